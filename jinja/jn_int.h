/* jn_int.h: the Jinja engine's private parts, shared by its files (not for other modules).
 *
 * Values (jn_value.c): every value of a render lives in the render's arena and is freed
 * with it, so values are shared freely and never counted. Lists and dicts are immutable,
 * as the sandbox makes them; the one mutable object is a namespace (its dict). Strings are
 * UTF-8 with a length; lengths, indexes and slices count code points as Python's do.
 * Syntax tree (jn_parse.c): nodes hold their line for errors; a template owns its nodes.
 * Evaluation (jn_eval.c): scopes chain to their parent; a for statement and a macro call
 * open one, an if does not (jinja2's rules). Filters, tests, methods and globals are in
 * jn_filters.c (with the tests) and jn_methods.c (with the globals).
 */
#ifndef JN_INT_H
#define JN_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "jn.h"

/* ---- arena ---- */

typedef struct jn_chunk jn_chunk;
typedef struct {
    jn_chunk *head;
    size_t used, limit; /* bytes taken in all, and the most allowed (0: no limit) */
} jn_arena;

void *jn_alloc(jn_arena *a, size_t n); /* zeroed; NULL when out of memory or past the limit */
void jn_arena_free(jn_arena *a);

/* ---- values ---- */

typedef enum {
    JV_UNDEF,
    JV_NONE,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,
    JV_LIST,
    JV_DICT,
    JV_FUNC,
    JV_NS,
    JV_LOOP,
} jv_kind;

typedef struct jv jv;
typedef struct jn_ctx jn_ctx;
typedef struct jn_node jn_node;
typedef struct jn_scope jn_scope;

/* Arguments of a call: positional, then keyword (names[i] for kv[i]). */
typedef struct {
    jv **pos;
    size_t n_pos;
    const char **names;
    jv **kv;
    size_t n_kv;
} jn_args;

typedef jv *(*jn_native)(jn_ctx *c, jv *self, const jn_args *a, int line);

typedef struct {
    size_t n, cap;
    jv **keys, **vals;
} jn_dict;

typedef struct {
    size_t index0, length;
    jv *list; /* the items looped over (a JV_LIST) */
} jn_loop;

struct jv {
    jv_kind kind;
    union {
        bool b;
        int64_t i;
        double f;
        struct {
            const char *s; /* NUL-terminated too */
            size_t len;    /* bytes */
            bool markup;   /* markupsafe's Markup (|safe, |escape): `+` escapes the other side */
        } str;
        struct {
            jv **items;
            size_t n;
            bool tuple; /* written as a tuple: (a, b) */
            bool gen;   /* a generator (map, select, ...): iterable, but no len(), no
                           index, not JSON, always true */
        } list;
        jn_dict *dict;     /* JV_DICT, JV_NS */
        jn_loop *loop;     /* JV_LOOP */
        const char *undef; /* JV_UNDEF: the name looked up, for errors (may be NULL) */
        struct {
            const char *name;
            jn_native native; /* NULL: a macro */
            jv *self;         /* a bound method's object */
            const jn_node *macro;
            jn_scope *closure;
            jv *caller; /* a call block's caller, given to the macro it calls */
        } fn;
    } u;
};

extern jv jn_undef_v, jn_none_v, jn_true_v, jn_false_v;
#define JN_UNDEF   (&jn_undef_v)
#define JN_NONE    (&jn_none_v)
#define JN_BOOL(x) ((x) ? &jn_true_v : &jn_false_v)

jv *jn_int(jn_ctx *c, int64_t i);
jv *jn_float(jn_ctx *c, double f);
jv *jn_str(jn_ctx *c, const char *s, size_t len); /* copies */
jv *jn_cstr(jn_ctx *c, const char *s);
jv *jn_undef_named(jn_ctx *c, const char *name);
jv *jn_list(jn_ctx *c, size_t n); /* n items, all JN_NONE until set */
jv *jn_dict_new(jn_ctx *c);
int jn_dict_set(jn_ctx *c, jv *d, jv *key, jv *val); /* replaces an equal key's value */
jv *jn_dict_get(const jv *d, const jv *key);         /* NULL when absent */
jv *jn_dict_gets(const jv *d, const char *key);
jv *jn_from_json(jn_ctx *c, const json_t *j);
jv *jn_func(jn_ctx *c, const char *name, jn_native fn, jv *self);

