/* fuzz_kvx.c: libFuzzer target for the bytes kvxfer takes from outside: KV targets
 * (kvx_pf_add_target -> target_decode, the frame, the layout, the peer address and rkey
 * decoding of the pipe) and active messages (msg_parse, then the decode side's
 * BEGIN/DONE/STOPPED and the prefill side's ACCEPT/REFUSE/ABORT handling).
 *
 * Every input builds a fresh in-process cluster on a fake fabric (kvx_pipe_fake.c): a
 * decode connector D with a registered KV region and a real target for request 1, a
 * prefill connector P with a source region and request 1 open, and a bare pipe X that
 * injects raw active messages into D or P. Nothing survives the input.
 *
 * Input: flags u8, target length u16 LE, target bytes, then records
 * (dst u8, length u16 LE, bytes) of messages; a short input simply ends early.
 *   flags & 3   0: P gets D's real target; 1: the bytes as a whole target blob; 2: the
 *               bytes are a target payload the harness frames (magic, version, kind,
 *               length, checksum) after filling placeholders: epoch 0, key 0, connector id 0,
 *               base and region bytes all-ones -> D's; address length 0xffffffff -> D's address;
 *               then rkey length 0xffffffff -> D's rkey. (Random bytes would otherwise
 *               almost never pass the checksum or reach the peer.)
 *   flags & 4   send a chunk before the handshake (queued) and one after it (direct)
 *   flags & 8   finish the prefill request
 *   flags & 16  abort the decode request after the messages; flags & 32: the prefill one
 *   dst & 1     0: message to D; 1: to P. dst & 2: fill placeholders: magic 0 -> the
 *               message magic, epoch 0 -> D's request epoch, key 0 -> its key (without
 *               which D drops the message), connector id 0 -> D's,
 *               address length 0xffffffff -> X's address, 0xfffffffe -> P's.
 *
 * Oracle: no crash, leak or out-of-bounds access; every put P issues lands inside the
 * region its target claims (a wrapper pipe checks this: a real transport, e.g. UCX over
 * cma, would write wherever it is told); when the request is over and released, no chunk
 * copies or staging buffers are held.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvx_conn.h"
#include "kvx_wire.h"
#include "td_err.h"

/* ---- a pipe wrapper that checks puts against the target's claimed region ----------- */

typedef struct {
    kvx_pipe base;
    kvx_pipe *in;
    uint64_t lo, hi; /* [lo, hi): the region the last accepted target claims */
    bool armed;
} guard;

