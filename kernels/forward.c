/* forward.c: the forward pass of a model shard over one batch (kn_engine).
 *
 * Reads top to bottom like the math of a pre-norm Llama block:
 *   x = embed(tokens) [* sqrt(n_embd) gemma3, * embedding_scale granite] | embd_in
 *                                                          first stage | later stages
 *   for each local layer:
 *     h = rmsnorm(x) [olmo2: h = x] ; q, k, v = h Wq, h Wk, h Wv (+ bias)
 *       [qwen3/gemma3: rmsnorm per head; olmo2: over the whole q and k]
 *     rope(q, k) [not on smollm3's every 4th layer] ; write k, v to the paged pool ;
 *     a = attention(q, pool) [gemma2: scores soft-capped, cap * tanh(s / cap)]
 *       [gemma2/gemma3 sliding-window layers: window keys only; gemma3's: own rope base]
 *     x += [post-norm] allreduce(a Wo) [* residual_scale granite]
 *                                                      TP: each rank holds heads' share
 *     h = rmsnorm(x) [olmo2: x] ; x += [post-norm] allreduce((act(h Wg) * h Wu) Wd) [* ...]
 *       act: silu, or gelu (tanh) for gemma2/gemma3
 *   last stage: logits = rmsnorm(x[rows]) Wout [/ logit_scale granite]
 *                        [gemma2: cap * tanh(logits / cap)] ; else out = x
 *     TP: each rank's Wout holds a vocab slice; gather_cols joins the slices on rank 0
 * Every matmul keeps the batch's first n_solo rows batch-invariant (model.h): through the
 * backend's matmul_mixed, or row by row when the backend has none. Where the backend has
 * the optional fused ops (kn_backend.h), q, k, v are one matmul_multi, gate, up and the
 * activation one glu_ffn, and each output projection with its residual add one matmul_add
 * (tp 1 without post-norm), with the same bits as the sequences they replace.
 * The pass is in parts (input, each layer's attention half and feed-forward half, output) so
 * that two-batch overlap (forward_tbo.c) can interleave two micro-batches; an engine that
 * defers posts each all-reduce (kn_engine_reduce_add) and finishes it (kn_engine_settle)
 * before its next half.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine_int.h"
#include "td_err.h"

/* The ops every backend must have, and the memory ops a device backend needs on top. */
static int check_ops(const kn_backend_ops *o)
{
    const void *need[] = {o->matmul,    o->rmsnorm,  o->rope,   o->swiglu,  o->geglu, o->kv_write,
                          o->attention, o->get_rows, o->add,    o->add_row, o->scale, o->copy_rows,
                          o->alloc,     o->free,     o->upload, o->download};
    for (size_t i = 0; i < sizeof need / sizeof *need; i++)
        if (!need[i]) return TD_EINVAL;
    if (!o->host_memory && (!o->map_matrix || !o->map_vector || !o->synchronize)) return TD_EINVAL;
    if (!o->host_alloc != !o->host_free) return TD_EINVAL;
    return 0;
}

