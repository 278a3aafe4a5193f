/* pf_stage.c: what every prefill stage does: the stage chain (activation messages in
 * order), the chunk's forward pass over the stage's layers, the KV push of each chunk to
 * the decode ranks, the last stage's first-token sampling, and the reports to stage 0. */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pf_int.h"
#include "td_err.h"

int64_t pf_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- setup ---- */

static int alloc_bufs(pf_buf *b, int n, size_t cap)
{
    for (int i = 0; i < n; i++) {
        b[i].buf = aligned_alloc(64, (cap + 63) & ~(size_t)63);
        b[i].cap = cap;
        if (!b[i].buf) return TD_ENOMEM;
    }
    return 0;
}

int pf_stage_setup(pf_node *n)
{
    const td_cfg *cfg = n->p->cfg;
    const td_cfg_decode *d0 = &cfg->decode[0]; /* every decode instance has the same KV shape */
    td_dtype kv_type = d0->kv_dtype;
    pf_rig_params rp = {
        .model_path = cfg->model,
        .pp = n->pp,
        .stage = n->stage,
        .partition = n->cfg->layer_partition,
        .threads = n->cfg->threads,
        .ctx = n->cfg->kv_tokens,
        .block_size = d0->block_size,
        .kv_type = kv_type,
    };
    int rc = pf_rig_open(&n->rig, &rp);
    if (rc) return rc;
    const kn_model *m = n->rig.model;
    n->first = m->first;
    n->last = m->last;
    n->n_embd = m->hp.n_embd;
    n->n_vocab = m->hp.n_vocab;
    n->chunk_max = n->cfg->chunk_size;
    if (n->chunk_max > n->cfg->kv_tokens) n->chunk_max = n->cfg->kv_tokens;
    size_t chunk_bytes = pf_wire_chunk_size(PF_MAX_SEGS, n->chunk_max, n->chunk_max, n->n_embd);
    size_t target_bytes = TD_CTRL_MAX_BLOB + 28 + 4 * PF_MAX_TARGETS;
    n->msg_cap = chunk_bytes > target_bytes ? chunk_bytes : target_bytes;
    n->timeout_ms = cfg->kvxfer.timeout_ms;

    kvx_pipe *pipe;
    kvx_pipe_params pp = {.tls = cfg->kvxfer.ucx_tls};
    if ((rc = kvx_pipe_ucx_create(&pp, &pipe))) return rc;
    kvx_conn_params cp = {.timeout_ms = n->timeout_ms, .progress_thread = true};
    if ((rc = kvx_conn_create(pipe, &cp, &n->kvx))) return rc;
    const kn_kv_pool *kv = n->rig.kv;
    kvx_layout lay = {
        .layer0 = (uint32_t)n->rig.l0,
        .n_layers = (uint32_t)(n->rig.l1 - n->rig.l0),
        .n_kv_heads = (uint32_t)m->hp.n_head_kv,
        .head0 = 0,
        .n_heads = (uint32_t)m->hp.n_head_kv,
        .block_size = (uint32_t)kv->block_size,
        .head_dim = (uint32_t)kv->head_dim,
        .dtype_size = kv->type == TD_F16 ? 2 : 4,
        .n_blocks = (uint32_t)kv->n_blocks,
    };
    if ((rc = kvx_pf_register_source(n->kvx, kv->region, kv->region_bytes, &lay))) return rc;

    size_t C = (size_t)n->chunk_max;
    n->pos = malloc(C * sizeof *n->pos);
    n->seq_of = malloc(C * sizeof *n->seq_of);
    n->tokens = malloc(C * sizeof *n->tokens);
    if (!n->pos || !n->seq_of || !n->tokens) return TD_ENOMEM;
    if (n->last) {
        n->logits = malloc((size_t)PF_MAX_SEGS * (size_t)n->n_vocab * sizeof *n->logits);
        if (!n->logits) return TD_ENOMEM;
    } else if ((rc = alloc_bufs(n->sends, PF_NSEND, n->msg_cap)))
        return rc;
    if (!n->first && (rc = alloc_bufs(n->recvs, PF_NRECV, n->msg_cap))) return rc;
    n->next_peer = n->lead_peer = -1;
    for (int s = 0; s < PF_MAX_STAGES; s++)
        n->member_peer[s] = -1;
    TD_LOG_INFO("prefill %s stage %d/%d: layers [%d, %d), %d threads, KV %d blocks of %d (%s), "
                "chunks up to %d tokens",
                n->p->instance, n->stage, n->pp, n->rig.l0, n->rig.l1, n->cfg->threads,
                kv->n_blocks, kv->block_size, td_dtype_name(kv->type), n->chunk_max);
    return 0;
}

