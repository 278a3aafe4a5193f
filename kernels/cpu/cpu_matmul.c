/* cpu_matmul.c: y = x W^T for every weight type the CPU backend supports, and the
 * embedding lookup (get_rows).
 *
 * Two paths, chosen by the number of rows m of x:
 *  - dot path (decode and small batches, m < MM_GEMM_MIN_M, and every solo row of
 *    matmul_mixed): the pool splits W's rows;
 *    each thread streams its rows once, dequantizing every block in registers and
 *    dotting it against all m rows of x (float32 throughout). At m == 1 weight bytes
 *    dominate, so the goal is to read them at memory speed: four rows of W at a time
 *    (independent chains hide the FMA latency) with software prefetch; for m > 1 two
 *    rows of W times up to four rows of x, so each block is dequantized once per four
 *    rows of x and the kernel is FMA-bound. Every row of x gets the arithmetic of m == 1,
 *    so its result does not depend on the other rows (batch-invariant).
 *  - gemm path (prefill): each thread dequantizes slices of its rows of W to float32 in its
 *    scratch and hands them to single-threaded OpenBLAS sgemm, which writes the matching
 *    columns of y. Dequantization is O(n_rows * n_cols), amortized over m rows of x.
 *    sgemm's rounding depends on the batch, so a row's result may change with m. Where
 *    AMX-BF16 is usable (kn_bf16amx_usable; TANDEM_CPU_AMX=0 turns it off) the gemm path
 *    instead splits x once per call and each slice of W into bf16 hi and lo parts and runs
 *    three bf16 products on AMX tiles (cpu_bf16amx.h: about 2^-17 relative error, six
 *    products and float32's accuracy when built with KN_BF16AMX_PARTS=3; a row's bits do not
 *    depend on m), for every weight type the gemm path takes, F32 included.
 * In the q8 mode (kn_cpu_set_act_q8) the dot path of Q4_K and Q6_K weights quantizes its rows
 * of x to 8 bits once per call and runs cpu_q8act.c's integer dots; Q4_0, Q4_1, Q5_0 and Q8_0
 * weights send every row (solo and batch, any m) through cpu_q8gemm.c's integer GEMM, whose
 * per-row bits do not depend on m, so matmul_mixed's contract holds for all rows; a matrix
 * the engine registered (kn_cpu_map_matrix) is packed for it once (cpu_packed.c), same bits.
 * Mapped Q4_K and Q6_K matrices take the dot path through their packed copy (cpu_q8kpack.c; Q4_K
 * on AMX-INT8 tiles from KN_Q8K_DOT_AMX_MIN_M rows of x, same bits).
 * With AVX512-VNNI the gemm path's batch rows of Q4_K and Q6_K take cpu_q8kgemm.c's integer
 * GEMM in that mode instead of dequantize + sgemm (x in 32-blocks; per-row bits independent of
 * m there too), each thread running the solo rows' dots over the same 16-row groups first.
 * In the q16 mode (KN_CPU_ACT_Q16) the dot path's rows of Q4_0, Q4_1, Q5_0 and Q8_0 weights are
 * quantized to 16 bits once per call and take cpu_q16act.c's integer dots (through the q8
 * mode's packed copy of a registered matrix, read by 16-row groups); the other types stay
 * float32, and so do the gemm path's batch rows where AMX-BF16 runs them (mm_gemm_rows: without
 * it, with AVX512-VNNI, the q16 dots take every row, faster than dequantize + sgemm).
 * matmul_mixed (solo rows first, then batch rows): when the batch rows take the gemm path,
 * each thread runs the dot path for the solo rows over a slice of W's rows just before it
 * dequantizes that slice for sgemm, so the slice is read from memory once.
 */
#include <cblas.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "cpu_backend.h"
#include "cpu_bf16amx.h"
#include "cpu_internal.h"
#include "cpu_q16act.h"
#include "cpu_q8act.h"
#include "cpu_quant.h"
#include "cpu_traits.h"
#include "td_err.h"

/* Tunables (overridable with -D for experiments). Figures from bench_matmul on a 2-core
 * AVX-512 EPYC, default model shapes, Q4_1.
 * MM_GEMM_MIN_M: smallest m that takes the gemm path. The dot path reaches 95-120 GFLOP/s
 * per thread from m = 4 to 48 (the weights are dequantized once per 4 rows of x, from L1),
 * while dequantize + sgemm only passes 90 GFLOP/s from m = 64 on and reaches ~100 at 512. */
#ifndef MM_GEMM_MIN_M
#define MM_GEMM_MIN_M 64
#endif
/* The dot path gives each thread at least this many weight bytes: a fork-join costs a
 * few hundred ns, about what one thread needs to stream 8 KiB. */
#define MM_DOT_MIN_BYTES (16 * 1024)
/* Software prefetch distance along each row stream of the dot path, in bytes. The
 * hardware prefetcher alone left single-thread reads of cold weights at 7-8 GB/s (latency
 * bound); 4-8 KiB ahead doubles that. */
