/* rt_pair.c: disaggregated serving: pairing a prefill instance with a decode instance per
 * request, relaying the decode side's KV targets, and what happens when either side fails
 * before the first token. Loop thread only: the loop calls in and carries out the verdict
 * each function returns (rt_pair_out); nothing here calls the loop.
 *
 * One attempt of a request (its own request id, the same on both sides, so the logs of the
 * three processes line up):
 *
 *   dispatch: Alloc{Submit, n_stages} -> decode leader  |  Prefill{ids, no targets} -> prefill
 *   decode:  AllocReply{kv_targets} -- state SUBMITTED -> RUNNING, targets kept
 *   prefill: Ack ---------------------- pf_acked
 *   both in: KvTarget{targets} -> prefill (kvt_sent; the targets are freed)
 *   prefill: PrefillDone -------------- pf_busy = false (metrics, one INFO log line)
 *   decode:  TokenEvents exactly as after Submit (the first carries the prefill's token)
 *
 * Failures before the first token (n_gen == 0):
 *   a process died or is stopping: a prefill ErrorEvent or a decode ErrorEvent (the KV
 *   transfer) ERR_PEER_FAILED / ERR_SHUTDOWN (a stage, a rank, the link between them), a
 *   KvTarget refused as unknown (ERR_NOT_FOUND: stage 0 failed the request already)
 *     -> the request moves (lost_early, rt_loop_lose): another instance, or the same one
 *        once it re-formed, within router.migrate_wait_ms.
 *   any other prefill ErrorEvent, a Prefill/KvTarget reply error or no reply, a decode
 *   ERR_TIMEOUT (the KV transfer)
 *     -> cancel both sides; if the request has not been retried yet and another prefill
 *        instance is alive (or the failure was a timeout and the same one still is), it
 *        goes back to the head of the queue avoiding the failed instance (pf_avoid), else
 *        it ends with 503 prefill_failed.
 *   the prefill instance marked dead or restarted -> the request moves (rt_loop_lose):
 *     another prefill instance, or the same one once it answers again, within
 *     router.migrate_wait_ms (not counted as a move when its Prefill was not acknowledged:
 *     it went to the process that died).
 *   ERR_BUSY from either side -> cancel the other side, pause that instance 100 ms,
 *     re-queue (a bounce, not a failure); MAX_BUSY bounces -> 503 instance_busy.
 *   no first token by deadline_ms (rt_pair_deadline) -> cancel both, 503 first_token_timeout.
 *   decode instance dead -> rt_loop.c fails its requests; retire cancels the prefill side.
 *
 * Cancelling a side (abandon): a side whose request call was answered gets a Cancel now;
 * one whose call is still out is cancelled when its answer comes (an AllocReply for no live
 * attempt: rt_pair_orphan_alloc; the Ack of an abandoned Prefill: the instance's orphan
 * list), so a Cancel can never overtake the request it cancels.
 *
 * Invariants: pf_busy <=> the attempt counts in its prefill instance's `active` and
 * `inflight_tokens`; a decode side counts in `active` while SUBMITTED or RUNNING (as in
 * colocated mode). Both are released exactly once (pf_release, abandon, retire). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rt.h"
#include "rt_pair.h"
#include "td_err.h"
#include "td_grow.h"

#define ALLOC_TIMEOUT_MS  10000 /* the decode leader answers between steps */
#define MIN_PF_CALL_MS    10000 /* floor of the Prefill and KvTarget reply waits */
#define CANCEL_TIMEOUT_MS 5000
#define MAX_RETRIES       3   /* Alloc calls without an answer (as a colocated Submit) */
#define MAX_BUSY          50  /* ERR_BUSY bounces before 503 (>= 5 s with one decode instance) */
#define BUSY_PAUSE_MS     100 /* an instance that answered ERR_BUSY is skipped this long */

/* How long a Prefill or KvTarget call waits for its reply. Stage 0 answers them between
 * chunks, and one chunk can take seconds (a long chunk, a big model, a busy machine): a
 * reply wait shorter than that failed healthy attempts (a KvTarget sent while stage 0
 * computed a chunk under load timed out at 5 s). A dead stage 0 is found by its heartbeat
 * (answered on NNG's thread), and the node bounds the whole transfer by kvxfer.timeout_ms,
 * so the reply wait can be as long as that. */
