/* pf_int.h: the state of one prefill stage process and what every stage does with it
 * (pf_stage.c: requests, compute, first-token sampling, KV push, reports), shared by the
 * two roles: pf_leader.c (stage 0: control socket, queue, chunk planning, membership; its
 * start-up profile in pf_chunking.c) and
 * pf_follow.c (stages > 0: joining, the received stream). The chain transport is
 * pf_chain.h, the shard of the model pf_shard.h. Not a public interface: see pf_node.h.
 *
 * Reports: a stage reports each request it is done with (pf_stage_poll). Stages > 0 send
 * the report over the chain; stage 0 queues it in its own stage state, and the leader's
 * loop drains the queue (pf_stage_take_report) with the reports that came over the chain,
 * so stage code never calls into the leader.
 * Threading: a pf_stage is owned by the process's main thread, which runs the role's loop;
 * the link's and the connector's progress threads never touch it (they complete pf_ops and
 * kvxfer requests, read here by polling).
 */
#ifndef PF_INT_H
#define PF_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "ctrl.h"
#include "gr_grammar.h"
#include "kvx_conn.h"
#include "pf_chain.h"
#include "pf_chunk.h"
#include "pf_tune.h"
#include "pf_kvcache.h"
#include "pf_node.h"
#include "pf_shard.h"
#include "pf_wire.h"
#include "sampler.h"
#include "td_coreshare.h"

/* A request as one stage sees it. */
typedef struct pf_req {
    uint64_t id;
    int32_t n_prompt;
    uint32_t n_dst;
    td_sampling sampling; /* .grammar NULL: the text lives in the chunk that samples */
    kn_kv_seq kv;     /* this stage's blocks for the whole prompt; the first n_hit are the prefix
                         cache's (held through hit), the others the request's own */
    int32_t *hit;     /* (n_hit) the cached prefix blocks it holds */
    int n_hit;
    bool unrefd;   /* its stream references on hit were dropped (RELEASE) */
    bool released; /* stage 0's RELEASE came while it was still running: no insert */
    bool ok;       /* its transfer completed (a retired request: its blocks may be cached) */
    int32_t *hist; /* (n_prompt) the prompt's ids: last stage (the repetition penalty), and
                      every stage with a prefix cache (the blocks' tokens) */
    int32_t n_hist;
    uint32_t n_chunks;  /* chunks computed */
    int32_t n_sent;     /* tokens whose KV went to the connector */
    int32_t n_computed; /* tokens computed */
    int32_t first_token;
    bool opened;   /* kvx_pf_open done */
    bool finished; /* kvx_pf_finish done */
    bool failed;   /* no more work; waiting for the connector's final state */
    int fail_err;  /* td_err of a local failure */
    /* last stage, sampling.logprobs: the first token's logprob; prompt_logprobs: the
     * logits of the previous chunk's last row (they score this chunk's first token) */
    bool has_first_lp;
    td_logprob_entry first_lp;
    float *plp_row; /* (n_vocab) */
    bool plp_row_set;
    int64_t t_first_ms;   /* first chunk computed here */
    int64_t *comp_end_ns; /* (cap_chunks) td_now_ns when chunk k's compute ended */
    uint32_t cap_chunks;
    struct pf_req *next;
} pf_req;

/* One stage process: its identity, its shard and connector, its chain and its requests.
 * Owned by the main thread (see the top). */
typedef struct {
    const pf_node_params *p;
    const td_cfg_prefill *cfg;
    int stage, pp;
    bool first, last;
    uint64_t boot_id; /* differs per process start (StageHello, the epoch) */
    pf_shard shard;
    int n_embd, n_vocab;
    int chunk_max; /* tokens per chunk at most */
    kvx_conn *kvx;
    int timeout_ms; /* kvxfer.timeout_ms: a request's transfer deadline */
    uint64_t epoch; /* StageTable epoch this stage runs in; 0: not joined */
    pf_chain chain;

    /* requests of this stage */
    pf_req *reqs;
    int n_reqs;
    /* prefix cache (NULL: off) and the requests whose transfer ended but whose RELEASE has
     * not come yet (their blocks wait for the decision to cache them) */
    pf_kvc *kvc;
    pf_req *retired;
    uint64_t cache_hit_tokens; /* prompt tokens taken from the cache (not computed) so far */

    /* scratch of one chunk */
    int32_t *pos, *seq_of; /* (chunk_max) per row */
    int32_t *ids;          /* (chunk_max) the chunk's live token ids, compacted */
    float *logits;         /* last stage: (logit_cap, n_vocab) */
    int32_t *lrows;        /* last stage: (chunk_max + PF_MAX_SEGS) the chunk's logit rows */
    int logit_cap;         /* PF_MAX_SEGS; more for prompt logprobs (a row per token) */
    /* last stage, structured output: the vocabulary's trie and the compiled grammars; NULL
     * when the model has no usable tokenizer (a request with a grammar then fails) */
    gr_vocab *gvocab;
    gr_cache *grammars;

    /* stage 0 as the last stage: LOGPROBS messages waiting for the leader's loop, a FIFO */
    struct pf_lp_blob *lp_head, *lp_tail;

    /* stage 0: reports waiting for the leader's loop, a FIFO */
    pf_report *reports; /* (cap_reports) */
    int rep_head, n_reports, cap_reports;

    /* this stage's compute */
    uint64_t n_chunks;      /* chunks computed */
    double slow_chunk_ms;   /* recent longest chunk compute (decays) */
    double last_forward_ms; /* the last chunk's forward pass alone (no waits: the cost model's
                               refit learns from it, pf_chunking_observe) */
    /* decode[].share_cores: the CPU pool's gate on the decode instances of this host that
     * share its cores (td_coreshare.h), or NULL */
    td_coreshare_gate *cores;
} pf_stage;