#ifndef MM_PREFETCH
#define MM_PREFETCH 8192
#endif
/* The gemm path dequantizes a slice of W's rows to float32 per sgemm call: at least
 * MM_GEMM_SLICE_MIN_ROWS rows, more while they fit in MM_GEMM_SLICE_BYTES. Each call
 * packs all of x again (m x k floats), so a slice of few rows makes the packing as costly as
 * the multiply: with the 1 MiB bound alone ffn_down of Qwen2.5 1.5B (k = 8960) got 29 rows
 * per call and prefill ran at 0.66 of the sgemm rate; 512 rows: 0.88 (pp512 1.36x on the
 * 1.5B, 1.16x on the 0.5B, 1.03x on the default model: BENCHMARKS.md, "Against llama.cpp
 * on a quiet machine"). The cost is scratch: up to 512 k floats per thread (18 MiB at
 * k = 8960). */
#ifndef MM_GEMM_SLICE_BYTES
#define MM_GEMM_SLICE_BYTES (1024 * 1024)
#endif
#ifndef MM_GEMM_SLICE_MIN_ROWS
#define MM_GEMM_SLICE_MIN_ROWS 512
#endif
#define MM_GEMM_MIN_ROWS 16 /* per thread and per sgemm call */

typedef struct {
    kn_cpu *c;
    const kn_mat *w;
    /* dot path rows */
    const float *x;     /* (m, n_cols) */
    const float *xsum;  /* (m, n_cols / g) sums of x over groups of g, the type's xsum_group
                         * (cpu_traits.h), when g > 0; else NULL */
    const void *xq;     /* (m, kn_q8_row_bytes) x quantized to 8 bits (q8 mode); else NULL */
    const void *xq16;   /* (m, kn_q16_row_bytes) x quantized to 16 bits (q16 mode); else NULL */
    const void *packed; /* q8 mode, K-quant W, or q16 mode: W's packed copy (cpu_packed.c), or
                           NULL */
    int64_t m;          /* 0: none */
    float *y;           /* (m, n_rows) */
    /* gemm path rows */
    const float *gx; /* (gm, n_cols) */
    const void *gxb; /* gx packed for the AMX-BF16 products (kn_bf16amx_pack_x), or NULL */
    const void *gxq; /* q8 mode, K-quant W: gx quantized to kn_q8b blocks (kn_q8k_gemm) */
    int64_t gm;      /* 0: none */
    float *gy;       /* (gm, n_rows) */
    atomic_int err;
} mm_job;

static pthread_once_t blas_once = PTHREAD_ONCE_INIT;

/* Our pool already occupies every core; OpenBLAS threads on top would only contend. */
static void blas_single_thread(void)
{
    openblas_set_num_threads(1);
}

/* ---- dot path ---- */

/* y[j * ldy + r] = dot(row r of W, row j of x) for R rows of a block-quantized W starting
 * at w (row stride ws) and M rows of x (row stride ldx), nb blocks per row.
 * The quants stay unscaled and d is applied once per block and row of x; for Q4_1/Q5_1
 * the offsets contribute m * sum(x over the block), taken from xs ((M, nb), row stride nb). */
KN_ALWAYS_INLINE void qdot(td_dtype t, int R, int M, const uint8_t *w, size_t ws, int64_t nb,
                           const float *x, int64_t ldx, const float *xs, float *y, int64_t ldy)
{
    const size_t bs = kn_q_block_bytes(t);
    kn_vf acc[4][4];
    float macc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < M; j++) {
            acc[r][j] = kn_vzero();
            macc[r][j] = 0.0f;
        }
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * TD_QK;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = w + (size_t)r * ws + (size_t)b * bs;
#if MM_PREFETCH
            __builtin_prefetch(blk + MM_PREFETCH);
#endif
            kn_vf q[KN_NV];
            kn_q_load(t, blk, q);
            const kn_vf vd = kn_vset1(kn_h2f(blk));
            /* Every row of x gets exactly the arithmetic of the m == 1 case (unscaled quants
             * dotted with the row, then one multiply-add by d; Q4_1 offsets through the
             * block sums), so a row's result does not depend on which other rows share the
             * batch: decode outputs are the same whether a request runs alone or batched.
             * The block is loaded once for all M rows either way. */
