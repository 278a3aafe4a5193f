/* rt_metrics.c: the router's Prometheus metrics (text exposition format 0.0.4) and its
 * one log line per ended generation request.
 * Series: tandem_router_requests_total{status} (generation requests only: /v1/completions
 * and /v1/chat/completions), tandem_router_http_requests_total{path,status} (everything
 * else: /health, /metrics, /v1/models, path="other"), tandem_router_time_to_first_token_seconds,
 * tandem_router_time_per_output_token_seconds, tandem_router_e2e_request_latency_seconds
 * (histograms), tandem_router_prompt_tokens_total, tandem_router_generation_tokens_total,
 * tandem_router_queue_length, tandem_router_requests_running, and per decode instance
 * tandem_instance_{up,running,waiting,kv_blocks_used,kv_blocks_free,kv_usage_ratio}.
 * With prefill instances (disaggregated mode) also tandem_router_prefill_{requests,retries,
 * failures{reason},busy{side}}_total, the histograms tandem_router_prefill_chunk_size_tokens,
 * tandem_router_prefill_seconds, tandem_router_prefill_queue_seconds, and per prefill
 * instance tandem_prefill_instance_{up,queued_prompt_tokens,running,waiting,requests}.
 * Per decode and prefill instance that reported: tandem_instance_compute_info,
 * tandem_instance_blas_core_older_than_cpu, tandem_instance_products_info (label role).
 * The vLLM- and SGLang-named series are rt_metrics_vllm.c's; tandem_router_cache_route_*
 * (cache-aware routing) rt_metrics_cache.c's.
 * Threading: every function takes m->mu; any thread may call them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "rt_metrics.h"
#include "td_err.h"

/* upper bounds in seconds; the last bucket is +Inf */
static const double LAT_LE[RT_HIST_BUCKETS] = {0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,
                                               0.5,   0.75, 1.0,  2.5,  5.0,  10.0, 30.0, 60.0};
static const double TPOT_LE[RT_HIST_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.015, 0.02,
                                                0.025, 0.03,   0.04,  0.05, 0.075, 0.1,
                                                0.15,  0.2,    0.5,   1.0};

/* tokens; chunk sizes are aligned to max(block size, 64) by the prefill planner */
static const double CHUNK_LE[RT_HIST_BUCKETS] = {16,  32,   64,   128,  192,  256,  384,  512,
                                                 768, 1024, 1536, 2048, 3072, 4096, 8192, 16384};
#define LAT_BOUNDS   ((rt_bounds){LAT_LE, RT_HIST_BUCKETS})
#define TPOT_BOUNDS  ((rt_bounds){TPOT_LE, RT_HIST_BUCKETS})
#define CHUNK_BOUNDS ((rt_bounds){CHUNK_LE, RT_HIST_BUCKETS})

