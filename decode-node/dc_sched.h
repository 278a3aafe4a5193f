/* dc_sched.h: the decode instance's continuous-batching scheduler (runs on rank 0).
 *
 * Purpose: decide, step by step, which tokens go through the model: one token for every
 * running request that is decoding, plus prefill chunks (colocated mode: the instance
 * prefills its own prompts) under a per-step prefill token budget, so long prompts never
 * stall running decodes. It owns the KV block allocation of rank 0's pool; the other ranks use
 * the same block ids (their pools have the same number of blocks). In disaggregated mode
 * a request's prompt KV is computed by a prefill instance and written into its blocks by
 * kvxfer: such a request starts TRANSFERRING with its prompt's blocks reserved.
 *
 * A request's life:
 *
 *     submit ──> WAITING ──admit──> RUNNING ──(stop | length | cancel | error)──> freed
 *                  ^                   │ ^
 *                  └────preempt────────┘ │   (KV freed; prompt + generated recomputed later)
 *                                        │
 *     submit_transfer ──> TRANSFERRING ──┘ transfer_done: first token appended (and
 *                            │             reported); joins when the batch has room
 *                            └──transfer_end (failed, cancelled: only once no writer can
 *                               write into its blocks any more)──> freed
 *
 * TRANSFERRING holds blocks for [0, n_prompt) and is never planned; the node decides its
 * end (kvxfer's safety rule: blocks of a failed transfer are reusable only when every
 * rank's transfer is FAILED or DONE). transfer_done makes it as if the node had prefilled
 * the prompt itself and sampled the prefill's first token (the sampler skips one draw,
 * kn_sampler_skip), so a seeded request gives the same tokens in both modes.
 *
 * A running request holds tokens [0, n_tokens) (prompt, then generated ones) of which
 * [0, n_computed) have KV in the pool. Each step computes a range [n_computed, +chunk);
 * when that reaches n_tokens the last row's logits are sampled and the new token is
 * appended. Prefill and decode are thus the same thing with chunk > 1 or == 1. A request
 * that asks for prompt logprobs also gets a logit row for every prompt row of its chunks
 * (once per position: not again after a preemption); others get none.
 * Invariants: a request is in exactly one of the waiting, running or transferring lists;
 * blocks held = blocks for n_computed (+ this step's chunk between plan and commit);
 * a request that could never fit the whole pool (prompt + max_tokens) is refused at
 * submit; the oldest running request can always progress (preemption takes the most
 * recently admitted first), so the scheduler cannot deadlock.
 * Prefix cache (p.prefix_cache, kvmem/kv_cache.h): at admission a request shares the
 * cached leading whole blocks of its tokens (never the block of its last token, which is
 * always computed) and n_computed starts after them; each whole block enters the cache as
 * soon as its KV is computed (an arrived transfer's prompt blocks too), so concurrent
 * requests with a common prefix and later turns of a conversation share it. Freeing or
 * preempting drops references; cached blocks stay until an allocation evicts them (least
 * recently idle first). The other ranks follow through the plan's block tables.
 * Second tier (p.tier): an evicted cached block is written to the tier; at admission a
 * prompt's leading blocks found only there are copied into free pool blocks (bounded work
 * per step, see dc_sched_params) before the request's first chunk is planned. At tp > 1 the
 * tier (params.tier.log) records its copies; the node sends them in the step plan and the
 * other ranks repeat them on their pools (dc_tier.c, kv_tier.h "tensor parallelism").
 * Structured output: a request with a grammar (td_sampling.grammar_kind) has a matcher that
 * has seen every generated token (a moved request's are replayed at submit, a transfer's
 * first token at transfer_done); each sample is masked by it, and a token that completes
 * the document finishes the request STOP (the token is sent).
 * Threading: not thread-safe; the node's single engine loop calls everything.
 * Ownership: dc_sched_submit copies its inputs; the dc_step returned by dc_sched_plan
 * points into the scheduler and is valid until the next dc_sched_commit/plan.
 */
#ifndef DC_SCHED_H
#define DC_SCHED_H

#include <stdbool.h>
#include <stdint.h>

#include "gr_grammar.h"
#include "kv_mem.h"
#include "model.h"
#include "dc_spec.h"
#include "sampler.h"

typedef enum {
    DC_FINISH_NONE = 0,
    DC_FINISH_STOP,   /* EOS / end-of-generation or a stop token id */
    DC_FINISH_LENGTH, /* max tokens or the context limit */
    DC_FINISH_CANCELLED,
    DC_FINISH_ERROR,
} dc_finish;

typedef struct {
    uint64_t id;
    const int32_t *prompt;
    int32_t n_prompt;
    td_sampling sampling; /* .skip_samples < n_prompt */
    int32_t max_tokens;
    const int32_t *stop_ids;
    int n_stop;
    bool ignore_eos;
} dc_request_params;

