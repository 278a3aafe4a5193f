/* pl_plan.h: the planner on top of the simulator: workloads, the search over cluster
 * configurations for the cheapest one that meets latency targets, and the reproduction of
 * SGLang's published chunked-pipeline-parallel figures (BACKGROUND.md section 5).
 *
 * Purpose: `tandem plan` (tools/cmd_plan.c) is a thin printer over these.
 * Cost of a configuration: its devices, n_prefill pp tp + n_decode tp. It meets the targets
 * when it fits in memory and its p90 TTFT and p90 TPOT are within them.
 * Threading: pure functions. Ownership: pl_search allocates *out (free() it).
 */
#ifndef PL_PLAN_H
#define PL_PLAN_H

#include <stdbool.h>
#include <stdint.h>

#include "pl_sim.h"

typedef struct {
    int n_requests;           /* > 0 */
    double rate;              /* arrivals a second (Poisson); 0: all at time 0 */
    int prompt_lo, prompt_hi; /* prompt tokens, uniform in [lo, hi] */
    int output_lo, output_hi; /* output tokens, uniform in [lo, hi], >= 1 */
    uint64_t seed;
} pl_workload;

/* The requests of w into out (w->n_requests). Returns 0 or TD_EINVAL (bad ranges). */
int pl_workload_make(const pl_workload *w, pl_request *out);

typedef struct {
    double ttft_ms, tpot_ms; /* p90 targets */
    int max_instances;       /* per role, 1..max; 0: 4 */
    pl_prefill_cfg pf;       /* chunk, chunk_max, smooth, page (pp and tp are searched) */
    int max_batch;           /* decode; 0: 256 */
    int max_prefill_tp;      /* 0: 1, Tandem's prefill node has no tensor parallelism (yet);
                              * more plans clusters of engines that have it */
    int max_devices;         /* 0: no cap; else configurations using more devices (the
                              * machine's cores or GPUs) are not considered */
    bool ep;                 /* decode instances run expert parallelism (pl_decode_cfg.ep) */
    int tbo_min;             /* > 0: decode instances of tp >= 2 run two-batch overlap
                              * (pl_decode_cfg.tbo_min) */
} pl_search_params;

typedef struct {
    pl_cluster cl;
    pl_result r;
    bool meets;
} pl_candidate;

/* Simulate every configuration (instances 1..max per role, pp in 1, 2, 4, 8, tp in 1, 2, 4,
 * 8 up to devices_per_node, prefill tp up to max_prefill_tp; for a mixture-of-experts model
 * without ep also decode instances that are data-parallel attention groups of 2 and 4 members)
 * over reqs. *out (n_out) in order of
 * devices then output throughput (descending); *best the index of the cheapest that meets the
 * targets, -1 if none. Returns 0 or a td_err from the simulator. */
int pl_search(const pl_model *m, const pl_hw *hw, const pl_request *reqs, int n,
              const pl_search_params *p, pl_candidate **out, int *n_out, int *best);

typedef struct {
    const char *what; /* the figure */
    const char *unit; /* "x", "%", "s" */
    double published; /* SGLang's figure */
    double simulated; /* ours */
} pl_repro_row;

#define PL_REPRO_ROWS 8

/* SGLang's chunked PP on H20 with DeepSeek-V3.1 and 128K-token prompts: TP8, PP4 x TP8
 * (dynamic chunks, initial 12K, s 0.65; and the best fixed 4K), TP32; throughput over
 * n_batch prompts arriving together, TTFT of one prompt alone. rows (PL_REPRO_ROWS).
 * Returns 0 or a td_err. */
int pl_reproduce(const pl_hw *h20, int n_batch, pl_repro_row *rows);

#endif
