/* kvx_conn.h: the top layer of kvxfer: the API the prefill and decode nodes call to move
 * a request's KV cache from prefill stages into decode ranks' paged KV pools.
 *
 * Purpose. Decode side: register this rank's KV pool, make the *KV target* bytes of a
 * request (endpoint address, memory key, layout, block ids, head range), poll the
 * request's state, abort it. Prefill side: open a request, add the targets of every
 * decode rank, send chunks (token range x this stage's layer range; each decode rank
 * gets its heads only; contiguous runs coalesce into single puts; chunks wait in the
 * lookup buffer until the targets arrived and accepted; each chunk's puts to a rank are
 * followed by a flush of that rank, so every chunk is known to have landed on its own),
 * per-chunk times (handed, issued, landed: kvx_pf_chunk_times), finish (wait for the
 * flushes, then notify every rank with a metadata record), abort. Composes the pipe
 * (kvx_pipe.h) and the lookup buffer (kvx_lookup.h); neither knows this layer.
 *
 * Protocol (active messages on one id). A *writer* is one (PP stage, source TP rank)
 * process. It sends BEGIN(req, epoch, stage, src rank/tp, its address) to every decode
 * rank of the request and writes nothing before that rank answered ACCEPT (a rank that
 * aborted, failed or never heard of the request answers REFUSE). After a chunk's puts
 * to a rank the writer flushes that rank (one flush per rank per chunk); finish = every
 * chunk flush completed, then DONE(meta). A decode abort sends ABORT to every accepted
 * writer; the writer stops, flushes and answers STOPPED. A prefill abort flushes, then
 * sends STOPPED.
 *
 * Puts: a piece is (layer, K/V, block, head slice [, token range]); pieces contiguous on
 * both sides merge into one put; small pieces contiguous only at the destination (a head
 * slice of consecutive blocks when the source holds more heads) are gathered into a
 * staging buffer (kept until the chunk's flush of that rank completed) and go as one put.
 * A target may hold a prefix already (kvx_dec_req_params.first_pos, the decode side's
 * prefix cache): its positions below first_pos are cut from every chunk at issue time, so a
 * chunk queued before the target arrived is cut too; a chunk with nothing left for a rank
 * sends that rank no put and no flush (it still lands, and finish still notifies).
 *
 * Chunk times (CLOCK_MONOTONIC ns, td_now_ns: comparable between the processes of one
 * host): handed = kvx_pf_send_chunk accepted the chunk; issued = its puts started (the
 * same moment when the request was READY; later for a chunk that waited in the lookup
 * buffer for its targets); landed = the last of its rank flushes completed with success,
 * as seen by this connector's progress (so at or after the true moment): its KV is in
 * every decode rank's memory. handed <= issued <= landed; a chunk whose flush failed
 * never lands (landed stays 0).
 *
 * Decode request states (kvx_dec_poll):
 *
 *   kvx_dec_make_target
 *          |
 *          v         first ACCEPT          DONE from every writer of every stage
 *      WAITING ----------------------> TRANSFERRING -----------------------> DONE
 *          |                               |
 *          | kvx_dec_abort, deadline       | kvx_dec_abort, deadline, STOPPED from a
 *          |                               | writer, a writer's endpoint failed
 *          v                               v
 *      FAILED <----------------------- ABORTING
 *              every accepted writer is done, answered STOPPED, or its endpoint failed
 *              (or was closed by us after abort_timeout_ms)
 *
 *   (WAITING -> FAILED directly when no writer was accepted yet: BEGINs after that are
 *   refused.) In DONE every writer flushed before its notice: the blocks hold the KV. In
 *   FAILED no writer can write into the blocks any more: only then may the caller reuse
 *   them. ABORTING is reported as such: the blocks are NOT yet safe.
 *
 * Prefill request states (kvx_pf_poll):
 *
 *   kvx_pf_open -> OPEN --all targets added--> BEGUN --every rank ACCEPTs--> READY
 *   READY --kvx_pf_finish--> FLUSHING --chunk flushes ok--> NOTIFYING --notices sent--> DONE
 *   any non-final --kvx_pf_abort, deadline, ABORT/REFUSE, endpoint/flush failed--> ABORTING
 *   ABORTING --outstanding puts flushed (or endpoint closed), STOPPED sent--> FAILED
 *
 *   Chunks sent in OPEN/BEGUN are copied into the lookup buffer and go out on READY;
 *   a finish before READY is remembered and runs after them.
 *
 * Invariants: every request has a deadline (timeout_ms from open / make_target); a dead
 * peer fails its requests on the other side at the latest after timeout_ms +
 * abort_timeout_ms (usually at once: UCX reports the endpoint error over the network; on
 * shared memory the pipe watches the peer process). Bytes from outside
 * (targets, messages) are decoded with bounds checks: malformed input is an error
 * (logged once), never a crash.
 *
 * Threading: every function is thread-safe (one mutex per connector). Progress happens in
 * kvx_conn_progress (call it from the owner's loop; it sleeps on the pipe's event fd when
 * idle) or, with params.progress_thread, in an internal thread that does the same. Over
 * TCP, puts are emulated with messages: the decode side must keep progressing.
 *
 * Ownership: the connector owns the pipe given to kvx_conn_create. Registered regions are
 * borrowed until kvx_conn_destroy. The source KV of a prefill request (the region and the
 * blocks named in send_chunk) must stay valid and unchanged until kvx_pf_poll reports
 * DONE or FAILED (queued chunks are copies; a direct chunk's blocks are read by the
 * transport until the chunk landed). Request records, chunk times included, live until
 * kvx_*_release (only in a final state).
 */
