/* engine_stage.c: what a device backend (kn_backend.h: host_memory false) needs from the
 * engine beyond the forward pass itself: the shard's weights mapped once, each batch's
 * host arrays (tokens, positions, sequence indices, logit rows, block tables and the seq
 * views that point at them) copied into backend memory before the first op reads them, and
 * with tp > 1 the collectives staged through host memory (the process's host collective,
 * the decode node's shared-memory all-reduce, sums what each rank downloads; a micro-batch of
 * two-batch overlap posts its download and uploads the sum when it waits).
 * Host-memory backends (cpu) read the caller's arrays directly; one with a map_matrix is
 * told the shard's weight matrices (kn_engine_map_model) and nothing else here. */
#include <stdlib.h>
#include <string.h>

#include "engine_int.h"
#include "td_err.h"

static int map_mat(kn_engine *e, const kn_mat *w)
{
    return w->data ? e->be.ops->map_matrix(e->be.ctx, w) : 0;
}

static int map_vec(kn_engine *e, const float *v, int64_t n)
{
    return v && e->be.ops->map_vector ? e->be.ops->map_vector(e->be.ctx, v, n) : 0;
}

int kn_engine_map_model(kn_engine *e)
{
    const kn_model *m = e->m;
    const int64_t E = m->hp.n_embd, HD = m->hp.head_dim;
    const int64_t nq = m->heads.n_q * HD, nkv = m->heads.n_kv * HD;
    int rc = 0;
    if (!rc) rc = map_mat(e, &m->tok_embd);
    if (!rc && m->last) rc = map_mat(e, &m->output);
    if (!rc && m->last) rc = map_vec(e, m->output_norm, E);
    if (!rc) rc = map_mat(e, &m->mtp_eh_proj);
    if (!rc) rc = map_vec(e, m->mtp_enorm, E);
    if (!rc) rc = map_vec(e, m->mtp_hnorm, E);
    if (!rc) rc = map_vec(e, m->rope_freq, m->hp.n_rot / 2);
    if (!rc) rc = map_vec(e, m->rope_freq_swa, m->hp.n_rot / 2);
    for (int li = 0; !rc && li < m->shard.l1 - m->shard.l0; li++) {
        const kn_layer *ly = &m->layers[li];
        const kn_mat *mats[] = {&ly->wq,     &ly->wk,   &ly->wv,    &ly->wo,
                                &ly->w_gate, &ly->w_up, &ly->w_down};
        for (size_t i = 0; !rc && i < sizeof mats / sizeof *mats; i++)
            rc = map_mat(e, mats[i]);
        /* experts (model_moe.c) and latent attention (model_mla.c) */
        const kn_mat *more[] = {&ly->gate_inp, &ly->sh_gate, &ly->sh_up, &ly->sh_down,
                                &ly->wq_a,     &ly->wq_b,    &ly->wkv_c, &ly->wkv_pe};
        for (size_t i = 0; !rc && i < sizeof more / sizeof *more; i++)
            rc = map_mat(e, more[i]);
        for (int x = 0; !rc && ly->exp_gate && x < m->hp.n_expert; x++)
            if (!(rc = map_mat(e, &ly->exp_gate[x])) && !(rc = map_mat(e, &ly->exp_up[x])))
                rc = map_mat(e, &ly->exp_down[x]);
        for (int h = 0; !rc && ly->wk_b && h < m->heads.n_q; h++)
            if (!(rc = map_mat(e, &ly->wk_b[h]))) rc = map_mat(e, &ly->wv_b[h]);
        if (!rc) rc = map_vec(e, ly->q_a_norm, m->hp.q_lora_rank);
        if (!rc) rc = map_vec(e, ly->kv_a_norm, m->hp.kv_lora_rank);
        struct {
            const float *v;
            int64_t n;
        } vecs[] = {{ly->attn_norm, E}, {ly->ffn_norm, E},       {ly->bq, nq},
                    {ly->bk, nkv},      {ly->bv, nkv},           {ly->q_norm, HD},
                    {ly->k_norm, HD},   {ly->attn_post_norm, E}, {ly->ffn_post_norm, E}};
        for (size_t i = 0; !rc && i < sizeof vecs / sizeof *vecs; i++)
            rc = map_vec(e, vecs[i].v, vecs[i].n);
    }
    if (rc) TD_LOG_ERR("cannot copy the model's weights into %s memory", e->be.ops->name);
    return rc;
}

