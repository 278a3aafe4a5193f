/* test_matmul.c: the CPU backend's dequantizers, matmul (both paths) and get_rows against
 * naive references, for every supported weight type, odd shapes, strided row-slice
 * views and 1, 2 and 3 threads; matmul_mixed's solo rows bit for bit against each row
 * alone. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "kn_test_util.h"
#include "td_dtype.h"
#include "td_err.h"
#include "tharness.h"

static const td_dtype all_types[] = {TD_F32,  TD_F16,  TD_BF16, TD_Q8_0,
                                     TD_Q4_0, TD_Q4_1, TD_Q5_0, TD_Q5_1};
#define N_TYPES (int)(sizeof all_types / sizeof all_types[0])

static uint64_t rng = 0x9e3779b97f4a7c15ull;

/* ---- reference quantizers, after ggml's quantize_row_*_ref ---- */

static void quantize_q8_0(const float *x, td_block_q8_0 *y, int64_t n)
{
    for (int64_t b = 0; b < n / TD_QK; b++, x += TD_QK) {
        float amax = 0.0f;
        for (int j = 0; j < TD_QK; j++)
            amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
        y[b].d = td_fp32_to_fp16(d);
        for (int j = 0; j < TD_QK; j++)
            y[b].qs[j] = (int8_t)roundf(x[j] * id);
    }
}

static void quantize_q4_0(const float *x, td_block_q4_0 *y, int64_t n)
{
    for (int64_t b = 0; b < n / TD_QK; b++, x += TD_QK) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < TD_QK; j++)
            if (amax < fabsf(x[j])) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        const float d = max / -8.0f, id = d ? 1.0f / d : 0.0f;
        y[b].d = td_fp32_to_fp16(d);
        for (int j = 0; j < TD_QK / 2; j++) {
            int x0 = (int8_t)(x[j] * id + 8.5f), x1 = (int8_t)(x[j + TD_QK / 2] * id + 8.5f);
            x0 = x0 < 15 ? x0 : 15;
            x1 = x1 < 15 ? x1 : 15;
            y[b].qs[j] = (uint8_t)(x0 | (x1 << 4));
        }
    }
}

static void quantize_q4_1(const float *x, td_block_q4_1 *y, int64_t n)
{
    for (int64_t b = 0; b < n / TD_QK; b++, x += TD_QK) {
        float min = INFINITY, max = -INFINITY;
        for (int j = 0; j < TD_QK; j++) {
            min = fminf(min, x[j]);
            max = fmaxf(max, x[j]);
        }
        const float d = (max - min) / 15.0f, id = d ? 1.0f / d : 0.0f;
        y[b].d = td_fp32_to_fp16(d);
        y[b].m = td_fp32_to_fp16(min);
        for (int j = 0; j < TD_QK / 2; j++) {
            int x0 = (int8_t)((x[j] - min) * id + 0.5f);
            int x1 = (int8_t)((x[j + TD_QK / 2] - min) * id + 0.5f);
            x0 = x0 < 15 ? x0 : 15;
            x1 = x1 < 15 ? x1 : 15;
            y[b].qs[j] = (uint8_t)(x0 | (x1 << 4));
        }
    }
}

/* Q5_0/Q5_1 store 5-bit quants as a nibble in qs and the 5th bit in bit j of qh. */
static void pack_q5(const int q[TD_QK], uint8_t qh_out[4], uint8_t qs[TD_QK / 2])
{
    uint32_t qh = 0;
    for (int j = 0; j < TD_QK / 2; j++) {
        qs[j] = (uint8_t)((q[j] & 0x0f) | ((q[j + TD_QK / 2] & 0x0f) << 4));
        qh |= (uint32_t)((q[j] & 0x10) >> 4) << j;
        qh |= (uint32_t)((q[j + TD_QK / 2] & 0x10) >> 4) << (j + TD_QK / 2);
    }
    memcpy(qh_out, &qh, 4);
}

static void quantize_q5_0(const float *x, td_block_q5_0 *y, int64_t n)
{
    for (int64_t b = 0; b < n / TD_QK; b++, x += TD_QK) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < TD_QK; j++)
            if (amax < fabsf(x[j])) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        const float d = max / -16.0f, id = d ? 1.0f / d : 0.0f;
        y[b].d = td_fp32_to_fp16(d);
        int q[TD_QK];
        for (int j = 0; j < TD_QK; j++) {
            int v = (int8_t)(x[j] * id + 16.5f);
            q[j] = v < 31 ? v : 31;
        }
        pack_q5(q, y[b].qh, y[b].qs);
    }
}

