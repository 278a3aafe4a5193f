/* jn_value.c: the engine's values: the arena they live in, their Python semantics (truth,
 * equality, order), and how they are written (str, repr, json.dumps). See jn_int.h. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jn_int.h"
#include "td_err.h"
#include "td_grow.h"

jv jn_undef_v = {.kind = JV_UNDEF}, jn_none_v = {.kind = JV_NONE};
jv jn_true_v = {.kind = JV_BOOL, .u.b = true}, jn_false_v = {.kind = JV_BOOL, .u.b = false};

/* ---- arena ---- */

struct jn_chunk {
    jn_chunk *next;
    size_t cap, used;
    _Alignas(16) unsigned char data[];
};

#define JN_CHUNK (64 * 1024)

void *jn_alloc(jn_arena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (a->limit && (n > a->limit || a->used > a->limit - n)) return NULL;
    jn_chunk *h = a->head;
    if (!h || h->cap - h->used < n) {
        size_t cap = n > JN_CHUNK / 4 ? n : JN_CHUNK;
        if (!(h = malloc(sizeof *h + cap))) return NULL;
        h->cap = cap;
        h->used = 0;
        /* a large block gets its own chunk behind the head, so the head's room is kept */
        if (cap != JN_CHUNK && a->head) {
            h->next = a->head->next;
            a->head->next = h;
        } else {
            h->next = a->head;
            a->head = h;
        }
    }
    void *p = h->data + h->used;
    h->used += n;
    a->used += n;
    memset(p, 0, n);
    return p;
}

void jn_arena_free(jn_arena *a)
{
    for (jn_chunk *h = a->head, *next; h; h = next) {
        next = h->next;
        free(h);
    }
    *a = (jn_arena){0};
}

jv *jn_fail(jn_ctx *c, int rc, int line, const char *fmt, ...)
{
    if (c->rc) return NULL;
    c->rc = rc;
    if (c->err) {
        va_list ap;
        va_start(ap, fmt);
        c->err->line = line;
        vsnprintf(c->err->msg, sizeof c->err->msg, fmt, ap);
        va_end(ap);
    }
    return NULL;
}

static jv *oom(jn_ctx *c)
{
    return jn_fail(c,
                   c->arena.limit && c->arena.used + 4096 > c->arena.limit ? TD_ERANGE : TD_ENOMEM,
                   0, "out of memory (the render's memory limit is %zu bytes)", c->arena.limit);
}

static jv *new_value(jn_ctx *c, jv_kind k)
{
    jv *v = jn_alloc(&c->arena, sizeof *v);
    if (!v) return oom(c);
    v->kind = k;
    return v;
}

jv *jn_int(jn_ctx *c, int64_t i)
{
    bool small = i >= 0 && i < 256;
    if (small && c->small_ints[i]) return c->small_ints[i];
    jv *v = new_value(c, JV_INT);
    if (v) v->u.i = i;
    if (v && small) c->small_ints[i] = v;
    return v;
}

jv *jn_float(jn_ctx *c, double f)
{
    jv *v = new_value(c, JV_FLOAT);
    if (v) v->u.f = f;
    return v;
}

jv *jn_str(jn_ctx *c, const char *s, size_t len)
{
    jv *v = new_value(c, JV_STR);
    char *d = v ? jn_alloc(&c->arena, len + 1) : NULL;
    if (!d) return v ? oom(c) : NULL;
    if (len) memcpy(d, s, len);
    v->u.str.s = d;
    v->u.str.len = len;
    return v;
}

jv *jn_cstr(jn_ctx *c, const char *s)
{
    return jn_str(c, s, strlen(s));
}

jv *jn_undef_named(jn_ctx *c, const char *name)
{
    jv *v = new_value(c, JV_UNDEF);
    if (v) v->u.undef = name;
    return v;
}

