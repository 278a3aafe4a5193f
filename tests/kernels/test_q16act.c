/* test_q16act.c: the CPU backend's 16-bit activation mode (KN_CPU_ACT_Q16, cpu_q16act.c) for
 * Q4_0, Q4_1, Q5_0 and Q8_0 weights: the quantization of x and its byte planes, the dots against
 * a float64 reference of the same quantized math (the integer part exact, the float part within
 * its rounding) and against float64 of the unquantized x (within the bound the rounding of x to
 * 16 bits allows), the same bits for 1, 2 and 3 threads, for each row alone, for partial groups
 * of rows and any row range, with the weights packed (map_matrix) or not, and with the AVX2 and
 * scalar forms forced; matmul_mixed's batch rows and the other weight types keep the float32
 * bits; the fused dot path (kn_cpu_dot_init) agrees; TANDEM_CPU_ACT and the mode's names. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "cpu_bf16amx.h"
#include "cpu_internal.h"
#include "cpu_q16act.h"
#include "cpu_q8act.h"
#include "kn_test_util.h"
#include "td_dtype.h"
#include "td_err.h"
#include "tharness.h"

static const td_dtype qtypes[] = {TD_Q4_0, TD_Q4_1, TD_Q5_0, TD_Q8_0};
#define N_QTYPES 4

static uint64_t rng = 0x2545f4914f6cdd1dull;

typedef struct {
    uint8_t *buf;
    kn_mat w;
    int *q; /* (n_rows, n_cols) the signed quants w_q (Q4_0 q - 8, Q4_1 q, Q5_0 q - 16, Q8_0 q) */
    double *wf; /* (n_rows, n_cols) the weights dequantized in float64 */
} q_mat;

/* Random blocks (weights of magnitude ~1, d of both signs, Q4_1 mins >= 0); rows one block
 * apart, gaps 0xff. */
static int make_mat(td_dtype t, int64_t n_rows, int64_t n_cols, q_mat *m)
{
    const size_t bs = td_dtype_get((uint32_t)t)->type_size, rb = td_dtype_row_bytes(t, n_cols),
                 stride = rb + bs;
    const int64_t nb = n_cols / 32;
    m->buf = malloc(stride * (size_t)n_rows);
    m->q = malloc((size_t)(n_rows * n_cols) * sizeof(int));
    m->wf = malloc((size_t)(n_rows * n_cols) * sizeof(double));
    if (!m->buf || !m->q || !m->wf) return -1;
    memset(m->buf, 0xff, stride * (size_t)n_rows);
    const float wmax = t == TD_Q4_0 ? 8 : t == TD_Q4_1 ? 15 : t == TD_Q5_0 ? 16 : 128;
    for (int64_t r = 0; r < n_rows; r++) {
        uint8_t *p = m->buf + (size_t)r * stride;
        for (size_t i = 0; i < rb; i++)
            p[i] = (uint8_t)kt_u32(&rng);
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = p + (size_t)b * bs;
            const float d = kt_uniform(&rng, 0.25f, 1.0f) / wmax;
            kt_put_f16(blk, t != TD_Q4_1 && (kt_u32(&rng) & 1) ? -d : d);
            if (t == TD_Q4_1) kt_put_f16(blk + 2, kt_uniform(&rng, 0.0f, 1.0f) / 63);
            const float dd = kt_get_f16(blk), mm = t == TD_Q4_1 ? kt_get_f16(blk + 2) : 0.0f;
            uint32_t qh = 0;
            if (t == TD_Q5_0) memcpy(&qh, blk + 2, 4);
            const uint8_t *qs = blk + (t == TD_Q4_1 ? 4 : t == TD_Q5_0 ? 6 : 2);
            for (int e = 0; e < 32; e++) {
                int q;
                if (t == TD_Q8_0) {
                    q = (int8_t)qs[e];
                } else {
                    q = e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
                    if (t == TD_Q5_0) q = (q | (int)((qh >> e) & 1) << 4) - 16;
                    if (t == TD_Q4_0) q -= 8;
                }
                const int64_t k = r * n_cols + b * 32 + e;
                m->q[k] = q;
                m->wf[k] = (double)dd * q + (double)mm;
            }
        }
    }
    m->w = (kn_mat){
        .type = t, .n_rows = n_rows, .n_cols = n_cols, .row_stride = stride, .data = m->buf};
    return 0;
}