static int pf_call_ms(const td_cfg *cfg)
{
    return cfg->kvxfer.timeout_ms > MIN_PF_CALL_MS ? cfg->kvxfer.timeout_ms : MIN_PF_CALL_MS;
}

int64_t rt_pair_deadline(const td_cfg *cfg, int64_t now)
{
    return now + cfg->kvxfer.timeout_ms + cfg->router.instance_timeout_ms + 2000;
}

/* ---- bookkeeping of the two sides ---- */

static void drop_targets(rt_req *q)
{
    for (size_t i = 0; i < q->pair.n_targets; i++)
        free(q->pair.targets[i].data);
    free(q->pair.targets);
    q->pair.targets = NULL;
    q->pair.n_targets = 0;
}

/* Has the current attempt produced its first token? (a moved request had gen_base before) */
static bool started(const rt_req *q)
{
    return q->loop.n_gen > q->loop.gen_base;
}

/* The prefill side no longer works on the attempt (done, refused, failed or cancelled). */
static void pf_release(rt_router *r, rt_req *q)
{
    if (!q->pair.pf_busy) return;
    rt_inst *s = &r->reg.pf[q->pair.pinst];
    size_t n;
    rt_req_prompt(q, &n);
    s->active--;
    s->inflight_tokens -= n < s->inflight_tokens ? n : s->inflight_tokens;
    q->pair.pf_busy = false;
    q->pair.pf_call = 0;
}

static void orphan_add(rt_inst *s, uint64_t call, uint64_t rid)
{
    if (TD_GROW_INT(s->orphans, s->cap_orphans, s->n_orphans + 1, 16)) {
        /* the node drops the request after kvxfer.timeout_ms without targets anyway */
        TD_LOG_WARN("router: req %llu: out of memory: cannot cancel its prefill later",
                    (unsigned long long)rid);
        return;
    }
    s->orphans[s->n_orphans++] = (rt_call){.call_id = call, .rid = rid};
}

static void cancel_prefill(rt_router *r, rt_req *q)
{
    if (!q->pair.pf_busy) return;
    rt_inst *s = &r->reg.pf[q->pair.pinst];
    uint64_t call;
    if (q->pair.pf_acked)
        td_ctrl_client_cancel(s->c, q->loop.rid, CANCEL_TIMEOUT_MS, &call);
    else
        orphan_add(s, q->pair.pf_call, q->loop.rid); /* cancelled when its Ack arrives */
    pf_release(r, q);
}

/* ---- verdicts for the loop ---- */

static rt_pair_out go_on(void)
{
    return (rt_pair_out){.verdict = RT_PAIR_OK};
}

static rt_pair_out requeue(rt_req *q, bool counted)
{
    return (rt_pair_out){.verdict = counted ? RT_PAIR_RETRY : RT_PAIR_BOUNCE, .q = q};
}

static rt_pair_out lost(rt_req *q, const char *why)
{
    rt_pair_out o = {.verdict = RT_PAIR_LOST, .q = q};
    snprintf(o.msg, sizeof o.msg, "%s", why);
    return o;
}

static rt_pair_out failed(rt_req *q, int status, const char *code, const char *msg)
{
    rt_pair_out o = {.verdict = RT_PAIR_FAILED, .q = q, .status = status, .code = code};
    snprintf(o.msg, sizeof o.msg, "%s", msg);
    return o;
}

/* Cancel q on its decode instance. */
static void cancel_decode(rt_router *r, rt_req *q)
{
    if (q->loop.inst < 0 || !q->loop.rid) return;
    uint64_t call;
    td_ctrl_client_cancel(r->reg.inst[q->loop.inst].c, q->loop.rid, CANCEL_TIMEOUT_MS, &call);
}

/* End the current attempt on both sides; q is then off every instance (state INBOX). */
static void abandon(rt_router *r, rt_req *q)
{
    if (q->loop.inst >= 0 && (q->loop.state == RT_ST_SUBMITTED || q->loop.state == RT_ST_RUNNING)) {
        /* SUBMITTED: the AllocReply, if one comes, matches no attempt and is cancelled then */
        if (q->loop.state == RT_ST_RUNNING) cancel_decode(r, q);
        r->reg.inst[q->loop.inst].active--;
    }
    q->loop.inst = -1;
    q->loop.state = RT_ST_INBOX;
    cancel_prefill(r, q);
    drop_targets(q);
    q->pair.deadline_ms = 0;
}

