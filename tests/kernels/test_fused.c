/* test_fused.c: the CPU backend's fused ops (kernels/cpu/cpu_fused.c) against the sequences of
 * unfused ops they replace, bit for bit: matmul_multi against one matmul_mixed per matrix,
 * glu_ffn against gate and up matmul_mixed and swiglu/geglu, matmul_add against matmul_mixed
 * and add, experts_ffn against glu_ffn and matmul_mixed per group; weight types with and without
 * block sums, mixed types in one call, the q8 and q16 activation modes, solo and batch rows, the
 * gemm path, 1-3 threads; bad arguments; in the q8 and q16 modes, weights packed for the integer
 * GEMM (map_matrix) fused at m <= 4 (one dispatch, the bits of per-call packing). With a model file
 * (argv[1]), the engine's logits with the fused ops equal those with TANDEM_CPU_FUSED=0 over
 * prefills (dot and gemm path), decode steps and a mixed step. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tharness.h"
#include "cpu_backend.h"
#include "cpu_internal.h"
#include "cpu_pool.h"
#include "cpu_q16act.h"
#include "cpu_q8act.h"
#include "kn_backends.h"
#include "kn_test_util.h"
#include "kv_mem.h"
#include "model.h"
#include "td_err.h"

static uint64_t rng = 0x2545f4914f6cdd1dull;

/* A half with |value| < 1 (exponent below 15), or a small positive scale. */
static uint16_t half_small(void)
{
    return (uint16_t)((kt_u32(&rng) & 0x83ff) | ((8 + kt_u32(&rng) % 6) << 10));
}
static uint16_t half_scale(void)
{
    return (uint16_t)(((4 + kt_u32(&rng) % 4) << 10) | (kt_u32(&rng) & 0x3ff));
}

/* n_rows x n_cols of type t, random quants with sane fp16 scales (rows padded by 16 bytes,
 * so the row stride is not the row size). */
static kn_mat make_mat(td_dtype t, int64_t n_rows, int64_t n_cols)
{
    const td_dtype_info *info = td_dtype_get((uint32_t)t);
    const size_t rb = td_dtype_row_bytes(t, n_cols), stride = rb + 16;
    uint8_t *d = malloc(stride * (size_t)n_rows);
    for (size_t i = 0; i < stride * (size_t)n_rows; i++)
        d[i] = (uint8_t)kt_u32(&rng);
    for (int64_t r = 0; r < n_rows; r++) {
        uint8_t *row = d + (size_t)r * stride;
        for (int64_t b = 0; b < n_cols / info->blck; b++) {
            uint8_t *blk = row + (size_t)b * info->type_size;
            if (t == TD_Q4_1 || t == TD_Q4_K) {
                kt_put16(blk, half_scale());
                kt_put16(blk + 2, half_scale());
            } else if (t == TD_Q8_0) {
                kt_put16(blk, half_scale());
            } else if (t == TD_Q6_K) {
                kt_put16(blk + info->type_size - 2, half_scale());
            }
        }
        if (t == TD_F16)
            for (int64_t i = 0; i < n_cols; i++)
                kt_put16(row + 2 * i, half_small());
        if (t == TD_F32)
            for (int64_t i = 0; i < n_cols; i++) {
                float f = (float)((int)(kt_u32(&rng) % 2001) - 1000) / 1000.0f;
                memcpy(row + 4 * i, &f, 4);
            }
    }
    return (kn_mat){.type = t, .n_rows = n_rows, .n_cols = n_cols, .row_stride = stride, .data = d};
}

static float *make_x(int64_t n)
{
    float *x = malloc((size_t)n * sizeof *x);
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)((int)(kt_u32(&rng) % 4001) - 2000) / 1000.0f;
    return x;
}

static kn_cpu *cpus[3]; /* 1, 2 and 3 threads */

/* One matmul_multi case: bits equal to one matmul_mixed per matrix. */
static void check_multi(kn_cpu *c, int n_w, const td_dtype *types, const int64_t *rows, int64_t k,
                        int64_t m, int64_t solo)
{
    kn_mat w[KN_MULTI_MAX];
    const kn_mat *wp[KN_MULTI_MAX];
    float *a[KN_MULTI_MAX], *b[KN_MULTI_MAX];
    float *x = make_x(m * k);
    for (int i = 0; i < n_w; i++) {
        w[i] = make_mat(types[i], rows[i], k);
        wp[i] = &w[i];
        a[i] = calloc((size_t)(m * rows[i]), sizeof(float));
        b[i] = calloc((size_t)(m * rows[i]), sizeof(float));
    }
    TH_CHECK(kn_cpu_matmul_multi(c, n_w, wp, x, m, solo, a) == 0);
    for (int i = 0; i < n_w; i++)
        TH_CHECK(kn_cpu_matmul_mixed(c, &w[i], x, m, solo, b[i]) == 0);
    for (int i = 0; i < n_w; i++) {
        TH_CHECKF(!memcmp(a[i], b[i], (size_t)(m * rows[i]) * sizeof(float)),
                  "multi: matrix %d (%s) m %lld solo %lld threads %d differs", i,
                  td_dtype_name(types[i]), (long long)m, (long long)solo, kn_cpu_n_threads(c));
        free((void *)w[i].data);
        free(a[i]);
        free(b[i]);
    }
    free(x);
}

