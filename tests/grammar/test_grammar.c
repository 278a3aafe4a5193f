/* test_grammar.c: the schema compiler, the matcher and the token mask (grammar/gr_grammar.h). */
#include <string.h>

#include "gr_grammar.h"
#include "td_err.h"
#include "tharness.h"

static const char *piece_of(void *ctx, int32_t id, size_t *len)
{
    const char *const *p = ctx;
    if (!p[id]) return NULL;
    *len = strlen(p[id]);
    return p[id];
}

/* A small vocabulary: single bytes and a few multi-byte tokens. Token 0 is EOG. */
static const char *vocab_pieces[] = {NULL,  "{",    "}",       "\"",   ":",     ",",        " ",
                                     "\n",  "[",    "]",       "a",    "b",     "1",        "0",
                                     "-",   ".",    "e",       "true", "false", "null",     "{\"",
                                     "\":", "\",",  "\"}",     "name", "age",   "{}",       "\\",
                                     "u",   "\n  ", "x",       "\xc3", "\xa9",  "\xc3\xa9", "2",
                                     "ab",  "]}",   "<|ctl|>", "n",    "t",     "r",        "f",
                                     "l",   "s"};
#define NV ((int32_t)(sizeof vocab_pieces / sizeof vocab_pieces[0]))
static gr_vocab *V;

static const char *piece_nonctl(void *ctx, int32_t id, size_t *len)
{
    if (id == 37) return NULL; /* a control token: never generated */
    return piece_of(ctx, id, len);
}

static int match(const char *schema, bool strict, const char *doc, bool *complete)
{
    gr_grammar *g = NULL;
    char err[256] = "";
    int rc = schema
                 ? gr_compile_text(strict ? TD_GRAMMAR_JSON_SCHEMA_STRICT : TD_GRAMMAR_JSON_SCHEMA,
                                   schema, &g, err, sizeof err)
                 : gr_compile_json_object(&g);
    if (rc) {
        fprintf(stderr, "compile failed: %s\n", err);
        return rc;
    }
    gr_matcher *m = NULL;
    rc = gr_matcher_create(g, V, &m);
    gr_grammar_unref(g);
    if (rc) return rc;
    rc = gr_matcher_accept_bytes(m, doc, strlen(doc));
    if (complete) *complete = gr_matcher_can_end(m);
    gr_matcher_destroy(m);
    return rc;
}

/* valid: accepted and complete */
static bool ok(const char *schema, bool strict, const char *doc)
{
    bool c = false;
    return match(schema, strict, doc, &c) == 0 && c;
}

/* invalid: rejected (a byte leaves the grammar) or incomplete */
static bool bad(const char *schema, bool strict, const char *doc)
{
    bool c = false;
    int rc = match(schema, strict, doc, &c);
    return rc == TD_EINVAL || (rc == 0 && !c);
}

static void test_json_object(void)
{
    TH_CHECK(ok(NULL, false, "{}"));
    TH_CHECK(ok(NULL, false, "{\"a\":1}"));
    TH_CHECK(ok(NULL, false, "{\"a\": [1, 2.5e-3, \"x\", true, null, {\"b\": {}}]}"));
    TH_CHECK(ok(NULL, false, "{\n  \"a\": \"\\u00e9\\n\\\"\"\n}"));
    TH_CHECK(ok(NULL, false, "{\"\xc3\xa9\": \"\xe2\x82\xac\xf0\x9f\x98\x80\"}"));
    TH_CHECK(bad(NULL, false, "[]"));
    TH_CHECK(bad(NULL, false, " {}"));
    TH_CHECK(bad(NULL, false, "{}x"));
    TH_CHECK(bad(NULL, false, "{\"a\":1,}"));
    TH_CHECK(bad(NULL, false, "{\"a\" 1}"));
    TH_CHECK(bad(NULL, false, "{\"a\":01}"));
    TH_CHECK(bad(NULL, false, "{\"a\":\"\x01\"}"));
    TH_CHECK(bad(NULL, false, "{\"a\":\"\xc3\"}"));         /* truncated UTF-8 */
    TH_CHECK(bad(NULL, false, "{\"a\":\"\xed\xa0\x80\"}")); /* a surrogate */
    TH_CHECK(bad(NULL, false, "{\"a\":\"\\x\"}"));
    TH_CHECK(bad(NULL, false, "{  \"a\":1}"));               /* two spaces: whitespace is bounded */
    TH_CHECK(bad(NULL, false, "{\"a\":12345678901234567}")); /* 17 digits */
    TH_CHECK(bad(NULL, false, "{\"a\""));
}

