/* gr_grammar.h: structured output. JSON schemas compiled to a byte-level pushdown automaton,
 * matched per sequence, and turned into a token mask for the sampler.
 *
 * Purpose: `response_format` json_object / json_schema (and later tool-call arguments) are
 * enforced by constrained decoding: before each sampled token, gr_matcher_mask says which
 * vocabulary tokens keep the output a prefix of a document the grammar accepts (an end-of-
 * generation token only where the document is complete); the sampler sets the others to
 * -inf (kn_sampler_set_mask); the sampled token advances the matcher.
 *
 *   schema (jansson json_t, or its text) --gr_compile_*--> gr_grammar (immutable automaton,
 *   plus its mask cache)  +  gr_vocab (byte trie of the model's token strings, once per
 *   model)  --gr_matcher_create--> gr_matcher (one per sequence)
 *
 *   matcher: start --accept_token*--> ... --> complete (gr_matcher_can_end) --> done
 *   (gr_matcher_done: complete and no byte can follow; the request ends there)
 *
 * What a schema may use: type (string, number, integer, boolean, null, object, array, or a
 * list of them: "nullable"), properties, required, additionalProperties, items, minItems,
 * maxItems, minLength, maxLength, enum, const, anyOf, $ref to "#/$defs/..." or
 * "#/definitions/..." (recursion included), and the annotations title, description,
 * default, examples, $schema, $id, $comment. Anything else is an error that names the
 * keyword and where it is (gr_compile_schema's err), never ignored. Objects list their
 * properties in the schema's order; strict mode (OpenAI's) makes every listed property
 * required, otherwise those not in "required" may be left out; no other keys are generated
 * (a subset of the valid documents, each of them valid). An object schema without
 * properties accepts any keys (values per additionalProperties, false: only {}).
 * Bounds that keep a sampled document finite (the model cannot loop forever in them):
 * whitespace between tokens is nothing, one space, or one newline followed by at most 12
 * spaces; no whitespace before or after the root value; integers have at most 16 digits,
 * fractions 16, exponents 3; nesting (the automaton's stack) is at most GR_MAX_STACK deep.
 * json_object is any JSON object. Every string is valid UTF-8.
 *
 * Invariants: a matcher's state always is a prefix of an accepted document; a token that
 * gr_matcher_mask allows is accepted by gr_matcher_accept_token; gr_matcher_mask never
 * allows nothing unless the document is complete and the vocabulary has no EOG token.
 * Threading: a gr_grammar's automaton is immutable, but its mask cache and a gr_vocab's
 * scratch are not: all matchers of one vocabulary are used from one thread at a time (the
 * decode engine loop, the last prefill stage's loop, the CLI). gr_compile_* and the
 * gr_vocab_* queries are pure. Ownership: gr_grammar is reference-counted (gr_grammar_ref /
 * _unref; a matcher holds one reference); a matcher borrows its vocab, which must outlive
 * it; gr_cache owns its grammars and hands out references.
 */
#ifndef GR_GRAMMAR_H
#define GR_GRAMMAR_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_sampling.h"
#include "tokenizer.h"

#define GR_MAX_STACK     32        /* nested rule calls (JSON nesting of generic values) */
#define GR_MAX_TEXT      (1 << 16) /* bytes of a schema's text on the wire */
#define GR_MAX_STATES    (1 << 20) /* automaton states of one compiled schema */
#define GR_MAX_REPEAT    256       /* largest minItems/maxItems/minLength/maxLength bound */
#define GR_MAX_TOKEN_LEN 256       /* vocabulary tokens longer than this are never allowed */

typedef struct gr_grammar gr_grammar;
typedef struct gr_vocab gr_vocab;
typedef struct gr_matcher gr_matcher;
typedef struct gr_cache gr_cache;

/* ---- compile ---- */

/* Compile a JSON schema (a jansson object or true). strict: every listed property is
 * required (OpenAI's strict mode). Returns 0 with *out (one reference), or TD_EUNSUPP
 * (a keyword or value the compiler does not handle), TD_EINVAL (not a valid schema),
 * TD_ERANGE (too large), TD_ENOMEM; err (err_cap bytes, may be NULL) then says why,
 * naming the keyword and its JSON pointer, e.g. "unsupported JSON schema keyword 'pattern'
 * at #/properties/name". */
