/* rt_loop.c: the router loop thread. It alone owns the control-plane clients (one per
 * decode and prefill instance, via rt_registry), the request table and the router queue,
 * and it takes every scheduling decision. The HTTP threads only post to its inbox (new
 * requests, closed connections) and wake it through an eventfd; it answers through
 * rt_req's shared fields and resumes the connection (rt_req_wake).
 *
 * One iteration: poll(wake fd, client fds, <= 50 ms) -> take the inbox (admit: queue or
 * 429/503; closed connections: cancel) -> drain every client (replies, token events,
 * health; prefill instances' through rt_pair.c) -> liveness (fail the requests of
 * instances silent for instance_timeout_ms) -> request deadlines (504) -> attempt
 * deadlines (disaggregated) -> heartbeats -> dispatch queued requests, round robin over
 * clients (rt_fair.c), to rt_reg_pick's choice (and, disaggregated, rt_reg_pick_prefill's)
 * -> poke idle suspended connections (so a client that went away is noticed).
 *
 * Stop (rt_loop_stop, after the drain in rt_main.c): every request still open ends with
 * 503 shutting_down and is cancelled on its instances; then a health call to each
 * instance that got a Cancel serves as a barrier (the node answers it only after reading
 * what came before it on the connection), waited for up to FLUSH_MS, so the Cancels are
 * not lost when the sockets close. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <microhttpd.h>

#include "rt.h"
#include "td_err.h"

#define SUBMIT_TIMEOUT_MS 10000
#define CANCEL_TIMEOUT_MS 5000
#define MAX_RETRIES       3
#define FLUSH_MS          500 /* stop: wait this long at most for the Cancels to arrive */

/* ---- rt_req lifetime ---- */

rt_req *rt_req_create(void)
{
    rt_req *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    pthread_mutex_init(&q->mu, NULL);
    q->refs = 1;
    q->fd = -1;
    q->inst = -1;
    q->pinst = -1;
    q->pf_avoid = -1;
    q->fslot = -1;
    return q;
}

void rt_req_retain(rt_req *q)
{
    pthread_mutex_lock(&q->mu);
    q->refs++;
    pthread_mutex_unlock(&q->mu);
}

void rt_req_release(rt_req *q)
{
    if (!q) return;
    pthread_mutex_lock(&q->mu);
    int left = --q->refs;
    pthread_mutex_unlock(&q->mu);
    if (left) return;
    rt_params_fini(&q->p);
    if (q->dt_init) td_detok_fini(&q->dt);
    rt_buf_free(&q->held);
    rt_buf_free(&q->text);
    rt_buf_free(&q->out);
    free(q->gen_ids);
    free(q->resume);
    for (size_t i = 0; i < q->n_targets; i++)
        free(q->targets[i].data);
    free(q->targets);
    pthread_mutex_destroy(&q->mu);
    free(q);
}

void rt_req_wake(rt_req *q)
{
    struct MHD_Connection *conn = NULL;
    pthread_mutex_lock(&q->mu);
    if (q->suspended && !q->http_gone) {
        q->suspended = false;
        conn = q->conn;
    }
    pthread_mutex_unlock(&q->mu);
    /* the connection cannot complete while suspended, so conn is still valid here */
    if (conn) MHD_resume_connection(conn);
}

/* ---- inbox (HTTP threads) ---- */

static void wake_loop(rt_router *r)
{
    uint64_t one = 1;
    ssize_t w = write(r->wake_fd, &one, sizeof one);
    (void)w; /* the counter saturating still leaves the fd readable */
}

bool rt_loop_post(rt_router *r, rt_req *q)
{
    pthread_mutex_lock(&r->in_mu);
    if (r->closing) {
        pthread_mutex_unlock(&r->in_mu);
        return false;
    }
    q->refs++; /* nobody else knows q yet */
    q->state = RT_ST_INBOX;
    atomic_fetch_add(&r->queued, 1);
    pthread_mutex_lock(&q->mu);
    q->suspended = true;
    MHD_suspend_connection(q->conn);
    pthread_mutex_unlock(&q->mu);
    q->next = NULL;
    if (r->in_tail)
        r->in_tail->next = q;
    else
        r->in_head = q;
    r->in_tail = q;
    pthread_mutex_unlock(&r->in_mu);
    wake_loop(r);
    return true;
}

void rt_loop_gone(rt_router *r, rt_req *q)
{
    rt_req_retain(q);
    pthread_mutex_lock(&r->in_mu);
    q->gone_next = r->gone_head;
    r->gone_head = q;
    pthread_mutex_unlock(&r->in_mu);
    wake_loop(r);
}

/* ---- request endings (loop thread) ---- */

static void queue_remove(rt_router *r, rt_req *q)
{
    if (q->fslot < 0) return;
    rt_fair_remove(&r->fair, q);
    atomic_fetch_sub(&r->queued, 1);
}

