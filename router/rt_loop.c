/* rt_loop.c: the router loop thread. It alone owns the control-plane clients (one per
 * decode and prefill instance, via rt_registry), the request table and the router queue,
 * and it takes every scheduling decision. The HTTP threads only post to its inbox (new
 * requests, closed connections) and wake it through an eventfd; it answers through
 * q->http (rt_req.h) and resumes the connection (rt_req_wake).
 *
 * One iteration: poll(wake fd, client fds, <= 50 ms) -> take the inbox (admit: queue or
 * 429/503; closed connections: cancel) -> drain every client (replies, token events,
 * health; prefill instances' through rt_pair.c, whose verdicts rt_loop_act carries out)
 * -> liveness (move the requests of instances silent for instance_timeout_ms; answer the
 * queue with 503 when no instance is left) -> request deadlines (504) -> attempt
 * deadlines (disaggregated) -> heartbeats -> dispatch queued requests, round robin over
 * clients (rt_fair.c), to rt_reg_pick's choice (and, disaggregated, rt_pair_pick's)
 * -> poke idle suspended connections (so a client that went away is noticed).
 *
 * Stop (rt_loop_stop, after the drain in rt_main.c): every request still open ends with
 * 503 shutting_down and is cancelled on its instances; then a health call to each
 * instance that got a Cancel serves as a barrier (the node answers it only after reading
 * what came before it on the connection), waited for up to FLUSH_MS, so the Cancels are
 * not lost when the sockets close. */
#define _GNU_SOURCE /* POLLRDHUP */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <microhttpd.h>

#include "rt_choices.h"
#include "rt_loop.h"
#include "rt_logprobs.h"
#include "rt_loop_int.h"
#include "rt_member.h"
#include "td_clock.h"
#include "td_err.h"
#include "td_grow.h"

#define MAX_RETRIES 3
#define FLUSH_MS    500 /* stop: wait this long at most for the Cancels to arrive */

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
    q->loop.state = RT_ST_INBOX;
    atomic_fetch_add(&r->queued, 1);
    pthread_mutex_lock(&q->mu);
    q->http.suspended = true;
    MHD_suspend_connection(q->http.conn);
    pthread_mutex_unlock(&q->mu);
    q->loop.next = NULL;
    if (r->in_tail)
        r->in_tail->loop.next = q;
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
    q->loop.gone_next = r->gone_head;
    r->gone_head = q;
    pthread_mutex_unlock(&r->in_mu);
    wake_loop(r);
}

/* Every request on decode instance i lost its decode side; but those sent to process
 * `boot` (not 0: the new process a restart notice names, whose Health came first and which
 * was given requests since) are in good hands. */
static void lose_all(rt_router *r, int i, uint64_t boot, const char *why, int64_t now)
{
    for (uint32_t k = 0; k < r->table.cap; k++) {
        rt_req *q = r->table.slots[k];
        if (q && q->loop.inst == i && !(boot && q->loop.inst_boot == boot) &&
            (q->loop.state == RT_ST_SUBMITTED || q->loop.state == RT_ST_RUNNING))
            rt_loop_move(r, q, why, q->loop.state == RT_ST_RUNNING, now); /* RUNNING: taken */
    }
}

/* ---- control-plane input ---- */

