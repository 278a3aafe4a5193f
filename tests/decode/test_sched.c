/* test_sched.c: the decode scheduler driving a real engine (one rank) on a synthetic
 * model: concurrent requests give the same tokens as alone, pool pressure (waiting and
 * preemption) still completes everything correctly, cancel frees blocks within one step,
 * requests that can never fit are refused, stop ids end generation, step plans survive
 * the trip to follower ranks (and malformed plans are rejected), and requests whose KV
 * arrives from a prefill (TRANSFERRING: simulated here by prefilling into the reserved
 * blocks) give the same tokens as colocated ones, also under pool pressure; a decode row
 * batched with a prefill chunk past the gemm threshold gives the bits of the row alone;
 * with itl_target_ms a long prompt arriving beside running decodes is cut into chunks
 * that keep every step within the target (under a synthetic step time the scheduler
 * learns from dc_sched_observe), yet always progresses, with the same tokens.
 * usage: test_sched MODEL.gguf
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../tharness.h"
#include "cpu_backend.h"
#include "cpu_pool.h"
#include "dc_plan.h"
#include "kv_cache.h"
#include "dc_sched.h"
#include "dc_threads.h"
#include "model.h"
#include "sampler.h"
#include "td_err.h"

#define MAX_REQ 32
#define MAX_OUT 64

typedef struct {
    int32_t ids[MAX_REQ][MAX_OUT];
    int n[MAX_REQ];
    dc_finish finish[MAX_REQ];
    int finals[MAX_REQ];
    int32_t cached[MAX_REQ]; /* usage: prompt tokens from the prefix cache */
    /* each token's logprob and its first alternative's (the odd requests ask for 2), NAN
     * where the event had none (a transfer's first token) */
    float lp[MAX_REQ][MAX_OUT][2];
} outputs;

static void on_tokens(void *ctx, uint64_t id, const int32_t *ids, int n,
                      const td_logprob_entry *lps, dc_finish finish, int32_t n_prompt,
                      int32_t n_gen, int32_t n_cached)
{
    ((outputs *)ctx)->cached[id] = n_cached;
    outputs *o = ctx;
    for (int i = 0; i < n && o->n[id] < MAX_OUT; i++) {
        o->lp[id][o->n[id]][0] = lps ? lps[i].logprob : NAN;
        o->lp[id][o->n[id]][1] = lps && lps[i].n_top > 1 ? lps[i].top[1].logprob : NAN;
        o->ids[id][o->n[id]++] = ids[i];
    }
    if (finish != DC_FINISH_NONE) {
        o->finish[id] = finish;
        o->finals[id]++;
    }
    (void)n_prompt;
    (void)n_gen;
}

static td_gguf *gguf;
static kn_model *model;
static kn_cpu *cpu;
static kn_engine *engine;

typedef struct {
    int32_t prompt[200];
    int n_prompt;
    int max_tokens;
    float temperature;
    uint64_t seed;
} req_spec;

static req_spec specs[MAX_REQ];

static dc_request_params params_of(int i)
{
    return (dc_request_params){
        .id = (uint64_t)i,
        .prompt = specs[i].prompt,
        .n_prompt = specs[i].n_prompt,
        .sampling = {.temperature = specs[i].temperature,
                     .top_k = 20,
                     .seed = specs[i].seed,
                     .logprobs = (uint32_t)(i % 2 ? 3 : 0)},
        .max_tokens = specs[i].max_tokens,
    };
}

/* Run the scheduler until idle (or max_steps); returns the number of steps. */
static int drive(dc_sched *s, kn_kv_pool *kv, int max_steps, float *logits)
{
    int steps = 0;
    while (!dc_sched_idle(s) && steps < max_steps) {
        dc_step st;
        int n = dc_sched_plan(s, &st);
        if (n < 0) return n;
        if (n == 0) break;
        int rc = kn_engine_forward(engine, kv, &st.batch, logits);
        dc_sched_commit(s, logits, rc);
        steps++;
    }
    return steps;
}

static float *logits_buf;
static dc_spec_params spec; /* speculative decoding of the schedulers created (off: {0}) */
static bool deterministic;  /* run(): every row solo */
static bool pc_on;          /* run(): with the prefix cache */
static bool pc_one_by_one;  /* run(): each request to its end before the next is submitted */

static int run(const int *which, int n_which, int n_blocks, int step_tokens, outputs *o,
               dc_sched_stats *stats)
{
    memset(o, 0, sizeof *o);
    kn_kv_mem *mem;
    kn_kv_pool_params kp = kn_model_kv_params(model, n_blocks, 16, TD_F32);
    if (kn_kv_mem_create(&kp, &mem)) return -1;
    kn_kv_pool *kv = kn_kv_mem_pool(mem);
    dc_sched *s;
    dc_sched_params sp = {.max_running = 16,
                          .step_tokens = step_tokens,
                          .deterministic = deterministic,
                          .prefix_cache = pc_on,
                          .spec = spec};
    if (dc_sched_create(&sp, model, mem, (dc_sink){.ctx = o, .on_tokens = on_tokens}, &s))
        return -1;
    int steps = 0;
    for (int i = 0; i < n_which; i++) {
        dc_request_params p = params_of(which[i]);
        if (dc_sched_submit(s, &p)) return -1;
        if (pc_one_by_one) steps += drive(s, kv, 100000, logits_buf);
    }
    steps += drive(s, kv, 100000, logits_buf);
    if (stats) *stats = dc_sched_get_stats(s);
    int leaked = kv->n_blocks - kn_kv_available(mem); /* idle cached blocks are not leaks */
    dc_sched_destroy(s);
    TH_CHECKF(leaked == 0, "%d blocks still in use after all requests finished", leaked);
    kn_kv_mem_destroy(mem);
    return steps;
}

static outputs alone;

static void compute_alone(int n_req)
{
    memset(&alone, 0, sizeof alone);
    for (int i = 0; i < n_req; i++) {
        outputs o;
        run(&i, 1, 256, 64, &o, NULL);
        memcpy(alone.ids[i], o.ids[i], sizeof o.ids[i]);
        memcpy(alone.lp[i], o.lp[i], sizeof o.lp[i]);
        alone.n[i] = o.n[i];
        alone.finish[i] = o.finish[i];
    }
}

static void check_same_as_alone(const outputs *o, int n_req, const char *what)
{
    for (int i = 0; i < n_req; i++) {
        TH_CHECKF(o->finals[i] == 1, "%s: req %d got %d final events", what, i, o->finals[i]);
        TH_CHECKF(o->n[i] == alone.n[i] &&
                      !memcmp(o->ids[i], alone.ids[i], sizeof(int32_t) * o->n[i]),
                  "%s: req %d generated %d tokens, alone %d (first %d vs %d)", what, i, o->n[i],
                  alone.n[i], o->ids[i][0], alone.ids[i][0]);
        TH_CHECK(o->finish[i] == DC_FINISH_LENGTH);
        /* with every row solo (deterministic), logprobs where both have them: the same bits
         * (the odd requests asked); otherwise a prefill row's (a request's first token, or
         * the first after a preemption) depends on its batch */
        if (!deterministic) continue;
        int lp_same = 1, lp_seen = 0;
        for (int j = 0; j < o->n[i] && j < alone.n[i]; j++)
            for (int k = 0; k < 2; k++)
                if (!isnan(o->lp[i][j][k]) && !isnan(alone.lp[i][j][k])) {
                    lp_seen++;
                    lp_same &= memcmp(&o->lp[i][j][k], &alone.lp[i][j][k], sizeof(float)) == 0;
                }
        TH_CHECKF(lp_same && (i % 2 == 0 || lp_seen > 0), "%s: req %d: logprobs differ (%d seen)",
                  what, i, lp_seen);
        TH_CHECK(i % 2 || lp_seen == 0);
    }
}

#define N_REQ 16

static void test_concurrent_equals_alone(void)
{
    int all[N_REQ];
    for (int i = 0; i < N_REQ; i++)
        all[i] = i;
    outputs o;
    int steps = run(all, N_REQ, 256, 64, &o, NULL);
    fprintf(stderr, "  %d requests together: %d steps\n", N_REQ, steps);
    TH_CHECK(steps > 0);
    check_same_as_alone(&o, N_REQ, "together");
}

/* decode[].adaptive_threads: steps computed by fewer of the pool's threads (each step's
 * count set through kn_pool_set_limit, as the decode node does from dc_threads) generate the
 * tokens computed alone with both threads; and the chooser itself. */
static void test_thread_limit(void)
{
    kn_pool *pool = kn_cpu_pool(cpu);
    int all[N_REQ];
    for (int i = 0; i < N_REQ; i++)
        all[i] = i;
    outputs o;
    kn_pool_set_limit(pool, 1);
    TH_CHECK(kn_pool_limit(pool) == 1);
    TH_CHECK(run(all, N_REQ, 256, 64, &o, NULL) > 0);
    check_same_as_alone(&o, N_REQ, "one thread of two");
    kn_pool_set_limit(pool, 2);
}

/* A world where a step at t threads takes cost[t] ms and the cost model follows the recent
 * steps (as dc_cost does): the chooser settles on the fastest level and follows a change. */
static void world_run(dc_threads *t, const double *cost_of_threads, int steps, double *model,
                      int *at_best, int best)
{
    *at_best = 0;
    for (int i = 0; i < steps; i++) {
        int n = dc_threads_next(t);
        double ms = cost_of_threads[n];
        dc_threads_observe(t, ms, *model);
        *model += 0.05 * (ms - *model);
        *at_best += n == best;
    }
    fprintf(stderr, "  %d of %d steps at %d threads\n", *at_best, steps, best);
}

