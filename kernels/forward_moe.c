/* forward_moe.c: a mixture-of-experts layer's FFN in the forward pass (kn_engine).
 *
 *   logits = h Wr                                    (the router, whole on every rank)
 *   per token: k experts and weights                 (moe_route.c, on the host)
 *   per expert x with tokens T_x:  y[T_x] = (act(h[T_x] Wg_x) * h[T_x] Wu_x) Wd_x
 *                                    (every choice's token gathered once; the experts in
 *                                    one experts_ffn op where the backend has it, else one
 *                                    glu_ffn and one down product per expert)
 *   mo[i] = sum_j w[i, j] y[slot(i, j)]               (weighted_rows_sum, in choice order)
 *         [+ (act(h Wg_s) * h Wu_s) Wd_s]             (shared experts)
 *   x += allreduce(mo)
 * Batch invariance (model.h): a solo row's choice depends on its own logits; in each
 * expert's gathered group the solo rows come first (moe_route.h), so each is computed as if
 * alone there too; and its combine reads only its own slots, in its own choice order. So a
 * decode row's result does not depend on which other rows chose the same experts.
 * With expert parallelism (kn_shard.ep) a rank computes only the experts it holds; the
 * choices of the others read a zero row in the combine, so each rank's mo is its experts'
 * share and the all-reduce sums the shares (every rank has every token: attention is
 * tensor-parallel, so no token moves).
 * A device backend downloads the router's logits and uploads the plan (n * k tokens, slots
 * and weights) once per layer; the experts' GEMMs run in its memory.
 * Data-parallel attention (kn_shard.dp_size > 1, host backends): each member routes its own
 * rows, the rows travel with their choices (dp_gather, every member's solo rows first), each
 * member runs the experts it holds on every row and combines them, the others' choices
 * reading the zero row, and dp_reduce sums the members' shares back into each row's own
 * member; the shared experts run whole on the member's own rows. A solo row's route and
 * shared experts are its own, it leads every group it joins and its combine reads its own
 * slots, and the sum over members runs in member order: its result does not depend on the
 * other rows of any member. */
#include <stdlib.h>
#include <string.h>

#include "engine_int.h"
#include "td_err.h"

int64_t kn_engine_ffn_width(const kn_model *m)
{
    int64_t f = m->n_ff_local;
    if (m->hp.n_expert && m->n_ffe_local > f) f = m->n_ffe_local;
    if (m->hp.n_ff_shexp && m->n_ffs_local > f) f = m->n_ffs_local;
    return f;
}

void kn_engine_moe_free(kn_engine *e)
{
    kn_engine_moe *mo = &e->moe;
    void **const bufs[] = {
        (void **)&mo->rl, (void **)&mo->xe,  (void **)&mo->ge,   (void **)&mo->ue, (void **)&mo->ye,
        (void **)&mo->mo, (void **)&mo->tok, (void **)&mo->slot, (void **)&mo->wt, (void **)&mo->pk,
        (void **)&mo->pa, (void **)&mo->ha,  (void **)&mo->ma};
    kn_engine_free_bufs(e, bufs, sizeof bufs / sizeof *bufs);
    free(mo->h_rl);
    mo->h_rl = NULL;
    kn_engine_groups *gr = &mo->grp;
    void *host[] = {gr->wg, gr->wu, gr->wd, gr->x, gr->m, gr->solo, gr->g, gr->u, gr->y};
    for (size_t i = 0; i < sizeof host / sizeof *host; i++)
        free(host[i]);
    *gr = (kn_engine_groups){0};
    kn_moe_plan_free(&mo->plan);
    kn_moe_plan_free(&mo->own);
    mo->cap = 0;
}

/* The host side: the group arrays (one entry per expert at most), the router's host logits
 * on a device backend. */
