/* kvx_pipe_ucx_amput.c: puts and flushes as the pipe's own active messages, on transports
 * that have no remote memory access (tcp).
 *
 * Why: UCX 1.13 emulates a put over tcp with active messages of its own (UCP PUT, id 17)
 * and the receiver answers every one with a completion (CMPL) through its endpoint to the
 * writer, from inside UCX (ucp_put_handler -> ucp_rma_sw_send_cmpl). When the writer is
 * killed with puts still in the receiver's socket, that endpoint can already be failed when
 * the CMPL goes out; UCX then calls ucs_fatal("unexpected error: Endpoint timeout") and the
 * receiver (a decode rank) dies with the prefill stage that was writing into it. Nothing on
 * our side of the API closes that window (kvxfer/README.md). Here the receiver sends
 * nothing per put: one acknowledgement per flush, as a user request whose failure reaches
 * its callback like any other.
 *
 * Protocol (ids above the users' 0..KVX_AM_IDS-1 and the probe's):
 *   PUT   header {raddr, key[2]}, data: at most KVXI_AMPUT_PIECE bytes; eager (the handler
 *         sees the whole piece), sent with UCP_AM_SEND_FLAG_REPLY. The receiver copies it into
 *         the registration that holds [raddr, raddr + len) when the key is that
 *         registration's (kvx_mem.key: 128 random bits, known only to whoever was given its
 *         rkey, which travels inside the decode target over the control plane), or counts it
 *         as bad for its sender: a process that reaches this worker's port but was never
 *         given a target cannot write into the KV pool (issue 44).
 *   FLUSH header {seq}, eager, REPLY: handled after every PUT the sender issued before it
 *         (eager messages of one endpoint reach their handlers in order); the receiver
 *         answers at once, from the handler, through the reply endpoint:
 *   ACK   header {seq, status}: status 0, or TD_EINVAL when a put since the sender's last
 *         flush fell outside every registration. The sender's flush completes with it.
 * A sender whose endpoint fails before the ACK arrives: its flush fails with the peer's
 * error (kvxi_ucx_orphan_ops). The source of a put stays borrowed until its flush completed
 * (kvx_pipe.h), which covers these sends too: the ACK comes after the data arrived.
 */
#include <stdlib.h>
#include <string.h>

#include "kvx_pipe_ucx_int.h"

#define KVXI_AMPUT_PIECE (256u << 10) /* bytes per PUT message: the receiver assembles one */

typedef struct {
    uint64_t seq;
    int32_t status;
    uint32_t pad;
} ack_hdr;

/* --- receiver -------------------------------------------------------------------------- */

/* The bad-put count of the sender behind reply_ep (created at 0 when add). */
static uint32_t *bad_slot(kvxi_ucx_pipe *p, ucp_ep_h ep, bool add)
{
    for (int i = 0; i < p->n_bad; i++)
        if (p->bad[i].ep == ep) return &p->bad[i].n;
    if (!add) return NULL;
    if (p->n_bad == KVXI_UCX_BAD_MAX) { /* the oldest is forgotten */
        memmove(p->bad, p->bad + 1, (KVXI_UCX_BAD_MAX - 1) * sizeof(p->bad[0]));
        p->n_bad--;
    }
    p->bad[p->n_bad] = (kvxi_ucx_bad){.ep = ep, .n = 0};
    return &p->bad[p->n_bad++].n;
}

static bool in_mem(const kvx_mem *m, uint64_t addr, size_t len)
{
    uint64_t base = (uint64_t)(uintptr_t)m->base;
    return addr >= base && len <= m->len && addr - base <= m->len - len;
}

