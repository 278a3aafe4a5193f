/* test_kvx_conn.c: the connector on the in-process fake transport: byte-exact transfers
 * for every TP pairing and PP layer ranges, chunks out of order, a late target (lookup
 * buffer path), coalescing counts, per-chunk flushes and times (ordered, a chunk's KV in
 * place once it landed, copies and staging freed before finish, a failing put), aborts
 * from either side, timeouts, killed peers, malformed targets, a full lookup buffer, the
 * progress thread; no leaks after each. */
#define _GNU_SOURCE /* memfd_create (kvx_scenario.h) */
#include <string.h>
#include <sys/resource.h>

#include "kvx_conn.h"
#include "kvx_scenario.h"
#include "kvx_wire.h"
#include "td_clock.h"
#include "td_tp.h"
#include "tharness.h"

#define MAXC 16

typedef struct {
    kvx_fake_fabric *fab;
    int n_dec, n_src;
    kvx_conn *dec[MAXC], *src[MAXC];
    kvx_pipe *dec_pipe[MAXC], *src_pipe[MAXC];
    uint8_t *dreg[MAXC], *sreg[MAXC];
    kvx_layout dl[MAXC], sl[MAXC];
    uint32_t src_stage[MAXC], src_rank[MAXC], src_tp;
} world;

typedef struct {
    uint32_t n_kv_heads, head_dim, block_size, n_layers;
    uint32_t n_q_heads; /* query heads (td_tp.h's rule); 0: as many as KV heads */
    uint32_t src_tp, dst_tp, pp;
    uint32_t layer_split[4]; /* stage s holds [split[s], split[s+1]); split[pp] = n_layers */
    uint32_t n_blocks;       /* per region */
    int timeout_ms;
    size_t lookup_budget;
    bool progress_thread;
    bool sliced; /* sources sliced for the decode ranks' head ranges (kvx_layout_slice) */
    int spin_us; /* kvx_conn_params.spin_us (0: the default) */
    uint32_t dec_arrays, src_arrays; /* kvx_layout.kv_arrays (0: K and V; 1: latent) */
} wcfg;

/* The KV heads rank r of tp holds (common/td_tp.h), into l. */
static void layout_heads(const wcfg *c, uint32_t tp, uint32_t r, kvx_layout *l)
{
    td_tp_heads h;
    int nq = (int)(c->n_q_heads ? c->n_q_heads : c->n_kv_heads);
    if (td_tp_heads_of_rank(nq, (int)c->n_kv_heads, (int)tp, (int)r, &h)) abort();
    l->head0 = (uint32_t)h.kv0;
    l->n_heads = (uint32_t)h.n_kv;
}

static void world_init(world *w, const wcfg *c)
{
    memset(w, 0, sizeof(*w));
    if (kvx_fake_fabric_create(&w->fab)) abort();
    kvx_conn_params cp = {.timeout_ms = c->timeout_ms ? c->timeout_ms : 5000,
                          .abort_timeout_ms = 500,
                          .lookup_budget = c->lookup_budget,
                          .progress_thread = c->progress_thread,
                          .spin_us = c->spin_us};
    w->n_dec = (int)c->dst_tp;
    for (uint32_t r = 0; r < c->dst_tp; r++) {
        kvx_layout *l = &w->dl[r];
        *l = (kvx_layout){.layer0 = 0,
                          .n_layers = c->n_layers,
                          .n_kv_heads = c->n_kv_heads,
                          .block_size = c->block_size,
                          .head_dim = c->head_dim,
                          .dtype_size = 2,
                          .n_blocks = c->n_blocks,
                          .kv_arrays = c->dec_arrays};
        layout_heads(c, c->dst_tp, r, l);
        w->dreg[r] = calloc(1, kvx_layout_bytes(l));
        if (kvx_pipe_fake_create(w->fab, NULL, &w->dec_pipe[r])) abort();
        if (kvx_conn_create(w->dec_pipe[r], &cp, &w->dec[r])) abort();
        if (kvx_dec_register(w->dec[r], w->dreg[r], kvx_layout_bytes(l), l)) abort();
    }
    cp.progress_thread = false;
    w->n_src = (int)(c->pp * c->src_tp);
    for (uint32_t s = 0; s < c->pp; s++)
        for (uint32_t r = 0; r < c->src_tp; r++) {
            int i = (int)(s * c->src_tp + r);
            kvx_layout *l = &w->sl[i];
            *l = (kvx_layout){.layer0 = c->layer_split[s],
                              .n_layers = c->layer_split[s + 1] - c->layer_split[s],
                              .n_kv_heads = c->n_kv_heads,
                              .block_size = c->block_size,
                              .head_dim = c->head_dim,
                              .dtype_size = 2,
                              .n_blocks = c->n_blocks,
                              .kv_arrays = c->src_arrays};
            layout_heads(c, c->src_tp, r, l);
            if (c->sliced) {
                uint32_t rg[2 * MAXC];
                for (uint32_t d = 0; d < c->dst_tp; d++) {
                    rg[2 * d] = w->dl[d].head0;
                    rg[2 * d + 1] = w->dl[d].head0 + w->dl[d].n_heads;
                }
                if (kvx_layout_slice(l, rg, c->dst_tp)) abort();
            }
            w->sreg[i] = calloc(1, kvx_layout_bytes(l));
            w->src_stage[i] = s;
            w->src_rank[i] = r;
            w->src_tp = c->src_tp;
            if (kvx_pipe_fake_create(w->fab, NULL, &w->src_pipe[i])) abort();
            if (kvx_conn_create(w->src_pipe[i], &cp, &w->src[i])) abort();
            if (kvx_pf_register_source(w->src[i], w->sreg[i], kvx_layout_bytes(l), l)) abort();
        }
}

static void progress_all(world *w, int sleep_ms)
{
    int n = 0;
    for (int i = 0; i < w->n_dec; i++)
        n += kvx_conn_progress(w->dec[i], 0);
    for (int i = 0; i < w->n_src; i++)
        n += kvx_conn_progress(w->src[i], 0);
    if (!n && sleep_ms && w->n_dec) kvx_conn_progress(w->dec[0], sleep_ms);
}

/* Leak check, then teardown: no requests, no endpoints, registrations only the pool. */
static void world_fini(world *w)
{
    for (int k = 0; k < 5; k++)
        progress_all(w, 0);
    kvx_conn_stats st;
    for (int i = 0; i < w->n_dec + w->n_src; i++) {
        kvx_conn *c = i < w->n_dec ? w->dec[i] : w->src[i - w->n_dec];
        kvx_conn_close_idle(c);
        kvx_conn_stats_get(c, &st);
        TH_CHECKF(st.dec_requests == 0 && st.pf_requests == 0 && st.peers == 0 &&
                      st.pipe.peers == 0 && st.pipe.rkeys == 0 && st.pipe.pending_ops == 0 &&
                      st.queued_chunks == 0 && st.queued_bytes == 0 && st.held_bytes == 0 &&
                      st.pipe.mems == (i < w->n_dec ? 1 : 0),
                  "conn %d: requests %d/%d peers %d/%d rkeys %d ops %d queued %d held %zu "
                  "mems %d",
                  i, st.dec_requests, st.pf_requests, st.peers, st.pipe.peers, st.pipe.rkeys,
                  st.pipe.pending_ops, st.queued_chunks, st.held_bytes, st.pipe.mems);
    }
    for (int i = 0; i < w->n_dec; i++) {
        kvx_conn_destroy(w->dec[i]);
        free(w->dreg[i]);
    }
    for (int i = 0; i < w->n_src; i++) {
        kvx_conn_destroy(w->src[i]);
        free(w->sreg[i]);
    }
    kvx_fake_fabric_destroy(w->fab);
}

typedef struct {
    uint64_t req;
    uint32_t n_tokens, chunk;
    int order; /* 0 in order, 1 reversed, 2 interleaved odd/even */
    bool late; /* targets arrive after the chunks */
    uint32_t salt;
    uint32_t dst_run;   /* decode block runs */
    bool aligned_src;   /* source blocks contiguous (else reversed) */
    uint32_t src_gap;   /* with aligned_src: an id skipped after every src_gap blocks (0: none) */
    bool ready;         /* chunks only once every source is READY: put from the source region
                           itself (else the first chunks may wait as copies) */
    uint32_t first_pos; /* the decode ranks hold [0, first_pos) already (never written) */
} xfer;

typedef struct {
    int32_t dblk[MAXC][256];
    int32_t sblk[MAXC][256];
    uint32_t nb;
    uint8_t tgt[MAXC][8192];
    size_t tgt_len[MAXC];
} xstate;

static bool all_final(world *w, uint64_t req)
{
    for (int i = 0; i < w->n_dec; i++) {
        kvx_dec_status ds;
        if (kvx_dec_poll(w->dec[i], req, &ds) == 0 && ds.state != KVX_REQ_DONE &&
            ds.state != KVX_REQ_FAILED)
            return false;
    }
    for (int i = 0; i < w->n_src; i++) {
        kvx_pf_status ps;
        if (kvx_pf_poll(w->src[i], req, &ps) == 0 && ps.state != KVX_REQ_DONE &&
            ps.state != KVX_REQ_FAILED)
            return false;
    }
    return true;
}

static bool pump_final(world *w, uint64_t req, int ms)
{
    int64_t end = td_now_ms() + ms;
    while (!all_final(w, req) && td_now_ms() < end)
        progress_all(w, 2);
    return all_final(w, req);
}

