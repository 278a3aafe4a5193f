/* jn_eval.c: renders a syntax tree: expressions with Python's semantics as jinja2's sandbox
 * applies them, statements with jinja2's scoping, macros and call blocks, and jn_render. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "jn_int.h"
#include "td_err.h"

enum { R_OK = 0, R_BREAK = 1, R_CONTINUE = 2, R_ERR = -1 };

static jv *eval(jn_ctx *c, jn_scope *s, const jn_node *x);
static int render(jn_ctx *c, jn_scope *s, const jn_node *x, jn_buf *out);

bool jn_count_step(jn_ctx *c, int line)
{
    if (++c->steps <= JN_MAX_STEPS) return true;
    jn_fail(c, TD_ERANGE, line, "the template ran more than %d loop iterations and calls",
            JN_MAX_STEPS);
    return false;
}

/* ---- scopes ---- */

static jn_scope *scope_new(jn_ctx *c, jn_scope *parent)
{
    jn_scope *s = jn_alloc(&c->arena, sizeof *s);
    if (!s || !(s->vars = jn_dict_new(c)))
        return (jn_scope *)jn_fail(c, TD_ENOMEM, 0, "out of memory");
    s->parent = parent;
    return s;
}

static jv *lookup(jn_scope *s, const char *name)
{
    for (; s; s = s->parent) {
        jv *v = jn_dict_gets(s->vars, name);
        if (v) return v;
    }
    return NULL;
}

static int assign(jn_ctx *c, jn_scope *s, const char *name, jv *v)
{
    jv *k = jn_cstr(c, name);
    return k ? jn_dict_set(c, s->vars, k, v) : -1;
}

/* name = v, or a, b = v (v unpacked: a list of as many items). */
static int assign_targets(jn_ctx *c, jn_scope *s, const jn_node *x, jv *v)
{
    if (x->n_names == 1) return assign(c, s, x->names[0], v);
    jv *items = v->kind == JV_LIST ? v : jn_iterate(c, v, x->line);
    if (!items) return -1;
    if (items->u.list.n != x->n_names) {
        jn_fail(c, TD_EINVAL, x->line, "cannot unpack %zu values into %zu names", items->u.list.n,
                x->n_names);
        return -1;
    }
    for (size_t i = 0; i < x->n_names; i++)
        if (assign(c, s, x->names[i], items->u.list.items[i])) return -1;
    return 0;
}

/* ---- attributes, items, iteration ---- */

static jv *loop_attr(jn_ctx *c, jn_loop *l, const char *name, int line)
{
    size_t i = l->index0, n = l->length;
    if (!strcmp(name, "index")) return jn_int(c, (int64_t)i + 1);
    if (!strcmp(name, "index0")) return jn_int(c, (int64_t)i);
    if (!strcmp(name, "revindex")) return jn_int(c, (int64_t)(n - i));
    if (!strcmp(name, "revindex0")) return jn_int(c, (int64_t)(n - i - 1));
    if (!strcmp(name, "first")) return JN_BOOL(i == 0);
    if (!strcmp(name, "last")) return JN_BOOL(i + 1 == n);
    if (!strcmp(name, "length")) return jn_int(c, (int64_t)n);
    if (!strcmp(name, "depth")) return jn_int(c, 1);
    if (!strcmp(name, "depth0")) return jn_int(c, 0);
    if (!strcmp(name, "previtem"))
        return i ? l->list->u.list.items[i - 1] : jn_undef_named(c, "previtem");
    if (!strcmp(name, "nextitem"))
        return i + 1 < n ? l->list->u.list.items[i + 1] : jn_undef_named(c, "nextitem");
    (void)line;
    return jn_undef_named(c, name);
}

jv *jn_getattr(jn_ctx *c, jv *v, const char *name, int line)
{
    switch (v->kind) {
    case JV_UNDEF:
        return jn_fail(c, TD_EINVAL, line, "'%s' is undefined (reading its attribute '%s')",
                       v->u.undef ? v->u.undef : "value", name);
    case JV_LOOP:
        if (!strcmp(name, "cycle")) return jn_method(c, v, name, line);
        return loop_attr(c, v->u.loop, name, line);
    case JV_NS: {
        jv *r = jn_dict_gets(v, name);
        return r ? r : jn_undef_named(c, name);
    }
    case JV_DICT: {
        /* a dict's own methods come first (jinja2 tries getattr, then the item) */
        jv *m = jn_method(c, v, name, line);
        if (m || c->rc) return m;
        jv *r = jn_dict_gets(v, name);
        return r ? r : jn_undef_named(c, name);
    }
    case JV_STR:
    case JV_LIST: {
        jv *m = jn_method(c, v, name, line);
        return m || c->rc ? m : jn_undef_named(c, name);
    }
    default:
        return jn_undef_named(c, name);
    }
}

