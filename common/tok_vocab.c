/* tok_vocab.c: building a tokenizer from a GGUF file: the vocabulary, merges, token
 * types and scores, the special tokens and each token's bytes (see tokenizer.h; follows
 * llama-vocab.cpp's load). Encoding is in tokenizer.c, decoding in tok_decode.c. */
#define _GNU_SOURCE /* qsort_r */
#include "tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"
#include "tok_internal.h"
#include "td_grow.h"

/* ---- hash map ---- */

static uint64_t td_hash(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    return h;
}

int td_strmap_init(td_strmap *m, size_t n_expected)
{
    size_t cap = 16;
    while (cap < 2 * n_expected + 16)
        cap *= 2;
    m->key = calloc(cap, sizeof *m->key);
    m->klen = calloc(cap, sizeof *m->klen);
    m->val = calloc(cap, sizeof *m->val);
    m->cap = cap;
    m->n = 0;
    return m->key && m->klen && m->val ? 0 : TD_ENOMEM;
}

void td_strmap_fini(td_strmap *m)
{
    free(m->key);
    free(m->klen);
    free(m->val);
    *m = (td_strmap){0};
}

/* Insert or overwrite. The map never fills: capacity is fixed at >= 2x the entries. */
void td_strmap_put(td_strmap *m, const char *k, size_t n, int32_t v)
{
    size_t i = td_hash(k, n) & (m->cap - 1);
    while (m->key[i]) {
        if (m->klen[i] == n && memcmp(m->key[i], k, n) == 0) {
            m->val[i] = v;
            return;
        }
        i = (i + 1) & (m->cap - 1);
    }
    m->key[i] = k;
    m->klen[i] = (uint32_t)n;
    m->val[i] = v;
    m->n++;
}

int32_t td_strmap_get(const td_strmap *m, const char *k, size_t n)
{
    if (!m->cap) return -1;
    size_t i = td_hash(k, n) & (m->cap - 1);
    while (m->key[i]) {
        if (m->klen[i] == n && memcmp(m->key[i], k, n) == 0) return m->val[i];
        i = (i + 1) & (m->cap - 1);
    }
    return -1;
}

/* ---- growable bytes ---- */

int td_bytes_reserve(td_bytes *b, size_t extra)
{
    return TD_GROW(b->v, b->cap, b->n + extra, 256);
}

int td_bytes_add(td_bytes *b, const void *s, size_t n)
{
    if (n == 0) return 0;
    if (td_bytes_reserve(b, n)) return TD_ENOMEM;
    memcpy(b->v + b->n, s, n);
    b->n += n;
    return 0;
}

/* ---- loading ---- */

static void byte_level_tables(td_tokenizer *t)
{
    /* GPT-2 bytes_to_unicode: printable latin-1 bytes map to themselves, the other 68 to
     * U+0100.. in byte order */
    int n = 0;
    for (int i = 0; i < 0x144; i++)
        t->byte_dec[i] = -1;
    for (int b = 0; b < 256; b++) {
        bool keep = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        uint32_t cpt = keep ? (uint32_t)b : 256u + (uint32_t)n++;
        uint8_t buf[4];
        size_t len = td_utf8_encode(cpt, buf);
        memcpy(t->byte_enc[b], buf, len);
        t->byte_enc_len[b] = (uint8_t)len;
        t->byte_dec[cpt] = (int16_t)b;
    }
}

static bool str_eq(const char *s, size_t n, const char *lit)
{
    return strlen(lit) == n && memcmp(s, lit, n) == 0;
}

/* tokenizer.ggml.pre values we implement, with llama.cpp's flags for each (llama_vocab::
 * impl::load): clean_spaces (BPE's default is on), add_bos, ignore_merges. */
typedef struct {
    const char *name;
    td_pre_kind kind;
    bool clean_spaces, add_bos, ignore_merges;
} td_pre_entry;

