/* dc_node.c: a decode rank's life: load, rendezvous, then the leader or follower loop;
 * on the leader, the control requests (Submit, Alloc, Cancel) and the transfers' events. */
#include "dc_node.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cpu_backend.h"
#include "ctrl.h"
#include "dc_plan.h"
#include "dc_sched.h"
#include "dc_shm.h"
#include "dc_xfer.h"
#include "gguf.h"
#include "kv_pool.h"
#include "kvx_conn.h"
#include "model.h"
#include "td_err.h"
#include "tokenizer.h"

#define IDLE_WAIT_MS       200  /* leader's inbox wait while nothing runs (liveness checks) */
#define XFER_WAIT_MS       2    /* ... while only KV transfers are in flight: react quickly */
#define DRAIN_MS           3000 /* after a failure: keep answering polls so errors get out */
#define STOP_DRAIN_MS      500  /* after SIGTERM with requests in flight: the same, shorter */
#define MAX_WAITING_FACTOR 4    /* queued requests beyond 4 x max_batch are refused (busy) */

/* Where a scheduler request came from: events go back to (client, request id). */
typedef struct {
    uint64_t client_id, request_id;
    uint32_t seq; /* next TokenEvent.seq */
    bool used;
    Td__ErrorCode err_code; /* the ErrorEvent of a FINISH_ERROR, when not the default */
    char err_msg[320];
} route;

typedef struct {
    const dc_node_params *p;
    const td_cfg_decode *dcfg;
    td_gguf *gguf;
    kn_model *model;
    kn_cpu *cpu;
    kn_engine *engine;
    kn_kv_pool *kv;
    dc_shm *shm;
    bool disagg;    /* the cluster has prefill instances: KV arrives through kvxfer */
    char token[32]; /* the instance's name token (shared-memory names) */
    /* leader only */
    dc_xfer *xfer;       /* disaggregated mode: the KV-transfer plane */
    void **peer_regions; /* (tp) rank r > 0: its pool region mapped here */
    size_t region_bytes;
    td_ctrl_server *srv;
    dc_sched *sched;
    route *routes; /* (n_routes) indexed by scheduler id */
    size_t n_routes;
    int64_t started_ms;
    uint64_t step;
    int64_t step_ns;     /* wall time of all steps */
    int64_t step_tokens; /* tokens of all steps */
    bool stopping;       /* SIGTERM: in-flight requests end with ERR_SHUTDOWN */
    bool draining;       /* after the loop: new requests are refused */
    bool load_changed;   /* an Alloc or a transfer event: publish the health now */
    float *logits;       /* (max_batch, n_vocab) */
} node;

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- setup ---- */

static int kv_blocks_of(const node *n)
{
    if (n->dcfg->kv_blocks > 0)
        return (int)(n->dcfg->kv_blocks > (1 << 30) ? 1 << 30 : n->dcfg->kv_blocks);
    kn_kv_pool_params kp = kn_model_kv_params(n->model, 1, n->dcfg->block_size,
                                              strcmp(n->dcfg->kv_dtype, "f32") ? TD_F16 : TD_F32);
    size_t es = kp.type == TD_F16 ? 2 : 4;
    size_t per_block = 2 * (size_t)kp.n_layers * (size_t)kp.n_kv_heads * (size_t)kp.block_size *
                       (size_t)kp.head_dim * es;
    int64_t nb = n->dcfg->kv_memory / (int64_t)per_block;
    return nb > (1 << 30) ? 1 << 30 : (int)nb;
}

