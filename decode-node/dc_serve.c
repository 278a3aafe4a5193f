/* dc_serve.c: the decode leader's control plane: Submit, Alloc and Cancel in (refused
 * with ERR_BUSY while the instance forms), token and error events out, the transfers'
 * events applied to the scheduler, Health. The rank's life and the step loop are in
 * dc_node.c. This file owns the node's dc_serve part (dc_node_int.h) and only reads the
 * others. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dc_node_int.h"
#include "kv_cache.h"
#include "kvx_conn.h"
#include "td_clock.h"
#include "td_err.h"
#include "td_grow.h"

#define MAX_WAITING_FACTOR 4 /* queued requests beyond 4 x max_batch are refused (busy) */

/* ---- the part's life ---- */

/* router.membership: announce the instance to the router at the address others reach it at
 * (--advertise, else the YAML's host, with the port bound). */
static void start_join(dc_node *n, const char *bound)
{
    const td_cfg_membership *m = &n->p->cfg->router.membership;
    td_join_params jp = {.router = m->address,
                         .role = TD__ROLE__ROLE_DECODE,
                         .name = n->p->instance,
                         .bound = bound,
                         .host = n->p->advertise ? n->p->advertise : n->dcfg->host,
                         .template_name = n->dcfg->name,
                         .tp = (uint32_t)n->dcfg->tp,
                         .max_batch = (uint32_t)n->dcfg->max_batch,
                         .period_ms = m->lease_ms / 4 > 0 ? m->lease_ms / 4 : 1,
                         .security = &n->p->cfg->security};
    if (*m->address) td_join_start(&jp, &n->serve.join); /* a failure is logged: it serves */
}

int dc_serve_init(dc_node *n)
{
    td_ctrl_opts opts = {.security = &n->p->cfg->security};
    int rc = td_ctrl_server_create(&opts, &n->serve.srv);
    if (rc) return rc;
    char url[256], bound[256];
    if (n->p->listen)
        snprintf(url, sizeof url, "%s", n->p->listen);
    else if ((rc = td_cfg_ctrl_url(n->dcfg->host, n->dcfg->port, url, sizeof url)))
        return rc;
    if ((rc = td_ctrl_server_listen(n->serve.srv, url, bound, sizeof bound))) {
        TD_LOG_ERR("decode %s: cannot listen on %s: %s", n->p->instance, url, td_strerror(rc));
        return rc;
    }
    TD_LOG_INFO("decode %s: serving on %s%s", n->p->instance, bound,
                n->proc.disagg ? " (disaggregated: Alloc and colocated Submit)" : "");
    n->serve.started_ms = td_now_ms();
    start_join(n, bound);
    return 0;
}

void dc_serve_fini(dc_node *n)
{
    td_join_stop(n->serve.join);
    td_ctrl_server_destroy(n->serve.srv);
    free(n->serve.routes);
    free(n->serve.held_allocs);
    n->serve = (dc_serve){0};
}

/* ---- leader: events out ---- */

static Td__FinishReason wire_finish(dc_finish f)
{
    switch (f) {
    case DC_FINISH_STOP:
        return TD__FINISH_REASON__FINISH_STOP;
    case DC_FINISH_LENGTH:
        return TD__FINISH_REASON__FINISH_LENGTH;
    case DC_FINISH_CANCELLED:
        return TD__FINISH_REASON__FINISH_CANCELLED;
    case DC_FINISH_ERROR:
        return TD__FINISH_REASON__FINISH_ERROR;
    default:
        return TD__FINISH_REASON__FINISH_NONE;
    }
}