int kn_engine_create(const kn_model *m, kn_backend be, const kn_collective *coll, kn_engine **out)
{
    *out = NULL;
    if (!be.ops || check_ops(be.ops)) {
        TD_LOG_ERR("backend '%s' lacks ops the engine needs", be.ops ? be.ops->name : "(none)");
        return TD_EINVAL;
    }
    if (m->shard.tp_size > 1 && (!coll || !coll->allreduce_sum)) {
        TD_LOG_ERR("tp %d needs an allreduce", m->shard.tp_size);
        return TD_EINVAL;
    }
    if (m->hp.kv_lora_rank && !be.ops->copy_2d) {
        TD_LOG_ERR("backend '%s' cannot run latent attention (no copy_2d)", be.ops->name);
        return TD_EUNSUPP;
    }
    if (m->hp.n_expert && !be.ops->weighted_rows_sum) {
        TD_LOG_ERR("backend '%s' cannot run mixture-of-experts layers (no weighted_rows_sum)",
                   be.ops->name);
        return TD_EUNSUPP;
    }
    if (m->shard.tp_size > 1 && m->last && !coll->gather_cols) {
        TD_LOG_ERR("tp %d: the vocab-parallel LM head needs a gather", m->shard.tp_size);
        return TD_EINVAL;
    }
    const int dp = m->shard.dp_size > 1 ? m->shard.dp_size : 1;
    if (dp > 1 && (!coll || !coll->dp_counts || !coll->dp_gather || !coll->dp_reduce)) {
        TD_LOG_ERR("dp attention %d needs the group's collectives", dp);
        return TD_EINVAL;
    }
    if (dp > 1 && !be.ops->host_memory) {
        TD_LOG_ERR("dp attention runs on host-memory backends; '%s' is not one", be.ops->name);
        return TD_EUNSUPP;
    }
    kn_engine *e = calloc(1, sizeof *e);
    if (!e) return TD_ENOMEM;
    if (dp > 1 && !(e->dp_counts = calloc((size_t)(2 * dp), sizeof *e->dp_counts))) {
        free(e);
        return TD_ENOMEM;
    }
    e->m = m;
    e->be = be;
    e->dev = !be.ops->host_memory;
    if (coll) e->coll = *coll;
    /* a host backend with map_matrix learns which matrices are the model's weights */
    int rc = e->dev || be.ops->map_matrix ? kn_engine_map_model(e) : 0;
    if (rc) {
        kn_engine_destroy(e);
        return rc;
    }
    *out = e;
    return 0;
}

static void free_scratch(kn_engine *e)
{
    float **bufs[] = {&e->x, &e->h, &e->q, &e->k, &e->v, &e->att, &e->g, &e->u, &e->sel, &e->cat};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) {
        if (*bufs[i]) e->be.ops->free(e->be.ctx, *bufs[i]);
        *bufs[i] = NULL;
    }
    e->cap = 0;
}

void kn_engine_destroy(kn_engine *e)
{
    if (!e) return;
    kn_engine_tbo_free(e);
    free_scratch(e);
    kn_engine_moe_free(e);
    kn_engine_mla_free(e);
    if (e->lg) e->be.ops->free(e->be.ctx, e->lg);
    kn_engine_stage_free(e);
    free(e->dp_counts);
    free(e);
}

void kn_engine_free_bufs(kn_engine *e, void **const *bufs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (*bufs[i]) e->be.ops->free(e->be.ctx, *bufs[i]);
        *bufs[i] = NULL;
    }
}

int kn_engine_alloc_bufs(kn_engine *e, const kn_engine_buf *b, size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        if (!b[i].buf) continue;
        *b[i].buf = e->be.ops->alloc(e->be.ctx, (size_t)b[i].elems * 4);
        if (*b[i].buf) continue;
        for (size_t j = 0; j < i; j++)
            if (b[j].buf) kn_engine_free_bufs(e, &b[j].buf, 1);
        TD_LOG_ERR("cannot allocate the %s scratch (%lld elements)", what, (long long)b[i].elems);
        return TD_ENOMEM;
    }
    return 0;
}

/* The activations of n tokens, in the backend's memory. */
int kn_engine_reserve(kn_engine *e, int64_t n)
{
    int rc = kn_engine_moe_reserve(e, n);
    if (!rc) rc = kn_engine_mla_reserve(e, n);
    if (rc || n <= e->cap) return rc;
    free_scratch(e);
    const kn_model *m = e->m;
    int64_t E = m->hp.n_embd, HD = m->hp.head_dim;
    int64_t nq = m->heads.n_q * HD, nkv = m->heads.n_kv * HD, F = kn_engine_ffn_width(m);
    struct {
        float **buf;
        int64_t width;
    } want[] = {
        {&e->x, E},    {&e->h, E}, {&e->q, nq}, {&e->k, nkv}, {&e->v, nkv},
        {&e->att, nq}, {&e->g, F}, {&e->u, F},  {&e->sel, E}, {&e->cat, m->shard.mtp ? 2 * E : 0}};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        if (!want[i].width) continue;
        *want[i].buf = e->be.ops->alloc(e->be.ctx, (size_t)(n * want[i].width) * sizeof(float));
        if (!*want[i].buf) {
            free_scratch(e);
            TD_LOG_ERR("cannot allocate activations for %lld tokens", (long long)n);
            return TD_ENOMEM;
        }
    }
    e->cap = n;
    return 0;
}

