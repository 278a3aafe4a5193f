/* ctrl_codec.c: envelope encode/decode with size, memory and field limits (no NNG). */
#include "ctrl_internal.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"

#define MAX_INSTANCE_NAME 256u
#define MAX_POLL_WAIT_MS  60000u
#define MAX_STAGES        256u

/* Defaults for a zeroed/NULL td_ctrl_opts (docs/control-plane.md). */
#define DEF_MAX_MSG    (4u << 20)
#define DEF_MAX_TOKENS (1u << 20)
#define DEF_MAX_OUTBOX (1u << 16)

void td_ctrl_opts_fill(const td_ctrl_opts *in, td_ctrl_opts *out)
{
    td_ctrl_opts o = {0};
    if (in) o = *in;
    if (!o.max_msg_bytes) o.max_msg_bytes = DEF_MAX_MSG;
    if (!o.max_tokens) o.max_tokens = DEF_MAX_TOKENS;
    if (!o.max_outbox) o.max_outbox = DEF_MAX_OUTBOX;
    if (o.poll_wait_ms <= 0) o.poll_wait_ms = 1000;
    if (o.peer_timeout_ms <= 0) o.peer_timeout_ms = 10000;
    if (o.peer_grace_ms <= 0) o.peer_grace_ms = 2000;
    if (o.reconnect_min_ms <= 0) o.reconnect_min_ms = 50;
    if (o.reconnect_max_ms <= 0) o.reconnect_max_ms = 1000;
    if (o.reconnect_max_ms < o.reconnect_min_ms) o.reconnect_max_ms = o.reconnect_min_ms;
    if (o.send_timeout_ms <= 0) o.send_timeout_ms = 5000;
    *out = o;
}

/* ---- byte-budgeted allocator: bounds the memory one message can make us allocate ---- */

typedef struct {
    size_t used, budget;
    int over;
} budget;

static void *budget_alloc(void *data, size_t size)
{
    budget *b = data;
    if (size > b->budget - b->used) {
        b->over = 1;
        return NULL;
    }
    b->used += size;
    return malloc(size ? size : 1);
}

static void budget_free(void *data, void *ptr)
{
    (void)data;
    free(ptr);
}

/* ---- validation ---------------------------------------------------------------------- */

typedef struct {
    const td_ctrl_opts *o;
    char *err;
    size_t errcap;
} vctx;

static int bad(vctx *v, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int bad(vctx *v, int code, const char *fmt, ...)
{
    if (v->err && v->errcap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(v->err, v->errcap, fmt, ap);
        va_end(ap);
    }
    return code;
}

static int check_tokens(vctx *v, const char *what, const int32_t *t, size_t n, size_t max)
{
    if (n > max)
        return bad(v, TD_ERANGE, "%s: %zu token ids, more than the limit of %zu", what, n, max);
    for (size_t i = 0; i < n; i++)
        if (t[i] < 0) return bad(v, TD_EINVAL, "%s[%zu]: negative token id %d", what, i, t[i]);
    return 0;
}

static int check_str(vctx *v, const char *what, const char *s, size_t max)
{
    if (s && strnlen(s, max + 1) > max)
        return bad(v, TD_ERANGE, "%s: string longer than %zu bytes", what, max);
    return 0;
}

static int check_blob(vctx *v, const char *what, const ProtobufCBinaryData *b)
{
    if (b->len > TD_CTRL_MAX_BLOB)
        return bad(v, TD_ERANGE, "%s: %zu bytes, more than the limit of %u", what, b->len,
                   TD_CTRL_MAX_BLOB);
    return 0;
}

/* A list of per-rank kvxfer targets (at most MAX_STAGES of them, each a bounded blob). */
static int check_blobs(vctx *v, const char *what, const ProtobufCBinaryData *b, size_t n)
{
    if (n > MAX_STAGES) return bad(v, TD_ERANGE, "%s: %zu entries, limit %u", what, n, MAX_STAGES);
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        int rc = check_blob(v, what, &b[i]);
        if (rc) return rc;
        total += b[i].len;
    }
    if (total > TD_CTRL_MAX_BLOB)
        return bad(v, TD_ERANGE, "%s: %zu bytes in all, more than the limit of %u", what, total,
                   TD_CTRL_MAX_BLOB);
    return 0;
}