#pragma GCC unroll 4
            for (int j = 0; j < M; j++) {
                const float *xj = xb + j * ldx;
                kn_vf p = kn_vmul(q[0], kn_vload(xj));
#pragma GCC unroll 32
                for (int k = 1; k < KN_NV; k++)
                    p = kn_vfma(q[k], kn_vload(xj + k * KN_VL), p);
                acc[r][j] = kn_vfma(p, vd, acc[r][j]);
                if (kn_q_has_min(t))
                    macc[r][j] = kn_fmaf(kn_h2f(blk + 2), xs[j * nb + b], macc[r][j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < M; j++)
            y[j * ldy + r] = kn_vsum(acc[r][j]) + macc[r][j];
}

/* The same for a float-like W (F32, F16, BF16) of n columns (any n). */
KN_ALWAYS_INLINE void fdot(td_dtype t, int R, int M, const uint8_t *w, size_t ws, int64_t n,
                           const float *x, int64_t ldx, float *y, int64_t ldy)
{
    const size_t es = t == TD_F32 ? 4 : 2;
    kn_vf acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < M; j++)
            acc[r][j] = kn_vzero();
    int64_t i = 0;
    for (; i + KN_VL <= n; i += KN_VL) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const kn_vf wv = kn_f_load(t, w + (size_t)r * ws + (size_t)i * es);
#pragma GCC unroll 4
            for (int j = 0; j < M; j++)
                acc[r][j] = kn_vfma(wv, kn_vload(x + j * ldx + i), acc[r][j]);
        }
    }
    float s[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < M; j++)
            s[r][j] = kn_vsum(acc[r][j]);
    for (; i < n; i++)
        for (int r = 0; r < R; r++) {
            const float wv = kn_f_load1(t, w + (size_t)r * ws + (size_t)i * es);
            for (int j = 0; j < M; j++)
                s[r][j] = kn_fmaf(wv, x[j * ldx + i], s[r][j]);
        }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < M; j++)
            y[j * ldy + r] = s[r][j];
}

/* R rows of W from row r against rows [i, i + M) of x. */
KN_ALWAYS_INLINE void dot_tile(td_dtype t, int R, int M, const mm_job *j, int64_t r, int64_t i)
{
    const kn_mat *w = j->w;
    const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * w->row_stride;
    const float *x = j->x + i * w->n_cols;
    float *y = j->y + i * w->n_rows + r;
    if (t == TD_Q8_0 || t == TD_Q4_0 || t == TD_Q4_1 || t == TD_Q5_0 || t == TD_Q5_1 ||
        t == TD_IQ4_NL)
        qdot(t, R, M, wr, w->row_stride, w->n_cols / TD_QK, x, w->n_cols,
             j->xsum ? j->xsum + i * (w->n_cols / TD_QK) : NULL, y, w->n_rows);
    else
        fdot(t, R, M, wr, w->row_stride, w->n_cols, x, w->n_cols, y, w->n_rows);
}

/* Rows [R x M) tiles over rows [r, r + R) of W and all rows of x. */
KN_ALWAYS_INLINE void dot_rows(td_dtype t, int R, const mm_job *j, int64_t r)
{
    int64_t i = 0;
    for (; i + 4 <= j->m; i += 4)
        dot_tile(t, R, 4, j, r, i);
    switch (j->m - i) {
    case 3:
        dot_tile(t, R, 3, j, r, i);
        break;
    case 2:
        dot_tile(t, R, 2, j, r, i);
        break;
    case 1:
        dot_tile(t, R, 1, j, r, i);
        break;
    default:
        break;
    }
}

KN_ALWAYS_INLINE void dot_range(td_dtype t, const mm_job *j, int64_t r0, int64_t r1)
{
    int64_t r = r0;
    if (j->m == 1) {
        for (; r + 4 <= r1; r += 4)
            dot_tile(t, 4, 1, j, r, 0);
        for (; r < r1; r++)
            dot_tile(t, 1, 1, j, r, 0);
        return;
    }
    for (; r + 2 <= r1; r += 2)
        dot_rows(t, 2, j, r);
    for (; r < r1; r++)
        dot_rows(t, 1, j, r);
}

/* The float32 dot kernels of cpu_traits.h's table: one specialised copy of the dot path per
 * type, so every inner loop is branch-free. */
#define MM_DOT(name, T)                                                                            \
    void name(const kn_mat *w, const float *x, const float *xs, int64_t m, float *y, int64_t r0,   \
              int64_t r1)                                                                          \
    {                                                                                              \
        const mm_job j = {.w = w, .x = x, .xsum = xs, .m = m, .y = y};                             \
        dot_range(T, &j, r0, r1);                                                                  \
    }
MM_DOT(kn_cpu_dot_f32, TD_F32)
MM_DOT(kn_cpu_dot_f16, TD_F16)
MM_DOT(kn_cpu_dot_bf16, TD_BF16)
MM_DOT(kn_cpu_dot_q8_0, TD_Q8_0)
MM_DOT(kn_cpu_dot_q4_0, TD_Q4_0)
MM_DOT(kn_cpu_dot_q4_1, TD_Q4_1)
MM_DOT(kn_cpu_dot_q5_0, TD_Q5_0)
MM_DOT(kn_cpu_dot_q5_1, TD_Q5_1)
MM_DOT(kn_cpu_dot_iq4_nl, TD_IQ4_NL)

/* Rows [r0, r1) of W against the dot rows of x: the q8 or q16 mode's integer dots when x was
 * quantized for them, else the type's float32 dot (mm_check accepted the type). */
