/* dc_draft.c: a draft model, or the target's multi-token prediction block, as speculative
 * decoding's proposer (dc_draft.h). */
#include "dc_draft.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_mem.h"
#include "sampler.h"
#include "td_clock.h"
#include "td_err.h"
#include "td_grow.h"

#define TOKENS_KEY "tokenizer.ggml.tokens"
/* a request fed more than this in one call (its prompt) gets no proposals in it (dc_draft.h) */
#define FAR_TOKENS (DC_SPEC_MAX_TOKENS + 1)

/* One request's record (dc_draft.h: HOLDS). */
typedef struct {
    uint64_t id;
    kn_kv_seq seq;  /* its blocks: positions [0, n_held) and perhaps room reserved past them */
    int32_t *toks;  /* (cap) the tokens at those positions, then those still to be fed */
    int32_t n_held; /* tokens whose KV the sequence holds */
    int32_t cap;
    /* an MTP block's: the target's hidden states of positions [hid0, hid0 + n_hid) (rows of
     * n_embd; position p's row is the input of position p + 1), and where the held KV stops
     * being computed from them: past n_exact, from the block's own (its chained proposals) */
    float *hid;
    int32_t hid0, n_hid, cap_hid;
    int32_t n_exact;
} draft_req;

/* A request of the current call: its record, its position in the call's arrays and how far
 * it is fed: [n_held, n_in) of its record's tokens are still to catch up. */
typedef struct {
    int rec, i;
    int32_t n_in;
    int row;  /* its logit row in the current pass, or -1 */
    bool far; /* it catches up more than FAR_TOKENS: no proposals in this call */
} draft_act;

struct dc_draft {
    char who[96];
    kn_backend be;      /* borrowed; the pool points here */
    bool mtp;           /* the target's MTP block: rows read the target's hidden states */
    int64_t E;          /* mtp: n_embd, a hidden row's floats */
    td_gguf *gguf;      /* the draft's file (NULL for an MTP block) */
    const td_gguf *src; /* where the weights are: gguf, or the target's file (borrowed) */
    kn_model *model;
    kn_engine *engine;
    kn_kv_mem *mem;
    int32_t n_in;    /* ids it can read: its embedding rows */
    int32_t n_out;   /* ids it may propose: below both models' rows and the token list */
    int chunk;       /* most tokens of a catch-up pass */
    draft_req *reqs; /* (n_reqs) records, in no order */
    int n_reqs, cap_reqs;
    /* a call's work, grown on demand */
    draft_act *act; /* (cap_act) */
    kn_seq_view *views;
    int32_t *rows;
    int cap_act;
    int32_t *tok, *pos, *seq_of; /* (cap_tok) one pass's rows */
    int cap_tok;
    float *logits; /* (cap_act, model n_vocab) */
    float *embd;   /* mtp: (cap_tok, E) one pass's hidden inputs */
    float *hout;   /* mtp: (cap_tok, E) its rows' own hidden states (the next proposal's input) */
    float *chain;  /* mtp: (cap_act, E) each request's last row's own hidden state */
    dc_draft_stats st;
    int64_t warm_ns;    /* warm_up's time */
    int64_t call_stale; /* the last propose call's (dc_spec_proposer.stale_tokens) */
};

/* ---- the vocabulary ---- */

/* The draft's token list equals the target's; TD_EINVAL (logged) otherwise. */
static int check_vocab(const dc_draft *d, const td_gguf *target, const char *path)
{
    td_gguf_vtype ed, et;
    size_t nd, nt;
    if (td_gguf_get_arr(d->gguf, TOKENS_KEY, &ed, &nd) || ed != TD_GGUF_STRING ||
        td_gguf_get_arr(target, TOKENS_KEY, &et, &nt) || et != TD_GGUF_STRING) {
        TD_LOG_ERR("%s: draft model %s: no token list (%s) in it or in the target: its "
                   "vocabulary cannot be checked",
                   d->who, path, TOKENS_KEY);
        return TD_EINVAL;
    }
    if (nd != nt) {
        TD_LOG_ERR("%s: draft model %s has %zu tokens, the target %zu: a draft needs the "
                   "target's vocabulary",
                   d->who, path, nd, nt);
        return TD_EINVAL;
    }
    for (size_t i = 0; i < nd; i++) {
        const char *a, *b;
        size_t la, lb;
        if (td_gguf_arr_str(d->gguf, TOKENS_KEY, i, &a, &la) ||
            td_gguf_arr_str(target, TOKENS_KEY, i, &b, &lb))
            return TD_EFORMAT; /* cannot happen: the reader checked both arrays */
        if (la != lb || memcmp(a, b, la)) {
            TD_LOG_ERR("%s: draft model %s: token %zu is '%.*s', the target's '%.*s': a draft "
                       "needs the target's vocabulary",
                       d->who, path, i, (int)(la > 40 ? 40 : la), a, (int)(lb > 40 ? 40 : lb), b);
            return TD_EINVAL;
        }
    }
    return 0;
}