static int setup(node *n)
{
    const dc_node_params *p = n->p;
    char err[512];
    int rc = td_gguf_open(p->cfg->model, &n->gguf, err, sizeof err);
    if (rc) {
        TD_LOG_ERR("decode %s rank %d: %s", p->instance, p->rank, err);
        return rc;
    }
    kn_shard shard = {.tp_rank = p->rank, .tp_size = n->dcfg->tp};
    if ((rc = kn_model_load(n->gguf, &shard, &n->model))) return rc;
    if ((rc = kn_cpu_create(n->dcfg->threads, &n->cpu))) return rc;
    int n_blocks = kv_blocks_of(n);
    if (n_blocks < 1) {
        TD_LOG_ERR("decode %s: kv_memory %lld bytes holds no block", p->instance,
                   (long long)n->dcfg->kv_memory);
        return TD_EINVAL;
    }
    td_dtype kv_type = strcmp(n->dcfg->kv_dtype, "f32") ? TD_F16 : TD_F32;
    kn_kv_pool_params kp = kn_model_kv_params(n->model, n_blocks, n->dcfg->block_size, kv_type);
    snprintf(n->token, sizeof n->token, "p%d", n->dcfg->port);
    /* disaggregated: the leader receives every rank's KV (dc_xfer.h), so a follower's pool
     * is shared memory the leader maps after the rendezvous (it is created before, so it
     * exists once the rendezvous completes) */
    n->disagg = p->cfg->n_prefill > 0;
    char shm_name[256];
    if (n->disagg && p->rank > 0) {
        dc_xfer_kv_shm_sweep(p->instance, n->token);
        if ((rc = dc_xfer_kv_shm_name(p->instance, n->token, p->rank, (int)getpid(), shm_name,
                                      sizeof shm_name)))
            return rc;
        kp.shm_name = shm_name;
    }
    if ((rc = kn_kv_pool_create(&kp, &n->kv))) return rc;

    int32_t max_ctx = n->model->hp.n_ctx_train;
    int bpseq = (max_ctx + n->dcfg->block_size - 1) / n->dcfg->block_size;
    /* a step holds the prefill budget plus one token per running request */
    int64_t max_step = (int64_t)n->dcfg->step_tokens + n->dcfg->max_batch;
    size_t max_plan =
        64 + (size_t)max_step * 12 + (size_t)n->dcfg->max_batch * (4 + (size_t)bpseq * 4);
    dc_shm_params sp = {
        .instance = p->instance,
        .token = n->token,
        .rank = p->rank,
        .tp = n->dcfg->tp,
        .max_floats = max_step * n->model->hp.n_embd,
        .max_plan = max_plan,
        .timeout_ms = p->cfg->kvxfer.timeout_ms,
        .interrupt = p->stop,
    };
    if ((rc = dc_shm_open(&sp, &n->shm))) return rc;
    kn_collective coll = dc_shm_collective(n->shm);
    if ((rc = kn_engine_create(n->model, kn_cpu_backend(n->cpu), &coll, &n->engine))) return rc;
    TD_LOG_INFO("decode %s rank %d/%d: %s layers, %d heads/%d kv heads local, %d kv blocks of %d "
                "(%s), %d threads",
                p->instance, p->rank, n->dcfg->tp, kn_arch_name(n->model->hp.arch),
                n->model->n_head_local, n->model->n_head_kv_local, n_blocks, n->dcfg->block_size,
                td_dtype_name(kv_type), kn_cpu_n_threads(n->cpu));
    return 0;
}

static void teardown(node *n)
{
    /* the connectors first: they have the pools registered */
    dc_xfer_destroy(n->xfer);
    for (int r = 1; n->peer_regions && r < n->dcfg->tp; r++)
        kn_kv_region_unmap(n->peer_regions[r], n->region_bytes);
    free(n->peer_regions);
    dc_sched_destroy(n->sched);
    td_ctrl_server_destroy(n->srv);
    free(n->routes);
    free(n->logits);
    kn_engine_destroy(n->engine);
    dc_shm_close(n->shm);
    kn_kv_pool_destroy(n->kv);
    kn_cpu_destroy(n->cpu);
    kn_model_destroy(n->model);
    td_gguf_close(n->gguf);
}

/* ---- follower ---- */

