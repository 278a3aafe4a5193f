/* kvx_conn_pf.c: the prefill side of the connector: the request state machine, per-chunk
 * flushes and times, the lookup-buffer path, target decoding, the kvx_pf_ API (the puts
 * themselves: kvx_conn_put.c). */
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvx_conn_int.h"
#include "td_clock.h"

/* --- prefill side ----------------------------------------------------------------------- */

static kvxi_pf_req *kvxi_pf_find(kvx_conn *c, uint64_t id)
{
    for (kvxi_pf_req *r = c->preqs; r; r = r->next)
        if (r->id == id) return r;
    return NULL;
}

static void kvxi_pf_fail(kvx_conn *c, kvxi_pf_req *r, kvx_fail_reason why, int err)
{
    if (kvxi_pf_final(r) || r->state == KVX_REQ_ABORTING) return;
    if (why != KVX_FAIL_ABORTED)
        TD_LOG_ERR("kvx conn: req %llu stage %u failed in state %s: %s (%s)",
                   (unsigned long long)r->id, r->stage, kvx_req_state_name(r->state),
                   why == KVX_FAIL_TIMEOUT        ? "timeout"
                   : why == KVX_FAIL_PEER_ABORTED ? "aborted by the decode side"
                   : why == KVX_FAIL_PEER_FAILED  ? "peer failed"
                                                  : "bad input",
                   td_strerror(err));
    r->state = KVX_REQ_ABORTING;
    r->reason = why;
    r->err = err;
    r->abort_phase = 0;
    r->abort_deadline = td_now_ms() + c->params.abort_timeout_ms;
    kvx_lookup_drop_request(c->lb, r->id, kvxi_free_copy, NULL);
}

static void kvxi_pf_op_done(void *arg, int status, size_t len)
{
    kvxi_op *o = arg;
    kvxi_pf_target *t = &o->r->tgt[o->t];
    if (status && !t->flush_err) t->flush_err = status;
    t->ops--;
    o->r->pending--;
    free(o);
}

static void kvxi_pf_flush_done(void *arg, int status, size_t len)
{
    kvxi_op *o = arg;
    o->r->tgt[o->t].flushed = true;
    kvxi_pf_op_done(arg, status, len);
}

/* Start a flush (m == NULL) or a message to target t, counted in r->pending. */
static int kvxi_pf_start_op(kvx_conn *c, kvxi_pf_req *r, uint32_t t, const kvxi_msg *m)
{
    kvxi_op *o = malloc(sizeof(*o));
    if (!o) return TD_ENOMEM;
    *o = (kvxi_op){c, r, t, NULL, -1};
    kvxi_pf_target *tg = &r->tgt[t];
    int err;
    if (!kvxi_peer_ok(c, tg->peer))
        err = TD_EIO;
    else if (!m)
        err = kvx_pipe_flush(c->pipe, c->peers[tg->peer].peer, kvxi_pf_flush_done, o);
    else
        err = kvxi_msg_send_cb(c, tg->peer, m, kvxi_pf_op_done, o);
    if (err) {
        free(o);
        return err;
    }
    r->pending++;
    tg->ops++;
    return 0;
}

/* --- chunks: records, per-rank flushes, times ------------------------------------------ */

/* The record of chunk number k (< KVX_MAX_CHUNKS), the array grown on demand (doubling,
 * so a request holds at most KVX_MAX_CHUNKS records); NULL if out of memory. */
static kvxi_pf_chunk *chunk_rec(kvxi_pf_req *r, uint32_t k)
{
    if (k < r->n_chunks) return &r->chunks[k];
    uint32_t n = r->n_chunks ? r->n_chunks : 16;
    while (n <= k)
        n *= 2;
    if (n > KVX_MAX_CHUNKS) n = KVX_MAX_CHUNKS;
    kvxi_pf_chunk *nc = realloc(r->chunks, n * sizeof(*nc));
    if (!nc) return NULL;
    memset(nc + r->n_chunks, 0, (n - r->n_chunks) * sizeof(*nc));
    r->chunks = nc;
    r->n_chunks = n;
    return &nc[k];
}

/* Once no flush of the chunk is in flight (they were all started: completions only run in
 * progress, never while a chunk is being issued): it landed unless something failed, and
 * its copy goes (after a failure it waits for the final state, like an unflushed arena). */
static void chunk_settle(kvx_conn *c, kvxi_pf_req *r, kvxi_pf_chunk *ch)
{
    if (ch->flushes) return;
    if (!ch->failed && !ch->landed_ns) ch->landed_ns = (uint64_t)td_now_ns();
    kvxi_chunk_copy *cc = ch->copy;
    if (!cc) return;
    ch->copy = NULL;
    if (ch->failed) {
        cc->next = r->held;
        r->held = cc;
        return;
    }
    c->held_bytes -= cc->bytes;
    free(cc);
}