static bool host_scratch(kn_engine *e, int64_t n)
{
    kn_engine_moe *mo = &e->moe;
    kn_engine_groups *gr = &mo->grp;
    const size_t X = (size_t)e->m->hp.n_expert;
    gr->wg = malloc(X * sizeof *gr->wg);
    gr->wu = malloc(X * sizeof *gr->wu);
    gr->wd = malloc(X * sizeof *gr->wd);
    gr->x = malloc(X * sizeof *gr->x);
    gr->m = malloc(X * sizeof *gr->m);
    gr->solo = malloc(X * sizeof *gr->solo);
    gr->g = malloc(X * sizeof *gr->g);
    gr->u = malloc(X * sizeof *gr->u);
    gr->y = malloc(X * sizeof *gr->y);
    if (e->dev) mo->h_rl = malloc((size_t)n * X * sizeof *mo->h_rl);
    return gr->wg && gr->wu && gr->wd && gr->x && gr->m && gr->solo && gr->g && gr->u && gr->y &&
           (!e->dev || mo->h_rl);
}

int kn_engine_moe_reserve(kn_engine *e, int64_t n)
{
    const kn_hparams *hp = &e->m->hp;
    kn_engine_moe *mo = &e->moe;
    if (!hp->n_expert || n <= mo->cap) return 0;
    kn_engine_moe_free(e);
    const int64_t E = hp->n_embd, X = hp->n_expert, k = hp->n_expert_used;
    const int64_t F = e->m->n_ffe_local;
    const bool dp = e->m->shard.dp_size > 1;
    /* the plan's device copies only on a device backend (a host one reads the plan) */
    const kn_engine_buf want[] = {
        {(void **)&mo->rl, n * X},
        {(void **)&mo->xe, n * k * E},
        {(void **)&mo->ge, n * k * F},
        {(void **)&mo->ue, n * k * F},
        {(void **)&mo->ye, (n * k + 1) * E}, /* and a zero row: the experts held elsewhere */
        {(void **)&mo->mo, n * E},
        {e->dev ? (void **)&mo->tok : NULL, n * k},
        {e->dev ? (void **)&mo->slot : NULL, n * k},
        {e->dev ? (void **)&mo->wt : NULL, n * k},
        {dp ? (void **)&mo->pk : NULL, n * (E + 2 * k)},
        {dp ? (void **)&mo->pa : NULL, n * (E + 2 * k)},
        {dp ? (void **)&mo->ha : NULL, n * E},
        {dp ? (void **)&mo->ma : NULL, n * E},
    };
    int rc = kn_engine_alloc_bufs(e, want, sizeof want / sizeof *want, "experts'");
    if (rc) return rc;
    float *zero = calloc((size_t)E, sizeof *zero);
    if (zero) rc = e->be.ops->upload(e->be.ctx, mo->ye + n * k * E, zero, (size_t)E * 4);
    free(zero);
    if (!zero || rc || !host_scratch(e, n)) {
        kn_engine_moe_free(e);
        TD_LOG_ERR("cannot set up the experts' scratch for %lld tokens", (long long)n);
        return rc ? rc : TD_ENOMEM;
    }
    mo->cap = n;
    return 0;
}

/* The experts other ranks or members hold read the zero row in the combine (ep, dp
 * attention). */
static void zero_others(kn_engine *e, int64_t nk)
{
    kn_engine_moe *mo = &e->moe;
    const int x0 = e->m->x0, x1 = e->m->x0 + e->m->n_x_local;
    if (x1 - x0 < e->m->hp.n_expert)
        for (int64_t ch = 0; ch < nk; ch++)
            if (mo->plan.expert[ch] < x0 || mo->plan.expert[ch] >= x1)
                mo->plan.slot[ch] = (int32_t)(mo->cap * e->m->hp.n_expert_used);
}

/* The plan for the layer: routed on the host, and in backend memory for a device backend
 * (*tok, *slot, *wt point at the arrays the ops read). */
