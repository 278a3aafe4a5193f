/* rt_toolfmt.c: tool-call formats: detection, block markers, block parsers (see rt_toolfmt.h).
 *
 * Each parser reads one complete block as vLLM's parser of the same name reads the whole
 * output: JSON formats (llama3_json, mistral, pythonic) are all-or-nothing (anything
 * malformed leaves the block as content); tag formats (deepseek, kimi_k2, qwen3_coder,
 * glm45) take every call whose tags match and skip the rest. */
#define _GNU_SOURCE /* memmem, strndup */
#include "rt_toolfmt.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "jn.h"
#include "td_err.h"
#include "td_grow.h"

static const char *const NAMES[RT_TOOLFMT_N] = {
    [RT_TOOLFMT_HERMES] = "hermes",
    [RT_TOOLFMT_LLAMA3_JSON] = "llama3_json",
    [RT_TOOLFMT_MISTRAL] = "mistral",
    [RT_TOOLFMT_DEEPSEEK_V3] = "deepseek_v3",
    [RT_TOOLFMT_DEEPSEEK_V31] = "deepseek_v31",
    [RT_TOOLFMT_QWEN3_CODER] = "qwen3_coder",
    [RT_TOOLFMT_GLM45] = "glm45",
    [RT_TOOLFMT_KIMI_K2] = "kimi_k2",
    [RT_TOOLFMT_PYTHONIC] = "pythonic",
};

const char *rt_toolfmt_name(rt_toolfmt f)
{
    return f >= 0 && f < RT_TOOLFMT_N ? NAMES[f] : "?";
}

bool rt_toolfmt_by_name(const char *name, rt_toolfmt *f)
{
    for (int i = 0; i < RT_TOOLFMT_N; i++)
        if (!strcmp(name, NAMES[i])) {
            *f = (rt_toolfmt)i;
            return true;
        }
    return false;
}

static bool has(const char *s, size_t n, const char *lit)
{
    return memmem(s, n, lit, strlen(lit)) != NULL;
}

rt_toolfmt rt_toolfmt_detect(const char *t, size_t n)
{
    if (has(t, n, "[TOOL_CALLS]")) return RT_TOOLFMT_MISTRAL;
    if (has(t, n, RT_TF_DS_CALLS_BEGIN))
        return has(t, n, "```json") ? RT_TOOLFMT_DEEPSEEK_V3 : RT_TOOLFMT_DEEPSEEK_V31;
    if (has(t, n, RT_TF_KIMI_BEGIN)) return RT_TOOLFMT_KIMI_K2;
    if (has(t, n, "<arg_key>")) return RT_TOOLFMT_GLM45;
    if (has(t, n, "<function=") && has(t, n, "<parameter=") && !has(t, n, "<seed:tool_call>"))
        return RT_TOOLFMT_QWEN3_CODER; /* Seed-OSS wraps the same in <seed:tool_call> */
    if (has(t, n, "<tool_call>")) return RT_TOOLFMT_HERMES;
    if (has(t, n, "{\"name\": function name, \"parameters\"")) return RT_TOOLFMT_LLAMA3_JSON;
    if (has(t, n, "[func_name1(")) return RT_TOOLFMT_PYTHONIC;
    return RT_TOOLFMT_HERMES;
}

bool rt_toolfmt_shows_special(rt_toolfmt f)
{
    return f == RT_TOOLFMT_MISTRAL || f == RT_TOOLFMT_KIMI_K2 || f == RT_TOOLFMT_DEEPSEEK_V3 ||
           f == RT_TOOLFMT_DEEPSEEK_V31;
}