static const td_pre_entry pre_table[] = {
    {"default", TD_PRE_DEFAULT, true, false, false},
    {"smollm", TD_PRE_SMOLLM, false, false, false},
    {"starcoder", TD_PRE_SMOLLM, true, false, false},
    {"refact", TD_PRE_SMOLLM, true, false, false},
    {"command-r", TD_PRE_SMOLLM, false, false, false},
    {"codeshell", TD_PRE_SMOLLM, true, false, false},
    {"exaone", TD_PRE_SMOLLM, true, false, false},
    {"minerva-7b", TD_PRE_SMOLLM, true, false, false},
    {"mellum2", TD_PRE_SMOLLM, true, false, false},
    {"gpt-2", TD_PRE_GPT2, true, false, false},
    {"phi-2", TD_PRE_GPT2, true, false, false},
    {"jina-es", TD_PRE_GPT2, true, false, false},
    {"jina-de", TD_PRE_GPT2, true, false, false},
    {"jina-v2-es", TD_PRE_GPT2, true, false, false},
    {"jina-v2-de", TD_PRE_GPT2, true, false, false},
    {"jina-v1-en", TD_PRE_GPT2, true, false, false},
    {"jina-v2-code", TD_PRE_GPT2, true, false, false},
    {"gigachat", TD_PRE_GPT2, true, false, false},
    {"a.x-4.0", TD_PRE_GPT2, true, false, false},
    {"mellum", TD_PRE_GPT2, true, false, false},
    {"modern-bert", TD_PRE_GPT2, true, false, false},
    {"roberta-bpe", TD_PRE_GPT2, true, false, false},
    {"mpt", TD_PRE_GPT2, true, false, false},
    {"olmo", TD_PRE_GPT2, true, false, false},
    {"jais", TD_PRE_GPT2, true, false, false},
    {"exaone4", TD_PRE_GPT2, true, false, false},
    {"trillion", TD_PRE_GPT2, false, false, false},
    {"granite-docling", TD_PRE_GPT2, false, false, false},
    {"falcon", TD_PRE_FALCON, true, false, false},
    {"llama3", TD_PRE_LLAMA3, true, true, true},
    {"llama-v3", TD_PRE_LLAMA3, true, true, true},
    {"llama-bpe", TD_PRE_LLAMA3, true, true, true},
    {"falcon3", TD_PRE_LLAMA3, true, true, true},
    {"falcon-h1", TD_PRE_LLAMA3, true, true, true},
    {"pixtral", TD_PRE_LLAMA3, true, true, true},
    {"midm-2.0", TD_PRE_LLAMA3, true, true, true},
    {"lfm2", TD_PRE_LLAMA3, true, true, true},
    {"jina-v5-nano", TD_PRE_LLAMA3, true, true, true},
    {"dbrx", TD_PRE_LLAMA3, true, false, false},
    {"smaug-bpe", TD_PRE_LLAMA3, true, false, false},
    {"qwen2", TD_PRE_QWEN2, false, false, false},
    {"deepseek-r1-qwen", TD_PRE_QWEN2, false, false, false},
    {"kormo", TD_PRE_QWEN2, false, false, false},
    {"f2llmv2", TD_PRE_QWEN2, false, false, false},
    {"hunyuan", TD_PRE_QWEN2, false, false, false},
    {"solar-open", TD_PRE_QWEN2, false, false, false},
    {"grok-2", TD_PRE_QWEN2, false, false, false},
    {"stablelm2", TD_PRE_QWEN2, true, false, false},
    {"megrez", TD_PRE_QWEN2, true, false, false},
    {"qwen35", TD_PRE_QWEN35, false, false, false},
    {"deepseek-llm", TD_PRE_DEEPSEEK_LLM, false, false, false},
    {"deepseek-coder", TD_PRE_DEEPSEEK_CODER, false, false, false},
    {"gemma4", TD_PRE_NEWLINES, true, false, false},
    {"granite-embed-multi-311m", TD_PRE_NEWLINES, true, false, false},
};

int32_t td_tok_key_id(const td_gguf *g, const char *key, int32_t def, int32_t n_vocab)
{
    int64_t v;
    if (td_gguf_get_i64(g, key, &v) != 0) return def;
    if (v < 0 || v >= n_vocab) {
        TD_LOG_WARN("tokenizer: bad special token %s = %lld, using default id %d", key,
                    (long long)v, def);
        return def;
    }
    return (int32_t)v;
}

static bool get_bool_key(const td_gguf *g, const char *key, bool def)
{
    bool v;
    return td_gguf_get_bool(g, key, &v) == 0 ? v : def;
}

/* Bytes of a normal token: BPE maps each codepoint back through the byte-level table,
 * spm turns U+2581 into a space and <0xXX> into its byte. */
