/* test_pf_kvcache.c: the prefill stage cache's KV events (prefill-node/pf_kvcache.h): a
 * reader that replays them holds exactly the blocks the cache indexes (a random workload
 * with shared prefixes and LRU evictions under a small budget, checked after every insert
 * against pf_kvc_match), ids are the chained block hashes the router computes, a flush is
 * one CLEARED event after which the replayed set is empty, and the ring keeps the latest
 * PF_KVC_EVENT_LOG events (first > 1 once it wrapped, seqs contiguous); a prompt's tail (its
 * last partial block) is matched, acquired and evicted like a block and named by no event.
 * usage: test_pf_kvcache
 */
#include <stdlib.h>
#include <string.h>

#include "../tharness.h"
#include "kv_mem.h"
#include "pf_kvcache.h"
#include "td_blockhash.h"
#include "td_err.h"

#define BS      4
#define MAXB    8
#define NSET    512 /* a replayed set of ids: linear search is enough here */
#define PROMPTS 200

typedef struct {
    uint64_t id[NSET];
    int n;
    uint64_t next; /* seq of the next event to apply */
    int gaps;
} replay;

static int find(const replay *r, uint64_t id)
{
    for (int k = 0; k < r->n; k++)
        if (r->id[k] == id) return k;
    return -1;
}

/* Apply the cache's window past r->next, as the router does. */
static void apply(replay *r, const pf_kvc *c)
{
    uint8_t kind[PF_KVC_EVENT_LOG];
    uint64_t ids[PF_KVC_EVENT_LOG], first;
    int n_ids, n = pf_kvc_events(c, PF_KVC_EVENT_LOG, kind, ids, &n_ids, &first);
    if (first > r->next) r->gaps++;
    int j = 0;
    for (int k = 0; k < n; k++) {
        uint64_t seq = first + (uint64_t)k, id = kind[k] == PF_KVC_EV_CLEARED ? 0 : ids[j++];
        if (seq < r->next) continue;
        r->next = seq + 1;
        int at = find(r, id);
        if (kind[k] == PF_KVC_EV_STORED) {
            TH_CHECK(at < 0); /* stored once until removed */
            if (at < 0 && r->n < NSET) r->id[r->n++] = id;
        } else if (kind[k] == PF_KVC_EV_REMOVED) {
            TH_CHECK(at >= 0 || r->gaps); /* after a gap: stored before the window */
            if (at >= 0) r->id[at] = r->id[--r->n];
        } else {
            TH_CHECK(kind[k] == PF_KVC_EV_CLEARED);
            r->n = 0;
        }
    }
    TH_CHECK(j == n_ids);
}

static kn_kv_mem *make_mem(void)
{
    kn_kv_pool_params p = {.n_layers = 1,
                           .n_kv_heads = 1,
                           .head_dim = 4,
                           .block_size = BS,
                           .n_blocks = 64,
                           .type = TD_F32};
    kn_kv_mem *mem = NULL;
    return kn_kv_mem_create(&p, &mem) ? NULL : mem;
}

/* A prompt of n_blocks whole blocks: a common first block, then a branch chosen from few. */
static void make_prompt(int32_t *t, int n_blocks, unsigned *seed)
{
    for (int i = 0; i < n_blocks * BS; i++)
        t[i] = i < BS ? 7 : (int32_t)(rand_r(seed) % 2 + (i / BS) * 3);
}

static void insert(pf_kvc *c, kn_kv_mem *mem, const int32_t *t, int n_blocks)
{
    int32_t blocks[16];
    TH_REQUIRE(kn_kv_alloc(mem, n_blocks, blocks) == 0);
    pf_kvc_insert(c, t, n_blocks, 0, blocks, 0);
}

static void test_replay_equals_index(void)
{
    kn_kv_mem *mem = make_mem();
    TH_REQUIRE(mem);
    pf_kvc *c = NULL;
    TH_REQUIRE(pf_kvc_create(mem, MAXB, &c) == 0);
    TH_CHECK(pf_kvc_event_next(c) == 1);
    replay r = {.next = 1};
    unsigned seed = 12345;
    int32_t t[16 * BS];
    uint64_t ids[16], last;
    for (int p = 0; p < PROMPTS; p++) {
        int nb = 1 + (int)(rand_r(&seed) % 4);
        make_prompt(t, nb, &seed);
        insert(c, mem, t, nb);
        apply(&r, c);
        /* every prompt seen: the cache's match equals the replayed set's leading run */
        size_t n = td_block_hashes(t, (size_t)nb * BS, BS, ids);
        int lead = 0;
        while (lead < (int)n && find(&r, ids[lead]) >= 0)
            lead++;
        TH_CHECK(pf_kvc_match(c, t, nb * BS, nb, &last) == lead);
        pf_kvc_stats s;
        pf_kvc_get_stats(c, &s);
        TH_CHECK(s.n_indexed == r.n);
    }
    pf_kvc_stats s;
    pf_kvc_get_stats(c, &s);
    TH_CHECK(s.evicted > 0); /* the budget was exceeded: removals were replayed */
    TH_CHECK(r.gaps == 0);
    uint64_t before = pf_kvc_event_next(c);
    pf_kvc_flush(c);
    TH_CHECK(pf_kvc_event_next(c) == before + 1); /* one CLEARED, not one event a block */
    apply(&r, c);
    TH_CHECK(r.n == 0);
    pf_kvc_destroy(c);
    kn_kv_mem_destroy(mem);
}

