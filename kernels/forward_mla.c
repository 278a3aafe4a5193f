/* forward_mla.c: multi-head latent attention in the forward pass (deepseek2), in the
 * absorbed form: attention runs on the latent KV itself, one vector per token, as MQA.
 *
 *   q = h Wq  |  rmsnorm(h Wq_a) Wq_b                 (this rank's heads: [nope | rope] each)
 *   c = rmsnorm(h Wkv_c) ; k_pe = rope(h Wkv_pe)      (the latent, whole on every rank)
 *   K = [c | k_pe] into the pool (one KV head of kv_lora_rank + n_rot dims); V is K
 *   per head: Q_h = [q_nope_h Wk_b_h^T | rope(q_pe_h)]  (the key's up-projection absorbed)
 *   O = attention(Q, K, V), scale mscale^2 / sqrt(mla_nope + n_rot)   (model_mla.c)
 *   per head: a_h = O_h[:kv_lora_rank] Wv_b_h^T        (the value's up-projection)
 *   x += allreduce(a Wo)
 * The value is a prefix of the latent, so the pool has the latent layout (kv_pool.h
 * KN_KV_LAYOUT_LATENT, from kn_model_kv_params): one array a layer, stored, copied, cached
 * and transferred once. The per-head products run as whole matmuls on contiguous
 * copies (copy_2d), so solo rows keep their bits as everywhere else. */
#include "engine_int.h"
#include "td_err.h"

void kn_engine_mla_free(kn_engine *e)
{
    kn_engine_mla *ml = &e->mla;
    void **const bufs[] = {(void **)&ml->qa, (void **)&ml->q,   (void **)&ml->c,
                           (void **)&ml->pe, (void **)&ml->qpe, (void **)&ml->qn,
                           (void **)&ml->ql, (void **)&ml->ov,  (void **)&ml->av};
    kn_engine_free_bufs(e, bufs, sizeof bufs / sizeof *bufs);
    ml->cap = 0;
}

int kn_engine_mla_reserve(kn_engine *e, int64_t n)
{
    const kn_hparams *hp = &e->m->hp;
    kn_engine_mla *ml = &e->mla;
    if (!hp->kv_lora_rank || n <= ml->cap) return 0;
    kn_engine_mla_free(e);
    const int64_t nh = e->m->heads.n_q, R = hp->kv_lora_rank, P = hp->n_rot, N = hp->mla_nope;
    const kn_engine_buf want[] = {
        {hp->q_lora_rank ? (void **)&ml->qa : NULL, n * hp->q_lora_rank},
        {(void **)&ml->q, n * nh * (N + P)},
        {(void **)&ml->c, n * R},
        {(void **)&ml->pe, n * P},
        {(void **)&ml->qpe, n * nh * P},
        {(void **)&ml->qn, n * N},
        {(void **)&ml->ql, n * R},
        {(void **)&ml->ov, n * hp->mla_v},
        {(void **)&ml->av, n * nh * hp->mla_v},
    };
    int rc = kn_engine_alloc_bufs(e, want, sizeof want / sizeof *want, "latent attention");
    if (!rc) ml->cap = n;
    return rc;
}

/* ml->q: every head's query as projected, from h. */
static int queries(kn_engine *e, const kn_layer *ly, const float *h, int64_t n, int64_t solo)
{
    const kn_hparams *hp = &e->m->hp;
    kn_engine_mla *ml = &e->mla;
    if (!hp->q_lora_rank) return kn_engine_matmul(e, &ly->wq, h, n, solo, ml->q);
    int rc = kn_engine_matmul(e, &ly->wq_a, h, n, solo, ml->qa);
    if (rc) return rc;
    e->be.ops->rmsnorm(e->be.ctx, ml->qa, ly->q_a_norm, ml->qa, n, hp->q_lora_rank, hp->rms_eps);
    return kn_engine_matmul(e, &ly->wq_b, ml->qa, n, solo, ml->q);
}

