/* test_draft.c: a draft model as the decode scheduler's proposer (decode-node/dc_draft.h) on
 * synthetic models. The target as its own draft proposes what greedy decoding samples: every
 * proposal is accepted; another model of the same vocabulary (qwen2.gguf) proposes worse:
 * some are rejected. Either way, and with a draft pool too small for some requests (which
 * then get no proposals) or a target pool small enough to preempt, every request's tokens
 * are those without speculation, greedy and seeded. Direct calls: proposals are the same
 * after keep rolled a request back, for a fresh request, and with catch-up cut into small
 * passes; keep gives blocks back, drop all of them; a token the draft cannot read gets no
 * proposals. A draft of another vocabulary is refused at create.
 * The target's own MTP block (deepseek2-mtp*.gguf as the target) as the proposer: the same
 * tokens as without speculation, an oracle block's proposals nearly all accepted, and a direct
 * call's first proposal that of one pass of the block over the prompt.
 * usage: test_draft SYNTH_DIR (its llama.gguf, qwen2.gguf, deepseek2-mtp.gguf and
 *        deepseek2-mtp-echo.gguf)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../tharness.h"
#include "cpu_backend.h"
#include "dc_draft.h"
#include "dc_sched.h"
#include "gguf.h"
#include "kv_mem.h"
#include "model.h"
#include "td_err.h"

#define N_REQ   10
#define MAX_OUT 48

typedef struct {
    int32_t ids[N_REQ][MAX_OUT];
    int n[N_REQ];
    int finals[N_REQ];
} outputs;

static void on_tokens(void *ctx, uint64_t id, const int32_t *ids, int n,
                      const td_logprob_entry *lps, dc_finish finish, int32_t n_prompt,
                      int32_t n_gen, int32_t n_cached)
{
    outputs *o = ctx;
    for (int i = 0; i < n && o->n[id] < MAX_OUT; i++)
        o->ids[id][o->n[id]++] = ids[i];
    if (finish != DC_FINISH_NONE) o->finals[id]++;
    (void)lps;
    (void)n_prompt;
    (void)n_gen;
    (void)n_cached;
}

static char dir[1024];
static td_gguf *gguf;
static kn_model *model;
static kn_cpu *cpu;
static kn_engine *engine;
static float *logits;

typedef struct {
    int32_t prompt[100];
    int n_prompt, max_tokens;
    float temperature;
} req_spec;
static req_spec specs[N_REQ];
static outputs off; /* every request without speculation */

/* A draft of file name on a backend of its own (dc_draft.h: a destroyed draft's weights stay
 * registered with its backend), kv_tokens of KV, catch-up passes of chunk tokens. */
typedef struct {
    kn_cpu *cpu;
    dc_draft *d;
} draft_rig;

static int rig_open(draft_rig *r, const char *name, int64_t kv_tokens, int chunk)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    memset(r, 0, sizeof *r);
    if (kn_cpu_create(2, &r->cpu)) return -1;
    dc_draft_params p = {.path = path,
                         .be = kn_cpu_backend(r->cpu),
                         .target = model,
                         .target_gguf = gguf,
                         .kv_tokens = kv_tokens,
                         .kv_type = TD_F32,
                         .chunk_tokens = chunk};
    return dc_draft_create(&p, &r->d);
}

static void rig_close(draft_rig *r)
{
    dc_draft_destroy(r->d);
    kn_cpu_destroy(r->cpu);
    memset(r, 0, sizeof *r);
}

/* Every request at once through a scheduler with spec (a pool of n_blocks of 16 tokens)
 * until idle; the scheduler's figures in st. */
