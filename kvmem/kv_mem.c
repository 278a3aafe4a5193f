/* kv_mem.c: the KV memory of one shard (kv_mem.h): the pool, its optional cache and tier,
 * the allocator that goes through the cache when there is one, and the sequence interface. */
#include "kv_mem.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "td_err.h"
#include "td_grow.h"

struct kn_kv_mem {
    kn_kv_pool_params params; /* shm_name points at shm_name below */
    char *shm_name;
    kn_kv_pool *pool;
    kn_kv_cache *cache;
    kn_kv_tier *tier;
};

int kn_kv_mem_create(const kn_kv_pool_params *p, kn_kv_mem **out)
{
    *out = NULL;
    kn_kv_mem *m = calloc(1, sizeof *m);
    if (!m) return TD_ENOMEM;
    m->params = *p;
    if (p->shm_name && !(m->shm_name = strdup(p->shm_name))) {
        free(m);
        return TD_ENOMEM;
    }
    m->params.shm_name = m->shm_name;
    int rc = kn_kv_pool_create(&m->params, &m->pool);
    if (rc) {
        kn_kv_mem_destroy(m);
        return rc;
    }
    *out = m;
    return 0;
}

void kn_kv_mem_destroy(kn_kv_mem *m)
{
    if (!m) return;
    kn_kv_cache_destroy(m->cache); /* its idle blocks go back to the pool first */
    kn_kv_tier_destroy(m->tier);
    kn_kv_pool_destroy(m->pool);
    free(m->shm_name);
    free(m);
}

kn_kv_pool *kn_kv_mem_pool(const kn_kv_mem *m)
{
    return m->pool;
}

int kn_kv_mem_renew_pool(kn_kv_mem *m)
{
    if (!m->pool) return TD_ESTATE;
    int idle = m->cache ? kn_kv_cache_get_stats(m->cache).idle : 0;
    if (kn_kv_pool_n_free(m->pool) + idle != m->pool->n_blocks) return TD_ESTATE; /* held */
    /* The fresh segment takes the old one's name. The old pool must not unlink it when it
       is destroyed below (the name is the fresh segment's by then: a TP follower renewed
       its pool, then its own cleanup removed the new name, and every new leader failed to
       map it, so a decode instance whose rank 0 was restarted never re-formed), and a name
       no leader unlinked yet must go first (the segment is created exclusively). */
    if (m->pool->shm_name) {
        shm_unlink(m->pool->shm_name); /* usually gone already: its mapper unlinked it */
        free(m->pool->shm_name);
        m->pool->shm_name = NULL;
    }
    kn_kv_pool *fresh = NULL;
    int rc = kn_kv_pool_create(&m->params, &fresh);
    if (rc) return rc;  /* the old pool stays */
    kn_kv_mem_clear(m); /* idle blocks back to the old pool; a CLEARED event; the tier too */
    if (m->cache && (rc = kn_kv_cache_rebind(m->cache, fresh))) {
        kn_kv_pool_destroy(fresh); /* cannot happen: emptied, same params */
        return rc;
    }
    kn_kv_pool_destroy(m->pool);
    m->pool = fresh;
    return 0;
}

int kn_kv_mem_add_cache(kn_kv_mem *m)
{
    if (m->cache) return TD_ESTATE;
    int rc = kn_kv_cache_create(m->pool, &m->cache);
    if (!rc && m->tier) kn_kv_cache_set_tier(m->cache, m->tier);
    return rc;
}

int kn_kv_mem_add_tier(kn_kv_mem *m, const kn_kv_tier_params *p)
{
    if (m->tier) return TD_ESTATE;
    int rc = kn_kv_tier_create(p, m->pool, &m->tier);
    if (!rc && m->cache) kn_kv_cache_set_tier(m->cache, m->tier);
    return rc;
}

kn_kv_cache *kn_kv_mem_cache(const kn_kv_mem *m)
{
    return m->cache;
}

kn_kv_tier *kn_kv_mem_tier(const kn_kv_mem *m)
{
    return m->tier;
}

void kn_kv_mem_clear(kn_kv_mem *m)
{
    if (m->cache)
        kn_kv_cache_clear(m->cache);
    else if (m->tier)
        kn_kv_tier_clear(m->tier);
}

/* ---- blocks ---- */

int kn_kv_alloc(kn_kv_mem *m, int n, int32_t *ids)
{
    return m->cache ? kn_kv_cache_alloc(m->cache, n, ids) : kn_kv_pool_take(m->pool, n, ids);
}

void kn_kv_free(kn_kv_mem *m, int n, const int32_t *ids)
{
    if (m->cache) {
        kn_kv_cache_free(m->cache, n, ids);
        return;
    }
    for (int i = n - 1; i >= 0; i--)
        if (kn_kv_pool_unref(m->pool, ids[i])) kn_kv_pool_put(m->pool, ids[i]);
}

