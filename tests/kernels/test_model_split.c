/* test_model_split.c: exactness of the engine's splits on a synthetic model.
 *
 * The unsplit model (one shard, all layers) is the reference. Against it:
 *   - PP into 2 and 3 stages (hidden states handed from stage to stage),
 *   - TP 2 and 4 (ranks run concurrently on threads, summing partials through a
 *     barrier-based allreduce and gathering the vocab-parallel LM head's logit slices on
 *     rank 0, as the decode node's shared-memory collective does; the other ranks' output
 *     buffer must stay untouched, or be NULL),
 *   - PP 2 x TP 2,
 *   - prefill in chunks of 1, 7, 64 and all at once, then greedy decode from that KV,
 *   - two sequences in one batch vs each alone (no cross-sequence attention),
 *   - a solo decode row's logits bit for bit alone and beside a long prompt chunk,
 *   - two-batch overlap at tp 2 (and ep): every forward of 2 tokens or more as two
 *     micro-batches, a prompt chunk cut through its sequence, a solo decode row bit for bit
 *     what it is unsplit,
 * must all give the same logits (max abs difference < 1e-4), and bad batches must be
 * rejected with an error. A model whose FFN width tp does not split into whole 32-weight
 * blocks (--n-ff 544) checks the uneven split (ranks differ by one block). A model whose
 * row-parallel tensors are 256-weight K blocks (--types kquant) checks the re-quantization
 * of cut slices: its reference is the unsplit model with those tensors re-quantized to
 * Q8_0 too (kn_shard.requant_all), and the change from the original is reported.
 * usage: test_model_split MODEL.gguf
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

#define PROMPT_LEN 45
#define N_DECODE   6
#define BLOCK      16

static const char *model_path;
static td_gguf *gguf;
static int n_vocab, n_embd, n_layer, n_ff, n_head;
static bool requant_ref; /* row-parallel tensors have blocks wider than 32: compare requantized */
static bool gguf_moe;    /* the model has mixture-of-experts layers */
static bool grids_ep;    /* grid_open's shards divide the experts among the ranks (kn_shard.ep) */
static int64_t grids_tbo;   /* grid_open's engines' two-batch overlap (kn_engine_set_tbo) */
static uint64_t tbo_splits; /* forwards rank 0 ran split, summed by grid_close */
/* --tp: the TP sizes test_tp_splits runs (test_pp_x_tp takes the first and the last) */
static int tp_sizes[8] = {2, 4}, n_tp_sizes = 2;
/* the largest logit difference a split may show: float reassociation only (the real
 * Qwen2.5 0.5B file at tp 7 stays near 1e-5) */
static const float split_tol = 1e-4f;

/* ---- a "stage x rank" grid of shards running one sequence ---- */

typedef struct {
    kn_model *model;
    kn_cpu *cpu;
    kn_engine *engine;
    kn_kv_mem *mem;
    kn_kv_pool *kv; /* mem's pool */
    kn_kv_seq seqs[2];
    kt_rank_coll coll;
} shard_rt;

typedef struct {
    int pp, tp;
    shard_rt *rt; /* (pp * tp) stage-major */
    kt_coll *ars; /* (pp) one collective per stage */
    td_dtype kv_type;
    int64_t n_solo; /* the next batches' leading solo rows (model.h), 0 by default */
} grid;

static int grid_open(grid *g, int pp, int tp, td_dtype kv_type)
{
    memset(g, 0, sizeof *g);
    g->pp = pp;
    g->tp = tp;
    g->kv_type = kv_type;
    g->rt = calloc((size_t)(pp * tp), sizeof *g->rt);
    g->ars = calloc((size_t)pp, sizeof *g->ars);
    for (int s = 0; s < pp; s++) {
        g->ars[s].tp = tp;
        g->ars[s].slots = calloc((size_t)tp, sizeof(float *));
        g->ars[s].parts = calloc((size_t)tp, sizeof(float *));
        pthread_barrier_init(&g->ars[s].bar, NULL, (unsigned)tp);
        /* later stages get the extra layers, as the prefill node does */
        int l0 = n_layer * s / pp, l1 = n_layer * (s + 1) / pp;
        for (int r = 0; r < tp; r++) {
            shard_rt *x = &g->rt[s * tp + r];
            kn_shard sh = {.l0 = l0,
                           .l1 = l1,
                           .tp_rank = r,
                           .tp_size = tp,
                           .requant_all = requant_ref,
                           .ep = grids_ep};
            int rc = kn_model_load(gguf, &sh, &x->model);
            if (rc) return rc;
            if ((rc = kn_cpu_create(1 + (r % 2), &x->cpu))) return rc; /* mixed thread counts */
            x->coll = (kt_rank_coll){.cc = &g->ars[s], .rank = r};
            kn_collective coll = {.ctx = &x->coll,
                                  .allreduce_sum = kt_allreduce_sum,
                                  .gather_cols = kt_gather_cols,
                                  .allreduce_post = kt_allreduce_post,
                                  .allreduce_wait = kt_allreduce_wait};
            if ((rc = kn_engine_create(x->model, kn_cpu_backend(x->cpu), &coll, &x->engine)))
                return rc;
            if (grids_tbo && (rc = kn_engine_set_tbo(x->engine, grids_tbo))) return rc;
            kn_kv_pool_params kp = kn_model_kv_params(x->model, 64, BLOCK, kv_type);
            if ((rc = kn_kv_mem_create(&kp, &x->mem))) return rc;
            x->kv = kn_kv_mem_pool(x->mem);
            kn_kv_seq_init(&x->seqs[0]);
            kn_kv_seq_init(&x->seqs[1]);
        }
    }
    return 0;
}