static void kvxi_pf_chunk_flush_done(void *arg, int status, size_t len)
{
    kvxi_op *o = arg;
    kvxi_pf_req *r = o->r;
    kvxi_pf_target *t = &r->tgt[o->t];
    kvxi_pf_chunk *ch = &r->chunks[o->chunk];
    if (status) {
        if (!t->flush_err) t->flush_err = status;
        ch->failed = true;
    }
    if (o->bufs) kvxi_arena_put(o->c, o->bufs);
    t->ops--;
    t->flushes--;
    r->pending--;
    ch->flushes--;
    chunk_settle(o->c, r, ch);
    free(o);
}

/* After chunk k's puts to target t: one flush of t covers them (and frees their staging
 * arena when it completes). If it cannot start, the chunk never lands, the target
 * records the error and the arena waits for the final state. */
static int kvxi_pf_chunk_flush(kvx_conn *c, kvxi_pf_req *r, uint32_t t, uint32_t k,
                               kvxi_chunk_copy *arena)
{
    kvxi_pf_target *tg = &r->tgt[t];
    kvxi_pf_chunk *ch = &r->chunks[k];
    kvxi_op *o = malloc(sizeof(*o));
    int err = o ? 0 : TD_ENOMEM;
    if (!err && !kvxi_peer_ok(c, tg->peer)) err = TD_EIO;
    if (!err) {
        *o = (kvxi_op){c, r, t, arena, k};
        err = kvx_pipe_flush(c->pipe, c->peers[tg->peer].peer, kvxi_pf_chunk_flush_done, o);
    }
    if (!err) {
        r->pending++;
        tg->ops++;
        tg->flushes++;
        ch->flushes++;
        return 0;
    }
    free(o);
    if (arena) {
        arena->next = r->held;
        r->held = arena;
    }
    ch->failed = true;
    if (!tg->flush_err) tg->flush_err = err;
    return err;
}

/* Issue chunk k: tokens [t0, t1) of src (layout sl, logical block b in sblk[b - sfirst])
 * to every target, then one flush per target that got puts. */
static int kvxi_pf_issue_chunk(kvx_conn *c, kvxi_pf_req *r, uint32_t k, const uint8_t *src,
                               const kvx_layout *sl, const uint32_t *sblk, uint32_t sfirst,
                               uint32_t t0, uint32_t t1)
{
    kvxi_pf_chunk *ch = &r->chunks[k];
    ch->issued_ns = (uint64_t)td_now_ns();
    int err = 0;
    for (uint32_t t = 0; t < r->n_tgt && !err; t++) {
        kvxi_chunk_copy *arena = NULL;
        uint64_t puts = r->puts;
        err = kvxi_pf_check_fit(r, &r->tgt[t], sl, t1);
        if (!err) err = kvxi_pf_put_range(c, r, &r->tgt[t], src, sl, sblk, sfirst, t0, t1, &arena);
        if (r->puts != puts || arena) {
            int ferr = kvxi_pf_chunk_flush(c, r, t, k, arena);
            if (!err) err = ferr;
        }
    }
    if (err) ch->failed = true;
    chunk_settle(c, r, ch);
    return err;
}

/* A chunk that waited in the lookup buffer goes out from its copy (held until its
 * flushes completed). */
static int kvxi_pf_send_copy(kvx_conn *c, kvxi_pf_req *r, kvxi_chunk_copy *cc)
{
    kvxi_pf_chunk *ch = &r->chunks[cc->chunk];
    ch->copy = cc;
    c->held_bytes += cc->bytes;
    kvx_layout pl = c->src_layout;
    pl.n_blocks = cc->nb;
    uint32_t *ids = malloc(cc->nb * sizeof(*ids));
    if (!ids) {
        ch->failed = true;
        chunk_settle(c, r, ch);
        return TD_ENOMEM;
    }
    for (uint32_t i = 0; i < cc->nb; i++)
        ids[i] = i;
    int err = kvxi_pf_issue_chunk(c, r, cc->chunk, cc->data, &pl, ids, cc->b_first, cc->t0, cc->t1);
    free(ids);
    return err;
}

/* --- the request state machine (kvx_conn.h, "Prefill request states") -------------------- */

/* Any non-final state: the deadline, a failed endpoint, a REFUSE or a failed flush (or
 * message) moves the request to ABORTING. */
