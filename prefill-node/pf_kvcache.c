/* pf_kvcache.c: a prefill stage's prefix cache (see pf_kvcache.h): a hash table of block
 * ids (chained buckets), an LRU list of the indexed blocks, and the blocks' tokens. */
#include "pf_kvcache.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "td_blockhash.h"
#include "td_err.h"

struct pf_kvc_ent {
    uint64_t id, parent; /* td_block_hash ids */
    int32_t block;       /* pool block id */
    int depth;           /* block index in its prompt (0: the first) */
    int n_tok;           /* tokens held: block_size, or fewer for a prompt's tail */
    int ref, users;
    bool indexed;
    struct pf_kvc_ent *hnext;       /* bucket chain */
    struct pf_kvc_ent *prev, *next; /* LRU list: head = least recently used */
    int32_t tokens[];               /* (n_tok) */
};

struct pf_kvc {
    kn_kv_pool *pool;
    int bs, max_blocks;
    pf_kvc_ent **buckets; /* (mask + 1) */
    uint64_t mask;
    pf_kvc_ent *head, *tail;
    pf_kvc_stats stats;
    uint64_t ev_id[PF_KVC_EVENT_LOG]; /* ring of the latest events: seq s at (s - 1) % LOG */
    uint8_t ev_kind[PF_KVC_EVENT_LOG];
    uint64_t ev_next; /* seq of the next event */
};

static void log_event(pf_kvc *c, uint8_t kind, uint64_t id)
{
    size_t at = (size_t)((c->ev_next - 1) % PF_KVC_EVENT_LOG);
    c->ev_id[at] = id;
    c->ev_kind[at] = kind;
    c->ev_next++;
}

uint64_t pf_kvc_event_next(const pf_kvc *c)
{
    return c->ev_next;
}

int pf_kvc_events(const pf_kvc *c, int max, uint8_t *kind, uint64_t *ids, int *n_ids,
                  uint64_t *first)
{
    uint64_t n = c->ev_next - 1, lim = max < 0 ? 0 : (uint64_t)max;
    if (n > PF_KVC_EVENT_LOG) n = PF_KVC_EVENT_LOG;
    if (n > lim) n = lim;
    *first = c->ev_next - n;
    *n_ids = 0;
    for (uint64_t k = 0; k < n; k++) {
        size_t at = (size_t)((*first + k - 1) % PF_KVC_EVENT_LOG);
        kind[k] = c->ev_kind[at];
        if (kind[k] != PF_KVC_EV_CLEARED) ids[(*n_ids)++] = c->ev_id[at];
    }
    return (int)n;
}

int pf_kvc_create(kn_kv_pool *pool, int max_blocks, pf_kvc **out)
{
    *out = NULL;
    if (!pool || max_blocks < 1) return TD_EINVAL;
    pf_kvc *c = calloc(1, sizeof *c);
    if (!c) return TD_ENOMEM;
    uint64_t n = 16;
    while (n < 2 * (uint64_t)max_blocks)
        n <<= 1;
    c->buckets = calloc(n, sizeof *c->buckets);
    if (!c->buckets) {
        free(c);
        return TD_ENOMEM;
    }
    c->mask = n - 1;
    c->pool = pool;
    c->bs = pool->block_size;
    c->max_blocks = max_blocks;
    c->ev_next = 1;
    *out = c;
    return 0;
}

static pf_kvc_ent *find(const pf_kvc *c, uint64_t id)
{
    for (pf_kvc_ent *e = c->buckets[id & c->mask]; e; e = e->hnext)
        if (e->id == id) return e;
    return NULL;
}

static void lru_unlink(pf_kvc *c, pf_kvc_ent *e)
{
    if (e->prev)
        e->prev->next = e->next;
    else
        c->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        c->tail = e->prev;
    e->prev = e->next = NULL;
}

static void lru_push(pf_kvc *c, pf_kvc_ent *e) /* most recently used */
{
    e->prev = c->tail;
    e->next = NULL;
    if (c->tail)
        c->tail->next = e;
    else
        c->head = e;
    c->tail = e;
}

static void drop_block(pf_kvc *c, pf_kvc_ent *e)
{
    kn_kv_free(c->pool, 1, &e->block);
    free(e);
}

/* Take e out of the index; its block goes back to the pool unless a request still uses it. */
static void detach(pf_kvc *c, pf_kvc_ent *e)
{
    pf_kvc_ent **pp = &c->buckets[e->id & c->mask];
    while (*pp != e)
        pp = &(*pp)->hnext;
    *pp = e->hnext;
    lru_unlink(c, e);
    e->indexed = false;
    c->stats.n_indexed--;
    if (e->users)
        c->stats.n_detached++;
    else
        drop_block(c, e);
}

void pf_kvc_destroy(pf_kvc *c)
{
    if (!c) return;
    pf_kvc_flush(c);
    free(c->buckets);
    free(c);
}

int pf_kvc_match(const pf_kvc *c, const int32_t *tokens, int n, int max_blocks, uint64_t *last_id)
{
    uint64_t id = TD_BLOCK_HASH_ROOT;
    int k = 0;
    for (; k < max_blocks && (int64_t)(k + 1) * c->bs <= n; k++) {
        const int32_t *t = tokens + (size_t)k * (size_t)c->bs;
        uint64_t nid = td_block_hash(id, t, (size_t)c->bs);
        const pf_kvc_ent *e = find(c, nid);
        if (!e || e->parent != id || e->depth != k || e->n_tok != c->bs ||
            memcmp(e->tokens, t, (size_t)c->bs * sizeof *t))
            break;
        id = nid;
    }
    *last_id = id;
    return k;
}

