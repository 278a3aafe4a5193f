/* pf_stage.c: what every prefill stage does with a chunk: its requests on this stage (KV
 * blocks through pf_blocks.c, the kvxfer request), the forward pass over the stage's layers, the
 * last stage's first-token sampling, the KV push of each chunk to the decode ranks, and the reports
 * to stage 0. The chain that carries the chunks is pf_chain.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "pf_int.h"
#include "td_clock.h"
#include "td_err.h"
#include "td_grow.h"

/* ---- setup ---- */

static int open_connector(pf_stage *st)
{
    const td_cfg *cfg = st->p->cfg;
    kvx_pipe *pipe;
    /* a replica started from a template is at its --advertise host, not the template's */
    kvx_pipe_params pp = {.tls = cfg->kvxfer.ucx_tls,
                          .host = st->p->advertise ? st->p->advertise : st->cfg->hosts[st->stage]};
    int rc = kvx_pipe_ucx_create(&pp, &pipe);
    if (rc) return rc;
    kvx_conn_params cp = {.timeout_ms = st->timeout_ms, .progress_thread = true};
    if ((rc = kvx_conn_create(pipe, &cp, &st->kvx))) return rc;
    const kn_model *m = st->shard.rt.model;
    const kn_kv_pool *kv = st->shard.kv;
    kvx_layout lay = {
        .layer0 = (uint32_t)st->shard.l0,
        .n_layers = (uint32_t)(st->shard.l1 - st->shard.l0),
        .n_kv_heads = (uint32_t)m->hp.n_head_kv,
        .head0 = 0,
        .n_heads = (uint32_t)m->hp.n_head_kv,
        .block_size = (uint32_t)kv->block_size,
        .head_dim = (uint32_t)kv->head_dim,
        .dtype_size = kv->type == TD_F16 ? 2 : 4,
        .n_blocks = (uint32_t)kv->n_blocks,
        .n_slices = (uint32_t)kv->slicing.n_slices,   /* the pool's layout is the source's */
        .kv_arrays = (uint32_t)kn_kv_pool_arrays(kv), /* a latent pool's blocks go once */
    };
    for (int s = 0; s < kv->slicing.n_slices && kv->slicing.n_slices > 1; s++)
        lay.slice_heads[s] = (uint32_t)kv->slicing.slice_heads[s];
    /* a device pool's host staging copy: each chunk's blocks are downloaded there (forward) */
    return kvx_pf_register_source(st->kvx, kn_kv_xfer_region(kv), kv->region_bytes, &lay);
}

static int open_chain(pf_stage *st)
{
    size_t chunk_bytes = pf_wire_chunk_max_size(st->chunk_max, st->chunk_max, st->n_embd);
    size_t target_bytes = TD_CTRL_MAX_BLOB + 28 + 4 * PF_MAX_TARGETS;
    pf_chain_params cp = {.instance = st->p->instance,
                          .stage = st->stage,
                          .pp = st->pp,
                          .first = st->first,
                          .last = st->last,
                          .tls = st->p->cfg->kvxfer.ucx_tls,
                          .host = st->cfg->hosts[st->stage],
                          .msg_cap = chunk_bytes > target_bytes ? chunk_bytes : target_bytes,
                          .stop = st->p->stop};
    return pf_chain_init(&st->chain, &cp);
}

/* Last stage: the vocabulary trie for structured output (the first token obeys the grammar),
 * as the decode node builds it. A model without token strings serves without it. */
static int open_grammar(pf_stage *st)
{
    td_tokenizer *tok = NULL;
    if (td_tok_create(st->shard.rt.gguf, &tok)) {
        TD_LOG_WARN("prefill %s stage %d: no tokenizer: requests with a grammar will fail",
                    st->p->instance, st->stage);
        return 0;
    }
    int rc = 0;
    if (td_tok_n_vocab(tok) == st->n_vocab && (rc = gr_vocab_from_tok(tok, &st->gvocab)) == 0)
        rc = gr_cache_create(0, &st->grammars);
    td_tok_destroy(tok);
    return rc;
}

/* decode[].share_cores: pause this stage's compute while a decode step on its host runs
 * (common/td_coreshare.h). Hosts match by their YAML strings. CPU backends only. */
static int open_core_gate(pf_stage *st)
{
    const td_cfg *cfg = st->p->cfg;
    const char *host = st->cfg->hosts[st->stage];
    kn_cpu *c = kn_cpu_of(st->shard.rt.be);
    char(*names)[96] = calloc((size_t)cfg->n_decode, sizeof *names);
    const char **list = calloc((size_t)cfg->n_decode, sizeof *list);
    int n = 0, rc = names && list ? 0 : TD_ENOMEM;
    for (int i = 0; !rc && i < cfg->n_decode; i++) {
        const td_cfg_decode *d = &cfg->decode[i];
        if (!d->share_cores || strcmp(d->host, host)) continue;
        td_coreshare_name(d->port, names[n], sizeof names[n]);
        list[n] = names[n];
        n++;
    }
    if (!rc && n > 0 && c && !(rc = td_coreshare_gate_create(list, n, &st->cores))) {
        kn_pool_set_gate(kn_cpu_pool(c), td_coreshare_gate_wait, st->cores);
        TD_LOG_INFO("prefill %s stage %d: shares its cores with %d decode instance%s of host %s "
                    "(decode[].share_cores): its compute pauses while their steps run",
                    st->p->instance, st->stage, n, n > 1 ? "s" : "", host);
    }
    free(names);
    free(list);
    return rc;
}