static void req_free(pf_node *n, pf_req *r)
{
    kn_kv_seq_fini(n->rig.kv, &r->kv);
    free(r->hist);
    free(r->comp_end_ns);
    free(r);
}

void pf_stage_teardown(pf_node *n)
{
    pf_chain_close(n);
    kvx_conn_destroy(n->kvx); /* fails what is left; nothing writes into our pool after */
    while (n->reqs) {
        pf_req *r = n->reqs;
        n->reqs = r->next;
        req_free(n, r);
    }
    for (int i = 0; i < PF_NSEND; i++)
        free(n->sends[i].buf);
    for (int i = 0; i < PF_NRECV; i++)
        free(n->recvs[i].buf);
    free(n->pos);
    free(n->seq_of);
    free(n->tokens);
    free(n->logits);
    pf_rig_close(&n->rig);
}

/* ---- the chain ---- */

static void ctl_drop_all(pf_node *n);

int pf_chain_open(pf_node *n)
{
    int rc = pf_link_create(n->p->cfg->kvxfer.ucx_tls, &n->link);
    n->send_seq = n->recv_seq = 1;
    n->broken = false;
    return rc;
}

void pf_chain_close(pf_node *n)
{
    ctl_drop_all(n);          /* the messages were for this chain only */
    pf_link_destroy(n->link); /* completes pending sends/receives with an error */
    n->link = NULL;
    for (int i = 0; i < PF_NSEND; i++)
        n->sends[i].busy = false;
    for (int i = 0; i < PF_NRECV; i++)
        n->recvs[i].busy = false;
    n->next_peer = n->lead_peer = -1;
    for (int s = 0; s < PF_MAX_STAGES; s++)
        n->member_peer[s] = -1;
    n->epoch = 0;
}

int pf_chain_start(pf_node *n, const uint8_t *const *addrs, const size_t *lens)
{
    int rc = 0;
    if (n->stage == 0) {
        for (int s = 1; s < n->pp && !rc; s++)
            rc = pf_link_connect(n->link, addrs[s], lens[s], &n->member_peer[s]);
        n->next_peer = n->pp > 1 ? n->member_peer[1] : -1;
    } else {
        rc = pf_link_connect(n->link, addrs[0], lens[0], &n->lead_peer);
        if (!rc && !n->last)
            rc = pf_link_connect(n->link, addrs[n->stage + 1], lens[n->stage + 1], &n->next_peer);
    }
    for (int i = 0; !rc && !n->first && i < PF_NRECV; i++) {
        rc = pf_link_recv(n->link, PF_TAG_CHAIN, n->recvs[i].buf, n->recvs[i].cap, &n->recvs[i].op);
        n->recvs[i].busy = !rc;
    }
    if (rc)
        TD_LOG_ERR("prefill %s stage %d: cannot connect the stage chain: %s", n->p->instance,
                   n->stage, td_strerror(rc));
    return rc;
}

void pf_wait(pf_node *n, int extra_fd, int timeout_ms)
{
    struct pollfd pfd[2];
    int k = 0;
    if (n->link) pfd[k++] = (struct pollfd){.fd = pf_link_wake_fd(n->link), .events = POLLIN};
    if (extra_fd >= 0) pfd[k++] = (struct pollfd){.fd = extra_fd, .events = POLLIN};
    poll(pfd, (nfds_t)k, timeout_ms);
    if (n->link) pf_link_clear_wake(n->link);
}

static bool peer_dead(pf_node *n, kvx_peer p)
{
    return p >= 0 && n->link && pf_link_peer_failed(n->link, p) != 0;
}

pf_buf *pf_chain_free_send(pf_node *n, int timeout_ms)
{
    int64_t until = pf_now_ms() + timeout_ms;
    for (;;) {
        for (int i = 0; i < PF_NSEND; i++) {
            pf_buf *b = &n->sends[i];
            if (b->busy && pf_op_done(&b->op)) {
                b->busy = false;
                if (b->op.status) {
                    TD_LOG_ERR("prefill %s stage %d: send to stage %d failed: %s", n->p->instance,
                               n->stage, n->stage + 1, td_strerror(b->op.status));
                    n->broken = true;
                }
            }
        }
        if (n->broken || !n->link || peer_dead(n, n->next_peer)) {
            n->broken = true;
            return NULL;
        }
        for (int i = 0; i < PF_NSEND; i++)
            if (!n->sends[i].busy) return &n->sends[i];
        if (pf_now_ms() >= until || *n->p->stop) return NULL;
        pf_wait(n, -1, 20);
    }
}

