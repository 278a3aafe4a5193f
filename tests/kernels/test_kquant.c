/* test_kquant.c: the CPU backend's K-quant and IQ4 types (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
 * IQ4_NL, IQ4_XS): dequantization bit for bit against a scalar transcription of
 * gguf.quants' numpy dequantizers (the numpy
 * code itself is compared in tests/ref/test_kquant_ref.py), matmul on both paths against
 * a float64 reference over the dequantized weights (1, a few and many rows; several
 * super-blocks per row; strided row-slice views; 1, 2 and 3 threads), thread and batch
 * invariance of the dot path, get_rows, and the shape errors. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "kn_test_util.h"
#include "td_dtype.h"
#include "td_err.h"
#include "tharness.h"

static const td_dtype ktypes[] = {TD_Q2_K, TD_Q3_K,   TD_Q4_K,  TD_Q5_K,
                                  TD_Q6_K, TD_IQ4_NL, TD_IQ4_XS};
#define N_KTYPES 7
#define QK_K     256

/* IQ4_NL's levels (gguf.quants.IQ4_NL.kvalues) */
static const int kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

static uint64_t rng = 0x2545f4914f6cdd1dull;

static size_t block_bytes(td_dtype t)
{
    return td_dtype_get((uint32_t)t)->type_size;
}

static int64_t block_len(td_dtype t)
{
    return td_dtype_get((uint32_t)t)->blck;
}

/* The largest |w| / |d| of a block (dmin taken equal to d). */
static float max_weight_per_d(td_dtype t)
{
    switch (t) {
    case TD_Q2_K:
        return 15.0f * 3.0f + 15.0f;
    case TD_Q3_K:
        return 32.0f * 4.0f;
    case TD_Q6_K:
        return 128.0f * 32.0f;
    case TD_IQ4_NL:
        return 127.0f;
    case TD_IQ4_XS:
        return 32.0f * 127.0f;
    default:
        return 63.0f * 31.0f;
    }
}

/* nb random super-blocks: random bytes, then d (and dmin) replaced by finite halves.
 * wide: any finite half, some subnormal, either sign (dequantization tests); otherwise
 * magnitudes that keep the weights near [-1, 1] (matmul tests). */
static void random_blocks(td_dtype t, uint8_t *dst, int64_t nb, int wide)
{
    const size_t bs = block_bytes(t);
    for (size_t i = 0; i < (size_t)nb * bs; i++)
        dst[i] = (uint8_t)kt_u32(&rng);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = dst + (size_t)b * bs;
        for (int k = 0; k < 2; k++) {
            const int off = k ? kt_dmin_offset(t) : kt_d_offset(t);
            if (off < 0) continue;
            uint16_t h;
            if (wide) {
                h = (uint16_t)(kt_u32(&rng) % 0x7c00); /* finite */
                if (b % 5 == 1) h &= 0x03ff;           /* subnormal */
                if (kt_u32(&rng) & 1) h |= 0x8000;
            } else {
                /* |w| <= 1 or so; the types without mins get either sign */
                h = td_fp32_to_fp16(kt_uniform(&rng, 0.25f, 1.0f) / max_weight_per_d(t));
                if (kt_dmin_offset(t) < 0 && (kt_u32(&rng) & 1)) h |= 0x8000;
            }
            kt_put16(blk + off, h);
        }
    }
}