static void free_mat(q_mat *m)
{
    free(m->buf);
    free(m->q);
    free(m->wf);
}

/* |x - d q| / d at most: a half, plus the roundings of 32767 / max|x|, of x times it and of d
 * (each 2^-24 relative, on q of up to 2^15). */
#define Q16_XERR (0.5 + 0x1p-7)

/* xd, q (m, n): the scale and the quant of every element of xq; checks the rule (|q| <= 32512,
 * |x - d q| <= d / 2 up to the float rounding of x / d, q = 256 hi + lo with lo in [-128, 127],
 * the sums). Returns the failures. */
static int64_t unpack_x(const float *x, const kn_q16b *xq, int64_t m, int64_t n, double *xd, int *q)
{
    int64_t fails = 0;
    for (int64_t b = 0; b < m * n / 32; b++) {
        int sum = 0;
        float amax = 0.0f;
        for (int k = 0; k < 32; k++)
            amax = fabsf(x[b * 32 + k]) > amax ? fabsf(x[b * 32 + k]) : amax;
        const float id = (float)KN_Q16_QMAX / amax;
        for (int k = 0; k < 32; k++) {
            const int64_t e = b * 32 + k;
            xd[e] = xq[b].d;
            q[e] = xq[b].qs[k];
            sum += q[e];
            /* the rule exactly (every form of the quantizer gives these bits): nearest even
             * of x times the float QMAX / amax, a block of zeros when that overflows */
            const float v = isinf(id) ? 0.0f : nearbyintf(x[e] * id);
            if (q[e] != (int)fmaxf(-KN_Q16_QMAX, fminf(KN_Q16_QMAX, v)) ||
                xq[b].d != (isinf(id) ? 0.0f : amax / (float)KN_Q16_QMAX) || q[e] < -KN_Q16_QMAX ||
                q[e] > KN_Q16_QMAX ||
                (!isinf(id) && fabs((double)x[e] - (double)xq[b].d * q[e]) > xq[b].d * Q16_XERR) ||
                q[e] != 256 * xq[b].hi[k] + xq[b].lo[k])
                fails++;
        }
        fails += sum != xq[b].sum || xq[b].dsum != xq[b].d * (float)sum;
    }
    return fails;
}

static kn_cpu *cpus[3]; /* 1, 2 and 3 threads */

static int matmul_act(kn_cpu *c, kn_cpu_act_mode a, const kn_mat *w, const float *x, int64_t m,
                      int64_t solo, float *y)
{
    kn_cpu_set_act(c, a);
    int rc = kn_cpu_matmul_mixed(c, w, x, m, solo, y);
    kn_cpu_set_act(c, KN_CPU_ACT_F32);
    return rc;
}

/* y against float64: yq, the same quantized math (integer dots exact, the float part's rounding
 * only) and yx, the weights against the unquantized x (plus the rounding of x to 16 bits).
 * Returns the largest error of y against yx relative to sum |w x|. */
static double check_bounds(td_dtype t, const q_mat *W, const float *x, const double *xd,
                           const int *q, const float *y, int64_t m)
{
    const int64_t n = W->w.n_cols, nb = n / 32, rows = W->w.n_rows;
    const size_t bs = td_dtype_get((uint32_t)t)->type_size;
    double worst = 0;
    int64_t fails = 0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *row = W->buf + (size_t)r * W->w.row_stride;
            double yq = 0, yx = 0, mag = 0, xerr = 0;
            for (int64_t b = 0; b < nb; b++) {
                const double dw = kt_get_f16(row + (size_t)b * bs),
                             mw = t == TD_Q4_1 ? kt_get_f16(row + (size_t)b * bs + 2) : 0;
                const double dx = xd[i * n + b * 32];
                int64_t s = 0, sx = 0;
                for (int e = 0; e < 32; e++) {
                    const int64_t k = i * n + b * 32 + e, kw = r * n + b * 32 + e;
                    s += (int64_t)W->q[kw] * q[k];
                    sx += q[k];
                    yx += W->wf[kw] * x[k];
                    mag += fabs(W->wf[kw] * x[k]) + fabs(W->wf[kw]) * dx;
                    xerr += fabs(W->wf[kw]) * dx * Q16_XERR;
                }
                yq += dw * dx * (double)s + mw * dx * (double)sx;
            }
            const double yv = y[i * rows + r];
            /* float part: (float)s, d_w * d_x and two fmas per block, each rounded once */
            const double fb = (double)(4 * nb + 8) * 0x1p-24 * mag;
            if (!(fabs(yv - yq) <= fb) || !(fabs(yv - yx) <= fb + xerr)) {
                if (fails++ < 5)
                    fprintf(stderr, "%s row %lld x %lld: y %.9g, quantized math %.9g, exact %.9g\n",
                            td_dtype_name(t), (long long)r, (long long)i, yv, yq, yx);
            }
            if (mag > 0 && fabs(yv - yx) / mag > worst) worst = fabs(yv - yx) / mag;
        }
    TH_CHECKF(fails == 0, "%s: %lld dots out of bounds", td_dtype_name(t), (long long)fails);
    return worst;
}

