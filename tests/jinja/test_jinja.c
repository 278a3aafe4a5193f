/* test_jinja.c: the Jinja engine (jinja/jn.h) on constructs one at a time: each case's
 * expected text is what jinja2 under transformers' settings renders (each checked with
 * tests/ref/template_reference.py's render when written); errors are checked to be errors with a
 * line, and the limits to hold. The real templates are tested whole by tests/templates (the
 * corpus). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jn.h"
#include "jn_chat.h"
#include "td_err.h"

static int failures, checks;

/* Render src with vars (JSON text) and compare with want (NULL: expect an error whose
 * message contains err_sub, and the return code rc_want). */
static void check(const char *src, const char *vars, const char *want, int rc_want,
                  const char *err_sub, int line)
{
    checks++;
    json_error_t je;
    json_t *v = json_loads(vars ? vars : "{}", 0, &je);
    if (!v) {
        printf("FAIL line %d: bad vars JSON: %s\n", line, je.text);
        failures++;
        return;
    }
    jn_template *t = NULL;
    jn_error e = {0};
    char *out = NULL;
    size_t n = 0;
    jn_opts o = {.now = 1764979200};
    int rc = jn_parse(src, strlen(src), &t, &e);
    if (!rc) rc = jn_render(t, v, &o, &out, &n, &e);
    if (want) {
        if (rc || strcmp(out, want) || n != strlen(want)) {
            printf("FAIL line %d: %s\n  want [%s]\n  got  [%s] rc=%d err='line %d: %s'\n", line,
                   src, want, out ? out : "(null)", rc, e.line, e.msg);
            failures++;
        }
    } else if (rc != rc_want || (err_sub && !strstr(e.msg, err_sub))) {
        printf("FAIL line %d: %s\n  want error %d containing '%s'\n  got rc=%d '%s' out=[%s]\n",
               line, src, rc_want, err_sub ? err_sub : "", rc, e.msg, out ? out : "(null)");
        failures++;
    }
    free(out);
    jn_template_free(t);
    json_decref(v);
}

#define OK(src, vars, want)     check(src, vars, want, 0, NULL, __LINE__)
#define ERR(src, vars, rc, sub) check(src, vars, NULL, rc, sub, __LINE__)

static void test_output_and_whitespace(void)
{
    OK("hello", NULL, "hello");
    OK("a\n", NULL, "a"); /* one trailing newline dropped */
    OK("a\n\n", NULL, "a\n");
    OK("a\r\nb", NULL, "a\nb");
    OK("{% if true %}\nx\n{% endif %}\ny", NULL, "x\ny"); /* trim_blocks */
    OK("  {% if true %}x{% endif %}", NULL, "x");         /* lstrip_blocks */
    OK("a  {% if true %}x{% endif %}", NULL, "a  x");     /* not at a line's start */
    OK("  {{ 1 }}", NULL, "  1");                         /* lstrip is for blocks only */
    OK("a \n {{- 1 -}} \n b", NULL, "a1b");
    OK("  {%+ if true %}x{% endif %}", NULL, "  x");
    OK("{% if true +%}\nx{% endif %}", NULL, "\nx");
    OK("a{# note #}\nb", NULL, "ab");
    OK("  {# note #}\nb", NULL, "b");
    OK("{% raw %}{{ x }}{% endraw %}", NULL, "{{ x }}");
    OK("{{ none }}|{{ true }}|{{ 1.5 }}|{{ 2.0 }}|{{ 1e20 }}|{{ x }}", NULL,
       "None|True|1.5|2.0|1e+20|");
    OK("{{ [1, 'a', none, {'k': \"it's\"}] }}", NULL, "[1, 'a', None, {'k': \"it's\"}]");
    OK("{{ (1,) }}{{ (1, 2) }}", NULL, "(1,)(1, 2)");
    OK("{{ 'a\\n\\t\\u00e9\\x41' }}", NULL,
       "a\n\t\xc3\xa9"
       "A");
}