static void test_thread_choice(void)
{
    dc_threads t;
    int at_best;
    double model = 10; /* the cost model's prediction */
    /* off, or one thread: every step at the configured count */
    dc_threads_init(&t, 4, false);
    for (int i = 0; i < 40; i++)
        TH_CHECK(dc_threads_next(&t) == 4);
    dc_threads_init(&t, 1, true);
    TH_CHECK(t.n_levels == 1 && dc_threads_next(&t) == 1);
    /* 2 threads, the cores free: 2 stays (probes of 1 are 1 step in 16) */
    double cost[9] = {0};
    cost[2] = 6, cost[1] = 10;
    dc_threads_init(&t, 2, true);
    TH_CHECK(t.n_levels == 2);
    world_run(&t, cost, 320, &model, &at_best, 2);
    TH_CHECKF(at_best >= 300 - 1 && t.cur == 0, "free cores: %d of 320 steps at 2 threads",
              at_best);
    /* the cores taken by others: 2 threads wait for each other, 1 is faster: it takes over
       within a few probes, and 2 comes back once they are free again */
    cost[2] = 17, cost[1] = 9;
    world_run(&t, cost, 320, &model, &at_best, 1);
    TH_CHECKF(at_best >= 240 && t.cur == 1, "contended: %d of 320 steps at 1 thread", at_best);
    cost[2] = 6, cost[1] = 10;
    world_run(&t, cost, 320, &model, &at_best, 2);
    TH_CHECKF(at_best >= 220 && t.cur == 0, "free again: %d of 320 steps at 2 threads", at_best);
    /* a difference within the margin does not flip it (2 threads' score 7.5 x 2^0.35 = 9.55
       against 9.5) */
    cost[2] = 7.5, cost[1] = 9.5;
    world_run(&t, cost, 320, &model, &at_best, 2);
    TH_CHECKF(at_best >= 300 - 1, "within the margin: %d of 320 steps stayed at 2", at_best);
    /* a second thread that shortens the step by little (0.89x) is not worth its core */
    cost[2] = 8.5, cost[1] = 9.5;
    world_run(&t, cost, 320, &model, &at_best, 1);
    TH_CHECKF(at_best >= 240 && t.cur == 1, "2 threads 0.89x the time: %d of 320 steps at 1",
              at_best);
    /* 8 threads, 2 the fastest: levels 8, 4, 2, 1, reached step by step through the probes */
    double c8[9] = {0};
    c8[8] = 20, c8[4] = 12, c8[2] = 8, c8[1] = 11;
    dc_threads_init(&t, 8, true);
    TH_CHECK(t.n_levels == 4 && dc_threads_of(&t, 3) == 1);
    world_run(&t, c8, 640, &model, &at_best, 2);
    TH_CHECKF(t.cur == 2 && t.at[2] > 400, "8 threads: settled at %d threads (%llu steps at 2)",
              dc_threads_of(&t, t.cur), (unsigned long long)t.at[2]);
    /* steps the model cannot judge are ignored */
    int cur = t.cur;
    dc_threads_next(&t);
    dc_threads_observe(&t, 5, 0);
    dc_threads_observe(&t, 0, 5);
    TH_CHECK(t.cur == cur);
}

static void test_pool_pressure(void)
{
    /* 14 blocks of 16 tokens: the largest request needs ~6, all together ~60 */
    int all[N_REQ];
    for (int i = 0; i < N_REQ; i++)
        all[i] = i;
    outputs o;
    dc_sched_stats st;
    int steps = run(all, N_REQ, 14, 48, &o, &st);
    fprintf(stderr, "  small pool: %d steps, %llu preemptions\n", steps,
            (unsigned long long)st.preemptions);
    TH_CHECK(steps > 0);
    TH_CHECK(st.preemptions > 0);
    check_same_as_alone(&o, N_REQ, "small pool");
}

static void test_refuse_and_cancel(void)
{
    kn_kv_mem *mem;
    kn_kv_pool_params kp = kn_model_kv_params(model, 8, 16, TD_F32);
    TH_REQUIRE(kn_kv_mem_create(&kp, &mem) == 0);
    kn_kv_pool *kv = kn_kv_mem_pool(mem);
    outputs o;
    memset(&o, 0, sizeof o);
    dc_sched *s;
    dc_sched_params sp = {.step_tokens = 64};
    TH_REQUIRE(dc_sched_create(&sp, model, mem, (dc_sink){.ctx = &o, .on_tokens = on_tokens}, &s) ==
               0);
    dc_request_params big = params_of(0);
    big.max_tokens = 8 * 16; /* prompt + this > 8 blocks */
    TH_CHECK(dc_sched_submit(s, &big) == TD_ENOSPC);
    dc_request_params p = params_of(1);
    p.max_tokens = 40;
    TH_CHECK(dc_sched_submit(s, &p) == 0);
    TH_CHECK(dc_sched_submit(s, &p) == TD_EINVAL); /* duplicate id */
    dc_request_params bad = params_of(2);
    int32_t badtok[2] = {1, model->hp.n_vocab};
    bad.prompt = badtok;
    bad.n_prompt = 2;
    TH_CHECK(dc_sched_submit(s, &bad) == TD_ERANGE);
    bad.n_prompt = 0;
    TH_CHECK(dc_sched_submit(s, &bad) == TD_EINVAL);
    drive(s, kv, 5, logits_buf);
    TH_CHECK(o.n[1] > 0 && o.finals[1] == 0);
    TH_CHECK(kv->n_free < kv->n_blocks);
    TH_CHECK(dc_sched_cancel(s, 1) == 0);
    TH_CHECK(dc_sched_cancel(s, 99) == TD_ENOENT);
    dc_step st;
    TH_CHECK(dc_sched_plan(s, &st) == 0); /* the only request was cancelled */
    TH_CHECK(o.finish[1] == DC_FINISH_CANCELLED && o.finals[1] == 1);
    TH_CHECK(kv->n_free == kv->n_blocks);
    TH_CHECK(dc_sched_idle(s));
    dc_sched_destroy(s);
    kn_kv_mem_destroy(mem);
}

static void test_stop_ids(void)
{
    /* stop on the first token request 3 generates alone: nothing is emitted, finish STOP */
    kn_kv_mem *mem;
    kn_kv_pool_params kp = kn_model_kv_params(model, 64, 16, TD_F32);
    TH_REQUIRE(kn_kv_mem_create(&kp, &mem) == 0);
    kn_kv_pool *kv = kn_kv_mem_pool(mem);
    outputs o;
    memset(&o, 0, sizeof o);
    dc_sched *s;
    dc_sched_params sp = {0};
    TH_REQUIRE(dc_sched_create(&sp, model, mem, (dc_sink){.ctx = &o, .on_tokens = on_tokens}, &s) ==
               0);
    dc_request_params p = params_of(3);
    int32_t stop = alone.ids[3][2];
    p.stop_ids = &stop;
    p.n_stop = 1;
    TH_REQUIRE(dc_sched_submit(s, &p) == 0);
    drive(s, kv, 1000, logits_buf);
    TH_CHECK(o.finish[3] == DC_FINISH_STOP);
    TH_CHECK(o.n[3] <= 2 && !memcmp(o.ids[3], alone.ids[3], sizeof(int32_t) * o.n[3]));
    dc_sched_destroy(s);
    kn_kv_mem_destroy(mem);
}

static void test_plan_round_trip(void)
{
    kn_kv_mem *mem;
    kn_kv_pool_params kp = kn_model_kv_params(model, 64, 16, TD_F32);
    TH_REQUIRE(kn_kv_mem_create(&kp, &mem) == 0);
    kn_kv_pool *kv = kn_kv_mem_pool(mem);
    outputs o;
    memset(&o, 0, sizeof o);
    dc_sched *s;
    dc_sched_params sp = {.step_tokens = 40};
    TH_REQUIRE(dc_sched_create(&sp, model, mem, (dc_sink){.ctx = &o, .on_tokens = on_tokens}, &s) ==
               0);
    for (int i = 0; i < 4; i++) {
        dc_request_params p = params_of(i);
        TH_REQUIRE(dc_sched_submit(s, &p) == 0);
    }
    dc_plan_view v;
    dc_plan_view_init(&v);
    uint8_t buf[1 << 16];
    for (int step = 0; step < 6; step++) {
        dc_step st;
        TH_REQUIRE(dc_sched_plan(s, &st) > 0);
        size_t len;
        /* odd steps carry tier copies (a TP leader's tier: kv_tier.h), made before the step */
        const kn_kv_tier_op cp[3] = {
            {KN_KV_TIER_OP_PUT, 7, 1}, {KN_KV_TIER_OP_GET, 2, 1}, {KN_KV_TIER_OP_GET, 7, 3}};
        int nc = step % 2 ? 3 : 0;
        TH_REQUIRE(dc_plan_encode(&st.batch, cp, nc, 16, (uint64_t)step, step % 3, buf, sizeof buf,
                                  &len) == 0);
        TH_CHECK(len == dc_plan_size(&st.batch, nc, 16));
        TH_REQUIRE(dc_plan_decode(buf, len, 16, kv->n_blocks, &v) == 0);
        const kn_batch *a = &st.batch, *b = &v.batch;
        TH_CHECK(v.kind == DC_PLAN_RUN && v.step == (uint64_t)step && v.threads == step % 3);
        TH_CHECK(v.n_copies == nc && (!nc || !memcmp(v.copies, cp, sizeof cp)));
        TH_CHECK(a->n_tokens == b->n_tokens && a->n_seqs == b->n_seqs);
        TH_CHECK(a->n_solo == b->n_solo);
        /* the logit rows travel too: every rank computes its vocab slice of them */
        TH_CHECK(a->n_logits > 0 && a->n_logits == b->n_logits);
        TH_CHECK(!memcmp(a->logit_rows, b->logit_rows, 4 * (size_t)a->n_logits));
        TH_CHECK(!memcmp(a->tokens, b->tokens, 4 * a->n_tokens));
        TH_CHECK(!memcmp(a->pos, b->pos, 4 * a->n_tokens));
        TH_CHECK(!memcmp(a->seq_of, b->seq_of, 4 * a->n_tokens));
        for (int q = 0; q < a->n_seqs; q++) {
            TH_CHECK(a->seqs[q].n_ctx == b->seqs[q].n_ctx);
            TH_CHECK(!memcmp(a->seqs[q].block_table, b->seqs[q].block_table,
                             4 * (size_t)((a->seqs[q].n_ctx + 15) / 16)));
        }
        /* every truncation and a corrupt block id are rejected */
        for (size_t cut = 0; cut < len; cut += 7)
            TH_CHECK(dc_plan_decode(buf, cut, 16, kv->n_blocks, &v) == TD_EFORMAT);
        TH_CHECK(dc_plan_decode(buf, len, 16, 1, &v) == TD_EFORMAT || a->n_seqs == 0);
        int rc = kn_engine_forward(engine, kv, &st.batch, logits_buf);
        dc_sched_commit(s, logits_buf, rc);
    }
    size_t len;
    /* copies alone (a planning that scheduled nothing): DC_PLAN_COPY; bad copies refused */
    kn_kv_tier_op cp[2] = {{KN_KV_TIER_OP_PUT, 0, 5}, {KN_KV_TIER_OP_GET, 0, 6}};
    TH_CHECK(dc_plan_encode(NULL, cp, 2, 16, 8, 0, buf, sizeof buf, &len) == 0);
    TH_CHECK(len == dc_plan_size(NULL, 2, 16));
    TH_CHECK(dc_plan_decode(buf, len, 16, kv->n_blocks, &v) == 0 && v.kind == DC_PLAN_COPY &&
             v.n_copies == 2 && v.copies[1].kind == KN_KV_TIER_OP_GET && v.copies[1].block == 6 &&
             v.batch.n_tokens == 0);
    for (size_t cut = 0; cut < len; cut += 5)
        TH_CHECK(dc_plan_decode(buf, cut, 16, kv->n_blocks, &v) == TD_EFORMAT);
    TH_CHECK(dc_plan_decode(buf, len, 16, 6, &v) == TD_EFORMAT); /* block 6 outside the pool */
    cp[0].kind = 9;
    TH_CHECK(dc_plan_encode(NULL, cp, 2, 16, 8, 0, buf, sizeof buf, &len) == 0);
    TH_CHECK(dc_plan_decode(buf, len, 16, kv->n_blocks, &v) == TD_EFORMAT);
    TH_CHECK(dc_plan_encode(NULL, NULL, 0, 16, 9, 0, buf, sizeof buf, &len) == 0);
    TH_CHECK(dc_plan_decode(buf, len, 16, kv->n_blocks, &v) == 0 && v.kind == DC_PLAN_SHUTDOWN);
    buf[0] ^= 1;
    TH_CHECK(dc_plan_decode(buf, len, 16, kv->n_blocks, &v) == TD_EFORMAT);
    dc_plan_view_fini(&v);
    dc_sched_destroy(s);
    kn_kv_mem_destroy(mem);
}

