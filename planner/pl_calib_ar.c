/* pl_calib_ar.c: `tandem calibrate`'s measurements across processes (pl_calib.h): tp rank
 * processes of the decode node's own shared-memory collective (dc_shm), each one thread,
 * timing all-reduces of one token's hidden state (a decode step of batch 1 makes 2 a
 * layer), whole batch-1 decode steps and whole prefill chunks of the model's tp shards. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "act_check.h"
#include "dc_shm.h"
#include "kn_runtime.h"
#include "kv_mem.h"
#include "pl_calib.h"
#include "td_clock.h"
#include "td_err.h"
#include "td_stats.h"

#define AR_WARMUP 200

/* One rank: join, warm up, time iters all-reduces; rank 0 stores the mean (us). */
static int ar_rank(const char *token, int rank, int tp, int n, int iters, double *out)
{
    dc_shm_params p = {.instance = "calib",
                       .token = token,
                       .rank = rank,
                       .tp = tp,
                       .max_floats = n,
                       .timeout_ms = 10000,
                       .op_timeout_ms = 10000};
    dc_shm *s;
    int rc = dc_shm_open(&p, &s);
    if (rc) return rc;
    float *buf = calloc((size_t)n, sizeof *buf);
    rc = buf ? 0 : TD_ENOMEM;
    for (int i = 0; i < AR_WARMUP && !rc; i++)
        rc = dc_shm_allreduce(s, buf, n);
    int64_t t0 = td_now_ns();
    for (int i = 0; i < iters && !rc; i++)
        rc = dc_shm_allreduce(s, buf, n);
    if (!rc && rank == 0) *out = (double)(td_now_ns() - t0) / 1e3 / iters;
    dc_shm_close(s);
    free(buf);
    return rc;
}

/* What every rank process runs; rank 0 leaves its figure in res[0] (shared memory). */
typedef struct {
    const char *model; /* decode steps and prefill chunks: the GGUF; all-reduces: NULL */
    int tp, threads, n_floats, iters;
    int chunk; /* with model: 0 decode steps, else prefill chunks of this many tokens */
    bool ep;   /* with model: the experts whole on the ranks */
    bool dp;   /* with model: the ranks are a data-parallel attention group's members (each
                  its own row a step; a chunk is member 0's, the others idle) */
} rank_job;

static int tp_rank(const char *token, const rank_job *j, int rank, double *out);

static int run_rank(const rank_job *j, const char *token, int rank, double *res)
{
    return j->model ? tp_rank(token, j, rank, res)
                    : ar_rank(token, rank, j->tp, j->n_floats, j->iters, res);
}

/* Fork j->tp rank processes, wait for all; *out rank 0's figure. A rank that fails kills the
 * measurement (TD_EIO, logged by the caller). */
