/* pf_tune.h: the self-tuning cost model of dynamic chunking: a robust fit of the start-up
 * profile, an online refit from the stage times the chunks actually took, and the initial
 * chunk size chosen by the model.
 *
 * Purpose: the start-up profile (pf_profile.h) measures f(l), one forward over l tokens from
 * an empty context, up to 1.25 C, once, under whatever load the machine had then. Stage 0
 * then feeds pf_tune every chunk it computes (its segments' prefixes L_i and sizes x_i and
 * the measured ms) and refits, so the model follows the machine's present load and covers
 * every prefix length actually seen. One linear least-squares problem holds both kinds of
 * data, with parameters (a, b, c_p, c_o):
 *     profile point (l, t):      t = a l^2 + b l + c_p
 *     chunk (L_i, x_i) -> t:     t = a sum x_i (2 L_i + x_i) + b sum x_i + c_o
 * (f(L + x) - f(L) = a x (2L + x) + b x; each kind keeps its own per-forward constant, a
 * served chunk also pays staging and the KV hand-off). Profile points have a fixed total
 * weight of PF_TUNE_PRIOR_WEIGHT chunk-equivalents, small on purpose: they only keep b and
 * c_o apart while the chunks' sizes do not vary (a profile taken on a busier machine, with
 * the weight of 8 chunks, kept a 23 % error in b; test_pf_tune); chunk i of age k (0: newest) has
 * weight decay^k; chunks are kept in a ring of PF_TUNE_CAP (bounded memory). Both fits reject
 * outliers: residuals beyond 3.5 robust sigmas (1.4826 x median |r|) are dropped and the fit
 * redone, at most three rounds, at most a quarter of the points in all.
 * The bound on the refit: pf_tune_model returns the start-up fit unless the online fit
 *   - has at least PF_TUNE_MIN_CHUNKS chunks spanning two distinct prefix costs,
 *   - is well conditioned (every pivot of the column-scaled normal equations > 1e-9 of the
 *     largest),
 *   - is convex (a > 0) with a within a factor PF_TUNE_MAX_RATIO of the start-up a;
 * so a refit only ever moves the chunk sizes inside the planner's [C/4, C] band, and never
 * from a fit the data cannot support (fixed chunk sizes alone cannot tell b from c_o: the
 * profile points pin b).
 * Threading: none; one owner (stage 0's loop). Ownership: plain value, no allocation.
 */
#ifndef PF_TUNE_H
#define PF_TUNE_H

#include <stdbool.h>
#include <stdint.h>

#include "pf_chunk.h"

#define PF_TUNE_CAP          256  /* chunks kept for the online fit */
#define PF_TUNE_MAX_PROFILE  64   /* profile points kept (as PF_PROFILE_MAX_LENGTHS) */
#define PF_TUNE_PRIOR_WEIGHT 0.5  /* total weight of the profile points, in chunks */
#define PF_TUNE_MIN_CHUNKS   8    /* chunks before the online fit may be used */
#define PF_TUNE_MAX_RATIO    8.0  /* the online a stays within [a0 / 8, 8 a0] */
#define PF_TUNE_AUTO_CAP     2048 /* chunk_size left out: chunk buffers, profile up to 1.25 x */
#define PF_TUNE_AUTO_FIXED   512  /* chunk_size left out, no usable model: fixed chunks */
#define PF_TUNE_C_FLOOR      1.0  /* c is at least this x the marginal cost of `align` tokens */

/* Robust quadratic fit of a profile: pf_fit_quadratic with outlier rejection (above).
 * *n_rejected (may be NULL) receives the number of points dropped. Returns as
 * pf_fit_quadratic over the kept points. */
int pf_fit_robust(const double *len, const double *t, int n, pf_cost_model *m, int *n_rejected);

typedef struct {
    double q, x, t; /* sum x_i (2 L_i + x_i) tokens^2, sum x_i tokens, measured ms */
} pf_tune_obs;

typedef struct {
    pf_cost_model prior;              /* the start-up fit (robust) */
    pf_cost_model cur;                /* what pf_tune_model returns */
    double plen[PF_TUNE_MAX_PROFILE]; /* (n_prof) profile lengths, tokens */
    double pms[PF_TUNE_MAX_PROFILE];  /* (n_prof) profile times, ms */
    int n_prof;
    pf_tune_obs ring[PF_TUNE_CAP]; /* chunks, newest at head - 1 */
    int head, n_obs;
    double decay;                            /* weight factor per chunk of age; (0, 1] */
    double c_online;                         /* fitted per-forward constant of a chunk, ms */
    uint64_t n_seen, n_refits, n_kept_prior; /* chunks observed; refits used; refits refused */
    bool online;                             /* cur is the online fit */
    bool frozen; /* TANDEM_PF_ONLINE_REFIT=0: stage 0 feeds no chunks (start-up fit only) */
} pf_tune;

/* Start from the start-up fit `prior` and its profile points (len, ms; n <= 64 kept).
 * decay 0 means 0.97 (about 33 chunks of memory). */
void pf_tune_init(pf_tune *tu, const pf_cost_model *prior, const double *len, const double *ms,
                  int n, double decay);

/* One computed chunk: n_segs segments with prefixes L[i] and sizes x[i] (> 0) took ms.
 * Refits. Returns 0, or TD_EINVAL for a bad observation (ignored). */
int pf_tune_observe(pf_tune *tu, const int64_t *L, const int64_t *x, int n_segs, double ms);

/* The model to plan with: the online fit if it passes the bound above, else the prior. */
const pf_cost_model *pf_tune_model(const pf_tune *tu);

/* Initial chunk size for a prompt of n tokens on a pipeline of pp stages, when the YAML
 * gives none. With chunks of equal cost (the planner's goal), n_k chunks cost
 * F + n_k c in all (F = f(n) - f(0), c the per-forward constant), and the pipeline takes
 * about (n_k + pp - 1) chunk times, so the makespan (F + n_k c)(1 + (pp - 1) / n_k) is least
 * at n_k = sqrt(F (pp - 1) / c). The first chunk then costs (F + n_k c) / n_k - c:
 * C solves a C^2 + b C = F / n_k. Rounded down to the alignment, within [align, cap].
 * c is the online constant when the online fit is in use, else the profile's, floored at
 * PF_TUNE_C_FLOOR x (a align^2 + b align), the model's cost of the smallest chunk: the
 * intercept is extrapolated to l = 0 from long lengths, where a forward's cost per token is
 * lowest, and misses what a small served chunk costs besides (weights streamed per forward,
 * staging, the hand-off); it came out -16 ms where the online refit then found 220 ms
 * (docs/prefill.md). The makespan is flat near its optimum (c off by 3x moves n_k by 1.7x
 * and the makespan ~1 %).
 * pp 1, n < 1 or a model without a valid fit gives cap. */
int pf_tune_initial_chunk(const pf_tune *tu, int64_t n, int pp, int align, int cap);

#endif
