/* test_kv_mem.c: the KV memory facade (kvmem/kv_mem.h): blocks allocated and freed with and
 * without a prefix cache (idle cached blocks counted as available, evicted least recently used
 * first when the free list is short, all or nothing), sequences (reserve, release, match,
 * commit, claim_restored), rollback (inside a private block, inside a cached block: a private
 * copy with the same KV while the cached entry stays matchable, at a block boundary, bad
 * lengths, no block for the copy), and renewing the pool (a named shared segment too: its
 * name passes to the new segment); every test twice, on a K+V pool and
 * on a latent one (kv_pool.h KN_KV_LAYOUT_LATENT: one array a layer, copied once). */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "../tharness.h"
#include "kv_mem.h"
#include "td_err.h"

#define BS 4

static kn_kv_layout layout; /* the pools' layout: every test runs with each */

static kn_kv_pool_params params_of(int n_blocks)
{
    return (kn_kv_pool_params){.n_layers = 2,
                               .n_kv_heads = 2,
                               .head_dim = 4,
                               .block_size = BS,
                               .n_blocks = n_blocks,
                               .type = TD_F32,
                               .layout = layout};
}

/* A KV memory of n_blocks blocks, with the prefix cache if cache. */
static kn_kv_mem *mem_of(int n_blocks, bool cache)
{
    kn_kv_pool_params p = params_of(n_blocks);
    kn_kv_mem *m = NULL;
    if (kn_kv_mem_create(&p, &m)) return NULL;
    if (cache && kn_kv_mem_add_cache(m)) {
        kn_kv_mem_destroy(m);
        return NULL;
    }
    return m;
}

/* Block b of array i (kn_kv_pool_array: a layer's K or V, or its latent; a head-major pool:
 * one contiguous range). */
static float *blk(const kn_kv_pool *pool, int i, int32_t b)
{
    return (float *)((char *)kn_kv_pool_array(pool, i) + (size_t)b * pool->block_bytes);
}

/* Distinct values from seed in every array of block b (every layer's K and V, or latent). */
static void fill(kn_kv_pool *pool, int32_t b, unsigned seed)
{
    for (int i = 0; i < kn_kv_pool_arrays(pool) * pool->n_layers; i++) {
        float *x = blk(pool, i, b);
        for (size_t j = 0; j < pool->block_bytes / 4; j++)
            x[j] = (float)(seed * 1000u + (unsigned)i * 50u + j);
    }
}

/* Whether blocks a and b hold the same bytes in every array. */
static bool same_kv(const kn_kv_pool *pool, int32_t a, int32_t b)
{
    for (int i = 0; i < kn_kv_pool_arrays(pool) * pool->n_layers; i++)
        if (memcmp(blk(pool, i, a), blk(pool, i, b), pool->block_bytes)) return false;
    return true;
}

static bool chain_eq(kn_kv_chain a, kn_kv_chain b)
{
    return a.id == b.id && a.serial == b.serial;
}

/* The chain of the leading n whole blocks of tok as the cache's index has it. */
static kn_kv_chain walked(const kn_kv_mem *m, const int32_t *tok, int n)
{
    kn_kv_chain ch;
    if (kn_kv_cache_probe(kn_kv_mem_cache(m), tok, (int64_t)n * BS, n, &ch) < n) ch.serial = 0;
    return ch;
}

/* s: tok[0..n) reserved, its blocks past the matched ones filled (seed base + block index)
 * as if computed, and committed. */
static int computed(kn_kv_mem *m, kn_kv_seq *s, const int32_t *tok, int n, unsigned base)
{
    int rc = kn_kv_seq_reserve(m, s, n);
    for (int b = s->n_entered; !rc && b < s->n_blocks; b++)
        fill(kn_kv_mem_pool(m), s->blocks[b], base + (unsigned)b);
    if (!rc) kn_kv_seq_commit(m, s, tok, n);
    return rc;
}

