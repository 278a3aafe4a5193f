/* gr_schema.c: JSON schema -> automaton (gr_int.h). Thompson-style: emit(schema, a, b)
 * adds the states and edges that lead from state a to state b over exactly the documents
 * the schema allows (within gr_grammar.h's bounds). Schemas reached by $ref and array
 * items become rules (entered by a call, left by a rule end), compiled once each. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gr_int.h"
#include "td_err.h"
#include "td_grow.h"

#define MAX_INT_DIGITS  16
#define MAX_FRAC_DIGITS 16
#define MAX_EXP_DIGITS  3
#define MAX_WS_SPACES   12
#define MAX_SCHEMA_NEST 64 /* schema objects inside one another (not through rules) */

typedef struct {
    int32_t from;
    gr_edge e;
} b_edge;

typedef struct {
    int32_t from;
    gr_eps x;
} b_eps;

typedef struct {
    const json_t *schema;
    int32_t entry;
} b_rule;

typedef struct {
    const json_t *root;
    bool strict;
    int32_t n_st;
    bool *ret; /* (cap_st) */
    int32_t cap_st;
    b_edge *edges;
    int32_t n_edges, cap_edges;
    b_eps *eps;
    int32_t n_eps, cap_eps;
    b_rule *rules;
    int n_rules, cap_rules;
    int32_t value_rule; /* the generic JSON value's entry, -1 until built */
    int nest;
    char path[512]; /* JSON pointer of the schema being compiled, for errors */
    char *err;
    size_t err_cap;
    int rc;
} cc;

static int fail(cc *c, int rc, const char *fmt, ...)
{
    if (c->rc) return c->rc;
    c->rc = rc;
    if (c->err && c->err_cap) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(c->err, c->err_cap, fmt, ap);
        va_end(ap);
        if (n >= 0 && (size_t)n < c->err_cap)
            snprintf(c->err + n, c->err_cap - (size_t)n, " at #%s", c->path);
    }
    return rc;
}

static int32_t new_state(cc *c)
{
    if (c->rc) return 0;
    if (c->n_st >= GR_MAX_STATES) return fail(c, TD_ERANGE, "schema too large"), 0;
    if (TD_GROW_INT(c->ret, c->cap_st, c->n_st + 1, 256))
        return fail(c, TD_ENOMEM, "out of memory"), 0;
    c->ret[c->n_st] = false;
    return c->n_st++;
}

static void edge(cc *c, int32_t from, uint8_t lo, uint8_t hi, int32_t to)
{
    if (c->rc) return;
    if (TD_GROW_INT(c->edges, c->cap_edges, c->n_edges + 1, 512))
        return (void)fail(c, TD_ENOMEM, "out of memory");
    c->edges[c->n_edges++] = (b_edge){from, {lo, hi, to}};
}

static void eps_ret(cc *c, int32_t from, int32_t to, int32_t ret)
{
    if (c->rc) return;
    if (TD_GROW_INT(c->eps, c->cap_eps, c->n_eps + 1, 256))
        return (void)fail(c, TD_ENOMEM, "out of memory");
    c->eps[c->n_eps++] = (b_eps){from, {to, ret}};
}

static void eps(cc *c, int32_t from, int32_t to)
{
    eps_ret(c, from, to, -1);
}

static void byte(cc *c, int32_t from, uint8_t b, int32_t to)
{
    edge(c, from, b, b, to);
}

static void literal(cc *c, int32_t a, const char *s, size_t n, int32_t b)
{
    for (size_t i = 0; i < n && !c->rc; i++) {
        int32_t nx = i + 1 == n ? b : new_state(c);
        byte(c, a, (uint8_t)s[i], nx);
        a = nx;
    }
    if (n == 0) eps(c, a, b);
}

