/* rt_dispatch.c: how the loop starts, moves and ends requests (rt_loop_int.h): admission
 * into the router queue, dispatch to instances (colocated: Submit; disaggregated: an attempt
 * through rt_pair.c), the endings (finish, fail, retire), re-queueing, migration of a request
 * whose decode side was lost, and what the pairing's verdicts mean. Loop thread only.
 *
 * Admission (rt_loop_admit): no live instance -> 503 no_instance; queue full
 * (router.max_queue) -> 429 to the newcomer or to the newest queued request of the client
 * holding the most (rt_fair_victim); else QUEUED. Dispatch (rt_loop_dispatch) takes the
 * queue's next request (round robin over clients) while rt_route_decode (and,
 * disaggregated, rt_pair_pick) find an instance with room, by router.routing (rt_route.h);
 * rt_route_commit records where its prefix went. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rt_choices.h"
#include "rt_loop_int.h"
#include "rt_route.h"
#include "rt_tools.h"
#include "td_clock.h"
#include "td_err.h"

#define SUBMIT_TIMEOUT_MS 10000
#define CANCEL_TIMEOUT_MS 5000

/* ---- request endings (loop thread) ---- */

static void queue_remove(rt_router *r, rt_req *q)
{
    if (q->loop.fslot < 0) return;
    rt_fair_remove(&r->fair, q);
    atomic_fetch_sub(&r->queued, 1);
}

void rt_loop_cancel(rt_router *r, rt_req *q)
{
    if (q->loop.inst < 0 || !q->loop.rid) return;
    uint64_t call;
    td_ctrl_client_cancel(r->reg.inst[q->loop.inst].c, q->loop.rid, CANCEL_TIMEOUT_MS, &call);
}

void rt_loop_cancel_decode_side(rt_router *r, rt_req *q)
{
    if (q->loop.state == RT_ST_RUNNING || (q->loop.state == RT_ST_SUBMITTED && !r->disagg))
        rt_loop_cancel(r, q);
}

void rt_loop_retire(rt_router *r, rt_req *q)
{
    if (q->loop.state == RT_ST_QUEUED) queue_remove(r, q);
    if (r->disagg) rt_pair_release(r, q);
    rt_table_remove(&r->table, q);
    if (q->loop.inst >= 0 && (q->loop.state == RT_ST_SUBMITTED || q->loop.state == RT_ST_RUNNING))
        r->reg.inst[q->loop.inst].active--;
    q->loop.state = RT_ST_DONE;
    if (q->ch.parent) rt_choices_retired(r, q);
    rt_req_release(q);
}

void rt_loop_finish(rt_router *r, rt_req *q, rt_finish fin)
{
    int rc = rt_stream_finish(r, q, fin);
    if (rc) TD_LOG_ERR("router: %s: cannot write the response: %s", q->oid, td_strerror(rc));
    const char *outcome = fin == RT_FIN_LENGTH && !q->loop.stop_hit ? "length" : "stop";
    /* as the answer says it (rt_stream.c): a stop whose text was parsed into tool calls */
    if (!strcmp(outcome, "stop") && q->loop.toolp && rt_toolp_n_calls(q->loop.toolp))
        outcome = "tool_calls";
    rt_metrics_request_end(&r->metrics, r->cfg, q, td_now_ms(), rc && !q->p.stream ? 500 : 200,
                           outcome);
    rt_loop_retire(r, q);
}

void rt_loop_fail(rt_router *r, rt_req *q, int status, const char *code, const char *msg)
{
    rt_error e;
    rt_error_set(&e, status, NULL, code, "%s", msg);
    if (status >= 500) TD_LOG_WARN("router: %s: %s", q->oid, msg);
    rt_stream_fail(q, &e);
    rt_metrics_request_end(&r->metrics, r->cfg, q, td_now_ms(), status, code);
    rt_loop_retire(r, q);
}

void rt_loop_requeue(rt_router *r, rt_req *q, bool counted)
{
    if (q->loop.inst >= 0) r->reg.inst[q->loop.inst].active--;
    q->loop.inst = -1;
    q->loop.state = RT_ST_QUEUED;
    if (counted) q->loop.retries++;
    rt_fair_push_front(&r->fair, q);
    atomic_fetch_add(&r->queued, 1);
}

