/* pf_link.c: a kvxfer pipe with a progress thread (see pf_link.h). */
#include "pf_link.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "td_err.h"

#define MAX_PEERS 256

struct pf_link {
    kvx_pipe *pipe;
    pthread_mutex_t mu;
    pthread_t thread;
    bool thread_on, stop;
    int wake_fd;
    int peer_err[MAX_PEERS];
    bool connected[MAX_PEERS]; /* endpoints made by pf_link_connect */
    /* received reports, a ring */
    uint8_t *reports[PF_LINK_MAX_REPORTS]; /* malloc'd copies (up to PF_LINK_REPORT_MAX) */
    size_t report_len[PF_LINK_MAX_REPORTS];
    int r_head, r_count;
};

static void wake(pf_link *l)
{
    uint64_t one = 1;
    ssize_t w = write(l->wake_fd, &one, sizeof one);
    (void)w; /* a full counter is still readable */
}

static void on_done(void *arg, int status, size_t len)
{
    pf_op *op = arg;
    op->status = status;
    op->len = len;
    atomic_store_explicit(&op->done, 1, memory_order_release);
    wake(op->link);
}

static void on_peer_err(void *arg, kvx_peer peer, int status)
{
    pf_link *l = arg;
    if (peer >= 0 && peer < MAX_PEERS) l->peer_err[peer] = status ? status : TD_EIO;
    wake(l);
}

static void on_report(void *arg, const void *data, size_t len)
{
    pf_link *l = arg;
    if (len > PF_LINK_REPORT_MAX || l->r_count == PF_LINK_MAX_REPORTS) {
        TD_LOG_WARN("prefill link: report dropped (%zu bytes, %d queued)", len, l->r_count);
        return;
    }
    int i = (l->r_head + l->r_count) % PF_LINK_MAX_REPORTS;
    if (!(l->reports[i] = malloc(len ? len : 1))) {
        TD_LOG_WARN("prefill link: report dropped (%zu bytes): out of memory", len);
        return;
    }
    memcpy(l->reports[i], data, len);
    l->report_len[i] = len;
    l->r_count++;
    wake(l);
}

static void *progress_main(void *arg)
{
    pf_link *l = arg;
    for (;;) {
        pthread_mutex_lock(&l->mu);
        if (l->stop) {
            pthread_mutex_unlock(&l->mu);
            break;
        }
        int n = kvx_pipe_progress(l->pipe);
        int armed = n == 0 ? kvx_pipe_arm(l->pipe) : 0;
        int fd = kvx_pipe_event_fd(l->pipe);
        pthread_mutex_unlock(&l->mu);
        if (armed == 1) {
            /* wake at least every 100 ms: over shared memory a dead peer is only seen by
             * a progress call (the pipe watches its pid) */
            struct pollfd pfd = {.fd = fd, .events = POLLIN};
            poll(&pfd, 1, 100);
        }
    }
    return NULL;
}

int pf_link_create(const char *tls, const char *host, pf_link **out)
{
    *out = NULL;
    pf_link *l = calloc(1, sizeof *l);
    if (!l) return TD_ENOMEM;
    pthread_mutex_init(&l->mu, NULL);
    l->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    kvx_pipe_params pp = {.peer_err_cb = on_peer_err, .peer_err_arg = l, .tls = tls, .host = host};
    int rc = l->wake_fd < 0 ? TD_EIO : kvx_pipe_ucx_create(&pp, &l->pipe);
    if (!rc) rc = kvx_pipe_set_am_handler(l->pipe, 1, on_report, l);
    if (!rc) {
        if (pthread_create(&l->thread, NULL, progress_main, l))
            rc = TD_ENOMEM;
        else
            l->thread_on = true;
    }
    if (rc) {
        pf_link_destroy(l);
        return rc;
    }
    *out = l;
    return 0;
}

