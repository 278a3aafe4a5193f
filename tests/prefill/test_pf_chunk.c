/* test_pf_chunk.c: the prefill node's pure planning functions (prefill-node/pf_chunk.h)
 * against hand-computed cases: layer partitions (default and explicit, valid and not),
 * the least-squares quadratic fit (exact recovery, conditioning at large lengths,
 * degenerate inputs, the b clamp, the non-convex fallback), the next-chunk formula with
 * each clamp (smoothing, floor, alignment, caps), and whole plans (fixed when s = 0,
 * decreasing along the prompt when a > 0 and s > 0, exact coverage).
 */
#include <math.h>
#include <string.h>

#include "../tharness.h"
#include "pf_chunk.h"
#include "td_err.h"

static bool close_rel(double x, double y, double tol)
{
    return fabs(x - y) <= tol * fmax(1.0, fmax(fabs(x), fabs(y)));
}

/* ---- layer partition ---- */

static void test_partition_default(void)
{
    int c[8];
    TH_REQUIRE(pf_layer_partition(61, 4, NULL, 0, c) == 0);
    TH_CHECK(c[0] == 15 && c[1] == 15 && c[2] == 15 && c[3] == 16);
    TH_REQUIRE(pf_layer_partition(30, 4, NULL, 0, c) == 0);
    TH_CHECK(c[0] == 7 && c[1] == 7 && c[2] == 8 && c[3] == 8);
    TH_REQUIRE(pf_layer_partition(30, 2, NULL, 0, c) == 0);
    TH_CHECK(c[0] == 15 && c[1] == 15);
    TH_REQUIRE(pf_layer_partition(10, 3, NULL, 0, c) == 0);
    TH_CHECK(c[0] == 3 && c[1] == 3 && c[2] == 4);
    TH_REQUIRE(pf_layer_partition(5, 5, NULL, 0, c) == 0);
    for (int s = 0; s < 5; s++)
        TH_CHECK(c[s] == 1);
    TH_REQUIRE(pf_layer_partition(7, 1, NULL, 0, c) == 0);
    TH_CHECK(c[0] == 7);

    int l0, l1, q[4] = {15, 15, 15, 16};
    TH_CHECK(pf_stage_range(q, 4, 0, &l0, &l1) == 0 && l0 == 0 && l1 == 15);
    TH_CHECK(pf_stage_range(q, 4, 3, &l0, &l1) == 0 && l0 == 45 && l1 == 61);
    TH_CHECK(pf_stage_range(q, 4, 4, &l0, &l1) == TD_EINVAL);
    TH_CHECK(pf_stage_range(q, 4, -1, &l0, &l1) == TD_EINVAL);
}

static void test_partition_explicit(void)
{
    int c[4] = {0};
    int ok[2] = {10, 20};
    TH_CHECK(pf_layer_partition(30, 2, ok, 2, c) == 0 && c[0] == 10 && c[1] == 20);
    int short_sum[2] = {10, 19}, long_sum[2] = {11, 20}, zero[2] = {0, 30}, neg[2] = {-1, 31};
    TH_CHECK(pf_layer_partition(30, 2, short_sum, 2, c) == TD_EINVAL);
    TH_CHECK(pf_layer_partition(30, 2, long_sum, 2, c) == TD_EINVAL);
    TH_CHECK(pf_layer_partition(30, 2, zero, 2, c) == TD_EINVAL);
    TH_CHECK(pf_layer_partition(30, 2, neg, 2, c) == TD_EINVAL);
    int three[3] = {10, 10, 10};
    TH_CHECK(pf_layer_partition(30, 2, three, 3, c) == TD_EINVAL); /* entries != pp */
    TH_CHECK(pf_layer_partition(30, 0, NULL, 0, c) == TD_EINVAL);
    TH_CHECK(pf_layer_partition(3, 4, NULL, 0, c) == TD_EINVAL); /* a stage without layers */
    TH_CHECK(pf_layer_partition(0, 1, NULL, 0, c) == TD_EINVAL);
}

/* ---- fit ---- */

