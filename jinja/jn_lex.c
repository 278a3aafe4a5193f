/* jn_lex.c: template text -> tokens, with jinja2's whitespace rules as transformers sets
 * them (trim_blocks, lstrip_blocks, `-` and `+` markers, newlines normalised to "\n", one
 * trailing newline dropped). See jn_lex.h. */
#include "jn_lex.h"

#include <ctype.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"
#include "td_grow.h"

typedef struct {
    jn_ctx *c;
    const char *s; /* normalised source */
    size_t n, pos;
    int line;
    jn_tok *toks;
    size_t n_toks, cap;
    bool line_starting; /* the last tag's end (and what it consumed) ended a line */
} lexer;

static int lex_fail(lexer *L, int line, const char *what)
{
    jn_fail(L->c, TD_EINVAL, line, "%s", what);
    return -1;
}

static jn_tok *push(lexer *L, jn_tok_type t, const char *s, size_t len)
{
    if (TD_GROW(L->toks, L->cap, L->n_toks + 1, 256)) {
        jn_fail(L->c, TD_ENOMEM, L->line, "out of memory");
        return NULL;
    }
    jn_tok *k = &L->toks[L->n_toks++];
    *k = (jn_tok){.type = t, .line = L->line, .s = s, .len = len};
    return k;
}

static void count_lines(lexer *L, size_t from, size_t to)
{
    for (size_t i = from; i < to; i++)
        L->line += L->s[i] == '\n';
}

/* Text before a tag, with the tag's left side applied: `-` strips all whitespace before it,
 * a block or comment tag alone on its line (lstrip_blocks, unless `+`) strips the line's
 * indentation. */
static int push_text(lexer *L, size_t from, size_t to, char kind, char sign)
{
    const char *t = L->s + from;
    size_t n = to - from;
    if (sign == '-') {
        while (n && isspace((unsigned char)t[n - 1]))
            n--;
    } else if (sign != '+' && kind != '{') {
        size_t l = n;
        while (l && t[l - 1] != '\n')
            l--;
        bool ws = l < n;
        for (size_t i = l; i < n && ws; i++)
            ws = isspace((unsigned char)t[i]);
        if ((l > 0 || L->line_starting) && ws) n = l;
    }
    if (n && !push(L, JN_T_TEXT, t, n)) return -1;
    return 0;
}

/* After a tag's closing marker: `-` eats all whitespace after it; a block or comment end
 * eats one newline (trim_blocks) unless it is `+`. */
static size_t after_tag(lexer *L, size_t p, char kind, char sign)
{
    size_t start = p;
    if (sign == '-') {
        while (p < L->n && isspace((unsigned char)L->s[p]))
            p++;
    } else if (sign != '+' && kind != '{' && p < L->n && L->s[p] == '\n') {
        p++;
    }
    L->line_starting = p > start ? L->s[p - 1] == '\n' : false;
    count_lines(L, start, p);
    return p;
}

/* cp as UTF-8 into out (4 bytes at most); its length. */
static size_t utf8_put(unsigned long cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | cp >> 6);
        out[1] = (char)(0x80 | (cp & 63));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12);
        out[1] = (char)(0x80 | ((cp >> 6) & 63));
        out[2] = (char)(0x80 | (cp & 63));
        return 3;
    }
    out[0] = (char)(0xF0 | cp >> 18);
    out[1] = (char)(0x80 | ((cp >> 12) & 63));
    out[2] = (char)(0x80 | ((cp >> 6) & 63));
    out[3] = (char)(0x80 | (cp & 63));
    return 4;
}

/* The escape at s[*pp] (just after its backslash) as Python's unicode-escape reads it:
 * its bytes into out (*on of them; 0 for a backslash-newline), *pp past it. */
