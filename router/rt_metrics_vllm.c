/* rt_metrics_vllm.c: the router's series under the names stock dashboards query: vLLM's
 * (vllm:*, with vLLM v1's bucket bounds and a model_name label) and SGLang's PD-disaggregation
 * ones (sglang:kv_transfer_*), next to Tandem's own KV-transfer histograms in base units
 * (tandem_kv_transfer_*). docs/api.md ("Metrics") maps every name to what it measures here.
 *
 * The router measures every request-level series (it sees each request from its arrival to
 * its last byte); the per-instance gauges and counts (preemptions, prefix cache, steps,
 * speculative decoding) come from the instances' Health, the KV-transfer figures from
 * PrefillDone (the prefill stages measure their own pushes). Request phases, in the
 * router's clock:
 *   arrival --queue--> dispatch (Submit / Alloc+Prefill sent) --prefill--> first token
 *           --decode--> last token; e2e: arrival to the response's end.
 * This file writes rt_metrics.v only; the per-instance counts it renders are
 * rt_metrics_inst.c's (rt_metrics.tally), the pairing counts rt_metrics.c's.
 * Threading: rt_metrics_itl takes m->mu; the others run with it held (rt_metrics_set_model:
 * before the loop starts). */
#include <stdio.h>
#include <string.h>

#include "rt_metrics.h"

/* vLLM v1's bounds (vllm/v1/metrics/loggers.py) */
static const double TTFT_LE[] = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                 0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                 20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
static const double ITL_LE[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
static const double REQ_LE[] = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
/* Tandem's KV transfer: seconds, bytes, bytes per second */
static const double KV_S_LE[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                 0.05,   0.1,     0.25,   0.5,   1.0,    2.5,   5.0,  10.0};
static const double KV_B_LE[] = {16384.0,      65536.0,      262144.0,      1048576.0,
                                 4194304.0,    16777216.0,   67108864.0,    268435456.0,
                                 1073741824.0, 4294967296.0, 17179869184.0, 68719476736.0};
static const double KV_BW_LE[] = {1e7, 2.5e7, 5e7,    1e8,  2.5e8, 5e8,    1e9,  2.5e9,
                                  5e9, 1e10,  2.5e10, 5e10, 1e11,  2.5e11, 5e11, 1e12};
#define NB(a)      ((int)(sizeof(a) / sizeof(a)[0]))
#define BOUNDS(a)  ((rt_bounds){(a), NB(a)})
#define TOK_BOUNDS ((rt_bounds){m->v.tok_le, m->v.n_tok_le})

void rt_metrics_set_model(rt_metrics *m, const char *name, int32_t n_ctx)
{
    snprintf(m->v.model, sizeof m->v.model, "%s", name);
    /* vLLM's build_1_2_5_buckets(max_model_len): 1, 2, 5, 10, 20, 50, ... <= n_ctx */
    static const int mant[3] = {1, 2, 5};
    m->v.n_tok_le = 0;
    for (double e = 1; m->v.n_tok_le < RT_HIST_MAX; e *= 10) {
        int k = 0;
        for (; k < 3 && m->v.n_tok_le < RT_HIST_MAX && mant[k] * e <= (n_ctx > 0 ? n_ctx : 1); k++)
            m->v.tok_le[m->v.n_tok_le++] = mant[k] * e;
        if (k < 3) break;
    }
}

void rt_metrics_itl(rt_metrics *m, double gap, int k)
{
    if (k <= 0 || gap < 0) return;
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < k; i++)
        rt_hist_observe(&m->v.itl, BOUNDS(ITL_LE), gap / k);
    pthread_mutex_unlock(&m->mu);
}

