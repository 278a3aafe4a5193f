/* kv_cache_int.h: the hooks kv_pool.c calls on its attached prefix cache (kv_cache.h).
 *
 * Purpose: the pool allocates and frees blocks; the cache decides which unreferenced blocks
 * it keeps. These three calls are the whole interface between them, declared apart so that
 * the pool does not include the cache's header (which includes the pool's).
 * Threading: as the pool's.
 */
#ifndef KN_KV_CACHE_INT_H
#define KN_KV_CACHE_INT_H

#include <stdbool.h>
#include <stdint.h>

struct kn_kv_cache;

/* Idle (unreferenced, evictable) cached blocks. */
int kn_kv_cache_idle(const struct kn_kv_cache *c);
/* Evict the least recently idle block: it leaves the index; returns its id (refs 0, to be
 * put on the free list by the pool), -1 if none is idle. */
int32_t kn_kv_cache_evict(struct kn_kv_cache *c);
/* block's last reference just went: if it is cached it becomes idle (most recent) and this
 * returns true; false: not cached (the pool frees it). */
bool kn_kv_cache_park(struct kn_kv_cache *c, int32_t block);

#endif