/* Python's slice.indices: start, stop, step for a length n. */
static void slice_bounds(int64_t n, const jv *a, const jv *b, int64_t step, int64_t *start,
                         int64_t *stop)
{
    int64_t lo = step < 0 ? -1 : 0, hi = step < 0 ? n - 1 : n;
    if (!a || a->kind == JV_NONE) {
        *start = step < 0 ? hi : lo;
    } else {
        *start = a->u.i < 0 ? a->u.i + n : a->u.i;
        if (*start < lo) *start = lo;
        if (*start > hi) *start = hi;
    }
    if (!b || b->kind == JV_NONE) {
        *stop = step < 0 ? lo : hi;
    } else {
        *stop = b->u.i < 0 ? b->u.i + n : b->u.i;
        if (*stop < lo) *stop = lo;
        if (*stop > hi) *stop = hi;
    }
}

static jv *slice(jn_ctx *c, jv *v, jv *a, jv *b, jv *st, int line)
{
    for (jv **p = (jv *[]){a, b, st}, **e = p + 3; p < e; p++)
        if (*p && (*p)->kind != JV_NONE && (*p)->kind != JV_INT)
            return jn_fail(c, TD_EINVAL, line, "slice indices must be integers or None, not %s",
                           jn_type_name(*p));
    int64_t step = st && st->kind == JV_INT ? st->u.i : 1, start, stop;
    if (step == 0) return jn_fail(c, TD_EINVAL, line, "slice step cannot be zero");
    if (v->kind == JV_UNDEF)
        return jn_fail(c, TD_EINVAL, line, "'%s' is undefined (sliced)",
                       v->u.undef ? v->u.undef : "value");
    if (v->kind == JV_LIST && v->u.list.gen) return jn_undef_named(c, "slice");
    if (v->kind != JV_LIST && v->kind != JV_STR)
        return jn_fail(c, TD_EINVAL, line, "'%s' object is not subscriptable", jn_type_name(v));
    bool str = v->kind == JV_STR;
    int64_t n = str ? (int64_t)jn_utf8_count(v->u.str.s, v->u.str.len) : (int64_t)v->u.list.n;
    slice_bounds(n, a, b, step, &start, &stop);
    int64_t cnt = step > 0 ? (stop > start ? (stop - start + step - 1) / step : 0)
                           : (start > stop ? (start - stop - step - 1) / -step : 0);
    if (!str) {
        jv *r = jn_list(c, (size_t)cnt);
        for (int64_t k = 0; r && k < cnt; k++)
            r->u.list.items[k] = v->u.list.items[start + k * step];
        return r;
    }
    if (step == 1) {
        size_t o = jn_utf8_offset(v->u.str.s, v->u.str.len, (size_t)start);
        size_t e = jn_utf8_offset(v->u.str.s, v->u.str.len, (size_t)(start + cnt));
        return jn_str(c, v->u.str.s + o, e - o);
    }
    /* each code point's byte offset, once: s[::-1] of a long message stays linear */
    size_t *at = jn_alloc(&c->arena, ((size_t)n + 1) * sizeof *at), k0 = 0;
    if (!at) return jn_fail(c, TD_ENOMEM, line, "out of memory");
    for (size_t o = 0; o < v->u.str.len; o++)
        if (((unsigned char)v->u.str.s[o] & 0xC0) != 0x80) at[k0++] = o;
    at[k0] = v->u.str.len;
    jn_buf buf = {0};
    for (int64_t k = 0; k < cnt; k++) {
        size_t i = (size_t)(start + k * step);
        if (jn_buf_put(c, &buf, v->u.str.s + at[i], at[i + 1] - at[i])) {
            free(buf.buf);
            return NULL;
        }
    }
    jv *r = jn_str(c, buf.buf ? buf.buf : "", buf.len);
    free(buf.buf);
    return r;
}

