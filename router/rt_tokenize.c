/* rt_tokenize.c: vLLM's POST /tokenize and POST /detokenize, and GET /version (see
 * rt_tokenize.h). Runs on the HTTP threads; reads only the router's read-only model state. */
#include "rt_tokenize.h"

#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef TANDEM_VERSION
#error "TANDEM_VERSION is set by router/CMakeLists.txt from the CMake project version"
#endif

static bool absent(const json_t *v)
{
    return !v || json_is_null(v);
}

/* Every field is known or refused, as on the generation endpoints. */
static int fields(json_t *o, const char *const *keys, size_t n, rt_error *e)
{
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v)
    {
        size_t i = 0;
        while (i < n && strcmp(keys[i], key))
            i++;
        if (i < n) continue;
        rt_error_set(e, 400, NULL, "unsupported_parameter", "'%.100s' is not supported by Tandem",
                     key);
        return rt_error_own_param(e, key);
    }
    return 0;
}

static int get_bool(json_t *o, const char *key, bool *out, rt_error *e)
{
    json_t *v = json_object_get(o, key);
    if (absent(v)) return 0;
    if (!json_is_boolean(v)) return rt_error_set(e, 400, key, NULL, "'%s' must be a boolean", key);
    *out = json_is_true(v);
    return 0;
}

static int check_model(const rt_model *m, json_t *o, rt_error *e)
{
    json_t *v = json_object_get(o, "model");
    if (absent(v)) return 0;
    if (!json_is_string(v)) return rt_error_set(e, 400, "model", NULL, "'model' must be a string");
    if (rt_openai_model_is(m, json_string_value(v))) return 0;
    return rt_error_set(e, 404, "model", "model_not_found", "The model '%.200s' does not exist",
                        json_string_value(v));
}

static json_t *load(const char *body, size_t len, rt_error *e)
{
    json_error_t jerr;
    json_t *o = json_loadb(body, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!o) {
        rt_error_set(e, 400, NULL, NULL, "invalid JSON body: %s (line %d, column %d)", jerr.text,
                     jerr.line, jerr.column);
        return NULL;
    }
    if (!json_is_object(o)) {
        json_decref(o);
        rt_error_set(e, 400, NULL, NULL, "the request body must be a JSON object");
        return NULL;
    }
    return o;
}

static int dump(json_t *r, char **out, rt_error *e)
{
    *out = r ? json_dumps(r, JSON_COMPACT) : NULL;
    json_decref(r);
    return *out ? 200 : rt_error_set(e, 500, NULL, NULL, "out of memory");
}

/* The ids of a completion prompt (a string) or a chat (messages through the template). */
static int tokenize_obj(const rt_model *m, json_t *o, rt_params *p, rt_error *e)
{
    static const char *const keys[] = {"model",
                                       "prompt",
                                       "messages",
                                       "add_special_tokens",
                                       "add_generation_prompt",
                                       "tools",
                                       "chat_template_kwargs"};
    int rc;
    json_t *prompt = json_object_get(o, "prompt"), *msgs = json_object_get(o, "messages");
    if ((rc = fields(o, keys, sizeof keys / sizeof keys[0], e)) || (rc = check_model(m, o, e)))
        return rc;
    if (absent(prompt) == absent(msgs))
        return rt_error_set(e, 400, "prompt", NULL,
                            "send exactly one of 'prompt' (a string) and 'messages'");
    /* vLLM's defaults: special tokens for a prompt; for a chat the template writes them */
    bool add_special = absent(msgs), gen = true;
    if ((rc = get_bool(o, "add_special_tokens", &add_special, e))) return rc;
    if (!absent(prompt)) {
        static const char *const chat_only[] = {"add_generation_prompt", "tools",
                                                "chat_template_kwargs"};
        for (size_t k = 0; k < sizeof chat_only / sizeof *chat_only; k++)
            if (json_object_get(o, chat_only[k]))
                return rt_error_set(e, 400, chat_only[k], NULL, "'%s' goes with 'messages'",
                                    chat_only[k]);
        if (!json_is_string(prompt))
            return rt_error_set(e, 400, "prompt", NULL, "'prompt' must be a string");
        return rt_openai_tokenize(m, json_string_value(prompt), json_string_length(prompt),
                                  add_special, p, e);
    }
    if ((rc = get_bool(o, "add_generation_prompt", &gen, e))) return rc;
    if (json_object_get(o, "add_special_tokens"))
        return rt_error_set(e, 400, "add_special_tokens", NULL,
                            "'add_special_tokens' goes with 'prompt': the chat template writes "
                            "the special tokens of a chat");
    return rt_openai_messages(m, o, gen, p, e);
}