static int follower_loop(node *n)
{
    dc_plan_view v;
    dc_plan_view_init(&v);
    int rc = 0;
    while (!*n->p->stop) {
        const void *plan;
        size_t len;
        rc = dc_shm_plan_wait(n->shm, -1, &plan, &len);
        if (rc == DC_SHM_STOP || rc == DC_SHM_INTR) {
            rc = 0;
            break;
        }
        if (rc == TD_ETIMEDOUT) continue;
        if (rc) break;
        if ((rc = dc_plan_decode(plan, len, n->kv->block_size, n->kv->n_blocks, &v))) break;
        if (v.kind == DC_PLAN_SHUTDOWN) break;
        if ((rc = kn_engine_forward(n->engine, n->kv, &v.batch, NULL))) {
            TD_LOG_ERR("decode %s rank %d: step %llu failed: %s", n->p->instance, n->p->rank,
                       (unsigned long long)v.step, td_strerror(rc));
            break;
        }
    }
    dc_plan_view_fini(&v);
    return rc;
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

static void on_tokens(void *ctx, uint64_t id, const int32_t *ids, int n_ids, dc_finish finish,
                      int32_t n_prompt, int32_t n_gen)
{
    node *n = ctx;
    if (id >= n->n_routes || !n->routes[id].used) return;
    route *r = &n->routes[id];
    if (finish == DC_FINISH_ERROR) {
        if (r->err_code != TD__ERROR_CODE__ERR_NONE)
            td_ctrl_server_send_error(n->srv, r->client_id, r->request_id, r->err_code, "%s",
                                      r->err_msg);
        else if (n->stopping)
            td_ctrl_server_send_error(n->srv, r->client_id, r->request_id,
                                      TD__ERROR_CODE__ERR_SHUTDOWN,
                                      "decode instance %s is shutting down", n->p->instance);
        else
            td_ctrl_server_send_error(n->srv, r->client_id, r->request_id,
                                      TD__ERROR_CODE__ERR_INTERNAL,
                                      "request failed on decode instance %s", n->p->instance);
    }
    /* TD_ENOENT: the client is gone; the request is finishing or will be cancelled */
    td_ctrl_server_send_tokens(n->srv, r->client_id, r->request_id, r->seq++, ids, (size_t)n_ids,
                               wire_finish(finish), (uint32_t)n_prompt, (uint32_t)n_gen);
    if (finish != DC_FINISH_NONE) r->used = false;
}

/* ---- leader: requests in ---- */

static int64_t find_route(const node *n, uint64_t client, uint64_t request_id)
{
    for (size_t i = 0; i < n->n_routes; i++)
        if (n->routes[i].used && n->routes[i].client_id == client &&
            n->routes[i].request_id == request_id)
            return (int64_t)i;
    return -1;
}

static int64_t new_route(node *n, uint64_t client, uint64_t request_id)
{
    for (size_t i = 0; i < n->n_routes; i++)
        if (!n->routes[i].used) {
            n->routes[i] = (route){.client_id = client, .request_id = request_id, .used = true};
            return (int64_t)i;
        }
    size_t cap = n->n_routes ? 2 * n->n_routes : 64;
    route *r = realloc(n->routes, cap * sizeof *r);
    if (!r) return -1;
    memset(r + n->n_routes, 0, (cap - n->n_routes) * sizeof *r);
    n->routes = r;
    size_t i = n->n_routes;
    n->n_routes = cap;
    n->routes[i] = (route){.client_id = client, .request_id = request_id, .used = true};
    return (int64_t)i;
}

/* The scheduler's view of a Submit (also the request inside an Alloc). */
static dc_request_params request_params(const Td__Submit *s, uint64_t id)
{
    const Td__Sampling *sm = s->sampling;
    dc_request_params rp = {
        .id = id,
        .prompt = s->token_ids,
        .n_prompt = (int32_t)s->n_token_ids,
        .max_tokens = (int32_t)(s->max_tokens > INT32_MAX ? INT32_MAX : s->max_tokens),
        .stop_ids = s->stop_token_ids,
        .n_stop = (int)s->n_stop_token_ids,
        .ignore_eos = s->ignore_eos,
    };
    if (sm)
        rp.sampling = (kn_sampler_params){.temperature = sm->temperature,
                                          .top_k = sm->top_k,
                                          .top_p = sm->top_p,
                                          .min_p = sm->min_p,
                                          .repeat_penalty = sm->repeat_penalty,
                                          .repeat_last_n = sm->repeat_last_n,
                                          .seed = sm->seed};
    return rp;
}

/* Refuse a request the scheduler rejected (rc from dc_sched_submit*). */
static void reply_refused(node *n, td_ctrl_req *req, uint64_t request_id, int rc)
{
    Td__ErrorCode code = rc == TD_ENOSPC   ? TD__ERROR_CODE__ERR_NO_SPACE
                         : rc == TD_ENOMEM ? TD__ERROR_CODE__ERR_INTERNAL
                                           : TD__ERROR_CODE__ERR_INVALID;
    td_ctrl_server_reply_error(n->srv, req, request_id, code,
                               rc == TD_ENOSPC   ? "request can never fit this instance's KV pool "
                                                   "(%d blocks of %d tokens)"
                               : rc == TD_ERANGE ? "prompt too long or token id outside the "
                                                   "vocabulary (%d blocks of %d tokens)"
                                                 : "invalid request (%d blocks of %d tokens)",
                               n->kv->n_blocks, n->kv->block_size);
}

static void handle_submit(node *n, const td_ctrl_server_in *in)
{
    const Td__Submit *s = in->env->submit;
    if (find_route(n, in->client_id, s->request_id) >= 0) {
        /* the control layer re-sends a call whose connection dropped: the same (client,
         * request id) while it runs is that retry, answered like the first time */
        td_ctrl_server_reply_ack(n->srv, in->req, s->request_id);
        return;
    }
    if (n->draining) {
        td_ctrl_server_reply_error(n->srv, in->req, s->request_id, TD__ERROR_CODE__ERR_SHUTDOWN,
                                   "decode instance %s is shutting down", n->p->instance);
        return;
    }
    dc_sched_stats st = dc_sched_get_stats(n->sched);
    if (st.waiting >= MAX_WAITING_FACTOR * n->dcfg->max_batch) {
        td_ctrl_server_reply_error(n->srv, in->req, s->request_id, TD__ERROR_CODE__ERR_BUSY,
                                   "%d requests already waiting", st.waiting);
        return;
    }
    int64_t id = new_route(n, in->client_id, s->request_id);
    if (id < 0) {
        td_ctrl_server_reply_error(n->srv, in->req, s->request_id, TD__ERROR_CODE__ERR_INTERNAL,
                                   "out of memory");
        return;
    }
    dc_request_params rp = request_params(s, (uint64_t)id);
    int rc = dc_sched_submit(n->sched, &rp);
    if (rc) {
        n->routes[id].used = false;
        reply_refused(n, in->req, s->request_id, rc);
        return;
    }
    td_ctrl_server_reply_ack(n->srv, in->req, s->request_id);
}

/* Reply AllocReply with the transfer's targets (one per rank, rank order). */
static void reply_targets(node *n, td_ctrl_req *req, uint64_t request_id, uint64_t id)
{
    const uint8_t *const *tg;
    const size_t *len;
    if (dc_xfer_targets(n->xfer, id, &tg, &len)) {
        td_ctrl_server_reply_error(n->srv, req, request_id, TD__ERROR_CODE__ERR_INTERNAL,
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
    Td__Envelope env = TD__ENVELOPE__INIT;
    env.body_case = TD__ENVELOPE__BODY_ALLOC_REPLY;
    env.alloc_reply = &ar;
    td_ctrl_server_reply(n->srv, req, &env);
}

/* Alloc (disaggregated mode): reserve the prompt's blocks, make every rank's KV target and
 * answer them; the request waits TRANSFERRING until the prefill stages' KV is in. */
static void handle_alloc(node *n, const td_ctrl_server_in *in)
{
    const Td__Alloc *a = in->env->alloc;
    const Td__Submit *s = a->request; /* present: the decoder checks it */
    uint64_t rid = s->request_id;
    if (!n->xfer) {
        td_ctrl_server_reply_error(n->srv, in->req, rid, TD__ERROR_CODE__ERR_UNSUPPORTED,
                                   "decode instance %s runs in colocated mode (%s has no prefill "
                                   "instances)",
                                   n->p->instance, n->p->cfg->path);
        return;
    }
    int64_t id = find_route(n, in->client_id, rid);
    if (id >= 0) {
        /* a retry of the call (the control layer re-sends after a connection drop) */
        if (dc_xfer_live(n->xfer, (uint64_t)id))
            reply_targets(n, in->req, rid, (uint64_t)id);
        else
            td_ctrl_server_reply_error(n->srv, in->req, rid, TD__ERROR_CODE__ERR_DUPLICATE,
                                       "request %llu is already running", (unsigned long long)rid);
        return;
    }
    if (n->draining) {
        td_ctrl_server_reply_error(n->srv, in->req, rid, TD__ERROR_CODE__ERR_SHUTDOWN,
                                   "decode instance %s is shutting down", n->p->instance);
        return;
    }
    if (a->n_stages < 1 || a->n_stages > KVX_MAX_STAGES) {
        td_ctrl_server_reply_error(n->srv, in->req, rid, TD__ERROR_CODE__ERR_INVALID,
                                   "alloc: n_stages %u is not in 1..%d", a->n_stages,
                                   KVX_MAX_STAGES);
        return;
    }
    /* the kvxfer request id is the client's request id (the prefill side opens the same) */
    if (dc_xfer_kvx_live(n->xfer, rid)) {
        td_ctrl_server_reply_error(n->srv, in->req, rid, TD__ERROR_CODE__ERR_DUPLICATE,
                                   "request id %llu is already being transferred into %s (by "
                                   "another client)",
                                   (unsigned long long)rid, n->p->instance);
        return;
    }
    dc_sched_stats st = dc_sched_get_stats(n->sched);
    if (st.waiting + st.transferring >= MAX_WAITING_FACTOR * n->dcfg->max_batch) {
        td_ctrl_server_reply_error(n->srv, in->req, rid, TD__ERROR_CODE__ERR_BUSY,
                                   "%d requests already waiting and %d transferring", st.waiting,
                                   st.transferring);
        return;
    }
    if ((id = new_route(n, in->client_id, rid)) < 0) {
        td_ctrl_server_reply_error(n->srv, in->req, rid, TD__ERROR_CODE__ERR_INTERNAL,
                                   "out of memory");
        return;
    }
    dc_request_params rp = request_params(s, (uint64_t)id);
    const int32_t *blocks;
    int n_blocks;
    int rc = dc_sched_submit_transfer(n->sched, &rp, &blocks, &n_blocks);
    if (rc == TD_ESTATE) {
        n->routes[id].used = false;
        td_ctrl_server_reply_error(n->srv, in->req, rid, TD__ERROR_CODE__ERR_BUSY,
                                   "the KV pool cannot hold the prompt's %d blocks now (%d of %d "
                                   "free)",
                                   kn_kv_blocks_for(n->kv, rp.n_prompt), n->kv->n_free,
                                   n->kv->n_blocks);
        return;
    }
    if (rc) {
        n->routes[id].used = false;
        reply_refused(n, in->req, rid, rc);
        return;
    }
    rc = dc_xfer_start(n->xfer, (uint64_t)id, rid, a->n_stages, rp.n_prompt, blocks, n_blocks);
    if (rc) {
        /* no target went out: the blocks are safe to free; no event (the reply says it) */
        n->routes[id].used = false;
        dc_sched_transfer_end(n->sched, (uint64_t)id, DC_FINISH_ERROR);
        td_ctrl_server_reply_error(n->srv, in->req, rid, TD__ERROR_CODE__ERR_INTERNAL,
                                   "cannot make the KV targets: %s", td_strerror(rc));
        return;
    }
    reply_targets(n, in->req, rid, (uint64_t)id);
    n->load_changed = true; /* blocks are held now: a router picking instances sees it */
}

/* Cancel one request: a transfer in flight is aborted (its blocks are freed once kvxfer
 * says no writer can write any more), anything else goes through the scheduler. */
static int cancel_one(node *n, uint64_t id)
{
    if (n->xfer && dc_xfer_live(n->xfer, id))
        return dc_xfer_abort(n->xfer, id, DC_XFER_END_CANCELLED);
    return dc_sched_cancel(n->sched, id);
}

static void handle_request(node *n, const td_ctrl_server_in *in)
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
            td_ctrl_server_reply_error(n->srv, in->req, rid, TD__ERROR_CODE__ERR_NOT_FOUND,
                                       "no running request %llu", (unsigned long long)rid);
            return;
        }
        td_ctrl_server_reply_ack(n->srv, in->req, rid);
        return;
    }
    default:
        td_ctrl_server_reply_error(n->srv, in->req, 0, TD__ERROR_CODE__ERR_UNSUPPORTED,
                                   "decode instance %s does not handle %s", n->p->instance,
                                   td_ctrl_body_name(env->body_case));
        return;
    }
}