static void test_object_properties(void)
{
    const char *s = "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},"
                    "\"age\":{\"type\":\"integer\"}},\"required\":[\"name\"],"
                    "\"additionalProperties\":false}";
    TH_CHECK(ok(s, false, "{\"name\":\"x\",\"age\":3}"));
    TH_CHECK(ok(s, false, "{\"name\": \"x\"}"));
    TH_CHECK(ok(s, true, "{\"name\":\"x\", \"age\":-3}"));
    TH_CHECK(bad(s, true, "{\"name\":\"x\"}"));            /* strict: every property */
    TH_CHECK(bad(s, false, "{\"age\":3}"));                /* name is required */
    TH_CHECK(bad(s, false, "{\"age\":3,\"name\":\"x\"}")); /* schema order */
    TH_CHECK(bad(s, false, "{\"name\":\"x\",\"age\":3.5}"));
    TH_CHECK(bad(s, false, "{\"name\":\"x\",\"other\":1}"));
    TH_CHECK(bad(s, false, "{\"name\":1}"));
    const char *opt = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"boolean\"},"
                      "\"b\":{\"type\":\"null\"}}}";
    TH_CHECK(ok(opt, false, "{}"));
    TH_CHECK(ok(opt, false, "{\"b\":null}"));
    TH_CHECK(ok(opt, false, "{\"a\":false}"));
    TH_CHECK(ok(opt, false, "{\"a\":true,\"b\":null}"));
    TH_CHECK(bad(opt, false, "{,\"b\":null}"));
    TH_CHECK(bad(opt, false, "{\"a\":true,}"));
    const char *addl = "{\"type\":\"object\",\"additionalProperties\":{\"type\":\"integer\"}}";
    TH_CHECK(ok(addl, false, "{\"x\":1,\"y\":2}"));
    TH_CHECK(bad(addl, false, "{\"x\":\"1\"}"));
    TH_CHECK(ok("{\"type\":\"object\",\"additionalProperties\":false}", false, "{}"));
    TH_CHECK(bad("{\"type\":\"object\",\"additionalProperties\":false}", false, "{\"a\":1}"));
}

static void test_arrays_strings_numbers(void)
{
    const char *arr = "{\"type\":\"array\",\"items\":{\"type\":\"number\"},\"minItems\":1,"
                      "\"maxItems\":3}";
    TH_CHECK(ok(arr, false, "[1]"));
    TH_CHECK(ok(arr, false, "[1, 2.5, -0.5e+10]"));
    TH_CHECK(bad(arr, false, "[]"));
    TH_CHECK(bad(arr, false, "[1,2,3,4]"));
    TH_CHECK(bad(arr, false, "[\"a\"]"));
    const char *un = "{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":2}";
    TH_CHECK(ok(un, false, "[1,2,3,4,5,6,7,8,9,10]"));
    TH_CHECK(bad(un, false, "[1]"));
    TH_CHECK(ok("{\"type\":\"array\"}", false, "[1,\"a\",{}]"));
    TH_CHECK(ok("{\"type\":\"array\"}", false, "[]"));
    const char *str = "{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}";
    TH_CHECK(ok(str, false, "\"ab\""));
    TH_CHECK(ok(str, false, "\"\xc3\xa9\\n\\u0041\""));
    TH_CHECK(bad(str, false, "\"a\""));
    TH_CHECK(bad(str, false, "\"abcd\""));
    TH_CHECK(ok("{\"type\":\"integer\"}", false, "-12"));
    TH_CHECK(bad("{\"type\":\"integer\"}", false, "1.5"));
    TH_CHECK(ok("{\"type\":\"number\"}", false, "0.25"));
    TH_CHECK(bad("{\"type\":\"number\"}", false, "1."));
    TH_CHECK(bad("{\"type\":\"number\"}", false, ".5"));
    TH_CHECK(ok("{\"type\":\"boolean\"}", false, "true"));
    TH_CHECK(bad("{\"type\":\"boolean\"}", false, "True"));
}

