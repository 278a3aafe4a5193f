/* kvx_pipe_ucx.c: the UCX implementation of the pipe (one context, one worker).
 *
 * Operations on a peer that failed (or was force-closed) complete with an error in the
 * next progress even when UCX itself never completes them (over shared memory, with
 * UCP_ERR_HANDLING_MODE_NONE, a flush to a process that died stays in flight forever):
 * the owner hears the error, and the operation becomes a *zombie* that keeps its UCX
 * request (and an am_send payload) until UCX completes it or the pipe is destroyed.
 *
 * A wedged receive queue (shared memory): UCX's posix/sysv transports give each worker one
 * receive FIFO that every peer writes into: a writer reserves a slot (an atomic on the
 * head), fills it, then sets its owner flag; the reader stops at the first slot whose flag
 * is not set. A peer killed between the two leaves that slot reserved forever: the worker
 * receives nothing more from anyone (ACCEPTs, DONEs, and the completions of the puts,
 * which UCX emulates with active messages when the remote memory is not its own shared
 * memory, so a flush to a live peer never completes either). So after every peer death the
 * pipe sends itself a probe from a second worker through that FIFO; if it has not arrived
 * after PROBE_MS of progress, the FIFO is wedged: with kvx_pipe_allow_reset, every peer
 * fails and a new worker takes over (the old one is kept, never progressed, until destroy:
 * its requests may still point at our operations). */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include "kvx_pipe.h"
#include "kvx_wire.h"

typedef struct ucx_pipe ucx_pipe;

typedef struct {
    ucx_pipe *pipe;
    ucp_ep_h ep;       /* NULL once closed */
    int status;        /* 0 or the error it failed with */
    bool used;         /* slot taken (until disconnect) */
    bool err_pending;  /* failed, peer_err_cb not yet delivered */
    bool close_needed; /* failed, ep still to be force-closed */
    int pidfd;         /* shared-memory mode: the peer process (readable once it exited) */
} ucx_peer;

struct kvx_mem {
    ucp_mem_h memh;
    void *base;
    size_t len;
    kvx_mem *next, *prev;
};

struct kvx_rkey {
    ucp_rkey_h rkey;
    kvx_peer peer;
    kvx_rkey *next, *prev;
};

/* One asynchronous operation with a user callback. */
typedef struct ucx_op {
    ucx_pipe *pipe;
    kvx_done_cb cb;
    void *arg;
    int status;
    size_t len;
    bool done;
    bool zombie;   /* reported failed already; waits for UCX to let go of the request */
    kvx_peer peer; /* the endpoint it runs on; -1: none (receives), or no longer tracked */
    void *copy;    /* am_send: the copied payload */
    void *req;     /* the UCX request while in flight (freed by the callback) */
    struct ucx_op *next, *prev;
} ucx_op;

#define PROBE_AM_ID KVX_AM_IDS /* the wedge probe's active message id (users have 0..7) */
#define PROBE_MS    1000       /* a probe not back after this long (and 3 progress calls) */

struct ucx_pipe {
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
    void **closing;   /* (n_closing) endpoint close requests still in progress */
    int n_closing;
    kvx_pipe_params params;
    ucx_peer **peers; /* (n_peers) slots, each allocated once */
    int n_peers;
    kvx_mem *mems;
    kvx_rkey *rkeys;
    int n_mems, n_rkeys;
    ucx_op *ops; /* pending and completed-not-delivered operations */
    int n_ops;
    ucx_op *zombies; /* reported operations whose UCX request is still in flight */
    bool any_done;   /* some op in the list is done */
    struct {
        kvx_am_cb cb;
        void *arg;
    } am[KVX_AM_IDS];
};

static int ucx_err(ucs_status_t st)
{
    switch (st) {
    case UCS_OK:
        return 0;
    case UCS_ERR_NO_MEMORY:
        return TD_ENOMEM;
    case UCS_ERR_INVALID_PARAM:
        return TD_EINVAL;
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_ENDPOINT_TIMEOUT:
        return TD_ETIMEDOUT;
    case UCS_ERR_MESSAGE_TRUNCATED:
        return TD_ERANGE;
    case UCS_ERR_UNSUPPORTED:
        return TD_EUNSUPP;
    default:
        return TD_EIO;
    }
}

#define PEER_GONE (-2) /* ucx_op.peer: its endpoint was force-closed */

static ucx_op *op_new(ucx_pipe *p, kvx_peer peer, kvx_done_cb cb, void *arg)
{
    ucx_op *op = calloc(1, sizeof(*op));
    if (!op) return NULL;
    op->pipe = p;
    op->peer = peer;
    op->cb = cb;
    op->arg = arg;
    op->next = p->ops;
    if (p->ops) p->ops->prev = op;
    p->ops = op;
    p->n_ops++;
    return op;
}

static void op_detach(ucx_op *op)
{
    ucx_pipe *p = op->pipe;
    ucx_op **head = op->zombie ? &p->zombies : &p->ops;
    if (op->prev)
        op->prev->next = op->next;
    else
        *head = op->next;
    if (op->next) op->next->prev = op->prev;
    op->next = op->prev = NULL;
    if (!op->zombie) p->n_ops--;
}