static void kvxi_pf_check(kvx_conn *c, kvxi_pf_req *r, int64_t now)
{
    if (now >= r->deadline) kvxi_pf_fail(c, r, KVX_FAIL_TIMEOUT, TD_ETIMEDOUT);
    for (uint32_t t = 0; t < r->n_tgt && r->state != KVX_REQ_ABORTING; t++) {
        kvxi_pf_target *tg = &r->tgt[t];
        if (tg->have && !kvxi_peer_ok(c, tg->peer))
            kvxi_pf_fail(c, r, KVX_FAIL_PEER_FAILED, TD_EIO);
        else if (tg->refused)
            kvxi_pf_fail(c, r, KVX_FAIL_PEER_ABORTED, TD_ESTATE);
        else if (tg->flush_err) /* a chunk's flush (or a message) failed */
            kvxi_pf_fail(c, r, KVX_FAIL_PEER_FAILED, tg->flush_err);
    }
}

/* A message of this request to target tg: the fields every type carries. */
static kvxi_msg kvxi_pf_msg(const kvxi_pf_req *r, const kvxi_pf_target *tg, uint32_t type)
{
    return (kvxi_msg){.type = type,
                      .req = r->id,
                      .epoch = tg->epoch,
                      .key = {tg->key[0], tg->key[1]},
                      .stage = r->stage,
                      .src_rank = r->src_rank,
                      .src_tp = r->src_tp,
                      .rank = tg->rank};
}

/* OPEN -> BEGUN once every target was added: BEGIN to each. False while waiting or failed. */
static bool kvxi_pf_begin(kvx_conn *c, kvxi_pf_req *r)
{
    if (!r->n_dst) return false;
    for (uint32_t t = 0; t < r->n_dst; t++)
        if (!r->tgt[t].have) return false;
    for (uint32_t t = 0; t < r->n_dst; t++) {
        kvxi_pf_target *tg = &r->tgt[t];
        kvxi_msg m = kvxi_pf_msg(r, tg, KVXI_MSG_BEGIN);
        m.addr = c->addr;
        m.addr_len = (uint32_t)c->addr_len;
        int err = kvxi_pf_start_op(c, r, t, &m);
        if (err) {
            kvxi_pf_fail(c, r, KVX_FAIL_PEER_FAILED, err);
            return false;
        }
        tg->begin_sent = true;
    }
    r->state = KVX_REQ_BEGUN;
    return true;
}

/* BEGUN -> READY once every rank ACCEPTed: the chunks queued in the lookup buffer go out.
 * False while waiting or failed. */
static bool kvxi_pf_ready(kvx_conn *c, kvxi_pf_req *r)
{
    for (uint32_t t = 0; t < r->n_tgt; t++)
        if (!r->tgt[t].accepted) return false;
    r->state = KVX_REQ_READY;
    kvx_lb_key k;
    void *v;
    while (kvx_lookup_drop_first(c->lb, r->id, &k, &v, NULL) == 0) {
        int err = kvxi_pf_send_copy(c, r, v);
        if (err) {
            kvxi_pf_fail(c, r, err == TD_ERANGE ? KVX_FAIL_BAD_INPUT : KVX_FAIL_PEER_FAILED, err);
            return false;
        }
    }
    return true;
}

/* FLUSHING -> NOTIFYING once every chunk flush completed (every chunk's puts to a target
 * were followed by a flush of it): DONE with the metadata to each target. */
static void kvxi_pf_notify(kvx_conn *c, kvxi_pf_req *r)
{
    for (uint32_t t = 0; t < r->n_tgt; t++) {
        if (r->tgt[t].flush_err) {
            kvxi_pf_fail(c, r, KVX_FAIL_PEER_FAILED, r->tgt[t].flush_err);
            return;
        }
        if (r->tgt[t].flushes) return;
    }
    for (uint32_t t = 0; t < r->n_tgt; t++) {
        kvxi_msg m = kvxi_pf_msg(r, &r->tgt[t], KVXI_MSG_DONE);
        m.first_token = r->meta.first_token;
        m.n_tokens = r->meta.n_tokens;
        int err = kvxi_pf_start_op(c, r, t, &m);
        if (err) {
            kvxi_pf_fail(c, r, KVX_FAIL_PEER_FAILED, err);
            return;
        }
    }
    r->state = KVX_REQ_NOTIFYING;
}

/* NOTIFYING -> DONE once every notice was sent. False while waiting or failed. */
static bool kvxi_pf_done(kvx_conn *c, kvxi_pf_req *r)
{
    if (r->pending) return false;
    for (uint32_t t = 0; t < r->n_tgt; t++)
        if (r->tgt[t].flush_err) {
            kvxi_pf_fail(c, r, KVX_FAIL_PEER_FAILED, r->tgt[t].flush_err);
            return false;
        }
    r->state = KVX_REQ_DONE;
    return true;
}

/* ABORTING -> FAILED: wait for what is in flight (closing a peer that does not complete
 * it within abort_timeout_ms), flush every target that got a BEGIN, then send it STOPPED.
 * True once FAILED. */
