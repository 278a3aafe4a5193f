/* rt_cache.h: the router's per-instance index of cached prefixes and SGLang's cache-aware
 * choice (prefix rt_cidx_ / rt_cache_).
 *
 * Purpose: cache-aware routing (router.routing: cache_aware; docs/prefix-cache.md,
 * "Routing"). For each instance the router keeps the ids of the KV blocks
 * (common/td_blockhash.h, with the instance's block size) of the prompts it sent there: an
 * approximation of what the instance's prefix cache holds, learned without any message
 * from the node (SGLang's approximate tree). Block ids are chained, so "the first k blocks
 * of a prompt are indexed" means "the instance was sent a prompt starting with those
 * k * block_size tokens"; rt_cidx_match counts them. The index forgets the least recently
 * used blocks beyond the instance's pool size (Health kv_blocks_used + kv_blocks_free), as
 * the node would; blocks of one prompt are touched from the last to the first, so a
 * prefix outlives its extensions (leaves go first, as in a radix tree).
 * KV events: a decode node reports which blocks its cache stored and removed
 * (Health.kv_event_*, kvmem/kv_cache.h; vLLM's BlockStored / BlockRemoved, Dynamo's);
 * rt_cidx_events applies them. While the router has seen every event of the node's
 * process from the first on, the index is *exact*: it holds what the node's pool holds
 * and routing adds no block (rt_cidx_insert only notes which block follows which in the
 * prompts sent there, the successors rt_cidx_forks reads: a node's blocks also hold what
 * it generated, which the next prompt may not repeat, and that is no fork). A node that sends no
 * events (an older one, a prefill instance) keeps the estimate; after a gap (the node's log
 * overwrote events the router had not seen, or the router started late) the index is the
 * estimate corrected by the events that follow, until the node restarts or clears its
 * cache (an "all cleared" event: what follows it describes the cache whole).
 * Invariants: n <= capacity; every indexed id is in the hash table exactly once and in the
 * LRU list exactly once; block_size 0 or capacity 0: nothing is indexed.
 * Threading: the loop thread only (no locks).
 * Ownership: an rt_cidx owns its arrays (rt_cidx_fini); rt_cache_ids owns its buffer.
 */
#ifndef RT_CACHE_H
#define RT_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"

#define RT_CIDX_NIL UINT32_MAX

typedef struct {
    uint64_t id;         /* td_block_hash id */
    uint64_t succ;       /* the id of a block indexed after this one in a prompt; 0: none yet */
    uint32_t prev, next; /* LRU list: prev is more recent; RT_CIDX_NIL at the ends */
    uint32_t n_succ;     /* distinct successors seen: 0, 1 (succ) or 2 (two or more) */
} rt_cidx_node;

typedef struct {
    uint32_t block_size; /* tokens per block of the instance; 0: unknown */
    uint32_t capacity;   /* most blocks indexed: the instance's pool */
    uint32_t n;          /* blocks indexed */
    rt_cidx_node *node;  /* (cap_nodes) node[0..n) in use, in no particular order */
    uint32_t cap_nodes;
    uint32_t *slot;      /* (n_slots) open addressing, linear probing: node index + 1, 0 empty */
    uint32_t n_slots;    /* a power of two > 2 * cap_nodes, or 0 */
    uint32_t head, tail; /* most / least recently used node, RT_CIDX_NIL when empty */
    bool exact;          /* fed by events with no gap since the node's first (see above) */
    uint64_t ev_next;    /* the seq of the next event expected; 0: no events seen */
} rt_cidx;

/* Set the block size and capacity from an instance's health figures. A different block
 * size clears the index (the ids mean other blocks); a smaller capacity evicts the least
 * recently used blocks. Allocates nothing (rt_cidx_insert grows the arrays). */
void rt_cidx_configure(rt_cidx *x, uint32_t block_size, uint32_t capacity);
/* Forget everything (the instance restarted or was marked dead), events seen included;
 * frees the arrays. */
void rt_cidx_clear(rt_cidx *x);
void rt_cidx_fini(rt_cidx *x);
/* ids[0..n): the chained block ids of one prompt sent here (the estimate; when the index
 * is exact only the successors of the blocks it holds are noted, nothing is added). Each is added
 * or made most recently used, from ids[n-1] to ids[0] (ids[0] ends most recent); beyond capacity
 * the least recently used blocks go. 0 or TD_ENOMEM (what was indexed stays consistent). */
int rt_cidx_insert(rt_cidx *x, const uint64_t *ids, size_t n);
/* Forget one block (an eviction event); false if it was not indexed. */
bool rt_cidx_remove(rt_cidx *x, uint64_t id);

/* What one Health's events did to the index. */
typedef struct {
    uint32_t applied; /* events applied (new ones; those seen before are skipped) */
    bool gap;         /* events were lost since the last report: the index was dropped */
} rt_cidx_ev_result;

