/* test_rt_toolfmt.c: the other families' tool-call formats (router/rt_toolfmt.c through the
 * push parser of router/rt_tools.c): llama3_json, mistral, deepseek_v3, deepseek_v31,
 * qwen3_coder, glm45, kimi_k2, pythonic, with the call strings their templates teach and
 * vLLM's parser tests' cases; text around the calls, malformed blocks left as content,
 * parallel_tool_calls false, the call ids. Every case is fed whole and in pieces of 1, 2,
 * 3, 5 and 11 bytes; the streamed events must assemble to the non-streamed answer, and
 * that to the expected one. Then format detection from template texts, and with
 * --templates DIR (the corpus' templates directory) the corpus' families.
 *
 *   test_rt_toolfmt [--templates DIR]
 */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rt_buf.h"
#include "rt_toolfmt.h"
#include "rt_tools.h"
#include "tharness.h"

/* the expected answers are written positionally, trailing fields (ids) left out */
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

#define MAXC 8

typedef struct {
    rt_buf content;
    bool has_content;
    int n_calls;
    char id[MAXC][64], name[MAXC][64];
    rt_buf args[MAXC];
    bool order_ok;
    bool shape_ok;        /* each event's delta has the shape vLLM streams */
    size_t fed;           /* the input bytes fed so far */
    size_t call_at[MAXC]; /* fed when the call was announced */
    size_t args_at[MAXC]; /* fed when its first arguments piece came */
    int pieces[MAXC];     /* its arguments pieces */
} asm_t;

/* The delta of an event: {"content"} or {"tool_calls": [{index, id, type, function: {name,
 * arguments: ""}}]} for a call's first, [{index, function: {arguments}}] for the next. */
static bool delta_ok(const rt_tool_ev *e)
{
    json_t *d = rt_tool_ev_delta(e);
    json_t *tc = json_array_get(json_object_get(d, "tool_calls"), 0);
    json_t *fn = json_object_get(tc, "function");
    bool ok;
    if (e->kind == RT_TOOL_EV_CONTENT)
        ok = json_object_size(d) == 1 && json_is_string(json_object_get(d, "content"));
    else if (e->kind == RT_TOOL_EV_CALL)
        ok = json_object_size(tc) == 4 && json_is_string(json_object_get(tc, "id")) &&
             json_string_length(json_object_get(tc, "id")) > 0 &&
             !strcmp(json_string_value(json_object_get(tc, "type")), "function") &&
             json_is_string(json_object_get(fn, "name")) &&
             !strcmp(json_string_value(json_object_get(fn, "arguments")), "");
    else
        ok = json_object_size(tc) == 2 && json_object_size(fn) == 1 &&
             json_integer_value(json_object_get(tc, "index")) == e->index &&
             json_string_length(json_object_get(fn, "arguments")) == e->len && e->len > 0;
    json_decref(d);
    return ok;
}

static int on_ev(void *ctx, const rt_tool_ev *e)
{
    asm_t *a = ctx;
    if (!delta_ok(e)) a->shape_ok = false;
    if (e->kind == RT_TOOL_EV_CONTENT) {
        rt_buf_append(&a->content, e->text, e->len);
        a->has_content = true;
    } else if (e->kind == RT_TOOL_EV_CALL) {
        if (e->index != a->n_calls || a->n_calls == MAXC) a->order_ok = false;
        if (a->n_calls == MAXC) return 0;
        snprintf(a->id[a->n_calls], sizeof a->id[0], "%s", e->id);
        snprintf(a->name[a->n_calls], sizeof a->name[0], "%s", e->name);
        a->call_at[a->n_calls] = a->fed;
        a->n_calls++;
    } else {
        if (e->index != a->n_calls - 1) a->order_ok = false;
        if (e->index < 0 || e->index >= MAXC) return 0;
        if (!a->pieces[e->index]++) a->args_at[e->index] = a->fed;
        rt_buf_append(&a->args[e->index], e->text, e->len);
    }
    return 0;
}

typedef struct {
    const char *content; /* NULL: none */
    int n_calls;
    const char *name[4], *args[4];
    const char *id[4]; /* NULL: the parser's own (call_..., or 9 alphanumerics for mistral) */
} want_t;

