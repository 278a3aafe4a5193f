/* jn_parse.c: tokens -> syntax tree: the token helpers, the expressions (jinja2's precedence,
 * its implicit tuples, its test arguments without parentheses), and jn_parse /
 * jn_template_free. The statements are jn_parse_stmt.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jn_parse_int.h"
#include "td_err.h"

jn_node *jnp_fail(jn_parser *P, int rc, const char *fmt, const char *arg)
{
    jn_fail(P->c, rc, P->t[P->i].line, fmt, arg);
    return NULL;
}

jn_tok *jnp_cur(jn_parser *P)
{
    return &P->t[P->i];
}

bool jnp_is_op(jn_parser *P, const char *op)
{
    jn_tok *t = jnp_cur(P);
    return t->type == JN_T_OP && t->len == strlen(op) && !strncmp(t->s, op, t->len);
}

bool jnp_is_name(jn_parser *P, const char *name)
{
    jn_tok *t = jnp_cur(P);
    return t->type == JN_T_NAME && t->len == strlen(name) && !strncmp(t->s, name, t->len);
}

bool jnp_is_name_at(jn_parser *P, size_t k, const char *name)
{
    jn_tok *t = P->i + k < P->n ? &P->t[P->i + k] : &P->t[P->n - 1];
    return t->type == JN_T_NAME && t->len == strlen(name) && !strncmp(t->s, name, t->len);
}

bool jnp_skip_op(jn_parser *P, const char *op)
{
    if (!jnp_is_op(P, op)) return false;
    P->i++;
    return true;
}

bool jnp_skip_name(jn_parser *P, const char *name)
{
    if (!jnp_is_name(P, name)) return false;
    P->i++;
    return true;
}

const char *jnp_tok_desc(jn_parser *P)
{
    static _Thread_local char d[48];
    jn_tok *t = jnp_cur(P);
    switch (t->type) {
    case JN_T_EOF:
        return "end of template";
    case JN_T_BLOCK_END:
        return "end of statement block";
    case JN_T_VAR_END:
        return "end of print statement";
    case JN_T_TEXT:
        return "template text";
    default:
        snprintf(d, sizeof d, "'%.*s'", (int)(t->len > 40 ? 40 : t->len), t->s);
        return d;
    }
}

bool jnp_expect_op(jn_parser *P, const char *op)
{
    if (jnp_skip_op(P, op)) return true;
    jn_fail(P->c, TD_EINVAL, jnp_cur(P)->line, "expected '%s', got %s", op, jnp_tok_desc(P));
    return false;
}

jn_node *jnp_node(jn_parser *P, jn_kind k)
{
    jn_node *x = jn_alloc(&P->c->arena, sizeof *x);
    if (!x) return jnp_fail(P, TD_ENOMEM, "out of memory%s", "");
    x->kind = k;
    x->line = jnp_cur(P)->line;
    return x;
}

const char *jnp_tok_name(jn_parser *P)
{
    jn_tok *t = jnp_cur(P);
    char *s = jn_alloc(&P->c->arena, t->len + 1);
    if (!s) return (const char *)jnp_fail(P, TD_ENOMEM, "out of memory%s", "");
    memcpy(s, t->s, t->len);
    P->i++;
    return s;
}

int jnp_vec_push(jn_parser *P, jn_nodevec *v, jn_node *x)
{
    if (!x) return -1;
    if (v->n == v->cap) {
        size_t cap = v->cap ? 2 * v->cap : 8;
        jn_node **nv = jn_alloc(&P->c->arena, cap * sizeof *nv);
        if (!nv) return jnp_fail(P, TD_ENOMEM, "out of memory%s", ""), -1;
        if (v->n) memcpy(nv, v->v, v->n * sizeof *nv);
        v->v = nv;
        v->cap = cap;
    }
    v->v[v->n++] = x;
    return 0;
}

static jn_node *parse_unary(jn_parser *P, bool with_filter);
static jn_node *parse_not(jn_parser *P);
static jn_node *parse_primary(jn_parser *P);
static jn_node *parse_postfix(jn_parser *P, jn_node *x);

/* (args): positional then keyword arguments into x->kids / x->kw. */
static int parse_call_args(jn_parser *P, jn_node *x)
{
    jn_nodevec args = {0};
    const char *kw[64];
    size_t n_kw = 0;
    if (!jnp_expect_op(P, "(")) return -1;
    while (!jnp_is_op(P, ")")) {
        if (args.n && !jnp_expect_op(P, ",")) return -1;
        if (jnp_is_op(P, ")")) break; /* a trailing comma */
        if (jnp_is_op(P, "*") || jnp_is_op(P, "**"))
            return jnp_fail(P, TD_EUNSUPP, "*args and **kwargs in a call are not supported%s", ""),
                   -1;
        if (jnp_cur(P)->type == JN_T_NAME && P->i + 1 < P->n && P->t[P->i + 1].type == JN_T_OP &&
            P->t[P->i + 1].len == 1 && P->t[P->i + 1].s[0] == '=') {
            if (n_kw == 64)
                return jnp_fail(P, TD_EUNSUPP, "more than 64 keyword arguments%s", ""), -1;
            kw[n_kw++] = jnp_tok_name(P);
            P->i++;
            if (jnp_vec_push(P, &args, jnp_expr(P, true))) return -1;
        } else {
            if (n_kw)
                return jnp_fail(P, TD_EINVAL, "positional argument after keyword arguments%s", ""),
                       -1;
            if (jnp_vec_push(P, &args, jnp_expr(P, true))) return -1;
        }
    }
    P->i++;
    x->kids = args.v;
    x->n = args.n;
    if (n_kw) {
        x->kw = jn_alloc(&P->c->arena, n_kw * sizeof *x->kw);
        if (!x->kw) return jnp_fail(P, TD_ENOMEM, "out of memory%s", ""), -1;
        memcpy(x->kw, kw, n_kw * sizeof *kw);
        x->n_kw = n_kw;
    }
    return 0;
}