static void test_expressions(void)
{
    OK("{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }}", NULL,
       "3 -4 1 2 3.5 1024");
    OK("{{ 'a' ~ 1 ~ none }} {{ 'ab' * 2 }} {{ [1] + [2] }}", NULL, "a1None abab [1, 2]");
    OK("{{ 1 < 2 < 3 }} {{ 'b' in 'abc' }} {{ 2 not in [1] }} {{ 'k' in {'k': 1} }}", NULL,
       "True True True True");
    OK("{{ x or 'd' }} {{ 0 and 1 }} {{ not x }}", NULL, "d 0 True");
    OK("{{ 'y' if x else 'n' }}{{ 'z' if x }}", NULL, "n");
    OK("{{ s[1:] }} {{ s[::-1] }} {{ s[-1] }} {{ l[1:3] }} {{ l[-2:] }}",
       "{\"s\": \"h\\u00e9llo\", \"l\": [1, 2, 3, 4]}", "\xc3\xa9llo oll\xc3\xa9h o [2, 3] [3, 4]");
    OK("{{ m.role }} {{ m['content'] }} {{ m.missing }} {{ m.items()|list }}",
       "{\"m\": {\"role\": \"user\", \"content\": \"hi\"}}",
       "user hi  [('role', 'user'), ('content', 'hi')]");
    OK("{{ m.get('role') }} {{ m.get('x', 'd') }} {{ m.get('x') }}", "{\"m\": {\"role\": \"u\"}}",
       "u d None");
    ERR("{{ x.y }}", NULL, TD_EINVAL, "'x' is undefined");
    ERR("{{ x + 1 }}", NULL, TD_EINVAL, "undefined");
    ERR("{{ 1 + 'a' }}", NULL, TD_EINVAL, "unsupported operand");
    ERR("{{ 1 < 'a' }}", NULL, TD_EINVAL, "not supported");
    ERR("{{ 1 / 0 }}", NULL, TD_EINVAL, "division by zero");
}

static void test_statements(void)
{
    OK("{% for x in [1, 2, 3] %}{{ loop.index }}{{ x }}{% if not loop.last %},{% endif %}{% endfor "
       "%}",
       NULL, "11,22,33");
    OK("{% for x in [] %}a{% else %}empty{% endfor %}", NULL, "empty");
    OK("{% for x in [1, 2, 3, 4] if x % 2 %}{{ x }}/{{ loop.length }} {% endfor %}", NULL,
       "1/2 3/2 ");
    OK("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", "{\"d\": {\"a\": 1, \"b\": 2}}",
       "a=1;b=2;");
    OK("{% for x in [1, 2, 3] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}", NULL,
       "1");
    OK("{% for x in [1, 2, 3] %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}{% endfor %}", NULL,
       "13");
    /* a break or continue belongs to a loop around it in the same body, or fails to parse */
    ERR("{%- break %}x", NULL, TD_EINVAL, "'break' outside a for loop");
    ERR("{% for x in [] %}{% else %}{% continue %}{% endfor %}", NULL, TD_EINVAL,
        "'continue' outside a for loop");
    ERR("{% for x in [1] %}{% macro m() %}{% break %}{% endmacro %}{% endfor %}", NULL, TD_EINVAL,
        "'break' outside a for loop");
    OK("{% macro m() %}{% for x in [1, 2] %}{{ x }}{% break %}{% endfor %}{% endmacro %}"
       "{% for y in [3, 4] %}{{ m() }}{% if y == 3 %}{% continue %}{% endif %}{{ y }}{% endfor %}",
       NULL, "114");
    OK("{% for x in 'ab' %}{{ loop.previtem }}{{ x }}{{ loop.nextitem }}|{% endfor %}", NULL,
       "ab|ab|");
    /* scoping: a set in a loop stays in it, a namespace carries out */
    OK("{% set a = 1 %}{% for x in [1] %}{% set a = 2 %}{% endfor %}{{ a }}", NULL, "1");
    OK("{% set ns = namespace(a=1) %}{% for x in [1] %}{% set ns.a = 2 %}{% endfor %}{{ ns.a }}",
       NULL, "2");
    OK("{% if true %}{% set a = 3 %}{% endif %}{{ a }}", NULL, "3");
    OK("{% set a, b = 1, 2 %}{{ b }}{{ a }}", NULL, "21");
    OK("{% set t %}x{{ 1 }}{% endset %}[{{ t }}]", NULL, "[x1]");
    OK("{% set t | upper %}ab{% endset %}{{ t }}", NULL, "AB");
    OK("{% macro m(a, b='d') %}{{ a }}{{ b }}{{ varargs }}{% endmacro %}{{ m(1) }} {{ m(1, b=2) }} "
       "{{ m(1, 2, 3) }}",
       NULL, "1d() 12() 12(3,)");
    OK("{% macro m() %}<{{ caller() }}>{% endmacro %}{% call m() %}in{% endcall %}", NULL, "<in>");
    OK("{% filter upper %}ab{% endfilter %}", NULL, "AB");
    OK("{% generation %}g{% endgeneration %}", NULL, "g");
    OK("{% if false %}a{% elif true %}b{% else %}c{% endif %}", NULL, "b");
    ERR("{% if true %}", NULL, TD_EINVAL, "endif");
    ERR("{% include 'x' %}", NULL, TD_EUNSUPP, "include");
    ERR("{{ raise_exception('bad role') }}", NULL, TD_EINVAL, "bad role");
    ERR("{% set ns = namespace() %}{% set ns._x = 1 %}", NULL, TD_EINVAL, "underscore");
    ERR("{% set l = [1] %}{{ l.append(2) }}", NULL, TD_EINVAL, "unsafe");
}