/* A step that mixes a decode row with a prefill chunk past the gemm threshold (77 rows):
 * the decode row comes first as a solo row, and its logits are bit-identical to the same
 * row run alone; bad solo counts and misplaced solo logit rows are refused. */
static void test_solo_rows(void)
{
    kn_kv_mem *mem;
    kn_kv_pool_params kp = kn_model_kv_params(model, 64, 16, TD_F32);
    TH_REQUIRE(kn_kv_mem_create(&kp, &mem) == 0);
    kn_kv_pool *kv = kn_kv_mem_pool(mem);
    outputs o;
    memset(&o, 0, sizeof o);
    dc_sched *s;
    dc_sched_params sp = {.max_running = 16, .step_tokens = 100};
    TH_REQUIRE(dc_sched_create(&sp, model, mem, (dc_sink){.ctx = &o, .on_tokens = on_tokens}, &s) ==
               0);
    dc_request_params p0 = params_of(0), p2 = params_of(2);
    TH_REQUIRE(specs[2].n_prompt >= 64 && specs[2].n_prompt < 100 && specs[0].max_tokens > 2);
    TH_REQUIRE(dc_sched_submit(s, &p0) == 0);
    TH_REQUIRE(drive(s, kv, 1, logits_buf) == 1); /* request 0's prompt: now decoding */
    TH_REQUIRE(dc_sched_submit(s, &p2) == 0);
    dc_step st;
    TH_REQUIRE(dc_sched_plan(s, &st) == 1 + specs[2].n_prompt);
    const kn_batch *b = &st.batch;
    TH_CHECK(b->n_solo == 1 && b->n_logits == 2 && b->logit_rows[0] == 0); /* the decode row */
    TH_CHECK(b->tokens[0] == o.ids[0][0] && b->pos[0] == specs[0].n_prompt);
    const size_t nv = (size_t)model->hp.n_vocab;
    float *mixed = malloc(2 * nv * sizeof *mixed), *solo = malloc(nv * sizeof *solo);
    TH_REQUIRE(mixed && solo);
    TH_REQUIRE(kn_engine_forward(engine, kv, b, mixed) == 0);
    /* the decode row alone (its KV write repeats the same bits into the same slot) */
    const int32_t seq0 = 0, row0 = 0;
    kn_batch one = {.n_tokens = 1,
                    .n_solo = 1,
                    .tokens = b->tokens,
                    .pos = b->pos,
                    .seq_of = &seq0,
                    .n_seqs = 1,
                    .seqs = &b->seqs[b->seq_of[0]],
                    .n_logits = 1,
                    .logit_rows = &row0};
    TH_REQUIRE(kn_engine_forward(engine, kv, &one, solo) == 0);
    TH_CHECK(memcmp(mixed, solo, nv * sizeof *solo) == 0);
    /* refused: more solo rows than tokens; a solo row's logit row after another one */
    kn_batch bad = *b;
    bad.n_solo = b->n_tokens + 1;
    TH_CHECK(kn_engine_forward(engine, kv, &bad, mixed) == TD_EINVAL);
    const int32_t swapped[2] = {b->logit_rows[1], b->logit_rows[0]};
    bad = *b;
    bad.n_solo = 1; /* row 0 solo: its logit row must come first */
    bad.logit_rows = swapped;
    TH_CHECK(kn_engine_forward(engine, kv, &bad, mixed) == TD_EINVAL);
    TH_REQUIRE(kn_engine_forward(engine, kv, b, mixed) == 0);
    dc_sched_commit(s, mixed, 0);
    drive(s, kv, 1000, logits_buf);
    TH_CHECK(dc_sched_idle(s) && o.n[0] == specs[0].max_tokens && o.n[2] == specs[2].max_tokens);
    dc_sched_destroy(s);

    /* deterministic: the prefill rows are solo rows too */
    memset(&o, 0, sizeof o);
    sp.deterministic = true;
    TH_REQUIRE(dc_sched_create(&sp, model, mem, (dc_sink){.ctx = &o, .on_tokens = on_tokens}, &s) ==
               0);
    TH_REQUIRE(dc_sched_submit(s, &p0) == 0);
    TH_REQUIRE(drive(s, kv, 1, logits_buf) == 1);
    TH_REQUIRE(dc_sched_submit(s, &p2) == 0);
    TH_REQUIRE(dc_sched_plan(s, &st) == 1 + specs[2].n_prompt);
    TH_CHECK(st.batch.n_solo == st.batch.n_tokens);
    TH_REQUIRE(kn_engine_forward(engine, kv, &st.batch, mixed) == 0);
    dc_sched_commit(s, mixed, 0);
    drive(s, kv, 1000, logits_buf);
    TH_CHECK(dc_sched_idle(s) && o.n[0] == specs[0].max_tokens && o.n[2] == specs[2].max_tokens);
    free(mixed);
    free(solo);
    dc_sched_destroy(s);
    kn_kv_mem_destroy(mem);
}

/* What a prefill instance does for request i: compute the prompt's KV from position `from`
 * on (the blocks before it hold the prefix already: the decode side's cache) into the
 * blocks the scheduler reserved (as kvxfer would put it there), never writing below it, and
 * sample the first token with the request's sampler. Returns the token or a negative td_err. */
static int32_t fake_prefill_from(kn_kv_pool *kv, int i, const int32_t *blocks, int n_blocks,
                                 int from)
{
    int32_t table[16], pos[200], seq_of[200] = {0};
    if (n_blocks > 16) return TD_ERANGE;
    memcpy(table, blocks, (size_t)n_blocks * sizeof *table); /* the scheduler may move them */
    int n = specs[i].n_prompt;
    for (int t = from; t < n; t++)
        pos[t - from] = t;
    kn_seq_view view = {.block_table = table, .n_ctx = n};
    int32_t last = n - from - 1;
    kn_batch b = {.n_tokens = n - from,
                  .tokens = specs[i].prompt + from,
                  .pos = pos,
                  .seq_of = seq_of,
                  .n_seqs = 1,
                  .seqs = &view,
                  .n_logits = 1,
                  .logit_rows = &last};
    int rc = kn_engine_forward(engine, kv, &b, logits_buf);
    if (rc) return rc;
    dc_request_params p = params_of(i);
    kn_sampler smp;
    if ((rc = kn_sampler_init(&smp, &p.sampling, model->hp.n_vocab))) return rc;
    int32_t first = kn_sample(&smp, logits_buf, specs[i].prompt, n, p.sampling.skip_samples);
    kn_sampler_fini(&smp);
    return first;
}

static int32_t fake_prefill(kn_kv_pool *kv, int i, const int32_t *blocks, int n_blocks)
{
    return fake_prefill_from(kv, i, blocks, n_blocks, 0);
}

/* One scheduler step; returns its tokens (0: nothing runnable). */
static int one_step(dc_sched *s, kn_kv_pool *kv)
{
    dc_step st;
    int n = dc_sched_plan(s, &st);
    if (n <= 0) return n;
    dc_sched_commit(s, logits_buf, kn_engine_forward(engine, kv, &st.batch, logits_buf));
    return n;
}

/* Every request arrives by transfer, one after the other while the others decode. */
static void transfer_all(int n_blocks, const char *what)
{
    kn_kv_mem *mem;
    kn_kv_pool_params kp = kn_model_kv_params(model, n_blocks, 16, TD_F32);
    TH_REQUIRE(kn_kv_mem_create(&kp, &mem) == 0);
    kn_kv_pool *kv = kn_kv_mem_pool(mem);
    outputs o;
    memset(&o, 0, sizeof o);
    dc_sched *s;
    dc_sched_params sp = {.max_running = 16, .step_tokens = 48, .spec = spec};
    TH_REQUIRE(dc_sched_create(&sp, model, mem, (dc_sink){.ctx = &o, .on_tokens = on_tokens}, &s) ==
               0);
    for (int i = 0; i < N_REQ; i++) {
        dc_request_params p = params_of(i);
        const int32_t *blocks;
        int nb, rc, guard = 0;
        int32_t nc;
        /* the pool has no room for the prompt now: the running requests make some */
        while ((rc = dc_sched_submit_transfer(s, &p, &blocks, &nb, &nc)) == TD_ESTATE &&
               guard++ < 1000)
            if (one_step(s, kv) <= 0) break;
        TH_REQUIRE(rc == 0);
        TH_CHECK(nb == kn_kv_blocks_for(kv, specs[i].n_prompt));
        TH_CHECK(dc_sched_transferring(s, (uint64_t)i));
        TH_CHECK(dc_sched_get_stats(s).transferring == 1);
        int32_t first = fake_prefill(kv, i, blocks, nb);
        TH_REQUIRE(first >= 0);
        TH_CHECK(dc_sched_transfer_done(s, (uint64_t)i, first) == 0);
        TH_CHECK(!dc_sched_transferring(s, (uint64_t)i));
        TH_CHECK(o.n[i] == 1 && o.ids[i][0] == first);
        one_step(s, kv);
    }
    drive(s, kv, 100000, logits_buf);
    dc_sched_stats st = dc_sched_get_stats(s);
    fprintf(stderr, "  %s: %llu preemptions\n", what, (unsigned long long)st.preemptions);
    check_same_as_alone(&o, N_REQ, what);
    TH_CHECKF(kv->n_free == kv->n_blocks, "%s: %d blocks still in use", what,
              kv->n_blocks - kv->n_free);
    dc_sched_destroy(s);
    kn_kv_mem_destroy(mem);
}

static void test_transfer_equals_colocated(void)
{
    transfer_all(256, "transferred");
    transfer_all(14, "transferred, small pool"); /* preempted ones are recomputed locally */
}