void td_ctrl_sampling_to_pb(const td_sampling *s, Td__Sampling *pb)
{
    td__sampling__init(pb);
    pb->temperature = s->temperature;
    pb->top_k = s->top_k;
    pb->top_p = s->top_p;
    pb->min_p = s->min_p;
    pb->repeat_penalty = s->repeat_penalty;
    pb->repeat_last_n = s->repeat_last_n;
    pb->seed = s->seed;
    pb->skip_samples = s->skip_samples;
    pb->presence_penalty = s->presence_penalty;
    pb->frequency_penalty = s->frequency_penalty;
    /* the lists are borrowed from s: the proto's repeated fields point into it */
    if (s->n_logit_bias > 0) {
        pb->n_logit_bias_ids = pb->n_logit_bias_values = (size_t)s->n_logit_bias;
        pb->logit_bias_ids = (int32_t *)s->logit_bias_ids;
        pb->logit_bias_values = (float *)s->logit_bias_values;
    }
    pb->min_tokens = (uint32_t)s->min_tokens;
    if (s->min_tokens > 0 && s->n_min_tokens_ids > 0) {
        pb->n_min_tokens_ids = (size_t)s->n_min_tokens_ids;
        pb->min_tokens_ids = (int32_t *)s->min_tokens_ids;
    }
    pb->logprobs = s->logprobs;
    pb->prompt_logprobs = s->prompt_logprobs;
    pb->grammar_kind = (uint32_t)s->grammar_kind;
    if (s->grammar) pb->grammar = (char *)s->grammar; /* borrowed: packed before s goes */
}

td_sampling td_ctrl_sampling_from_pb(const Td__Sampling *pb)
{
    td_sampling s = {0};
    if (!pb) return s;
    s = (td_sampling){.temperature = pb->temperature,
                      .top_k = pb->top_k,
                      .top_p = pb->top_p,
                      .min_p = pb->min_p,
                      .repeat_penalty = pb->repeat_penalty,
                      .repeat_last_n = pb->repeat_last_n,
                      .seed = pb->seed,
                      .skip_samples = pb->skip_samples,
                      .presence_penalty = pb->presence_penalty,
                      .frequency_penalty = pb->frequency_penalty,
                      .min_tokens = (int32_t)pb->min_tokens,
                      .logprobs = pb->logprobs,
                      .prompt_logprobs = pb->prompt_logprobs,
                      .grammar_kind = (int32_t)pb->grammar_kind,
                      /* borrowed from the message; "" (proto3's default) is none */
                      .grammar = pb->grammar && pb->grammar[0] ? pb->grammar : NULL};
    /* check_sampling bounded the counts; the clamps keep an unchecked message in bounds */
    size_t nb = pb->n_logit_bias_ids < pb->n_logit_bias_values ? pb->n_logit_bias_ids
                                                               : pb->n_logit_bias_values;
    if (nb > TD_MAX_LOGIT_BIAS) nb = TD_MAX_LOGIT_BIAS;
    if (nb) {
        memcpy(s.logit_bias_ids, pb->logit_bias_ids, nb * sizeof *s.logit_bias_ids);
        memcpy(s.logit_bias_values, pb->logit_bias_values, nb * sizeof *s.logit_bias_values);
    }
    s.n_logit_bias = (int32_t)nb;
    size_t nm =
        pb->n_min_tokens_ids > TD_MAX_MIN_TOKENS_IDS ? TD_MAX_MIN_TOKENS_IDS : pb->n_min_tokens_ids;
    if (nm) memcpy(s.min_tokens_ids, pb->min_tokens_ids, nm * sizeof *s.min_tokens_ids);
    s.n_min_tokens_ids = (int32_t)nm;
    return s;
}

Td__Logprob **td_ctrl_logprobs_to_pb(const td_logprob_entry *e, size_t n)
{
    if (!n) return NULL;
    size_t n_top = 0;
    for (size_t i = 0; i < n; i++)
        n_top += (size_t)e[i].n_top;
    /* pointers, then messages, then ids and values (all 4- or 8-byte aligned) */
    size_t bytes = n * (sizeof(Td__Logprob *) + sizeof(Td__Logprob)) + n_top * 8;
    Td__Logprob **v = malloc(bytes);
    if (!v) return NULL;
    Td__Logprob *m = (Td__Logprob *)(v + n);
    int32_t *ids = (int32_t *)(m + n);
    float *vals = (float *)(ids + n_top);
    for (size_t i = 0; i < n; i++) {
        td__logprob__init(&m[i]);
        m[i].logprob = e[i].logprob;
        m[i].n_top_ids = m[i].n_top_logprobs = (size_t)e[i].n_top;
        m[i].top_ids = ids;
        m[i].top_logprobs = vals;
        for (int32_t j = 0; j < e[i].n_top; j++) {
            *ids++ = e[i].top[j].id;
            *vals++ = e[i].top[j].logprob;
        }
        v[i] = &m[i];
    }
    return v;
}

