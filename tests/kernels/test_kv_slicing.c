/* test_kv_slicing.c: the KV pool's sliced layout (kvmem/kv_pool.h, kn_kv_tile in
 * kn_backend.h) against kvxfer's sliced source layout and against the head-major pool:
 *   - every (layer, K/V, block, head, token) of a sliced or head-major pool is where
 *     kvx_layout_off puts it, for the cuts kvx_layout_slice makes for decode tp sets;
 *     kn_kv_block_piece's pieces are a block's heads in order;
 *   - bad slicings and a backend without sliced kernels are refused with clear errors;
 *   - kv_write and attention on a sliced pool give bit for bit the head-major results
 *     (F16 and F32, GQA with a TP rank's phase, 1 and 2 threads, scattered block tables);
 *   - the tier's block copies carry the same bytes out of and into either layout;
 *   - kn_kv_alloc hands blocks out lowest id first, whatever order they were freed in;
 *   - with a model file argument: the engine's logits on a sliced pool equal the
 *     head-major ones bit for bit (cpu), and on cpu-dev the staged download of a sliced
 *     device pool gives the KV the cpu computed.
 * usage: test_kv_slicing [MODEL.gguf] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "gguf.h"
#include "kn_backends.h"
#include "kn_test_util.h"
#include "kv_mem.h"
#include "kvx_conn.h"
#include "model.h"
#include "td_err.h"
#include "td_tp.h"
#include "tharness.h"

static unsigned rng = 12345;
static float frand(void)
{
    rng = rng * 1103515245u + 12345u;
    return (float)((rng >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/* The cut kvx_layout_slice makes for n_kv KV heads (n_q query heads) and decode tps. */
static int cut(int n_q, int n_kv, const int *tps, int n_tp, kvx_layout *l)
{
    uint32_t ranges[2 * 64];
    int n = 0;
    for (int i = 0; i < n_tp; i++)
        for (int r = 0; r < tps[i]; r++) {
            td_tp_heads h;
            if (td_tp_heads_of_rank(n_q, n_kv, tps[i], r, &h)) return -1;
            ranges[2 * n] = (uint32_t)h.kv0;
            ranges[2 * n + 1] = (uint32_t)(h.kv0 + h.n_kv);
            n++;
        }
    return kvx_layout_slice(l, ranges, (uint32_t)n);
}

static kn_kv_pool *pool_like(const kvx_layout *l, td_dtype t, int n_blocks, bool sliced)
{
    kn_kv_pool_params p = {.n_layers = (int)l->n_layers,
                           .n_kv_heads = (int)l->n_heads,
                           .head_dim = (int)l->head_dim,
                           .block_size = (int)l->block_size,
                           .n_blocks = n_blocks,
                           .type = t};
    if (sliced && l->n_slices > 1) {
        p.n_slices = (int)l->n_slices;
        for (uint32_t s = 0; s < l->n_slices; s++)
            p.slice_heads[s] = (int)l->slice_heads[s];
    }
    kn_kv_pool *pool = NULL;
    return kn_kv_pool_create(&p, &pool) ? NULL : pool;
}

/* (n_q, n_kv, tps...) shapes: even splits, uneven and replicated ranges, two instances. */
static const int shapes[][6] = {
    /* n_q, n_kv, n_tp, tp0, tp1, expected slices */
    {9, 3, 1, 3, 0, 3},  {8, 4, 1, 2, 0, 2},  {8, 4, 2, 2, 4, 4}, {6, 2, 1, 3, 0, 2},
    {14, 2, 1, 7, 0, 2}, {12, 6, 2, 2, 3, 4}, {8, 8, 1, 1, 0, 1},
};

