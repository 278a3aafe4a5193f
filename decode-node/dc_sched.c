/* dc_sched.c: continuous batching with chunked prefill and preemption (see dc_sched.h): the
 * request lists, admission (prefix cache, second tier, transfers), preemption, the step's plan
 * and layout. What a step's logits become is dc_sched_tokens.c's; the state both share is
 * dc_sched_int.h. */
#include <stdlib.h>
#include <string.h>

#include "dc_plan.h"
#include "dc_sched_int.h"
#include "td_err.h"
#include "td_grow.h"

static int list_push(dc_req_list *l, dc_req *r)
{
    int rc = TD_GROW_INT(l->v, l->cap, l->n + 1, 16);
    if (rc) return rc;
    l->v[l->n++] = r;
    return 0;
}

static int list_push_front(dc_req_list *l, dc_req *r)
{
    int rc = list_push(l, r);
    if (rc) return rc;
    memmove(l->v + 1, l->v, (size_t)(l->n - 1) * sizeof *l->v);
    l->v[0] = r;
    return 0;
}

void dcs_list_remove_at(dc_req_list *l, int i)
{
    memmove(l->v + i, l->v + i + 1, (size_t)(l->n - i - 1) * sizeof *l->v);
    l->n--;
}

void dcs_req_free(dc_sched *s, dc_req *r)
{
    if (s->p.spec.method == DC_SPEC_DRAFT && s->p.spec.proposer.drop)
        s->p.spec.proposer.drop(s->p.spec.proposer.ctx, r->id);
    kn_kv_seq_fini(s->mem, &r->seq);
    kn_sampler_fini(&r->smp);
    gr_matcher_destroy(r->gm);
    free(r->draft);
    free(r->tokens);
    free(r->stop_ids);
    free(r);
}

int dc_sched_create(const dc_sched_params *p, const kn_model *m, kn_kv_mem *mem, dc_sink sink,
                    dc_sched **out)
{
    *out = NULL;
    dc_sched *s = calloc(1, sizeof *s);
    if (!s) return TD_ENOMEM;
    s->p = *p;
    if (s->p.max_running <= 0) s->p.max_running = 64;
    if (s->p.step_tokens <= 0) s->p.step_tokens = 256;
    if (s->p.max_ctx <= 0) s->p.max_ctx = m->hp.n_ctx_train;

    dc_spec_params *sp = &s->p.spec;
    if (sp->max_tokens <= 0) sp->max_tokens = 8;
    if (sp->ngram_min <= 0) sp->ngram_min = 2;
    if (sp->ngram_max <= 0) sp->ngram_max = sp->ngram_min > 4 ? sp->ngram_min : 4;
    if (sp->max_tokens > DC_SPEC_MAX_TOKENS || sp->ngram_max < sp->ngram_min ||
        (sp->method != DC_SPEC_OFF && sp->method != DC_SPEC_NGRAM && sp->method != DC_SPEC_DRAFT) ||
        (sp->method == DC_SPEC_DRAFT && !sp->proposer.propose) ||
        (sp->method == DC_SPEC_DRAFT && sp->proposer.n_hidden > 0 && !sp->proposer.computed)) {
        TD_LOG_ERR("speculative decoding: bad parameters (method %d, max_tokens %d, ngram "
                   "%d..%d)",
                   (int)sp->method, sp->max_tokens, sp->ngram_min, sp->ngram_max);
        dc_sched_destroy(s);
        return TD_EINVAL;
    }
    int spec_k = sp->method == DC_SPEC_OFF ? 0 : sp->max_tokens;

    s->m = m;
    s->mem = mem;
    s->kv = kn_kv_mem_pool(mem);
    dc_cost_init(&s->cost, &m->hp);
    dc_spec_gate_init(&s->gate, sp->method != DC_SPEC_OFF && !sp->pinned && sp->gate);
    s->sink = sink;
    /* prefill budget + one per decode and its proposals */
    s->cap_tokens = s->p.step_tokens + s->p.max_running * (1 + spec_k);
    s->cap_seqs = s->p.max_running;
    s->eog = malloc((size_t)(p->n_eog ? p->n_eog : 1) * sizeof *s->eog);
    s->tok = malloc((size_t)s->cap_tokens * sizeof *s->tok);
    s->pos = malloc((size_t)s->cap_tokens * sizeof *s->pos);
    s->seq_of = malloc((size_t)s->cap_tokens * sizeof *s->seq_of);
    s->rows = malloc((size_t)s->cap_tokens * sizeof *s->rows); /* prompt logprobs: a row each */
    s->views = malloc((size_t)s->cap_seqs * sizeof *s->views);
    s->in_step = malloc((size_t)s->cap_seqs * sizeof *s->in_step);
    s->emit = malloc((size_t)(1 + spec_k) * sizeof *s->emit);
    s->emit_lp = malloc((size_t)(1 + spec_k) * sizeof *s->emit_lp);
    s->cands = malloc((size_t)s->cap_seqs * sizeof *s->cands);
    s->cand_req = malloc((size_t)s->cap_seqs * sizeof *s->cand_req);
    size_t ns = (size_t)s->cap_seqs;
    bool pr = sp->method == DC_SPEC_DRAFT;
    if (pr) {
        s->pr_ids = malloc(ns * sizeof *s->pr_ids);
        s->pr_toks = malloc(ns * sizeof *s->pr_toks);
        s->pr_ntok = malloc(ns * sizeof *s->pr_ntok);
        s->pr_out = malloc(ns * sizeof *s->pr_out);
        s->pr_k = malloc(ns * sizeof *s->pr_k);
        s->pr_nout = malloc(ns * sizeof *s->pr_nout);
        if (sp->proposer.n_hidden > 0)
            s->hid = malloc((size_t)s->cap_tokens * (size_t)sp->proposer.n_hidden * sizeof *s->hid);
    }
    if (!s->eog || !s->tok || !s->pos || !s->seq_of || !s->rows || !s->views || !s->in_step ||
        !s->emit || !s->emit_lp || !s->cands || !s->cand_req ||
        (pr && (!s->pr_ids || !s->pr_toks || !s->pr_ntok || !s->pr_out || !s->pr_k || !s->pr_nout ||
                (sp->proposer.n_hidden > 0 && !s->hid)))) {
        dc_sched_destroy(s);
        return TD_ENOMEM;
    }
    if (p->n_eog) memcpy(s->eog, p->eog_ids, (size_t)p->n_eog * sizeof *s->eog);
    s->p.eog_ids = s->eog;
    if (s->p.tier_blocks_per_step <= 0) s->p.tier_blocks_per_step = 32;
    int rc = p->prefix_cache ? kn_kv_mem_add_cache(mem) : 0;
    if (rc) TD_LOG_ERR("cannot create the prefix cache: %s", td_strerror(rc));
    if (!rc && p->tier.bytes && !p->prefix_cache) {
        TD_LOG_ERR("a prefix cache tier needs the prefix cache");
        rc = TD_EINVAL;
    }
    if (!rc && p->tier.bytes) rc = kn_kv_mem_add_tier(mem, &p->tier);
    s->cache = kn_kv_mem_cache(mem);
    s->tier = kn_kv_mem_tier(mem);
    if (rc) {
        dc_sched_destroy(s);
        return rc;
    }
    s->p.tier.path = NULL; /* borrowed for create only */
    *out = s;
    return 0;
}

