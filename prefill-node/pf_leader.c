/* pf_leader.c: stage 0 of a prefill instance: the control socket (Prefill, KvTarget,
 * Cancel from the router; StageHello from the other stages), the request queue, the chunk
 * planner (dynamic chunking over the start-up profile, refitted online, pf_chunking.c) and
 * the completion events (PrefillDone / ErrorEvent) once every stage reported. The stage
 * chain's membership is pf_formation.c's; the state both share is pf_leader_int.h. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pf_health.h"
#include "pf_leader_int.h"
#include "td_clock.h"
#include "td_err.h"

#define HEALTH_MS       100
#define REPORT_GRACE_MS 5000 /* on top of the transfer deadline */
#define STOP_DRAIN_MS   500

/* ---- jobs ---- */

static void job_free(pf_job *j)
{
    free(j->prompt);
    free(j->grammar);
    for (int i = 0; i < j->n_targets; i++)
        free(j->targets[i]);
    free(j->chunk_sizes);
    free(j);
}

static pf_job *find_job(pf_leader *ld, uint64_t request_id)
{
    for (pf_job *j = ld->jobs; j; j = j->next)
        if (j->request_id == request_id) return j;
    return NULL;
}

static void unlink_job(pf_leader *ld, pf_job *j)
{
    for (pf_job **pp = &ld->jobs; *pp; pp = &(*pp)->next)
        if (*pp == j) {
            *pp = j->next;
            ld->n_jobs--;
            return;
        }
}

static Td__ErrorCode wire_code(int err, uint32_t reason)
{
    if (err == TD_ETIMEDOUT || reason == KVX_FAIL_TIMEOUT) return TD__ERROR_CODE__ERR_TIMEOUT;
    if (err == TD_ENOSPC) return TD__ERROR_CODE__ERR_NO_SPACE;
    if (err == TD_ESTATE) return TD__ERROR_CODE__ERR_SHUTDOWN;
    return TD__ERROR_CODE__ERR_PEER_FAILED;
}

/* Every stage's hold on j's cached prefix ends, at this point of the stage stream; when it
 * succeeded everywhere its whole blocks go into every stage's prefix cache. Nothing to do
 * on a chain that was re-formed since (the stages flushed their caches). */
static void release_job(pf_leader *ld, pf_job *j, bool ok)
{
    pf_stage *st = ld->st;
    if (!j->emitted || !st->kvc || !st->epoch || j->epoch != st->epoch) return;
    bool insert = ok && !j->err && !j->cancelled;
    pf_stage_release(st, j->request_id, insert);
    uint8_t msg[28];
    int64_t len = pf_wire_release_write(msg, sizeof msg, 0, j->request_id, insert);
    if (len > 0) pf_chain_send_msg(&st->chain, msg, (size_t)len);
}

/* End a job: tell its client (unless it cancelled) and forget it. */
void pfl_finish_job(pf_leader *ld, pf_job *j, int err, const char *why)
{
    unlink_job(ld, j);
    release_job(ld, j, !err);
    if (j->cancelled) {
        job_free(j);
        return;
    }
    if (err) {
        ld->n_failed++;
        TD_LOG_INFO("prefill %s: request %llu failed: %s", ld->st->p->instance,
                    (unsigned long long)j->request_id, why);
        td_ctrl_server_send_error(ld->srv, j->client_id, j->request_id,
                                  wire_code(err, j->fail_reason), "prefill instance %s: %s",
                                  ld->st->p->instance, why);
    } else {
        ld->n_done++;
        Td__PrefillDone pd = TD__PREFILL_DONE__INIT;
        pd.request_id = j->request_id;
        pd.first_token = j->first_token;
        Td__Logprob **first_lp = j->has_first_lp ? td_ctrl_logprobs_to_pb(&j->first_lp, 1) : NULL;
        if (first_lp) pd.first_logprob = first_lp[0];
        pd.n_prompt_tokens = (uint32_t)j->n_prompt;
        pd.n_chunk_sizes = j->n_chunks;
        pd.chunk_sizes = (uint32_t *)j->chunk_sizes;
        pd.queued_ms = (uint64_t)(j->t_start_ms - j->t_submit_ms);
        pd.prefill_ms = (uint64_t)(j->t_end_ms - j->t_start_ms);
        pd.kv_bytes = j->kv_bytes;
        pd.kv_transfer_us = j->kv_xfer_us;
        pd.kv_exposed_us = j->kv_exposed_us;
        pd.cached_tokens = (uint32_t)j->n_cached;
        char sizes[256];
        int off = 0;
        for (uint32_t i = 0; i < j->n_chunks && off < (int)sizeof sizes - 16; i++)
            off += snprintf(sizes + off, sizeof sizes - (size_t)off, "%s%d", i ? "," : "",
                            j->chunk_sizes[i]);
        TD_LOG_INFO("prefill %s: request %llu: %d tokens (%d from the prefix cache) in %u chunks "
                    "[%s], queued %llu ms, prefill %llu ms",
                    ld->st->p->instance, (unsigned long long)j->request_id, j->n_prompt,
                    j->n_cached, j->n_chunks, sizes, (unsigned long long)pd.queued_ms,
                    (unsigned long long)pd.prefill_ms);
        Td__Event ev = TD__EVENT__INIT;
        ev.body_case = TD__EVENT__BODY_PREFILL_DONE;
        ev.prefill_done = &pd;
        td_ctrl_server_send_event(ld->srv, j->client_id, &ev);
        free(first_lp);
    }
    job_free(j);
}