int gr_compile_schema(const json_t *schema, bool strict, gr_grammar **out, char *err,
                      size_t err_cap);
/* Any JSON object (response_format json_object). */
int gr_compile_json_object(gr_grammar **out);
/* From td_sampling's form: kind TD_GRAMMAR_JSON_OBJECT (text ignored, may be NULL),
 * TD_GRAMMAR_JSON_SCHEMA or _STRICT (text: the schema's JSON, at most GR_MAX_TEXT bytes).
 * Errors as gr_compile_schema; TD_EINVAL for text that is not JSON or an unknown kind. */
int gr_compile_text(int32_t kind, const char *text, gr_grammar **out, char *err, size_t err_cap);

gr_grammar *gr_grammar_ref(gr_grammar *g);
void gr_grammar_unref(gr_grammar *g); /* NULL is fine */
int32_t gr_grammar_n_states(const gr_grammar *g);

/* ---- vocabulary ---- */

/* Build the byte trie of a vocabulary. piece(ctx, id, &len) gives token id's bytes, or
 * NULL for a token that may never be generated inside a document (control and unknown
 * tokens); eog (n_eog ids) are the end-of-generation tokens, allowed only where the
 * document is complete. Returns 0, TD_EINVAL, TD_ENOMEM. */
int gr_vocab_create(int32_t n_vocab, const char *(*piece)(void *ctx, int32_t id, size_t *len),
                    void *ctx, const int32_t *eog, int n_eog, gr_vocab **out);
/* The vocabulary of a model's tokenizer: text tokens as td_tok_piece_render shows them,
 * control and unknown tokens never, EOG tokens (td_tok_is_eog) at the end. */
int gr_vocab_from_tok(const td_tokenizer *t, gr_vocab **out);
void gr_vocab_destroy(gr_vocab *v); /* NULL is fine */
int32_t gr_vocab_n_vocab(const gr_vocab *v);

/* ---- per-sequence matcher ---- */

int gr_matcher_create(gr_grammar *g, gr_vocab *v, gr_matcher **out);
void gr_matcher_destroy(gr_matcher *m); /* NULL is fine */
/* Feed bytes. 0, or TD_EINVAL (the bytes leave the grammar: the state is unchanged). */
int gr_matcher_accept_bytes(gr_matcher *m, const char *bytes, size_t len);
/* Feed a token: its bytes, or for an EOG token the end of the document. 0, TD_EINVAL (not
 * allowed here: the state is unchanged), TD_ERANGE (id outside the vocabulary). */
int gr_matcher_accept_token(gr_matcher *m, int32_t id);
/* Replay n tokens (a moved request's generated tokens). 0 or the first error. */
int gr_matcher_accept_tokens(gr_matcher *m, const int32_t *ids, int64_t n);
/* The document is complete (an EOG token is allowed). */
bool gr_matcher_can_end(const gr_matcher *m);
/* Complete and nothing can follow, or an EOG token was accepted: the request is over. */
bool gr_matcher_done(const gr_matcher *m);
/* The allowed tokens now: a bitset, bit (id & 31) of word id >> 5 set = allowed, n_vocab
 * bits. Valid until the next gr_matcher_mask on any matcher of the same grammar. Returns
 * 0, TD_ENOMEM, or TD_ESTATE when no token is allowed (cannot happen for a live matcher of
 * a byte-complete vocabulary). */
int gr_matcher_mask(gr_matcher *m, const uint32_t **mask);

/* ---- per-process cache of compiled grammars ---- */

/* Grammars keyed by (kind, text) (FNV-1a of both, then compared). Up to max_entries
 * (0: 64), the least recently used dropped first. */
int gr_cache_create(int max_entries, gr_cache **out);
void gr_cache_destroy(gr_cache *c); /* drops its references; NULL is fine */
/* A reference to the grammar of (kind, text), compiled on first use (errors as
 * gr_compile_text). The caller unrefs it. */
int gr_cache_get(gr_cache *c, int32_t kind, const char *text, gr_grammar **out, char *err,
                 size_t err_cap);

#endif
