/* kvx_conn.c: the connector's shared parts: layouts, endpoints to other connectors, the
 * wire messages and their dispatch, progress (the owner's loop or a thread), lifecycle and
 * statistics. Pipe callbacks only record (a message queue, counters); progress then steps
 * every request (kvx_conn_pf.c, kvx_conn_dec.c). */
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvx_conn_int.h"
#include "td_clock.h"

const char *kvx_req_state_name(kvx_req_state s)
{
    static const char *names[] = {"waiting", "transferring", "done",  "aborting", "failed",
                                  "open",    "begun",        "ready", "flushing", "notifying"};
    return (unsigned)s < sizeof(names) / sizeof(names[0]) ? names[s] : "?";
}

size_t kvx_layout_bytes(const kvx_layout *l)
{
    if (!l || !l->n_layers || !l->n_heads || !l->block_size || !l->head_dim || !l->dtype_size ||
        !l->n_blocks || !l->n_kv_heads || l->head0 >= l->n_kv_heads ||
        l->n_heads > l->n_kv_heads - l->head0 || l->n_layers > 65536 || l->layer0 > 65536 ||
        l->block_size > 65536 || l->head_dim > 65536 || l->dtype_size > 16 || l->n_heads > 4096 ||
        l->kv_arrays > 2)
        return 0;
    if (l->n_slices > 1) {
        if (l->n_slices > KVX_MAX_SLICES) return 0;
        uint32_t sum = 0;
        for (uint32_t s = 0; s < l->n_slices; s++) {
            if (!l->slice_heads[s] || l->slice_heads[s] > l->n_heads) return 0;
            sum += l->slice_heads[s];
        }
        if (sum != l->n_heads) return 0;
    }
    unsigned __int128 b = (unsigned __int128)l->n_layers * kvx_layout_arrays(l) * l->n_blocks *
                          l->n_heads * l->block_size * l->head_dim * l->dtype_size;
    return b > ((unsigned __int128)1 << 46) ? 0 : (size_t)b;
}

size_t kvx_layout_off(const kvx_layout *l, uint32_t ll, uint32_t kv, uint32_t blk, uint32_t h,
                      uint32_t tok)
{
    return kvxi_kv_off(l, ll, kv, blk, h, tok);
}

int kvx_layout_slice(kvx_layout *l, const uint32_t *ranges, uint32_t n)
{
    if (!l || !ranges || !n) return TD_EINVAL;
    uint32_t h0 = l->head0, h1 = l->head0 + l->n_heads;
    bool cut[4097] = {false}; /* cut[i]: a slice starts at local head i */
    if (l->n_heads > 4096) return TD_EINVAL;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t a = ranges[2 * i], b = ranges[2 * i + 1];
        if (a >= b) return TD_EINVAL;
        if (a > h0 && a < h1) cut[a - h0] = true;
        if (b > h0 && b < h1) cut[b - h0] = true;
    }
    uint32_t heads[KVX_MAX_SLICES], ns = 0, start = 0;
    for (uint32_t i = 1; i <= l->n_heads; i++) {
        if (i < l->n_heads && !cut[i]) continue;
        if (ns == KVX_MAX_SLICES) return TD_ERANGE;
        heads[ns++] = i - start;
        start = i;
    }
    l->n_slices = ns;
    memset(l->slice_heads, 0, sizeof(l->slice_heads));
    if (ns > 1) memcpy(l->slice_heads, heads, ns * sizeof(heads[0]));
    return 0;
}

/* --- peers ---------------------------------------------------------------------------- */

static int peer_find(kvx_conn *c, uint64_t uid)
{
    for (int i = 0; i < c->n_peers; i++)
        if (c->peers[i].peer >= 0 && !c->peers[i].failed && c->peers[i].uid == uid) return i;
    return -1;
}

/* The endpoint to connector uid at addr (created on first use). */
int kvxi_peer_get(kvx_conn *c, uint64_t uid, const void *addr, size_t addr_len, int *out)
{
    int i = peer_find(c, uid);
    if (i >= 0) {
        *out = i;
        return 0;
    }
    for (i = 0; i < c->n_peers; i++)
        if (c->peers[i].peer < 0 && c->peers[i].refs == 0) break;
    if (i == c->n_peers) {
        kvxi_peer *np = realloc(c->peers, (size_t)(c->n_peers + 1) * sizeof(*np));
        if (!np) return TD_ENOMEM;
        c->peers = np;
        c->n_peers++;
    }
    kvxi_peer *p = &c->peers[i];
    memset(p, 0, sizeof(*p));
    p->peer = -1;
    p->uid = uid;
    int err = kvx_pipe_connect(c->pipe, addr, addr_len, &p->peer);
    if (err) {
        p->peer = -1;
        return err;
    }
    *out = i;
    return 0;
}

