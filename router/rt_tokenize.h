/* rt_tokenize.h: vLLM's token endpoints and the version (prefix rt_).
 *
 * Purpose: POST /tokenize ({"model", "prompt"[, "add_special_tokens"]} or {"model",
 * "messages"[, "add_generation_prompt"]} -> {"count", "max_model_len", "tokens"}), tokenized
 * exactly as /v1/completions and /v1/chat/completions tokenize their prompts; POST /detokenize
 * ({"model", "tokens"} -> {"prompt"}, special tokens' text kept, as vLLM); GET /version
 * ({"version"}: the CMake project version).
 * Invariants: every field is known or refused with a 400 that names it; token ids are checked
 * against the vocabulary; the output is valid JSON (invalid UTF-8 becomes U+FFFD).
 * Threading: called on the HTTP threads; reads only the router's read-only model state.
 * Ownership: *out is a malloc'd JSON body the caller frees.
 */
#ifndef RT_TOKENIZE_H
#define RT_TOKENIZE_H

#include <stddef.h>

#include "rt_openai.h"

/* Each returns 200 with *out set, or the HTTP status with e filled (*out NULL). */
int rt_tokenize(const rt_model *m, const char *body, size_t len, char **out, rt_error *e);
int rt_detokenize(const rt_model *m, const char *body, size_t len, char **out, rt_error *e);

/* GET /version body, malloc'd (NULL: no memory). */
char *rt_version_json(void);

#endif