bool pf_kvc_match_tail(const pf_kvc *c, uint64_t parent, int depth, const int32_t *tokens, int n,
                       uint64_t *id)
{
    if (n < 1 || n >= c->bs) return false;
    uint64_t nid = td_block_hash(parent, tokens, (size_t)n);
    const pf_kvc_ent *e = find(c, nid);
    if (!e || e->parent != parent || e->depth != depth || e->n_tok != n ||
        memcmp(e->tokens, tokens, (size_t)n * sizeof *tokens))
        return false;
    *id = nid;
    return true;
}

int pf_kvc_acquire(pf_kvc *c, uint64_t last_id, int n, int32_t *blocks, pf_kvc_ent **ents,
                   int32_t *tokens)
{
    uint64_t id = last_id;
    for (int i = n - 1; i >= 0; i--) { /* from the leaf back to the root */
        pf_kvc_ent *e = find(c, id);
        if (!e || e->depth != i || (i < n - 1 && e->n_tok != c->bs)) return TD_ENOENT;
        ents[i] = e;
        id = e->parent;
    }
    if (id != TD_BLOCK_HASH_ROOT) return TD_ENOENT;
    for (int i = n - 1; i >= 0; i--) { /* the root ends most recent: evicted last */
        pf_kvc_ent *e = ents[i];
        e->ref++;
        e->users++;
        lru_unlink(c, e);
        lru_push(c, e);
        blocks[i] = e->block;
        if (tokens) memcpy(tokens + (size_t)i * (size_t)c->bs, e->tokens, (size_t)e->n_tok * 4);
    }
    return 0;
}

void pf_kvc_unref(pf_kvc *c, pf_kvc_ent *const *ents, int n)
{
    (void)c;
    for (int i = 0; i < n; i++)
        if (ents[i]->ref > 0) ents[i]->ref--;
}

void pf_kvc_unuse(pf_kvc *c, pf_kvc_ent *const *ents, int n)
{
    for (int i = 0; i < n; i++) {
        pf_kvc_ent *e = ents[i];
        if (--e->users > 0 || e->indexed) continue;
        c->stats.n_detached--;
        drop_block(c, e);
    }
}

/* Make room for one more indexed block: evict the least recently used unreferenced one. */
static bool make_room(pf_kvc *c)
{
    if (c->stats.n_indexed < c->max_blocks) return true;
    for (pf_kvc_ent *e = c->head; e; e = e->next)
        if (!e->ref) {
            if (e->n_tok == c->bs) log_event(c, PF_KVC_EV_REMOVED, e->id); /* tails: none */
            detach(c, e);
            c->stats.evicted++;
            return true;
        }
    return false;
}

int pf_kvc_insert(pf_kvc *c, const int32_t *tokens, int n, int n_tail, const int32_t *blocks,
                  int from)
{
    uint64_t id = TD_BLOCK_HASH_ROOT;
    for (int i = 0; i < from; i++)
        id = td_block_hash(id, tokens + (size_t)i * (size_t)c->bs, (size_t)c->bs);
    if (n_tail < 0 || n_tail >= c->bs) n_tail = 0;
    const int end = n + (n_tail > 0); /* blocks[n]: the tail's */
    pf_kvc_ent **added = end > from ? malloc((size_t)(end - from) * sizeof *added) : NULL;
    int n_added = 0, i = from;
    for (; added && i < end; i++) {
        const int nt = i < n ? c->bs : n_tail;
        const size_t tb = (size_t)nt * sizeof *tokens;
        const int32_t *t = tokens + (size_t)i * (size_t)c->bs;
        uint64_t nid = td_block_hash(id, t, (size_t)nt);
        pf_kvc_ent *e = find(c, nid);
        if (e && (e->parent != id || e->depth != i || e->n_tok != nt || memcmp(e->tokens, t, tb)))
            break; /* a collision: keep the older block, insert nothing after it */
        if (e) {   /* another request inserted the same block meanwhile */
            kn_kv_free(c->pool, 1, &blocks[i]);
            id = nid;
            continue;
        }
        if (!make_room(c)) break;
        e = malloc(sizeof *e + tb);
        if (!e) break;
        /* ref 1 while this prompt is inserted: its own blocks are not evicted for it */
        *e = (pf_kvc_ent){.id = nid,
                          .parent = id,
                          .block = blocks[i],
                          .depth = i,
                          .n_tok = nt,
                          .ref = 1,
                          .indexed = true};
        memcpy(e->tokens, t, tb);
        e->hnext = c->buckets[nid & c->mask];
        c->buckets[nid & c->mask] = e;
        lru_push(c, e);
        c->stats.n_indexed++;
        c->stats.inserted++;
        if (nt == c->bs) log_event(c, PF_KVC_EV_STORED, nid); /* the router knows whole blocks */
        added[n_added++] = e;
        id = nid;
    }
    if (i < end) kn_kv_free(c->pool, end - i, blocks + i);
    /* parents more recent than their children: a prefix outlives its extensions */
    for (int k = n_added - 1; k >= 0; k--) {
        added[k]->ref = 0;
        lru_unlink(c, added[k]);
        lru_push(c, added[k]);
    }
    free(added);
    return n_added;
}

void pf_kvc_flush(pf_kvc *c)
{
    while (c->head) {
        c->stats.flushed++;
        detach(c, c->head);
    }
    log_event(c, PF_KVC_EV_CLEARED, 0); /* what follows describes the cache whole */
}

void pf_kvc_get_stats(const pf_kvc *c, pf_kvc_stats *out)
{
    *out = c->stats;
}