void rt_metrics_vllm_end(rt_metrics *m, const rt_req *q, int64_t now_ms, int status,
                         const char *outcome)
{
    rt_vmetrics *v = &m->v;
    const rt_req_loop *l = &q->loop;
    v->gen_tokens += (uint64_t)(l->n_gen > 0 ? l->n_gen : 0);
    if (l->t_first_ms) v->prompt_tokens += q->p.n_prompt; /* its prompt was prefilled */
    if (status == 499) v->success[RT_FR_ABORT]++;
    if (status != 200) return;
    rt_fin_reason fr = RT_FR_STOP;
    if (outcome && !strcmp(outcome, "length")) fr = RT_FR_LENGTH;
    if (outcome && !strcmp(outcome, "tool_calls")) fr = RT_FR_TOOL_CALLS;
    v->success[fr]++;
    rt_hist_observe(&v->e2e, BOUNDS(REQ_LE), (double)(now_ms - q->t_arrive_ms) / 1000.0);
    rt_hist_observe(&v->prompt, TOK_BOUNDS, (double)q->p.n_prompt);
    rt_hist_observe(&v->gen, TOK_BOUNDS, (double)(l->n_gen > 0 ? l->n_gen : 0));
    int64_t disp = l->t_dispatch_ms ? l->t_dispatch_ms : now_ms;
    rt_hist_observe(&v->queue, BOUNDS(REQ_LE), (double)(disp - q->t_arrive_ms) / 1000.0);
    if (!l->t_first_ms) return;
    double ttft = (double)(l->t_first_ms - q->t_arrive_ms) / 1000.0;
    double prefill = (double)(l->t_first_ms - disp) / 1000.0;
    double decode = (double)(l->t_last_ms - l->t_first_ms) / 1000.0;
    rt_hist_observe(&v->ttft, BOUNDS(TTFT_LE), ttft);
    rt_hist_observe(&v->prefill, BOUNDS(REQ_LE), prefill);
    rt_hist_observe(&v->decode, BOUNDS(REQ_LE), decode);
    rt_hist_observe(&v->inference, BOUNDS(REQ_LE), prefill + decode);
    if (l->n_gen > 1) rt_hist_observe(&v->tpot_req, BOUNDS(ITL_LE), decode / (l->n_gen - 1));
}

void rt_metrics_vllm_kv(rt_metrics *m, const Td__PrefillDone *d)
{
    rt_vmetrics *v = &m->v;
    if (!d->kv_bytes) return; /* a prefill node that does not report it */
    double s = (double)d->kv_transfer_us / 1e6;
    rt_hist_observe(&v->kv_s, BOUNDS(KV_S_LE), s);
    rt_hist_observe(&v->kv_exposed_s, BOUNDS(KV_S_LE), (double)d->kv_exposed_us / 1e6);
    rt_hist_observe(&v->kv_bytes, BOUNDS(KV_B_LE), (double)d->kv_bytes);
    if (s > 0) rt_hist_observe(&v->kv_bw, BOUNDS(KV_BW_LE), (double)d->kv_bytes / s);
}

/* model_name="...", and instance="..." unless inst is NULL */
static const rt_labels *labels(rt_labels *l, const rt_metrics *m, const char *inst)
{
    rt_labels_reset(l);
    rt_labels_add(l, "model_name", m->v.model);
    if (inst) rt_labels_add(l, "instance", inst);
    return l;
}

/* tandem_decode_step_seconds: each decode instance's steps (every configured instance, its
 * counts summed across restarts). */
static void render_steps(rt_mw *w, const rt_metrics *m)
{
    rt_mw_family(w, "tandem_decode_step_seconds", RT_MT_HISTOGRAM,
                 "Decode steps of the instance by duration, planning to commit (the time its "
                 "running requests wait for each token), across restarts.");
    rt_bounds bd = {td_step_hist_le(), TD_STEP_HIST_N};
    rt_labels l;
    for (int i = 0; i < m->n_inst; i++) {
        if (!m->inst[i].name[0]) continue;
        const uint64_t *t = m->tally[i].total.steps;
        rt_hist h = {.sum = (double)t[TD_STEP_HIST_N + 1] / 1e6};
        for (int k = 0; k <= TD_STEP_HIST_N; k++) {
            h.counts[k] = t[k];
            h.n += t[k];
        }
        rt_mw_hist(w, labels(&l, m, m->inst[i].name), &h, bd, 1.0);
    }
}

#define WHAT_CLAIMING 99  /* put_inst: share_cores claims now */
#define WHAT_SHARE    100 /* put_inst: share_cores's counts, + their index */
_Static_assert(10 + RT_SPEC_N <= WHAT_CLAIMING, "put_inst's codes overlap");

/* One family with a value per decode instance: what 0 running, 1 waiting, 2 KV usage,
 * WHAT_CLAIMING share_cores claiming (alive instances only), 3 preemptions, 4-9 prefix cache
 * queried tokens, hit tokens, evictions, tier writes, reads, hits, 10 + k speculative
 * decoding's spec[k] (verifications, proposed tokens verified, accepted tokens, ...),
 * WHAT_SHARE + k share_cores's share[k] (claimed steps, left steps, claiming began)
 * (counters: every instance). */
