/* test_rt_unit_cache.c: cache-aware routing without processes: the per-instance prefix
 * index (matches of chained block ids, LRU eviction bounded by the pool with prefixes
 * outliving their extensions, removal by id as a KV event would do, a random workload
 * against a reference model), SGLang's choice (longest match, cache_threshold, the
 * balance thresholds, the distinguishing match beyond a shared prefix and forks), and the
 * routing over a hand-made registry: a conversation stays where its prefix is, new
 * conversations sharing a system prompt spread by load instead of following the first one,
 * load routing ignores it, and a restart (new boot id, uptime going back) or a death drops
 * the instance's index; the index fed by KV events (exact, gaps, bad reports, restarts). */
#include <stdlib.h>
#include <string.h>

#include "rt_cache.h"
#include "rt_registry.h"
#include "rt_route.h"
#include "td_blockhash.h"
#include "td_err.h"
#include "tharness.h"

#define BS 4 /* tokens per block in these tests */

/* tokens[0..n) = base + k (k = 0..n) */
static void fill(int32_t *t, size_t n, int32_t base)
{
    for (size_t k = 0; k < n; k++)
        t[k] = base + (int32_t)k;
}

static void test_index_match(void)
{
    rt_cidx x = {0};
    int32_t a[40], b[40];
    uint64_t ia[10], ib[10];
    fill(a, 40, 100);
    memcpy(b, a, sizeof b);
    b[21] = -1; /* b shares a's first 5 blocks (tokens 0..19) and differs in block 5 */
    TH_CHECK(td_block_hashes(a, 40, BS, ia) == 10 && td_block_hashes(b, 40, BS, ib) == 10);
    TH_CHECK(rt_cidx_insert(&x, ia, 10) == 0 && x.n == 0); /* unconfigured: nothing kept */
    rt_cidx_configure(&x, BS, 100);
    TH_CHECK(rt_cidx_match(&x, ia, 10) == 0);
    TH_CHECK(rt_cidx_insert(&x, ia, 6) == 0 && x.n == 6);
    TH_CHECK(rt_cidx_match(&x, ia, 10) == 6); /* a longer prompt: its first 6 blocks */
    TH_CHECK(rt_cidx_match(&x, ib, 10) == 5); /* a sibling: the shared part */
    TH_CHECK(rt_cidx_insert(&x, ia, 10) == 0 && x.n == 10);
    TH_CHECK(rt_cidx_insert(&x, ib, 10) == 0 && x.n == 15);
    TH_CHECK(rt_cidx_match(&x, ib, 10) == 10 && rt_cidx_match(&x, ia, 10) == 10);
    /* an event: block 2 gone, so nothing after it matches (ids are chained) */
    TH_CHECK(rt_cidx_remove(&x, ia[2]) && !rt_cidx_remove(&x, ia[2]));
    TH_CHECK(rt_cidx_match(&x, ia, 10) == 2 && rt_cidx_match(&x, ib, 10) == 2 && x.n == 14);
    /* another block size: other ids, the index starts over */
    rt_cidx_configure(&x, 2 * BS, 100);
    TH_CHECK(x.n == 0 && rt_cidx_match(&x, ia, 10) == 0);
    rt_cidx_fini(&x);
}

static void test_index_lru(void)
{
    rt_cidx x = {0};
    rt_cidx_configure(&x, BS, 8);
    int32_t a[32], b[32];
    uint64_t ia[8], ib[8];
    fill(a, 32, 0);
    fill(b, 32, 1000);
    td_block_hashes(a, 32, BS, ia);
    td_block_hashes(b, 32, BS, ib);
    rt_cidx_insert(&x, ia, 6);
    rt_cidx_insert(&x, ib, 4); /* 10 > 8: a's 2 deepest blocks go, its prefix stays */
    TH_CHECK(x.n == 8);
    TH_CHECK(rt_cidx_match(&x, ia, 8) == 4 && rt_cidx_match(&x, ib, 8) == 4);
    rt_cidx_insert(&x, ia, 2); /* a[0..1] most recent; a[2..3] now the least recent */
    rt_cidx_insert(&x, ia, 5); /* a[4], a[3], a[2] come back in place of a[3], a[2], b[3] */
    TH_CHECK(rt_cidx_match(&x, ia, 8) == 5 && rt_cidx_match(&x, ib, 8) == 3);
    /* a smaller pool (the instance restarted smaller, or reports so): LRU first */
    rt_cidx_configure(&x, BS, 5);
    TH_CHECK(x.n == 5 && rt_cidx_match(&x, ia, 8) == 5 && rt_cidx_match(&x, ib, 8) == 0);
    /* a prompt longer than the pool keeps its first blocks */
    rt_cidx_insert(&x, ib, 8);
    TH_CHECK(x.n == 5 && rt_cidx_match(&x, ib, 8) == 5 && rt_cidx_match(&x, ia, 8) == 0);
    rt_cidx_clear(&x);
    TH_CHECK(x.n == 0 && rt_cidx_match(&x, ib, 8) == 0);
    rt_cidx_insert(&x, ib, 3); /* usable after a clear: block size and capacity kept */
    TH_CHECK(rt_cidx_match(&x, ib, 8) == 3);
    rt_cidx_fini(&x);
}

