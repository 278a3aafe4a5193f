/* test_logprobs.c: td_logprobs against a brute-force log-softmax and full sort: values,
 * order and ties, large logits (no overflow), and bad arguments. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../tharness.h"
#include "sampler.h"
#include "td_err.h"

/* reference: log-softmax in long double, top k by a full selection sort */
static void ref_logprobs(const float *l, int n, int chosen, int k, double *clp, td_logprob *top)
{
    long double mx = l[0], s = 0;
    for (int i = 1; i < n; i++)
        if (l[i] > mx) mx = l[i];
    for (int i = 0; i < n; i++)
        s += expl((long double)l[i] - mx);
    long double lse = mx + logl(s);
    *clp = (double)((long double)l[chosen] - lse);
    char *used = calloc((size_t)n, 1);
    for (int j = 0; j < k; j++) {
        int b = -1;
        for (int i = 0; i < n; i++)
            if (!used[i] && (b < 0 || l[i] > l[b])) b = i; /* first max: lowest id */
        used[b] = 1;
        top[j] = (td_logprob){.id = b, .logprob = (float)((long double)l[b] - lse)};
    }
    free(used);
}

static void check_against_ref(const float *l, int n, float scale)
{
    for (int k = 0; k <= TD_MAX_TOP_LOGPROBS && k <= n; k += (k < 3 ? 1 : 7)) {
        for (int chosen = 0; chosen < n; chosen += n / 5 + 1) {
            td_logprob want[TD_MAX_TOP_LOGPROBS];
            td_logprob_entry e;
            double wclp;
            TH_REQUIRE(kn_logprobs(l, n, chosen, k, &e) == 0 && e.n_top == k);
            float clp = e.logprob;
            const td_logprob *got = e.top;
            ref_logprobs(l, n, chosen, k, &wclp, want);
            double tol = 1e-5 * (1 + scale);
            TH_CHECKF(fabs(clp - wclp) < tol, "n %d chosen %d: %.9g vs %.9g", n, chosen, clp, wclp);
            for (int j = 0; j < k; j++) {
                TH_CHECKF(got[j].id == want[j].id, "n %d k %d rank %d: id %d vs %d", n, k, j,
                          got[j].id, want[j].id);
                TH_CHECKF(fabs(got[j].logprob - want[j].logprob) < tol, "rank %d: %.9g vs %.9g", j,
                          got[j].logprob, want[j].logprob);
            }
        }
    }
}

static void test_random(void)
{
    srand(7);
    for (int n = 1; n <= 3000; n = n * 3 + 1) {
        float *l = malloc((size_t)n * sizeof *l);
        for (int i = 0; i < n; i++)
            l[i] = (float)(rand() % 2001 - 1000) / 100.0f; /* many ties */
        check_against_ref(l, n, 10);
        free(l);
    }
}

static void test_large_logits(void)
{
    /* exp(1e4) overflows a double: only the max-subtracted form survives */
    float l[50];
    for (int i = 0; i < 50; i++)
        l[i] = 1e4f + (float)(i % 7);
    check_against_ref(l, 50, 0);
    td_logprob_entry e;
    TH_REQUIRE(kn_logprobs(l, 50, 6, 3, &e) == 0);
    TH_CHECK(isfinite(e.logprob) && e.logprob < 0 && e.top[0].id == 6 && e.top[1].id == 13 &&
             e.top[2].id == 20 && e.top[0].logprob == e.logprob);
    /* sum of exp over the vocabulary is 1 */
    double s = 0;
    for (int i = 0; i < 50; i++) {
        TH_REQUIRE(kn_logprobs(l, 50, i, 0, &e) == 0);
        s += exp(e.logprob);
    }
    TH_CHECKF(fabs(s - 1) < 1e-6, "sum %.9g", s);
}

/* A real vocabulary's size and spread (logits ~ N(0, 3) plus a few peaks): every
 * logprob above -30 within 1e-5 of a double-precision log-softmax; the time per call. */
static void test_vocab(void)
{
    enum { N = 49152 };
    float *l = malloc(N * sizeof *l);
    srand(11);
    for (int i = 0; i < N; i++) {
        double u1 = (rand() + 1.0) / (RAND_MAX + 2.0), u2 = (rand() + 1.0) / (RAND_MAX + 2.0);
        l[i] = (float)(3.0 * sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2));
    }
    l[123] = 25, l[4567] = 24.5f, l[40000] = 22;
    double mx = l[0], sum = 0, worst = 0;
    for (int i = 1; i < N; i++)
        mx = l[i] > mx ? l[i] : mx;
    for (int i = 0; i < N; i++)
        sum += exp((double)l[i] - mx);
    double lse = mx + log(sum);
    td_logprob_entry e;
    for (int i = 0; i < N; i += 7) {
        TH_REQUIRE(kn_logprobs(l, N, i, 0, &e) == 0);
        double want = (double)l[i] - lse;
        if (want > -30 && fabs(e.logprob - want) > worst) worst = fabs(e.logprob - want);
    }
    TH_CHECKF(worst < 1e-5, "worst |error| %.3g", worst);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int reps = 200;
    for (int r = 0; r < reps; r++)
        kn_logprobs(l, N, r, 20, &e);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double us =
        ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / 1e3 / reps;
    printf("kn_logprobs: vocabulary %d, k 20: %.1f us per call, worst error %.2g\n", N, us, worst);
    free(l);
}

static void test_bad_args(void)
{
    float l[4] = {0, 1, 2, 3};
    td_logprob_entry e;
    TH_CHECK(kn_logprobs(l, 4, -1, 0, &e) == TD_EINVAL);
    TH_CHECK(kn_logprobs(l, 4, 4, 0, &e) == TD_EINVAL);
    TH_CHECK(kn_logprobs(l, 4, 0, 5, &e) == TD_EINVAL);
    TH_CHECK(kn_logprobs(l, 4, 0, -1, &e) == TD_EINVAL);
    TH_CHECK(kn_logprobs(l, 0, 0, 0, &e) == TD_EINVAL);
}

int main(void)
{
    TH_RUN(test_random);
    TH_RUN(test_large_logits);
    TH_RUN(test_vocab);
    TH_RUN(test_bad_args);
    TH_EXIT();
}
