/* rt_metrics.h: the router's Prometheus metrics and its one log line per ended request
 * (prefix rt_metrics_).
 *
 * Purpose: counters, gauges and histograms of generation requests, non-generation paths,
 * instances and (disaggregated) the pairing; rendered as Prometheus text for /metrics.
 * Invariants: histogram counts[] are per bucket (cumulated when rendered); the gauges are
 * what the loop last published.
 * Threading: every function takes rt_metrics.mu; any thread may call them
 * (rt_metrics_request_end: the loop thread, before the request is retired).
 * Ownership: rt_metrics owns its gauge arrays (rt_metrics_fini).
 * Names: tandem_* (rt_metrics.c) and the vLLM / SGLang names that stock dashboards query
 * (rt_metrics_vllm.c; docs/api.md has the mapping).
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
#include "rt_req.h"
#include "td_step_hist.h"

#define RT_HIST_BUCKETS 16 /* the tandem_* histograms' */
#define RT_HIST_MAX     24 /* the most finite buckets of any histogram */

typedef struct {
    uint64_t counts[RT_HIST_MAX + 1]; /* per bucket, the one after the last bound: +Inf */
    double sum;
    uint64_t n;
} rt_hist;

/* A histogram's finite upper bounds, ascending (n <= RT_HIST_MAX). */
typedef struct {
    const double *le;
    int n;
} rt_bounds;

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
#define RT_SPEC_N   (3 + RT_SPEC_POS) /* rt_inst_gauge.spec */

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
     * (Health.spec_accepted_per_pos; 0 past its end) */
    uint64_t spec[RT_SPEC_N];
    uint64_t boot_id; /* Health.boot_id: a new one restarts every count above from 0 */
    bool alive;
    rt_compute compute;
    char name[TD_CFG_NAME_MAX + 1]; /* the instance's; "": a vacant slot (no series) */
    char url[160];                  /* its control socket as the router dials it */
    bool joined;                    /* it joined at run time (router.membership) */
    bool draining;                  /* it is leaving: nothing new goes to it */
} rt_inst_gauge;

/* vllm:request_success_total's finished_reason label. */
typedef enum {
    RT_FR_STOP = 0,
    RT_FR_LENGTH,
    RT_FR_ABORT,
    RT_FR_TOOL_CALLS, /* "stop" whose answer was parsed into tool calls (rt_tools.h) */
    RT_FR_N
} rt_fin_reason;

/* The series named after vLLM's and SGLang's (rt_metrics_vllm.c). */
typedef struct {
    char model[520];            /* model_name="...", escaped (rt_metrics_set_model) */
    double tok_le[RT_HIST_MAX]; /* tokens: vLLM's 1-2-5 bounds up to the context length */
    int n_tok_le;
    rt_hist ttft, itl, e2e;         /* seconds; itl: one observation per token after the first */
    rt_hist queue, prefill, decode; /* seconds: arrival -> dispatch -> first token -> last */
    rt_hist inference, tpot_req;    /* seconds: prefill + decode; per request (last-first)/(n-1) */
    rt_hist prompt, gen;            /* tokens per finished request */
    uint64_t success[RT_FR_N];      /* ended requests by finish reason */
    uint64_t prompt_tokens, gen_tokens; /* every request's (prefilled prompts, received tokens) */
    uint64_t *preempt_total;            /* (n_inst) preemptions seen, across instance restarts */
    uint64_t *preempt_last;             /* (n_inst) the last reported count */
    uint64_t *pc_total, *pc_last;       /* (n_inst, RT_PC_N) the same for .pc */
    uint64_t *step_total, *step_last;   /* (n_inst, RT_STEP_N) the same for .steps */
    uint64_t *spec_total, *spec_last;   /* (n_inst, RT_SPEC_N) the same for .spec */
    uint64_t *boot_last;                /* (n_inst) the boot id the last counts came from */
    rt_hist kv_s, kv_exposed_s;         /* seconds: PrefillDone.kv_transfer_us, kv_exposed_us */
    rt_hist kv_bytes, kv_bw;            /* bytes; bytes per second (bytes / kv_transfer_us) */
} rt_vmetrics;

