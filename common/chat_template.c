/* chat_template.c: template family detection and rendering (see chat_template.h; follows
 * llama.cpp's llama-chat.cpp for the families it knows). */
#define _GNU_SOURCE /* memmem */
#include "chat_template.h"

#include <stdlib.h>
#include <string.h>

#include "td_err.h"
#include "td_grow.h"

typedef struct {
    char *v;
    size_t n, cap;
    bool oom;
} td_sbuf;

static void sb_add(td_sbuf *b, const char *s, size_t n)
{
    if (b->oom) return;
    if (TD_GROW(b->v, b->cap, b->n + n + 1, 256)) {
        b->oom = true;
        return;
    }
    memcpy(b->v + b->n, s, n);
    b->n += n;
    b->v[b->n] = '\0';
}

static void sb_str(td_sbuf *b, const char *s)
{
    sb_add(b, s, strlen(s));
}

static bool contains(const char *t, size_t n, const char *needle)
{
    return memmem(t, n, needle, strlen(needle)) != NULL;
}

/* The llama2 variants llama.cpp distinguishes. */
typedef struct {
    bool system; /* <<SYS>> blocks */
    bool bos;    /* "<s>" before each later [INST] */
    bool strip;  /* trim message content */
} td_llama2_variant;

static td_chat_family detect(const char *t, size_t n, td_llama2_variant *v)
{
    if (contains(t, n, "<|im_start|>")) {
        /* phi-4 and smolvlm use the marker with another layout */
        if (contains(t, n, "<|im_sep|>") || contains(t, n, "<end_of_utterance>"))
            return TD_CHAT_UNKNOWN;
        return TD_CHAT_CHATML;
    }
    if ((n >= 7 && memcmp(t, "mistral", 7) == 0) || contains(t, n, "[INST]")) {
        /* mistral v1/v3/v7 render differently; not supported */
        if (contains(t, n, "[SYSTEM_PROMPT]") || contains(t, n, "' [INST] ' + system_message") ||
            contains(t, n, "[AVAILABLE_TOOLS]"))
            return TD_CHAT_UNKNOWN;
        td_llama2_variant x = {0};
        if (contains(t, n, "content.strip()")) {
            x.system = x.strip = true;
        } else if (contains(t, n, "bos_token + '[INST]")) {
            x.system = x.bos = true;
        } else if (contains(t, n, "<<SYS>>")) {
            x.system = true;
        }
        if (v) *v = x;
        return TD_CHAT_LLAMA2;
    }
    if (contains(t, n, "<|start_header_id|>") && contains(t, n, "<|end_header_id|>"))
        return TD_CHAT_LLAMA3;
    if (contains(t, n, "<start_of_turn>")) return TD_CHAT_GEMMA;
    return TD_CHAT_UNKNOWN;
}

td_chat_family td_chat_detect(const char *tmpl, size_t tmpl_len)
{
    return tmpl ? detect(tmpl, tmpl_len, NULL) : TD_CHAT_UNKNOWN;
}

/* A literal default system message in a chatml template: the text of a Jinja string
 * literal '<|im_start|>system\n...<|im_end|>' with no expression inside. Returns a
 * malloc'd unescaped copy, or NULL if the template has none. */
static char *default_system(const char *t, size_t n, bool *oom)
{
    static const char head[] = "<|im_start|>system";
    const char *p = t, *end = t + n;
    while ((p = memmem(p, (size_t)(end - p), head, sizeof head - 1)) != NULL) {
        const char *q = p + sizeof head - 1;
        p = q;
        if (q < end && *q == '\n')
            q++;
        else if (end - q >= 2 && q[0] == '\\' && q[1] == 'n')
            q += 2;
        else
            continue;
        const char *e = memmem(q, (size_t)(end - q), "<|im_end|>", 10);
        if (!e) break;
        bool literal = true;
        for (const char *c = q; c < e; c++)
            if (*c == '\'' || *c == '"' || *c == '{' || *c == '}') literal = false;
        if (!literal || e == q) continue;
        td_sbuf b = {0};
        for (const char *c = q; c < e; c++) {
            if (*c == '\\' && c + 1 < e) {
                c++;
                char x = *c == 'n' ? '\n' : *c == 't' ? '\t' : *c;
                sb_add(&b, &x, 1);
            } else {
                sb_add(&b, c, 1);
            }
        }
        if (b.oom) {
            free(b.v);
            *oom = true;
            return NULL;
        }
        return b.v;
    }
    return NULL;
}