struct pf_ctl {
    struct pf_ctl *next;
    size_t len;
    uint8_t data[];
};

static void ctl_drop_all(pf_node *n)
{
    while (n->ctl_head) {
        struct pf_ctl *c = n->ctl_head;
        n->ctl_head = c->next;
        free(c);
    }
    n->ctl_tail = NULL;
}

bool pf_chain_queue_empty(const pf_node *n)
{
    return !n->ctl_head;
}

int pf_chain_flush(pf_node *n)
{
    while (n->ctl_head) {
        pf_buf *b = pf_chain_free_send(n, 0);
        if (!b) return n->broken ? TD_EIO : 0;
        struct pf_ctl *c = n->ctl_head;
        if (c->len > b->cap) return TD_ERANGE;
        memcpy(b->buf, c->data, c->len);
        uint64_t seq = n->send_seq++;
        memcpy(b->buf + 8, &seq, 8); /* the seq of this hop (pf_wire header layout) */
        if (pf_link_send(n->link, n->next_peer, PF_TAG_CHAIN, b->buf, c->len, &b->op)) {
            n->broken = true;
            return TD_EIO;
        }
        b->busy = true;
        n->ctl_head = c->next;
        if (!n->ctl_head) n->ctl_tail = NULL;
        free(c);
    }
    return 0;
}

int pf_chain_send_msg(pf_node *n, const void *msg, size_t len)
{
    if (n->last || !n->link) return 0;
    struct pf_ctl *c = malloc(sizeof *c + len);
    if (!c) return TD_ENOMEM;
    c->next = NULL;
    c->len = len;
    memcpy(c->data, msg, len);
    if (n->ctl_tail)
        n->ctl_tail->next = c;
    else
        n->ctl_head = c;
    n->ctl_tail = c;
    return pf_chain_flush(n);
}

/* ---- requests ---- */

static pf_req *find_req(pf_node *n, uint64_t id)
{
    for (pf_req *r = n->reqs; r; r = r->next)
        if (r->id == id) return r;
    return NULL;
}

static void fail_req(pf_node *n, pf_req *r, int err)
{
    if (r->failed) return;
    r->failed = true;
    r->fail_err = err ? err : TD_EIO;
    if (r->opened) kvx_pf_abort(n->kvx, r->id);
}

static pf_req *new_req(pf_node *n, const pf_seg *g)
{
    pf_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->id = g->req_id;
    r->n_prompt = (int32_t)g->n_prompt;
    r->n_dst = g->n_dst;
    r->sampling = g->sampling;
    r->first_token = -1;
    kn_kv_seq_init(&r->kv);
    r->next = n->reqs;
    n->reqs = r;
    n->n_reqs++;
    return r;
}

/* Open the request on this stage: blocks for the whole prompt, the kvxfer request. */
static int open_req(pf_node *n, pf_req *r)
{
    int rc = kn_kv_seq_reserve(n->rig.kv, &r->kv, r->n_prompt);
    if (rc) {
        TD_LOG_WARN("prefill %s stage %d: request %llu: no KV room for %d tokens (%d blocks "
                    "free)",
                    n->p->instance, n->stage, (unsigned long long)r->id, r->n_prompt,
                    n->rig.kv->n_free);
        return rc;
    }
    if (n->last && !(r->hist = malloc((size_t)r->n_prompt * sizeof *r->hist))) return TD_ENOMEM;
    kvx_pf_req_params kp = {.stage = (uint32_t)n->stage,
                            .src_rank = 0,
                            .src_tp = 1,
                            .n_dst = r->n_dst,
                            .timeout_ms = n->timeout_ms};
    if ((rc = kvx_pf_open(n->kvx, r->id, &kp))) return rc;
    r->opened = true;
    return 0;
}

