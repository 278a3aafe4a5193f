/* test_engine_device.c: the engine drives a device backend (kn_backend.h: host_memory
 * false) without ever handing it host memory, and gets the same logits.
 *
 * The device is "cpu-dev" (kernels/cpu/cpu_dev.h): the CPU backend behind a device
 * contract, checking every pointer each op is given (its own allocations, or weights it
 * mapped). The KV pool is created in its memory too. The engine runs a chunked prefill,
 * greedy decode and a two-sequence batch on a synthetic model, once on the plain CPU
 * backend and once on cpu-dev: the logits must be bit-identical (same kernels, same thread
 * count) and the violations zero. Then the same at tp 2 (two ranks in two threads, a
 * barrier collective as test_model_split's): cpu-dev's collectives go through host staging
 * (engine_stage.c) and must give cpu's tp 2 logits bit for bit; the bytes staged are
 * counted against what the engine should move. This is the CPU-side proof of the staging a
 * CUDA backend relies on. Two-batch overlap at tp 2 on cpu-dev gives cpu's bits with it.
 * usage: test_engine_device MODEL.gguf
 */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

#include "../tharness.h"
#include "cpu_backend.h"
#include "cpu_dev.h"
#include "kn_backends.h"
#include "kn_test_util.h"
#include "kv_mem.h"
#include "model.h"
#include "td_err.h"

/* ---- one engine + pool on a backend, and the run both backends must agree on ---- */

#define PROMPT 37
#define STEPS  5
#define BLOCK  16

static td_gguf *gguf;
static kn_model *model;
static int64_t rig_tbo; /* rig_open's engines' two-batch overlap (kn_engine_set_tbo), tp > 1 */
static uint64_t tbo_ran; /* forwards run_tp2's rank 0 ran split, summed */

/* An engine and pool on a backend; at tp > 1 the ranks run in threads over a barrier
 * collective (kt_coll, test_model_split.c's too), every rank summing in rank order so all get
 * bit-identical sums. */
typedef struct {
    const kn_model *m;
    kn_backend be;
    kn_engine *eng;
    kn_kv_mem *mem;
    kn_kv_pool *kv; /* mem's pool */
    kn_kv_seq seq[2];
    kt_rank_coll coll;      /* tp > 1 */
    pthread_barrier_t *bar; /* tp > 1: the ranks meet after each forward */
} rig;

/* An engine and pool for model m (a shard when cc is not NULL: rank `rank` of cc->tp). */
static int rig_open(rig *r, const kn_model *m, kn_backend be, kt_coll *cc, int rank)
{
    memset(r, 0, sizeof *r);
    r->m = m;
    r->be = be;
    r->coll = (kt_rank_coll){.cc = cc, .rank = rank};
    r->bar = cc ? &cc->bar : NULL;
    kn_collective coll = {.ctx = &r->coll,
                          .allreduce_sum = kt_allreduce_sum,
                          .gather_cols = kt_gather_cols,
                          .allreduce_post = kt_allreduce_post,
                          .allreduce_wait = kt_allreduce_wait};
    int rc = kn_engine_create(m, be, cc ? &coll : NULL, &r->eng);
    if (rc) return rc;
    if (cc && rig_tbo && (rc = kn_engine_set_tbo(r->eng, rig_tbo))) return rc;
    kn_kv_pool_params kp = kn_model_kv_params(m, 32, BLOCK, TD_F16);
    kp.backend = &r->be;
    if ((rc = kn_kv_mem_create(&kp, &r->mem))) return rc;
    r->kv = kn_kv_mem_pool(r->mem);
    kn_kv_seq_init(&r->seq[0]);
    kn_kv_seq_init(&r->seq[1]);
    return 0;
}

static void rig_close(rig *r)
{
    if (r->mem) {
        kn_kv_seq_fini(r->mem, &r->seq[0]);
        kn_kv_seq_fini(r->mem, &r->seq[1]);
    }
    kn_kv_mem_destroy(r->mem);
    kn_engine_destroy(r->eng);
}

