/* kvx_conn_dec.c: the decode side of the connector: request state machine (writers,
 * completion, the abort handshake), incoming BEGIN/DONE/STOPPED, the kvx_dec_ API. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "kvx_conn_int.h"
#include "td_clock.h"

/* --- decode side ------------------------------------------------------------------------ */

static kvxi_dec_req *kvxi_dec_find(kvx_conn *c, uint64_t id)
{
    for (kvxi_dec_req *r = c->dreqs; r; r = r->next)
        if (r->id == id) return r;
    return NULL;
}

static void kvxi_dec_fail(kvx_conn *c, kvxi_dec_req *r, kvx_fail_reason why, int err)
{
    if (!kvxi_dec_live(r)) return;
    if (why != KVX_FAIL_ABORTED)
        TD_LOG_ERR("kvx conn: req %llu failed in state %s: %s", (unsigned long long)r->id,
                   kvx_req_state_name(r->state),
                   why == KVX_FAIL_TIMEOUT        ? "timeout"
                   : why == KVX_FAIL_PEER_ABORTED ? "aborted by a prefill stage"
                                                  : "a prefill peer failed");
    r->state = KVX_REQ_ABORTING;
    r->reason = why;
    r->err = err;
    r->abort_deadline = td_now_ms() + c->params.abort_timeout_ms;
    r->abort_sent = false;
}

void kvxi_dec_pipe_reset(kvx_conn *c)
{
    for (kvxi_dec_req *r = c->dreqs; r; r = r->next) {
        for (int i = 0; i < r->n_w; i++)
            r->w[i].closed = true; /* their endpoints died with the old worker */
        kvxi_dec_fail(c, r, KVX_FAIL_PEER_FAILED, TD_EIO);
    }
}

/* Stages whose every writer (source TP rank) sent DONE. */
static uint64_t kvxi_dec_stages_done(const kvxi_dec_req *r)
{
    uint64_t m = 0;
    for (uint32_t st = 0; st < r->n_stages; st++) {
        uint32_t n = 0;
        for (int i = 0; i < r->n_w; i++)
            n += r->w[i].stage == st && r->w[i].done;
        if (r->src_tp[st] && n == r->src_tp[st]) m |= 1ull << st;
    }
    return m;
}

void kvxi_dec_step(kvx_conn *c, kvxi_dec_req *r, int64_t now)
{
    if (!kvxi_dec_live(r) && r->state != KVX_REQ_ABORTING) return;
    /* writers whose endpoint failed can no longer write */
    for (int i = 0; i < r->n_w; i++)
        if (!r->w[i].closed && !kvxi_peer_ok(c, r->w[i].peer)) {
            r->w[i].closed = true;
            kvxi_dec_fail(c, r, KVX_FAIL_PEER_FAILED, TD_EIO);
        }
    if (kvxi_dec_live(r) && now >= r->deadline) kvxi_dec_fail(c, r, KVX_FAIL_TIMEOUT, TD_ETIMEDOUT);
    uint64_t all = r->n_stages == 64 ? ~0ull : (1ull << r->n_stages) - 1;
    if (kvxi_dec_live(r)) {
        if (kvxi_dec_stages_done(r) == all)
            r->state = KVX_REQ_DONE;
        else
            return;
    }
    if (r->state == KVX_REQ_ABORTING) {
        if (!r->abort_sent) {
            for (int i = 0; i < r->n_w; i++) {
                if (r->w[i].closed) continue;
                kvxi_msg m = {.type = KVXI_MSG_ABORT,
                              .req = r->id,
                              .epoch = r->epoch,
                              .key = {r->key[0], r->key[1]},
                              .stage = r->w[i].stage,
                              .src_rank = r->w[i].src_rank};
                if (kvxi_msg_send(c, r->w[i].peer, &m)) r->w[i].closed = true;
            }
            r->abort_sent = true;
        }
        int open = 0;
        for (int i = 0; i < r->n_w; i++)
            open += !r->w[i].closed;
        if (open && now >= r->abort_deadline) {
            for (int i = 0; i < r->n_w; i++)
                if (!r->w[i].closed) {
                    TD_LOG_WARN("kvx conn: req %llu stage %u rank %u: no answer to the abort, "
                                "closing its endpoint",
                                (unsigned long long)r->id, r->w[i].stage, r->w[i].src_rank);
                    kvxi_peer_close(c, r->w[i].peer, true);
                    r->w[i].closed = true;
                }
            open = 0;
        }
        if (open) return;
        r->state = KVX_REQ_FAILED;
    }
    for (int i = 0; i < r->n_w; i++)
        if (r->w[i].peer >= 0) {
            c->peers[r->w[i].peer].refs--;
            r->w[i].peer = -1;
        }
}

