/* test_kv_cache.c: the prefix cache of a KV pool (kvmem/kv_cache.h), added to a kn_kv_mem as
 * the nodes do (kv_mem.h): sharing and reference counts, LRU eviction order (deepest blocks
 * first), all-or-nothing allocation under pressure, collisions and stale parents caught by
 * the token and parent checks, one cache a mem, destroy giving idle blocks back. */
#include <string.h>

#include "../tharness.h"
/* the cache's source itself: the collision test plants an entry's tokens */
#include "../../kvmem/kv_cache.c"
#include "kv_mem.h"
#include "td_blockhash.h"
#include "td_err.h"

#define BS 4

static kn_kv_pool_params params_of(int n_blocks)
{
    return (kn_kv_pool_params){.n_layers = 1,
                               .n_kv_heads = 1,
                               .head_dim = 4,
                               .block_size = BS,
                               .n_blocks = n_blocks,
                               .type = TD_F32};
}

/* A KV memory of n_blocks with the prefix cache added: *c its cache, *pool (if pool) its pool. */
static kn_kv_mem *mem_of(int n_blocks, kn_kv_cache **c, kn_kv_pool **pool)
{
    kn_kv_pool_params p = params_of(n_blocks);
    kn_kv_mem *m = NULL;
    if (kn_kv_mem_create(&p, &m)) return NULL;
    if (kn_kv_mem_add_cache(m)) {
        kn_kv_mem_destroy(m);
        return NULL;
    }
    *c = kn_kv_mem_cache(m);
    if (pool) *pool = kn_kv_mem_pool(m);
    return m;
}

/* A sequence holding tok[0..n_tok), its whole blocks computed and entered. */
static void enter(kn_kv_cache *c, kn_kv_seq *s, kn_kv_mem *m, const int32_t *tok, int n_tok)
{
    kn_kv_seq_init(s);
    TH_REQUIRE(kn_kv_seq_reserve(m, s, n_tok) == 0);
    kn_kv_chain ch = kn_kv_cache_root();
    for (int b = 0; b < n_tok / BS; b++)
        kn_kv_cache_insert(c, &ch, tok + b * BS, s->blocks[b]);
}

