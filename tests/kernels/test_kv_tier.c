/* test_kv_tier.c: the prefix cache's second tier (kvmem/kv_tier.h): bit-exact round trips
 * (file and host memory), its LRU, a full tier, refused and broken files (a foreign file, a
 * locked one, a corrupt slot, a file truncated under the tier: errors, never a crash), and
 * the cache with a tier attached (a kn_kv_mem with both added: evicted blocks come back by a
 * match, under a budget), and tensor parallelism (a follower rank, a kn_kv_mem with a tier and
 * no cache, repeats the leader tier's logged copies exactly). */
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../tharness.h"
#include "cpu_dev.h"
#include "kn_backends.h"
#include "kv_mem.h"
#include "td_blockhash.h"
#include "td_err.h"

#define BS 4

static char dir[] = "/tmp/tandem-kvtier-XXXXXX";

static kn_kv_pool_params params_heads(int n_blocks, int n_kv_heads)
{
    return (kn_kv_pool_params){.n_layers = 2,
                               .n_kv_heads = n_kv_heads,
                               .head_dim = 4,
                               .block_size = BS,
                               .n_blocks = n_blocks,
                               .type = TD_F32};
}

static kn_kv_pool *pool_heads(int n_blocks, int n_kv_heads)
{
    kn_kv_pool_params p = params_heads(n_blocks, n_kv_heads);
    kn_kv_pool *pool = NULL;
    return kn_kv_pool_create(&p, &pool) ? NULL : pool;
}

/* A KV memory of n_blocks blocks of n_kv_heads heads each. */
static kn_kv_mem *mem_heads(int n_blocks, int n_kv_heads)
{
    kn_kv_pool_params p = params_heads(n_blocks, n_kv_heads);
    kn_kv_mem *m = NULL;
    return kn_kv_mem_create(&p, &m) ? NULL : m;
}

static kn_kv_pool *pool_of(int n_blocks)
{
    return pool_heads(n_blocks, 2);
}

/* Fill block b of every layer's K and V with values derived from seed. */
static void fill(kn_kv_pool *pool, int32_t b, unsigned seed)
{
    for (int l = 0; l < pool->n_layers; l++) {
        float *k = (float *)((char *)pool->k[l] + (size_t)b * pool->block_bytes);
        float *v = (float *)((char *)pool->v[l] + (size_t)b * pool->block_bytes);
        for (size_t i = 0; i < pool->block_bytes / 4; i++) {
            seed = seed * 1103515245u + 12345u;
            k[i] = (float)(seed >> 8) / 7.0f;
            v[i] = -(float)(seed >> 9) / 3.0f;
        }
    }
}

static bool same(const kn_kv_pool *pool, int32_t a, int32_t b)
{
    for (int l = 0; l < pool->n_layers; l++)
        if (memcmp((char *)pool->k[l] + (size_t)a * pool->block_bytes,
                   (char *)pool->k[l] + (size_t)b * pool->block_bytes, pool->block_bytes) ||
            memcmp((char *)pool->v[l] + (size_t)a * pool->block_bytes,
                   (char *)pool->v[l] + (size_t)b * pool->block_bytes, pool->block_bytes))
            return false;
    return true;
}

static kn_kv_tier_params tier_params(const kn_kv_pool *pool, const char *path, int slots)
{
    return (kn_kv_tier_params){.path = path,
                               .bytes = 4096 + (size_t)slots * kn_kv_tier_block_bytes(pool)};
}

static kn_kv_tier *tier_of(const kn_kv_pool *pool, const char *path, int slots)
{
    kn_kv_tier_params p = tier_params(pool, path, slots);
    kn_kv_tier *t = NULL;
    return kn_kv_tier_create(&p, pool, &t) ? NULL : t;
}

/* m's tier (added: slots blocks in path or host memory), or NULL. */
static kn_kv_tier *add_tier(kn_kv_mem *m, const char *path, int slots)
{
    kn_kv_tier_params p = tier_params(kn_kv_mem_pool(m), path, slots);
    return kn_kv_mem_add_tier(m, &p) ? NULL : kn_kv_mem_tier(m);
}

static void test_round_trip(const char *path)
{
    kn_kv_pool *pool = pool_of(4);
    kn_kv_tier *t = tier_of(pool, path, 2);
    TH_REQUIRE(pool && t && kn_kv_tier_get_stats(t).slots == 2);
    int32_t tok[BS] = {1, 2, 3, 4}, other[BS] = {1, 2, 3, 5};
    fill(pool, 0, 7);
    TH_CHECK(kn_kv_tier_put(t, pool, 0, 42, 5, 1, tok) == 0);
    uint64_t serial = 0;
    int slot = kn_kv_tier_find(t, 42, 1, tok, &serial);
    TH_CHECK(slot >= 0 && serial == 5);
    TH_CHECK(kn_kv_tier_find(t, 42, 2, tok, &serial) < 0);   /* another parent */
    TH_CHECK(kn_kv_tier_find(t, 42, 1, other, &serial) < 0); /* other tokens: a collision */
    TH_CHECK(kn_kv_tier_find(t, 43, 1, tok, &serial) < 0);
    fill(pool, 1, 99);
    TH_CHECK(!same(pool, 0, 1));
    TH_CHECK(kn_kv_tier_get(t, slot, pool, 1) == 0);
    TH_CHECK(same(pool, 0, 1)); /* bit-exact */
    /* the same entry leaving the pool again costs no write */
    TH_CHECK(kn_kv_tier_put(t, pool, 1, 42, 5, 1, tok) == 0);
    kn_kv_tier_stats st = kn_kv_tier_get_stats(t);
    TH_CHECK(st.writes == 1 && st.reads == 1 && st.used == 1 && st.errors == 0);
    kn_kv_tier_destroy(t);
    kn_kv_pool_destroy(pool);
}