int kn_kv_available(const kn_kv_mem *m)
{
    return m->cache ? kn_kv_cache_available(m->cache) : kn_kv_pool_n_free(m->pool);
}

/* ---- sequences ---- */

void kn_kv_seq_init(kn_kv_seq *s)
{
    memset(s, 0, sizeof *s);
    s->chain = kn_kv_cache_root();
}

int kn_kv_seq_match(kn_kv_mem *m, kn_kv_seq *s, const int32_t *tokens, int64_t n_tokens,
                    int max_blocks, kn_kv_tier_budget *tb)
{
    if (!m->cache || s->n_blocks || max_blocks < 1) return 0;
    int rc = TD_GROW_INT(s->blocks, s->cap, max_blocks, 8); /* room without allocating blocks */
    if (rc) return rc;
    int n = kn_kv_cache_match_tier(m->cache, tokens, n_tokens, max_blocks, s->blocks, &s->chain,
                                   m->tier ? tb : NULL);
    s->n_blocks = s->n_entered = n;
    return n;
}

int kn_kv_seq_claim_restored(kn_kv_mem *m, const kn_kv_seq *s)
{
    return m->cache ? kn_kv_cache_claim_restored(m->cache, s->blocks, s->n_entered) : 0;
}

int kn_kv_seq_reserve(kn_kv_mem *m, kn_kv_seq *s, int64_t n_ctx)
{
    if (n_ctx < 0) return TD_EINVAL;
    int need = kn_kv_blocks_for(m->pool, n_ctx);
    if (need <= s->n_blocks) return 0;
    int rc = TD_GROW_INT(s->blocks, s->cap, need, 8);
    if (rc) return rc;
    rc = kn_kv_alloc(m, need - s->n_blocks, s->blocks + s->n_blocks);
    if (rc) return rc;
    s->n_blocks = need;
    return 0;
}

void kn_kv_seq_commit(kn_kv_mem *m, kn_kv_seq *s, const int32_t *tokens, int64_t n_computed)
{
    const int bs = m->pool->block_size;
    if (!m->cache) return;
    while (s->n_entered < s->n_blocks && (int64_t)(s->n_entered + 1) * bs <= n_computed &&
           s->chain.serial) {
        kn_kv_cache_insert(m->cache, &s->chain, tokens + (size_t)s->n_entered * (size_t)bs,
                           s->blocks[s->n_entered]);
        if (!s->chain.serial) break; /* the chain broke at this block: not entered */
        s->n_entered++;
    }
}

/* s's block i is cached (never written again) and s will write into it: s takes a private
 * copy. Even when s alone holds it the entry stays: entries chained after it (s's own blocks
 * past n_ctx, idle now) follow its serial, and forgetting it would leave them unreachable
 * while the router's index still lists them. */
static int copy_on_write(kn_kv_mem *m, kn_kv_seq *s, int i)
{
    int32_t b;
    int rc = kn_kv_alloc(m, 1, &b);
    if (!rc && (rc = kn_kv_block_copy(m->pool, s->blocks[i], b))) kn_kv_free(m, 1, &b);
    if (rc) return rc;
    kn_kv_free(m, 1, &s->blocks[i]);
    s->blocks[i] = b;
    return 0;
}

int kn_kv_seq_rollback(kn_kv_mem *m, kn_kv_seq *s, const int32_t *tokens, int64_t n_ctx)
{
    const int bs = m->pool->block_size;
    if (n_ctx < 0 || n_ctx > (int64_t)s->n_blocks * bs) return TD_EINVAL;
    int keep = kn_kv_blocks_for(m->pool, n_ctx), whole = (int)(n_ctx / bs);
    kn_kv_free(m, s->n_blocks - keep, s->blocks + keep);
    s->n_blocks = keep;
    int rc = 0;
    if (keep > whole && m->cache && kn_kv_cache_holds(m->cache, s->blocks[whole]) &&
        (rc = copy_on_write(m, s, whole))) {
        kn_kv_free(m, 1, &s->blocks[whole]); /* the caller computes its positions again */
        s->n_blocks = whole;
    }
    if (s->n_entered > whole) { /* back to the last whole kept block's place in the chains */
        s->n_entered = whole;
        if (!m->cache || kn_kv_cache_probe(m->cache, tokens, n_ctx, whole, &s->chain) < whole)
            s->chain.serial = 0;
    }
    return rc;
}

void kn_kv_seq_release(kn_kv_mem *m, kn_kv_seq *s)
{
    kn_kv_free(m, s->n_blocks, s->blocks);
    s->n_blocks = 0;
    s->n_entered = 0;
    s->chain = kn_kv_cache_root();
}

void kn_kv_seq_fini(kn_kv_mem *m, kn_kv_seq *s)
{
    if (s->n_blocks) kn_kv_seq_release(m, s);
    free(s->blocks);
    kn_kv_seq_init(s);
}