static void test_transfer_edges(void)
{
    kn_kv_mem *mem;
    kn_kv_pool_params kp = kn_model_kv_params(model, 16, 16, TD_F32);
    TH_REQUIRE(kn_kv_mem_create(&kp, &mem) == 0);
    kn_kv_pool *kv = kn_kv_mem_pool(mem);
    outputs o;
    memset(&o, 0, sizeof o);
    dc_sched *s;
    dc_sched_params sp = {0};
    TH_REQUIRE(dc_sched_create(&sp, model, mem, (dc_sink){.ctx = &o, .on_tokens = on_tokens}, &s) ==
               0);
    const int32_t *blocks;
    int nb;
    int32_t nc;
    /* same errors as submit */
    dc_request_params big = params_of(0);
    big.max_tokens = 16 * 16;
    TH_CHECK(dc_sched_submit_transfer(s, &big, &blocks, &nb, &nc) == TD_ENOSPC);
    /* a transferring request holds its blocks and is not runnable */
    dc_request_params p = params_of(5); /* 3 + 5 * 37 % 90 = 8 tokens: 1 block */
    TH_REQUIRE(dc_sched_submit_transfer(s, &p, &blocks, &nb, &nc) == 0 && nb == 1);
    TH_CHECK(dc_sched_submit_transfer(s, &p, &blocks, &nb, &nc) == TD_EINVAL); /* duplicate id */
    TH_CHECK(kv->n_free == 15 && !dc_sched_idle(s));
    dc_step st;
    TH_CHECK(dc_sched_plan(s, &st) == 0);
    /* cancel only marks it: the node ends it once no writer can write */
    TH_CHECK(dc_sched_cancel(s, 5) == 0);
    TH_CHECK(dc_sched_plan(s, &st) == 0 && kv->n_free == 15 && o.finals[5] == 0);
    TH_CHECK(dc_sched_transfer_end(s, 5, DC_FINISH_CANCELLED) == 0);
    TH_CHECK(o.finish[5] == DC_FINISH_CANCELLED && o.finals[5] == 1 && kv->n_free == 16);
    TH_CHECK(dc_sched_transfer_end(s, 5, DC_FINISH_CANCELLED) == TD_ENOENT);
    /* the pool cannot hold the prompt right now: retry later */
    dc_request_params q = params_of(6); /* 3 + 6 * 37 % 90 = 45 tokens: 3 blocks */
    q.max_tokens = 4;
    int held = 0;
    for (uint64_t id = 20; id < 25; id++, held++) { /* 5 x 3 of 16 blocks */
        q.id = id;
        TH_REQUIRE(dc_sched_submit_transfer(s, &q, &blocks, &nb, &nc) == 0);
    }
    q.id = 25;
    TH_CHECK(dc_sched_submit_transfer(s, &q, &blocks, &nb, &nc) == TD_ESTATE);
    TH_CHECK(dc_sched_get_stats(s).transferring == held && kv->n_free == 16 - 3 * held);
    /* a first token outside the vocabulary changes nothing */
    TH_CHECK(dc_sched_transfer_done(s, 20, model->hp.n_vocab) == TD_EINVAL);
    TH_CHECK(dc_sched_transferring(s, 20));
    /* a failed transfer ends with an error and gives its blocks back */
    TH_CHECK(dc_sched_transfer_end(s, 20, DC_FINISH_ERROR) == 0 && o.finish[20] == DC_FINISH_ERROR);
    TH_CHECK(kv->n_free == 16 - 3 * (held - 1));
    dc_sched_destroy(s);
    kn_kv_mem_destroy(mem);

    TH_REQUIRE(kn_kv_mem_create(&kp, &mem) == 0);

    kv = kn_kv_mem_pool(mem);
    memset(&o, 0, sizeof o);
    TH_REQUIRE(dc_sched_create(&sp, model, mem, (dc_sink){.ctx = &o, .on_tokens = on_tokens}, &s) ==
               0);
    p = params_of(5);
    p.max_tokens = 1;
    TH_REQUIRE(dc_sched_submit_transfer(s, &p, &blocks, &nb, &nc) == 0);
    TH_CHECK(dc_sched_transfer_done(s, 5, 7) == 0);
    TH_CHECK(o.n[5] == 1 && o.ids[5][0] == 7 && o.finish[5] == DC_FINISH_LENGTH);
    /* a stop token: counted, not sent, finish STOP */
    int32_t stop = 9;
    p = params_of(6);
    p.stop_ids = &stop;
    p.n_stop = 1;
    TH_REQUIRE(dc_sched_submit_transfer(s, &p, &blocks, &nb, &nc) == 0);
    TH_CHECK(dc_sched_transfer_done(s, 6, 9) == 0);
    TH_CHECK(o.n[6] == 0 && o.finish[6] == DC_FINISH_STOP);
    /* cancelled while transferring, then the KV arrives anyway: it ends cancelled */
    p = params_of(7);
    TH_REQUIRE(dc_sched_submit_transfer(s, &p, &blocks, &nb, &nc) == 0);
    TH_CHECK(dc_sched_cancel(s, 7) == 0 && dc_sched_transfer_done(s, 7, 3) == 0);
    TH_CHECK(o.n[7] == 0 && o.finish[7] == DC_FINISH_CANCELLED);
    /* fail_all ends transferring requests too and frees their blocks */
    p = params_of(8);
    TH_REQUIRE(dc_sched_submit_transfer(s, &p, &blocks, &nb, &nc) == 0);
    dc_sched_fail_all(s);
    TH_CHECK(o.finish[8] == DC_FINISH_ERROR && kv->n_free == kv->n_blocks && dc_sched_idle(s));
    dc_sched_destroy(s);
    kn_kv_mem_destroy(mem);
}

/* Prefix cache: the 2nd turn of a conversation (turn 1's prompt + its answer + more) run
 * right after turn 1 on a cached scheduler gives the tokens it gives cold, reports cached
 * tokens, and so do identical prompts submitted at once (they wait for the first to compute
 * the shared blocks) and a small pool that must evict. */
static void test_prefix_cache(void)
{
    enum { T = N_REQ }; /* specs T + k: turn 2 of request k */
    int idx[8];
    for (int k = 0; k < 4; k++) {
        req_spec *t2 = &specs[T + k];
        *t2 = specs[k];
        memcpy(t2->prompt + t2->n_prompt, alone.ids[k], sizeof(int32_t) * alone.n[k]);
        t2->n_prompt += alone.n[k];
        for (int j = 0; j < 5; j++)
            t2->prompt[t2->n_prompt++] = (7 * j + k) % model->hp.n_vocab;
        t2->temperature = 0;
        t2->max_tokens = 8;
    }
    outputs cold[4], o;
    for (int k = 0; k < 4; k++) {
        int i = T + k;
        run(&i, 1, 256, 64, &cold[k], NULL);
        TH_CHECK(cold[k].cached[i] == 0);
    }
    pc_on = pc_one_by_one = true;
    for (int k = 0; k < 4; k++)
        idx[2 * k] = k, idx[2 * k + 1] = T + k;
    dc_sched_stats st;
    run(idx, 8, 256, 64, &o, &st);
    for (int k = 0; k < 4; k++) {
        int i = T + k;
        TH_CHECKF(o.n[i] == cold[k].n[i] && !memcmp(o.ids[i], cold[k].ids[i], 4 * (size_t)o.n[i]),
                  "turn 2 of %d: %d tokens with the cache, %d cold", k, o.n[i], cold[k].n[i]);
        int whole = (specs[k].n_prompt + alone.n[k] - 1) / 16 * 16; /* turn 1's computed blocks */
        TH_CHECKF(o.cached[i] == whole, "turn 2 of %d: %d cached tokens, expected %d", k,
                  o.cached[i], whole);
    }
    TH_CHECK(st.prefix_hits > 0 && st.prefix_hits <= st.prefix_queried);
    /* four identical greedy prompts at once: the first computes, the others share */
    pc_one_by_one = false;
    for (int k = 0; k < 4; k++)
        specs[T + 4 + k] = specs[T], idx[k] = T + 4 + k;
    run(idx, 4, 256, 64, &o, &st);
    int shared = (specs[T].n_prompt - 1) / 16 * 16;
    for (int k = 0; k < 4; k++) {
        int i = T + 4 + k;
        TH_CHECK(o.n[i] == cold[0].n[T] && !memcmp(o.ids[i], cold[0].ids[T], 4 * (size_t)o.n[i]));
        TH_CHECKF(o.cached[i] == (k ? shared : 0), "copy %d: %d cached tokens", k, o.cached[i]);
    }
    /* a small pool: evictions, outputs unchanged */
    int all[N_REQ];
    for (int i = 0; i < N_REQ; i++)
        all[i] = i;
    run(all, N_REQ, 14, 48, &o, &st);
    fprintf(stderr, "  small pool with the cache: %llu evictions, %llu of %llu tokens hit\n",
            (unsigned long long)st.prefix_evictions, (unsigned long long)st.prefix_hits,
            (unsigned long long)st.prefix_queried);
    TH_CHECK(st.prefix_evictions > 0);
    check_same_as_alone(&o, N_REQ, "small pool, cache");
    pc_on = false;
}

/* Prefix cache in disaggregated mode: turn 1 arrives by transfer and decodes; turn 2's
 * Alloc shares the blocks turn 1 left (n_cached = the whole blocks of turn 1's computed
 * tokens), the prefill writes only the rest and turn 2 gives the cold tokens; a transfer
 * cancelled after sharing drops its references once (nothing held, nothing double-freed);
 * no sharing with prompt logprobs. Needs test_prefix_cache's specs (turn 2 of k at N_REQ + k). */
static void test_transfer_prefix(void)
{
    enum { K = 3, T = N_REQ + K }; /* turn 1: request 3 (greedy, 24 tokens); T: its turn 2 */
    outputs cold, o;
    int i2 = T;
    run(&i2, 1, 256, 64, &cold, NULL);
    kn_kv_mem *mem;
    kn_kv_pool_params kp = kn_model_kv_params(model, 64, 16, TD_F32);
    TH_REQUIRE(kn_kv_mem_create(&kp, &mem) == 0);
    kn_kv_pool *kv = kn_kv_mem_pool(mem);
    memset(&o, 0, sizeof o);
    dc_sched *s;
    dc_sched_params sp = {.max_running = 16, .step_tokens = 64, .prefix_cache = true};
    TH_REQUIRE(dc_sched_create(&sp, model, mem, (dc_sink){.ctx = &o, .on_tokens = on_tokens}, &s) ==
               0);
    const int32_t *blocks;
    int nb;
    int32_t nc;
    dc_request_params p = params_of(K); /* turn 1, its answer is alone.ids[K] */
    TH_REQUIRE(dc_sched_submit_transfer(s, &p, &blocks, &nb, &nc) == 0 && nc == 0);
    TH_REQUIRE(dc_sched_transfer_done(s, K, fake_prefill(kv, K, blocks, nb)) == 0);
    drive(s, kv, 100000, logits_buf);
    TH_CHECK(o.n[K] == alone.n[K] && !memcmp(o.ids[K], alone.ids[K], 4 * (size_t)o.n[K]));
    int whole = (specs[K].n_prompt + alone.n[K] - 1) / 16 * 16;
    p = params_of(T);
    TH_REQUIRE(dc_sched_submit_transfer(s, &p, &blocks, &nb, &nc) == 0);
    TH_CHECKF(nc == whole && nc > 0, "turn 2: %d positions shared, expected %d", nc, whole);
    for (int b = 0; b < nc / 16; b++)
        TH_CHECK(kv->refs[blocks[b]] == 1);
    int32_t first = fake_prefill_from(kv, T, blocks, nb, nc);
    TH_REQUIRE(first >= 0 && dc_sched_transfer_done(s, T, first) == 0);
    drive(s, kv, 100000, logits_buf);
    TH_CHECKF(o.n[T] == cold.n[T] && !memcmp(o.ids[T], cold.ids[T], 4 * (size_t)o.n[T]),
              "turn 2 with %d shared positions differs from cold", nc);
    TH_CHECK(o.cached[T] == nc);
    /* the same prompt again, cancelled during its transfer: its shared references go */
    specs[T + 1] = specs[T];
    p = params_of(T + 1);
    TH_REQUIRE(dc_sched_submit_transfer(s, &p, &blocks, &nb, &nc) == 0 && nc >= whole);
    int32_t shared0 = blocks[0];
    TH_CHECK(kv->refs[shared0] == 1 && dc_sched_cancel(s, T + 1) == 0);
    TH_CHECK(dc_sched_transfer_end(s, T + 1, DC_FINISH_CANCELLED) == 0);
    TH_CHECK(kv->refs[shared0] == 0 && kn_kv_available(mem) == kv->n_blocks);
    /* prompt logprobs: nothing shared */
    p.sampling.prompt_logprobs = true;
    p.sampling.logprobs = 1;
    TH_REQUIRE(dc_sched_submit_transfer(s, &p, &blocks, &nb, &nc) == 0 && nc == 0);
    TH_CHECK(dc_sched_transfer_end(s, T + 1, DC_FINISH_CANCELLED) == 0);
    TH_CHECK(dc_sched_get_stats(s).prefix_hits >= (uint64_t)whole);
    TH_CHECK(kn_kv_available(mem) == kv->n_blocks && dc_sched_idle(s));
    dc_sched_destroy(s);
    kn_kv_mem_destroy(mem);
}