void dc_sched_destroy(dc_sched *s)
{
    if (!s) return;
    for (int i = 0; i < s->waiting.n; i++)
        dcs_req_free(s, s->waiting.v[i]);
    for (int i = 0; i < s->running.n; i++)
        dcs_req_free(s, s->running.v[i]);
    for (int i = 0; i < s->xfer.n; i++)
        dcs_req_free(s, s->xfer.v[i]);
    free(s->waiting.v);
    free(s->running.v);
    free(s->xfer.v);
    free(s->eog);
    free(s->tok);
    free(s->pos);
    free(s->seq_of);
    free(s->rows);
    free(s->views);
    free(s->in_step);
    free(s->emit);
    free(s->emit_lp);
    free(s->cands);
    free(s->cand_req);
    free(s->pr_ids);
    free(s->pr_toks);
    free(s->pr_ntok);
    free(s->pr_out);
    free(s->hid);
    free(s->pr_k);
    free(s->pr_nout);
    free(s);
}

static dc_req *find(dc_sched *s, uint64_t id, dc_req_list **list, int *idx)
{
    dc_req_list *ls[3] = {&s->waiting, &s->running, &s->xfer};
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < ls[k]->n; i++)
            if (ls[k]->v[i]->id == id) {
                if (list) *list = ls[k];
                if (idx) *idx = i;
                return ls[k]->v[i];
            }
    return NULL;
}

/* The checks every new request passes (dc_sched_submit's error contract). */
static int check_params(dc_sched *s, const dc_request_params *p)
{
    if (p->n_prompt < 1 || p->max_tokens < 1 || p->n_stop < 0 || (p->n_stop && !p->stop_ids)) {
        TD_LOG_ERR("req %llu: empty prompt, max tokens < 1 or bad stop list",
                   (unsigned long long)p->id);
        return TD_EINVAL;
    }
    if (p->sampling.skip_samples >= (uint32_t)p->n_prompt) {
        TD_LOG_ERR("req %llu: skip_samples %u of a %d-token prompt", (unsigned long long)p->id,
                   p->sampling.skip_samples, p->n_prompt);
        return TD_EINVAL;
    }
    if (find(s, p->id, NULL, NULL)) {
        TD_LOG_ERR("req %llu: id already in use", (unsigned long long)p->id);
        return TD_EINVAL;
    }
    if (p->sampling.grammar_kind && (!s->p.vocab || !s->p.grammars)) {
        TD_LOG_ERR("req %llu: structured output without the model's vocabulary",
                   (unsigned long long)p->id);
        return TD_EUNSUPP;
    }
    if (p->n_prompt >= s->p.max_ctx) {
        TD_LOG_ERR("req %llu: prompt of %d tokens does not fit the context (%d)",
                   (unsigned long long)p->id, p->n_prompt, s->p.max_ctx);
        return TD_ERANGE;
    }
    for (int32_t i = 0; i < p->n_prompt; i++)
        if (p->prompt[i] < 0 || p->prompt[i] >= s->m->hp.n_vocab) {
            TD_LOG_ERR("req %llu: token %d of the prompt (%d) is outside the vocabulary",
                       (unsigned long long)p->id, i, p->prompt[i]);
            return TD_ERANGE;
        }
    int64_t most = (int64_t)p->n_prompt + p->max_tokens;
    if (most > s->p.max_ctx) most = s->p.max_ctx;
    if (kn_kv_blocks_for(s->kv, most) > s->kv->n_blocks) {
        TD_LOG_ERR("req %llu: %lld tokens need %d KV blocks; the pool has %d",
                   (unsigned long long)p->id, (long long)most, kn_kv_blocks_for(s->kv, most),
                   s->kv->n_blocks);
        return TD_ENOSPC;
    }
    return 0;
}