static bool kvxi_pf_abort_step(kvx_conn *c, kvxi_pf_req *r, int64_t now)
{
    if (now >= r->abort_deadline && r->pending) {
        /* a peer that does not complete our flush within the bound is closed: its
         * operations complete with errors and nothing of ours is read any more */
        for (uint32_t t = 0; t < r->n_tgt; t++)
            if (r->tgt[t].have && kvxi_peer_ok(c, r->tgt[t].peer) && r->tgt[t].ops > 0) {
                TD_LOG_WARN("kvx conn: req %llu rank %u: closing an unresponsive peer",
                            (unsigned long long)r->id, r->tgt[t].rank);
                kvxi_peer_close(c, r->tgt[t].peer, true);
            }
        return false;
    }
    if (r->pending) return false;
    if (r->abort_phase == 0) {
        for (uint32_t t = 0; t < r->n_tgt; t++) {
            kvxi_pf_target *tg = &r->tgt[t];
            tg->flushed = false;
            tg->flush_err = 0;
            if (tg->begin_sent && kvxi_peer_ok(c, tg->peer)) kvxi_pf_start_op(c, r, t, NULL);
        }
        r->abort_phase = 1;
        return false;
    }
    if (r->abort_phase == 1) {
        for (uint32_t t = 0; t < r->n_tgt; t++) {
            kvxi_pf_target *tg = &r->tgt[t];
            if (!tg->begin_sent || !kvxi_peer_ok(c, tg->peer)) continue;
            kvxi_msg m = kvxi_pf_msg(r, tg, KVXI_MSG_STOPPED);
            kvxi_pf_start_op(c, r, t, &m);
        }
        r->abort_phase = 2;
        return false;
    }
    r->state = KVX_REQ_FAILED;
    return true;
}

/* DONE or FAILED reached: copies go, endpoints are no longer used by this request. */
static void kvxi_pf_let_go(kvx_conn *c, kvxi_pf_req *r)
{
    while (r->held) {
        kvxi_chunk_copy *cc = r->held;
        r->held = cc->next;
        c->held_bytes -= cc->bytes;
        free(cc);
    }
    for (uint32_t k = 0; k < r->n_chunks; k++)
        if (r->chunks[k].copy) { /* not expected: no flush is in flight any more */
            c->held_bytes -= r->chunks[k].copy->bytes;
            free(r->chunks[k].copy);
            r->chunks[k].copy = NULL;
        }
    kvx_lookup_drop_request(c->lb, r->id, kvxi_free_copy, NULL);
    for (uint32_t t = 0; t < r->n_tgt; t++)
        if (r->tgt[t].have && r->tgt[t].peer >= 0) {
            c->peers[r->tgt[t].peer].refs--;
            r->tgt[t].peer = -1;
        }
}

/* Advance one prefill request as far as it can go now. */
void kvxi_pf_step(kvx_conn *c, kvxi_pf_req *r, int64_t now)
{
    if (kvxi_pf_final(r)) return;
    if (r->state != KVX_REQ_ABORTING) kvxi_pf_check(c, r, now);
    switch (r->state) {
    case KVX_REQ_OPEN:
        if (!kvxi_pf_begin(c, r)) return;
    /* fall through */
    case KVX_REQ_BEGUN:
        if (!kvxi_pf_ready(c, r)) return;
    /* fall through */
    case KVX_REQ_READY:
        if (!r->finish_wanted) return; /* a finish before READY runs here */
        r->state = KVX_REQ_FLUSHING;
    /* fall through */
    case KVX_REQ_FLUSHING:
        kvxi_pf_notify(c, r);
        return;
    case KVX_REQ_NOTIFYING:
        if (!kvxi_pf_done(c, r)) return;
        break;
    case KVX_REQ_ABORTING:
        if (!kvxi_pf_abort_step(c, r, now)) return;
        break;
    default:
        return;
    }
    kvxi_pf_let_go(c, r);
}

void kvxi_pf_free(kvxi_pf_req *r)
{
    for (uint32_t t = 0; t < KVX_MAX_RANKS; t++)
        free(r->tgt[t].blocks);
    while (r->held) {
        kvxi_chunk_copy *cc = r->held;
        r->held = cc->next;
        free(cc);
    }
    for (uint32_t k = 0; k < r->n_chunks; k++)
        free(r->chunks[k].copy);
    free(r->chunks);
    free(r);
}

/* ACCEPT, REFUSE or ABORT from a decode rank. */
void kvxi_pf_on_msg(kvx_conn *c, const kvxi_msg *m)
{
    kvxi_pf_req *r = kvxi_pf_find(c, m->req);
    kvxi_pf_target *t = NULL;
    for (uint32_t i = 0; r && i < r->n_tgt; i++)
        if (r->tgt[i].have && r->tgt[i].epoch == m->epoch && r->tgt[i].dst_uid == m->uid &&
            kvxi_key_eq(r->tgt[i].key, m->key))
            t = &r->tgt[i];
    if (!t) { /* a stale one, or from a process that was never given the target */
        TD_LOG_WARN("kvx conn: req %llu: message %u for no known target, or without the "
                    "target's key (dropped)",
                    (unsigned long long)m->req, m->type);
        return;
    }
    if (m->type == KVXI_MSG_ACCEPT)
        t->accepted = true;
    else if (m->type == KVXI_MSG_REFUSE)
        t->refused = true;
    else
        kvxi_pf_fail(c, r, KVX_FAIL_PEER_ABORTED, TD_ESTATE);
}

