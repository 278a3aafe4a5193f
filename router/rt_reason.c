/* rt_reason.c: reasoning and content apart, incrementally (see rt_reason.h). */
#define _GNU_SOURCE /* memmem */
#include "rt_reason.h"

#include <string.h>

/* The markers of each format, in detection order: a template naming both of a format's
 * markers has that format (<seed:think> first: its markers do not contain <think>'s, but a
 * template may quote both families). */
static const struct {
    const char *open, *close, *name;
} FMT[] = {
    [RT_REASON_SEED] = {"<seed:think>", "</seed:think>", "seed_oss"},
    [RT_REASON_MISTRAL] = {"[THINK]", "[/THINK]", "mistral"},
    [RT_REASON_GEMMA4] = {"<|channel>thought", "<channel|>", "gemma4"},
    [RT_REASON_THINK] = {"<think>", "</think>", "think"},
};
static const rt_reason_fmt ORDER[] = {RT_REASON_SEED, RT_REASON_MISTRAL, RT_REASON_GEMMA4,
                                      RT_REASON_THINK};

enum { START, REASONING, CONTENT };

/* Whitespace allowed before an opening marker: the run and a partial marker must fit in the
 * parser's held bytes, so the verdict never depends on how the text was split. */
#define MAX_LEAD 8
_Static_assert(MAX_LEAD + sizeof "<|channel>thought" <= sizeof((rt_reason *)0)->held,
               "held bytes: the lead and a marker's prefix");

const char *rt_reason_fmt_name(rt_reason_fmt f)
{
    return f > RT_REASON_NONE && f < RT_REASON_N ? FMT[f].name : "none";
}

void rt_reason_init(rt_reason *p, rt_reason_fmt fmt, bool open)
{
    if (fmt <= RT_REASON_NONE || fmt >= RT_REASON_N) fmt = RT_REASON_THINK;
    *p = (rt_reason){.state = open ? REASONING : START, .fmt = fmt};
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
    const char *open = FMT[p->fmt].open, *close = FMT[p->fmt].close;
    size_t lo = strlen(open), lc = strlen(close);
    if (p->state == CONTENT) {
        *rc = put(fn, ctx, false, s, n);
        return n;
    }
    if (p->state == START) {
        /* whitespace then the opening marker: reasoning; anything else: all content */
        size_t w = 0;
        while (w < n && all_space(s + w, 1))
            w++;
        size_t left = n - w, k = left < lo ? left : lo;
        if (w > MAX_LEAD || memcmp(s + w, open, k)) {
            p->state = CONTENT;
            return 0;
        }
        if (k < lo) return 0; /* undecided: held */
        p->state = REASONING;
        return w + lo;
    }
    const char *end = memmem(s, n, close, lc);
    if (end) {
        *rc = put(fn, ctx, true, s, (size_t)(end - s));
        p->state = CONTENT;
        return (size_t)(end - s) + lc;
    }
    size_t keep = partial_tail(s, n, close);
    *rc = put(fn, ctx, true, s, n - keep);
    return n - keep;
}

int rt_reason_feed(rt_reason *p, const char *text, size_t len, rt_reason_fn fn, void *ctx)
{
    /* the held bytes and the new text as one run (the held part is short: a marker's
       prefix, after at most MAX_LEAD bytes of whitespace) */
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
        size_t rest = n - used; /* <= MAX_LEAD + a marker's prefix: fits */
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

static bool has(const char *s, size_t len, const char *tag)
{
    return memmem(s, len, tag, strlen(tag)) != NULL;
}

rt_reason_fmt rt_reason_template(const char *tmpl, size_t len)
{
    for (size_t i = 0; i < sizeof ORDER / sizeof *ORDER; i++)
        if (has(tmpl, len, FMT[ORDER[i]].open) && has(tmpl, len, FMT[ORDER[i]].close))
            return ORDER[i];
    return RT_REASON_NONE;
}

/* The last occurrence of tag in s[0..len), or NULL. */
static const char *last(const char *s, size_t len, const char *tag)
{
    const char *hit = NULL;
    size_t n = strlen(tag);
    for (const char *p = s; (p = memmem(p, len - (size_t)(p - s), tag, n)); p++)
        hit = p;
    return hit;
}

bool rt_reason_prompt_open(rt_reason_fmt fmt, const char *prompt, size_t len)
{
    if (fmt <= RT_REASON_NONE || fmt >= RT_REASON_N) return false;
    const char *o = last(prompt, len, FMT[fmt].open), *c = last(prompt, len, FMT[fmt].close);
    return o && (!c || c < o);
}