jv *jn_list(jn_ctx *c, size_t n)
{
    jv *v = new_value(c, JV_LIST);
    if (!v) return NULL;
    if (n && !(v->u.list.items = jn_alloc(&c->arena, n * sizeof(jv *)))) return oom(c);
    for (size_t i = 0; i < n; i++)
        v->u.list.items[i] = JN_NONE;
    v->u.list.n = n;
    return v;
}

jv *jn_dict_new(jn_ctx *c)
{
    jv *v = new_value(c, JV_DICT);
    if (v && !(v->u.dict = jn_alloc(&c->arena, sizeof *v->u.dict))) return oom(c);
    return v;
}

jv *jn_dict_get(const jv *d, const jv *key)
{
    const jn_dict *x = d->u.dict;
    for (size_t i = 0; i < x->n; i++)
        if (jn_equal(x->keys[i], key)) return x->vals[i];
    return NULL;
}

jv *jn_dict_gets(const jv *d, const char *key)
{
    const jn_dict *x = d->u.dict;
    size_t kl = strlen(key);
    for (size_t i = 0; i < x->n; i++)
        if (x->keys[i]->kind == JV_STR && x->keys[i]->u.str.len == kl &&
            !memcmp(x->keys[i]->u.str.s, key, kl))
            return x->vals[i];
    return NULL;
}

/* key -> val at the end, without looking for an equal key (the caller knows there is none). */
static int dict_append(jn_ctx *c, jv *d, jv *key, jv *val)
{
    jn_dict *x = d->u.dict;
    if (x->n == x->cap) {
        size_t cap = x->cap ? 2 * x->cap : 8;
        jv **k = jn_alloc(&c->arena, cap * sizeof *k), **v = jn_alloc(&c->arena, cap * sizeof *v);
        if (!k || !v) {
            oom(c);
            return -1;
        }
        if (x->n) {
            memcpy(k, x->keys, x->n * sizeof *k);
            memcpy(v, x->vals, x->n * sizeof *v);
        }
        x->keys = k;
        x->vals = v;
        x->cap = cap;
    }
    x->keys[x->n] = key;
    x->vals[x->n++] = val;
    return 0;
}

int jn_dict_set(jn_ctx *c, jv *d, jv *key, jv *val)
{
    jn_dict *x = d->u.dict;
    for (size_t i = 0; i < x->n; i++)
        if (jn_equal(x->keys[i], key)) {
            x->vals[i] = val;
            return 0;
        }
    return dict_append(c, d, key, val);
}

jv *jn_func(jn_ctx *c, const char *name, jn_native fn, jv *self)
{
    jv *v = new_value(c, JV_FUNC);
    if (!v) return NULL;
    v->u.fn.name = name;
    v->u.fn.native = fn;
    v->u.fn.self = self;
    return v;
}

jv *jn_from_json(jn_ctx *c, const json_t *j)
{
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        jv *d = jn_dict_new(c);
        const char *k;
        json_t *x;
        if (!d) return NULL;
        /* a JSON object's keys are distinct already: appended, so a client's object of
           many keys costs linear time, not quadratic */
        json_object_foreach((json_t *)j, k, x)
        {
            jv *key = jn_cstr(c, k), *val = jn_from_json(c, x);
            if (!key || !val || dict_append(c, d, key, val)) return NULL;
        }
        return d;
    }
    case JSON_ARRAY: {
        jv *l = jn_list(c, json_array_size(j));
        for (size_t i = 0; l && i < l->u.list.n; i++)
            if (!(l->u.list.items[i] = jn_from_json(c, json_array_get(j, i)))) return NULL;
        return l;
    }
    case JSON_STRING:
        return jn_str(c, json_string_value(j), json_string_length(j));
    case JSON_INTEGER:
        return jn_int(c, json_integer_value(j));
    case JSON_REAL:
        return jn_float(c, json_real_value(j));
    case JSON_TRUE:
        return JN_BOOL(true);
    case JSON_FALSE:
        return JN_BOOL(false);
    default:
        return JN_NONE;
    }
}

