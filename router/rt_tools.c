/* rt_tools.c: the tool-call push parser: Hermes / Qwen2.5 calls, and the call blocks of the
 * other formats (see rt_tools.h; the formats' markers and block parsers: rt_toolfmt.h).
 *
 * States (each feed moves through them as the text allows):
 *
 *   OUT --"<tool_call>"--> HEAD --{"name": "f", "arguments": {--> ARGS --value closed--> TAIL
 *    ^                      | other text                                                  |
 *    |                      v                                                             |
 *    +--"</tool_call>"---- RAW (held whole, parsed as JSON at the end tag)                |
 *    +--"</tool_call>" (or text that cannot belong to the tail) ---------------------------+
 *
 * BARE (the start when tools are declared, and after a call without tags): pend holds the
 * text that may still be {"name": <declared>, "arguments": { (or a ```json fence of it);
 * such a call goes to ARGS and its tail ends at its "}" (or the closing fence), back to
 * BARE; anything else is fed again from OUT.
 * OUT: pend holds outside text not yet emitted (whitespace only, or a partial tag).
 * HEAD, RAW: pend holds the call's text after "<tool_call>". TAIL: pend holds the text
 * after the arguments. ARGS: nothing is held; the scanner tracks strings and brackets.
 *
 * The other formats (rt_toolfmt.h) stream each call block through its scanner
 * (rt_toolscan.h) and settle it with the block's parse at its end:
 *
 *   BOUT --an open marker--> BLOCK --its close marker (or the end of the output)--> BOUT
 *
 * BOUT: pend holds outside text not yet emitted (whitespace only, a partial marker, or,
 * before any other text, what may still become an at_start marker). BLOCK: pend holds the
 * whitespace run before the block (blk_at bytes) and the block from its open marker on;
 * each feed lets the scan emit what became certain (sent: its calls as sent); at its end
 * the block is parsed: the calls sent get the rest of their arguments and the further calls
 * follow whole (settle_block) or, when it holds none and none was sent, all of pend is
 * content. */
#define _GNU_SOURCE /* memmem */
#include "rt_tools.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jn.h"
#include "rt_buf.h"
#include "rt_chat.h"
#include "rt_toolfmt.h"
#include "rt_toolscan.h"
#include "td_err.h"
#include "td_grow.h"

static const char OPEN[] = "<tool_call>", CLOSE[] = "</tool_call>";
#define OPEN_LEN  (sizeof OPEN - 1)
#define CLOSE_LEN (sizeof CLOSE - 1)
#define MAX_DEPTH 64

typedef enum {
    ST_OUT = 0,
    ST_HEAD,
    ST_RAW,
    ST_ARGS,
    ST_TAIL,
    ST_BARE,
    ST_BOUT,
    ST_BLOCK
} rt_toolp_state;
typedef enum { END_TAG = 0, END_FENCE, END_BRACE } rt_toolp_end;

typedef struct {
    char *id;
    char *name;
    rt_buf args;
} rt_toolp_call;

/* A call the scan of the current block announced, and its arguments as sent. */
typedef struct {
    char *name;
    rt_buf args;
} rt_toolp_sent;

struct rt_toolp {
    rt_toolp_state st;
    rt_buf pend;
    bool seg_text;  /* OUT: the current outside run has emitted text */
    bool seen_call; /* a "<tool_call>" tag was seen */
    bool dropping;  /* the current call is dropped (parallel == false, not the first) */
    /* ARGS scanner */
    char stack[MAX_DEPTH];
    int depth;
    bool in_str, esc;
    /* TAIL: "}" seen */
    bool tail_brace;
    rt_toolp_end end; /* what ends the current call: </tool_call>, ``` or its own "}" */
    /* the other formats (BOUT, BLOCK) */
    rt_toolfmt fmt;
    const rt_toolfmt_marker *marks; /* (n_marks) the format's block markers */
    size_t n_marks;
    const rt_toolfmt_marker *cur; /* BLOCK: the marker that opened it */
    size_t blk_at;                /* BLOCK: where the block starts in pend */
    bool started;                 /* BOUT: an at_start marker can no longer open a block */
    json_t *tools;                /* the request's tools (parameter types), or NULL */
    rt_toolscan scan;             /* BLOCK: what of the block is already certain */
    rt_toolp_sent *sent;          /* (n_sent) BLOCK: the calls the scan announced */
    int n_sent, cap_sent;
    char **names;                 /* (n_names) the declared tools: a bare call must name one */
    size_t n_names;
    /* results */
    rt_buf content;
    bool has_content;
    rt_toolp_call *calls;
    int n_calls, cap_calls;
    bool parallel;
    uint64_t seed;
    /* the event sink of the feed in progress */
    rt_tool_ev_fn fn;
    void *ctx;
};