static void test_fit_exact(void)
{
    /* t = 2e-6 l^2 + 0.5 l + 3 over 64..640 */
    double l[10], t[10];
    for (int i = 0; i < 10; i++) {
        l[i] = 64 + 64 * i;
        t[i] = 2e-6 * l[i] * l[i] + 0.5 * l[i] + 3;
    }
    pf_cost_model m;
    TH_REQUIRE(pf_fit_quadratic(l, t, 10, &m) == 0);
    TH_CHECK(m.valid && m.dynamic && m.n_samples == 10);
    TH_CHECKF(close_rel(m.a, 2e-6, 1e-8), "a %.12e", m.a);
    TH_CHECKF(close_rel(m.b, 0.5, 1e-9), "b %.12e", m.b);
    TH_CHECKF(close_rel(m.c, 3, 1e-8), "c %.12e", m.c);
    TH_CHECK(m.b == m.b_fit);
    TH_CHECKF(m.r2 > 1 - 1e-12 && m.r2 <= 1 + 1e-12, "r2 %.15f", m.r2);
    TH_CHECK(close_rel(pf_cost_eval(&m, 100), 2e-6 * 1e4 + 50 + 3, 1e-9));
    /* f(L + x) - f(L) = a x (2L + x) + b x */
    TH_CHECK(close_rel(pf_cost_chunk(&m, 1000, 200), 2e-6 * 200 * 2200 + 0.5 * 200, 1e-9));
}

static void test_fit_large_lengths(void)
{
    /* lengths near 10^6 with a narrow range: raw normal equations in l would lose every
     * digit of a (sums of l^4 ~ 1e25); centred and scaled they do not */
    double l[8], t[8];
    for (int i = 0; i < 8; i++) {
        l[i] = 1e6 + 1000.0 * i;
        t[i] = 3e-9 * l[i] * l[i] + 2e-3 * l[i] + 7;
    }
    pf_cost_model m;
    TH_REQUIRE(pf_fit_quadratic(l, t, 8, &m) == 0);
    TH_CHECKF(close_rel(m.a, 3e-9, 1e-5), "a %.12e", m.a);
    for (int i = 0; i < 8; i++)
        TH_CHECK(close_rel(pf_cost_eval(&m, l[i]), t[i], 1e-9));
    TH_CHECK(m.r2 > 1 - 1e-9);
}

static void test_fit_noisy(void)
{
    /* exact quadratic plus +-1% alternating noise: a recovered roughly, 0 < R^2 < 1 */
    double l[16], t[16];
    for (int i = 0; i < 16; i++) {
        l[i] = 40 + 40 * i;
        double f = 1e-4 * l[i] * l[i] + 2 * l[i] + 10;
        t[i] = f * (i % 2 ? 1.01 : 0.99);
    }
    pf_cost_model m;
    TH_REQUIRE(pf_fit_quadratic(l, t, 16, &m) == 0);
    TH_CHECK(m.valid && m.r2 < 1 && m.r2 > 0.99);
    TH_CHECKF(m.a > 0 && fabs(m.a - 1e-4) < 1e-4, "a %.6e", m.a);
}

static void test_fit_degenerate(void)
{
    pf_cost_model m;
    double l2[2] = {1, 2}, t2[2] = {1, 4};
    TH_CHECK(pf_fit_quadratic(l2, t2, 2, &m) == TD_EINVAL && !m.valid && !m.dynamic);
    double l3[4] = {5, 5, 9, 9}, t3[4] = {1, 1, 2, 2}; /* two distinct lengths */
    TH_CHECK(pf_fit_quadratic(l3, t3, 4, &m) == TD_EINVAL && !m.valid && !m.dynamic);
    double l4[3] = {5, 5, 5}, t4[3] = {1, 2, 3};
    TH_CHECK(pf_fit_quadratic(l4, t4, 3, &m) == TD_EINVAL);
    double l5[3] = {1, 2, 3}, t5[3] = {1, NAN, 3};
    TH_CHECK(pf_fit_quadratic(l5, t5, 3, &m) == TD_EINVAL && !m.valid);
    double l6[3] = {1, INFINITY, 3}, t6[3] = {1, 2, 3};
    TH_CHECK(pf_fit_quadratic(l6, t6, 3, &m) == TD_EINVAL);
    TH_CHECK(pf_fit_quadratic(NULL, NULL, 0, &m) == TD_EINVAL);
    /* constant times: a fit with a = 0 (not convex: fixed chunks), R^2 = 1 */
    double l7[4] = {1, 2, 3, 4}, t7[4] = {5, 5, 5, 5};
    TH_CHECK(pf_fit_quadratic(l7, t7, 4, &m) == 0 && m.valid && !m.dynamic);
    TH_CHECK(fabs(m.a) < 1e-12 && close_rel(m.c, 5, 1e-12) && m.r2 == 1);
}

