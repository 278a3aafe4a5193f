/* cpu_arith.c: the residual add, bias add, scaling and row gather of the CPU backend. These are
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
