/* kn_test_util.h: the helpers the kernel tests and benchmarks in tests/kernels/ share, so that
 * each is written once: the xorshift64 random streams and their float forms, fp16 fields in
 * block bytes, random weights in block formats, float64 reference products, the 1-2-3-thread
 * CPU backends, the skip exit (77), timers and medians for the benchmarks, the in-process
 * collective of the tensor-parallel engine tests, and opening a model file.
 *
 * Invariants: every random helper takes the caller's state (uint64_t *), so each file keeps
 * its own seeds and streams; a helper draws exactly what the copy it replaced drew, in the
 * same order, so a test sees the same data as before. Nothing here checks: assertions stay in
 * the tests (tharness.h). Threading: none, but the collective (kt_coll), whose ranks are
 * threads meeting at its barrier. Ownership: what a helper allocates, the caller frees. */
#ifndef KN_TEST_UTIL_H
#define KN_TEST_UTIL_H

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "gguf.h"
#include "model.h"
#include "td_clock.h"
#include "td_dtype.h"
#include "td_err.h"

/* ---- random streams: xorshift64 (13, 7, 17) over the caller's state ---- */

/* Advances *s and returns the new state (every bit of it). */
static inline uint64_t kt_xorshift64(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* 32 random bits (bits 16..47 of the state). */
static inline uint32_t kt_u32(uint64_t *s)
{
    return (uint32_t)(kt_xorshift64(s) >> 16);
}

/* Uniform in [lo, hi) from 24 bits. */
static inline float kt_uniform(uint64_t *s, float lo, float hi)
{
    return lo + (hi - lo) * (float)(kt_u32(s) & 0xffffff) / 16777216.0f;
}

/* Uniform in [-1, 1) from 24 bits. */
static inline float kt_signed_unit(uint64_t *s)
{
    return (float)(kt_u32(s) & 0xffffff) / 8388608.0f - 1.0f;
}

/* Uniform in [0, 1) from 53 bits. */
static inline double kt_unit(uint64_t *s)
{
    return (double)(kt_xorshift64(s) >> 11) * (1.0 / 9007199254740992.0);
}

/* Uniform in [lo, hi), from kt_unit. */
static inline float kt_frand(uint64_t *s, float lo, float hi)
{
    return lo + (hi - lo) * (float)kt_unit(s);
}

/* ---- fp16 fields inside block bytes (unaligned) ---- */

static inline void kt_put16(uint8_t *p, uint16_t h)
{
    memcpy(p, &h, 2);
}

static inline void kt_put_f16(uint8_t *p, float v)
{
    kt_put16(p, td_fp32_to_fp16(v));
}

static inline float kt_get_f16(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return td_fp16_to_fp32(h);
}

/* Byte offset of a block's fp16 scale d. */
static inline int kt_d_offset(td_dtype t)
{
    return t == TD_Q6_K ? 208 : t == TD_Q3_K ? 108 : t == TD_Q2_K ? 80 : 0;
}

/* Byte offset of a block's fp16 min (dmin, m), -1 where the type has none. */
static inline int kt_dmin_offset(td_dtype t)
{
    return t == TD_Q2_K                                                   ? 82
           : t == TD_Q4_1 || t == TD_Q5_1 || t == TD_Q4_K || t == TD_Q5_K ? 2
                                                                          : -1;
}

/* ---- random weights ---- */

/* Random W of type t (n_rows, n_cols) into *w; returns the allocation (the caller frees it),
 * NULL when out of memory. Rows one block apart (float types: 3 elements), the gaps 0xff, so
 * the row stride is not the row size. Float types: values in [-0.1, 0.1); block types: random
 * bytes with finite small scales (d of either sign but Q6_K's, Q4_1/Q4_K mins d / 2). */
static inline uint8_t *kt_make_w(uint64_t *rng, td_dtype t, int64_t n_rows, int64_t n_cols,
                                 kn_mat *w)
{
    const td_dtype_info *info = td_dtype_get((uint32_t)t);
    const size_t rb = td_dtype_row_bytes(t, n_cols),
                 stride = rb + (info->blck == 1 ? 3 * info->type_size : info->type_size);
    uint8_t *buf = malloc(stride * (size_t)n_rows);
    if (!buf) return NULL;
    memset(buf, 0xff, stride * (size_t)n_rows);
    for (int64_t r = 0; r < n_rows; r++) {
        uint8_t *p = buf + (size_t)r * stride;
        if (t == TD_F32 || t == TD_F16) {
            for (int64_t i = 0; i < n_cols; i++) {
                const float v = kt_signed_unit(rng) * 0.1f;
                if (t == TD_F32)
                    memcpy(p + 4 * i, &v, 4);
                else
                    kt_put_f16(p + 2 * i, v);
            }
            continue;
        }
        for (size_t i = 0; i < rb; i++)
            p[i] = (uint8_t)kt_u32(rng);
        for (int64_t b = 0; b < n_cols / info->blck; b++) {
            uint8_t *blk = p + (size_t)b * info->type_size;
            const float d = (float)(1 + kt_u32(rng) % 1000) * 1e-5f;
            if (t == TD_Q6_K)
                kt_put_f16(blk + 208, d);
            else
                kt_put_f16(blk, kt_u32(rng) & 1 ? -d : d);
            if (t == TD_Q4_K || t == TD_Q4_1) kt_put_f16(blk + 2, d * 0.5f);
        }
    }
    *w = (kn_mat){.type = t, .n_rows = n_rows, .n_cols = n_cols, .row_stride = stride, .data = buf};
    return buf;
}

/* The benchmarks' weights: rows x cols of t, rows packed (stride = row size), random bytes
 * (bits 24..31 of each state) and every fp16 scale (d, and the min where the type has one)
 * 0x2000 (~0.008), or with vary 0x2000 | (block index & 0x3ff): realistic work, nothing the
 * kernel can skip. NULL when out of memory. */
static inline uint8_t *kt_bench_weights(uint64_t *rng, td_dtype t, int64_t rows, int64_t cols,
                                        bool vary)
{
    const size_t bytes = td_dtype_row_bytes(t, cols) * (size_t)rows;
    uint8_t *p = malloc(bytes);
    if (!p) return NULL;
    for (size_t i = 0; i < bytes; i++)
        p[i] = (uint8_t)(kt_xorshift64(rng) >> 24);
    const size_t bs = td_dtype_get((uint32_t)t)->type_size;
    const int d_off = kt_d_offset(t), m_off = kt_dmin_offset(t);
    for (size_t b = 0; b < bytes / bs; b++) {
        const uint16_t s = (uint16_t)(vary ? 0x2000 | (b & 0x3ff) : 0x2000);
        kt_put16(p + b * bs + d_off, s);
        if (m_off >= 0) kt_put16(p + b * bs + m_off, s);
    }
    return p;
}

/* x (m, n) for the activation modes: uniform in [-s, s] with s varying by row and block, row
 * 0's first 32 zero (the d = 0 case); with outliers, every 97th element times 40. NULL when out
 * of memory. */
static inline float *kt_act_x(uint64_t *rng, int64_t m, int64_t n, bool outliers)
{
    float *x = malloc((size_t)(m * n) * sizeof(float));
    if (!x) return NULL;
    for (int64_t i = 0; i < m; i++)
        for (int64_t e = 0; e < n; e++) {
            const float s = (float)(1 + i % 3) * (e % 512 < 256 ? 1.0f : 0.01f);
            x[i * n + e] = i == 0 && e < 32
                               ? 0.0f
                               : kt_uniform(rng, -s, s) * (outliers && e % 97 == 0 ? 40.0f : 1.0f);
        }
    return x;
}

/* ---- float64 references ---- */

/* sum a[i] b[i] over n in float64, in order; *abs_sum (if not NULL) = sum |a[i] b[i]|. */
static inline double kt_dot64(const float *a, const float *b, int64_t n, double *abs_sum)
{
    double s = 0.0, abs = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double p = (double)a[i] * b[i];
        s += p;
        abs += fabs(p);
    }
    if (abs_sum) *abs_sum = abs;
    return s;
}

