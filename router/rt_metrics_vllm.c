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
    char esc[sizeof m->v.model - 16];
    rt_metrics_label_escape(esc, sizeof esc, name);
    snprintf(m->v.model, sizeof m->v.model, "model_name=\"%s\"", esc);
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

/* Add what counter cur gained since *last (from 0 after a restart: it went back, or the
 * instance's boot id changed) to *total. */
static void accumulate(uint64_t *total, uint64_t *last, uint64_t cur, bool restarted)
{
    if (restarted) *last = 0;
    *total += cur >= *last ? cur - *last : cur;
    *last = cur;
}

void rt_metrics_publish_inst(rt_metrics *m, int i, const rt_inst_gauge *g)
{
    if (i < 0 || i >= m->n_inst) return;
    if (strcmp(m->inst[i].name, g->name)) { /* another instance in the slot: counts from 0 */
        m->v.preempt_total[i] = m->v.preempt_last[i] = m->v.boot_last[i] = 0;
        memset(&m->v.pc_total[RT_PC_N * i], 0, RT_PC_N * sizeof *m->v.pc_total);
        memset(&m->v.pc_last[RT_PC_N * i], 0, RT_PC_N * sizeof *m->v.pc_last);
        memset(&m->v.step_total[RT_STEP_N * i], 0, RT_STEP_N * sizeof *m->v.step_total);
        memset(&m->v.step_last[RT_STEP_N * i], 0, RT_STEP_N * sizeof *m->v.step_last);
        memset(&m->v.spec_total[RT_SPEC_N * i], 0, RT_SPEC_N * sizeof *m->v.spec_total);
        memset(&m->v.spec_last[RT_SPEC_N * i], 0, RT_SPEC_N * sizeof *m->v.spec_last);
    }
    bool restarted = g->boot_id && m->v.boot_last[i] && g->boot_id != m->v.boot_last[i];
    if (g->boot_id) m->v.boot_last[i] = g->boot_id;
    accumulate(&m->v.preempt_total[i], &m->v.preempt_last[i], g->preemptions, restarted);
    for (int k = 0; k < RT_PC_N; k++)
        accumulate(&m->v.pc_total[RT_PC_N * i + k], &m->v.pc_last[RT_PC_N * i + k], g->pc[k],
                   restarted);
    for (int k = 0; k < RT_STEP_N; k++)
        accumulate(&m->v.step_total[RT_STEP_N * i + k], &m->v.step_last[RT_STEP_N * i + k],
                   g->steps[k], restarted);
    for (int k = 0; k < RT_SPEC_N; k++)
        accumulate(&m->v.spec_total[RT_SPEC_N * i + k], &m->v.spec_last[RT_SPEC_N * i + k],
                   g->spec[k], restarted);
    m->inst[i] = *g;
}

/* tandem_decode_step_seconds: each decode instance's steps (every configured instance, its
 * counts summed across restarts). */