static void quantize_q5_1(const float *x, td_block_q5_1 *y, int64_t n)
{
    for (int64_t b = 0; b < n / TD_QK; b++, x += TD_QK) {
        float min = INFINITY, max = -INFINITY;
        for (int j = 0; j < TD_QK; j++) {
            min = fminf(min, x[j]);
            max = fmaxf(max, x[j]);
        }
        const float d = (max - min) / 31.0f, id = d ? 1.0f / d : 0.0f;
        y[b].d = td_fp32_to_fp16(d);
        y[b].m = td_fp32_to_fp16(min);
        int q[TD_QK];
        for (int j = 0; j < TD_QK; j++) {
            int v = (uint8_t)((x[j] - min) * id + 0.5f);
            q[j] = v < 31 ? v : 31;
        }
        pack_q5(q, y[b].qh, y[b].qs);
    }
}

/* Quantizes n elements in chunks of 64 blocks through a stack buffer of blocks of type B. */
#define QUANTIZE_CHUNKED(B, fn)                                                                    \
    do {                                                                                           \
        B tmp[64];                                                                                 \
        for (int64_t i = 0; i < n; i += 64 * TD_QK) {                                              \
            int64_t k = n - i < 64 * TD_QK ? n - i : 64 * TD_QK;                                   \
            fn(x + i, tmp, k);                                                                     \
            memcpy((uint8_t *)dst + i / TD_QK * sizeof *tmp, tmp,                                  \
                   (size_t)k / TD_QK * sizeof *tmp);                                               \
        }                                                                                          \
    } while (0)

/* dst (row bytes of n elements of t) = x (n) stored as t. */
static void quantize_row(td_dtype t, const float *x, void *dst, int64_t n)
{
    switch (t) {
    case TD_F32:
        memcpy(dst, x, (size_t)n * 4);
        break;
    case TD_F16:
    case TD_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = t == TD_F16 ? td_fp32_to_fp16(x[i]) : td_fp32_to_bf16(x[i]);
            memcpy((uint8_t *)dst + 2 * i, &h, 2);
        }
        break;
    case TD_Q8_0:
        QUANTIZE_CHUNKED(td_block_q8_0, quantize_q8_0);
        break;
    case TD_Q4_0:
        QUANTIZE_CHUNKED(td_block_q4_0, quantize_q4_0);
        break;
    case TD_Q4_1:
        QUANTIZE_CHUNKED(td_block_q4_1, quantize_q4_1);
        break;
    case TD_Q5_0:
        QUANTIZE_CHUNKED(td_block_q5_0, quantize_q5_0);
        break;
    case TD_Q5_1:
        QUANTIZE_CHUNKED(td_block_q5_1, quantize_q5_1);
        break;
    default:
        break;
    }
}

/* Scalar dequantization written out the way ggml's reference does it. */
static float ref_dequant_one(td_dtype t, const uint8_t *row, int64_t i)
{
    uint16_t h, hm;
    const int64_t b = i / TD_QK, j = i % TD_QK;
    switch (t) {
    case TD_F32: {
        float f;
        memcpy(&f, row + 4 * i, 4);
        return f;
    }
    case TD_F16:
        memcpy(&h, row + 2 * i, 2);
        return td_fp16_to_fp32(h);
    case TD_BF16:
        memcpy(&h, row + 2 * i, 2);
        return td_bf16_to_fp32(h);
    case TD_Q8_0: {
        const uint8_t *blk = row + b * sizeof(td_block_q8_0);
        memcpy(&h, blk, 2);
        return (float)(int8_t)blk[2 + j] * td_fp16_to_fp32(h);
    }
    case TD_Q4_0: {
        const uint8_t *blk = row + b * sizeof(td_block_q4_0);
        memcpy(&h, blk, 2);
        int q = j < 16 ? (blk[2 + j] & 0x0f) : (blk[2 + j - 16] >> 4);
        return (float)(q - 8) * td_fp16_to_fp32(h);
    }
    case TD_Q4_1: {
        const uint8_t *blk = row + b * sizeof(td_block_q4_1);
        memcpy(&h, blk, 2);
        memcpy(&hm, blk + 2, 2);
        int q = j < 16 ? (blk[4 + j] & 0x0f) : (blk[4 + j - 16] >> 4);
        volatile float p = (float)q * td_fp16_to_fp32(h); /* rounded before the add */
        return p + td_fp16_to_fp32(hm);
    }
    case TD_Q5_0:
    case TD_Q5_1: {
        const int has_m = t == TD_Q5_1;
        const uint8_t *blk = row + b * (has_m ? sizeof(td_block_q5_1) : sizeof(td_block_q5_0));
        const uint8_t *qs = blk + (has_m ? 8 : 6);
        uint32_t qh;
        memcpy(&h, blk, 2);
        memcpy(&hm, blk + 2, 2);
        memcpy(&qh, qs - 4, 4);
        int q = (j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4)) | (int)((qh >> j) & 1) << 4;
        if (!has_m) return (float)(q - 16) * td_fp16_to_fp32(h);
        volatile float p = (float)q * td_fp16_to_fp32(h); /* rounded before the add */
        return p + td_fp16_to_fp32(hm);
    }
    default:
        return NAN;
    }
}

