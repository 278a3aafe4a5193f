/* kv_cache.h: the prefix cache of a paged KV pool: content-addressed, shared, LRU-evicted blocks.
 *
 * Purpose: a request whose prompt starts like an earlier one (a system prompt, the previous
 * turns of a conversation, the other choices of an n>1 request) reuses the KV of those
 * leading whole blocks instead of computing it again. A full block whose KV is computed is
 * entered under its block id (common/td_blockhash.h: its tokens chained with its prefix's id)
 * with its tokens kept beside it; a later sequence finds its leading blocks by id, compares
 * the tokens, takes a reference on each and computes only the rest.
 * Exactness: an id is a 64-bit hash, never trusted alone. An entry records its tokens and
 * the serial number of the entry of the block before it (its parent); a match checks both,
 * so entry i is taken only if its tokens are the query's block i and it was computed after
 * the very entry that matched block i - 1 (by induction: after the query's whole prefix).
 * A collision, or an entry whose parent was evicted and re-entered since, is a miss.
 * Serial numbers are never reused (an evicted and re-entered block gets a new one).
 * States of a pool block (refs = kn_kv_pool.refs):
 *
 *     free ──cache_alloc──> private (refs >= 1) ──kn_kv_cache_insert──> cached, refs >= 1
 *      ^                       │ cache_free to 0                        │ ^ kn_kv_cache_match
 *      └───────────────────────┘                        cache_free to 0 v │ (refs 1)
 *      └────── cache_alloc evicts it (least recently idle first) ── cached idle (refs 0)
 *
 * Only whole blocks are entered by a decode sequence (its last partial block is never
 * shared; a prefill stage's policy also keeps a prompt's tail, below) and only once their
 * KV is computed; a cached block is never written again (its owners only
 * append past it), so sharing needs no copy. A block entered by one sequence while another
 * computed the same prefix privately stays private in the second (no swap).
 * Invariants: an entry's block is referenced or on the idle list, never free; the idle list
 * holds exactly the cached blocks with refs 0, oldest first; kn_kv_cache_available counts
 * them (unless demand eviction is off).
 * Threading: not thread-safe; the owner of the pool calls everything.
 * Layering (kv_mem.h): the cache is layer 3, above the pool (whose block allocator it drives:
 * blocks of a pool with a cache are allocated and freed through kn_kv_cache_alloc/free,
 * which kv_mem.c calls) and the tier (its victim store). It calls nothing above it.
 * Ownership: the cache borrows the pool; at destroy its idle blocks go back to the free list
 * (referenced ones stay with their owners); destroy it before the pool.
 */
#ifndef KN_KV_CACHE_H
#define KN_KV_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "kv_pool.h"

typedef struct kn_kv_cache kn_kv_cache;

/* Where a sequence stands in the cache's chains: the id of its last entered (or matched)
 * block and that entry's serial. serial 0: the chain is broken (a collision or a block
 * someone else entered differently): the sequence enters no more blocks. */
typedef struct {
    uint64_t id;
    uint64_t serial;
} kn_kv_chain;

typedef struct {
    int cached;         /* blocks entered in the index now */
    int idle;           /* of which unreferenced (evictable) */
    uint64_t inserts;   /* blocks entered since create */
    uint64_t evictions; /* cached blocks evicted to make room since create */
} kn_kv_cache_stats;

/* A cache over pool (borrowed; one cache a pool: kv_mem.h makes it). TD_ENOMEM. */
int kn_kv_cache_create(kn_kv_pool *pool, kn_kv_cache **out);
void kn_kv_cache_destroy(kn_kv_cache *c); /* NULL is fine */

/* The pool's allocator with the cache's keeping: take n blocks into ids (each with one
 * reference), evicting idle cached blocks (least recently used first, written to the tier
 * if any) when the free list is short; TD_ENOSPC (nothing taken, nothing evicted) if fewer
 * than n are free or idle. */
int kn_kv_cache_alloc(kn_kv_cache *c, int n, int32_t *ids);
/* Drop one reference to each of ids, last first (so a sequence's deepest blocks are the
 * least recently used of its cached ones: evicted before the prefix they extend); a block
 * whose last reference goes stays idle if it is cached, else returns to the free list. */