static void check_type(td_dtype t, int64_t n_rows, int64_t n_cols, int64_t m)
{
    q_mat W;
    TH_REQUIRE(make_mat(t, n_rows, n_cols, &W) == 0);
    const size_t ny = (size_t)(m * n_rows) * sizeof(float);
    float *x = kt_act_x(&rng, m, n_cols, true), *y = malloc(ny), *yt = malloc(ny);
    kn_q16b *xq = malloc((size_t)m * kn_q16_row_bytes(n_cols));
    double *xd = malloc((size_t)(m * n_cols) * sizeof(double));
    int *q = malloc((size_t)(m * n_cols) * sizeof(int));
    TH_REQUIRE(x && y && yt && xq && xd && q);
    TH_CHECK(kn_q16_supported(t));
    kn_q16_quant_rows(x, m, n_cols, xq);
    TH_CHECK(unpack_x(x, xq, m, n_cols, xd, q) == 0);
    TH_REQUIRE(matmul_act(cpus[0], KN_CPU_ACT_Q16, &W.w, x, m, 0, y) == 0);
    const double worst = check_bounds(t, &W, x, xd, q, y, m);
    /* a sanity figure beside the bounds: |y - exact| / sum |w x| is ~2e-5 here (q8's 8-bit
     * rounding: ~5e-3); a few blocks (n 96) leave less averaging, so the margin */
    TH_CHECKF(worst < 5e-4, "%s: relative error %.3g", td_dtype_name(t), worst);
    /* thread counts, each row alone */
    for (int k = 1; k < 3; k++) {
        TH_REQUIRE(matmul_act(cpus[k], KN_CPU_ACT_Q16, &W.w, x, m, 0, yt) == 0);
        TH_CHECK(memcmp(y, yt, ny) == 0);
    }
    for (int64_t i = 0; i < m; i++) {
        TH_REQUIRE(matmul_act(cpus[1], KN_CPU_ACT_Q16, &W.w, x + i * n_cols, 1, 0, yt) == 0);
        TH_CHECK(memcmp(y + i * n_rows, yt, (size_t)n_rows * sizeof(float)) == 0);
    }
    /* the AVX2 and scalar forms */
    static const char *const forms[] = {"avx2", "scalar"};
    for (int f = 0; f < 2; f++) {
        kn_q16_force_isa(forms[f]);
        TH_REQUIRE(matmul_act(cpus[1], KN_CPU_ACT_Q16, &W.w, x, m, 0, yt) == 0);
        const char *isa = kn_q16_isa();
        kn_q16_force_isa(NULL);
        TH_CHECKF(memcmp(y, yt, ny) == 0, "%s m %lld: %s and %s differ", td_dtype_name(t),
                  (long long)m, isa, kn_q16_isa());
    }
    /* any row range, packed or not: the same bits */
    const size_t pbytes = kn_q8_gemm_packed_bytes(&W.w);
    void *packed = pbytes ? aligned_alloc(64, (pbytes + 63) & ~(size_t)63) : NULL;
    if (packed) kn_q8_gemm_pack(&W.w, packed, 0, (n_rows + 15) / 16);
    for (int pk = 0; pk < 2; pk++) {
        const int64_t cuts[] = {0, 5, 16, 17, 30, n_rows};
        memset(yt, 0xff, ny);
        for (int c = 0; c + 1 < 6; c++) {
            const int64_t a = cuts[c] < n_rows ? cuts[c] : n_rows,
                          b = cuts[c + 1] < n_rows ? cuts[c + 1] : n_rows;
            if (a < b) kn_q16_dot(&W.w, pk ? packed : NULL, xq, m, yt, a, b);
        }
        TH_CHECKF(memcmp(y, yt, ny) == 0, "%s m %lld: row ranges (packed %d) change the bits",
                  td_dtype_name(t), (long long)m, pk);
        if (!packed) break;
    }
    free(packed);
    /* W registered as the engine registers its weights: the q8 packed copy, the same bits; a
     * view of fewer rows at the same address was never registered (raw rows) */
    kn_cpu *pc;
    TH_REQUIRE(kn_cpu_create(2, &pc) == 0);
    TH_REQUIRE(kn_cpu_map_matrix(pc, &W.w) == 0);
    TH_REQUIRE(matmul_act(pc, KN_CPU_ACT_Q16, &W.w, x, m, 0, yt) == 0);
    TH_CHECK(kn_cpu_packed_bytes(pc) == kn_q8_gemm_packed_bytes(&W.w));
    TH_CHECKF(memcmp(y, yt, ny) == 0, "%s m %lld: the packed weights change the bits",
              td_dtype_name(t), (long long)m);
    if (n_rows > 3) {
        kn_mat v = W.w;
        v.n_rows = n_rows - 3;
        TH_REQUIRE(matmul_act(pc, KN_CPU_ACT_Q16, &v, x, m, 0, yt) == 0);
        int64_t diff = 0;
        for (int64_t i = 0; i < m; i++)
            diff +=
                memcmp(y + i * n_rows, yt + i * v.n_rows, (size_t)v.n_rows * sizeof(float)) != 0;
        TH_CHECK(diff == 0);
    }
    /* the fused ops' dot path in pieces: the same bits, packed (grain 16) or not */
    for (int k = 0; k < 2; k++) {
        kn_cpu *c = k ? pc : cpus[1];
        kn_cpu_set_act(c, KN_CPU_ACT_Q16);
        float *side = malloc(kn_cpu_dot_side_floats(c, &W.w, m) * sizeof(float) + 64);
        kn_cpu_dot d;
        TH_REQUIRE(side && kn_cpu_dot_init(c, &W.w, x, m, m, side, yt, &d) == 0);
        TH_CHECK(d.xq16 && d.grain == (k && pbytes ? 16 : 1));
        memset(yt, 0xff, ny);
        for (int64_t r = 0; r < n_rows; r += 16)
            kn_cpu_dot_rows(&d, r, r + 16 < n_rows ? r + 16 : n_rows);
        kn_cpu_set_act(c, KN_CPU_ACT_F32);
        TH_CHECK(memcmp(y, yt, ny) == 0);
        free(side);
    }
    kn_cpu_destroy(pc);
    fprintf(stderr, "  %s %lld x %lld, m %lld: relative error %.2e\n", td_dtype_name(t),
            (long long)n_rows, (long long)n_cols, (long long)m, worst);
    free(x), free(y), free(yt), free(xq), free(xd), free(q);
    free_mat(&W);
}