/* What a failed transfer means, for the router's error message (and its operator). */
static const char *fail_text(int err, uint32_t reason)
{
    switch (reason) {
    case KVX_FAIL_PEER_FAILED:
        return "a decode rank became unreachable (its process or connection died)";
    case KVX_FAIL_PEER_ABORTED:
        return "the decode side aborted or refused it";
    case KVX_FAIL_TIMEOUT:
        return "the transfer deadline passed (kvxfer.timeout_ms)";
    case KVX_FAIL_BAD_INPUT:
        return "the KV target does not fit this model or stage (block size, heads, dtype)";
    default:
        break;
    }
    switch (err) {
    case TD_ENOSPC:
        return "no KV room on a prefill stage";
    case TD_ESTATE:
        return "a prefill stage is shutting down";
    case TD_EIO:
        return "a prefill stage failed or was aborted";
    default:
        return td_strerror(err);
    }
}

static void on_report(pf_leader *ld, const pf_report *r)
{
    if (r->epoch != ld->st->epoch || r->stage >= (uint32_t)ld->st->pp)
        return; /* an old formation's */
    pf_job *j = find_job(ld, r->req_id);
    if (!j || !j->emitted) return;
    ld->cache_hits[r->stage] = r->cache_hit_tokens; /* (tokens) the stage's totals so far */
    ld->cache_evicted[r->stage] = r->cache_evicted;
    if (!(j->reported & 1ull << r->stage)) j->kv_bytes += r->kv_bytes; /* once per stage */
    j->reported |= 1ull << r->stage;
    if (r->end_ms > j->t_end_ms) j->t_end_ms = r->end_ms;
    if (r->kv_xfer_us > j->kv_xfer_us) j->kv_xfer_us = r->kv_xfer_us;
    if (r->kv_exposed_us > j->kv_exposed_us) j->kv_exposed_us = r->kv_exposed_us;
    if (r->status && !j->err) {
        j->err = r->status;
        j->fail_reason = r->reason;
        j->fail_stage = (int)r->stage;
        /* the other stages stop too (the decode side also tells them) */
        pf_stage_abort(ld->st, j->request_id, r->status);
        uint8_t msg[28];
        int64_t len = pf_wire_abort_write(msg, sizeof msg, 0, j->request_id, r->status);
        if (len > 0) pf_chain_send_msg(&ld->st->chain, msg, (size_t)len);
    }
    if (r->stage == (uint32_t)ld->st->pp - 1) {
        j->first_token = r->first_token;
        j->has_first_lp = r->has_lp;
        if (r->has_lp) j->first_lp = r->first_lp;
    }
    uint64_t all = ld->st->pp == 64 ? ~0ull : (1ull << ld->st->pp) - 1;
    if ((j->reported & all) != all) return;
    if (j->err) {
        char why[160];
        snprintf(why, sizeof why, "KV transfer failed on stage %d: %s", j->fail_stage,
                 fail_text(j->err, j->fail_reason));
        pfl_finish_job(ld, j, j->err, why);
    } else
        pfl_finish_job(ld, j, 0, NULL);
}

/* A LOGPROBS message of the last stage: the prompt logprobs go to the job's client as a
 * TokenEvent without tokens (TokenEvent.prompt_logprobs, prompt_from), each a few KB, so no
 * event nears the control plane's message limit whatever the prompt's length; they precede
 * the job's PrefillDone (the last stage sends them before its report). */