ucs_status_t kvxi_ucx_amput_recv(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                                 const ucp_am_recv_param_t *prm)
{
    kvxi_ucx_pipe *p = arg;
    ucp_ep_h ep = (prm->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? prm->reply_ep : NULL;
    uint64_t h[3] = {0}; /* raddr, key */
    bool ok = hlen == sizeof(h) && !(prm->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV);
    if (ok) memcpy(h, hdr, sizeof(h));
    kvx_mem *m = p->mems;
    while (ok && m && !in_mem(m, h[0], len))
        m = m->next;
    /* compared without an early exit: the time does not tell how much of a guess was right */
    bool keyed = m && ((m->key[0] ^ h[1]) | (m->key[1] ^ h[2])) == 0;
    if (ok && keyed) {
        memcpy((void *)(uintptr_t)h[0], data, len);
        return UCS_OK;
    }
    uint32_t *bad = bad_slot(p, ep, true);
    if (bad && (*bad)++ == 0) {
        if (!ok)
            TD_LOG_ERR("kvx ucx: a peer's put of %zu bytes has a malformed header (%zu bytes): "
                       "dropped (its next flush fails)",
                       len, hlen);
        else if (m)
            TD_LOG_ERR("kvx ucx: refused a peer's put of %zu bytes at 0x%llx: it does not carry "
                       "the registration's key (a process that was never given a target): "
                       "dropped (its next flush fails)",
                       len, (unsigned long long)h[0]);
        else
            TD_LOG_ERR("kvx ucx: a peer's put of %zu bytes at 0x%llx is outside every "
                       "registration of this pipe: dropped (its next flush fails)",
                       len, (unsigned long long)h[0]);
    }
    return UCS_OK;
}

static void ack_sent(void *req, ucs_status_t st, void *user)
{
    (void)st; /* a sender that died meanwhile has no flush left to complete */
    free(user);
    ucp_request_free(req);
}

ucs_status_t kvxi_ucx_amflush_recv(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                                   const ucp_am_recv_param_t *prm)
{
    kvxi_ucx_pipe *p = arg;
    (void)data;
    (void)len;
    if (hlen != sizeof(uint64_t) || !(prm->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
        TD_LOG_ERR("kvx ucx: malformed flush message (%zu header bytes): ignored", hlen);
        return UCS_OK;
    }
    ack_hdr *a = calloc(1, sizeof(*a)); /* the header lives until the send completes */
    if (!a) return UCS_OK;              /* the sender's flush fails by its deadline */
    memcpy(&a->seq, hdr, sizeof(a->seq));
    uint32_t *bad = bad_slot(p, prm->reply_ep, false);
    a->status = bad && *bad ? TD_EINVAL : 0;
    if (bad) *bad = 0;
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                              UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS,
                              .cb.send = ack_sent,
                              .user_data = a,
                              .flags = UCP_AM_SEND_FLAG_EAGER};
    ucs_status_ptr_t sp =
        ucp_am_send_nbx(prm->reply_ep, KVXI_UCX_AMACK_ID, a, sizeof(*a), NULL, 0, &rp);
    if (!UCS_PTR_IS_PTR(sp)) free(a); /* done at once, or failed (the sender is gone) */
    return UCS_OK;
}

/* --- sender ---------------------------------------------------------------------------- */

ucs_status_t kvxi_ucx_amack_recv(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                                 const ucp_am_recv_param_t *prm)
{
    kvxi_ucx_pipe *p = arg;
    (void)data;
    (void)len;
    (void)prm;
    ack_hdr a;
    if (hlen != sizeof(a)) return UCS_OK;
    memcpy(&a, hdr, sizeof(a));
    for (kvxi_ucx_op *op = p->ops; op; op = op->next)
        if (op->ack_wait && op->ack_seq == a.seq && !op->done) {
            op->ack_wait = false;
            op->acked = true;
            op->ack_status = a.status;
            if (!op->req) kvxi_ucx_op_complete(op, a.status, 0);
            break;
        }
    return UCS_OK;
}

int kvxi_ucx_amput(kvxi_ucx_pipe *p, kvx_peer peer, ucp_ep_h ep, const void *src, size_t len,
                   uint64_t raddr, const kvx_rkey *rk)
{
    for (size_t off = 0; off < len;) { /* nothing to move for len 0 */
        size_t n = len - off < KVXI_AMPUT_PIECE ? len - off : KVXI_AMPUT_PIECE;
        kvxi_ucx_op *op = kvxi_ucx_op_new(p, peer, NULL, NULL);
        if (!op) return TD_ENOMEM;
        op->hdr[0] = raddr + off; /* the header lives in the op until the send completes */
        op->hdr[1] = rk->key[0];
        op->hdr[2] = rk->key[1];
        ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                                   UCP_OP_ATTR_FIELD_USER_DATA |
                                                   UCP_OP_ATTR_FIELD_FLAGS,
                                   .cb.send = kvxi_ucx_send_cb, /* the op has no user callback */
                                   .user_data = op,
                                   .flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY};
        ucs_status_ptr_t sp = ucp_am_send_nbx(ep, KVXI_UCX_AMPUT_ID, op->hdr, sizeof(op->hdr),
                                              (const char *)src + off, n, &prm);
        int err = kvxi_ucx_op_started(op, sp, "put");
        if (err) return err;
        off += n;
    }
    return 0;
}

/* The FLUSH message is out; the flush completes when the ACK is in too. */
static void flush_sent(void *req, ucs_status_t st, void *user)
{
    kvxi_ucx_op *op = user;
    ucp_request_free(req);
    if (op->zombie) {
        kvxi_ucx_op_unlink(op);
        return;
    }
    op->req = NULL;
    if (st != UCS_OK)
        kvxi_ucx_op_complete(op, kvxi_ucx_err(st), 0);
    else if (op->acked)
        kvxi_ucx_op_complete(op, op->ack_status, 0);
}

int kvxi_ucx_amflush(kvxi_ucx_pipe *p, kvx_peer peer, ucp_ep_h ep, kvx_done_cb cb, void *arg)
{
    kvxi_ucx_op *op = kvxi_ucx_op_new(p, peer, cb, arg);
    if (!op) return TD_ENOMEM;
    op->hdr[0] = ++p->amflush_seq;
    op->ack_seq = op->hdr[0];
    op->ack_wait = true;
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                               UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FIELD_FLAGS,
                               .cb.send = flush_sent,
                               .user_data = op,
                               .flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY};
    ucs_status_ptr_t sp =
        ucp_am_send_nbx(ep, KVXI_UCX_AMFLUSH_ID, op->hdr, sizeof(op->hdr[0]), NULL, 0, &prm);
    if (sp == NULL) return 0; /* out at once: now the ACK */
    if (UCS_PTR_IS_ERR(sp)) {
        TD_LOG_ERR("kvx ucx: flush failed: %s", ucs_status_string(UCS_PTR_STATUS(sp)));
        kvxi_ucx_op_unlink(op);
        return kvxi_ucx_err(UCS_PTR_STATUS(sp));
    }
    op->req = sp;
    return 0;
}