/* ---- create / destroy ---- */

static int draft_propose(void *ctx, int n, const uint64_t *ids, const int32_t *const *toks,
                         const int32_t *n_toks, const int *k, int32_t *const *out, int *n_out);
static void draft_drop(void *ctx, uint64_t id);

/* The first passes' one-time costs (the weights' pages read in, the backend's packed copies
 * of them: kn_backend.h map_matrix) paid at start-up rather than inside a step: a catch-up
 * of WARM_TOKENS tokens, then a proposal row and a second one, forgotten afterwards. */
#define WARM_TOKENS (FAR_TOKENS + 1)
static void warm_up(dc_draft *d)
{
    int64_t t0 = td_now_ns();
    int32_t toks[WARM_TOKENS + 1], prop[2];
    for (int i = 0; i <= WARM_TOKENS; i++)
        toks[i] = i % d->n_out;
    const int32_t *tp = toks;
    int32_t *op = prop;
    uint64_t id = UINT64_MAX;
    for (int32_t n = WARM_TOKENS; n <= WARM_TOKENS + 1; n++) {
        int k = 2, n_out = 0;
        draft_propose(d, 1, &id, &tp, &n, &k, &op, &n_out);
    }
    draft_drop(d, id);
    d->st = (dc_draft_stats){0};
    d->warm_ns = td_now_ns() - t0;
}

static int check_params(const dc_draft_params *p, const char *who, int bs)
{
    if (!p->path == !p->mtp || !p->target || !p->target_gguf || !p->be.ops || p->kv_tokens < 1 ||
        bs < 1 || (bs & (bs - 1)) || p->chunk_tokens < 0 ||
        (p->kv_type != TD_F32 && p->kv_type != TD_F16)) {
        TD_LOG_ERR("%s: draft model: bad parameters (kv_tokens %lld, block_size %d, "
                   "chunk_tokens %d)",
                   who, (long long)p->kv_tokens, bs, p->chunk_tokens);
        return TD_EINVAL;
    }
    return 0;
}

int dc_draft_create(const dc_draft_params *p, dc_draft **out)
{
    *out = NULL;
    const char *who = p->who ? p->who : "draft";
    int bs = p->block_size ? p->block_size : 16;
    int rc = check_params(p, who, bs);
    if (rc) return rc;
    dc_draft *d = calloc(1, sizeof *d);
    if (!d) return TD_ENOMEM;
    snprintf(d->who, sizeof d->who, "%s", who);
    d->be = p->be;
    d->chunk = p->chunk_tokens ? p->chunk_tokens : 512;
    d->mtp = p->mtp;
    const char *what = p->mtp ? "the target's MTP block" : p->path;
    char err[512];
    if (!p->mtp && (rc = td_gguf_open(p->path, &d->gguf, err, sizeof err))) {
        TD_LOG_ERR("%s: draft model: %s", who, err);
        goto fail;
    }
    if (!p->mtp && (rc = check_vocab(d, p->target_gguf, p->path))) goto fail;
    /* a draft whole; an MTP block from the target's own file (same vocabulary) */
    kn_shard whole = {.mtp = p->mtp};
    if ((rc = kn_model_load(p->mtp ? p->target_gguf : d->gguf, &whole, &d->model))) {
        TD_LOG_ERR("%s: cannot load draft model %s: %s", who, what, td_strerror(rc));
        goto fail;
    }
    d->E = d->model->hp.n_embd;
    d->src = p->mtp ? p->target_gguf : d->gguf;
    if ((rc = kn_engine_create(d->model, d->be, NULL, &d->engine))) {
        TD_LOG_ERR("%s: cannot create the draft model's engine: %s", who, td_strerror(rc));
        goto fail;
    }
    int64_t nb = (p->kv_tokens + bs - 1) / bs;
    kn_kv_pool_params kp =
        kn_model_kv_params(d->model, nb > (1 << 30) ? 1 << 30 : (int)nb, bs, p->kv_type);
    kp.backend = &d->be;
    if ((rc = kn_kv_mem_create(&kp, &d->mem))) {
        TD_LOG_ERR("%s: cannot create the draft model's KV pool (%lld blocks): %s", who,
                   (long long)nb, td_strerror(rc));
        goto fail;
    }
    size_t n_tokens = 0;
    td_gguf_vtype et;
    td_gguf_get_arr(p->mtp ? p->target_gguf : d->gguf, TOKENS_KEY, &et, &n_tokens);
    d->n_in = d->model->hp.n_vocab;
    d->n_out = d->n_in < p->target->hp.n_vocab ? d->n_in : p->target->hp.n_vocab;
    if ((size_t)d->n_out > n_tokens) d->n_out = (int32_t)n_tokens;
    warm_up(d);
    *out = d;
    return 0;
fail:
    dc_draft_destroy(d);
    return rc;
}

