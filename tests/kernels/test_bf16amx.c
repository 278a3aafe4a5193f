/* test_bf16amx.c: the gemm path's bf16x3 products on AMX-BF16 (cpu_bf16amx.h) against a float64
 * reference of x . dequant(W), next to the path they replace (dequantize + OpenBLAS sgemm)
 * against the same reference: per row of x, the relative L2 error of AMX within BF_RATIO of
 * sgemm's or below BF_FLOOR (bf16x3's bound: see there), printing both, for F32, F16, Q4_0, Q4_1,
 * Q8_0, Q4_K, Q6_K, m 1 to 512 (partial tiles of x), K from 8 to 8960 (not multiples of 32 for the
 * float types, of 256 for the 32-block types), row counts of W that are not multiples of 16. Then
 * the bits: a row of x alone equals the row in a batch, and W's rows in two calls equal one call;
 * nothing stored outside the rows asked for. Then the backend's matmul (1, 2 and 3 threads,
 * solo rows mixed in) against its sgemm path (kn_bf16amx_force_off), and the describe line.
 * Exits 77 (ctest's skip) where AMX-BF16 is unusable: no AMX-BF16 on the CPU, the OS refusing
 * the tile state, or TANDEM_CPU_AMX=0.
 */
#include <cblas.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "cpu_bf16amx.h"
#include "kn_test_util.h"
#include "td_dtype.h"
#include "td_err.h"
#include "tharness.h"

#define SENTINEL (-12345.0f)
/* AMX's error against sgemm's, per row: at most BF_RATIO times, or below BF_FLOOR relative.
 * bf16x6 (KN_BF16AMX_PARTS 3) holds x and W to 2^-24 like float32: within 4x of sgemm (worst
 * measured 3.03x), the floor only for rows where sgemm is exact. bf16x3 holds them to about
 * 2^-17 (a 16-bit significand): measured 2e-6 to 1.4e-5 relative, 6-175x sgemm's (which is
 * 1e-7 to 7e-7 and grows with K), so its bound is the floor: 4e-5, under the 3 x 2^-16 of the
 * terms it drops or rounds per product (cpu_bf16amx.h). */
#define BF_RATIO 4.0
#if KN_BF16AMX_PARTS == 3
#define BF_FLOOR 1e-7
#else
#define BF_FLOOR 4e-5
#endif

static uint64_t rng = 0x13198a2e03707344ull;

static float *make_x(int64_t m, int64_t n)
{
    float *x = malloc((size_t)(m * n) * sizeof(float));
    if (!x) return NULL;
    for (int64_t i = 0; i < m * n; i++)
        x[i] = kt_signed_unit(&rng);
    return x;
}

/* W dequantized (n_rows, n_cols) */
static float *dequant(const kn_mat *w)
{
    float *d = malloc((size_t)(w->n_rows * w->n_cols) * sizeof(float));
    if (d && kt_dequant_mat(w, d)) {
        free(d);
        return NULL;
    }
    return d;
}

/* Relative L2 error of row i of y (ldy floats a row, n values) against ref. */
static double row_err(const float *y, const double *ref, int64_t i, int64_t n, int64_t ldy)
{
    double e = 0, s = 0;
    for (int64_t r = 0; r < n; r++) {
        const double d = y[i * ldy + r] - ref[i * n + r];
        e += d * d;
        s += ref[i * n + r] * ref[i * n + r];
    }
    return s > 0 ? sqrt(e / s) : sqrt(e);
}

static double worst_ratio, worst_amx;

/* The AMX products of W (t, n_rows x n_cols) and m rows of x against float64 and sgemm; the
 * bits of rows alone and of W's rows split in two calls. */