static void send_cancel(rt_router *r, rt_req *q)
{
    if (q->inst < 0 || !q->rid) return;
    uint64_t call;
    td_ctrl_client_cancel(r->reg.inst[q->inst].c, q->rid, CANCEL_TIMEOUT_MS, &call);
}

void rt_loop_cancel_decode(rt_router *r, rt_req *q)
{
    send_cancel(r, q);
}

/* Cancel q's decode side if the instance may hold it: colocated, also while the Submit is
 * unanswered (the Cancel follows it on the same connection); disaggregated, an unanswered
 * Alloc is cancelled when its reply comes (rt_pair_orphan_alloc), once q is out of the
 * table. The prefill side is retire's (rt_pair_release). */
static void cancel_decode_side(rt_router *r, rt_req *q)
{
    if (q->state == RT_ST_RUNNING || (q->state == RT_ST_SUBMITTED && !r->disagg)) send_cancel(r, q);
}

/* Take q out of the loop's structures and drop the loop's reference. */
static void retire(rt_router *r, rt_req *q)
{
    if (q->state == RT_ST_QUEUED) queue_remove(r, q);
    if (r->disagg) rt_pair_release(r, q);
    rt_table_remove(&r->table, q);
    if (q->inst >= 0 && (q->state == RT_ST_SUBMITTED || q->state == RT_ST_RUNNING))
        r->reg.inst[q->inst].active--;
    q->state = RT_ST_DONE;
    rt_req_release(q);
}

static void finish(rt_router *r, rt_req *q, rt_finish fin)
{
    int rc = rt_stream_finish(r, q, fin);
    if (rc) TD_LOG_ERR("router: %s: cannot write the response: %s", q->oid, td_strerror(rc));
    rt_metrics_request_end(r, q, td_ctrl_now_ms(), rc && !q->p.stream ? 500 : 200,
                           fin == RT_FIN_LENGTH && !q->stop_hit ? "length" : "stop");
    retire(r, q);
}

static void fail(rt_router *r, rt_req *q, int status, const char *code, const char *msg)
{
    rt_error e;
    rt_error_set(&e, status, NULL, code, "%s", msg);
    if (status >= 500) TD_LOG_WARN("router: %s: %s", q->oid, msg);
    rt_stream_fail(q, &e);
    rt_metrics_request_end(r, q, td_ctrl_now_ms(), status, code);
    retire(r, q);
}

void rt_loop_retire(rt_router *r, rt_req *q)
{
    retire(r, q);
}

void rt_loop_fail(rt_router *r, rt_req *q, int status, const char *code, const char *msg)
{
    fail(r, q, status, code, msg);
}

static void requeue_front(rt_router *r, rt_req *q)
{
    if (q->inst >= 0) r->reg.inst[q->inst].active--;
    q->inst = -1;
    q->state = RT_ST_QUEUED;
    q->retries++;
    rt_fair_push_front(&r->fair, q);
    atomic_fetch_add(&r->queued, 1);
}

void rt_loop_requeue(rt_router *r, rt_req *q)
{
    requeue_front(r, q);
}

/* ---- migration: a request whose decode side was lost ---- */

int32_t *rt_req_prompt(const rt_req *q, size_t *n)
{
    *n = q->resume ? q->n_resume : q->p.n_prompt;
    return q->resume ? q->resume : q->p.prompt;
}

/* The next attempt's prompt: p.prompt followed by every token received so far. */
static int make_resume(rt_req *q)
{
    q->gen_base = q->n_gen;
    if (!q->n_gen) return 0;
    size_t n = q->p.n_prompt + (size_t)q->n_gen;
    int32_t *ids = realloc(q->resume, n * sizeof *ids);
    if (!ids) return TD_ENOMEM;
    memcpy(ids, q->p.prompt, q->p.n_prompt * sizeof *ids);
    memcpy(ids + q->p.n_prompt, q->gen_ids, (size_t)q->n_gen * sizeof *ids);
    q->resume = ids;
    q->n_resume = n;
    return 0;
}