/* A TokenEvent with logprobs (generated tokens' or the prompt's) to the route's client. */
static void send_logprobs(dc_node *n, dc_route *r, const int32_t *ids, int n_ids,
                          const td_logprob_entry *lps, int32_t prompt_from,
                          const td_logprob_entry *plps, int n_plps, dc_finish finish,
                          int32_t n_prompt, int32_t n_gen, int32_t n_cached)
{
    Td__Usage u = TD__USAGE__INIT;
    u.prompt_tokens = (uint32_t)n_prompt;
    u.completion_tokens = (uint32_t)n_gen;
    u.cached_tokens = (uint32_t)n_cached;
    Td__TokenEvent t = TD__TOKEN_EVENT__INIT;
    t.request_id = r->request_id;
    t.seq = r->seq++;
    t.n_token_ids = (size_t)n_ids;
    t.token_ids = (int32_t *)ids;
    t.finish = wire_finish(finish);
    t.usage = &u;
    t.logprobs = td_ctrl_logprobs_to_pb(lps, lps ? (size_t)n_ids : 0);
    t.n_logprobs = t.logprobs ? (size_t)n_ids : 0;
    t.prompt_logprobs = td_ctrl_logprobs_to_pb(plps, (size_t)n_plps);
    t.n_prompt_logprobs = t.prompt_logprobs ? (size_t)n_plps : 0;
    t.prompt_from = (uint32_t)prompt_from;
    if ((lps && n_ids && !t.logprobs) || (n_plps && !t.prompt_logprobs))
        TD_LOG_ERR("req %llu: no memory for its logprobs; the event goes without them",
                   (unsigned long long)r->request_id);
    Td__Event ev = TD__EVENT__INIT;
    ev.body_case = TD__EVENT__BODY_TOKEN;
    ev.token = &t;
    td_ctrl_server_send_event(n->serve.srv, r->client_id, &ev);
    free(t.logprobs);
    free(t.prompt_logprobs);
}

void dc_serve_on_prompt_logprobs(void *ctx, uint64_t id, int32_t from, const td_logprob_entry *e,
                                 int n_e)
{
    dc_node *n = ctx;
    if (id >= n->serve.n_routes || !n->serve.routes[id].used) return;
    send_logprobs(n, &n->serve.routes[id], NULL, 0, NULL, from, e, n_e, DC_FINISH_NONE, 0, 0, 0);
}

void dc_serve_on_tokens(void *ctx, uint64_t id, const int32_t *ids, int n_ids,
                        const td_logprob_entry *lps, dc_finish finish, int32_t n_prompt,
                        int32_t n_gen, int32_t n_cached)
{
    dc_node *n = ctx;
    if (id >= n->serve.n_routes || !n->serve.routes[id].used) return;
    int64_t t0 = td_now_ns();
    dc_route *r = &n->serve.routes[id];
    if (finish == DC_FINISH_ERROR) {
        if (r->err_code != TD__ERROR_CODE__ERR_NONE)
            td_ctrl_server_send_error(n->serve.srv, r->client_id, r->request_id, r->err_code, "%s",
                                      r->err_msg);
        else if (n->life.stopping)
            td_ctrl_server_send_error(n->serve.srv, r->client_id, r->request_id,
                                      TD__ERROR_CODE__ERR_SHUTDOWN,
                                      "decode instance %s is shutting down", n->p->instance);
        else /* a rank died or the instance broke: PEER_FAILED tells the router to move the
                request (migration); a plain failure stays INTERNAL */
            td_ctrl_server_send_error(n->serve.srv, r->client_id, r->request_id,
                                      n->life.fail_why[0] ? TD__ERROR_CODE__ERR_PEER_FAILED
                                                          : TD__ERROR_CODE__ERR_INTERNAL,
                                      "request failed on decode instance %s%s%s", n->p->instance,
                                      n->life.fail_why[0] ? ": " : "", n->life.fail_why);
    }
    /* the blocks this request stored reach the router before its end does (KV events: the
       router routes the conversation's next turn by them) */
    if (finish != DC_FINISH_NONE && kn_kv_mem_cache(n->proc.mem)) dc_serve_health(n);
    /* TD_ENOENT: the client is gone; the request is finishing or will be cancelled */
    if (lps && n_ids)
        send_logprobs(n, r, ids, n_ids, lps, 0, NULL, 0, finish, n_prompt, n_gen, n_cached);
    else
        td_ctrl_server_send_tokens(n->serve.srv, r->client_id, r->request_id, r->seq++, ids,
                                   (size_t)n_ids, wire_finish(finish), (uint32_t)n_prompt,
                                   (uint32_t)n_gen, (uint32_t)n_cached);
    if (finish != DC_FINISH_NONE) r->used = false;
    n->serve.ns_stream += td_now_ns() - t0;
}

