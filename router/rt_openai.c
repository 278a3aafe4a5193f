/* rt_openai.c: OpenAI request bodies -> rt_params (validated), error objects, /v1/models.
 * Runs on the HTTP threads; reads only the router's read-only state (config, tokenizer,
 * chat template). Every rejection names the field (param) and says what was expected. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rt_openai.h"
#include "rt_format.h"
#include "rt_reason.h"
#include "td_clock.h"
#include "td_err.h"

void rt_params_fini(rt_params *p)
{
    free(p->prompt);
    for (int i = 0; i < p->n_more; i++)
        free(p->more[i].ids);
    free(p->more);
    free(p->grammar);
    for (int i = 0; i < p->n_stop; i++)
        free(p->stop[i]);
    rt_chat_tools_fini(&p->tools);
    *p = (rt_params){0};
}

/* ---- field helpers: each returns 0 or the HTTP status with e filled ---- */

static int bad(rt_error *e, const char *param, const char *fmt, const char *what)
{
    return rt_error_set(e, 400, param, NULL, fmt, param, what);
}

static bool absent(const json_t *v)
{
    return !v || json_is_null(v);
}

static int get_number(json_t *o, const char *key, double lo, double hi, double *out, rt_error *e)
{
    json_t *v = json_object_get(o, key);
    if (absent(v)) return 0;
    if (!json_is_number(v)) return bad(e, key, "'%s' must be a number%s", "");
    double d = json_number_value(v);
    if (!isfinite(d) || d < lo || d > hi) {
        char what[96];
        snprintf(what, sizeof what, " in [%g, %g], got %g", lo, hi, d);
        return bad(e, key, "'%s' must be a number%s", what);
    }
    *out = d;
    return 0;
}

static int get_int(json_t *o, const char *key, long long lo, long long hi, long long *out,
                   rt_error *e)
{
    json_t *v = json_object_get(o, key);
    if (absent(v)) return 0;
    if (!json_is_integer(v)) return bad(e, key, "'%s' must be an integer%s", "");
    long long x = json_integer_value(v);
    if (x < lo || x > hi) {
        char what[96];
        snprintf(what, sizeof what, " in [%lld, %lld], got %lld", lo, hi, x);
        return bad(e, key, "'%s' must be an integer%s", what);
    }
    *out = x;
    return 0;
}

static int get_bool(json_t *o, const char *key, bool *out, rt_error *e)
{
    json_t *v = json_object_get(o, key);
    if (absent(v)) return 0;
    if (!json_is_boolean(v)) return bad(e, key, "'%s' must be a boolean%s", "");
    *out = json_is_true(v);
    return 0;
}

static int parse_stop(json_t *o, rt_params *p, rt_error *e)
{
    json_t *v = json_object_get(o, "stop");
    if (absent(v)) return 0;
    json_t *one[1] = {v};
    json_t **items = one;
    size_t n = 1;
    if (json_is_array(v)) {
        n = json_array_size(v);
        if (n > RT_MAX_STOP)
            return rt_error_set(e, 400, "stop", NULL, "'stop' takes at most %d strings, got %zu",
                                RT_MAX_STOP, n);
    } else if (!json_is_string(v)) {
        return bad(e, "stop", "'%s' must be a string or an array of strings%s", "");
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = json_is_array(v) ? json_array_get(v, i) : items[0];
        if (!json_is_string(s))
            return bad(e, "stop", "'%s' must be a string or an array of strings%s", "");
        size_t len = json_string_length(s);
        if (len == 0) continue; /* an empty stop string never matches anything useful */
        if (len > RT_MAX_STOP_BYTES)
            return rt_error_set(e, 400, "stop", NULL, "a stop string is longer than %d bytes",
                                RT_MAX_STOP_BYTES);
        char *c = malloc(len + 1);
        if (!c) return rt_error_set(e, 500, NULL, NULL, "out of memory");
        memcpy(c, json_string_value(s), len + 1);
        p->stop[p->n_stop] = c;
        p->stop_len[p->n_stop++] = len;
    }
    return 0;
}