/* tp > 1: every rank waits until rank 0 has written the logits the next step reads */
static void meet(const rig *r)
{
    if (r->bar) pthread_barrier_wait(r->bar);
}

/* Sequence 0 prefilled in chunks of 9 with sequence 1 (a shorter prompt) in the same
 * batches, then STEPS greedy steps of both together (decode rows solo); logits of every
 * step of both sequences into lg ((1 + STEPS) * 2 rows of n_vocab), written by rank 0 and
 * read by every rank. */
static const int32_t len[2] = {PROMPT, PROMPT / 3}; /* the two prompts */

static int decode(rig *r, float *lg);

static int run(rig *r, float *lg)
{
    const int nv = r->m->hp.n_vocab;
    const bool writer = r->coll.rank == 0;
    int32_t tok[2][PROMPT];
    for (int i = 0; i < PROMPT; i++) {
        tok[0][i] = (i * 131 + 7) % nv;
        tok[1][i] = (i * 71 + 3) % nv;
    }
    int done[2] = {0, 0};
    int rc = 0;
    while (!rc && (done[0] < len[0] || done[1] < len[1])) {
        int32_t t[18], pos[18], so[18], rows[2];
        int n = 0, nl = 0;
        for (int s = 0; s < 2; s++)
            for (int k = 0; k < 9 && done[s] < len[s]; k++, done[s]++) {
                t[n] = tok[s][done[s]], pos[n] = done[s], so[n] = s;
                if (done[s] + 1 == len[s]) rows[nl++] = n;
                n++;
            }
        kn_seq_view v[2];
        for (int s = 0; s < 2 && !rc; s++) {
            rc = kn_kv_seq_reserve(r->mem, &r->seq[s], done[s]);
            v[s] = (kn_seq_view){.block_table = r->seq[s].blocks, .n_ctx = done[s]};
        }
        kn_batch b = {.n_tokens = n,
                      .tokens = t,
                      .pos = pos,
                      .seq_of = so,
                      .n_seqs = 2,
                      .seqs = v,
                      .n_logits = nl,
                      .logit_rows = rows};
        float tmp[2 * 512];
        if (!rc) rc = kn_engine_forward(r->eng, r->kv, &b, nl ? tmp : NULL);
        for (int i = 0; i < nl && !rc && writer; i++) {
            int s = so[rows[i]];
            memcpy(lg + (size_t)s * nv, tmp + (size_t)i * nv, (size_t)nv * 4);
        }
        meet(r);
    }
    return rc ? rc : decode(r, lg);
}

/* STEPS greedy steps of both sequences after their prompts (in the pool), from the logits
 * of lg's first two rows on. */
static int decode(rig *r, float *lg)
{
    const int nv = r->m->hp.n_vocab;
    int rc = 0;
    for (int step = 0; step < STEPS && !rc; step++) {
        int32_t t[2], pos[2], so[2] = {0, 1}, rows[2] = {0, 1};
        kn_seq_view v[2];
        for (int s = 0; s < 2 && !rc; s++) {
            const float *l = lg + ((size_t)step * 2 + s) * nv;
            int best = 0;
            for (int i = 1; i < nv; i++)
                if (l[i] > l[best]) best = i;
            t[s] = best;
            pos[s] = len[s] + step;
            rc = kn_kv_seq_reserve(r->mem, &r->seq[s], pos[s] + 1);
            v[s] = (kn_seq_view){.block_table = r->seq[s].blocks, .n_ctx = pos[s] + 1};
        }
        kn_batch b = {.n_tokens = 2,
                      .n_solo = 2,
                      .tokens = t,
                      .pos = pos,
                      .seq_of = so,
                      .n_seqs = 2,
                      .seqs = v,
                      .n_logits = 2,
                      .logit_rows = rows};
        if (!rc) rc = kn_engine_forward(r->eng, r->kv, &b, lg + (size_t)(step + 1) * 2 * nv);
        meet(r);
    }
    return rc;
}