void pf_link_destroy(pf_link *l)
{
    if (!l) return;
    if (l->thread_on) {
        pthread_mutex_lock(&l->mu);
        l->stop = true;
        pthread_mutex_unlock(&l->mu);
        kvx_pipe_signal(l->pipe);
        pthread_join(l->thread, NULL);
    }
    /* A link is destroyed when its chain is over (broken, re-formed, or the stage stops):
     * nothing still in flight on it is wanted. Close every endpoint without flushing, so
     * its operations fail at once: a graceful close waits for the peer, and a peer that is
     * stopped (SIGSTOP, a stuck host) is not dead to the pipe (its process still exists),
     * so the destroy would wait out its bounds (1.3 s) with stage 0's loop blocked: no
     * Health answers, no ready: false, no new chain meanwhile. */
    for (int i = 0; l->pipe && i < MAX_PEERS; i++)
        if (l->connected[i]) kvx_pipe_disconnect(l->pipe, i, true);
    kvx_pipe_destroy(l->pipe); /* completes pending ops with an error */
    for (int k = 0; k < l->r_count; k++)
        free(l->reports[(l->r_head + k) % PF_LINK_MAX_REPORTS]);
    if (l->wake_fd >= 0) close(l->wake_fd);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

#define LOCKED(l, expr)                                                                            \
    ({                                                                                             \
        pthread_mutex_lock(&(l)->mu);                                                              \
        int rc_ = (expr);                                                                          \
        pthread_mutex_unlock(&(l)->mu);                                                            \
        kvx_pipe_signal((l)->pipe);                                                                \
        rc_;                                                                                       \
    })

int pf_link_address(pf_link *l, void *buf, size_t cap, size_t *len)
{
    return LOCKED(l, kvx_pipe_address(l->pipe, buf, cap, len));
}

int pf_link_connect(pf_link *l, const void *addr, size_t len, kvx_peer *out)
{
    int rc = LOCKED(l, kvx_pipe_connect(l->pipe, addr, len, out));
    if (!rc && (*out < 0 || *out >= MAX_PEERS)) {
        TD_LOG_ERR("prefill link: peer id %d out of range", *out);
        return TD_ERANGE;
    }
    if (!rc) l->connected[*out] = true;
    return rc;
}

int pf_link_send(pf_link *l, kvx_peer peer, uint64_t tag, const void *buf, size_t len, pf_op *op)
{
    pf_op_reset(op);
    op->link = l;
    return LOCKED(l, kvx_pipe_tag_send(l->pipe, peer, tag, buf, len, on_done, op));
}

int pf_link_recv(pf_link *l, uint64_t tag, void *buf, size_t cap, pf_op *op)
{
    pf_op_reset(op);
    op->link = l;
    return LOCKED(l, kvx_pipe_tag_recv(l->pipe, tag, buf, cap, on_done, op));
}

int pf_link_report(pf_link *l, kvx_peer peer, const void *buf, size_t len)
{
    return LOCKED(l, kvx_pipe_am_send(l->pipe, peer, 1, buf, len, NULL, NULL));
}

bool pf_link_take_report(pf_link *l, void *buf, size_t *len)
{
    pthread_mutex_lock(&l->mu);
    bool got = l->r_count > 0;
    if (got) {
        memcpy(buf, l->reports[l->r_head], l->report_len[l->r_head]);
        free(l->reports[l->r_head]);
        l->reports[l->r_head] = NULL;
        *len = l->report_len[l->r_head];
        l->r_head = (l->r_head + 1) % PF_LINK_MAX_REPORTS;
        l->r_count--;
    }
    pthread_mutex_unlock(&l->mu);
    return got;
}

int pf_link_peer_failed(pf_link *l, kvx_peer peer)
{
    if (peer < 0 || peer >= MAX_PEERS) return TD_EINVAL;
    pthread_mutex_lock(&l->mu);
    int e = l->peer_err[peer];
    if (!e) e = kvx_pipe_peer_status(l->pipe, peer);
    pthread_mutex_unlock(&l->mu);
    return e;
}

int pf_link_wake_fd(const pf_link *l)
{
    return l->wake_fd;
}

void pf_link_clear_wake(pf_link *l)
{
    uint64_t v;
    while (read(l->wake_fd, &v, sizeof v) > 0) {
    }
}
