/* kvx_pipe_ucx_int.h: the UCX pipe's shared state, private to kvx_pipe_ucx*.c.
 *
 * Purpose: the UCX implementation of kvx_pipe.h is split by concern:
 *   kvx_pipe_ucx.c        the context and worker: create, destroy, progress, sleep (the ops table)
 *   kvx_pipe_ucx_peer.c   wire-up: the address, endpoints and peer failure, registrations, rkeys
 *   kvx_pipe_ucx_op.c     operations (put, flush, active messages, tagged messages), their
 *                         completion, and the zombies of failed peers
 *   kvx_pipe_ucx_probe.c  the shared-memory receive FIFO's wedge probe and the worker reset
 *   kvx_pipe_ucx_amput.c  puts and flushes as our own active messages where the transports
 *                         have no remote memory access (tcp): see the top of that file
 *   kvx_pipe_ucx_cma.c    puts over shared memory as writes into the peer process
 *                         (process_vm_writev): see the top of that file
 *
 * Zombies: operations on a peer that failed (or was force-closed) complete with an error in
 * the next progress even when UCX itself never completes them (over shared memory, with
 * UCP_ERR_HANDLING_MODE_NONE, a flush to a process that died stays in flight forever): the
 * owner hears the error, and the operation becomes a *zombie* that keeps its UCX request
 * (and an am_send payload) until UCX completes it or the pipe is destroyed.
 *
 * A wedged receive queue (shared memory): see kvx_pipe_ucx_probe.c.
 *
 * Invariants: p->ops holds the operations whose owner has not heard of them yet (in flight,
 * or done and waiting for progress to deliver them; n_ops counts them); p->zombies holds the
 * ones reported failed whose UCX request is still in flight. A peer slot, once allocated,
 * lives as long as the pipe (ids are indexes); `used` says whether it is taken.
 * Threading: that of kvx_pipe.h (one thread at a time; the worker is serialized).
 */
#ifndef KVX_PIPE_UCX_INT_H
#define KVX_PIPE_UCX_INT_H

#include <sys/uio.h>
#include <ucp/api/ucp.h>

#include "kvx_pipe.h"

typedef struct kvxi_ucx_pipe kvxi_ucx_pipe;

#define KVXI_CMA_IOV 1024 /* puts written per process_vm_writev (the kernel's UIO_MAXIOV) */

/* Shared memory: puts to one peer not yet written into its process (kvx_pipe_ucx_cma.c). */
typedef struct {
    struct iovec l[KVXI_CMA_IOV], r[KVXI_CMA_IOV]; /* sources, destinations (pairwise) */
    struct kvx_rkey *rk[KVXI_CMA_IOV];             /* for the fallback through UCX */
    int n;
    int err; /* a write of an earlier batch failed: the next flush says so */
} kvxi_cma_queue;

typedef struct {
    kvxi_ucx_pipe *pipe;
    ucp_ep_h ep;        /* NULL once closed */
    int status;         /* 0 or the error it failed with */
    bool used;          /* slot taken (until disconnect) */
    bool err_pending;   /* failed, peer_err_cb not yet delivered */
    bool close_needed;  /* failed, ep still to be force-closed */
    int pidfd;          /* shared-memory mode: the peer process (readable once it exited) */
    uint32_t pid;       /* ... and its pid (cma writes) */
    kvxi_cma_queue *cq; /* ... the puts not yet written (NULL until the first) */
    bool am;            /* a key of it wants amputs: flushes are amflushes too */
} kvxi_ucx_peer;

struct kvx_mem {
    ucp_mem_h memh;
    void *base;
    size_t len;
    int fd;          /* kvx_pipe_mem_reg_fd: the file it maps (borrowed), else -1 */
    uint64_t fd_off; /* ... base's offset in it */
    uint64_t key[2]; /* random at registration, travels in its rkey: a put over active
                        messages (amput.c) that does not carry it is refused */
    kvx_mem *next, *prev;
};

struct kvx_rkey {
    ucp_rkey_h rkey;
    kvx_peer peer;
    uint64_t cma_base, cma_len; /* shared memory: the region in the peer process (len 0: none) */
    uint8_t *map;               /* ... mapped here (its file's pages): cma_base's byte, or NULL */
    void *map_addr;             /* ... the mapping (page-aligned) and its length */
    size_t map_len;
    uint64_t key[2]; /* the registration's key (kvx_mem.key), sent with every amput */
    bool am;         /* the receiver takes puts only as amputs (it has no UCX puts) */
    kvx_rkey *next, *prev;
};

