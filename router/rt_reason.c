/* rt_reason.c: reasoning and content apart, incrementally (see rt_reason.h). */
#define _GNU_SOURCE /* memmem */
#include "rt_reason.h"

#include <string.h>

static const char OPEN[] = "<think>", CLOSE[] = "</think>";

enum { START, REASONING, CONTENT };

/* Whitespace allowed before an opening <think>: the run and a partial tag must fit in the
 * parser's held bytes, so the verdict never depends on how the text was split. */
#define MAX_LEAD 8

void rt_reason_init(rt_reason *p, bool open)
{
    *p = (rt_reason){.state = open ? REASONING : START};
}

static int put(rt_reason_fn fn, void *ctx, bool reasoning, const char *s, size_t n)
{
    return n && fn ? fn(ctx, reasoning, s, n) : 0;
}

/* The longest tail of s[0..n) that is a proper prefix of tag (held back: it may become one). */
static size_t partial_tail(const char *s, size_t n, const char *tag)
{
    size_t t = strlen(tag);
    for (size_t k = t - 1 < n ? t - 1 : n; k > 0; k--)
        if (!memcmp(s + n - k, tag, k)) return k;
    return 0;
}

static bool all_space(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\n' && s[i] != '\t' && s[i] != '\r') return false;
    return true;
}

/* One step over s[0..n) (held text first): returns the bytes consumed. */
static size_t step(rt_reason *p, const char *s, size_t n, rt_reason_fn fn, void *ctx, int *rc)
{
    if (p->state == CONTENT) {
        *rc = put(fn, ctx, false, s, n);
        return n;
    }
    if (p->state == START) {
        /* whitespace then <think>: reasoning; anything else: all content */
        size_t w = 0;
        while (w < n && all_space(s + w, 1))
            w++;
        size_t left = n - w, k = left < sizeof OPEN - 1 ? left : sizeof OPEN - 1;
        if (w > MAX_LEAD || memcmp(s + w, OPEN, k)) {
            p->state = CONTENT;
            return 0;
        }
        if (k < sizeof OPEN - 1) return 0; /* undecided: held */
        p->state = REASONING;
        return w + sizeof OPEN - 1;
    }
    const char *end = memmem(s, n, CLOSE, sizeof CLOSE - 1);
    if (end) {
        *rc = put(fn, ctx, true, s, (size_t)(end - s));
        p->state = CONTENT;
        return (size_t)(end - s) + sizeof CLOSE - 1;
    }
    size_t keep = partial_tail(s, n, CLOSE);
    *rc = put(fn, ctx, true, s, n - keep);
    return n - keep;
}

int rt_reason_feed(rt_reason *p, const char *text, size_t len, rt_reason_fn fn, void *ctx)
{
    /* the held bytes and the new text as one run (the held part is short: a tag's prefix,
       after at most MAX_LEAD bytes of whitespace) */
    char buf[256];
    while (len || p->n_held) {
        size_t take = sizeof buf - p->n_held < len ? sizeof buf - p->n_held : len;
        memcpy(buf, p->held, p->n_held);
        memcpy(buf + p->n_held, text, take);
        size_t n = p->n_held + take, used = 0;
        text += take;
        len -= take;
        int rc = 0;
        for (;;) {
            int before = p->state;
            size_t k = step(p, buf + used, n - used, fn, ctx, &rc);
            used += k;
            if (rc) return rc;
            if (used == n || (k == 0 && p->state == before)) break;
        }
        size_t rest = n - used; /* <= MAX_LEAD + a tag's prefix: fits */
        memcpy(p->held, buf + used, rest);
        p->n_held = rest;
        if (!len) break;
    }
    return 0;
}

int rt_reason_finish(rt_reason *p, rt_reason_fn fn, void *ctx)
{
    int rc = put(fn, ctx, p->state == REASONING, p->held, p->n_held);
    p->n_held = 0;
    return rc;
}

bool rt_reason_template(const char *tmpl, size_t len)
{
    return memmem(tmpl, len, OPEN, sizeof OPEN - 1) && memmem(tmpl, len, CLOSE, sizeof CLOSE - 1);
}

bool rt_reason_prompt_open(const char *prompt, size_t len)
{
    const char *o = NULL, *c = NULL;
    for (const char *s = prompt; (s = memmem(s, len - (size_t)(s - prompt), OPEN, sizeof OPEN - 1));
         s++)
        o = s;
    for (const char *s = prompt;
         (s = memmem(s, len - (size_t)(s - prompt), CLOSE, sizeof CLOSE - 1)); s++)
        c = s;
    return o && (!c || c < o);
}