static void run(const dc_spec_params *spec, int n_blocks, outputs *o, dc_sched_stats *st)
{
    memset(o, 0, sizeof *o);
    kn_kv_mem *mem;
    kn_kv_pool_params kp = kn_model_kv_params(model, n_blocks, 16, TD_F32);
    TH_REQUIRE(kn_kv_mem_create(&kp, &mem) == 0);
    dc_sched_params sp = {.max_running = 16, .step_tokens = 48, .spec = *spec};
    dc_sched *s;
    TH_REQUIRE(dc_sched_create(&sp, model, mem, (dc_sink){.ctx = o, .on_tokens = on_tokens}, &s) ==
               0);
    for (int i = 0; i < N_REQ; i++) {
        dc_request_params p = {.id = (uint64_t)i,
                               .prompt = specs[i].prompt,
                               .n_prompt = specs[i].n_prompt,
                               .sampling = {.temperature = specs[i].temperature,
                                            .top_k = 20,
                                            .seed = 500 + (uint64_t)i},
                               .max_tokens = specs[i].max_tokens};
        TH_REQUIRE(dc_sched_submit(s, &p) == 0);
    }
    for (int steps = 0; !dc_sched_idle(s) && steps < 10000; steps++) {
        dc_step step;
        int n = dc_sched_plan(s, &step);
        TH_REQUIRE(n > 0);
        dc_sched_commit(s, logits,
                        kn_engine_forward(engine, kn_kv_mem_pool(mem), &step.batch, logits));
    }
    TH_CHECK(dc_sched_idle(s));
    *st = dc_sched_get_stats(s);
    dc_sched_destroy(s);
    kn_kv_mem_destroy(mem);
}

static void check_same(const outputs *o, const char *what)
{
    for (int i = 0; i < N_REQ; i++)
        TH_CHECKF(o->finals[i] == 1 && o->n[i] == off.n[i] &&
                      !memcmp(o->ids[i], off.ids[i], sizeof(int32_t) * (size_t)o->n[i]),
                  "%s: req %d: %d tokens, %d without speculation", what, i, o->n[i], off.n[i]);
}

static const dc_spec_params PINNED = {.method = DC_SPEC_DRAFT, .max_tokens = 4, .pinned = true};

/* The target as its own draft: greedy requests accept every proposal. */
static void test_self_draft(void)
{
    float t[N_REQ];
    for (int i = 0; i < N_REQ; i++)
        t[i] = specs[i].temperature, specs[i].temperature = 0;
    outputs greedy_off, o;
    dc_sched_stats st;
    run(&(dc_spec_params){0}, 256, &greedy_off, &st);
    draft_rig r;
    TH_REQUIRE(rig_open(&r, "llama.gguf", 256 * 16, 0) == 0);
    dc_spec_params sp = PINNED;
    sp.proposer = dc_draft_proposer(r.d);
    run(&sp, 256, &o, &st);
    for (int i = 0; i < N_REQ; i++)
        specs[i].temperature = t[i];
    for (int i = 0; i < N_REQ; i++)
        TH_CHECKF(o.n[i] == greedy_off.n[i] &&
                      !memcmp(o.ids[i], greedy_off.ids[i], sizeof(int32_t) * (size_t)o.n[i]),
                  "self draft, greedy: req %d differs", i);
    dc_draft_stats ds = dc_draft_get_stats(r.d);
    fprintf(stderr,
            "  self draft: %llu proposed, %llu accepted, %llu verifications; draft %llu "
            "passes, %llu rows\n",
            (unsigned long long)st.spec_draft_tokens, (unsigned long long)st.spec_accepted,
            (unsigned long long)st.spec_drafts, (unsigned long long)ds.passes,
            (unsigned long long)ds.rows);
    TH_CHECK(st.spec_draft_tokens > 0 && st.spec_accepted == st.spec_draft_tokens);
    TH_CHECK(ds.proposals >= st.spec_draft_tokens && ds.refused == 0);
    TH_CHECK(dc_draft_blocks_used(r.d) == 0);
    /* seeded sampling too: the same tokens as without speculation */
    run(&sp, 256, &o, &st);
    check_same(&o, "self draft, sampled");
    TH_CHECK(st.spec_accepted > 0 && dc_draft_blocks_used(r.d) == 0);
    rig_close(&r);
}

