/* kv_pool.h: the paged KV cache of one model shard, and its block allocator.
 *
 * Purpose: hold K and V (or one latent array) of every (local) layer in fixed-size blocks
 * that sequences own through block tables, so sequences grow without copying and KV can be
 * shipped block by block (kvxfer registers the whole pool as one memory region).
 * Layout: one contiguous region. For local layer l, K then V (params.layout
 * KN_KV_LAYOUT_KV), or one array (KN_KV_LAYOUT_LATENT: v[l] == k[l], below), each an array
 * of tiles (one (block, head) pair's (block_size, head_dim) elements of `type`, contiguous)
 * laid out by the pool's slicing (kn_backend.h, kn_kv_tile): head-major by default,
 *   (n_blocks, n_kv_heads, block_size, head_dim)
 * (one block's heads are one contiguous range), or, with params.n_slices > 1 (a prefill
 * stage whose decode ranks each hold a part of its heads), slice by slice,
 *   (slice, n_blocks, slice_heads[slice], block_size, head_dim)
 * (one slice's part of a run of consecutive blocks is one contiguous range: kvxfer puts it
 * without staging; kvx_conn.h's sliced source layout). A block of a layer's K is then
 * n_slices contiguous pieces (kn_kv_block_piece), one in a head-major pool; the pieces in
 * order are the block's heads in order, so block copies (kv_tier.h's file, staging
 * uploads) carry the same bytes in every layout. Every copy of a block's KV (staging,
 * kn_kv_block_copy, the tier, kvxfer) walks the kn_kv_pool_arrays(p) * n_layers arrays in
 * region order (kn_kv_pool_array), so a latent block is stored and moved once.
 * Invariants: block_size is a power of two; a block id is either on the free list, or
 * referenced by refs[id] >= 1 holders (more than one only through a prefix cache,
 * kv_cache.h), or (refs 0) kept idle by the prefix cache above it; kn_kv_pool_take is
 * all-or-nothing. The pool calls nothing above it (kv_mem.h: the layers).
 * Memory: private anonymous memory (zero-filled lazily), an unnamed memfd (fd_backed), or,
 * with params.shm_name, a POSIX shared-memory segment the pool's process creates and another
 * process of the same host maps with kn_kv_region_map (to have KV written into it). The
 * segment is reserved with posix_fallocate at create, so a full /dev/shm is a clean
 * TD_ENOMEM there rather than a SIGBUS at the first write.
 * Device pools (params.backend with host_memory false): the region is the backend's memory.
 * With params.host_stage they also keep a host copy of the same layout (the "staging",
 * shared memory when shm_name is set), which kvxfer reads and writes instead
 * (kn_kv_xfer_region): KV received into it is uploaded block by block before the engine
 * reads it (the engine asks with kn_kv_stage_upload; on_dev says which blocks' device copy
 * is current), and a prefill stage downloads each chunk's blocks before it pushes them
 * (kn_kv_stage_download). A block handed out by kn_kv_pool_take is not current until uploaded
 * or written by the engine. The on_dev flags (n_blocks bytes) follow the region in the host
 * copy, so in shared memory a process that maps it and writes blocks there can clear
 * them; kn_kv_region_map of such a pool (params.backend a device, host_stage) maps
 * region_bytes + n_blocks.
 * Threading: not thread-safe; the process's engine loop owns the pool (a process that maps
 * the region shares the memory, not the allocator).
 * Ownership: kn_kv_pool_create/destroy own the region (kn_kv_mem_create makes one). A shared
 * pool's name exists from create until the mapper unlinks it (kn_kv_region_map with
 * unlink) or the pool is destroyed, whichever comes first: names must therefore be unique
 * per creating process (carry its pid), so that destroy never removes another's segment.
 */
#ifndef KN_KV_POOL_H
#define KN_KV_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kn_backend.h"
#include "td_dtype.h"