static void try_send_and_finish(pf_node *n, pf_req *r)
{
    if (r->failed || !r->opened) return;
    if (r->n_sent < r->n_computed) {
        int rc = kvx_pf_send_chunk(n->kvx, r->id, r->n_chunks - 1, (uint32_t)r->n_sent,
                                   (uint32_t)r->n_computed, r->kv.blocks, (uint32_t)r->kv.n_blocks);
        if (rc == TD_ENOSPC) return; /* the lookup buffer is full: later */
        if (rc) {
            fail_req(n, r, rc);
            return;
        }
        r->n_sent = r->n_computed;
    }
    if (r->n_sent == r->n_prompt && !r->finished && (!n->last || r->first_token >= 0)) {
        kvx_meta meta = {.first_token = n->last ? r->first_token : -1,
                         .n_tokens = (uint32_t)r->n_prompt};
        int rc = kvx_pf_finish(n->kvx, r->id, &meta);
        if (rc)
            fail_req(n, r, rc);
        else
            r->finished = true;
    }
}

void pf_stage_targets(pf_node *n, uint64_t req_id, const uint8_t *const *t, const size_t *lens,
                      int n_t)
{
    pf_req *r = find_req(n, req_id);
    if (!r || r->failed || !r->opened) return;
    for (int i = 0; i < n_t; i++) {
        int rc = kvx_pf_add_target(n->kvx, req_id, t[i], lens[i]);
        if (rc) {
            TD_LOG_WARN("prefill %s stage %d: request %llu: KV target %d rejected: %s",
                        n->p->instance, n->stage, (unsigned long long)req_id, i, td_strerror(rc));
            fail_req(n, r, rc);
            return;
        }
    }
}

void pf_stage_abort(pf_node *n, uint64_t req_id, int err)
{
    pf_req *r = find_req(n, req_id);
    if (r) fail_req(n, r, err);
}

void pf_stage_abort_all(pf_node *n, int err)
{
    for (pf_req *r = n->reqs; r; r = r->next)
        fail_req(n, r, err);
}

void pf_report_out(pf_node *n, const pf_report *r)
{
    if (n->stage == 0) {
        pf_leader_on_report(n, r);
        return;
    }
    if (!n->link || n->lead_peer < 0) return; /* stage 0 fails it when the chain re-forms */
    uint8_t b[PF_REPORT_BYTES];
    pf_wire_report_write(b, r);
    if (pf_link_report(n->link, n->lead_peer, b, sizeof b)) n->broken = true;
}

/* One line per request (debug: one per chunk) about its KV transfer: how much of the
 * transfer time (from a chunk handed to kvxfer to its KV landed in every decode rank)
 * passed while this stage was still computing the request's later chunks, i.e. was hidden
 * behind compute. The chunk lines are what tests/prefill checks chunk-by-chunk transfer
 * with: chunk k landed before chunk k + 1's compute ended. */
static void log_transfer(pf_node *n, const pf_req *r, const kvx_pf_status *st)
{
    uint32_t nc = r->n_chunks < r->cap_chunks ? r->n_chunks : r->cap_chunks;
    if (!nc) return;
    int64_t last_end = r->comp_end_ns[nc - 1];
    double total = 0, hidden = 0;
    for (uint32_t k = 0; k < nc; k++) {
        kvx_chunk_times t;
        if (kvx_pf_chunk_times(n->kvx, r->id, k, &t) || !t.landed_ns) continue;
        double span = (double)(t.landed_ns - t.handed_ns);
        double before = (double)last_end - (double)t.handed_ns;
        total += span;
        hidden += before <= 0 ? 0 : before < span ? before : span;
        TD_LOG_DEBUG("prefill %s stage %d: request %llu chunk %u: computed %lld landed %lld "
                     "(handed %lld issued %lld ns)",
                     n->p->instance, n->stage, (unsigned long long)r->id, k,
                     (long long)r->comp_end_ns[k], (long long)t.landed_ns, (long long)t.handed_ns,
                     (long long)t.issued_ns);
    }
    TD_LOG_INFO("prefill %s stage %d: request %llu: KV of %d tokens in %u chunks, %.1f MiB in "
                "%llu puts; transfer %.1f ms, %.0f %% of it hidden behind compute",
                n->p->instance, n->stage, (unsigned long long)r->id, r->n_prompt, r->n_chunks,
                (double)st->bytes / (1 << 20), (unsigned long long)st->puts, total / 1e6,
                total > 0 ? 100.0 * hidden / total : 0.0);
}