static void on_lp(pf_leader *ld, const uint8_t *buf, size_t len)
{
    pf_lp_msg m;
    if (pf_wire_lp_parse(buf, len, &m) || m.epoch != ld->st->epoch) return;
    pf_job *j = find_job(ld, m.req_id);
    if (!j || !j->emitted || j->cancelled || !j->sampling.prompt_logprobs) return;
    if (m.from < 1 || m.from + (uint32_t)m.n > (uint32_t)j->n_prompt) return;
    td_logprob_entry *e = malloc((size_t)m.n * sizeof *e);
    for (int i = 0; e && i < m.n; i++)
        pf_wire_lp_entry(&m, i, &e[i]);
    Td__TokenEvent t = TD__TOKEN_EVENT__INIT;
    t.request_id = j->request_id;
    t.prompt_logprobs = e ? td_ctrl_logprobs_to_pb(e, (size_t)m.n) : NULL;
    free(e);
    if (!t.prompt_logprobs) {
        TD_LOG_ERR("prefill %s: request %llu: no memory for its prompt logprobs",
                   ld->st->p->instance, (unsigned long long)j->request_id);
        return;
    }
    t.n_prompt_logprobs = (size_t)m.n;
    t.prompt_from = m.from;
    Td__Event ev = TD__EVENT__INIT;
    ev.body_case = TD__EVENT__BODY_TOKEN;
    ev.token = &t;
    td_ctrl_server_send_event(ld->srv, j->client_id, &ev);
    free(t.prompt_logprobs);
}

/* The other stages' reports and LOGPROBS messages, in their order. */
static void take_chain_reports(pf_leader *ld)
{
    pf_report r;
    uint8_t lp[PF_LINK_REPORT_MAX];
    size_t len = 0;
    uint32_t kind;
    while ((kind = pf_chain_take_report(&ld->st->chain, &r, lp, &len)))
        if (kind == PF_MSG_REPORT)
            on_report(ld, &r);
        else
            on_lp(ld, lp, len);
}

/* ---- requests from the router ---- */

static int set_targets(pf_job *j, ProtobufCBinaryData *t, size_t n)
{
    if (!n) return 0;
    if (j->n_targets) return TD_ESTATE;
    if (n > PF_MAX_TARGETS || (j->n_dst && n != j->n_dst)) return TD_EINVAL;
    for (size_t i = 0; i < n; i++) {
        j->targets[i] = malloc(t[i].len ? t[i].len : 1);
        if (!j->targets[i]) return TD_ENOMEM;
        memcpy(j->targets[i], t[i].data, t[i].len);
        j->target_len[i] = t[i].len;
        j->n_targets = (int)i + 1;
    }
    j->n_dst = (uint32_t)n;
    return 0;
}

/* Targets go to this stage's connector and down the chain, after the first chunk. */
static void push_targets(pf_leader *ld, pf_job *j)
{
    if (!j->emitted || j->targets_sent || !j->n_targets) return;
    j->targets_sent = true;
    pf_stage_targets(ld->st, j->request_id, (const uint8_t *const *)j->targets, j->target_len,
                     j->n_targets);
    if (ld->st->pp == 1) return;
    size_t sz = pf_wire_targets_size(j->target_len, j->n_targets);
    uint8_t *msg = malloc(sz);
    if (!msg) return;
    int64_t len = pf_wire_targets_write(
        msg, sz, 0, j->request_id, (const uint8_t *const *)j->targets, j->target_len, j->n_targets);
    if (len > 0) pf_chain_send_msg(&ld->st->chain, msg, (size_t)len);
    free(msg);
}

