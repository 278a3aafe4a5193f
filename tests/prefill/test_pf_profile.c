/* test_pf_profile.c: the stage profile and the cost-model fit on the real engine, on a
 * synthetic model (prefill-node/pf_profile.h): every kind of stage (first: token ids in;
 * middle and last: hidden states in) profiles within a small time budget, the fit is
 * finite, and the plan built from it covers a prompt exactly with chunks that follow the
 * rules (first chunk C; dynamic chunks aligned to 64 and at most C; caps), and runs
 * through the stage. Bad shards and profiles are rejected with an error.
 * usage: test_pf_profile MODEL.gguf
 */
#include <math.h>
#include <string.h>

#include "../tharness.h"
#include "pf_chunk.h"
#include "pf_profile.h"
#include "td_err.h"

#define CHUNK  128
#define PROMPT 1000
#define BUDGET 300 /* ms */

static const char *model_path;

static void check_plan(const pf_cost_model *m, const pf_chunk_params *p, const int32_t *c,
                       int64_t n, int64_t total)
{
    int64_t sum = 0;
    for (int64_t i = 0; i < n; i++) {
        sum += c[i];
        TH_CHECK(c[i] > 0 && c[i] <= p->chunk_size);
        bool last = i == n - 1;
        if (i == 0)
            TH_CHECK(c[i] == (total < p->chunk_size ? total : p->chunk_size));
        else if (!last && (!m->dynamic || p->smooth == 0))
            TH_CHECK(c[i] == p->chunk_size);
        else if (!last)
            TH_CHECKF(c[i] % 64 == 0 && c[i] >= 64, "chunk %lld: %d", (long long)i, c[i]);
    }
    TH_CHECK(sum == total);
}

static void profile_stage(int pp, int stage)
{
    pf_shard shard;
    pf_shard_params rp = {.model_path = model_path, .pp = pp, .stage = stage, .ctx = 1024};
    TH_REQUIRE(pf_shard_open(&shard, &rp) == 0);
    TH_CHECK(shard.rt.model->first == (stage == 0) && shard.rt.model->last == (stage == pp - 1));
    pf_profile_params pp_ = {.chunk_size = CHUNK, .n_lengths = 8, .reps = 2, .budget_ms = BUDGET};
    pf_profile_result pr;
    int rc = pf_profile_stage(&shard, &pp_, &pr);
    TH_CHECK(rc == 0);
    if (rc) {
        pf_shard_close(&shard);
        return;
    }
    fprintf(stderr,
            "  pp %d stage %d layers [%d, %d): %d lengths [%d, %d], %.0f ms%s, a %.3e b %.3e "
            "c %.3f R^2 %.3f%s\n",
            pp, stage, shard.l0, shard.l1, pr.n_lengths, pr.len[0], pr.len[pr.n_lengths - 1],
            pr.elapsed_ms, pr.budget_hit ? " (budget)" : "", pr.fit.a, pr.fit.b, pr.fit.c,
            pr.fit.r2, pr.fit.dynamic ? "" : " (fixed fallback)");
    TH_CHECK(pr.n_lengths >= 3 && pr.n_lengths <= 8);
    TH_CHECK(pr.len[pr.n_lengths - 1] <= CHUNK + CHUNK / 4);
    for (int i = 0; i < pr.n_lengths; i++) {
        TH_CHECK(pr.ms[i] > 0 && isfinite(pr.ms[i]) && pr.n_runs[i] >= 1);
        if (i) TH_CHECK(pr.len[i] > pr.len[i - 1]);
    }
    /* bounded: the budget plus a few forwards of <= 160 tokens on a 6-layer model */
    TH_CHECKF(pr.elapsed_ms < BUDGET + 20000, "%.0f ms", pr.elapsed_ms);
    TH_CHECK(pr.fit.valid); /* 3+ distinct lengths always give a solvable system */
    TH_CHECK(isfinite(pr.fit.a) && isfinite(pr.fit.b) && isfinite(pr.fit.c));
    TH_CHECK(isfinite(pr.fit.r2) && pr.fit.r2 <= 1 + 1e-9 && pr.fit.b >= 0);
    /* the robust fit may drop outlying lengths (a busy moment), at most a quarter of them */
    TH_CHECKF(pr.fit.n_samples <= pr.n_lengths &&
                  pr.fit.n_samples >= pr.n_lengths - pr.n_lengths / 4,
              "%d of %d lengths fitted", pr.fit.n_samples, pr.n_lengths);

    pf_chunk_params cp = {.chunk_size = CHUNK, .smooth = 0.75, .page_size = 16, .dynamic = true};
    int64_t cap = pf_plan_max_chunks(&cp, PROMPT);
    int32_t c[64];
    int64_t n;
    TH_REQUIRE(cap <= 64);
    TH_CHECK(pf_plan_chunks(&pr.fit, &cp, PROMPT, c, cap, &n) == 0);
    check_plan(&pr.fit, &cp, c, n, PROMPT);
    double ms[64];
    TH_CHECK(pf_profile_run_plan(&shard, c, n, 1, ms) == 0);
    for (int64_t i = 0; i < n; i++)
        TH_CHECK(ms[i] > 0 && isfinite(ms[i]));
    cp.smooth = 0;
    TH_CHECK(pf_plan_chunks(&pr.fit, &cp, PROMPT, c, cap, &n) == 0);
    check_plan(&pr.fit, &cp, c, n, PROMPT);
    TH_CHECK(n == (PROMPT + CHUNK - 1) / CHUNK);
    TH_CHECK(pf_profile_run_plan(&shard, c, n, 2, ms) == 0);

    /* a plan longer than the pool, a profile longer than the pool, bad parameters */
    int32_t big[2] = {1000, 1000};
    TH_CHECK(pf_profile_run_plan(&shard, big, 2, 0, ms) == TD_ERANGE);
    int32_t zero[1] = {0};
    TH_CHECK(pf_profile_run_plan(&shard, zero, 1, 0, ms) == TD_EINVAL);
    pf_profile_params too_long = {.chunk_size = 1000};
    TH_CHECK(pf_profile_stage(&shard, &too_long, &pr) == TD_ERANGE);
    pf_profile_params bad = {.chunk_size = 0};
    TH_CHECK(pf_profile_stage(&shard, &bad, &pr) == TD_EINVAL);
    pf_shard_close(&shard);
}

