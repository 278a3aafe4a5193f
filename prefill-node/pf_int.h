/* pf_int.h: the state of one prefill stage process, shared by pf_stage.c (what every
 * stage does: the chain, compute, KV push, reports), pf_leader.c (stage 0: control
 * socket, queue, chunk planning, membership) and pf_follow.c (stages > 0: joining).
 * Not a public interface: see pf_node.h.
 */
#ifndef PF_INT_H
#define PF_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "ctrl.h"
#include "kvx_conn.h"
#include "pf_chunk.h"
#include "pf_link.h"
#include "pf_node.h"
#include "pf_profile.h"
#include "pf_wire.h"
#include "sampler.h"

#define PF_NSEND     2 /* send buffers per stage: a chunk computes while the last one moves */
#define PF_NRECV     2 /* receives posted from the previous stage */
#define PF_TAG_CHAIN 1

/* A request as one stage sees it. */
typedef struct pf_req {
    uint64_t id;
    int32_t n_prompt;
    uint32_t n_dst;
    td_sampling sampling;
    kn_kv_seq kv;  /* this stage's blocks for the whole prompt */
    int32_t *hist; /* last stage: the prompt's ids (for the repetition penalty) */
    int32_t n_hist;
    uint32_t n_chunks;  /* chunks computed */
    int32_t n_sent;     /* tokens whose KV went to the connector */
    int32_t n_computed; /* tokens computed */
    int32_t first_token;
    bool opened;          /* kvx_pf_open done */
    bool finished;        /* kvx_pf_finish done */
    bool failed;          /* no more work; waiting for the connector's final state */
    int fail_err;         /* td_err of a local failure */
    int64_t t_first_ms;   /* first chunk computed here */
    int64_t *comp_end_ns; /* (cap_chunks) CLOCK_MONOTONIC ns when chunk k's compute ended */
    uint32_t cap_chunks;
    struct pf_req *next;
} pf_req;

/* Stage 0's record of a request from the router. */
typedef struct pf_job {
    uint64_t client_id, request_id;
    int32_t *prompt;
    int32_t n_prompt;
    int32_t done; /* tokens scheduled into chunks */
    uint32_t n_chunks;
    uint32_t n_dst;
    td_sampling sampling;
    uint8_t *targets[PF_MAX_TARGETS];
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
    int64_t t_submit_ms, t_start_ms, t_end_ms;
    int32_t *chunk_sizes;
    uint32_t cap_chunks;
    struct pf_job *next;
} pf_job;

typedef struct {
    uint8_t *buf;
    size_t cap;
    pf_op op;
    bool busy;
} pf_buf;

typedef struct {
    const pf_node_params *p;
    const td_cfg_prefill *cfg;
    int stage, pp;
    bool first, last;
    pf_rig rig;
    int n_embd, n_vocab;
    int chunk_max;  /* tokens per chunk at most */
    size_t msg_cap; /* bytes of the largest chain message */
    kvx_conn *kvx;
    int timeout_ms;
    uint64_t boot_id;

    /* the stage chain */
    pf_link *link;
    uint64_t epoch;     /* StageTable epoch this stage runs in; 0: not joined */
    kvx_peer next_peer; /* stage + 1, or -1 */
    kvx_peer lead_peer; /* stage 0 (stages > 0), or -1 */
    uint64_t send_seq, recv_seq;
    pf_buf sends[PF_NSEND];
    pf_buf recvs[PF_NRECV];
    bool broken;                        /* a peer failed: rejoin */
    struct pf_ctl *ctl_head, *ctl_tail; /* TARGETS / ABORT waiting for a send buffer, in order */

    /* requests of this stage */
    pf_req *reqs;
    int n_reqs;

    /* scratch of one chunk */
    int32_t *pos, *seq_of, *tokens;
    float *logits; /* last stage: (PF_MAX_SEGS, n_vocab) */
    float *io;     /* stage 0 with pp 1 / the last stage: no send buffer; scratch output */

    /* stage 0 */
    td_ctrl_server *srv;
    pf_job *jobs; /* FIFO: emitted first, then queued */
    int n_jobs;
    pf_cost_model model;
    pf_chunk_params chunking;
    struct {
        bool present;
        uint64_t boot_id;
        uint8_t addr[KVX_ADDR_MAX];
        size_t addr_len;
        int64_t seen_ms;
    } members[PF_MAX_STAGES];
    kvx_peer member_peer[PF_MAX_STAGES];
    bool running; /* every stage joined (stage 0: table complete) */
    int64_t started_ms;
    uint64_t n_done, n_failed, n_chunks_total;
    double slow_chunk_ms; /* recent longest chunk compute here (decays): heartbeat allowance */

    /* stages > 0 */
    td_ctrl_client *cli;
    uint64_t hello_call;
    int64_t hello_sent_ms;
} pf_node;

int64_t pf_now_ms(void);

/* pf_stage.c */
int pf_stage_setup(pf_node *n);
void pf_stage_teardown(pf_node *n);
int pf_chain_open(pf_node *n);   /* new link (new address) */
void pf_chain_close(pf_node *n); /* drop link and peers */
int pf_chain_start(pf_node *n, const uint8_t *const *addrs, const size_t *lens); /* connect */
/* Compute one chunk (stage 0: from its own plan; others: a received message) and pass it
 * on. segs/ids as in pf_wire; embd NULL on stage 0. */
int pf_stage_chunk(pf_node *n, pf_seg *segs, int n_segs, const int32_t *ids, float *embd);
void pf_stage_targets(pf_node *n, uint64_t req_id, const uint8_t *const *t, const size_t *lens,
                      int n_t);
void pf_stage_abort(pf_node *n, uint64_t req_id, int err);
void pf_stage_abort_all(pf_node *n, int err);
/* Poll the connector for this stage's requests; report the finished ones. */
void pf_stage_poll(pf_node *n);
/* Process received chain messages in order (stages > 0). */
int pf_stage_recv(pf_node *n);
/* Queue a TARGETS or ABORT message for the next stage (copied; no-op on the last stage)
 * and send what the free send buffers allow, without waiting: the loop must keep serving
 * while the next stage is slow or stopped. pf_chain_flush sends more; chunks go only when
 * the queue is empty, so the chain keeps stage 0's order. */
int pf_chain_send_msg(pf_node *n, const void *msg, size_t len);
int pf_chain_flush(pf_node *n); /* 0, or a negative td_err if the link broke */
bool pf_chain_queue_empty(const pf_node *n);
/* Wait (bounded) for a free send buffer; NULL if the link broke. */
pf_buf *pf_chain_free_send(pf_node *n, int timeout_ms);
/* Where a report about req goes: stage 0 handles it itself, others send it. */
void pf_report_out(pf_node *n, const pf_report *r);
/* Wait for link events or fd (stage 0's control socket, -1 none), up to timeout_ms. */
void pf_wait(pf_node *n, int extra_fd, int timeout_ms);

/* pf_leader.c */
int pf_leader_run(pf_node *n);
void pf_leader_on_report(pf_node *n, const pf_report *r);

/* pf_follow.c */
int pf_follower_run(pf_node *n);

#endif