static kvx_pipe *IN(kvx_pipe *p)
{
    return ((guard *)p)->in;
}
static void g_destroy(kvx_pipe *p)
{
    kvx_pipe_destroy(IN(p));
    free(p);
}
static int g_address(kvx_pipe *p, void *b, size_t c, size_t *l)
{
    return kvx_pipe_address(IN(p), b, c, l);
}
static int g_connect(kvx_pipe *p, const void *a, size_t l, kvx_peer *o)
{
    return kvx_pipe_connect(IN(p), a, l, o);
}
static void g_disconnect(kvx_pipe *p, kvx_peer pe, bool f)
{
    kvx_pipe_disconnect(IN(p), pe, f);
}
static int g_peer_status(kvx_pipe *p, kvx_peer pe)
{
    return kvx_pipe_peer_status(IN(p), pe);
}
static int g_mem_reg(kvx_pipe *p, void *b, size_t l, kvx_mem **o)
{
    return kvx_pipe_mem_reg(IN(p), b, l, o);
}
static void g_mem_dereg(kvx_pipe *p, kvx_mem *m)
{
    kvx_pipe_mem_dereg(IN(p), m);
}
static int g_rkey_pack(kvx_pipe *p, kvx_mem *m, void *b, size_t c, size_t *l)
{
    return kvx_pipe_rkey_pack(IN(p), m, b, c, l);
}
static int g_rkey_unpack(kvx_pipe *p, kvx_peer pe, const void *b, size_t l, kvx_rkey **o)
{
    return kvx_pipe_rkey_unpack(IN(p), pe, b, l, o);
}
static void g_rkey_destroy(kvx_pipe *p, kvx_rkey *rk)
{
    kvx_pipe_rkey_destroy(IN(p), rk);
}
static int g_put(kvx_pipe *p, kvx_peer pe, const void *src, size_t len, uint64_t raddr,
                 kvx_rkey *rk)
{
    guard *g = (guard *)p;
    if (!g->armed || raddr < g->lo || len > g->hi - g->lo || raddr - g->lo > g->hi - g->lo - len)
        abort(); /* a put outside the region the target claims */
    return kvx_pipe_put(g->in, pe, src, len, raddr, rk);
}
static int g_flush(kvx_pipe *p, kvx_peer pe, kvx_done_cb cb, void *a)
{
    return kvx_pipe_flush(IN(p), pe, cb, a);
}
static int g_set_am(kvx_pipe *p, unsigned id, kvx_am_cb cb, void *a)
{
    return kvx_pipe_set_am_handler(IN(p), id, cb, a);
}
static int g_am_send(kvx_pipe *p, kvx_peer pe, unsigned id, const void *b, size_t l, kvx_done_cb cb,
                     void *a)
{
    return kvx_pipe_am_send(IN(p), pe, id, b, l, cb, a);
}
static int g_tag_send(kvx_pipe *p, kvx_peer pe, uint64_t t, const void *b, size_t l, kvx_done_cb cb,
                      void *a)
{
    return kvx_pipe_tag_send(IN(p), pe, t, b, l, cb, a);
}
static int g_tag_recv(kvx_pipe *p, uint64_t t, void *b, size_t c, kvx_done_cb cb, void *a)
{
    return kvx_pipe_tag_recv(IN(p), t, b, c, cb, a);
}
static int g_progress(kvx_pipe *p)
{
    return kvx_pipe_progress(IN(p));
}
static int g_arm(kvx_pipe *p)
{
    return kvx_pipe_arm(IN(p));
}
static int g_event_fd(kvx_pipe *p)
{
    return kvx_pipe_event_fd(IN(p));
}
static void g_signal(kvx_pipe *p)
{
    kvx_pipe_signal(IN(p));
}
static void g_stats(kvx_pipe *p, kvx_pipe_stats *o)
{
    kvx_pipe_stats_get(IN(p), o);
}

static const kvx_pipe_ops guard_ops = {
    .name = "guard",
    .destroy = g_destroy,
    .address = g_address,
    .connect = g_connect,
    .disconnect = g_disconnect,
    .peer_status = g_peer_status,
    .mem_reg = g_mem_reg,
    .mem_dereg = g_mem_dereg,
    .rkey_pack = g_rkey_pack,
    .rkey_unpack = g_rkey_unpack,
    .rkey_destroy = g_rkey_destroy,
    .put = g_put,
    .flush = g_flush,
    .set_am_handler = g_set_am,
    .am_send = g_am_send,
    .tag_send = g_tag_send,
    .tag_recv = g_tag_recv,
    .progress = g_progress,
    .arm = g_arm,
    .event_fd = g_event_fd,
    .signal = g_signal,
    .stats = g_stats,
};

/* ---- input reading ------------------------------------------------------------------ */

typedef struct {
    const uint8_t *p;
    size_t n;
} in_t;

static bool take(in_t *in, size_t k, const uint8_t **out)
{
    if (in->n < k) return false;
    *out = in->p;
    in->p += k;
    in->n -= k;
    return true;
}

static bool take_u8(in_t *in, uint8_t *v)
{
    const uint8_t *b;
    if (!take(in, 1, &b)) return false;
    *v = b[0];
    return true;
}

static bool take_blob(in_t *in, const uint8_t **b, size_t *len)
{
    const uint8_t *h;
    if (!take(in, 2, &h)) return false;
    size_t l = (size_t)h[0] | (size_t)h[1] << 8;
    if (l > in->n) l = in->n; /* a short last blob: what is there */
    *len = l;
    return take(in, l, b);
}

static uint64_t get64(const uint8_t *b)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)b[i] << (8 * i);
    return v;
}
static uint32_t get32(const uint8_t *b)
{
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}
static void put64(uint8_t *b, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
}
static void put32(uint8_t *b, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        b[i] = (uint8_t)(v >> (8 * i));
}

/* ---- the per-input cluster ---------------------------------------------------------- */