static void test_multi(void)
{
    const td_dtype same[][3] = {{TD_Q4_1, TD_Q4_1, TD_Q4_1},
                                {TD_Q8_0, TD_Q8_0, TD_Q8_0},
                                {TD_Q4_K, TD_Q4_K, TD_Q6_K},
                                {TD_F16, TD_F32, TD_Q4_1},
                                {TD_Q6_K, TD_Q4_K, TD_Q4_K}};
    const int64_t rows[3] = {150, 46, 46}; /* rows not a multiple of 4 */
    const int64_t ms[][2] = {{1, 1}, {1, 0}, {3, 3}, {5, 2}, {6, 0}, {70, 0}, {70, 4}};
    for (int t = 0; t < 3; t++)
        for (size_t s = 0; s < sizeof same / sizeof *same; s++)
            for (size_t i = 0; i < sizeof ms / sizeof *ms; i++)
                check_multi(cpus[t], 3, same[s], rows, 512, ms[i][0], ms[i][1]);
    /* one and two matrices */
    check_multi(cpus[1], 1, same[0], rows, 256, 1, 1);
    check_multi(cpus[1], 2, same[2], rows, 256, 2, 2);
    /* the q8 activation mode: x quantized once per type, shared */
    for (int t = 0; t < 3; t++) {
        kn_cpu_set_act_q8(cpus[t], true);
        check_multi(cpus[t], 3, same[2], rows, 512, 1, 1);
        check_multi(cpus[t], 3, same[1], rows, 512, 4, 2);
        /* the q16 mode: 32-block types quantized once, the K-types float32 */
        kn_cpu_set_act(cpus[t], KN_CPU_ACT_Q16);
        check_multi(cpus[t], 3, same[2], rows, 512, 1, 1);
        check_multi(cpus[t], 3, same[0], rows, 512, 5, 2);
        check_multi(cpus[t], 3, same[1], rows, 512, 70, 4);
        kn_cpu_set_act_q8(cpus[t], false);
    }
}

/* One glu_ffn case: bits equal to gate, up (matmul_mixed) and swiglu/geglu; out == gate
 * as the engine calls it. */
static void check_glu(kn_cpu *c, td_dtype tg, td_dtype tu, int64_t F, int64_t k, int64_t m,
                      int64_t solo, bool gelu)
{
    kn_mat wg = make_mat(tg, F, k), wu = make_mat(tu, F, k);
    float *x = make_x(m * k);
    const size_t n = (size_t)(m * F);
    float *g1 = calloc(n, 4), *u1 = calloc(n, 4), *g2 = calloc(n, 4), *u2 = calloc(n, 4);
    TH_CHECK(kn_cpu_glu_ffn(c, &wg, &wu, x, m, solo, gelu, g1, u1, g1) == 0);
    TH_CHECK(kn_cpu_matmul_mixed(c, &wg, x, m, solo, g2) == 0);
    TH_CHECK(kn_cpu_matmul_mixed(c, &wu, x, m, solo, u2) == 0);
    if (gelu)
        kn_cpu_geglu(c, g2, u2, g2, m, F);
    else
        kn_cpu_swiglu(c, g2, u2, g2, m, F);
    TH_CHECKF(!memcmp(g1, g2, n * 4) && !memcmp(u1, u2, n * 4),
              "glu %s/%s F %lld m %lld solo %lld gelu %d threads %d differs", td_dtype_name(tg),
              td_dtype_name(tu), (long long)F, (long long)m, (long long)solo, gelu,
              kn_cpu_n_threads(c));
    free((void *)wg.data);
    free((void *)wu.data);
    free(x);
    free(g1);
    free(u1);
    free(g2);
    free(u2);
}

