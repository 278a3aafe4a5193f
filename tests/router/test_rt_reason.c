/* test_rt_reason.c: the reasoning parser (router/rt_reason.c): a block the output opens, one
 * the prompt left open, no block, a block cut by max_tokens, tags split anywhere, and the
 * template and prompt checks. Every case is fed whole and in pieces of 1, 2, 3, 5 and 11
 * bytes; what comes out must be the expected reasoning and content whatever the split. The
 * same with the other families' markers (Seed-OSS, Mistral, Gemma 4). */
#include <stdio.h>
#include <string.h>

#include "rt_buf.h"
#include "rt_reason.h"
#include "tharness.h"

typedef struct {
    rt_buf r, c;
    int order_bad; /* reasoning after content */
} out_t;

static int on_piece(void *ctx, bool reasoning, const char *text, size_t len)
{
    out_t *o = ctx;
    if (reasoning && o->c.len) o->order_bad = 1;
    return rt_buf_append(reasoning ? &o->r : &o->c, text, len);
}

static rt_reason_fmt g_fmt = RT_REASON_THINK; /* the format run() parses */

/* Feeds text in pieces of `step` bytes (0: whole) and checks the result. */
static void run(const char *text, bool open, const char *want_r, const char *want_c, size_t step)
{
    rt_reason p;
    out_t o = {0};
    rt_reason_init(&p, g_fmt, open);
    size_t n = strlen(text);
    for (size_t i = 0; i < n;) {
        size_t k = step && n - i > step ? step : n - i;
        TH_CHECK(rt_reason_feed(&p, text + i, k, on_piece, &o) == 0);
        i += k;
    }
    TH_CHECK(rt_reason_finish(&p, on_piece, &o) == 0);
    bool ok = o.r.len == strlen(want_r) && !memcmp(o.r.buf ? o.r.buf : "", want_r, o.r.len) &&
              o.c.len == strlen(want_c) && !memcmp(o.c.buf ? o.c.buf : "", want_c, o.c.len) &&
              !o.order_bad;
    TH_CHECKF(ok, "%s: text %s open %d step %zu: reasoning [%.*s] content [%.*s]",
              rt_reason_fmt_name(g_fmt), text, open, step, (int)o.r.len, o.r.buf ? o.r.buf : "",
              (int)o.c.len, o.c.buf ? o.c.buf : "");
    rt_buf_free(&o.r);
    rt_buf_free(&o.c);
}

static void each_split(const char *text, bool open, const char *want_r, const char *want_c)
{
    static const size_t steps[] = {0, 1, 2, 3, 5, 11};
    for (size_t i = 0; i < sizeof steps / sizeof *steps; i++)
        run(text, open, want_r, want_c, steps[i]);
}

static void test_opened_by_output(void)
{
    each_split("<think>\nplan it\n</think>\n\nThe answer.", false, "\nplan it\n",
               "\n\nThe answer.");
    each_split("  \n<think>a</think>b", false, "a", "b");
    each_split("<think></think>", false, "", "");
    each_split("<think>cut by max_tokens", false, "cut by max_tokens", "");
    each_split("<think>x</thi", false, "x</thi", ""); /* a partial tag at the end is text */
    each_split("<think>a < b </think> c </think>", false, "a < b ", " c </think>");
}

static void test_open_prompt(void)
{
    each_split("reason</think>answer", true, "reason", "answer");
    each_split("all reasoning", true, "all reasoning", "");
    each_split("<think>x</think>y", true, "<think>x", "y");
}

static void test_no_block(void)
{
    each_split("plain answer", false, "", "plain answer");
    each_split("answer with <think>later</think>", false, "", "answer with <think>later</think>");
    each_split("<thin", false, "", "<thin");
    each_split("   ", false, "", "   ");
    each_split("", false, "", "");
    /* whitespace before the tag: up to 8 bytes; past that the output is content */
    each_split("        <think>r</think>c", false, "r", "c");
    each_split("         <think>r</think>c", false, "", "         <think>r</think>c");
}

static void test_checks(void)
{
    const char *t = "{% if x %}<think>\n{% endif %}</think>";
    TH_CHECK(rt_reason_template(t, strlen(t)) == RT_REASON_THINK);
    TH_CHECK(rt_reason_template("<think>", 7) == RT_REASON_NONE);
    const char *open = "<|im_start|>assistant\n<think>\n";
    const char *closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
    TH_CHECK(rt_reason_prompt_open(RT_REASON_THINK, open, strlen(open)));
    TH_CHECK(!rt_reason_prompt_open(RT_REASON_THINK, closed, strlen(closed)));
    TH_CHECK(!rt_reason_prompt_open(RT_REASON_THINK, "no tags", 7));
    TH_CHECK(!rt_reason_prompt_open(RT_REASON_NONE, open, strlen(open)));
    /* the other families' markers, as their templates write them */
    const char *seed = "{%- set think_begin_token = '<seed:think>' -%}{%- set think_end_token = "
                       "'</seed:think>' -%}";
    TH_CHECK(rt_reason_template(seed, strlen(seed)) == RT_REASON_SEED);
    const char *mis = "{{- '[THINK]' + block['thinking'] + '[/THINK]' }}";
    TH_CHECK(rt_reason_template(mis, strlen(mis)) == RT_REASON_MISTRAL);
    const char *gem = "{{- '<|channel>thought\\n' + thinking_text + '\\n<channel|>' -}}";
    TH_CHECK(rt_reason_template(gem, strlen(gem)) == RT_REASON_GEMMA4);
    /* Ministral's system prompt quotes both of its markers: the prompt is not left open */
    const char *quoted = "[SYSTEM_PROMPT]follow:[THINK]thoughts[/THINK]answer[/SYSTEM_PROMPT]"
                         "[INST]hi[/INST]";
    TH_CHECK(!rt_reason_prompt_open(RT_REASON_MISTRAL, quoted, strlen(quoted)));
    const char *gem_off = "<|turn>model\n<|channel>thought\n<channel|>";
    TH_CHECK(!rt_reason_prompt_open(RT_REASON_GEMMA4, gem_off, strlen(gem_off)));
}

/* The same rules with each other family's markers. */
static void test_other_markers(void)
{
    g_fmt = RT_REASON_SEED;
    each_split("<seed:think>plan</seed:think>Answer.", false, "plan", "Answer.");
    each_split("<think>x</think>y", false, "", "<think>x</think>y"); /* another family's */
    each_split("plan</seed:think>Answer", true, "plan", "Answer");
    g_fmt = RT_REASON_MISTRAL;
    each_split("[THINK]a [b] c[/THINK]\nThe answer", false, "a [b] c", "\nThe answer");
    each_split(" [THINK]cut", false, "cut", "");
    each_split("[THIN", false, "", "[THIN");
    g_fmt = RT_REASON_GEMMA4;
    each_split("<|channel>thought\nstep 1\n<channel|>Paris.", false, "\nstep 1\n", "Paris.");
    each_split("        <|channel>thought<channel|>", false, "", "");
    each_split("Paris.", false, "", "Paris.");
    g_fmt = RT_REASON_THINK;
}

int main(void)
{
    TH_RUN(test_opened_by_output);
    TH_RUN(test_open_prompt);
    TH_RUN(test_no_block);
    TH_RUN(test_checks);
    TH_RUN(test_other_markers);
    TH_EXIT();
}
