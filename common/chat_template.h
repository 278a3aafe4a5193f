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
 * Invariants: output is NUL-terminated; unknown templates fail with TD_EUNSUPP (logged).
 * Threading: pure function; safe from any thread.
 * Ownership: *out is malloc'd, the caller frees it; inputs are only read.
 */
#ifndef TD_CHAT_TEMPLATE_H
#define TD_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

typedef struct {
    const char *role;    /* "system", "user", "assistant" (NUL-terminated) */
    const char *content; /* NUL-terminated */
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
 * message without role/content), TD_EUNSUPP (unknown template), TD_ENOMEM. */
int td_chat_render(const char *tmpl, size_t tmpl_len, const td_chat_msg *msgs, size_t n,
                   bool add_generation_prompt, char **out);

#endif
