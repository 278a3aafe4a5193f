/* pf_chain.c: the stage chain transport: buffers, in-order sends and receives of chain
 * messages, the queue of control messages, the reports to stage 0 (see pf_chain.h). */
#include "pf_chain.h"

#include <poll.h>
#include <stdlib.h>
#include <string.h>

#include "td_clock.h"
#include "td_err.h"

struct pf_ctl {
    struct pf_ctl *next;
    size_t len;
    uint8_t data[]; /* (len) a whole chain message */
};

static void forget_peers(pf_chain *c)
{
    c->next_peer = c->lead_peer = -1;
    for (int s = 0; s < PF_MAX_STAGES; s++)
        c->member_peer[s] = -1;
}

static int alloc_bufs(pf_buf *b, int n, size_t cap)
{
    for (int i = 0; i < n; i++) {
        b[i].buf = aligned_alloc(64, (cap + 63) & ~(size_t)63);
        b[i].cap = cap;
        if (!b[i].buf) return TD_ENOMEM;
    }
    return 0;
}

int pf_chain_init(pf_chain *c, const pf_chain_params *p)
{
    memset(c, 0, sizeof *c);
    c->instance = p->instance;
    c->stage = p->stage;
    c->pp = p->pp;
    c->first = p->first;
    c->last = p->last;
    c->tls = p->tls;
    c->host = p->host;
    c->stop = p->stop;
    forget_peers(c);
    int rc = 0;
    if (!c->last) rc = alloc_bufs(c->sends, PF_NSEND, p->msg_cap);
    if (!rc && !c->first) rc = alloc_bufs(c->recvs, PF_NRECV, p->msg_cap);
    return rc;
}

void pf_chain_fini(pf_chain *c)
{
    pf_chain_close(c);
    for (int i = 0; i < PF_NSEND; i++)
        free(c->sends[i].buf);
    for (int i = 0; i < PF_NRECV; i++)
        free(c->recvs[i].buf);
    memset(c->sends, 0, sizeof c->sends);
    memset(c->recvs, 0, sizeof c->recvs);
}

static void ctl_drop_all(pf_chain *c)
{
    while (c->ctl_head) {
        pf_ctl *m = c->ctl_head;
        c->ctl_head = m->next;
        free(m);
    }
    c->ctl_tail = NULL;
}

int pf_chain_open(pf_chain *c)
{
    int rc = pf_link_create(c->tls, c->host, &c->link);
    c->send_seq = c->recv_seq = 1;
    c->broken = false;
    return rc;
}

void pf_chain_close(pf_chain *c)
{
    ctl_drop_all(c);          /* the messages were for this chain only */
    pf_link_destroy(c->link); /* completes pending sends/receives with an error */
    c->link = NULL;
    for (int i = 0; i < PF_NSEND; i++)
        c->sends[i].busy = false;
    for (int i = 0; i < PF_NRECV; i++)
        c->recvs[i].busy = false;
    forget_peers(c);
}

int pf_chain_start(pf_chain *c, const uint8_t *const *addrs, const size_t *lens)
{
    int rc = 0;
    if (c->stage == 0) {
        for (int s = 1; s < c->pp && !rc; s++)
            rc = pf_link_connect(c->link, addrs[s], lens[s], &c->member_peer[s]);
        c->next_peer = c->pp > 1 ? c->member_peer[1] : -1;
    } else {
        rc = pf_link_connect(c->link, addrs[0], lens[0], &c->lead_peer);
        if (!rc && !c->last)
            rc = pf_link_connect(c->link, addrs[c->stage + 1], lens[c->stage + 1], &c->next_peer);
    }
    for (int i = 0; !rc && !c->first && i < PF_NRECV; i++) {
        rc = pf_link_recv(c->link, PF_TAG_CHAIN, c->recvs[i].buf, c->recvs[i].cap, &c->recvs[i].op);
        c->recvs[i].busy = !rc;
    }
    if (rc)
        TD_LOG_ERR("prefill %s stage %d: cannot connect the stage chain: %s", c->instance, c->stage,
                   td_strerror(rc));
    return rc;
}

int pf_chain_address(pf_chain *c, void *buf, size_t cap, size_t *len)
{
    return pf_link_address(c->link, buf, cap, len);
}

void pf_chain_wait(pf_chain *c, int extra_fd, int timeout_ms)
{
    struct pollfd pfd[2];
    int k = 0;
    if (c->link) pfd[k++] = (struct pollfd){.fd = pf_link_wake_fd(c->link), .events = POLLIN};
    if (extra_fd >= 0) pfd[k++] = (struct pollfd){.fd = extra_fd, .events = POLLIN};
    poll(pfd, (nfds_t)k, timeout_ms);
    if (c->link) pf_link_clear_wake(c->link);
}

static bool peer_dead(pf_chain *c, kvx_peer p)
{
    return p >= 0 && c->link && pf_link_peer_failed(c->link, p) != 0;
}

bool pf_chain_stage_failed(pf_chain *c, int s)
{
    return c->link && pf_link_peer_failed(c->link, c->member_peer[s]);
}

bool pf_chain_neighbour_failed(pf_chain *c)
{
    return pf_link_peer_failed(c->link, c->lead_peer) ||
           (c->next_peer >= 0 && pf_link_peer_failed(c->link, c->next_peer));
}