static bool not_degenerate(const float *lg, int nv)
{
    float spread = 0;
    for (int i = 1; i < nv; i++)
        spread = fmaxf(spread, fabsf(lg[i] - lg[0]));
    return spread > 0.1f; /* the comparison means something */
}

static void test_cpudev_equals_cpu(void)
{
    const int nv = model->hp.n_vocab;
    TH_REQUIRE(nv <= 512);
    size_t n = (size_t)(1 + STEPS) * 2 * nv;
    float *a = calloc(n, 4), *b = calloc(n, 4);
    kn_backend cpu, dv;
    TH_REQUIRE(kn_backend_create("cpu", &(kn_backend_options){.n_threads = 2}, &cpu) == 0);
    TH_REQUIRE(kn_backend_create("cpu-dev", &(kn_backend_options){.n_threads = 2}, &dv) == 0);
    TH_CHECK(!dv.ops->host_memory && !strcmp(dv.ops->name, "cpu-dev"));
    rig r1, r2;
    TH_REQUIRE(rig_open(&r1, model, cpu, NULL, 0) == 0);
    TH_REQUIRE(rig_open(&r2, model, dv, NULL, 0) == 0);
    kn_cpudev_stats st;
    char probe[64];
    /* the pool is device memory: reading its last bytes back is no violation */
    TH_CHECK(
        dv.ops->download(dv.ctx, probe, (char *)r2.kv->region + r2.kv->region_bytes - 64, 64) == 0);
    TH_CHECK(run(&r1, a) == 0);
    TH_CHECK(run(&r2, b) == 0);
    TH_REQUIRE(kn_cpudev_stats_of(dv, &st) == 0);
    TH_CHECKF(st.n_violations == 0, "%lld host pointers given to the device backend; first: %s",
              (long long)st.n_violations, st.first);
    TH_CHECK(memcmp(a, b, n * 4) == 0);
    TH_CHECK(not_degenerate(a, nv));
    rig_close(&r1);
    rig_close(&r2);
    TH_REQUIRE(kn_cpudev_stats_of(dv, &st) == 0);
    TH_CHECKF(st.n_mapped > 0, "weights stay mapped until the backend is destroyed");
    TH_CHECKF(st.n_live == 0, "%d device buffers not freed by engine and pool", st.n_live);
    TH_CHECK(kn_cpudev_stats_of(cpu, &st) == TD_EINVAL);
    kn_backend_destroy(&dv);
    kn_backend_destroy(&cpu);
    free(a);
    free(b);
}

/* The checker itself: a host pointer handed to an op is a violation, reported as the
 * asynchronous error of the next synchronize and download. */
static void test_cpudev_catches_host_pointers(void)
{
    kn_backend dv;
    TH_REQUIRE(kn_backend_create("cpu-dev", &(kn_backend_options){.n_threads = 1}, &dv) == 0);
    float host[8] = {0}, back[8];
    float *d = dv.ops->alloc(dv.ctx, sizeof host);
    TH_REQUIRE(d);
    TH_CHECK(dv.ops->upload(dv.ctx, d, host, sizeof host) == 0);
    dv.ops->add(dv.ctx, d, d, 1, 8);
    TH_CHECK(dv.ops->synchronize(dv.ctx) == 0);
    dv.ops->add(dv.ctx, d, host, 1, 8); /* host x */
    dv.ops->add(dv.ctx, d, d, 1, 9);    /* runs past the allocation's end */
    kn_cpudev_stats st;
    TH_REQUIRE(kn_cpudev_stats_of(dv, &st) == 0);
    TH_CHECKF(st.n_violations == 3 && strstr(st.first, "add: x"), "%lld violations, first %s",
              (long long)st.n_violations, st.first);
    TH_CHECK(dv.ops->synchronize(dv.ctx) == TD_ESTATE);
    TH_CHECK(dv.ops->download(dv.ctx, back, d, sizeof back) == TD_ESTATE);
    TH_CHECK(st.n_live == 1 && st.n_upload == 1 && st.bytes_upload == sizeof host);
    dv.ops->free(dv.ctx, d);
    kn_backend_destroy(&dv);
}