/* One asynchronous operation with a user callback. */
typedef struct kvxi_ucx_op {
    kvxi_ucx_pipe *pipe;
    kvx_done_cb cb;
    void *arg;
    int status;
    size_t len;
    bool done;
    bool zombie;   /* reported failed already; waits for UCX to let go of the request */
    kvx_peer peer; /* the endpoint it runs on; -1: none (receives), or no longer tracked */
    void *copy;    /* am_send: the copied payload */
    void *req;     /* the UCX request while in flight (freed by the callback) */
    uint64_t hdr[3];  /* active-message puts and flushes: the message header ({raddr, key}
                         or {seq}) */
    uint64_t ack_seq; /* an active-message flush: the ACK it waits for */
    bool ack_wait;    /* ... not in yet */
    bool acked;       /* ... in (with ack_status) before the FLUSH send completed */
    int ack_status;
    struct kvxi_ucx_op *next, *prev;
} kvxi_ucx_op;

#define KVXI_UCX_PROBE_AM_ID                                                                       \
    KVX_AM_IDS                  /* the wedge probe's active message id (users have 0..7)           \
                                 */
#define KVXI_UCX_AMPUT_ID   (KVX_AM_IDS + 1) /* kvx_pipe_ucx_amput.c: PUT, FLUSH, ACK */
#define KVXI_UCX_AMFLUSH_ID (KVX_AM_IDS + 2)
#define KVXI_UCX_AMACK_ID   (KVX_AM_IDS + 3)
#define KVXI_UCX_BAD_MAX    64 /* senders whose puts outside the registrations are counted */
#define KVXI_RKEY_AM_ONLY   1u /* rkey flag: the receiver takes puts only as amputs */
#define KVXI_UCX_PEER_GONE (-2) /* kvxi_ucx_op.peer: its endpoint was force-closed */

/* A sender of active-message puts that fell outside every registration (amput.c). */
typedef struct {
    ucp_ep_h ep; /* its reply endpoint */
    uint32_t n;  /* bad puts since its last flush */
} kvxi_ucx_bad;

/* A user's active message handler (kvx_pipe_set_am_handler). */
typedef struct {
    kvx_am_cb cb;
    void *arg;
} kvxi_ucx_am;

struct kvxi_ucx_pipe {
    kvx_pipe base;
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_worker_h *retired; /* (n_retired) wedged workers, destroyed with the pipe */
    int n_retired;
    bool can_reset;       /* kvx_pipe_allow_reset: the owner copes with a new address */
    uint32_t gen;         /* workers replaced */
    ucp_worker_h probe_w; /* shared memory: sends the wedge probe (created on first use) */
    ucp_ep_h probe_ep;    /* probe_w -> worker (NULL until needed, and after a reset) */
    uint64_t probe_seq;   /* last probe sent */
    uint64_t probe_got;   /* last probe received */
    uint64_t probe_buf;   /* the payload of the probe in flight */
    bool probe_wanted;    /* a peer died: probe at the next progress */
    bool probing;         /* probe probe_seq in flight */
    bool wedge_logged;    /* no reset allowed: the wedge was reported */
    int64_t probe_deadline;
    int probe_rounds; /* progress calls since the probe was sent */
    int efd;          /* the worker's event fd */
    int epfd;         /* what sleepers wait on: efd + the peers' pidfds */
    bool shm;         /* shared-memory transports only: liveness by pidfd, not by UCX */
    bool am_puts;     /* puts and flushes as our own active messages (amput.c) */
    bool cma_puts;    /* shared memory: puts written into the peer process (cma.c) */
    bool map_puts;    /* ... or copied into a mapping of its memory's file, where it has one */
    bool map_logged;  /* a mapping failed: said once */
    uint64_t amflush_seq;                 /* last active-message flush sent */
    kvxi_ucx_bad bad[KVXI_UCX_BAD_MAX];   /* receiver: senders with bad puts */
    int n_bad;
    void **closing;   /* (n_closing) endpoint close requests still in progress */
    int n_closing;
    kvx_pipe_params params;
    kvxi_ucx_peer **peers; /* (n_peers) slots, each allocated once */
    int n_peers;
    kvx_mem *mems;
    kvx_rkey *rkeys;
    int n_mems, n_rkeys;
    kvxi_ucx_op *ops; /* pending and completed-not-delivered operations */
    int n_ops;
    kvxi_ucx_op *zombies; /* reported operations whose UCX request is still in flight */
    bool any_done;        /* some op in the list is done */
    kvxi_ucx_am am[KVX_AM_IDS];
};