int pf_stage_setup(pf_stage *st)
{
    const td_cfg *cfg = st->p->cfg;
    const td_cfg_decode *d0 = &cfg->decode[0]; /* every decode instance has the same KV shape */
    td_dtype kv_type = d0->kv_dtype;
    pf_shard_params sp = {
        .model_path = cfg->model,
        .pp = st->pp,
        .stage = st->stage,
        .partition = st->cfg->layer_partition,
        .threads = st->cfg->threads,
        .backend = td_cfg_backend_name(cfg->backend),
        .cpu_act = td_cfg_act_name(cfg->cpu_act),
        .devices = st->cfg->devices,
        .ctx = st->cfg->kv_tokens,
        .block_size = d0->block_size,
        .kv_type = kv_type,
        .cache_bytes = st->cfg->prefix_cache ? (size_t)st->cfg->prefix_cache_mb << 20 : 0,
    };
    char who[96];
    snprintf(who, sizeof who, "prefill %s stage %d", st->p->instance, st->stage);
    int rc = pf_stage_slicing(cfg, who, &sp.n_slices, sp.slice_heads);
    if (!rc) rc = pf_shard_open(&st->shard, &sp);
    if (rc) return rc;
    if (st->shard.cache_blocks > 0 &&
        (rc = pf_kvc_create(st->shard.mem, st->shard.cache_blocks, &st->kvc)))
        return rc;
    const kn_model *m = st->shard.rt.model;
    st->first = m->first;
    st->last = m->last;
    st->n_embd = m->hp.n_embd;
    st->n_vocab = m->hp.n_vocab;
    st->chunk_max = st->cfg->chunk_size > 0 ? st->cfg->chunk_size : PF_TUNE_AUTO_CAP;
    if (st->chunk_max > st->cfg->kv_tokens) st->chunk_max = st->cfg->kv_tokens;
    st->timeout_ms = cfg->kvxfer.timeout_ms;
    if ((rc = open_connector(st))) return rc;

    size_t C = (size_t)st->chunk_max;
    st->pos = malloc(C * sizeof *st->pos);
    st->seq_of = malloc(C * sizeof *st->seq_of);
    st->ids = malloc(C * sizeof *st->ids);
    if (!st->pos || !st->seq_of || !st->ids) return TD_ENOMEM;
    if (st->last && (rc = open_grammar(st))) return rc;
    if (st->last) {
        st->logit_cap = PF_MAX_SEGS;
        st->logits = malloc((size_t)PF_MAX_SEGS * (size_t)st->n_vocab * sizeof *st->logits);
        st->lrows = malloc((C + PF_MAX_SEGS) * sizeof *st->lrows);
        if (!st->logits || !st->lrows) return TD_ENOMEM;
    }
    if ((rc = open_chain(st))) return rc;
    if ((rc = open_core_gate(st))) return rc;
    const kn_kv_pool *kv = st->shard.kv;
    TD_LOG_INFO("prefill %s stage %d/%d: layers [%d, %d), %d threads, KV %d blocks of %d (%s, "
                "%d of them for the prefix cache, %d head slice%s), chunks up to %d tokens",
                st->p->instance, st->stage, st->pp, st->shard.l0, st->shard.l1, st->cfg->threads,
                kv->n_blocks, kv->block_size, td_dtype_name(kv->type), st->shard.cache_blocks,
                kv->slicing.n_slices, kv->slicing.n_slices > 1 ? "s" : "", st->chunk_max);
    return 0;
}

static void req_free(pf_stage *st, pf_req *r)
{
    pf_blocks_release(st, r, false);
    free(r->hit);
    free(r->hist);
    free(r->plp_row);
    free(r->comp_end_ns);
    free(r);
}

static void free_retired(pf_stage *st)
{
    while (st->retired) {
        pf_req *r = st->retired;
        st->retired = r->next;
        req_free(st, r);
    }
}

