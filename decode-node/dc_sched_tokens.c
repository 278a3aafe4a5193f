/* dc_sched_tokens.c: what the decode scheduler does with a step's logits and with a
 * transfer's first token (see dc_sched.h): the grammar's mask and matcher, stop tokens,
 * sampling and logprobs, speculation's acceptance and rollback, the token events to the sink,
 * and the transferred requests' arrival. The lists and the planning are dc_sched.c's. */
#include <stdlib.h>

#include "dc_sched_int.h"
#include "td_err.h"

static int32_t grammar_accept(dc_req *r, int32_t id)
{
    int rc = gr_matcher_accept_token(r->gm, id);
    if (!rc) return id;
    TD_LOG_ERR("req %llu: token %d leaves the grammar", (unsigned long long)r->id, id);
    return rc;
}

static bool is_stop(const dc_sched *s, const dc_req *r, int32_t id)
{
    for (int i = 0; i < r->n_stop; i++)
        if (r->stop_ids[i] == id) return true;
    if (r->ignore_eos) return false;
    for (int i = 0; i < s->p.n_eog; i++)
        if (s->p.eog_ids[i] == id) return true;
    return false;
}

/* The step's prompt-logprob rows of r to the sink; 0 or a negative td_err. */
static int prompt_logprobs(dc_sched *s, dc_req *r, const float *logits)
{
    int32_t n_vocab = s->m->hp.n_vocab, k = (int32_t)r->smp.p.logprobs - 1;
    td_logprob_entry *e = malloc((size_t)r->plp_n * sizeof *e);
    if (!e) return TD_ENOMEM;
    int rc = 0;
    for (int32_t j = 0; j < r->plp_n && !rc; j++)
        rc = kn_logprobs(logits + (size_t)(r->plp_row0 + j) * (size_t)n_vocab, n_vocab,
                         r->tokens[r->plp_pos0 + j], k, &e[j]);
    if (!rc && s->sink.on_prompt_logprobs)
        s->sink.on_prompt_logprobs(s->sink.ctx, r->id, r->plp_pos0, e, r->plp_n);
    free(e);
    if (!rc) r->plp_next = r->plp_pos0 + r->plp_n;
    r->plp_n = 0;
    return rc;
}

/* Sample r's next token from its logit row (the grammar's mask applied, the matcher
 * advanced unless it is a stop token); *lp its logprobs when the request asked. The token
 * or a negative td_err. */
static int32_t sample_row(dc_sched *s, dc_req *r, const float *row, td_logprob_entry *lp)
{
    int32_t n_vocab = s->m->hp.n_vocab;
    const uint32_t *mask = NULL;
    int32_t id = r->gm ? gr_matcher_mask(r->gm, &mask) : 0;
    kn_sampler_set_mask(&r->smp, mask);
    if (id == 0) id = kn_sample(&r->smp, row, r->tokens, r->n_tokens, r->n_tokens - r->out_from);
    if (id >= 0 && r->gm && !is_stop(s, r, id)) id = grammar_accept(r, id);
    /* the raw model distribution (vLLM's raw_logprobs): before the grammar's mask too */
    if (id >= 0 && r->smp.p.logprobs)
        id = kn_logprobs(row, n_vocab, id, (int)r->smp.p.logprobs - 1, lp) ? TD_EINVAL : id;
    return id;
}

/* Speculative decoding's bookkeeping after r's verification: n_acc of its n_draft proposals
 * were accepted (their KV kept); the KV of the rest is dropped when r goes on (keep), and
 * the whole blocks of what it kept enter the prefix cache. */
