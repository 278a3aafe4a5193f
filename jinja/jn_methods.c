/* jn_methods.c: what a template may call on a value (str, dict and list methods, loop.cycle)
 * and the global functions (range, dict, namespace, raise_exception, strftime_now), with
 * Python's semantics; the sandbox's refusals for methods that would change a value. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "jn_int.h"
#include "td_err.h"

/* ---- string helpers (shared with the filters) ---- */

/* Python's str.isspace for one code point. */
static bool py_space(uint32_t cp)
{
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
           cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
           cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

static bool in_set(uint32_t cp, const jv *chars)
{
    if (!chars) return py_space(cp);
    for (size_t i = 0; i < chars->u.str.len;)
        if (jn_utf8_next(chars->u.str.s, chars->u.str.len, &i) == cp) return true;
    return false;
}

/* str.strip / lstrip / rstrip (which: 1 left, 2 right, 3 both); chars NULL: whitespace. */
jv *jn_str_strip(jn_ctx *c, const jv *v, const jv *chars, int which)
{
    const char *s = v->u.str.s;
    size_t n = v->u.str.len, a = 0, b = n;
    if (which & 1)
        while (a < n) {
            size_t i = a;
            if (!in_set(jn_utf8_next(s, n, &i), chars)) break;
            a = i;
        }
    if (which & 2)
        while (b > a) {
            size_t st = b - 1;
            while (st > a && ((unsigned char)s[st] & 0xC0) == 0x80)
                st--;
            size_t i = st;
            if (!in_set(jn_utf8_next(s, n, &i), chars)) break;
            b = st;
        }
    return a == 0 && b == n ? (jv *)v : jn_str(c, s + a, b - a);
}

/* ASCII case mapping (mode: 'u' upper, 'l' lower, 'c' capitalize, 't' title). Non-ASCII
 * letters are left as they are: a template's roles and markers are ASCII. */
jv *jn_str_case(jn_ctx *c, const jv *v, char mode)
{
    jv *r = jn_str(c, v->u.str.s, v->u.str.len);
    if (!r) return NULL;
    char *s = (char *)r->u.str.s;
    bool prev_letter = false;
    for (size_t i = 0; i < r->u.str.len; i++) {
        unsigned char ch = (unsigned char)s[i];
        bool up = mode == 'u' || (mode == 'c' && i == 0) || (mode == 't' && !prev_letter);
        if (ch < 0x80) s[i] = (char)(up ? toupper(ch) : tolower(ch));
        prev_letter = isalpha(ch) || ch >= 0x80;
    }
    return r;
}

/* ---- str methods ---- */

static jv *bad_arg(jn_ctx *c, int line, const char *fn, const char *what)
{
    return jn_fail(c, TD_EINVAL, line, "%s: %s", fn, what);
}

static const jv *opt_str(jn_ctx *c, const jn_args *a, size_t i, const char *name, const char *fn,
                         int line, bool *bad)
{
    jv *v = jn_arg(a, i, name);
    *bad = false;
    if (!v || v->kind == JV_NONE) return NULL;
    if (v->kind != JV_STR) {
        *bad = true;
        bad_arg(c, line, fn, "expected a string argument");
    }
    return v;
}

static jv *m_strip(jn_ctx *c, jv *self, const jn_args *a, int line, int which, const char *fn)
{
    bool bad;
    const jv *chars = opt_str(c, a, 0, "chars", fn, line, &bad);
    return bad ? NULL : jn_str_strip(c, self, chars, which);
}

static jv *m_strip3(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    return m_strip(c, self, a, line, 3, "strip");
}
static jv *m_lstrip(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    return m_strip(c, self, a, line, 1, "lstrip");
}
static jv *m_rstrip(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    return m_strip(c, self, a, line, 2, "rstrip");
}

static int list_append(jn_ctx *c, jv *l, size_t *cap, jv *item)
{
    if (l->u.list.n == *cap) {
        size_t nc = *cap ? 2 * *cap : 8;
        jv **ni = jn_alloc(&c->arena, nc * sizeof *ni);
        if (!ni) return jn_fail(c, TD_ENOMEM, 0, "out of memory"), -1;
        if (l->u.list.n) memcpy(ni, l->u.list.items, l->u.list.n * sizeof *ni);
        l->u.list.items = ni;
        *cap = nc;
    }
    l->u.list.items[l->u.list.n++] = item;
    return 0;
}

/* str.split / rsplit; sep NULL: runs of whitespace. */
static jv *split(jn_ctx *c, jv *self, const jn_args *a, int line, bool right)
{
    bool bad;
    const char *fn = right ? "rsplit" : "split";
    const jv *sep = opt_str(c, a, 0, "sep", fn, line, &bad);
    jv *mx = jn_arg(a, 1, "maxsplit");
    if (bad) return NULL;
    if (mx && mx->kind != JV_INT) return bad_arg(c, line, fn, "maxsplit must be an integer");
    int64_t max = mx ? mx->u.i : -1;
    if (sep && !sep->u.str.len) return bad_arg(c, line, fn, "empty separator");
    const char *s = self->u.str.s;
    size_t n = self->u.str.len, cap = 0;
    jv *out = jn_list(c, 0), *parts[2];
    if (!out) return NULL;
    /* collected left to right; rsplit collects its pieces from the right, then reverses */
    size_t lo = 0, hi = n;
    for (;;) {
        if (!sep) {
            while (lo < hi && isspace((unsigned char)(right ? s[hi - 1] : s[lo])))
                right ? hi-- : lo++;
            if (lo == hi) break;
        }
        if (max >= 0 && (int64_t)out->u.list.n >= max) {
            /* the rest as it is (Python keeps its far end's whitespace) */
            if (list_append(c, out, &cap, jn_str(c, s + lo, hi - lo))) return NULL;
            break;
        }
        size_t at = SIZE_MAX, sl = sep ? sep->u.str.len : 1;
        if (!right) {
            for (size_t i = lo; i + sl <= hi && at == SIZE_MAX; i++)
                if (sep ? !memcmp(s + i, sep->u.str.s, sl) : isspace((unsigned char)s[i])) at = i;
        } else {
            for (size_t i = hi; i >= lo + sl && at == SIZE_MAX; i--)
                if (sep ? !memcmp(s + i - sl, sep->u.str.s, sl) : isspace((unsigned char)s[i - 1]))
                    at = i - sl;
        }
        if (at == SIZE_MAX) {
            if (list_append(c, out, &cap, jn_str(c, s + lo, hi - lo))) return NULL;
            break;
        }
        parts[0] = right ? jn_str(c, s + at + sl, hi - at - sl) : jn_str(c, s + lo, at - lo);
        if (!parts[0] || list_append(c, out, &cap, parts[0])) return NULL;
        if (right)
            hi = at;
        else
            lo = at + sl;
    }
    if (right)
        for (size_t i = 0; i < out->u.list.n / 2; i++) {
            jv *t = out->u.list.items[i];
            out->u.list.items[i] = out->u.list.items[out->u.list.n - 1 - i];
            out->u.list.items[out->u.list.n - 1 - i] = t;
        }
    return out;
}

static jv *m_split(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    return split(c, self, a, line, false);
}
static jv *m_rsplit(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    return split(c, self, a, line, true);
}

static jv *m_splitlines(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    jv *keep = jn_arg(a, 0, "keepends");
    bool keepends = keep && jn_truthy(keep);
    const char *s = self->u.str.s;
    size_t n = self->u.str.len, start = 0, cap = 0;
    jv *out = jn_list(c, 0);
    (void)line;
    for (size_t i = 0; out && i < n;) {
        size_t j = i, e;
        uint32_t cp = jn_utf8_next(s, n, &j);
        bool nl = cp == '\n' || cp == '\r' || cp == 0x0B || cp == 0x0C ||
                  (cp >= 0x1C && cp <= 0x1E) || cp == 0x85 || cp == 0x2028 || cp == 0x2029;
        if (!nl) {
            i = j;
            continue;
        }
        e = j;
        if (cp == '\r' && j < n && s[j] == '\n') e = j + 1;
        if (list_append(c, out, &cap, jn_str(c, s + start, (keepends ? e : i) - start)))
            return NULL;
        i = start = e;
    }
    if (out && start < n && list_append(c, out, &cap, jn_str(c, s + start, n - start))) return NULL;
    return out;
}

/* startswith / endswith: a prefix or a tuple of them. */
static jv *affix(jn_ctx *c, jv *self, const jn_args *a, int line, bool end)
{
    jv *p = jn_arg(a, 0, NULL);
    if (!p) return bad_arg(c, line, end ? "endswith" : "startswith", "takes an argument");
    if (a->n_pos > 1) return jn_fail(c, TD_EUNSUPP, line, "startswith/endswith with start or end");
    jv one = *p, *list[1] = {&one};
    jv **items = p->kind == JV_LIST ? p->u.list.items : list;
    size_t n = p->kind == JV_LIST ? p->u.list.n : 1;
    for (size_t i = 0; i < n; i++) {
        jv *x = items[i];
        if (x->kind != JV_STR)
            return bad_arg(c, line, end ? "endswith" : "startswith",
                           "the argument must be str or a tuple of str");
        size_t k = x->u.str.len;
        if (k <= self->u.str.len &&
            !memcmp(self->u.str.s + (end ? self->u.str.len - k : 0), x->u.str.s, k))
            return JN_BOOL(true);
    }
    return JN_BOOL(false);
}

static jv *m_startswith(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    return affix(c, self, a, line, false);
}
static jv *m_endswith(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    return affix(c, self, a, line, true);
}

/* str.replace(old, new[, count]) (also the replace filter's). */
jv *jn_str_replace(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    jv *o = jn_arg(a, 0, "old"), *nw = jn_arg(a, 1, "new"), *cnt = jn_arg(a, 2, "count");
    if (!o || !nw) return bad_arg(c, line, "replace", "takes old and new");
    if (!(o = jn_to_str(c, o)) || !(nw = jn_to_str(c, nw))) return NULL;
    int64_t max = cnt && cnt->kind == JV_INT ? cnt->u.i : -1;
    jn_buf b = {0};
    const char *s = self->u.str.s;
    size_t n = self->u.str.len, ol = o->u.str.len, i = 0, run = 0;
    int64_t done = 0;
    int rc = 0;
    while (!rc && i <= n && (max < 0 || done < max)) {
        if (ol ? (i + ol <= n && !memcmp(s + i, o->u.str.s, ol)) : true) {
            rc = jn_buf_put(c, &b, s + run, i - run) ||
                 jn_buf_put(c, &b, nw->u.str.s, nw->u.str.len);
            done++;
            if (!ol) { /* '' matches between every character */
                if (i == n) {
                    run = n;
                    break;
                }
                size_t j = i;
                jn_utf8_next(s, n, &j);
                rc = rc || jn_buf_put(c, &b, s + i, j - i);
                run = i = j;
                continue;
            }
            run = i = i + ol;
        } else if (i < n) {
            i++;
        } else {
            break;
        }
    }
    if (!rc) rc = jn_buf_put(c, &b, s + run, n - run);
    jv *r = rc ? NULL : jn_str(c, b.buf ? b.buf : "", b.len);
    free(b.buf);
    return r;
}

static jv *m_upper(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)a, (void)line;
    return jn_str_case(c, self, 'u');
}
static jv *m_lower(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)a, (void)line;
    return jn_str_case(c, self, 'l');
}
static jv *m_title(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)a, (void)line;
    return jn_str_case(c, self, 't');
}
static jv *m_capitalize(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)a, (void)line;
    return jn_str_case(c, self, 'c');
}

