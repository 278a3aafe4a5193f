/* pf_profile.h: measuring one pipeline stage on the real engine: the start-up profile
 * that the dynamic chunk planner's cost model is fitted to, and timed runs of a chunk
 * plan.
 *
 * Purpose: stage 0 of a prefill instance profiles its own stage (its layer range of the
 * model, on its backend and thread count) at start-up and fits pf_cost_model to it.
 * What f(l) means here: the run time (ms) of ONE forward of the stage over a
 * single-request prefill of l tokens at positions [0, l) from an empty context, i.e. the
 * cumulative stage time of a sequence of length l. f(L + x) - f(L) then predicts a chunk
 * of x tokens after a prefix of L (attention over the prefix included); the per-forward
 * constant c cancels in that difference. Lengths are spread over [min(64, hi/4), hi],
 * hi = 1.25 C by default; each length is run `reps` times (passes over all lengths, so
 * drift hits every length alike) and the median is fitted. The stage's real inputs are
 * used: token ids on the first stage, hidden states (deterministic pseudo-random, unit
 * scale) elsewhere; the last stage computes no logits (a non-final chunk's work).
 * Time bound: the profile stops starting new forwards once budget_ms has elapsed (one
 * warm-up forward at the longest length and the first three timed lengths always run,
 * so the bound is budget_ms + 4 forwards of at most max_len tokens); lengths are visited
 * spread out (longest, shortest, middle, ...) so a cut-short first pass spans the range.
 * Stop: *stop (a signal handler's flag) is read before every forward, the warm-up
 * included, so a SIGTERM ends the profile within one forward.
 * Caching: the result depends only on what pf_pcache.h puts in its key; stage 0 keeps
 * it on disk there and re-uses it across restarts.
 * Threading: drives the engine from the calling thread; the engine and pool must not be
 * used by anyone else meanwhile.
 * Ownership: the caller opens the stage's shard (pf_shard.h) and keeps it; profile
 * results are filled into caller structs (fixed-size arrays, no allocation).
 */
#ifndef PF_PROFILE_H
#define PF_PROFILE_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "pf_chunk.h"
#include "pf_shard.h"

#define PF_PROFILE_MAX_LENGTHS 64

typedef struct {
    int chunk_size;              /* C, tokens (> 0) */
    int max_len;                 /* longest profiled length; 0: 1.25 C */
    int n_lengths;               /* 0: 16; at most PF_PROFILE_MAX_LENGTHS */
    int reps;                    /* passes over the lengths, median per length; 0: 3 */
    int budget_ms;               /* wall-time bound of the profile; 0: 20000 */
    uint64_t seed;               /* input ids / hidden states; 0 is fine */
    volatile sig_atomic_t *stop; /* non-zero: stop before the next forward; NULL: never */
} pf_profile_params;

/* p with every 0 replaced by the value pf_profile_stage uses (max_len, n_lengths, reps,
 * budget_ms); stop and seed are copied. The cache key is built from the result. */
pf_profile_params pf_profile_resolve(const pf_profile_params *p);

typedef struct {
    int n_lengths;                       /* lengths with at least one timing */
    int32_t len[PF_PROFILE_MAX_LENGTHS]; /* (n_lengths) tokens, ascending */
    double ms[PF_PROFILE_MAX_LENGTHS];   /* (n_lengths) median forward time, ms */
    int n_runs[PF_PROFILE_MAX_LENGTHS];  /* (n_lengths) timings behind each median */
    double elapsed_ms;                   /* the whole profile incl. warm-up */
    bool budget_hit;                     /* stopped early on budget_ms */
    bool stopped;                        /* *stop was seen: partial, not fitted */
    pf_cost_model fit;                   /* fitted over (len, ms); see fit.dynamic */
} pf_profile_result;

/* Profile the shard's stage and fit the cost model. Returns 0 when the forwards ran (the
 * fit may still have failed: out->fit.valid / .dynamic say, and the caller falls back to
 * fixed chunks), TD_ESTATE with out->stopped set when *p->stop ended it early (nothing
 * usable in out), or a negative td_err from the engine / bad parameters (TD_EINVAL,
 * TD_ERANGE if max_len exceeds the shard's ctx). */
int pf_profile_stage(pf_shard *s, const pf_profile_params *p, pf_profile_result *out);

/* Run one request of sum(chunks) tokens through the shard's stage in the given chunks (a
 * fresh sequence from position 0) and write each chunk's forward time into ms (n).
 * Returns 0 or a negative td_err (TD_ERANGE if the prompt exceeds the shard's ctx). */
int pf_profile_run_plan(pf_shard *s, const int32_t *chunks, int64_t n, uint64_t seed, double *ms);

#endif