/* trim ASCII whitespace at both ends (llama.cpp's trim) */
static void sb_trimmed(td_sbuf *b, const char *s)
{
    size_t n = strlen(s), i = 0;
    while (i < n && strchr(" \t\n\v\f\r", s[i]))
        i++;
    while (n > i && strchr(" \t\n\v\f\r", s[n - 1]))
        n--;
    sb_add(b, s + i, n - i);
}

/* Gemma (as llama.cpp's LLM_CHAT_TEMPLATE_GEMMA renders it): no system role, so system
 * messages are collected (trimmed) and put before the next user turn's text; "assistant" is
 * "model"; contents trimmed; every turn "<start_of_turn>ROLE\n...<end_of_turn>\n". */
static void render_gemma(td_sbuf *b, const td_chat_msg *msgs, size_t n, bool add_generation_prompt)
{
    td_sbuf sys = {0};
    sb_add(&sys, "", 0);
    for (size_t i = 0; i < n; i++) {
        const char *role = msgs[i].role;
        if (strcmp(role, "system") == 0) {
            sb_trimmed(&sys, msgs[i].content);
            continue;
        }
        bool model = strcmp(role, "assistant") == 0;
        sb_str(b, "<start_of_turn>");
        sb_str(b, model ? "model" : role);
        sb_str(b, "\n");
        if (sys.n && !model) {
            sb_str(b, sys.v);
            sb_str(b, "\n\n");
            sys.n = 0;
            sys.v[0] = 0;
        }
        sb_trimmed(b, msgs[i].content);
        sb_str(b, "<end_of_turn>\n");
    }
    if (sys.oom) b->oom = true;
    free(sys.v);
    if (add_generation_prompt) sb_str(b, "<start_of_turn>model\n");
}

/* ---- tools: chatml templates with Qwen2.5's (Hermes-style) tools block ---- */

/* The template's literal pieces, as its source spells them (inside Jinja string literals:
 * \n and \" escaped). A template has tools when it holds every one of them; the rendered
 * text is each piece unescaped. */
enum {
    TK_PRE,
    TK_POST,
    TK_CALL_OPEN,
    TK_CALL_MID,
    TK_CALL_CLOSE,
    TK_RESP_OPEN,
    TK_RESP_CLOSE,
    TK_N
};
static const char *const tools_src[TK_N] = {
    [TK_PRE] = "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
               "query.\\n\\nYou are provided with function signatures within <tools></tools> "
               "XML tags:\\n<tools>",
    [TK_POST] = "\\n</tools>\\n\\nFor each function call, return a json object with function "
                "name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
                "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n"
                "</tool_call><|im_end|>\\n",
    [TK_CALL_OPEN] = "\\n<tool_call>\\n{\"name\": \"",
    [TK_CALL_MID] = "\", \"arguments\": ",
    [TK_CALL_CLOSE] = "}\\n</tool_call>",
    [TK_RESP_OPEN] = "\\n<tool_response>\\n",
    [TK_RESP_CLOSE] = "\\n</tool_response>",
};

/* Unescape a Jinja literal's \n, \t and \" (and \\) into b. */
static void sb_unescaped(td_sbuf *b, const char *s, const char *end)
{
    for (const char *c = s; c < end; c++) {
        if (*c == '\\' && c + 1 < end) {
            c++;
            char x = *c == 'n' ? '\n' : *c == 't' ? '\t' : *c;
            sb_add(b, &x, 1);
        } else {
            sb_add(b, c, 1);
        }
    }
}

static void sb_piece(td_sbuf *b, int k)
{
    sb_unescaped(b, tools_src[k], tools_src[k] + strlen(tools_src[k]));
}

bool td_chat_has_tools(const char *tmpl, size_t tmpl_len)
{
    if (!tmpl || detect(tmpl, tmpl_len, NULL) != TD_CHAT_CHATML) return false;
    for (int k = 0; k < TK_N; k++)
        if (!contains(tmpl, tmpl_len, tools_src[k])) return false;
    bool oom = false;
    char *sys = default_system(tmpl, tmpl_len, &oom);
    free(sys);
    return sys != NULL;
}