/* The second tier at Alloc (disaggregated mode): turn 1 arrives by transfer and decodes,
 * the whole pool is then taken and given back (every idle cached block goes to the tier),
 * and turn 2's Alloc finds its prefix in the tier: the blocks are copied back (n_cached as
 * with the pool, tier reads and hits counted), the prefill writes only the rest, and turn 2
 * gives the cold tokens. Without the tier the same Alloc shares nothing. */
static void test_transfer_tier(void)
{
    enum { K = 3, T = N_REQ + K };
    outputs cold;
    int i2 = T;
    run(&i2, 1, 256, 64, &cold, NULL);
    int whole = 0;
    for (int with_tier = 1; with_tier >= 0; with_tier--) {
        kn_kv_mem *mem;
        kn_kv_pool_params kp = kn_model_kv_params(model, 64, 16, TD_F32);
        TH_REQUIRE(kn_kv_mem_create(&kp, &mem) == 0);
        kn_kv_pool *kv = kn_kv_mem_pool(mem);
        outputs o;
        memset(&o, 0, sizeof o);
        dc_sched *s;
        dc_sched_params sp = {.max_running = 16, .step_tokens = 64, .prefix_cache = true};
        if (with_tier)
            sp.tier = (kn_kv_tier_params){.bytes = 4096 + 64 * kn_kv_tier_block_bytes(kv)};
        TH_REQUIRE(dc_sched_create(&sp, model, mem, (dc_sink){.ctx = &o, .on_tokens = on_tokens},
                                   &s) == 0);
        const int32_t *blocks;
        int nb;
        int32_t nc;
        specs[T + 1] = specs[T];
        dc_request_params p = params_of(K);
        TH_REQUIRE(dc_sched_submit_transfer(s, &p, &blocks, &nb, &nc) == 0 && nc == 0);
        TH_REQUIRE(dc_sched_transfer_done(s, K, fake_prefill(kv, K, blocks, nb)) == 0);
        drive(s, kv, 100000, logits_buf);
        if (with_tier) whole = (specs[K].n_prompt + o.n[K] - 1) / 16 * 16;
        /* another user takes the whole pool: the cached blocks leave it */
        int n_all = kn_kv_available(mem);
        int32_t *all = malloc((size_t)n_all * sizeof *all);
        TH_REQUIRE(all && kn_kv_alloc(mem, n_all, all) == 0);
        TH_CHECK(kn_kv_cache_get_stats(kn_kv_mem_cache(mem)).cached == 0);
        for (int i = 0; i < n_all; i++) /* scribble: only the tier still holds turn 1's KV */
            memset((char *)kv->k[0] + (size_t)all[i] * kv->block_bytes, 0x7f, kv->block_bytes);
        kn_kv_free(mem, n_all, all);
        free(all);
        p = params_of(T);
        TH_REQUIRE(dc_sched_submit_transfer(s, &p, &blocks, &nb, &nc) == 0);
        dc_sched_stats st = dc_sched_get_stats(s);
        if (!with_tier) {
            TH_CHECKF(nc == 0, "no tier: %d positions shared", nc);
            TH_CHECK(dc_sched_transfer_end(s, T, DC_FINISH_CANCELLED) == 0);
        } else {
            TH_CHECKF(nc == whole && nc > 0, "turn 2 from the tier: %d positions, expected %d", nc,
                      whole);
            TH_CHECK(st.tier_reads == (uint64_t)nc / 16 && st.tier_hits == (uint64_t)nc);
            int32_t first = fake_prefill_from(kv, T, blocks, nb, nc);
            TH_REQUIRE(first >= 0 && dc_sched_transfer_done(s, T, first) == 0);
            drive(s, kv, 100000, logits_buf);
            TH_CHECKF(o.n[T] == cold.n[T] && !memcmp(o.ids[T], cold.ids[T], 4 * (size_t)o.n[T]),
                      "turn 2 with %d positions from the tier differs from cold", nc);
            TH_CHECK(o.cached[T] == nc);
        }
        TH_CHECK(kn_kv_available(mem) == kv->n_blocks && dc_sched_idle(s));
        dc_sched_destroy(s);
        kn_kv_mem_destroy(mem);
    }
}

/* The step time the ITL test pretends to measure (ms): 2 + 1 per decode row + 0.1 per
 * prefill token (decode rows are the batch's solo rows). */
static double fake_ms(const kn_batch *b)
{
    return 2.0 + 1.0 * b->n_solo + 0.1 * (b->n_tokens - b->n_solo);
}

typedef struct {
    int mixed;          /* steps with decode rows and prefill tokens */
    double max_ms;      /* the slowest of them after the first three (the fit warming up) */
    int min_pf, max_pf; /* their prefill tokens */
    uint64_t capped;    /* stats.prefill_capped */
} itl_result;

/* Four short requests (greedy) start one step apart; at step 12, while they decode, a
 * 190-token prompt arrives. Every step's fake time is observed. */
static void run_itl(double target, outputs *o, itl_result *res)
{
    memset(o, 0, sizeof *o);
    *res = (itl_result){.min_pf = 1 << 30};
    static int32_t prompts[5][190];
    kn_kv_mem *mem;
    kn_kv_pool_params kp = kn_model_kv_params(model, 256, 16, TD_F32);
    TH_REQUIRE(kn_kv_mem_create(&kp, &mem) == 0);
    kn_kv_pool *kv = kn_kv_mem_pool(mem);
    dc_sched *s;
    dc_sched_params sp = {.max_running = 16, .step_tokens = 512, .itl_target_ms = target};
    TH_REQUIRE(dc_sched_create(&sp, model, mem, (dc_sink){.ctx = o, .on_tokens = on_tokens}, &s) ==
               0);
    for (int step = 0; step < 1000 && (step < 13 || !dc_sched_idle(s)); step++) {
        if (step < 4 || step == 12) {
            int i = step < 4 ? step : 4;
            dc_request_params p = {.id = (uint64_t)i,
                                   .prompt = prompts[i],
                                   .n_prompt = i < 4 ? 8 + 20 * i : 190,
                                   .max_tokens = i < 4 ? 40 : 4};
            for (int j = 0; j < p.n_prompt; j++)
                prompts[i][j] = (int32_t)((j * 7919 + i * 104729) % model->hp.n_vocab);
            TH_REQUIRE(dc_sched_submit(s, &p) == 0);
        }
        dc_step st;
        int n = dc_sched_plan(s, &st);
        TH_REQUIRE(n >= 0);
        if (n == 0) continue;
        dc_sched_commit(s, logits_buf, kn_engine_forward(engine, kv, &st.batch, logits_buf));
        double ms = fake_ms(&st.batch);
        dc_sched_observe(s, ms);
        int pf = st.batch.n_tokens - st.batch.n_solo;
        if (!st.batch.n_solo || !pf) continue;
        if (++res->mixed > 3 && ms > res->max_ms) res->max_ms = ms;
        if (pf < res->min_pf) res->min_pf = pf;
        if (pf > res->max_pf) res->max_pf = pf;
    }
    res->capped = dc_sched_get_stats(s).prefill_capped;
    TH_CHECK(dc_sched_idle(s));
    dc_sched_destroy(s);
    kn_kv_mem_destroy(mem);
}

static void test_itl_target(void)
{
    outputs free_run, capped, least;
    itl_result rf, rc, rl;
    run_itl(0, &free_run, &rf);
    run_itl(12, &capped, &rc);
    run_itl(0.5, &least, &rl); /* below the decode-only step: the minimum chunk */
    fprintf(stderr,
            "  uncapped: %d mixed steps, prefill %d..%d, slowest %.1f ms; target 12 ms: %d, "
            "%d..%d, %.1f ms; target 0.5 ms: %d, %d..%d\n",
            rf.mixed, rf.min_pf, rf.max_pf, rf.max_ms, rc.mixed, rc.min_pf, rc.max_pf, rc.max_ms,
            rl.mixed, rl.min_pf, rl.max_pf);
    TH_CHECKF(rf.max_pf >= 190 && rf.capped == 0, "uncapped: the prompt in one step (%d)",
              rf.max_pf);
    TH_CHECKF(rc.max_ms <= 12 * 1.1, "target 12 ms: a step took %.1f ms", rc.max_ms);
    TH_CHECKF(rc.min_pf >= 1 && rc.max_pf < 190 && rc.capped > 0,
              "target 12 ms: prefill %d..%d per step", rc.min_pf, rc.max_pf);
    TH_CHECKF(rl.max_pf == DC_SCHED_MIN_PREFILL && rl.mixed >= 190 / DC_SCHED_MIN_PREFILL,
              "target 0.5 ms: prefill at most %d per step, %d steps", rl.max_pf, rl.mixed);
    for (int i = 0; i < 5; i++) {
        TH_CHECKF(capped.finals[i] == 1 && least.finals[i] == 1, "req %d: final events", i);
        TH_CHECKF(capped.n[i] == free_run.n[i] && least.n[i] == free_run.n[i] &&
                      !memcmp(capped.ids[i], free_run.ids[i], sizeof(int32_t) * capped.n[i]) &&
                      !memcmp(least.ids[i], free_run.ids[i], sizeof(int32_t) * least.n[i]),
                  "req %d: other tokens with the cap", i);
    }
}

/* ---- the step cost model (dc_plan.h) ---- */

/* A world whose step takes 40 ms + 7.5 ms a solo row (decode or verification) + 3.8 ms a
 * prefill token + 2e-4 ms an attention pair, +-3 % noise: the phases of a colocated node
 * serving one request, then sixteen (the shapes of tools/bench_spec.py's run). */
static double world_ms(const dc_step_shape *s, uint64_t *rng)
{
    *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
    double noise = 1 + 0.06 * ((double)(*rng >> 11) / (double)(1ull << 53) - 0.5);
    return (40 + 7.5 * (s->n_decode + s->n_draft) + 3.8 * s->n_prefill + 2e-4 * s->attn) * noise;
}

