/* kv_pool.c: one-region paged KV pool with a lowest-id-first allocator and per-block
 * reference counts; the region is private anonymous memory, an unnamed memfd, a named POSIX
 * shared-memory segment, or a device backend's memory (then optionally with a host staging
 * copy for kvxfer). Layer 1 of kv_mem.h: it calls nothing above it. */
#define _GNU_SOURCE /* memfd_create */
#include "kv_pool.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "td_err.h"
#include "td_grow.h"

/* Validate the shape; *block_bytes and *region_bytes on success. */
static int pool_shape(const kn_kv_pool_params *p, size_t *block_bytes, size_t *region_bytes)
{
    int bs = p->block_size ? p->block_size : 16;
    td_dtype type = p->type;
    const int arrays = kn_kv_layout_arrays(p->layout);
    if (p->n_layers < 1 || p->n_kv_heads < 1 || p->head_dim < 1 || p->n_blocks < 1 ||
        (bs & (bs - 1)) || (type != TD_F16 && type != TD_F32) || !arrays) {
        TD_LOG_ERR("bad kv pool shape: layers %d kv heads %d head dim %d blocks %d block size %d "
                   "type %s layout %d",
                   p->n_layers, p->n_kv_heads, p->head_dim, p->n_blocks, bs, td_dtype_name(type),
                   (int)p->layout);
        return TD_EINVAL;
    }
    size_t es = type == TD_F16 ? 2 : 4;
    size_t bb = (size_t)p->n_kv_heads * (size_t)bs * (size_t)p->head_dim * es;
    size_t layer_bytes = bb * (size_t)p->n_blocks;
    if (layer_bytes / bb != (size_t)p->n_blocks ||
        layer_bytes > SIZE_MAX / 2 / (size_t)p->n_layers) {
        TD_LOG_ERR("kv pool size overflows");
        return TD_EINVAL;
    }
    if (p->n_slices < 0 || p->n_slices > KN_KV_MAX_SLICES) {
        TD_LOG_ERR("bad kv pool slicing: %d slices (at most %d)", p->n_slices, KN_KV_MAX_SLICES);
        return TD_EINVAL;
    }
    if (p->n_slices > 1) {
        int sum = 0;
        for (int i = 0; i < p->n_slices; i++) {
            if (p->slice_heads[i] < 1 || p->slice_heads[i] > p->n_kv_heads) {
                TD_LOG_ERR("bad kv pool slicing: slice %d has %d heads", i, p->slice_heads[i]);
                return TD_EINVAL;
            }
            sum += p->slice_heads[i];
        }
        if (sum != p->n_kv_heads) {
            TD_LOG_ERR("bad kv pool slicing: %d slices of %d heads in all, the pool has %d",
                       p->n_slices, sum, p->n_kv_heads);
            return TD_EINVAL;
        }
    }
    *block_bytes = bb;
    *region_bytes = layer_bytes * (size_t)arrays * (size_t)p->n_layers;
    return 0;
}

/* The layout of params p (valid): n_slices 1 for head-major. */
static kn_kv_slicing pool_slicing(const kn_kv_pool_params *p)
{
    kn_kv_slicing s = {.n_blocks = p->n_blocks, .n_slices = 1};
    if (p->n_slices > 1) {
        s.n_slices = p->n_slices;
        for (int i = 0; i < p->n_slices; i++)
            s.slice_heads[i] = p->slice_heads[i];
    }
    return s;
}

/* A device pool with host staging: its host copy ends in n_blocks on_dev flags. */
static bool staged(const kn_kv_pool_params *p)
{
    return p->host_stage && p->backend && p->backend->ops && !p->backend->ops->host_memory;
}

size_t kn_kv_pool_region_bytes(const kn_kv_pool_params *p)
{
    size_t bb, rb;
    return pool_shape(p, &bb, &rb) ? 0 : rb;
}

size_t kn_kv_pool_params_block_bytes(const kn_kv_pool_params *p)
{
    size_t bb, rb;
    return pool_shape(p, &bb, &rb) ? 0 : rb / (size_t)p->n_blocks;
}

static bool shm_name_ok(const char *name)
{
    size_t n = strlen(name);
    return n >= 2 && n < 200 && name[0] == '/' && !strchr(name + 1, '/');
}

/* Create the named segment of `bytes` (NULL: an unnamed memfd), reserve its memory, map
 * it; *fdp keeps the descriptor open. */