void pf_stage_teardown(pf_stage *st)
{
    pf_chain_close(&st->chain);
    kvx_conn_destroy(st->kvx); /* fails what is left; nothing writes into our pool after */
    while (st->reqs) {
        pf_req *r = st->reqs;
        st->reqs = r->next;
        req_free(st, r);
    }
    free_retired(st);
    pf_kvc_destroy(st->kvc);
    pf_chain_fini(&st->chain);
    free(st->pos);
    free(st->seq_of);
    free(st->ids);
    free(st->logits);
    free(st->lrows);
    free(st->reports);
    gr_cache_destroy(st->grammars);
    gr_vocab_destroy(st->gvocab);
    pf_lp_drop_all(st);
    pf_shard_close(&st->shard);
    if (st->cores) { /* after the pool that calls it */
        td_coreshare_gate_stats cs = td_coreshare_gate_get_stats(st->cores);
        TD_LOG_INFO("prefill %s stage %d: paused %llu times for decode steps, %.1f s in all",
                    st->p->instance, st->stage, (unsigned long long)cs.parks, cs.parked_ms / 1e3);
        td_coreshare_gate_destroy(st->cores);
    }
}

void pf_stage_leave_chain(pf_stage *st, int err)
{
    pf_stage_abort_all(st, err);
    pf_chain_close(&st->chain);
    st->epoch = 0;
    /* a new chain starts with empty caches on every stage (a restarted stage has none): what
     * the running requests still use goes back to the pool when they end */
    free_retired(st);
    for (pf_req *r = st->reqs; r; r = r->next) { /* no RELEASE comes for them: free at their end */
        if (r->n_hit && !r->unrefd) pf_kvc_unref(st->kvc, r->hit, r->n_hit);
        r->unrefd = r->released = true;
    }
    if (st->kvc) pf_kvc_flush(st->kvc);
}

/* ---- requests ---- */

static pf_req *find_req(pf_stage *st, uint64_t id)
{
    for (pf_req *r = st->reqs; r; r = r->next)
        if (r->id == id) return r;
    return NULL;
}

static void fail_req(pf_stage *st, pf_req *r, int err)
{
    if (r->failed) return;
    r->failed = true;
    r->fail_err = err ? err : TD_EIO;
    if (r->opened) kvx_pf_abort(st->kvx, r->id);
}

static pf_req *new_req(pf_stage *st, const pf_seg *g)
{
    pf_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->id = g->req_id;
    r->n_prompt = (int32_t)g->n_prompt;
    r->n_dst = g->n_dst;
    r->sampling = g->sampling;
    r->sampling.grammar = NULL; /* it points into the message: sampling reads the segment's */
    r->first_token = -1;
    kn_kv_seq_init(&r->kv);
    r->next = st->reqs;
    st->reqs = r;
    st->n_reqs++;
    return r;
}

/* Open the request on this stage: blocks for the whole prompt, the kvxfer request. */
static int open_req(pf_stage *st, pf_req *r, const pf_seg *g)
{
    int rc = pf_blocks_open(st, r, g);
    if (rc) return rc;
    kvx_pf_req_params kp = {.stage = (uint32_t)st->stage,
                            .src_rank = 0,
                            .src_tp = 1,
                            .n_dst = r->n_dst,
                            .timeout_ms = st->timeout_ms};
    if ((rc = kvx_pf_open(st->kvx, r->id, &kp))) return rc;
    r->opened = true;
    return 0;
}

void pf_stage_targets(pf_stage *st, uint64_t req_id, const uint8_t *const *t, const size_t *lens,
                      int n_t)
{
    pf_req *r = find_req(st, req_id);
    if (!r || r->failed || !r->opened) return;
    for (int i = 0; i < n_t; i++) {
        int rc = kvx_pf_add_target(st->kvx, req_id, t[i], lens[i]);
        if (rc) {
            TD_LOG_WARN("prefill %s stage %d: request %llu: KV target %d rejected: %s",
                        st->p->instance, st->stage, (unsigned long long)req_id, i, td_strerror(rc));
            fail_req(st, r, rc);
            return;
        }
    }
}

void pf_stage_abort(pf_stage *st, uint64_t req_id, int err)
{
    pf_req *r = find_req(st, req_id);
    if (r) fail_req(st, r, err);
}

void pf_stage_abort_all(pf_stage *st, int err)
{
    for (pf_req *r = st->reqs; r; r = r->next)
        fail_req(st, r, err);
}

/* ---- KV push and reports ---- */

/* Hand the chunks computed since the last call to the connector; finish the transfer
 * after the last one (the last stage once it sampled the first token). */
static void try_send_and_finish(pf_stage *st, pf_req *r)
{
    if (r->failed || !r->opened) return;
    if (r->n_sent < r->n_computed) {
        int rc = kvx_pf_send_chunk(st->kvx, r->id, r->n_chunks - 1, (uint32_t)r->n_sent,
                                   (uint32_t)r->n_computed, r->kv.blocks, (uint32_t)r->kv.n_blocks);
        if (rc == TD_ENOSPC) return; /* the lookup buffer is full: later */
        if (rc) {
            fail_req(st, r, rc);
            return;
        }
        r->n_sent = r->n_computed;
    }
    if (r->n_sent == r->n_prompt && !r->finished && (!st->last || r->first_token >= 0)) {
        kvx_meta meta = {.first_token = st->last ? r->first_token : -1,
                         .n_tokens = (uint32_t)r->n_prompt};
        int rc = kvx_pf_finish(st->kvx, r->id, &meta);
        if (rc)
            fail_req(st, r, rc);
        else
            r->finished = true;
    }
}

