/* rt_metrics.c: the router's own Prometheus series (text exposition format 0.0.4), its one
 * log line per ended generation request, and the order of the exposition.
 * Series: tandem_router_requests_total{status} (generation requests only: /v1/completions
 * and /v1/chat/completions), tandem_router_http_requests_total{path,status} (everything
 * else: /health, /metrics, /v1/models, path="other"), tandem_router_time_to_first_token_seconds,
 * tandem_router_time_per_output_token_seconds, tandem_router_e2e_request_latency_seconds,
 * tandem_router_token_write_delay_seconds (histograms), tandem_router_prompt_tokens_total,
 * tandem_router_generation_tokens_total, tandem_router_queue_length,
 * tandem_router_requests_running, tandem_router_request_timeouts_total{state},
 * tandem_router_queue_evictions_total, tandem_router_draining, tandem_router_migrations_total,
 * tandem_router_migration_pause_seconds. With prefill instances (disaggregated mode) also
 * tandem_router_prefill_{requests,retries,failures{reason}}_total,
 * tandem_router_pair_busy_total{side}, the histograms tandem_router_prefill_chunk_size_tokens,
 * tandem_router_prefill_seconds, tandem_router_prefill_queue_seconds.
 * The per-instance series are rt_metrics_inst.c's, the vLLM- and SGLang-named ones
 * rt_metrics_vllm.c's, tandem_router_cache_route_* (cache-aware routing) rt_metrics_cache.c's;
 * rt_metrics_render calls each in turn. This file writes only the fields of rt_metrics'
 * first block (rt_metrics.h).
 * Threading: every function takes m->mu (rt_metrics_publish_router: the caller holds it);
 * any thread may call them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
    m->http = calloc((size_t)RT_PATH_N * 600, sizeof *m->http);
    rt_metrics_set_model(m, "", 0);
    int rc = rt_metrics_inst_init(m, n_inst, n_pf);
    return !m->http ? TD_ENOMEM : rc;
}

void rt_metrics_fini(rt_metrics *m)
{
    rt_metrics_inst_fini(m);
    free(m->http);
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

void rt_metrics_publish_router(rt_metrics *m, int queue, int active, bool draining)
{
    m->queue = queue;
    m->active = active;
    m->draining = draining;
}

static void put_hist(rt_mw *w, const char *name, const char *help, const rt_hist *h, rt_bounds bd)
{
    rt_mw_hist_family(w, name, help, NULL, h, bd, 1.0);
}

/* The disaggregated-mode router series (caller holds m->mu). */
static void render_prefill(rt_mw *w, const rt_metrics *m)
{
    rt_mw_family(w, "tandem_router_prefill_requests_total", RT_MT_COUNTER,
                 "Prefill requests sent (one per attempt).");
    rt_mw_uint(w, NULL, m->pf_requests);
    rt_mw_family(w, "tandem_router_prefill_retries_total", RT_MT_COUNTER,
                 "Requests retried after a prefill failure.");
    rt_mw_uint(w, NULL, m->pf_retries);
    static const char *const reasons[RT_PF_N] = {"prefill_error", "instance_dead", "transfer",
                                                 "deadline"};
    rt_labels l;
    rt_mw_family(w, "tandem_router_prefill_failures_total", RT_MT_COUNTER,
                 "Attempts that failed before their first token, by reason.");
    for (int k = 0; k < RT_PF_N; k++) {
        rt_labels_reset(&l);
        rt_labels_add(&l, "reason", reasons[k]);
        rt_mw_uint(w, &l, m->pf_failures[k]);
    }
    rt_mw_family(w, "tandem_router_pair_busy_total", RT_MT_COUNTER,
                 "ERR_BUSY answers to Alloc (decode) and Prefill (prefill).");
    rt_labels_reset(&l);
    rt_labels_add(&l, "side", "decode");
    rt_mw_uint(w, &l, m->busy_decode);
    rt_labels_reset(&l);
    rt_labels_add(&l, "side", "prefill");
    rt_mw_uint(w, &l, m->busy_prefill);
    put_hist(w, "tandem_router_prefill_chunk_size_tokens",
             "Chunk sizes chosen by the prefill instances (from PrefillDone).", &m->chunk,
             CHUNK_BOUNDS);
    put_hist(w, "tandem_router_prefill_seconds",
             "Prefill time: first chunk's start to the last stage's finish (PrefillDone).",
             &m->pf_time, LAT_BOUNDS);
    put_hist(w, "tandem_router_prefill_queue_seconds",
             "Time a prefill waited at stage 0 before its first chunk (PrefillDone).",
             &m->pf_queued, LAT_BOUNDS);
}

/* Responses: generation requests by status, the other paths by path and status (caller holds
 * m->mu). */