static int shm_create(const char *name, size_t bytes, void **out, int *fdp)
{
    int fd = name ? shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600)
                  : memfd_create("tandem-kv", MFD_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        TD_LOG_ERR("kv pool: cannot create shared memory %s: %s", name ? name : "(memfd)",
                   strerror(e));
        return e == EEXIST ? TD_ESTATE : e == ENOMEM || e == ENOSPC ? TD_ENOMEM : TD_EIO;
    }
    /* fallocate, not ftruncate: tmpfs pages are reserved now, so a full /dev/shm fails
     * here instead of killing the process with SIGBUS when a block is first written */
    int e = posix_fallocate(fd, 0, (off_t)bytes);
    void *r = MAP_FAILED;
    if (!e) {
        r = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (r == MAP_FAILED) e = errno;
    }
    if (e) {
        TD_LOG_ERR("kv pool: cannot reserve %zu bytes of shared memory %s: %s", bytes,
                   name ? name : "(memfd)", strerror(e));
        close(fd);
        if (name) shm_unlink(name);
        return e == ENOSPC || e == ENOMEM || e == EFBIG ? TD_ENOMEM : TD_EIO;
    }
    *out = r;
    *fdp = fd;
    return 0;
}

/* Host memory of `bytes`: the shared segment `name`, or private anonymous memory
 * (page-aligned, registrable for RDMA, zero-filled lazily). */
static int host_region(kn_kv_pool *pool, const char *name, size_t bytes, void **out)
{
    if (name || pool->fd_backed) {
        int rc = shm_create(name, bytes, out, &pool->fd);
        if (rc && name) {
            free(pool->shm_name); /* not ours: creation failed (maybe someone else's name) */
            pool->shm_name = NULL;
        }
        return rc;
    }
    void *r = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (r == MAP_FAILED) {
        TD_LOG_ERR("cannot allocate kv pool of %zu bytes", bytes);
        return TD_ENOMEM;
    }
    *out = r;
    return 0;
}

int kn_kv_pool_create(const kn_kv_pool_params *p, kn_kv_pool **out)
{
    *out = NULL;
    size_t block_bytes, region_bytes;
    int rc = pool_shape(p, &block_bytes, &region_bytes);
    if (rc) return rc;
    if (p->shm_name && !shm_name_ok(p->shm_name)) {
        TD_LOG_ERR("kv pool: bad shared memory name '%s'", p->shm_name);
        return TD_EINVAL;
    }
    const bool device = p->backend && p->backend->ops && !p->backend->ops->host_memory;
    if (device && p->shm_name && !staged(p)) {
        TD_LOG_ERR("kv pool: a shared pool in %s memory needs host staging (host_stage)",
                   p->backend->ops->name);
        return TD_EINVAL;
    }
    if (p->n_slices > 1 && p->backend && p->backend->ops && !p->backend->ops->kv_sliced) {
        TD_LOG_ERR("kv pool: the %s backend's kernels take head-major KV pools only, not one "
                   "sliced into %d head slices",
                   p->backend->ops->name, p->n_slices);
        return TD_EUNSUPP;
    }
    kn_kv_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return TD_ENOMEM;
    pool->n_layers = p->n_layers;
    pool->n_kv_heads = p->n_kv_heads;
    pool->head_dim = p->head_dim;
    pool->block_size = p->block_size ? p->block_size : 16;
    pool->n_blocks = p->n_blocks;
    pool->type = p->type;
    pool->block_bytes = block_bytes;
    pool->slicing = pool_slicing(p);
    pool->layout = p->layout;
    pool->region_bytes = region_bytes;
    pool->fd = -1;
    pool->fd_backed = p->fd_backed;
    pool->k = calloc((size_t)p->n_layers, sizeof *pool->k);
    pool->v = calloc((size_t)p->n_layers, sizeof *pool->v);
    pool->free_ids = malloc((size_t)p->n_blocks * sizeof *pool->free_ids);
    pool->refs = calloc((size_t)p->n_blocks, sizeof *pool->refs);
    if (p->shm_name) pool->shm_name = strdup(p->shm_name);
    if (!pool->k || !pool->v || !pool->free_ids || !pool->refs ||
        (p->shm_name && !pool->shm_name)) {
        TD_LOG_ERR("cannot allocate kv pool bookkeeping");
        kn_kv_pool_destroy(pool);
        return TD_ENOMEM;
    }
    void *r = NULL;
    if (device) {
        pool->dev = *p->backend;
        r = pool->dev.ops->alloc(pool->dev.ctx, region_bytes);
        if (!r) {
            TD_LOG_ERR("cannot allocate a kv pool of %zu bytes in %s memory", region_bytes,
                       pool->dev.ops->name);
            kn_kv_pool_destroy(pool);
            return TD_ENOMEM;
        }
        pool->region = r;
        if (p->host_stage && (rc = host_region(pool, p->shm_name,
                                               region_bytes + (size_t)p->n_blocks, &pool->host))) {
            kn_kv_pool_destroy(pool);
            return rc;
        }
        if (pool->host) pool->on_dev = (uint8_t *)pool->host + region_bytes;
    } else if ((rc = host_region(pool, p->shm_name, region_bytes, &r))) {
        kn_kv_pool_destroy(pool);
        return rc;
    }
    pool->region = r;
    size_t layer_bytes = block_bytes * (size_t)p->n_blocks;
    const int arrays = kn_kv_pool_arrays(pool);
    for (int l = 0; l < p->n_layers; l++) {
        pool->k[l] = (char *)r + (size_t)(arrays * l) * layer_bytes;
        pool->v[l] = (char *)r + (size_t)(arrays * l + arrays - 1) * layer_bytes; /* latent: k[l] */
    }
    /* 0, 1, 2, ...: sorted, so a heap */
    for (int i = 0; i < p->n_blocks; i++)
        pool->free_ids[i] = i;
    pool->n_free = p->n_blocks;
    *out = pool;
    return 0;
}

