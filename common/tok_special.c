/* tok_special.c: which tokens are special, decided by their names as llama.cpp's vocabulary
 * loader (llama_vocab::impl::load) decides it: the end-of-turn / end-of-message ids, the
 * end-of-generation set, the control type forced on tokens that look like control tokens
 * (so that raw text never turns into them unless parse_special), and the whitespace some
 * models' special tokens strip. Also the list of special tokens td_tok_encode partitions
 * raw text by. See tok_internal.h. */
#define _GNU_SOURCE /* qsort_r */
#include "tokenizer.h"

#include <stdlib.h>
#include <string.h>

#include "td_err.h"
#include "tok_internal.h"

/* The names below are llama.cpp's (the version vendored by llama-cpp-python 0.3.36), except
 * "</s>" (an end-of-generation name there since paddleocr) and "<reponame>" (a FIM repo
 * name): "</s>" is an ordinary BPE token of Qwen2.5 (id 128247) and a user-defined one of
 * Gemma 3 (id 212), "<reponame>" a control token of SmolLM2; taking them would change where
 * those models stop and what their prompts tokenize to, so they keep the types their files
 * give them. U+FF5C and U+2581 are spelled as UTF-8 escapes. */
#define FW_BAR "\xef\xbd\x9c" /* U+FF5C, DeepSeek's fullwidth bar */
#define SPM_SP "\xe2\x96\x81" /* U+2581 */

static const char *const eot_names[] = {"<|eot_id|>",
                                        "<|im_end|>",
                                        "<|end|>",
                                        "<end_of_turn>",
                                        "<|endoftext|>",
                                        "<|end_of_text|>",
                                        "<EOT>",
                                        "_<EOT>",
                                        "[EOT]",
                                        "<" FW_BAR "end" SPM_SP "of" SPM_SP "sentence" FW_BAR ">",
                                        "<end_of_utterance>",
                                        NULL};
static const char *const eom_names[] = {"<|eom_id|>", NULL};
static const char *const eog_names[] = {"<|eot_id|>",
                                        "<|im_end|>",
                                        "<|end|>",
                                        "<|return|>",
                                        "<|call|>",
                                        "<|flush|>",
                                        "<|calls|>",
                                        "<end_of_turn>",
                                        "<|endoftext|>",
                                        "<|eom_id|>",
                                        "<EOT>",
                                        "_<EOT>",
                                        "[EOT]",
                                        "[EOS]",
                                        "<|end_of_text|>",
                                        "<end_of_utterance>",
                                        "<eos>",
                                        "<turn|>",
                                        "<|tool_response>",
                                        "<" FW_BAR "end" SPM_SP "of" SPM_SP "sentence" FW_BAR ">",
                                        "[e~[",
                                        NULL};
/* fill-in-the-middle prefix / suffix / middle: control */
static const char *const fim_names[] = {"<|fim_prefix|>",
                                        "<fim-prefix>",
                                        "<fim_prefix>",
                                        "<" FW_BAR "fim" SPM_SP "begin" FW_BAR ">",
                                        "<PRE>",
                                        SPM_SP "<PRE>",
                                        "<|code_prefix|>",
                                        "<|prefix|>",
                                        "<|fim_suffix|>",
                                        "<fim-suffix>",
                                        "<fim_suffix>",
                                        "<" FW_BAR "fim" SPM_SP "hole" FW_BAR ">",
                                        "<SUF>",
                                        SPM_SP "<SUF>",
                                        "<|code_suffix|>",
                                        "<|suffix|>",
                                        "<|fim_middle|>",
                                        "<fim-middle>",
                                        "<fim_middle>",
                                        "<" FW_BAR "fim" SPM_SP "end" FW_BAR ">",
                                        "<MID>",
                                        SPM_SP "<MID>",
                                        "<|code_middle|>",
                                        "<|middle|>",
                                        NULL};
/* fill-in-the-middle pad / repo / file separator: control, and they end generation */
static const char *const fim_eog_names[] = {
    "<|fim_pad|>",   "<fim-pad>",  "<fim_pad>", "<PAD>",        "[PAD]", "<|fim_repo|>",
    "<|repo_name|>", "<fim-repo>", "<REPO>",    "<|file_sep|>", NULL};
/* gpt-oss: always rendered, so user-defined whatever the file says */
static const char *const harmony_user[] = {"<|channel|>", "<|message|>", "<|start|>",
                                           "<|constrain|>", NULL};

static bool str_eq(const char *s, size_t n, const char *lit)
{
    return strlen(lit) == n && memcmp(s, lit, n) == 0;
}

static bool text_in(const char *s, size_t n, const char *const *list)
{
    for (; *list; list++)
        if (str_eq(s, n, *list)) return true;
    return false;
}

static int32_t id_of(const td_tokenizer *t, const char *text)
{
    return td_strmap_get(&t->tok_map, text, strlen(text));
}

static void force_control(td_tokenizer *t, int32_t i)
{
    if (t->type[i] == TD_TOKTYPE_CONTROL) return;
    TD_LOG_WARN("tokenizer: control-looking token %d '%.*s' was not control-type; treating it "
                "as control",
                i, (int)t->text_len[i], t->text[i]);
    t->type[i] = TD_TOKTYPE_CONTROL;
}