static void test_enum_const_anyof_ref(void)
{
    const char *en = "{\"enum\":[\"red\",\"green\",3,null,{\"a\":[1]}]}";
    TH_CHECK(ok(en, false, "\"red\""));
    TH_CHECK(ok(en, false, "3"));
    TH_CHECK(ok(en, false, "null"));
    TH_CHECK(ok(en, false, "{\"a\":[1]}"));
    TH_CHECK(bad(en, false, "\"blue\""));
    TH_CHECK(bad(en, false, "\"re\""));
    TH_CHECK(ok("{\"type\":\"string\",\"enum\":[\"a\",1]}", false, "\"a\""));
    TH_CHECK(bad("{\"type\":\"string\",\"enum\":[\"a\",1]}", false, "1"));
    TH_CHECK(ok("{\"const\":\"fixed\"}", false, "\"fixed\""));
    TH_CHECK(bad("{\"const\":\"fixed\"}", false, "\"fixe\""));
    const char *any = "{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"integer\"}]}";
    TH_CHECK(ok(any, false, "\"s\""));
    TH_CHECK(ok(any, false, "7"));
    TH_CHECK(bad(any, false, "true"));
    const char *nul = "{\"type\":[\"string\",\"null\"]}";
    TH_CHECK(ok(nul, false, "null"));
    TH_CHECK(ok(nul, false, "\"x\""));
    TH_CHECK(bad(nul, false, "1"));
    const char *rec =
        "{\"$ref\":\"#/$defs/node\",\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{"
        "\"v\":{\"type\":\"integer\"},\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$"
        "defs/node\"}}},\"required\":[\"v\",\"kids\"]}}}";
    TH_CHECK(ok(rec, false,
                "{\"v\":1,\"kids\":[{\"v\":2,\"kids\":[]},{\"v\":3,\"kids\":[{\"v\":4,"
                "\"kids\":[]}]}]}"));
    TH_CHECK(bad(rec, false, "{\"v\":1,\"kids\":[{\"v\":2}]}"));
    const char *defs = "{\"type\":\"object\",\"properties\":{\"p\":{\"$ref\":\"#/definitions/"
                       "pt\"}},\"required\":[\"p\"],\"definitions\":{\"pt\":{\"type\":\"array\","
                       "\"items\":{\"type\":\"number\"},\"minItems\":2,\"maxItems\":2}}}";
    TH_CHECK(ok(defs, false, "{\"p\":[1,2]}"));
    TH_CHECK(bad(defs, false, "{\"p\":[1]}"));
}

static int compile_err(const char *schema, char *err, size_t cap)
{
    gr_grammar *g = NULL;
    int rc = gr_compile_text(TD_GRAMMAR_JSON_SCHEMA, schema, &g, err, cap);
    gr_grammar_unref(g);
    return rc;
}