static int make_piece(td_tokenizer *t, int32_t id, td_bytes *out)
{
    const char *s = t->text[id];
    size_t n = t->text_len[id];
    uint8_t ty = t->type[id];
    if (ty == TD_TOKTYPE_CONTROL || ty == TD_TOKTYPE_UNKNOWN || ty == TD_TOKTYPE_USER_DEFINED)
        return td_bytes_add(out, s, n);
    /* SentencePiece-style texts: U+2581 for a space, <0xXX> for a byte (spm, WordPiece as
     * converted, gemma4's BPE) */
    if (t->kind != TD_VOCAB_BPE || !t->byte_encode) {
        if (ty == TD_TOKTYPE_BYTE) {
            if (n == 6 && s[0] == '<' && s[1] == '0' && s[2] == 'x') {
                char hex[3] = {s[3], s[4], 0};
                char c = (char)strtol(hex, NULL, 16);
                return td_bytes_add(out, &c, 1);
            }
            return 0;
        }
        if (ty != TD_TOKTYPE_NORMAL) return 0;
        for (size_t i = 0; i < n;) {
            if (i + 3 <= n && memcmp(s + i, "\xe2\x96\x81", 3) == 0) {
                if (td_bytes_add(out, " ", 1)) return TD_ENOMEM;
                i += 3;
            } else {
                if (td_bytes_add(out, s + i, 1)) return TD_ENOMEM;
                i++;
            }
        }
        return 0;
    }
    if (ty != TD_TOKTYPE_NORMAL) return 0;
    for (size_t i = 0; i < n;) {
        size_t k;
        uint32_t cpt = td_utf8_decode((const uint8_t *)s + i, n - i, &k);
        if (cpt < 0x144 && t->byte_dec[cpt] >= 0) {
            char c = (char)t->byte_dec[cpt];
            if (td_bytes_add(out, &c, 1)) return TD_ENOMEM;
        } else {
            /* as llama_decode_text: a char outside the byte alphabet is kept visible */
            char tmp[32];
            int m = snprintf(tmp, sizeof tmp, "[UNK_BYTE_0x");
            if (td_bytes_add(out, tmp, (size_t)m)) return TD_ENOMEM;
            for (size_t j = 0; j < k; j++) {
                m = snprintf(tmp, sizeof tmp, "%02x", (uint8_t)s[i + j]);
                if (td_bytes_add(out, tmp, (size_t)m)) return TD_ENOMEM;
            }
            if (td_bytes_add(out, s, n) || td_bytes_add(out, "]", 1)) return TD_ENOMEM;
        }
        i += k;
    }
    return 0;
}

/* The per-token arrays, (n) each. */
static int alloc_vocab(td_tokenizer *t, size_t n)
{
    t->text = calloc(n, sizeof *t->text);
    t->text_len = calloc(n, sizeof *t->text_len);
    t->piece = calloc(n, sizeof *t->piece);
    t->piece_len = calloc(n, sizeof *t->piece_len);
    t->type = calloc(n, 1);
    t->score = calloc(n, sizeof *t->score);
    t->eog = calloc(n, 1);
    t->strip = calloc(n, 1);
    if (!t->text || !t->text_len || !t->piece || !t->piece_len || !t->type || !t->score ||
        !t->eog || !t->strip)
        return TD_ENOMEM;
    return 0;
}

/* The n token texts, then the nm merges, back to back into t->pool; off (n + nm + 1) gets
 * where each starts (offsets, not pointers: the pool moves while it grows). */
static int load_strings(td_tokenizer *t, const td_gguf *g, size_t n, size_t nm, size_t *off)
{
    td_bytes pool = {0};
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        const char *s;
        size_t len;
        rc = td_gguf_arr_str(g, "tokenizer.ggml.tokens", i, &s, &len);
        if (rc) break;
        off[i] = pool.n;
        if (len == 0) {
            char tmp[40];
            int m = snprintf(tmp, sizeof tmp, "[EMPTY_%zu]", i);
            TD_LOG_WARN("tokenizer: empty token at index %zu", i);
            rc = td_bytes_add(&pool, tmp, (size_t)m);
            t->text_len[i] = (uint32_t)m;
        } else if (len > UINT32_MAX / 4) {
            rc = TD_EFORMAT;
        } else {
            rc = td_bytes_add(&pool, s, len);
            t->text_len[i] = (uint32_t)len;
        }
    }
    for (size_t i = 0; i < nm && !rc; i++) {
        const char *s;
        size_t len;
        rc = td_gguf_arr_str(g, "tokenizer.ggml.merges", i, &s, &len);
        if (!rc) {
            off[n + i] = pool.n;
            rc = td_bytes_add(&pool, s, len);
        }
    }
    off[n + nm] = pool.n;
    if (rc) {
        free(pool.v);
        if (rc != TD_ENOMEM) TD_LOG_ERR("tokenizer: bad token or merge string");
        return rc;
    }
    t->pool = pool.v;
    return 0;
}

