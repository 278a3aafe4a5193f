/* cpu_ops.c: the CPU backend's row-wise element ops: rmsnorm, rope, swiglu and geglu.
 *
 * All of them are memory-bound at decode sizes, so they only fan out to the pool when a call
 * carries enough rows to pay for waking the workers (prefill). The SIMD paths use AVX2 +
 * FMA (present in both the native and the portable build); a scalar path covers the rest.
 */
#include <assert.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define OPS_SIMD 1
#endif

#include "cpu_backend.h"
#include "cpu_simd.h"
#include "cpu_internal.h"

/* Work below this many float elements per thread is done on fewer threads: waking a
 * worker costs about as much as touching this many elements. */
#define OPS_MIN_ELEMS_PER_THREAD 16384

static int64_t min_rows_per_thread(int64_t row_elems)
{
    int64_t r = OPS_MIN_ELEMS_PER_THREAD / (row_elems > 0 ? row_elems : 1);
    return r > 1 ? r : 1;
}

/* ---- rmsnorm ---- */

typedef struct {
    const float *x;      /* (m, n) */
    const float *weight; /* (n) */
    float *y;            /* (m, n), may equal x */
    int64_t n;
    float eps;
} rmsnorm_job;

/* Sum of squares of a row in float64: a float sum over a few thousand squares loses
 * several digits, and the reference parity tests compare against float64. */
static double row_sumsq(const float *x, int64_t n)
{
    int64_t j = 0;
    double s = 0.0;
#ifdef OPS_SIMD
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_loadu_ps(x + j);
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
        __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        a0 = _mm256_fmadd_pd(lo, lo, a0);
        a1 = _mm256_fmadd_pd(hi, hi, a1);
    }
    __m256d a = _mm256_add_pd(a0, a1);
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    s = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
#endif
    for (; j < n; j++)
        s += (double)x[j] * x[j];
    return s;
}

static void rmsnorm_rows(void *arg, int64_t i0, int64_t i1, int tid)
{
    const rmsnorm_job *J = arg;
    const int64_t n = J->n;
    for (int64_t i = i0; i < i1; i++) {
        const float *x = J->x + i * n;
        float *y = J->y + i * n;
        const float scale = (float)(1.0 / sqrt(row_sumsq(x, n) / (double)n + (double)J->eps));
        int64_t j = 0;
        /* (x * scale) * weight, in that order, as ggml's rms_norm followed by mul */
#ifdef OPS_SIMD
        const __m256 vs = _mm256_set1_ps(scale);
        for (; j + 8 <= n; j += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + j), vs);
            _mm256_storeu_ps(y + j, _mm256_mul_ps(v, _mm256_loadu_ps(J->weight + j)));
        }
#endif
        for (; j < n; j++)
            y[j] = (x[j] * scale) * J->weight[j];
    }
}

void kn_cpu_rmsnorm(void *ctx, const float *x, const float *weight, float *y, int64_t m, int64_t n,
                    float eps)
{
    assert(m >= 0 && n > 0);
    rmsnorm_job J = {.x = x, .weight = weight, .y = y, .n = n, .eps = eps};
    kn_pool_run(kn_cpu_pool(ctx), m, min_rows_per_thread(n), rmsnorm_rows, &J);
}

/* ---- rope ---- */

typedef struct {
    float *x; /* (m, n_heads, head_dim) */
    int n_heads, head_dim, n_rot;
    const int32_t *pos; /* (m) */
    const float *freq;  /* (head_dim / 2) */
    bool neox;
} rope_job;

/* theta = pos * freq[i] is formed and its cos/sin taken in float64, then rounded to
 * float. ggml builds theta in float by repeated multiplication and calls cosf/sinf, which
 * drifts by a few float ulps of theta at long positions; float64 gives the correctly
 * rounded rotation, which stays well inside the reference tolerance. The rotation itself
 * is done in float, as ggml does. */
