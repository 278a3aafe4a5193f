/* jn_parse_stmt.c: the statements of a template (if, for, set and block set, macro, call,
 * filter, generation, break, continue) and template bodies; see jn_parse_int.h. */
#include <stdio.h>
#include <string.h>

#include "jn_parse_int.h"
#include "td_err.h"

static bool at_block_name(jn_parser *P, const char *name)
{
    return jnp_cur(P)->type == JN_T_BLOCK_BEGIN && jnp_is_name_at(P, 1, name);
}

static bool expect_block_end(jn_parser *P)
{
    if (jnp_cur(P)->type == JN_T_BLOCK_END) {
        P->i++;
        return true;
    }
    jnp_fail(P, TD_EINVAL, "expected the end of the statement block, got %s", jnp_tok_desc(P));
    return false;
}

/* {% NAME %} closing a block: BLOCK_BEGIN, NAME, BLOCK_END. */
static bool expect_end_tag(jn_parser *P, const char *name)
{
    if (!at_block_name(P, name)) {
        jn_fail(P->c, TD_EINVAL, jnp_cur(P)->line, "expected {%% %s %%}, got %s", name,
                jnp_tok_desc(P));
        return false;
    }
    P->i += 2;
    return expect_block_end(P);
}

/* Assignment targets: a, b or (a, b); ns.attr when allowed (set only). */
static int parse_targets(jn_parser *P, jn_node *x, bool allow_attr)
{
    const char *names[16];
    size_t n = 0;
    bool paren = jnp_skip_op(P, "(");
    do {
        if (jnp_cur(P)->type != JN_T_NAME)
            return jnp_fail(P, TD_EINVAL, "expected a name to assign to, got %s", jnp_tok_desc(P)),
                   -1;
        if (n == 16) return jnp_fail(P, TD_EUNSUPP, "more than 16 names to unpack%s", ""), -1;
        if (!(names[n++] = jnp_tok_name(P))) return -1;
        if (allow_attr && n == 1 && jnp_skip_op(P, ".")) {
            if (jnp_cur(P)->type != JN_T_NAME)
                return jnp_fail(P, TD_EINVAL, "expected an attribute name, got %s",
                                jnp_tok_desc(P)),
                       -1;
            if (!(x->attr = jnp_tok_name(P))) return -1;
            break;
        }
    } while (jnp_skip_op(P, ","));
    if (paren && !jnp_expect_op(P, ")")) return -1;
    if (!(x->names = jn_alloc(&P->c->arena, n * sizeof *names)))
        return jnp_fail(P, TD_ENOMEM, "out of memory%s", ""), -1;
    memcpy(x->names, names, n * sizeof *names);
    x->n_names = n;
    return 0;
}

static jn_node *parse_if(jn_parser *P)
{
    static const char *const ends[] = {"elif", "else", "endif"};
    jn_node *x = jnp_node(P, S_IF);
    jn_nodevec arms = {0};
    if (!x) return NULL;
    for (;;) {
        if (jnp_vec_push(P, &arms, jnp_tuple(P, true, false)) || !expect_block_end(P) ||
            jnp_vec_push(P, &arms, jnp_body(P, ends, 3)))
            return NULL;
        P->i++; /* the block's begin; its name is next */
        if (jnp_skip_name(P, "elif")) continue;
        if (jnp_skip_name(P, "else")) {
            if (!expect_block_end(P) || jnp_vec_push(P, &arms, jnp_body(P, ends + 2, 1)))
                return NULL;
            P->i++;
        }
        if (!jnp_skip_name(P, "endif") || !expect_block_end(P))
            return jnp_fail(P, TD_EINVAL, "expected {%% endif %%}, got %s", jnp_tok_desc(P));
        break;
    }
    x->kids = arms.v;
    x->n = arms.n;
    return x;
}

static jn_node *parse_for(jn_parser *P)
{
    static const char *const ends[] = {"else", "endfor"};
    jn_node *x = jnp_node(P, S_FOR);
    if (!x || parse_targets(P, x, false)) return NULL;
    if (!jnp_skip_name(P, "in"))
        return jnp_fail(P, TD_EINVAL, "expected 'in' in a for loop, got %s", jnp_tok_desc(P));
    if (!(x->a = jnp_tuple(P, false, false))) return NULL;
    if (jnp_skip_name(P, "if") && !(x->b = jnp_expr(P, true))) return NULL;
    if (jnp_is_name(P, "recursive"))
        return jnp_fail(P, TD_EUNSUPP, "recursive for loops are not supported%s", "");
    if (!expect_block_end(P)) return NULL;
    P->loops++;
    x->body = jnp_body(P, ends, 2);
    P->loops--;
    if (!x->body) return NULL;
    if (at_block_name(P, "else")) {
        P->i += 2;
        if (!expect_block_end(P) || !(x->else_body = jnp_body(P, ends + 1, 1))) return NULL;
    }
    return expect_end_tag(P, "endfor") ? x : NULL;
}