static rt_req *find_call(rt_router *r, int i, uint64_t call_id)
{
    /* replies to Submit: the request is in the table with that call id on instance i */
    for (uint32_t k = 0; k < r->table.cap; k++) {
        rt_req *q = r->table.slots[k];
        if (q && q->loop.inst == i && q->loop.state == RT_ST_SUBMITTED &&
            q->loop.call_id == call_id)
            return q;
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
        rt_pair_out o = rt_pair_on_alloc(r, q, i, in, now);
        rt_loop_act(r, &o, now);
        return;
    }
    if (in->err) {
        /* no answer in time: the instance is probably going away */
        if (q->loop.retries < MAX_RETRIES) {
            q->loop.retries++;
            rt_loop_lose(r, q, "the decode instance did not answer", now);
        } else {
            rt_loop_fail(r, q, 503, "instance_unavailable", "the decode instance did not answer");
        }
        return;
    }
    const Td__Envelope *env = in->env;
    if (env->body_case == TD__ENVELOPE__BODY_ACK) {
        q->loop.state = RT_ST_RUNNING;
        return;
    }
    if (env->body_case != TD__ENVELOPE__BODY_ERROR) {
        rt_loop_fail(r, q, 500, NULL, "unexpected reply from the decode instance");
        return;
    }
    const Td__ErrorEvent *err = env->error;
    switch (err->code) {
    case TD__ERROR_CODE__ERR_BUSY:
        s->busy_until_ms = now + 100;
        if (q->loop.retries < 100) {
            rt_loop_requeue(r, q, false); /* busy is not a failure */
            return;
        }
        rt_loop_fail(r, q, 503, "instance_busy", err->message);
        return;
    case TD__ERROR_CODE__ERR_NO_SPACE:
    case TD__ERROR_CODE__ERR_INVALID: {
        rt_error e;
        rt_error_set(&e, 400, NULL, NULL, "%s", err->message);
        rt_stream_fail(q, &e);
        rt_metrics_request_end(&r->metrics, r->cfg, q, now, 400, NULL);
        rt_loop_retire(r, q);
        return;
    }
    case TD__ERROR_CODE__ERR_SHUTDOWN:
        /* a leaving (or stopping) instance refused what it never took: nothing new goes to it
           (its Health says the same), and the request goes elsewhere without counting as a
           move or a retry */
        s->draining = true;
        rt_loop_requeue(r, q, false);
        return;
    case TD__ERROR_CODE__ERR_PEER_FAILED:
        rt_loop_lose(r, q, err->message, now); /* elsewhere, or the same one once it re-formed */
        return;
    default:
        rt_loop_fail(r, q, 500, NULL, err->message);
        return;
    }
}

/* Append ids to q->loop.gen_ids (what a moved request resumes from). */
static int keep_ids(rt_req *q, const int32_t *ids, size_t n)
{
    if (!n) return 0;
    if (n > (size_t)(INT_MAX - q->loop.n_gen)) return TD_ERANGE;
    int rc = TD_GROW_INT(q->loop.gen_ids, q->loop.cap_gen, q->loop.n_gen + (int)n, 64);
    if (rc) return rc;
    memcpy(q->loop.gen_ids + q->loop.n_gen, ids,
           n * sizeof *ids); /* n_gen grows in rt_stream_tokens */
    return 0;
}

static void on_token(rt_router *r, int i, const Td__TokenEvent *t, int64_t now);

/* Disaggregated: keep decode-side events (a packed copy) until the prefill's PrefillDone of
 * the attempt is in (prefill_done): with logprobs all of them (PrefillDone brings the first
 * token's logprob), otherwise only the last one's finish, so that the response's usage has
 * the prefill's cached_tokens (the decode side can finish a short answer before the prefill
 * instance's notice arrives). The last event's tokens go out at once: the notice leaves a
 * busy prefill leader between its chunks, up to a chunk's time later (about a second at 1
 * thread), which held the last token back as the stream's longest inter-token gap (ITL p99,
 * BENCHMARKS.md "The last token waited for PrefillDone"). A prefill instance lost meanwhile
 * releases them (prefill_lost). True when t was taken care of here. */
static bool hold_event(rt_router *r, int i, rt_req *q, const Td__TokenEvent *t, int64_t now)
{
    if (!r->disagg || q->pair.pinst < 0 || q->loop.pd_seen) return false;
    if (!q->p.sampling.logprobs && t->finish == TD__FINISH_REASON__FINISH_NONE &&
        !q->loop.lp_hold.len)
        return false;
    Td__TokenEvent fin;
    if (!q->p.sampling.logprobs && t->n_token_ids && !q->loop.lp_hold.len) {
        Td__TokenEvent toks = *t; /* the tokens now, as an event that does not finish */
        toks.finish = TD__FINISH_REASON__FINISH_NONE;
        toks.usage = NULL;
        on_token(r, i, &toks, now);
        if (rt_table_get(&r->table, t->request_id) != q || q->loop.state != RT_ST_RUNNING)
            return true; /* a stop string ended it, or it failed */
        fin = *t; /* and the finish, with the usage, held */
        fin.n_token_ids = 0;
        fin.token_ids = NULL;
        t = &fin;
    }
    size_t n = td__token_event__get_packed_size(t);
    uint8_t *b = malloc(n + 4);
    uint32_t n32 = (uint32_t)n;
    int rc = b ? 0 : TD_ENOMEM;
    if (b) {
        memcpy(b, &n32, 4);
        td__token_event__pack(t, b + 4);
        rc = rt_buf_append(&q->loop.lp_hold, b, n + 4);
        free(b);
    }
    if (rc) {
        rt_loop_cancel(r, q);
        rt_loop_fail(r, q, 500, NULL, "out of memory while holding tokens");
    }
    return true;
}

