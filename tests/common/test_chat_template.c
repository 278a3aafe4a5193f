/* test_chat_template.c: chat template rendering.
 *
 *   test_chat_template                         built-in cases (no files needed)
 *   test_chat_template --gguf F --expect-dir D     render the GGUF's template
 *   test_chat_template --tmpl-file F --expect-dir D
 * With a template, the conversations below are rendered and compared with D/case<k>.txt,
 * which tests/ref/tok_reference.py writes by running the same template through jinja2.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_template.h"
#include "gguf.h"
#include "td_err.h"
#include "tharness.h"

/* Conversations shared with tok_reference.py (keep in sync: CHAT_CASES there). */
static const td_chat_msg conv1[] = {{"user", "hi", NULL, 0}};
static const td_chat_msg conv2[] = {{"system", "S", NULL, 0},
                                    {"user", "A", NULL, 0},
                                    {"assistant", "B", NULL, 0},
                                    {"user", "C", NULL, 0}};
static const td_chat_msg conv3[] = {
    {"user", "What is 2+2?", NULL, 0},
    {"assistant", "4", NULL, 0},
    {"user", "  and \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80 ", NULL, 0}};
static const struct {
    const td_chat_msg *m;
    size_t n;
    bool gen;
} cases[] = {{conv1, 1, true}, {conv2, 4, true}, {conv2, 4, false}, {conv3, 3, true}};

static const char *g_tmpl_file, *g_gguf, *g_dir;

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (fread(b, 1, (size_t)n, f) != (size_t)n) n = 0;
    b[n] = '\0';
    fclose(f);
    *len = (size_t)n;
    return b;
}

static void check_render(const char *tmpl, const td_chat_msg *m, size_t n, bool gen,
                         const char *want)
{
    char *out = NULL;
    int rc = td_chat_render(tmpl, strlen(tmpl), m, n, gen, &out);
    TH_CHECKF(rc == 0, "render failed: %d", rc);
    if (rc) return;
    TH_CHECKF(strcmp(out, want) == 0, "got\n---\n%s\n---\nwant\n---\n%s\n---", out, want);
    free(out);
}

