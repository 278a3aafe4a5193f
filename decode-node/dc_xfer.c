/* dc_xfer.c: the leader's kvxfer connectors, one per rank, and the per-request transfer
 * state that spans them (see dc_xfer.h). */
#include "dc_xfer.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kvx_conn.h"
#include "td_tp.h"
#include "td_clock.h"
#include "td_err.h"
#include "td_grow.h"

/* One transfer: a kvxfer request on every rank's connector. */
typedef struct {
    uint64_t key, kvx_id;
    uint32_t n_stages;
    int32_t n_prompt;
    int32_t n_cached; /* positions every rank holds already: not transferred */
    int64_t t_start_ns;
    bool ending;      /* aborted on every rank; waiting for all to be final */
    dc_xfer_end why;  /* ending: the first reason */
    char msg[320];    /* ending: the first failure, for the client */
    uint8_t **target; /* (tp) target bytes */
    size_t *target_len;
} xfer;

struct dc_xfer {
    dc_xfer_params p;
    char instance[64];
    kvx_conn **conn;  /* (tp) */
    uint8_t **on_dev; /* (tp) staged: rank r's on_dev flags (n_blocks), else NULL */
    xfer *v;          /* (n, cap) live transfers */
    int n, cap;
};

int dc_xfer_create(const dc_xfer_params *p, dc_xfer **out)
{
    *out = NULL;
    if (p->tp < 1 || p->tp > KVX_MAX_RANKS || !p->regions || !p->region_bytes) return TD_EINVAL;
    dc_xfer *x = calloc(1, sizeof *x);
    if (!x) return TD_ENOMEM;
    x->p = *p;
    snprintf(x->instance, sizeof x->instance, "%s", p->instance ? p->instance : "?");
    x->p.instance = x->instance;
    x->p.regions = NULL; /* borrowed only during create: the connectors keep them */
    x->p.region_bytes = NULL;
    x->conn = calloc((size_t)p->tp, sizeof *x->conn);
    if (p->staged) x->on_dev = calloc((size_t)p->tp, sizeof *x->on_dev);
    if (!x->conn || (p->staged && !x->on_dev)) {
        free(x->conn);
        free(x);
        return TD_ENOMEM;
    }
    int rc = 0;
    for (int r = 0; r < p->tp && !rc; r++) {
        kvx_layout l = {.layer0 = 0,
                        .n_layers = p->n_layers,
                        .n_kv_heads = p->n_kv_heads,
                        .block_size = p->block_size,
                        .head_dim = p->head_dim,
                        .dtype_size = p->dtype_size,
                        .n_blocks = p->n_blocks,
                        .kv_arrays = p->latent ? 1 : 2};
        td_tp_heads h = {0};
        rc = td_tp_heads_of_rank((int)p->n_heads, (int)p->n_kv_heads, p->tp, r, &h);
        l.head0 = (uint32_t)h.kv0;
        l.n_heads = (uint32_t)h.n_kv;
        const size_t kv_bytes = kvx_layout_bytes(&l);
        const size_t flags = p->staged ? p->n_blocks : 0;
        if (rc || kv_bytes + flags != p->region_bytes[r]) {
            TD_LOG_ERR("decode %s: rank %d's KV pool (%zu bytes) does not match its kvxfer layout "
                       "(%zu bytes%s)",
                       x->instance, r, p->region_bytes[r], kv_bytes,
                       p->staged ? " and a flag a block" : "");
            rc = TD_EINVAL;
            break;
        }
        if (p->staged) x->on_dev[r] = (uint8_t *)p->regions[r] + kv_bytes;
        kvx_pipe *pipe;
        if ((rc = kvx_pipe_ucx_create(&(kvx_pipe_params){.tls = p->tls, .host = p->host}, &pipe))) {
            TD_LOG_ERR("decode %s: cannot start UCX (tls '%s') for rank %d's KV: %s", x->instance,
                       p->tls ? p->tls : "", r, td_strerror(rc));
            break;
        }
        /* progress in the connector's thread: puts emulated over tcp need the receiver
         * to progress while the engine computes, and the leader loop must not spin */
        kvx_conn_params cp = {.timeout_ms = p->timeout_ms, .progress_thread = true};
        if ((rc = kvx_conn_create(pipe, &cp, &x->conn[r]))) break;
        rc = kvx_dec_register_fd(x->conn[r], p->regions[r], kv_bytes, &l,
                                 p->region_fds ? p->region_fds[r] : -1);
    }
    if (rc) {
        dc_xfer_destroy(x);
        return rc;
    }
    TD_LOG_INFO("decode %s: kvxfer ready: %d connectors (tls '%s'), transfer timeout %d ms",
                x->instance, p->tp, p->tls ? p->tls : "", p->timeout_ms);
    *out = x;
    return 0;
}