/* Where results go. Called from dc_sched_commit / dc_sched_plan, on the engine loop. */
typedef struct {
    void *ctx;
    /* New tokens of request id (n may be 0 on a final event); finish != NONE marks the
     * last event of the request; usage counts travel with every event. lps (n): the tokens'
     * logprobs when the request asked (sampling.logprobs) and this node sampled them, else
     * NULL (the first token of a transfer: the prefill reports its logprob). n_cached: prompt
     * tokens whose KV came from the prefix cache at its first admission (usage). */
    void (*on_tokens)(void *ctx, uint64_t id, const int32_t *ids, int n,
                      const td_logprob_entry *lps, dc_finish finish, int32_t n_prompt,
                      int32_t n_generated, int32_t n_cached);
    /* sampling.prompt_logprobs: the logprobs of prompt positions from .. from + n - 1 (from
     * >= 1), in order, each position once, all before the request's first token; optional. */
    void (*on_prompt_logprobs)(void *ctx, uint64_t id, int32_t from, const td_logprob_entry *e,
                               int n);
} dc_sink;

typedef struct {
    int max_running;        /* requests in the running batch; 0: 64 */
    int step_tokens;        /* prefill tokens per step, on top of one token per decoding
                               request; 0: 256 */
    bool deterministic;     /* prefill rows are solo rows too (kn_batch.n_solo = all) */
    int32_t max_ctx;        /* per-request context limit (prompt + generated); 0: model's */
    const int32_t *eog_ids; /* tokens that end generation unless ignore_eos */
    int n_eog;
    /* structured output (grammar/gr_grammar.h), borrowed for the scheduler's life: the
     * model's vocabulary and the process's compiled grammars. NULL: a request with a
     * grammar is refused (TD_EUNSUPP). */
    gr_vocab *vocab;
    gr_cache *grammars;
    /* prefix cache (kvmem/kv_cache.h), added to the KV memory at create (it lives as long as
     * the memory) */
    bool prefix_cache;
    /* its second tier (kvmem/kv_tier.h), likewise added when tier.bytes > 0 (needs
     * prefix_cache): evicted cached blocks go there, and a prompt's
     * blocks found there are copied back at admission, at most tier_blocks_per_step per step
     * (0: 32); a request whose prefix needs more waits at the head of the queue and goes on
     * the next step (running requests decode meanwhile) */
    kn_kv_tier_params tier;
    int tier_blocks_per_step;
    /* colocated scheduling with bounded decode stalls: while requests decode, a step takes
     * only the prefill tokens that the step cost model (dc_plan.h, fitted from
     * dc_sched_observe) predicts keep the step's time within itl_target_ms; the step's first
     * chunk still gets min(DC_SCHED_MIN_PREFILL, what its prompt has left), so prompts always
     * progress. 0: no cap (step_tokens alone bounds the prefill share). */
    double itl_target_ms;
    /* the CPU pool every request's sampler spreads its per-token passes over
     * (kn_sampler_set_pool: the same tokens), borrowed for the scheduler's life; the caller
     * never runs it during dc_sched_commit; NULL: the calling thread alone */
    struct kn_pool *sample_pool;
    /* speculative decoding (dc_spec.h): a decoding request's proposals verified in its
     * step; method DC_SPEC_OFF: none */
    dc_spec_params spec;
} dc_sched_params;

enum { DC_SCHED_MIN_PREFILL = 32 }; /* prefill tokens a capped step still takes */

typedef struct dc_sched dc_sched;

/* One step's batch. */
typedef struct {
    kn_batch batch; /* tokens, positions, sequences, logit rows */
    int n_requests; /* requests taking part */
} dc_step;

typedef struct {
    int running, waiting; /* waiting includes arrived transfers waiting for a batch slot */
    int transferring;     /* KV transfers in flight (their blocks count as used) */
    int kv_blocks_used, kv_blocks_free;
    uint64_t preemptions;
    uint64_t prefix_queried;   /* tokens of admitted requests looked up in the prefix cache */
    uint64_t prefix_hits;      /* of which found cached (not computed again) */
    uint64_t prefix_evictions; /* cached blocks evicted to make room */
    /* the second tier: blocks written to it, blocks read back, prompt tokens of admitted
     * requests whose KV came from blocks read back, tier errors (all 0 without a tier) */
    uint64_t tier_writes, tier_reads, tier_hits, tier_errors;
    uint64_t prefill_capped; /* steps whose prefill share itl_target_ms cut */
    /* speculative decoding: verifications (decode rows that carried proposals), proposed
     * tokens verified, of which accepted, and accepted at each proposal position (0: the
     * first of a verification), all since the start */
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted;
    uint64_t spec_accepted_pos[DC_SPEC_MAX_TOKENS];
    uint64_t spec_held_steps; /* steps the measured gate held speculation off in */
    /* the step cost model as fitted (dc_plan.h): predicted ms of a step of one decode row,
     * and what one verification row adds to it (its attention at position 0 aside) */
    double cost_decode_ms, cost_verify_ms;
} dc_sched_stats;

