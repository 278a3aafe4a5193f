/* kvx_pipe_ucx_peer.c: the UCX pipe's wire-up: the exported address, endpoints to peers and
 * their failure (UCX's error callback on network transports, the peer's pidfd over shared
 * memory), endpoint closes, memory registrations and remote keys. */
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kvx_pipe_ucx_int.h"
#include "kvx_wire.h"

static void peer_fail(kvxi_ucx_peer *pr, int status)
{
    if (pr->status) return;
    pr->status = status;
    pr->err_pending = true;
    pr->close_needed = pr->ep != NULL;
}

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    kvxi_ucx_peer *pr = arg;
    TD_LOG_WARN("kvx ucx: peer failed: %s", ucs_status_string(st));
    peer_fail(pr, st == UCS_ERR_ENDPOINT_TIMEOUT ? TD_ETIMEDOUT : TD_EIO);
}

kvxi_ucx_peer *kvxi_ucx_peer_get(kvxi_ucx_pipe *p, kvx_peer id)
{
    if (id < 0 || id >= p->n_peers || !p->peers[id]->used) return NULL;
    return p->peers[id];
}

/* Close an endpoint; force: do not flush (peer gone). Bounded wait. */
void kvxi_ucx_ep_close(kvxi_ucx_pipe *p, kvxi_ucx_peer *pr, bool force)
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
void kvxi_ucx_reap_closing(kvxi_ucx_pipe *p)
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

int kvxi_ucx_address(kvx_pipe *base, void *buf, size_t cap, size_t *len)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    ucp_address_t *addr;
    size_t n;
    ucs_status_t st = ucp_worker_get_address(p->worker, &addr, &n);
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: worker address: %s", ucs_status_string(st));
        return kvxi_ucx_err(st);
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

int kvxi_ucx_connect(kvx_pipe *base, const void *addr, size_t len, kvx_peer *out)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
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
        kvxi_ucx_peer **np = realloc(p->peers, (size_t)(p->n_peers + 1) * sizeof(*np));
        if (!np) return TD_ENOMEM;
        p->peers = np;
        np[p->n_peers] = calloc(1, sizeof(kvxi_ucx_peer));
        if (!np[p->n_peers]) return TD_ENOMEM;
        id = p->n_peers++;
    }
    kvxi_ucx_peer *pr = p->peers[id];
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
        return kvxi_ucx_err(st);
    }
    pr->used = true;
    pr->pid = peer_pid;
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

void kvxi_ucx_pidfd_close(kvxi_ucx_pipe *p, kvxi_ucx_peer *pr)
{
    if (pr->pidfd < 0) return;
    epoll_ctl(p->epfd, EPOLL_CTL_DEL, pr->pidfd, NULL);
    close(pr->pidfd);
    pr->pidfd = -1;
}

/* Shared-memory mode: peers whose process exited fail (returns how many newly). */
int kvxi_ucx_check_pids(kvxi_ucx_pipe *p)
{
    int n = 0;
    for (int i = 0; i < p->n_peers; i++) {
        kvxi_ucx_peer *pr = p->peers[i];
        if (!pr->used || pr->pidfd < 0 || pr->status) continue;
        struct pollfd pf = {.fd = pr->pidfd, .events = POLLIN};
        if (poll(&pf, 1, 0) > 0) {
            /* nothing in flight to it: a stop, not a failure (what depended on the peer
               is reported by the layers above) */
            int busy = 0;
            for (kvxi_ucx_op *op = p->ops; op; op = op->next)
                busy += op->peer == i && !op->done;
            if (busy)
                TD_LOG_WARN("kvx ucx: peer process exited with %d operation(s) in flight", busy);
            else
                TD_LOG_INFO("kvx ucx: peer process exited");
            peer_fail(pr, TD_EIO);
            kvxi_ucx_pidfd_close(p, pr);
            p->probe_wanted = true; /* it may have died writing into our receive FIFO */
            n++;
        }
    }
    return n;
}

