/* rt_tools.h: the model's output -> OpenAI tool_calls, incrementally (prefix rt_).
 *
 * Purpose: a push parser for the tool-call format of the model's family (rt_toolfmt.h):
 * Hermes / Qwen2.5's
 *     <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
 * (the rules below), or the call blocks of another family. It is fed the generated text
 * piece by piece (after stop strings), emitting events in order:
 * content text, the start of a call (index, id, name) and its arguments in pieces as they
 * are generated, as vLLM streams them. The non-streamed answer is what the events add up to
 * (content, calls), so a stream assembles to exactly the non-streamed message.
 * Rules:
 *  - Text outside the calls is content; a run of it that is only whitespace and touches a
 *    call (the "\n" between two calls) is dropped. A partial "<tool_call>" at the end of
 *    the text so far is held back until it is decided.
 *  - A call whose text starts {"name": "<string>", "arguments": { is announced as soon as
 *    the "{" of the arguments arrives, and its arguments are streamed as generated while a
 *    JSON scanner follows them; the call ends at the value's closing bracket (what follows
 *    up to </tool_call> should be "}" and whitespace; anything else is dropped).
 *  - Any other call text is held until </tool_call> (or the end of the output) and parsed
 *    as JSON: an object with a string "name" and an "arguments" member is a call (its
 *    arguments re-written as vLLM writes them, json.dumps); otherwise the text, tags included, is
 * content, as vLLM's hermes parser leaves invalid JSON.
 *  - An unterminated call at the end of the output (max_tokens) keeps the arguments
 *    generated so far (finish_reason is then "length", as OpenAI reports it).
 *  - A call without the tags (Qwen2.5-Coder writes them so; llama.cpp's Hermes parser
 *    accepts them too): at the start of the output, or right after such a call, a JSON
 *    object {"name": "<a declared tool>", "arguments": {...}}, bare or inside a ```json
 *    fence. Any other text there is content.
 *  - parallel == false keeps the first call and drops the others.
 * The other formats: text outside the call blocks streams as it comes (a partial open
 * marker held back; a whitespace-only run that touches a block of calls is dropped); in a
 * block (from its open marker to its close marker, or the end of the output) each call is
 * emitted as soon as its name is complete and its arguments in pieces as they become
 * certain (rt_toolscan.h); at the block's end its
 * parse (rt_toolfmt_parse) completes them. A block that holds no call, and announced none,
 * is content, markers included (never lost); a call announced stands (a block that breaks
 * after it keeps the calls sent, as vLLM's streaming does).
 * Invariants: events carry only text the model generated, in order, each byte once;
 * content never holds a complete "<tool_call>" tag of a call that was parsed.
 * Threading: none (one parser per request, on the loop thread).
 * Ownership: the parser owns its buffers; event pointers are valid during the callback.
 */
#ifndef RT_TOOLS_H
#define RT_TOOLS_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "rt_toolfmt.h"

typedef enum {
    RT_TOOL_EV_CONTENT = 0, /* text: content */
    RT_TOOL_EV_CALL,        /* a call starts: index, id, name */
    RT_TOOL_EV_ARGS,        /* text: the next piece of call index's arguments */
} rt_tool_ev_kind;

typedef struct {
    rt_tool_ev_kind kind;
    int index;        /* CALL, ARGS: the call's index in the message's tool_calls */
    const char *id;   /* CALL: "call_" + 24 hex digits (mistral: 9 letters and digits; kimi_k2:
                         the id the model wrote, "functions.f:0") */
    const char *name; /* CALL: the function name */
    const char *text; /* CONTENT, ARGS: len bytes */
    size_t len;
} rt_tool_ev;

/* Receives each event; a non-zero return stops the feed and is returned by it. */
typedef int (*rt_tool_ev_fn)(void *ctx, const rt_tool_ev *ev);

typedef struct rt_toolp rt_toolp;

/* A parser; seed makes the call ids (the request id: unique per request); names: the
 * request's tools (a call without tags must name one; n_names 0: tagged calls only).
 * NULL: no memory. */
rt_toolp *rt_toolp_create(const char *seed, bool parallel, const char *const *names,
                          size_t n_names);
/* The same for the format fmt (rt_toolfmt.h; RT_TOOLFMT_HERMES is rt_toolp_create). tools:
 * the request's tools array, for the parameter types of qwen3_coder and glm45 (NULL: none;
 * a reference is kept until rt_toolp_destroy). names are only read by Hermes. */
rt_toolp *rt_toolp_create_fmt(rt_toolfmt fmt, const json_t *tools, const char *seed, bool parallel,
                              const char *const *names, size_t n_names);
void rt_toolp_destroy(rt_toolp *p);

/* Feed len bytes of output. fn may be NULL (the results are kept either way). Returns 0,
 * TD_ENOMEM, or fn's non-zero return. */
int rt_toolp_feed(rt_toolp *p, const char *text, size_t len, rt_tool_ev_fn fn, void *ctx);
/* The output has ended: decide what is held back. */
int rt_toolp_finish(rt_toolp *p, rt_tool_ev_fn fn, void *ctx);

/* What the events added up to. content: NULL when there was none. */
const char *rt_toolp_content(const rt_toolp *p, size_t *len);
int rt_toolp_n_calls(const rt_toolp *p);
/* The message's tool_calls array ([{id, type, function: {name, arguments}}]), new ref. */
json_t *rt_toolp_calls_json(const rt_toolp *p);
/* The delta object for a streamed event: {"content": ...} or {"tool_calls": [...]}. */
json_t *rt_tool_ev_delta(const rt_tool_ev *ev);

#endif