#ifndef KVX_CONN_H
#define KVX_CONN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvx_pipe.h"

#define KVX_MAX_STAGES 64
#define KVX_MAX_RANKS  64
#define KVX_MAX_CHUNKS 16384 /* chunk numbers per prefill request: 0 .. KVX_MAX_CHUNKS - 1 */

#define KVX_MAX_SLICES 16 /* head slices of a sliced source region */

/* A KV region: for each local layer, K then V (kv_arrays 0 or 2), or one array (kv_arrays 1:
 * a latent pool, kvmem's KN_KV_LAYOUT_LATENT, whose V is its K), each
 * (n_blocks, n_heads, block_size, head_dim) elements of dtype_size bytes (head-major blocks:
 * one head's part of a block is contiguous, a run of heads too, but a head range narrower
 * than n_heads is strided from block to block). A one-array region's blocks are put once;
 * a source and a target whose kv_arrays differ are refused (kvx_pf_add_target).
 * Sliced (a prefill stage's source region only; n_slices > 1): the held heads are cut into
 * n_slices consecutive slices of slice_heads[i] heads (summing to n_heads), and each layer's
 * K (then V) holds slice 0's (n_blocks, slice_heads[0], block_size, head_dim), then slice
 * 1's, ...: a slice's part of a run of consecutive blocks is one contiguous range, so a
 * decode rank whose heads are a union of slices gets one put per slice and run, without
 * staging. With one slice this is the head-major layout. Decode regions and targets are
 * never sliced (their pool is the kernels' head-major pool). */
typedef struct {
    uint32_t layer0, n_layers; /* global layers held: [layer0, layer0 + n_layers) */
    uint32_t n_kv_heads;       /* the model's KV heads (all TP ranks together) */
    uint32_t head0, n_heads;   /* heads held: [head0, head0 + n_heads); a decode rank's
                                * range follows common/td_tp.h, so ranges of different
                                * ranks may overlap (replicated KV heads): each target
                                * gets every head of its range */
    uint32_t block_size;       /* tokens per block */
    uint32_t head_dim;         /* elements */
    uint32_t dtype_size;       /* bytes per element */
    uint32_t n_blocks;         /* blocks per layer array */

    /* sliced sources (above): 0 or 1 slice is head-major; slice_heads[i] for i < n_slices */
    uint32_t n_slices;
    uint32_t slice_heads[KVX_MAX_SLICES];
    uint32_t kv_arrays; /* arrays a layer: 0 or 2: K then V; 1: one (latent: V is K) */
} kvx_layout;

/* Arrays a layer of l holds: 2 (K, V) or 1 (latent); kv_arrays 0 is 2. */
static inline uint32_t kvx_layout_arrays(const kvx_layout *l)
{
    return l->kv_arrays == 1 ? 1 : 2;
}

/* Bytes of a region with this layout (0 if the layout is invalid: a sliced one also needs
 * n_slices <= KVX_MAX_SLICES and slices of >= 1 head summing to n_heads; kv_arrays is 0, 1
 * or 2). */
size_t kvx_layout_bytes(const kvx_layout *l);

/* Byte offset in a region of layout l (valid) of local layer ll, kv (0 K, 1 V: K's offset
 * in a one-array layout, whose V is its K), block blk, local head h (0 .. n_heads - 1),
 * token tok: where that head's tokens of the block start (its tokens of the block are
 * contiguous in every layout). */
size_t kvx_layout_off(const kvx_layout *l, uint32_t ll, uint32_t kv, uint32_t blk, uint32_t h,
                      uint32_t tok);

/* Slice l (held heads [head0, head0 + n_heads)) for destinations holding the global head
 * ranges [ranges[2i], ranges[2i+1]), i < n: the coarsest cut of the held heads in which each
 * range's held part is a union of slices (n_slices 1 when none cuts them). TD_EINVAL for an
 * empty or reversed range or n == 0, TD_ERANGE when more than KVX_MAX_SLICES slices would be
 * needed (l unchanged on error). */