static void end_verification(dc_sched *s, dc_req *r, int n_acc, bool keep)
{
    s->spec_drafts++;
    s->spec_draft_tokens += (uint64_t)r->n_draft;
    s->spec_accepted += (uint64_t)n_acc;
    for (int j = 0; j < n_acc; j++)
        s->spec_accepted_pos[j]++;
    /* TANDEM_LOG=debug: what the adaptive choice saw and what came of it */
    TD_LOG_DEBUG("speculation: request %llu verified %d, accepted %d (chances %.3f first, %.3f "
                 "later)",
                 (unsigned long long)r->id, r->n_draft, n_acc, r->spec.accept, r->spec.cont);
    dc_spec_req_observe(&r->spec, r->n_draft, n_acc);
    r->n_draft = 0;
    if (keep && kn_kv_seq_rollback(s->mem, &r->seq, r->tokens, r->n_computed)) {
        /* no block for a private copy: the sequence kept its whole blocks only; the rest
         * is computed again (kv_mem.h) */
        r->n_computed = r->n_computed / s->kv->block_size * s->kv->block_size;
    }
    if (keep && s->p.spec.method == DC_SPEC_DRAFT && s->p.spec.proposer.keep)
        s->p.spec.proposer.keep(s->p.spec.proposer.ctx, r->id, r->tokens, r->n_tokens);
    dcs_pc_insert(s, r);
}

/* Emit r's tokens from the step's logits: its next token from its first logit row and,
 * while the step verified proposals (r->n_draft) and each sampled token equals the
 * proposal its row was computed for, the next ones from the rows that follow (dc_spec.h:
 * the tokens are those of sampling one step at a time). Sends them in one event; frees r
 * (and removes it from the running list, index i) when it finished. */
static void emit_tokens(dc_sched *s, int i, dc_req *r, const float *logits)
{
    int32_t n_vocab = s->m->hp.n_vocab;
    bool want_lp = r->smp.p.logprobs;
    int n = 0, n_acc = 0, nd = r->n_draft;
    dc_finish why = DC_FINISH_NONE;
    for (int j = 0; j <= nd; j++) {
        const float *row = logits + (size_t)(r->logit_row + j) * (size_t)n_vocab;
        int32_t id = sample_row(s, r, row, &s->emit_lp[n]);
        if (id < 0) {
            TD_LOG_ERR("req %llu: sampling failed: %s", (unsigned long long)r->id, td_strerror(id));
            why = DC_FINISH_ERROR;
            break;
        }
        r->n_generated++; /* a stop token is generated work (usage counts it), not sent */
        if (is_stop(s, r, id)) {
            why = DC_FINISH_STOP;
            break;
        }
        r->tokens[r->n_tokens++] = s->emit[n++] = id;
        if (r->n_generated >= r->max_tokens || r->n_tokens >= s->p.max_ctx) why = DC_FINISH_LENGTH;
        if (r->gm && gr_matcher_done(r->gm)) why = DC_FINISH_STOP; /* the document is whole */
        if (why != DC_FINISH_NONE || j == nd || id != r->draft[j]) break;
        r->n_computed++; /* proposal j was id: its row's KV holds */
        n_acc++;
    }
    r->logit_row = -1;
    if (nd) end_verification(s, r, n_acc, why == DC_FINISH_NONE);
    /* an error's event carries no tokens: those sampled before it go out first */
    if (s->sink.on_tokens && (n || why != DC_FINISH_ERROR))
        s->sink.on_tokens(s->sink.ctx, r->id, s->emit, n, want_lp ? s->emit_lp : NULL,
                          why == DC_FINISH_ERROR ? DC_FINISH_NONE : why, r->n_prompt,
                          r->n_generated, r->n_cached);
    if (why == DC_FINISH_ERROR) {
        dcs_finish(s, &s->running, i, DC_FINISH_ERROR);
    } else if (why != DC_FINISH_NONE) {
        dcs_list_remove_at(&s->running, i);
        dcs_req_free(s, r);
    }
}