/* Random inserts and removes against a reference (an array in LRU order, most recent
 * first): the table's probing and backward-shift deletion, the node moves, the list. */
static void test_index_random(void)
{
    enum { CAP = 300, IDS = 1000, OPS = 20000 };
    rt_cidx x = {0};
    rt_cidx_configure(&x, BS, CAP);
    uint64_t *ref = calloc(CAP + 1, sizeof *ref);
    int n_ref = 0;
    srand(7);
    int bad = 0;
    for (int op = 0; op < OPS && !bad; op++) {
        /* few distinct ids: hits, evictions and removals all happen often; some ids share
           their low bits, so probe runs form */
        uint64_t id = (uint64_t)(rand() % IDS) * (rand() % 2 ? 1 : (1ull << 40));
        int at = -1;
        for (int k = 0; k < n_ref; k++)
            if (ref[k] == id) at = k;
        if (rand() % 4 == 0) {
            bool had = rt_cidx_remove(&x, id);
            bad |= had != (at >= 0);
            if (at >= 0) memmove(ref + at, ref + at + 1, (size_t)(n_ref - at - 1) * sizeof *ref);
            if (at >= 0) n_ref--;
        } else {
            rt_cidx_insert(&x, &id, 1);
            if (at >= 0) {
                memmove(ref + 1, ref, (size_t)at * sizeof *ref);
            } else {
                memmove(ref + 1, ref, (size_t)(n_ref < CAP ? n_ref : CAP - 1) * sizeof *ref);
                if (n_ref < CAP) n_ref++;
            }
            ref[0] = id;
        }
        bad |= (int)x.n != n_ref;
        if (op % 97 == 0) /* the whole content, and the LRU order */
            for (int k = 0; k < n_ref; k++)
                bad |= rt_cidx_match(&x, &ref[k], 1) != 1;
    }
    TH_CHECKF(!bad, "index and reference disagree");
    uint32_t k = x.head;
    for (int i = 0; i < n_ref && k != RT_CIDX_NIL; i++, k = x.node[k].next)
        bad |= x.node[k].id != ref[i];
    TH_CHECKF(!bad && x.n == (uint32_t)n_ref, "LRU order differs from the reference");
    free(ref);
    rt_cidx_fini(&x);
}

static void test_choose(void)
{
    td_cfg_cache_aware p = {
        .cache_threshold = 0.5, .balance_abs_threshold = 32, .balance_rel_threshold = 1.1};
    rt_route_why why;
    int sk;
    /* c[0] is the load order's choice */
    rt_cache_cand c[3] = {{0, 5, 0, false}, {1, 6, 80, false}, {2, 2, 40, false}};
    TH_CHECK(rt_cache_choose(c, 3, 100, &p, &why, &sk) == 1 && why == RT_ROUTE_BY_CACHE &&
             sk == -1);
    /* a match at or below the threshold: the load order */
    TH_CHECK(rt_cache_choose(c, 3, 160, &p, &why, &sk) == 0 && why == RT_ROUTE_BY_LOAD);
    p.cache_threshold = 0;
    TH_CHECK(rt_cache_choose(c, 3, 160, &p, &why, &sk) == 1 && why == RT_ROUTE_BY_CACHE);
    c[1].matched = c[2].matched = 0; /* nothing matches anywhere: the load order */
    TH_CHECK(rt_cache_choose(c, 3, 160, &p, &why, &sk) == 0 && why == RT_ROUTE_BY_LOAD);
    /* equal matches: the less loaded */
    c[1].matched = c[2].matched = 40;
    TH_CHECK(rt_cache_choose(c, 3, 100, &p, &why, &sk) == 2);
    /* overloaded: more than abs AND more than rel x the least loaded */
    c[2].matched = 0;
    c[1].load = 2 + 33; /* 33 more than c[2]'s 2, and 17.5 x: overloaded */
    TH_CHECK(rt_cache_choose(c, 3, 100, &p, &why, &sk) == 2 && why == RT_ROUTE_OVERLOADED &&
             sk == 1);
    c[1].load = 2 + 32; /* exactly abs more: not overloaded */
    TH_CHECK(rt_cache_choose(c, 3, 100, &p, &why, &sk) == 1 && why == RT_ROUTE_BY_CACHE);
    p.balance_abs_threshold = 2;
    c[1].load = 300;
    c[0].load = c[2].load = 280; /* 20 more but only 1.07 x: not overloaded */
    TH_CHECK(rt_cache_choose(c, 3, 100, &p, &why, &sk) == 1 && why == RT_ROUTE_BY_CACHE);
    c[2].load = 200; /* 1.5 x the least loaded (c[2]); c[0] is not: c[2] takes it */
    TH_CHECK(rt_cache_choose(c, 3, 100, &p, &why, &sk) == 2 && why == RT_ROUTE_OVERLOADED);
    c[0].load = 200; /* equally least loaded: the load order's choice */
    TH_CHECK(rt_cache_choose(c, 3, 100, &p, &why, &sk) == 0 && why == RT_ROUTE_OVERLOADED);
    /* one candidate: it holds everything any candidate holds, nothing distinguishes it */
    TH_CHECK(rt_cache_choose(&c[1], 1, 100, &p, &why, &sk) == 0 && why == RT_ROUTE_BY_LOAD);
}

