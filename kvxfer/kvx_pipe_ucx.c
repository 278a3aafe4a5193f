/* kvx_pipe_ucx.c: the UCX implementation of the pipe (one context, one worker): creation
 * and destruction, progress and sleeping, and the ops table. The rest is split by concern
 * (see kvx_pipe_ucx_int.h): wire-up in kvx_pipe_ucx_peer.c, operations in kvx_pipe_ucx_op.c,
 * the shared-memory wedge probe in kvx_pipe_ucx_probe.c. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/epoll.h>
#include <unistd.h>

#include "kvx_pipe_ucx_int.h"
#include "td_clock.h"

int kvxi_ucx_err(ucs_status_t st)
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

ucs_status_t kvxi_ucx_worker_open(kvxi_ucx_pipe *p, ucp_worker_h *w, int *efd)
{
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    ucs_status_t st = ucp_worker_create(p->ctx, &wp, w);
    if (st != UCS_OK) return st;
    if (efd) st = ucp_worker_get_efd(*w, efd);
    for (unsigned id = 0; efd && st == UCS_OK && id <= KVXI_UCX_AMACK_ID; id++) {
        /* the users' ids, then the pipe's own: the probe and (on every network pipe, since a
           peer may send them whatever this pipe does) the active-message puts */
        ucp_am_recv_callback_t cb = id < KVX_AM_IDS                ? kvxi_ucx_am_recv
                                    : id == KVXI_UCX_PROBE_AM_ID ? kvxi_ucx_probe_recv
                                    : id == KVXI_UCX_AMPUT_ID    ? kvxi_ucx_amput_recv
                                    : id == KVXI_UCX_AMFLUSH_ID  ? kvxi_ucx_amflush_recv
                                                                 : kvxi_ucx_amack_recv;
        if (id < KVX_AM_IDS && !p->am[id].cb) continue;
        if (id > KVXI_UCX_PROBE_AM_ID && p->shm) continue;
        ucp_am_handler_param_t hp = {
            .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                          UCP_AM_HANDLER_PARAM_FIELD_ARG,
            .id = id,
            .cb = cb,
            .arg = id < KVX_AM_IDS ? (void *)&p->am[id] : (void *)p,
        };
        st = ucp_worker_set_am_recv_handler(*w, &hp);
    }
    if (st != UCS_OK) {
        ucp_worker_destroy(*w);
        *w = NULL;
    }
    return st;
}

static int ucx_progress(kvx_pipe *base)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    int n = 0;
    while (ucp_worker_progress(p->worker))
        n = 1; /* data moved (kvx_pipe_progress) */
    if (p->shm) {
        kvxi_ucx_check_pids(p);
        kvxi_ucx_probe_step(p);
    }
    if (p->n_closing) kvxi_ucx_reap_closing(p);
    bool closed = false;
    for (int i = 0; i < p->n_peers; i++) {
        kvxi_ucx_peer *pr = p->peers[i];
        if (pr->close_needed) {
            pr->close_needed = false;
            kvxi_ucx_ep_close(p, pr, true);
            closed = true;
        }
    }
    if (closed)
        while (ucp_worker_progress(p->worker)) { /* completions the closes produced */
        }
    n += kvxi_ucx_deliver_done(p);
    n += kvxi_ucx_orphan_ops(p);
    for (int i = 0; i < p->n_peers; i++) {
        kvxi_ucx_peer *pr = p->peers[i];
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
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    if (p->any_done || p->probe_wanted) return 0;
    if (p->shm && kvxi_ucx_check_pids(p)) return 0;
    for (int i = 0; i < p->n_peers; i++)
        if (p->peers[i]->err_pending || p->peers[i]->close_needed) return 0;
    ucs_status_t st = ucp_worker_arm(p->worker);
    return st == UCS_OK ? 1 : 0;
}

static int ucx_event_fd(kvx_pipe *base)
{
    return ((kvxi_ucx_pipe *)base)->efd;
}

static void ucx_signal(kvx_pipe *base)
{
    ucp_worker_signal(((kvxi_ucx_pipe *)base)->worker);
}

static void ucx_allow_reset(kvx_pipe *base)
{
    ((kvxi_ucx_pipe *)base)->can_reset = true;
}

static uint32_t ucx_generation(kvx_pipe *base)
{
    return ((kvxi_ucx_pipe *)base)->gen;
}

