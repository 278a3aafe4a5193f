/* dc_report.c: the decode leader's figures at exit, in its log: steps and their mean time, the
 * collectives, the steps by compute threads, speculation and the draft model, where the serving
 * loop's time went, and the KV transfers still alive (the tests' leak check). The decode
 * benchmarks (BENCHMARKS.md, tools/) and tests read these lines: change them with their readers. */
#include <stdio.h>

#include "dc_node_int.h"
#include "td_err.h"

/* Where the serving loop's time went, per step that ran (the decode benchmark reads it):
 * sequential, the loop is inbox + plan + encode + forward + commit (token events inside it);
 * with overlap, inbox (token events inside it) + waiting for the pass + commit + plan +
 * encode, the pass computing from its launch to the join. */
static void log_phases(const dc_node *n)
{
    if (!n->stats.step || !n->stats.ns_serve) return;
    double per = 1e6 * (double)n->stats.step, all = (double)n->stats.ns_serve / 100.0;
    bool ov = n->dcfg->overlap;
    int64_t mid = ov ? n->stats.ns_join : n->stats.ns_forward;
    TD_LOG_INFO("decode %s: per step (ms, %% of the loop): loop %.3f, inbox+transfers+health "
                "%.3f (%.1f%%), plan %.3f (%.1f%%), plan encode %.3f (%.1f%%), %s %.3f (%.1f%%), "
                "commit %.3f (%.1f%%), token events %.3f (%.1f%%, inside the %s), forward pass "
                "%.3f",
                n->p->instance, (double)n->stats.ns_serve / per, (double)n->stats.ns_inbox / per,
                (double)n->stats.ns_inbox / all, (double)n->stats.ns_plan / per,
                (double)n->stats.ns_plan / all, (double)n->stats.ns_encode / per,
                (double)n->stats.ns_encode / all, ov ? "waiting for the pass" : "forward",
                (double)mid / per, (double)mid / all, (double)n->stats.ns_commit / per,
                (double)n->stats.ns_commit / all, (double)n->serve.ns_stream / per,
                (double)n->serve.ns_stream / all, ov ? "inbox" : "commit",
                (double)n->stats.ns_forward / per);
    if (ov)
        TD_LOG_INFO("decode %s: overlap per step (ms): pass %.3f, thread hand-offs %.3f, the "
                    "node thread's work outlasting the pass %.3f",
                    n->p->instance, (double)n->ovl.ns_pass / per, (double)n->ovl.ns_handoff / per,
                    (double)n->ovl.ns_io_over / per);
}

