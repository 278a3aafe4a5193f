/* jn_filters.c: jinja2's filters and tests as chat templates use them, transformers' tojson,
 * and the names jinja2 knows (so one not implemented here is refused by name, never
 * skipped). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jn_int.h"
#include "td_err.h"

/* ---- names ---- */

static const char *const jinja2_filters[] = {
    "abs",    "attr",       "batch",       "capitalize", "center",   "count",
    "d",      "default",    "dictsort",    "e",          "escape",   "filesizeformat",
    "first",  "float",      "forceescape", "format",     "groupby",  "indent",
    "int",    "items",      "join",        "last",       "length",   "list",
    "lower",  "map",        "max",         "min",        "pprint",   "random",
    "reject", "rejectattr", "replace",     "reverse",    "round",    "safe",
    "select", "selectattr", "slice",       "sort",       "string",   "striptags",
    "sum",    "title",      "tojson",      "trim",       "truncate", "unique",
    "upper",  "urlencode",  "urlize",      "wordcount",  "wordwrap", "xmlattr",
};

static const char *const jinja2_tests[] = {
    "boolean", "callable", "defined",  "divisibleby", "eq",    "equalto", "escaped",
    "even",    "false",    "filter",   "float",       "ge",    "gt",      "greaterthan",
    "in",      "integer",  "iterable", "le",          "lower", "lt",      "lessthan",
    "mapping", "ne",       "none",     "number",      "odd",   "sameas",  "sequence",
    "string",  "test",     "true",     "undefined",   "upper", "==",      "!=",
    "<",       "<=",       ">",        ">=",
};

static bool in_names(const char *const *names, size_t n, const char *name)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(names[i], name)) return true;
    return false;
}

bool jn_has_filter(const char *name)
{
    return in_names(jinja2_filters, sizeof jinja2_filters / sizeof *jinja2_filters, name);
}

bool jn_has_test(const char *name)
{
    return in_names(jinja2_tests, sizeof jinja2_tests / sizeof *jinja2_tests, name);
}

/* ---- helpers ---- */

static const jn_args no_args;

/* The arguments after the first `skip` positional ones (map/select pass the rest on). */
static jn_args rest_args(const jn_args *a, size_t skip)
{
    jn_args r = *a;
    r.pos = a->n_pos > skip ? a->pos + skip : NULL;
    r.n_pos = a->n_pos > skip ? a->n_pos - skip : 0;
    return r;
}

/* jinja2's attribute getter: "a.b.0" reads item by item; none reads nothing (the value
 * itself); any other value (map(attribute=0)) is one item key, as jinja2's make_attrgetter
 * takes it. */
static jv *attr_path(jn_ctx *c, jv *v, jv *path, int line)
{
    if (path->kind == JV_NONE || path->kind == JV_UNDEF) return v;
    if (path->kind != JV_STR) return jn_getitem(c, v, path, line);
    const char *p = path->u.str.s;
    while (v) {
        const char *dot = strchr(p, '.');
        size_t n = dot ? (size_t)(dot - p) : strlen(p);
        char part[128];
        if (n >= sizeof part) return jn_fail(c, TD_EINVAL, line, "attribute name too long");
        memcpy(part, p, n);
        part[n] = '\0';
        char *end;
        long idx = strtol(part, &end, 10);
        if (n && !*end) {
            jv *k = jn_int(c, idx);
            v = k ? jn_getitem(c, v, k, line) : NULL;
        } else {
            jv *k = jn_cstr(c, part);
            v = k ? jn_getitem(c, v, k, line) : NULL;
        }
        if (!dot) break;
        p = dot + 1;
    }
    return v;
}

static jv *str_of(jn_ctx *c, jv *v)
{
    return jn_to_str(c, v);
}

/* The key a sort, unique, min or max compares: the attribute, lower-cased strings unless
 * case_sensitive. */
static jv *sort_key(jn_ctx *c, jv *v, jv *attr, bool case_sensitive, int line)
{
    if (attr && !(v = attr_path(c, v, attr, line))) return NULL;
    if (!case_sensitive && v->kind == JV_STR) return jn_str_case(c, v, 'l');
    return v;
}