/* A filter's name (dotted names are one name) and its arguments, over x. */
jn_node *jnp_filter(jn_parser *P, jn_node *x)
{
    jn_node *f = jnp_node(P, N_FILTER);
    if (!f) return NULL;
    if (jnp_cur(P)->type != JN_T_NAME)
        return jnp_fail(P, TD_EINVAL, "expected a filter name, got %s", jnp_tok_desc(P));
    f->name = jnp_tok_name(P);
    if (!f->name) return NULL;
    f->a = x;
    if (jnp_is_op(P, "(") && parse_call_args(P, f)) return NULL;
    return f;
}

static jn_node *parse_test(jn_parser *P, jn_node *x)
{
    jn_node *t = jnp_node(P, N_TEST);
    if (!t) return NULL;
    t->negate = jnp_skip_name(P, "not");
    if (jnp_cur(P)->type != JN_T_NAME)
        return jnp_fail(P, TD_EINVAL, "expected a test name, got %s", jnp_tok_desc(P));
    t->name = jnp_tok_name(P);
    if (!t->name) return NULL;
    t->a = x;
    jn_tok *k = jnp_cur(P);
    if (jnp_is_op(P, "(")) {
        if (parse_call_args(P, t)) return NULL;
    } else if ((k->type == JN_T_NAME || k->type == JN_T_STRING || k->type == JN_T_INT ||
                k->type == JN_T_FLOAT || jnp_is_op(P, "[") || jnp_is_op(P, "{")) &&
               !jnp_is_name(P, "else") && !jnp_is_name(P, "or") && !jnp_is_name(P, "and")) {
        /* jinja2 takes one argument without parentheses: `x is divisibleby 3` */
        if (jnp_is_name(P, "is"))
            return jnp_fail(P, TD_EINVAL, "tests cannot be chained with 'is'%s", "");
        jn_node *arg = parse_postfix(P, parse_primary(P));
        if (!arg) return NULL;
        jn_nodevec v = {0};
        if (jnp_vec_push(P, &v, arg)) return NULL;
        t->kids = v.v;
        t->n = 1;
    }
    return t;
}

