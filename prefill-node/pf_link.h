/* pf_link.h: the activation plane of a prefill stage: a kvxfer pipe (UCX) driven by its
 * own progress thread, so sends and receives move while the stage computes.
 *
 * Purpose: stage s posts the send of a finished chunk's hidden states to stage s+1 and
 * goes on computing the next chunk at once; without a thread nobody would progress the
 * transfer (over TCP the sender pushes the bytes) until the compute ended. Reports from
 * stages to stage 0 travel as active messages on the same pipe.
 * Operations: every send or receive is a pf_op the caller owns; its completion is seen
 * with pf_op_done (acquire) after the link's eventfd woke the owner. Peer failures are
 * recorded per peer and readable with pf_link_peer_failed.
 * Invariants: a pf_op passed to send/recv must stay alive until it is done (or the link is
 * destroyed: destroy completes every pending op with an error first). The progress thread
 * sleeps on the pipe's event fd when idle (no busy polling).
 * Threading: all functions are called by the stage's main thread; the progress thread
 * takes the same lock for each progress call; callbacks only record and wake.
 * Ownership: the link owns its pipe and thread.
 */
#ifndef PF_LINK_H
#define PF_LINK_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvx_pipe.h"

typedef struct pf_link pf_link;

typedef struct {
    atomic_int done; /* 0 pending, 1 done */
    int status;      /* 0 or a negative td_err */
    size_t len;      /* receive: bytes received */
    pf_link *link;
} pf_op;

#define PF_LINK_MAX_REPORTS 4096
#define PF_LINK_REPORT_MAX  KVX_AM_MAX /* a report or a prompt-logprobs message */

/* tls: UCX transports (the YAML's kvxfer.ucx_tls); host: this stage's host in the YAML,
 * whose network devices the link uses (kvx_pipe_params.host), or NULL. */
int pf_link_create(const char *tls, const char *host, pf_link **out);
void pf_link_destroy(pf_link *l); /* NULL is fine */

int pf_link_address(pf_link *l, void *buf, size_t cap, size_t *len);
int pf_link_connect(pf_link *l, const void *addr, size_t len, kvx_peer *out);

int pf_link_send(pf_link *l, kvx_peer peer, uint64_t tag, const void *buf, size_t len, pf_op *op);
int pf_link_recv(pf_link *l, uint64_t tag, void *buf, size_t cap, pf_op *op);
/* A small report (<= PF_LINK_REPORT_MAX bytes, copied) to a peer, fire and forget; reports
 * to one peer arrive in order. */
int pf_link_report(pf_link *l, kvx_peer peer, const void *buf, size_t len);
/* Take the next received report (copied into buf); false if there is none. */
bool pf_link_take_report(pf_link *l, void *buf, size_t *len);

static inline bool pf_op_done(pf_op *op)
{
    return atomic_load_explicit(&op->done, memory_order_acquire) != 0;
}
static inline void pf_op_reset(pf_op *op)
{
    atomic_store_explicit(&op->done, 0, memory_order_relaxed);
    op->status = 0;
    op->len = 0;
}

/* 0 while the peer is fine, else the error it failed with. */
int pf_link_peer_failed(pf_link *l, kvx_peer peer);
/* An eventfd that is readable when an op completed, a report arrived or a peer failed;
 * pf_link_clear_wake reads it empty. */
int pf_link_wake_fd(const pf_link *l);
void pf_link_clear_wake(pf_link *l);

#endif