static void check_kernel(td_dtype t, int64_t n_rows, int64_t n_cols, int64_t m)
{
    kn_mat w;
    uint8_t *buf = kt_make_w(&rng, t, n_rows, n_cols, &w);
    float *x = make_x(m, n_cols), *wd = dequant(&w);
    const int64_t ldy = n_rows + 5; /* a store past row n_rows - 1 shows */
    const size_t ny = (size_t)(m * ldy);
    float *ya = malloc(ny * sizeof(float)), *ys = malloc(ny * sizeof(float)),
          *y1 = malloc(ny * sizeof(float));
    double *ref = malloc((size_t)(m * n_rows) * sizeof(double));
    void *xp = aligned_alloc(64, kn_bf16amx_x_bytes(m, n_cols)),
         *x1 = aligned_alloc(64, kn_bf16amx_x_bytes(1, n_cols));
    const size_t sb = (kn_bf16amx_scratch_bytes(n_rows, n_cols) + 63) / 64 * 64;
    void *scratch = aligned_alloc(64, sb);
    TH_REQUIRE(buf && x && wd && ya && ys && y1 && ref && xp && x1 && scratch);
    kt_ref_matmul(x, wd, m, n_rows, n_cols, ref, NULL);
    kt_fill(ys, ny, SENTINEL);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n_rows, (int)n_cols, 1.0f, x,
                (int)n_cols, wd, (int)n_cols, 0.0f, ys, (int)ldy);
    kn_bf16amx_pack_x(x, m, n_cols, 0, 2 * ((m + 31) / 32), xp);
    kt_fill(ya, ny, SENTINEL);
    TH_REQUIRE(kn_bf16amx_rows(&w, 0, n_rows, xp, m, ya, ldy, scratch) == 0);
    int64_t bad = 0, outside = 0;
    double worst = 0, wa = 0, ws = 0;
    for (int64_t i = 0; i < m; i++) {
        for (int64_t r = n_rows; r < ldy; r++)
            outside += ya[i * ldy + r] != SENTINEL;
        const double ea = row_err(ya, ref, i, n_rows, ldy), es = row_err(ys, ref, i, n_rows, ldy);
        bad += !(ea <= BF_RATIO * es || ea <= BF_FLOOR);
        if (ea / (es > 1e-12 ? es : 1e-12) > worst) worst = ea / (es > 1e-12 ? es : 1e-12);
        if (ea > wa) wa = ea, ws = es;
    }
    if (n_cols >= 256 && worst > worst_ratio) worst_ratio = worst;
    if (wa > worst_amx) worst_amx = wa;
    printf("  %-5s %4lld x %5lld m %3lld: worst row error amx %.2e (sgemm %.2e), worst ratio "
           "%.2f\n",
           td_dtype_name(t), (long long)n_rows, (long long)n_cols, (long long)m, wa, ws, worst);
    TH_CHECKF(bad == 0 && outside == 0,
              "%s %lldx%lld m %lld: %lld rows beyond %.0fx sgemm's error, %lld stored outside",
              td_dtype_name(t), (long long)n_rows, (long long)n_cols, (long long)m, (long long)bad,
              BF_RATIO, (long long)outside);
    /* rows of x alone (the first, one in the middle, the last): the bits of the batch */
    int64_t diff = 0;
    const int64_t alone[] = {0, m / 2, m - 1};
    for (int a = 0; a < 3; a++) {
        const int64_t i = alone[a];
        kn_bf16amx_pack_x(x + i * n_cols, 1, n_cols, 0, 2, x1);
        kt_fill(y1, (size_t)ldy, SENTINEL);
        TH_REQUIRE(kn_bf16amx_rows(&w, 0, n_rows, x1, 1, y1, ldy, scratch) == 0);
        diff += memcmp(y1, ya + i * ldy, (size_t)n_rows * sizeof(float)) != 0;
    }
    /* W's rows in two calls, split off a 16-row boundary */
    const int64_t cut = n_rows / 2 | 1;
    kt_fill(y1, ny, SENTINEL);
    TH_REQUIRE(kn_bf16amx_rows(&w, 0, cut, xp, m, y1, ldy, scratch) == 0);
    TH_REQUIRE(kn_bf16amx_rows(&w, cut, n_rows - cut, xp, m, y1 + cut, ldy, scratch) == 0);
    TH_CHECKF(diff == 0 && memcmp(y1, ya, ny * sizeof(float)) == 0,
              "%s %lldx%lld m %lld: %lld rows alone differ from the batch, or split rows differ",
              td_dtype_name(t), (long long)n_rows, (long long)n_cols, (long long)m,
              (long long)diff);
    free(buf), free(x), free(wd), free(ya), free(ys), free(y1), free(ref), free(xp), free(x1);
    free(scratch);
}

