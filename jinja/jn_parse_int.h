/* jn_parse_int.h: the parser's state and helpers, shared by its two files (private to the
 * engine): jn_parse.c (tokens, expressions, the entry points) and jn_parse_stmt.c (the
 * statements and template bodies). Errors go to the parser's context (jn_fail); a function
 * that fails returns NULL / false / -1 with it set. */
#ifndef JN_PARSE_INT_H
#define JN_PARSE_INT_H

#include "jn_int.h"
#include "jn_lex.h"

typedef struct {
    jn_ctx *c;
    jn_tok *t;
    size_t n, i;
    int depth; /* nesting of expressions and blocks: bounded, and so the C stack */
    int loops; /* for-loop bodies around the current token (0 in a macro or call body):
                * break / continue outside one fail to parse, as Jinja2 refuses them */
} jn_parser;

typedef struct {
    jn_node **v;
    size_t n, cap;
} jn_nodevec;

/* an error at the current token: fmt with one string argument */
jn_node *jnp_fail(jn_parser *P, int rc, const char *fmt, const char *arg);
jn_tok *jnp_cur(jn_parser *P);
bool jnp_is_op(jn_parser *P, const char *op);
bool jnp_is_name(jn_parser *P, const char *name);
bool jnp_is_name_at(jn_parser *P, size_t k, const char *name); /* k tokens ahead */
bool jnp_skip_op(jn_parser *P, const char *op);                /* consumed when it is */
bool jnp_skip_name(jn_parser *P, const char *name);
const char *jnp_tok_desc(jn_parser *P); /* the current token, for messages */
bool jnp_expect_op(jn_parser *P, const char *op);
jn_node *jnp_node(jn_parser *P, jn_kind k); /* a new node at the current line */
const char *jnp_tok_name(jn_parser *P);     /* the current token's text, copied; consumed */
int jnp_vec_push(jn_parser *P, jn_nodevec *v, jn_node *x); /* x NULL: -1 (its error set) */

jn_node *jnp_expr(jn_parser *P, bool condexpr);
jn_node *jnp_tuple(jn_parser *P, bool condexpr, bool explicit_parens);
jn_node *jnp_filter(jn_parser *P, jn_node *x); /* the filter after "|", applied to x */
/* Statements until {% END %} for an END of ends (left unconsumed), or the template's end. */
jn_node *jnp_body(jn_parser *P, const char *const *ends, size_t n_ends);
bool jnp_reads_name(const jn_node *x, const char *name);

#endif