void rt_pair_abandon(rt_router *r, rt_req *q)
{
    abandon(r, q);
}

void rt_pair_moved(rt_req *q)
{
    q->pair.pf_retried = false;
    q->pair.pf_avoid = -1;
    q->pair.pf_same_ok = false;
    q->pair.busy = 0;
}

void rt_pair_release(rt_router *r, rt_req *q)
{
    /* after the first token the prefill is over (its PrefillDone may still be on its way) */
    if (started(q))
        pf_release(r, q);
    else
        cancel_prefill(r, q);
    drop_targets(q);
}

static const char *pf_name(const rt_router *r, int j)
{
    return j >= 0 && j < r->reg.n_pf ? r->reg.pf[j].name : "?";
}

/* An ERR_BUSY from either side: back to the queue head, or 503 after MAX_BUSY. */
static rt_pair_out bounce(rt_router *r, rt_req *q, const char *msg)
{
    abandon(r, q);
    if (++q->pair.busy < MAX_BUSY) return requeue(q, false); /* busy is not a failure */
    return failed(q, 503, "instance_busy", msg);
}

/* The attempt was lost before its first token because a process of one of its instances
 * died or is stopping (ERR_PEER_FAILED, ERR_SHUTDOWN: a prefill stage, a decode rank, the
 * connection between them): the request is not at fault, so it moves (rt_loop_lose) as
 * when an instance is marked dead or restarts: to another instance, or to the same one once
 * it re-formed, within router.migrate_wait_ms. Failing it at once (no other prefill
 * instance: 503 prefill_failed), or retrying it as a failure (then no instance alive at the
 * next liveness check: 503 no_instance), broke that promise. */
static rt_pair_out lost_early(rt_router *r, rt_req *q, rt_pf_fail why, const char *msg)
{
    rt_metrics_pair(&r->metrics, RT_PM_FAIL, why);
    TD_LOG_WARN("router: %s req %llu: attempt %d lost before its first token: %s", q->oid,
                (unsigned long long)q->loop.rid, q->pair.attempts, msg);
    return lost(q, msg);
}

/* The attempt failed before its first token: retry once elsewhere, or end the request. */
static rt_pair_out pair_failed(rt_router *r, rt_req *q, rt_pf_fail why, bool timeout,
                               const char *msg)
{
    int failed_on = q->pair.pinst;
    bool first = !q->pair.pf_retried;
    rt_metrics_pair(&r->metrics, RT_PM_FAIL, why);
    TD_LOG_WARN("router: %s req %llu: attempt %d failed before its first token: %s", q->oid,
                (unsigned long long)q->loop.rid, q->pair.attempts, msg);
    if (first) snprintf(q->pair.pf_fail, sizeof q->pair.pf_fail, "%s", msg);
    if (why != RT_PF_DEADLINE && !started(q) && first) {
        int others = rt_reg_n_pf_alive(&r->reg, failed_on);
        bool same = timeout && failed_on >= 0 && r->reg.pf[failed_on].alive;
        if (others || same) {
            abandon(r, q);
            q->pair.pf_retried = true;
            q->pair.pf_avoid = failed_on;
            q->pair.pf_same_ok = same;
            rt_metrics_pair(&r->metrics, RT_PM_RETRY, 0);
            return requeue(q, true);
        }
    }
    abandon(r, q);
    char text[800];
    if (why == RT_PF_DEADLINE)
        snprintf(text, sizeof text, "%s", msg);
    else if (!first)
        snprintf(text, sizeof text, "the prefill of this request failed twice: %s; retry: %s",
                 q->pair.pf_fail, msg);
    else
        snprintf(text, sizeof text,
                 "the prefill of this request failed and no other prefill instance is "
                 "available: %s",
                 msg);
    return failed(q, 503, why == RT_PF_DEADLINE ? "first_token_timeout" : "prefill_failed", text);
}

/* ---- starting an attempt ---- */