/* Close an endpoint; force: do not flush (it failed, or it does not answer). */
void kvxi_peer_close(kvx_conn *c, int i, bool force)
{
    kvxi_peer *p = &c->peers[i];
    if (p->peer < 0) return;
    force = force || p->failed;
    p->failed = true;
    if (p->rkey) kvx_pipe_rkey_destroy(c->pipe, p->rkey);
    p->rkey = NULL;
    kvx_pipe_disconnect(c->pipe, p->peer, force);
    p->peer = -1;
}

bool kvxi_peer_ok(kvx_conn *c, int i)
{
    return i >= 0 && i < c->n_peers && c->peers[i].peer >= 0 && !c->peers[i].failed;
}

/* --- messages ------------------------------------------------------------------------- */

static size_t msg_encode(kvx_conn *c, const kvxi_msg *m, uint8_t *buf, size_t cap)
{
    kvx_wr w;
    kvx_wr_init(&w, buf, cap);
    kvx_wr_u32(&w, KVX_MAGIC_MSG);
    kvx_wr_u32(&w, m->type);
    kvx_wr_u64(&w, m->req);
    kvx_wr_u64(&w, m->epoch);
    kvx_wr_u64(&w, m->key[0]);
    kvx_wr_u64(&w, m->key[1]);
    kvx_wr_u64(&w, c->uid);
    kvx_wr_u32(&w, m->stage);
    kvx_wr_u32(&w, m->rank);
    kvx_wr_u32(&w, m->src_rank);
    kvx_wr_u32(&w, m->src_tp);
    kvx_wr_u32(&w, (uint32_t)m->first_token);
    kvx_wr_u32(&w, m->n_tokens);
    kvx_wr_u32(&w, m->addr_len);
    kvx_wr_bytes(&w, m->addr, m->addr_len);
    return w.ok ? w.len : 0;
}

/* Send a message to peer pi; cb (may be NULL) gets its completion. */
int kvxi_msg_send_cb(kvx_conn *c, int pi, const kvxi_msg *m, kvx_done_cb cb, void *arg)
{
    uint8_t buf[KVX_AM_MAX];
    size_t n = msg_encode(c, m, buf, sizeof(buf));
    if (!n) return TD_ERANGE;
    if (!kvxi_peer_ok(c, pi)) return TD_EIO;
    return kvx_pipe_am_send(c->pipe, c->peers[pi].peer, KVXI_AM_ID, buf, n, cb, arg);
}

int kvxi_msg_send(kvx_conn *c, int pi, const kvxi_msg *m)
{
    return kvxi_msg_send_cb(c, pi, m, NULL, NULL);
}

static int msg_parse(const uint8_t *buf, size_t len, kvxi_msg *m)
{
    kvx_rd r;
    kvx_rd_init(&r, buf, len);
    uint32_t magic = kvx_rd_u32(&r);
    m->type = kvx_rd_u32(&r);
    m->req = kvx_rd_u64(&r);
    m->epoch = kvx_rd_u64(&r);
    m->key[0] = kvx_rd_u64(&r);
    m->key[1] = kvx_rd_u64(&r);
    m->uid = kvx_rd_u64(&r);
    m->stage = kvx_rd_u32(&r);
    m->rank = kvx_rd_u32(&r);
    m->src_rank = kvx_rd_u32(&r);
    m->src_tp = kvx_rd_u32(&r);
    m->first_token = (int32_t)kvx_rd_u32(&r);
    m->n_tokens = kvx_rd_u32(&r);
    m->addr_len = kvx_rd_u32(&r);
    m->addr = kvx_rd_bytes(&r, m->addr_len);
    if (!r.ok || magic != KVX_MAGIC_MSG || m->type < KVXI_MSG_BEGIN || m->type > KVXI_MSG_STOPPED ||
        r.off != len)
        return TD_EFORMAT;
    return 0;
}