static void test_glu(void)
{
    const int64_t ms[][2] = {{1, 1}, {2, 0}, {5, 5}, {7, 3}, {66, 0}, {66, 3}};
    /* F 392: whole 8-groups; F 100: not (the activation runs after the dispatch) */
    const int64_t Fs[] = {392, 100, 8};
    for (int t = 0; t < 3; t++)
        for (size_t f = 0; f < sizeof Fs / sizeof *Fs; f++)
            for (size_t i = 0; i < sizeof ms / sizeof *ms; i++)
                for (int gelu = 0; gelu < 2; gelu++) {
                    check_glu(cpus[t], TD_Q4_1, TD_Q4_1, Fs[f], 256, ms[i][0], ms[i][1], gelu);
                    check_glu(cpus[t], TD_Q4_K, TD_Q6_K, Fs[f], 256, ms[i][0], ms[i][1], gelu);
                }
    kn_cpu_set_act_q8(cpus[1], true);
    check_glu(cpus[1], TD_Q4_K, TD_Q4_K, 392, 512, 1, 1, false);
    check_glu(cpus[1], TD_Q8_0, TD_Q8_0, 392, 512, 3, 3, false);
    kn_cpu_set_act(cpus[1], KN_CPU_ACT_Q16);
    check_glu(cpus[1], TD_Q4_1, TD_Q4_1, 392, 512, 1, 1, false);
    check_glu(cpus[1], TD_Q8_0, TD_Q4_1, 100, 512, 5, 2, true);
    check_glu(cpus[1], TD_Q4_1, TD_Q4_1, 392, 256, 66, 3, false);
    kn_cpu_set_act_q8(cpus[1], false);
}

/* experts_ffn over groups of the given rows (and solo rows): bits equal to glu_ffn and
 * matmul_mixed group by group; the groups' types cycle, a group of 66 batch rows takes the
 * gemm path inside the op. */
static void check_experts(kn_cpu *c, int n, const int64_t *m, const int64_t *solo, bool gelu)
{
    enum { F = 224, K = 256, MAXG = 8 }; /* F: whole 32-blocks of the down rows */
    /* types make_mat gives sane scales */
    const td_dtype tg[] = {TD_Q4_K, TD_Q8_0, TD_Q4_1}, td[] = {TD_Q8_0, TD_Q4_1, TD_F16};
    kn_mat wg[MAXG], wu[MAXG], wd[MAXG];
    const kn_mat *pg[MAXG], *pu[MAXG], *pd[MAXG];
    const float *x[MAXG];
    float *g1[MAXG], *u1[MAXG], *y1[MAXG], *g2[MAXG], *u2[MAXG], *y2[MAXG];
    for (int i = 0; i < n; i++) {
        wg[i] = make_mat(tg[i % 3], F, K), wu[i] = make_mat(tg[(i + 1) % 3], F, K);
        wd[i] = make_mat(td[i % 3], K, F);
        pg[i] = &wg[i], pu[i] = &wu[i], pd[i] = &wd[i];
        x[i] = make_x(m[i] * K);
        g1[i] = calloc((size_t)(m[i] * F), 4), u1[i] = calloc((size_t)(m[i] * F), 4);
        g2[i] = calloc((size_t)(m[i] * F), 4), u2[i] = calloc((size_t)(m[i] * F), 4);
        y1[i] = calloc((size_t)(m[i] * K), 4), y2[i] = calloc((size_t)(m[i] * K), 4);
    }
    TH_CHECK(kn_cpu_experts_ffn(c, n, pg, pu, pd, x, m, solo, gelu, g1, u1, y1) == 0);
    for (int i = 0; i < n; i++) {
        TH_CHECK(
            kn_cpu_glu_ffn(c, &wg[i], &wu[i], x[i], m[i], solo[i], gelu, g2[i], u2[i], g2[i]) == 0);
        TH_CHECK(kn_cpu_matmul_mixed(c, &wd[i], g2[i], m[i], solo[i], y2[i]) == 0);
        bool finite = true; /* NaN payloads could differ: the comparison needs numbers */
        for (int64_t v = 0; v < m[i] * K; v++)
            finite = finite && isfinite(y2[i][v]);
        TH_CHECK(finite);
        TH_CHECKF(!memcmp(g1[i], g2[i], (size_t)(m[i] * F) * 4) &&
                      !memcmp(y1[i], y2[i], (size_t)(m[i] * K) * 4),
                  "experts: group %d of %d (m %lld solo %lld) gelu %d threads %d differs (gate %d "
                  "out %d)",
                  i, n, (long long)m[i], (long long)solo[i], gelu, kn_cpu_n_threads(c),
                  memcmp(g1[i], g2[i], (size_t)(m[i] * F) * 4) != 0,
                  memcmp(y1[i], y2[i], (size_t)(m[i] * K) * 4) != 0);
        free((void *)wg[i].data), free((void *)wu[i].data), free((void *)wd[i].data);
        free((void *)x[i]), free(g1[i]), free(u1[i]), free(g2[i]), free(u2[i]);
        free(y1[i]), free(y2[i]);
    }
}