/* ---- leader: requests in ---- */

static int64_t find_route(const dc_node *n, uint64_t client, uint64_t request_id)
{
    for (size_t i = 0; i < n->serve.n_routes; i++)
        if (n->serve.routes[i].used && n->serve.routes[i].client_id == client &&
            n->serve.routes[i].request_id == request_id)
            return (int64_t)i;
    return -1;
}

static int64_t new_route(dc_node *n, uint64_t client, uint64_t request_id)
{
    for (size_t i = 0; i < n->serve.n_routes; i++)
        if (!n->serve.routes[i].used) {
            n->serve.routes[i] =
                (dc_route){.client_id = client, .request_id = request_id, .used = true};
            return (int64_t)i;
        }
    size_t cap = n->serve.n_routes ? 2 * n->serve.n_routes : 64;
    dc_route *r = realloc(n->serve.routes, cap * sizeof *r);
    if (!r) return -1;
    memset(r + n->serve.n_routes, 0, (cap - n->serve.n_routes) * sizeof *r);
    n->serve.routes = r;
    size_t i = n->serve.n_routes;
    n->serve.n_routes = cap;
    n->serve.routes[i] = (dc_route){.client_id = client, .request_id = request_id, .used = true};
    return (int64_t)i;
}

/* The scheduler's view of a Submit (also the request inside an Alloc). */
static dc_request_params request_params(const Td__Submit *s, uint64_t id)
{
    dc_request_params rp = {
        .id = id,
        .prompt = s->token_ids,
        .n_prompt = (int32_t)s->n_token_ids,
        .max_tokens = (int32_t)(s->max_tokens > INT32_MAX ? INT32_MAX : s->max_tokens),
        .stop_ids = s->stop_token_ids,
        .n_stop = (int)s->n_stop_token_ids,
        .ignore_eos = s->ignore_eos,
        .sampling = td_ctrl_sampling_from_pb(s->sampling),
    };
    return rp;
}

/* Refuse a request the scheduler rejected (rc from dc_sched_submit*). */
static void reply_refused(dc_node *n, td_ctrl_req *req, uint64_t request_id, int rc)
{
    Td__ErrorCode code = rc == TD_ENOSPC   ? TD__ERROR_CODE__ERR_NO_SPACE
                         : rc == TD_ENOMEM ? TD__ERROR_CODE__ERR_INTERNAL
                                           : TD__ERROR_CODE__ERR_INVALID;
    td_ctrl_server_reply_error(n->serve.srv, req, request_id, code,
                               rc == TD_ENOSPC   ? "request can never fit this instance's KV pool "
                                                   "(%d blocks of %d tokens)"
                               : rc == TD_ERANGE ? "prompt too long or token id outside the "
                                                   "vocabulary (%d blocks of %d tokens)"
                                                 : "invalid request (%d blocks of %d tokens)",
                               dc_kv(n)->n_blocks, dc_kv(n)->block_size);
}

static void handle_submit(dc_node *n, const td_ctrl_server_in *in)
{
    const Td__Submit *s = in->env->submit;
    if (find_route(n, in->client_id, s->request_id) >= 0) {
        /* the control layer re-sends a call whose connection dropped: the same (client,
         * request id) while it runs is that retry, answered like the first time */
        td_ctrl_server_reply_ack(n->serve.srv, in->req, s->request_id);
        return;
    }
    if (n->life.draining) {
        td_ctrl_server_reply_error(n->serve.srv, in->req, s->request_id,
                                   TD__ERROR_CODE__ERR_SHUTDOWN,
                                   "decode instance %s is shutting down", n->p->instance);
        return;
    }
    if (n->life.forming) {
        td_ctrl_server_reply_error(n->serve.srv, in->req, s->request_id, TD__ERROR_CODE__ERR_BUSY,
                                   "decode instance %s %s", n->p->instance, n->life.forming_why);
        return;
    }
    dc_sched_stats st = dc_sched_get_stats(n->leader.sched);
    if (st.waiting >= MAX_WAITING_FACTOR * n->dcfg->max_batch) {
        td_ctrl_server_reply_error(n->serve.srv, in->req, s->request_id, TD__ERROR_CODE__ERR_BUSY,
                                   "%d requests already waiting", st.waiting);
        return;
    }
    int64_t id = new_route(n, in->client_id, s->request_id);
    if (id < 0) {
        td_ctrl_server_reply_error(n->serve.srv, in->req, s->request_id,
                                   TD__ERROR_CODE__ERR_INTERNAL, "out of memory");
        return;
    }
    dc_request_params rp = request_params(s, (uint64_t)id);
    int rc = dc_sched_submit(n->leader.sched, &rp);
    if (rc) {
        n->serve.routes[id].used = false;
        reply_refused(n, in->req, s->request_id, rc);
        return;
    }
    td_ctrl_server_reply_ack(n->serve.srv, in->req, s->request_id);
}

