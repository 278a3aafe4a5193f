/* rt_chat.c: chat messages, tools and tool_choice -> the prompt text (see rt_chat.h). */
#include "rt_chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_template.h"
#include "gr_grammar.h"
#include "td_err.h"
#include "td_grow.h"

/* ---- Python's json.dumps(ensure_ascii=False) ---- */

static int py_string(rt_buf *b, const char *s, size_t n)
{
    int rc = rt_buf_append(b, "\"", 1);
    for (size_t i = 0; i < n && !rc; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        const char *x = NULL;
        switch (c) {
        case '"':
            x = "\\\"";
            break;
        case '\\':
            x = "\\\\";
            break;
        case '\n':
            x = "\\n";
            break;
        case '\r':
            x = "\\r";
            break;
        case '\t':
            x = "\\t";
            break;
        case '\b':
            x = "\\b";
            break;
        case '\f':
            x = "\\f";
            break;
        default:
            if (c < 0x20) {
                snprintf(esc, sizeof esc, "\\u%04x", c);
                x = esc;
            }
        }
        rc = x ? rt_buf_puts(b, x) : rt_buf_append(b, &s[i], 1);
    }
    return rc ? rc : rt_buf_append(b, "\"", 1);
}

/* repr(float): the shortest digits that read back to d; fixed notation for decimal
 * exponents in [-4, 16) (always with a fraction: "2.0"), else "1e+16" / "1.5e-05". */
static int py_real(rt_buf *b, double d)
{
    char s[40];
    int p = 1;
    for (; p < 17; p++) {
        snprintf(s, sizeof s, "%.*e", p - 1, d);
        if (strtod(s, NULL) == d) break;
    }
    snprintf(s, sizeof s, "%.*e", p - 1, d);
    char digits[24];
    int nd = 0, exp10 = 0;
    const char *c = s;
    bool neg = *c == '-';
    if (neg) c++;
    for (; *c && *c != 'e'; c++)
        if (*c != '.') digits[nd++] = *c;
    if (*c == 'e') exp10 = atoi(c + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    char out[64];
    int o = 0;
    if (neg) out[o++] = '-';
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            out[o++] = '0';
            out[o++] = '.';
            for (int k = 0; k < -exp10 - 1; k++)
                out[o++] = '0';
            for (int k = 0; k < nd; k++)
                out[o++] = digits[k];
        } else {
            for (int k = 0; k <= exp10; k++)
                out[o++] = k < nd ? digits[k] : '0';
            out[o++] = '.';
            if (nd > exp10 + 1)
                for (int k = exp10 + 1; k < nd; k++)
                    out[o++] = digits[k];
            else
                out[o++] = '0';
        }
        out[o] = '\0';
    } else {
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            for (int k = 1; k < nd; k++)
                out[o++] = digits[k];
        }
        snprintf(out + o, sizeof out - (size_t)o, "e%c%02d", exp10 < 0 ? '-' : '+',
                 exp10 < 0 ? -exp10 : exp10);
    }
    return rt_buf_puts(b, out);
}

static int py_dump(rt_buf *b, const json_t *v)
{
    char num[32];
    int rc = 0;
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        const char *key;
        json_t *x;
        bool first = true;
        rc = rt_buf_puts(b, "{");
        json_object_foreach((json_t *)v, key, x)
        {
            if (!rc && !first) rc = rt_buf_puts(b, ", ");
            first = false;
            if (!rc) rc = py_string(b, key, strlen(key));
            if (!rc) rc = rt_buf_puts(b, ": ");
            if (!rc) rc = py_dump(b, x);
        }
        return rc ? rc : rt_buf_puts(b, "}");
    }
    case JSON_ARRAY:
        rc = rt_buf_puts(b, "[");
        for (size_t i = 0; i < json_array_size(v) && !rc; i++) {
            if (i) rc = rt_buf_puts(b, ", ");
            if (!rc) rc = py_dump(b, json_array_get(v, i));
        }
        return rc ? rc : rt_buf_puts(b, "]");
    case JSON_STRING:
        return py_string(b, json_string_value(v), json_string_length(v));
    case JSON_INTEGER:
        snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        return rt_buf_puts(b, num);
    case JSON_REAL:
        return py_real(b, json_real_value(v));
    case JSON_TRUE:
        return rt_buf_puts(b, "true");
    case JSON_FALSE:
        return rt_buf_puts(b, "false");
    default:
        return rt_buf_puts(b, "null");
    }
}

char *rt_chat_pyjson(const json_t *v)
{
    rt_buf b = {0};
    if (py_dump(&b, v) || rt_buf_append(&b, "", 0)) {
        rt_buf_free(&b);
        return NULL;
    }
    return b.buf;
}