static int fork_ranks(const rank_job *j, const char *what, double *out)
{
    double *res =
        mmap(NULL, sizeof *res, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (res == MAP_FAILED) return TD_ENOMEM;
    *res = -1;
    char token[64];
    snprintf(token, sizeof token, "%s%ld", what, (long)getpid());
    pid_t pids[DC_SHM_MAX_TP];
    int started = 0, rc = 0;
    fflush(NULL);
    for (int r = 0; r < j->tp; r++, started++) {
        pids[r] = fork();
        if (pids[r] < 0) {
            rc = TD_EIO;
            break;
        }
        if (pids[r] == 0) _exit(run_rank(j, token, r, res) ? 1 : 0);
    }
    for (int r = 0; r < started; r++) {
        int st;
        if (rc) kill(pids[r], SIGKILL);
        if (waitpid(pids[r], &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st)) rc = TD_EIO;
    }
    if (!rc && *res > 0) *out = *res;
    if (!rc && *res <= 0) rc = TD_EIO;
    munmap(res, sizeof *res);
    if (rc) TD_LOG_ERR("calibrate: the tp %d %s measurement failed", j->tp, what);
    return rc;
}

int pl_calib_allreduce(int tp, int n_floats, int iters, double *us)
{
    if (tp < 2 || tp > DC_SHM_MAX_TP || n_floats < 1 || iters < 1) return TD_EINVAL;
    rank_job j = {.tp = tp, .n_floats = n_floats, .iters = iters};
    return fork_ranks(&j, "allreduce", us);
}

/* ---- the whole decode step and prefill chunk at tp ---- */

typedef struct {
    dc_shm *shm;
    int rank;
    uint64_t step;
} tp_coll;

/* The decode node's hand-off before each step: the leader publishes a plan, the followers
 * wait for it (futex wake-ups of processes that may not be running) */
static int tp_plan(void *ctx)
{
    tp_coll *c = ctx;
    if (c->rank == 0) {
        c->step++;
        return dc_shm_plan_publish(c->shm, &c->step, sizeof c->step);
    }
    const void *plan;
    size_t len;
    int rc = dc_shm_plan_wait(c->shm, 30000, &plan, &len);
    return rc ? rc : len == sizeof c->step ? 0 : TD_EIO;
}

static int tp_allreduce(void *ctx, float *buf, int64_t n)
{
    return dc_shm_allreduce(((tp_coll *)ctx)->shm, buf, n);
}

static int tp_gather(void *ctx, const float *part, int64_t rows, int64_t n_cols, float *out)
{
    return dc_shm_gather_cols(((tp_coll *)ctx)->shm, part, rows, n_cols, out);
}

static int dp_counts(void *ctx, const int64_t mine[2], int64_t *all)
{
    return dc_shm_dp_counts(((tp_coll *)ctx)->shm, mine, all);
}

static int dp_gather(void *ctx, const float *mine, const int64_t *counts, int64_t n_cols,
                     float *all)
{
    return dc_shm_dp_gather(((tp_coll *)ctx)->shm, mine, counts, n_cols, all);
}

static int dp_reduce(void *ctx, const float *all, const int64_t *counts, int64_t n_cols,
                     float *mine)
{
    return dc_shm_dp_reduce(((tp_coll *)ctx)->shm, all, counts, n_cols, mine);
}

/* A dp member's turn before each step: nothing to hand off (each member plans its own). */
static int dp_none(void *ctx)
{
    (void)ctx;
    return 0;
}

/* Prefill chunks of x tokens from an empty context, no logits (as pl_calib_chunks times them
 * at tp 1), one warm-up and reps timed, each after the plan hand-off; *ms their median. */
static int tp_chunks(kn_engine *eng, kn_kv_mem *mem, int n_vocab, int x, int reps,
                     const pl_calib_step_hook *hook, double *ms)
{
    int32_t *tok = malloc((size_t)x * sizeof *tok), *pos = malloc((size_t)x * sizeof *pos);
    int32_t *seq_of = calloc((size_t)x, sizeof *seq_of);
    double t[16];
    int rc = reps < 1 || reps > 16 ? TD_EINVAL : tok && pos && seq_of ? 0 : TD_ENOMEM;
    for (int i = 0; i < x && !rc; i++) {
        tok[i] = (int32_t)(((uint32_t)i * 7919u + 17) % (uint32_t)n_vocab);
        pos[i] = i;
    }
    for (int r = 0; r < reps + 1 && !rc; r++) {
        kn_kv_seq seq;
        kn_kv_seq_init(&seq);
        int64_t t0 = td_now_ns();
        rc = hook->fn(hook->ctx);
        if (!rc) rc = kn_kv_seq_reserve(mem, &seq, x);
        kn_seq_view view = {.block_table = seq.blocks, .n_ctx = x};
        kn_batch b = {
            .n_tokens = x, .tokens = tok, .pos = pos, .seq_of = seq_of, .n_seqs = 1, .seqs = &view};
        if (!rc) rc = kn_engine_forward(eng, kn_kv_mem_pool(mem), &b, NULL);
        if (r > 0) t[r - 1] = (double)(td_now_ns() - t0) / 1e6;
        kn_kv_seq_fini(mem, &seq);
    }
    if (!rc) *ms = td_stats_median(t, (size_t)reps);
    free(tok);
    free(pos);
    free(seq_of);
    return rc;
}

/* One rank: its shard, a small pool, the steps or chunks; rank 0 stores the median (ms). */
static int tp_rank(const char *token, const rank_job *j, int rank, double *out)
{
    kn_runtime rt;
    memset(&rt, 0, sizeof rt);
    tp_coll c = {.rank = rank};
    kn_collective coll = {.ctx = &c,
                          .allreduce_sum = tp_allreduce,
                          .gather_cols = tp_gather,
                          .dp_counts = dp_counts,
                          .dp_gather = dp_gather,
                          .dp_reduce = dp_reduce};
    kn_shard shard = {.tp_rank = rank, .tp_size = j->tp, .ep = j->ep};
    if (j->dp) shard = (kn_shard){.dp_rank = rank, .dp_size = j->tp};
    kn_runtime_params rp = {.model_path = j->model,
                            .shard = shard,
                            .backend_opts = {.n_threads = j->threads, .device = -1, .rank = rank},
                            .coll = &coll,
                            .who = "calibrate"};
    int rc = kn_act_runtime_open(&rt, &rp); /* TANDEM_CPU_ACT=auto resolved, as the nodes do */
    if (rc) return rc;
    const kn_hparams *hp = &rt.model->hp;
    int64_t max_floats = (int64_t)hp->n_embd > hp->n_vocab ? hp->n_embd : hp->n_vocab;
    if (j->chunk > 0 && (int64_t)j->chunk * hp->n_embd > max_floats)
        max_floats = (int64_t)j->chunk * hp->n_embd; /* a chunk's all-reduces */
    if (j->dp) /* a chunk's rows with their choices in one piece */
        max_floats =
            (int64_t)(j->chunk > 0 ? j->chunk : 1) * (hp->n_embd + 2 * (int64_t)hp->n_expert_used);
    dc_shm_params sp = {.instance = "calibtp",
                        .token = token,
                        .rank = rank,
                        .tp = j->tp,
                        .max_floats = max_floats,
                        .timeout_ms = 30000,
                        .op_timeout_ms = 30000};
    kn_kv_mem *kv = NULL;
    int tokens = j->chunk > 0 ? j->chunk : 2 * j->iters;
    if (!(rc = dc_shm_open(&sp, &c.shm))) {
        kn_kv_pool_params kp = kn_model_kv_params(rt.model, (tokens + 64) / 16 + 1, 16, TD_F16);
        rc = kn_kv_mem_create(&kp, &kv);
    }
    double ms = 0;
    pl_calib_step_hook hook = {.fn = j->dp ? dp_none : tp_plan, .ctx = &c};
    if (!rc && j->chunk > 0 && j->dp && rank > 0) /* member 0's chunks: their rounds */
        for (int r = 0; r < j->iters + 1 && !rc; r++)
            rc = kn_engine_forward_idle(rt.engine);
    else if (!rc && j->chunk > 0)
        rc = tp_chunks(rt.engine, kv, hp->n_vocab, j->chunk, j->iters, &hook, &ms);
    else if (!rc)
        rc = pl_calib_decode_steps(rt.engine, kv, hp->n_vocab, 0, j->iters, &hook, &ms);
    if (!rc && rank == 0) *out = ms;
    kn_kv_mem_destroy(kv);
    if (c.shm) dc_shm_close(c.shm);
    kn_runtime_close(&rt);
    return rc;
}

int pl_calib_decode_tp(const char *model_path, int tp, bool ep, int threads, int steps, double *ms)
{
    if (tp < 2 || tp > DC_SHM_MAX_TP || steps < 1 || !model_path) return TD_EINVAL;
    rank_job j = {.model = model_path, .tp = tp, .ep = ep, .threads = threads, .iters = steps};
    return fork_ranks(&j, ep ? "decodestepep" : "decodestep", ms);
}

int pl_calib_chunk_tp(const char *model_path, int tp, bool ep, int threads, int x, int reps,
                      double *ms)
{
    if (tp < 2 || tp > DC_SHM_MAX_TP || x < 1 || reps < 1 || reps > 16 || !model_path)
        return TD_EINVAL;
    rank_job j = {
        .model = model_path, .tp = tp, .ep = ep, .threads = threads, .iters = reps, .chunk = x};
    return fork_ranks(&j, ep ? "prefillchunkep" : "prefillchunk", ms);
}

int pl_calib_dp(const char *model_path, int dp, int threads, int steps, int chunk, double *ms)
{
    if (dp < 2 || dp > DC_SHM_MAX_TP || steps < 1 || chunk < 0 || !model_path) return TD_EINVAL;
    rank_job j = {.model = model_path,
                  .tp = dp,
                  .dp = true,
                  .threads = threads,
                  .iters = chunk ? 2 : steps,
                  .chunk = chunk};
    return fork_ranks(&j, chunk ? "dpchunk" : "dpstep", ms);
}