static int tokenize(const rt_model *r, const char *text, size_t len, bool add_special,
                    int32_t **ids, size_t *n, rt_error *e)
{
    int rc = td_tok_encode(r->tok, text, len, add_special, true, ids, n);
    if (rc)
        return rt_error_set(e, 500, NULL, NULL, "cannot tokenize the prompt: %s", td_strerror(rc));
    return 0;
}

int rt_openai_tokenize(const rt_model *r, const char *text, size_t len, bool add_special,
                       rt_params *p, rt_error *e)
{
    return tokenize(r, text, len, add_special, &p->prompt, &p->n_prompt, e);
}

/* One prompt, a string or an array of token ids, into (ids, n); `what` names it in errors
 * ("prompt", or "prompt[i]" in a batch). */
static int parse_one(const rt_model *r, json_t *v, const char *what, int32_t **out, size_t *n_out,
                     rt_error *e)
{
    if (json_is_string(v))
        return tokenize(r, json_string_value(v), json_string_length(v), true, out, n_out, e);
    if (!json_is_array(v))
        return rt_error_set(e, 400, "prompt", NULL,
                            "'%s' must be a string or an array of token ids", what);
    size_t n = json_array_size(v);
    if (n == 0) return rt_error_set(e, 400, "prompt", NULL, "'%s' is empty", what);
    if (n > (size_t)r->limits->max_prompt_tokens) n = (size_t)r->limits->max_prompt_tokens + 1;
    int32_t *ids = malloc(n * sizeof *ids);
    if (!ids) return rt_error_set(e, 500, NULL, NULL, "out of memory");
    int32_t nv = td_tok_n_vocab(r->tok);
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(v, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) >= nv) {
            free(ids);
            return rt_error_set(e, 400, "prompt", NULL,
                                "'%s' token ids must be integers in [0, %d); element %zu is not",
                                what, nv, i);
        }
        ids[i] = (int32_t)json_integer_value(t);
    }
    *out = ids;
    *n_out = n;
    return 0;
}

/* "prompt": one prompt, or a batch (an array of strings / token-id arrays): the first goes to
 * p->prompt, the others to p->more (their max_tokens are set by parse_obj). */
static int parse_prompt(const rt_model *r, json_t *o, rt_params *p, rt_error *e)
{
    json_t *v = json_object_get(o, "prompt");
    if (absent(v)) return rt_error_set(e, 400, "prompt", NULL, "'prompt' is required");
    bool batch = json_is_array(v) && json_array_size(v) > 0 &&
                 (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0)));
    if (!batch) return parse_one(r, v, "prompt", &p->prompt, &p->n_prompt, e);
    size_t n = json_array_size(v);
    int cap = r->limits->max_batch_prompts > 0 ? r->limits->max_batch_prompts : 1;
    if (n > (size_t)cap)
        return rt_error_set(e, 400, "prompt", NULL,
                            "'prompt' holds %zu prompts; at most %d "
                            "(router.max_batch_prompts) may be sent in one request",
                            n, cap);
    if (n > 1 && !(p->more = calloc(n - 1, sizeof *p->more)))
        return rt_error_set(e, 500, NULL, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        char what[32];
        snprintf(what, sizeof what, "prompt[%zu]", i);
        json_t *el = json_array_get(v, i);
        if (!json_is_string(el) && !json_is_array(el))
            return rt_error_set(e, 400, "prompt", NULL,
                                "'%s' must be a string or an array of token ids (a batch holds "
                                "prompts of either kind)",
                                what);
        int rc = i == 0 ? parse_one(r, el, what, &p->prompt, &p->n_prompt, e)
                        : parse_one(r, el, what, &p->more[i - 1].ids, &p->more[i - 1].n, e);
        if (rc) return rc;
        if (i > 0) p->n_more = (int)i;
    }
    return 0;
}

