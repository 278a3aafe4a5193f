/* test_model_dp.c: data-parallel attention in the engine (kn_shard.dp_size) on a synthetic
 * mixture-of-experts model.
 *
 * A group of dp members runs on threads (one each) with the in-process collective of
 * kn_test_util.h; each member holds every tensor but its share of the routed experts and runs
 * its own sequence in its own KV pool. Against the unsplit model running each sequence alone:
 *   - each member's prompt (a different length each, one member idle in the first forward)
 *     and greedy decode give the same logits (max abs difference 1e-4: the experts' outputs
 *     are summed per member, then over members) and the same tokens;
 *   - a member's solo decode row gives bit-identical logits whether the other members run
 *     nothing, other decode rows or a long prompt chunk beside it (the solo-first gathered
 *     layout and the member-order sum);
 *   - a member given a bad batch gets its error while the others' forward completes (it takes
 *     its part without rows);
 *   - dp on a model without experts, dp with tp, and a collective without the dp calls are
 *     refused.
 * usage: test_model_dp MOE_MODEL.gguf DENSE_MODEL.gguf [--dp 2,3]
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "../tharness.h"
#include "cpu_backend.h"
#include "kn_test_util.h"
#include "kv_mem.h"
#include "model.h"
#include "td_err.h"

#define MAX_DP   4
#define N_DECODE 5
#define BLOCK    16
#define MAX_TOK  64

static td_gguf *gguf;
static const char *dense_path;
static int n_vocab;
static const float tol = 1e-4f;

/* one member (or the unsplit reference) with its own pool and sequence */
typedef struct {
    kn_model *model;
    kn_cpu *cpu;
    kn_engine *engine;
    kn_kv_mem *mem;
    kn_kv_seq seq;
    kt_rank_coll coll;
} member;

static int member_open(member *x, int r, int dp, kt_coll *cc)
{
    memset(x, 0, sizeof *x);
    kn_shard sh = {.dp_rank = r, .dp_size = dp};
    int rc = kn_model_load(gguf, &sh, &x->model);
    if (!rc) rc = kn_cpu_create(1, &x->cpu);
    x->coll = (kt_rank_coll){.cc = cc, .rank = r};
    kn_collective coll = {.ctx = &x->coll,
                          .allreduce_sum = kt_allreduce_sum,
                          .gather_cols = kt_gather_cols,
                          .dp_counts = kt_dp_counts,
                          .dp_gather = kt_dp_gather,
                          .dp_reduce = kt_dp_reduce};
    if (!rc)
        rc = kn_engine_create(x->model, kn_cpu_backend(x->cpu), dp > 1 ? &coll : NULL,
                              &x->engine);
    kn_kv_pool_params kp;
    if (!rc) kp = kn_model_kv_params(x->model, 32, BLOCK, TD_F32);
    if (!rc) rc = kn_kv_mem_create(&kp, &x->mem);
    kn_kv_seq_init(&x->seq);
    return rc;
}

static void member_close(member *x)
{
    if (x->mem) kn_kv_seq_fini(x->mem, &x->seq);
    kn_kv_mem_destroy(x->mem);
    kn_engine_destroy(x->engine);
    kn_cpu_destroy(x->cpu);
    kn_model_destroy(x->model);
    memset(x, 0, sizeof *x);
}

/* One forward of a member: n tokens of its sequence from position p0 (n 0: idle), the
 * last row's logits into out; solo: the rows are decode rows computed as if alone. */
typedef struct {
    member *x;
    const int32_t *tok;
    int n, p0;
    bool solo, bad;
    float *out;
    int rc;
} fwd_job;

