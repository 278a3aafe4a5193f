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
#include "td_clock.h"
#include "td_err.h"

void rt_params_fini(rt_params *p)
{
    free(p->prompt);
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

static int tokenize(const rt_model *r, const char *text, size_t len, bool add_special, rt_params *p,
                    rt_error *e)
{
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = td_tok_encode(r->tok, text, len, add_special, true, &ids, &n);
    if (rc)
        return rt_error_set(e, 500, NULL, NULL, "cannot tokenize the prompt: %s", td_strerror(rc));
    p->prompt = ids;
    p->n_prompt = n;
    return 0;
}

static int parse_prompt(const rt_model *r, json_t *o, rt_params *p, rt_error *e)
{
    json_t *v = json_object_get(o, "prompt");
    if (absent(v)) return rt_error_set(e, 400, "prompt", NULL, "'prompt' is required");
    if (json_is_array(v) && json_array_size(v) == 1 &&
        (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0))))
        v = json_array_get(v, 0); /* a batch of one */
    if (json_is_array(v) && json_array_size(v) > 1 &&
        (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0))))
        return rt_error_set(e, 400, "prompt", "unsupported_parameter",
                            "'prompt' holds %zu prompts: Tandem serves one prompt per request "
                            "(a string, or an array of token ids); send one request per prompt",
                            json_array_size(v));
    if (json_is_string(v))
        return tokenize(r, json_string_value(v), json_string_length(v), true, p, e);
    if (!json_is_array(v))
        return bad(e, "prompt", "'%s' must be a string or an array of token ids%s", "");
    size_t n = json_array_size(v);
    if (n == 0) return rt_error_set(e, 400, "prompt", NULL, "'prompt' is empty");
    if (n > (size_t)r->limits->max_prompt_tokens) n = (size_t)r->limits->max_prompt_tokens + 1;
    int32_t *ids = malloc(n * sizeof *ids);
    if (!ids) return rt_error_set(e, 500, NULL, NULL, "out of memory");
    int32_t nv = td_tok_n_vocab(r->tok);
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(v, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) >= nv) {
            free(ids);
            return rt_error_set(
                e, 400, "prompt", NULL,
                "'prompt' token ids must be integers in [0, %d); element %zu is not", nv, i);
        }
        ids[i] = (int32_t)json_integer_value(t);
    }
    p->prompt = ids;
    p->n_prompt = n;
    return 0;
}

/* The messages (and tools) rendered with the model's template (rt_chat.c), tokenized. */
static int parse_messages(const rt_model *r, json_t *o, rt_params *p, rt_error *e)
{
    char *text = NULL;
    int rc = rt_chat_prompt(r->tmpl, r->tmpl_len, o, &p->tools, &text, e);
    /* the template writes BOS itself where the model wants one */
    if (!rc) rc = tokenize(r, text, strlen(text), false, p, e);
    free(text);
    return rc;
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
    {"migrate", EP_ALL},
    {"timeout", EP_ALL},
    {"user", EP_ALL}, /* an end-user id for the caller's own monitoring: no effect, as OpenAI */
    /* the ones below are accepted only with the value that asks for nothing (unsupported) */
    {"n", EP_ALL},
    {"best_of", EP_C},
    {"echo", EP_C},
    {"suffix", EP_C},
    {"logprobs", EP_ALL},
    {"top_logprobs", EP_ALL},
    {"logit_bias", EP_ALL},
    {"response_format", EP_ALL},
    {"tools", EP_CH},
    {"tool_choice", EP_CH},
    {"parallel_tool_calls", EP_CH},
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
    long long n = 1;
    int rc;
    if ((rc = unknown_fields(o, ep, e))) return rc;
    if ((rc = get_int(o, "n", 1, 1 << 20, &n, e))) return rc;
    if (n != 1) return rt_error_set(e, 400, "n", NULL, "only n = 1 is supported, got %lld", n);
    if ((rc = get_int(o, "best_of", 1, 1, &n, e))) return rc;
    if ((v = json_object_get(o, "echo")) && !absent(v) && !json_is_false(v))
        return rt_error_set(e, 400, "echo", NULL, "'echo' is not supported");
    v = json_object_get(o, "logprobs");
    if (!absent(v) && !json_is_false(v))
        return rt_error_set(e, 400, "logprobs", NULL, "'logprobs' is not supported");
    v = json_object_get(o, "top_logprobs");
    if (!absent(v))
        return rt_error_set(e, 400, "top_logprobs", NULL, "'top_logprobs' is not supported");
    v = json_object_get(o, "suffix");
    if (!absent(v)) return rt_error_set(e, 400, "suffix", NULL, "'suffix' is not supported");
    v = json_object_get(o, "logit_bias");
    if (!absent(v) && !(json_is_object(v) && json_object_size(v) == 0))
        return rt_error_set(e, 400, "logit_bias", NULL, "'logit_bias' is not supported");
    v = json_object_get(o, "response_format");
    if (!absent(v)) {
        json_t *t = json_object_get(v, "type");
        if (!json_is_string(t) || strcmp(json_string_value(t), "text"))
            return rt_error_set(e, 400, "response_format", NULL,
                                "only response_format {\"type\": \"text\"} is supported");
    }
    v = json_object_get(o, "user");
    if (!absent(v) && !json_is_string(v)) return bad(e, "user", "'%s' must be a string%s", "");
    return 0;
}