/* The messages (and tools) rendered with the model's template (rt_chat.c), tokenized. */
static int parse_messages(const rt_model *r, json_t *o, rt_params *p, rt_error *e)
{
    return rt_openai_messages(r, o, true, p, e);
}

int rt_openai_messages(const rt_model *r, json_t *o, bool add_generation_prompt, rt_params *p,
                       rt_error *e)
{
    char *text = NULL;
    int rc = rt_chat_prompt(&r->chat, o, add_generation_prompt, &p->tools, &text, e);
    /* the template writes BOS itself where the model wants one */
    if (!rc) rc = tokenize(r, text, strlen(text), false, &p->prompt, &p->n_prompt, e);
    /* a forced call's output is the call's JSON, never a thinking block */
    if (!rc && r->chat.thinks && r->limits->reasoning && !p->tools.forced) {
        p->reasoning = true;
        p->reasoning_fmt = r->chat.thinks;
        p->reasoning_open = rt_reason_prompt_open(r->chat.thinks, text, strlen(text));
    }
    free(text);
    return rc;
}

/* tool_choice required or a named function (rt_chat.h): the call's schema becomes the
 * request's grammar. */
static int forced_call(rt_params *p, rt_error *e)
{
    if (!p->tools.grammar) return 0;
    if (p->sampling.grammar_kind)
        return rt_error_set(e, 400, "response_format", NULL,
                            "'response_format' cannot be combined with tool_choice \"required\" "
                            "or a named function (the output is the call)");
    p->grammar = p->tools.grammar;
    p->tools.grammar = NULL;
    p->sampling.grammar_kind =
        p->tools.strict ? TD_GRAMMAR_JSON_SCHEMA_STRICT : TD_GRAMMAR_JSON_SCHEMA;
    p->sampling.grammar = p->grammar;
    return 0;
}

/* OpenAI's logit_bias: {"token id": bias in [-100, 100]}, at most TD_MAX_LOGIT_BIAS entries. */
static int parse_logit_bias(const rt_model *r, json_t *o, td_sampling *sp, rt_error *e)
{
    json_t *v = json_object_get(o, "logit_bias"), *b;
    if (absent(v)) return 0;
    if (!json_is_object(v))
        return bad(e, "logit_bias", "'%s' must be an object mapping token ids to biases%s", "");
    if (json_object_size(v) > TD_MAX_LOGIT_BIAS)
        return rt_error_set(e, 400, "logit_bias", NULL,
                            "'logit_bias' takes at most %d entries, got %zu", TD_MAX_LOGIT_BIAS,
                            json_object_size(v));
    int32_t nv = td_tok_n_vocab(r->tok);
    const char *key;
    json_object_foreach(v, key, b)
    {
        char *end;
        errno = 0;
        long id = strtol(key, &end, 10);
        if (!*key || *end || errno || id < 0 || id >= nv || (key[0] == '0' && key[1]))
            return rt_error_set(e, 400, "logit_bias", NULL,
                                "'logit_bias' keys must be token ids in [0, %d); '%.40s' is not",
                                nv, key);
        double d = json_is_number(b) ? json_number_value(b) : NAN;
        if (!(d >= -100 && d <= 100))
            return rt_error_set(e, 400, "logit_bias", NULL,
                                "'logit_bias' values must be numbers in [-100, 100]; token %ld's "
                                "is not",
                                id);
        sp->logit_bias_ids[sp->n_logit_bias] = (int32_t)id;
        sp->logit_bias_values[sp->n_logit_bias++] = (float)d;
    }
    return 0;
}

