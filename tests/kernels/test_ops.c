/* test_ops.c: the CPU backend's rmsnorm, rope and swiglu against float64 references, on
 * 1, 2 and 3 threads (row counts big enough that the pool really splits). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "kn_test_util.h"
#include "tharness.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static const int thread_counts[] = {1, 2, 3};

static void test_rmsnorm(void)
{
    static const int64_t ns[] = {1, 7, 64, 576, 4099};
    for (size_t tc = 0; tc < 3; tc++) {
        kn_cpu *c;
        TH_REQUIRE(kn_cpu_create(thread_counts[tc], &c) == 0);
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            const int64_t n = ns[k], m = 301;
            float *x = malloc(sizeof(float) * m * n), *w = malloc(sizeof(float) * n);
            float *y = malloc(sizeof(float) * m * n), *xa = malloc(sizeof(float) * m * n);
            for (int64_t j = 0; j < n; j++)
                w[j] = kt_frand(&rng, -2, 2);
            for (int64_t i = 0; i < m * n; i++)
                x[i] = kt_frand(&rng, -3, 3) * (float)(1 + i % 5);
            memcpy(xa, x, sizeof(float) * m * n);
            const float eps = 1e-5f;
            kn_cpu_rmsnorm(c, x, w, y, m, n, eps);
            kn_cpu_rmsnorm(c, xa, w, xa, m, n, eps); /* in place */
            double worst = 0;
            int same = 1;
            for (int64_t i = 0; i < m; i++) {
                double ss = 0;
                for (int64_t j = 0; j < n; j++)
                    ss += (double)x[i * n + j] * x[i * n + j];
                double sc = 1.0 / sqrt(ss / (double)n + eps);
                for (int64_t j = 0; j < n; j++) {
                    double ref = x[i * n + j] * sc * w[j];
                    double e = fabs(y[i * n + j] - ref) / (fabs(ref) + 1e-30);
                    if (e > worst) worst = e;
                    if (xa[i * n + j] != y[i * n + j]) same = 0;
                }
            }
            TH_CHECKF(worst < 1e-6, "threads %d n %lld rel err %g", thread_counts[tc], (long long)n,
                      worst);
            TH_CHECKF(same, "in-place result differs (threads %d n %lld)", thread_counts[tc],
                      (long long)n);
            free(x);
            free(w);
            free(y);
            free(xa);
        }
        kn_cpu_destroy(c);
    }
}

/* freq[i] = base^(-2i / n_rot), as llama.cpp's theta_scale powers */
static void rope_case(kn_cpu *c, int n_heads, int head_dim, int n_rot, bool neox, int64_t m)
{
    const int64_t row = (int64_t)n_heads * head_dim;
    float *x = malloc(sizeof(float) * m * row), *x0 = malloc(sizeof(float) * m * row);
    float *freq = malloc(sizeof(float) * (size_t)(head_dim / 2));
    int32_t *pos = malloc(sizeof(int32_t) * m);
    for (int i = 0; i < head_dim / 2; i++)
        freq[i] = (float)pow(10000.0, -2.0 * i / (double)n_rot);
    for (int64_t t = 0; t < m; t++)
        pos[t] = t < 4 ? (int32_t)t : (int32_t)(kt_unit(&rng) * 20000);
    for (int64_t i = 0; i < m * row; i++)
        x0[i] = x[i] = kt_frand(&rng, -2, 2);
    kn_cpu_rope(c, x, m, n_heads, head_dim, n_rot, pos, freq, neox);
    double worst = 0;
    int untouched = 1;
    const int half = n_rot / 2;
    for (int64_t t = 0; t < m; t++)
        for (int h = 0; h < n_heads; h++) {
            const float *a = x0 + t * row + (int64_t)h * head_dim;
            const float *b = x + t * row + (int64_t)h * head_dim;
            for (int i = 0; i < half; i++) {
                int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
                double th = (double)pos[t] * (double)freq[i];
                double r0 = a[i0] * cos(th) - a[i1] * sin(th);
                double r1 = a[i0] * sin(th) + a[i1] * cos(th);
                double mag = fabs(a[i0]) + fabs(a[i1]) + 1e-30;
                double e = fmax(fabs(b[i0] - r0), fabs(b[i1] - r1)) / mag;
                if (e > worst) worst = e;
            }
            for (int d = n_rot; d < head_dim; d++)
                if (a[d] != b[d]) untouched = 0;
        }
    TH_CHECKF(worst < 1e-6, "%s n_rot %d/%d rel err %g", neox ? "neox" : "norm", n_rot, head_dim,
              worst);
    TH_CHECKF(untouched, "dims >= n_rot changed (%s n_rot %d)", neox ? "neox" : "norm", n_rot);
    free(x);
    free(x0);
    free(freq);
    free(pos);
}

static void test_rope(void)
{
    for (size_t tc = 0; tc < 3; tc++) {
        kn_cpu *c;
        TH_REQUIRE(kn_cpu_create(thread_counts[tc], &c) == 0);
        for (int neox = 0; neox < 2; neox++) {
            rope_case(c, 9, 64, 64, neox, 1);
            rope_case(c, 9, 64, 64, neox, 200);
            rope_case(c, 4, 128, 32, neox, 150); /* partial rotary */
            rope_case(c, 3, 64, 0, neox, 5);
        }
        kn_cpu_destroy(c);
    }
}

static void test_swiglu(void)
{
    static const int64_t ns[] = {1, 13, 1536};
    for (size_t tc = 0; tc < 3; tc++) {
        kn_cpu *c;
        TH_REQUIRE(kn_cpu_create(thread_counts[tc], &c) == 0);
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            const int64_t n = ns[k], m = 97;
            float *g = malloc(sizeof(float) * m * n), *u = malloc(sizeof(float) * m * n);
            float *o = malloc(sizeof(float) * m * n);
            for (int64_t i = 0; i < m * n; i++) {
                g[i] = kt_frand(&rng, -20, 20);
                u[i] = kt_frand(&rng, -3, 3);
            }
            /* the saturating ends and zero */
            static const float edge[] = {-100.f, -88.5f, -87.f, 0.f, 87.f, 88.5f, 100.f};
            for (size_t e = 0; e < sizeof edge / sizeof edge[0] && (int64_t)e < m * n; e++)
                g[e] = edge[e];
            kn_cpu_swiglu(c, g, u, o, m, n);
            double worst = 0;
            for (int64_t i = 0; i < m * n; i++) {
                double ref = g[i] / (1.0 + exp(-(double)g[i])) * u[i];
                double e = fabs(o[i] - ref) / (fabs(ref) + 1e-30);
                if (fabs(o[i] - ref) < 1e-30) e = 0; /* underflowed tails */
                if (e > worst) worst = e;
            }
            TH_CHECKF(worst < 1e-6, "threads %d n %lld rel err %g", thread_counts[tc], (long long)n,
                      worst);
            free(g);
            free(u);
            free(o);
        }
        kn_cpu_destroy(c);
    }
}

int main(void)
{
    TH_RUN(test_rmsnorm);
    TH_RUN(test_rope);
    TH_RUN(test_swiglu);
    TH_EXIT();
}