static void rope_rows(void *arg, int64_t i0, int64_t i1, int tid)
{
    const rope_job *J = arg;
    const int half = J->n_rot / 2;
    /* NORM pairs (2i, 2i+1); NEOX pairs (i, i + n_rot/2) */
    const int stride = J->neox ? 1 : 2, off = J->neox ? half : 1;
    for (int64_t t = i0; t < i1; t++) {
        float *row = J->x + t * (int64_t)J->n_heads * J->head_dim;
        const double p = (double)J->pos[t];
        for (int i = 0; i < half; i++) {
            const double theta = p * (double)J->freq[i]; /* gcc fuses sin+cos into sincos */
            const float c = (float)cos(theta), s = (float)sin(theta);
            for (int h = 0; h < J->n_heads; h++) {
                float *a = row + (int64_t)h * J->head_dim + (int64_t)i * stride;
                const float x0 = a[0], x1 = a[off];
                a[0] = x0 * c - x1 * s;
                a[off] = x0 * s + x1 * c;
            }
        }
    }
}

void kn_cpu_rope(void *ctx, float *x, int64_t m, int n_heads, int head_dim, int n_rot,
                 const int32_t *pos, const float *freq, bool neox)
{
    assert(n_rot >= 0 && n_rot <= head_dim && n_rot % 2 == 0);
    if (n_rot == 0) return;
    rope_job J = {.x = x,
                  .n_heads = n_heads,
                  .head_dim = head_dim,
                  .n_rot = n_rot,
                  .pos = pos,
                  .freq = freq,
                  .neox = neox};
    /* a row costs n_rot/2 float64 sincos calls (~20 ns each) plus the rotations */
    int64_t min_rows = 8192 / ((int64_t)n_rot * 8 + (int64_t)n_heads * n_rot);
    kn_pool_run(kn_cpu_pool(ctx), m, min_rows > 1 ? min_rows : 1, rope_rows, &J);
}

/* ---- swiglu ---- */

typedef struct {
    const float *gate, *up; /* (m, n) */
    float *out;             /* (m, n) */
    int64_t n;
} swiglu_job;

void kn_cpu_swiglu_span(const float *g, const float *u, float *o, int64_t e0, int64_t e1)
{
    int64_t j = e0;
#ifdef OPS_SIMD
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; j + 8 <= e1; j += 8) {
        __m256 vg = _mm256_loadu_ps(g + j);
        __m256 den = _mm256_add_ps(one, kn_exp8(_mm256_xor_ps(vg, sign)));
        _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(vg, den), _mm256_loadu_ps(u + j)));
    }
#endif
    for (; j < e1; j++)
        o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

static void swiglu_rows(void *arg, int64_t i0, int64_t i1, int tid)
{
    const swiglu_job *J = arg;
    /* rows are contiguous, so the row range is one flat element range */
    kn_cpu_swiglu_span(J->gate, J->up, J->out, i0 * J->n, i1 * J->n);
}

void kn_cpu_swiglu(void *ctx, const float *gate, const float *up, float *out, int64_t m, int64_t n)
{
    assert(m >= 0 && n > 0);
    swiglu_job J = {.gate = gate, .up = up, .out = out, .n = n};
    kn_pool_run(kn_cpu_pool(ctx), m, min_rows_per_thread(n), swiglu_rows, &J);
}

/* ---- geglu ---- */

/* GELU with the tanh approximation, as ggml_gelu and Hugging Face's gelu_pytorch_tanh that
 * gemma uses: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
void kn_cpu_geglu_span(const float *g, const float *u, float *o, int64_t e0, int64_t e1)
{
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    for (int64_t j = e0; j < e1; j++) {
        const float x = g[j];
        o[j] = 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x))) * u[j];
    }
}

static void geglu_rows(void *arg, int64_t i0, int64_t i1, int tid)
{
    const swiglu_job *J = arg;
    kn_cpu_geglu_span(J->gate, J->up, J->out, i0 * J->n, i1 * J->n);
    (void)tid;
}

void kn_cpu_geglu(void *ctx, const float *gate, const float *up, float *out, int64_t m, int64_t n)
{
    assert(m >= 0 && n > 0);
    swiglu_job J = {.gate = gate, .up = up, .out = out, .n = n};
    kn_pool_run(kn_cpu_pool(ctx), m, min_rows_per_thread(n), geglu_rows, &J);
}