/* The matcher of a request with a grammar, fed the tokens it generated before it moved
 * (the last skip_samples of its prompt). */
static int req_grammar(dc_sched *s, const dc_request_params *p, dc_req *r)
{
    if (!p->sampling.grammar_kind) return 0;
    char err[256];
    gr_grammar *g = NULL;
    int rc = gr_cache_get(s->p.grammars, p->sampling.grammar_kind, p->sampling.grammar, &g, err,
                          sizeof err);
    if (rc) {
        TD_LOG_ERR("req %llu: grammar: %s", (unsigned long long)p->id, err);
        return rc == TD_ENOMEM ? rc : TD_EINVAL;
    }
    rc = gr_matcher_create(g, s->p.vocab, &r->gm);
    gr_grammar_unref(g);
    if (rc) return rc;
    int32_t from = p->n_prompt - (int32_t)p->sampling.skip_samples;
    if ((rc = gr_matcher_accept_tokens(r->gm, p->prompt + from, p->n_prompt - from))) {
        TD_LOG_ERR("req %llu: its %u generated tokens leave the grammar", (unsigned long long)p->id,
                   p->sampling.skip_samples);
        return TD_EINVAL;
    }
    return 0;
}

/* A new request record (checked parameters), holding no blocks. */
static int req_new(dc_sched *s, const dc_request_params *p, dc_req **out)
{
    int64_t most = (int64_t)p->n_prompt + p->max_tokens;
    if (most > s->p.max_ctx) most = s->p.max_ctx;
    dc_req *r = calloc(1, sizeof *r);
    if (!r) return TD_ENOMEM;
    r->id = p->id;
    r->cap = (int32_t)most + 1;
    r->tokens = malloc((size_t)r->cap * sizeof *r->tokens);
    r->stop_ids = malloc((size_t)(p->n_stop ? p->n_stop : 1) * sizeof *r->stop_ids);
    if (s->p.spec.method != DC_SPEC_OFF)
        r->draft = malloc((size_t)s->p.spec.max_tokens * sizeof *r->draft);
    int rc = (!r->tokens || !r->stop_ids || (s->p.spec.method != DC_SPEC_OFF && !r->draft))
                 ? TD_ENOMEM
                 : 0;
    /* a moved request's sampler skips the draws made before it moved */
    if (!rc) rc = kn_sampler_init(&r->smp, &p->sampling, s->m->hp.n_vocab);
    if (!rc) kn_sampler_set_pool(&r->smp, s->p.sample_pool);
    if (!rc) rc = req_grammar(s, p, r);
    if (rc) {
        gr_matcher_destroy(r->gm);
        kn_sampler_fini(&r->smp);
        free(r->draft);
        free(r->tokens);
        free(r->stop_ids);
        free(r);
        return rc;
    }
    memcpy(r->tokens, p->prompt, (size_t)p->n_prompt * sizeof *r->tokens);
    if (p->n_stop) memcpy(r->stop_ids, p->stop_ids, (size_t)p->n_stop * sizeof *r->stop_ids);
    r->n_tokens = r->n_prompt = p->n_prompt;
    r->out_from = p->n_prompt - (int32_t)p->sampling.skip_samples;
    r->n_stop = p->n_stop;
    r->max_tokens = p->max_tokens;
    r->ignore_eos = p->ignore_eos;
    r->logit_row = -1;
    r->plp_next = p->sampling.prompt_logprobs ? 1 : p->n_prompt;
    dc_spec_req_init(&r->spec);
    kn_kv_seq_init(&r->seq);
    *out = r;
    return 0;
}

int dc_sched_submit(dc_sched *s, const dc_request_params *p)
{
    int rc = check_params(s, p);
    dc_req *r = NULL;
    if (!rc) rc = req_new(s, p, &r);
    if (!rc && (rc = list_push(&s->waiting, r))) dcs_req_free(s, r);
    return rc;
}

/* Blocks the running requests still need to finish their prompts (promised capacity). */
static int promised_blocks(const dc_sched *s);
static int pc_match(dc_sched *s, dc_req *r, bool *wait);