static bool id_ok(rt_toolfmt f, const char *id, const char *want)
{
    if (want) return !strcmp(id, want);
    if (f != RT_TOOLFMT_MISTRAL) return !strncmp(id, "call_", 5) && strlen(id) == 29;
    for (const char *c = id; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9')))
            return false;
    return strlen(id) == 9;
}

#define RANDOM_SPLIT 1000 /* a split from here on: pieces of 1 to 8 bytes, seeded by it */

/* One split of one case. */
static void run_split(const char *label, rt_toolfmt f, json_t *tools, const char *text,
                      bool parallel, const want_t *w, size_t split)
{
    size_t n = strlen(text), step = split ? split : n + 1;
    uint64_t r = split;
    rt_toolp *p = rt_toolp_create_fmt(f, tools, "chatcmpl-test", parallel, NULL, 0);
    TH_REQUIRE(p != NULL);
    asm_t a = {.order_ok = true, .shape_ok = true};
    for (size_t i = 0; i < n; i += step) {
        if (split >= RANDOM_SPLIT) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            step = 1 + (r >> 33) % 8;
        }
        size_t k = n - i < step ? n - i : step;
        a.fed = i + k;
        TH_CHECK(rt_toolp_feed(p, text + i, k, on_ev, &a) == 0);
    }
    TH_CHECK(rt_toolp_finish(p, on_ev, &a) == 0);
    size_t clen = 0;
    const char *c = rt_toolp_content(p, &clen);
    bool ok = (c == NULL) == (w->content == NULL) &&
              (!c || (clen == strlen(w->content) && !memcmp(c, w->content, clen)));
    TH_CHECKF(ok, "%s (split %zu): content '%.*s', want '%s'", label, split, (int)clen,
              c ? c : "(null)", w->content ? w->content : "(null)");
    TH_CHECKF(rt_toolp_n_calls(p) == w->n_calls, "%s (split %zu): %d calls, want %d", label, split,
              rt_toolp_n_calls(p), w->n_calls);
    json_t *calls = rt_toolp_calls_json(p);
    for (int k = 0; k < w->n_calls && k < rt_toolp_n_calls(p); k++) {
        json_t *fn = json_object_get(json_array_get(calls, k), "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        const char *args = json_string_value(json_object_get(fn, "arguments"));
        const char *id = json_string_value(json_object_get(json_array_get(calls, k), "id"));
        TH_CHECKF(name && !strcmp(name, w->name[k]), "%s (split %zu): call %d name %s", label,
                  split, k, name ? name : "(null)");
        TH_CHECKF(args && !strcmp(args, w->args[k]), "%s (split %zu): call %d args '%s', want '%s'",
                  label, split, k, args ? args : "(null)", w->args[k]);
        TH_CHECKF(id && id_ok(f, id, w->id[k]), "%s: id %s", label, id ? id : "(null)");
        TH_CHECKF(k < a.n_calls && !strcmp(a.id[k], id ? id : "") &&
                      !strcmp(a.name[k], w->name[k]) && a.args[k].len == strlen(w->args[k]) &&
                      !memcmp(a.args[k].buf, w->args[k], a.args[k].len),
                  "%s (split %zu): streamed call %d differs", label, split, k);
    }
    json_decref(calls);
    TH_CHECKF(a.n_calls == w->n_calls && a.order_ok, "%s (split %zu): streamed %d calls", label,
              split, a.n_calls);
    TH_CHECKF(a.shape_ok, "%s (split %zu): a delta of the wrong shape", label, split);
    TH_CHECKF(a.has_content == (c != NULL) && a.content.len == clen &&
                  (!clen || !memcmp(a.content.buf, c, clen)),
              "%s (split %zu): streamed content differs", label, split);
    rt_buf_free(&a.content);
    for (int k = 0; k < MAXC; k++)
        rt_buf_free(&a.args[k]);
    rt_toolp_destroy(p);
}

static void run_tools(const char *label, rt_toolfmt f, const char *tools_json, const char *text,
                      bool parallel, const want_t *w)
{
    static const size_t splits[] = {0,
                                    1,
                                    2,
                                    3,
                                    5,
                                    11,
                                    RANDOM_SPLIT,
                                    RANDOM_SPLIT + 1,
                                    RANDOM_SPLIT + 2,
                                    RANDOM_SPLIT + 3,
                                    RANDOM_SPLIT + 4};
    json_t *tools = tools_json ? json_loads(tools_json, 0, NULL) : NULL;
    TH_REQUIRE(!tools_json || tools);
    for (size_t s = 0; s < sizeof splits / sizeof splits[0]; s++)
        run_split(label, f, tools, text, parallel, w, splits[s]);
    json_decref(tools);
}

static void run(const char *label, rt_toolfmt f, const char *text, const want_t *w)
{
    run_tools(label, f, NULL, text, true, w);
}

/* ---- llama3_json (Llama 3.1 / 3.2 / 3.3: {"name": f, "parameters": {...}}) ---- */

static void test_llama3(void)
{
    const rt_toolfmt F = RT_TOOLFMT_LLAMA3_JSON;
    run("llama3 plain", F, "The weather is sunny.", &(want_t){"The weather is sunny."});
    run("llama3 template form", F,
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}",
        &(want_t){NULL, 1, {"get_weather"}, {"{\"city\": \"Paris\", \"unit\": \"celsius\"}"}});
    run("llama3 python_tag, compact", F,
        "<|python_tag|>{\"name\":\"f\",\"parameters\":{\"a\":1,\"b\":[true,null]}}",
        &(want_t){NULL, 1, {"f"}, {"{\"a\": 1, \"b\": [true, null]}"}});
    run("llama3 text then python_tag", F,
        "Let me look.<|python_tag|>{\"name\": \"f\", \"arguments\": {}}",
        &(want_t){"Let me look.", 1, {"f"}, {"{}"}});
    run("llama3 two calls with ;", F,
        "{\"name\": \"f\", \"arguments\": {\"x\": \"\\u00e9\"}}; {\"name\": \"g\", \"parameters\": "
        "{\"y\": 2.5}}",
        &(want_t){NULL, 2, {"f", "g"}, {"{\"x\": \"\xc3\xa9\"}", "{\"y\": 2.5}"}});
    run("llama3 leading whitespace", F, "\n\n {\"name\": \"f\", \"parameters\": {\"k\": \"v\"}}\n",
        &(want_t){NULL, 1, {"f"}, {"{\"k\": \"v\"}"}});
    run("llama3 JSON that is no call", F, "{\"answer\": 42}", &(want_t){"{\"answer\": 42}"});
    /* a call announced stands (vLLM never takes a delta back), with the arguments sent */
    run("llama3 truncated", F,
        "{\"name\": \"f\", \"parameters\": {\"a\": ", &(want_t){NULL, 1, {"f"}, {"{\"a\": "}});
    run("llama3 text after the call", F, "{\"name\": \"f\", \"parameters\": {}} and more",
        &(want_t){" and more", 1, {"f"}, {"{}"}});
    run("llama3 header cut short", F, "{\"name\": \"f\", \"param",
        &(want_t){"{\"name\": \"f\", \"param"});
    run("llama3 brace later is text", F, "Use {x} here", &(want_t){"Use {x} here"});
    run_tools("llama3 parallel false", F, NULL,
              "{\"name\": \"f\", \"parameters\": {}}; {\"name\": \"g\", \"parameters\": {}}", false,
              &(want_t){NULL, 1, {"f"}, {"{}"}});
}