static void handle_prefill(pf_leader *ld, const td_ctrl_server_in *in)
{
    const Td__Prefill *p = in->env->prefill;
    pf_job *old = find_job(ld, p->request_id);
    if (old) {
        if (old->client_id == in->client_id) /* the control layer's retry of the same call */
            td_ctrl_server_reply_ack(ld->srv, in->req, p->request_id);
        else
            td_ctrl_server_reply_error(ld->srv, in->req, p->request_id,
                                       TD__ERROR_CODE__ERR_DUPLICATE, "request id in use");
        return;
    }
    if (ld->leaving) {
        td_ctrl_server_reply_error(ld->srv, in->req, p->request_id, TD__ERROR_CODE__ERR_SHUTDOWN,
                                   "prefill instance %s is leaving", ld->st->p->instance);
        return;
    }
    if (!ld->running) {
        td_ctrl_server_reply_error(ld->srv, in->req, p->request_id, TD__ERROR_CODE__ERR_BUSY,
                                   "prefill instance %s: stages not all joined",
                                   ld->st->p->instance);
        return;
    }
    int waiting = 0;
    for (pf_job *j = ld->jobs; j; j = j->next)
        waiting += !j->emitted;
    if (waiting >= ld->st->cfg->max_queue) {
        td_ctrl_server_reply_error(ld->srv, in->req, p->request_id, TD__ERROR_CODE__ERR_BUSY,
                                   "%d prefill requests already waiting", waiting);
        return;
    }
    int max_ctx = ld->st->shard.rt.model->hp.n_ctx_train;
    int cap = ld->st->shard.kv->n_blocks * ld->st->shard.kv->block_size;
    if (p->n_token_ids > (size_t)(cap < max_ctx ? cap : max_ctx)) {
        td_ctrl_server_reply_error(ld->srv, in->req, p->request_id, TD__ERROR_CODE__ERR_NO_SPACE,
                                   "prompt of %zu tokens: this instance holds %d (KV) and the "
                                   "model %d",
                                   p->n_token_ids, cap, max_ctx);
        return;
    }
    for (size_t i = 0; i < p->n_token_ids; i++)
        if (p->token_ids[i] >= ld->st->n_vocab) {
            td_ctrl_server_reply_error(ld->srv, in->req, p->request_id, TD__ERROR_CODE__ERR_INVALID,
                                       "token id %d outside the vocabulary", p->token_ids[i]);
            return;
        }
    uint32_t n_dst = p->n_decode_ranks ? p->n_decode_ranks : (uint32_t)p->n_kv_targets;
    if (n_dst < 1 || n_dst > PF_MAX_TARGETS) {
        td_ctrl_server_reply_error(ld->srv, in->req, p->request_id, TD__ERROR_CODE__ERR_INVALID,
                                   "n_decode_ranks %u (1..%d)", n_dst, PF_MAX_TARGETS);
        return;
    }
    pf_job *j = calloc(1, sizeof *j);
    if (j) j->prompt = malloc(p->n_token_ids * sizeof *j->prompt);
    if (!j || !j->prompt) {
        if (j) job_free(j);
        td_ctrl_server_reply_error(ld->srv, in->req, p->request_id, TD__ERROR_CODE__ERR_INTERNAL,
                                   "out of memory");
        return;
    }
    memcpy(j->prompt, p->token_ids, p->n_token_ids * sizeof *j->prompt);
    j->client_id = in->client_id;
    j->request_id = p->request_id;
    j->n_prompt = (int32_t)p->n_token_ids;
    j->n_dst = n_dst;
    j->first_token = -1;
    j->t_submit_ms = td_now_ms();
    j->sampling = td_ctrl_sampling_from_pb(p->sampling);
    /* the decoded message's schema text is gone after this call: the job keeps a copy */
    if (j->sampling.grammar && !(j->sampling.grammar = j->grammar = strdup(j->sampling.grammar))) {
        job_free(j);
        td_ctrl_server_reply_error(ld->srv, in->req, p->request_id, TD__ERROR_CODE__ERR_INTERNAL,
                                   "out of memory");
        return;
    }
    if (set_targets(j, p->kv_targets, p->n_kv_targets)) {
        job_free(j);
        td_ctrl_server_reply_error(ld->srv, in->req, p->request_id, TD__ERROR_CODE__ERR_INVALID,
                                   "%zu KV targets for %u decode ranks", p->n_kv_targets, n_dst);
        return;
    }
    pf_job **tail = &ld->jobs;
    while (*tail)
        tail = &(*tail)->next;
    *tail = j;
    ld->n_jobs++;
    td_ctrl_server_reply_ack(ld->srv, in->req, p->request_id);
}

static void cancel_job(pf_leader *ld, pf_job *j, int err)
{
    if (!j->emitted) {
        pfl_finish_job(ld, j, 0, NULL);
        return;
    }
    /* in the chain: every stage aborts; the job ends when all reported */
    pf_stage_abort(ld->st, j->request_id, err);
    uint8_t msg[28];
    int64_t len = pf_wire_abort_write(msg, sizeof msg, 0, j->request_id, err);
    if (len > 0) pf_chain_send_msg(&ld->st->chain, msg, (size_t)len);
    j->done = j->n_prompt; /* schedule nothing more */
    if (!j->err) j->err = err;
}