/* *buf holds at least n elements of size es in backend memory (grown, contents lost). */
static int grow_dev(kn_engine *e, void **buf, int64_t *cap, int64_t n, size_t es)
{
    if (n <= *cap) return 0;
    e->be.ops->free(e->be.ctx, *buf);
    *cap = 0;
    *buf = e->be.ops->alloc(e->be.ctx, (size_t)n * es);
    if (!*buf) return TD_ENOMEM;
    *cap = n;
    return 0;
}

static int upload(kn_engine *e, void *dst, const void *src, size_t bytes)
{
    return bytes ? e->be.ops->upload(e->be.ctx, dst, src, bytes) : 0;
}

/* The seq views: block tables packed end to end, then views pointing into the packed copy. */
static int stage_seqs(kn_engine *e, const kn_kv_pool *kv, const kn_batch *b, kn_batch *db)
{
    kn_engine_stage *st = &e->st;
    int64_t total = 0;
    for (int s = 0; s < b->n_seqs; s++)
        total += kn_kv_blocks_for(kv, b->seqs[s].n_ctx);
    int64_t cap_seqs = st->cap_seqs, cap_tab = st->cap_tab;
    if (b->n_seqs > cap_seqs || total > cap_tab) {
        /* the host packing buffers always have the device buffers' capacities */
        int rc = grow_dev(e, (void **)&st->seqs, &cap_seqs, b->n_seqs, sizeof *st->seqs);
        if (!rc) rc = grow_dev(e, (void **)&st->tables, &cap_tab, total ? total : 1, 4);
        st->cap_seqs = (int)cap_seqs;
        st->cap_tab = cap_tab;
        free(st->h_seqs);
        free(st->h_tables);
        st->h_seqs = malloc((size_t)(cap_seqs ? cap_seqs : 1) * sizeof *st->h_seqs);
        st->h_tables = malloc((size_t)(cap_tab ? cap_tab : 1) * sizeof *st->h_tables);
        if (rc || !st->h_seqs || !st->h_tables) {
            st->cap_seqs = 0; /* grow everything again next time */
            st->cap_tab = 0;
            return TD_ENOMEM;
        }
    }
    int64_t at = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const int nb = kn_kv_blocks_for(kv, b->seqs[s].n_ctx);
        if (nb) memcpy(st->h_tables + at, b->seqs[s].block_table, (size_t)nb * 4);
        st->h_seqs[s] = (kn_seq_view){.block_table = st->tables + at, .n_ctx = b->seqs[s].n_ctx};
        at += nb;
    }
    int rc = upload(e, st->tables, st->h_tables, (size_t)at * 4);
    if (!rc) rc = upload(e, st->seqs, st->h_seqs, (size_t)b->n_seqs * sizeof *st->seqs);
    db->seqs = st->seqs;
    return rc;
}

/* *buf holds at least n elements of size es in host memory (grown, contents lost). */
static int grow_host(void **buf, int64_t *cap, int64_t n, size_t es)
{
    if (n <= *cap) return 0;
    free(*buf);
    *cap = 0;
    *buf = malloc((size_t)n * es);
    if (!*buf) return TD_ENOMEM;
    *cap = n;
    return 0;
}

/* A staged pool: sequence s's positions before its first one in this batch were written
 * elsewhere (KV received into the host copy, or earlier batches); the blocks holding them
 * are uploaded unless current. The blocks from the first position on are written by this
 * batch's kv_write, so they are current after it. */
