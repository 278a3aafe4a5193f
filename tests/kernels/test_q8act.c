/* test_q8act.c: the CPU backend's 8-bit activation mode (kn_cpu_set_act_q8, cpu_q8act.c and
 * cpu_q8gemm.c, cpu_q8kgemm.c) for Q4_K, Q6_K, Q5_0, Q8_0, Q4_0 and Q4_1 weights, m from 1 to 512:
 * the quantization of x, the integer dots against a float64 reference of the same quantized math,
 * the distance to the float32 path within the bound the rounding of x allows, determinism over
 * thread counts, batch invariance (matmul and matmul_mixed), the AVX2 form of the GEMM forced (the
 * same bits), the mode off giving the float32 path bit for bit, the types the mode leaves to the
 * float32 path, and TANDEM_CPU_ACT. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "cpu_q8act.h"
#include "kn_test_util.h"
#include "td_dtype.h"
#include "td_err.h"
#include "tharness.h"

static const td_dtype qtypes[] = {TD_Q4_K, TD_Q6_K, TD_Q5_0, TD_Q8_0, TD_Q4_0, TD_Q4_1};
#define N_QTYPES 6

static uint64_t rng = 0x9e3779b97f4a7c15ull;

/* The largest |quant * scale| per d. */
static float wmax_per_d(td_dtype t)
{
    return t == TD_Q4_K   ? 63 * 15
           : t == TD_Q6_K ? 128 * 32
           : t == TD_Q5_0 ? 16
           : t == TD_Q4_0 ? 8
           : t == TD_Q4_1 ? 15
                          : 128;
}

typedef struct {
    uint8_t *buf;
    kn_mat w;
    double *a, *b; /* (n_rows, n_cols) exact weights w = a + b: a = d-part, b = min part */
} q_mat;

/* Random blocks with weights of magnitude ~1; rows one block apart, gaps 0xff. a and b
 * come from dequantizing with dmin zeroed and with d zeroed (each part exact). */
static int make_mat(td_dtype t, int64_t n_rows, int64_t n_cols, q_mat *m)
{
    const td_dtype_info *info = td_dtype_get((uint32_t)t);
    const size_t bs = info->type_size, rb = td_dtype_row_bytes(t, n_cols), stride = rb + bs;
    m->buf = malloc(stride * (size_t)n_rows);
    m->a = malloc((size_t)(n_rows * n_cols) * sizeof(double));
    m->b = malloc((size_t)(n_rows * n_cols) * sizeof(double));
    float *tmp = malloc((size_t)n_cols * sizeof(float));
    uint8_t *row = malloc(rb);
    if (!m->buf || !m->a || !m->b || !tmp || !row) return -1;
    memset(m->buf, 0xff, stride * (size_t)n_rows);
    for (int64_t r = 0; r < n_rows; r++) {
        uint8_t *p = m->buf + (size_t)r * stride;
        for (size_t i = 0; i < rb; i++)
            p[i] = (uint8_t)kt_u32(&rng);
        for (int64_t b = 0; b < n_cols / info->blck; b++) {
            uint8_t *blk = p + (size_t)b * bs;
            float d = kt_uniform(&rng, 0.25f, 1.0f) / wmax_per_d(t);
            kt_put_f16(blk + kt_d_offset(t), (kt_u32(&rng) & 1) && kt_dmin_offset(t) < 0 ? -d : d);
            if (kt_dmin_offset(t) >= 0)
                kt_put_f16(blk + kt_dmin_offset(t), kt_uniform(&rng, 0.0f, 1.0f) / 63);
        }
        for (int part = 0; part < 2; part++) {
            double *dst = (part ? m->b : m->a) + r * n_cols;
            if (part && kt_dmin_offset(t) < 0) {
                memset(dst, 0, (size_t)n_cols * sizeof(double));
                continue;
            }
            memcpy(row, p, rb);
            const int zero_off = part ? kt_d_offset(t) : kt_dmin_offset(t); /* the part left out */
            for (int64_t b = 0; zero_off >= 0 && b < n_cols / info->blck; b++)
                kt_put_f16(row + (size_t)b * bs + zero_off, 0.0f);
            if (kn_dequant_row(t, row, tmp, n_cols)) return -1;
            for (int64_t e = 0; e < n_cols; e++)
                dst[e] = tmp[e];
        }
    }
    free(tmp);
    free(row);
    m->w = (kn_mat){
        .type = t, .n_rows = n_rows, .n_cols = n_cols, .row_stride = stride, .data = m->buf};
    return 0;
}