static void ucx_stats(kvx_pipe *base, kvx_pipe_stats *out)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    memset(out, 0, sizeof(*out));
    for (int i = 0; i < p->n_peers; i++)
        out->peers += p->peers[i]->used;
    out->mems = p->n_mems;
    out->rkeys = p->n_rkeys;
    out->pending_ops = p->n_ops;
}

static void ucx_destroy(kvx_pipe *base)
{
    kvxi_ucx_pipe *p = (kvxi_ucx_pipe *)base;
    if (p->worker) {
        while (p->rkeys)
            kvxi_ucx_rkey_destroy(base, p->rkeys);
        for (int i = 0; i < p->n_peers; i++) {
            kvxi_ucx_peer *pr = p->peers[i];
            if (pr->used) kvxi_ucx_ep_close(p, pr, pr->status != 0);
            kvxi_ucx_pidfd_close(p, pr);
            pr->used = false;
            pr->err_pending = pr->close_needed = false;
        }
        /* receives nobody will match are cancelled (their callbacks report it) */
        for (kvxi_ucx_op *op = p->ops; op; op = op->next)
            if (op->req && !op->done) ucp_request_cancel(p->worker, op->req);
        /* active-message flushes: no ACK can come through the closed endpoints */
        for (kvxi_ucx_op *op = p->ops; op; op = op->next)
            if (op->ack_wait && !op->req && !op->done) kvxi_ucx_op_complete(op, TD_EIO, 0);
        /* deliver (with their errors) the completions the closes produced */
        int64_t end = td_now_ms() + 1000;
        while (p->ops && td_now_ms() < end)
            ucx_progress(base);
        while (p->ops) { /* still in flight after the bound: report, leave the request */
            kvxi_ucx_op *op = p->ops;
            if (op->req) ucp_request_free(op->req);
            kvx_done_cb cb = op->cb;
            void *arg = op->arg;
            kvxi_ucx_op_unlink(op);
            if (cb) cb(arg, TD_EIO, 0);
        }
        int64_t cend = td_now_ms() + 300; /* graceful closes: a short bound, then UCX */
        while (p->n_closing && td_now_ms() < cend) {
            ucp_worker_progress(p->worker);
            kvxi_ucx_reap_closing(p);
        }
        for (int i = 0; i < p->n_closing; i++)
            ucp_request_free(p->closing[i]);
        free(p->closing);
        p->closing = NULL;
        p->n_closing = 0;
        while (p->zombies) { /* no callback comes after ucp_request_free */
            kvxi_ucx_op *op = p->zombies;
            if (op->req) ucp_request_free(op->req);
            kvxi_ucx_op_unlink(op);
        }
        while (p->mems)
            kvxi_ucx_mem_dereg(base, p->mems);
        kvxi_ucx_probe_ep_close(p);
        if (p->probe_w) ucp_worker_destroy(p->probe_w);
        ucp_worker_destroy(p->worker);
        for (int i = 0; i < p->n_retired; i++)
            ucp_worker_destroy(p->retired[i]);
    }
    free(p->retired);
    if (p->ctx) ucp_cleanup(p->ctx);
    if (p->epfd > 0) close(p->epfd);
    for (int i = 0; i < p->n_peers; i++) {
        kvxi_ucx_cma_free(p->peers[i]);
        free(p->peers[i]);
    }
    free(p->peers);
    free(p);
}

static const kvx_pipe_ops ucx_ops = {
    .name = "ucx",
    .destroy = ucx_destroy,
    .address = kvxi_ucx_address,
    .connect = kvxi_ucx_connect,
    .disconnect = kvxi_ucx_disconnect,
    .peer_status = kvxi_ucx_peer_status,
    .mem_reg = kvxi_ucx_mem_reg,
    .mem_reg_fd = kvxi_ucx_mem_reg_fd,
    .mem_dereg = kvxi_ucx_mem_dereg,
    .rkey_pack = kvxi_ucx_rkey_pack,
    .rkey_unpack = kvxi_ucx_rkey_unpack,
    .rkey_destroy = kvxi_ucx_rkey_destroy,
    .put = kvxi_ucx_put,
    .flush = kvxi_ucx_flush,
    .set_am_handler = kvxi_ucx_set_am_handler,
    .am_send = kvxi_ucx_am_send,
    .tag_send = kvxi_ucx_tag_send,
    .tag_recv = kvxi_ucx_tag_recv,
    .progress = ucx_progress,
    .arm = ucx_arm,
    .event_fd = ucx_event_fd,
    .signal = ucx_signal,
    .stats = ucx_stats,
    .allow_reset = ucx_allow_reset,
    .generation = ucx_generation,
};