static void test_filters_and_tests(void)
{
    OK("{{ d|tojson }}", "{\"d\": {\"a\": [1, 2.5, \"\\u00e9\\\"\\n\"], \"b\": null, \"c\": true}}",
       "{\"a\": [1, 2.5, \"\xc3\xa9\\\"\\n\"], \"b\": null, \"c\": true}");
    OK("{{ d|tojson(indent=2) }}", "{\"d\": {\"a\": [1], \"b\": {}}}",
       "{\n  \"a\": [\n    1\n  ],\n  \"b\": {}\n}");
    OK("{{ d|tojson(separators=(',', ':'), sort_keys=true) }}", "{\"d\": {\"b\": 1, \"a\": 2}}",
       "{\"a\":2,\"b\":1}");
    OK("{{ '  x  '|trim }}|{{ 'ab'|upper }}|{{ 'AB'|lower }}|{{ 'hello world'|title }}|{{ "
       "'hI'|capitalize }}",
       NULL, "x|AB|ab|Hello World|Hi");
    OK("{{ [1, 2]|length }} {{ 'h\xc3\xa9'|length }} {{ {'a': 1}|length }} {{ x|length }}", NULL,
       "2 2 1 0");
    OK("{{ x|default('d') }} {{ ''|default('d', true) }} {{ 0|default('d') }}", NULL, "d d 0");
    OK("{{ [1, 2]|join(', ') }} {{ l|map(attribute='n')|join }} {{ ['a', 'b']|map('upper')|list }}",
       "{\"l\": [{\"n\": \"x\"}, {\"n\": \"y\"}]}", "1, 2 xy ['A', 'B']");
    OK("{{ l|selectattr('t', 'equalto', 'f')|map(attribute='n')|list }} {{ "
       "l|rejectattr('t')|list|length }}",
       "{\"l\": [{\"n\": 1, \"t\": \"f\"}, {\"n\": 2, \"t\": \"g\"}, {\"n\": 3}]}", "[1] 1");
    /* a non-string attribute is one item key (jinja2's make_attrgetter); none reads nothing */
    OK("{{ [[1, 2], [3, 4]]|map(attribute=1)|list }} {{ [[1, 2], [3, 4]]|sum(attribute=1) }} {{ "
       "[[1, 2], [3, 4]]|join(',', attribute=0) }} {{ [[3, 1], [1, 2]]|sort(attribute=0)|list }} "
       "{{ [3, 1]|sort(attribute=none)|list }} {{ [[2, 9], [1, 8]]|max(attribute=1) }}",
       NULL, "[2, 4] 6 1,3 [[1, 2], [3, 1]] [1, 3] [2, 9]");
    OK("{{ [3, 1, 2]|sort|list }} {{ ['b', 'A', 'a']|unique|list }} {{ [2, 5, 1]|max }} {{ {'b': "
       "1, 'a': 2}|dictsort }}",
       NULL, "[1, 2, 3] ['b', 'A'] 5 [('a', 2), ('b', 1)]");
    OK("{{ 'a\\nb\\n'|indent(2) }}|{{ 'a\\nb'|indent(2, true) }}", NULL, "a\n  b\n|  a\n  b");
    OK("{{ '3'|int + 1 }} {{ 'x'|int }} {{ 2.7|int }} {{ '1.5'|float }}", NULL, "4 0 2 1.5");
    OK("{{ 'aXbX'|replace('X', '-') }} {{ [1, 2]|first }} {{ [1, 2]|last }} {{ 'ab'|reverse }}",
       NULL, "a-b- 1 2 ba");
    OK("{{ x is defined }} {{ none is none }} {{ 's' is string }} {{ {} is mapping }} {{ [] is "
       "iterable }} "
       "{{ 1 is number }} {{ 3 is divisibleby 3 }} {{ 2 is even }} {{ 'a' is in 'ab' }} {{ 1 is "
       "not none }}",
       NULL, "False True True True True True True True True True");
    /* markupsafe: Markup + str escapes the str; ~ and join do not */
    OK("{{ '<a>'|safe + '<b>' }} {{ '<b>' + '&'|safe }} {{ '<a>'|safe ~ '<b>' }} {{ \"'x'\"|e }}",
       NULL, "<a>&lt;b&gt; &lt;b&gt;& <a><b> &#39;x&#39;");
    /* map and select give generators: iterable once, no len(), not JSON, map of nothing */
    OK("{{ [1, 2]|map('string')|list }} {{ x|map('upper')|list }} {{ [1]|select|first }}", NULL,
       "['1', '2'] [] 1");
    ERR("{{ [1]|map('string')|tojson }}", NULL, TD_EINVAL, "generator");
    ERR("{{ [1]|select|length }}", NULL, TD_EINVAL, "len()");
    OK("{{ s|tojson(ensure_ascii=true) }}", "{\"s\": \"\xc3\xa9\xf0\x9f\x98\x80\"}",
       "\"\\u00e9\\ud83d\\ude00\"");
    ERR("{{ x|from_json }}", NULL, TD_EINVAL, "no filter named 'from_json'");
    OK("{% if false %}{{ x|from_json }}{% endif %}ok", NULL, "ok"); /* only when reached */
    ERR("{{ x|wordwrap }}", NULL, TD_EUNSUPP, "wordwrap");
}

