/* moe_route.h: a mixture-of-experts layer's routing, on the host: which experts each token
 * takes and with what weights (llama.cpp's build_moe_ffn), and the tokens grouped by expert
 * for the experts' GEMMs.
 *
 * Per token: probabilities from the router's logits (softmax, or sigmoid); the choice reads
 * them plus the layer's bias when it has one (DeepSeek V3's correction), limited to the best
 * n_group_used groups when the model has groups (a group scores the sum of its two best);
 * the k best are taken (ties to the lower expert id), their unbiased probabilities are the
 * weights, renormalised to sum 1 (the sum clamped at 2^-14 as llama.cpp does) when the model
 * says so, then scaled.
 * Invariants: a token's choice and weights depend on its own logits only, and its slots list
 * its choices in the order taken, so the engine's combine adds a token's k outputs in that
 * order whatever else is in the batch. Within an expert's group the tokens ascend, so the
 * batch's leading solo rows come first in every group. */
#ifndef KN_MOE_ROUTE_H
#define KN_MOE_ROUTE_H

#include <stdint.h>

#include "model.h"

typedef struct {
    int64_t n_tokens;
    int k, n_expert;
    int32_t *expert; /* (n_tokens * k) token i's j-th choice at i * k + j */
    float *weight;   /* (n_tokens * k) its weight */
    int32_t *offset; /* (n_expert + 1) expert x's group is [offset[x], offset[x + 1]) */
    int32_t *token;  /* (n_tokens * k) the tokens of each group, ascending within it */
    int32_t *slot;   /* (n_tokens * k) choice i * k + j's row in the grouped order */
    /* scratch and capacities (grown on demand; kn_moe_plan_free releases) */
    int64_t cap;
    float *prob, *sel; /* (n_expert) one token's probabilities and choice scores */
} kn_moe_plan;

/* Route n tokens: logits (n, n_expert) row-major, bias (n_expert) or NULL. hp gives k,
 * gating, groups, renormalisation and scale; bias finite (the loader checks). 0, or
 * TD_ENOMEM / TD_EINVAL (a logit that is not finite: no choice can be made from it). */
int kn_moe_route(const kn_hparams *hp, const float *bias, const float *logits, int64_t n,
                 kn_moe_plan *p);
void kn_moe_plan_free(kn_moe_plan *p);
/* kn_moe_route's first half: the n tokens' choices and weights (expert, weight) only, no
 * grouping (data-parallel attention gathers them and groups every member's together). */
int kn_moe_choose(const kn_hparams *hp, const float *bias, const float *logits, int64_t n,
                  kn_moe_plan *p);

/* The plan's parts for a caller that makes the choices itself (data-parallel attention: the
 * choices every member made for its own rows, gathered): room for n tokens' k choices among
 * n_expert (contents lost when it grows; sets k and n_expert), then, once expert and weight
 * hold the n tokens' choices, the grouping (offset, token, slot) as kn_moe_route makes it. */
int kn_moe_plan_reserve(kn_moe_plan *p, int64_t n, int k, int n_expert);
void kn_moe_group(kn_moe_plan *p, int64_t n);

#endif