/* A request's KV transfer passed its deadline on this stage: say where the time went. The
 * deadline (kvxfer.timeout_ms, from the stage's first chunk) covers the compute of every
 * later chunk, so on a busy CPU a prompt can outlast it with every transfer on time. What
 * the connector took before it failed tells the two apart (n_sent, finished: a chunk
 * computed after the deadline is refused). */
static void log_deadline(pf_node *n, const pf_req *r)
{
    char since[64] = "";
    if (r->n_chunks)
        snprintf(since, sizeof since, "; its first chunk here began %lld ms ago",
                 (long long)(pf_now_ms() - r->t_first_ms));
    if (!r->finished)
        TD_LOG_WARN("prefill %s stage %d: request %llu: the KV transfer deadline "
                    "(kvxfer.timeout_ms %d) passed while this stage was still computing (%d of %d "
                    "tokens handed over%s): the deadline must cover the prompt's whole prefill",
                    n->p->instance, n->stage, (unsigned long long)r->id, n->timeout_ms, r->n_sent,
                    r->n_prompt, since);
    else
        TD_LOG_WARN("prefill %s stage %d: request %llu: the KV transfer deadline "
                    "(kvxfer.timeout_ms %d) passed after all %d tokens were computed and handed "
                    "over%s: the KV targets or the decode ranks were late",
                    n->p->instance, n->stage, (unsigned long long)r->id, n->timeout_ms, r->n_prompt,
                    since);
}

void pf_stage_poll(pf_node *n)
{
    pf_req **pp = &n->reqs;
    while (*pp) {
        pf_req *r = *pp;
        try_send_and_finish(n, r);
        pf_report rep = {.epoch = n->epoch,
                         .req_id = r->id,
                         .stage = (uint32_t)n->stage,
                         .first_token = n->last ? r->first_token : -1,
                         .end_ms = pf_now_ms()};
        bool over = false;
        if (r->opened) {
            kvx_pf_status st;
            if (kvx_pf_poll(n->kvx, r->id, &st) == 0 &&
                (st.state == KVX_REQ_DONE || st.state == KVX_REQ_FAILED)) {
                over = true;
                if (st.state == KVX_REQ_FAILED) {
                    if (st.reason == KVX_FAIL_TIMEOUT) log_deadline(n, r);
                    rep.status = r->fail_err ? r->fail_err : st.err ? st.err : TD_EIO;
                    rep.reason = (uint32_t)st.reason;
                } else
                    log_transfer(n, r, &st);
                kvx_pf_release(n->kvx, r->id);
            }
        } else if (r->failed) {
            over = true;
            rep.status = r->fail_err;
        }
        if (!over) {
            pp = &r->next;
            continue;
        }
        pf_report_out(n, &rep);
        *pp = r->next;
        n->n_reqs--;
        req_free(n, r); /* the connector is final: nothing reads our blocks any more */
    }
}

/* ---- one chunk ---- */

/* Drop the rows of segments that died on this stage from ids/embd (in place). */
static int64_t compact(pf_node *n, const pf_seg *segs, int n_segs, const bool *was_live,
                       int32_t *ids, float *embd)
{
    int64_t src = 0, dst = 0;
    size_t E = (size_t)n->n_embd;
    for (int i = 0; i < n_segs; i++) {
        int64_t len = segs[i].t1 - segs[i].t0;
        if (!was_live[i]) continue;
        if (!(segs[i].flags & PF_SEG_DEAD)) {
            if (src != dst) {
                memmove(ids + dst, ids + src, (size_t)len * sizeof *ids);
                if (embd) memmove(embd + dst * E, embd + src * E, (size_t)len * E * sizeof *embd);
            }
            dst += len;
        }
        src += len;
    }
    return dst;
}