/* A stable merge sort of items by keys (parallel arrays). */
static int sort_items(jn_ctx *c, jv **items, jv **keys, size_t n, bool reverse, int line)
{
    if (n < 2) return 0;
    jv **ti = jn_alloc(&c->arena, n * sizeof *ti), **tk = jn_alloc(&c->arena, n * sizeof *tk);
    if (!ti || !tk) return jn_fail(c, TD_ENOMEM, line, "out of memory"), -1;
    for (size_t w = 1; w < n; w *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * w) {
            size_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            size_t i = lo, j = mid, o = lo;
            while (i < mid || j < hi) {
                bool take_left = j >= hi;
                if (i < mid && j < hi) {
                    bool ok;
                    int r = jn_compare(keys[i], keys[j], &ok);
                    if (!ok)
                        return jn_fail(c, TD_EINVAL, line,
                                       "'<' not supported between '%s' and '%s'",
                                       jn_type_name(keys[i]), jn_type_name(keys[j])),
                               -1;
                    take_left = reverse ? r >= 0 : r <= 0;
                }
                if (take_left) {
                    ti[o] = items[i];
                    tk[o++] = keys[i++];
                } else {
                    ti[o] = items[j];
                    tk[o++] = keys[j++];
                }
            }
        }
        memcpy(items, ti, n * sizeof *ti);
        memcpy(keys, tk, n * sizeof *tk);
    }
    return 0;
}

static jv *copy_list(jn_ctx *c, jv *l)
{
    jv *r = jn_list(c, l->u.list.n);
    if (r && l->u.list.n) memcpy(r->u.list.items, l->u.list.items, l->u.list.n * sizeof(jv *));
    return r;
}

/* ---- filters ---- */

static jv *f_length(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a;
    switch (v->kind) {
    case JV_UNDEF:
        return jn_int(c, 0);
    case JV_STR:
        return jn_int(c, (int64_t)jn_utf8_count(v->u.str.s, v->u.str.len));
    case JV_LIST:
        if (v->u.list.gen) break;
        return jn_int(c, (int64_t)v->u.list.n);
    case JV_DICT:
    case JV_NS:
        return jn_int(c, (int64_t)v->u.dict->n);
    default:
        break;
    }
    return jn_fail(c, TD_EINVAL, line, "object of type '%s' has no len()", jn_type_name(v));
}

static jv *f_default(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)line;
    jv *d = jn_arg(a, 0, "default_value"), *b = jn_arg(a, 1, "boolean");
    bool boolean = b && jn_truthy(b);
    if (v->kind == JV_UNDEF || (boolean && !jn_truthy(v))) return d ? d : jn_str(c, "", 0);
    return v;
}

static jv *f_tojson(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    jv *ind = jn_arg(a, 1, "indent"), *seps = jn_arg(a, 2, "separators");
    jv *sort = jn_arg(a, 3, "sort_keys"), *ascii = jn_arg(a, 0, "ensure_ascii");
    int indent = -1;
    if (ind && ind->kind == JV_INT)
        indent = (int)(ind->u.i < 0 ? 0 : ind->u.i > 64 ? 64 : ind->u.i);
    else if (ind && ind->kind != JV_NONE)
        return jn_fail(c, TD_EUNSUPP, line, "tojson: indent must be an integer");
    const char *item_sep = NULL, *key_sep = NULL;
    if (seps && seps->kind != JV_NONE) {
        if (seps->kind != JV_LIST || seps->u.list.n != 2 || seps->u.list.items[0]->kind != JV_STR ||
            seps->u.list.items[1]->kind != JV_STR)
            return jn_fail(c, TD_EINVAL, line, "tojson: separators must be two strings");
        item_sep = seps->u.list.items[0]->u.str.s;
        key_sep = seps->u.list.items[1]->u.str.s;
    }
    jn_buf b = {0};
    jv *r = NULL;
    if (!jn_write_json(c, &b, v, indent, item_sep, key_sep, sort && jn_truthy(sort),
                       ascii && jn_truthy(ascii)))
        r = jn_str(c, b.buf ? b.buf : "", b.len);
    else if (c->err && !c->err->line)
        c->err->line = line;
    free(b.buf);
    return r;
}

static jv *f_string(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a, (void)line;
    return str_of(c, v);
}

static jv *f_trim(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    jv *chars = jn_arg(a, 0, "chars"), *s = str_of(c, v);
    if (chars && chars->kind != JV_STR && chars->kind != JV_NONE)
        return jn_fail(c, TD_EINVAL, line, "trim: chars must be a string");
    return s ? jn_str_strip(c, s, chars && chars->kind == JV_STR ? chars : NULL, 3) : NULL;
}

static jv *f_case(jn_ctx *c, jv *v, char mode)
{
    jv *s = str_of(c, v);
    if (!s) return NULL;
    if (mode == 'c') { /* capitalize: the first letter up, the rest down */
        jv *low = jn_str_case(c, s, 'l');
        return low ? jn_str_case(c, low, 'c') : NULL;
    }
    if (mode == 't') {
        jv *low = jn_str_case(c, s, 'l');
        return low ? jn_str_case(c, low, 't') : NULL;
    }
    return jn_str_case(c, s, mode);
}