/* The KV transfer's path on a device: the prompts' KV computed elsewhere (the cpu rig) lands
 * in a staged pool's host copy, block by block, as kvxfer puts it there; the device engine
 * then decodes from it: the engine uploads exactly the received blocks, once, and the
 * logits equal the cpu run's bit for bit. */
static void test_received_kv_decodes(void)
{
    const int nv = model->hp.n_vocab;
    size_t n = (size_t)(1 + STEPS) * 2 * nv;
    float *a = calloc(n, 4), *b = calloc(n, 4);
    kn_backend cpu, dv;
    TH_REQUIRE(kn_backend_create("cpu", &(kn_backend_options){.n_threads = 2}, &cpu) == 0);
    TH_REQUIRE(kn_backend_create("cpu-dev", &(kn_backend_options){.n_threads = 2}, &dv) == 0);
    rig r1, r2;
    TH_REQUIRE(rig_open(&r1, model, cpu, NULL, 0) == 0);
    TH_REQUIRE(run(&r1, a) == 0);
    memset(&r2, 0, sizeof r2);
    r2.m = model;
    r2.be = dv;
    TH_REQUIRE(kn_engine_create(model, dv, NULL, &r2.eng) == 0);
    kn_kv_pool_params kp = kn_model_kv_params(model, 32, BLOCK, TD_F16);
    kp.backend = &r2.be;
    kp.host_stage = true;
    TH_REQUIRE(kn_kv_mem_create(&kp, &r2.mem) == 0);
    r2.kv = kn_kv_mem_pool(r2.mem);
    int n_blocks = 0;
    const size_t bb = r1.kv->block_bytes;
    for (int s = 0; s < 2; s++) {
        kn_kv_seq_init(&r2.seq[s]);
        TH_REQUIRE(kn_kv_seq_reserve(r2.mem, &r2.seq[s], len[s]) == 0);
        for (int j = 0; j < r2.seq[s].n_blocks; j++, n_blocks++)
            for (int a = 0; a < kn_kv_pool_arrays(r2.kv) * r2.kv->n_layers; a++) {
                const char *src =
                    (char *)kn_kv_pool_array(r1.kv, a) + (size_t)r1.seq[s].blocks[j] * bb;
                size_t off = (size_t)((char *)kn_kv_pool_array(r2.kv, a) - (char *)r2.kv->region);
                memcpy((char *)r2.kv->host + off + (size_t)r2.seq[s].blocks[j] * bb, src, bb);
            }
    }
    memcpy(b, a, (size_t)2 * nv * 4); /* the prompts' last logits: the prefill's answer */
    TH_CHECK(decode(&r2, b) == 0);
    TH_CHECK(memcmp(a, b, n * 4) == 0);
    TH_CHECKF(r2.kv->n_stage_up == (uint64_t)n_blocks, "%llu blocks uploaded, %d received",
              (unsigned long long)r2.kv->n_stage_up, n_blocks);
    kn_cpudev_stats st;
    TH_CHECK(kn_cpudev_stats_of(dv, &st) == 0 && st.n_violations == 0);
    rig_close(&r1);
    rig_close(&r2);
    kn_backend_destroy(&dv);
    kn_backend_destroy(&cpu);
    free(a);
    free(b);
}

/* ---- tp 2: two ranks in two threads ---- */

typedef struct {
    rig r;
    kn_model *m;
    float *lg;
    int rc;
} rank_job;

static void *rank_main(void *v)
{
    rank_job *j = v;
    j->rc = run(&j->r, j->lg);
    return NULL;
}

/* The run at tp 2 on backend `name`: logits into lg (rank 0's), the cpu-dev stats of rank
 * 0 into st when name is cpu-dev. */