/* nothing, one space, or a newline and up to MAX_WS_SPACES spaces */
static void ws(cc *c, int32_t a, int32_t b)
{
    eps(c, a, b);
    byte(c, a, ' ', b);
    int32_t s = new_state(c);
    byte(c, a, '\n', s);
    eps(c, s, b);
    for (int i = 0; i < MAX_WS_SPACES && !c->rc; i++) {
        int32_t t = new_state(c);
        byte(c, s, ' ', t);
        eps(c, t, b);
        s = t;
    }
}

/* exactly `min` to `max` digits (the first one from [lo0, '9']) */
static void digits(cc *c, int32_t a, char lo0, int min, int max, int32_t b)
{
    for (int i = 0; i < max && !c->rc; i++) {
        int32_t nx = new_state(c);
        edge(c, a, (uint8_t)(i == 0 ? lo0 : '0'), '9', nx);
        if (i + 1 >= min) eps(c, nx, b);
        a = nx;
    }
}

static void number(cc *c, int32_t a, bool integer, int32_t b)
{
    int32_t s = new_state(c), ip = new_state(c);
    eps(c, a, s);
    byte(c, a, '-', s);
    byte(c, s, '0', ip);
    digits(c, s, '1', 1, MAX_INT_DIGITS, ip);
    if (integer) return eps(c, ip, b);
    int32_t fr = new_state(c), f0 = new_state(c);
    eps(c, ip, fr);
    byte(c, ip, '.', f0);
    digits(c, f0, '0', 1, MAX_FRAC_DIGITS, fr);
    int32_t e0 = new_state(c), e1 = new_state(c);
    eps(c, fr, b);
    edge(c, fr, 'E', 'E', e0);
    edge(c, fr, 'e', 'e', e0);
    eps(c, e0, e1);
    byte(c, e0, '+', e1);
    byte(c, e0, '-', e1);
    digits(c, e1, '0', 1, MAX_EXP_DIGITS, b);
}

/* one character of a JSON string body: printable ASCII but '"' and '\\', an escape, or a
 * well-formed UTF-8 sequence (no overlongs, no surrogates) */
static void str_char(cc *c, int32_t a, int32_t b)
{
    edge(c, a, 0x20, 0x21, b);
    edge(c, a, 0x23, 0x5b, b);
    edge(c, a, 0x5d, 0x7f, b);
    int32_t esc = new_state(c), u = new_state(c);
    byte(c, a, '\\', esc);
    const char *simple = "\"\\/bfnrt";
    for (const char *p = simple; *p; p++)
        byte(c, esc, (uint8_t)*p, b);
    byte(c, esc, 'u', u);
    for (int i = 0; i < 4 && !c->rc; i++) {
        int32_t nx = i == 3 ? b : new_state(c);
        edge(c, u, '0', '9', nx);
        edge(c, u, 'a', 'f', nx);
        edge(c, u, 'A', 'F', nx);
        u = nx;
    }
    int32_t t1 = new_state(c), t2 = new_state(c), t3 = new_state(c);
    edge(c, t1, 0x80, 0xbf, b); /* one continuation byte left */
    edge(c, t2, 0x80, 0xbf, t1);
    edge(c, t3, 0x80, 0xbf, t2);
    edge(c, a, 0xc2, 0xdf, t1);
    int32_t e0 = new_state(c), ed = new_state(c), f0 = new_state(c), f4 = new_state(c);
    byte(c, a, 0xe0, e0);
    edge(c, e0, 0xa0, 0xbf, t1);
    edge(c, a, 0xe1, 0xec, t2);
    byte(c, a, 0xed, ed);
    edge(c, ed, 0x80, 0x9f, t1);
    edge(c, a, 0xee, 0xef, t2);
    byte(c, a, 0xf0, f0);
    edge(c, f0, 0x90, 0xbf, t2);
    edge(c, a, 0xf1, 0xf3, t3);
    byte(c, a, 0xf4, f4);
    edge(c, f4, 0x80, 0x8f, t2);
}