static void release_all(world *w, uint64_t req)
{
    for (int i = 0; i < w->n_dec; i++)
        kvx_dec_release(w->dec[i], req);
    for (int i = 0; i < w->n_src; i++)
        kvx_pf_release(w->src[i], req);
}

/* Decode ranks make targets; sources open (and get targets unless late). */
static void xfer_setup(world *w, const wcfg *c, const xfer *x, xstate *s)
{
    s->nb = (x->n_tokens + c->block_size - 1) / c->block_size;
    for (int i = 0; i < w->n_dec; i++) {
        memset(w->dreg[i], 0, kvx_layout_bytes(&w->dl[i])); /* so stray writes show */
        sc_blocks(s->dblk[i], s->nb, c->n_blocks, x->dst_run, 3 + (uint32_t)x->req * 7);
        kvx_dec_req_params dp = {.n_stages = c->pp,
                                 .rank = (uint32_t)i,
                                 .tp = c->dst_tp,
                                 .blocks = s->dblk[i],
                                 .n_blocks = s->nb,
                                 .first_pos = x->first_pos};
        TH_CHECK(kvx_dec_make_target(w->dec[i], x->req, &dp, s->tgt[i], sizeof(s->tgt[i]),
                                     &s->tgt_len[i]) == 0);
    }
    for (int i = 0; i < w->n_src; i++) {
        for (uint32_t b = 0; b < s->nb; b++)
            s->sblk[i][b] = x->aligned_src ? (int32_t)(b + 1 + (x->src_gap ? b / x->src_gap : 0))
                                           : (int32_t)(c->n_blocks - 1 - b);
        sc_fill(w->sreg[i], &w->sl[i], s->sblk[i], x->n_tokens, x->salt);
        kvx_pf_req_params pp = {
            .stage = w->src_stage[i], .src_rank = w->src_rank[i], .src_tp = w->src_tp};
        TH_CHECK(kvx_pf_open(w->src[i], x->req, &pp) == 0);
        if (!x->late)
            for (int d = 0; d < w->n_dec; d++)
                TH_CHECK(kvx_pf_add_target(w->src[i], x->req, s->tgt[d], s->tgt_len[d]) == 0);
    }
}

static void xfer_chunks(world *w, const xfer *x, xstate *s, uint32_t from, uint32_t to)
{
    uint32_t nch = (x->n_tokens + x->chunk - 1) / x->chunk;
    for (int i = 0; i < w->n_src; i++)
        for (uint32_t k = from; k < to && k < nch; k++) {
            uint32_t ci = x->order == 1 ? nch - 1 - k
                          : x->order == 2
                              ? (k < (nch + 1) / 2 ? 2 * k : 2 * (k - (nch + 1) / 2) + 1)
                              : k;
            uint32_t t0 = ci * x->chunk, t1 = t0 + x->chunk;
            if (t1 > x->n_tokens) t1 = x->n_tokens;
            TH_CHECK(kvx_pf_send_chunk(w->src[i], x->req, ci, t0, t1, s->sblk[i], s->nb) == 0);
        }
}

static void xfer_finish(world *w, const wcfg *c, const xfer *x, xstate *s)
{
    if (x->late)
        for (int i = 0; i < w->n_src; i++)
            for (int d = 0; d < w->n_dec; d++)
                TH_CHECK(kvx_pf_add_target(w->src[i], x->req, s->tgt[d], s->tgt_len[d]) == 0);
    for (int i = 0; i < w->n_src; i++) {
        kvx_meta m = {.first_token = w->src_stage[i] == c->pp - 1 ? 4242 : -1,
                      .n_tokens = x->n_tokens};
        TH_CHECK(kvx_pf_finish(w->src[i], x->req, &m) == 0);
    }
}

/* Wrong elements of rank d's blocks with a held prefix: positions below first_pos still 0
 * (never written: xfer_setup zeroed the region), the others the pattern. */
static size_t verify_cut(const world *w, int d, const xstate *s, const xfer *x, uint32_t layers)
{
    const kvx_layout *l = &w->dl[d];
    size_t bad = 0;
    for (uint32_t ll = 0; ll < layers; ll++)
        for (uint32_t kv = 0; kv < kvx_layout_arrays(l); kv++)
            for (uint32_t p = 0; p < x->n_tokens; p++)
                for (uint32_t h = 0; h < l->n_heads; h++)
                    for (uint32_t e = 0; e < l->head_dim; e++) {
                        uint16_t got =
                            *sc_elem(w->dreg[d], l, ll, kv, (uint32_t)s->dblk[d][p / l->block_size],
                                     h, p % l->block_size, e);
                        bad +=
                            got !=
                            (p < x->first_pos ? 0 : sc_value(x->salt, ll, kv, l->head0 + h, p, e));
                    }
    return bad;
}

static uint64_t last_bytes;  /* run_xfer: bytes the sources put */
static uint64_t last_staged; /* run_xfer: bytes of them staged first (kvx_pf_status.staged) */

/* Full transfer; returns the total puts and pieces of the sources. */
static void run_xfer(world *w, const wcfg *c, const xfer *x, uint64_t *puts, uint64_t *pieces)
{
    xstate *s = calloc(1, sizeof(*s));
    xfer_setup(w, c, x, s);
    for (int64_t end = td_now_ms() + 5000; x->ready && td_now_ms() < end;) {
        bool all = true;
        for (int i = 0; i < w->n_src; i++) {
            kvx_pf_status ps;
            all = all && kvx_pf_poll(w->src[i], x->req, &ps) == 0 && ps.state == KVX_REQ_READY;
        }
        if (all) break;
        progress_all(w, 1);
    }
    xfer_chunks(w, x, s, 0, 1000);
    if (x->late) {
        kvx_conn_stats st;
        kvx_conn_stats_get(w->src[0], &st);
        TH_CHECK(st.queued_chunks > 0);
    }
    xfer_finish(w, c, x, s);
    TH_CHECK(pump_final(w, x->req, 5000));
    *puts = *pieces = last_bytes = last_staged = 0;
    for (int i = 0; i < w->n_src; i++) {
        kvx_pf_status ps;
        TH_CHECK(kvx_pf_poll(w->src[i], x->req, &ps) == 0);
        TH_CHECKF(ps.state == KVX_REQ_DONE, "source %d: %s", i, kvx_req_state_name(ps.state));
        *puts += ps.puts;
        *pieces += ps.pieces;
        last_bytes += ps.bytes;
        last_staged += ps.staged;
        TH_CHECK(ps.staged <= ps.bytes);
    }
    for (int d = 0; d < w->n_dec; d++) {
        kvx_dec_status ds;
        TH_CHECK(kvx_dec_poll(w->dec[d], x->req, &ds) == 0);
        TH_CHECKF(ds.state == KVX_REQ_DONE, "rank %d: %s", d, kvx_req_state_name(ds.state));
        TH_CHECK(ds.stages_done == (1ull << c->pp) - 1);
        TH_CHECK(ds.meta[c->pp - 1].first_token == 4242 && ds.meta[0].n_tokens == x->n_tokens);
        size_t bad = x->first_pos ? verify_cut(w, d, s, x, c->n_layers)
                                  : sc_verify(w->dreg[d], &w->dl[d], s->dblk[d], s->nb, x->n_tokens,
                                              0, c->n_layers, x->salt, 1);
        TH_CHECKF(bad == 0, "rank %d: %zu wrong elements", d, bad);
    }
    release_all(w, x->req);
    free(s);
}

static wcfg base_cfg(uint32_t src_tp, uint32_t dst_tp)
{
    return (wcfg){.n_kv_heads = 4,
                  .head_dim = 8,
                  .block_size = 16,
                  .n_layers = 3,
                  .src_tp = src_tp,
                  .dst_tp = dst_tp,
                  .pp = 1,
                  .layer_split = {0, 3},
                  .n_blocks = 48};
}

static void test_tp_pairs(void)
{
    static const uint32_t pairs[][2] = {{1, 1}, {1, 2}, {1, 4}, {2, 1}, {2, 4}, {4, 2}, {4, 1}};
    for (size_t p = 0; p < sizeof(pairs) / sizeof(pairs[0]); p++) {
        wcfg c = base_cfg(pairs[p][0], pairs[p][1]);
        world w;
        world_init(&w, &c);
        xfer x = {.req = 10 + p,
                  .n_tokens = 150,
                  .chunk = 37,
                  .order = (int)(p % 3),
                  .salt = 77 + (uint32_t)p,
                  .dst_run = 4};
        uint64_t puts, pieces;
        run_xfer(&w, &c, &x, &puts, &pieces);
        fprintf(stderr, "  tp %u->%u: %llu pieces, %llu puts\n", pairs[p][0], pairs[p][1],
                (unsigned long long)pieces, (unsigned long long)puts);
        world_fini(&w);
    }
}

/* Decode ranks that share KV heads (td_tp.h): 14 query heads over 2 KV heads (Qwen2.5
 * 0.5B) to tp 7, where rank 3 holds both KV heads and the others one, and 4 query heads
 * over 2 KV heads to tp 4 (each KV head on two ranks). Every rank gets all heads of its
 * range, byte-exact, from a prefill stage that holds them all and from two split stages. */
