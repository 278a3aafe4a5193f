/* sampler.h: next-token sampling from logits.
 *
 * Purpose: the one sampler used by the CLI, the prefill last stage and decode rank 0.
 * Order: logit bias and the min_tokens mask first (vLLM's logits processors), then as
 * llama.cpp's default chain: repetition penalty -> presence and frequency penalties -> top-k ->
 * top-p -> min-p -> temperature -> draw. temperature <= 0 is greedy (argmax after the
 * penalties; ties go to the lowest id). A masked token (-inf) is never drawn.
 * Penalties: repeat_penalty divides a positive logit (multiplies a negative one) of each
 * distinct token among the last repeat_last_n of the history, prompt included (llama.cpp);
 * presence and frequency penalties count only the request's generated tokens (OpenAI and
 * vLLM): logit[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0).
 * Mask: a token mask set with kn_sampler_set_mask (structured output) is applied before
 * anything else: masked tokens get logit -inf and can never be drawn.
 * Invariants: the same params, seed, logits and history give the same token, on every
 * machine (the RNG is a counter-free xoshiro256** seeded with splitmix64).
 * Threading: a kn_sampler belongs to one sequence and one thread. With a pool
 * (kn_sampler_set_pool), kn_sample spreads its per-token passes over the pool's threads
 * and returns the token the one-thread path returns, bit for bit: each token's value is
 * computed alone, and every sum keeps its order on the calling thread.
 * Ownership: kn_sampler_init/fini (embedded); scratch is owned by the sampler; the pool is
 * borrowed.
 */
#ifndef KN_SAMPLER_H
#define KN_SAMPLER_H

#include <stdint.h>

#include "td_sampling.h"

typedef struct {
    td_sampling p;
    int32_t n_vocab;
    uint64_t rng[4];
    struct kn_cand *cand;  /* (n_vocab) scratch */
    struct kn_cand *cand2; /* (n_vocab) scratch: the top-p nucleus */
    int32_t *count;        /* (n_vocab) zeroed scratch for the presence and frequency
                              penalties; NULL when both are 0 */
    uint8_t *seen;         /* (n_vocab) zeroed scratch for the repetition penalty; NULL when off */
    const uint32_t *mask;  /* borrowed, for the next kn_sample only: bit (id & 31) of word
                              id >> 5 set = allowed; NULL: every token */
    struct kn_pool *pool;  /* borrowed (kn_sampler_set_pool); NULL: the calling thread only */
} kn_sampler;

/* Seeds the sampler from p and advances it past p->skip_samples draws (kn_sampler_skip).
 * TD_EINVAL (logged) when a logit-bias or min_tokens id is outside [0, n_vocab), a bias is not
 * finite or a count is out of range; TD_ENOMEM. */
int kn_sampler_init(kn_sampler *s, const td_sampling *p, int32_t n_vocab);
void kn_sampler_fini(kn_sampler *s);

/* Sample from logits (n_vocab). history (n_hist) are the sequence's previous tokens, used by
 * the repetition penalty; its last n_out (0 <= n_out <= n_hist) are the tokens generated for
 * this request so far (a moved request's included), which alone count for the presence and
 * frequency penalties. Returns the token id (>= 0) or a negative td_err (TD_EINVAL for an
 * n_out out of range). */
int32_t kn_sample(kn_sampler *s, const float *logits, const int32_t *history, int64_t n_hist,
                  int64_t n_out);

/* Run kn_sample's per-token passes (copy, mask, argmax, max, exp) on pool's threads from
 * now on (NULL: on the calling thread only). The pool is borrowed until the sampler's fini
 * or the next set; kn_sample then calls kn_pool_run, so it must not run while another
 * thread uses the pool (the decode node samples between forward passes). */
void kn_sampler_set_pool(kn_sampler *s, struct kn_pool *pool);

/* Restrict the next kn_sample call to the tokens whose bit is set in mask ((n_vocab + 31)
 * / 32 words, borrowed until that call, which clears it). NULL: no restriction. A mask that
 * allows no token makes kn_sample return TD_EINVAL. */
void kn_sampler_set_mask(kn_sampler *s, const uint32_t *mask);

/* Advance the sampler exactly as one successful kn_sample call does, without logits: a
 * token sampled elsewhere with the same params and seed (the last prefill stage samples
 * a disaggregated request's first token) is skipped, so the next kn_sample here draws
 * what a sampler that had drawn that token itself would draw. kn_sample draws one random
 * number per call when temperature > 0 and none when greedy; so does this. */
void kn_sampler_skip(kn_sampler *s);

/* The index of the largest of v[0, n) (n >= 1; ties: the lowest index): greedy decoding
 * of one logit row, for callers that need no sampler (a draft model, act_check). */
int32_t kn_argmax(const float *v, int32_t n);

/* Log-probabilities, as OpenAI's logprobs and vLLM's default "raw_logprobs": log-softmax of
 * the model's raw logits, before every penalty, top-k/p, min-p and temperature.
 * The log-probability of token chosen under logits (n_vocab) into out->logprob, and the k
 * (0 <= k <= TD_MAX_TOP_LOGPROBS, k <= n_vocab) most likely tokens into out->top, most
 * likely first (ties: lowest id first). log-sum-exp in double with the maximum subtracted;
 * the top k by a partial selection (a k-element heap, O(n_vocab log k)), no sort of the
 * vocabulary. Returns 0, or TD_EINVAL for chosen or k out of range. */
int kn_logprobs(const float *logits, int32_t n_vocab, int32_t chosen, int k, td_logprob_entry *out);

/* (float)exp(x), bit for bit, without libm's call for x in [-104, 0] (the sampler's
 * exp((logit - max) / temperature)): a polynomial within 1e-15 of exp, kept only when every
 * value within 1e-13 of it rounds to the same float (else libm's exp decides, about once
 * in 10^6 calls). Exposed for its test. */
float kn_exp_to_float(double x);

#endif