typedef struct {
    uint64_t queued_tokens;
    uint32_t running, waiting;
    int active; /* the router's attempts on it */
    bool alive;
    rt_compute compute;
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
    uint64_t by_status[600]; /* responses by HTTP status */
    uint64_t prompt_tokens, generation_tokens;
    rt_hist ttft, tpot, e2e; /* seconds */
    rt_hist write_delay;     /* seconds: token event received -> its bytes handed to the socket */
    rt_inst_gauge *inst;     /* (n_inst) */
    int n_inst;
    int queue;                  /* requests in the router queue */
    int active;                 /* requests on instances */
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
    rt_pf_gauge *pf;                    /* (n_pf) */
    int n_pf;
    uint64_t *http; /* (RT_PATH_N, 600) responses to non-generation requests by path and
                      status (rt_metrics_http) */
    rt_vmetrics v;
    rt_cache_stats *cache_dec; /* (n_inst) cache-aware routing, as the loop last published */
    rt_cache_stats *cache_pf;  /* (n_pf) */
} rt_metrics;

int rt_metrics_init(rt_metrics *m, int n_inst, int n_pf);
void rt_metrics_fini(rt_metrics *m);
/* The served model: the model_name label, and the token histograms' bounds (1, 2, 5, 10, ...
 * up to n_ctx). Before the loop starts. */
void rt_metrics_set_model(rt_metrics *m, const char *name, int32_t n_ctx);
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
/* Tokens arrived: k of them, `gap` seconds after the request's previous tokens (its first
 * tokens are not reported): k inter-token latencies of gap / k each. */
void rt_metrics_itl(rt_metrics *m, double gap, int k);
/* Decode instance i's figures from the loop (caller holds m->mu): stores g and counts the
 * preemptions (and every other count of g) it reports since the last call (a smaller count:
 * the instance restarted). */
void rt_metrics_publish_inst(rt_metrics *m, int i, const rt_inst_gauge *g);
/* Histogram helpers shared by rt_metrics.c and rt_metrics_vllm.c. rt_hist_render writes
 * one histogram series (labels: "" or `k="v",...`), bounds and sum multiplied by scale (a
 * unit change: 1000 renders seconds as milliseconds). 0 or TD_ENOMEM. */
void rt_hist_observe(rt_hist *h, rt_bounds bd, double v);
int rt_hist_render(rt_buf *b, const char *name, const char *help, const char *labels,
                   const rt_hist *h, rt_bounds bd, double scale);
/* The same without the HELP and TYPE lines: one more series of a histogram family (several
 * label sets under one header). */
int rt_hist_render_series(rt_buf *b, const char *name, const char *labels, const rt_hist *h,
                          rt_bounds bd, double scale);
/* s as a Prometheus label value (text format 0.0.4: backslash, double quote and line feed
 * escaped) into out, NUL-terminated; cut before an escape that does not fit. */
void rt_metrics_label_escape(char *out, size_t cap, const char *s);
/* rt_metrics_vllm.c, caller holds m->mu: a request ended (as rt_metrics_request_end); a
 * PrefillDone's KV figures; the vLLM/SGLang-named series. */
void rt_metrics_vllm_end(rt_metrics *m, const rt_req *q, int64_t now_ms, int status,
                         const char *outcome);
void rt_metrics_vllm_kv(rt_metrics *m, const Td__PrefillDone *d);
int rt_metrics_vllm_render(rt_buf *b, const rt_metrics *m, const td_cfg *cfg);
/* rt_metrics_cache.c, caller holds m->mu: the tandem_router_cache_route_* series (only
 * with router.routing: cache_aware). */
int rt_metrics_cache_render(rt_buf *b, const rt_metrics *m, const td_cfg *cfg);
/* Prometheus text exposition (malloc'd). */
char *rt_metrics_render(rt_metrics *m, const td_cfg *cfg);
/* GET /instances: the live set as the loop last published it, JSON (malloc'd):
 * {"decode": [{"name", "url", "alive", "draining", "joined", "running", "waiting",
 * "kv_blocks_used", "kv_blocks_free"}], "prefill": [{"name", "url", "alive", "draining",
 * "joined", "running", "waiting", "queued_prompt_tokens"}]}. */
char *rt_metrics_instances_json(rt_metrics *m);
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

#endif
