/* rt_toolscan.c: the call blocks' streaming scanners (see rt_toolscan.h).
 *
 * Each step rescans the block from t->pos (the text before it is decided) and moves on as
 * far as the text allows. The states, per format:
 *
 *   deepseek_*, kimi_k2:  SEEK --call begin--> HEAD --name complete--> ARGS --call end--> SEEK
 *                                               +--no call here--> SKIP --call end--> SEEK
 *   qwen3_coder:          SEEK --<function=--> HEAD --">"--> PSEEK --<parameter=--> PNAME
 *                         --">"--> PVAL --value end--> PSEEK; PSEEK --</function>--> SEEK
 *   glm45:                HEAD --"\n" or <arg_key>--> KSEEK --<arg_key>--> KEY
 *                         --<arg_value>--> VAL --</arg_value>--> KSEEK
 *   llama3_json:          SEEK --"{"--> HEAD --name, "arguments": --> ARGS --value closed-->
 *                         TAIL --"}"--> NEXT --";"--> HEAD
 *   mistral:              SEG --[TOOL_CALLS]--> NAME (f[ARGS]{, f{) or HEAD (a [{...}] list)
 *                         --> ARGS --> NEXT (list: TAIL, then NEXT) --> NAME, HEAD or SEG
 *   any:                  DEAD (nothing more is certain before the block ends)
 *
 * The re-written arguments (llama3_json, mistral) are rebuilt from the value's start at each
 * step (jr_value) and only the part past what was sent goes out: json.dumps writes each
 * token on its own, so the text of a complete token never changes later. */
#define _GNU_SOURCE /* memmem, strndup */
#include "rt_toolscan.h"

#include <stdlib.h>
#include <string.h>

#include "jn.h"
#include "td_err.h"

#define DS3_FENCE "\n```json\n"
#define DS3_END   "\n```" RT_TF_DS_CALL_END
#define MAX_DEPTH 64

typedef enum {
    SC_SEEK = 0,
    SC_HEAD,
    SC_ARGS,
    SC_SKIP,
    SC_PSEEK,
    SC_PNAME,
    SC_PVAL,
    SC_KSEEK,
    SC_KEY,
    SC_VAL,
    SC_TAIL,
    SC_NEXT,
    SC_SEG,
    SC_NAME,
    SC_DEAD
} rt_toolscan_state;

void rt_toolscan_init(rt_toolscan *t, rt_toolfmt f, const json_t *tools)
{
    *t = (rt_toolscan){.fmt = f, .tools = tools};
    rt_toolscan_reset(t);
}

void rt_toolscan_reset(rt_toolscan *t)
{
    free(t->fname);
    t->fname = NULL;
    t->st = t->fmt == RT_TOOLFMT_GLM45 ? SC_HEAD : t->fmt == RT_TOOLFMT_MISTRAL ? SC_SEG : SC_SEEK;
    t->pos = t->a = t->b = t->sent = t->tail = 0;
    t->n_params = 0;
    t->list = false;
    t->args.len = 0;
}

void rt_toolscan_fini(rt_toolscan *t)
{
    free(t->fname);
    rt_buf_free(&t->args);
    rt_buf_free(&t->tmp);
    *t = (rt_toolscan){0};
}