int dc_sched_commit(dc_sched *s, const float *logits, int rc)
{
    if (!s->planned) return TD_ESTATE;
    s->planned = false;
    uint64_t accepted0 = s->spec_accepted;
    for (int i = s->running.n - 1; i >= 0; i--) {
        dc_req *r = s->running.v[i];
        if (!r->chunk) continue;
        if (rc) {
            dcs_finish(s, &s->running, i, DC_FINISH_ERROR);
            continue;
        }
        /* a proposer that follows the target's rows (and, an MTP block, reads their hidden
         * states) is told of r's */
        const dc_spec_proposer *pp = &s->p.spec.proposer;
        if (s->p.spec.method == DC_SPEC_DRAFT && pp->computed)
            pp->computed(pp->ctx, r->id, r->n_computed, r->chunk,
                         s->hid ? s->hid + (size_t)r->row0 * (size_t)pp->n_hidden : NULL, r->tokens,
                         r->n_tokens);
        /* a proposal's KV is kept only once it is accepted (emit_tokens) */
        r->n_computed += r->chunk - r->n_draft;
        r->chunk = 0;
        if (!r->n_draft) dcs_pc_insert(s, r);
        if (r->plp_n && prompt_logprobs(s, r, logits)) {
            dcs_finish(s, &s->running, i, DC_FINISH_ERROR);
            continue;
        }
        if (r->logit_row >= 0) emit_tokens(s, i, r, logits);
    }
    s->step_accepted = (int)(s->spec_accepted - accepted0);
    return rc;
}

static int xfer_index(const dc_sched *s, uint64_t id)
{
    for (int i = 0; i < s->xfer.n; i++)
        if (s->xfer.v[i]->id == id) return i;
    return -1;
}

int dc_sched_transfer_done(dc_sched *s, uint64_t id, int32_t first_token)
{
    int i = xfer_index(s, id);
    if (i < 0 || s->xfer.v[i]->arrived) return TD_ENOENT;
    dc_req *r = s->xfer.v[i];
    if (r->cancelled) {
        dcs_finish(s, &s->xfer, i, DC_FINISH_CANCELLED);
        return 0;
    }
    if (first_token < 0 || first_token >= s->m->hp.n_vocab) {
        TD_LOG_ERR("req %llu: first token %d from the prefill is outside the vocabulary",
                   (unsigned long long)id, first_token);
        return TD_EINVAL;
    }
    /* the KV of the whole prompt is in the blocks: as if this node had prefilled it and
     * sampled first_token with the request's sampler, which therefore skips one draw */
    r->n_computed = r->n_prompt;
    dcs_pc_insert(s, r); /* a later request on this instance may share the prompt's blocks */
    kn_sampler_skip(&r->smp);
    r->n_generated++;
    if (is_stop(s, r, first_token)) {
        dcs_finish(s, &s->xfer, i, DC_FINISH_STOP);
        return 0;
    }
    if (r->gm && grammar_accept(r, first_token) < 0) {
        dcs_finish(s, &s->xfer, i, DC_FINISH_ERROR);
        return 0;
    }
    r->tokens[r->n_tokens++] = first_token;
    dc_finish why = DC_FINISH_NONE;
    if (r->n_generated >= r->max_tokens || r->n_tokens >= s->p.max_ctx) why = DC_FINISH_LENGTH;
    if (r->gm && gr_matcher_done(r->gm)) why = DC_FINISH_STOP;
    if (s->sink.on_tokens)
        s->sink.on_tokens(s->sink.ctx, r->id, &first_token, 1, NULL, why, r->n_prompt,
                          r->n_generated, r->n_cached);
    if (why != DC_FINISH_NONE) {
        dcs_list_remove_at(&s->xfer, i);
        dcs_req_free(s, r);
        return 0;
    }
    r->arrived = true;
    if (!s->planned) dcs_admit_arrived(s); /* between steps; else the next plan admits it */
    return 0;
}

int dc_sched_transfer_end(dc_sched *s, uint64_t id, dc_finish why)
{
    int i = xfer_index(s, id);
    if (i < 0) return TD_ENOENT;
    dcs_finish(s, &s->xfer, i, why);
    return 0;
}

bool dc_sched_transferring(const dc_sched *s, uint64_t id)
{
    int i = xfer_index(s, id);
    return i >= 0 && !s->xfer.v[i]->arrived;
}