static void mm_dot_part(void *arg, int64_t r0, int64_t r1, int tid)
{
    const mm_job *j = arg;
    if (j->xq16) {
        kn_q16_dot(j->w, j->packed, j->xq16, j->m, j->y, r0, r1);
        return;
    }
    if (j->xq) {
        kn_q8_dot(j->w, j->packed, j->xq, j->m, j->y, r0, r1);
        return;
    }
    kn_cpu_traits_of(j->w->type)->dot(j->w, j->x, j->xsum, j->m, j->y, r0, r1);
}

/* mm_dot_part on the rows of 16-row groups [g0, g1). */
static void mm_dot_groups(void *arg, int64_t g0, int64_t g1, int tid)
{
    const mm_job *j = arg;
    mm_dot_part(arg, 16 * g0, 16 * g1 < j->w->n_rows ? 16 * g1 : j->w->n_rows, tid);
}

/* xs (n / g) = sums of x (n floats) over each group of g (32, or Q2_K's 16; a multiple of
 * KN_VL). */
static void block_sums(const float *x, int64_t n, int g, float *xs)
{
    for (int64_t i = 0; i < n / g; i++) {
        const float *xb = x + i * g;
        kn_vf s = kn_vload(xb);
        for (int k = 1; k < g / KN_VL; k++)
            s = kn_vadd(s, kn_vload(xb + k * KN_VL));
        xs[i] = kn_vsum(s);
    }
}

/* ---- gemm path ---- */

/* The gemm rows of rows [r0, r1) of W; the dot rows too (if any), slice by slice. */
static void mm_gemm_part(void *arg, int64_t r0, int64_t r1, int tid)
{
    mm_job *j = arg;
    const kn_mat *w = j->w;
    const int64_t k = w->n_cols;
    const uint8_t *base = (const uint8_t *)w->data;
    if (w->type == TD_F32 && w->row_stride % sizeof(float) == 0 &&
        (uintptr_t)w->data % sizeof(float) == 0) {
        /* already float32: sgemm reads W in place */
        if (j->m) mm_dot_part(j, r0, r1, tid);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)j->gm, (blasint)(r1 - r0),
                    (blasint)k, 1.0f, j->gx, (blasint)k,
                    (const float *)(const void *)(base + (size_t)r0 * w->row_stride),
                    (blasint)(w->row_stride / sizeof(float)), 0.0f, j->gy + r0, (blasint)w->n_rows);
        return;
    }
    int64_t slice = MM_GEMM_SLICE_BYTES / (k * (int64_t)sizeof(float));
    if (slice < MM_GEMM_SLICE_MIN_ROWS) slice = MM_GEMM_SLICE_MIN_ROWS;
    if (slice > r1 - r0) slice = r1 - r0;
    float *buf = kn_cpu_scratch(j->c, tid, (size_t)(slice * k)); /* (slice, k) */
    if (!buf) {
        atomic_store(&j->err, TD_ENOMEM);
        return;
    }
    for (int64_t r = r0; r < r1; r += slice) {
        const int64_t n = r1 - r < slice ? r1 - r : slice;
        if (j->m) mm_dot_part(j, r, r + n, tid);
        for (int64_t i = 0; i < n; i++)
            kn_dequant_row(w->type, base + (size_t)(r + i) * w->row_stride, buf + i * k, k);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)j->gm, (blasint)n, (blasint)k,
                    1.0f, j->gx, (blasint)k, buf, (blasint)k, 0.0f, j->gy + r, (blasint)w->n_rows);
    }
}

/* The gemm rows of 32-row groups [g0, g1) of W on AMX-BF16 (kn_bf16amx_rows, x packed in
 * j->gxb), slice by slice, each after the dot rows' dots over it (as mm_gemm_part). */
static void mm_bf16_part(void *arg, int64_t g0, int64_t g1, int tid)
{
    mm_job *j = arg;
    const kn_mat *w = j->w;
    const int64_t r0 = 32 * g0, r1 = 32 * g1 < w->n_rows ? 32 * g1 : w->n_rows;
    const int64_t slice = r1 - r0 < KN_BF16AMX_SLICE_ROWS ? r1 - r0 : KN_BF16AMX_SLICE_ROWS;
    const size_t bytes = kn_bf16amx_scratch_bytes(slice, w->n_cols);
    void *buf = kn_cpu_scratch(j->c, tid, (bytes + 3) / sizeof(float));
    if (!buf) {
        atomic_store(&j->err, TD_ENOMEM);
        return;
    }
    for (int64_t r = r0; r < r1; r += slice) {
        const int64_t n = r1 - r < slice ? r1 - r : slice;
        if (j->m) mm_dot_part(j, r, r + n, tid);
        const int rc = kn_bf16amx_rows(w, r, n, j->gxb, j->gm, j->gy + r, w->n_rows, buf);
        if (rc) {
            atomic_store(&j->err, rc);
            return;
        }
    }
}

/* Pairs [p0, p1) of the gemm rows' 16-row tiles of x packed for AMX-BF16 into j->gxb. */
static void mm_bf16_pack_part(void *arg, int64_t p0, int64_t p1, int tid)
{
    const mm_job *j = arg;
    kn_bf16amx_pack_x(j->gx, j->gm, j->w->n_cols, 2 * p0, 2 * p1, (void *)j->gxb);
}