static void on_token(rt_router *r, int i, const Td__TokenEvent *t, int64_t now)
{
    rt_req *q = rt_table_get(&r->table, t->request_id);
    if (!q || q->loop.inst != i ||
        (q->loop.state != RT_ST_SUBMITTED && q->loop.state != RT_ST_RUNNING))
        return;
    if (hold_event(r, i, q, t, now)) return;
    q->loop.state = RT_ST_RUNNING;
    if (t->usage) /* the current attempt's figure (a moved request's prompt is longer) */
        q->loop.n_cached = t->usage->cached_tokens < q->p.n_prompt ? (int)t->usage->cached_tokens
                                                                   : (int)q->p.n_prompt;
    if (t->n_token_ids) {
        if (!q->loop.t_first_ms) q->loop.t_first_ms = now;
        q->loop.t_last_ms = now;
        int64_t ns = td_now_ns();
        if (q->loop.t_tok_ns)
            rt_metrics_itl(&r->metrics, (double)(ns - q->loop.t_tok_ns) / 1e9, (int)t->n_token_ids);
        q->loop.t_tok_ns = ns;
        if (q->loop.lost_ms && q->loop.migrations) {
            TD_LOG_INFO("router: %s: moved: the stream goes on %lld ms after it lost its "
                        "instance",
                        q->oid, (long long)(now - q->loop.lost_ms));
            rt_metrics_migrated(&r->metrics, (double)(now - q->loop.lost_ms) / 1000.0);
        }
        q->loop.lost_ms = 0;
    }
    int rc = keep_ids(q, t->token_ids, t->n_token_ids);
    if (!rc) rc = rt_logprobs_keep(q, t);
    if (!rc) rc = rt_stream_tokens(r, q, t->token_ids, t->n_token_ids);
    if (rc < 0) {
        TD_LOG_ERR("router: %s: cannot process tokens: %s", q->oid, td_strerror(rc));
        rt_loop_cancel(r, q);
        rt_loop_fail(r, q, 500, NULL, "internal error while detokenizing");
        return;
    }
    if (rc == RT_FIN_STOP) {
        if (t->finish == TD__FINISH_REASON__FINISH_NONE) rt_loop_cancel(r, q);
        rt_loop_finish(r, q, RT_FIN_STOP);
        return;
    }
    switch (t->finish) {
    case TD__FINISH_REASON__FINISH_NONE:
        return;
    case TD__FINISH_REASON__FINISH_STOP:
        /* the instance does not send the end-of-generation token but counts it */
        if (t->usage && !q->p.gen_none &&
            (int64_t)t->usage->completion_tokens + q->loop.gen_base > q->loop.n_gen)
            q->loop.n_gen = (int)t->usage->completion_tokens + q->loop.gen_base;
        rt_loop_finish(r, q, RT_FIN_STOP);
        return;
    case TD__FINISH_REASON__FINISH_LENGTH:
        rt_loop_finish(r, q, RT_FIN_LENGTH);
        return;
    case TD__FINISH_REASON__FINISH_CANCELLED:
        rt_loop_fail(r, q, 503, "cancelled", "the request was cancelled by the decode instance");
        return;
    default:
        rt_loop_fail(r, q, 500, NULL, "the request failed on the decode instance");
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
            if (!q || q->loop.inst != i) continue;
            if (r->disagg) {
                rt_pair_out o = rt_pair_on_decode_error(r, q, ev->error);
                rt_loop_act(r, &o, now);
            } else if (rt_code_lost(ev->error->code))
                rt_loop_lose(r, q, ev->error->message, now);
            else
                rt_loop_fail(r, q, 500, NULL, ev->error->message);
        }
    }
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
    rt_reg_forget(s, "marked dead"); /* whatever comes back may be a new process */
    lose_all(r, i, 0, why, now);
}