static void cancel_client(node *n, uint64_t client)
{
    for (size_t i = 0; i < n->n_routes; i++)
        if (n->routes[i].used && n->routes[i].client_id == client) cancel_one(n, i);
}

/* Apply the transfers' events to the scheduler: arrived KV joins the batch, failed and
 * cancelled transfers end (their blocks are safe to reuse now). */
static void poll_transfers(node *n)
{
    dc_xfer_event ev;
    while (n->xfer && dc_xfer_next(n->xfer, &ev) == 1) {
        n->load_changed = true;
        route *r = ev.key < n->n_routes ? &n->routes[ev.key] : NULL;
        if (ev.kind == DC_XFER_ARRIVED) {
            if (dc_sched_transfer_done(n->sched, ev.key, ev.first_token) != TD_EINVAL) continue;
            ev.why = DC_XFER_END_FAILED;
            snprintf(ev.msg, sizeof ev.msg,
                     "KV transfer from prefill: first token %d is outside the vocabulary",
                     ev.first_token);
        }
        if (ev.why == DC_XFER_END_CANCELLED) {
            dc_sched_transfer_end(n->sched, ev.key, DC_FINISH_CANCELLED);
            continue;
        }
        if (ev.why == DC_XFER_END_STOPPED) continue; /* the request ended already */
        if (r && r->used) {
            r->err_code = ev.why == DC_XFER_END_TIMEOUT ? TD__ERROR_CODE__ERR_TIMEOUT
                                                        : TD__ERROR_CODE__ERR_PEER_FAILED;
            snprintf(r->err_msg, sizeof r->err_msg, "%s", ev.msg);
        }
        dc_sched_transfer_end(n->sched, ev.key, DC_FINISH_ERROR);
    }
}