int dc_sched_submit_transfer(dc_sched *s, const dc_request_params *p, const int32_t **blocks,
                             int *n_blocks, int32_t *n_cached)
{
    dc_req *r = NULL;
    int rc = check_params(s, p);
    if (!rc) rc = req_new(s, p, &r);
    if (rc) return rc;
    /* the cached prefix (the tier's within the step's copy budget, never waiting for more)
     * is shared, not transferred; blocks promised to running prompts stay theirs */
    bool wait;
    int m = pc_match(s, r, &wait), need = kn_kv_blocks_for(s->kv, p->n_prompt) - m;
    if (kn_kv_available(s->mem) - promised_blocks(s) < need) rc = TD_ESTATE;
    if (!rc) rc = kn_kv_seq_reserve(s->mem, &r->seq, p->n_prompt);
    if (!rc) rc = list_push(&s->xfer, r);
    if (rc) {
        dcs_req_free(s, r); /* drops the matched blocks' references */
        return rc == TD_ENOSPC ? TD_ESTATE : rc;
    }
    s->pc_queried += s->cache ? (uint64_t)p->n_prompt : 0;
    s->pc_hits += (uint64_t)r->n_computed;
    if (s->cache)
        s->tier_hits +=
            (uint64_t)kn_kv_seq_claim_restored(s->mem, &r->seq) * (uint64_t)s->kv->block_size;
    r->n_cached = r->n_computed;
    r->admitted_once = true; /* usage keeps this figure if it is preempted later */
    *blocks = r->seq.blocks;
    *n_blocks = r->seq.n_blocks;
    *n_cached = r->n_cached;
    return 0;
}

int dc_sched_cancel(dc_sched *s, uint64_t id)
{
    dc_req *r = find(s, id, NULL, NULL);
    if (!r) return TD_ENOENT;
    r->cancelled = true;
    return 0;
}

void dcs_finish(dc_sched *s, dc_req_list *l, int i, dc_finish why)
{
    dc_req *r = l->v[i];
    dcs_list_remove_at(l, i);
    if (s->sink.on_tokens)
        s->sink.on_tokens(s->sink.ctx, r->id, NULL, 0, NULL, why, r->n_prompt, r->n_generated,
                          r->n_cached);
    dcs_req_free(s, r);
}

/* Move running request i back to the front of the waiting list, freeing its KV. */
static void preempt(dc_sched *s, int i)
{
    dc_req *r = s->running.v[i];
    TD_LOG_INFO("req %llu: preempted (kv pool full); %d tokens will be recomputed",
                (unsigned long long)r->id, r->n_computed);
    dcs_list_remove_at(&s->running, i);
    kn_kv_seq_release(s->mem, &r->seq); /* cached blocks stay cached: a re-admission finds them */
    r->n_computed = 0;
    r->chunk = 0;
    r->n_draft = 0;
    if (s->p.spec.method == DC_SPEC_DRAFT && s->p.spec.proposer.drop)
        s->p.spec.proposer.drop(s->p.spec.proposer.ctx, r->id);
    s->preemptions++;
    if (list_push_front(&s->waiting, r)) {
        /* cannot fail: the waiting list had room for it before it was admitted... but a
         * realloc may; then the request ends with an error rather than leaking */
        if (s->sink.on_tokens)
            s->sink.on_tokens(s->sink.ctx, r->id, NULL, 0, NULL, DC_FINISH_ERROR, r->n_prompt,
                              r->n_generated, r->n_cached);
        dcs_req_free(s, r);
    }
}

static int newest_running(const dc_sched *s)
{
    int best = -1;
    for (int i = 0; i < s->running.n; i++)
        if (best < 0 || s->running.v[i]->admitted > s->running.v[best]->admitted) best = i;
    return best;
}

/* Reserve KV for r's next `chunk` tokens, preempting newer requests when the pool is
 * full. Returns false if r itself had to be preempted (it is then no longer running). */
static bool reserve_or_preempt(dc_sched *s, dc_req *r, int32_t chunk)
{
    for (;;) {
        if (kn_kv_seq_reserve(s->mem, &r->seq, r->n_computed + chunk) == 0) return true;
        int victim = newest_running(s);
        bool self = s->running.v[victim] == r;
        /* a victim already in this step gives back its blocks and leaves the step */
        preempt(s, victim);
        if (self) return false;
    }
}

/* Prefix cache, at admission and Alloc: share r's cached leading whole blocks (never the last
 * token's: its logits are needed, and a shared block is never written) and compute after
 * them; blocks only the second tier holds are copied back first, within the step's copy
 * budget and the unpromised room. Prompt logprobs match nothing. Returns the blocks matched;
 * *wait: the copy budget ran out first (r waits a step rather than compute them). */
static int pc_match(dc_sched *s, dc_req *r, bool *wait)
{
    *wait = false;
    int most = (r->n_tokens - 1) / s->kv->block_size;
    if (!s->cache || r->plp_next < r->n_prompt || most < 1 || r->seq.n_blocks) return 0;
    int room = kn_kv_available(s->mem) - promised_blocks(s);
    kn_kv_tier_budget tb = {.copies_left = s->tier_left < room ? s->tier_left : room};
    int m = kn_kv_seq_match(s->mem, &r->seq, r->tokens, r->n_tokens, most, &tb);
    if (m < 0) return 0; /* no memory for the table: compute it all */
    s->tier_left -= tb.copied;
    *wait = tb.more && s->tier_left <= 0; /* not for want of room: that may never come */
    r->n_computed = m * s->kv->block_size;
    return m;
}

