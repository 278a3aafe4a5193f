/* rt_chat.c: chat messages, tools and tool_choice -> the prompt text (see rt_chat.h). */
#include "rt_chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gr_grammar.h"
#include "rt_reason.h"
#include "td_err.h"
#include "td_grow.h"

/* ---- tools, tool_choice, parallel_tool_calls ---- */

static bool absent(const json_t *v)
{
    return !v || json_is_null(v);
}

/* tools: each {"type": "function", "function": {"name", "description", "parameters",
 * "strict"}}, handed to the template as sent. */
static int parse_tools(const rt_chat_tmpl *tmpl, json_t *o, size_t *n_tools, rt_error *e)
{
    json_t *v = json_object_get(o, "tools");
    *n_tools = 0;
    if (absent(v)) return 0;
    if (!json_is_array(v))
        return rt_error_set(e, 400, "tools", NULL, "'tools' must be an array of tools");
    size_t n = json_array_size(v);
    if (n && !tmpl->reads_tools)
        return rt_error_set(e, 400, "tools", "unsupported_parameter",
                            "'tools' needs a chat template that renders tools; this model's "
                            "template (%s) does not read them",
                            tmpl->source);
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
    }
    *n_tools = n;
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

static int oom(rt_error *e)
{
    return rt_error_set(e, 500, NULL, NULL, "out of memory");
}

/* Which fields a message of this role may carry; the rest would reach no template, so they
 * are refused rather than dropped. */
static int message_fields(json_t *m, size_t i, const char *role, rt_error *e)
{
    const char *key;
    json_t *v;
    bool assistant = !strcmp(role, "assistant");
    json_object_foreach(m, key, v)
    {
        if (!strcmp(key, "role") || !strcmp(key, "content")) continue;
        if (!strcmp(key, "tool_calls") &&
            (assistant || absent(v) || (json_is_array(v) && !json_array_size(v))))
            continue;
        bool text_field =
            (!strcmp(key, "tool_call_id") && !strcmp(role, "tool")) || !strcmp(key, "name") ||
            (assistant && (!strcmp(key, "reasoning_content") || !strcmp(key, "reasoning")));
        if (text_field) {
            if (json_is_string(v) || absent(v)) continue;
            return rt_error_set(e, 400, "messages", NULL, "messages[%zu].%s must be a string", i,
                                key);
        }
        return rt_error_set(e, 400, "messages", "unsupported_parameter",
                            "messages[%zu].%.100s is not supported by Tandem", i, key);
    }
    return 0;
}

/* content: a string, or text parts joined; absent/null allowed for assistant messages (the
 * template then sees ""). */
static json_t *message_content(json_t *content, size_t i, const char *role, rt_error *e)
{
    if (json_is_string(content)) return json_incref(content);
    if (absent(content) && !strcmp(role, "assistant")) return json_string("");
    if (!json_is_array(content)) {
        rt_error_set(e, 400, "messages", NULL,
                     "messages[%zu].content must be a string or an array of text parts", i);
        return NULL;
    }
    rt_buf b = {0};
    for (size_t k = 0; k < json_array_size(content); k++) {
        json_t *part = json_array_get(content, k);
        json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
        if (!json_is_string(type) || strcmp(json_string_value(type), "text") ||
            !json_is_string(text)) {
            rt_buf_free(&b);
            rt_error_set(e, 400, "messages", NULL,
                         "messages[%zu].content[%zu]: only {\"type\": \"text\", \"text\": ...} "
                         "parts are supported",
                         i, k);
            return NULL;
        }
        if (rt_buf_append(&b, json_string_value(text), json_string_length(text))) {
            rt_buf_free(&b);
            oom(e);
            return NULL;
        }
    }
    json_t *s = json_stringn(b.buf ? b.buf : "", b.len);
    rt_buf_free(&b);
    if (!s) oom(e);
    return s;
}

/* An assistant message's tool_calls: [{id, type: "function", function: {name, arguments}}],
 * each arguments text parsed into the value the template writes back (vLLM's rule). */