/* UCX status -> td_err. */
int kvxi_ucx_err(ucs_status_t st);

/* --- kvx_pipe_ucx.c -------------------------------------------------------------------- */

/* A worker in serialized mode; with efd, its event fd and every active message handler
 * (the probe's and the users') registered. On error *w is NULL. */
ucs_status_t kvxi_ucx_worker_open(kvxi_ucx_pipe *p, ucp_worker_h *w, int *efd);

/* --- kvx_pipe_ucx_peer.c --------------------------------------------------------------- */

int kvxi_ucx_address(kvx_pipe *base, void *buf, size_t cap, size_t *len);
int kvxi_ucx_connect(kvx_pipe *base, const void *addr, size_t len, kvx_peer *out);
void kvxi_ucx_disconnect(kvx_pipe *base, kvx_peer peer, bool force);
int kvxi_ucx_peer_status(kvx_pipe *base, kvx_peer peer);
int kvxi_ucx_mem_reg(kvx_pipe *base, void *addr, size_t len, kvx_mem **out);
int kvxi_ucx_mem_reg_fd(kvx_pipe *base, void *addr, size_t len, int fd, uint64_t off,
                        kvx_mem **out);
void kvxi_ucx_mem_dereg(kvx_pipe *base, kvx_mem *m);
int kvxi_ucx_rkey_pack(kvx_pipe *base, kvx_mem *m, void *buf, size_t cap, size_t *len);
int kvxi_ucx_rkey_unpack(kvx_pipe *base, kvx_peer peer, const void *buf, size_t len,
                         kvx_rkey **out);
void kvxi_ucx_rkey_destroy(kvx_pipe *base, kvx_rkey *rk);
/* The peer slot of id, or NULL if id is not a connected peer. */
kvxi_ucx_peer *kvxi_ucx_peer_get(kvxi_ucx_pipe *p, kvx_peer id);
/* Close an endpoint; force: do not flush (peer gone). A graceful close finishes in later
 * progress calls (kept in p->closing). */
void kvxi_ucx_ep_close(kvxi_ucx_pipe *p, kvxi_ucx_peer *pr, bool force);
/* Release the close requests that completed. */
void kvxi_ucx_reap_closing(kvxi_ucx_pipe *p);
/* Shared-memory mode: peers whose process exited fail (returns how many newly). */
int kvxi_ucx_check_pids(kvxi_ucx_pipe *p);
/* Stop watching a peer's process (no-op without a pidfd). */
void kvxi_ucx_pidfd_close(kvxi_ucx_pipe *p, kvxi_ucx_peer *pr);

/* --- kvx_pipe_ucx_op.c ----------------------------------------------------------------- */

int kvxi_ucx_put(kvx_pipe *base, kvx_peer peer, const void *src, size_t len, uint64_t raddr,
                 kvx_rkey *rk);
int kvxi_ucx_flush(kvx_pipe *base, kvx_peer peer, kvx_done_cb cb, void *arg);
/* A put through UCX's ucp_put_nbx (completed by a later flush). */
int kvxi_ucx_rma_put(ucp_ep_h ep, const void *src, size_t len, uint64_t raddr, kvx_rkey *rk);
int kvxi_ucx_set_am_handler(kvx_pipe *base, unsigned id, kvx_am_cb cb, void *arg);
int kvxi_ucx_am_send(kvx_pipe *base, kvx_peer peer, unsigned id, const void *buf, size_t len,
                     kvx_done_cb cb, void *arg);
int kvxi_ucx_tag_send(kvx_pipe *base, kvx_peer peer, uint64_t tag, const void *buf, size_t len,
                      kvx_done_cb cb, void *arg);
int kvxi_ucx_tag_recv(kvx_pipe *base, uint64_t tag, void *buf, size_t cap, kvx_done_cb cb,
                      void *arg);
/* The UCX receive handler of a user's active message id (arg: its kvxi_ucx_am). */
ucs_status_t kvxi_ucx_am_recv(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                              const ucp_am_recv_param_t *prm);
/* A new operation on the pipe's list (cb may be NULL: nobody is told). */
kvxi_ucx_op *kvxi_ucx_op_new(kvxi_ucx_pipe *p, kvx_peer peer, kvx_done_cb cb, void *arg);
/* Mark an operation done (its callback runs in the next kvxi_ucx_deliver_done). */
void kvxi_ucx_op_complete(kvxi_ucx_op *op, int status, size_t len);
/* Finish an nbx call: NULL (done at once), an error (op freed, error returned), or a
 * request that calls back later (kept in op->req). */