static bool cost_near(double got, double want, double tol, const char *what)
{
    bool ok = fabs(got - want) <= tol * want;
    TH_CHECKF(ok, "%s: %.2f ms predicted, %.2f ms true", what, got, want);
    return ok;
}

static void cost_step(dc_cost *c, dc_step_shape s, uint64_t *rng)
{
    dc_cost_observe(c, &s, world_ms(&s, rng));
    for (int i = 0; i < DC_COST_N; i++)
        TH_CHECKF(c->theta[i] >= 0, "coefficient %d negative: %g", i, c->theta[i]);
}

static void test_cost_model(void)
{
    dc_cost c;
    dc_cost_init(&c, &model->hp);
    uint64_t rng = 7;
    dc_step_shape one = {.n_decode = 1, .attn = 300}, sixteen = {.n_decode = 16, .attn = 4800};
    /* a prompt of 47 tokens, then its decode alone: every step one row (the per-row cost and
     * the intercept cannot be told apart, the step itself must be predicted) */
    cost_step(&c, (dc_step_shape){.n_prefill = 47, .attn = 47 * 48 / 2}, &rng);
    for (int i = 0; i < 30; i++)
        cost_step(&c, (dc_step_shape){.n_decode = 1, .attn = 48 + i}, &rng);
    cost_near(dc_cost_predict(&c, &one), 47.56, 0.05, "one row, one-row steps only");
    /* speculation tried: 0..8 verification rows beside the row determine the per-row cost */
    for (int i = 0; i < 40; i++)
        cost_step(&c, (dc_step_shape){.n_decode = 1, .n_draft = (i * 5) % 9, .attn = 100 + i},
                  &rng);
    cost_near(dc_cost_predict(&c, &one), 47.56, 0.05, "one row");
    cost_near(dc_cost_draft_ms(&c, 300), 7.56, 0.2, "a verification row at batch 1");
    /* sixteen prompts of 512 tokens in chunks beside the first decodes, then sixteen decodes
     * with many verifications, then without */
    for (int i = 0; i < 6; i++)
        cost_step(&c, (dc_step_shape){.n_decode = i, .n_prefill = 512, .attn = 512 * 513 / 2},
                  &rng);
    for (int i = 0; i < 12; i++)
        cost_step(&c, (dc_step_shape){.n_decode = 16, .n_draft = 80 - 6 * i, .attn = 5000}, &rng);
    for (int i = 0; i < 60; i++)
        cost_step(&c, (dc_step_shape){.n_decode = 16, .attn = 4800}, &rng);
    double before = dc_cost_predict(&c, &sixteen);
    cost_near(before, 40 + 16 * 7.5 + 0.96, 0.05, "sixteen rows");
    cost_near(dc_cost_draft_ms(&c, 300), 7.56, 0.2, "a verification row at batch 16");
    /* one step stalled by the host (2 s): the fit moves little */
    dc_cost_observe(&c, &sixteen, 2000);
    double after = dc_cost_predict(&c, &sixteen);
    TH_CHECKF(after < before * 1.1, "a 2 s stall moved the 16-row step from %.1f to %.1f ms",
              before, after);
    /* a real change (every step now twice as long) is followed, the clipping notwithstanding,
     * as fast as the forgetting lets go of the old steps (0.98^120: 9 % of their weight left) */
    for (int i = 0; i < 120; i++) {
        dc_step_shape s = {.n_decode = 16, .n_draft = i % 3 ? 0 : 8, .attn = 4800};
        dc_cost_observe(&c, &s, 2 * world_ms(&s, &rng));
    }
    cost_near(dc_cost_predict(&c, &sixteen), 2 * (40 + 16 * 7.5 + 0.96), 0.1,
              "sixteen rows, the machine twice as slow");
}

/* The start of a run on a model of Qwen2.5-1.5B's shapes, the world measured with it (s30, Intel,
 * the first request of a batch-1 run): a first prefill of 47 tokens at 579 ms (the start's
 * assumed rate predicts 2468), then one-row decode steps of 48.5 ms. The steps cannot tell the
 * intercept from the per-row cost, and the start must leave a verification row cheap enough to
 * be tried (a proposal at the start's chance, 0.6, taken by the choice): with one prior weight
 * for all coefficients the prefill's pulled the intercept to 0, the row cost rose to 45 ms and
 * that run's first request never speculated. */
static double draft_row_ms(const void *ctx, int32_t pos)
{
    return dc_cost_draft_ms(ctx, pos);
}

static void test_cost_start(void)
{
    const kn_hparams hp = {.n_embd = 1536,
                           .n_head = 12,
                           .head_dim = 128,
                           .n_head_kv = 2,
                           .n_layer = 28,
                           .n_ff = 8960,
                           .n_vocab = 151936};
    dc_cost c;
    dc_cost_init(&c, &hp);
    dc_step_shape pf = {.n_prefill = 47, .attn = 1128};
    dc_cost_observe(&c, &pf, 579);
    dc_step_shape one = {.n_decode = 1};
    for (int i = 0; i < 40; i++) {
        one.attn = 48 + i;
        dc_cost_observe(&c, &one, 48.5);
        for (int k = 0; k < DC_COST_N; k++)
            TH_CHECKF(c.theta[k] >= 0, "coefficient %d negative: %g", k, c.theta[k]);
    }
    const double t = dc_cost_predict(&c, &one), r = dc_cost_draft_ms(&c, 600);
    cost_near(t, 48.5, 0.05, "a one-row step after the start");
    TH_CHECKF(0.6 * t > r, "a verification row predicted at %.1f ms beside a %.1f ms step", r, t);
    dc_spec_cand cand = {.accept = 0.6, .cont = 0.6, .n_cand = 8, .pos0 = 600};
    dc_spec_choose(&cand, 1, 1, t, draft_row_ms, &c, 0);
    TH_CHECKF(cand.take >= 1, "the start's chance took %d of 8 proposals", cand.take);
}

/* ---- speculative decoding (dc_spec.h) ---- */

static double flat_ms(const void *ctx, int32_t pos)
{
    (void)pos;
    return *(const double *)ctx;
}

static void test_spec_units(void)
{
    int32_t out[8];
    /* the suffix [7 8] occurred twice: the most recent occurrence's continuation wins */
    int32_t t1[] = {7, 8, 1, 2, 3, 7, 8, 4, 5, 6, 9, 7, 8};
    TH_CHECK(dc_spec_ngram(t1, 13, 2, 4, 3, out) == 3 && out[0] == 4 && out[1] == 5 && out[2] == 6);
    /* a longer match beats a more recent shorter one: [3 7 8] matches only at 2..4 */
    int32_t t2[] = {3, 7, 8, 1, 2, 9, 7, 8, 5, 3, 7, 8};
    TH_CHECK(dc_spec_ngram(t2, 12, 2, 4, 8, out) == 8 && out[0] == 1 && out[1] == 2);
    /* the continuation stops at the end of the tokens: [5 5 5] proposes one 5 (the
     * occurrence ending one before the end) */
    int32_t t3[] = {1, 5, 5, 5};
    TH_CHECK(dc_spec_ngram(t3, 4, 2, 4, 4, out) == 1 && out[0] == 5);
    /* no earlier occurrence of the last ngram_min tokens, too short, k 0 */
    int32_t t4[] = {1, 2, 3, 4, 5};
    TH_CHECK(dc_spec_ngram(t4, 5, 2, 4, 4, out) == 0);
    TH_CHECK(dc_spec_ngram(t4, 2, 2, 4, 4, out) == 0);
    TH_CHECK(dc_spec_ngram(t1, 13, 2, 4, 0, out) == 0);
    TH_CHECK(dc_spec_ngram(t1, 13, 1, 1, 2, out) == 2 && out[0] == 4 && out[1] == 5);

    /* acceptance estimates: accepted ones raise it, a rejected one lowers it, steps without
     * proposals bring it back toward the start */
    dc_spec_req q;
    dc_spec_req_init(&q);
    double a0 = q.accept;
    dc_spec_req_observe(&q, 4, 4);
    TH_CHECK(q.accept > a0);
    for (int i = 0; i < 20; i++)
        dc_spec_req_observe(&q, 4, 0);
    double low = q.accept;
    TH_CHECK(low < 0.1);
    dc_spec_req_observe(&q, 0, 0);
    TH_CHECK(q.accept > low && q.accept < a0);
    /* runs: every other verification all right, the others wrong from the first: the first
     * proposal's chance about a half, a later one's (after a right one) near 1, so the 8th
     * is nearly as likely as the first (one chance for all, a^8, would say 0.6 %) */
    dc_spec_req_init(&q);
    for (int i = 0; i < 40; i++)
        dc_spec_req_observe(&q, 8, i % 2 ? 8 : 0);
    TH_CHECKF(q.accept > 0.35 && q.accept < 0.65 && q.cont > 0.95, "runs: %.3f, %.3f", q.accept,
              q.cont);
    /* a rejection after three accepted: three trials of the later ones, one failed */
    dc_spec_req_init(&q);
    double c0 = q.cont;
    dc_spec_req_observe(&q, 8, 3);
    TH_CHECK(q.accept > a0);
    double c_ok = c0 + (1 - c0) * 0.125;
    c_ok += (1 - c_ok) * 0.125;
    c_ok -= c_ok * 0.125;
    TH_CHECKF(fabs(q.cont - c_ok) < 1e-12, "cont %.6f, expected %.6f", q.cont, c_ok);

    /* choice: a row costing 1 ms beside a 10 ms step of one decode row pays while p * ms >
     * tokens: with 0.5 the first (0.5 * 10 > 1) and second (0.25 * 11 > 1.5) do, the third
     * (0.125 * 12 < 1.75) not */
    double row = 1.0;
    dc_spec_cand c[2] = {{.accept = 0.5, .cont = 0.5, .n_cand = 8},
                         {.accept = 0.9, .cont = 0.9, .n_cand = 2}};
    dc_spec_choose(c, 1, 1, 10, flat_ms, &row, 0);
    TH_CHECKF(c[0].take == 2, "took %d", c[0].take);
    /* two requests: the likelier ones first, up to what each has */
    dc_spec_choose(c, 2, 2, 10, flat_ms, &row, 0);
    TH_CHECKF(c[1].take == 2 && c[0].take >= 1 && c[0].take < 2, "took %d, %d", c[0].take,
              c[1].take);
    /* a large batch: verification rows cost as much as what they may add */
    dc_spec_choose(c, 2, 64, 40, flat_ms, &row, 0);
    TH_CHECK(c[0].take == 0 && c[1].take == 0);
    /* a draft model's pass (4 ms) per proposal depth: alone, a request with 0.9 takes 3
     * (0.9 * 10 > 5, 0.81 * 15 > 1.9 * 5, 0.729 * 20 > 2.71 * 5, 0.656 * 25 < 3.44 * 5) */
    dc_spec_cand d[3] = {{.accept = 0.9, .cont = 0.9, .n_cand = 8},
                         {.accept = 0.9, .cont = 0.9, .n_cand = 8},
                         {.accept = 0.2, .cont = 0.2, .n_cand = 8}};
    dc_spec_choose(d, 1, 1, 10, flat_ms, &row, 4);
    TH_CHECKF(d[0].take == 3, "alone with passes: took %d", d[0].take);
    /* two such requests in a 10 ms step share each pass: one's first proposal alone would
     * not pay (0.9 * 10 < 2 * 5), both together do (1.8 * 10 > 2 * 6), then the second depth
     * (1.62 * 16 > 3.8 * 6), not the third (1.458 * 22 < 5.42 * 6) */
    dc_spec_choose(d, 2, 2, 10, flat_ms, &row, 4);
    TH_CHECKF(d[0].take == 2 && d[1].take == 2, "two with passes: took %d, %d", d[0].take,
              d[1].take);
    /* an unlikely third (0.2 a ms of its row, below the step's rate) rides none of them */
    dc_spec_choose(d, 3, 3, 12, flat_ms, &row, 4);
    TH_CHECKF(d[0].take == 2 && d[1].take == 2 && d[2].take == 0,
              "two with passes: took %d, %d, %d", d[0].take, d[1].take, d[2].take);
}