static void handle_request(pf_leader *ld, const td_ctrl_server_in *in)
{
    const Td__Envelope *env = in->env;
    switch (env->body_case) {
    case TD__ENVELOPE__BODY_PREFILL:
        handle_prefill(ld, in);
        return;
    case TD__ENVELOPE__BODY_KV_TARGET: {
        const Td__KvTarget *t = env->kv_target;
        pf_job *j = find_job(ld, t->request_id);
        if (!j || j->client_id != in->client_id || j->err) {
            td_ctrl_server_reply_error(ld->srv, in->req, t->request_id,
                                       TD__ERROR_CODE__ERR_NOT_FOUND, "no prefill request %llu",
                                       (unsigned long long)t->request_id);
            return;
        }
        int rc = set_targets(j, t->kv_targets, t->n_kv_targets);
        if (rc == TD_ESTATE) { /* a retried call: the same targets again */
            td_ctrl_server_reply_ack(ld->srv, in->req, t->request_id);
            return;
        }
        if (rc) {
            td_ctrl_server_reply_error(ld->srv, in->req, t->request_id, TD__ERROR_CODE__ERR_INVALID,
                                       "%zu KV targets for %u decode ranks", t->n_kv_targets,
                                       j->n_dst);
            return;
        }
        push_targets(ld, j);
        td_ctrl_server_reply_ack(ld->srv, in->req, t->request_id);
        return;
    }
    case TD__ENVELOPE__BODY_CANCEL: {
        uint64_t rid = env->cancel->request_id;
        pf_job *j = find_job(ld, rid);
        if (!j || j->client_id != in->client_id) {
            td_ctrl_server_reply_error(ld->srv, in->req, rid, TD__ERROR_CODE__ERR_NOT_FOUND,
                                       "no prefill request %llu", (unsigned long long)rid);
            return;
        }
        j->cancelled = true;
        cancel_job(ld, j, TD_EIO);
        td_ctrl_server_reply_ack(ld->srv, in->req, rid);
        return;
    }
    case TD__ENVELOPE__BODY_STAGE_HELLO:
        pfl_handle_hello(ld, in);
        return;
    default:
        td_ctrl_server_reply_error(ld->srv, in->req, 0, TD__ERROR_CODE__ERR_UNSUPPORTED,
                                   "prefill instance %s does not handle %s", ld->st->p->instance,
                                   td_ctrl_body_name(env->body_case));
    }
}

static int serve_inbox(pf_leader *ld, int timeout_ms)
{
    for (;;) {
        td_ctrl_server_in in;
        int rc = td_ctrl_server_recv(ld->srv, &in, timeout_ms);
        if (rc == TD_ETIMEDOUT) return 0;
        if (rc) return rc;
        if (in.kind == TD_CTRL_IN_REQUEST)
            handle_request(ld, &in);
        else if (in.kind == TD_CTRL_IN_PEER_GONE)
            for (pf_job *j = ld->jobs, *nx; j; j = nx) {
                nx = j->next;
                if (j->client_id == in.client_id) {
                    j->cancelled = true;
                    cancel_job(ld, j, TD_EIO);
                }
            }
        timeout_ms = 0;
    }
}

/* ---- deadlines ---- */

static void expire_jobs(pf_leader *ld)
{
    int64_t now = td_now_ms();
    for (pf_job *j = ld->jobs, *nx; j; j = nx) {
        nx = j->next;
        if (!j->emitted && now - j->t_submit_ms > ld->st->timeout_ms)
            pfl_finish_job(ld, j, TD_ETIMEDOUT, "waited in the queue past the transfer deadline");
        else if (j->emitted && now - j->t_start_ms > ld->st->timeout_ms + REPORT_GRACE_MS)
            pfl_finish_job(ld, j, TD_ETIMEDOUT, "stages did not report before the deadline");
    }
}

/* ---- chunk planning ---- */

static int record_chunk(pf_job *j, int32_t size)
{
    if (j->n_chunks == j->cap_chunks) {
        uint32_t cap = j->cap_chunks ? 2 * j->cap_chunks : 8;
        int32_t *c = realloc(j->chunk_sizes, cap * sizeof *c);
        if (!c) return TD_ENOMEM;
        j->chunk_sizes = c;
        j->cap_chunks = cap;
    }
    j->chunk_sizes[j->n_chunks++] = size;
    return 0;
}

