/* pf_profile.c: start-up profile of one pipeline stage on the engine, the cost-model fit
 * over it, and timed runs of chunk plans (see pf_profile.h for what is measured). */
#include "pf_profile.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "td_clock.h"
#include "td_err.h"
#include "td_stats.h"
#include "pf_tune.h"

#define PF_MAX_REPS 16

/* CLOCK_MONOTONIC in ms, with sub-ms resolution (forwards of short lengths take ~1 ms) */
static double now_ms(void)
{
    return (double)td_now_ns() * 1e-6;
}

/* ---- inputs ---- */

/* A stage's input for up to n tokens: ids (first stage) or hidden states (others). */
typedef struct {
    int32_t *ids; /* (n) first stage, else NULL */
    float *embd;  /* (n, n_embd) other stages, else NULL */
    int32_t *pos; /* (n) scratch */
    int32_t *seq; /* (n) zeros: one sequence */
    float *out;   /* (n, n_embd) output of a non-last stage; (1) on the last */
    int64_t n;
} pf_stage_io;

static uint64_t lcg(uint64_t *x)
{
    *x = *x * 6364136223846793005ull + 1442695040888963407ull;
    return *x >> 33;
}

static void io_free(pf_stage_io *io)
{
    free(io->ids);
    free(io->embd);
    free(io->pos);
    free(io->seq);
    free(io->out);
    memset(io, 0, sizeof *io);
}

static int io_alloc(pf_stage_io *io, const kn_model *m, int64_t n, uint64_t seed)
{
    memset(io, 0, sizeof *io);
    size_t E = (size_t)m->hp.n_embd;
    io->n = n;
    io->pos = malloc((size_t)n * sizeof *io->pos);
    io->seq = calloc((size_t)n, sizeof *io->seq);
    io->out = malloc((m->last ? 1 : (size_t)n * E) * sizeof *io->out);
    if (m->first)
        io->ids = malloc((size_t)n * sizeof *io->ids);
    else
        io->embd = malloc((size_t)n * E * sizeof *io->embd);
    if (!io->pos || !io->seq || !io->out || (!io->ids && !io->embd)) {
        io_free(io);
        return TD_ENOMEM;
    }
    uint64_t x = seed * 2654435761ull + 12345;
    if (io->ids) {
        for (int64_t i = 0; i < n; i++)
            io->ids[i] = (int32_t)(lcg(&x) % (uint64_t)m->hp.n_vocab);
    } else {
        /* uniform in [-sqrt(3), sqrt(3)): unit variance, like a residual stream after norm */
        for (size_t i = 0; i < (size_t)n * E; i++)
            io->embd[i] = (float)(((double)lcg(&x) / 2147483648.0 - 0.5) * 3.4641016);
    }
    return 0;
}

/* One forward of tokens [start, start + len) of the sequence in seq (blocks reserved). */
static int forward(pf_shard *sh, pf_stage_io *io, kn_kv_seq *seq, int64_t start, int64_t len)
{
    for (int64_t i = 0; i < len; i++)
        io->pos[i] = (int32_t)(start + i);
    kn_seq_view view = {.block_table = seq->blocks, .n_ctx = (int32_t)(start + len)};
    size_t E = (size_t)sh->rt.model->hp.n_embd;
    kn_batch b = {
        .n_tokens = len,
        .tokens = io->ids ? io->ids + start : NULL,
        .embd = io->embd ? io->embd + (size_t)start * E : NULL,
        .pos = io->pos,
        .seq_of = io->seq,
        .n_seqs = 1,
        .seqs = &view,
        .n_logits = 0,
        .logit_rows = NULL,
    };
    return kn_engine_forward(sh->rt.engine, sh->kv, &b, io->out);
}

/* ---- profile ---- */

/* Visit order spreading the lengths: last, first, then midpoints of the intervals
 * breadth-first (n <= PF_PROFILE_MAX_LENGTHS). */
static void spread_order(int n, int *order)
{
    int k = 0, qa[2 * PF_PROFILE_MAX_LENGTHS], qb[2 * PF_PROFILE_MAX_LENGTHS], head = 0, tail = 0;
    order[k++] = n - 1;
    if (n > 1) order[k++] = 0;
    qa[tail] = 0;
    qb[tail++] = n - 1;
    while (head < tail && k < n) {
        int a = qa[head], b = qb[head++], mid = (a + b) / 2;
        if (mid == a || mid == b) continue;
        order[k++] = mid;
        qa[tail] = a;
        qb[tail++] = mid;
        qa[tail] = mid;
        qb[tail++] = b;
    }
}

pf_profile_params pf_profile_resolve(const pf_profile_params *p)
{
    pf_profile_params q = *p;
    if (!q.max_len) q.max_len = p->chunk_size + p->chunk_size / 4;
    if (!q.n_lengths) q.n_lengths = 16;
    if (!q.reps) q.reps = 3;
    if (q.reps > PF_MAX_REPS) q.reps = PF_MAX_REPS;
    if (!q.budget_ms) q.budget_ms = 20000;
    return q;
}

static bool stop_seen(const pf_profile_params *p)
{
    return p->stop && *p->stop;
}