static void put_inst(rt_mw *w, const rt_metrics *m, const char *name, rt_mtype type,
                     const char *help, int what)
{
    rt_mw_family(w, name, type, help);
    rt_labels l;
    for (int i = 0; i < m->n_inst; i++) {
        if (!m->inst[i].name[0]) continue;
        const rt_inst_gauge *g = &m->inst[i];
        const rt_inst_counts *t = &m->tally[i].total;
        double val;
        if (what == WHAT_CLAIMING) { /* a gauge: alive instances only */
            if (!g->alive) continue;
            val = g->share_claiming;
        } else if (what == 3) /* the counters: every configured instance, dead or alive */
            val = (double)t->preempt;
        else if (what >= WHAT_SHARE)
            val = (double)t->share[what - WHAT_SHARE];
        else if (what >= 10)
            val = (double)t->spec[what - 10];
        else if (what >= 4)
            val = (double)t->pc[what - 4];
        else if (!g->alive)
            continue; /* a dead instance's last figures would sum into the cluster's */
        else
            val = what == 0                 ? g->running
                  : what == 1               ? g->waiting
                  : g->kv_used + g->kv_free ? (double)g->kv_used / (double)(g->kv_used + g->kv_free)
                                            : 0.0;
        rt_mw_real(w, labels(&l, m, g->name), val, 15);
    }
}

/* decode[].share_cores per decode instance (0 with it off): steps that claimed the host's
 * cores, steps auto left to the scheduler, times auto began claiming (counters, summed across
 * restarts), and whether its steps claim now. */
static void render_share(rt_mw *w, const rt_metrics *m)
{
    put_inst(w, m, "tandem_decode_share_cores_claimed_steps_total", RT_MT_COUNTER,
             "Steps that claimed the host's cores from the prefill stages beside them "
             "(decode[].share_cores).",
             WHAT_SHARE);
    put_inst(w, m, "tandem_decode_share_cores_left_steps_total", RT_MT_COUNTER,
             "Steps share_cores: auto left to the scheduler beside the prefill stages.",
             WHAT_SHARE + 1);
    put_inst(w, m, "tandem_decode_share_cores_claiming_started_total", RT_MT_COUNTER,
             "Times share_cores: auto began claiming, having measured the steps left to the "
             "scheduler stretched past itl_target_ms.",
             WHAT_SHARE + 2);
    put_inst(w, m, "tandem_decode_share_cores_claiming", RT_MT_GAUGE,
             "1 while the instance's steps beside busy prefill stages claim the cores "
             "(share_cores: true, or auto having measured that it pays), else 0.",
             WHAT_CLAIMING);
}

/* vLLM's speculative decoding counters per decode instance (every configured one, summed
 * across restarts): verifications, proposed tokens, accepted tokens, and the accepted tokens
 * by proposal position, a series for each position up to the instance's last with one. */
static void render_spec(rt_mw *w, const rt_metrics *m)
{
    put_inst(w, m, "vllm:spec_decode_num_drafts_total", RT_MT_COUNTER,
             "Verifications: decode rows of the instance that carried proposed tokens.", 10);
    put_inst(w, m, "vllm:spec_decode_num_draft_tokens_total", RT_MT_COUNTER,
             "Proposed tokens the decode instance verified.", 11);
    put_inst(w, m, "vllm:spec_decode_num_accepted_tokens_total", RT_MT_COUNTER,
             "Of those, tokens accepted (they matched what was sampled).", 12);
    put_inst(w, m, "tandem_spec_decode_gate_held_steps_total", RT_MT_COUNTER,
             "Steps in which the measured gate (decode[].speculative.gate) held the proposals "
             "off: at that batch size, steps without them were measured faster.",
             10 + RT_SPEC_HELD);
    rt_mw_family(w, "vllm:spec_decode_num_accepted_tokens_per_pos_total", RT_MT_COUNTER,
                 "Accepted tokens by proposal position (0: a verification's first).");
    rt_labels l;
    for (int i = 0; i < m->n_inst; i++) {
        if (!m->inst[i].name[0]) continue;
        const uint64_t *pos = &m->tally[i].total.spec[3];
        int n = RT_SPEC_POS;
        while (n > 0 && !pos[n - 1])
            n--;
        for (int k = 0; k < n; k++) {
            labels(&l, m, m->inst[i].name);
            rt_labels_add_int(&l, "position", k);
            rt_mw_uint(w, &l, pos[k]);
        }
    }
}