static void test_experts(void)
{
    const int64_t m1[] = {1, 1, 1, 1}, s1[] = {1, 1, 1, 1};        /* one decode token, 4 experts */
    const int64_t m2[] = {3, 1, 66, 2, 5}, s2[] = {2, 1, 3, 0, 0}; /* a mixed step */
    for (int t = 0; t < 3; t++)
        for (int gelu = 0; gelu < 2; gelu++) {
            check_experts(cpus[t], 4, m1, s1, gelu);
            check_experts(cpus[t], 5, m2, s2, gelu);
        }
    kn_cpu_set_act_q8(cpus[1], true); /* unpacked: the q8 GEMM's panel case runs inside too */
    check_experts(cpus[1], 4, m1, s1, false);
    check_experts(cpus[1], 5, m2, s2, false);
    kn_cpu_set_act(cpus[1], KN_CPU_ACT_Q16);
    check_experts(cpus[1], 4, m1, s1, false);
    check_experts(cpus[1], 5, m2, s2, true);
    kn_cpu_set_act_q8(cpus[1], false);
}

/* One matmul_add case: bits equal to matmul_mixed and add. */
static void check_add(kn_cpu *c, td_dtype t, int64_t N, int64_t k, int64_t m, int64_t solo)
{
    kn_mat w = make_mat(t, N, k);
    float *x = make_x(m * k), *acc1 = make_x(m * N);
    const size_t n = (size_t)(m * N);
    float *acc2 = malloc(n * 4), *y1 = calloc(n, 4), *y2 = calloc(n, 4);
    memcpy(acc2, acc1, n * 4);
    TH_CHECK(kn_cpu_matmul_add(c, &w, x, m, solo, y1, acc1) == 0);
    TH_CHECK(kn_cpu_matmul_mixed(c, &w, x, m, solo, y2) == 0);
    kn_cpu_add(c, acc2, y2, m, N);
    TH_CHECKF(!memcmp(acc1, acc2, n * 4) && !memcmp(y1, y2, n * 4),
              "add %s N %lld m %lld solo %lld threads %d differs", td_dtype_name(t), (long long)N,
              (long long)m, (long long)solo, kn_cpu_n_threads(c));
    free((void *)w.data);
    free(x);
    free(acc1);
    free(acc2);
    free(y1);
    free(y2);
}

static void test_add(void)
{
    const td_dtype types[] = {TD_Q4_1, TD_Q8_0, TD_Q4_K, TD_Q6_K, TD_F16};
    const int64_t ms[][2] = {{1, 1}, {1, 0}, {4, 4}, {9, 2}, {70, 0}, {70, 5}};
    for (int t = 0; t < 3; t++)
        for (size_t i = 0; i < sizeof types / sizeof *types; i++)
            for (size_t j = 0; j < sizeof ms / sizeof *ms; j++)
                check_add(cpus[t], types[i], 301, 512, ms[j][0], ms[j][1]);
}

static void test_errors(void)
{
    kn_mat a = make_mat(TD_Q4_1, 64, 256), b = make_mat(TD_Q4_1, 32, 512);
    const kn_mat *w[4] = {&a, &a, &a, &a};
    float x[512] = {0}, y[4][64];
    float *const yp[4] = {y[0], y[1], y[2], y[3]};
    TH_CHECK(kn_cpu_matmul_multi(cpus[1], 0, w, x, 1, 1, yp) == TD_EINVAL);
    TH_CHECK(kn_cpu_matmul_multi(cpus[1], 4, w, x, 1, 1, yp) == TD_EINVAL);
    const kn_mat *wb[2] = {&a, &b}; /* different widths */
    TH_CHECK(kn_cpu_matmul_multi(cpus[1], 2, wb, x, 1, 1, yp) == TD_EINVAL);
    TH_CHECK(kn_cpu_matmul_multi(cpus[1], 1, w, x, 2, 3, yp) == TD_EINVAL); /* solo > m */
    kn_mat c = make_mat(TD_Q4_1, 32, 256);
    TH_CHECK(kn_cpu_glu_ffn(cpus[1], &a, &c, x, 1, 1, false, y[0], y[1], y[0]) == TD_EINVAL);
    kn_mat bad = a;
    bad.type = TD_Q4_0 + 100; /* not a type */
    const kn_mat *wbad[1] = {&bad};
    TH_CHECK(kn_cpu_matmul_multi(cpus[1], 1, wbad, x, 1, 1, yp) < 0);
    free((void *)a.data);
    free((void *)b.data);
    free((void *)c.data);
}

/* ---- the q8 mode on packed weights: the GEMM's panel-free kernel fused ---- */