/* ---- migration: a request whose decode side was lost ---- */

/* The next attempt's prompt: p.prompt followed by every token received so far. */
static int make_resume(rt_req *q)
{
    q->loop.gen_base = q->loop.n_gen;
    if (!q->loop.n_gen) return 0;
    size_t n = q->p.n_prompt + (size_t)q->loop.n_gen;
    int32_t *ids = realloc(q->loop.resume, n * sizeof *ids);
    if (!ids) return TD_ENOMEM;
    memcpy(ids, q->p.prompt, q->p.n_prompt * sizeof *ids);
    memcpy(ids + q->p.n_prompt, q->loop.gen_ids, (size_t)q->loop.n_gen * sizeof *ids);
    q->loop.resume = ids;
    q->loop.n_resume = n;
    return 0;
}

void rt_loop_lose(rt_router *r, rt_req *q, const char *why, int64_t now)
{
    rt_loop_move(r, q, why, true, now);
}

void rt_loop_move(rt_router *r, rt_req *q, const char *why, bool counted, int64_t now)
{
    const td_cfg_router *rc = &r->cfg->router;
    if (r->disagg) {
        rt_pair_abandon(r, q); /* cancels both sides; q->loop.inst is -1 after */
    } else {
        if (q->loop.state == RT_ST_SUBMITTED || q->loop.state == RT_ST_RUNNING)
            rt_loop_cancel(r, q);
        if (q->loop.inst >= 0) r->reg.inst[q->loop.inst].active--;
        q->loop.inst = -1;
    }
    if (q->loop.n_gen >= q->p.max_tokens) { /* lost after its last token, before the finish */
        rt_loop_finish(r, q, RT_FIN_LENGTH);
        return;
    }
    char no[160] = "";
    if (q->loop.n_gen > 0 && q->p.no_migrate)
        snprintf(no, sizeof no, "the request asked not to move (\"migrate\": false)");
    else if (!rc->max_migrations)
        snprintf(no, sizeof no, "router.max_migrations is 0");
    else if (counted && q->loop.migrations >= rc->max_migrations)
        snprintf(no, sizeof no, "it moved %d times already (router.max_migrations)",
                 q->loop.migrations);
    else if (make_resume(q))
        snprintf(no, sizeof no, "out of memory");
    if (no[0]) {
        char msg[600];
        snprintf(msg, sizeof msg, "%s after %d tokens; the request cannot move: %s", why,
                 q->loop.n_gen, no);
        rt_loop_fail(r, q, 503, "instance_unavailable", msg);
        return;
    }
    if (!r->disagg) {
        /* a fresh id: late events of the lost attempt must not match the next one (the
           disaggregated attempt takes its own in rt_pair_start) */
        rt_table_remove(&r->table, q);
        int err = rt_table_add(&r->table, q);
        if (err) {
            rt_loop_fail(r, q, 500, NULL, "cannot track the request");
            return;
        }
    }
    if (!q->loop.lost_ms) q->loop.lost_ms = now;
    rt_pair_moved(q);
    if (counted) {
        q->loop.migrations++;
        TD_LOG_INFO("router: %s: %s after %d tokens: moving it (move %d of %d), it goes on "
                    "from token %d",
                    q->oid, why, q->loop.n_gen, q->loop.migrations, rc->max_migrations,
                    q->loop.n_gen);
        rt_metrics_migration(&r->metrics);
    } else {
        TD_LOG_INFO("router: %s: %s before its instance took it: sending it again (not "
                    "counted as a move), it goes on from token %d",
                    q->oid, why, q->loop.n_gen);
    }
    q->loop.state = RT_ST_QUEUED;
    rt_fair_push_front(&r->fair, q);
    atomic_fetch_add(&r->queued, 1);
}

/* ---- admission and dispatch ---- */

/* q never got into the queue: answer e, drop the loop's reference. */
static void refuse(rt_router *r, rt_req *q, const rt_error *e)
{
    atomic_fetch_sub(&r->queued, 1);
    q->loop.state = RT_ST_DONE;
    rt_stream_fail(q, e);
    rt_metrics_request_end(&r->metrics, r->cfg, q, td_now_ms(), e->status, e->code);
    rt_req_release(q);
}

