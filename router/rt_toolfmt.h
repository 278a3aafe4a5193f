/* rt_toolfmt.h: the tool-call formats of the model families, and their call blocks (prefix rt_).
 *
 * Purpose: which format a model writes its calls in (found in its chat template's own
 * literal markers, or named by router.tool_parser), where a call block starts and ends in
 * the output, and a complete block -> the calls in it, as vLLM's tool parser of the same
 * name reads them:
 *   hermes        <tool_call>{"name": f, "arguments": {...}}</tool_call>  (rt_tools.c itself)
 *   llama3_json   {"name": f, "parameters": {...}} at the start of the output (or after
 *                 <|python_tag|>), several separated by ";"
 *   mistral       [TOOL_CALLS][{"name": f, "arguments": {...}}, ...] (Nemo), or
 *                 [TOOL_CALLS]f[ARGS]{...} / f[CALL_ID]id[ARGS]{...} / f{...}, repeated (v11+)
 *   deepseek_v3
 * <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{...}\n```
 *                 <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>  (R1 and its distills)
 *   deepseek_v31
 * <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>... qwen3_coder
 * <tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call> glm45
 * <tool_call>f\n<arg_key>p</arg_key>\n<arg_value>value</arg_value>\n</tool_call> kimi_k2
 * <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0
 *                 <|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>
 *   pythonic      [f(a=1, b="x"), g()] as the whole output
 * Arguments are returned as vLLM returns them: the generated text itself where vLLM passes
 * it through (deepseek_v3, deepseek_v31, kimi_k2), else re-written as json.dumps writes
 * them (jn_pyjson); a parameter value of qwen3_coder and glm45 is typed from the tool's
 * JSON schema (a string parameter stays a string, others are read as JSON / a Python
 * literal), as vLLM does.
 * Invariants: the tables are constant; a parse never keeps a pointer into its input.
 * Threading: none (pure functions).
 * Ownership: rt_toolfmt_calls owns its strings (rt_toolfmt_calls_fini).
 */
#ifndef RT_TOOLFMT_H
#define RT_TOOLFMT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

/* DeepSeek's and Kimi's literal markers (the parse's and the scan's, rt_toolscan.c) */
#define RT_TF_DS_CALLS_BEGIN                                                                       \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "calls\xe2\x96\x81"                                                                            \
    "begin\xef\xbd\x9c>"
#define RT_TF_DS_CALLS_END                                                                         \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "calls\xe2\x96\x81"                                                                            \
    "end\xef\xbd\x9c>"
#define RT_TF_DS_CALL_BEGIN                                                                        \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "call\xe2\x96\x81"                                                                             \
    "begin\xef\xbd\x9c>"
#define RT_TF_DS_CALL_END                                                                          \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "call\xe2\x96\x81"                                                                             \
    "end\xef\xbd\x9c>"
#define RT_TF_DS_SEP                                                                               \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "sep\xef\xbd\x9c>"
#define RT_TF_KIMI_BEGIN    "<|tool_calls_section_begin|>"
#define RT_TF_KIMI_END      "<|tool_calls_section_end|>"
#define RT_TF_KIMI_CALL     "<|tool_call_begin|>"
#define RT_TF_KIMI_ARG      "<|tool_call_argument_begin|>"
#define RT_TF_KIMI_CALL_END "<|tool_call_end|>"

typedef enum {
    RT_TOOLFMT_HERMES = 0, /* the default: a template with no other family's markers */
    RT_TOOLFMT_LLAMA3_JSON,
    RT_TOOLFMT_MISTRAL,
    RT_TOOLFMT_DEEPSEEK_V3,
    RT_TOOLFMT_DEEPSEEK_V31,
    RT_TOOLFMT_QWEN3_CODER,
    RT_TOOLFMT_GLM45,
    RT_TOOLFMT_KIMI_K2,
    RT_TOOLFMT_PYTHONIC,
    RT_TOOLFMT_N
} rt_toolfmt;

/* The format's name (router.tool_parser's word, vLLM's --tool-call-parser name). */
const char *rt_toolfmt_name(rt_toolfmt f);
/* name -> *f; returns false for an unknown name ("auto" is not a format). */
bool rt_toolfmt_by_name(const char *name, rt_toolfmt *f);
/* The format a chat template teaches, from its literal markers (first rule that matches):
 * [TOOL_CALLS] mistral; <｜tool▁calls▁begin｜> deepseek_v3 with a ```json fence, else
 * deepseek_v31; <|tool_calls_section_begin|> kimi_k2; <arg_key> glm45; <function= and
 * <parameter= (without <seed:tool_call>) qwen3_coder; <tool_call> hermes; {"name": function
 * name, "parameters" (Llama 3.1 to 3.3's instruction) llama3_json; [func_name1( pythonic;
 * anything else hermes. */
rt_toolfmt rt_toolfmt_detect(const char *tmpl, size_t len);
/* The format's markers are control tokens that a reply hides by default: a request parsed
 * in it decodes with special tokens shown (as vLLM's mistral parser asks). */
bool rt_toolfmt_shows_special(rt_toolfmt f);

/* Where a call block starts (open) and ends (close, NULL: at the end of the output). An
 * at_start marker opens a block only as the first text of the output (after whitespace),
 * and belongs to the block's text; the others open one anywhere. */
typedef struct {
    const char *open;
    const char *close;
    bool at_start;
} rt_toolfmt_marker;

/* The format's markers (*n of them; none for hermes, which rt_tools.c parses itself). */
const rt_toolfmt_marker *rt_toolfmt_markers(rt_toolfmt f, size_t *n);

typedef struct {
    char *name;
    char *args; /* the arguments as the API returns them (a JSON text) */
    char *id;   /* the call id the format writes (kimi_k2), or NULL: the parser makes one */
} rt_toolfmt_call;

typedef struct {
    rt_toolfmt_call *v;
    int n, cap;
} rt_toolfmt_calls;

void rt_toolfmt_calls_fini(rt_toolfmt_calls *c);

/* The calls in a complete block s[0..n) (its markers included): appended to *out. tools:
 * the request's tools array (for the parameter types), or NULL. Returns 0 (out->n == 0:
 * the block holds no call, and is content) or TD_ENOMEM. */
int rt_toolfmt_parse(rt_toolfmt f, const char *s, size_t n, const json_t *tools,
                     rt_toolfmt_calls *out);

/* Text helpers the parse and the scan (rt_toolscan.c) share: the offset of lit in
 * s[from..n), or n; the end of the Python identifier at s[i] (i itself when there is none). */
size_t rt_toolfmt_find(const char *s, size_t n, size_t from, const char *lit);
size_t rt_toolfmt_py_ident(const char *s, size_t n, size_t i);

/* qwen3_coder, glm45, pythonic: one parameter as its call's arguments hold it, "key": value
 * (the JSON text json.dumps writes between the object's braces), with the value text v[0..n)
 * cut as the format's parser cuts it and typed from tool fn's schema in tools (pythonic: read
 * as a Python literal), as rt_toolfmt_parse types it. NULL: no memory, a value that is not
 * valid UTF-8, or (pythonic) not a literal. */
char *rt_toolfmt_param_json(rt_toolfmt f, const json_t *tools, const char *fn, const char *key,
                            const char *v, size_t n);

#endif