static void test_share_and_refcount(void)
{
    kn_kv_cache *c;
    kn_kv_pool *pool;
    kn_kv_mem *m = mem_of(8, &c, &pool);
    TH_REQUIRE(m);
    TH_CHECK(kn_kv_mem_add_cache(m) == TD_ESTATE && kn_kv_mem_cache(m) == c); /* one a mem */
    int32_t tok[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    kn_kv_seq a;
    enter(c, &a, m, tok, 10); /* 3 blocks, 2 whole: entered */
    TH_CHECK(kn_kv_cache_get_stats(c).cached == 2);
    int32_t got[4];
    kn_kv_chain ch;
    /* the partial third block is never matched; max_blocks caps the match */
    TH_CHECK(kn_kv_cache_match(c, tok, 10, 4, got, &ch) == 2);
    TH_CHECK(got[0] == a.blocks[0] && got[1] == a.blocks[1]);
    TH_CHECK(pool->refs[a.blocks[0]] == 2 && pool->refs[a.blocks[2]] == 1);
    TH_CHECK(kn_kv_cache_match(c, tok, 10, 1, got + 2, &ch) == 1 && pool->refs[got[0]] == 3);
    kn_kv_free(m, 1, got + 2);
    /* another prompt diverging in block 1 shares block 0 only */
    int32_t other[8] = {1, 2, 3, 4, 5, 6, 7, 99};
    int32_t g2[2];
    TH_CHECK(kn_kv_cache_match(c, other, 8, 2, g2, &ch) == 1 && g2[0] == a.blocks[0]);
    kn_kv_free(m, 1, g2);
    /* the owner goes: cached blocks stay (idle only when the sharers are gone too) */
    kn_kv_seq_fini(m, &a);
    TH_CHECK(pool->n_free == 8 - 2 && kn_kv_cache_get_stats(c).idle == 0);
    kn_kv_free(m, 2, got);
    TH_CHECK(kn_kv_cache_get_stats(c).idle == 2 && kn_kv_available(m) == 8);
    /* and match again from idle */
    TH_CHECK(kn_kv_cache_match(c, tok, 8, 2, got, &ch) == 2 && kn_kv_cache_get_stats(c).idle == 0);
    kn_kv_free(m, 2, got);
    /* clear: every entry forgotten, idle blocks free again */
    kn_kv_cache_clear(c);
    TH_CHECK(pool->n_free == 8 && kn_kv_cache_get_stats(c).cached == 0);
    TH_CHECK(kn_kv_cache_match(c, tok, 8, 2, got, &ch) == 0);
    kn_kv_mem_destroy(m);
}

static void test_eviction_order_and_all_or_nothing(void)
{
    kn_kv_cache *c;
    kn_kv_pool *pool;
    kn_kv_mem *m = mem_of(6, &c, &pool);
    TH_REQUIRE(m);
    int32_t x[8] = {1, 1, 1, 1, 2, 2, 2, 2}, y[8] = {3, 3, 3, 3, 4, 4, 4, 4};
    kn_kv_seq a, b;
    enter(c, &a, m, x, 8);
    enter(c, &b, m, y, 8);
    int32_t xa0 = a.blocks[0], xa1 = a.blocks[1], yb0 = b.blocks[0], yb1 = b.blocks[1];
    kn_kv_seq_fini(m, &a); /* idle order: x1, x0 (deepest first) */
    kn_kv_seq_fini(m, &b); /* then y1, y0 */
    TH_CHECK(pool->n_free == 2 && kn_kv_available(m) == 6);
    /* 7 blocks: refused, nothing evicted */
    int32_t ids[7];
    TH_CHECK(kn_kv_alloc(m, 7, ids) == TD_ENOSPC);
    TH_CHECK(kn_kv_cache_get_stats(c).evictions == 0 && kn_kv_cache_get_stats(c).cached == 4);
    /* 3 blocks: the 2 free, then x's deepest block */
    TH_CHECK(kn_kv_alloc(m, 3, ids) == 0);
    kn_kv_cache_stats st = kn_kv_cache_get_stats(c);
    TH_CHECK(st.evictions == 1 && st.cached == 3);
    int has_x1 = 0, has_other = 0;
    for (int i = 0; i < 3; i++)
        has_x1 += ids[i] == xa1, has_other += ids[i] == xa0 || ids[i] == yb0 || ids[i] == yb1;
    TH_CHECK(has_x1 == 1 && has_other == 0);
    int32_t got[2];
    kn_kv_chain ch;
    TH_CHECK(kn_kv_cache_match(c, x, 8, 2, got, &ch) == 1 && got[0] == xa0);
    kn_kv_free(m, 1, got); /* x0 is now the most recent idle: y1, y0, x0 */
    int32_t more[2];
    TH_CHECK(kn_kv_alloc(m, 2, more) == 0);
    TH_CHECK((more[0] == yb1 && more[1] == yb0) || (more[0] == yb0 && more[1] == yb1));
    TH_CHECK(kn_kv_cache_match(c, y, 8, 2, got, &ch) == 0);
    TH_CHECK(kn_kv_cache_get_stats(c).evictions == 3);
    kn_kv_free(m, 3, ids);
    kn_kv_free(m, 2, more);
    TH_CHECK(kn_kv_available(m) == 6); /* every block free or idle: nothing leaked */
    kn_kv_mem_destroy(m);
}

/* An entry's parent evicted and re-entered: its old child must not match through it. */
static void test_stale_parent(void)
{
    kn_kv_cache *c;
    kn_kv_pool *pool;
    kn_kv_mem *m = mem_of(4, &c, &pool);
    TH_REQUIRE(m);
    int32_t x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    kn_kv_seq a;
    enter(c, &a, m, x, 8);
    int32_t child = a.blocks[1];
    /* keep the child referenced, let the parent go idle and be evicted */
    int32_t keep = child;
    kn_kv_pool_ref(pool, keep);
    kn_kv_seq_fini(m, &a);
    int32_t ids[3];
    TH_REQUIRE(kn_kv_alloc(m, 3, ids) == 0); /* 2 free + the idle parent */
    /* the parent's tokens entered again in another block: a new serial */
    kn_kv_chain ch = kn_kv_cache_root();
    TH_CHECK(kn_kv_cache_insert(c, &ch, x, ids[0]));
    int32_t got[2];
    TH_CHECK(kn_kv_cache_match(c, x, 8, 2, got, &ch) == 1 && got[0] == ids[0]);
    kn_kv_free(m, 1, got);
    /* entering the child through the new parent replaces nothing in use: chain breaks */
    ch = kn_kv_cache_root();
    kn_kv_cache_insert(c, &ch, x, ids[0]); /* equal entry: the chain goes on through it */
    TH_CHECK(ch.serial != 0);
    TH_CHECK(!kn_kv_cache_insert(c, &ch, x + 4, ids[1]) && ch.serial == 0);
    kn_kv_free(m, 1, &keep); /* the stale child idle: now it gives way */
    ch = kn_kv_cache_root();
    kn_kv_cache_insert(c, &ch, x, ids[0]);
    TH_CHECK(kn_kv_cache_insert(c, &ch, x + 4, ids[1]));
    TH_CHECK(kn_kv_cache_match(c, x, 8, 2, got, &ch) == 2 && got[1] == ids[1]);
    kn_kv_free(m, 2, got);
    kn_kv_free(m, 3, ids);
    TH_CHECK(kn_kv_available(m) == 4); /* every block free or idle: nothing leaked */
    kn_kv_mem_destroy(m);
}

/* A 64-bit collision cannot be searched for, so the test plants one: the entry of x's block
 * is given other tokens (as if y's tokens had hashed to x's id). A query for x finds the id
 * but must miss on the tokens; an insert under that id breaks the chain while the entry is
 * in use and replaces it once idle. */
static void test_collision_compares_tokens(void)
{
    kn_kv_cache *c;
    kn_kv_pool *pool;
    kn_kv_mem *m = mem_of(4, &c, &pool);
    TH_REQUIRE(m);
    int32_t x[4] = {1, 2, 3, 4}, y[4] = {9, 9, 9, 9};
    kn_kv_seq a, b;
    enter(c, &a, m, x, 4);
    memcpy(c->tok + (size_t)a.blocks[0] * BS, y, sizeof y); /* the planted collision */
    int32_t got[1];
    kn_kv_chain ch;
    TH_CHECK(kn_kv_cache_match(c, x, 4, 1, got, &ch) == 0);
    kn_kv_seq_init(&b);
    TH_REQUIRE(kn_kv_seq_reserve(m, &b, 4) == 0);
    ch = kn_kv_cache_root();
    TH_CHECK(!kn_kv_cache_insert(c, &ch, x, b.blocks[0]) && ch.serial == 0);
    kn_kv_seq_fini(m, &a); /* the colliding entry goes idle */
    ch = kn_kv_cache_root();
    TH_CHECK(kn_kv_cache_insert(c, &ch, x, b.blocks[0]));
    TH_CHECK(kn_kv_cache_match(c, x, 4, 1, got, &ch) == 1 && got[0] == b.blocks[0]);
    kn_kv_free(m, 1, got);
    TH_CHECK(kn_kv_cache_get_stats(c).cached == 1 && pool->n_free == 3);
    kn_kv_seq_fini(m, &b);
    TH_CHECK(kn_kv_available(m) == 4); /* every block free or idle: nothing leaked */
    kn_kv_mem_destroy(m);
}

/* The event log: stored, removed on eviction, cleared; numbering,
 * the bound, and a reader that fell behind the ring learning that it lost events. */
static void test_event_log(void)
{
    kn_kv_cache *c;
    kn_kv_mem *m = mem_of(4, &c, NULL);
    TH_REQUIRE(m);
    TH_CHECK(kn_kv_cache_set_event_log(c, -1) == TD_EINVAL);
    kn_kv_event ev[8];
    uint64_t first;
    TH_CHECK(kn_kv_cache_event_next(c) == 1 && kn_kv_cache_events(c, 1, ev, 8, &first) == 0);
    TH_CHECK(first == 1);
    int32_t x[8] = {1, 1, 1, 1, 2, 2, 2, 2};
    uint64_t h[2];
    TH_REQUIRE(td_block_hashes(x, 8, BS, h) == 2);
    kn_kv_seq a;
    enter(c, &a, m, x, 8);
    TH_CHECK(kn_kv_cache_event_next(c) == 3);
    TH_CHECK(kn_kv_cache_events(c, 1, ev, 8, &first) == 2 && first == 1);
    TH_CHECK(ev[0].kind == KN_KV_EV_STORED && ev[0].id == h[0]);
    TH_CHECK(ev[1].kind == KN_KV_EV_STORED && ev[1].id == h[1]);
    /* entering the same blocks again (another sequence sharing them) logs nothing */
    kn_kv_chain ch = kn_kv_cache_root();
    kn_kv_cache_insert(c, &ch, x, a.blocks[0]);
    TH_CHECK(kn_kv_cache_event_next(c) == 3);
    /* since is inclusive; max bounds the answer */
    TH_CHECK(kn_kv_cache_events(c, 2, ev, 8, &first) == 1 && first == 2 && ev[0].id == h[1]);
    TH_CHECK(kn_kv_cache_events(c, 1, ev, 1, &first) == 1 && ev[0].id == h[0]);
    kn_kv_seq_fini(m, &a); /* idle: x1 then x0 */
    int32_t ids[3];
    TH_REQUIRE(kn_kv_alloc(m, 3, ids) == 0); /* 2 free + evicts x1 (deepest first) */
    TH_CHECK(kn_kv_cache_events(c, 3, ev, 8, &first) == 1 && first == 3);
    TH_CHECK(ev[0].kind == KN_KV_EV_REMOVED && ev[0].id == h[1]);
    kn_kv_cache_clear(c);
    TH_CHECK(kn_kv_cache_events(c, 4, ev, 8, &first) == 1 && ev[0].kind == KN_KV_EV_CLEARED);
    kn_kv_free(m, 3, ids);
    /* overflow: a ring of 3; 6 events (3 prompts of one block, then their evictions) */
    TH_REQUIRE(kn_kv_cache_set_event_log(c, 3) == 0);
    TH_CHECK(kn_kv_cache_events(c, 4, ev, 8, &first) == 0 && first == 5); /* dropped */
    uint64_t ids3[3];
    for (int k = 0; k < 3; k++) {
        int32_t t[BS] = {10 + k, 10 + k, 10 + k, 10 + k};
        TH_REQUIRE(td_block_hashes(t, BS, BS, &ids3[k]) == 1);
        kn_kv_seq s;
        enter(c, &s, m, t, BS);
        kn_kv_seq_fini(m, &s);
    }
    int32_t all[4];
    TH_REQUIRE(kn_kv_alloc(m, 4, all) == 0); /* 1 free + evicts all 3 */
    TH_CHECK(kn_kv_cache_event_next(c) == 11);
    /* a reader at 5 lost 5..7: it gets the 3 kept, from 8, and sees first > since */
    TH_CHECK(kn_kv_cache_events(c, 5, ev, 8, &first) == 3 && first == 8);
    for (int k = 0; k < 3; k++)
        TH_CHECK(ev[k].kind == KN_KV_EV_REMOVED && ev[k].id == ids3[k]);
    /* a reader that is up to date gets nothing, and first is the next seq */
    TH_CHECK(kn_kv_cache_events(c, 11, ev, 8, &first) == 0 && first == 11);
    /* no log: nothing kept, numbering goes on */
    kn_kv_free(m, 4, all);
    TH_REQUIRE(kn_kv_cache_set_event_log(c, 0) == 0);
    kn_kv_cache_clear(c);
    TH_CHECK(kn_kv_cache_event_next(c) == 12);
    TH_CHECK(kn_kv_cache_events(c, 11, ev, 8, &first) == 0 && first == 12);
    kn_kv_mem_destroy(m);
}

/* A cache made by hand over a pool (kn_kv_cache_create) is attached to nothing: its blocks
 * are taken and given back with kn_kv_cache_alloc/free, which keep and evict; the pool's own
 * allocator does not see its idle blocks; destroy gives them back to the free list. */
static void test_hand_made_cache(void)
{
    kn_kv_pool_params p = params_of(4);
    kn_kv_pool *pool = NULL;
    kn_kv_cache *c = NULL;
    TH_REQUIRE(kn_kv_pool_create(&p, &pool) == 0);
    TH_REQUIRE(kn_kv_cache_create(pool, &c) == 0);
    int32_t x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, ids[4];
    TH_REQUIRE(kn_kv_cache_alloc(c, 2, ids) == 0);
    kn_kv_chain ch = kn_kv_cache_root();
    TH_CHECK(kn_kv_cache_insert(c, &ch, x, ids[0]) && kn_kv_cache_insert(c, &ch, x + 4, ids[1]));
    kn_kv_cache_free(c, 2, ids); /* both idle: kept, off the free list */
    TH_CHECK(pool->n_free == 2 && kn_kv_cache_available(c) == 4);
    TH_CHECK(kn_kv_pool_take(pool, 3, ids) == TD_ENOSPC); /* the pool alone evicts nothing */
    TH_CHECK(kn_kv_cache_alloc(c, 3, ids) == 0 && kn_kv_cache_get_stats(c).evictions == 1);
    TH_CHECK(kn_kv_cache_alloc(c, 2, ids + 3) == TD_ENOSPC &&
             kn_kv_cache_alloc(c, -1, ids) == TD_EINVAL);
    kn_kv_cache_free(c, 3, ids);
    TH_CHECK(pool->n_free == 3 && kn_kv_cache_get_stats(c).idle == 1);
    kn_kv_cache_destroy(c);
    TH_CHECK(pool->n_free == 4); /* the idle block went back */
    kn_kv_pool_destroy(pool);
}

int main(void)
{
    TH_RUN(test_share_and_refcount);
    TH_RUN(test_eviction_order_and_all_or_nothing);
    TH_RUN(test_stale_parent);
    TH_RUN(test_collision_compares_tokens);
    TH_RUN(test_event_log);
    TH_RUN(test_hand_made_cache);
    TH_EXIT();
}