/* ---- mistral ---- */

static void test_mistral(void)
{
    const rt_toolfmt F = RT_TOOLFMT_MISTRAL;
    run("mistral nemo list", F,
        "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": "
        "\"abc123def\"}]",
        &(want_t){NULL, 1, {"get_weather"}, {"{\"city\": \"Paris\"}"}});
    run("mistral nemo two", F,
        "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"name\": \"g\", "
        "\"arguments\": {}}]",
        &(want_t){NULL, 2, {"f", "g"}, {"{\"a\": 1}", "{}"}});
    run("mistral v11 name{args}", F, "[TOOL_CALLS]add{\"a\": 3.5, \"b\": 4}",
        &(want_t){NULL, 1, {"add"}, {"{\"a\": 3.5, \"b\": 4}"}});
    run("devstral [ARGS]", F, "[TOOL_CALLS]get_weather[ARGS]{\"city\":\"Paris\"}",
        &(want_t){NULL, 1, {"get_weather"}, {"{\"city\": \"Paris\"}"}});
    run("small 3.2 [CALL_ID]", F,
        "[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{\"city\": \"Paris\"}"
        "[TOOL_CALLS]f[CALL_ID]zzzzzzzzz[ARGS]{}",
        &(want_t){NULL, 2, {"get_weather", "f"}, {"{\"city\": \"Paris\"}", "{}"}});
    run("mistral text before", F, "Let me check.[TOOL_CALLS]f[ARGS]{\"q\": \"[TOOL\"}",
        &(want_t){"Let me check.", 1, {"f"}, {"{\"q\": \"[TOOL\"}"}});
    run("mistral truncated", F,
        "Hi [TOOL_CALLS]f[ARGS]{\"a\": ", &(want_t){"Hi ", 1, {"f"}, {"{\"a\": "}});
    run("mistral malformed", F, "Hi [TOOL_CALLS]f[ARGS]x", &(want_t){"Hi [TOOL_CALLS]f[ARGS]x"});
    run("mistral partial marker is text", F, "see [TOOL_", &(want_t){"see [TOOL_"});
    run("mistral plain", F, "[1, 2] is a list", &(want_t){"[1, 2] is a list"});
}

/* ---- deepseek_v3 (R1 and its distills) and deepseek_v31 ---- */

#define DS_CALLS_B                                                                                 \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "calls\xe2\x96\x81"                                                                            \
    "begin\xef\xbd\x9c>"
#define DS_CALLS_E                                                                                 \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "calls\xe2\x96\x81"                                                                            \
    "end\xef\xbd\x9c>"
#define DS_CALL_B                                                                                  \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "call\xe2\x96\x81"                                                                             \
    "begin\xef\xbd\x9c>"
#define DS_CALL_E                                                                                  \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "call\xe2\x96\x81"                                                                             \
    "end\xef\xbd\x9c>"
#define DS_SEP                                                                                     \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "sep\xef\xbd\x9c>"
#define DS3(name, args)  DS_CALL_B "function" DS_SEP name "\n```json\n" args "\n```" DS_CALL_E
#define DS31(name, args) DS_CALL_B name DS_SEP args DS_CALL_E

static void test_deepseek(void)
{
    const rt_toolfmt V3 = RT_TOOLFMT_DEEPSEEK_V3, V31 = RT_TOOLFMT_DEEPSEEK_V31;
    run("deepseek v3 one", V3, DS_CALLS_B DS3("get_weather", "{\"city\": \"Paris\"}") DS_CALLS_E,
        &(want_t){NULL, 1, {"get_weather"}, {"{\"city\": \"Paris\"}"}});
    run("deepseek v3 two, text before", V3,
        "Checking.\n\n" DS_CALLS_B DS3("f", "{\"a\":1}") "\n" DS3("g", "{}") DS_CALLS_E,
        &(want_t){"Checking.\n\n", 2, {"f", "g"}, {"{\"a\":1}", "{}"}});
    run("deepseek v3 unterminated section", V3, DS_CALLS_B DS3("f", "{}"),
        &(want_t){NULL, 1, {"f"}, {"{}"}});
    run("deepseek v3 malformed", V3, DS_CALLS_B DS_CALL_B "f{}" DS_CALL_E DS_CALLS_E,
        &(want_t){DS_CALLS_B DS_CALL_B "f{}" DS_CALL_E DS_CALLS_E});
    run("deepseek v31 one", V31, DS_CALLS_B DS31("get_weather", "{\"city\":\"Paris\"}") DS_CALLS_E,
        &(want_t){NULL, 1, {"get_weather"}, {"{\"city\":\"Paris\"}"}});
    run("deepseek v31 two, text after", V31,
        "Sure." DS_CALLS_B DS31("f", "{\"a\": \"x\"}") DS31("g", "{}") DS_CALLS_E " Done.",
        &(want_t){"Sure. Done.", 2, {"f", "g"}, {"{\"a\": \"x\"}", "{}"}});
    run("deepseek v31 plain", V31, "No tools needed.", &(want_t){"No tools needed."});
}