static void test_addressing(void)
{
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        const int *sh = shapes[k];
        int tps[2] = {sh[3], sh[4]};
        for (int ti = 0; ti < 2; ti++) {
            td_dtype t = ti ? TD_F32 : TD_F16;
            kvx_layout l = {.n_layers = 2,
                            .n_kv_heads = (uint32_t)sh[1],
                            .n_heads = (uint32_t)sh[1],
                            .block_size = 4,
                            .head_dim = 8,
                            .dtype_size = t == TD_F16 ? 2 : 4,
                            .n_blocks = 5};
            TH_REQUIRE(cut(sh[0], sh[1], tps, sh[2], &l) == 0);
            TH_CHECKF((int)(l.n_slices > 1 ? l.n_slices : 1) == sh[5], "shape %zu: %u slices", k,
                      l.n_slices);
            for (int sliced = 0; sliced < 2; sliced++) {
                kvx_layout kl = l;
                if (!sliced) kl.n_slices = 0;
                kn_kv_pool *p = pool_like(&kl, t, 5, sliced);
                TH_REQUIRE(p);
                TH_CHECK(p->region_bytes == kvx_layout_bytes(&kl));
                TH_CHECK(p->slicing.n_slices == (sliced && l.n_slices > 1 ? (int)l.n_slices : 1));
                int bad = 0;
                const size_t es = t == TD_F16 ? 2 : 4, tile = 4 * 8 * es;
                for (uint32_t ll = 0; ll < 2; ll++)
                    for (uint32_t kv = 0; kv < 2; kv++)
                        for (uint32_t b = 0; b < 5; b++)
                            for (uint32_t h = 0; h < kl.n_heads; h++)
                                for (uint32_t tok = 0; tok < 4; tok++) {
                                    const char *arr = (const char *)(kv ? p->v[ll] : p->k[ll]);
                                    size_t got =
                                        (size_t)(arr - (const char *)p->region) +
                                        (size_t)kn_kv_tile(&p->slicing, p->n_kv_heads, b, (int)h) *
                                            tile +
                                        tok * 8 * es;
                                    bad += got != kvx_layout_off(&kl, ll, kv, b, h, tok);
                                }
                TH_CHECKF(bad == 0, "shape %zu %s %s: %d offsets differ from kvx_layout_off", k,
                          td_dtype_name(t), sliced ? "sliced" : "head-major", bad);
                /* pieces: a block's heads in order, each contiguous where the tiles say */
                for (int32_t b = 0; b < 5; b++) {
                    int next = 0;
                    for (int s = 0; s < p->slicing.n_slices; s++) {
                        int h0;
                        size_t n, off = kn_kv_block_piece(p, b, s, &h0, &n);
                        TH_CHECK(h0 == next && n % tile == 0 && n >= tile);
                        for (int h = h0; h < h0 + (int)(n / tile); h++)
                            TH_CHECK(off + (size_t)(h - h0) * tile ==
                                     (size_t)kn_kv_tile(&p->slicing, p->n_kv_heads, b, h) * tile);
                        next = h0 + (int)(n / tile);
                    }
                    TH_CHECK(next == p->n_kv_heads);
                }
                kn_kv_pool_destroy(p);
            }
        }
    }
}

static void test_refused(void)
{
    kn_kv_pool_params p = {.n_layers = 1, .n_kv_heads = 4, .head_dim = 8, .n_blocks = 4};
    kn_kv_pool *pool = NULL;
    p.n_slices = 2;
    p.slice_heads[0] = 1;
    p.slice_heads[1] = 2; /* sums to 3, not 4 */
    TH_CHECK(kn_kv_pool_create(&p, &pool) == TD_EINVAL && !pool);
    p.slice_heads[1] = 0; /* an empty slice */
    TH_CHECK(kn_kv_pool_create(&p, &pool) == TD_EINVAL && !pool);
    p.n_slices = KN_KV_MAX_SLICES + 1;
    TH_CHECK(kn_kv_pool_create(&p, &pool) == TD_EINVAL && !pool);
    p.n_slices = -1;
    TH_CHECK(kn_kv_pool_create(&p, &pool) == TD_EINVAL && !pool);
    TH_CHECK(kn_kv_pool_region_bytes(&p) == 0);
    p.n_slices = 2;
    p.slice_heads[1] = 3;
    /* a device backend whose kernels are head-major only (cuda's table says so): refused
     * before any of its memory is touched */
    static const kn_backend_ops head_major_only = {.name = "headmajor", .host_memory = false};
    kn_backend be = {.ops = &head_major_only};
    p.backend = &be;
    TH_CHECK(kn_kv_pool_create(&p, &pool) == TD_EUNSUPP && !pool);
    p.backend = NULL;
    TH_CHECK(kn_kv_pool_create(&p, &pool) == 0 && pool && pool->slicing.n_slices == 2);
    kn_kv_pool_destroy(pool);
}