static void op_unlink(ucx_op *op)
{
    op_detach(op);
    free(op->copy);
    free(op);
}

static void op_complete(ucx_op *op, int status, size_t len)
{
    op->done = true;
    op->status = status;
    op->len = len;
    op->pipe->any_done = true;
}

/* Finish an nbx call: NULL (done at once), an error, or a request that calls back later. */
static int op_started(ucx_op *op, ucs_status_ptr_t sp, const char *what)
{
    if (sp == NULL) {
        op_complete(op, 0, op->len);
        return 0;
    }
    if (UCS_PTR_IS_ERR(sp)) {
        int err = ucx_err(UCS_PTR_STATUS(sp));
        TD_LOG_ERR("kvx ucx: %s failed: %s", what, ucs_status_string(UCS_PTR_STATUS(sp)));
        op_unlink(op);
        return err;
    }
    op->req = sp; /* the callback frees it */
    return 0;
}

static void send_cb(void *req, ucs_status_t st, void *user)
{
    ucx_op *op = user;
    if (op->zombie) { /* its owner heard about it long ago */
        op_unlink(op);
        ucp_request_free(req);
        return;
    }
    op->req = NULL;
    op_complete(op, ucx_err(st), 0);
    ucp_request_free(req);
}

static void recv_cb(void *req, ucs_status_t st, const ucp_tag_recv_info_t *info, void *user)
{
    ucx_op *op = user;
    if (op->zombie) {
        op_unlink(op);
        ucp_request_free(req);
        return;
    }
    op->req = NULL;
    op_complete(op, ucx_err(st), st == UCS_OK ? info->length : 0);
    ucp_request_free(req);
}

static void peer_fail(ucx_peer *pr, int status)
{
    if (pr->status) return;
    pr->status = status;
    pr->err_pending = true;
    pr->close_needed = pr->ep != NULL;
}

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    ucx_peer *pr = arg;
    TD_LOG_WARN("kvx ucx: peer failed: %s", ucs_status_string(st));
    peer_fail(pr, st == UCS_ERR_ENDPOINT_TIMEOUT ? TD_ETIMEDOUT : TD_EIO);
}

static int check_pids(ucx_pipe *p);

static ucx_peer *peer_get(ucx_pipe *p, kvx_peer id)
{
    if (id < 0 || id >= p->n_peers || !p->peers[id]->used) return NULL;
    return p->peers[id];
}

/* Close an endpoint; force: do not flush (peer gone). Bounded wait. */
static void ep_close(ucx_pipe *p, ucx_peer *pr, bool force)
{
    if (!pr->ep) return;
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0};
    ucs_status_ptr_t sp = ucp_ep_close_nbx(pr->ep, &prm);
    pr->ep = NULL;
    if (!sp || UCS_PTR_IS_ERR(sp)) return;
    /* a graceful close needs the peer's progress: it completes in later progress calls */
    void **nc = realloc(p->closing, (size_t)(p->n_closing + 1) * sizeof(*nc));
    if (!nc) {
        ucp_request_free(sp); /* UCX finishes it on its own */
        return;
    }
    p->closing = nc;
    p->closing[p->n_closing++] = sp;
}

/* Release the close requests that completed. */
static void reap_closing(ucx_pipe *p)
{
    int k = 0;
    for (int i = 0; i < p->n_closing; i++) {
        if (ucp_request_check_status(p->closing[i]) != UCS_INPROGRESS)
            ucp_request_free(p->closing[i]);
        else
            p->closing[k++] = p->closing[i];
    }
    p->n_closing = k;
}

/* Operations still in flight on a failed or force-closed endpoint (after UCX had its
 * chance to complete them): the owner hears TD_EIO (or the peer's error) and the operation
 * becomes a zombie (see the top of the file). Returns how many were reported. */
static int orphan_ops(ucx_pipe *p)
{
    int n = 0;
    for (ucx_op *op = p->ops, *next; op; op = next) {
        next = op->next;
        if (op->done || !op->req || op->peer == -1) continue;
        int st = TD_EIO;
        if (op->peer >= 0) {
            ucx_peer *pr = op->peer < p->n_peers ? p->peers[op->peer] : NULL;
            if (!pr || !pr->status || pr->ep) continue; /* healthy, or not closed yet */
            st = pr->status;
        }
        kvx_done_cb cb = op->cb;
        void *arg = op->arg;
        op_detach(op);
        op->zombie = true;
        op->cb = NULL;
        op->next = p->zombies;
        if (p->zombies) p->zombies->prev = op;
        p->zombies = op;
        if (cb) cb(arg, st, 0);
        n++;
        next = p->ops; /* the callback may have changed the list */
    }
    return n;
}

static void probe_step(ucx_pipe *p);