/* One step of a batch of 16 decode rows through the gate: a plain step takes 10 ms; one
 * with speculation generates 20 tokens in allowed_ms. Returns whether it was allowed. */
static bool gate_step(dc_spec_gate *g, double allowed_ms)
{
    bool allow = dc_spec_gate_allow(g, 16);
    dc_spec_gate_observe(g, allow ? allowed_ms : 10, allow ? 20 : 16);
    return allow;
}

/* The measured gate: held off at a batch size where speculation's time per token is worse,
 * allowed again once it is better, probed at the rates dc_spec.h gives, each batch size
 * apart, not moved by a first slow step; off, every step allows. */
static void test_spec_gate(void)
{
    dc_spec_gate g;
    dc_spec_gate_init(&g, true);
    const int b16 = dc_spec_gate_bucket(16);
    TH_CHECK(b16 == 4 && dc_spec_gate_bucket(1) == 0 && dc_spec_gate_bucket(3) == 1 &&
             dc_spec_gate_bucket(1000) == DC_SPEC_GATE_BUCKETS - 1);
    /* 20 tokens in 15 ms: 0.75 ms a token against 0.625 without. Allowed until the held-off
     * probes have DC_SPEC_GATE_MIN_OBS steps, then held, probed one step in 8 */
    int allowed = 0;
    for (int i = 0; i < 256; i++)
        allowed += gate_step(&g, 15);
    const int before = DC_SPEC_GATE_PROBE * DC_SPEC_GATE_MIN_OBS;
    TH_CHECKF(g.held[b16] &&
                  allowed == before - DC_SPEC_GATE_MIN_OBS + (256 - before) / DC_SPEC_GATE_PROBE,
              "a losing batch size: %d of 256 steps allowed", allowed);
    TH_CHECKF(g.held_steps == (uint64_t)(256 - allowed - DC_SPEC_GATE_MIN_OBS), "held %llu",
              (unsigned long long)g.held_steps);
    /* batch 1 is its own: still allowed */
    TH_CHECK(dc_spec_gate_allow(&g, 1));
    dc_spec_gate_observe(&g, 5, 2);
    /* speculation pays again (20 tokens in 6 ms): the probes see it and the gate opens */
    int first = -1;
    for (int i = 0; i < 64 && first < 0; i++)
        if (!g.held[b16])
            first = i;
        else
            gate_step(&g, 6);
    TH_CHECKF(first >= 0 && first <= 4 * DC_SPEC_GATE_PROBE, "opened after %d steps", first);
    /* far apart (0.3 against 0.625 ms a token): probed once in DC_SPEC_GATE_PROBE_FAR */
    for (int i = 0; i < 64; i++)
        gate_step(&g, 6);
    int held = 0;
    for (int i = 0; i < 4 * DC_SPEC_GATE_PROBE_FAR; i++)
        held += !gate_step(&g, 6);
    TH_CHECKF(held == 4, "far apart: %d of %d steps held off", held, 4 * DC_SPEC_GATE_PROBE_FAR);
    /* a first step of 10x (a warm-up) does not hold off a way that pays */
    dc_spec_gate_init(&g, true);
    TH_CHECK(gate_step(&g, 60));
    for (int i = 0; i < 64; i++)
        gate_step(&g, 6);
    TH_CHECKF(!g.held[b16], "held after a slow first step (%.3f against %.3f ms a token)",
              g.ms_tok[b16][1], g.ms_tok[b16][0]);
    /* a skipped probe (its time held a proposer's catch-up): the next step of its batch size
     * speculates in its place and is the one measured; a skipped held step changes nothing */
    dc_spec_gate_init(&g, true);
    for (int i = 0; i < 256; i++)
        gate_step(&g, 15); /* held, as above */
    TH_REQUIRE(g.held[b16]);
    int i = 0;
    while (!dc_spec_gate_allow(&g, 16) && i++ < 64)
        dc_spec_gate_observe(&g, 10, 16);
    const double was = g.ms_tok[b16][1];
    const uint32_t n_was = g.n_obs[b16][1];
    dc_spec_gate_skip(&g); /* the probe: not measured */
    TH_CHECK(g.ms_tok[b16][1] == was && g.n_obs[b16][1] == n_was);
    TH_CHECK(dc_spec_gate_allow(&g, 16)); /* its stand-in */
    dc_spec_gate_observe(&g, 15, 20);
    TH_CHECK(g.n_obs[b16][1] == n_was + 1);
    TH_CHECK(!dc_spec_gate_allow(&g, 16)); /* held again */
    dc_spec_gate_skip(&g);
    TH_CHECK(!dc_spec_gate_allow(&g, 16) && g.reprobe < 0);
    dc_spec_gate_observe(&g, 10, 16);
    /* off: always allowed, nothing measured */
    dc_spec_gate_init(&g, false);
    for (int i = 0; i < 64; i++)
        TH_CHECK(gate_step(&g, 100));
    TH_CHECK(!g.held_steps);
}

/* Requests N_REQ.. N_REQ + N_LONG - 1: long greedy generations (a random model's text
 * falls into loops, which prompt lookup predicts), as alone without speculation. */
#define N_LONG 6
static outputs long_alone;

/* Request NEXT_TURN: the next turn of request N_REQ's conversation (its prompt, 40 tokens it
 * generated, 3 more), whose prefix the cache holds once N_REQ ran. */
#define NEXT_TURN 30

static void check_long(const outputs *o, const char *what)
{
    for (int i = N_REQ; i < N_REQ + N_LONG; i++)
        TH_CHECKF(o->n[i] == long_alone.n[i] &&
                      !memcmp(o->ids[i], long_alone.ids[i], sizeof(int32_t) * o->n[i]),
                  "%s: long request %d differs from alone", what, i);
}

static void setup_long(void)
{
    for (int i = N_REQ; i < N_REQ + N_LONG; i++) {
        specs[i].n_prompt = 24 + 8 * (i - N_REQ);
        for (int j = 0; j < specs[i].n_prompt; j++)
            specs[i].prompt[j] = (int32_t)((j % (3 + i - N_REQ)) * 37 + i) % model->hp.n_vocab;
        specs[i].max_tokens = 60;
        specs[i].temperature = i % 2 ? 0.7f : 0.0f;
        specs[i].seed = 77 + (uint64_t)i;
        outputs o;
        run(&i, 1, 256, 64, &o, NULL);
        memcpy(long_alone.ids[i], o.ids[i], sizeof o.ids[i]);
        long_alone.n[i] = o.n[i];
    }
    req_spec *t = &specs[NEXT_TURN];
    *t = specs[N_REQ];
    memcpy(t->prompt + t->n_prompt, long_alone.ids[N_REQ], 40 * sizeof(int32_t));
    t->n_prompt += 40;
    for (int j = 0; j < 3; j++)
        t->prompt[t->n_prompt++] = 5 + j;
    t->max_tokens = 20;
    int i = NEXT_TURN;
    outputs o;
    run(&i, 1, 256, 64, &o, NULL);
    memcpy(long_alone.ids[i], o.ids[i], sizeof o.ids[i]);
    long_alone.n[i] = o.n[i];
}

/* Every request's tokens with speculation as without (greedy and seeded sampling alike),
 * with proposals really verified and accepted. */
static void test_spec_equals_alone(void)
{
    setup_long();
    int all[N_REQ + N_LONG];
    for (int i = 0; i < N_REQ + N_LONG; i++)
        all[i] = i;
    const dc_spec_params modes[] = {
        {.method = DC_SPEC_NGRAM, .max_tokens = 4, .pinned = true, .ngram_min = 1},
        {.method = DC_SPEC_NGRAM, .max_tokens = 8, .pinned = true},
        {.method = DC_SPEC_NGRAM}, /* adaptive, defaults */
    };
    for (size_t m = 0; m < sizeof modes / sizeof *modes; m++) {
        spec = modes[m];
        outputs o;
        dc_sched_stats st;
        int steps = run(all, N_REQ + N_LONG, 256, 64, &o, &st);
        fprintf(stderr,
                "  speculation (max %d, ngram_min %d, %s): %d steps, %llu verifications, "
                "%llu proposals, %llu accepted\n",
                spec.max_tokens, spec.ngram_min, spec.pinned ? "pinned" : "adaptive", steps,
                (unsigned long long)st.spec_drafts, (unsigned long long)st.spec_draft_tokens,
                (unsigned long long)st.spec_accepted);
        check_same_as_alone(&o, N_REQ, "speculation");
        check_long(&o, "speculation");
        uint64_t pos_sum = 0;
        for (int j = 0; j < DC_SPEC_MAX_TOKENS; j++)
            pos_sum += st.spec_accepted_pos[j];
        TH_CHECK(pos_sum == st.spec_accepted && st.spec_accepted <= st.spec_draft_tokens);
        /* single-token matches propose often enough that some are accepted whatever the
         * machine's kernels make of the random model */
        if (spec.ngram_min == 1) TH_CHECK(st.spec_drafts > 0 && st.spec_accepted > 0);
    }
    /* logprobs: with every row solo, each token's (a verification row's too) are those of
     * the request alone without speculation, bit for bit */
    static outputs saved;
    saved = alone;
    spec = (dc_spec_params){0};
    deterministic = true;
    compute_alone(N_REQ + N_LONG);
    spec = modes[0];
    outputs o;
    dc_sched_stats st;
    run(all, N_REQ + N_LONG, 256, 64, &o, &st);
    check_same_as_alone(&o, N_REQ + N_LONG, "speculation, logprobs");
    TH_CHECK(st.spec_accepted > 0);
    deterministic = false;
    alone = saved;
    spec = (dc_spec_params){0};
}

/* A proposer that knows the future (each request's tokens alone, from `alone`): all its
 * proposals are right, except, for every third request, the second of each step's. */
typedef struct {
    int calls, keeps, drops;
} oracle;

