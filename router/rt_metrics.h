/* rt_metrics.h: the router's Prometheus metrics and its one log line per ended request
 * (prefix rt_metrics_).
 *
 * Purpose: counters, gauges and histograms of generation requests, non-generation paths,
 * instances and (disaggregated) the pairing; rendered as Prometheus text for /metrics
 * through the family writer of rt_metrics_text.h.
 * Invariants: histogram counts[] are per bucket (cumulated when rendered); the gauges are
 * what the loop last published; every field of rt_metrics has one writer, the file named
 * at its block below (the others read it, under mu).
 * Threading: every function takes rt_metrics.mu, except those marked "caller holds m->mu"
 * (rt_metrics_publish_*: the loop publishes under one lock); any thread may call them
 * (rt_metrics_request_end: the loop thread, before the request is retired).
 * Ownership: rt_metrics owns its per-instance arrays and the http counts (rt_metrics_fini).
 * Files, by concern (rt_metrics_render in rt_metrics.c calls each one's render in turn;
 * none calls another's):
 *   rt_metrics.c        the router's own counts and histograms (tandem_router_*), the log
 *                       line, init/fini, the render order
 *   rt_metrics_inst.c   the instances as the loop publishes them (gauges, compute facts,
 *                       cache-aware routing stats) and their counts summed across restarts;
 *                       tandem_instance_*, tandem_prefill_instance_*, GET /instances
 *   rt_metrics_vllm.c   the series under vLLM's and SGLang's names (and the tandem_ ones that
 *                       sit among them) and the request measures only they use (rt_vmetrics)
 *   rt_metrics_cache.c  tandem_router_cache_route_* (router.routing: cache_aware)
 *   rt_metrics_text.c   the text writer (families, labels, samples, histograms)
 * docs/api.md has the mapping of names to what they measure.
 */
#ifndef RT_METRICS_H
#define RT_METRICS_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "ctrl.h"
#include "rt_cache.h"
#include "rt_metrics_text.h"
#include "rt_req.h"
#include "td_step_hist.h"

#define RT_HIST_BUCKETS 16 /* the tandem_router_* histograms' */

/* What an instance computes with, as its Health said (fields 27-33; rt_reg_seen copies
 * them, bytes outside printable ASCII but the line feed replaced by '?'): the series
 * tandem_instance_compute_info, _blas_core_older_than_cpu and _products_info. */
typedef struct {
    bool seen; /* a Health came (before: no series) */
    char backend[TD_CTRL_MAX_TAG + 1], act[TD_CTRL_MAX_TAG + 1], cpu_isa[TD_CTRL_MAX_TAG + 1],
        kernels_isa[TD_CTRL_MAX_TAG + 1], blas_core[TD_CTRL_MAX_TAG + 1];
    bool blas_older; /* Health.blas_core_older */
    char paths[TD_CTRL_MAX_PATHS + 1];
} rt_compute;

#define RT_PC_N   6                    /* rt_inst_gauge.pc */
#define RT_STEP_N (TD_STEP_HIST_N + 2) /* rt_inst_gauge.steps */
/* Health.spec_accepted_per_pos entries kept (the decode node's DC_SPEC_MAX_TOKENS); later
 * ones are dropped */
#define RT_SPEC_POS 32
#define RT_SPEC_HELD (3 + RT_SPEC_POS)  /* rt_inst_gauge.spec[]: Health.spec_held_steps */
#define RT_SPEC_N    (RT_SPEC_HELD + 1) /* rt_inst_gauge.spec */
#define RT_SHARE_N   3                  /* rt_inst_gauge.share */

