/* jn_parse.c: tokens -> syntax tree, following jinja2's parser (its precedence, its implicit
 * tuples, its test arguments without parentheses), and jn_parse / jn_template_free. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jn_int.h"
#include "jn_lex.h"
#include "td_err.h"

typedef struct {
    jn_ctx *c;
    jn_tok *t;
    size_t n, i;
} parser;

typedef struct {
    jn_node **v;
    size_t n, cap;
} nodevec;

static jn_node *perr(parser *P, int rc, const char *fmt, const char *arg)
{
    jn_fail(P->c, rc, P->t[P->i].line, fmt, arg);
    return NULL;
}

static jn_tok *cur(parser *P)
{
    return &P->t[P->i];
}

static bool is_op(parser *P, const char *op)
{
    jn_tok *t = cur(P);
    return t->type == JN_T_OP && t->len == strlen(op) && !strncmp(t->s, op, t->len);
}

static bool is_name(parser *P, const char *name)
{
    jn_tok *t = cur(P);
    return t->type == JN_T_NAME && t->len == strlen(name) && !strncmp(t->s, name, t->len);
}

static bool is_name_at(parser *P, size_t k, const char *name)
{
    jn_tok *t = P->i + k < P->n ? &P->t[P->i + k] : &P->t[P->n - 1];
    return t->type == JN_T_NAME && t->len == strlen(name) && !strncmp(t->s, name, t->len);
}

static bool skip_op(parser *P, const char *op)
{
    if (!is_op(P, op)) return false;
    P->i++;
    return true;
}

static bool skip_name(parser *P, const char *name)
{
    if (!is_name(P, name)) return false;
    P->i++;
    return true;
}

static const char *tok_desc(parser *P)
{
    static _Thread_local char d[48];
    jn_tok *t = cur(P);
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

static bool expect_op(parser *P, const char *op)
{
    if (skip_op(P, op)) return true;
    jn_fail(P->c, TD_EINVAL, cur(P)->line, "expected '%s', got %s", op, tok_desc(P));
    return false;
}

static jn_node *node(parser *P, jn_kind k)
{
    jn_node *x = jn_alloc(&P->c->arena, sizeof *x);
    if (!x) return perr(P, TD_ENOMEM, "out of memory%s", "");
    x->kind = k;
    x->line = cur(P)->line;
    return x;
}

static const char *tok_name(parser *P)
{
    jn_tok *t = cur(P);
    char *s = jn_alloc(&P->c->arena, t->len + 1);
    if (!s) return (const char *)perr(P, TD_ENOMEM, "out of memory%s", "");
    memcpy(s, t->s, t->len);
    P->i++;
    return s;
}

static int vec_push(parser *P, nodevec *v, jn_node *x)
{
    if (!x) return -1;
    if (v->n == v->cap) {
        size_t cap = v->cap ? 2 * v->cap : 8;
        jn_node **nv = jn_alloc(&P->c->arena, cap * sizeof *nv);
        if (!nv) return perr(P, TD_ENOMEM, "out of memory%s", ""), -1;
        if (v->n) memcpy(nv, v->v, v->n * sizeof *nv);
        v->v = nv;
        v->cap = cap;
    }
    v->v[v->n++] = x;
    return 0;
}

static jn_node *parse_expr(parser *P, bool condexpr);
static jn_node *parse_tuple(parser *P, bool condexpr, bool explicit_parens);
static jn_node *parse_unary(parser *P, bool with_filter);
static jn_node *parse_primary(parser *P);
static jn_node *parse_postfix(parser *P, jn_node *x);

/* (args): positional then keyword arguments into x->kids / x->kw. */
static int parse_call_args(parser *P, jn_node *x)
{
    nodevec args = {0};
    const char *kw[64];
    size_t n_kw = 0;
    if (!expect_op(P, "(")) return -1;
    while (!is_op(P, ")")) {
        if (args.n && !expect_op(P, ",")) return -1;
        if (is_op(P, ")")) break; /* a trailing comma */
        if (is_op(P, "*") || is_op(P, "**"))
            return perr(P, TD_EUNSUPP, "*args and **kwargs in a call are not supported%s", ""), -1;
        if (cur(P)->type == JN_T_NAME && P->i + 1 < P->n && P->t[P->i + 1].type == JN_T_OP &&
            P->t[P->i + 1].len == 1 && P->t[P->i + 1].s[0] == '=') {
            if (n_kw == 64) return perr(P, TD_EUNSUPP, "more than 64 keyword arguments%s", ""), -1;
            kw[n_kw++] = tok_name(P);
            P->i++;
            if (vec_push(P, &args, parse_expr(P, true))) return -1;
        } else {
            if (n_kw)
                return perr(P, TD_EINVAL, "positional argument after keyword arguments%s", ""), -1;
            if (vec_push(P, &args, parse_expr(P, true))) return -1;
        }
    }
    P->i++;
    x->kids = args.v;
    x->n = args.n;
    if (n_kw) {
        x->kw = jn_alloc(&P->c->arena, n_kw * sizeof *x->kw);
        if (!x->kw) return perr(P, TD_ENOMEM, "out of memory%s", ""), -1;
        memcpy(x->kw, kw, n_kw * sizeof *kw);
        x->n_kw = n_kw;
    }
    return 0;
}