/* ref (m, n_rows) = x (m, n_cols) . wd^T (wd: (n_rows, n_cols)) in float64; mag (m, n_rows),
 * if not NULL, the sums of |w x| (the scale of each output's float32 rounding). */
static inline void kt_ref_matmul(const float *x, const float *wd, int64_t m, int64_t n_rows,
                                 int64_t n_cols, double *ref, double *mag)
{
    for (int64_t i = 0; i < m; i++)
        for (int64_t r = 0; r < n_rows; r++)
            ref[i * n_rows + r] = kt_dot64(wd + r * n_cols, x + i * n_cols, n_cols,
                                           mag ? &mag[i * n_rows + r] : NULL);
}

/* out (n_rows, n_cols) = W dequantized row by row (kn_dequant_row); its error code. */
static inline int kt_dequant_mat(const kn_mat *w, float *out)
{
    for (int64_t r = 0; r < w->n_rows; r++) {
        const int rc = kn_dequant_row(w->type, (const uint8_t *)w->data + (size_t)r * w->row_stride,
                                      out + r * w->n_cols, w->n_cols);
        if (rc) return rc;
    }
    return 0;
}

static inline void kt_fill(float *y, size_t n, float v)
{
    for (size_t i = 0; i < n; i++)
        y[i] = v;
}