static void grid_close(grid *g)
{
    for (int i = 0; i < g->pp * g->tp && g->rt; i++) {
        shard_rt *x = &g->rt[i];
        if (x->mem) {
            kn_kv_seq_fini(x->mem, &x->seqs[0]);
            kn_kv_seq_fini(x->mem, &x->seqs[1]);
        }
        kn_kv_mem_destroy(x->mem);
        if (i == 0 && x->engine) tbo_splits += kn_engine_tbo_count(x->engine);
        kn_engine_destroy(x->engine);
        kn_cpu_destroy(x->cpu);
        kn_model_destroy(x->model);
    }
    for (int s = 0; s < g->pp && g->ars; s++) {
        free(g->ars[s].slots);
        free(g->ars[s].parts);
        pthread_barrier_destroy(&g->ars[s].bar);
    }
    free(g->rt);
    free(g->ars);
    memset(g, 0, sizeof *g);
}

typedef struct {
    shard_rt *x;
    kn_batch b;
    float *out;
    int rc;
} rank_job;

static void *rank_main(void *v)
{
    rank_job *j = v;
    j->rc = kn_engine_forward(j->x->engine, j->x->kv, &j->b, j->out);
    return NULL;
}

#define SENTINEL 0x7fc0beefu /* a NaN no kernel writes */

static float *sentinels(int n_rows)
{
    size_t cnt = (size_t)n_rows * (size_t)n_vocab;
    uint32_t *p = malloc(cnt * sizeof *p);
    for (size_t i = 0; i < cnt; i++)
        p[i] = SENTINEL;
    return (float *)p;
}

static bool untouched(const float *buf, int n_rows)
{
    const uint32_t *p = (const uint32_t *)buf;
    for (size_t i = 0; i < (size_t)n_rows * (size_t)n_vocab; i++)
        if (p[i] != SENTINEL) return false;
    return true;
}

/* Runs tokens (of up to two sequences, given by seq_of) through every stage; logits of
 * the rows asked for land in logits (n_rows, n_vocab). ctx_after[s]: positions of
 * sequence s after this batch. */
static int grid_forward(grid *g, const int32_t *tokens, const int32_t *pos, const int32_t *seq_of,
                        int64_t n, int n_seqs, const int32_t *ctx_after, const int32_t *rows,
                        int n_rows, float *logits)
{
    float *h_in = NULL, *h_out = malloc((size_t)(n * n_embd) * sizeof(float));
    int rc = 0;
    for (int s = 0; s < g->pp && !rc; s++) {
        bool last = s == g->pp - 1;
        rank_job jobs[8];
        pthread_t th[8];
        kn_seq_view views[8][2];
        for (int r = 0; r < g->tp && !rc; r++) {
            shard_rt *x = &g->rt[s * g->tp + r];
            for (int q = 0; q < n_seqs && !rc; q++) {
                rc = kn_kv_seq_reserve(x->mem, &x->seqs[q], ctx_after[q]);
                views[r][q] =
                    (kn_seq_view){.block_table = x->seqs[q].blocks, .n_ctx = ctx_after[q]};
            }
            /* ranks other than 0 write their hidden states to a private buffer; the last
             * stage's logits are rank 0's only: rank 1 passes NULL, the others a buffer of
             * sentinels that must stay untouched */
            float *out = r == 0 ? (last ? logits : h_out)
                         : last ? (r == 1 ? NULL : sentinels(n_rows))
                                : malloc((size_t)(n * n_embd) * 4);
            jobs[r] = (rank_job){
                .x = x,
                .b = {.n_tokens = n,
                      .tokens = s == 0 ? tokens : NULL,
                      .embd = h_in,
                      .pos = pos,
                      .seq_of = seq_of,
                      .n_solo = g->n_solo,
                      .n_seqs = n_seqs,
                      .seqs = views[r],
                      .n_logits = last ? n_rows : 0,
                      .logit_rows = rows},
                .out = out,
            };
        }
        for (int r = 0; r < g->tp && !rc; r++)
            pthread_create(&th[r], NULL, rank_main, &jobs[r]);
        for (int r = 0; r < g->tp && !rc; r++)
            pthread_join(th[r], NULL);
        for (int r = 0; r < g->tp && !rc; r++) {
            if (jobs[r].rc) rc = jobs[r].rc;
            if (r > 0 && !last) /* TP ranks must agree exactly after the allreduces */
                TH_CHECK(memcmp(h_out, jobs[r].out, (size_t)(n * n_embd) * sizeof(float)) == 0);
            if (r > 0 && last && jobs[r].out) TH_CHECK(untouched(jobs[r].out, n_rows));
            if (r > 0) free(jobs[r].out);
        }
        if (!last) {
            free(h_in);
            h_in = h_out;
            h_out = malloc((size_t)(n * n_embd) * sizeof(float));
        }
    }
    free(h_in);
    free(h_out);
    return rc;
}

/* Prefill the prompt for sequence 0 in chunks, then N_DECODE greedy steps; records the
 * logits after the prompt and after each step, and the tokens chosen. */