static jn_node *parse_filter_expr(jn_parser *P, jn_node *x)
{
    while (x) {
        if (jnp_skip_op(P, "|")) {
            x = jnp_filter(P, x);
        } else if (jnp_skip_name(P, "is")) {
            x = parse_test(P, x);
        } else if (jnp_is_op(P, "(")) {
            jn_node *call = jnp_node(P, N_CALL);
            if (!call || parse_call_args(P, call)) return NULL;
            call->a = x;
            x = call;
        } else {
            break;
        }
    }
    return x;
}

/* x[...]: an index or a slice a:b:c. */
static jn_node *parse_subscript(jn_parser *P, jn_node *x)
{
    jn_node *parts[3] = {0};
    int k = 0;
    bool slice = false;
    while (!jnp_is_op(P, "]")) {
        if (jnp_skip_op(P, ":")) {
            slice = true;
            if (++k > 2) return jnp_fail(P, TD_EINVAL, "a slice has at most three parts%s", "");
            continue;
        }
        if (parts[k]) return jnp_fail(P, TD_EINVAL, "expected ':' or ']', got %s", jnp_tok_desc(P));
        if (!(parts[k] = jnp_expr(P, true))) return NULL;
    }
    P->i++;
    jn_node *s = jnp_node(P, slice ? N_SLICE : N_ITEM);
    if (!s) return NULL;
    if (!slice && !parts[0]) return jnp_fail(P, TD_EINVAL, "empty subscript []%s", "");
    s->a = x;
    s->b = parts[0];
    s->c = parts[1];
    s->d = parts[2];
    return s;
}

static jn_node *parse_postfix(jn_parser *P, jn_node *x)
{
    while (x) {
        if (jnp_skip_op(P, ".")) {
            jn_tok *t = jnp_cur(P);
            if (t->type == JN_T_NAME) {
                jn_node *a = jnp_node(P, N_ATTR);
                if (!a) return NULL;
                a->a = x;
                if (!(a->name = jnp_tok_name(P))) return NULL;
                x = a;
            } else if (t->type == JN_T_INT) { /* x.0 is x[0] */
                jn_node *it = jnp_node(P, N_ITEM), *lit = jnp_node(P, N_LIT);
                if (!it || !lit) return NULL;
                lit->lit = t->val;
                P->i++;
                it->a = x;
                it->b = lit;
                x = it;
            } else {
                return jnp_fail(P, TD_EINVAL, "expected a name after '.', got %s", jnp_tok_desc(P));
            }
        } else if (jnp_skip_op(P, "[")) {
            x = parse_subscript(P, x);
        } else if (jnp_is_op(P, "(")) {
            jn_node *call = jnp_node(P, N_CALL);
            if (!call || parse_call_args(P, call)) return NULL;
            call->a = x;
            x = call;
        } else {
            break;
        }
    }
    return x;
}

/* [a, b] or {k: v, ...}. */
static jn_node *parse_collection(jn_parser *P, bool dict)
{
    jn_node *x = jnp_node(P, dict ? N_DICT : N_LIST);
    jn_nodevec v = {0};
    if (!x) return NULL;
    const char *close = dict ? "}" : "]";
    while (!jnp_is_op(P, close)) {
        if (v.n && !jnp_expect_op(P, ",")) return NULL;
        if (jnp_is_op(P, close)) break;
        if (jnp_vec_push(P, &v, jnp_expr(P, true))) return NULL;
        if (dict && (!jnp_expect_op(P, ":") || jnp_vec_push(P, &v, jnp_expr(P, true)))) return NULL;
    }
    P->i++;
    x->kids = v.v;
    x->n = v.n;
    return x;
}