static void test_kernel(void)
{
    printf("  products: %s\n", KN_BF16AMX_NAME);
    static const int64_t ms[] = {1, 15, 16, 17, 64, 100, 512};
    /* float types: any K */
    static const td_dtype ft[] = {TD_F32, TD_F16};
    static const int64_t fk[] = {8, 32, 96, 100, 576, 8960};
    for (size_t t = 0; t < 2; t++)
        for (size_t k = 0; k < sizeof fk / sizeof *fk; k++)
            for (size_t i = 0; i < sizeof ms / sizeof *ms; i++) {
                if (fk[k] * ms[i] > 600 * 576) continue; /* the float64 reference's cost */
                check_kernel(ft[t], 37 + 16 * (int64_t)(i % 3), fk[k], ms[i]);
            }
    static const td_dtype bt[] = {TD_Q4_0, TD_Q4_1, TD_Q8_0};
    static const int64_t bk[] = {32, 96, 576, 8960};
    for (size_t t = 0; t < 3; t++)
        for (size_t k = 0; k < sizeof bk / sizeof *bk; k++)
            for (size_t i = 0; i < sizeof ms / sizeof *ms; i++) {
                if (bk[k] * ms[i] > 600 * 576) continue;
                check_kernel(bt[t], 21 + 16 * (int64_t)(i % 4), bk[k], ms[i]);
            }
    static const td_dtype kt[] = {TD_Q4_K, TD_Q6_K};
    static const int64_t kk[] = {256, 768, 2304};
    for (size_t t = 0; t < 2; t++)
        for (size_t k = 0; k < sizeof kk / sizeof *kk; k++)
            for (size_t i = 0; i < sizeof ms / sizeof *ms; i++) {
                if (kk[k] * ms[i] > 600 * 576) continue;
                check_kernel(kt[t], 19 + 16 * (int64_t)(i % 4), kk[k], ms[i]);
            }
    printf("  worst AMX/sgemm row error ratio at K >= 256: %.2f; worst AMX row error %.2e\n",
           worst_ratio, worst_amx);
}

/* The backend's matmul (gemm path: 100 rows, 10 of them solo) with 1, 2 and 3 threads against
 * its sgemm path: errors as above, and the same bits at every thread count. */
static void test_backend(void)
{
    static const td_dtype types[] = {TD_F32, TD_F16, TD_Q4_0, TD_Q4_1, TD_Q8_0, TD_Q4_K, TD_Q6_K};
    const int64_t n_rows = 203, n_cols = 3 * 256, m = 100;
    for (size_t k = 0; k < sizeof types / sizeof *types; k++) {
        kn_mat w;
        uint8_t *buf = kt_make_w(&rng, types[k], n_rows, n_cols, &w);
        float *x = make_x(m, n_cols), *wd = dequant(&w);
        const size_t ny = (size_t)(m * n_rows);
        float *ys = malloc(ny * sizeof(float)), *ya = malloc(ny * sizeof(float)),
              *yt = malloc(ny * sizeof(float));
        double *ref = malloc(ny * sizeof(double));
        TH_REQUIRE(buf && x && wd && ys && ya && yt && ref);
        kt_ref_matmul(x, wd, m, n_rows, n_cols, ref, NULL);
        for (int th = 1; th <= 3; th++) {
            kn_cpu *c;
            TH_REQUIRE(kn_cpu_create(th, &c) == 0);
            kn_bf16amx_force_off(true);
            TH_REQUIRE(kn_cpu_matmul_mixed(c, &w, x, m, 10, ys) == 0);
            kn_bf16amx_force_off(false);
            kt_fill(ya, ny, SENTINEL);
            TH_REQUIRE(kn_cpu_matmul_mixed(c, &w, x, m, 10, ya) == 0);
            if (th == 1) memcpy(yt, ya, ny * sizeof(float));
            int64_t bad = 0;
            for (int64_t i = 0; i < m; i++) {
                const double ea = row_err(ya, ref, i, n_rows, n_rows),
                             es = row_err(ys, ref, i, n_rows, n_rows);
                bad += !(ea <= BF_RATIO * es || ea <= BF_FLOOR);
            }
            /* the solo rows take the dot path either way */
            TH_CHECKF(memcmp(ys, ya, 10 * (size_t)n_rows * sizeof(float)) == 0,
                      "%s: solo rows differ", td_dtype_name(types[k]));
            TH_CHECKF(bad == 0 && memcmp(yt, ya, ny * sizeof(float)) == 0,
                      "%s %d threads: %lld rows beyond %.0fx sgemm's error, or bits differ from 1 "
                      "thread",
                      td_dtype_name(types[k]), th, (long long)bad, BF_RATIO);
            kn_cpu_destroy(c);
        }
        free(buf), free(x), free(wd), free(ys), free(ya), free(yt), free(ref);
    }
}

int main(void)
{
    if (!kn_bf16amx_usable())
        return kt_skip("AMX-BF16 is not usable here (no AMX-BF16, the OS refused the tile "
                       "state, or TANDEM_CPU_AMX=0)");
    TH_RUN(test_kernel);
    TH_RUN(test_backend);
    TH_EXIT();
}