/* The q8 mode's gemm rows of K-quant weights (kn_q8k_gemm): the dot rows and the gemm rows
 * of groups [g0, g1) of 16 rows of W. */
static void mm_q8k_part(void *arg, int64_t g0, int64_t g1, int tid)
{
    mm_job *j = arg;
    const int64_t r0 = 16 * g0, r1 = 16 * g1 < j->w->n_rows ? 16 * g1 : j->w->n_rows;
    if (j->m) mm_dot_part(j, r0, r1, tid);
    const size_t bytes = kn_q8k_gemm_panel_bytes(j->w->n_cols);
    void *panel = kn_cpu_scratch(j->c, tid, (bytes + 3) / sizeof(float));
    if (!panel) {
        atomic_store(&j->err, TD_ENOMEM);
        return;
    }
    kn_q8k_gemm(j->w, j->gxq, j->gm, j->gy, j->w->n_rows, g0, g1, panel);
}

/* ---- q8 integer GEMM (32-block weights) ---- */

typedef struct {
    kn_cpu *c;
    const kn_mat *w;
    const void *packed; /* w packed once (cpu_packed.c), or NULL */
    const void *xq;
    int64_t m;
    float *y;
    int G;
    atomic_int err;
} q8g_job;

/* Whether kn_q8_gemm runs without a panel: W packed, read by 16-row groups (a packed copy made
 * before kn_q8_gemm_force_avx2 is not used at G 8), and m <= 4 rows read the copy directly. */
static bool q8g_panel_free(const void *packed, int G, int64_t m)
{
    return packed && G == 16 && m <= 4;
}

static void mm_q8g_part(void *arg, int64_t g0, int64_t g1, int tid)
{
    q8g_job *j = arg;
    void *panel = NULL;
    if (!q8g_panel_free(j->packed, j->G, j->m)) {
        const size_t bytes = kn_q8_gemm_panel_bytes(j->w->n_cols);
        panel = kn_cpu_scratch(j->c, tid, (bytes + 3) / sizeof(float));
        if (!panel) {
            atomic_store(&j->err, TD_ENOMEM);
            return;
        }
    }
    kn_q8_gemm(j->w, j->packed, j->xq, j->m, j->y, j->G, g0, g1, panel);
}

static int mm_q8_gemm(kn_cpu *c, const kn_mat *w, const float *x, int64_t m, float *y)
{
    const size_t bytes = (size_t)m * kn_q8_row_bytes(w->type, w->n_cols);
    void *xq = kn_cpu_scratch(c, KN_CPU_CALLER, (bytes + 3) / sizeof(float));
    if (!xq) {
        TD_LOG_ERR("matmul: out of memory for %zu bytes of quantized x", bytes);
        return TD_ENOMEM;
    }
    kn_q8_quant_rows(w->type, x, m, w->n_cols, xq);
    q8g_job j = {.c = c,
                 .w = w,
                 .packed = kn_cpu_packed_of(c, w),
                 .xq = xq,
                 .m = m,
                 .y = y,
                 .G = kn_q8_gemm_group_rows()};
    atomic_init(&j.err, 0);
    const int64_t groups = (w->n_rows + j.G - 1) / j.G;
    /* as the dot path: at least MM_DOT_MIN_BYTES of W per thread (a fork-join's cost) */
    int64_t min_groups = MM_DOT_MIN_BYTES / (j.G * (int64_t)w->row_stride * (m < 4 ? 1 : m / 4));
    if (min_groups < 1) min_groups = 1;
    kn_pool_run(c->pool, groups, min_groups, mm_q8g_part, &j);
    const int err = atomic_load(&j.err);
    if (err) TD_LOG_ERR("matmul: out of memory for the q8 weight panels");
    return err;
}

/* ---- entry points ---- */

static int mm_check(const kn_mat *w, const char *op)
{
    if (!kn_cpu_type_supported(w->type)) {
        kn_cpu_log_unsupported(w->type, op);
        return TD_EUNSUPP;
    }
    const td_dtype_info *info = td_dtype_get((uint32_t)w->type);
    if (w->n_rows < 0 || w->n_cols <= 0 || w->n_cols % info->blck || w->n_cols > INT32_MAX ||
        w->n_rows > INT32_MAX) {
        TD_LOG_ERR("%s: bad %s matrix shape %lld x %lld (block size %u)", op, info->name,
                   (long long)w->n_rows, (long long)w->n_cols, info->blck);
        return TD_EINVAL;
    }
    if ((w->n_rows > 1 && w->row_stride < td_dtype_row_bytes(w->type, w->n_cols)) ||
        (w->n_rows > 0 && !w->data)) {
        TD_LOG_ERR("%s: row stride %zu bytes below the row size of %lld %s elements", op,
                   w->row_stride, (long long)w->n_cols, info->name);
        return TD_EINVAL;
    }
    return 0;
}