const rt_toolfmt_marker *rt_toolfmt_markers(rt_toolfmt f, size_t *n)
{
    static const rt_toolfmt_marker llama[] = {{"<|python_tag|>", NULL, false}, {"{", NULL, true}};
    static const rt_toolfmt_marker mistral[] = {{"[TOOL_CALLS]", NULL, false}};
    static const rt_toolfmt_marker ds[] = {{RT_TF_DS_CALLS_BEGIN, RT_TF_DS_CALLS_END, false}};
    static const rt_toolfmt_marker qwen[] = {{"<tool_call>", "</tool_call>", false},
                                             {"<function=", "</function>", false}};
    static const rt_toolfmt_marker glm[] = {{"<tool_call>", "</tool_call>", false}};
    static const rt_toolfmt_marker kimi[] = {{RT_TF_KIMI_BEGIN, RT_TF_KIMI_END, false}};
    static const rt_toolfmt_marker py[] = {{"[", NULL, true}};
#define M(a)                                                                                       \
    do {                                                                                           \
        *n = sizeof a / sizeof a[0];                                                               \
        return a;                                                                                  \
    } while (0)
    switch (f) {
    case RT_TOOLFMT_LLAMA3_JSON:
        M(llama);
    case RT_TOOLFMT_MISTRAL:
        M(mistral);
    case RT_TOOLFMT_DEEPSEEK_V3:
    case RT_TOOLFMT_DEEPSEEK_V31:
        M(ds);
    case RT_TOOLFMT_QWEN3_CODER:
        M(qwen);
    case RT_TOOLFMT_GLM45:
        M(glm);
    case RT_TOOLFMT_KIMI_K2:
        M(kimi);
    case RT_TOOLFMT_PYTHONIC:
        M(py);
    default:
        break;
    }
#undef M
    *n = 0;
    return NULL;
}

/* ---- results ---- */

void rt_toolfmt_calls_fini(rt_toolfmt_calls *c)
{
    for (int i = 0; i < c->n; i++) {
        free(c->v[i].name);
        free(c->v[i].args);
        free(c->v[i].id);
    }
    free(c->v);
    *c = (rt_toolfmt_calls){0};
}

/* Append a call; args is taken (freed on failure). */
static int add_call(rt_toolfmt_calls *out, const char *name, size_t nlen, char *args,
                    const char *id, size_t idlen)
{
    if (!args || TD_GROW_INT(out->v, out->cap, out->n + 1, 4)) {
        free(args);
        return TD_ENOMEM;
    }
    rt_toolfmt_call *c = &out->v[out->n];
    *c = (rt_toolfmt_call){
        .name = strndup(name, nlen), .args = args, .id = id ? strndup(id, idlen) : NULL};
    if (!c->name || (id && !c->id)) {
        free(c->name);
        free(c->args);
        free(c->id);
        return TD_ENOMEM;
    }
    out->n++;
    return 0;
}

static int add_json_call(rt_toolfmt_calls *out, const char *name, size_t nlen, const json_t *args)
{
    return add_call(out, name, nlen, jn_pyjson(args), NULL, 0);
}

