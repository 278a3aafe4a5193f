/* pf_kvcache.c: a prefill stage's prefix cache (see pf_kvcache.h): the stream-ordered policy
 * (stream references, an LRU of the indexed blocks, the block budget) over the KV memory's
 * block cache (kvmem/kv_cache.h), which holds the index, the tokens, the chains and the events. */
#include "pf_kvcache.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "td_blockhash.h"
#include "td_err.h"
#include "td_ilist.h"

struct pf_kvc {
    kn_kv_mem *mem;
    kn_kv_cache *cache; /* mem's */
    int bs, max_blocks, n_blocks;
    int32_t *ref;         /* (n_blocks) stream references of an indexed block */
    td_ilist lru;         /* the indexed blocks (links: n_blocks), least recently used first */
    bool *indexed;        /* (n_blocks) in the policy's index (and the cache's) */
    bool *detached;       /* (n_blocks) left the index while a request still used it */
    int32_t *work;        /* (n_blocks) detach's worklist */
    int32_t *n_child;     /* (n_blocks) indexed entries chained right after an indexed block */
    pf_kvc_stats stats;
};

int pf_kvc_create(kn_kv_mem *mem, int max_blocks, pf_kvc **out)
{
    *out = NULL;
    if (!mem || max_blocks < 1) return TD_EINVAL;
    int rc = kn_kv_mem_cache(mem) ? 0 : kn_kv_mem_add_cache(mem);
    if (rc) return rc;
    pf_kvc *c = calloc(1, sizeof *c);
    if (!c) return TD_ENOMEM;
    c->mem = mem;
    c->cache = kn_kv_mem_cache(mem);
    c->bs = kn_kv_mem_pool(mem)->block_size;
    c->n_blocks = kn_kv_mem_pool(mem)->n_blocks;
    c->max_blocks = max_blocks;
    td_ilist_clear(&c->lru);
    size_t nb = (size_t)c->n_blocks;
    c->ref = calloc(nb, sizeof *c->ref);
    c->lru.prev = malloc(nb * sizeof *c->lru.prev);
    c->lru.next = malloc(nb * sizeof *c->lru.next);
    c->indexed = calloc(nb, sizeof *c->indexed);
    c->detached = calloc(nb, sizeof *c->detached);
    c->work = malloc(nb * sizeof *c->work);
    c->n_child = calloc(nb, sizeof *c->n_child);
    if (!c->ref || !c->lru.prev || !c->lru.next || !c->indexed || !c->detached || !c->work ||
        !c->n_child) {
        pf_kvc_destroy(c);
        return TD_ENOMEM;
    }
    /* every stage evicts at the same points of the stream, whatever its physical holds */
    kn_kv_cache_set_demand_evict(c->cache, false);
    *out = c;
    return 0;
}

void pf_kvc_destroy(pf_kvc *c)
{
    if (!c) return;
    if (c->indexed) pf_kvc_flush(c);
    free(c->ref);
    free(c->lru.prev);
    free(c->lru.next);
    free(c->indexed);
    free(c->detached);
    free(c->work);
    free(c->n_child);
    free(c);
}

/* The indexed block whose entry the chain ch ends in, or -1 (the root, or not indexed). */
static int32_t chain_block(const pf_kvc *c, kn_kv_chain ch)
{
    if (ch.serial == kn_kv_cache_root().serial) return -1;
    int32_t b = kn_kv_cache_find(c->cache, ch.id);
    return b >= 0 && c->indexed[b] && kn_kv_cache_entry(c->cache, b).serial == ch.serial ? b : -1;
}

/* Take b out of the policy's index; the cache forgets it (its block goes back to the pool
 * unless a request still uses it: then when the last one lets go). */
static void drop(pf_kvc *c, int32_t b)
{
    int32_t pb = chain_block(c, kn_kv_cache_entry(c->cache, b).parent);
    if (pb >= 0) c->n_child[pb]--;
    td_ilist_unlink(&c->lru, b);
    c->indexed[b] = false;
    c->ref[b] = 0;
    c->stats.n_indexed--;
    if (kn_kv_mem_pool(c->mem)->refs[b] > 0) {
        c->detached[b] = true;
        c->stats.n_detached++;
    }
    kn_kv_cache_forget(c->cache, b);
}

/* Drop b and every entry that chains after it: an entry is matched only after the very entry
 * before it (serials are never reused), so b's descendants could never be matched again; they
 * go at once, each with its REMOVED event, so that the events describe what can be matched.
 * Returns the entries dropped. The index is searched for children only where an entry has
 * some (n_child): eviction takes the least recently used entry, which is mostly a leaf
 * (insert makes parents more recent than their children). */
