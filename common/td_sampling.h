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
    /* Structured output (grammar/gr_grammar.h): TD_GRAMMAR_*; for the JSON_SCHEMA kinds
     * `grammar` is the schema's JSON text (NUL-terminated, borrowed from whoever filled the
     * struct: rt_params, a decoded proto message, a prefill wire buffer), else NULL. The
     * sampler itself never reads them: the decode scheduler and the last prefill stage
     * compile them into a token mask (kn_sampler_set_mask). */
    int32_t grammar_kind;
    const char *grammar;
} td_sampling;

enum {
    TD_GRAMMAR_NONE = 0,
    TD_GRAMMAR_JSON_OBJECT = 1,        /* response_format json_object: any JSON object */
    TD_GRAMMAR_JSON_SCHEMA = 2,        /* json_schema, strict false */
    TD_GRAMMAR_JSON_SCHEMA_STRICT = 3, /* json_schema, strict true: every property required */
};

#endif