/* Stage 0 keeps its own reports for the leader's loop; others send them to stage 0. */
static void report_out(pf_stage *st, const pf_report *r)
{
    if (st->stage != 0) {
        pf_chain_report(&st->chain, r);
        return;
    }
    if (st->rep_head + st->n_reports == st->cap_reports) {
        if (st->rep_head) { /* slide the FIFO to the front first */
            memmove(st->reports, st->reports + st->rep_head,
                    (size_t)st->n_reports * sizeof *st->reports);
            st->rep_head = 0;
        } else if (TD_GROW_INT(st->reports, st->cap_reports, st->cap_reports + 1, 16)) {
            /* the job then ends at its deadline */
            TD_LOG_ERR("prefill %s: out of memory: report of request %llu dropped", st->p->instance,
                       (unsigned long long)r->req_id);
            return;
        }
    }
    st->reports[st->rep_head + st->n_reports++] = *r;
}

bool pf_stage_take_report(pf_stage *st, pf_report *out)
{
    if (!st->n_reports) return false;
    *out = st->reports[st->rep_head++];
    if (!--st->n_reports) st->rep_head = 0;
    return true;
}

static uint32_t us_of(int64_t ns)
{
    return ns <= 0 ? 0 : ns / 1000 > UINT32_MAX ? UINT32_MAX : (uint32_t)(ns / 1000);
}

/* One line per request (debug: one per chunk) about its KV transfer: how much of the
 * transfer time (from a chunk handed to kvxfer to its KV landed in every decode rank)
 * passed while this stage was still computing the request's later chunks, i.e. was hidden
 * behind compute. The chunk lines are what tests/prefill checks chunk-by-chunk transfer
 * with: chunk k landed before chunk k + 1's compute ended. Fills rep's KV figures (the
 * router's metrics): bytes, the union of the chunks' in-flight intervals [issued, landed]
 * (chunks are issued in order, so one sweep merges them), and the exposed tail from the
 * last chunk's compute end to the last landing. */
static void log_transfer(pf_stage *st, const pf_req *r, const kvx_pf_status *s, pf_report *rep)
{
    rep->kv_bytes = s->bytes;
    uint32_t nc = r->n_chunks < r->cap_chunks ? r->n_chunks : r->cap_chunks;
    if (!nc) return;
    int64_t last_end = r->comp_end_ns[nc - 1];
    double total = 0, hidden = 0;
    int64_t busy = 0, cover = 0, last_landed = 0; /* ns */
    for (uint32_t k = 0; k < nc; k++) {
        kvx_chunk_times t;
        if (kvx_pf_chunk_times(st->kvx, r->id, k, &t) || !t.landed_ns) continue;
        int64_t from = (int64_t)(t.issued_ns ? t.issued_ns : t.handed_ns),
                to = (int64_t)t.landed_ns;
        if (from < cover) from = cover;
        if (to > from) busy += to - from;
        if (to > cover) cover = to;
        if (to > last_landed) last_landed = to;
        double span = (double)(t.landed_ns - t.handed_ns);
        double before = (double)last_end - (double)t.handed_ns;
        total += span;
        hidden += before <= 0 ? 0 : before < span ? before : span;
        TD_LOG_DEBUG("prefill %s stage %d: request %llu chunk %u: computed %lld landed %lld "
                     "(handed %lld issued %lld ns)",
                     st->p->instance, st->stage, (unsigned long long)r->id, k,
                     (long long)r->comp_end_ns[k], (long long)t.landed_ns, (long long)t.handed_ns,
                     (long long)t.issued_ns);
    }
    TD_LOG_INFO("prefill %s stage %d: request %llu: KV of %d tokens in %u chunks, %.1f MiB in "
                "%llu puts (%.1f MiB staged); transfer %.1f ms, %.0f %% of it hidden behind "
                "compute",
                st->p->instance, st->stage, (unsigned long long)r->id, r->n_prompt, r->n_chunks,
                (double)s->bytes / (1 << 20), (unsigned long long)s->puts,
                (double)s->staged / (1 << 20), total / 1e6,
                total > 0 ? 100.0 * hidden / total : 0.0);
    rep->kv_xfer_us = us_of(busy);
    rep->kv_exposed_us = us_of(last_landed - last_end);
}

/* A request's KV transfer passed its deadline on this stage: say where the time went. The
 * deadline (kvxfer.timeout_ms, from the stage's first chunk) covers the compute of every
 * later chunk, so on a busy CPU a prompt can outlast it with every transfer on time. What
 * the connector took before it failed tells the two apart (n_sent, finished: a chunk
 * computed after the deadline is refused). */