static int run_sequence(grid *g, const int32_t *prompt, int n_prompt, int chunk, float *logits,
                        int32_t *gen)
{
    int32_t pos[PROMPT_LEN], seq_of[PROMPT_LEN] = {0};
    int rc = 0;
    for (int done = 0; done < n_prompt && !rc;) {
        int len = n_prompt - done < chunk ? n_prompt - done : chunk;
        for (int i = 0; i < len; i++)
            pos[i] = done + i;
        int32_t ctx = done + len, row = len - 1;
        rc = grid_forward(g, prompt + done, pos, seq_of, len, 1, &ctx, &row, 1, logits);
        done += len;
    }
    for (int t = 0; t < N_DECODE && !rc; t++) {
        const float *l = logits + (size_t)t * n_vocab;
        int32_t best = 0;
        for (int v = 1; v < n_vocab; v++)
            if (l[v] > l[best]) best = v;
        gen[t] = best;
        int32_t p = n_prompt + t, ctx = p + 1, row = 0;
        rc = grid_forward(g, &best, &p, seq_of, 1, 1, &ctx, &row, 1,
                          logits + (size_t)(t + 1) * n_vocab);
    }
    return rc;
}

static float max_abs_diff(const float *a, const float *b, size_t n)
{
    float m = 0;
    for (size_t i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]);
        if (!(d <= m)) m = d; /* catches nan */
    }
    return m;
}

static int32_t prompt[PROMPT_LEN];
static float *ref_logits; /* (N_DECODE + 1, n_vocab) */
static int32_t ref_gen[N_DECODE];

static void compare_config(int pp, int tp, int chunk, td_dtype kv_type, float tol)
{
    grid g;
    int rc = grid_open(&g, pp, tp, kv_type);
    TH_CHECKF(rc == 0, "pp %d tp %d: open failed: %s", pp, tp, td_strerror(rc));
    if (rc) {
        grid_close(&g);
        return;
    }
    float *logits = calloc((size_t)(N_DECODE + 1) * n_vocab, sizeof(float));
    int32_t gen[N_DECODE];
    rc = run_sequence(&g, prompt, PROMPT_LEN, chunk, logits, gen);
    TH_CHECKF(rc == 0, "pp %d tp %d chunk %d: forward failed: %s", pp, tp, chunk, td_strerror(rc));
    if (!rc) {
        float d = max_abs_diff(ref_logits, logits, (size_t)(N_DECODE + 1) * n_vocab);
        fprintf(stderr, "  pp %d tp %d%s chunk %2d kv %s: max |dlogit| %.3g\n", pp, tp,
                grids_ep ? " ep" : "", chunk, td_dtype_name(kv_type), d);
        TH_CHECKF(d < tol, "pp %d tp %d chunk %d: logits differ by %g", pp, tp, chunk, d);
        if (kv_type == TD_F32) TH_CHECK(memcmp(gen, ref_gen, sizeof gen) == 0);
    }
    free(logits);
    grid_close(&g);
}

static void test_reference_is_sane(void)
{
    /* the synthetic model must not be degenerate, or every comparison passes trivially */
    float mn = ref_logits[0], mx = ref_logits[0];
    for (int v = 0; v < n_vocab; v++) {
        mn = fminf(mn, ref_logits[v]);
        mx = fmaxf(mx, ref_logits[v]);
    }
    TH_CHECKF(mx - mn > 0.1f, "logit spread %g", mx - mn);
    fprintf(stderr, "  reference spread %.3g, generated %d %d %d ...\n", mx - mn, ref_gen[0],
            ref_gen[1], ref_gen[2]);
}

static void test_pp_splits(void)
{
    compare_config(2, 1, PROMPT_LEN, TD_F32, split_tol);
    compare_config(3, 1, PROMPT_LEN, TD_F32, split_tol);
}

/* tp sizes beyond the KV-head count, or not dividing it, replicate KV heads (td_tp.h) */
static void test_tp_splits(void)
{
    for (int i = 0; i < n_tp_sizes; i++)
        compare_config(1, tp_sizes[i], PROMPT_LEN, TD_F32, split_tol);
}

/* Expert parallelism (ep = tp): each rank holds whole experts, its share of them, and the
 * ranks' shares tile the experts; the logits match the unsplit model's. A model without
 * experts refuses ep. */
static void test_ep_splits(void)
{
    if (!gguf_moe) {
        kn_model *m = NULL;
        kn_shard sh = {.tp_rank = 0, .tp_size = 2, .ep = true};
        TH_CHECK(kn_model_load(gguf, &sh, &m) == TD_EUNSUPP && !m);
        return;
    }
    for (int i = 0; i < n_tp_sizes; i++) {
        const int tp = tp_sizes[i];
        int next = 0;
        for (int r = 0; r < tp; r++) {
            kn_model *m = NULL;
            kn_shard sh = {.tp_rank = r, .tp_size = tp, .ep = true};
            TH_REQUIRE(kn_model_load(gguf, &sh, &m) == 0);
            const int l = m->hp.n_layer - 1; /* a MoE layer (dense ones lead) */
            TH_CHECK(m->x0 == next && m->n_x_local > 0 && m->n_ffe_local == m->hp.n_ff_exp);
            for (int x = 0; x < m->hp.n_expert; x++) {
                const bool mine = x >= m->x0 && x < m->x0 + m->n_x_local;
                TH_CHECK(!m->layers[l].exp_down[x].data == !mine);
                TH_CHECK(!mine || m->layers[l].exp_down[x].n_cols == m->hp.n_ff_exp);
            }
            next = m->x0 + m->n_x_local;
            kn_model_destroy(m);
        }
        TH_CHECK(next > 0);
    }
    grids_ep = true;
    for (int i = 0; i < n_tp_sizes; i++)
        compare_config(1, tp_sizes[i], PROMPT_LEN, TD_F32, split_tol);
    compare_config(2, tp_sizes[0], 7, TD_F32, split_tol);
    grids_ep = false;
}