#define N_BLOCKS 8
static const kvx_layout LAYOUT = {.layer0 = 0,
                                  .n_layers = 2,
                                  .n_kv_heads = 4,
                                  .head0 = 0,
                                  .n_heads = 4,
                                  .block_size = 4,
                                  .head_dim = 4,
                                  .dtype_size = 2,
                                  .n_blocks = N_BLOCKS};

/* target payload offsets (kvx_dec_make_target's order) */
enum { T_EPOCH = 8, T_KEY = 16, T_UID = 32, T_BASE = 88, T_BYTES = 96, T_ADDR_LEN = 104 };
/* message offsets (msg_encode's order) */
enum { M_EPOCH = 16, M_KEY = 24, M_UID = 40, M_ADDR_LEN = 72, M_HDR = 76 };

typedef struct {
    kvx_fake_fabric *fab;
    kvx_conn *d, *p;
    guard *g;
    kvx_pipe *x;
    kvx_peer x_to_d, x_to_p;
    uint8_t *dreg, *sreg;
    uint8_t tgt[512]; /* D's real target for request 1 */
    size_t tgt_len;
    uint64_t epoch, uid, base, bytes;
    uint8_t key[16]; /* D's request key (the real target's) */
    const uint8_t *d_addr, *d_rkey;
    uint32_t d_addr_len, d_rkey_len;
    uint8_t x_addr[KVX_ADDR_MAX], p_addr[KVX_ADDR_MAX];
    size_t x_addr_len, p_addr_len;
} world;

static void progress(world *w, int rounds)
{
    for (int i = 0; i < rounds; i++) {
        kvx_conn_progress(w->d, 0);
        kvx_conn_progress(w->p, 0);
        kvx_pipe_progress(w->x);
    }
}

static int world_init(world *w)
{
    memset(w, 0, sizeof *w);
    size_t rb = kvx_layout_bytes(&LAYOUT);
    w->dreg = calloc(1, rb);
    w->sreg = calloc(1, rb);
    if (!w->dreg || !w->sreg || kvx_fake_fabric_create(&w->fab)) return -1;
    kvx_pipe *pd, *pp;
    if (kvx_pipe_fake_create(w->fab, NULL, &pd)) return -1;
    if (kvx_conn_create(pd, NULL, &w->d)) return -1;
    if (kvx_pipe_fake_create(w->fab, NULL, &pp)) return -1;
    w->g = calloc(1, sizeof *w->g);
    if (!w->g) {
        kvx_pipe_destroy(pp);
        return -1;
    }
    w->g->base.ops = &guard_ops;
    w->g->in = pp;
    if (kvx_conn_create(&w->g->base, NULL, &w->p)) return -1;
    if (kvx_pipe_fake_create(w->fab, NULL, &w->x)) return -1;
    for (size_t i = 0; i < rb; i++)
        w->sreg[i] = (uint8_t)(i * 7);
    if (kvx_dec_register(w->d, w->dreg, rb, &LAYOUT) ||
        kvx_pf_register_source(w->p, w->sreg, rb, &LAYOUT))
        return -1;
    static const int32_t blocks[] = {3, 0, 5, 6};
    kvx_dec_req_params dp = {.n_stages = 1, .rank = 0, .tp = 1, .blocks = blocks, .n_blocks = 4};
    if (kvx_dec_make_target(w->d, 1, &dp, w->tgt, sizeof w->tgt, &w->tgt_len)) return -1;
    kvx_pf_req_params pp_ = {.stage = 0};
    if (kvx_pf_open(w->p, 1, &pp_)) return -1;
    /* what the placeholders stand for, read back from the real target */
    const uint8_t *pl = w->tgt + KVX_FRAME_HDR;
    w->epoch = get64(pl + T_EPOCH);
    memcpy(w->key, pl + T_KEY, sizeof w->key);
    w->uid = get64(pl + T_UID);
    w->base = get64(pl + T_BASE);
    w->bytes = get64(pl + T_BYTES);
    w->d_addr_len = get32(pl + T_ADDR_LEN);
    w->d_addr = pl + T_ADDR_LEN + 4;
    w->d_rkey_len = get32(w->d_addr + w->d_addr_len);
    w->d_rkey = w->d_addr + w->d_addr_len + 4;
    if (kvx_pipe_address(w->x, w->x_addr, sizeof w->x_addr, &w->x_addr_len) ||
        kvx_pipe_address(pp, w->p_addr, sizeof w->p_addr, &w->p_addr_len))
        return -1;
    size_t al;
    uint8_t a[KVX_ADDR_MAX];
    kvx_pipe *pd_in = pd;
    if (kvx_pipe_address(pd_in, a, sizeof a, &al) || kvx_pipe_connect(w->x, a, al, &w->x_to_d) ||
        kvx_pipe_connect(w->x, w->p_addr, w->p_addr_len, &w->x_to_p))
        return -1;
    return 0;
}