/* Reply AllocReply with the transfer's targets (one per rank, rank order). */
static void reply_targets(dc_node *n, td_ctrl_req *req, uint64_t request_id, uint64_t id)
{
    const uint8_t *const *tg;
    const size_t *len;
    int32_t n_cached;
    if (dc_xfer_targets(n->plane.xfer, id, &tg, &len, &n_cached)) {
        td_ctrl_server_reply_error(n->serve.srv, req, request_id, TD__ERROR_CODE__ERR_INTERNAL,
                                   "no KV targets for request %llu (bug)",
                                   (unsigned long long)request_id);
        return;
    }
    ProtobufCBinaryData bins[KVX_MAX_RANKS];
    for (int r = 0; r < n->dcfg->tp; r++)
        bins[r] = (ProtobufCBinaryData){.len = len[r], .data = (uint8_t *)tg[r]};
    Td__AllocReply ar = TD__ALLOC_REPLY__INIT;
    ar.request_id = request_id;
    ar.n_kv_targets = (size_t)n->dcfg->tp;
    ar.kv_targets = bins;
    ar.n_cached = (uint32_t)n_cached;
    Td__Envelope env = TD__ENVELOPE__INIT;
    env.body_case = TD__ENVELOPE__BODY_ALLOC_REPLY;
    env.alloc_reply = &ar;
    td_ctrl_server_reply(n->serve.srv, req, &env);
}

/* Whether an Alloc reply must wait for the other ranks' tier copies: at tp > 1 every rank
 * repeats the leader's tier copies when it reads the next plan, and a block the allocation
 * evicted to the tier must be copied out on every rank before the prefill stages, which
 * write the targets' blocks at once, can overwrite it. */
static bool must_hold(dc_node *n)
{
    int nc = 0;
    if (n->dcfg->tp > 1) dc_tier_pending(n, &nc);
    return nc > 0 || n->serve.n_held_allocs > 0;
}

static void answer_targets(dc_node *n, td_ctrl_req *req, uint64_t client_id, uint64_t request_id,
                           uint64_t id)
{
    if (!must_hold(n)) {
        reply_targets(n, req, request_id, id);
        return;
    }
    if (TD_GROW_INT(n->serve.held_allocs, n->serve.cap_held_allocs, n->serve.n_held_allocs + 1,
                    16)) {
        /* no room to wait: fail it (its blocks return when the transfer ends) */
        dc_xfer_abort(n->plane.xfer, id, DC_XFER_END_FAILED);
        td_ctrl_server_reply_error(n->serve.srv, req, request_id, TD__ERROR_CODE__ERR_INTERNAL,
                                   "out of memory");
        return;
    }
    n->serve.held_allocs[n->serve.n_held_allocs++] =
        (dc_held_alloc){.req = req, .client_id = client_id, .request_id = request_id, .id = id};
}

