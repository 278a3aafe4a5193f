/* pf_kvcache.h: a prefill stage's prefix cache: whole KV blocks of recent prompts, for the
 * stage's layers, in the stage's own KV pool (pf_shard: cache_blocks on top of kv_tokens).
 * It is a policy over the KV memory's block cache (kvmem/kv_cache.h, the decode side's too),
 * which holds the index, the tokens, the chains (serials: a block is matched only after the
 * very entry before it) and the KV events; this file adds what a pipeline of stages needs:
 * stream references, its own LRU and block budget, eviction decided here (the allocator's
 * eviction is turned off), and acquisition by a chain's last id (a stage past the first has
 * no prompt tokens: it gets them from the cache).
 *
 * Purpose: a request whose prompt starts with a cached prefix takes those blocks instead of
 * computing them (and pushes them to the decode ranks from here). A block is identified by
 * its td_block_hash id (its tokens chained with its prefix's id); the cache keeps its
 * tokens too and compares them on lookup, so a 64-bit collision is a miss, never a wrong
 * block. Whole blocks are cached, and the *tail* of a prompt (its last partial block, of
 * 2 .. block_size - 1 tokens): a request whose whole prompt is here copies its last block,
 * whole or tail, and computes only its last token (pf_stage.c open_blocks). A tail is a
 * leaf: nothing chains after it, no KV event names it (the router indexes whole blocks).
 * Interface: match (how many leading blocks of a prompt are here), acquire / unref / unuse
 * (a request's hold), insert (a finished request's blocks), LRU eviction of unreferenced
 * blocks under max_blocks, flush.
 *
 * Two counts per block. `ref` is the *stream* reference: taken when a request opens with the
 * block and dropped when stage 0's RELEASE of that request is processed; only blocks with
 * ref 0 may be evicted. Every stage applies acquire / unref / insert / evict at the same
 * points of the ordered stage stream (pf_wire.h), so the indexes of all stages of an
 * instance stay identical and stage 0 can decide for all of them. `users` is the physical
 * hold (a request whose connector may still read the block): the pool's reference count. An
 * evicted or flushed block leaves the index at once but goes back to the pool only when its
 * last user drops it.
 * Ownership: the cache keeps the pool blocks it indexes; the KV memory is borrowed (outlives
 * the policy; pf_kvc_create adds its block cache if it has none). Threading: the stage's main
 * thread only.
 */
#ifndef PF_KVCACHE_H
#define PF_KVCACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "kv_mem.h"

typedef struct pf_kvc pf_kvc;

typedef struct {
    uint64_t inserted;         /* blocks inserted */
    uint64_t evicted;          /* blocks evicted (LRU, to stay under max_blocks) */
    uint64_t flushed;          /* blocks dropped by pf_kvc_flush */
    int n_indexed, n_detached; /* blocks in the index / out of it but still used */
} pf_kvc_stats;

/* max_blocks >= 1 blocks of the pool's block_size tokens. TD_EINVAL, TD_ENOMEM. */
int pf_kvc_create(kn_kv_mem *mem, int max_blocks, pf_kvc **out);
/* Returns every block to the pool; no request may hold one any more. NULL is fine. */
void pf_kvc_destroy(pf_kvc *c);

/* How many leading whole blocks of tokens[0..n) are indexed (ids and tokens equal), at
 * most max_blocks; *last_id gets the last matched block's id. No state change. */
int pf_kvc_match(const pf_kvc *c, const int32_t *tokens, int n, int max_blocks, uint64_t *last_id);
/* Whether the n tokens after the chain ending in parent (depth blocks long), 1 <= n <
 * block_size, are a cached tail; *id gets its id (an acquire's last_id). No state change. */
bool pf_kvc_match_tail(const pf_kvc *c, uint64_t parent, int depth, const int32_t *tokens, int n,
                       uint64_t *id);
/* Take the n blocks of the chain ending in last_id (a tail, or a whole block) (n blocks back
 * to the root): ref and users + 1, most recently used. blocks (n) gets their pool ids (the
 * handles unref and unuse take), tokens (n * block_size, or NULL) their tokens (a tail's
 * n_tail of the last). TD_ENOENT (nothing taken) if the index does not hold exactly that
 * chain. */
int pf_kvc_acquire(pf_kvc *c, uint64_t last_id, int n, int32_t *blocks, int32_t *tokens);
void pf_kvc_unref(pf_kvc *c, const int32_t *blocks, int n); /* stream ref - 1 */
void pf_kvc_unuse(pf_kvc *c, const int32_t *blocks, int n); /* users - 1 */
/* Insert blocks[from..n) of a prompt and, with n_tail in 1 .. block_size - 1, its tail
 * blocks[n] (tokens: n * block_size + n_tail ids; blocks[i] holds tokens [i bs, (i + 1) bs),
 * blocks before `from` are already the cache's). Ownership of every one of blocks[from..end)
 * (end = n, + 1 with a tail) passes to the cache: indexed, or back to the pool when its id
 * is already indexed, the ids collide (different tokens: the rest is not inserted either),
 * or no unreferenced block can be evicted to stay under max_blocks. Returns blocks indexed. */
int pf_kvc_insert(pf_kvc *c, const int32_t *tokens, int n, int n_tail, const int32_t *blocks,
                  int from);
/* Empty the index (a new stage chain): unused blocks go back to the pool now, used ones
 * when their last user drops them. */
void pf_kvc_flush(pf_kvc *c);
void pf_kvc_get_stats(const pf_kvc *c, pf_kvc_stats *out);

/* ---- KV events (docs/prefix-cache.md, "KV events"): the block cache's (kv_cache.h) ----
 * The cache logs what enters and leaves its index in a ring of the latest
 * PF_KVC_EVENT_LOG events, numbered from 1 per cache: STORED (a block was inserted),
 * REMOVED (evicted by LRU), CLEARED (pf_kvc_flush emptied it: a new stage chain). The kinds
 * and numbering are the decode side's (kn_kv_event_kind), so the router reads both alike.
 * Stage 0's cache describes its instance: every stage applies the same decisions. */
#define PF_KVC_EVENT_LOG KN_KV_EVENT_LOG_DEFAULT

enum {
    PF_KVC_EV_STORED = KN_KV_EV_STORED,
    PF_KVC_EV_REMOVED = KN_KV_EV_REMOVED,
    PF_KVC_EV_CLEARED = KN_KV_EV_CLEARED
};

/* The seq the next event will get (1 + events logged so far). */
uint64_t pf_kvc_event_next(const pf_kvc *c);
/* The latest events the ring holds (at most max), oldest first: kind[k] per event, and
 * ids[] the block id of each STORED / REMOVED one (*n_ids of them, CLEARED has none).
 * *first gets the seq of the first one (of the next event when none). Returns how many. */
int pf_kvc_events(const pf_kvc *c, int max, uint8_t *kind, uint64_t *ids, int *n_ids,
                  uint64_t *first);

#endif