static void test_tp_replicated_heads(void)
{
    static const uint32_t shapes[][4] = {{14, 2, 1, 7}, {4, 2, 1, 4}, {14, 2, 2, 7}};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        wcfg c = base_cfg(shapes[k][2], shapes[k][3]);
        c.n_q_heads = shapes[k][0];
        c.n_kv_heads = shapes[k][1];
        world w;
        world_init(&w, &c);
        xfer x = {.req = 40 + k,
                  .n_tokens = 90,
                  .chunk = 33,
                  .salt = 13 + (uint32_t)k,
                  .dst_run = 2,
                  .order = (int)k};
        uint64_t puts, pieces;
        run_xfer(&w, &c, &x, &puts, &pieces);
        fprintf(stderr, "  %u/%u heads, tp %u->%u: %llu pieces, %llu puts\n", shapes[k][0],
                shapes[k][1], shapes[k][2], shapes[k][3], (unsigned long long)pieces,
                (unsigned long long)puts);
        world_fini(&w);
    }
}

/* Two PP stages (layers 0-2 and 2-5) to 2 decode ranks; two requests back to back. */
static void test_pp_stages(void)
{
    wcfg c = base_cfg(1, 2);
    c.n_layers = 5;
    c.pp = 2;
    c.layer_split[0] = 0;
    c.layer_split[1] = 2;
    c.layer_split[2] = 5;
    world w;
    world_init(&w, &c);
    uint64_t puts, pieces;
    xfer x = {.req = 1, .n_tokens = 100, .chunk = 32, .salt = 5, .dst_run = 8};
    run_xfer(&w, &c, &x, &puts, &pieces);
    x.req = 2;
    x.salt = 6;
    x.order = 1;
    run_xfer(&w, &c, &x, &puts, &pieces);
    world_fini(&w);
}

/* Targets after the chunks: the chunks wait in the lookup buffer, then drain. */
static void test_late_target(void)
{
    wcfg c = base_cfg(2, 4);
    world w;
    world_init(&w, &c);
    uint64_t puts, pieces;
    xfer x = {
        .req = 3, .n_tokens = 130, .chunk = 20, .order = 2, .late = true, .salt = 9, .dst_run = 3};
    run_xfer(&w, &c, &x, &puts, &pieces);
    world_fini(&w);
}

/* A decode rank that holds a prefix (first_pos): two stages at tp 2 -> 2 put only the
 * positions at and after it, chunks queued before the target (late) included, and a chunk
 * entirely below it puts nothing but still lands; the bytes are exactly the rest's share;
 * a block-aligned and a mid-block first_pos; a target without one keeps the old size. */
static void test_first_pos(void)
{
    wcfg c = base_cfg(2, 2);
    c.pp = 2;
    c.layer_split[1] = 1;
    c.layer_split[2] = 3;
    static const uint32_t cuts[] = {32, 45};
    for (int late = 0; late < 2; late++)
        for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
            world w;
            world_init(&w, &c);
            uint64_t puts, pieces, full;
            xfer x = {.req = 60 + (uint64_t)(2 * late + (int)k),
                      .n_tokens = 100,
                      .chunk = 20,
                      .late = late,
                      .salt = 5,
                      .dst_run = 2};
            run_xfer(&w, &c, &x, &puts, &pieces);
            full = last_bytes;
            x.req += 100;
            x.first_pos = cuts[k];
            run_xfer(&w, &c, &x, &puts, &pieces);
            TH_CHECKF(last_bytes * x.n_tokens == full * (x.n_tokens - x.first_pos),
                      "first_pos %u: %llu of %llu bytes", x.first_pos,
                      (unsigned long long)last_bytes, (unsigned long long)full);
            world_fini(&w);
        }
    /* the optional tail: 4 bytes more, and a first position outside the blocks is refused */
    world w;
    wcfg c1 = base_cfg(1, 1);
    world_init(&w, &c1);
    int32_t blocks[4] = {1, 2, 3, 4};
    kvx_dec_req_params dp = {.n_stages = 1, .tp = 1, .blocks = blocks, .n_blocks = 4};
    uint8_t buf[4096];
    size_t len0, len1;
    TH_REQUIRE(kvx_dec_make_target(w.dec[0], 70, &dp, buf, sizeof(buf), &len0) == 0);
    dp.first_pos = 16;
    TH_REQUIRE(kvx_dec_make_target(w.dec[0], 71, &dp, buf, sizeof(buf), &len1) == 0);
    TH_CHECK(len1 == len0 + 4);
    dp.first_pos = 64;
    TH_CHECK(kvx_dec_make_target(w.dec[0], 72, &dp, buf, sizeof(buf), &len1) == TD_EINVAL);
    for (uint64_t id = 70; id < 72; id++) {
        kvx_dec_abort(w.dec[0], id);
        kvx_dec_release(w.dec[0], id);
    }
    world_fini(&w);
}

/* Coalescing: 1->1 with contiguous blocks on both sides and block-aligned chunks: one put
 * per (layer, K/V) per chunk; with runs of 4 on the decode side, one per run. */
static void test_coalescing(void)
{
    wcfg c = base_cfg(1, 1);
    world w;
    world_init(&w, &c);
    uint64_t puts, pieces;
    xfer x = {
        .req = 4, .n_tokens = 256, .chunk = 128, .salt = 1, .dst_run = 0, .aligned_src = true};
    run_xfer(&w, &c, &x, &puts, &pieces);
    TH_CHECKF(pieces == 3 * 2 * 16 && puts == 3 * 2 * 2, "pieces %llu puts %llu",
              (unsigned long long)pieces, (unsigned long long)puts);
    x.req = 5;
    x.dst_run = 4;
    run_xfer(&w, &c, &x, &puts, &pieces);
    TH_CHECKF(pieces == 3 * 2 * 16 && puts == 3 * 2 * 4, "pieces %llu puts %llu",
              (unsigned long long)pieces, (unsigned long long)puts);
    world_fini(&w);
}

/* Sliced sources (kvx_layout.n_slices): byte-exact for even, uneven and overlapping
 * (replicated) decode head ranges, from one and from two source TP ranks, chunks in and out
 * of order, queued chunks (late targets) too. Each shape runs head-major, then sliced: where
 * every decode rank's heads are one slice of each source, the sliced transfer needs the
 * same number of puts (whole-block chunks, contiguous source blocks) and no staging buffer,
 * where the head-major one stages; a rank spanning several slices (overlapping ranges) is
 * contiguous at the destination only across slices, so its pieces still stage (exactness
 * only). */
static void test_sliced_source(void)
{
    /* q heads, kv heads, src tp, dst tp, late */
    static const uint32_t shapes[][5] = {{4, 4, 1, 2, 0}, {4, 4, 1, 4, 1}, {4, 4, 2, 4, 0},
                                         {6, 3, 1, 3, 0}, {6, 3, 1, 2, 1}, {14, 2, 1, 7, 0}};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        uint64_t hm_puts = 0;
        for (int sliced = 0; sliced < 2; sliced++) {
            wcfg c = base_cfg(shapes[k][2], shapes[k][3]);
            c.n_q_heads = shapes[k][0];
            c.n_kv_heads = shapes[k][1];
            c.sliced = sliced;
            world w;
            world_init(&w, &c);
            xfer x = {.req = 80 + k,
                      .n_tokens = 128,
                      .chunk = 64,
                      .order = (int)(k % 2),
                      .late = shapes[k][4],
                      .salt = 21 + (uint32_t)k,
                      .dst_run = 0,
                      .aligned_src = true};
            uint64_t puts, pieces;
            run_xfer(&w, &c, &x, &puts, &pieces);
            size_t pooled = 0;
            bool one_slice = true; /* every rank's heads are one slice of every source */
            for (int i = 0; i < w.n_src; i++) {
                kvx_conn_stats st;
                kvx_conn_stats_get(w.src[i], &st);
                pooled += st.pooled_bytes;
                const kvx_layout *sl = &w.sl[i];
                for (int d = 0; d < w.n_dec; d++) {
                    uint32_t a = w.dl[d].head0, b = a + w.dl[d].n_heads, h = sl->head0, n = 0;
                    uint32_t ns = sl->n_slices > 1 ? sl->n_slices : 1;
                    for (uint32_t j = 0; j < ns; j++) {
                        uint32_t e = h + (ns > 1 ? sl->slice_heads[j] : sl->n_heads);
                        n += h < b && e > a;
                        h = e;
                    }
                    one_slice = one_slice && n <= 1;
                }
            }
            fprintf(stderr,
                    "  %u/%u heads, tp %u->%u, %s source (%u slices): %llu pieces, "
                    "%llu puts, %zu staging bytes pooled, %llu bytes staged\n",
                    shapes[k][0], shapes[k][1], shapes[k][2], shapes[k][3],
                    sliced ? "sliced" : "head-major", w.sl[0].n_slices, (unsigned long long)pieces,
                    (unsigned long long)puts, pooled, (unsigned long long)last_staged);
            if (!sliced) {
                hm_puts = puts;
                TH_CHECK(shapes[k][3] <= shapes[k][2] || (pooled > 0 && last_staged > 0));
            } else if (one_slice) {
                TH_CHECKF(pooled == 0 && last_staged == 0 && puts == hm_puts,
                          "%zu bytes pooled, %llu staged, %llu puts (%llu)", pooled,
                          (unsigned long long)last_staged, (unsigned long long)puts,
                          (unsigned long long)hm_puts);
            }
            world_fini(&w);
        }
    }
}

/* A sliced source whose block table has gaps (a prefill pool after its prefix cache evicted
 * and freed blocks): runs of source blocks go as they are where the run breaks (one more
 * put per gap, nothing copied), an isolated block is still gathered (with the piece after
 * it); byte-exact. The head-major source stages everything either way. */