static void test_methods(void)
{
    OK("{{ ' a b '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b "
       "'.split() }}",
       NULL, "a b|a|['a', 'b', '', 'c']|['a', 'b']");
    OK("{{ 'a b c'.split(' ', 1) }} {{ 'a b c'.rsplit(' ', 1) }} {{ 'ab'.startswith(('x', 'a')) }}",
       NULL, "['a', 'b c'] ['a b', 'c'] True");
    OK("{{ '{}-{}'.format(1, 'b') }} {{ '{n}!'.format(n=2) }} {{ 'x{0}{0}'.format(3) }}", NULL,
       "1-b 2! x33");
    OK("{{ 'a\\nb\\r\\nc'.splitlines() }} {{ 'abcb'.count('b') }} {{ 'abc'.find('c') }}", NULL,
       "['a', 'b', 'c'] 2 2");
    OK("{{ ', '.join(['a', 'b']) }} {{ 'ab'.upper() }} {{ 'x'.missing }}", NULL, "a, b AB ");
    OK("{{ strftime_now('%Y-%m-%d') }} {{ range(3)|list }} {{ range(1, 7, 2)|list }} {{ dict(a=1) "
       "}}",
       NULL, "2025-12-06 [0, 1, 2] [1, 3, 5] {'a': 1}");
}