static const char *round_trip_path;
static void test_round_trip_file(void)
{
    test_round_trip(round_trip_path);
}
static void test_round_trip_memory(void)
{
    test_round_trip(NULL);
}

static void test_lru_and_full(void)
{
    kn_kv_pool *pool = pool_of(4);
    kn_kv_tier *t = tier_of(pool, NULL, 3);
    TH_REQUIRE(pool && t);
    int32_t tok[BS] = {1, 2, 3, 4};
    uint64_t s;
    for (int i = 0; i < 3; i++) {
        fill(pool, i, (unsigned)i);
        TH_CHECK(kn_kv_tier_put(t, pool, i, 100 + (uint64_t)i, 10 + (uint64_t)i, 1, tok) == 0);
    }
    /* touch entry 100 by reading it: 101 is now the least recently used */
    TH_CHECK(kn_kv_tier_get(t, kn_kv_tier_find(t, 100, 1, tok, &s), pool, 3) == 0);
    TH_CHECK(kn_kv_tier_put(t, pool, 3, 103, 13, 1, tok) == 0); /* full: drops 101 */
    TH_CHECK(kn_kv_tier_find(t, 101, 1, tok, &s) < 0);
    TH_CHECK(kn_kv_tier_find(t, 100, 1, tok, &s) >= 0 && kn_kv_tier_find(t, 102, 1, tok, &s) >= 0);
    /* a put touches too: 102 goes next, after 100 was touched */
    TH_CHECK(kn_kv_tier_put(t, pool, 0, 104, 14, 1, tok) == 0);
    TH_CHECK(kn_kv_tier_find(t, 102, 1, tok, &s) < 0 && kn_kv_tier_find(t, 100, 1, tok, &s) >= 0);
    /* the same id under a new serial replaces the old entry (no drop counted) */
    TH_CHECK(kn_kv_tier_put(t, pool, 1, 100, 20, 1, tok) == 0);
    TH_CHECK(kn_kv_tier_find(t, 100, 1, tok, &s) >= 0 && s == 20);
    kn_kv_tier_stats st = kn_kv_tier_get_stats(t);
    TH_CHECK(st.used == 3 && st.dropped == 2 && st.writes == 6);
    kn_kv_tier_clear(t);
    TH_CHECK(kn_kv_tier_get_stats(t).used == 0 && kn_kv_tier_find(t, 100, 1, tok, &s) < 0);
    kn_kv_tier_destroy(t);
    kn_kv_pool_destroy(pool);
}

