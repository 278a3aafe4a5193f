/* rt_choices.c: a request with several choices (n > 1, batched prompts) as child requests on
 * the loop: fan-out at admission, the join's bookkeeping as children retire, and the end of
 * the whole request when one of them fails or the client leaves (rt_choices.h). The bytes of
 * the joined response are rt_stream.c's. Loop thread only. */
#include <stdlib.h>
#include <string.h>

#include "rt_choices.h"
#include "rt_loop_int.h"
#include "td_clock.h"
#include "td_err.h"

bool rt_choices_many(const rt_req *q)
{
    return !q->ch.parent && (q->p.n > 1 || q->p.best_of > 1 || q->p.n_more > 0);
}

/* Children per prompt: best_of candidates, or n choices. */
static int per_prompt(const rt_params *p)
{
    return p->best_of > p->n ? p->best_of : p->n > 1 ? p->n : 1;
}

/* Child (prompt i, choice c) of parent q: a plain request that borrows q's parameters. */
static rt_req *make_child(const rt_req *q, int i, int c)
{
    rt_req *k = rt_req_create();
    if (!k) return NULL;
    memcpy(k->oid, q->oid, sizeof k->oid);
    k->created = q->created;
    k->t_arrive_ms = q->t_arrive_ms;
    k->expires_ms = q->expires_ms;
    k->client = q->client;
    k->p = q->p; /* borrowed: rt_req_release frees no child's p */
    if (i > 0) {
        k->p.prompt = q->p.more[i - 1].ids;
        k->p.n_prompt = q->p.more[i - 1].n;
        k->p.max_tokens = q->p.more[i - 1].max_tokens;
    }
    k->p.more = NULL;
    k->p.n_more = 0;
    k->p.n = 1;
    k->p.best_of = 0;
    k->p.sampling.seed = q->p.sampling.seed + (uint64_t)c;
    k->ch.parent = (rt_req *)q;
    k->ch.index = i * per_prompt(&q->p) + c;
    k->loop.state = RT_ST_DONE; /* in the loop once admitted */
    return k;
}

static int make_children(rt_req *q, rt_error *e)
{
    int n = per_prompt(&q->p), total = n * (1 + q->p.n_more);
    q->ch.kids = calloc((size_t)total, sizeof *q->ch.kids);
    if (!q->ch.kids) return rt_error_set(e, 500, NULL, NULL, "out of memory");
    for (int i = 0; i <= q->p.n_more; i++)
        for (int c = 0; c < n; c++) {
            rt_req *k = make_child(q, i, c);
            if (!k) return rt_error_set(e, 500, NULL, NULL, "out of memory");
            q->ch.kids[q->ch.n_kids++] = k;
        }
    q->ch.n_out = q->ch.n_kids;
    return 0;
}

int rt_choices_admit(rt_router *r, rt_req *q, rt_error *e)
{
    int rc = make_children(q, e);
    if (rc) return rc;
    int total = q->ch.n_kids, max = r->cfg->router.max_queue;
    if (r->fair.len + total > max)
        return rt_error_set(e, 429, NULL, "queue_full",
                            "the router queue cannot take the %d choices of this request now "
                            "(%d of its %d places are taken)",
                            total, r->fair.len, max);
    for (int i = 0; i < total; i++) {
        int err = rt_table_add(&r->table, q->ch.kids[i]);
        if (err) {
            while (i-- > 0)
                rt_table_remove(&r->table, q->ch.kids[i]);
            return rt_error_set(e, 500, NULL, NULL, "cannot track the request: %s",
                                td_strerror(err));
        }
    }
    for (int i = 0; i < total; i++) {
        rt_req *k = q->ch.kids[i];
        rt_req_retain(k); /* the loop's, until rt_loop_retire */
        k->loop.state = RT_ST_QUEUED;
        rt_fair_push(&r->fair, k);
    }
    q->ch.n_live = total;
    atomic_fetch_add(&r->queued, total - 1); /* the children take the parent's place */
    return 0;
}

/* Cancel and retire every child of q still in the loop (q failed: its response holds the
 * error already). */