rt_toolp *rt_toolp_create(const char *seed, bool parallel, const char *const *names, size_t n_names)
{
    return rt_toolp_create_fmt(RT_TOOLFMT_HERMES, NULL, seed, parallel, names, n_names);
}

rt_toolp *rt_toolp_create_fmt(rt_toolfmt fmt, const json_t *tools, const char *seed, bool parallel,
                              const char *const *names, size_t n_names)
{
    rt_toolp *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->parallel = parallel;
    p->fmt = fmt;
    p->marks = rt_toolfmt_markers(fmt, &p->n_marks);
    if (p->n_marks) n_names = 0; /* untagged Hermes calls are Hermes' alone */
    p->tools = json_incref((json_t *)tools);
    rt_toolscan_init(&p->scan, fmt, p->tools);
    p->names = n_names ? calloc(n_names, sizeof *p->names) : NULL;
    for (size_t i = 0; i < n_names && p->names; i++)
        if ((p->names[p->n_names] = strdup(names[i]))) p->n_names++;
    if (p->n_names != n_names) {
        rt_toolp_destroy(p);
        return NULL;
    }
    p->st = p->n_marks ? ST_BOUT : n_names ? ST_BARE : ST_OUT;
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (const char *c = seed ? seed : ""; *c; c++)
        h = (h ^ (unsigned char)*c) * 1099511628211ull;
    p->seed = h;
    return p;
}

void rt_toolp_destroy(rt_toolp *p)
{
    if (!p) return;
    for (int i = 0; i < p->n_calls; i++) {
        free(p->calls[i].id);
        free(p->calls[i].name);
        rt_buf_free(&p->calls[i].args);
    }
    free(p->calls);
    for (size_t i = 0; i < p->n_names; i++)
        free(p->names[i]);
    free(p->names);
    for (int i = 0; i < p->cap_sent; i++) {
        free(p->sent[i].name);
        rt_buf_free(&p->sent[i].args);
    }
    free(p->sent);
    rt_toolscan_fini(&p->scan);
    json_decref(p->tools);
    rt_buf_free(&p->pend);
    rt_buf_free(&p->content);
    free(p);
}

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static bool is_ws(char c)
{
    return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

static bool all_ws(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!is_ws(s[i])) return false;
    return true;
}

/* ---- events ---- */

static int ev(rt_toolp *p, const rt_tool_ev *e)
{
    return p->fn ? p->fn(p->ctx, e) : 0;
}

static int emit_content(rt_toolp *p, const char *s, size_t n)
{
    if (!n) return 0;
    if (rt_buf_append(&p->content, s, n)) return TD_ENOMEM;
    p->has_content = true;
    return ev(p, &(rt_tool_ev){.kind = RT_TOOL_EV_CONTENT, .text = s, .len = n});
}

/* A new call's id: "call_" + 24 hex digits, 9 letters and digits for Mistral (its templates
 * refuse any other id in the history, as vLLM's mistral parser makes them). */
