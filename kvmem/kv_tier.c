/* kv_tier.c: the prefix cache's second tier (kv_tier.h): a store of block-sized slots (a
 * memory-mapped file or anonymous host memory), an in-memory index from block id to slot
 * with each entry's serials, tokens and data checksum, and an LRU list of the entries.
 *
 * File layout: a 4096-byte header (u64 magic "TDKVTIER", u32 version, u32 0, u64 slot
 * bytes, u64 slots), then the slots; slot i holds, for each local layer l, K then V of one
 * block ((n_kv_heads, block_size, head_dim) each, the pool's layout). */
#include "kv_tier.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "td_err.h"
#include "td_ilist.h"

#define TIER_MAGIC   0x52454954564b4454ull /* the bytes "TDKVTIER" as a little-endian u64 */
#define TIER_VERSION 1u
#define HEADER_BYTES 4096u

struct kn_kv_tier {
    char *path;        /* NULL: anonymous memory */
    int fd;            /* the file, -1: none */
    uint8_t *base;     /* the whole store (header + slots) */
    size_t total;      /* bytes of the store */
    size_t slot_bytes; /* one block, every layer's arrays (kn_kv_pool_block_bytes) */
    int bs;            /* tokens per block */
    int n_slots;
    uint64_t *id;         /* (n_slots) */
    uint64_t *serial;     /* (n_slots) 0: the slot is empty */
    uint64_t *parent;     /* (n_slots) the parent entry's serial */
    uint64_t *sum;        /* (n_slots) checksum of the slot's data */
    int32_t *tok;         /* (n_slots, bs) */
    td_ilist lru;         /* the filled slots (links: n_slots), least recently used first */
    int32_t *free_slots; /* stack of empty slots */
    int n_free;
    int32_t *index; /* (mask + 1) slot of each index position, -1: empty */
    uint64_t mask;
    bool broken; /* the file shrank: every call misses from then on */
    uint64_t writes, reads, dropped, errors;
    bool log;           /* record copies (a TP leader's tier) */
    kn_kv_tier_op *ops; /* (cap_ops) the copies since the last kn_kv_tier_ops_clear */
    int n_ops, cap_ops;
};

size_t kn_kv_tier_block_bytes(const kn_kv_pool *pool)
{
    return kn_kv_pool_block_bytes(pool);
}

/* ---- checksum: four 64-bit lanes of xor-multiply, folded ---- */

static uint64_t mix(uint64_t h, uint64_t w)
{
    h = (h ^ w) * 0x9e3779b97f4a7c15ull;
    return h ^ (h >> 31);
}

static uint64_t checksum(const uint8_t *p, size_t n)
{
    uint64_t h[4] = {1, 2, 3, 4}, w;
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++) {
            memcpy(&w, p + i + 8 * (size_t)k, 8);
            h[k] = mix(h[k], w);
        }
    for (; i < n; i++)
        h[0] = mix(h[0], p[i]);
    return mix(mix(h[0], h[1]), mix(h[2], h[3] ^ n));
}

/* ---- the store ---- */