static void free_mat(q_mat *m)
{
    free(m->buf);
    free(m->a);
    free(m->b);
}

/* xd, q (m, n): the scale and the quant of every element of the quantized rows xq; checks
 * the quantization rule (|q| <= 127, |x - d q| <= d / 2 up to the float rounding of x / d, the
 * bsums and the 32-block sums). Returns failures. */
static int64_t unpack_x(td_dtype t, const float *x, const uint8_t *xq, int64_t m, int64_t n,
                        double *xd, int *q)
{
    const int is_k = t == TD_Q4_K || t == TD_Q6_K, bl = is_k ? 256 : 32;
    const size_t bsz = is_k ? sizeof(kn_q8k) : sizeof(kn_q8b);
    int64_t fails = 0;
    for (int64_t b = 0; b < m * n / bl; b++) {
        const uint8_t *blk = xq + (size_t)b * bsz;
        const float d = is_k ? ((const kn_q8k *)blk)->d : ((const kn_q8b *)blk)->d;
        const int8_t *qs = is_k ? ((const kn_q8k *)blk)->qs : ((const kn_q8b *)blk)->qs;
        float amax = 0.0f;
        for (int k = 0; k < bl; k++)
            amax = fabsf(x[b * bl + k]) > amax ? fabsf(x[b * bl + k]) : amax;
        const float id = 127.0f / amax; /* inf: the block is all zeros, d 0 */
        fails += d != (isinf(id) ? 0.0f : amax / 127.0f);
        for (int k = 0; k < bl; k++) {
            const int64_t e = b * bl + k;
            xd[e] = d;
            q[e] = qs[k];
            /* the rule exactly (the AVX-512 and scalar quantizers give these bytes) */
            const float v = isinf(id) ? 0.0f : nearbyintf(x[e] * id);
            if (q[e] != (int)fmaxf(-127.0f, fminf(127.0f, v)) || q[e] < -127 ||
                (!isinf(id) && fabs((double)x[e] - (double)d * q[e]) > d * (0.5 + 256 * 0x1p-24)))
                fails++;
        }
        if (!is_k) {
            int sum = 0;
            for (int k = 0; k < bl; k++)
                sum += qs[k];
            fails += sum != ((const kn_q8b *)blk)->sum;
        }
        for (int g = 0; is_k && g < 16; g++) {
            int s = 0;
            for (int k = 0; k < 16; k++)
                s += qs[16 * g + k];
            fails += s != ((const kn_q8k *)blk)->bsums[g];
        }
    }
    return fails;
}

static kn_cpu *cpus[3]; /* 1, 2 and 3 threads */

static int matmul_act(kn_cpu *c, bool q8, const kn_mat *w, const float *x, int64_t m,
                      int64_t m_solo, float *y)
{
    kn_cpu_set_act_q8(c, q8);
    int rc = kn_cpu_matmul_mixed(c, w, x, m, m_solo, y);
    kn_cpu_set_act_q8(c, false);
    return rc;
}

/* y (m rows of the q8 path on W) against float64 of the quantized math (xd q: x as quantized),
 * within (nblk + 16) 2^-23 sum |xd q| (|a| + |b|) (float rounding of the scaling and
 * accumulation over nblk blocks), and against y32 (the float32 path) within the rounding of x,
 * sum |w| d / 2, plus 1e-5 sum |w x| (the float32 path's own rounding). */
