/* dc_spec.h: speculative decoding's policy in the decode scheduler: which tokens a decoding
 * request proposes for the next step, and how many of them are worth verifying.
 *
 * Purpose: at small batches a decode step reads every weight to produce one token per
 * request; the same read verifies a few proposed tokens more. dc_sched lays a request's
 * proposals out after its decode row (all of them solo rows, model.h: each row's logits are
 * bit-identical to those of sequential decoding), samples each verified position with the
 * request's own sampler in order, keeps the proposals up to the first that differs from
 * what was sampled, and rolls the KV of the rest back (kvmem: kn_kv_seq_rollback).
 * Because every proposal here is deterministic (a point mass), sampling the target and
 * comparing is exactly rejection sampling (accept d with probability p(d), else draw from
 * p without d renormalised): the output has the target's distribution, and a seeded
 * request draws the same numbers in the same order as without speculation, so its tokens
 * are the same with speculation on or off.
 *
 * Proposals (prompt lookup, vLLM's `ngram`, llama.cpp's lookup decoding): the longest
 * suffix of the request's tokens (prompt and output) of ngram_min..ngram_max tokens that
 * occurred before, its most recent earlier occurrence, and the tokens that followed it.
 *
 * How many (adaptive): each request keeps two running estimates: a, the chance that its
 * first proposal of a step is accepted, and c, the chance that a later one is, given the one
 * before it was (the j-th is accepted with a c^(j-1)). Two, not one: acceptance comes in
 * runs (where the answer copies its input, the whole continuation is right or the first
 * token is not), and one chance per proposal, raised to the j-th power, undervalued the
 * deep proposals that pay most (prompt lookup on code edits: 2.5 of 3.7 proposals a
 * verification accepted, where one chance of 0.69 predicts 1.5). The step adds proposals, most
 * likely first across the batch, while each raises the step's expected tokens per predicted
 * millisecond: p * t > T * r, with p the proposal's chance, T the step's expected tokens so far, t
 * its predicted time and r the predicted cost of one verification row, plus one draft model pass
 * where the proposal is deeper than any taken so far (the step cost model, dc_plan.h, fitted from
 * the measured step times). A large batch (T large against t) or a poor acceptance thus turns
 * speculation off by itself. Not adaptive: every proposal up to max_tokens.
 *
 * Threading: none; the scheduler's engine loop calls everything.
 */
#ifndef DC_SPEC_H
#define DC_SPEC_H

#include <stdbool.h>
#include <stdint.h>

enum { DC_SPEC_MAX_TOKENS = 32 }; /* bound on max_tokens (and the per-position counters) */
/* A proposer that speculated in the request's last step is at most this many tokens behind
 * it: the token sampled after the accepted proposals, and the last proposal when all were
 * accepted (it was never fed back). */
enum { DC_SPEC_STEADY_BEHIND = 2 };

typedef enum {
    DC_SPEC_OFF = 0,
    DC_SPEC_NGRAM, /* prompt lookup */
    DC_SPEC_DRAFT, /* a proposer (dc_spec_proposer: a draft model, an MTP block) */
} dc_spec_method;

/* A proposer that computes its proposals (dc_draft.h): the scheduler decides first how
 * many tokens each request may propose (adaptive: from its acceptance, as for prompt
 * lookup; its cost is in the measured step time, which the step cost model fits), then
 * asks for them all at once. Called on the scheduler's thread only. */