/* Pipe callback: only record. */
static void on_am(void *arg, const void *data, size_t len)
{
    kvx_conn *c = arg;
    kvxi_queued_msg *q = malloc(sizeof(*q) + len);
    if (!q) {
        TD_LOG_ERR("kvx conn: out of memory for a %zu-byte message (dropped)", len);
        return;
    }
    q->len = len;
    q->next = NULL;
    memcpy(q->data, data, len);
    if (c->inbox_tail)
        c->inbox_tail->next = q;
    else
        c->inbox = q;
    c->inbox_tail = q;
}

/* --- lookup buffer values --------------------------------------------------------------- */

void kvxi_free_copy(void *arg, const kvx_lb_key *k, void *val, size_t bytes)
{
    free(val);
}

/* --- incoming messages ------------------------------------------------------------------ */

static void handle_msg(kvx_conn *c, const uint8_t *data, size_t len)
{
    kvxi_msg m;
    if (msg_parse(data, len, &m)) {
        TD_LOG_ERR("kvx conn: malformed message of %zu bytes (dropped)", len);
        return;
    }
    if (m.type == KVXI_MSG_BEGIN || m.type == KVXI_MSG_DONE || m.type == KVXI_MSG_STOPPED)
        kvxi_dec_on_msg(c, &m);
    else
        kvxi_pf_on_msg(c, &m);
}

/* --- progress --------------------------------------------------------------------------- */

/* A connector id that differs across processes, restarts and worker replacements. */
static uint64_t new_uid(kvx_conn *c)
{
    uint64_t seed = (uint64_t)td_now_ns() * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid() << 32 ^
                    (uint64_t)(uintptr_t)c ^ c->uid;
    seed ^= seed >> 31;
    seed *= 0xbf58476d1ce4e5b9ull;
    return seed ^ (seed >> 29);
}

/* The pipe replaced its wedged worker (kvx_pipe_allow_reset): every endpoint failed with
 * it. The connector takes the new address and a new id, so that peers open fresh endpoints
 * to it instead of reusing the ones into the dead queue, and fails the decode requests
 * whose targets carry the old address (nobody can begin them any more). */
static void pipe_reset(kvx_conn *c)
{
    size_t len = 0;
    int err = kvx_pipe_address(c->pipe, c->addr, sizeof(c->addr), &len);
    if (err) {
        TD_LOG_ERR("kvx conn: no address after the worker replacement: %s", td_strerror(err));
        len = 0;
    }
    c->addr_len = len;
    c->uid = new_uid(c);
    for (int i = 0; i < c->n_peers; i++)
        if (c->peers[i].peer >= 0) c->peers[i].failed = true;
    kvxi_dec_pipe_reset(c);
    TD_LOG_WARN("kvx conn: the transport worker was replaced: requests in flight fail, new ones "
                "use the new address");
}

/* Locked: run the pipe, the messages and every request's step. */
static int progress_locked(kvx_conn *c)
{
    int n = kvx_pipe_progress(c->pipe);
    if (n < 0) return n;
    uint32_t gen = kvx_pipe_generation(c->pipe);
    if (gen != c->pipe_gen) {
        c->pipe_gen = gen;
        pipe_reset(c);
        n++;
    }
    while (c->inbox) {
        kvxi_queued_msg *q = c->inbox;
        c->inbox = q->next;
        if (!c->inbox) c->inbox_tail = NULL;
        handle_msg(c, q->data, q->len);
        free(q);
        n++;
    }
    int64_t now = td_now_ms();
    for (kvxi_pf_req *r = c->preqs; r; r = r->next)
        kvxi_pf_step(c, r, now);
    for (kvxi_dec_req *r = c->dreqs; r; r = r->next)
        kvxi_dec_step(c, r, now);
    /* endpoints that failed and that no request uses any more are released */
    for (int i = 0; i < c->n_peers; i++)
        if (c->peers[i].peer >= 0 && c->peers[i].failed && c->peers[i].refs == 0)
            kvxi_peer_close(c, i, true);
        else if (c->peers[i].peer >= 0 && !c->peers[i].failed &&
                 kvx_pipe_peer_status(c->pipe, c->peers[i].peer))
            c->peers[i].failed = true;
    return n;
}

