/* dc_plan.c: flat encoding of a step's batch:
 *   u32 magic 'TDPL', u32 kind, u64 step, i32 n_tokens, i32 n_seqs, i32 n_solo, i32 n_logits,
 *   i32 n_copies, i32 threads (0: as configured),
 *   n_copies x (i32 kind, i32 slot, i32 block) (the tier copies, in order),
 *   i32 tokens[n_tokens], i32 pos[n_tokens], i32 seq_of[n_tokens], i32 logit_rows[n_logits],
 *   per sequence: i32 n_ctx, then i32 blocks[ceil(n_ctx / block_size)]
 * The ranks of an instance share a host, so byte order is the host's. */
#include "dc_plan.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"
#include "td_linsolve.h"

#define PLAN_MAGIC   0x4c504454u /* "TDPL" */
#define HEADER_BYTES 40
#define COPY_BYTES   12

static int blocks_for(int32_t n_ctx, int block_size)
{
    return (int)((n_ctx + block_size - 1) / block_size);
}

size_t dc_plan_size(const kn_batch *b, int n_copies, int block_size)
{
    size_t c = HEADER_BYTES + (size_t)n_copies * COPY_BYTES;
    if (!b) return c;
    size_t n = c + (size_t)b->n_tokens * 12 + (size_t)b->n_logits * 4 + (size_t)b->n_seqs * 4;
    for (int s = 0; s < b->n_seqs; s++)
        n += (size_t)blocks_for(b->seqs[s].n_ctx, block_size) * 4;
    return n;
}

static void put(uint8_t **p, const void *src, size_t n)
{
    memcpy(*p, src, n);
    *p += n;
}

int dc_plan_encode(const kn_batch *b, const kn_kv_tier_op *copies, int n_copies, int block_size,
                   uint64_t step, int threads, void *buf, size_t cap, size_t *len)
{
    size_t need = dc_plan_size(b, n_copies, block_size);
    if (need > cap) {
        TD_LOG_ERR("step %llu: plan of %zu bytes exceeds the plan area (%zu)",
                   (unsigned long long)step, need, cap);
        return TD_ERANGE;
    }
    uint8_t *p = buf;
    uint32_t magic = PLAN_MAGIC, kind = b          ? DC_PLAN_RUN
                                        : n_copies ? DC_PLAN_COPY
                                                   : DC_PLAN_SHUTDOWN;
    int32_t nc = n_copies, th = threads;
    int32_t nt = b ? (int32_t)b->n_tokens : 0, ns = b ? b->n_seqs : 0;
    int32_t solo = b ? (int32_t)b->n_solo : 0, nl = b ? b->n_logits : 0;
    put(&p, &magic, 4);
    put(&p, &kind, 4);
    put(&p, &step, 8);
    put(&p, &nt, 4);
    put(&p, &ns, 4);
    put(&p, &solo, 4);
    put(&p, &nl, 4);
    put(&p, &nc, 4);
    put(&p, &th, 4);
    for (int i = 0; i < nc; i++) {
        put(&p, &copies[i].kind, 4);
        put(&p, &copies[i].slot, 4);
        put(&p, &copies[i].block, 4);
    }
    if (b) {
        put(&p, b->tokens, (size_t)nt * 4);
        put(&p, b->pos, (size_t)nt * 4);
        put(&p, b->seq_of, (size_t)nt * 4);
        if (nl) put(&p, b->logit_rows, (size_t)nl * 4);
        for (int s = 0; s < ns; s++) {
            put(&p, &b->seqs[s].n_ctx, 4);
            put(&p, b->seqs[s].block_table, (size_t)blocks_for(b->seqs[s].n_ctx, block_size) * 4);
        }
    }
    *len = (size_t)(p - (uint8_t *)buf);
    return 0;
}

void dc_plan_view_init(dc_plan_view *v)
{
    memset(v, 0, sizeof *v);
}

void dc_plan_view_fini(dc_plan_view *v)
{
    free(v->views);
    free(v->scratch);
    memset(v, 0, sizeof *v);
}

static int bad(const char *what)
{
    TD_LOG_ERR("malformed step plan: %s", what);
    return TD_EFORMAT;
}