static int lex_escape(lexer *L, size_t *pp, char *out, size_t *on, int line)
{
    static const char simple[] = "n\nt\tr\r\\\\''\"\"a\ab\bf\fv\v";
    size_t p = *pp;
    char e = L->s[p];
    *on = 1;
    for (const char *k = simple; *k; k += 2)
        if (*k == e) {
            out[0] = k[1];
            *pp = p + 1;
            return 0;
        }
    unsigned long cp = 0;
    if (e >= '0' && e <= '7') { /* octal, up to three digits */
        for (int k = 0; k < 3 && p < L->n && L->s[p] >= '0' && L->s[p] <= '7'; k++, p++)
            cp = cp * 8 + (unsigned long)(L->s[p] - '0');
        *on = utf8_put(cp, out);
        *pp = p;
        return 0;
    }
    if (e == '\n') { /* a backslash-newline continues the string */
        L->line++;
        *on = 0;
        *pp = p + 1;
        return 0;
    }
    int hex = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
    if (!hex) { /* an unknown escape stays as it is */
        out[0] = '\\';
        out[1] = e;
        *on = 2;
        *pp = p + 1;
        return 0;
    }
    for (int k = 0; k < hex; k++) {
        char h = p + 1 < L->n ? L->s[p + 1] : 0;
        if (!isxdigit((unsigned char)h))
            return lex_fail(L, line, "truncated \\x, \\u or \\U escape in a string");
        cp = cp * 16 + (unsigned long)(isdigit((unsigned char)h) ? h - '0' : tolower(h) - 'a' + 10);
        p++;
    }
    if (cp > 0x10FFFF) return lex_fail(L, line, "escape past U+10FFFF in a string");
    *on = utf8_put(cp, out);
    *pp = p + 1;
    return 0;
}

/* A string literal at s[p] (a quote): its value as Python's unicode-escape reads it. */
static int lex_string(lexer *L, size_t *pp, jn_tok *tok)
{
    size_t p = *pp + 1;
    char q = L->s[*pp];
    jn_buf b = {0};
    int line = L->line;
    for (;;) {
        if (p >= L->n) {
            free(b.buf);
            return lex_fail(L, line, "unterminated string");
        }
        char ch = L->s[p];
        if (ch == q) break;
        if (ch != '\\' || p + 1 >= L->n) {
            L->line += ch == '\n';
            if (jn_buf_put(L->c, &b, &ch, 1)) goto fail;
            p++;
            continue;
        }
        char out[8];
        size_t on;
        p++;
        if (lex_escape(L, &p, out, &on, line) || (on && jn_buf_put(L->c, &b, out, on))) goto fail;
    }
    tok->val = jn_str(L->c, b.buf ? b.buf : "", b.len);
    free(b.buf);
    *pp = p + 1;
    return tok->val ? 0 : -1;
fail:
    free(b.buf);
    return -1;
}

static int lex_number(lexer *L, size_t *pp, jn_tok *tok)
{
    size_t p = *pp;
    char digits[64];
    size_t nd = 0;
    bool is_float = false;
    for (; p < L->n; p++) {
        char ch = L->s[p];
        if (ch == '_' && p + 1 < L->n && isdigit((unsigned char)L->s[p + 1])) continue;
        if (isdigit((unsigned char)ch)) {
        } else if (ch == '.' && !is_float && p + 1 < L->n && isdigit((unsigned char)L->s[p + 1])) {
            is_float = true;
        } else if ((ch == 'e' || ch == 'E') && p + 1 < L->n &&
                   (isdigit((unsigned char)L->s[p + 1]) ||
                    ((L->s[p + 1] == '+' || L->s[p + 1] == '-') && p + 2 < L->n &&
                     isdigit((unsigned char)L->s[p + 2])))) {
            is_float = true;
            if (nd + 2 >= sizeof digits) return lex_fail(L, L->line, "number too long");
            digits[nd++] = ch;
            ch = L->s[++p];
        } else {
            break;
        }
        if (nd + 1 >= sizeof digits) return lex_fail(L, L->line, "number too long");
        digits[nd++] = ch;
    }
    digits[nd] = '\0';
    *pp = p;
    if (is_float) {
        tok->type = JN_T_FLOAT;
        tok->val = jn_float(L->c, strtod(digits, NULL));
    } else {
        char *end;
        long long v = strtoll(digits, &end, 10);
        if (*end || v == LLONG_MAX) return lex_fail(L, L->line, "integer literal too large");
        tok->type = JN_T_INT;
        tok->val = jn_int(L->c, v);
    }
    return tok->val ? 0 : -1;
}