static void xfer_free(const dc_xfer *x, xfer *t)
{
    for (int r = 0; t->target && r < x->p.tp; r++)
        free(t->target[r]);
    free(t->target);
    free(t->target_len);
}

void dc_xfer_destroy(dc_xfer *x)
{
    if (!x) return;
    for (int i = 0; i < x->n; i++)
        xfer_free(x, &x->v[i]);
    for (int r = 0; x->conn && r < x->p.tp; r++)
        kvx_conn_destroy(x->conn[r]);
    free(x->conn);
    free(x->on_dev);
    free(x->v);
    free(x);
}

static xfer *find_key(const dc_xfer *x, uint64_t key)
{
    for (int i = 0; i < x->n; i++)
        if (x->v[i].key == key) return &x->v[i];
    return NULL;
}

bool dc_xfer_live(const dc_xfer *x, uint64_t key)
{
    return find_key(x, key) != NULL;
}

bool dc_xfer_kvx_live(const dc_xfer *x, uint64_t kvx_id)
{
    for (int i = 0; i < x->n; i++)
        if (x->v[i].kvx_id == kvx_id) return true;
    return false;
}

int dc_xfer_pending(const dc_xfer *x)
{
    return x ? x->n : 0;
}

/* Abort and release rank r's request (after a failed start: nobody has its target, so
 * no writer was accepted and the abort makes it FAILED at once). */
static void drop_rank(dc_xfer *x, int r, uint64_t kvx_id)
{
    kvx_dec_abort(x->conn[r], kvx_id);
    if (kvx_dec_release(x->conn[r], kvx_id))
        TD_LOG_ERR("decode %s: rank %d: cannot release kvxfer request %llu (bug)", x->instance, r,
                   (unsigned long long)kvx_id);
}