/* The block layout: which arrays a layer of the pool holds. The model decides it
 * (kn_model_kv_params): a model with multi-head latent attention (deepseek2) keeps one
 * latent vector per token and layer (kv_lora_rank + n_rot elements, one KV head) whose
 * prefix is the value its attention reads, so it needs no V array. */
typedef enum {
    KN_KV_LAYOUT_KV = 0, /* K then V for each layer: 2 arrays a layer */
    KN_KV_LAYOUT_LATENT, /* one array a layer, v[l] == k[l]: the value is read from K (its
                            prefix), never written apart (kn_backend.h kv_write: vpool ==
                            kpool writes K only); half the bytes of KN_KV_LAYOUT_KV */
} kn_kv_layout;

/* Arrays a layer holds in layout l: 2 (K, V) or 1 (latent); 0 for an unknown value. */
static inline int kn_kv_layout_arrays(kn_kv_layout l)
{
    return l == KN_KV_LAYOUT_KV ? 2 : l == KN_KV_LAYOUT_LATENT ? 1 : 0;
}

static inline const char *kn_kv_layout_name(kn_kv_layout l)
{
    return l == KN_KV_LAYOUT_KV ? "K+V" : l == KN_KV_LAYOUT_LATENT ? "latent" : "?";
}

typedef struct {
    int n_layers;   /* local layers of the shard */
    int n_kv_heads; /* local KV heads (this TP rank's) */
    int head_dim;
    int block_size; /* tokens per block, power of two; 0: 16 */
    int n_blocks;
    td_dtype type;             /* TD_F16 (the default of the nodes) or TD_F32 (exactness checks) */
    const char *shm_name;      /* NULL: private memory; else "/NAME" (< 200 bytes, no other
                                  '/'): back the region with a new POSIX shared-memory segment of
                                  this name (created exclusively: an existing one is TD_ESTATE) */
    const kn_backend *backend; /* NULL or host memory: as above; a device backend: the
                                  region is its memory (borrowed: outlive the pool) */
    bool host_stage;           /* the KV must be reachable in host memory (kvxfer): a device
                                  pool keeps a host copy (staging, shm_name applies to it);
                                  a host pool is reachable already */
    bool fd_backed;            /* host memory without shm_name: an unnamed memfd (shared
                                  mapping) instead of private anonymous memory, so that
                                  kn_kv_pool_fd can hand it to a writer on the same host
                                  (kvxfer maps it there: kvx_dec_register_fd) */
    int n_slices;              /* 0 or 1: head-major; 2 .. KN_KV_MAX_SLICES: sliced, the KV
                                  heads cut into slices of slice_heads[i] >= 1 heads summing
                                  to n_kv_heads (a backend without kv_sliced refuses it) */
    int slice_heads[KN_KV_MAX_SLICES];
    kn_kv_layout layout; /* KN_KV_LAYOUT_KV (0, the default) or KN_KV_LAYOUT_LATENT */
} kn_kv_pool_params;

typedef struct {
    int n_layers, n_kv_heads, head_dim, block_size, n_blocks;
    td_dtype type;
    void *region; /* the whole pool */
    size_t region_bytes;
    size_t block_bytes;    /* bytes of one block of one layer array (K, V or latent): all
                              heads */
    kn_kv_slicing slicing; /* the layer arrays' layout (n_slices 1: head-major) */
    kn_kv_layout layout;   /* K and V, or latent (one array a layer) */
    void **k, **v;         /* (n_layers) pointers into region; latent: v[l] == k[l] (the
                              attention reads V where it is, and a K/V loop that forgot the
                              layout copies the same bytes twice rather than a wrong array) */
    int32_t *free_ids;     /* free block ids, a binary min-heap (lowest id first) */
    int n_free;
    int32_t *refs;   /* (n_blocks) references to each block */
    char *shm_name;  /* the segment's name while this pool may still have to unlink it, or NULL */
    int fd;          /* the host memory's file (shm segment or memfd), open while the pool
                        lives; -1 for private memory (kn_kv_pool_fd) */
    bool fd_backed;  /* params.fd_backed */
    kn_backend dev;  /* the device backend whose memory region is, or zeroed (host memory) */
    void *host;      /* device pool with host_stage: the staging copy (region_bytes, same
                        layout; shm when shm_name), else NULL */
    uint8_t *on_dev; /* (n_blocks) with host, at host + region_bytes: the block's device copy
                        is current (1) or its host copy holds newer KV (0: received, not
                        yet uploaded) */
    uint64_t n_stage_up, n_stage_down; /* blocks staged each way (all layers' arrays) */
} kn_kv_pool;