static void test_blocks_without_cache(void)
{
    kn_kv_mem *m = mem_of(8, false);
    TH_REQUIRE(m);
    kn_kv_pool *pool = kn_kv_mem_pool(m);
    TH_CHECK(pool && pool->n_blocks == 8 && pool->block_size == BS);
    TH_CHECK(!kn_kv_mem_cache(m) && !kn_kv_mem_tier(m) && kn_kv_available(m) == 8);
    int32_t ids[8];
    TH_CHECK(kn_kv_alloc(m, -1, ids) == TD_EINVAL);
    TH_REQUIRE(kn_kv_alloc(m, 3, ids) == 0);
    TH_CHECK(kn_kv_available(m) == 5 && pool->n_free == 5);
    for (int i = 0; i < 3; i++)
        TH_CHECK(pool->refs[ids[i]] == 1);
    TH_CHECK(kn_kv_alloc(m, 6, ids + 3) == TD_ENOSPC && kn_kv_available(m) == 5); /* nothing */
    TH_CHECK(kn_kv_alloc(m, 0, ids + 3) == 0 && kn_kv_available(m) == 5);
    kn_kv_free(m, 3, ids);
    TH_CHECK(kn_kv_available(m) == 8);
    /* without a cache: no match, a commit enters nothing, clear is a no-op */
    int32_t tok[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    kn_kv_seq s;
    kn_kv_seq_init(&s);
    TH_CHECK(kn_kv_seq_match(m, &s, tok, 8, 2, NULL) == 0 && s.n_blocks == 0);
    TH_REQUIRE(kn_kv_seq_reserve(m, &s, 8) == 0 && s.n_blocks == 2);
    kn_kv_seq_commit(m, &s, tok, 8);
    TH_CHECK(s.n_entered == 0 && kn_kv_seq_claim_restored(m, &s) == 0);
    kn_kv_mem_clear(m);
    TH_CHECK(kn_kv_available(m) == 6);
    /* rollback without a cache: no copy, blocks past n_ctx freed */
    int32_t b0 = s.blocks[0];
    TH_CHECK(kn_kv_seq_rollback(m, &s, tok, 3) == 0 && s.n_blocks == 1 && s.blocks[0] == b0);
    TH_CHECK(kn_kv_available(m) == 7);
    kn_kv_seq_fini(m, &s);
    TH_CHECK(kn_kv_available(m) == 8 && !s.blocks && s.n_blocks == 0);
    kn_kv_mem_destroy(m);
    kn_kv_mem_destroy(NULL);
}

/* Idle cached blocks count as available; a short free list evicts them least recently used
 * first (a sequence's deepest block first); an allocation that cannot be met evicts nothing. */
static void test_blocks_with_cache(void)
{
    kn_kv_mem *m = mem_of(6, true);
    TH_REQUIRE(m);
    kn_kv_pool *pool = kn_kv_mem_pool(m);
    kn_kv_cache *c = kn_kv_mem_cache(m);
    TH_REQUIRE(c);
    TH_CHECK(kn_kv_mem_add_cache(m) == TD_ESTATE && kn_kv_mem_cache(m) == c);
    int32_t x[8] = {1, 1, 1, 1, 2, 2, 2, 2}, y[8] = {3, 3, 3, 3, 4, 4, 4, 4};
    kn_kv_seq a, b;
    kn_kv_seq_init(&a);
    kn_kv_seq_init(&b);
    TH_REQUIRE(computed(m, &a, x, 8, 10) == 0 && computed(m, &b, y, 8, 20) == 0);
    int32_t x0 = a.blocks[0], x1 = a.blocks[1], y0 = b.blocks[0], y1 = b.blocks[1];
    TH_CHECK(kn_kv_cache_get_stats(c).cached == 4 && kn_kv_available(m) == 2);
    kn_kv_seq_fini(m, &a); /* idle, oldest first: x1, x0 */
    kn_kv_seq_fini(m, &b); /* then y1, y0 */
    TH_CHECK(pool->n_free == 2 && kn_kv_cache_get_stats(c).idle == 4);
    TH_CHECK(kn_kv_available(m) == 6); /* free plus idle */
    int32_t ids[7];
    TH_CHECK(kn_kv_alloc(m, 7, ids) == TD_ENOSPC);
    TH_CHECK(kn_kv_cache_get_stats(c).evictions == 0 && kn_kv_cache_get_stats(c).cached == 4);
    /* 3: the 2 free, then x's deepest block (the least recently idle) */
    TH_REQUIRE(kn_kv_alloc(m, 3, ids) == 0);
    kn_kv_cache_stats st = kn_kv_cache_get_stats(c);
    TH_CHECK(st.evictions == 1 && st.cached == 3 && st.idle == 3 && kn_kv_available(m) == 3);
    int n_x1 = 0, n_other = 0;
    for (int i = 0; i < 3; i++)
        n_x1 += ids[i] == x1, n_other += ids[i] == x0 || ids[i] == y0 || ids[i] == y1;
    TH_CHECK(n_x1 == 1 && n_other == 0);
    /* 2 more: x0, then y1 */
    TH_REQUIRE(kn_kv_alloc(m, 2, ids + 3) == 0);
    TH_CHECK(ids[3] != ids[4] && (ids[3] == x0 || ids[4] == x0) && (ids[3] == y1 || ids[4] == y1));
    TH_CHECK(kn_kv_cache_get_stats(c).evictions == 3 && kn_kv_available(m) == 1);
    /* what is left of y matches; x matches nothing */
    kn_kv_seq_init(&a);
    TH_CHECK(kn_kv_seq_match(m, &a, y, 8, 2, NULL) == 1 && a.blocks[0] == y0);
    TH_CHECK(kn_kv_available(m) == 0 && pool->refs[y0] == 1);
    kn_kv_seq_fini(m, &a);
    TH_CHECK(kn_kv_seq_match(m, &a, x, 8, 2, NULL) == 0 && a.n_blocks == 0);
    kn_kv_free(m, 5, ids);
    TH_CHECK(kn_kv_available(m) == 6 && pool->n_free == 5);
    kn_kv_mem_clear(m); /* the cache's entries are gone, its idle block free again */
    TH_CHECK(pool->n_free == 6 && kn_kv_cache_get_stats(c).cached == 0);
    kn_kv_seq_fini(m, &a);
    kn_kv_mem_destroy(m);
}

static void test_seq_reserve_release(void)
{
    kn_kv_mem *m = mem_of(4, true);
    TH_REQUIRE(m);
    kn_kv_seq s;
    kn_kv_seq_init(&s);
    TH_CHECK(!s.blocks && s.n_blocks == 0 && s.n_entered == 0);
    TH_CHECK(chain_eq(s.chain, kn_kv_cache_root()));
    TH_CHECK(kn_kv_seq_reserve(m, &s, 0) == 0 && s.n_blocks == 0);
    TH_CHECK(kn_kv_seq_reserve(m, &s, -1) == TD_EINVAL);
    TH_CHECK(kn_kv_seq_reserve(m, &s, 5) == 0 && s.n_blocks == 2 && kn_kv_available(m) == 2);
    int32_t b0 = s.blocks[0], b1 = s.blocks[1];
    TH_CHECK(kn_kv_seq_reserve(m, &s, 3) == 0 && s.n_blocks == 2); /* never shrinks */
    TH_CHECK(kn_kv_seq_reserve(m, &s, 8) == 0 && s.n_blocks == 2);
    /* all or nothing: 5 blocks do not fit, the 2 held stay as they were */
    TH_CHECK(kn_kv_seq_reserve(m, &s, 20) == TD_ENOSPC && s.n_blocks == 2);
    TH_CHECK(s.blocks[0] == b0 && s.blocks[1] == b1 && kn_kv_available(m) == 2);
    TH_CHECK(kn_kv_seq_reserve(m, &s, 16) == 0 && s.n_blocks == 4 && kn_kv_available(m) == 0);
    TH_CHECK(s.blocks[0] == b0 && s.blocks[1] == b1);
    kn_kv_seq_release(m, &s);
    TH_CHECK(s.n_blocks == 0 && s.n_entered == 0 && kn_kv_available(m) == 4);
    TH_CHECK(chain_eq(s.chain, kn_kv_cache_root()));
    TH_CHECK(kn_kv_seq_reserve(m, &s, 1) == 0 && s.n_blocks == 1); /* the record is reusable */
    kn_kv_seq_fini(m, &s);
    TH_CHECK(!s.blocks && s.n_blocks == 0 && s.cap == 0 && kn_kv_available(m) == 4);
    kn_kv_mem_destroy(m);
}

/* A sequence's commit enters its whole computed blocks only; another sequence's match takes
 * them (a reference each) and computes the rest in blocks of its own. */
static void test_seq_match_and_commit(void)
{
    kn_kv_mem *m = mem_of(12, true);
    TH_REQUIRE(m);
    kn_kv_pool *pool = kn_kv_mem_pool(m);
    kn_kv_cache *c = kn_kv_mem_cache(m);
    int32_t tok[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    kn_kv_seq a, b, d;
    kn_kv_seq_init(&a);
    kn_kv_seq_init(&b);
    kn_kv_seq_init(&d);
    TH_REQUIRE(kn_kv_seq_reserve(m, &a, 10) == 0 && a.n_blocks == 3);
    kn_kv_seq_commit(m, &a, tok, 3); /* no whole block computed yet */
    TH_CHECK(a.n_entered == 0 && kn_kv_cache_get_stats(c).cached == 0);
    kn_kv_seq_commit(m, &a, tok, 7);
    TH_CHECK(a.n_entered == 1 && kn_kv_cache_holds(c, a.blocks[0]));
    kn_kv_seq_commit(m, &a, tok, 10); /* the partial third block stays private */
    TH_CHECK(a.n_entered == 2 && kn_kv_cache_get_stats(c).cached == 2);
    TH_CHECK(!kn_kv_cache_holds(c, a.blocks[2]) && chain_eq(a.chain, walked(m, tok, 2)));
    kn_kv_seq_commit(m, &a, tok, 10); /* again: nothing new */
    TH_CHECK(a.n_entered == 2 && kn_kv_cache_get_stats(c).inserts == 2);
    /* b: the same prompt shares a's two whole blocks and computes the third */
    TH_CHECK(kn_kv_seq_match(m, &b, tok, 10, 3, NULL) == 2);
    TH_CHECK(b.n_blocks == 2 && b.n_entered == 2 && chain_eq(b.chain, a.chain));
    TH_CHECK(b.blocks[0] == a.blocks[0] && b.blocks[1] == a.blocks[1]);
    TH_CHECK(pool->refs[a.blocks[0]] == 2 && pool->refs[a.blocks[1]] == 2);
    TH_CHECK(kn_kv_seq_match(m, &b, tok, 10, 3, NULL) == 0 && b.n_blocks == 2); /* holds some */
    TH_REQUIRE(kn_kv_seq_reserve(m, &b, 10) == 0 && b.n_blocks == 3);
    TH_CHECK(b.blocks[2] != a.blocks[2] && pool->refs[b.blocks[2]] == 1);
    TH_CHECK(kn_kv_seq_claim_restored(m, &b) == 0); /* no tier */
    /* b computes block 2 whole: entered; a's equal block 2 then continues through b's entry */
    kn_kv_seq_commit(m, &b, tok, 12);
    TH_CHECK(b.n_entered == 3 && kn_kv_cache_holds(c, b.blocks[2]));
    kn_kv_seq_commit(m, &a, tok, 12);
    TH_CHECK(a.n_entered == 3 && !kn_kv_cache_holds(c, a.blocks[2]));
    TH_CHECK(chain_eq(a.chain, b.chain) && kn_kv_cache_get_stats(c).cached == 3);
    /* max_blocks caps a match; a prompt that diverges in block 1 shares block 0 only */
    TH_CHECK(kn_kv_seq_match(m, &d, tok, 12, 1, NULL) == 1 && d.blocks[0] == a.blocks[0]);
    kn_kv_seq_release(m, &d);
    int32_t other[8] = {1, 2, 3, 4, 5, 6, 7, 99};
    TH_CHECK(kn_kv_seq_match(m, &d, other, 8, 2, NULL) == 1 && d.n_entered == 1);
    TH_CHECK(pool->refs[a.blocks[0]] == 3);
    kn_kv_seq_commit(m, &d, other, 8); /* d has no block 1 yet: nothing to enter */
    TH_CHECK(d.n_entered == 1);
    kn_kv_seq_fini(m, &d);
    kn_kv_seq_fini(m, &a);
    kn_kv_seq_fini(m, &b);
    TH_CHECK(kn_kv_available(m) == 12 && kn_kv_cache_get_stats(c).idle == 3);
    kn_kv_mem_destroy(m);
}

/* (a) inside a private block: the blocks past it are freed, the rest kept as they are;
 * (c) at a block boundary: no copy, the chain steps back; to 0: nothing kept;
 * (d) n_ctx past the table or negative: TD_EINVAL, nothing changed. */
static void test_rollback_private_and_boundary(void)
{
    kn_kv_mem *m = mem_of(8, true);
    TH_REQUIRE(m);
    kn_kv_cache *c = kn_kv_mem_cache(m);
    int32_t tok[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    kn_kv_seq a;
    kn_kv_seq_init(&a);
    TH_REQUIRE(kn_kv_seq_reserve(m, &a, 12) == 0);
    kn_kv_seq_commit(m, &a, tok, 4); /* block 0 cached; 1 and 2 private */
    TH_REQUIRE(a.n_entered == 1);
    int32_t b0 = a.blocks[0], b1 = a.blocks[1];
    kn_kv_chain ch1 = a.chain;
    TH_CHECK(kn_kv_seq_rollback(m, &a, tok, 13) == TD_EINVAL);
    TH_CHECK(kn_kv_seq_rollback(m, &a, tok, -1) == TD_EINVAL);
    TH_CHECK(a.n_blocks == 3 && a.n_entered == 1 && kn_kv_available(m) == 5);
    TH_CHECK(kn_kv_seq_rollback(m, &a, tok, 12) == 0 && a.n_blocks == 3); /* keeps it all */
    /* (a) to 6: inside private block 1 */
    TH_CHECK(kn_kv_seq_rollback(m, &a, tok, 6) == 0);
    TH_CHECK(a.n_blocks == 2 && a.blocks[0] == b0 && a.blocks[1] == b1);
    TH_CHECK(a.n_entered == 1 && chain_eq(a.chain, ch1) && kn_kv_available(m) == 6);
    TH_CHECK(kn_kv_cache_get_stats(c).cached == 1 &&
             kn_kv_seq_rollback(m, &a, tok, 9) == TD_EINVAL);
    /* (c) computed on to 12 and committed, then back to the boundary 8: no copy */
    TH_REQUIRE(kn_kv_seq_reserve(m, &a, 12) == 0);
    kn_kv_seq_commit(m, &a, tok, 12);
    TH_REQUIRE(a.n_entered == 3 && kn_kv_cache_get_stats(c).cached == 3);
    int32_t b2 = a.blocks[2];
    int avail = kn_kv_available(m);
    TH_CHECK(kn_kv_seq_rollback(m, &a, tok, 8) == 0);
    TH_CHECK(a.n_blocks == 2 && a.blocks[0] == b0 && a.blocks[1] == b1 && a.n_entered == 2);
    TH_CHECK(chain_eq(a.chain, walked(m, tok, 2)) && a.chain.serial != 0);
    /* block 2 left the sequence but stays cached (idle); no block was taken for a copy */
    TH_CHECK(kn_kv_cache_holds(c, b2) && kn_kv_available(m) == avail + 1);
    TH_CHECK(kn_kv_cache_get_stats(c).idle == 1 && kn_kv_mem_pool(m)->refs[b2] == 0);
    /* a commit after it goes on through the entry that is there */
    TH_REQUIRE(kn_kv_seq_reserve(m, &a, 12) == 0);
    kn_kv_seq_commit(m, &a, tok, 12);
    TH_CHECK(a.n_entered == 3 && chain_eq(a.chain, walked(m, tok, 3)));
    TH_CHECK(kn_kv_cache_get_stats(c).cached == 3);
    /* to 0: nothing kept, back at the root */
    TH_CHECK(kn_kv_seq_rollback(m, &a, tok, 0) == 0 && a.n_blocks == 0 && a.n_entered == 0);
    TH_CHECK(chain_eq(a.chain, kn_kv_cache_root()) && kn_kv_available(m) == 8);
    kn_kv_seq_fini(m, &a);
    kn_kv_mem_destroy(m);
}

/* (b) inside a cached block another sequence also holds: the sequence gets a private copy (a
 * new block, the same bytes in every layer's K and V); the cached entry stays matchable by
 * another sequence; n_entered and the chain step back, and a later commit of other tokens
 * enters the copy. */
static void test_rollback_cached_copies(void)
{
    kn_kv_mem *m = mem_of(10, true);
    TH_REQUIRE(m);
    kn_kv_pool *pool = kn_kv_mem_pool(m);
    kn_kv_cache *c = kn_kv_mem_cache(m);
    int32_t tok[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    int32_t alt[12] = {1, 2, 3, 4, 5, 6, 70, 80, 90, 100, 110, 120}; /* differs from 6 on */
    kn_kv_seq a, b, d;
    kn_kv_seq_init(&a);
    kn_kv_seq_init(&b);
    kn_kv_seq_init(&d);
    TH_REQUIRE(computed(m, &a, tok, 12, 1) == 0 && a.n_entered == 3);
    int32_t old[3] = {a.blocks[0], a.blocks[1], a.blocks[2]};
    TH_CHECK(!same_kv(pool, old[0], old[1]) && !same_kv(pool, old[1], old[2]));
    TH_CHECK(kn_kv_seq_match(m, &b, tok, 12, 3, NULL) == 3); /* b shares all three */
    TH_CHECK(b.blocks[0] == old[0] && b.blocks[1] == old[1] && b.blocks[2] == old[2]);
    TH_CHECK(kn_kv_seq_rollback(m, &a, alt, 6) == 0);
    TH_CHECK(a.n_blocks == 2 && a.blocks[0] == old[0]);
    TH_CHECK(a.blocks[1] != old[0] && a.blocks[1] != old[1] && a.blocks[1] != old[2]);
    TH_CHECK(same_kv(pool, a.blocks[1], old[1])); /* every layer's K and V */
    TH_CHECK(!kn_kv_cache_holds(c, a.blocks[1]) && pool->refs[a.blocks[1]] == 1);
    TH_CHECK(a.n_entered == 1 && chain_eq(a.chain, walked(m, tok, 1)));
    /* the cached blocks 1 and 2 stay entries, b's alone now */
    kn_kv_cache_stats st = kn_kv_cache_get_stats(c);
    TH_CHECK(st.cached == 3 && st.idle == 0 && pool->refs[old[1]] == 1);
    TH_CHECK(pool->refs[old[0]] == 2 && pool->refs[old[2]] == 1);
    /* a computes the other tokens on (positions 6..11) and commits: the copy is entered */
    TH_REQUIRE(kn_kv_seq_reserve(m, &a, 12) == 0 && a.n_blocks == 3);
    fill(pool, a.blocks[1], 41); /* positions 6, 7 written (the whole block, for the test) */
    fill(pool, a.blocks[2], 42);
    kn_kv_seq_commit(m, &a, alt, 12);
    TH_CHECK(a.n_entered == 3 && kn_kv_cache_holds(c, a.blocks[1]));
    TH_CHECK(kn_kv_cache_holds(c, a.blocks[2]) && kn_kv_cache_get_stats(c).cached == 5);
    TH_CHECK(chain_eq(a.chain, walked(m, alt, 3)));
    TH_CHECK(kn_kv_seq_match(m, &d, alt, 12, 3, NULL) == 3);
    TH_CHECK(d.blocks[0] == old[0] && d.blocks[1] == a.blocks[1] && d.blocks[2] == a.blocks[2]);
    kn_kv_seq_release(m, &d);
    /* the original entries are still what tok matches, KV untouched by a's writes */
    TH_CHECK(kn_kv_seq_match(m, &d, tok, 12, 3, NULL) == 3 && d.blocks[1] == old[1]);
    TH_CHECK(same_kv(pool, b.blocks[1], d.blocks[1]) && !same_kv(pool, old[1], a.blocks[1]));
    kn_kv_seq_fini(m, &d);
    kn_kv_seq_fini(m, &b);
    kn_kv_seq_fini(m, &a);
    TH_CHECK(kn_kv_available(m) == 10);
    kn_kv_mem_destroy(m);
}

/* (b') inside a cached block the sequence alone holds: it still takes a private copy, and the
 * entry stays (no event): the entries chained after it, the sequence's blocks past n_ctx now
 * idle, still follow it and stay matchable, as the router's index says. */
static void test_rollback_sole_holder(void)
{
    kn_kv_mem *m = mem_of(4, true);
    TH_REQUIRE(m);
    kn_kv_pool *pool = kn_kv_mem_pool(m);
    kn_kv_cache *c = kn_kv_mem_cache(m);
    int32_t tok[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    kn_kv_seq a, b;
    kn_kv_seq_init(&a);
    kn_kv_seq_init(&b);
    TH_REQUIRE(computed(m, &a, tok, 12, 1) == 0 && a.n_entered == 3);
    int32_t old1 = a.blocks[1];
    uint64_t ev = kn_kv_cache_event_next(c);
    TH_CHECK(kn_kv_seq_rollback(m, &a, tok, 6) == 0);
    TH_CHECK(a.n_blocks == 2 && a.blocks[1] != old1 && kn_kv_cache_holds(c, old1));
    TH_CHECK(same_kv(pool, a.blocks[1], old1) && !kn_kv_cache_holds(c, a.blocks[1]));
    TH_CHECK(pool->refs[old1] == 0 && a.n_entered == 1);
    TH_CHECK(kn_kv_cache_get_stats(c).cached == 3); /* blocks 1 and 2 stay cached, idle */
    kn_kv_event e[4];
    uint64_t first;
    TH_CHECK(kn_kv_cache_events(c, ev, e, 4, &first) == 0); /* nothing left the index */
    TH_CHECK(kn_kv_seq_match(m, &b, tok, 12, 3, NULL) == 3); /* the whole chain still matches */
    kn_kv_seq_fini(m, &b);
    kn_kv_seq_fini(m, &a);
    TH_CHECK(kn_kv_available(m) == 4);
    kn_kv_mem_destroy(m);
}

/* (e) no block for the copy: TD_ENOSPC, the sequence keeps its whole blocks only. */
static void test_rollback_no_room(void)
{
    kn_kv_mem *m = mem_of(3, true);
    TH_REQUIRE(m);
    kn_kv_pool *pool = kn_kv_mem_pool(m);
    int32_t tok[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    kn_kv_seq a, b;
    kn_kv_seq_init(&a);
    kn_kv_seq_init(&b);
    TH_REQUIRE(computed(m, &a, tok, 12, 1) == 0 && a.n_entered == 3);
    TH_REQUIRE(kn_kv_seq_match(m, &b, tok, 12, 3, NULL) == 3); /* b holds all three */
    int32_t old[3] = {a.blocks[0], a.blocks[1], a.blocks[2]};
    TH_CHECK(kn_kv_available(m) == 0);
    TH_CHECK(kn_kv_seq_rollback(m, &a, tok, 6) == TD_ENOSPC);
    TH_CHECK(a.n_blocks == 1 && a.blocks[0] == old[0] && a.n_entered == 1);
    TH_CHECK(chain_eq(a.chain, walked(m, tok, 1)));
    TH_CHECK(pool->refs[old[0]] == 2 && pool->refs[old[1]] == 1 && pool->refs[old[2]] == 1);
    /* room again: the positions dropped are computed once more, the commit goes on */
    kn_kv_seq_release(m, &b);
    TH_REQUIRE(kn_kv_seq_reserve(m, &a, 12) == 0 && a.n_blocks == 3);
    kn_kv_seq_commit(m, &a, tok, 12);
    TH_CHECK(a.n_entered == 3 && chain_eq(a.chain, walked(m, tok, 3)));
    kn_kv_seq_fini(m, &a);
    kn_kv_seq_fini(m, &b);
    TH_CHECK(kn_kv_available(m) == 3);
    kn_kv_mem_destroy(m);
}

/* With a tier (added before the cache): blocks evicted into it come back by a sequence's
 * match within the budget, counted once by claim_restored. */
static void test_seq_match_tier(void)
{
    kn_kv_mem *m = mem_of(3, false);
    TH_REQUIRE(m);
    kn_kv_pool *pool = kn_kv_mem_pool(m);
    kn_kv_tier_params tp = {.bytes = 4096 + 8 * kn_kv_tier_block_bytes(pool)};
    TH_REQUIRE(kn_kv_mem_add_tier(m, &tp) == 0 && kn_kv_mem_add_cache(m) == 0);
    TH_CHECK(kn_kv_cache_tier(kn_kv_mem_cache(m)) == kn_kv_mem_tier(m));
    int32_t tok[8] = {1, 2, 3, 4, 5, 6, 7, 8}, ids[3];
    kn_kv_seq a;
    kn_kv_seq_init(&a);
    TH_REQUIRE(computed(m, &a, tok, 8, 5) == 0 && a.n_entered == 2);
    kn_kv_seq_release(m, &a);
    TH_REQUIRE(kn_kv_alloc(m, 3, ids) == 0); /* both evicted into the tier */
    TH_CHECK(kn_kv_tier_get_stats(kn_kv_mem_tier(m)).writes == 2);
    for (int i = 0; i < 3; i++)
        fill(pool, ids[i], 90u + (unsigned)i);
    kn_kv_free(m, 3, ids);
    kn_kv_tier_budget tb = {.copies_left = 1};
    TH_CHECK(kn_kv_seq_match(m, &a, tok, 8, 2, &tb) == 1 && tb.copied == 1 && tb.more);
    TH_CHECK(a.n_entered == 1 && kn_kv_seq_claim_restored(m, &a) == 1);
    TH_CHECK(kn_kv_seq_claim_restored(m, &a) == 0);
    kn_kv_seq_release(m, &a);
    TH_CHECK(kn_kv_seq_match(m, &a, tok, 8, 2, NULL) == 1); /* no budget: the pool only */
    kn_kv_seq_fini(m, &a);
    kn_kv_mem_destroy(m);
}

/* renew_pool: refused while a block is held (nothing changed); with every block free or
 * idle, a fresh pool of the same shape, the cache cleared (and the tier's entries with it:
 * their serials name nothing any more), the tier kept and attached to the cache. */
static void test_renew_pool(void)
{
    kn_kv_mem *m = mem_of(4, true);
    TH_REQUIRE(m);
    kn_kv_pool *pool = kn_kv_mem_pool(m);
    kn_kv_tier_params tp = {.bytes = 4096 + 4 * kn_kv_tier_block_bytes(pool)};
    TH_REQUIRE(kn_kv_mem_add_tier(m, &tp) == 0);
    kn_kv_tier *t = kn_kv_mem_tier(m);
    int32_t tok[8] = {1, 2, 3, 4, 5, 6, 7, 8}, ids[3];
    kn_kv_seq a;
    kn_kv_seq_init(&a);
    TH_REQUIRE(computed(m, &a, tok, 8, 3) == 0 && a.n_entered == 2);
    kn_kv_seq_release(m, &a);
    TH_REQUIRE(kn_kv_alloc(m, 3, ids) == 0); /* one evicted into the tier */
    TH_CHECK(kn_kv_tier_get_stats(t).used == 1);
    TH_CHECK(kn_kv_mem_renew_pool(m) == TD_ESTATE); /* blocks held */
    TH_CHECK(kn_kv_mem_pool(m) == pool && pool->refs[ids[0]] == 1 && pool->n_free == 0);
    TH_CHECK(kn_kv_cache_get_stats(kn_kv_mem_cache(m)).cached == 1);
    kn_kv_free(m, 3, ids); /* one idle cached block left: no obstacle */
    TH_CHECK(kn_kv_available(m) == 4 && pool->n_free == 3);
    kn_kv_cache *c = kn_kv_mem_cache(m);
    uint64_t ev = kn_kv_cache_event_next(c);
    TH_REQUIRE(kn_kv_mem_renew_pool(m) == 0);
    pool = kn_kv_mem_pool(m);
    TH_REQUIRE(pool && kn_kv_mem_cache(m) == c); /* the same cache goes on */
    kn_kv_event e[4];
    uint64_t first;
    TH_CHECK(kn_kv_cache_events(c, ev, e, 4, &first) == 1 && first == ev &&
             e[0].kind == KN_KV_EV_CLEARED); /* numbering goes on: readers see the clear */
    TH_CHECK(pool->n_free == 4 && pool->n_blocks == 4 && pool->block_size == BS);
    TH_CHECK(kn_kv_cache_get_stats(c).cached == 0 && kn_kv_cache_tier(c) == t);
    TH_CHECK(kn_kv_mem_tier(m) == t && kn_kv_tier_get_stats(t).used == 0);
    kn_kv_tier_budget tb = {.copies_left = 2};
    TH_CHECK(kn_kv_seq_match(m, &a, tok, 8, 2, &tb) == 0 && tb.copied == 0 && !tb.more);
    /* the renewed memory works as a new one */
    TH_REQUIRE(computed(m, &a, tok, 8, 4) == 0 && a.n_entered == 2);
    TH_CHECK(kn_kv_cache_get_stats(c).cached == 2 && kn_kv_available(m) == 2);
    kn_kv_seq_fini(m, &a);
    kn_kv_mem_destroy(m);
    /* without a cache: the same rule */
    TH_REQUIRE((m = mem_of(2, false)) != NULL);
    TH_REQUIRE(kn_kv_alloc(m, 1, ids) == 0);
    TH_CHECK(kn_kv_mem_renew_pool(m) == TD_ESTATE);
    kn_kv_free(m, 1, ids);
    TH_CHECK(kn_kv_mem_renew_pool(m) == 0 && kn_kv_available(m) == 2 && !kn_kv_mem_cache(m));
    kn_kv_mem_destroy(m);
    /* a cache without demand eviction (a prefill stage's): idle blocks are no obstacle either */
    TH_REQUIRE((m = mem_of(4, true)) != NULL);
    kn_kv_cache_set_demand_evict(kn_kv_mem_cache(m), false);
    TH_REQUIRE(computed(m, &a, tok, 8, 3) == 0);
    kn_kv_seq_fini(m, &a);
    TH_CHECK(kn_kv_available(m) == 2); /* the two cached blocks are kept, not available */
    TH_CHECK(kn_kv_mem_renew_pool(m) == 0 && kn_kv_available(m) == 4);
    kn_kv_mem_destroy(m);
}

/* renew_pool of a named (shared) segment, as a TP follower renews its pool after its
 * leader mapped the old one and unlinked its name: the fresh segment is there under the
 * name for the next leader to map, the old one's mapping stays valid; also when no leader
 * unlinked the name; destroying the memory removes the name. */
static void test_renew_named(void)
{
    char name[64];
    snprintf(name, sizeof name, "/tandem-test-kvmem-%d", (int)getpid());
    kn_kv_pool_params p = params_of(2);
    p.shm_name = name;
    kn_kv_mem *m = NULL;
    TH_REQUIRE(kn_kv_mem_create(&p, &m) == 0);
    for (int unlinked = 1; unlinked >= 0; unlinked--) {
        void *old = NULL, *fresh = NULL;
        size_t bytes = 0, fbytes = 0;
        if (unlinked) { /* the leader maps the segment and unlinks the name */
            TH_REQUIRE(kn_kv_region_map(&p, true, &old, &bytes, NULL) == 0);
            TH_CHECK(kn_kv_region_map(&p, false, &fresh, &fbytes, NULL) == TD_ENOENT);
            ((volatile char *)old)[0] = 1;
        }
        TH_CHECK(kn_kv_mem_renew_pool(m) == 0);
        /* the next leader finds the fresh segment under the name */
        TH_CHECK(kn_kv_region_map(&p, false, &fresh, &fbytes, NULL) == 0 && fbytes > 0);
        if (fresh) ((char *)fresh)[0] = 7;
        TH_CHECK(((char *)kn_kv_pool_array(kn_kv_mem_pool(m), 0))[0] == 7);
        kn_kv_region_unmap(fresh, fbytes);
        kn_kv_region_unmap(old, bytes);
    }
    kn_kv_mem_destroy(m);
    void *r = NULL;
    size_t b = 0;
    TH_CHECK(kn_kv_region_map(&p, false, &r, &b, NULL) == TD_ENOENT); /* the name went */
    kn_kv_region_unmap(r, b);
}

/* The pool's layout is the params': its bytes (a latent block is half a K+V one), and a
 * renewed pool keeps it. */
static void test_layout_kept(void)
{
    kn_kv_mem *m = mem_of(4, true);
    TH_REQUIRE(m);
    const kn_kv_pool *pool = kn_kv_mem_pool(m);
    const size_t arrays = layout == KN_KV_LAYOUT_LATENT ? 1 : 2;
    TH_CHECK(pool->layout == layout && kn_kv_pool_block_bytes(pool) == arrays * 2 * 2 * BS * 4 * 4);
    TH_CHECK(pool->region_bytes == 4 * kn_kv_pool_block_bytes(pool));
    TH_CHECK((pool->v[1] == pool->k[1]) == (arrays == 1));
    TH_REQUIRE(kn_kv_mem_renew_pool(m) == 0);
    pool = kn_kv_mem_pool(m);
    TH_CHECK(pool->layout == layout && pool->region_bytes == 4 * arrays * 2 * 2 * BS * 4 * 4);
    kn_kv_mem_destroy(m);
}

int main(void)
{
    for (int i = 0; i < 2; i++) {
        layout = i ? KN_KV_LAYOUT_LATENT : KN_KV_LAYOUT_KV;
        fprintf(stderr, "layout %s\n", kn_kv_layout_name(layout));
        TH_RUN(test_blocks_without_cache);
        TH_RUN(test_blocks_with_cache);
        TH_RUN(test_seq_reserve_release);
        TH_RUN(test_seq_match_and_commit);
        TH_RUN(test_rollback_private_and_boundary);
        TH_RUN(test_rollback_cached_copies);
        TH_RUN(test_rollback_sole_holder);
        TH_RUN(test_rollback_no_room);
        TH_RUN(test_seq_match_tier);
        TH_RUN(test_renew_pool);
        TH_RUN(test_renew_named);
        TH_RUN(test_layout_kept);
    }
    TH_EXIT();
}