static int member_forward(fwd_job *j)
{
    member *x = j->x;
    if (j->n == 0) return kn_engine_forward_idle(x->engine);
    int32_t pos[MAX_TOK], seq_of[MAX_TOK] = {0}, tok[MAX_TOK];
    for (int i = 0; i < j->n; i++) {
        pos[i] = j->p0 + i;
        tok[i] = j->bad && i == 0 ? n_vocab + 5 : j->tok[i]; /* out of range */
    }
    int rc = kn_kv_seq_reserve(x->mem, &x->seq, j->p0 + j->n);
    if (rc) return rc;
    kn_seq_view view = {.block_table = x->seq.blocks, .n_ctx = j->p0 + j->n};
    int32_t row = j->n - 1;
    kn_batch b = {.n_tokens = j->n,
                  .n_solo = j->solo ? j->n : 0,
                  .tokens = tok,
                  .pos = pos,
                  .seq_of = seq_of,
                  .n_seqs = 1,
                  .seqs = &view,
                  .n_logits = 1,
                  .logit_rows = &row};
    return kn_engine_forward(x->engine, kn_kv_mem_pool(x->mem), &b, j->out);
}

static void *fwd_main(void *v)
{
    fwd_job *j = v;
    j->rc = member_forward(j);
    return NULL;
}

/* Every member's job at once (a group's forward). */
static void group_forward(fwd_job *jobs, int dp)
{
    pthread_t th[MAX_DP];
    for (int r = 0; r < dp; r++)
        pthread_create(&th[r], NULL, fwd_main, &jobs[r]);
    for (int r = 0; r < dp; r++)
        pthread_join(th[r], NULL);
}

static int argmax(const float *l)
{
    int best = 0;
    for (int v = 1; v < n_vocab; v++)
        if (l[v] > l[best]) best = v;
    return best;
}

static float max_abs_diff(const float *a, const float *b)
{
    float m = 0;
    for (int i = 0; i < n_vocab; i++) {
        float d = a[i] > b[i] ? a[i] - b[i] : b[i] - a[i];
        if (!(d <= m)) m = d; /* NaN propagates */
    }
    return m;
}

/* The prompt of member r: its own length and tokens. */
static int prompt_of(int r, int32_t *tok)
{
    int n = 9 + 11 * r;
    for (int i = 0; i < n; i++)
        tok[i] = (int32_t)(((uint32_t)(i + 1) * 2654435761u + (uint32_t)r * 97u) % (uint32_t)n_vocab);
    return n;
}

/* The reference: the unsplit model runs member r's prompt, then greedy decode rows; the
 * logits after the prompt and after each step, and the tokens. */
static void reference(int r, float *logits, int32_t *gen)
{
    member ref;
    TH_REQUIRE(member_open(&ref, 0, 1, NULL) == 0);
    int32_t tok[MAX_TOK];
    int n = prompt_of(r, tok);
    fwd_job j = {.x = &ref, .tok = tok, .n = n, .out = logits};
    TH_REQUIRE(member_forward(&j) == 0);
    for (int t = 0; t < N_DECODE; t++) {
        gen[t] = argmax(logits + (size_t)t * n_vocab);
        j = (fwd_job){.x = &ref,
                      .tok = &gen[t],
                      .n = 1,
                      .p0 = n + t,
                      .solo = true,
                      .out = logits + (size_t)(t + 1) * n_vocab};
        TH_REQUIRE(member_forward(&j) == 0);
    }
    member_close(&ref);
}

static int group_dp; /* the dp test_group runs */