static kvxi_dec_writer *kvxi_dec_writer_find(kvxi_dec_req *r, uint32_t stage, uint32_t src_rank)
{
    for (int i = 0; i < r->n_w; i++)
        if (r->w[i].stage == stage && r->w[i].src_rank == src_rank) return &r->w[i];
    return NULL;
}

/* BEGIN, DONE or STOPPED from a prefill writer. A message for a live request must carry the
 * request's key (kvxi_dec_req.key, known only to whoever was given the target over the
 * control plane): without it nothing changes and no endpoint is opened (issue 44). A BEGIN
 * for a request released here (a late writer) is refused when it has the key; one for a
 * request never seen, or without the key, is dropped: an address in a message nobody can
 * check is never dialled. */
void kvxi_dec_on_msg(kvx_conn *c, const kvxi_msg *m)
{
    kvxi_dec_req *r = kvxi_dec_find(c, m->req);
    if (r && !kvxi_key_eq(r->key, m->key)) {
        TD_LOG_WARN("kvx conn: req %llu stage %u rank %u: refused message %u without the "
                    "request's key (not from a process given its target): dropped",
                    (unsigned long long)m->req, m->stage, m->src_rank, m->type);
        return;
    }
    bool match = r && r->epoch == m->epoch && m->stage < r->n_stages && m->src_tp &&
                 m->src_tp <= KVX_MAX_RANKS && m->src_rank < m->src_tp;
    if (m->type == KVXI_MSG_BEGIN) {
        bool gone = false;
        for (int i = 0; !r && !gone && i < KVXI_GONE_MAX; i++)
            gone =
                c->gone[i].used && c->gone[i].id == m->req && kvxi_key_eq(c->gone[i].key, m->key);
        if (!r && !gone) {
            TD_LOG_WARN("kvx conn: req %llu stage %u: BEGIN for a request not known here (or "
                        "without its key): dropped",
                        (unsigned long long)m->req, m->stage);
            return;
        }
        int pi;
        if (kvxi_peer_get(c, m->uid, m->addr, m->addr_len, &pi)) {
            TD_LOG_ERR("kvx conn: req %llu stage %u: cannot reach the prefill stage",
                       (unsigned long long)m->req, m->stage);
            return;
        }
        const char *why = !match              ? "unknown request"
                          : !kvxi_dec_live(r) ? kvx_req_state_name(r->state)
                          : kvxi_dec_writer_find(r, m->stage, m->src_rank) ? "duplicate writer"
                          : r->src_tp[m->stage] && r->src_tp[m->stage] != m->src_tp
                              ? "source TP size differs from the stage's other ranks"
                          : r->n_w == KVX_MAX_WRITERS ? "too many writers"
                                                      : NULL;
        kvxi_dec_writer *w = NULL;
        if (!why) {
            kvxi_dec_writer *nw = realloc(r->w, (size_t)(r->n_w + 1) * sizeof(*nw));
            if (!nw)
                why = "out of memory";
            else {
                r->w = nw;
                w = &r->w[r->n_w++];
                *w = (kvxi_dec_writer){.stage = m->stage, .src_rank = m->src_rank, .peer = pi};
                c->peers[pi].refs++;
                r->src_tp[m->stage] = m->src_tp;
                r->state = KVX_REQ_TRANSFERRING;
            }
        }
        if (why)
            TD_LOG_WARN("kvx conn: req %llu stage %u rank %u: refused (%s)",
                        (unsigned long long)m->req, m->stage, m->src_rank, why);
        kvxi_msg a = {.type = w ? KVXI_MSG_ACCEPT : KVXI_MSG_REFUSE,
                      .req = m->req,
                      .epoch = m->epoch,
                      .key = {m->key[0], m->key[1]},
                      .stage = m->stage,
                      .rank = m->rank,
                      .src_rank = m->src_rank};
        if (kvxi_msg_send(c, pi, &a) && w) {
            w->closed = true;
            kvxi_dec_fail(c, r, KVX_FAIL_PEER_FAILED, TD_EIO);
        }
        return;
    }
    kvxi_dec_writer *w = match ? kvxi_dec_writer_find(r, m->stage, m->src_rank) : NULL;
    if (!w) {
        TD_LOG_WARN("kvx conn: req %llu stage %u: unexpected message %u (dropped)",
                    (unsigned long long)m->req, m->stage, m->type);
        return;
    }
    w->closed = true; /* after DONE or STOPPED the writer writes no more */
    if (m->type == KVXI_MSG_DONE) {
        w->done = true;
        w->meta = (kvx_meta){.first_token = m->first_token, .n_tokens = m->n_tokens};
    } else {
        kvxi_dec_fail(c, r, KVX_FAIL_PEER_ABORTED, TD_ESTATE);
    }
    return;
}