void rt_loop_admit(rt_router *r, rt_req *q)
{
    rt_error e;
    bool no_pf = r->disagg && atomic_load(&r->n_pf_alive) == 0;
    if (atomic_load(&r->n_alive) == 0 || no_pf) {
        rt_error_set(&e, 503, NULL, "no_instance", "no %s instance is available",
                     no_pf ? "prefill" : "decode");
        refuse(r, q, &e);
        return;
    }
    if (rt_choices_many(q)) { /* n > 1 or several prompts: its children are queued instead */
        if (rt_choices_admit(r, q, &e)) refuse(r, q, &e);
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
        rt_metrics_request_end(&r->metrics, r->cfg, v, td_now_ms(), 429, "queue_full");
        rt_loop_retire(r, v);
    }
    int rc = rt_table_add(&r->table, q);
    if (rc) {
        rt_error_set(&e, 500, NULL, NULL, "cannot track the request: %s", td_strerror(rc));
        refuse(r, q, &e);
        return;
    }
    q->loop.state = RT_ST_QUEUED;
    rt_fair_push(&r->fair, q); /* r->queued already counts it */
}

static int submit(rt_router *r, rt_req *q, int i)
{
    rt_inst *s = &r->reg.inst[i];
    Td__Sampling sm;
    Td__Submit sub;
    rt_req_submit_msg(q, &sm, &sub);
    int rc = td_ctrl_client_submit(s->c, &sub, SUBMIT_TIMEOUT_MS, &q->loop.call_id);
    if (rc) return rc;
    q->loop.inst = i;
    q->loop.inst_boot = s->boot_id;
    q->loop.state = RT_ST_SUBMITTED;
    if (!q->loop.t_dispatch_ms) q->loop.t_dispatch_ms = td_now_ms();
    s->active++;
    return 0;
}

void rt_loop_dispatch(rt_router *r, int64_t now)
{
    rt_req *q;
    while ((q = rt_fair_peek(&r->fair))) {
        size_t np;
        const int32_t *prompt = rt_req_prompt(q, &np);
        rt_route_pick dpk, ppk;
        int i = rt_route_decode(&r->reg, &r->cfg->router, prompt, np, now, &dpk);
        if (i < 0) return;
        int p = -1;
        if (r->disagg) {
            p = rt_pair_pick(r, q, now, &ppk);
            if (p < 0) {
                rt_pair_out o = rt_pair_unservable(r, q);
                if (o.verdict == RT_PAIR_OK) return;
                rt_loop_act(r, &o, now); /* failed; next in the queue */
                continue;
            }
        }
        rt_fair_pop(&r->fair);
        atomic_fetch_sub(&r->queued, 1);
        q->loop.state = RT_ST_INBOX; /* off the queue, not yet submitted */
        int rc = r->disagg ? rt_pair_start(r, q, i, p, now) : submit(r, q, i);
        if (!rc) { /* q is on its instance(s): they now hold (or compute) its prefix */
            rt_route_commit(&r->reg, r->reg.inst, prompt, np, &dpk);
            if (r->disagg) rt_route_commit(&r->reg, r->reg.pf, prompt, np, &ppk);
            continue;
        }
        q->loop.state = RT_ST_DONE;
        rt_table_remove(&r->table, q);
        rt_error e;
        rt_error_set(&e, 500, NULL, NULL, "cannot send the request: %s", td_strerror(rc));
        TD_LOG_ERR("router: %s: %s", q->oid, e.message);
        rt_stream_fail(q, &e);
        rt_metrics_request_end(&r->metrics, r->cfg, q, now, 500, NULL);
        if (q->ch.parent) rt_choices_retired(r, q);
        rt_req_release(q);
    }
}

void rt_loop_act(rt_router *r, const rt_pair_out *o, int64_t now)
{
    switch (o->verdict) {
    case RT_PAIR_OK:
        return;
    case RT_PAIR_RETRY:
        rt_loop_requeue(r, o->q, true);
        return;
    case RT_PAIR_BOUNCE:
        rt_loop_requeue(r, o->q, false);
        return;
    case RT_PAIR_LOST:
        rt_loop_move(r, o->q, o->msg, !o->uncounted, now);
        return;
    case RT_PAIR_FAILED:
        rt_loop_fail(r, o->q, o->status, o->code, o->msg);
        return;
    }
}