static bool is_ws(char c)
{
    return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

/* s[*a..*b) without surrounding whitespace */
static void trim(const char *s, size_t *a, size_t *b)
{
    while (*a < *b && is_ws(s[*a]))
        (*a)++;
    while (*b > *a && is_ws(s[*b - 1]))
        (*b)--;
}

static size_t skip_lit(const char *s, size_t n, size_t i, const char *lit)
{
    size_t k = strlen(lit);
    return i + k <= n && !memcmp(s + i, lit, k) ? i + k : i;
}

/* Offset of lit in s[from..n), or n. */
size_t rt_toolfmt_find(const char *s, size_t n, size_t from, const char *lit)
{
    if (from >= n) return n;
    const char *p = memmem(s + from, n - from, lit, strlen(lit));
    return p ? (size_t)(p - s) : n;
}

/* One JSON value at s[*i..n) (whitespace before it skipped); *i moves past it. */
static json_t *json_at(const char *s, size_t n, size_t *i)
{
    while (*i < n && is_ws(s[*i]))
        (*i)++;
    json_error_t err;
    json_t *v = json_loadb(s + *i, n - *i, JSON_DECODE_ANY | JSON_DISABLE_EOF_CHECK, &err);
    if (v) *i += (size_t)err.position;
    return v;
}

/* ---- Python literals (pythonic calls; glm45 / qwen3_coder values, as ast.literal_eval) ---- */

typedef struct {
    const char *s;
    size_t n, i;
    int depth;
} rt_py;

static void py_ws(rt_py *r)
{
    while (r->i < r->n && is_ws(r->s[r->i]))
        r->i++;
}

static int hexval(char c)
{
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

static size_t utf8_put(char *o, uint32_t cp)
{
    if (cp < 0x80) return (size_t)(o[0] = (char)cp, 1);
    if (cp < 0x800) {
        o[0] = (char)(0xc0 | cp >> 6), o[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xe0 | cp >> 12), o[1] = (char)(0x80 | (cp >> 6 & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (char)(0xf0 | cp >> 18), o[1] = (char)(0x80 | (cp >> 12 & 0x3f));
    o[2] = (char)(0x80 | (cp >> 6 & 0x3f)), o[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* A '...' or "..." string with Python's escapes; NULL if malformed. */
static json_t *py_str(rt_py *r)
{
    char q = r->s[r->i++];
    char *o = malloc(r->n - r->i + 1);
    size_t k = 0;
    while (o && r->i < r->n && r->s[r->i] != q && r->s[r->i] != '\n') {
        char c = r->s[r->i++];
        if (c != '\\') {
            o[k++] = c;
            continue;
        }
        if (r->i == r->n) break;
        char e = r->s[r->i++];
        static const char from[] = "nrtbfv0\\'\"", to[] = "\n\r\t\b\f\v\0\\'\"";
        const char *m = memchr(from, e, sizeof from - 1);
        int w = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
        if (m) {
            o[k++] = to[m - from];
        } else if (e == '\n') {
            /* a line continuation */
        } else if (w && r->i + (size_t)w <= r->n) {
            uint32_t cp = 0;
            for (int j = 0; j < w; j++) {
                int h = hexval(r->s[r->i++]);
                cp = h < 0 ? 0x110000 : cp * 16 + (uint32_t)h;
            }
            if (cp > 0x10ffff || (cp >= 0xd800 && cp < 0xe000)) break;
            k += utf8_put(o + k, cp); /* at most 4 bytes for the 4 to 10 it replaced */
        } else {
            o[k++] = '\\', o[k++] = e; /* Python keeps an unknown escape */
        }
    }
    json_t *v = NULL;
    if (o && r->i < r->n && r->s[r->i] == q) {
        r->i++;
        v = json_stringn(o, k); /* NULL for invalid UTF-8 */
    }
    free(o);
    return v;
}

static json_t *py_num(rt_py *r)
{
    size_t a = r->i;
    bool real = false;
    if (r->i < r->n && (r->s[r->i] == '-' || r->s[r->i] == '+')) r->i++;
    while (r->i < r->n && r->s[r->i] && strchr("0123456789.eE+-", r->s[r->i])) {
        char c = r->s[r->i];
        if ((c == '+' || c == '-') && r->s[r->i - 1] != 'e' && r->s[r->i - 1] != 'E') break;
        real |= c == '.' || c == 'e' || c == 'E';
        r->i++;
    }
    char buf[64];
    size_t len = r->i - a;
    if (!len || len >= sizeof buf) return NULL;
    memcpy(buf, r->s + a, len);
    buf[len] = 0;
    char *end;
    errno = 0;
    if (!real) {
        long long x = strtoll(buf, &end, 10);
        return *end || errno ? NULL : json_integer(x);
    }
    double d = strtod(buf, &end);
    return *end || !isfinite(d) ? NULL : json_real(d);
}

static json_t *py_value(rt_py *r);

/* [...] or (...) -> a list; {k: v, ...} -> an object with string keys. */
static json_t *py_container(rt_py *r)
{
    char open = r->s[r->i++], close = open == '[' ? ']' : open == '(' ? ')' : '}';
    json_t *v = open == '{' ? json_object() : json_array();
    bool ok = v && r->depth < 64, closed = false;
    r->depth++;
    for (bool first = true; ok && !closed; first = false) {
        py_ws(r);
        if (!first && r->i < r->n && r->s[r->i] == ',') {
            r->i++;
            py_ws(r);
        } else if (!first && !(r->i < r->n && r->s[r->i] == close)) {
            break;
        }
        if (r->i < r->n && r->s[r->i] == close) {
            r->i++;
            closed = true;
            break;
        }
        json_t *k = py_value(r);
        if (open != '{') {
            ok = k && !json_array_append_new(v, k);
            continue;
        }
        py_ws(r);
        json_t *x = NULL;
        if (json_is_string(k) && r->i < r->n && r->s[r->i] == ':') {
            r->i++;
            x = py_value(r);
        }
        ok = x && !json_object_set_new(v, json_string_value(k), x);
        json_decref(k);
    }
    r->depth--;
    if (!closed) json_decref(v);
    return closed ? v : NULL;
}

static json_t *py_value(rt_py *r)
{
    py_ws(r);
    if (r->i >= r->n) return NULL;
    char c = r->s[r->i];
    if (c == '\'' || c == '"') return py_str(r);
    if (c == '[' || c == '(' || c == '{') return py_container(r);
    static const struct {
        const char *w;
        int v;
    } kw[] = {{"True", 1}, {"False", 0}, {"None", -1}};
    for (size_t k = 0; k < 3; k++) {
        size_t e = skip_lit(r->s, r->n, r->i, kw[k].w);
        bool word =
            e < r->n && (r->s[e] == '_' || ((r->s[e] | 32) >= 'a' && (r->s[e] | 32) <= 'z'));
        if (e != r->i && !word) {
            r->i = e;
            return kw[k].v < 0 ? json_null() : json_boolean(kw[k].v);
        }
    }
    return py_num(r);
}

/* ast.literal_eval of the whole text s[0..n), NULL if it is not one literal. */
static json_t *py_literal(const char *s, size_t n)
{
    rt_py r = {s, n, 0, 0};
    json_t *v = py_value(&r);
    py_ws(&r);
    if (v && r.i != n) json_decref(v), v = NULL;
    return v;
}

/* ---- llama3_json: {"name": f, "arguments"|"parameters": {...}} (; {...})* ---- */

static int parse_llama3(const char *s, size_t n, rt_toolfmt_calls *out)
{
    size_t i = skip_lit(s, n, 0, "<|python_tag|>");
    rt_toolfmt_calls got = {0};
    int rc = 0;
    for (bool more = true; more && !rc;) {
        json_t *o = json_at(s, n, &i);
        json_t *name = json_object_get(o, "name"), *args = json_object_get(o, "arguments");
        if (!args) args = json_object_get(o, "parameters");
        if (!json_is_string(name) || !json_is_object(args)) {
            json_decref(o);
            rt_toolfmt_calls_fini(&got);
            return 0;
        }
        rc = add_json_call(&got, json_string_value(name), json_string_length(name), args);
        json_decref(o);
        while (i < n && is_ws(s[i]))
            i++;
        more = i < n && s[i] == ';';
        i += more;
        while (i < n && is_ws(s[i]))
            i++;
        if (!more && i < n) rt_toolfmt_calls_fini(&got); /* text after the calls */
    }
    for (int k = 0; k < got.n && !rc; k++) {
        rc = add_call(out, got.v[k].name, strlen(got.v[k].name), got.v[k].args, NULL, 0);
        got.v[k].args = NULL;
    }
    rt_toolfmt_calls_fini(&got);
    return rc;
}

/* ---- mistral ---- */

/* One [TOOL_CALLS] segment: a JSON array of {name, arguments}, or f[CALL_ID]id[ARGS]{...},
 * f[ARGS]{...} or f{...} (several of the last may follow each other). Returns 0, TD_ENOMEM,
 * or 1: malformed. */
static int mistral_segment(const char *s, size_t n, rt_toolfmt_calls *out)
{
    size_t i = 0;
    while (i < n && is_ws(s[i]))
        i++;
    if (i < n && s[i] == '[') {
        json_t *a = json_at(s, n, &i), *c;
        size_t k;
        int rc = json_is_array(a) && json_array_size(a) ? 0 : 1;
        json_array_foreach(a, k, c)
        {
            json_t *name = json_object_get(c, "name"), *args = json_object_get(c, "arguments");
            if (rc || !json_is_string(name) || !args) {
                rc = rc ? rc : 1;
                break;
            }
            rc = add_json_call(out, json_string_value(name), json_string_length(name), args);
        }
        json_decref(a);
        return rc;
    }
    while (i < n) {
        size_t a = i;
        while (i < n && s[i] != '{' && s[i] != '[')
            i++;
        size_t b = i;
        trim(s, &a, &b);
        if (i < n && s[i] == '[') { /* [CALL_ID]id, then [ARGS] */
            size_t j = skip_lit(s, n, i, "[CALL_ID]");
            if (j != i) i = rt_toolfmt_find(s, n, j, "[ARGS]");
            size_t k = skip_lit(s, n, i, "[ARGS]");
            if (k == i) return 1;
            i = k;
        }
        json_t *args = a < b ? json_at(s, n, &i) : NULL;
        if (!json_is_object(args)) return json_decref(args), 1;
        int rc = add_json_call(out, s + a, b - a, args);
        json_decref(args);
        if (rc) return rc;
        while (i < n && (is_ws(s[i]) || s[i] == ','))
            i++;
    }
    return out->n ? 0 : 1;
}

static int parse_mistral(const char *s, size_t n, rt_toolfmt_calls *out)
{
    static const char TAG[] = "[TOOL_CALLS]";
    rt_toolfmt_calls got = {0};
    int rc = 0;
    for (size_t i = rt_toolfmt_find(s, n, 0, TAG); i < n && !rc;) {
        size_t a = i + sizeof TAG - 1, b = rt_toolfmt_find(s, n, a, TAG);
        rc = mistral_segment(s + a, b - a, &got);
        i = b;
    }
    if (rc == 1) rc = 0, rt_toolfmt_calls_fini(&got);
    for (int k = 0; k < got.n && !rc; k++) {
        rc = add_call(out, got.v[k].name, strlen(got.v[k].name), got.v[k].args, NULL, 0);
        got.v[k].args = NULL;
    }
    rt_toolfmt_calls_fini(&got);
    return rc;
}

/* ---- deepseek_v3, deepseek_v31, kimi_k2: tagged calls, arguments passed through ---- */

static int parse_deepseek(bool v3, const char *s, size_t n, rt_toolfmt_calls *out)
{
    int rc = 0;
    for (size_t i = rt_toolfmt_find(s, n, 0, RT_TF_DS_CALL_BEGIN); i < n && !rc;) {
        size_t a = i + strlen(RT_TF_DS_CALL_BEGIN), e = rt_toolfmt_find(s, n, a, RT_TF_DS_CALL_END);
        i = e < n ? rt_toolfmt_find(s, n, e, RT_TF_DS_CALL_BEGIN) : n;
        size_t sep = rt_toolfmt_find(s, e, a, RT_TF_DS_SEP);
        if (e == n || sep == e) continue;
        size_t na = sep + strlen(RT_TF_DS_SEP), nb, aa, ab = e;
        if (v3) { /* type<sep>name\n```json\nARGS\n``` */
            nb = rt_toolfmt_find(s, e, na, "\n```json\n");
            aa = nb + 9;
            if (nb == e || ab < aa + 4 || memcmp(s + ab - 4, "\n```", 4)) continue;
            ab -= 4;
        } else { /* name<sep>ARGS */
            nb = sep, aa = na, na = a;
        }
        char *args = strndup(s + aa, ab - aa);
        rc = add_call(out, s + na, nb - na, args, NULL, 0);
    }
    return rc;
}

static int parse_kimi(const char *s, size_t n, rt_toolfmt_calls *out)
{
    int rc = 0;
    for (size_t i = rt_toolfmt_find(s, n, 0, RT_TF_KIMI_CALL); i < n && !rc;) {
        size_t a = i + strlen(RT_TF_KIMI_CALL), e = rt_toolfmt_find(s, n, a, RT_TF_KIMI_CALL_END);
        i = e < n ? rt_toolfmt_find(s, n, e, RT_TF_KIMI_CALL) : n;
        size_t sep = rt_toolfmt_find(s, e, a, RT_TF_KIMI_ARG);
        if (e == n || sep == e || rt_toolfmt_find(s, e, a, RT_TF_KIMI_CALL) != e) continue;
        size_t ia = a, ib = sep, aa = sep + strlen(RT_TF_KIMI_ARG), ab = e;
        trim(s, &ia, &ib);
        trim(s, &aa, &ab);
        /* the id: functions.f:0 (or f:0): name = before ":", after the last "." */
        size_t colon = ib;
        while (colon > ia && s[colon - 1] != ':')
            colon--;
        bool digits = colon > ia && colon < ib && memchr(s + ia, '<', ib - ia) == NULL;
        for (size_t k = colon; digits && k < ib; k++)
            digits = s[k] >= '0' && s[k] <= '9';
        if (!digits) continue;
        size_t nb = colon - 1, na = nb;
        while (na > ia && s[na - 1] != '.')
            na--;
        rc = add_call(out, s + na, nb - na, strndup(s + aa, ab - aa), s + ia, ib - ia);
    }
    return rc;
}

/* ---- qwen3_coder and glm45: parameters typed from the tool's schema ---- */

/* The schema of parameter p of tool f in tools (its parameters' properties, or the
 * parameters object itself without them, as vLLM reads it); NULL: not declared. */
static const json_t *param_schema(const json_t *tools, const char *f, const char *p)
{
    size_t i;
    const json_t *t;
    json_array_foreach(tools, i, t)
    {
        const json_t *fn = json_object_get(t, "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        if (!name || strcmp(name, f)) continue;
        const json_t *ps = json_object_get(fn, "parameters");
        const json_t *props = json_object_get(ps, "properties");
        if (!json_is_object(props)) props = json_is_object(ps) ? ps : NULL;
        return json_object_get(props, p);
    }
    return NULL;
}

static bool starts(const char *s, const char *p)
{
    return !strncmp(s, p, strlen(p));
}

static json_t *json_or_literal(const char *v, size_t n, bool try_json)
{
    json_t *x = try_json ? json_loadb(v, n, JSON_DECODE_ANY, NULL) : NULL;
    return x ? x : py_literal(v, n);
}

/* vLLM's Qwen3-Coder conversion of a parameter's text by its schema type. */
static json_t *qwen_value(const char *v, size_t n, const json_t *schema)
{
    if (n == 4 && !strncasecmp(v, "null", 4)) return json_null();
    if (!schema) return json_stringn(v, n);
    const json_t *tj = json_object_get(schema, "type");
    char type[64] = "string";
    if (json_is_string(tj)) {
        size_t a = 0, b = json_string_length(tj);
        trim(json_string_value(tj), &a, &b);
        snprintf(type, sizeof type, "%.*s", (int)(b - a), json_string_value(tj) + a);
        for (char *c = type; *c; c++)
            *c = (char)((*c >= 'A' && *c <= 'Z') ? *c + 32 : *c);
    } else if (tj) {
        type[0] = 0; /* a list of types: literal_eval, as vLLM's str() of it matches nothing */
    }
    static const char *const str_types[] = {"string", "str", "text", "varchar", "char", "enum"};
    for (size_t i = 0; i < 6; i++)
        if (!strcmp(type, str_types[i])) return json_stringn(v, n);
    char buf[64];
    bool small = n < sizeof buf;
    if (small) memcpy(buf, v, n), buf[n] = 0;
    char *end = NULL;
    if (starts(type, "int") || starts(type, "uint") || starts(type, "long") ||
        starts(type, "short") || starts(type, "unsigned")) {
        long long x = small ? (errno = 0, strtoll(buf, &end, 10)) : 0;
        while (end && is_ws(*end))
            end++;
        return small && end != buf && !*end && !errno ? json_integer(x) : json_stringn(v, n);
    }
    if (starts(type, "num") || starts(type, "float")) {
        double d = small ? strtod(buf, &end) : 0;
        while (end && is_ws(*end))
            end++;
        if (!small || end == buf || *end || !isfinite(d)) return json_stringn(v, n);
        return d == trunc(d) && fabs(d) < 9.2e18 ? json_integer((long long)d) : json_real(d);
    }
    if (!strcmp(type, "boolean") || !strcmp(type, "bool") || !strcmp(type, "binary"))
        return json_boolean(n == 4 && !strncasecmp(v, "true", 4));
    bool js = !strcmp(type, "object") || !strcmp(type, "array") || !strcmp(type, "arr") ||
              starts(type, "dict") || starts(type, "list");
    json_t *x = json_or_literal(v, n, js);
    return x ? x : json_stringn(v, n);
}

/* Parameter key of tool fn with the value text v[0..n) (already cut as the format cuts it),
 * typed as the format's parser types it; NULL: no memory (or invalid UTF-8). */
static json_t *param_value(rt_toolfmt f, const json_t *tools, const char *fn, const char *key,
                           const char *v, size_t n)
{
    if (f == RT_TOOLFMT_PYTHONIC) return py_literal(v, n); /* untyped: as parse_pythonic */
    const json_t *sc = param_schema(tools, fn, key);
    if (f == RT_TOOLFMT_QWEN3_CODER) return qwen_value(v, n, sc);
    const char *ty = json_string_value(json_object_get(sc, "type"));
    json_t *x = ty && !strcmp(ty, "string") ? NULL : json_or_literal(v, n, true);
    return x ? x : json_stringn(v, n);
}

char *rt_toolfmt_param_json(rt_toolfmt f, const json_t *tools, const char *fn, const char *key,
                            const char *v, size_t n)
{
    /* the object's own text less its braces: exactly what the whole call's json.dumps holds */
    json_t *o = json_object(), *x = param_value(f, tools, fn, key, v, n);
    char *s = o && x && !json_object_set_new(o, key, x) ? jn_pyjson(o) : NULL;
    if (!o) json_decref(x);
    json_decref(o);
    size_t len = s ? strlen(s) : 0;
    if (len >= 2) {
        memmove(s, s + 1, len - 2);
        s[len - 2] = 0;
    }
    return s;
}

/* <function=NAME>(<parameter=P>VALUE</parameter>)*: one call from s[0..n) (after "<function="). */
static int qwen_function(const char *s, size_t n, const json_t *tools, rt_toolfmt_calls *out)
{
    size_t gt = rt_toolfmt_find(s, n, 0, ">");
    if (gt == n) return 0;
    char *name = strndup(s, gt);
    json_t *args = json_object();
    int rc = name && args ? 0 : TD_ENOMEM;
    for (size_t i = rt_toolfmt_find(s, n, gt, "<parameter="); i < n && !rc;) {
        size_t a = i + 11, p = rt_toolfmt_find(s, n, a, ">");
        if (p == n) break;
        size_t e = rt_toolfmt_find(s, n, p, "</parameter>"),
               e2 = rt_toolfmt_find(s, n, p, "<parameter="),
               e3 = rt_toolfmt_find(s, n, p, "</function>");
        e = e2 < e ? e2 : e;
        e = e3 < e ? e3 : e;
        i = rt_toolfmt_find(s, n, e, "<parameter=");
        size_t va = p + 1, vb = e;
        if (va < vb && s[va] == '\n') va++;
        if (vb > va && s[vb - 1] == '\n') vb--;
        char *pn = strndup(s + a, p - a);
        json_t *v =
            pn ? param_value(RT_TOOLFMT_QWEN3_CODER, tools, name, pn, s + va, vb - va) : NULL;
        rc = v && !json_object_set_new(args, pn, v) ? 0 : TD_ENOMEM;
        free(pn);
    }
    if (!rc) rc = add_json_call(out, name, strlen(name), args);
    free(name);
    json_decref(args);
    return rc;
}

static int parse_qwen3_coder(const char *s, size_t n, const json_t *tools, rt_toolfmt_calls *out)
{
    int rc = 0;
    for (size_t i = rt_toolfmt_find(s, n, 0, "<function="); i < n && !rc;) {
        size_t a = i + 10, e = rt_toolfmt_find(s, n, a, "</function>");
        rc = qwen_function(s + a, e - a, tools, out);
        i = rt_toolfmt_find(s, n, e, "<function=");
    }
    return rc;
}

/* <tool_call>NAME\n(<arg_key>K</arg_key>\s*<arg_value>V</arg_value>)*</tool_call> */
static int parse_glm(const char *s, size_t n, const json_t *tools, rt_toolfmt_calls *out)
{
    size_t a = skip_lit(s, n, 0, "<tool_call>"), e = rt_toolfmt_find(s, n, a, "</tool_call>");
    size_t nb = rt_toolfmt_find(s, e, a, "<arg_key>"), nl = rt_toolfmt_find(s, e, a, "\n");
    nb = nl < nb ? nl : nb;
    size_t na = a;
    trim(s, &na, &nb);
    if (na == nb) return 0;
    char *name = strndup(s + na, nb - na);
    json_t *args = json_object();
    int rc = name && args ? 0 : TD_ENOMEM;
    for (size_t i = rt_toolfmt_find(s, e, nb, "<arg_key>"); i < e && !rc;
         i = rt_toolfmt_find(s, e, i, "<arg_key>")) {
        size_t ka = i + 9, kb = rt_toolfmt_find(s, e, ka, "</arg_key>"),
               va = skip_lit(s, e, kb, "</arg_key>");
        while (va < e && is_ws(s[va]))
            va++;
        size_t v0 = va;
        va = skip_lit(s, e, va, "<arg_value>");
        size_t vb = rt_toolfmt_find(s, e, va, "</arg_value>");
        if (kb == e || va == v0 || vb == e) break;
        i = vb;
        trim(s, &ka, &kb);
        trim(s, &va, &vb);
        char *k = strndup(s + ka, kb - ka);
        json_t *v = k ? param_value(RT_TOOLFMT_GLM45, tools, name, k, s + va, vb - va) : NULL;
        rc = k && v && !json_object_set_new(args, k, v) ? 0 : TD_ENOMEM;
        free(k);
    }
    if (!rc) rc = add_json_call(out, name, strlen(name), args);
    free(name);
    json_decref(args);
    return rc;
}

/* ---- pythonic: [f(a=1, b="x"), g()] ---- */

size_t rt_toolfmt_py_ident(const char *s, size_t n, size_t i)
{
    size_t a = i;
    while (i < n && (s[i] == '_' || ((s[i] | 32) >= 'a' && (s[i] | 32) <= 'z') ||
                     (i > a && s[i] >= '0' && s[i] <= '9') || (unsigned char)s[i] >= 0x80))
        i++;
    return i;
}

/* One call f(k=v, ...) at r->i; 1: malformed. */
static int py_call(rt_py *r, rt_toolfmt_calls *out)
{
    py_ws(r);
    size_t a = r->i, b = rt_toolfmt_py_ident(r->s, r->n, a);
    if (b == a || b >= r->n || r->s[b] != '(') return 1;
    r->i = b + 1;
    json_t *args = json_object();
    int rc = args ? 0 : TD_ENOMEM;
    for (bool first = true; !rc;) {
        py_ws(r);
        if (r->i < r->n && r->s[r->i] == ')') break;
        if (!first && (r->i >= r->n || r->s[r->i++] != ',')) rc = 1;
        py_ws(r);
        if (rc || (!first && r->i < r->n && r->s[r->i] == ')')) break;
        first = false;
        size_t ka = r->i, kb = rt_toolfmt_py_ident(r->s, r->n, ka);
        r->i = kb;
        py_ws(r);
        json_t *v = kb > ka && r->i < r->n && r->s[r->i++] == '=' ? py_value(r) : NULL;
        char *k = v ? strndup(r->s + ka, kb - ka) : NULL;
        rc = k && !json_object_set_new(args, k, v) ? 0 : 1;
        if (!k) json_decref(v);
        free(k);
    }
    if (!rc && r->i < r->n && r->s[r->i] == ')') {
        r->i++;
        rc = add_json_call(out, r->s + a, b - a, args);
    } else if (!rc) {
        rc = 1;
    }
    json_decref(args);
    return rc;
}

static int parse_pythonic(const char *s, size_t n, rt_toolfmt_calls *out)
{
    rt_py r = {s, n, 0, 0};
    rt_toolfmt_calls got = {0};
    py_ws(&r);
    int rc = r.i < n && s[r.i] == '[' ? 0 : 1;
    r.i++;
    for (bool first = true; !rc; first = false) {
        py_ws(&r);
        if (!first && r.i < n && s[r.i] == ']') break;
        if (!first && (r.i >= n || s[r.i++] != ',')) rc = 1;
        if (!rc) rc = py_call(&r, &got);
    }
    if (!rc) {
        r.i++;
        py_ws(&r);
        rc = r.i == n ? 0 : 1;
    }
    if (rc == 1) rc = 0, rt_toolfmt_calls_fini(&got);
    for (int k = 0; k < got.n && !rc; k++) {
        rc = add_call(out, got.v[k].name, strlen(got.v[k].name), got.v[k].args, NULL, 0);
        got.v[k].args = NULL;
    }
    rt_toolfmt_calls_fini(&got);
    return rc;
}

int rt_toolfmt_parse(rt_toolfmt f, const char *s, size_t n, const json_t *tools,
                     rt_toolfmt_calls *out)
{
    switch (f) {
    case RT_TOOLFMT_LLAMA3_JSON:
        return parse_llama3(s, n, out);
    case RT_TOOLFMT_MISTRAL:
        return parse_mistral(s, n, out);
    case RT_TOOLFMT_DEEPSEEK_V3:
        return parse_deepseek(true, s, n, out);
    case RT_TOOLFMT_DEEPSEEK_V31:
        return parse_deepseek(false, s, n, out);
    case RT_TOOLFMT_QWEN3_CODER:
        return parse_qwen3_coder(s, n, tools, out);
    case RT_TOOLFMT_GLM45:
        return parse_glm(s, n, tools, out);
    case RT_TOOLFMT_KIMI_K2:
        return parse_kimi(s, n, out);
    case RT_TOOLFMT_PYTHONIC:
        return parse_pythonic(s, n, out);
    default:
        return 0;
    }
}