static void test_errors(void)
{
    char err[256];
    TH_CHECK(compile_err("{\"type\":\"string\",\"pattern\":\"^a\"}", err, sizeof err) ==
             TD_EUNSUPP);
    TH_CHECKF(strstr(err, "'pattern'") && strstr(err, "at #"), "%s", err);
    TH_CHECK(compile_err("{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"number\","
                         "\"minimum\":3}}}",
                         err, sizeof err) == TD_EUNSUPP);
    TH_CHECKF(strstr(err, "'minimum'") && strstr(err, "#/properties/x"), "%s", err);
    TH_CHECK(compile_err("{\"allOf\":[]}", err, sizeof err) == TD_EUNSUPP);
    TH_CHECK(strstr(err, "'allOf'") != NULL);
    TH_CHECK(compile_err("{\"$ref\":\"http://x/y\"}", err, sizeof err) == TD_EUNSUPP);
    TH_CHECK(compile_err("{\"$ref\":\"#/$defs/missing\"}", err, sizeof err) == TD_EINVAL);
    TH_CHECK(compile_err("{\"type\":\"strin\"}", err, sizeof err) == TD_EINVAL);
    TH_CHECK(compile_err("not json", err, sizeof err) == TD_EINVAL);
    TH_CHECK(compile_err("{\"type\":\"array\",\"maxItems\":100000}", err, sizeof err) ==
             TD_EUNSUPP);
    TH_CHECK(compile_err("{\"minLength\":3}", err, sizeof err) == TD_EUNSUPP);
    /* a $ref cycle that consumes nothing compiles, and matches nothing unbounded */
    TH_CHECK(compile_err("{\"$ref\":\"#/$defs/a\",\"$defs\":{\"a\":{\"$ref\":\"#/$defs/a\"}}}", err,
                         sizeof err) == 0);
}

static bool allowed(const uint32_t *mask, int32_t id)
{
    return mask[id >> 5] >> (id & 31) & 1;
}

static void test_mask(void)
{
    gr_grammar *g = NULL;
    const char *s = "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\","
                    "\"maxLength\":2}},\"required\":[\"name\"]}";
    char err[128];
    TH_REQUIRE(gr_compile_text(TD_GRAMMAR_JSON_SCHEMA, s, &g, err, sizeof err) == 0);
    gr_matcher *m = NULL;
    TH_REQUIRE(gr_matcher_create(g, V, &m) == 0);
    gr_grammar_unref(g);
    const uint32_t *mask;
    TH_REQUIRE(gr_matcher_mask(m, &mask) == 0);
    for (int32_t i = 0; i < NV; i++) /* only "{" and "{\"" can start */
        TH_CHECKF(allowed(mask, i) == (i == 1 || i == 20), "token %d", i);
    TH_CHECK(gr_matcher_accept_token(m, 2) == TD_EINVAL); /* "}" */
    TH_CHECK(gr_matcher_accept_token(m, 0) == TD_EINVAL); /* EOG before the end */
    TH_CHECK(gr_matcher_accept_token(m, 20) == 0);        /* {" */
    TH_CHECK(gr_matcher_accept_token(m, 24) == 0);        /* name */
    TH_CHECK(gr_matcher_accept_token(m, 21) == 0);        /* ": */
    TH_REQUIRE(gr_matcher_mask(m, &mask) == 0);
    TH_CHECK(allowed(mask, 3) && allowed(mask, 6) && !allowed(mask, 10));
    TH_CHECK(gr_matcher_accept_token(m, 3) == 0); /* " */
    TH_REQUIRE(gr_matcher_mask(m, &mask) == 0);
    TH_CHECK(allowed(mask, 35) && allowed(mask, 33) && allowed(mask, 31) && !allowed(mask, 32));
    TH_CHECK(!allowed(mask, 37) && !allowed(mask, 0)); /* control token, EOG */
    TH_CHECK(allowed(mask, 23) && !allowed(mask, 22)); /* "} ends it, ", cannot */
    TH_CHECK(gr_matcher_accept_token(m, 35) == 0);     /* ab: maxLength reached */
    TH_REQUIRE(gr_matcher_mask(m, &mask) == 0);
    TH_CHECK(allowed(mask, 3) && !allowed(mask, 10) && !allowed(mask, 35));
    TH_CHECK(!gr_matcher_done(m));
    TH_CHECK(gr_matcher_accept_token(m, 23) == 0); /* "} */
    TH_CHECK(gr_matcher_can_end(m) && gr_matcher_done(m));
    TH_REQUIRE(gr_matcher_mask(m, &mask) == 0);
    for (int32_t i = 0; i < NV; i++)
        TH_CHECKF(allowed(mask, i) == (i == 0), "token %d after the end", i);
    TH_CHECK(gr_matcher_accept_token(m, 0) == 0);
    TH_CHECK(gr_matcher_done(m));
    gr_matcher_destroy(m);
}