static bool needs_tools(const td_chat_msg *msgs, size_t n, size_t n_tools)
{
    if (n_tools) return true;
    for (size_t i = 0; i < n; i++)
        if (msgs[i].n_tool_calls || !strcmp(msgs[i].role, "tool")) return true;
    return false;
}

/* Qwen2.5's template: the system turn (the first system message, else the default) with the
 * tools block when there are tools; assistant tool calls as <tool_call> blocks; runs of
 * "tool" messages as one user turn of <tool_response> blocks. */
static void render_qwen_tools(td_sbuf *b, const char *dflt, const td_chat_msg *msgs, size_t n,
                              const char *const *tools, size_t n_tools, bool gen)
{
    bool first_sys = n > 0 && !strcmp(msgs[0].role, "system");
    sb_str(b, "<|im_start|>system\n");
    sb_str(b, first_sys ? msgs[0].content : dflt);
    if (n_tools) {
        sb_piece(b, TK_PRE);
        for (size_t t = 0; t < n_tools; t++) {
            sb_str(b, "\n");
            sb_str(b, tools[t]);
        }
        sb_piece(b, TK_POST);
    } else {
        sb_str(b, "<|im_end|>\n");
    }
    for (size_t i = 0; i < n; i++) {
        const td_chat_msg *m = &msgs[i];
        bool asst = !strcmp(m->role, "assistant"), tool = !strcmp(m->role, "tool");
        if (!tool && !(asst && m->n_tool_calls)) {
            if (i == 0 && first_sys) continue;
            sb_str(b, "<|im_start|>");
            sb_str(b, m->role);
            sb_str(b, "\n");
            sb_str(b, m->content);
            sb_str(b, "<|im_end|>\n");
        } else if (asst) {
            sb_str(b, "<|im_start|>assistant");
            if (m->content && *m->content) {
                sb_str(b, "\n");
                sb_str(b, m->content);
            }
            for (size_t k = 0; k < m->n_tool_calls; k++) {
                sb_piece(b, TK_CALL_OPEN);
                sb_str(b, m->tool_calls[k].name);
                sb_piece(b, TK_CALL_MID);
                sb_str(b, m->tool_calls[k].arguments);
                sb_piece(b, TK_CALL_CLOSE);
            }
            sb_str(b, "<|im_end|>\n");
        } else {
            if (i == 0 || strcmp(msgs[i - 1].role, "tool")) sb_str(b, "<|im_start|>user");
            sb_piece(b, TK_RESP_OPEN);
            sb_str(b, m->content);
            sb_piece(b, TK_RESP_CLOSE);
            if (i + 1 == n || strcmp(msgs[i + 1].role, "tool")) sb_str(b, "<|im_end|>\n");
        }
    }
    if (gen) sb_str(b, "<|im_start|>assistant\n");
}

static int check_msgs(const td_chat_msg *msgs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const td_chat_msg *m = &msgs[i];
        bool calls = m->n_tool_calls && !strcmp(m->role ? m->role : "", "assistant");
        if (!m->role || (!m->content && !calls) || (m->n_tool_calls && !m->tool_calls)) {
            TD_LOG_ERR("chat: message %zu has no role or content", i);
            return TD_EINVAL;
        }
        for (size_t k = 0; k < m->n_tool_calls; k++)
            if (!m->tool_calls[k].name || !m->tool_calls[k].arguments) {
                TD_LOG_ERR("chat: message %zu tool call %zu has no name or arguments", i, k);
                return TD_EINVAL;
            }
    }
    return 0;
}

int td_chat_render(const char *tmpl, size_t tmpl_len, const td_chat_msg *msgs, size_t n,
                   bool add_generation_prompt, char **out)
{
    return td_chat_render_tools(tmpl, tmpl_len, msgs, n, NULL, 0, add_generation_prompt, out);
}