/* '"' chars{min, max} '"'; max < 0: unbounded */
static void string(cc *c, int32_t a, int min, int max, int32_t b)
{
    int32_t s = new_state(c);
    byte(c, a, '"', s);
    int n = max >= 0 ? max : min;
    for (int i = 0; i <= n && !c->rc; i++) {
        if (i >= min) byte(c, s, '"', b);
        if (i == n) {
            if (max < 0) str_char(c, s, s);
            break;
        }
        int32_t nx = new_state(c);
        str_char(c, s, nx);
        s = nx;
    }
}

static int32_t value_rule(cc *c);
static void emit(cc *c, const json_t *schema, int32_t a, int32_t b);

static void call(cc *c, int32_t a, int32_t entry, int32_t b)
{
    eps_ret(c, a, entry, b);
}

/* '{' ws ( '}' | key ws ':' ws V ( ws ',' ws key ws ':' ws V )* ws '}' ), V = vs or any */
static void any_object(cc *c, const json_t *vs, int32_t a, int32_t b)
{
    int32_t o = new_state(c), body = new_state(c), end = new_state(c), k = new_state(c);
    byte(c, a, '{', o);
    ws(c, o, body);
    byte(c, body, '}', b);
    eps(c, body, k);
    int32_t k1 = new_state(c), k2 = new_state(c), k3 = new_state(c), v = new_state(c);
    string(c, k, 0, -1, k1);
    ws(c, k1, k2);
    byte(c, k2, ':', k3);
    ws(c, k3, v);
    int32_t after = new_state(c), sep = new_state(c);
    if (vs)
        emit(c, vs, v, after);
    else
        call(c, v, value_rule(c), after);
    ws(c, after, end);
    byte(c, end, '}', b);
    byte(c, end, ',', sep);
    ws(c, sep, k);
}

/* the generic value rule: object | array | string | number | true | false | null */
static int32_t value_rule(cc *c)
{
    if (c->value_rule >= 0) return c->value_rule;
    int32_t e = new_state(c), x = new_state(c);
    c->value_rule = e;
    c->ret[x] = true;
    any_object(c, NULL, e, x);
    int32_t o = new_state(c), body = new_state(c), after = new_state(c), end = new_state(c);
    byte(c, e, '[', o);
    ws(c, o, body);
    byte(c, body, ']', x);
    call(c, body, e, after);
    ws(c, after, end);
    byte(c, end, ']', x);
    int32_t sep = new_state(c), nx = new_state(c);
    byte(c, end, ',', sep);
    ws(c, sep, nx);
    call(c, nx, e, after);
    string(c, e, 0, -1, x);
    number(c, e, false, x);
    literal(c, e, "true", 4, x);
    literal(c, e, "false", 5, x);
    literal(c, e, "null", 4, x);
    return e;
}

/* ---- schema keywords ---- */

static const char *const known_keys[] = {
    "type",        "properties", "required",    "additionalProperties",
    "items",       "minItems",   "maxItems",    "minLength",
    "maxLength",   "enum",       "const",       "anyOf",
    "$ref",        "$defs",      "definitions", "title",
    "description", "default",    "examples",    "$schema",
    "$id",         "$comment",   NULL};

static int push_path(cc *c, const char *a, const char *b)
{
    size_t n = strlen(c->path);
    int w = snprintf(c->path + n, sizeof c->path - n, "/%s%s%s", a, b ? "/" : "", b ? b : "");
    (void)w;
    return (int)n;
}

static void pop_path(cc *c, int n)
{
    c->path[n] = 0;
}

static bool check_keys(cc *c, const json_t *s)
{
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)s, key, v)
    {
        int i = 0;
        while (known_keys[i] && strcmp(known_keys[i], key))
            i++;
        if (!known_keys[i])
            return fail(c, TD_EUNSUPP, "unsupported JSON schema keyword '%.64s'", key), false;
    }
    return true;
}