/* Plan and run the next chunk; returns 1 if one ran, 0 if there is nothing to do. */
static int run_chunk(pf_leader *ld)
{
    if (!ld->st->last &&
        (!pf_chain_queue_empty(&ld->st->chain) || !pf_chain_free_send(&ld->st->chain, 0)))
        return 0; /* the chain is full: later (queued messages first, to keep the order) */
    pf_seg segs[PF_MAX_SEGS];
    pf_job *js[PF_MAX_SEGS];
    int n_segs = 0;
    int32_t budget = ld->st->chunk_max;
    int64_t promised = 0;
    size_t gbytes = 0; /* schema texts in the chunk (pf_wire: PF_WIRE_GRAMMAR_BUDGET) */
    int32_t *ids = ld->ids;
    int64_t n_ids = 0;
    for (pf_job *j = ld->jobs; j && budget > 0 && n_segs < PF_MAX_SEGS; j = j->next) {
        if (j->done >= j->n_prompt || j->cancelled || j->err) continue;
        if (!j->emitted) { /* the plan starts after the cached prefix (never prompt logprobs:
                              the last stage needs every position's logits for them) */
            j->n_cached =
                j->sampling.prompt_logprobs
                    ? 0
                    : pf_stage_cached_prefix(ld->st, j->prompt, j->n_prompt, &j->cached_id);
            j->done = j->n_cached;
            int64_t need = kn_kv_blocks_for(ld->st->shard.kv, j->n_prompt) -
                           j->n_cached / ld->st->shard.kv->block_size;
            if (ld->st->shard.kv->n_free - promised < need) break; /* in order: wait for room */
            promised += need;
            if (!j->chunk0)
                j->chunk0 = pf_chunking_initial(ld->st, &ld->tune, &ld->chunking, j->request_id,
                                                j->n_cached, j->n_prompt);
        }
        int32_t rem = j->n_prompt - j->done, size;
        if (n_segs == 0) { /* the request's own C (pf_chunking_initial) also bounds the chunk */
            pf_chunk_params cp = ld->chunking;
            cp.chunk_size = budget = j->chunk0 > 0 && j->chunk0 < budget ? j->chunk0 : budget;
            int64_t x = pf_next_chunk(pf_tune_model(&ld->tune), &cp, j->done, rem);
            size = x > 0 ? (int32_t)x : (rem < budget ? rem : budget);
        } else
            size = rem; /* packing after a request's last chunk: the rest of the budget */
        if (size > budget) size = budget;
        pf_seg *g = &segs[n_segs];
        *g = (pf_seg){.req_id = j->request_id,
                      .t0 = (uint32_t)j->done,
                      .t1 = (uint32_t)(j->done + size),
                      .n_prompt = (uint32_t)j->n_prompt,
                      .chunk = j->n_chunks,
                      .n_dst = j->n_dst,
                      .sampling = j->sampling};
        if (!j->emitted) {
            g->n_cached = (uint32_t)j->n_cached;
            g->cached_id = j->n_cached ? j->cached_id : 0;
        }
        g->flags = (!j->emitted ? PF_SEG_FIRST : 0) | (g->t1 == g->n_prompt ? PF_SEG_LAST : 0);
        size_t gb = pf_wire_seg_grammar_bytes(g);
        if (gbytes + gb > PF_WIRE_GRAMMAR_BUDGET) break; /* its schema goes in a later chunk */
        gbytes += gb;
        memcpy(ids + n_ids, j->prompt + j->done, (size_t)size * sizeof *ids);
        g->tokens = ids + n_ids;
        n_ids += size;
        budget -= size;
        js[n_segs++] = j;
        if (!(g->flags & PF_SEG_LAST)) break; /* a request's middle chunk fills the chunk */
    }
    if (!n_segs) return 0;
    int64_t now = td_now_ms();
    for (int i = 0; i < n_segs; i++) {
        pf_job *j = js[i];
        if (!j->emitted) {
            j->t_start_ms = now;
            j->epoch = ld->st->epoch;
        }
        j->emitted = true;
        j->done = (int32_t)segs[i].t1;
        record_chunk(j, (int32_t)(segs[i].t1 - segs[i].t0));
    }
    /* the refit learns the forward's time, not the wait for a free send buffer (pf_int.h) */
    int rc = pf_stage_chunk(ld->st, segs, n_segs, ids, NULL);
    if (!rc) pf_chunking_observe(ld->st, &ld->tune, segs, n_segs, ld->st->last_forward_ms);
    for (int i = 0; i < n_segs; i++)
        push_targets(ld, js[i]);
    return rc ? rc : 1;
}

