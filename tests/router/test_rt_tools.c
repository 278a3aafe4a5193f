/* test_rt_tools.c: the tool-call parser (router/rt_tools.c): complete calls, several calls,
 * text around them, malformed calls left as content, other key orders, truncation, the
 * parallel_tool_calls switch. Every case is fed whole and in pieces of 1, 2, 3, 5 and 11
 * bytes; the streamed events must assemble to the same answer as the parser's results, and
 * that answer must be the expected one whatever the split. */
#define _GNU_SOURCE /* memmem */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rt_buf.h"
#include "rt_tools.h"
#include "tharness.h"

#define MAXC 8

/* What a client assembles from the events (as the openai client does from the deltas). */
typedef struct {
    rt_buf content;
    bool has_content;
    int n_calls;
    char id[MAXC][40], name[MAXC][64];
    rt_buf args[MAXC];
    bool order_ok;   /* ARGS only for the newest call, CALL indices 0, 1, ... */
    bool tag_leaked; /* a content event held "<tool_call>" */
} asm_t;

static int on_ev(void *ctx, const rt_tool_ev *e)
{
    asm_t *a = ctx;
    if (e->kind == RT_TOOL_EV_CONTENT) {
        rt_buf_append(&a->content, e->text, e->len);
        a->has_content = true;
        if (memmem(e->text, e->len, "<tool_call>", 11)) a->tag_leaked = true;
    } else if (e->kind == RT_TOOL_EV_CALL) {
        if (e->index != a->n_calls || a->n_calls == MAXC) a->order_ok = false;
        if (a->n_calls == MAXC) return 0;
        snprintf(a->id[a->n_calls], sizeof a->id[0], "%s", e->id);
        snprintf(a->name[a->n_calls], sizeof a->name[0], "%s", e->name);
        a->n_calls++;
    } else {
        if (e->index != a->n_calls - 1) a->order_ok = false;
        if (e->index >= 0 && e->index < MAXC) rt_buf_append(&a->args[e->index], e->text, e->len);
    }
    return 0;
}

typedef struct {
    const char *content; /* NULL: none */
    int n_calls;
    const char *name[3], *args[3];
} want_t;

static const char *const names[] = {"get_weather", "f", "g", "a", "b"};
static size_t n_names = sizeof names / sizeof names[0];

static void run_case(const char *label, const char *text, bool parallel, const want_t *w)
{
    static const size_t splits[] = {0, 1, 2, 3, 5, 11};
    for (size_t s = 0; s < sizeof splits / sizeof splits[0]; s++) {
        size_t step = splits[s] ? splits[s] : strlen(text) + 1;
        rt_toolp *p = rt_toolp_create("chatcmpl-test", parallel, names, n_names);
        TH_REQUIRE(p != NULL);
        asm_t a = {.order_ok = true};
        size_t n = strlen(text);
        for (size_t i = 0; i < n; i += step)
            TH_CHECK(rt_toolp_feed(p, text + i, n - i < step ? n - i : step, on_ev, &a) == 0);
        TH_CHECK(rt_toolp_finish(p, on_ev, &a) == 0);
        size_t clen = 0;
        const char *c = rt_toolp_content(p, &clen);
        /* the non-streamed answer */
        bool ok = (c == NULL) == (w->content == NULL) &&
                  (!c || (clen == strlen(w->content) && !memcmp(c, w->content, clen)));
        TH_CHECKF(ok, "%s (split %zu): content '%.*s', want '%s'", label, splits[s], (int)clen,
                  c ? c : "(null)", w->content ? w->content : "(null)");
        TH_CHECKF(rt_toolp_n_calls(p) == w->n_calls, "%s (split %zu): %d calls, want %d", label,
                  splits[s], rt_toolp_n_calls(p), w->n_calls);
        json_t *calls = rt_toolp_calls_json(p);
        for (int k = 0; k < w->n_calls && k < rt_toolp_n_calls(p); k++) {
            json_t *f = json_object_get(json_array_get(calls, k), "function");
            const char *name = json_string_value(json_object_get(f, "name"));
            const char *args = json_string_value(json_object_get(f, "arguments"));
            const char *id = json_string_value(json_object_get(json_array_get(calls, k), "id"));
            TH_CHECKF(name && !strcmp(name, w->name[k]), "%s (split %zu): call %d name %s", label,
                      splits[s], k, name ? name : "(null)");
            TH_CHECKF(args && !strcmp(args, w->args[k]),
                      "%s (split %zu): call %d args '%s', want '%s'", label, splits[s], k,
                      args ? args : "(null)", w->args[k]);
            TH_CHECKF(id && !strncmp(id, "call_", 5) && strlen(id) == 29, "%s: id %s", label,
                      id ? id : "(null)");
            /* the stream assembles to the same call */
            TH_CHECKF(k < a.n_calls && !strcmp(a.id[k], id ? id : "") &&
                          !strcmp(a.name[k], w->name[k]) && a.args[k].len == strlen(w->args[k]) &&
                          !memcmp(a.args[k].buf, w->args[k], a.args[k].len),
                      "%s (split %zu): streamed call %d differs", label, splits[s], k);
        }
        json_decref(calls);
        TH_CHECKF(a.n_calls == w->n_calls && a.order_ok, "%s (split %zu): streamed %d calls", label,
                  splits[s], a.n_calls);
        TH_CHECKF(a.has_content == (c != NULL) && a.content.len == clen &&
                      (!clen || !memcmp(a.content.buf, c, clen)),
                  "%s (split %zu): streamed content differs", label, splits[s]);
        if (!w->content || !strstr(w->content, "<tool_call>"))
            TH_CHECKF(!a.tag_leaked, "%s: a <tool_call> tag reached content", label);
        rt_buf_free(&a.content);
        for (int k = 0; k < MAXC; k++)
            rt_buf_free(&a.args[k]);
        rt_toolp_destroy(p);
    }
}

