/* bench_q8amx.c: the q8 mode's integer GEMMs on AMX-INT8 against AVX512-VNNI
 * (kn_q8_gemm_force_amx_off), alternated in one process, on the matrix shapes of Qwen2.5-0.5B,
 * Qwen2.5-1.5B and SmolLM2-135M, so the AMX form is judged against the one before it on the same
 * machine.
 *
 * Usage: bench_q8amx [threads [m [filter]]]   (default: 2 threads, m = 512 rows of x: a
 *                                              prefill chunk; filter: only the shapes whose
 *                                              name contains it)
 * Per weight type (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) and shape (rows x cols of W): GFLOP/s
 * (2 m rows cols per product) of the backend's matmul in the q8 mode, the median of several
 * passes, VNNI then AMX then VNNI again; every type through W mapped (the packed copy, as the
 * engine runs them: below 64 rows of x K-quants then take the packed dot, Q4_K on AMX from
 * KN_Q8K_DOT_AMX_MIN_M rows) and as it is (per-call panels; K-quants' row-wise dot below 64
 * rows). Not a test: prints figures only.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "cpu_q8act.h"
#include "kn_test_util.h"
#include "td_clock.h"
#include "td_dtype.h"

#define PASSES 7

static uint64_t rng = 0x2545f4914f6cdd1dull;

/* Median seconds of PASSES products (one warm-up first). */
static double time_product(kn_cpu *c, const kn_mat *w, const float *x, int64_t m, float *y)
{
    double t[PASSES];
    for (int p = -1; p < PASSES; p++) {
        const int64_t t0 = td_now_ns();
        if (kn_cpu_matmul(c, w, x, m, y)) return -1.0;
        if (p >= 0) t[p] = (double)(td_now_ns() - t0) * 1e-9;
    }
    return kt_median(t, PASSES);
}

int main(int argc, char **argv)
{
    const int threads = argc > 1 ? atoi(argv[1]) : 2;
    const int64_t m = argc > 2 ? atoll(argv[2]) : 512;
    const char *filter = argc > 3 ? argv[3] : "";
    static const struct {
        const char *what;
        int64_t rows, cols;
    } shapes[] = {
        {"qwen0.5b q/o", 896, 896},      {"qwen0.5b k/v", 128, 896},
        {"qwen0.5b gate/up", 4864, 896}, {"qwen0.5b down", 896, 4864},
        {"smol135m q/o", 576, 576},      {"smol135m k/v", 192, 576},
        {"smol135m gate/up", 1536, 576}, {"smol135m down", 576, 1536},
        {"qwen1.5b q/o", 1536, 1536},    {"qwen1.5b gate/up", 8960, 1536},
        {"qwen1.5b down", 1536, 8960},
    };
    static const td_dtype types[] = {TD_Q4_0, TD_Q4_1, TD_Q5_0, TD_Q8_0, TD_Q4_K, TD_Q6_K};
    if (!kn_q8_gemm_amx()) {
        printf("AMX-INT8 is not usable here (or TANDEM_CPU_AMX=0): nothing to compare\n");
        return 0;
    }
    printf("%d threads, m %lld, GFLOP/s (median of %d): vnni, amx, vnni again, amx / vnni\n",
           threads, (long long)m, PASSES);
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
        for (size_t k = 0; k < sizeof types / sizeof *types; k++) {
            const td_dtype t = types[k];
            const bool ktype = t == TD_Q4_K || t == TD_Q6_K;
            const int64_t rows = shapes[s].rows, cols = shapes[s].cols;
            if ((ktype && cols % 256) || !strstr(shapes[s].what, filter)) continue;
            void *data = kt_bench_weights(&rng, t, rows, cols, false);
            float *x = malloc((size_t)(m * cols) * sizeof(float));
            float *y = malloc((size_t)(m * rows) * sizeof(float));
            if (!data || !x || !y) return 1;
            for (int64_t i = 0; i < m * cols; i++)
                x[i] = (float)((kt_xorshift64(&rng) >> 24) & 0xff) / 128.0f - 1.0f;
            const kn_mat w = {.type = t,
                              .n_rows = rows,
                              .n_cols = cols,
                              .row_stride = td_dtype_row_bytes(t, cols),
                              .data = data};
            for (int mapped = 1; mapped >= 0; mapped--) {
                kn_cpu *c;
                if (kn_cpu_create(threads, &c)) return 1;
                kn_cpu_set_act_q8(c, true);
                if (mapped && kn_cpu_map_matrix(c, &w)) return 1;
                double g[3];
                for (int r = 0; r < 3; r++) {
                    kn_q8_gemm_force_amx_off(r != 1);
                    const double sec = time_product(c, &w, x, m, y);
                    if (sec <= 0) return 1;
                    g[r] = 2.0 * (double)m * (double)rows * (double)cols / sec * 1e-9;
                }
                kn_q8_gemm_force_amx_off(false);
                printf("%-17s %-5s %-8s %7.1f %7.1f %7.1f  %.2fx\n", shapes[s].what,
                       td_dtype_name(t), mapped ? "mapped" : "as is", g[0], g[1], g[2],
                       g[1] / (0.5 * (g[0] + g[2])));
                fflush(stdout);
                kn_cpu_destroy(c);
            }
            free(data), free(x), free(y);
        }
    return 0;
}