static void test_profile_single_stage(void)
{
    profile_stage(1, 0);
}

static void test_profile_first_and_last(void)
{
    profile_stage(2, 0);
    profile_stage(2, 1);
}

static void test_profile_middle(void)
{
    profile_stage(3, 1);
}

static void test_shard_errors(void)
{
    pf_shard shard;
    memset(&shard, 0x5a, sizeof shard);
    pf_shard_params rp = {.model_path = model_path, .pp = 2, .stage = 2};
    TH_CHECK(pf_shard_open(&shard, &rp) == TD_EINVAL);
    TH_CHECK(shard.rt.model == NULL && shard.rt.gguf == NULL); /* zeroed on failure */
    int bad_part[2] = {1, 1};                                  /* the model has more layers */
    rp = (pf_shard_params){.model_path = model_path, .pp = 2, .partition = bad_part};
    TH_CHECK(pf_shard_open(&shard, &rp) == TD_EINVAL);
    rp = (pf_shard_params){.model_path = model_path, .pp = 100};
    TH_CHECK(pf_shard_open(&shard, &rp) == TD_EINVAL);
    rp = (pf_shard_params){.model_path = "/nonexistent/model.gguf"};
    TH_CHECK(pf_shard_open(&shard, &rp) < 0);
    pf_shard_close(&shard); /* zeroed: fine */
    /* an explicit partition that fits: stage 1 of {2, 4} is layers [2, 6) */
    int part[2] = {2, 4};
    rp = (pf_shard_params){
        .model_path = model_path, .pp = 2, .stage = 1, .partition = part, .ctx = 256};
    TH_REQUIRE(pf_shard_open(&shard, &rp) == 0);
    TH_CHECK(shard.l0 == 2 && shard.l1 == 6);
    pf_shard_close(&shard);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: test_pf_profile MODEL.gguf\n");
        return 2;
    }
    model_path = argv[1];
    TH_RUN(test_profile_single_stage);
    TH_RUN(test_profile_first_and_last);
    TH_RUN(test_profile_middle);
    TH_RUN(test_shard_errors);
    TH_EXIT();
}
