/* kvx_pipe_ucx_op.c: the UCX pipe's operations (put, flush, active and tagged messages) and
 * their completion: every operation with a callback is a kvxi_ucx_op on the pipe's list
 * until progress delivers it, or, if its peer failed first, until it is reported and kept
 * as a zombie (see kvx_pipe_ucx_int.h). */
#include <stdlib.h>
#include <string.h>

#include "kvx_pipe_ucx_int.h"

kvxi_ucx_op *kvxi_ucx_op_new(kvxi_ucx_pipe *p, kvx_peer peer, kvx_done_cb cb, void *arg)
{
    kvxi_ucx_op *op = calloc(1, sizeof(*op));
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

static void op_detach(kvxi_ucx_op *op)
{
    kvxi_ucx_pipe *p = op->pipe;
    kvxi_ucx_op **head = op->zombie ? &p->zombies : &p->ops;
    if (op->prev)
        op->prev->next = op->next;
    else
        *head = op->next;
    if (op->next) op->next->prev = op->prev;
    op->next = op->prev = NULL;
    if (!op->zombie) p->n_ops--;
}

void kvxi_ucx_op_unlink(kvxi_ucx_op *op)
{
    op_detach(op);
    free(op->copy);
    free(op);
}

void kvxi_ucx_op_complete(kvxi_ucx_op *op, int status, size_t len)
{
    op->done = true;
    op->status = status;
    op->len = len;
    op->pipe->any_done = true;
}

int kvxi_ucx_op_started(kvxi_ucx_op *op, ucs_status_ptr_t sp, const char *what)
{
    if (sp == NULL) {
        kvxi_ucx_op_complete(op, 0, op->len);
        return 0;
    }
    if (UCS_PTR_IS_ERR(sp)) {
        int err = kvxi_ucx_err(UCS_PTR_STATUS(sp));
        TD_LOG_ERR("kvx ucx: %s failed: %s", what, ucs_status_string(UCS_PTR_STATUS(sp)));
        kvxi_ucx_op_unlink(op);
        return err;
    }
    op->req = sp; /* the callback frees it */
    return 0;
}

void kvxi_ucx_send_cb(void *req, ucs_status_t st, void *user)
{
    kvxi_ucx_op *op = user;
    if (op->zombie) { /* its owner heard about it long ago */
        kvxi_ucx_op_unlink(op);
        ucp_request_free(req);
        return;
    }
    op->req = NULL;
    kvxi_ucx_op_complete(op, kvxi_ucx_err(st), 0);
    ucp_request_free(req);
}

static void recv_cb(void *req, ucs_status_t st, const ucp_tag_recv_info_t *info, void *user)
{
    kvxi_ucx_op *op = user;
    if (op->zombie) {
        kvxi_ucx_op_unlink(op);
        ucp_request_free(req);
        return;
    }
    op->req = NULL;
    kvxi_ucx_op_complete(op, kvxi_ucx_err(st), st == UCS_OK ? info->length : 0);
    ucp_request_free(req);
}

void kvxi_ucx_op_zombify(kvxi_ucx_op *op, int status)
{
    kvxi_ucx_pipe *p = op->pipe;
    kvx_done_cb cb = op->cb;
    void *arg = op->arg;
    op_detach(op);
    op->zombie = true;
    op->cb = NULL;
    op->next = p->zombies;
    if (p->zombies) p->zombies->prev = op;
    p->zombies = op;
    if (cb) cb(arg, status, 0);
}

int kvxi_ucx_deliver_done(kvxi_ucx_pipe *p)
{
    int n = 0;
    while (p->any_done) {
        p->any_done = false;
        kvxi_ucx_op *op = p->ops, *next;
        for (; op; op = next) {
            next = op->next;
            if (!op->done) continue;
            kvx_done_cb cb = op->cb;
            void *arg = op->arg;
            int st = op->status;
            size_t len = op->len;
            kvxi_ucx_op_unlink(op);
            if (cb) cb(arg, st, len);
            n++;
            next = p->ops; /* the callback may have changed the list */
        }
    }
    return n;
}

/* Operations still in flight on a failed or force-closed endpoint (after UCX had its
 * chance to complete them): the owner hears TD_EIO (or the peer's error) and the operation
 * becomes a zombie (see kvx_pipe_ucx_int.h). Returns how many were reported. */
int kvxi_ucx_orphan_ops(kvxi_ucx_pipe *p)
{
    int n = 0;
    for (kvxi_ucx_op *op = p->ops, *next; op; op = next) {
        next = op->next;
        if (op->done || (!op->req && !op->ack_wait) || op->peer == -1) continue;
        int st = TD_EIO;
        if (op->peer >= 0) {
            kvxi_ucx_peer *pr = op->peer < p->n_peers ? p->peers[op->peer] : NULL;
            if (!pr || !pr->status || pr->ep) continue; /* healthy, or not closed yet */
            st = pr->status;
        }
        if (op->req)
            kvxi_ucx_op_zombify(op, st);
        else /* an active-message flush whose ACK cannot come any more */
            kvxi_ucx_op_complete(op, st, 0);
        n++;
        next = p->ops; /* the callback may have changed the list */
    }
    return n;
}

/* Shared memory: a message to a peer goes after the puts queued for it (cma.c); a failed
 * write is for the next flush to report. */
static void drain_for_message(kvxi_ucx_pipe *p, kvx_peer peer)
{
    kvxi_ucx_peer *pr = kvxi_ucx_peer_get(p, peer);
    int err = pr ? kvxi_ucx_cma_drain(p, pr) : 0;
    if (err) pr->cq->err = err;
}

static ucp_ep_h live_ep(kvxi_ucx_pipe *p, kvx_peer peer, int *err)
{
    kvxi_ucx_peer *pr = kvxi_ucx_peer_get(p, peer);
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

int kvxi_ucx_rma_put(ucp_ep_h ep, const void *src, size_t len, uint64_t raddr, kvx_rkey *rk)
{
    ucp_request_param_t prm = {.op_attr_mask = 0};
    ucs_status_ptr_t sp = ucp_put_nbx(ep, src, len, raddr, rk->rkey, &prm);
    if (UCS_PTR_IS_ERR(sp)) {
        TD_LOG_ERR("kvx ucx: put %zu bytes: %s", len, ucs_status_string(UCS_PTR_STATUS(sp)));
        return kvxi_ucx_err(UCS_PTR_STATUS(sp));
    }
    if (sp) ucp_request_free(sp);
    return 0;
}

int kvxi_ucx_put(kvx_pipe *base, kvx_peer peer, const void *src, size_t len, uint64_t raddr,
                 kvx_rkey *rk)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    int err;
    ucp_ep_h ep = live_ep(p, peer, &err);
    if (!ep) return err;
    if (!rk || rk->peer != peer) return TD_EINVAL;
    if (p->am_puts || rk->am) return kvxi_ucx_amput(p, peer, ep, src, len, raddr, rk);
    if (rk->cma_len && (rk->map || p->cma_puts))
        return kvxi_ucx_cma_put(p, kvxi_ucx_peer_get(p, peer), src, len, raddr, rk);
    return kvxi_ucx_rma_put(ep, src, len, raddr, rk);
}

int kvxi_ucx_flush(kvx_pipe *base, kvx_peer peer, kvx_done_cb cb, void *arg)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    int err;
    ucp_ep_h ep = live_ep(p, peer, &err);
    if (!ep) return err;
    if (p->am_puts || kvxi_ucx_peer_get(p, peer)->am) return kvxi_ucx_amflush(p, peer, ep, cb, arg);
    if ((err = kvxi_ucx_cma_drain(p, kvxi_ucx_peer_get(p, peer)))) return err;
    kvxi_ucx_op *op = kvxi_ucx_op_new(p, peer, cb, arg);
    if (!op) return TD_ENOMEM;
    ucp_request_param_t prm = {.op_attr_mask =
                                   UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                               .cb.send = kvxi_ucx_send_cb,
                               .user_data = op};
    return kvxi_ucx_op_started(op, ucp_ep_flush_nbx(ep, &prm), "flush");
}