static void lose(rt_router *r, rt_req *q, const char *why, int64_t now)
{
    const td_cfg_router *rc = &r->cfg->router;
    if (r->disagg) {
        rt_pair_abandon(r, q); /* cancels both sides; q->inst is -1 after */
    } else {
        if (q->state == RT_ST_SUBMITTED || q->state == RT_ST_RUNNING) send_cancel(r, q);
        if (q->inst >= 0) r->reg.inst[q->inst].active--;
        q->inst = -1;
    }
    if (q->n_gen >= q->p.max_tokens) { /* lost after its last token, before the finish */
        finish(r, q, RT_FIN_LENGTH);
        return;
    }
    char no[160] = "";
    if (q->n_gen > 0 && q->p.no_migrate)
        snprintf(no, sizeof no, "the request asked not to move (\"migrate\": false)");
    else if (!rc->max_migrations)
        snprintf(no, sizeof no, "router.max_migrations is 0");
    else if (q->migrations >= rc->max_migrations)
        snprintf(no, sizeof no, "it moved %d times already (router.max_migrations)", q->migrations);
    else if (make_resume(q))
        snprintf(no, sizeof no, "out of memory");
    if (no[0]) {
        char msg[600];
        snprintf(msg, sizeof msg, "%s after %d tokens; the request cannot move: %s", why, q->n_gen,
                 no);
        fail(r, q, 503, "instance_unavailable", msg);
        return;
    }
    if (!r->disagg) {
        /* a fresh id: late events of the lost attempt must not match the next one (the
           disaggregated attempt takes its own in rt_pair_start) */
        rt_table_remove(&r->table, q);
        int err = rt_table_add(&r->table, q);
        if (err) {
            fail(r, q, 500, NULL, "cannot track the request");
            return;
        }
    }
    q->migrations++;
    if (!q->lost_ms) q->lost_ms = now;
    /* a fresh start for the disaggregated attempt: any prefill instance, one retry */
    q->pf_retried = false;
    q->pf_avoid = -1;
    q->pf_same_ok = false;
    q->busy = 0;
    TD_LOG_INFO("router: %s: %s after %d tokens: moving it (move %d of %d), it goes on from "
                "token %d",
                q->oid, why, q->n_gen, q->migrations, rc->max_migrations, q->n_gen);
    rt_metrics_migration(&r->metrics);
    q->state = RT_ST_QUEUED;
    rt_fair_push_front(&r->fair, q);
    atomic_fetch_add(&r->queued, 1);
}

void rt_loop_lose(rt_router *r, rt_req *q, const char *why, int64_t now)
{
    lose(r, q, why, now);
}

/* Every request on decode instance i lost its decode side. */
static void lose_all(rt_router *r, int i, const char *why, int64_t now)
{
    for (uint32_t k = 0; k < r->table.cap; k++) {
        rt_req *q = r->table.slots[k];
        if (q && q->inst == i && (q->state == RT_ST_SUBMITTED || q->state == RT_ST_RUNNING))
            lose(r, q, why, now);
    }
}

/* ---- admission and dispatch ---- */

/* q never got into the queue: answer e, drop the loop's reference. */
static void refuse(rt_router *r, rt_req *q, const rt_error *e)
{
    atomic_fetch_sub(&r->queued, 1);
    q->state = RT_ST_DONE;
    rt_stream_fail(q, e);
    rt_metrics_request_end(r, q, td_ctrl_now_ms(), e->status, e->code);
    rt_req_release(q);
}

static void admit(rt_router *r, rt_req *q)
{
    rt_error e;
    bool no_pf = r->disagg && atomic_load(&r->n_pf_alive) == 0;
    if (atomic_load(&r->n_alive) == 0 || no_pf) {
        rt_error_set(&e, 503, NULL, "no_instance", "no %s instance is available",
                     no_pf ? "prefill" : "decode");
        refuse(r, q, &e);
        return;
    }
    int max = r->cfg->router.max_queue;
    if (r->fair.len >= max) {
        /* full: the client holding the most queued requests gives one up, unless that
           is the newcomer's own client (then the newcomer is refused) */
        rt_req *v = rt_fair_victim(&r->fair, q->client);
        if (!v) {
            rt_error_set(&e, 429, NULL, "queue_full", "the router queue is full (%d requests)",
                         max);
            refuse(r, q, &e);
            return;
        }
        rt_error_set(&e, 429, NULL, "queue_full",
                     "the router queue is full (%d requests) and this client holds the most "
                     "of them",
                     max);
        TD_LOG_DEBUG("router: %s: queue full: refused for a client with fewer requests", v->oid);
        rt_metrics_eviction(&r->metrics);
        rt_stream_fail(v, &e);
        rt_metrics_request_end(r, v, td_ctrl_now_ms(), 429, "queue_full");
        retire(r, v);
    }
    int rc = rt_table_add(&r->table, q);
    if (rc) {
        rt_error_set(&e, 500, NULL, NULL, "cannot track the request: %s", td_strerror(rc));
        refuse(r, q, &e);
        return;
    }
    q->state = RT_ST_QUEUED;
    rt_fair_push(&r->fair, q); /* r->queued already counts it */
}

void rt_req_submit_msg(const rt_req *q, Td__Sampling *sm, Td__Submit *sub)
{
    td_sampling s = q->p.sampling;
    s.skip_samples = (uint32_t)q->gen_base; /* a moved request: the draws already made */
    td_ctrl_sampling_to_pb(&s, sm);
    td__submit__init(sub);
    sub->request_id = q->rid;
    sub->token_ids = rt_req_prompt(q, &sub->n_token_ids);
    sub->sampling = sm;
    sub->max_tokens = (uint32_t)(q->p.max_tokens - q->gen_base);
    sub->ignore_eos = q->p.ignore_eos;
}