/* Arrays a layer of the pool holds: 2 (K, V) or 1 (latent). */
static inline int kn_kv_pool_arrays(const kn_kv_pool *p)
{
    return kn_kv_layout_arrays(p->layout);
}

/* Array a (0 <= a < kn_kv_pool_arrays(p) * n_layers) in region order: K of layer a, or,
 * in the K+V layout, K (a even) or V (a odd) of layer a / 2. */
static inline void *kn_kv_pool_array(const kn_kv_pool *p, int a)
{
    return kn_kv_pool_arrays(p) == 1 ? p->k[a] : a & 1 ? p->v[a / 2] : p->k[a / 2];
}

/* Bytes one block takes in the pool: every local layer's arrays, all heads
 * (region_bytes = n_blocks times this). */
static inline size_t kn_kv_pool_block_bytes(const kn_kv_pool *p)
{
    return (size_t)kn_kv_pool_arrays(p) * (size_t)p->n_layers * p->block_bytes;
}

/* Piece i (0 <= i < slicing.n_slices) of block blk of a layer's K (or V) array: returns its
 * byte offset in the array and sets *bytes; heads [*h0, *h0 + heads) of the block, in
 * order (one piece, every head, in a head-major pool). */
static inline size_t kn_kv_block_piece(const kn_kv_pool *p, int32_t blk, int i, int *h0,
                                       size_t *bytes)
{
    const size_t tile = (size_t)p->block_size * (size_t)p->head_dim * (p->type == TD_F16 ? 2 : 4);
    int first = 0;
    for (int j = 0; j < i; j++)
        first += p->slicing.slice_heads[j];
    const int heads = p->slicing.n_slices > 1 ? p->slicing.slice_heads[i] : p->n_kv_heads;
    if (h0) *h0 = first;
    *bytes = (size_t)heads * tile;
    return (size_t)kn_kv_tile(&p->slicing, p->n_kv_heads, blk, first) * tile;
}

/* The memory kvxfer registers: the staging of a staged device pool, else the region. */
static inline void *kn_kv_xfer_region(const kn_kv_pool *p)
{
    return p->host ? p->host : p->region;
}

/* Staged device pools: copy blocks ids (n) host -> device, every layer's arrays, and mark
 * them current (kn_kv_stage_upload), or device -> host (kn_kv_stage_download, waits for
 * the backend's queued ops). kn_kv_pool_block_bytes bytes a block. A pool without
 * staging: TD_EINVAL. Errors of the backend's upload/download are returned. */
int kn_kv_stage_upload(kn_kv_pool *p, const int32_t *ids, int n);
int kn_kv_stage_download(kn_kv_pool *p, const int32_t *ids, int n);

/* dst's KV = src's, every layer's arrays (copy on write: a request that must write into
 * a block it shares takes a private copy first). On the pool's own memory: memcpy, or the
 * backend's download + upload for a device pool. A staged pool copies where src's newest KV
 * is: on the device (dst current there, on_dev 1; its staging is not touched: download the
 * block before kvxfer pushes it), or in the staging (src received, not uploaded: dst is
 * uploaded before the engine reads it, on_dev 0). TD_ERANGE (nothing copied) for an id out of
 * range or src == dst, TD_ENOMEM, or the backend's error. */