static const char smollm_tmpl[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\n' }}{% endif %}";

static void test_chatml(void)
{
    check_render(smollm_tmpl, conv1, 1, true,
                 "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                 "Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    check_render(smollm_tmpl, conv2, 4, false,
                 "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nA<|im_end|>\n"
                 "<|im_start|>assistant\nB<|im_end|>\n<|im_start|>user\nC<|im_end|>\n");
    /* plain chatml: no default system message */
    const char *plain = "{% for message in messages %}{{'<|im_start|>' + message['role'] + "
                        "'\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}";
    check_render(plain, conv1, 1, true, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    /* Qwen-style escaped default */
    const char *qwen = "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
                       "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- "
                       "'<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}";
    check_render(qwen, conv1, 1, false,
                 "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n");
    TH_CHECK(td_chat_detect(smollm_tmpl, strlen(smollm_tmpl)) == TD_CHAT_CHATML);
}

static void test_llama3(void)
{
    const char *t = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}";
    TH_CHECK(td_chat_detect(t, strlen(t)) == TD_CHAT_LLAMA3);
    const td_chat_msg m[] = {{"system", " S ", NULL, 0}, {"user", "A\n", NULL, 0}};
    check_render(t, m, 2, true,
                 "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nA<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

static void test_llama2(void)
{
    const char *sys = "{% if messages[0]['role'] == 'system' %}<<SYS>>{% endif %}[INST]";
    TH_CHECK(td_chat_detect(sys, strlen(sys)) == TD_CHAT_LLAMA2);
    check_render(sys, conv2, 4, true,
                 "[INST] <<SYS>>\nS\n<</SYS>>\n\nA [/INST]B</s>[INST] C [/INST]");
    const char *bos = "{{ bos_token + '[INST] ' + content }} <<SYS>>";
    check_render(bos, conv2, 4, true,
                 "[INST] <<SYS>>\nS\n<</SYS>>\n\nA [/INST]B</s><s>[INST] C [/INST]");
    const char *plain = "{{ '[INST] ' + message['content'] + ' [/INST]' }}";
    check_render(plain, conv2, 4, false, "[INST] S\nA [/INST]B</s>[INST] C [/INST]");
    const char *strip = "{{ '[INST] ' + message.content.strip() }} <<SYS>>";
    const td_chat_msg m[] = {{"user", "  A  ", NULL, 0}};
    check_render(strip, m, 1, true, "[INST] A [/INST]");
}

static void test_gemma(void)
{
    /* Gemma 3's template (abridged): the marker is what detection needs */
    const char *t = "{{ bos_token }}{% for message in loop_messages %}<start_of_turn>"
                    "{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}";
    TH_CHECK(td_chat_detect(t, strlen(t)) == TD_CHAT_GEMMA);
    /* llama.cpp's rendering: the system text joins the next user turn, assistant is model */
    check_render(t, conv2, 4, true,
                 "<start_of_turn>user\nS\n\nA<end_of_turn>\n<start_of_turn>model\nB<end_of_turn>\n"
                 "<start_of_turn>user\nC<end_of_turn>\n<start_of_turn>model\n");
    const td_chat_msg m[] = {{"user", " hi \n", NULL, 0}};
    check_render(t, m, 1, false, "<start_of_turn>user\nhi<end_of_turn>\n");
}

static void test_errors(void)
{
    char *out = (char *)1;
    const char *unk = "{% for m in messages %}{{ m['content'] }}{% endfor %}";
    TH_CHECK(td_chat_render(unk, strlen(unk), conv1, 1, true, &out) == TD_EUNSUPP);
    TH_CHECK(out == NULL);
    TH_CHECK(td_chat_render("", 0, conv1, 1, true, &out) == TD_EUNSUPP);
    const char *mistral7 = "[SYSTEM_PROMPT] [INST]";
    TH_CHECK(td_chat_render(mistral7, strlen(mistral7), conv1, 1, true, &out) == TD_EUNSUPP);
    TH_CHECK(td_chat_render(NULL, 0, conv1, 1, true, &out) == TD_EINVAL);
    TH_CHECK(td_chat_render(smollm_tmpl, strlen(smollm_tmpl), NULL, 1, true, &out) == TD_EINVAL);
    const td_chat_msg bad[] = {{"user", NULL, NULL, 0}};
    TH_CHECK(td_chat_render(smollm_tmpl, strlen(smollm_tmpl), bad, 1, true, &out) == TD_EINVAL);
    TH_CHECK(td_chat_render(smollm_tmpl, strlen(smollm_tmpl), conv1, 1, true, NULL) == TD_EINVAL);
    /* no messages: nothing but the generation prompt */
    TH_CHECK(td_chat_render(smollm_tmpl, strlen(smollm_tmpl), NULL, 0, true, &out) == 0);
    TH_CHECK(out && strcmp(out, "<|im_start|>assistant\n") == 0);
    free(out);
}

static void test_reference(void)
{
    size_t tlen = 0;
    char *tmpl = NULL;
    td_gguf *g = NULL;
    if (g_tmpl_file) {
        tmpl = slurp(g_tmpl_file, &tlen);
        TH_REQUIRE(tmpl != NULL);
    } else {
        char err[256];
        TH_REQUIRE(td_gguf_open(g_gguf, &g, err, sizeof err) == 0);
        const char *s;
        TH_REQUIRE(td_gguf_get_str(g, "tokenizer.chat_template", &s, &tlen) == 0);
        tmpl = malloc(tlen + 1);
        memcpy(tmpl, s, tlen);
        tmpl[tlen] = '\0';
        td_gguf_close(g);
    }
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/case%zu.txt", g_dir, k + 1);
        size_t wlen;
        char *want = slurp(path, &wlen);
        TH_CHECKF(want != NULL, "missing %s", path);
        if (!want) continue;
        char *out = NULL;
        int rc = td_chat_render(tmpl, tlen, cases[k].m, cases[k].n, cases[k].gen, &out);
        TH_CHECKF(rc == 0, "case %zu: render failed %d", k + 1, rc);
        if (rc == 0)
            TH_CHECKF(strlen(out) == wlen && memcmp(out, want, wlen) == 0,
                      "case %zu differs from jinja2:\n--- ours\n%s\n--- jinja2\n%s\n---", k + 1,
                      out, want);
        fprintf(stderr, "case %zu %s\n", k + 1,
                rc == 0 && !strcmp(out, want) ? "matches" : "DIFFERS");
        free(out);
        free(want);
    }
    free(tmpl);
}

int main(int argc, char **argv)
{
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--tmpl-file"))
            g_tmpl_file = argv[i + 1];
        else if (!strcmp(argv[i], "--gguf"))
            g_gguf = argv[i + 1];
        else if (!strcmp(argv[i], "--expect-dir"))
            g_dir = argv[i + 1];
    }
    if (g_dir && (g_tmpl_file || g_gguf)) {
        TH_RUN(test_reference);
        TH_EXIT();
    }
    TH_RUN(test_chatml);
    TH_RUN(test_llama3);
    TH_RUN(test_llama2);
    TH_RUN(test_gemma);
    TH_RUN(test_errors);
    TH_EXIT();
}