/* The old policy's mistake: a match that is a prefix shared by all conversations (a system
 * prompt) decided. The choice scores the match beyond what every candidate holds, and a
 * match ending at a fork (another prompt went on differently there) counts for nothing. */
static void test_choose_shared(void)
{
    td_cfg_cache_aware p = {
        .cache_threshold = 0.5, .balance_abs_threshold = 32, .balance_rel_threshold = 1.1};
    rt_route_why why;
    int sk;
    /* a new conversation: d1 (c[1]) got another one with the same 64-token system prompt,
       which its match ends at (a fork); the old policy sent it to d1 (64 of 80 > 0.5) */
    rt_cache_cand c[2] = {{0, 0, 0, false}, {1, 1, 64, true}};
    TH_CHECK(rt_cache_choose(c, 2, 80, &p, &why, &sk) == 0 && why == RT_ROUTE_BY_LOAD);
    c[1].fork = false; /* the same match as the end of a prompt sent there: its history */
    TH_CHECK(rt_cache_choose(c, 2, 80, &p, &why, &sk) == 1 && why == RT_ROUTE_BY_CACHE);
    /* both hold the system prompt (64); d1 also this conversation's history (32 more) */
    c[0].matched = 64;
    c[1].matched = 96;
    TH_CHECK(rt_cache_choose(c, 2, 112, &p, &why, &sk) == 1 && why == RT_ROUTE_BY_CACHE);
    /* a history short against the rest of the prompt beyond the shared part (16 of 48) */
    c[1].matched = 80;
    TH_CHECK(rt_cache_choose(c, 2, 112, &p, &why, &sk) == 0 && why == RT_ROUTE_BY_LOAD);
    /* the old policy's pick in this case was d1 (80 of 112 > 0.5): the shared part decided */
    p.cache_threshold = 0.3; /* 16 / 48 = 0.33 > 0.3 */
    TH_CHECK(rt_cache_choose(c, 2, 112, &p, &why, &sk) == 1 && why == RT_ROUTE_BY_CACHE);
    /* the longer distinguishing match wins over a longer total match that forks */
    rt_cache_cand e[3] = {{0, 0, 64, false}, {1, 0, 128, true}, {2, 3, 96, false}};
    TH_CHECK(rt_cache_choose(e, 3, 140, &p, &why, &sk) == 2 && why == RT_ROUTE_BY_CACHE);
}

/* A health report of a decode instance with a pool of 64 blocks of BS tokens. */
static Td__Health health(uint64_t boot, uint64_t uptime)
{
    Td__Health h = TD__HEALTH__INIT;
    h.ready = true;
    h.role = TD__ROLE__ROLE_DECODE;
    h.kv_block_size = BS;
    h.kv_blocks_free = 60;
    h.kv_blocks_used = 4;
    h.boot_id = boot;
    h.uptime_ms = uptime;
    return h;
}

/* Route a prompt to a decode instance and commit it, as rt_loop_dispatch does. */
static int route(rt_registry *g, const td_cfg_router *rc, const int32_t *t, size_t n,
                 rt_route_pick *pk)
{
    int i = rt_route_decode(g, rc, t, n, 0, pk);
    if (i >= 0) rt_route_commit(g, g->inst, t, n, pk);
    return i;
}

/* A Health's events, built as the decode node does (dc_serve.c health_events). */
typedef struct {
    uint64_t ids[64];
    uint8_t kind[32];
    size_t n_ids, n_ev;
} evs;

static void ev_stored(evs *e, uint64_t id)
{
    e->kind[e->n_ev++] = 1;
    e->ids[e->n_ids++] = id;
}

static void ev_removed(evs *e, uint64_t id)
{
    e->kind[e->n_ev++] = 2;
    e->ids[e->n_ids++] = id;
}

static int apply(rt_cidx *x, uint64_t first, const evs *e, size_t from, rt_cidx_ev_result *r)
{
    size_t skip_ids = 0;
    for (size_t k = 0; k < from; k++)
        skip_ids += e->kind[k] != 3;
    return rt_cidx_events(x, first, e->kind + from, e->n_ev - from, e->ids + skip_ids,
                          e->n_ids - skip_ids, r);
}

/* The index fed by KV events: exact from the node's first event, a repeated window applied
 * once, removal and clear, forks from the parents, a gap (dropped, the estimate again), bad
 * reports refused whole, a node without events. */