/* Prefix cache: whether r should wait for a running request that is computing r's next
 * whole block (a common prefix submitted at once: n>1 choices, a burst of the same system
 * prompt), so that r shares it a step later instead of computing it too. */
static bool pc_defer(const dc_sched *s, const dc_req *r, int m)
{
    int64_t want = (int64_t)(m + 1) * s->kv->block_size; /* tokens through r's next block */
    if (!s->cache || r->plp_next < r->n_prompt || want > r->n_tokens - 1) return false;
    for (int i = 0; i < s->running.n; i++) {
        const dc_req *q = s->running.v[i];
        if (q->n_computed < want && q->n_tokens >= want && q->seq.chain.serial &&
            !memcmp(q->tokens, r->tokens, (size_t)want * sizeof *r->tokens))
            return true;
    }
    return false;
}

/* Undo pc_match (admission did not happen). */
static void pc_unmatch(dc_sched *s, dc_req *r)
{
    kn_kv_seq_release(s->mem, &r->seq);
    r->n_computed = 0;
}

/* Prefix cache: enter r's whole blocks whose KV is now computed. */
void dcs_pc_insert(dc_sched *s, dc_req *r)
{
    kn_kv_seq_commit(s->mem, &r->seq, r->tokens, r->n_computed);
}

static int promised_blocks(const dc_sched *s)
{
    int n = 0;
    for (int i = 0; i < s->running.n; i++) {
        const dc_req *r = s->running.v[i];
        int need = kn_kv_blocks_for(s->kv, r->n_tokens + 1) - r->seq.n_blocks;
        if (need > 0) n += need;
    }
    return n;
}

/* p.itl_target_ms: cut a prefill chunk of a step with decodes to the time the step has left;
 * the step's first chunk keeps min(DC_SCHED_MIN_PREFILL, chunk) so prompts always progress. */
static int32_t cap_chunk(dc_sched *s, int32_t pos0, int32_t chunk)
{
    if (!s->capping) return chunk;
    int32_t n = dc_cost_fit_chunk(&s->cost, s->ms_left, pos0, chunk);
    int32_t least = chunk < DC_SCHED_MIN_PREFILL ? chunk : DC_SCHED_MIN_PREFILL;
    if (!s->prefill_planned && n < least) n = least;
    s->ms_left -= dc_cost_chunk_ms(&s->cost, pos0, n);
    s->prefill_planned |= n > 0;
    s->capped |= n < chunk;
    return n;
}

/* Arrived transfers join the running batch (oldest first) while it has room: they hold
 * their prompt's KV already, so they go before waiting requests. */
void dcs_admit_arrived(dc_sched *s)
{
    for (int i = 0; i < s->xfer.n && s->running.n < s->p.max_running;) {
        dc_req *r = s->xfer.v[i];
        if (!r->arrived || r->cancelled || list_push(&s->running, r)) {
            i++;
            continue;
        }
        dcs_list_remove_at(&s->xfer, i);
        r->admitted = ++s->admit_counter;
        r->chunk = 0;
        r->logit_row = -1;
    }
}

/* Admit waiting requests (FIFO) while the prefill budget, the batch and the pool allow;
 * each shares its cached prefix and gets its first chunk. Returns the budget left. */
static int admit_waiting(dc_sched *s, int budget)
{
    while (s->waiting.n && budget > 0 && s->running.n < s->p.max_running) {
        dc_req *r = s->waiting.v[0];
        bool wait;
        int m = pc_match(s, r, &wait); /* cached leading blocks: shared, not computed again */
        int need = kn_kv_blocks_for(s->kv, r->n_tokens + 1) - m;
        int32_t left = r->n_tokens - r->n_computed;
        int32_t chunk = cap_chunk(s, r->n_computed, left < budget ? left : budget);
        if (wait || !chunk || pc_defer(s, r, m) ||
            (kn_kv_available(s->mem) - promised_blocks(s) < need && s->running.n > 0) ||
            kn_kv_seq_reserve(s->mem, &r->seq, r->n_computed + chunk)) {
            pc_unmatch(s, r);
            break;
        }
        dcs_list_remove_at(&s->waiting, 0);
        if (list_push(&s->running, r)) {
            pc_unmatch(s, r);
            list_push_front(&s->waiting, r); /* cannot fail: we just removed it */
            break;
        }
        if (s->cache) {
            s->pc_queried += (uint64_t)r->n_tokens;
            s->pc_hits += (uint64_t)r->n_computed;
            s->tier_hits +=
                (uint64_t)kn_kv_seq_claim_restored(s->mem, &r->seq) * (uint64_t)s->kv->block_size;
        }
        if (!r->admitted_once)
            r->n_cached = r->n_computed < r->n_prompt ? r->n_computed : r->n_prompt;
        r->admitted_once = true;
        r->admitted = ++s->admit_counter;
        r->chunk = chunk;
        r->logit_row = -1;
        budget -= chunk;
    }
    return budget;
}

/* DC_SPEC_DRAFT: the proposer computes the n candidates' proposals, as many as the choice
 * took for each; a take shrinks to what the proposer gave. false: none in this step. */