static void sweep(rt_router *r, rt_req *q, int status, const char *code)
{
    q->ch.failed = true;
    q->ch.sweeping = true;
    int64_t now = td_now_ms();
    for (int i = 0; i < q->ch.n_kids; i++) {
        rt_req *k = q->ch.kids[i];
        if (k->loop.state == RT_ST_DONE) continue;
        rt_loop_cancel_decode_side(r, k);
        rt_metrics_request_end(&r->metrics, r->cfg, k, now, status, code);
        rt_loop_retire(r, k);
    }
    q->ch.sweeping = false;
}

/* The cumulative logprob of k's generated tokens (those it received; vLLM's
 * cumulative_logprob less the end-of-generation token, which is not answered). */
static double cumulative_logprob(const rt_req *k)
{
    double s = 0;
    for (int i = 0; i < k->loop.n_lps; i++)
        s += k->loop.lps[i].logprob;
    return s;
}

static int by_prompt_then_logprob(const void *a, const void *b)
{
    const rt_req *x = *(rt_req *const *)a, *y = *(rt_req *const *)b;
    int per = per_prompt(&x->ch.parent->p);
    int px = x->ch.index / per, py = y->ch.index / per;
    if (px != py) return px < py ? -1 : 1;
    double lx = cumulative_logprob(x), ly = cumulative_logprob(y);
    if (lx != ly) return lx > ly ? -1 : 1;
    return x->ch.index < y->ch.index ? -1 : 1; /* ties: the lower candidate first */
}

/* best_of: each prompt's candidates in decreasing cumulative logprob; its n first are the
 * answer, indexed prompt * n + rank, in kids[0 .. n_out); the others follow, unanswered. */
static void rank(rt_req *q)
{
    int per = per_prompt(&q->p), n = q->p.n > 1 ? q->p.n : 1, out = 0;
    qsort(q->ch.kids, (size_t)q->ch.n_kids, sizeof *q->ch.kids, by_prompt_then_logprob);
    for (int i = 0; i < q->ch.n_kids; i++) {
        if (i % per >= n) continue;
        /* a stable partition in place (a few dozen children): kids[out] <- kids[i] */
        rt_req *k = q->ch.kids[i];
        memmove(q->ch.kids + out + 1, q->ch.kids + out, (size_t)(i - out) * sizeof *q->ch.kids);
        k->ch.index = (i / per) * n + i % per;
        q->ch.kids[out++] = k;
    }
    q->ch.n_out = out;
}

/* q's last child left: end the response if every child finished, drop the loop's
 * reference (q may be freed). */
static void end(rt_router *r, rt_req *q)
{
    if (!q->ch.failed && q->p.best_of > q->p.n) rank(q);
    if (!q->ch.failed) {
        int rc = rt_stream_close(r, q);
        if (rc) TD_LOG_ERR("router: %s: cannot write the response: %s", q->oid, td_strerror(rc));
    }
    rt_req_release(q);
}

void rt_choices_retired(rt_router *r, rt_req *k)
{
    rt_req *q = k->ch.parent;
    q->ch.n_live--;
    if (q->ch.sweeping) return;
    if (!k->ch.finished && !q->ch.failed) {
        /* its error is the response already (rt_stream_fail), unless it ended without one */
        rt_error e;
        rt_error_set(&e, 500, NULL, NULL, "internal error while writing choice %d", k->ch.index);
        rt_stream_fail(q, &e);
        TD_LOG_INFO("router: %s: choice %d failed: the request ends, its %d other live "
                    "choice(s) are cancelled",
                    q->oid, k->ch.index, q->ch.n_live);
        sweep(r, q, q->http.status ? q->http.status : 500, "choice_failed");
    }
    if (q->ch.n_live == 0) end(r, q);
}

void rt_choices_abort(rt_router *r, rt_req *q, int status, const char *code, const char *msg)
{
    if (q->ch.failed || q->ch.n_live == 0) return;
    rt_error e;
    rt_error_set(&e, status, NULL, code, "%s", msg);
    rt_stream_fail(q, &e);
    rt_req_retain(q); /* the last child's retirement drops the loop's reference */
    sweep(r, q, status, code);
    if (q->ch.n_live == 0) end(r, q);
    rt_req_release(q);
}