/* Element e of a row of Q2_K, Q3_K, IQ4_NL or IQ4_XS blocks (ref_dequant_one's order). */
static float ref_dequant_low(td_dtype t, const uint8_t *row, int64_t e)
{
    const uint8_t *blk = row + (size_t)(e / block_len(t)) * block_bytes(t);
    const int i = (int)(e % block_len(t)), c = i / 32, l = i % 32, g = i / 16;
    if (t == TD_IQ4_NL) {
        const int n = (blk[2 + i % 16] >> (4 * (i / 16))) & 15;
        return kt_get_f16(blk) * (float)kvalues_iq4nl[n];
    }
    if (t == TD_IQ4_XS) {
        const int sh = blk[2] | blk[3] << 8;
        const int ls = ((blk[4 + c / 2] >> (4 * (c % 2))) & 15) | (((sh >> (2 * c)) & 3) << 4);
        const int n = (blk[8 + 16 * c + l % 16] >> (4 * (l / 16))) & 15;
        volatile float dl = kt_get_f16(blk) * (float)(ls - 32);
        return dl * (float)kvalues_iq4nl[n];
    }
    const int ql = (blk[(t == TD_Q2_K ? 16 : 32) + 32 * (c / 4) + l] >> (2 * (c % 4))) & 3;
    if (t == TD_Q3_K) {
        const uint8_t *s = blk + 96;
        const int sc =
            ((s[g % 8] >> (4 * (g / 8))) & 15) | (((s[8 + g % 4] >> (2 * (g / 4))) & 3) << 4);
        const int q = ql - (((blk[l] >> c) & 1) ? 0 : 4);
        volatile float dl = kt_get_f16(blk + 108) * (float)(sc - 32);
        return dl * (float)q;
    }
    volatile float dl = kt_get_f16(blk + 80) * (float)(blk[g] & 15);
    volatile float ml = kt_get_f16(blk + 82) * (float)(blk[g] >> 4);
    volatile float p = dl * (float)ql;
    return p - ml;
}

/* Element e of a row of K blocks, written out the way gguf.quants computes it (numpy's
 * float32 order: d * sc first, then times q, then minus dmin * m). */
