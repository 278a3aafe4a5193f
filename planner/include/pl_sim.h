/* pl_sim.h: a discrete-event simulator of a Tandem cluster: prefill instances running chunked
 * pipeline parallelism with the prefill node's own dynamic chunk planner, decode instances
 * running continuous batching with tensor parallelism, KV transfer between them.
 *
 * Purpose: predict TTFT, TPOT and throughput of a configuration from a model shape
 * (pl_model.h) and a hardware profile (pl_hw.h), before the cluster exists.
 * The cost model (all times in ms, per device; docs/planner.md derives it):
 *   prefill stage of n_l layers on tp devices, chunk of x tokens after a prefix of L:
 *     t = max(compute, weights) + tp all-reduce + per-chunk overhead, with
 *     compute = 2 n_l P_layer x / (tp F_mm e_mm) + n_l A x (L + x/2) / (tp F_att e_att)
 *     weights = bytes of the stage's weights read / tp / (B_hbm e_mem)
 *     all-reduce = 2 n_l ring all-reduces of x n_embd act_bytes (NVLink within a node, the
 *                  network when tp spans nodes)
 *     (a profile's measured prefill_speedup for tp: the tp 1 compute, weights and overhead
 *     divided by it, no all-reduce term: the measurement holds them)
 *   so without the weights floor a chunk costs a x (2L + x) + b x + c: the quadratic the
 *   prefill node fits (pf_chunk.h), which the simulator hands to pf_plan_chunks and
 *   pf_tune_initial_chunk exactly as stage 0 does with its profile.
 *   Pipeline: chunk k leaves stage s at max(stage s free, chunk k left stage s - 1 plus the
 *   activation send) + its stage time; stage 0 starts chunk k only after chunk k - pp left
 *   the last stage (pp chunks in flight); requests follow each other FCFS on an instance,
 *   each new one on the instance whose stage 0 frees first.
 *   KV transfer: each stage sends its layers' KV of a chunk once computed, on its own link,
 *   overlapped with later chunks; a request's TTFT ends when its last chunk's KV has landed.
 *   Decode step of B requests with a summed context S on tp devices, a roofline per phase:
 *     max(weights read for B tokens / tp / (B_hbm e_mem), 2 P_active B / (tp F_mm e_mm))
 *     + max(S kv_bytes / tp / (B_hbm e_mem), n_layer A S / (tp F_att e_att))
 *     + 2 n_layer all-reduces of B n_embd act_bytes + step overhead;
 *   with expert parallelism (whole experts on each of the tp ranks, decode[].ep) the routed
 *   experts' share of both weight terms is scaled by the expected imbalance: the rank with
 *   the most experts touched (bytes) or choices (products) sets the step
 *   (pl_model_ep_imbalance). Tandem's ep moves no token (attention stays tensor-parallel and
 *   the all-reduces the tp step has anyway combine the experts' shares): no dispatch term;
 *   requests join a running batch at step boundaries (continuous batching) on the decode
 *   instance with the fewest requests, if its KV memory holds prompt + output.
 * Invariants: results are deterministic for a given input (no clock, no randomness beyond
 * the workload's seed).
 * Threading: pure functions on caller-owned memory. Ownership: callers own every buffer.
 */
#ifndef PL_SIM_H
#define PL_SIM_H

#include <stdbool.h>
#include <stdint.h>

#include "pf_chunk.h"
#include "pl_hw.h"
#include "pl_model.h"

/* One pipeline stage's cost, ms. */
typedef struct {
    int n_layers, tp;
    double a, b_comp, b_comm, c;   /* compute a, b; all-reduce per token; per-chunk constant */
    double weight_ms_full;         /* reading all the stage's weights once (dense share) */
    double weight_frac;            /* the stage's share of the model's layers */
    double send_ms_token, send_ms; /* activation send to the next stage: per token, per send */
    double kv_ms_token, kv_ms;     /* KV transfer of the stage's layers: per token, per chunk */
    pf_cost_model fit;             /* a, b = b_comp + b_comm, c: what a profile would fit */
} pl_stage;

typedef struct {
    int pp, tp;    /* per prefill instance */
    int chunk;     /* initial chunk C; 0: pf_tune_initial_chunk per request (cap below) */
    int chunk_max; /* cap on C and on every chunk; 0: PF_TUNE_AUTO_CAP */
    double smooth; /* dynamic chunking's s; 0: fixed chunks of C */
    int page;      /* KV page size, tokens; 0: 16 */
} pl_prefill_cfg;

typedef struct {
    int tp;          /* per decode instance */
    bool ep;         /* expert parallelism (decode[].ep = tp): each rank holds its share of a
                        mixture-of-experts model's experts whole instead of a slice of each; no
                        effect on a dense model or at tp 1 */
    int max_batch;   /* requests in a step; 0: 256 */
    int step_tokens; /* colocated: prompt tokens a step at most (decode[].step_tokens); 0: 512 */
    int dp;          /* 0 or 1; > 1 (tp 1, ep off, a mixture-of-experts model): each instance is a
                        data-parallel attention group of dp member instances (decode[].dp), each
                        its own requests and KV at the pl_decode_step_ms_dp cost */
    int tbo_min;     /* > 0 (tp >= 2, no dp): decode steps of at least this many requests at the
                        pl_decode_step_ms_tbo cost (decode[].tbo_min_tokens; a colocated step's
                        prompt chunk keeps its whole cost) */
} pl_decode_cfg;

