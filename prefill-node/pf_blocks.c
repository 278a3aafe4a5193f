/* pf_blocks.c: a request's KV blocks on a prefill stage and the stage's prefix cache
 * (pf_kvcache.h): stage 0's lookup, the cached prefix a request takes (and the copy of its
 * last block when the whole prompt is cached), its own blocks, and what goes back to the
 * cache or the pool when it ends (docs/prefix-cache.md, "Prefill stages"). */
#include <stdlib.h>
#include <string.h>

#include "pf_int.h"
#include "td_err.h"

/* (pf_int.h) The whole blocks and a tail of >= 2 tokens go to the cache: a 1-token tail
 * saves nothing (that token is computed again anyway). */
void pf_blocks_release(pf_stage *st, pf_req *r, bool insert)
{
    int nb = r->kv.n_blocks, nh = r->n_hit, bs = st->shard.kv->block_size;
    int nf = r->n_prompt / bs; /* whole blocks (>= nh; nh + 1 with a copied last block) */
    int tail = r->n_prompt % bs >= 2 ? r->n_prompt % bs : 0; /* 1 token: nothing to save */
    if (insert && st->kvc && r->hist && nf + (tail > 0) <= nb) {
        pf_kvc_insert(st->kvc, r->hist, nf, tail, r->kv.blocks, nh);
        kn_kv_free(st->shard.mem, nb - nf - (tail > 0), r->kv.blocks + nf + (tail > 0));
    } else if (nb > nh)
        kn_kv_free(st->shard.mem, nb - nh, r->kv.blocks + nh);
    if (nh) {
        if (!r->unrefd) pf_kvc_unref(st->kvc, r->hit, nh);
        pf_kvc_unuse(st->kvc, r->hit, nh);
    }
    r->n_hit = 0;
    r->kv.n_blocks = 0;
    kn_kv_seq_fini(st->shard.mem, &r->kv);
}

/* r's block table: the cached prefix's blocks (n_cached tokens ending in block cached_id,
 * as stage 0 decided), then its own blocks for the rest of the prompt. A prompt cached
 * whole has n_cached = n_prompt - 1 (pf_stage_cached_prefix): its last block (whole, or
 * the cache's copy of its tail) is copied into one of r's own (the last token's KV is
 * written again, and a cached block is never written) and the cache's is let go at once. */
int pf_blocks_open(pf_stage *st, pf_req *r, const pf_seg *g)
{
    kn_kv_pool *kv = st->shard.kv;
    const int bs = kv->block_size;
    int nb = kn_kv_blocks_for(kv, r->n_prompt), nh = (int)g->n_cached / bs;
    const bool copy_last = g->n_cached % (uint32_t)bs != 0;
    if ((st->kvc || st->last) && !(r->hist = malloc((size_t)r->n_prompt * sizeof *r->hist)))
        return TD_ENOMEM;
    if (!(r->kv.blocks = malloc((size_t)nb * sizeof *r->kv.blocks))) return TD_ENOMEM;
    r->kv.cap = nb;
    int32_t src = -1; /* copy_last: the cached block copied */
    if (g->n_cached) {
        const int na = nh + copy_last; /* blocks taken from the cache */
        if (!st->kvc || (copy_last && (int)g->n_cached != r->n_prompt - 1)) return TD_EINVAL;
        if (!(r->hit = malloc((size_t)na * sizeof *r->hit))) return TD_ENOMEM;
        if (pf_kvc_acquire(st->kvc, g->cached_id, na, r->kv.blocks, r->hist)) {
            TD_LOG_WARN("prefill %s stage %d: request %llu: stage 0 took %u tokens from the "
                        "prefix cache, which this stage does not hold (its cache differs)",
                        st->p->instance, st->stage, (unsigned long long)r->id, g->n_cached);
            return TD_ENOENT;
        }
        memcpy(r->hit, r->kv.blocks, (size_t)na * sizeof *r->hit);
        if (copy_last) src = r->kv.blocks[nh];
        r->n_hit = r->kv.n_blocks = nh;
        r->n_computed = (int32_t)g->n_cached; /* pushed with the first computed chunk */
    }
    int rc =
        kn_kv_alloc(st->shard.mem, nb - nh, r->kv.blocks + nh); /* ascending runs: kvxfer's puts */
    if (!rc && copy_last) rc = kn_kv_block_copy(kv, src, r->kv.blocks[nh]);
    if (copy_last) { /* every stage lets it go here, at the same point of the stream */
        pf_kvc_unref(st->kvc, r->hit + nh, 1);
        pf_kvc_unuse(st->kvc, r->hit + nh, 1);
    }
    if (rc) {
        if (rc == TD_ENOSPC)
            TD_LOG_WARN("prefill %s stage %d: request %llu: no KV room for %d tokens (%d "
                        "blocks free)",
                        st->p->instance, st->stage, (unsigned long long)r->id,
                        r->n_prompt - nh * bs, kv->n_free);
        else
            TD_LOG_WARN("prefill %s stage %d: request %llu: copying cached block %d: %s",
                        st->p->instance, st->stage, (unsigned long long)r->id, src,
                        td_strerror(rc));
        if (rc != TD_ENOSPC) kn_kv_free(st->shard.mem, nb - nh, r->kv.blocks + nh);
        return rc;
    }
    r->kv.n_blocks = nb;
    st->cache_hit_tokens += g->n_cached;
    return 0;
}

int32_t pf_stage_cached_prefix(const pf_stage *st, const int32_t *prompt, int32_t n, uint64_t *id)
{
    *id = 0;
    if (!st->kvc || n < 2) return 0;
    int bs = st->shard.kv->block_size;
    uint64_t last;
    int k = pf_kvc_match(st->kvc, prompt, n, n / bs, &last), t = n - k * bs;
    /* the whole prompt is cached (to its last whole block, or with its tail): compute its
     * last token again (the last stage samples from its logits) in a copy of the last block
     * (pf_blocks_open), not the whole block */
    bool whole = t == 0 || (k == n / bs && t >= 2 &&
                            pf_kvc_match_tail(st->kvc, last, k, prompt + (size_t)k * bs, t, &last));
    if (k || whole) *id = last;
    return whole ? n - 1 : k * bs;
}

void pf_stage_cache_stats(const pf_stage *st, uint64_t *hit_tokens, uint64_t *evicted)
{
    pf_kvc_stats s = {0};
    if (st->kvc) pf_kvc_get_stats(st->kvc, &s);
    *hit_tokens = st->cache_hit_tokens;
    *evicted = s.evicted;
}