static bool draft_propose(dc_sched *s, int n)
{
    const dc_spec_proposer *pp = &s->p.spec.proposer;
    int m = 0;
    for (int c = 0; c < n; c++) {
        dc_req *r = s->cand_req[c];
        if (!s->cands[c].take) continue;
        s->pr_ids[m] = r->id;
        s->pr_toks[m] = r->tokens;
        s->pr_ntok[m] = r->n_tokens;
        s->pr_k[m] = s->cands[c].take;
        s->pr_out[m] = r->draft;
        s->pr_nout[m++] = 0;
    }
    if (!m) return true;
    int rc =
        pp->propose(pp->ctx, m, s->pr_ids, s->pr_toks, s->pr_ntok, s->pr_k, s->pr_out, s->pr_nout);
    if (rc) TD_LOG_WARN("speculative decoding: the proposer failed: %s", td_strerror(rc));
    s->step_stale = pp->stale_tokens ? pp->stale_tokens(pp->ctx) : 0;
    for (int c = 0, j = 0; c < n; c++) {
        if (!s->cands[c].take) continue;
        int got = rc ? 0 : s->pr_nout[j];
        j++;
        if (got < s->cands[c].take) s->cands[c].take = got < 0 ? 0 : got;
    }
    return !rc;
}

static double draft_ms(const void *cost, int32_t pos)
{
    return dc_cost_draft_ms(cost, pos);
}

/* Speculative decoding (dc_spec.h): the proposals each decoding request of the step
 * verifies beside its decode row, never past what it may still generate; the rows they
 * need are reserved without preempting anyone (a short pool verifies fewer). Adds their
 * rows to d. */
static void plan_proposals(dc_sched *s, dc_step_shape *d)
{
    const dc_spec_params *sp = &s->p.spec;
    bool lookup = sp->method == DC_SPEC_NGRAM;
    bool allow = dc_spec_gate_allow(&s->gate, d->n_decode);
    int n = 0;
    for (int i = 0; i < s->running.n; i++) {
        dc_req *r = s->running.v[i];
        r->n_draft = 0;
        if (r->chunk != 1 || r->n_tokens - r->n_computed != 1 || !allow) continue;
        int k = sp->max_tokens, room = r->max_tokens - r->n_generated - 1;
        if (room > s->p.max_ctx - r->n_tokens - 1) room = s->p.max_ctx - r->n_tokens - 1;
        k = k < room ? k : room;
        /* prompt lookup finds its proposals now; a proposer computes them once chosen */
        int n_cand = k <= 0   ? 0
                     : lookup ? dc_spec_ngram(r->tokens, r->n_tokens, sp->ngram_min, sp->ngram_max,
                                              k, r->draft)
                              : k;
        if (!n_cand) {
            dc_spec_req_observe(&r->spec, 0, 0);
            continue;
        }
        s->cand_req[n] = r;
        s->cands[n++] = (dc_spec_cand){.accept = r->spec.accept,
                                       .cont = r->spec.cont,
                                       .n_cand = n_cand,
                                       .pos0 = r->n_tokens,
                                       .take = n_cand};
    }
    if (!n) return;
    if (!sp->pinned)
        dc_spec_choose(s->cands, n, d->n_decode, dc_cost_predict(&s->cost, d), draft_ms, &s->cost,
                       lookup ? 0 : dc_cost_pass_ms(&s->cost));
    if (!lookup && !draft_propose(s, n)) return;
    for (int c = 0; c < n; c++) {
        dc_req *r = s->cand_req[c];
        int take = s->cands[c].take;
        TD_LOG_DEBUG("speculation: request %llu has %d proposals, takes %d",
                     (unsigned long long)r->id, s->cands[c].n_cand, take);
        if (!take) dc_spec_req_observe(&r->spec, 0, 0);
        if (!take || kn_kv_seq_reserve(s->mem, &r->seq, r->n_computed + 1 + take)) continue;
        r->n_draft = take;
        r->chunk = 1 + take;
        d->n_draft += take;
        if (!lookup && take > d->n_pass) d->n_pass = take;
        d->attn += take * (double)r->n_tokens + (double)take * (take + 1) / 2;
    }
}

/* 1. decoding requests: one token each, oldest first, always (the budget is for prefill
 * tokens only, so a small budget never starves running decodes), and their proposals. Then,
 * with p.itl_target_ms, the time the step's prefill may take beside them. */
static void plan_decodes(dc_sched *s)
{
    for (int i = 0; i < s->running.n; i++) {
        s->running.v[i]->chunk = 0;
        s->running.v[i]->logit_row = -1;
    }
    for (int i = 0; i < s->running.n; i++) {
        dc_req *r = s->running.v[i];
        if (r->n_tokens - r->n_computed != 1 || r->chunk) continue;
        if (!reserve_or_preempt(s, r, 1)) {
            i = -1; /* the list changed: rescan (requests with chunk set are skipped) */
            continue;
        }
        r->chunk = 1;
    }
    dc_step_shape d = {0};
    for (int i = 0; i < s->running.n; i++)
        if (s->running.v[i]->chunk) d.n_decode++, d.attn += s->running.v[i]->n_computed + 1;
    if (s->p.spec.method != DC_SPEC_OFF) plan_proposals(s, &d);
    s->capping = s->p.itl_target_ms > 0 && d.n_decode > 0;
    s->prefill_planned = s->capped = false;
    s->ms_left = s->p.itl_target_ms - dc_cost_predict(&s->cost, &d);
}