int dc_plan_decode(const void *buf, size_t len, int block_size, int n_blocks, dc_plan_view *v)
{
    const uint8_t *p = buf, *end = p + len;
    uint32_t magic, kind;
    int32_t nt, ns, solo, nl, nc, th;
    if (len < HEADER_BYTES) return bad("shorter than its header");
    memcpy(&magic, p, 4);
    memcpy(&kind, p + 4, 4);
    memcpy(&v->step, p + 8, 8);
    memcpy(&nt, p + 16, 4);
    memcpy(&ns, p + 20, 4);
    memcpy(&solo, p + 24, 4);
    memcpy(&nl, p + 28, 4);
    memcpy(&nc, p + 32, 4);
    memcpy(&th, p + 36, 4);
    p += HEADER_BYTES;
    if (magic != PLAN_MAGIC) return bad("bad magic");
    if (th < 0) return bad("a negative thread count");
    v->threads = th;
    v->n_copies = 0;
    v->copies = NULL;
    if (kind == DC_PLAN_SHUTDOWN) {
        v->kind = kind;
        memset(&v->batch, 0, sizeof v->batch);
        return 0;
    }
    if (nc < 0 || (size_t)nc > (size_t)(end - p) / COPY_BYTES) return bad("copies past the end");
    if (kind == DC_PLAN_COPY && (nt || ns || solo || nl || nc < 1))
        return bad("a copy plan with a batch or without copies");
    if (kind != DC_PLAN_COPY && (kind != DC_PLAN_RUN || nt < 1 || ns < 1 || ns > nt || solo < 0 ||
                                 solo > nt || nl < 0 || nl > nt))
        return bad("bad kind or counts");
    /* the arrays and the tables must fit what is left; copy them into aligned scratch */
    size_t left = (size_t)(end - p);
    if ((size_t)nc * COPY_BYTES + (size_t)nt * 12 + (size_t)nl * 4 > left)
        return bad("token arrays past the end");
    size_t words = left / 4;
    if (v->cap_scratch < words) {
        free(v->scratch);
        v->scratch = malloc(words * sizeof *v->scratch);
        if (!v->scratch) {
            v->cap_scratch = 0;
            return TD_ENOMEM;
        }
        v->cap_scratch = words;
    }
    if (v->cap_views < ns) {
        free(v->views);
        v->views = malloc((size_t)ns * sizeof *v->views);
        if (!v->views) {
            v->cap_views = 0;
            return TD_ENOMEM;
        }
        v->cap_views = ns;
    }
    memcpy(v->scratch, p, words * 4);
    for (int i = 0; i < nc; i++) {
        const int32_t *c = v->scratch + 3 * i;
        if ((c[0] != KN_KV_TIER_OP_PUT && c[0] != KN_KV_TIER_OP_GET) || c[1] < 0 || c[2] < 0 ||
            c[2] >= n_blocks)
            return bad("tier copy of an unknown kind or outside the pool");
    }
    v->copies = (const kn_kv_tier_op *)v->scratch;
    v->n_copies = nc;
    if (kind == DC_PLAN_COPY) {
        if ((size_t)nc * COPY_BYTES != left) return bad("trailing bytes");
        v->kind = kind;
        memset(&v->batch, 0, sizeof v->batch);
        return 0;
    }
    int32_t *tok = v->scratch + 3 * nc, *pos = tok + nt, *seq_of = pos + nt, *rows = seq_of + nt;
    int32_t *q = rows + nl;
    int32_t *qend = v->scratch + words;
    for (int s = 0; s < ns; s++) {
        if (q >= qend) return bad("sequence table past the end");
        int32_t n_ctx = *q++;
        if (n_ctx < 1) return bad("sequence with no context");
        int nb = blocks_for(n_ctx, block_size);
        if (nb > qend - q) return bad("block table past the end");
        for (int j = 0; j < nb; j++)
            if (q[j] < 0 || q[j] >= n_blocks) return bad("block id outside the pool");
        v->views[s] = (kn_seq_view){.block_table = q, .n_ctx = n_ctx};
        q += nb;
    }
    if (q != qend || (size_t)(end - p) != words * 4) return bad("trailing bytes");
    v->kind = kind;
    v->batch = (kn_batch){.n_tokens = nt,
                          .n_solo = solo,
                          .tokens = tok,
                          .pos = pos,
                          .seq_of = seq_of,
                          .n_seqs = ns,
                          .seqs = v->views,
                          .n_logits = nl,
                          .logit_rows = nl ? rows : NULL};
    return 0;
}