static size_t elem_unit(td_dtype t) /* bytes of one block (or one element) */
{
    return td_dtype_get((uint32_t)t)->type_size;
}

/* ---- dequantization ---- */

static void check_half(td_dtype t, const uint16_t *in, const uint32_t *want_bits, int n)
{
    float out[32];
    TH_REQUIRE(kn_dequant_row(t, in, out, n) == 0);
    for (int i = 0; i < n; i++)
        TH_CHECKF(td_fp32_to_bits(out[i]) == want_bits[i], "%s[%d] 0x%04x -> 0x%08x, want 0x%08x",
                  td_dtype_name(t), i, in[i], td_fp32_to_bits(out[i]), want_bits[i]);
}

static void test_dequant_known_values(void)
{
    /* 19 elements: 16 go through the SIMD loop, 3 through the tail */
    const uint16_t h[19] = {0x3c00, 0x0001, 0x03ff, 0x8000, 0x7c00, 0xfc00, 0xc000,
                            0x7bff, 0x0400, 0x3555, 0x8001, 0x0000, 0x4900, 0x3800,
                            0x3c01, 0x5640, 0x3c00, 0x0001, 0xfc00};
    const uint32_t hw[19] = {0x3f800000, 0x33800000, 0x387fc000, 0x80000000, 0x7f800000,
                             0xff800000, 0xc0000000, 0x477fe000, 0x38800000, 0x3eaaa000,
                             0xb3800000, 0x00000000, 0x41200000, 0x3f000000, 0x3f802000,
                             0x42c80000, 0x3f800000, 0x33800000, 0xff800000};
    check_half(TD_F16, h, hw, 19);
    float nan_out[1];
    const uint16_t hnan = 0x7e00;
    TH_CHECK(kn_dequant_row(TD_F16, &hnan, nan_out, 1) == 0 && isnan(nan_out[0]));

    const uint16_t b[19] = {0x3f80, 0x7f80, 0xc040, 0x0001, 0x8000, 0xff80, 0x4049,
                            0x3c00, 0x0000, 0x3f80, 0x7f7f, 0xbf80, 0x4000, 0x4080,
                            0x3e80, 0x3f00, 0x0001, 0xc040, 0x3f80};
    uint32_t bw[19];
    for (int i = 0; i < 19; i++)
        bw[i] = (uint32_t)b[i] << 16;
    check_half(TD_BF16, b, bw, 19);

    const float f[5] = {1.5f, -0.0f, 3e-40f, INFINITY, -7.25f};
    float out[5];
    TH_CHECK(kn_dequant_row(TD_F32, f, out, 5) == 0);
    TH_CHECK(memcmp(f, out, sizeof f) == 0);
}

/* Random block bytes (scales restricted to finite halves, some subnormal) against the
 * scalar formula, bit for bit. */
