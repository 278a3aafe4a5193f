/* bench_kquant.c: K-quant and IQ4 matmul speed next to Q4_1's on the same shape, in the
 * same run.
 *
 * Usage: bench_kquant [threads [rows cols]]   (default: 1 thread, 8960 x 1536, the FFN
 * gate/up shape of Qwen2.5-1.5B)
 * Prints per type: m = 1 dot rows/s and weight GB/s, hot (one matrix that stays in cache)
 * and cold (cycling over copies totalling ~256 MB, beyond L3), then GFLOP/s at m = 8 (dot
 * path) and m = 256 (gemm path), and on a second line the cold time at m = 2, 4, 9, 16 (the
 * rows of a decode step: a batch, or a row with its verification rows) against m = 1's.
 * Random quants with small finite scales.
 * With TANDEM_CPU_ACT=q8, a second line per type ("mapped") times the same products over
 * matrices registered with kn_cpu_map_matrix, as the engine's weights are: the types the q8
 * mode packs (cpu_packed.c) then run their packed kernels.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "kn_test_util.h"
#include "td_dtype.h"

#define COLD_BYTES ((size_t)256 << 20)

static uint64_t rng = 0x9e3779b97f4a7c15ull;

/* Median seconds of one matmul pass over n matrices (cycled) at m rows of x. */
static kn_mat mat_of(td_dtype t, uint8_t *w, int64_t rows, int64_t cols)
{
    return (kn_mat){.type = t,
                    .n_rows = rows,
                    .n_cols = cols,
                    .row_stride = td_dtype_row_bytes(t, cols),
                    .data = w};
}

static double time_pass(kn_cpu *c, td_dtype t, uint8_t **w, int n, int64_t rows, int64_t cols,
                        const float *x, int64_t m, float *y)
{
    double ts[9];
    for (int r = -1; r < 9; r++) {
        const double t0 = kt_now_s();
        for (int i = 0; i < n; i++) {
            const kn_mat km = mat_of(t, w[i], rows, cols);
            kn_cpu_matmul(c, &km, x, m, y);
        }
        if (r >= 0) ts[r] = (kt_now_s() - t0) / n;
    }
    return kt_median(ts, 9);
}

int main(int argc, char **argv)
{
    const int threads = argc > 1 ? atoi(argv[1]) : 1;
    const int64_t rows = argc > 3 ? atoll(argv[2]) : 8960, cols = argc > 3 ? atoll(argv[3]) : 1536;
    if (threads < 1 || rows < 1 || cols < 256 || cols % 256) {
        fprintf(stderr, "usage: bench_kquant [threads [rows cols]] (cols a multiple of 256)\n");
        return 2;
    }
    float *x = malloc((size_t)(256 * cols) * sizeof *x), *y = malloc((size_t)(256 * rows) * 4);
    if (!x || !y) return 1;
    for (int64_t i = 0; i < 256 * cols; i++)
        x[i] = (float)((i * 7919) % 2001 - 1000) / 1000.0f;
    printf("isa %s, %d thread(s), %lld x %lld\n", kn_cpu_isa(), threads, (long long)rows,
           (long long)cols);
    const td_dtype types[] = {TD_Q4_1, TD_Q2_K, TD_Q3_K,   TD_Q4_K,  TD_Q5_K,
                              TD_Q6_K, TD_Q8_0, TD_IQ4_NL, TD_IQ4_XS};
    const char *act = getenv("TANDEM_CPU_ACT");
    const int passes = act && !strcmp(act, "q8") ? 2 : 1;
    for (int ti = 0; ti < (int)(sizeof types / sizeof *types); ti++)
        for (int mapped = 0; mapped < passes; mapped++) {
            const td_dtype t = types[ti];
            kn_cpu *c; /* one per pass: a registration must not outlive its matrix */
            if (kn_cpu_create(threads, &c)) return 1;
            const size_t mb = td_dtype_row_bytes(t, cols) * (size_t)rows;
            int n = (int)(COLD_BYTES / mb) + 1;
            if (n > 4096) n = 4096;
            uint8_t **w = malloc((size_t)n * sizeof *w);
            if (!w) return 1;
            for (int i = 0; i < n; i++)
                if (!(w[i] = kt_bench_weights(&rng, t, rows, cols, false))) return 1;
            for (int i = 0; mapped && i < n; i++) {
                const kn_mat km = mat_of(t, w[i], rows, cols);
                kn_cpu_map_matrix(c, &km);
            }
            const double hot = time_pass(c, t, w, 1, rows, cols, x, 1, y);
            const double cold = time_pass(c, t, w, n, rows, cols, x, 1, y);
            const double m8 = time_pass(c, t, w, 1, rows, cols, x, 8, y);
            static const int64_t cm[] = {2, 4, 9, 16}; /* a decode step's rows, cold weights */
            double cold_m[4];
            for (int k = 0; k < 4; k++)
                cold_m[k] = time_pass(c, t, w, n, rows, cols, x, cm[k], y);
            const double m256 = time_pass(c, t, w, 1, rows, cols, x, 256, y);
            const double fl = 2.0 * (double)rows * (double)cols;
            printf("  %-5s %s m1 hot %6.2f Mrows/s %5.1f GB/s | cold %6.2f Mrows/s %5.1f GB/s | "
                   "m8 %5.1f GFLOP/s | m256 %5.1f GFLOP/s\n",
                   td_dtype_name(t), mapped ? "mapped" : "      ", rows / hot / 1e6, mb / hot / 1e9,
                   rows / cold / 1e6, mb / cold / 1e9, 8 * fl / m8 / 1e9, 256 * fl / m256 / 1e9);
            printf("        cold, time against m = 1: m2 %.2fx m4 %.2fx m9 %.2fx m16 %.2fx\n",
                   cold_m[0] / cold, cold_m[1] / cold, cold_m[2] / cold, cold_m[3] / cold);
            for (int i = 0; i < n; i++)
                free(w[i]);
            free(w);
            kn_cpu_destroy(c); /* with the copies of the freed matrices */
        }
    free(x);
    free(y);
    return 0;
}