/* pf_stage.c */
int pf_stage_setup(pf_stage *st); /* shard, connector, chain buffers, scratch */
/* pf_slice.c: the head slicing of the stage's KV pool for the cluster's decode instances
 * (*n_slices 0: head-major; else slice_heads[0 .. *n_slices)); who names the stage in logs. */
int pf_stage_slicing(const td_cfg *cfg, const char *who, int *n_slices, int *slice_heads);
void pf_stage_teardown(pf_stage *st);
/* Leave the chain (close it, epoch 0) after failing every request with err. */
void pf_stage_leave_chain(pf_stage *st, int err);
/* Compute one chunk (stage 0: from its own plan; others: a received message) and pass it
 * on. segs/ids as in pf_wire (ids: the live segments' token ids, read before anything is
 * written to this stage's scratch); embd NULL on stage 0. */
int pf_stage_chunk(pf_stage *st, pf_seg *segs, int n_segs, const int32_t *ids, float *embd);
void pf_stage_targets(pf_stage *st, uint64_t req_id, const uint8_t *const *t, const size_t *lens,
                      int n_t);
void pf_stage_abort(pf_stage *st, uint64_t req_id, int err);
void pf_stage_abort_all(pf_stage *st, int err);
/* Stage 0's RELEASE of a request (every stage runs it at the same point of the stream): its
 * hold on the cached prefix ends; insert: its whole blocks go into the prefix cache. */
void pf_stage_release(pf_stage *st, uint64_t req_id, bool insert);
/* Poll the connector for this stage's requests; report the finished ones. */
void pf_stage_poll(pf_stage *st);
/* Stage 0: the next report of its own stage (queued by pf_stage_poll); false if none. */
bool pf_stage_take_report(pf_stage *st, pf_report *out);
/* Process the next received chain message in order (stages > 0): 1 if one was handled,
 * 0 if none waits, or a negative td_err (the chain is broken). */
int pf_stage_recv(pf_stage *st);

/* pf_blocks.c */
/* r's block table for its prompt (the cached prefix stage 0 decided in g, then r's own
 * blocks); 0, TD_EINVAL (g's prefix is malformed or the cache is off), TD_ENOENT (this
 * stage's cache lacks it), TD_ENOSPC (no KV room), TD_ENOMEM, or a block copy's error. */
int pf_blocks_open(pf_stage *st, pf_req *r, const pf_seg *g);
/* Give back r's blocks: its own to the cache (insert: the whole blocks and the tail) or the
 * pool, its hold on the cached prefix to the cache. */
void pf_blocks_release(pf_stage *st, pf_req *r, bool insert);
/* Stage 0: tokens of the prompt's prefix in the cache (0 when the cache is off) and the id
 * of its last cached block: the leading whole blocks, or n - 1 when the whole prompt is
 * there (to its last whole block, or with its tail): the last token is always computed. */
int32_t pf_stage_cached_prefix(const pf_stage *st, const int32_t *prompt, int32_t n, uint64_t *id);
void pf_stage_cache_stats(const pf_stage *st, uint64_t *hit_tokens, uint64_t *evicted);

/* pf_lp.c: the last stage's logprobs (sampling.logprobs, kn_logprobs on the raw logits).
 * The first token's (into r->first_lp, for its report); 0 or TD_EINVAL. */
int pf_lp_first(pf_stage *st, pf_req *r, const float *row, int32_t token);
/* The prompt logprobs that segment g's rows give (rows: (g->t1 - g->t0, n_vocab), row t
 * scores prompt token t + 1; the prompt's ids up to g->t1 in r->hist): positions
 * max(t0, 1) .. t1 - 1 (t0's from the previous chunk's saved row) as LOGPROBS messages to
 * stage 0; the last row is kept for the next chunk. 0 or a negative td_err. */
int pf_lp_prompt(pf_stage *st, pf_req *r, const pf_seg *g, const float *rows);
/* Stage 0: the next LOGPROBS message of its own stage (pp 1), copied into buf
 * (PF_LP_MAX_BYTES); false if none. */
bool pf_stage_take_lp(pf_stage *st, uint8_t *buf, size_t *len);
void pf_lp_drop_all(pf_stage *st);

/* pf_chunking.c: stage 0's chunking, fixed or dynamic over the stage profile (cached or
 * measured; *st->p->profiling is 1 while it measures). Returns 0 (a profile that failed
 * means fixed chunks, with a warning), or TD_ESTATE when *stop ended the profile (the
 * caller shuts down). */
int pf_chunking_setup(pf_stage *st, pf_tune *tune, pf_chunk_params *chunking);

/* The initial chunk size of a request with n_cached of its n_prompt tokens in the prefix
 * cache: chunking->chunk_size, unless the YAML left chunk_size out and chunking is dynamic;
 * then the model's choice for its n_prompt - n_cached tokens (pf_tune_initial_chunk, within
 * [alignment, chunk_max]), logged. */
int pf_chunking_initial(const pf_stage *st, const pf_tune *tune, const pf_chunk_params *chunking,
                        uint64_t request_id, int64_t n_cached, int64_t n_prompt);

/* Feed the chunk of segs (n_segs) that stage 0 computed in ms to the online refit of the cost
 * model (dynamic chunking only; a chunk with a failed segment is not a sample). Logs the
 * model when the refit takes over or gives way, and every 64 chunks. */
void pf_chunking_observe(pf_stage *st, pf_tune *tune, const pf_seg *segs, int n_segs, double ms);

/* pf_leader.c */
int pf_leader_run(pf_stage *st);

/* pf_follow.c */
int pf_follower_run(pf_stage *st);

#endif