bool jn_truthy(const jv *v);
bool jn_equal(const jv *a, const jv *b);
/* Python's ordering (<0, 0, >0) of numbers with numbers, strings with strings, lists with
 * lists; *ok false for any other pair (a TypeError in Python). */
int jn_compare(const jv *a, const jv *b, bool *ok);
const char *jn_type_name(const jv *v); /* Python's name of the type: 'str', 'dict', ... */
bool jn_is_seq(const jv *v);           /* a list (the only sequence values here) */

/* A buffer that grows, bounded by the render's output limit. */
typedef struct {
    char *buf;
    size_t len, cap;
} jn_buf;
int jn_buf_put(jn_ctx *c, jn_buf *b, const char *s, size_t n); /* 0, or -1 with c's error set */
int jn_buf_puts(jn_ctx *c, jn_buf *b, const char *s);

/* str(v) as Python writes it into b ('None', 'True', repr of lists and dicts). */
int jn_write_str(jn_ctx *c, jn_buf *b, const jv *v);
int jn_write_repr(jn_ctx *c, jn_buf *b, const jv *v);
jv *jn_to_str(jn_ctx *c, const jv *v); /* str(v) as a value; NULL on error */
/* json.dumps(v, ensure_ascii, indent, separators, sort_keys); indent < 0: none.
 * item_sep / key_sep NULL: Python's defaults for the indent. */
int jn_write_json(jn_ctx *c, jn_buf *b, const jv *v, int indent, const char *item_sep,
                  const char *key_sep, bool sort_keys, bool ensure_ascii);
/* repr(float) into s (>= 40 bytes). */
void jn_float_repr(double d, char *s);

/* UTF-8: the code point at s[*i] (advancing *i; a stray byte reads as itself); code points
 * in s[0..len); the byte offset of code point i (len if past it). */
uint32_t jn_utf8_next(const char *s, size_t n, size_t *i);
size_t jn_utf8_count(const char *s, size_t len);
size_t jn_utf8_offset(const char *s, size_t len, size_t i);

/* ---- syntax tree ---- */

typedef enum {
    /* expressions */
    N_LIT,    /* lit */
    N_NAME,   /* name */
    N_ATTR,   /* a.name */
    N_ITEM,   /* a[b] */
    N_SLICE,  /* a[b:c:d] (absent parts NULL) */
    N_CALL,   /* a(args) */
    N_FILTER, /* a | name(args) (a NULL in a filter block: the body) */
    N_TEST,   /* a is [not] name(args) */
    N_BIN,    /* a op b: + - * / // % ** ~ */
    N_NEG,    /* -a */
    N_POS,    /* +a */
    N_NOT,    /* not a */
    N_AND,
    N_OR,
    N_CMP,   /* kids[0] ops[0] kids[1] ops[1] ... (chained comparisons) */
    N_COND,  /* b if a else c */
    N_LIST,  /* [kids] */
    N_TUPLE, /* (kids) */
    N_DICT,  /* {kids[0]: kids[1], ...} */
    /* statements */
    S_TEXT,    /* text */
    S_OUT,     /* {{ a }} */
    S_IF,      /* kids: cond, body, cond, body, ..., [else body] (n odd: else) */
    S_FOR,     /* targets names; a iterable; b filter or NULL; body; else_body */
    S_SET,     /* targets names (or ns.attr: name + attr); a value */
    S_SETBLK,  /* name; body; filters in b (an N_FILTER chain over NULL) or NULL */
    S_MACRO,   /* name; params names, defaults kids (NULL entries: none); body */
    S_CALLBLK, /* a the call; params (caller's); body */
    S_FILTBLK, /* b the filter chain; body */
    S_BREAK,
    S_CONTINUE,
    S_BODY, /* kids: statements (a template, a block body) */
} jn_kind;

typedef enum {
    OP_ADD,
    OP_SUB,
    OP_MUL,
    OP_DIV,
    OP_FLOORDIV,
    OP_MOD,
    OP_POW,
    OP_CONCAT,
    OP_EQ,
    OP_NE,
    OP_LT,
    OP_LE,
    OP_GT,
    OP_GE,
    OP_IN,
    OP_NOTIN,
} jn_op;