/* vLLM's stop_token_ids: token ids that end the request, as an end-of-generation id does. */
static int parse_stop_ids(const rt_model *r, json_t *o, rt_params *p, rt_error *e)
{
    json_t *v = json_object_get(o, "stop_token_ids");
    if (absent(v)) return 0;
    if (!json_is_array(v))
        return bad(e, "stop_token_ids", "'%s' must be an array of token ids%s", "");
    if (json_array_size(v) > RT_MAX_STOP_IDS)
        return rt_error_set(e, 400, "stop_token_ids", NULL,
                            "'stop_token_ids' takes at most %d ids, got %zu", RT_MAX_STOP_IDS,
                            json_array_size(v));
    int32_t nv = td_tok_n_vocab(r->tok);
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *t = json_array_get(v, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) >= nv)
            return rt_error_set(e, 400, "stop_token_ids", NULL,
                                "'stop_token_ids' must be integers in [0, %d); element %zu is not",
                                nv, i);
        p->stop_ids[p->n_stop_ids++] = (int32_t)json_integer_value(t);
    }
    return 0;
}

/* vLLM's min_tokens: the stop ids and (unless ignore_eos) the model's end-of-generation ids are
 * masked in the sampler until min_tokens tokens were generated. */
static int set_min_tokens(const rt_model *r, long long min_tokens, rt_params *p, rt_error *e)
{
    td_sampling *sp = &p->sampling;
    if (min_tokens > p->max_tokens)
        return rt_error_set(e, 400, "min_tokens", NULL,
                            "'min_tokens' (%lld) must not exceed max_tokens (%d)", min_tokens,
                            p->max_tokens);
    if (min_tokens <= 0) return 0;
    sp->min_tokens = (int32_t)min_tokens;
    for (int i = 0; i < p->n_stop_ids; i++)
        sp->min_tokens_ids[sp->n_min_tokens_ids++] = p->stop_ids[i];
    int32_t nv = td_tok_n_vocab(r->tok);
    for (int32_t id = 0; id < nv && !p->ignore_eos; id++) {
        if (!td_tok_is_eog(r->tok, id)) continue;
        if (sp->n_min_tokens_ids == TD_MAX_MIN_TOKENS_IDS)
            return rt_error_set(e, 400, "min_tokens", NULL,
                                "'min_tokens' would mask more than %d stop and end-of-generation "
                                "ids; send fewer stop_token_ids",
                                TD_MAX_MIN_TOKENS_IDS);
        sp->min_tokens_ids[sp->n_min_tokens_ids++] = id;
    }
    return 0;
}

static int check_model(const rt_model *r, json_t *o, rt_error *e)
{
    json_t *v = json_object_get(o, "model");
    if (absent(v)) return 0;
    if (!json_is_string(v)) return bad(e, "model", "'%s' must be a string%s", "");
    const char *m = json_string_value(v);
    if (rt_openai_model_is(r, m)) return 0;
    return rt_error_set(e, 404, "model", "model_not_found", "The model '%.200s' does not exist", m);
}

/* Every top-level field a request may carry, and on which endpoint. A field not listed is
 * refused with a 400 that names it: nothing is accepted and then ignored. Listed fields that
 * Tandem implements only in part are checked by unsupported() below. */
enum { EP_C = 1 << RT_EP_COMPLETIONS, EP_CH = 1 << RT_EP_CHAT, EP_ALL = EP_C | EP_CH };
static const struct {
    const char *key;
    int eps;
} known[] = {
    {"model", EP_ALL},
    {"prompt", EP_C},
    {"messages", EP_CH},
    {"stream", EP_ALL},
    {"stream_options", EP_ALL},
    {"max_tokens", EP_ALL},
    {"max_completion_tokens", EP_CH},
    {"temperature", EP_ALL},
    {"top_p", EP_ALL},
    {"top_k", EP_ALL},
    {"min_p", EP_ALL},
    {"repetition_penalty", EP_ALL},
    {"presence_penalty", EP_ALL},
    {"frequency_penalty", EP_ALL},
    {"seed", EP_ALL},
    {"stop", EP_ALL},
    {"ignore_eos", EP_ALL},
    {"logit_bias", EP_ALL},
    {"min_tokens", EP_ALL},
    {"stop_token_ids", EP_ALL},
    {"skip_special_tokens", EP_ALL},
    {"spaces_between_special_tokens", EP_ALL},
    {"migrate", EP_ALL},
    {"timeout", EP_ALL},
    {"response_format", EP_ALL}, /* structured output: rt_format.h */
    {"user", EP_ALL}, /* an end-user id for the caller's own monitoring: no effect, as OpenAI */
    {"n", EP_ALL},
    {"best_of", EP_C},
    {"logprobs", EP_ALL},    /* chat: a bool; completions: 0..20 alternatives */
    {"top_logprobs", EP_CH}, /* 0..20, with logprobs: true */
    {"echo", EP_C},
    /* the ones below are accepted only with the value that asks for nothing (unsupported) */
    {"suffix", EP_C},
    {"tools", EP_CH},
    {"tool_choice", EP_CH},
    {"parallel_tool_calls", EP_CH},
    {"chat_template_kwargs", EP_CH}, /* vLLM's: variables for the chat template (rt_chat.h) */
};

