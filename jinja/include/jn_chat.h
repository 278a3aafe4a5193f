/* jn_chat.h: a chat template's variables, made as transformers' apply_chat_template makes
 * them, and the rendering with them (prefix jn_).
 *
 * Purpose: the router, `tandem template` and the tests give a template exactly what
 * transformers gives it, so a rendering here equals transformers' (and vLLM's, which calls
 * it): each message without its keys whose value is null; a message's reasoning
 * (reasoning_content, thinking or reasoning) copied under both `thinking` (first) and
 * `reasoning_content` (last); `tools` None when there are none, `documents` None;
 * add_generation_prompt; bos_token and eos_token when the tokenizer has them; then every
 * chat_template_kwargs entry, which wins over those.
 * Ownership: inputs are only read; the returned object is the caller's (json_decref).
 */
#ifndef JN_CHAT_H
#define JN_CHAT_H

#include <jansson.h>
#include <stdbool.h>

#include "jn.h"
#include "tokenizer.h"

typedef struct {
    const json_t *messages; /* an array of message objects */
    const json_t *tools;    /* an array, or NULL (the template sees None) */
    bool add_generation_prompt;
    const char *bos_token, *eos_token; /* NULL: left undefined */
    const json_t *kwargs;              /* an object of extra variables, or NULL */
} jn_chat;

/* The variables; NULL with *err filled (a message that is not an object, kwargs that are
 * not an object) or out of memory. */
json_t *jn_chat_vars(const jn_chat *chat, jn_error *err);

/* jn_chat_vars + jn_render. Returns jn_render's codes (TD_EINVAL for bad input too). */
int jn_chat_render(const jn_template *t, const jn_chat *chat, const jn_opts *opts, char **out,
                   size_t *len, jn_error *err);

/* The text of a built-in template for a model file without one, by family: "chatml"
 * (transformers' default ChatML), "llama3" (Llama 3 Instruct's), "llama2" (Llama 2 Chat's),
 * "gemma" (Gemma 3's, the system turn folded into the first user turn); NULL for any other
 * name. */
const char *jn_family_template(const char *family);

/* bos_token and eos_token as a template sees them: the tokenizer's pieces (NULL when it
 * has no such token). A rendered prompt is tokenized without adding special tokens
 * (transformers' and vLLM's rule: the template writes BOS where the model wants one). */
typedef struct {
    char *bos, *eos;
} jn_special;
int jn_special_init(jn_special *s, const td_tokenizer *tok); /* 0 or TD_ENOMEM */
void jn_special_fini(jn_special *s);

/* One user message rendered with a template text (add_generation_prompt on), for the tools
 * that prompt a model directly (tandem generate --chat, the activation-mode check).
 * Returns 0 with *out malloc'd, or the jn_parse / jn_render code with *err filled. */
int jn_chat_render_user(const char *tmpl, size_t len, const char *user, const jn_special *s,
                        char **out, jn_error *err);

#endif