/* Blocks a prefix cache frees one by one, oldest first (or newest first, or scattered),
 * come back lowest id first: one ascending run. */
static void test_alloc_ascending(void)
{
    kn_kv_pool_params p = {.n_layers = 1, .n_kv_heads = 2, .head_dim = 4, .n_blocks = 12};
    kn_kv_mem *mem = NULL;
    TH_REQUIRE(kn_kv_mem_create(&p, &mem) == 0);
    int32_t a[12], b[5];
    TH_REQUIRE(kn_kv_alloc(mem, 12, a) == 0);
    for (int i = 3; i < 8; i++) /* blocks 3..7, oldest first */
        kn_kv_free(mem, 1, &a[i]);
    TH_REQUIRE(kn_kv_alloc(mem, 5, b) == 0);
    for (int i = 0; i < 5; i++)
        TH_CHECKF(b[i] == 3 + i, "block %d: id %d", i, b[i]);
    const int order[5] = {4, 0, 3, 1, 2}; /* scattered */
    for (int i = 0; i < 5; i++)
        kn_kv_free(mem, 1, &b[order[i]]);
    kn_kv_free(mem, 1, &a[10]);
    TH_REQUIRE(kn_kv_alloc(mem, 4, b) == 0);
    for (int i = 0; i < 4; i++)
        TH_CHECKF(b[i] == 3 + i, "scattered frees: block %d: id %d", i, b[i]);
    TH_REQUIRE(kn_kv_alloc(mem, 2, b) == 0);
    TH_CHECK(b[0] == 7 && b[1] == 10);
    TH_CHECK(kn_kv_alloc(mem, 1, b) == TD_ENOSPC);
    kn_kv_mem_destroy(mem);
}

/* kv_write then attention on a pool; out (m, nh, hd). */
typedef struct {
    int nh, nkv, group, phase, hd, bs, m;
    td_dtype t;
} att_case;

static void write_and_attend(kn_cpu *c, kn_kv_pool *p, const att_case *C, const float *k,
                             const float *v, const float *q, const int32_t *tables, float *out)
{
    /* two sequences of m / 2 tokens each, their blocks scattered over the pool */
    const int half = C->m / 2, nb = (half + C->bs - 1) / C->bs;
    int32_t pos[256], seq_of[256];
    for (int i = 0; i < C->m; i++) {
        pos[i] = i % half;
        seq_of[i] = i / half;
    }
    kn_seq_view views[2] = {{.block_table = tables, .n_ctx = half},
                            {.block_table = tables + nb, .n_ctx = half}};
    kn_cpu_kv_write(c, p->k[0], p->v[0], C->t, C->bs, &p->slicing, C->nkv, C->hd, k, v, C->m, pos,
                    seq_of, views);
    kn_cpu_attention(c, q, p->k[0], p->v[0], C->t, C->bs, &p->slicing, C->nh, C->nkv, C->group,
                     C->phase, C->hd, 1.0f / sqrtf((float)C->hd), 0, 0.0f, C->m, 0, pos, seq_of,
                     views, out);
}