static const char *const ops[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*",
                                  "/",  "%",  "~",  "<",  ">",  "=",  "(", ")", "[",
                                  "]",  "{",  "}",  ",",  ".",  ":",  "|", ";"};

/* The tokens inside {{ }} or {% %} up to the closing marker (close: '}' or '%'). */
static int lex_tag(lexer *L, size_t *pp, char close, char *sign)
{
    size_t p = *pp;
    int depth = 0; /* brackets open: a '}' inside {{ {'a': 1} }} is not the end */
    for (;;) {
        while (p < L->n && isspace((unsigned char)L->s[p])) {
            L->line += L->s[p] == '\n';
            p++;
        }
        if (p >= L->n)
            return lex_fail(L, L->line, close == '%' ? "unclosed {% tag" : "unclosed {{ tag");
        const char *s = L->s + p;
        size_t left = L->n - p;
        if (depth == 0) {
            if (left >= 3 && (s[0] == '-' || s[0] == '+') && s[1] == close && s[2] == '}') {
                *sign = s[0];
                *pp = p + 3;
                return 0;
            }
            if (left >= 2 && s[0] == close && s[1] == '}') {
                *sign = 0;
                *pp = p + 2;
                return 0;
            }
        }
        jn_tok *t = push(L, JN_T_OP, s, 1);
        if (!t) return -1;
        if (isalpha((unsigned char)s[0]) || s[0] == '_') {
            size_t k = 1;
            while (k < left && (isalnum((unsigned char)s[k]) || s[k] == '_'))
                k++;
            t->type = JN_T_NAME;
            t->len = k;
            p += k;
        } else if (isdigit((unsigned char)s[0])) {
            if (lex_number(L, &p, t)) return -1;
        } else if (s[0] == '\'' || s[0] == '"') {
            t->type = JN_T_STRING;
            if (lex_string(L, &p, t)) return -1;
        } else {
            size_t i = 0;
            for (; i < sizeof ops / sizeof *ops; i++)
                if (!strncmp(s, ops[i], strlen(ops[i]))) break;
            if (i == sizeof ops / sizeof *ops) {
                char what[64];
                snprintf(what, sizeof what, "unexpected character '%c'", s[0]);
                return lex_fail(L, L->line, what);
            }
            t->len = strlen(ops[i]);
            p += t->len;
            if (strchr("([{", s[0])) depth++;
            if (strchr(")]}", s[0]) && depth > 0) depth--;
        }
    }
}

/* {% raw %} at p (just after its tag's end): everything up to {% endraw %} is text. */
static int lex_raw(lexer *L, size_t *pp)
{
    size_t p = *pp;
    for (size_t q = p; q + 1 < L->n; q++) {
        if (L->s[q] != '{' || L->s[q + 1] != '%') continue;
        size_t r = q + 2;
        char lsign = r < L->n && (L->s[r] == '-' || L->s[r] == '+') ? L->s[r++] : 0;
        while (r < L->n && isspace((unsigned char)L->s[r]))
            r++;
        if (L->n - r < 6 || strncmp(L->s + r, "endraw", 6)) continue;
        r += 6;
        while (r < L->n && isspace((unsigned char)L->s[r]))
            r++;
        char rsign = r < L->n && (L->s[r] == '-' || L->s[r] == '+') ? L->s[r++] : 0;
        if (L->n - r < 2 || L->s[r] != '%' || L->s[r + 1] != '}') continue;
        if (push_text(L, p, q, '%', lsign)) return -1;
        count_lines(L, p, r + 2);
        *pp = after_tag(L, r + 2, '%', rsign);
        return 0;
    }
    return lex_fail(L, L->line, "{% raw %} without {% endraw %}");
}