static int oracle_propose(void *ctx, int n, const uint64_t *ids, const int32_t *const *toks,
                          const int32_t *n_toks, const int *k, int32_t *const *out, int *n_out)
{
    oracle *o = ctx;
    o->calls++;
    for (int i = 0; i < n; i++) {
        int id = (int)ids[i], g = n_toks[i] - specs[id].n_prompt; /* tokens generated */
        TH_CHECK(g >= 1 &&
                 !memcmp(toks[i] + specs[id].n_prompt, alone.ids[id], (size_t)g * sizeof(int32_t)));
        n_out[i] = 0;
        for (int j = 0; j < k[i] && g + j < alone.n[id]; j++)
            out[i][n_out[i]++] = alone.ids[id][g + j] ^ (id % 3 == 0 && j == 1);
    }
    return 0;
}

static void oracle_keep(void *ctx, uint64_t id, const int32_t *toks, int32_t n)
{
    (void)id;
    (void)toks;
    (void)n;
    ((oracle *)ctx)->keeps++;
}

static void oracle_drop(void *ctx, uint64_t id)
{
    (void)id;
    ((oracle *)ctx)->drops++;
}

/* The proposer interface (DC_SPEC_DRAFT): proposals that are right are all accepted (the
 * bonus token after them too), a wrong one ends its request's step there; each request is
 * dropped once it ends. */
static void test_spec_proposer(void)
{
    int all[N_REQ];
    for (int i = 0; i < N_REQ; i++)
        all[i] = i;
    oracle orc = {0};
    spec = (dc_spec_params){
        .method = DC_SPEC_DRAFT,
        .max_tokens = 3,
        .pinned = true,
        .proposer = {
            .ctx = &orc, .propose = oracle_propose, .keep = oracle_keep, .drop = oracle_drop}};
    outputs o;
    dc_sched_stats st;
    int steps = run(all, N_REQ, 256, 64, &o, &st);
    spec = (dc_spec_params){0};
    fprintf(stderr, "  oracle: %d steps, %llu verifications, %llu proposals, %llu accepted\n",
            steps, (unsigned long long)st.spec_drafts, (unsigned long long)st.spec_draft_tokens,
            (unsigned long long)st.spec_accepted);
    check_same_as_alone(&o, N_REQ, "oracle proposals");
    /* kept: each verification of a request that goes on */
    TH_CHECK(orc.calls > 0 && orc.keeps > 0 && orc.keeps <= (int)st.spec_drafts);
    TH_CHECKF(orc.drops == N_REQ, "%d drops", orc.drops);
    /* every wrong proposal is the second of its step: a step of such a request accepts one */
    TH_CHECK(st.spec_accepted_pos[0] == st.spec_drafts);
    TH_CHECK(st.spec_accepted > st.spec_draft_tokens / 2);
}

/* A proposer like a draft model in disaggregated mode: its first call for a request catches up
 * the request's prompt (no proposals, stale_tokens says how many tokens), later calls propose as
 * the oracle does. */
typedef struct {
    oracle o;
    bool seen[N_REQ];
    int64_t far; /* the last call's */
} far_oracle;

static int far_propose(void *ctx, int n, const uint64_t *ids, const int32_t *const *toks,
                       const int32_t *n_toks, const int *k, int32_t *const *out, int *n_out)
{
    far_oracle *f = ctx;
    int rc = oracle_propose(&f->o, n, ids, toks, n_toks, k, out, n_out);
    f->far = 0;
    for (int i = 0; i < n; i++)
        if (!f->seen[ids[i]]) {
            f->seen[ids[i]] = true;
            f->far += n_toks[i];
            n_out[i] = 0;
        }
    return rc;
}

static int64_t stale_tokens(void *ctx)
{
    return ((far_oracle *)ctx)->far;
}

/* The measured gate beside a proposer's catch-up of far requests: such a step holds a draft's
 * prefill (here 400 ms against 10 for a plain step), and measured as a speculating step it
 * makes the gate hold speculation off although every other speculating step pays (10 ms + 1
 * a verification row, its proposals right); with stale_tokens the scheduler measures neither
 * the gate nor the cost model on it, and speculation stays on. Requests one after another
 * (batch 1, the disaggregated case). */
static void run_far(bool tell, dc_sched_stats *st)
{
    int ids[10] = {1, 2, 4, 5, 7, 8, 10, 11, 13, 14}; /* not every third: proposals right */
    far_oracle f = {0};
    dc_spec_params sp = {.method = DC_SPEC_DRAFT,
                         .max_tokens = 4,
                         .gate = true,
                         .proposer = {.ctx = &f,
                                      .propose = far_propose,
                                      .keep = oracle_keep,
                                      .drop = oracle_drop,
                                      .stale_tokens = tell ? stale_tokens : NULL}};
    kn_kv_mem *mem;
    kn_kv_pool_params kp = kn_model_kv_params(model, 256, 16, TD_F32);
    TH_REQUIRE(kn_kv_mem_create(&kp, &mem) == 0);
    kn_kv_pool *kv = kn_kv_mem_pool(mem);
    dc_sched *s;
    outputs o;
    memset(&o, 0, sizeof o);
    dc_sched_params p = {.max_running = 16, .step_tokens = 64, .spec = sp};
    TH_REQUIRE(dc_sched_create(&p, model, mem, (dc_sink){.ctx = &o, .on_tokens = on_tokens}, &s) ==
               0);
    for (int i = 0; i < 10; i++) {
        dc_request_params rp = params_of(ids[i]);
        TH_REQUIRE(dc_sched_submit(s, &rp) == 0);
        while (!dc_sched_idle(s)) {
            dc_step step;
            int n = dc_sched_plan(s, &step);
            TH_REQUIRE(n > 0);
            int pf = (int)(step.batch.n_tokens - step.batch.n_solo);
            int64_t far = f.far;
            f.far = 0; /* one step's */
            dc_sched_commit(s, logits_buf, kn_engine_forward(engine, kv, &step.batch, logits_buf));
            dc_sched_observe(s, far ? 400.0 : pf ? 10.0 + pf : 10.0 + (double)(n - 1));
        }
    }
    *st = dc_sched_get_stats(s);
    dc_sched_destroy(s);
    kn_kv_mem_destroy(mem);
    for (int i = 0; i < 10; i++) {
        int id = ids[i];
        TH_CHECKF(o.n[id] == alone.n[id] &&
                      !memcmp(o.ids[id], alone.ids[id], sizeof(int32_t) * (size_t)o.n[id]),
                  "far catch-up: req %d differs from alone", id);
    }
}

static void test_spec_far_not_measured(void)
{
    dc_sched_stats told, not_told;
    run_far(true, &told);
    run_far(false, &not_told);
    fprintf(stderr,
            "  far catch-up told: %llu verifications, %llu held steps; not told: %llu, %llu\n",
            (unsigned long long)told.spec_drafts, (unsigned long long)told.spec_held_steps,
            (unsigned long long)not_told.spec_drafts, (unsigned long long)not_told.spec_held_steps);
    TH_CHECK(told.spec_held_steps == 0 && told.spec_drafts > 0);
    TH_CHECK(not_told.spec_held_steps > 0);
}

/* Speculation under pool pressure (preemption; proposals never preempt) and for requests
 * whose prompt KV arrived by transfer, with the prefix cache: still every token as alone. */
static void test_spec_pressure_and_transfer(void)
{
    int all[N_REQ + N_LONG];
    for (int i = 0; i < N_REQ + N_LONG; i++)
        all[i] = i;
    spec =
        (dc_spec_params){.method = DC_SPEC_NGRAM, .max_tokens = 6, .pinned = true, .ngram_min = 1};
    outputs o;
    dc_sched_stats st;
    run(all, N_REQ + N_LONG, 14, 48, &o, &st);
    TH_CHECK(st.preemptions > 0 && st.spec_accepted > 0);
    check_same_as_alone(&o, N_REQ, "speculation, small pool");
    check_long(&o, "speculation, small pool");
    /* the next turn reads the blocks verification rows wrote for the turn before */
    pc_on = pc_one_by_one = true;
    int turns[2] = {N_REQ, NEXT_TURN};
    run(turns, 2, 64, 64, &o, &st);
    pc_on = pc_one_by_one = false;
    TH_CHECKF(st.prefix_hits >= 48 && st.spec_accepted > 0, "%llu hits, %llu accepted",
              (unsigned long long)st.prefix_hits, (unsigned long long)st.spec_accepted);
    for (int k = 0; k < 2; k++)
        TH_CHECKF(
            o.n[turns[k]] == long_alone.n[turns[k]] &&
                !memcmp(o.ids[turns[k]], long_alone.ids[turns[k]], sizeof(int32_t) * o.n[turns[k]]),
            "speculation, prefix cache: request %d differs from alone", turns[k]);
    transfer_all(256, "speculation, transferred");
    transfer_all(14, "speculation, transferred, small pool");
    spec = (dc_spec_params){0};
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: test_sched MODEL.gguf\n");
        return 2;
    }
    char err[256];
    kn_shard sh = {0};
    if (td_gguf_open(argv[1], &gguf, err, sizeof err) || kn_model_load(gguf, &sh, &model) ||
        kn_cpu_create(2, &cpu) || kn_engine_create(model, kn_cpu_backend(cpu), NULL, &engine)) {
        fprintf(stderr, "cannot set up the engine for %s\n", argv[1]);
        return 1;
    }
    /* a step's logit rows: 16 running requests with up to 32 proposals each, or a prefill */
    logits_buf = malloc((size_t)16 * (1 + DC_SPEC_MAX_TOKENS) * model->hp.n_vocab * sizeof(float));
    uint64_t x = 12345;
    for (int i = 0; i < N_REQ; i++) {
        specs[i].n_prompt = 3 + (i * 37) % 90;
        for (int j = 0; j < specs[i].n_prompt; j++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            specs[i].prompt[j] = (int32_t)((x >> 33) % (uint64_t)model->hp.n_vocab);
        }
        specs[i].max_tokens = 4 + (i * 11) % 20;
        specs[i].temperature = i % 3 == 0 ? 0.0f : 0.9f;
        specs[i].seed = 1000 + (uint64_t)i;
    }
    compute_alone(N_REQ);
    TH_RUN(test_concurrent_equals_alone);
    TH_RUN(test_thread_limit);
    TH_RUN(test_thread_choice);
    TH_RUN(test_pool_pressure);
    TH_RUN(test_refuse_and_cancel);
    TH_RUN(test_stop_ids);
    TH_RUN(test_plan_round_trip);
    TH_RUN(test_solo_rows);
    TH_RUN(test_transfer_equals_colocated);
    TH_RUN(test_transfer_edges);
    TH_RUN(test_prefix_cache);
    TH_RUN(test_transfer_prefix);
    TH_RUN(test_transfer_tier);
    TH_RUN(test_itl_target);
    TH_RUN(test_cost_model);
    TH_RUN(test_cost_start);
    TH_RUN(test_spec_units);
    TH_RUN(test_spec_gate);
    TH_RUN(test_spec_equals_alone);
    TH_RUN(test_spec_pressure_and_transfer);
    TH_RUN(test_spec_proposer);
    TH_RUN(test_spec_far_not_measured);
    free(logits_buf);
    kn_engine_destroy(engine);
    kn_cpu_destroy(cpu);
    kn_model_destroy(model);
    td_gguf_close(gguf);
    TH_EXIT();
}