void dc_report_log(const dc_node *n)
{
    /* the figures the decode benchmark reads (BENCHMARKS.md) */
    dc_shm_stats ss = n->form.shm_done;
    if (n->form.shm) {
        dc_shm_stats cur;
        dc_shm_get_stats(n->form.shm, &cur);
        ss.n_allreduce += cur.n_allreduce;
        ss.ns_allreduce += cur.ns_allreduce;
        ss.n_gather += cur.n_gather;
        ss.ns_gather += cur.ns_gather;
    }
    dc_sched_stats st = dc_sched_get_stats(n->leader.sched);
    TD_LOG_INFO("decode %s: %llu steps, %lld tokens, mean step %.3f ms, allreduce %llu x "
                "%.2f us (%.1f%% of step time), logit gather %llu x %.2f us, %llu preemptions, "
                "%d formations",
                n->p->instance, (unsigned long long)n->stats.step, (long long)n->stats.step_tokens,
                n->stats.step ? (double)n->stats.step_ns / (double)n->stats.step / 1e6 : 0.0,
                (unsigned long long)ss.n_allreduce,
                ss.n_allreduce ? (double)ss.ns_allreduce / (double)ss.n_allreduce / 1e3 : 0.0,
                n->stats.step_ns ? 100.0 * (double)ss.ns_allreduce / (double)n->stats.step_ns : 0.0,
                (unsigned long long)ss.n_gather,
                ss.n_gather ? (double)ss.ns_gather / (double)ss.n_gather / 1e3 : 0.0,
                (unsigned long long)st.preemptions, n->life.formations);
    if (n->dcfg->tbo_min_tokens && n->proc.rt.engine)
        TD_LOG_INFO("decode %s: two-batch overlap (decode[].tbo_min_tokens %d): %llu of %llu steps "
                    "ran as two micro-batches",
                    n->p->instance, n->dcfg->tbo_min_tokens,
                    (unsigned long long)kn_engine_tbo_count(n->proc.rt.engine),
                    (unsigned long long)n->stats.step);
    const dc_threads *th = &n->leader.threads;
    if (th->n_levels > 1 && th->steps) {
        char buf[256];
        size_t off = 0;
        for (int i = 0; i < th->n_levels && off < sizeof buf; i++)
            off += (size_t)snprintf(buf + off, sizeof buf - off, "%s%d: %.1f%%", i ? ", " : "",
                                    dc_threads_of(th, i), 100.0 * (double)th->at[i] / th->steps);
        TD_LOG_INFO("decode %s: steps by compute threads (decode[].adaptive_threads) %s",
                    n->p->instance, buf);
    }
    if (n->leader.cores) {
        td_coreshare_stats cs = td_coreshare_get_stats(n->leader.cores);
        TD_LOG_INFO("decode %s: shared cores (decode[].share_cores): %llu steps claimed them for "
                    "%.1f s; %llu waited first for the prefill stages' share, %.1f s in all",
                    n->p->instance, (unsigned long long)cs.steps, cs.claimed_ms / 1e3,
                    (unsigned long long)cs.waits, cs.wait_ms / 1e3);
        if (n->dcfg->share_cores == TD_CFG_SHARE_AUTO)
            TD_LOG_INFO("decode %s: shared cores, auto: %llu steps left to the scheduler; "
                        "claiming began %llu times; last measured: steps beside busy stages "
                        "%.2fx their time when claiming, three in four over %.1f ms (claims "
                        "when >= %.1fx and over %.1f ms)",
                        n->p->instance, (unsigned long long)cs.unclaimed,
                        (unsigned long long)cs.switches, cs.stretch, cs.p25_ms,
                        TD_CORESHARE_AUTO_STRETCH, n->dcfg->itl_target_ms);
    }
    if (st.spec_drafts)
        TD_LOG_INFO("decode %s: speculation: %llu verifications, %llu proposed tokens, %llu "
                    "accepted (%.1f%%), %.2f tokens per verification; step cost model: %.2f ms "
                    "a one-row step, %.2f ms a verification row; %llu steps held off by the "
                    "measured gate",
                    n->p->instance, (unsigned long long)st.spec_drafts,
                    (unsigned long long)st.spec_draft_tokens, (unsigned long long)st.spec_accepted,
                    100.0 * (double)st.spec_accepted / (double)st.spec_draft_tokens,
                    1.0 + (double)st.spec_accepted / (double)st.spec_drafts, st.cost_decode_ms,
                    st.cost_verify_ms, (unsigned long long)st.spec_held_steps);
    if (n->leader.draft) {
        dc_draft_stats ds = dc_draft_get_stats(n->leader.draft);
        TD_LOG_INFO("decode %s: draft model: %llu calls, %llu passes, %llu tokens computed, %llu "
                    "proposed, %llu requests refused, %.1f ms (%.1f%% of step time)",
                    n->p->instance, (unsigned long long)ds.calls, (unsigned long long)ds.passes,
                    (unsigned long long)ds.rows, (unsigned long long)ds.proposals,
                    (unsigned long long)ds.refused, (double)ds.ns / 1e6,
                    n->stats.step_ns ? 100.0 * (double)ds.ns / (double)n->stats.step_ns : 0.0);
    }
    if (n->dcfg->dp > 1) {
        /* the gathers and reduces hold the waits for the other members: what two-batch
         * overlap could hide at most */
        dc_shm_stats gs;
        dc_group_stats(n, &gs);
        double ns = (double)(gs.ns_gather + gs.ns_allreduce);
        TD_LOG_INFO("decode %s: dp group: %llu rounds, %llu idle (member %d of %s's %d); %llu "
                    "gathers %.1f us, %llu reduces %.1f us: %.1f%% of step time",
                    n->p->instance, (unsigned long long)n->group.rounds,
                    (unsigned long long)n->group.idle_rounds, n->dcfg->dp_rank, n->dcfg->dp_group,
                    n->dcfg->dp, (unsigned long long)gs.n_gather,
                    gs.n_gather ? (double)gs.ns_gather / (double)gs.n_gather / 1e3 : 0.0,
                    (unsigned long long)gs.n_allreduce,
                    gs.n_allreduce ? (double)gs.ns_allreduce / (double)gs.n_allreduce / 1e3 : 0.0,
                    n->stats.step_ns ? 100.0 * ns / (double)n->stats.step_ns : 0.0);
    }
    log_phases(n);
    if (n->plane.xfer) {
        /* leak check of the tests: every transfer released on every rank */
        char per_rank[256] = "";
        size_t used = 0;
        for (int r = 0; r < n->dcfg->tp && used < sizeof per_rank; r++)
            used += (size_t)snprintf(per_rank + used, sizeof per_rank - used, "%s%d", r ? "," : "",
                                     dc_xfer_dec_requests(n->plane.xfer, r));
        TD_LOG_INFO("decode %s: kvxfer: %d transfers alive, dec_requests %s", n->p->instance,
                    dc_xfer_pending(n->plane.xfer), per_rank);
    }
}