/* str.find / rfind / count / index of a substring. */
static jv *m_search(jn_ctx *c, jv *self, const jn_args *a, int line, char mode)
{
    jv *sub = jn_arg(a, 0, NULL);
    if (!sub || sub->kind != JV_STR) return bad_arg(c, line, "find", "takes a string");
    if (a->n_pos > 1) return jn_fail(c, TD_EUNSUPP, line, "find/count with start or end");
    const char *s = self->u.str.s;
    size_t n = self->u.str.len, k = sub->u.str.len;
    int64_t count = 0, found = -1;
    for (size_t i = 0; i + k <= n; i++) {
        if (memcmp(s + i, sub->u.str.s, k)) continue;
        int64_t at = (int64_t)jn_utf8_count(s, i);
        if (mode == 'c') {
            count++;
            if (k) i += k - 1;
            continue;
        }
        found = at;
        if (mode != 'r') break;
    }
    if (mode == 'c') return jn_int(c, count);
    if (mode == 'i' && found < 0) return jn_fail(c, TD_EINVAL, line, "index: substring not found");
    return jn_int(c, found);
}

static jv *m_find(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    return m_search(c, self, a, line, 'f');
}
static jv *m_rfind(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    return m_search(c, self, a, line, 'r');
}
static jv *m_index(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    return m_search(c, self, a, line, 'i');
}
static jv *m_count(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    return m_search(c, self, a, line, 'c');
}