/* A filter's name (dotted names are one name) and its arguments, over x. */
static jn_node *parse_filter(parser *P, jn_node *x)
{
    jn_node *f = node(P, N_FILTER);
    if (!f) return NULL;
    if (cur(P)->type != JN_T_NAME)
        return perr(P, TD_EINVAL, "expected a filter name, got %s", tok_desc(P));
    f->name = tok_name(P);
    if (!f->name) return NULL;
    f->a = x;
    if (is_op(P, "(") && parse_call_args(P, f)) return NULL;
    return f;
}

static jn_node *parse_test(parser *P, jn_node *x)
{
    jn_node *t = node(P, N_TEST);
    if (!t) return NULL;
    t->negate = skip_name(P, "not");
    if (cur(P)->type != JN_T_NAME)
        return perr(P, TD_EINVAL, "expected a test name, got %s", tok_desc(P));
    t->name = tok_name(P);
    if (!t->name) return NULL;
    t->a = x;
    jn_tok *k = cur(P);
    if (is_op(P, "(")) {
        if (parse_call_args(P, t)) return NULL;
    } else if ((k->type == JN_T_NAME || k->type == JN_T_STRING || k->type == JN_T_INT ||
                k->type == JN_T_FLOAT || is_op(P, "[") || is_op(P, "{")) &&
               !is_name(P, "else") && !is_name(P, "or") && !is_name(P, "and")) {
        /* jinja2 takes one argument without parentheses: `x is divisibleby 3` */
        if (is_name(P, "is")) return perr(P, TD_EINVAL, "tests cannot be chained with 'is'%s", "");
        jn_node *arg = parse_postfix(P, parse_primary(P));
        if (!arg) return NULL;
        nodevec v = {0};
        if (vec_push(P, &v, arg)) return NULL;
        t->kids = v.v;
        t->n = 1;
    }
    return t;
}

