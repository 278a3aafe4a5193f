/* kv_cache.c: the prefix cache of a KV pool (kv_cache.h): an open-addressing index from block
 * id to pool block, per-block entries (id, serial, parent serial, tokens), and a doubly
 * linked list of idle cached blocks in the order they became idle. */
#include "kv_cache.h"

#include <stdlib.h>
#include <string.h>

#include "kv_tier.h"
#include "td_blockhash.h"
#include "td_err.h"
#include "td_ilist.h"

#define ROOT_SERIAL 1u /* the root's "entry"; real entries start at 2 */

struct kn_kv_cache {
    kn_kv_pool *pool;
    int bs;               /* tokens per block */
    uint64_t *id;         /* (n_blocks) block id of the entry */
    uint64_t *serial;     /* (n_blocks) 0: not cached */
    uint64_t *parent;     /* (n_blocks) serial of the entry before it */
    uint64_t *pid;        /* (n_blocks) block id of the entry before it */
    int32_t *ntok;        /* (n_blocks) tokens the entry holds: bs, or fewer for a tail */
    int32_t *tok;         /* (n_blocks, bs) the entry's tokens */
    td_ilist idle;        /* the idle blocks (links: n_blocks), least recently idle first */
    int n_idle, n_cached;
    bool no_demand_evict; /* kn_kv_cache_set_demand_evict(false) */
    int32_t *slots;       /* (mask + 1) block of each index slot, -1: empty */
    uint64_t mask;
    uint64_t next_serial;
    uint64_t inserts, evictions;
    struct kn_kv_tier *tier; /* the second tier, or NULL */
    bool *restored;          /* (n_blocks) copied in from the tier, not claimed yet */
    kn_kv_event *ev;         /* (ev_cap) ring of the latest events: seq s at (s - 1) % ev_cap */
    int ev_cap;
    uint64_t ev_next; /* seq of the next event */
    uint64_t ev_skip; /* events before this seq were dropped with the previous log */
};

/* Log one event (a no-op without a log). */
static void ev_log(kn_kv_cache *c, uint8_t kind, uint64_t id)
{
    if (c->ev_cap)
        c->ev[(c->ev_next - 1) % (uint64_t)c->ev_cap] = (kn_kv_event){.id = id, .kind = kind};
    c->ev_next++;
}

int kn_kv_cache_set_event_log(kn_kv_cache *c, int capacity)
{
    if (capacity < 0) return TD_EINVAL;
    kn_kv_event *ev = NULL;
    if (capacity && !(ev = calloc((size_t)capacity, sizeof *ev))) return TD_ENOMEM;
    free(c->ev);
    c->ev = ev;
    c->ev_cap = capacity;
    c->ev_skip = c->ev_next; /* what was logged is gone */
    return 0;
}

uint64_t kn_kv_cache_event_next(const kn_kv_cache *c)
{
    return c->ev_next;
}

int kn_kv_cache_events(const kn_kv_cache *c, uint64_t since, kn_kv_event *out, int max,
                       uint64_t *first)
{
    /* the oldest kept: the ring's capacity back from the next, and not before the log was
       (re)made */
    uint64_t oldest = c->ev_next > (uint64_t)c->ev_cap ? c->ev_next - (uint64_t)c->ev_cap : 1;
    if (oldest < c->ev_skip) oldest = c->ev_skip;
    uint64_t s = since < oldest ? oldest : since;
    if (s > c->ev_next) s = c->ev_next;
    *first = s;
    int n = 0;
    for (; n < max && s + (uint64_t)n < c->ev_next; n++)
        out[n] = c->ev[(s + (uint64_t)n - 1) % (uint64_t)c->ev_cap];
    return n;
}