int pf_profile_stage(pf_shard *sh, const pf_profile_params *p_in, pf_profile_result *out)
{
    memset(out, 0, sizeof *out);
    if (p_in->chunk_size < 1 || p_in->n_lengths < 0 || p_in->n_lengths > PF_PROFILE_MAX_LENGTHS ||
        p_in->reps < 0 || p_in->max_len < 0 || p_in->budget_ms < 0) {
        TD_LOG_ERR("profile: bad parameters (chunk %d, lengths %d, reps %d)", p_in->chunk_size,
                   p_in->n_lengths, p_in->reps);
        return TD_EINVAL;
    }
    pf_profile_params p0 = pf_profile_resolve(p_in);
    const pf_profile_params *p = &p0;
    int hi = p->max_len, nl = p->n_lengths, reps = p->reps;
    double budget = p->budget_ms;
    if (hi > sh->ctx) {
        TD_LOG_ERR("profile: length %d exceeds the stage's KV capacity %d", hi, sh->ctx);
        return TD_ERANGE;
    }
    int lo = hi / 4 < 64 ? hi / 4 : 64;
    if (lo < 1) lo = 1;
    if (hi - lo + 1 < nl) nl = hi - lo + 1;
    int32_t lens[PF_PROFILE_MAX_LENGTHS];
    for (int i = 0; i < nl; i++)
        lens[i] = nl > 1 ? (int32_t)(lo + (int64_t)(hi - lo) * i / (nl - 1)) : hi;
    double(*tm)[PF_MAX_REPS] = calloc((size_t)nl, sizeof *tm);
    int nrun[PF_PROFILE_MAX_LENGTHS] = {0}, order[PF_PROFILE_MAX_LENGTHS];
    pf_stage_io io;
    kn_kv_seq seq;
    kn_kv_seq_init(&seq);
    int rc = tm ? io_alloc(&io, sh->rt.model, hi, p->seed) : TD_ENOMEM;
    if (rc) {
        free(tm);
        return rc;
    }
    spread_order(nl, order);
    double t0 = now_ms();
    if (stop_seen(p))
        out->stopped = true;
    else if (!(rc = kn_kv_seq_reserve(sh->mem, &seq, hi)))
        rc = forward(sh, &io, &seq, 0, hi); /* warm-up: weights paged in, scratch sized */
    for (int rep = 0; rep < reps && !rc && !out->budget_hit && !out->stopped; rep++) {
        for (int k = 0; k < nl && !rc; k++) {
            if (stop_seen(p)) {
                out->stopped = true;
                break;
            }
            /* the first three lengths always run, so there is something to fit */
            if ((rep > 0 || k >= 3) && now_ms() - t0 >= budget) {
                out->budget_hit = true;
                break;
            }
            int i = order[k];
            double s = now_ms();
            rc = forward(sh, &io, &seq, 0, lens[i]);
            tm[i][nrun[i]++] = now_ms() - s;
        }
    }
    out->elapsed_ms = now_ms() - t0;
    kn_kv_seq_fini(sh->mem, &seq);
    io_free(&io);
    if (rc) {
        TD_LOG_ERR("profile: forward failed: %s", td_strerror(rc));
        free(tm);
        return rc;
    }
    if (out->stopped) {
        free(tm);
        return TD_ESTATE;
    }
    double xs[PF_PROFILE_MAX_LENGTHS];
    for (int i = 0; i < nl; i++) {
        if (!nrun[i]) continue;
        int k = out->n_lengths++;
        out->len[k] = lens[i];
        out->ms[k] = td_stats_median(tm[i], (size_t)nrun[i]);
        out->n_runs[k] = nrun[i];
        xs[k] = lens[i];
    }
    free(tm);
    pf_fit_robust(xs, out->ms, out->n_lengths, &out->fit, NULL); /* outliers: a busy moment */
    return 0;
}

int pf_profile_run_plan(pf_shard *sh, const int32_t *chunks, int64_t n, uint64_t seed, double *ms)
{
    int64_t total = 0;
    for (int64_t k = 0; k < n; k++) {
        if (chunks[k] < 1) return TD_EINVAL;
        total += chunks[k];
    }
    if (total < 1) return TD_EINVAL;
    if (total > sh->ctx) {
        TD_LOG_ERR("plan of %lld tokens exceeds the stage's KV capacity %d", (long long)total,
                   sh->ctx);
        return TD_ERANGE;
    }
    pf_stage_io io;
    int rc = io_alloc(&io, sh->rt.model, total, seed);
    if (rc) return rc;
    kn_kv_seq seq;
    kn_kv_seq_init(&seq);
    int64_t done = 0;
    for (int64_t k = 0; k < n && !rc; k++) {
        double s = now_ms();
        /* block reservation is part of a chunk's real cost, and cheap */
        if (!(rc = kn_kv_seq_reserve(sh->mem, &seq, done + chunks[k])))
            rc = forward(sh, &io, &seq, done, chunks[k]);
        ms[k] = now_ms() - s;
        done += chunks[k];
    }
    kn_kv_seq_fini(sh->mem, &seq);
    io_free(&io);
    return rc;
}