/* A new process answers for decode instance i: what the old one held is gone. */
static void instance_restarted(rt_router *r, int i, int64_t now)
{
    rt_inst *s = &r->reg.inst[i];
    TD_LOG_WARN("router: decode instance %s (%s) restarted: moving its requests", s->name, s->url);
    char why[300];
    snprintf(why, sizeof why, "decode instance %s restarted", s->name);
    uint64_t boot = td_ctrl_client_epoch(s->c);
    rt_reg_restarted(s, boot);
    lose_all(r, i, boot, why, now);
}

/* ---- prefill instances (disaggregated mode; rt_pair.c decides, the loop acts) ---- */

static void on_pf_reply(rt_router *r, int j, const td_ctrl_client_in *in, int64_t now)
{
    rt_pair_out o = rt_pair_on_reply(r, j, in, now);
    rt_loop_act(r, &o, now);
}

/* PrefillDone of q's attempt is in (its first token's logprob in q->loop.first_lp): the
 * decode side's events held meanwhile go through, in order. */
static void prefill_done(rt_router *r, rt_req *q, int64_t now)
{
    q->loop.pd_seen = true;
    rt_buf held = q->loop.lp_hold;
    q->loop.lp_hold = (rt_buf){0};
    int inst = q->loop.inst; /* q may be over after any of them: not touched again */
    for (size_t off = 0; off + 4 <= held.len;) {
        uint32_t n;
        memcpy(&n, held.buf + off, 4);
        Td__TokenEvent *t = td__token_event__unpack(NULL, n, (const uint8_t *)held.buf + off + 4);
        off += 4 + (size_t)n;
        if (!t) continue; /* packed here: cannot fail but for memory */
        on_token(r, inst, t, now);
        td__token_event__free_unpacked(t, NULL);
    }
    rt_buf_free(&held);
}

static void on_pf_events(rt_router *r, int j, const td_ctrl_client_in *in, int64_t now)
{
    rt_inst *s = &r->reg.pf[j];
    if (rt_reg_seen(s, in->health, now))
        TD_LOG_INFO("router: prefill instance %s (%s) is serving", s->name, s->url);
    for (size_t k = 0; k < in->n_events; k++) {
        const Td__Event *ev = in->events[k];
        rt_pair_out o = rt_pair_on_event(r, j, ev);
        rt_loop_act(r, &o, now);
        if (ev->body_case == TD__EVENT__BODY_TOKEN) { /* its prompt logprobs */
            rt_req *q = rt_table_get(&r->table, ev->token->request_id);
            if (q && q->pair.pinst == j && rt_logprobs_keep(q, ev->token))
                TD_LOG_WARN("router: %s: prompt logprobs from prefill instance %s dropped", q->oid,
                            s->name);
        }
        if (ev->body_case != TD__EVENT__BODY_PREFILL_DONE) continue;
        const Td__PrefillDone *d = ev->prefill_done;
        rt_req *q = rt_table_get(&r->table, d->request_id);
        if (!q || q->pair.pinst != j || q->loop.pd_seen) continue;
        if (d->first_logprob) td_ctrl_logprob_from_pb(d->first_logprob, &q->loop.first_lp);
        q->loop.first_lp_set = d->first_logprob != NULL;
        prefill_done(r, q, now);
    }
}

/* The attempts on prefill instance j are lost (silent, or restarted: the new process knows
 * nothing of them), but those sent to process `boot` (lose_all). Each starts again, on
 * another instance or on j once it answers again, as a moved request does (rt_loop_lose: it
 * waits up to router.migrate_wait_ms for a live instance). */
static void prefill_lost(rt_router *r, int j, bool restarted, uint64_t boot, int64_t now)
{
    for (uint32_t k = 0; k < r->table.cap; k++) {
        rt_req *q = r->table.slots[k];
        if (!q || (boot && q->pair.pinst == j && q->pair.pf_boot == boot)) continue;
        /* a last event held for PrefillDone's cached_tokens: the notice will not come, the
           answer is complete without it (with logprobs it is not: the attempt fails over) */
        if (q->pair.pinst == j && !q->loop.pd_seen && !q->p.sampling.logprobs &&
            q->loop.lp_hold.len) {
            prefill_done(r, q, now);
            if (r->table.slots[k] != q) continue; /* it ended */
        }
        rt_pair_out o = rt_pair_prefill_lost(r, q, j, restarted);
        rt_loop_act(r, &o, now);
    }
}