int rt_tokenize(const rt_model *m, const char *body, size_t len, char **out, rt_error *e)
{
    *out = NULL;
    json_t *o = load(body, len, e);
    if (!o) return e->status;
    rt_params p = {0};
    int rc = tokenize_obj(m, o, &p, e);
    json_decref(o);
    if (!rc) {
        json_t *ids = json_array();
        for (size_t i = 0; ids && i < p.n_prompt; i++)
            if (json_array_append_new(ids, json_integer(p.prompt[i]))) {
                json_decref(ids);
                ids = NULL;
            }
        json_t *r = ids ? json_pack("{s:I, s:i, s:o}", "count", (json_int_t)p.n_prompt,
                                    "max_model_len", (int)m->n_ctx, "tokens", ids)
                        : NULL;
        rc = dump(r, out, e);
    }
    rt_params_fini(&p);
    return rc;
}

static int detokenize_obj(const rt_model *m, json_t *o, char **text, long *n_text, rt_error *e)
{
    static const char *const keys[] = {"model", "tokens"};
    int rc;
    if ((rc = fields(o, keys, 2, e)) || (rc = check_model(m, o, e))) return rc;
    json_t *v = json_object_get(o, "tokens");
    if (!json_is_array(v))
        return rt_error_set(e, 400, "tokens", NULL, "'tokens' must be an array of token ids");
    size_t n = json_array_size(v);
    int32_t nv = td_tok_n_vocab(m->tok);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) return rt_error_set(e, 500, NULL, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(v, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) >= nv) {
            free(ids);
            return rt_error_set(e, 400, "tokens", NULL,
                                "'tokens' must be integers in [0, %d); element %zu is not", nv, i);
        }
        ids[i] = (int32_t)json_integer_value(t);
    }
    /* as vLLM (tokenizer.decode): special tokens keep their text */
    long need = td_tok_decode(m->tok, ids, n, true, NULL, 0);
    *text = need >= 0 ? malloc((size_t)need + 1) : NULL;
    if (*text) td_tok_decode(m->tok, ids, n, true, *text, (size_t)need);
    free(ids);
    if (!*text) return rt_error_set(e, 500, NULL, NULL, "cannot decode the tokens");
    *n_text = need;
    return 0;
}

/* Length of the valid UTF-8 character at s[0..n), or 0 if it is not one (RFC 3629: no
 * overlong forms, no surrogates, nothing past U+10FFFF). */
static size_t utf8_char(const uint8_t *s, size_t n)
{
    size_t need;
    uint8_t lo = 0x80, hi = 0xBF;
    if (s[0] < 0x80) return 1;
    if (s[0] >= 0xC2 && s[0] <= 0xDF)
        need = 2;
    else if (s[0] >= 0xE0 && s[0] <= 0xEF) {
        need = 3;
        lo = s[0] == 0xE0 ? 0xA0 : 0x80;
        hi = s[0] == 0xED ? 0x9F : 0xBF;
    } else if (s[0] >= 0xF0 && s[0] <= 0xF4) {
        need = 4;
        lo = s[0] == 0xF0 ? 0x90 : 0x80;
        hi = s[0] == 0xF4 ? 0x8F : 0xBF;
    } else
        return 0;
    if (n < need || s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < need; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return need;
}

/* Copy in to out (room for 3 * n bytes), each byte that starts no valid character replaced
 * by U+FFFD; returns the bytes written. */
static size_t utf8_fix(const char *in, size_t n, char *out)
{
    const uint8_t *s = (const uint8_t *)in;
    size_t w = 0;
    for (size_t i = 0; i < n;) {
        size_t c = utf8_char(s + i, n - i);
        if (c) {
            memcpy(out + w, s + i, c);
            w += c;
            i += c;
        } else {
            memcpy(out + w, "\xef\xbf\xbd", 3);
            w += 3;
            i++;
        }
    }
    return w;
}

int rt_detokenize(const rt_model *m, const char *body, size_t len, char **out, rt_error *e)
{
    *out = NULL;
    json_t *o = load(body, len, e);
    if (!o) return e->status;
    char *text = NULL;
    long n = 0;
    int rc = detokenize_obj(m, o, &text, &n, e);
    json_decref(o);
    if (rc) return rc;
    /* JSON needs valid UTF-8: a cut multi-byte character becomes U+FFFD, as in a stream */
    char *fixed = malloc(3 * (size_t)n + 1);
    size_t fn = fixed ? utf8_fix(text, (size_t)n, fixed) : 0;
    free(text);
    json_t *r = fixed ? json_pack("{s:s%}", "prompt", fixed, fn) : NULL;
    free(fixed);
    return dump(r, out, e);
}

char *rt_version_json(void)
{
    return strdup("{\"version\":\"" TANDEM_VERSION "\"}");
}