static jn_node *parse_set(jn_parser *P)
{
    static const char *const ends[] = {"endset"};
    jn_node *x = jnp_node(P, S_SET);
    if (!x || parse_targets(P, x, true)) return NULL;
    if (jnp_skip_op(P, "=")) {
        if (!(x->a = jnp_tuple(P, true, false))) return NULL;
        return expect_block_end(P) ? x : NULL;
    }
    /* {% set x %}...{% endset %}, optionally through filters: {% set x | trim %} */
    if (x->n_names != 1 || x->attr)
        return jnp_fail(P, TD_EUNSUPP, "a block set assigns one plain name%s", "");
    x->kind = S_SETBLK;
    x->name = x->names[0];
    jn_node *f = NULL;
    while (jnp_skip_op(P, "|"))
        if (!(f = jnp_filter(P, f))) return NULL;
    x->b = f;
    if (!expect_block_end(P) || !(x->body = jnp_body(P, ends, 1))) return NULL;
    return expect_end_tag(P, "endset") ? x : NULL;
}

/* (a, b=default, ...) of a macro or a call block. */
static int parse_params(jn_parser *P, jn_node *x)
{
    const char *names[64];
    jn_node *defs[64];
    size_t n = 0;
    if (!jnp_expect_op(P, "(")) return -1;
    while (!jnp_skip_op(P, ")")) {
        if (n && !jnp_expect_op(P, ",")) return -1;
        if (jnp_skip_op(P, ")")) break;
        if (jnp_cur(P)->type != JN_T_NAME)
            return jnp_fail(P, TD_EINVAL, "expected a parameter name, got %s", jnp_tok_desc(P)), -1;
        if (n == 64) return jnp_fail(P, TD_EUNSUPP, "more than 64 parameters%s", ""), -1;
        if (!(names[n] = jnp_tok_name(P))) return -1;
        defs[n] = NULL;
        if (jnp_skip_op(P, "=") && !(defs[n] = jnp_expr(P, true))) return -1;
        n++;
    }
    x->names = jn_alloc(&P->c->arena, (n + 1) * sizeof *names);
    x->defaults = jn_alloc(&P->c->arena, (n + 1) * sizeof *defs);
    if (!x->names || !x->defaults) return jnp_fail(P, TD_ENOMEM, "out of memory%s", ""), -1;
    memcpy(x->names, names, n * sizeof *names);
    memcpy(x->defaults, defs, n * sizeof *defs);
    x->n_names = n;
    return 0;
}

/* Does the tree under x read the name? (jinja2 lets a macro take extra positional or
 * keyword arguments only when its body reads `varargs` or `kwargs`.) */
bool jnp_reads_name(const jn_node *x, const char *name)
{
    if (!x) return false;
    if (x->kind == N_NAME && !strcmp(x->name, name)) return true;
    if (jnp_reads_name(x->a, name) || jnp_reads_name(x->b, name) || jnp_reads_name(x->c, name) ||
        jnp_reads_name(x->d, name) || jnp_reads_name(x->body, name) ||
        jnp_reads_name(x->else_body, name))
        return true;
    for (size_t i = 0; i < x->n; i++)
        if (jnp_reads_name(x->kids[i], name)) return true;
    for (size_t i = 0; x->defaults && i < x->n_names; i++)
        if (jnp_reads_name(x->defaults[i], name)) return true;
    return false;
}

static void mark_extra_args(jn_node *x)
{
    x->negate = jnp_reads_name(x->body, "varargs");
    x->kwargs = jnp_reads_name(x->body, "kwargs");
}

/* a macro's or call block's body: called from anywhere, so a loop around its definition
 * is not a loop around its break */
static jn_node *loop_free_body(jn_parser *P, const char *const *ends, size_t n_ends)
{
    int loops = P->loops;
    P->loops = 0;
    jn_node *body = jnp_body(P, ends, n_ends);
    P->loops = loops;
    return body;
}

static jn_node *parse_macro(jn_parser *P)
{
    static const char *const ends[] = {"endmacro"};
    jn_node *x = jnp_node(P, S_MACRO);
    if (!x) return NULL;
    if (jnp_cur(P)->type != JN_T_NAME)
        return jnp_fail(P, TD_EINVAL, "expected a macro name, got %s", jnp_tok_desc(P));
    if (!(x->name = jnp_tok_name(P)) || parse_params(P, x) || !expect_block_end(P) ||
        !(x->body = loop_free_body(P, ends, 1)))
        return NULL;
    mark_extra_args(x);
    return expect_end_tag(P, "endmacro") ? x : NULL;
}

static jn_node *parse_call_block(jn_parser *P)
{
    static const char *const ends[] = {"endcall"};
    jn_node *x = jnp_node(P, S_CALLBLK);
    if (!x) return NULL;
    if (jnp_is_op(P, "(") && parse_params(P, x)) return NULL;
    if (!(x->a = jnp_expr(P, true))) return NULL;
    if (x->a->kind != N_CALL) return jnp_fail(P, TD_EINVAL, "a call block needs a call%s", "");
    if (!expect_block_end(P) || !(x->body = loop_free_body(P, ends, 1))) return NULL;
    mark_extra_args(x);
    return expect_end_tag(P, "endcall") ? x : NULL;
}