void dc_draft_destroy(dc_draft *d)
{
    if (!d) return;
    for (int i = 0; i < d->n_reqs; i++) {
        kn_kv_seq_fini(d->mem, &d->reqs[i].seq);
        free(d->reqs[i].toks);
        free(d->reqs[i].hid);
    }
    free(d->reqs);
    kn_kv_mem_destroy(d->mem);
    kn_engine_destroy(d->engine);
    kn_model_destroy(d->model);
    td_gguf_close(d->gguf);
    free(d->act);
    free(d->views);
    free(d->rows);
    free(d->tok);
    free(d->pos);
    free(d->seq_of);
    free(d->logits);
    free(d->embd);
    free(d->hout);
    free(d->chain);
    free(d);
}

dc_draft_info dc_draft_get_info(const dc_draft *d)
{
    const kn_kv_pool *kv = kn_kv_mem_pool(d->mem);
    dc_draft_info in = {.arch = d->model->hp.arch,
                        .n_layer = d->model->hp.n_layer,
                        .n_embd = d->model->hp.n_embd,
                        .n_vocab = d->model->hp.n_vocab,
                        .kv_bytes = kv->region_bytes,
                        .kv_blocks = kv->n_blocks,
                        .warm_ms = (double)d->warm_ns / 1e6};
    /* an MTP block's own: its layer's tensors (blk.<n_layer>.*), not the trunk's it shares */
    char prefix[32];
    size_t np = (size_t)snprintf(prefix, sizeof prefix, "blk.%d.", d->model->shard.l0);
    for (size_t i = 0; i < td_gguf_n_tensors(d->src); i++) {
        const td_gguf_tensor *t = td_gguf_tensor_at(d->src, i);
        if (!d->mtp || !strncmp(t->name, prefix, np)) in.weight_bytes += t->nbytes;
    }
    return in;
}

dc_draft_stats dc_draft_get_stats(const dc_draft *d)
{
    return d->st;
}

int dc_draft_blocks_used(const dc_draft *d)
{
    return kn_kv_mem_pool(d->mem)->n_blocks - kn_kv_available(d->mem);
}

/* ---- records ---- */

static int find_req(const dc_draft *d, uint64_t id)
{
    for (int i = 0; i < d->n_reqs; i++)
        if (d->reqs[i].id == id) return i;
    return -1;
}

/* Its record, made empty when it has none; -1: out of memory. */
static int get_req(dc_draft *d, uint64_t id)
{
    int r = find_req(d, id);
    if (r >= 0) return r;
    if (TD_GROW_INT(d->reqs, d->cap_reqs, d->n_reqs + 1, 16)) return -1;
    draft_req *q = &d->reqs[d->n_reqs];
    *q = (draft_req){.id = id};
    kn_kv_seq_init(&q->seq);
    return d->n_reqs++;
}

static int32_t common_prefix(const int32_t *a, int32_t na, const int32_t *b, int32_t nb)
{
    int32_t n = na < nb ? na : nb, i = 0;
    while (i < n && a[i] == b[i])
        i++;
    return i;
}