static void test_dequant_blocks_bit_exact(void)
{
    const td_dtype qt[] = {TD_Q8_0, TD_Q4_0, TD_Q4_1, TD_Q5_0, TD_Q5_1};
    for (int ti = 0; ti < 5; ti++) {
        const td_dtype t = qt[ti];
        const int nb = 37;
        const size_t bs = elem_unit(t);
        uint8_t *row = malloc(nb * bs);
        float *out = malloc(nb * TD_QK * sizeof *out);
        TH_REQUIRE(row && out);
        for (size_t i = 0; i < nb * bs; i++)
            row[i] = (uint8_t)kt_u32(&rng);
        for (int b = 0; b < nb; b++) {
            for (int k = 0; k < (t == TD_Q4_1 || t == TD_Q5_1 ? 2 : 1); k++) {
                uint16_t s = (uint16_t)(kt_u32(&rng) & 0x7bff); /* finite, positive */
                if (b % 5 == 1) s &= 0x03ff;                    /* subnormal */
                if (kt_u32(&rng) & 1) s |= 0x8000;
                memcpy(row + b * bs + 2 * k, &s, 2);
            }
        }
        TH_CHECK(kn_dequant_row(t, row, out, nb * TD_QK) == 0);
        int bad = 0;
        for (int i = 0; i < nb * TD_QK; i++) {
            float want = ref_dequant_one(t, row, i);
            if (td_fp32_to_bits(out[i]) != td_fp32_to_bits(want) && bad++ < 5)
                fprintf(stderr, "%s[%d] = %.9g, want %.9g\n", td_dtype_name(t), i, out[i], want);
        }
        TH_CHECKF(bad == 0, "%s: %d mismatches", td_dtype_name(t), bad);
        free(row);
        free(out);
    }
}

/* The test's quantizers are sane: round trips stay within half a quantization step. */
static void test_quantize_round_trip(void)
{
    enum { N = 4 * TD_QK };
    float x[N], y[N];
    uint8_t q[N * 4];
    for (int i = 0; i < N; i++)
        x[i] = kt_uniform(&rng, -2.0f, 2.0f);
    for (int ti = 0; ti < N_TYPES; ti++) {
        const td_dtype t = all_types[ti];
        quantize_row(t, x, q, N);
        TH_REQUIRE(kn_dequant_row(t, q, y, N) == 0);
        /* a step is 4/127 (Q8_0), 4/8 (Q4_0, extremes), 4/15 (Q4_1), 4/16 (Q5_0, extremes),
         * 4/31 (Q5_1); fp16 scales add a bit */
        float tol = t == TD_Q8_0   ? 0.017f
                    : t == TD_Q4_0 ? 0.26f
                    : t == TD_Q4_1 ? 0.14f
                    : t == TD_Q5_0 ? 0.13f
                    : t == TD_Q5_1 ? 0.07f
                                   : 0.008f;
        float worst = 0.0f;
        for (int i = 0; i < N; i++)
            worst = fmaxf(worst, fabsf(x[i] - y[i]));
        TH_CHECKF(worst <= tol, "%s: worst round-trip error %g > %g", td_dtype_name(t), worst, tol);
    }
}

/* ---- matmul ---- */

typedef struct {
    uint8_t *buf; /* whole allocation, gaps filled with NaN patterns */
    kn_mat w;
    float *deq; /* (n_rows, n_cols) kn_dequant_row of each row */
} test_mat;

/* A strided row-slice view: each row sits one block (or element) into a row of
 * row_bytes + 3 units, like a row-parallel slice of a wider matrix. */
static int make_mat(td_dtype t, int64_t n_rows, int64_t n_cols, test_mat *tm)
{
    const size_t unit = elem_unit(t), rb = td_dtype_row_bytes(t, n_cols);
    const size_t stride = rb + 3 * unit;
    tm->buf = malloc(stride * (size_t)n_rows + unit);
    tm->deq = malloc((size_t)(n_rows * n_cols) * sizeof(float));
    float *row = malloc((size_t)n_cols * sizeof(float));
    if (!tm->buf || !tm->deq || !row) return -1;
    memset(tm->buf, 0xff, stride * (size_t)n_rows + unit); /* NaN scales if read */
    for (int64_t r = 0; r < n_rows; r++) {
        const float scale = (r % 7 == 3) ? 20.0f : 1.0f; /* rows of different magnitude */
        for (int64_t i = 0; i < n_cols; i++)
            row[i] = scale * kt_uniform(&rng, -1.0f, 1.0f);
        quantize_row(t, row, tm->buf + unit + (size_t)r * stride, n_cols);
    }
    free(row);
    tm->w = (kn_mat){.type = t,
                     .n_rows = n_rows,
                     .n_cols = n_cols,
                     .row_stride = stride,
                     .data = tm->buf + unit};
    return kt_dequant_mat(&tm->w, tm->deq) ? -1 : 0;
}

