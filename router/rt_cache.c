/* rt_cache.c: the per-instance index of the block ids the router sent to an instance (a
 * hash table over an LRU list, bounded by the instance's pool, each block with a successor
 * seen after it) and the cache-aware choice by distinguishing match. Loop thread only.
 * The nodes are kept dense (node[0..n)): removing one moves the last into its place, so
 * the arrays never hold holes and growth is a plain doubling. */
#include <stdlib.h>
#include <string.h>

#include "rt_cache.h"
#include "td_blockhash.h"
#include "td_err.h"

static uint32_t mix(uint64_t id, uint32_t mask)
{
    id ^= id >> 33; /* splitmix64's finalizer: the ids' low bits alone may cluster */
    id *= 0xff51afd7ed558ccdull;
    id ^= id >> 33;
    return (uint32_t)id & mask;
}

/* The slot holding id, or the empty slot where it would go. */
static uint32_t probe(const rt_cidx *x, uint64_t id)
{
    uint32_t mask = x->n_slots - 1, s = mix(id, mask);
    while (x->slot[s] && x->node[x->slot[s] - 1].id != id)
        s = (s + 1) & mask;
    return s;
}

static uint32_t find(const rt_cidx *x, uint64_t id)
{
    if (!x->n) return RT_CIDX_NIL;
    uint32_t s = probe(x, id);
    return x->slot[s] ? x->slot[s] - 1 : RT_CIDX_NIL;
}

static void lru_unlink(rt_cidx *x, uint32_t k)
{
    rt_cidx_node *d = &x->node[k];
    if (d->prev != RT_CIDX_NIL)
        x->node[d->prev].next = d->next;
    else
        x->head = d->next;
    if (d->next != RT_CIDX_NIL)
        x->node[d->next].prev = d->prev;
    else
        x->tail = d->prev;
}

static void lru_push_head(rt_cidx *x, uint32_t k)
{
    rt_cidx_node *d = &x->node[k];
    d->prev = RT_CIDX_NIL;
    d->next = x->head;
    if (x->head != RT_CIDX_NIL) x->node[x->head].prev = k;
    x->head = k;
    if (x->tail == RT_CIDX_NIL) x->tail = k;
}

/* Empty slot s, then move later entries of its probe run back (no tombstones). */
static void slot_delete(rt_cidx *x, uint32_t s)
{
    uint32_t mask = x->n_slots - 1;
    x->slot[s] = 0;
    for (uint32_t j = (s + 1) & mask; x->slot[j]; j = (j + 1) & mask) {
        uint32_t home = mix(x->node[x->slot[j] - 1].id, mask);
        /* the entry at j may move to s if its home is not in (s, j] (cyclically) */
        if (((j - home) & mask) >= ((j - s) & mask)) {
            x->slot[s] = x->slot[j];
            x->slot[j] = 0;
            s = j;
        }
    }
}

/* Remove node k: out of the table and the list; the last node takes its place. */
static void remove_node(rt_cidx *x, uint32_t k)
{
    slot_delete(x, probe(x, x->node[k].id));
    lru_unlink(x, k);
    uint32_t last = --x->n;
    if (k == last) return;
    x->node[k] = x->node[last];
    x->slot[probe(x, x->node[k].id)] = k + 1;
    if (x->node[k].prev != RT_CIDX_NIL)
        x->node[x->node[k].prev].next = k;
    else
        x->head = k;
    if (x->node[k].next != RT_CIDX_NIL)
        x->node[x->node[k].next].prev = k;
    else
        x->tail = k;
}

/* Room for one more node: nodes and slots doubled (rehashed) when full. */
static int grow(rt_cidx *x)
{
    if (x->n < x->cap_nodes) return 0;
    uint32_t cap = x->cap_nodes ? 2 * x->cap_nodes : 256;
    if (cap > x->capacity) cap = x->capacity;
    uint32_t ns = 1;
    while (ns <= 2 * cap)
        ns *= 2;
    rt_cidx_node *nd = realloc(x->node, (size_t)cap * sizeof *nd);
    if (!nd) return TD_ENOMEM;
    x->node = nd;
    uint32_t *sl = calloc(ns, sizeof *sl);
    if (!sl) return TD_ENOMEM;
    free(x->slot);
    x->slot = sl;
    x->n_slots = ns;
    x->cap_nodes = cap;
    for (uint32_t k = 0; k < x->n; k++)
        x->slot[probe(x, x->node[k].id)] = k + 1;
    return 0;
}