int kn_kv_cache_create(kn_kv_pool *pool, kn_kv_cache **out)
{
    *out = NULL;
    kn_kv_cache *c = calloc(1, sizeof *c);
    if (!c) return TD_ENOMEM;
    td_ilist_clear(&c->idle); /* before any failure: destroy walks the idle list */
    size_t nb = (size_t)pool->n_blocks, cap = 16;
    while (cap < 2 * nb)
        cap *= 2;
    c->pool = pool;
    c->bs = pool->block_size;
    c->id = calloc(nb, sizeof *c->id);
    c->serial = calloc(nb, sizeof *c->serial);
    c->parent = calloc(nb, sizeof *c->parent);
    c->pid = calloc(nb, sizeof *c->pid);
    c->ntok = calloc(nb, sizeof *c->ntok);
    c->tok = malloc(nb * (size_t)c->bs * sizeof *c->tok);
    c->idle.prev = malloc(nb * sizeof *c->idle.prev);
    c->idle.next = malloc(nb * sizeof *c->idle.next);
    c->slots = malloc(cap * sizeof *c->slots);
    c->restored = calloc(nb, sizeof *c->restored);
    if (!c->id || !c->serial || !c->parent || !c->pid || !c->ntok || !c->tok || !c->idle.prev ||
        !c->idle.next || !c->slots || !c->restored) {
        kn_kv_cache_destroy(c);
        return TD_ENOMEM;
    }
    memset(c->slots, 0xff, cap * sizeof *c->slots);
    c->mask = cap - 1;
    td_ilist_clear(&c->idle);
    c->next_serial = ROOT_SERIAL + 1;
    c->ev_next = c->ev_skip = 1;
    if (kn_kv_cache_set_event_log(c, KN_KV_EVENT_LOG_DEFAULT)) {
        kn_kv_cache_destroy(c);
        return TD_ENOMEM;
    }
    *out = c;
    return 0;
}

void kn_kv_cache_destroy(kn_kv_cache *c)
{
    if (!c) return;
    if (c->idle.next) /* idle blocks are nobody's: back to the free list */
        for (int32_t b = c->idle.head; b >= 0; b = c->idle.next[b])
            kn_kv_pool_put(c->pool, b);
    free(c->id);
    free(c->serial);
    free(c->parent);
    free(c->pid);
    free(c->ntok);
    free(c->tok);
    free(c->idle.prev);
    free(c->idle.next);
    free(c->slots);
    free(c->restored);
    free(c->ev);
    free(c);
}

kn_kv_chain kn_kv_cache_root(void)
{
    return (kn_kv_chain){.id = TD_BLOCK_HASH_ROOT, .serial = ROOT_SERIAL};
}

/* ---- index: linear probing keyed by block id, deletion by backward shift ---- */

static uint64_t slot_of(const kn_kv_cache *c, uint64_t id)
{
    return (id ^ (id >> 29)) & c->mask;
}

static int32_t index_find(const kn_kv_cache *c, uint64_t id)
{
    for (uint64_t i = slot_of(c, id);; i = (i + 1) & c->mask) {
        int32_t b = c->slots[i];
        if (b < 0 || c->id[b] == id) return b;
    }
}

static void index_add(kn_kv_cache *c, int32_t b)
{
    uint64_t i = slot_of(c, c->id[b]);
    while (c->slots[i] >= 0)
        i = (i + 1) & c->mask;
    c->slots[i] = b;
}

static void index_del(kn_kv_cache *c, int32_t b)
{
    uint64_t i = slot_of(c, c->id[b]);
    while (c->slots[i] != b)
        i = (i + 1) & c->mask;
    /* shift later members of the probe run back into the hole */
    for (uint64_t j = (i + 1) & c->mask; c->slots[j] >= 0; j = (j + 1) & c->mask) {
        uint64_t home = slot_of(c, c->id[c->slots[j]]);
        /* j's entry may move to i unless its home lies cyclically in (i, j] */
        bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (stays) continue;
        c->slots[i] = c->slots[j];
        i = j;
    }
    c->slots[i] = -1;
}

/* ---- idle list ---- */

static void idle_unlink(kn_kv_cache *c, int32_t b)
{
    td_ilist_unlink(&c->idle, b);
    c->n_idle--;
}

static void idle_append(kn_kv_cache *c, int32_t b)
{
    td_ilist_append(&c->idle, b);
    c->n_idle++;
}

/* Drop entry b from the index (its block keeps its references or is idle: the caller says) */
static void entry_drop(kn_kv_cache *c, int32_t b)
{
    if (c->ntok[b] == c->bs) ev_log(c, KN_KV_EV_REMOVED, c->id[b]); /* tails: no events */
    index_del(c, b);
    c->serial[b] = 0;
    c->restored[b] = false;
    c->n_cached--;
}