/* The pool runs of c so far (kept when TANDEM_CPU_PROFILE was set at its creation). */
static uint64_t pool_runs(kn_cpu *c)
{
    kn_pool_stats st;
    kn_pool_get_stats(kn_cpu_pool(c), &st);
    return st.runs;
}

/* The q8 mode's backends of 1-3 threads: packed[t - 1] gets every case's matrices registered
 * (map_matrix), per_call[t - 1] none (its products pack per call). The registry keys on
 * w->data, so no case's matrix is freed before the backends are (a new malloc could hand out
 * the address again with other bits behind it): they wait in kept[]. */
static kn_cpu *packed[3], *per_call[3];
static void *kept[1024];
static int n_kept;

typedef enum { OP_MULTI, OP_GLU, OP_ADD } fused_op;

/* One fused op on packed w (multi: n matrices; glu: gate w[0], up w[1]; add: w[0] onto acc);
 * results into y[i] (glu: y[0] the activation, y[1] up; add: y[0] the product, y[1] acc). */
static int run_op(kn_cpu *c, fused_op op, int n, const kn_mat *w, const float *x, int64_t m,
                  float **y, const float *acc0)
{
    const kn_mat *wp[KN_MULTI_MAX];
    for (int i = 0; i < n; i++)
        wp[i] = &w[i];
    if (op == OP_MULTI) return kn_cpu_matmul_multi(c, n, wp, x, m, m, y);
    if (op == OP_GLU) return kn_cpu_glu_ffn(c, &w[0], &w[1], x, m, m, false, y[0], y[1], y[0]);
    memcpy(y[1], acc0, (size_t)(m * w[0].n_rows) * sizeof(float));
    return kn_cpu_matmul_add(c, &w[0], x, m, m, y[0], y[1]);
}

/* The unfused sequence of run_op, on c. */
static int run_unfused(kn_cpu *c, fused_op op, int n, const kn_mat *w, const float *x, int64_t m,
                       float **y, const float *acc0)
{
    int rc = 0;
    for (int i = 0; i < (op == OP_ADD ? 1 : n) && !rc; i++)
        rc = kn_cpu_matmul_mixed(c, &w[i], x, m, m, y[i]);
    if (rc) return rc;
    if (op == OP_GLU) kn_cpu_swiglu(c, y[0], y[1], y[0], m, w[0].n_rows);
    if (op == OP_ADD) {
        memcpy(y[1], acc0, (size_t)(m * w[0].n_rows) * sizeof(float));
        kn_cpu_add(c, y[1], y[0], m, w[0].n_rows);
    }
    return 0;
}

/* One case: the fused op on packed weights equals the unfused ops on the same backend and
 * on one that packs per call, bit for bit; at m <= 4 on a packing CPU multi and glu are one
 * pool run. */
static void check_packed(fused_op op, int n, const td_dtype *types, const int64_t *rows, int64_t k,
                         int64_t m, int t)
{
    kn_mat w[KN_MULTI_MAX];
    float *y[3][KN_MULTI_MAX];
    const int n_out = op == OP_MULTI ? n : 2;
    int64_t out_rows[KN_MULTI_MAX];
    for (int i = 0; i < n; i++)
        w[i] = make_mat(types[i], rows[i], k);
    for (int i = 0; i < n_out; i++) {
        out_rows[i] = op == OP_MULTI ? rows[i] : rows[0];
        for (int v = 0; v < 3; v++)
            y[v][i] = calloc((size_t)(m * out_rows[i]), sizeof(float));
    }
    float *x = make_x(m * k), *acc0 = make_x(m * rows[0]);
    kn_cpu *c = packed[t - 1], *cp = per_call[t - 1];
    for (int i = 0; i < n; i++) {
        kn_cpu_map_matrix(c, &w[i]);
        TH_REQUIRE(n_kept < (int)(sizeof kept / sizeof *kept));
        kept[n_kept++] = (void *)w[i].data;
    }
    TH_CHECK(run_op(c, op, n, w, x, m, y[0], acc0) == 0); /* packs on first use */
    const uint64_t before = pool_runs(c);
    TH_CHECK(run_op(c, op, n, w, x, m, y[0], acc0) == 0);
    const uint64_t runs = pool_runs(c) - before;
    TH_CHECK(run_unfused(c, op, n, w, x, m, y[1], acc0) == 0);
    TH_CHECK(run_unfused(cp, op, n, w, x, m, y[2], acc0) == 0);
    for (int i = 0; i < n_out; i++) {
        const size_t b = (size_t)(m * out_rows[i]) * sizeof(float);
        TH_CHECKF(!memcmp(y[0][i], y[1][i], b) && !memcmp(y[1][i], y[2][i], b),
                  "packed op %d output %d (%s) m %lld threads %d differs", (int)op, i,
                  td_dtype_name(types[i < n ? i : 0]), (long long)m, t);
    }
    bool all_packed = kn_q8_gemm_group_rows() == 16;
    for (int i = 0; i < n; i++)
        all_packed = all_packed && kn_q8_packed_bytes(&w[i]) > 0;
    /* fused: one run for the products and the activation; an op that fell back runs one
     * per matrix plus the activation's. (matmul_add cannot tell: its unfused add of rows this
     * short runs on the caller, so both make one run; its bits are checked above.) */
    if (all_packed && m <= 4 && op != OP_ADD)
        TH_CHECKF(runs == 1, "packed op %d m %lld threads %d: %llu pool runs, not fused", (int)op,
                  (long long)m, t, (unsigned long long)runs);
    for (int i = 0; i < n_out; i++)
        for (int v = 0; v < 3; v++)
            free(y[v][i]);
    free(x);
    free(acc0);
}

