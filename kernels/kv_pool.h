/* kv_pool.h: the paged KV cache of one model shard, and its block allocator.
 *
 * Purpose: hold K and V of every (local) layer in fixed-size blocks that sequences own
 * through block tables, so sequences grow without copying and KV can be shipped block by
 * block (kvxfer registers the whole pool as one memory region).
 * Layout: one contiguous region. For local layer l, K then V, each
 *   (n_blocks, n_kv_heads, block_size, head_dim) of `type`
 * (head-major inside a block: one head's slice of a block is one contiguous range).
 * Invariants: block_size is a power of two; a block id is either on the free list or
 * owned by exactly one kn_kv_seq; kn_kv_alloc is all-or-nothing.
 * Threading: not thread-safe; the process's engine loop owns the pool.
 * Ownership: kn_kv_pool_create/destroy own the region; kn_kv_seq_init/fini are for an
 * embedded sequence record whose blocks go back to the pool on kn_kv_seq_release.
 */
#ifndef KN_KV_POOL_H
#define KN_KV_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_dtype.h"

typedef struct {
    int n_layers;   /* local layers of the shard */
    int n_kv_heads; /* local KV heads (this TP rank's) */
    int head_dim;
    int block_size; /* tokens per block, power of two; 0: 16 */
    int n_blocks;
    td_dtype type; /* TD_F16 (the default of the nodes) or TD_F32 (exactness checks) */
} kn_kv_pool_params;

typedef struct {
    int n_layers, n_kv_heads, head_dim, block_size, n_blocks;
    td_dtype type;
    void *region; /* the whole pool */
    size_t region_bytes;
    size_t block_bytes; /* bytes of one block of one layer's K (or V): all heads */
    void **k, **v;      /* (n_layers) pointers into region */
    int32_t *free_ids;  /* stack of free block ids */
    int n_free;
} kn_kv_pool;

int kn_kv_pool_create(const kn_kv_pool_params *p, kn_kv_pool **out);
void kn_kv_pool_destroy(kn_kv_pool *pool); /* NULL is fine */

/* Take n free blocks into ids; TD_ENOSPC (and nothing taken) if fewer are free. */
int kn_kv_alloc(kn_kv_pool *pool, int n, int32_t *ids);
void kn_kv_free(kn_kv_pool *pool, int n, const int32_t *ids);

/* Blocks needed for n_ctx positions. */
static inline int kn_kv_blocks_for(const kn_kv_pool *pool, int64_t n_ctx)
{
    return (int)((n_ctx + pool->block_size - 1) / pool->block_size);
}

/* A sequence's block table, grown on demand. */
typedef struct {
    int32_t *blocks; /* (n_blocks) block ids, position p lives in blocks[p / block_size] */
    int n_blocks, cap;
} kn_kv_seq;

void kn_kv_seq_init(kn_kv_seq *s);
/* Make room for positions [0, n_ctx): allocates missing blocks (all or nothing). */
int kn_kv_seq_reserve(kn_kv_pool *pool, kn_kv_seq *s, int64_t n_ctx);
/* Return every block to the pool; the record stays usable (empty). */
void kn_kv_seq_release(kn_kv_pool *pool, kn_kv_seq *s);
void kn_kv_seq_fini(kn_kv_pool *pool, kn_kv_seq *s); /* release + free the table */

#endif
