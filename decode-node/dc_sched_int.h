/* dc_sched_int.h: the decode scheduler's private state, shared by dc_sched.c (the lists,
 * admission, preemption, the step's plan and layout) and dc_sched_tokens.c (what a step's
 * logits or a transfer's first token become: sampling, stops, the grammar, speculation's
 * acceptance, the token events).
 * Not installed; nothing outside these two files includes it. The functions shared between
 * them carry the dcs_ prefix. Threading: as dc_sched.h (one owner thread).
 */
#ifndef DC_SCHED_INT_H
#define DC_SCHED_INT_H

#include "dc_plan.h"
#include "dc_sched.h"

typedef struct {
    uint64_t id;
    int32_t *tokens; /* (cap) prompt then generated */
    int32_t n_tokens, cap;
    int32_t n_prompt;
    int32_t out_from;   /* tokens[out_from..n_tokens): generated for the request (a moved
                           request's earlier tokens end its prompt: sampling.skip_samples) */
    int32_t n_computed; /* tokens with KV in the pool */
    int32_t n_generated;
    int32_t max_tokens;
    int32_t *stop_ids;
    int n_stop;
    bool ignore_eos;
    bool cancelled;
    bool arrived; /* transferring: the KV and the first token are in; runnable */
    kn_kv_seq seq;
    kn_sampler smp;
    gr_matcher *gm;    /* structured output: the generated tokens so far; NULL: none */
    uint64_t admitted; /* admission order; preemption takes the largest */
    int32_t chunk;     /* tokens of this step (0: not in the step) */
    int32_t logit_row; /* row in this step's logits, -1: none */
    int32_t row0;      /* its first row (token) in this step's batch */
    /* prompt logprobs (sampling.prompt_logprobs): the next prompt position owed (n_prompt:
     * none), and this step's rows: position plp_pos0 + j is scored by row plp_row0 + j */
    int32_t plp_next, plp_row0, plp_pos0, plp_n;
    /* prefix cache: prompt tokens found cached at the first admission (usage), and whether
     * it was admitted before (its place in the cache's chains is seq's) */
    int32_t n_cached;
    bool admitted_once;
    /* speculative decoding: proposals after the decode row's token, n_draft of them in this
     * step (draft: (spec max_tokens), NULL without it) */
    int32_t *draft;
    int n_draft;
    dc_spec_req spec;
} dc_req;

/* A growable array of request pointers. */
typedef struct {
    dc_req **v;
    int n, cap;
} dc_req_list;

struct dc_sched {
    dc_sched_params p;
    int32_t *eog; /* (n_eog) copy */
    const kn_model *m;
    kn_kv_mem *mem;
    const kn_kv_pool *kv; /* mem's pool: its shape */
    dc_sink sink;
    dc_req_list waiting; /* FIFO; preempted requests go back to the front */
    dc_req_list running; /* in admission order */
    dc_req_list xfer;    /* transferring (disaggregated): prompt blocks held, in Alloc order */
    uint64_t admit_counter;
    uint64_t preemptions;
    kn_kv_cache *cache;           /* p.prefix_cache: mem's prefix cache, else NULL */
    uint64_t pc_queried, pc_hits; /* tokens looked up / found at admissions */
    kn_kv_tier *tier;             /* p.tier: mem's second tier, else NULL */
    int tier_left;                /* copies from the tier this step may still make */
    uint64_t tier_hits;           /* tokens admitted from blocks the tier gave back */
    /* the current step's arrays, (cap_tokens) / (cap_seqs) */
    int32_t *tok, *pos, *seq_of, *rows;
    kn_seq_view *views;
    dc_req **in_step; /* (cap_seqs) requests of this step, index = seq index */
    int cap_tokens, cap_seqs;
    bool planned;                          /* a step was planned and not committed yet */
    dc_cost cost;                          /* p.itl_target_ms: the step cost model */
    dc_step_shape shape;                   /* of the step last planned (dc_sched_observe) */
    bool capping, prefill_planned, capped; /* planning a capped step, with ms_left */
    double ms_left;                        /* ms its prefill may still take */
    uint64_t prefill_capped;
    /* speculative decoding: a request's tokens and their logprobs emitted by one commit
     * (1 + max_tokens), the step's candidates (cap_seqs), and the counters */
    int32_t *emit;
    td_logprob_entry *emit_lp;
    dc_spec_cand *cands;
    dc_req **cand_req; /* (cap_seqs) the request of each candidate */
    /* DC_SPEC_DRAFT: the proposer's arguments, (cap_seqs) each */
    uint64_t *pr_ids;
    const int32_t **pr_toks;
    int32_t *pr_ntok, **pr_out;
    int *pr_k, *pr_nout;
    float *hid; /* (cap_tokens, proposer.n_hidden): the step's hidden states for
                   proposer.computed (n_hidden > 0), else NULL */
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted;
    uint64_t spec_accepted_pos[DC_SPEC_MAX_TOKENS];
    dc_spec_gate gate; /* speculation per batch size, measured (dc_spec.h) */
    int step_accepted; /* the last commit's accepted proposals */
    int64_t step_stale; /* tokens the proposer caught up beyond its steady lag in the step
                           being run (dc_spec_proposer.stale_tokens): it is not measured */
};

void dcs_list_remove_at(dc_req_list *l, int i);
/* Frees r and everything it holds (its KV sequence, sampler, matcher, draft state). */
void dcs_req_free(dc_sched *s, dc_req *r);
/* Ends request i of l with why (its event sent) and frees it. */
void dcs_finish(dc_sched *s, dc_req_list *l, int i, dc_finish why);
/* Prefix cache: enter r's whole blocks whose KV is now computed. */
void dcs_pc_insert(dc_sched *s, dc_req *r);
/* Transferred requests whose KV and first token are in join the running list. */
void dcs_admit_arrived(dc_sched *s);

#endif