int rt_pair_pick(rt_router *r, const rt_req *q, int64_t now, rt_route_pick *pk)
{
    int avoid = q->pair.pf_avoid;
    size_t n;
    const int32_t *prompt = rt_req_prompt(q, &n);
    const td_cfg_router *rc = &r->cfg->router;
    int p = rt_route_prefill(&r->reg, rc, prompt, n, now, avoid, pk);
    if (p < 0 && avoid >= 0 && q->pair.pf_same_ok && !rt_reg_n_pf_alive(&r->reg, avoid))
        p = rt_route_prefill(&r->reg, rc, prompt, n, now, -1, pk); /* a timeout: may retry */
    return p;
}

rt_pair_out rt_pair_unservable(rt_router *r, rt_req *q)
{
    if (q->pair.pf_avoid < 0 || rt_reg_n_pf_alive(&r->reg, q->pair.pf_avoid) > 0) return go_on();
    if (q->pair.pf_same_ok && r->reg.pf[q->pair.pf_avoid].alive) return go_on(); /* only busy */
    char msg[800];
    snprintf(msg, sizeof msg,
             "the prefill of this request failed and no other prefill instance is available: %s",
             q->pair.pf_fail);
    return failed(q, 503, "prefill_failed", msg);
}

int rt_pair_start(rt_router *r, rt_req *q, int d, int p, int64_t now)
{
    if (q->pair.attempts > 0) {
        /* a fresh id: late answers about the previous attempt must not match this one */
        rt_table_remove(&r->table, q);
        int rc = rt_table_add(&r->table, q);
        if (rc) return rc;
    }
    rt_inst *ds = &r->reg.inst[d], *ps = &r->reg.pf[p];
    Td__Sampling sm, dsm;
    Td__Submit sub;
    rt_req_submit_msg(q, &sm, &sub);
    /* the prefill computes the prompt's logprobs and the first token's (PrefillDone); the
       decode side the later tokens' (a decode-side recompute must not send them again) */
    dsm = sm;
    dsm.prompt_logprobs = false;
    sub.sampling = &dsm;
    q->loop.pd_seen = q->loop.first_lp_set = false;
    rt_buf_free(&q->loop.lp_hold);
    Td__Alloc al = TD__ALLOC__INIT;
    al.request = &sub;
    al.n_stages = (uint32_t)ps->pcfg->pp;
    Td__Envelope env = TD__ENVELOPE__INIT;
    env.body_case = TD__ENVELOPE__BODY_ALLOC;
    env.alloc = &al;
    uint64_t acall = 0, pcall = 0;
    int rc = td_ctrl_client_call(ds->c, &env, ALLOC_TIMEOUT_MS, &acall);
    if (rc) return rc;

    Td__Prefill pf = TD__PREFILL__INIT;
    pf.request_id = q->loop.rid;
    pf.token_ids = rt_req_prompt(q, &pf.n_token_ids);
    pf.sampling = &sm;
    pf.decode_instance = (char *)ds->name;
    pf.n_decode_ranks = (uint32_t)ds->cfg->tp;
    env = (Td__Envelope)TD__ENVELOPE__INIT;
    env.body_case = TD__ENVELOPE__BODY_PREFILL;
    env.prefill = &pf;
    rc = td_ctrl_client_call(ps->c, &env, pf_call_ms(r->cfg), &pcall);
    if (rc) {
        uint64_t call;
        td_ctrl_client_cancel(ds->c, q->loop.rid, CANCEL_TIMEOUT_MS, &call);
        return rc;
    }
    q->pair.attempts++;
    q->loop.inst = d;
    q->loop.inst_boot = ds->boot_id;
    q->loop.state = RT_ST_SUBMITTED;
    if (!q->loop.t_dispatch_ms) q->loop.t_dispatch_ms = now;
    q->loop.call_id = acall;
    ds->active++;
    q->pair.pinst = p;
    q->pair.pf_boot = ps->boot_id;
    q->pair.pf_call = pcall;
    q->pair.pf_busy = true;
    q->pair.pf_acked = false;
    q->pair.kvt_sent = false;
    q->pair.dc_cached = 0;
    ps->active++;
    ps->inflight_tokens += pf.n_token_ids;
    q->pair.deadline_ms = rt_pair_deadline(r->cfg, now);
    rt_metrics_pair(&r->metrics, RT_PM_SENT, 0);
    TD_LOG_DEBUG(
        "router: %s req %llu: attempt %d: prefill %s (boot %llx), decode %s, %zu prompt tokens",
        q->oid, (unsigned long long)q->loop.rid, q->pair.attempts, ps->name,
        (unsigned long long)ps->boot_id, ds->name, pf.n_token_ids);
    return 0;
}