/* Token types and scores (optional arrays; a wrong length is a format error). */
static int load_types_scores(td_tokenizer *t, const td_gguf *g, size_t n)
{
    td_gguf_vtype et;
    size_t na;
    int rc = 0;
    for (size_t i = 0; i < n; i++)
        t->type[i] = TD_TOKTYPE_NORMAL;
    if (td_gguf_get_arr(g, "tokenizer.ggml.token_type", &et, &na) == 0) {
        int32_t *tt = malloc(n * sizeof *tt);
        if (!tt)
            rc = TD_ENOMEM;
        else if (na != n || td_gguf_arr_read_i32(g, "tokenizer.ggml.token_type", tt, n) != 0)
            rc = TD_EFORMAT;
        for (size_t i = 0; !rc && i < n; i++)
            t->type[i] = tt[i] >= 0 && tt[i] <= 6 ? (uint8_t)tt[i] : TD_TOKTYPE_UNDEFINED;
        free(tt);
    }
    if (!rc && td_gguf_get_arr(g, "tokenizer.ggml.scores", &et, &na) == 0) {
        if (na != n || td_gguf_arr_read_f32(g, "tokenizer.ggml.scores", t->score, n) != 0)
            rc = TD_EFORMAT;
    }
    if (rc == TD_EFORMAT)
        TD_LOG_ERR("tokenizer: token_type/scores arrays do not match %zu tokens", n);
    return rc;
}

/* Now that the pool stays put: the text pointers, text -> id and "left right" -> rank. */
static int build_maps(td_tokenizer *t, size_t n, size_t nm, const size_t *off)
{
    int rc = td_strmap_init(&t->tok_map, n);
    if (!rc && nm) rc = td_strmap_init(&t->merge_map, nm);
    if (rc) return rc;
    for (size_t i = 0; i < n; i++) {
        t->text[i] = t->pool + off[i];
        td_strmap_put(&t->tok_map, t->text[i], t->text_len[i], (int32_t)i);
        if (t->text_len[i] > t->max_token_len) t->max_token_len = t->text_len[i];
    }
    for (size_t i = 0; i < nm; i++) {
        const char *s = t->pool + off[n + i];
        size_t len = off[n + i + 1] - off[n + i];
        /* llama.cpp splits at the first space after position 0; a merge without one
         * has an empty pair, which never matches */
        const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        if (!sp) continue;
        /* keep the first rank of a duplicated merge, like emplace */
        if (td_strmap_get(&t->merge_map, s, len) < 0)
            td_strmap_put(&t->merge_map, s, len, (int32_t)i);
    }
    return 0;
}

/* Tokens, merges (BPE), types and scores, and the maps over them. */
static int load_vocab(td_tokenizer *t, const td_gguf *g)
{
    td_gguf_vtype et;
    size_t n;
    if (td_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n) != 0 || et != TD_GGUF_STRING ||
        n == 0 || n > INT32_MAX / 2) {
        TD_LOG_ERR("tokenizer: tokenizer.ggml.tokens missing or not a string array");
        return TD_EFORMAT;
    }
    t->n_vocab = (int32_t)n;
    size_t nm = 0;
    if (t->kind == TD_VOCAB_BPE) {
        if (td_gguf_get_arr(g, "tokenizer.ggml.merges", &et, &nm) != 0 || et != TD_GGUF_STRING) {
            TD_LOG_ERR("tokenizer: tokenizer.ggml.merges missing or not a string array");
            return TD_EFORMAT;
        }
    }
    if (alloc_vocab(t, n)) return TD_ENOMEM;
    size_t *off = malloc((n + nm + 1) * sizeof *off);
    if (!off) return TD_ENOMEM;
    int rc = load_strings(t, g, n, nm, off);
    if (!rc) rc = load_types_scores(t, g, n);
    if (!rc) rc = build_maps(t, n, nm, off);
    free(off);
    return rc;
}

/* A BPE vocabulary's pre-tokenizer (tokenizer.ggml.pre; llama.cpp's "default" where it is
 * missing) and the flags that go with it. */