/* isdigit, isalpha, isalnum, isspace, islower, isupper (ASCII letters and digits). */
static jv *m_is(jn_ctx *c, jv *self, const char *name)
{
    const char *s = self->u.str.s;
    size_t n = self->u.str.len;
    (void)c;
    if (!n) return JN_BOOL(false);
    bool cased = false;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (!strcmp(name, "isdigit") && !isdigit(ch)) return JN_BOOL(false);
        if (!strcmp(name, "isalpha") && !isalpha(ch)) return JN_BOOL(false);
        if (!strcmp(name, "isalnum") && !isalnum(ch)) return JN_BOOL(false);
        if (!strcmp(name, "isspace") && !isspace(ch)) return JN_BOOL(false);
        if (!strcmp(name, "islower") && isupper(ch)) return JN_BOOL(false);
        if (!strcmp(name, "isupper") && islower(ch)) return JN_BOOL(false);
        cased |= isalpha(ch);
    }
    return JN_BOOL(strcmp(name, "islower") && strcmp(name, "isupper") ? true : cased);
}

static jv *m_isdigit(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)a, (void)line;
    return m_is(c, self, "isdigit");
}
static jv *m_isalpha(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)a, (void)line;
    return m_is(c, self, "isalpha");
}
static jv *m_isalnum(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)a, (void)line;
    return m_is(c, self, "isalnum");
}
static jv *m_isspace(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)a, (void)line;
    return m_is(c, self, "isspace");
}
static jv *m_islower(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)a, (void)line;
    return m_is(c, self, "islower");
}
static jv *m_isupper(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)a, (void)line;
    return m_is(c, self, "isupper");
}

