/* td_blockhash.c: chained 64-bit block ids (td_blockhash.h). */
#include "td_blockhash.h"

/* splitmix64's finalizer: a full-avalanche 64-bit mix */
static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

uint64_t td_block_hash(uint64_t parent, const int32_t *tokens, size_t n)
{
    /* the length goes in first so that blocks of different sizes never share an id; each
       token is mixed with its position's odd multiplier so that order matters */
    uint64_t h = mix64(parent ^ (0x9e3779b97f4a7c15ull * (uint64_t)(n + 1)));
    for (size_t i = 0; i < n; i++)
        h = mix64(h + (uint64_t)(uint32_t)tokens[i] * 0xff51afd7ed558ccdull + i);
    return h;
}

size_t td_block_hashes(const int32_t *tokens, size_t n_tokens, size_t block_size, uint64_t *ids)
{
    if (!block_size) return 0;
    size_t n = n_tokens / block_size;
    uint64_t parent = TD_BLOCK_HASH_ROOT;
    for (size_t b = 0; b < n; b++)
        parent = ids[b] = td_block_hash(parent, tokens + b * block_size, block_size);
    return n;
}