/* ---- backends and exits ---- */

/* cpus[i]: a CPU backend of i + 1 threads, i = 0..2. -1 (said on stderr) when one fails. */
static inline int kt_cpus_create(kn_cpu *cpus[3])
{
    for (int i = 0; i < 3; i++)
        if (kn_cpu_create(i + 1, &cpus[i])) {
            fprintf(stderr, "cannot create a cpu backend with %d threads\n", i + 1);
            return -1;
        }
    return 0;
}

static inline void kt_cpus_destroy(kn_cpu *cpus[3])
{
    for (int i = 0; i < 3; i++)
        kn_cpu_destroy(cpus[i]);
}

/* Says why nothing was tested and gives ctest's skip code (SKIP_RETURN_CODE 77) for main to
 * return. */
static inline int kt_skip(const char *why)
{
    printf("SKIP: %s: nothing tested\n", why);
    return 77;
}

/* Opens the GGUF file at path and loads the whole model (no shard); -1 (said on stderr) on
 * failure. The caller closes both (kn_model_destroy, td_gguf_close). */
static inline int kt_open_model(const char *path, td_gguf **g, kn_model **m)
{
    char err[256];
    if (td_gguf_open(path, g, err, sizeof err)) {
        fprintf(stderr, "cannot open %s: %s\n", path, err);
        return -1;
    }
    if (kn_model_load(*g, &(kn_shard){0}, m)) {
        fprintf(stderr, "cannot load %s\n", path);
        return -1;
    }
    return 0;
}

/* ---- benchmarks: time and medians ---- */

/* Seconds on the monotonic clock. */
static inline double kt_now_s(void)
{
    return (double)td_now_ns() * 1e-9;
}

static inline int kt_cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of v (n values, sorted in place): the middle one, or the mean of the two. */
static inline double kt_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, kt_cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* ---- an in-process collective for tensor-parallel engines (one thread a rank) ---- */

typedef struct {
    pthread_barrier_t bar; /* tp parties */
    float **slots;         /* (tp) each rank's allreduce buffer */
    const float **parts;   /* (tp) each rank's logit slice (gather_cols), or a dp member's
                              rows (dp_gather, dp_reduce) */
    int64_t counts[2 * 16]; /* dp_counts: member q's at [2q], [2q + 1] (tp <= 16) */
    int tp;                 /* ranks, or dp members */
} kt_coll;

/* A rank's context for kn_collective (ctx). */
typedef struct {
    kt_coll *cc;
    int rank;
    float *posted[2]; /* kt_allreduce_post's copies, oldest first */
    int n_posted;
} kt_rank_coll;

/* kn_collective.allreduce_sum: every rank sums in rank order, so all ranks get bit-identical
 * results. */
static inline int kt_allreduce_sum(void *ctx, float *buf, int64_t n)
{
    kt_rank_coll *rc = ctx;
    kt_coll *cc = rc->cc;
    float *mine = malloc((size_t)n * sizeof *mine);
    if (!mine) return TD_ENOMEM;
    cc->slots[rc->rank] = buf;
    pthread_barrier_wait(&cc->bar);
    for (int64_t i = 0; i < n; i++) {
        float s = 0;
        for (int r = 0; r < cc->tp; r++)
            s += cc->slots[r][i];
        mine[i] = s;
    }
    pthread_barrier_wait(&cc->bar); /* nobody overwrites buf before all have read it */
    memcpy(buf, mine, (size_t)n * sizeof *mine);
    free(mine);
    return 0;
}

/* kn_collective.allreduce_post / allreduce_wait: post keeps a copy of buf (so a caller that
 * changed buf before the wait would be caught); the wait sums the copies, as
 * kt_allreduce_sum would have at the post. At most two in flight, waited in order. */
static inline int kt_allreduce_post(void *ctx, const float *buf, int64_t n, uint64_t *ticket)
{
    kt_rank_coll *rc = ctx;
    if (rc->n_posted >= 2) return TD_ESTATE;
    float *copy = malloc((size_t)(n > 0 ? n : 1) * sizeof *copy);
    if (!copy) return TD_ENOMEM;
    if (n > 0) memcpy(copy, buf, (size_t)n * sizeof *copy);
    *ticket = (uint64_t)(uintptr_t)copy;
    rc->posted[rc->n_posted++] = copy;
    return 0;
}