static void render_requests(rt_mw *w, const rt_metrics *m)
{
    rt_labels l;
    rt_mw_family(w, "tandem_router_requests_total", RT_MT_COUNTER,
                 "Generation requests (/v1/completions, /v1/chat/completions) by the HTTP "
                 "status of their response.");
    for (int s = 100; s < 600; s++) {
        if (!m->by_status[s]) continue;
        rt_labels_reset(&l);
        rt_labels_add_int(&l, "status", s);
        rt_mw_uint(w, &l, m->by_status[s]);
    }
    static const char *const paths[RT_PATH_N] = {"/health", "/metrics", "/v1/models", "other"};
    rt_mw_family(w, "tandem_router_http_requests_total", RT_MT_COUNTER,
                 "Responses to the other requests (health and metrics polls, /v1/models, "
                 "unknown paths) by path and status.");
    for (int p = 0; p < RT_PATH_N; p++)
        for (int s = 100; s < 600; s++) {
            uint64_t n = m->http[(size_t)p * 600 + (size_t)s];
            if (!n) continue;
            rt_labels_reset(&l);
            rt_labels_add(&l, "path", paths[p]);
            rt_labels_add_int(&l, "status", s);
            rt_mw_uint(w, &l, n);
        }
}

/* The request latency histograms (caller holds m->mu). */
static void render_latency(rt_mw *w, const rt_metrics *m)
{
    put_hist(w, "tandem_router_time_to_first_token_seconds",
             "Time from the complete request to its first generated token.", &m->ttft, LAT_BOUNDS);
    put_hist(w, "tandem_router_time_per_output_token_seconds",
             "Mean time between generated tokens after the first, per request.", &m->tpot,
             TPOT_BOUNDS);
    put_hist(w, "tandem_router_e2e_request_latency_seconds",
             "Time from the complete request to its last byte of output.", &m->e2e, LAT_BOUNDS);
    put_hist(w, "tandem_router_token_write_delay_seconds",
             "Streaming: time from a token event reaching the router to its SSE bytes being "
             "handed to the socket (the router's own overhead).",
             &m->write_delay, WRITE_BOUNDS);
}

/* Token counters, the queue, timeouts, evictions, the drain, migrations (caller holds m->mu). */
static void render_counters(rt_mw *w, const rt_metrics *m)
{
    rt_mw_family(w, "tandem_router_prompt_tokens_total", RT_MT_COUNTER,
                 "Prompt tokens of finished requests.");
    rt_mw_uint(w, NULL, m->prompt_tokens);
    rt_mw_family(w, "tandem_router_generation_tokens_total", RT_MT_COUNTER,
                 "Generated tokens of finished requests.");
    rt_mw_uint(w, NULL, m->generation_tokens);
    rt_mw_family(w, "tandem_router_queue_length", RT_MT_GAUGE,
                 "Requests waiting in the router for an instance.");
    rt_mw_int(w, NULL, m->queue);
    rt_mw_family(w, "tandem_router_requests_running", RT_MT_GAUGE, "Requests on decode instances.");
    rt_mw_int(w, NULL, m->active);
    static const char *const where[RT_TO_N] = {"queued", "waiting", "generating"};
    rt_mw_family(w, "tandem_router_request_timeouts_total", RT_MT_COUNTER,
                 "Requests ended by their deadline (504), by where they were: queued, waiting "
                 "(on an instance, no token yet), generating.");
    for (int k = 0; k < RT_TO_N; k++) {
        rt_labels l;
        rt_labels_reset(&l);
        rt_labels_add(&l, "state", where[k]);
        rt_mw_uint(w, &l, m->timeouts[k]);
    }
    rt_mw_family(w, "tandem_router_queue_evictions_total", RT_MT_COUNTER,
                 "Queued requests refused (429) to make room for a request of a client holding "
                 "fewer.");
    rt_mw_uint(w, NULL, m->evictions);
    rt_mw_family(w, "tandem_router_draining", RT_MT_GAUGE,
                 "1 once a stop signal came: new requests get 503.");
    rt_mw_int(w, NULL, m->draining ? 1 : 0);
    rt_mw_family(w, "tandem_router_migrations_total", RT_MT_COUNTER,
                 "Times a request's decode instance died, restarted or failed it and the "
                 "request moved to go on elsewhere.");
    rt_mw_uint(w, NULL, m->migrations);
    put_hist(w, "tandem_router_migration_pause_seconds",
             "Moved requests: time from losing the decode side to the next token.",
             &m->migrate_pause, LAT_BOUNDS);
}

/* Each file renders its own families; the order here is the one /metrics has always had,
 * so that expositions from before and after a change compare line by line. */
char *rt_metrics_render(rt_metrics *m, const td_cfg *cfg)
{
    rt_buf b = {0};
    rt_mw w = rt_mw_start(&b);
    pthread_mutex_lock(&m->mu);
    render_requests(&w, m);
    render_latency(&w, m);
    render_counters(&w, m);
    rt_metrics_inst_render_decode(&w, m);
    if (m->n_pf > 0) {
        render_prefill(&w, m);
        rt_metrics_inst_render_prefill(&w, m);
    }
    rt_metrics_inst_render_compute(&w, m);
    rt_metrics_vllm_render(&w, m);
    if (cfg->router.routing == TD_CFG_ROUTING_CACHE_AWARE) rt_metrics_cache_render(&w, m);
    pthread_mutex_unlock(&m->mu);
    if (w.rc) {
        rt_buf_free(&b);
        return NULL;
    }
    return b.buf;
}