static void free_mat(test_mat *tm)
{
    free(tm->buf);
    free(tm->deq);
}

static kn_cpu *cpus[3]; /* 1, 2 and 3 threads */

static void test_matmul_all(void)
{
    const int64_t ms[] = {1, 2, 3, 7, 8, 16, 33, 100};
    const int64_t rows[] = {1, 5, 67, 300};
    const int64_t cols[] = {32, 64, 576, 1536, 37};
    const int n_m = 8, n_rows = 4, n_cols = 5;
    int64_t n_fail = 0, n_cmp = 0;
    double worst = 0.0;
    for (int ti = 0; ti < N_TYPES; ti++) {
        const td_dtype t = all_types[ti];
        for (int ci = 0; ci < n_cols; ci++) {
            const int64_t k = cols[ci];
            if (k % td_dtype_get((uint32_t)t)->blck) continue; /* 37: float types only */
            for (int ri = 0; ri < n_rows; ri++) {
                const int64_t n = rows[ri];
                test_mat tm;
                TH_REQUIRE(make_mat(t, n, k, &tm) == 0);
                for (int mi = 0; mi < n_m; mi++) {
                    const int64_t m = ms[mi];
                    float *x = malloc((size_t)(m * k) * sizeof *x);
                    float *y = malloc((size_t)(m * n) * sizeof *y);
                    float *y1 = malloc((size_t)(m * n) * sizeof *y1);
                    double *ref = malloc((size_t)(m * n) * sizeof *ref);
                    double *mag = malloc((size_t)(m * n) * sizeof *mag);
                    TH_REQUIRE(x && y && y1 && ref && mag);
                    for (int64_t i = 0; i < m * k; i++)
                        x[i] = kt_uniform(&rng, -1.0f, 1.0f);
                    kt_ref_matmul(x, tm.deq, m, n, k, ref, mag);
                    for (int th = 0; th < 3; th++) {
                        for (int64_t i = 0; i < m * n; i++)
                            y[i] = NAN;
                        int rc = kn_cpu_matmul(cpus[th], &tm.w, x, m, y);
                        TH_CHECKF(rc == 0, "%s %lldx%lld m %lld: rc %d", td_dtype_name(t),
                                  (long long)n, (long long)k, (long long)m, rc);
                        for (int64_t i = 0; i < m * n; i++) {
                            double err = fabs((double)y[i] - ref[i]);
                            double tol = 1e-5 * mag[i] + 1e-30;
                            n_cmp++;
                            if (!(err <= tol)) {
                                if (n_fail++ < 10)
                                    fprintf(stderr,
                                            "%s %lldx%lld m %lld threads %d y[%lld] = %.8g, "
                                            "want %.8g (tol %.3g)\n",
                                            td_dtype_name(t), (long long)n, (long long)k,
                                            (long long)m, th + 1, (long long)i, y[i], ref[i], tol);
                            } else if (mag[i] > 0 && err / mag[i] > worst) {
                                worst = err / mag[i];
                            }
                        }
                        /* the dot path (m < 64) splits rows only, so every thread count
                         * gives the same bits */
                        if (th == 0) memcpy(y1, y, (size_t)(m * n) * sizeof *y);
                        if (th > 0 && m < 64)
                            TH_CHECKF(memcmp(y, y1, (size_t)(m * n) * sizeof *y) == 0,
                                      "%s %lldx%lld m %lld: %d threads differ from 1",
                                      td_dtype_name(t), (long long)n, (long long)k, (long long)m,
                                      th + 1);
                    }
                    /* batch invariance on the dot path: each row of x alone (m = 1) gives
                     * the same bits as inside the batch */
                    if (m > 1 && m < 64) {
                        float *yr = malloc((size_t)n * sizeof *yr);
                        TH_REQUIRE(yr);
                        for (int64_t j = 0; j < m; j++) {
                            TH_CHECK(kn_cpu_matmul(cpus[1], &tm.w, x + j * k, 1, yr) == 0);
                            TH_CHECKF(memcmp(yr, y1 + j * n, (size_t)n * sizeof *yr) == 0,
                                      "%s %lldx%lld: row %lld of a batch of %lld differs from "
                                      "the row alone",
                                      td_dtype_name(t), (long long)n, (long long)k, (long long)j,
                                      (long long)m);
                        }
                        free(yr);
                    }
                    free(x);
                    free(y);
                    free(y1);
                    free(ref);
                    free(mag);
                }
                free_mat(&tm);
            }
        }
    }
    TH_CHECKF(n_fail == 0, "%lld of %lld outputs out of tolerance", (long long)n_fail,
              (long long)n_cmp);
    fprintf(stderr, "  matmul: %lld outputs, worst |err| / sum|w x| = %.3g\n", (long long)n_cmp,
            worst);
}