static void check_bounds(td_dtype t, const char *what, const q_mat *W, const float *x,
                         const double *xd, const int *q, const float *y, const float *y32,
                         int64_t m, int64_t nblk)
{
    const int64_t n_rows = W->w.n_rows, n_cols = W->w.n_cols;
    int64_t fails = 0;
    double worst_ref = 0, worst_f32 = 0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t r = 0; r < n_rows; r++) {
            double ref = 0, s = 0, dx = 0, wx = 0;
            for (int64_t e = 0; e < n_cols; e++) {
                const double a = W->a[r * n_cols + e], b = W->b[r * n_cols + e];
                const double xv = xd[i * n_cols + e] * q[i * n_cols + e];
                ref += (a + b) * xv;
                s += (fabs(a) + fabs(b)) * fabs(xv);
                dx += fabs(a + b) * xd[i * n_cols + e] * 0.5;
                wx += fabs((a + b) * x[i * n_cols + e]);
            }
            const double b1 = (double)(nblk + 16) * 0x1p-23 * s + 1e-30, b2 = dx + 1e-5 * wx + b1;
            const double e1 = fabs(y[i * n_rows + r] - ref),
                         e2 = fabs((double)y[i * n_rows + r] - y32[i * n_rows + r]);
            fails += !(e1 <= b1) + !(e2 <= b2);
            if (e1 / b1 > worst_ref) worst_ref = e1 / b1;
            if (wx > 0 && e2 / wx > worst_f32) worst_f32 = e2 / wx;
        }
    fprintf(stderr,
            "%s %lldx%lld m %lld%s: error / bound vs float64 %.3g, |q8 - f32| / sum|w x| %.3g\n",
            td_dtype_name(t), (long long)n_rows, (long long)n_cols, (long long)m, what, worst_ref,
            worst_f32);
    TH_CHECKF(fails == 0, "%s%s: %lld outputs out of bounds", td_dtype_name(t), what,
              (long long)fails);
}

/* The q8 path of type t on an (n_rows, n_cols) W and m rows of x: check_bounds against
 * float64 and the float32 path, then the same bits for 1, 2 and 3 threads and for each row
 * of x alone. */