/* Keep the first n of q's held tokens (n <= n_held). */
static void roll_back(dc_draft *d, draft_req *q, int32_t n)
{
    if (n >= q->n_held) return;
    /* no prefix cache here: a rollback copies nothing and cannot fail, but if it did the
     * record would start again from nothing */
    if (kn_kv_seq_rollback(d->mem, &q->seq, q->toks, n)) {
        kn_kv_seq_release(d->mem, &q->seq);
        n = 0;
    }
    q->n_held = n;
    if (q->n_exact > n) q->n_exact = n;
}

static void empty_req(dc_draft *d, draft_req *q)
{
    kn_kv_seq_release(d->mem, &q->seq);
    q->n_held = q->n_exact = 0;
}

/* What q's record keeps of its held tokens given the target's toks[0, n): their common
 * prefix; an MTP block's also not past what it computed from the target's hidden states
 * (a chained proposal's KV came from the block's own, even where its token was right). */
static int32_t kept_prefix(const dc_draft *d, const draft_req *q, const int32_t *toks, int32_t n)
{
    int32_t k = common_prefix(q->toks, q->n_held, toks, n);
    return d->mtp && k > q->n_exact ? q->n_exact : k;
}

static void draft_keep(void *ctx, uint64_t id, const int32_t *toks, int32_t n)
{
    dc_draft *d = ctx;
    int r = find_req(d, id);
    if (r < 0) return;
    draft_req *q = &d->reqs[r];
    roll_back(d, q, kept_prefix(d, q, toks, n));
}

/* The block's input row for position p of q: the target's hidden state of p - 1, or zeros
 * where it is not known (p = 0; a prompt the prefill stages computed; a cached prefix). */
static void hidden_in(const dc_draft *d, const draft_req *q, int32_t p, float *row)
{
    int32_t i = p - 1 - q->hid0;
    if (p >= 1 && i >= 0 && i < q->n_hid)
        memcpy(row, q->hid + (int64_t)i * d->E, (size_t)d->E * sizeof *row);
    else
        memset(row, 0, (size_t)d->E * sizeof *row);
}

static void draft_drop(void *ctx, uint64_t id)
{
    dc_draft *d = ctx;
    int r = find_req(d, id);
    if (r < 0) return;
    kn_kv_seq_fini(d->mem, &d->reqs[r].seq);
    free(d->reqs[r].toks);
    free(d->reqs[r].hid);
    d->reqs[r] = d->reqs[--d->n_reqs];
}

/* ---- propose ---- */

static int grow_call(dc_draft *d, int n)
{
    int want_tok = n > d->chunk ? n : d->chunk;
    if (n > d->cap_act) {
        draft_act *a = realloc(d->act, (size_t)n * sizeof *a);
        if (a) d->act = a;
        kn_seq_view *v = realloc(d->views, (size_t)n * sizeof *v);
        if (v) d->views = v;
        int32_t *r = realloc(d->rows, (size_t)n * sizeof *r);
        if (r) d->rows = r;
        float *l = realloc(d->logits, (size_t)n * (size_t)d->model->hp.n_vocab * sizeof *l);
        if (l) d->logits = l;
        if (!a || !v || !r || !l) return TD_ENOMEM;
        if (d->mtp) {
            float *c = realloc(d->chain, (size_t)n * (size_t)d->E * sizeof *c);
            if (!c) return TD_ENOMEM;
            d->chain = c;
        }
        d->cap_act = n;
    }
    if (want_tok > d->cap_tok) {
        int32_t **bufs[] = {&d->tok, &d->pos, &d->seq_of};
        for (size_t b = 0; b < 3; b++) {
            int32_t *p = realloc(*bufs[b], (size_t)want_tok * sizeof *p);
            if (!p) return TD_ENOMEM;
            *bufs[b] = p;
        }
        float **hbufs[] = {&d->embd, &d->hout};
        for (size_t b = 0; d->mtp && b < 2; b++) {
            float *p = realloc(*hbufs[b], (size_t)want_tok * (size_t)d->E * sizeof *p);
            if (!p) return TD_ENOMEM;
            *hbufs[b] = p;
        }
        d->cap_tok = want_tok;
    }
    return 0;
}

/* q's tokens [n_held, n) from toks to be fed, with room reserved for need positions. false:
 * a token the draft cannot read or no room (q emptied, counted as refused). */