/* ---- health ---- */

static void publish_health(pf_leader *ld)
{
    Td__Health h = TD__HEALTH__INIT;
    h.instance = (char *)ld->st->p->instance;
    h.role = TD__ROLE__ROLE_PREFILL;
    h.rank = 0;
    uint64_t queued = 0;
    for (pf_job *j = ld->jobs; j; j = j->next) {
        if (j->emitted)
            h.running++;
        else
            h.waiting++;
        queued += (uint64_t)(j->n_prompt - j->done);
    }
    h.queued_prompt_tokens = queued;
    pf_health_buf hb; /* the pool's share, the cache's budget and KV events */
    pf_health_cache(ld->st, &h, &hb);
    pf_health_compute(&ld->compute, &h);
    h.uptime_ms = (uint64_t)(td_now_ms() - ld->started_ms);
    h.ready = ld->running;
    h.draining = ld->leaving;
    uint64_t hits[PF_MAX_STAGES], evicted[PF_MAX_STAGES];
    if (ld->st->kvc) { /* stage 0's own figures now, the others' from their last reports */
        memcpy(hits, ld->cache_hits, sizeof hits);
        memcpy(evicted, ld->cache_evicted, sizeof evicted);
        pf_stage_cache_stats(ld->st, &hits[0], &evicted[0]);
        h.n_prefix_cache_hit_tokens = h.n_prefix_cache_evicted_blocks = (size_t)ld->st->pp;
        h.prefix_cache_hit_tokens = hits;
        h.prefix_cache_evicted_blocks = evicted;
    }
    td_ctrl_server_set_health(ld->srv, &h);
}

/* router.membership: announce the instance to the router at the address others reach stage 0
 * at (--advertise, else hosts[0], with the port bound). */
static void start_join(pf_leader *ld, const char *bound)
{
    const pf_node_params *p = ld->st->p;
    const td_cfg_membership *m = &p->cfg->router.membership;
    td_join_params jp = {.router = m->address,
                         .role = TD__ROLE__ROLE_PREFILL,
                         .name = p->instance,
                         .bound = bound,
                         .host = p->advertise ? p->advertise : ld->st->cfg->hosts[0],
                         .template_name = ld->st->cfg->name,
                         .pp = (uint32_t)ld->st->pp,
                         .max_queue = (uint32_t)ld->st->cfg->max_queue,
                         .period_ms = m->lease_ms / 4 > 0 ? m->lease_ms / 4 : 1,
                         .security = &p->cfg->security};
    if (*m->address) td_join_start(&jp, &ld->join); /* a failure is logged: it serves */
}

/* After SIGTERM: whether the serving loop ends now. With prefill[].drain_timeout_ms the
 * instance first leaves (Health.draining, the router told at once, new prompts refused with
 * ERR_SHUTDOWN: the router sends them elsewhere) while the prompts in flight finish, for up to
 * that long; what is left then fails (the router starts those again elsewhere). */
static bool stop_now(pf_leader *ld)
{
    if (!*ld->st->p->stop) return false;
    bool idle = !ld->jobs && !ld->st->reqs;
    if (ld->leaving) return idle || td_now_ms() >= ld->leave_until_ms;
    int drain = ld->st->cfg->drain_timeout_ms;
    if (drain <= 0 || idle || !ld->running) return true;
    ld->leaving = true;
    ld->leave_until_ms = td_now_ms() + drain;
    td_join_leave(ld->join);
    publish_health(ld);
    TD_LOG_INFO("prefill %s: leaving: %d prompts may finish within %d ms "
                "(prefill[].drain_timeout_ms); no new ones",
                ld->st->p->instance, ld->n_jobs, drain);
    return false;
}