static jn_node *parse_filter_block(jn_parser *P)
{
    static const char *const ends[] = {"endfilter"};
    jn_node *x = jnp_node(P, S_FILTBLK), *f = NULL;
    if (!x) return NULL;
    do {
        if (!(f = jnp_filter(P, f))) return NULL;
    } while (jnp_skip_op(P, "|"));
    x->b = f;
    if (!expect_block_end(P) || !(x->body = jnp_body(P, ends, 1))) return NULL;
    return expect_end_tag(P, "endfilter") ? x : NULL;
}

/* transformers' {% generation %} marks the assistant's text for its masks; it renders its
 * body unchanged. */
static jn_node *parse_generation(jn_parser *P)
{
    static const char *const ends[] = {"endgeneration"};
    jn_node *x;
    if (!expect_block_end(P) || !(x = jnp_body(P, ends, 1))) return NULL;
    return expect_end_tag(P, "endgeneration") ? x : NULL;
}

static jn_node *parse_statement_in(jn_parser *P)
{
    P->i++; /* {% */
    if (jnp_cur(P)->type != JN_T_NAME)
        return jnp_fail(P, TD_EINVAL, "expected a statement name, got %s", jnp_tok_desc(P));
    if (jnp_skip_name(P, "if")) return parse_if(P);
    if (jnp_skip_name(P, "for")) return parse_for(P);
    if (jnp_skip_name(P, "set")) return parse_set(P);
    if (jnp_skip_name(P, "macro")) return parse_macro(P);
    if (jnp_skip_name(P, "call")) return parse_call_block(P);
    if (jnp_skip_name(P, "filter")) return parse_filter_block(P);
    if (jnp_skip_name(P, "generation")) return parse_generation(P);
    if (jnp_is_name(P, "break") || jnp_is_name(P, "continue")) {
        if (!P->loops)
            return jnp_fail(P, TD_EINVAL, "'%s' outside a for loop",
                            jnp_is_name(P, "break") ? "break" : "continue");
        jn_node *x = jnp_node(P, jnp_is_name(P, "break") ? S_BREAK : S_CONTINUE);
        P->i++;
        return x && expect_block_end(P) ? x : NULL;
    }
    static const char *const known[] = {"block", "extends",    "include", "import", "from",
                                        "with",  "autoescape", "do",      "trans",  "raw"};
    for (size_t k = 0; k < sizeof known / sizeof *known; k++)
        if (jnp_is_name(P, known[k]))
            return jnp_fail(P, TD_EUNSUPP, "the '%s' statement is not supported in chat templates",
                            known[k]);
    return jnp_fail(P, TD_EINVAL, "unknown statement %s", jnp_tok_desc(P));
}

static jn_node *parse_statement(jn_parser *P)
{
    if (++P->depth > JN_MAX_DEPTH) {
        P->depth--;
        return jnp_fail(P, TD_EUNSUPP, "expressions or blocks nested deeper than %s", "256");
    }
    jn_node *x = parse_statement_in(P);
    P->depth--;
    return x;
}

/* Statements until {% END %} for an END of ends (left unconsumed) or the end of the
 * template (an error when ends are given). */
jn_node *jnp_body(jn_parser *P, const char *const *ends, size_t n_ends)
{
    jn_node *body = jnp_node(P, S_BODY);
    jn_nodevec v = {0};
    if (!body) return NULL;
    for (;;) {
        jn_tok *t = jnp_cur(P);
        jn_node *x = NULL;
        if (t->type == JN_T_EOF) {
            if (n_ends)
                return (jn_node *)jn_fail(P->c, TD_EINVAL, t->line,
                                          "unexpected end of template: {%% %s %%} missing",
                                          ends[n_ends - 1]);
            break;
        }
        if (t->type == JN_T_TEXT) {
            if (!(x = jnp_node(P, S_TEXT))) return NULL;
            if (!(x->lit = jn_str(P->c, t->s, t->len))) return NULL;
            P->i++;
        } else if (t->type == JN_T_VAR_BEGIN) {
            P->i++;
            if (!(x = jnp_node(P, S_OUT)) || !(x->a = jnp_tuple(P, true, false))) return NULL;
            if (jnp_cur(P)->type != JN_T_VAR_END)
                return jnp_fail(P, TD_EINVAL, "expected '}}', got %s", jnp_tok_desc(P));
            P->i++;
        } else if (t->type == JN_T_BLOCK_BEGIN) {
            bool end = false;
            for (size_t k = 0; k < n_ends && !end; k++)
                end = jnp_is_name_at(P, 1, ends[k]);
            if (end) break;
            if (!(x = parse_statement(P))) return NULL;
        } else {
            return jnp_fail(P, TD_EINVAL, "unexpected %s", jnp_tok_desc(P));
        }
        if (jnp_vec_push(P, &v, x)) return NULL;
    }
    body->kids = v.v;
    body->n = v.n;
    return body;
}
