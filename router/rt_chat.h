/* rt_chat.h: a /v1/chat/completions body's messages and tools -> the prompt text (prefix rt_).
 *
 * Purpose: validate `messages` (system, developer, user, assistant with or without
 * `tool_calls`, tool with `tool_call_id`), `tools`, `tool_choice` and `parallel_tool_calls`,
 * and render them with the model's chat template (common/chat_template.h), passing tools and
 * tool-call arguments to it as the Jinja template would see them under transformers and vLLM:
 * each tool object as the client sent it and each call's arguments string parsed, both
 * written by `tojson` (Python's json.dumps: ", " and ": " separators, keys in the order
 * given, non-ASCII kept, floats in Python's repr).
 * Support: tools, tool calls and tool messages need a template with Qwen2.5's tools block
 * (td_chat_has_tools); any other template answers them with a 400 that says so.
 * tool_choice "auto" (the default with tools) parses the output into tool_calls
 * (rt_tools.h); "none" keeps the tools in the prompt (as vLLM does) and returns text;
 * "required" and a named function force one call: t->grammar is a JSON schema of
 * {"name": <a declared name, or the named one>, "arguments": <valid under its parameters>}
 * (anyOf over the tools), which becomes the request's grammar (rt_openai.c), and the
 * output, that bare JSON call, is parsed into tool_calls as with "auto". `strict: true`
 * compiles the schema in strict mode (every listed property required); with "auto" it is a
 * 400 (a text answer could not be constrained).
 * Threading: HTTP threads; reads only the template text and the body.
 * Ownership: *text is malloc'd (the caller frees it); body is only read.
 */
#ifndef RT_CHAT_H
#define RT_CHAT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "rt_buf.h"

/* What the output side needs to know of a request's tools. */
typedef struct {
    bool parse;    /* tools with tool_choice "auto": the output is parsed into tool_calls */
    bool parallel; /* parallel_tool_calls (default true); false: the first call only */
    char **names;  /* (n_names) with parse: the declared tools' names, malloc'd */
    size_t n_names;
    bool forced;   /* tool_choice required or a named function */
    bool strict;   /* forced: a chosen function has strict true */
    char *grammar; /* forced: the call's JSON schema (malloc'd), for the request's grammar */
} rt_chat_tools;

void rt_chat_tools_fini(rt_chat_tools *t);

/* Validate the chat body's messages and tool fields, fill *t, and render the prompt with
 * the template tmpl[0..tmpl_len) into *text (add_generation_prompt: the assistant turn
 * opened at the end, as a chat request wants; /tokenize may ask for it off). Returns 0, or the HTTP
 * status with e filled
 * (*t may then hold names: rt_chat_tools_fini). */
int rt_chat_prompt(const char *tmpl, size_t tmpl_len, json_t *body, bool add_generation_prompt,
                   rt_chat_tools *t, char **text, rt_error *e);

/* v written as Python's json.dumps(v, ensure_ascii=False) writes it (Jinja's tojson under
 * transformers): malloc'd, NULL out of memory. */
char *rt_chat_pyjson(const json_t *v);

#endif