/* Another model of the same vocabulary: worse proposals, the same tokens. Then under
 * pressure: a target pool that preempts, a draft pool that cannot hold every request. */
static void test_other_draft(void)
{
    draft_rig r;
    TH_REQUIRE(rig_open(&r, "qwen2.gguf", 256 * 16, 0) == 0);
    dc_spec_params sp = PINNED;
    sp.proposer = dc_draft_proposer(r.d);
    outputs o;
    dc_sched_stats st;
    run(&sp, 256, &o, &st);
    check_same(&o, "qwen2 draft");
    fprintf(stderr, "  qwen2 draft: %llu proposed, %llu accepted\n",
            (unsigned long long)st.spec_draft_tokens, (unsigned long long)st.spec_accepted);
    TH_CHECK(st.spec_draft_tokens > 0 && st.spec_accepted < st.spec_draft_tokens);
    TH_CHECK(dc_draft_blocks_used(r.d) == 0);
    run(&sp, 14, &o, &st);
    check_same(&o, "qwen2 draft, small target pool");
    TH_CHECK(st.preemptions > 0 && dc_draft_blocks_used(r.d) == 0);
    rig_close(&r);

    /* 6 blocks of draft KV: the longer requests do not fit beside the others */
    TH_REQUIRE(rig_open(&r, "llama.gguf", 6 * 16, 0) == 0);
    sp.proposer = dc_draft_proposer(r.d);
    run(&sp, 256, &o, &st);
    check_same(&o, "small draft pool");
    dc_draft_stats ds = dc_draft_get_stats(r.d);
    TH_CHECKF(ds.refused > 0 && st.spec_accepted > 0, "%llu refused, %llu accepted",
              (unsigned long long)ds.refused, (unsigned long long)st.spec_accepted);
    TH_CHECK(dc_draft_blocks_used(r.d) == 0);
    rig_close(&r);
}

/* One request's proposals by a direct call; its count returned. */
static int propose1(dc_spec_proposer *pp, uint64_t id, const int32_t *toks, int32_t n, int k,
                    int32_t *out)
{
    int n_out = -1;
    int32_t *outs[1] = {out};
    const int32_t *ts[1] = {toks};
    int rc = pp->propose(pp->ctx, 1, &id, ts, &n, &k, outs, &n_out);
    TH_CHECKF(rc == 0, "propose: %s", td_strerror(rc));
    return n_out;
}