static void test_pp_x_tp(void)
{
    compare_config(2, tp_sizes[0], PROMPT_LEN, TD_F32, split_tol);
    compare_config(3, tp_sizes[n_tp_sizes - 1], 7, TD_F32, split_tol);
}

static void test_chunking(void)
{
    compare_config(1, 1, 1, TD_F32, split_tol);
    compare_config(1, 1, 7, TD_F32, split_tol);
    compare_config(1, 1, 64, TD_F32, split_tol);
}

static void test_two_sequences_in_one_batch(void)
{
    /* sequence 1 is a different prompt; batched together with sequence 0 the logits of
     * sequence 0 must equal the reference */
    grid g;
    TH_REQUIRE(grid_open(&g, 1, 1, TD_F32) == 0);
    int32_t tok[2 * PROMPT_LEN], pos[2 * PROMPT_LEN], seq_of[2 * PROMPT_LEN];
    int n = 0;
    for (int i = 0; i < PROMPT_LEN; i++) {
        /* interleave the two sequences' tokens */
        tok[n] = prompt[i], pos[n] = i, seq_of[n++] = 0;
        tok[n] = (prompt[PROMPT_LEN - 1 - i] * 7 + 3) % n_vocab, pos[n] = i, seq_of[n++] = 1;
    }
    int32_t ctx[2] = {PROMPT_LEN, PROMPT_LEN}, rows[2] = {n - 2, n - 1};
    float *logits = malloc((size_t)2 * n_vocab * sizeof(float));
    int rc = grid_forward(&g, tok, pos, seq_of, n, 2, ctx, rows, 2, logits);
    TH_CHECKF(rc == 0, "%s", td_strerror(rc));
    float d = max_abs_diff(ref_logits, logits, (size_t)n_vocab);
    fprintf(stderr, "  two sequences: max |dlogit| of seq 0 %.3g\n", d);
    TH_CHECK(d < split_tol);
    TH_CHECK(max_abs_diff(ref_logits, logits + n_vocab, (size_t)n_vocab) > 1e-3f);
    free(logits);
    grid_close(&g);
}

/* Both prompts, sequence 0's and a second one, in one batch; their last rows' logits into
 * logits (2 rows). */
static int both_prompts(grid *g, float *logits)
{
    int32_t tok[2 * PROMPT_LEN], pos[2 * PROMPT_LEN], seq[2 * PROMPT_LEN];
    for (int i = 0; i < PROMPT_LEN; i++) {
        tok[i] = prompt[i], pos[i] = i, seq[i] = 0;
        tok[PROMPT_LEN + i] = (prompt[i] * 5 + 1) % n_vocab, pos[PROMPT_LEN + i] = i;
        seq[PROMPT_LEN + i] = 1;
    }
    int32_t ctx[2] = {PROMPT_LEN, PROMPT_LEN}, last[2] = {PROMPT_LEN - 1, 2 * PROMPT_LEN - 1};
    return grid_forward(g, tok, pos, seq, 2 * PROMPT_LEN, 2, ctx, last, 2, logits);
}

/* After both_prompts: sequence 0's next token (ref_gen[0]) as the batch's solo row, then
 * `chunk` prompt rows of sequence 1 (0: the row alone); the logits of the solo row and of the
 * chunk's last row into logits (1 or 2 rows). The solo row rewrites its own KV each time. */
static int solo_beside_chunk(grid *g, int chunk, float *logits)
{
    int32_t *tok = malloc((size_t)(1 + chunk) * 3 * sizeof *tok), *pos = tok + 1 + chunk;
    int32_t *seq = pos + 1 + chunk;
    if (!tok) return TD_ENOMEM;
    tok[0] = ref_gen[0], pos[0] = PROMPT_LEN, seq[0] = 0;
    for (int i = 0; i < chunk; i++) {
        tok[1 + i] = (int32_t)((i * 3 + 7) % n_vocab);
        pos[1 + i] = PROMPT_LEN + i;
        seq[1 + i] = 1;
    }
    int32_t ctx[2] = {PROMPT_LEN + 1, PROMPT_LEN + chunk}, rows[2] = {0, chunk};
    g->n_solo = 1;
    int rc =
        grid_forward(g, tok, pos, seq, 1 + chunk, chunk ? 2 : 1, ctx, rows, chunk ? 2 : 1, logits);
    free(tok);
    return rc;
}

/* A decode row computed as a solo row (model.h) has the same logits, bit for bit, alone and
 * batched with another sequence's prompt rows; with experts, those rows share the decode
 * row's experts (the gathered groups keep it first and alone). The chunk is long enough
 * that the batch rows take the gemm path (64 rows and more, per expert too), whose bits
 * depend on the batch: a solo row computed with them would differ. */