/* ---- qwen3_coder ---- */

static const char QWEN_TOOLS[] =
    "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": "
    "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \"days\": "
    "{\"type\": \"integer\"}, \"temp\": {\"type\": \"number\"}, \"metric\": {\"type\": "
    "\"boolean\"}, \"opts\": {\"type\": \"object\"}, \"tags\": {\"type\": \"array\"}}}}}]";

static void test_qwen3_coder(void)
{
    const rt_toolfmt F = RT_TOOLFMT_QWEN3_CODER;
    run_tools("qwen3 coder typed", F, QWEN_TOOLS,
              "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n<parameter=temp>\n21.5\n</parameter>\n"
              "<parameter=metric>\nTrue\n</parameter>\n</function>\n</tool_call>",
              true,
              &(want_t){NULL,
                        1,
                        {"get_weather"},
                        {"{\"city\": \"Paris\", \"days\": 3, \"temp\": 21.5, \"metric\": true}"}});
    run_tools("qwen3 coder objects, null, unknown", F, QWEN_TOOLS,
              "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n"
              "</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=tags>\n"
              "['x', 'y']\n</parameter>\n<parameter=temp>\n4.0\n</parameter>\n<parameter=x>\n5\n"
              "</parameter>\n<parameter=days>\nnull\n</parameter>\n</function>\n</tool_call>",
              true,
              &(want_t){"I'll check.\n",
                        1,
                        {"get_weather"},
                        {"{\"city\": \"123\", \"opts\": {\"a\": [1, 2]}, \"tags\": [\"x\", \"y\"], "
                         "\"temp\": 4, \"x\": \"5\", \"days\": null}"}});
    run("qwen3 coder two calls, multi-line value", F,
        "<tool_call>\n<function=write>\n<parameter=text>\nline 1\nline 2\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
        &(want_t){NULL, 2, {"write", "f"}, {"{\"text\": \"line 1\\nline 2\"}", "{}"}});
    run("qwen3 coder no <function=", F, "<tool_call>\nnothing\n</tool_call>",
        &(want_t){"<tool_call>\nnothing\n</tool_call>"});
    run("qwen3 coder unterminated", F, "<tool_call>\n<function=f>\n<parameter=a>\nx",
        &(want_t){NULL, 1, {"f"}, {"{\"a\": \"x\"}"}});
    run("qwen3 coder bare function", F, "<function=f>\n<parameter=a>\n1\n</parameter>\n</function>",
        &(want_t){NULL, 1, {"f"}, {"{\"a\": \"1\"}"}});
}

/* ---- glm45 ---- */

static void test_glm45(void)
{
    const rt_toolfmt F = RT_TOOLFMT_GLM45;
    run_tools("glm typed", F, QWEN_TOOLS,
              "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts</arg_key>\n"
              "<arg_value>{\"a\": true}</arg_value>\n</tool_call>",
              true,
              &(want_t){NULL,
                        1,
                        {"get_weather"},
                        {"{\"city\": \"123\", \"days\": 3, \"opts\": {\"a\": true}}"}});
    run("glm untyped, literal, text", F,
        "Let me see.<tool_call>f\n<arg_key>a</arg_key><arg_value>['x', 1]</arg_value>"
        "<arg_key>b</arg_key>\n<arg_value>hello world</arg_value></tool_call>",
        &(want_t){"Let me see.", 1, {"f"}, {"{\"a\": [\"x\", 1], \"b\": \"hello world\"}"}});
    run("glm two, no args", F, "<tool_call>f\n</tool_call>\n<tool_call>g</tool_call>",
        &(want_t){NULL, 2, {"f", "g"}, {"{}", "{}"}});
    run("glm empty call is content", F, "<tool_call></tool_call>",
        &(want_t){"<tool_call></tool_call>"});
}

/* ---- kimi_k2 ---- */

#define KB "<|tool_calls_section_begin|>"
#define KE "<|tool_calls_section_end|>"
#define KC(id, args)                                                                               \
    "<|tool_call_begin|>" id "<|tool_call_argument_begin|>" args "<|tool_call_end|>"

static void test_kimi(void)
{
    const rt_toolfmt F = RT_TOOLFMT_KIMI_K2;
    run("kimi one", F, KB KC("functions.get_weather:0", "{\"city\": \"Beijing\"}") KE,
        &(want_t){
            NULL, 1, {"get_weather"}, {"{\"city\": \"Beijing\"}"}, {"functions.get_weather:0"}});
    run("kimi two, text, spaces", F,
        "I'll look.\n" KB " " KC(" functions.f:0 ", " {\"a\": 1} ") "\n" KC("g:1", "{}") KE,
        &(want_t){"I'll look.\n", 2, {"f", "g"}, {"{\"a\": 1}", "{}"}, {"functions.f:0", "g:1"}});
    run("kimi bad id", F, KB KC("functions.f", "{}") KE, &(want_t){KB KC("functions.f", "{}") KE});
}