static void test_direct_calls(void)
{
    int32_t toks[60], p0[6], p1[6], p2[6], p3[6];
    for (int i = 0; i < 60; i++)
        toks[i] = (i * 37 + 11) % model->hp.n_vocab;
    draft_rig r, small;
    TH_REQUIRE(rig_open(&r, "llama.gguf", 64 * 16, 0) == 0);
    TH_REQUIRE(rig_open(&small, "llama.gguf", 64 * 16, 7) == 0);
    dc_spec_proposer pp = dc_draft_proposer(r.d), ps = dc_draft_proposer(small.d);
    /* 40 tokens from nothing: caught up, no proposals yet (a prompt's prefill) */
    TH_CHECK(propose1(&pp, 1, toks, 40, 5, p0) == 0);
    /* then 5 proposals: its last token fed again; KV of 44 positions, 3 blocks */
    TH_CHECK(propose1(&pp, 1, toks, 40, 5, p0) == 5);
    TH_CHECK(dc_draft_blocks_used(r.d) == 3);
    /* the target kept 10 of them: the draft gives back what follows */
    pp.keep(pp.ctx, 1, toks, 10);
    TH_CHECK(dc_draft_blocks_used(r.d) == 1);
    TH_CHECK(propose1(&pp, 1, toks, 40, 5, p1) == 5 && !memcmp(p0, p1, sizeof p0[0] * 5));
    /* its own proposals accepted: the same as a fresh request computing them all */
    memcpy(toks + 40, p0, 3 * sizeof *toks);
    TH_CHECK(propose1(&pp, 1, toks, 43, 3, p1) == 3);
    TH_CHECK(propose1(&pp, 2, toks, 43, 3, p2) == 0 && propose1(&pp, 2, toks, 43, 3, p2) == 3);
    TH_CHECK(!memcmp(p1, p2, sizeof p1[0] * 3) && !memcmp(p1, p0 + 3, sizeof p1[0] * 2));
    /* catch-up in passes of 7 tokens, 7 a call while far behind: 43 tokens held 7, then 14,
     * then (29 to go: near) all of them and the proposals */
    TH_CHECK(propose1(&ps, 1, toks, 43, 3, p3) == 0 && dc_draft_blocks_used(small.d) == 3);
    TH_CHECK(propose1(&ps, 1, toks, 43, 3, p3) == 0);
    TH_CHECK(propose1(&ps, 1, toks, 43, 3, p3) == 3);
    TH_CHECK(!memcmp(p1, p3, sizeof p1[0] * 3));
    /* a short prompt proposes at once */
    TH_CHECK(propose1(&pp, 4, toks, 20, 2, p2) == 2);
    /* a prompt's prefill chunk (colocated) is caught up as the target computes it: its first
     * call proposes at once, as a request caught up by calls does */
    TH_REQUIRE(pp.computed != NULL && pp.n_hidden == 0);
    int used = dc_draft_blocks_used(r.d);
    pp.computed(pp.ctx, 5, 0, 40, NULL, toks, 40);
    TH_CHECK(dc_draft_blocks_used(r.d) == used + 3);
    TH_CHECK(propose1(&pp, 5, toks, 40, 5, p3) == 5 && !memcmp(p0, p3, sizeof p0[0] * 5));
    pp.computed(pp.ctx, 6, 0, 20, NULL, toks, 20); /* short: left to the calls */
    TH_CHECK(dc_draft_blocks_used(r.d) == used + 3);
    /* a token it cannot embed: no proposals, no error */
    toks[5] = model->hp.n_vocab + 3;
    TH_CHECK(propose1(&pp, 3, toks, 20, 2, p2) == 0);
    TH_CHECK(dc_draft_get_stats(r.d).refused == 1);
    pp.drop(pp.ctx, 1);
    pp.drop(pp.ctx, 2);
    pp.drop(pp.ctx, 3);
    pp.drop(pp.ctx, 4);
    pp.drop(pp.ctx, 5);
    pp.drop(pp.ctx, 99); /* unknown: nothing */
    ps.drop(ps.ctx, 1);
    TH_CHECK(dc_draft_blocks_used(r.d) == 0 && dc_draft_blocks_used(small.d) == 0);
    rig_close(&r);
    rig_close(&small);
}

/* A copy of llama.gguf whose first token's string differs in one byte: the key
 * "tokenizer.ggml.tokens", then the value's type (u32 array), element type (u32 string),
 * count (u64) and the first string (u64 length, bytes). */
static int write_other_vocab(const char *out)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/llama.gguf", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)size);
    int ok = buf && fread(buf, 1, (size_t)size, f) == (size_t)size;
    fclose(f);
    static const char key[] = "tokenizer.ggml.tokens";
    const size_t kl = sizeof key - 1;
    char *at = NULL;
    for (long i = 8; ok && !at && i + (long)kl + 32 < size; i++) {
        uint64_t l;
        memcpy(&l, buf + i - 8, 8);
        if (l == kl && !memcmp(buf + i, key, kl)) at = buf + i + kl + 4 + 4 + 8;
    }
    uint64_t len = 0;
    if (at) memcpy(&len, at, 8);
    if (len) at[8] ^= 0x20;
    f = len ? fopen(out, "wb") : NULL;
    ok = f && fwrite(buf, 1, (size_t)size, f) == (size_t)size;
    if (f) ok &= fclose(f) == 0;
    free(buf);
    return ok ? 0 : -1;
}