static int unknown_fields(json_t *o, rt_endpoint ep, rt_error *e)
{
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v)
    {
        size_t i = 0, n = sizeof known / sizeof known[0];
        while (i < n && strcmp(known[i].key, key))
            i++;
        if (i < n && (known[i].eps & (1 << ep))) continue;
        rt_error_set(
            e, 400, NULL, "unsupported_parameter", "'%.100s' is not supported by Tandem%s", key,
            i < n ? (ep == RT_EP_CHAT ? " in /v1/chat/completions" : " in /v1/completions") : "");
        return rt_error_own_param(e, key);
    }
    json_t *so = json_object_get(o, "stream_options");
    if (json_is_object(so)) json_object_foreach(so, key, v)
        {
            if (strcmp(key, "include_usage"))
                return rt_error_set(e, 400, "stream_options", "unsupported_parameter",
                                    "'stream_options.%.100s' is not supported by Tandem", key);
        }
    return 0;
}

static int unsupported(json_t *o, rt_endpoint ep, rt_error *e)
{
    json_t *v;
    int rc;
    if ((rc = unknown_fields(o, ep, e))) return rc;
    v = json_object_get(o, "suffix");
    if (!absent(v)) return rt_error_set(e, 400, "suffix", NULL, "'suffix' is not supported");
    /* the detokenizer joins special tokens' text without spaces (llama.cpp), vLLM's false */
    v = json_object_get(o, "spaces_between_special_tokens");
    if (!absent(v) && !json_is_false(v))
        return rt_error_set(e, 400, "spaces_between_special_tokens", "unsupported_parameter",
                            "only 'spaces_between_special_tokens': false is supported");
    v = json_object_get(o, "user");
    if (!absent(v) && !json_is_string(v)) return bad(e, "user", "'%s' must be a string%s", "");
    return 0;
}

/* A prompt of n_prompt tokens against the limits, and its max_tokens: the request's
 * (max_tokens >= 1), else the endpoint's default cut to the room left. batch_i: its index in a
 * batch (named in errors), -1 for a single prompt. */
static int fit_prompt(const rt_model *r, rt_endpoint ep, size_t n_prompt, long long max_tokens,
                      int batch_i, int *out, rt_error *e)
{
    const td_cfg_router *rc_cfg = r->limits;
    const char *param = ep == RT_EP_CHAT ? "messages" : "prompt";
    char which[48] = "";
    if (batch_i >= 0) snprintf(which, sizeof which, " (prompt[%d])", batch_i);
    if (n_prompt == 0) return rt_error_set(e, 400, "prompt", NULL, "the prompt is empty%s", which);
    if (n_prompt > (size_t)rc_cfg->max_prompt_tokens)
        return rt_error_set(e, 400, param, "context_length_exceeded",
                            "the prompt%s is longer than router.max_prompt_tokens (%d tokens)",
                            which, rc_cfg->max_prompt_tokens);
    long long room = (long long)r->n_ctx - (long long)n_prompt;
    if (room < 1)
        return rt_error_set(
            e, 400, param, "context_length_exceeded",
            "This model's maximum context length is %d tokens; the prompt%s has %zu", r->n_ctx,
            which, n_prompt);
    if (max_tokens < 0) {
        max_tokens = ep == RT_EP_COMPLETIONS ? 16 : rc_cfg->max_tokens;
        /* fuzz_openai found: the completions default (16) ignored a smaller
         * router.max_tokens cap (tests/fuzz/regress/openai-default-over-cap) */
        if (max_tokens > rc_cfg->max_tokens) max_tokens = rc_cfg->max_tokens;
        if (max_tokens > room) max_tokens = room;
    } else if (max_tokens > room) {
        return rt_error_set(e, 400, "max_tokens", "context_length_exceeded",
                            "This model's maximum context length is %d tokens; the prompt%s has "
                            "%zu and max_tokens is %lld",
                            r->n_ctx, which, n_prompt, max_tokens);
    }
    *out = (int)max_tokens;
    return 0;
}