/* KvTarget once both the Prefill's Ack and the AllocReply are in. */
static rt_pair_out relay(rt_router *r, rt_req *q)
{
    if (!q->pair.pf_busy || !q->pair.pf_acked || q->pair.kvt_sent || !q->pair.n_targets)
        return go_on();
    rt_inst *s = &r->reg.pf[q->pair.pinst];
    Td__KvTarget kt = TD__KV_TARGET__INIT;
    kt.request_id = q->loop.rid;
    kt.kv_targets = q->pair.targets;
    kt.n_kv_targets = q->pair.n_targets;
    Td__Envelope env = TD__ENVELOPE__INIT;
    env.body_case = TD__ENVELOPE__BODY_KV_TARGET;
    env.kv_target = &kt;
    int rc = td_ctrl_client_call(s->c, &env, pf_call_ms(r->cfg), &q->pair.pf_call);
    if (rc) {
        char msg[256];
        snprintf(msg, sizeof msg, "cannot send the KV targets to prefill instance %s: %s", s->name,
                 td_strerror(rc));
        return pair_failed(r, q, RT_PF_ERROR, false, msg);
    }
    q->pair.kvt_sent = true;
    drop_targets(q);
    return go_on();
}

/* ---- the decode side ---- */

void rt_pair_orphan_alloc(rt_router *r, int i, const Td__Envelope *env)
{
    uint64_t rid = env->alloc_reply->request_id, call;
    const rt_req *q = rt_table_get(&r->table, rid);
    if (!rid || (q && q->loop.inst == i)) return; /* never cancel a live attempt */
    TD_LOG_DEBUG("router: req %llu: reservation on decode instance %s outlived its attempt: "
                 "cancelled",
                 (unsigned long long)rid, r->reg.inst[i].name);
    td_ctrl_client_cancel(r->reg.inst[i].c, rid, CANCEL_TIMEOUT_MS, &call);
}

static int keep_targets(rt_req *q, const Td__AllocReply *ar)
{
    q->pair.targets = calloc(ar->n_kv_targets, sizeof *q->pair.targets);
    if (!q->pair.targets) return TD_ENOMEM;
    q->pair.n_targets = ar->n_kv_targets;
    for (size_t k = 0; k < ar->n_kv_targets; k++) {
        size_t len = ar->kv_targets[k].len;
        q->pair.targets[k].data = malloc(len ? len : 1);
        if (!q->pair.targets[k].data) return TD_ENOMEM;
        if (len) memcpy(q->pair.targets[k].data, ar->kv_targets[k].data, len);
        q->pair.targets[k].len = len;
    }
    return 0;
}