static void test_kernels_identical(void)
{
    /* nh, nkv, group, phase, hd, bs, m, type: a whole model, a TP rank's GQA share with a
     * phase (td_tp.h), MHA */
    const att_case cases[] = {{9, 3, 3, 0, 64, 16, 200, TD_F16},
                              {9, 3, 3, 0, 64, 16, 200, TD_F32},
                              {5, 3, 3, 2, 32, 8, 96, TD_F16},
                              {4, 4, 1, 0, 16, 4, 64, TD_F32}};
    const int cuts[][4] = {{1, 1, 1, 0}, {1, 2, 0, 0}, {2, 1, 0, 0}, {1, 3, 0, 0}};
    for (int threads = 1; threads <= 2; threads++) {
        kn_cpu *c;
        TH_REQUIRE(kn_cpu_create(threads, &c) == 0);
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const att_case *C = &cases[ci];
            const int half = C->m / 2, nb = (half + C->bs - 1) / C->bs, n_blocks = 2 * nb + 5;
            int32_t tables[64];
            for (int i = 0; i < 2 * nb; i++) /* scattered: 4, 9, 3, 8, ... */
                tables[i] = (int32_t)((i * 7 + 4) % n_blocks);
            size_t nkvf = (size_t)C->m * C->nkv * C->hd, nqf = (size_t)C->m * C->nh * C->hd;
            float *k = malloc(nkvf * 4), *v = malloc(nkvf * 4), *q = malloc(nqf * 4);
            float *ref = malloc(nqf * 4), *got = malloc(nqf * 4);
            TH_REQUIRE(k && v && q && ref && got);
            for (size_t i = 0; i < nkvf; i++) {
                k[i] = frand();
                v[i] = frand();
            }
            for (size_t i = 0; i < nqf; i++)
                q[i] = frand();
            kn_kv_pool_params pp = {.n_layers = 1,
                                    .n_kv_heads = C->nkv,
                                    .head_dim = C->hd,
                                    .block_size = C->bs,
                                    .n_blocks = n_blocks,
                                    .type = C->t};
            kn_kv_pool *hm = NULL;
            TH_REQUIRE(kn_kv_pool_create(&pp, &hm) == 0);
            write_and_attend(c, hm, C, k, v, q, tables, ref);
            for (size_t x = 0; x < sizeof cuts / sizeof cuts[0]; x++) {
                kn_kv_pool_params sp = pp;
                int sum = 0;
                for (int s = 0; s < 4 && cuts[x][s]; s++) {
                    sp.slice_heads[s] = cuts[x][s];
                    sum += cuts[x][s];
                    sp.n_slices = s + 1;
                }
                if (sum != C->nkv) continue;
                kn_kv_pool *sl = NULL;
                TH_REQUIRE(kn_kv_pool_create(&sp, &sl) == 0);
                memset(got, 0, nqf * 4);
                write_and_attend(c, sl, C, k, v, q, tables, got);
                TH_CHECKF(memcmp(got, ref, nqf * 4) == 0,
                          "case %zu cut %zu, %d threads: attention differs from head-major", ci, x,
                          threads);
                const size_t tile = (size_t)C->bs * C->hd * (C->t == TD_F16 ? 2 : 4);
                int bad = 0;
                for (int b = 0; b < n_blocks; b++)
                    for (int h = 0; h < C->nkv; h++)
                        for (int kv = 0; kv < 2; kv++) {
                            const char *a = (const char *)(kv ? hm->v[0] : hm->k[0]) +
                                            kn_kv_tile(&hm->slicing, C->nkv, b, h) * tile;
                            const char *e = (const char *)(kv ? sl->v[0] : sl->k[0]) +
                                            kn_kv_tile(&sl->slicing, C->nkv, b, h) * tile;
                            bad += memcmp(a, e, tile) != 0;
                        }
                TH_CHECKF(bad == 0, "case %zu cut %zu: %d tiles differ after kv_write", ci, x, bad);
                kn_kv_pool_destroy(sl);
            }
            kn_kv_pool_destroy(hm);
            free(k);
            free(v);
            free(q);
            free(ref);
            free(got);
        }
        kn_cpu_destroy(c);
    }
}

/* A block put into the tier from a sliced pool comes back into a head-major one (and the
 * other way) with every tile equal. */