/* matmul_mixed: solo rows first, then batch rows. Each solo row gives the bits of that row
 * alone (m = 1) and the batch rows those of the batch alone, whatever the mix: solo counts
 * 1, 7, 64 and 200 (past the gemm threshold) with 0, 5 (dot path) and 70, 130 (gemm path)
 * batch rows, on 1, 2 and 3 threads. */
static void test_matmul_mixed(void)
{
    const int64_t solos[] = {1, 7, 64, 200}, batches[] = {0, 5, 70, 130};
    const int64_t shapes[][2] = {{300, 576}, {67, 64}, {5, 37}};
    const int64_t max_m = 200 + 130;
    int64_t n_cmp = 0;
    for (int ti = 0; ti < N_TYPES; ti++) {
        const td_dtype t = all_types[ti];
        for (int si = 0; si < 3; si++) {
            const int64_t n = shapes[si][0], k = shapes[si][1];
            if (k % td_dtype_get((uint32_t)t)->blck) continue; /* 37: float types only */
            test_mat tm;
            TH_REQUIRE(make_mat(t, n, k, &tm) == 0);
            float *x = malloc((size_t)(max_m * k) * sizeof *x);
            float *alone = malloc((size_t)(max_m * n) * sizeof *alone); /* each row, m = 1 */
            float *y = malloc((size_t)(max_m * n) * sizeof *y);
            float *yb = malloc((size_t)(max_m * n) * sizeof *yb);
            TH_REQUIRE(x && alone && y && yb);
            for (int64_t i = 0; i < max_m * k; i++)
                x[i] = kt_uniform(&rng, -1.0f, 1.0f);
            for (int64_t j = 0; j < max_m; j++)
                TH_REQUIRE(kn_cpu_matmul(cpus[0], &tm.w, x + j * k, 1, alone + j * n) == 0);
            for (int a = 0; a < 4; a++)
                for (int b = 0; b < 4; b++) {
                    const int64_t solo = solos[a], nb = batches[b], m = solo + nb;
                    /* the batch rows are rows [200, 200 + nb) of x: the same for every solo */
                    const float *xb = x + 200 * k;
                    float *xm = malloc((size_t)(m * k) * sizeof *xm);
                    TH_REQUIRE(xm);
                    memcpy(xm, x, (size_t)(solo * k) * sizeof *xm);
                    memcpy(xm + solo * k, xb, (size_t)(nb * k) * sizeof *xm);
                    for (int th = 0; th < 3; th++) {
                        /* the gemm path's bits depend on how the threads split W's rows:
                         * compare with the batch alone on the same backend */
                        if (nb) TH_REQUIRE(kn_cpu_matmul(cpus[th], &tm.w, xb, nb, yb) == 0);
                        for (int64_t i = 0; i < m * n; i++)
                            y[i] = NAN;
                        TH_CHECK(kn_cpu_matmul_mixed(cpus[th], &tm.w, xm, m, solo, y) == 0);
                        for (int64_t j = 0; j < solo; j++, n_cmp++)
                            TH_CHECKF(memcmp(y + j * n, alone + j * n, (size_t)n * sizeof *y) == 0,
                                      "%s %lldx%lld: solo row %lld of %lld (+ %lld batch rows, "
                                      "%d threads) differs from the row alone",
                                      td_dtype_name(t), (long long)n, (long long)k, (long long)j,
                                      (long long)solo, (long long)nb, th + 1);
                        n_cmp += nb;
                        TH_CHECKF(nb == 0 ||
                                      memcmp(y + solo * n, yb, (size_t)(nb * n) * sizeof *y) == 0,
                                  "%s %lldx%lld: %lld batch rows after %lld solo rows (%d "
                                  "threads) differ from the batch alone",
                                  td_dtype_name(t), (long long)n, (long long)k, (long long)nb,
                                  (long long)solo, th + 1);
                    }
                    free(xm);
                }
            TH_CHECK(kn_cpu_matmul_mixed(cpus[0], &tm.w, x, 4, 5, y) == TD_EINVAL);
            TH_CHECK(kn_cpu_matmul_mixed(cpus[0], &tm.w, x, 4, -1, y) == TD_EINVAL);
            TH_CHECK(kn_cpu_matmul_mixed(cpus[0], &tm.w, x, 0, 0, y) == 0);
            free(x);
            free(alone);
            free(y);
            free(yb);
            free_mat(&tm);
        }
    }
    fprintf(stderr, "  matmul_mixed: %lld rows bit-identical\n", (long long)n_cmp);
}