static void world_fini(world *w)
{
    kvx_conn_destroy(w->d); /* each connector destroys its pipe (P: the guard and the fake) */
    kvx_conn_destroy(w->p);
    kvx_pipe_destroy(w->x);
    kvx_fake_fabric_destroy(w->fab);
    free(w->dreg);
    free(w->sreg);
}

/* Frame a target payload after filling its placeholders; returns the blob length. */
static size_t make_target(world *w, const uint8_t *pl, size_t n, uint8_t *out, size_t cap)
{
    uint8_t buf[4096];
    size_t len = 0;
    if (n > 2048) n = 2048;
    memcpy(buf, pl, n);
    len = n;
    if (len >= T_ADDR_LEN) {
        if (!get64(buf + T_EPOCH)) put64(buf + T_EPOCH, w->epoch);
        if (!get64(buf + T_KEY) && !get64(buf + T_KEY + 8)) memcpy(buf + T_KEY, w->key, 16);
        if (!get64(buf + T_UID)) put64(buf + T_UID, w->uid);
        if (get64(buf + T_BASE) == UINT64_MAX) put64(buf + T_BASE, w->base);
        if (get64(buf + T_BYTES) == UINT64_MAX) put64(buf + T_BYTES, w->bytes);
    }
    /* splice D's address and rkey in place of 0xffffffff lengths */
    size_t off = T_ADDR_LEN;
    for (int k = 0; k < 2 && off + 4 <= len; k++) {
        uint32_t l = get32(buf + off);
        const uint8_t *rep = k == 0 ? w->d_addr : w->d_rkey;
        uint32_t rl = k == 0 ? w->d_addr_len : w->d_rkey_len;
        if (l == 0xffffffffu && len + rl <= sizeof buf) {
            put32(buf + off, rl);
            memmove(buf + off + 4 + rl, buf + off + 4, len - off - 4);
            memcpy(buf + off + 4, rep, rl);
            len += rl;
            l = rl;
        }
        if (l > len - off - 4) break;
        off += 4 + l;
    }
    size_t out_len;
    if (!kvx_frame_write(out, cap, KVX_MAGIC_TARGET, KVX_KIND_UCX, buf, len, &out_len)) return 0;
    return out_len;
}

static void send_msg(world *w, uint8_t dst, const uint8_t *b, size_t n)
{
    uint8_t buf[KVX_AM_MAX];
    if (n > KVX_AM_MAX - KVX_ADDR_MAX / 2) n = KVX_AM_MAX - KVX_ADDR_MAX / 2;
    memcpy(buf, b, n);
    size_t len = n;
    if (dst & 2) {
        if (len >= 4 && !get32(buf)) put32(buf, KVX_MAGIC_MSG);
        if (len >= M_EPOCH + 8 && !get64(buf + M_EPOCH)) put64(buf + M_EPOCH, w->epoch);
        if (len >= M_KEY + 16 && !get64(buf + M_KEY) && !get64(buf + M_KEY + 8))
            memcpy(buf + M_KEY, w->key, 16);
        if (len >= M_UID + 8 && !get64(buf + M_UID)) put64(buf + M_UID, w->uid);
        if (len >= M_HDR) {
            uint32_t l = get32(buf + M_ADDR_LEN);
            const uint8_t *rep = l == 0xffffffffu ? w->x_addr : l == 0xfffffffeu ? w->p_addr : NULL;
            size_t rl = l == 0xffffffffu ? w->x_addr_len : w->p_addr_len;
            if (rep && len + rl <= sizeof buf) {
                put32(buf + M_ADDR_LEN, (uint32_t)rl);
                memmove(buf + M_HDR + rl, buf + M_HDR, len - M_HDR);
                memcpy(buf + M_HDR, rep, rl);
                len += rl;
            }
        }
    }
    kvx_pipe_am_send(w->x, (dst & 1) ? w->x_to_p : w->x_to_d, 0, buf, len, NULL, NULL);
}