/* Leading logit rows that belong to solo rows (they must all be leading: validate). */
static int solo_logits(const kn_batch *b)
{
    int i = 0;
    while (i < b->n_logits && b->logit_rows[i] < b->n_solo)
        i++;
    return i;
}

int kn_engine_matmul(const kn_engine *e, const kn_mat *w, const float *x, int64_t m, int64_t solo,
                     float *y)
{
    const kn_backend_ops *ops = e->be.ops;
    void *c = e->be.ctx;
    if (solo == 0) return ops->matmul(c, w, x, m, y);
    if (ops->matmul_mixed) return ops->matmul_mixed(c, w, x, m, solo, y);
    int rc;
    for (int64_t i = 0; i < solo; i++)
        if ((rc = ops->matmul(c, w, x + i * w->n_cols, 1, y + i * w->n_rows))) return rc;
    if (m == solo) return 0;
    return ops->matmul(c, w, x + solo * w->n_cols, m - solo, y + solo * w->n_rows);
}

/* Everything in the batch that comes from outside is checked here, before any kernel
 * indexes memory with it. */
static int validate(const kn_engine *e, const kn_kv_pool *kv, const kn_batch *b)
{
    const kn_model *m = e->m;
    if (b->n_tokens < 1 || b->n_seqs < 1 || !b->pos || !b->seq_of || !b->seqs) {
        TD_LOG_ERR("empty or incomplete batch (%lld tokens, %d seqs)", (long long)b->n_tokens,
                   b->n_seqs);
        return TD_EINVAL;
    }
    if (b->n_solo < 0 || b->n_solo > b->n_tokens) {
        TD_LOG_ERR("%lld solo rows in a batch of %lld tokens", (long long)b->n_solo,
                   (long long)b->n_tokens);
        return TD_EINVAL;
    }
    if (m->first ? !b->tokens : !b->embd) {
        TD_LOG_ERR("batch lacks %s for this stage", m->first ? "tokens" : "input hidden states");
        return TD_EINVAL;
    }
    if (m->shard.mtp && !b->embd) {
        TD_LOG_ERR("an MTP block's batch lacks the trunk's hidden states");
        return TD_EINVAL;
    }
    if (kv->n_layers != m->shard.l1 - m->shard.l0 || kv->n_kv_heads != m->heads.n_kv ||
        kv->head_dim != m->hp.head_dim) {
        TD_LOG_ERR("kv pool shape (%d layers, %d heads, dim %d) does not match the shard",
                   kv->n_layers, kv->n_kv_heads, kv->head_dim);
        return TD_EINVAL;
    }
    /* a latent pool has no V of its own: a model with a value apart would write it over K */
    if ((kv->layout == KN_KV_LAYOUT_LATENT) != (m->hp.kv_lora_rank > 0)) {
        TD_LOG_ERR("kv pool layout %s does not match the model's (%s: kn_model_kv_params)",
                   kn_kv_layout_name(kv->layout), m->hp.kv_lora_rank > 0 ? "latent" : "K+V");
        return TD_EINVAL;
    }
    for (int s = 0; s < b->n_seqs; s++) {
        const kn_seq_view *sv = &b->seqs[s];
        if (sv->n_ctx < 0 || (sv->n_ctx > 0 && !sv->block_table)) {
            TD_LOG_ERR("seq %d: bad context length %d", s, sv->n_ctx);
            return TD_EINVAL;
        }
        int nb = kn_kv_blocks_for(kv, sv->n_ctx);
        for (int j = 0; j < nb; j++)
            if (sv->block_table[j] < 0 || sv->block_table[j] >= kv->n_blocks) {
                TD_LOG_ERR("seq %d: block table entry %d is %d (pool has %d blocks)", s, j,
                           sv->block_table[j], kv->n_blocks);
                return TD_ERANGE;
            }
    }
    for (int64_t i = 0; i < b->n_tokens; i++) {
        int32_t s = b->seq_of[i];
        if (s < 0 || s >= b->n_seqs) {
            TD_LOG_ERR("token %lld: sequence index %d out of range", (long long)i, s);
            return TD_EINVAL;
        }
        if (b->pos[i] < 0 || b->pos[i] >= b->seqs[s].n_ctx) {
            TD_LOG_ERR("token %lld: position %d outside the sequence's %d positions", (long long)i,
                       b->pos[i], b->seqs[s].n_ctx);
            return TD_ERANGE;
        }
        if (m->first && (b->tokens[i] < 0 || b->tokens[i] >= m->hp.n_vocab)) {
            TD_LOG_ERR("token %lld: id %d outside the vocabulary (%d)", (long long)i, b->tokens[i],
                       m->hp.n_vocab);
            return TD_ERANGE;
        }
    }
    if (m->last) {
        if (b->n_logits < 0 || (b->n_logits > 0 && !b->logit_rows)) return TD_EINVAL;
        for (int i = 0; i < b->n_logits; i++)
            if (b->logit_rows[i] < 0 || b->logit_rows[i] >= b->n_tokens) {
                TD_LOG_ERR("logit row %d out of the batch's %lld tokens", b->logit_rows[i],
                           (long long)b->n_tokens);
                return TD_ERANGE;
            }
        int lead = solo_logits(b);
        for (int i = lead; i < b->n_logits; i++)
            if (b->logit_rows[i] < b->n_solo) {
                TD_LOG_ERR("logit row %d of solo row %d comes after a logit row of another row", i,
                           b->logit_rows[i]);
                return TD_EINVAL;
            }
    }
    return 0;
}

