/* kvx_lookup.h: the middle layer of kvxfer: keyed storage for KV chunks that cannot go
 * out yet (their destination is not known, or its consumer is not ready).
 *
 * Purpose: turn "chunks in the order they were produced" into "chunks by key", because the
 * producer (prefill) and the consumer (the KV target arriving, the decode side accepting)
 * handle requests in different orders. Key = (request id, chunk index, layer range).
 *
 * Invariants:
 * - A key is stored at most once (insert of a present key is TD_ESTATE).
 * - The sum of the entries' byte sizes never exceeds the budget; an entry larger than
 *   the whole budget is refused at once (TD_ENOSPC), it could never fit.
 * - Lookup by key and by request is O(1) on average (two hash tables); expiry visits only
 *   the expired entries (entries are kept in insertion order).
 *
 * Threading: thread-safe (one mutex). insert with timeout_ms > 0 waits on a condition
 * variable (never a sleep loop) until drop_select, drop_request, expire or destroy frees
 * enough bytes or the timeout passes. Free functions passed in are called with the lock
 * held: they must not call back into the buffer.
 *
 * Ownership: the value pointer belongs to the buffer from a successful insert until it is
 * handed back by drop_select / drop_first (caller owns it again) or freed by drop_request
 * / expire / destroy through the caller's free function. On a failed insert the caller
 * still owns it.
 */
#ifndef KVX_LOOKUP_H
#define KVX_LOOKUP_H

#include <stddef.h>
#include <stdint.h>

#include "td_err.h"

typedef struct {
    uint64_t req_id;
    uint32_t chunk;          /* chunk index inside the request */
    uint32_t layer0, layer1; /* global layer range [layer0, layer1) */
} kvx_lb_key;

typedef struct kvx_lookup kvx_lookup;

/* Called for every value the buffer frees itself (drop_request, expire, destroy). */
typedef void (*kvx_lb_free_fn)(void *arg, const kvx_lb_key *key, void *val, size_t bytes);

/* budget_bytes 0: 256 MiB. */
int kvx_lookup_create(size_t budget_bytes, kvx_lookup **out);
/* Frees every remaining value through free_fn (may be NULL); wakes and fails waiters
 * must not exist (no thread may be inside a call). NULL is fine. */
void kvx_lookup_destroy(kvx_lookup *lb, kvx_lb_free_fn free_fn, void *arg);

/* Store val (bytes counted against the budget). When full: timeout_ms == 0 returns
 * TD_ENOSPC at once, > 0 waits for space up to timeout_ms then TD_ETIMEDOUT. */
int kvx_lookup_insert(kvx_lookup *lb, const kvx_lb_key *key, void *val, size_t bytes,
                      int timeout_ms);
/* Return and remove the entry of key; TD_ENOENT if absent. */
int kvx_lookup_drop_select(kvx_lookup *lb, const kvx_lb_key *key, void **val, size_t *bytes);
/* Return and remove the oldest entry of a request (draining in order); TD_ENOENT if none. */
int kvx_lookup_drop_first(kvx_lookup *lb, uint64_t req_id, kvx_lb_key *key, void **val,
                          size_t *bytes);
/* Free every entry of a request (cancel); returns how many. */
int kvx_lookup_drop_request(kvx_lookup *lb, uint64_t req_id, kvx_lb_free_fn free_fn, void *arg);
/* Free every entry inserted before now_ms - max_age_ms; returns how many. */
int kvx_lookup_expire(kvx_lookup *lb, int64_t now_ms, int64_t max_age_ms, kvx_lb_free_fn free_fn,
                      void *arg);

typedef struct {
    size_t bytes, budget; /* bytes stored, the budget */
    int entries, requests;
} kvx_lookup_stats;
void kvx_lookup_stats_get(kvx_lookup *lb, kvx_lookup_stats *out);

#endif