/* The batch rows (m - m_solo) that take the gemm path: all of them from MM_GEMM_MIN_M on,
 * except in the q16 mode on weights it has AVX512-VNNI integer dots for, where AMX-BF16 is not
 * usable: there the dot path's 16-bit dots run 4 rows of x per read of a packed 16-row group
 * and beat dequantize + sgemm at every m (the default model's pp512, AMD EPYC, 2 threads:
 * BENCHMARKS.md "The AMD machine type with s25-s31's changes"), and the batch rows get a solo
 * row's bits. */
static int64_t mm_gemm_rows(const kn_cpu *c, const kn_mat *w, int64_t m, int64_t m_solo)
{
    if (m - m_solo < MM_GEMM_MIN_M) return 0;
    if (c->act_q16 && kn_q16_supported(w->type) && !kn_bf16amx_usable() &&
        !strcmp(kn_q16_isa(), "avx512vnni"))
        return 0;
    return m - m_solo;
}

#define MM_STR_(x) #x
#define MM_STR(x)  MM_STR_(x)

void kn_cpu_matmul_paths(const kn_cpu *c, const kn_mat *w, const char **batch, const char **solo)
{
    /* kn_cpu_matmul_mixed's choices, in its order */
    const bool amx = kn_q8_gemm_amx(); /* 24 rows of x and more: kn_q8_gemm_amx */
    if (c->act_q8 && kn_q8_gemm_supported(w)) {
        *batch = !strcmp(kn_q8_gemm_isa(), "avx2") ? "q8 integer GEMM (avx2)"
                 : amx ? "q8 integer GEMM (amx-int8, below 24 rows avx512-vnni)"
                       : "q8 integer GEMM (avx512-vnni)";
        *solo = !strcmp(kn_q8_gemm_isa(), "avx2") ? "q8 integer GEMM (avx2)"
                                                  : "q8 integer GEMM (avx512-vnni)";
        return;
    }
    if (c->act_q8 && kn_q8k_gemm_supported(w))
        *batch =
            amx ? "q8 K-quant integer GEMM (amx-int8)" : "q8 K-quant integer GEMM (avx512-vnni)";
    else if (kn_bf16amx_usable())
        *batch = w->type == TD_F32 ? KN_BF16AMX_NAME : "float32 tiles + " KN_BF16AMX_NAME;
    else if (!mm_gemm_rows(c, w, MM_GEMM_MIN_M, 0))
        *batch = "q16 integer dot (avx512-vnni)";
    else if (w->type == TD_F32)
        *batch = "OpenBLAS sgemm";
    else
        *batch = "float32 tiles + OpenBLAS sgemm";
    if (c->act_q16 && kn_q16_supported(w->type)) {
        static const char *const q16[] = {"q16 integer dot (scalar)", "q16 integer dot (avx2)",
                                          "q16 integer dot (avx512-vnni)"};
        const char *isa = kn_q16_isa();
        *solo = q16[!strcmp(isa, "avx512vnni") ? 2 : !strcmp(isa, "avx2") ? 1 : 0];
        return;
    }
    /* Q4_K through the packed copy the engine maps: AMX from KN_Q8K_DOT_AMX_MIN_M rows */
    *solo = !c->act_q8 || !kn_q8_supported(w->type) ? "float32 dot"
            : w->type == TD_Q4_K && amx && kn_q8k_packed_bytes(w)
                ? "q8 integer dot (amx-int8 from " MM_STR(KN_Q8K_DOT_AMX_MIN_M) " rows)"
                : "q8 integer dot";
}

bool kn_cpu_gemm_amx(const kn_cpu *c)
{
    return c->act_q8 ? kn_q8_gemm_amx() : kn_bf16amx_usable();
}

int kn_cpu_matmul(void *ctx, const kn_mat *w, const float *x, int64_t m, float *y)
{
    return kn_cpu_matmul_mixed(ctx, w, x, m, 0, y);
}