/* ---- tools, tool_choice, parallel_tool_calls ---- */

static bool absent(const json_t *v)
{
    return !v || json_is_null(v);
}

/* The render state of one request: what td_chat_render_tools reads, and what it owns. */
typedef struct {
    td_chat_msg *msgs;
    size_t n;
    char **tools; /* (n_tools) tojson text */
    size_t n_tools;
    td_chat_tool_call **calls; /* (n) per message, NULL none */
    char **owned;              /* (owned_n) strings to free */
    size_t owned_n, owned_cap;
} rt_chat_st;

static int keep(rt_chat_st *st, char *s, rt_error *e)
{
    if (!s) return rt_error_set(e, 500, NULL, NULL, "out of memory");
    if (TD_GROW(st->owned, st->owned_cap, st->owned_n + 1, 16)) {
        free(s);
        return rt_error_set(e, 500, NULL, NULL, "out of memory");
    }
    st->owned[st->owned_n++] = s;
    return 0;
}

static int parse_tools(const char *tmpl, size_t tmpl_len, json_t *o, rt_chat_st *st, rt_error *e)
{
    json_t *v = json_object_get(o, "tools");
    if (absent(v)) return 0;
    if (!json_is_array(v))
        return rt_error_set(e, 400, "tools", NULL, "'tools' must be an array of tools");
    size_t n = json_array_size(v);
    if (n && !td_chat_has_tools(tmpl, tmpl_len))
        return rt_error_set(e, 400, "tools", "unsupported_parameter",
                            "'tools' needs a chat template that renders tools (Qwen2.5's "
                            "tools block); this model's template has none");
    st->tools = n ? calloc(n, sizeof *st->tools) : NULL;
    if (n && !st->tools) return rt_error_set(e, 500, NULL, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(v, i), *f = json_object_get(t, "function");
        json_t *type = json_object_get(t, "type");
        if (!json_is_object(t) || !json_is_string(type) ||
            strcmp(json_string_value(type), "function") || !json_is_object(f) ||
            !json_is_string(json_object_get(f, "name")))
            return rt_error_set(e, 400, "tools", NULL,
                                "tools[%zu] must be {\"type\": \"function\", \"function\": "
                                "{\"name\": ..., \"description\": ..., \"parameters\": ...}}",
                                i);
        json_t *params = json_object_get(f, "parameters"), *strict = json_object_get(f, "strict");
        if (!absent(params) && !json_is_object(params))
            return rt_error_set(e, 400, "tools", NULL,
                                "tools[%zu].function.parameters must be a JSON schema object", i);
        if (!absent(strict) && !json_is_boolean(strict))
            return rt_error_set(e, 400, "tools", NULL,
                                "tools[%zu].function.strict must be a boolean", i);
        int rc = keep(st, rt_chat_pyjson(t), e);
        if (rc) return rc;
        st->tools[st->n_tools++] = st->owned[st->owned_n - 1];
    }
    return 0;
}

/* tool_choice: none, auto (the default), required or {"type": "function", "function":
 * {"name": ...}}; a forced call (required, named) sets p->forced and *named (the name, or
 * NULL for any of the tools). */
