/* rt_toolscan.h: a call block's text so far -> the calls and argument pieces that are already
 * certain (prefix rt_).
 *
 * Purpose: the streaming half of a format's call blocks (rt_toolfmt.h): fed the growing
 * text of one block, from its open marker on, it announces each call as soon as its name is
 * complete and then hands out its arguments in pieces, as vLLM's streaming tool parsers of
 * the same names do:
 *   deepseek_v3, deepseek_v31, kimi_k2  the generated arguments text as it comes (a tail that
 *                                       may still be an end marker, or kimi's trailing
 *                                       whitespace, held back)
 *   qwen3_coder, glm45                  "{", then each parameter, "key": value typed from the
 *                                       schema, once its end tag is there
 *   llama3_json, mistral                the arguments re-written as json.dumps writes them,
 *                                       each token once it is complete (a string's characters
 *                                       as they come)
 *   pythonic                            "{", then each parameter, "key": value as
 *                                       ast.literal_eval reads it, once a "," or ")" ends it
 * The scanner reads the calls as rt_toolfmt_parse reads them, so what it hands out is a prefix
 * of that parse's calls whenever the whole block parses; what it cannot decide (a key order
 * other than name first, arguments nested deeper than 64, text it does not expect) stops it
 * for the rest of the block, and the caller takes the rest from rt_toolfmt_parse at the end.
 * Invariants: it never reads past the n bytes it is given, and never hands out a byte that
 * may still turn out to be part of a marker; calls are announced in order, and a call's
 * arguments only until the next call is announced.
 * Threading: none (one scanner per parser).
 * Ownership: the scanner owns its buffers (rt_toolscan_fini); tools is borrowed until then.
 */
#ifndef RT_TOOLSCAN_H
#define RT_TOOLSCAN_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "rt_buf.h"
#include "rt_toolfmt.h"

/* Where the scan hands its results: a call starts (id NULL: the parser makes one), or the
 * next piece of the newest call's arguments. A non-zero return stops the scan and is
 * returned by rt_toolscan_step. */
typedef struct {
    int (*call)(void *ctx, const char *name, size_t name_len, const char *id, size_t id_len);
    int (*args)(void *ctx, const char *s, size_t n);
    void *ctx;
} rt_toolscan_sink;

typedef struct {
    rt_toolfmt fmt;
    const json_t *tools; /* the request's tools (parameter types), or NULL: borrowed */
    int st;              /* the scan state (rt_toolscan.c) */
    size_t pos;          /* block offset: the text before it is decided */
    size_t a, b;         /* block offsets: the current name, key or value */
    size_t sent;         /* raw formats: block offset of the next argument byte to send */
    size_t tail;         /* JSON formats: where text that is no call follows the calls, or 0 */
    int n_params;        /* the current call's parameters sent (kimi_k2: bytes sent) */
    bool list;           /* mistral: inside a [{...}, ...] list */
    char *fname;         /* qwen3_coder, glm45: the current call's name */
    rt_buf args;         /* llama3_json, mistral: the re-written arguments sent so far */
    rt_buf tmp;          /* scratch: the re-written arguments of this step */
} rt_toolscan;

void rt_toolscan_init(rt_toolscan *t, rt_toolfmt f, const json_t *tools);
/* A new block starts: the state of the last one is dropped. */
void rt_toolscan_reset(rt_toolscan *t);
void rt_toolscan_fini(rt_toolscan *t);

/* The block's text so far is s[0..n) (s: the block from its open marker; n only grows from
 * one call to the next within a block). Hands k what became certain. Returns 0, TD_ENOMEM or
 * a sink's non-zero return. */
int rt_toolscan_step(rt_toolscan *t, const char *s, size_t n, const rt_toolscan_sink *k);

/* Longest suffix of s[0..n) that is a proper prefix of lit. */
size_t rt_toolscan_partial(const char *s, size_t n, const char *lit);

#endif