static bool feed(dc_draft *d, draft_req *q, const int32_t *toks, int32_t n, int32_t need)
{
    bool ok = true;
    for (int32_t j = q->n_held; j < n && ok; j++)
        ok = toks[j] >= 0 && toks[j] < d->n_in;
    if (ok) ok = TD_GROW_INT(q->toks, q->cap, need, 64) == 0;
    if (!ok || kn_kv_seq_reserve(d->mem, &q->seq, need)) {
        empty_req(d, q);
        d->st.refused++;
        return false;
    }
    memcpy(q->toks + q->n_held, toks + q->n_held, (size_t)(n - q->n_held) * sizeof *toks);
    return true;
}

/* Request i of the call (tokens toks[0, n), k proposals wanted) joins it: its record rolled
 * back to what it shares with toks (its last token fed again if it holds them all), room
 * reserved for toks and k - 1 proposals, the tokens to feed copied in. false: it takes no
 * part (nothing wanted, a token the draft cannot read, no room: its record is emptied). */
static bool join_call(dc_draft *d, int i, uint64_t id, const int32_t *toks, int32_t n, int k,
                      draft_act *a)
{
    if (k < 1 || n < 1) return false;
    int r = get_req(d, id);
    if (r < 0) return false;
    draft_req *q = &d->reqs[r];
    int32_t keep = kept_prefix(d, q, toks, n);
    roll_back(d, q, keep < n ? keep : n - 1);
    if (!feed(d, q, toks, n, n + k - 1)) return false;
    *a = (draft_act){.rec = r, .i = i, .n_in = n, .row = -1, .far = n - q->n_held > FAR_TOKENS};
    if (n - q->n_held > DC_SPEC_STEADY_BEHIND)
        d->call_stale += n - q->n_held - DC_SPEC_STEADY_BEHIND;
    return true;
}

/* One pass: the n_tok rows laid out in tok, pos, seq_of over n_views sequences, logits of
 * n_rows of them. */
static int run_pass(dc_draft *d, int n_tok, int n_views, int n_rows)
{
    kn_batch b = {.n_tokens = n_tok,
                  .tokens = d->tok,
                  .embd = d->mtp ? d->embd : NULL,
                  .hidden_out = d->mtp ? d->hout : NULL,
                  .pos = d->pos,
                  .seq_of = d->seq_of,
                  .n_seqs = n_views,
                  .seqs = d->views,
                  .n_logits = n_rows,
                  .logit_rows = d->rows};
    d->st.passes++;
    d->st.rows += (uint64_t)n_tok;
    return kn_engine_forward(d->engine, kn_kv_mem_pool(d->mem), &b, d->logits);
}

/* MTP: act a's last row (row of the pass) gave hidden state hout[row], its next row's input. */
static void chain_keep(dc_draft *d, int a, int row)
{
    memcpy(d->chain + a * d->E, d->hout + (int64_t)row * d->E, (size_t)d->E * sizeof(float));
}

/* Catch the call's m requests up: every token of theirs fed, in passes of at most chunk
 * tokens, but those of requests far behind (a prompt: no proposal in this call) only up to
 * far_budget tokens in all (the rest in later calls: a call's time is a decode step's);
 * proposal 1 from each near one's last row. */
static int catch_up(dc_draft *d, int m, int32_t *const *out, int *n_out, int64_t far_budget)
{
    for (;;) {
        int n_tok = 0, n_views = 0, n_rows = 0;
        for (int a = 0; a < m && n_tok < d->chunk; a++) {
            draft_act *x = &d->act[a];
            draft_req *q = &d->reqs[x->rec];
            int32_t take = x->n_in - q->n_held;
            if (x->far && take > far_budget) take = (int32_t)far_budget;
            if (take <= 0) continue;
            if (take > d->chunk - n_tok) take = d->chunk - n_tok;
            if (x->far) far_budget -= take;
            for (int32_t j = 0; j < take; j++, n_tok++) {
                d->tok[n_tok] = q->toks[q->n_held + j];
                d->pos[n_tok] = q->n_held + j;
                d->seq_of[n_tok] = n_views;
                if (d->mtp) hidden_in(d, q, q->n_held + j, d->embd + n_tok * d->E);
            }
            d->views[n_views++] =
                (kn_seq_view){.block_table = q->seq.blocks, .n_ctx = q->n_held + take};
            x->row = -1;
            if (q->n_held + take == x->n_in && !x->far)
                x->row = n_rows, d->rows[n_rows++] = n_tok - 1;
            q->n_held += take;      /* undone below if the pass fails */
            q->n_exact = q->n_held; /* from the target's hidden states */
        }
        if (!n_tok) return 0;
        int rc = run_pass(d, n_tok, n_views, n_rows);
        if (rc) return rc;
        for (int a = 0; a < m; a++) {
            draft_act *x = &d->act[a];
            if (x->row < 0) continue;
            out[x->i][0] = kn_argmax(d->logits + (size_t)x->row * d->model->hp.n_vocab, d->n_out);
            n_out[x->i] = 1;
            if (d->mtp) chain_keep(d, a, d->rows[x->row]);
            x->row = -1;
        }
    }
}