static int choose_pre(td_tokenizer *t, const char *pre, size_t pre_len)
{
    if (!pre) {
        TD_LOG_WARN("tokenizer: tokenizer.ggml.pre missing, using llama.cpp's 'default' "
                    "pre-tokenizer (as llama.cpp does; the model's own may differ)");
        pre = "default", pre_len = 7;
    }
    const td_pre_entry *e = NULL;
    for (size_t i = 0; i < sizeof pre_table / sizeof pre_table[0]; i++)
        if (str_eq(pre, pre_len, pre_table[i].name)) e = &pre_table[i];
    if (!e) {
        TD_LOG_ERR("tokenizer: unsupported pre-tokenizer '%.*s' (tokenizer.ggml.pre) for a BPE "
                   "vocabulary; supported: default, gpt-2, mpt, falcon, starcoder, refact, "
                   "smollm, command-r, llama3/llama-bpe, qwen2, qwen35, deepseek-llm, "
                   "deepseek-coder, gemma4 and their aliases",
                   (int)(pre_len < 64 ? pre_len : 64), pre);
        return TD_EUNSUPP;
    }
    snprintf(t->pre_name, sizeof t->pre_name, "%s", e->name);
    t->pre = e->kind;
    t->clean_spaces = e->clean_spaces;
    t->add_bos = e->add_bos;
    t->ignore_merges = e->ignore_merges;
    /* gemma4's BPE is SentencePiece-style: spaces as U+2581, raw UTF-8, <0xXX> bytes */
    t->escape_ws = e->kind == TD_PRE_NEWLINES;
    t->byte_encode = !t->escape_ws;
    if (t->byte_encode) byte_level_tables(t);
    return 0;
}

/* The tokenizer model and its defaults: gpt2 and gemma4 (BPE, with a pre-tokenizer of
 * pre_table), llama (SentencePiece), bert (WordPiece) or t5 (Unigram). */
static int choose_model(td_tokenizer *t, const td_gguf *g)
{
    const char *model, *pre = NULL;
    size_t model_len, pre_len = 0;
    if (td_gguf_get_str(g, "tokenizer.ggml.model", &model, &model_len) != 0) {
        TD_LOG_ERR("tokenizer: tokenizer.ggml.model missing");
        return TD_EFORMAT;
    }
    if (td_gguf_get_str(g, "tokenizer.ggml.pre", &pre, &pre_len) != 0) pre = NULL;
    t->sep = -1;
    snprintf(t->pre_name, sizeof t->pre_name, "none");
    if (str_eq(model, model_len, "gpt2") || str_eq(model, model_len, "gemma4")) {
        t->kind = TD_VOCAB_BPE;
        if (str_eq(model, model_len, "gemma4")) /* llama.cpp ignores the file's pre here */
            pre = "gemma4", pre_len = 6, t->bos = t->eos = t->unk = -1;
        else
            t->bos = 11, t->eos = 11, t->unk = -1;
        int rc = choose_pre(t, pre, pre_len);
        if (rc) return rc;
    } else if (str_eq(model, model_len, "llama")) {
        t->kind = TD_VOCAB_SPM;
        t->pre = TD_PRE_NONE;
        t->add_bos = true;
        t->add_space_prefix = true;
        t->bos = 1, t->eos = 2, t->unk = 0;
    } else if (str_eq(model, model_len, "bert")) {
        t->kind = TD_VOCAB_WPM;
        t->pre = TD_PRE_NONE;
        t->add_bos = true, t->add_sep = true, t->clean_spaces = true;
        t->bos = 101, t->eos = -1, t->unk = 100, t->sep = 102;
    } else if (str_eq(model, model_len, "t5")) {
        /* add_space_prefix stays off unless the file says so, as llama.cpp leaves it */
        t->kind = TD_VOCAB_UGM;
        t->pre = TD_PRE_NONE;
        t->add_eos = true;
        t->bos = -1, t->eos = 1, t->unk = 2;
    } else {
        TD_LOG_ERR("tokenizer: unsupported tokenizer model '%.*s' (tokenizer.ggml.model; "
                   "supported: gpt2, gemma4 (BPE), llama (SentencePiece), bert (WordPiece), t5 "
                   "(Unigram))",
                   (int)(model_len < 64 ? model_len : 64), model);
        return TD_EUNSUPP;
    }
    t->add_space_prefix = get_bool_key(g, "tokenizer.ggml.add_space_prefix", t->add_space_prefix);
    return 0;
}

/* bos / eos / unk: the model's defaults unless the file names them (ids in the vocabulary);
 * add_bos / add_eos only with a token to add. */