static int submit(rt_router *r, rt_req *q, int i)
{
    rt_inst *s = &r->reg.inst[i];
    Td__Sampling sm;
    Td__Submit sub;
    rt_req_submit_msg(q, &sm, &sub);
    int rc = td_ctrl_client_submit(s->c, &sub, SUBMIT_TIMEOUT_MS, &q->call_id);
    if (rc) return rc;
    q->inst = i;
    q->state = RT_ST_SUBMITTED;
    s->active++;
    return 0;
}

static void dispatch(rt_router *r, int64_t now)
{
    rt_req *q;
    while ((q = rt_fair_peek(&r->fair))) {
        int i = rt_reg_pick(&r->reg, now);
        if (i < 0) return;
        int p = -1;
        if (r->disagg) {
            p = rt_reg_pick_prefill(&r->reg, now, q->pf_avoid);
            if (p < 0 && q->pf_avoid >= 0 && q->pf_same_ok &&
                !rt_reg_n_pf_alive(&r->reg, q->pf_avoid))
                p = rt_reg_pick_prefill(&r->reg, now, -1); /* a timeout: the same one may retry */
            if (p < 0) {
                if (rt_pair_unservable(r, q)) continue; /* failed; next in the queue */
                return;
            }
        }
        rt_fair_pop(&r->fair);
        atomic_fetch_sub(&r->queued, 1);
        q->state = RT_ST_INBOX; /* off the queue, not yet submitted */
        int rc = r->disagg ? rt_pair_start(r, q, i, p, now) : submit(r, q, i);
        if (rc) {
            q->state = RT_ST_DONE;
            rt_table_remove(&r->table, q);
            rt_error e;
            rt_error_set(&e, 500, NULL, NULL, "cannot send the request: %s", td_strerror(rc));
            TD_LOG_ERR("router: %s: %s", q->oid, e.message);
            rt_stream_fail(q, &e);
            rt_metrics_request_end(r, q, now, 500, NULL);
            rt_req_release(q);
        }
    }
}

/* ---- control-plane input ---- */

static rt_req *find_call(rt_router *r, int i, uint64_t call_id)
{
    /* replies to Submit: the request is in the table with that call id on instance i */
    for (uint32_t k = 0; k < r->table.cap; k++) {
        rt_req *q = r->table.slots[k];
        if (q && q->inst == i && q->state == RT_ST_SUBMITTED && q->call_id == call_id) return q;
    }
    return NULL;
}

static void on_reply(rt_router *r, int i, const td_ctrl_client_in *in, int64_t now)
{
    rt_inst *s = &r->reg.inst[i];
    if (in->call_id == s->hb_call) {
        s->hb_call = 0;
        if (!in->err && in->env && in->env->body_case == TD__ENVELOPE__BODY_HEALTH) {
            if (rt_reg_seen(s, in->env->health, now))
                TD_LOG_INFO("router: decode instance %s (%s) is serving", s->name, s->url);
        }
        return;
    }
    if (!in->err) rt_reg_seen(s, NULL, now);
    rt_req *q = find_call(r, i, in->call_id);
    if (!q) {
        /* a Cancel's answer, or a request that ended meanwhile; an Alloc's reservation of
           an attempt that ended must not stay behind */
        if (!in->err && in->env && in->env->body_case == TD__ENVELOPE__BODY_ALLOC_REPLY)
            rt_pair_orphan_alloc(r, i, in->env);
        return;
    }
    if (r->disagg) {
        rt_pair_on_alloc(r, q, i, in, now);
        return;
    }
    if (in->err) {
        /* no answer in time: the instance is probably going away */
        if (q->retries < MAX_RETRIES) {
            q->retries++;
            lose(r, q, "the decode instance did not answer", now);
        } else {
            fail(r, q, 503, "instance_unavailable", "the decode instance did not answer");
        }
        return;
    }
    const Td__Envelope *env = in->env;
    if (env->body_case == TD__ENVELOPE__BODY_ACK) {
        q->state = RT_ST_RUNNING;
        return;
    }
    if (env->body_case != TD__ENVELOPE__BODY_ERROR) {
        fail(r, q, 500, NULL, "unexpected reply from the decode instance");
        return;
    }
    const Td__ErrorEvent *err = env->error;
    switch (err->code) {
    case TD__ERROR_CODE__ERR_BUSY:
        s->busy_until_ms = now + 100;
        if (q->retries < 100) {
            q->retries--; /* busy is not a failure */
            requeue_front(r, q);
            return;
        }
        fail(r, q, 503, "instance_busy", err->message);
        return;
    case TD__ERROR_CODE__ERR_NO_SPACE:
    case TD__ERROR_CODE__ERR_INVALID: {
        rt_error e;
        rt_error_set(&e, 400, NULL, NULL, "%s", err->message);
        rt_stream_fail(q, &e);
        rt_metrics_request_end(r, q, now, 400, NULL);
        retire(r, q);
        return;
    }
    case TD__ERROR_CODE__ERR_SHUTDOWN:
    case TD__ERROR_CODE__ERR_PEER_FAILED:
        lose(r, q, err->message, now); /* elsewhere, or the same one once it re-formed */
        return;
    default:
        fail(r, q, 500, NULL, err->message);
        return;
    }
}