/* a non-negative integer keyword, at most GR_MAX_REPEAT; absent: dflt */
static int count_kw(cc *c, const json_t *s, const char *kw, int dflt)
{
    json_t *v = json_object_get(s, kw);
    if (!v) return dflt;
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return fail(c, TD_EINVAL, "'%s' must be a non-negative integer", kw), dflt;
    if (json_integer_value(v) > GR_MAX_REPEAT)
        return fail(c, TD_EUNSUPP, "'%s' above %d is not supported", kw, GR_MAX_REPEAT), dflt;
    return (int)json_integer_value(v);
}

static void literal_value(cc *c, const json_t *v, int32_t a, int32_t b)
{
    char *t = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!t) return (void)fail(c, TD_ENOMEM, "out of memory");
    literal(c, a, t, strlen(t), b);
    free(t);
}

static void array(cc *c, const json_t *s, int32_t a, int32_t b)
{
    int min = count_kw(c, s, "minItems", 0), max = count_kw(c, s, "maxItems", -1);
    if (max >= 0 && min > max) return (void)fail(c, TD_EINVAL, "minItems above maxItems");
    json_t *items = json_object_get(s, "items");
    int p = push_path(c, "items", NULL);
    if (items && !json_is_object(items) && !json_is_boolean(items))
        fail(c, TD_EUNSUPP, "'items' must be a schema (tuple forms are not supported)");
    int32_t entry = -1;
    if (json_is_false(items)) max = 0;
    if (max != 0 && !c->rc) {
        if (!items || json_is_true(items)) {
            entry = value_rule(c);
        } else { /* items as a rule of its own, entered once per element */
            entry = new_state(c);
            int32_t x = new_state(c);
            if (!c->rc) c->ret[x] = true;
            emit(c, items, entry, x);
        }
    }
    pop_path(c, p);
    if (max == 0 && min > 0) fail(c, TD_EINVAL, "minItems above 0 with no items allowed");
    int32_t o = new_state(c), at = new_state(c);
    byte(c, a, '[', o);
    ws(c, o, at); /* at: before the first element */
    if (min == 0) byte(c, at, ']', b);
    int n = max >= 0 ? max : (min > 1 ? min : 1);
    int32_t loop_at = -1;
    for (int i = 1; i <= n && !c->rc; i++) { /* i: elements after this one is read */
        int32_t got = new_state(c), end = new_state(c);
        call(c, at, entry, got);
        ws(c, got, end);
        if (i >= min) byte(c, end, ']', b);
        if (i == n && max >= 0) break;
        int32_t sep = new_state(c);
        byte(c, end, ',', sep);
        if (i == n) { /* unbounded: loop on the last element */
            loop_at = at;
            ws(c, sep, loop_at);
            break;
        }
        at = new_state(c);
        ws(c, sep, at);
    }
    (void)loop_at;
}

/* the properties in schema order: states p[i][0] (none written yet) and p[i][1] (some):
 * from p[i][1] a ',' leads to key i; from p[i][0] key i directly; an optional property
 * may be skipped (p[i][x] -> p[i+1][x]) */