/* Proposals 2..k: one row per request still wanting more, its last proposal fed. */
static int extend(dc_draft *d, int m, const int *k, int32_t *const *out, int *n_out)
{
    for (;;) {
        int n_tok = 0;
        for (int a = 0; a < m; a++) {
            draft_act *x = &d->act[a];
            draft_req *q = &d->reqs[x->rec];
            int got = n_out[x->i];
            x->row = -1;
            if (got < 1 || got >= k[x->i]) continue;
            q->toks[q->n_held] = d->tok[n_tok] = out[x->i][got - 1];
            if (d->mtp) /* the block's own hidden state of the row before */
                memcpy(d->embd + n_tok * d->E, d->chain + a * d->E, (size_t)d->E * sizeof(float));
            d->pos[n_tok] = q->n_held;
            d->seq_of[n_tok] = n_tok;
            d->views[n_tok] = (kn_seq_view){.block_table = q->seq.blocks, .n_ctx = ++q->n_held};
            x->row = n_tok;
            d->rows[n_tok] = n_tok;
            n_tok++;
        }
        if (!n_tok) return 0;
        int rc = run_pass(d, n_tok, n_tok, n_tok);
        if (rc) return rc;
        for (int a = 0; a < m; a++) {
            draft_act *x = &d->act[a];
            if (x->row < 0) continue;
            out[x->i][n_out[x->i]++] =
                kn_argmax(d->logits + (size_t)x->row * d->model->hp.n_vocab, d->n_out);
            if (d->mtp) chain_keep(d, a, x->row);
        }
    }
}

/* ---- the target's rows: an MTP block's hidden states, a prompt's chunks ---- */

/* q's stored rows before the first the block still reads (position n_exact - 1's, the input
 * of n_exact) go. */
static void trim_hid(dc_draft *d, draft_req *q)
{
    int32_t need0 = q->n_exact > 0 ? q->n_exact - 1 : 0;
    if (!q->n_hid || q->hid0 >= need0) return;
    int32_t drop = need0 - q->hid0 < q->n_hid ? need0 - q->hid0 : q->n_hid;
    memmove(q->hid, q->hid + drop * d->E, (size_t)((q->n_hid - drop) * d->E) * sizeof *q->hid);
    q->hid0 += drop;
    q->n_hid -= drop;
}

/* Store rows [pos0, pos0 + n) of the target's hidden states h in q (those the block still
 * reads); a gap before them reads as zeros. false: no memory (then none are kept). */
static bool store_hid(dc_draft *d, draft_req *q, int32_t pos0, int32_t n, const float *h)
{
    const int64_t E = d->E;
    int32_t need0 = q->n_exact > 0 ? q->n_exact - 1 : 0;
    if (pos0 < need0) {
        int32_t skip = need0 - pos0;
        if (skip >= n) return true;
        pos0 += skip;
        h += skip * E;
        n -= skip;
    }
    if (!q->n_hid || pos0 < q->hid0) { /* nothing kept, or rows before them: start again */
        q->hid0 = pos0;
        q->n_hid = 0;
    }
    int32_t end = pos0 + n, old_end = q->hid0 + q->n_hid;
    if (end - q->hid0 > q->cap_hid) {
        int32_t cap = end - q->hid0 + 64;
        float *g = realloc(q->hid, (size_t)cap * (size_t)E * sizeof *g);
        if (!g) {
            q->n_hid = 0;
            return false;
        }
        q->hid = g;
        q->cap_hid = cap;
    }
    if (pos0 > old_end)
        memset(q->hid + (old_end - q->hid0) * E, 0,
               (size_t)((pos0 - old_end) * E) * sizeof *q->hid);
    memcpy(q->hid + (pos0 - q->hid0) * E, h, (size_t)(n * E) * sizeof *h);
    if (end > old_end) q->n_hid = end - q->hid0;
    return true;
}