static jn_node *parse_primary(jn_parser *P)
{
    jn_tok *t = jnp_cur(P);
    jn_node *x;
    switch (t->type) {
    case JN_T_NAME: {
        static const char *const lits[] = {"true", "false", "none", "True", "False", "None"};
        for (int k = 0; k < 6; k++)
            if (jnp_is_name(P, lits[k])) {
                if (!(x = jnp_node(P, N_LIT))) return NULL;
                x->lit = k % 3 == 2 ? JN_NONE : JN_BOOL(k % 3 == 0);
                P->i++;
                return x;
            }
        if (!(x = jnp_node(P, N_NAME))) return NULL;
        x->name = jnp_tok_name(P);
        return x->name ? x : NULL;
    }
    case JN_T_STRING: {
        /* adjacent strings are one: 'a' 'b' */
        if (!(x = jnp_node(P, N_LIT))) return NULL;
        x->lit = t->val;
        P->i++;
        while (jnp_cur(P)->type == JN_T_STRING) {
            jv *b = jnp_cur(P)->val;
            char *s = jn_alloc(&P->c->arena, x->lit->u.str.len + b->u.str.len + 1);
            jv *cat = s ? jn_alloc(&P->c->arena, sizeof *cat) : NULL;
            if (!cat) return jnp_fail(P, TD_ENOMEM, "out of memory%s", "");
            memcpy(s, x->lit->u.str.s, x->lit->u.str.len);
            memcpy(s + x->lit->u.str.len, b->u.str.s, b->u.str.len);
            *cat = (jv){.kind = JV_STR, .u.str = {.s = s, .len = x->lit->u.str.len + b->u.str.len}};
            x->lit = cat;
            P->i++;
        }
        return x;
    }
    case JN_T_INT:
    case JN_T_FLOAT:
        if (!(x = jnp_node(P, N_LIT))) return NULL;
        x->lit = t->val;
        P->i++;
        return x;
    case JN_T_OP:
        if (jnp_skip_op(P, "(")) {
            x = jnp_tuple(P, true, true);
            return x && jnp_expect_op(P, ")") ? x : NULL;
        }
        if (jnp_skip_op(P, "[")) return parse_collection(P, false);
        if (jnp_skip_op(P, "{")) return parse_collection(P, true);
        /* fall through */
    default:
        return jnp_fail(P, TD_EINVAL, "unexpected %s", jnp_tok_desc(P));
    }
}

static jn_node *parse_unary_in(jn_parser *P, bool with_filter)
{
    jn_node *x;
    if (jnp_is_op(P, "-") || jnp_is_op(P, "+")) {
        jn_node *u = jnp_node(P, jnp_is_op(P, "-") ? N_NEG : N_POS);
        P->i++;
        if (!u || !(u->a = parse_unary(P, false))) return NULL;
        x = u;
    } else {
        x = parse_primary(P);
    }
    x = parse_postfix(P, x);
    return with_filter ? parse_filter_expr(P, x) : x;
}

static jn_node *parse_unary(jn_parser *P, bool with_filter)
{
    if (++P->depth > JN_MAX_DEPTH) {
        P->depth--;
        return jnp_fail(P, TD_EUNSUPP, "expressions or blocks nested deeper than %s", "256");
    }
    jn_node *x = parse_unary_in(P, with_filter);
    P->depth--;
    return x;
}

static jn_node *binary(jn_parser *P, jn_op op, jn_node *a, jn_node *b)
{
    if (!a || !b) return NULL;
    jn_node *x = jnp_node(P, N_BIN);
    if (!x) return NULL;
    x->op = op;
    x->a = a;
    x->b = b;
    x->line = a->line;
    return x;
}

static jn_node *parse_pow(jn_parser *P)
{
    jn_node *x = parse_unary(P, true);
    while (x && jnp_skip_op(P, "**"))
        x = binary(P, OP_POW, x, parse_unary(P, true));
    return x;
}