/* ---- Python semantics ---- */

bool jn_truthy(const jv *v)
{
    switch (v->kind) {
    case JV_BOOL:
        return v->u.b;
    case JV_INT:
        return v->u.i != 0;
    case JV_FLOAT:
        return v->u.f != 0;
    case JV_STR:
        return v->u.str.len > 0;
    case JV_LIST:
        return v->u.list.gen || v->u.list.n > 0;
    case JV_DICT:
        return v->u.dict->n > 0;
    case JV_FUNC:
    case JV_NS:
    case JV_LOOP:
        return true;
    default:
        return false;
    }
}

static bool is_num(const jv *v)
{
    return v->kind == JV_INT || v->kind == JV_FLOAT || v->kind == JV_BOOL;
}

static double num(const jv *v)
{
    return v->kind == JV_FLOAT ? v->u.f : v->kind == JV_INT ? (double)v->u.i : (double)v->u.b;
}

bool jn_equal(const jv *a, const jv *b)
{
    if (a == b) return true;
    if (is_num(a) && is_num(b)) {
        if (a->kind != JV_FLOAT && b->kind != JV_FLOAT)
            return (a->kind == JV_INT ? a->u.i : a->u.b) == (b->kind == JV_INT ? b->u.i : b->u.b);
        return num(a) == num(b);
    }
    if (a->kind != b->kind) return false;
    switch (a->kind) {
    case JV_UNDEF: /* jinja2's Undefined equals any other Undefined */
    case JV_NONE:
        return true;
    case JV_STR:
        return a->u.str.len == b->u.str.len && !memcmp(a->u.str.s, b->u.str.s, a->u.str.len);
    case JV_LIST:
        if (a->u.list.gen || b->u.list.gen || a->u.list.n != b->u.list.n) return false;
        for (size_t i = 0; i < a->u.list.n; i++)
            if (!jn_equal(a->u.list.items[i], b->u.list.items[i])) return false;
        return true;
    case JV_DICT:
        if (a->u.dict->n != b->u.dict->n) return false;
        for (size_t i = 0; i < a->u.dict->n; i++) {
            jv *o = jn_dict_get(b, a->u.dict->keys[i]);
            if (!o || !jn_equal(a->u.dict->vals[i], o)) return false;
        }
        return true;
    default:
        return false; /* functions, namespaces, loops: identity only */
    }
}

int jn_compare(const jv *a, const jv *b, bool *ok)
{
    *ok = true;
    if (is_num(a) && is_num(b)) {
        if (a->kind == JV_INT && b->kind == JV_INT) return (a->u.i > b->u.i) - (a->u.i < b->u.i);
        double x = num(a), y = num(b);
        return (x > y) - (x < y);
    }
    if (a->kind == JV_STR && b->kind == JV_STR) {
        /* UTF-8 byte order is code point order */
        size_t n = a->u.str.len < b->u.str.len ? a->u.str.len : b->u.str.len;
        int r = memcmp(a->u.str.s, b->u.str.s, n);
        if (r) return r;
        return (a->u.str.len > b->u.str.len) - (a->u.str.len < b->u.str.len);
    }
    if (a->kind == JV_LIST && b->kind == JV_LIST) {
        for (size_t i = 0; i < a->u.list.n && i < b->u.list.n; i++) {
            if (jn_equal(a->u.list.items[i], b->u.list.items[i])) continue;
            return jn_compare(a->u.list.items[i], b->u.list.items[i], ok);
        }
        return (a->u.list.n > b->u.list.n) - (a->u.list.n < b->u.list.n);
    }
    *ok = false;
    return 0;
}

const char *jn_type_name(const jv *v)
{
    if (v->kind == JV_LIST && v->u.list.gen) return "generator";
    static const char *names[] = {"Undefined", "NoneType",  "bool",       "int",
                                  "float",     "str",       "list",       "dict",
                                  "function",  "Namespace", "LoopContext"};
    return names[v->kind];
}