int dc_serve_sync_allocs(dc_node *n)
{
    if (!n->serve.n_held_allocs) return 0;
    int nc;
    dc_tier_pending(n, &nc);
    int64_t t0 = td_now_ns();
    int rc = dc_tier_flush(n, n->stats.step);
    if (!rc)
        TD_LOG_INFO("decode %s: %d Alloc replies held until every rank made %d tier copies "
                    "(%.2f ms)",
                    n->p->instance, n->serve.n_held_allocs, nc, (double)(td_now_ns() - t0) / 1e6);
    for (int i = 0; i < n->serve.n_held_allocs; i++) {
        dc_held_alloc *h = &n->serve.held_allocs[i];
        /* still the same request: a cancelled one's route (and id) may be taken again */
        const dc_route *r = h->id < n->serve.n_routes ? &n->serve.routes[h->id] : NULL;
        bool same = r && r->used && r->client_id == h->client_id && r->request_id == h->request_id;
        if (!rc && same && dc_xfer_live(n->plane.xfer, h->id))
            reply_targets(n, h->req, h->request_id, h->id);
        else
            td_ctrl_server_reply_error(n->serve.srv, h->req, h->request_id,
                                       rc ? TD__ERROR_CODE__ERR_PEER_FAILED
                                          : TD__ERROR_CODE__ERR_NOT_FOUND,
                                       rc ? "decode instance %s failed before the KV targets "
                                            "were ready: %s"
                                          : "request cancelled on %s before its KV targets "
                                            "went out%s",
                                       n->p->instance, rc ? td_strerror(rc) : "");
    }
    n->serve.n_held_allocs = 0;
    return rc;
}

void dc_serve_fail_allocs(dc_node *n)
{
    for (int i = 0; i < n->serve.n_held_allocs; i++)
        td_ctrl_server_reply_error(
            n->serve.srv, n->serve.held_allocs[i].req, n->serve.held_allocs[i].request_id,
            TD__ERROR_CODE__ERR_PEER_FAILED,
            "decode instance %s stopped before the KV targets were ready", n->p->instance);
    n->serve.n_held_allocs = 0;
}

/* Alloc (disaggregated mode): reserve the prompt's blocks (sharing the prefix this pool
 * holds), make every rank's KV target and answer them with the count of positions held
 * (not transferred); the request waits TRANSFERRING until the prefill stages' KV is in. */