jv *jn_getitem(jn_ctx *c, jv *v, jv *key, int line)
{
    switch (v->kind) {
    case JV_UNDEF:
        return jn_fail(c, TD_EINVAL, line, "'%s' is undefined (indexed)",
                       v->u.undef ? v->u.undef : "value");
    case JV_DICT: {
        jv *r = jn_dict_get(v, key);
        if (r) return r;
        break;
    }
    case JV_LIST:
    case JV_STR:
        if (v->kind == JV_LIST && v->u.list.gen) break; /* not subscriptable */
        if (key->kind == JV_INT || key->kind == JV_BOOL) {
            int64_t i = key->kind == JV_INT ? key->u.i : key->u.b;
            int64_t n = v->kind == JV_LIST ? (int64_t)v->u.list.n
                                           : (int64_t)jn_utf8_count(v->u.str.s, v->u.str.len);
            if (i < 0) i += n;
            if (i < 0 || i >= n) return jn_undef_named(c, "item");
            if (v->kind == JV_LIST) return v->u.list.items[i];
            size_t o = jn_utf8_offset(v->u.str.s, v->u.str.len, (size_t)i);
            size_t e = jn_utf8_offset(v->u.str.s, v->u.str.len, (size_t)i + 1);
            return jn_str(c, v->u.str.s + o, e - o);
        }
        break;
    default:
        break;
    }
    /* jinja2 falls back to the attribute of that name */
    if (key->kind == JV_STR && v->kind != JV_DICT) return jn_getattr(c, v, key->u.str.s, line);
    return jn_undef_named(c, key->kind == JV_STR ? key->u.str.s : "item");
}

jv *jn_iterate(jn_ctx *c, jv *v, int line)
{
    switch (v->kind) {
    case JV_UNDEF:
        return jn_list(c, 0);
    case JV_LIST:
        return v;
    case JV_DICT: {
        jv *r = jn_list(c, v->u.dict->n);
        for (size_t i = 0; r && i < v->u.dict->n; i++)
            r->u.list.items[i] = v->u.dict->keys[i];
        return r;
    }
    case JV_STR: {
        size_t n = jn_utf8_count(v->u.str.s, v->u.str.len), o = 0;
        jv *r = jn_list(c, n);
        for (size_t i = 0; r && i < n; i++) {
            size_t e = o + 1;
            while (e < v->u.str.len && ((unsigned char)v->u.str.s[e] & 0xC0) == 0x80)
                e++;
            if (!(r->u.list.items[i] = jn_str(c, v->u.str.s + o, e - o))) return NULL;
            o = e;
        }
        return r;
    }
    default:
        return jn_fail(c, TD_EINVAL, line, "'%s' object is not iterable", jn_type_name(v));
    }
}

/* ---- operators ---- */

static bool is_intlike(const jv *v)
{
    return v->kind == JV_INT || v->kind == JV_BOOL;
}

static int64_t ival(const jv *v)
{
    return v->kind == JV_INT ? v->u.i : v->u.b;
}

static bool is_number(const jv *v)
{
    return is_intlike(v) || v->kind == JV_FLOAT;
}

static double fval(const jv *v)
{
    return v->kind == JV_FLOAT ? v->u.f : (double)ival(v);
}

static const char *op_text(jn_op op)
{
    static const char *const t[] = {"+",  "-",  "*", "/",  "//", "%",  "**", "~",
                                    "==", "!=", "<", "<=", ">",  ">=", "in", "not in"};
    return t[op];
}

static jv *type_error(jn_ctx *c, jn_op op, const jv *a, const jv *b, int line)
{
    if (a->kind == JV_UNDEF || b->kind == JV_UNDEF) {
        const jv *u = a->kind == JV_UNDEF ? a : b;
        return jn_fail(c, TD_EINVAL, line, "'%s' is undefined (an operand of '%s')",
                       u->u.undef ? u->u.undef : "value", op_text(op));
    }
    return jn_fail(c, TD_EINVAL, line, "unsupported operand types for %s: '%s' and '%s'",
                   op_text(op), jn_type_name(a), jn_type_name(b));
}

static jv *concat(jn_ctx *c, jv *a, jv *b)
{
    jn_buf buf = {0};
    jv *r = NULL;
    if (!jn_write_str(c, &buf, a) && !jn_write_str(c, &buf, b))
        r = jn_str(c, buf.buf ? buf.buf : "", buf.len);
    free(buf.buf);
    return r;
}

static jv *repeat(jn_ctx *c, jv *seq, int64_t n, int line)
{
    if (n < 0) n = 0;
    size_t unit = seq->kind == JV_STR ? seq->u.str.len : seq->u.list.n;
    if (unit && (uint64_t)n > c->max_output / unit)
        return jn_fail(c, TD_ERANGE, line, "a repetition longer than the output limit");
    if (seq->kind == JV_LIST) {
        jv *r = jn_list(c, unit * (size_t)n);
        for (size_t i = 0; r && i < unit * (size_t)n; i++)
            r->u.list.items[i] = seq->u.list.items[i % unit];
        return r;
    }
    char *s = jn_alloc(&c->arena, unit * (size_t)n + 1);
    if (!s) return jn_fail(c, TD_ENOMEM, line, "out of memory");
    for (int64_t i = 0; i < n; i++)
        memcpy(s + (size_t)i * unit, seq->u.str.s, unit);
    jv *r = jn_str(c, "", 0);
    if (r) {
        r->u.str.s = s;
        r->u.str.len = unit * (size_t)n;
    }
    return r;
}

