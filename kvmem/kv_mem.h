/* kv_mem.h: the KV memory of one model shard: its layers, and the one interface the nodes use.
 *
 * Purpose: every process that holds KV (a decode rank, a prefill stage, the tools' engine, a
 * second (draft) model beside a first) owns one kn_kv_mem; the scheduler above it sees
 * blocks and sequences (match, reserve, commit, release, rollback), never the cache's
 * bookkeeping, and the forward pass sees the pool's layout (kn_kv_mem_pool).
 * Layers, each calling only those below it (the include graph says the same; none knows a
 * node's protocol: the decode leader's transfers, the prefill stages' stream order live above):
 *   1. kv_pool.h: the region (private, memfd, POSIX shm, device memory with a host staging
 *      copy), its layout and slicing, and the block allocator (free list, reference counts).
 *   2. kv_tier.h: the second tier: a store of copies of evicted cached blocks; it knows the
 *      pool's layout and nothing of the index that decides what goes there.
 *   3. kv_cache.h: the content-addressed block cache: index, serials, idle LRU, KV events;
 *      it evicts into the tier and restores from it, and drives the pool's allocator.
 *   4. this file: owns the three, allocates through the cache when there is one (so eviction
 *      and keeping are never bypassed), and keeps a sequence's place in the cache's chains.
 * Why the tier sits below the cache: the tier is a block store the cache writes victims to and
 * reads hits from; the cache decides, the tier only copies. With the pool calling nothing above
 * it (a block whose last reference goes is the caller's to keep or give back), no layer calls up.
 * Threading: not thread-safe; the owner of the shard's engine loop calls everything.
 * Ownership: kn_kv_mem_create/destroy own the pool, and the cache and tier once added.
 */
#ifndef KN_KV_MEM_H
#define KN_KV_MEM_H

#include <stdbool.h>
#include <stdint.h>

#include "kv_cache.h"
#include "kv_pool.h"
#include "kv_tier.h"

typedef struct kn_kv_mem kn_kv_mem;

/* A pool of params p (kn_kv_pool_create's errors; p->shm_name is copied). */
int kn_kv_mem_create(const kn_kv_pool_params *p, kn_kv_mem **out);
void kn_kv_mem_destroy(kn_kv_mem *m); /* cache, tier, pool; NULL is fine */

/* The pool (layout, region, staging) the forward pass and kvxfer address. Stable until
 * kn_kv_mem_renew_pool. */
kn_kv_pool *kn_kv_mem_pool(const kn_kv_mem *m);

/* A fresh pool of the same params in place of the current one (a TP follower's new shared
 * segment after its leader unlinked the old one): the cache (if any) and the tier are
 * cleared (kn_kv_mem_clear: a CLEARED event) and go on over the new pool (same pointers,
 * numbering and settings). No block may be held (TD_ESTATE otherwise); the pool's errors
 * (then nothing else changed). A named segment's name (params.shm_name) passes to the new
 * segment: the old one's is unlinked first (its mappings live on). */
int kn_kv_mem_renew_pool(kn_kv_mem *m);

/* Add the prefix cache (kv_cache.h) over the pool: blocks whose last reference goes are kept
 * while they are cached. TD_ESTATE: one was added already; TD_ENOMEM. */
int kn_kv_mem_add_cache(kn_kv_mem *m);
/* Add the second tier (kv_tier.h, kn_kv_tier_create's errors) for the pool's blocks; the
 * cache, if any (now or later), evicts into it. TD_ESTATE: one was added already. A tier
 * without a cache is a TP follower's: it repeats its leader's copies (kn_kv_tier_apply). */
int kn_kv_mem_add_tier(kn_kv_mem *m, const kn_kv_tier_params *p);
kn_kv_cache *kn_kv_mem_cache(const kn_kv_mem *m); /* or NULL */
kn_kv_tier *kn_kv_mem_tier(const kn_kv_mem *m);   /* or NULL */
/* Forget every cached entry (kn_kv_cache_clear, which clears the tier too) or, without a
 * cache, the tier's. */