/* Append ids to q->gen_ids (what a moved request resumes from). */
static int keep_ids(rt_req *q, const int32_t *ids, size_t n)
{
    if (!n) return 0;
    size_t need = (size_t)q->n_gen + n;
    if (need > (size_t)q->cap_gen) {
        size_t cap = q->cap_gen ? 2 * (size_t)q->cap_gen : 64;
        while (cap < need)
            cap *= 2;
        int32_t *g = realloc(q->gen_ids, cap * sizeof *g);
        if (!g) return TD_ENOMEM;
        q->gen_ids = g;
        q->cap_gen = (int)cap;
    }
    memcpy(q->gen_ids + q->n_gen, ids, n * sizeof *ids); /* n_gen grows in rt_stream_tokens */
    return 0;
}

static void on_token(rt_router *r, int i, const Td__TokenEvent *t, int64_t now)
{
    rt_req *q = rt_table_get(&r->table, t->request_id);
    if (!q || q->inst != i || (q->state != RT_ST_SUBMITTED && q->state != RT_ST_RUNNING)) return;
    q->state = RT_ST_RUNNING;
    if (t->n_token_ids) {
        if (!q->t_first_ms) q->t_first_ms = now;
        q->t_last_ms = now;
        if (q->lost_ms) {
            TD_LOG_INFO("router: %s: moved: the stream goes on %lld ms after its decode side "
                        "was lost",
                        q->oid, (long long)(now - q->lost_ms));
            rt_metrics_migrated(&r->metrics, (double)(now - q->lost_ms) / 1000.0);
            q->lost_ms = 0;
        }
    }
    int rc = keep_ids(q, t->token_ids, t->n_token_ids);
    if (!rc) rc = rt_stream_tokens(r, q, t->token_ids, t->n_token_ids);
    if (rc < 0) {
        TD_LOG_ERR("router: %s: cannot process tokens: %s", q->oid, td_strerror(rc));
        send_cancel(r, q);
        fail(r, q, 500, NULL, "internal error while detokenizing");
        return;
    }
    if (rc == RT_FIN_STOP) {
        if (t->finish == TD__FINISH_REASON__FINISH_NONE) send_cancel(r, q);
        finish(r, q, RT_FIN_STOP);
        return;
    }
    switch (t->finish) {
    case TD__FINISH_REASON__FINISH_NONE:
        return;
    case TD__FINISH_REASON__FINISH_STOP:
        /* the instance does not send the end-of-generation token but counts it */
        if (t->usage && (int64_t)t->usage->completion_tokens + q->gen_base > q->n_gen)
            q->n_gen = (int)t->usage->completion_tokens + q->gen_base;
        finish(r, q, RT_FIN_STOP);
        return;
    case TD__FINISH_REASON__FINISH_LENGTH:
        finish(r, q, RT_FIN_LENGTH);
        return;
    case TD__FINISH_REASON__FINISH_CANCELLED:
        fail(r, q, 503, "cancelled", "the request was cancelled by the decode instance");
        return;
    default:
        fail(r, q, 500, NULL, "the request failed on the decode instance");
        return;
    }
}

static void on_events(rt_router *r, int i, const td_ctrl_client_in *in, int64_t now)
{
    rt_inst *s = &r->reg.inst[i];
    if (rt_reg_seen(s, in->health, now))
        TD_LOG_INFO("router: decode instance %s (%s) is serving", s->name, s->url);
    for (size_t k = 0; k < in->n_events; k++) {
        const Td__Event *ev = in->events[k];
        if (ev->body_case == TD__EVENT__BODY_TOKEN) {
            on_token(r, i, ev->token, now);
        } else if (ev->body_case == TD__EVENT__BODY_ERROR && ev->error->request_id) {
            rt_req *q = rt_table_get(&r->table, ev->error->request_id);
            if (!q || q->inst != i) continue;
            if (r->disagg)
                rt_pair_on_decode_error(r, q, ev->error, now);
            else if (rt_code_lost(ev->error->code))
                lose(r, q, ev->error->message, now);
            else
                fail(r, q, 500, NULL, ev->error->message);
        }
    }
}

bool rt_code_lost(int code)
{
    return code == TD__ERROR_CODE__ERR_PEER_FAILED || code == TD__ERROR_CODE__ERR_SHUTDOWN;
}

/* Move every request on instance i (it stopped answering; lose cancels them there in case
 * it comes back with them still running). */