static void test_other_vocab_refused(void)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/other-vocab-%d.gguf", P_tmpdir, (int)getpid());
    TH_REQUIRE(write_other_vocab(path) == 0);
    kn_cpu *c;
    TH_REQUIRE(kn_cpu_create(1, &c) == 0);
    dc_draft_params p = {.path = path,
                         .be = kn_cpu_backend(c),
                         .target = model,
                         .target_gguf = gguf,
                         .kv_tokens = 256};
    dc_draft *d = NULL;
    TH_CHECK(dc_draft_create(&p, &d) == TD_EINVAL && !d);
    unlink(path);
    /* and a missing file, bad parameters */
    p.path = "/nonexistent/draft.gguf";
    TH_CHECK(dc_draft_create(&p, &d) < 0 && !d);
    p.path = path;
    p.kv_tokens = 0;
    TH_CHECK(dc_draft_create(&p, &d) == TD_EINVAL && !d);
    kn_cpu_destroy(c);
}

/* ---- the target's own MTP block (dc_draft_params.mtp) ---- */

/* The test's target (the globals run() uses) replaced by file name, prompts folded into its
 * vocabulary; restored by target_close. */
typedef struct {
    td_gguf *g;
    kn_model *m;
    kn_cpu *cpu;
    kn_engine *e;
    td_gguf *saved_g;
    kn_model *saved_m;
    kn_engine *saved_e;
    req_spec saved_specs[N_REQ];
    outputs saved_off;
} target_rig;