static int ucx_progress(kvx_pipe *base)
{
    ucx_pipe *p = (ucx_pipe *)base;
    while (ucp_worker_progress(p->worker)) {
    }
    int n = 0;
    if (p->shm) {
        check_pids(p);
        probe_step(p);
    }
    if (p->n_closing) reap_closing(p);
    bool closed = false;
    for (int i = 0; i < p->n_peers; i++) {
        ucx_peer *pr = p->peers[i];
        if (pr->close_needed) {
            pr->close_needed = false;
            ep_close(p, pr, true);
            closed = true;
        }
    }
    if (closed)
        while (ucp_worker_progress(p->worker)) { /* completions the closes produced */
        }
    while (p->any_done) {
        p->any_done = false;
        ucx_op *op = p->ops, *next;
        for (; op; op = next) {
            next = op->next;
            if (!op->done) continue;
            kvx_done_cb cb = op->cb;
            void *arg = op->arg;
            int st = op->status;
            size_t len = op->len;
            op_unlink(op);
            if (cb) cb(arg, st, len);
            n++;
            next = p->ops; /* the callback may have changed the list */
        }
    }
    n += orphan_ops(p);
    for (int i = 0; i < p->n_peers; i++) {
        ucx_peer *pr = p->peers[i];
        if (pr->used && pr->err_pending) {
            pr->err_pending = false;
            if (p->params.peer_err_cb) p->params.peer_err_cb(p->params.peer_err_arg, i, pr->status);
            n++;
        }
    }
    return n;
}

static int ucx_arm(kvx_pipe *base)
{
    ucx_pipe *p = (ucx_pipe *)base;
    if (p->any_done || p->probe_wanted) return 0;
    if (p->shm && check_pids(p)) return 0;
    for (int i = 0; i < p->n_peers; i++)
        if (p->peers[i]->err_pending || p->peers[i]->close_needed) return 0;
    ucs_status_t st = ucp_worker_arm(p->worker);
    return st == UCS_OK ? 1 : 0;
}

static int ucx_event_fd(kvx_pipe *base)
{
    return ((ucx_pipe *)base)->efd;
}

static void ucx_signal(kvx_pipe *base)
{
    ucp_worker_signal(((ucx_pipe *)base)->worker);
}

static int ucx_address(kvx_pipe *base, void *buf, size_t cap, size_t *len)
{
    ucx_pipe *p = (ucx_pipe *)base;
    ucp_address_t *addr;
    size_t n;
    ucs_status_t st = ucp_worker_get_address(p->worker, &addr, &n);
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: worker address: %s", ucs_status_string(st));
        return ucx_err(st);
    }
    uint8_t *pl = malloc(n + 8);
    bool ok = false;
    if (pl) {
        kvx_wr w;
        kvx_wr_init(&w, pl, n + 8);
        kvx_wr_u32(&w, p->shm);
        kvx_wr_u32(&w, (uint32_t)getpid());
        kvx_wr_bytes(&w, addr, n);
        ok = kvx_frame_write(buf, cap, KVX_MAGIC_ADDR, KVX_KIND_UCX, pl, n + 8, len);
        free(pl);
    }
    ucp_worker_release_address(p->worker, addr);
    if (!ok) {
        TD_LOG_ERR("kvx ucx: address needs %zu bytes, buffer has %zu", *len, cap);
        return TD_ERANGE;
    }
    return 0;
}

static int ucx_connect(kvx_pipe *base, const void *addr, size_t len, kvx_peer *out)
{
    ucx_pipe *p = (ucx_pipe *)base;
    const void *pl;
    size_t n;
    if (kvx_frame_read(addr, len, KVX_MAGIC_ADDR, KVX_KIND_UCX, &pl, &n) || n <= 8) {
        TD_LOG_ERR("kvx ucx: malformed peer address (%zu bytes)", len);
        return TD_EFORMAT;
    }
    kvx_rd rd;
    kvx_rd_init(&rd, pl, n);
    uint32_t peer_shm = kvx_rd_u32(&rd), peer_pid = kvx_rd_u32(&rd);
    pl = (const uint8_t *)pl + 8;
    n -= 8;
    if (peer_shm != p->shm) {
        TD_LOG_ERR("kvx ucx: the peer uses %s transports, this pipe %s (set the same UCX_TLS)",
                   peer_shm ? "shared-memory" : "network", p->shm ? "shared-memory" : "network");
        return TD_EUNSUPP;
    }
    int id = -1;
    for (int i = 0; i < p->n_peers; i++)
        if (!p->peers[i]->used) {
            id = i;
            break;
        }
    if (id < 0) {
        ucx_peer **np = realloc(p->peers, (size_t)(p->n_peers + 1) * sizeof(*np));
        if (!np) return TD_ENOMEM;
        p->peers = np;
        np[p->n_peers] = calloc(1, sizeof(ucx_peer));
        if (!np[p->n_peers]) return TD_ENOMEM;
        id = p->n_peers++;
    }
    ucx_peer *pr = p->peers[id];
    memset(pr, 0, sizeof(*pr));
    pr->pipe = p;
    pr->pidfd = -1;
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = pl,
        .err_mode = p->shm ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ep_err_cb, .arg = pr},
    };
    ucs_status_t st = ucp_ep_create(p->worker, &ep, &pr->ep);
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: endpoint create: %s", ucs_status_string(st));
        pr->ep = NULL;
        return ucx_err(st);
    }
    pr->used = true;
    if (p->shm) {
        /* same host: the peer's liveness is its process; a pidfd tells when it exits */
        pr->pidfd = (int)syscall(SYS_pidfd_open, (pid_t)peer_pid, 0);
        if (pr->pidfd < 0) {
            TD_LOG_WARN("kvx ucx: peer process %u is gone", peer_pid);
            peer_fail(pr, TD_EIO);
        } else {
            struct epoll_event ev = {.events = EPOLLIN, .data.fd = pr->pidfd};
            epoll_ctl(p->epfd, EPOLL_CTL_ADD, pr->pidfd, &ev);
        }
    }
    *out = id;
    return 0;
}