static void test_tier_copies(void)
{
    kn_kv_pool_params hp = {.n_layers = 2,
                            .n_kv_heads = 3,
                            .head_dim = 4,
                            .block_size = 4,
                            .n_blocks = 6,
                            .type = TD_F32};
    kn_kv_pool_params sp = hp;
    sp.n_slices = 2;
    sp.slice_heads[0] = 1;
    sp.slice_heads[1] = 2;
    kn_kv_pool *hm = NULL, *sl = NULL;
    TH_REQUIRE(kn_kv_pool_create(&hp, &hm) == 0 && kn_kv_pool_create(&sp, &sl) == 0);
    for (size_t i = 0; i < sl->region_bytes / 4; i++)
        ((float *)sl->region)[i] = frand();
    for (size_t i = 0; i < hm->region_bytes / 4; i++)
        ((float *)hm->region)[i] = frand();
    kn_kv_tier_params tp = {.bytes = 4096 + 4 * kn_kv_tier_block_bytes(hm)};
    kn_kv_tier *t = NULL;
    TH_REQUIRE(kn_kv_tier_create(&tp, hm, &t) == 0);
    int32_t tokens[4] = {1, 2, 3, 4};
    TH_REQUIRE(kn_kv_tier_put(t, sl, 2, 77, 1, 0, tokens) == 0);
    TH_REQUIRE(kn_kv_tier_put(t, hm, 4, 78, 2, 0, tokens) == 0);
    uint64_t serial;
    int s77 = kn_kv_tier_find(t, 77, 0, tokens, &serial);
    int s78 = kn_kv_tier_find(t, 78, 0, tokens, &serial);
    TH_REQUIRE(s77 >= 0 && s78 >= 0);
    TH_REQUIRE(kn_kv_tier_get(t, s77, hm, 1) == 0); /* sliced block 2 -> head-major block 1 */
    TH_REQUIRE(kn_kv_tier_get(t, s78, sl, 5) == 0); /* head-major block 4 -> sliced block 5 */
    const size_t tile = 4 * 4 * 4;
    int bad = 0;
    for (int l = 0; l < 2; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int h = 0; h < 3; h++) {
                const char *H = (const char *)(kv ? hm->v[l] : hm->k[l]);
                const char *S = (const char *)(kv ? sl->v[l] : sl->k[l]);
                bad += memcmp(H + kn_kv_tile(&hm->slicing, 3, 1, h) * tile,
                              S + kn_kv_tile(&sl->slicing, 3, 2, h) * tile, tile) != 0;
                bad += memcmp(S + kn_kv_tile(&sl->slicing, 3, 5, h) * tile,
                              H + kn_kv_tile(&hm->slicing, 3, 4, h) * tile, tile) != 0;
            }
    TH_CHECKF(bad == 0, "%d tiles differ after the tier's copies", bad);
    kn_kv_tier_destroy(t);
    kn_kv_pool_destroy(hm);
    kn_kv_pool_destroy(sl);
}

/* kn_kv_block_copy (a prefill stage's copy of a cached last block): every tile of the
 * source block, in a head-major and a sliced pool, and nothing else changes. */