static void object(cc *c, const json_t *s, int32_t a, int32_t b)
{
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    json_t *addl = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props))
        return (void)fail(c, TD_EINVAL, "'properties' must be an object");
    if (req && !json_is_array(req)) return (void)fail(c, TD_EINVAL, "'required' must be an array");
    if (addl && !json_is_boolean(addl) && !json_is_object(addl))
        return (void)fail(c, TD_EINVAL, "'additionalProperties' must be a boolean or a schema");
    size_t ri;
    json_t *rv;
    json_array_foreach(req, ri, rv)
    {
        if (!json_is_string(rv)) return (void)fail(c, TD_EINVAL, "'required' must list strings");
        if (!json_object_get(props, json_string_value(rv)))
            return (void)fail(c, TD_EUNSUPP, "required property '%.64s' is not in 'properties'",
                              json_string_value(rv));
    }
    if (!props || json_object_size(props) == 0) {
        if (json_is_false(addl)) return literal(c, a, "{}", 2, b);
        const json_t *vs = json_is_object(addl) ? addl : NULL;
        int p = push_path(c, "additionalProperties", NULL);
        any_object(c, vs, a, b);
        pop_path(c, p);
        return;
    }
    int32_t o = new_state(c), p0 = new_state(c), p1 = -1;
    byte(c, a, '{', o);
    ws(c, o, p0);
    const char *key;
    json_t *ps;
    json_object_foreach(props, key, ps)
    {
        bool required = c->strict;
        json_array_foreach(req, ri, rv) required = required || !strcmp(json_string_value(rv), key);
        int32_t k = new_state(c), n1 = new_state(c), n0 = required ? -1 : new_state(c);
        eps(c, p0, k);
        if (p1 >= 0) {
            int32_t sep = new_state(c);
            byte(c, p1, ',', sep);
            ws(c, sep, k);
        }
        if (!required) {
            eps(c, p0, n0);
            if (p1 >= 0) eps(c, p1, n1);
        }
        int32_t k1 = new_state(c), k2 = new_state(c), k3 = new_state(c), v = new_state(c);
        json_t *kj = json_string(key);
        if (!kj) return (void)fail(c, TD_ENOMEM, "out of memory");
        literal_value(c, kj, k, k1);
        json_decref(kj);
        ws(c, k1, k2);
        byte(c, k2, ':', k3);
        ws(c, k3, v);
        int32_t after = new_state(c);
        int pp = push_path(c, "properties", key);
        emit(c, ps, v, after);
        pop_path(c, pp);
        ws(c, after, n1);
        p0 = required ? -1 : n0; /* p0 < 0: a property is certainly written by now */
        p1 = n1;
        if (p0 < 0) p0 = new_state(c); /* unreachable "nothing written" state */
    }
    byte(c, p0, '}', b);
    byte(c, p1, '}', b);
}

/* "#/$defs/name" or "#/definitions/name" (JSON pointer escapes ~0 ~1 included) */
static const json_t *resolve(cc *c, const char *ref)
{
    const json_t *at = c->root;
    if (strncmp(ref, "#/", 2)) return NULL;
    const char *p = ref + 2;
    while (*p && at) {
        const char *e = strchr(p, '/');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        char key[256];
        size_t k = 0;
        for (size_t i = 0; i < n && k + 1 < sizeof key; i++) {
            if (p[i] == '~' && i + 1 < n && (p[i + 1] == '0' || p[i + 1] == '1'))
                key[k++] = p[++i] == '0' ? '~' : '/';
            else
                key[k++] = p[i];
        }
        key[k] = 0;
        at = json_is_object(at) ? json_object_get(at, key) : NULL;
        p = e ? e + 1 : p + n;
    }
    return at;
}

/* the rule of a schema reached by $ref: compiled once (recursion enters the rule again) */
static void ref(cc *c, const json_t *v, int32_t a, int32_t b)
{
    if (!json_is_string(v)) return (void)fail(c, TD_EINVAL, "'$ref' must be a string");
    const char *r = json_string_value(v);
    if (strncmp(r, "#/$defs/", 8) && strncmp(r, "#/definitions/", 14))
        return (void)fail(c, TD_EUNSUPP, "'$ref' '%.64s' (only #/$defs/... and #/definitions/...)",
                          r);
    const json_t *t = resolve(c, r);
    if (!t || (!json_is_object(t) && !json_is_boolean(t)))
        return (void)fail(c, TD_EINVAL, "'$ref' '%.64s' does not resolve to a schema", r);
    for (int i = 0; i < c->n_rules; i++)
        if (c->rules[i].schema == t) return call(c, a, c->rules[i].entry, b);
    if (TD_GROW_INT(c->rules, c->cap_rules, c->n_rules + 1, 16))
        return (void)fail(c, TD_ENOMEM, "out of memory");
    int32_t entry = new_state(c), x = new_state(c);
    if (c->rc) return;
    c->ret[x] = true;
    c->rules[c->n_rules++] = (b_rule){t, entry};
    call(c, a, entry, b);
    char saved[sizeof c->path];
    memcpy(saved, c->path, sizeof saved);
    snprintf(c->path, sizeof c->path, "%s", r + 1);
    int nest = c->nest;
    c->nest = 0; /* a rule starts a fresh nesting count: its depth is the stack's */
    emit(c, t, entry, x);
    c->nest = nest;
    if (!c->rc) memcpy(c->path, saved, sizeof saved);
}