static json_t *message_calls(json_t *calls, size_t i, rt_error *e)
{
    json_t *out = json_array();
    if (!out) return oom(e), NULL;
    for (size_t k = 0; k < json_array_size(calls); k++) {
        json_t *c = json_array_get(calls, k), *f = json_object_get(c, "function");
        json_t *name = json_object_get(f, "name"), *args = json_object_get(f, "arguments");
        json_t *type = json_object_get(c, "type"), *id = json_object_get(c, "id");
        if (!json_is_object(c) ||
            (!absent(type) &&
             (!json_is_string(type) || strcmp(json_string_value(type), "function")))) {
            rt_error_set(e, 400, "messages", NULL,
                         "messages[%zu].tool_calls[%zu] must be {\"id\": ..., \"type\": "
                         "\"function\", \"function\": {\"name\": ..., \"arguments\": ...}}",
                         i, k);
            goto fail;
        }
        if (!json_is_string(name) || !json_is_string(args) ||
            (!absent(id) && !json_is_string(id))) {
            rt_error_set(e, 400, "messages", NULL,
                         "messages[%zu].tool_calls[%zu] needs a string 'id', and a function "
                         "with a string 'name' and 'arguments' (a JSON text)",
                         i, k);
            goto fail;
        }
        json_error_t jerr;
        json_t *a = json_loadb(json_string_value(args), json_string_length(args),
                               JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &jerr);
        if (!a) {
            rt_error_set(e, 400, "messages", NULL,
                         "messages[%zu].tool_calls[%zu].function.arguments is not valid JSON: %s",
                         i, k, jerr.text);
            goto fail;
        }
        json_t *call = absent(id) ? json_pack("{s:s, s:{s:O, s:o}}", "type", "function", "function",
                                              "name", name, "arguments", a)
                                  : json_pack("{s:O, s:s, s:{s:O, s:o}}", "id", id, "type",
                                              "function", "function", "name", name, "arguments", a);
        if (json_array_append_new(out, call)) {
            oom(e);
            goto fail;
        }
    }
    return out;
fail:
    json_decref(out);
    return NULL;
}

/* One message as the template sees it: role (developer read as system), content, and the
 * role's own fields. */
static json_t *parse_message(json_t *m, size_t i, rt_error *e)
{
    json_t *role = json_object_get(m, "role");
    if (!json_is_object(m) || !json_is_string(role)) {
        rt_error_set(e, 400, "messages", NULL,
                     "messages[%zu] must be an object with a string 'role'", i);
        return NULL;
    }
    const char *rs = json_string_value(role);
    if (!strcmp(rs, "developer")) rs = "system";
    if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant") &&
        strcmp(rs, "tool")) {
        rt_error_set(e, 400, "messages", NULL,
                     "messages[%zu].role must be system, developer, user, assistant or tool", i);
        return NULL;
    }
    if (message_fields(m, i, rs, e)) return NULL;
    json_t *calls = json_object_get(m, "tool_calls");
    if (!absent(calls) && !json_is_array(calls)) {
        rt_error_set(e, 400, "messages", NULL, "messages[%zu].tool_calls must be an array", i);
        return NULL;
    }
    json_t *out = json_pack("{s:s}", "role", rs), *content;
    if (!out) return oom(e), NULL;
    if (!(content = message_content(json_object_get(m, "content"), i, rs, e)) ||
        json_object_set_new(out, "content", content))
        goto fail;
    static const char *const copied[] = {"name", "tool_call_id", "reasoning_content", "reasoning"};
    for (size_t k = 0; k < sizeof copied / sizeof *copied; k++) {
        json_t *v = json_object_get(m, copied[k]);
        if (!absent(v) && json_object_set(out, copied[k], v)) goto oom_fail;
    }
    if (json_array_size(calls)) {
        json_t *c = message_calls(calls, i, e);
        if (!c || json_object_set_new(out, "tool_calls", c)) goto fail;
    }
    return out;
oom_fail:
    oom(e);
fail:
    json_decref(out);
    return NULL;
}

