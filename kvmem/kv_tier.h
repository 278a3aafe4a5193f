/* kv_tier.h: the second tier of a pool's prefix cache: a larger, slower store that cached
 * blocks go to when the pool evicts them, and come back from when a prompt needs them.
 *
 * Purpose: a pool holds few blocks (it is the memory the model computes on); a conversation
 * that comes back after many others finds its prefix evicted. The tier keeps the K/V of
 * evicted cached blocks (every local layer of the block, as kv_pool.h lays them out) in a
 * store of its own, keyed like the cache (kv_cache.h) by block id with the block's tokens
 * and the serials of the entry and of its parent kept beside it (in memory, not in the
 * store), so a block read back is the very entry the pool evicted: same tokens, same prefix,
 * bit-identical KV. Where the store lives is the caller's choice (the backend decides):
 *   - params.path set: a file on a local disk, reserved at create (posix_fallocate: a full
 *     disk fails here, not at a write) and memory-mapped; the CPU backend's tier. The file
 *     is a scratch space of this process: it is (re)initialised at create and locked
 *     (flock) while the tier lives; an existing file that is not a tier file is refused.
 *   - params.path NULL: anonymous host memory.
 * A pool in device memory is copied through the backend's download/upload (either store);
 * a staged device pool's block whose newest KV is in its host copy is read there, and a
 * block copied in is marked current on the device (kv_pool.h on_dev). Tested with the
 * cpu-dev backend (kernels/cpu/cpu_dev.h); never run on a GPU here.
 * Integrity: every slot's data has a 64-bit checksum kept in memory; a slot whose data no
 * longer matches (the file was written by someone else) is an error (TD_EFORMAT, the entry
 * dropped), never KV handed to the model; a file that shrank under the tier is TD_EIO before
 * any access (no SIGBUS) and the tier stops (every later call misses).
 * LRU: the tier has its own: put and a read touch an entry; a put into a full tier replaces
 * the least recently used entry. An entry stays after a read (the pool's copy and the tier's
 * are the same entry: evicting it from the pool again costs no write).
 * Threading: not thread-safe; the owner of the pool calls everything.
 * Ownership: the tier owns its store; it borrows nothing past a call.
 */
#ifndef KN_KV_TIER_H
#define KN_KV_TIER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_pool.h"

typedef struct kn_kv_tier kn_kv_tier;

typedef struct {
    const char *path; /* a file on a local disk, or NULL: anonymous host memory */
    size_t bytes;     /* the store's size, header included; must hold at least one block */
    int slots;        /* 0: as many blocks as bytes hold; else exactly this many (bytes must
                         hold them): the ranks of a TP instance use the same count */
    bool log;         /* record every copy (kn_kv_tier_ops): a TP leader's tier, whose copies
                         the other ranks repeat on their own shards (kn_kv_tier_apply) */
} kn_kv_tier_params;

/* One copy between a pool block and a slot, as the leader's tier made it. */
enum { KN_KV_TIER_OP_PUT = 1, KN_KV_TIER_OP_GET = 2 };
typedef struct {
    int32_t kind;  /* KN_KV_TIER_OP_PUT: block -> slot; KN_KV_TIER_OP_GET: slot -> block */
    int32_t slot;  /* the tier slot */
    int32_t block; /* the pool block */
} kn_kv_tier_op;

typedef struct {
    int slots;        /* blocks the tier holds */
    int used;         /* entries now */
    uint64_t writes;  /* blocks written (evicted from the pool into the tier) */
    uint64_t reads;   /* blocks read back into the pool */
    uint64_t dropped; /* entries replaced by LRU to make room */
    uint64_t errors;  /* corrupt slots, a shrunk file, a failed device copy */
} kn_kv_tier_stats;

/* A tier for blocks of pool's shape. TD_EINVAL: bytes holds no block (the message says how
 * many bytes one block needs); TD_EFORMAT: path exists and is not a tier file; TD_ESTATE:
 * the file is locked by another tier; TD_ENOMEM: no memory or no disk space; TD_EIO:
 * another file error (logged with errno). */
int kn_kv_tier_create(const kn_kv_tier_params *p, const kn_kv_pool *pool, kn_kv_tier **out);
void kn_kv_tier_destroy(kn_kv_tier *t); /* NULL is fine; the file stays (scratch) */

/* Bytes one block takes in the tier of pool: kn_kv_pool_block_bytes (every local layer's K
 * and V, or its latent array once). */
size_t kn_kv_tier_block_bytes(const kn_kv_pool *pool);

/* Store pool block `block` (its KV computed) as the entry (id, serial, parent, tokens
 * (block_size)): an entry of the same id and serial is only touched (no copy); another
 * entry of the same id is replaced; a full tier drops its least recently used entry.
 * 0, or TD_EIO / TD_EFORMAT (a failed copy: nothing stored). */
int kn_kv_tier_put(kn_kv_tier *t, const kn_kv_pool *pool, int32_t block, uint64_t id,
                   uint64_t serial, uint64_t parent, const int32_t *tokens);

/* The slot of the entry with this id whose parent serial and tokens match, or -1; *serial:
 * its serial. Touches nothing. */
int kn_kv_tier_find(const kn_kv_tier *t, uint64_t id, uint64_t parent, const int32_t *tokens,
                    uint64_t *serial);

/* Copy the entry in slot into pool block `block` (the caller holds it) and touch it. 0;
 * TD_EFORMAT: its data is corrupt (the entry is dropped); TD_EIO: the file shrank or a
 * device copy failed (the tier stops); TD_ENOENT: no entry there. */
int kn_kv_tier_get(kn_kv_tier *t, int slot, kn_kv_pool *pool, int32_t block);

/* Forget every entry (the serials they carry mean nothing any more). */
void kn_kv_tier_clear(kn_kv_tier *t);

kn_kv_tier_stats kn_kv_tier_get_stats(const kn_kv_tier *t);

/* ---- tensor parallelism ----
 * Each rank of a TP instance holds its own pool (its KV heads) and its own tier (PATH.rR)
 * of the same slot count. Only the leader's tier has an index and an LRU (it decides, as it
 * owns the cache): with params.log it records every copy it makes, in order (a put that
 * only touches an entry copies nothing and is not recorded). The leader sends them with
 * the next step plan and every other rank repeats them on its own shard with
 * kn_kv_tier_apply before the step computes: same slots, same blocks, same order, so each
 * rank's slot s holds its heads of the leader's entry in s. A follower's tier keeps only a
 * checksum per slot (its own data's), so a corrupt or never-written slot is an error there
 * too, never KV handed to the model. Clearing a tier empties its log. */

/* The copies recorded since the last kn_kv_tier_ops_clear, oldest first (*n of them). */
const kn_kv_tier_op *kn_kv_tier_ops(const kn_kv_tier *t, int *n);
void kn_kv_tier_ops_clear(kn_kv_tier *t);
/* Repeat the leader's copy op on this rank's pool and tier. 0; TD_EINVAL: a slot or block
 * out of range or an unknown kind; TD_ENOENT: a get from a slot never written (or whose put
 * failed); TD_EFORMAT: the slot's data is corrupt; TD_EIO: the file shrank or a device copy
 * failed. Any error means this rank's KV would differ from the leader's: the caller stops. */
int kn_kv_tier_apply(kn_kv_tier *t, kn_kv_pool *pool, const kn_kv_tier_op *op);

#endif