static jv *m_join(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    jv *it = jn_arg(a, 0, NULL), *items = it ? jn_iterate(c, it, line) : NULL;
    if (!items) return it ? NULL : bad_arg(c, line, "join", "takes an iterable");
    jn_buf b = {0};
    jv *r = NULL;
    for (size_t i = 0; i < items->u.list.n; i++) {
        jv *x = items->u.list.items[i];
        if (x->kind != JV_STR) {
            jn_fail(c, TD_EINVAL, line, "join: sequence item %zu: expected str, %s found", i,
                    jn_type_name(x));
            goto out;
        }
        if ((i && jn_buf_put(c, &b, self->u.str.s, self->u.str.len)) ||
            jn_buf_put(c, &b, x->u.str.s, x->u.str.len))
            goto out;
    }
    r = jn_str(c, b.buf ? b.buf : "", b.len);
out:
    free(b.buf);
    return r;
}

/* removeprefix / removesuffix */
static jv *m_remove(jn_ctx *c, jv *self, const jn_args *a, int line, bool suffix)
{
    jv *x = jn_arg(a, 0, NULL);
    if (!x || x->kind != JV_STR) return bad_arg(c, line, "removeprefix", "takes a string");
    size_t k = x->u.str.len, n = self->u.str.len;
    if (k > n || memcmp(self->u.str.s + (suffix ? n - k : 0), x->u.str.s, k)) return self;
    return jn_str(c, self->u.str.s + (suffix ? 0 : k), n - k);
}
static jv *m_removeprefix(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    return m_remove(c, self, a, line, false);
}
static jv *m_removesuffix(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    return m_remove(c, self, a, line, true);
}

