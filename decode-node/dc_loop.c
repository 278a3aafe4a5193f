/* dc_loop.c: the leader's serving loop (SERVING): each step planned, published to the other
 * ranks, computed and committed, one after another or with the inbox and the last step's
 * events served while the pass computes (decode[].overlap, dc_async.c); the step claims the
 * host's cores where decode[].share_cores asks (common/td_coreshare.h). This file owns the
 * step figures (dc_stats, dc_node_int.h); the rank's life around the loop (formations, the
 * stop) is dc_node.c's. */
#include <stdbool.h>
#include <stdint.h>

#include "dc_node_int.h"
#include "dc_plan.h"
#include "td_clock.h"
#include "td_err.h"

#define IDLE_WAIT_MS 200 /* leader's inbox wait while nothing runs (liveness checks) */
#define XFER_WAIT_MS 2   /* ... while only KV transfers are in flight: react quickly */
/* a dp group's member (dc_group.c) while nothing runs: it sleeps on the group's round word
 * instead of the inbox, this long at a time between looks at the inbox */
#define GROUP_IDLE_MS 2

/* A step between its plan and its commit. */
typedef struct {
    dc_step st;
    int k;          /* its tokens */
    int rc;         /* publishing the plan failed: the step's requests fail in the commit */
    int64_t t_plan; /* when its planning began */
    int64_t t_fwd;  /* when its forward pass began */
} step_run;

/* Plan the next step and publish it to the other ranks: its tokens (0: nothing runnable)
 * or a negative td_err of the planning. */
static int step_begin(dc_node *n, step_run *sr)
{
    sr->t_plan = td_now_ns();
    int k = sr->k = dc_sched_plan(n->leader.sched, &sr->st);
    int64_t t0 = td_now_ns();
    if (k == 0 && (sr->rc = dc_tier_flush(n, n->stats.step)))
        return sr->rc; /* copies of an empty step */
    if (k <= 0) return k;
    n->stats.ns_plan += t0 - sr->t_plan;
    if (n->leader.cores) { /* the stages' share of the last period first (step_end releases) */
        td_coreshare_claim(n->leader.cores);
        int64_t t1 = td_now_ns();
        sr->t_plan += t1 - t0; /* the step's time, as its cost model learns it, is not the wait */
        t0 = t1;
    }
    void *buf;
    size_t cap, len;
    int nc, rc = dc_shm_plan_begin(n->form.shm, &buf, &cap);
    const kn_kv_tier_op *copies = dc_tier_pending(n, &nc);
    int threads = dc_threads_next(&n->leader.threads);
    if (!rc)
        rc = dc_plan_encode(&sr->st.batch, copies, nc, dc_kv(n)->block_size, n->stats.step, threads,
                            buf, cap, &len);
    dc_node_use_threads(n, threads);
    if (!rc && sr->st.batch.n_logits > n->leader.logit_rows)
        rc = dc_node_grow_logits(n, sr->st.batch.n_logits);
    if (!rc) rc = dc_shm_plan_commit(n->form.shm, len);
    if (!rc) dc_tier_sent(n);
    sr->rc = rc;
    sr->t_fwd = td_now_ns();
    n->stats.ns_encode += sr->t_fwd - t0;
    return k;
}

/* The step's forward pass ended with rc: commit it (sample, stop rules, events). Its
 * tokens, or rc. */
static int step_end(dc_node *n, step_run *sr, int rc)
{
    int64_t t_commit = td_now_ns();
    n->stats.step++;
    if (rc) dc_node_step_failed(n, rc); /* its requests fail in the commit: their events say why */
    dc_sched_commit(n->leader.sched, n->leader.logits, rc);
    if (n->leader.cores) /* before the cost model learns this step: its prediction */
        td_coreshare_release(n->leader.cores, n->dcfg->itl_target_ms,
                             dc_sched_predict_ms(n->leader.sched));
    int64_t t1 = td_now_ns();
    n->stats.ns_forward += t_commit - sr->t_fwd;
    n->stats.ns_commit += t1 - t_commit;
    /* the whole step, as its decodes wait for it: the cost model behind itl_target_ms */
    if (!rc) {
        double ms = (double)(t1 - sr->t_plan) / 1e6;
        dc_threads_observe(&n->leader.threads, ms, dc_sched_predict_ms(n->leader.sched));
        dc_sched_observe(n->leader.sched, ms);
        n->stats.step_hist[td_step_hist_bucket((double)(t1 - sr->t_plan) / 1e9)]++;
        n->stats.step_us += (uint64_t)(t1 - sr->t_plan) / 1000u;
    }
    n->stats.step_ns += t1 - sr->t_fwd + (sr->t_fwd - sr->t_plan);
    n->stats.step_tokens += sr->k;
    return rc ? rc : sr->k;
}

static int run_step(dc_node *n)
{
    step_run sr;
    int k = step_begin(n, &sr);
    if (k <= 0) return k;
    int rc = sr.rc;
    if (!rc) rc = dc_group_forward(n, &sr.st.batch, n->leader.logits);
    return step_end(n, &sr, rc);
}

/* The inbox, the transfers and the health, before a step: wait ms for the first message
 * (*ns_wait: how long it took, dc_serve_inbox). */
static int serve_io(dc_node *n, int wait, int64_t *last_health, int64_t *ns_wait)
{
    int rc = dc_serve_inbox(n, wait, ns_wait);
    if (rc) return rc;
    dc_serve_transfers(n);
    dc_serve_health_tick(n, last_health);
    return 0;
}

/* The inbox wait before a step: none after a step that ran (there is more work); a short
 * one while only KV transfers are in flight (their completion is polled: react in ~2 ms,
 * never spin); a long one when idle. */