/* --- prefill API ------------------------------------------------------------------------ */

int kvx_pf_register_source(kvx_conn *c, void *region, size_t bytes, const kvx_layout *layout)
{
    size_t need = kvx_layout_bytes(layout);
    if (!region || !need || bytes < need) {
        TD_LOG_ERR("kvx conn: source: invalid layout or region (%zu bytes, layout needs %zu)",
                   bytes, need);
        return TD_EINVAL;
    }
    pthread_mutex_lock(&c->mu);
    int err = c->src ? TD_ESTATE : 0;
    if (!err) {
        c->src = region;
        c->src_bytes = need;
        c->src_layout = *layout;
    }
    pthread_mutex_unlock(&c->mu);
    return err;
}

int kvx_pf_open(kvx_conn *c, uint64_t req_id, const kvx_pf_req_params *p)
{
    if (!p || p->stage >= KVX_MAX_STAGES || p->n_dst > KVX_MAX_RANKS || p->src_tp > KVX_MAX_RANKS ||
        p->src_rank >= (p->src_tp ? p->src_tp : 1))
        return TD_EINVAL;
    pthread_mutex_lock(&c->mu);
    int err = 0;
    kvxi_pf_req *r = NULL;
    if (!c->src)
        err = TD_ESTATE;
    else if (kvxi_pf_find(c, req_id))
        err = TD_ESTATE;
    else if (!(r = calloc(1, sizeof(*r))))
        err = TD_ENOMEM;
    if (err) {
        pthread_mutex_unlock(&c->mu);
        if (err == TD_ESTATE)
            TD_LOG_ERR("kvx conn: req %llu: open: %s", (unsigned long long)req_id,
                       c->src ? "already open" : "no source region registered");
        return err;
    }
    r->id = req_id;
    r->stage = p->stage;
    r->src_rank = p->src_rank;
    r->src_tp = p->src_tp ? p->src_tp : 1;
    r->n_dst = p->n_dst;
    r->n_tgt = p->n_dst;
    r->state = KVX_REQ_OPEN;
    r->deadline = td_now_ms() + (p->timeout_ms > 0 ? p->timeout_ms : c->params.timeout_ms);
    for (int t = 0; t < KVX_MAX_RANKS; t++)
        r->tgt[t].peer = -1;
    r->next = c->preqs;
    c->preqs = r;
    c->n_preqs++;
    pthread_mutex_unlock(&c->mu);
    return 0;
}

/* Decode target bytes into t (blocks allocated); TD_EFORMAT if malformed. */
static int target_decode(const void *buf, size_t len, kvxi_pf_target *t, const uint8_t **addr,
                         uint32_t *addr_len, const uint8_t **rkey, uint32_t *rkey_len,
                         uint64_t *req_id)
{
    const void *pl;
    size_t n;
    if (kvx_frame_read(buf, len, KVX_MAGIC_TARGET, KVX_KIND_UCX, &pl, &n)) return TD_EFORMAT;
    kvx_rd r;
    kvx_rd_init(&r, pl, n);
    *req_id = kvx_rd_u64(&r);
    t->epoch = kvx_rd_u64(&r);
    t->key[0] = kvx_rd_u64(&r);
    t->key[1] = kvx_rd_u64(&r);
    t->dst_uid = kvx_rd_u64(&r);
    t->rank = kvx_rd_u32(&r);
    t->tp = kvx_rd_u32(&r);
    t->n_stages = kvx_rd_u32(&r);
    kvxi_rd_layout(&r, &t->layout);
    t->base = kvx_rd_u64(&r);
    t->region_bytes = kvx_rd_u64(&r);
    *addr_len = kvx_rd_u32(&r);
    *addr = kvx_rd_bytes(&r, *addr_len);
    *rkey_len = kvx_rd_u32(&r);
    *rkey = kvx_rd_bytes(&r, *rkey_len);
    t->n_blocks = kvx_rd_u32(&r);
    if (!r.ok || t->n_blocks == 0 || t->n_blocks > (n - r.off) / 4) return TD_EFORMAT;
    /* fuzz_kvx found: an invalid layout (kvx_layout_bytes 0, e.g. more heads than the
     * model has) with region_bytes 0 passed the size check, and puts computed from it
     * went outside the decode region (tests/fuzz/regress/kvx-invalid-layout-target,
     * kvx-heads-beyond-layout) */
    if (!t->tp || t->tp > KVX_MAX_RANKS || t->rank >= t->tp || !t->n_stages ||
        t->n_stages > KVX_MAX_STAGES || !kvx_layout_bytes(&t->layout) ||
        kvx_layout_bytes(&t->layout) != t->region_bytes || t->base + t->region_bytes < t->base)
        return TD_EFORMAT;
    t->blocks = malloc(t->n_blocks * sizeof(uint32_t));
    if (!t->blocks) return TD_ENOMEM;
    for (uint32_t i = 0; i < t->n_blocks; i++) {
        t->blocks[i] = kvx_rd_u32(&r);
        if (t->blocks[i] >= t->layout.n_blocks) {
            free(t->blocks);
            t->blocks = NULL;
            return TD_EFORMAT;
        }
    }
    /* optional tail (kvx_dec_req_params.first_pos): absent means 0, a 0 written is invalid */
    if (r.off < n && ((t->first_pos = kvx_rd_u32(&r)) == 0 ||
                      (uint64_t)t->first_pos >= (uint64_t)t->n_blocks * t->layout.block_size))
        r.ok = false;
    if (!r.ok || r.off != n) {
        free(t->blocks);
        t->blocks = NULL;
        return TD_EFORMAT;
    }
    return 0;
}