static void typed(cc *c, const json_t *s, const char *t, int32_t a, int32_t b)
{
    if (!strcmp(t, "object")) return object(c, s, a, b);
    if (!strcmp(t, "array")) return array(c, s, a, b);
    if (!strcmp(t, "string")) {
        int min = count_kw(c, s, "minLength", 0), max = count_kw(c, s, "maxLength", -1);
        if (max >= 0 && min > max) return (void)fail(c, TD_EINVAL, "minLength above maxLength");
        return string(c, a, min, max, b);
    }
    if (!strcmp(t, "number") || !strcmp(t, "integer")) return number(c, a, t[0] == 'i', b);
    if (!strcmp(t, "boolean")) {
        literal(c, a, "true", 4, b);
        return literal(c, a, "false", 5, b);
    }
    if (!strcmp(t, "null")) return literal(c, a, "null", 4, b);
    fail(c, TD_EINVAL, "unknown type '%.32s'", t);
}

/* whether literal v is of (one of) the type(s) in type (NULL: any) */
static bool of_type(const json_t *v, const json_t *type)
{
    if (!type) return true;
    if (json_is_array(type)) {
        size_t i;
        json_t *t;
        json_array_foreach(type, i, t) if (of_type(v, t)) return true;
        return false;
    }
    const char *t = json_string_value(type);
    if (!t) return false;
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return !strcmp(t, "object");
    case JSON_ARRAY:
        return !strcmp(t, "array");
    case JSON_STRING:
        return !strcmp(t, "string");
    case JSON_INTEGER:
        return !strcmp(t, "integer") || !strcmp(t, "number");
    case JSON_REAL:
        return !strcmp(t, "number");
    case JSON_TRUE:
    case JSON_FALSE:
        return !strcmp(t, "boolean");
    case JSON_NULL:
        return !strcmp(t, "null");
    }
    return false;
}

/* const: its compact JSON text, if it has the schema's type */
static void values(cc *c, const json_t *v, const json_t *type, int32_t a, int32_t b)
{
    if (!of_type(v, type)) return (void)fail(c, TD_EINVAL, "'const' does not match 'type'");
    literal_value(c, v, a, b);
}

static void alternatives(cc *c, const json_t *list, const char *kw, const json_t *type, int32_t a,
                         int32_t b)
{
    if (!json_is_array(list) || json_array_size(list) == 0)
        return (void)fail(c, TD_EINVAL, "'%s' must be a non-empty array", kw);
    size_t i;
    json_t *v;
    int kept = 0;
    json_array_foreach(list, i, v)
    {
        if (!strcmp(kw, "enum")) {
            if (of_type(v, type)) literal_value(c, v, a, b), kept++;
            continue;
        }
        char idx[24];
        snprintf(idx, sizeof idx, "%zu", i);
        int p = push_path(c, kw, idx);
        emit(c, v, a, b);
        pop_path(c, p);
        kept++;
    }
    if (!kept) fail(c, TD_EINVAL, "no value of 'enum' matches 'type'");
}

/* keywords that constrain a value of a type other than the given ones */
static void check_applies(cc *c, const json_t *s, const char *types)
{
    static const struct {
        const char *kw, *type;
    } owner[] = {
        {"properties", "object"}, {"required", "object"}, {"additionalProperties", "object"},
        {"items", "array"},       {"minItems", "array"},  {"maxItems", "array"},
        {"minLength", "string"},  {"maxLength", "string"}};
    for (size_t i = 0; i < sizeof owner / sizeof owner[0]; i++)
        if (json_object_get(s, owner[i].kw) && !strstr(types, owner[i].type))
            fail(c, TD_EUNSUPP, "'%s' without \"type\": \"%s\" is not supported", owner[i].kw,
                 owner[i].type);
}