/* q, k, v = h Wq, h Wk, h Wv: one fused op when the backend has it. */
static int qkv(const kn_engine *e, const kn_layer *ly, const float *h, int64_t n, int64_t solo)
{
    if (e->be.ops->matmul_multi) {
        const kn_mat *w[3] = {&ly->wq, &ly->wk, &ly->wv};
        float *const y[3] = {e->q, e->k, e->v};
        return e->be.ops->matmul_multi(e->be.ctx, 3, w, h, n, solo, y);
    }
    int rc;
    if ((rc = kn_engine_matmul(e, &ly->wq, h, n, solo, e->q))) return rc;
    if ((rc = kn_engine_matmul(e, &ly->wk, h, n, solo, e->k))) return rc;
    return kn_engine_matmul(e, &ly->wv, h, n, solo, e->v);
}

/* g = act(h Wg) * (h Wu), act silu or gelu (tanh): one fused op when the backend has it. */
int kn_engine_glu(const kn_engine *e, const kn_mat *wg, const kn_mat *wu, const float *h, int64_t n,
                  int64_t solo, float *g, float *u)
{
    const kn_backend_ops *ops = e->be.ops;
    const bool gelu = e->m->hp.gelu_ffn;
    if (ops->glu_ffn) return ops->glu_ffn(e->be.ctx, wg, wu, h, n, solo, gelu, g, u, g);
    int rc;
    if ((rc = kn_engine_matmul(e, wg, h, n, solo, g))) return rc;
    if ((rc = kn_engine_matmul(e, wu, h, n, solo, u))) return rc;
    if (gelu)
        ops->geglu(e->be.ctx, g, u, g, n, wg->n_rows);
    else
        ops->swiglu(e->be.ctx, g, u, g, n, wg->n_rows);
    return 0;
}

/* On a device backend through host memory. */
int kn_engine_allreduce(kn_engine *e, float *buf, int64_t n)
{
    if (e->m->shard.tp_size == 1) return 0;
    if (e->dev) return kn_engine_allreduce_staged(e, buf, n);
    return e->coll.allreduce_sum(e->coll.ctx, buf, n);
}

/* What follows an all-reduce: x += [post_norm] buf [* residual_scale]. */
static void finish_add(kn_engine *e, float *buf, int64_t n, const float *post_norm, bool scaled)
{
    const kn_backend_ops *ops = e->be.ops;
    const kn_hparams *hp = &e->m->hp;
    const int64_t E = hp->n_embd;
    /* gemma3/olmo2 normalize the (whole, reduced) output before the residual add */
    if (post_norm) ops->rmsnorm(e->be.ctx, buf, post_norm, buf, n, E, hp->rms_eps);
    if (scaled) ops->scale(e->be.ctx, buf, n * E, hp->residual_scale); /* granite */
    ops->add(e->be.ctx, e->x, buf, n, E);
}