static void pidfd_close(ucx_pipe *p, ucx_peer *pr)
{
    if (pr->pidfd < 0) return;
    epoll_ctl(p->epfd, EPOLL_CTL_DEL, pr->pidfd, NULL);
    close(pr->pidfd);
    pr->pidfd = -1;
}

/* Shared-memory mode: peers whose process exited fail (returns how many newly). */
static int check_pids(ucx_pipe *p)
{
    int n = 0;
    for (int i = 0; i < p->n_peers; i++) {
        ucx_peer *pr = p->peers[i];
        if (!pr->used || pr->pidfd < 0 || pr->status) continue;
        struct pollfd pf = {.fd = pr->pidfd, .events = POLLIN};
        if (poll(&pf, 1, 0) > 0) {
            /* nothing in flight to it: a stop, not a failure (what depended on the peer
               is reported by the layers above) */
            int busy = 0;
            for (ucx_op *op = p->ops; op; op = op->next)
                busy += op->peer == i && !op->done;
            if (busy)
                TD_LOG_WARN("kvx ucx: peer process exited with %d operation(s) in flight", busy);
            else
                TD_LOG_INFO("kvx ucx: peer process exited");
            peer_fail(pr, TD_EIO);
            pidfd_close(p, pr);
            p->probe_wanted = true; /* it may have died writing into our receive FIFO */
            n++;
        }
    }
    return n;
}

static void ucx_disconnect(kvx_pipe *base, kvx_peer peer, bool force)
{
    ucx_pipe *p = (ucx_pipe *)base;
    ucx_peer *pr = peer_get(p, peer);
    if (!pr) return;
    /* rkeys unpacked on this endpoint go first (UCX requires it) */
    for (kvx_rkey *rk = p->rkeys, *nx; rk; rk = nx) {
        nx = rk->next;
        if (rk->peer == peer) base->ops->rkey_destroy(base, rk);
    }
    bool forced = force || pr->status != 0;
    ep_close(p, pr, forced);
    /* its operations: after a forced close, reported failed by the next progress unless UCX
     * completes them first; after a graceful one, left to UCX (the slot may be reused) */
    for (ucx_op *op = p->ops; op; op = op->next)
        if (op->peer == peer) op->peer = forced ? PEER_GONE : -1;
    pidfd_close(p, pr);
    pr->close_needed = false;
    pr->err_pending = false;
    pr->used = false;
}

static int ucx_peer_status(kvx_pipe *base, kvx_peer peer)
{
    ucx_peer *pr = peer_get((ucx_pipe *)base, peer);
    if (!pr) return TD_EINVAL;
    return pr->status;
}

static int ucx_mem_reg(kvx_pipe *base, void *addr, size_t len, kvx_mem **out)
{
    ucx_pipe *p = (ucx_pipe *)base;
    if (!addr || !len) return TD_EINVAL;
    kvx_mem *m = calloc(1, sizeof(*m));
    if (!m) return TD_ENOMEM;
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
        .address = addr,
        .length = len,
    };
    ucs_status_t st = ucp_mem_map(p->ctx, &mp, &m->memh);
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: register %zu bytes: %s", len, ucs_status_string(st));
        free(m);
        return ucx_err(st);
    }
    m->base = addr;
    m->len = len;
    m->next = p->mems;
    if (p->mems) p->mems->prev = m;
    p->mems = m;
    p->n_mems++;
    *out = m;
    return 0;
}

static void ucx_mem_dereg(kvx_pipe *base, kvx_mem *m)
{
    ucx_pipe *p = (ucx_pipe *)base;
    ucp_mem_unmap(p->ctx, m->memh);
    if (m->prev)
        m->prev->next = m->next;
    else
        p->mems = m->next;
    if (m->next) m->next->prev = m->prev;
    p->n_mems--;
    free(m);
}

static int ucx_rkey_pack(kvx_pipe *base, kvx_mem *m, void *buf, size_t cap, size_t *len)
{
    ucx_pipe *p = (ucx_pipe *)base;
    void *rb;
    size_t n;
    ucs_status_t st = ucp_rkey_pack(p->ctx, m->memh, &rb, &n);
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: rkey pack: %s", ucs_status_string(st));
        return ucx_err(st);
    }
    bool ok = kvx_frame_write(buf, cap, KVX_MAGIC_RKEY, KVX_KIND_UCX, rb, n, len);
    ucp_rkey_buffer_release(rb);
    if (!ok) {
        TD_LOG_ERR("kvx ucx: rkey needs %zu bytes, buffer has %zu", *len, cap);
        return TD_ERANGE;
    }
    return 0;
}