static void test_fit_concave_and_clamp(void)
{
    double l[6], t[6];
    pf_cost_model m;
    /* concave: a < 0 -> valid but not dynamic */
    for (int i = 0; i < 6; i++) {
        l[i] = 100 * (i + 1);
        t[i] = -1e-4 * l[i] * l[i] + l[i];
    }
    TH_REQUIRE(pf_fit_quadratic(l, t, 6, &m) == 0);
    TH_CHECK(m.valid && !m.dynamic && m.a < 0);
    pf_chunk_params p = {.chunk_size = 512, .smooth = 1, .page_size = 16, .dynamic = true};
    TH_CHECK(pf_next_chunk(&m, &p, 4096, 100000) == 512); /* fixed fallback */
    /* negative linear term: b clamped at 0, a kept */
    for (int i = 0; i < 6; i++)
        t[i] = 1e-3 * l[i] * l[i] - 0.5 * l[i] + 100;
    TH_REQUIRE(pf_fit_quadratic(l, t, 6, &m) == 0);
    TH_CHECK(m.dynamic && m.b == 0 && close_rel(m.b_fit, -0.5, 1e-9));
    TH_CHECK(close_rel(m.a, 1e-3, 1e-9));
    /* the clamped model drives the planner: a = 1e-3, b = 0 is f = 1e-3 l^2, as a = 1 */
    p.smooth = 1;
    TH_CHECK(pf_next_chunk(&m, &p, 512, 100000) == 192);
}

/* ---- next chunk ---- */

static void test_next_chunk_formula(void)
{
    /* f(l) = l^2: T = C^2. C = 512, L = 512: x = (-1024 + sqrt(1024^2 + 4 * 512^2)) / 2
     * = 512 (sqrt 2 - 1) = 212.08 */
    pf_cost_model m = {.a = 1, .b = 0, .valid = true, .dynamic = true};
    pf_chunk_params p = {.chunk_size = 512, .smooth = 1, .page_size = 16, .dynamic = true};
    TH_CHECK(pf_chunk_align(&p) == 64);
    TH_CHECK(pf_next_chunk(&m, &p, 0, 100000) == 512);   /* first chunk: C */
    TH_CHECK(pf_next_chunk(&m, &p, 512, 100000) == 192); /* 212.08 -> 192 */
    p.smooth = 0.5;                                      /* 512 - 0.5 * 299.92 = 362.04 */
    TH_CHECK(pf_next_chunk(&m, &p, 512, 100000) == 320);
    p.smooth = 0.75; /* 512 - 0.75 * 299.92 = 287.06 */
    TH_CHECK(pf_next_chunk(&m, &p, 512, 100000) == 256);
    p.smooth = 0; /* fixed */
    TH_CHECK(pf_next_chunk(&m, &p, 512, 100000) == 512);
    TH_CHECK(pf_next_chunk(&m, &p, 100000, 100000) == 512);
    /* b > 0: f = l^2 + 512 l, C = 512: T = 2 * 512^2; L = 512: B = 1536,
     * x = (-1536 + sqrt(1536^2 + 8 * 512^2)) / 2 = 512 (sqrt 17 - 3) / 2 = 287.52 -> 256 */
    pf_cost_model mb = {.a = 1, .b = 512, .valid = true, .dynamic = true};
    p.smooth = 1;
    TH_CHECK(pf_next_chunk(&mb, &p, 512, 100000) == 256);
    /* fixed chunking requested, or a model that is not convex, or none */
    p.dynamic = false;
    TH_CHECK(pf_next_chunk(&m, &p, 512, 100000) == 512);
    p.dynamic = true;
    pf_cost_model flat = {.a = 0, .b = 1, .valid = true, .dynamic = false};
    TH_CHECK(pf_next_chunk(&flat, &p, 512, 100000) == 512);
    TH_CHECK(pf_next_chunk(NULL, &p, 512, 100000) == 512);
}