static jv *arith(jn_ctx *c, jn_op op, jv *a, jv *b, int line)
{
    if (op == OP_CONCAT) return concat(c, a, b);
    if (op == OP_ADD && a->kind == b->kind && (a->kind == JV_STR || a->kind == JV_LIST)) {
        if (a->kind == JV_STR && (a->u.str.markup || b->u.str.markup)) {
            /* Markup + str escapes the str (markupsafe), either way round */
            jv *x = a->u.str.markup ? a : jn_html_escape(c, a);
            jv *y = b->u.str.markup ? b : jn_html_escape(c, b);
            jv *r = x && y ? concat(c, x, y) : NULL;
            if (r) r->u.str.markup = true;
            return r;
        }
        if (a->kind == JV_STR) return concat(c, a, b);
        if (a->u.list.gen || b->u.list.gen) return type_error(c, op, a, b, line);
        jv *r = jn_list(c, a->u.list.n + b->u.list.n);
        for (size_t i = 0; r && i < r->u.list.n; i++)
            r->u.list.items[i] =
                i < a->u.list.n ? a->u.list.items[i] : b->u.list.items[i - a->u.list.n];
        return r;
    }
    if (op == OP_MUL && (a->kind == JV_STR || a->kind == JV_LIST) && is_intlike(b))
        return repeat(c, a, ival(b), line);
    if (op == OP_MUL && (b->kind == JV_STR || b->kind == JV_LIST) && is_intlike(a))
        return repeat(c, b, ival(a), line);
    if (op == OP_MOD && a->kind == JV_STR)
        return jn_fail(c, TD_EUNSUPP, line,
                       "printf-style formatting ('...' %% x) is not supported");
    if (!is_number(a) || !is_number(b)) return type_error(c, op, a, b, line);
    bool ints = is_intlike(a) && is_intlike(b);
    int64_t x = ints ? ival(a) : 0, y = ints ? ival(b) : 0, r;
    double fx = fval(a), fy = fval(b);
    if ((op == OP_DIV || op == OP_FLOORDIV || op == OP_MOD) && fy == 0)
        return jn_fail(c, TD_EINVAL, line, "division by zero");
    switch (op) {
    case OP_ADD:
        return ints && !__builtin_add_overflow(x, y, &r) ? jn_int(c, r) : jn_float(c, fx + fy);
    case OP_SUB:
        return ints && !__builtin_sub_overflow(x, y, &r) ? jn_int(c, r) : jn_float(c, fx - fy);
    case OP_MUL:
        return ints && !__builtin_mul_overflow(x, y, &r) ? jn_int(c, r) : jn_float(c, fx * fy);
    case OP_DIV:
        return jn_float(c, fx / fy);
    case OP_FLOORDIV:
        if (ints) return jn_int(c, x / y - ((x % y != 0) && ((x < 0) != (y < 0))));
        return jn_float(c, floor(fx / fy));
    case OP_MOD:
        if (ints) {
            int64_t m = x % y;
            return jn_int(c, m && ((m < 0) != (y < 0)) ? m + y : m);
        } else {
            double m = fmod(fx, fy);
            return jn_float(c, m && ((m < 0) != (fy < 0)) ? m + fy : m);
        }
    case OP_POW:
        if (ints && y >= 0) {
            int64_t p = 1;
            bool over = false;
            for (int64_t k = 0; k < y && !over; k++)
                over = __builtin_mul_overflow(p, x, &p);
            if (!over) return jn_int(c, p);
        }
        return jn_float(c, pow(fx, fy));
    default:
        return type_error(c, op, a, b, line);
    }
}

/* needle in hay: a substring, a list's item, a dict's key. */
static int contains(jn_ctx *c, jv *hay, jv *needle, int line)
{
    switch (hay->kind) {
    case JV_STR:
        if (needle->kind != JV_STR) {
            jn_fail(c, TD_EINVAL, line, "'in <string>' requires string as left operand, not %s",
                    jn_type_name(needle));
            return -1;
        }
        if (!needle->u.str.len) return 1;
        for (size_t i = 0; i + needle->u.str.len <= hay->u.str.len; i++)
            if (!memcmp(hay->u.str.s + i, needle->u.str.s, needle->u.str.len)) return 1;
        return 0;
    case JV_LIST:
        for (size_t i = 0; i < hay->u.list.n; i++)
            if (jn_equal(hay->u.list.items[i], needle)) return 1;
        return 0;
    case JV_DICT:
    case JV_NS:
        return jn_dict_get(hay, needle) != NULL;
    case JV_UNDEF:
        return 0;
    default:
        jn_fail(c, TD_EINVAL, line, "argument of type '%s' is not iterable", jn_type_name(hay));
        return -1;
    }
}