static jv *f_upper(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a, (void)line;
    return f_case(c, v, 'u');
}
static jv *f_lower(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a, (void)line;
    return f_case(c, v, 'l');
}
static jv *f_capitalize(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a, (void)line;
    return f_case(c, v, 'c');
}
static jv *f_title(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a, (void)line;
    return f_case(c, v, 't');
}

static jv *f_join(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    jv *sep = jn_arg(a, 0, "d"), *attr = jn_arg(a, 1, "attribute");
    jv *items = jn_iterate(c, v, line);
    if (!items || (sep && !(sep = str_of(c, sep)))) return NULL;
    jn_buf b = {0};
    jv *r = NULL;
    for (size_t i = 0; i < items->u.list.n; i++) {
        jv *x = items->u.list.items[i];
        if (attr && !(x = attr_path(c, x, attr, line))) goto out;
        if ((i && sep && jn_buf_put(c, &b, sep->u.str.s, sep->u.str.len)) || jn_write_str(c, &b, x))
            goto out;
    }
    r = jn_str(c, b.buf ? b.buf : "", b.len);
out:
    free(b.buf);
    return r;
}

static jv *f_first_last(jn_ctx *c, jv *v, int line, bool last)
{
    if (last && v->kind == JV_LIST && v->u.list.gen) /* reversed() needs a sequence */
        return jn_fail(c, TD_EINVAL, line, "last: 'generator' object is not reversible");
    jv *items = jn_iterate(c, v, line);
    if (!items) return NULL;
    if (!items->u.list.n) return jn_undef_named(c, last ? "last" : "first");
    return items->u.list.items[last ? items->u.list.n - 1 : 0];
}

static jv *f_first(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a;
    return f_first_last(c, v, line, false);
}
static jv *f_last(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a;
    return f_first_last(c, v, line, true);
}

static jv *f_list(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a;
    jv *items = jn_iterate(c, v, line);
    return items ? copy_list(c, items) : NULL;
}

static jv *f_items(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a;
    if (v->kind == JV_UNDEF) return jn_list(c, 0);
    if (v->kind != JV_DICT && v->kind != JV_NS)
        return jn_fail(c, TD_EINVAL, line, "items: can only get item pairs from a mapping");
    return jn_dict_items(c, v);
}

static jv *f_dictsort(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    jv *cs = jn_arg(a, 0, "case_sensitive"), *by = jn_arg(a, 1, "by"),
       *rev = jn_arg(a, 2, "reverse");
    if (v->kind != JV_DICT) return jn_fail(c, TD_EINVAL, line, "dictsort: a mapping is required");
    bool by_value = by && by->kind == JV_STR && !strcmp(by->u.str.s, "value");
    jv *items = jn_dict_items(c, v);
    jv **keys = items ? jn_alloc(&c->arena, (items->u.list.n + 1) * sizeof *keys) : NULL;
    if (!keys) return jn_fail(c, TD_ENOMEM, line, "out of memory");
    for (size_t i = 0; i < items->u.list.n; i++)
        if (!(keys[i] = sort_key(c, items->u.list.items[i]->u.list.items[by_value], NULL,
                                 cs && jn_truthy(cs), line)))
            return NULL;
    return sort_items(c, items->u.list.items, keys, items->u.list.n, rev && jn_truthy(rev), line)
               ? NULL
               : items;
}

static jv *f_sort(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    jv *rev = jn_arg(a, 0, "reverse"), *cs = jn_arg(a, 1, "case_sensitive");
    jv *attr = jn_arg(a, 2, "attribute");
    jv *items = jn_iterate(c, v, line);
    if (!items || !(items = copy_list(c, items))) return NULL;
    jv **keys = jn_alloc(&c->arena, (items->u.list.n + 1) * sizeof *keys);
    if (!keys) return jn_fail(c, TD_ENOMEM, line, "out of memory");
    for (size_t i = 0; i < items->u.list.n; i++)
        if (!(keys[i] = sort_key(c, items->u.list.items[i], attr, cs && jn_truthy(cs), line)))
            return NULL;
    return sort_items(c, items->u.list.items, keys, items->u.list.n, rev && jn_truthy(rev), line)
               ? NULL
               : items;
}