static int route(kn_engine *e, const kn_layer *ly, const float *h, int64_t n, int64_t solo,
                 const int32_t **tok, const int32_t **slot, const float **wt)
{
    kn_engine_moe *mo = &e->moe;
    const kn_backend_ops *ops = e->be.ops;
    const int64_t X = e->m->hp.n_expert, nk = n * e->m->hp.n_expert_used;
    int rc = kn_engine_matmul(e, &ly->gate_inp, h, n, solo, mo->rl);
    if (rc) return rc;
    const float *logits = mo->rl;
    if (e->dev) {
        if ((rc = ops->download(e->be.ctx, mo->h_rl, mo->rl, (size_t)(n * X) * sizeof(float))))
            return rc;
        logits = mo->h_rl;
    }
    if ((rc = kn_moe_route(&e->m->hp, ly->exp_probs_b, logits, n, &mo->plan))) return rc;
    zero_others(e, nk);
    *tok = mo->plan.token;
    *slot = mo->plan.slot;
    *wt = mo->plan.weight;
    if (!e->dev) return 0;
    if ((rc = ops->upload(e->be.ctx, mo->tok, mo->plan.token, (size_t)nk * 4)) ||
        (rc = ops->upload(e->be.ctx, mo->slot, mo->plan.slot, (size_t)nk * 4)) ||
        (rc = ops->upload(e->be.ctx, mo->wt, mo->plan.weight, (size_t)nk * 4)))
        return rc;
    *tok = mo->tok;
    *slot = mo->slot;
    *wt = mo->wt;
    return 0;
}

/* The layer's groups (the experts this rank holds that have tokens) into mo->grp: each
 * reads its rows of the gathered tokens and writes its rows of the grouped outputs. */
static int groups_of(kn_engine *e, const kn_layer *ly, int64_t solo)
{
    kn_engine_moe *mo = &e->moe;
    const kn_moe_plan *p = &mo->plan;
    kn_engine_groups *gr = &mo->grp;
    const int64_t E = e->m->hp.n_embd, F = e->m->n_ffe_local;
    int n = 0;
    for (int x = 0; x < e->m->hp.n_expert; x++) {
        const int32_t o0 = p->offset[x], cnt = p->offset[x + 1] - o0;
        if (!cnt || !ly->exp_gate[x].data) continue; /* no token, or held by another rank */
        int64_t es = 0;                              /* the group's leading solo rows */
        while (es < cnt && p->token[o0 + es] < solo)
            es++;
        gr->wg[n] = &ly->exp_gate[x];
        gr->wu[n] = &ly->exp_up[x];
        gr->wd[n] = &ly->exp_down[x];
        gr->x[n] = mo->xe + (int64_t)o0 * E;
        gr->m[n] = cnt;
        gr->solo[n] = es;
        gr->g[n] = mo->ge + (int64_t)o0 * F;
        gr->u[n] = mo->ue + (int64_t)o0 * F;
        gr->y[n] = mo->ye + (int64_t)o0 * E;
        n++;
    }
    return n;
}

/* Every group's FFN on its rows: at once where the backend can (experts_ffn), else one
 * expert after another. */
static int experts(kn_engine *e, int ng)
{
    const kn_engine_groups *gr = &e->moe.grp;
    const kn_backend_ops *ops = e->be.ops;
    if (ops->experts_ffn)
        return ops->experts_ffn(e->be.ctx, ng, gr->wg, gr->wu, gr->wd, gr->x, gr->m, gr->solo,
                                e->m->hp.gelu_ffn, gr->g, gr->u, gr->y);
    int rc = 0;
    for (int i = 0; i < ng && !rc; i++)
        if (!(rc = kn_engine_glu(e, gr->wg[i], gr->wu[i], gr->x[i], gr->m[i], gr->solo[i], gr->g[i],
                                 gr->u[i])))
            rc = kn_engine_matmul(e, gr->wd[i], gr->g[i], gr->m[i], gr->solo[i], gr->y[i]);
    return rc;
}