#define CALL(name, args)                                                                           \
    "<tool_call>\n{\"name\": \"" name "\", \"arguments\": " args "}\n</tool_call>"

static void test_complete(void)
{
    run_case("plain text", "Hello, world!", true, &(want_t){.content = "Hello, world!"});
    run_case("one call", CALL("get_weather", "{\"city\": \"Paris\"}"), true,
             &(want_t){NULL, 1, {"get_weather"}, {"{\"city\": \"Paris\"}"}});
    run_case("one call, no newlines",
             "<tool_call>{\"name\":\"f\",\"arguments\":{\"a\":[1,{\"b\":null}]}}</tool_call>", true,
             &(want_t){NULL, 1, {"f"}, {"{\"a\":[1,{\"b\":null}]}"}});
    run_case("escaped name", CALL("f\\u00e9", "{}"), true,
             &(want_t){NULL, 1, {"f\xc3\xa9"}, {"{}"}});
    run_case("brackets and tags inside strings",
             CALL("f", "{\"q\": \"}]</tool_call>{\\\"\", \"r\": \"\\\\\"}"), true,
             &(want_t){NULL, 1, {"f"}, {"{\"q\": \"}]</tool_call>{\\\"\", \"r\": \"\\\\\"}"}});
}

static void test_several(void)
{
    run_case("text then two calls",
             "I'll check both.\n" CALL("get_weather", "{\"city\": \"Paris\"}") "\n" CALL(
                 "get_weather", "{\"city\": \"Tokyo\"}") "\n",
             true,
             &(want_t){"I'll check both.\n",
                       2,
                       {"get_weather", "get_weather"},
                       {"{\"city\": \"Paris\"}", "{\"city\": \"Tokyo\"}"}});
    run_case("parallel_tool_calls false keeps the first",
             CALL("a", "{\"x\": 1}") "\n" CALL("b", "{\"y\": 2}"), false,
             &(want_t){NULL, 1, {"a"}, {"{\"x\": 1}"}});
    run_case("text after a call", CALL("a", "{}") "\nAnd then?", true,
             &(want_t){"\nAnd then?", 1, {"a"}, {"{}"}});
    run_case("other key order",
             "<tool_call>\n{\"arguments\": {\"x\": 1.5}, \"name\": \"f\"}\n</tool_call>", true,
             &(want_t){NULL, 1, {"f"}, {"{\"x\": 1.5}"}});
}

static void test_partial(void)
{
    run_case("truncated arguments", "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"b",
             true, &(want_t){NULL, 1, {"f"}, {"{\"a\": \"b"}});
    run_case("unterminated but whole JSON", "<tool_call>\n{\"arguments\": {}, \"name\": \"g\"}",
             true, &(want_t){NULL, 1, {"g"}, {"{}"}});
    run_case("a partial tag that is not one", "a <tool b <tool_cal", true,
             &(want_t){.content = "a <tool b <tool_cal"});
    run_case("whitespace only, no call", "\n", true, &(want_t){.content = "\n"});
    run_case("header cut short", "<tool_call>\n{\"name\": \"f", true,
             &(want_t){.content = "<tool_call>\n{\"name\": \"f"});
}

static void test_malformed(void)
{
    run_case("invalid JSON stays content", "<tool_call>\n{\"name\": get_weather}\n</tool_call>",
             true, &(want_t){.content = "<tool_call>\n{\"name\": get_weather}\n</tool_call>"});
    run_case("no arguments stays content", "<tool_call>{\"name\": \"f\"}</tool_call> ok", true,
             &(want_t){.content = "<tool_call>{\"name\": \"f\"}</tool_call> ok"});
    run_case("malformed then valid", "<tool_call>oops</tool_call>\n" CALL("f", "{\"k\": true}"),
             true, &(want_t){"<tool_call>oops</tool_call>", 1, {"f"}, {"{\"k\": true}"}});
    run_case("text where the tail should be",
             "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\nnot a tag", true,
             &(want_t){"not a tag", 1, {"f"}, {"{\"a\": 1}"}});
    run_case("false end tag", "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_x> y", true,
             &(want_t){"</tool_x> y", 1, {"f"}, {"{}"}});
}