/* "n" (choices per prompt) and "best_of", against router.max_n and the router queue. */
static int parse_n(json_t *o, rt_endpoint ep, const td_cfg_router *cfg, rt_params *p, rt_error *e)
{
    long long n = 1, best_of = -1;
    int rc;
    if ((rc = get_int(o, "n", 1, 1 << 30, &n, e))) return rc;
    if (n > 1 && n > cfg->max_n)
        return rt_error_set(e, 400, "n", NULL,
                            "'n' is %lld; at most %d choices per prompt (router.max_n)", n,
                            cfg->max_n);
    if (ep == RT_EP_COMPLETIONS && (rc = get_int(o, "best_of", 1, 1 << 30, &best_of, e))) return rc;
    if (best_of >= 0 && best_of < n)
        return rt_error_set(e, 400, "best_of", NULL, "'best_of' (%lld) must be at least 'n' (%lld)",
                            best_of, n);
    if (best_of > n) {
        /* vLLM's best_of: best_of candidates, the n with the highest cumulative logprob of
           their generated tokens answered (rt_choices.h); ranked only once all have ended */
        if (p->stream)
            return rt_error_set(e, 400, "best_of", NULL,
                                "'best_of' (%lld) > 'n' cannot be streamed: the best choices "
                                "are known only when every candidate has ended",
                                best_of);
        if (best_of > cfg->max_n)
            return rt_error_set(e, 400, "best_of", NULL,
                                "'best_of' is %lld; at most %d candidates per prompt "
                                "(router.max_n)",
                                best_of, cfg->max_n);
        p->best_of = (int)best_of;
        if (!p->sampling.logprobs) p->sampling.logprobs = 1, p->lp_hidden = true;
    }
    long long total = (best_of > n ? best_of : n) * (1 + (long long)p->n_more);
    if (total > 1 && total > cfg->max_queue)
        return rt_error_set(e, 400, p->n_more ? "prompt" : "n", NULL,
                            "%lld choices (n = %lld, best_of %lld, for each of %d prompts) "
                            "exceed the router queue (router.max_queue = %d)",
                            total, n, best_of > n ? best_of : n, 1 + p->n_more, cfg->max_queue);
    p->n = (int)n;
    return 0;
}

/* logprobs, top_logprobs and echo into p (sampling.logprobs, prompt_logprobs, echo). */
static int parse_logprobs(rt_endpoint ep, json_t *o, rt_params *p, rt_error *e)
{
    int rc;
    long long top = -1;
    bool want = false;
    if (ep == RT_EP_CHAT) {
        if ((rc = get_bool(o, "logprobs", &want, e)) ||
            (rc = get_int(o, "top_logprobs", 0, TD_MAX_TOP_LOGPROBS, &top, e)))
            return rc;
        if (top >= 0 && !want)
            return rt_error_set(e, 400, "top_logprobs", NULL,
                                "'top_logprobs' needs 'logprobs': true");
        if (want) p->sampling.logprobs = 1 + (uint32_t)(top < 0 ? 0 : top);
        return 0;
    }
    json_t *v = json_object_get(o, "logprobs");
    if (json_is_false(v)) v = NULL;
    if ((rc = get_bool(o, "echo", &p->echo, e))) return rc;
    if (!absent(v)) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 ||
            json_integer_value(v) > TD_MAX_TOP_LOGPROBS)
            return rt_error_set(e, 400, "logprobs", NULL,
                                "'logprobs' must be an integer in [0, %d] on /v1/completions",
                                TD_MAX_TOP_LOGPROBS);
        p->sampling.logprobs = 1 + (uint32_t)json_integer_value(v);
        p->sampling.prompt_logprobs = p->echo;
    }
    return 0;
}