static void check_type(td_dtype t, int64_t n_rows, int64_t n_cols, int64_t m)
{
    q_mat W;
    TH_REQUIRE(make_mat(t, n_rows, n_cols, &W) == 0);
    float *x = kt_act_x(&rng, m, n_cols, false), *y = malloc((size_t)(m * n_rows) * sizeof(float));
    float *y32 = malloc((size_t)(m * n_rows) * sizeof(float));
    float *yt = malloc((size_t)(m * n_rows) * sizeof(float));
    uint8_t *xq = malloc((size_t)m * kn_q8_row_bytes(t, n_cols));
    double *xd = malloc((size_t)(m * n_cols) * sizeof(double));
    int *q = malloc((size_t)(m * n_cols) * sizeof(int));
    TH_REQUIRE(x && y && y32 && yt && xq && xd && q);
    kn_q8_quant_rows(t, x, m, n_cols, xq);
    TH_CHECK(unpack_x(t, x, xq, m, n_cols, xd, q) == 0);
    /* K-types: every row solo here (the q8 dot path, x in 256-blocks); check_kgemm tests their
     * batch rows (the K-quant GEMM, x in 32-blocks) */
    const int64_t solo = (t == TD_Q4_K || t == TD_Q6_K) ? m : 0;
    TH_REQUIRE(matmul_act(cpus[0], true, &W.w, x, m, solo, y) == 0);
    TH_REQUIRE(matmul_act(cpus[0], false, &W.w, x, m, solo, y32) == 0);
    check_bounds(t, "", &W, x, xd, q, y, y32, m, n_cols / td_dtype_get((uint32_t)t)->blck);
    for (int k = 1; k < 3; k++) {
        TH_REQUIRE(matmul_act(cpus[k], true, &W.w, x, m, solo, yt) == 0);
        TH_CHECK(memcmp(y, yt, (size_t)(m * n_rows) * sizeof(float)) == 0);
    }
    for (int64_t i = 0; i < m; i++) {
        TH_REQUIRE(matmul_act(cpus[1], true, &W.w, x + i * n_cols, 1, 0, yt) == 0);
        TH_CHECK(memcmp(y + i * n_rows, yt, (size_t)n_rows * sizeof(float)) == 0);
    }
    if (kn_q8_gemm_supported(&W.w)) {
        /* the AVX2 form (groups of 8, maddubs) gives the same bits as VNNI's */
        kn_q8_gemm_force_avx2(true);
        TH_CHECK(!strcmp(kn_q8_gemm_isa(), "avx2"));
        TH_REQUIRE(matmul_act(cpus[1], true, &W.w, x, m, solo, yt) == 0);
        kn_q8_gemm_force_avx2(false);
        TH_CHECKF(memcmp(y, yt, (size_t)(m * n_rows) * sizeof(float)) == 0,
                  "%s m %lld: avx2 and %s differ", td_dtype_name(t), (long long)m,
                  kn_q8_gemm_isa());
    }
    /* W registered as the engine registers its weights (map_matrix): the q8 GEMM and the
     * K-quant dot read its packed copy (every type here, with VNNI) and give the same bits, for the
     * batch and each row alone; a view of fewer rows at the same address was never registered and
     * keeps the per-call panels, with the same bits for its rows */
    kn_cpu *pc;
    TH_REQUIRE(kn_cpu_create(2, &pc) == 0);
    TH_REQUIRE(kn_cpu_map_matrix(pc, &W.w) == 0 && kn_cpu_map_matrix(pc, &W.w) == 0);
    TH_REQUIRE(matmul_act(pc, true, &W.w, x, m, solo, yt) == 0);
    TH_CHECK(kn_cpu_packed_bytes(pc) == kn_q8_packed_bytes(&W.w));
    TH_CHECKF(memcmp(y, yt, (size_t)(m * n_rows) * sizeof(float)) == 0,
              "%s m %lld: the packed weights change the bits", td_dtype_name(t), (long long)m);
    for (int64_t i = 0; i < m && i < 5; i++) {
        TH_REQUIRE(matmul_act(pc, true, &W.w, x + i * n_cols, 1, 0, yt) == 0);
        TH_CHECK(memcmp(y + i * n_rows, yt, (size_t)n_rows * sizeof(float)) == 0);
    }
    if (n_rows > 3) {
        kn_mat v = W.w;
        v.n_rows = n_rows - 3;
        TH_REQUIRE(matmul_act(pc, true, &v, x, m, solo, yt) == 0);
        int64_t diff = 0;
        for (int64_t i = 0; i < m; i++)
            diff +=
                memcmp(y + i * n_rows, yt + i * v.n_rows, (size_t)v.n_rows * sizeof(float)) != 0;
        TH_CHECK(diff == 0);
        TH_CHECK(kn_cpu_packed_bytes(pc) == kn_q8_packed_bytes(&W.w));
    }
    kn_cpu_destroy(pc);
    free(x), free(y), free(y32), free(yt), free(xq), free(xd), free(q);
    free_mat(&W);
}

/* The K-quant GEMM (kn_q8k_gemm, AVX512-VNNI): the m - solo >= 64 batch rows of Q4_K and Q6_K
 * in the q8 mode, x in 32-blocks. check_bounds against float64 and the float32 path; the same bits
 * for 1, 2 and 3 threads, for the batch rows of a shorter batch (rows 5..m-1 of x as the batch) and
 * next to solo rows, whose bits stay those of m == 1; with the AVX2 form forced, the float32 gemm
 * path's bits (no K-quant GEMM there). */