void kn_kv_pool_destroy(kn_kv_pool *pool)
{
    if (!pool) return;
    if (pool->region && pool->dev.ops)
        pool->dev.ops->free(pool->dev.ctx, pool->region);
    else if (pool->region)
        munmap(pool->region, pool->region_bytes);
    if (pool->host) munmap(pool->host, pool->region_bytes + (size_t)pool->n_blocks);
    /* the mapper usually unlinked it already (ENOENT); the name carries our pid, so it
     * cannot be another process's segment */
    if (pool->shm_name) shm_unlink(pool->shm_name);
    if (pool->fd >= 0) close(pool->fd);
    free(pool->shm_name);
    free(pool->k);
    free(pool->v);
    free(pool->free_ids);
    free(pool->refs);
    free(pool);
}

int kn_kv_region_map(const kn_kv_pool_params *p, bool unlink, void **region, size_t *bytes,
                     int *fdp)
{
    *region = NULL;
    *bytes = 0;
    if (fdp) *fdp = -1;
    size_t block_bytes, region_bytes;
    int rc = pool_shape(p, &block_bytes, &region_bytes);
    if (rc) return rc;
    if (staged(p)) region_bytes += (size_t)p->n_blocks; /* the on_dev flags */
    if (!p->shm_name || !shm_name_ok(p->shm_name)) {
        TD_LOG_ERR("kv pool: bad shared memory name '%s'", p->shm_name ? p->shm_name : "(null)");
        return TD_EINVAL;
    }
    int fd = shm_open(p->shm_name, O_RDWR, 0);
    if (fd < 0) {
        int e = errno;
        TD_LOG_ERR("kv pool: cannot open shared memory %s: %s", p->shm_name, strerror(e));
        return e == ENOENT ? TD_ENOENT : TD_EIO;
    }
    struct stat st;
    rc = fstat(fd, &st) ? TD_EIO : 0;
    if (!rc && (st.st_size < 0 || (size_t)st.st_size != region_bytes)) {
        TD_LOG_ERR("kv pool: shared memory %s has %lld bytes, the pool needs %zu", p->shm_name,
                   (long long)st.st_size, region_bytes);
        rc = TD_EFORMAT;
    }
    void *r = MAP_FAILED;
    if (!rc) {
        r = mmap(NULL, region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (r == MAP_FAILED) {
            TD_LOG_ERR("kv pool: cannot map shared memory %s: %s", p->shm_name, strerror(errno));
            rc = TD_ENOMEM;
        }
    }
    if (rc || !fdp)
        close(fd);
    else
        *fdp = fd;
    if (rc) return rc;
    if (unlink) shm_unlink(p->shm_name);
    *region = r;
    *bytes = region_bytes;
    return 0;
}

void kn_kv_region_unmap(void *region, size_t bytes)
{
    if (region) munmap(region, bytes);
}

/* The free ids are a min-heap: a block is taken lowest id first, whatever order blocks were
 * freed in. A request's blocks then form runs of consecutive ids as far as the free blocks
 * allow (one contiguous piece per layer array for attention to stream, one kvxfer put per
 * run), where a stack handed them out in the order of the last frees (rollbacks,
 * preemptions, cache evictions). On the speculation benchmark's steps it measured no
 * different (BENCHMARKS.md, "The step cost model and the acceptance model"). */
static void heap_push(kn_kv_pool *pool, int32_t id)
{
    int32_t *h = pool->free_ids;
    int i = pool->n_free++;
    while (i > 0 && h[(i - 1) / 2] > id) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = id;
}

static int32_t heap_pop(kn_kv_pool *pool)
{
    int32_t *h = pool->free_ids, top = h[0], last = h[--pool->n_free];
    int i = 0, n = pool->n_free;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && h[c + 1] < h[c]) c++;
        if (h[c] >= last) break;
        h[i] = h[c];
        i = c;
    }
    if (n > 0) h[i] = last;
    return top;
}

