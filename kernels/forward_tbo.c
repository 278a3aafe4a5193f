/* forward_tbo.c: two-batch overlap, the CPU form of SGLang's TBO (kn_engine_set_tbo).
 *
 * A tensor-parallel forward waits in every all-reduce (two a layer) for the slowest rank:
 * the ranks' shares are never quite equal (an expert-parallel rank whose experts drew more
 * tokens, a rank whose core was taken), and on a device the collective itself takes time.
 * Split into two micro-batches, A (rows [0, split)) and B (the rest), the forward runs
 *     A attention, post A's all-reduce;  B attention, post B's;
 *     wait A's, A feed-forward, post;     wait B's, B feed-forward, post;   next layer ...
 * so each micro-batch's all-reduce is in flight while the other computes, and a rank that
 * is ahead computes instead of spinning. Every rank interleaves the same way, so the
 * collectives pair in order (dc_shm.h: post, then wait, at most two in flight).
 *
 * Each micro-batch is its own kn_engine (the twin holds B's activations; both share the
 * model, the backend and the collective), so the forward's parts run unchanged on either:
 * a micro-batch's results are the whole batch's rows computed with fewer neighbours. Solo
 * rows stay bit-identical (model.h: batch-invariant); other rows may round differently, as
 * with any other batch composition. A sequence whose rows straddle the split is fine: A's
 * attention half writes its keys of a layer before B's attention half of that layer reads
 * them, and A's rows come first in the sequence (kn_batch: position order).
 *
 * On a device backend each micro-batch's arrays are staged into its engine's device buffers,
 * and its all-reduce goes through its engine's host staging (engine_stage.c): the post
 * downloads (waiting for that micro-batch's kernels), so the wait for the other ranks runs
 * while the other micro-batch's kernels, already queued, compute. Not yet run on a GPU
 * (cpu-dev checks the memory contract: test_engine_device).
 *
 * The cost is the weights: each micro-batch reads every matrix, so where a step is bound
 * by reading weights (small decode batches on a CPU) the overlap pays only if the waits it
 * hides are longer than the second read; min_tokens keeps small batches whole. */
#include <stdlib.h>

#include "engine_int.h"
#include "td_err.h"

void kn_engine_tbo_free(kn_engine *e)
{
    kn_engine_destroy(e->tbo.twin);
    free(e->tbo.rows);
    e->tbo = (kn_engine_tbo){0};
}

int kn_engine_set_tbo(kn_engine *e, int64_t min_tokens)
{
    const kn_model *m = e->m;
    if (min_tokens < 0) return TD_EINVAL;
    if (min_tokens == 0) {
        kn_engine_tbo_free(e);
        return 0;
    }
    const char *why = m->shard.tp_size < 2   ? "needs tp >= 2"
                      : m->shard.dp_size > 1 ? "is not built for dp"
                      : !e->coll.allreduce_post || !e->coll.allreduce_wait
                          ? "needs a split allreduce"
                      : m->shard.mtp ? "is not for an MTP block"
                                     : NULL;
    if (why) {
        TD_LOG_ERR("two-batch overlap %s", why);
        return TD_EUNSUPP;
    }
    if (!e->tbo.twin) {
        kn_engine *t = calloc(1, sizeof *t);
        if (!t) return TD_ENOMEM;
        t->m = m; /* the weights were mapped for e (the backend keeps them), not again */
        t->be = e->be;
        t->dev = e->dev;
        t->coll = e->coll;
        e->tbo.twin = t;
    }
    e->tbo.min_tokens = min_tokens;
    return 0;
}

uint64_t kn_engine_tbo_count(const kn_engine *e)
{
    return e->tbo.n_split;
}

/* The number of leading logit rows in [0, split), or -1 when a later one is there too. */
static int logits_before(const kn_batch *b, int64_t split)
{
    int nl = 0;
    while (nl < b->n_logits && b->logit_rows[nl] < split)
        nl++;
    for (int i = nl; i < b->n_logits; i++)
        if (b->logit_rows[i] < split) return -1;
    return nl;
}