static void test_solo_row_invariant(void)
{
    grid g;
    TH_REQUIRE(grid_open(&g, 1, 1, TD_F32) == 0);
    float *logits = malloc((size_t)3 * n_vocab * sizeof(float)); /* alone, then 2 rows */
    TH_REQUIRE(both_prompts(&g, logits) == 0);
    TH_REQUIRE(solo_beside_chunk(&g, 0, logits) == 0);
    /* each expert gets more than the 64 rows of the gemm path */
    TH_REQUIRE(solo_beside_chunk(&g, 320, logits + n_vocab) == 0);
    TH_CHECK(memcmp(logits, logits + n_vocab, (size_t)n_vocab * sizeof(float)) == 0);
    TH_CHECK(max_abs_diff(logits, ref_logits + n_vocab, (size_t)n_vocab) < split_tol);
    free(logits);
    grid_close(&g);
}

/* Two-batch overlap (kernels/forward_tbo.c) at every tp size, experts split and (a MoE
 * model) ep: the prompt as one chunk, cut through its sequence, and the decode steps give the
 * reference's logits and tokens; at the first tp size, a solo decode row beside another
 * sequence's chunk is bit for bit what it is unsplit; tp 1 and a collective without the
 * split allreduce are refused. */
static void test_tbo(void)
{
    const int tp = tp_sizes[0];
    grids_tbo = 2;
    for (int i = 0; i < n_tp_sizes; i++) /* every tp size; experts split and (MoE) whole */
        for (int ep = 0; ep <= (gguf_moe ? 1 : 0); ep++) {
            grids_ep = ep;
            tbo_splits = 0;
            compare_config(1, tp_sizes[i], PROMPT_LEN, TD_F32, split_tol);
            TH_CHECK(tbo_splits == 1); /* the prompt; decode steps are one token */
        }
    grids_ep = false;
    /* the solo row: unsplit (grids_tbo 0) and split grids run the same batches, the prompts
     * whole, then the decode row with a chunk, which the split grid cuts (at row 80) */
    float *logits[2];
    for (int t = 0; t < 2; t++) {
        grids_tbo = t ? 2 : 0;
        tbo_splits = 0;
        grid g;
        TH_REQUIRE(grid_open(&g, 1, tp, TD_F32) == 0);
        logits[t] = malloc((size_t)2 * n_vocab * sizeof(float));
        /* the prompts whole in both (their KV's bits depend on the batch they ran in) */
        for (int r = 0; r < tp && t; r++)
            TH_CHECK(kn_engine_set_tbo(g.rt[r].engine, 1000) == 0);
        TH_REQUIRE(both_prompts(&g, logits[t]) == 0);
        for (int r = 0; r < tp && t; r++)
            TH_CHECK(kn_engine_set_tbo(g.rt[r].engine, 2) == 0);
        TH_REQUIRE(solo_beside_chunk(&g, 160, logits[t]) == 0);
        grid_close(&g);
        TH_CHECKF(tbo_splits == (t ? 1u : 0u), "splits %llu", (unsigned long long)tbo_splits);
    }
    TH_CHECK(memcmp(logits[0], logits[1], (size_t)n_vocab * sizeof(float)) == 0);
    float d = max_abs_diff(logits[0] + n_vocab, logits[1] + n_vocab, (size_t)n_vocab);
    fprintf(stderr, "  tbo: chunk row max |dlogit| %.3g\n", d);
    TH_CHECK(d < split_tol);
    TH_CHECK(max_abs_diff(logits[0], ref_logits + n_vocab, (size_t)n_vocab) < split_tol);
    free(logits[0]);
    free(logits[1]);
    grids_tbo = 0;
    /* refused: tp 1; a collective without the split allreduce */
    kn_model *m = NULL;
    kn_cpu *cpu = NULL;
    kn_engine *e = NULL;
    kn_shard sh = {.tp_rank = 0, .tp_size = 1};
    TH_REQUIRE(kn_model_load(gguf, &sh, &m) == 0 && kn_cpu_create(1, &cpu) == 0);
    TH_REQUIRE(kn_engine_create(m, kn_cpu_backend(cpu), NULL, &e) == 0);
    TH_CHECK(kn_engine_set_tbo(e, 2) == TD_EUNSUPP);
    TH_CHECK(kn_engine_set_tbo(e, 0) == 0);
    kn_engine_destroy(e);
    kn_model_destroy(m);
    sh = (kn_shard){.tp_rank = 0, .tp_size = 2};
    kt_coll cc = {.tp = 2};
    kt_rank_coll rc = {.cc = &cc};
    kn_collective plain = {
        .ctx = &rc, .allreduce_sum = kt_allreduce_sum, .gather_cols = kt_gather_cols};
    TH_REQUIRE(kn_model_load(gguf, &sh, &m) == 0);
    TH_REQUIRE(kn_engine_create(m, kn_cpu_backend(cpu), &plain, &e) == 0);
    TH_CHECK(kn_engine_set_tbo(e, 2) == TD_EUNSUPP);
    kn_engine_destroy(e);
    kn_model_destroy(m);
    kn_cpu_destroy(cpu);
}