/* e->k (n, R + P) = [rmsnorm(h Wkv_c) | rope(h Wkv_pe)]: the batch's latent KV. */
static int latent(kn_engine *e, const kn_layer *ly, const kn_batch *b, const float *h)
{
    const kn_hparams *hp = &e->m->hp;
    const kn_backend_ops *ops = e->be.ops;
    void *c = e->be.ctx;
    kn_engine_mla *ml = &e->mla;
    const int64_t n = b->n_tokens, solo = b->n_solo, R = hp->kv_lora_rank, P = hp->n_rot;
    int rc;
    if ((rc = kn_engine_matmul(e, &ly->wkv_c, h, n, solo, ml->c)) ||
        (rc = kn_engine_matmul(e, &ly->wkv_pe, h, n, solo, ml->pe)))
        return rc;
    ops->rmsnorm(c, ml->c, ly->kv_a_norm, ml->c, n, R, hp->rms_eps);
    ops->rope(c, ml->pe, n, 1, (int)P, (int)P, b->pos, e->m->rope_freq, hp->rope_neox);
    ops->copy_2d(c, ml->c, R, e->k, R + P, n, R);
    ops->copy_2d(c, ml->pe, P, e->k + R, R + P, n, P);
    return 0;
}

/* e->q (n, nh, R + P): each head's query in the latent's space, its rope part rotated. */
static int absorbed_queries(kn_engine *e, const kn_layer *ly, const kn_batch *b)
{
    const kn_hparams *hp = &e->m->hp;
    const kn_backend_ops *ops = e->be.ops;
    void *c = e->be.ctx;
    kn_engine_mla *ml = &e->mla;
    const int64_t n = b->n_tokens, solo = b->n_solo, nh = e->m->heads.n_q;
    const int64_t R = hp->kv_lora_rank, P = hp->n_rot, N = hp->mla_nope, QD = N + P, HD = R + P;
    ops->copy_2d(c, ml->q + N, QD, ml->qpe, P, n * nh, P);
    ops->rope(c, ml->qpe, n, (int)nh, (int)P, (int)P, b->pos, e->m->rope_freq, hp->rope_neox);
    ops->copy_2d(c, ml->qpe, P, e->q + R, HD, n * nh, P);
    for (int64_t hd = 0; hd < nh; hd++) {
        ops->copy_2d(c, ml->q + hd * QD, nh * QD, ml->qn, N, n, N);
        int rc = kn_engine_matmul(e, &ly->wk_b[hd], ml->qn, n, solo, ml->ql);
        if (rc) return rc;
        ops->copy_2d(c, ml->ql, R, e->q + hd * HD, nh * HD, n, R);
    }
    return 0;
}

int kn_engine_mla_attention(kn_engine *e, kn_kv_pool *kv, const kn_batch *b, int li, const float *h)
{
    const kn_model *m = e->m;
    const kn_hparams *hp = &m->hp;
    const kn_layer *ly = &m->layers[li];
    const kn_backend_ops *ops = e->be.ops;
    void *c = e->be.ctx;
    kn_engine_mla *ml = &e->mla;
    const int64_t n = b->n_tokens, solo = b->n_solo, nh = m->heads.n_q;
    const int64_t R = hp->kv_lora_rank, HD = hp->head_dim, V = hp->mla_v;
    int rc;
    if ((rc = queries(e, ly, h, n, solo)) || (rc = latent(e, ly, b, h)) ||
        (rc = absorbed_queries(e, ly, b)))
        return rc;
    /* the latent is the pool's one array (KN_KV_LAYOUT_LATENT): written once (vpool ==
     * kpool: K only), and the attention reads the value as its prefix from the same tiles */
    ops->kv_write(c, kv->k[li], kv->k[li], kv->type, kv->block_size, &kv->slicing, 1, (int)HD, e->k,
                  e->k, n, b->pos, b->seq_of, b->seqs);
    ops->attention(c, e->q, kv->k[li], kv->k[li], kv->type, kv->block_size, &kv->slicing, (int)nh,
                   1, m->heads.group, m->heads.phase, (int)HD, hp->attn_scale, 0, 0.0f, n, solo,
                   b->pos, b->seq_of, b->seqs, e->att);
    for (int64_t hd = 0; hd < nh; hd++) {
        ops->copy_2d(c, e->att + hd * HD, nh * HD, ml->ql, R, n, R);
        if ((rc = kn_engine_matmul(e, &ly->wv_b[hd], ml->ql, n, solo, ml->ov))) return rc;
        ops->copy_2d(c, ml->ov, V, ml->av + hd * V, nh * V, n, V);
    }
    return kn_engine_project_add(e, &ly->wo, ml->av, NULL, n, solo);
}