static void instance_died(rt_router *r, int i, int64_t now)
{
    rt_inst *s = &r->reg.inst[i];
    TD_LOG_WARN("router: decode instance %s (%s) silent for %d ms: marked dead", s->name, s->url,
                r->cfg->router.instance_timeout_ms);
    char why[300];
    snprintf(why, sizeof why, "decode instance %s stopped answering", s->name);
    lose_all(r, i, why, now);
}

/* A new process answers for decode instance i: what the old one held is gone. */
static void instance_restarted(rt_router *r, int i, int64_t now)
{
    rt_inst *s = &r->reg.inst[i];
    TD_LOG_WARN("router: decode instance %s (%s) restarted: moving its requests", s->name, s->url);
    char why[300];
    snprintf(why, sizeof why, "decode instance %s restarted", s->name);
    lose_all(r, i, why, now);
}

/* Did s just die? (alive, but not heard from within the timeout) */
static bool went_silent(rt_inst *s, int timeout, int64_t now)
{
    bool recent = s->ever_seen && now - s->last_seen_ms <= timeout;
    if (s->alive && !recent) {
        s->alive = false;
        return true;
    }
    s->alive = recent && s->ready;
    return false;
}

static void liveness(rt_router *r, int64_t now)
{
    int timeout = r->cfg->router.instance_timeout_ms;
    for (int i = 0; i < r->reg.n; i++)
        if (went_silent(&r->reg.inst[i], timeout, now)) instance_died(r, i, now);
    for (int j = 0; j < r->reg.n_pf; j++)
        if (went_silent(&r->reg.pf[j], timeout, now)) rt_pair_prefill_died(r, j);
    int n = rt_reg_n_alive(&r->reg);
    int n_pf = rt_reg_n_pf_alive(&r->reg, -1);
    atomic_store(&r->n_alive, n);
    atomic_store(&r->n_pf_alive, n_pf);
    /* Nobody can take the queue: answer it now rather than let clients hang; but a request
       that is moving waits up to router.migrate_wait_ms for an instance to come (back). */
    bool none = !n || (r->disagg && !n_pf);
    int wait = r->cfg->router.migrate_wait_ms;
    for (uint32_t k = 0; k < r->table.cap; k++) {
        rt_req *q = r->table.slots[k];
        if (!q || q->state != RT_ST_QUEUED) continue;
        if (q->lost_ms && now - q->lost_ms > wait) {
            char msg[300];
            snprintf(msg, sizeof msg,
                     "its decode instance was lost after %d tokens and no instance took the "
                     "request over within %d ms (router.migrate_wait_ms)",
                     q->n_gen, wait);
            fail(r, q, 503, "instance_unavailable", msg);
        } else if (none && !q->lost_ms) {
            fail(r, q, 503, "no_instance",
                 n ? "no prefill instance is available" : "no decode instance is available");
        }
    }
}

/* Requests past their deadline: cancelled on their instance(s), ended with 504 (an SSE
 * error event once streaming started; the text already sent stands, no finish_reason). */
static void expire(rt_router *r, int64_t now)
{
    static const char *const where_name[RT_TO_N] = {"queued", "waiting for its first token",
                                                    "generating"};
    for (uint32_t k = 0; k < r->table.cap; k++) {
        rt_req *q = r->table.slots[k];
        if (!q || !q->expires_ms || now < q->expires_ms) continue;
        rt_timeout_state where = q->state == RT_ST_QUEUED ? RT_TO_QUEUED
                                 : q->n_gen > 0           ? RT_TO_GENERATING
                                                          : RT_TO_WAITING;
        long long limit = (long long)(q->expires_ms - q->t_arrive_ms);
        TD_LOG_INFO("router: %s: its deadline of %lld ms passed while %s (tokens: %d): ended",
                    q->oid, limit, where_name[where], q->n_gen);
        rt_metrics_timeout(&r->metrics, where);
        cancel_decode_side(r, q);
        rt_error e;
        rt_error_set(&e, 504, NULL, "request_timeout",
                     "the request did not complete within its timeout of %lld ms (%s; tokens "
                     "generated: %d)",
                     limit, where_name[where], q->n_gen);
        rt_stream_fail(q, &e);
        rt_metrics_request_end(r, q, now, 504, "request_timeout");
        retire(r, q);
    }
}

static void publish_metrics(rt_router *r)
{
    rt_metrics *m = &r->metrics;
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < r->reg.n && i < m->n_inst; i++) {
        const rt_inst *s = &r->reg.inst[i];
        m->inst[i] = (rt_inst_gauge){.running = s->running,
                                     .waiting = s->waiting,
                                     .kv_used = s->kv_used,
                                     .kv_free = s->kv_free,
                                     .alive = s->alive};
    }
    for (int j = 0; j < r->reg.n_pf && j < m->n_pf; j++) {
        const rt_inst *s = &r->reg.pf[j];
        m->pf[j] = (rt_pf_gauge){.queued_tokens = s->queued_tokens,
                                 .running = s->running,
                                 .waiting = s->waiting,
                                 .active = s->active,
                                 .alive = s->alive};
    }
    m->queue = atomic_load(&r->queued);
    m->active = (int)r->table.count - r->fair.len;
    m->draining = atomic_load(&r->draining);
    pthread_mutex_unlock(&m->mu);
}