/* How many transports of a UCX_TLS list are among names[0..n) (*total: how many it has). */
static int tls_count(const char *tls, const char *const *names, size_t n, int *total)
{
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", tls);
    char *save = NULL;
    int hits = 0;
    *total = 0;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        ++*total;
        for (size_t i = 0; i < n; i++)
            if (!strcmp(t, names[i])) {
                hits++;
                break;
            }
    }
    return hits;
}

#define TLS_COUNT(tls, names, total) tls_count(tls, names, sizeof(names) / sizeof(names[0]), total)

/* True when every transport of a UCX_TLS list works on one host only (shared memory). */
static bool tls_shm_only(const char *tls)
{
    static const char *const shm[] = {"sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self"};
    if (!tls || !tls[0] || tls[0] == '^') return false;
    int total;
    return TLS_COUNT(tls, shm, &total) == total;
}

/* Whether puts go as our own active messages (kvx_pipe_ucx_amput.c): on network pipes whose
 * transports have no remote memory access, i.e. tcp, where UCX 1.13 would emulate them in a
 * way that can abort the receiver. A list naming an RDMA transport keeps UCX's puts; UCX's
 * default list ("", "all", "^...") does when this host has an RDMA device. KVX_UCX_PUTS=am
 * or rma in the environment decides instead (for measurements); another value is
 * TD_EINVAL. Shared-memory pipes copy their puts into a mapping of the peer's memory, or
 * write them into the peer process where the memory has no file (kvx_pipe_ucx_cma.c);
 * KVX_UCX_PUTS=cma: always the writes, rma: UCX's emulated puts. */
static int want_am_puts(const char *tls, bool shm, bool *out)
{
    static const char *const rdma[] = {"rc",   "rc_v",     "rc_x",    "rc_verbs", "rc_mlx5",
                                       "dc",   "dc_x",     "dc_mlx5", "ud",       "ud_v",
                                       "ud_x", "ud_verbs", "ud_mlx5", "ib"};
    const char *env = getenv("KVX_UCX_PUTS");
    if (env && env[0] && strcmp(env, "am") && strcmp(env, "rma") && strcmp(env, "cma")) {
        TD_LOG_ERR("kvx ucx: KVX_UCX_PUTS is '%s': am, rma, cma or unset", env);
        return TD_EINVAL;
    }
    if (shm || (env && env[0])) {
        *out = !shm && !strcmp(env, "am");
        return 0;
    }
    if (!tls || !tls[0] || tls[0] == '^' || !strcmp(tls, "all")) {
        DIR *d = opendir("/sys/class/infiniband");
        bool dev = false;
        for (struct dirent *e; d && (e = readdir(d));)
            dev = dev || e->d_name[0] != '.';
        if (d) closedir(d);
        *out = !dev;
        return 0;
    }
    int total;
    *out = TLS_COUNT(tls, rdma, &total) == 0;
    return 0;
}

/* The list can open a posix or sysv interface: it names one (or sm/shm/mm), or it is
 * UCX's default list ("", "all"). */
static bool tls_has_mm(const char *tls)
{
    static const char *const mm[] = {"sm", "shm", "mm", "posix", "sysv", "all"};
    if (!tls || !tls[0]) return true;
    if (tls[0] == '^') return false;
    int total;
    return TLS_COUNT(tls, mm, &total) > 0;
}

/* kvx_pipe_params.shm_fifo_size. The key is the mm transports' own (posix and sysv share
 * it): UCX 1.13 applies "MM_FIFO_SIZE" to their interfaces, warns (on stdout) about
 * "POSIX_FIFO_SIZE" as an unknown key, and about any key no interface of the list used:
 * lists without posix/sysv (tcp) get nothing set. */