int kvx_layout_slice(kvx_layout *l, const uint32_t *ranges, uint32_t n);

typedef struct {
    int timeout_ms;       /* default request deadline; 0: 30000 */
    int abort_timeout_ms; /* wait for a writer's STOPPED before closing it; 0: 2000 */
    size_t lookup_budget; /* bytes of queued chunks; 0: 256 MiB */
    bool progress_thread; /* run progress in an internal thread */
    int spin_us;          /* after progress that did something (data moved included), keep
                           * polling this long before sleeping on the event fd: a wake-up
                           * per message costs a scheduling round on a loaded machine.
                           * 0: KVX_SPIN_US_DEFAULT; < 0: sleep at once */
} kvx_conn_params;

#define KVX_SPIN_US_DEFAULT 200

typedef struct kvx_conn kvx_conn;

/* Takes ownership of pipe (also on failure). */
int kvx_conn_create(kvx_pipe *pipe, const kvx_conn_params *params, kvx_conn **out);
/* Closes every endpoint, fails and frees every request and queued chunk. NULL is fine. */
void kvx_conn_destroy(kvx_conn *c);
/* Make progress; sleep up to timeout_ms when idle (0: do not sleep): idle is no activity for
 * params.spin_us (until then it returns 0 at once: the caller's loop polls). Returns >= 0
 * or a negative td_err. Not needed (but harmless) with params.progress_thread. */
int kvx_conn_progress(kvx_conn *c, int timeout_ms);

typedef struct {
    int dec_requests, pf_requests; /* request records alive */
    int peers;                     /* endpoints alive */
    kvx_pipe_stats pipe;
    size_t queued_bytes; /* chunks in the lookup buffer */
    int queued_chunks;
    size_t held_bytes;   /* chunk copies and staging buffers waiting for a flush */
    size_t pooled_bytes; /* idle staging buffers kept for reuse */
} kvx_conn_stats;
void kvx_conn_stats_get(kvx_conn *c, kvx_conn_stats *out);
/* Close the endpoints no request uses (they are otherwise cached for later requests) and
 * free the idle staging buffers; returns how many endpoints were closed. */
int kvx_conn_close_idle(kvx_conn *c);

typedef enum {
    KVX_REQ_WAITING,
    KVX_REQ_TRANSFERRING,
    KVX_REQ_DONE,
    KVX_REQ_ABORTING,
    KVX_REQ_FAILED,
    /* prefill side only */
    KVX_REQ_OPEN,
    KVX_REQ_BEGUN,
    KVX_REQ_READY,
    KVX_REQ_FLUSHING,
    KVX_REQ_NOTIFYING,
} kvx_req_state;
const char *kvx_req_state_name(kvx_req_state s);

typedef enum {
    KVX_FAIL_NONE,
    KVX_FAIL_ABORTED,      /* this side called abort */
    KVX_FAIL_PEER_ABORTED, /* the other side aborted (or refused) */
    KVX_FAIL_PEER_FAILED,  /* an endpoint failed */
    KVX_FAIL_TIMEOUT,      /* the deadline passed */
    KVX_FAIL_BAD_INPUT,    /* a target or chunk did not fit */
} kvx_fail_reason;

/* Metadata a stage sends with its finish notice. */
typedef struct {
    int32_t first_token; /* sampled by the last stage; -1 from other stages */
    uint32_t n_tokens;   /* prompt tokens transferred */
} kvx_meta;

/* --- decode side ---------------------------------------------------------------------- */

/* Register this rank's KV pool (once per connector). */
int kvx_dec_register(kvx_conn *c, void *region, size_t bytes, const kvx_layout *layout);
/* The same for a pool that is a shared mapping of the file fd from its start (a shm segment
 * or memfd, kn_kv_pool_fd): a prefill stage on this host may map it and copy its KV in
 * directly (kvx_pipe_mem_reg_fd). fd is borrowed until the connector is destroyed; -1:
 * kvx_dec_register. */
int kvx_dec_register_fd(kvx_conn *c, void *region, size_t bytes, const kvx_layout *layout, int fd);

typedef struct {
    uint32_t n_stages;     /* prefill stages that will write (1..KVX_MAX_STAGES) */
    uint32_t rank, tp;     /* this decode rank and the decode TP size */
    const int32_t *blocks; /* (n_blocks) block ids: position p lives in blocks[p / bs] */
    uint32_t n_blocks;
    int timeout_ms;     /* 0: the connector's */
    uint32_t first_pos; /* positions [0, first_pos) are held already (a prefix this rank's
                         * pool shares with other requests): the writers never put them, so
                         * their blocks are never written by this request. 0: every position
                         * (the target then has the layout writers older than first_pos read;
                         * with first_pos > 0 such a writer refuses the target as malformed
                         * instead of writing the shared blocks) */
} kvx_dec_req_params;