static void take_inbox(rt_router *r)
{
    uint64_t v;
    ssize_t rd = read(r->wake_fd, &v, sizeof v);
    (void)rd;
    pthread_mutex_lock(&r->in_mu);
    rt_req *nq = r->in_head, *gone = r->gone_head;
    r->in_head = r->in_tail = NULL;
    r->gone_head = NULL;
    pthread_mutex_unlock(&r->in_mu);
    while (nq) {
        rt_req *next = nq->next;
        nq->next = NULL;
        admit(r, nq);
        nq = next;
    }
    while (gone) {
        rt_req *next = gone->gone_next;
        if (gone->state == RT_ST_SUBMITTED || gone->state == RT_ST_RUNNING) {
            send_cancel(r, gone);
            rt_metrics_request_end(r, gone, td_ctrl_now_ms(), 499, "client_closed");
            retire(r, gone);
        } else if (gone->state == RT_ST_QUEUED) {
            rt_metrics_request_end(r, gone, td_ctrl_now_ms(), 499, "client_closed");
            retire(r, gone);
        }
        rt_req_release(gone); /* the reference rt_loop_gone took */
        gone = next;
    }
}

/* Did the client of a suspended connection close it? MHD reads nothing from a connection
 * whose request is complete until the response writes, so a client that leaves before
 * its first byte (a long queue wait, a slow prefill) would otherwise go unnoticed. The fd
 * cannot be closed under us: the connection cannot complete while suspended, and it is
 * resumed only under q->mu (rt_req_wake). A half-close (FIN after the request) counts as
 * gone, as it does for every HTTP server that checks. */
