/* rt_chat.h: a /v1/chat/completions body's messages and tools -> the prompt text (prefix rt_).
 *
 * Purpose: validate `messages` (system, developer, user, assistant with or without
 * `tool_calls` and reasoning, tool with `tool_call_id`), `tools`, `tool_choice`,
 * `parallel_tool_calls` and `chat_template_kwargs`, and render them with the model's own
 * Jinja chat template (jinja/jn.h) as transformers' apply_chat_template does under vLLM:
 * each tool object as the client sent it, each call's arguments string parsed into an object
 * (vLLM's rule), `tools` None without tools, the tokenizer's bos_token and eos_token, the
 * request's chat_template_kwargs (enable_thinking, ...) last.
 * The template: the GGUF's tokenizer.chat_template, or router.chat_template's file, or (for a
 * model file without one) a family's built-in one named there; a request with tools uses the
 * GGUF's tokenizer.chat_template.tool_use where there is one (transformers' rule).
 * Support: tools need a template that reads `tools` (a template that ignores them would hide
 * them from the model), else a 400 says so. A conversation the template refuses
 * (raise_exception: roles that do not alternate, ...) is a 400 with its message; a construct
 * the engine lacks is a 500 that names it.
 * tool_choice "auto" (the default with tools) parses the output into tool_calls
 * (rt_tools.h); "none" keeps the tools in the prompt (as vLLM does) and returns text;
 * "required" and a named function force one call: t->grammar is a JSON schema of
 * {"name": <a declared name, or the named one>, "arguments": <valid under its parameters>}
 * (anyOf over the tools), which becomes the request's grammar (rt_openai.c), and the
 * output, that bare JSON call, is parsed into tool_calls as with "auto". `strict: true`
 * compiles the schema in strict mode (every listed property required); with "auto" it is a
 * 400 (a text answer could not be constrained).
 * Threading: HTTP threads; the templates are read-only after rt_chat_tmpl_init.
 * Ownership: *text is malloc'd (the caller frees it); body is only read.
 */
#ifndef RT_CHAT_H
#define RT_CHAT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "gguf.h"
#include "jn.h"
#include "jn_chat.h"
#include "rt_buf.h"
#include "rt_reason.h"
#include "rt_toolfmt.h"
#include "tokenizer.h"

/* What the output side needs to know of a request's tools. */
typedef struct {
    bool parse;    /* tools with tool_choice "auto": the output is parsed into tool_calls */
    bool parallel; /* parallel_tool_calls (default true); false: the first call only */
    char **names;  /* (n_names) with parse: the declared tools' names, malloc'd */
    size_t n_names;
    rt_toolfmt fmt; /* with parse: the output's call format (hermes for a forced call) */
    json_t *tools;  /* with parse: the request's tools array (a reference), for rt_tools.h */
    bool forced;    /* tool_choice required or a named function */
    bool strict;    /* forced: a chosen function has strict true */
    char *grammar;  /* forced: the call's JSON schema (malloc'd), for the request's grammar */
} rt_chat_tools;

void rt_chat_tools_fini(rt_chat_tools *t);

/* The templates a router renders with; made once at start, read-only after. */
typedef struct {
    jn_template *main;     /* the model's, router.chat_template's file, or a family's */
    jn_template *tool_use; /* tokenizer.chat_template.tool_use (requests with tools), or NULL */
    bool reads_tools;      /* the template for requests with tools reads `tools` */
    rt_reason_fmt thinks;  /* its thinking block's markers, or none (rt_reason.h) */
    rt_toolfmt tool_fmt;   /* the call format its text teaches (rt_toolfmt_detect), or the one
                              router.tool_parser names (set by the router after init) */
    jn_special special;    /* bos_token, eos_token */
    char source[320];      /* where the template came from, for logs */
} rt_chat_tmpl;

/* From the model file g (its vocabulary tok) and router.chat_template `forced` ("": the
 * model's; chatml | llama3 | llama2 | gemma; else a template file). Returns 0, or an error
 * with the reason in err (a template that does not parse names its line). */
int rt_chat_tmpl_init(rt_chat_tmpl *t, const td_gguf *g, const td_tokenizer *tok,
                      const char *forced, char *err, size_t cap);
/* From a template text alone (tests): no tool_use template, no special tokens. */
int rt_chat_tmpl_init_text(rt_chat_tmpl *t, const char *text, size_t len, char *err, size_t cap);
void rt_chat_tmpl_fini(rt_chat_tmpl *t);

/* Validate the chat body's messages and tool fields, fill *t, and render the prompt into
 * *text (add_generation_prompt: the assistant turn opened at the end, as a chat request
 * wants; /tokenize may ask for it off). Returns 0, or the HTTP status with e filled (*t may
 * then hold names: rt_chat_tools_fini). */
int rt_chat_prompt(const rt_chat_tmpl *tmpl, json_t *body, bool add_generation_prompt,
                   rt_chat_tools *t, char **text, rt_error *e);

#endif