static void handle_alloc(dc_node *n, const td_ctrl_server_in *in)
{
    const Td__Alloc *a = in->env->alloc;
    const Td__Submit *s = a->request; /* present: the decoder checks it */
    uint64_t rid = s->request_id;
    if (!n->proc.disagg) {
        td_ctrl_server_reply_error(n->serve.srv, in->req, rid, TD__ERROR_CODE__ERR_UNSUPPORTED,
                                   "decode instance %s runs in colocated mode (%s has no prefill "
                                   "instances)",
                                   n->p->instance, n->p->cfg->path);
        return;
    }
    int64_t id = find_route(n, in->client_id, rid);
    if (id >= 0) {
        /* a retry of the call (the control layer re-sends after a connection drop) */
        if (n->plane.xfer && dc_xfer_live(n->plane.xfer, (uint64_t)id))
            answer_targets(n, in->req, in->client_id, rid, (uint64_t)id);
        else
            td_ctrl_server_reply_error(n->serve.srv, in->req, rid, TD__ERROR_CODE__ERR_DUPLICATE,
                                       "request %llu is already running", (unsigned long long)rid);
        return;
    }
    if (n->life.draining) {
        td_ctrl_server_reply_error(n->serve.srv, in->req, rid, TD__ERROR_CODE__ERR_SHUTDOWN,
                                   "decode instance %s is shutting down", n->p->instance);
        return;
    }
    /* forming: no KV plane yet, or the last one's transfers still end (their blocks are
     * not reusable before that) */
    if (n->life.forming || !n->plane.xfer) {
        td_ctrl_server_reply_error(n->serve.srv, in->req, rid, TD__ERROR_CODE__ERR_BUSY,
                                   "decode instance %s %s", n->p->instance,
                                   n->life.forming ? n->life.forming_why
                                                   : "has no KV-transfer plane (bug)");
        return;
    }
    if (a->n_stages < 1 || a->n_stages > KVX_MAX_STAGES) {
        td_ctrl_server_reply_error(n->serve.srv, in->req, rid, TD__ERROR_CODE__ERR_INVALID,
                                   "alloc: n_stages %u is not in 1..%d", a->n_stages,
                                   KVX_MAX_STAGES);
        return;
    }
    /* the kvxfer request id is the client's request id (the prefill side opens the same) */
    if (dc_xfer_kvx_live(n->plane.xfer, rid)) {
        td_ctrl_server_reply_error(n->serve.srv, in->req, rid, TD__ERROR_CODE__ERR_DUPLICATE,
                                   "request id %llu is already being transferred into %s (by "
                                   "another client)",
                                   (unsigned long long)rid, n->p->instance);
        return;
    }
    dc_sched_stats st = dc_sched_get_stats(n->leader.sched);
    if (st.waiting + st.transferring >= MAX_WAITING_FACTOR * n->dcfg->max_batch) {
        td_ctrl_server_reply_error(n->serve.srv, in->req, rid, TD__ERROR_CODE__ERR_BUSY,
                                   "%d requests already waiting and %d transferring", st.waiting,
                                   st.transferring);
        return;
    }
    if ((id = new_route(n, in->client_id, rid)) < 0) {
        td_ctrl_server_reply_error(n->serve.srv, in->req, rid, TD__ERROR_CODE__ERR_INTERNAL,
                                   "out of memory");
        return;
    }
    dc_request_params rp = request_params(s, (uint64_t)id);
    const int32_t *blocks;
    int n_blocks;
    int32_t n_cached;
    int rc = dc_sched_submit_transfer(n->leader.sched, &rp, &blocks, &n_blocks, &n_cached);
    if (rc == TD_ESTATE) {
        n->serve.routes[id].used = false;
        td_ctrl_server_reply_error(n->serve.srv, in->req, rid, TD__ERROR_CODE__ERR_BUSY,
                                   "the KV pool cannot hold the prompt's %d blocks now (%d of %d "
                                   "free)",
                                   kn_kv_blocks_for(dc_kv(n), rp.n_prompt),
                                   kn_kv_available(n->proc.mem), dc_kv(n)->n_blocks);
        return;
    }
    if (rc) {
        n->serve.routes[id].used = false;
        reply_refused(n, in->req, rid, rc);
        return;
    }
    rc = dc_xfer_start(n->plane.xfer, (uint64_t)id, rid, a->n_stages, rp.n_prompt, n_cached, blocks,
                       n_blocks);
    if (rc) {
        /* no target went out: the blocks are safe to free; no event (the reply says it) */
        n->serve.routes[id].used = false;
        dc_sched_transfer_end(n->leader.sched, (uint64_t)id, DC_FINISH_ERROR);
        td_ctrl_server_reply_error(n->serve.srv, in->req, rid, TD__ERROR_CODE__ERR_INTERNAL,
                                   "cannot make the KV targets: %s", td_strerror(rc));
        return;
    }
    answer_targets(n, in->req, in->client_id, rid, (uint64_t)id);
    n->serve.load_changed = true; /* blocks are held now: a router picking instances sees it */
}

/* Cancel one request: a transfer in flight is aborted (its blocks are freed once kvxfer
 * says no writer can write any more), anything else goes through the scheduler. */
static int cancel_one(dc_node *n, uint64_t id)
{
    if (n->plane.xfer && dc_xfer_live(n->plane.xfer, id))
        return dc_xfer_abort(n->plane.xfer, id, DC_XFER_END_CANCELLED);
    return dc_sched_cancel(n->leader.sched, id);
}

static void handle_request(dc_node *n, const td_ctrl_server_in *in)
{
    const Td__Envelope *env = in->env;
    switch (env->body_case) {
    case TD__ENVELOPE__BODY_SUBMIT:
        handle_submit(n, in);
        return;
    case TD__ENVELOPE__BODY_ALLOC:
        handle_alloc(n, in);
        return;
    case TD__ENVELOPE__BODY_CANCEL: {
        uint64_t rid = env->cancel->request_id;
        int64_t id = find_route(n, in->client_id, rid);
        if (id < 0 || cancel_one(n, (uint64_t)id)) {
            td_ctrl_server_reply_error(n->serve.srv, in->req, rid, TD__ERROR_CODE__ERR_NOT_FOUND,
                                       "no running request %llu", (unsigned long long)rid);
            return;
        }
        td_ctrl_server_reply_ack(n->serve.srv, in->req, rid);
        return;
    }
    default:
        td_ctrl_server_reply_error(n->serve.srv, in->req, 0, TD__ERROR_CODE__ERR_UNSUPPORTED,
                                   "decode instance %s does not handle %s", n->p->instance,
                                   td_ctrl_body_name(env->body_case));
        return;
    }
}