static void test_packed(void)
{
    const td_dtype sets[][3] = {{TD_Q4_0, TD_Q4_0, TD_Q4_0}, {TD_Q4_1, TD_Q4_1, TD_Q4_1},
                                {TD_Q5_0, TD_Q5_0, TD_Q5_0}, {TD_Q8_0, TD_Q8_0, TD_Q8_0},
                                {TD_Q8_0, TD_Q4_1, TD_Q4_1}, {TD_Q4_K, TD_Q4_0, TD_Q6_K}};
    /* rows not multiples of 16: partial last groups, parts that end inside a matrix */
    const int64_t rows[3] = {150, 46, 46}, glu_rows[2] = {392, 392}, ms[] = {1, 2, 4, 5};
    for (int t = 0; t < 3; t++) {
        setenv("TANDEM_CPU_PROFILE", "1", 1); /* packed[]'s pool counts its runs */
        TH_REQUIRE(kn_cpu_create(t + 1, &packed[t]) == 0);
        unsetenv("TANDEM_CPU_PROFILE");
        TH_REQUIRE(kn_cpu_create(t + 1, &per_call[t]) == 0);
        kn_cpu_set_act_q8(packed[t], true);
        kn_cpu_set_act_q8(per_call[t], true);
    }
    for (int t = 1; t <= 3; t++)
        for (size_t s = 0; s < sizeof sets / sizeof *sets; s++)
            for (size_t i = 0; i < sizeof ms / sizeof *ms; i++) {
                check_packed(OP_MULTI, 3, sets[s], rows, 512, ms[i], t);
                check_packed(OP_GLU, 2, sets[s], glu_rows, 256, ms[i], t);
                check_packed(OP_ADD, 1, sets[s], rows, 512, ms[i], t);
            }
    check_packed(OP_MULTI, 1, sets[1], rows + 1, 256, 1, 2);
    /* the glu's F not a multiple of 16: the last item is half a group */
    const int64_t odd[2] = {200, 200};
    check_packed(OP_GLU, 2, sets[0], odd, 256, 1, 2);
    check_packed(OP_GLU, 2, sets[3], odd, 256, 3, 3);
    /* the q16 mode reads the same packed copies (K-types: the float32 dot) */
    for (int t = 0; t < 3; t++) {
        kn_cpu_set_act(packed[t], KN_CPU_ACT_Q16);
        kn_cpu_set_act(per_call[t], KN_CPU_ACT_Q16);
    }
    for (int t = 1; t <= 3; t++)
        for (size_t s = 0; s < sizeof sets / sizeof *sets; s++)
            for (size_t i = 0; i < sizeof ms / sizeof *ms; i += 2) {
                check_packed(OP_MULTI, 3, sets[s], rows, 512, ms[i], t);
                check_packed(OP_GLU, 2, sets[s], glu_rows, 256, ms[i], t);
                check_packed(OP_ADD, 1, sets[s], rows, 512, ms[i], t);
            }
    check_packed(OP_GLU, 2, sets[0], odd, 256, 1, 2);
    for (int t = 0; t < 3; t++) {
        kn_cpu_destroy(packed[t]);
        kn_cpu_destroy(per_call[t]);
    }
    for (int i = 0; i < n_kept; i++)
        free(kept[i]);
}

/* ---- the engine: fused against TANDEM_CPU_FUSED=0 ---- */

static kn_model *model;

typedef struct {
    kn_backend be;
    kn_engine *eng;
    kn_kv_mem *mem;
    kn_kv_seq seq[3];
    kn_backend_ops no_map;     /* the table without map_matrix, when rig_open's q8 is 2 or 4 */
    const kn_backend_ops *own; /* the backend's own table, put back at rig_close */
} rig;