static void test_sliced_gaps(void)
{
    uint64_t aligned_puts = 0;
    for (uint32_t gap = 0; gap < 4; gap += gap ? 2 : 1) { /* 0 (none), 1 (isolated), 3 */
        for (int sliced = 0; sliced < 2; sliced++) {
            wcfg c = base_cfg(1, 4);
            c.sliced = sliced;
            world w;
            world_init(&w, &c);
            xfer x = {.req = 90 + gap * 2 + (uint64_t)sliced,
                      .n_tokens = 192,
                      .chunk = 64,
                      .salt = 31 + gap,
                      .aligned_src = true,
                      .src_gap = gap,
                      .ready = true};
            uint64_t puts, pieces;
            run_xfer(&w, &c, &x, &puts, &pieces);
            fprintf(stderr,
                    "  gap %u, %s source: %llu pieces, %llu puts, %llu of %llu bytes staged\n", gap,
                    sliced ? "sliced" : "head-major", (unsigned long long)pieces,
                    (unsigned long long)puts, (unsigned long long)last_staged,
                    (unsigned long long)last_bytes);
            if (!sliced)
                TH_CHECK(last_staged == last_bytes); /* every piece strided in the source */
            else if (gap == 0)
                aligned_puts = puts;
            else if (gap == 1)
                TH_CHECK(last_staged == last_bytes); /* isolated blocks: gathered as before */
            else /* chunks of 4 blocks over runs of 3: blocks 1-3 | 5, 6-7 | 9-10, 11 | 13-15:
                  * only chunk 2's isolated first block is gathered, with the next one */
                TH_CHECKF(last_staged * 6 == last_bytes && puts == 2 * aligned_puts,
                          "runs of %u blocks: %llu bytes staged, %llu puts (%llu without gaps)",
                          gap, (unsigned long long)last_staged, (unsigned long long)puts,
                          (unsigned long long)aligned_puts);
            world_fini(&w);
        }
    }
}

/* kvx_layout_slice cuts, the validation of sliced layouts, and kvx_layout_off: every
 * element of a sliced region has its own offset inside the region, and a slice's run of
 * consecutive blocks is contiguous. Decode regions are never sliced. */
static void test_slice_layout(void)
{
    kvx_layout l = {.n_layers = 2,
                    .n_kv_heads = 6,
                    .head0 = 1,
                    .n_heads = 4,
                    .block_size = 4,
                    .head_dim = 2,
                    .dtype_size = 2,
                    .n_blocks = 5};
    uint32_t r1[] = {0, 2, 2, 4, 4, 6}; /* held 1..4: cuts at 2 and 4 */
    TH_REQUIRE(kvx_layout_slice(&l, r1, 3) == 0);
    TH_CHECK(l.n_slices == 3 && l.slice_heads[0] == 1 && l.slice_heads[1] == 2 &&
             l.slice_heads[2] == 1);
    uint32_t r2[] = {0, 6}; /* one range over everything: no cut */
    TH_REQUIRE(kvx_layout_slice(&l, r2, 1) == 0);
    TH_CHECK(l.n_slices == 1 && l.slice_heads[0] == 0);
    uint32_t r3[] = {0, 3, 2, 5}; /* overlapping ranges: cuts at 2, 3 (and 5 is the end) */
    TH_REQUIRE(kvx_layout_slice(&l, r3, 2) == 0);
    TH_CHECK(l.n_slices == 3 && l.slice_heads[0] == 1 && l.slice_heads[1] == 1 &&
             l.slice_heads[2] == 2);
    uint32_t bad[] = {3, 3};
    kvx_layout keep = l;
    TH_CHECK(kvx_layout_slice(&l, bad, 1) == TD_EINVAL && !memcmp(&l, &keep, sizeof(l)));
    TH_CHECK(kvx_layout_slice(&l, r1, 0) == TD_EINVAL);
    /* offsets: a permutation of the region's elements, slices contiguous across blocks */
    size_t bytes = kvx_layout_bytes(&l), n = 0, tokb = 4;
    TH_REQUIRE(bytes == 2 * 2 * 5 * 4 * 4 * tokb);
    uint8_t *seen = calloc(bytes, 1);
    for (uint32_t ll = 0; ll < 2; ll++)
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t b = 0; b < 5; b++)
                for (uint32_t h = 0; h < 4; h++)
                    for (uint32_t t = 0; t < 4; t++) {
                        size_t o = kvx_layout_off(&l, ll, kv, b, h, t);
                        if (o + tokb <= bytes && !seen[o]) n++;
                        if (o < bytes) seen[o] = 1;
                    }
    free(seen);
    TH_CHECK(n == bytes / tokb);
    size_t hb = 4 * tokb; /* slice 2 (heads 2, 3): block b+1 follows block b */
    TH_CHECK(kvx_layout_off(&l, 1, 1, 3, 2, 0) + 2 * hb == kvx_layout_off(&l, 1, 1, 4, 2, 0));
    TH_CHECK(kvx_layout_off(&l, 0, 0, 0, 3, 0) == kvx_layout_off(&l, 0, 0, 0, 2, 0) + hb);
    /* invalid slices */
    kvx_layout v = l;
    v.slice_heads[2] = 1; /* sums to 3 of 4 */
    TH_CHECK(kvx_layout_bytes(&v) == 0);
    v = l;
    v.n_slices = KVX_MAX_SLICES + 1;
    TH_CHECK(kvx_layout_bytes(&v) == 0);
    v = l;
    v.slice_heads[1] = 0;
    v.slice_heads[2] = 3;
    TH_CHECK(kvx_layout_bytes(&v) == 0);
    /* too many slices */
    kvx_layout m = {.n_layers = 1,
                    .n_kv_heads = 40,
                    .n_heads = 40,
                    .block_size = 4,
                    .head_dim = 2,
                    .dtype_size = 2,
                    .n_blocks = 2};
    uint32_t many[2 * 20];
    for (uint32_t i = 0; i < 20; i++) {
        many[2 * i] = 2 * i;
        many[2 * i + 1] = 2 * i + 2;
    }
    TH_CHECK(kvx_layout_slice(&m, many, 20) == TD_ERANGE && m.n_slices == 0);
    /* a decode region is never sliced */
    kvx_fake_fabric *fab;
    kvx_pipe *p;
    kvx_conn *c;
    TH_REQUIRE(kvx_fake_fabric_create(&fab) == 0 && kvx_pipe_fake_create(fab, NULL, &p) == 0 &&
               kvx_conn_create(p, NULL, &c) == 0);
    uint8_t *reg = calloc(1, bytes);
    TH_CHECK(kvx_dec_register(c, reg, bytes, &l) == TD_EINVAL);
    kvx_conn_destroy(c);
    kvx_fake_fabric_destroy(fab);
    free(reg);
}

static kvx_req_state dec_state(world *w, int d, uint64_t req, kvx_dec_status *ds)
{
    kvx_dec_status tmp;
    if (!ds) ds = &tmp;
    return kvx_dec_poll(w->dec[d], req, ds) == 0 ? ds->state : (kvx_req_state)-1;
}

static kvx_req_state pf_state(world *w, int i, uint64_t req, kvx_pf_status *ps)
{
    kvx_pf_status tmp;
    if (!ps) ps = &tmp;
    return kvx_pf_poll(w->src[i], req, ps) == 0 ? ps->state : (kvx_req_state)-1;
}

/* The decode side aborts after half the chunks: the stage stops, and only then the
 * blocks are released (FAILED); the sender reports the peer's abort. */
static void test_dec_abort(void)
{
    wcfg c = base_cfg(1, 2);
    world w;
    world_init(&w, &c);
    xstate *s = calloc(1, sizeof(*s));
    xfer x = {.req = 7, .n_tokens = 160, .chunk = 16, .salt = 3, .dst_run = 2};
    xfer_setup(&w, &c, &x, s);
    int64_t end = td_now_ms() + 2000;
    while (pf_state(&w, 0, 7, NULL) != KVX_REQ_READY && td_now_ms() < end)
        progress_all(&w, 1);
    xfer_chunks(&w, &x, s, 0, 5);
    TH_CHECK(kvx_dec_abort(w.dec[0], 7) == 0);
    TH_CHECK(dec_state(&w, 0, 7, NULL) == KVX_REQ_ABORTING); /* a writer may still write */
    TH_CHECK(kvx_dec_release(w.dec[0], 7) == TD_ESTATE);
    TH_CHECK(pump_final(&w, 7, 3000));
    kvx_dec_status ds;
    TH_CHECK(dec_state(&w, 0, 7, &ds) == KVX_REQ_FAILED && ds.reason == KVX_FAIL_ABORTED);
    TH_CHECK(dec_state(&w, 1, 7, &ds) == KVX_REQ_FAILED && ds.reason == KVX_FAIL_PEER_ABORTED);
    kvx_pf_status ps;
    TH_CHECK(pf_state(&w, 0, 7, &ps) == KVX_REQ_FAILED && ps.reason == KVX_FAIL_PEER_ABORTED);
    TH_CHECK(kvx_pf_send_chunk(w.src[0], 7, 9, 144, 160, s->sblk[0], s->nb) < 0);
    release_all(&w, 7);
    /* the same connectors serve the next request */
    uint64_t puts, pieces;
    x.req = 8;
    run_xfer(&w, &c, &x, &puts, &pieces);
    world_fini(&w);
    free(s);
}