void td_ctrl_logprob_from_pb(const Td__Logprob *pb, td_logprob_entry *e)
{
    size_t k = pb->n_top_ids < pb->n_top_logprobs ? pb->n_top_ids : pb->n_top_logprobs;
    if (k > TD_MAX_TOP_LOGPROBS) k = TD_MAX_TOP_LOGPROBS;
    e->logprob = pb->logprob;
    e->n_top = (int32_t)k;
    for (size_t j = 0; j < k; j++)
        e->top[j] = (td_logprob){.id = pb->top_ids[j], .logprob = pb->top_logprobs[j]};
}

/* n_prompt: the request's prompt tokens (skip_samples counts tokens among them). */
static int check_sampling(vctx *v, const Td__Sampling *s, size_t n_prompt)
{
    if (!s) return 0;
    if (s->skip_samples >= n_prompt)
        return bad(v, TD_EINVAL, "sampling: skip_samples %u of a %zu-token prompt", s->skip_samples,
                   n_prompt);
    if (!isfinite(s->temperature) || !isfinite(s->top_p) || !isfinite(s->min_p) ||
        !isfinite(s->repeat_penalty) || !isfinite(s->presence_penalty) ||
        !isfinite(s->frequency_penalty))
        return bad(v, TD_EINVAL, "sampling: non-finite parameter");
    if (s->repeat_last_n < 0)
        return bad(v, TD_EINVAL, "sampling: negative repeat_last_n %d", s->repeat_last_n);
    if (s->n_logit_bias_ids != s->n_logit_bias_values || s->n_logit_bias_ids > TD_MAX_LOGIT_BIAS)
        return bad(v, TD_ERANGE, "sampling: %zu logit bias ids and %zu values (at most %d)",
                   s->n_logit_bias_ids, s->n_logit_bias_values, TD_MAX_LOGIT_BIAS);
    for (size_t i = 0; i < s->n_logit_bias_ids; i++)
        if (s->logit_bias_ids[i] < 0 || !isfinite(s->logit_bias_values[i]))
            return bad(v, TD_EINVAL, "sampling: logit bias entry %zu is invalid", i);
    if (s->n_min_tokens_ids > TD_MAX_MIN_TOKENS_IDS || s->min_tokens > INT32_MAX)
        return bad(v, TD_ERANGE, "sampling: %zu min_tokens ids (at most %d)", s->n_min_tokens_ids,
                   TD_MAX_MIN_TOKENS_IDS);
    for (size_t i = 0; i < s->n_min_tokens_ids; i++)
        if (s->min_tokens_ids[i] < 0)
            return bad(v, TD_EINVAL, "sampling: negative min_tokens id %d", s->min_tokens_ids[i]);
    if (s->logprobs > TD_CTRL_MAX_LOGPROBS + 1)
        return bad(v, TD_EINVAL, "sampling: logprobs %u over %u", s->logprobs,
                   TD_CTRL_MAX_LOGPROBS + 1);
    if (s->prompt_logprobs && !s->logprobs)
        return bad(v, TD_EINVAL, "sampling: prompt_logprobs without logprobs");
    if (s->grammar_kind > TD_GRAMMAR_JSON_SCHEMA_STRICT)
        return bad(v, TD_EINVAL, "sampling: unknown grammar_kind %u", s->grammar_kind);
    size_t glen = s->grammar ? strlen(s->grammar) : 0;
    if (glen > TD_CTRL_MAX_GRAMMAR)
        return bad(v, TD_ERANGE, "sampling: grammar of %zu bytes, more than %u", glen,
                   TD_CTRL_MAX_GRAMMAR);
    if ((s->grammar_kind >= TD_GRAMMAR_JSON_SCHEMA) != (glen > 0))
        return bad(v, TD_EINVAL, "sampling: grammar_kind %u with %s schema text", s->grammar_kind,
                   glen ? "a" : "no");
    return 0;
}

