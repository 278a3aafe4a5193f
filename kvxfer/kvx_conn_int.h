/* kvx_conn_int.h: the connector's private state, shared by kvx_conn.c (peers, messages,
 * progress, lifecycle), kvx_conn_pf.c (prefill side), kvx_conn_put.c (the prefill side's
 * puts) and kvx_conn_dec.c (decode side).
 * Not installed; nothing outside kvxfer/ includes it. Its types and macros, and the internal
 * functions shared between the files, carry the kvxi_ (KVXI_) prefix. Every function
 * here runs with c->mu held.
 */
#ifndef KVX_CONN_INT_H
#define KVX_CONN_INT_H

#include <pthread.h>

#include "kvx_conn.h"
#include "kvx_lookup.h"
#include "kvx_wire.h"

#define KVXI_AM_ID 0

typedef struct kvxi_chunk_copy kvxi_chunk_copy;

enum {
    KVXI_MSG_BEGIN = 1,
    KVXI_MSG_ACCEPT,
    KVXI_MSG_REFUSE,
    KVXI_MSG_DONE,
    KVXI_MSG_ABORT,
    KVXI_MSG_STOPPED
};

/* An endpoint to another connector, shared by every request that talks to it. */
typedef struct {
    uint64_t uid;   /* the other connector's id */
    kvx_peer peer;  /* pipe endpoint; -1 once disconnected */
    bool failed;    /* endpoint error seen (or closed by us) */
    int refs;       /* requests using it */
    kvx_rkey *rkey; /* prefill side: the decode region's key */
    uint32_t rkey_sum;
} kvxi_peer;

typedef struct kvxi_queued_msg {
    size_t len;
    struct kvxi_queued_msg *next;
    uint8_t data[];
} kvxi_queued_msg;

/* A copy of a chunk (queued, then held until its flushes completed): a small region with
 * the source layout whose blocks are the chunk's blocks b_first.. in order. Also the
 * type of a staging arena (then only bytes and data are used). */
struct kvxi_chunk_copy {
    uint32_t chunk, t0, t1, b_first, nb;
    size_t bytes;
    struct kvxi_chunk_copy *next;
    uint8_t data[]; /* (n_layers, arrays, nb, n_heads, block_size, head_dim), or staging
                       bytes */
};

typedef struct {
    bool have, accepted, refused, begin_sent, flushed, stopped_sent;
    int flush_err; /* first failed operation (flush or message) on this target */
    int ops;       /* operations in flight on this target (flushes, messages) */
    int flushes;   /* chunk flushes in flight on this target */
    int peer;      /* index into c->peers */
    uint64_t epoch, dst_uid;
    uint64_t key[2]; /* the target's key: every message of the request carries it */
    uint32_t rank, tp, n_stages;
    kvx_layout layout;
    uint64_t base, region_bytes;
    uint32_t n_blocks;
    uint32_t *blocks;
    uint32_t first_pos; /* positions below are held by the decode rank: never put */
} kvxi_pf_target;

/* One chunk of a prefill request (indexed by its chunk number): its times and the rank
 * flushes of its puts still in flight. */
typedef struct {
    uint64_t handed_ns;    /* send_chunk accepted it (0: never sent) */
    uint64_t issued_ns;    /* its puts started (0: still queued) */
    uint64_t landed_ns;    /* the last of its rank flushes completed with success (0: not yet) */
    uint32_t flushes;      /* rank flushes of this chunk in flight */
    bool failed;           /* a flush failed or could not start: it never lands */
    kvxi_chunk_copy *copy; /* drained lookup-buffer copy its puts read; freed after the flushes */
} kvxi_pf_chunk;

typedef struct kvxi_pf_req {
    uint64_t id;
    uint32_t stage, n_dst;
    uint32_t src_rank, src_tp; /* this stage's TP rank and size */
    kvx_req_state state;
    kvx_fail_reason reason;
    int err;
    int64_t deadline, abort_deadline;
    kvxi_pf_target tgt[KVX_MAX_RANKS];
    uint32_t n_tgt;
    bool finish_wanted;
    kvx_meta meta;
    int pending;           /* operations in flight whose callback will touch this record */
    int abort_phase;       /* 0: flush; 1: flushes out; 2: STOPPED sent */
    kvxi_chunk_copy *held; /* buffers whose flush could not start, freed when final */
    kvxi_pf_chunk
        *chunks; /* (n_chunks) by chunk number, grown as chunks come (<= KVX_MAX_CHUNKS) */
    uint32_t n_chunks;
    uint64_t pieces, puts, bytes;
    uint64_t staged; /* bytes of them gathered into staging arenas first */
    struct kvxi_pf_req *next;
} kvxi_pf_req;