static int run_tp2(const char *name, float *lg, kn_cpudev_stats *st)
{
    float *slots[2];
    const float *parts[2];
    kt_coll cc = {.slots = slots, .parts = parts, .tp = 2};
    pthread_barrier_init(&cc.bar, NULL, 2);
    rank_job jobs[2] = {0};
    kn_backend be[2] = {0};
    int rc = 0;
    for (int r = 0; r < 2 && !rc; r++) {
        kn_shard sh = {.l0 = 0, .l1 = model->hp.n_layer, .tp_rank = r, .tp_size = 2};
        rc = kn_model_load(gguf, &sh, &jobs[r].m);
        if (!rc) rc = kn_backend_create(name, &(kn_backend_options){.n_threads = 1}, &be[r]);
        if (!rc) rc = rig_open(&jobs[r].r, jobs[r].m, be[r], &cc, r);
        jobs[r].lg = lg;
    }
    pthread_t th[2];
    for (int r = 0; r < 2 && !rc; r++)
        pthread_create(&th[r], NULL, rank_main, &jobs[r]);
    for (int r = 0; r < 2 && !rc; r++)
        pthread_join(th[r], NULL);
    if (!rc) rc = jobs[0].rc ? jobs[0].rc : jobs[1].rc;
    for (int r = 0; r < 2; r++) {
        if (r == 0 && jobs[r].r.eng) tbo_ran += kn_engine_tbo_count(jobs[r].r.eng);
        rig_close(&jobs[r].r);
        if (r == 0 && st && !rc) rc = kn_cpudev_stats_of(be[0], st); /* engine gone */
        kn_backend_destroy(&be[r]);
        kn_model_destroy(jobs[r].m);
    }
    pthread_barrier_destroy(&cc.bar);
    return rc;
}

/* tp 2 on cpu-dev (collectives staged through host memory) equals tp 2 on cpu bit for bit,
 * and rank 0 downloads exactly what the engine should: per forward and layer, two
 * all-reduces of (tokens, n_embd), plus its logit slices (and per MoE layer the router's
 * logits, (tokens, n_expert)); it uploads as much for the
 * all-reduces, plus the batches' arrays. */
static void test_tp2_cpudev_equals_cpu(void)
{
    const int nv = model->hp.n_vocab;
    size_t n = (size_t)(1 + STEPS) * 2 * nv;
    float *a = calloc(n, 4), *b = calloc(n, 4);
    kn_cpudev_stats st;
    TH_REQUIRE(run_tp2("cpu", a, NULL) == 0);
    TH_REQUIRE(run_tp2("cpu-dev", b, &st) == 0);
    TH_CHECKF(st.n_violations == 0, "first violation: %s", st.first);
    TH_CHECK(memcmp(a, b, n * 4) == 0);
    TH_CHECK(not_degenerate(a, nv));
    const int64_t tokens = PROMPT + PROMPT / 3 + 2 * STEPS, logit_rows = 2 + 2 * STEPS;
    const int64_t vloc = nv / 2; /* kn_split_even: rank 0 holds [0, nv / 2) */
    const int64_t ar = tokens * model->hp.n_layer * 2 * model->hp.n_embd;
    /* a mixture-of-experts layer also downloads its router's logits (its plan goes up) */
    int64_t moe_layers = 0;
    for (int il = 0; il < model->hp.n_layer; il++)
        moe_layers += kn_layer_is_moe(&model->hp, il);
    const int64_t router = tokens * moe_layers * model->hp.n_expert;
    uint64_t want = (uint64_t)(ar + logit_rows * vloc + router) * 4;
    TH_CHECKF(st.bytes_download == want, "rank 0 downloaded %llu bytes, expected %llu",
              (unsigned long long)st.bytes_download, (unsigned long long)want);
    TH_CHECK(st.bytes_upload > (uint64_t)ar * 4);
    TH_CHECKF(st.n_host_live == 0, "%d staging buffers left", st.n_host_live);
    fprintf(stderr,
            "tp 2 cpu-dev rank 0: %llu bytes down, %llu up (%llu of them all-reduces) for %lld "
            "tokens (%d layers, n_embd %d, vocab slice %lld)\n",
            (unsigned long long)st.bytes_download, (unsigned long long)st.bytes_upload,
            (unsigned long long)ar * 4, (long long)tokens, model->hp.n_layer, model->hp.n_embd,
            (long long)vloc);
    free(a);
    free(b);
}