int kn_kv_pool_take(kn_kv_pool *pool, int n, int32_t *ids)
{
    if (n < 0) return TD_EINVAL;
    if (n > pool->n_free) return TD_ENOSPC;
    for (int i = 0; i < n; i++) {
        ids[i] = heap_pop(pool);
        pool->refs[ids[i]] = 1;
        if (pool->on_dev) pool->on_dev[ids[i]] = 0;
    }
    return 0;
}

/* A block id out of range, or a reference count that cannot be, is a bug in the layer
 * above: stop before the free list or a sequence's KV is corrupted. */
static void check_block(const kn_kv_pool *pool, int32_t id, bool held, const char *what)
{
    if (id >= 0 && id < pool->n_blocks && (!held || pool->refs[id] >= 1)) return;
    TD_LOG_ERR("kv block %d %s (bug)", id, what);
    abort();
}

void kn_kv_pool_ref(kn_kv_pool *pool, int32_t id)
{
    check_block(pool, id, false, "referenced out of range");
    pool->refs[id]++;
}

bool kn_kv_pool_unref(kn_kv_pool *pool, int32_t id)
{
    check_block(pool, id, true, "freed twice or out of range");
    return --pool->refs[id] == 0;
}

void kn_kv_pool_put(kn_kv_pool *pool, int32_t id)
{
    check_block(pool, id, false, "put out of range");
    if (pool->refs[id] || pool->n_free >= pool->n_blocks) {
        TD_LOG_ERR("kv block %d put while held or free (bug)", id);
        abort();
    }
    heap_push(pool, id);
}

/* Every layer's arrays (K and V, or the latent once) of blocks ids between the staging and
 * the device (a sliced pool's block piece by piece). */
static int stage_blocks(kn_kv_pool *p, const int32_t *ids, int n, bool up)
{
    if (!p->host) return TD_EINVAL;
    const kn_backend_ops *o = p->dev.ops;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= p->n_blocks) return TD_ERANGE;
        for (int a = 0; a < kn_kv_pool_arrays(p) * p->n_layers; a++)
            for (int s = 0; s < p->slicing.n_slices; s++) {
                size_t bytes, off = kn_kv_block_piece(p, ids[i], s, NULL, &bytes);
                char *d = (char *)kn_kv_pool_array(p, a) + off;
                char *h = (char *)p->host + (d - (char *)p->region); /* the same offset */
                int rc =
                    up ? o->upload(p->dev.ctx, d, h, bytes) : o->download(p->dev.ctx, h, d, bytes);
                if (rc) return rc;
            }
        if (up) p->on_dev[ids[i]] = 1;
    }
    if (up)
        p->n_stage_up += (uint64_t)n;
    else
        p->n_stage_down += (uint64_t)n;
    return 0;
}

int kn_kv_block_copy(kn_kv_pool *p, int32_t src, int32_t dst)
{
    if (src < 0 || src >= p->n_blocks || dst < 0 || dst >= p->n_blocks || src == dst)
        return TD_ERANGE;
    const kn_backend_ops *o = p->dev.ops;
    /* a staged pool's newest KV of src may be in its host copy (received, not uploaded):
     * copy there and leave dst to be uploaded; else on the device, and dst is current there */
    const bool in_host = p->host && !p->on_dev[src];
    const bool device = o && !o->host_memory && !in_host;
    void *tmp = NULL;
    if (device && !(tmp = malloc(p->block_bytes))) return TD_ENOMEM;
    int rc = 0;
    for (int a = 0; a < kn_kv_pool_arrays(p) * p->n_layers && !rc; a++)
        for (int s = 0; s < p->slicing.n_slices && !rc; s++) {
            size_t bytes, off_s = kn_kv_block_piece(p, src, s, NULL, &bytes);
            size_t off_d = kn_kv_block_piece(p, dst, s, NULL, &bytes);
            char *base = kn_kv_pool_array(p, a);
            if (in_host) /* the staging copy: the same offsets */
                base = (char *)p->host + (base - (char *)p->region);
            if (!device)
                memcpy(base + off_d, base + off_s, bytes);
            else if (!(rc = o->download(p->dev.ctx, tmp, base + off_s, bytes)))
                rc = o->upload(p->dev.ctx, base + off_d, tmp, bytes);
        }
    free(tmp);
    if (!rc && p->host) p->on_dev[dst] = p->on_dev[src];
    return rc;
}

int kn_kv_stage_upload(kn_kv_pool *p, const int32_t *ids, int n)
{
    return stage_blocks(p, ids, n, true);
}

int kn_kv_stage_download(kn_kv_pool *p, const int32_t *ids, int n)
{
    return stage_blocks(p, ids, n, false);
}