static void log_deadline(pf_stage *st, const pf_req *r)
{
    char since[64] = "";
    if (r->n_chunks)
        snprintf(since, sizeof since, "; its first chunk here began %lld ms ago",
                 (long long)(td_now_ms() - r->t_first_ms));
    if (!r->finished)
        TD_LOG_WARN("prefill %s stage %d: request %llu: the KV transfer deadline "
                    "(kvxfer.timeout_ms %d) passed while this stage was still computing (%d of %d "
                    "tokens handed over%s): the deadline must cover the prompt's whole prefill",
                    st->p->instance, st->stage, (unsigned long long)r->id, st->timeout_ms,
                    r->n_sent, r->n_prompt, since);
    else
        TD_LOG_WARN("prefill %s stage %d: request %llu: the KV transfer deadline "
                    "(kvxfer.timeout_ms %d) passed after all %d tokens were computed and handed "
                    "over%s: the KV targets or the decode ranks were late",
                    st->p->instance, st->stage, (unsigned long long)r->id, st->timeout_ms,
                    r->n_prompt, since);
}

/* Is r over on this stage (its connector request final, or failed before it opened)?
 * Fills rep's outcome when it is. */
static bool req_over(pf_stage *st, pf_req *r, pf_report *rep)
{
    if (!r->opened) {
        rep->status = r->fail_err;
        return r->failed;
    }
    kvx_pf_status s;
    if (kvx_pf_poll(st->kvx, r->id, &s) || (s.state != KVX_REQ_DONE && s.state != KVX_REQ_FAILED))
        return false;
    if (s.state == KVX_REQ_FAILED) {
        if (s.reason == KVX_FAIL_TIMEOUT) log_deadline(st, r);
        rep->status = r->fail_err ? r->fail_err : s.err ? s.err : TD_EIO;
        rep->reason = (uint32_t)s.reason;
    } else
        log_transfer(st, r, &s, rep);
    kvx_pf_release(st->kvx, r->id);
    return true;
}

void pf_stage_poll(pf_stage *st)
{
    pf_req **pp = &st->reqs;
    while (*pp) {
        pf_req *r = *pp;
        try_send_and_finish(st, r);
        pf_report rep = {.epoch = st->epoch,
                         .req_id = r->id,
                         .stage = (uint32_t)st->stage,
                         .first_token = st->last ? r->first_token : -1,
                         .end_ms = td_now_ms(),
                         .has_lp = st->last && r->has_first_lp};
        if (rep.has_lp) rep.first_lp = r->first_lp;
        pf_stage_cache_stats(st, &rep.cache_hit_tokens, &rep.cache_evicted);
        if (!req_over(st, r, &rep)) {
            pp = &r->next;
            continue;
        }
        report_out(st, &rep);
        *pp = r->next;
        st->n_reqs--;
        if (st->kvc && !r->released) { /* its blocks wait for stage 0's RELEASE */
            r->ok = rep.status == 0;
            r->next = st->retired;
            st->retired = r;
        } else
            req_free(st, r); /* the connector is final: nothing reads our blocks any more */
    }
}

void pf_stage_release(pf_stage *st, uint64_t req_id, bool insert)
{
    for (pf_req **pp = &st->retired; *pp; pp = &(*pp)->next) {
        pf_req *r = *pp;
        if (r->id != req_id) continue;
        *pp = r->next;
        pf_blocks_release(st, r, insert && r->ok);
        req_free(st, r);
        return;
    }
    pf_req *r = find_req(st, req_id); /* still running here (stage 0 gave up on it) */
    if (!r) return;
    if (r->n_hit && !r->unrefd) pf_kvc_unref(st->kvc, r->hit, r->n_hit);
    r->unrefd = r->released = true;
}

/* ---- one chunk ---- */

/* One chunk's batch on this stage: its segments, their requests here, the rows. */
typedef struct {
    pf_seg *segs;
    int n_segs;
    pf_req *rq[PF_MAX_SEGS];    /* (n_segs) the segment's request, NULL if refused */
    bool was_live[PF_MAX_SEGS]; /* (n_segs) live when the chunk arrived (it has rows) */
    int64_t rows_in;            /* rows that arrived */
    int64_t rows;               /* rows computed here (live segments) */
    kn_seq_view views[PF_MAX_SEGS];
    int32_t *logit_rows;       /* last stage: the rows of the segments that end, and every row
                                  of the segments that want prompt logprobs (st->lrows) */
    int32_t srow[PF_MAX_SEGS]; /* (n_segs) the sampled logit row of a LAST segment, or -1 */
    int32_t prow[PF_MAX_SEGS]; /* (n_segs) the first of its rows' logit rows (prompt
                                  logprobs), or -1 */
    int n_views, n_logits;
} pf_batch;

/* Find or open each segment's request; segments whose request failed (or a duplicate
 * first chunk) become DEAD. Returns 0 or TD_ENOMEM. */