static jv *compare_chain(jn_ctx *c, jn_scope *s, const jn_node *x)
{
    jv *a = eval(c, s, x->kids[0]);
    for (size_t i = 1; a && i < x->n; i++) {
        jv *b = eval(c, s, x->kids[i]);
        if (!b) return NULL;
        jn_op op = x->ops[i - 1];
        int r;
        if (op == OP_EQ || op == OP_NE) {
            r = jn_equal(a, b) == (op == OP_EQ);
        } else if (op == OP_IN || op == OP_NOTIN) {
            if ((r = contains(c, b, a, x->line)) < 0) return NULL;
            r = r == (op == OP_IN);
        } else {
            bool ok;
            int k = jn_compare(a, b, &ok);
            if (!ok)
                return jn_fail(c, TD_EINVAL, x->line, "'%s' not supported between '%s' and '%s'",
                               op_text(op), jn_type_name(a), jn_type_name(b));
            r = op == OP_LT ? k < 0 : op == OP_LE ? k <= 0 : op == OP_GT ? k > 0 : k >= 0;
        }
        if (!r) return JN_BOOL(false);
        a = b;
    }
    return a ? JN_BOOL(true) : NULL;
}

/* ---- calls ---- */

jv *jn_arg(const jn_args *a, size_t i, const char *name)
{
    for (size_t k = 0; name && k < a->n_kv; k++)
        if (!strcmp(a->names[k], name)) return a->kv[k];
    return i < a->n_pos ? a->pos[i] : NULL;
}

static int eval_args(jn_ctx *c, jn_scope *s, const jn_node *x, size_t skip, jn_args *a)
{
    size_t n_pos = x->n - x->n_kw;
    *a = (jn_args){0};
    a->pos = jn_alloc(&c->arena, (x->n + 1) * sizeof *a->pos);
    if (!a->pos) return jn_fail(c, TD_ENOMEM, x->line, "out of memory"), -1;
    (void)skip;
    for (size_t i = 0; i < x->n; i++)
        if (!(a->pos[i] = eval(c, s, x->kids[i]))) return -1;
    a->n_pos = n_pos;
    a->kv = a->pos + n_pos;
    a->names = x->kw;
    a->n_kv = x->n_kw;
    return 0;
}

static jv *call_macro(jn_ctx *c, jv *fn, const jn_args *a, int line)
{
    const jn_node *m = fn->u.fn.macro;
    jn_scope *s = scope_new(c, fn->u.fn.closure);
    if (!s) return NULL;
    if (a->n_pos > m->n_names && !m->negate)
        return jn_fail(c, TD_EINVAL, line, "macro '%s' takes not more than %zu argument(s)",
                       fn->u.fn.name, m->n_names);
    jv *kwargs = jn_dict_new(c);
    if (!kwargs) return NULL;
    for (size_t i = 0; i < m->n_names; i++) {
        jv *v = i < a->n_pos ? a->pos[i] : NULL;
        for (size_t k = 0; k < a->n_kv; k++)
            if (!strcmp(a->names[k], m->names[i])) v = a->kv[k];
        if (!v) v = m->defaults[i] ? eval(c, s, m->defaults[i]) : jn_undef_named(c, m->names[i]);
        if (!v || assign(c, s, m->names[i], v)) return NULL;
    }
    for (size_t k = 0; k < a->n_kv; k++) {
        bool param = false;
        for (size_t i = 0; i < m->n_names && !param; i++)
            param = !strcmp(a->names[k], m->names[i]);
        if (!param && !m->kwargs)
            return jn_fail(c, TD_EINVAL, line, "macro '%s' takes no keyword argument '%s'",
                           fn->u.fn.name, a->names[k]);
        if (!param) {
            jv *key = jn_cstr(c, a->names[k]);
            if (!key || jn_dict_set(c, kwargs, key, a->kv[k])) return NULL;
        }
    }
    size_t extra = a->n_pos > m->n_names ? a->n_pos - m->n_names : 0;
    jv *varargs = jn_list(c, extra);
    for (size_t i = 0; varargs && i < extra; i++)
        varargs->u.list.items[i] = a->pos[m->n_names + i];
    if (varargs) varargs->u.list.tuple = true;
    if (!varargs || assign(c, s, "varargs", varargs) || assign(c, s, "kwargs", kwargs)) return NULL;
    if (fn->u.fn.caller && assign(c, s, "caller", fn->u.fn.caller)) return NULL;
    jn_buf out = {0};
    int rc = render(c, s, m->body, &out);
    jv *r = rc == R_ERR ? NULL : jn_str(c, out.buf ? out.buf : "", out.len);
    free(out.buf);
    return r;
}