void kn_kv_cache_free(kn_kv_cache *c, int n, const int32_t *ids);
/* Blocks an allocation can take now: free plus idle cached ones. */
int kn_kv_cache_available(const kn_kv_cache *c);

/* Forget every entry (the KV they name is gone: a TP instance re-forms with fresh follower
 * pools): idle blocks go back to the free list, referenced ones stay with their owners as
 * private blocks. Not counted as evictions. */
void kn_kv_cache_clear(kn_kv_cache *c);

/* The chain of an empty sequence. */
kn_kv_chain kn_kv_cache_root(void);

/* The leading whole blocks of tokens[0..n_tokens), at most max_blocks of them, that the
 * cache holds: takes one reference on each, writes their pool ids to blocks and returns how
 * many; *chain is where the sequence stands after them (for kn_kv_cache_insert). */
int kn_kv_cache_match(kn_kv_cache *c, const int32_t *tokens, int64_t n_tokens, int max_blocks,
                      int32_t *blocks, kn_kv_chain *chain);

/* Block (referenced by the caller, its KV computed) holds tokens[0..block_size) following
 * the prefix *chain ends at: enter it, or continue the chain through an equal entry that is
 * there already; an idle entry of the same id that does not match (a collision or a stale
 * parent) is dropped for it. *chain advances (or breaks: serial 0; nothing is entered while
 * it is broken). Returns true if block itself was entered. */
bool kn_kv_cache_insert(kn_kv_cache *c, kn_kv_chain *chain, const int32_t *tokens, int32_t block);

kn_kv_cache_stats kn_kv_cache_get_stats(const kn_kv_cache *c);

/* An empty cache (kn_kv_cache_clear) over a new pool of the same shape, in place of its
 * pool (destroyed after): its numbering of events and serials, its settings and its tier go
 * on. TD_ESTATE: the cache has entries, or the shapes differ. */
int kn_kv_cache_rebind(kn_kv_cache *c, kn_kv_pool *pool);
/* Whether pool block `block` is an entry of the cache (then it is never written again). */
bool kn_kv_cache_holds(const kn_kv_cache *c, int32_t block);
/* How many leading whole blocks of tokens[0..n_tokens) (at most max_blocks) are entries,
 * following the index only (no reference taken, nothing touched); *chain: where they end. */
int kn_kv_cache_probe(const kn_kv_cache *c, const int32_t *tokens, int64_t n_tokens, int max_blocks,
                      kn_kv_chain *chain);

/* ---- policies above the cache (a prefill stage's, pf_kvcache.h) ----
 * A *tail* is an entry of 1 .. block_size - 1 tokens (a prompt's last partial block): a
 * leaf (nothing chains after it, no KV event names it, never written to the tier); the
 * decode side never enters one. A policy that decides eviction itself (the same decisions
 * on every stage of a pipeline, whatever each stage's physical holds) turns the allocator's
 * eviction off and drops entries with kn_kv_cache_forget. */

/* Enter block as the n tokens (1 <= n <= block_size; n < block_size: a tail) after *chain,
 * as kn_kv_cache_insert does for a whole block. */
bool kn_kv_cache_insert_n(kn_kv_cache *c, kn_kv_chain *chain, const int32_t *tokens, int n,
                          int32_t block);
/* Whether the n tokens (1 <= n < block_size) after *chain are a tail entry; *id its id (left
 * as it was on a miss). */
bool kn_kv_cache_probe_tail(const kn_kv_cache *c, const kn_kv_chain *chain, const int32_t *tokens,
                            int n, uint64_t *id);
/* The block of the entry with this id, or -1 (its parent is not checked: kn_kv_cache_entry). */
int32_t kn_kv_cache_find(const kn_kv_cache *c, uint64_t id);
typedef struct {
    uint64_t id, serial;
    kn_kv_chain parent;    /* the entry before it (the root's id and serial for a first block) */
    int n_tokens;          /* block_size, or fewer for a tail */
    const int32_t *tokens; /* (n_tokens), the cache's */
} kn_kv_entry;
/* Entry `block` (kn_kv_cache_holds must be true). */
kn_kv_entry kn_kv_cache_entry(const kn_kv_cache *c, int32_t block);
/* One more reference on an entry's block (an idle one is held again); drop it with
 * kn_kv_cache_free. */