static jn_node *parse_filter_expr(parser *P, jn_node *x)
{
    while (x) {
        if (skip_op(P, "|")) {
            x = parse_filter(P, x);
        } else if (skip_name(P, "is")) {
            x = parse_test(P, x);
        } else if (is_op(P, "(")) {
            jn_node *call = node(P, N_CALL);
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
static jn_node *parse_subscript(parser *P, jn_node *x)
{
    jn_node *parts[3] = {0};
    int k = 0;
    bool slice = false;
    while (!is_op(P, "]")) {
        if (skip_op(P, ":")) {
            slice = true;
            if (++k > 2) return perr(P, TD_EINVAL, "a slice has at most three parts%s", "");
            continue;
        }
        if (parts[k]) return perr(P, TD_EINVAL, "expected ':' or ']', got %s", tok_desc(P));
        if (!(parts[k] = parse_expr(P, true))) return NULL;
    }
    P->i++;
    jn_node *s = node(P, slice ? N_SLICE : N_ITEM);
    if (!s) return NULL;
    if (!slice && !parts[0]) return perr(P, TD_EINVAL, "empty subscript []%s", "");
    s->a = x;
    s->b = parts[0];
    s->c = parts[1];
    s->d = parts[2];
    return s;
}

static jn_node *parse_postfix(parser *P, jn_node *x)
{
    while (x) {
        if (skip_op(P, ".")) {
            jn_tok *t = cur(P);
            if (t->type == JN_T_NAME) {
                jn_node *a = node(P, N_ATTR);
                if (!a) return NULL;
                a->a = x;
                if (!(a->name = tok_name(P))) return NULL;
                x = a;
            } else if (t->type == JN_T_INT) { /* x.0 is x[0] */
                jn_node *it = node(P, N_ITEM), *lit = node(P, N_LIT);
                if (!it || !lit) return NULL;
                lit->lit = t->val;
                P->i++;
                it->a = x;
                it->b = lit;
                x = it;
            } else {
                return perr(P, TD_EINVAL, "expected a name after '.', got %s", tok_desc(P));
            }
        } else if (skip_op(P, "[")) {
            x = parse_subscript(P, x);
        } else if (is_op(P, "(")) {
            jn_node *call = node(P, N_CALL);
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
static jn_node *parse_collection(parser *P, bool dict)
{
    jn_node *x = node(P, dict ? N_DICT : N_LIST);
    nodevec v = {0};
    if (!x) return NULL;
    const char *close = dict ? "}" : "]";
    while (!is_op(P, close)) {
        if (v.n && !expect_op(P, ",")) return NULL;
        if (is_op(P, close)) break;
        if (vec_push(P, &v, parse_expr(P, true))) return NULL;
        if (dict && (!expect_op(P, ":") || vec_push(P, &v, parse_expr(P, true)))) return NULL;
    }
    P->i++;
    x->kids = v.v;
    x->n = v.n;
    return x;
}

static jn_node *parse_primary(parser *P)
{
    jn_tok *t = cur(P);
    jn_node *x;
    switch (t->type) {
    case JN_T_NAME: {
        static const char *const lits[] = {"true", "false", "none", "True", "False", "None"};
        for (int k = 0; k < 6; k++)
            if (is_name(P, lits[k])) {
                if (!(x = node(P, N_LIT))) return NULL;
                x->lit = k % 3 == 2 ? JN_NONE : JN_BOOL(k % 3 == 0);
                P->i++;
                return x;
            }
        if (!(x = node(P, N_NAME))) return NULL;
        x->name = tok_name(P);
        return x->name ? x : NULL;
    }
    case JN_T_STRING: {
        /* adjacent strings are one: 'a' 'b' */
        if (!(x = node(P, N_LIT))) return NULL;
        x->lit = t->val;
        P->i++;
        while (cur(P)->type == JN_T_STRING) {
            jv *b = cur(P)->val;
            char *s = jn_alloc(&P->c->arena, x->lit->u.str.len + b->u.str.len + 1);
            jv *cat = s ? jn_alloc(&P->c->arena, sizeof *cat) : NULL;
            if (!cat) return perr(P, TD_ENOMEM, "out of memory%s", "");
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
        if (!(x = node(P, N_LIT))) return NULL;
        x->lit = t->val;
        P->i++;
        return x;
    case JN_T_OP:
        if (skip_op(P, "(")) {
            x = parse_tuple(P, true, true);
            return x && expect_op(P, ")") ? x : NULL;
        }
        if (skip_op(P, "[")) return parse_collection(P, false);
        if (skip_op(P, "{")) return parse_collection(P, true);
        /* fall through */
    default:
        return perr(P, TD_EINVAL, "unexpected %s", tok_desc(P));
    }
}

static jn_node *parse_unary(parser *P, bool with_filter)
{
    jn_node *x;
    if (is_op(P, "-") || is_op(P, "+")) {
        jn_node *u = node(P, is_op(P, "-") ? N_NEG : N_POS);
        P->i++;
        if (!u || !(u->a = parse_unary(P, false))) return NULL;
        x = u;
    } else {
        x = parse_primary(P);
    }
    x = parse_postfix(P, x);
    return with_filter ? parse_filter_expr(P, x) : x;
}

static jn_node *binary(parser *P, jn_op op, jn_node *a, jn_node *b)
{
    if (!a || !b) return NULL;
    jn_node *x = node(P, N_BIN);
    if (!x) return NULL;
    x->op = op;
    x->a = a;
    x->b = b;
    x->line = a->line;
    return x;
}

static jn_node *parse_pow(parser *P)
{
    jn_node *x = parse_unary(P, true);
    while (x && skip_op(P, "**"))
        x = binary(P, OP_POW, x, parse_unary(P, true));
    return x;
}

static jn_node *parse_math2(parser *P)
{
    jn_node *x = parse_pow(P);
    for (;;) {
        jn_op op;
        if (skip_op(P, "*"))
            op = OP_MUL;
        else if (skip_op(P, "/"))
            op = OP_DIV;
        else if (skip_op(P, "//"))
            op = OP_FLOORDIV;
        else if (skip_op(P, "%"))
            op = OP_MOD;
        else
            return x;
        x = binary(P, op, x, parse_pow(P));
    }
}

static jn_node *parse_concat(parser *P)
{
    jn_node *x = parse_math2(P);
    while (x && skip_op(P, "~"))
        x = binary(P, OP_CONCAT, x, parse_math2(P));
    return x;
}

static jn_node *parse_math1(parser *P)
{
    jn_node *x = parse_concat(P);
    for (;;) {
        if (skip_op(P, "+"))
            x = binary(P, OP_ADD, x, parse_concat(P));
        else if (skip_op(P, "-"))
            x = binary(P, OP_SUB, x, parse_concat(P));
        else
            return x;
    }
}

static jn_node *parse_compare(parser *P)
{
    jn_node *x = parse_math1(P);
    if (!x) return NULL;
    nodevec v = {0};
    jn_op ops[32];
    size_t n_ops = 0;
    static const char *const cmp[] = {"==", "!=", "<", "<=", ">", ">="};
    for (;;) {
        jn_op op;
        int k = 0;
        for (; k < 6 && !is_op(P, cmp[k]); k++) {
        }
        if (k < 6) {
            op = (jn_op)(OP_EQ + k);
            P->i++;
        } else if (skip_name(P, "in")) {
            op = OP_IN;
        } else if (is_name(P, "not") && is_name_at(P, 1, "in")) {
            P->i += 2;
            op = OP_NOTIN;
        } else {
            break;
        }
        if (n_ops == 32) return perr(P, TD_EUNSUPP, "more than 32 chained comparisons%s", "");
        if (!v.n && vec_push(P, &v, x)) return NULL;
        ops[n_ops++] = op;
        if (vec_push(P, &v, parse_math1(P))) return NULL;
    }
    if (!n_ops) return x;
    jn_node *c = node(P, N_CMP);
    if (!c) return NULL;
    c->kids = v.v;
    c->n = v.n;
    if (!(c->ops = jn_alloc(&P->c->arena, n_ops * sizeof *c->ops)))
        return perr(P, TD_ENOMEM, "out of memory%s", "");
    memcpy(c->ops, ops, n_ops * sizeof *ops);
    c->line = x->line;
    return c;
}

static jn_node *parse_not(parser *P)
{
    if (is_name(P, "not")) {
        jn_node *x = node(P, N_NOT);
        P->i++;
        if (!x || !(x->a = parse_not(P))) return NULL;
        return x;
    }
    return parse_compare(P);
}

static jn_node *logical(parser *P, jn_kind k, jn_node *a, jn_node *b)
{
    if (!a || !b) return NULL;
    jn_node *x = node(P, k);
    if (!x) return NULL;
    x->a = a;
    x->b = b;
    x->line = a->line;
    return x;
}

static jn_node *parse_and(parser *P)
{
    jn_node *x = parse_not(P);
    while (x && skip_name(P, "and"))
        x = logical(P, N_AND, x, parse_not(P));
    return x;
}

static jn_node *parse_or(parser *P)
{
    jn_node *x = parse_and(P);
    while (x && skip_name(P, "or"))
        x = logical(P, N_OR, x, parse_and(P));
    return x;
}

static jn_node *parse_expr(parser *P, bool condexpr)
{
    jn_node *x = parse_or(P);
    while (condexpr && x && skip_name(P, "if")) {
        jn_node *c = node(P, N_COND);
        if (!c || !(c->a = parse_or(P))) return NULL;
        c->b = x;
        if (skip_name(P, "else") && !(c->c = parse_expr(P, true))) return NULL;
        c->line = x->line;
        x = c;
    }
    return x;
}

static bool tuple_end(parser *P)
{
    jn_tok *t = cur(P);
    return t->type == JN_T_VAR_END || t->type == JN_T_BLOCK_END || t->type == JN_T_EOF ||
           is_op(P, ")") || is_op(P, "]") || is_op(P, "}") || is_op(P, "=") || is_name(P, "in") ||
           is_name(P, "if") || is_name(P, "recursive");
}

/* Expressions separated by commas: one without a comma is itself, else a tuple. */
static jn_node *parse_tuple(parser *P, bool condexpr, bool explicit_parens)
{
    nodevec v = {0};
    bool comma = false;
    int line = cur(P)->line;
    for (;;) {
        if (v.n) {
            if (!skip_op(P, ",")) break;
            comma = true;
        }
        if (tuple_end(P)) break;
        if (vec_push(P, &v, parse_expr(P, condexpr))) return NULL;
    }
    if (v.n == 1 && !comma) return v.v[0];
    if (!v.n && !explicit_parens)
        return perr(P, TD_EINVAL, "expected an expression, got %s", tok_desc(P));
    jn_node *x = node(P, N_TUPLE);
    if (!x) return NULL;
    x->kids = v.v;
    x->n = v.n;
    x->line = line;
    return x;
}

/* ---- statements ---- */

static jn_node *parse_body(parser *P, const char *const *ends, size_t n_ends);

static bool at_block_name(parser *P, const char *name)
{
    return cur(P)->type == JN_T_BLOCK_BEGIN && is_name_at(P, 1, name);
}

static bool expect_block_end(parser *P)
{
    if (cur(P)->type == JN_T_BLOCK_END) {
        P->i++;
        return true;
    }
    perr(P, TD_EINVAL, "expected the end of the statement block, got %s", tok_desc(P));
    return false;
}

/* {% NAME %} closing a block: BLOCK_BEGIN, NAME, BLOCK_END. */
static bool expect_end_tag(parser *P, const char *name)
{
    if (!at_block_name(P, name)) {
        jn_fail(P->c, TD_EINVAL, cur(P)->line, "expected {%% %s %%}, got %s", name, tok_desc(P));
        return false;
    }
    P->i += 2;
    return expect_block_end(P);
}

/* Assignment targets: a, b or (a, b); ns.attr when allowed (set only). */
static int parse_targets(parser *P, jn_node *x, bool allow_attr)
{
    const char *names[16];
    size_t n = 0;
    bool paren = skip_op(P, "(");
    do {
        if (cur(P)->type != JN_T_NAME)
            return perr(P, TD_EINVAL, "expected a name to assign to, got %s", tok_desc(P)), -1;
        if (n == 16) return perr(P, TD_EUNSUPP, "more than 16 names to unpack%s", ""), -1;
        if (!(names[n++] = tok_name(P))) return -1;
        if (allow_attr && n == 1 && skip_op(P, ".")) {
            if (cur(P)->type != JN_T_NAME)
                return perr(P, TD_EINVAL, "expected an attribute name, got %s", tok_desc(P)), -1;
            if (!(x->attr = tok_name(P))) return -1;
            break;
        }
    } while (skip_op(P, ","));
    if (paren && !expect_op(P, ")")) return -1;
    if (!(x->names = jn_alloc(&P->c->arena, n * sizeof *names)))
        return perr(P, TD_ENOMEM, "out of memory%s", ""), -1;
    memcpy(x->names, names, n * sizeof *names);
    x->n_names = n;
    return 0;
}

static jn_node *parse_if(parser *P)
{
    static const char *const ends[] = {"elif", "else", "endif"};
    jn_node *x = node(P, S_IF);
    nodevec arms = {0};
    if (!x) return NULL;
    for (;;) {
        if (vec_push(P, &arms, parse_tuple(P, true, false)) || !expect_block_end(P) ||
            vec_push(P, &arms, parse_body(P, ends, 3)))
            return NULL;
        P->i++; /* the block's begin; its name is next */
        if (skip_name(P, "elif")) continue;
        if (skip_name(P, "else")) {
            if (!expect_block_end(P) || vec_push(P, &arms, parse_body(P, ends + 2, 1))) return NULL;
            P->i++;
        }
        if (!skip_name(P, "endif") || !expect_block_end(P))
            return perr(P, TD_EINVAL, "expected {%% endif %%}, got %s", tok_desc(P));
        break;
    }
    x->kids = arms.v;
    x->n = arms.n;
    return x;
}

static jn_node *parse_for(parser *P)
{
    static const char *const ends[] = {"else", "endfor"};
    jn_node *x = node(P, S_FOR);
    if (!x || parse_targets(P, x, false)) return NULL;
    if (!skip_name(P, "in"))
        return perr(P, TD_EINVAL, "expected 'in' in a for loop, got %s", tok_desc(P));
    if (!(x->a = parse_tuple(P, false, false))) return NULL;
    if (skip_name(P, "if") && !(x->b = parse_expr(P, true))) return NULL;
    if (is_name(P, "recursive"))
        return perr(P, TD_EUNSUPP, "recursive for loops are not supported%s", "");
    if (!expect_block_end(P) || !(x->body = parse_body(P, ends, 2))) return NULL;
    if (at_block_name(P, "else")) {
        P->i += 2;
        if (!expect_block_end(P) || !(x->else_body = parse_body(P, ends + 1, 1))) return NULL;
    }
    return expect_end_tag(P, "endfor") ? x : NULL;
}

static jn_node *parse_set(parser *P)
{
    static const char *const ends[] = {"endset"};
    jn_node *x = node(P, S_SET);
    if (!x || parse_targets(P, x, true)) return NULL;
    if (skip_op(P, "=")) {
        if (!(x->a = parse_tuple(P, true, false))) return NULL;
        return expect_block_end(P) ? x : NULL;
    }
    /* {% set x %}...{% endset %}, optionally through filters: {% set x | trim %} */
    if (x->n_names != 1 || x->attr)
        return perr(P, TD_EUNSUPP, "a block set assigns one plain name%s", "");
    x->kind = S_SETBLK;
    x->name = x->names[0];
    jn_node *f = NULL;
    while (skip_op(P, "|"))
        if (!(f = parse_filter(P, f))) return NULL;
    x->b = f;
    if (!expect_block_end(P) || !(x->body = parse_body(P, ends, 1))) return NULL;
    return expect_end_tag(P, "endset") ? x : NULL;
}

/* (a, b=default, ...) of a macro or a call block. */
static int parse_params(parser *P, jn_node *x)
{
    const char *names[64];
    jn_node *defs[64];
    size_t n = 0;
    if (!expect_op(P, "(")) return -1;
    while (!skip_op(P, ")")) {
        if (n && !expect_op(P, ",")) return -1;
        if (skip_op(P, ")")) break;
        if (cur(P)->type != JN_T_NAME)
            return perr(P, TD_EINVAL, "expected a parameter name, got %s", tok_desc(P)), -1;
        if (n == 64) return perr(P, TD_EUNSUPP, "more than 64 parameters%s", ""), -1;
        if (!(names[n] = tok_name(P))) return -1;
        defs[n] = NULL;
        if (skip_op(P, "=") && !(defs[n] = parse_expr(P, true))) return -1;
        n++;
    }
    x->names = jn_alloc(&P->c->arena, (n + 1) * sizeof *names);
    x->defaults = jn_alloc(&P->c->arena, (n + 1) * sizeof *defs);
    if (!x->names || !x->defaults) return perr(P, TD_ENOMEM, "out of memory%s", ""), -1;
    memcpy(x->names, names, n * sizeof *names);
    memcpy(x->defaults, defs, n * sizeof *defs);
    x->n_names = n;
    return 0;
}

/* Does the tree under x read the name? (jinja2 lets a macro take extra positional or
 * keyword arguments only when its body reads `varargs` or `kwargs`.) */
static bool reads_name(const jn_node *x, const char *name)
{
    if (!x) return false;
    if (x->kind == N_NAME && !strcmp(x->name, name)) return true;
    if (reads_name(x->a, name) || reads_name(x->b, name) || reads_name(x->c, name) ||
        reads_name(x->d, name) || reads_name(x->body, name) || reads_name(x->else_body, name))
        return true;
    for (size_t i = 0; i < x->n; i++)
        if (reads_name(x->kids[i], name)) return true;
    for (size_t i = 0; x->defaults && i < x->n_names; i++)
        if (reads_name(x->defaults[i], name)) return true;
    return false;
}

static void mark_extra_args(jn_node *x)
{
    x->negate = reads_name(x->body, "varargs");
    x->kwargs = reads_name(x->body, "kwargs");
}

static jn_node *parse_macro(parser *P)
{
    static const char *const ends[] = {"endmacro"};
    jn_node *x = node(P, S_MACRO);
    if (!x) return NULL;
    if (cur(P)->type != JN_T_NAME)
        return perr(P, TD_EINVAL, "expected a macro name, got %s", tok_desc(P));
    if (!(x->name = tok_name(P)) || parse_params(P, x) || !expect_block_end(P) ||
        !(x->body = parse_body(P, ends, 1)))
        return NULL;
    mark_extra_args(x);
    return expect_end_tag(P, "endmacro") ? x : NULL;
}

static jn_node *parse_call_block(parser *P)
{
    static const char *const ends[] = {"endcall"};
    jn_node *x = node(P, S_CALLBLK);
    if (!x) return NULL;
    if (is_op(P, "(") && parse_params(P, x)) return NULL;
    if (!(x->a = parse_expr(P, true))) return NULL;
    if (x->a->kind != N_CALL) return perr(P, TD_EINVAL, "a call block needs a call%s", "");
    if (!expect_block_end(P) || !(x->body = parse_body(P, ends, 1))) return NULL;
    mark_extra_args(x);
    return expect_end_tag(P, "endcall") ? x : NULL;
}

static jn_node *parse_filter_block(parser *P)
{
    static const char *const ends[] = {"endfilter"};
    jn_node *x = node(P, S_FILTBLK), *f = NULL;
    if (!x) return NULL;
    do {
        if (!(f = parse_filter(P, f))) return NULL;
    } while (skip_op(P, "|"));
    x->b = f;
    if (!expect_block_end(P) || !(x->body = parse_body(P, ends, 1))) return NULL;
    return expect_end_tag(P, "endfilter") ? x : NULL;
}

/* transformers' {% generation %} marks the assistant's text for its masks; it renders its
 * body unchanged. */
static jn_node *parse_generation(parser *P)
{
    static const char *const ends[] = {"endgeneration"};
    jn_node *x;
    if (!expect_block_end(P) || !(x = parse_body(P, ends, 1))) return NULL;
    return expect_end_tag(P, "endgeneration") ? x : NULL;
}

static jn_node *parse_statement(parser *P)
{
    P->i++; /* {% */
    if (cur(P)->type != JN_T_NAME)
        return perr(P, TD_EINVAL, "expected a statement name, got %s", tok_desc(P));
    if (skip_name(P, "if")) return parse_if(P);
    if (skip_name(P, "for")) return parse_for(P);
    if (skip_name(P, "set")) return parse_set(P);
    if (skip_name(P, "macro")) return parse_macro(P);
    if (skip_name(P, "call")) return parse_call_block(P);
    if (skip_name(P, "filter")) return parse_filter_block(P);
    if (skip_name(P, "generation")) return parse_generation(P);
    if (is_name(P, "break") || is_name(P, "continue")) {
        jn_node *x = node(P, is_name(P, "break") ? S_BREAK : S_CONTINUE);
        P->i++;
        return x && expect_block_end(P) ? x : NULL;
    }
    static const char *const known[] = {"block", "extends",    "include", "import", "from",
                                        "with",  "autoescape", "do",      "trans",  "raw"};
    for (size_t k = 0; k < sizeof known / sizeof *known; k++)
        if (is_name(P, known[k]))
            return perr(P, TD_EUNSUPP, "the '%s' statement is not supported in chat templates",
                        known[k]);
    return perr(P, TD_EINVAL, "unknown statement %s", tok_desc(P));
}

/* Statements until {% END %} for an END of ends (left unconsumed) or the end of the
 * template (an error when ends are given). */
static jn_node *parse_body(parser *P, const char *const *ends, size_t n_ends)
{
    jn_node *body = node(P, S_BODY);
    nodevec v = {0};
    if (!body) return NULL;
    for (;;) {
        jn_tok *t = cur(P);
        jn_node *x = NULL;
        if (t->type == JN_T_EOF) {
            if (n_ends)
                return (jn_node *)jn_fail(P->c, TD_EINVAL, t->line,
                                          "unexpected end of template: {%% %s %%} missing",
                                          ends[n_ends - 1]);
            break;
        }
        if (t->type == JN_T_TEXT) {
            if (!(x = node(P, S_TEXT))) return NULL;
            if (!(x->lit = jn_str(P->c, t->s, t->len))) return NULL;
            P->i++;
        } else if (t->type == JN_T_VAR_BEGIN) {
            P->i++;
            if (!(x = node(P, S_OUT)) || !(x->a = parse_tuple(P, true, false))) return NULL;
            if (cur(P)->type != JN_T_VAR_END)
                return perr(P, TD_EINVAL, "expected '}}', got %s", tok_desc(P));
            P->i++;
        } else if (t->type == JN_T_BLOCK_BEGIN) {
            bool end = false;
            for (size_t k = 0; k < n_ends && !end; k++)
                end = is_name_at(P, 1, ends[k]);
            if (end) break;
            if (!(x = parse_statement(P))) return NULL;
        } else {
            return perr(P, TD_EINVAL, "unexpected %s", tok_desc(P));
        }
        if (vec_push(P, &v, x)) return NULL;
    }
    body->kids = v.v;
    body->n = v.n;
    return body;
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
        parser P = {.c = c, .t = toks, .n = n};
        t->root = parse_body(&P, NULL, 0);
        if (t->root && cur(&P)->type != JN_T_EOF)
            perr(&P, TD_EINVAL, "unexpected %s", tok_desc(&P));
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
    return t && reads_name(t->root, name);
}

void jn_template_free(jn_template *t)
{
    if (!t) return;
    if (t->pc) jn_arena_free(&t->pc->arena);
    free(t->pc);
    free(t);
}