/* A decode instance as the loop publishes it (rt_reg_gauge, rt_metrics_publish_inst). */
typedef struct {
    uint32_t running, waiting, kv_used, kv_free;
    uint64_t preemptions; /* as the instance last reported it (Health.num_preemptions) */
    /* likewise: prefix cache queried tokens, hit tokens, evictions (Health 13-15), then its
     * second tier's blocks written, blocks read back, hit tokens (Health.prefix_tier 0-2) */
    uint64_t pc[RT_PC_N];
    /* likewise: its steps per td_step_hist.h bucket (Health.step_time_counts), then their
     * total time in microseconds (Health.step_time_us) */
    uint64_t steps[RT_STEP_N];
    /* likewise: speculative decoding's verifications, proposed tokens verified, of which
     * accepted (Health 34-36), then the accepted tokens at each proposal position
     * (Health.spec_accepted_per_pos; 0 past its end), then the steps the measured gate held
     * the proposals off (Health.spec_held_steps) */
    uint64_t spec[RT_SPEC_N];
    /* likewise: decode[].share_cores's steps that claimed the cores, steps left to the
     * scheduler, times auto began claiming (Health 40-42) */
    uint64_t share[RT_SHARE_N];
    bool share_claiming; /* Health.share_claiming: its steps claim the cores now */
    uint64_t boot_id; /* Health.boot_id: a new one restarts every count above from 0 */
    bool alive;
    rt_compute compute;
    rt_cache_stats cache;           /* cache-aware routing's figures for it (rt_inst.cst) */
    char name[TD_CFG_NAME_MAX + 1]; /* the instance's; "": a vacant slot (no series) */
    char url[160];                  /* its control socket as the router dials it */
    bool joined;                    /* it joined at run time (router.membership) */
    bool draining;                  /* it is leaving: nothing new goes to it */
} rt_inst_gauge;

/* A decode instance's counts as /metrics shows them: summed across its restarts (the
 * instance reports counts since its own start). */
typedef struct {
    uint64_t preempt, pc[RT_PC_N], steps[RT_STEP_N], spec[RT_SPEC_N], share[RT_SHARE_N];
} rt_inst_counts;
typedef struct {
    rt_inst_counts total; /* seen across restarts: what the counters render */
    rt_inst_counts last;  /* as last reported (0 after a restart) */
    uint64_t boot;        /* the boot id the last counts came from */
} rt_inst_tally;

/* vllm:request_success_total's finished_reason label. */
typedef enum {
    RT_FR_STOP = 0,
    RT_FR_LENGTH,
    RT_FR_ABORT,
    RT_FR_TOOL_CALLS, /* "stop" whose answer was parsed into tool calls (rt_tools.h) */
    RT_FR_N
} rt_fin_reason;

/* The request measures of the series named after vLLM's and SGLang's (rt_metrics_vllm.c
 * writes them all). */
typedef struct {
    char model[520];            /* the model_name label's value (rt_metrics_set_model) */
    double tok_le[RT_HIST_MAX]; /* tokens: vLLM's 1-2-5 bounds up to the context length */
    int n_tok_le;
    rt_hist ttft, itl, e2e;         /* seconds; itl: one observation per token after the first */
    rt_hist queue, prefill, decode; /* seconds: arrival -> dispatch -> first token -> last */
    rt_hist inference, tpot_req;    /* seconds: prefill + decode; per request (last-first)/(n-1) */
    rt_hist prompt, gen;            /* tokens per finished request */
    uint64_t success[RT_FR_N];      /* ended requests by finish reason */
    uint64_t prompt_tokens, gen_tokens; /* every request's (prefilled prompts, received tokens) */
    rt_hist kv_s, kv_exposed_s;         /* seconds: PrefillDone.kv_transfer_us, kv_exposed_us */
    rt_hist kv_bytes, kv_bw;            /* bytes; bytes per second (bytes / kv_transfer_us) */
} rt_vmetrics;

/* A prefill instance as the loop publishes it (rt_metrics_publish_pf). */
typedef struct {
    uint64_t queued_tokens;
    uint32_t running, waiting;
    int active; /* the router's attempts on it */
    bool alive;
    rt_compute compute;
    rt_cache_stats cache;           /* cache-aware routing's figures for it (rt_inst.cst) */
    char name[TD_CFG_NAME_MAX + 1]; /* the instance's; "": a vacant slot (no series) */
    char url[160];                  /* its control socket as the router dials it */
    bool joined;                    /* it joined at run time (router.membership) */
    bool draining;                  /* it is leaving: nothing new goes to it */
} rt_pf_gauge;

/* Where a request was when its deadline passed (metric label). */
typedef enum {
    RT_TO_QUEUED = 0, /* in the router queue */
    RT_TO_WAITING,    /* on its instance(s), no token yet (disaggregated: prefilling) */
    RT_TO_GENERATING, /* tokens were coming */
    RT_TO_N
} rt_timeout_state;