static void prefill_died(rt_router *r, int j, int64_t now)
{
    rt_inst *s = &r->reg.pf[j];
    TD_LOG_WARN("router: prefill instance %s (%s) silent for %d ms: marked dead", s->name, s->url,
                r->cfg->router.instance_timeout_ms);
    rt_reg_forget(s, "marked dead");
    prefill_lost(r, j, false, 0, now);
}

void rt_loop_inst_lost(rt_router *r, bool pf, int k, const char *why, int64_t now)
{
    rt_inst *s = pf ? &r->reg.pf[k] : &r->reg.inst[k];
    rt_reg_forget(s, why);
    if (pf)
        prefill_lost(r, k, false, 0, now);
    else
        lose_all(r, k, 0, why, now);
}

static void prefill_restarted(rt_router *r, int j, int64_t now)
{
    rt_inst *s = &r->reg.pf[j];
    TD_LOG_WARN("router: prefill instance %s (%s) restarted: its prompts start again", s->name,
                s->url);
    uint64_t boot = td_ctrl_client_epoch(s->c);
    rt_reg_restarted(s, boot);
    prefill_lost(r, j, true, boot, now);
}

/* Attempts past their first-token deadline: both sides cancelled, the request failed. */
static void pair_deadlines(rt_router *r, int64_t now)
{
    for (uint32_t k = 0; k < r->table.cap; k++) {
        rt_req *q = r->table.slots[k];
        if (!q) continue;
        rt_pair_out o = rt_pair_expire(r, q, now);
        rt_loop_act(r, &o, now);
    }
}

/* Did s just die? (heard from, but not within the timeout: once per silence, whether it was
 * ready or not: one that said it was not ready (stopping, re-forming) and then went away may
 * still hold requests, or owe the PrefillDone a held last event waits for) */
