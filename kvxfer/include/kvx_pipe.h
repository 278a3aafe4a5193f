/* kvx_pipe.h: the bottom layer of kvxfer: moves bytes between two processes.
 *
 * Purpose: one ops table (kvx_pipe_ops) for everything the upper layers need from a
 * transport: the local address and memory keys exported as opaque bytes, endpoints to
 * peers created from those bytes, one-sided puts into a registered remote region, a
 * per-peer flush, small active messages (notifications), tagged send/receive of buffers
 * (stage-to-stage activations) and peer-failure reporting. Two implementations fill the
 * table: UCX (kvx_pipe_ucx_create, the real one; UCX_TLS picks the transports) and an
 * in-process fake (kvx_pipe_fake_create, for unit tests and fault injection).
 *
 * Invariants:
 * - Exported bytes (address, rkey) start with a magic and a version and carry their
 *   length; importing malformed bytes returns TD_EINVAL/TD_EFORMAT, never crashes.
 * - Every asynchronous operation that returned 0 calls its callback exactly once, from
 *   kvx_pipe_progress (never from inside the call that started it), with 0 or a negative
 *   td_err. An operation that returned an error never calls its callback.
 * - A put has no callback: it is complete once a later flush of the same peer completed
 *   (with 0). Its source buffer must stay valid and unchanged until then.
 * - After a peer failed (its endpoint reported an error, or kvx_pipe_disconnect), every
 *   pending operation on it completes with an error and new ones return TD_EIO. The peer
 *   id stays reserved until kvx_pipe_disconnect; peer_err_cb is called once per peer.
 * - An idle pipe does not spin: kvx_pipe_wait sleeps on an event fd (UCX: the worker's
 *   fd after ucp_worker_arm) until something happens or the timeout passes. (UCX over
 *   shared memory: a peer's death is seen by the next progress call, so sleepers should
 *   wake at least every few hundred ms; the connector's waits do.)
 * - A graceful disconnect does not block: UCX finishes the close in later progress calls
 *   (destroy waits for it briefly, then leaves it to UCX).
 *
 * Threading: not thread-safe. One thread at a time (the owner, or the owner's progress
 * thread under the owner's lock) calls into a pipe; the UCX worker is created in
 * serialized mode. Exceptions: kvx_pipe_signal and waiting on kvx_pipe_event_fd may be
 * done from any thread. Callbacks run inside kvx_pipe_progress on the calling thread and
 * must only record and wake.
 *
 * Ownership: kvx_pipe_destroy closes every endpoint (pending operations complete with an
 * error first), releases rkeys and registrations still alive, and frees the pipe. A
 * registered region is borrowed: the caller keeps it mapped until kvx_pipe_mem_dereg.
 * Buffers of am_send are copied (the caller may reuse them at once); buffers of put,
 * tag_send and tag_recv are borrowed until completion.
 */
#ifndef KVX_PIPE_H
#define KVX_PIPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_err.h"

typedef struct kvx_pipe kvx_pipe;
typedef struct kvx_mem kvx_mem;   /* a local registered region */
typedef struct kvx_rkey kvx_rkey; /* a remote region's key, usable with one peer */
typedef int32_t kvx_peer;         /* >= 0; index of an endpoint inside its pipe */

#define KVX_ADDR_MAX 4096 /* bytes: upper bound of an exported address */
#define KVX_RKEY_MAX 1024 /* bytes: upper bound of an exported rkey */
#define KVX_AM_MAX   4096 /* bytes: largest active message */
#define KVX_AM_IDS   8    /* active message ids are 0..KVX_AM_IDS-1 */

/* Completion of an asynchronous operation: status 0 or a negative td_err; for a tag
 * receive, len is the number of bytes received (0 otherwise). */
typedef void (*kvx_done_cb)(void *arg, int status, size_t len);
/* An active message arrived: data is valid only during the call. */
typedef void (*kvx_am_cb)(void *arg, const void *data, size_t len);
/* A peer failed (once per peer): status is a negative td_err. */
typedef void (*kvx_peer_err_cb)(void *arg, kvx_peer peer, int status);