/* Two-batch overlap at tp 2 on cpu-dev: each micro-batch's arrays staged into its engine's
 * memory and its all-reduces posted through host staging, no violation; the logits are the
 * cpu backend's with the overlap bit for bit, and the plain run's within float noise (the
 * prompt batches ran in halves; the decode rows are solo, their bits the plain run's given
 * the same KV). */
static void test_tbo_cpudev(void)
{
    const int nv = model->hp.n_vocab;
    size_t n = (size_t)(1 + STEPS) * 2 * nv;
    float *plain = calloc(n, 4), *a = calloc(n, 4), *b = calloc(n, 4);
    kn_cpudev_stats st;
    TH_REQUIRE(run_tp2("cpu", plain, NULL) == 0);
    rig_tbo = 2;
    tbo_ran = 0;
    TH_REQUIRE(run_tp2("cpu", a, NULL) == 0);
    /* the prompt batches of 18, 12, 9 and 9 rows (the last, 1 row, whole) and every decode
     * step of the two sequences */
    TH_CHECKF(tbo_ran == 4 + STEPS, "%llu forwards split", (unsigned long long)tbo_ran);
    tbo_ran = 0;
    TH_REQUIRE(run_tp2("cpu-dev", b, &st) == 0);
    TH_CHECK(tbo_ran == 4 + STEPS);
    rig_tbo = 0;
    TH_CHECKF(st.n_violations == 0, "first violation: %s", st.first);
    TH_CHECK(memcmp(a, b, n * 4) == 0);
    TH_CHECKF(st.n_host_live == 0, "%d staging buffers left", st.n_host_live);
    float d = 0;
    for (size_t i = 0; i < n; i++)
        d = fmaxf(d, fabsf(a[i] - plain[i]));
    fprintf(stderr, "tp 2 with two-batch overlap: max |dlogit| against the plain run %.3g\n", d);
    TH_CHECK(d < 1e-4f && not_degenerate(a, nv));
    free(plain);
    free(a);
    free(b);
}

/* A device pool with host staging (the KV transfer's): kvxfer sees the host copy (shared
 * memory here), blocks move between it and the device on request, a fresh block is not
 * current on the device until uploaded. A shared pool in device memory without staging
 * and an unknown backend name are refused. */