static void test_next_chunk_clamps(void)
{
    pf_cost_model m = {.a = 1, .b = 0, .valid = true, .dynamic = true};
    /* floor C/4: L = 4096, x = 2T / (B + sqrt(B^2 + 4T)) = 31.9 -> 128 (aligned) */
    pf_chunk_params p = {.chunk_size = 512, .smooth = 1, .page_size = 16, .dynamic = true};
    TH_CHECK(pf_next_chunk(&m, &p, 4096, 100000) == 128);
    /* floor not aligned: C = 300 -> floor 75 -> rounded down to 64 */
    p.chunk_size = 300;
    TH_CHECK(pf_next_chunk(&m, &p, 100000, 1000000) == 64);
    /* floor below the alignment: C = 100 -> 25 -> 0 -> never below 64 */
    p.chunk_size = 100;
    TH_CHECK(pf_next_chunk(&m, &p, 100000, 1000000) == 64);
    /* page size above 64 sets the alignment: C = 1024, L = 1024: 424.15 -> 256 */
    p.chunk_size = 1024;
    p.page_size = 256;
    TH_CHECK(pf_chunk_align(&p) == 256);
    TH_CHECK(pf_next_chunk(&m, &p, 1024, 100000) == 256);
    p.page_size = 16;
    TH_CHECK(pf_next_chunk(&m, &p, 1024, 100000) == 384);
    /* caps: remaining, then the per-batch token limit (first chunk too) */
    p.chunk_size = 512;
    TH_CHECK(pf_next_chunk(&m, &p, 0, 100) == 100);
    TH_CHECK(pf_next_chunk(&m, &p, 512, 100) == 100);
    TH_CHECK(pf_next_chunk(&m, &p, 512, 7) == 7);
    p.max_batch_tokens = 128;
    TH_CHECK(pf_next_chunk(&m, &p, 0, 100000) == 128);
    TH_CHECK(pf_next_chunk(&m, &p, 512, 100000) == 128);
    TH_CHECK(pf_next_chunk(&m, &p, 512, 50) == 50);
    /* bad parameters */
    p.max_batch_tokens = 0;
    TH_CHECK(pf_next_chunk(&m, &p, 0, 0) == TD_EINVAL);
    TH_CHECK(pf_next_chunk(&m, &p, -1, 10) == TD_EINVAL);
    p.smooth = 1.5;
    TH_CHECK(pf_next_chunk(&m, &p, 0, 10) == TD_EINVAL);
    p.smooth = -0.1;
    TH_CHECK(pf_next_chunk(&m, &p, 0, 10) == TD_EINVAL);
    p.smooth = 0.5;
    p.chunk_size = 0;
    TH_CHECK(pf_next_chunk(&m, &p, 0, 10) == TD_EINVAL);
}

/* ---- plans ---- */

static int64_t sum_chunks(const int32_t *c, int64_t n)
{
    int64_t s = 0;
    for (int64_t i = 0; i < n; i++)
        s += c[i];
    return s;
}

static void test_plan_fixed(void)
{
    pf_cost_model m = {.a = 1e-6, .b = 1, .valid = true, .dynamic = true};
    pf_chunk_params p = {.chunk_size = 512, .smooth = 0, .page_size = 16, .dynamic = true};
    int32_t c[64];
    int64_t n;
    TH_REQUIRE(pf_plan_chunks(&m, &p, 8192, c, 64, &n) == 0);
    TH_CHECK(n == 16);
    for (int64_t i = 0; i < n; i++)
        TH_CHECK(c[i] == 512);
    TH_REQUIRE(pf_plan_chunks(&m, &p, 1000, c, 64, &n) == 0);
    TH_CHECK(n == 2 && c[0] == 512 && c[1] == 488);
    TH_REQUIRE(pf_plan_chunks(&m, &p, 1, c, 64, &n) == 0);
    TH_CHECK(n == 1 && c[0] == 1);
    /* an unaligned C stays C when fixed */
    p.chunk_size = 500;
    TH_REQUIRE(pf_plan_chunks(&m, &p, 1200, c, 64, &n) == 0);
    TH_CHECK(n == 3 && c[0] == 500 && c[1] == 500 && c[2] == 200);
    /* output too small, bad length */
    TH_CHECK(pf_plan_chunks(&m, &p, 1200, c, 2, &n) == TD_ERANGE);
    TH_CHECK(pf_plan_chunks(&m, &p, 0, c, 64, &n) == TD_EINVAL);
}