int pf_stage_chunk(pf_node *n, pf_seg *segs, int n_segs, const int32_t *ids_in, float *embd)
{
    bool was_live[PF_MAX_SEGS];
    pf_req *rq[PF_MAX_SEGS];
    int64_t rows_in = 0;
    for (int i = 0; i < n_segs; i++) {
        pf_seg *g = &segs[i];
        was_live[i] = !(g->flags & PF_SEG_DEAD);
        if (was_live[i]) rows_in += g->t1 - g->t0;
        pf_req *r = find_req(n, g->req_id);
        if (g->flags & PF_SEG_FIRST) {
            if (r) { /* a duplicate id would mix two prompts' KV: refuse the new one */
                g->flags |= PF_SEG_DEAD;
                rq[i] = NULL;
                continue;
            }
            r = new_req(n, g);
            if (!r) return TD_ENOMEM;
            if (!was_live[i])
                fail_req(n, r, TD_EIO);
            else {
                int rc = open_req(n, r);
                if (rc) fail_req(n, r, rc);
            }
        } else if (r && !r->failed && (!was_live[i] || (int32_t)g->t0 != r->n_computed)) {
            fail_req(n, r, was_live[i] ? TD_EINVAL : TD_EIO);
        }
        if (!r || r->failed) g->flags |= PF_SEG_DEAD;
        rq[i] = r;
    }
    int32_t *ids = n->tokens;
    if (rows_in > n->chunk_max) return TD_ERANGE;
    memcpy(ids, ids_in, (size_t)rows_in * sizeof *ids);
    int64_t rows = compact(n, segs, n_segs, was_live, ids, embd);

    /* the batch over the live segments */
    kn_seq_view views[PF_MAX_SEGS];
    int32_t logit_rows[PF_MAX_SEGS];
    int n_views = 0, n_logits = 0;
    int64_t row = 0;
    for (int i = 0; i < n_segs; i++) {
        const pf_seg *g = &segs[i];
        if (g->flags & PF_SEG_DEAD) continue;
        for (uint32_t t = g->t0; t < g->t1; t++, row++) {
            n->pos[row] = (int32_t)t;
            n->seq_of[row] = n_views;
        }
        views[n_views++] = (kn_seq_view){.block_table = rq[i]->kv.blocks, .n_ctx = (int32_t)g->t1};
        if (n->last && (g->flags & PF_SEG_LAST)) logit_rows[n_logits++] = (int32_t)(row - 1);
    }
    pf_buf *sb = NULL;
    float *out = n->logits;
    if (!n->last) {
        sb = pf_chain_free_send(n, n->timeout_ms);
        if (!sb) return TD_EIO;
        out = (float *)(sb->buf + pf_wire_chunk_payload_off(n_segs, rows));
    }
    int64_t t0 = pf_now_ms();
    if (rows > 0) {
        kn_batch b = {.n_tokens = rows,
                      .tokens = n->first ? ids : NULL,
                      .embd = n->first ? NULL : embd,
                      .pos = n->pos,
                      .seq_of = n->seq_of,
                      .n_seqs = n_views,
                      .seqs = views,
                      .n_logits = n_logits,
                      .logit_rows = logit_rows};
        int rc = kn_engine_forward(n->rig.engine, n->rig.kv, &b, out);
        if (rc) {
            TD_LOG_ERR("prefill %s stage %d: forward of %lld tokens failed: %s", n->p->instance,
                       n->stage, (long long)rows, td_strerror(rc));
            for (int i = 0; i < n_segs; i++)
                if (!(segs[i].flags & PF_SEG_DEAD)) {
                    fail_req(n, rq[i], rc);
                    segs[i].flags |= PF_SEG_DEAD;
                }
            rows = 0;
        }
    }
    int64_t t1 = pf_now_ms();
    int64_t t1_ns = (int64_t)kvx_now_ns();
    n->n_chunks_total++;
    n->slow_chunk_ms *= 0.95;
    if ((double)(t1 - t0) > n->slow_chunk_ms) n->slow_chunk_ms = (double)(t1 - t0);
    for (int i = 0; i < n_segs; i++) {
        const pf_seg *g = &segs[i];
        if (g->flags & PF_SEG_DEAD) continue;
        pf_req *r = rq[i];
        if (!r->n_chunks) r->t_first_ms = t0;
        if (r->n_chunks == r->cap_chunks) {
            uint32_t cap = r->cap_chunks ? 2 * r->cap_chunks : 8;
            int64_t *c = realloc(r->comp_end_ns, cap * sizeof *c);
            if (c) {
                r->comp_end_ns = c;
                r->cap_chunks = cap;
            }
        }
        if (r->n_chunks < r->cap_chunks) r->comp_end_ns[r->n_chunks] = t1_ns;
        r->n_chunks++;
        r->n_computed = (int32_t)g->t1;
        TD_LOG_DEBUG("prefill %s stage %d: request %llu chunk %u [%u, %u) computed at %lld ms "
                     "(%lld ms)",
                     n->p->instance, n->stage, (unsigned long long)r->id, g->chunk, g->t0, g->t1,
                     (long long)t1, (long long)(t1 - t0));
    }
    /* the last stage keeps the prompt's ids for the repetition penalty, then samples */
    if (n->last) {
        int64_t off = 0;
        int li = 0;
        for (int i = 0; i < n_segs; i++) {
            const pf_seg *g = &segs[i];
            if (g->flags & PF_SEG_DEAD) continue;
            pf_req *r = rq[i];
            memcpy(r->hist + g->t0, ids + off, (size_t)(g->t1 - g->t0) * sizeof *ids);
            off += g->t1 - g->t0;
            if (!(g->flags & PF_SEG_LAST)) continue;
            kn_sampler s;
            /* a moved request's sampler skips the draws made before it moved */
            int rc = kn_sampler_init(&s, &g->sampling, n->n_vocab);
            int32_t tok = rc ? rc
                             : kn_sample(&s, n->logits + (size_t)li * (size_t)n->n_vocab, r->hist,
                                         r->n_prompt);
            if (!rc) kn_sampler_fini(&s);
            li++;
            if (tok < 0)
                fail_req(n, r, tok);
            else
                r->first_token = tok;
        }
    }
    for (int i = 0; i < n_segs; i++)
        if (!(segs[i].flags & PF_SEG_DEAD)) try_send_and_finish(n, rq[i]);
    if (n->last) return 0;
    int64_t len = pf_wire_chunk_write(sb->buf, sb->cap, n->send_seq, segs, n_segs, ids, n->n_embd);
    if (len < 0) return (int)len;
    n->send_seq++;
    int rc = pf_link_send(n->link, n->next_peer, PF_TAG_CHAIN, sb->buf, (size_t)len, &sb->op);
    if (rc) {
        n->broken = true;
        return rc;
    }
    sb->busy = true;
    return 0;
}