/* Forget every block (the events' state stays). */
static void drop_all(rt_cidx *x)
{
    free(x->node);
    free(x->slot);
    x->node = NULL;
    x->slot = NULL;
    x->n = x->cap_nodes = x->n_slots = 0;
    x->head = x->tail = RT_CIDX_NIL;
}

void rt_cidx_clear(rt_cidx *x)
{
    drop_all(x);
    x->exact = false;
    x->ev_next = 0;
}

void rt_cidx_fini(rt_cidx *x)
{
    rt_cidx_clear(x);
}

void rt_cidx_configure(rt_cidx *x, uint32_t block_size, uint32_t capacity)
{
    if (!x->node) x->head = x->tail = RT_CIDX_NIL; /* a zeroed index */
    if (block_size != x->block_size) rt_cidx_clear(x);
    x->block_size = block_size;
    x->capacity = capacity;
    while (x->n > capacity)
        remove_node(x, x->tail);
    if (!x->n && x->cap_nodes > capacity) rt_cidx_clear(x); /* no larger arrays than needed */
}

/* Node k was seen followed by block succ in a prompt. */
static void note_succ(rt_cidx_node *d, uint64_t succ)
{
    if (!d->n_succ) {
        d->succ = succ;
        d->n_succ = 1;
    } else if (d->succ != succ) {
        d->n_succ = 2;
    }
}

static int insert_ids(rt_cidx *x, const uint64_t *ids, size_t n)
{
    if (!x->block_size || !x->capacity) return 0;
    if (!x->node) x->head = x->tail = RT_CIDX_NIL;
    for (size_t i = n; i-- > 0;) {
        uint32_t k = find(x, ids[i]);
        if (k != RT_CIDX_NIL) {
            lru_unlink(x, k);
            lru_push_head(x, k);
        } else {
            if (x->n >= x->capacity) remove_node(x, x->tail);
            int rc = grow(x);
            if (rc) return rc;
            k = x->n++;
            x->node[k] = (rt_cidx_node){.id = ids[i]};
            x->slot[probe(x, ids[i])] = k + 1;
            lru_push_head(x, k);
        }
        if (i + 1 < n) note_succ(&x->node[k], ids[i + 1]);
    }
    return 0;
}

int rt_cidx_insert(rt_cidx *x, const uint64_t *ids, size_t n)
{
    if (!x->exact) return insert_ids(x, ids, n);
    /* the node says what it holds: only which block follows which in a prompt sent here */
    for (size_t i = 0; i + 1 < n; i++) {
        uint32_t k = find(x, ids[i]);
        if (k != RT_CIDX_NIL) note_succ(&x->node[k], ids[i + 1]);
    }
    return 0;
}

bool rt_cidx_remove(rt_cidx *x, uint64_t id)
{
    uint32_t k = find(x, id);
    if (k == RT_CIDX_NIL) return false;
    remove_node(x, k);
    return true;
}

/* The ids each of kind[0..n_ev) takes; -1: an unknown kind. */
static int ev_ids(uint8_t kind)
{
    return kind == 1 || kind == 2 ? 1 : kind == 3 ? 0 : -1;
}

/* Apply one event whose ids start at id. */
static int apply_one(rt_cidx *x, uint8_t kind, const uint64_t *id)
{
    if (kind == 2) {
        rt_cidx_remove(x, id[0]);
        return 0;
    }
    if (kind == 3) { /* the node's cache is empty: what follows describes it whole */
        drop_all(x);
        x->exact = true;
        return 0;
    }
    return insert_ids(x, id, 1);
}