static int render_steps(rt_buf *b, const rt_metrics *m, const td_cfg *cfg)
{
    const char *name = "tandem_decode_step_seconds";
    char line[512];
    snprintf(line, sizeof line,
             "# HELP %s Decode steps of the instance by duration, planning to commit (the time "
             "its running requests wait for each token), across restarts.\n# TYPE %s "
             "histogram\n",
             name, name);
    int rc = rt_buf_puts(b, line);
    rt_bounds bd = {td_step_hist_le(), TD_STEP_HIST_N};
    for (int i = 0; i < m->n_inst; i++) {
        if (!m->inst[i].name[0]) continue;
        const uint64_t *t = &m->v.step_total[RT_STEP_N * i];
        rt_hist h = {.sum = (double)t[TD_STEP_HIST_N + 1] / 1e6};
        for (int k = 0; k <= TD_STEP_HIST_N; k++) {
            h.counts[k] = t[k];
            h.n += t[k];
        }
        char lb[640];
        snprintf(lb, sizeof lb, "%s,instance=\"%s\"", m->v.model, m->inst[i].name);
        rc |= rt_hist_render_series(b, name, lb, &h, bd, 1.0);
    }
    return rc;
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

/* One family with a value per decode instance: what 0 running, 1 waiting, 2 KV usage (alive
 * instances only), 3 preemptions, 4-9 prefix cache queried tokens, hit tokens, evictions,
 * tier writes, reads, hits, 10-12 speculative decoding's verifications, proposed tokens
 * verified, accepted tokens (counters: every instance). */
static int put_inst(rt_buf *b, const rt_metrics *m, const td_cfg *cfg, const char *name,
                    const char *type, const char *help, int what)
{
    char line[2048];
    snprintf(line, sizeof line, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
    int rc = rt_buf_puts(b, line);
    for (int i = 0; i < m->n_inst; i++) {
        if (!m->inst[i].name[0]) continue;
        const rt_inst_gauge *g = &m->inst[i];
        double val;
        if (what == 3) /* the counters: every configured instance, dead or alive */
            val = (double)m->v.preempt_total[i];
        else if (what >= 10)
            val = (double)m->v.spec_total[RT_SPEC_N * i + what - 10];
        else if (what >= 4)
            val = (double)m->v.pc_total[RT_PC_N * i + what - 4];
        else if (!g->alive)
            continue; /* a dead instance's last figures would sum into the cluster's */
        else
            val = what == 0                 ? g->running
                  : what == 1               ? g->waiting
                  : g->kv_used + g->kv_free ? (double)g->kv_used / (double)(g->kv_used + g->kv_free)
                                            : 0.0;
        snprintf(line, sizeof line, "%s{%s,instance=\"%s\"} %.15g\n", name, m->v.model,
                 m->inst[i].name, val);
        rc |= rt_buf_puts(b, line);
    }
    return rc;
}

/* vLLM's speculative decoding counters per decode instance (every configured one, summed
 * across restarts): verifications, proposed tokens, accepted tokens, and the accepted tokens
 * by proposal position, a series for each position up to the instance's last with one. */
static int render_spec(rt_buf *b, const rt_metrics *m, const td_cfg *cfg)
{
    int rc =
        put_inst(b, m, cfg, "vllm:spec_decode_num_drafts_total", "counter",
                 "Verifications: decode rows of the instance that carried proposed tokens.", 10);
    rc |= put_inst(b, m, cfg, "vllm:spec_decode_num_draft_tokens_total", "counter",
                   "Proposed tokens the decode instance verified.", 11);
    rc |= put_inst(b, m, cfg, "vllm:spec_decode_num_accepted_tokens_total", "counter",
                   "Of those, tokens accepted (they matched what was sampled).", 12);
    const char *name = "vllm:spec_decode_num_accepted_tokens_per_pos_total";
    char line[2048];
    snprintf(line, sizeof line,
             "# HELP %s Accepted tokens by proposal position (0: a verification's first).\n"
             "# TYPE %s counter\n",
             name, name);
    rc |= rt_buf_puts(b, line);
    for (int i = 0; i < m->n_inst; i++) {
        if (!m->inst[i].name[0]) continue;
        const uint64_t *pos = &m->v.spec_total[RT_SPEC_N * i + 3];
        int n = RT_SPEC_POS;
        while (n > 0 && !pos[n - 1])
            n--;
        for (int k = 0; k < n; k++) {
            snprintf(line, sizeof line, "%s{%s,instance=\"%s\",position=\"%d\"} %llu\n", name,
                     m->v.model, m->inst[i].name, k, (unsigned long long)pos[k]);
            rc |= rt_buf_puts(b, line);
        }
    }
    return rc;
}

/* vLLM's request histograms (model_name only: the router measures them all). */
static int render_requests(rt_buf *b, const rt_metrics *m)
{
    const rt_vmetrics *v = &m->v;
    const char *lb = v->model;
    int rc = 0;
    rc |= rt_hist_render(b, "vllm:time_to_first_token_seconds",
                         "Time from the complete request to its first token.", lb, &v->ttft,
                         BOUNDS(TTFT_LE), 1);
    rc |= rt_hist_render(b, "vllm:inter_token_latency_seconds",
                         "Time between a request's consecutive tokens as the router receives "
                         "them (one observation per token after the first).",
                         lb, &v->itl, BOUNDS(ITL_LE), 1);
    rc |= rt_hist_render(b, "vllm:time_per_output_token_seconds",
                         "The older name of vllm:inter_token_latency_seconds (same data).", lb,
                         &v->itl, BOUNDS(ITL_LE), 1);
    rc |= rt_hist_render(b, "vllm:request_time_per_output_token_seconds",
                         "Per finished request: (last token - first token) / (tokens - 1).", lb,
                         &v->tpot_req, BOUNDS(ITL_LE), 1);
    rc |= rt_hist_render(b, "vllm:e2e_request_latency_seconds",
                         "Time from the complete request to the end of its response.", lb, &v->e2e,
                         BOUNDS(REQ_LE), 1);
    rc |= rt_hist_render(b, "vllm:request_queue_time_seconds",
                         "Time in the router queue: arrival to first dispatch to an instance.", lb,
                         &v->queue, BOUNDS(REQ_LE), 1);
    rc |= rt_hist_render(b, "vllm:request_prefill_time_seconds",
                         "First dispatch to the first token (disaggregated: prefill instance "
                         "queue, prefill, KV transfer, first token relay).",
                         lb, &v->prefill, BOUNDS(REQ_LE), 1);
    rc |= rt_hist_render(b, "vllm:request_decode_time_seconds", "First token to last token.", lb,
                         &v->decode, BOUNDS(REQ_LE), 1);
    rc |= rt_hist_render(b, "vllm:request_inference_time_seconds", "Prefill time plus decode time.",
                         lb, &v->inference, BOUNDS(REQ_LE), 1);
    rc |= rt_hist_render(b, "vllm:request_prompt_tokens", "Prompt tokens per finished request.", lb,
                         &v->prompt, TOK_BOUNDS, 1);
    rc |= rt_hist_render(b, "vllm:request_generation_tokens",
                         "Generated tokens per finished request.", lb, &v->gen, TOK_BOUNDS, 1);
    return rc;
}

/* vLLM's counters (caller holds m->mu). */
static int render_counters(rt_buf *b, const rt_metrics *m)
{
    const rt_vmetrics *v = &m->v;
    static const char *const fr[RT_FR_N] = {"stop", "length", "abort", "tool_calls"};
    char line[2048];
    int rc = rt_buf_puts(
        b, "# HELP vllm:request_success_total Ended requests by finish reason "
           "(abort: the client went away; tool_calls: a stop whose answer was tool calls).\n"
           "# TYPE vllm:request_success_total counter\n");
    for (int k = 0; k < RT_FR_N; k++) {
        snprintf(line, sizeof line, "vllm:request_success_total{%s,finished_reason=\"%s\"} %llu\n",
                 v->model, fr[k], (unsigned long long)v->success[k]);
        rc |= rt_buf_puts(b, line);
    }
    snprintf(line, sizeof line,
             "# HELP vllm:prompt_tokens_total Prompt tokens prefilled (requests that got a "
             "first token).\n"
             "# TYPE vllm:prompt_tokens_total counter\n"
             "vllm:prompt_tokens_total{%s} %llu\n"
             "# HELP vllm:generation_tokens_total Generated tokens of every request.\n"
             "# TYPE vllm:generation_tokens_total counter\n"
             "vllm:generation_tokens_total{%s} %llu\n",
             v->model, (unsigned long long)v->prompt_tokens, v->model,
             (unsigned long long)v->gen_tokens);
    rc |= rt_buf_puts(b, line);
    return rc;
}

/* Disaggregated mode: the KV transfer, in Tandem's base units and SGLang's PD names. */
static int render_kv(rt_buf *b, const rt_metrics *m)
{
    const rt_vmetrics *v = &m->v;
    const char *lb = v->model;
    char line[2048];
    int rc = 0;
    rc |= rt_hist_render(b, "tandem_kv_transfer_seconds",
                         "Per prefill: time the KV puts were in flight (slowest stage).", lb,
                         &v->kv_s, BOUNDS(KV_S_LE), 1);
    rc |= rt_hist_render(b, "tandem_kv_transfer_exposed_seconds",
                         "Per prefill: KV transfer time not hidden behind compute (largest "
                         "over the stages).",
                         lb, &v->kv_exposed_s, BOUNDS(KV_S_LE), 1);
    rc |= rt_hist_render(b, "tandem_kv_transfer_bytes", "Per prefill: KV bytes put, all stages.",
                         lb, &v->kv_bytes, BOUNDS(KV_B_LE), 1);
    rc |= rt_hist_render(b, "tandem_kv_transfer_bandwidth_bytes_per_second",
                         "Per prefill: KV bytes / tandem_kv_transfer_seconds.", lb, &v->kv_bw,
                         BOUNDS(KV_BW_LE), 1);
    rc |= rt_hist_render(b, "sglang:kv_transfer_latency_ms",
                         "tandem_kv_transfer_seconds in milliseconds.", lb, &v->kv_s,
                         BOUNDS(KV_S_LE), 1e3);
    rc |= rt_hist_render(b, "sglang:kv_transfer_total_mb",
                         "tandem_kv_transfer_bytes in MB (10^6 bytes).", lb, &v->kv_bytes,
                         BOUNDS(KV_B_LE), 1e-6);
    rc |= rt_hist_render(b, "sglang:kv_transfer_speed_gb_s",
                         "tandem_kv_transfer_bandwidth_bytes_per_second in GB/s (10^9 bytes).", lb,
                         &v->kv_bw, BOUNDS(KV_BW_LE), 1e-9);
    snprintf(line, sizeof line,
             "# HELP sglang:num_prefill_retries_total tandem_router_prefill_retries_total.\n"
             "# TYPE sglang:num_prefill_retries_total counter\n"
             "sglang:num_prefill_retries_total{%s} %llu\n"
             "# HELP sglang:num_transfer_failed_reqs_total Attempts whose KV transfer failed "
             "(tandem_router_prefill_failures_total{reason=\"transfer\"}).\n"
             "# TYPE sglang:num_transfer_failed_reqs_total counter\n"
             "sglang:num_transfer_failed_reqs_total{%s} %llu\n",
             lb, (unsigned long long)m->pf_retries, lb,
             (unsigned long long)m->pf_failures[RT_PF_TRANSFER]);
    rc |= rt_buf_puts(b, line);
    return rc;
}

int rt_metrics_vllm_render(rt_buf *b, const rt_metrics *m, const td_cfg *cfg)
{
    int rc = render_requests(b, m);
    rc |= render_counters(b, m);
    rc |= put_inst(b, m, cfg, "vllm:num_requests_running", "gauge",
                   "Requests in the decode instance's running batch (alive instances).", 0);
    rc |= put_inst(b, m, cfg, "vllm:num_requests_waiting", "gauge",
                   "Requests the decode instance admitted but does not run yet (queue, KV "
                   "transfer); the router's own queue is tandem_router_queue_length.",
                   1);
    rc |= put_inst(b, m, cfg, "vllm:kv_cache_usage_perc", "gauge",
                   "Fraction (0-1) of the decode instance's KV blocks in use.", 2);
    rc |= put_inst(b, m, cfg, "vllm:num_preemptions_total", "counter",
                   "Requests the decode instance preempted (KV pool full), across restarts.", 3);
    rc |= put_inst(b, m, cfg, "vllm:prefix_cache_queries_total", "counter",
                   "Tokens the decode instance looked up in its prefix cache (admitted requests, "
                   "and KV transfers at Alloc).",
                   4);
    rc |= put_inst(b, m, cfg, "vllm:prefix_cache_hits_total", "counter",
                   "Of those, tokens found cached (their KV was not computed or not transferred "
                   "again).",
                   5);
    rc |= put_inst(b, m, cfg, "tandem_prefix_cache_evictions_total", "counter",
                   "Cached KV blocks the decode instance evicted to make room.", 6);
    rc |= put_inst(b, m, cfg, "tandem_prefix_cache_tier_writes_total", "counter",
                   "Evicted cached KV blocks the decode instance wrote to its second tier "
                   "(decode[].prefix_cache_tier).",
                   7);
    rc |=
        put_inst(b, m, cfg, "tandem_prefix_cache_tier_reads_total", "counter",
                 "KV blocks the decode instance read back from its second tier into the pool.", 8);
    rc |= put_inst(b, m, cfg, "tandem_prefix_cache_tier_hits_total", "counter",
                   "Prompt tokens of admitted requests whose KV came from blocks read back from "
                   "the second tier (part of vllm:prefix_cache_hits_total).",
                   9);
    rc |= render_spec(b, m, cfg);
    rc |= render_steps(b, m, cfg);
    if (m->n_pf > 0) rc |= render_kv(b, m);
    return rc;
}
