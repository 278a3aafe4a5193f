/* pl_calib.h: `tandem calibrate`: measure this machine's costs for a model through the
 * engine's own code paths and express them as a hardware profile (pl_hw.h), so that the
 * simulator's predictions for this machine rest on measured figures.
 *
 * What is measured (CPU backend; one "device" = the given number of threads):
 *   - the sgemm rate and the memory read bandwidth: the kernels' ceiling probes
 *     (kn_cpu_sgemm_gflops, kn_cpu_mem_read_gbps, as `tandem bench-engine` uses them);
 *   - the model's prefill cost by length: the prefill node's stage profile over the whole
 *     model (pf_profile_stage: single-request forwards of many lengths, fitted as
 *     f(l) = a l^2 + b l + c); b gives the matrix-product rate on the model's own shapes and
 *     types, a the attention rate, c the per-forward overhead;
 *   - batch-1 decode steps (one-token forwards with their logits, as the decode node steps):
 *     the weights' read rate, the LM head included;
 *   - the decode node's shared-memory all-reduce (dc_shm) of one token's hidden state at tp 2,
 *     3 and 4: that many forked rank processes of one thread (pl_calib_allreduce), so a tp
 *     larger than the cores pays the time-sharing it meets in a decode instance.
 * What is not measured, and where its figure comes from (stated in the written file):
 *   - kvxfer loopback needs a UCX receiver process: BENCHMARKS.md's kvxfer figures (shared
 *     memory 8.33 GB/s, 40 us for one block; TCP 0.9 GB/s, 635 us).
 * Threading: runs on the caller's thread plus the backend's pool. Ownership: none kept.
 */
#ifndef PL_CALIB_H
#define PL_CALIB_H

#include "kv_mem.h"
#include "model.h"
#include "pf_chunk.h"
#include "pf_shard.h"
#include "pl_hw.h"
#include "pl_model.h"

/* The default context of the long decode steps (their time over the short ones' gives the
 * attention's cost per token of context, pl_hw.decode_attn) and of the longest prefix of the
 * measured prefill chunks */
#define PL_CALIB_LONG_CTX 4096

typedef struct {
    const char *model_path; /* GGUF */
    int threads;            /* per device; 0: 1 */
    int chunk;              /* profile lengths up to 1.25 x this; 0: 1024 */
    int budget_ms;          /* the profile's time bound; 0: 20000 */
    int decode_steps;       /* batch-1 decode steps timed; 0: 32 */
    int long_ctx;           /* 0: PL_CALIB_LONG_CTX (the prompts the profile is for: shorter
                               is faster to calibrate, longer extrapolates less) */
} pl_calib_params;

typedef struct {
    pl_hw hw;       /* the profile */
    pl_model model; /* the model's shape */
    double sgemm_gflops, mem_gbps;
    double fit_a, fit_b, fit_c, fit_r2; /* the prefill profile's fit, ms */
    double decode_ms;                   /* median batch-1 decode step */
    int long_ctx;                       /* the long context of the measurements below */
    int chunk_x;                        /* tokens of the chunks below: min(512, chunk) */
    double chunk_ms[4];                 /* chunks after 0, 1/4, 2/4, 3/4 long_ctx of prefix */
    int joint;             /* 1: fit_* are the joint fit of the profile and those chunks */
    double decode_long_ms; /* the same long_ctx tokens later */
    double matmul_gflops;  /* the model's matrix products, from b */
    double attn_gflops;    /* attention, from a */
    double decode_gbps;    /* weights read per second by decode */
    double allreduce_us[PL_HW_MAX_AR_TP + 1];   /* [tp]: one all-reduce of n_embd floats */
    double decode_tp_ms[PL_HW_MAX_AR_TP + 1];   /* [tp]: the batch-1 decode step; 0: not measured */
    double decode_speedup[PL_HW_MAX_AR_TP + 1]; /* [tp]: decode_ms / decode_tp_ms[tp] */
    /* the same with the experts whole on the ranks (decode[].ep; a mixture-of-experts model
     * whose experts the tp ranks divide): 0 when not measured */
    double decode_tp_ep_ms[PL_HW_MAX_AR_TP + 1], decode_speedup_ep[PL_HW_MAX_AR_TP + 1];
    /* a prefill chunk of chunk_x tokens from an empty context at tp (forked ranks, as the
     * decode steps above; chunk_ms[0] is its tp 1 time), the experts split and whole: 0 when
     * not measured */
    double chunk_tp_ms[PL_HW_MAX_AR_TP + 1], prefill_speedup[PL_HW_MAX_AR_TP + 1];
    double chunk_tp_ep_ms[PL_HW_MAX_AR_TP + 1], prefill_speedup_ep[PL_HW_MAX_AR_TP + 1];
    /* a data-parallel attention group of dp members (a mixture-of-experts model with at least
     * dp experts): the batch-1 step of each member at once and member 0's prefill chunk, and
     * their speed-ups over tp 1 (below 1: what the group costs a member); 0 when not measured */
    double decode_dp_ms[PL_HW_MAX_AR_TP + 1], decode_speedup_dp[PL_HW_MAX_AR_TP + 1];
    double chunk_dp_ms[PL_HW_MAX_AR_TP + 1], prefill_speedup_dp[PL_HW_MAX_AR_TP + 1];
    /* KV transfer, [0] shared memory, [1] TCP: kvx-bench's medians in the model's KV shape
     * (GB/s of a 4096-token chunk, us of a one-block chunk), or BENCHMARKS.md's figures */
    double kvx_gbps[2], kvx_lat_us[2];
    int kvx_measured; /* 1: measured here */
} pl_calib_result;

