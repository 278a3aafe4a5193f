/* pf_chain.h: the stage chain of one prefill stage: the ordered stream of chain messages
 * (pf_wire.h: CHUNK, TARGETS, ABORT) from stage s to stage s + 1 over the activation link
 * (pf_link.h), and the reports from stages s > 0 to stage 0.
 *
 * Purpose: the transport only. What a message means (compute, KV push, sampling) is the
 * stage's business (pf_int.h); who is in the chain is stage 0's (pf_leader.c) or the
 * follower's (pf_follow.c), which hand the members' addresses to pf_chain_start.
 * Life: pf_chain_init (buffers) -> pf_chain_open (a new link, a new address) ->
 * pf_chain_start (connect the neighbours, post the receives) -> ... -> pf_chain_close
 * (drop the link and everything queued for it; the next formation opens a new one) ->
 * pf_chain_fini.
 * Invariants: every message on the chain carries a per-hop sequence number (pf_wire header
 * bytes 8..15) stamped here when it is sent; receives may complete out of order, and
 * pf_chain_next hands them out in sequence order. Chunks are sent only when no control
 * message waits (pf_chain_queue_empty), so stage 0's order is kept down the chain. A send
 * buffer is reused only after its send completed. `broken` becomes true when a send,
 * receive or neighbour fails; the owner then re-forms the chain (it may also set it).
 * Threading: called from the stage's main thread only; the link's progress thread
 * completes the pf_ops and wakes pf_chain_wait.
 * Ownership: the chain owns its link, buffers and queued messages; a pf_buf handed out by
 * pf_chain_free_send or pf_chain_next stays the chain's.
 */
#ifndef PF_CHAIN_H
#define PF_CHAIN_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pf_chunk.h"
#include "pf_link.h"
#include "pf_wire.h"

#define PF_NSEND     2 /* send buffers per stage: a chunk computes while the last one moves */
#define PF_NRECV     2 /* receives posted from the previous stage */
#define PF_TAG_CHAIN 1

typedef struct {
    uint8_t *buf; /* (cap) bytes, 64-byte aligned: one chain message */
    size_t cap;
    pf_op op;
    bool busy; /* a send or receive on buf is in flight (or, a receive, not yet handled) */
} pf_buf;

typedef struct pf_ctl pf_ctl; /* a control message waiting for a send buffer (pf_chain.c) */

typedef struct {
    /* fixed by pf_chain_init */
    const char *instance; /* for log lines */
    int stage, pp;
    bool first, last;
    const char *tls;             /* UCX transports of the link */
    const char *host;            /* this stage's host in the YAML: the link's network devices */
    volatile sig_atomic_t *stop; /* pf_chain_free_send gives up when it becomes non-zero */
    pf_buf sends[PF_NSEND];      /* stages but the last */
    pf_buf recvs[PF_NRECV];      /* stages but the first */

    /* one formation: pf_chain_open .. pf_chain_close */
    pf_link *link;                       /* NULL: closed */
    kvx_peer next_peer;                  /* stage + 1, or -1 */
    kvx_peer lead_peer;                  /* stage 0 (stages > 0), or -1 */
    kvx_peer member_peer[PF_MAX_STAGES]; /* stage 0: every other stage, or -1 */
    uint64_t send_seq, recv_seq;         /* next sequence number out / expected in */
    bool broken;                         /* a peer failed: re-form */
    pf_ctl *ctl_head, *ctl_tail;         /* TARGETS / ABORT waiting for a send buffer, in order */
} pf_chain;

typedef struct {
    const char *instance;
    int stage, pp;
    bool first, last;
    const char *tls;
    const char *host; /* this stage's host (kvx_pipe_params.host), or NULL */
    size_t msg_cap;   /* bytes of the largest chain message */
    volatile sig_atomic_t *stop;
} pf_chain_params;

/* Allocate the buffers (no link yet). Returns 0 or TD_ENOMEM (pf_chain_fini cleans up). */
int pf_chain_init(pf_chain *c, const pf_chain_params *p);
void pf_chain_fini(pf_chain *c); /* closes the chain; safe on a zeroed chain */

int pf_chain_open(pf_chain *c);   /* new link (new address) */
void pf_chain_close(pf_chain *c); /* drop link, peers and queued messages */
/* Connect: stage 0 to every stage, others to stage 0 and the next stage; post the
 * receives. addrs/lens: (pp) the members' link addresses. Logs a failure. */
int pf_chain_start(pf_chain *c, const uint8_t *const *addrs, const size_t *lens);
/* This stage's link address (for the StageTable / StageHello). */
int pf_chain_address(pf_chain *c, void *buf, size_t cap, size_t *len);

/* Wait for link events or fd (stage 0's control socket, -1 none), up to timeout_ms. */
void pf_chain_wait(pf_chain *c, int extra_fd, int timeout_ms);
/* Stage 0: stage s is unreachable. */
bool pf_chain_stage_failed(pf_chain *c, int s);
/* Stages > 0: stage 0 or the next stage is unreachable. */
bool pf_chain_neighbour_failed(pf_chain *c);

/* ---- sending ---- */
/* Wait (bounded; 0: just look) for a free send buffer; NULL if the link broke, time ran
 * out or *stop was set. */
pf_buf *pf_chain_free_send(pf_chain *c, int timeout_ms);
/* Send len bytes of b (from pf_chain_free_send) to the next stage, stamped with the next
 * sequence number. Returns 0 or a negative td_err (the chain is broken). */
int pf_chain_post(pf_chain *c, pf_buf *b, size_t len);
/* Queue a TARGETS or ABORT message for the next stage (copied; no-op on the last stage)
 * and send what the free send buffers allow, without waiting: the loop must keep serving
 * while the next stage is slow or stopped. pf_chain_flush sends more. */
int pf_chain_send_msg(pf_chain *c, const void *msg, size_t len);
int pf_chain_flush(pf_chain *c); /* 0, or a negative td_err if the link broke */
bool pf_chain_queue_empty(const pf_chain *c);

/* ---- receiving (stages > 0) ---- */
/* The next message in sequence order: 1 and *out (its length in (*out)->op.len), 0 if it
 * has not arrived, or a negative td_err if a receive failed (logged; the chain is broken).
 * The caller handles it, then calls pf_chain_recv_done. */
int pf_chain_next(pf_chain *c, pf_buf **out);
/* Done with b: the sequence moves on and b's receive is posted again; err != 0 (the
 * caller's failure to handle it: logged here) breaks the chain instead. Returns err, or
 * the repost's error. */
int pf_chain_recv_done(pf_chain *c, pf_buf *b, int err);

/* ---- reports ---- */
/* Stages > 0: send a report to stage 0 (fire and forget; nothing without a chain). */
void pf_chain_report(pf_chain *c, const pf_report *r);
/* The last stage (> 0): a LOGPROBS message (pf_wire) to stage 0, as a report. */
void pf_chain_report_msg(pf_chain *c, const void *msg, size_t len);
/* Stage 0: the next well-formed message the other stages sent, in arrival order (a
 * stage's messages arrive in the order it sent them): PF_MSG_REPORT into *rep, or
 * PF_MSG_LOGPROBS copied into lp (PF_LINK_REPORT_MAX bytes), *lp_len bytes; 0 if none. */
uint32_t pf_chain_take_report(pf_chain *c, pf_report *rep, uint8_t *lp, size_t *lp_len);

#endif