static void test_f16_kv_close(void)
{
    /* f16 KV rounds K and V (relative 5e-4): close to f32, not equal; the logits move in
     * proportion to their size (a real model's reach 20-30) */
    float mx = 0;
    for (int v = 0; v < n_vocab; v++)
        mx = fmaxf(mx, fabsf(ref_logits[v]));
    /* a mixture-of-experts router is not continuous: where two experts' scores nearly tie,
     * the rounding can flip the choice and move the logits by that expert's share (seen:
     * 0.055 on split-qwen3moe, 2.7x the dense bound), so its bound is 4x the dense one */
    const float moe = gguf_moe ? 4.0f : 1.0f;
    compare_config(1, 1, 16, TD_F16, moe * fmaxf(2e-2f, 4e-3f * mx));
}

static void test_bad_batches(void)
{
    grid g;
    TH_REQUIRE(grid_open(&g, 1, 1, TD_F32) == 0);
    shard_rt *x = &g.rt[0];
    TH_REQUIRE(kn_kv_seq_reserve(x->mem, &x->seqs[0], 4) == 0);
    kn_seq_view view = {.block_table = x->seqs[0].blocks, .n_ctx = 4};
    int32_t tok[2] = {1, 2}, pos[2] = {0, 1}, seq_of[2] = {0, 0}, row = 1;
    float *out = malloc((size_t)n_vocab * sizeof(float));
    kn_batch ok = {.n_tokens = 2,
                   .tokens = tok,
                   .pos = pos,
                   .seq_of = seq_of,
                   .n_seqs = 1,
                   .seqs = &view,
                   .n_logits = 1,
                   .logit_rows = &row};
    TH_CHECK(kn_engine_forward(x->engine, x->kv, &ok, out) == 0);
    kn_batch b = ok;
    int32_t bad_tok[2] = {1, n_vocab};
    b.tokens = bad_tok;
    TH_CHECK(kn_engine_forward(x->engine, x->kv, &b, out) == TD_ERANGE);
    b = ok;
    int32_t bad_pos[2] = {0, 4};
    b.pos = bad_pos;
    TH_CHECK(kn_engine_forward(x->engine, x->kv, &b, out) == TD_ERANGE);
    b = ok;
    int32_t bad_seq[2] = {0, 1};
    b.seq_of = bad_seq;
    TH_CHECK(kn_engine_forward(x->engine, x->kv, &b, out) == TD_EINVAL);
    b = ok;
    int32_t bad_row = 2;
    b.logit_rows = &bad_row;
    TH_CHECK(kn_engine_forward(x->engine, x->kv, &b, out) == TD_ERANGE);
    b = ok;
    int32_t bad_table[1] = {9999};
    kn_seq_view bad_view = {.block_table = bad_table, .n_ctx = 4};
    b.seqs = &bad_view;
    TH_CHECK(kn_engine_forward(x->engine, x->kv, &b, out) == TD_ERANGE);
    b = ok;
    b.tokens = NULL;
    TH_CHECK(kn_engine_forward(x->engine, x->kv, &b, out) == TD_EINVAL);
    /* bad shards */
    kn_model *m = NULL;
    kn_shard s1 = {.l0 = 2, .l1 = 1};
    TH_CHECK(kn_model_load(gguf, &s1, &m) == TD_EINVAL && !m);
    kn_shard s2 = {.tp_rank = 0, .tp_size = n_head + 1}; /* does not divide the heads */
    TH_CHECK(kn_model_load(gguf, &s2, &m) == TD_EUNSUPP && !m);
    kn_shard s3 = {.l0 = 0, .l1 = n_layer + 1};
    TH_CHECK(kn_model_load(gguf, &s3, &m) == TD_EINVAL && !m);
    free(out);
    grid_close(&g);
}

/* Uneven FFN splits: when tp does not cut the width into whole 32-blocks, rank r holds
 * blocks [r * nb / tp, (r + 1) * nb / tp), the ranks tile the width, and the split logits
 * match (test_tp_splits ran them). A mixture-of-experts layer 0 splits every expert's width
 * (n_ff_exp) the same way: its last expert's slices are checked. */
static void test_ffn_split_tiles(void)
{
    for (int i = 0; i < n_tp_sizes; i++) {
        const int tp = tp_sizes[i];
        int next = 0, width = 0;
        bool uneven = false;
        for (int r = 0; r < tp; r++) {
            kn_model *m = NULL;
            kn_shard sh = {.tp_rank = r, .tp_size = tp};
            TH_REQUIRE(kn_model_load(gguf, &sh, &m) == 0);
            const kn_layer *ly = &m->layers[0];
            const bool moe = kn_layer_is_moe(&m->hp, 0);
            const int f0 = moe ? m->ffe0 : m->ff0, nf = moe ? m->n_ffe_local : m->n_ff_local;
            const kn_mat *up = moe ? &ly->exp_up[m->hp.n_expert - 1] : &ly->w_up;
            const kn_mat *down = moe ? &ly->exp_down[m->hp.n_expert - 1] : &ly->w_down;
            width = moe ? m->hp.n_ff_exp : n_ff;
            TH_CHECK(f0 == next && nf % 32 == 0 && nf > 0);
            TH_CHECK(down->n_cols == nf);
            TH_CHECK(up->n_rows == nf);
            uneven |= nf != width / tp;
            next = f0 + nf;
            kn_model_destroy(m);
        }
        TH_CHECK(next == width);
        if (width % (32 * tp)) TH_CHECKF(uneven, "tp %d: ffn %d split evenly", tp, width);
        fprintf(stderr, "  tp %d: ffn %d tiled%s\n", tp, width, uneven ? " unevenly" : "");
    }
}