static jn_node *parse_math2(jn_parser *P)
{
    jn_node *x = parse_pow(P);
    for (;;) {
        jn_op op;
        if (jnp_skip_op(P, "*"))
            op = OP_MUL;
        else if (jnp_skip_op(P, "/"))
            op = OP_DIV;
        else if (jnp_skip_op(P, "//"))
            op = OP_FLOORDIV;
        else if (jnp_skip_op(P, "%"))
            op = OP_MOD;
        else
            return x;
        x = binary(P, op, x, parse_pow(P));
    }
}

static jn_node *parse_concat(jn_parser *P)
{
    jn_node *x = parse_math2(P);
    while (x && jnp_skip_op(P, "~"))
        x = binary(P, OP_CONCAT, x, parse_math2(P));
    return x;
}

static jn_node *parse_math1(jn_parser *P)
{
    jn_node *x = parse_concat(P);
    for (;;) {
        if (jnp_skip_op(P, "+"))
            x = binary(P, OP_ADD, x, parse_concat(P));
        else if (jnp_skip_op(P, "-"))
            x = binary(P, OP_SUB, x, parse_concat(P));
        else
            return x;
    }
}

static jn_node *parse_compare(jn_parser *P)
{
    jn_node *x = parse_math1(P);
    if (!x) return NULL;
    jn_nodevec v = {0};
    jn_op ops[32];
    size_t n_ops = 0;
    static const char *const cmp[] = {"==", "!=", "<", "<=", ">", ">="};
    for (;;) {
        jn_op op;
        int k = 0;
        for (; k < 6 && !jnp_is_op(P, cmp[k]); k++) {
        }
        if (k < 6) {
            op = (jn_op)(OP_EQ + k);
            P->i++;
        } else if (jnp_skip_name(P, "in")) {
            op = OP_IN;
        } else if (jnp_is_name(P, "not") && jnp_is_name_at(P, 1, "in")) {
            P->i += 2;
            op = OP_NOTIN;
        } else {
            break;
        }
        if (n_ops == 32) return jnp_fail(P, TD_EUNSUPP, "more than 32 chained comparisons%s", "");
        if (!v.n && jnp_vec_push(P, &v, x)) return NULL;
        ops[n_ops++] = op;
        if (jnp_vec_push(P, &v, parse_math1(P))) return NULL;
    }
    if (!n_ops) return x;
    jn_node *c = jnp_node(P, N_CMP);
    if (!c) return NULL;
    c->kids = v.v;
    c->n = v.n;
    if (!(c->ops = jn_alloc(&P->c->arena, n_ops * sizeof *c->ops)))
        return jnp_fail(P, TD_ENOMEM, "out of memory%s", "");
    memcpy(c->ops, ops, n_ops * sizeof *ops);
    c->line = x->line;
    return c;
}

static jn_node *parse_not_in(jn_parser *P)
{
    if (jnp_is_name(P, "not")) {
        jn_node *x = jnp_node(P, N_NOT);
        P->i++;
        if (!x || !(x->a = parse_not(P))) return NULL;
        return x;
    }
    return parse_compare(P);
}

static jn_node *parse_not(jn_parser *P)
{
    if (++P->depth > JN_MAX_DEPTH) {
        P->depth--;
        return jnp_fail(P, TD_EUNSUPP, "expressions or blocks nested deeper than %s", "256");
    }
    jn_node *x = parse_not_in(P);
    P->depth--;
    return x;
}

static jn_node *logical(jn_parser *P, jn_kind k, jn_node *a, jn_node *b)
{
    if (!a || !b) return NULL;
    jn_node *x = jnp_node(P, k);
    if (!x) return NULL;
    x->a = a;
    x->b = b;
    x->line = a->line;
    return x;
}

static jn_node *parse_and(jn_parser *P)
{
    jn_node *x = parse_not(P);
    while (x && jnp_skip_name(P, "and"))
        x = logical(P, N_AND, x, parse_not(P));
    return x;
}