void kn_kv_cache_clear(kn_kv_cache *c)
{
    while (c->idle.head >= 0) {
        int32_t b = c->idle.head;
        idle_unlink(c, b);
        kn_kv_pool_put(c->pool, b);
    }
    memset(c->slots, 0xff, (size_t)(c->mask + 1) * sizeof *c->slots);
    memset(c->serial, 0, (size_t)c->pool->n_blocks * sizeof *c->serial);
    memset(c->restored, 0, (size_t)c->pool->n_blocks * sizeof *c->restored);
    c->n_cached = 0;
    if (c->tier) kn_kv_tier_clear(c->tier);
    ev_log(c, KN_KV_EV_CLEARED, 0);
}

/* Enter pool block b (held by the caller) as the entry (id, serial) of n tokens after the
 * entry (its id and serial) of the block before it. Only whole blocks are logged: a tail is
 * a leaf nobody indexes (kv_cache.h). */
static void entry_add(kn_kv_cache *c, int32_t b, uint64_t id, uint64_t serial,
                      const kn_kv_chain *parent, const int32_t *tokens, int n)
{
    if (n == c->bs) ev_log(c, KN_KV_EV_STORED, id);
    c->id[b] = id;
    c->serial[b] = serial;
    c->parent[b] = parent->serial;
    c->pid[b] = parent->id;
    c->ntok[b] = n;
    memcpy(c->tok + (size_t)b * (size_t)c->bs, tokens, (size_t)n * sizeof *tokens);
    index_add(c, b);
    c->n_cached++;
}

/* The entry of the n tokens t after chain ch (n = bs: a whole block), or -1. */
static int32_t lookup_n(const kn_kv_cache *c, const kn_kv_chain *ch, const int32_t *t, int n,
                        uint64_t *id)
{
    *id = td_block_hash(ch->id, t, (size_t)n);
    int32_t b = index_find(c, *id);
    bool hit = b >= 0 && c->parent[b] == ch->serial && c->ntok[b] == n &&
               !memcmp(c->tok + (size_t)b * (size_t)c->bs, t, (size_t)n * sizeof *t);
    return hit ? b : -1;
}

static int32_t lookup(const kn_kv_cache *c, const kn_kv_chain *ch, const int32_t *t, uint64_t *id)
{
    return lookup_n(c, ch, t, c->bs, id);
}

/* The query's next block (id, tokens t, after chain ch) is not in the pool as it should be
 * (existing: the pool's entry of that id that does not fit, or -1): copy it in from the
 * tier into a new block, entered under the tier entry's serial. The block, or -1. */
static int32_t restore(kn_kv_cache *c, uint64_t id, const kn_kv_chain *ch, const int32_t *t,
                       int32_t existing)
{
    uint64_t serial;
    if (kn_kv_tier_find(c->tier, id, ch->serial, t, &serial) < 0) return -1;
    if (existing >= 0) { /* a stale or colliding entry: it gives way if nobody holds it */
        if (c->pool->refs[existing] > 0) return -1;
        idle_unlink(c, existing);
        entry_drop(c, existing);
        kn_kv_pool_put(c->pool, existing);
    }
    int32_t b;
    if (kn_kv_cache_alloc(c, 1, &b)) return -1;
    /* the allocation may have evicted blocks into a full tier, dropping this entry */
    int slot = kn_kv_tier_find(c->tier, id, ch->serial, t, &serial);
    if (slot < 0 || kn_kv_tier_get(c->tier, slot, c->pool, b)) {
        kn_kv_cache_free(c, 1, &b);
        return -1;
    }
    entry_add(c, b, id, serial, ch, t, c->bs);
    c->restored[b] = true;
    return b;
}