/* Evicting an entry takes the entries chained after it (their parent is gone: they could
 * never match again), and only those: prompts A B C and A B D under a budget of 4, then E
 * (evicts C, a leaf) and F (evicts B, whose child D goes with it; A and E stay). */
static void test_evict_descendants(void)
{
    kn_kv_mem *mem = make_mem();
    TH_REQUIRE(mem);
    pf_kvc *c = NULL;
    TH_REQUIRE(pf_kvc_create(mem, 4, &c) == 0);
    int32_t abc[3 * BS] = {1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
    int32_t abd[3 * BS] = {1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4};
    int32_t e[BS] = {5, 5, 5, 5}, f[BS] = {6, 6, 6, 6};
    insert(c, mem, abc, 3);
    insert(c, mem, abd, 3);
    uint64_t last;
    pf_kvc_stats st;
    pf_kvc_get_stats(c, &st);
    TH_CHECK(st.n_indexed == 4 && pf_kvc_match(c, abd, 3 * BS, 3, &last) == 3);
    insert(c, mem, e, 1); /* evicts C */
    pf_kvc_get_stats(c, &st);
    TH_CHECK(st.n_indexed == 4 && st.evicted == 1);
    TH_CHECK(pf_kvc_match(c, abc, 3 * BS, 3, &last) == 2 &&
             pf_kvc_match(c, abd, 3 * BS, 3, &last) == 3);
    insert(c, mem, f, 1); /* evicts B, and D with it */
    pf_kvc_get_stats(c, &st);
    TH_CHECK(st.n_indexed == 3 && st.evicted == 3);
    TH_CHECK(pf_kvc_match(c, abd, 3 * BS, 3, &last) == 1);
    TH_CHECK(pf_kvc_match(c, e, BS, 1, &last) == 1 && pf_kvc_match(c, f, BS, 1, &last) == 1);
    pf_kvc_destroy(c);
    kn_kv_mem_destroy(mem);
}

static void test_ring_wraps(void)
{
    kn_kv_mem *mem = make_mem();
    TH_REQUIRE(mem);
    pf_kvc *c = NULL;
    TH_REQUIRE(pf_kvc_create(mem, MAXB, &c) == 0);
    int32_t t[BS];
    for (int p = 0; p < 400; p++) { /* one block each, all different: stored + removed */
        for (int i = 0; i < BS; i++)
            t[i] = p * 10 + i;
        insert(c, mem, t, 1);
    }
    uint64_t next = pf_kvc_event_next(c);
    TH_CHECK(next > PF_KVC_EVENT_LOG + 1);
    uint8_t kind[PF_KVC_EVENT_LOG];
    uint64_t ids[PF_KVC_EVENT_LOG], first;
    int n_ids, n = pf_kvc_events(c, PF_KVC_EVENT_LOG, kind, ids, &n_ids, &first);
    TH_CHECK(n == PF_KVC_EVENT_LOG && first == next - PF_KVC_EVENT_LOG && n_ids == n);
    /* the last event: the last block stored, with the router's id for it */
    uint64_t want = td_block_hash(TD_BLOCK_HASH_ROOT, t, BS);
    TH_CHECK(kind[n - 1] == PF_KVC_EV_STORED && ids[n_ids - 1] == want);
    replay r = {.next = 1};
    apply(&r, c);
    TH_CHECK(r.gaps == 1);                              /* a reader from 1 learns it lost events */
    n = pf_kvc_events(c, 3, kind, ids, &n_ids, &first); /* at most max, the latest */
    TH_CHECK(n == 3 && first == next - 3);
    pf_kvc_destroy(c);
    kn_kv_mem_destroy(mem);
}

/* Tails (a prompt's last partial block): inserted after its whole blocks, matched only with
 * its parent, depth, length and tokens, acquired at the end of its chain (its tokens only),
 * never after a tail, named by no KV event, evicted like any block. */
static void test_tails(void)
{
    kn_kv_mem *mem = make_mem();
    TH_REQUIRE(mem);
    pf_kvc *c = NULL;
    TH_REQUIRE(pf_kvc_create(mem, 3, &c) == 0);
    int32_t t[2 * BS + 3] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
    int32_t blocks[3];
    TH_REQUIRE(kn_kv_alloc(mem, 3, blocks) == 0);
    uint64_t ev0 = pf_kvc_event_next(c);
    TH_CHECK(pf_kvc_insert(c, t, 2, 3, blocks, 0) == 3);
    TH_CHECK(pf_kvc_event_next(c) == ev0 + 2); /* the two whole blocks only */
    uint64_t last, id;
    TH_CHECK(pf_kvc_match(c, t, 2 * BS + 3, 2, &last) == 2);
    TH_CHECK(pf_kvc_match_tail(c, last, 2, t + 2 * BS, 3, &id));
    TH_CHECK(id == td_block_hash(last, t + 2 * BS, 3));
    TH_CHECK(!pf_kvc_match_tail(c, last, 2, t + 2 * BS, 2, &id)); /* another length */
    TH_CHECK(!pf_kvc_match_tail(c, last, 1, t + 2 * BS, 3, &id)); /* another depth */
    TH_CHECK(!pf_kvc_match_tail(c, TD_BLOCK_HASH_ROOT, 2, t + 2 * BS, 3, &id));
    int32_t other[3] = {9, 10, 12};
    TH_CHECK(!pf_kvc_match_tail(c, last, 2, other, 3, &id));
    uint64_t keep = last; /* a miss leaves the id alone: stage 0 passes the one it holds */
    TH_CHECK(!pf_kvc_match_tail(c, last, 2, other, 3, &keep) && keep == last);
    TH_CHECK(!pf_kvc_match_tail(c, last, 2, t + 2 * BS, BS, &id)); /* a whole block is no tail */
    /* a prompt that continues past the tail matches the whole blocks only */
    int32_t longer[3 * BS] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    TH_CHECK(pf_kvc_match(c, longer, 3 * BS, 3, &last) == 2);
    /* acquire the chain ending in the tail: its blocks, and exactly its tokens */
    TH_CHECK(pf_kvc_match_tail(c, last, 2, t + 2 * BS, 3, &id));
    int32_t got[3], hist[2 * BS + 3];
    TH_CHECK(pf_kvc_acquire(c, id, 3, got, hist) == 0);
    TH_CHECK(!memcmp(got, blocks, sizeof got) && !memcmp(hist, t, sizeof hist));
    TH_CHECK(pf_kvc_acquire(c, id, 2, got, NULL) == TD_ENOENT); /* not a 2-block chain */
    pf_kvc_unref(c, got, 3);
    pf_kvc_unuse(c, got, 3);
    /* a tail is evicted like a block (budget 3), and names no event when it goes */
    int32_t u[BS] = {40, 41, 42, 43}, ub;
    TH_REQUIRE(kn_kv_alloc(mem, 1, &ub) == 0);
    uint64_t ev1 = pf_kvc_event_next(c);
    TH_CHECK(pf_kvc_insert(c, u, 1, 0, &ub, 0) == 1);
    pf_kvc_stats st;
    pf_kvc_get_stats(c, &st);
    TH_CHECK(st.n_indexed == 3 && st.evicted == 1);
    uint8_t kind[PF_KVC_EVENT_LOG];
    uint64_t ids[PF_KVC_EVENT_LOG], first;
    int n_ids, n = pf_kvc_events(c, PF_KVC_EVENT_LOG, kind, ids, &n_ids, &first);
    int removed = 0, stored = 0;
    for (int k = 0; k < n; k++)
        if (first + (uint64_t)k >= ev1) {
            removed += kind[k] == PF_KVC_EV_REMOVED;
            stored += kind[k] == PF_KVC_EV_STORED;
        }
    /* the least recently used entry was the tail (a chain's leaf goes first) */
    TH_CHECK(pf_kvc_match(c, t, 2 * BS, 2, &last) == 2);
    TH_CHECK(!pf_kvc_match_tail(c, last, 2, t + 2 * BS, 3, &id));
    TH_CHECKF(stored == 1 && removed == 0, "events after the insert: %d stored, %d removed", stored,
              removed);
    pf_kvc_destroy(c);
    TH_CHECK(kn_kv_available(mem) == kn_kv_mem_pool(mem)->n_blocks); /* every block back */
    kn_kv_mem_destroy(mem);
}

int main(void)
{
    TH_RUN(test_replay_equals_index);
    TH_RUN(test_evict_descendants);
    TH_RUN(test_ring_wraps);
    TH_RUN(test_tails);
    TH_EXIT();
}