static int inbox_wait(const dc_node *n, int k)
{
    int pending = dc_xfer_pending(n->plane.xfer);
    return dc_sched_idle(n->leader.sched) && !pending ? (n->dcfg->dp > 1 ? 0 : IDLE_WAIT_MS)
           : k > 0 || !pending                        ? 0
                                                      : XFER_WAIT_MS;
}

/* SERVING, one step after another. Returns 0 when *stop was set, a failure of the instance
 * (a rank died or is silent, a step failed: the caller re-forms), or, with *fatal, a
 * failure of the control server. */
static int serve_sequential(dc_node *n, bool *fatal)
{
    int64_t last_health = 0, ns_wait = 0;
    int k = 0; /* tokens of the last step */
    int rc = 0;
    while (!dc_node_stop_now(n)) {
        int64_t t_loop = td_now_ns();
        if ((rc = serve_io(n, inbox_wait(n, k), &last_health, &ns_wait))) {
            *fatal = true;
            return rc;
        }
        int64_t t_in = td_now_ns();
        k = 0;
        if ((rc = dc_serve_sync_allocs(n))) return rc; /* no pass in flight here */
        bool idle = dc_sched_idle(n->leader.sched);
        if (!idle) {
            if ((rc = run_step(n)) < 0) return rc;
            k = rc;
            if (dc_sched_idle(n->leader.sched)) dc_serve_health(n); /* the load dropped to 0 */
        }
        /* a dp group's member without rows takes its part in the others' rounds */
        if (k == 0 && (rc = dc_group_idle(n, idle && !dc_xfer_pending(n->plane.xfer) ? GROUP_IDLE_MS
                                                                                     : 0)) < 0)
            return rc;
        /* no step ran (idle, or only transfers): notice a dead rank now, not at the next
         * step */
        if (k == 0 && ((rc = dc_shm_check(n->form.shm)) || (rc = dc_group_check(n)))) return rc;
        if (k > 0) { /* only the loops that ran a step, without an idle wait before it */
            n->stats.ns_inbox += t_in - t_loop - ns_wait;
            n->stats.ns_serve += td_now_ns() - t_loop - ns_wait;
        }
    }
    return 0;
}

/* SERVING with overlap (decode[].overlap): step N's forward pass runs on the forward thread
 * while this thread sends step N-1's token events and serves the inbox, the transfers and
 * the health; then it joins the pass, commits it (sampling must see step N's logits before
 * step N + 1 embeds its tokens) and plans and launches step N + 1, holding the events back
 * meanwhile. Every request's tokens are the sequential path's: the scheduler runs the same
 * calls in the same order per request, only the inbox is read while the pass computes.
 * Returns as serve_sequential, with no pass in flight and no event held. */
static int serve_overlap(dc_node *n, bool *fatal)
{
    int64_t last_health = 0, ns_wait = 0;
    step_run sr;
    bool flying = false; /* sr's forward pass runs */
    int k = 0, rc = 0;
    while (!dc_node_stop_now(n)) {
        int64_t t_loop = td_now_ns();
        dc_async_flush(n); /* the last step's events */
        if ((rc = serve_io(n, flying ? 0 : inbox_wait(n, k), &last_health, &ns_wait))) {
            *fatal = true;
            break;
        }
        int64_t t_in = td_now_ns();
        k = 0;
        dc_async_hold(n, true);
        if (flying) {
            flying = false;
            int64_t t_join = td_now_ns();
            int rc_fwd = dc_async_join(n);
            n->stats.ns_join += td_now_ns() - t_join;
            if ((rc = step_end(n, &sr, rc_fwd)) < 0) break;
            k = rc;
        }
        if ((rc = dc_serve_sync_allocs(n))) break; /* joined: no pass in flight */
        if (!dc_sched_idle(n->leader.sched)) {
            if ((rc = step_begin(n, &sr)) < 0) break;
            if (rc > 0 && !sr.rc && n->dcfg->dp > 1 && !n->group.ready) sr.rc = TD_ESTATE;
            if (rc > 0 && !sr.rc) {
                dc_group_round(n); /* a dp group's round: the idle members wake */
                dc_async_launch(n, &sr.st.batch, n->leader.logits);
                flying = true;
            } else if (rc > 0 && (rc = step_end(n, &sr, sr.rc)) < 0) {
                break;
            }
        }
        dc_async_hold(n, false);
        if (!flying) dc_async_flush(n); /* no pass to hide them behind */
        rc = 0;
        if (k > 0 && !flying && dc_sched_idle(n->leader.sched)) dc_serve_health(n); /* load 0 */
        /* a dp group's member without a pass of its own takes its part in the others' rounds
         * (the engine is free: no pass in flight) */
        if (!flying && k == 0 &&
            (rc = dc_group_idle(n, dc_sched_idle(n->leader.sched) && !dc_xfer_pending(n->plane.xfer)
                                       ? GROUP_IDLE_MS
                                       : 0)) < 0)
            break;
        rc = 0;
        if (!flying && k == 0 && ((rc = dc_shm_check(n->form.shm)) || (rc = dc_group_check(n))))
            break;
        if (k > 0) { /* as in serve_sequential */
            n->stats.ns_inbox += t_in - t_loop - ns_wait;
            n->stats.ns_serve += td_now_ns() - t_loop - ns_wait;
        }
    }
    dc_async_hold(n, false);
    if (flying) { /* stopping, or the control server failed: the pass ends first */
        int rc2 = step_end(n, &sr, dc_async_join(n));
        if (rc2 < 0 && !rc && !*n->p->stop) rc = rc2;
    }
    dc_async_flush(n);
    return rc;
}

int dc_loop_serve(dc_node *n, bool *fatal)
{
    return n->ovl.fwd ? serve_overlap(n, fatal) : serve_sequential(n, fatal);
}