/* vLLM's request histograms (model_name only: the router measures them all). */
static void render_requests(rt_mw *w, const rt_metrics *m)
{
    const rt_vmetrics *v = &m->v;
    rt_labels l;
    const rt_labels *lb = labels(&l, m, NULL);
    rt_mw_hist_family(w, "vllm:time_to_first_token_seconds",
                      "Time from the complete request to its first token.", lb, &v->ttft,
                      BOUNDS(TTFT_LE), 1);
    rt_mw_hist_family(w, "vllm:inter_token_latency_seconds",
                      "Time between a request's consecutive tokens as the router receives "
                      "them (one observation per token after the first).",
                      lb, &v->itl, BOUNDS(ITL_LE), 1);
    rt_mw_hist_family(w, "vllm:time_per_output_token_seconds",
                      "The older name of vllm:inter_token_latency_seconds (same data).", lb,
                      &v->itl, BOUNDS(ITL_LE), 1);
    rt_mw_hist_family(w, "vllm:request_time_per_output_token_seconds",
                      "Per finished request: (last token - first token) / (tokens - 1).", lb,
                      &v->tpot_req, BOUNDS(ITL_LE), 1);
    rt_mw_hist_family(w, "vllm:e2e_request_latency_seconds",
                      "Time from the complete request to the end of its response.", lb, &v->e2e,
                      BOUNDS(REQ_LE), 1);
    rt_mw_hist_family(w, "vllm:request_queue_time_seconds",
                      "Time in the router queue: arrival to first dispatch to an instance.", lb,
                      &v->queue, BOUNDS(REQ_LE), 1);
    rt_mw_hist_family(w, "vllm:request_prefill_time_seconds",
                      "First dispatch to the first token (disaggregated: prefill instance "
                      "queue, prefill, KV transfer, first token relay).",
                      lb, &v->prefill, BOUNDS(REQ_LE), 1);
    rt_mw_hist_family(w, "vllm:request_decode_time_seconds", "First token to last token.", lb,
                      &v->decode, BOUNDS(REQ_LE), 1);
    rt_mw_hist_family(w, "vllm:request_inference_time_seconds", "Prefill time plus decode time.",
                      lb, &v->inference, BOUNDS(REQ_LE), 1);
    rt_mw_hist_family(w, "vllm:request_prompt_tokens", "Prompt tokens per finished request.", lb,
                      &v->prompt, TOK_BOUNDS, 1);
    rt_mw_hist_family(w, "vllm:request_generation_tokens", "Generated tokens per finished request.",
                      lb, &v->gen, TOK_BOUNDS, 1);
}

/* vLLM's counters (caller holds m->mu). */
static void render_counters(rt_mw *w, const rt_metrics *m)
{
    const rt_vmetrics *v = &m->v;
    static const char *const fr[RT_FR_N] = {"stop", "length", "abort", "tool_calls"};
    rt_labels l;
    rt_mw_family(w, "vllm:request_success_total", RT_MT_COUNTER,
                 "Ended requests by finish reason (abort: the client went away; tool_calls: a "
                 "stop whose answer was tool calls).");
    for (int k = 0; k < RT_FR_N; k++) {
        labels(&l, m, NULL);
        rt_labels_add(&l, "finished_reason", fr[k]);
        rt_mw_uint(w, &l, v->success[k]);
    }
    labels(&l, m, NULL);
    rt_mw_family(w, "vllm:prompt_tokens_total", RT_MT_COUNTER,
                 "Prompt tokens prefilled (requests that got a first token).");
    rt_mw_uint(w, &l, v->prompt_tokens);
    rt_mw_family(w, "vllm:generation_tokens_total", RT_MT_COUNTER,
                 "Generated tokens of every request.");
    rt_mw_uint(w, &l, v->gen_tokens);
}