bool jn_is_seq(const jv *v)
{
    return v->kind == JV_LIST;
}

/* ---- writing ---- */

int jn_buf_put(jn_ctx *c, jn_buf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > c->max_output) {
        jn_fail(c, TD_ERANGE, 0, "the rendering is longer than its limit of %zu bytes",
                c->max_output);
        return -1;
    }
    if (TD_GROW(b->buf, b->cap, b->len + n + 1, 256)) {
        jn_fail(c, TD_ENOMEM, 0, "out of memory");
        return -1;
    }
    if (n) memcpy(b->buf + b->len, s, n);
    b->len += n;
    b->buf[b->len] = '\0';
    return 0;
}

int jn_buf_puts(jn_ctx *c, jn_buf *b, const char *s)
{
    return jn_buf_put(c, b, s, strlen(s));
}

void jn_float_repr(double d, char *s)
{
    if (isnan(d)) {
        strcpy(s, "nan");
        return;
    }
    if (isinf(d)) {
        strcpy(s, d < 0 ? "-inf" : "inf");
        return;
    }
    /* the shortest digits that read back to d, then Python's layout: fixed notation for
     * decimal exponents in [-4, 16) (always with a fraction: "2.0"), else "1e+16" */
    char e[40];
    int p = 1;
    for (; p < 17; p++) {
        snprintf(e, sizeof e, "%.*e", p - 1, d);
        if (strtod(e, NULL) == d) break;
    }
    snprintf(e, sizeof e, "%.*e", p - 1, d);
    char digits[24];
    int nd = 0, exp10 = 0, o = 0;
    const char *q = e;
    if (*q == '-') {
        s[o++] = '-';
        q++;
    }
    for (; *q && *q != 'e'; q++)
        if (*q != '.') digits[nd++] = *q;
    if (*q == 'e') exp10 = atoi(q + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            s[o++] = '0';
            s[o++] = '.';
            for (int k = 0; k < -exp10 - 1; k++)
                s[o++] = '0';
            for (int k = 0; k < nd; k++)
                s[o++] = digits[k];
        } else {
            for (int k = 0; k <= exp10; k++)
                s[o++] = k < nd ? digits[k] : '0';
            s[o++] = '.';
            if (nd > exp10 + 1)
                for (int k = exp10 + 1; k < nd; k++)
                    s[o++] = digits[k];
            else
                s[o++] = '0';
        }
        s[o] = '\0';
        return;
    }
    s[o++] = digits[0];
    if (nd > 1) {
        s[o++] = '.';
        for (int k = 1; k < nd; k++)
            s[o++] = digits[k];
    }
    snprintf(s + o, 16, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
}

/* repr(str): single quotes unless the text has one and no double quote. */
static int repr_str(jn_ctx *c, jn_buf *b, const char *s, size_t n)
{
    bool sq = memchr(s, '\'', n) != NULL, dq = memchr(s, '"', n) != NULL;
    char q = sq && !dq ? '"' : '\'';
    if (jn_buf_put(c, b, &q, 1)) return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        char esc[8];
        const char *x = NULL;
        if (ch == '\\')
            x = "\\\\";
        else if (ch == '\n')
            x = "\\n";
        else if (ch == '\r')
            x = "\\r";
        else if (ch == '\t')
            x = "\\t";
        else if (ch == (unsigned char)q)
            x = q == '\'' ? "\\'" : "\\\"";
        else if (ch < 0x20 || ch == 0x7f) {
            snprintf(esc, sizeof esc, "\\x%02x", ch);
            x = esc;
        }
        if (x ? jn_buf_puts(c, b, x) : jn_buf_put(c, b, &s[i], 1)) return -1;
    }
    return jn_buf_put(c, b, &q, 1);
}