int rt_cidx_events(rt_cidx *x, uint64_t first, const uint8_t *kind, size_t n_ev,
                   const uint64_t *ids, size_t n_ids, rt_cidx_ev_result *r)
{
    *r = (rt_cidx_ev_result){0};
    if (!first) { /* a node without events: the estimate from now on */
        x->exact = false;
        x->ev_next = 0;
        return 0;
    }
    size_t need = 0;
    for (size_t k = 0; k < n_ev; k++) {
        if (ev_ids(kind[k]) < 0) return TD_EINVAL;
        need += (size_t)ev_ids(kind[k]);
    }
    if (need != n_ids || first > UINT64_MAX - n_ev) return TD_EINVAL;
    uint64_t end = first + n_ev;
    bool back = x->ev_next && end < x->ev_next; /* numbering went back: a new process */
    if (!x->ev_next || first > x->ev_next || back) {
        if (first == 1) { /* the whole history: the index is exactly what it says */
            drop_all(x);
            x->exact = true;
        } else {
            if (x->ev_next) { /* lost events, removals maybe: what the index holds may be
                                 gone; the estimate again, corrected by the events */
                drop_all(x);
                r->gap = true;
            }
            x->exact = false;
        }
        x->ev_next = first;
    }
    const uint64_t *id = ids;
    for (size_t k = 0; k < n_ev; k++) {
        if (first + k >= x->ev_next) {
            int rc = apply_one(x, kind[k], id);
            if (rc) return rc;
            r->applied++;
            x->ev_next = first + k + 1;
        }
        id += ev_ids(kind[k]);
    }
    return 0;
}

size_t rt_cidx_match(const rt_cidx *x, const uint64_t *ids, size_t n)
{
    size_t k = 0;
    while (k < n && find(x, ids[k]) != RT_CIDX_NIL)
        k++;
    return k;
}

bool rt_cidx_forks(const rt_cidx *x, const uint64_t *ids, size_t n, size_t m)
{
    if (!m || m >= n) return false;
    uint32_t k = find(x, ids[m - 1]);
    if (k == RT_CIDX_NIL) return false;
    const rt_cidx_node *d = &x->node[k];
    return d->n_succ >= 2 || (d->n_succ == 1 && find(x, d->succ) != RT_CIDX_NIL);
}

const uint64_t *rt_cache_ids_get(rt_cache_ids *c, const int32_t *tokens, size_t n_tokens,
                                 uint32_t block_size, size_t *n)
{
    *n = 0;
    if (!block_size) return c->ids;
    if (c->ids && c->tokens == tokens && c->n_tokens == n_tokens && c->block_size == block_size) {
        *n = c->n;
        return c->ids;
    }
    size_t want = n_tokens / block_size;
    if (want > c->cap || !c->ids) {
        uint64_t *ids = realloc(c->ids, (want ? want : 1) * sizeof *ids);
        if (!ids) return NULL;
        c->ids = ids;
        c->cap = want ? want : 1;
    }
    c->n = td_block_hashes(tokens, n_tokens, block_size, c->ids);
    c->tokens = tokens;
    c->n_tokens = n_tokens;
    c->block_size = block_size;
    *n = c->n;
    return c->ids;
}

void rt_cache_ids_fini(rt_cache_ids *c)
{
    free(c->ids);
    *c = (rt_cache_ids){0};
}

/* The candidate's distinguishing match: beyond what every candidate holds, 0 at a fork. */
static uint32_t distinct(const rt_cache_cand *c, uint32_t shared)
{
    return c->fork ? 0 : c->matched - shared;
}

int rt_cache_choose(const rt_cache_cand *c, int n, size_t n_prompt, const td_cfg_cache_aware *p,
                    rt_route_why *why, int *skipped)
{
    uint32_t shared = c[0].matched;
    for (int k = 1; k < n; k++)
        if (c[k].matched < shared) shared = c[k].matched;
    int best = 0, least = 0;
    for (int k = 1; k < n; k++) {
        uint32_t dk = distinct(&c[k], shared), db = distinct(&c[best], shared);
        if (dk > db || (dk == db && c[k].load < c[best].load)) best = k;
        if (c[k].load < c[least].load) least = k;
    }
    *skipped = -1;
    uint32_t d = distinct(&c[best], shared);
    size_t rest = n_prompt > shared ? n_prompt - shared : 0; /* the part not held everywhere */
    double rate = rest ? (double)d / (double)rest : 0.0;
    if (!d || rate <= p->cache_threshold) {
        *why = RT_ROUTE_BY_LOAD;
        return 0;
    }
    uint32_t lb = c[best].load, lm = c[least].load;
    if (lb - lm > (uint32_t)p->balance_abs_threshold &&
        (double)lb > (double)lm * p->balance_rel_threshold) {
        *why = RT_ROUTE_OVERLOADED;
        *skipped = best;
        return c[0].load == lm ? 0 : least;
    }
    *why = RT_ROUTE_BY_CACHE;
    return best;
}
