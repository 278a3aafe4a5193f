/* kv_pool.c: one-region paged KV pool with a free-list allocator. */
#include "kv_pool.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "td_err.h"

int kn_kv_pool_create(const kn_kv_pool_params *p, kn_kv_pool **out)
{
    *out = NULL;
    int bs = p->block_size ? p->block_size : 16;
    td_dtype type = p->type;
    if (p->n_layers < 1 || p->n_kv_heads < 1 || p->head_dim < 1 || p->n_blocks < 1 ||
        (bs & (bs - 1)) || (type != TD_F16 && type != TD_F32)) {
        TD_LOG_ERR("bad kv pool shape: layers %d kv heads %d head dim %d blocks %d block size %d "
                   "type %s",
                   p->n_layers, p->n_kv_heads, p->head_dim, p->n_blocks, bs, td_dtype_name(type));
        return TD_EINVAL;
    }
    size_t es = type == TD_F16 ? 2 : 4;
    size_t block_bytes = (size_t)p->n_kv_heads * (size_t)bs * (size_t)p->head_dim * es;
    size_t layer_bytes = block_bytes * (size_t)p->n_blocks;
    if (layer_bytes / block_bytes != (size_t)p->n_blocks ||
        layer_bytes > SIZE_MAX / 2 / (size_t)p->n_layers) {
        TD_LOG_ERR("kv pool size overflows");
        return TD_EINVAL;
    }
    kn_kv_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return TD_ENOMEM;
    pool->n_layers = p->n_layers;
    pool->n_kv_heads = p->n_kv_heads;
    pool->head_dim = p->head_dim;
    pool->block_size = bs;
    pool->n_blocks = p->n_blocks;
    pool->type = type;
    pool->block_bytes = block_bytes;
    pool->region_bytes = layer_bytes * 2 * (size_t)p->n_layers;
    /* anonymous mapping: page-aligned (registrable for RDMA later), zero-filled lazily */
    void *r =
        mmap(NULL, pool->region_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    pool->k = calloc((size_t)p->n_layers, sizeof *pool->k);
    pool->v = calloc((size_t)p->n_layers, sizeof *pool->v);
    pool->free_ids = malloc((size_t)p->n_blocks * sizeof *pool->free_ids);
    if (r == MAP_FAILED || !pool->k || !pool->v || !pool->free_ids) {
        TD_LOG_ERR("cannot allocate kv pool of %zu bytes", pool->region_bytes);
        if (r != MAP_FAILED) munmap(r, pool->region_bytes);
        free(pool->k);
        free(pool->v);
        free(pool->free_ids);
        free(pool);
        return TD_ENOMEM;
    }
    pool->region = r;
    for (int l = 0; l < p->n_layers; l++) {
        pool->k[l] = (char *)r + (size_t)(2 * l) * layer_bytes;
        pool->v[l] = (char *)r + (size_t)(2 * l + 1) * layer_bytes;
    }
    /* stack with block 0 on top, so allocation order is 0, 1, 2, ... */
    for (int i = 0; i < p->n_blocks; i++)
        pool->free_ids[i] = p->n_blocks - 1 - i;
    pool->n_free = p->n_blocks;
    *out = pool;
    return 0;
}

void kn_kv_pool_destroy(kn_kv_pool *pool)
{
    if (!pool) return;
    if (pool->region) munmap(pool->region, pool->region_bytes);
    free(pool->k);
    free(pool->v);
    free(pool->free_ids);
    free(pool);
}

int kn_kv_alloc(kn_kv_pool *pool, int n, int32_t *ids)
{
    if (n < 0) return TD_EINVAL;
    if (n > pool->n_free) return TD_ENOSPC;
    for (int i = 0; i < n; i++)
        ids[i] = pool->free_ids[--pool->n_free];
    return 0;
}

void kn_kv_free(kn_kv_pool *pool, int n, const int32_t *ids)
{
    for (int i = 0; i < n; i++) {
        /* a double free is a bug in the caller; the stack cannot overflow otherwise */
        if (pool->n_free >= pool->n_blocks || ids[i] < 0 || ids[i] >= pool->n_blocks) {
            TD_LOG_ERR("kv block %d freed twice or out of range (bug)", ids[i]);
            abort();
        }
        pool->free_ids[pool->n_free++] = ids[i];
    }
}

void kn_kv_seq_init(kn_kv_seq *s)
{
    memset(s, 0, sizeof *s);
}

int kn_kv_seq_reserve(kn_kv_pool *pool, kn_kv_seq *s, int64_t n_ctx)
{
    if (n_ctx < 0) return TD_EINVAL;
    int need = kn_kv_blocks_for(pool, n_ctx);
    if (need <= s->n_blocks) return 0;
    if (need > s->cap) {
        int cap = s->cap ? s->cap : 8;
        while (cap < need)
            cap *= 2;
        int32_t *b = realloc(s->blocks, (size_t)cap * sizeof *b);
        if (!b) return TD_ENOMEM;
        s->blocks = b;
        s->cap = cap;
    }
    int rc = kn_kv_alloc(pool, need - s->n_blocks, s->blocks + s->n_blocks);
    if (rc) return rc;
    s->n_blocks = need;
    return 0;
}

void kn_kv_seq_release(kn_kv_pool *pool, kn_kv_seq *s)
{
    kn_kv_free(pool, s->n_blocks, s->blocks);
    s->n_blocks = 0;
}

void kn_kv_seq_fini(kn_kv_pool *pool, kn_kv_seq *s)
{
    if (s->n_blocks) kn_kv_seq_release(pool, s);
    free(s->blocks);
    memset(s, 0, sizeof *s);
}