static void test_bare(void)
{
    run_case("bare call", "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}", true,
             &(want_t){NULL, 1, {"get_weather"}, {"{\"city\": \"Paris\"}"}});
    run_case("fenced call",
             "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\n    \"city\": "
             "\"Paris\"\n  }\n}\n```\n",
             true, &(want_t){NULL, 1, {"get_weather"}, {"{\n    \"city\": \"Paris\"\n  }"}});
    run_case("two bare calls then text",
             "{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n{\"name\": \"g\", \"arguments\": {}}\n"
             "{\"temperature\": 18}",
             true, &(want_t){"\n{\"temperature\": 18}", 2, {"f", "g"}, {"{\"x\": 1}", "{}"}});
    run_case("undeclared name is text", "{\"name\": \"other\", \"arguments\": {}}", true,
             &(want_t){.content = "{\"name\": \"other\", \"arguments\": {}}"});
    run_case("JSON that is no call", " {\"city\": \"Paris\"}", true,
             &(want_t){.content = " {\"city\": \"Paris\"}"});
    run_case("a code fence that is no call", "```python\nprint(1)\n```", true,
             &(want_t){.content = "```python\nprint(1)\n```"});
    run_case("bare call later in the text is text", "Sure: {\"name\": \"f\", \"arguments\": {}}",
             true, &(want_t){.content = "Sure: {\"name\": \"f\", \"arguments\": {}}"});
    n_names = 0; /* tagged calls only */
    run_case("no declared tools: bare JSON is text", "{\"name\": \"f\", \"arguments\": {}}", true,
             &(want_t){.content = "{\"name\": \"f\", \"arguments\": {}}"});
    run_case("no declared tools: tagged call", CALL("zz", "{}"), true,
             &(want_t){NULL, 1, {"zz"}, {"{}"}});
    n_names = sizeof names / sizeof names[0];
}

/* Random texts from the format's pieces, fed in random splits: the stream always
 * assembles to the parser's own answer (and nothing crashes: run it under ASan). */
static void test_random(void)
{
    static const char *const bits[] = {"<tool_call>",
                                       "</tool_call>",
                                       "<tool_",
                                       "{",
                                       "}",
                                       "[",
                                       "]",
                                       "\"name\"",
                                       ": ",
                                       ", ",
                                       "\"arguments\"",
                                       "\"f\"",
                                       "\"get_weather\"",
                                       "\"x\\\"\"",
                                       "\n",
                                       " ",
                                       "```json\n",
                                       "```",
                                       "text",
                                       "1.5",
                                       "<",
                                       "\\"};
    uint64_t r = 42;
    for (int it = 0; it < 3000; it++) {
        char text[512];
        size_t n = 0;
        int k = 1 + (int)((r = r * 6364136223846793005ull + 1442695040888963407ull) >> 60);
        for (int j = 0; j < k * 3; j++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            const char *b = bits[(r >> 33) % (sizeof bits / sizeof bits[0])];
            size_t l = strlen(b);
            if (n + l >= sizeof text) break;
            memcpy(text + n, b, l);
            n += l;
        }
        text[n] = 0;
        rt_toolp *p = rt_toolp_create("seed", (r >> 20) & 1, names, (r >> 21) & 1 ? n_names : 0);
        TH_REQUIRE(p != NULL);
        asm_t a = {.order_ok = true};
        for (size_t i = 0; i < n;) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            size_t step = 1 + (r >> 40) % 9;
            if (step > n - i) step = n - i;
            TH_CHECK(rt_toolp_feed(p, text + i, step, on_ev, &a) == 0);
            i += step;
        }
        TH_CHECK(rt_toolp_finish(p, on_ev, &a) == 0);
        size_t clen = 0;
        const char *c = rt_toolp_content(p, &clen);
        json_t *calls = rt_toolp_calls_json(p);
        bool same = a.has_content == (c != NULL) && a.content.len == clen &&
                    (!clen || !memcmp(a.content.buf, c, clen)) && a.order_ok &&
                    a.n_calls == (rt_toolp_n_calls(p) < MAXC ? rt_toolp_n_calls(p) : MAXC);
        for (int q = 0; same && q < a.n_calls; q++) {
            json_t *f = json_object_get(json_array_get(calls, q), "function");
            const char *args = json_string_value(json_object_get(f, "arguments"));
            same = args && strlen(args) == a.args[q].len &&
                   !memcmp(args, a.args[q].buf, a.args[q].len);
        }
        TH_CHECKF(same, "random %d: the stream differs from the answer for '%s'", it, text);
        json_decref(calls);
        rt_buf_free(&a.content);
        for (int q = 0; q < MAXC; q++)
            rt_buf_free(&a.args[q]);
        rt_toolp_destroy(p);
    }
}

int main(void)
{
    TH_RUN(test_complete);
    TH_RUN(test_several);
    TH_RUN(test_partial);
    TH_RUN(test_malformed);
    TH_RUN(test_bare);
    TH_RUN(test_random);
    TH_EXIT();
}