static int stage_kv(kn_engine *e, kn_kv_pool *kv, const kn_batch *b)
{
    kn_engine_stage *st = &e->st;
    int64_t cap_first = st->cap_first, total = 0;
    int rc = grow_host((void **)&st->first, &cap_first, b->n_seqs, sizeof *st->first);
    st->cap_first = (int)cap_first;
    for (int s = 0; s < b->n_seqs; s++)
        total += kn_kv_blocks_for(kv, b->seqs[s].n_ctx);
    if (!rc) rc = grow_host((void **)&st->up, &st->cap_up, total ? total : 1, sizeof *st->up);
    if (rc) return rc;
    for (int s = 0; s < b->n_seqs; s++)
        st->first[s] = b->seqs[s].n_ctx;
    for (int64_t i = 0; i < b->n_tokens; i++)
        if (b->pos[i] < st->first[b->seq_of[i]]) st->first[b->seq_of[i]] = b->pos[i];
    int n_up = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const int32_t *t = b->seqs[s].block_table;
        const int old = kn_kv_blocks_for(kv, st->first[s]),
                  nb = kn_kv_blocks_for(kv, b->seqs[s].n_ctx);
        for (int j = 0; j < old; j++)
            if (!kv->on_dev[t[j]]) {
                kv->on_dev[t[j]] = 1; /* listed once, even when sequences share it */
                st->up[n_up++] = t[j];
            }
        for (int j = st->first[s] / kv->block_size; j < nb; j++)
            kv->on_dev[t[j]] = 1;
    }
    rc = n_up ? kn_kv_stage_upload(kv, st->up, n_up) : 0;
    for (int i = 0; rc && i < n_up; i++)
        kv->on_dev[st->up[i]] = 0;
    if (rc) TD_LOG_ERR("cannot upload %d received kv blocks: %s", n_up, td_strerror(rc));
    return rc;
}

int kn_engine_stage_batch(kn_engine *e, kn_kv_pool *kv, const kn_batch *b, kn_batch *db)
{
    kn_engine_stage *st = &e->st;
    const int64_t n = b->n_tokens;
    *db = *b;
    int rc = kv->host ? stage_kv(e, kv, b) : 0;
    if (rc) return rc;
    if (n > st->cap_tok) {
        int64_t c1 = 0, c2 = 0, c3 = 0;
        e->be.ops->free(e->be.ctx, st->tokens);
        e->be.ops->free(e->be.ctx, st->pos);
        e->be.ops->free(e->be.ctx, st->seq_of);
        st->tokens = st->pos = st->seq_of = NULL;
        st->cap_tok = 0;
        rc = grow_dev(e, (void **)&st->tokens, &c1, n, 4);
        if (!rc) rc = grow_dev(e, (void **)&st->pos, &c2, n, 4);
        if (!rc) rc = grow_dev(e, (void **)&st->seq_of, &c3, n, 4);
        if (rc) return rc;
        st->cap_tok = n;
    }
    if (b->tokens && !rc) rc = upload(e, st->tokens, b->tokens, (size_t)n * 4);
    if (!rc) rc = upload(e, st->pos, b->pos, (size_t)n * 4);
    if (!rc) rc = upload(e, st->seq_of, b->seq_of, (size_t)n * 4);
    db->tokens = b->tokens ? st->tokens : NULL;
    db->pos = st->pos;
    db->seq_of = st->seq_of;
    if (!rc && b->n_logits > 0) {
        int64_t cap = st->cap_rows;
        rc = grow_dev(e, (void **)&st->rows, &cap, b->n_logits, 4);
        st->cap_rows = (int)cap;
        if (!rc) rc = upload(e, st->rows, b->logit_rows, (size_t)b->n_logits * 4);
        db->logit_rows = st->rows;
    }
    if (!rc) rc = stage_seqs(e, kv, b, db);
    if (rc) TD_LOG_ERR("cannot stage the batch in %s memory: %s", e->be.ops->name, td_strerror(rc));
    return rc;
}