int dc_xfer_start(dc_xfer *x, uint64_t key, uint64_t kvx_id, uint32_t n_stages, int32_t n_prompt,
                  int32_t n_cached, const int32_t *blocks, int n_blocks)
{
    if (find_key(x, key) || dc_xfer_kvx_live(x, kvx_id)) return TD_ESTATE;
    if (n_stages < 1 || n_stages > KVX_MAX_STAGES || n_prompt < 1 || n_blocks < 1 || n_cached < 0 ||
        n_cached >= n_prompt)
        return TD_EINVAL;
    if (TD_GROW_INT(x->v, x->cap, x->n + 1, 16)) return TD_ENOMEM;
    xfer t = {.key = key,
              .kvx_id = kvx_id,
              .n_stages = n_stages,
              .n_prompt = n_prompt,
              .n_cached = n_cached,
              .t_start_ns = td_now_ns()};
    t.target = calloc((size_t)x->p.tp, sizeof *t.target);
    t.target_len = calloc((size_t)x->p.tp, sizeof *t.target_len);
    if (!t.target || !t.target_len) {
        xfer_free(x, &t);
        return TD_ENOMEM;
    }
    int rc = 0, made = 0;
    for (int r = 0; r < x->p.tp && !rc; r++) {
        kvx_dec_req_params dp = {.n_stages = n_stages,
                                 .rank = (uint32_t)r,
                                 .tp = (uint32_t)x->p.tp,
                                 .blocks = blocks,
                                 .n_blocks = (uint32_t)n_blocks,
                                 .timeout_ms = x->p.timeout_ms,
                                 .first_pos = (uint32_t)n_cached};
        /* addresses, key, layout and block ids: the exact size is known after a try */
        size_t cap = 1024 + KVX_ADDR_MAX + KVX_RKEY_MAX + 4 * (size_t)n_blocks, len = 0;
        for (int attempt = 0; attempt < 2; attempt++) {
            free(t.target[r]);
            if (!(t.target[r] = malloc(cap))) {
                rc = TD_ENOMEM;
                break;
            }
            rc = kvx_dec_make_target(x->conn[r], kvx_id, &dp, t.target[r], cap, &len);
            if (rc != TD_ERANGE || len <= cap) break;
            cap = len;
        }
        if (!rc) {
            t.target_len[r] = len;
            made++;
        } else {
            TD_LOG_ERR("decode %s: request %llu: cannot make rank %d's KV target: %s", x->instance,
                       (unsigned long long)kvx_id, r, td_strerror(rc));
        }
    }
    if (rc) {
        for (int r = 0; r < made; r++)
            drop_rank(x, r, kvx_id);
        xfer_free(x, &t);
        return rc == TD_ESTATE ? TD_EIO : rc; /* TD_ESTATE means "alive" to the caller */
    }
    /* staged pools: the transferred blocks' host copies get the KV, so no rank's device copy
     * of them is current (no step reads these blocks before the event ARRIVED, and no target
     * is out yet). The blocks before n_cached (whole blocks, shared from the prefix cache) are
     * not written: their device copies may be the only current ones (KV computed on the
     * device, e.g. a previous answer's), so their flags stay. */
    for (int r = 0; x->on_dev && r < x->p.tp; r++)
        for (int i = n_cached / (int32_t)x->p.block_size; i < n_blocks; i++)
            if (blocks[i] >= 0 && (uint32_t)blocks[i] < x->p.n_blocks) x->on_dev[r][blocks[i]] = 0;
    x->v[x->n++] = t;
    return 0;
}

int dc_xfer_targets(const dc_xfer *x, uint64_t key, const uint8_t *const **targets,
                    const size_t **lens, int32_t *n_cached)
{
    const xfer *t = find_key(x, key);
    if (!t) return TD_ENOENT;
    *n_cached = t->n_cached;
    *targets = (const uint8_t *const *)t->target;
    *lens = t->target_len;
    return 0;
}

static void begin_ending(dc_xfer *x, xfer *t, dc_xfer_end why)
{
    if (t->ending) return;
    t->ending = true;
    t->why = why;
    for (int r = 0; r < x->p.tp; r++)
        kvx_dec_abort(x->conn[r], t->kvx_id); /* a no-op on ranks already DONE/FAILED */
}

int dc_xfer_abort(dc_xfer *x, uint64_t key, dc_xfer_end why)
{
    xfer *t = find_key(x, key);
    if (!t) return TD_ENOENT;
    if (!t->ending)
        snprintf(t->msg, sizeof t->msg, "KV transfer from prefill %s",
                 why == DC_XFER_END_CANCELLED ? "cancelled"
                                              : "stopped: the node stops or re-forms");
    begin_ending(x, t, why);
    return 0;
}

void dc_xfer_abort_all(dc_xfer *x, dc_xfer_end why)
{
    for (int i = 0; x && i < x->n; i++)
        dc_xfer_abort(x, x->v[i].key, why);
}

static const char *reason_text(kvx_fail_reason r)
{
    switch (r) {
    case KVX_FAIL_ABORTED:
        return "aborted by this node";
    case KVX_FAIL_PEER_ABORTED:
        return "a prefill stage aborted it";
    case KVX_FAIL_PEER_FAILED:
        return "a prefill writer failed (its process or connection died)";
    case KVX_FAIL_TIMEOUT:
        return "the transfer deadline passed";
    case KVX_FAIL_BAD_INPUT:
        return "a target or chunk did not fit";
    default:
        return "unknown reason";
    }
}