/* ---- pythonic (vLLM's pythonic parser tests) ---- */

static void test_pythonic(void)
{
    const rt_toolfmt F = RT_TOOLFMT_PYTHONIC;
    run("pythonic simple", F, "[get_weather(city='San Francisco', metric='celsius')]",
        &(want_t){
            NULL, 1, {"get_weather"}, {"{\"city\": \"San Francisco\", \"metric\": \"celsius\"}"}});
    run("pythonic more types", F,
        "[register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': "
        "'CA'}, role=None, passed_test=True, aliases=['John', 'Johnny'])]",
        &(want_t){NULL,
                  1,
                  {"register_user"},
                  {"{\"name\": \"John Doe\", \"age\": 37, \"address\": {\"city\": \"San "
                   "Francisco\", \"state\": \"CA\"}, \"role\": null, \"passed_test\": true, "
                   "\"aliases\": [\"John\", \"Johnny\"]}"}});
    run("pythonic parallel, escapes, numbers", F,
        "[get_weather(city='Martha\\'s Vineyard', metric=\"\\\"cool units\\\"\"), "
        "f(x=1.5, y=-2, z=1e3, e=[]), g()]",
        &(want_t){NULL,
                  3,
                  {"get_weather", "f", "g"},
                  {"{\"city\": \"Martha's Vineyard\", \"metric\": \"\\\"cool units\\\"\"}",
                   "{\"x\": 1.5, \"y\": -2, \"z\": 1000.0, \"e\": []}", "{}"}});
    run("pythonic text", F, "Hello [world]", &(want_t){"Hello [world]"});
    run("pythonic a list of numbers", F, "[1, 2]", &(want_t){"[1, 2]"});
    /* a call announced stands (vLLM's streaming), so the answer keeps it: text after the
     * list is content; a call cut short keeps the parameters complete when it ended */
    run("pythonic text after", F, "[f()] done", &(want_t){" done", 1, {"f"}, {"{}"}});
    run("pythonic truncated", F, "[f(a=1, b='x", &(want_t){NULL, 1, {"f"}, {"{\"a\": 1"}});
    run("pythonic not a literal", F, "[f(a=g(1))]", &(want_t){NULL, 1, {"f"}, {"{"}});
}

/* ---- streaming: each call's name as soon as it is complete, its arguments in pieces ---- */

typedef struct {
    const char *label;
    rt_toolfmt f;
    const char *pieces[32]; /* the output at its tokens' boundaries */
    const char *name_by;    /* the first call is announced once this text is fed */
    const char *args_by;    /* and its first arguments piece has come once this one is */
    want_t w;
} stream_case;

/* The end of the piece that completes the first part in text: when an event can come. */
static size_t end_of(const char *const *pieces, const char *text, const char *part)
{
    const char *at = strstr(text, part);
    size_t want = at ? (size_t)(at - text) + strlen(part) : strlen(text), end = 0;
    for (int i = 0; pieces[i] && end < want; i++)
        end += strlen(pieces[i]);
    return end;
}

static void run_stream(const stream_case *c)
{
    char text[2048] = "";
    for (int i = 0; c->pieces[i]; i++)
        strncat(text, c->pieces[i], sizeof text - strlen(text) - 1);
    json_t *tools = json_loads(QWEN_TOOLS, 0, NULL);
    rt_toolp *p = rt_toolp_create_fmt(c->f, tools, "chatcmpl-test", true, NULL, 0);
    TH_REQUIRE(p != NULL);
    asm_t a = {.order_ok = true, .shape_ok = true};
    for (int i = 0; c->pieces[i]; i++) {
        a.fed += strlen(c->pieces[i]);
        TH_CHECK(rt_toolp_feed(p, c->pieces[i], strlen(c->pieces[i]), on_ev, &a) == 0);
    }
    TH_CHECK(rt_toolp_finish(p, on_ev, &a) == 0);
    TH_CHECKF(a.n_calls == c->w.n_calls && a.order_ok && a.shape_ok, "%s: %d calls streamed",
              c->label, a.n_calls);
    for (int k = 0; k < c->w.n_calls && k < a.n_calls; k++)
        TH_CHECKF(!strcmp(a.name[k], c->w.name[k]) && a.args[k].len == strlen(c->w.args[k]) &&
                      !memcmp(a.args[k].buf, c->w.args[k], a.args[k].len),
                  "%s: call %d streamed as %s '%.*s'", c->label, k, a.name[k], (int)a.args[k].len,
                  a.args[k].buf);
    size_t want_c = c->w.content ? strlen(c->w.content) : 0;
    TH_CHECKF(a.content.len == want_c && (!want_c || !memcmp(a.content.buf, c->w.content, want_c)),
              "%s: content '%.*s'", c->label, (int)a.content.len, a.content.buf);
    TH_CHECKF(a.n_calls && a.call_at[0] <= end_of(c->pieces, text, c->name_by),
              "%s: name at byte %zu, not %zu", c->label, a.call_at[0],
              end_of(c->pieces, text, c->name_by));
    TH_CHECKF(a.n_calls && a.pieces[0] >= 2 && a.args_at[0] <= end_of(c->pieces, text, c->args_by),
              "%s: %d arguments pieces, the first at byte %zu", c->label, a.pieces[0],
              a.args_at[0]);
    rt_buf_free(&a.content);
    for (int k = 0; k < MAXC; k++)
        rt_buf_free(&a.args[k]);
    rt_toolp_destroy(p);
    json_decref(tools);
}