static void test_q16_dots(void)
{
    for (int k = 0; k < N_QTYPES; k++) {
        static const int64_t ms[] = {1, 2, 3, 5, 8, 33};
        for (int i = 0; i < 6; i++)
            check_type(qtypes[k], 37, 5 * 256, ms[i]);
        check_type(qtypes[k], 9, 96, 4);
        check_type(qtypes[k], 16, 32, 1);
    }
}

/* The quantizer at its edges: ties round to even (x times 1.0 exactly .5), the clamps and
 * negative byte planes (q = -129: hi -1, lo 127), and blocks so small that QMAX / amax
 * overflows: zeros with d 0, not NaN. */
static void test_quant_edges(void)
{
    float x[96] = {0};
    x[0] = (float)KN_Q16_QMAX; /* id = 1 */
    const float ties[] = {2.5f, -3.5f, 0.5f, 1.5f, -129.0f, -32512.0f, -0.5f, 255.5f};
    const int want[] = {2, -4, 0, 2, -129, -32512, 0, 256};
    for (int k = 0; k < 8; k++)
        x[1 + k] = ties[k];
    for (int k = 0; k < 32; k++) /* the second block: subnormal and tiny */
        x[32 + k] = k % 2 ? 1e-40f : -3e-36f;
    for (int k = 0; k < 32; k++) /* the third: one element at the overflow's edge, a zero */
        x[64 + k] = k == 5 ? 1e-33f : k == 6 ? 0.0f : 1e-35f;
    kn_q16b b[3], bs[3];
    double xd[96];
    int q[96];
    kn_q16_force_isa("scalar"); /* the quantizer's scalar form: the same bytes */
    kn_q16_quant_rows(x, 1, 96, bs);
    kn_q16_force_isa(NULL);
    kn_q16_quant_rows(x, 1, 96, b);
    TH_CHECK(memcmp(b, bs, sizeof b) == 0);
    TH_CHECK(unpack_x(x, b, 1, 96, xd, q) == 0);
    for (int k = 0; k < 8; k++)
        TH_CHECKF(b[0].qs[1 + k] == want[k], "x %g: q %d, want %d", (double)ties[k], b[0].qs[1 + k],
                  want[k]);
    TH_CHECK(b[0].hi[5] == -1 && b[0].lo[5] == 127);
    TH_CHECK(b[1].d == 0.0f && b[1].sum == 0 && b[1].dsum == 0.0f);
    for (int k = 0; k < 32; k++)
        TH_CHECK(b[1].qs[k] == 0 && b[1].hi[k] == 0 && b[1].lo[k] == 0);
    TH_CHECK(b[2].d > 0.0f && b[2].qs[5] == KN_Q16_QMAX && b[2].qs[6] == 0);
}