int rt_metrics_init(rt_metrics *m, int n_inst, int n_pf)
{
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    m->inst = calloc((size_t)(n_inst > 0 ? n_inst : 1), sizeof *m->inst);
    m->pf = calloc((size_t)(n_pf > 0 ? n_pf : 1), sizeof *m->pf);
    m->http = calloc((size_t)RT_PATH_N * 600, sizeof *m->http);
    m->v.preempt_total = calloc((size_t)(n_inst > 0 ? n_inst : 1), sizeof *m->v.preempt_total);
    m->v.preempt_last = calloc((size_t)(n_inst > 0 ? n_inst : 1), sizeof *m->v.preempt_last);
    m->cache_dec = calloc((size_t)(n_inst > 0 ? n_inst : 1), sizeof *m->cache_dec);
    m->cache_pf = calloc((size_t)(n_pf > 0 ? n_pf : 1), sizeof *m->cache_pf);
    m->v.pc_total = calloc((size_t)(n_inst > 0 ? n_inst : 1) * RT_PC_N, sizeof *m->v.pc_total);
    m->v.pc_last = calloc((size_t)(n_inst > 0 ? n_inst : 1) * RT_PC_N, sizeof *m->v.pc_last);
    m->v.step_total =
        calloc((size_t)(n_inst > 0 ? n_inst : 1) * RT_STEP_N, sizeof *m->v.step_total);
    m->v.step_last = calloc((size_t)(n_inst > 0 ? n_inst : 1) * RT_STEP_N, sizeof *m->v.step_last);
    m->v.spec_total =
        calloc((size_t)(n_inst > 0 ? n_inst : 1) * RT_SPEC_N, sizeof *m->v.spec_total);
    m->v.spec_last = calloc((size_t)(n_inst > 0 ? n_inst : 1) * RT_SPEC_N, sizeof *m->v.spec_last);
    m->v.boot_last = calloc((size_t)(n_inst > 0 ? n_inst : 1), sizeof *m->v.boot_last);
    rt_metrics_set_model(m, "", 0);
    if (!m->inst || !m->pf || !m->http || !m->v.preempt_total || !m->v.preempt_last ||
        !m->cache_dec || !m->cache_pf || !m->v.pc_total || !m->v.pc_last || !m->v.step_total ||
        !m->v.step_last || !m->v.spec_total || !m->v.spec_last || !m->v.boot_last)
        return TD_ENOMEM;
    m->n_inst = n_inst;
    m->n_pf = n_pf;
    return 0;
}

void rt_metrics_fini(rt_metrics *m)
{
    free(m->inst);
    free(m->pf);
    free(m->http);
    free(m->v.preempt_total);
    free(m->v.preempt_last);
    free(m->cache_dec);
    free(m->cache_pf);
    m->cache_dec = m->cache_pf = NULL;
    m->v.preempt_total = m->v.preempt_last = NULL;
    free(m->v.pc_total);
    free(m->v.pc_last);
    m->v.pc_total = m->v.pc_last = NULL;
    free(m->v.step_total);
    free(m->v.step_last);
    free(m->v.boot_last);
    m->v.step_total = m->v.step_last = m->v.boot_last = NULL;
    free(m->v.spec_total);
    free(m->v.spec_last);
    m->v.spec_total = m->v.spec_last = NULL;
    m->inst = NULL;
    m->pf = NULL;
    m->http = NULL;
    pthread_mutex_destroy(&m->mu);
}

void rt_metrics_status(rt_metrics *m, int status)
{
    if (status < 100 || status >= 600) return;
    pthread_mutex_lock(&m->mu);
    m->by_status[status]++;
    pthread_mutex_unlock(&m->mu);
}

void rt_metrics_http(rt_metrics *m, rt_path path, int status)
{
    if (status < 100 || status >= 600 || path < 0 || path >= RT_PATH_N) return;
    pthread_mutex_lock(&m->mu);
    m->http[(size_t)path * 600 + (size_t)status]++;
    pthread_mutex_unlock(&m->mu);
}

void rt_hist_observe(rt_hist *h, rt_bounds bd, double v)
{
    int b = 0;
    while (b < bd.n && v > bd.le[b])
        b++;
    h->counts[b]++;
    h->sum += v;
    h->n++;
}
#define observe rt_hist_observe

/* Router overhead on the token path: tens of microseconds when healthy. */
static const double WRITE_LE[RT_HIST_BUCKETS] = {
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
    0.005,   0.01,     0.025,   0.05,   0.1,     0.25,   0.5,   1.0};
#define WRITE_BOUNDS ((rt_bounds){WRITE_LE, RT_HIST_BUCKETS})

void rt_metrics_write_delay(rt_metrics *m, double seconds)
{
    pthread_mutex_lock(&m->mu);
    observe(&m->write_delay, WRITE_BOUNDS, seconds);
    pthread_mutex_unlock(&m->mu);
}