static int ucx_rkey_unpack(kvx_pipe *base, kvx_peer peer, const void *buf, size_t len,
                           kvx_rkey **out)
{
    ucx_pipe *p = (ucx_pipe *)base;
    ucx_peer *pr = peer_get(p, peer);
    const void *pl;
    size_t n;
    if (!pr) return TD_EINVAL;
    if (pr->status || !pr->ep) return TD_EIO;
    if (kvx_frame_read(buf, len, KVX_MAGIC_RKEY, KVX_KIND_UCX, &pl, &n) || n == 0) {
        TD_LOG_ERR("kvx ucx: malformed rkey (%zu bytes)", len);
        return TD_EFORMAT;
    }
    kvx_rkey *rk = calloc(1, sizeof(*rk));
    if (!rk) return TD_ENOMEM;
    ucs_status_t st = ucp_ep_rkey_unpack(pr->ep, pl, &rk->rkey);
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: rkey unpack: %s", ucs_status_string(st));
        free(rk);
        return ucx_err(st);
    }
    rk->peer = peer;
    rk->next = p->rkeys;
    if (p->rkeys) p->rkeys->prev = rk;
    p->rkeys = rk;
    p->n_rkeys++;
    *out = rk;
    return 0;
}

static void ucx_rkey_destroy(kvx_pipe *base, kvx_rkey *rk)
{
    ucx_pipe *p = (ucx_pipe *)base;
    ucp_rkey_destroy(rk->rkey);
    if (rk->prev)
        rk->prev->next = rk->next;
    else
        p->rkeys = rk->next;
    if (rk->next) rk->next->prev = rk->prev;
    p->n_rkeys--;
    free(rk);
}

static ucp_ep_h live_ep(ucx_pipe *p, kvx_peer peer, int *err)
{
    ucx_peer *pr = peer_get(p, peer);
    if (!pr) {
        *err = TD_EINVAL;
        return NULL;
    }
    if (pr->status || !pr->ep) {
        *err = pr->status ? pr->status : TD_EIO;
        return NULL;
    }
    return pr->ep;
}

static int ucx_put(kvx_pipe *base, kvx_peer peer, const void *src, size_t len, uint64_t raddr,
                   kvx_rkey *rk)
{
    ucx_pipe *p = (ucx_pipe *)base;
    int err;
    ucp_ep_h ep = live_ep(p, peer, &err);
    if (!ep) return err;
    if (!rk || rk->peer != peer) return TD_EINVAL;
    ucp_request_param_t prm = {.op_attr_mask = 0};
    ucs_status_ptr_t sp = ucp_put_nbx(ep, src, len, raddr, rk->rkey, &prm);
    if (UCS_PTR_IS_ERR(sp)) {
        TD_LOG_ERR("kvx ucx: put %zu bytes: %s", len, ucs_status_string(UCS_PTR_STATUS(sp)));
        return ucx_err(UCS_PTR_STATUS(sp));
    }
    if (sp) ucp_request_free(sp);
    return 0;
}

static int ucx_flush(kvx_pipe *base, kvx_peer peer, kvx_done_cb cb, void *arg)
{
    ucx_pipe *p = (ucx_pipe *)base;
    int err;
    ucp_ep_h ep = live_ep(p, peer, &err);
    if (!ep) return err;
    ucx_op *op = op_new(p, peer, cb, arg);
    if (!op) return TD_ENOMEM;
    ucp_request_param_t prm = {.op_attr_mask =
                                   UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                               .cb.send = send_cb,
                               .user_data = op};
    return op_started(op, ucp_ep_flush_nbx(ep, &prm), "flush");
}

static ucs_status_t am_recv(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                            const ucp_am_recv_param_t *prm)
{
    struct {
        kvx_am_cb cb;
        void *arg;
    } *h = arg;
    if (prm->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        TD_LOG_ERR("kvx ucx: dropped a rendezvous active message of %zu bytes", len);
        return UCS_OK;
    }
    if (h->cb) h->cb(h->arg, data, len);
    return UCS_OK;
}

static int ucx_set_am_handler(kvx_pipe *base, unsigned id, kvx_am_cb cb, void *arg)
{
    ucx_pipe *p = (ucx_pipe *)base;
    if (id >= KVX_AM_IDS) return TD_EINVAL;
    p->am[id].cb = cb;
    p->am[id].arg = arg;
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = id,
        .cb = cb ? am_recv : NULL,
        .arg = &p->am[id],
    };
    ucs_status_t st = ucp_worker_set_am_recv_handler(p->worker, &hp);
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: set am handler %u: %s", id, ucs_status_string(st));
        return ucx_err(st);
    }
    return 0;
}

static int ucx_am_send(kvx_pipe *base, kvx_peer peer, unsigned id, const void *buf, size_t len,
                       kvx_done_cb cb, void *arg)
{
    ucx_pipe *p = (ucx_pipe *)base;
    int err;
    if (id >= KVX_AM_IDS || len > KVX_AM_MAX) return TD_EINVAL;
    ucp_ep_h ep = live_ep(p, peer, &err);
    if (!ep) return err;
    ucx_op *op = op_new(p, peer, cb, arg);
    if (!op) return TD_ENOMEM;
    op->copy = malloc(len ? len : 1);
    if (!op->copy) {
        op_unlink(op);
        return TD_ENOMEM;
    }
    memcpy(op->copy, buf, len);
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                               UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FIELD_FLAGS,
                               .cb.send = send_cb,
                               .user_data = op,
                               .flags = UCP_AM_SEND_FLAG_EAGER};
    return op_started(op, ucp_am_send_nbx(ep, id, NULL, 0, op->copy, len, &prm), "am send");
}