/* Why a disaggregated attempt failed before its first token (metric label). */
typedef enum {
    RT_PF_ERROR = 0, /* the prefill instance reported an error (reply or ErrorEvent) */
    RT_PF_DEAD,      /* the prefill instance was marked dead */
    RT_PF_TRANSFER,  /* the decode side reported the KV transfer failed / timed out */
    RT_PF_DEADLINE,  /* no first token by the attempt's deadline */
    RT_PF_N
} rt_pf_fail;

typedef struct {
    pthread_mutex_t mu;
    /* rt_metrics.c writes these: the router's own counts and histograms, and the router
     * gauges the loop publishes (rt_metrics_publish_router) */
    uint64_t by_status[600]; /* responses by HTTP status */
    uint64_t prompt_tokens, generation_tokens;
    rt_hist ttft, tpot, e2e; /* seconds */
    rt_hist write_delay;     /* seconds: token event received -> its bytes handed to the socket */
    int queue;               /* requests in the router queue */
    int active;              /* requests on instances */
    uint64_t timeouts[RT_TO_N]; /* requests ended by their deadline */
    uint64_t evictions;         /* queued requests refused to make room for a quieter client */
    uint64_t migrations;        /* times a request's decode side was lost and it moved */
    rt_hist migrate_pause;      /* seconds: decode side lost -> the next token (moved requests) */
    bool draining;              /* SIGTERM/SIGINT received */
    /* disaggregated mode */
    uint64_t pf_requests; /* Prefill messages sent (attempts) */
    uint64_t pf_retries;  /* attempts retried after a prefill failure */
    uint64_t pf_failures[RT_PF_N];
    uint64_t busy_decode, busy_prefill; /* ERR_BUSY bounces */
    rt_hist chunk;                      /* tokens: chunk sizes from PrefillDone */
    rt_hist pf_time, pf_queued;         /* seconds: PrefillDone.prefill_ms, queued_ms */
    uint64_t *http; /* (RT_PATH_N, 600) responses to non-generation requests by path and
                      status (rt_metrics_http) */
    /* rt_metrics_inst.c writes these (rt_metrics_inst_init, rt_metrics_publish_inst/_pf) */
    rt_inst_gauge *inst;  /* (n_inst) */
    rt_inst_tally *tally; /* (n_inst) */
    int n_inst;
    rt_pf_gauge *pf; /* (n_pf) */
    int n_pf;
    /* rt_metrics_vllm.c writes these */
    rt_vmetrics v;
} rt_metrics;

/* ---- rt_metrics.c ---- */

int rt_metrics_init(rt_metrics *m, int n_inst, int n_pf);
void rt_metrics_fini(rt_metrics *m);
void rt_metrics_status(rt_metrics *m, int status);
void rt_metrics_write_delay(rt_metrics *m, double seconds);
void rt_metrics_prefill_done(rt_metrics *m, const Td__PrefillDone *d);
typedef enum {
    RT_PM_SENT = 0,     /* a Prefill went out (an attempt) */
    RT_PM_RETRY,        /* a request is retried after a prefill failure */
    RT_PM_BUSY_DECODE,  /* ERR_BUSY to Alloc */
    RT_PM_BUSY_PREFILL, /* ERR_BUSY to Prefill */
    RT_PM_FAIL,         /* an attempt failed before its first token (why) */
} rt_pair_metric;
void rt_metrics_pair(rt_metrics *m, rt_pair_metric what, rt_pf_fail why);
void rt_metrics_timeout(rt_metrics *m, rt_timeout_state where);
void rt_metrics_eviction(rt_metrics *m);
/* A request moved (rt_loop_lose); a moved request's next token came `pause` s after. */
void rt_metrics_migration(rt_metrics *m);
void rt_metrics_migrated(rt_metrics *m, double pause);
/* The loop's router gauges (caller holds m->mu): requests in the router queue, requests on
 * instances, whether a stop signal came. */