/* Start a request and write its KV target bytes (at most cap; *len gets the size, also
 * when TD_ERANGE says cap is too small). TD_ESTATE if req_id is alive. */
int kvx_dec_make_target(kvx_conn *c, uint64_t req_id, const kvx_dec_req_params *p, void *buf,
                        size_t cap, size_t *len);

typedef struct {
    kvx_req_state state;
    kvx_fail_reason reason;
    int err; /* td_err of the failure, 0 otherwise */
    uint32_t n_stages;
    uint64_t stages_begun;         /* bit s: a writer of stage s was accepted */
    uint64_t stages_done;          /* bit s: every TP rank of stage s sent DONE */
    kvx_meta meta[KVX_MAX_STAGES]; /* per stage, from its TP rank 0 */
} kvx_dec_status;
int kvx_dec_poll(kvx_conn *c, uint64_t req_id, kvx_dec_status *out); /* TD_ENOENT */
/* Abort: WAITING/TRANSFERRING -> ABORTING or FAILED; no-op in a final state. */
int kvx_dec_abort(kvx_conn *c, uint64_t req_id);
/* Forget a DONE or FAILED request (TD_ESTATE otherwise). */
int kvx_dec_release(kvx_conn *c, uint64_t req_id);

/* --- prefill side --------------------------------------------------------------------- */

/* Register this stage's KV (the source of every chunk; once per connector). */
int kvx_pf_register_source(kvx_conn *c, void *region, size_t bytes, const kvx_layout *layout);

typedef struct {
    uint32_t stage;    /* this stage's id (< the target's n_stages) */
    uint32_t src_rank; /* this process's TP rank inside the stage */
    uint32_t src_tp;   /* the stage's TP size (0: 1); the decode side waits for all */
    uint32_t n_dst;    /* decode ranks (targets) of the request; 0: from the first target */
    int timeout_ms;    /* 0: the connector's */
} kvx_pf_req_params;

int kvx_pf_open(kvx_conn *c, uint64_t req_id, const kvx_pf_req_params *p);
/* Add one decode rank's target bytes (any order; malformed bytes are TD_EFORMAT and fail
 * nothing else). */
int kvx_pf_add_target(kvx_conn *c, uint64_t req_id, const void *target, size_t len);
/* Send tokens [t0, t1) of this stage's layers as chunk number `chunk` (< KVX_MAX_CHUNKS,
 * each number once per request: TD_EINVAL / TD_ESTATE); src_blocks (n_src_blocks) is the
 * request's block table in the source region (position p in src_blocks[p / bs]).
 * TD_ENOSPC if the chunk must be queued and the lookup buffer is full (nothing sent, no
 * time recorded; retry later). */
int kvx_pf_send_chunk(kvx_conn *c, uint64_t req_id, uint32_t chunk, uint32_t t0, uint32_t t1,
                      const int32_t *src_blocks, uint32_t n_src_blocks);
int kvx_pf_finish(kvx_conn *c, uint64_t req_id, const kvx_meta *meta);
int kvx_pf_abort(kvx_conn *c, uint64_t req_id);

typedef struct {
    kvx_req_state state;
    kvx_fail_reason reason;
    int err;
    uint32_t n_targets, n_accepted;
    uint64_t pieces; /* puts before coalescing (contiguous pieces) */
    uint64_t puts;   /* puts issued after coalescing */
    uint64_t bytes;  /* bytes put */
    uint64_t staged; /* bytes of them gathered into a staging buffer first (pieces of a
                      * head-major source strided from block to block; 0 when every decode
                      * rank's heads are one slice of a sliced source) */
} kvx_pf_status;
int kvx_pf_poll(kvx_conn *c, uint64_t req_id, kvx_pf_status *out);

/* A chunk's times (see "Chunk times" above), CLOCK_MONOTONIC nanoseconds; 0: not yet. */
typedef struct {
    uint64_t handed_ns; /* kvx_pf_send_chunk accepted the chunk */
    uint64_t issued_ns; /* its puts started (0: still in the lookup buffer) */
    uint64_t landed_ns; /* every rank's flush of its puts completed (0: not yet, or failed) */
} kvx_chunk_times;
/* TD_ENOENT: no such request, or that chunk was not sent. Valid until kvx_pf_release. */
int kvx_pf_chunk_times(kvx_conn *c, uint64_t req_id, uint32_t chunk, kvx_chunk_times *out);
int kvx_pf_release(kvx_conn *c, uint64_t req_id);

#endif