/* Mean time of one dc_shm all-reduce of n_floats over tp forked rank processes (one thread
 * each), iters timed after a warm-up, into *us. Returns 0, TD_EINVAL or TD_EIO (logged). */
int pl_calib_allreduce(int tp, int n_floats, int iters, double *us);

/* Batch-1 decode steps as the decode node runs them: one token a forward, a solo row, with
 * its logits (the LM head is part of every step; the prefill profile's forwards skip it),
 * after a context of ctx0 tokens (reserved, not computed: attention's time does not depend
 * on the values it reads). steps warm-up steps, then steps timed; *ms their median. hook
 * (may be NULL) runs before each step, inside its time. */
typedef struct {
    int (*fn)(void *ctx); /* before every step (the tp ranks' plan hand-off); nonzero stops */
    void *ctx;
} pl_calib_step_hook;
int pl_calib_decode_steps(kn_engine *eng, kn_kv_mem *mem, int n_vocab, int ctx0, int steps,
                          const pl_calib_step_hook *hook, double *ms);

/* The same at tp ranks: tp forked processes, each the model's rank shard (threads threads;
 * ep: the experts whole, kn_shard.ep) with the decode node's dc_shm collective; *ms rank 0's
 * median step. Returns 0 or a td_err (logged). */
int pl_calib_decode_tp(const char *model_path, int tp, bool ep, int threads, int steps, double *ms);

/* A prefill chunk of x tokens from an empty context, no logits, at tp ranks as above: one
 * warm-up, reps (1..16) timed, *ms rank 0's median. Returns 0 or a td_err (logged). */
int pl_calib_chunk_tp(const char *model_path, int tp, bool ep, int threads, int x, int reps,
                      double *ms);

/* A data-parallel attention group of dp forked members (kn_shard.dp_size; the dc_shm dp
 * collectives): chunk 0: steps batch-1 decode steps of every member at once (one row each),
 * *ms member 0's median; chunk > 0: member 0's prefill chunk of that many tokens from an
 * empty context while the others take their idle part (median of 2 after a warm-up).
 * Returns 0 or a td_err (logged). */
int pl_calib_dp(const char *model_path, int dp, int threads, int steps, int chunk, double *ms);

/* Prefill chunks of x tokens after prefixes of k long_ctx / n tokens, k = 0..n-1 (the prefix
 * reserved and filled, not computed), each the median of reps forwards. */
#define PL_CALIB_MAX_CHUNKS 16
typedef struct {
    double L, x, ms;
} pl_calib_chunk;
int pl_calib_chunks(pf_shard *sh, int long_ctx, int x, int n, int reps, pl_calib_chunk *out);

/* Least squares of the chunk cost model t = a q + b l + c over profile forwards (q = l^2,
 * l tokens from an empty context) and chunks (q = x (2L + x), l = x), equal weights.
 * Sets fit's a, b, b_fit, c; TD_ERANGE (fit untouched) when singular or not convex. */
int pl_calib_fit_joint(const double *len, const double *t, int n_prof, const pl_calib_chunk *ch,
                       int n_ch, pf_cost_model *fit);

/* kvx-bench (built beside the running binary) over shared memory and TCP in the model's KV
 * shape, one decode rank: fills r's kvx_* and sets kvx_measured. TD_ENOENT (no kvx-bench) or
 * TD_EIO (it failed): r is left alone; a warning is logged. */
int pl_calib_kvx(const kn_hparams *hp, pl_calib_result *r);

/* Measure; returns 0 or a td_err (logged). */
int pl_calibrate(const pl_calib_params *p, pl_calib_result *out);

/* The '#' comment block that pl_hw_write puts on top of a calibrated profile: the
 * measurements and the sources of what was not measured. Into buf (cap). */
void pl_calib_comment(const pl_calib_result *r, char *buf, size_t cap);

#endif