/* The vocab-parallel LM head: rank r's output view is rows [r * n / tp, (r + 1) * n / tp)
 * of the LM head tensor (zero-copy: it points into rank 0's view at vocab0 rows), the
 * ranks tile the vocabulary, and the first stage keeps the whole token_embd. */
static void test_lm_head_tiles(void)
{
    for (int i = 0; i < n_tp_sizes; i++) {
        const int tp = tp_sizes[i];
        int next = 0;
        bool uneven = false;
        kn_mat whole = {0};
        for (int r = 0; r < tp; r++) {
            kn_model *m = NULL;
            kn_shard sh = {.tp_rank = r, .tp_size = tp};
            TH_REQUIRE(kn_model_load(gguf, &sh, &m) == 0);
            if (r == 0) whole = m->output;
            TH_CHECK(m->vocab0 == next && m->output.n_rows == m->n_vocab_local);
            TH_CHECK(m->n_vocab_local == n_vocab / tp || m->n_vocab_local == n_vocab / tp + 1);
            TH_CHECK(m->output.data ==
                     (const char *)whole.data + (size_t)m->vocab0 * whole.row_stride);
            TH_CHECK(m->tok_embd.n_rows == n_vocab);
            uneven |= m->n_vocab_local != n_vocab / tp;
            next = m->vocab0 + m->n_vocab_local;
            kn_model_destroy(m);
        }
        TH_CHECK(next == n_vocab);
        if (n_vocab % tp) TH_CHECKF(uneven, "tp %d: vocab %d split evenly", tp, n_vocab);
        fprintf(stderr, "  tp %d: LM head rows of vocab %d tiled%s\n", tp, n_vocab,
                uneven ? " unevenly" : "");
    }
}

static double rel_l2(const float *a, const float *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : INFINITY;
}

/* Whether the gguf type of tensor blk.L.NAME.weight has blocks wider than 32 weights and
 * a TP slice of `cols` input columns cuts through them (then it loads as Q8_0). */
static bool cut_needs_requant(int layer, const char *name, int64_t cols, td_dtype *orig)
{
    char full[96];
    snprintf(full, sizeof full, "blk.%d.%s.weight", layer, name);
    const td_gguf_tensor *t = td_gguf_find_tensor(gguf, full);
    const td_dtype_info *di = t ? td_dtype_get(t->type) : NULL;
    *orig = t ? (td_dtype)t->type : TD_F32;
    return di && di->blck > 32 && cols % di->blck != 0;
}

/* K-type row-parallel tensors: a cut slice loads as Q8_0 (and a whole one, or one of
 * 32-weight blocks, keeps its type); the re-quantized reference differs from the original
 * model a little, not zero. */
static void test_requant(void)
{
    kn_model *m = NULL;
    kn_shard half = {.tp_rank = 1, .tp_size = 2};
    TH_REQUIRE(kn_model_load(gguf, &half, &m) == 0);
    int want_owned = 0;
    for (int l = 0; l < n_layer; l++) {
        const kn_layer *ly = &m->layers[l];
        td_dtype od, oo;
        bool rd = cut_needs_requant(l, "ffn_down", ly->w_down.n_cols, &od);
        bool ro = cut_needs_requant(l, "attn_output", ly->wo.n_cols, &oo);
        TH_CHECKF(ly->w_down.type == (rd ? TD_Q8_0 : od) && ly->wo.type == (ro ? TD_Q8_0 : oo),
                  "layer %d: ffn_down %s -> %s, attn_output %s -> %s", l, td_dtype_name(od),
                  td_dtype_name(ly->w_down.type), td_dtype_name(oo), td_dtype_name(ly->wo.type));
        want_owned += rd + ro;
    }
    /* gemma3 270M's tp 2 slices are whole 256-blocks: nothing to re-quantize */
    TH_CHECK(m->n_owned == want_owned);
    fprintf(stderr, "  tp 2: %d row-parallel slices re-quantized\n", want_owned);
    td_dtype orig;
    cut_needs_requant(0, "ffn_down", m->layers[0].w_down.n_cols, &orig);
    kn_model_destroy(m);
    /* the original, unsplit and not re-quantized, against the re-quantized reference */
    requant_ref = false;
    grid g;
    TH_REQUIRE(grid_open(&g, 1, 1, TD_F32) == 0);
    float *logits = calloc((size_t)(N_DECODE + 1) * n_vocab, sizeof(float));
    int32_t gen[N_DECODE];
    int rc = run_sequence(&g, prompt, PROMPT_LEN, PROMPT_LEN, logits, gen);
    TH_CHECK(rc == 0);
    double d = rel_l2(ref_logits, logits, (size_t)n_vocab); /* prompt logits: same input */
    fprintf(stderr, "  %s -> q8_0 row-parallel: prompt logits rel L2 %.3g\n", td_dtype_name(orig),
            d);
    /* synthetic models ~4e-3, Qwen2.5 0.5B 8.9e-3, gemma3 270M 4.7e-2 */
    TH_CHECK(d > 0 && d < 6e-2);
    free(logits);
    grid_close(&g);
    requant_ref = true;
}

/* An architecture a TP split cannot compute (olmo2's Q/K norm over every head) refuses
 * tp > 1 at load, naming the reason, rather than computing something else. */