static int ucx_tag_send(kvx_pipe *base, kvx_peer peer, uint64_t tag, const void *buf, size_t len,
                        kvx_done_cb cb, void *arg)
{
    ucx_pipe *p = (ucx_pipe *)base;
    int err;
    ucp_ep_h ep = live_ep(p, peer, &err);
    if (!ep) return err;
    ucx_op *op = op_new(p, peer, cb, arg);
    if (!op) return TD_ENOMEM;
    ucp_request_param_t prm = {.op_attr_mask =
                                   UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                               .cb.send = send_cb,
                               .user_data = op};
    return op_started(op, ucp_tag_send_nbx(ep, buf, len, tag, &prm), "tag send");
}

static int ucx_tag_recv(kvx_pipe *base, uint64_t tag, void *buf, size_t cap, kvx_done_cb cb,
                        void *arg)
{
    ucx_pipe *p = (ucx_pipe *)base;
    ucx_op *op = op_new(p, -1, cb, arg);
    if (!op) return TD_ENOMEM;
    op->len = 0;
    /* no immediate completion: the length is reported by the callback */
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                               UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
                               .cb.recv = recv_cb,
                               .user_data = op};
    return op_started(op, ucp_tag_recv_nbx(p->worker, buf, cap, tag, UINT64_MAX, &prm), "tag recv");
}

/* --- the wedge probe and the worker replacement (see the top of the file) ---------------- */

static ucs_status_t probe_recv(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                               const ucp_am_recv_param_t *prm)
{
    ucx_pipe *p = arg;
    uint64_t seq;
    if (len == sizeof(seq) && !(prm->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        memcpy(&seq, data, sizeof(seq));
        if (seq > p->probe_got) p->probe_got = seq;
    }
    return UCS_OK;
}

/* A worker in serialized mode with its event fd; the probe handler and the users' active
 * message handlers registered. */
static ucs_status_t worker_open(ucx_pipe *p, ucp_worker_h *w, int *efd)
{
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    ucs_status_t st = ucp_worker_create(p->ctx, &wp, w);
    if (st != UCS_OK) return st;
    if (efd) st = ucp_worker_get_efd(*w, efd);
    for (unsigned id = 0; efd && st == UCS_OK && id <= KVX_AM_IDS; id++) {
        bool probe = id == PROBE_AM_ID;
        if (!probe && !p->am[id].cb) continue;
        ucp_am_handler_param_t hp = {
            .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                          UCP_AM_HANDLER_PARAM_FIELD_ARG,
            .id = id,
            .cb = probe ? probe_recv : am_recv,
            .arg = probe ? (void *)p : (void *)&p->am[id],
        };
        st = ucp_worker_set_am_recv_handler(*w, &hp);
    }
    if (st != UCS_OK) {
        ucp_worker_destroy(*w);
        *w = NULL;
    }
    return st;
}

/* The receive FIFO is wedged: every peer fails, a new worker takes over. */
static void worker_replace(ucx_pipe *p)
{
    ucp_worker_h nw = NULL;
    int nefd = -1;
    ucp_worker_h *nr = realloc(p->retired, (size_t)(p->n_retired + 1) * sizeof(*nr));
    if (nr) p->retired = nr;
    ucs_status_t st = nr ? worker_open(p, &nw, &nefd) : UCS_ERR_NO_MEMORY;
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = nefd};
    if (st == UCS_OK && epoll_ctl(p->epfd, EPOLL_CTL_ADD, nefd, &ev)) st = UCS_ERR_IO_ERROR;
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: cannot replace the wedged worker: %s (this pipe receives nothing "
                   "more)",
                   ucs_status_string(st));
        if (nw) ucp_worker_destroy(nw);
        p->can_reset = false;
        return;
    }
    epoll_ctl(p->epfd, EPOLL_CTL_DEL, p->efd, NULL);
    p->retired[p->n_retired++] = p->worker; /* never progressed again; destroyed last */
    p->worker = nw;
    p->efd = nefd;
    p->gen++;
    /* the probe's endpoint pointed at the old FIFO */
    if (p->probe_ep) {
        ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                   .flags = UCP_EP_CLOSE_FLAG_FORCE};
        ucs_status_ptr_t sp = ucp_ep_close_nbx(p->probe_ep, &prm);
        if (sp && !UCS_PTR_IS_ERR(sp)) ucp_request_free(sp);
        p->probe_ep = NULL;
    }
    p->probing = false;
    /* closes in progress belong to the old worker */
    for (int i = 0; i < p->n_closing; i++)
        ucp_request_free(p->closing[i]);
    p->n_closing = 0;
    /* every endpoint was on the old worker: the peers fail, their slots stay reserved */
    for (int i = 0; i < p->n_peers; i++) {
        ucx_peer *pr = p->peers[i];
        if (!pr->used) continue;
        pr->ep = NULL;
        pr->close_needed = false;
        if (!pr->status) {
            pr->status = TD_EIO;
            pr->err_pending = true;
        }
    }
    /* operations in flight on the old worker never complete: reported failed, kept as
     * zombies (their UCX requests point at them) until destroy */
    for (ucx_op *op = p->ops, *next; op; op = next) {
        next = op->next;
        if (op->done || !op->req) continue;
        kvx_done_cb cb = op->cb;
        void *arg = op->arg;
        op_detach(op);
        op->zombie = true;
        op->cb = NULL;
        op->next = p->zombies;
        if (p->zombies) p->zombies->prev = op;
        p->zombies = op;
        if (cb) cb(arg, TD_EIO, 0);
        next = p->ops; /* the callback may have changed the list */
    }
    TD_LOG_WARN("kvx ucx: a new UCX worker took over (generation %u): every peer of the old one "
                "failed",
                p->gen);
}