struct jn_node {
    jn_kind kind;
    int line;
    jn_op op;
    jn_op *ops;       /* N_CMP: (n - 1) operators between kids */
    bool negate;      /* N_TEST: is not; S_MACRO / S_CALLBLK: its body reads `varargs` */
    bool kwargs;      /* S_MACRO / S_CALLBLK: its body reads `kwargs` */
    const char *name; /* N_NAME, N_ATTR, N_FILTER, N_TEST, S_SETBLK, S_MACRO; S_SET ns attr */
    const char *attr; /* S_SET: ns.attr's attr */
    jv *lit;          /* N_LIT (a template-owned value), S_TEXT */
    jn_node *a, *b, *c, *d;
    jn_node **kids; /* N_CALL/N_FILTER/N_TEST args; lists; S_IF arms; S_BODY */
    size_t n;
    const char **kw; /* keyword names of the last n_kw of kids (N_CALL, N_FILTER, N_TEST) */
    size_t n_kw;
    const char **names; /* S_FOR / S_SET targets, S_MACRO / S_CALLBLK params */
    size_t n_names;
    jn_node **defaults; /* S_MACRO / S_CALLBLK: (n_names), NULL for none */
    jn_node *body, *else_body;
};

struct jn_template {
    jn_ctx *pc;    /* the arena of the tree and its literals */
    jn_node *root; /* S_BODY */
};

/* ---- names (jn_filters.c) ---- */

/* Does jinja2 know a filter or a test of this name? An unknown one is an error when it is
 * applied (jinja2 3's rule: a template may name one in a branch it never takes). */
bool jn_has_filter(const char *name);
bool jn_has_test(const char *name);

/* ---- evaluation ---- */

struct jn_scope {
    jn_scope *parent;
    jv *vars; /* a dict */
};

struct jn_ctx {
    jn_arena arena;
    jn_error *err;
    int rc;     /* the first error (0 none) */
    int depth;  /* calls and nested renders */
    long steps; /* loop iterations and calls so far */
    size_t max_output;
    int64_t now;
    jn_scope *globals;
    jv *small_ints[256]; /* 0..255, made once per render (loop counters, lengths) */
};

/* Record an error (the first one wins); returns NULL so callers can `return jn_fail(...)`. */
jv *jn_fail(jn_ctx *c, int rc, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
bool jn_count_step(jn_ctx *c, int line); /* false (error set) past JN_MAX_STEPS */

/* Call a value (a macro, a function, a bound method). */
jv *jn_call(jn_ctx *c, jv *fn, const jn_args *a, int line);
/* Apply a filter or a test by name (map, select and friends use them too). */
jv *jn_apply_filter(jn_ctx *c, const char *name, jv *v, const jn_args *a, int line);
int jn_apply_test(jn_ctx *c, const char *name, jv *v, const jn_args *a,
                  int line); /* 1, 0, -1 err */
/* v.name: a dict's item, a string's or dict's method, loop.* and namespace attributes. */
jv *jn_getattr(jn_ctx *c, jv *v, const char *name, int line);
jv *jn_getitem(jn_ctx *c, jv *v, jv *key, int line);
/* The values iterating over v gives (a dict's keys, a string's characters); NULL + error for
 * a value that cannot be iterated; an undefined value gives an empty list. */
jv *jn_iterate(jn_ctx *c, jv *v, int line);
/* A keyword argument by name, else positional i, else NULL. */
jv *jn_arg(const jn_args *a, size_t i, const char *name);
/* The global functions (range, dict, namespace, raise_exception, strftime_now) into d. */
int jn_add_globals(jn_ctx *c, jv *d);

/* ---- methods and the string operations the filters share (jn_methods.c) ---- */

/* self.name as a bound method; NULL (no error) when self's type has no method of that name. */
jv *jn_method(jn_ctx *c, jv *self, const char *name, int line);
/* str.strip (which 3), lstrip (1), rstrip (2); chars NULL: whitespace. */
jv *jn_str_strip(jn_ctx *c, const jv *v, const jv *chars, int which);
/* ASCII case: 'u' upper, 'l' lower, 'c' first letter up, 't' each word's first letter up. */
jv *jn_str_case(jn_ctx *c, const jv *v, char mode);
jv *jn_str_replace(jn_ctx *c, jv *self, const jn_args *a, int line); /* (old, new, count) */
jv *jn_dict_items(jn_ctx *c, jv *self);                      /* a list of (key, value) tuples */
int jn_ns_check_name(jn_ctx *c, const char *name, int line); /* 0, or -1: '_' names refused */
jv *jn_html_escape(jn_ctx *c, jv *v); /* markupsafe's escape(str(v)): a Markup (jn_filters.c) */

#endif