static void test_staged_pool(void)
{
    kn_backend be;
    TH_REQUIRE(kn_backend_create("cpu-dev", NULL, &be) == 0);
    kn_kv_pool_params kp = kn_model_kv_params(model, 4, BLOCK, TD_F32);
    kp.backend = &be;
    char name[64];
    snprintf(name, sizeof name, "/tandem-test-device-pool-%d", (int)getpid());
    kp.shm_name = name;
    kn_kv_pool *kv = NULL;
    kn_kv_mem *mem = NULL;
    TH_CHECK(kn_kv_pool_create(&kp, &kv) == TD_EINVAL && !kv);
    TH_CHECK(kn_kv_mem_create(&kp, &mem) == TD_EINVAL && !mem);
    kp.host_stage = true;
    TH_REQUIRE(kn_kv_mem_create(&kp, &mem) == 0);
    kv = kn_kv_mem_pool(mem);
    TH_CHECK(kv->host && kn_kv_xfer_region(kv) == kv->host && kv->host != kv->region);
    /* the model's layout: a latent-attention model's pool holds its latent once */
    const bool latent = model->hp.kv_lora_rank > 0;
    TH_CHECK(kv->layout == (latent ? KN_KV_LAYOUT_LATENT : KN_KV_LAYOUT_KV) &&
             (kv->v[0] == kv->k[0]) == latent &&
             kv->region_bytes ==
                 (size_t)(latent ? 1 : 2) * kv->n_layers * kv->n_blocks * kv->block_bytes);
    void *mapped;
    size_t mb;
    TH_CHECK(kn_kv_region_map(&kp, true, &mapped, &mb, NULL) == 0 &&
             mb == kv->region_bytes + (size_t)kv->n_blocks); /* the on_dev flags follow */
    const uint8_t *flags = (const uint8_t *)mapped + kv->region_bytes;
    int32_t ids[2];
    TH_REQUIRE(kn_kv_alloc(mem, 2, ids) == 0);
    TH_CHECK(!kv->on_dev[ids[0]] && !kv->on_dev[ids[1]]);
    /* "received" KV: a pattern in block ids[1] of every layer, through the other mapping */
    const size_t bb = kv->block_bytes;
    float *pat = malloc(bb), *back = malloc(bb);
    for (size_t i = 0; i < bb / 4; i++)
        pat[i] = (float)i * 0.5f;
    for (int a = 0; a < kn_kv_pool_arrays(kv) * kv->n_layers; a++) {
        size_t off = (size_t)((char *)kn_kv_pool_array(kv, a) - (char *)kv->region);
        memcpy((char *)mapped + off + (size_t)ids[1] * bb, pat, bb);
    }
    TH_CHECK(kn_kv_stage_upload(kv, &ids[1], 1) == 0);
    TH_CHECK(kv->on_dev[ids[1]] && !kv->on_dev[ids[0]] && kv->n_stage_up == 1);
    TH_CHECK(flags[ids[1]] == 1 && flags[ids[0]] == 0); /* the mapper sees them */
    int same = 0;
    for (int l = 0; l < kv->n_layers; l++) {
        TH_CHECK(be.ops->download(be.ctx, back, (char *)kv->v[l] + (size_t)ids[1] * bb, bb) == 0);
        same += !memcmp(back, pat, bb);
    }
    TH_CHECK(same == kv->n_layers);
    /* the other way: what the device holds in block ids[0] reaches the host copy */
    for (int l = 0; l < kv->n_layers; l++)
        TH_CHECK(be.ops->upload(be.ctx, (char *)kv->k[l] + (size_t)ids[0] * bb, pat, bb) == 0);
    TH_CHECK(kn_kv_stage_download(kv, &ids[0], 1) == 0);
    size_t off0 = (size_t)((char *)kv->k[kv->n_layers - 1] - (char *)kv->region);
    TH_CHECK(!memcmp((char *)mapped + off0 + (size_t)ids[0] * bb, pat, bb));
    int32_t bad = kv->n_blocks;
    TH_CHECK(kn_kv_stage_upload(kv, &bad, 1) == TD_ERANGE);
    /* a block copy on the device (a prefill stage's copy of a cached last block): ids[1]'s
     * KV, uploaded above, into ids[0], through the backend's own calls */
    TH_CHECK(kn_kv_block_copy(kv, ids[1], ids[0]) == 0);
    same = 0;
    for (int l = 0; l < kv->n_layers; l++) {
        TH_CHECK(be.ops->download(be.ctx, back, (char *)kv->v[l] + (size_t)ids[0] * bb, bb) == 0);
        same += !memcmp(back, pat, bb);
    }
    TH_CHECKF(same == kv->n_layers, "%d of %d layers' V copied on the device", same, kv->n_layers);
    kn_cpudev_stats st;
    TH_CHECK(kn_cpudev_stats_of(be, &st) == 0 && st.n_violations == 0);
    kn_kv_free(mem, 2, ids);
    kn_kv_region_unmap(mapped, mb);
    kn_kv_mem_destroy(mem);
    free(pat);
    free(back);
    /* a host pool has nothing to stage */
    kn_kv_pool_params hp = kn_model_kv_params(model, 4, BLOCK, TD_F32);
    TH_REQUIRE(kn_kv_pool_create(&hp, &kv) == 0);
    TH_CHECK(!kv->host && kn_kv_xfer_region(kv) == kv->region);
    TH_CHECK(kn_kv_stage_upload(kv, ids, 0) == TD_EINVAL);
    kn_kv_pool_destroy(kv);
    kn_backend x;
    TH_CHECK(kn_backend_create("nope", NULL, &x) == TD_EINVAL && !x.ops);
    kn_backend_destroy(&be);
}