typedef struct {
    kvx_peer_err_cb peer_err_cb; /* may be NULL */
    void *peer_err_arg;
    /* UCX only: transports (like UCX_TLS; NULL or "": the environment's UCX_TLS or UCX's
     * default) and the keepalive interval for dead-peer detection (0: 1000 ms).
     * Network transports: endpoints use UCP_ERR_HANDLING_MODE_PEER (UCX reports a dead
     * peer). Shared-memory-only lists (sm, posix, sysv, cma, knem, xpmem, self): UCX 1.13
     * has no peer-failure support there, so endpoints use mode NONE and a peer's death is
     * seen through a pidfd of its process (the address carries the pid). Both peers must
     * be in the same mode (connect says TD_EUNSUPP otherwise); their puts are copied
     * straight into the peer's memory, through a mapping of its file where the region was
     * registered with one (kvx_pipe_mem_reg_fd), else with process_vm_writev
     * (kvx_pipe_ucx_cma.c; KVX_UCX_PUTS=cma: always the writes, rma: UCX's emulated puts, as
     * where the kernel refuses both). Network pipes without an
     * RDMA transport (tcp) carry puts and flushes as their own active messages, not UCX's
     * puts (kvx_pipe_ucx_amput.c says why; KVX_UCX_PUTS=am|rma in the environment
     * decides instead). */
    const char *tls;
    int keepalive_ms;
    /* UCX only: elements of the posix and sysv transports' receive FIFO (each carries up to
     * one 8 KiB fragment; UCX's puts into memory it did not allocate travel as such fragments,
     * which matters where the pipe falls back to them).
     * 0: KVX_SHM_FIFO_DEFAULT, unless UCX_POSIX_FIFO_SIZE / UCX_SYSV_FIFO_SIZE is set in the
     * environment (UCX's own default is 64: on a loaded machine a sender then stalls every
     * 512 KiB until the receiver is scheduled again; 4096 costs ~17 MB more resident memory
     * per process than 64, 1024 ~4 MB, and moved a chunk 1.4-2.4x faster than 1024 under
     * load, BENCHMARKS.md) */
    int shm_fifo_size;
    /* UCX only: the host the cluster YAML gives this process's instance (decode[].host, the
     * prefill stage's hosts[] entry). Network transports then use only the device(s) that
     * carry its address (UCX's NET_DEVICES, from kvx_net_devices_for_host: 127.0.0.1 -> lo),
     * so the KV plane listens and connects on the cluster's addresses only; the choice is
     * logged. NULL, or an address no device has (a NAT's, a name that does not resolve
     * here: a warning), or a wildcard (0.0.0.0, ::): every device, as UCX picks them. The
     * environment's UCX_NET_DEVICES wins over it; shared-memory-only lists have no network
     * device to choose. */
    const char *host;
} kvx_pipe_params;

#define KVX_SHM_FIFO_DEFAULT 4096

/* Statistics for leak checks: what is alive right now. */
typedef struct {
    int peers;       /* endpoints not yet disconnected (failed ones included) */
    int mems;        /* registrations */
    int rkeys;       /* unpacked rkeys */
    int pending_ops; /* operations whose callback has not run yet */
} kvx_pipe_stats;

typedef struct {
    const char *name;
    void (*destroy)(kvx_pipe *p);
    int (*address)(kvx_pipe *p, void *buf, size_t cap, size_t *len);
    int (*connect)(kvx_pipe *p, const void *addr, size_t len, kvx_peer *out);
    void (*disconnect)(kvx_pipe *p, kvx_peer peer, bool force);
    int (*peer_status)(kvx_pipe *p, kvx_peer peer);
    int (*mem_reg)(kvx_pipe *p, void *base, size_t len, kvx_mem **out);
    /* optional (NULL: mem_reg): base..base+len is bytes off.. of the file fd, mapped shared */
    int (*mem_reg_fd)(kvx_pipe *p, void *base, size_t len, int fd, uint64_t off, kvx_mem **out);
    void (*mem_dereg)(kvx_pipe *p, kvx_mem *m);
    int (*rkey_pack)(kvx_pipe *p, kvx_mem *m, void *buf, size_t cap, size_t *len);
    int (*rkey_unpack)(kvx_pipe *p, kvx_peer peer, const void *buf, size_t len, kvx_rkey **out);
    void (*rkey_destroy)(kvx_pipe *p, kvx_rkey *rk);
    int (*put)(kvx_pipe *p, kvx_peer peer, const void *src, size_t len, uint64_t raddr,
               kvx_rkey *rk);
    int (*flush)(kvx_pipe *p, kvx_peer peer, kvx_done_cb cb, void *arg);
    int (*set_am_handler)(kvx_pipe *p, unsigned id, kvx_am_cb cb, void *arg);
    int (*am_send)(kvx_pipe *p, kvx_peer peer, unsigned id, const void *buf, size_t len,
                   kvx_done_cb cb, void *arg);
    int (*tag_send)(kvx_pipe *p, kvx_peer peer, uint64_t tag, const void *buf, size_t len,
                    kvx_done_cb cb, void *arg);
    int (*tag_recv)(kvx_pipe *p, uint64_t tag, void *buf, size_t cap, kvx_done_cb cb, void *arg);
    int (*progress)(kvx_pipe *p);
    int (*arm)(kvx_pipe *p);
    int (*event_fd)(kvx_pipe *p);
    void (*signal)(kvx_pipe *p);
    void (*stats)(kvx_pipe *p, kvx_pipe_stats *out);
    /* optional (NULL: never replaces its worker, generation 0): see kvx_pipe_allow_reset */
    void (*allow_reset)(kvx_pipe *p);
    uint32_t (*generation)(kvx_pipe *p);
} kvx_pipe_ops;

