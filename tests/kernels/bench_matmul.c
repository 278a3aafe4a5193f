/* bench_matmul.c: matmul throughput on the default model's shapes next to the machine's
 * ceilings measured in the same run (see docs/BENCHMARKING.md).
 *
 * Usage: bench_matmul [threads ...]   (default: 1 2)
 * Prints, per thread count: streaming read GB/s and sgemm 2048^3 GFLOP/s; for m = 1 the
 * weight bytes read per second per shape (cold: cycling over copies much larger than L3;
 * hot: one copy that stays in cache) and a whole decode step's matmuls (30 layers + LM
 * head, ~98 MB); for larger m the GFLOP/s per shape; for m = 64..256 the GFLOP/s of solo
 * rows (matmul_mixed: the batch-invariant dot path) next to the gemm path.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "kn_test_util.h"
#include "td_dtype.h"

typedef struct {
    const char *name;
    td_dtype type;
    int64_t rows, cols;
} shape;

/* SmolLM2-135M-like: hidden 576, 9 heads (3 KV) of 64, FFN 1536, vocab 49152, 30 layers */
static const shape shapes[] = {
    {"attn_q/o 576x576 Q4_1", TD_Q4_1, 576, 576},
    {"attn_k/v 192x576 Q4_1", TD_Q4_1, 192, 576},
    {"ffn_gate/up 1536x576 Q4_1", TD_Q4_1, 1536, 576},
    {"ffn_down 576x1536 Q4_1", TD_Q4_1, 576, 1536},
    {"lm_head 49152x576 Q8_0", TD_Q8_0, 49152, 576},
};
#define N_SHAPES   (int)(sizeof shapes / sizeof shapes[0])
#define N_LAYERS   30
#define COLD_BYTES ((size_t)256 << 20)

static uint64_t rng = 0x2545f4914f6cdd1dull;

static kn_mat mat_of(const shape *s, const void *data)
{
    return (kn_mat){.type = s->type,
                    .n_rows = s->rows,
                    .n_cols = s->cols,
                    .row_stride = td_dtype_row_bytes(s->type, s->cols),
                    .data = data};
}

/* Median seconds of reps passes over n_mats matrices of shape s at m rows of x, the first
 * solo of them solo rows (matmul_mixed). */
static double time_mixed(kn_cpu *c, const shape *s, void **mats, int n_mats, const float *x,
                         int64_t m, int64_t solo, float *y, int reps)
{
    double t[16];
    if (reps > 16) reps = 16;
    for (int r = -1; r < reps; r++) {
        double t0 = kt_now_s();
        for (int i = 0; i < n_mats; i++) {
            kn_mat w = mat_of(s, mats[i]);
            kn_cpu_matmul_mixed(c, &w, x, m, solo, y);
        }
        if (r >= 0) t[r] = kt_now_s() - t0;
    }
    return kt_median(t, reps);
}

/* Median seconds of reps passes over n_mats matrices of shape s at m rows of x. */
static double time_pass(kn_cpu *c, const shape *s, void **mats, int n_mats, const float *x,
                        int64_t m, float *y, int reps)
{
    double t[16];
    if (reps > 16) reps = 16;
    for (int r = -1; r < reps; r++) {
        double t0 = kt_now_s();
        for (int i = 0; i < n_mats; i++) {
            kn_mat w = mat_of(s, mats[i]);
            kn_cpu_matmul(c, &w, x, m, y);
        }
        if (r >= 0) t[r] = kt_now_s() - t0;
    }
    return kt_median(t, reps);
}