static void test_index_events(void)
{
    rt_cidx x = {0};
    rt_cidx_configure(&x, BS, 64);
    int32_t a[16], b[16];
    uint64_t ia[4], ib[4];
    fill(a, 16, 300);
    memcpy(b, a, sizeof b);
    b[9] = -1; /* b forks from a after 2 blocks */
    TH_REQUIRE(td_block_hashes(a, 16, BS, ia) == 4 && td_block_hashes(b, 16, BS, ib) == 4);
    evs e = {0};
    ev_stored(&e, ia[0]);
    ev_stored(&e, ia[1]);
    ev_stored(&e, ia[2]);
    rt_cidx_ev_result r;
    TH_CHECK(apply(&x, 1, &e, 0, &r) == 0 && r.applied == 3 && !r.gap);
    TH_CHECK(x.exact && x.ev_next == 4 && x.n == 3 && rt_cidx_match(&x, ia, 4) == 3);
    /* exact: what the router sends adds nothing (the node says what it stored), but which
       block follows which in it is noted */
    TH_CHECK(rt_cidx_insert(&x, ib, 4) == 0 && x.n == 3);
    TH_CHECK(!rt_cidx_forks(&x, ia, 4, 2)); /* b's third block is not on the node yet */
    /* the same window again, then longer: only the new events count */
    TH_CHECK(apply(&x, 1, &e, 0, &r) == 0 && r.applied == 0 && x.n == 3);
    ev_stored(&e, ib[2]); /* b's third block, there now: a's second block forks */
    ev_removed(&e, ia[2]);
    TH_CHECK(apply(&x, 1, &e, 0, &r) == 0 && r.applied == 2 && x.ev_next == 6);
    TH_CHECK(x.n == 3 && rt_cidx_match(&x, ia, 4) == 2 && rt_cidx_match(&x, ib, 4) == 3);
    TH_CHECK(rt_cidx_forks(&x, ia, 4, 2)); /* b continued a[0..8) with another block than a */
    /* a window that slid (starts at 3): still contiguous, nothing lost */
    e.kind[e.n_ev++] = 3; /* cleared */
    TH_CHECK(apply(&x, 3, &e, 2, &r) == 0 && r.applied == 1 && x.n == 0 && x.exact);
    /* refused whole: ids that do not fit the kinds, an unknown kind */
    evs bad = {0};
    ev_stored(&bad, ia[0]);
    bad.n_ids = 0;
    TH_CHECK(apply(&x, 7, &bad, 0, &r) == TD_EINVAL && x.n == 0 && x.ev_next == 7);
    bad.n_ids = 1;
    bad.kind[0] = 9;
    TH_CHECK(apply(&x, 7, &bad, 0, &r) == TD_EINVAL && x.ev_next == 7);
    /* a gap: the report starts at 9, event 7..8 were lost: dropped, the estimate again */
    evs g = {0};
    ev_stored(&g, ia[0]);
    TH_CHECK(apply(&x, 7, &g, 0, &r) == 0 && x.n == 1 && x.ev_next == 8);
    evs g2 = {0};
    ev_stored(&g2, ib[0]);
    ev_stored(&g2, ib[1]);
    TH_CHECK(apply(&x, 9, &g2, 0, &r) == 0 && r.gap && r.applied == 2 && !x.exact);
    TH_CHECK(x.n == 2 && rt_cidx_match(&x, ia, 4) == 2 && x.ev_next == 11);
    /* not exact: the prompts sent here count again, corrected by later events */
    TH_CHECK(rt_cidx_insert(&x, ia, 4) == 0 && rt_cidx_match(&x, ia, 4) == 4);
    evs g3 = {0};
    ev_removed(&g3, ia[3]);
    TH_CHECK(apply(&x, 11, &g3, 0, &r) == 0 && !r.gap && rt_cidx_match(&x, ia, 4) == 3);
    /* a node that sends no events: the estimate, the index kept */
    TH_CHECK(rt_cidx_events(&x, 0, NULL, 0, NULL, 0, &r) == 0 && !x.exact && x.ev_next == 0);
    TH_CHECK(x.n == 3);
    /* a new process's whole history (seq 1): exact again, from nothing */
    TH_CHECK(apply(&x, 1, &g2, 0, &r) == 0 && !r.gap && x.exact && x.n == 2);
    TH_CHECK(rt_cidx_match(&x, ia, 4) == 2 && rt_cidx_match(&x, ib, 4) == 2);
    /* numbering that went back without a restart seen: dropped (a gap), not exact */
    TH_CHECK(apply(&x, 3, &g3, 0, &r) == 0 && x.ev_next == 4 && x.n == 2);
    TH_CHECK(apply(&x, 2, &g3, 0, &r) == 0 && r.gap && !x.exact && x.n == 0);
    /* the node cleared its cache: exact again from there */
    TH_CHECK(rt_cidx_insert(&x, ia, 2) == 0 && x.n == 2); /* the estimate meanwhile */
    evs cl = {.kind = {3}, .n_ev = 1};
    TH_CHECK(apply(&x, 3, &cl, 0, &r) == 0 && r.applied == 1 && x.exact && x.n == 0);
    rt_cidx_fini(&x);
}

/* Two live instances d0, d1 (boot ids boot, boot + 1) seen once; the cache-aware config
 * the route tests use. */