void rt_metrics_prefill_done(rt_metrics *m, const Td__PrefillDone *d)
{
    pthread_mutex_lock(&m->mu);
    for (size_t k = 0; k < d->n_chunk_sizes; k++)
        observe(&m->chunk, CHUNK_BOUNDS, (double)d->chunk_sizes[k]);
    observe(&m->pf_time, LAT_BOUNDS, (double)d->prefill_ms / 1000.0);
    observe(&m->pf_queued, LAT_BOUNDS, (double)d->queued_ms / 1000.0);
    rt_metrics_vllm_kv(m, d);
    pthread_mutex_unlock(&m->mu);
}

void rt_metrics_pair(rt_metrics *m, rt_pair_metric what, rt_pf_fail why)
{
    pthread_mutex_lock(&m->mu);
    switch (what) {
    case RT_PM_SENT:
        m->pf_requests++;
        break;
    case RT_PM_RETRY:
        m->pf_retries++;
        break;
    case RT_PM_BUSY_DECODE:
        m->busy_decode++;
        break;
    case RT_PM_BUSY_PREFILL:
        m->busy_prefill++;
        break;
    case RT_PM_FAIL:
        if (why >= 0 && why < RT_PF_N) m->pf_failures[why]++;
        break;
    }
    pthread_mutex_unlock(&m->mu);
}

void rt_metrics_timeout(rt_metrics *m, rt_timeout_state where)
{
    pthread_mutex_lock(&m->mu);
    if (where >= 0 && where < RT_TO_N) m->timeouts[where]++;
    pthread_mutex_unlock(&m->mu);
}

void rt_metrics_eviction(rt_metrics *m)
{
    pthread_mutex_lock(&m->mu);
    m->evictions++;
    pthread_mutex_unlock(&m->mu);
}

void rt_metrics_migration(rt_metrics *m)
{
    pthread_mutex_lock(&m->mu);
    m->migrations++;
    pthread_mutex_unlock(&m->mu);
}

void rt_metrics_migrated(rt_metrics *m, double pause)
{
    pthread_mutex_lock(&m->mu);
    observe(&m->migrate_pause, LAT_BOUNDS, pause);
    pthread_mutex_unlock(&m->mu);
}

/* The finished request's tokens and latencies (caller holds m->mu). */
static void record_finished(rt_metrics *m, const rt_req *q, int64_t now_ms)
{
    m->prompt_tokens += q->p.n_prompt;
    m->generation_tokens += (uint64_t)q->loop.n_gen;
    if (q->loop.t_first_ms) {
        observe(&m->ttft, LAT_BOUNDS, (double)(q->loop.t_first_ms - q->t_arrive_ms) / 1000.0);
        if (q->loop.n_gen > 1)
            observe(&m->tpot, TPOT_BOUNDS,
                    (double)(q->loop.t_last_ms - q->loop.t_first_ms) / 1000.0 /
                        (q->loop.n_gen - 1));
    }
    observe(&m->e2e, LAT_BOUNDS, (double)(now_ms - q->t_arrive_ms) / 1000.0);
}

void rt_metrics_request_end(rt_metrics *m, const td_cfg *cfg, const rt_req *q, int64_t now_ms,
                            int status, const char *outcome)
{
    char ttft[24] = "-", where[200] = "";
    size_t w = 0;
    pthread_mutex_lock(&m->mu);
    if (status == 200) record_finished(m, q, now_ms);
    rt_metrics_vllm_end(m, q, now_ms, status, outcome);
    /* the instances' names as the loop (this thread) last published them */
    if (q->loop.inst >= 0 && q->loop.inst < m->n_inst)
        w +=
            (size_t)snprintf(where + w, sizeof where - w, " decode %s", m->inst[q->loop.inst].name);
    if (q->pair.pinst >= 0 && q->pair.pinst < m->n_pf && w < sizeof where)
        w +=
            (size_t)snprintf(where + w, sizeof where - w, " prefill %s", m->pf[q->pair.pinst].name);
    pthread_mutex_unlock(&m->mu);
    /* q->p, oid and the times are immutable or loop-owned: no lock needed on the loop */
    if (q->loop.t_first_ms)
        snprintf(ttft, sizeof ttft, "%lld", (long long)(q->loop.t_first_ms - q->t_arrive_ms));
    if (q->loop.migrations && w < sizeof where)
        snprintf(where + w, sizeof where - w, " moved %d", q->loop.migrations);
    TD_LOG_INFO("router: request %s %s%s status %d %s %s prompt_tokens %zu output_tokens %d "
                "ttft_ms %s total_ms %lld%s",
                q->oid, q->p.ep == RT_EP_CHAT ? "/v1/chat/completions" : "/v1/completions",
                q->p.stream ? " stream" : "", status, status == 200 ? "finish" : "error",
                outcome ? outcome : "-", q->p.n_prompt, q->loop.n_gen, ttft,
                (long long)(now_ms - q->t_arrive_ms), where);
}

