/* test_blockhash.c: common/td_blockhash (chained block ids): a block's id depends on its
 * tokens, their order and everything before it; td_block_hashes agrees with chaining by hand;
 * the values are pinned, so a change to the hash (which must bump TD_BLOCK_HASH_VERSION)
 * cannot slip in unnoticed. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_blockhash.h"
#include "tharness.h"

#define PINNED_A 0x78862a1ea000fa67ull
#define PINNED_B 0x23f16b1fda24378dull

static void test_chain(void)
{
    int32_t t[64];
    for (int i = 0; i < 64; i++)
        t[i] = (i * 7919) % 50000;
    uint64_t ids[4], again[4];
    TH_CHECK(td_block_hashes(t, 64, 16, ids) == 4);
    TH_CHECK(td_block_hashes(t, 63, 16, again) == 3); /* the partial block has no id */
    TH_CHECK(!memcmp(ids, again, 3 * sizeof *ids));
    uint64_t p = TD_BLOCK_HASH_ROOT;
    for (int b = 0; b < 4; b++) {
        p = td_block_hash(p, t + 16 * b, 16);
        TH_CHECK(p == ids[b]);
    }
    /* the same tokens after another prefix: another id */
    int32_t u[64];
    memcpy(u, t, sizeof u);
    u[0] ^= 1;
    uint64_t uid[4];
    td_block_hashes(u, 64, 16, uid);
    for (int b = 0; b < 4; b++)
        TH_CHECK(uid[b] != ids[b]);
    /* order matters; so does the length */
    int32_t s[16];
    memcpy(s, t, sizeof s);
    int32_t x = s[3];
    s[3] = s[4];
    s[4] = x;
    TH_CHECK(td_block_hash(TD_BLOCK_HASH_ROOT, s, 16) != ids[0]);
    TH_CHECK(td_block_hash(TD_BLOCK_HASH_ROOT, t, 15) != td_block_hash(TD_BLOCK_HASH_ROOT, t, 16));
    int32_t zero = 0;
    TH_CHECK(td_block_hash(TD_BLOCK_HASH_ROOT, &zero, 1) !=
             td_block_hash(TD_BLOCK_HASH_ROOT, t, 0));
    TH_CHECK(td_block_hashes(t, 64, 0, ids) == 0);
}

/* ids of 1M distinct one-token blocks: no collision among them (a sanity check of the mix,
 * not a proof) */
static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void test_spread(void)
{
    enum { N = 1 << 20 };
    static uint64_t v[N];
    for (int32_t i = 0; i < N; i++)
        v[i] = td_block_hash(TD_BLOCK_HASH_ROOT, &i, 1);
    qsort(v, N, sizeof *v, cmp_u64);
    int dup = 0;
    for (int i = 1; i < N; i++)
        dup += v[i] == v[i - 1];
    TH_CHECK(dup == 0);
}

static void test_pinned(void)
{
    int32_t t[4] = {1, 2, 3, 4};
    uint64_t a = td_block_hash(TD_BLOCK_HASH_ROOT, t, 4);
    uint64_t b = td_block_hash(a, t, 4);
    /* pinned for TD_BLOCK_HASH_VERSION 1 */
    TH_CHECK(TD_BLOCK_HASH_VERSION == 1u);
    TH_CHECK(a == PINNED_A);
    TH_CHECK(b == PINNED_B);
    if (a != PINNED_A || b != PINNED_B)
        fprintf(stderr, "ids now 0x%016llxull 0x%016llxull\n", (unsigned long long)a,
                (unsigned long long)b);
}

int main(void)
{
    TH_RUN(test_chain);
    TH_RUN(test_spread);
    TH_RUN(test_pinned);
    TH_EXIT();
}