static td_cfg_router two_instances(rt_inst d[2], uint64_t boot)
{
    for (int i = 0; i < 2; i++) {
        d[i].cap = 100;
        d[i].name = i ? "d1" : "d0";
        Td__Health h = health(boot + (uint64_t)i, 1000);
        rt_reg_seen(&d[i], &h, 0);
    }
    return (td_cfg_router){.routing = TD_CFG_ROUTING_CACHE_AWARE,
                           .cache_aware = {.cache_threshold = 0.5,
                                           .balance_abs_threshold = 32,
                                           .balance_rel_threshold = 1.1}};
}

static void test_route(void)
{
    rt_inst d[2] = {0};
    rt_registry g = {.inst = d, .n = 2};
    td_cfg_router rc = two_instances(d, 10);
    for (int i = 0; i < 2; i++)
        TH_CHECK(d[i].alive && d[i].cidx.block_size == BS && d[i].cidx.capacity == 64);
    d[1].kv_free = 70; /* the load order prefers d1 */
    int32_t conv[64];
    fill(conv, 64, 7);
    rt_route_pick pk;
    /* turn 1 (16 tokens): nothing cached anywhere, the load order */
    TH_CHECK(route(&g, &rc, conv, 16, &pk) == 1 && pk.why == RT_ROUTE_BY_LOAD);
    TH_CHECK(d[1].cidx.n == 4 && d[0].cidx.n == 0 && d[1].cst.by_load == 1);
    /* turns 2.. grow the prefix: they stay on d1 even when the load order says d0 */
    d[0].kv_free = 90;
    d[1].active = 3;
    TH_CHECK(route(&g, &rc, conv, 24, &pk) == 1 && pk.why == RT_ROUTE_BY_CACHE && pk.matched == 16);
    TH_CHECK(route(&g, &rc, conv, 40, &pk) == 1 && pk.matched == 24);
    TH_CHECK(d[1].cst.by_cache == 2 && d[1].cst.matched_tokens == 40 && d[1].cst.blocks == 10);
    /* another conversation: no match, the load order (d0) */
    int32_t other[24];
    fill(other, 24, 5000);
    TH_CHECK(route(&g, &rc, other, 24, &pk) == 0 && pk.why == RT_ROUTE_BY_LOAD);
    /* d1 overloaded: the least loaded takes the turn, counted against d1 */
    d[1].active = 40;
    TH_CHECK(route(&g, &rc, conv, 48, &pk) == 0 && pk.why == RT_ROUTE_OVERLOADED &&
             pk.skipped == 1 && d[1].cst.overloaded == 1);
    d[1].active = 0;
    /* routing: load ignores the index and leaves it alone */
    rc.routing = TD_CFG_ROUTING_LOAD;
    uint32_t n0 = d[0].cidx.n;
    TH_CHECK(route(&g, &rc, conv, 56, &pk) == 0 && !pk.cache_aware && d[0].cidx.n == n0);
    rc.routing = TD_CFG_ROUTING_CACHE_AWARE;
    /* both hold 12 blocks of conv now (d0 from the overloaded turn): the longer match */
    TH_CHECK(route(&g, &rc, conv, 64, &pk) == 0 && pk.matched == 48);

    /* a restart seen in Health: a new boot id drops the index */
    TH_CHECK(d[1].cidx.n > 0);
    Td__Health h = health(99, 5000);
    rt_reg_seen(&d[1], &h, 0);
    TH_CHECK(d[1].cidx.n == 0 && d[1].cst.drops == 1 && d[1].boot_id == 99);
    /* the same process again: kept */
    route(&g, &rc, other, 24, &pk); /* on d0 (it matches there) */
    d[0].kv_free = 10;              /* the load order now prefers d1 */
    int32_t third[32];
    fill(third, 32, 9000);
    TH_CHECK(route(&g, &rc, third, 32, &pk) == 1 && d[1].cidx.n == 8);
    h = health(99, 6000);
    rt_reg_seen(&d[1], &h, 0);
    TH_CHECK(d[1].cidx.n == 8);
    /* the control client's restart notice of that same process (epoch == boot id): kept */
    rt_reg_restarted(&d[1], 99);
    TH_CHECK(d[1].cidx.n == 8 && d[1].cst.drops == 1);
    /* a notice before the new process's Health: dropped once, not again by the Health */
    rt_reg_restarted(&d[1], 123);
    TH_CHECK(d[1].cidx.n == 0 && d[1].cst.drops == 2);
    route(&g, &rc, third, 32, &pk);
    h = health(123, 50);
    rt_reg_seen(&d[1], &h, 0);
    TH_CHECK(d[1].cidx.n == 8 && d[1].cst.drops == 2);
    /* a node that sends no boot id: an uptime that went back */
    h = health(0, 10);
    rt_reg_seen(&d[1], &h, 0);
    TH_CHECK(d[1].cidx.n == 0 && d[1].cst.drops == 3);
    /* stale knowledge is not used: `third` no longer matches on d1 (the load order's) */
    TH_CHECK(route(&g, &rc, third, 32, &pk) == 1 && pk.why == RT_ROUTE_BY_LOAD);
    /* rt_reg_forget (restart by event epoch, marked dead) */
    rt_reg_forget(&d[0], "test");
    TH_CHECK(d[0].cidx.n == 0 && d[0].cst.drops == 1 && d[0].cst.blocks == 0);
    TH_CHECK(route(&g, &rc, conv, 64, &pk) == 1 && pk.why == RT_ROUTE_BY_LOAD);
    /* a dead or full instance is never chosen for its match */
    TH_CHECK(route(&g, &rc, conv, 64, &pk) == 1 && pk.why == RT_ROUTE_BY_CACHE);
    d[1].active = d[1].cap;
    TH_CHECK(route(&g, &rc, conv, 64, &pk) == 0 && pk.why == RT_ROUTE_BY_LOAD);
    d[1].active = 0;
    d[1].alive = false;
    TH_CHECK(rt_route_decode(&g, &rc, conv, 64, 0, &pk) == 0);
    d[0].alive = false;
    TH_CHECK(rt_route_decode(&g, &rc, conv, 64, 0, &pk) == -1);
    for (int i = 0; i < 2; i++)
        rt_cidx_fini(&d[i].cidx);
    rt_cache_ids_fini(&g.ids);
}