int kvx_pf_add_target(kvx_conn *c, uint64_t req_id, const void *target, size_t len)
{
    kvxi_pf_target t = {0};
    const uint8_t *addr, *rkey;
    uint32_t addr_len, rkey_len;
    uint64_t tid;
    int err = target_decode(target, len, &t, &addr, &addr_len, &rkey, &rkey_len, &tid);
    if (err) {
        TD_LOG_ERR("kvx conn: req %llu: malformed KV target (%zu bytes)",
                   (unsigned long long)req_id, len);
        return err;
    }
    t.peer = -1;
    pthread_mutex_lock(&c->mu);
    kvxi_pf_req *r = kvxi_pf_find(c, req_id);
    const kvx_layout *sl = &c->src_layout, *dl = &t.layout;
    if (!r) {
        err = TD_ENOENT;
    } else if (tid != req_id) {
        TD_LOG_ERR("kvx conn: req %llu: target is for req %llu", (unsigned long long)req_id,
                   (unsigned long long)tid);
        err = TD_EINVAL;
    } else if (r->state != KVX_REQ_OPEN) {
        TD_LOG_ERR("kvx conn: req %llu: target in state %s", (unsigned long long)req_id,
                   kvx_req_state_name(r->state));
        err = TD_ESTATE;
    } else if ((r->n_dst && t.tp != r->n_dst) || r->stage >= t.n_stages || r->tgt[t.rank].have) {
        TD_LOG_ERR("kvx conn: req %llu rank %u: target does not match the request (tp %u, "
                   "stages %u)",
                   (unsigned long long)req_id, t.rank, t.tp, t.n_stages);
        err = TD_EINVAL;
    } else if (dl->n_kv_heads != sl->n_kv_heads || dl->block_size != sl->block_size ||
               dl->head_dim != sl->head_dim || dl->dtype_size != sl->dtype_size) {
        TD_LOG_ERR("kvx conn: req %llu rank %u: target geometry (heads %u, block %u, dim %u, "
                   "dtype %u bytes) differs from the source",
                   (unsigned long long)req_id, t.rank, dl->n_kv_heads, dl->block_size, dl->head_dim,
                   dl->dtype_size);
        err = TD_EINVAL;
    } else if (kvx_layout_arrays(dl) != kvx_layout_arrays(sl)) {
        TD_LOG_ERR("kvx conn: req %llu rank %u: the target's KV pool holds %s a layer, the "
                   "source's %s: the two sides laid the model's KV out differently",
                   (unsigned long long)req_id, t.rank,
                   kvx_layout_arrays(dl) == 1 ? "one latent array" : "K and V",
                   kvx_layout_arrays(sl) == 1 ? "one latent array" : "K and V");
        err = TD_EINVAL;
    }
    int pi = -1;
    if (!err) err = kvxi_peer_get(c, t.dst_uid, addr, addr_len, &pi);
    if (!err) {
        kvxi_peer *p = &c->peers[pi];
        uint32_t sum = kvx_fnv1a(rkey, rkey_len);
        if (p->rkey && p->rkey_sum != sum) {
            kvx_pipe_rkey_destroy(c->pipe, p->rkey);
            p->rkey = NULL;
        }
        if (!p->rkey) {
            err = kvx_pipe_rkey_unpack(c->pipe, p->peer, rkey, rkey_len, &p->rkey);
            p->rkey_sum = sum;
            if (err) p->rkey = NULL;
        }
    }
    if (!err) {
        t.have = true;
        t.peer = pi;
        c->peers[pi].refs++;
        if (!r->n_dst) r->n_dst = r->n_tgt = t.tp;
        r->tgt[t.rank] = t;
        t.blocks = NULL;
        kvxi_pf_step(c, r, td_now_ms());
    }
    pthread_mutex_unlock(&c->mu);
    free(t.blocks);
    kvxi_kick(c);
    return err;
}

