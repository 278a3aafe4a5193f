/* jn.h: a Jinja template engine for chat templates (prefix jn_).
 *
 * Purpose: render a model's own chat template (the GGUF's tokenizer.chat_template, a Jinja
 * text written for Python's jinja2) exactly as Hugging Face transformers' apply_chat_template
 * renders it, so a prompt is what the model was trained on whatever its family. The dialect
 * is transformers': an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the
 * loop controls (break, continue), the `generation` block, `tojson` as json.dumps with
 * ensure_ascii off (and its indent, separators, sort_keys arguments), and the globals
 * raise_exception and strftime_now beside jinja2's own (range, dict, namespace).
 * What is covered: the statements, expressions, filters, tests and string/dict methods that
 * real chat templates use (docs/api.md lists them). A construct outside that set is an error
 * that names it and its line (never a rendering that differs from jinja2's); so is an unsafe
 * call the sandbox refuses (list.append, dict.update, ...).
 * Limits: a render stops with an error past opts.max_output bytes, a nesting depth of
 * JN_MAX_DEPTH calls, or JN_MAX_STEPS loop iterations and calls, so a template or a
 * conversation cannot hold a router thread or its memory.
 * Threading: a parsed template is immutable; any number of threads may render it at once.
 * Ownership: jn_parse copies what it needs of src; *out of jn_render is malloc'd, the caller
 * frees it; vars is only read.
 */
#ifndef JN_H
#define JN_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define JN_MAX_DEPTH 256
#define JN_MAX_STEPS 2000000

typedef struct jn_template jn_template;

/* Where and why a parse or a render failed: "line N: message" (line 0: not tied to one). */
typedef struct {
    int line;
    char msg[384];
} jn_error;

typedef struct {
    /* strftime_now's time, Unix seconds, formatted in UTC; 0: the clock */
    int64_t now;
    /* the rendering's size limit in bytes; 0: 64 MiB */
    size_t max_output;
} jn_opts;

/* Parse src[0..len) (UTF-8). Returns 0; TD_EINVAL for a syntax error, TD_EUNSUPP for a
 * construct the engine does not implement (both with *err filled); TD_ENOMEM. */
int jn_parse(const char *src, size_t len, jn_template **out, jn_error *err);

void jn_template_free(jn_template *t);

/* Does the template read the variable `name` anywhere (e.g. "tools": whether a model's
 * template renders the tools it is given at all)? */
bool jn_template_reads(const jn_template *t, const char *name);

/* Render t with the variables of vars (a JSON object: messages, tools, add_generation_prompt,
 * bos_token, ... as the template reads them; JSON objects are dicts, arrays lists). opts may
 * be NULL. Returns 0 with *out (NUL-terminated, *len bytes); TD_EINVAL for an error the
 * template raises or makes (raise_exception, an undefined value's attribute, a type error:
 * *err says which and where), TD_EUNSUPP (a construct reached that is not implemented),
 * TD_ERANGE (a limit above), TD_ENOMEM. */
int jn_render(const jn_template *t, const json_t *vars, const jn_opts *opts, char **out,
              size_t *len, jn_error *err);

/* v as Python's json.dumps(v, ensure_ascii=False) writes it, as a template's tojson does
 * (", " and ": " separators, keys in their order, floats as repr): malloc'd, NULL when out
 * of memory. For the API's tool-call arguments, which vLLM writes the same way. */
char *jn_pyjson(const json_t *v);

#endif