/* A decode instance whose Health carries KV events: its index is what the node reported
 * (not what was routed there), matched by the next turn; a gap is counted and the prompts
 * sent there count again; a restart starts over from the new process's events. */
static void test_route_events(void)
{
    rt_inst d[1] = {0};
    rt_registry g = {.inst = d, .n = 1};
    td_cfg_router rc = {.routing = TD_CFG_ROUTING_CACHE_AWARE,
                        .cache_aware = {.cache_threshold = 0.5,
                                        .balance_abs_threshold = 32,
                                        .balance_rel_threshold = 1.1}};
    d[0].cap = 100;
    d[0].name = "d0";
    Td__Health h = health(7, 100);
    h.kv_event_seq = 1; /* a node with events, none yet */
    rt_reg_seen(&d[0], &h, 0);
    TH_CHECK(d[0].alive && d[0].cst.exact && d[0].cidx.n == 0);
    int32_t conv[24];
    fill(conv, 24, 40);
    uint64_t ids[6];
    TH_REQUIRE(td_block_hashes(conv, 24, BS, ids) == 6);
    rt_route_pick pk;
    TH_CHECK(route(&g, &rc, conv, 16, &pk) == 0 && d[0].cidx.n == 0); /* no guess */
    /* the node computed the prompt and 4 generated tokens: 5 blocks */
    evs e = {0};
    for (int k = 0; k < 5; k++)
        ev_stored(&e, ids[k]);
    h.kv_event_seq = 1;
    h.kv_event_kind = (ProtobufCBinaryData){.len = e.n_ev, .data = e.kind};
    h.kv_event_ids = e.ids;
    h.n_kv_event_ids = e.n_ids;
    rt_reg_seen(&d[0], &h, 0);
    TH_CHECK(d[0].cidx.n == 5 && d[0].cst.blocks == 5 && d[0].cst.events == 5);
    rt_reg_seen(&d[0], &h, 0); /* the same report again (a poll's piggy-backed Health) */
    TH_CHECK(d[0].cst.events == 5);
    TH_CHECK(route(&g, &rc, conv, 24, &pk) == 0 && pk.matched == 20);
    /* a report from seq 20: 6..19 lost */
    evs e2 = {0};
    ev_removed(&e2, ids[4]);
    h.kv_event_seq = 20;
    h.kv_event_kind = (ProtobufCBinaryData){.len = e2.n_ev, .data = e2.kind};
    h.kv_event_ids = e2.ids;
    h.n_kv_event_ids = e2.n_ids;
    rt_reg_seen(&d[0], &h, 0);
    TH_CHECK(d[0].cst.event_gaps == 1 && !d[0].cst.exact && d[0].cidx.n == 0);
    route(&g, &rc, conv, 24, &pk); /* the estimate again */
    TH_CHECK(d[0].cidx.n == 6);
    /* malformed: refused, the estimate kept */
    h.kv_event_seq = 21;
    h.n_kv_event_ids = 0;
    rt_reg_seen(&d[0], &h, 0);
    TH_CHECK(d[0].ev_warned && d[0].cidx.n == 6 && d[0].cidx.ev_next == 0);
    /* a restart: the new process's history from seq 1, exact again */
    h = health(8, 10);
    h.kv_event_seq = 1;
    h.kv_event_kind = (ProtobufCBinaryData){.len = 2, .data = e.kind};
    h.kv_event_ids = e.ids;
    h.n_kv_event_ids = 2;
    rt_reg_seen(&d[0], &h, 0);
    TH_CHECK(d[0].cst.exact && d[0].cidx.n == 2 && d[0].cst.drops == 1);
    rt_cidx_fini(&d[0].cidx);
    rt_cache_ids_fini(&g.ids);
}

/* Conversations with one system prompt on two instances: the first turns spread by load,
 * each conversation then stays where its history is (the old policy sent them all to the
 * instance that took the first one, and kept them there). */