static int admit_segs(pf_stage *st, pf_batch *bt)
{
    bt->rows_in = 0;
    for (int i = 0; i < bt->n_segs; i++) {
        pf_seg *g = &bt->segs[i];
        bool live = bt->was_live[i] = !(g->flags & PF_SEG_DEAD);
        if (live) bt->rows_in += g->t1 - g->t0;
        pf_req *r = find_req(st, g->req_id);
        if (g->flags & PF_SEG_FIRST) {
            if (r) { /* a duplicate id would mix two prompts' KV: refuse the new one */
                g->flags |= PF_SEG_DEAD;
                bt->rq[i] = NULL;
                continue;
            }
            r = new_req(st, g);
            if (!r) return TD_ENOMEM;
            if (!live)
                fail_req(st, r, TD_EIO);
            else {
                int rc = open_req(st, r, g);
                if (rc) fail_req(st, r, rc);
            }
        } else if (r && !r->failed && (!live || (int32_t)g->t0 != r->n_computed)) {
            fail_req(st, r, live ? TD_EINVAL : TD_EIO);
        }
        if (!r || r->failed) g->flags |= PF_SEG_DEAD;
        bt->rq[i] = r;
    }
    return 0;
}

/* Drop the rows of segments that died on this stage from st->ids and embd (in place);
 * sets bt->rows. */
static void compact(pf_stage *st, pf_batch *bt, float *embd)
{
    int64_t src = 0, dst = 0;
    size_t E = (size_t)st->n_embd;
    int32_t *ids = st->ids;
    for (int i = 0; i < bt->n_segs; i++) {
        int64_t len = bt->segs[i].t1 - bt->segs[i].t0;
        if (!bt->was_live[i]) continue;
        if (!(bt->segs[i].flags & PF_SEG_DEAD)) {
            if (src != dst) {
                memmove(ids + dst, ids + src, (size_t)len * sizeof *ids);
                if (embd) memmove(embd + dst * E, embd + src * E, (size_t)len * E * sizeof *embd);
            }
            dst += len;
        }
        src += len;
    }
    bt->rows = dst;
}

/* The live segments' ids into their requests' prompt copies (hist). */
static void keep_ids(pf_stage *st, const pf_batch *bt)
{
    int64_t off = 0;
    for (int i = 0; i < bt->n_segs; i++) {
        const pf_seg *g = &bt->segs[i];
        if (g->flags & PF_SEG_DEAD) continue;
        if (bt->rq[i]->hist)
            memcpy(bt->rq[i]->hist + g->t0, st->ids + off,
                   (size_t)(g->t1 - g->t0) * sizeof *st->ids);
        off += g->t1 - g->t0;
    }
}

/* Positions, sequences and logit rows of the live segments. */
static void build_batch(pf_stage *st, pf_batch *bt)
{
    int64_t row = 0;
    bt->n_views = bt->n_logits = 0;
    bt->logit_rows = st->lrows;
    for (int i = 0; i < bt->n_segs; i++) {
        const pf_seg *g = &bt->segs[i];
        bt->srow[i] = bt->prow[i] = -1;
        if (g->flags & PF_SEG_DEAD) continue;
        /* prompt logprobs: every row's logits (the LAST segment's last row is sampled) */
        bool all = st->last && g->sampling.prompt_logprobs;
        if (all) bt->prow[i] = bt->n_logits;
        for (uint32_t t = g->t0; t < g->t1; t++, row++) {
            st->pos[row] = (int32_t)t;
            st->seq_of[row] = bt->n_views;
            if (all) bt->logit_rows[bt->n_logits++] = (int32_t)row;
        }
        bt->views[bt->n_views++] =
            (kn_seq_view){.block_table = bt->rq[i]->kv.blocks, .n_ctx = (int32_t)g->t1};
        if (st->last && (g->flags & PF_SEG_LAST)) {
            if (!all) bt->logit_rows[bt->n_logits++] = (int32_t)(row - 1);
            bt->srow[i] = bt->n_logits - 1;
        }
    }
}

/* A device pool: the blocks this chunk wrote, into the host copy kvxfer pushes from (a block
 * the previous chunk ended in again: its earlier positions are unchanged). */
static int download_kv(pf_stage *st, const pf_batch *bt)
{
    kn_kv_pool *kv = st->shard.kv;
    for (int i = 0; i < bt->n_segs; i++) {
        const pf_seg *g = &bt->segs[i];
        if (g->flags & PF_SEG_DEAD) continue;
        const int j0 = (int)(g->t0 / (uint32_t)kv->block_size), j1 = kn_kv_blocks_for(kv, g->t1);
        int rc = kn_kv_stage_download(kv, bt->rq[i]->kv.blocks + j0, j1 - j0);
        if (rc) return rc;
    }
    return 0;
}