/* --- decode API ------------------------------------------------------------------------- */

int kvx_dec_register(kvx_conn *c, void *region, size_t bytes, const kvx_layout *layout)
{
    return kvx_dec_register_fd(c, region, bytes, layout, -1);
}

int kvx_dec_register_fd(kvx_conn *c, void *region, size_t bytes, const kvx_layout *layout, int fd)
{
    size_t need = kvx_layout_bytes(layout);
    if (need && layout->n_slices > 1) {
        TD_LOG_ERR("kvx conn: register: a decode region is never sliced (%u slices)",
                   layout->n_slices);
        return TD_EINVAL;
    }
    if (!region || !need || bytes < need) {
        TD_LOG_ERR("kvx conn: register: invalid layout or region (%zu bytes, layout needs %zu)",
                   bytes, need);
        return TD_EINVAL;
    }
    pthread_mutex_lock(&c->mu);
    int err = c->dec_mem ? TD_ESTATE : 0;
    if (!err) err = kvx_pipe_mem_reg_fd(c->pipe, region, need, fd, 0, &c->dec_mem);
    if (!err) err = kvx_pipe_rkey_pack(c->pipe, c->dec_mem, c->rkey, sizeof(c->rkey), &c->rkey_len);
    if (!err) {
        c->dec_region = region;
        c->dec_layout = *layout;
    } else if (c->dec_mem && err != TD_ESTATE) {
        kvx_pipe_mem_dereg(c->pipe, c->dec_mem);
        c->dec_mem = NULL;
    }
    pthread_mutex_unlock(&c->mu);
    return err;
}

int kvx_dec_make_target(kvx_conn *c, uint64_t req_id, const kvx_dec_req_params *p, void *buf,
                        size_t cap, size_t *len)
{
    if (!p || !p->n_stages || p->n_stages > KVX_MAX_STAGES || !p->tp || p->rank >= p->tp ||
        p->tp > KVX_MAX_RANKS || !p->blocks || !p->n_blocks) {
        TD_LOG_ERR("kvx conn: req %llu: invalid target parameters", (unsigned long long)req_id);
        return TD_EINVAL;
    }
    pthread_mutex_lock(&c->mu);
    int err = 0;
    if (!c->dec_mem) {
        TD_LOG_ERR("kvx conn: req %llu: no KV region registered", (unsigned long long)req_id);
        err = TD_ESTATE;
    } else if (kvxi_dec_find(c, req_id)) {
        TD_LOG_ERR("kvx conn: req %llu: already alive", (unsigned long long)req_id);
        err = TD_ESTATE;
    } else if ((uint64_t)p->first_pos >= (uint64_t)p->n_blocks * c->dec_layout.block_size) {
        TD_LOG_ERR("kvx conn: req %llu: first position %u is not inside its %u blocks",
                   (unsigned long long)req_id, p->first_pos, p->n_blocks);
        err = TD_EINVAL;
    }
    for (uint32_t i = 0; !err && i < p->n_blocks; i++)
        if (p->blocks[i] < 0 || (uint32_t)p->blocks[i] >= c->dec_layout.n_blocks) {
            TD_LOG_ERR("kvx conn: req %llu: block id %d out of range", (unsigned long long)req_id,
                       p->blocks[i]);
            err = TD_EINVAL;
        }
    kvxi_dec_req *r = NULL;
    if (!err && !(r = calloc(1, sizeof(*r)))) err = TD_ENOMEM;
    if (err) {
        pthread_mutex_unlock(&c->mu);
        return err;
    }
    if (getrandom(r->key, sizeof(r->key), 0) != (ssize_t)sizeof(r->key)) {
        TD_LOG_ERR("kvx conn: req %llu: no random key: %s", (unsigned long long)req_id,
                   strerror(errno));
        free(r);
        pthread_mutex_unlock(&c->mu);
        return TD_EIO;
    }
    r->id = req_id;
    r->epoch = ++c->next_epoch;
    r->n_stages = p->n_stages;
    r->state = KVX_REQ_WAITING;
    r->deadline = td_now_ms() + (p->timeout_ms > 0 ? p->timeout_ms : c->params.timeout_ms);

    size_t pl_cap = 148 + c->addr_len + c->rkey_len + (size_t)p->n_blocks * 4;
    uint8_t *pl = malloc(pl_cap);
    if (!pl) {
        free(r);
        pthread_mutex_unlock(&c->mu);
        return TD_ENOMEM;
    }
    kvx_wr w;
    kvx_wr_init(&w, pl, pl_cap);
    kvx_wr_u64(&w, req_id);
    kvx_wr_u64(&w, r->epoch);
    kvx_wr_u64(&w, r->key[0]);
    kvx_wr_u64(&w, r->key[1]);
    kvx_wr_u64(&w, c->uid);
    kvx_wr_u32(&w, p->rank);
    kvx_wr_u32(&w, p->tp);
    kvx_wr_u32(&w, p->n_stages);
    kvxi_wr_layout(&w, &c->dec_layout);
    kvx_wr_u64(&w, (uint64_t)(uintptr_t)c->dec_region);
    kvx_wr_u64(&w, kvx_layout_bytes(&c->dec_layout));
    kvx_wr_u32(&w, (uint32_t)c->addr_len);
    kvx_wr_bytes(&w, c->addr, c->addr_len);
    kvx_wr_u32(&w, (uint32_t)c->rkey_len);
    kvx_wr_bytes(&w, c->rkey, c->rkey_len);
    kvx_wr_u32(&w, p->n_blocks);
    for (uint32_t i = 0; i < p->n_blocks; i++)
        kvx_wr_u32(&w, (uint32_t)p->blocks[i]);
    if (p->first_pos) kvx_wr_u32(&w, p->first_pos); /* optional tail: see kvx_dec_req_params */
    if (!w.ok || !kvx_frame_write(buf, cap, KVX_MAGIC_TARGET, KVX_KIND_UCX, pl, w.len, len)) {
        err = TD_ERANGE;
        free(r);
    } else {
        r->next = c->dreqs;
        c->dreqs = r;
        c->n_dreqs++;
    }
    free(pl);
    pthread_mutex_unlock(&c->mu);
    return err;
}