static void test_block_copy(void)
{
    for (int sliced = 0; sliced < 2; sliced++) {
        kn_kv_pool_params p = {.n_layers = 2,
                               .n_kv_heads = 3,
                               .head_dim = 4,
                               .block_size = 4,
                               .n_blocks = 6,
                               .type = TD_F16};
        if (sliced) {
            p.n_slices = 2;
            p.slice_heads[0] = 2;
            p.slice_heads[1] = 1;
        }
        kn_kv_pool *pool = NULL;
        TH_REQUIRE(kn_kv_pool_create(&p, &pool) == 0);
        for (size_t i = 0; i < pool->region_bytes; i++)
            ((unsigned char *)pool->region)[i] = (unsigned char)(frand() * 255.0f);
        unsigned char *before = malloc(pool->region_bytes);
        TH_REQUIRE(before);
        memcpy(before, pool->region, pool->region_bytes);
        TH_CHECK(kn_kv_block_copy(pool, 4, 1) == 0);
        const size_t tile = 4 * 4 * 2;
        int bad = 0, moved = 0;
        for (int l = 0; l < 2; l++)
            for (int kv = 0; kv < 2; kv++)
                for (int b = 0; b < 6; b++)
                    for (int h = 0; h < 3; h++) {
                        const char *A = (const char *)(kv ? pool->v[l] : pool->k[l]);
                        size_t off = (size_t)(A - (const char *)pool->region);
                        size_t t = kn_kv_tile(&pool->slicing, 3, b, h) * tile;
                        size_t t4 = kn_kv_tile(&pool->slicing, 3, 4, h) * tile;
                        const unsigned char *want = before + off + (b == 1 ? t4 : t);
                        bad += memcmp(A + t, want, tile) != 0;
                        moved += b == 1 && memcmp(A + t, before + off + t, tile) != 0;
                    }
        TH_CHECKF(bad == 0 && moved == 2 * 2 * 3, "%s pool: %d tiles wrong, %d of 12 changed",
                  sliced ? "sliced" : "head-major", bad, moved);
        memcpy(before, pool->region, pool->region_bytes); /* refused copies change nothing */
        TH_CHECK(kn_kv_block_copy(pool, 2, 2) == TD_ERANGE);
        TH_CHECK(kn_kv_block_copy(pool, 6, 1) == TD_ERANGE);
        TH_CHECK(kn_kv_block_copy(pool, 0, -1) == TD_ERANGE);
        TH_CHECK(!memcmp(pool->region, before, pool->region_bytes));
        free(before);
        kn_kv_pool_destroy(pool);
    }
}

/* ---- the engine on a sliced pool ---- */

static kn_model *model;

typedef struct {
    kn_backend be;
    kn_engine *eng;
    kn_kv_mem *mem;
    kn_kv_pool *kv; /* mem's pool */
    kn_kv_seq seq;
} rig;

static int rig_open(rig *r, const char *backend, const int *cut)
{
    memset(r, 0, sizeof *r);
    int rc = kn_backend_create(backend, &(kn_backend_options){.n_threads = 2}, &r->be);
    if (rc) return rc;
    if ((rc = kn_engine_create(model, r->be, NULL, &r->eng))) return rc;
    kn_kv_pool_params kp = kn_model_kv_params(model, 24, 16, TD_F16);
    kp.backend = &r->be;
    kp.host_stage = !r->be.ops->host_memory; /* a device pool keeps a host copy */
    for (int s = 0; cut && cut[s]; s++) {
        kp.slice_heads[s] = cut[s];
        kp.n_slices = s + 1;
    }
    if ((rc = kn_kv_mem_create(&kp, &r->mem))) return rc;
    r->kv = kn_kv_mem_pool(r->mem);
    kn_kv_seq_init(&r->seq);
    /* scatter the sequence's blocks: take 3 first and give them back */
    int32_t skip[3];
    if ((rc = kn_kv_alloc(r->mem, 3, skip))) return rc;
    if ((rc = kn_kv_seq_reserve(r->mem, &r->seq, 160))) return rc;
    kn_kv_free(r->mem, 3, skip);
    return 0;
}

static void rig_close(rig *r)
{
    if (r->mem) kn_kv_seq_fini(r->mem, &r->seq);
    kn_kv_mem_destroy(r->mem);
    kn_engine_destroy(r->eng);
    kn_backend_destroy(&r->be);
}

/* Prefill 100 tokens in chunks of 37 then decode 3: the logits of every step's last row. */
static int run(rig *r, float *lg)
{
    const int nv = model->hp.n_vocab, steps[] = {37, 37, 26, 1, 1, 1};
    int done = 0, rc = 0;
    for (size_t i = 0; i < sizeof steps / sizeof *steps && !rc; i++) {
        int32_t t[64], pos[64], so[64], row = steps[i] - 1;
        for (int k = 0; k < steps[i]; k++) {
            t[k] = (int32_t)(((done + k) * 131 + 7) % nv);
            pos[k] = done + k;
            so[k] = 0;
        }
        done += steps[i];
        kn_seq_view v = {.block_table = r->seq.blocks, .n_ctx = done};
        kn_batch b = {.n_tokens = steps[i],
                      .n_solo = steps[i] == 1,
                      .tokens = t,
                      .pos = pos,
                      .seq_of = so,
                      .n_seqs = 1,
                      .seqs = &v,
                      .n_logits = 1,
                      .logit_rows = &row};
        rc = kn_engine_forward(r->eng, r->kv, &b, lg + i * (size_t)nv);
    }
    return rc;
}