void rt_metrics_publish_router(rt_metrics *m, int queue, int active, bool draining);
/* Prometheus text exposition (malloc'd). */
char *rt_metrics_render(rt_metrics *m, const td_cfg *cfg);
/* Non-generation paths, counted apart from the API (generation) requests. */
typedef enum {
    RT_PATH_HEALTH = 0, /* /health */
    RT_PATH_METRICS,    /* /metrics */
    RT_PATH_MODELS,     /* /v1/models */
    RT_PATH_OTHER,      /* anything else (404) */
    RT_PATH_N
} rt_path;
/* A response with status (100..599) to a request on a non-generation path. */
void rt_metrics_http(rt_metrics *m, rt_path path, int status);
/* A generation request ended, however: finished (status 200, outcome its finish reason
 * "stop" / "length"), failed, timed out, refused or left by its client (status: the HTTP
 * status its answer has or would have had, also when it goes out as an SSE error event;
 * outcome: the error code, or NULL). Logs the request's one info line (id, endpoint,
 * status, outcome, prompt and output tokens, TTFT, total time, instances; never the
 * prompt) and, finished, records its tokens and latencies. Loop thread, before q is
 * retired. */
void rt_metrics_request_end(rt_metrics *m, const td_cfg *cfg, const rt_req *q, int64_t now_ms,
                            int status, const char *outcome);

/* ---- rt_metrics_inst.c ---- */

/* The per-instance arrays, all zero (rt_metrics_init; n <= 0: one unused slot). 0 or
 * TD_ENOMEM; rt_metrics_inst_fini frees what was allocated. */
int rt_metrics_inst_init(rt_metrics *m, int n_inst, int n_pf);
void rt_metrics_inst_fini(rt_metrics *m);
/* Decode instance i's figures from the loop (caller holds m->mu): stores g and counts the
 * preemptions (and every other count of g) it reports since the last call (a smaller count
 * or a new boot id: the instance restarted; another name: another instance, from 0). */
void rt_metrics_publish_inst(rt_metrics *m, int i, const rt_inst_gauge *g);
/* Prefill instance j's figures from the loop (caller holds m->mu): stores g. */
void rt_metrics_publish_pf(rt_metrics *m, int j, const rt_pf_gauge *g);
/* Caller holds m->mu: tandem_instance_{up,...,kv_usage_ratio} per decode instance;
 * tandem_prefill_instance_* per prefill instance; the three compute series per instance
 * that reported. */
void rt_metrics_inst_render_decode(rt_mw *w, const rt_metrics *m);
void rt_metrics_inst_render_prefill(rt_mw *w, const rt_metrics *m);
void rt_metrics_inst_render_compute(rt_mw *w, const rt_metrics *m);
/* GET /instances: the live set as the loop last published it, JSON (malloc'd):
 * {"decode": [{"name", "url", "alive", "draining", "joined", "running", "waiting",
 * "kv_blocks_used", "kv_blocks_free"}], "prefill": [{"name", "url", "alive", "draining",
 * "joined", "running", "waiting", "queued_prompt_tokens"}]}. */
char *rt_metrics_instances_json(rt_metrics *m);

/* ---- rt_metrics_vllm.c ---- */

/* The served model: the model_name label, and the token histograms' bounds (1, 2, 5, 10, ...
 * up to n_ctx). Before the loop starts. */
void rt_metrics_set_model(rt_metrics *m, const char *name, int32_t n_ctx);
/* Tokens arrived: k of them, `gap` seconds after the request's previous tokens (its first
 * tokens are not reported): k inter-token latencies of gap / k each. */
void rt_metrics_itl(rt_metrics *m, double gap, int k);
/* Caller holds m->mu: a request ended (as rt_metrics_request_end); a PrefillDone's KV
 * figures; the vLLM/SGLang-named series. */
void rt_metrics_vllm_end(rt_metrics *m, const rt_req *q, int64_t now_ms, int status,
                         const char *outcome);
void rt_metrics_vllm_kv(rt_metrics *m, const Td__PrefillDone *d);
void rt_metrics_vllm_render(rt_mw *w, const rt_metrics *m);

/* ---- rt_metrics_cache.c ---- */

/* Caller holds m->mu: the tandem_router_cache_route_* series (only with router.routing:
 * cache_aware). */
void rt_metrics_cache_render(rt_mw *w, const rt_metrics *m);

#endif