/* Data-parallel attention (the top comment): h (n, n_embd) this member's rows, n may be 0. */
static int moe_ffn_dp(kn_engine *e, const kn_layer *ly, const float *h, int64_t n, int64_t solo)
{
    const kn_hparams *hp = &e->m->hp;
    const kn_backend_ops *ops = e->be.ops;
    void *c = e->be.ctx;
    kn_engine_moe *mo = &e->moe;
    const int64_t E = hp->n_embd, k = hp->n_expert_used, W = E + 2 * k;
    const int64_t N = e->dp_all;
    int rc = 0;
    if (n > 0) { /* this member's choices, packed beside its rows */
        if ((rc = kn_engine_matmul(e, &ly->gate_inp, h, n, solo, mo->rl)) ||
            (rc = kn_moe_choose(hp, ly->exp_probs_b, mo->rl, n, &mo->own)))
            return rc;
        for (int64_t i = 0; i < n; i++) {
            float *row = mo->pk + i * W;
            memcpy(row, h + i * E, (size_t)E * sizeof *row);
            for (int64_t j = 0; j < k; j++) {
                row[E + j] = (float)mo->own.expert[i * k + j]; /* exact: ids < 2^24 */
                row[E + k + j] = mo->own.weight[i * k + j];
            }
        }
    }
    if ((rc = e->coll.dp_gather(e->coll.ctx, mo->pk, e->dp_counts, W, mo->pa))) return rc;
    if ((rc = kn_moe_plan_reserve(&mo->plan, N, (int)k, hp->n_expert))) return rc;
    for (int64_t i = 0; i < N; i++) {
        const float *row = mo->pa + i * W;
        memcpy(mo->ha + i * E, row, (size_t)E * sizeof *row);
        for (int64_t j = 0; j < k; j++) {
            const float x = row[E + j];
            if (!(x >= 0 && x < hp->n_expert)) {
                TD_LOG_ERR("dp attention: gathered row %lld names expert %g", (long long)i,
                           (double)x);
                return TD_EINVAL;
            }
            mo->plan.expert[i * k + j] = (int32_t)x;
            mo->plan.weight[i * k + j] = row[E + k + j];
        }
    }
    kn_moe_group(&mo->plan, N);
    zero_others(e, N * k);
    if (N > 0) {
        ops->copy_rows(c, mo->ha, mo->plan.token, N * k, E, mo->xe);
        if ((rc = experts(e, groups_of(e, ly, e->dp_all_solo)))) return rc;
        ops->weighted_rows_sum(c, mo->ye, mo->plan.slot, mo->plan.weight, (int)k, N, E, mo->ma);
    }
    if ((rc = e->coll.dp_reduce(e->coll.ctx, mo->ma, e->dp_counts, E, mo->mo))) return rc;
    if (n == 0) return 0;
    if (ly->sh_gate.data) {
        if ((rc = kn_engine_glu(e, &ly->sh_gate, &ly->sh_up, h, n, solo, e->g, e->u)) ||
            (rc = kn_engine_matmul(e, &ly->sh_down, e->g, n, solo, mo->xe)))
            return rc;
        ops->add(c, mo->mo, mo->xe, n, E);
    }
    ops->add(c, e->x, mo->mo, n, E);
    return 0;
}

int kn_engine_moe_ffn(kn_engine *e, const kn_layer *ly, const float *h, int64_t n, int64_t solo)
{
    if (e->m->shard.dp_size > 1) return moe_ffn_dp(e, ly, h, n, solo);
    const kn_hparams *hp = &e->m->hp;
    const kn_backend_ops *ops = e->be.ops;
    void *c = e->be.ctx;
    kn_engine_moe *mo = &e->moe;
    const int64_t E = hp->n_embd;
    const int32_t *tok, *slot;
    const float *wt;
    int rc = route(e, ly, h, n, solo, &tok, &slot, &wt);
    if (rc) return rc;
    ops->copy_rows(c, h, tok, n * hp->n_expert_used, E, mo->xe);
    if ((rc = experts(e, groups_of(e, ly, solo)))) return rc;
    ops->weighted_rows_sum(c, mo->ye, slot, wt, hp->n_expert_used, n, E, mo->mo);
    if (ly->sh_gate.data) {
        if ((rc = kn_engine_glu(e, &ly->sh_gate, &ly->sh_up, h, n, solo, e->g, e->u)) ||
            (rc = kn_engine_matmul(e, &ly->sh_down, e->g, n, solo, mo->xe)))
            return rc;
        ops->add(c, mo->mo, mo->xe, n, E);
    }
    return kn_engine_reduce_add(e, mo->mo, n, NULL, false);
}