rt_pair_out rt_pair_on_alloc(rt_router *r, rt_req *q, int i, const td_ctrl_client_in *in,
                             int64_t now)
{
    rt_inst *s = &r->reg.inst[i];
    char msg[600];
    if (in->err) {
        /* no answer in time: it may still have reserved the blocks */
        cancel_decode(r, q);
        abandon(r, q);
        if (q->loop.retries < MAX_RETRIES) return requeue(q, true);
        return failed(q, 503, "instance_unavailable", "the decode instance did not answer");
    }
    const Td__Envelope *env = in->env;
    if (env->body_case == TD__ENVELOPE__BODY_ALLOC_REPLY) {
        const Td__AllocReply *ar = env->alloc_reply;
        if (ar->n_kv_targets != (size_t)s->cfg->tp) {
            snprintf(msg, sizeof msg, "decode instance %s answered %zu KV targets for tp %d",
                     s->name, ar->n_kv_targets, s->cfg->tp);
            TD_LOG_ERR("router: %s req %llu: %s", q->oid, (unsigned long long)q->loop.rid, msg);
            q->loop.state = RT_ST_RUNNING; /* it holds the request: abandon cancels it */
            abandon(r, q);
            return failed(q, 500, NULL, msg);
        }
        q->loop.state = RT_ST_RUNNING;
        q->pair.dc_cached = ar->n_cached < q->p.n_prompt ? ar->n_cached : 0; /* else bogus */
        if (ar->n_cached)
            TD_LOG_DEBUG("router: %s req %llu: decode instance %s holds %u prompt tokens: not "
                         "pushed",
                         q->oid, (unsigned long long)q->loop.rid, s->name, ar->n_cached);
        if (keep_targets(q, ar)) {
            abandon(r, q);
            return failed(q, 500, NULL, "out of memory while relaying the KV targets");
        }
        return relay(r, q);
    }
    if (env->body_case != TD__ENVELOPE__BODY_ERROR) {
        abandon(r, q);
        return failed(q, 500, NULL, "unexpected reply from the decode instance");
    }
    const Td__ErrorEvent *err = env->error;
    switch (err->code) {
    case TD__ERROR_CODE__ERR_BUSY:
        s->busy_until_ms = now + BUSY_PAUSE_MS;
        rt_metrics_pair(&r->metrics, RT_PM_BUSY_DECODE, 0);
        return bounce(r, q,
                      "every decode instance is busy (no room for the request's KV cache now)");
    case TD__ERROR_CODE__ERR_NO_SPACE:
    case TD__ERROR_CODE__ERR_INVALID:
        abandon(r, q);
        return failed(q, 400, NULL, err->message);
    case TD__ERROR_CODE__ERR_SHUTDOWN:
        /* a leaving (or stopping) instance refused the Alloc: nothing new goes to it, the
           request goes elsewhere as from a busy one */
        s->draining = true;
        return bounce(r, q, "every decode instance is leaving");
    case TD__ERROR_CODE__ERR_PEER_FAILED:
        return lost(q, err->message); /* elsewhere, or here once it re-formed */
    default:
        abandon(r, q);
        return failed(q, 500, NULL, err->message);
    }
}

rt_pair_out rt_pair_on_decode_error(rt_router *r, rt_req *q, const Td__ErrorEvent *e)
{
    bool died = e->code == TD__ERROR_CODE__ERR_PEER_FAILED;
    if ((died || e->code == TD__ERROR_CODE__ERR_TIMEOUT) && !started(q)) {
        char msg[600];
        snprintf(msg, sizeof msg,
                 "decode instance %s: KV transfer from prefill instance %s: %s: %s",
                 q->loop.inst >= 0 ? r->reg.inst[q->loop.inst].name : "?",
                 pf_name(r, q->pair.pinst), td_ctrl_err_name(e->code), e->message);
        /* a writer (prefill stage) or a decode rank died: the request moves; the transfer
           timed out: the same prefill instance may retry */
        if (died) return lost_early(r, q, RT_PF_TRANSFER, msg);
        return pair_failed(r, q, RT_PF_TRANSFER, true, msg);
    }
    /* as in colocated mode (and a leader stopping, ERR_SHUTDOWN, before the first token) */
    if (rt_code_lost(e->code)) return lost(q, e->message);
    return failed(q, 500, NULL, e->message);
}

/* ---- the prefill side ---- */

static rt_req *find_pf_call(rt_router *r, int j, uint64_t call_id)
{
    for (uint32_t k = 0; k < r->table.cap; k++) {
        rt_req *q = r->table.slots[k];
        if (q && q->pair.pinst == j && q->pair.pf_busy && q->pair.pf_call == call_id) return q;
    }
    return NULL;
}

/* A reply that matches no live attempt: an abandoned Prefill that was not refused (an Ack,
 * or no answer in time: it may have got through) is cancelled now. */
static void orphan_reply(rt_inst *s, const td_ctrl_client_in *in)
{
    for (int k = 0; k < s->n_orphans; k++) {
        if (s->orphans[k].call_id != in->call_id) continue;
        uint64_t rid = s->orphans[k].rid, call;
        s->orphans[k] = s->orphans[--s->n_orphans];
        if (in->err || in->env->body_case == TD__ENVELOPE__BODY_ACK)
            td_ctrl_client_cancel(s->c, rid, CANCEL_TIMEOUT_MS, &call);
        return;
    }
}