static void test_tp_refused(void)
{
    kn_model *m = NULL;
    kn_shard s = {.tp_rank = 0, .tp_size = 2};
    TH_CHECK(kn_model_load(gguf, &s, &m) == TD_EUNSUPP && m == NULL);
}

static void test_kv_pool_exhaustion(void)
{
    kn_kv_mem *mem;
    kn_kv_pool_params p = {.n_layers = 1,
                           .n_kv_heads = 1,
                           .head_dim = 8,
                           .block_size = 16,
                           .n_blocks = 4,
                           .type = TD_F16};
    TH_REQUIRE(kn_kv_mem_create(&p, &mem) == 0);
    kn_kv_pool *kv = kn_kv_mem_pool(mem);
    kn_kv_seq a, b;
    kn_kv_seq_init(&a);
    kn_kv_seq_init(&b);
    TH_CHECK(kn_kv_seq_reserve(mem, &a, 33) == 0 && a.n_blocks == 3);
    TH_CHECK(kn_kv_seq_reserve(mem, &b, 17) == TD_ENOSPC && b.n_blocks == 0); /* all or nothing */
    TH_CHECK(kv->n_free == 1);
    kn_kv_seq_release(mem, &a);
    TH_CHECK(kn_kv_seq_reserve(mem, &b, 64) == 0 && kv->n_free == 0);
    kn_kv_seq_fini(mem, &a);
    kn_kv_seq_fini(mem, &b);
    TH_CHECK(kv->n_free == 4);
    kn_kv_pool_params bad = p;
    bad.block_size = 12;
    kn_kv_pool *kv2 = NULL;
    kn_kv_mem *mem2 = NULL;
    TH_CHECK(kn_kv_pool_create(&bad, &kv2) == TD_EINVAL && !kv2);
    TH_CHECK(kn_kv_mem_create(&bad, &mem2) == TD_EINVAL && !mem2);
    kn_kv_mem_destroy(mem);
}

/* "2,4,8" into tp_sizes; false if malformed */
static bool parse_tp_sizes(const char *s)
{
    n_tp_sizes = 0;
    while (*s && n_tp_sizes < 8) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > 8 || (*end && *end != ',')) return false;
        tp_sizes[n_tp_sizes++] = (int)v;
        s = *end ? end + 1 : end;
    }
    return n_tp_sizes > 0 && !*s;
}

int main(int argc, char **argv)
{
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--tp") == 0 && i + 1 < argc && parse_tp_sizes(argv[i + 1])) {
            i++;
        } else {
            argc = 0; /* usage */
            break;
        }
    }
    if (argc < 2) {
        fprintf(stderr, "usage: test_model_split MODEL.gguf [--tp N,N...]\n"
                        "  --tp   TP sizes to compare (1-8; default 2,4)\n");
        return 2;
    }
    model_path = argv[1];
    char err[256];
    if (td_gguf_open(model_path, &gguf, err, sizeof err)) {
        fprintf(stderr, "cannot open %s: %s\n", model_path, err);
        return 1;
    }
    kn_hparams hp;
    if (kn_hparams_read(gguf, &hp)) return 1;
    n_vocab = hp.n_vocab;
    n_embd = hp.n_embd;
    n_layer = hp.n_layer;
    n_ff = hp.n_ff;
    gguf_moe = hp.n_expert > 0;
    n_head = hp.n_head;
    const td_gguf_tensor *down = td_gguf_find_tensor(gguf, "blk.0.ffn_down.weight");
    requant_ref = down && td_dtype_get(down->type) && td_dtype_get(down->type)->blck > 32;
    fprintf(stderr, "model %s: %s, %d layers, embd %d, heads %d/%d, ff %d, vocab %d\n", model_path,
            kn_arch_name(hp.arch), n_layer, n_embd, hp.n_head, hp.n_head_kv, hp.n_ff, n_vocab);
    for (int i = 0; i < PROMPT_LEN; i++)
        prompt[i] = (i * 131 + 17) % n_vocab;
    ref_logits = calloc((size_t)(N_DECODE + 1) * n_vocab, sizeof(float));
    grid g;
    if (grid_open(&g, 1, 1, TD_F32) ||
        run_sequence(&g, prompt, PROMPT_LEN, PROMPT_LEN, ref_logits, ref_gen)) {
        fprintf(stderr, "reference run failed\n");
        return 1;
    }
    grid_close(&g);
    TH_RUN(test_reference_is_sane);
    TH_RUN(test_pp_splits);
    TH_RUN(test_tp_splits);
    TH_RUN(test_pp_x_tp);
    TH_RUN(test_ep_splits);
    TH_RUN(test_chunking);
    TH_RUN(test_two_sequences_in_one_batch);
    TH_RUN(test_solo_row_invariant);
    if (tp_sizes[0] >= 2) TH_RUN(test_tbo);
    TH_RUN(test_f16_kv_close);
    TH_RUN(test_bad_batches);
    TH_RUN(test_kv_pool_exhaustion);
    TH_RUN(test_ffn_split_tiles);
    TH_RUN(test_lm_head_tiles);
    if (requant_ref) TH_RUN(test_requant);
    if (hp.qk_norm_whole) TH_RUN(test_tp_refused);
    free(ref_logits);
    td_gguf_close(gguf);
    TH_EXIT();
}