/* Copy blocks ids[0 .. pl->n_blocks) (every layer, K and V or the latent array, all held
 * heads) of the source (layout sl) into dst, blocks 0 .. n_blocks - 1 of layout pl (sl's
 * shape, slices and arrays). */
static void copy_blocks(uint8_t *dst, const kvx_layout *pl, const uint8_t *src,
                        const kvx_layout *sl, const int32_t *ids)
{
    uint32_t n_sl = sl->n_slices > 1 ? sl->n_slices : 1;
    for (uint32_t ll = 0; ll < sl->n_layers; ll++)
        for (uint32_t kv = 0; kv < kvx_layout_arrays(sl); kv++)
            for (uint32_t s = 0, h = 0; s<n_sl; h += n_sl> 1 ? sl->slice_heads[s] : 0, s++) {
                uint32_t nh = n_sl > 1 ? sl->slice_heads[s] : sl->n_heads;
                for (uint32_t i = 0; i < pl->n_blocks; i++)
                    memcpy(dst + kvxi_kv_off(pl, ll, kv, i, h, 0),
                           src + kvxi_kv_off(sl, ll, kv, (uint32_t)ids[i], h, 0),
                           (size_t)nh * kvxi_head_bytes(sl));
            }
}

int kvx_pf_send_chunk(kvx_conn *c, uint64_t req_id, uint32_t chunk, uint32_t t0, uint32_t t1,
                      const int32_t *src_blocks, uint32_t n_src_blocks)
{
    uint64_t handed = (uint64_t)td_now_ns();
    pthread_mutex_lock(&c->mu);
    kvxi_pf_req *r = kvxi_pf_find(c, req_id);
    const kvx_layout *sl = &c->src_layout;
    int err = 0;
    if (!r)
        err = TD_ENOENT;
    else if (r->state == KVX_REQ_ABORTING || r->state == KVX_REQ_FAILED)
        err = r->err ? r->err : TD_ESTATE;
    else if (r->finish_wanted || r->state > KVX_REQ_READY || r->state == KVX_REQ_DONE)
        err = TD_ESTATE;
    else if (t0 >= t1 || !src_blocks || (uint64_t)n_src_blocks * sl->block_size < t1) {
        TD_LOG_ERR("kvx conn: req %llu chunk %u: bad token range %u-%u (%u source blocks)",
                   (unsigned long long)req_id, chunk, t0, t1, n_src_blocks);
        err = TD_EINVAL;
    } else if (chunk >= KVX_MAX_CHUNKS) {
        TD_LOG_ERR("kvx conn: req %llu chunk %u: chunk numbers go up to %u",
                   (unsigned long long)req_id, chunk, KVX_MAX_CHUNKS - 1);
        err = TD_EINVAL;
    } else if (chunk < r->n_chunks && r->chunks[chunk].handed_ns) {
        TD_LOG_ERR("kvx conn: req %llu chunk %u: sent twice", (unsigned long long)req_id, chunk);
        err = TD_ESTATE;
    }
    uint32_t bs = sl->block_size, b_first = t0 / (bs ? bs : 1), b_last = (t1 - 1) / (bs ? bs : 1);
    for (uint32_t b = b_first; !err && b <= b_last; b++)
        if (src_blocks[b] < 0 || (uint32_t)src_blocks[b] >= sl->n_blocks) {
            TD_LOG_ERR("kvx conn: req %llu chunk %u: source block %d out of range",
                       (unsigned long long)req_id, chunk, src_blocks[b]);
            err = TD_EINVAL;
        }
    kvxi_pf_chunk *ch = err ? NULL : chunk_rec(r, chunk);
    if (!err && !ch) err = TD_ENOMEM;
    if (err) {
        pthread_mutex_unlock(&c->mu);
        return err;
    }
    if (r->state == KVX_REQ_READY) {
        uint32_t *ids = malloc((b_last + 1) * sizeof(*ids));
        err = ids ? 0 : TD_ENOMEM;
        for (uint32_t b = 0; ids && b <= b_last; b++)
            ids[b] = b >= b_first ? (uint32_t)src_blocks[b] : 0;
        if (!err) {
            ch->handed_ns = handed;
            err = kvxi_pf_issue_chunk(c, r, chunk, c->src, sl, ids, 0, t0, t1);
        }
        free(ids);
        if (err)
            kvxi_pf_fail(c, r, err == TD_ERANGE ? KVX_FAIL_BAD_INPUT : KVX_FAIL_PEER_FAILED, err);
    } else {
        /* not ready: copy the chunk's blocks (all held heads) into the lookup buffer */
        uint32_t nb = b_last - b_first + 1;
        size_t blk = (size_t)sl->n_heads * kvxi_head_bytes(sl);
        size_t bytes = (size_t)sl->n_layers * kvx_layout_arrays(sl) * nb * blk;
        kvxi_chunk_copy *cc = malloc(sizeof(*cc) + bytes);
        if (!cc) err = TD_ENOMEM;
        if (cc) {
            *cc = (kvxi_chunk_copy){
                .chunk = chunk, .t0 = t0, .t1 = t1, .b_first = b_first, .nb = nb, .bytes = bytes};
            kvx_layout pl = *sl;
            pl.n_blocks = nb;
            copy_blocks(cc->data, &pl, c->src, sl, src_blocks + b_first);
            kvx_lb_key k = {.req_id = req_id,
                            .chunk = chunk,
                            .layer0 = sl->layer0,
                            .layer1 = sl->layer0 + sl->n_layers};
            err = kvx_lookup_insert(c->lb, &k, cc, bytes, 0);
            if (err)
                free(cc);
            else
                ch->handed_ns = handed;
        }
    }
    pthread_mutex_unlock(&c->mu);
    kvxi_kick(c);
    return err;
}