static bool client_closed(rt_req *q)
{
    bool closed = false;
    pthread_mutex_lock(&q->mu);
    if (q->suspended && !q->http_gone && q->fd >= 0) {
        char c;
        ssize_t n = recv(q->fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        closed = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    }
    pthread_mutex_unlock(&q->mu);
    return closed;
}

static void poke(rt_router *r)
{
    for (uint32_t k = 0; k < r->table.cap; k++) {
        rt_req *q = r->table.slots[k];
        if (!q) continue;
        if (client_closed(q)) {
            TD_LOG_DEBUG("router: %s: the client closed its connection: cancelled", q->oid);
            if (q->state == RT_ST_SUBMITTED || q->state == RT_ST_RUNNING) send_cancel(r, q);
            rt_error e; /* never seen: it makes MHD write, fail and complete the connection */
            rt_error_set(&e, 499, NULL, NULL, "the client closed the connection");
            rt_stream_fail(q, &e);
            rt_metrics_request_end(r, q, td_ctrl_now_ms(), 499, "client_closed");
            retire(r, q);
            continue;
        }
        rt_req_wake(q);
    }
}

/* Wait up to wait_ms for the wake fd or any control client (fds: 1 + n + n_pf). */
static void wait_input(rt_router *r, struct pollfd *fds, int wait_ms)
{
    int n = r->reg.n, n_pf = r->reg.n_pf;
    fds[0] = (struct pollfd){.fd = r->wake_fd, .events = POLLIN};
    for (int i = 0; i < n; i++)
        fds[i + 1] = (struct pollfd){.fd = td_ctrl_client_fd(r->reg.inst[i].c), .events = POLLIN};
    for (int j = 0; j < n_pf; j++)
        fds[n + j + 1] = (struct pollfd){.fd = td_ctrl_client_fd(r->reg.pf[j].c), .events = POLLIN};
    poll(fds, (nfds_t)(n + n_pf) + 1, wait_ms);
}

/* Everything the control clients have: replies, events, health. */
static void read_instances(rt_router *r, int64_t now)
{
    for (int i = 0; i < r->reg.n; i++) {
        rt_inst *s = &r->reg.inst[i];
        while (td_ctrl_client_recv(s->c, &s->in, 0) == 0) {
            r->t_events_ns = rt_now_ns();
            if (s->in.kind == TD_CTRL_IN_REPLY)
                on_reply(r, i, &s->in, now);
            else if (s->in.kind == TD_CTRL_IN_EVENTS)
                on_events(r, i, &s->in, now);
            else if (s->in.kind == TD_CTRL_IN_RESTARTED)
                instance_restarted(r, i, now);
        }
    }
    for (int j = 0; j < r->reg.n_pf; j++) {
        rt_inst *s = &r->reg.pf[j];
        while (td_ctrl_client_recv(s->c, &s->in, 0) == 0) {
            if (s->in.kind == TD_CTRL_IN_REPLY)
                rt_pair_on_reply(r, j, &s->in, now);
            else if (s->in.kind == TD_CTRL_IN_EVENTS)
                rt_pair_on_events(r, j, &s->in, now);
            else if (s->in.kind == TD_CTRL_IN_RESTARTED)
                rt_pair_prefill_restarted(r, j, now);
        }
    }
}

static rt_inst *inst_at(rt_router *r, int k) /* decode instances, then prefill instances */
{
    return k < r->reg.n ? &r->reg.inst[k] : &r->reg.pf[k - r->reg.n];
}

/* Stop: end every open request (503, cancelled on its instances), then wait up to
 * FLUSH_MS for a health answer from each alive instance that got a Cancel: it comes after
 * the node read the Cancels. A node that never answers (stopped, gone) still drops a
 * vanished client's requests by itself (TD_CTRL_IN_PEER_GONE). */
static void stop_all(rt_router *r, struct pollfd *fds)
{
    int n_all = r->reg.n + r->reg.n_pf;
    bool *told = calloc((size_t)n_all + 1, sizeof *told);
    take_inbox(r);
    for (uint32_t k = 0; k < r->table.cap; k++) {
        rt_req *q = r->table.slots[k];
        if (!q) continue;
        if (told && q->inst >= 0) told[q->inst] = true;
        if (told && q->pf_busy && q->pinst >= 0) told[r->reg.n + q->pinst] = true;
        send_cancel(r, q);
        fail(r, q, 503, "shutting_down", "the router is shutting down");
    }
    if (!told) return;
    int waiting = 0;
    for (int k = 0; k < n_all; k++) {
        rt_inst *s = inst_at(r, k);
        s->hb_call = 0;
        if (!told[k] || !s->alive) continue;
        /* its own timeout later than ours: a timeout answer must not pass for the barrier */
        if (td_ctrl_client_health(s->c, 2 * FLUSH_MS, &s->hb_call))
            told[k] = false;
        else
            waiting++;
    }
    int64_t end = td_ctrl_now_ms() + FLUSH_MS;
    while (waiting > 0 && td_ctrl_now_ms() < end) {
        wait_input(r, fds, 10);
        read_instances(r, td_ctrl_now_ms()); /* on_reply clears hb_call */
        waiting = 0;
        for (int k = 0; k < n_all; k++)
            waiting += told[k] && inst_at(r, k)->hb_call != 0;
    }
    if (waiting) TD_LOG_WARN("router: %d instance(s) did not confirm the last cancels", waiting);
    free(told);
}

static void *loop_main(void *arg)
{
    rt_router *r = arg;
    struct pollfd *fds = calloc((size_t)(r->reg.n + r->reg.n_pf) + 1, sizeof *fds);
    if (!fds) {
        TD_LOG_ERR("router: out of memory in the loop");
        return NULL;
    }
    int64_t last_poke = td_ctrl_now_ms();
    while (!atomic_load(&r->stop)) {
        wait_input(r, fds, r->cfg->router.heartbeat_ms < 50 ? r->cfg->router.heartbeat_ms : 50);
        int64_t now = td_ctrl_now_ms();
        take_inbox(r);
        read_instances(r, now);
        now = td_ctrl_now_ms();
        liveness(r, now);
        expire(r, now);
        if (r->disagg) rt_pair_deadlines(r, now);
        rt_reg_heartbeat(&r->reg, &r->cfg->router, now);
        dispatch(r, now);
        if (now - last_poke >= RT_POKE_MS) {
            poke(r);
            last_poke = now;
        }
        publish_metrics(r);
    }
    stop_all(r, fds);
    free(fds);
    return NULL;
}

int rt_loop_start(rt_router *r)
{
    r->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->wake_fd < 0) {
        TD_LOG_ERR("router: eventfd failed");
        return TD_EIO;
    }
    r->disagg = r->cfg->n_prefill > 0;
    int rc = rt_reg_init(&r->reg, r->cfg);
    if (rc) return rc;
    if (pthread_create(&r->loop, NULL, loop_main, r)) {
        TD_LOG_ERR("router: cannot start the loop thread");
        return TD_ENOMEM;
    }
    r->loop_started = true;
    return 0;
}

void rt_loop_stop(rt_router *r)
{
    if (!r->loop_started) return;
    atomic_store(&r->stop, true);
    wake_loop(r);
    pthread_join(r->loop, NULL);
    r->loop_started = false;
}

void rt_loop_drain(rt_router *r)
{
    rt_req *g = r->gone_head;
    r->gone_head = NULL;
    while (g) {
        rt_req *next = g->gone_next;
        rt_req_release(g);
        g = next;
    }
    rt_reg_fini(&r->reg);
    rt_table_fini(&r->table);
    if (r->wake_fd >= 0) close(r->wake_fd);
    r->wake_fd = -1;
}