static char *make_id(const rt_toolp *p)
{
    static const char ALNUM[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    uint64_t a = mix(p->seed ^ (uint64_t)p->n_calls), b = mix(a);
    char id[32];
    if (p->fmt == RT_TOOLFMT_MISTRAL) {
        for (int i = 0; i < 9; i++, a /= 62)
            id[i] = ALNUM[a % 62];
        id[9] = 0;
    } else {
        snprintf(id, sizeof id, "call_%016llx%08llx", (unsigned long long)a,
                 (unsigned long long)(b >> 32));
    }
    return strdup(id);
}

/* id: the call's id as the format wrote it, or NULL: one is made. */
static int start_call(rt_toolp *p, const char *name, size_t name_len, const char *id)
{
    if (!p->parallel && p->n_calls >= 1) {
        p->dropping = true;
        return 0;
    }
    p->dropping = false;
    if (TD_GROW_INT(p->calls, p->cap_calls, p->n_calls + 1, 4)) return TD_ENOMEM;
    rt_toolp_call *c = &p->calls[p->n_calls];
    *c = (rt_toolp_call){0};
    c->name = strndup(name, name_len);
    c->id = id ? strdup(id) : make_id(p);
    if (!c->name || !c->id) {
        free(c->name);
        free(c->id);
        return TD_ENOMEM;
    }
    int idx = p->n_calls++;
    return ev(p,
              &(rt_tool_ev){.kind = RT_TOOL_EV_CALL, .index = idx, .id = c->id, .name = c->name});
}

static int call_args(rt_toolp *p, const char *s, size_t n)
{
    if (p->dropping || !n) return 0;
    rt_toolp_call *c = &p->calls[p->n_calls - 1];
    if (rt_buf_append(&c->args, s, n)) return TD_ENOMEM;
    return ev(p,
              &(rt_tool_ev){.kind = RT_TOOL_EV_ARGS, .index = p->n_calls - 1, .text = s, .len = n});
}

/* ---- OUT ---- */

/* Longest suffix of s[0..n) that is a proper prefix of "<tool_call>". */
static size_t open_holdback(const char *s, size_t n)
{
    for (size_t k = n < OPEN_LEN - 1 ? n : OPEN_LEN - 1; k > 0; k--)
        if (!memcmp(s + n - k, OPEN, k)) return k;
    return 0;
}

static size_t feed_out(rt_toolp *p, const char *s, size_t n, int *rc)
{
    size_t old = p->pend.len;
    if ((*rc = rt_buf_append(&p->pend, s, n) ? TD_ENOMEM : 0)) return n;
    const char *hit = memmem(p->pend.buf, p->pend.len, OPEN, OPEN_LEN);
    if (hit) {
        size_t k = (size_t)(hit - p->pend.buf);
        if (p->seg_text || !all_ws(p->pend.buf, k)) *rc = emit_content(p, p->pend.buf, k);
        p->pend.len = 0;
        p->st = ST_HEAD;
        p->seen_call = true;
        return k + OPEN_LEN - old;
    }
    size_t send = p->pend.len - open_holdback(p->pend.buf, p->pend.len);
    if (send && (p->seg_text || !all_ws(p->pend.buf, send))) {
        p->seg_text = true;
        *rc = emit_content(p, p->pend.buf, send);
        rt_buf_consume(&p->pend, send);
    }
    return n;
}

/* ---- HEAD: {"name": "<string>", "arguments": { ---- */

typedef enum { HEAD_MORE, HEAD_FAIL, HEAD_OK } rt_head;

static size_t skip_ws(const char *s, size_t i, size_t n)
{
    while (i < n && is_ws(s[i]))
        i++;
    return i;
}

/* Match lit at s[*i]: HEAD_OK (advanced), HEAD_MORE (s ends inside it), HEAD_FAIL. */
static rt_head lit(const char *s, size_t n, size_t *i, const char *l)
{
    size_t k = strlen(l), have = n - *i < k ? n - *i : k;
    if (memcmp(s + *i, l, have)) return HEAD_FAIL;
    if (have < k) return HEAD_MORE;
    *i += k;
    return HEAD_OK;
}

/* The header of s[0..n): on HEAD_OK, *name_at and *name_len give the JSON string token (quotes
 * included) and *val is the offset of the arguments' "{". */
static rt_head match_head(const char *s, size_t n, size_t *name_at, size_t *name_len, size_t *val)
{
    static const char *const steps[] = {"{", "\"name\"", ":", NULL, ",", "\"arguments\"", ":"};
    size_t i = 0;
    for (size_t k = 0; k < sizeof steps / sizeof steps[0]; k++) {
        i = skip_ws(s, i, n);
        if (i == n) return HEAD_MORE;
        if (steps[k]) {
            rt_head h = lit(s, n, &i, steps[k]);
            if (h != HEAD_OK) return h;
            continue;
        }
        if (s[i] != '"') return HEAD_FAIL;
        size_t j = i + 1;
        while (j < n && s[j] != '"') {
            if (s[j] == '\n' || (unsigned char)s[j] < 0x20) return HEAD_FAIL;
            j += s[j] == '\\' ? 2 : 1;
        }
        if (j >= n) return HEAD_MORE;
        *name_at = i;
        *name_len = j + 1 - i;
        i = j + 1;
    }
    i = skip_ws(s, i, n);
    if (i == n) return HEAD_MORE;
    if (s[i] != '{') return HEAD_FAIL;
    *val = i;
    return HEAD_OK;
}

static size_t feed_head(rt_toolp *p, const char *s, size_t n, int *rc)
{
    size_t old = p->pend.len;
    if ((*rc = rt_buf_append(&p->pend, s, n) ? TD_ENOMEM : 0)) return n;
    size_t at = 0, len = 0, val = 0;
    rt_head h = match_head(p->pend.buf, p->pend.len, &at, &len, &val);
    if (h == HEAD_MORE) return n;
    if (h == HEAD_FAIL) {
        p->st = ST_RAW;
        p->pend.len = old; /* RAW takes the same bytes again */
        return 0;
    }
    json_t *name = json_loadb(p->pend.buf + at, len, JSON_DECODE_ANY, NULL);
    if (!name || !json_is_string(name)) {
        json_decref(name);
        p->st = ST_RAW;
        p->pend.len = old;
        return 0;
    }
    *rc = start_call(p, json_string_value(name), json_string_length(name), NULL);
    json_decref(name);
    p->pend.len = 0;
    p->st = ST_ARGS;
    p->end = END_TAG;
    p->depth = 0;
    p->in_str = p->esc = false;
    return val - old; /* the "{" is fed to ARGS */
}

/* ---- RAW: held until </tool_call>, then JSON or content ---- */

static int finish_raw(rt_toolp *p, bool closed)
{
    const char *s = p->pend.buf ? p->pend.buf : "";
    json_t *o = json_loadb(s, p->pend.len, JSON_REJECT_DUPLICATES, NULL);
    json_t *name = json_object_get(o, "name"), *args = json_object_get(o, "arguments");
    int rc = 0;
    if (json_is_string(name) && args) {
        char *a = jn_pyjson(args);
        rc = a ? start_call(p, json_string_value(name), json_string_length(name), NULL) : TD_ENOMEM;
        if (!rc) rc = call_args(p, a, strlen(a));
        free(a);
    } else {
        rt_buf b = {0};
        int e = rt_buf_puts(&b, OPEN) || rt_buf_append(&b, s, p->pend.len) ||
                (closed && rt_buf_puts(&b, CLOSE));
        rc = e ? TD_ENOMEM : emit_content(p, b.buf, b.len);
        rt_buf_free(&b);
    }
    json_decref(o);
    p->pend.len = 0;
    return rc;
}

static size_t feed_raw(rt_toolp *p, const char *s, size_t n, int *rc)
{
    size_t old = p->pend.len;
    if ((*rc = rt_buf_append(&p->pend, s, n) ? TD_ENOMEM : 0)) return n;
    const char *hit = memmem(p->pend.buf, p->pend.len, CLOSE, CLOSE_LEN);
    if (!hit) return n;
    size_t k = (size_t)(hit - p->pend.buf);
    p->pend.len = k;
    *rc = finish_raw(p, true);
    p->st = ST_OUT;
    p->seg_text = false;
    return k + CLOSE_LEN - old;
}

/* ---- ARGS: a JSON value scanner (strings, brackets) ---- */

static size_t feed_args(rt_toolp *p, const char *s, size_t n, int *rc)
{
    size_t i = 0;
    bool done = false, bad = false;
    for (; i < n && !done && !bad; i++) {
        char c = s[i];
        if (p->in_str) {
            if (p->esc)
                p->esc = false;
            else if (c == '\\')
                p->esc = true;
            else if (c == '"')
                p->in_str = false;
        } else if (c == '"') {
            p->in_str = true;
        } else if (c == '{' || c == '[') {
            if (p->depth == MAX_DEPTH)
                bad = true;
            else
                p->stack[p->depth++] = c == '{' ? '}' : ']';
        } else if (c == '}' || c == ']') {
            if (!p->depth || p->stack[p->depth - 1] != c)
                bad = true;
            else
                done = --p->depth == 0;
        } else if (!strchr(" \t\r\n,:-+.0123456789eEtruefalsn", c)) {
            bad = true;
        }
    }
    if (bad) i--; /* the offending byte starts the tail */
    *rc = call_args(p, s, i);
    if (done || bad) {
        p->st = ST_TAIL;
        p->tail_brace = false;
        p->pend.len = 0;
    }
    return i;
}

/* ---- TAIL: "}" and whitespace, then </tool_call> ---- */

static size_t feed_tail(rt_toolp *p, const char *s, size_t n, int *rc)
{
    const char *term = p->end == END_FENCE ? "```" : CLOSE;
    size_t term_len = strlen(term);
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (p->pend.len) { /* inside the end tag (or fence) */
            if ((*rc = rt_buf_append(&p->pend, &c, 1) ? TD_ENOMEM : 0)) return n;
            if (memcmp(p->pend.buf, term, p->pend.len)) {
                /* not the end tag: the call is over, and the held bytes are outside text
                   (OUT takes pend as its own pending text) */
                p->st = ST_OUT;
                p->seg_text = false;
                return i + 1;
            }
            if (p->pend.len == term_len) {
                p->pend.len = 0;
                p->st = p->end == END_TAG ? ST_OUT : ST_BARE;
                p->seg_text = false;
                return i + 1;
            }
        } else if (c == term[0] && p->end != END_BRACE) {
            *rc = rt_buf_append(&p->pend, &c, 1) ? TD_ENOMEM : 0;
        } else if (c == '}' && !p->tail_brace) {
            p->tail_brace = true;
            if (p->end == END_BRACE) { /* a bare call ends with its own object */
                p->st = ST_BARE;
                return i + 1;
            }
        } else if (!is_ws(c)) {
            p->st = ST_OUT; /* text that is no part of a tail: outside text */
            p->seg_text = false;
            return i;
        }
    }
    return n;
}