static ucs_status_t set_fifo_size(ucp_config_t *cfg, const char *tls, int n)
{
    if (!tls_has_mm(tls)) return UCS_OK;
    if (n <= 0 && (getenv("UCX_POSIX_FIFO_SIZE") || getenv("UCX_SYSV_FIFO_SIZE") ||
                   getenv("UCX_MM_FIFO_SIZE")))
        return UCS_OK; /* the environment's */
    char v[16];
    snprintf(v, sizeof(v), "%d", n > 0 ? n : KVX_SHM_FIFO_DEFAULT);
    return ucp_config_modify(cfg, "MM_FIFO_SIZE", v);
}

/* kvx_pipe_params.host: NET_DEVICES, the device(s) that carry the host's address (network
 * lists only; the environment's UCX_NET_DEVICES wins). Logged at info once a process, at
 * debug after that (a decode leader opens one pipe per rank). */
static ucs_status_t set_net_devices(ucp_config_t *cfg, const char *host, bool shm)
{
    if (shm || !host) return UCS_OK;
    static atomic_bool logged;
    td_log_level lvl = atomic_exchange(&logged, true) ? TD_LOG_DEBUG : TD_LOG_INFO;
    const char *env = getenv("UCX_NET_DEVICES");
    if (env && env[0]) {
        td_log_write(lvl, __FILE__, __LINE__,
                     "kvx ucx: network devices %s (UCX_NET_DEVICES from the environment; host %s)",
                     env, host);
        return UCS_OK;
    }
    char devs[256];
    int rc = kvx_net_devices_for_host(host, devs, sizeof devs);
    if (rc == TD_EINVAL) {
        td_log_write(lvl, __FILE__, __LINE__,
                     "kvx ucx: host %s is a wildcard: UCX uses every network device", host);
        return UCS_OK;
    }
    if (rc) {
        TD_LOG_WARN("kvx ucx: no network device of this machine has the address of host %s (%s): "
                    "UCX uses every network device (set UCX_NET_DEVICES to choose)",
                    host, td_strerror(rc));
        return UCS_OK;
    }
    td_log_write(lvl, __FILE__, __LINE__,
                 "kvx ucx: network devices %s (those with the address of host %s)", devs, host);
    return ucp_config_modify(cfg, "NET_DEVICES", devs);
}

int kvx_pipe_ucx_create(const kvx_pipe_params *params, kvx_pipe **out)
{
    kvxi_ucx_pipe *p = calloc(1, sizeof(*p));
    if (!p) return TD_ENOMEM;
    p->base.ops = &ucx_ops;
    if (params) p->params = *params;
    p->params.tls = NULL; /* not kept: borrowed */

    const char *tls = params && params->tls && params->tls[0] ? params->tls : getenv("UCX_TLS");
    p->shm = tls_shm_only(tls);
    if (want_am_puts(tls, p->shm, &p->am_puts)) {
        free(p);
        return TD_EINVAL;
    }
    const char *puts_env = getenv("KVX_UCX_PUTS");
    p->cma_puts = p->shm && !(puts_env && !strcmp(puts_env, "rma"));
    p->map_puts = p->cma_puts && !(puts_env && !strcmp(puts_env, "cma"));
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
    if (st == UCS_OK) st = set_fifo_size(cfg, tls, params ? params->shm_fifo_size : 0);
    if (st == UCS_OK) st = set_net_devices(cfg, params ? params->host : NULL, p->shm);
    if (st != UCS_OK) {
        TD_LOG_ERR("kvx ucx: config: %s", ucs_status_string(st));
        ucp_config_release(cfg);
        free(p);
        return TD_EINVAL;
    }
    /* UCP_FEATURE_RMA only where UCX's puts may carry the KV (RDMA lists, KVX_UCX_PUTS=rma,
     * and shared memory when the kernel refuses the writes into the peer, cma.c): with it
     * UCX installs its put emulation over every transport, whose handler writes the data
     * wherever the message says, with no check, for anyone who reaches the worker's port.
     * Over tcp our own puts carry the registration's key instead (amput.c), and without the
     * feature UCX drops an emulated put as an unknown message (issue 44). */
    ucp_params_t cp = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
        .features = (p->am_puts ? 0 : UCP_FEATURE_RMA) | UCP_FEATURE_AM | UCP_FEATURE_TAG |
                    UCP_FEATURE_WAKEUP,
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
    st = kvxi_ucx_worker_open(p, &p->worker, &p->efd);
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