static void test_route_shared(void)
{
    rt_inst d[2] = {0};
    rt_registry g = {.inst = d, .n = 2};
    td_cfg_router rc = two_instances(d, 20);
    enum { SYS = 40, T1 = 64, NC = 4, LEN = 128 };
    int32_t conv[NC][LEN];
    for (int k = 0; k < NC; k++) {
        fill(conv[k], LEN, 1000 * (k + 1));
        fill(conv[k], SYS, 7); /* the shared system prompt: 10 blocks */
    }
    rt_route_pick pk;
    int home[NC];
    for (int k = 0; k < NC; k++) { /* turn 1 of each, the others still running */
        home[k] = route(&g, &rc, conv[k], T1, &pk);
        TH_CHECKF(pk.why == RT_ROUTE_BY_LOAD, "conversation %d turn 1 routed by cache", k);
        d[home[k]].active++;
    }
    TH_CHECK(d[0].active == 2 && d[1].active == 2); /* spread, not all on one instance */
    for (int turn = 2; turn <= 6; turn++) {
        for (int k = 0; k < NC; k++) { /* the load order now always prefers the other one */
            d[home[k]].kv_free = 10;
            d[1 - home[k]].kv_free = 50;
            int i = route(&g, &rc, conv[k], T1 + 12 * (size_t)(turn - 1), &pk);
            TH_CHECKF(i == home[k] && pk.why == RT_ROUTE_BY_CACHE,
                      "conversation %d turn %d went to d%d (%d), not its home d%d", k, turn, i,
                      (int)pk.why, home[k]);
        }
    }
    for (int i = 0; i < 2; i++)
        rt_cidx_fini(&d[i].cidx);
    rt_cache_ids_fini(&g.ids);
}

/* Prefill instances: the same policy, never the instance to avoid. */
static void test_route_prefill(void)
{
    rt_inst p[2] = {0};
    td_cfg_prefill pc = {0};
    rt_registry g = {.pf = p, .n_pf = 2};
    td_cfg_router rc = {.routing = TD_CFG_ROUTING_CACHE_AWARE,
                        .cache_aware = {.cache_threshold = 0.5,
                                        .balance_abs_threshold = 32,
                                        .balance_rel_threshold = 1.1}};
    for (int j = 0; j < 2; j++) {
        p[j].cap = 10;
        p[j].pcfg = &pc;
        Td__Health h = health(1 + (uint64_t)j, 10);
        h.role = TD__ROLE__ROLE_PREFILL;
        rt_reg_seen(&p[j], &h, 0);
    }
    int32_t t[32];
    fill(t, 32, 3);
    rt_route_pick pk;
    int j = rt_route_prefill(&g, &rc, t, 32, 0, -1, &pk);
    TH_REQUIRE(j >= 0);
    rt_route_commit(&g, g.pf, t, 32, &pk);
    for (int k = 0; k < 4; k++) /* idle instances alternate in the load order: the match wins */
        TH_CHECK(rt_route_prefill(&g, &rc, t, 32, 0, -1, &pk) == j && pk.why == RT_ROUTE_BY_CACHE);
    TH_CHECK(rt_route_prefill(&g, &rc, t, 32, 0, j, &pk) == 1 - j && pk.matched == 0);
    for (int k = 0; k < 2; k++)
        rt_cidx_fini(&p[k].cidx);
    rt_cache_ids_fini(&g.ids);
}

/* Prefill leaders' KV events (stage 0's cache): the index is bounded by the cache's budget
 * (Health.prefix_cache_blocks), not the requests' pool; it is exact from the events; a stage
 * chain re-formed (same leader process, same boot id) clears it by a CLEARED event, and the
 * next request goes by load, not by the stale match. */
