/* kvx_pipe_ucx_probe.c: the UCX pipe's wedge probe and worker replacement (shared memory).
 *
 * A wedged receive queue: UCX's posix/sysv transports give each worker one receive FIFO
 * that every peer writes into: a writer reserves a slot (an atomic on the head), fills it,
 * then sets its owner flag; the reader stops at the first slot whose flag is not set. A
 * peer killed between the two leaves that slot reserved forever: the worker receives
 * nothing more from anyone (ACCEPTs, DONEs, and the completions of the puts, which UCX
 * emulates with active messages when the remote memory is not its own shared memory, so a
 * flush to a live peer never completes either). So after every peer death the pipe sends
 * itself a probe from a second worker through that FIFO; if it has not arrived after
 * PROBE_MS of progress, the FIFO is wedged: with kvx_pipe_allow_reset, every peer fails and
 * a new worker takes over (the old one is kept, never progressed, until destroy: its
 * requests may still point at our operations). */
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>

#include "kvx_pipe_ucx_int.h"
#include "td_clock.h"

#define PROBE_MS 1000 /* a probe not back after this long (and 3 progress calls) */

ucs_status_t kvxi_ucx_probe_recv(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                                 const ucp_am_recv_param_t *prm)
{
    kvxi_ucx_pipe *p = arg;
    uint64_t seq;
    if (len == sizeof(seq) && !(prm->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        memcpy(&seq, data, sizeof(seq));
        if (seq > p->probe_got) p->probe_got = seq;
    }
    return UCS_OK;
}

void kvxi_ucx_probe_ep_close(kvxi_ucx_pipe *p)
{
    if (!p->probe_ep) return;
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t sp = ucp_ep_close_nbx(p->probe_ep, &prm);
    if (sp && !UCS_PTR_IS_ERR(sp)) ucp_request_free(sp);
    p->probe_ep = NULL;
}

/* The receive FIFO is wedged: every peer fails, a new worker takes over. */
static void worker_replace(kvxi_ucx_pipe *p)
{
    ucp_worker_h nw = NULL;
    int nefd = -1;
    ucp_worker_h *nr = realloc(p->retired, (size_t)(p->n_retired + 1) * sizeof(*nr));
    if (nr) p->retired = nr;
    ucs_status_t st = nr ? kvxi_ucx_worker_open(p, &nw, &nefd) : UCS_ERR_NO_MEMORY;
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
    kvxi_ucx_probe_ep_close(p);
    p->probing = false;
    /* closes in progress belong to the old worker */
    for (int i = 0; i < p->n_closing; i++)
        ucp_request_free(p->closing[i]);
    p->n_closing = 0;
    /* every endpoint was on the old worker: the peers fail, their slots stay reserved */
    for (int i = 0; i < p->n_peers; i++) {
        kvxi_ucx_peer *pr = p->peers[i];
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
    for (kvxi_ucx_op *op = p->ops, *next; op; op = next) {
        next = op->next;
        if (op->done || !op->req) continue;
        kvxi_ucx_op_zombify(op, TD_EIO);
        next = p->ops; /* the callback may have changed the list */
    }
    TD_LOG_WARN("kvx ucx: a new UCX worker took over (generation %u): every peer of the old one "
                "failed",
                p->gen);
}

void kvxi_ucx_probe_step(kvxi_ucx_pipe *p)
{
    if (p->probing) {
        if (p->probe_w)
            while (ucp_worker_progress(p->probe_w)) {
            }
        while (ucp_worker_progress(p->worker)) {
        }
        if (p->probe_got >= p->probe_seq) {
            p->probing = false;
        } else if (++p->probe_rounds >= 3 && td_now_ms() > p->probe_deadline) {
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
    if (!p->probe_w && kvxi_ucx_worker_open(p, &p->probe_w, NULL) != UCS_OK) {
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
    ucs_status_ptr_t sp = ucp_am_send_nbx(p->probe_ep, KVXI_UCX_PROBE_AM_ID, NULL, 0, &p->probe_buf,
                                          sizeof(p->probe_buf), &prm);
    if (UCS_PTR_IS_ERR(sp)) return;
    if (sp) ucp_request_free(sp); /* completes in the probe worker's progress */
    p->probing = true;
    p->probe_rounds = 0;
    p->probe_deadline = td_now_ms() + PROBE_MS;
}