/* ---- sending ---- */

pf_buf *pf_chain_free_send(pf_chain *c, int timeout_ms)
{
    int64_t until = td_now_ms() + timeout_ms;
    for (;;) {
        for (int i = 0; i < PF_NSEND; i++) {
            pf_buf *b = &c->sends[i];
            if (b->busy && pf_op_done(&b->op)) {
                b->busy = false;
                if (b->op.status) {
                    TD_LOG_ERR("prefill %s stage %d: send to stage %d failed: %s", c->instance,
                               c->stage, c->stage + 1, td_strerror(b->op.status));
                    c->broken = true;
                }
            }
        }
        if (c->broken || !c->link || peer_dead(c, c->next_peer)) {
            c->broken = true;
            return NULL;
        }
        for (int i = 0; i < PF_NSEND; i++)
            if (!c->sends[i].busy) return &c->sends[i];
        if (td_now_ms() >= until || *c->stop) return NULL;
        pf_chain_wait(c, -1, 20);
    }
}

int pf_chain_post(pf_chain *c, pf_buf *b, size_t len)
{
    uint64_t seq = c->send_seq++;
    memcpy(b->buf + 8, &seq, 8); /* the seq of this hop (pf_wire header layout) */
    int rc = pf_link_send(c->link, c->next_peer, PF_TAG_CHAIN, b->buf, len, &b->op);
    if (rc) {
        c->broken = true;
        return rc;
    }
    b->busy = true;
    return 0;
}

bool pf_chain_queue_empty(const pf_chain *c)
{
    return !c->ctl_head;
}

int pf_chain_flush(pf_chain *c)
{
    while (c->ctl_head) {
        pf_buf *b = pf_chain_free_send(c, 0);
        if (!b) return c->broken ? TD_EIO : 0;
        pf_ctl *m = c->ctl_head;
        if (m->len > b->cap) return TD_ERANGE;
        memcpy(b->buf, m->data, m->len);
        if (pf_chain_post(c, b, m->len)) return TD_EIO;
        c->ctl_head = m->next;
        if (!c->ctl_head) c->ctl_tail = NULL;
        free(m);
    }
    return 0;
}

int pf_chain_send_msg(pf_chain *c, const void *msg, size_t len)
{
    if (c->last || !c->link) return 0;
    pf_ctl *m = malloc(sizeof *m + len);
    if (!m) return TD_ENOMEM;
    m->next = NULL;
    m->len = len;
    memcpy(m->data, msg, len);
    if (c->ctl_tail)
        c->ctl_tail->next = m;
    else
        c->ctl_head = m;
    c->ctl_tail = m;
    return pf_chain_flush(c);
}

/* ---- receiving ---- */

int pf_chain_next(pf_chain *c, pf_buf **out)
{
    *out = NULL;
    for (int i = 0; i < PF_NRECV; i++) {
        pf_buf *b = &c->recvs[i];
        if (!b->busy || !pf_op_done(&b->op)) continue;
        if (b->op.status) {
            TD_LOG_ERR("prefill %s stage %d: receive from stage %d failed: %s", c->instance,
                       c->stage, c->stage - 1, td_strerror(b->op.status));
            c->broken = true;
            return b->op.status;
        }
        uint64_t seq = 0;
        if (b->op.len >= 16) memcpy(&seq, b->buf + 8, 8);
        if (seq == c->recv_seq) *out = b; /* receives may complete out of order */
    }
    return *out != NULL;
}

int pf_chain_recv_done(pf_chain *c, pf_buf *b, int err)
{
    c->recv_seq++;
    b->busy = false;
    if (err) {
        TD_LOG_ERR("prefill %s stage %d: chain message %llu: %s", c->instance, c->stage,
                   (unsigned long long)(c->recv_seq - 1), td_strerror(err));
        c->broken = true;
        return err;
    }
    int rc = pf_link_recv(c->link, PF_TAG_CHAIN, b->buf, b->cap, &b->op);
    if (rc) {
        c->broken = true;
        return rc;
    }
    b->busy = true;
    return 0;
}

/* ---- reports ---- */

void pf_chain_report(pf_chain *c, const pf_report *r)
{
    if (!c->link || c->lead_peer < 0) return; /* stage 0 fails it when the chain re-forms */
    uint8_t b[PF_REPORT_BYTES];
    pf_wire_report_write(b, r);
    if (pf_link_report(c->link, c->lead_peer, b, sizeof b)) c->broken = true;
}

void pf_chain_report_msg(pf_chain *c, const void *msg, size_t len)
{
    if (!c->link || c->lead_peer < 0) return;
    if (pf_link_report(c->link, c->lead_peer, msg, len)) c->broken = true;
}

uint32_t pf_chain_take_report(pf_chain *c, pf_report *rep, uint8_t *lp, size_t *lp_len)
{
    if (!c->link) return 0;
    size_t len;
    while (pf_link_take_report(c->link, lp, &len)) {
        uint32_t kind = pf_wire_kind(lp, len);
        if (kind == PF_MSG_REPORT && !pf_wire_report_parse(lp, len, rep)) return kind;
        if (kind == PF_MSG_LOGPROBS) {
            *lp_len = len;
            return kind;
        }
        if (kind != PF_MSG_REPORT) TD_LOG_WARN("prefill chain: unknown report dropped");
    }
    return 0;
}
