/* test_cuda.c: the CUDA backend against the CPU backend. Without a usable GPU (this
 * project's CI machines) it checks only that kn_backend_create("cuda") refuses clearly
 * (TD_EUNSUPP, *out zeroed). With one it compares, for every weight type the CUDA backend
 * has: matmul at m = 1, 5 (GEMV) and 20, 40 (GEMM) within float rounding of the CPU,
 * matmul_mixed's solo rows (3 of them, and all 40) bit for bit against m == 1, get_rows bit for
 * bit; and rmsnorm and swiglu within a few ulps; kv_write + attention over a paged f16 pool (two
 * one-token decode rows of long contexts as the solo rows, a 30-token prefill run of a
 * third sequence) within float rounding of the CPU, and the solo rows bit-identical when
 * computed alone. First run on an NVIDIA H200 on 2026-11-27 (docs/gpu.md). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "cuda_backend.h"
#include "kn_backends.h"
#include "kn_elem.h"
#include "kn_test_util.h"
#include "tharness.h"
#include "td_err.h"

static uint64_t rng = 0x5851f42d4c957f2dull;

/* A weight matrix of random data with small finite scales. */
static void *rand_matrix(td_dtype t, int64_t rows, int64_t cols, size_t *stride)
{
    *stride = td_dtype_row_bytes(t, cols);
    uint8_t *w = malloc(*stride * (size_t)rows);
    const int bb = kn_elem_block_bytes(t), bl = kn_elem_block_len(t);
    for (int64_t b = 0; b < rows * cols / bl; b++) {
        uint8_t *p = w + (size_t)b * bb;
        for (int i = 0; i < bb; i++)
            p[i] = (uint8_t)kt_xorshift64(&rng);
        const uint16_t d = td_fp32_to_fp16(kt_frand(&rng, -0.02f, 0.02f));
        if (t == TD_F32) {
            const float f = kt_frand(&rng, -1, 1);
            memcpy(p, &f, 4);
        } else if (t == TD_F16) {
            const uint16_t h = td_fp32_to_fp16(kt_frand(&rng, -1, 1));
            memcpy(p, &h, 2);
        } else if (t == TD_BF16) {
            const uint16_t h = td_fp32_to_bf16(kt_frand(&rng, -1, 1));
            memcpy(p, &h, 2);
        } else if (t == TD_Q6_K) {
            memcpy(p + 208, &d, 2);
        } else {
            memcpy(p, &d, 2);
            if (t == TD_Q4_1 || t == TD_Q5_1 || t == TD_Q4_K || t == TD_Q5_K) memcpy(p + 2, &d, 2);
        }
    }
    return w;
}

/* Backend memory holding a copy of n floats / bytes of host data. */
static void *up(kn_backend *g, const void *src, size_t bytes)
{
    void *p = g->ops->alloc(g->ctx, bytes);
    if (p && g->ops->upload(g->ctx, p, src, bytes)) return NULL;
    return p;
}

static float max_abs(const float *a, int64_t n)
{
    float m = 0;
    for (int64_t i = 0; i < n; i++)
        m = fmaxf(m, fabsf(a[i]));
    return m;
}

static void check_matmul(kn_backend *cpu, kn_backend *g, const kn_mat *w, int64_t m)
{
    const int64_t K = w->n_cols, N = w->n_rows;
    float *x = malloc(sizeof(float) * m * K), *ref = malloc(sizeof(float) * m * N);
    float *got = malloc(sizeof(float) * m * N), *one = malloc(sizeof(float) * N);
    for (int64_t i = 0; i < m * K; i++)
        x[i] = kt_frand(&rng, -1, 1);
    TH_REQUIRE(cpu->ops->matmul(cpu->ctx, w, x, m, ref) == 0);
    float *dx = up(g, x, sizeof(float) * m * K), *dy = g->ops->alloc(g->ctx, sizeof(float) * m * N);
    TH_REQUIRE(dx && dy);
    TH_CHECK(g->ops->matmul(g->ctx, w, dx, m, dy) == 0);
    TH_CHECK(g->ops->download(g->ctx, got, dy, sizeof(float) * m * N) == 0);
    const float tol = 2e-5f * max_abs(ref, m * N) + 1e-6f;
    int bad = 0;
    for (int64_t i = 0; i < m * N; i++)
        bad += !(fabsf(got[i] - ref[i]) <= tol);
    TH_CHECKF(bad == 0, "%s m %lld: %d of %lld outside %g of the cpu", td_dtype_name(w->type),
              (long long)m, bad, (long long)(m * N), tol);
    /* solo rows: bit-identical to m == 1 (at m 40 all rows: GEMV launches of 32 + 8) */
    const int64_t solo = m >= 40 ? m : m < 3 ? m : 3;
    TH_CHECK(g->ops->matmul_mixed(g->ctx, w, dx, m, solo, dy) == 0);
    TH_CHECK(g->ops->download(g->ctx, got, dy, sizeof(float) * m * N) == 0);
    for (int64_t i = 0; i < solo; i++) {
        TH_CHECK(g->ops->matmul(g->ctx, w, dx + i * K, 1, dy) == 0);
        TH_CHECK(g->ops->download(g->ctx, one, dy, sizeof(float) * N) == 0);
        TH_CHECKF(memcmp(one, got + i * N, sizeof(float) * N) == 0,
                  "%s: solo row %lld differs from m == 1", td_dtype_name(w->type), (long long)i);
    }
    g->ops->free(g->ctx, dx);
    g->ops->free(g->ctx, dy);
    free(x);
    free(ref);
    free(got);
    free(one);
}