ucs_status_t kvxi_ucx_am_recv(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                              const ucp_am_recv_param_t *prm)
{
    kvxi_ucx_am *h = arg;
    if (prm->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        TD_LOG_ERR("kvx ucx: dropped a rendezvous active message of %zu bytes", len);
        return UCS_OK;
    }
    if (h->cb) h->cb(h->arg, data, len);
    return UCS_OK;
}

int kvxi_ucx_set_am_handler(kvx_pipe *base, unsigned id, kvx_am_cb cb, void *arg)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    if (id >= KVX_AM_IDS) return TD_EINVAL;
    p->am[id].cb = cb;
    p->am[id].arg = arg;
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = id,
        .cb = cb ? kvxi_ucx_am_recv : NULL,
        .arg = &p->am[id],
    };
    ucs_status_t st = ucp_worker_set_am_recv_handler(p->worker, &hp);
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: set am handler %u: %s", id, ucs_status_string(st));
        return kvxi_ucx_err(st);
    }
    return 0;
}

int kvxi_ucx_am_send(kvx_pipe *base, kvx_peer peer, unsigned id, const void *buf, size_t len,
                     kvx_done_cb cb, void *arg)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    int err;
    if (id >= KVX_AM_IDS || len > KVX_AM_MAX) return TD_EINVAL;
    ucp_ep_h ep = live_ep(p, peer, &err);
    if (!ep) return err;
    drain_for_message(p, peer);
    kvxi_ucx_op *op = kvxi_ucx_op_new(p, peer, cb, arg);
    if (!op) return TD_ENOMEM;
    op->copy = malloc(len ? len : 1);
    if (!op->copy) {
        kvxi_ucx_op_unlink(op);
        return TD_ENOMEM;
    }
    memcpy(op->copy, buf, len);
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                               UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FIELD_FLAGS,
                               .cb.send = kvxi_ucx_send_cb,
                               .user_data = op,
                               .flags = UCP_AM_SEND_FLAG_EAGER};
    return kvxi_ucx_op_started(op, ucp_am_send_nbx(ep, id, NULL, 0, op->copy, len, &prm), "am send");
}