/* Record r caught up to position upto of toks now, alone (no proposal). */
static void catch_up_now(dc_draft *d, int r, const int32_t *toks, int32_t upto)
{
    draft_req *q = &d->reqs[r];
    roll_back(d, q, kept_prefix(d, q, toks, upto));
    if (grow_call(d, 1) || !feed(d, q, toks, upto, upto)) return;
    d->act[0] = (draft_act){.rec = r, .i = 0, .n_in = upto, .row = -1, .far = true};
    int rc = catch_up(d, 1, NULL, NULL, INT64_MAX);
    if (rc) {
        TD_LOG_WARN("%s: draft model pass failed: %s", d->who, td_strerror(rc));
        empty_req(d, q);
    }
}

/* The target computed positions [pos0, pos0 + n) of request id (its tokens toks[0, n_toks);
 * an MTP block: h, their hidden states, kept until the block reads them). A chunk of more than
 * FAR_TOKENS rows (a prompt's prefill, colocated) is caught up at once, while the target
 * prefills it, so a prompt's catch-up does not land in one decode step (nor, for an MTP block,
 * are its rows all kept). A prompt computed elsewhere (the prefill stages) or served by the
 * prefix cache, whose last positions alone the target computes here, is caught up by the
 * proposals' calls, at most chunk tokens of it a call (catch_up). */
static void draft_computed(void *ctx, uint64_t id, int32_t pos0, int32_t n, const float *h,
                           const int32_t *toks, int32_t n_toks)
{
    dc_draft *d = ctx;
    if (n < 1 || (!d->mtp && n <= FAR_TOKENS)) return;
    int r = get_req(d, id);
    if (r < 0) return;
    draft_req *q = &d->reqs[r];
    /* positions whose token (and, for the block, input) are known: p < n_toks, and p below the
     * rows' end (a draft model) or p - 1 below it (the block reads the row before) */
    int32_t upto = pos0 + n;
    if (d->mtp) {
        trim_hid(d, q);
        if (!store_hid(d, q, pos0, n, h)) return;
        upto = q->hid0 + q->n_hid + 1;
    }
    if (upto > n_toks) upto = n_toks;
    if (n > FAR_TOKENS && upto - kept_prefix(d, q, toks, n_toks) > FAR_TOKENS) {
        int64_t t0 = td_now_ns();
        d->st.calls++;
        catch_up_now(d, r, toks, upto);
        if (d->mtp) trim_hid(d, q);
        d->st.ns += td_now_ns() - t0; /* the draft's share of the steps, wherever it ran */
    }
}

/* ---- the proposer's calls ---- */

static int draft_propose(void *ctx, int n, const uint64_t *ids, const int32_t *const *toks,
                         const int32_t *n_toks, const int *k, int32_t *const *out, int *n_out)
{
    dc_draft *d = ctx;
    int64_t t0 = td_now_ns();
    d->st.calls++;
    d->call_stale = 0;
    for (int i = 0; i < n; i++)
        n_out[i] = 0;
    int rc = grow_call(d, n);
    if (rc) return rc;
    int m = 0;
    for (int i = 0; i < n; i++)
        if (join_call(d, i, ids[i], toks[i], n_toks[i], k[i], &d->act[m])) m++;
    if (m && !(rc = catch_up(d, m, out, n_out, d->chunk))) rc = extend(d, m, k, out, n_out);
    if (rc) {
        /* the KV of the failed pass is unknown: its requests start again from nothing */
        TD_LOG_WARN("%s: draft model pass failed: %s", d->who, td_strerror(rc));
        for (int a = 0; a < m; a++) {
            empty_req(d, &d->reqs[d->act[a].rec]);
            n_out[d->act[a].i] = 0;
        }
    }
    for (int i = 0; i < n && !rc; i++)
        d->st.proposals += (uint64_t)n_out[i];
    d->st.ns += td_now_ns() - t0;
    return rc;
}

static int64_t draft_stale_tokens(void *ctx)
{
    return ((const dc_draft *)ctx)->call_stale;
}

dc_spec_proposer dc_draft_proposer(dc_draft *d)
{
    return (dc_spec_proposer){.ctx = d,
                              .propose = draft_propose,
                              .keep = draft_keep,
                              .drop = draft_drop,
                              .computed = draft_computed,
                              .stale_tokens = draft_stale_tokens,
                              .n_hidden = d->mtp ? (int)d->E : 0};
}