static int parse_obj(const rt_model *r, rt_endpoint ep, json_t *o, rt_params *p, rt_error *e)
{
    int rc;
    const td_cfg_router *rc_cfg = r->limits;
    if ((rc = check_model(r, o, e)) || (rc = unsupported(o, ep, e))) return rc;
    double temperature = 1.0, top_p = 1.0, min_p = 0.0, rep = 1.0, pres = 0, freq = 0, timeout = 0;
    bool migrate = true; /* a Tandem extension: false ends the stream if its instance dies */
    long long top_k = -1, seed = -1, max_tokens = -1, mct = -1;
    bool seeded = json_object_get(o, "seed") && !json_is_null(json_object_get(o, "seed"));
    if ((rc = get_number(o, "temperature", 0, 2, &temperature, e)) ||
        (rc = get_number(o, "top_p", 0, 1, &top_p, e)) ||
        (rc = get_number(o, "min_p", 0, 1, &min_p, e)) ||
        (rc = get_number(o, "repetition_penalty", 0.01, 10, &rep, e)) ||
        (rc = get_number(o, "presence_penalty", -2, 2, &pres, e)) ||
        (rc = get_number(o, "frequency_penalty", -2, 2, &freq, e)) ||
        (rc = get_int(o, "top_k", -1, 1 << 30, &top_k, e)) ||
        (rc = get_int(o, "seed", INT64_MIN, INT64_MAX, &seed, e)) ||
        (rc = get_int(o, "max_tokens", 1, rc_cfg->max_tokens, &max_tokens, e)) ||
        (rc = get_bool(o, "stream", &p->stream, e)) ||
        (rc = get_bool(o, "ignore_eos", &p->ignore_eos, e)) ||
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
    if ((rc = parse_stop(o, p, e))) return rc;
    if (ep == RT_EP_COMPLETIONS)
        rc = parse_prompt(r, o, p, e);
    else
        rc = parse_messages(r, o, p, e);
    if (rc) return rc;
    if (p->n_prompt == 0) return rt_error_set(e, 400, "prompt", NULL, "the prompt is empty");
    if (p->n_prompt > (size_t)rc_cfg->max_prompt_tokens)
        return rt_error_set(e, 400, ep == RT_EP_CHAT ? "messages" : "prompt",
                            "context_length_exceeded",
                            "the prompt is longer than router.max_prompt_tokens (%d tokens)",
                            rc_cfg->max_prompt_tokens);
    long long room = (long long)r->n_ctx - (long long)p->n_prompt;
    if (room < 1)
        return rt_error_set(e, 400, ep == RT_EP_CHAT ? "messages" : "prompt",
                            "context_length_exceeded",
                            "This model's maximum context length is %d tokens; the prompt has %zu",
                            r->n_ctx, p->n_prompt);
    if (max_tokens < 0) {
        max_tokens = ep == RT_EP_COMPLETIONS ? 16 : rc_cfg->max_tokens;
        /* fuzz_openai found: the completions default (16) ignored a smaller
         * router.max_tokens cap (tests/fuzz/regress/openai-default-over-cap) */
        if (max_tokens > rc_cfg->max_tokens) max_tokens = rc_cfg->max_tokens;
        if (max_tokens > room) max_tokens = room;
    } else if (max_tokens > room) {
        return rt_error_set(e, 400, "max_tokens", "context_length_exceeded",
                            "This model's maximum context length is %d tokens; the prompt has %zu "
                            "and max_tokens is %lld",
                            r->n_ctx, p->n_prompt, max_tokens);
    }
    p->max_tokens = (int)max_tokens;
    td_sampling *sp = &p->sampling;
    sp->temperature = (float)temperature;
    sp->top_p = top_p >= 1.0 ? 0.0f : (float)top_p;
    sp->min_p = (float)min_p;
    sp->top_k = top_k < 0 ? 0 : (int32_t)top_k;
    sp->repeat_penalty = (float)rep;
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
    return 0;
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