void kvxi_ucx_disconnect(kvx_pipe *base, kvx_peer peer, bool force)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    kvxi_ucx_peer *pr = kvxi_ucx_peer_get(p, peer);
    if (!pr) return;
    /* rkeys unpacked on this endpoint go first (UCX requires it) */
    for (kvx_rkey *rk = p->rkeys, *nx; rk; rk = nx) {
        nx = rk->next;
        if (rk->peer == peer) base->ops->rkey_destroy(base, rk);
    }
    bool forced = force || pr->status != 0;
    kvxi_ucx_ep_close(p, pr, forced);
    /* its operations: after a forced close, reported failed by the next progress unless UCX
     * completes them first; after a graceful one, left to UCX (the slot may be reused) */
    for (kvxi_ucx_op *op = p->ops; op; op = op->next)
        if (op->peer == peer) op->peer = forced ? KVXI_UCX_PEER_GONE : -1;
    kvxi_ucx_pidfd_close(p, pr);
    kvxi_ucx_cma_free(pr); /* written when its rkeys went, above */
    pr->close_needed = false;
    pr->err_pending = false;
    pr->used = false;
}

int kvxi_ucx_peer_status(kvx_pipe *base, kvx_peer peer)
{
    kvxi_ucx_peer *pr = kvxi_ucx_peer_get((kvxi_ucx_pipe *)base, peer);
    if (!pr) return TD_EINVAL;
    return pr->status;
}

int kvxi_ucx_mem_reg(kvx_pipe *base, void *addr, size_t len, kvx_mem **out)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
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
        return kvxi_ucx_err(st);
    }
    if (getrandom(m->key, sizeof(m->key), 0) != (ssize_t)sizeof(m->key)) {
        TD_LOG_ERR("kvx ucx: register: no random key for the region: %s", strerror(errno));
        ucp_mem_unmap(p->ctx, m->memh);
        free(m);
        return TD_EIO;
    }
    m->base = addr;
    m->len = len;
    m->fd = -1;
    m->next = p->mems;
    if (p->mems) p->mems->prev = m;
    p->mems = m;
    p->n_mems++;
    *out = m;
    return 0;
}

int kvxi_ucx_mem_reg_fd(kvx_pipe *base, void *addr, size_t len, int fd, uint64_t off, kvx_mem **out)
{
    int rc = kvxi_ucx_mem_reg(base, addr, len, out);
    if (!rc) {
        (*out)->fd = fd;
        (*out)->fd_off = off;
    }
    return rc;
}

void kvxi_ucx_mem_dereg(kvx_pipe *base, kvx_mem *m)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    ucp_mem_unmap(p->ctx, m->memh);
    if (m->prev)
        m->prev->next = m->next;
    else
        p->mems = m->next;
    if (m->next) m->next->prev = m->prev;
    p->n_mems--;
    free(m);
}

int kvxi_ucx_rkey_pack(kvx_pipe *base, kvx_mem *m, void *buf, size_t cap, size_t *len)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    void *rb;
    size_t n;
    ucs_status_t st = ucp_rkey_pack(p->ctx, m->memh, &rb, &n);
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: rkey pack: %s", ucs_status_string(st));
        return kvxi_ucx_err(st);
    }
    /* the registration's key first (amput.c checks it) and whether puts must be amputs (a
     * pipe without UCX's puts: a writer that uses UCX's would have its puts dropped), then,
     * over shared memory, the region's bounds in this process (kvx_pipe_ucx_cma.c) */
    uint8_t hdr[64];
    kvx_wr w;
    kvx_wr_init(&w, hdr, sizeof(hdr));
    kvx_wr_u64(&w, m->key[0]);
    kvx_wr_u64(&w, m->key[1]);
    kvx_wr_u32(&w, p->am_puts ? KVXI_RKEY_AM_ONLY : 0);
    size_t h = w.len + (p->shm ? kvxi_ucx_cma_key_write(m, hdr + w.len, sizeof(hdr) - w.len) : 0);
    uint8_t *pl = malloc(h + n);
    bool ok = false;
    if (pl) {
        memcpy(pl, hdr, h);
        memcpy(pl + h, rb, n);
        ok = kvx_frame_write(buf, cap, KVX_MAGIC_RKEY, KVX_KIND_UCX, pl, h + n, len);
        free(pl);
    }
    ucp_rkey_buffer_release(rb);
    if (!pl) return TD_ENOMEM;
    if (!ok) {
        TD_LOG_ERR("kvx ucx: rkey needs %zu bytes, buffer has %zu", *len, cap);
        return TD_ERANGE;
    }
    return 0;
}