/* q8: 0 the float32 path; 1 the q8 mode; 2 the q8 mode on a table without map_matrix (the
 * engine names no weights, so nothing is packed); 3 and 4 the same with the q16 mode. */
static int rig_open(rig *r, const char *fused, int q8)
{
    memset(r, 0, sizeof *r);
    setenv("TANDEM_CPU_FUSED", fused, 1);
    int rc = kn_backend_create("cpu", &(kn_backend_options){.n_threads = 2}, &r->be);
    unsetenv("TANDEM_CPU_FUSED");
    if (rc) return rc;
    kn_cpu_set_act(kn_cpu_of(r->be), q8 == 0   ? KN_CPU_ACT_F32
                                     : q8 <= 2 ? KN_CPU_ACT_Q8
                                               : KN_CPU_ACT_Q16);
    r->own = r->be.ops;
    if (q8 == 2 || q8 == 4) {
        r->no_map = *r->be.ops;
        r->no_map.map_matrix = NULL;
        r->be.ops = &r->no_map;
    }
    if ((rc = kn_engine_create(model, r->be, NULL, &r->eng))) return rc;
    kn_kv_pool_params kp = kn_model_kv_params(model, 64, 16, TD_F16);
    if ((rc = kn_kv_mem_create(&kp, &r->mem))) return rc;
    for (int s = 0; s < 3; s++)
        kn_kv_seq_init(&r->seq[s]);
    return 0;
}

static void rig_close(rig *r)
{
    for (int s = 0; s < 3 && r->mem; s++)
        kn_kv_seq_fini(r->mem, &r->seq[s]);
    kn_kv_mem_destroy(r->mem);
    kn_engine_destroy(r->eng);
    if (r->own) r->be.ops = r->own;
    kn_backend_destroy(&r->be);
}

/* One batch: sequence s gets cnt[s] tokens from position done[s]; the first `solo` rows of
 * the batch are solo. Logits of each sequence's last token into lg (a row of n_vocab per
 * sequence with tokens). */
static int step(rig *r, const int *cnt, int solo, int *done, float *lg)
{
    const int nv = model->hp.n_vocab;
    int32_t t[160], pos[160], so[160], rows[3];
    int n = 0, nl = 0, rc = 0;
    kn_seq_view v[3];
    for (int s = 0; s < 3; s++) {
        for (int k = 0; k < cnt[s]; k++, n++) {
            t[n] = (int32_t)(((done[s] + k) * 131 + s * 17 + 7) % nv);
            pos[n] = done[s] + k;
            so[n] = s;
        }
        if (cnt[s]) rows[nl++] = n - 1;
        done[s] += cnt[s];
        if (cnt[s] && !rc) rc = kn_kv_seq_reserve(r->mem, &r->seq[s], done[s]);
        v[s] = (kn_seq_view){.block_table = r->seq[s].blocks, .n_ctx = done[s]};
    }
    kn_batch b = {.n_tokens = n,
                  .n_solo = solo,
                  .tokens = t,
                  .pos = pos,
                  .seq_of = so,
                  .n_seqs = 3,
                  .seqs = v,
                  .n_logits = nl,
                  .logit_rows = rows};
    return rc ? rc : kn_engine_forward(r->eng, kn_kv_mem_pool(r->mem), &b, lg);
}

/* The steps: prefill 37 tokens (dot path) then 90 (gemm path) then decode rows (solo) and a
 * step of 2 decode rows with 20 prompt rows of a third sequence. */
static int run(rig *r, float *lg, int *n_rows)
{
    const int nv = model->hp.n_vocab;
    int done[3] = {0, 0, 0}, rc = 0, k = 0;
    const int plan[][4] = {{37, 0, 0, 0}, {0, 90, 0, 0}, {1, 1, 0, 2},
                           {1, 1, 0, 2},  {1, 1, 20, 2}, {1, 1, 1, 3}};
    for (size_t i = 0; i < sizeof plan / sizeof *plan && !rc; i++) {
        rc = step(r, plan[i], plan[i][3], done, lg + (size_t)k * nv);
        for (int s = 0; s < 3; s++)
            k += plan[i][s] > 0;
    }
    *n_rows = k;
    return rc;
}

