/* test_pf_tune.c: the self-tuning cost model (prefill-node/pf_tune.h): the robust profile
 * fit survives outliers that throw the plain least-squares fit off; the online refit from
 * served chunks converges to the true coefficients when the start-up profile was taken on a
 * busier machine; it keeps the start-up fit when the chunks cannot support a refit (too
 * few, or a wildly different a); old data is forgotten; the model's initial chunk size
 * follows its closed form and its bounds.
 */
#include <math.h>
#include <string.h>

#include "../tharness.h"
#include "pf_tune.h"
#include "td_err.h"

static double f_true(double l, double a, double b, double c)
{
    return (a * l + b) * l + c;
}

/* 16 lengths 64..640 of f = 7e-4 l^2 + 2.2 l + 5, every third one hit by a 2-4x spike (a
 * neighbour's burst) */
static void test_robust_profile(void)
{
    double len[16], t[16];
    const double a = 7e-4, b = 2.2, c = 5;
    for (int i = 0; i < 16; i++) {
        len[i] = 64 + 576.0 * i / 15;
        t[i] = f_true(len[i], a, b, c) * (1 + 0.01 * ((i * 7) % 5 - 2) / 2.0);
    }
    t[2] *= 3.0;
    t[7] *= 2.0;
    t[12] *= 4.0;
    pf_cost_model plain, rob;
    int nrej = -1;
    TH_REQUIRE(pf_fit_quadratic(len, t, 16, &plain) == 0);
    TH_REQUIRE(pf_fit_robust(len, t, 16, &rob, &nrej) == 0);
    TH_CHECK(nrej == 3);
    TH_CHECK(rob.dynamic && rob.n_samples == 13);
    TH_CHECK(fabs(rob.a - a) < 0.15 * a);
    TH_CHECK(fabs(rob.b - b) < 0.05 * b);
    /* the plain fit is far off (this is what the feature is for) */
    TH_CHECK(fabs(plain.a - a) > 0.5 * a || fabs(plain.b - b) > 0.3 * b);
    /* clean data: nothing rejected, the same fit as the plain one */
    for (int i = 0; i < 16; i++)
        t[i] = f_true(len[i], a, b, c);
    TH_REQUIRE(pf_fit_robust(len, t, 16, &rob, &nrej) == 0);
    TH_CHECK(nrej == 0 && fabs(rob.a - a) < 1e-9 && fabs(rob.b - b) < 1e-6);
    /* degenerate input keeps pf_fit_quadratic's error */
    TH_CHECK(pf_fit_robust(len, t, 2, &rob, &nrej) == TD_EINVAL);
}

/* the profile was measured with a neighbour running (every time 1.8x); the chunks served
 * later (8K prompts planned with the model in use, and a packed chunk of short ones) run on a quiet
 * machine at a = 6e-4, b = 2, per-chunk constant 9 ms, with a few slow chunks mixed in */
static void test_online_converges(void)
{
    const double a = 6e-4, b = 2.0, c_o = 9.0;
    double len[16], t[16];
    for (int i = 0; i < 16; i++) {
        len[i] = 64 + 576.0 * i / 15;
        t[i] = 1.8 * f_true(len[i], a, b, 4.0);
    }
    pf_cost_model prior;
    TH_REQUIRE(pf_fit_robust(len, t, 16, &prior, NULL) == 0);
    TH_REQUIRE(prior.dynamic && fabs(prior.a - 1.8 * a) < 1e-9);
    pf_tune tu;
    pf_tune_init(&tu, &prior, len, t, 16, 0);
    TH_CHECK(pf_tune_model(&tu)->a == prior.a && !tu.online);
    /* closed loop: each 8K prompt is planned with the model in use (C = 1024, s = 0.75) */
    pf_chunk_params cp = {.chunk_size = 1024, .smooth = 0.75, .page_size = 16, .dynamic = true};
    int k = 0;
    for (int req = 0; req < 6; req++)
        for (int64_t L = 0, x; L < 8192; L += x, k++) {
            x = pf_next_chunk(pf_tune_model(&tu), &cp, L, 8192 - L);
            double ms = a * x * (2.0 * L + x) + b * x + c_o;
            if (k % 11 == 5) ms *= 2.5; /* a burst */
            TH_REQUIRE(pf_tune_observe(&tu, &L, &x, 1, ms) == 0);
            if (k + 1 < PF_TUNE_MIN_CHUNKS)
                TH_CHECK(!tu.online && pf_tune_model(&tu)->a == prior.a);
        }
    /* a packed chunk of two short prompts */
    int64_t Ls[2] = {0, 0}, xs[2] = {100, 200};
    double ms = a * (100.0 * 100 + 200.0 * 200) + b * 300 + c_o;
    TH_REQUIRE(pf_tune_observe(&tu, Ls, xs, 2, ms) == 0);
    const pf_cost_model *m = pf_tune_model(&tu);
    TH_CHECK(tu.online);
    TH_CHECK(fabs(m->a - a) < 0.02 * a);
    TH_CHECK(fabs(tu.c_online - c_o) < 0.2 * c_o);
    TH_CHECK(fabs(m->b - b) < 0.05 * b);
    /* the plan is the one the true model gives */
    cp.smooth = 1;
    int64_t got = pf_next_chunk(m, &cp, 4096, 4096);
    int64_t want =
        pf_next_chunk(&(pf_cost_model){.a = a, .b = b, .dynamic = true}, &cp, 4096, 4096);
    TH_CHECK(got == want);
    /* bad observations are refused and change nothing */
    int64_t bad = 0;
    TH_CHECK(pf_tune_observe(&tu, Ls, &bad, 1, 5) == TD_EINVAL);
    TH_CHECK(pf_tune_observe(&tu, Ls, xs, 1, NAN) == TD_EINVAL);
}

