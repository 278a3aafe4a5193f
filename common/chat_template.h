/* chat_template.h: render a conversation into the prompt text a model expects, from the
 * GGUF's tokenizer.chat_template string.
 *
 * Purpose: the CLI and the router turn OpenAI-style messages into a prompt without a Jinja
 * engine. The family is detected from the template text the way llama.cpp's
 * llm_chat_detect_template does, and each family is rendered by fixed code:
 *   chatml ("<|im_start|>": SmolLM2, Qwen), llama3 ("<|start_header_id|>" and
 *   "<|end_header_id|>"), llama2 ("[INST]", with its <<SYS>> / BOS-in-history / strip
 *   variants), gemma ("<start_of_turn>": Gemma 1-3; no system role, a system message is
 *   prepended to the next user turn, "assistant" is "model").
 * A chatml template that writes a literal default system message when the conversation
 * has none (SmolLM2's "You are a helpful AI assistant named SmolLM, ...") gets that text,
 * extracted from the template string, so the output equals what the Jinja template gives.
 * Tools (td_chat_render_tools): only the chatml templates with Qwen2.5's tools block; every
 * other family refuses tools, tool calls and "tool" messages with TD_EUNSUPP.
 * Invariants: output is NUL-terminated; unknown templates fail with TD_EUNSUPP (logged).
 * Threading: pure function; safe from any thread.
 * Ownership: *out is malloc'd, the caller frees it; inputs are only read.
 */
#ifndef TD_CHAT_TEMPLATE_H
#define TD_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

/* One function call of an assistant message, as the template writes it. */
typedef struct {
    const char *name;      /* function name (NUL-terminated) */
    const char *arguments; /* the arguments as Jinja's `tojson` writes them (Python json.dumps:
                              ", " and ": " separators, keys in order, non-ASCII kept) */
} td_chat_tool_call;

typedef struct {
    const char *role;    /* "system", "user", "assistant", "tool" (NUL-terminated) */
    const char *content; /* NUL-terminated; NULL only in an assistant message with tool calls */
    const td_chat_tool_call *tool_calls; /* (n_tool_calls): assistant messages only */
    size_t n_tool_calls;
} td_chat_msg;

typedef enum {
    TD_CHAT_UNKNOWN = 0,
    TD_CHAT_CHATML,
    TD_CHAT_LLAMA3,
    TD_CHAT_LLAMA2,
    TD_CHAT_GEMMA,
} td_chat_family;

/* Family of a template string (TD_CHAT_UNKNOWN if not recognised). */
td_chat_family td_chat_detect(const char *tmpl, size_t tmpl_len);

/* Render messages with the model's template. Returns 0, TD_EINVAL (NULL arguments or a
 * message without role/content), TD_EUNSUPP (unknown template, or a "tool" message or tool
 * calls with a template that has no tools), TD_ENOMEM. */
int td_chat_render(const char *tmpl, size_t tmpl_len, const td_chat_msg *msgs, size_t n,
                   bool add_generation_prompt, char **out);

/* Does the template render tools, tool calls and "tool" messages? True for the chatml
 * templates with Qwen2.5's (Hermes-style) tools block: the system turn lists each tool's
 * JSON inside <tools></tools>, an assistant call is "<tool_call>\n{"name": ..., "arguments":
 * ...}\n</tool_call>", consecutive "tool" messages become one user turn of
 * <tool_response> blocks. Recognised by the template's own literal text for each of these
 * pieces (and a literal default system message), so what is rendered is what it says. */
bool td_chat_has_tools(const char *tmpl, size_t tmpl_len);

/* td_chat_render with the request's tools: tools[0..n_tools) are each tool object as
 * `tojson` writes it ({"type": "function", "function": {...}}). n_tools > 0, tool calls or
 * "tool" messages need td_chat_has_tools (else TD_EUNSUPP). */
int td_chat_render_tools(const char *tmpl, size_t tmpl_len, const td_chat_msg *msgs, size_t n,
                         const char *const *tools, size_t n_tools, bool add_generation_prompt,
                         char **out);

#endif