static inline int kt_allreduce_wait(void *ctx, uint64_t ticket, float *buf, int64_t n)
{
    kt_rank_coll *rc = ctx;
    float *copy = rc->posted[0];
    if (!rc->n_posted || (uint64_t)(uintptr_t)copy != ticket) return TD_ESTATE;
    rc->posted[0] = rc->posted[1];
    rc->n_posted--;
    int err = kt_allreduce_sum(ctx, copy, n);
    if (!err && n > 0) memcpy(buf, copy, (size_t)n * sizeof *buf);
    free(copy);
    return err;
}

/* kn_collective.gather_cols: rank r's part is columns [r * n_cols / tp, (r + 1) * n_cols / tp)
 * (model.h); rank 0 copies every part into out, the others leave theirs alone. */
static inline int kt_gather_cols(void *ctx, const float *part, int64_t rows, int64_t n_cols,
                                 float *out)
{
    kt_rank_coll *rc = ctx;
    kt_coll *cc = rc->cc;
    cc->parts[rc->rank] = part;
    pthread_barrier_wait(&cc->bar);
    for (int r = 0; r < cc->tp && rc->rank == 0; r++) {
        int64_t c0 = r * n_cols / cc->tp, nc = (r + 1) * n_cols / cc->tp - c0;
        for (int64_t i = 0; i < rows; i++)
            memcpy(out + i * n_cols + c0, cc->parts[r] + i * nc, (size_t)nc * sizeof *out);
    }
    pthread_barrier_wait(&cc->bar); /* the parts stay valid until rank 0 has copied them */
    return 0;
}

/* kn_collective.dp_counts (kt_coll's tp members, at most 16). */
static inline int kt_dp_counts(void *ctx, const int64_t mine[2], int64_t *all)
{
    kt_rank_coll *rc = ctx;
    kt_coll *cc = rc->cc;
    cc->counts[2 * rc->rank] = mine[0];
    cc->counts[2 * rc->rank + 1] = mine[1];
    pthread_barrier_wait(&cc->bar);
    memcpy(all, cc->counts, (size_t)(2 * cc->tp) * sizeof *all);
    pthread_barrier_wait(&cc->bar); /* nobody writes the next counts before all have read */
    return 0;
}

/* kn_collective.dp_gather: every member copies every member's rows into its all, in
 * td_dp_layout's solo-first places. */
static inline int kt_dp_gather(void *ctx, const float *mine, const int64_t *counts, int64_t n_cols,
                               float *all)
{
    kt_rank_coll *rc = ctx;
    kt_coll *cc = rc->cc;
    cc->parts[rc->rank] = mine;
    pthread_barrier_wait(&cc->bar);
    for (int q = 0; q < cc->tp; q++) {
        int64_t at, rest_at, n_all, n_solo, s = counts[2 * q + 1], n = counts[2 * q];
        td_dp_layout(counts, cc->tp, q, &at, &rest_at, &n_all, &n_solo);
        if (s) memcpy(all + at * n_cols, cc->parts[q], (size_t)(s * n_cols) * sizeof *all);
        if (n > s)
            memcpy(all + rest_at * n_cols, cc->parts[q] + s * n_cols,
                   (size_t)((n - s) * n_cols) * sizeof *all);
    }
    pthread_barrier_wait(&cc->bar);
    return 0;
}

/* kn_collective.dp_reduce: member r sums its rows of every member's all, in member order. */
static inline int kt_dp_reduce(void *ctx, const float *all, const int64_t *counts, int64_t n_cols,
                               float *mine)
{
    kt_rank_coll *rc = ctx;
    kt_coll *cc = rc->cc;
    cc->parts[rc->rank] = all;
    pthread_barrier_wait(&cc->bar);
    int64_t at, rest_at, n_all, n_solo, s = counts[2 * rc->rank + 1], n = counts[2 * rc->rank];
    td_dp_layout(counts, cc->tp, rc->rank, &at, &rest_at, &n_all, &n_solo);
    for (int64_t i = 0; i < n; i++) {
        const int64_t src = (i < s ? at + i : rest_at + i - s) * n_cols;
        for (int64_t j = 0; j < n_cols; j++) {
            float v = cc->parts[0][src + j];
            for (int q = 1; q < cc->tp; q++)
                v += cc->parts[q][src + j];
            mine[i * n_cols + j] = v;
        }
    }
    pthread_barrier_wait(&cc->bar);
    return 0;
}

#endif
