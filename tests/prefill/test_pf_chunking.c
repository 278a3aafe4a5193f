/* test_pf_chunking.c: stage 0's chunking set-up and the per-request initial chunk
 * (prefill-node/pf_chunking.c) without a model: an explicit chunk_size is used as given;
 * chunk_size left out gives fixed chunks of 512 when nothing can be modelled (dynamic off,
 * or no profile) and, with a cost model, each request's own initial chunk, chosen for its
 * uncached tokens (pf_tune_initial_chunk) within [alignment, chunk_max];
 * TANDEM_PF_ONLINE_REFIT accepts 0 and 1 only.
 */
#include <stdlib.h>
#include <string.h>

#include "../tharness.h"
#include "pf_int.h"
#include "td_err.h"

typedef struct {
    pf_node_params p;
    td_cfg_prefill cfg;
    kn_kv_pool kv;
    pf_stage st;
} fixture;

/* A stage 0 of pp 2 with chunk_size (0: left out); chunk_max as pf_stage_open sets it. */
static void fixture_init(fixture *f, int chunk_size, bool dynamic, int budget_ms)
{
    memset(f, 0, sizeof *f);
    f->p.instance = "t";
    f->cfg.chunk_size = chunk_size;
    f->cfg.dynamic_chunking = dynamic;
    f->cfg.smooth_factor = 0.75;
    f->cfg.profile_budget_ms = budget_ms;
    f->kv.block_size = 16;
    f->st.p = &f->p;
    f->st.cfg = &f->cfg;
    f->st.pp = 2;
    f->st.shard.kv = &f->kv;
    f->st.chunk_max = chunk_size > 0 ? chunk_size : PF_TUNE_AUTO_CAP;
}

static void test_setup_fixed(void)
{
    fixture f;
    pf_tune tu;
    pf_chunk_params cp;
    unsetenv("TANDEM_PF_ONLINE_REFIT");
    /* explicit sizes as given, dynamic or not */
    fixture_init(&f, 300, false, 20000);
    TH_CHECK(pf_chunking_setup(&f.st, &tu, &cp) == 0);
    TH_CHECK(cp.chunk_size == 300 && !cp.dynamic && cp.max_batch_tokens == 300);
    TH_CHECK(pf_chunking_initial(&f.st, &tu, &cp, 1, 0, 6144) == 300);
    fixture_init(&f, 300, true, 0); /* dynamic without a profile */
    TH_CHECK(pf_chunking_setup(&f.st, &tu, &cp) == 0);
    TH_CHECK(cp.chunk_size == 300 && !cp.dynamic);
    /* left out, nothing to model with: fixed chunks of 512 in buffers of 2048 */
    fixture_init(&f, 0, false, 20000);
    TH_CHECK(pf_chunking_setup(&f.st, &tu, &cp) == 0);
    TH_CHECK(cp.chunk_size == PF_TUNE_AUTO_FIXED && !cp.dynamic);
    TH_CHECK(pf_chunking_initial(&f.st, &tu, &cp, 1, 0, 6144) == PF_TUNE_AUTO_FIXED);
    fixture_init(&f, 0, true, 0);
    TH_CHECK(pf_chunking_setup(&f.st, &tu, &cp) == 0);
    TH_CHECK(cp.chunk_size == PF_TUNE_AUTO_FIXED && !cp.dynamic);
}

static void test_refit_env(void)
{
    fixture f;
    pf_tune tu;
    pf_chunk_params cp;
    fixture_init(&f, 0, false, 20000);
    setenv("TANDEM_PF_ONLINE_REFIT", "0", 1);
    TH_CHECK(pf_chunking_setup(&f.st, &tu, &cp) == 0);
    setenv("TANDEM_PF_ONLINE_REFIT", "1", 1);
    TH_CHECK(pf_chunking_setup(&f.st, &tu, &cp) == 0);
    setenv("TANDEM_PF_ONLINE_REFIT", "off", 1);
    TH_CHECK(pf_chunking_setup(&f.st, &tu, &cp) == TD_EINVAL);
    unsetenv("TANDEM_PF_ONLINE_REFIT");
}

static void test_initial_per_request(void)
{
    fixture f;
    pf_tune tu;
    pf_cost_model m = {.a = 1e-3, .b = 2, .c = 200, .valid = true, .dynamic = true};
    pf_tune_init(&tu, &m, NULL, NULL, 0, 0);
    pf_chunk_params cp = {.chunk_size = PF_TUNE_AUTO_CAP,
                          .smooth = 0.75,
                          .page_size = 16,
                          .max_batch_tokens = PF_TUNE_AUTO_CAP,
                          .dynamic = true};
    fixture_init(&f, 0, true, 20000);
    /* 6144 tokens at pp 2: 1024 (test_pf_tune's closed form) */
    TH_CHECK(pf_chunking_initial(&f.st, &tu, &cp, 1, 0, 6144) == 1024);
    /* each request its own: a shorter prompt gets a smaller chunk, a cached prefix counts
     * out, and a longer one stays within the buffers */
    int c_short = pf_chunking_initial(&f.st, &tu, &cp, 2, 0, 1024);
    TH_CHECK(c_short >= 64 && c_short < 1024 && c_short % 64 == 0);
    TH_CHECK(pf_chunking_initial(&f.st, &tu, &cp, 3, 5120, 6144) == c_short);
    TH_CHECK(pf_chunking_initial(&f.st, &tu, &cp, 4, 0, 1 << 20) == PF_TUNE_AUTO_CAP);
    /* more stages: smaller chunks; an explicit chunk_size: as given */
    f.st.pp = 4;
    TH_CHECK(pf_chunking_initial(&f.st, &tu, &cp, 5, 0, 6144) < 1024);
    fixture_init(&f, 512, true, 20000);
    cp.chunk_size = 512;
    TH_CHECK(pf_chunking_initial(&f.st, &tu, &cp, 6, 0, 6144) == 512);
}

int main(void)
{
    TH_RUN(test_setup_fixed);
    TH_RUN(test_refit_env);
    TH_RUN(test_initial_per_request);
    TH_EXIT();
}