int td_chat_render_tools(const char *tmpl, size_t tmpl_len, const td_chat_msg *msgs, size_t n,
                         const char *const *tools, size_t n_tools, bool add_generation_prompt,
                         char **out)
{
    if (!out) return TD_EINVAL;
    *out = NULL;
    if (!tmpl || (!msgs && n) || (!tools && n_tools)) return TD_EINVAL;
    int crc = check_msgs(msgs, n);
    if (crc) return crc;
    if (needs_tools(msgs, n, n_tools)) {
        if (!td_chat_has_tools(tmpl, tmpl_len)) {
            TD_LOG_ERR("chat: the chat template does not render tools, tool calls or tool "
                       "messages");
            return TD_EUNSUPP;
        }
        bool oom = false;
        char *dflt = default_system(tmpl, tmpl_len, &oom);
        if (!dflt) return TD_ENOMEM;
        td_sbuf b = {0};
        sb_add(&b, "", 0);
        render_qwen_tools(&b, dflt, msgs, n, tools, n_tools, add_generation_prompt);
        free(dflt);
        if (b.oom) {
            free(b.v);
            return TD_ENOMEM;
        }
        *out = b.v;
        return 0;
    }
    td_llama2_variant v = {0};
    td_chat_family fam = detect(tmpl, tmpl_len, &v);
    td_sbuf b = {0};
    sb_add(&b, "", 0);
    switch (fam) {
    case TD_CHAT_CHATML: {
        bool oom = false;
        char *sys = default_system(tmpl, tmpl_len, &oom);
        if (oom) return TD_ENOMEM;
        if (sys && n > 0 && strcmp(msgs[0].role, "system") != 0) {
            sb_str(&b, "<|im_start|>system\n");
            sb_str(&b, sys);
            sb_str(&b, "<|im_end|>\n");
        }
        free(sys);
        for (size_t i = 0; i < n; i++) {
            sb_str(&b, "<|im_start|>");
            sb_str(&b, msgs[i].role);
            sb_str(&b, "\n");
            sb_str(&b, msgs[i].content);
            sb_str(&b, "<|im_end|>\n");
        }
        if (add_generation_prompt) sb_str(&b, "<|im_start|>assistant\n");
        break;
    }
    case TD_CHAT_LLAMA3:
        for (size_t i = 0; i < n; i++) {
            sb_str(&b, "<|start_header_id|>");
            sb_str(&b, msgs[i].role);
            sb_str(&b, "<|end_header_id|>\n\n");
            sb_trimmed(&b, msgs[i].content);
            sb_str(&b, "<|eot_id|>");
        }
        if (add_generation_prompt) sb_str(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    case TD_CHAT_LLAMA2: {
        /* llama2 ignores add_generation_prompt: a user turn already ends with [/INST] */
        bool inside_turn = true;
        sb_str(&b, "[INST] ");
        for (size_t i = 0; i < n; i++) {
            if (!inside_turn) {
                inside_turn = true;
                sb_str(&b, v.bos ? "<s>[INST] " : "[INST] ");
            }
            const char *role = msgs[i].role;
            if (strcmp(role, "system") == 0) {
                if (v.system) sb_str(&b, "<<SYS>>\n");
                v.strip ? sb_trimmed(&b, msgs[i].content) : sb_str(&b, msgs[i].content);
                sb_str(&b, v.system ? "\n<</SYS>>\n\n" : "\n");
            } else if (strcmp(role, "user") == 0) {
                v.strip ? sb_trimmed(&b, msgs[i].content) : sb_str(&b, msgs[i].content);
                sb_str(&b, " [/INST]");
            } else {
                v.strip ? sb_trimmed(&b, msgs[i].content) : sb_str(&b, msgs[i].content);
                sb_str(&b, "</s>");
                inside_turn = false;
            }
        }
        break;
    }
    case TD_CHAT_GEMMA:
        render_gemma(&b, msgs, n, add_generation_prompt);
        break;
    case TD_CHAT_UNKNOWN:
    default:
        free(b.v);
        TD_LOG_ERR(
            "chat: unsupported chat template (not chatml, llama3, llama2 or gemma): '%.*s%s'",
            tmpl_len > 60 ? 60 : (int)tmpl_len, tmpl, tmpl_len > 60 ? "..." : "");
        return TD_EUNSUPP;
    }
    if (b.oom) {
        free(b.v);
        return TD_ENOMEM;
    }
    *out = b.v;
    return 0;
}