static void test_engine_identical(void)
{
    const int nkv = model->heads.n_kv, nv = model->hp.n_vocab;
    const size_t n = (size_t)6 * nv;
    float *ref = calloc(n, 4), *got = calloc(n, 4);
    TH_REQUIRE(ref && got);
    rig hm;
    TH_REQUIRE(rig_open(&hm, "cpu", NULL) == 0);
    TH_REQUIRE(run(&hm, ref) == 0);
    int cuts[3][KN_KV_MAX_SLICES + 1] = {{0}};
    for (int h = 0; h < nkv && h < KN_KV_MAX_SLICES; h++) /* one head per slice */
        cuts[0][h] = 1;
    cuts[1][0] = 1; /* 1, then the rest */
    cuts[1][1] = nkv - 1;
    for (int x = 0; x < 2 && nkv > 1; x++) {
        rig sl;
        TH_REQUIRE(rig_open(&sl, "cpu", cuts[x]) == 0);
        TH_CHECK(sl.kv->slicing.n_slices > 1);
        memset(got, 0, n * 4);
        TH_REQUIRE(run(&sl, got) == 0);
        TH_CHECKF(memcmp(got, ref, n * 4) == 0, "cut %d: logits differ from head-major", x);
        rig_close(&sl);
    }
    /* cpu-dev (the CPU kernels behind a device's contract): a sliced device pool with host
     * staging; its staged download carries the KV the cpu run computed, tile for tile */
    rig dv;
    TH_REQUIRE(rig_open(&dv, "cpu-dev", nkv > 1 ? cuts[1] : NULL) == 0);
    memset(got, 0, n * 4);
    TH_REQUIRE(run(&dv, got) == 0);
    TH_CHECKF(memcmp(got, ref, n * 4) == 0, "cpu-dev sliced: logits differ from cpu head-major");
    TH_REQUIRE(kn_kv_stage_download(dv.kv, dv.seq.blocks, dv.seq.n_blocks) == 0);
    const size_t tile = (size_t)16 * model->hp.head_dim * 2;
    int bad = 0;
    for (int l = 0; l < hm.kv->n_layers; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int i = 0; i < hm.seq.n_blocks; i++)
                for (int h = 0; h < nkv; h++) {
                    const char *a = (const char *)(kv ? hm.kv->v[l] : hm.kv->k[l]) +
                                    kn_kv_tile(&hm.kv->slicing, nkv, hm.seq.blocks[i], h) * tile;
                    const char *dreg = (const char *)(kv ? dv.kv->v[l] : dv.kv->k[l]);
                    const char *e = (const char *)dv.kv->host +
                                    (dreg - (const char *)dv.kv->region) +
                                    kn_kv_tile(&dv.kv->slicing, nkv, dv.seq.blocks[i], h) * tile;
                    bad += memcmp(a, e, tile) != 0;
                }
    TH_CHECKF(bad == 0, "cpu-dev sliced: %d tiles of the staged download differ", bad);
    rig_close(&dv);
    rig_close(&hm);
    free(ref);
    free(got);
}

int main(int argc, char **argv)
{
    TH_RUN(test_addressing);
    TH_RUN(test_refused);
    TH_RUN(test_alloc_ascending);
    TH_RUN(test_kernels_identical);
    TH_RUN(test_tier_copies);
    TH_RUN(test_block_copy);
    if (argc > 1) {
        td_gguf *g;
        if (kt_open_model(argv[1], &g, &model)) return 1;
        TH_RUN(test_engine_identical);
        kn_model_destroy(model);
        td_gguf_close(g);
    }
    TH_EXIT();
}