typedef struct {
    void *ctx;
    /* n requests: request i (id ids[i], tokens toks[i][0, n_toks[i]): prompt and output)
     * gets up to k[i] proposals in out[i], their number in n_out[i] (fewer, 0: none). 0, or
     * a negative td_err: then no request speculates in this step. */
    int (*propose)(void *ctx, int n, const uint64_t *ids, const int32_t *const *toks,
                   const int32_t *n_toks, const int *k, int32_t *const *out, int *n_out);
    /* Request id's tokens are now toks[0, n) (its proposals were verified): what the
     * proposer computed past their longest prefix it agrees with is stale. */
    void (*keep)(void *ctx, uint64_t id, const int32_t *toks, int32_t n);
    /* Request id ended or was preempted: forget it. */
    void (*drop)(void *ctx, uint64_t id);
    /* Optional (NULL: not told). The target computed positions [pos0, pos0 + n) of request
     * id in the step just ended (its prefill chunk, or its decode row and verification rows);
     * toks[0, n_toks): the request's tokens (prompt and output) so far; h: with n_hidden > 0,
     * the rows' final hidden states as the LM head reads them (n, n_hidden;
     * kn_batch.hidden_out), else NULL. Called before the step's tokens are sampled: rows past
     * what keep then says the request holds are of rejected proposals. */
    void (*computed)(void *ctx, uint64_t id, int32_t pos0, int32_t n, const float *h,
                     const int32_t *toks, int32_t n_toks);
    int n_hidden; /* > 0: computed reads the target's hidden states (an MTP block) */
    /* Optional (NULL: none). Tokens the last propose call caught up beyond what speculating
     * in every step leaves behind (DC_SPEC_STEADY_BEHIND a request): a prompt the prefill
     * stages computed or the prefix cache served, or the output of steps in which a request
     * did not speculate (the gate held it off, the choice took nothing). That is not the
     * price of the step's proposals, so the scheduler measures neither the gate nor the step
     * cost model on that step, and the gate measures the next one instead
     * (dc_spec_gate_skip). */
    int64_t (*stale_tokens)(void *ctx);
} dc_spec_proposer;

typedef struct {
    dc_spec_method method;
    int max_tokens; /* most proposals one request verifies in a step, 1..DC_SPEC_MAX_TOKENS;
                       0: 8 */
    bool pinned;    /* every proposal up to max_tokens, no adaptation */
    bool gate;      /* adaptive: also the measured gate (dc_spec_gate, below) */
    int ngram_min;  /* shortest suffix matched; 0: 2 */
    int ngram_max;  /* longest; 0: 4 (ngram_min <= ngram_max) */
    dc_spec_proposer proposer; /* DC_SPEC_DRAFT: borrowed for the scheduler's life */
} dc_spec_params;

/* A request's acceptance record. */
typedef struct {
    double accept; /* estimated chance that a step's first proposal is accepted */
    double cont;   /* ... that a later one is, the one before it accepted */
} dc_spec_req;

void dc_spec_req_init(dc_spec_req *q);
/* A verification ended: n_proposed proposals, the first n_accepted of them accepted. */
void dc_spec_req_observe(dc_spec_req *q, int n_proposed, int n_accepted);

/* One request's proposals in a step (dc_spec_choose). */
typedef struct {
    double accept; /* its dc_spec_req estimates */
    double cont;
    int n_cand;   /* proposals it has */
    int32_t pos0; /* the position of the first */
    int take;     /* out: how many of them to verify */
    double next;  /* dc_spec_choose's own: the chance of proposal take + 1 */
} dc_spec_cand;

/* Adaptive: take proposals of c (n), the most likely first across requests, while each
 * raises the step's expected tokens per predicted millisecond (see the top); tokens and
 * ms: the step's without proposals (ms > 0); row_ms(ctx, pos): a verification row's
 * predicted ms at position pos; pass_ms: a proposer's pass per proposal depth (0: prompt
 * lookup, which needs none). */
void dc_spec_choose(dc_spec_cand *c, int n, double tokens, double ms,
                    double (*row_ms)(const void *ctx, int32_t pos), const void *ctx,
                    double pass_ms);