int kvxi_ucx_rkey_unpack(kvx_pipe *base, kvx_peer peer, const void *buf, size_t len, kvx_rkey **out)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    kvxi_ucx_peer *pr = kvxi_ucx_peer_get(p, peer);
    const void *pl;
    size_t n;
    if (!pr) return TD_EINVAL;
    if (pr->status || !pr->ep) return TD_EIO;
    if (kvx_frame_read(buf, len, KVX_MAGIC_RKEY, KVX_KIND_UCX, &pl, &n) || n == 0) {
        TD_LOG_ERR("kvx ucx: malformed rkey (%zu bytes)", len);
        return TD_EFORMAT;
    }
    kvx_rd rd;
    kvx_rd_init(&rd, pl, n);
    uint64_t key0 = kvx_rd_u64(&rd), key1 = kvx_rd_u64(&rd);
    uint32_t flags = kvx_rd_u32(&rd);
    if (!rd.ok || rd.off == n || (flags & ~KVXI_RKEY_AM_ONLY)) {
        TD_LOG_ERR("kvx ucx: malformed rkey (%zu bytes)", len);
        return TD_EFORMAT;
    }
    pl = (const uint8_t *)pl + rd.off;
    n -= rd.off;
    kvx_rkey *rk = calloc(1, sizeof(*rk));
    if (!rk) return TD_ENOMEM;
    rk->key[0] = key0;
    rk->key[1] = key1;
    rk->am = (flags & KVXI_RKEY_AM_ONLY) && !p->shm; /* shm lists never mix with tcp ones */
    if (p->shm) {
        size_t h = kvxi_ucx_cma_key_read(p, rk, pr, pl, n);
        if (!h || h == n) {
            TD_LOG_ERR("kvx ucx: malformed shared-memory rkey (%zu bytes)", len);
            kvxi_ucx_cma_unmap(rk);
            free(rk);
            return TD_EFORMAT;
        }
        pl = (const uint8_t *)pl + h;
    }
    ucs_status_t st = ucp_ep_rkey_unpack(pr->ep, pl, &rk->rkey);
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: rkey unpack: %s", ucs_status_string(st));
        kvxi_ucx_cma_unmap(rk);
        free(rk);
        return kvxi_ucx_err(st);
    }
    rk->peer = peer;
    pr->am = pr->am || rk->am;
    rk->next = p->rkeys;
    if (p->rkeys) p->rkeys->prev = rk;
    p->rkeys = rk;
    p->n_rkeys++;
    *out = rk;
    return 0;
}

void kvxi_ucx_rkey_destroy(kvx_pipe *base, kvx_rkey *rk)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    kvxi_ucx_peer *pr = kvxi_ucx_peer_get(p, rk->peer);
    if (pr && pr->cq && pr->cq->n) { /* queued puts may name rk: write them first */
        int err = kvxi_ucx_cma_drain(p, pr);
        if (err) pr->cq->err = err;
    }
    ucp_rkey_destroy(rk->rkey);
    kvxi_ucx_cma_unmap(rk);
    if (rk->prev)
        rk->prev->next = rk->next;
    else
        p->rkeys = rk->next;
    if (rk->next) rk->next->prev = rk->prev;
    p->n_rkeys--;
    free(rk);
}