static int write_value(jn_ctx *c, jn_buf *b, const jv *v, bool repr)
{
    char num[40];
    switch (v->kind) {
    case JV_UNDEF:
        return 0;
    case JV_NONE:
        return jn_buf_puts(c, b, "None");
    case JV_BOOL:
        return jn_buf_puts(c, b, v->u.b ? "True" : "False");
    case JV_INT:
        snprintf(num, sizeof num, "%lld", (long long)v->u.i);
        return jn_buf_puts(c, b, num);
    case JV_FLOAT:
        jn_float_repr(v->u.f, num);
        return jn_buf_puts(c, b, num);
    case JV_STR:
        return repr ? repr_str(c, b, v->u.str.s, v->u.str.len)
                    : jn_buf_put(c, b, v->u.str.s, v->u.str.len);
    case JV_LIST:
        if (v->u.list.gen) return jn_buf_puts(c, b, "<generator object>");
        if (jn_buf_puts(c, b, v->u.list.tuple ? "(" : "[")) return -1;
        for (size_t i = 0; i < v->u.list.n; i++)
            if ((i && jn_buf_puts(c, b, ", ")) || write_value(c, b, v->u.list.items[i], true))
                return -1;
        if (v->u.list.tuple && v->u.list.n == 1 && jn_buf_puts(c, b, ",")) return -1;
        return jn_buf_puts(c, b, v->u.list.tuple ? ")" : "]");
    case JV_DICT:
        if (jn_buf_puts(c, b, "{")) return -1;
        for (size_t i = 0; i < v->u.dict->n; i++)
            if ((i && jn_buf_puts(c, b, ", ")) || write_value(c, b, v->u.dict->keys[i], true) ||
                jn_buf_puts(c, b, ": ") || write_value(c, b, v->u.dict->vals[i], true))
                return -1;
        return jn_buf_puts(c, b, "}");
    case JV_NS:
        return jn_buf_puts(c, b, "<Namespace>");
    case JV_LOOP:
        return jn_buf_puts(c, b, "<LoopContext>");
    case JV_FUNC:
        snprintf(num, sizeof num, "<function %.20s>", v->u.fn.name ? v->u.fn.name : "");
        return jn_buf_puts(c, b, num);
    }
    return 0;
}

int jn_write_str(jn_ctx *c, jn_buf *b, const jv *v)
{
    return write_value(c, b, v, false);
}

int jn_write_repr(jn_ctx *c, jn_buf *b, const jv *v)
{
    return write_value(c, b, v, true);
}

jv *jn_to_str(jn_ctx *c, const jv *v)
{
    if (v->kind == JV_STR) return (jv *)v;
    jn_buf b = {0};
    if (jn_write_str(c, &b, v)) {
        free(b.buf);
        return NULL;
    }
    jv *r = jn_str(c, b.buf ? b.buf : "", b.len);
    free(b.buf);
    return r;
}

/* json.dumps's string: the quote, the backslash and the control characters escaped, and
 * with ensure_ascii every other non-ASCII character as \uXXXX (UTF-16 pairs above U+FFFF). */
static int json_str(jn_ctx *c, jn_buf *b, const char *s, size_t n, bool ascii)
{
    if (jn_buf_put(c, b, "\"", 1)) return -1;
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        const char *x = NULL;
        char esc[8];
        if (ch == '"')
            x = "\\\"";
        else if (ch == '\\')
            x = "\\\\";
        else if (ch == '\n')
            x = "\\n";
        else if (ch == '\r')
            x = "\\r";
        else if (ch == '\t')
            x = "\\t";
        else if (ch == '\b')
            x = "\\b";
        else if (ch == '\f')
            x = "\\f";
        else if (ch < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", ch);
            x = esc;
        }
        if (ascii && ch >= 0x80) {
            size_t j = i;
            uint32_t cp = jn_utf8_next(s, n, &j);
            char u[16];
            if (cp >= 0x10000)
                snprintf(u, sizeof u, "\\u%04x\\u%04x", 0xD800 + ((cp - 0x10000) >> 10),
                         0xDC00 + ((cp - 0x10000) & 0x3FF));
            else
                snprintf(u, sizeof u, "\\u%04x", cp);
            if (jn_buf_put(c, b, s + run, i - run) || jn_buf_puts(c, b, u)) return -1;
            run = j;
            i = j - 1;
            continue;
        }
        if (!x) continue;
        if (jn_buf_put(c, b, s + run, i - run) || jn_buf_puts(c, b, x)) return -1;
        run = i + 1;
    }
    if (jn_buf_put(c, b, s + run, n - run)) return -1;
    return jn_buf_put(c, b, "\"", 1);
}