/* One accepted writer of a decode request: (stage, source TP rank). */
typedef struct {
    uint32_t stage, src_rank;
    int peer;    /* index into c->peers; -1 once the request let go of it */
    bool done;   /* its DONE arrived (after its flush) */
    bool closed; /* it can no longer write: done, stopped, or its endpoint is gone */
    kvx_meta meta;
} kvxi_dec_writer;

#define KVX_MAX_WRITERS 256
#define KVXI_GONE_MAX   1024

/* A released decode request: its id and key (kvxi_dec_on_msg). */
typedef struct {
    bool used;
    uint64_t id;
    uint64_t key[2];
} kvxi_gone;

typedef struct kvxi_dec_req {
    uint64_t id, epoch;
    uint64_t key[2]; /* 128 random bits, in the target only: a message without them is not
                        the request's (issue 44; kvx_conn_dec.c) */
    kvx_req_state state;
    kvx_fail_reason reason;
    int err;
    uint32_t n_stages;
    uint32_t src_tp[KVX_MAX_STAGES]; /* writers expected per stage (0: none seen yet) */
    kvxi_dec_writer *w;              /* (n_w) accepted writers */
    int n_w;
    int64_t deadline, abort_deadline;
    bool abort_sent;
    struct kvxi_dec_req *next;
} kvxi_dec_req;

struct kvx_conn {
    pthread_mutex_t mu;
    kvx_pipe *pipe;
    kvx_conn_params params;
    uint64_t uid, next_epoch;
    uint8_t addr[KVX_ADDR_MAX];
    size_t addr_len;
    kvx_lookup *lb;
    kvxi_peer *peers;
    int n_peers;
    kvxi_queued_msg *inbox, *inbox_tail;
    /* decode side */
    kvx_mem *dec_mem;
    void *dec_region;
    kvx_layout dec_layout;
    uint8_t rkey[KVX_RKEY_MAX];
    size_t rkey_len;
    kvxi_dec_req *dreqs;
    int n_dreqs;
    kvxi_gone gone[KVXI_GONE_MAX]; /* the last requests released, so that a late BEGIN with
                                      the key is refused (and one without it dropped) */
    int gone_next;
    /* prefill side */
    const uint8_t *src;
    size_t src_bytes;
    kvx_layout src_layout;
    kvxi_pf_req *preqs;
    int n_preqs;
    size_t held_bytes;           /* chunk copies and staging arenas (busy or pooled) */
    kvxi_chunk_copy *stage_pool; /* idle staging arenas */
    size_t stage_pool_bytes;
    uint32_t pipe_gen; /* kvx_pipe_generation last seen */
    /* progress thread */
    pthread_t thread;
    bool thread_on, stop;
    int64_t active_ns; /* last progress that did something (spin_us) */
};

typedef struct {
    kvx_conn *c;
    kvxi_pf_req *r;
    uint32_t t;
    kvxi_chunk_copy *bufs; /* staging buffers a flush frees */
    int64_t chunk;         /* a chunk flush: the chunk's number; -1 otherwise */
} kvxi_op;

typedef struct {
    uint32_t type;
    uint64_t req, epoch, uid;
    uint64_t key[2]; /* the request's key (kvxi_dec_req.key) */
    uint32_t stage, rank;
    uint32_t src_rank, src_tp;
    int32_t first_token;
    uint32_t n_tokens;
    const uint8_t *addr;
    uint32_t addr_len;
} kvxi_msg;

/* bytes of one (block, head): block_size x head_dim elements */
static inline size_t kvxi_head_bytes(const kvx_layout *l)
{
    return (size_t)l->block_size * l->head_dim * l->dtype_size;
}

/* byte offset of (local layer, K/V, block, head index inside the region, token); kv 1 of a
 * one-array (latent) layout is its K */