static void check_kgemm(td_dtype t, int64_t n_rows, int64_t n_cols, int64_t m)
{
    q_mat W;
    TH_REQUIRE(make_mat(t, n_rows, n_cols, &W) == 0);
    TH_REQUIRE(kn_q8k_gemm_supported(&W.w));
    const size_t ny = (size_t)(m * n_rows) * sizeof(float);
    float *x = kt_act_x(&rng, m, n_cols, false), *y = malloc(ny), *y32 = malloc(ny),
          *yt = malloc(ny);
    uint8_t *xq = malloc((size_t)m * kn_q8_row_bytes(TD_Q8_0, n_cols));
    double *xd = malloc((size_t)(m * n_cols) * sizeof(double));
    int *q = malloc((size_t)(m * n_cols) * sizeof(int));
    TH_REQUIRE(x && y && y32 && yt && xq && xd && q);
    kn_q8_quant_rows(TD_Q8_0, x, m, n_cols, xq);
    TH_CHECK(unpack_x(TD_Q8_0, x, xq, m, n_cols, xd, q) == 0);
    for (int64_t b = 0; b < m * n_cols / 32; b++) {
        const kn_q8b *blk = (const kn_q8b *)(const void *)(xq + (size_t)b * sizeof(kn_q8b));
        int s16 = 0;
        for (int k = 0; k < 16; k++)
            s16 += blk->qs[k];
        TH_CHECK(s16 == blk->sum16);
    }
    TH_REQUIRE(matmul_act(cpus[0], true, &W.w, x, m, 0, y) == 0);
    TH_REQUIRE(matmul_act(cpus[0], false, &W.w, x, m, 0, y32) == 0);
    check_bounds(t, " (K-quant GEMM)", &W, x, xd, q, y, y32, m, n_cols / 32);
    for (int k = 1; k < 3; k++) {
        TH_REQUIRE(matmul_act(cpus[k], true, &W.w, x, m, 0, yt) == 0);
        TH_CHECK(memcmp(y, yt, ny) == 0);
    }
    /* rows 5.. as a batch of their own; then rows 0..4 solo beside them (64 batch rows at
     * least, else they are dot rows) */
    TH_REQUIRE(m - 5 >= 64);
    TH_REQUIRE(matmul_act(cpus[1], true, &W.w, x + 5 * n_cols, m - 5, 0, yt) == 0);
    TH_CHECK(memcmp(y + 5 * n_rows, yt, ny - (size_t)(5 * n_rows) * sizeof(float)) == 0);
    TH_REQUIRE(matmul_act(cpus[2], true, &W.w, x, m, 5, yt) == 0);
    TH_CHECK(memcmp(y + 5 * n_rows, yt + 5 * n_rows, ny - (size_t)(5 * n_rows) * sizeof(float)) ==
             0);
    float *y1 = malloc((size_t)n_rows * sizeof(float));
    TH_REQUIRE(y1);
    for (int64_t i = 0; i < 5; i++) {
        TH_REQUIRE(matmul_act(cpus[0], true, &W.w, x + i * n_cols, 1, 0, y1) == 0);
        TH_CHECK(memcmp(yt + i * n_rows, y1, (size_t)n_rows * sizeof(float)) == 0);
    }
    /* Without the K-quant GEMM the q8 mode's batch rows take the float32 path: the same
     * sgemm calls, so the same bits. Both runs on one pool: an sgemm's element may depend on
     * the call's shape (which slice of rows it is in: OpenBLAS's Prescott kernels), and the
     * slices follow the thread count. */
    TH_REQUIRE(matmul_act(cpus[1], false, &W.w, x, m, 0, y32) == 0);
    kn_q8_gemm_force_avx2(true);
    TH_CHECK(!kn_q8k_gemm_supported(&W.w));
    TH_REQUIRE(matmul_act(cpus[1], true, &W.w, x, m, 0, yt) == 0);
    kn_q8_gemm_force_avx2(false);
    TH_CHECK(memcmp(y32, yt, ny) == 0);
    free(x), free(y), free(y32), free(yt), free(y1), free(xq), free(xd), free(q);
    free_mat(&W);
}

static void test_kquant_gemm(void)
{
    kn_mat probe = {.type = TD_Q4_K, .n_rows = 1, .n_cols = 256, .row_stride = 144};
    if (!kn_q8k_gemm_supported(&probe)) {
        fprintf(stderr, "no AVX512-VNNI: the K-quant GEMM is not built for this CPU, skipped\n");
        return;
    }
    static const td_dtype kt[] = {TD_Q4_K, TD_Q6_K};
    for (int k = 0; k < 2; k++) {
        check_kgemm(kt[k], 37, 5 * 256, 69);
        check_kgemm(kt[k], 48, 2 * 256, 203);
        check_kgemm(kt[k], 9, 256, 512);
    }
}