static int target_open(target_rig *t, const char *name)
{
    char path[1200], err[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    memset(t, 0, sizeof *t);
    kn_shard sh = {0};
    if (td_gguf_open(path, &t->g, err, sizeof err) || kn_model_load(t->g, &sh, &t->m) ||
        kn_cpu_create(2, &t->cpu) || kn_engine_create(t->m, kn_cpu_backend(t->cpu), NULL, &t->e)) {
        fprintf(stderr, "cannot set up the engine for %s\n", path);
        return -1;
    }
    t->saved_g = gguf, t->saved_m = model, t->saved_e = engine;
    memcpy(t->saved_specs, specs, sizeof specs);
    t->saved_off = off;
    gguf = t->g, model = t->m, engine = t->e;
    for (int i = 0; i < N_REQ; i++)
        for (int j = 0; j < specs[i].n_prompt; j++)
            specs[i].prompt[j] %= model->hp.n_vocab;
    dc_sched_stats st;
    run(&(dc_spec_params){0}, 256, &off, &st);
    return 0;
}

static void target_close(target_rig *t)
{
    gguf = t->saved_g, model = t->saved_m, engine = t->saved_e;
    memcpy(specs, t->saved_specs, sizeof specs);
    off = t->saved_off;
    kn_engine_destroy(t->e);
    kn_cpu_destroy(t->cpu);
    kn_model_destroy(t->m);
    td_gguf_close(t->g);
}

static int mtp_open(draft_rig *r, int64_t kv_tokens)
{
    memset(r, 0, sizeof *r);
    if (kn_cpu_create(2, &r->cpu)) return -1;
    dc_draft_params p = {.mtp = true,
                         .be = kn_cpu_backend(r->cpu),
                         .target = model,
                         .target_gguf = gguf,
                         .kv_tokens = kv_tokens,
                         .kv_type = TD_F32};
    return dc_draft_create(&p, &r->d);
}

/* The requests through the MTP block of file name: the tokens without speculation, greedy
 * and seeded, in a roomy pool and in one that preempts; its acceptance in *acc (of 1). */
static void mtp_exact(const char *name, double *acc)
{
    target_rig t;
    TH_REQUIRE(target_open(&t, name) == 0);
    draft_rig r;
    TH_REQUIRE(mtp_open(&r, 256 * 16) == 0);
    dc_spec_params sp = PINNED;
    sp.proposer = dc_draft_proposer(r.d);
    outputs o;
    dc_sched_stats st;
    run(&sp, 256, &o, &st);
    check_same(&o, name);
    TH_CHECK(st.spec_draft_tokens > 0 && dc_draft_blocks_used(r.d) == 0);
    /* acceptance of greedy requests (a sampled one's token is a draw the argmax often misses) */
    float temp[N_REQ];
    outputs greedy_off;
    for (int i = 0; i < N_REQ; i++)
        temp[i] = specs[i].temperature, specs[i].temperature = 0;
    run(&(dc_spec_params){0}, 256, &greedy_off, &st);
    run(&sp, 256, &o, &st);
    for (int i = 0; i < N_REQ; i++) {
        specs[i].temperature = temp[i];
        TH_CHECKF(o.n[i] == greedy_off.n[i] &&
                      !memcmp(o.ids[i], greedy_off.ids[i], sizeof(int32_t) * (size_t)o.n[i]),
                  "%s, greedy: req %d differs", name, i);
    }
    *acc = st.spec_draft_tokens ? (double)st.spec_accepted / (double)st.spec_draft_tokens : 0;
    fprintf(stderr, "  %s MTP block, greedy: %llu proposed, %llu accepted (%.0f %%)\n", name,
            (unsigned long long)st.spec_draft_tokens, (unsigned long long)st.spec_accepted,
            100.0 * *acc);
    run(&sp, 14, &o, &st);
    check_same(&o, "MTP block, small target pool");
    TH_CHECK(st.preemptions > 0 && dc_draft_blocks_used(r.d) == 0);
    rig_close(&r);
    target_close(&t);
}

/* The oracle block (make_synth.py deepseek2-mtp-echo: it copies the target's first layer, the
 * target's others add next to nothing) proposes what the target samples: nearly all accepted.
 * A random block (deepseek2-mtp) proposes worse: the same tokens either way. */
static void test_mtp_exact(void)
{
    double acc_echo, acc_random;
    mtp_exact("deepseek2-mtp-echo.gguf", &acc_echo);
    mtp_exact("deepseek2-mtp.gguf", &acc_random);
    TH_CHECKF(acc_echo > 0.8 && acc_echo > acc_random, "echo %.2f, random %.2f", acc_echo,
              acc_random);
}

/* A direct call gives the block's first proposal after a prompt as one pass of the block over
 * the prompt does (tandem logits --mtp, which tests/ref checks against the numpy reference):
 * rows (token p, the target's hidden state of p - 1) from the hidden states the target gave
 * through the proposer's hidden(); then keep and drop give every block back. A target without
 * an MTP block is refused. */
static void test_mtp_direct(void)
{
    target_rig t;
    TH_REQUIRE(target_open(&t, "deepseek2-mtp.gguf") == 0);
    /* 60 positions: the proposer catches them up in hidden() already (a prompt's chunk) */
    const int64_t E = model->hp.n_embd, n = 60;
    int32_t toks[70], pos[70], seq_of[70] = {0};
    float *hid = malloc((size_t)(n + 1) * (size_t)E * sizeof *hid);
    float *lg = malloc((size_t)model->hp.n_vocab * sizeof *lg);
    TH_REQUIRE(hid && lg);
    for (int i = 0; i < n; i++)
        toks[i] = (i * 37 + 11) % model->hp.n_vocab, pos[i] = i;
    /* the target over the prompt: its hidden states and its greedy next token */
    kn_kv_mem *mem;
    kn_kv_pool_params kp = kn_model_kv_params(model, 8, 16, TD_F32);
    TH_REQUIRE(kn_kv_mem_create(&kp, &mem) == 0);
    kn_kv_seq seq;
    kn_kv_seq_init(&seq);
    TH_REQUIRE(kn_kv_seq_reserve(mem, &seq, n) == 0);
    kn_seq_view view = {.block_table = seq.blocks, .n_ctx = (int32_t)n};
    int32_t last = (int32_t)n - 1;
    kn_batch b = {.n_tokens = n,
                  .tokens = toks,
                  .pos = pos,
                  .seq_of = seq_of,
                  .n_seqs = 1,
                  .seqs = &view,
                  .n_logits = 1,
                  .logit_rows = &last,
                  .hidden_out = hid + E};
    TH_REQUIRE(kn_engine_forward(engine, kn_kv_mem_pool(mem), &b, lg) == 0);
    toks[n] = kn_argmax(lg, model->hp.n_vocab);
    pos[n] = (int32_t)n;
    /* the proposer, fed those hidden states */
    draft_rig r;
    TH_REQUIRE(mtp_open(&r, 64 * 16) == 0);
    dc_spec_proposer pp = dc_draft_proposer(r.d);
    TH_REQUIRE(pp.computed && pp.n_hidden == E);
    pp.computed(pp.ctx, 7, 0, (int32_t)n, hid + E, toks, (int32_t)n);
    TH_CHECK(dc_draft_blocks_used(r.d) == 4); /* positions 0..59 caught up */
    int32_t prop[4];
    TH_CHECK(propose1(&pp, 7, toks, (int32_t)n + 1, 3, prop) == 3);
    /* the block in one pass over rows 0..n (row 0 reads zeros) */
    kn_model *bm;
    kn_engine *be;
    kn_kv_mem *bmem;
    /* the block is no trunk layer (block_count counts it), and it loads whole only */
    TH_CHECK(model->hp.n_layer_nextn == 1 && model->shard.l1 == model->hp.n_layer);
    TH_CHECK(kn_model_load(gguf, &(kn_shard){.mtp = true, .tp_size = 2}, &bm) == TD_EINVAL);
    TH_REQUIRE(kn_model_load(gguf, &(kn_shard){.mtp = true}, &bm) == 0);
    TH_CHECK(bm->shard.l0 == model->hp.n_layer && bm->first && bm->last);
    TH_REQUIRE(kn_engine_create(bm, kn_cpu_backend(t.cpu), NULL, &be) == 0);
    kn_kv_pool_params bp = kn_model_kv_params(bm, 8, 16, TD_F32);
    TH_REQUIRE(bp.n_layers == 1 && kn_kv_mem_create(&bp, &bmem) == 0);
    kn_kv_seq bseq;
    kn_kv_seq_init(&bseq);
    TH_REQUIRE(kn_kv_seq_reserve(bmem, &bseq, n + 1) == 0);
    memset(hid, 0, (size_t)E * sizeof *hid);
    kn_seq_view bview = {.block_table = bseq.blocks, .n_ctx = (int32_t)n + 1};
    int32_t blast = (int32_t)n;
    float *own = malloc((size_t)(n + 1) * (size_t)E * sizeof *own);
    TH_REQUIRE(own != NULL);
    kn_batch bb = {.n_tokens = n + 1,
                   .tokens = toks,
                   .embd = hid,
                   .pos = pos,
                   .seq_of = seq_of,
                   .n_seqs = 1,
                   .seqs = &bview,
                   .n_logits = 1,
                   .logit_rows = &blast,
                   .hidden_out = own};
    TH_REQUIRE(kn_engine_forward(be, kn_kv_mem_pool(bmem), &bb, lg) == 0);
    TH_CHECKF(prop[0] == kn_argmax(lg, model->hp.n_vocab), "proposal %d, the block's argmax %d",
              prop[0], kn_argmax(lg, model->hp.n_vocab));
    /* the chain: each next row reads the block's own hidden state of the row before */
    for (int j = 1; j < 3; j++) {
        int32_t tk = prop[j - 1], ps = (int32_t)n + j, zero = 0;
        TH_REQUIRE(kn_kv_seq_reserve(bmem, &bseq, ps + 1) == 0);
        bview = (kn_seq_view){.block_table = bseq.blocks, .n_ctx = ps + 1};
        /* the row before's own hidden state: own[n] after the pass, then own[j - 1 & 1] */
        float *h_prev = own + (j == 1 ? n : (j - 1) % 2) * E, *h_out = own + (j % 2) * E;
        kn_batch cb = {.n_tokens = 1,
                       .tokens = &tk,
                       .embd = h_prev,
                       .pos = &ps,
                       .seq_of = &zero,
                       .n_seqs = 1,
                       .seqs = &bview,
                       .n_logits = 1,
                       .logit_rows = &zero,
                       .hidden_out = h_out};
        TH_REQUIRE(kn_engine_forward(be, kn_kv_mem_pool(bmem), &cb, lg) == 0);
        TH_CHECKF(prop[j] == kn_argmax(lg, model->hp.n_vocab),
                  "proposal %d: %d, the chained block's argmax %d", j, prop[j],
                  kn_argmax(lg, model->hp.n_vocab));
    }
    free(own);
    /* the target kept the prompt and its token only: the chained proposals' KV (computed from
     * the block's own hidden states) goes */
    pp.keep(pp.ctx, 7, toks, (int32_t)n + 1);
    TH_CHECK(dc_draft_blocks_used(r.d) == 4); /* 61 positions: four blocks of 16 */
    pp.drop(pp.ctx, 7);
    TH_CHECK(dc_draft_blocks_used(r.d) == 0);
    kn_kv_seq_fini(bmem, &bseq);
    kn_kv_mem_destroy(bmem);
    kn_engine_destroy(be);
    kn_model_destroy(bm);
    rig_close(&r);
    kn_kv_seq_fini(mem, &seq);
    kn_kv_mem_destroy(mem);
    free(hid);
    free(lg);
    target_close(&t);
    /* llama.gguf has no MTP block */
    TH_CHECK(mtp_open(&r, 256) == TD_EINVAL && !r.d);
    kn_cpu_destroy(r.cpu);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: test_draft SYNTH_DIR\n");
        return 2;
    }
    snprintf(dir, sizeof dir, "%s", argv[1]);
    char path[1200], err[256];
    snprintf(path, sizeof path, "%s/llama.gguf", dir);
    kn_shard sh = {0};
    if (td_gguf_open(path, &gguf, err, sizeof err) || kn_model_load(gguf, &sh, &model) ||
        kn_cpu_create(2, &cpu) || kn_engine_create(model, kn_cpu_backend(cpu), NULL, &engine)) {
        fprintf(stderr, "cannot set up the engine for %s\n", path);
        return 1;
    }
    logits = malloc((size_t)16 * (1 + DC_SPEC_MAX_TOKENS) * model->hp.n_vocab * sizeof(float));
    uint64_t x = 777;
    for (int i = 0; i < N_REQ; i++) {
        specs[i].n_prompt = 3 + (i * 41) % 95;
        for (int j = 0; j < specs[i].n_prompt; j++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            specs[i].prompt[j] = (int32_t)((x >> 33) % (uint64_t)model->hp.n_vocab);
        }
        specs[i].max_tokens = 12 + (i * 7) % 30;
        specs[i].temperature = i % 2 ? 0.9f : 0.0f;
    }
    dc_sched_stats st;
    run(&(dc_spec_params){0}, 256, &off, &st);
    TH_RUN(test_self_draft);
    TH_RUN(test_other_draft);
    TH_RUN(test_direct_calls);
    TH_RUN(test_other_vocab_refused);
    TH_RUN(test_mtp_exact);
    TH_RUN(test_mtp_direct);
    free(logits);
    kn_engine_destroy(engine);
    kn_cpu_destroy(cpu);
    kn_model_destroy(model);
    td_gguf_close(gguf);
    TH_EXIT();
}