void kn_kv_cache_take(kn_kv_cache *c, int32_t block);
/* Entry `block` leaves the index (a REMOVED event for a whole block): an idle block goes back
 * to the free list, a held one stays with its holders as a private block (free when their
 * last reference goes). A block that is no entry: nothing. */
void kn_kv_cache_forget(kn_kv_cache *c, int32_t block);
/* on (the default): kn_kv_cache_alloc evicts idle blocks when the free list is short; off:
 * it takes free blocks only and idle blocks stay until forgotten (kn_kv_cache_available
 * counts free blocks only). */
void kn_kv_cache_set_demand_evict(kn_kv_cache *c, bool on);

/* ---- KV events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared, Dynamo's) ----
 * The cache logs what enters and leaves its index, so that the decode node can tell the
 * router which blocks it holds (docs/prefix-cache.md, "KV events"). A bounded ring of the
 * latest events, numbered from 1 (seq) in the order they happened; an older event is
 * overwritten when the ring is full: a reader that asks for it learns so (the first event
 * it gets has a later seq than it asked for) and must treat what it knew as lost.
 * STORED: a block entered the index (inserted, or read back from the tier). REMOVED: a block left
 * the index (evicted, written to the tier, or dropped for a colliding entry). CLEARED: every entry
 * was forgotten (kn_kv_cache_clear). Blocks in the second tier only are not in the index: the
 * events describe the pool. */
#define KN_KV_EVENT_LOG_DEFAULT 512 /* events a new cache keeps */

typedef enum { KN_KV_EV_STORED = 1, KN_KV_EV_REMOVED = 2, KN_KV_EV_CLEARED = 3 } kn_kv_event_kind;

typedef struct {
    uint64_t id;  /* the block's id (0 for CLEARED) */
    uint8_t kind; /* kn_kv_event_kind */
} kn_kv_event;

/* Keep the latest capacity events (0: log nothing); the events logged so far are dropped
 * (a reader sees a gap), numbering goes on. TD_EINVAL (capacity < 0), TD_ENOMEM. */
int kn_kv_cache_set_event_log(kn_kv_cache *c, int capacity);
/* The seq the next event will get (1 + events logged since create). */
uint64_t kn_kv_cache_event_next(const kn_kv_cache *c);
/* The events from seq since on, oldest first, at most max of them, into out; *first is the
 * seq of out[0] (of the next event when none): *first > since means events were lost (the
 * ring overwrote them, or since is 0). Returns how many were written. */
int kn_kv_cache_events(const kn_kv_cache *c, uint64_t since, kn_kv_event *out, int max,
                       uint64_t *first);

/* ---- the second tier (kv_tier.h) ----
 * With a tier attached, a block the pool evicts is written to the tier first (an entry the
 * tier holds already, with the same serial, costs no write), and a match that finds a
 * block only in the tier copies it into a newly allocated pool block, where it is entered
 * again under its old serial (the same entry: its children, in the pool or the tier, still
 * follow it), so exactness is the cache's own argument. The copies a match may make are
 * bounded by the caller (the scheduler spreads a long prefix over several steps). */
struct kn_kv_tier;

typedef struct {
    int copies_left; /* in: tier blocks this match may copy into the pool; decremented */
    int copied;      /* out: blocks copied in by this match */
    bool more;       /* out: the match stopped at a block the tier holds, copies_left 0 */
} kn_kv_tier_budget;

/* Attach tier (borrowed until detached with NULL or the cache is destroyed); NULL detaches.
 * Clearing the cache clears the tier too. */
void kn_kv_cache_set_tier(kn_kv_cache *c, struct kn_kv_tier *tier);
struct kn_kv_tier *kn_kv_cache_tier(const kn_kv_cache *c); /* the attached tier, or NULL */
/* kn_kv_cache_match, also taking blocks from the tier within tb's budget (tb NULL or no
 * tier: the pool only). A block copied in is held by the caller like a matched one. */
int kn_kv_cache_match_tier(kn_kv_cache *c, const int32_t *tokens, int64_t n_tokens, int max_blocks,
                           int32_t *blocks, kn_kv_chain *chain, kn_kv_tier_budget *tb);
/* How many of blocks[0..n) came from the tier since they were last claimed; clears their
 * mark (the scheduler counts a tier hit once, when a request is admitted with them). */
int kn_kv_cache_claim_restored(kn_kv_cache *c, const int32_t *blocks, int n);

#endif