jv *jn_call(jn_ctx *c, jv *fn, const jn_args *a, int line)
{
    if (fn->kind == JV_UNDEF)
        return jn_fail(c, TD_EINVAL, line, "'%s' is undefined (called)",
                       fn->u.undef ? fn->u.undef : "value");
    if (fn->kind != JV_FUNC)
        return jn_fail(c, TD_EINVAL, line, "'%s' object is not callable", jn_type_name(fn));
    if (!jn_count_step(c, line)) return NULL;
    if (c->depth >= JN_MAX_DEPTH)
        return jn_fail(c, TD_ERANGE, line, "calls nested deeper than %d", JN_MAX_DEPTH);
    c->depth++;
    jv *r =
        fn->u.fn.native ? fn->u.fn.native(c, fn->u.fn.self, a, line) : call_macro(c, fn, a, line);
    c->depth--;
    return r;
}

/* A filter applied to what is below it: an inner filter, an expression, or (NULL, the
 * bottom of a filter block's or block set's chain) the body's text v. */
static jv *filter_chain(jn_ctx *c, jn_scope *s, const jn_node *f, jv *v)
{
    jv *in = !f->a ? v : f->a->kind == N_FILTER ? filter_chain(c, s, f->a, v) : eval(c, s, f->a);
    jn_args a;
    if (!in || eval_args(c, s, f, 0, &a)) return NULL;
    return jn_apply_filter(c, f->name, in, &a, f->line);
}

/* ---- expressions ---- */

static jv *eval_collection(jn_ctx *c, jn_scope *s, const jn_node *x)
{
    if (x->kind == N_DICT) {
        jv *d = jn_dict_new(c);
        for (size_t i = 0; d && i + 1 < x->n; i += 2) {
            jv *k = eval(c, s, x->kids[i]), *v = k ? eval(c, s, x->kids[i + 1]) : NULL;
            if (!v || jn_dict_set(c, d, k, v)) return NULL;
        }
        return d;
    }
    jv *l = jn_list(c, x->n);
    for (size_t i = 0; l && i < x->n; i++)
        if (!(l->u.list.items[i] = eval(c, s, x->kids[i]))) return NULL;
    if (l) l->u.list.tuple = x->kind == N_TUPLE;
    return l;
}

static jv *eval_test(jn_ctx *c, jn_scope *s, const jn_node *x)
{
    jv *v = eval(c, s, x->a);
    jn_args a;
    if (!v || eval_args(c, s, x, 0, &a)) return NULL;
    int r = jn_apply_test(c, x->name, v, &a, x->line);
    return r < 0 ? NULL : JN_BOOL((r == 1) != x->negate);
}

static jv *eval_call(jn_ctx *c, jn_scope *s, const jn_node *x, jv *caller)
{
    jv *fn = eval(c, s, x->a);
    jn_args a;
    if (!fn || eval_args(c, s, x, 0, &a)) return NULL;
    if (caller) {
        if (fn->kind != JV_FUNC || fn->u.fn.native)
            return jn_fail(c, TD_EINVAL, x->line, "a call block must call a macro");
        jv *bound = jn_alloc(&c->arena, sizeof *bound);
        if (!bound) return jn_fail(c, TD_ENOMEM, x->line, "out of memory");
        *bound = *fn;
        bound->u.fn.caller = caller;
        fn = bound;
    }
    return jn_call(c, fn, &a, x->line);
}