/* the online data says a is 20x the profile's: outside the bound, the prior stays */
static void test_online_bound(void)
{
    double len[8], t[8];
    for (int i = 0; i < 8; i++) {
        len[i] = 64 + 64.0 * i;
        t[i] = f_true(len[i], 1e-4, 1, 2);
    }
    pf_cost_model prior;
    TH_REQUIRE(pf_fit_quadratic(len, t, 8, &prior) == 0 && prior.dynamic);
    pf_tune tu;
    pf_tune_init(&tu, &prior, len, t, 8, 0.9);
    for (int64_t L = 0; L < 20 * 256; L += 256) {
        int64_t x = 256;
        TH_REQUIRE(pf_tune_observe(&tu, &L, &x, 1, 2e-3 * x * (2.0 * L + x) + 1 * x + 3) == 0);
    }
    TH_CHECK(!tu.online && tu.n_kept_prior > 0);
    TH_CHECK(pf_tune_model(&tu)->a == prior.a);
    /* no profile points at all (fixed chunks): never online */
    pf_tune t2;
    pf_tune_init(&t2, &(pf_cost_model){0}, NULL, NULL, 0, 0);
    for (int64_t L = 0; L < 20 * 256; L += 256) {
        int64_t x = 256;
        pf_tune_observe(&t2, &L, &x, 1, 1e-4 * x * (2.0 * L + x) + x);
    }
    TH_CHECK(!t2.online && !pf_tune_model(&t2)->dynamic);
}

/* decay forgets: the machine gets 1.5x slower; after ~100 chunks the fit follows */
static void test_online_forgets(void)
{
    double len[8], t[8];
    for (int i = 0; i < 8; i++) {
        len[i] = 64 + 64.0 * i;
        t[i] = f_true(len[i], 5e-4, 1, 2);
    }
    pf_cost_model prior;
    TH_REQUIRE(pf_fit_quadratic(len, t, 8, &prior) == 0);
    pf_tune tu;
    pf_tune_init(&tu, &prior, len, t, 8, 0);
    for (int phase = 0; phase < 2; phase++)
        for (int r = 0; r < 10; r++)
            for (int64_t L = 0; L < 4096; L += 512) {
                int64_t x = 512;
                double k = phase ? 1.5 : 1.0;
                pf_tune_observe(&tu, &L, &x, 1, k * (5e-4 * x * (2.0 * L + x) + x) + 4);
            }
    TH_CHECK(tu.online);
    TH_CHECK(fabs(pf_tune_model(&tu)->a - 7.5e-4) < 0.1 * 7.5e-4);
}

static void test_initial_chunk(void)
{
    pf_cost_model m = {.a = 1e-3, .b = 2, .c = 200, .valid = true, .dynamic = true};
    pf_tune tu;
    pf_tune_init(&tu, &m, NULL, NULL, 0, 0);
    /* n = 6144, pp 2: F = 1e-3 n^2 + 2 n = 50036.7; n_k = sqrt(F / 200) = 15.82;
     * T = 3163.4; C = 2T / (2 + sqrt(4 + 4e-3 T)) = 1040.5 -> 1024 at alignment 64 */
    TH_CHECK(pf_tune_initial_chunk(&tu, 6144, 2, 64, 2048) == 1024);
    /* more stages: more chunks, smaller ones */
    TH_CHECK(pf_tune_initial_chunk(&tu, 6144, 4, 64, 2048) < 1024);
    /* pp 1: the cap */
    TH_CHECK(pf_tune_initial_chunk(&tu, 6144, 1, 64, 2048) == 2048);
    /* a constant <= 0 (an intercept lost in noise), a small one or none is floored at the
     * marginal cost of 64 tokens, 1e-3 64^2 + 2 64 = 132.1 ms: n_k = 19.46, T = 2570.9,
     * C = 889.7 -> 832 */
    double cs[] = {-3, 1e-6, 50, NAN};
    for (int i = 0; i < 4; i++) {
        m.c = cs[i];
        pf_tune_init(&tu, &m, NULL, NULL, 0, 0);
        TH_CHECK(pf_tune_initial_chunk(&tu, 6144, 2, 64, 2048) == 832);
    }
    /* a big constant: a few big chunks, within the cap */
    m.c = 1e6;
    pf_tune_init(&tu, &m, NULL, NULL, 0, 0);
    TH_CHECK(pf_tune_initial_chunk(&tu, 6144, 2, 64, 2048) == 2048);
    /* no valid model: the cap */
    m.valid = false;
    pf_tune_init(&tu, &m, NULL, NULL, 0, 0);
    TH_CHECK(pf_tune_initial_chunk(&tu, 6144, 2, 64, 2048) == 2048);
}

int main(void)
{
    TH_RUN(test_robust_profile);
    TH_RUN(test_online_converges);
    TH_RUN(test_online_bound);
    TH_RUN(test_online_forgets);
    TH_RUN(test_initial_chunk);
    TH_EXIT();
}