static void test_engine_fused_equals_unfused(void)
{
    const int nv = model->hp.n_vocab;
    const size_t n = (size_t)32 * nv;
    float *a = calloc(n, 4), *b = calloc(n, 4);
    rig r1, r2;
    TH_REQUIRE(rig_open(&r1, "1", 0) == 0);
    TH_REQUIRE(rig_open(&r2, "0", 0) == 0);
    TH_CHECK(kn_cpu_fused(kn_cpu_of(r1.be)) && !kn_cpu_fused(kn_cpu_of(r2.be)));
    TH_CHECK(r1.be.ops->matmul_multi && r1.be.ops->glu_ffn && r1.be.ops->matmul_add);
    TH_CHECK(!r2.be.ops->matmul_multi && !r2.be.ops->glu_ffn && !r2.be.ops->matmul_add);
    int na = 0, nb = 0;
    TH_CHECK(run(&r1, a, &na) == 0);
    TH_CHECK(run(&r2, b, &nb) == 0);
    TH_CHECK(na == nb && na > 0);
    TH_CHECKF(!memcmp(a, b, (size_t)na * nv * 4), "fused logits differ from unfused");
    rig_close(&r1);
    rig_close(&r2);
    free(a);
    free(b);
    /* a bad knob is an error, not silently ignored */
    setenv("TANDEM_CPU_FUSED", "yes", 1);
    kn_backend be;
    TH_CHECK(kn_backend_create("cpu", NULL, &be) == TD_EINVAL);
    unsetenv("TANDEM_CPU_FUSED");
}

/* Whether the model has a matrix the q8 GEMM packs (on this CPU). */
static bool model_has_packable(void)
{
    if (model->last && kn_q8_packed_bytes(&model->output)) return true;
    for (int li = 0; li < model->shard.l1 - model->shard.l0; li++) {
        const kn_layer *ly = &model->layers[li];
        const kn_mat *mats[] = {&ly->wq,     &ly->wk,   &ly->wv,    &ly->wo,
                                &ly->w_gate, &ly->w_up, &ly->w_down};
        for (size_t i = 0; i < sizeof mats / sizeof *mats; i++)
            if (mats[i]->data && kn_q8_packed_bytes(mats[i])) return true;
    }
    return false;
}

/* The q8 (q16) mode through the engine, which names its weights to the backend (map_matrix): the
 * integer GEMM (dots) read packed copies of the Q4_0, Q4_1, Q5_0 and Q8_0 matrices and must give
 * the logits of per-call packing (unpacked rows: the same engine on a table without map_matrix)
 * and, fused, those of the unfused ops (TANDEM_CPU_FUSED=0). */
static void check_engine_packed(int q16)
{
    const int nv = model->hp.n_vocab;
    const size_t n = (size_t)32 * nv;
    float *a = calloc(n, 4), *b = calloc(n, 4);
    rig r1, r2;
    TH_REQUIRE(a && b && rig_open(&r1, "1", 1 + 2 * q16) == 0 &&
               rig_open(&r2, "1", 2 + 2 * q16) == 0);
    int na = 0, nb = 0;
    TH_CHECK(run(&r1, a, &na) == 0);
    TH_CHECK(run(&r2, b, &nb) == 0);
    TH_CHECK(na == nb && na > 0);
    TH_CHECKF(!memcmp(a, b, (size_t)na * nv * 4), "q%d logits with packed weights differ",
              q16 ? 16 : 8);
    /* and the fused ops on packed weights (decode rows) give the unfused sequence's logits */
    rig r3;
    int nc = 0;
    TH_REQUIRE(rig_open(&r3, "0", 1 + 2 * q16) == 0);
    TH_CHECK(run(&r3, b, &nc) == 0);
    TH_CHECK(nc == na);
    TH_CHECKF(!memcmp(a, b, (size_t)na * nv * 4), "q%d fused logits differ from unfused",
              q16 ? 16 : 8);
    rig_close(&r3);
    const size_t packed = kn_cpu_packed_bytes(kn_cpu_of(r1.be));
    fprintf(stderr, "%s mode: %zu bytes of packed weights (%s)\n", q16 ? "q16" : "q8", packed,
            q16 ? kn_q16_isa() : kn_q8_gemm_isa());
    TH_CHECK(kn_q8_gemm_group_rows() != 16 || packed > 0 || !model_has_packable());
    rig_close(&r1);
    rig_close(&r2);
    free(a);
    free(b);
}

static void test_engine_q8_packed(void)
{
    check_engine_packed(0);
}

static void test_engine_q16_packed(void)
{
    check_engine_packed(1);
}

int main(int argc, char **argv)
{
    if (kt_cpus_create(cpus)) return 1;
    TH_RUN(test_multi);
    TH_RUN(test_glu);
    TH_RUN(test_add);
    TH_RUN(test_experts);
    TH_RUN(test_errors);
    kt_cpus_destroy(cpus);
    TH_RUN(test_packed);
    if (argc > 1) {
        td_gguf *g;
        if (kt_open_model(argv[1], &g, &model)) return 1;
        TH_RUN(test_engine_fused_equals_unfused);
        TH_RUN(test_engine_q8_packed);
        TH_RUN(test_engine_q16_packed);
        kn_model_destroy(model);
        td_gguf_close(g);
    }
    TH_EXIT();
}