static void test_group(void)
{
    const int dp = group_dp;
    fprintf(stderr, "dp %d\n", dp);
    kt_coll cc = {.tp = dp};
    cc.slots = calloc((size_t)dp, sizeof *cc.slots);
    cc.parts = calloc((size_t)dp, sizeof *cc.parts);
    pthread_barrier_init(&cc.bar, NULL, (unsigned)dp);
    member m[MAX_DP];
    for (int r = 0; r < dp; r++)
        TH_REQUIRE(member_open(&m[r], r, dp, &cc) == 0);
    const size_t V = (size_t)n_vocab;
    float *ref = malloc((size_t)dp * (N_DECODE + 1) * V * sizeof *ref);
    float *got = malloc((size_t)dp * (N_DECODE + 1) * V * sizeof *got);
    int32_t ref_gen[MAX_DP][N_DECODE], tok[MAX_DP][MAX_TOK], n_prompt[MAX_DP];
    for (int r = 0; r < dp; r++) {
        reference(r, ref + (size_t)r * (N_DECODE + 1) * V, ref_gen[r]);
        n_prompt[r] = prompt_of(r, tok[r]);
    }
    fwd_job jobs[MAX_DP];
    /* the prompts: the last member idles in the first forward and prefills in the second,
     * alone with the others idle */
    for (int pass = 0; pass < 2; pass++) {
        for (int r = 0; r < dp; r++) {
            bool now = (r == dp - 1) == (pass == 1);
            jobs[r] = (fwd_job){.x = &m[r],
                                .tok = tok[r],
                                .n = now ? n_prompt[r] : 0,
                                .out = got + (size_t)r * (N_DECODE + 1) * V};
        }
        group_forward(jobs, dp);
        for (int r = 0; r < dp; r++)
            TH_CHECKF(jobs[r].rc == 0, "pass %d member %d: %d", pass, r, jobs[r].rc);
    }
    /* greedy decode rows, every member at once */
    int32_t cur[MAX_DP];
    for (int t = 0; t < N_DECODE; t++) {
        for (int r = 0; r < dp; r++) {
            cur[r] = argmax(got + ((size_t)r * (N_DECODE + 1) + t) * V);
            TH_CHECKF(cur[r] == ref_gen[r][t], "member %d step %d: token %d, unsplit %d", r, t,
                      cur[r], ref_gen[r][t]);
            jobs[r] = (fwd_job){.x = &m[r],
                                .tok = &cur[r],
                                .n = 1,
                                .p0 = n_prompt[r] + t,
                                .solo = true,
                                .out = got + ((size_t)r * (N_DECODE + 1) + t + 1) * V};
        }
        group_forward(jobs, dp);
        for (int r = 0; r < dp; r++)
            TH_CHECK(jobs[r].rc == 0);
    }
    for (int r = 0; r < dp; r++)
        for (int t = 0; t <= N_DECODE; t++) {
            size_t at = ((size_t)r * (N_DECODE + 1) + t) * V;
            float d = max_abs_diff(got + at, ref + at);
            TH_CHECKF(d < tol, "member %d logits %d: max abs diff %g against the unsplit model", r,
                      t, (double)d);
        }

    /* batch invariance across members: member 0's solo row at the next position, computed
     * three times (its KV entry rewritten with the same values): the others idle, the others
     * with decode rows, the others with a prompt chunk */
    float *solo = malloc(3 * V * sizeof *solo), *scratch = malloc((size_t)dp * V * sizeof *scratch);
    int32_t next = argmax(got + (size_t)N_DECODE * V), chunk[MAX_TOK];
    for (int i = 0; i < MAX_TOK; i++)
        chunk[i] = (int32_t)((i * 7919 + 3) % n_vocab);
    for (int way = 0; way < 3; way++) {
        for (int r = 0; r < dp; r++) {
            int p0 = n_prompt[r] + N_DECODE;
            jobs[r] = r == 0 ? (fwd_job){.x = &m[0],
                                         .tok = &next,
                                         .n = 1,
                                         .p0 = p0,
                                         .solo = true,
                                         .out = solo + (size_t)way * V}
                             : (fwd_job){.x = &m[r],
                                         .tok = way == 1 ? &cur[r] : chunk,
                                         .n = way == 0 ? 0 : way == 1 ? 1 : 40,
                                         .p0 = p0,
                                         .solo = way == 1,
                                         .out = scratch + (size_t)r * V};
        }
        group_forward(jobs, dp);
        for (int r = 0; r < dp; r++)
            TH_CHECKF(jobs[r].rc == 0, "way %d member %d: %d", way, r, jobs[r].rc);
    }
    TH_CHECK(memcmp(solo, solo + V, V * sizeof *solo) == 0);
    TH_CHECK(memcmp(solo, solo + 2 * V, V * sizeof *solo) == 0);

    /* a bad batch on the last member: its error, the others' forward completes as before */
    for (int r = 0; r < dp; r++)
        jobs[r] = (fwd_job){.x = &m[r],
                            .tok = r == 0 ? &next : chunk,
                            .n = r == 0 ? 1 : 3,
                            .p0 = n_prompt[r] + N_DECODE,
                            .solo = true,
                            .bad = r == dp - 1,
                            .out = r == 0 ? scratch : scratch + (size_t)r * V};
    group_forward(jobs, dp);
    TH_CHECKF(jobs[0].rc == 0 && jobs[dp - 1].rc == TD_ERANGE, "%d, %d", jobs[0].rc, jobs[dp - 1].rc);
    TH_CHECK(memcmp(scratch, solo, V * sizeof *solo) == 0);

    free(solo);
    free(scratch);
    free(ref);
    free(got);
    for (int r = 0; r < dp; r++)
        member_close(&m[r]);
    free(cc.slots);
    free(cc.parts);
    pthread_barrier_destroy(&cc.bar);
}