static jn_node *parse_or(jn_parser *P)
{
    jn_node *x = parse_and(P);
    while (x && jnp_skip_name(P, "or"))
        x = logical(P, N_OR, x, parse_and(P));
    return x;
}

static jn_node *parse_expr_in(jn_parser *P, bool condexpr)
{
    jn_node *x = parse_or(P);
    while (condexpr && x && jnp_skip_name(P, "if")) {
        jn_node *c = jnp_node(P, N_COND);
        if (!c || !(c->a = parse_or(P))) return NULL;
        c->b = x;
        if (jnp_skip_name(P, "else") && !(c->c = jnp_expr(P, true))) return NULL;
        c->line = x->line;
        x = c;
    }
    return x;
}

jn_node *jnp_expr(jn_parser *P, bool condexpr)
{
    if (++P->depth > JN_MAX_DEPTH) {
        P->depth--;
        return jnp_fail(P, TD_EUNSUPP, "expressions or blocks nested deeper than %s", "256");
    }
    jn_node *x = parse_expr_in(P, condexpr);
    P->depth--;
    return x;
}

static bool tuple_end(jn_parser *P)
{
    jn_tok *t = jnp_cur(P);
    return t->type == JN_T_VAR_END || t->type == JN_T_BLOCK_END || t->type == JN_T_EOF ||
           jnp_is_op(P, ")") || jnp_is_op(P, "]") || jnp_is_op(P, "}") || jnp_is_op(P, "=") ||
           jnp_is_name(P, "in") || jnp_is_name(P, "if") || jnp_is_name(P, "recursive");
}

/* Expressions separated by commas: one without a comma is itself, else a tuple. */
jn_node *jnp_tuple(jn_parser *P, bool condexpr, bool explicit_parens)
{
    jn_nodevec v = {0};
    bool comma = false;
    int line = jnp_cur(P)->line;
    for (;;) {
        if (v.n) {
            if (!jnp_skip_op(P, ",")) break;
            comma = true;
        }
        if (tuple_end(P)) break;
        if (jnp_vec_push(P, &v, jnp_expr(P, condexpr))) return NULL;
    }
    if (v.n == 1 && !comma) return v.v[0];
    if (!v.n && !explicit_parens)
        return jnp_fail(P, TD_EINVAL, "expected an expression, got %s", jnp_tok_desc(P));
    jn_node *x = jnp_node(P, N_TUPLE);
    if (!x) return NULL;
    x->kids = v.v;
    x->n = v.n;
    x->line = line;
    return x;
}

int jn_parse(const char *src, size_t len, jn_template **out, jn_error *err)
{
    *out = NULL;
    jn_template *t = calloc(1, sizeof *t);
    jn_ctx *c = t ? calloc(1, sizeof *c) : NULL;
    if (!c) {
        free(t);
        return TD_ENOMEM;
    }
    jn_error scratch;
    c->err = err ? err : &scratch;
    c->max_output = (size_t)1 << 30;
    t->pc = c;
    jn_tok *toks = NULL;
    size_t n = 0;
    if (!jn_lex(c, src, len, &toks, &n)) {
        jn_parser P = {.c = c, .t = toks, .n = n};
        t->root = jnp_body(&P, NULL, 0);
        if (t->root && jnp_cur(&P)->type != JN_T_EOF)
            jnp_fail(&P, TD_EINVAL, "unexpected %s", jnp_tok_desc(&P));
    }
    free(toks);
    int rc = c->rc;
    if (rc) {
        jn_template_free(t);
        return rc;
    }
    c->err = NULL;
    *out = t;
    return 0;
}

bool jn_template_reads(const jn_template *t, const char *name)
{
    return t && jnp_reads_name(t->root, name);
}

void jn_template_free(jn_template *t)
{
    if (!t) return;
    if (t->pc) jn_arena_free(&t->pc->arena);
    free(t->pc);
    free(t);
}