/* The packed K-quant dot (kn_q8k_pack, kn_q8k_dot_packed_* through kn_q8_dot) against the rows as
 * they are: the same bits for Q4_K and Q6_K, m 1..9 (tiles of 4 and their tails), a partial last
 * group, row ranges that start and end inside groups (the rows outside left untouched), a copy
 * packed in two parts, strided rows, and a row of x at full scale (|q| = 127 everywhere: the
 * integer sums at their largest). Skipped without AVX512-VNNI, where nothing is packed. */
static void test_kpacked(void)
{
    kn_mat probe = {.type = TD_Q4_K, .n_rows = 1, .n_cols = 256, .row_stride = 144};
    if (!kn_q8k_packed_bytes(&probe)) {
        fprintf(stderr, "no AVX512-VNNI: K-quant weights are not packed on this CPU, skipped\n");
        return;
    }
    kn_q8_gemm_force_avx2(true);
    TH_CHECK(kn_q8k_packed_bytes(&probe) == 0);
    kn_q8_gemm_force_avx2(false);
    static const td_dtype kt[] = {TD_Q4_K, TD_Q6_K};
    static const int64_t ranges[][2] = {{0, 53}, {3, 29}, {16, 32}, {17, 18}, {40, 53}, {52, 53}};
    const int64_t n_rows = 53, n_cols = 3 * 256, groups = (n_rows + 15) / 16;
    for (int k = 0; k < 2; k++) {
        q_mat W;
        TH_REQUIRE(make_mat(kt[k], n_rows, n_cols, &W) == 0);
        TH_CHECK((size_t)W.w.row_stride > td_dtype_row_bytes(kt[k], n_cols));
        const size_t pbytes = kn_q8k_packed_bytes(&W.w);
        TH_CHECK(pbytes == kn_q8_packed_bytes(&W.w) && pbytes > 0);
        uint8_t *packed = malloc(pbytes);
        TH_REQUIRE(packed);
        kn_q8k_pack(&W.w, packed, 0, 1);
        kn_q8k_pack(&W.w, packed, 1, groups);
        for (int64_t m = 1; m <= 9; m++) {
            float *x = kt_act_x(&rng, m, n_cols, false);
            TH_REQUIRE(x);
            for (int64_t e = 0; e < n_cols; e++)
                x[(m - 1) * n_cols + e] = e % 2 ? -1.0f : 1.0f;
            const size_t xb = (size_t)m * kn_q8_row_bytes(kt[k], n_cols);
            void *xq = malloc(xb);
            float *y = malloc((size_t)(m * n_rows) * sizeof(float));
            float *yp = malloc((size_t)(m * n_rows) * sizeof(float));
            TH_REQUIRE(xq && y && yp);
            kn_q8_quant_rows(kt[k], x, m, n_cols, xq);
            kn_q8_dot(&W.w, NULL, xq, m, y, 0, n_rows);
            for (size_t r = 0; r < sizeof ranges / sizeof *ranges; r++) {
                const int64_t r0 = ranges[r][0], r1 = ranges[r][1];
                for (int64_t i = 0; i < m * n_rows; i++)
                    yp[i] = -12345.0f;
                kn_q8_dot(&W.w, packed, xq, m, yp, r0, r1);
                int64_t diff = 0, touched = 0;
                for (int64_t i = 0; i < m; i++)
                    for (int64_t row = 0; row < n_rows; row++) {
                        const float a = y[i * n_rows + row], b = yp[i * n_rows + row];
                        if (row >= r0 && row < r1)
                            diff += memcmp(&a, &b, sizeof a) != 0;
                        else
                            touched += b != -12345.0f;
                    }
                TH_CHECKF(diff == 0 && touched == 0,
                          "%s m %lld rows [%lld, %lld): %lld rows differ, %lld outside written",
                          td_dtype_name(kt[k]), (long long)m, (long long)r0, (long long)r1,
                          (long long)diff, (long long)touched);
            }
            free(x), free(xq), free(y), free(yp);
        }
        free(packed);
        free_mat(&W);
    }
}