/* Every implementation embeds this as its first member. */
struct kvx_pipe {
    const kvx_pipe_ops *ops;
};

/* --- constructors -------------------------------------------------------------------- */

/* A UCX pipe (context + one worker). TD_EIO if UCX cannot start. */
int kvx_pipe_ucx_create(const kvx_pipe_params *params, kvx_pipe **out);

/* The network devices (interface names, comma-separated as UCX_NET_DEVICES takes them) that
 * carry host's address (a name is resolved first): a loopback address (127.0.0.0/8, ::1)
 * -> the loopback device(s) ("lo"); any other -> the interfaces that hold that address.
 * TD_EINVAL for "" or a wildcard (0.0.0.0, ::: every device), TD_ENOENT when no device
 * of this host has the address or the name does not resolve, TD_ERANGE if buf is small,
 * TD_EIO if the interfaces cannot be listed. kvx_netdev.c. */
int kvx_net_devices_for_host(const char *host, char *buf, size_t cap);

/* The fake: pipes created on the same fabric reach each other in-process. Puts copy at
 * once (bounds-checked against the registration); flushes, messages and receive
 * completions are delivered by the target's progress. */
typedef struct kvx_fake_fabric kvx_fake_fabric;
int kvx_fake_fabric_create(kvx_fake_fabric **out);
void kvx_fake_fabric_destroy(kvx_fake_fabric *f); /* after its pipes; NULL is fine */
int kvx_pipe_fake_create(kvx_fake_fabric *f, const kvx_pipe_params *params, kvx_pipe **out);
/* Fault injection: the pipe dies (as if its process were killed): peers of it see an
 * error; it stops delivering anything. The object stays valid until destroyed. */
void kvx_pipe_fake_kill(kvx_pipe *p);
/* Fault injection: fail the pipe's puts after `n` more succeed (-1: never). */
void kvx_pipe_fake_fail_puts_after(kvx_pipe *p, int n);
/* Count of puts the pipe has issued (successful or not). */
uint64_t kvx_pipe_fake_puts(kvx_pipe *p);

/* --- calls (see the ops table; errors are negative td_err) --------------------------- */

static inline void kvx_pipe_destroy(kvx_pipe *p)
{
    if (p) p->ops->destroy(p);
}
/* Export this pipe's address (opaque bytes, at most KVX_ADDR_MAX). */
static inline int kvx_pipe_address(kvx_pipe *p, void *buf, size_t cap, size_t *len)
{
    return p->ops->address(p, buf, cap, len);
}
/* Create an endpoint from a peer's exported address. */
static inline int kvx_pipe_connect(kvx_pipe *p, const void *addr, size_t len, kvx_peer *out)
{
    return p->ops->connect(p, addr, len, out);
}
/* Close an endpoint and free its id. Graceful (flushes first, bounded) unless force or
 * the peer failed: then pending operations complete with an error at once. */
static inline void kvx_pipe_disconnect(kvx_pipe *p, kvx_peer peer, bool force)
{
    p->ops->disconnect(p, peer, force);
}
/* 0 while the peer is usable, else the error it failed with. */
static inline int kvx_pipe_peer_status(kvx_pipe *p, kvx_peer peer)
{
    return p->ops->peer_status(p, peer);
}
static inline int kvx_pipe_mem_reg(kvx_pipe *p, void *base, size_t len, kvx_mem **out)
{
    return p->ops->mem_reg(p, base, len, out);
}
/* Register memory that is a shared mapping of a file (shm segment, memfd): base..base+len
 * holds the file's bytes off..off+len. A writer on the same host may then map the file
 * itself (UCX shared-memory pipes: its puts become plain copies, kvx_pipe_ucx_cma.c). fd is
 * borrowed (open until mem_dereg); fd < 0, or a pipe without the op: kvx_pipe_mem_reg. */
