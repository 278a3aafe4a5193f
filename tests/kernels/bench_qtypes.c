/* bench_qtypes.c: the matmul paths of every 32-weight block type side by side on one shape,
 * measured in the same run, so a new type's kernels can be judged against the ones before it.
 *
 * Usage: bench_qtypes [threads [rows cols]]   (default: 1 thread, 4864 x 896, the FFN
 *                                              gate/up of Qwen2.5-0.5B)
 * Per type, on a weight matrix of rows x cols:
 *   m = 1 (decode): weight rows per second and GB/s, cold (cycling over copies much larger
 *   than L3) and hot (one copy, cache-resident when it fits);
 *   m = 8 (dot path) and m = 256 (dequantize + sgemm path): GFLOP/s.
 * Medians of several passes; the streaming read ceiling is printed for scale.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "kn_test_util.h"
#include "td_clock.h"
#include "td_dtype.h"

static const td_dtype types[] = {TD_Q4_0, TD_Q4_1, TD_Q5_0, TD_Q5_1, TD_Q8_0};
#define N_TYPES    (int)(sizeof types / sizeof types[0])
#define COLD_BYTES ((size_t)256 << 20)
#define MAX_PASSES 16

static uint64_t rng = 0x2545f4914f6cdd1dull;

/* Median seconds of passes over n_mats matrices at m rows of x (one warm-up pass first). */
static double time_pass(kn_cpu *c, kn_mat w, void **mats, int n_mats, const float *x, int64_t m,
                        float *y, int passes)
{
    double t[MAX_PASSES];
    if (passes > MAX_PASSES) passes = MAX_PASSES;
    for (int p = -1; p < passes; p++) {
        const int64_t t0 = td_now_ns();
        for (int i = 0; i < n_mats; i++) {
            w.data = mats[i];
            if (kn_cpu_matmul(c, &w, x, m, y)) return -1.0;
        }
        if (p >= 0) t[p] = (double)(td_now_ns() - t0) * 1e-9;
    }
    return kt_median(t, passes);
}

static int bench_type(kn_cpu *c, td_dtype t, int64_t rows, int64_t cols, const float *x, float *y)
{
    const size_t bytes = td_dtype_row_bytes(t, cols) * (size_t)rows;
    const int n_mats = (int)((COLD_BYTES + bytes - 1) / bytes);
    void **mats = calloc((size_t)n_mats, sizeof *mats);
    if (!mats) return -1;
    int rc = 0;
    for (int i = 0; i < n_mats && !rc; i++)
        if (!(mats[i] = kt_bench_weights(&rng, t, rows, cols, true))) rc = -1;
    const kn_mat w = {
        .type = t, .n_rows = rows, .n_cols = cols, .row_stride = td_dtype_row_bytes(t, cols)};
    if (!rc) {
        const double cold = time_pass(c, w, mats, n_mats, x, 1, y, 5) / n_mats;
        const double hot = time_pass(c, w, mats, 1, x, 1, y, 15);
        const double t8 = time_pass(c, w, mats, 1, x, 8, y, 9);
        const double t256 = time_pass(c, w, mats, 1, x, 256, y, 5);
        if (cold < 0 || hot < 0 || t8 < 0 || t256 < 0) {
            rc = -1;
        } else {
            const double fl = 2.0 * (double)rows * (double)cols;
            printf("  %-5s %5.2f B/w  m1 cold %6.2f Mrows/s %5.1f GB/s  hot %6.2f Mrows/s "
                   "%5.1f GB/s  m8 %5.1f GFLOP/s  m256 %5.1f GFLOP/s\n",
                   td_dtype_name((uint32_t)t), (double)bytes / (double)(rows * cols),
                   (double)rows / cold / 1e6, (double)bytes / cold / 1e9, (double)rows / hot / 1e6,
                   (double)bytes / hot / 1e9, 8 * fl / t8 / 1e9, 256 * fl / t256 / 1e9);
        }
    }
    for (int i = 0; i < n_mats; i++)
        free(mats[i]);
    free(mats);
    return rc;
}

int main(int argc, char **argv)
{
    const int n_threads = argc > 1 ? atoi(argv[1]) : 1;
    const int64_t rows = argc > 3 ? atoll(argv[2]) : 4864, cols = argc > 3 ? atoll(argv[3]) : 896;
    if (n_threads < 1 || rows < 1 || cols < 32 || cols % 32 || cols > (1 << 20)) {
        fprintf(stderr, "usage: bench_qtypes [threads [rows cols]] (cols a multiple of 32)\n");
        return 2;
    }
    kn_cpu *c;
    if (kn_cpu_create(n_threads, &c)) return 1;
    float *x = malloc((size_t)(256 * cols) * sizeof *x);
    float *y = malloc((size_t)(256 * rows) * sizeof *y);
    if (!x || !y) return 1;
    for (int64_t i = 0; i < 256 * cols; i++)
        x[i] = (float)((i * 7919) % 2001 - 1000) * 1e-3f;
    printf("== %d thread(s), isa %s, W %lld x %lld, streaming read %.1f GB/s\n", n_threads,
           kn_cpu_isa(), (long long)rows, (long long)cols, kn_cpu_mem_read_gbps(c, 0, 5));
    int rc = 0;
    for (int i = 0; i < N_TYPES && !rc; i++)
        rc = bench_type(c, types[i], rows, cols, x, y);
    free(x);
    free(y);
    kn_cpu_destroy(c);
    return rc ? 1 : 0;
}