int kn_kv_cache_match_tier(kn_kv_cache *c, const int32_t *tokens, int64_t n_tokens, int max_blocks,
                           int32_t *blocks, kn_kv_chain *chain, kn_kv_tier_budget *tb)
{
    kn_kv_chain ch = kn_kv_cache_root();
    int n = 0;
    while (n < max_blocks && (int64_t)(n + 1) * c->bs <= n_tokens) {
        const int32_t *t = tokens + (size_t)n * (size_t)c->bs;
        uint64_t id;
        int32_t b = lookup(c, &ch, t, &id);
        if (b >= 0) {
            if (c->pool->refs[b] == 0) idle_unlink(c, b);
            kn_kv_pool_ref(c->pool, b);
        } else {
            if (!tb || !c->tier) break;
            if (tb->copies_left <= 0) {
                uint64_t serial;
                tb->more = kn_kv_tier_find(c->tier, id, ch.serial, t, &serial) >= 0;
                break;
            }
            if ((b = restore(c, id, &ch, t, index_find(c, id))) < 0) break;
            tb->copies_left--;
            tb->copied++;
        }
        blocks[n++] = b;
        ch = (kn_kv_chain){.id = id, .serial = c->serial[b]};
    }
    *chain = ch;
    return n;
}

int kn_kv_cache_match(kn_kv_cache *c, const int32_t *tokens, int64_t n_tokens, int max_blocks,
                      int32_t *blocks, kn_kv_chain *chain)
{
    return kn_kv_cache_match_tier(c, tokens, n_tokens, max_blocks, blocks, chain, NULL);
}

void kn_kv_cache_set_tier(kn_kv_cache *c, struct kn_kv_tier *tier)
{
    c->tier = tier;
}

struct kn_kv_tier *kn_kv_cache_tier(const kn_kv_cache *c)
{
    return c->tier;
}

int kn_kv_cache_claim_restored(kn_kv_cache *c, const int32_t *blocks, int n)
{
    int k = 0;
    for (int i = 0; i < n; i++)
        if (c->restored[blocks[i]]) {
            c->restored[blocks[i]] = false;
            k++;
        }
    return k;
}

bool kn_kv_cache_insert(kn_kv_cache *c, kn_kv_chain *chain, const int32_t *tokens, int32_t block)
{
    return kn_kv_cache_insert_n(c, chain, tokens, c->bs, block);
}

bool kn_kv_cache_insert_n(kn_kv_cache *c, kn_kv_chain *chain, const int32_t *tokens, int n,
                          int32_t block)
{
    if (!chain->serial || n < 1 || n > c->bs) return false;
    if (block < 0 || block >= c->pool->n_blocks || c->pool->refs[block] < 1) {
        /* the caller's bug: an unreferenced block; stop its chain */
        TD_LOG_ERR("kv cache: block %d entered while free (bug)", block);
        chain->serial = 0;
        return false;
    }
    uint64_t id = td_block_hash(chain->id, tokens, (size_t)n);
    int32_t e = index_find(c, id);
    if (e >= 0) {
        bool same = c->parent[e] == chain->serial && c->ntok[e] == n &&
                    !memcmp(c->tok + (size_t)e * (size_t)c->bs, tokens, (size_t)n * sizeof *tokens);
        if (same) { /* entered already (maybe by someone else): go on through it */
            *chain = (kn_kv_chain){.id = id, .serial = c->serial[e]};
            return false;
        }
        if (c->pool->refs[e] > 0) { /* a collision or a stale parent, still in use */
            chain->serial = 0;
            return false;
        }
        /* idle and useless to this chain: it gives way (its block becomes free) */
        idle_unlink(c, e);
        entry_drop(c, e);
        kn_kv_pool_put(c->pool, e);
    }
    if (c->serial[block]) { /* cached under another prefix: it cannot hold this one */
        chain->serial = 0;
        return false;
    }
    entry_add(c, block, id, c->next_serial++, chain, tokens, n);
    c->inserts++;
    *chain = (kn_kv_chain){.id = id, .serial = c->serial[block]};
    return true;
}

int kn_kv_cache_rebind(kn_kv_cache *c, kn_kv_pool *pool)
{
    if (c->n_cached || c->n_idle || pool->n_blocks != c->pool->n_blocks ||
        pool->block_size != c->bs)
        return TD_ESTATE;
    c->pool = pool;
    return 0;
}

bool kn_kv_cache_holds(const kn_kv_cache *c, int32_t block)
{
    return block >= 0 && block < c->pool->n_blocks && c->serial[block] != 0;
}