/* The forward pass over the stage's layers into out; a failure fails every live segment. */
static void forward(pf_stage *st, pf_batch *bt, const float *embd, float *out)
{
    if (bt->rows <= 0) return;
    kn_batch b = {.n_tokens = bt->rows,
                  .tokens = st->first ? st->ids : NULL,
                  .embd = st->first ? NULL : embd,
                  .pos = st->pos,
                  .seq_of = st->seq_of,
                  .n_seqs = bt->n_views,
                  .seqs = bt->views,
                  .n_logits = bt->n_logits,
                  .logit_rows = bt->logit_rows};
    int rc = kn_engine_forward(st->shard.rt.engine, st->shard.kv, &b, out);
    if (!rc && st->shard.kv->host) rc = download_kv(st, bt);
    if (!rc) return;
    TD_LOG_ERR("prefill %s stage %d: forward of %lld tokens failed: %s", st->p->instance, st->stage,
               (long long)bt->rows, td_strerror(rc));
    for (int i = 0; i < bt->n_segs; i++)
        if (!(bt->segs[i].flags & PF_SEG_DEAD)) {
            fail_req(st, bt->rq[i], rc);
            bt->segs[i].flags |= PF_SEG_DEAD;
        }
    bt->rows = 0;
}

/* Account the chunk computed in [t0, t1] ms (t1_ns: its end) to the stage and its requests. */
static void record_compute(pf_stage *st, pf_batch *bt, int64_t t0, int64_t t1, int64_t t1_ns)
{
    st->n_chunks++;
    st->slow_chunk_ms *= 0.95;
    if ((double)(t1 - t0) > st->slow_chunk_ms) st->slow_chunk_ms = (double)(t1 - t0);
    for (int i = 0; i < bt->n_segs; i++) {
        const pf_seg *g = &bt->segs[i];
        if (g->flags & PF_SEG_DEAD) continue;
        pf_req *r = bt->rq[i];
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
                     st->p->instance, st->stage, (unsigned long long)r->id, g->chunk, g->t0, g->t1,
                     (long long)t1, (long long)(t1 - t0));
    }
}

/* The matcher of segment g's grammar at the document's start (a moved request: after the
 * tokens it generated before, the end of its prompt), or NULL with *rc set. */
static gr_matcher *first_matcher(pf_stage *st, const pf_req *r, const pf_seg *g, int *rc)
{
    gr_matcher *m = NULL;
    gr_grammar *gg = NULL;
    char err[256] = "";
    if (!st->gvocab) {
        *rc = TD_EUNSUPP;
        snprintf(err, sizeof err, "structured output needs the model's tokenizer");
    } else if (!(*rc = gr_cache_get(st->grammars, g->sampling.grammar_kind, g->sampling.grammar,
                                    &gg, err, sizeof err))) {
        *rc = gr_matcher_create(gg, st->gvocab, &m);
        gr_grammar_unref(gg);
        uint32_t n = g->sampling.skip_samples; /* a moved request's generated tokens */
        if (!*rc && (*rc = gr_matcher_accept_tokens(m, r->hist + r->n_prompt - n, n)))
            snprintf(err, sizeof err, "its %u generated tokens leave the grammar", n);
    }
    if (!*rc) return m;
    gr_matcher_destroy(m);
    TD_LOG_ERR("prefill %s: request %llu: grammar: %s", st->p->instance, (unsigned long long)r->id,
               err[0] ? err : td_strerror(*rc));
    return NULL;
}

/* The first token of a request whose prompt segment g ends, from its logits row (n_vocab):
 * the token id, or a negative td_err. A grammar's mask applies (structured output). */
static int32_t sample_first(pf_stage *st, pf_req *r, const pf_seg *g, const float *row)
{
    gr_matcher *m = NULL;
    const uint32_t *mask = NULL;
    int rc = 0;
    if (g->sampling.grammar_kind &&
        (!(m = first_matcher(st, r, g, &rc)) || (rc = gr_matcher_mask(m, &mask)))) {
        gr_matcher_destroy(m);
        return rc;
    }
    kn_sampler s;
    /* a moved request's sampler skips the draws made before it moved, and its prompt
     * ends with them: they are its generated tokens for the penalties */
    rc = kn_sampler_init(&s, &g->sampling, st->n_vocab);
    if (!rc) kn_sampler_set_mask(&s, mask);
    int32_t tok = rc ? rc : kn_sample(&s, row, r->hist, r->n_prompt, g->sampling.skip_samples);
    if (!rc) kn_sampler_fini(&s);
    gr_matcher_destroy(m);
    return tok;
}

/* Last stage: keep the prompt's ids for the repetition penalty, then sample the first
 * token of every segment that ends a prompt. */
static void sample_first_tokens(pf_stage *st, pf_batch *bt)
{
    size_t V = (size_t)st->n_vocab;
    for (int i = 0; i < bt->n_segs; i++) {
        const pf_seg *g = &bt->segs[i];
        if (g->flags & PF_SEG_DEAD) continue;
        pf_req *r = bt->rq[i];
        int rc = bt->prow[i] < 0 ? 0 : pf_lp_prompt(st, r, g, st->logits + (size_t)bt->prow[i] * V);
        if (rc) {
            TD_LOG_ERR("prefill %s: request %llu: prompt logprobs: %s", st->p->instance,
                       (unsigned long long)r->id, td_strerror(rc));
            fail_req(st, r, rc);
            continue;
        }
        if (!(g->flags & PF_SEG_LAST)) continue;
        int32_t tok = sample_first(st, r, g, st->logits + (size_t)bt->srow[i] * V);
        if (tok >= 0 && g->sampling.logprobs &&
            pf_lp_first(st, r, st->logits + (size_t)bt->srow[i] * V, tok))
            tok = TD_EINVAL;
        if (tok < 0)
            fail_req(st, r, tok);
        else
            r->first_token = tok;
    }
}