int kvxi_ucx_tag_send(kvx_pipe *base, kvx_peer peer, uint64_t tag, const void *buf, size_t len,
                      kvx_done_cb cb, void *arg)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    int err;
    ucp_ep_h ep = live_ep(p, peer, &err);
    if (!ep) return err;
    drain_for_message(p, peer);
    kvxi_ucx_op *op = kvxi_ucx_op_new(p, peer, cb, arg);
    if (!op) return TD_ENOMEM;
    ucp_request_param_t prm = {.op_attr_mask =
                                   UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                               .cb.send = kvxi_ucx_send_cb,
                               .user_data = op};
    return kvxi_ucx_op_started(op, ucp_tag_send_nbx(ep, buf, len, tag, &prm), "tag send");
}

int kvxi_ucx_tag_recv(kvx_pipe *base, uint64_t tag, void *buf, size_t cap, kvx_done_cb cb,
                      void *arg)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    kvxi_ucx_op *op = kvxi_ucx_op_new(p, -1, cb, arg);
    if (!op) return TD_ENOMEM;
    op->len = 0;
    /* no immediate completion: the length is reported by the callback */
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                               UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
                               .cb.recv = recv_cb,
                               .user_data = op};
    return kvxi_ucx_op_started(op, ucp_tag_recv_nbx(p->worker, buf, cap, tag, UINT64_MAX, &prm), "tag recv");
}