/* str.format: {} {0} {name} and {{ }}; a field with a conversion or a format spec is
 * refused rather than written without it. */
static jv *m_format(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    const char *s = self->u.str.s;
    size_t n = self->u.str.len, auto_i = 0;
    jn_buf b = {0};
    jv *r = NULL;
    for (size_t i = 0; i < n; i++) {
        if ((s[i] == '{' || s[i] == '}') && i + 1 < n && s[i + 1] == s[i]) {
            if (jn_buf_put(c, &b, s + i, 1)) goto out;
            i++;
            continue;
        }
        if (s[i] == '}') {
            jn_fail(c, TD_EINVAL, line, "format: single '}' encountered in format string");
            goto out;
        }
        if (s[i] != '{') {
            if (jn_buf_put(c, &b, s + i, 1)) goto out;
            continue;
        }
        const char *close = memchr(s + i, '}', n - i);
        if (!close) {
            jn_fail(c, TD_EINVAL, line, "format: single '{' encountered in format string");
            goto out;
        }
        size_t fl = (size_t)(close - (s + i)) - 1;
        char field[64];
        if (fl >= sizeof field || memchr(s + i + 1, ':', fl) || memchr(s + i + 1, '!', fl) ||
            memchr(s + i + 1, '.', fl) || memchr(s + i + 1, '[', fl)) {
            jn_fail(c, TD_EUNSUPP, line, "format: only {}, {N} and {name} fields are supported");
            goto out;
        }
        memcpy(field, s + i + 1, fl);
        field[fl] = '\0';
        jv *v;
        if (!fl)
            v = jn_arg(a, auto_i++, NULL);
        else if (isdigit((unsigned char)field[0]))
            v = jn_arg(a, (size_t)atoi(field), NULL);
        else
            v = jn_arg(a, SIZE_MAX, field);
        if (!v) {
            jn_fail(c, TD_EINVAL, line, "format: no argument for field '{%s}'", field);
            goto out;
        }
        if (jn_write_str(c, &b, v)) goto out;
        i += fl + 1;
    }
    r = jn_str(c, b.buf ? b.buf : "", b.len);
out:
    free(b.buf);
    return r;
}

/* ---- dict and list methods ---- */

static jv *m_get(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    jv *k = jn_arg(a, 0, NULL), *d = jn_arg(a, 1, NULL);
    if (!k) return bad_arg(c, line, "get", "takes a key");
    jv *v = jn_dict_get(self, k);
    return v ? v : d ? d : JN_NONE;
}

/* items(), keys(), values() */
static jv *dict_view(jn_ctx *c, jv *self, char which)
{
    jn_dict *d = self->u.dict;
    jv *r = jn_list(c, d->n);
    for (size_t i = 0; r && i < d->n; i++) {
        if (which == 'k') {
            r->u.list.items[i] = d->keys[i];
        } else if (which == 'v') {
            r->u.list.items[i] = d->vals[i];
        } else {
            jv *pair = jn_list(c, 2);
            if (!pair) return NULL;
            pair->u.list.items[0] = d->keys[i];
            pair->u.list.items[1] = d->vals[i];
            pair->u.list.tuple = true;
            r->u.list.items[i] = pair;
        }
    }
    return r;
}

jv *jn_dict_items(jn_ctx *c, jv *self)
{
    return dict_view(c, self, 'i');
}

static jv *m_items(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)a, (void)line;
    return dict_view(c, self, 'i');
}
static jv *m_keys(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)a, (void)line;
    return dict_view(c, self, 'k');
}
static jv *m_values(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)a, (void)line;
    return dict_view(c, self, 'v');
}

static jv *m_list_index(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    jv *x = jn_arg(a, 0, NULL);
    for (size_t i = 0; x && i < self->u.list.n; i++)
        if (jn_equal(self->u.list.items[i], x)) return jn_int(c, (int64_t)i);
    return jn_fail(c, TD_EINVAL, line, "list.index: the value is not in the list");
}

static jv *m_list_count(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    jv *x = jn_arg(a, 0, NULL);
    int64_t n = 0;
    (void)line;
    for (size_t i = 0; x && i < self->u.list.n; i++)
        n += jn_equal(self->u.list.items[i], x);
    return jn_int(c, n);
}