int kn_engine_reduce_add(kn_engine *e, float *buf, int64_t n, const float *post_norm, bool scaled)
{
    const int64_t N = n * e->m->hp.n_embd;
    if (e->defer && e->m->shard.tp_size > 1) { /* a micro-batch: the rest after the other's work */
        uint64_t ticket;
        int rc = e->dev ? kn_engine_allreduce_post_staged(e, buf, N, &ticket)
                        : e->coll.allreduce_post(e->coll.ctx, buf, N, &ticket);
        if (rc) return rc;
        e->pend = (kn_engine_pending){.on = true,
                                      .buf = buf,
                                      .rows = n,
                                      .post_norm = post_norm,
                                      .scaled = scaled,
                                      .ticket = ticket};
        return 0;
    }
    int rc = kn_engine_allreduce(e, buf, N);
    if (rc) return rc;
    finish_add(e, buf, n, post_norm, scaled);
    return 0;
}

int kn_engine_settle(kn_engine *e)
{
    kn_engine_pending *p = &e->pend;
    if (!p->on) return 0;
    p->on = false;
    const int64_t N = p->rows * e->m->hp.n_embd;
    int rc = e->dev ? kn_engine_allreduce_wait_staged(e, p->ticket, p->buf, N)
                    : e->coll.allreduce_wait(e->coll.ctx, p->ticket, p->buf, N);
    if (rc) return rc;
    finish_add(e, p->buf, p->rows, p->post_norm, p->scaled);
    return 0;
}

/* x += [post_norm] allreduce(in W) [* residual_scale]: one fused op where nothing comes
 * between the product and the add (tp 1, no post-norm, no scale) and the backend has it. */
int kn_engine_project_add(kn_engine *e, const kn_mat *w, const float *in, const float *post_norm,
                          int64_t n, int64_t solo)
{
    const kn_backend_ops *ops = e->be.ops;
    const bool scaled = e->m->hp.residual_scale != 1.0f;
    if (ops->matmul_add && e->m->shard.tp_size == 1 && !post_norm && !scaled)
        return ops->matmul_add(e->be.ctx, w, in, n, solo, e->h, e->x);
    int rc = kn_engine_matmul(e, w, in, n, solo, e->h);
    if (rc) return rc;
    return kn_engine_reduce_add(e, e->h, n, post_norm, scaled);
}

/* q, k (n rows) normalized: per head (qwen3, gemma3) or over the whole projection (olmo2,
 * tp 1 only), then rotated unless the layer has no rope (smollm3's every 4th). */
static void qk_norm_rope(kn_engine *e, const kn_layer *ly, const kn_batch *b, int il,
                         const float *freq)
{
    const kn_backend_ops *ops = e->be.ops;
    void *c = e->be.ctx;
    const kn_hparams *hp = &e->m->hp;
    const int64_t n = b->n_tokens, HD = hp->head_dim;
    const int nh = e->m->heads.n_q, nkv = e->m->heads.n_kv;
    const int64_t rows_q = hp->qk_norm_whole ? n : n * nh, dim_q = hp->qk_norm_whole ? nh * HD : HD;
    const int64_t rows_k = hp->qk_norm_whole ? n : n * nkv;
    const int64_t dim_k = hp->qk_norm_whole ? nkv * HD : HD;
    if (ly->q_norm) ops->rmsnorm(c, e->q, ly->q_norm, e->q, rows_q, dim_q, hp->rms_eps);
    if (ly->k_norm) ops->rmsnorm(c, e->k, ly->k_norm, e->k, rows_k, dim_k, hp->rms_eps);
    if (!kn_layer_has_rope(hp, il)) return;
    ops->rope(c, e->q, n, nh, (int)HD, hp->n_rot, b->pos, freq, hp->rope_neox);
    ops->rope(c, e->k, n, nkv, (int)HD, hp->n_rot, b->pos, freq, hp->rope_neox);
}