static int parse_obj(const rt_model *r, rt_endpoint ep, json_t *o, rt_params *p, rt_error *e)
{
    int rc;
    const td_cfg_router *rc_cfg = r->limits;
    if ((rc = check_model(r, o, e)) || (rc = unsupported(o, ep, e))) return rc;
    double temperature = 1.0, top_p = 1.0, min_p = 0.0, rep = 1.0, pres = 0, freq = 0, timeout = 0;
    bool migrate = true; /* a Tandem extension: false ends the stream if its instance dies */
    p->skip_special = true;
    long long top_k = -1, seed = -1, max_tokens = -1, mct = -1, min_tokens = 0;
    bool seeded = json_object_get(o, "seed") && !json_is_null(json_object_get(o, "seed"));
    if ((rc = get_number(o, "temperature", 0, 2, &temperature, e)) ||
        (rc = get_number(o, "top_p", 0, 1, &top_p, e)) ||
        (rc = get_number(o, "min_p", 0, 1, &min_p, e)) ||
        (rc = get_number(o, "repetition_penalty", 0.01, 10, &rep, e)) ||
        (rc = get_number(o, "presence_penalty", -2, 2, &pres, e)) ||
        (rc = get_number(o, "frequency_penalty", -2, 2, &freq, e)) ||
        (rc = get_int(o, "top_k", -1, 1 << 30, &top_k, e)) ||
        (rc = get_int(o, "seed", INT64_MIN, INT64_MAX, &seed, e)) ||
        (rc = parse_logprobs(ep, o, p, e)) ||
        (rc = get_int(o, "max_tokens", p->echo ? 0 : 1, rc_cfg->max_tokens, &max_tokens, e)) ||
        (rc = get_bool(o, "stream", &p->stream, e)) ||
        (rc = get_bool(o, "ignore_eos", &p->ignore_eos, e)) ||
        (rc = get_bool(o, "skip_special_tokens", &p->skip_special, e)) ||
        (rc = get_int(o, "min_tokens", 0, rc_cfg->max_tokens, &min_tokens, e)) ||
        (rc = get_bool(o, "migrate", &migrate, e)) ||
        (rc =
             get_number(o, "timeout", 0.001, rc_cfg->max_request_timeout_ms / 1000.0, &timeout, e)))
        return rc;
    /* a Tandem extension: seconds, as the OpenAI clients' own timeout option; more than
       router.max_request_timeout_ms is refused rather than silently shortened */
    if (timeout > 0) p->timeout_ms = llround(timeout * 1000.0) > 0 ? llround(timeout * 1000.0) : 1;
    p->no_migrate = !migrate;
    if (ep == RT_EP_CHAT &&
        (rc = get_int(o, "max_completion_tokens", 1, rc_cfg->max_tokens, &mct, e)))
        return rc;
    if (mct > 0) max_tokens = mct;
    json_t *so = json_object_get(o, "stream_options");
    if (!absent(so)) {
        if (!json_is_object(so)) return bad(e, "stream_options", "'%s' must be an object%s", "");
        if ((rc = get_bool(so, "include_usage", &p->include_usage, e))) return rc;
    }
    if (!p->stream) p->include_usage = false;
    if ((rc = parse_stop(o, p, e)) || (rc = parse_stop_ids(r, o, p, e)) ||
        (rc = parse_logit_bias(r, o, &p->sampling, e)) ||
        (rc = rt_format_parse(o, &p->sampling, &p->grammar, e)))
        return rc;
    if (ep == RT_EP_COMPLETIONS)
        rc = parse_prompt(r, o, p, e);
    else
        rc = parse_messages(r, o, p, e);
    if (rc || (rc = forced_call(p, e))) return rc;
    /* a tool-call answer's text is parsed into calls: which token's logprob belongs where is
       not defined by OpenAI's shapes, so the pair is refused rather than half answered */
    if (p->tools.parse && p->sampling.logprobs)
        return rt_error_set(e, 400, "logprobs", "unsupported_parameter",
                            "'logprobs' together with 'tools' (tool_choice \"auto\") is not "
                            "supported");
    if ((rc = fit_prompt(r, ep, p->n_prompt, max_tokens, -1, &p->max_tokens, e))) return rc;
    for (int i = 0; i < p->n_more && !rc; i++)
        rc = fit_prompt(r, ep, p->more[i].n, max_tokens, i + 1, &p->more[i].max_tokens, e);
    if (rc || (rc = parse_n(o, ep, rc_cfg, p, e))) return rc;
    if (p->echo && max_tokens == 0) {
        /* echo with max_tokens 0 (lm-evaluation-harness's loglikelihood): the decode side
           always generates one token; the router drops it (every prompt of a batch) */
        p->gen_none = true;
        p->max_tokens = 1;
        for (int i = 0; i < p->n_more; i++)
            p->more[i].max_tokens = 1;
    }
    td_sampling *sp = &p->sampling;
    sp->temperature = (float)temperature;
    sp->top_p = top_p >= 1.0 ? 0.0f : (float)top_p;
    sp->min_p = (float)min_p;
    sp->top_k = top_k < 0 ? 0 : (int32_t)top_k;
    sp->repeat_penalty = (float)rep;
    sp->repeat_last_n = INT32_MAX; /* vLLM's repetition_penalty: the whole prompt and output */
    sp->presence_penalty = (float)pres;
    sp->frequency_penalty = (float)freq;
    if (seeded)
        sp->seed = (uint64_t)seed;
    else {
        struct timespec ts = td_wall_now();
        sp->seed = (uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ull ^ (uint64_t)ts.tv_sec;
    }
    if (temperature > 0 && top_p <= 0)
        return rt_error_set(e, 400, "top_p", NULL, "'top_p' must be in (0, 1]");
    return set_min_tokens(r, min_tokens, p, e);
}

int rt_openai_parse(const rt_model *r, rt_endpoint ep, const char *body, size_t len, rt_params *p,
                    rt_error *e)
{
    *p = (rt_params){.ep = ep};
    json_error_t jerr;
    json_t *o = json_loadb(body, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!o)
        return rt_error_set(e, 400, NULL, NULL, "invalid JSON body: %s (line %d, column %d)",
                            jerr.text, jerr.line, jerr.column);
    int rc;
    if (!json_is_object(o))
        rc = rt_error_set(e, 400, NULL, NULL, "the request body must be a JSON object");
    else
        rc = parse_obj(r, ep, o, p, e);
    json_decref(o);
    if (rc) rt_params_fini(p);
    p->ep = ep;
    return rc;
}

bool rt_openai_model_is(const rt_model *r, const char *id)
{
    size_t ml = strlen(r->name);
    return !strcmp(id, r->name) || (!strncmp(id, r->name, ml) && !strcmp(id + ml, ".gguf"));
}

static json_t *model_obj(const rt_model *r)
{
    return json_pack("{s:s, s:s, s:I, s:s, s:i}", "id", r->name, "object", "model", "created",
                     (json_int_t)0, "owned_by", "tandem", "max_model_len", (int)r->n_ctx);
}

char *rt_openai_model(const rt_model *r)
{
    json_t *o = model_obj(r);
    if (!o) return NULL;
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

char *rt_openai_models(const rt_model *r)
{
    json_t *o = json_pack("{s:s, s:[o]}", "object", "list", "data", model_obj(r));
    if (!o) return NULL;
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}