static jv *m_cycle(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    if (!a->n_pos) return bad_arg(c, line, "loop.cycle", "takes at least one value");
    return a->pos[self->u.loop->index0 % a->n_pos];
}

/* A method the sandbox refuses (it would change an immutable value): an error when called. */
static jv *m_unsafe(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)a;
    return jn_fail(c, TD_EINVAL, line,
                   "access to a method that changes a %s is unsafe (the template sandbox's "
                   "values are immutable)",
                   jn_type_name(self));
}

typedef struct {
    jv_kind kind;
    const char *name;
    jn_native fn;
} method;

static const method methods[] = {
    {JV_STR, "strip", m_strip3},
    {JV_STR, "lstrip", m_lstrip},
    {JV_STR, "rstrip", m_rstrip},
    {JV_STR, "split", m_split},
    {JV_STR, "rsplit", m_rsplit},
    {JV_STR, "splitlines", m_splitlines},
    {JV_STR, "startswith", m_startswith},
    {JV_STR, "endswith", m_endswith},
    {JV_STR, "replace", jn_str_replace},
    {JV_STR, "upper", m_upper},
    {JV_STR, "lower", m_lower},
    {JV_STR, "title", m_title},
    {JV_STR, "capitalize", m_capitalize},
    {JV_STR, "find", m_find},
    {JV_STR, "rfind", m_rfind},
    {JV_STR, "index", m_index},
    {JV_STR, "count", m_count},
    {JV_STR, "isdigit", m_isdigit},
    {JV_STR, "isalpha", m_isalpha},
    {JV_STR, "isalnum", m_isalnum},
    {JV_STR, "isspace", m_isspace},
    {JV_STR, "islower", m_islower},
    {JV_STR, "isupper", m_isupper},
    {JV_STR, "join", m_join},
    {JV_STR, "format", m_format},
    {JV_STR, "removeprefix", m_removeprefix},
    {JV_STR, "removesuffix", m_removesuffix},
    {JV_DICT, "get", m_get},
    {JV_DICT, "items", m_items},
    {JV_DICT, "keys", m_keys},
    {JV_DICT, "values", m_values},
    {JV_DICT, "pop", m_unsafe},
    {JV_DICT, "popitem", m_unsafe},
    {JV_DICT, "update", m_unsafe},
    {JV_DICT, "setdefault", m_unsafe},
    {JV_DICT, "clear", m_unsafe},
    {JV_LIST, "index", m_list_index},
    {JV_LIST, "count", m_list_count},
    {JV_LIST, "append", m_unsafe},
    {JV_LIST, "extend", m_unsafe},
    {JV_LIST, "insert", m_unsafe},
    {JV_LIST, "pop", m_unsafe},
    {JV_LIST, "remove", m_unsafe},
    {JV_LIST, "reverse", m_unsafe},
    {JV_LIST, "sort", m_unsafe},
    {JV_LIST, "clear", m_unsafe},
    {JV_LOOP, "cycle", m_cycle},
};

/* self.name as a bound method, or NULL (no error) when self's type has none of that name. */
jv *jn_method(jn_ctx *c, jv *self, const char *name, int line)
{
    (void)line;
    for (size_t i = 0; i < sizeof methods / sizeof *methods; i++)
        if (methods[i].kind == self->kind && !strcmp(methods[i].name, name))
            return jn_func(c, methods[i].name, methods[i].fn, self);
    return NULL;
}

/* ---- globals ---- */