/* Apply one Health's KV events (proto/tandem_ctrl.proto, Health 21-23): first is
 * kv_event_seq (0: the node sends none: the index goes back to the estimate), kind[0..n_ev)
 * one byte per event (1 stored, 2 removed, 3 cleared), ids[0..n_ids) the blocks of the
 * stored and removed ones, in order. A stored block is added (most recently used), a
 * removed one forgotten, a clear forgets all (and makes the index exact). Events before ev_next are
 * skipped. If first > ev_next (events lost) the index is dropped and stops being exact, unless
 * first is 1 (the node's whole history is here: the index is rebuilt exact from it). TD_EINVAL (ids
 * do not fit the kinds, an unknown kind; nothing applied, the index unchanged) or
 * TD_ENOMEM; *r says what was done. */
int rt_cidx_events(rt_cidx *x, uint64_t first, const uint8_t *kind, size_t n_ev,
                   const uint64_t *ids, size_t n_ids, rt_cidx_ev_result *r);
/* How many of ids[0..n) are indexed, counted from ids[0] up to the first missing one. */
size_t rt_cidx_match(const rt_cidx *x, const uint64_t *ids, size_t n);
/* Given m = rt_cidx_match(x, ids, n) with 0 < m < n: does the match end at a fork, that is,
 * was a prompt indexed here that continues ids[0..m) with another block than ids[m] (its
 * successor still indexed, or two successors seen)? Then the matched part is a prefix this
 * prompt shares with another one (a system prompt), not one it extends (its own history,
 * whose last indexed block has no successor). False when m is 0 or n (a whole match). */
bool rt_cidx_forks(const rt_cidx *x, const uint64_t *ids, size_t n, size_t m);

/* The block ids of one prompt for one block size, kept while the same prompt is asked
 * for again (the instances of a cluster usually share one block size). */
typedef struct {
    uint64_t *ids; /* (cap) */
    size_t cap, n;
    const int32_t *tokens; /* the prompt they were computed for (borrowed, compared only) */
    size_t n_tokens;
    uint32_t block_size;
} rt_cache_ids;

/* The ids of tokens[0..n_tokens) with block_size (n_tokens / block_size of them), or NULL
 * (out of memory); valid until the next call. */
const uint64_t *rt_cache_ids_get(rt_cache_ids *c, const int32_t *tokens, size_t n_tokens,
                                 uint32_t block_size, size_t *n);
void rt_cache_ids_fini(rt_cache_ids *c);

/* Per instance, for /metrics (rt_metrics_cache.c): loop-owned, published with the gauges. */
typedef struct {
    uint64_t by_cache;       /* requests sent here for their prefix match (RT_ROUTE_BY_CACHE) */
    uint64_t by_load;        /* requests sent here by the load order (no match above threshold,
                                or the match's instance was overloaded) */
    uint64_t overloaded;     /* times this instance had the longest match but was overloaded */
    uint64_t matched_tokens; /* prompt tokens matched here, over the requests sent here */
    uint64_t drops;          /* times its index was dropped (restart, marked dead) */
    uint32_t blocks;         /* blocks indexed now */
    uint64_t events;         /* KV events applied to its index */
    uint64_t event_gaps;     /* times events were lost (the index dropped, estimate again) */
    bool exact;              /* its index is fed by events without a gap (rt_cidx.exact) */
} rt_cache_stats;

/* One instance that can take the request now. */
typedef struct {
    int inst;         /* its index (decode or prefill array) */
    uint32_t load;    /* the router's requests on it (rt_inst.active) */
    uint32_t matched; /* prompt tokens in whole indexed blocks (rt_cidx_match * block size) */
    bool fork;        /* the match ends where another prompt sent there went on (rt_cidx_forks) */
} rt_cache_cand;

/* Why the choice fell where it did (metric labels). */
typedef enum {
    RT_ROUTE_BY_LOAD = 0, /* no distinguishing match above cache_threshold: the load order's */
    RT_ROUTE_BY_CACHE,    /* the longest match */
    RT_ROUTE_OVERLOADED,  /* the longest match's instance was overloaded: the least loaded */
} rt_route_why;

/* The cache-aware choice among c[0..n) (n >= 1), c[0] being what routing: load would pick.
 * SGLang's rule (the longest match unless overloaded) scored by the *distinguishing* match:
 * shared = the shortest match among the candidates (what every one of them holds, such as
 * a system prompt); a candidate's distinguishing match is matched - shared, or 0 when its
 * match ends at a fork (a prefix another prompt sent there continues differently: a new
 * conversation matching an old one's system prompt, not its own history). best = the
 * longest distinguishing match (ties: the lower load, then the earlier candidate). If it
 * is 0 or not more than cache_threshold of the prompt's part beyond shared: c[0], BY_LOAD.
 * Else if best.load - min_load > balance_abs_threshold and best.load > min_load *
 * balance_rel_threshold: the least loaded candidate (c[0] among equals), OVERLOADED, and
 * *skipped = best's position. Else best, BY_CACHE. Returns a position in c. */
int rt_cache_choose(const rt_cache_cand *c, int n, size_t n_prompt, const td_cfg_cache_aware *p,
                    rt_route_why *why, int *skipped);

#endif