/* The mask agrees with accept_token for every token, along a whole document. */
static void test_mask_agrees(void)
{
    gr_grammar *g = NULL;
    TH_REQUIRE(gr_compile_json_object(&g) == 0);
    gr_matcher *m = NULL;
    TH_REQUIRE(gr_matcher_create(g, V, &m) == 0);
    const int32_t doc[] = {20, 10, 21, 6, 8, 12, 5, 17, 5, 26, 9, 5, 3, 35, 21, 19, 2};
    for (size_t k = 0; k < sizeof doc / sizeof doc[0]; k++) {
        const uint32_t *mask;
        TH_REQUIRE(gr_matcher_mask(m, &mask) == 0);
        uint32_t copy[(NV + 31) / 32]; /* the mask has one bit per token, no more */
        memcpy(copy, mask, sizeof copy);
        for (int32_t i = 0; i < NV; i++) {
            gr_matcher *t = NULL;
            TH_REQUIRE(gr_matcher_create(g, V, &t) == 0);
            TH_REQUIRE(gr_matcher_accept_tokens(t, doc, (int64_t)k) == 0);
            TH_CHECKF((gr_matcher_accept_token(t, i) == 0) == allowed(copy, i), "step %zu tok %d",
                      k, i);
            gr_matcher_destroy(t);
        }
        TH_CHECKF(allowed(copy, doc[k]), "step %zu", k);
        TH_REQUIRE(gr_matcher_accept_token(m, doc[k]) == 0);
    }
    TH_CHECK(gr_matcher_done(m));
    gr_matcher_destroy(m);
    gr_grammar_unref(g);
}

static void test_cache(void)
{
    gr_cache *c = NULL;
    TH_REQUIRE(gr_cache_create(2, &c) == 0);
    gr_grammar *a, *b, *d;
    char err[128];
    TH_REQUIRE(gr_cache_get(c, TD_GRAMMAR_JSON_SCHEMA, "{\"type\":\"integer\"}", &a, err,
                            sizeof err) == 0);
    TH_REQUIRE(gr_cache_get(c, TD_GRAMMAR_JSON_SCHEMA, "{\"type\":\"integer\"}", &b, err,
                            sizeof err) == 0);
    TH_CHECK(a == b);
    TH_REQUIRE(gr_cache_get(c, TD_GRAMMAR_JSON_OBJECT, NULL, &d, err, sizeof err) == 0);
    TH_CHECK(d != a);
    TH_CHECK(gr_cache_get(c, TD_GRAMMAR_JSON_SCHEMA, "{\"format\":1}", &b, err, sizeof err) ==
             TD_EUNSUPP);
    gr_grammar_unref(a);
    gr_grammar_unref(a);
    gr_grammar_unref(d);
    gr_cache_destroy(c);
}

int main(void)
{
    int32_t eog = 0;
    if (gr_vocab_create(NV, piece_nonctl, (void *)vocab_pieces, &eog, 1, &V)) return 1;
    gr_vocab *none = NULL;
    TH_CHECK(gr_vocab_create(0, piece_nonctl, NULL, NULL, 0, &none) == TD_EINVAL && !none);
    TH_RUN(test_json_object);
    TH_RUN(test_object_properties);
    TH_RUN(test_arrays_strings_numbers);
    TH_RUN(test_enum_const_anyof_ref);
    TH_RUN(test_errors);
    TH_RUN(test_mask);
    TH_RUN(test_mask_agrees);
    TH_RUN(test_cache);
    gr_vocab_destroy(V);
    TH_EXIT();
}