/* The step cost model. Features are scaled to about 1 for a typical step so that one prior
 * weight suits every coefficient: solo rows / 8, prefill tokens / 128, attention pairs
 * / 65536, draft passes / 4. */
static const double FEAT_SCALE[DC_COST_N] = {1, 8, 128, 65536, 4};
#define COST_FORGET 0.98 /* per step: the fit looks back about 50 steps */
/* The start's weight per coefficient, in steps: the data win at once where they determine a
 * coefficient, the start decides only what they leave open (the intercept against the per-row
 * cost while every step has one row). The prefill token's start is the least known (an
 * assumed rate, 2-10x off on a CPU) and weighs least: at the common weight its pull, through
 * the first prefill step (t = intercept + tokens x its cost), held the intercept at 0, so the
 * one-row steps that followed put their whole time into the per-row cost (replayed from a
 * run's log, the 1.5B model on the Intel machine: a verification row predicted at 45 ms, 8
 * measured, and the run's first request never speculated; test_sched's test_cost_start). */
static const double PRIOR_W[DC_COST_N] = {0.05, 0.05, 1e-4, 0.05, 0.05};
#define COST_CLIP   5.0  /* residuals beyond this many mean absolute residuals, and beyond */
#define COST_CLIP_R 0.5  /* this share of the prediction, are clipped */
#define COST_GFLOPS 50.0 /* the start's assumed rate (GFLOP/s): conservative for a CPU */

static void features(const dc_step_shape *s, double x[DC_COST_N])
{
    x[0] = 1;
    x[1] = (s->n_decode + s->n_draft) / FEAT_SCALE[1];
    x[2] = s->n_prefill / FEAT_SCALE[2];
    x[3] = s->attn / FEAT_SCALE[3];
    x[4] = s->n_pass / FEAT_SCALE[4];
}

void dc_cost_init(dc_cost *c, const kn_hparams *hp)
{
    memset(c, 0, sizeof *c);
    /* matmul weights per layer: q and o, k and v, the three FFN matrices (of the experts a
     * token takes, in a MoE layer) */
    double d = hp->n_embd, qd = (double)hp->n_head * hp->head_dim,
           kvd = (double)hp->n_head_kv * hp->head_dim, ffn = 0;
    for (int il = 0; il < hp->n_layer; il++)
        ffn += (double)kn_layer_ffn_active(hp, il);
    double flops_tok = 2.0 * (hp->n_layer * (2 * d * qd + 2 * d * kvd) + 3 * d * ffn);
    double flops_pair = 4.0 * hp->n_layer * qd; /* q.k and p.v per (row, position) */
    double ms_per_flop = 1e3 / (COST_GFLOPS * 1e9);
    c->prior[0] = 1.0;
    /* a solo row beside others reads weights that are read for them already: it costs
     * arithmetic, not memory (a one-row step's weight read lands in the intercept). Started
     * low on purpose (a quarter of a prefill token): while every step has one row the steps
     * cannot tell the two apart, and a start too high would keep speculation from ever being
     * tried, hence never measured */
    c->prior[1] = 0.25 * flops_tok * ms_per_flop * FEAT_SCALE[1];
    c->prior[2] = flops_tok * ms_per_flop * FEAT_SCALE[2];
    c->prior[3] = flops_pair * ms_per_flop * FEAT_SCALE[3];
    /* the draft model is not known here: its passes start free, so it is tried, and the
     * steps that use it measure it */
    c->prior[4] = 0;
    memcpy(c->theta, c->prior, sizeof c->theta);
}

double dc_cost_predict(const dc_cost *c, const dc_step_shape *s)
{
    double x[DC_COST_N], t = 0;
    features(s, x);
    for (int i = 0; i < DC_COST_N; i++)
        t += c->theta[i] * x[i];
    return t;
}

/* Solve M[F][F] th[F] = v[F] for the coefficients in mask F (the rest 0); false if a pivot is
 * not above 1e-300, a guard against dividing by zero only (M is positive definite: the prior's
 * weight is on its diagonal). */
