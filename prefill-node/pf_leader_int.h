/* pf_leader_int.h: stage 0's leader state (the router's requests as jobs, the stage chain's
 * members), shared by pf_leader.c (the control socket, the queue, chunk planning, health,
 * the loop) and pf_formation.c (the membership of the stage chain: hellos, the table, the
 * members' silence, re-forming).
 * Not installed; nothing outside those two files includes it. The functions shared between
 * them carry the pfl_ prefix. Threading: the main thread only (pf_leader_run's loop).
 */
#ifndef PF_LEADER_INT_H
#define PF_LEADER_INT_H

#include "ctrl_join.h"
#include "pf_int.h"

/* Stage 0's record of a request from the router. */
typedef struct pf_job {
    uint64_t client_id, request_id;
    int32_t *prompt; /* (n_prompt) token ids */
    int32_t n_prompt;
    int32_t done;       /* tokens scheduled into chunks */
    int32_t n_cached;   /* tokens taken from the prefix cache (decided at its first chunk) */
    uint64_t cached_id; /* the last cached block's id */
    uint64_t epoch;     /* the stage chain its first chunk went down */
    uint32_t n_chunks;
    uint32_t n_dst;
    td_sampling sampling;             /* .grammar: the job's own copy (grammar) */
    char *grammar;                    /* structured output: the schema's text, NULL if none */
    uint8_t *targets[PF_MAX_TARGETS]; /* (n_targets) the decode ranks' kvxfer targets */
    size_t target_len[PF_MAX_TARGETS];
    int n_targets;
    bool targets_sent; /* TARGETS went down the chain (after the first chunk) */
    bool emitted;      /* its first chunk entered the chain */
    bool cancelled;
    uint64_t reported; /* bit s: stage s reported */
    int err;           /* first failure reported (td_err), 0 if none */
    uint32_t fail_reason;
    int fail_stage;
    int32_t first_token;
    bool has_first_lp; /* sampling.logprobs: the last stage's report carried first_lp */
    td_logprob_entry first_lp;
    int64_t t_submit_ms, t_start_ms, t_end_ms;
    uint64_t kv_bytes;                  /* the stages' reports summed */
    uint32_t kv_xfer_us, kv_exposed_us; /* the largest of the stages' reports */
    int32_t chunk0;                     /* its initial chunk size (pf_chunking_initial); 0 */
    int32_t *chunk_sizes;               /* (cap_chunks) tokens of each chunk so far */
    uint32_t cap_chunks;
    struct pf_job *next;
} pf_job;

/* One member of the stage chain as stage 0 knows it (from its StageHello). */
typedef struct {
    bool present;
    uint64_t boot_id;
    uint8_t addr[KVX_ADDR_MAX]; /* (addr_len) its link address */
    size_t addr_len;
    int64_t seen_ms; /* its last hello */
} pf_member;

/* Stage 0's leader state, on top of its stage (st). Owned by the main thread, like the
 * stage: the leader's loop (pf_leader_run) is the only code that touches either. */
typedef struct {
    pf_stage *st;
    td_ctrl_server *srv;
    td_join *join;          /* announcements to the router (router.membership), or NULL */
    bool leaving;           /* SIGTERM with prefill[].drain_timeout_ms: no new prompts, those
                               in flight finish (Health.draining) */
    int64_t leave_until_ms; /* leaving: when the prompts left fail */
    pf_job *jobs;           /* FIFO: emitted first, then queued */
    int n_jobs;
    pf_tune tune; /* the cost model, refitted from every chunk stage 0 computes (pf_tune.h) */
    pf_chunk_params chunking;
    pf_member members[PF_MAX_STAGES]; /* (pp) the current formation */
    bool running;                     /* every stage joined (the table is complete) */
    int64_t started_ms;
    kn_compute_info compute; /* Health 27-33, made before the first */
    uint64_t n_done, n_failed;
    uint64_t cache_hits[PF_MAX_STAGES], cache_evicted[PF_MAX_STAGES]; /* stages' reports */
    int32_t *ids; /* (chunk_max) the token ids of the chunk being planned */
} pf_leader;

/* Ends job j: PrefillDone (err 0) or ErrorEvent (err, why logged) to its client (nothing
 * for a cancelled one), then frees it. */
void pfl_finish_job(pf_leader *ld, pf_job *j, int err, const char *why);
/* The chain is broken (why): every job in it fails and the stages form again. */
void pfl_reset_formation(pf_leader *ld, const char *why);
/* A StageHello from another stage: it joins (or rejoins) the formation; answered with the
 * table of members. */
void pfl_handle_hello(pf_leader *ld, const td_ctrl_server_in *in);
/* Members silent too long, or a broken chain: re-form. */
void pfl_check_members(pf_leader *ld);

#endif
