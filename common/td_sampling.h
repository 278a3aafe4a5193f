/* td_sampling.h: a request's sampling parameters, one type from the router to the sampler.
 *
 * Purpose: the router parses them from the OpenAI body into this struct; the control plane
 * carries them as proto Sampling (td_ctrl_sampling_to_pb / _from_pb in ctrl.h, the only
 * conversion); the prefill chain's wire format carries them to the last stage; the decode
 * scheduler and the last prefill stage hand them to kn_sampler_init unchanged.
 * Semantics (kernels/sampler.h applies them, in llama.cpp's order): repetition penalty ->
 * presence and frequency penalties -> top-k -> top-p -> min-p -> temperature -> draw.
 */
#ifndef TD_SAMPLING_H
#define TD_SAMPLING_H

#include <stdbool.h>
#include <stdint.h>

typedef struct {
    float temperature;     /* <= 0: greedy */
    int32_t top_k;         /* <= 0: off */
    float top_p;           /* >= 1 or <= 0: off */
    float min_p;           /* <= 0: off */
    float repeat_penalty;  /* 1 or 0: off; > 1 penalizes tokens in the recent history */
    int32_t repeat_last_n; /* history window for the penalty; 0: 64 */
    /* OpenAI's penalties, over the tokens generated for this request only (as vLLM):
     * logit[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0). 0: off */
    float presence_penalty;
    float frequency_penalty;
    uint64_t seed;
    /* Draws already made for this request elsewhere (a moved request, or the first token that
     * the last prefill stage sampled): kn_sampler_init advances the sampler past them, so a
     * seeded request gives the same tokens wherever it runs. */
    uint32_t skip_samples;
    /* OpenAI logprobs, log-softmax of the raw logits (kn_logprobs): 0 off; else each
     * generated token's logprob and its logprobs - 1 (0..20) most likely alternatives */
    uint32_t logprobs;
    bool prompt_logprobs; /* and every prompt token's from the second on (echo); logprobs > 0 */
} td_sampling;

#define TD_MAX_TOP_LOGPROBS 20 /* OpenAI's limit on top_logprobs */

typedef struct {
    int32_t id;
    float logprob;
} td_logprob;

/* One position's logprob (kernels/sampler.h kn_logprobs): the token's and its n_top most
 * likely alternatives, most likely first. */
typedef struct {
    float logprob;
    int32_t n_top;
    td_logprob top[TD_MAX_TOP_LOGPROBS];
} td_logprob_entry;

#endif