int rt_hist_render(rt_buf *b, const char *name, const char *help, const char *labels,
                   const rt_hist *h, rt_bounds bd, double scale)
{
    char line[1024];
    snprintf(line, sizeof line, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    int rc = rt_buf_puts(b, line);
    return rc | rt_hist_render_series(b, name, labels, h, bd, scale);
}

int rt_hist_render_series(rt_buf *b, const char *name, const char *labels, const rt_hist *h,
                          rt_bounds bd, double scale)
{
    char line[1024];
    const char *sep = labels[0] ? "," : "";
    int rc = 0;
    uint64_t cum = 0;
    for (int i = 0; i <= bd.n; i++) {
        cum += h->counts[i];
        if (i < bd.n)
            snprintf(line, sizeof line, "%s_bucket{%s%sle=\"%.15g\"} %llu\n", name, labels, sep,
                     bd.le[i] * scale, (unsigned long long)cum);
        else
            snprintf(line, sizeof line, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels, sep,
                     (unsigned long long)cum);
        rc |= rt_buf_puts(b, line);
    }
    const char *lb = labels[0] ? "{" : "", *rb = labels[0] ? "}" : "";
    snprintf(line, sizeof line, "%s_sum%s%s%s %.15g\n%s_count%s%s%s %llu\n", name, lb, labels, rb,
             h->sum * scale, name, lb, labels, rb, (unsigned long long)h->n);
    rc |= rt_buf_puts(b, line);
    return rc;
}

void rt_metrics_label_escape(char *out, size_t cap, const char *s)
{
    size_t w = 0;
    for (; *s; s++) {
        bool esc = *s == '\\' || *s == '"' || *s == '\n';
        if (w + 1 + esc >= cap) break;
        if (esc) out[w++] = '\\';
        out[w++] = *s == '\n' ? 'n' : *s;
    }
    if (cap) out[w] = '\0';
}

static int put_hist(rt_buf *b, const char *name, const char *help, const rt_hist *h, rt_bounds bd)
{
    return rt_hist_render(b, name, help, "", h, bd, 1.0);
}

/* The disaggregated-mode series (caller holds m->mu). */
static int render_prefill(rt_buf *b, const rt_metrics *m, const td_cfg *cfg)
{
    char line[512];
    int rc = 0;
    snprintf(
        line, sizeof line,
        "# HELP tandem_router_prefill_requests_total Prefill requests sent (one per attempt).\n"
        "# TYPE tandem_router_prefill_requests_total counter\n"
        "tandem_router_prefill_requests_total %llu\n"
        "# HELP tandem_router_prefill_retries_total Requests retried after a prefill failure.\n"
        "# TYPE tandem_router_prefill_retries_total counter\n"
        "tandem_router_prefill_retries_total %llu\n",
        (unsigned long long)m->pf_requests, (unsigned long long)m->pf_retries);
    rc |= rt_buf_puts(b, line);
    static const char *const reasons[RT_PF_N] = {"prefill_error", "instance_dead", "transfer",
                                                 "deadline"};
    rc |= rt_buf_puts(b, "# HELP tandem_router_prefill_failures_total Attempts that failed "
                         "before their first token, by reason.\n"
                         "# TYPE tandem_router_prefill_failures_total counter\n");
    for (int k = 0; k < RT_PF_N; k++) {
        snprintf(line, sizeof line, "tandem_router_prefill_failures_total{reason=\"%s\"} %llu\n",
                 reasons[k], (unsigned long long)m->pf_failures[k]);
        rc |= rt_buf_puts(b, line);
    }
    snprintf(line, sizeof line,
             "# HELP tandem_router_pair_busy_total ERR_BUSY answers to Alloc (decode) and "
             "Prefill (prefill).\n"
             "# TYPE tandem_router_pair_busy_total counter\n"
             "tandem_router_pair_busy_total{side=\"decode\"} %llu\n"
             "tandem_router_pair_busy_total{side=\"prefill\"} %llu\n",
             (unsigned long long)m->busy_decode, (unsigned long long)m->busy_prefill);
    rc |= rt_buf_puts(b, line);
    rc |= put_hist(b, "tandem_router_prefill_chunk_size_tokens",
                   "Chunk sizes chosen by the prefill instances (from PrefillDone).", &m->chunk,
                   CHUNK_BOUNDS);
    rc |= put_hist(b, "tandem_router_prefill_seconds",
                   "Prefill time: first chunk's start to the last stage's finish (PrefillDone).",
                   &m->pf_time, LAT_BOUNDS);
    rc |= put_hist(b, "tandem_router_prefill_queue_seconds",
                   "Time a prefill waited at stage 0 before its first chunk (PrefillDone).",
                   &m->pf_queued, LAT_BOUNDS);
    static const char *const names[] = {"up", "queued_prompt_tokens", "running", "waiting",
                                        "requests"};
    static const char *const helps[] = {
        "1 when the prefill instance is alive and ready (all stages joined).",
        "Prompt tokens queued or being prefilled on the instance.",
        "Requests the instance is prefilling.", "Requests waiting at the instance's stage 0.",
        "The router's attempts on the instance not yet done."};
    for (int k = 0; k < 5; k++) {
        snprintf(line, sizeof line,
                 "# HELP tandem_prefill_instance_%s %s\n# TYPE tandem_prefill_instance_%s gauge\n",
                 names[k], helps[k], names[k]);
        rc |= rt_buf_puts(b, line);
        for (int j = 0; j < m->n_pf; j++) {
            if (!m->pf[j].name[0]) continue;
            const rt_pf_gauge *g = &m->pf[j];
            double v = k == 0   ? g->alive
                       : k == 1 ? (double)g->queued_tokens
                       : k == 2 ? (double)g->running
                       : k == 3 ? (double)g->waiting
                                : (double)g->active;
            snprintf(line, sizeof line, "tandem_prefill_instance_%s{instance=\"%s\"} %g\n",
                     names[k], m->pf[j].name, v);
            rc |= rt_buf_puts(b, line);
        }
    }
    return rc;
}

/* Responses: generation requests by status, the other paths by path and status (caller holds
 * m->mu). */
static int render_requests(rt_buf *b, const rt_metrics *m)
{
    char line[512];
    int rc = 0;
    rc |= rt_buf_puts(b, "# HELP tandem_router_requests_total Generation requests "
                         "(/v1/completions, /v1/chat/completions) by the HTTP status of their "
                         "response.\n"
                         "# TYPE tandem_router_requests_total counter\n");
    for (int s = 100; s < 600; s++) {
        if (!m->by_status[s]) continue;
        snprintf(line, sizeof line, "tandem_router_requests_total{status=\"%d\"} %llu\n", s,
                 (unsigned long long)m->by_status[s]);
        rc |= rt_buf_puts(b, line);
    }
    static const char *const paths[RT_PATH_N] = {"/health", "/metrics", "/v1/models", "other"};
    rc |= rt_buf_puts(b, "# HELP tandem_router_http_requests_total Responses to the other "
                         "requests (health and metrics polls, /v1/models, unknown paths) by "
                         "path and status.\n"
                         "# TYPE tandem_router_http_requests_total counter\n");
    for (int p = 0; p < RT_PATH_N; p++)
        for (int s = 100; s < 600; s++) {
            uint64_t n = m->http[(size_t)p * 600 + (size_t)s];
            if (!n) continue;
            snprintf(line, sizeof line,
                     "tandem_router_http_requests_total{path=\"%s\",status=\"%d\"} %llu\n",
                     paths[p], s, (unsigned long long)n);
            rc |= rt_buf_puts(b, line);
        }
    return rc;
}

/* The request latency histograms (caller holds m->mu). */
static int render_latency(rt_buf *b, const rt_metrics *m)
{
    int rc = 0;
    rc |= put_hist(b, "tandem_router_time_to_first_token_seconds",
                   "Time from the complete request to its first generated token.", &m->ttft,
                   LAT_BOUNDS);
    rc |= put_hist(b, "tandem_router_time_per_output_token_seconds",
                   "Mean time between generated tokens after the first, per request.", &m->tpot,
                   TPOT_BOUNDS);
    rc |=
        put_hist(b, "tandem_router_e2e_request_latency_seconds",
                 "Time from the complete request to its last byte of output.", &m->e2e, LAT_BOUNDS);
    rc |= put_hist(b, "tandem_router_token_write_delay_seconds",
                   "Streaming: time from a token event reaching the router to its SSE bytes being "
                   "handed to the socket (the router's own overhead).",
                   &m->write_delay, WRITE_BOUNDS);
    return rc;
}

/* Token counters, the queue, timeouts, evictions, the drain, migrations (caller holds m->mu). */
static int render_counters(rt_buf *b, const rt_metrics *m)
{
    char line[512];
    int rc = 0;
    snprintf(line, sizeof line,
             "# HELP tandem_router_prompt_tokens_total Prompt tokens of finished requests.\n"
             "# TYPE tandem_router_prompt_tokens_total counter\n"
             "tandem_router_prompt_tokens_total %llu\n"
             "# HELP tandem_router_generation_tokens_total Generated tokens of finished requests.\n"
             "# TYPE tandem_router_generation_tokens_total counter\n"
             "tandem_router_generation_tokens_total %llu\n",
             (unsigned long long)m->prompt_tokens, (unsigned long long)m->generation_tokens);
    rc |= rt_buf_puts(b, line);
    snprintf(line, sizeof line,
             "# HELP tandem_router_queue_length Requests waiting in the router for an instance.\n"
             "# TYPE tandem_router_queue_length gauge\n"
             "tandem_router_queue_length %d\n"
             "# HELP tandem_router_requests_running Requests on decode instances.\n"
             "# TYPE tandem_router_requests_running gauge\n"
             "tandem_router_requests_running %d\n",
             m->queue, m->active);
    rc |= rt_buf_puts(b, line);
    static const char *const where[RT_TO_N] = {"queued", "waiting", "generating"};
    rc |= rt_buf_puts(b, "# HELP tandem_router_request_timeouts_total Requests ended by their "
                         "deadline (504), by where they were: queued, waiting (on an instance, "
                         "no token yet), generating.\n"
                         "# TYPE tandem_router_request_timeouts_total counter\n");
    for (int k = 0; k < RT_TO_N; k++) {
        snprintf(line, sizeof line, "tandem_router_request_timeouts_total{state=\"%s\"} %llu\n",
                 where[k], (unsigned long long)m->timeouts[k]);
        rc |= rt_buf_puts(b, line);
    }
    snprintf(line, sizeof line,
             "# HELP tandem_router_queue_evictions_total Queued requests refused (429) to make "
             "room for a request of a client holding fewer.\n"
             "# TYPE tandem_router_queue_evictions_total counter\n"
             "tandem_router_queue_evictions_total %llu\n"
             "# HELP tandem_router_draining 1 once a stop signal came: new requests get 503.\n"
             "# TYPE tandem_router_draining gauge\n"
             "tandem_router_draining %d\n",
             (unsigned long long)m->evictions, m->draining ? 1 : 0);
    rc |= rt_buf_puts(b, line);
    snprintf(line, sizeof line,
             "# HELP tandem_router_migrations_total Times a request's decode instance died, "
             "restarted or failed it and the request moved to go on elsewhere.\n"
             "# TYPE tandem_router_migrations_total counter\n"
             "tandem_router_migrations_total %llu\n",
             (unsigned long long)m->migrations);
    rc |= rt_buf_puts(b, line);
    rc |= put_hist(b, "tandem_router_migration_pause_seconds",
                   "Moved requests: time from losing the decode side to the next token.",
                   &m->migrate_pause, LAT_BOUNDS);
    return rc;
}

/* The per decode instance gauges (caller holds m->mu). */
static int render_decode(rt_buf *b, const rt_metrics *m, const td_cfg *cfg)
{
    char line[512];
    int rc = 0;
    static const char *const names[] = {
        "up", "running", "waiting", "kv_blocks_used", "kv_blocks_free", "kv_usage_ratio"};
    static const char *const helps[] = {"1 when the decode instance is alive and ready.",
                                        "Requests in the instance's batch.",
                                        "Requests admitted by the instance but waiting.",
                                        "KV blocks in use.",
                                        "KV blocks free.",
                                        "Fraction of the KV pool in use."};
    for (int k = 0; k < 6; k++) {
        snprintf(line, sizeof line,
                 "# HELP tandem_instance_%s %s\n# TYPE tandem_instance_%s gauge\n", names[k],
                 helps[k], names[k]);
        rc |= rt_buf_puts(b, line);
        for (int i = 0; i < m->n_inst; i++) {
            if (!m->inst[i].name[0]) continue;
            const rt_inst_gauge *g = &m->inst[i];
            double v = k == 0   ? g->alive
                       : k == 1 ? g->running
                       : k == 2 ? g->waiting
                       : k == 3 ? g->kv_used
                       : k == 4 ? g->kv_free
                       : g->kv_used + g->kv_free
                           ? (double)g->kv_used / (double)(g->kv_used + g->kv_free)
                           : 0.0;
            snprintf(line, sizeof line, "tandem_instance_%s{instance=\"%s\"} %g\n", names[k],
                     m->inst[i].name, v);
            rc |= rt_buf_puts(b, line);
        }
    }
    return rc;
}

/* pre key="val" with val escaped (pre: "{" for the first label, else ","). */
static int put_label(rt_buf *b, const char *pre, const char *key, const char *val)
{
    char esc[2 * TD_CTRL_MAX_PATHS + 2]; /* the longest value, every byte escaped */
    rt_metrics_label_escape(esc, sizeof esc, val);
    int rc = rt_buf_puts(b, pre);
    rc |= rt_buf_puts(b, key);
    rc |= rt_buf_puts(b, "=\"");
    rc |= rt_buf_puts(b, esc);
    return rc | rt_buf_puts(b, "\"");
}

/* What each decode and prefill instance computes with, as its last Health said (instances
 * that have not reported yet: no series): two info series (value 1, the facts in the labels)
 * and whether its OpenBLAS core is older than its CPU (caller holds m->mu). */
static int render_compute(rt_buf *b, const rt_metrics *m, const td_cfg *cfg)
{
    static const char *const names[3] = {"tandem_instance_compute_info",
                                         "tandem_instance_blas_core_older_than_cpu",
                                         "tandem_instance_products_info"};
    static const char *const helps[3] = {
        "What the instance computes with (decode: rank 0, prefill: stage 0): the backend, and "
        "the CPU backend's activation mode, CPU and kernel instruction sets and OpenBLAS core "
        "(empty for other backends). Always 1.",
        "1 when the instance's OpenBLAS core is older than its CPU: its float32 GEMM (prefill "
        "rows) runs at a fraction of the CPU's speed.",
        "The kernels of the instance's products by weight type (batch rows, solo rows; the CPU "
        "backend's). Always 1."};
    int rc = 0;
    for (int f = 0; f < 3; f++) {
        char line[512];
        snprintf(line, sizeof line, "# HELP %s %s\n# TYPE %s gauge\n", names[f], helps[f],
                 names[f]);
        rc |= rt_buf_puts(b, line);
        for (int k = 0; k < m->n_inst + m->n_pf; k++) {
            const bool dec = k < m->n_inst;
            const rt_compute *c = dec ? &m->inst[k].compute : &m->pf[k - m->n_inst].compute;
            if (!c->seen || !(dec ? m->inst[k].name : m->pf[k - m->n_inst].name)[0]) continue;
            rc |= rt_buf_puts(b, names[f]);
            rc |= put_label(b, "{", "instance", dec ? m->inst[k].name : m->pf[k - m->n_inst].name);
            rc |= put_label(b, ",", "role", dec ? "decode" : "prefill");
            if (f == 0) {
                rc |= put_label(b, ",", "backend", c->backend);
                rc |= put_label(b, ",", "act", c->act);
                rc |= put_label(b, ",", "cpu_isa", c->cpu_isa);
                rc |= put_label(b, ",", "kernels_isa", c->kernels_isa);
                rc |= put_label(b, ",", "blas_core", c->blas_core);
            } else if (f == 2) {
                rc |= put_label(b, ",", "paths", c->paths);
            }
            rc |= rt_buf_puts(b, f == 1 && !c->blas_older ? "} 0\n" : "} 1\n");
        }
    }
    return rc;
}

char *rt_metrics_render(rt_metrics *m, const td_cfg *cfg)
{
    rt_buf b = {0};
    int rc = 0;
    pthread_mutex_lock(&m->mu);
    rc |= render_requests(&b, m);
    rc |= render_latency(&b, m);
    rc |= render_counters(&b, m);
    rc |= render_decode(&b, m, cfg);
    if (m->n_pf > 0) rc |= render_prefill(&b, m, cfg);
    rc |= render_compute(&b, m, cfg);
    rc |= rt_metrics_vllm_render(&b, m, cfg);
    if (cfg->router.routing == TD_CFG_ROUTING_CACHE_AWARE)
        rc |= rt_metrics_cache_render(&b, m, cfg);
    pthread_mutex_unlock(&m->mu);
    if (rc) {
        rt_buf_free(&b);
        return NULL;
    }
    return b.buf;
}

char *rt_metrics_instances_json(rt_metrics *m)
{
    json_t *dec = json_array(), *pf = json_array();
    pthread_mutex_lock(&m->mu);
    for (int i = 0; dec && i < m->n_inst; i++) {
        const rt_inst_gauge *g = &m->inst[i];
        if (!g->name[0]) continue;
        json_array_append_new(
            dec, json_pack("{s:s, s:s, s:b, s:b, s:b, s:I, s:I, s:I, s:I}", "name", g->name,
                           "url", g->url, "alive", g->alive, "draining", g->draining, "joined",
                           g->joined, "running", (json_int_t)g->running, "waiting",
                           (json_int_t)g->waiting, "kv_blocks_used", (json_int_t)g->kv_used,
                           "kv_blocks_free", (json_int_t)g->kv_free));
    }
    for (int j = 0; pf && j < m->n_pf; j++) {
        const rt_pf_gauge *g = &m->pf[j];
        if (!g->name[0]) continue;
        json_array_append_new(
            pf, json_pack("{s:s, s:s, s:b, s:b, s:b, s:I, s:I, s:I}", "name", g->name, "url",
                          g->url, "alive", g->alive, "draining", g->draining, "joined", g->joined,
                          "running", (json_int_t)g->running, "waiting", (json_int_t)g->waiting,
                          "queued_prompt_tokens", (json_int_t)g->queued_tokens));
    }
    pthread_mutex_unlock(&m->mu);
    json_t *root = dec && pf ? json_pack("{s:o, s:o}", "decode", dec, "prefill", pf) : NULL;
    if (!root) {
        json_decref(dec);
        json_decref(pf);
        return NULL;
    }
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}