int kn_kv_cache_probe(const kn_kv_cache *c, const int32_t *tokens, int64_t n_tokens, int max_blocks,
                      kn_kv_chain *chain)
{
    kn_kv_chain ch = kn_kv_cache_root();
    int n = 0;
    for (; n < max_blocks && (int64_t)(n + 1) * c->bs <= n_tokens; n++) {
        uint64_t id;
        int32_t b = lookup(c, &ch, tokens + (size_t)n * (size_t)c->bs, &id);
        if (b < 0) break;
        ch = (kn_kv_chain){.id = id, .serial = c->serial[b]};
    }
    *chain = ch;
    return n;
}

bool kn_kv_cache_probe_tail(const kn_kv_cache *c, const kn_kv_chain *chain, const int32_t *tokens,
                            int n, uint64_t *id)
{
    uint64_t found;
    if (n < 1 || n >= c->bs || lookup_n(c, chain, tokens, n, &found) < 0) return false;
    *id = found; /* untouched on a miss: callers pass the id they hold */
    return true;
}

int32_t kn_kv_cache_find(const kn_kv_cache *c, uint64_t id)
{
    return index_find(c, id);
}

kn_kv_entry kn_kv_cache_entry(const kn_kv_cache *c, int32_t block)
{
    return (kn_kv_entry){.id = c->id[block],
                         .serial = c->serial[block],
                         .parent = {.id = c->pid[block], .serial = c->parent[block]},
                         .n_tokens = c->ntok[block],
                         .tokens = c->tok + (size_t)block * (size_t)c->bs};
}

void kn_kv_cache_take(kn_kv_cache *c, int32_t block)
{
    if (c->pool->refs[block] == 0 && c->serial[block]) idle_unlink(c, block);
    kn_kv_pool_ref(c->pool, block);
}

void kn_kv_cache_forget(kn_kv_cache *c, int32_t block)
{
    if (!c->serial[block]) return;
    bool idle = c->pool->refs[block] == 0;
    if (idle) idle_unlink(c, block);
    entry_drop(c, block);
    if (idle) kn_kv_pool_put(c->pool, block);
}

void kn_kv_cache_set_demand_evict(kn_kv_cache *c, bool on)
{
    c->no_demand_evict = !on;
}

kn_kv_cache_stats kn_kv_cache_get_stats(const kn_kv_cache *c)
{
    return (kn_kv_cache_stats){
        .cached = c->n_cached, .idle = c->n_idle, .inserts = c->inserts, .evictions = c->evictions};
}

/* Evict the least recently idle block (written to the tier first, if any): it leaves the
 * index and goes back to the free list. false if none is idle. */
static bool evict_one(kn_kv_cache *c)
{
    int32_t b = c->idle.head;
    if (b < 0) return false;
    idle_unlink(c, b);
    /* to the second tier first (a failure is the tier's error: the block is only lost) */
    if (c->tier && c->ntok[b] == c->bs)
        kn_kv_tier_put(c->tier, c->pool, b, c->id[b], c->serial[b], c->parent[b],
                       c->tok + (size_t)b * (size_t)c->bs);
    entry_drop(c, b);
    c->evictions++;
    kn_kv_pool_put(c->pool, b);
    return true;
}

int kn_kv_cache_available(const kn_kv_cache *c)
{
    return kn_kv_pool_n_free(c->pool) + (c->no_demand_evict ? 0 : c->n_idle);
}

int kn_kv_cache_alloc(kn_kv_cache *c, int n, int32_t *ids)
{
    if (n < 0) return TD_EINVAL;
    if (n > kn_kv_cache_available(c)) return TD_ENOSPC;
    while (kn_kv_pool_n_free(c->pool) < n) /* the free list is short: evict, oldest first */
        evict_one(c);
    return kn_kv_pool_take(c->pool, n, ids);
}

void kn_kv_cache_free(kn_kv_cache *c, int n, const int32_t *ids)
{
    for (int i = n - 1; i >= 0; i--) {
        int32_t b = ids[i];
        if (!kn_kv_pool_unref(c->pool, b)) continue;
        if (c->serial[b])
            idle_append(c, b); /* cached: kept idle, most recently */
        else
            kn_kv_pool_put(c->pool, b);
    }
}