static void test_route_prefill_events(void)
{
    rt_inst p[2] = {0};
    td_cfg_prefill pc = {0};
    rt_registry g = {.pf = p, .n_pf = 2};
    td_cfg_router rc = {.routing = TD_CFG_ROUTING_CACHE_AWARE,
                        .cache_aware = {.cache_threshold = 0.5,
                                        .balance_abs_threshold = 32,
                                        .balance_rel_threshold = 1.1}};
    int32_t t[32];
    fill(t, 32, 5);
    uint64_t ids[8];
    TH_REQUIRE(td_block_hashes(t, 32, BS, ids) == 8);
    evs e = {0};
    e.kind[e.n_ev++] = 3; /* the start-up formation's flush */
    for (int k = 0; k < 6; k++)
        ev_stored(&e, ids[k]);
    Td__Health h[2];
    for (int j = 0; j < 2; j++) {
        p[j].cap = 10;
        p[j].pcfg = &pc;
        h[j] = health(1 + (uint64_t)j, 10);
        h[j].role = TD__ROLE__ROLE_PREFILL;
        h[j].prefix_cache_blocks = 6;
        h[j].kv_event_seq = 1; /* events, none yet */
        rt_reg_seen(&p[j], &h[j], 0);
        TH_CHECK(p[j].cidx.capacity == 6 && p[j].cst.exact);
    }
    h[0].prefix_cache_blocks = 0; /* a leader without a cache: the requests' pool bounds it */
    rt_reg_seen(&p[0], &h[0], 0);
    TH_CHECK(p[0].cidx.capacity == 64);
    h[0].prefix_cache_blocks = 6;
    /* p1 stored the prompt's first 6 blocks (its whole budget) */
    h[1].kv_event_kind = (ProtobufCBinaryData){.len = e.n_ev, .data = e.kind};
    h[1].kv_event_ids = e.ids;
    h[1].n_kv_event_ids = e.n_ids;
    rt_reg_seen(&p[1], &h[1], 0);
    TH_CHECK(p[1].cst.exact && p[1].cidx.n == 6 && p[1].cst.events == 7);
    rt_route_pick pk;
    for (int k = 0; k < 2; k++) /* idle instances alternate in the load order: the match wins */
        TH_CHECK(rt_route_prefill(&g, &rc, t, 32, 0, -1, &pk) == 1 && pk.why == RT_ROUTE_BY_CACHE &&
                 pk.matched == 6 * BS);
    rt_route_commit(&g, g.pf, t, 32, &pk);
    TH_CHECK(p[1].cidx.n == 6); /* exact: a prompt sent there adds no block */
    /* stage 1 restarted: the leader re-formed the chain and flushed (seq 8), same boot id */
    evs c = {0};
    c.kind[c.n_ev++] = 3;
    h[1].kv_event_seq = 8;
    h[1].kv_event_kind = (ProtobufCBinaryData){.len = c.n_ev, .data = c.kind};
    h[1].n_kv_event_ids = 0;
    rt_reg_seen(&p[1], &h[1], 0);
    TH_CHECK(p[1].cidx.n == 0 && p[1].cst.exact && p[1].cst.drops == 0 && p[1].cst.event_gaps == 0);
    for (int k = 0; k < 2; k++) {
        TH_CHECK(rt_route_prefill(&g, &rc, t, 32, 0, -1, &pk) >= 0 && pk.why == RT_ROUTE_BY_LOAD &&
                 pk.matched == 0);
    }
    for (int k = 0; k < 2; k++)
        rt_cidx_fini(&p[k].cidx);
    rt_cache_ids_fini(&g.ids);
}

/* routing: round_robin: instances in turn whatever their load or cache, skipping one that
 * cannot take a request (full) and the prefill attempt's `avoid`. */
static void test_route_round_robin(void)
{
    rt_inst d[3] = {0}, p[3] = {0};
    td_cfg_prefill pc = {0};
    rt_registry g = {.inst = d, .n = 3, .pf = p, .n_pf = 3};
    td_cfg_router rc = {.routing = TD_CFG_ROUTING_ROUND_ROBIN};
    for (int i = 0; i < 3; i++) {
        d[i].cap = p[i].cap = 10;
        p[i].pcfg = &pc;
        Td__Health h = health(1 + (uint64_t)i, 10);
        h.kv_blocks_free = 10 + 10 * (uint32_t)i; /* the load order would always take d2 */
        rt_reg_seen(&d[i], &h, 0);
        h.role = TD__ROLE__ROLE_PREFILL;
        rt_reg_seen(&p[i], &h, 0);
    }
    int32_t t[32];
    fill(t, 32, 5);
    rt_route_pick pk;
    for (int k = 0; k < 6; k++) /* the same prompt: no stickiness either */
        TH_CHECK(route(&g, &rc, t, 32, &pk) == k % 3 && !pk.cache_aware);
    d[1].active = d[1].cap; /* full: skipped */
    TH_CHECK(route(&g, &rc, t, 32, &pk) == 0);
    TH_CHECK(route(&g, &rc, t, 32, &pk) == 2);
    TH_CHECK(route(&g, &rc, t, 32, &pk) == 0);
    for (int k = 0; k < 3; k++)
        d[k].active = d[k].cap;
    TH_CHECK(route(&g, &rc, t, 32, &pk) == -1);
    TH_CHECK(rt_route_prefill(&g, &rc, t, 32, 0, -1, &pk) == 0);
    TH_CHECK(rt_route_prefill(&g, &rc, t, 32, 0, 1, &pk) == 2); /* 1 avoided */
    TH_CHECK(rt_route_prefill(&g, &rc, t, 32, 0, -1, &pk) == 0);
    TH_CHECK(rt_route_prefill(&g, &rc, t, 32, 0, -1, &pk) == 1);
    for (int k = 0; k < 3; k++) {
        TH_CHECK(d[k].cidx.n == 0); /* round robin indexes nothing */
        rt_cidx_fini(&d[k].cidx);
        rt_cidx_fini(&p[k].cidx);
    }
    rt_cache_ids_fini(&g.ids);
}

int main(void)
{
    TH_RUN(test_index_match);
    TH_RUN(test_index_lru);
    TH_RUN(test_index_random);
    TH_RUN(test_index_events);
    TH_RUN(test_choose);
    TH_RUN(test_choose_shared);
    TH_RUN(test_route);
    TH_RUN(test_route_events);
    TH_RUN(test_route_shared);
    TH_RUN(test_route_prefill);
    TH_RUN(test_route_prefill_events);
    TH_RUN(test_route_round_robin);
    TH_EXIT();
}