int64_t kn_engine_tbo_split(const kn_engine *e, const kn_batch *b)
{
    const int64_t n = b->n_tokens;
    if (!e->tbo.min_tokens || n < 2 || n < e->tbo.min_tokens) return 0;
    /* halves of the rows, moved to the nearest boundary between sequences within the middle
     * half (so a request's rows stay together), else cut through one */
    int64_t split = n / 2;
    for (int64_t d = 0; d <= n / 4; d++) {
        if (split - d > 0 && b->seq_of[split - d] != b->seq_of[split - d - 1]) {
            split -= d;
            break;
        }
        if (split + d < n && b->seq_of[split + d] != b->seq_of[split + d - 1]) {
            split += d;
            break;
        }
    }
    if (e->m->last && logits_before(b, split) < 0) return 0;
    return split;
}

int kn_engine_forward_tbo(kn_engine *e, kn_kv_pool *kv, const kn_batch *b, int64_t split,
                          float *out)
{
    const kn_model *m = e->m;
    const int64_t n = b->n_tokens, E = m->hp.n_embd;
    const int nl = m->last ? logits_before(b, split) : 0;
    kn_engine_tbo *t = &e->tbo;
    if (b->n_logits - nl > t->cap_rows) {
        int32_t *r = realloc(t->rows, (size_t)(b->n_logits - nl) * sizeof *r);
        if (!r) return TD_ENOMEM;
        t->rows = r;
        t->cap_rows = b->n_logits - nl;
    }
    for (int i = nl; i < b->n_logits; i++)
        t->rows[i - nl] = b->logit_rows[i] - (int32_t)split;
    kn_batch mb[2] = {*b, *b};
    mb[0].n_tokens = split;
    mb[0].n_solo = b->n_solo < split ? b->n_solo : split;
    mb[0].n_logits = nl;
    mb[1].n_tokens = n - split;
    mb[1].n_solo = b->n_solo > split ? b->n_solo - split : 0;
    mb[1].tokens = b->tokens ? b->tokens + split : NULL;
    mb[1].embd = b->embd ? b->embd + split * E : NULL;
    mb[1].pos = b->pos + split;
    mb[1].seq_of = b->seq_of + split;
    mb[1].n_logits = b->n_logits - nl;
    mb[1].logit_rows = t->rows;
    mb[1].hidden_out = b->hidden_out ? b->hidden_out + split * E : NULL;
    float *outs[2] = {out, NULL};
    if (out) outs[1] = out + (m->last ? (int64_t)nl * m->hp.n_vocab : split * E);
    kn_engine *eng[2] = {e, t->twin};
    kn_batch staged[2]; /* a device backend's: each micro-batch's arrays in its memory */
    const kn_batch *db[2] = {&mb[0], &mb[1]};
    int rc = 0;
    for (int i = 0; i < 2 && !rc; i++) {
        if (e->dev && !(rc = kn_engine_stage_batch(eng[i], kv, &mb[i], &staged[i])))
            db[i] = &staged[i];
        if (!rc && !(rc = kn_engine_reserve(eng[i], mb[i].n_tokens)))
            rc = kn_engine_input(eng[i], &mb[i], db[i]);
    }
    e->defer = eng[1]->defer = true;
    for (int li = 0; li < m->shard.l1 - m->shard.l0 && !rc; li++)
        for (int half = 0; half < 2 && !rc; half++)
            for (int i = 0; i < 2 && !rc; i++)
                if (!(rc = kn_engine_settle(eng[i])))
                    rc = half ? kn_engine_ffn_half(eng[i], db[i], li)
                              : kn_engine_attn_half(eng[i], kv, db[i], li);
    for (int i = 0; i < 2; i++) {
        if (!rc) rc = kn_engine_settle(eng[i]);
        eng[i]->pend.on = false; /* after a failure the instance re-forms: nothing to wait */
        eng[i]->defer = false;
    }
    for (int i = 0; i < 2 && !rc; i++)
        rc = kn_engine_output(eng[i], &mb[i], db[i], outs[i]);
    if (!rc) t->n_split++;
    return rc;
}