static void emit(cc *c, const json_t *s, int32_t a, int32_t b)
{
    if (c->rc) return;
    if (json_is_true(s)) return call(c, a, value_rule(c), b);
    if (json_is_false(s)) return (void)fail(c, TD_EINVAL, "the schema false allows nothing");
    if (!json_is_object(s)) return (void)fail(c, TD_EINVAL, "a schema must be an object");
    if (++c->nest > MAX_SCHEMA_NEST) return (void)fail(c, TD_ERANGE, "schema nested too deeply");
    if (!check_keys(c, s)) return;
    json_t *v, *type = json_object_get(s, "type");
    int n_kinds = !!json_object_get(s, "enum") + !!json_object_get(s, "const") +
                  !!json_object_get(s, "anyOf") + !!json_object_get(s, "$ref");
    bool lit = json_object_get(s, "enum") || json_object_get(s, "const");
    if (n_kinds > 1 || (n_kinds && type && !lit)) {
        fail(c, TD_EUNSUPP, "combining %s in one schema is not supported",
             type ? "type with anyOf or $ref" : "enum, const, anyOf and $ref");
    } else if (n_kinds) { /* a type next to enum/const only filters the values */
        check_applies(c, s, "");
        if ((v = json_object_get(s, "const")))
            values(c, v, type, a, b);
        else if ((v = json_object_get(s, "enum")))
            alternatives(c, v, "enum", type, a, b);
        else if ((v = json_object_get(s, "anyOf")))
            alternatives(c, v, "anyOf", NULL, a, b);
        else
            ref(c, json_object_get(s, "$ref"), a, b);
    } else if (json_is_string(type)) {
        check_applies(c, s, json_string_value(type));
        typed(c, s, json_string_value(type), a, b);
    } else if (json_is_array(type) && json_array_size(type) > 0) {
        size_t i;
        char all[128] = "";
        json_array_foreach(type, i, v)
        {
            if (!json_is_string(v)) return (void)fail(c, TD_EINVAL, "'type' must list strings");
            size_t n = strlen(all);
            snprintf(all + n, sizeof all - n, "%.20s,", json_string_value(v));
        }
        check_applies(c, s, all);
        json_array_foreach(type, i, v) typed(c, s, json_string_value(v), a, b);
    } else if (type) {
        fail(c, TD_EINVAL, "'type' must be a string or a non-empty array of strings");
    } else if (json_object_get(s, "properties") || json_object_get(s, "additionalProperties") ||
               json_object_get(s, "required")) {
        check_applies(c, s, "object");
        object(c, s, a, b);
    } else if (json_object_get(s, "items") || json_object_get(s, "minItems") ||
               json_object_get(s, "maxItems")) {
        check_applies(c, s, "array");
        array(c, s, a, b);
    } else {
        check_applies(c, s, "");
        call(c, a, value_rule(c), b); /* {} (annotations only): any value */
    }
    c->nest--;
}