static jv *f_unique(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    jv *cs = jn_arg(a, 0, "case_sensitive"), *attr = jn_arg(a, 1, "attribute");
    jv *items = jn_iterate(c, v, line), *out = items ? jn_list(c, items->u.list.n) : NULL;
    jv **seen = out ? jn_alloc(&c->arena, (items->u.list.n + 1) * sizeof *seen) : NULL;
    if (!seen) return out ? jn_fail(c, TD_ENOMEM, line, "out of memory") : NULL;
    size_t n = 0;
    for (size_t i = 0; i < items->u.list.n; i++) {
        jv *k = sort_key(c, items->u.list.items[i], attr, cs && jn_truthy(cs), line);
        if (!k) return NULL;
        bool dup = false;
        for (size_t j = 0; j < n && !dup; j++)
            dup = jn_equal(seen[j], k);
        if (dup) continue;
        seen[n] = k;
        out->u.list.items[n++] = items->u.list.items[i];
    }
    out->u.list.n = n;
    return out;
}

static jv *min_max(jn_ctx *c, jv *v, const jn_args *a, int line, bool max)
{
    jv *cs = jn_arg(a, 0, "case_sensitive"), *attr = jn_arg(a, 1, "attribute");
    jv *items = jn_iterate(c, v, line), *best = NULL, *best_key = NULL;
    if (!items) return NULL;
    for (size_t i = 0; i < items->u.list.n; i++) {
        jv *k = sort_key(c, items->u.list.items[i], attr, cs && jn_truthy(cs), line);
        if (!k) return NULL;
        bool ok = true;
        int r = best ? jn_compare(k, best_key, &ok) : 0;
        if (!ok) return jn_fail(c, TD_EINVAL, line, "min/max: values that cannot be compared");
        if (!best || (max ? r > 0 : r < 0)) {
            best = items->u.list.items[i];
            best_key = k;
        }
    }
    return best ? best : jn_undef_named(c, max ? "max" : "min");
}

static jv *f_min(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    return min_max(c, v, a, line, false);
}
static jv *f_max(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    return min_max(c, v, a, line, true);
}

static jv *f_reverse(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a;
    jv *items = jn_iterate(c, v, line), *r = items ? jn_list(c, items->u.list.n) : NULL;
    if (!r) return NULL;
    for (size_t i = 0; i < items->u.list.n; i++)
        r->u.list.items[i] = items->u.list.items[items->u.list.n - 1 - i];
    if (v->kind != JV_STR) return r;
    jn_args none = no_args;
    jv *empty = jn_str(c, "", 0);
    jv *join = empty ? jn_method(c, empty, "join", line) : NULL;
    jv *arg[1] = {r};
    none.pos = arg;
    none.n_pos = 1;
    return join ? jn_call(c, join, &none, line) : NULL;
}

static jv *f_replace(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    jv *s = str_of(c, v);
    return s ? jn_str_replace(c, s, a, line) : NULL;
}

/* jinja2 3.1's indent: lines after the first (and the first with first=True) get the
 * indentation; blank lines only with blank=True. */
static jv *f_indent(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    jv *w = jn_arg(a, 0, "width"), *first = jn_arg(a, 1, "first"), *blank = jn_arg(a, 2, "blank");
    jv *s = str_of(c, v), *ind;
    if (!s) return NULL;
    if (w && w->kind == JV_STR)
        ind = w;
    else {
        int64_t n = w && w->kind == JV_INT ? w->u.i : 4;
        char sp[256];
        if (n < 0) n = 0;
        if (n > 255) return jn_fail(c, TD_EUNSUPP, line, "indent wider than 255");
        memset(sp, ' ', (size_t)n);
        ind = jn_str(c, sp, (size_t)n);
    }
    jn_args none = no_args;
    /* s + "\n", split into lines (the newline makes splitlines keep a last empty line) */
    jv *nl = jn_str(c, "\n", 1), *s2 = nl ? jn_str(c, "", 0) : NULL;
    jv *pair[2] = {s, nl};
    jv *cat = jn_list(c, 2);
    if (!s2 || !cat) return NULL;
    cat->u.list.items[0] = pair[0];
    cat->u.list.items[1] = pair[1];
    jv *join = jn_method(c, s2, "join", line);
    none.pos = &cat;
    none.n_pos = 1;
    s2 = join ? jn_call(c, join, &none, line) : NULL;
    none = no_args;
    jv *sl = ind && s2 ? jn_method(c, s2, "splitlines", line) : NULL;
    jv *lines = sl ? jn_call(c, sl, &none, line) : NULL;
    if (!lines) return NULL;
    jn_buf b = {0};
    jv *r = NULL;
    bool fst = first && jn_truthy(first), blk = blank && jn_truthy(blank);
    for (size_t i = 0; i < lines->u.list.n; i++) {
        jv *l = lines->u.list.items[i];
        bool add = i == 0 ? fst : (blk || l->u.str.len);
        if ((i && jn_buf_put(c, &b, "\n", 1)) ||
            (add && jn_buf_put(c, &b, ind->u.str.s, ind->u.str.len)) ||
            jn_buf_put(c, &b, l->u.str.s, l->u.str.len))
            goto out;
    }
    if (!lines->u.list.n && fst && jn_buf_put(c, &b, ind->u.str.s, ind->u.str.len)) goto out;
    r = jn_str(c, b.buf ? b.buf : "", b.len);
out:
    free(b.buf);
    return r;
}