/* The messages as the template sees them; NULL with e filled. */
static json_t *parse_messages(json_t *o, rt_error *e)
{
    json_t *v = json_object_get(o, "messages"), *out;
    if (absent(v)) return rt_error_set(e, 400, "messages", NULL, "'messages' is required"), NULL;
    if (!json_is_array(v) || json_array_size(v) == 0) {
        rt_error_set(e, 400, "messages", NULL, "'messages' must be a non-empty array of messages");
        return NULL;
    }
    if (!(out = json_array())) return oom(e), NULL;
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *m = parse_message(json_array_get(v, i), i, e);
        if (!m || json_array_append_new(out, m)) {
            if (m) oom(e);
            json_decref(out);
            return NULL;
        }
    }
    return out;
}

void rt_chat_tools_fini(rt_chat_tools *t)
{
    for (size_t i = 0; i < t->n_names; i++)
        free(t->names[i]);
    free(t->names);
    free(t->grammar);
    json_decref(t->tools);
    *t = (rt_chat_tools){0};
}

/* The rendering of the conversation, or the status of why not. */
static int render(const rt_chat_tmpl *tmpl, const jn_chat *chat, size_t n_tools, char **text,
                  rt_error *e)
{
    const jn_template *t = n_tools && tmpl->tool_use ? tmpl->tool_use : tmpl->main;
    if (!t) return rt_error_set(e, 500, NULL, NULL, "the model has no chat template");
    jn_error err = {0};
    int rc = jn_chat_render(t, chat, NULL, text, NULL, &err);
    switch (rc) {
    case 0:
        return 0;
    case TD_EINVAL: /* the template refused the conversation (raise_exception and the like) */
        return rt_error_set(e, 400, "messages", NULL,
                            "the model's chat template refused the conversation (line %d): %s",
                            err.line, err.msg);
    case TD_ERANGE:
        return rt_error_set(e, 400, "messages", NULL,
                            "the conversation is too large for the chat template: %s", err.msg);
    case TD_EUNSUPP:
        return rt_error_set(e, 500, NULL, NULL,
                            "the model's chat template needs what Tandem's template engine "
                            "does not implement (line %d): %s",
                            err.line, err.msg);
    default:
        return oom(e);
    }
}

int rt_chat_prompt(const rt_chat_tmpl *tmpl, json_t *o, bool add_generation_prompt,
                   rt_chat_tools *p, char **text, rt_error *e)
{
    *text = NULL;
    size_t n_tools = 0;
    const char *named = NULL;
    json_t *kw = json_object_get(o, "chat_template_kwargs");
    if (!absent(kw) && !json_is_object(kw))
        return rt_error_set(e, 400, "chat_template_kwargs", NULL,
                            "'chat_template_kwargs' must be an object");
    /* the variables the request itself sets (transformers refuses them twice too) */
    static const char *const reserved[] = {"messages", "tools", "documents",
                                           "add_generation_prompt"};
    for (size_t k = 0; k < sizeof reserved / sizeof *reserved; k++)
        if (json_object_get(kw, reserved[k]))
            return rt_error_set(e, 400, "chat_template_kwargs", NULL,
                                "chat_template_kwargs.%s is set by the request itself",
                                reserved[k]);
    int rc = parse_tools(tmpl, o, &n_tools, e);
    if (!rc) rc = parse_choice(o, n_tools, p, &named, e);
    if (!rc && p->forced) rc = forced_grammar(o, named, p, e);
    if (!rc) rc = strict_needs_forced(o, p, e);
    if (!rc && p->parse) rc = tool_names(o, p, e);
    if (!rc && p->parse) { /* a forced call is the bare JSON that the Hermes parser reads */
        p->fmt = p->forced ? RT_TOOLFMT_HERMES : tmpl->tool_fmt;
        p->tools = json_incref(json_object_get(o, "tools"));
    }
    json_t *msgs = rc ? NULL : parse_messages(o, e);
    if (!msgs) return rc ? rc : e->status;
    jn_chat chat = {.messages = msgs,
                    .tools = n_tools ? json_object_get(o, "tools") : NULL,
                    .add_generation_prompt = add_generation_prompt,
                    .bos_token = tmpl->special.bos,
                    .eos_token = tmpl->special.eos,
                    .kwargs = absent(kw) ? NULL : kw};
    rc = render(tmpl, &chat, n_tools, text, e);
    json_decref(msgs);
    return rc;
}