static int detach(pf_kvc *c, int32_t b)
{
    int n_work = 0, dropped = 0;
    c->work[n_work++] = b;
    while (n_work) {
        int32_t x = c->work[--n_work];
        uint64_t serial = kn_kv_cache_entry(c->cache, x).serial;
        int children = c->n_child[x];
        drop(c, x);
        dropped++;
        for (int32_t y = c->lru.head; y >= 0 && children > 0; y = c->lru.next[y])
            if (kn_kv_cache_entry(c->cache, y).parent.serial == serial) {
                c->work[n_work++] = y;
                children--;
            }
    }
    return dropped;
}

/* Whether the entry chain ch ends in is still indexed (the root always is). */
static bool chain_alive(const pf_kvc *c, const kn_kv_chain *ch)
{
    return ch->serial == kn_kv_cache_root().serial || chain_block(c, *ch) >= 0;
}

/* How many entries the chain ending in entry b holds back to the root (b's depth + 1), or
 * -1 if it does not reach the root through entries. */
static int chain_length(const pf_kvc *c, int32_t b)
{
    int n = 0;
    for (; b >= 0 && n <= c->n_blocks; n++) {
        kn_kv_entry e = kn_kv_cache_entry(c->cache, b);
        if (e.parent.serial == kn_kv_cache_root().serial)
            return e.parent.id == TD_BLOCK_HASH_ROOT ? n + 1 : -1;
        b = kn_kv_cache_find(c->cache, e.parent.id);
        if (b >= 0 && kn_kv_cache_entry(c->cache, b).serial != e.parent.serial) return -1;
    }
    return -1;
}

int pf_kvc_match(const pf_kvc *c, const int32_t *tokens, int n, int max_blocks, uint64_t *last_id)
{
    kn_kv_chain ch;
    int k = kn_kv_cache_probe(c->cache, tokens, n, max_blocks, &ch);
    *last_id = ch.id;
    return k;
}

bool pf_kvc_match_tail(const pf_kvc *c, uint64_t parent, int depth, const int32_t *tokens, int n,
                       uint64_t *id)
{
    kn_kv_chain ch = kn_kv_cache_root();
    if (depth > 0) {
        int32_t b = kn_kv_cache_find(c->cache, parent);
        if (b < 0 || chain_length(c, b) != depth) return false;
        ch = (kn_kv_chain){.id = parent, .serial = kn_kv_cache_entry(c->cache, b).serial};
    } else if (parent != TD_BLOCK_HASH_ROOT) {
        return false;
    }
    return kn_kv_cache_probe_tail(c->cache, &ch, tokens, n, id);
}

int pf_kvc_acquire(pf_kvc *c, uint64_t last_id, int n, int32_t *blocks, int32_t *tokens)
{
    if (n < 1) return TD_ENOENT;
    int32_t b = kn_kv_cache_find(c->cache, last_id);
    if (b < 0 || chain_length(c, b) != n) return TD_ENOENT;
    for (int i = n - 1; i >= 0; i--) { /* from the leaf back to the root */
        kn_kv_entry e = kn_kv_cache_entry(c->cache, b);
        if (!c->indexed[b] || (i < n - 1 && e.n_tokens != c->bs)) return TD_ENOENT;
        blocks[i] = b;
        if (i) b = kn_kv_cache_find(c->cache, e.parent.id);
    }
    for (int i = n - 1; i >= 0; i--) { /* the root ends most recent: evicted last */
        int32_t k = blocks[i];
        kn_kv_entry e = kn_kv_cache_entry(c->cache, k);
        c->ref[k]++;
        kn_kv_cache_take(c->cache, k);
        td_ilist_unlink(&c->lru, k);
        td_ilist_append(&c->lru, k);
        if (tokens)
            memcpy(tokens + (size_t)i * (size_t)c->bs, e.tokens,
                   (size_t)e.n_tokens * sizeof *tokens);
    }
    return 0;
}

void pf_kvc_unref(pf_kvc *c, const int32_t *blocks, int n)
{
    for (int i = 0; i < n; i++)
        if (c->indexed[blocks[i]] && c->ref[blocks[i]] > 0) c->ref[blocks[i]]--;
}

void pf_kvc_unuse(pf_kvc *c, const int32_t *blocks, int n)
{
    const kn_kv_pool *pool = kn_kv_mem_pool(c->mem);
    for (int i = 0; i < n; i++) {
        int32_t b = blocks[i];
        if (c->detached[b] && pool->refs[b] == 1) { /* its last user: back to the pool */
            c->detached[b] = false;
            c->stats.n_detached--;
        }
        kn_kv_free(c->mem, 1, &b);
    }
}

/* Make room for one more indexed block: evict the least recently used unreferenced one. */
static bool make_room(pf_kvc *c)
{
    if (c->stats.n_indexed < c->max_blocks) return true;
    for (int32_t b = c->lru.head; b >= 0; b = c->lru.next[b])
        if (!c->ref[b]) {
            c->stats.evicted += (uint64_t)detach(c, b); /* REMOVED events: the cache's */
            return true;
        }
    return false;
}