/* What a group cannot be: refused at load or at engine creation, with a message. */
static void test_refusals(void)
{
    kn_model *mdl = NULL;
    kn_shard sh = {.dp_rank = 0, .dp_size = 2, .tp_size = 2};
    TH_CHECK(kn_model_load(gguf, &sh, &mdl) == TD_EUNSUPP && !mdl);
    sh = (kn_shard){.dp_rank = 2, .dp_size = 2};
    TH_CHECK(kn_model_load(gguf, &sh, &mdl) == TD_EINVAL && !mdl);
    td_gguf *dense = NULL;
    char err[256];
    TH_REQUIRE(td_gguf_open(dense_path, &dense, err, sizeof err) == 0);
    sh = (kn_shard){.dp_rank = 0, .dp_size = 2};
    TH_CHECK(kn_model_load(dense, &sh, &mdl) == TD_EUNSUPP && !mdl);
    td_gguf_close(dense);
    /* a collective without the group's calls */
    TH_REQUIRE(kn_model_load(gguf, &sh, &mdl) == 0);
    kn_cpu *cpu;
    TH_REQUIRE(kn_cpu_create(1, &cpu) == 0);
    kt_rank_coll rc = {0};
    kn_collective tp_only = {
        .ctx = &rc, .allreduce_sum = kt_allreduce_sum, .gather_cols = kt_gather_cols};
    kn_engine *eng = NULL;
    TH_CHECK(kn_engine_create(mdl, kn_cpu_backend(cpu), &tp_only, &eng) == TD_EINVAL && !eng);
    TH_CHECK(kn_engine_create(mdl, kn_cpu_backend(cpu), NULL, &eng) == TD_EINVAL && !eng);
    kn_cpu_destroy(cpu);
    kn_model_destroy(mdl);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s MOE_MODEL.gguf DENSE_MODEL.gguf [--dp 2,3]\n", argv[0]);
        return 2;
    }
    dense_path = argv[2];
    int dps[MAX_DP] = {2, 3}, n_dps = 2;
    if (argc >= 5 && !strcmp(argv[3], "--dp")) {
        n_dps = 0;
        for (char *p = argv[4]; *p && n_dps < MAX_DP;) {
            int v = (int)strtol(p, &p, 10);
            if (v >= 2 && v <= MAX_DP) dps[n_dps++] = v;
            if (*p == ',') p++;
            else if (*p) break;
        }
    }
    char err[256];
    if (td_gguf_open(argv[1], &gguf, err, sizeof err)) {
        fprintf(stderr, "cannot open %s: %s\n", argv[1], err);
        return 2;
    }
    kn_hparams hp;
    if (kn_hparams_read(gguf, &hp) || !hp.n_expert) {
        fprintf(stderr, "%s: not a mixture-of-experts model\n", argv[1]);
        return 2;
    }
    n_vocab = hp.n_vocab;
    for (int i = 0; i < n_dps; i++)
        if (dps[i] <= hp.n_expert) {
            group_dp = dps[i];
            TH_RUN(test_group);
        }
    TH_RUN(test_refusals);
    td_gguf_close(gguf);
    TH_EXIT();
}