static int lay_out(dc_sched *s, dc_step *step);

int dc_sched_plan(dc_sched *s, dc_step *step)
{
    memset(step, 0, sizeof *step);
    if (s->planned) return TD_ESTATE;
    /* report and free cancelled requests first: their blocks return within this step */
    for (int i = s->waiting.n - 1; i >= 0; i--)
        if (s->waiting.v[i]->cancelled) dcs_finish(s, &s->waiting, i, DC_FINISH_CANCELLED);
    for (int i = s->running.n - 1; i >= 0; i--)
        if (s->running.v[i]->cancelled) dcs_finish(s, &s->running, i, DC_FINISH_CANCELLED);
    /* a transferring request's blocks are the node's to release (dc_sched_transfer_end:
     * kvxfer says when no writer can write any more); once arrived they are ours */
    for (int i = s->xfer.n - 1; i >= 0; i--)
        if (s->xfer.v[i]->arrived && s->xfer.v[i]->cancelled)
            dcs_finish(s, &s->xfer, i, DC_FINISH_CANCELLED);
    dcs_admit_arrived(s);

    int budget = s->p.step_tokens;
    s->tier_left = s->p.tier_blocks_per_step;
    uint64_t preemptions_before = s->preemptions;
    plan_decodes(s);
    /* 2. prefill chunks of admitted requests, in admission order (capped: within the time
     * the step has left) */
    for (int i = 0; i < s->running.n && budget > 0; i++) {
        dc_req *r = s->running.v[i];
        int32_t left = r->n_tokens - r->n_computed;
        if (r->chunk || left <= 1) continue;
        int32_t chunk = cap_chunk(s, r->n_computed, left < budget ? left : budget);
        if (!chunk || kn_kv_seq_reserve(s->mem, &r->seq, r->n_computed + chunk)) break; /* wait */
        r->chunk = chunk;
        budget -= chunk;
    }
    /* 3. admit waiting requests while the budget, the batch and the pool allow; not in a
     * step that had to preempt (the pool is short: re-admitting the victim at once would
     * only have it preempted again) */
    if (s->preemptions == preemptions_before) budget = admit_waiting(s, budget);
    s->prefill_capped += s->capped;
    return lay_out(s, step);
}

/* The planned chunks as the step's batch (see the comment inside); returns its tokens. */
static int lay_out(dc_sched *s, dc_step *step)
{
    /* lay out the batch: requests in running order, each its chunk of tokens; first the
     * one-token decode rows (each followed by its proposals' rows, dc_spec.h), then the
     * prefill chunks. The decode rows are solo rows (computed as if each were alone), so a
     * running request's next token does not depend on what else is batched, nor on whether
     * it speculates. With p.deterministic the prefill rows are too: otherwise a
     * prompt whose chunk shares a step with others takes the batched (gemm) path, whose
     * rounding differs from the dot path's, and that alone can flip a sampled token later
     * (decode_node 'concurrent'). Its cost: colocated prefill on the dot path, about half
     * the matmul rate at 64-256 rows (BENCHMARKS.md "Engine"). */
    int n = 0, nseq = 0, nrows = 0, n_decode = 0;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) n_decode = n; /* the decode rows came first */
        for (int i = 0; i < s->running.n; i++) {
            dc_req *r = s->running.v[i];
            bool decode = r->chunk == 1 + r->n_draft && r->n_computed + 1 == r->n_tokens;
            if (!r->chunk || decode != (pass == 0)) continue;
            r->plp_n = 0;
            r->row0 = n;
            if (decode) { /* the decode row and its proposals: a logit row each */
                r->logit_row = nrows;
                for (int32_t j = 0; j < r->chunk; j++) {
                    s->tok[n] = j ? r->draft[j - 1] : r->tokens[r->n_computed];
                    s->pos[n] = r->n_computed + j;
                    s->seq_of[n] = nseq;
                    s->rows[nrows++] = n++;
                }
            }
            for (int32_t j = 0; j < r->chunk && !decode; j++) {
                int32_t q = r->n_computed + j;
                s->tok[n] = r->tokens[q];
                s->pos[n] = q;
                s->seq_of[n] = nseq;
                n++;
                /* this row's logits score prompt token q + 1, if still owed */
                if (q + 1 >= r->plp_next && q + 1 < r->n_prompt) {
                    if (!r->plp_n) r->plp_row0 = nrows, r->plp_pos0 = q + 1;
                    r->plp_n++;
                    s->rows[nrows++] = n - 1;
                }
            }
            s->views[nseq] =
                (kn_seq_view){.block_table = r->seq.blocks, .n_ctx = r->n_computed + r->chunk};
            if (!decode && r->n_computed + r->chunk == r->n_tokens) {
                r->logit_row = nrows;
                s->rows[nrows++] = n - 1;
            }
            s->in_step[nseq++] = r;
        }
    }
    int n_draft = 0, n_pass = 0;
    for (int i = 0; i < nseq; i++) {
        n_draft += s->in_step[i]->n_draft;
        if (s->in_step[i]->n_draft > n_pass) n_pass = s->in_step[i]->n_draft;
    }
    s->shape = (dc_step_shape){.n_decode = n_decode - n_draft,
                               .n_prefill = n - n_decode,
                               .n_draft = n_draft,
                               .n_pass = s->p.spec.method == DC_SPEC_DRAFT ? n_pass : 0};
    for (int i = 0; i < n; i++)
        s->shape.attn += s->pos[i] + 1;
    if (n == 0) return 0;
    step->batch = (kn_batch){.n_tokens = n,
                             .n_solo = s->p.deterministic ? n : n_decode,
                             .tokens = s->tok,
                             .pos = s->pos,
                             .seq_of = s->seq_of,
                             .n_seqs = nseq,
                             .seqs = s->views,
                             .n_logits = nrows,
                             .logit_rows = s->rows,
                             .hidden_out = s->hid};
    step->n_requests = nseq;
    s->planned = true;
    return n;
}