static void check_get_rows(kn_backend *cpu, kn_backend *g, const kn_mat *w)
{
    const int32_t ids[] = {5, 0, (int32_t)w->n_rows - 1, 5};
    const int64_t m = 4, K = w->n_cols;
    float *ref = malloc(sizeof(float) * m * K), *got = malloc(sizeof(float) * m * K);
    TH_REQUIRE(cpu->ops->get_rows(cpu->ctx, w, ids, m, ref) == 0);
    int32_t *dids = up(g, ids, sizeof ids);
    float *dout = g->ops->alloc(g->ctx, sizeof(float) * m * K);
    TH_REQUIRE(dids && dout);
    TH_CHECK(g->ops->get_rows(g->ctx, w, dids, m, dout) == 0);
    TH_CHECK(g->ops->download(g->ctx, got, dout, sizeof(float) * m * K) == 0);
    TH_CHECKF(memcmp(ref, got, sizeof(float) * m * K) == 0, "%s: get_rows differs from the cpu",
              td_dtype_name(w->type));
    g->ops->free(g->ctx, dids);
    g->ops->free(g->ctx, dout);
    free(ref);
    free(got);
}

static void check_types(kn_backend *cpu, kn_backend *g)
{
    static const td_dtype types[] = {TD_F32,  TD_F16,  TD_BF16, TD_Q8_0, TD_Q4_0, TD_Q4_1,
                                     TD_Q5_0, TD_Q5_1, TD_Q4_K, TD_Q5_K, TD_Q6_K};
    enum { NT = sizeof types / sizeof types[0] };
    void *keep[NT]; /* freed only at the end: a freed block's address may come back from
                     * malloc, and the weight map would take it for the old matrix */
    for (size_t k = 0; k < NT; k++) {
        kn_mat w = {.type = types[k], .n_rows = 67, .n_cols = 512};
        keep[k] = rand_matrix(w.type, w.n_rows, w.n_cols, &w.row_stride);
        w.data = keep[k];
        TH_REQUIRE(g->ops->map_matrix(g->ctx, &w) == 0);
        check_matmul(cpu, g, &w, 1);
        check_matmul(cpu, g, &w, 5);
        check_matmul(cpu, g, &w, 20);
        check_matmul(cpu, g, &w, 40);
        check_get_rows(cpu, g, &w);
    }
    for (size_t k = 0; k < NT; k++)
        free(keep[k]);
}

static void check_elementwise(kn_backend *cpu, kn_backend *g)
{
    enum { M = 9, N = 576 };
    static float x[M * N], u[M * N], w[N], ref[M * N], got[M * N];
    for (int i = 0; i < M * N; i++) {
        x[i] = kt_frand(&rng, -3, 3);
        u[i] = kt_frand(&rng, -3, 3);
    }
    for (int i = 0; i < N; i++)
        w[i] = kt_frand(&rng, -2, 2);
    TH_REQUIRE(g->ops->map_vector(g->ctx, w, N) == 0);
    float *dx = up(g, x, sizeof x), *du = up(g, u, sizeof u), *dy = g->ops->alloc(g->ctx, sizeof x);
    TH_REQUIRE(dx && du && dy);
    cpu->ops->rmsnorm(cpu->ctx, x, w, ref, M, N, 1e-6f);
    g->ops->rmsnorm(g->ctx, dx, w, dy, M, N, 1e-6f);
    TH_CHECK(g->ops->download(g->ctx, got, dy, sizeof got) == 0);
    int bad = 0;
    for (int i = 0; i < M * N; i++)
        bad += !(fabsf(got[i] - ref[i]) <= 1e-6f * fmaxf(fabsf(ref[i]), 1.0f));
    TH_CHECKF(bad == 0, "rmsnorm: %d values differ", bad);
    cpu->ops->swiglu(cpu->ctx, x, u, ref, M, N);
    g->ops->swiglu(g->ctx, dx, du, dy, M, N);
    TH_CHECK(g->ops->download(g->ctx, got, dy, sizeof got) == 0);
    bad = 0;
    for (int i = 0; i < M * N; i++)
        bad += !(fabsf(got[i] - ref[i]) <= 4e-6f * fmaxf(fabsf(ref[i]), 1.0f));
    TH_CHECKF(bad == 0, "swiglu: %d values differ", bad);
    g->ops->free(g->ctx, dx);
    g->ops->free(g->ctx, du);
    g->ops->free(g->ctx, dy);
}