static int64_t next_deadline(kvx_conn *c)
{
    int64_t d = INT64_MAX;
    for (kvxi_pf_req *r = c->preqs; r; r = r->next) {
        if (kvxi_pf_final(r)) continue;
        int64_t x = r->state == KVX_REQ_ABORTING ? r->abort_deadline : r->deadline;
        if (x < d) d = x;
    }
    for (kvxi_dec_req *r = c->dreqs; r; r = r->next) {
        int64_t x = kvxi_dec_live(r)               ? r->deadline
                    : r->state == KVX_REQ_ABORTING ? r->abort_deadline
                                                   : INT64_MAX;
        if (x < d) d = x;
    }
    return d;
}

int kvx_conn_progress(kvx_conn *c, int timeout_ms)
{
    pthread_mutex_lock(&c->mu);
    int n = progress_locked(c);
    int64_t now_ns = td_now_ns();
    if (n != 0) c->active_ns = now_ns;
    if (n != 0 || timeout_ms <= 0 || now_ns - c->active_ns < (int64_t)c->params.spin_us * 1000) {
        pthread_mutex_unlock(&c->mu);
        return n;
    }
    int64_t now = td_now_ms(), d = next_deadline(c);
    int wait = timeout_ms;
    if (d != INT64_MAX) wait = d <= now ? 0 : (d - now < wait ? (int)(d - now) + 1 : wait);
    int armed = wait > 0 ? kvx_pipe_arm(c->pipe) : 0;
    int fd = kvx_pipe_event_fd(c->pipe);
    pthread_mutex_unlock(&c->mu);
    if (armed) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        poll(&pfd, 1, wait);
    }
    pthread_mutex_lock(&c->mu);
    n = progress_locked(c);
    pthread_mutex_unlock(&c->mu);
    return n;
}

static void *progress_thread(void *arg)
{
    kvx_conn *c = arg;
    for (;;) {
        pthread_mutex_lock(&c->mu);
        bool stop = c->stop;
        pthread_mutex_unlock(&c->mu);
        if (stop) break;
        kvx_conn_progress(c, 200);
    }
    return NULL;
}

/* After an API call that started work: wake the progress thread (it may be asleep). */
void kvxi_kick(kvx_conn *c)
{
    if (c->thread_on) kvx_pipe_signal(c->pipe);
}

/* --- lifecycle -------------------------------------------------------------------------- */

int kvx_conn_create(kvx_pipe *pipe, const kvx_conn_params *params, kvx_conn **out)
{
    kvx_conn *c = calloc(1, sizeof(*c));
    if (!c) {
        kvx_pipe_destroy(pipe);
        return TD_ENOMEM;
    }
    c->pipe = pipe;
    if (params) c->params = *params;
    if (c->params.timeout_ms <= 0) c->params.timeout_ms = 30000;
    if (c->params.abort_timeout_ms <= 0) c->params.abort_timeout_ms = 2000;
    if (c->params.spin_us == 0) c->params.spin_us = KVX_SPIN_US_DEFAULT;
    if (c->params.spin_us < 0) c->params.spin_us = 0;
    pthread_mutex_init(&c->mu, NULL);
    c->uid = new_uid(c);
    c->next_epoch = c->uid ^ 0x5555;
    int err = kvx_lookup_create(c->params.lookup_budget, &c->lb);
    if (!err) err = kvx_pipe_address(pipe, c->addr, sizeof(c->addr), &c->addr_len);
    if (!err) err = kvx_pipe_set_am_handler(pipe, KVXI_AM_ID, on_am, c);
    if (!err) {
        kvx_pipe_allow_reset(pipe); /* the connector re-reads its address (pipe_reset) */
        c->pipe_gen = kvx_pipe_generation(pipe);
    }
    if (err) {
        kvx_conn_destroy(c);
        return err;
    }
    if (c->params.progress_thread) {
        if (pthread_create(&c->thread, NULL, progress_thread, c)) {
            kvx_conn_destroy(c);
            return TD_ENOMEM;
        }
        c->thread_on = true;
    }
    *out = c;
    return 0;
}