/* Shared memory: after a peer death, send the probe; judge it once it had its time. */
static void probe_step(ucx_pipe *p)
{
    if (p->probing) {
        if (p->probe_w)
            while (ucp_worker_progress(p->probe_w)) {
            }
        while (ucp_worker_progress(p->worker)) {
        }
        if (p->probe_got >= p->probe_seq) {
            p->probing = false;
        } else if (++p->probe_rounds >= 3 && kvx_now_ms() > p->probe_deadline) {
            p->probing = false;
            if (p->can_reset) {
                TD_LOG_ERR("kvx ucx: the shared-memory receive queue is stuck (a peer died while "
                           "writing into it): replacing the UCX worker");
                worker_replace(p);
            } else if (!p->wedge_logged) {
                TD_LOG_ERR("kvx ucx: the shared-memory receive queue is stuck (a peer died while "
                           "writing into it): this pipe receives nothing more");
                p->wedge_logged = true;
            }
            return;
        }
    }
    if (!p->probe_wanted || p->probing) return;
    p->probe_wanted = false;
    if (!p->probe_w && worker_open(p, &p->probe_w, NULL) != UCS_OK) {
        TD_LOG_WARN("kvx ucx: no probe worker: a wedged receive queue would go unnoticed");
        p->probe_w = NULL;
        return;
    }
    if (!p->probe_ep) {
        ucp_address_t *addr;
        size_t n;
        if (ucp_worker_get_address(p->worker, &addr, &n) != UCS_OK) return;
        ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                            UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                              .address = addr,
                              .err_mode = UCP_ERR_HANDLING_MODE_NONE};
        ucs_status_t st = ucp_ep_create(p->probe_w, &ep, &p->probe_ep);
        ucp_worker_release_address(p->worker, addr);
        if (st != UCS_OK) {
            p->probe_ep = NULL;
            return;
        }
    }
    p->probe_buf = ++p->probe_seq;
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_AM_SEND_FLAG_EAGER};
    ucs_status_ptr_t sp = ucp_am_send_nbx(p->probe_ep, PROBE_AM_ID, NULL, 0, &p->probe_buf,
                                          sizeof(p->probe_buf), &prm);
    if (UCS_PTR_IS_ERR(sp)) return;
    if (sp) ucp_request_free(sp); /* completes in the probe worker's progress */
    p->probing = true;
    p->probe_rounds = 0;
    p->probe_deadline = kvx_now_ms() + PROBE_MS;
}

static void ucx_allow_reset(kvx_pipe *base)
{
    ((ucx_pipe *)base)->can_reset = true;
}

static uint32_t ucx_generation(kvx_pipe *base)
{
    return ((ucx_pipe *)base)->gen;
}

static void ucx_stats(kvx_pipe *base, kvx_pipe_stats *out)
{
    ucx_pipe *p = (ucx_pipe *)base;
    memset(out, 0, sizeof(*out));
    for (int i = 0; i < p->n_peers; i++)
        out->peers += p->peers[i]->used;
    out->mems = p->n_mems;
    out->rkeys = p->n_rkeys;
    out->pending_ops = p->n_ops;
}