static int popcount64(uint64_t v)
{
    int n = 0;
    for (; v; v &= v - 1)
        n++;
    return n;
}

/* The first failure of a live transfer, seen on rank r. */
static void fail_seen(dc_xfer *x, xfer *t, int r, const kvx_dec_status *st)
{
    long long ms = (long long)((td_now_ns() - t->t_start_ns) / 1000000);
    if (st->reason == KVX_FAIL_TIMEOUT)
        snprintf(t->msg, sizeof t->msg,
                 "KV transfer from prefill timed out on rank %d: not complete %lld ms after "
                 "Alloc (deadline %d ms; %d of %u stages begun, %d done)",
                 r, ms, x->p.timeout_ms, popcount64(st->stages_begun), t->n_stages,
                 popcount64(st->stages_done));
    else
        snprintf(t->msg, sizeof t->msg,
                 "KV transfer from prefill failed on rank %d: %s (%s %lld ms after Alloc; %d of "
                 "%u stages begun, %d done)",
                 r, reason_text(st->reason), kvx_req_state_name(st->state), ms,
                 popcount64(st->stages_begun), t->n_stages, popcount64(st->stages_done));
    TD_LOG_ERR("decode %s: request %llu: %s", x->instance, (unsigned long long)t->kvx_id, t->msg);
    begin_ending(x, t, st->reason == KVX_FAIL_TIMEOUT ? DC_XFER_END_TIMEOUT : DC_XFER_END_FAILED);
}

/* Every rank DONE: the metadata must describe the whole prompt, and the ranks must agree
 * on the first token (each got it from the last stage's TP rank 0). Returns 0 and the
 * first token, or fills t->msg. */
static int check_meta(dc_xfer *x, xfer *t, const kvx_dec_status *st, int32_t *first)
{
    uint32_t last = t->n_stages - 1;
    *first = st[0].meta[last].first_token;
    for (int r = 0; r < x->p.tp; r++) {
        for (uint32_t s = 0; s < t->n_stages; s++)
            if (st[r].meta[s].n_tokens != (uint32_t)t->n_prompt) {
                snprintf(t->msg, sizeof t->msg,
                         "KV transfer from prefill: stage %u sent %u tokens to rank %d, the prompt "
                         "has %d",
                         s, st[r].meta[s].n_tokens, r, t->n_prompt);
                return TD_EINVAL;
            }
        if (st[r].meta[last].first_token != *first) {
            snprintf(t->msg, sizeof t->msg,
                     "KV transfer from prefill: ranks 0 and %d got different first tokens (%d, %d)",
                     r, *first, st[r].meta[last].first_token);
            return TD_EINVAL;
        }
    }
    return 0;
}

static void release_all(dc_xfer *x, xfer *t)
{
    for (int r = 0; r < x->p.tp; r++) {
        int rc = kvx_dec_release(x->conn[r], t->kvx_id);
        if (rc && rc != TD_ENOENT)
            TD_LOG_ERR("decode %s: rank %d: cannot release kvxfer request %llu: %s (bug)",
                       x->instance, r, (unsigned long long)t->kvx_id, td_strerror(rc));
    }
}

static void remove_at(dc_xfer *x, int i)
{
    xfer_free(x, &x->v[i]);
    memmove(x->v + i, x->v + i + 1, (size_t)(x->n - i - 1) * sizeof *x->v);
    x->n--;
}