/* Logprob entries (n): at most TD_CTRL_MAX_LOGPROBS alternatives, as many ids as values,
 * ids >= 0, values finite or -inf (a token the model rules out). */
static int check_logprobs(vctx *v, const char *what, Td__Logprob *const *e, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!e[i]) return bad(v, TD_EINVAL, "%s[%zu]: missing", what, i);
        if (e[i]->n_top_ids != e[i]->n_top_logprobs || e[i]->n_top_ids > TD_CTRL_MAX_LOGPROBS)
            return bad(v, TD_EINVAL, "%s[%zu]: %zu ids, %zu values (at most %u)", what, i,
                       e[i]->n_top_ids, e[i]->n_top_logprobs, TD_CTRL_MAX_LOGPROBS);
        if (isnan(e[i]->logprob) || e[i]->logprob > 0)
            return bad(v, TD_EINVAL, "%s[%zu]: logprob %g", what, i, e[i]->logprob);
        for (size_t j = 0; j < e[i]->n_top_ids; j++)
            if (e[i]->top_ids[j] < 0 || isnan(e[i]->top_logprobs[j]) || e[i]->top_logprobs[j] > 0)
                return bad(v, TD_EINVAL, "%s[%zu]: top %zu: id %d logprob %g", what, i, j,
                           e[i]->top_ids[j], e[i]->top_logprobs[j]);
    }
    return 0;
}

static int check_token_event(vctx *v, const Td__TokenEvent *t)
{
    int rc;
    if (!t->request_id) return bad(v, TD_EINVAL, "token event: request_id 0");
    if ((unsigned)t->finish > TD__FINISH_REASON__FINISH_ERROR)
        return bad(v, TD_EINVAL, "token event: unknown finish reason %d", t->finish);
    if (t->n_logprobs && t->n_logprobs != t->n_token_ids)
        return bad(v, TD_EINVAL, "token event: %zu logprobs for %zu tokens", t->n_logprobs,
                   t->n_token_ids);
    if (t->n_prompt_logprobs > v->o->max_tokens)
        return bad(v, TD_ERANGE, "token event: %zu prompt logprobs", t->n_prompt_logprobs);
    if ((rc = check_logprobs(v, "token.logprobs", t->logprobs, t->n_logprobs)) ||
        (rc = check_logprobs(v, "token.prompt_logprobs", t->prompt_logprobs, t->n_prompt_logprobs)))
        return rc;
    return check_tokens(v, "token.token_ids", t->token_ids, t->n_token_ids, v->o->max_tokens);
}

static int check_submit(vctx *v, const Td__Submit *m)
{
    int rc;
    if (!m->request_id) return bad(v, TD_EINVAL, "submit: request_id 0");
    if (!m->n_token_ids)
        return bad(v, TD_EINVAL, "submit %llu: empty prompt", (unsigned long long)m->request_id);
    if ((rc = check_tokens(v, "submit.token_ids", m->token_ids, m->n_token_ids, v->o->max_tokens)))
        return rc;
    if ((rc = check_tokens(v, "submit.stop_token_ids", m->stop_token_ids, m->n_stop_token_ids,
                           TD_CTRL_MAX_STOP_IDS)))
        return rc;
    if (!m->max_tokens)
        return bad(v, TD_EINVAL, "submit %llu: max_tokens 0", (unsigned long long)m->request_id);
    return check_sampling(v, m->sampling, m->n_token_ids);
}

static int check_event(vctx *v, const Td__Event *e)
{
    int rc;
    switch (e->body_case) {
    case TD__EVENT__BODY_TOKEN:
        return check_token_event(v, e->token);
    case TD__EVENT__BODY_ERROR:
        return check_str(v, "error.message", e->error->message, TD_CTRL_MAX_STRING);
    case TD__EVENT__BODY_PREFILL_DONE:
        if (e->prefill_done->first_token < 0)
            return bad(v, TD_EINVAL, "prefill_done: negative first token");
        if (e->prefill_done->n_chunk_sizes > TD_CTRL_MAX_CHUNKS)
            return bad(v, TD_ERANGE, "prefill_done: %zu chunk sizes",
                       e->prefill_done->n_chunk_sizes);
        if (e->prefill_done->first_logprob)
            return check_logprobs(v, "prefill_done.first_logprob", &e->prefill_done->first_logprob,
                                  1);
        return 0;
    default:
        rc = bad(v, TD_EINVAL, "event %llu without a body", (unsigned long long)e->seq);
    }
    return rc;
}