static void test_plan_dynamic(void)
{
    /* times in ms of a stage: 2e-4 ms/token^2, 1 ms/token */
    pf_cost_model m = {.a = 2e-4, .b = 1, .valid = true, .dynamic = true};
    pf_chunk_params p = {.chunk_size = 512, .smooth = 0.75, .page_size = 16, .dynamic = true};
    int64_t cap = pf_plan_max_chunks(&p, 8192);
    TH_CHECK(cap == 128); /* 8192 / min(512, 64) */
    int32_t c[128];
    int64_t n;
    TH_REQUIRE(pf_plan_chunks(&m, &p, 8192, c, cap, &n) == 0);
    TH_CHECK(sum_chunks(c, n) == 8192);
    TH_CHECK(c[0] == 512);
    TH_CHECK(n > 16);
    for (int64_t i = 1; i < n - 1; i++) {
        TH_CHECKF(c[i] <= c[i - 1], "chunk %lld: %d after %d", (long long)i, c[i], c[i - 1]);
        TH_CHECK(c[i] % 64 == 0 && c[i] >= 128);
    }
    TH_CHECK(c[n - 2] < c[1]); /* strictly smaller far along the prompt */
    /* s = 1: every non-final chunk's predicted time is at most T, and one more alignment
     * unit would exceed T (rounding down), unless the floor held it up */
    p.smooth = 1;
    TH_REQUIRE(pf_plan_chunks(&m, &p, 8192, c, cap, &n) == 0);
    TH_CHECK(sum_chunks(c, n) == 8192);
    double T = pf_cost_chunk(&m, 0, 512);
    int64_t L = c[0];
    for (int64_t i = 1; i < n - 1; i++) {
        TH_CHECKF(pf_cost_chunk(&m, L, c[i]) <= T * (1 + 1e-12) || c[i] == 128,
                  "chunk %lld size %d at %lld", (long long)i, c[i], (long long)L);
        TH_CHECK(pf_cost_chunk(&m, L, c[i] + 64) > T);
        L += c[i];
    }
    /* the dynamic plan's predicted times are flatter than the fixed plan's */
    pf_chunk_params f = p;
    f.smooth = 0;
    int32_t cf[128];
    int64_t nf;
    TH_REQUIRE(pf_plan_chunks(&m, &f, 8192, cf, cap, &nf) == 0);
    double fixed_last = pf_cost_chunk(&m, 8192 - 512, 512);
    TH_CHECKF(fixed_last / T > 3, "%f", fixed_last / T); /* 2137.3 / 564.4 */
    /* a tiny cap fails cleanly */
    TH_CHECK(pf_plan_chunks(&m, &p, 8192, c, 3, &n) == TD_ERANGE);
}

static void test_plan_caps(void)
{
    pf_cost_model m = {.a = 2e-5, .b = 1, .valid = true, .dynamic = true};
    pf_chunk_params p = {.chunk_size = 512,
                         .smooth = 0.75,
                         .page_size = 16,
                         .max_batch_tokens = 200,
                         .dynamic = true};
    int64_t cap = pf_plan_max_chunks(&p, 3000);
    int32_t c[256];
    int64_t n;
    TH_REQUIRE(cap <= 256);
    TH_REQUIRE(pf_plan_chunks(&m, &p, 3000, c, cap, &n) == 0);
    TH_CHECK(sum_chunks(c, n) == 3000);
    for (int64_t i = 0; i < n; i++)
        TH_CHECK(c[i] <= 200 && c[i] > 0);
}

int main(void)
{
    TH_RUN(test_partition_default);
    TH_RUN(test_partition_explicit);
    TH_RUN(test_fit_exact);
    TH_RUN(test_fit_large_lengths);
    TH_RUN(test_fit_noisy);
    TH_RUN(test_fit_degenerate);
    TH_RUN(test_fit_concave_and_clamp);
    TH_RUN(test_next_chunk_formula);
    TH_RUN(test_next_chunk_clamps);
    TH_RUN(test_plan_fixed);
    TH_RUN(test_plan_dynamic);
    TH_RUN(test_plan_caps);
    TH_EXIT();
}