static void test_bad_files(void)
{
    kn_kv_pool *pool = pool_of(4);
    TH_REQUIRE(pool);
    char path[128];
    snprintf(path, sizeof path, "%s/foreign", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    TH_REQUIRE(fd >= 0 && write(fd, "not a tier file", 15) == 15);
    close(fd);
    kn_kv_tier *t = NULL;
    kn_kv_tier_params p = {.path = path, .bytes = 1 << 20};
    TH_CHECK(kn_kv_tier_create(&p, pool, &t) == TD_EFORMAT && !t);
    p.bytes = 4096 + kn_kv_tier_block_bytes(pool) - 1; /* no block fits */
    snprintf(path, sizeof path, "%s/tier", dir);
    TH_CHECK(kn_kv_tier_create(&p, pool, &t) == TD_EINVAL && !t);
    t = tier_of(pool, path, 2);
    TH_REQUIRE(t);
    kn_kv_tier *t2 = tier_of(pool, path, 2); /* locked by t */
    TH_CHECK(!t2);
    int32_t tok[BS] = {1, 2, 3, 4};
    uint64_t s;
    fill(pool, 0, 3);
    TH_CHECK(kn_kv_tier_put(t, pool, 0, 7, 9, 1, tok) == 0);
    TH_CHECK(kn_kv_tier_put(t, pool, 0, 8, 10, 1, tok) == 0);
    /* someone writes into the file: the slot is corrupt, an error and a miss after */
    fd = open(path, O_RDWR);
    TH_REQUIRE(fd >= 0 && pwrite(fd, "garbage!", 8, 4096 + 16) == 8);
    int slot7 = kn_kv_tier_find(t, 7, 1, tok, &s), slot8 = kn_kv_tier_find(t, 8, 1, tok, &s);
    TH_CHECK(slot7 == 0 && slot8 == 1); /* slots are taken from 0 up */
    TH_CHECK(kn_kv_tier_get(t, slot7, pool, 1) == TD_EFORMAT);
    TH_CHECK(kn_kv_tier_find(t, 7, 1, tok, &s) < 0);
    TH_CHECK(kn_kv_tier_get(t, slot8, pool, 1) == 0);
    TH_CHECK(kn_kv_tier_get_stats(t).errors == 1 && kn_kv_tier_get_stats(t).used == 1);
    /* the file shrinks under the tier: an error, not a SIGBUS; the tier stops */
    TH_REQUIRE(ftruncate(fd, 100) == 0);
    close(fd);
    TH_CHECK(kn_kv_tier_get(t, slot8, pool, 1) == TD_EIO);
    TH_CHECK(kn_kv_tier_put(t, pool, 0, 11, 12, 1, tok) == TD_EIO);
    TH_CHECK(kn_kv_tier_find(t, 8, 1, tok, &s) < 0);
    kn_kv_tier_destroy(t);
    /* the tier file of a gone process is a tier file: reused */
    t = tier_of(pool, path, 3);
    TH_CHECK(t && kn_kv_tier_get_stats(t).used == 0);
    kn_kv_tier_destroy(t);
    kn_kv_pool_destroy(pool);
}

/* The cache with a tier: a sequence's blocks evicted from a small pool come back bit-exact
 * by a match, within the copy budget; the restored entries keep their serials, so a child
 * that stayed in the pool still follows them. */
static void test_cache_with_tier(void)
{
    kn_kv_mem *mem = mem_heads(4, 2);
    TH_REQUIRE(mem && kn_kv_mem_add_cache(mem) == 0);
    kn_kv_pool *pool = kn_kv_mem_pool(mem);
    kn_kv_cache *c = kn_kv_mem_cache(mem);
    kn_kv_tier *t = add_tier(mem, NULL, 8); /* added after the cache: attached to it */
    TH_REQUIRE(t && kn_kv_cache_tier(c) == t);
    TH_CHECK(kn_kv_mem_add_tier(mem, &(kn_kv_tier_params){.bytes = 1 << 20}) == TD_ESTATE);
    int32_t tok[3 * BS] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    kn_kv_seq a;
    kn_kv_seq_init(&a);
    TH_REQUIRE(kn_kv_seq_reserve(mem, &a, 3 * BS) == 0);
    kn_kv_chain ch = kn_kv_cache_root();
    for (int b = 0; b < 3; b++) {
        fill(pool, a.blocks[b], 50u + (unsigned)b);
        kn_kv_cache_insert(c, &ch, tok + b * BS, a.blocks[b]);
    }
    kn_kv_seq_fini(mem, &a); /* idle: block 2 least recently, then 1, then 0 */
    /* take the whole pool: every idle block is evicted into the tier */
    int32_t all[4];
    TH_REQUIRE(kn_kv_alloc(mem, 4, all) == 0);
    TH_CHECK(kn_kv_tier_get_stats(t).writes == 3 && kn_kv_cache_get_stats(c).cached == 0);
    /* remember what the blocks held, then overwrite them */
    kn_kv_pool *ref = pool_of(4);
    TH_REQUIRE(ref);
    for (int b = 0; b < 3; b++)
        fill(ref, b, 50u + (unsigned)b);
    for (int b = 0; b < 4; b++)
        fill(pool, all[b], 1000u + (unsigned)b);
    kn_kv_free(mem, 4, all);
    /* budget 2 of 3: two blocks come back, the match says there is more */
    int32_t got[3];
    kn_kv_tier_budget tb = {.copies_left = 2};
    int m = kn_kv_cache_match_tier(c, tok, 3 * BS, 3, got, &ch, &tb);
    TH_CHECK(m == 2 && tb.copied == 2 && tb.more && tb.copies_left == 0);
    TH_CHECK(kn_kv_tier_get_stats(t).reads == 2);
    for (int b = 0; b < m; b++)
        for (int l = 0; l < pool->n_layers; l++)
            TH_CHECK(!memcmp((char *)pool->k[l] + (size_t)got[b] * pool->block_bytes,
                             (char *)ref->k[l] + (size_t)b * ref->block_bytes, pool->block_bytes) &&
                     !memcmp((char *)pool->v[l] + (size_t)got[b] * pool->block_bytes,
                             (char *)ref->v[l] + (size_t)b * ref->block_bytes, pool->block_bytes));
    TH_CHECK(kn_kv_cache_claim_restored(c, got, m) == 2 &&
             kn_kv_cache_claim_restored(c, got, m) == 0);
    kn_kv_free(mem, m, got);
    /* next time: two from the pool, the third from the tier, nothing more */
    tb = (kn_kv_tier_budget){.copies_left = 4};
    m = kn_kv_cache_match_tier(c, tok, 3 * BS, 3, got, &ch, &tb);
    TH_CHECK(m == 3 && tb.copied == 1 && !tb.more);
    for (int l = 0; l < pool->n_layers; l++)
        TH_CHECK(!memcmp((char *)pool->k[l] + (size_t)got[2] * pool->block_bytes,
                         (char *)ref->k[l] + 2 * ref->block_bytes, pool->block_bytes));
    /* without a budget the match is the pool's only */
    int32_t g2[3];
    kn_kv_chain ch2;
    TH_CHECK(kn_kv_cache_match(c, tok, 3 * BS, 3, g2, &ch2) == 3 && ch2.serial == ch.serial);
    kn_kv_free(mem, 3, g2);
    kn_kv_free(mem, m, got);
    kn_kv_pool_destroy(ref);
    kn_kv_mem_destroy(mem); /* the cache, the tier and the pool */
}

/* Whether block b of every layer holds what fill(pool, b, seed) wrote. */
static bool holds(const kn_kv_pool *pool, int32_t b, unsigned seed)
{
    for (int l = 0; l < pool->n_layers; l++) {
        const float *k = (const float *)((char *)pool->k[l] + (size_t)b * pool->block_bytes);
        const float *v = (const float *)((char *)pool->v[l] + (size_t)b * pool->block_bytes);
        for (size_t i = 0; i < pool->block_bytes / 4; i++) {
            seed = seed * 1103515245u + 12345u;
            if (k[i] != (float)(seed >> 8) / 7.0f || v[i] != -(float)(seed >> 9) / 3.0f)
                return false;
        }
    }
    return true;
}

/* Tensor parallelism: rank 0's cache and logging tier decide; rank 1 (another number of KV
 * heads, so other slot bytes, the same slot count) repeats the logged copies on its own pool
 * and tier before each "step" computes. Many sequences through a 4-block pool and a 3-slot
 * tier (evictions, LRU drops, restores): every block a match hands out holds on each rank
 * exactly that rank's KV of that entry. */
static void test_tp_replay(void)
{
    enum { NSEQ = 5, NB = 2 };
    /* rank 0: the leader's memory, its tier added before its cache; rank 1: a tier only */
    kn_kv_mem *m0 = mem_heads(4, 2), *m1 = mem_heads(4, 1);
    TH_REQUIRE(m0 && m1);
    kn_kv_pool *p0 = kn_kv_mem_pool(m0), *p1 = kn_kv_mem_pool(m1);
    char path0[128], path1[128];
    snprintf(path0, sizeof path0, "%s/tp.r0", dir);
    snprintf(path1, sizeof path1, "%s/tp.r1", dir);
    size_t big = kn_kv_tier_block_bytes(p0);
    kn_kv_tier_params tp0 = {.path = path0, .bytes = 4096 + 3 * big, .slots = 3, .log = true};
    kn_kv_tier_params tp1 = {.path = path1, .bytes = 4096 + 3 * big, .slots = 3};
    TH_REQUIRE(kn_kv_mem_add_tier(m0, &tp0) == 0 && kn_kv_mem_add_tier(m1, &tp1) == 0);
    TH_REQUIRE(kn_kv_mem_add_cache(m0) == 0);
    kn_kv_cache *c = kn_kv_mem_cache(m0);
    kn_kv_tier *t0 = kn_kv_mem_tier(m0), *t1 = kn_kv_mem_tier(m1);
    TH_CHECK(kn_kv_cache_tier(c) == t0 && !kn_kv_mem_cache(m1)); /* the cache found the tier */
    TH_CHECK(kn_kv_tier_get_stats(t1).slots == 3); /* not the 6 its bytes would hold */
    unsigned rnd = 12345;
    int hits = 0, restored = 0;
    for (int it = 0; it < 200; it++) {
        rnd = rnd * 1103515245u + 12345u;
        int q = (int)(rnd >> 16) % NSEQ;
        int32_t tok[NB * BS], blocks[NB];
        for (int j = 0; j < NB * BS; j++)
            tok[j] = 100 * q + j;
        kn_kv_tier_budget tb = {.copies_left = NB};
        kn_kv_chain ch;
        int m = kn_kv_cache_match_tier(c, tok, NB * BS, NB, blocks, &ch, &tb);
        bool ok = kn_kv_alloc(m0, NB - m, blocks + m) == 0;
        TH_CHECK(ok);
        if (!ok) break;
        /* the step plan: rank 1 makes rank 0's copies first */
        int n_ops;
        const kn_kv_tier_op *ops = kn_kv_tier_ops(t0, &n_ops);
        for (int i = 0; i < n_ops; i++)
            TH_CHECK(kn_kv_tier_apply(t1, p1, &ops[i]) == 0);
        kn_kv_tier_ops_clear(t0);
        hits += m;
        restored += tb.copied;
        for (int b = 0; b < m; b++) { /* what it matched is each rank's KV of that block */
            unsigned seed = 1000u * (unsigned)q + 10u * (unsigned)b;
            TH_CHECK(holds(p0, blocks[b], seed) && holds(p1, blocks[b], seed + 1));
        }
        for (int b = m; b < NB; b++) { /* "compute" the rest on both ranks, enter it */
            unsigned seed = 1000u * (unsigned)q + 10u * (unsigned)b;
            fill(p0, blocks[b], seed);
            fill(p1, blocks[b], seed + 1);
            kn_kv_cache_insert(c, &ch, tok + b * BS, blocks[b]);
        }
        kn_kv_free(m0, NB, blocks);
    }
    kn_kv_tier_stats s0 = kn_kv_tier_get_stats(t0), s1 = kn_kv_tier_get_stats(t1);
    TH_CHECK(restored > 20 && hits > restored && s0.dropped > 0);
    TH_CHECK(s1.writes == s0.writes && s1.reads == s0.reads && s0.errors == 0 && s1.errors == 0);
    /* a follower refuses what it cannot do exactly: never-written, out of range, corrupt */
    kn_kv_tier_clear(t1);
    kn_kv_tier_op get0 = {KN_KV_TIER_OP_GET, 0, 1}, put0 = {KN_KV_TIER_OP_PUT, 0, 1};
    TH_CHECK(kn_kv_tier_apply(t1, p1, &get0) == TD_ENOENT);
    TH_CHECK(kn_kv_tier_apply(t1, p1, &(kn_kv_tier_op){KN_KV_TIER_OP_GET, 3, 1}) == TD_EINVAL);
    TH_CHECK(kn_kv_tier_apply(t1, p1, &(kn_kv_tier_op){KN_KV_TIER_OP_PUT, 0, 4}) == TD_EINVAL);
    TH_CHECK(kn_kv_tier_apply(t1, p1, &(kn_kv_tier_op){7, 0, 1}) == TD_EINVAL);
    fill(p1, 1, 77);
    TH_CHECK(kn_kv_tier_apply(t1, p1, &put0) == 0);
    fill(p1, 2, 78);
    TH_CHECK(kn_kv_tier_apply(t1, p1, &(kn_kv_tier_op){KN_KV_TIER_OP_GET, 0, 2}) == 0 &&
             holds(p1, 2, 77));
    int fd = open(path1, O_RDWR);
    TH_REQUIRE(fd >= 0 && pwrite(fd, "garbage!", 8, 4096 + 8) == 8);
    close(fd);
    TH_CHECK(kn_kv_tier_apply(t1, p1, &get0) == TD_EFORMAT);
    TH_CHECK(kn_kv_tier_apply(t1, p1, &get0) == TD_ENOENT); /* dropped */
    /* a put that only touches an entry copies nothing: nothing to repeat */
    kn_kv_tier_ops_clear(t0);
    int32_t tk[BS] = {9, 9, 9, 9};
    TH_CHECK(kn_kv_tier_put(t0, p0, 0, 555, 99, 1, tk) == 0);
    TH_CHECK(kn_kv_tier_put(t0, p0, 1, 555, 99, 1, tk) == 0);
    int n_ops;
    const kn_kv_tier_op *ops = kn_kv_tier_ops(t0, &n_ops);
    TH_CHECK(n_ops == 1 && ops[0].kind == KN_KV_TIER_OP_PUT && ops[0].block == 0);
    kn_kv_tier_clear(t0);
    TH_CHECK((kn_kv_tier_ops(t0, &n_ops), n_ops == 0));
    kn_kv_mem_destroy(m0);
    kn_kv_mem_destroy(m1);
}

/* Copy host pool h's block hb to device pool d's block db (every layer's K and V), or back. */
static bool dev_copy(const kn_backend *be, kn_kv_pool *d, int32_t db, kn_kv_pool *h, int32_t hb,
                     bool up)
{
    for (int l = 0; l < d->n_layers; l++)
        for (int kv = 0; kv < 2; kv++) {
            char *dp = (char *)(kv ? d->v[l] : d->k[l]) + (size_t)db * d->block_bytes;
            char *hp = (char *)(kv ? h->v[l] : h->k[l]) + (size_t)hb * h->block_bytes;
            if (up ? be->ops->upload(be->ctx, dp, hp, d->block_bytes)
                   : be->ops->download(be->ctx, hp, dp, d->block_bytes))
                return false;
        }
    return true;
}

/* A pool in device memory (backend cpu-dev: the CPU kernels behind a device backend's
 * contract, which counts any host pointer handed to it as a violation): blocks go to the
 * tier (file or host memory) through the backend's download and come back through its
 * upload, bit-exact, with no violation; a TP follower's replay works the same way. */
static void test_device_pool(const char *path)
{
    kn_backend be;
    TH_REQUIRE(kn_backend_create("cpu-dev", &(kn_backend_options){.n_threads = 1}, &be) == 0);
    TH_REQUIRE(!be.ops->host_memory);
    kn_kv_pool_params pp = {.n_layers = 2,
                            .n_kv_heads = 2,
                            .head_dim = 4,
                            .block_size = BS,
                            .n_blocks = 4,
                            .type = TD_F32,
                            .backend = &be};
    kn_kv_pool *d = NULL, *d1 = NULL, *h = pool_of(4);
    TH_REQUIRE(kn_kv_pool_create(&pp, &d) == 0 && kn_kv_pool_create(&pp, &d1) == 0 && h);
    TH_REQUIRE(d->dev.ops && !d->host);
    kn_cpudev_stats st0, st;
    TH_REQUIRE(kn_cpudev_stats_of(be, &st0) == 0);
    kn_kv_tier_params tp = {
        .path = path, .bytes = 4096 + 2 * kn_kv_tier_block_bytes(d), .log = true};
    kn_kv_tier *t = NULL, *t1 = NULL;
    kn_kv_tier_params tp1 = {.path = NULL, .bytes = tp.bytes};
    TH_REQUIRE(kn_kv_tier_create(&tp, d, &t) == 0 && kn_kv_tier_create(&tp1, d1, &t1) == 0);
    int32_t tok[BS] = {1, 2, 3, 4};
    fill(h, 0, 7);
    fill(h, 1, 99);
    TH_CHECK(dev_copy(&be, d, 2, h, 0, true) && dev_copy(&be, d, 3, h, 1, true));
    TH_CHECK(dev_copy(&be, d1, 2, h, 1, true)); /* rank 1's KV of the block: other values */
    TH_CHECK(kn_kv_tier_put(t, d, 2, 42, 5, 1, tok) == 0);
    uint64_t serial;
    int slot = kn_kv_tier_find(t, 42, 1, tok, &serial);
    TH_CHECK(slot >= 0 && kn_kv_tier_get(t, slot, d, 3) == 0);
    fill(h, 2, 1234);
    TH_CHECK(dev_copy(&be, d, 3, h, 2, false) && holds(h, 2, 7)); /* bit-exact, via download */
    /* rank 1 repeats the copies: its block 2 goes to its slot, comes back into its block 3 */
    int n_ops;
    const kn_kv_tier_op *ops = kn_kv_tier_ops(t, &n_ops);
    TH_CHECK(n_ops == 2);
    for (int i = 0; i < n_ops; i++)
        TH_CHECK(kn_kv_tier_apply(t1, d1, &ops[i]) == 0);
    TH_CHECK(dev_copy(&be, d1, 3, h, 2, false) && holds(h, 2, 99));
    TH_REQUIRE(kn_cpudev_stats_of(be, &st) == 0);
    TH_CHECKF(st.n_violations == 0, "%lld violations; first: %s", (long long)st.n_violations,
              st.first);
    size_t blk = kn_kv_tier_block_bytes(d);
    /* two puts downloaded a block each, two gets uploaded one, plus the test's own copies */
    TH_CHECK(st.bytes_download - st0.bytes_download == 2 * blk + 2 * blk);
    TH_CHECK(st.bytes_upload - st0.bytes_upload == 2 * blk + 3 * blk);
    kn_kv_tier_destroy(t);
    kn_kv_tier_destroy(t1);
    kn_kv_pool_destroy(d);
    kn_kv_pool_destroy(d1);
    kn_kv_pool_destroy(h);
    kn_backend_destroy(&be);
}

/* A staged device pool (kvxfer's KV lands in its host copy, kv_pool.h): a block whose newest
 * KV is in the host copy (on_dev 0) goes to the tier from there, and a block copied back is
 * marked current on the device, so the engine's upload does not put the stale host copy over
 * it. */
static void test_staged_device_pool(void)
{
    kn_backend be;
    TH_REQUIRE(kn_backend_create("cpu-dev", &(kn_backend_options){.n_threads = 1}, &be) == 0);
    kn_kv_pool_params pp = {.n_layers = 2,
                            .n_kv_heads = 2,
                            .head_dim = 4,
                            .block_size = BS,
                            .n_blocks = 4,
                            .type = TD_F32,
                            .backend = &be,
                            .host_stage = true};
    kn_kv_mem *dm = NULL;
    kn_kv_pool *h = pool_of(4);
    TH_REQUIRE(kn_kv_mem_create(&pp, &dm) == 0 && h);
    kn_kv_pool *d = kn_kv_mem_pool(dm);
    TH_REQUIRE(d->host && d->on_dev);
    kn_kv_tier *t = add_tier(dm, NULL, 2);
    TH_REQUIRE(t);
    int32_t ids[2], tok[BS] = {1, 2, 3, 4};
    TH_REQUIRE(kn_kv_alloc(dm, 2, ids) == 0 && !d->on_dev[ids[0]] && !d->on_dev[ids[1]]);
    /* block ids[0]: KV received into the host copy (the device copy is older) */
    fill(h, 0, 5);
    fill(h, 1, 6);
    TH_CHECK(dev_copy(&be, d, ids[0], h, 1, true)); /* the device copy: other values */
    d->on_dev[ids[0]] = 0;
    for (int l = 0; l < d->n_layers; l++) {
        size_t off = (size_t)ids[0] * d->block_bytes;
        memcpy((char *)d->host + ((char *)d->k[l] - (char *)d->region) + off,
               (char *)h->k[l] + 0 * h->block_bytes, d->block_bytes);
        memcpy((char *)d->host + ((char *)d->v[l] - (char *)d->region) + off,
               (char *)h->v[l] + 0 * h->block_bytes, d->block_bytes);
    }
    TH_CHECK(kn_kv_tier_put(t, d, ids[0], 42, 5, 1, tok) == 0);
    uint64_t serial;
    int slot = kn_kv_tier_find(t, 42, 1, tok, &serial);
    TH_CHECK(slot >= 0 && kn_kv_tier_get(t, slot, d, ids[1]) == 0);
    TH_CHECK(d->on_dev[ids[1]] == 1); /* current on the device: no stale upload over it */
    fill(h, 2, 999);
    TH_CHECK(dev_copy(&be, d, ids[1], h, 2, false) && holds(h, 2, 5)); /* the host copy's KV */
    /* copy on write (kn_kv_block_copy) copies where the newest KV is: from ids[0] (the host
     * copy) in the host copy, the copy to be uploaded; from ids[1] (the device) on the
     * device, the copy current there (a rolled-back sequence's block, a prefill stage's last
     * cached block) */
    int32_t cp[2];
    TH_REQUIRE(kn_kv_alloc(dm, 2, cp) == 0);
    TH_CHECK(kn_kv_block_copy(d, ids[0], cp[0]) == 0 && d->on_dev[cp[0]] == 0);
    for (int l = 0; l < d->n_layers; l++)
        for (int kv = 0; kv < 2; kv++) {
            const char *base =
                (const char *)d->host + ((char *)(kv ? d->v[l] : d->k[l]) - (char *)d->region);
            TH_CHECK(!memcmp(base + (size_t)cp[0] * d->block_bytes,
                             base + (size_t)ids[0] * d->block_bytes, d->block_bytes));
        }
    TH_CHECK(kn_kv_block_copy(d, ids[1], cp[1]) == 0 && d->on_dev[cp[1]] == 1);
    fill(h, 3, 999);
    TH_CHECK(dev_copy(&be, d, cp[1], h, 3, false) && holds(h, 3, 5));
    kn_kv_free(dm, 2, cp);
    kn_kv_free(dm, 2, ids);
    kn_kv_mem_destroy(dm);
    kn_kv_pool_destroy(h);
    kn_backend_destroy(&be);
}

static void test_device_pool_memory(void)
{
    test_device_pool(NULL);
}

static void test_device_pool_file(void)
{
    char path[128];
    snprintf(path, sizeof path, "%s/dev", dir);
    test_device_pool(path);
}

/* ---- the latent layout (kv_pool.h KN_KV_LAYOUT_LATENT): one array a layer ---- */

/* A latent pool's params: 2 layers of one KV head of 12 (a latent of 8 + a rope part of 4). */
static kn_kv_pool_params params_latent(int n_blocks)
{
    kn_kv_pool_params p = params_heads(n_blocks, 1);
    p.head_dim = 12;
    p.layout = KN_KV_LAYOUT_LATENT;
    return p;
}

/* Fill block b of every array of the pool (each layer's K and V, or its latent) from seed,
 * in region r (the pool's region, or its staging copy). */
static void fill_arrays(const kn_kv_pool *pool, void *r, int32_t b, unsigned seed)
{
    for (int a = 0; a < kn_kv_pool_arrays(pool) * pool->n_layers; a++) {
        size_t off = (size_t)((char *)kn_kv_pool_array(pool, a) - (char *)pool->region);
        float *x = (float *)((char *)r + off + (size_t)b * pool->block_bytes);
        for (size_t i = 0; i < pool->block_bytes / 4; i++) {
            seed = seed * 1103515245u + 12345u;
            x[i] = (float)(seed >> 8) / 7.0f;
        }
    }
}

/* Whether region r holds fill_arrays(pool, r, b, seed) in block b. */
static bool holds_arrays(const kn_kv_pool *pool, const void *r, int32_t b, unsigned seed)
{
    for (int a = 0; a < kn_kv_pool_arrays(pool) * pool->n_layers; a++) {
        size_t off = (size_t)((char *)kn_kv_pool_array(pool, a) - (char *)pool->region);
        const float *x = (const float *)((const char *)r + off + (size_t)b * pool->block_bytes);
        for (size_t i = 0; i < pool->block_bytes / 4; i++) {
            seed = seed * 1103515245u + 12345u;
            if (x[i] != (float)(seed >> 8) / 7.0f) return false;
        }
    }
    return true;
}

/* Bytes of region r (region_bytes) that are not 0 outside blocks a and b of every array. */
static size_t stray_bytes(const kn_kv_pool *pool, const void *r, int32_t a, int32_t b)
{
    size_t n = 0;
    for (size_t i = 0; i < pool->region_bytes; i++) {
        int32_t blk =
            (int32_t)(i % ((size_t)pool->n_blocks * pool->block_bytes) / pool->block_bytes);
        n += blk != a && blk != b && ((const uint8_t *)r)[i];
    }
    return n;
}

/* The latent layout's bytes (half of K+V's for the same shape: the region, a block, a tier
 * slot), its arrays (v[l] == k[l], one after the other), a bad layout refused; a block copy
 * and a tier round trip (file and host memory) move the latent once, bit-exact, and write
 * nothing else. */
static void test_latent_pool(void)
{
    kn_kv_pool_params lp = params_latent(6), kvp = lp;
    kvp.layout = KN_KV_LAYOUT_KV;
    const size_t blk = (size_t)2 * 1 * BS * 12 * 4; /* 2 layers, 1 head, f32 */
    TH_CHECK(kn_kv_pool_params_block_bytes(&lp) == blk);
    TH_CHECK(kn_kv_pool_params_block_bytes(&kvp) == 2 * blk);
    TH_CHECK(kn_kv_pool_region_bytes(&lp) == 6 * blk);
    TH_CHECK(kn_kv_pool_region_bytes(&kvp) == 2 * 6 * blk);
    kn_kv_pool_params bad = lp;
    bad.layout = (kn_kv_layout)7;
    kn_kv_pool *pool = NULL;
    TH_CHECK(kn_kv_pool_region_bytes(&bad) == 0 && kn_kv_pool_create(&bad, &pool) == TD_EINVAL);
    TH_REQUIRE(kn_kv_pool_create(&lp, &pool) == 0);
    TH_CHECK(pool->layout == KN_KV_LAYOUT_LATENT && kn_kv_pool_arrays(pool) == 1);
    TH_CHECK(pool->region_bytes == 6 * blk && kn_kv_pool_block_bytes(pool) == blk);
    TH_CHECK(pool->v[0] == pool->k[0] && pool->v[1] == pool->k[1]);
    TH_CHECK((char *)pool->k[1] - (char *)pool->k[0] == (ptrdiff_t)(6 * pool->block_bytes));
    TH_CHECK(kn_kv_pool_array(pool, 1) == pool->k[1]);
    fill_arrays(pool, pool->region, 1, 7);
    TH_CHECK(kn_kv_block_copy(pool, 1, 4) == 0 && holds_arrays(pool, pool->region, 4, 7));
    TH_CHECK(stray_bytes(pool, pool->region, 1, 4) == 0);
    /* the tier: a slot is the latent block once, so K+V's bytes for 2 slots hold 4 */
    TH_CHECK(kn_kv_tier_block_bytes(pool) == blk);
    char path[128];
    snprintf(path, sizeof path, "%s/latent", dir);
    const char *where[2] = {path, NULL};
    for (int i = 0; i < 2; i++) {
        kn_kv_tier_params tp = {.path = where[i], .bytes = 4096 + 2 * 2 * blk};
        kn_kv_tier *t = NULL;
        TH_REQUIRE(kn_kv_tier_create(&tp, pool, &t) == 0);
        TH_CHECK(kn_kv_tier_get_stats(t).slots == 4);
        int32_t tok[BS] = {5, 6, 7, 8};
        uint64_t serial;
        TH_CHECK(kn_kv_tier_put(t, pool, 4, 42, 5, 1, tok) == 0);
        int slot = kn_kv_tier_find(t, 42, 1, tok, &serial);
        memset((char *)pool->region, 0, pool->region_bytes);
        TH_CHECK(slot >= 0 && kn_kv_tier_get(t, slot, pool, 2) == 0);
        TH_CHECK(holds_arrays(pool, pool->region, 2, 7) &&
                 stray_bytes(pool, pool->region, 2, 2) == 0);
        fill_arrays(pool, pool->region, 4, 7);
        kn_kv_tier_destroy(t);
    }
    kn_kv_pool_destroy(pool);
}

/* A staged latent pool in device memory (cpu-dev): the staging, the block copy and the tier
 * move n_layers latent blocks a block (the backend's byte counts), bit-exact, with no
 * violation of the device contract. */
static void test_latent_device_pool(void)
{
    kn_backend be;
    TH_REQUIRE(kn_backend_create("cpu-dev", &(kn_backend_options){.n_threads = 1}, &be) == 0);
    kn_kv_pool_params pp = params_latent(6);
    pp.backend = &be;
    pp.host_stage = true;
    kn_kv_pool *d = NULL;
    TH_REQUIRE(kn_kv_pool_create(&pp, &d) == 0 && d->host && d->dev.ops);
    const size_t blk = kn_kv_pool_block_bytes(d);
    TH_CHECK(blk == (size_t)2 * BS * 12 * 4 && d->region_bytes == 6 * blk);
    kn_cpudev_stats st0, st;
    /* received into the staging (block 1), uploaded; the device's block 1 back into 3 */
    fill_arrays(d, d->host, 1, 11);
    TH_REQUIRE(kn_cpudev_stats_of(be, &st0) == 0);
    int32_t one = 1, three = 3;
    TH_CHECK(kn_kv_stage_upload(d, &one, 1) == 0 && d->on_dev[1]);
    TH_CHECK(kn_kv_block_copy(d, 1, 3) == 0 && d->on_dev[3]); /* on the device */
    TH_CHECK(kn_kv_stage_download(d, &three, 1) == 0);
    TH_CHECK(holds_arrays(d, d->host, 3, 11));
    TH_REQUIRE(kn_cpudev_stats_of(be, &st) == 0);
    /* upload 1, copy 3 (download + upload), download 3: each the latent block once */
    TH_CHECKF(st.bytes_upload - st0.bytes_upload == 2 * blk &&
                  st.bytes_download - st0.bytes_download == 2 * blk,
              "%llu bytes up, %llu down, block %zu",
              (unsigned long long)(st.bytes_upload - st0.bytes_upload),
              (unsigned long long)(st.bytes_download - st0.bytes_download), blk);
    /* the tier through the device: block 3 out, into block 5 */
    kn_kv_tier_params tp = {.path = NULL, .bytes = 4096 + 2 * blk};
    kn_kv_tier *t = NULL;
    TH_REQUIRE(kn_kv_tier_create(&tp, d, &t) == 0);
    int32_t tok[BS] = {1, 2, 3, 4}, five = 5;
    uint64_t serial;
    TH_CHECK(kn_kv_tier_put(t, d, 3, 9, 2, 1, tok) == 0);
    int slot = kn_kv_tier_find(t, 9, 1, tok, &serial);
    TH_CHECK(slot >= 0 && kn_kv_tier_get(t, slot, d, 5) == 0 && d->on_dev[5]);
    TH_CHECK(kn_kv_stage_download(d, &five, 1) == 0 && holds_arrays(d, d->host, 5, 11));
    TH_REQUIRE(kn_cpudev_stats_of(be, &st0) == 0);
    TH_CHECK(st0.bytes_upload - st.bytes_upload == blk &&
             st0.bytes_download - st.bytes_download == 2 * blk);
    TH_CHECKF(st0.n_violations == 0, "%lld violations; first: %s", (long long)st0.n_violations,
              st0.first);
    kn_kv_tier_destroy(t);
    kn_kv_pool_destroy(d);
    kn_backend_destroy(&be);
}

int main(void)
{
    if (!mkdtemp(dir)) return 1;
    static char path[128];
    snprintf(path, sizeof path, "%s/rt", dir);
    round_trip_path = path;
    TH_RUN(test_round_trip_file);
    TH_RUN(test_round_trip_memory);
    TH_RUN(test_lru_and_full);
    TH_RUN(test_bad_files);
    TH_RUN(test_cache_with_tier);
    TH_RUN(test_tp_replay);
    TH_RUN(test_device_pool_memory);
    TH_RUN(test_device_pool_file);
    TH_RUN(test_staged_device_pool);
    TH_RUN(test_latent_pool);
    TH_RUN(test_latent_device_pool);
    char cmd[160];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) fprintf(stderr, "cannot remove %s\n", dir);
    TH_EXIT();
}