/* The quantizers at their edges, 32-blocks (Q8_0's rows) and 256-blocks (Q4_K's): ties round
 * to even (x times 1.0 exactly .5), the clamp, and blocks so small that 127 / amax overflows:
 * zeros with d 0, not NaN or clamped garbage. */
static void test_quant_edges(void)
{
    static const td_dtype types[] = {TD_Q8_0, TD_Q4_K};
    float x[512] = {0};
    x[0] = 127.0f; /* id = 1 in the first 32 and the first 256 */
    const float ties[] = {2.5f, -3.5f, 0.5f, 1.5f, -0.5f, 126.5f};
    const int want[] = {2, -4, 0, 2, 0, 126};
    for (int k = 0; k < 6; k++)
        x[1 + k] = ties[k];
    for (int k = 256; k < 512; k++) /* the second 256 (and its 32-blocks): tiny, a zero */
        x[k] = k == 300 ? 0.0f : k % 2 ? 1e-40f : -2e-38f;
    for (int i = 0; i < 2; i++) {
        uint8_t *xq = malloc(kn_q8_row_bytes(types[i], 512));
        double xd[512];
        int q[512];
        TH_REQUIRE(xq);
        kn_q8_quant_rows(types[i], x, 1, 512, xq);
        TH_CHECKF(unpack_x(types[i], x, xq, 1, 512, xd, q) == 0, "%s", td_dtype_name(types[i]));
        for (int k = 0; k < 6; k++)
            TH_CHECKF(q[1 + k] == want[k], "%s: x %g: q %d, want %d", td_dtype_name(types[i]),
                      (double)ties[k], q[1 + k], want[k]);
        for (int k = 256; k < 512; k++)
            TH_CHECK(q[k] == 0 && xd[k] == 0.0);
        free(xq);
    }
}

static void test_q8_dots(void)
{
    for (int k = 0; k < N_QTYPES; k++) {
        const td_dtype t = qtypes[k];
        const int64_t bl = td_dtype_get((uint32_t)t)->blck;
        static const int64_t ms[] = {1, 8, 33, 64, 200, 512};
        for (int i = 0; i < 6; i++)
            check_type(t, 37, 5 * 256, ms[i]);
        check_type(t, 9, bl == 32 ? 96 : 256, 3);
    }
}

/* matmul_mixed with m - solo >= 64 batch rows: Q4_K's solo rows get the bits of m == 1 in q8
 * and its batch rows the K-quant GEMM's (with AVX512-VNNI; else the float32 gemm path's); Q5_0 and
 * Q4_1 (the integer GEMM) give every row, solo or batch, the bits of that row alone; Q5_1 (no
 * integer dots) keeps the float32 bits. The mode off again gives the float32 bits of a backend that
 * never had it. */