/* ---- BARE: a call without the tags, where one may start ---- */

static int feed_all(rt_toolp *p, const char *text, size_t len);

/* Qwen2.5-Coder writes its calls without <tool_call> tags, as a JSON object
 * {"name": ..., "arguments": {...}}, sometimes in a ```json fence; llama.cpp's Hermes
 * parser accepts those forms too. Only at the start of the output (or right after such a
 * call), and only for a declared tool's name: anything else is plain text. */
static rt_head match_bare(const char *s, size_t n, bool *fenced, size_t *name_at, size_t *name_len,
                          size_t *val)
{
    size_t i = skip_ws(s, 0, n);
    *fenced = false;
    if (i < n && s[i] == '`') {
        rt_head h = lit(s, n, &i, "```");
        if (h != HEAD_OK) return h;
        if (i < n && s[i] == 'j' && (h = lit(s, n, &i, "json")) != HEAD_OK) return h;
        if (i == n) return HEAD_MORE;
        *fenced = true;
    }
    size_t at = 0, len = 0, v = 0;
    rt_head h = match_head(s + i, n - i, &at, &len, &v);
    *name_at = i + at;
    *name_len = len;
    *val = i + v;
    return h;
}

static bool declared(const rt_toolp *p, const char *name)
{
    for (size_t i = 0; i < p->n_names; i++)
        if (!strcmp(p->names[i], name)) return true;
    return false;
}