/* int(x) as jinja2's filter does: numbers truncate, strings parse as int or else float,
 * anything else is the default. */
static jv *f_int(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    jv *d = jn_arg(a, 0, "default"), *base = jn_arg(a, 1, "base");
    (void)line;
    if (base && !(base->kind == JV_INT && base->u.i == 10))
        return jn_fail(c, TD_EUNSUPP, line, "int: only base 10 is supported");
    if (v->kind == JV_INT) return v;
    if (v->kind == JV_BOOL) return jn_int(c, v->u.b);
    if (v->kind == JV_FLOAT && isfinite(v->u.f)) return jn_int(c, (int64_t)v->u.f);
    if (v->kind == JV_STR) {
        jv *t = jn_str_strip(c, v, NULL, 3);
        char *end;
        if (t && t->u.str.len) {
            long long i = strtoll(t->u.str.s, &end, 10);
            if (!*end) return jn_int(c, i);
            double f = strtod(t->u.str.s, &end);
            if (!*end && isfinite(f)) return jn_int(c, (int64_t)f);
        }
    }
    return d ? d : jn_int(c, 0);
}

static jv *f_float(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    jv *d = jn_arg(a, 0, "default");
    (void)line;
    if (v->kind == JV_FLOAT) return v;
    if (v->kind == JV_INT || v->kind == JV_BOOL)
        return jn_float(c, v->kind == JV_INT ? (double)v->u.i : v->u.b);
    if (v->kind == JV_STR) {
        jv *t = jn_str_strip(c, v, NULL, 3);
        char *end;
        if (t && t->u.str.len) {
            double f = strtod(t->u.str.s, &end);
            if (!*end) return jn_float(c, f);
        }
    }
    return d ? d : jn_float(c, 0.0);
}

static jv *f_abs(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a;
    if (v->kind == JV_INT) return v->u.i < 0 ? jn_int(c, -v->u.i) : v;
    if (v->kind == JV_FLOAT) return jn_float(c, fabs(v->u.f));
    if (v->kind == JV_BOOL) return jn_int(c, v->u.b);
    return jn_fail(c, TD_EINVAL, line, "bad operand type for abs(): '%s'", jn_type_name(v));
}

static jv *f_round(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    jv *prec = jn_arg(a, 0, "precision"), *method = jn_arg(a, 1, "method");
    if (v->kind != JV_INT && v->kind != JV_FLOAT && v->kind != JV_BOOL)
        return jn_fail(c, TD_EINVAL, line, "round: a number is required");
    double x = v->kind == JV_FLOAT ? v->u.f : v->kind == JV_INT ? (double)v->u.i : v->u.b;
    double m = pow(10, prec && prec->kind == JV_INT ? (double)prec->u.i : 0);
    const char *how = method && method->kind == JV_STR ? method->u.str.s : "common";
    if (!strcmp(how, "common"))
        x = round(x * m) / m;
    else if (!strcmp(how, "floor"))
        x = floor(x * m) / m;
    else if (!strcmp(how, "ceil"))
        x = ceil(x * m) / m;
    else
        return jn_fail(c, TD_EINVAL, line, "round: method must be common, floor or ceil");
    return jn_float(c, x);
}

static jv *f_sum(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    jv *attr = jn_arg(a, 0, "attribute"), *start = jn_arg(a, 1, "start");
    jv *items = jn_iterate(c, v, line), *acc = start ? start : jn_int(c, 0);
    for (size_t i = 0; items && acc && i < items->u.list.n; i++) {
        jv *x = items->u.list.items[i];
        if (attr && !(x = attr_path(c, x, attr, line))) return NULL;
        bool fl = acc->kind == JV_FLOAT || x->kind == JV_FLOAT;
        if ((acc->kind != JV_INT && acc->kind != JV_FLOAT) ||
            (x->kind != JV_INT && x->kind != JV_FLOAT))
            return jn_fail(c, TD_EINVAL, line, "sum: numbers are required");
        acc = fl ? jn_float(c, (acc->kind == JV_FLOAT ? acc->u.f : (double)acc->u.i) +
                                   (x->kind == JV_FLOAT ? x->u.f : (double)x->u.i))
                 : jn_int(c, acc->u.i + x->u.i);
    }
    return items ? acc : NULL;
}