static jv *eval(jn_ctx *c, jn_scope *s, const jn_node *x)
{
    jv *a, *b;
    if (c->rc) return NULL;
    switch (x->kind) {
    case N_LIT:
        return x->lit;
    case N_NAME:
        a = lookup(s, x->name);
        return a ? a : jn_undef_named(c, x->name);
    case N_ATTR:
        return (a = eval(c, s, x->a)) ? jn_getattr(c, a, x->name, x->line) : NULL;
    case N_ITEM:
        a = eval(c, s, x->a);
        b = a ? eval(c, s, x->b) : NULL;
        return b ? jn_getitem(c, a, b, x->line) : NULL;
    case N_SLICE: {
        jv *p[3] = {0};
        const jn_node *parts[3] = {x->b, x->c, x->d};
        if (!(a = eval(c, s, x->a))) return NULL;
        for (int k = 0; k < 3; k++)
            if (parts[k] && !(p[k] = eval(c, s, parts[k]))) return NULL;
        return slice(c, a, p[0], p[1], p[2], x->line);
    }
    case N_CALL:
        return eval_call(c, s, x, NULL);
    case N_FILTER:
        return filter_chain(c, s, x, NULL);
    case N_TEST:
        return eval_test(c, s, x);
    case N_BIN:
        a = eval(c, s, x->a);
        b = a ? eval(c, s, x->b) : NULL;
        return b ? arith(c, x->op, a, b, x->line) : NULL;
    case N_NEG:
    case N_POS:
        if (!(a = eval(c, s, x->a))) return NULL;
        if (!is_number(a))
            return jn_fail(c, TD_EINVAL, x->line, "bad operand type for unary %c: '%s'",
                           x->kind == N_NEG ? '-' : '+', jn_type_name(a));
        if (x->kind == N_POS) return a->kind == JV_BOOL ? jn_int(c, a->u.b) : a;
        return a->kind == JV_FLOAT ? jn_float(c, -a->u.f) : jn_int(c, -ival(a));
    case N_NOT:
        return (a = eval(c, s, x->a)) ? JN_BOOL(!jn_truthy(a)) : NULL;
    case N_AND:
        if (!(a = eval(c, s, x->a))) return NULL;
        return jn_truthy(a) ? eval(c, s, x->b) : a;
    case N_OR:
        if (!(a = eval(c, s, x->a))) return NULL;
        return jn_truthy(a) ? a : eval(c, s, x->b);
    case N_CMP:
        return compare_chain(c, s, x);
    case N_COND:
        if (!(a = eval(c, s, x->a))) return NULL;
        if (jn_truthy(a)) return eval(c, s, x->b);
        return x->c ? eval(c, s, x->c) : jn_undef_named(c, NULL);
    case N_LIST:
    case N_TUPLE:
    case N_DICT:
        return eval_collection(c, s, x);
    default:
        return jn_fail(c, TD_EINVAL, x->line, "a statement where an expression was expected");
    }
}

/* ---- statements ---- */

static int render_for(jn_ctx *c, jn_scope *s, const jn_node *x, jn_buf *out)
{
    jv *it = eval(c, s, x->a), *items = it ? jn_iterate(c, it, x->line) : NULL;
    if (!items) return R_ERR;
    jn_scope *ls = scope_new(c, s);
    if (!ls) return R_ERR;
    if (x->b) { /* the loop's filter: loop.* counts the items it keeps */
        jv *kept = jn_list(c, items->u.list.n);
        if (!kept) return R_ERR;
        size_t n = 0;
        for (size_t i = 0; i < items->u.list.n; i++) {
            if (!jn_count_step(c, x->line) || assign_targets(c, ls, x, items->u.list.items[i]))
                return R_ERR;
            jv *keep = eval(c, ls, x->b);
            if (!keep) return R_ERR;
            if (jn_truthy(keep)) kept->u.list.items[n++] = items->u.list.items[i];
        }
        kept->u.list.n = n;
        items = kept;
    }
    jn_loop *l = jn_alloc(&c->arena, sizeof *l);
    jv *loop = l ? jn_alloc(&c->arena, sizeof *loop) : NULL;
    if (!loop) return jn_fail(c, TD_ENOMEM, x->line, "out of memory"), R_ERR;
    *l = (jn_loop){.length = items->u.list.n, .list = items};
    *loop = (jv){.kind = JV_LOOP, .u.loop = l};
    if (assign(c, ls, "loop", loop)) return R_ERR;
    for (size_t i = 0; i < items->u.list.n; i++) {
        l->index0 = i;
        if (!jn_count_step(c, x->line) || assign_targets(c, ls, x, items->u.list.items[i]))
            return R_ERR;
        int rc = render(c, ls, x->body, out);
        if (rc == R_ERR) return R_ERR;
        if (rc == R_BREAK) break;
    }
    if (!items->u.list.n && x->else_body) return render(c, s, x->else_body, out);
    return R_OK;
}

static int render_set(jn_ctx *c, jn_scope *s, const jn_node *x, jn_buf *out)
{
    (void)out;
    jv *v = eval(c, s, x->a);
    if (!v) return R_ERR;
    if (!x->attr) return assign_targets(c, s, x, v) ? R_ERR : R_OK;
    jv *ns = lookup(s, x->names[0]);
    if (!ns || ns->kind != JV_NS)
        return jn_fail(c, TD_EINVAL, x->line, "cannot assign attribute on non-namespace object"),
               R_ERR;
    if (jn_ns_check_name(c, x->attr, x->line)) return R_ERR;
    jv *k = jn_cstr(c, x->attr);
    return k && !jn_dict_set(c, ns, k, v) ? R_OK : R_ERR;
}