int pf_stage_chunk(pf_stage *st, pf_seg *segs, int n_segs, const int32_t *ids_in, float *embd)
{
    pf_batch bt = {.segs = segs, .n_segs = n_segs};
    int rc = admit_segs(st, &bt);
    if (rc) return rc;
    if (bt.rows_in > st->chunk_max) return TD_ERANGE;
    memcpy(st->ids, ids_in, (size_t)bt.rows_in * sizeof *st->ids);
    compact(st, &bt, embd);
    keep_ids(st, &bt);
    build_batch(st, &bt);
    if (bt.n_logits > st->logit_cap) { /* prompt logprobs: a logit row per token */
        float *l = realloc(st->logits, (size_t)bt.n_logits * (size_t)st->n_vocab * sizeof *l);
        if (!l) return TD_ENOMEM;
        st->logits = l;
        st->logit_cap = bt.n_logits;
    }

    /* the output goes straight into a send buffer (the last stage: the logits) */
    pf_buf *sb = NULL;
    float *out = st->logits;
    if (!st->last) {
        sb = pf_chain_free_send(&st->chain, st->timeout_ms);
        if (!sb) return TD_EIO;
        out = (float *)(sb->buf + pf_wire_chunk_payload_off(segs, n_segs, bt.rows));
    }
    double parked0 = 0;
    if (st->cores) {
        td_coreshare_gate_begin(st->cores); /* counted computing; a decode that (re)started */
        parked0 = td_coreshare_gate_get_stats(st->cores).parked_ms;
    }
    int64_t t0 = td_now_ms(), t0_ns = td_now_ns();
    forward(st, &bt, embd, out);
    int64_t t1 = td_now_ms(), t1_ns = td_now_ns();
    st->last_forward_ms = (double)(t1_ns - t0_ns) * 1e-6;
    /* the cost model learns the compute, not the pauses for decode steps */
    if (st->cores) {
        td_coreshare_gate_end(st->cores);
        st->last_forward_ms -= td_coreshare_gate_get_stats(st->cores).parked_ms - parked0;
    }
    record_compute(st, &bt, t0, t1, t1_ns);
    if (st->last) sample_first_tokens(st, &bt);
    for (int i = 0; i < n_segs; i++)
        if (!(segs[i].flags & PF_SEG_DEAD)) try_send_and_finish(st, bt.rq[i]);
    if (st->last) return 0;
    int64_t len = pf_wire_chunk_write(sb->buf, sb->cap, 0, segs, n_segs, st->ids, st->n_embd);
    if (len < 0) return (int)len;
    return pf_chain_post(&st->chain, sb, (size_t)len); /* stamps the hop's seq */
}

/* ---- stages > 0: the received stream ---- */

static int handle_msg(pf_stage *st, pf_buf *b)
{
    pf_msg m;
    int rc = pf_wire_parse(b->buf, b->op.len, st->n_embd, 1, st->chunk_max, &m);
    if (rc) return rc;
    switch (m.kind) {
    case PF_MSG_CHUNK:
        rc = pf_stage_chunk(st, m.segs, m.n_segs, m.ids, (float *)m.embd);
        break;
    case PF_MSG_TARGETS:
        pf_stage_targets(st, m.req_id, m.target, m.target_len, m.n_targets);
        rc = pf_chain_send_msg(&st->chain, b->buf, b->op.len);
        break;
    case PF_MSG_ABORT:
        pf_stage_abort(st, m.req_id, m.code ? m.code : TD_EIO);
        rc = pf_chain_send_msg(&st->chain, b->buf, b->op.len);
        break;
    case PF_MSG_RELEASE:
        pf_stage_release(st, m.req_id, m.code == 1);
        rc = pf_chain_send_msg(&st->chain, b->buf, b->op.len);
        break;
    default:
        rc = TD_EFORMAT;
    }
    pf_msg_fini(&m);
    return rc;
}

int pf_stage_recv(pf_stage *st)
{
    /* one message per call: the caller's loop keeps heartbeats and reports going while a
     * backlog of chunks waits (a stage that only computed would look silent to stage 0);
     * nothing new while forwarded messages still wait for a send buffer (order) */
    int rc = pf_chain_flush(&st->chain);
    if (rc) return rc;
    if (!pf_chain_queue_empty(&st->chain)) return 0;
    pf_buf *b;
    if ((rc = pf_chain_next(&st->chain, &b)) <= 0) return rc;
    rc = pf_chain_recv_done(&st->chain, b, handle_msg(st, b));
    return rc ? rc : 1;
}