static size_t feed_bare(rt_toolp *p, const char *s, size_t n, int *rc)
{
    size_t old = p->pend.len;
    if ((*rc = rt_buf_append(&p->pend, s, n) ? TD_ENOMEM : 0)) return n;
    bool fenced = false;
    size_t at = 0, len = 0, val = 0;
    rt_head h = match_bare(p->pend.buf, p->pend.len, &fenced, &at, &len, &val);
    if (h == HEAD_MORE) return n;
    json_t *name = h == HEAD_OK ? json_loadb(p->pend.buf + at, len, JSON_DECODE_ANY, NULL) : NULL;
    if (!json_is_string(name) || !declared(p, json_string_value(name))) {
        json_decref(name);
        /* plain text (or a tagged call): fed again from OUT */
        char *tmp = malloc(p->pend.len + 1);
        size_t tl = p->pend.len;
        if (!tmp) {
            *rc = TD_ENOMEM;
            return n;
        }
        memcpy(tmp, p->pend.buf, tl);
        p->pend.len = 0;
        p->st = ST_OUT;
        p->seg_text = false;
        *rc = feed_all(p, tmp, tl);
        free(tmp);
        return n;
    }
    p->seen_call = true;
    *rc = start_call(p, json_string_value(name), json_string_length(name), NULL);
    json_decref(name);
    p->pend.len = 0;
    p->st = ST_ARGS;
    p->end = fenced ? END_FENCE : END_BRACE;
    p->depth = 0;
    p->in_str = p->esc = false;
    return val - old;
}