typedef struct {
    int indent;
    const char *item_sep, *key_sep;
    bool sort_keys, ascii;
} json_fmt;

static int json_newline(jn_ctx *c, jn_buf *b, const json_fmt *f, int level)
{
    if (jn_buf_put(c, b, "\n", 1)) return -1;
    for (int i = 0; i < f->indent * level; i++)
        if (jn_buf_put(c, b, " ", 1)) return -1;
    return 0;
}

static int json_value(jn_ctx *c, jn_buf *b, const jv *v, const json_fmt *f, int level);

static int json_dict(jn_ctx *c, jn_buf *b, const jv *v, const json_fmt *f, int level)
{
    size_t n = v->u.dict->n, *order = NULL;
    if (!n) return jn_buf_puts(c, b, "{}");
    if (!(order = jn_alloc(&c->arena, n * sizeof *order))) return oom(c), -1;
    for (size_t i = 0; i < n; i++) {
        order[i] = i;
        jv *k = v->u.dict->keys[i];
        if (k->kind != JV_STR && k->kind != JV_INT && k->kind != JV_FLOAT && k->kind != JV_BOOL &&
            k->kind != JV_NONE)
            return jn_fail(c, TD_EINVAL, 0,
                           "tojson: keys must be str, int, float, bool or None, "
                           "not %s",
                           jn_type_name(k)),
                   -1;
        if (f->sort_keys && k->kind != JV_STR)
            return jn_fail(c, TD_EINVAL, 0, "tojson: sort_keys with a key of type %s",
                           jn_type_name(k)),
                   -1;
    }
    if (f->sort_keys) /* insertion sort: stable, and dicts here are small */
        for (size_t i = 1; i < n; i++)
            for (size_t j = i; j > 0; j--) {
                bool ok;
                if (jn_compare(v->u.dict->keys[order[j - 1]], v->u.dict->keys[order[j]], &ok) <= 0)
                    break;
                size_t t = order[j];
                order[j] = order[j - 1];
                order[j - 1] = t;
            }
    if (jn_buf_puts(c, b, "{")) return -1;
    for (size_t i = 0; i < n; i++) {
        jv *k = v->u.dict->keys[order[i]];
        if (i && jn_buf_puts(c, b, f->item_sep)) return -1;
        if (f->indent >= 0 && json_newline(c, b, f, level + 1)) return -1;
        int rc;
        if (k->kind == JV_STR) {
            rc = json_str(c, b, k->u.str.s, k->u.str.len, f->ascii);
        } else { /* json.dumps writes other keys as their JSON text in quotes */
            jn_buf t = {0};
            rc = json_value(c, &t, k, f, 0) || json_str(c, b, t.buf, t.len, f->ascii);
            free(t.buf);
        }
        if (rc || jn_buf_puts(c, b, f->key_sep) ||
            json_value(c, b, v->u.dict->vals[order[i]], f, level + 1))
            return -1;
    }
    if (f->indent >= 0 && json_newline(c, b, f, level)) return -1;
    return jn_buf_puts(c, b, "}");
}