/* x += [post-norm] allreduce(attention(in) Wo): local layer li's attention block. */
static int attention_block(kn_engine *e, kn_kv_pool *kv, const kn_batch *b, int li, const float *in)
{
    const kn_model *m = e->m;
    const kn_hparams *hp = &m->hp;
    const kn_layer *ly = &m->layers[li];
    const kn_backend_ops *ops = e->be.ops;
    void *c = e->be.ctx;
    const int64_t n = b->n_tokens, solo = b->n_solo, HD = hp->head_dim;
    const int nh = m->heads.n_q, nkv = m->heads.n_kv;
    const int il = m->shard.l0 + li;
    const bool swa = kn_layer_is_swa(hp, il);
    int rc;
    if ((rc = qkv(e, ly, in, n, solo))) return rc;
    if (ly->bq) ops->add_row(c, e->q, ly->bq, n, nh * HD);
    if (ly->bk) ops->add_row(c, e->k, ly->bk, n, nkv * HD);
    if (ly->bv) ops->add_row(c, e->v, ly->bv, n, nkv * HD);
    qk_norm_rope(e, ly, b, il, swa ? m->rope_freq_swa : m->rope_freq);
    ops->kv_write(c, kv->k[li], kv->v[li], kv->type, kv->block_size, &kv->slicing, nkv, (int)HD,
                  e->k, e->v, n, b->pos, b->seq_of, b->seqs);
    ops->attention(c, e->q, kv->k[li], kv->v[li], kv->type, kv->block_size, &kv->slicing, nh, nkv,
                   m->heads.group, m->heads.phase, (int)HD, hp->attn_scale,
                   swa ? hp->swa_window : 0, hp->attn_softcap, n, solo, b->pos, b->seq_of, b->seqs,
                   e->att);
    return kn_engine_project_add(e, &ly->wo, e->att, ly->attn_post_norm, n, solo);
}

int kn_engine_attn_half(kn_engine *e, kn_kv_pool *kv, const kn_batch *b, int li)
{
    const kn_model *m = e->m;
    const kn_hparams *hp = &m->hp;
    const kn_layer *ly = &m->layers[li];
    /* olmo2 has no pre-norms: the blocks read x itself; deepseek2 attends on latent KV
     * (forward_mla.c) */
    const float *in = ly->attn_norm ? e->h : e->x;
    if (ly->attn_norm)
        e->be.ops->rmsnorm(e->be.ctx, e->x, ly->attn_norm, e->h, b->n_tokens, hp->n_embd,
                           hp->rms_eps);
    return hp->kv_lora_rank ? kn_engine_mla_attention(e, kv, b, li, in)
                            : attention_block(e, kv, b, li, in);
}

int kn_engine_ffn_half(kn_engine *e, const kn_batch *b, int li)
{
    const kn_model *m = e->m;
    const kn_hparams *hp = &m->hp;
    const kn_layer *ly = &m->layers[li];
    const int64_t n = b->n_tokens, solo = b->n_solo;
    /* dense, or the layer's experts (forward_moe.c) */
    if (ly->ffn_norm)
        e->be.ops->rmsnorm(e->be.ctx, e->x, ly->ffn_norm, e->h, n, hp->n_embd, hp->rms_eps);
    const float *fin = ly->ffn_norm ? e->h : e->x;
    if (kn_layer_is_moe(hp, m->shard.l0 + li)) return kn_engine_moe_ffn(e, ly, fin, n, solo);
    int rc = kn_engine_glu(e, &ly->w_gate, &ly->w_up, fin, n, solo, e->g, e->u);
    return rc ? rc : kn_engine_project_add(e, &ly->w_down, e->g, ly->ffn_post_norm, n, solo);
}

/* logits (n_logits, n_vocab) = sel Wout on one rank; with tp > 1 each rank computes its
 * vocab slice (n_logits, n_vocab_local) and gather_cols joins them in rank 0's out. A device
 * backend computes into its own memory and downloads (with tp > 1, its slice, which the
 * host gather joins). */