/* Advance r's matcher by the token it sampled: id, or TD_EINVAL if the grammar refuses it
 * (a masked sample cannot be refused: that is a bug, reported as an error). */
void dc_sched_observe(dc_sched *s, double ms)
{
    if (!(s->shape.n_decode + s->shape.n_prefill)) return;
    /* TANDEM_LOG=debug: the fit step by step (how the speculation and prefill budgets see it) */
    TD_LOG_DEBUG("step cost: %d decode rows, %d verification rows, %d draft passes, %d prefill "
                 "tokens, %.0f attention pairs: %.2f ms measured, %.2f predicted",
                 s->shape.n_decode, s->shape.n_draft, s->shape.n_pass, s->shape.n_prefill,
                 s->shape.attn, ms, dc_cost_predict(&s->cost, &s->shape));
    /* a proposer's catch-up beyond its steady lag (disaggregated mode: a prompt the stages
     * computed; after held steps: their output) is a prefill of the draft's inside the step:
     * measured as the price of the step's proposals, it made the gate hold speculation off
     * for good (s36: 1414 of 1646 steps held, 35 verifications, the 0.5B draft at 0.74-1.01x
     * off in disaggregated mode, against 1.24-1.33x colocated) and bends the cost model's fit */
    const bool stale = s->step_stale > 0;
    s->step_stale = 0;
    if (stale) {
        dc_spec_gate_skip(&s->gate);
        return;
    }
    if (!s->shape.n_prefill)
        dc_spec_gate_observe(&s->gate, ms, s->shape.n_decode + s->step_accepted);
    dc_cost_observe(&s->cost, &s->shape, ms);
}

double dc_sched_predict_ms(const dc_sched *s)
{
    return s->shape.n_decode + s->shape.n_prefill ? dc_cost_predict(&s->cost, &s->shape) : 0;
}

void dc_sched_fail_all(dc_sched *s)
{
    s->planned = false;
    while (s->running.n)
        dcs_finish(s, &s->running, s->running.n - 1, DC_FINISH_ERROR);
    while (s->waiting.n)
        dcs_finish(s, &s->waiting, s->waiting.n - 1, DC_FINISH_ERROR);
    while (s->xfer.n)
        dcs_finish(s, &s->xfer, s->xfer.n - 1, DC_FINISH_ERROR);
    /* the instance re-forms or stops: the other ranks' pools start empty */
    if (s->cache) kn_kv_mem_clear(s->mem);
}

bool dc_sched_idle(const dc_sched *s)
{
    return s->running.n == 0 && s->waiting.n == 0 && s->xfer.n == 0;
}

dc_sched_stats dc_sched_get_stats(const dc_sched *s)
{
    int arrived = 0;
    for (int i = 0; i < s->xfer.n; i++)
        arrived += s->xfer.v[i]->arrived;
    kn_kv_tier_stats ts = s->tier ? kn_kv_tier_get_stats(s->tier) : (kn_kv_tier_stats){0};
    dc_sched_stats st = {
        .running = s->running.n,
        .waiting = s->waiting.n + arrived,
        .transferring = s->xfer.n - arrived,
        .kv_blocks_used = s->kv->n_blocks - kn_kv_available(s->mem),
        .kv_blocks_free = kn_kv_available(s->mem), /* idle cached blocks are evictable */
        .preemptions = s->preemptions,
        .prefix_queried = s->pc_queried,
        .prefix_hits = s->pc_hits,
        .prefix_evictions = s->cache ? kn_kv_cache_get_stats(s->cache).evictions : 0,
        .tier_writes = ts.writes,
        .tier_reads = ts.reads,
        .tier_hits = s->tier_hits,
        .tier_errors = ts.errors,
        .prefill_capped = s->prefill_capped,
        .spec_drafts = s->spec_drafts,
        .spec_draft_tokens = s->spec_draft_tokens,
        .spec_accepted = s->spec_accepted,
        .spec_held_steps = s->gate.held_steps,
    };
    memcpy(st.spec_accepted_pos, s->spec_accepted_pos, sizeof st.spec_accepted_pos);
    st.cost_decode_ms = dc_cost_predict(&s->cost, &(dc_step_shape){.n_decode = 1, .attn = 1});
    st.cost_verify_ms = dc_cost_draft_ms(&s->cost, 0);
    return st;
}
