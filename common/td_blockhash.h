/* td_blockhash.h: the identity of a KV block, the same on every node (prefix caching).
 *
 * Purpose: a KV block of block_size tokens means the same thing wherever its tokens and
 * everything before them are the same. Its id is a 64-bit hash of its tokens chained with
 * the id of the block before it (the root's parent is TD_BLOCK_HASH_ROOT), so equal ids mean
 * equal prefixes up to and including the block (vLLM's and SGLang's block hashing, Dynamo's
 * KV events use the same idea). The router, the prefill stages and the decode ranks all call
 * td_block_hash, so an id named in one process names the same prefix in another.
 * Only whole blocks have ids: the last partial block of a sequence is never shared.
 * Collisions: 64 bits; a cache that must be exact compares the block's tokens too (they
 * are cheap to keep beside the id), so a collision costs a miss, never a wrong answer.
 * The hash is not cryptographic: it is not a defence against a client who crafts
 * collisions, which is one more reason to compare the tokens.
 * Invariants: a pure function of (parent, tokens); stable across builds and machines
 * (little- and big-endian alike: it reads token values, not bytes). Changing it changes
 * every id: bump TD_BLOCK_HASH_VERSION, which nodes and router report to each other.
 * Threading: pure functions.
 */
#ifndef TD_BLOCKHASH_H
#define TD_BLOCKHASH_H

#include <stddef.h>
#include <stdint.h>

#define TD_BLOCK_HASH_VERSION 1u
#define TD_BLOCK_HASH_ROOT    0x54414e44454d3031ull /* "TANDEM01" */

/* The id of the block holding tokens[0..n) whose previous block's id is parent. */
uint64_t td_block_hash(uint64_t parent, const int32_t *tokens, size_t n);

/* The ids of the whole blocks of tokens[0..n_tokens) (n_tokens / block_size of them) into
 * ids; returns their count. */
size_t td_block_hashes(const int32_t *tokens, size_t n_tokens, size_t block_size, uint64_t *ids);

#endif