static void special_ids(td_tokenizer *t, const td_gguf *g)
{
    int32_t n = t->n_vocab;
    if (t->bos >= n) t->bos = -1;
    if (t->eos >= n) t->eos = -1;
    if (t->unk >= n) t->unk = -1;
    t->bos = td_tok_key_id(g, "tokenizer.ggml.bos_token_id", t->bos, n);
    t->eos = td_tok_key_id(g, "tokenizer.ggml.eos_token_id", t->eos, n);
    t->unk = td_tok_key_id(g, "tokenizer.ggml.unknown_token_id", t->unk, n);
    if (t->sep >= n) t->sep = -1;
    t->sep = td_tok_key_id(g, "tokenizer.ggml.seperator_token_id", t->sep, n); /* sic */
    t->add_bos = get_bool_key(g, "tokenizer.ggml.add_bos_token", t->add_bos);
    t->add_eos = get_bool_key(g, "tokenizer.ggml.add_eos_token", t->add_eos);
    if (t->pre == TD_PRE_NEWLINES) t->add_bos = true; /* llama.cpp#21500: Gemma 4 needs BOS */
    if (t->add_bos && t->bos < 0) t->add_bos = false;
    if (t->add_eos && t->eos < 0) t->add_eos = false;
    if (t->add_sep && t->sep < 0) t->add_sep = false;
    /* WordPiece's BertNormalizer: strip_accents follows lowercase unless given */
    t->wpm_lowercase = get_bool_key(g, "tokenizer.ggml.normalizer.lowercase", true);
    t->wpm_strip_accents =
        get_bool_key(g, "tokenizer.ggml.normalizer.strip_accents", t->wpm_lowercase);
}

/* Every token's bytes, decoded once (after find_specials' type overrides) into one buffer
 * that hangs off piece[0] (td_tok_destroy frees it). */
static int build_pieces(td_tokenizer *t)
{
    int32_t n = t->n_vocab;
    td_bytes pieces = {0};
    size_t *poff = malloc(((size_t)n + 1) * sizeof *poff);
    int rc = poff ? 0 : TD_ENOMEM;
    for (int32_t i = 0; !rc && i < n; i++) {
        poff[i] = pieces.n;
        rc = make_piece(t, i, &pieces);
        t->piece_len[i] = (uint32_t)(pieces.n - poff[i]);
    }
    if (!rc && td_bytes_reserve(&pieces, 1)) rc = TD_ENOMEM;
    if (rc) {
        free(poff);
        free(pieces.v);
        return rc;
    }
    for (int32_t i = 0; i < n; i++)
        t->piece[i] = pieces.v + poff[i];
    free(poff);
    return 0;
}

/* spm and gemma4: the token of each byte, <0xXX> (spm: or else the 1-byte text). */
static void byte_tokens(td_tokenizer *t)
{
    static const char hex[] = "0123456789ABCDEF";
    for (int b = 0; b < 256; b++) {
        char buf[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
        int32_t id = td_strmap_get(&t->tok_map, buf, 6);
        if (id < 0 && t->kind == TD_VOCAB_SPM) {
            char c = (char)b;
            id = td_strmap_get(&t->tok_map, &c, 1);
        }
        t->byte_tok[b] = id;
    }
}

int td_tok_create(const td_gguf *g, td_tokenizer **out)
{
    if (!out) return TD_EINVAL;
    *out = NULL;
    if (!g) return TD_EINVAL;
    td_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return TD_ENOMEM;
    int rc = choose_model(t, g);
    if (!rc) rc = load_vocab(t, g);
    if (!rc) {
        special_ids(t, g);
        rc = td_tok_find_specials(t, g);
        if (!rc) rc = build_pieces(t);
        if (!rc && t->kind == TD_VOCAB_UGM) rc = td_ugm_load(t, g); /* types are final */
    }
    if (!rc) rc = td_tok_collect_specials(t);
    if (rc) {
        td_tok_destroy(t);
        return rc;
    }
    if (t->kind == TD_VOCAB_SPM || (t->kind == TD_VOCAB_BPE && !t->byte_encode)) byte_tokens(t);
    *out = t;
    return 0;
}

void td_tok_destroy(td_tokenizer *t)
{
    if (!t) return;
    if (t->piece && t->n_vocab > 0) free((void *)t->piece[0]);
    free(t->pool);
    free(t->text);
    free(t->text_len);
    free(t->piece);
    free(t->piece_len);
    free(t->type);
    free(t->score);
    free(t->eog);
    free(t->strip);
    free(t->special);
    td_strmap_fini(&t->tok_map);
    td_strmap_fini(&t->merge_map);
    td_ugm_fini(&t->ugm);
    free(t);
}