float *kn_engine_stage_out(kn_engine *e, int64_t n)
{
    return grow_dev(e, (void **)&e->st.out, &e->st.cap_out, n, sizeof(float)) ? NULL : e->st.out;
}

static void free_host(kn_engine *e)
{
    kn_engine_stage *st = &e->st;
    if (st->host && e->be.ops->host_free)
        e->be.ops->host_free(e->be.ctx, st->host);
    else
        free(st->host);
    st->host = NULL;
    st->cap_host = 0;
}

/* Host staging for n floats (grown on demand, contents lost), or NULL. */
static float *stage_host(kn_engine *e, int64_t n)
{
    kn_engine_stage *st = &e->st;
    if (n <= st->cap_host) return st->host;
    const kn_backend_ops *o = e->be.ops;
    free_host(e);
    size_t bytes = (size_t)n * sizeof(float);
    st->host = o->host_alloc ? o->host_alloc(e->be.ctx, bytes) : malloc(bytes);
    if (!st->host) {
        TD_LOG_ERR("cannot allocate %zu bytes of host staging for the tp collectives", bytes);
        return NULL;
    }
    st->cap_host = n;
    return st->host;
}

int kn_engine_allreduce_staged(kn_engine *e, float *buf, int64_t n)
{
    float *h = stage_host(e, n);
    if (!h) return TD_ENOMEM;
    const size_t bytes = (size_t)n * sizeof(float);
    int rc = e->be.ops->download(e->be.ctx, h, buf, bytes);
    if (!rc) rc = e->coll.allreduce_sum(e->coll.ctx, h, n);
    if (!rc) rc = e->be.ops->upload(e->be.ctx, buf, h, bytes);
    return rc;
}

int kn_engine_allreduce_post_staged(kn_engine *e, const float *buf, int64_t n, uint64_t *ticket)
{
    float *h = stage_host(e, n ? n : 1);
    if (!h) return TD_ENOMEM;
    int rc = e->be.ops->download(e->be.ctx, h, buf, (size_t)n * sizeof(float));
    return rc ? rc : e->coll.allreduce_post(e->coll.ctx, h, n, ticket);
}

int kn_engine_allreduce_wait_staged(kn_engine *e, uint64_t ticket, float *buf, int64_t n)
{
    float *h = e->st.host; /* the post's: nothing staged on this engine since */
    int rc = e->coll.allreduce_wait(e->coll.ctx, ticket, h, n);
    return rc ? rc : e->be.ops->upload(e->be.ctx, buf, h, (size_t)n * sizeof(float));
}

int kn_engine_gather_staged(kn_engine *e, const float *part, int64_t rows, float *out)
{
    const kn_model *m = e->m;
    const int64_t n = rows * m->n_vocab_local;
    float *h = stage_host(e, n ? n : 1);
    if (!h) return TD_ENOMEM;
    int rc = e->be.ops->download(e->be.ctx, h, part, (size_t)n * sizeof(float));
    if (!rc) rc = e->coll.gather_cols(e->coll.ctx, h, rows, m->hp.n_vocab, out);
    return rc;
}

void kn_engine_stage_free(kn_engine *e)
{
    kn_engine_stage *st = &e->st;
    free_host(e);
    void *dev[] = {st->tokens, st->pos, st->seq_of, st->rows, st->seqs, st->tables, st->out};
    for (size_t i = 0; i < sizeof dev / sizeof *dev; i++)
        if (dev[i]) e->be.ops->free(e->be.ctx, dev[i]);
    free(st->h_seqs);
    free(st->h_tables);
    free(st->first);
    free(st->up);
    memset(st, 0, sizeof *st);
}