static void test_limits(void)
{
    ERR("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", NULL, TD_ERANGE, "nested deeper");
    ERR("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", NULL,
        TD_ERANGE, NULL);
    ERR("{% for i in range(10000) %}{% for j in range(201) %}{% endfor %}{% endfor %}", NULL,
        TD_ERANGE, "loop iterations");
    ERR("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", NULL, TD_EINVAL, "takes");
    ERR("{% macro m(a) %}{% endmacro %}{{ m(b=2) }}", NULL, TD_EINVAL, "keyword argument 'b'");
    ERR("{{ range(1000000) }}", NULL, TD_ERANGE, "range");
    ERR("{{ 'x' * 100000000000 }}", NULL, TD_ERANGE, "limit");
    ERR("{{ 'abc }}", NULL, TD_EINVAL, "unterminated");
    ERR("{{ 1 +  }}", NULL, TD_EINVAL, "unexpected");
    ERR("{% for %}", NULL, TD_EINVAL, "name");
    /* nesting deeper than the parser takes is an error, not a stack overflow */
    char deep[4000];
    memset(deep, '(', 1500);
    deep[1500] = '1';
    memset(deep + 1501, ')', 1500);
    deep[3001] = '\0';
    char tmpl[4100];
    snprintf(tmpl, sizeof tmpl, "{{ %s }}", deep);
    ERR(tmpl, NULL, TD_EUNSUPP, "nested deeper");
    char nots[4100] = "{{ ";
    for (int i = 0; i < 900; i++)
        strcat(nots, "not ");
    strcat(nots, "1 }}");
    ERR(nots, NULL, TD_EUNSUPP, "nested deeper");
    char ifs[8000] = "";
    for (int i = 0; i < 300; i++)
        strcat(ifs, "{% if 1 %}");
    ERR(ifs, NULL, TD_EUNSUPP, "nested deeper");
}

/* The built-in family templates (for model files without one), through jn_chat as the
 * router renders them; the expected texts are jinja2's (template_reference.py). */
static void test_families(void)
{
    static const struct {
        const char *family, *want;
    } cases[] = {
        {"chatml", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi <|im_end|>\n"
                   "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                   "<|im_start|>assistant\n"},
        {"llama3", "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>"
                   "assistant<|end_header_id|>\n\nHello.<|eot_id|><|start_header_id|>user"
                   "<|end_header_id|>\n\n2+2?<|eot_id|><|start_header_id|>assistant"
                   "<|end_header_id|>\n\n"},
        {"llama2", "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\n Hi [/INST] Hello. </s><s>[INST] "
                   "2+2? [/INST]"},
        {"gemma", "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
                  "Hello.<end_of_turn>\n<start_of_turn>user\n2+2?<end_of_turn>\n"
                  "<start_of_turn>model\n"},
    };
    json_t *msgs = json_loads("[{\"role\": \"system\", \"content\": \"Be brief.\"}, "
                              "{\"role\": \"user\", \"content\": \" Hi \"}, "
                              "{\"role\": \"assistant\", \"content\": \"Hello.\"}, "
                              "{\"role\": \"user\", \"content\": \"2+2?\"}]",
                              0, NULL);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        checks++;
        const char *src = jn_family_template(cases[i].family);
        jn_template *t = NULL;
        jn_error e = {0};
        char *out = NULL;
        jn_chat chat = {.messages = msgs,
                        .add_generation_prompt = true,
                        .bos_token = "<s>",
                        .eos_token = "</s>"};
        int rc = src ? jn_parse(src, strlen(src), &t, &e) : -1;
        if (!rc) rc = jn_chat_render(t, &chat, NULL, &out, NULL, &e);
        if (rc || strcmp(out, cases[i].want)) {
            printf("FAIL family %s: rc %d (%s)\n  got  [%s]\n  want [%s]\n", cases[i].family, rc,
                   e.msg, out ? out : "", cases[i].want);
            failures++;
        }
        free(out);
        jn_template_free(t);
    }
    checks++;
    if (jn_family_template("jinja") || jn_family_template(NULL)) {
        printf("FAIL an unknown family has a template\n");
        failures++;
    }
    json_decref(msgs);
}

int main(void)
{
    test_output_and_whitespace();
    test_expressions();
    test_statements();
    test_filters_and_tests();
    test_methods();
    test_limits();
    test_families();
    printf("test_jinja: %d of %d checks passed\n", checks - failures, checks);
    return failures ? 1 : 0;
}
