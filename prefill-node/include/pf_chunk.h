/* pf_chunk.h: the prefill node's pure planning functions: the layer partition of the
 * pipeline stages, the quadratic cost model of one stage, and the dynamic chunk planner
 * (BACKGROUND.md section 5).
 *
 * Purpose: stage 0 decides how a prompt is cut into chunks so that every chunk costs
 * about the same stage time as the first one, even though attention over a longer
 * prefix costs more. The cost model is the cumulative run time of one stage as a
 * function of sequence length,
 *     f(l) = a l^2 + b l + c   (l tokens, f in the unit of the samples, ms in Tandem),
 * fitted by least squares over single-request prefills of many lengths (pf_profile.h).
 * A chunk of x tokens after a prefix of L tokens is predicted to cost f(L + x) - f(L);
 * the next chunk solves f(L + x) - f(L) = T with T = f(C) - f(0), C the initial size,
 * then is smoothed toward C, floored, aligned and capped (pf_next_chunk).
 * Invariants: a model with dynamic = true has a > 0 and b >= 0 (b clamped), so every
 * predicted chunk time is positive and the next-chunk equation has one positive root;
 * a plan's chunks are all > 0 and sum to the prompt length exactly.
 * Threading: every function is pure (no state, no allocation; errors are logged) and
 * may run on any thread.
 * Ownership: callers own every buffer; nothing is kept.
 */
#ifndef PF_CHUNK_H
#define PF_CHUNK_H

#include <stdbool.h>
#include <stdint.h>

/* ---- layer partition ---- */

#define PF_MAX_STAGES 64 /* as TD_CFG_MAX_PARALLEL */

/* Layers per stage into counts (pp). parts (n_parts) is an explicit partition (the
 * YAML's layer_partition) or NULL for the default: equal shares with the extra layers on
 * the LATER stages (61 layers, pp 4 -> 15, 15, 15, 16). An explicit partition must have
 * pp entries, each > 0, summing to n_layer. Returns 0, or TD_EINVAL (logged) for
 * n_layer < 1, pp < 1, pp > n_layer, or a bad explicit partition. */
int pf_layer_partition(int n_layer, int pp, const int *parts, int n_parts, int *counts);

/* The layer range [*l0, *l1) of stage `stage` under counts (pp). TD_EINVAL if stage is
 * out of range. */
int pf_stage_range(const int *counts, int pp, int stage, int *l0, int *l1);

/* ---- cost model ---- */

typedef struct {
    double a, b, c; /* f(l) = a l^2 + b l + c; b already clamped at 0 */
    double b_fit;   /* b as fitted, before the clamp */
    double r2;      /* coefficient of determination of the unclamped fit, <= 1 */
    int n_samples;  /* samples the fit used */
    bool valid;     /* the least-squares problem had a unique finite solution */
    bool dynamic;   /* valid and a > 0 (its effect over the sampled range, a (range/2)^2,
                     * above 1e-9 of the largest time, i.e. not round-off); else fixed */
} pf_cost_model;

/* Fit f over samples (len[i], t[i]), i < n, in double precision (lengths are centred
 * and scaled before the normal equations are solved, so lengths of 10^6 tokens are as
 * well conditioned as lengths of 10). Always fills *m: on failure m->valid and
 * m->dynamic are false and a = b = c = 0. Returns 0, or TD_EINVAL when n < 3, fewer than
 * 3 distinct lengths, a value is not finite, or the system is singular; the caller then
 * falls back to fixed chunks (not logged here: the caller knows the context). */
int pf_fit_quadratic(const double *len, const double *t, int n, pf_cost_model *m);

/* f(l) and the predicted time of a chunk of x tokens after a prefix of L tokens,
 * f(L + x) - f(L) = a x (2L + x) + b x. */
double pf_cost_eval(const pf_cost_model *m, double l);
double pf_cost_chunk(const pf_cost_model *m, int64_t L, int64_t x);

/* ---- chunk planner ---- */

typedef struct {
    int chunk_size;       /* C: the initial (and fixed) chunk size, tokens, > 0 */
    double smooth;        /* s in [0, 1]: 0 fixed chunks, 1 follow the model exactly */
    int page_size;        /* KV block size, tokens; alignment = max(page_size, 64) */
    int max_batch_tokens; /* per-batch token limit; 0: none */
    bool dynamic;         /* false: fixed chunks of C whatever the model says */
} pf_chunk_params;

/* Alignment of dynamic chunk sizes: max(page_size, 64) tokens. */
int pf_chunk_align(const pf_chunk_params *p);

/* Size of the next chunk of a request whose first `done` tokens are computed and whose
 * `remaining` tokens (> 0) are not. The first chunk (done == 0), fixed chunking
 * (p->dynamic false, s == 0, or m NULL / not m->dynamic) give C. Otherwise, with
 * T = a C^2 + b C and B = 2 a done + b, x solves a x^2 + B x - T = 0 (the positive root,
 * computed as 2T / (B + sqrt(B^2 + 4aT)) to avoid cancellation);
 * next = C + s (x - C), floored at C / 4, rounded down to a multiple of the alignment
 * (never below it). Every case is then capped at `remaining` and at max_batch_tokens.
 * Returns the size (> 0), or TD_EINVAL for bad parameters (C < 1, s outside [0, 1],
 * done < 0, remaining < 1, page_size < 0, max_batch_tokens < 0). */
int64_t pf_next_chunk(const pf_cost_model *m, const pf_chunk_params *p, int64_t done,
                      int64_t remaining);

/* An upper bound on the number of chunks of a prompt of n_tokens (for sizing the
 * planner's output). 0 for bad parameters. */
int64_t pf_plan_max_chunks(const pf_chunk_params *p, int64_t n_tokens);

/* The chunk sizes of a prompt of n_tokens (> 0) into chunks (cap), *n_chunks of them,
 * by repeated pf_next_chunk. They sum to n_tokens. Returns 0, TD_EINVAL for bad
 * parameters, or TD_ERANGE if cap is too small (cap >= pf_plan_max_chunks always fits). */
int pf_plan_chunks(const pf_cost_model *m, const pf_chunk_params *p, int64_t n_tokens,
                   int32_t *chunks, int64_t cap, int64_t *n_chunks);

#endif