int kn_cpu_matmul_mixed(void *ctx, const kn_mat *w, const float *x, int64_t m, int64_t m_solo,
                        float *y)
{
    kn_cpu *c = ctx;
    int rc = mm_check(w, "matmul");
    if (rc) return rc;
    if (m < 0 || m > INT32_MAX || m_solo < 0 || m_solo > m) {
        TD_LOG_ERR("matmul: bad row counts m %lld, solo %lld", (long long)m, (long long)m_solo);
        return TD_EINVAL;
    }
    if (m == 0 || w->n_rows == 0) return 0;
    if (c->act_q8 && kn_q8_gemm_supported(w)) return mm_q8_gemm(c, w, x, m, y);
    /* the batch rows take the gemm path when there are enough of them; the dot path gives
     * every row the same bits in either role, so below that all m rows share it */
    const int64_t gm = mm_gemm_rows(c, w, m, m_solo);
    mm_job j = {.c = c,
                .w = w,
                .x = x,
                .m = m - gm,
                .y = y,
                .gx = x + (m - gm) * w->n_cols,
                .gm = gm,
                .gy = y + (m - gm) * w->n_rows};
    atomic_init(&j.err, 0);
    const int sg = kn_cpu_traits_of(w->type)->xsum_group;
    const bool q8dot = j.m && c->act_q8 && kn_q8_supported(w->type),
               kgemm = gm && c->act_q8 && kn_q8k_gemm_supported(w),
               q16dot = j.m && c->act_q16 && kn_q16_supported(w->type),
               bgemm = gm && !kgemm && kn_bf16amx_usable();
    /* the caller's scratch: the gemm rows' x packed for AMX-BF16 first (bx bytes), then the
     * dot rows' side data (one kind at most) */
    const size_t bx = bgemm ? kn_bf16amx_x_bytes(gm, w->n_cols) : 0;
    uint8_t *cs = NULL;
    if (bgemm) {
        size_t side = 0;
        if (q16dot)
            side = (size_t)j.m * kn_q16_row_bytes(w->n_cols);
        else if (q8dot)
            side = (size_t)j.m * kn_q8_row_bytes(w->type, w->n_cols);
        else if (j.m && sg)
            side = (size_t)(j.m * (w->n_cols / sg)) * sizeof(float);
        cs = (uint8_t *)kn_cpu_scratch(c, KN_CPU_CALLER, (bx + side + 3) / sizeof(float));
        if (!cs) {
            TD_LOG_ERR("matmul: out of memory for %zu bytes of packed x", bx + side);
            return TD_ENOMEM;
        }
        j.gxb = cs;
        kn_pool_run(c->pool, (gm + 31) / 32, 1, mm_bf16_pack_part, &j);
    }
    if (q16dot) {
        const size_t bytes = (size_t)j.m * kn_q16_row_bytes(w->n_cols);
        void *xq =
            cs ? (void *)(cs + bx) : kn_cpu_scratch(c, KN_CPU_CALLER, (bytes + 3) / sizeof(float));
        if (!xq) {
            TD_LOG_ERR("matmul: out of memory for %zu bytes of quantized x", bytes);
            return TD_ENOMEM;
        }
        kn_q16_quant_rows(x, j.m, w->n_cols, xq);
        j.xq16 = xq;
        j.packed = kn_cpu_packed_of(c, w); /* read by 16-row groups */
    }
    if (q8dot || kgemm) {
        /* one caller scratch: the dot rows' x as kn_q8_dot takes it, then the gemm rows' x
         * in 32-blocks for kn_q8k_gemm */
        const size_t dot_bytes = q8dot ? (size_t)j.m * kn_q8_row_bytes(w->type, w->n_cols) : 0,
                     gemm_bytes = kgemm ? (size_t)gm * kn_q8_row_bytes(TD_Q8_0, w->n_cols) : 0,
                     dot_pad = (dot_bytes + 63) / 64 * 64;
        uint8_t *xq = cs ? cs + bx
                         : (uint8_t *)kn_cpu_scratch(c, KN_CPU_CALLER,
                                                     (dot_pad + gemm_bytes + 3) / sizeof(float));
        if (!xq) {
            TD_LOG_ERR("matmul: out of memory for %zu bytes of quantized x", dot_pad + gemm_bytes);
            return TD_ENOMEM;
        }
        if (dot_bytes) {
            kn_q8_quant_rows(w->type, x, j.m, w->n_cols, xq);
            j.xq = xq;
            j.packed = kn_cpu_packed_of(c, w);
        }
        if (kgemm) {
            kn_q8_quant_rows(TD_Q8_0, j.gx, gm, w->n_cols, xq + dot_pad); /* 32-blocks */
            j.gxq = xq + dot_pad;
        }
    }
    if (j.m && !j.xq && !j.xq16 && sg) {
        const int64_t nb = w->n_cols / sg;
        float *xs = cs ? (float *)(void *)(cs + bx)
                       : kn_cpu_scratch(c, KN_CPU_CALLER, (size_t)(j.m * nb)); /* (m, nb) */
        if (!xs) {
            TD_LOG_ERR("matmul: out of memory for %lld block sums", (long long)(j.m * nb));
            return TD_ENOMEM;
        }
        block_sums(x, j.m * w->n_cols, sg, xs);
        j.xsum = xs;
    }
    if (kgemm) {
        kn_pool_run(c->pool, (w->n_rows + 15) / 16, MM_GEMM_MIN_ROWS / 16, mm_q8k_part, &j);
        return atomic_load(&j.err);
    }
    if (bgemm) {
        kn_pool_run(c->pool, (w->n_rows + 31) / 32, 1, mm_bf16_part, &j);
        return atomic_load(&j.err);
    }
    if (gm) {
        pthread_once(&blas_once, blas_single_thread);
        kn_pool_run(c->pool, w->n_rows, MM_GEMM_MIN_ROWS, mm_gemm_part, &j);
        return atomic_load(&j.err);
    }
    const int64_t row_bytes = (int64_t)td_dtype_row_bytes(w->type, w->n_cols);
    int64_t min_rows = MM_DOT_MIN_BYTES / row_bytes;
    if (min_rows < 4) min_rows = 4;
    if (j.packed) /* whole 16-row groups of the packed copy per part */
        kn_pool_run(c->pool, (w->n_rows + 15) / 16, (min_rows + 15) / 16, mm_dot_groups, &j);
    else
        kn_pool_run(c->pool, w->n_rows, min_rows, mm_dot_part, &j);
    return 0;
}