static void publish_health(node *n, bool ready)
{
    dc_sched_stats st = dc_sched_get_stats(n->sched);
    Td__Health h = TD__HEALTH__INIT;
    h.instance = (char *)n->p->instance;
    h.role = TD__ROLE__ROLE_DECODE;
    h.rank = 0;
    h.running = (uint32_t)st.running;
    h.waiting = (uint32_t)(st.waiting + st.transferring); /* admitted, not running yet */
    h.kv_blocks_used = (uint32_t)st.kv_blocks_used;
    h.kv_blocks_free = (uint32_t)st.kv_blocks_free;
    h.kv_block_size = (uint32_t)n->kv->block_size;
    h.uptime_ms = (uint64_t)(now_ms() - n->started_ms);
    h.ready = ready;
    td_ctrl_server_set_health(n->srv, &h);
}

/* Drain the inbox: wait up to timeout_ms for the first message, then take all pending. */
static int serve_inbox(node *n, int timeout_ms)
{
    for (;;) {
        td_ctrl_server_in in;
        int rc = td_ctrl_server_recv(n->srv, &in, timeout_ms);
        if (rc == TD_ETIMEDOUT) return 0;
        if (rc) return rc;
        if (in.kind == TD_CTRL_IN_REQUEST)
            handle_request(n, &in);
        else if (in.kind == TD_CTRL_IN_PEER_GONE)
            cancel_client(n, in.client_id);
        timeout_ms = 0;
    }
}