static jv *f_wordcount(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a, (void)line;
    jv *s = str_of(c, v);
    if (!s) return NULL;
    int64_t n = 0;
    bool in = false;
    for (size_t i = 0; i < s->u.str.len; i++) {
        unsigned char ch = (unsigned char)s->u.str.s[i];
        bool w = ch >= 0x80 || ch == '_' || (ch >= '0' && ch <= '9') ||
                 ((ch | 32) >= 'a' && (ch | 32) <= 'z');
        n += w && !in;
        in = w;
    }
    return jn_int(c, n);
}

/* A string as markupsafe's Markup (a copy: literals are shared). */
static jv *markup(jn_ctx *c, jv *s)
{
    if (!s || s->u.str.markup) return s;
    jv *m = jn_str(c, s->u.str.s, s->u.str.len);
    if (m) m->u.str.markup = true;
    return m;
}

static jv *f_safe(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a, (void)line;
    return markup(c, str_of(c, v));
}

jv *jn_html_escape(jn_ctx *c, jv *v)
{
    jv *s = str_of(c, v);
    jn_buf b = {0};
    jv *r = NULL;
    for (size_t i = 0; s && i < s->u.str.len; i++) {
        char ch = s->u.str.s[i];
        const char *e = ch == '&'    ? "&amp;"
                        : ch == '<'  ? "&lt;"
                        : ch == '>'  ? "&gt;"
                        : ch == '"'  ? "&#34;"
                        : ch == '\'' ? "&#39;"
                                     : NULL;
        if (e ? jn_buf_puts(c, &b, e) : jn_buf_put(c, &b, &ch, 1)) goto out;
    }
    if (s) r = markup(c, jn_str(c, b.buf ? b.buf : "", b.len));
out:
    free(b.buf);
    return r;
}

static jv *f_escape(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a, (void)line;
    return v->kind == JV_STR && v->u.str.markup ? v : jn_html_escape(c, v);
}

static jv *f_forceescape(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    (void)a, (void)line;
    return jn_html_escape(c, v);
}

static jv *f_center(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    jv *w = jn_arg(a, 0, "width"), *s = str_of(c, v);
    (void)line;
    if (!s) return NULL;
    int64_t width = w && w->kind == JV_INT ? w->u.i : 80,
            n = (int64_t)jn_utf8_count(s->u.str.s, s->u.str.len);
    if (width <= n) return s;
    if (width > 4096) return jn_fail(c, TD_EUNSUPP, line, "center wider than 4096");
    /* Python's str.center: the odd space goes left when the margin and width are odd */
    int64_t marg = width - n, left = marg / 2 + (marg & width & 1);
    char *buf = jn_alloc(&c->arena, (size_t)(s->u.str.len + (size_t)marg + 1));
    if (!buf) return jn_fail(c, TD_ENOMEM, line, "out of memory");
    memset(buf, ' ', (size_t)left);
    memcpy(buf + left, s->u.str.s, s->u.str.len);
    memset(buf + left + (int64_t)s->u.str.len, ' ', (size_t)(marg - left));
    return jn_str(c, buf, s->u.str.len + (size_t)marg);
}

static jv *f_attr(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    jv *name = jn_arg(a, 0, NULL);
    if (!name || name->kind != JV_STR) return jn_fail(c, TD_EINVAL, line, "attr: takes a name");
    return jn_getattr(c, v, name->u.str.s, line);
}

/* map('filter', ...) or map(attribute='x', default=...) */
static jv *f_map(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    /* jinja2 maps nothing over a false value (None, undefined, empty) */
    jv *items = jn_truthy(v) ? jn_iterate(c, v, line) : jn_list(c, 0);
    jv *attr = jn_arg(a, SIZE_MAX, "attribute");
    jv *dflt = jn_arg(a, SIZE_MAX, "default"), *name = jn_arg(a, 0, NULL);
    if (!items) return NULL;
    if (!attr && (!name || name->kind != JV_STR))
        return jn_fail(c, TD_EINVAL, line, "map: takes a filter name or attribute=");
    jn_args rest = rest_args(a, 1);
    rest.n_kv = 0;
    jv *r = jn_list(c, items->u.list.n);
    for (size_t i = 0; r && i < items->u.list.n; i++) {
        jv *x = items->u.list.items[i];
        if (attr) {
            x = attr_path(c, x, attr, line);
            if (x && x->kind == JV_UNDEF && dflt) x = dflt;
        } else {
            x = jn_apply_filter(c, name->u.str.s, x, &rest, line);
        }
        if (!x) return NULL;
        r->u.list.items[i] = x;
    }
    if (r) r->u.list.gen = true;
    return r;
}

/* select / reject (attr NULL) and selectattr / rejectattr: keep the items whose test (or
 * truth, without a test name) is `want`. */