int kn_cpu_get_rows(void *ctx, const kn_mat *w, const int32_t *ids, int64_t m, float *out)
{
    int rc = mm_check(w, "get_rows");
    if (rc) return rc;
    if (m < 0) {
        TD_LOG_ERR("get_rows: bad id count %lld", (long long)m);
        return TD_EINVAL;
    }
    for (int64_t i = 0; i < m; i++)
        if (ids[i] < 0 || ids[i] >= w->n_rows) {
            TD_LOG_ERR("get_rows: id %d at %lld out of range [0, %lld)", ids[i], (long long)i,
                       (long long)w->n_rows);
            return TD_ERANGE;
        }
    for (int64_t i = 0; i < m; i++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)ids[i] * w->row_stride;
        rc = kn_dequant_row(w->type, row, out + i * w->n_cols, w->n_cols);
        if (rc) return rc;
    }
    return 0;
}

/* ---- the dot path in pieces, for fused ops (cpu_internal.h) ---- */

size_t kn_cpu_dot_side_floats(const kn_cpu *c, const kn_mat *w, int64_t m)
{
    if (c->act_q16 && kn_q16_supported(w->type))
        return ((size_t)m * kn_q16_row_bytes(w->n_cols) + 3) / sizeof(float);
    if (c->act_q8 && kn_q8_supported(w->type))
        return ((size_t)m * kn_q8_row_bytes(w->type, w->n_cols) + 3) / sizeof(float);
    const kn_cpu_traits *tr = kn_cpu_traits_of(w->type); /* NULL: kn_cpu_dot_init refuses w */
    const int sg = tr ? tr->xsum_group : 0;
    return sg ? (size_t)(m * (w->n_cols / sg)) : 0;
}

int kn_cpu_dot_init(kn_cpu *c, const kn_mat *w, const float *x, int64_t m, int64_t m_solo,
                    float *side, float *y, kn_cpu_dot *d)
{
    int rc = mm_check(w, "matmul");
    if (rc) return rc;
    if (m < 1 || m > INT32_MAX || m_solo < 0 || m_solo > m) {
        TD_LOG_ERR("matmul: bad row counts m %lld, solo %lld", (long long)m, (long long)m_solo);
        return TD_EINVAL;
    }
    /* in the q8 mode these weights take the integer GEMM at every m, never the dot path; its
     * panel-free kernel (packed W, m <= 4) runs on any 16-row groups, so it fuses too */
    if (c->act_q8 && kn_q8_gemm_supported(w)) {
        const void *packed = kn_cpu_packed_of(c, w);
        if (!q8g_panel_free(packed, kn_q8_gemm_group_rows(), m)) return 1;
        kn_q8_quant_rows(w->type, x, m, w->n_cols, side);
        *d = (kn_cpu_dot){
            .c = c, .w = w, .x = x, .xq = side, .packed = packed, .m = m, .y = y, .grain = 16};
        return 0;
    }
    if (mm_gemm_rows(c, w, m, m_solo)) return 1; /* the batch rows take the gemm path */
    *d = (kn_cpu_dot){.c = c, .w = w, .x = x, .m = m, .y = y, .grain = 1};
    const int sg = kn_cpu_traits_of(w->type)->xsum_group;
    if (c->act_q16 && kn_q16_supported(w->type)) {
        kn_q16_quant_rows(x, m, w->n_cols, side);
        d->xq16 = side;
        d->packed = kn_cpu_packed_of(c, w); /* read by 16-row groups */
        if (d->packed) d->grain = 16;
    } else if (c->act_q8 && kn_q8_supported(w->type)) {
        kn_q8_quant_rows(w->type, x, m, w->n_cols, side);
        d->xq = side;
        d->packed = kn_cpu_packed_of(c, w); /* K-types: read by 16-row groups */
        if (d->packed) d->grain = 16;
    } else if (sg) {
        block_sums(x, m * w->n_cols, sg, side);
        d->xsum = side;
    }
    return 0;
}

void kn_cpu_dot_rows(const kn_cpu_dot *d, int64_t r0, int64_t r1)
{
    if (d->packed && !d->xq16 && kn_q8_gemm_supported(d->w)) {
        /* groups [r0 / 16, ceil(r1 / 16)): r1 is a group's end or n_rows */
        kn_q8_gemm(d->w, d->packed, d->xq, d->m, d->y, 16, r0 / 16, (r1 + 15) / 16, NULL);
        return;
    }
    const mm_job j = {.c = d->c,
                      .w = d->w,
                      .x = d->x,
                      .xsum = d->xsum,
                      .xq = d->xq,
                      .xq16 = d->xq16,
                      .packed = d->packed,
                      .m = d->m,
                      .y = d->y};
    mm_dot_part((void *)&j, r0, r1, 0);
}