int kvx_pf_finish(kvx_conn *c, uint64_t req_id, const kvx_meta *meta)
{
    pthread_mutex_lock(&c->mu);
    kvxi_pf_req *r = kvxi_pf_find(c, req_id);
    int err = 0;
    if (!r)
        err = TD_ENOENT;
    else if (r->finish_wanted || r->state > KVX_REQ_READY || r->state == KVX_REQ_DONE ||
             r->state == KVX_REQ_ABORTING || r->state == KVX_REQ_FAILED)
        err = r->err ? r->err : TD_ESTATE;
    if (!err) {
        r->finish_wanted = true;
        if (meta) r->meta = *meta;
        kvxi_pf_step(c, r, td_now_ms());
    }
    pthread_mutex_unlock(&c->mu);
    kvxi_kick(c);
    return err;
}

int kvx_pf_abort(kvx_conn *c, uint64_t req_id)
{
    pthread_mutex_lock(&c->mu);
    kvxi_pf_req *r = kvxi_pf_find(c, req_id);
    if (r) {
        kvxi_pf_fail(c, r, KVX_FAIL_ABORTED, TD_ESTATE);
        kvxi_pf_step(c, r, td_now_ms());
    }
    pthread_mutex_unlock(&c->mu);
    kvxi_kick(c);
    return r ? 0 : TD_ENOENT;
}

int kvx_pf_poll(kvx_conn *c, uint64_t req_id, kvx_pf_status *out)
{
    pthread_mutex_lock(&c->mu);
    kvxi_pf_req *r = kvxi_pf_find(c, req_id);
    if (r) {
        memset(out, 0, sizeof(*out));
        out->state = r->state;
        out->reason = r->reason;
        out->err = r->err;
        for (uint32_t t = 0; t < r->n_tgt; t++) {
            out->n_targets += r->tgt[t].have;
            out->n_accepted += r->tgt[t].accepted;
        }
        out->pieces = r->pieces;
        out->puts = r->puts;
        out->bytes = r->bytes;
        out->staged = r->staged;
    }
    pthread_mutex_unlock(&c->mu);
    return r ? 0 : TD_ENOENT;
}

int kvx_pf_chunk_times(kvx_conn *c, uint64_t req_id, uint32_t chunk, kvx_chunk_times *out)
{
    pthread_mutex_lock(&c->mu);
    kvxi_pf_req *r = kvxi_pf_find(c, req_id);
    int err = TD_ENOENT;
    if (r && chunk < r->n_chunks && r->chunks[chunk].handed_ns) {
        const kvxi_pf_chunk *ch = &r->chunks[chunk];
        *out = (kvx_chunk_times){
            .handed_ns = ch->handed_ns, .issued_ns = ch->issued_ns, .landed_ns = ch->landed_ns};
        err = 0;
    }
    pthread_mutex_unlock(&c->mu);
    return err;
}

int kvx_pf_release(kvx_conn *c, uint64_t req_id)
{
    pthread_mutex_lock(&c->mu);
    int err = TD_ENOENT;
    for (kvxi_pf_req **pp = &c->preqs; *pp; pp = &(*pp)->next) {
        kvxi_pf_req *r = *pp;
        if (r->id != req_id) continue;
        if (!kvxi_pf_final(r) || r->pending) {
            err = TD_ESTATE;
            break;
        }
        *pp = r->next;
        kvxi_pf_free(r);
        c->n_preqs--;
        err = 0;
        break;
    }
    pthread_mutex_unlock(&c->mu);
    return err;
}