static float ref_dequant_one(td_dtype t, const uint8_t *row, int64_t e)
{
    if (t == TD_Q2_K || t == TD_Q3_K || t == TD_IQ4_NL || t == TD_IQ4_XS)
        return ref_dequant_low(t, row, e);
    const uint8_t *blk = row + (size_t)(e / QK_K) * block_bytes(t);
    const int i = (int)(e % QK_K), c = i / 32, l = i % 32;
    if (t == TD_Q6_K) {
        const int h = c / 4, k = c % 4;
        int q = (blk[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 15;
        q |= ((blk[128 + 32 * h + l] >> (2 * k)) & 3) << 4;
        volatile float ds = kt_get_f16(blk + 208) * (float)(int8_t)blk[192 + i / 16];
        return ds * (float)(q - 32);
    }
    const uint8_t *s = blk + 4;
    int sc, mn;
    if (c < 4) {
        sc = s[c] & 63;
        mn = s[c + 4] & 63;
    } else {
        sc = (s[c + 4] & 0x0f) | ((s[c - 4] >> 2) & 0x30);
        mn = (s[c + 4] >> 4) | ((s[c] >> 2) & 0x30);
    }
    const uint8_t *qs = blk + (t == TD_Q4_K ? 16 : 48);
    int q = (qs[32 * (c / 2) + l] >> (4 * (c % 2))) & 15;
    if (t == TD_Q5_K) q |= ((blk[16 + l] >> c) & 1) << 4;
    volatile float ds = kt_get_f16(blk) * (float)sc, dm = kt_get_f16(blk + 2) * (float)mn;
    volatile float p = ds * (float)q; /* rounded (exact, in fact) before the subtraction */
    return p - dm;
}

/* ---- dequantization ---- */

static void test_dequant_bit_exact(void)
{
    for (int ti = 0; ti < N_KTYPES; ti++) {
        const td_dtype t = ktypes[ti];
        const int64_t ne = 41 * QK_K, nb = ne / block_len(t);
        uint8_t *row = malloc((size_t)nb * block_bytes(t));
        float *out = malloc((size_t)ne * sizeof *out);
        TH_REQUIRE(row && out);
        random_blocks(t, row, nb, 1);
        TH_REQUIRE(kn_dequant_row(t, row, out, ne) == 0);
        int bad = 0, n_nonzero = 0;
        for (int64_t e = 0; e < ne; e++) {
            const float want = ref_dequant_one(t, row, e);
            n_nonzero += want != 0.0f;
            if (td_fp32_to_bits(out[e]) != td_fp32_to_bits(want) && bad++ < 5)
                fprintf(stderr, "%s[%lld] = %.9g, want %.9g\n", td_dtype_name(t), (long long)e,
                        out[e], want);
        }
        TH_CHECKF(bad == 0, "%s: %d mismatches", td_dtype_name(t), bad);
        TH_CHECKF(n_nonzero > ne / 2, "%s: only %d nonzero values", td_dtype_name(t), n_nonzero);
        free(row);
        free(out);
    }
}

/* A hand-made Q4_K block: scales and mins at their extremes in every packing position. */
static void test_dequant_known_q4_k(void)
{
    uint8_t blk[144] = {0};
    kt_put16(blk, 0x3c00);     /* d = 1 */
    kt_put16(blk + 2, 0x3800); /* dmin = 0.5 */
    /* sc = {1, 2, 3, 63, 60, 17, 0, 48}, mn = {0, 63, 5, 1, 33, 2, 63, 16} */
    const int sc[8] = {1, 2, 3, 63, 60, 17, 0, 48}, mn[8] = {0, 63, 5, 1, 33, 2, 63, 16};
    uint8_t *s = blk + 4;
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
        s[j + 4] = (uint8_t)((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
        s[j + 8] = (uint8_t)((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
    }
    for (int i = 0; i < 128; i++)
        blk[16 + i] = (uint8_t)((i % 16) | ((15 - i % 16) << 4));
    float out[256];
    TH_REQUIRE(kn_dequant_row(TD_Q4_K, blk, out, 256) == 0);
    int bad = 0;
    for (int e = 0; e < 256; e++) {
        const int c = e / 32, l = e % 32;
        const int q = c % 2 ? 15 - l % 16 : l % 16;
        const float want = (float)(sc[c] * q) - 0.5f * (float)mn[c];
        bad += out[e] != want;
    }
    TH_CHECKF(bad == 0, "%d of 256 values differ from the hand-computed ones", bad);
}

/* ---- matmul ---- */

typedef struct {
    uint8_t *buf;
    kn_mat w;
    float *deq; /* (n_rows, n_cols) */
} kq_mat;

/* A strided row-slice view, each row one block into a row of row_bytes + 2 blocks, the
 * gaps 0xff (NaN scales if a kernel read them). */
static int make_mat(td_dtype t, int64_t n_rows, int64_t n_cols, kq_mat *m)
{
    const size_t bs = block_bytes(t), rb = td_dtype_row_bytes(t, n_cols), stride = rb + 2 * bs;
    m->buf = malloc(stride * (size_t)n_rows + bs);
    m->deq = malloc((size_t)(n_rows * n_cols) * sizeof(float));
    if (!m->buf || !m->deq) return -1;
    memset(m->buf, 0xff, stride * (size_t)n_rows + bs);
    for (int64_t r = 0; r < n_rows; r++)
        random_blocks(t, m->buf + bs + (size_t)r * stride, n_cols / block_len(t), 0);
    m->w = (kn_mat){
        .type = t, .n_rows = n_rows, .n_cols = n_cols, .row_stride = stride, .data = m->buf + bs};
    return kt_dequant_mat(&m->w, m->deq) ? -1 : 0;
}

static void free_mat(kq_mat *m)
{
    free(m->buf);
    free(m->deq);
}

static kn_cpu *cpus[3]; /* 1, 2 and 3 threads */

/* Each output against float64, within 1e-5 of sum |w x| (float32 accumulation over a few
 * thousand terms); returns the number of failures, worst relative error in *worst. */
static int64_t check_outputs(const kq_mat *tm, const float *x, int64_t m, const float *y,
                             double *worst, const char *what)
{
    const int64_t n = tm->w.n_rows, k = tm->w.n_cols;
    int64_t n_fail = 0;
    for (int64_t j = 0; j < m; j++)
        for (int64_t r = 0; r < n; r++) {
            double a;
            const double s = kt_dot64(tm->deq + r * k, x + j * k, k, &a);
            const double err = fabs((double)y[j * n + r] - s), tol = 1e-5 * a + 1e-30;
            if (!(err <= tol)) {
                if (n_fail++ < 5)
                    fprintf(stderr, "%s %lldx%lld m %lld: y[%lld][%lld] = %.8g, want %.8g\n", what,
                            (long long)n, (long long)k, (long long)m, (long long)j, (long long)r,
                            y[j * n + r], s);
            } else if (a > 0 && err / a > *worst) {
                *worst = err / a;
            }
        }
    return n_fail;
}

/* One type and shape for every m: 1, 2 and 3 threads against float64; the dot path
 * (m < 64) bit-identical across thread counts and, row by row, to m == 1. */
static void matmul_shape(td_dtype t, int64_t n, int64_t k, int64_t *n_fail, int64_t *n_cmp,
                         double *worst)
{
    const int64_t ms[] = {1, 2, 3, 4, 5, 9, 64, 100};
    kq_mat tm;
    TH_REQUIRE(make_mat(t, n, k, &tm) == 0);
    for (int mi = 0; mi < 8; mi++) {
        const int64_t m = ms[mi];
        float *x = malloc((size_t)(m * k) * sizeof *x);
        float *y = malloc((size_t)(m * n) * sizeof *y), *y1 = malloc((size_t)(m * n) * sizeof *y1);
        TH_REQUIRE(x && y && y1);
        for (int64_t i = 0; i < m * k; i++)
            x[i] = kt_uniform(&rng, -1.0f, 1.0f);
        for (int th = 0; th < 3; th++) {
            for (int64_t i = 0; i < m * n; i++)
                y[i] = NAN;
            TH_CHECK(kn_cpu_matmul(cpus[th], &tm.w, x, m, y) == 0);
            *n_fail += check_outputs(&tm, x, m, y, worst, td_dtype_name(t));
            *n_cmp += m * n;
            if (th == 0) memcpy(y1, y, (size_t)(m * n) * sizeof *y);
            if (th > 0 && m < 64)
                TH_CHECKF(memcmp(y, y1, (size_t)(m * n) * sizeof *y) == 0,
                          "%s %lldx%lld m %lld: %d threads differ from 1", td_dtype_name(t),
                          (long long)n, (long long)k, (long long)m, th + 1);
        }
        if (m > 1 && m < 64) {
            float *yr = malloc((size_t)n * sizeof *yr);
            TH_REQUIRE(yr);
            for (int64_t j = 0; j < m; j++) {
                TH_CHECK(kn_cpu_matmul(cpus[1], &tm.w, x + j * k, 1, yr) == 0);
                TH_CHECKF(memcmp(yr, y1 + j * n, (size_t)n * sizeof *yr) == 0,
                          "%s %lldx%lld: row %lld of a batch of %lld differs from the row alone",
                          td_dtype_name(t), (long long)n, (long long)k, (long long)j, (long long)m);
            }
            free(yr);
        }
        free(x);
        free(y);
        free(y1);
    }
    free_mat(&tm);
}

static void test_matmul(void)
{
    const int64_t rows[] = {1, 3, 67, 300}, cols[] = {256, 768, 2304};
    int64_t n_fail = 0, n_cmp = 0;
    double worst = 0.0;
    for (int ti = 0; ti < N_KTYPES; ti++)
        for (int ci = 0; ci < 3; ci++)
            for (int ri = 0; ri < 4; ri++)
                matmul_shape(ktypes[ti], rows[ri], cols[ci], &n_fail, &n_cmp, &worst);
    TH_CHECKF(n_fail == 0, "%lld of %lld outputs out of tolerance", (long long)n_fail,
              (long long)n_cmp);
    fprintf(stderr, "  matmul: %lld outputs, worst |err| / sum|w x| = %.3g\n", (long long)n_cmp,
            worst);
}

/* matmul_mixed: 3 solo rows plus 70 batch rows (gemm path): the solo rows give the bits of
 * each row alone, the batch rows those of the batch alone. */
static void test_matmul_mixed(void)
{
    for (int ti = 0; ti < N_KTYPES; ti++) {
        const td_dtype t = ktypes[ti];
        const int64_t n = 67, k = 512, solo = 3, nb = 70, m = solo + nb;
        kq_mat tm;
        TH_REQUIRE(make_mat(t, n, k, &tm) == 0);
        float *x = malloc((size_t)(m * k) * sizeof *x), *y = malloc((size_t)(m * n) * sizeof *y);
        float *ref = malloc((size_t)(m * n) * sizeof *ref);
        TH_REQUIRE(x && y && ref);
        for (int64_t i = 0; i < m * k; i++)
            x[i] = kt_uniform(&rng, -1.0f, 1.0f);
        for (int th = 0; th < 3; th++) {
            for (int64_t j = 0; j < solo; j++)
                TH_REQUIRE(kn_cpu_matmul(cpus[th], &tm.w, x + j * k, 1, ref + j * n) == 0);
            TH_REQUIRE(kn_cpu_matmul(cpus[th], &tm.w, x + solo * k, nb, ref + solo * n) == 0);
            TH_CHECK(kn_cpu_matmul_mixed(cpus[th], &tm.w, x, m, solo, y) == 0);
            TH_CHECKF(memcmp(y, ref, (size_t)(m * n) * sizeof *y) == 0,
                      "%s: mixed rows differ from the rows alone (%d threads)", td_dtype_name(t),
                      th + 1);
        }
        free(x);
        free(y);
        free(ref);
        free_mat(&tm);
    }
}

static void test_get_rows_and_errors(void)
{
    for (int ti = 0; ti < N_KTYPES; ti++) {
        const td_dtype t = ktypes[ti];
        TH_CHECK(kn_cpu_type_supported(t));
        kq_mat tm;
        TH_REQUIRE(make_mat(t, 9, 512, &tm) == 0);
        const int32_t ids[4] = {8, 0, 4, 4};
        float out[4 * 512], x[512] = {0}, y[9];
        TH_CHECK(kn_cpu_get_rows(cpus[1], &tm.w, ids, 4, out) == 0);
        for (int i = 0; i < 4; i++)
            TH_CHECKF(memcmp(out + i * 512, tm.deq + ids[i] * 512, 512 * sizeof(float)) == 0,
                      "%s row %d", td_dtype_name(t), ids[i]);
        /* whole blocks only: 288 columns are 9 blocks of 32 but not of 256, 272 not even
         * of 32 */
        const int64_t bad_cols = block_len(t) == QK_K ? 288 : 272;
        kn_mat w = tm.w;
        w.n_cols = bad_cols;
        TH_CHECK(kn_cpu_matmul(cpus[0], &w, x, 1, y) == TD_EINVAL);
        TH_CHECK(kn_dequant_row(t, tm.w.data, out, bad_cols) == TD_EINVAL);
        w.n_cols = 512;
        w.row_stride = td_dtype_row_bytes(t, 512) - 1;
        TH_CHECK(kn_cpu_matmul(cpus[0], &w, x, 1, y) == TD_EINVAL);
        free_mat(&tm);
    }
}

int main(void)
{
    if (kt_cpus_create(cpus)) return 1;
    fprintf(stderr, "isa %s\n", kn_cpu_isa());
    TH_RUN(test_dequant_bit_exact);
    TH_RUN(test_dequant_known_q4_k);
    TH_RUN(test_matmul);
    TH_RUN(test_matmul_mixed);
    TH_RUN(test_get_rows_and_errors);
    kt_cpus_destroy(cpus);
    TH_EXIT();
}