static void cancel_client(dc_node *n, uint64_t client)
{
    for (size_t i = 0; i < n->serve.n_routes; i++)
        if (n->serve.routes[i].used && n->serve.routes[i].client_id == client) cancel_one(n, i);
}

void dc_serve_transfers(dc_node *n)
{
    dc_xfer_event ev;
    while (n->plane.xfer && dc_xfer_next(n->plane.xfer, &ev) == 1) {
        n->serve.load_changed = true;
        dc_route *r = ev.key < n->serve.n_routes ? &n->serve.routes[ev.key] : NULL;
        if (ev.kind == DC_XFER_ARRIVED) {
            if (dc_sched_transfer_done(n->leader.sched, ev.key, ev.first_token) != TD_EINVAL)
                continue;
            ev.why = DC_XFER_END_FAILED;
            snprintf(ev.msg, sizeof ev.msg,
                     "KV transfer from prefill: first token %d is outside the vocabulary",
                     ev.first_token);
        }
        if (ev.why == DC_XFER_END_CANCELLED) {
            dc_sched_transfer_end(n->leader.sched, ev.key, DC_FINISH_CANCELLED);
            continue;
        }
        if (ev.why == DC_XFER_END_STOPPED) continue; /* the request ended already */
        if (r && r->used) {
            r->err_code = ev.why == DC_XFER_END_TIMEOUT ? TD__ERROR_CODE__ERR_TIMEOUT
                                                        : TD__ERROR_CODE__ERR_PEER_FAILED;
            snprintf(r->err_msg, sizeof r->err_msg, "%s", ev.msg);
        }
        dc_sched_transfer_end(n->leader.sched, ev.key, DC_FINISH_ERROR);
    }
}

/* Health's KV events (docs/prefix-cache.md, "KV events"): the latest events of rank 0's
 * prefix cache, all the log keeps (the ranks' caches are identical: rank 0's scheduler
 * decides every block table), so that a router that polls at any moment sees those since
 * its last poll, or learns from kv_event_seq that it missed some. ids and kind have room
 * for KN_KV_EVENT_LOG_DEFAULT events. No cache: no events (seq 0). */
static void health_events(dc_node *n, Td__Health *h, uint64_t *ids, uint8_t *kind)
{
    const kn_kv_cache *c = kn_kv_mem_cache(n->proc.mem);
    if (!c) return;
    kn_kv_event ev[KN_KV_EVENT_LOG_DEFAULT];
    uint64_t next = kn_kv_cache_event_next(c), first;
    uint64_t since = next > KN_KV_EVENT_LOG_DEFAULT ? next - KN_KV_EVENT_LOG_DEFAULT : 1;
    int k = kn_kv_cache_events(c, since, ev, KN_KV_EVENT_LOG_DEFAULT, &first);
    size_t m = 0;
    for (int i = 0; i < k; i++) {
        kind[i] = ev[i].kind;
        if (ev[i].kind != KN_KV_EV_CLEARED) ids[m++] = ev[i].id;
    }
    h->kv_event_seq = first;
    h->kv_event_kind = (ProtobufCBinaryData){.len = (size_t)k, .data = kind};
    h->n_kv_event_ids = m;
    h->kv_event_ids = ids;
}

/* Health 27-33 from n->serve.compute, made at the first report (dc_node_int.h). The limits of
 * those fields (TD_CTRL_MAX_TAG, TD_CTRL_MAX_PATHS) hold kn_compute_info's strings. */
_Static_assert(sizeof((kn_compute_info *)0)->blas_core <= TD_CTRL_MAX_TAG + 1 &&
                   sizeof((kn_compute_info *)0)->paths <= TD_CTRL_MAX_PATHS + 1,
               "Health's compute strings must fit the decoder's limits");
static void health_compute(dc_node *n, Td__Health *h)
{
    const kn_compute_info *c = &n->serve.compute;
    if (!n->serve.compute_made) kn_backend_compute_info(n->proc.rt.be, &n->serve.compute);
    n->serve.compute_made = true;
    h->backend = (char *)c->backend;
    h->act = (char *)c->act;
    h->cpu_isa = (char *)c->cpu_isa;
    h->kernels_isa = (char *)c->kernels_isa;
    h->blas_core = (char *)c->blas_core;
    h->blas_core_older = c->blas_older;
    h->compute_paths = (char *)c->paths;
}