/* ---- get_rows and errors ---- */

static void test_get_rows(void)
{
    for (int ti = 0; ti < N_TYPES; ti++) {
        const td_dtype t = all_types[ti];
        test_mat tm;
        TH_REQUIRE(make_mat(t, 11, 64, &tm) == 0);
        const int32_t ids[5] = {0, 10, 3, 3, 7};
        float out[5 * 64];
        TH_CHECK(kn_cpu_get_rows(cpus[1], &tm.w, ids, 5, out) == 0);
        for (int i = 0; i < 5; i++)
            TH_CHECKF(memcmp(out + i * 64, tm.deq + ids[i] * 64, 64 * sizeof(float)) == 0,
                      "%s row %d", td_dtype_name(t), ids[i]);
        const int32_t bad_hi[2] = {1, 11}, bad_lo[1] = {-1};
        TH_CHECK(kn_cpu_get_rows(cpus[1], &tm.w, bad_hi, 2, out) == TD_ERANGE);
        TH_CHECK(kn_cpu_get_rows(cpus[1], &tm.w, bad_lo, 1, out) == TD_ERANGE);
        TH_CHECK(kn_cpu_get_rows(cpus[1], &tm.w, ids, 0, out) == 0);
        free_mat(&tm);
    }
}

static void test_errors(void)
{
    uint8_t data[4096] = {0};
    float x[256] = {0}, y[256];
    const td_dtype unsupported[] = {TD_Q8_1, TD_I16, TD_Q8_K, TD_I32};
    for (int i = 0; i < 4; i++) {
        kn_mat w = {
            .type = unsupported[i], .n_rows = 2, .n_cols = 256, .row_stride = 1024, .data = data};
        TH_CHECK(!kn_cpu_type_supported(unsupported[i]));
        TH_CHECK(kn_cpu_matmul(cpus[0], &w, x, 1, y) == TD_EUNSUPP);
        const int32_t id = 0;
        TH_CHECK(kn_cpu_get_rows(cpus[0], &w, &id, 1, y) == TD_EUNSUPP);
        TH_CHECK(kn_dequant_row(unsupported[i], data, y, 256) == TD_EUNSUPP);
    }
    for (int ti = 0; ti < N_TYPES; ti++)
        TH_CHECK(kn_cpu_type_supported(all_types[ti]));
    /* n_cols not a multiple of the block size */
    kn_mat w = {.type = TD_Q4_1, .n_rows = 2, .n_cols = 48, .row_stride = 40, .data = data};
    TH_CHECK(kn_cpu_matmul(cpus[0], &w, x, 1, y) == TD_EINVAL);
    TH_CHECK(kn_dequant_row(TD_Q8_0, data, y, 40) == TD_EINVAL);
    /* row stride shorter than a row */
    w = (kn_mat){.type = TD_Q8_0, .n_rows = 2, .n_cols = 64, .row_stride = 34, .data = data};
    TH_CHECK(kn_cpu_matmul(cpus[0], &w, x, 1, y) == TD_EINVAL);
    w.row_stride = 68;
    TH_CHECK(kn_cpu_matmul(cpus[0], &w, x, -1, y) == TD_EINVAL);
    TH_CHECK(kn_cpu_matmul(cpus[0], &w, x, 0, y) == 0);
}

int main(void)
{
    if (kt_cpus_create(cpus)) return 1;
    fprintf(stderr, "isa %s\n", kn_cpu_isa());
    TH_RUN(test_dequant_known_values);
    TH_RUN(test_dequant_blocks_bit_exact);
    TH_RUN(test_quantize_round_trip);
    TH_RUN(test_matmul_all);
    TH_RUN(test_matmul_mixed);
    TH_RUN(test_get_rows);
    TH_RUN(test_errors);
    kt_cpus_destroy(cpus);
    TH_EXIT();
}
