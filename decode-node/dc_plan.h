/* dc_plan.h: the per-step batch plan rank 0 broadcasts to the other TP ranks.
 *
 * Purpose: every rank must run exactly the batch the leader scheduled (same tokens,
 * positions and block ids), or the all-reduces would mix different computations. The
 * plan is a flat little-endian byte image of a kn_batch, logit rows included: every rank
 * computes its vocab slice of the LM head for them (only rank 0 samples).
 * Invariants: dc_plan_decode checks every count and block id against the buffer length
 * and the pool before it returns a batch; a bad plan is TD_EFORMAT, never a crash.
 * Ownership: the decoded batch points into the plan buffer and into dc_plan_view's
 * arrays; valid until the next decode into the same view or dc_plan_view_fini.
 *
 * The step cost model (dc_cost, below) sizes a plan's prefill share in colocated mode: the
 * wall time of a step predicted from its shape, fitted online from the times the node
 * measures. Not thread-safe; rank 0's engine loop owns it (inside the scheduler).
 */
#ifndef DC_PLAN_H
#define DC_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "kv_tier.h"
#include "model.h"

/* DC_PLAN_COPY: the prefix cache tier's copies only (kv_tier.h "tensor parallelism"):
 * the leader made copies in a planning that scheduled nothing to compute; the other ranks
 * make them at once, so no copy waits for a later step. */
enum { DC_PLAN_RUN = 1, DC_PLAN_SHUTDOWN = 2, DC_PLAN_COPY = 3 };

/* Bytes needed to encode b (NULL: no batch) and n_copies tier copies with the pool's block
 * size. */
size_t dc_plan_size(const kn_batch *b, int n_copies, int block_size);
/* Encode b with the leader's tier copies (kind DC_PLAN_RUN: every rank makes the copies, in
 * order, before it computes b), or the copies alone (b NULL, n_copies > 0: DC_PLAN_COPY), or
 * a shutdown (b NULL, no copies) into buf; *len = bytes used. threads: the compute threads
 * every rank runs the step with (dc_threads.h; 0: each its configured count). TD_ERANGE if
 * cap is too small. */
int dc_plan_encode(const kn_batch *b, const kn_kv_tier_op *copies, int n_copies, int block_size,
                   uint64_t step, int threads, void *buf, size_t cap, size_t *len);

typedef struct {
    uint32_t kind; /* DC_PLAN_RUN, DC_PLAN_COPY or DC_PLAN_SHUTDOWN */
    uint64_t step;
    int threads;                 /* compute threads for the step (0: as configured) */
    const kn_kv_tier_op *copies; /* (n_copies) the tier copies to make first (kinds and
                                    blocks checked; slots are the tier's to check) */
    int n_copies;
    kn_batch batch;     /* logit rows as the leader's (their range is the engine's to check) */
    kn_seq_view *views; /* (cap_views) */
    int cap_views;
    int32_t *scratch; /* (cap_scratch) aligned copies of the arrays */
    size_t cap_scratch;
} dc_plan_view;

void dc_plan_view_init(dc_plan_view *v);
void dc_plan_view_fini(dc_plan_view *v);
/* Decode a plan; block ids are checked against n_blocks and the tables' lengths against
 * block_size. */
int dc_plan_decode(const void *buf, size_t len, int block_size, int n_blocks, dc_plan_view *v);

/* A step's shape: what its wall time depends on. */
typedef struct {
    int n_decode;  /* one-token decode rows */
    int n_prefill; /* prefill tokens (rows of chunks) */
    double attn;   /* attention work: (query row, context position) pairs over all rows */
    int n_draft;   /* verification rows: proposed tokens after decode rows (dc_spec.h) */
    int n_pass;    /* a draft model's forward passes for the step's proposals (one per
                      proposal depth, the deepest request's take; 0: prompt lookup) */
} dc_step_shape;

enum { DC_COST_N = 5 }; /* the cost model's coefficients */

/* The step cost model: t = c0 + c1 * solo rows + c2 * prefill tokens + c3 * attention pairs
 * + c4 * draft passes (milliseconds). Decode rows and verification rows are one feature: both are
 * solo rows with a logit row each, and they cost the same (kept apart, the two were confounded: a
 * batch of decodes always carries its verifications). The coefficients are the non-negative least
 * squares fit of the observed steps, weighted by forgetting (recent steps weigh most; a step
 * far off the fit is clipped before it moves it), with a weak pull toward the start so a
 * coefficient the steps do not determine (the per-row cost while every step has one row)
 * stays near it. The start is a rough estimate from the model's size (a conservative CPU
 * rate); the first steps the node measures replace it. Non-negative in the fit itself, not
 * only where it is used: a fit that predicts a step well with a negative intercept and
 * another term too large would, clamped at use, predict it several times too long. */
typedef struct {
    double theta[DC_COST_N]; /* coefficients, in ms per scaled feature (dc_plan.c: FEAT_SCALE),
                                each >= 0 */
    double prior[DC_COST_N]; /* the start, the weak pull's target */
    double A[DC_COST_N][DC_COST_N]; /* sum of forgetting-weighted x x^T of the steps */
    double b[DC_COST_N];            /* sum of forgetting-weighted x t */
    double err_ms;                  /* running mean absolute residual (outlier clipping) */
    uint64_t n_obs;                 /* steps observed */
} dc_cost;

void dc_cost_init(dc_cost *c, const kn_hparams *hp);
/* Predicted wall time of a step of shape s, in ms (>= 0). */
double dc_cost_predict(const dc_cost *c, const dc_step_shape *s);
/* Fold a measured step (ms > 0) into the fit. */
void dc_cost_observe(dc_cost *c, const dc_step_shape *s, double ms);
/* The attention pairs of a prefill chunk of n tokens at positions [pos0, pos0 + n). */
double dc_cost_chunk_attn(int32_t pos0, int32_t n);
/* Predicted extra ms of adding a chunk of n prefill tokens at pos0 to a step. */
double dc_cost_chunk_ms(const dc_cost *c, int32_t pos0, int32_t n);
/* Predicted extra ms of verifying one proposed token at position pos (its row and its
 * attention). */
double dc_cost_draft_ms(const dc_cost *c, int32_t pos);
/* Predicted extra ms of one more draft model pass (a proposal deeper than any other). */
double dc_cost_pass_ms(const dc_cost *c);
/* The largest n <= max_n whose chunk at pos0 adds at most ms_left (0 if none). */
int32_t dc_cost_fit_chunk(const dc_cost *c, double ms_left, int32_t pos0, int32_t max_n);

#endif