/* ---- the templates ---- */

static int compile(jn_template **t, const char *text, size_t len, const char *what, char *err,
                   size_t cap)
{
    jn_error je = {0};
    int rc = jn_parse(text, len, t, &je);
    if (rc) snprintf(err, cap, "%s does not parse: line %d: %s", what, je.line, je.msg);
    return rc;
}

int rt_chat_tmpl_init_text(rt_chat_tmpl *t, const char *text, size_t len, char *err, size_t cap)
{
    *t = (rt_chat_tmpl){0};
    snprintf(t->source, sizeof t->source, "a template text");
    int rc = compile(&t->main, text, len, "the chat template", err, cap);
    t->reads_tools = !rc && jn_template_reads(t->main, "tools");
    t->thinks = rc ? RT_REASON_NONE : rt_reason_template(text, len);
    t->tool_fmt = rt_toolfmt_detect(text, len);
    return rc;
}

/* router.chat_template's file, whole. */
static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    long n = -1;
    if (f && !fseek(f, 0, SEEK_END) && (n = ftell(f)) >= 0 && n < (1L << 24) &&
        !fseek(f, 0, SEEK_SET) && (buf = malloc((size_t)n + 1)) &&
        fread(buf, 1, (size_t)n, f) == (size_t)n) {
        buf[n] = '\0';
        *len = (size_t)n;
    } else {
        free(buf);
        buf = NULL;
    }
    if (f) fclose(f);
    return buf;
}

int rt_chat_tmpl_init(rt_chat_tmpl *t, const td_gguf *g, const td_tokenizer *tok,
                      const char *forced, char *err, size_t cap)
{
    *t = (rt_chat_tmpl){0};
    const char *text = NULL;
    char *file = NULL;
    size_t len = 0;
    int rc = 0;
    if (forced && forced[0] && (text = jn_family_template(forced))) {
        len = strlen(text);
        snprintf(t->source, sizeof t->source, "the built-in %s template", forced);
    } else if (forced && forced[0]) {
        if (!(file = read_file(forced, &len))) {
            snprintf(err, cap,
                     "router.chat_template '%s' is neither chatml, llama3, llama2, gemma "
                     "nor a readable template file (up to 16 MiB)",
                     forced);
            return TD_EIO;
        }
        text = file;
        snprintf(t->source, sizeof t->source, "the file %.290s", forced);
    } else if (td_gguf_get_str(g, "tokenizer.chat_template", &text, &len)) {
        snprintf(err, cap,
                 "the model has no chat template (tokenizer.chat_template); name one in "
                 "router.chat_template (chatml, llama3, llama2, gemma, or a file)");
        return TD_EUNSUPP;
    } else {
        snprintf(t->source, sizeof t->source, "the model's tokenizer.chat_template");
    }
    rc = compile(&t->main, text, len, t->source, err, cap);
    t->thinks = rt_reason_template(text, len);
    t->tool_fmt = rt_toolfmt_detect(text, len);
    free(file);
    const char *tu;
    size_t tul;
    if (!rc && (!forced || !forced[0]) &&
        !td_gguf_get_str(g, "tokenizer.chat_template.tool_use", &tu, &tul))
        rc = compile(&t->tool_use, tu, tul, "the model's tokenizer.chat_template.tool_use", err,
                     cap);
    if (!rc && t->tool_use && !t->thinks) t->thinks = rt_reason_template(tu, tul);
    if (!rc && t->tool_use)
        t->tool_fmt = rt_toolfmt_detect(tu, tul); /* what requests with tools use */
    if (!rc) t->reads_tools = jn_template_reads(t->tool_use ? t->tool_use : t->main, "tools");
    if (!rc && (rc = jn_special_init(&t->special, tok))) snprintf(err, cap, "out of memory");
    if (rc) rt_chat_tmpl_fini(t);
    return rc;
}

void rt_chat_tmpl_fini(rt_chat_tmpl *t)
{
    jn_template_free(t->main);
    jn_template_free(t->tool_use);
    jn_special_fini(&t->special);
    *t = (rt_chat_tmpl){0};
}