/* Index blocks[i] (the request's, entered by the cache after *ch as nt tokens t): ref 1
 * while its prompt is inserted (its own blocks are not evicted for it). */
static bool index_one(pf_kvc *c, kn_kv_chain *ch, const int32_t *t, int nt, int32_t b)
{
    /* evicting may take the chain's last entry (a prefix no request holds any more) */
    if (!make_room(c) || !chain_alive(c, ch)) return false;
    int32_t pb = chain_block(c, *ch);
    if (!kn_kv_cache_insert_n(c->cache, ch, t, nt, b)) return false;
    if (pb >= 0) c->n_child[pb]++;
    c->n_child[b] = 0;
    c->ref[b] = 1;
    c->indexed[b] = true;
    td_ilist_append(&c->lru, b);
    c->stats.n_indexed++;
    c->stats.inserted++;
    kn_kv_free(c->mem, 1, &b); /* the request's hold becomes the cache's keeping */
    return true;
}

int pf_kvc_insert(pf_kvc *c, const int32_t *tokens, int n, int n_tail, const int32_t *blocks,
                  int from)
{
    kn_kv_chain ch;
    bool linked = kn_kv_cache_probe(c->cache, tokens, (int64_t)from * c->bs, from, &ch) == from;
    if (n_tail < 0 || n_tail >= c->bs) n_tail = 0;
    const int end = n + (n_tail > 0); /* blocks[n]: the tail's */
    int32_t *added = end > from ? malloc((size_t)(end - from) * sizeof *added) : NULL;
    int n_added = 0, i = from;
    for (; linked && added && i < end; i++) {
        const int nt = i < n ? c->bs : n_tail;
        const int32_t *t = tokens + (size_t)i * (size_t)c->bs;
        uint64_t nid = td_block_hash(ch.id, t, (size_t)nt);
        int32_t e = kn_kv_cache_find(c->cache, nid);
        if (e >= 0) {
            kn_kv_entry en = kn_kv_cache_entry(c->cache, e);
            if (en.parent.serial != ch.serial || en.n_tokens != nt ||
                memcmp(en.tokens, t, (size_t)nt * sizeof *t))
                break; /* a collision: keep the older block, insert nothing after it */
            kn_kv_free(c->mem, 1, &blocks[i]); /* another request inserted it meanwhile */
            ch = (kn_kv_chain){.id = nid, .serial = en.serial};
            continue;
        }
        if (!index_one(c, &ch, t, nt, blocks[i])) break;
        added[n_added++] = blocks[i];
    }
    if (i < end) kn_kv_free(c->mem, end - i, blocks + i);
    /* parents more recent than their children: a prefix outlives its extensions */
    for (int k = n_added - 1; k >= 0; k--) {
        if (!c->indexed[added[k]]) continue; /* dropped with an evicted prefix meanwhile */
        c->ref[added[k]] = 0;
        td_ilist_unlink(&c->lru, added[k]);
        td_ilist_append(&c->lru, added[k]);
    }
    free(added);
    return n_added;
}

void pf_kvc_flush(pf_kvc *c)
{
    const kn_kv_pool *pool = kn_kv_mem_pool(c->mem);
    for (int32_t b = c->lru.head; b >= 0; b = c->lru.next[b]) {
        c->indexed[b] = false;
        c->ref[b] = 0;
        c->stats.flushed++;
        if (pool->refs[b] > 0) {
            c->detached[b] = true;
            c->stats.n_detached++;
        }
    }
    td_ilist_clear(&c->lru);
    c->stats.n_indexed = 0;
    kn_kv_cache_clear(c->cache); /* one CLEARED event: what follows describes the cache whole */
}

void pf_kvc_get_stats(const pf_kvc *c, pf_kvc_stats *out)
{
    *out = c->stats;
}

uint64_t pf_kvc_event_next(const pf_kvc *c)
{
    return kn_kv_cache_event_next(c->cache);
}

int pf_kvc_events(const pf_kvc *c, int max, uint8_t *kind, uint64_t *ids, int *n_ids,
                  uint64_t *first)
{
    uint64_t next = kn_kv_cache_event_next(c->cache), want = max < 0 ? 0 : (uint64_t)max;
    if (want > PF_KVC_EVENT_LOG) want = PF_KVC_EVENT_LOG;
    if (want > next - 1) want = next - 1;
    kn_kv_event ev[PF_KVC_EVENT_LOG];
    int n = kn_kv_cache_events(c->cache, next - want, ev, (int)want, first);
    *n_ids = 0;
    for (int k = 0; k < n; k++) {
        kind[k] = ev[k].kind;
        if (kind[k] != KN_KV_EV_CLEARED) ids[(*n_ids)++] = ev[k].id;
    }
    return n;
}