/* Open (or create) the file, refuse another's data, lock it, size it, map it. */
static int file_open(kn_kv_tier *t)
{
    t->fd = open(t->path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (t->fd < 0) {
        TD_LOG_ERR("kv tier: cannot open %s: %s", t->path, strerror(errno));
        return errno == ENOSPC ? TD_ENOMEM : TD_EIO;
    }
    if (flock(t->fd, LOCK_EX | LOCK_NB)) {
        TD_LOG_ERR("kv tier: %s is in use by another process", t->path);
        return TD_ESTATE;
    }
    struct stat st;
    if (fstat(t->fd, &st)) return TD_EIO;
    if (!S_ISREG(st.st_mode)) {
        TD_LOG_ERR("kv tier: %s is not a regular file", t->path);
        return TD_EFORMAT;
    }
    uint64_t magic = 0;
    if (st.st_size > 0 &&
        (pread(t->fd, &magic, sizeof magic, 0) != (ssize_t)sizeof magic || magic != TIER_MAGIC)) {
        TD_LOG_ERR("kv tier: %s exists and is not a tier file (refusing to overwrite it)", t->path);
        return TD_EFORMAT;
    }
    /* a previous process's tier: its entries mean nothing here (serials are per process) */
    if (ftruncate(t->fd, 0)) return TD_EIO;
    int e = posix_fallocate(t->fd, 0, (off_t)t->total);
    if (e) {
        TD_LOG_ERR("kv tier: cannot reserve %zu bytes for %s: %s", t->total, t->path, strerror(e));
        return e == ENOSPC || e == EFBIG ? TD_ENOMEM : TD_EIO;
    }
    void *r = mmap(NULL, t->total, PROT_READ | PROT_WRITE, MAP_SHARED, t->fd, 0);
    if (r == MAP_FAILED) {
        TD_LOG_ERR("kv tier: cannot map %s: %s", t->path, strerror(errno));
        return TD_ENOMEM;
    }
    t->base = r;
    uint64_t hdr[4] = {TIER_MAGIC, TIER_VERSION, t->slot_bytes, (uint64_t)t->n_slots};
    memcpy(t->base, hdr, sizeof hdr);
    return 0;
}

/* Whether the store may be touched: a file must still be as long as the tier (a shorter
 * one would raise SIGBUS). */
static bool store_ok(kn_kv_tier *t)
{
    if (t->broken) return false;
    if (t->fd < 0) return true;
    struct stat st;
    if (fstat(t->fd, &st) == 0 && st.st_size >= (off_t)t->total) return true;
    TD_LOG_ERR("kv tier: %s shrank to %lld bytes (the tier needs %zu): the tier stops", t->path,
               (long long)st.st_size, t->total);
    t->broken = true;
    t->errors++;
    return false;
}

static uint8_t *slot_data(const kn_kv_tier *t, int slot)
{
    return t->base + HEADER_BYTES + (size_t)slot * t->slot_bytes;
}

int kn_kv_tier_create(const kn_kv_tier_params *p, const kn_kv_pool *pool, kn_kv_tier **out)
{
    *out = NULL;
    size_t sb = kn_kv_tier_block_bytes(pool);
    if (p->bytes < HEADER_BYTES + sb) {
        TD_LOG_ERR("kv tier: %zu bytes hold no block (one block takes %zu bytes, plus a %u-byte "
                   "header)",
                   p->bytes, sb, HEADER_BYTES);
        return TD_EINVAL;
    }
    size_t n = (p->bytes - HEADER_BYTES) / sb;
    if (n > INT32_MAX / 4) n = INT32_MAX / 4;
    if (p->slots < 0 || (size_t)p->slots > n) {
        TD_LOG_ERR("kv tier: %zu bytes hold %zu blocks of %zu bytes, not the %d asked for",
                   p->bytes, n, sb, p->slots);
        return TD_EINVAL;
    }
    if (p->slots) n = (size_t)p->slots;
    kn_kv_tier *t = calloc(1, sizeof *t);
    if (!t) return TD_ENOMEM;
    t->fd = -1;
    t->log = p->log;
    t->bs = pool->block_size;
    t->n_slots = (int)n;
    t->slot_bytes = sb;
    t->total = HEADER_BYTES + n * sb;
    size_t cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    t->mask = cap - 1;
    t->id = calloc(n, sizeof *t->id);
    t->serial = calloc(n, sizeof *t->serial);
    t->parent = calloc(n, sizeof *t->parent);
    t->sum = calloc(n, sizeof *t->sum);
    t->tok = malloc(n * (size_t)t->bs * sizeof *t->tok);
    t->lru.prev = malloc(n * sizeof *t->lru.prev);
    t->lru.next = malloc(n * sizeof *t->lru.next);
    t->free_slots = malloc(n * sizeof *t->free_slots);
    t->index = malloc(cap * sizeof *t->index);
    if (p->path) t->path = strdup(p->path);
    int rc = 0;
    if (!t->id || !t->serial || !t->parent || !t->sum || !t->tok || !t->lru.prev || !t->lru.next ||
        !t->free_slots || !t->index || (p->path && !t->path))
        rc = TD_ENOMEM;
    if (!rc && p->path) rc = file_open(t);
    if (!rc && !p->path) {
        void *r = mmap(NULL, t->total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (r == MAP_FAILED) {
            TD_LOG_ERR("kv tier: cannot allocate %zu bytes of host memory", t->total);
            rc = TD_ENOMEM;
        } else
            t->base = r;
    }
    if (rc) {
        kn_kv_tier_destroy(t);
        return rc;
    }
    kn_kv_tier_clear(t);
    *out = t;
    return 0;
}

void kn_kv_tier_destroy(kn_kv_tier *t)
{
    if (!t) return;
    if (t->base) munmap(t->base, t->total);
    if (t->fd >= 0) close(t->fd); /* drops the lock */
    free(t->path);
    free(t->id);
    free(t->serial);
    free(t->parent);
    free(t->sum);
    free(t->tok);
    free(t->lru.prev);
    free(t->lru.next);
    free(t->free_slots);
    free(t->index);
    free(t->ops);
    free(t);
}

void kn_kv_tier_clear(kn_kv_tier *t)
{
    memset(t->index, 0xff, (size_t)(t->mask + 1) * sizeof *t->index);
    memset(t->serial, 0, (size_t)t->n_slots * sizeof *t->serial);
    for (int i = 0; i < t->n_slots; i++)
        t->free_slots[i] = t->n_slots - 1 - i;
    t->n_free = t->n_slots;
    td_ilist_clear(&t->lru);
    t->n_ops = 0;
}

/* Record a copy (a TP leader's tier). false: no memory (the caller undoes the copy, so the
 * other ranks never need it). */
static bool log_op(kn_kv_tier *t, int32_t kind, int32_t slot, int32_t block)
{
    if (!t->log) return true;
    if (t->n_ops == t->cap_ops) {
        int cap = t->cap_ops ? 2 * t->cap_ops : 64;
        kn_kv_tier_op *v = realloc(t->ops, (size_t)cap * sizeof *v);
        if (!v) {
            TD_LOG_ERR("kv tier: no memory to record a copy for the other ranks");
            t->errors++;
            return false;
        }
        t->ops = v;
        t->cap_ops = cap;
    }
    t->ops[t->n_ops++] = (kn_kv_tier_op){.kind = kind, .slot = slot, .block = block};
    return true;
}

/* ---- index (linear probing by id, deletion by backward shift) and LRU ---- */

static uint64_t home_of(const kn_kv_tier *t, uint64_t id)
{
    return (id ^ (id >> 31)) & t->mask;
}

static int32_t index_find(const kn_kv_tier *t, uint64_t id)
{
    for (uint64_t i = home_of(t, id);; i = (i + 1) & t->mask) {
        int32_t s = t->index[i];
        if (s < 0 || t->id[s] == id) return s;
    }
}

static void index_add(kn_kv_tier *t, int32_t s)
{
    uint64_t i = home_of(t, t->id[s]);
    while (t->index[i] >= 0)
        i = (i + 1) & t->mask;
    t->index[i] = s;
}

static void index_del(kn_kv_tier *t, int32_t s)
{
    uint64_t i = home_of(t, t->id[s]);
    while (t->index[i] != s)
        i = (i + 1) & t->mask;
    for (uint64_t j = (i + 1) & t->mask; t->index[j] >= 0; j = (j + 1) & t->mask) {
        uint64_t h = home_of(t, t->id[t->index[j]]);
        bool stays = i <= j ? (h > i && h <= j) : (h > i || h <= j);
        if (stays) continue;
        t->index[i] = t->index[j];
        i = j;
    }
    t->index[i] = -1;
}

static void entry_drop(kn_kv_tier *t, int32_t s)
{
    index_del(t, s);
    td_ilist_unlink(&t->lru, s);
    t->serial[s] = 0;
    t->free_slots[t->n_free++] = s;
}

/* ---- copies between a pool block and a slot ---- */

/* A device pool with host staging (kv_pool.h) holds a block's newest KV in its host copy
 * while on_dev is 0 (received, not uploaded yet): the copy out reads it there; a copy in
 * writes the device copy and marks it current, so the engine does not upload the older host
 * copy over it. A slot holds the block of each layer array in region order (each layer's K
 * and V, or its latent array once: kn_kv_pool_array) with its heads in order, whatever the
 * pool's slicing (a sliced pool's block is copied piece by piece, kn_kv_block_piece). */
static int copy_out(const kn_kv_pool *pool, int32_t block, uint8_t *dst)
{
    size_t bb = pool->block_bytes;
    bool host = !pool->dev.ops || (pool->host && !pool->on_dev[block]);
    for (int a = 0; a < kn_kv_pool_arrays(pool) * pool->n_layers; a++)
        for (int s = 0; s < pool->slicing.n_slices; s++) { /* the block's heads in order */
            int h0;
            size_t n, off = kn_kv_block_piece(pool, block, s, &h0, &n);
            const uint8_t *src = (const uint8_t *)kn_kv_pool_array(pool, a) + off;
            uint8_t *d = dst + (size_t)a * bb + (size_t)h0 * (bb / pool->n_kv_heads);
            if (pool->dev.ops && host) /* the staging copy: the same offset */
                memcpy(d, (const uint8_t *)pool->host + (src - (const uint8_t *)pool->region), n);
            else if (!pool->dev.ops)
                memcpy(d, src, n);
            else if (pool->dev.ops->download(pool->dev.ctx, d, src, n))
                return TD_EIO;
        }
    return 0;
}

static int copy_in(kn_kv_pool *pool, int32_t block, const uint8_t *src)
{
    size_t bb = pool->block_bytes;
    for (int a = 0; a < kn_kv_pool_arrays(pool) * pool->n_layers; a++)
        for (int s = 0; s < pool->slicing.n_slices; s++) {
            int h0;
            size_t n, off = kn_kv_block_piece(pool, block, s, &h0, &n);
            uint8_t *d = (uint8_t *)kn_kv_pool_array(pool, a) + off;
            const uint8_t *sp = src + (size_t)a * bb + (size_t)h0 * (bb / pool->n_kv_heads);
            if (!pool->dev.ops)
                memcpy(d, sp, n);
            else if (pool->dev.ops->upload(pool->dev.ctx, d, sp, n))
                return TD_EIO;
        }
    if (pool->host) pool->on_dev[block] = 1;
    return 0;
}

int kn_kv_tier_put(kn_kv_tier *t, const kn_kv_pool *pool, int32_t block, uint64_t id,
                   uint64_t serial, uint64_t parent, const int32_t *tokens)
{
    if (!store_ok(t)) return TD_EIO;
    int32_t s = index_find(t, id);
    if (s >= 0 && t->serial[s] == serial) { /* the same entry came back and left again */
        td_ilist_unlink(&t->lru, s);
        td_ilist_append(&t->lru, s);
        return 0;
    }
    if (s >= 0) entry_drop(t, s); /* the same id under another prefix: the newer wins */
    if (!t->n_free) {
        entry_drop(t, t->lru.head);
        t->dropped++;
    }
    s = t->free_slots[--t->n_free];
    uint8_t *d = slot_data(t, s);
    if (copy_out(pool, block, d)) {
        TD_LOG_ERR("kv tier: copying block %d out of the pool failed", block);
        t->free_slots[t->n_free++] = s;
        t->errors++;
        return TD_EIO;
    }
    t->id[s] = id;
    t->serial[s] = serial;
    t->parent[s] = parent;
    t->sum[s] = checksum(d, t->slot_bytes);
    memcpy(t->tok + (size_t)s * (size_t)t->bs, tokens, (size_t)t->bs * sizeof *tokens);
    index_add(t, s);
    td_ilist_append(&t->lru, s);
    if (!log_op(t, KN_KV_TIER_OP_PUT, s, block)) {
        entry_drop(t, s); /* the other ranks would not have it */
        return TD_ENOMEM;
    }
    t->writes++;
    return 0;
}

int kn_kv_tier_find(const kn_kv_tier *t, uint64_t id, uint64_t parent, const int32_t *tokens,
                    uint64_t *serial)
{
    if (t->broken) return -1;
    int32_t s = index_find(t, id);
    if (s < 0 || t->parent[s] != parent ||
        memcmp(t->tok + (size_t)s * (size_t)t->bs, tokens, (size_t)t->bs * sizeof *tokens))
        return -1;
    *serial = t->serial[s];
    return s;
}

int kn_kv_tier_get(kn_kv_tier *t, int slot, kn_kv_pool *pool, int32_t block)
{
    if (slot < 0 || slot >= t->n_slots || !t->serial[slot]) return TD_ENOENT;
    if (!store_ok(t)) return TD_EIO;
    const uint8_t *d = slot_data(t, slot);
    if (checksum(d, t->slot_bytes) != t->sum[slot]) {
        TD_LOG_ERR("kv tier: slot %d (block id %016llx) of %s is corrupt: dropped", slot,
                   (unsigned long long)t->id[slot], t->path ? t->path : "host memory");
        entry_drop(t, slot);
        t->errors++;
        return TD_EFORMAT;
    }
    if (copy_in(pool, block, d)) {
        TD_LOG_ERR("kv tier: copying slot %d into pool block %d failed: the tier stops", slot,
                   block);
        t->broken = true;
        t->errors++;
        return TD_EIO;
    }
    if (!log_op(t, KN_KV_TIER_OP_GET, slot, block))
        return TD_ENOMEM; /* the block is the caller's */
    td_ilist_unlink(&t->lru, slot);
    td_ilist_append(&t->lru, slot);
    t->reads++;
    return 0;
}

kn_kv_tier_stats kn_kv_tier_get_stats(const kn_kv_tier *t)
{
    return (kn_kv_tier_stats){.slots = t->n_slots,
                              .used = t->n_slots - t->n_free,
                              .writes = t->writes,
                              .reads = t->reads,
                              .dropped = t->dropped,
                              .errors = t->errors};
}

const kn_kv_tier_op *kn_kv_tier_ops(const kn_kv_tier *t, int *n)
{
    *n = t->n_ops;
    return t->ops;
}

void kn_kv_tier_ops_clear(kn_kv_tier *t)
{
    t->n_ops = 0;
}

/* A follower's slot s holds data when serial[s] is non-zero (it has no index: the leader's
 * tier decides which slot holds what). */
int kn_kv_tier_apply(kn_kv_tier *t, kn_kv_pool *pool, const kn_kv_tier_op *op)
{
    if (op->slot < 0 || op->slot >= t->n_slots || op->block < 0 || op->block >= pool->n_blocks ||
        (op->kind != KN_KV_TIER_OP_PUT && op->kind != KN_KV_TIER_OP_GET)) {
        TD_LOG_ERR("kv tier: copy op (kind %d, slot %d, block %d) out of range (%d slots, %d "
                   "blocks)",
                   op->kind, op->slot, op->block, t->n_slots, pool->n_blocks);
        return TD_EINVAL;
    }
    if (!store_ok(t)) return TD_EIO;
    uint8_t *d = slot_data(t, op->slot);
    if (op->kind == KN_KV_TIER_OP_PUT) {
        t->serial[op->slot] = 0;
        if (copy_out(pool, op->block, d)) {
            TD_LOG_ERR("kv tier: copying block %d out of the pool failed", op->block);
            t->errors++;
            return TD_EIO;
        }
        t->sum[op->slot] = checksum(d, t->slot_bytes);
        t->serial[op->slot] = 1;
        t->writes++;
        return 0;
    }
    if (!t->serial[op->slot]) {
        TD_LOG_ERR("kv tier: slot %d was never written here (the leader's tier holds it)",
                   op->slot);
        t->errors++;
        return TD_ENOENT;
    }
    if (checksum(d, t->slot_bytes) != t->sum[op->slot]) {
        TD_LOG_ERR("kv tier: slot %d of %s is corrupt", op->slot,
                   t->path ? t->path : "host memory");
        t->serial[op->slot] = 0;
        t->errors++;
        return TD_EFORMAT;
    }
    if (copy_in(pool, op->block, d)) {
        TD_LOG_ERR("kv tier: copying slot %d into pool block %d failed: the tier stops", op->slot,
                   op->block);
        t->broken = true;
        t->errors++;
        return TD_EIO;
    }
    t->reads++;
    return 0;
}
