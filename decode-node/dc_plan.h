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
 */
#ifndef DC_PLAN_H
#define DC_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"

enum { DC_PLAN_RUN = 1, DC_PLAN_SHUTDOWN = 2 };

/* Bytes needed to encode b (NULL: a shutdown plan) with the pool's block size. */
size_t dc_plan_size(const kn_batch *b, int block_size);
/* Encode b (kind DC_PLAN_RUN) or a shutdown (b NULL) into buf; *len = bytes used.
 * TD_ERANGE if cap is too small. */
int dc_plan_encode(const kn_batch *b, int block_size, uint64_t step, void *buf, size_t cap,
                   size_t *len);

typedef struct {
    uint32_t kind; /* DC_PLAN_RUN or DC_PLAN_SHUTDOWN */
    uint64_t step;
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

#endif