static jv *select_items(jn_ctx *c, jv *v, const jn_args *a, int line, bool by_attr, bool want)
{
    jv *items = jn_truthy(v) ? jn_iterate(c, v, line) : jn_list(c, 0);
    if (!items) return NULL;
    size_t k = 0;
    jv *attr = NULL;
    if (by_attr) {
        attr = jn_arg(a, k++, NULL);
        if (!attr || attr->kind != JV_STR)
            return jn_fail(c, TD_EINVAL, line, "selectattr: takes an attribute name");
    }
    jv *test = jn_arg(a, k, NULL);
    if (test && test->kind != JV_STR)
        return jn_fail(c, TD_EINVAL, line, "select: the test must be a name");
    jn_args rest = rest_args(a, k + 1);
    jv *r = jn_list(c, items->u.list.n);
    size_t n = 0;
    for (size_t i = 0; r && i < items->u.list.n; i++) {
        jv *x = items->u.list.items[i], *y = attr ? attr_path(c, x, attr, line) : x;
        if (!y) return NULL;
        int t = test ? jn_apply_test(c, test->u.str.s, y, &rest, line) : jn_truthy(y);
        if (t < 0) return NULL;
        if ((t == 1) == want) r->u.list.items[n++] = x;
    }
    if (r) {
        r->u.list.n = n;
        r->u.list.gen = true;
    }
    return r;
}

static jv *f_select(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    return select_items(c, v, a, line, false, true);
}
static jv *f_reject(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    return select_items(c, v, a, line, false, false);
}
static jv *f_selectattr(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    return select_items(c, v, a, line, true, true);
}
static jv *f_rejectattr(jn_ctx *c, jv *v, const jn_args *a, int line)
{
    return select_items(c, v, a, line, true, false);
}

typedef jv *(*filter_fn)(jn_ctx *c, jv *v, const jn_args *a, int line);

static const struct {
    const char *name;
    filter_fn fn;
} filters[] = {
    {"length", f_length},
    {"count", f_length},
    {"default", f_default},
    {"d", f_default},
    {"tojson", f_tojson},
    {"string", f_string},
    {"trim", f_trim},
    {"upper", f_upper},
    {"lower", f_lower},
    {"capitalize", f_capitalize},
    {"title", f_title},
    {"join", f_join},
    {"first", f_first},
    {"last", f_last},
    {"list", f_list},
    {"items", f_items},
    {"dictsort", f_dictsort},
    {"sort", f_sort},
    {"unique", f_unique},
    {"min", f_min},
    {"max", f_max},
    {"reverse", f_reverse},
    {"replace", f_replace},
    {"indent", f_indent},
    {"int", f_int},
    {"float", f_float},
    {"abs", f_abs},
    {"round", f_round},
    {"sum", f_sum},
    {"wordcount", f_wordcount},
    {"safe", f_safe},
    {"e", f_escape},
    {"escape", f_escape},
    {"forceescape", f_forceescape},
    {"center", f_center},
    {"attr", f_attr},
    {"map", f_map},
    {"select", f_select},
    {"reject", f_reject},
    {"selectattr", f_selectattr},
    {"rejectattr", f_rejectattr},
};

jv *jn_apply_filter(jn_ctx *c, const char *name, jv *v, const jn_args *a, int line)
{
    for (size_t i = 0; i < sizeof filters / sizeof *filters; i++)
        if (!strcmp(filters[i].name, name)) return filters[i].fn(c, v, a ? a : &no_args, line);
    if (jn_has_filter(name))
        return jn_fail(c, TD_EUNSUPP, line, "the filter '%s' is not implemented", name);
    return jn_fail(c, TD_EINVAL, line, "no filter named '%s'", name);
}

/* ---- tests ---- */

static int cmp_test(jn_ctx *c, const char *name, jv *v, jv *o, int line)
{
    if (!strcmp(name, "eq") || !strcmp(name, "equalto") || !strcmp(name, "=="))
        return jn_equal(v, o);
    if (!strcmp(name, "ne") || !strcmp(name, "!=")) return !jn_equal(v, o);
    bool ok;
    int r = jn_compare(v, o, &ok);
    if (!ok) {
        jn_fail(c, TD_EINVAL, line, "'%s' not supported between '%s' and '%s'", name,
                jn_type_name(v), jn_type_name(o));
        return -1;
    }
    if (!strcmp(name, "lt") || !strcmp(name, "lessthan") || !strcmp(name, "<")) return r < 0;
    if (!strcmp(name, "le") || !strcmp(name, "<=")) return r <= 0;
    if (!strcmp(name, "gt") || !strcmp(name, "greaterthan") || !strcmp(name, ">")) return r > 0;
    return r >= 0;
}