int kn_kv_block_copy(kn_kv_pool *p, int32_t src, int32_t dst);

/* Errors: TD_EINVAL bad shape or name; TD_ENOMEM no memory (or /dev/shm full); TD_ESTATE
 * the shm name already exists; TD_EIO another shm failure (logged with errno). */
int kn_kv_pool_create(const kn_kv_pool_params *p, kn_kv_pool **out);
/* The descriptor of the file holding the pool's host memory (the region of a host pool,
 * the staging copy of a device pool): a shm segment, or a memfd (params.fd_backed); -1 for
 * private memory. Owned by the pool. */
static inline int kn_kv_pool_fd(const kn_kv_pool *p)
{
    return p->fd;
}

/* Unmaps the region; a shared pool also unlinks its name if still there. NULL is fine. */
void kn_kv_pool_destroy(kn_kv_pool *pool);

/* Bytes of the region of a pool with these params (0 if the shape is invalid). */
size_t kn_kv_pool_region_bytes(const kn_kv_pool_params *p);
/* Bytes one block takes in a pool with these params (its n_blocks ignored): every layer's
 * arrays (K and V, or the latent array once), all heads; 0 if the shape is invalid. What a
 * byte budget (a decode rank's kv_memory, a prefix cache's bytes) is divided by. */
size_t kn_kv_pool_params_block_bytes(const kn_kv_pool_params *p);

/* Map the region of a shared pool another process created with the same params
 * (p->shm_name set): *region (read-write, shared), *bytes. The segment's size must be the
 * region size of p (else TD_EFORMAT), plus n_blocks on_dev flags for a staged device pool
 * (params.backend a device, host_stage): *bytes counts them. unlink: remove the name once mapped
 * (the memory lives on while any process maps it). TD_ENOENT if there is no such segment. Unmap
 * with kn_kv_region_unmap. fd (may be NULL): receives the segment's descriptor, left open
 * (the caller closes it; kvxfer hands it to a writer on this host), else it is closed once
 * mapped. */
int kn_kv_region_map(const kn_kv_pool_params *p, bool unlink, void **region, size_t *bytes,
                     int *fd);
void kn_kv_region_unmap(void *region, size_t bytes); /* NULL is fine */

/* ---- the block allocator (layer 1 of kv_mem.h; the layers above call these) ----
 * A block is free (on the free list, refs 0), held (refs >= 1), or kept (refs 0, off the
 * free list: the prefix cache holds it idle, kv_cache.h). The pool counts references and
 * keeps the free list; what happens to a block whose last reference goes is the caller's
 * decision (kn_kv_pool_put, or keep it). Everything else allocates through kv_mem.h. */

/* Take n free blocks into ids (each with one reference); TD_ENOSPC (nothing taken) if fewer
 * than n are free, TD_EINVAL if n < 0. */
int kn_kv_pool_take(kn_kv_pool *pool, int n, int32_t *ids);
/* One more reference to block id (held, or kept: it leaves the caller's keeping). */
void kn_kv_pool_ref(kn_kv_pool *pool, int32_t id);
/* Drop one reference to block id; true if it was the last (the block is now the caller's to
 * kn_kv_pool_put or keep). A block with no reference is a bug (abort). */
bool kn_kv_pool_unref(kn_kv_pool *pool, int32_t id);
/* Block id (refs 0, not free) goes back to the free list. */
void kn_kv_pool_put(kn_kv_pool *pool, int32_t id);
/* Blocks on the free list. */
static inline int kn_kv_pool_n_free(const kn_kv_pool *pool)
{
    return pool->n_free;
}

/* Blocks needed for n_ctx positions. */
static inline int kn_kv_blocks_for(const kn_kv_pool *pool, int64_t n_ctx)
{
    return (int)((n_ctx + pool->block_size - 1) / pool->block_size);
}

#endif