/* The measured gate (speculative.gate, adaptive only): the choice above weighs a proposal by
 * the step cost model, one line fitted over every batch size, and where a verification row
 * costs about what it saves (a batch whose steps are compute-bound: a mixture-of-experts
 * model at 16 rows on a CPU) its error decides, and a proposer's own time (a draft model's
 * or MTP block's passes, their catch-up) is only as right as the fit. The gate measures
 * instead: per batch size (decode rows 1, 2-3, 4-7, ... 64+), the wall time per generated
 * token of the steps that allow speculation and of the steps that hold it off, running means
 * (a step's time as measured, not over a prediction: the cost model is refitted as the steps
 * come, and early in a run its predictions are off by 2-5x, which no ratio to them survives;
 * probes interleave with the other steps, so both ways see the same contexts and row counts).
 * Speculation is held off at a batch size once both ways have DC_SPEC_GATE_MIN_OBS steps and
 * its time per token is above the held-off steps' by the margin, and allowed again once
 * below by it; one step in DC_SPEC_GATE_PROBE of a batch size runs the other way (one in
 * DC_SPEC_GATE_PROBE_FAR once the two are far apart, so a 2x gain loses little to its
 * probes). A step over twice its way's mean (a first step's warm-up, a preempted thread)
 * counts as twice the mean. Only steps without prefill rows are measured (a prompt's chunk
 * would hide the difference), and not those whose proposer caught up more than its steady
 * lag (dc_spec_gate_skip: the next step stands in). */
enum { DC_SPEC_GATE_BUCKETS = 7 };     /* decode rows 1, 2-3, 4-7, ..., 32-63, 64+ */
#define DC_SPEC_GATE_PROBE       8     /* one step in this many runs the other way */
#define DC_SPEC_GATE_PROBE_FAR   32    /* ... once one way is DC_SPEC_GATE_FAR ahead */
#define DC_SPEC_GATE_FAR         0.8   /* the better way's time per token below this share */
#define DC_SPEC_GATE_MARGIN      0.97  /* a switch: the other way below this share of the current */
#define DC_SPEC_GATE_MIN_OBS     4     /* steps of each way before a switch */
#define DC_SPEC_GATE_ALPHA       0.125 /* a step's weight in its way's running mean */
#define DC_SPEC_GATE_ALPHA_PROBE 0.25  /* a probe's: the one fresh reading of its way */

typedef struct {
    bool on;                                 /* measuring (else every step allows speculation) */
    bool held[DC_SPEC_GATE_BUCKETS];         /* speculation held off at this batch size */
    double ms_tok[DC_SPEC_GATE_BUCKETS][2];  /* [b][allowed]: running mean of a step's ms per
                                                generated token; < 0: not measured */
    uint32_t n_obs[DC_SPEC_GATE_BUCKETS][2]; /* steps measured (saturating) */
    uint64_t steps[DC_SPEC_GATE_BUCKETS];    /* steps planned at the batch size */
    int step_bucket;                         /* the last step's (dc_spec_gate_allow), -1: none */
    bool step_allowed;
    int reprobe;         /* the bucket whose next step speculates (dc_spec_gate_skip), -1: none */
    uint64_t held_steps; /* steps that held speculation off (probes aside: the stats line) */
} dc_spec_gate;

void dc_spec_gate_init(dc_spec_gate *g, bool on);
/* The batch size's index in held and ms_tok (n_decode >= 1). */
int dc_spec_gate_bucket(int n_decode);
/* Whether the next step, of n_decode decode rows, allows speculation. */
bool dc_spec_gate_allow(dc_spec_gate *g, int n_decode);
/* That step took ms and generated tokens (decode rows plus accepted proposals). Steps with
 * prefill rows are not given. */
void dc_spec_gate_observe(dc_spec_gate *g, double ms, int tokens);
/* That step is not measured (its time holds other work: a proposer's catch-up); when it
 * speculated, the next step of its batch size speculates too and is measured in its place
 * (else a probe after held steps, always behind, would never be measured). */
void dc_spec_gate_skip(dc_spec_gate *g);

/* Prompt lookup: up to k tokens following the most recent earlier occurrence of the longest
 * suffix of tokens[0, n) with ngram_min..ngram_max tokens; returns how many were written to
 * out (0: no such occurrence). */
int dc_spec_ngram(const int32_t *tokens, int32_t n, int ngram_min, int ngram_max, int k,
                  int32_t *out);

#endif