/* ---- stages > 0: the received stream ---- */

static int handle_msg(pf_node *n, pf_buf *b)
{
    pf_msg m;
    int rc = pf_wire_parse(b->buf, b->op.len, n->n_embd, 1, n->chunk_max, &m);
    if (rc) return rc;
    switch (m.kind) {
    case PF_MSG_CHUNK:
        rc = pf_stage_chunk(n, m.segs, m.n_segs, m.ids, (float *)m.embd);
        break;
    case PF_MSG_TARGETS:
        pf_stage_targets(n, m.req_id, m.target, m.target_len, m.n_targets);
        rc = pf_chain_send_msg(n, b->buf, b->op.len);
        break;
    case PF_MSG_ABORT:
        pf_stage_abort(n, m.req_id, m.code ? m.code : TD_EIO);
        rc = pf_chain_send_msg(n, b->buf, b->op.len);
        break;
    default:
        rc = TD_EFORMAT;
    }
    pf_msg_fini(&m);
    return rc;
}

int pf_stage_recv(pf_node *n)
{
    /* one message per call: the caller's loop keeps heartbeats and reports going while a
     * backlog of chunks waits (a stage that only computed would look silent to stage 0);
     * nothing new while forwarded messages still wait for a send buffer (order) */
    int frc = pf_chain_flush(n);
    if (frc) return frc;
    if (!pf_chain_queue_empty(n)) return 0;
    pf_buf *next = NULL;
    for (int i = 0; i < PF_NRECV; i++) {
        pf_buf *b = &n->recvs[i];
        if (!b->busy || !pf_op_done(&b->op)) continue;
        if (b->op.status) {
            TD_LOG_ERR("prefill %s stage %d: receive from stage %d failed: %s", n->p->instance,
                       n->stage, n->stage - 1, td_strerror(b->op.status));
            n->broken = true;
            return b->op.status;
        }
        uint64_t seq = 0;
        if (b->op.len >= 16) memcpy(&seq, b->buf + 8, 8);
        if (seq == n->recv_seq) next = b; /* receives may complete out of order */
    }
    if (!next) return 0;
    int rc = handle_msg(n, next);
    n->recv_seq++;
    next->busy = false;
    if (rc) {
        TD_LOG_ERR("prefill %s stage %d: chain message %llu: %s", n->p->instance, n->stage,
                   (unsigned long long)(n->recv_seq - 1), td_strerror(rc));
        n->broken = true;
        return rc;
    }
    rc = pf_link_recv(n->link, PF_TAG_CHAIN, next->buf, next->cap, &next->op);
    if (rc) {
        n->broken = true;
        return rc;
    }
    next->busy = true;
    return 1;
}