static bool went_silent(rt_inst *s, int timeout, int64_t now)
{
    bool recent = s->ever_seen && now - s->last_seen_ms <= timeout;
    if (s->ever_seen && !recent && !s->silence_noted) {
        s->silence_noted = true;
        /* it rejoins with its next ready Health, not with any reply: a Cancel answered by
           a new process would bring it back with the old one's state (its boot id, so the
           new one's restart notice would move what was sent to it since) */
        s->alive = s->ready = false;
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
        if (went_silent(&r->reg.pf[j], timeout, now)) prefill_died(r, j, now);
    int n = rt_reg_n_alive(&r->reg);
    int n_pf = rt_reg_n_pf_alive(&r->reg, -1);
    atomic_store(&r->n_alive, n);
    atomic_store(&r->n_pf_alive, n_pf);
    /* Nobody can take the queue: answer the new requests now rather than let clients hang;
       but a request that is moving, or was in flight, waits up to router.migrate_wait_ms
       for an instance to come (back). */
    bool none = !n || (r->disagg && !n_pf);
    int wait = r->cfg->router.migrate_wait_ms;
    for (uint32_t k = 0; k < r->table.cap; k++) {
        rt_req *q = r->table.slots[k];
        if (!q || q->loop.state != RT_ST_QUEUED) continue;
        if (q->loop.lost_ms && now - q->loop.lost_ms > wait) {
            char msg[300];
            snprintf(msg, sizeof msg,
                     "its instance was lost after %d tokens and no instance took the "
                     "request over within %d ms (router.migrate_wait_ms)",
                     q->loop.n_gen, wait);
            rt_loop_fail(r, q, 503, "instance_unavailable", msg);
        } else if (none && !q->loop.lost_ms && q->loop.t_dispatch_ms) {
            /* it was in flight (back in the queue after a retry or a busy answer) when the
               last instance went: it waits as a moved request does */
            q->loop.lost_ms = now;
        } else if (none && !q->loop.lost_ms) {
            rt_loop_fail(r, q, 503, "no_instance",
                         n ? "no prefill instance is available"
                           : "no decode instance is available");
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
        rt_timeout_state where = q->loop.state == RT_ST_QUEUED ? RT_TO_QUEUED
                                 : q->loop.n_gen > 0           ? RT_TO_GENERATING
                                                               : RT_TO_WAITING;
        long long limit = (long long)(q->expires_ms - q->t_arrive_ms);
        TD_LOG_INFO("router: %s: its deadline of %lld ms passed while %s (tokens: %d): ended",
                    q->oid, limit, where_name[where], q->loop.n_gen);
        rt_metrics_timeout(&r->metrics, where);
        rt_loop_cancel_decode_side(r, q);
        rt_error e;
        rt_error_set(&e, 504, NULL, "request_timeout",
                     "the request did not complete within its timeout of %lld ms (%s; tokens "
                     "generated: %d)",
                     limit, where_name[where], q->loop.n_gen);
        rt_stream_fail(q, &e);
        rt_metrics_request_end(&r->metrics, r->cfg, q, now, 504, "request_timeout");
        rt_loop_retire(r, q);
    }
}

static void publish_metrics(rt_router *r)
{
    rt_metrics *m = &r->metrics;
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < r->reg.n && i < m->n_inst; i++) {
        rt_inst_gauge g = rt_reg_gauge(&r->reg.inst[i]);
        rt_metrics_publish_inst(m, i, &g);
    }
    for (int j = 0; j < r->reg.n_pf && j < m->n_pf; j++) {
        const rt_inst *s = &r->reg.pf[j];
        rt_pf_gauge g = {.queued_tokens = s->queued_tokens,
                         .running = s->running,
                         .waiting = s->waiting,
                         .active = s->active,
                         .alive = s->alive,
                         .compute = s->compute,
                         .cache = s->cst};
        if (!s->vacant) {
            snprintf(g.name, sizeof g.name, "%s", s->name);
            snprintf(g.url, sizeof g.url, "%s", s->url);
        }
        g.joined = s->joined;
        g.draining = s->draining;
        rt_metrics_publish_pf(m, j, &g);
    }
    rt_metrics_publish_router(m, atomic_load(&r->queued), (int)r->table.count - r->fair.len,
                              atomic_load(&r->draining));
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
        rt_req *next = nq->loop.next;
        nq->loop.next = NULL;
        rt_loop_admit(r, nq);
        nq = next;
    }
    while (gone) {
        rt_req *next = gone->loop.gone_next;
        if (rt_choices_many(gone)) {
            rt_choices_abort(r, gone, 499, "client_closed", "the client closed the connection");
        } else if (gone->loop.state == RT_ST_SUBMITTED || gone->loop.state == RT_ST_RUNNING) {
            rt_loop_cancel(r, gone);
            rt_metrics_request_end(&r->metrics, r->cfg, gone, td_now_ms(), 499, "client_closed");
            rt_loop_retire(r, gone);
        } else if (gone->loop.state == RT_ST_QUEUED) {
            rt_metrics_request_end(&r->metrics, r->cfg, gone, td_now_ms(), 499, "client_closed");
            rt_loop_retire(r, gone);
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
 * gone, as it does for every HTTP server that checks; so does a FIN behind unread bytes
 * (POLLRDHUP), which is how a TLS client leaves (a close_notify alert, then FIN). */
static bool client_closed(rt_req *q)
{
    bool closed = false;
    pthread_mutex_lock(&q->mu);
    if (q->http.suspended && !q->http.gone && q->http.fd >= 0) {
        char c;
        ssize_t n = recv(q->http.fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        closed = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
        struct pollfd pf = {.fd = q->http.fd, .events = POLLRDHUP};
        if (n > 0 && poll(&pf, 1, 0) == 1) closed = pf.revents & (POLLRDHUP | POLLHUP | POLLERR);
    }
    pthread_mutex_unlock(&q->mu);
    return closed;
}

static void poke(rt_router *r)
{
    for (uint32_t k = 0; k < r->table.cap; k++) {
        rt_req *q = r->table.slots[k];
        if (!q) continue;
        if (q->ch.parent) { /* a choice: its parent holds the connection */
            if (client_closed(q->ch.parent))
                rt_choices_abort(r, q->ch.parent, 499, "client_closed",
                                 "the client closed the connection");
            else
                rt_req_wake(q->ch.parent);
            continue;
        }
        if (client_closed(q)) {
            TD_LOG_DEBUG("router: %s: the client closed its connection: cancelled", q->oid);
            if (q->loop.state == RT_ST_SUBMITTED || q->loop.state == RT_ST_RUNNING)
                rt_loop_cancel(r, q);
            rt_error e; /* never seen: it makes MHD write, fail and complete the connection */
            rt_error_set(&e, 499, NULL, NULL, "the client closed the connection");
            rt_stream_fail(q, &e);
            rt_metrics_request_end(&r->metrics, r->cfg, q, td_now_ms(), 499, "client_closed");
            rt_loop_retire(r, q);
            continue;
        }
        rt_req_wake(q);
    }
}

/* Wait up to wait_ms for the wake fd, the membership socket or any control client (fds:
 * room for 2 + cap + cap_pf; a vacant slot's entry is -1, which poll skips). */
static void wait_input(rt_router *r, struct pollfd *fds, int wait_ms)
{
    int n = r->reg.n, n_pf = r->reg.n_pf;
    fds[0] = (struct pollfd){.fd = r->wake_fd, .events = POLLIN};
    fds[1] = (struct pollfd){.fd = rt_member_fd(r->member), .events = POLLIN};
    for (int i = 0; i < n; i++)
        fds[i + 2] = (struct pollfd){
            .fd = r->reg.inst[i].c ? td_ctrl_client_fd(r->reg.inst[i].c) : -1, .events = POLLIN};
    for (int j = 0; j < n_pf; j++)
        fds[n + j + 2] = (struct pollfd){
            .fd = r->reg.pf[j].c ? td_ctrl_client_fd(r->reg.pf[j].c) : -1, .events = POLLIN};
    poll(fds, (nfds_t)(n + n_pf) + 2, wait_ms);
}

/* Everything the control clients have: replies, events, health. */
static void read_instances(rt_router *r, int64_t now)
{
    for (int i = 0; i < r->reg.n; i++) {
        rt_inst *s = &r->reg.inst[i];
        while (s->c && td_ctrl_client_recv(s->c, &s->in, 0) == 0) {
            r->t_events_ns = td_now_ns();
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
        while (s->c && td_ctrl_client_recv(s->c, &s->in, 0) == 0) {
            if (s->in.kind == TD_CTRL_IN_REPLY)
                on_pf_reply(r, j, &s->in, now);
            else if (s->in.kind == TD_CTRL_IN_EVENTS)
                on_pf_events(r, j, &s->in, now);
            else if (s->in.kind == TD_CTRL_IN_RESTARTED)
                prefill_restarted(r, j, now);
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
    /* who is told first: a failing choice retires its siblings (rt_choices.h) at once */
    for (uint32_t k = 0; k < r->table.cap && told; k++) {
        rt_req *q = r->table.slots[k];
        if (q && q->loop.inst >= 0) told[q->loop.inst] = true;
        if (q && q->pair.pf_busy && q->pair.pinst >= 0) told[r->reg.n + q->pair.pinst] = true;
    }
    for (uint32_t k = 0; k < r->table.cap; k++) {
        rt_req *q = r->table.slots[k];
        if (!q) continue;
        rt_loop_cancel(r, q);
        rt_loop_fail(r, q, 503, "shutting_down", "the router is shutting down");
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
    int64_t end = td_now_ms() + FLUSH_MS;
    while (waiting > 0 && td_now_ms() < end) {
        wait_input(r, fds, 10);
        read_instances(r, td_now_ms()); /* on_reply clears hb_call */
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
    struct pollfd *fds = calloc((size_t)(r->reg.cap + r->reg.cap_pf) + 2, sizeof *fds);
    if (!fds) {
        TD_LOG_ERR("router: out of memory in the loop");
        return NULL;
    }
    int64_t last_poke = td_now_ms();
    while (!atomic_load(&r->stop)) {
        wait_input(r, fds, r->cfg->router.heartbeat_ms < 50 ? r->cfg->router.heartbeat_ms : 50);
        int64_t now = td_now_ms();
        take_inbox(r);
        read_instances(r, now);
        now = td_now_ms();
        liveness(r, now);
        rt_member_poll(r, r->member, now);
        expire(r, now);
        if (r->disagg) pair_deadlines(r, now);
        rt_reg_heartbeat(&r->reg, &r->cfg->router, now);
        rt_loop_dispatch(r, now);
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
    if (!rc) rc = rt_member_start(r, &r->member);
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
        rt_req *next = g->loop.gone_next;
        rt_req_release(g);
        g = next;
    }
    rt_member_stop(r->member);
    r->member = NULL;
    rt_reg_fini(&r->reg);
    rt_table_fini(&r->table);
    if (r->wake_fd >= 0) close(r->wake_fd);
    r->wake_fd = -1;
}