rt_pair_out rt_pair_on_reply(rt_router *r, int j, const td_ctrl_client_in *in, int64_t now)
{
    rt_inst *s = &r->reg.pf[j];
    if (in->call_id == s->hb_call) {
        s->hb_call = 0;
        if (!in->err && in->env && in->env->body_case == TD__ENVELOPE__BODY_HEALTH &&
            rt_reg_seen(s, in->env->health, now))
            TD_LOG_INFO("router: prefill instance %s (%s) is serving", s->name, s->url);
        return go_on();
    }
    if (!in->err) rt_reg_seen(s, NULL, now);
    rt_req *q = find_pf_call(r, j, in->call_id);
    if (!q) {
        orphan_reply(s, in);
        return go_on();
    }
    bool is_prefill = !q->pair.pf_acked; /* else the reply is KvTarget's */
    const char *what = is_prefill ? "Prefill" : "KvTarget";
    char msg[600];
    if (in->err) {
        /* no Ack can come any more, but the request may have got through: cancel it now */
        q->pair.pf_acked = true;
        snprintf(msg, sizeof msg, "prefill instance %s did not answer %s (%s)", s->name, what,
                 td_strerror(in->err));
        return pair_failed(r, q, RT_PF_ERROR, false, msg);
    }
    const Td__Envelope *env = in->env;
    if (env->body_case == TD__ENVELOPE__BODY_ACK) {
        q->pair.pf_call = 0;
        if (is_prefill) {
            q->pair.pf_acked = true;
            return relay(r, q);
        }
        return go_on();
    }
    if (env->body_case != TD__ENVELOPE__BODY_ERROR) {
        snprintf(msg, sizeof msg, "prefill instance %s: unexpected reply to %s", s->name, what);
        return pair_failed(r, q, RT_PF_ERROR, false, msg);
    }
    const Td__ErrorEvent *e = env->error;
    if (is_prefill) pf_release(r, q); /* refused: nothing to cancel there */
    if (is_prefill && e->code == TD__ERROR_CODE__ERR_BUSY) {
        s->busy_until_ms = now + BUSY_PAUSE_MS;
        rt_metrics_pair(&r->metrics, RT_PM_BUSY_PREFILL, 0);
        return bounce(r, q, "every prefill instance is busy (its queue is full)");
    }
    if (is_prefill && e->code == TD__ERROR_CODE__ERR_SHUTDOWN) {
        /* a leaving prefill instance refused it: nothing new goes there (its Health says the
           same), the request goes elsewhere as from a busy one */
        s->draining = true;
        return bounce(r, q, "every prefill instance is leaving");
    }
    if (is_prefill &&
        (e->code == TD__ERROR_CODE__ERR_INVALID || e->code == TD__ERROR_CODE__ERR_NO_SPACE ||
         e->code == TD__ERROR_CODE__ERR_TOO_LARGE)) {
        snprintf(msg, sizeof msg, "the prefill instance refused the request: %s", e->message);
        abandon(r, q);
        return failed(q, 400, NULL, msg);
    }
    /* KvTarget refused: the prefill may still hold the request, abandon cancels it */
    q->pair.pf_call = 0;
    snprintf(msg, sizeof msg, "prefill instance %s: %s: %s: %s", s->name, what,
             td_ctrl_err_name(e->code), e->message);
    /* the instance no longer has the request: it failed it when a stage died (that
       ErrorEvent can come after this reply) or is stopping: it moves, as on the event */
    if (!is_prefill && (e->code == TD__ERROR_CODE__ERR_NOT_FOUND || rt_code_lost(e->code)))
        return lost_early(r, q, RT_PF_ERROR, msg);
    return pair_failed(r, q, RT_PF_ERROR, e->code == TD__ERROR_CODE__ERR_TIMEOUT, msg);
}

static void log_done(const rt_router *r, const rt_req *q, int j, const Td__PrefillDone *d)
{
    char chunks[400];
    size_t o = 0;
    size_t shown = d->n_chunk_sizes < 48 ? d->n_chunk_sizes : 48;
    chunks[0] = 0;
    for (size_t k = 0; k < shown && o < sizeof chunks; k++)
        o += (size_t)snprintf(chunks + o, sizeof chunks - o, "%s%u", k ? " " : "",
                              d->chunk_sizes[k]);
    if (shown < d->n_chunk_sizes && o < sizeof chunks)
        snprintf(chunks + o, sizeof chunks - o, " ...");
    TD_LOG_INFO("router: %s req %llu: prefill done on %s: %u prompt tokens, chunks [%s], queued "
                "%llu ms, prefill %llu ms",
                q ? q->oid : "-", (unsigned long long)d->request_id, pf_name(r, j),
                d->n_prompt_tokens, chunks, (unsigned long long)d->queued_ms,
                (unsigned long long)d->prefill_ms);
}