static void ucx_destroy(kvx_pipe *base)
{
    ucx_pipe *p = (ucx_pipe *)base;
    if (p->worker) {
        while (p->rkeys)
            ucx_rkey_destroy(base, p->rkeys);
        for (int i = 0; i < p->n_peers; i++) {
            ucx_peer *pr = p->peers[i];
            if (pr->used) ep_close(p, pr, pr->status != 0);
            pidfd_close(p, pr);
            pr->used = false;
            pr->err_pending = pr->close_needed = false;
        }
        /* receives nobody will match are cancelled (their callbacks report it) */
        for (ucx_op *op = p->ops; op; op = op->next)
            if (op->req && !op->done) ucp_request_cancel(p->worker, op->req);
        /* deliver (with their errors) the completions the closes produced */
        int64_t end = kvx_now_ms() + 1000;
        while (p->ops && kvx_now_ms() < end)
            ucx_progress(base);
        while (p->ops) { /* still in flight after the bound: report, leave the request */
            ucx_op *op = p->ops;
            if (op->req) ucp_request_free(op->req);
            kvx_done_cb cb = op->cb;
            void *arg = op->arg;
            op_unlink(op);
            if (cb) cb(arg, TD_EIO, 0);
        }
        int64_t cend = kvx_now_ms() + 300; /* graceful closes: a short bound, then UCX */
        while (p->n_closing && kvx_now_ms() < cend) {
            ucp_worker_progress(p->worker);
            reap_closing(p);
        }
        for (int i = 0; i < p->n_closing; i++)
            ucp_request_free(p->closing[i]);
        free(p->closing);
        p->closing = NULL;
        p->n_closing = 0;
        while (p->zombies) { /* no callback comes after ucp_request_free */
            ucx_op *op = p->zombies;
            if (op->req) ucp_request_free(op->req);
            op_unlink(op);
        }
        while (p->mems)
            ucx_mem_dereg(base, p->mems);
        if (p->probe_ep) {
            ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                       .flags = UCP_EP_CLOSE_FLAG_FORCE};
            ucs_status_ptr_t sp = ucp_ep_close_nbx(p->probe_ep, &prm);
            if (sp && !UCS_PTR_IS_ERR(sp)) ucp_request_free(sp);
        }
        if (p->probe_w) ucp_worker_destroy(p->probe_w);
        ucp_worker_destroy(p->worker);
        for (int i = 0; i < p->n_retired; i++)
            ucp_worker_destroy(p->retired[i]);
    }
    free(p->retired);
    if (p->ctx) ucp_cleanup(p->ctx);
    if (p->epfd > 0) close(p->epfd);
    for (int i = 0; i < p->n_peers; i++)
        free(p->peers[i]);
    free(p->peers);
    free(p);
}

static const kvx_pipe_ops ucx_ops = {
    .name = "ucx",
    .destroy = ucx_destroy,
    .address = ucx_address,
    .connect = ucx_connect,
    .disconnect = ucx_disconnect,
    .peer_status = ucx_peer_status,
    .mem_reg = ucx_mem_reg,
    .mem_dereg = ucx_mem_dereg,
    .rkey_pack = ucx_rkey_pack,
    .rkey_unpack = ucx_rkey_unpack,
    .rkey_destroy = ucx_rkey_destroy,
    .put = ucx_put,
    .flush = ucx_flush,
    .set_am_handler = ucx_set_am_handler,
    .am_send = ucx_am_send,
    .tag_send = ucx_tag_send,
    .tag_recv = ucx_tag_recv,
    .progress = ucx_progress,
    .arm = ucx_arm,
    .event_fd = ucx_event_fd,
    .signal = ucx_signal,
    .stats = ucx_stats,
    .allow_reset = ucx_allow_reset,
    .generation = ucx_generation,
};

/* True when every transport of a UCX_TLS list works on one host only (shared memory). */
static bool tls_shm_only(const char *tls)
{
    static const char *shm[] = {"sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self"};
    if (!tls || !tls[0] || tls[0] == '^') return false;
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", tls);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        bool ok = false;
        for (size_t i = 0; i < sizeof(shm) / sizeof(shm[0]); i++)
            ok = ok || !strcmp(t, shm[i]);
        if (!ok) return false;
    }
    return true;
}

int kvx_pipe_ucx_create(const kvx_pipe_params *params, kvx_pipe **out)
{
    ucx_pipe *p = calloc(1, sizeof(*p));
    if (!p) return TD_ENOMEM;
    p->base.ops = &ucx_ops;
    if (params) p->params = *params;
    p->params.tls = NULL; /* not kept: borrowed */

    const char *tls = params && params->tls && params->tls[0] ? params->tls : getenv("UCX_TLS");
    p->shm = tls_shm_only(tls);
    ucp_config_t *cfg;
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: read config: %s", ucs_status_string(st));
        free(p);
        return TD_EIO;
    }
    if (params && params->tls && params->tls[0]) st = ucp_config_modify(cfg, "TLS", params->tls);
    char ka[32];
    int ka_ms = params && params->keepalive_ms > 0 ? params->keepalive_ms : 1000;
    snprintf(ka, sizeof(ka), "%dms", ka_ms);
    if (st == UCS_OK) st = ucp_config_modify(cfg, "KEEPALIVE_INTERVAL", ka);
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: config: %s", ucs_status_string(st));
        ucp_config_release(cfg);
        free(p);
        return TD_EINVAL;
    }
    ucp_params_t cp = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP,
        .mt_workers_shared = 0,
    };
    st = ucp_init(&cp, cfg, &p->ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: init: %s", ucs_status_string(st));
        free(p);
        return TD_EIO;
    }
    p->efd = -1;
    st = worker_open(p, &p->worker, &p->efd);
    if (st == UCS_OK) {
        p->epfd = epoll_create1(EPOLL_CLOEXEC);
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = p->efd};
        if (p->epfd < 0 || epoll_ctl(p->epfd, EPOLL_CTL_ADD, p->efd, &ev)) st = UCS_ERR_IO_ERROR;
    }
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: worker: %s", ucs_status_string(st));
        if (p->worker) ucp_worker_destroy(p->worker);
        p->worker = NULL;
        ucx_destroy(&p->base);
        return TD_EIO;
    }
    *out = &p->base;
    return 0;
}