/* ---- BOUT, BLOCK: the call blocks of the other formats ---- */

/* Longest suffix of s[0..n) that is a proper prefix of an anywhere marker. */
static size_t marks_holdback(const rt_toolp *p, const char *s, size_t n)
{
    size_t best = 0;
    for (size_t m = 0; m < p->n_marks; m++) {
        const char *o = p->marks[m].open;
        size_t ol = strlen(o);
        for (size_t k = n < ol - 1 ? n : ol - 1; k > best && !p->marks[m].at_start; k--)
            if (!memcmp(s + n - k, o, k)) best = k;
    }
    return best;
}

/* pend[at..) starts a block opened by marker m: BLOCK, pend cut after the marker (the rest
 * of the input is fed again). Returns the input bytes taken. */
static size_t open_block(rt_toolp *p, const rt_toolfmt_marker *m, size_t at, size_t old)
{
    size_t end = at + strlen(m->open);
    p->pend.len = end;
    p->st = ST_BLOCK;
    p->cur = m;
    p->seen_call = true;
    p->n_sent = 0;
    rt_toolscan_reset(&p->scan);
    return end - old;
}

/* Before any other text: the output may still open with an at_start marker ("{", "[").
 * Returns true when that is undecided (all held) or a block opened (*took set). */
static bool at_start(rt_toolp *p, size_t old, size_t *took)
{
    size_t i = 0, n = p->pend.len;
    while (i < n && is_ws(p->pend.buf[i]))
        i++;
    if (i == n) {
        *took = n - old;
        return true;
    }
    for (size_t m = 0; m < p->n_marks; m++) {
        const char *o = p->marks[m].open;
        size_t ol = strlen(o), have = n - i < ol ? n - i : ol;
        if (!p->marks[m].at_start || memcmp(p->pend.buf + i, o, have)) continue;
        if (have < ol) {
            *took = n - old;
            return true;
        }
        p->blk_at = 0; /* the whitespace before it belongs to the block */
        *took = open_block(p, &p->marks[m], i, old);
        return true;
    }
    p->started = true;
    return false;
}

static size_t feed_bout(rt_toolp *p, const char *s, size_t n, int *rc)
{
    size_t old = p->pend.len, took = 0;
    if ((*rc = rt_buf_append(&p->pend, s, n) ? TD_ENOMEM : 0)) return n;
    if (!p->started && at_start(p, old, &took)) return took;
    const char *buf = p->pend.buf, *first = NULL;
    const rt_toolfmt_marker *fm = NULL;
    for (size_t m = 0; m < p->n_marks; m++) {
        const char *o = p->marks[m].open, *hit;
        if (p->marks[m].at_start) continue;
        if ((hit = memmem(buf, p->pend.len, o, strlen(o))) && (!first || hit < first))
            first = hit, fm = &p->marks[m];
    }
    if (first) {
        size_t k = (size_t)(first - buf);
        if (p->seg_text || !all_ws(buf, k)) {
            *rc = emit_content(p, buf, k);
            rt_buf_consume(&p->pend, k);
            old -= k; /* may wrap: open_block's difference stays right */
            k = 0;
        }
        p->blk_at = k; /* a whitespace run before the block: content only if it fails */
        return open_block(p, fm, k, old);
    }
    size_t send = p->pend.len - marks_holdback(p, buf, p->pend.len);
    if (send && (p->seg_text || !all_ws(buf, send))) {
        p->seg_text = true;
        *rc = emit_content(p, buf, send);
        rt_buf_consume(&p->pend, send);
    }
    return n;
}