/* The region a target blob claims (false if it is too short to say). */
static bool claimed(const uint8_t *t, size_t n, uint64_t *lo, uint64_t *hi)
{
    if (n < KVX_FRAME_HDR + T_ADDR_LEN) return false;
    uint64_t b = get64(t + KVX_FRAME_HDR + T_BASE), l = get64(t + KVX_FRAME_HDR + T_BYTES);
    *lo = b;
    *hi = b + l < b ? UINT64_MAX : b + l;
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int quiet;
    if (!quiet) {
        td_log_set_level(TD_LOG_ERROR + 1); /* malformed input is logged: keep it quiet */
        quiet = 1;
    }
    in_t in = {data, size};
    uint8_t flags = 0;
    take_u8(&in, &flags);
    const uint8_t *tb = NULL;
    size_t tn = 0;
    take_blob(&in, &tb, &tn);

    world w;
    if (world_init(&w)) abort(); /* the fake never fails to set up */

    uint8_t tbuf[4200];
    const uint8_t *target = w.tgt;
    size_t target_len = w.tgt_len;
    if ((flags & 3) == 1) {
        target = tb;
        target_len = tn;
    } else if ((flags & 3) == 2) {
        target_len = make_target(&w, tb ? tb : (const uint8_t *)"", tn, tbuf, sizeof tbuf);
        target = tbuf;
    }
    uint8_t *exact = malloc(target_len ? target_len : 1); /* exact size: ASan sees overreads */
    if (!exact) abort();
    if (target_len) memcpy(exact, target, target_len);
    w.g->armed = claimed(exact, target_len, &w.g->lo, &w.g->hi);
    int added = kvx_pf_add_target(w.p, 1, exact, target_len);
    free(exact);
    if (added && (flags & 3) == 0) abort(); /* the real target is always accepted */

    static const int32_t src_blocks[] = {2, 7, 1, 4};
    if (flags & 4) kvx_pf_send_chunk(w.p, 1, 0, 0, 5, src_blocks, 4);
    progress(&w, 3);
    if (flags & 4) kvx_pf_send_chunk(w.p, 1, 1, 5, 9, src_blocks, 4);

    uint8_t dst;
    const uint8_t *mb;
    size_t mn;
    int n_msgs = 0;
    while (n_msgs < 16 && take_u8(&in, &dst) && take_blob(&in, &mb, &mn)) {
        send_msg(&w, dst, mb, mn);
        progress(&w, 1);
        n_msgs++;
    }
    if (flags & 8) {
        kvx_meta meta = {.first_token = 7, .n_tokens = 9};
        kvx_pf_finish(w.p, 1, &meta);
    }
    progress(&w, 3);
    if (flags & 16) kvx_dec_abort(w.d, 1);
    if (flags & 32) kvx_pf_abort(w.p, 1);
    progress(&w, 3);

    /* wind down: abort whatever is still running, let the handshakes finish, release */
    kvx_dec_abort(w.d, 1);
    kvx_pf_abort(w.p, 1);
    progress(&w, 6);
    kvx_pf_status ps;
    kvx_dec_status ds;
    if (kvx_pf_poll(w.p, 1, &ps) == 0 && kvx_pf_release(w.p, 1) == 0) {
        kvx_conn_stats st;
        kvx_conn_stats_get(w.p, &st);
        if (st.pf_requests || st.held_bytes || st.queued_bytes || st.queued_chunks) abort();
    }
    if (kvx_dec_poll(w.d, 1, &ds) == 0 && kvx_dec_release(w.d, 1) == 0) {
        kvx_conn_stats st;
        kvx_conn_stats_get(w.d, &st);
        if (st.dec_requests) abort();
    }
    world_fini(&w);
    return 0;
}