rt_pair_out rt_pair_on_event(rt_router *r, int j, const Td__Event *ev)
{
    rt_inst *s = &r->reg.pf[j];
    if (ev->body_case == TD__EVENT__BODY_PREFILL_DONE) {
        const Td__PrefillDone *d = ev->prefill_done;
        rt_req *q = rt_table_get(&r->table, d->request_id);
        bool live = q && q->pair.pinst == j && q->pair.pf_busy;
        /* a late notice of an ended attempt still describes work the instance did */
        rt_metrics_prefill_done(&r->metrics, d);
        log_done(r, live ? q : NULL, j, d);
        /* usage.prompt_tokens_details: the notice can come after the decode side started
         * (pf_busy already false), so any notice of the request's current attempt counts */
        if (q && q->pair.pinst == j) q->pair.pf_cached = d->cached_tokens;
        if (live) pf_release(r, q);
    } else if (ev->body_case == TD__EVENT__BODY_ERROR && ev->error->request_id) {
        const Td__ErrorEvent *e = ev->error;
        rt_req *q = rt_table_get(&r->table, e->request_id);
        if (!q || q->pair.pinst != j || !q->pair.pf_busy) return go_on();
        pf_release(r, q); /* the request is over on the prefill side */
        if (started(q)) return go_on();
        char msg[600];
        snprintf(msg, sizeof msg, "prefill instance %s: %s: %s", s->name, td_ctrl_err_name(e->code),
                 e->message);
        /* a stage died (the chain re-forms) or a decode rank did, or stage 0 is stopping */
        if (rt_code_lost(e->code)) return lost_early(r, q, RT_PF_ERROR, msg);
        return pair_failed(r, q, RT_PF_ERROR, e->code == TD__ERROR_CODE__ERR_TIMEOUT, msg);
    }
    return go_on();
}

rt_pair_out rt_pair_prefill_lost(rt_router *r, rt_req *q, int j, bool restarted)
{
    if (q->pair.pinst != j || !q->pair.pf_busy) return go_on();
    if (started(q)) {
        pf_release(r, q);
        return go_on();
    }
    char msg[300];
    snprintf(msg, sizeof msg, "prefill instance %s %s", r->reg.pf[j].name,
             restarted ? "restarted" : "stopped answering");
    /* Either way the request is not at fault, so it moves rather than fails: to another
       prefill instance, or, when none is alive, it waits router.migrate_wait_ms for one to
       come (back). A supervised stage that takes longer than instance_timeout_ms to restart
       (a big model, a sanitizer build) is first marked dead, then answers again; failing
       the request then (its one retry spent on a transfer error the kill also caused) ended
       requests a restart of a few seconds would have served. The move cancels both sides,
       the silent instance's too, in case it comes back. */
    if (!restarted) {
        TD_LOG_WARN("router: %s req %llu: attempt %d lost before its first token: %s", q->oid,
                    (unsigned long long)q->loop.rid, q->pair.attempts, msg);
        rt_metrics_pair(&r->metrics, RT_PM_FAIL, RT_PF_DEAD);
    }
    rt_pair_out o = lost(q, msg);
    o.uncounted = !q->pair.pf_acked; /* sent to the process that died: not its fault */
    return o;
}

rt_pair_out rt_pair_expire(rt_router *r, rt_req *q, int64_t now)
{
    if (!q->pair.deadline_ms || started(q) || now <= q->pair.deadline_ms) return go_on();
    if (q->loop.state != RT_ST_SUBMITTED && q->loop.state != RT_ST_RUNNING) return go_on();
    char msg[400];
    snprintf(msg, sizeof msg,
             "no first token %lld ms after the request went to prefill instance %s and "
             "decode instance %s",
             (long long)(rt_pair_deadline(r->cfg, 0)), pf_name(r, q->pair.pinst),
             q->loop.inst >= 0 ? r->reg.inst[q->loop.inst].name : "?");
    return pair_failed(r, q, RT_PF_DEADLINE, true, msg);
}