static int lm_head(kn_engine *e, const kn_batch *b, float *out)
{
    const kn_model *m = e->m;
    const int nl = b->n_logits;
    if (e->dev) {
        const bool tp = m->shard.tp_size > 1;
        const int64_t n = (int64_t)nl * (tp ? m->n_vocab_local : m->hp.n_vocab);
        float *d = kn_engine_stage_out(e, n);
        if (!d) return TD_ENOMEM;
        int rc = kn_engine_matmul(e, &m->output, e->sel, nl, solo_logits(b), d);
        if (rc) return rc;
        if (tp) return kn_engine_gather_staged(e, d, nl, m->shard.tp_rank == 0 ? out : NULL);
        return e->be.ops->download(e->be.ctx, out, d, (size_t)n * sizeof(float));
    }
    if (m->shard.tp_size == 1)
        return kn_engine_matmul(e, &m->output, e->sel, nl, solo_logits(b), out);
    if (nl > e->cap_lg) {
        if (e->lg) e->be.ops->free(e->be.ctx, e->lg);
        e->cap_lg = 0;
        e->lg = e->be.ops->alloc(e->be.ctx, (size_t)nl * (size_t)m->n_vocab_local * sizeof(float));
        if (!e->lg) {
            TD_LOG_ERR("cannot allocate the logit slice of %d rows", nl);
            return TD_ENOMEM;
        }
        e->cap_lg = nl;
    }
    int rc = kn_engine_matmul(e, &m->output, e->sel, nl, solo_logits(b), e->lg);
    if (rc) return rc;
    return e->coll.gather_cols(e->coll.ctx, e->lg, nl, m->hp.n_vocab,
                               m->shard.tp_rank == 0 ? out : NULL);
}

/* The logits' last step, on the host (out is the caller's host buffer, whole on rank 0):
 * granite's 1 / logit_scale, as llama.cpp multiplies by it; gemma2's final soft-cap,
 * cap * tanh(logit / cap), after it (llama.cpp's order: scale by 1 / cap, tanh, scale). */
static void finish_logits(const kn_hparams *hp, float *out, int64_t n)
{
    if (hp->logit_scale != 1.0f) {
        const float s = 1.0f / hp->logit_scale;
        for (int64_t i = 0; i < n; i++)
            out[i] *= s;
    }
    if (hp->final_softcap > 0.0f) {
        const float cap = hp->final_softcap, inv = 1.0f / cap;
        for (int64_t i = 0; i < n; i++)
            out[i] = cap * tanhf(out[i] * inv);
    }
}

/* An MTP block's input (model.h kn_shard.mtp, llama.cpp's graph_mtp): x = eh_proj
 * [rmsnorm(embd(token)) * enorm, rmsnorm(h) * hnorm], h the trunk's normed hidden state of the
 * position before each token (hidden, host memory). */
static int mtp_input(kn_engine *e, const kn_batch *db, const float *hidden)
{
    const kn_model *m = e->m;
    const kn_backend_ops *ops = e->be.ops;
    void *c = e->be.ctx;
    const int64_t n = db->n_tokens, E = m->hp.n_embd;
    const float eps = m->hp.rms_eps;
    int rc;
    if ((rc = ops->get_rows(c, &m->tok_embd, db->tokens, n, e->x))) return rc;
    ops->rmsnorm(c, e->x, m->mtp_enorm, e->h, n, E, eps);
    ops->copy_2d(c, e->h, E, e->cat, 2 * E, n, E);
    if ((rc = ops->upload(c, e->x, hidden, (size_t)(n * E) * sizeof(float)))) return rc;
    ops->rmsnorm(c, e->x, m->mtp_hnorm, e->h, n, E, eps);
    ops->copy_2d(c, e->h, E, e->cat + E, 2 * E, n, E);
    return kn_engine_matmul(e, &m->mtp_eh_proj, e->cat, n, db->n_solo, e->x);
}

/* Data-parallel attention: the group's counts of this forward (every member's rows and solo
 * rows; a member whose batch is empty or bad offers none) into e->dp_*, and the MoE scratch
 * for all of them. */
static int dp_begin(kn_engine *e, int64_t n, int64_t solo)
{
    const int64_t mine[2] = {n, solo};
    int rc = e->coll.dp_counts(e->coll.ctx, mine, e->dp_counts);
    if (rc) return rc;
    int64_t at, rest_at;
    td_dp_layout(e->dp_counts, e->m->shard.dp_size, e->m->shard.dp_rank, &at, &rest_at, &e->dp_all,
                 &e->dp_all_solo);
    return kn_engine_moe_reserve(e, e->dp_all > n ? e->dp_all : n);
}

/* A member without rows in this forward: its part of every MoE layer's collectives (the
 * other members' rows through the experts it holds), nothing else. */
