/* jn_lex.h: the Jinja lexer (private to the engine): template text -> tokens.
 *
 * Text tokens come out with jinja2's whitespace rules already applied (trim_blocks,
 * lstrip_blocks, the `-` / `+` markers, newlines normalised, one trailing newline dropped,
 * as transformers' environment has them), comments and {% raw %} tags resolved, so the
 * parser sees only text, tag brackets and expression tokens. String, integer and float
 * literals carry their value (in the template's arena).
 */
#ifndef JN_LEX_H
#define JN_LEX_H

#include "jn_int.h"

typedef enum {
    JN_T_TEXT,
    JN_T_VAR_BEGIN,
    JN_T_VAR_END,
    JN_T_BLOCK_BEGIN,
    JN_T_BLOCK_END,
    JN_T_NAME,
    JN_T_STRING,
    JN_T_INT,
    JN_T_FLOAT,
    JN_T_OP,
    JN_T_EOF,
} jn_tok_type;

typedef struct {
    jn_tok_type type;
    int line;
    const char *s; /* the token's text in the normalised source (not NUL-terminated) */
    size_t len;
    jv *val; /* STRING, INT, FLOAT */
} jn_tok;

/* Tokens of src[0..len) into *toks (malloc'd, the caller frees it; texts point into c's
 * arena). Returns 0, or -1 with c's error set. */
int jn_lex(jn_ctx *c, const char *src, size_t len, jn_tok **toks, size_t *n);

#endif