static inline size_t kvxi_kv_off(const kvx_layout *l, uint32_t ll, uint32_t kv, uint32_t blk,
                                 uint32_t h, uint32_t tok)
{
    size_t hb = kvxi_head_bytes(l), tokb = (size_t)l->head_dim * l->dtype_size;
    uint32_t na = kvx_layout_arrays(l);
    size_t arr = ((size_t)ll * na + kv % na) * l->n_blocks * l->n_heads * hb;
    if (l->n_slices <= 1) return arr + ((size_t)blk * l->n_heads + h) * hb + (size_t)tok * tokb;
    uint32_t s0 = 0, s = 0;
    while (s + 1 < l->n_slices && h >= s0 + l->slice_heads[s])
        s0 += l->slice_heads[s++];
    return arr + ((size_t)s0 * l->n_blocks + (size_t)blk * l->slice_heads[s] + (h - s0)) * hb +
           (size_t)tok * tokb;
}

static inline bool kvxi_pf_final(const kvxi_pf_req *r)
{
    return r->state == KVX_REQ_DONE || r->state == KVX_REQ_FAILED;
}

static inline bool kvxi_dec_live(const kvxi_dec_req *r)
{
    return r->state == KVX_REQ_WAITING || r->state == KVX_REQ_TRANSFERRING;
}

/* kvx_conn.c */
int kvxi_peer_get(kvx_conn *c, uint64_t uid, const void *addr, size_t addr_len, int *out);
void kvxi_peer_close(kvx_conn *c, int i, bool force);
bool kvxi_peer_ok(kvx_conn *c, int i);
int kvxi_msg_send_cb(kvx_conn *c, int pi, const kvxi_msg *m, kvx_done_cb cb, void *arg);
int kvxi_msg_send(kvx_conn *c, int pi, const kvxi_msg *m);
void kvxi_free_copy(void *arg, const kvx_lb_key *k, void *val, size_t bytes);
void kvxi_kick(kvx_conn *c);
void kvxi_wr_layout(kvx_wr *w, const kvx_layout *l);
/* Whether a and b hold the same key; the time does not depend on where they differ. */
static inline bool kvxi_key_eq(const uint64_t a[2], const uint64_t b[2])
{
    return ((a[0] ^ b[0]) | (a[1] ^ b[1])) == 0;
}
void kvxi_rd_layout(kvx_rd *r, kvx_layout *l);

/* kvx_conn_pf.c */
void kvxi_pf_step(kvx_conn *c, kvxi_pf_req *r, int64_t now);
void kvxi_pf_free(kvxi_pf_req *r);
void kvxi_pf_on_msg(kvx_conn *c, const kvxi_msg *m); /* ACCEPT, REFUSE, ABORT */

/* kvx_conn_put.c */
/* Put tokens [t0, t1) of the source (region src with layout sl, logical block b in
 * block id sblk[b - sfirst]) into target t: its heads only, and only positions at or after
 * t->first_pos (a chunk entirely below puts nothing). *arena gets the staging
 * buffer the puts read (NULL if none): it must live until a flush of t completed. */
int kvxi_pf_put_range(kvx_conn *c, kvxi_pf_req *r, kvxi_pf_target *t, const uint8_t *src,
                      const kvx_layout *sl, const uint32_t *sblk, uint32_t sfirst, uint32_t t0,
                      uint32_t t1, kvxi_chunk_copy **arena);
/* Check a chunk fits a target (token range inside its blocks, layers inside its layers,
 * same geometry): TD_ERANGE (logged) if not. */
int kvxi_pf_check_fit(kvxi_pf_req *r, const kvxi_pf_target *t, const kvx_layout *sl, uint32_t t1);
/* Give a staging arena back (kept for reuse up to STAGE_POOL_MAX bytes, else freed). */
void kvxi_arena_put(kvx_conn *c, kvxi_chunk_copy *a);

/* kvx_conn_dec.c */
void kvxi_dec_step(kvx_conn *c, kvxi_dec_req *r, int64_t now);
void kvxi_dec_on_msg(kvx_conn *c, const kvxi_msg *m); /* BEGIN, DONE, STOPPED */
void kvxi_dec_pipe_reset(kvx_conn *c);                /* the pipe replaced its worker */

#endif