int kvx_dec_poll(kvx_conn *c, uint64_t req_id, kvx_dec_status *out)
{
    pthread_mutex_lock(&c->mu);
    kvxi_dec_req *r = kvxi_dec_find(c, req_id);
    if (r) {
        memset(out, 0, sizeof(*out));
        out->state = r->state;
        out->reason = r->reason;
        out->err = r->err;
        out->n_stages = r->n_stages;
        for (int i = 0; i < r->n_w; i++) {
            out->stages_begun |= 1ull << r->w[i].stage;
            if (r->w[i].done && r->w[i].src_rank == 0) out->meta[r->w[i].stage] = r->w[i].meta;
        }
        out->stages_done = kvxi_dec_stages_done(r);
    }
    pthread_mutex_unlock(&c->mu);
    return r ? 0 : TD_ENOENT;
}

int kvx_dec_abort(kvx_conn *c, uint64_t req_id)
{
    pthread_mutex_lock(&c->mu);
    kvxi_dec_req *r = kvxi_dec_find(c, req_id);
    if (r) {
        kvxi_dec_fail(c, r, KVX_FAIL_ABORTED, TD_ESTATE);
        kvxi_dec_step(c, r, td_now_ms());
    }
    pthread_mutex_unlock(&c->mu);
    kvxi_kick(c);
    return r ? 0 : TD_ENOENT;
}

int kvx_dec_release(kvx_conn *c, uint64_t req_id)
{
    pthread_mutex_lock(&c->mu);
    int err = TD_ENOENT;
    for (kvxi_dec_req **pp = &c->dreqs; *pp; pp = &(*pp)->next) {
        kvxi_dec_req *r = *pp;
        if (r->id != req_id) continue;
        if (r->state != KVX_REQ_DONE && r->state != KVX_REQ_FAILED) {
            err = TD_ESTATE;
            break;
        }
        *pp = r->next;
        c->gone[c->gone_next] =
            (kvxi_gone){.used = true, .id = r->id, .key = {r->key[0], r->key[1]}};
        c->gone_next = (c->gone_next + 1) % KVXI_GONE_MAX;
        free(r->w);
        free(r);
        c->n_dreqs--;
        err = 0;
        break;
    }
    pthread_mutex_unlock(&c->mu);
    return err;
}
