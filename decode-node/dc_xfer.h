/* dc_xfer.h: the decode leader's KV-transfer plane (disaggregated serving).
 *
 * Purpose: receive the prompt KV of requests a prefill instance computes: its stages
 * (kvxfer *writers*) put the KV straight into every decode rank's pool, and this module
 * tells the leader loop when a request's KV is complete on every rank (with the first
 * token the last stage sampled), or that the transfer failed.
 *
 * Design: all kvxfer work of a decode instance happens in the leader process (rank 0).
 * It owns one connector per TP rank (kvx_conn over its own UCX pipe, progressed by the
 * connector's thread); connector r registers rank r's pool with rank r's head range:
 * rank 0's own region, and for r > 0 the leader's mapping of the follower's pool, which
 * lives in POSIX shared memory (the follower creates it under dc_xfer_kv_shm_name before
 * the dc_shm rendezvous; the leader maps it after the rendezvous and unlinks the name).
 * Followers never touch kvxfer: their KV memory is simply filled, and the next step plan
 * they get through dc_shm (published after the leader saw DONE) orders the writes before
 * their reads. Block ids are the same on every rank (the scheduler allocates them once).
 * The kvxfer request id is the client's request id (Alloc.request.request_id): the prefill
 * instance opens its side with the same id (Prefill.request_id), and the id is in the
 * targets it receives.
 *
 * One transfer (one request, every rank):
 *
 *   dc_xfer_start: a kvxfer request + target on every rank
 *        |
 *        v        every rank DONE, the stages' metadata consistent
 *      LIVE -----------------------------------------------> event ARRIVED (released)
 *        |
 *        | a rank FAILED or ABORTING (writer died or aborted, deadline), bad metadata,
 *        | dc_xfer_abort: kvx_dec_abort on every rank
 *        v
 *      ENDING --every rank FAILED or DONE--> event ENDED (released)
 *
 * Invariants: each transfer yields exactly one event. ENDED comes only once no writer can
 * write into the request's blocks on any rank (kvxfer's rule: ABORTING is not safe), so the
 * caller frees the blocks then and never earlier. The reason of an ENDED event is the
 * first failure seen (later aborts of the other ranks do not overwrite it).
 * Threading: one thread (the leader loop) calls everything; the connectors' progress
 * threads are internal (kvxfer's API is thread-safe).
 * Ownership: the pool regions are borrowed until dc_xfer_destroy (destroy it before
 * unmapping them); target bytes returned by dc_xfer_targets live until the transfer's
 * event was returned.
 * Lifetime: one dc_xfer per formation of the instance (dc_node.h). When a rank fails the
 * leader aborts every transfer (DC_XFER_END_STOPPED), polls until none is alive (so no
 * writer can still write into any rank's pool), destroys it and unmaps the followers'
 * pools; the next formation creates a new one over the followers' new pool segments.
 */
#ifndef DC_XFER_H
#define DC_XFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *instance;       /* for logs */
    int tp;                     /* ranks (1 .. KVX_MAX_RANKS) */
    void *const *regions;       /* (tp) rank r's KV pool region as mapped in this process */
    const size_t *region_bytes; /* (tp) bytes of each region (borrowed during create) */
    const int *region_fds;      /* NULL, or (tp) the file each region maps from its start
                                   (borrowed until destroy), or -1: kvx_dec_register_fd */
    uint32_t n_layers;          /* layers of the model (every rank holds all) */
    uint32_t n_heads;           /* query heads of the model */
    uint32_t n_kv_heads;        /* KV heads of the model (rank r holds those of td_tp.h's rule) */
    uint32_t head_dim, block_size, dtype_size, n_blocks;
    bool latent;      /* the pools have the latent layout (kv_pool.h KN_KV_LAYOUT_LATENT): one
                         array a layer, which the targets say (kvx_layout.kv_arrays 1) */
    const char *tls;  /* UCX_TLS of the KV plane (cfg kvxfer.ucx_tls) */
    const char *host; /* the instance's host (cfg decode[].host): the pipes' network devices */
    int timeout_ms;   /* deadline of a transfer, from dc_xfer_start (cfg kvxfer) */
    bool staged;      /* device pools (kv_pool.h): each region is the host copy, followed by
                         its n_blocks on_dev flags (counted in region_bytes), which
                         dc_xfer_start clears for the transfer's blocks on every rank, so each
                         rank's engine uploads them before it first reads them */
} dc_xfer_params;

