/* cpu_ceilings.c: the machine's ceilings measured in the same run as a benchmark figure
 * (streaming read bandwidth, sgemm rate), so figures are reported as ratios to them. */
#include <cblas.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cpu_backend.h"
#include "cpu_internal.h"
#include "cpu_quant.h"
#include "td_clock.h"
#include "td_err.h"
#include "td_stats.h"

#define READ_DEFAULT_BYTES ((size_t)1 << 30) /* far beyond L3 (32 MiB here) */
#define SGEMM_DEFAULT_N    2048

/* ---- read bandwidth ---- */

#define READ_CHUNK 64 /* floats per pool item: one 256-byte stripe */

typedef struct {
    float *buf; /* (n_items, READ_CHUNK) */
    float sums[KN_CPU_MAX_THREADS];
} read_job;

static void fill_part(void *arg, int64_t i0, int64_t i1, int tid)
{
    read_job *j = arg;
    /* non-zero values, written by the thread that later reads them (first touch) */
    for (int64_t i = i0 * READ_CHUNK; i < i1 * READ_CHUNK; i++)
        j->buf[i] = (float)(i & 1023) * 0.25f + 1.0f;
}

static void sum_part(void *arg, int64_t i0, int64_t i1, int tid)
{
    read_job *j = arg;
    const float *p = j->buf + i0 * READ_CHUNK, *end = j->buf + i1 * READ_CHUNK;
    /* four independent accumulators: the loop must be limited by loads, not add latency */
    kn_vf a0 = kn_vzero(), a1 = kn_vzero(), a2 = kn_vzero(), a3 = kn_vzero();
    for (; p + 4 * KN_VL <= end; p += 4 * KN_VL) {
        a0 = kn_vadd(a0, kn_vload(p));
        a1 = kn_vadd(a1, kn_vload(p + KN_VL));
        a2 = kn_vadd(a2, kn_vload(p + 2 * KN_VL));
        a3 = kn_vadd(a3, kn_vload(p + 3 * KN_VL));
    }
    float s = kn_vsum(kn_vadd(kn_vadd(a0, a1), kn_vadd(a2, a3)));
    for (; p < end; p++)
        s += *p;
    j->sums[tid] = s;
}

double kn_cpu_mem_read_gbps(kn_cpu *c, size_t bytes, int reps)
{
    if (bytes == 0) bytes = READ_DEFAULT_BYTES;
    if (reps <= 0) reps = 5;
    const int64_t n_items = (int64_t)(bytes / (READ_CHUNK * sizeof(float)));
    if (n_items < 1) return 0.0;
    bytes = (size_t)n_items * READ_CHUNK * sizeof(float);
    read_job j = {0};
    void *p = NULL;
    if (posix_memalign(&p, 2 << 20, bytes)) {
        TD_LOG_ERR("mem_read_gbps: cannot allocate %zu bytes", bytes);
        return 0.0;
    }
    /* on huge pages, as the packed weight copies a decode step streams (cpu_packed.c): the
     * ceiling is the machine's, not its 4 KiB pages' */
    (void)madvise(p, bytes, MADV_HUGEPAGE);
    j.buf = p;
    double *t = malloc((size_t)reps * sizeof *t);
    if (!t) {
        free(p);
        return 0.0;
    }
    kn_pool_run(c->pool, n_items, 1, fill_part, &j);
    kn_pool_run(c->pool, n_items, 1, sum_part, &j); /* warm-up: TLB, thread wake-up */
    for (int r = 0; r < reps; r++) {
        int64_t t0 = td_now_ns();
        kn_pool_run(c->pool, n_items, 1, sum_part, &j);
        t[r] = 1e-9 * (double)(td_now_ns() - t0);
    }
    volatile float sink = 0;
    for (int i = 0; i < c->n_threads; i++)
        sink += j.sums[i]; /* keep the sums observable */
    (void)sink;
    double gbps = (double)bytes / td_stats_median(t, (size_t)reps) / 1e9;
    free(t);
    free(p);
    return gbps;
}

/* ---- sgemm rate ---- */

typedef struct {
    const float *a, *b; /* (n, n) each */
    float *cm;          /* (n, n) */
    int n;
} gemm_job;

/* Columns [i0, i1) of C = A B^T on one thread: how the matmul's gemm path uses sgemm. */
static void gemm_part(void *arg, int64_t i0, int64_t i1, int tid)
{
    gemm_job *g = arg;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, g->n, (blasint)(i1 - i0), g->n, 1.0f, g->a,
                g->n, g->b + i0 * g->n, g->n, 0.0f, g->cm + i0, g->n);
}

static double sgemm_median(kn_cpu *c, gemm_job *g, int reps, bool sliced, double *t)
{
    for (int r = -1; r < reps; r++) { /* r = -1: warm-up */
        int64_t t0 = td_now_ns();
        if (sliced)
            kn_pool_run(c->pool, g->n, 64, gemm_part, g);
        else
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, g->n, g->n, g->n, 1.0f, g->a, g->n,
                        g->b, g->n, 0.0f, g->cm, g->n);
        if (r >= 0) t[r] = 1e-9 * (double)(td_now_ns() - t0);
    }
    double n = g->n;
    return 2.0 * n * n * n / td_stats_median(t, (size_t)reps) / 1e9;
}

double kn_cpu_sgemm_gflops(kn_cpu *c, int n, int reps)
{
    if (n <= 0) n = SGEMM_DEFAULT_N;
    if (reps <= 0) reps = 3;
    size_t nn = (size_t)n * (size_t)n;
    float *a = malloc(nn * sizeof *a), *b = malloc(nn * sizeof *b), *cm = malloc(nn * sizeof *cm);
    double *t = malloc((size_t)reps * sizeof *t);
    double best = 0.0;
    if (!a || !b || !cm || !t) {
        TD_LOG_ERR("sgemm_gflops: cannot allocate 3 matrices of %d x %d", n, n);
        goto out;
    }
    for (size_t i = 0; i < nn; i++) {
        a[i] = (float)(i % 17) * 0.125f - 1.0f;
        b[i] = (float)(i % 13) * 0.25f - 1.5f;
    }
    gemm_job g = {.a = a, .b = b, .cm = cm, .n = n};
    /* both ways of using the cores, and the better one is the ceiling: OpenBLAS's own
     * threads on the whole product, and one single-threaded sgemm per pool thread */
    openblas_set_num_threads(c->n_threads);
    best = sgemm_median(c, &g, reps, false, t);
    openblas_set_num_threads(1);
    if (c->n_threads > 1) {
        double sliced = sgemm_median(c, &g, reps, true, t);
        if (sliced > best) best = sliced;
    }
out:
    free(a);
    free(b);
    free(cm);
    free(t);
    return best;
}