/* Disaggregated mode: map the followers' pools (their segments exist: they were created
 * before the rendezvous) and start the KV-transfer plane over every rank's pool. */
static int xfer_setup(node *n)
{
    int tp = n->dcfg->tp;
    kn_kv_pool_params kp =
        kn_model_kv_params(n->model, n->kv->n_blocks, n->kv->block_size, n->kv->type);
    n->region_bytes = n->kv->region_bytes;
    n->peer_regions = calloc((size_t)tp, sizeof *n->peer_regions);
    if (!n->peer_regions) return TD_ENOMEM;
    n->peer_regions[0] = n->kv->region;
    for (int r = 1; r < tp; r++) {
        char name[256];
        int rc = dc_xfer_kv_shm_name(n->p->instance, n->token, r, dc_shm_rank_pid(n->shm, r), name,
                                     sizeof name);
        kp.shm_name = name;
        size_t bytes = 0;
        /* unlink at once: from now on the memory lives exactly as long as its mappings */
        if (!rc) rc = kn_kv_region_map(&kp, true, &n->peer_regions[r], &bytes);
        if (rc) {
            TD_LOG_ERR("decode %s: cannot map rank %d's KV pool: %s", n->p->instance, r,
                       td_strerror(rc));
            return rc;
        }
    }
    const kn_hparams *hp = &n->model->hp;
    dc_xfer_params xp = {
        .instance = n->p->instance,
        .tp = tp,
        .regions = n->peer_regions,
        .region_bytes = n->region_bytes,
        .n_layers = (uint32_t)hp->n_layer,
        .n_kv_heads = (uint32_t)hp->n_head_kv,
        .head_dim = (uint32_t)hp->head_dim,
        .block_size = (uint32_t)n->kv->block_size,
        .dtype_size = n->kv->type == TD_F16 ? 2 : 4,
        .n_blocks = (uint32_t)n->kv->n_blocks,
        .tls = n->p->cfg->kvxfer.ucx_tls,
        .timeout_ms = n->p->cfg->kvxfer.timeout_ms,
    };
    return dc_xfer_create(&xp, &n->xfer);
}