/* The scan's sink: a call of the block starts (recorded as sent, then emitted). */
static int scan_call(void *ctx, const char *name, size_t len, const char *id, size_t id_len)
{
    rt_toolp *p = ctx;
    int cap = p->cap_sent;
    if (TD_GROW_INT(p->sent, p->cap_sent, p->n_sent + 1, 4)) return TD_ENOMEM;
    memset(p->sent + cap, 0, (size_t)(p->cap_sent - cap) * sizeof *p->sent);
    rt_toolp_sent *c = &p->sent[p->n_sent];
    free(c->name);
    c->args.len = 0;
    char *idz = id ? strndup(id, id_len) : NULL;
    if (!(c->name = strndup(name, len)) || (id && !idz)) {
        free(idz);
        return TD_ENOMEM;
    }
    p->n_sent++;
    int rc = start_call(p, name, len, idz);
    free(idz);
    return rc;
}

static int scan_args(void *ctx, const char *s, size_t n)
{
    rt_toolp *p = ctx;
    if (rt_buf_append(&p->sent[p->n_sent - 1].args, s, n)) return TD_ENOMEM;
    return call_args(p, s, n);
}

/* BLOCK: hand out what of the block so far is certain (pend less a partial close marker). */
static int scan_block(rt_toolp *p)
{
    size_t n = p->pend.len - p->blk_at;
    const char *b = p->pend.buf + p->blk_at;
    if (p->cur->close) n -= rt_toolscan_partial(b, n, p->cur->close);
    rt_toolscan_sink k = {.call = scan_call, .args = scan_args, .ctx = p};
    return rt_toolscan_step(&p->scan, b, n, &k);
}

/* The block's calls (its parse) after the scan announced n_sent of them: each of those that
 * is the parse's call of the same place with arguments the parse's begin with gets the rest
 * (only the newest can still be short: the scan finishes a call before it starts the next);
 * the parse's further calls follow whole. A call sent that the parse does not confirm (the
 * output broke off inside it, or the block turned out malformed) stands as it was sent,
 * and so does the answer: nothing of the block is taken back, as vLLM's streaming parsers
 * never take back a delta (the caller returns text after the calls as content). */
static int settle_block(rt_toolp *p, const rt_toolfmt_calls *calls, bool *confirmed)
{
    bool same = p->n_sent <= calls->n;
    int rc = 0;
    for (int i = 0; i < p->n_sent && same && !rc; i++) {
        const rt_toolfmt_call *c = &calls->v[i];
        const rt_buf *a = &p->sent[i].args;
        size_t len = strlen(c->args);
        same = !strcmp(c->name, p->sent[i].name) && a->len <= len &&
               !memcmp(c->args, a->buf ? a->buf : "", a->len);
        if (same && a->len < len) {
            same = i == p->n_sent - 1;
            if (same) rc = call_args(p, c->args + a->len, len - a->len);
        }
    }
    for (int i = p->n_sent; same && i < calls->n && !rc; i++) {
        const rt_toolfmt_call *c = &calls->v[i];
        rc = start_call(p, c->name, strlen(c->name), c->id);
        if (!rc) rc = call_args(p, c->args, strlen(c->args));
    }
    *confirmed = same;
    return rc;
}

/* The block in pend is complete: its calls, or all of pend as content. */
static int finish_block(rt_toolp *p)
{
    rt_toolfmt_calls calls = {0};
    const char *b = p->pend.buf + p->blk_at;
    int rc = rt_toolfmt_parse(p->fmt, b, p->pend.len - p->blk_at, p->tools, &calls);
    bool confirmed = true;
    if (!rc) rc = settle_block(p, &calls, &confirmed);
    bool any = calls.n || p->n_sent;
    if (!rc && !confirmed && p->scan.tail) /* text after the calls sent: content, not lost */
        rc = emit_content(p, b + p->scan.tail, p->pend.len - p->blk_at - p->scan.tail);
    if (!rc && !any) rc = emit_content(p, p->pend.buf, p->pend.len);
    p->seg_text = !any; /* a block left as content is text that whitespace may follow */
    p->n_sent = 0;
    rt_toolfmt_calls_fini(&calls);
    p->pend.len = 0;
    p->st = ST_BOUT;
    p->started = true;
    return rc;
}