static void test_mixed_and_off(void)
{
    const td_dtype types[] = {TD_Q4_K, TD_Q5_0, TD_Q4_1, TD_Q5_1};
    for (int k = 0; k < 4; k++) {
        const td_dtype t = types[k];
        const int64_t n_rows = 24, n_cols = 512, m = 70, solo = 3;
        q_mat W;
        if (t == TD_Q5_1) {
            /* random quants, d and m halves 0.01 */
            const size_t rb = td_dtype_row_bytes(t, n_cols), bs = 24;
            W.buf = malloc(rb * (size_t)n_rows), W.a = W.b = NULL;
            TH_REQUIRE(W.buf);
            for (size_t i = 0; i < rb * (size_t)n_rows; i++)
                W.buf[i] = (uint8_t)kt_u32(&rng);
            for (size_t b = 0; b < rb * (size_t)n_rows / bs; b++)
                kt_put_f16(W.buf + bs * b, 0.01f), kt_put_f16(W.buf + bs * b + 2, 0.01f);
            W.w = (kn_mat){
                .type = t, .n_rows = n_rows, .n_cols = n_cols, .row_stride = rb, .data = W.buf};
        } else {
            TH_REQUIRE(make_mat(t, n_rows, n_cols, &W) == 0);
        }
        float *x = kt_act_x(&rng, m, n_cols, false),
              *y = malloc((size_t)(m * n_rows) * sizeof(float));
        float *y32 = malloc((size_t)(m * n_rows) * sizeof(float)), *y1 = malloc(n_rows * 4);
        kn_cpu *fresh = NULL;
        TH_REQUIRE(x && y && y32 && y1 && kn_cpu_create(2, &fresh) == 0);
        TH_REQUIRE(matmul_act(cpus[1], true, &W.w, x, m, solo, y) == 0);
        TH_REQUIRE(kn_cpu_matmul_mixed(fresh, &W.w, x, m, solo, y32) == 0);
        const bool gemm = kn_q8_gemm_supported(&W.w), kgemm = kn_q8k_gemm_supported(&W.w);
        TH_CHECK(gemm == (t == TD_Q5_0 || t == TD_Q4_1));
        for (int64_t i = 0; i < (gemm ? m : solo); i++) {
            TH_REQUIRE(matmul_act(cpus[2], true, &W.w, x + i * n_cols, 1, 0, y1) == 0);
            TH_CHECK(memcmp(y + i * n_rows, y1, (size_t)n_rows * sizeof(float)) == 0);
        }
        const size_t nb = (size_t)((m - solo) * n_rows) * sizeof(float);
        TH_CHECK((gemm || kgemm) == !!memcmp(y + solo * n_rows, y32 + solo * n_rows, nb));
        TH_CHECK((t == TD_Q5_1) == !memcmp(y, y32, (size_t)(solo * n_rows) * sizeof(float)));
        /* on, then off again: the float32 bits, dot and gemm paths */
        TH_REQUIRE(matmul_act(cpus[1], false, &W.w, x, m, solo, y) == 0);
        TH_CHECK(memcmp(y, y32, (size_t)(m * n_rows) * sizeof(float)) == 0);
        TH_REQUIRE(kn_cpu_matmul(cpus[1], &W.w, x, 5, y) == 0);
        TH_REQUIRE(kn_cpu_matmul(fresh, &W.w, x, 5, y32) == 0);
        TH_CHECK(memcmp(y, y32, (size_t)(5 * n_rows) * sizeof(float)) == 0);
        kn_cpu_destroy(fresh);
        free(x), free(y), free(y32), free(y1), free(W.buf), free(W.a);
        if (W.b != W.a) free(W.b);
    }
}

static void test_env(void)
{
    kn_cpu *c = NULL;
    TH_REQUIRE(setenv("TANDEM_CPU_ACT", "q8", 1) == 0);
    TH_REQUIRE(kn_cpu_create(1, &c) == 0);
    TH_CHECK(kn_cpu_act_q8(c));
    kn_cpu_set_act_q8(c, false);
    TH_CHECK(!kn_cpu_act_q8(c));
    kn_cpu_destroy(c);
    TH_REQUIRE(setenv("TANDEM_CPU_ACT", "f32", 1) == 0);
    TH_REQUIRE(kn_cpu_create(1, &c) == 0);
    TH_CHECK(!kn_cpu_act_q8(c));
    kn_cpu_destroy(c);
    TH_REQUIRE(setenv("TANDEM_CPU_ACT", "q4", 1) == 0);
    c = NULL;
    TH_CHECK(kn_cpu_create(1, &c) == TD_EINVAL && c == NULL);
    unsetenv("TANDEM_CPU_ACT");
    TH_REQUIRE(kn_cpu_create(1, &c) == 0);
    TH_CHECK(!kn_cpu_act_q8(c));
    kn_cpu_destroy(c);
}

int main(void)
{
    unsetenv("TANDEM_CPU_ACT");
    if (kt_cpus_create(cpus)) return 1;
    fprintf(stderr, "isa %s, q8 gemm %s (weights packed: %s)\n", kn_cpu_isa(), kn_q8_gemm_isa(),
            kn_q8_gemm_group_rows() == 16 ? "yes" : "no, not AVX512-VNNI");
    TH_RUN(test_quant_edges);
    TH_RUN(test_q8_dots);
    TH_RUN(test_kquant_gemm);
    TH_RUN(test_kpacked);
    TH_RUN(test_mixed_and_off);
    TH_RUN(test_env);
    kt_cpus_destroy(cpus);
    TH_EXIT();
}