static inline int kvx_pipe_mem_reg_fd(kvx_pipe *p, void *base, size_t len, int fd, uint64_t off,
                                      kvx_mem **out)
{
    if (fd < 0 || !p->ops->mem_reg_fd) return p->ops->mem_reg(p, base, len, out);
    return p->ops->mem_reg_fd(p, base, len, fd, off, out);
}
static inline void kvx_pipe_mem_dereg(kvx_pipe *p, kvx_mem *m)
{
    if (m) p->ops->mem_dereg(p, m);
}
/* Export a registration's remote key (opaque bytes, at most KVX_RKEY_MAX). */
static inline int kvx_pipe_rkey_pack(kvx_pipe *p, kvx_mem *m, void *buf, size_t cap, size_t *len)
{
    return p->ops->rkey_pack(p, m, buf, cap, len);
}
static inline int kvx_pipe_rkey_unpack(kvx_pipe *p, kvx_peer peer, const void *buf, size_t len,
                                       kvx_rkey **out)
{
    return p->ops->rkey_unpack(p, peer, buf, len, out);
}
static inline void kvx_pipe_rkey_destroy(kvx_pipe *p, kvx_rkey *rk)
{
    if (rk) p->ops->rkey_destroy(p, rk);
}
/* Start a put of len bytes from src to raddr (an address inside the remote region). */
static inline int kvx_pipe_put(kvx_pipe *p, kvx_peer peer, const void *src, size_t len,
                               uint64_t raddr, kvx_rkey *rk)
{
    return p->ops->put(p, peer, src, len, raddr, rk);
}
/* Complete every put issued to the peer before this call; cb gets the outcome. */
static inline int kvx_pipe_flush(kvx_pipe *p, kvx_peer peer, kvx_done_cb cb, void *arg)
{
    return p->ops->flush(p, peer, cb, arg);
}
/* Install the handler of active message id (< KVX_AM_IDS); NULL removes it. */
static inline int kvx_pipe_set_am_handler(kvx_pipe *p, unsigned id, kvx_am_cb cb, void *arg)
{
    return p->ops->set_am_handler(p, id, cb, arg);
}
/* Send a small message (<= KVX_AM_MAX bytes, copied); cb may be NULL. Messages to one
 * peer arrive in order, and after the puts a completed flush covered. */
static inline int kvx_pipe_am_send(kvx_pipe *p, kvx_peer peer, unsigned id, const void *buf,
                                   size_t len, kvx_done_cb cb, void *arg)
{
    return p->ops->am_send(p, peer, id, buf, len, cb, arg);
}
static inline int kvx_pipe_tag_send(kvx_pipe *p, kvx_peer peer, uint64_t tag, const void *buf,
                                    size_t len, kvx_done_cb cb, void *arg)
{
    return p->ops->tag_send(p, peer, tag, buf, len, cb, arg);
}
/* Receive the next message with exactly this tag into buf (TD_ERANGE in cb if larger). */
static inline int kvx_pipe_tag_recv(kvx_pipe *p, uint64_t tag, void *buf, size_t cap,
                                    kvx_done_cb cb, void *arg)
{
    return p->ops->tag_recv(p, tag, buf, cap, cb, arg);
}
/* Run pending completions and handlers without blocking; returns how many ran (>= 0), plus
 * one when the transport moved data that completes nothing here (a put arriving, a queued
 * fragment sent): a caller that sleeps only after a 0 stays awake while data flows. */
static inline int kvx_pipe_progress(kvx_pipe *p)
{
    return p->ops->progress(p);
}
/* Prepare to sleep: 1 if the event fd will fire on the next event (safe to sleep), 0 if
 * events are already pending (progress first). */
static inline int kvx_pipe_arm(kvx_pipe *p)
{
    return p->ops->arm(p);
}
/* The fd that becomes readable when an armed pipe has an event or was signalled. */
static inline int kvx_pipe_event_fd(kvx_pipe *p)
{
    return p->ops->event_fd(p);
}
/* Wake a thread sleeping on the event fd (any thread). */
static inline void kvx_pipe_signal(kvx_pipe *p)
{
    p->ops->signal(p);
}
static inline void kvx_pipe_stats_get(kvx_pipe *p, kvx_pipe_stats *out)
{
    p->ops->stats(p, out);
}

/* The owner can live with a new local address (it re-reads kvx_pipe_address when
 * kvx_pipe_generation changes, and tells its peers the new one): the pipe may then replace
 * a wedged transport worker. UCX over shared memory: a peer that dies while it writes into
 * this process's receive queue leaves a slot reserved and never filled, and the worker
 * receives nothing more from anyone. After every peer death the pipe sends itself a probe
 * through that queue; if it does not come back within a second of progress, every peer
 * fails (their operations complete with TD_EIO, peer_err_cb once each), a new worker takes
 * over (new address, the old one kept unread until destroy) and the generation grows.
 * Without this call a wedge is only logged. */
static inline void kvx_pipe_allow_reset(kvx_pipe *p)
{
    if (p->ops->allow_reset) p->ops->allow_reset(p);
}

/* How many times the pipe replaced its worker (0 at creation). */
static inline uint32_t kvx_pipe_generation(kvx_pipe *p)
{
    return p->ops->generation ? p->ops->generation(p) : 0;
}

/* Progress; if nothing ran, arm and sleep on the event fd up to timeout_ms (0: do not
 * sleep). Returns the number of completions run (>= 0) or a negative td_err. */
int kvx_pipe_wait(kvx_pipe *p, int timeout_ms);

#endif