static int json_value(jn_ctx *c, jn_buf *b, const jv *v, const json_fmt *f, int level)
{
    char num[40];
    if (level > JN_MAX_DEPTH)
        return jn_fail(c, TD_ERANGE, 0, "tojson: nested deeper than %d", JN_MAX_DEPTH), -1;
    switch (v->kind) {
    case JV_NONE:
        return jn_buf_puts(c, b, "null");
    case JV_BOOL:
        return jn_buf_puts(c, b, v->u.b ? "true" : "false");
    case JV_INT:
        snprintf(num, sizeof num, "%lld", (long long)v->u.i);
        return jn_buf_puts(c, b, num);
    case JV_FLOAT:
        if (isnan(v->u.f)) return jn_buf_puts(c, b, "NaN");
        if (isinf(v->u.f)) return jn_buf_puts(c, b, v->u.f < 0 ? "-Infinity" : "Infinity");
        jn_float_repr(v->u.f, num);
        return jn_buf_puts(c, b, num);
    case JV_STR:
        return json_str(c, b, v->u.str.s, v->u.str.len, f->ascii);
    case JV_LIST:
        if (v->u.list.gen) break;
        if (!v->u.list.n) return jn_buf_puts(c, b, "[]");
        if (jn_buf_puts(c, b, "[")) return -1;
        for (size_t i = 0; i < v->u.list.n; i++) {
            if (i && jn_buf_puts(c, b, f->item_sep)) return -1;
            if (f->indent >= 0 && json_newline(c, b, f, level + 1)) return -1;
            if (json_value(c, b, v->u.list.items[i], f, level + 1)) return -1;
        }
        if (f->indent >= 0 && json_newline(c, b, f, level)) return -1;
        return jn_buf_puts(c, b, "]");
    case JV_DICT:
        return json_dict(c, b, v, f, level);
    default:
        break;
    }
    jn_fail(c, TD_EINVAL, 0, "tojson: Object of type %s is not JSON serializable", jn_type_name(v));
    return -1;
}

int jn_write_json(jn_ctx *c, jn_buf *b, const jv *v, int indent, const char *item_sep,
                  const char *key_sep, bool sort_keys, bool ensure_ascii)
{
    json_fmt f = {.indent = indent,
                  .item_sep = item_sep      ? item_sep
                              : indent >= 0 ? ","
                                            : ", ",
                  .key_sep = key_sep ? key_sep : ": ",
                  .sort_keys = sort_keys,
                  .ascii = ensure_ascii};
    return json_value(c, b, v, &f, 0);
}

char *jn_pyjson(const json_t *v)
{
    jn_ctx c = {.max_output = (size_t)1 << 30};
    jn_buf b = {0};
    jv *x = jn_from_json(&c, v);
    if (!x || jn_write_json(&c, &b, x, -1, NULL, NULL, false, false) || jn_buf_put(&c, &b, "", 0)) {
        free(b.buf);
        b.buf = NULL;
    }
    jn_arena_free(&c.arena);
    return b.buf;
}

/* ---- UTF-8 ---- */

uint32_t jn_utf8_next(const char *s, size_t n, size_t *i)
{
    unsigned char b = (unsigned char)s[*i];
    int k = b >= 0xF0 ? 3 : b >= 0xE0 ? 2 : b >= 0xC0 ? 1 : 0;
    uint32_t cp = k ? b & (0x3F >> k) : b;
    size_t j = *i + 1;
    for (int m = 0; m < k && j < n && ((unsigned char)s[j] & 0xC0) == 0x80; m++, j++)
        cp = cp << 6 | ((unsigned char)s[j] & 0x3F);
    *i = j;
    return cp;
}

size_t jn_utf8_count(const char *s, size_t len)
{
    size_t n = 0;
    for (size_t i = 0; i < len; i++)
        n += ((unsigned char)s[i] & 0xC0) != 0x80;
    return n;
}

size_t jn_utf8_offset(const char *s, size_t len, size_t i)
{
    size_t k = 0;
    for (size_t o = 0; o < len; o++) {
        if (((unsigned char)s[o] & 0xC0) == 0x80) continue;
        if (k++ == i) return o;
    }
    return len;
}