static int dp_idle(kn_engine *e)
{
    const kn_model *m = e->m;
    int rc = dp_begin(e, 0, 0);
    for (int li = 0; li < m->shard.l1 - m->shard.l0 && !rc; li++)
        if (kn_layer_is_moe(&m->hp, m->shard.l0 + li))
            rc = kn_engine_moe_ffn(e, &m->layers[li], NULL, 0, 0);
    return rc;
}

int kn_engine_forward_idle(kn_engine *e)
{
    if (e->m->shard.dp_size <= 1) return 0;
    return dp_idle(e);
}

int kn_engine_input(kn_engine *e, const kn_batch *b, const kn_batch *db)
{
    const kn_model *m = e->m;
    const kn_backend_ops *ops = e->be.ops;
    void *c = e->be.ctx;
    const int64_t n = b->n_tokens, E = m->hp.n_embd;
    int rc;
    if (m->shard.mtp) return mtp_input(e, db, b->embd);
    if (!m->first) return ops->upload(c, e->x, b->embd, (size_t)(n * E) * sizeof(float));
    if ((rc = ops->get_rows(c, &m->tok_embd, db->tokens, n, e->x))) return rc;
    if (m->hp.embd_scale != 1.0f) ops->scale(c, e->x, n * E, m->hp.embd_scale);
    return 0;
}

int kn_engine_output(kn_engine *e, const kn_batch *b, const kn_batch *db, float *out)
{
    const kn_model *m = e->m;
    const kn_backend_ops *ops = e->be.ops;
    void *c = e->be.ctx;
    const int64_t n = b->n_tokens, E = m->hp.n_embd;
    int rc;
    if (!m->last) return ops->download(c, out, e->x, (size_t)(n * E) * sizeof(float));
    if (b->hidden_out) {
        ops->rmsnorm(c, e->x, m->output_norm, e->h, n, E, m->hp.rms_eps);
        if ((rc = ops->download(c, b->hidden_out, e->h, (size_t)(n * E) * sizeof(float))))
            return rc;
    }
    if (b->n_logits == 0) return e->dev ? ops->synchronize(c) : 0;
    ops->copy_rows(c, e->x, db->logit_rows, b->n_logits, E, e->sel);
    ops->rmsnorm(c, e->sel, m->output_norm, e->sel, b->n_logits, E, m->hp.rms_eps);
    if ((rc = lm_head(e, b, out))) return rc;
    if (m->shard.tp_rank == 0) finish_logits(&m->hp, out, (int64_t)b->n_logits * m->hp.n_vocab);
    return 0;
}

int kn_engine_forward(kn_engine *e, kn_kv_pool *kv, const kn_batch *b, float *out)
{
    const kn_model *m = e->m;
    const bool dp = m->shard.dp_size > 1;
    int rc = validate(e, kv, b);
    bool wants_out = m->last ? b->n_logits > 0 && m->shard.tp_rank == 0 : true;
    if (!rc && wants_out && !out) {
        TD_LOG_ERR("no output buffer for the %s", m->last ? "logits" : "hidden states");
        rc = TD_EINVAL;
    }
    if (rc) { /* a dp member still takes its part, without rows: the others wait for it */
        if (dp) dp_idle(e);
        return rc;
    }
    int64_t split = kn_engine_tbo_split(e, b);
    if (split > 0) return kn_engine_forward_tbo(e, kv, b, split, out);
    if (dp && (rc = dp_begin(e, b->n_tokens, b->n_solo))) return rc;
    if ((rc = kn_engine_reserve(e, b->n_tokens))) return rc;
    kn_batch staged; /* b's arrays in the backend's memory (a device backend's only) */
    const kn_batch *db = b;
    if (e->dev) {
        if ((rc = kn_engine_stage_batch(e, kv, b, &staged))) return rc;
        db = &staged;
    }
    if ((rc = kn_engine_input(e, b, db))) return rc;
    for (int li = 0; li < m->shard.l1 - m->shard.l0; li++)
        if ((rc = kn_engine_attn_half(e, kv, db, li)) || (rc = kn_engine_ffn_half(e, db, li)))
            return rc;
    return kn_engine_output(e, b, db, out);
}