static void test_streaming(void)
{
    static const stream_case cases[] = {
        {"stream deepseek_v31",
         RT_TOOLFMT_DEEPSEEK_V31,
         {"Sure.", DS_CALLS_B, DS_CALL_B, "get", "_weather", DS_SEP, "{\"", "city", "\":", " \"",
          "Paris", "\"}", DS_CALL_E, DS_CALL_B, "f", DS_SEP, "{}", DS_CALL_E, DS_CALLS_E},
         DS_SEP,
         "city",
         {"Sure.", 2, {"get_weather", "f"}, {"{\"city\": \"Paris\"}", "{}"}}},
        {"stream deepseek_v3",
         RT_TOOLFMT_DEEPSEEK_V3,
         {DS_CALLS_B, DS_CALL_B, "function", DS_SEP, "get_weather", "\n", "```", "json", "\n",
          "{\"city\"", ": \"Paris\"}", "\n", "```", DS_CALL_E, DS_CALLS_E},
         "```json\n",
         ": \"Paris\"}",
         {NULL, 1, {"get_weather"}, {"{\"city\": \"Paris\"}"}}},
        {"stream kimi_k2",
         RT_TOOLFMT_KIMI_K2,
         {KB, "<|tool_call_begin|>", "functions", ".get", "_weather", ":", "0",
          "<|tool_call_argument_begin|>", "{\"", "city", "\": \"", "Beijing", "\"}",
          "<|tool_call_end|>", KE, " Done."},
         "<|tool_call_argument_begin|>",
         "city",
         {" Done.", 1, {"get_weather"}, {"{\"city\": \"Beijing\"}"}, {"functions.get_weather:0"}}},
        {"stream qwen3_coder",
         RT_TOOLFMT_QWEN3_CODER,
         {"<tool_call>",  "\n",          "<function=",  "get", "_weather",    ">",  "\n",
          "<parameter=",  "city",        ">",           "\n",  "Paris",       "\n", "</parameter>",
          "\n",           "<parameter=", "days",        ">",   "\n",          "3",  "\n",
          "</parameter>", "\n",          "</function>", "\n",  "</tool_call>"},
         "<function=get_weather>",
         "Paris\n</parameter>",
         {NULL, 1, {"get_weather"}, {"{\"city\": \"Paris\", \"days\": 3}"}}},
        {"stream glm45",
         RT_TOOLFMT_GLM45,
         {"<tool_call>", "get_weather", "\n", "<arg_key>", "city", "</arg_key>", "\n",
          "<arg_value>", "Paris", "</arg_value>", "\n", "<arg_key>", "days", "</arg_key>",
          "<arg_value>", "3", "</arg_value>", "\n", "</tool_call>"},
         "get_weather\n",
         "Paris</arg_value>",
         {NULL, 1, {"get_weather"}, {"{\"city\": \"Paris\", \"days\": 3}"}}},
        {"stream llama3_json",
         RT_TOOLFMT_LLAMA3_JSON,
         {"{\"", "name",       "\":", " \"",  "get_weather", "\",",
          " \"", "parameters", "\":", " {\"", "city",        "\":",
          " \"", "Paris",      "\",", " \"",  "days",        "\":",
          " 3",  "}}",         ";",   " {\"", "name",        "\": \"f\", \"parameters\": {}}"},
         "\"parameters\": {",
         "city",
         {NULL, 2, {"get_weather", "f"}, {"{\"city\": \"Paris\", \"days\": 3}", "{}"}}},
        {"stream mistral",
         RT_TOOLFMT_MISTRAL,
         {"Let me see.", "[TOOL_CALLS]", "get", "_weather", "[ARGS]", "{\"", "city", "\":", "\"",
          "Paris", "\"}", "[TOOL_CALLS]", "f", "[ARGS]", "{}"},
         "[ARGS]{",
         "city",
         {"Let me see.", 2, {"get_weather", "f"}, {"{\"city\": \"Paris\"}", "{}"}}},
        {"stream mistral list",
         RT_TOOLFMT_MISTRAL,
         {"[TOOL_CALLS]", "[{\"", "name", "\":", " \"", "f", "\",", " \"", "arguments",
          "\":", " {\"", "a", "\":", " 1", "}, \"id\": \"abc123def\"}", ",",
          " {\"name\": \"g\", \"arguments\": {}}", "]"},
         "\"arguments\": {",
         "\": 1",
         {NULL, 2, {"f", "g"}, {"{\"a\": 1}", "{}"}}},
        {"stream pythonic",
         RT_TOOLFMT_PYTHONIC,
         {"[", "get", "_weather", "(", "city", "=", "'", "Paris", "'", ",", " days", "=", "3", ")",
          ",", " f", "()", "]"},
         "(",
         "',",
         {NULL, 2, {"get_weather", "f"}, {"{\"city\": \"Paris\", \"days\": 3}", "{}"}}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_stream(&cases[i]);
}

/* Random outputs from each format's pieces, fed whole and in random splits: the answer never
 * depends on the split, and the stream always assembles to it (run it under ASan). */
static void answer(rt_toolfmt f, json_t *tools, const char *text, size_t n, uint64_t seed,
                   rt_buf *out)
{
    rt_toolp *p = rt_toolp_create_fmt(f, tools, "seed", true, NULL, 0);
    TH_REQUIRE(p != NULL);
    asm_t a = {.order_ok = true, .shape_ok = true};
    for (size_t i = 0, step = n + 1; i < n; i += step) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        if (seed & 1) step = 1 + (seed >> 33) % 6;
        while (i + step < n && ((unsigned char)text[i + step] & 0xc0) == 0x80)
            step++; /* the detokenizer hands out whole characters */
        TH_CHECK(rt_toolp_feed(p, text + i, n - i < step ? n - i : step, on_ev, &a) == 0);
    }
    TH_CHECK(rt_toolp_finish(p, on_ev, &a) == 0);
    size_t clen = 0;
    const char *c = rt_toolp_content(p, &clen);
    json_t *calls = rt_toolp_calls_json(p);
    bool same = a.order_ok && a.shape_ok && a.content.len == clen &&
                (!clen || !memcmp(c, a.content.buf, clen)) && a.n_calls == rt_toolp_n_calls(p);
    rt_buf_append(out, c ? c : "", clen);
    for (int k = 0; k < rt_toolp_n_calls(p) && k < MAXC; k++) {
        json_t *fn = json_object_get(json_array_get(calls, k), "function");
        const char *args = json_string_value(json_object_get(fn, "arguments"));
        same = same && strlen(args) == a.args[k].len && !memcmp(args, a.args[k].buf, a.args[k].len);
        rt_buf_puts(out, "|");
        rt_buf_puts(out, json_string_value(json_object_get(fn, "name")));
        rt_buf_puts(out, "|");
        rt_buf_puts(out, args);
    }
    TH_CHECKF(same, "random %s: the stream differs from the answer for '%.*s'", rt_toolfmt_name(f),
              (int)n, text);
    json_decref(calls);
    rt_buf_free(&a.content);
    for (int k = 0; k < MAXC; k++)
        rt_buf_free(&a.args[k]);
    rt_toolp_destroy(p);
}

static void test_random(void)
{
    static const char *const bits[] = {"[TOOL_CALLS]",
                                       "[ARGS]",
                                       "[CALL_ID]",
                                       "<|python_tag|>",
                                       DS_CALLS_B,
                                       DS_CALLS_E,
                                       DS_CALL_B,
                                       DS_CALL_E,
                                       DS_SEP,
                                       "\n```json\n",
                                       "\n```",
                                       KB,
                                       KE,
                                       "<|tool_call_begin|>",
                                       "<|tool_call_argument_begin|>",
                                       "<|tool_call_end|>",
                                       "functions.f:0",
                                       "<tool_call>",
                                       "</tool_call>",
                                       "<function=",
                                       "</function>",
                                       "<parameter=",
                                       "</parameter>",
                                       "<arg_key>",
                                       "</arg_key>",
                                       "<arg_value>",
                                       "</arg_value>",
                                       "{",
                                       "}",
                                       "[",
                                       "]",
                                       "\"name\": ",
                                       "\"arguments\": ",
                                       "\"parameters\": ",
                                       "\"f\"",
                                       "\"city\"",
                                       ", ",
                                       ": ",
                                       ";",
                                       "\n",
                                       " ",
                                       "get_weather",
                                       "days",
                                       ">",
                                       "3",
                                       "1.5",
                                       "\"\\u00e9\\\"\"",
                                       "text",
                                       "f(",
                                       ")",
                                       "x=1",
                                       "y='a,)'",
                                       "z=[1, {'k': None}]",
                                       "<"};
    json_t *tools = json_loads(QWEN_TOOLS, 0, NULL);
    uint64_t r = 7;
    for (int it = 0; it < 4000; it++) {
        char text[512];
        size_t n = 0;
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        rt_toolfmt f = (rt_toolfmt)(1 + (r >> 33) % (RT_TOOLFMT_N - 1));
        for (int j = 0, k = 3 + (int)((r >> 40) % 24); j < k; j++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            const char *b = bits[(r >> 33) % (sizeof bits / sizeof bits[0])];
            if (n + strlen(b) >= sizeof text) break;
            memcpy(text + n, b, strlen(b));
            n += strlen(b);
        }
        rt_buf whole = {0}, split = {0};
        answer(f, tools, text, n, 0, &whole);
        answer(f, tools, text, n, r | 1, &split);
        TH_CHECKF(whole.len == split.len && !memcmp(whole.buf, split.buf, whole.len),
                  "random %s: the answer depends on the split for '%.*s'", rt_toolfmt_name(f),
                  (int)n, text);
        rt_buf_free(&whole);
        rt_buf_free(&split);
    }
    json_decref(tools);
}

/* ---- detection ---- */

static void test_detect(void)
{
    static const struct {
        const char *text;
        rt_toolfmt want;
    } cases[] = {
        {"{{ '[TOOL_CALLS][' }}", RT_TOOLFMT_MISTRAL},
        {"{{'<\xef\xbd\x9ctool\xe2\x96\x81"
         "calls\xe2\x96\x81"
         "begin\xef\xbd\x9c>' + '```json'}}",
         RT_TOOLFMT_DEEPSEEK_V3},
        {"{{'<\xef\xbd\x9ctool\xe2\x96\x81"
         "calls\xe2\x96\x81"
         "begin\xef\xbd\x9c>'}}",
         RT_TOOLFMT_DEEPSEEK_V31},
        {"<|tool_calls_section_begin|>", RT_TOOLFMT_KIMI_K2},
        {"<tool_call>{{ name }}<arg_key>", RT_TOOLFMT_GLM45},
        {"<tool_call>\n<function=x>\n<parameter=y>", RT_TOOLFMT_QWEN3_CODER},
        {"<seed:tool_call>\n<function=x>\n<parameter=y>", RT_TOOLFMT_HERMES},
        {"<tool_call>\n{\"name\": <function-name>", RT_TOOLFMT_HERMES},
        {"'Respond in the format {\"name\": function name, \"parameters\": dictionary'",
         RT_TOOLFMT_LLAMA3_JSON},
        {"[func_name1(params_name1=params_value1)]", RT_TOOLFMT_PYTHONIC},
        {"{{ messages }}", RT_TOOLFMT_HERMES},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        TH_CHECKF(rt_toolfmt_detect(cases[i].text, strlen(cases[i].text)) == cases[i].want,
                  "detect case %zu", i);
    for (int f = 0; f < RT_TOOLFMT_N; f++) {
        rt_toolfmt g;
        TH_CHECK(rt_toolfmt_by_name(rt_toolfmt_name((rt_toolfmt)f), &g) && g == (rt_toolfmt)f);
    }
    rt_toolfmt g;
    TH_CHECK(!rt_toolfmt_by_name("auto", &g) && !rt_toolfmt_by_name("llama3", &g));
}

static const char *templates_dir;

static void test_corpus(void)
{
    static const struct {
        const char *file;
        rt_toolfmt want;
    } cases[] = {
        {"meta-llama-Llama-3.1-8B-Instruct", RT_TOOLFMT_LLAMA3_JSON},
        {"meta-llama-Llama-3.2-3B-Instruct", RT_TOOLFMT_LLAMA3_JSON},
        {"meta-llama-Llama-3.3-70B-Instruct", RT_TOOLFMT_LLAMA3_JSON},
        {"mistralai-Mistral-Nemo-Instruct-2407", RT_TOOLFMT_MISTRAL},
        {"Mistral-Small-3.2-24B-Instruct-2506", RT_TOOLFMT_MISTRAL},
        {"unsloth-mistral-Devstral-Small-2507", RT_TOOLFMT_MISTRAL},
        {"mistralai-Ministral-3-14B-Reasoning-2512", RT_TOOLFMT_MISTRAL},
        {"deepseek-ai-DeepSeek-V3.1", RT_TOOLFMT_DEEPSEEK_V31},
        {"deepseek-ai-DeepSeek-R1-Distill-Llama-8B", RT_TOOLFMT_DEEPSEEK_V3},
        {"deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", RT_TOOLFMT_DEEPSEEK_V3},
        {"Qwen3-Coder", RT_TOOLFMT_QWEN3_CODER},
        {"GLM-4.6", RT_TOOLFMT_GLM45},
        {"GLM-4.7-Flash", RT_TOOLFMT_GLM45},
        {"moonshotai-Kimi-K2", RT_TOOLFMT_KIMI_K2},
        {"Kimi-K2-Instruct", RT_TOOLFMT_KIMI_K2},
        {"Kimi-K2-Thinking", RT_TOOLFMT_KIMI_K2},
        {"Qwen-Qwen2.5-7B-Instruct", RT_TOOLFMT_HERMES},
        {"Qwen-Qwen3-0.6B", RT_TOOLFMT_HERMES},
        {"NousResearch-Hermes-3-Llama-3.1-8B-tool_use", RT_TOOLFMT_HERMES},
        {"ByteDance-Seed-OSS", RT_TOOLFMT_HERMES},
    };
    if (!templates_dir) {
        printf("skip test_corpus: no --templates DIR\n");
        return;
    }
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s.jinja", templates_dir, cases[i].file);
        FILE *fp = fopen(path, "rb");
        TH_CHECKF(fp != NULL, "open %s", path);
        if (!fp) continue;
        static char buf[1 << 20];
        size_t n = fread(buf, 1, sizeof buf, fp);
        fclose(fp);
        rt_toolfmt got = rt_toolfmt_detect(buf, n);
        TH_CHECKF(got == cases[i].want, "%s: detected %s, want %s", cases[i].file,
                  rt_toolfmt_name(got), rt_toolfmt_name(cases[i].want));
    }
}

int main(int argc, char **argv)
{
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--templates")) templates_dir = argv[i + 1];
    TH_RUN(test_llama3);
    TH_RUN(test_mistral);
    TH_RUN(test_deepseek);
    TH_RUN(test_qwen3_coder);
    TH_RUN(test_glm45);
    TH_RUN(test_kimi);
    TH_RUN(test_pythonic);
    TH_RUN(test_streaming);
    TH_RUN(test_random);
    TH_RUN(test_detect);
    TH_RUN(test_corpus);
    TH_EXIT();
}