int kvxi_ucx_op_started(kvxi_ucx_op *op, ucs_status_ptr_t sp, const char *what);
/* UCX's send callback of an operation (user data: the op): done with the send's status. */
void kvxi_ucx_send_cb(void *req, ucs_status_t st, void *user);
/* Take an operation off its list and free it (and its am_send payload). */
void kvxi_ucx_op_unlink(kvxi_ucx_op *op);
/* Report an operation in flight as failed with status (its callback runs now) and keep it
 * as a zombie until UCX lets go of its request. */
void kvxi_ucx_op_zombify(kvxi_ucx_op *op, int status);
/* Run the callbacks of the operations that completed; returns how many ran. */
int kvxi_ucx_deliver_done(kvxi_ucx_pipe *p);
/* Report the operations still in flight on failed or force-closed endpoints; returns how
 * many were reported. */
int kvxi_ucx_orphan_ops(kvxi_ucx_pipe *p);

/* --- kvx_pipe_ucx_amput.c -------------------------------------------------------------- */

/* A put / a flush of peer as active messages (p->am_puts). */
int kvxi_ucx_amput(kvxi_ucx_pipe *p, kvx_peer peer, ucp_ep_h ep, const void *src, size_t len,
                   uint64_t raddr, const kvx_rkey *rk);
int kvxi_ucx_amflush(kvxi_ucx_pipe *p, kvx_peer peer, ucp_ep_h ep, kvx_done_cb cb, void *arg);
/* The UCX receive handlers of PUT, FLUSH and ACK (arg: the pipe). */
ucs_status_t kvxi_ucx_amput_recv(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                                 const ucp_am_recv_param_t *prm);
ucs_status_t kvxi_ucx_amflush_recv(void *arg, const void *hdr, size_t hlen, void *data,
                                   size_t len, const ucp_am_recv_param_t *prm);
ucs_status_t kvxi_ucx_amack_recv(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                                 const ucp_am_recv_param_t *prm);

/* --- kvx_pipe_ucx_cma.c ---------------------------------------------------------------- */

/* The key header of a shared-memory pipe's rkey (this process, m's bounds and file): its
 * length, or 0 if cap is too small. */
size_t kvxi_ucx_cma_key_write(const kvx_mem *m, void *buf, size_t cap);
/* Read that header in front of UCX's rkey bytes: its length (0: malformed). When the key is
 * pr's process's own, rk takes the bounds, and maps the region's file if it has one (and
 * p->map_puts). */
size_t kvxi_ucx_cma_key_read(kvxi_ucx_pipe *p, kvx_rkey *rk, const kvxi_ucx_peer *pr,
                             const void *buf, size_t len);
/* Unmap rk's mapping of the peer's file (no-op without one). */
void kvxi_ucx_cma_unmap(kvx_rkey *rk);
/* A put of [src, src + len) at raddr of pr's process (rk->cma_len > 0): copied at once
 * into rk's mapping of the peer's file, or queued for a write into the process. TD_EINVAL:
 * outside the region, nothing copied or queued. */
int kvxi_ucx_cma_put(kvxi_ucx_pipe *p, kvxi_ucx_peer *pr, const void *src, size_t len,
                     uint64_t raddr, kvx_rkey *rk);
/* Write pr's queued puts (if the kernel refuses, p->cma_puts goes off and they go through
 * UCX). 0, or the first error since the last drain (the queue is empty either way). */
int kvxi_ucx_cma_drain(kvxi_ucx_pipe *p, kvxi_ucx_peer *pr);
void kvxi_ucx_cma_free(kvxi_ucx_peer *pr); /* the queue's memory */

/* --- kvx_pipe_ucx_probe.c -------------------------------------------------------------- */

/* The UCX receive handler of the probe (arg: the pipe). */
ucs_status_t kvxi_ucx_probe_recv(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                                 const ucp_am_recv_param_t *prm);
/* Shared memory, every progress: after a peer death, send the probe; judge it once it had
 * its time (replacing the worker if it is wedged and kvx_pipe_allow_reset was called). */
void kvxi_ucx_probe_step(kvxi_ucx_pipe *p);
/* Force-close the probe's endpoint (NULL is fine). */
void kvxi_ucx_probe_ep_close(kvxi_ucx_pipe *p);

#endif