/* The prefill side aborts: decode ranks fail with the peer's abort. */
static void test_pf_abort(void)
{
    wcfg c = base_cfg(2, 1);
    world w;
    world_init(&w, &c);
    xstate *s = calloc(1, sizeof(*s));
    xfer x = {.req = 11, .n_tokens = 64, .chunk = 16, .salt = 3, .dst_run = 2};
    xfer_setup(&w, &c, &x, s);
    xfer_chunks(&w, &x, s, 0, 2);
    TH_CHECK(kvx_pf_abort(w.src[1], 11) == 0);
    TH_CHECK(pump_final(&w, 11, 3000));
    kvx_dec_status ds;
    TH_CHECK(dec_state(&w, 0, 11, &ds) == KVX_REQ_FAILED && ds.reason == KVX_FAIL_PEER_ABORTED);
    TH_CHECK(pf_state(&w, 1, 11, NULL) == KVX_REQ_FAILED);
    TH_CHECK(pf_state(&w, 0, 11, NULL) == KVX_REQ_FAILED);
    release_all(&w, 11);
    world_fini(&w);
    free(s);
}

/* No receiver ever registers a target: the sender times out and frees its queue. */
static void test_no_target_timeout(void)
{
    wcfg c = base_cfg(1, 1);
    c.timeout_ms = 300;
    world w;
    world_init(&w, &c);
    xstate *s = calloc(1, sizeof(*s));
    xfer x = {.req = 12, .n_tokens = 64, .chunk = 16, .salt = 3, .late = true};
    xfer_setup(&w, &c, &x, s);
    xfer_chunks(&w, &x, s, 0, 4);
    kvx_dec_abort(w.dec[0], 12); /* the decode side's record is not part of this test */
    int64_t t0 = td_now_ms();
    kvx_pf_status ps;
    while (pf_state(&w, 0, 12, &ps) != KVX_REQ_FAILED && td_now_ms() - t0 < 3000)
        progress_all(&w, 5);
    int64_t dt = td_now_ms() - t0;
    TH_CHECKF(ps.state == KVX_REQ_FAILED && ps.reason == KVX_FAIL_TIMEOUT && dt < 1500,
              "state %s after %lld ms", kvx_req_state_name(ps.state), (long long)dt);
    release_all(&w, 12);
    world_fini(&w);
    free(s);
}

/* A target that no stage ever writes: the decode side times out. */
static void test_dec_timeout(void)
{
    wcfg c = base_cfg(1, 1);
    c.timeout_ms = 200;
    world w;
    world_init(&w, &c);
    int32_t blocks[4] = {1, 2, 3, 4};
    kvx_dec_req_params dp = {.n_stages = 1, .tp = 1, .blocks = blocks, .n_blocks = 4};
    uint8_t buf[4096];
    size_t len;
    TH_CHECK(kvx_dec_make_target(w.dec[0], 13, &dp, buf, sizeof(buf), &len) == 0);
    TH_CHECK(kvx_dec_make_target(w.dec[0], 13, &dp, buf, sizeof(buf), &len) == TD_ESTATE);
    TH_CHECK(kvx_dec_make_target(w.dec[0], 14, &dp, buf, 10, &len) == TD_ERANGE);
    int64_t t0 = td_now_ms();
    while (dec_state(&w, 0, 13, NULL) != KVX_REQ_FAILED && td_now_ms() - t0 < 3000)
        progress_all(&w, 50);
    kvx_dec_status ds;
    TH_CHECK(dec_state(&w, 0, 13, &ds) == KVX_REQ_FAILED && ds.reason == KVX_FAIL_TIMEOUT);
    TH_CHECK(td_now_ms() - t0 < 1500);
    release_all(&w, 13);
    world_fini(&w);
}

/* A prefill stage dies mid-transfer: the decode rank fails the request at once, frees
 * everything, and serves a request from another stage afterwards; then a decode rank
 * dies and the sender fails. */
static void test_peer_killed(void)
{
    wcfg c = base_cfg(1, 1);
    c.pp = 2;
    c.layer_split[1] = 1;
    c.layer_split[2] = 3;
    c.timeout_ms = 20000;
    world w;
    world_init(&w, &c);
    xstate *s = calloc(1, sizeof(*s));
    xfer x = {.req = 20, .n_tokens = 96, .chunk = 16, .salt = 3, .dst_run = 2};
    xfer_setup(&w, &c, &x, s);
    int64_t end = td_now_ms() + 2000;
    while (pf_state(&w, 1, 20, NULL) != KVX_REQ_READY && td_now_ms() < end)
        progress_all(&w, 1);
    xfer_chunks(&w, &x, s, 0, 3);
    kvx_pipe_fake_kill(w.src_pipe[1]);
    int64_t t0 = td_now_ms();
    kvx_dec_status ds;
    while (dec_state(&w, 0, 20, &ds) != KVX_REQ_FAILED && td_now_ms() - t0 < 5000)
        progress_all(&w, 5);
    TH_CHECKF(ds.state == KVX_REQ_FAILED && ds.reason == KVX_FAIL_PEER_FAILED, "state %s reason %d",
              kvx_req_state_name(ds.state), ds.reason);
    TH_CHECK(td_now_ms() - t0 < 1000);
    /* the surviving stage got the abort */
    while (pf_state(&w, 0, 20, NULL) != KVX_REQ_FAILED && td_now_ms() - t0 < 5000)
        progress_all(&w, 5);
    TH_CHECK(pf_state(&w, 0, 20, NULL) == KVX_REQ_FAILED);
    kvx_dec_release(w.dec[0], 20);
    kvx_pf_release(w.src[0], 20);
    /* the dead stage's connector is gone: replace it by a fresh one */
    kvx_conn_destroy(w.src[1]);
    kvx_conn_params cp = {.timeout_ms = 5000, .abort_timeout_ms = 500};
    TH_REQUIRE(kvx_pipe_fake_create(w.fab, NULL, &w.src_pipe[1]) == 0);
    TH_REQUIRE(kvx_conn_create(w.src_pipe[1], &cp, &w.src[1]) == 0);
    TH_REQUIRE(kvx_pf_register_source(w.src[1], w.sreg[1], kvx_layout_bytes(&w.sl[1]), &w.sl[1]) ==
               0);
    for (int k = 0; k < 5; k++)
        progress_all(&w, 0);
    kvx_conn_stats st;
    kvx_conn_stats_get(w.dec[0], &st);
    TH_CHECKF(st.peers == 1, "decode keeps %d endpoints (the dead one must be gone)", st.peers);
    uint64_t puts, pieces;
    x.req = 21;
    run_xfer(&w, &c, &x, &puts, &pieces);

    /* now the decode rank dies during a transfer */
    x.req = 22;
    xfer_setup(&w, &c, &x, s);
    xfer_chunks(&w, &x, s, 0, 2);
    kvx_pipe_fake_kill(w.dec_pipe[0]);
    t0 = td_now_ms();
    kvx_pf_status ps;
    while (pf_state(&w, 0, 22, &ps) != KVX_REQ_FAILED && td_now_ms() - t0 < 5000)
        progress_all(&w, 5);
    TH_CHECK(ps.state == KVX_REQ_FAILED && ps.reason == KVX_FAIL_PEER_FAILED);
    TH_CHECK(td_now_ms() - t0 < 2000);
    while (pf_state(&w, 1, 22, NULL) != KVX_REQ_FAILED && td_now_ms() - t0 < 5000)
        progress_all(&w, 5);
    kvx_pf_release(w.src[0], 22);
    kvx_pf_release(w.src[1], 22);
    kvx_dec_abort(w.dec[0], 22);
    for (int k = 0; k < 5; k++)
        progress_all(&w, 0);
    kvx_dec_release(w.dec[0], 22);
    for (int i = 0; i < w.n_src; i++) {
        kvx_conn_stats_get(w.src[i], &st);
        TH_CHECK(st.pf_requests == 0 && st.peers == 0 && st.pipe.rkeys == 0);
    }
    /* the dead decode connector: drop it from the leak check */
    kvx_conn_destroy(w.dec[0]);
    TH_REQUIRE(kvx_pipe_fake_create(w.fab, NULL, &w.dec_pipe[0]) == 0);
    TH_REQUIRE(kvx_conn_create(w.dec_pipe[0], &cp, &w.dec[0]) == 0);
    TH_REQUIRE(kvx_dec_register(w.dec[0], w.dreg[0], kvx_layout_bytes(&w.dl[0]), &w.dl[0]) == 0);
    world_fini(&w);
    free(s);
}