static bool is_ws(char c)
{
    return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

static size_t skip_ws(const char *s, size_t n, size_t i)
{
    while (i < n && is_ws(s[i]))
        i++;
    return i;
}

size_t rt_toolscan_partial(const char *s, size_t n, const char *lit)
{
    size_t l = strlen(lit);
    for (size_t k = n < l - 1 ? n : l - 1; k > 0; k--)
        if (!memcmp(s + n - k, lit, k)) return k;
    return 0;
}

/* s[i..n) against lit: 1 it starts with lit, 0 it may still (too short), -1 it cannot. */
static int starts_lit(const char *s, size_t n, size_t i, const char *lit)
{
    size_t l = strlen(lit), have = n - i < l ? n - i : l;
    if (memcmp(s + i, lit, have)) return -1;
    return have == l;
}

static char *dup_name(const char *s, size_t a, size_t b)
{
    while (a < b && is_ws(s[a]))
        a++;
    while (b > a && is_ws(s[b - 1]))
        b--;
    return strndup(s + a, b - a);
}

/* ---- deepseek_v3, deepseek_v31, kimi_k2: the generated arguments passed through ---- */

/* Send s[t->sent..e) (the arguments up to e, e > t->sent). */
static int send_raw(rt_toolscan *t, const char *s, size_t e, const rt_toolscan_sink *k)
{
    if (e <= t->sent) return 0;
    int rc = k->args(k->ctx, s + t->sent, e - t->sent);
    t->n_params += (int)(e - t->sent) > 0;
    t->sent = e;
    return rc;
}

/* kimi_k2's call id (functions.f:0, f:0), trimmed at s[a..b): the name's bounds, or false. */
static bool kimi_id(const char *s, size_t a, size_t b, size_t *na, size_t *nb)
{
    size_t colon = b;
    while (colon > a && s[colon - 1] != ':')
        colon--;
    bool digits = colon > a && colon < b && memchr(s + a, '<', b - a) == NULL;
    for (size_t i = colon; digits && i < b; i++)
        digits = s[i] >= '0' && s[i] <= '9';
    if (!digits) return false;
    *nb = colon - 1;
    *na = *nb;
    while (*na > a && s[*na - 1] != '.')
        (*na)--;
    return true;
}

/* HEAD: the call's name (and kimi's id) once certain; SKIP when the parse will skip it. */
static int raw_head(rt_toolscan *t, const char *s, size_t n, const rt_toolscan_sink *k, bool *more)
{
    bool kimi = t->fmt == RT_TOOLFMT_KIMI_K2, v3 = t->fmt == RT_TOOLFMT_DEEPSEEK_V3;
    const char *end = kimi ? RT_TF_KIMI_CALL_END : RT_TF_DS_CALL_END,
               *sep_lit = kimi ? RT_TF_KIMI_ARG : RT_TF_DS_SEP;
    size_t e = rt_toolfmt_find(s, n, t->a, end), sep = rt_toolfmt_find(s, e, t->a, sep_lit);
    if (kimi && rt_toolfmt_find(s, sep, t->a, RT_TF_KIMI_CALL) != sep)
        sep = e; /* a call inside a call */
    *more = false;
    if (sep == e) { /* no separator before the call's end: the parse skips it */
        if (e < n) t->st = SC_SKIP, *more = true;
        return 0;
    }
    size_t na = t->a, nb = sep, aa = sep + strlen(sep_lit);
    if (v3) { /* type<sep>name\n```json\nARGS */
        na = aa;
        nb = rt_toolfmt_find(s, e, na, DS3_FENCE);
        if (nb == e) {
            if (e < n) t->st = SC_SKIP, *more = true;
            return 0;
        }
        aa = nb + strlen(DS3_FENCE);
    }
    size_t ia = t->a, ib = sep;
    if (kimi) {
        while (ia < ib && is_ws(s[ia]))
            ia++;
        while (ib > ia && is_ws(s[ib - 1]))
            ib--;
        if (!kimi_id(s, ia, ib, &na, &nb)) {
            t->st = SC_SKIP;
            *more = e < n;
            return 0;
        }
    }
    t->st = SC_ARGS;
    t->sent = aa;
    t->n_params = 0;
    *more = true;
    return k->call(k->ctx, s + na, nb - na, kimi ? s + ia : NULL, kimi ? ib - ia : 0);
}

/* ARGS: the text up to the call's end marker, less what may still be a marker. */
static int raw_args(rt_toolscan *t, const char *s, size_t n, const rt_toolscan_sink *k, bool *more)
{
    bool kimi = t->fmt == RT_TOOLFMT_KIMI_K2, v3 = t->fmt == RT_TOOLFMT_DEEPSEEK_V3;
    const char *end = kimi ? RT_TF_KIMI_CALL_END : RT_TF_DS_CALL_END;
    if (kimi && !t->n_params) t->sent = skip_ws(s, n, t->sent); /* kimi trims the arguments */
    size_t e = rt_toolfmt_find(s, n, t->sent, end), stop = e;
    *more = e < n;
    if (e < n) {
        if (v3 && e >= t->sent + 4 && !memcmp(s + e - 4, "\n```", 4)) stop = e - 4;
        t->pos = e;
        t->st = SC_SEEK;
    } else {
        size_t h1 = rt_toolscan_partial(s + t->sent, n - t->sent, v3 ? DS3_END : end);
        size_t h2 = rt_toolscan_partial(s + t->sent, n - t->sent,
                                        kimi ? RT_TF_KIMI_END : RT_TF_DS_CALLS_END);
        size_t h3 = rt_toolscan_partial(s + t->sent, n - t->sent, end);
        size_t h = h1 > h2 ? h1 : h2;
        stop = n - (h > h3 ? h : h3);
    }
    while (kimi && stop > t->sent && is_ws(s[stop - 1]))
        stop--; /* trailing whitespace is the arguments' only if more text follows it */
    return send_raw(t, s, stop, k);
}

static int raw_step(rt_toolscan *t, const char *s, size_t n, const rt_toolscan_sink *k)
{
    bool kimi = t->fmt == RT_TOOLFMT_KIMI_K2, more = true;
    const char *begin = kimi ? RT_TF_KIMI_CALL : RT_TF_DS_CALL_BEGIN,
               *end = kimi ? RT_TF_KIMI_CALL_END : RT_TF_DS_CALL_END;
    int rc = 0;
    while (more && !rc) {
        size_t e;
        switch (t->st) {
        case SC_SEEK:
            e = rt_toolfmt_find(s, n, t->pos, begin);
            more = e < n;
            if (more) t->a = e + strlen(begin), t->st = SC_HEAD;
            break;
        case SC_HEAD:
            rc = raw_head(t, s, n, k, &more);
            break;
        case SC_SKIP: /* the next call is looked for after this one's end */
            e = rt_toolfmt_find(s, n, t->a, end);
            more = e < n;
            if (more) t->pos = e, t->st = SC_SEEK;
            break;
        case SC_ARGS:
            rc = raw_args(t, s, n, k, &more);
            break;
        default:
            more = false;
        }
    }
    return rc;
}

/* ---- qwen3_coder, glm45: each parameter once complete, typed ---- */

/* Send "{" (first) or one parameter: the key s[ka..kb), the value s[va..vb). */
static int send_param(rt_toolscan *t, const char *s, size_t ka, size_t kb, size_t va, size_t vb,
                      const rt_toolscan_sink *k)
{
    char *key = strndup(s + ka, kb - ka);
    char *pair = key && t->fname
                     ? rt_toolfmt_param_json(t->fmt, t->tools, t->fname, key, s + va, vb - va)
                     : NULL;
    free(key);
    if (!pair) return TD_ENOMEM;
    int rc = t->n_params++ ? k->args(k->ctx, ", ", 2) : 0;
    if (!rc) rc = k->args(k->ctx, pair, strlen(pair));
    free(pair);
    return rc;
}

static int start_typed(rt_toolscan *t, const char *name, const rt_toolscan_sink *k)
{
    free(t->fname);
    t->fname = strdup(name);
    t->n_params = 0;
    if (!t->fname) return TD_ENOMEM;
    int rc = k->call(k->ctx, name, strlen(name), NULL, 0);
    return rc ? rc : k->args(k->ctx, "{", 1);
}

/* <function=NAME>(<parameter=P>VALUE</parameter>)*</function>, as qwen_function reads it */
static int qwen_step(rt_toolscan *t, const char *s, size_t n, const rt_toolscan_sink *k)
{
    int rc = 0;
    for (bool more = true; more && !rc;) {
        size_t fe = rt_toolfmt_find(s, n, t->pos, "</function>"), i;
        more = false;
        switch (t->st) {
        case SC_SEEK:
            i = rt_toolfmt_find(s, n, t->pos, "<function=");
            if (i < n) t->pos = i + 10, t->st = SC_HEAD, more = true;
            break;
        case SC_HEAD:
            i = rt_toolfmt_find(s, fe, t->pos, ">");
            if (i == fe) { /* no name: no call */
                if (fe < n) t->pos = fe, t->st = SC_SEEK, more = true;
                break;
            }
            char *name = strndup(s + t->pos, i - t->pos);
            rc = name ? start_typed(t, name, k) : TD_ENOMEM;
            free(name);
            t->pos = i, t->st = SC_PSEEK, more = true;
            break;
        case SC_PSEEK:
        case SC_PNAME:
            i = rt_toolfmt_find(s, fe, t->pos, t->st == SC_PSEEK ? "<parameter=" : ">");
            if (i < fe) {
                if (t->st == SC_PSEEK)
                    t->a = t->pos = i + 11, t->st = SC_PNAME;
                else
                    t->b = i, t->st = SC_PVAL;
                more = true;
            } else if (fe < n) { /* the function ends: its arguments too */
                rc = k->args(k->ctx, "}", 1);
                t->pos = fe, t->st = SC_SEEK, more = true;
            }
            break;
        case SC_PVAL: {
            size_t e = rt_toolfmt_find(s, n, t->b, "</parameter>"),
                   e2 = rt_toolfmt_find(s, n, t->b, "<parameter=");
            e = e2 < e ? e2 : e;
            e = fe < e ? fe : e;
            if (e == n) break;
            size_t va = t->b + 1, vb = e;
            if (va < vb && s[va] == '\n') va++;
            if (vb > va && s[vb - 1] == '\n') vb--;
            rc = send_param(t, s, t->a, t->b, va, vb, k);
            t->pos = e, t->st = SC_PSEEK, more = true;
            break;
        }
        default:
            break;
        }
    }
    return rc;
}

/* <tool_call>NAME\n(<arg_key>K</arg_key>\s*<arg_value>V</arg_value>)*, as parse_glm reads it */
static int glm_step(rt_toolscan *t, const char *s, size_t n, const rt_toolscan_sink *k)
{
    int rc = 0;
    for (bool more = true; more && !rc;) {
        size_t i, j;
        more = false;
        switch (t->st) {
        case SC_HEAD: {
            size_t a = starts_lit(s, n, 0, "<tool_call>") == 1 ? 11 : 0;
            i = rt_toolfmt_find(s, n, a, "<arg_key>"), j = rt_toolfmt_find(s, n, a, "\n");
            i = j < i ? j : i;
            if (i == n) break;
            char *name = dup_name(s, a, i);
            if (name && !*name)
                t->st = SC_DEAD; /* no name: no call, the block is content */
            else
                rc = name ? start_typed(t, name, k) : TD_ENOMEM;
            if (t->st == SC_HEAD) t->pos = i, t->st = SC_KSEEK, more = true;
            free(name);
            break;
        }
        case SC_KSEEK:
            i = rt_toolfmt_find(s, n, t->pos, "<arg_key>");
            if (i < n) t->a = i + 9, t->st = SC_KEY, more = true;
            break;
        case SC_KEY:
            i = rt_toolfmt_find(s, n, t->a, "</arg_key>");
            if (i == n) break;
            j = skip_ws(s, n, i + 10);
            int m = j < n ? starts_lit(s, n, j, "<arg_value>") : 0;
            if (m < 0) t->st = SC_DEAD; /* the parse takes no more parameters */
            if (m > 0) t->b = i, t->sent = j + 11, t->st = SC_VAL, more = true;
            break;
        case SC_VAL:
            i = rt_toolfmt_find(s, n, t->sent, "</arg_value>");
            if (i == n) break;
            size_t ka = t->a, kb = t->b, va = t->sent, vb = i;
            while (ka < kb && is_ws(s[ka]))
                ka++;
            while (kb > ka && is_ws(s[kb - 1]))
                kb--;
            while (va < vb && is_ws(s[va]))
                va++;
            while (vb > va && is_ws(s[vb - 1]))
                vb--;
            rc = send_param(t, s, ka, kb, va, vb, k);
            t->pos = i, t->st = SC_KSEEK, more = true;
            break;
        default:
            break;
        }
    }
    return rc;
}

/* ---- llama3_json, mistral: JSON calls, the arguments re-written as json.dumps ---- */

typedef enum { JR_MORE = 0, JR_DONE, JR_BAD } rt_jr;

/* The string at s[*i] ('"'): json.dumps' text of as much of it as is complete, appended to
 * o (without the closing quote while the string is open). */
static rt_jr jr_string(const char *s, size_t n, size_t *i, rt_buf *o)
{
    rt_buf d = {0}; /* the characters decoded so far */
    size_t j = *i + 1;
    rt_jr r = JR_MORE;
    while (j < n && r == JR_MORE) {
        unsigned char c = (unsigned char)s[j];
        if (c == '"') {
            r = JR_DONE;
            j++;
            break;
        }
        if (c < 0x20) r = JR_BAD;
        if (c != '\\' || r != JR_MORE) {
            if (r == JR_MORE && rt_buf_append(&d, s + j, 1)) r = JR_BAD;
            j++;
            continue;
        }
        if (j + 1 >= n) break;
        static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
        const char *m = memchr(from, s[j + 1], sizeof from - 1);
        if (m) {
            if (rt_buf_append(&d, &to[m - from], 1)) r = JR_BAD;
            j += 2;
            continue;
        }
        if (s[j + 1] != 'u') {
            r = JR_BAD;
            break;
        }
        unsigned cp = 0, lo = 0;
        int w = 0;
        for (; w < 4 && j + 2 + w < n; w++) {
            char h = s[j + 2 + w];
            int v = h >= '0' && h <= '9'   ? h - '0'
                    : h >= 'a' && h <= 'f' ? h - 'a' + 10
                    : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                           : -1;
            if (v < 0) r = JR_BAD;
            cp = cp * 16 + (unsigned)(v < 0 ? 0 : v);
        }
        if (w < 4 || r != JR_MORE) break;
        size_t used = 6;
        if (cp >= 0xd800 && cp < 0xdc00) { /* a pair: wait for the low half */
            if (j + 12 > n) break;
            char buf[5] = {s[j + 8], s[j + 9], s[j + 10], s[j + 11], 0};
            lo = (unsigned)strtoul(buf, NULL, 16);
            if (s[j + 6] != '\\' || s[j + 7] != 'u' || lo < 0xdc00 || lo >= 0xe000) r = JR_BAD;
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            used = 12;
        } else if ((cp >= 0xdc00 && cp < 0xe000) || cp == 0) {
            r = JR_BAD; /* a lone low half; NUL, which jansson refuses */
        }
        char u[4];
        size_t ul = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
        if (ul == 1) u[0] = (char)cp;
        if (ul == 2) u[0] = (char)(0xc0 | cp >> 6), u[1] = (char)(0x80 | (cp & 0x3f));
        if (ul == 3)
            u[0] = (char)(0xe0 | cp >> 12), u[1] = (char)(0x80 | (cp >> 6 & 0x3f)),
            u[2] = (char)(0x80 | (cp & 0x3f));
        if (ul == 4)
            u[0] = (char)(0xf0 | cp >> 18), u[1] = (char)(0x80 | (cp >> 12 & 0x3f)),
            u[2] = (char)(0x80 | (cp >> 6 & 0x3f)), u[3] = (char)(0x80 | (cp & 0x3f));
        if (r == JR_MORE && rt_buf_append(&d, u, ul)) r = JR_BAD;
        j += used;
    }
    if (r == JR_MORE) { /* a character cut short is not certain yet */
        size_t cut = d.len, back = 0;
        while (cut > 0 && back < 3 && ((unsigned char)d.buf[cut - 1] & 0xc0) == 0x80)
            cut--, back++;
        if (cut > 0 && (unsigned char)d.buf[cut - 1] >= 0xc0) {
            unsigned char lead = (unsigned char)d.buf[cut - 1];
            size_t need = lead >= 0xf0 ? 3 : lead >= 0xe0 ? 2 : 1;
            if (back < need) d.len = cut - 1;
        }
    }
    json_t *str = r != JR_BAD ? json_stringn(d.buf ? d.buf : "", d.len) : NULL;
    char *txt = str ? jn_pyjson(str) : NULL;
    json_decref(str);
    rt_buf_free(&d);
    if (!txt) return JR_BAD;
    if (rt_buf_append(o, txt, strlen(txt) - (r == JR_DONE ? 0 : 1))) r = JR_BAD;
    free(txt);
    *i = j;
    return r;
}

/* json.dumps' text of the JSON value at s[0..n) as far as it is certain, appended to o;
 * JR_DONE sets *end past the value. JR_BAD: o holds what was certain before the fault. */
static rt_jr jr_value(const char *s, size_t n, rt_buf *o, size_t *end)
{
    enum { VAL, VAL_OR_CLOSE, KEY, KEY_OR_CLOSE, COLON, NEXT } ex = VAL;
    char stack[MAX_DEPTH]; /* the closing brackets */
    int d = 0;
    size_t i = 0;
    for (;;) {
        i = skip_ws(s, n, i);
        if (i == n) return JR_MORE;
        char c = s[i];
        bool close =
            (c == '}' || c == ']') && (ex == VAL_OR_CLOSE || ex == KEY_OR_CLOSE || ex == NEXT);
        if (close) {
            if (c != stack[d - 1]) return JR_BAD;
            if (rt_buf_append(o, &c, 1)) return JR_BAD;
            i++;
            if (!--d) break;
            ex = NEXT;
            continue;
        }
        if (ex == NEXT || ex == COLON) {
            if (c != (ex == NEXT ? ',' : ':')) return JR_BAD;
            if (rt_buf_puts(o, ex == NEXT ? ", " : ": ")) return JR_BAD;
            i++;
            ex = ex == COLON ? VAL : stack[d - 1] == '}' ? KEY : VAL;
            continue;
        }
        if (ex == KEY || ex == KEY_OR_CLOSE) {
            if (c != '"') return JR_BAD;
            rt_jr r = jr_string(s, n, &i, o);
            if (r != JR_DONE) return r;
            ex = COLON;
            continue;
        }
        if (c == '{' || c == '[') {
            if (d == MAX_DEPTH || rt_buf_append(o, &c, 1)) return JR_BAD;
            stack[d++] = c == '{' ? '}' : ']';
            ex = c == '{' ? KEY_OR_CLOSE : VAL_OR_CLOSE;
            i++;
            continue;
        }
        if (c == '"') {
            rt_jr r = jr_string(s, n, &i, o);
            if (r != JR_DONE) return r;
        } else { /* a number or literal: certain once the next byte ends it */
            size_t j = i;
            while (j < n && s[j] && strchr("+-.0123456789eEtruefalsn", s[j]))
                j++;
            if (j == n) return JR_MORE;
            json_t *v = j > i ? json_loadb(s + i, j - i, JSON_DECODE_ANY, NULL) : NULL;
            char *txt = v ? jn_pyjson(v) : NULL;
            json_decref(v);
            int bad = !txt || rt_buf_puts(o, txt);
            free(txt);
            if (bad) return JR_BAD;
            i = j;
        }
        if (!d) break;
        ex = NEXT;
    }
    *end = i;
    return JR_DONE;
}

/* HEAD: {"name": "<string>", "arguments": (or "parameters" for llama3_json) at s[*i]: 1 and
 * the call announced (*i at the value), 0 more text needed, -1 not in this form. */
static int json_head(rt_toolscan *t, const char *s, size_t n, size_t *i, const rt_toolscan_sink *k,
                     int *rc)
{
    static const char *const steps[] = {"{", "\"name\"", ":", NULL, ","};
    size_t j = *i, na = 0, nl = 0;
    for (size_t m = 0; m < 7; m++) {
        j = skip_ws(s, n, j);
        if (j == n) return 0;
        if (m < 5 && steps[m]) {
            int r = starts_lit(s, n, j, steps[m]);
            if (r <= 0) return r;
            j += strlen(steps[m]);
        } else if (m == 3) { /* the name: a JSON string */
            if (s[j] != '"') return -1;
            size_t e = j + 1;
            while (e < n && s[e] != '"')
                e += s[e] == '\\' ? 2 : 1;
            if (e >= n) return 0;
            na = j, nl = e + 1 - j, j = e + 1;
        } else if (m == 5) {
            int r = starts_lit(s, n, j, "\"arguments\"");
            size_t l = 11;
            if (r < 0 && t->fmt == RT_TOOLFMT_LLAMA3_JSON)
                r = starts_lit(s, n, j, "\"parameters\""), l = 12;
            if (r <= 0) return r;
            j += l;
        } else if (s[j] != ':') {
            return -1;
        } else {
            j++;
        }
    }
    j = skip_ws(s, n, j);
    if (j == n) return 0;
    if (t->fmt == RT_TOOLFMT_LLAMA3_JSON && s[j] != '{') return -1;
    json_t *name = json_loadb(s + na, nl, JSON_DECODE_ANY, NULL);
    if (!json_is_string(name)) return json_decref(name), -1;
    *rc = k->call(k->ctx, json_string_value(name), json_string_length(name), NULL, 0);
    json_decref(name);
    *i = j;
    return 1;
}

/* ARGS: the value from t->a, re-written; what is new goes out. */
static int json_args(rt_toolscan *t, const char *s, size_t n, const rt_toolscan_sink *k, bool *more)
{
    size_t end = 0;
    t->tmp.len = 0;
    rt_jr r = jr_value(s + t->a, n - t->a, &t->tmp, &end);
    int rc = 0;
    if (t->tmp.len > t->args.len &&
        (!t->args.len || !memcmp(t->tmp.buf, t->args.buf, t->args.len))) {
        rc = k->args(k->ctx, t->tmp.buf + t->args.len, t->tmp.len - t->args.len);
        if (!rc && rt_buf_append(&t->args, t->tmp.buf + t->args.len, t->tmp.len - t->args.len))
            rc = TD_ENOMEM;
    }
    *more = r == JR_DONE;
    if (r == JR_BAD) t->st = SC_DEAD;
    /* llama3_json and a mistral list: the call object's other members follow (TAIL) */
    bool obj = t->list || t->fmt == RT_TOOLFMT_LLAMA3_JSON;
    if (r == JR_DONE) t->pos = t->a + end, t->st = obj ? SC_TAIL : SC_NEXT;
    return rc;
}

/* TAIL: the rest of the call object after its arguments (other members), to its "}". */
static bool json_tail(rt_toolscan *t, const char *s, size_t n)
{
    int d = 1;
    bool str = false;
    for (size_t i = t->pos; i < n; i++) {
        char c = s[i];
        if (str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                str = false;
        } else if (c == '"') {
            str = true;
        } else if (c == '{' || c == '[') {
            d++;
        } else if ((c == '}' || c == ']') && !--d) {
            t->pos = i + 1;
            t->st = SC_NEXT;
            return true;
        }
    }
    return false;
}

static int json_step(rt_toolscan *t, const char *s, size_t n, const rt_toolscan_sink *k)
{
    bool llama = t->fmt == RT_TOOLFMT_LLAMA3_JSON, more = true;
    int rc = 0;
    while (more && !rc) {
        size_t i = t->pos;
        int r;
        more = false;
        switch (t->st) {
        case SC_SEEK: /* llama3_json: the block's first call */
            i = skip_ws(s, n, starts_lit(s, n, 0, "<|python_tag|>") == 1 ? 14 : 0);
            if (i < n) t->pos = i, t->st = s[i] == '{' ? SC_HEAD : SC_DEAD, more = true;
            break;
        case SC_SEG: /* mistral: [TOOL_CALLS], then a list or f[ARGS]{...} */
            r = starts_lit(s, n, i, "[TOOL_CALLS]");
            if (r < 0) t->st = SC_DEAD;
            i = skip_ws(s, n, i + 12);
            if (r <= 0 || i == n) break;
            t->list = s[i] == '[';
            t->pos = i + t->list, t->a = i, t->st = t->list ? SC_HEAD : SC_NAME, more = true;
            break;
        case SC_HEAD:
            r = json_head(t, s, n, &i, k, &rc);
            if (r < 0) t->st = SC_DEAD;
            if (r > 0) t->a = i, t->args.len = 0, t->st = SC_ARGS, more = true;
            break;
        case SC_NAME: /* mistral: f{...}, f[ARGS]{...}, f[CALL_ID]id[ARGS]{...} */
            while (i < n && s[i] != '{' && s[i] != '[')
                i++;
            size_t e = i;
            if (i < n && s[i] == '[') {
                r = starts_lit(s, n, i, "[CALL_ID]");
                if (r == 0) break;
                if (r > 0) i = rt_toolfmt_find(s, n, i + 9, "[ARGS]");
                r = i < n ? starts_lit(s, n, i, "[ARGS]") : 0;
                if (r < 0) t->st = SC_DEAD;
                if (r <= 0) break;
                i += 6;
            }
            i = skip_ws(s, n, i);
            if (i == n) break;
            char *name = dup_name(s, t->pos, e);
            if (!name) return TD_ENOMEM;
            if (!*name || s[i] != '{')
                t->st = SC_DEAD;
            else
                rc = k->call(k->ctx, name, strlen(name), NULL, 0);
            if (t->st == SC_NAME) t->a = i, t->args.len = 0, t->st = SC_ARGS, more = true;
            free(name);
            break;
        case SC_ARGS:
            rc = json_args(t, s, n, k, &more);
            break;
        case SC_TAIL:
            more = json_tail(t, s, n);
            break;
        case SC_NEXT:
            i = skip_ws(s, n, i);
            if (i == n) break;
            if (llama) { /* ; then the next call */
                if (s[i] != ';')
                    t->st = SC_DEAD, t->tail = t->pos;
                else if ((i = skip_ws(s, n, i + 1)) < n)
                    t->pos = i, t->st = s[i] == '{' ? SC_HEAD : SC_DEAD, more = true;
            } else if (t->list) { /* , {next} or the list's end */
                if (s[i] == ',')
                    t->pos = i + 1, t->st = SC_HEAD, more = true;
                else if (s[i] == ']')
                    t->list = false, t->pos = i + 1, t->st = SC_SKIP, more = true;
                else
                    t->st = SC_DEAD, t->tail = t->pos;
            } else { /* ", f{...}" in the same segment, or the next [TOOL_CALLS] */
                while (i < n && (is_ws(s[i]) || s[i] == ','))
                    i++;
                if (i == n) break;
                r = starts_lit(s, n, i, "[TOOL_CALLS]");
                if (r == 0) break;
                t->pos = i, t->st = r > 0 ? SC_SEG : SC_NAME, more = true;
            }
            break;
        case SC_SKIP: /* mistral: after a list, up to the next [TOOL_CALLS] */
            i = rt_toolfmt_find(s, n, t->pos, "[TOOL_CALLS]");
            if (i < n) t->pos = i, t->st = SC_SEG, more = true;
            break;
        default:
            break;
        }
    }
    return rc;
}

/* ---- pythonic: [f(a=1, b="x"), g()], as parse_pythonic reads it: the name at its "(", then
 * "{", each parameter once its value is complete (a "," or ")" follows it outside brackets
 * and strings), typed as ast.literal_eval would (rt_toolfmt_param_json), "}" at the ")" ---- */

/* Where the value that starts at s[i] ends: the "," or ")" after it outside brackets and
 * strings; n while the text ends first (or a bracket closes that never opened: the block's
 * parse decides). */
static size_t py_value_end(const char *s, size_t n, size_t i)
{
    int depth = 0;
    char q = 0;
    for (; i < n; i++) {
        const char c = s[i];
        if (q) {
            if (c == '\\')
                i++;
            else if (c == q)
                q = 0;
        } else if (c == '\'' || c == '"') {
            q = c;
        } else if (c == '[' || c == '(' || c == '{') {
            depth++;
        } else if (c == ']' || c == ')' || c == '}') {
            if (!depth) return c == ')' ? i : n;
            depth--;
        } else if (c == ',' && !depth) {
            return i;
        }
    }
    return n;
}

/* A parameter k=v at s[i] (PSEEK with none yet, or KSEEK): sent once v is complete. */
static int py_param(rt_toolscan *t, const char *s, size_t n, size_t i, const rt_toolscan_sink *k,
                    bool *more)
{
    size_t kb = rt_toolfmt_py_ident(s, n, i), eq = skip_ws(s, n, kb);
    if (kb == n || eq == n) return 0; /* the key may go on */
    if (kb == i || s[eq] != '=') {
        t->st = SC_DEAD;
        return 0;
    }
    size_t ve = py_value_end(s, n, eq + 1);
    if (ve == n) return 0;
    char *key = strndup(s + i, kb - i);
    char *pair =
        key ? rt_toolfmt_param_json(t->fmt, t->tools, t->fname, key, s + eq + 1, ve - (eq + 1))
            : NULL;
    free(key);
    if (!pair) { /* not a literal (or no memory): the block's parse decides */
        t->st = SC_DEAD;
        return 0;
    }
    int rc = t->n_params++ ? k->args(k->ctx, ", ", 2) : 0;
    if (!rc) rc = k->args(k->ctx, pair, strlen(pair));
    free(pair);
    t->pos = ve, t->st = SC_PSEEK, *more = true;
    return rc;
}

static int py_step(rt_toolscan *t, const char *s, size_t n, const rt_toolscan_sink *k)
{
    int rc = 0;
    for (bool more = true; more && !rc;) {
        more = false;
        const size_t i = skip_ws(s, n, t->pos);
        if (i == n) break;
        switch (t->st) {
        case SC_SEEK: /* the "[" that opened the block */
            if (s[i] != '[')
                t->st = SC_DEAD;
            else
                t->pos = i + 1, t->st = SC_HEAD, more = true;
            break;
        case SC_HEAD: { /* a call's name and its "(" */
            size_t b = rt_toolfmt_py_ident(s, n, i);
            if (b == n) break;
            if (b == i || s[b] != '(') {
                t->st = SC_DEAD;
                break;
            }
            char *name = strndup(s + i, b - i);
            rc = name ? start_typed(t, name, k) : TD_ENOMEM;
            free(name);
            t->pos = b + 1, t->st = SC_PSEEK, more = true;
            break;
        }
        case SC_PSEEK: /* after "(" or a parameter: ")", ",", or (none yet) a parameter */
        case SC_KSEEK: /* after ",": ")" or a parameter */
            if (s[i] == ')') {
                rc = k->args(k->ctx, "}", 1);
                t->pos = i + 1, t->st = SC_NEXT, more = true;
            } else if (t->st == SC_PSEEK && t->n_params) {
                if (s[i] == ',')
                    t->pos = i + 1, t->st = SC_KSEEK, more = true;
                else
                    t->st = SC_DEAD;
            } else {
                rc = py_param(t, s, n, i, k, &more);
            }
            break;
        case SC_NEXT: /* after a call: "," and the next one, or the closing "]" */
            if (s[i] == ',') {
                t->pos = i + 1, t->st = SC_HEAD, more = true;
            } else { /* "]" (or not a call list): nothing more to send */
                if (s[i] == ']') t->tail = i + 1; /* text after the list is content */
                t->st = SC_DEAD;
            }
            break;
        default:
            break;
        }
    }
    return rc;
}

int rt_toolscan_step(rt_toolscan *t, const char *s, size_t n, const rt_toolscan_sink *k)
{
    if (t->st == SC_DEAD) return 0;
    switch (t->fmt) {
    case RT_TOOLFMT_DEEPSEEK_V3:
    case RT_TOOLFMT_DEEPSEEK_V31:
    case RT_TOOLFMT_KIMI_K2:
        return raw_step(t, s, n, k);
    case RT_TOOLFMT_QWEN3_CODER:
        return qwen_step(t, s, n, k);
    case RT_TOOLFMT_GLM45:
        return glm_step(t, s, n, k);
    case RT_TOOLFMT_LLAMA3_JSON:
    case RT_TOOLFMT_MISTRAL:
        return json_step(t, s, n, k);
    case RT_TOOLFMT_PYTHONIC:
        return py_step(t, s, n, k);
    default:
        return 0;
    }
}