static void bench_threads(int n_threads)
{
    kn_cpu *c;
    if (kn_cpu_create(n_threads, &c)) return;
    const double read = kn_cpu_mem_read_gbps(c, 0, 5);
    const double peak = kn_cpu_sgemm_gflops(c, 2048, 3);
    printf("== %d thread(s), isa %s\n", n_threads, kn_cpu_isa());
    printf("ceilings: streaming read %.1f GB/s, sgemm 2048^3 %.1f GFLOP/s\n", read, peak);

    const int64_t max_m = 512, max_k = 1536, max_n = 49152;
    float *x = malloc((size_t)(max_m * max_k) * sizeof *x);
    float *y = malloc((size_t)(max_m * max_n) * sizeof *y);
    if (!x || !y) return;
    for (int64_t i = 0; i < max_m * max_k; i++)
        x[i] = (float)((i * 7919) % 2001 - 1000) * 1e-3f;

    printf("m = 1 (decode): weight GB/s, cold (> L3) and hot (cache-resident)\n");
    for (int si = 0; si < N_SHAPES; si++) {
        const shape *s = &shapes[si];
        const size_t bytes = td_dtype_row_bytes(s->type, s->cols) * (size_t)s->rows;
        int n_mats = (int)((COLD_BYTES + bytes - 1) / bytes);
        void **mats = calloc((size_t)n_mats, sizeof *mats);
        for (int i = 0; i < n_mats; i++)
            mats[i] = kt_bench_weights(&rng, s->type, s->rows, s->cols, true);
        double cold = time_pass(c, s, mats, n_mats, x, 1, y, 5);
        int hot_reps = (int)(COLD_BYTES / 4 / bytes) + 1;
        double hot = time_pass(c, s, mats, 1, x, 1, y, 9);
        double t0 = kt_now_s();
        for (int r = 0; r < hot_reps; r++) {
            kn_mat w = mat_of(s, mats[0]);
            kn_cpu_matmul(c, &w, x, 1, y);
        }
        double hot_avg = (kt_now_s() - t0) / hot_reps;
        if (hot_avg < hot) hot = hot_avg;
        printf("  %-28s cold %6.1f GB/s (%4.0f%% of read)  hot %6.1f GB/s  %7.1f us/call\n",
               s->name, (double)bytes * n_mats / cold / 1e9,
               100.0 * (double)bytes * n_mats / cold / 1e9 / read, (double)bytes / hot / 1e9,
               hot * 1e6);
        for (int i = 0; i < n_mats; i++)
            free(mats[i]);
        free(mats);
    }

    /* one decode step's matmuls in model order: 30 x (q k v o gate up down) + lm_head */
    const int per_layer[7] = {0, 1, 1, 0, 2, 2, 3};
    void *layer_w[N_LAYERS][7];
    size_t step_bytes = 0;
    for (int l = 0; l < N_LAYERS; l++)
        for (int i = 0; i < 7; i++) {
            const shape *s = &shapes[per_layer[i]];
            layer_w[l][i] = kt_bench_weights(&rng, s->type, s->rows, s->cols, true);
            step_bytes += td_dtype_row_bytes(s->type, s->cols) * (size_t)s->rows;
        }
    void *head = kt_bench_weights(&rng, shapes[4].type, shapes[4].rows, shapes[4].cols, true);
    step_bytes += td_dtype_row_bytes(shapes[4].type, shapes[4].cols) * (size_t)shapes[4].rows;
    /* then with the matrices registered as an engine registers its weights (map_matrix):
     * the q8 mode packs them once (cpu_packed.c; the q16 mode reads the copies too); they stay
     * alive until kn_cpu_destroy */
    for (int mapped = 0; mapped < 2; mapped++) {
        if (mapped && kn_cpu_act(c) == KN_CPU_ACT_F32) break;
        double ts[9];
        for (int r = -1; r < 9; r++) {
            double t0 = kt_now_s();
            for (int l = 0; l < N_LAYERS; l++)
                for (int i = 0; i < 7; i++) {
                    kn_mat w = mat_of(&shapes[per_layer[i]], layer_w[l][i]);
                    if (mapped) kn_cpu_map_matrix(c, &w);
                    kn_cpu_matmul(c, &w, x, 1, y);
                }
            kn_mat w = mat_of(&shapes[4], head);
            if (mapped) kn_cpu_map_matrix(c, &w);
            kn_cpu_matmul(c, &w, x, 1, y);
            if (r >= 0) ts[r] = kt_now_s() - t0;
        }
        const double med = kt_median(ts, 9);
        printf("  decode step matmuls%s (%.1f MB): %.2f ms = %.1f GB/s (%.0f%% of read; floor "
               "%.2f ms)\n",
               mapped ? ", weights packed" : "", step_bytes / 1e6, med * 1e3,
               step_bytes / med / 1e9, 100.0 * step_bytes / med / 1e9 / read,
               step_bytes / read / 1e6);
    }

    const int64_t ms[] = {2, 4, 8, 16, 32, 48, 64, 128, 512};
    printf("m > 1: GFLOP/s per shape (%% of sgemm peak)\n");
    for (int si = 0; si < N_SHAPES; si++) {
        const shape *s = &shapes[si];
        void *wm = kt_bench_weights(&rng, s->type, s->rows, s->cols, true);
        printf("  %-28s", s->name);
        for (int mi = 0; mi < (int)(sizeof ms / sizeof ms[0]); mi++) {
            const int64_t m = ms[mi];
            if (si == 4 && m > 64) continue; /* the LM head only runs on sampled rows */
            double t = time_pass(c, s, &wm, 1, x, m, y, 5);
            double gf = 2.0 * (double)m * s->rows * s->cols / t / 1e9;
            printf(" m%lld %.0f", (long long)m, gf);
            if (m == 512) printf(" (%.0f%%)", 100.0 * gf / peak);
        }
        printf("\n");
        free(wm);
    }

    /* decode rows past the gemm threshold stay on the dot path (batch invariance) */
    const int64_t big[] = {64, 128, 256};
    printf("m = 64..256: GFLOP/s, all rows solo (dot path) / gemm path / 4 solo + m gemm rows "
           "against m gemm rows alone (s)\n");
    for (int si = 0; si < N_SHAPES - 1; si++) {
        const shape *s = &shapes[si];
        void *wm = kt_bench_weights(&rng, s->type, s->rows, s->cols, true);
        printf("  %-28s", s->name);
        for (int mi = 0; mi < 3; mi++) {
            const int64_t m = big[mi];
            const double fl = 2.0 * (double)m * s->rows * s->cols;
            double td = time_mixed(c, s, &wm, 1, x, m, m, y, 5);
            double tg = time_pass(c, s, &wm, 1, x, m, y, 5);
            double tm = time_mixed(c, s, &wm, 1, x, m + 4, 4, y, 5);
            printf("  m%lld dot %.0f gemm %.0f mix %.2f", (long long)m, fl / td / 1e9,
                   fl / tg / 1e9, tm / tg);
        }
        printf("\n");
        free(wm);
    }
    for (int l = 0; l < N_LAYERS; l++)
        for (int i = 0; i < 7; i++)
            free(layer_w[l][i]);
    free(head);
    free(x);
    free(y);
    kn_cpu_destroy(c);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        bench_threads(1);
        bench_threads(2);
    }
    for (int i = 1; i < argc; i++)
        bench_threads(atoi(argv[i]));
    return 0;
}