static bool is_cmp_test(const char *name)
{
    static const char *const n[] = {
        "eq", "equalto", "==", "ne",          "!=", "lt", "lessthan", "<",
        "le", "<=",      "gt", "greaterthan", ">",  "ge", ">="};
    return in_names(n, sizeof n / sizeof *n, name);
}

static int case_test(const jv *v, bool upper)
{
    if (v->kind != JV_STR) return 0;
    bool cased = false;
    for (size_t i = 0; i < v->u.str.len; i++) {
        unsigned char ch = (unsigned char)v->u.str.s[i];
        if (upper ? (ch >= 'a' && ch <= 'z') : (ch >= 'A' && ch <= 'Z')) return 0;
        cased |= (ch | 32) >= 'a' && (ch | 32) <= 'z';
    }
    return cased;
}

int jn_apply_test(jn_ctx *c, const char *name, jv *v, const jn_args *a, int line)
{
    jv_kind k = v->kind;
    jv *o = jn_arg(a, 0, NULL);
    if (!strcmp(name, "defined")) return k != JV_UNDEF;
    if (!strcmp(name, "undefined")) return k == JV_UNDEF;
    if (!strcmp(name, "none")) return k == JV_NONE;
    if (!strcmp(name, "boolean")) return k == JV_BOOL;
    if (!strcmp(name, "true")) return k == JV_BOOL && v->u.b;
    if (!strcmp(name, "false")) return k == JV_BOOL && !v->u.b;
    if (!strcmp(name, "integer")) return k == JV_INT;
    if (!strcmp(name, "float")) return k == JV_FLOAT;
    if (!strcmp(name, "number")) return k == JV_INT || k == JV_FLOAT || k == JV_BOOL;
    if (!strcmp(name, "string")) return k == JV_STR;
    if (!strcmp(name, "mapping")) return k == JV_DICT;
    if (!strcmp(name, "iterable"))
        return k == JV_STR || k == JV_LIST || k == JV_DICT || k == JV_UNDEF;
    if (!strcmp(name, "sequence"))
        return k == JV_STR || k == JV_LIST || k == JV_DICT || k == JV_UNDEF;
    if (!strcmp(name, "callable")) return k == JV_FUNC;
    if (!strcmp(name, "escaped")) return 0;
    if (!strcmp(name, "lower")) return case_test(v, false);
    if (!strcmp(name, "upper")) return case_test(v, true);
    if (!strcmp(name, "filter") || !strcmp(name, "test"))
        return k == JV_STR &&
               (name[0] == 'f' ? jn_has_filter(v->u.str.s) : jn_has_test(v->u.str.s));
    if (!strcmp(name, "even") || !strcmp(name, "odd")) {
        if (k != JV_INT && k != JV_BOOL) {
            jn_fail(c, TD_EINVAL, line, "the test '%s' needs an integer", name);
            return -1;
        }
        int64_t i = k == JV_INT ? v->u.i : v->u.b;
        return (i % 2 == 0) == (name[0] == 'e');
    }
    if (!o) {
        jn_fail(c, TD_EINVAL, line, "the test '%s' takes an argument", name);
        return -1;
    }
    if (is_cmp_test(name)) return cmp_test(c, name, v, o, line);
    if (!strcmp(name, "sameas"))
        return v == o || (k == o->kind && (k == JV_NONE || (k == JV_BOOL && v->u.b == o->u.b)));
    if (!strcmp(name, "divisibleby")) {
        if ((k != JV_INT && k != JV_BOOL) || o->kind != JV_INT || !o->u.i) {
            jn_fail(c, TD_EINVAL, line,
                    "divisibleby: integers are required (and a non-zero divisor)");
            return -1;
        }
        return (k == JV_INT ? v->u.i : v->u.b) % o->u.i == 0;
    }
    if (!strcmp(name, "in")) {
        /* the same rules as the `in` operator */
        if (o->kind == JV_STR) {
            if (k != JV_STR) {
                jn_fail(c, TD_EINVAL, line, "'in <string>' requires string as left operand");
                return -1;
            }
            return strstr(o->u.str.s, v->u.str.s) != NULL;
        }
        if (o->kind == JV_LIST) {
            for (size_t i = 0; i < o->u.list.n; i++)
                if (jn_equal(o->u.list.items[i], v)) return 1;
            return 0;
        }
        if (o->kind == JV_DICT) return jn_dict_get(o, v) != NULL;
        jn_fail(c, TD_EINVAL, line, "argument of type '%s' is not iterable", jn_type_name(o));
        return -1;
    }
    jn_fail(c, TD_EINVAL, line, "no test named '%s'", name);
    return -1;
}