typedef struct dc_xfer dc_xfer;

/* Create the tp connectors and register the regions. TD_EIO if UCX cannot start. */
int dc_xfer_create(const dc_xfer_params *p, dc_xfer **out);
/* Closes the connectors (every transfer still alive fails). NULL is fine. */
void dc_xfer_destroy(dc_xfer *x);

/* Start the transfer of the request the caller knows as key (unique among live
 * transfers), kvxfer id kvx_id, written by n_stages prefill stages, prompt of n_prompt
 * tokens in blocks (n_blocks ids, position q in blocks[q / block_size]), of which every
 * rank holds [0, n_cached) already (the prefix cache's shared blocks, 0 <= n_cached <
 * n_prompt): the targets say so (kvx_dec_req_params.first_pos) and the writers put only
 * the rest. TD_ESTATE: a transfer with that kvx_id (or key) is alive; other errors are
 * logged. On failure nothing stays alive and no target was handed out, so the blocks are
 * free to reuse. */
int dc_xfer_start(dc_xfer *x, uint64_t key, uint64_t kvx_id, uint32_t n_stages, int32_t n_prompt,
                  int32_t n_cached, const int32_t *blocks, int n_blocks);
/* The tp target byte strings of a live transfer (rank order) and its n_cached. TD_ENOENT
 * if none. */
int dc_xfer_targets(const dc_xfer *x, uint64_t key, const uint8_t *const **targets,
                    const size_t **lens, int32_t *n_cached);
bool dc_xfer_live(const dc_xfer *x, uint64_t key); /* started, event not yet returned */
bool dc_xfer_kvx_live(const dc_xfer *x, uint64_t kvx_id);
int dc_xfer_pending(const dc_xfer *x); /* live transfers */

typedef enum {
    DC_XFER_END_FAILED = 1, /* a writer failed or aborted, or sent inconsistent metadata */
    DC_XFER_END_TIMEOUT,    /* the deadline passed before every stage was done */
    DC_XFER_END_CANCELLED,  /* dc_xfer_abort: the client cancelled or went away */
    DC_XFER_END_STOPPED,    /* dc_xfer_abort: the node stops, or a rank failed (the request
                               ended already) */
} dc_xfer_end;

/* Abort a live transfer (no-op if it is already ending: the first reason stays). */
int dc_xfer_abort(dc_xfer *x, uint64_t key, dc_xfer_end why);
void dc_xfer_abort_all(dc_xfer *x, dc_xfer_end why);

typedef enum { DC_XFER_ARRIVED = 1, DC_XFER_ENDED } dc_xfer_kind;

typedef struct {
    dc_xfer_kind kind;
    uint64_t key;
    int32_t first_token; /* ARRIVED: sampled by the last prefill stage */
    dc_xfer_end why;     /* ENDED */
    char msg[320];       /* ENDED: for the client, e.g. "KV transfer from prefill failed on
                            rank 1: a prefill writer failed (aborting; 1 of 2 stages begun, 0
                            done)" */
} dc_xfer_event;

/* Poll the live transfers: 1 and *ev for the next event (the transfer is then gone), 0
 * when none has one now. Call until it returns 0. */
int dc_xfer_next(dc_xfer *x, dc_xfer_event *ev);

/* Request records alive in connector `rank` (kvx_conn_stats dec_requests; leak checks). */
int dc_xfer_dec_requests(dc_xfer *x, int rank);

/* The shared-memory name of rank's KV pool ("/tandem-kv-INSTANCE-TOKEN-rRANK-PID": the
 * pid makes it unique per process, so the creator may always unlink it). TD_ERANGE if
 * cap is too small. */
int dc_xfer_kv_shm_name(const char *instance, const char *token, int rank, int pid, char *buf,
                        size_t cap);
/* Remove the KV pool segments of this instance and token whose creator is dead (a rank
 * killed before its leader mapped the segment leaves one behind). */
void dc_xfer_kv_shm_sweep(const char *instance, const char *token);

#endif