static bool solve_subset(const double M[DC_COST_N][DC_COST_N], const double v[DC_COST_N],
                         unsigned mask, double th[DC_COST_N])
{
    int idx[DC_COST_N], n = 0;
    for (int i = 0; i < DC_COST_N; i++)
        if (mask >> i & 1) idx[n++] = i;
    double a[DC_COST_N * DC_COST_N], y[DC_COST_N];
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < n; j++)
            a[i * n + j] = M[idx[i]][idx[j]];
        y[i] = v[idx[i]];
    }
    if (!td_solve_dense(n, a, y, y, 1e-300)) return false;
    memset(th, 0, sizeof(double) * DC_COST_N);
    for (int k = 0; k < n; k++)
        th[idx[k]] = y[k];
    return true;
}

/* The non-negative minimiser of th^T M th - 2 th^T v (M positive definite: the prior's weight
 * is on its diagonal). It is the unconstrained minimiser over its own set of positive
 * coefficients, so with this few coefficients trying every set and keeping the best feasible one
 * is exact, and cheap beside a step (32 systems of at most 5 unknowns). */
static void solve_nonneg(const double M[DC_COST_N][DC_COST_N], const double v[DC_COST_N],
                         double out[DC_COST_N])
{
    double best = 0, th[DC_COST_N];
    memset(out, 0, sizeof(double) * DC_COST_N); /* the empty set: objective 0 */
    for (unsigned mask = 1; mask < 1u << DC_COST_N; mask++) {
        if (!solve_subset(M, v, mask, th)) continue;
        bool ok = true;
        double obj = 0; /* at the subset's minimiser th^T M th = th^T v */
        for (int i = 0; i < DC_COST_N; i++) {
            ok = ok && th[i] >= 0;
            obj -= th[i] * v[i];
        }
        if (ok && obj < best) {
            best = obj;
            memcpy(out, th, sizeof th);
        }
    }
}

void dc_cost_observe(dc_cost *c, const dc_step_shape *s, double ms)
{
    if (!(ms > 0)) return;
    double x[DC_COST_N], pred = dc_cost_predict(c, s), e = ms - pred;
    features(s, x);
    /* a step far off the fit (the host stalled the process, a page fault storm) moves it by
     * a clipped amount; a real change of regime gets there over a few steps */
    double lim = COST_CLIP * (c->err_ms > 0.5 ? c->err_ms : 0.5);
    if (lim < COST_CLIP_R * pred) lim = COST_CLIP_R * pred;
    if (c->n_obs >= 16 && (e > lim || e < -lim)) e = e > 0 ? lim : -lim;
    c->err_ms += ((e < 0 ? -e : e) - c->err_ms) * (c->n_obs < 16 ? 0.25 : 0.05);
    double M[DC_COST_N][DC_COST_N], v[DC_COST_N];
    for (int i = 0; i < DC_COST_N; i++) {
        c->b[i] = COST_FORGET * c->b[i] + x[i] * (pred + e);
        for (int j = 0; j < DC_COST_N; j++) {
            c->A[i][j] = COST_FORGET * c->A[i][j] + x[i] * x[j];
            M[i][j] = c->A[i][j] + (i == j ? PRIOR_W[i] : 0);
        }
        v[i] = c->b[i] + PRIOR_W[i] * c->prior[i];
    }
    solve_nonneg(M, v, c->theta);
    c->n_obs++;
}

double dc_cost_chunk_attn(int32_t pos0, int32_t n)
{
    /* row pos0 + j attends to pos0 + j + 1 positions */
    return (double)n * pos0 + (double)n * (n + 1) / 2;
}

double dc_cost_chunk_ms(const dc_cost *c, int32_t pos0, int32_t n)
{
    return c->theta[2] * n / FEAT_SCALE[2] +
           c->theta[3] * dc_cost_chunk_attn(pos0, n) / FEAT_SCALE[3];
}

double dc_cost_draft_ms(const dc_cost *c, int32_t pos)
{
    return c->theta[1] / FEAT_SCALE[1] + c->theta[3] * ((double)pos + 1) / FEAT_SCALE[3];
}

double dc_cost_pass_ms(const dc_cost *c)
{
    return c->theta[4] / FEAT_SCALE[4];
}

int32_t dc_cost_fit_chunk(const dc_cost *c, double ms_left, int32_t pos0, int32_t max_n)
{
    int32_t lo = 0, hi = max_n; /* chunk_ms grows with n: the largest n that fits */
    while (lo < hi) {
        int32_t mid = lo + (hi - lo + 1) / 2;
        if (dc_cost_chunk_ms(c, pos0, mid) <= ms_left)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}