/* mem: the shard's KV memory (borrowed; outlives the scheduler), to which create adds the
 * prefix cache and its tier as p asks. */
int dc_sched_create(const dc_sched_params *p, const kn_model *m, kn_kv_mem *mem, dc_sink sink,
                    dc_sched **out);
void dc_sched_destroy(dc_sched *s); /* frees every request's blocks */

/* Queue a request. TD_EINVAL: bad parameters or a duplicate id, or a grammar that does not
 * compile or that a moved request's generated tokens leave; TD_EUNSUPP: a grammar without
 * a vocabulary (dc_sched_params.vocab); TD_ENOSPC: it could never fit the pool (prompt +
 * max_tokens); TD_ERANGE: prompt past the context limit or a token id outside the
 * vocabulary. */
int dc_sched_submit(dc_sched *s, const dc_request_params *p);
/* Cancel: the request finishes (DC_FINISH_CANCELLED) and its blocks are freed at the
 * next dc_sched_plan. TD_ENOENT if no such request. A request still transferring is only
 * marked: the node ends it with dc_sched_transfer_end once its transfer is over. */
int dc_sched_cancel(dc_sched *s, uint64_t id);

/* Disaggregated mode: check p like dc_sched_submit (same errors) and reserve blocks for
 * the whole prompt now; the request is TRANSFERRING. With the prefix cache, the prompt's
 * leading whole blocks found in the pool are shared (as at admission: never the block of
 * the last prompt token, nothing with prompt logprobs; blocks only the second tier holds
 * are copied back within what is left of the step's copy budget, never waiting for more:
 * the rest is transferred) and *n_cached (a multiple of the block size) says how many
 * positions they hold: the transfer must write only [*n_cached, n_prompt), never the
 * shared blocks. *blocks (n_blocks ids:
 * position q in blocks[q / block_size], the shared ones first) stays valid until the next
 * call into the scheduler. TD_ESTATE: the pool cannot hold the prompt right now (blocks
 * promised to running prompts count as taken); retry later. */
int dc_sched_submit_transfer(dc_sched *s, const dc_request_params *p, const int32_t **blocks,
                             int *n_blocks, int32_t *n_cached);
/* The KV of [0, n_prompt) arrived and the prefill sampled first_token: report it (a
 * generated token; a stop token or max_tokens 1 finishes the request here) and make the
 * request runnable. A request cancelled meanwhile finishes CANCELLED. TD_ENOENT: not
 * transferring; TD_EINVAL: first_token outside the vocabulary (nothing changed). */
int dc_sched_transfer_done(dc_sched *s, uint64_t id, int32_t first_token);
/* The transfer failed or was cancelled and no writer can write into the blocks any more:
 * free them and report the final event with why. TD_ENOENT if no such request. */
int dc_sched_transfer_end(dc_sched *s, uint64_t id, dc_finish why);
/* Whether id is transferring (its KV not arrived yet). */
bool dc_sched_transferring(const dc_sched *s, uint64_t id);

/* Build the next step. Returns the number of tokens (0: nothing runnable) or a negative
 * td_err. Finished/cancelled requests are reported and freed here. */
int dc_sched_plan(dc_sched *s, dc_step *step);
/* Apply the step's logits ((batch.n_logits, n_vocab)): sample, append, report, finish.
 * rc != 0 means the forward pass failed: every request of the step is failed. */
int dc_sched_commit(dc_sched *s, const float *logits, int rc);
/* The measured wall time of the step last committed (ms), for the step cost model that
 * sizes capped steps (p.itl_target_ms); steps never observed leave the model at its start. */
void dc_sched_observe(dc_sched *s, double ms);
/* The step cost model's prediction for the step last planned (ms; 0 for a step with no rows),
 * before dc_sched_observe folds it in. */
double dc_sched_predict_ms(const dc_sched *s);

/* Fail every request (e.g. a rank died); each gets a final DC_FINISH_ERROR event.
 * Transferring ones too: their blocks go back to the pool at once, so the caller must not
 * allocate again before every aborted transfer is final (the node stops, or re-forms and
 * admits nothing until then). Afterwards no block is in use and the prefix cache is empty
 * (the other ranks' pools start empty when the instance re-forms). */
void dc_sched_fail_all(dc_sched *s);

bool dc_sched_idle(const dc_sched *s); /* no request at all (transferring ones count) */
dc_sched_stats dc_sched_get_stats(const dc_sched *s);

#endif