/* Malformed or mismatched targets are errors, never crashes, and fail nothing else. */
static void test_bad_targets(void)
{
    wcfg c = base_cfg(1, 1);
    world w;
    world_init(&w, &c);
    int32_t blocks[4] = {1, 2, 3, 4};
    kvx_dec_req_params dp = {.n_stages = 1, .tp = 1, .blocks = blocks, .n_blocks = 4};
    uint8_t buf[4096], bad[4096];
    size_t len;
    TH_REQUIRE(kvx_dec_make_target(w.dec[0], 30, &dp, buf, sizeof(buf), &len) == 0);
    int32_t oob[1] = {48};
    kvx_dec_req_params dq = dp;
    dq.blocks = oob;
    dq.n_blocks = 1;
    TH_CHECK(kvx_dec_make_target(w.dec[0], 31, &dq, bad, sizeof(bad), &len) == TD_EINVAL);
    kvx_pf_req_params pp = {.stage = 0};
    TH_REQUIRE(kvx_pf_open(w.src[0], 30, &pp) == 0);
    td_log_set_level(TD_LOG_ERROR + 1); /* thousands of expected errors */
    int accepted = 0;
    for (size_t i = 0; i < len; i++) /* every truncation */
        accepted += kvx_pf_add_target(w.src[0], 30, buf, i) == 0;
    for (size_t i = 0; i < len; i++) /* every single-byte corruption */
        for (int bit = 0; bit < 8; bit += 3) {
            memcpy(bad, buf, len);
            bad[i] ^= (uint8_t)(1u << bit);
            accepted += kvx_pf_add_target(w.src[0], 30, bad, len) == 0;
        }
    uint32_t seed = 1;
    for (int k = 0; k < 2000; k++) { /* garbage */
        size_t n = (size_t)(seed % sizeof(bad));
        for (size_t i = 0; i < n; i++) {
            seed = seed * 1103515245u + 12345u;
            bad[i] = (uint8_t)(seed >> 16);
        }
        accepted += kvx_pf_add_target(w.src[0], 30, bad, n) == 0;
    }
    td_log_set_level(TD_LOG_INFO);
    TH_CHECK(accepted == 0);
    TH_CHECK(kvx_pf_add_target(w.src[0], 99, buf, len) == TD_ENOENT);
    TH_CHECK(kvx_pf_add_target(w.src[0], 30, buf, len) == 0);
    TH_CHECK(kvx_pf_add_target(w.src[0], 30, buf, len) == TD_ESTATE); /* no longer OPEN */
    /* bad chunks */
    int32_t sb[4] = {0, 1, 2, 3};
    TH_CHECK(kvx_pf_send_chunk(w.src[0], 30, 0, 10, 10, sb, 4) == TD_EINVAL);
    TH_CHECK(kvx_pf_send_chunk(w.src[0], 30, 0, 0, 65, sb, 4) == TD_EINVAL);
    int32_t sbad[4] = {0, 1, -2, 3};
    TH_CHECK(kvx_pf_send_chunk(w.src[0], 30, 0, 0, 64, sbad, 4) == TD_EINVAL);
    /* a target of another geometry */
    kvx_pf_abort(w.src[0], 30);
    kvx_dec_abort(w.dec[0], 30);
    TH_CHECK(pump_final(&w, 30, 2000));
    release_all(&w, 30);
    world_fini(&w);
}

/* Issue 44: a writer whose target differs from the real one only in the request's key (what
 * a process that reaches the decode side's transport but was never given the target would
 * have to guess: 128 random bits) is not accepted: its BEGIN is dropped, it puts nothing,
 * and the decode request waits as if nobody had written; the connectors then serve the
 * next request. */
static void test_unkeyed_begin(void)
{
    wcfg c = base_cfg(1, 1);
    world w;
    world_init(&w, &c);
    xstate *s = calloc(1, sizeof(*s));
    xfer x = {.req = 40, .n_tokens = 64, .chunk = 16, .salt = 5, .dst_run = 2, .late = true};
    xfer_setup(&w, &c, &x, s);
    const void *pl;
    size_t pn, fn;
    TH_REQUIRE(kvx_frame_read(s->tgt[0], s->tgt_len[0], KVX_MAGIC_TARGET, KVX_KIND_UCX, &pl, &pn) ==
               0);
    static uint8_t body[8192], forged[8192];
    memcpy(body, pl, pn);
    body[16 + 5] ^= 0x10; /* the key follows the request id and the epoch */
    TH_REQUIRE(
        kvx_frame_write(forged, sizeof(forged), KVX_MAGIC_TARGET, KVX_KIND_UCX, body, pn, &fn));
    TH_CHECK(kvx_pf_add_target(w.src[0], x.req, forged, fn) == 0); /* it cannot tell */
    xfer_chunks(&w, &x, s, 0, 4);
    int64_t end = td_now_ms() + 500;
    while (td_now_ms() < end)
        progress_all(&w, 2);
    kvx_dec_status ds;
    TH_CHECK(dec_state(&w, 0, x.req, &ds) == KVX_REQ_WAITING && ds.stages_begun == 0);
    TH_CHECK(pf_state(&w, 0, x.req, NULL) != KVX_REQ_READY);
    size_t zero = 0, n = kvx_layout_bytes(&w.dl[0]);
    for (size_t i = 0; i < n; i++)
        zero += w.dreg[0][i] == 0;
    TH_CHECKF(zero == n, "a writer without the key wrote %zu bytes", n - zero);
    kvx_pf_abort(w.src[0], x.req);
    kvx_dec_abort(w.dec[0], x.req);
    TH_CHECK(pump_final(&w, x.req, 3000));
    release_all(&w, x.req);
    uint64_t puts, pieces;
    x = (xfer){.req = 41, .n_tokens = 64, .chunk = 16, .salt = 5, .dst_run = 2};
    run_xfer(&w, &c, &x, &puts, &pieces);
    world_fini(&w);
    free(s);
}

/* A lookup budget smaller than the chunks: send_chunk says TD_ENOSPC, nothing leaks. */
static void test_lookup_full(void)
{
    wcfg c = base_cfg(1, 1);
    c.lookup_budget = 3 * 2 * 4 * 16 * 8 * 2 + 100; /* one 16-token chunk fits */
    world w;
    world_init(&w, &c);
    xstate *s = calloc(1, sizeof(*s));
    xfer x = {.req = 40, .n_tokens = 64, .chunk = 16, .salt = 3, .late = true};
    xfer_setup(&w, &c, &x, s);
    TH_CHECK(kvx_pf_send_chunk(w.src[0], 40, 0, 0, 16, s->sblk[0], s->nb) == 0);
    TH_CHECK(kvx_pf_send_chunk(w.src[0], 40, 1, 16, 32, s->sblk[0], s->nb) == TD_ENOSPC);
    kvx_pf_abort(w.src[0], 40);
    kvx_dec_abort(w.dec[0], 40);
    TH_CHECK(pump_final(&w, 40, 2000));
    release_all(&w, 40);
    world_fini(&w);
    free(s);
}