/* A block with a non-finite element: that row's products are NaN, the others finite. */
static void test_nonfinite(void)
{
    q_mat W;
    TH_REQUIRE(make_mat(TD_Q4_1, 20, 128, &W) == 0);
    float *x = kt_act_x(&rng, 2, 128, true), y[40];
    TH_REQUIRE(x);
    x[128 + 40] = INFINITY;
    TH_REQUIRE(matmul_act(cpus[1], KN_CPU_ACT_Q16, &W.w, x, 2, 0, y) == 0);
    for (int r = 0; r < 20; r++)
        TH_CHECK(isfinite(y[r]) && isnan(y[20 + r]));
    free(x);
    free_mat(&W);
}

/* matmul_mixed with m - solo >= 64 batch rows: the solo rows get the q16 bits of each row alone,
 * the batch rows the float32 gemm path's where one runs them (AMX-BF16, or no AVX512-VNNI),
 * else the q16 bits of each row alone too (cpu_matmul.c, mm_gemm_rows); types without q16 dots
 * (Q5_1, Q4_K) keep the float32 bits everywhere. */
static void test_mixed_and_others(void)
{
    const td_dtype types[] = {TD_Q4_1, TD_Q8_0, TD_Q5_1, TD_Q4_K};
    for (int k = 0; k < 4; k++) {
        const td_dtype t = types[k];
        const int64_t n_rows = 24, n_cols = 512, m = 70, solo = 3;
        const size_t rb = td_dtype_row_bytes(t, n_cols), ny = (size_t)(m * n_rows) * sizeof(float);
        q_mat W = {0};
        if (kn_q16_supported(t)) {
            TH_REQUIRE(make_mat(t, n_rows, n_cols, &W) == 0);
        } else {
            /* random quants, every half-float scale 0.01 (d, dmin and Q5_1's m) */
            W.buf = malloc(rb * (size_t)n_rows);
            TH_REQUIRE(W.buf);
            for (size_t i = 0; i < rb * (size_t)n_rows; i++)
                W.buf[i] = (uint8_t)kt_u32(&rng);
            const size_t bs = td_dtype_get((uint32_t)t)->type_size;
            for (size_t b = 0; b < rb * (size_t)n_rows / bs; b++)
                kt_put_f16(W.buf + bs * b, 0.01f), kt_put_f16(W.buf + bs * b + 2, 0.01f);
            W.w = (kn_mat){
                .type = t, .n_rows = n_rows, .n_cols = n_cols, .row_stride = rb, .data = W.buf};
        }
        float *x = kt_act_x(&rng, m, n_cols, true), *y = malloc(ny), *y32 = malloc(ny);
        float *y1 = malloc((size_t)n_rows * sizeof(float));
        TH_REQUIRE(x && y && y32 && y1);
        TH_REQUIRE(matmul_act(cpus[1], KN_CPU_ACT_Q16, &W.w, x, m, solo, y) == 0);
        TH_REQUIRE(matmul_act(cpus[2], KN_CPU_ACT_F32, &W.w, x, m, solo, y32) == 0);
        const bool q16 = kn_q16_supported(t);
        TH_CHECK(q16 == (t == TD_Q4_1 || t == TD_Q8_0));
        const char *batch, *solo_path;
        kn_cpu_set_act(cpus[1], KN_CPU_ACT_Q16);
        kn_cpu_matmul_paths(cpus[1], &W.w, &batch, &solo_path);
        kn_cpu_set_act(cpus[1], KN_CPU_ACT_F32);
        const bool batch_q16 = !strncmp(batch, "q16", 3);
        TH_CHECKF(!batch_q16 || (q16 && !kn_bf16amx_usable()), "batch rows by %s", batch);
        for (int64_t i = 0; i < (batch_q16 ? m : solo); i++) {
            TH_REQUIRE(matmul_act(cpus[0], KN_CPU_ACT_Q16, &W.w, x + i * n_cols, 1, 0, y1) == 0);
            TH_CHECK(memcmp(y + i * n_rows, y1, (size_t)n_rows * sizeof(float)) == 0);
        }
        const size_t nsolo = (size_t)(solo * n_rows) * sizeof(float);
        TH_CHECK(batch_q16 == !!memcmp((char *)y + nsolo, (char *)y32 + nsolo, ny - nsolo));
        TH_CHECK(q16 == !!memcmp(y, y32, nsolo));
        free(x), free(y), free(y32), free(y1);
        if (q16)
            free_mat(&W);
        else
            free(W.buf);
    }
}