static int check_health(vctx *v, const Td__Health *h)
{
    const struct {
        const char *what, *s;
        size_t max;
    } strs[] = {{"health.instance", h->instance, MAX_INSTANCE_NAME},
                {"health.backend", h->backend, TD_CTRL_MAX_TAG},
                {"health.act", h->act, TD_CTRL_MAX_TAG},
                {"health.cpu_isa", h->cpu_isa, TD_CTRL_MAX_TAG},
                {"health.kernels_isa", h->kernels_isa, TD_CTRL_MAX_TAG},
                {"health.blas_core", h->blas_core, TD_CTRL_MAX_TAG},
                {"health.compute_paths", h->compute_paths, TD_CTRL_MAX_PATHS}};
    for (size_t i = 0; i < sizeof strs / sizeof *strs; i++) {
        int rc = check_str(v, strs[i].what, strs[i].s, strs[i].max);
        if (rc) return rc;
    }
    return 0;
}

static int check_body(vctx *v, const Td__Envelope *e)
{
    int rc;
    switch (e->body_case) {
    case TD__ENVELOPE__BODY_SUBMIT:
        return check_submit(v, e->submit);
    case TD__ENVELOPE__BODY_CANCEL:
        return e->cancel->request_id ? 0 : bad(v, TD_EINVAL, "cancel: request_id 0");
    case TD__ENVELOPE__BODY_HEALTH_REQUEST:
        return 0;
    case TD__ENVELOPE__BODY_POLL:
        if (e->poll->wait_ms > MAX_POLL_WAIT_MS)
            return bad(v, TD_ERANGE, "poll: wait_ms %u over %u", e->poll->wait_ms,
                       MAX_POLL_WAIT_MS);
        return 0;
    case TD__ENVELOPE__BODY_ALLOC:
        if (!e->alloc->request) return bad(v, TD_EINVAL, "alloc: no request");
        if (e->alloc->n_stages > MAX_STAGES)
            return bad(v, TD_ERANGE, "alloc: %u stages", e->alloc->n_stages);
        return check_submit(v, e->alloc->request);
    case TD__ENVELOPE__BODY_PREFILL:
        if (!e->prefill->request_id) return bad(v, TD_EINVAL, "prefill: request_id 0");
        if (!e->prefill->n_token_ids) return bad(v, TD_EINVAL, "prefill: empty prompt");
        if ((rc = check_tokens(v, "prefill.token_ids", e->prefill->token_ids,
                               e->prefill->n_token_ids, v->o->max_tokens)) ||
            (rc = check_sampling(v, e->prefill->sampling, e->prefill->n_token_ids)) ||
            (rc = check_blobs(v, "prefill.kv_targets", e->prefill->kv_targets,
                              e->prefill->n_kv_targets)))
            return rc;
        if (e->prefill->n_decode_ranks > MAX_STAGES)
            return bad(v, TD_ERANGE, "prefill: %u decode ranks", e->prefill->n_decode_ranks);
        return check_str(v, "prefill.decode_instance", e->prefill->decode_instance,
                         MAX_INSTANCE_NAME);
    case TD__ENVELOPE__BODY_KV_TARGET:
        if (!e->kv_target->request_id) return bad(v, TD_EINVAL, "kv_target: request_id 0");
        if (!e->kv_target->n_kv_targets) return bad(v, TD_EINVAL, "kv_target: no targets");
        return check_blobs(v, "kv_target.kv_targets", e->kv_target->kv_targets,
                           e->kv_target->n_kv_targets);
    case TD__ENVELOPE__BODY_STAGE_HELLO: {
        const Td__StageHello *h = e->stage_hello;
        if (!h->pp || h->pp > MAX_STAGES || h->stage >= h->pp)
            return bad(v, TD_EINVAL, "stage_hello: stage %u of pp %u", h->stage, h->pp);
        if (!h->pipe_address.len) return bad(v, TD_EINVAL, "stage_hello: no pipe address");
        if ((rc = check_blob(v, "stage_hello.pipe_address", &h->pipe_address))) return rc;
        return check_str(v, "stage_hello.instance", h->instance, MAX_INSTANCE_NAME);
    }
    case TD__ENVELOPE__BODY_JOIN: {
        const Td__Join *j = e->join;
        if (j->role != TD__ROLE__ROLE_DECODE && j->role != TD__ROLE__ROLE_PREFILL)
            return bad(v, TD_EINVAL, "join: role %d is not decode or prefill", (int)j->role);
        if (!j->name || !j->name[0] || !j->url || !j->url[0])
            return bad(v, TD_EINVAL, "join: no name or no url");
        if (j->tp > MAX_STAGES || j->pp > MAX_STAGES)
            return bad(v, TD_ERANGE, "join: tp %u, pp %u", j->tp, j->pp);
        if ((rc = check_str(v, "join.name", j->name, MAX_INSTANCE_NAME)) ||
            (rc = check_str(v, "join.url", j->url, MAX_INSTANCE_NAME)))
            return rc;
        return check_str(v, "join.template_name", j->template_name, MAX_INSTANCE_NAME);
    }
    case TD__ENVELOPE__BODY_ACK:
        return 0;
    case TD__ENVELOPE__BODY_ERROR:
        return check_str(v, "error.message", e->error->message, TD_CTRL_MAX_STRING);
    case TD__ENVELOPE__BODY_HEALTH:
        return check_health(v, e->health);
    case TD__ENVELOPE__BODY_EVENTS: {
        const Td__Events *ev = e->events;
        if (ev->n_events > TD_CTRL_MAX_BATCH)
            return bad(v, TD_ERANGE, "events: %zu in one batch, limit %u", ev->n_events,
                       TD_CTRL_MAX_BATCH);
        for (size_t i = 0; i < ev->n_events; i++) {
            if (!ev->events[i]->seq) return bad(v, TD_EINVAL, "events[%zu]: seq 0", i);
            if (i && ev->events[i]->seq != ev->events[i - 1]->seq + 1)
                return bad(v, TD_EINVAL, "events[%zu]: seq %llu does not follow %llu", i,
                           (unsigned long long)ev->events[i]->seq,
                           (unsigned long long)ev->events[i - 1]->seq);
            if ((rc = check_event(v, ev->events[i]))) return rc;
        }
        return ev->health ? check_health(v, ev->health) : 0;
    }
    case TD__ENVELOPE__BODY_ALLOC_REPLY:
        return check_blobs(v, "alloc_reply.kv_targets", e->alloc_reply->kv_targets,
                           e->alloc_reply->n_kv_targets);
    case TD__ENVELOPE__BODY_STAGE_TABLE:
        if (e->stage_table->n_boot_ids != e->stage_table->n_pipe_addresses)
            return bad(v, TD_EINVAL, "stage_table: %zu addresses, %zu boot ids",
                       e->stage_table->n_pipe_addresses, e->stage_table->n_boot_ids);
        return check_blobs(v, "stage_table.pipe_addresses", e->stage_table->pipe_addresses,
                           e->stage_table->n_pipe_addresses);
    default:
        return bad(v, TD_EINVAL, "envelope without a body (or an unknown one)");
    }
}