/* Step transfer i; 1 and *ev if it produced its event (then it is removed). */
static int step(dc_xfer *x, int i, dc_xfer_event *ev)
{
    xfer *t = &x->v[i];
    kvx_dec_status st[KVX_MAX_RANKS];
    int n_done = 0, n_final = 0;
    for (int r = 0; r < x->p.tp; r++) {
        if (kvx_dec_poll(x->conn[r], t->kvx_id, &st[r])) {
            /* cannot happen (we release only here); count it as failed, never as safe to
             * write into, but it is final: nothing of it is left */
            memset(&st[r], 0, sizeof st[r]);
            st[r].state = KVX_REQ_FAILED;
            st[r].reason = KVX_FAIL_ABORTED;
        }
        bool failed = st[r].state == KVX_REQ_FAILED || st[r].state == KVX_REQ_ABORTING;
        if (failed && !t->ending) fail_seen(x, t, r, &st[r]);
        n_done += st[r].state == KVX_REQ_DONE;
        n_final += st[r].state == KVX_REQ_DONE || st[r].state == KVX_REQ_FAILED;
    }
    memset(ev, 0, sizeof *ev);
    ev->key = t->key;
    if (!t->ending && n_done == x->p.tp) {
        int32_t first;
        if (check_meta(x, t, st, &first) == 0) {
            TD_LOG_INFO("decode %s: request %llu: KV of %d tokens from %u stages arrived (%d "
                        "held here, not transferred; transfer %.1f ms after Alloc)",
                        x->instance, (unsigned long long)t->kvx_id, t->n_prompt, t->n_stages,
                        t->n_cached, (double)(td_now_ns() - t->t_start_ns) / 1e6);
            release_all(x, t);
            ev->kind = DC_XFER_ARRIVED;
            ev->first_token = first;
            remove_at(x, i);
            return 1;
        }
        TD_LOG_ERR("decode %s: request %llu: %s", x->instance, (unsigned long long)t->kvx_id,
                   t->msg);
        begin_ending(x, t, DC_XFER_END_FAILED); /* every rank is DONE: final already */
    }
    if (!t->ending || n_final < x->p.tp) return 0;
    /* no writer can write into the blocks on any rank any more */
    release_all(x, t);
    ev->kind = DC_XFER_ENDED;
    ev->why = t->why;
    snprintf(ev->msg, sizeof ev->msg, "%s", t->msg);
    remove_at(x, i);
    return 1;
}

int dc_xfer_next(dc_xfer *x, dc_xfer_event *ev)
{
    for (int i = 0; x && i < x->n; i++)
        if (step(x, i, ev)) return 1;
    return 0;
}

int dc_xfer_dec_requests(dc_xfer *x, int rank)
{
    if (!x || rank < 0 || rank >= x->p.tp) return -1;
    kvx_conn_stats st;
    kvx_conn_stats_get(x->conn[rank], &st);
    return st.dec_requests;
}

/* ---- the followers' KV pool segments ---- */

#define KV_SHM_PREFIX "tandem-kv-"

int dc_xfer_kv_shm_name(const char *instance, const char *token, int rank, int pid, char *buf,
                        size_t cap)
{
    int n = snprintf(buf, cap, "/" KV_SHM_PREFIX "%s-%s-r%d-%d", instance, token, rank, pid);
    return n < 0 || (size_t)n >= cap ? TD_ERANGE : 0;
}

void dc_xfer_kv_shm_sweep(const char *instance, const char *token)
{
    char prefix[256];
    int np = snprintf(prefix, sizeof prefix, KV_SHM_PREFIX "%s-%s-r", instance, token);
    if (np < 0 || (size_t)np >= sizeof prefix) return;
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, prefix, (size_t)np)) continue;
        int rank, pid, used = 0;
        if (sscanf(e->d_name + np, "%d-%d%n", &rank, &pid, &used) != 2 || e->d_name[np + used] ||
            pid <= 0)
            continue;
        if (kill(pid, 0) == 0 || errno != ESRCH) continue; /* alive (or not ours to judge) */
        char name[300];
        snprintf(name, sizeof name, "/%s", e->d_name);
        if (shm_unlink(name) == 0)
            TD_LOG_INFO("decode %s: removed the stale KV segment %s (rank %d, pid %d is gone)",
                        instance, name, rank, pid);
    }
    closedir(d);
}