/* kn_backend_options.cpu_act (the YAML's cpu_act: f32, q8, q16): sets the mode of cpu and
 * cpu-dev over TANDEM_CPU_ACT, NULL leaves the variable's; a bad value, or one for cuda, is
 * TD_EINVAL */
static void test_cpu_act(void)
{
    const char *names[] = {"cpu", "cpu-dev"};
    for (int k = 0; k < 2; k++) {
        kn_backend b;
        char d[256];
        TH_REQUIRE(setenv("TANDEM_CPU_ACT", "q8", 1) == 0);
        TH_REQUIRE(kn_backend_create(names[k], &(kn_backend_options){.cpu_act = "f32"}, &b) == 0);
        b.ops->describe(b.ctx, d, sizeof d);
        TH_CHECKF(!strstr(d, "q8"), "%s: %s", names[k], d);
        kn_backend_destroy(&b);
        TH_REQUIRE(kn_backend_create(names[k], &(kn_backend_options){0}, &b) == 0);
        b.ops->describe(b.ctx, d, sizeof d);
        TH_CHECKF(strstr(d, "q8 activations"), "%s: %s", names[k], d);
        kn_backend_destroy(&b);
        TH_REQUIRE(unsetenv("TANDEM_CPU_ACT") == 0);
        TH_REQUIRE(kn_backend_create(names[k], &(kn_backend_options){.cpu_act = "q8"}, &b) == 0);
        b.ops->describe(b.ctx, d, sizeof d);
        TH_CHECKF(strstr(d, "q8 activations"), "%s: %s", names[k], d);
        if (k == 0) TH_CHECK(kn_cpu_act_q8(b.ctx));
        kn_backend_destroy(&b);
        TH_REQUIRE(kn_backend_create(names[k], &(kn_backend_options){.cpu_act = "q16"}, &b) == 0);
        b.ops->describe(b.ctx, d, sizeof d);
        TH_CHECKF(strstr(d, "q16 activations"), "%s: %s", names[k], d);
        if (k == 0) {
            kn_compute_info ci;
            kn_backend_compute_info(b, &ci);
            TH_CHECK(kn_cpu_act(b.ctx) == KN_CPU_ACT_Q16 && !strcmp(ci.act, "q16"));
        }
        kn_backend_destroy(&b);
        TH_CHECK(kn_backend_create(names[k], &(kn_backend_options){.cpu_act = "q4"}, &b) ==
                     TD_EINVAL &&
                 !b.ops);
    }
    kn_backend b;
    TH_CHECK(kn_backend_create("cuda", &(kn_backend_options){.cpu_act = "q8"}, &b) == TD_EINVAL &&
             !b.ops);
}

/* backend 'cuda' where it cannot run: a clear TD_EUNSUPP, never a CPU run in disguise */
static void test_cuda_refused_without_gpu(void)
{
    kn_backend b;
    int rc = kn_backend_create("cuda", NULL, &b);
    if (rc == 0) { /* a GPU and a complete CUDA backend: nothing to refuse */
        kn_backend_destroy(&b);
        return;
    }
    TH_CHECK(rc == TD_EUNSUPP && !b.ops);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: test_engine_device MODEL.gguf\n");
        return 2;
    }
    if (kt_open_model(argv[1], &gguf, &model)) return 1;
    TH_RUN(test_cpudev_equals_cpu);
    TH_RUN(test_cpudev_catches_host_pointers);
    TH_RUN(test_tp2_cpudev_equals_cpu);
    TH_RUN(test_tbo_cpudev);
    TH_RUN(test_received_kv_decodes);
    TH_RUN(test_staged_pool);
    TH_RUN(test_cpu_act);
    TH_RUN(test_cuda_refused_without_gpu);
    kn_model_destroy(model);
    td_gguf_close(gguf);
    TH_EXIT();
}