/* The version is field 1 and protobuf-c writes fields in number order, so a peer of
 * another version is recognised from the first bytes even when its body would not
 * decode with our schema. Returns the version, or -1 if the message does not start with
 * field 1. */
static int64_t peek_version(const uint8_t *p, size_t len)
{
    if (len < 2 || p[0] != 0x08) return -1; /* field 1, wire type varint */
    uint64_t v = 0;
    for (size_t i = 1; i < len && i < 11; i++) {
        v |= (uint64_t)(p[i] & 0x7f) << (7 * (i - 1));
        if (!(p[i] & 0x80)) return v > 0xffffffffu ? -1 : (int64_t)v;
    }
    return -1;
}

int td_ctrl_decode(const void *buf, size_t len, const td_ctrl_opts *opts, Td__Envelope **out,
                   char *err, size_t errcap)
{
    td_ctrl_opts o;
    td_ctrl_opts_fill(opts, &o);
    vctx v = {.o = &o, .err = err, .errcap = errcap};
    *out = NULL;
    if (err && errcap) err[0] = 0;
    if (len > o.max_msg_bytes)
        return bad(&v, TD_ERANGE, "message of %zu bytes exceeds the limit of %zu bytes", len,
                   o.max_msg_bytes);
    if (len == 0 || !buf) return bad(&v, TD_EFORMAT, "empty message");
    int64_t ver = peek_version(buf, len);
    if (ver >= 0 && ver != TD_CTRL_VERSION)
        return bad(&v, TD_EUNSUPP,
                   "peer speaks control protocol version %lld, this build speaks %u",
                   (long long)ver, TD_CTRL_VERSION);

    budget b = {.budget = 32 * len + (64u << 10)};
    ProtobufCAllocator a = {.alloc = budget_alloc, .free = budget_free, .allocator_data = &b};
    Td__Envelope *e = td__envelope__unpack(&a, len, buf);
    if (!e) {
        if (b.over)
            return bad(&v, TD_ERANGE, "message of %zu bytes decodes to more than %zu bytes", len,
                       b.budget);
        return bad(&v, TD_EFORMAT,
                   "malformed envelope (%zu bytes): not valid protobuf or "
                   "truncated",
                   len);
    }
    int rc = 0;
    if (e->version != TD_CTRL_VERSION)
        rc = bad(&v, TD_EUNSUPP, "peer speaks control protocol version %u, this build speaks %u",
                 e->version, TD_CTRL_VERSION);
    else
        rc = check_body(&v, e);
    if (rc) {
        td_ctrl_envelope_free(e);
        return rc;
    }
    *out = e;
    return 0;
}