void dc_serve_health(dc_node *n)
{
    dc_sched_stats st = dc_sched_get_stats(n->leader.sched);
    Td__Health h = TD__HEALTH__INIT;
    h.instance = (char *)n->p->instance;
    h.role = TD__ROLE__ROLE_DECODE;
    h.rank = 0;
    h.running = (uint32_t)st.running;
    h.waiting = (uint32_t)(st.waiting + st.transferring); /* admitted, not running yet */
    h.kv_blocks_used = (uint32_t)st.kv_blocks_used;
    h.kv_blocks_free = (uint32_t)st.kv_blocks_free;
    h.kv_block_size = (uint32_t)dc_kv(n)->block_size;
    h.uptime_ms = (uint64_t)(td_now_ms() - n->serve.started_ms);
    h.num_preemptions = st.preemptions;
    h.prefix_queried_tokens = st.prefix_queried;
    h.prefix_hit_tokens = st.prefix_hits;
    h.prefix_evictions = st.prefix_evictions;
    uint64_t tier[4] = {st.tier_writes, st.tier_reads, st.tier_hits, st.tier_errors};
    if (n->dcfg->tier.path) {
        h.n_prefix_tier = 4;
        h.prefix_tier = tier;
    }
    h.n_step_time_counts = TD_STEP_HIST_N + 1;
    h.step_time_counts = n->stats.step_hist;
    h.step_time_us = n->stats.step_us;
    h.spec_drafts = st.spec_drafts;
    h.spec_draft_tokens = st.spec_draft_tokens;
    h.spec_accepted_tokens = st.spec_accepted;
    h.spec_held_steps = st.spec_held_steps;
    if (n->leader.cores) {
        td_coreshare_stats cs = td_coreshare_get_stats(n->leader.cores);
        h.share_claimed_steps = cs.steps;
        h.share_left_steps = cs.unclaimed;
        h.share_switches = cs.switches;
        h.share_claiming = cs.claiming;
    }
    size_t n_pos = sizeof st.spec_accepted_pos / sizeof st.spec_accepted_pos[0];
    while (n_pos > 0 && !st.spec_accepted_pos[n_pos - 1])
        n_pos--; /* up to the last nonzero position: a small message */
    h.n_spec_accepted_per_pos = n_pos;
    h.spec_accepted_per_pos = st.spec_accepted_pos;
    /* alive but not ready while forming: the router keeps polling and sends nothing */
    h.ready = !n->life.forming && !n->life.stopping && (!n->life.draining || n->life.leaving);
    h.draining = n->life.draining;
    uint64_t ev_ids[KN_KV_EVENT_LOG_DEFAULT];
    uint8_t ev_kind[KN_KV_EVENT_LOG_DEFAULT];
    health_events(n, &h, ev_ids, ev_kind);
    health_compute(n, &h);
    td_ctrl_server_set_health(n->serve.srv, &h);
}

void dc_serve_health_tick(dc_node *n, int64_t *last_ms)
{
    if (!n->serve.load_changed && td_now_ms() - *last_ms < 100) return;
    dc_serve_health(n);
    *last_ms = td_now_ms();
    n->serve.load_changed = false;
}

int dc_serve_inbox(dc_node *n, int timeout_ms, int64_t *ns_wait)
{
    if (ns_wait) *ns_wait = 0;
    for (;;) {
        td_ctrl_server_in in;
        int64_t t_wait = timeout_ms > 0 ? td_now_ns() : 0;
        int rc = td_ctrl_server_recv(n->serve.srv, &in, timeout_ms);
        if (timeout_ms > 0 && ns_wait) *ns_wait = td_now_ns() - t_wait;
        if (rc == TD_ETIMEDOUT) return 0;
        if (rc) return rc;
        if (in.kind == TD_CTRL_IN_REQUEST)
            handle_request(n, &in);
        else if (in.kind == TD_CTRL_IN_PEER_GONE)
            cancel_client(n, in.client_id);
        timeout_ms = 0;
    }
}
