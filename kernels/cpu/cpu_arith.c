/* cpu_arith.c: the residual add, bias add, scaling, row gather, strided copy and the experts'
 * weighted combine of the CPU backend. These are
 * memory-bound and small (m x n_embd floats), so they run on the calling thread. */
#include <string.h>

#include "cpu_backend.h"

void kn_cpu_add(void *ctx, float *y, const float *x, int64_t m, int64_t n)
{
    int64_t total = m * n;
    for (int64_t i = 0; i < total; i++)
        y[i] += x[i];
}

void kn_cpu_add_row(void *ctx, float *y, const float *b, int64_t m, int64_t n)
{
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < n; i++)
            y[r * n + i] += b[i];
}

void kn_cpu_scale(void *ctx, float *x, int64_t n, float s)
{
    for (int64_t i = 0; i < n; i++)
        x[i] *= s;
}

void kn_cpu_copy_rows(void *ctx, const float *src, const int32_t *rows, int64_t m, int64_t n,
                      float *dst)
{
    for (int64_t r = 0; r < m; r++)
        memcpy(dst + r * n, src + (int64_t)rows[r] * n, (size_t)n * 4);
}

void kn_cpu_weighted_rows_sum(void *ctx, const float *x, const int32_t *idx, const float *w, int k,
                              int64_t m, int64_t n, float *y)
{
    for (int64_t r = 0; r < m; r++) {
        float *yr = y + r * n;
        for (int64_t i = 0; i < n; i++)
            yr[i] = 0.0f;
        for (int j = 0; j < k; j++) {
            const float *xr = x + (int64_t)idx[r * k + j] * n;
            const float wj = w[r * k + j];
            for (int64_t i = 0; i < n; i++)
                yr[i] += wj * xr[i];
        }
    }
}

void kn_cpu_copy_2d(void *ctx, const float *src, int64_t src_stride, float *dst, int64_t dst_stride,
                    int64_t m, int64_t n)
{
    for (int64_t r = 0; r < m; r++)
        memcpy(dst + r * dst_stride, src + r * src_stride, (size_t)n * sizeof *dst);
}