static int parse_choice(json_t *o, size_t n_tools, rt_chat_tools *p, const char **named,
                        rt_error *e)
{
    json_t *v = json_object_get(o, "tool_choice"), *par = json_object_get(o, "parallel_tool_calls");
    bool auto_ = true;
    *named = NULL;
    if (!absent(par) && !json_is_boolean(par))
        return rt_error_set(e, 400, "parallel_tool_calls", NULL,
                            "'parallel_tool_calls' must be a boolean");
    p->parallel = absent(par) || json_is_true(par);
    json_t *type = json_object_get(v, "type"), *f = json_object_get(v, "function");
    if (json_is_string(v) && !strcmp(json_string_value(v), "none")) {
        auto_ = false;
    } else if (json_is_string(v) && !strcmp(json_string_value(v), "required")) {
        p->forced = true;
    } else if (json_is_object(v) && json_is_string(type) &&
               !strcmp(json_string_value(type), "function") && json_is_object(f) &&
               json_is_string(json_object_get(f, "name"))) {
        p->forced = true;
        *named = json_string_value(json_object_get(f, "name"));
    } else if (!absent(v) && !(json_is_string(v) && !strcmp(json_string_value(v), "auto"))) {
        return rt_error_set(e, 400, "tool_choice", NULL,
                            "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
    if (p->forced && !n_tools)
        return rt_error_set(e, 400, "tool_choice", NULL,
                            "tool_choice \"required\" or a named function needs 'tools'");
    p->parse = auto_ && n_tools > 0;
    return 0;
}

/* One call of tool t as the forced output: {"name": <its name>, "arguments": <an object
 * valid under its parameters>}; NULL out of memory. */
static json_t *call_schema(json_t *t)
{
    json_t *f = json_object_get(t, "function"), *params = json_object_get(f, "parameters");
    json_t *args = absent(params)
                       ? json_pack("{s:s, s:b}", "type", "object", "additionalProperties", 0)
                       : json_incref(params);
    return json_pack("{s:s, s:{s:{s:O}, s:o}, s:[s, s], s:b}", "type", "object", "properties",
                     "name", "const", json_object_get(f, "name"), "arguments", args, "required",
                     "name", "arguments", "additionalProperties", 0);
}

/* tool_choice required or named: the output is one call as a JSON document (the tools'
 * schemas compiled by the grammar engine; the router parses it back into tool_calls, see
 * rt_tools.h's untagged calls). Compiled here so a schema it cannot take is a 400; *text is
 * the schema's JSON for the request's grammar. */
static int forced_grammar(json_t *o, const char *named, rt_chat_tools *p, rt_error *e)
{
    json_t *tools = json_object_get(o, "tools"), *any = json_array(), *t;
    size_t i;
    bool found = false;
    if (!any) return rt_error_set(e, 500, NULL, NULL, "out of memory");
    json_array_foreach(tools, i, t)
    {
        json_t *f = json_object_get(t, "function");
        if (named && strcmp(named, json_string_value(json_object_get(f, "name")))) continue;
        found = true;
        p->strict |= json_is_true(json_object_get(f, "strict"));
        if (json_array_append_new(any, call_schema(t))) {
            json_decref(any);
            return rt_error_set(e, 500, NULL, NULL, "out of memory");
        }
    }
    if (!found) {
        json_decref(any);
        return rt_error_set(e, 400, "tool_choice", NULL,
                            "tool_choice names function '%.64s', which 'tools' does not declare",
                            named);
    }
    json_t *schema = json_array_size(any) == 1 ? json_incref(json_array_get(any, 0))
                                               : json_pack("{s:O}", "anyOf", any);
    json_decref(any);
    char err[256];
    gr_grammar *g = NULL;
    int rc = schema ? gr_compile_schema(schema, p->strict, &g, err, sizeof err) : TD_ENOMEM;
    gr_grammar_unref(g);
    if (!rc && !(p->grammar = json_dumps(schema, JSON_COMPACT))) rc = TD_ENOMEM;
    json_decref(schema);
    if (rc == TD_ENOMEM) return rt_error_set(e, 500, NULL, NULL, "out of memory");
    if (rc)
        return rt_error_set(e, 400, "tools", rc == TD_EUNSUPP ? "unsupported_parameter" : NULL,
                            "the tools' parameters (as one call's schema): %s", err);
    if (strlen(p->grammar) > GR_MAX_TEXT)
        return rt_error_set(e, 400, "tools", NULL,
                            "the tools' parameters are longer than %d bytes as one schema",
                            GR_MAX_TEXT);
    p->parse = true;
    return 0;
}

/* function.strict with tool_choice auto: the model may answer in text, and only a forced call
 * (required, named) is constrained, so it is refused rather than ignored. */
static int strict_needs_forced(json_t *o, const rt_chat_tools *p, rt_error *e)
{
    json_t *t;
    size_t i;
    if (p->forced || !p->parse) return 0; /* none: no call to constrain */
    json_array_foreach(json_object_get(o, "tools"), i, t)
    {
        if (json_is_true(json_object_get(json_object_get(t, "function"), "strict")))
            return rt_error_set(e, 400, "tools", "unsupported_parameter",
                                "tools[%zu].function.strict needs tool_choice \"required\" or "
                                "a named function (with \"auto\" the model may answer in "
                                "text, which is not constrained)",
                                i);
    }
    return 0;
}

/* The declared tools' names, for the output parser (rt_tools.h). */
static int tool_names(json_t *o, rt_chat_tools *p, rt_error *e)
{
    json_t *v = json_object_get(o, "tools");
    size_t n = json_array_size(v);
    p->names = calloc(n, sizeof *p->names);
    if (!p->names) return rt_error_set(e, 500, NULL, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *name = json_object_get(json_object_get(json_array_get(v, i), "function"), "name");
        if (!(p->names[i] = strdup(json_string_value(name))))
            return rt_error_set(e, 500, NULL, NULL, "out of memory");
        p->n_names++;
    }
    return 0;
}

/* ---- messages ---- */

/* Which fields a message of this role may carry. name and the like would be dropped by the
 * template, so they are refused; tool_call_id is required by the API but the template has
 * no place for it (tool results are matched by order), so it is checked and not rendered. */
static int message_fields(json_t *m, size_t i, const char *role, rt_error *e)
{
    const char *key;
    json_t *v;
    json_object_foreach(m, key, v)
    {
        if (!strcmp(key, "role") || !strcmp(key, "content")) continue;
        if (!strcmp(key, "tool_calls") && !strcmp(role, "assistant")) continue;
        if (!strcmp(key, "tool_calls") && (absent(v) || (json_is_array(v) && !json_array_size(v))))
            continue;
        if (!strcmp(key, "tool_call_id") && !strcmp(role, "tool")) {
            if (json_is_string(v)) continue;
            return rt_error_set(e, 400, "messages", NULL,
                                "messages[%zu].tool_call_id must be a string", i);
        }
        return rt_error_set(e, 400, "messages", "unsupported_parameter",
                            "messages[%zu].%.100s is not supported by Tandem", i, key);
    }
    return 0;
}

/* content: a string, or text parts joined; absent/null allowed for assistant messages. */
static int message_content(json_t *content, size_t i, const char *role, rt_chat_st *st, rt_error *e)
{
    if (json_is_string(content)) {
        st->msgs[i].content = json_string_value(content);
        return 0;
    }
    if (absent(content) && !strcmp(role, "assistant")) {
        st->msgs[i].content = NULL; /* "" unless it carries tool calls (below) */
        return 0;
    }
    if (!json_is_array(content))
        return rt_error_set(e, 400, "messages", NULL,
                            "messages[%zu].content must be a string or an array of text parts", i);
    rt_buf b = {0};
    for (size_t k = 0; k < json_array_size(content); k++) {
        json_t *part = json_array_get(content, k);
        json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
        if (!json_is_string(type) || strcmp(json_string_value(type), "text") ||
            !json_is_string(text)) {
            rt_buf_free(&b);
            return rt_error_set(e, 400, "messages", NULL,
                                "messages[%zu].content[%zu]: only {\"type\": \"text\", "
                                "\"text\": ...} parts are supported",
                                i, k);
        }
        if (rt_buf_append(&b, json_string_value(text), json_string_length(text))) {
            rt_buf_free(&b);
            return rt_error_set(e, 500, NULL, NULL, "out of memory");
        }
    }
    if (rt_buf_append(&b, "", 0)) return rt_error_set(e, 500, NULL, NULL, "out of memory");
    int rc = keep(st, b.buf, e);
    if (!rc) st->msgs[i].content = b.buf;
    return rc;
}

/* An assistant message's tool_calls: [{id, type: "function", function: {name, arguments}}]
 * with arguments a JSON text, parsed and re-written by tojson as vLLM hands it to the
 * template. */
static int message_calls(json_t *calls, size_t i, rt_chat_st *st, rt_error *e)
{
    size_t n = json_is_array(calls) ? json_array_size(calls) : 0;
    if (!n) return 0;
    td_chat_tool_call *tc = calloc(n, sizeof *tc);
    if (!tc) return rt_error_set(e, 500, NULL, NULL, "out of memory");
    st->calls[i] = tc;
    for (size_t k = 0; k < n; k++) {
        json_t *c = json_array_get(calls, k), *f = json_object_get(c, "function");
        json_t *name = json_object_get(f, "name"), *args = json_object_get(f, "arguments");
        json_t *type = json_object_get(c, "type");
        if (!json_is_object(c) || (!absent(type) && (!json_is_string(type) ||
                                                     strcmp(json_string_value(type), "function"))))
            return rt_error_set(e, 400, "messages", NULL,
                                "messages[%zu].tool_calls[%zu] must be {\"id\": ..., \"type\": "
                                "\"function\", \"function\": {\"name\": ..., \"arguments\": ...}}",
                                i, k);
        if (!json_is_string(name) || !json_is_string(args))
            return rt_error_set(e, 400, "messages", NULL,
                                "messages[%zu].tool_calls[%zu].function needs a string 'name' and "
                                "'arguments' (a JSON text)",
                                i, k);
        json_error_t jerr;
        json_t *a = json_loadb(json_string_value(args), json_string_length(args),
                               JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &jerr);
        if (!a)
            return rt_error_set(e, 400, "messages", NULL,
                                "messages[%zu].tool_calls[%zu].function.arguments is not valid "
                                "JSON: %s",
                                i, k, jerr.text);
        int rc = keep(st, rt_chat_pyjson(a), e);
        json_decref(a);
        if (rc) return rc;
        tc[k].name = json_string_value(name);
        tc[k].arguments = st->owned[st->owned_n - 1];
    }
    st->msgs[i].tool_calls = tc;
    st->msgs[i].n_tool_calls = n;
    return 0;
}

static int parse_message(json_t *m, size_t i, bool tools_ok, rt_chat_st *st, rt_error *e)
{
    json_t *role = json_object_get(m, "role");
    if (!json_is_object(m) || !json_is_string(role))
        return rt_error_set(e, 400, "messages", NULL,
                            "messages[%zu] must be an object with a string 'role'", i);
    const char *rs = json_string_value(role);
    if (!strcmp(rs, "developer")) rs = "system";
    if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant") && strcmp(rs, "tool"))
        return rt_error_set(e, 400, "messages", NULL,
                            "messages[%zu].role must be system, developer, user, assistant or "
                            "tool",
                            i);
    int rc = message_fields(m, i, rs, e);
    if (rc) return rc;
    json_t *calls = json_object_get(m, "tool_calls");
    bool has_calls = json_is_array(calls) && json_array_size(calls);
    if (!absent(calls) && !json_is_array(calls))
        return rt_error_set(e, 400, "messages", NULL, "messages[%zu].tool_calls must be an array",
                            i);
    if ((has_calls || !strcmp(rs, "tool")) && !tools_ok)
        return rt_error_set(e, 400, "messages", "unsupported_parameter",
                            "messages[%zu]: %s need a chat template that renders tools (Qwen2.5's "
                            "tools block); this model's template has none",
                            i, has_calls ? "tool_calls" : "tool messages");
    st->msgs[i].role = rs;
    if ((rc = message_content(json_object_get(m, "content"), i, rs, st, e))) return rc;
    if (has_calls && (rc = message_calls(calls, i, st, e))) return rc;
    if (!st->msgs[i].content && !st->msgs[i].n_tool_calls) st->msgs[i].content = "";
    return 0;
}

static void chat_st_fini(rt_chat_st *st)
{
    for (size_t i = 0; i < st->owned_n; i++)
        free(st->owned[i]);
    if (st->calls)
        for (size_t i = 0; i < st->n; i++)
            free(st->calls[i]);
    free(st->owned);
    free(st->calls);
    free(st->tools);
    free(st->msgs);
}

void rt_chat_tools_fini(rt_chat_tools *t)
{
    for (size_t i = 0; i < t->n_names; i++)
        free(t->names[i]);
    free(t->names);
    free(t->grammar);
    *t = (rt_chat_tools){0};
}

int rt_chat_prompt(const char *tmpl, size_t tmpl_len, json_t *o, bool add_generation_prompt,
                   rt_chat_tools *p, char **text, rt_error *e)
{
    *text = NULL;
    json_t *v = json_object_get(o, "messages");
    if (absent(v)) return rt_error_set(e, 400, "messages", NULL, "'messages' is required");
    if (!json_is_array(v) || json_array_size(v) == 0)
        return rt_error_set(e, 400, "messages", NULL,
                            "'messages' must be a non-empty array of messages");
    rt_chat_st st = {.n = json_array_size(v)};
    st.msgs = calloc(st.n, sizeof *st.msgs);
    st.calls = calloc(st.n, sizeof *st.calls);
    int rc = 0;
    if (!st.msgs || !st.calls) rc = rt_error_set(e, 500, NULL, NULL, "out of memory");
    if (!rc) rc = parse_tools(tmpl, tmpl_len, o, &st, e);
    const char *named = NULL;
    if (!rc) rc = parse_choice(o, st.n_tools, p, &named, e);
    if (!rc && p->forced) rc = forced_grammar(o, named, p, e);
    if (!rc) rc = strict_needs_forced(o, p, e);
    if (!rc && p->parse) rc = tool_names(o, p, e);
    bool tools_ok = td_chat_has_tools(tmpl, tmpl_len);
    for (size_t i = 0; i < st.n && !rc; i++)
        rc = parse_message(json_array_get(v, i), i, tools_ok, &st, e);
    if (!rc) {
        int err = td_chat_render_tools(tmpl, tmpl_len, st.msgs, st.n, (const char *const *)st.tools,
                                       st.n_tools, add_generation_prompt, text);
        if (err)
            rc = rt_error_set(e, 500, NULL, NULL, "cannot render the chat template: %s",
                              td_strerror(err));
    }
    chat_st_fini(&st);
    return rc;
}
