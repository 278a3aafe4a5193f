/* td_sampling.h: a request's sampling parameters, one type from the router to the sampler.
 *
 * Purpose: the router parses them from the OpenAI body into this struct; the control plane
 * carries them as proto Sampling (td_ctrl_sampling_to_pb / _from_pb in ctrl.h, the only
 * conversion); the prefill chain's wire format carries them to the last stage; the decode
 * scheduler and the last prefill stage hand them to kn_sampler_init unchanged.
 * Semantics (kernels/sampler.h applies them): logit bias and the min_tokens mask (as vLLM,
 * before everything else) -> repetition penalty -> presence and frequency penalties (llama.cpp's
 * order from here on) -> top-k -> top-p -> min-p -> temperature -> draw.
 * Size: the logit bias and the min_tokens ids live inline (fixed caps) so that the struct copies
 * by value everywhere; the wire formats carry only the entries in use.
 */
#ifndef TD_SAMPLING_H
#define TD_SAMPLING_H

#include <stdbool.h>
#include <stdint.h>

#define TD_MAX_LOGIT_BIAS     300 /* entries of logit_bias (OpenAI's cap) */
#define TD_MAX_MIN_TOKENS_IDS 96  /* ids masked by min_tokens: stop_token_ids + EOG ids */

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
    /* vLLM's min_tokens: while fewer than min_tokens tokens have been generated for the request
     * (kn_sample's n_out, a moved request's earlier ones included), min_tokens_ids (the
     * request's stop_token_ids, and the model's end-of-generation ids unless ignore_eos) are
     * masked to -inf. 0: off (the ids are then not carried). */
    int32_t min_tokens;
    int32_t n_min_tokens_ids; /* 0 .. TD_MAX_MIN_TOKENS_IDS */
    int32_t min_tokens_ids[TD_MAX_MIN_TOKENS_IDS];
    /* OpenAI's logit_bias: logit_bias_values[i] (in [-100, 100] from the router) is added to
     * the raw logit of logit_bias_ids[i] before anything else; distinct ids. */
    int32_t n_logit_bias; /* 0 .. TD_MAX_LOGIT_BIAS */
    int32_t logit_bias_ids[TD_MAX_LOGIT_BIAS];
    float logit_bias_values[TD_MAX_LOGIT_BIAS];
    /* OpenAI logprobs, log-softmax of the raw logits (kn_logprobs): 0 off; else each
     * generated token's logprob and its logprobs - 1 (0..20) most likely alternatives */
    uint32_t logprobs;
    bool prompt_logprobs; /* and every prompt token's from the second on (echo); logprobs > 0 */
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