/* Group the builder's edges by state into the grammar's arrays. */
static int finish(cc *c, gr_grammar *g)
{
    g->n_st = c->n_st;
    g->st = calloc((size_t)c->n_st, sizeof *g->st);
    g->edges = malloc((size_t)(c->n_edges ? c->n_edges : 1) * sizeof *g->edges);
    g->eps = malloc((size_t)(c->n_eps ? c->n_eps : 1) * sizeof *g->eps);
    if (!g->st || !g->edges || !g->eps) return TD_ENOMEM;
    for (int32_t i = 0; i < c->n_edges; i++)
        g->st[c->edges[i].from].ne++;
    for (int32_t i = 0; i < c->n_eps; i++)
        g->st[c->eps[i].from].nx++;
    int32_t e = 0, x = 0;
    for (int32_t i = 0; i < c->n_st; i++) {
        g->st[i].e0 = e;
        g->st[i].x0 = x;
        e += g->st[i].ne;
        x += g->st[i].nx;
        g->st[i].ne = g->st[i].nx = 0;
        g->st[i].ret = c->ret[i];
    }
    for (int32_t i = 0; i < c->n_edges; i++) {
        gr_state *st = &g->st[c->edges[i].from];
        g->edges[st->e0 + st->ne++] = c->edges[i].e;
    }
    for (int32_t i = 0; i < c->n_eps; i++) {
        gr_state *st = &g->st[c->eps[i].from];
        g->eps[st->x0 + st->nx++] = c->eps[i].x;
    }
    return 0;
}

static void cc_fini(cc *c)
{
    free(c->ret);
    free(c->edges);
    free(c->eps);
    free(c->rules);
}

/* root == NULL: any JSON object */
static int compile(const json_t *root, bool strict, gr_grammar **out, char *err, size_t err_cap)
{
    *out = NULL;
    if (err && err_cap) err[0] = 0;
    cc c = {.root = root, .strict = strict, .value_rule = -1, .err = err, .err_cap = err_cap};
    int32_t start = new_state(&c), x = new_state(&c);
    if (!c.rc) c.ret[x] = true;
    if (root)
        emit(&c, root, start, x);
    else
        any_object(&c, NULL, start, x);
    gr_grammar *g = calloc(1, sizeof *g);
    int rc = c.rc ? c.rc : !g ? TD_ENOMEM : finish(&c, g);
    cc_fini(&c);
    if (g) {
        g->refs = 1;
        g->start = start;
    }
    if (rc) {
        if (rc == TD_ENOMEM && err && err_cap && !err[0]) snprintf(err, err_cap, "out of memory");
        gr_grammar_unref(g);
        return rc;
    }
    *out = g;
    return 0;
}

int gr_compile_schema(const json_t *schema, bool strict, gr_grammar **out, char *err,
                      size_t err_cap)
{
    if (!schema) {
        *out = NULL;
        if (err && err_cap) snprintf(err, err_cap, "no schema");
        return TD_EINVAL;
    }
    return compile(schema, strict, out, err, err_cap);
}

int gr_compile_json_object(gr_grammar **out)
{
    return compile(NULL, false, out, NULL, 0);
}

int gr_compile_text(int32_t kind, const char *text, gr_grammar **out, char *err, size_t err_cap)
{
    *out = NULL;
    if (kind == TD_GRAMMAR_JSON_OBJECT) return gr_compile_json_object(out);
    if (kind != TD_GRAMMAR_JSON_SCHEMA && kind != TD_GRAMMAR_JSON_SCHEMA_STRICT) {
        if (err && err_cap) snprintf(err, err_cap, "unknown grammar kind %d", (int)kind);
        return TD_EINVAL;
    }
    size_t len = text ? strnlen(text, GR_MAX_TEXT + 1) : 0;
    if (!text || len > GR_MAX_TEXT) {
        if (err && err_cap)
            snprintf(err, err_cap, "schema text missing or over %d bytes", GR_MAX_TEXT);
        return TD_EINVAL;
    }
    json_error_t je;
    json_t *s = json_loadb(text, len, JSON_DECODE_ANY, &je);
    if (!s) {
        if (err && err_cap) snprintf(err, err_cap, "schema is not JSON: %s", je.text);
        return TD_EINVAL;
    }
    int rc = compile(s, kind == TD_GRAMMAR_JSON_SCHEMA_STRICT, out, err, err_cap);
    json_decref(s);
    return rc;
}

gr_grammar *gr_grammar_ref(gr_grammar *g)
{
    g->refs++;
    return g;
}

int32_t gr_grammar_n_states(const gr_grammar *g)
{
    return g->n_st;
}