typedef struct {
    int n_prefill; /* 0: colocated, the decode instances prefill their own prompts */
    int n_decode;
    pl_prefill_cfg pf;
    pl_decode_cfg dc;
} pl_cluster;

typedef struct {
    double arrival_ms;
    int prompt, output; /* tokens; output >= 1 (the first comes from prefill) */
} pl_request;

typedef struct {
    double ttft_p50, ttft_p90, ttft_mean; /* ms */
    double tpot_p50, tpot_p90, tpot_mean; /* ms, over requests with output > 1 */
    double makespan_ms;                   /* first arrival to last token */
    double prefill_end_ms;                /* first arrival to last KV landed */
    double prefill_tps, output_tps;       /* prompt tokens / prefill span, outputs / makespan */
    int64_t n_chunks;                     /* prefill chunks run */
    int devices;                          /* n_prefill pp tp + n_decode tp */
    bool fits;                            /* weights (and one request's KV) fit the memory */
    char why[128];                        /* when !fits: what does not fit */
} pl_result;

/* The cost of one stage of n_layers layers on tp devices; ep: a mixture-of-experts model's
 * experts whole on them; pp_cross: the stage's activation send crosses nodes. Where the
 * profile has a measured prefill_speedup(_ep) for tp, the tp 1 cost divided by it (all-reduces
 * and overhead in it) replaces the parallel rates and the all-reduce terms. Returns 0 or
 * TD_EINVAL. */
int pl_stage_make(const pl_model *m, const pl_hw *hw, int n_layers, int tp, bool ep, bool pp_cross,
                  pl_stage *st);
/* A member of a data-parallel attention group of dp (tp 1) prefilling a chunk while the
 * others take their idle part: the tp 1 stage over the profile's prefill_speedup_dp[dp] where
 * measured, else the tp 1 stage. Returns 0 or TD_EINVAL. */
int pl_stage_make_dp(const pl_model *m, const pl_hw *hw, int dp, pl_stage *st);

/* Time of a chunk of x tokens after a prefix of L on stage st, ms (the formula above). */
double pl_stage_ms(const pl_model *m, const pl_stage *st, int64_t L, int64_t x);

/* Ring all-reduce of `bytes` over tp devices, ms (0 for tp 1). */
double pl_allreduce_ms(const pl_hw *hw, int tp, double bytes);

/* Time of one decode step of B requests with summed context S on tp devices, ms; ep: the
 * experts whole on the ranks (pl_decode_cfg.ep), the experts' bytes and products scaled by the
 * expected imbalance (pl_model_ep_imbalance). */
double pl_decode_step_ms(const pl_model *m, const pl_hw *hw, int tp, bool ep, int B, double S);
/* The same step with two-batch overlap (decode[].tbo_min_tokens): two micro-batches of about
 * B / 2 requests, each priced as a step of its own (so each reads the weights), each one's
 * all-reduces hidden behind the other's compute but for what sticks out. Where the profile's
 * measured speed-up holds the all-reduces (a calibrated CPU profile) nothing is left to hide
 * and only the second weight read shows: the overlap is predicted to pay where the
 * collectives are priced apart (a device profile's NVLink or network all-reduces) and the
 * step is compute-bound. tp < 2 or B < 2: pl_decode_step_ms. */
double pl_decode_step_ms_tbo(const pl_model *m, const pl_hw *hw, int tp, bool ep, int B, double S);
/* The step of one member of a data-parallel attention group of dp with B requests and
 * context S of its own: the tp 1 step over the profile's decode_speedup_dp[dp] (a member's
 * batch-1 step with every member stepping, measured), else the tp 1 step plus the gather and
 * reduce of dp B rows in every MoE layer (taken as two all-reduces of their bytes; the
 * experts' share a member saves is not counted). */
double pl_decode_step_ms_dp(const pl_model *m, const pl_hw *hw, int dp, int B, double S);

/* Simulate the cluster over reqs (n, any arrival order; not modified). Fills *r; when the
 * configuration does not fit, r->fits is false and the times are 0. Returns 0, TD_EINVAL
 * for a bad configuration or request, TD_ENOMEM. */
int pl_simulate(const pl_model *m, const pl_hw *hw, const pl_cluster *cl, const pl_request *reqs,
                int n, pl_result *r);

/* The same for a closed loop of one client: request i + 1 arrives when request i's last token
 * is out (reqs' arrival times are ignored), so no two requests overlap; TTFT and TPOT
 * percentiles over the requests, throughput over the summed spans. */
int pl_simulate_sequential(const pl_model *m, const pl_hw *hw, const pl_cluster *cl,
                           const pl_request *reqs, int n, pl_result *r);

/* Times with their request index, sorted by time then index (deterministic ties). */
typedef struct {
    double t;
    int i;
} pl_key;
void pl_sort_keys(pl_key *k, int n);

/* Prefill alone: per-request TTFT (ttft[i], ms from arrival to KV landed) of reqs on
 * n_prefill instances; *n_chunks the chunks run. Used by pl_simulate. */
int pl_sim_prefill(const pl_model *m, const pl_hw *hw, const pl_prefill_cfg *pf, int n_prefill,
                   const pl_request *reqs, int n, double *ttft, int64_t *n_chunks);

#endif