/* Disaggregated mode: the KV transfer, in Tandem's base units and SGLang's PD names. */
static void render_kv(rt_mw *w, const rt_metrics *m)
{
    const rt_vmetrics *v = &m->v;
    rt_labels l;
    const rt_labels *lb = labels(&l, m, NULL);
    rt_mw_hist_family(w, "tandem_kv_transfer_seconds",
                      "Per prefill: time the KV puts were in flight (slowest stage).", lb, &v->kv_s,
                      BOUNDS(KV_S_LE), 1);
    rt_mw_hist_family(w, "tandem_kv_transfer_exposed_seconds",
                      "Per prefill: KV transfer time not hidden behind compute (largest "
                      "over the stages).",
                      lb, &v->kv_exposed_s, BOUNDS(KV_S_LE), 1);
    rt_mw_hist_family(w, "tandem_kv_transfer_bytes", "Per prefill: KV bytes put, all stages.", lb,
                      &v->kv_bytes, BOUNDS(KV_B_LE), 1);
    rt_mw_hist_family(w, "tandem_kv_transfer_bandwidth_bytes_per_second",
                      "Per prefill: KV bytes / tandem_kv_transfer_seconds.", lb, &v->kv_bw,
                      BOUNDS(KV_BW_LE), 1);
    rt_mw_hist_family(w, "sglang:kv_transfer_latency_ms",
                      "tandem_kv_transfer_seconds in milliseconds.", lb, &v->kv_s, BOUNDS(KV_S_LE),
                      1e3);
    rt_mw_hist_family(w, "sglang:kv_transfer_total_mb",
                      "tandem_kv_transfer_bytes in MB (10^6 bytes).", lb, &v->kv_bytes,
                      BOUNDS(KV_B_LE), 1e-6);
    rt_mw_hist_family(w, "sglang:kv_transfer_speed_gb_s",
                      "tandem_kv_transfer_bandwidth_bytes_per_second in GB/s (10^9 bytes).", lb,
                      &v->kv_bw, BOUNDS(KV_BW_LE), 1e-9);
    rt_mw_family(w, "sglang:num_prefill_retries_total", RT_MT_COUNTER,
                 "tandem_router_prefill_retries_total.");
    rt_mw_uint(w, lb, m->pf_retries);
    rt_mw_family(w, "sglang:num_transfer_failed_reqs_total", RT_MT_COUNTER,
                 "Attempts whose KV transfer failed "
                 "(tandem_router_prefill_failures_total{reason=\"transfer\"}).");
    rt_mw_uint(w, lb, m->pf_failures[RT_PF_TRANSFER]);
}

void rt_metrics_vllm_render(rt_mw *w, const rt_metrics *m)
{
    render_requests(w, m);
    render_counters(w, m);
    put_inst(w, m, "vllm:num_requests_running", RT_MT_GAUGE,
             "Requests in the decode instance's running batch (alive instances).", 0);
    put_inst(w, m, "vllm:num_requests_waiting", RT_MT_GAUGE,
             "Requests the decode instance admitted but does not run yet (queue, KV "
             "transfer); the router's own queue is tandem_router_queue_length.",
             1);
    put_inst(w, m, "vllm:kv_cache_usage_perc", RT_MT_GAUGE,
             "Fraction (0-1) of the decode instance's KV blocks in use.", 2);
    put_inst(w, m, "vllm:num_preemptions_total", RT_MT_COUNTER,
             "Requests the decode instance preempted (KV pool full), across restarts.", 3);
    put_inst(w, m, "vllm:prefix_cache_queries_total", RT_MT_COUNTER,
             "Tokens the decode instance looked up in its prefix cache (admitted requests, "
             "and KV transfers at Alloc).",
             4);
    put_inst(w, m, "vllm:prefix_cache_hits_total", RT_MT_COUNTER,
             "Of those, tokens found cached (their KV was not computed or not transferred "
             "again).",
             5);
    put_inst(w, m, "tandem_prefix_cache_evictions_total", RT_MT_COUNTER,
             "Cached KV blocks the decode instance evicted to make room.", 6);
    put_inst(w, m, "tandem_prefix_cache_tier_writes_total", RT_MT_COUNTER,
             "Evicted cached KV blocks the decode instance wrote to its second tier "
             "(decode[].prefix_cache_tier).",
             7);
    put_inst(w, m, "tandem_prefix_cache_tier_reads_total", RT_MT_COUNTER,
             "KV blocks the decode instance read back from its second tier into the pool.", 8);
    put_inst(w, m, "tandem_prefix_cache_tier_hits_total", RT_MT_COUNTER,
             "Prompt tokens of admitted requests whose KV came from blocks read back from "
             "the second tier (part of vllm:prefix_cache_hits_total).",
             9);
    render_spec(w, m);
    render_share(w, m);
    render_steps(w, m);
    if (m->n_pf > 0) render_kv(w, m);
}