static bool is_raw_begin(const jn_tok *toks, size_t n)
{
    return n >= 2 && toks[n - 2].type == JN_T_BLOCK_BEGIN && toks[n - 1].type == JN_T_NAME &&
           toks[n - 1].len == 3 && !strncmp(toks[n - 1].s, "raw", 3);
}

static int lex_all(lexer *L)
{
    while (L->pos < L->n) {
        const char *open = NULL;
        for (size_t q = L->pos; q + 1 < L->n; q++)
            if (L->s[q] == '{' &&
                (L->s[q + 1] == '{' || L->s[q + 1] == '%' || L->s[q + 1] == '#')) {
                open = L->s + q;
                break;
            }
        if (!open) {
            if (!push(L, JN_T_TEXT, L->s + L->pos, L->n - L->pos)) return -1;
            count_lines(L, L->pos, L->n);
            L->pos = L->n;
            break;
        }
        size_t at = (size_t)(open - L->s), p = at + 2;
        char kind = open[1], lsign = p < L->n && (L->s[p] == '-' || L->s[p] == '+') ? L->s[p] : 0;
        if (lsign) p++;
        if (push_text(L, L->pos, at, kind, lsign)) return -1;
        count_lines(L, L->pos, at);
        char rsign = 0;
        if (kind == '#') {
            const char *end = NULL;
            for (size_t q = p; q + 1 < L->n; q++)
                if (L->s[q] == '#' && L->s[q + 1] == '}') {
                    end = L->s + q;
                    break;
                }
            if (!end) return lex_fail(L, L->line, "unclosed comment");
            size_t e = (size_t)(end - L->s);
            if (e > p && (L->s[e - 1] == '-' || L->s[e - 1] == '+')) rsign = L->s[e - 1];
            count_lines(L, at, e + 2);
            L->pos = after_tag(L, e + 2, '#', rsign);
            continue;
        }
        if (!push(L, kind == '{' ? JN_T_VAR_BEGIN : JN_T_BLOCK_BEGIN, open, 2)) return -1;
        if (lex_tag(L, &p, kind == '{' ? '}' : '%', &rsign)) return -1;
        if (!push(L, kind == '{' ? JN_T_VAR_END : JN_T_BLOCK_END, L->s + p - 2, 2)) return -1;
        L->pos = after_tag(L, p, kind, rsign);
        if (kind == '%' && L->n_toks >= 3 && is_raw_begin(L->toks, L->n_toks - 1)) {
            L->n_toks -= 3; /* the raw tag itself leaves nothing */
            if (lex_raw(L, &L->pos)) return -1;
        }
    }
    return push(L, JN_T_EOF, L->s + L->n, 0) ? 0 : -1;
}

int jn_lex(jn_ctx *c, const char *src, size_t len, jn_tok **toks, size_t *n)
{
    /* newlines as jinja2 reads them: \r\n and \r become \n, and one trailing newline goes */
    char *s = jn_alloc(&c->arena, len + 1);
    if (!s) {
        jn_fail(c, TD_ENOMEM, 0, "out of memory");
        return -1;
    }
    size_t m = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[m++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            s[m++] = src[i];
        }
    }
    if (m && s[m - 1] == '\n') m--;
    s[m] = '\0';
    lexer L = {.c = c, .s = s, .n = m, .line = 1, .line_starting = true};
    if (lex_all(&L)) {
        free(L.toks);
        return -1;
    }
    *toks = L.toks;
    *n = L.n_toks;
    return 0;
}