static jv *g_range(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)self;
    int64_t v[3] = {0, 0, 1};
    if (!a->n_pos || a->n_pos > 3 || a->n_kv)
        return bad_arg(c, line, "range", "takes 1 to 3 integers");
    for (size_t i = 0; i < a->n_pos; i++) {
        if (a->pos[i]->kind != JV_INT && a->pos[i]->kind != JV_BOOL)
            return bad_arg(c, line, "range", "arguments must be integers");
        v[a->n_pos == 1 ? 1 : i] = a->pos[i]->kind == JV_INT ? a->pos[i]->u.i : a->pos[i]->u.b;
    }
    if (!v[2]) return bad_arg(c, line, "range", "step must not be zero");
    int64_t n = v[2] > 0 ? (v[1] > v[0] ? (v[1] - v[0] + v[2] - 1) / v[2] : 0)
                         : (v[0] > v[1] ? (v[0] - v[1] - v[2] - 1) / -v[2] : 0);
    if (n > 100000) /* jinja2's sandbox refuses ranges past MAX_RANGE */
        return jn_fail(c, TD_ERANGE, line, "range: %lld items, more than the sandbox's 100000",
                       (long long)n);
    jv *r = jn_list(c, (size_t)n);
    for (int64_t i = 0; r && i < n; i++)
        if (!(r->u.list.items[i] = jn_int(c, v[0] + i * v[2]))) return NULL;
    return r;
}

/* dict(**kw) and namespace(mapping?, **kw) */
static jv *kw_dict(jn_ctx *c, const jn_args *a, int line, const char *fn)
{
    jv *d = jn_dict_new(c);
    if (!d) return NULL;
    if (a->n_pos > 1) return bad_arg(c, line, fn, "takes at most one positional argument");
    if (a->n_pos) {
        jv *m = a->pos[0];
        if (m->kind != JV_DICT && m->kind != JV_NS) return bad_arg(c, line, fn, "takes a mapping");
        for (size_t i = 0; i < m->u.dict->n; i++)
            if (jn_dict_set(c, d, m->u.dict->keys[i], m->u.dict->vals[i])) return NULL;
    }
    for (size_t i = 0; i < a->n_kv; i++) {
        jv *k = jn_cstr(c, a->names[i]);
        if (!k || jn_dict_set(c, d, k, a->kv[i])) return NULL;
    }
    return d;
}

static jv *g_dict(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)self;
    return kw_dict(c, a, line, "dict");
}

/* transformers' namespace refuses underscore names (they reach Python internals there). */
int jn_ns_check_name(jn_ctx *c, const char *name, int line)
{
    if (name[0] != '_') return 0;
    jn_fail(c, TD_EINVAL, line,
            "chat templates cannot store underscore-prefixed attributes on a namespace, but "
            "got '%s'",
            name);
    return -1;
}

static jv *g_namespace(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)self;
    jv *d = kw_dict(c, a, line, "namespace");
    if (!d) return NULL;
    for (size_t i = 0; i < d->u.dict->n; i++)
        if (d->u.dict->keys[i]->kind == JV_STR &&
            jn_ns_check_name(c, d->u.dict->keys[i]->u.str.s, line))
            return NULL;
    d->kind = JV_NS;
    return d;
}

static jv *g_raise(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)self;
    jv *m = jn_arg(a, 0, NULL);
    jv *s = m ? jn_to_str(c, m) : NULL;
    return jn_fail(c, TD_EINVAL, line, "the template raised an exception: %s",
                   s ? s->u.str.s : "(no message)");
}

static jv *g_strftime(jn_ctx *c, jv *self, const jn_args *a, int line)
{
    (void)self;
    jv *f = jn_arg(a, 0, NULL);
    if (!f || f->kind != JV_STR) return bad_arg(c, line, "strftime_now", "takes a format string");
    time_t t = (time_t)c->now;
    struct tm tm;
    char out[256];
    gmtime_r(&t, &tm);
    size_t n = strftime(out, sizeof out, f->u.str.s, &tm);
    if (!n && f->u.str.len)
        return bad_arg(c, line, "strftime_now", "the formatted date is too long");
    return jn_str(c, out, n);
}

int jn_add_globals(jn_ctx *c, jv *d)
{
    static const struct {
        const char *name;
        jn_native fn;
    } g[] = {{"range", g_range},
             {"dict", g_dict},
             {"namespace", g_namespace},
             {"raise_exception", g_raise},
             {"strftime_now", g_strftime}};
    for (size_t i = 0; i < sizeof g / sizeof *g; i++) {
        jv *k = jn_cstr(c, g[i].name), *f = k ? jn_func(c, g[i].name, g[i].fn, NULL) : NULL;
        if (!f || jn_dict_set(c, d, k, f)) return -1;
    }
    return 0;
}