/* kv_write + attention: cuda against cpu; solo rows alone == solo rows in the batch. */
static void check_attention(kn_backend *cpu, kn_backend *g)
{
    enum { BS = 16, NKV = 2, NH = 6, HD = 64, NB = 16, NSEQ = 3, M = 32, SOLO = 2 };
    static const int32_t ctx[NSEQ] = {40, 70, 30}, first_blk[NSEQ] = {0, 3, 8};
    const size_t pool_bytes = (size_t)NB * NKV * BS * HD * 2; /* f16 */
    void *kc = calloc(1, pool_bytes), *vc = calloc(1, pool_bytes);
    /* both pools start zeroed (cudaMalloc does not clear: the slots past a sequence's
     * last position are never written) */
    void *kg = up(g, kc, pool_bytes), *vg = up(g, vc, pool_bytes);
    int32_t tables[NSEQ][8];
    kn_seq_view views[NSEQ], dviews[NSEQ];
    for (int s = 0; s < NSEQ; s++) {
        for (int b = 0; b < 8; b++)
            tables[s][b] = first_blk[s] + b;
        views[s] = (kn_seq_view){.block_table = tables[s], .n_ctx = ctx[s]};
        dviews[s] =
            (kn_seq_view){.block_table = up(g, tables[s], sizeof tables[s]), .n_ctx = ctx[s]};
    }
    kn_seq_view *dv = up(g, dviews, sizeof dviews);
    TH_REQUIRE(kc && vc && kg && vg && dv);
    /* every position of every sequence written, one sequence at a time */
    for (int s = 0; s < NSEQ; s++) {
        const int n = ctx[s];
        float *k = malloc(sizeof(float) * n * NKV * HD), *v = malloc(sizeof(float) * n * NKV * HD);
        int32_t *pos = malloc(sizeof(int32_t) * n), *so = malloc(sizeof(int32_t) * n);
        for (int i = 0; i < n * NKV * HD; i++) {
            k[i] = kt_frand(&rng, -1, 1);
            v[i] = kt_frand(&rng, -1, 1);
        }
        for (int i = 0; i < n; i++) {
            pos[i] = i;
            so[i] = s;
        }
        cpu->ops->kv_write(cpu->ctx, kc, vc, TD_F16, BS, NULL, NKV, HD, k, v, n, pos, so, views);
        float *dk = up(g, k, sizeof(float) * n * NKV * HD),
              *dvv = up(g, v, sizeof(float) * n * NKV * HD);
        int32_t *dp = up(g, pos, sizeof(int32_t) * n), *ds = up(g, so, sizeof(int32_t) * n);
        g->ops->kv_write(g->ctx, kg, vg, TD_F16, BS, NULL, NKV, HD, dk, dvv, n, dp, ds, dv);
        TH_CHECK(g->ops->synchronize(g->ctx) == 0);
        g->ops->free(g->ctx, dk);
        g->ops->free(g->ctx, dvv);
        g->ops->free(g->ctx, dp);
        g->ops->free(g->ctx, ds);
        free(k);
        free(v);
        free(pos);
        free(so);
    }
    /* the pools hold the same bits */
    void *back = malloc(pool_bytes);
    TH_CHECK(g->ops->download(g->ctx, back, kg, pool_bytes) == 0);
    TH_CHECKF(memcmp(back, kc, pool_bytes) == 0,
              "kv_write: the cuda K pool differs from the cpu's");
    TH_CHECK(g->ops->download(g->ctx, back, vg, pool_bytes) == 0);
    TH_CHECKF(memcmp(back, vc, pool_bytes) == 0,
              "kv_write: the cuda V pool differs from the cpu's");
    free(back);
    /* the batch: 2 solo decode rows (last positions of sequences 0 and 1), then sequence
     * 2's 30 positions */
    int32_t pos[M], so[M];
    pos[0] = ctx[0] - 1;
    so[0] = 0;
    pos[1] = ctx[1] - 1;
    so[1] = 1;
    for (int i = SOLO; i < M; i++) {
        pos[i] = i - SOLO;
        so[i] = 2;
    }
    static float q[M * NH * HD], ref[M * NH * HD], got[M * NH * HD], one[NH * HD];
    for (int i = 0; i < M * NH * HD; i++)
        q[i] = kt_frand(&rng, -1, 1);
    const float scale = 0.125f;
    cpu->ops->attention(cpu->ctx, q, kc, vc, TD_F16, BS, NULL, NH, NKV, NH / NKV, 0, HD, scale, 0,
                        0.0f, M, SOLO, pos, so, views, ref);
    float *dq = up(g, q, sizeof q), *dout = g->ops->alloc(g->ctx, sizeof got);
    int32_t *dp = up(g, pos, sizeof pos), *ds = up(g, so, sizeof so);
    TH_REQUIRE(dq && dout && dp && ds);
    g->ops->attention(g->ctx, dq, kg, vg, TD_F16, BS, NULL, NH, NKV, NH / NKV, 0, HD, scale, 0,
                      0.0f, M, SOLO, dp, ds, dv, dout);
    TH_CHECK(g->ops->download(g->ctx, got, dout, sizeof got) == 0);
    int bad = 0;
    for (int i = 0; i < M * NH * HD; i++)
        bad += !(fabsf(got[i] - ref[i]) <= 2e-5f * fmaxf(fabsf(ref[i]), 1.0f));
    TH_CHECKF(bad == 0, "attention: %d of %d values outside float rounding of the cpu", bad,
              M * NH * HD);
    /* each solo row alone: the same bits as in the batch */
    for (int r = 0; r < SOLO; r++) {
        g->ops->attention(g->ctx, dq + (size_t)r * NH * HD, kg, vg, TD_F16, BS, NULL, NH, NKV,
                          NH / NKV, 0, HD, scale, 0, 0.0f, 1, 1, dp + r, ds + r, dv, dout);
        TH_CHECK(g->ops->download(g->ctx, one, dout, sizeof one) == 0);
        TH_CHECKF(memcmp(one, got + (size_t)r * NH * HD, sizeof one) == 0,
                  "attention: solo row %d alone differs from the batch", r);
    }
    /* soft-capped scores (gemma2): a cap most scores pass, cuda against cpu, and unlike the
     * uncapped result */
    static float cref[M * NH * HD];
    const float cap = 0.25f;
    cpu->ops->attention(cpu->ctx, q, kc, vc, TD_F16, BS, NULL, NH, NKV, NH / NKV, 0, HD, scale, 0,
                        cap, M, SOLO, pos, so, views, cref);
    g->ops->attention(g->ctx, dq, kg, vg, TD_F16, BS, NULL, NH, NKV, NH / NKV, 0, HD, scale, 0, cap,
                      M, SOLO, dp, ds, dv, dout);
    TH_CHECK(g->ops->download(g->ctx, got, dout, sizeof got) == 0);
    bad = 0;
    float moved = 0.0f;
    for (int i = 0; i < M * NH * HD; i++) {
        bad += !(fabsf(got[i] - cref[i]) <= 2e-5f * fmaxf(fabsf(cref[i]), 1.0f));
        moved = fmaxf(moved, fabsf(cref[i] - ref[i]));
    }
    TH_CHECKF(bad == 0, "capped attention: %d of %d values outside float rounding of the cpu", bad,
              M * NH * HD);
    TH_CHECKF(moved > 1e-3f, "capped attention: the cap moved the cpu's output by %g only",
              (double)moved);
    g->ops->free(g->ctx, dq);
    g->ops->free(g->ctx, dout);
    g->ops->free(g->ctx, dp);
    g->ops->free(g->ctx, ds);
    for (int s = 0; s < NSEQ; s++)
        g->ops->free(g->ctx, (void *)dviews[s].block_table);
    g->ops->free(g->ctx, dv);
    g->ops->free(g->ctx, kg);
    g->ops->free(g->ctx, vg);
    free(kc);
    free(vc);
}

static void test_cuda(void)
{
    char why[256];
    kn_backend g;
    const kn_backend_options o = {.n_threads = 1, .device = 0};
    if (kn_cuda_device_count(why, sizeof why) == 0) {
        /* no GPU: the backend must refuse, clearly, and leave *out zeroed */
        TH_CHECK(kn_backend_create("cuda", &o, &g) == TD_EUNSUPP);
        TH_CHECK(g.ops == NULL && g.ctx == NULL);
        fprintf(stderr, "no GPU here (%s): checked the refusal only\n", why);
        return;
    }
    kn_backend cpu;
    TH_REQUIRE(kn_backend_create("cpu", &o, &cpu) == 0);
    TH_REQUIRE(kn_backend_create("cuda", &o, &g) == 0);
    check_types(&cpu, &g);
    check_elementwise(&cpu, &g);
    check_attention(&cpu, &g);
    TH_CHECK(g.ops->synchronize(g.ctx) == 0);
    kn_backend_destroy(&g);
    kn_backend_destroy(&cpu);
}

int main(void)
{
    TH_RUN(test_cuda);
    TH_EXIT();
}
