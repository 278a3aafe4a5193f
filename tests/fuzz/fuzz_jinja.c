/* fuzz_jinja.c: libFuzzer target for the chat-template engine (jinja/jn.h): a template text
 * from the model file (untrusted: any GGUF a user points the router at) parsed and rendered
 * with a conversation, tools and kwargs as the router passes them.
 *
 * Input: the template's text. It is parsed; if it parses, it is rendered twice with the
 * same variables (a small output limit, so runaway output stops early).
 * Oracle: no crash, leak, hang or out-of-bounds access; every failure has a message; a
 * rendering is NUL-terminated at its length, and the same both times (no state kept
 * between renders of one parsed template).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jn.h"
#include "jn_chat.h"
#include "td_err.h"

static json_t *g_vars;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    td_log_set_level(TD_LOG_ERROR);
    json_t *msgs = json_loads(
        "[{\"role\": \"system\", \"content\": \"Be brief.\"},"
        " {\"role\": \"user\", \"content\": \"Weather in Paris? \\u00e9\\u4e2d\"},"
        " {\"role\": \"assistant\", \"content\": \"\", \"reasoning_content\": \"think\","
        "  \"tool_calls\": [{\"id\": \"c1\", \"type\": \"function\", \"function\":"
        "  {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"n\": 1.5}}}]},"
        " {\"role\": \"tool\", \"tool_call_id\": \"c1\", \"content\": \"18 C\"}]",
        0, NULL);
    json_t *tools = json_loads("[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\","
                               " \"parameters\": {\"type\": \"object\", \"properties\":"
                               " {\"city\": {\"type\": \"string\"}}}}}]",
                               0, NULL);
    json_t *kw = json_pack("{s:b}", "enable_thinking", 0);
    jn_chat chat = {.messages = msgs,
                    .tools = tools,
                    .add_generation_prompt = true,
                    .bos_token = "<s>",
                    .eos_token = "</s>",
                    .kwargs = kw};
    jn_error e;
    g_vars = jn_chat_vars(&chat, &e);
    json_decref(msgs);
    json_decref(tools);
    json_decref(kw);
    if (!g_vars) {
        fprintf(stderr, "fuzz_jinja: %s\n", e.msg);
        exit(2);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* an exact-size heap copy: ASan sees any read past the text */
    char *src = malloc(size ? size : 1);
    if (!src) return 0;
    memcpy(src, data, size);
    jn_template *t = NULL;
    jn_error e = {0};
    int rc = jn_parse(src, size, &t, &e);
    free(src);
    if (rc) {
        if (!e.msg[0]) abort(); /* a failure without a message */
        return 0;
    }
    jn_opts o = {.now = 1764979200, .max_output = 1 << 16};
    char *out[2] = {NULL, NULL};
    size_t len[2] = {0, 0};
    int r[2];
    for (int k = 0; k < 2; k++) {
        e = (jn_error){0};
        r[k] = jn_render(t, g_vars, &o, &out[k], &len[k], &e);
        if (r[k] && (!e.msg[0] || out[k])) abort();
        if (!r[k] && (!out[k] || out[k][len[k]] != '\0')) abort();
    }
    if (r[0] != r[1] || (!r[0] && (len[0] != len[1] || memcmp(out[0], out[1], len[0])))) abort();
    free(out[0]);
    free(out[1]);
    jn_template_free(t);
    return 0;
}