static size_t feed_block(rt_toolp *p, const char *s, size_t n, int *rc)
{
    size_t old = p->pend.len;
    if ((*rc = rt_buf_append(&p->pend, s, n) ? TD_ENOMEM : 0)) return n;
    const char *close = p->cur->close;
    if (!close) { /* the block runs to the end of the output */
        *rc = scan_block(p);
        return n;
    }
    size_t cl = strlen(close), from = p->blk_at + strlen(p->cur->open);
    if (old > from + cl) from = old - cl; /* the close may straddle the feeds */
    const char *hit = memmem(p->pend.buf + from, p->pend.len - from, close, cl);
    if (!hit) {
        *rc = scan_block(p);
        return n;
    }
    size_t end = (size_t)(hit - p->pend.buf) + cl;
    p->pend.len = end - cl; /* the scan first: the answer must not depend on the pieces */
    *rc = scan_block(p);
    p->pend.len = end;
    if (!*rc) *rc = finish_block(p);
    return end - old;
}

/* ---- driver ---- */

int rt_toolp_feed(rt_toolp *p, const char *text, size_t len, rt_tool_ev_fn fn, void *ctx)
{
    p->fn = fn;
    p->ctx = ctx;
    return feed_all(p, text, len);
}

static int feed_all(rt_toolp *p, const char *text, size_t len)
{
    int rc = 0;
    while (len && !rc) {
        size_t k = 0;
        switch (p->st) {
        case ST_OUT:
            k = feed_out(p, text, len, &rc);
            break;
        case ST_HEAD:
            k = feed_head(p, text, len, &rc);
            break;
        case ST_RAW:
            k = feed_raw(p, text, len, &rc);
            break;
        case ST_ARGS:
            k = feed_args(p, text, len, &rc);
            break;
        case ST_TAIL:
            k = feed_tail(p, text, len, &rc);
            break;
        case ST_BARE:
            k = feed_bare(p, text, len, &rc);
            break;
        case ST_BOUT:
            k = feed_bout(p, text, len, &rc);
            break;
        case ST_BLOCK:
            k = feed_block(p, text, len, &rc);
            break;
        }
        text += k;
        len -= k;
    }
    return rc;
}

int rt_toolp_finish(rt_toolp *p, rt_tool_ev_fn fn, void *ctx)
{
    p->fn = fn;
    p->ctx = ctx;
    int rc = 0;
    if (p->st == ST_BLOCK) {
        rc = finish_block(p);
    } else if (p->st == ST_OUT || p->st == ST_BARE || p->st == ST_BOUT) {
        if (p->seg_text || !p->seen_call || !all_ws(p->pend.buf, p->pend.len))
            rc = emit_content(p, p->pend.buf, p->pend.len);
    } else if (p->st == ST_HEAD || p->st == ST_RAW) {
        rc = finish_raw(p, false);
    }
    p->pend.len = 0;
    p->st = p->n_marks ? ST_BOUT : ST_OUT;
    p->started = true;
    p->seen_call = true;
    p->seg_text = false;
    return rc;
}

const char *rt_toolp_content(const rt_toolp *p, size_t *len)
{
    *len = p->content.len;
    return p->has_content ? p->content.buf : NULL;
}

int rt_toolp_n_calls(const rt_toolp *p)
{
    return p->n_calls;
}

json_t *rt_toolp_calls_json(const rt_toolp *p)
{
    json_t *a = json_array();
    for (int i = 0; a && i < p->n_calls; i++) {
        const rt_toolp_call *c = &p->calls[i];
        const char *args = c->args.buf ? c->args.buf : "";
        if (json_array_append_new(a, json_pack("{s:s, s:s, s:{s:s, s:s%}}", "id", c->id, "type",
                                               "function", "function", "name", c->name, "arguments",
                                               args, c->args.len))) {
            json_decref(a);
            return NULL;
        }
    }
    return a;
}

json_t *rt_tool_ev_delta(const rt_tool_ev *e)
{
    if (e->kind == RT_TOOL_EV_CONTENT) return json_pack("{s:s%}", "content", e->text, e->len);
    if (e->kind == RT_TOOL_EV_CALL)
        return json_pack("{s:[{s:i, s:s, s:s, s:{s:s, s:s}}]}", "tool_calls", "index", e->index,
                         "id", e->id, "type", "function", "function", "name", e->name, "arguments",
                         "");
    return json_pack("{s:[{s:i, s:{s:s%}}]}", "tool_calls", "index", e->index, "function",
                     "arguments", e->text, e->len);
}