/* The body rendered alone, as a string value (block set, filter block). */
static jv *capture(jn_ctx *c, jn_scope *s, const jn_node *body)
{
    jn_buf b = {0};
    jv *r = render(c, s, body, &b) == R_ERR ? NULL : jn_str(c, b.buf ? b.buf : "", b.len);
    free(b.buf);
    return r;
}

static jv *macro_value(jn_ctx *c, jn_scope *s, const jn_node *x, const char *name)
{
    jv *fn = jn_func(c, name, NULL, NULL);
    if (!fn) return NULL;
    fn->u.fn.macro = x;
    fn->u.fn.closure = s;
    return fn;
}

static int render(jn_ctx *c, jn_scope *s, const jn_node *x, jn_buf *out)
{
    jv *v;
    if (c->rc) return R_ERR;
    switch (x->kind) {
    case S_BODY:
        for (size_t i = 0; i < x->n; i++) {
            int rc = render(c, s, x->kids[i], out);
            if (rc) return rc;
        }
        return R_OK;
    case S_TEXT:
        return jn_buf_put(c, out, x->lit->u.str.s, x->lit->u.str.len) ? R_ERR : R_OK;
    case S_OUT:
        if (!(v = eval(c, s, x->a))) return R_ERR;
        return jn_write_str(c, out, v) ? R_ERR : R_OK;
    case S_IF:
        for (size_t i = 0; i + 1 < x->n; i += 2) {
            if (!(v = eval(c, s, x->kids[i]))) return R_ERR;
            if (jn_truthy(v)) return render(c, s, x->kids[i + 1], out);
        }
        return x->n % 2 ? render(c, s, x->kids[x->n - 1], out) : R_OK;
    case S_FOR:
        return render_for(c, s, x, out);
    case S_SET:
        return render_set(c, s, x, out);
    case S_SETBLK:
        if (!(v = capture(c, s, x->body)) || (x->b && !(v = filter_chain(c, s, x->b, v))))
            return R_ERR;
        return assign(c, s, x->name, v) ? R_ERR : R_OK;
    case S_FILTBLK:
        if (!(v = capture(c, s, x->body)) || !(v = filter_chain(c, s, x->b, v))) return R_ERR;
        return jn_write_str(c, out, v) ? R_ERR : R_OK;
    case S_MACRO:
        if (!(v = macro_value(c, s, x, x->name))) return R_ERR;
        return assign(c, s, x->name, v) ? R_ERR : R_OK;
    case S_CALLBLK: {
        jv *caller = macro_value(c, s, x, "caller");
        if (!caller || !(v = eval_call(c, s, x->a, caller))) return R_ERR;
        return jn_write_str(c, out, v) ? R_ERR : R_OK;
    }
    case S_BREAK:
        return R_BREAK;
    case S_CONTINUE:
        return R_CONTINUE;
    default:
        return jn_fail(c, TD_EINVAL, x->line, "an expression where a statement was expected"),
               R_ERR;
    }
}

int jn_render(const jn_template *t, const json_t *vars, const jn_opts *opts, char **out,
              size_t *len, jn_error *err)
{
    *out = NULL;
    if (len) *len = 0;
    jn_error scratch;
    jn_ctx c = {.err = err ? err : &scratch};
    c.max_output = opts && opts->max_output ? opts->max_output : (size_t)64 << 20;
    c.now = opts && opts->now ? opts->now : (int64_t)time(NULL);
    /* values beside the output: the conversation, copies, intermediate strings */
    c.arena.limit = c.max_output * 4 + ((size_t)64 << 20);
    if (c.err) *c.err = (jn_error){0};
    if (!t || !json_is_object(vars)) {
        jn_fail(&c, TD_EINVAL, 0, t ? "the variables must be a JSON object" : "no template");
        return c.rc;
    }
    jn_buf b = {0};
    jn_scope *g = scope_new(&c, NULL), *top = g ? scope_new(&c, g) : NULL;
    jv *v = top ? jn_from_json(&c, vars) : NULL;
    if (v && !jn_add_globals(&c, g->vars)) {
        top->vars = v;
        c.globals = g;
        if (render(&c, top, t->root, &b) == R_OK && !b.buf) jn_buf_put(&c, &b, "", 0);
    }
    jn_arena_free(&c.arena);
    if (c.rc) {
        free(b.buf);
        return c.rc;
    }
    *out = b.buf;
    if (len) *len = b.len;
    return 0;
}