static int lead(pf_leader *ld)
{
    /* listen first: a busy port is an error before any profiling, and meanwhile Health is
     * answered (ready: false) and the other stages' hellos wait in the inbox */
    td_ctrl_opts opts = {.security = &ld->st->p->cfg->security};
    int rc = td_ctrl_server_create(&opts, &ld->srv);
    if (rc) return rc;
    char url[256], bound[256];
    if (ld->st->p->listen)
        snprintf(url, sizeof url, "%s", ld->st->p->listen);
    else if ((rc = td_cfg_ctrl_url(ld->st->cfg->hosts[0], ld->st->cfg->port, url, sizeof url)))
        return rc;
    if ((rc = td_ctrl_server_listen(ld->srv, url, bound, sizeof bound))) {
        TD_LOG_ERR("prefill %s: cannot listen on %s: %s", ld->st->p->instance, url,
                   td_strerror(rc));
        return rc;
    }
    ld->started_ms = td_now_ms();
    kn_backend_compute_info(ld->st->shard.rt.be, &ld->compute);
    publish_health(ld);
    if ((rc = pf_chunking_setup(ld->st, &ld->tune, &ld->chunking))) {
        td_ctrl_server_destroy(ld->srv);
        ld->srv = NULL; /* TD_ESTATE: SIGTERM while profiling, a normal stop; else logged */
        return rc == TD_ESTATE ? 0 : rc;
    }
    TD_LOG_INFO("prefill %s: serving on %s (pp %d)", ld->st->p->instance, bound, ld->st->pp);
    start_join(ld, bound);
    ld->members[0].boot_id = ld->st->boot_id;
    pfl_reset_formation(ld, "start-up");
    if (ld->running) TD_LOG_INFO("prefill %s: ready", ld->st->p->instance);
    int64_t last_health = 0;
    while (!stop_now(ld)) {
        if ((rc = serve_inbox(ld, 0))) break;
        pfl_check_members(ld);
        take_chain_reports(ld); /* the other stages' */
        if (ld->st->chain.link && pf_chain_flush(&ld->st->chain)) ld->st->chain.broken = true;
        pf_stage_poll(ld->st);
        pf_report r;
        uint8_t lp[PF_LP_MAX_BYTES];
        size_t lp_len;
        while (pf_stage_take_lp(ld->st, lp, &lp_len)) /* this stage's (pp 1), then */
            on_lp(ld, lp, lp_len);
        while (pf_stage_take_report(ld->st, &r)) /* its reports */
            on_report(ld, &r);
        expire_jobs(ld);
        int ran = 0;
        if (ld->running) {
            ran = run_chunk(ld);
            if (ran < 0) {
                TD_LOG_ERR("prefill %s: chunk failed: %s", ld->st->p->instance, td_strerror(ran));
                if (ran == TD_ENOMEM) break;
                ran = 0;
            }
        }
        if (td_now_ms() - last_health >= HEALTH_MS) {
            publish_health(ld);
            last_health = td_now_ms();
        }
        if (!ran)
            pf_chain_wait(&ld->st->chain, td_ctrl_server_fd(ld->srv),
                          ld->jobs || ld->st->reqs ? 5 : 100);
    }
    /* stop: fail what is in flight (the router starts those prompts again elsewhere), let
       the events out, then tear down */
    td_join_leave(ld->join);
    if (ld->n_jobs)
        TD_LOG_INFO("prefill %s: stopping; %d requests end with an error", ld->st->p->instance,
                    ld->n_jobs);
    while (ld->jobs)
        pfl_finish_job(ld, ld->jobs, TD_ESTATE, "the prefill instance is shutting down");
    pf_stage_abort_all(ld->st, TD_ESTATE);
    ld->running = false;
    publish_health(ld);
    /* the error events go out with the clients' next long poll (~ms); transfers end */
    int64_t start = td_now_ms();
    while (td_now_ms() - start < STOP_DRAIN_MS) {
        serve_inbox(ld, 20);
        pf_stage_poll(ld->st);
        pf_report r;
        while (pf_stage_take_report(ld->st, &r))
            on_report(ld, &r); /* the jobs are gone: nothing more to tell */
        if (!ld->st->reqs && td_now_ms() - start >= 100) break;
    }
    TD_LOG_INFO("prefill %s: %llu requests done, %llu failed, %llu chunks", ld->st->p->instance,
                (unsigned long long)ld->n_done, (unsigned long long)ld->n_failed,
                (unsigned long long)ld->st->n_chunks);
    td_ctrl_server_destroy(ld->srv);
    ld->srv = NULL;
    return rc == TD_ESTATE ? 0 : rc;
}

int pf_leader_run(pf_stage *st)
{
    pf_leader *ld = calloc(1, sizeof *ld);
    if (!ld) return TD_ENOMEM;
    ld->st = st;
    ld->ids = malloc((size_t)st->chunk_max * sizeof *ld->ids);
    int rc = ld->ids ? lead(ld) : TD_ENOMEM;
    td_join_stop(ld->join);
    td_ctrl_server_destroy(ld->srv); /* left by an error before the loop */
    free(ld->ids);
    free(ld);
    return rc;
}