static void test_env_and_names(void)
{
    kn_cpu *c = NULL;
    kn_cpu_act_mode a;
    TH_CHECK(kn_cpu_act_parse("q16", &a) == 0 && a == KN_CPU_ACT_Q16);
    TH_CHECK(kn_cpu_act_parse("q8", &a) == 0 && a == KN_CPU_ACT_Q8);
    TH_CHECK(kn_cpu_act_parse("f32", &a) == 0 && a == KN_CPU_ACT_F32);
    TH_CHECK(kn_cpu_act_parse("q4", &a) == TD_EINVAL && kn_cpu_act_parse(NULL, &a) == TD_EINVAL);
    TH_CHECK(!strcmp(kn_cpu_act_name(KN_CPU_ACT_Q16), "q16"));
    TH_REQUIRE(setenv("TANDEM_CPU_ACT", "q16", 1) == 0);
    TH_REQUIRE(kn_cpu_create(1, &c) == 0);
    TH_CHECK(kn_cpu_act(c) == KN_CPU_ACT_Q16 && !kn_cpu_act_q8(c));
    kn_cpu_set_act_q8(c, true);
    TH_CHECK(kn_cpu_act(c) == KN_CPU_ACT_Q8);
    kn_cpu_set_act_q8(c, false);
    TH_CHECK(kn_cpu_act(c) == KN_CPU_ACT_F32);
    kn_cpu_destroy(c);
    TH_REQUIRE(setenv("TANDEM_CPU_ACT", "q17", 1) == 0);
    c = NULL;
    TH_CHECK(kn_cpu_create(1, &c) == TD_EINVAL && c == NULL);
    unsetenv("TANDEM_CPU_ACT");
}

int main(void)
{
    unsetenv("TANDEM_CPU_ACT");
    if (kt_cpus_create(cpus)) return 1;
    fprintf(stderr, "isa %s, q16 dots %s (weights packed: %s)\n", kn_cpu_isa(), kn_q16_isa(),
            kn_q8_gemm_group_rows() == 16 ? "yes" : "no, not AVX512-VNNI");
    TH_RUN(test_q16_dots);
    TH_RUN(test_quant_edges);
    TH_RUN(test_nonfinite);
    TH_RUN(test_mixed_and_others);
    TH_RUN(test_env_and_names);
    kt_cpus_destroy(cpus);
    TH_EXIT();
}