static int leader_setup(node *n)
{
    int rc;
    td_tokenizer *tok = NULL;
    int32_t *eog = NULL;
    int n_eog = 0;
    /* end-of-generation ids come from the tokenizer metadata (absent: no EOG ids) */
    if (td_tok_create(n->gguf, &tok) == 0) {
        int32_t nv = td_tok_n_vocab(tok);
        eog = malloc((size_t)nv * sizeof *eog);
        for (int32_t i = 0; eog && i < nv; i++)
            if (td_tok_is_eog(tok, i)) eog[n_eog++] = i;
        td_tok_destroy(tok);
    }
    dc_sched_params sp = {.max_running = n->dcfg->max_batch,
                          .step_tokens = n->dcfg->step_tokens,
                          .eog_ids = eog,
                          .n_eog = n_eog};
    rc = dc_sched_create(&sp, n->model, n->kv, (dc_sink){.ctx = n, .on_tokens = on_tokens},
                         &n->sched);
    free(eog);
    if (rc) return rc;
    n->logits = malloc((size_t)n->dcfg->max_batch * (size_t)n->model->hp.n_vocab * sizeof(float));
    if (!n->logits) return TD_ENOMEM;
    td_ctrl_opts opts = {0};
    if ((rc = td_ctrl_server_create(&opts, &n->srv))) return rc;
    char url[256], bound[256];
    if (n->p->listen)
        snprintf(url, sizeof url, "%s", n->p->listen);
    else if ((rc = td_cfg_ctrl_url(n->dcfg->host, n->dcfg->port, url, sizeof url)))
        return rc;
    if ((rc = td_ctrl_server_listen(n->srv, url, bound, sizeof bound))) {
        TD_LOG_ERR("decode %s: cannot listen on %s: %s", n->p->instance, url, td_strerror(rc));
        return rc;
    }
    if (n->disagg && (rc = xfer_setup(n))) return rc;
    TD_LOG_INFO("decode %s: serving on %s%s", n->p->instance, bound,
                n->disagg ? " (disaggregated: Alloc and colocated Submit)" : "");
    return 0;
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int run_step(node *n)
{
    dc_step st;
    int k = dc_sched_plan(n->sched, &st);
    if (k <= 0) return k;
    int64_t t0 = now_ns();
    void *buf;
    size_t cap, len;
    int rc = dc_shm_plan_begin(n->shm, &buf, &cap);
    if (!rc) rc = dc_plan_encode(&st.batch, n->kv->block_size, n->step, buf, cap, &len);
    if (!rc) rc = dc_shm_plan_commit(n->shm, len);
    if (!rc) rc = kn_engine_forward(n->engine, n->kv, &st.batch, n->logits);
    n->step++;
    dc_sched_commit(n->sched, n->logits, rc);
    n->step_ns += now_ns() - t0;
    n->step_tokens += k;
    return rc ? rc : k;
}

static int leader_loop(node *n)
{
    int rc = leader_setup(n);
    if (rc) return rc;
    n->started_ms = now_ms();
    int64_t last_health = 0;
    int k = 0; /* tokens of the last step */
    while (!*n->p->stop) {
        /* no wait after a step that ran (there is more work); a short one while only KV
         * transfers are in flight (their completion is polled: react in ~2 ms, never
         * spin); a long one when idle */
        int pending = dc_xfer_pending(n->xfer);
        int wait = dc_sched_idle(n->sched) && !pending ? IDLE_WAIT_MS
                   : k > 0 || !pending                 ? 0
                                                       : XFER_WAIT_MS;
        if ((rc = serve_inbox(n, wait))) break;
        poll_transfers(n);
        if (n->load_changed || now_ms() - last_health >= 100) {
            publish_health(n, true);
            last_health = now_ms();
            n->load_changed = false;
        }
        k = 0;
        if (!dc_sched_idle(n->sched)) {
            if ((rc = run_step(n)) < 0) break;
            k = rc;
            rc = 0;
            if (dc_sched_idle(n->sched)) publish_health(n, true); /* the load dropped to 0 */
        }
        /* no step ran (idle, or only transfers): notice a dead rank now, not at the next
         * step */
        if (k == 0 && (rc = dc_shm_check(n->shm))) break;
    }
    n->draining = true;
    bool broken = false;
    if (rc && *n->p->stop) {
        /* `tandem down` signals every rank at once: a follower that stopped first is part
         * of the shutdown, not a failure */
        TD_LOG_INFO("decode %s: stopping (another rank stopped first: %s)", n->p->instance,
                    td_strerror(rc));
        rc = 0;
        broken = true;
    }
    if (rc) {
        TD_LOG_ERR("decode %s: stopping after a failure (%s); failing every request",
                   n->p->instance, td_strerror(rc));
        /* transfers are aborted (their writers stop) but their blocks are not waited for:
         * nothing is allocated any more (draining), and the process ends */
        dc_xfer_abort_all(n->xfer, DC_XFER_END_STOPPED);
        dc_sched_fail_all(n->sched);
        publish_health(n, false);
        /* keep answering polls for a moment so the error events reach their clients */
        int64_t until = now_ms() + DRAIN_MS;
        td_ctrl_server_stats ss;
        do {
            serve_inbox(n, 50);
            poll_transfers(n);
            td_ctrl_server_get_stats(n->srv, &ss);
        } while (now_ms() < until && ss.clients > 0);
        return rc;
    }
    if (!dc_sched_idle(n->sched)) {
        /* stopped with work in flight: end every request with a clear error and give the
         * events a moment to reach their clients (they long-poll, so ~ms) */
        dc_sched_stats st = dc_sched_get_stats(n->sched);
        TD_LOG_INFO("decode %s: stopping; %d running and %d waiting requests end with an error",
                    n->p->instance, st.running, st.waiting);
        n->stopping = true;
        dc_xfer_abort_all(n->xfer, DC_XFER_END_STOPPED);
        dc_sched_fail_all(n->sched);
        publish_health(n, false);
        int64_t until = now_ms() + STOP_DRAIN_MS;
        while (now_ms() < until) {
            serve_inbox(n, 50);
            poll_transfers(n);
        }
    }
    if (!broken) dc_shm_plan_stop(n->shm);
    /* the figures the decode benchmark reads (BENCHMARKS.md) */
    dc_shm_stats ss;
    dc_shm_get_stats(n->shm, &ss);
    dc_sched_stats st = dc_sched_get_stats(n->sched);
    TD_LOG_INFO("decode %s: %llu steps, %lld tokens, mean step %.3f ms, allreduce %llu x "
                "%.2f us (%.1f%% of step time), %llu preemptions",
                n->p->instance, (unsigned long long)n->step, (long long)n->step_tokens,
                n->step ? (double)n->step_ns / (double)n->step / 1e6 : 0.0,
                (unsigned long long)ss.n_allreduce,
                ss.n_allreduce ? (double)ss.ns_allreduce / (double)ss.n_allreduce / 1e3 : 0.0,
                n->step_ns ? 100.0 * (double)ss.ns_allreduce / (double)n->step_ns : 0.0,
                (unsigned long long)st.preemptions);
    if (n->xfer) {
        /* leak check of the tests: every transfer released on every rank */
        char per_rank[256] = "";
        size_t used = 0;
        for (int r = 0; r < n->dcfg->tp && used < sizeof per_rank; r++)
            used += (size_t)snprintf(per_rank + used, sizeof per_rank - used, "%s%d", r ? "," : "",
                                     dc_xfer_dec_requests(n->xfer, r));
        TD_LOG_INFO("decode %s: kvxfer: %d transfers alive, dec_requests %s", n->p->instance,
                    dc_xfer_pending(n->xfer), per_rank);
    }
    return 0;
}

int dc_node_run(const dc_node_params *p)
{
    node n = {.p = p};
    n.dcfg = td_cfg_find_decode(p->cfg, p->instance);
    if (!n.dcfg) {
        TD_LOG_ERR("no decode instance '%s' in %s", p->instance, p->cfg->path);
        return TD_EINVAL;
    }
    if (p->rank >= n.dcfg->tp) {
        TD_LOG_ERR("rank %d is outside decode instance %s (tp %d)", p->rank, p->instance,
                   n.dcfg->tp);
        return TD_EINVAL;
    }
    int rc = setup(&n);
    if (!rc) rc = p->rank == 0 ? leader_loop(&n) : follower_loop(&n);
    if (rc) TD_LOG_ERR("decode %s rank %d: exiting: %s", p->instance, p->rank, td_strerror(rc));
    teardown(&n);
    return rc;
}