void td_ctrl_envelope_free(Td__Envelope *env)
{
    if (env) td__envelope__free_unpacked(env, NULL); /* budget_alloc used malloc */
}

int td_ctrl_encode(const Td__Envelope *env, const td_ctrl_opts *opts, uint8_t **buf, size_t *len)
{
    td_ctrl_opts o;
    td_ctrl_opts_fill(opts, &o);
    *buf = NULL;
    *len = 0;
    if (!env || env->body_case == TD__ENVELOPE__BODY__NOT_SET) {
        TD_LOG_ERR("ctrl encode: envelope without a body");
        return TD_EINVAL;
    }
    Td__Envelope e = *env;
    if (!e.version) e.version = TD_CTRL_VERSION;
    size_t n = td__envelope__get_packed_size(&e);
    if (n > o.max_msg_bytes) {
        TD_LOG_ERR("ctrl encode: %s message of %zu bytes exceeds the limit of %zu bytes",
                   td_ctrl_body_name(e.body_case), n, o.max_msg_bytes);
        return TD_ERANGE;
    }
    uint8_t *p = malloc(n ? n : 1);
    if (!p) return TD_ENOMEM;
    td__envelope__pack(&e, p);
    *buf = p;
    *len = n;
    return 0;
}

Td__ErrorCode td_ctrl_err_code(int err)
{
    switch (err) {
    case TD_OK:
        return TD__ERROR_CODE__ERR_NONE;
    case TD_EFORMAT:
        return TD__ERROR_CODE__ERR_MALFORMED;
    case TD_ERANGE:
        return TD__ERROR_CODE__ERR_TOO_LARGE;
    case TD_EUNSUPP:
        return TD__ERROR_CODE__ERR_VERSION;
    case TD_EINVAL:
        return TD__ERROR_CODE__ERR_INVALID;
    case TD_ETIMEDOUT:
        return TD__ERROR_CODE__ERR_TIMEOUT;
    case TD_ENOSPC:
        return TD__ERROR_CODE__ERR_NO_SPACE;
    case TD_ENOENT:
        return TD__ERROR_CODE__ERR_NOT_FOUND;
    case TD_ESTATE:
        return TD__ERROR_CODE__ERR_SHUTDOWN;
    default:
        return TD__ERROR_CODE__ERR_INTERNAL;
    }
}

const char *td_ctrl_err_name(Td__ErrorCode code)
{
    const ProtobufCEnumValue *v =
        protobuf_c_enum_descriptor_get_value(&td__error_code__descriptor, (int)code);
    return v ? v->name : "ERR_UNKNOWN";
}

const char *td_ctrl_body_name(Td__Envelope__BodyCase body)
{
    const ProtobufCFieldDescriptor *f =
        protobuf_c_message_descriptor_get_field(&td__envelope__descriptor, (unsigned)body);
    return f ? f->name : "none";
}