static double cpu_seconds(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec +
           (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

/* The decode side runs its own progress thread; an idle connector sleeps. */
/* Times of chunk k of a request on source i; asserts it exists. */
static kvx_chunk_times chunk_times(world *w, int i, uint64_t req, uint32_t k)
{
    kvx_chunk_times ct = {0};
    TH_CHECKF(kvx_pf_chunk_times(w->src[i], req, k, &ct) == 0, "source %d chunk %u: no times", i,
              k);
    return ct;
}

/* Progress until chunk k of every source landed (or ms passed). */
static bool pump_landed(world *w, uint64_t req, uint32_t k, int ms)
{
    int64_t end = td_now_ms() + ms;
    for (;;) {
        bool all = true;
        for (int i = 0; i < w->n_src; i++) {
            kvx_chunk_times ct = {0};
            all = all && kvx_pf_chunk_times(w->src[i], req, k, &ct) == 0 && ct.landed_ns;
        }
        if (all) return true;
        if (td_now_ms() > end) return false;
        progress_all(w, 1);
    }
}

/* Per-chunk flushes, direct path: each chunk lands on its own before the next one is sent
 * and before finish (its tokens are in every decode rank's blocks, the next chunk's are
 * not); handed <= issued <= landed; staging buffers are back in the pool once a chunk
 * landed; bad chunk numbers are refused. */
static void test_chunk_times(void)
{
    wcfg c = base_cfg(1, 2); /* 4 source heads -> 2 + 2: strided slices, staged puts */
    world w;
    world_init(&w, &c);
    xstate *s = calloc(1, sizeof(*s));
    xfer x = {.req = 60, .n_tokens = 100, .chunk = 32, .salt = 17, .dst_run = 4};
    xfer_setup(&w, &c, &x, s);
    int64_t end = td_now_ms() + 2000;
    while (pf_state(&w, 0, 60, NULL) != KVX_REQ_READY && td_now_ms() < end)
        progress_all(&w, 1);
    TH_REQUIRE(pf_state(&w, 0, 60, NULL) == KVX_REQ_READY);
    kvx_chunk_times ct;
    TH_CHECK(kvx_pf_chunk_times(w.src[0], 60, 0, &ct) == TD_ENOENT); /* not sent yet */
    TH_CHECK(kvx_pf_chunk_times(w.src[0], 61, 0, &ct) == TD_ENOENT); /* no such request */
    uint32_t nch = (x.n_tokens + x.chunk - 1) / x.chunk;
    for (uint32_t k = 0; k < nch; k++) {
        uint64_t before = (uint64_t)td_now_ns();
        xfer_chunks(&w, &x, s, k, k + 1);
        ct = chunk_times(&w, 0, 60, k);
        TH_CHECKF(ct.handed_ns >= before && ct.issued_ns >= ct.handed_ns,
                  "chunk %u: handed %llu issued %llu (before %llu)", k,
                  (unsigned long long)ct.handed_ns, (unsigned long long)ct.issued_ns,
                  (unsigned long long)before);
        TH_CHECKF(ct.landed_ns == 0, "chunk %u landed inside send_chunk", k); /* needs progress */
        TH_CHECK(pump_landed(&w, 60, k, 2000));
        ct = chunk_times(&w, 0, 60, k);
        TH_CHECK(ct.landed_ns >= ct.issued_ns);
        uint32_t t1 = (k + 1) * x.chunk < x.n_tokens ? (k + 1) * x.chunk : x.n_tokens;
        for (int d = 0; d < w.n_dec; d++) {
            TH_CHECKF(sc_verify(w.dreg[d], &w.dl[d], s->dblk[d], s->nb, t1, 0, c.n_layers, x.salt,
                                0) == 0,
                      "rank %d: chunk %u landed but tokens < %u are not all there", d, k, t1);
            if (k + 1 < nch)
                TH_CHECK(sc_verify(w.dreg[d], &w.dl[d], s->dblk[d], s->nb, t1 + 1, 0, c.n_layers,
                                   x.salt, 0) > 0); /* the next chunk's are not */
        }
        kvx_conn_stats st;
        kvx_conn_stats_get(w.src[0], &st);
        TH_CHECKF(st.held_bytes == 0 && st.pooled_bytes > 0,
                  "chunk %u landed: %zu bytes still held, %zu pooled", k, st.held_bytes,
                  st.pooled_bytes);
    }
    TH_CHECK(kvx_pf_send_chunk(w.src[0], 60, 1, 32, 64, s->sblk[0], s->nb) == TD_ESTATE);
    TH_CHECK(kvx_pf_send_chunk(w.src[0], 60, KVX_MAX_CHUNKS, 32, 64, s->sblk[0], s->nb) ==
             TD_EINVAL);
    xfer_finish(&w, &c, &x, s);
    TH_CHECK(pump_final(&w, 60, 5000));
    TH_CHECK(pf_state(&w, 0, 60, NULL) == KVX_REQ_DONE &&
             dec_state(&w, 1, 60, NULL) == KVX_REQ_DONE);
    ct = chunk_times(&w, 0, 60, nch - 1); /* still there until release */
    TH_CHECK(ct.landed_ns > 0);
    release_all(&w, 60);
    TH_CHECK(kvx_pf_chunk_times(w.src[0], 60, 0, &ct) == TD_ENOENT);
    world_fini(&w);
    free(s);
}

/* Chunks queued before the targets (out of order, two TP source ranks): nothing is issued
 * until the targets arrived; then issued >= their arrival and landed >= issued for every
 * chunk, the copies are freed as their chunks land (before finish). */
static void test_chunk_times_late(void)
{
    wcfg c = base_cfg(2, 2);
    world w;
    world_init(&w, &c);
    xstate *s = calloc(1, sizeof(*s));
    xfer x = {
        .req = 62, .n_tokens = 90, .chunk = 16, .order = 1, .late = true, .salt = 5, .dst_run = 2};
    xfer_setup(&w, &c, &x, s);
    xfer_chunks(&w, &x, s, 0, 1000);
    for (int k = 0; k < 5; k++)
        progress_all(&w, 1);
    uint32_t nch = (x.n_tokens + x.chunk - 1) / x.chunk;
    for (int i = 0; i < w.n_src; i++)
        for (uint32_t k = 0; k < nch; k++) {
            kvx_chunk_times ct = chunk_times(&w, i, 62, k);
            TH_CHECK(ct.handed_ns > 0 && ct.issued_ns == 0 && ct.landed_ns == 0);
        }
    uint64_t t_target = (uint64_t)td_now_ns();
    for (int i = 0; i < w.n_src; i++)
        for (int d = 0; d < w.n_dec; d++)
            TH_CHECK(kvx_pf_add_target(w.src[i], 62, s->tgt[d], s->tgt_len[d]) == 0);
    for (uint32_t k = 0; k < nch; k++)
        TH_CHECK(pump_landed(&w, 62, k, 2000));
    for (int i = 0; i < w.n_src; i++) {
        for (uint32_t k = 0; k < nch; k++) {
            kvx_chunk_times ct = chunk_times(&w, i, 62, k);
            TH_CHECKF(ct.handed_ns < t_target && ct.issued_ns >= t_target &&
                          ct.landed_ns >= ct.issued_ns,
                      "source %d chunk %u: handed %llu issued %llu landed %llu (targets %llu)", i,
                      k, (unsigned long long)ct.handed_ns, (unsigned long long)ct.issued_ns,
                      (unsigned long long)ct.landed_ns, (unsigned long long)t_target);
        }
        kvx_conn_stats st;
        kvx_conn_stats_get(w.src[i], &st);
        TH_CHECKF(st.held_bytes == 0 && st.queued_chunks == 0,
                  "source %d: every chunk landed, %zu bytes still held", i, st.held_bytes);
        TH_CHECK(pf_state(&w, i, 62, NULL) == KVX_REQ_READY);
    }
    for (int d = 0; d < w.n_dec; d++) /* all there before any finish */
        TH_CHECK(sc_verify(w.dreg[d], &w.dl[d], s->dblk[d], s->nb, x.n_tokens, 0, c.n_layers,
                           x.salt, 1) == 0);
    x.late = false;
    xfer_finish(&w, &c, &x, s);
    TH_CHECK(pump_final(&w, 62, 5000));
    TH_CHECK(dec_state(&w, 0, 62, NULL) == KVX_REQ_DONE);
    release_all(&w, 62);
    world_fini(&w);
    free(s);
}

/* A put fails in the middle of a request: the chunk's flush reports it, the request fails
 * at once (before any finish), that chunk never lands, the earlier ones did; nothing
 * leaks, the next request goes through. */
static void test_chunk_put_fails(void)
{
    wcfg c = base_cfg(1, 1);
    world w;
    world_init(&w, &c);
    xstate *s = calloc(1, sizeof(*s));
    xfer x = {.req = 64, .n_tokens = 128, .chunk = 32, .salt = 2, .dst_run = 0};
    xfer_setup(&w, &c, &x, s);
    int64_t end = td_now_ms() + 2000;
    while (pf_state(&w, 0, 64, NULL) != KVX_REQ_READY && td_now_ms() < end)
        progress_all(&w, 1);
    xfer_chunks(&w, &x, s, 0, 2);
    TH_CHECK(pump_landed(&w, 64, 1, 2000));
    kvx_pipe_fake_fail_puts_after(w.src_pipe[0], 0);
    td_log_set_level(TD_LOG_ERROR + 1);
    xfer_chunks(&w, &x, s, 2, 3);
    kvx_pf_status ps;
    end = td_now_ms() + 3000;
    while (pf_state(&w, 0, 64, &ps) != KVX_REQ_FAILED && td_now_ms() < end)
        progress_all(&w, 1);
    TH_CHECKF(ps.state == KVX_REQ_FAILED && ps.reason == KVX_FAIL_PEER_FAILED, "%s reason %d",
              kvx_req_state_name(ps.state), ps.reason);
    TH_CHECK(chunk_times(&w, 0, 64, 0).landed_ns > 0 && chunk_times(&w, 0, 64, 1).landed_ns > 0);
    kvx_chunk_times ct = chunk_times(&w, 0, 64, 2);
    TH_CHECK(ct.issued_ns > 0 && ct.landed_ns == 0);
    TH_CHECK(kvx_pf_send_chunk(w.src[0], 64, 3, 96, 128, s->sblk[0], s->nb) < 0);
    kvx_dec_abort(w.dec[0], 64); /* the decode side only learns it by its own means */
    TH_CHECK(pump_final(&w, 64, 3000));
    td_log_set_level(TD_LOG_INFO);
    release_all(&w, 64);
    kvx_pipe_fake_fail_puts_after(w.src_pipe[0], -1);
    for (int k = 0; k < 5; k++)
        progress_all(&w, 1);
    uint64_t puts, pieces;
    x.req = 65;
    run_xfer(&w, &c, &x, &puts, &pieces);
    world_fini(&w);
    free(s);
}

static void test_progress_thread(void)
{
    wcfg c = base_cfg(1, 2);
    c.progress_thread = true;
    world w;
    world_init(&w, &c);
    uint64_t puts, pieces;
    xfer x = {.req = 50, .n_tokens = 100, .chunk = 33, .salt = 8, .dst_run = 5};
    run_xfer(&w, &c, &x, &puts, &pieces);
    double c0 = cpu_seconds();
    int64_t t0 = td_now_ms();
    while (td_now_ms() - t0 < 300)
        kvx_conn_progress(w.src[0], 100);
    double used = cpu_seconds() - c0;
    TH_CHECKF(used < 0.1, "idle connectors used %.3f s of CPU in 0.3 s", used);
    world_fini(&w);
}

/* Soak: back-to-back requests on one set of connectors, each finishing normally, aborted by
 * either side mid-way, or with a late target; every finished one is byte-exact and nothing
 * leaks. Duration: KVX_SOAK_SECONDS (default 1). */
/* kvx_conn_params.spin_us: right after progress that did something (a BEGIN handled),
 * kvx_conn_progress returns at once for spin_us (the caller's loop polls) instead of
 * sleeping its timeout; with spin_us < 0 an idle call sleeps at once. */
static void test_spin_window(void)
{
    for (int spin = 0; spin < 2; spin++) {
        wcfg c = base_cfg(1, 1);
        c.spin_us = spin ? 5000000 : -1;
        world w;
        world_init(&w, &c);
        xfer x = {.req = 90, .n_tokens = 32, .chunk = 32, .salt = 3, .dst_run = 2};
        xstate *s = calloc(1, sizeof(*s));
        xfer_setup(&w, &c, &x, s);
        int n = 0;
        int64_t end = td_now_ms() + 2000;
        while (n == 0 && td_now_ms() < end) {
            kvx_conn_progress(w.src[0], 0); /* sends BEGIN */
            n = kvx_conn_progress(w.dec[0], 0);
        }
        TH_REQUIRE(n > 0);
        int64_t t0 = td_now_ms();
        for (int k = 0; k < 3; k++)
            kvx_conn_progress(w.dec[0], 200); /* nothing new for it */
        int64_t took = td_now_ms() - t0;
        if (spin)
            TH_CHECKF(took < 150, "3 calls took %lld ms inside the spin window", (long long)took);
        else
            TH_CHECKF(took >= 150, "3 idle calls took %lld ms without spinning", (long long)took);
        kvx_dec_abort(w.dec[0], x.req);
        kvx_pf_abort(w.src[0], x.req);
        TH_CHECK(pump_final(&w, x.req, 5000));
        release_all(&w, x.req);
        free(s);
        world_fini(&w);
    }
}

static void test_soak(void)
{
    const char *env = getenv("KVX_SOAK_SECONDS");
    double secs = env ? atof(env) : 1.0;
    wcfg c = base_cfg(2, 2);
    c.n_layers = 4;
    c.pp = 2;
    c.layer_split[1] = 1;
    c.layer_split[2] = 4;
    world w;
    world_init(&w, &c);
    xstate *s = calloc(1, sizeof(*s));
    uint32_t seed = 12345;
    int done = 0, aborted = 0;
    int64_t end = td_now_ms() + (int64_t)(secs * 1000);
    td_log_set_level(TD_LOG_ERROR + 1); /* aborts log errors by design */
    for (uint64_t req = 1000; td_now_ms() < end; req++) {
        seed = seed * 1103515245u + 12345u;
        int action = (int)(seed >> 16) % 4;
        xfer x = {.req = req,
                  .n_tokens = 20 + (seed >> 8) % 200,
                  .chunk = 7 + (seed >> 4) % 40,
                  .order = (int)(seed >> 20) % 3,
                  .late = action == 3,
                  .salt = (uint32_t)req,
                  .dst_run = 1 + (seed >> 12) % 6};
        xfer_setup(&w, &c, &x, s);
        uint32_t nch = (x.n_tokens + x.chunk - 1) / x.chunk;
        xfer_chunks(&w, &x, s, 0, action == 1 || action == 2 ? nch / 2 : 1000);
        for (int k = 0; k < 3; k++)
            progress_all(&w, 0);
        if (action == 1) kvx_dec_abort(w.dec[(int)(req % 2)], req);
        if (action == 2) kvx_pf_abort(w.src[(int)(req % 4)], req);
        if (action == 1 || action == 2) {
            TH_CHECK(pump_final(&w, req, 5000));
            aborted++;
        } else {
            xfer_finish(&w, &c, &x, s);
            TH_CHECK(pump_final(&w, req, 5000));
            for (int d = 0; d < w.n_dec; d++) {
                TH_CHECK(dec_state(&w, d, req, NULL) == KVX_REQ_DONE);
                TH_CHECK(sc_verify(w.dreg[d], &w.dl[d], s->dblk[d], s->nb, x.n_tokens, 0,
                                   c.n_layers, x.salt, 1) == 0);
            }
            done++;
        }
        release_all(&w, req);
    }
    td_log_set_level(TD_LOG_INFO);
    fprintf(stderr, "  soak: %d transfers, %d aborted\n", done, aborted);
    TH_CHECK(done > 0 && aborted > 0);
    world_fini(&w);
    free(s);
}

/* The latent layout (kvx_layout.kv_arrays 1: kvmem's KN_KV_LAYOUT_LATENT, deepseek2's pool):
 * one array a layer, its one KV head replicated on every decode rank; two PP stages to tp 2,
 * from the source region and through the lookup buffer (a late target): byte-exact, half
 * the bytes of the same transfer in K+V, and the regions half the size. The element word of
 * an encoded target carries the layout (a K+V target's bytes are those before the latent
 * layout existed). A source and a target that disagree are refused at add_target, and
 * nothing is written. */
static void test_latent_layout(void)
{
    uint64_t bytes[2] = {0, 0};
    for (uint32_t arrays = 2; arrays >= 1; arrays--)
        for (int late = 0; late < 2; late++) {
            wcfg c = base_cfg(1, 2);
            c.n_kv_heads = 1;
            c.n_q_heads = 2;
            c.head_dim = 12; /* kv_lora_rank + n_rot */
            c.pp = 2;
            c.layer_split[1] = 1;
            c.layer_split[2] = 3;
            c.dec_arrays = c.src_arrays = arrays;
            world w;
            world_init(&w, &c);
            TH_CHECK(kvx_layout_bytes(&w.dl[0]) ==
                     (size_t)arrays * c.n_layers * c.n_blocks * c.block_size * c.head_dim * 2);
            xfer x = {.req = 90 + 2 * arrays + (uint32_t)late,
                      .n_tokens = 70,
                      .chunk = 24,
                      .salt = 31,
                      .dst_run = 3,
                      .late = late};
            uint64_t puts, pieces;
            run_xfer(&w, &c, &x, &puts, &pieces);
            TH_CHECKF(last_bytes == (uint64_t)arrays * 70 * 3 * 12 * 2 * 2,
                      "%u arrays: %llu bytes put", arrays, (unsigned long long)last_bytes);
            bytes[arrays - 1] = last_bytes;
            world_fini(&w);
        }
    TH_CHECK(bytes[1] == 2 * bytes[0]);
    fprintf(stderr,
            "  70 tokens, 3 layers, one head of 12 to 2 ranks: K+V %llu bytes, latent "
            "%llu\n",
            (unsigned long long)bytes[1], (unsigned long long)bytes[0]);
    /* the wire: the element word (frame header, 52 bytes of ids and key, 7 layout words
     * before it) */
    for (uint32_t arrays = 2; arrays >= 1; arrays--) {
        wcfg c = base_cfg(1, 1);
        c.dec_arrays = arrays;
        world w;
        world_init(&w, &c);
        int32_t blocks[2] = {1, 2};
        kvx_dec_req_params dp = {.n_stages = 1, .tp = 1, .blocks = blocks, .n_blocks = 2};
        uint8_t buf[4096];
        size_t len;
        TH_REQUIRE(kvx_dec_make_target(w.dec[0], 7, &dp, buf, sizeof(buf), &len) == 0);
        uint32_t word;
        memcpy(&word, buf + 20 + 52 + 7 * 4, 4);
        TH_CHECKF(word == (arrays == 1 ? 0x10002u : 2u), "element word %#x", word);
        kvx_dec_abort(w.dec[0], 7);
        TH_CHECK(pump_final(&w, 7, 2000));
        release_all(&w, 7);
        world_fini(&w);
    }
    /* disagreeing sides: a latent source and a K+V target, and the other way round */
    for (int k = 0; k < 2; k++) {
        wcfg c = base_cfg(1, 1);
        c.n_kv_heads = 1;
        c.src_arrays = k ? 2 : 1;
        c.dec_arrays = k ? 1 : 2;
        world w;
        world_init(&w, &c);
        int32_t blocks[2] = {1, 2};
        kvx_dec_req_params dp = {.n_stages = 1, .tp = 1, .blocks = blocks, .n_blocks = 2};
        uint8_t buf[4096];
        size_t len;
        TH_REQUIRE(kvx_dec_make_target(w.dec[0], 8, &dp, buf, sizeof(buf), &len) == 0);
        kvx_pf_req_params pp = {.stage = 0};
        TH_REQUIRE(kvx_pf_open(w.src[0], 8, &pp) == 0);
        TH_CHECK(kvx_pf_add_target(w.src[0], 8, buf, len) == TD_EINVAL);
        int32_t sb[2] = {0, 1};
        memset(w.sreg[0], 0x5a, kvx_layout_bytes(&w.sl[0]));
        kvx_pf_send_chunk(w.src[0], 8, 0, 0, 20, sb, 2); /* queued: no target was accepted */
        kvx_pf_abort(w.src[0], 8);
        kvx_dec_abort(w.dec[0], 8);
        TH_CHECK(pump_final(&w, 8, 2000));
        size_t stray = 0;
        for (size_t i = 0; i < kvx_layout_bytes(&w.dl[0]); i++)
            stray += w.dreg[0][i] != 0;
        TH_CHECKF(stray == 0, "%zu bytes written into the decode region", stray);
        release_all(&w, 8);
        world_fini(&w);
    }
}

int main(void)
{
    TH_RUN(test_tp_pairs);
    TH_RUN(test_tp_replicated_heads);
    TH_RUN(test_pp_stages);
    TH_RUN(test_late_target);
    TH_RUN(test_first_pos);
    TH_RUN(test_coalescing);
    TH_RUN(test_sliced_source);
    TH_RUN(test_sliced_gaps);
    TH_RUN(test_slice_layout);
    TH_RUN(test_latent_layout);
    TH_RUN(test_chunk_times);
    TH_RUN(test_chunk_times_late);
    TH_RUN(test_chunk_put_fails);
    TH_RUN(test_dec_abort);
    TH_RUN(test_pf_abort);
    TH_RUN(test_no_target_timeout);
    TH_RUN(test_dec_timeout);
    TH_RUN(test_peer_killed);
    TH_RUN(test_bad_targets);
    TH_RUN(test_unkeyed_begin);
    TH_RUN(test_lookup_full);
    TH_RUN(test_progress_thread);
    TH_RUN(test_spin_window);
    TH_RUN(test_soak);
    TH_EXIT();
}