/* The end-of-generation set and the control types, by name. */
static void mark_by_name(td_tokenizer *t, const td_gguf *g)
{
    int32_t n = t->n_vocab;
    t->eot = td_tok_key_id(g, "tokenizer.ggml.eot_token_id", -1, n);
    t->eom = td_tok_key_id(g, "tokenizer.ggml.eom_token_id", -1, n);
    bool eot_given = t->eot >= 0, eom_given = t->eom >= 0;
    for (int32_t i = 0; i < n; i++) {
        /* only the id the text map resolves to counts, as llama.cpp iterates token_to_id */
        if (td_strmap_get(&t->tok_map, t->text[i], t->text_len[i]) != i) continue;
        const char *s = t->text[i];
        size_t len = t->text_len[i];
        bool is_eot = !eot_given && text_in(s, len, eot_names);
        bool is_eom = !eom_given && text_in(s, len, eom_names);
        bool is_eog =
            text_in(s, len, eog_names) || text_in(s, len, fim_eog_names) || is_eot || is_eom;
        if (is_eot && t->eot < 0) t->eot = i;
        if (is_eom && t->eom < 0) t->eom = i;
        if (is_eog || text_in(s, len, fim_names)) force_control(t, i);
        if (is_eog) t->eog[i] = 1;
        if (text_in(s, len, harmony_user)) t->type[i] = TD_TOKTYPE_USER_DEFINED;
    }
    if (t->eos >= 0) t->eog[t->eos] = 1;
    if (t->eot >= 0) t->eog[t->eot] = 1;
    if (t->eom >= 0) t->eog[t->eom] = 1;
}

static bool is_eog_named(const td_tokenizer *t, const char *text)
{
    int32_t id = id_of(t, text);
    return id >= 0 && t->eog[id];
}

/* o200k_harmony (gpt-oss) and solar-open end a turn with <|return|> / <|call|> / <|calls|>
 * / <|flush|>; their <|end|> only ends a message, so it is no end of generation there. */
static void harmony_end(td_tokenizer *t)
{
    bool has_call = is_eog_named(t, "<|call|>") || is_eog_named(t, "<|calls|>");
    bool has_return = is_eog_named(t, "<|return|>"), has_flush = is_eog_named(t, "<|flush|>");
    int32_t end = id_of(t, "<|end|>");
    if (end < 0 || !t->eog[end] || !has_call || !(has_return || has_flush)) return;
    t->eog[end] = 0;
    t->type[end] = TD_TOKTYPE_USER_DEFINED;
}

static bool is_special_type(uint8_t ty)
{
    return ty == TD_TOKTYPE_CONTROL || ty == TD_TOKTYPE_USER_DEFINED || ty == TD_TOKTYPE_UNKNOWN;
}

static char ascii_lower(char c)
{
    return c >= 'A' && c <= 'Z' ? (char)(c + 32) : c;
}

/* The string under key contains needle (lowercased first if lower). */
static bool key_contains(const td_gguf *g, const char *key, const char *needle, bool lower)
{
    const char *s;
    size_t n, k = strlen(needle);
    if (td_gguf_get_str(g, key, &s, &n) != 0) return false;
    for (size_t i = 0; i + k <= n; i++) {
        size_t j = 0;
        while (j < k && (lower ? ascii_lower(s[i + j]) : s[i + j]) == needle[j])
            j++;
        if (j == k) return true;
    }
    return false;
}

static void set_strip(td_tokenizer *t, const char *text, uint8_t bit, bool on)
{
    int32_t id = id_of(t, text);
    if (id < 0) return;
    t->strip[id] = on ? (uint8_t)(t->strip[id] | bit) : (uint8_t)(t->strip[id] & ~bit);
}

/* llama.cpp's per-model token attributes, chosen by tokenizer.ggml.pre, general.architecture
 * or the lowercased general.name: a <mask> that swallows the spaces before it (jina v2,
 * nomic-bert-moe, jina-bert-v3; [MASK] of modern-bert), Phi-3's special tokens the ones
 * after them. */
static void strip_attributes(td_tokenizer *t, const td_gguf *g)
{
    const char *pre = "tokenizer.ggml.pre", *arch = "general.architecture";
    if (key_contains(g, pre, "jina-v2-de", false) || key_contains(g, pre, "jina-v2-es", false) ||
        key_contains(g, pre, "jina-v2-code", false) ||
        key_contains(g, arch, "nomic-bert-moe", false) ||
        key_contains(g, arch, "jina-bert-v3", false)) {
        set_strip(t, "<mask>", TD_STRIP_LEFT, true);
    } else if (key_contains(g, "general.name", "phi-3", true) ||
               key_contains(g, "general.name", "phi3", true)) {
        for (int32_t i = 0; i < t->n_vocab; i++)
            if (is_special_type(t->type[i])) t->strip[i] |= TD_STRIP_RIGHT;
        set_strip(t, "</s>", TD_STRIP_RIGHT, true);
        set_strip(t, "<unk>", TD_STRIP_RIGHT, false);
        set_strip(t, "<s>", TD_STRIP_RIGHT, false);
        set_strip(t, "<|endoftext|>", TD_STRIP_RIGHT, false);
    } else if (key_contains(g, "general.name", "modern-bert", true)) {
        set_strip(t, "[MASK]", TD_STRIP_LEFT, true);
    }
}

int td_tok_find_specials(td_tokenizer *t, const td_gguf *g)
{
    mark_by_name(t, g);
    harmony_end(t);
    strip_attributes(t, g);
    return 0;
}

static int cmp_special(const void *a, const void *b, void *ctx)
{
    const td_tokenizer *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (t->text_len[x] != t->text_len[y]) return t->text_len[x] > t->text_len[y] ? -1 : 1;
    return x < y ? -1 : x > y;
}

int td_tok_collect_specials(td_tokenizer *t)
{
    size_t ns = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        ns += is_special_type(t->type[i]);
    t->special = malloc((ns ? ns : 1) * sizeof *t->special);
    if (!t->special) return TD_ENOMEM;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if (is_special_type(t->type[i])) t->special[t->n_special++] = i;
    qsort_r(t->special, t->n_special, sizeof *t->special, cmp_special, t);
    return 0;
}