void kn_kv_mem_clear(kn_kv_mem *m);

/* ---- blocks ---- */

/* Take n blocks into ids (each with one reference), evicting idle cached blocks (least
 * recently used first) when the free list is short; TD_ENOSPC (nothing taken, nothing
 * evicted) if fewer than n are free or idle; TD_EINVAL n < 0. The lowest free ids, in
 * ascending order (kv_pool.c): a request's blocks form runs of consecutive ids wherever the
 * free blocks allow, each one contiguous piece per layer array (attention streams it) and
 * per slice of a sliced pool (one kvxfer put). */
int kn_kv_alloc(kn_kv_mem *m, int n, int32_t *ids);
/* Drop one reference to each of ids, last first; a block whose last reference goes stays
 * idle in the cache if it is cached, else returns to the free list. A block with no
 * reference is a bug (abort). */
void kn_kv_free(kn_kv_mem *m, int n, const int32_t *ids);
/* Blocks an allocation can take now: free ones, plus the idle cached ones the cache evicts
 * on demand (kn_kv_cache_set_demand_evict). */
int kn_kv_available(const kn_kv_mem *m);

/* ---- sequences ----
 * A sequence's block table (position p lives in blocks[p / block_size]) and its place in
 * the cache: its first n_entered blocks are entered into the cache (or were matched from
 * it, or continue through an equal entry someone else made) and chain is where they end.
 * chain.serial 0: the chain broke (a collision): the sequence enters no more blocks. */
typedef struct {
    int32_t *blocks;
    int n_blocks, cap;
    int n_entered;
    kn_kv_chain chain;
} kn_kv_seq;

void kn_kv_seq_init(kn_kv_seq *s);
/* An empty sequence (no block yet) takes the cached leading whole blocks of
 * tokens[0..n_tokens), at most max_blocks (the tier's too within tb's budget, tb NULL: the
 * pool only): a reference on each, into blocks; n_entered = n_blocks = the count returned
 * (0 without a cache, or when s holds blocks already). TD_ENOMEM (nothing taken). */
int kn_kv_seq_match(kn_kv_mem *m, kn_kv_seq *s, const int32_t *tokens, int64_t n_tokens,
                    int max_blocks, kn_kv_tier_budget *tb);
/* How many of the sequence's entered blocks came from the tier since they were last
 * claimed (a tier hit is counted once: a second call says 0). */
int kn_kv_seq_claim_restored(kn_kv_mem *m, const kn_kv_seq *s);
/* Make room for positions [0, n_ctx): allocates the missing blocks (all or nothing:
 * TD_ENOSPC, TD_ENOMEM). */
int kn_kv_seq_reserve(kn_kv_mem *m, kn_kv_seq *s, int64_t n_ctx);
/* The KV of positions [0, n_computed) of tokens is computed: enter the whole blocks of it
 * not entered yet into the cache (a no-op without one). */
void kn_kv_seq_commit(kn_kv_mem *m, kn_kv_seq *s, const int32_t *tokens, int64_t n_computed);
/* Keep positions [0, n_ctx) of the sequence (tokens: its tokens, at least those n_ctx),
 * dropping the rest (rejected draft tokens, a truncated context): blocks past them are
 * freed (cached ones stay cached, idle); a kept block that is cached and will be written
 * again (n_ctx inside it) is replaced by a private copy (a cached block is never written);
 * the chain steps back to the last whole kept block.
 * 0; TD_EINVAL (n_ctx < 0 or past the table); TD_ENOSPC or the backend's copy error: no
 * block for the copy, and the sequence keeps only its whole blocks, positions
 * [0, n_ctx / block_size * block_size) (the caller computes the rest again). */
int kn_kv_seq_rollback(kn_kv_mem *m, kn_kv_seq *s, const int32_t *tokens, int64_t n_ctx);
/* Return every block (cached ones stay cached); the record stays usable (empty). */
void kn_kv_seq_release(kn_kv_mem *m, kn_kv_seq *s);
void kn_kv_seq_fini(kn_kv_mem *m, kn_kv_seq *s); /* release + free the table */

#endif