void kvx_conn_destroy(kvx_conn *c)
{
    if (!c) return;
    if (c->thread_on) {
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_mutex_unlock(&c->mu);
        kvx_pipe_signal(c->pipe);
        pthread_join(c->thread, NULL);
    }
    /* the pipe goes first: its pending operations call back into live records */
    if (c->pipe) {
        for (int i = 0; i < c->n_peers; i++)
            if (c->peers[i].peer >= 0 && c->peers[i].rkey)
                kvx_pipe_rkey_destroy(c->pipe, c->peers[i].rkey);
        if (c->dec_mem) kvx_pipe_mem_dereg(c->pipe, c->dec_mem);
        kvx_pipe_destroy(c->pipe);
    }
    while (c->preqs) {
        kvxi_pf_req *r = c->preqs;
        c->preqs = r->next;
        kvxi_pf_free(r);
    }
    while (c->dreqs) {
        kvxi_dec_req *r = c->dreqs;
        c->dreqs = r->next;
        free(r->w);
        free(r);
    }
    while (c->inbox) {
        kvxi_queued_msg *q = c->inbox;
        c->inbox = q->next;
        free(q);
    }
    while (c->stage_pool) {
        kvxi_chunk_copy *a = c->stage_pool;
        c->stage_pool = a->next;
        free(a);
    }
    kvx_lookup_destroy(c->lb, kvxi_free_copy, NULL);
    free(c->peers);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

int kvx_conn_close_idle(kvx_conn *c)
{
    int n = 0;
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < c->n_peers; i++)
        if (c->peers[i].peer >= 0 && c->peers[i].refs == 0) {
            kvxi_peer_close(c, i, false);
            n++;
        }
    while (c->stage_pool) {
        kvxi_chunk_copy *a = c->stage_pool;
        c->stage_pool = a->next;
        c->stage_pool_bytes -= a->bytes;
        c->held_bytes -= a->bytes;
        free(a);
    }
    pthread_mutex_unlock(&c->mu);
    return n;
}

void kvx_conn_stats_get(kvx_conn *c, kvx_conn_stats *out)
{
    memset(out, 0, sizeof(*out));
    pthread_mutex_lock(&c->mu);
    out->dec_requests = c->n_dreqs;
    out->pf_requests = c->n_preqs;
    for (int i = 0; i < c->n_peers; i++)
        out->peers += c->peers[i].peer >= 0;
    kvx_pipe_stats_get(c->pipe, &out->pipe);
    kvx_lookup_stats ls;
    kvx_lookup_stats_get(c->lb, &ls);
    out->queued_bytes = ls.bytes;
    out->queued_chunks = ls.entries;
    out->held_bytes = c->held_bytes - c->stage_pool_bytes;
    out->pooled_bytes = c->stage_pool_bytes;
    pthread_mutex_unlock(&c->mu);
}

/* --- target encoding helpers ---------------------------------------------------------- */

/* The element word of an encoded layout: dtype_size in its low 16 bits, KVXI_LAYOUT_LATENT
 * for a one-array (latent) layout. A K+V layout encodes as it always did (its targets are
 * byte for byte those of a connector without the latent layout); a connector without it
 * reads a latent target's word as a dtype size over 16, an invalid layout: the target is
 * refused as malformed, never written with K+V offsets. */
#define KVXI_LAYOUT_LATENT (1u << 16)

void kvxi_wr_layout(kvx_wr *w, const kvx_layout *l)
{
    kvx_wr_u32(w, l->layer0);
    kvx_wr_u32(w, l->n_layers);
    kvx_wr_u32(w, l->n_kv_heads);
    kvx_wr_u32(w, l->head0);
    kvx_wr_u32(w, l->n_heads);
    kvx_wr_u32(w, l->block_size);
    kvx_wr_u32(w, l->head_dim);
    kvx_wr_u32(w, l->dtype_size | (kvx_layout_arrays(l) == 1 ? KVXI_LAYOUT_LATENT : 0));
    kvx_wr_u32(w, l->n_blocks);
}

void kvxi_rd_layout(kvx_rd *r, kvx_layout *l)
{
    l->layer0 = kvx_rd_u32(r);
    l->n_layers = kvx_rd_u32(r);
    l->n_kv_heads = kvx_rd_u32(r);
    l->head0 = kvx_rd_u32(r);
    l->n_heads = kvx_rd_u32(r);
    l->block_size = kvx_rd_u32(r);
    l->head_dim = kvx_rd_u32(r);
    uint32_t elem = kvx_rd_u32(r);
    l->kv_arrays = elem & KVXI_LAYOUT_LATENT ? 1 : 2;
    l->dtype_size = elem & ~KVXI_LAYOUT_LATENT; /* other high bits: over 16, invalid */
    l->n_blocks = kvx_rd_u32(r);
    l->n_slices = 0; /* never sliced on the wire */
    memset(l->slice_heads, 0, sizeof(l->slice_heads));
}
