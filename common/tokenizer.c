/* tokenizer.c: vocabulary loading, special-token partition, byte-level BPE and
 * SentencePiece encoding (see tokenizer.h; follows llama-vocab.cpp; decoding is in
 * tok_decode.c). */
#define _GNU_SOURCE /* memmem, qsort_r */
#include "tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"
#include "tok_internal.h"

/* ---- hash map ---- */

static uint64_t td_hash(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    return h;
}

static int strmap_init(td_strmap *m, size_t n_expected)
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

static void strmap_fini(td_strmap *m)
{
    free(m->key);
    free(m->klen);
    free(m->val);
    *m = (td_strmap){0};
}

/* Insert or overwrite. The map never fills: capacity is fixed at >= 2x the entries. */
static void strmap_put(td_strmap *m, const char *k, size_t n, int32_t v)
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

static int32_t strmap_get(const td_strmap *m, const char *k, size_t n)
{
    if (!m->cap) return -1;
    size_t i = td_hash(k, n) & (m->cap - 1);
    while (m->key[i]) {
        if (m->klen[i] == n && memcmp(m->key[i], k, n) == 0) return m->val[i];
        i = (i + 1) & (m->cap - 1);
    }
    return -1;
}

/* ---- growable buffers ---- */

typedef struct {
    int32_t *v;
    size_t n, cap;
} td_ids;

static int ids_push(td_ids *a, int32_t id)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? 2 * a->cap : 64;
        int32_t *p = realloc(a->v, cap * sizeof *p);
        if (!p) return TD_ENOMEM;
        a->v = p;
        a->cap = cap;
    }
    a->v[a->n++] = id;
    return 0;
}

int td_bytes_reserve(td_bytes *b, size_t extra)
{
    if (b->n + extra <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + extra)
        cap *= 2;
    char *p = realloc(b->v, cap);
    if (!p) return TD_ENOMEM;
    b->v = p;
    b->cap = cap;
    return 0;
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

static bool text_in(const char *s, size_t n, const char *const *list)
{
    for (; *list; list++)
        if (str_eq(s, n, *list)) return true;
    return false;
}

typedef struct {
    const char *name;
    td_pre_kind kind;
    bool clean_spaces, add_bos, ignore_merges;
} td_pre_entry;

static const td_pre_entry pre_table[] = {
    {"smollm", TD_PRE_SMOLLM, false, false, false},
    {"starcoder", TD_PRE_SMOLLM, true, false, false},
    {"refact", TD_PRE_SMOLLM, true, false, false},
    {"command-r", TD_PRE_SMOLLM, false, false, false},
    {"codeshell", TD_PRE_SMOLLM, true, false, false},
    {"exaone", TD_PRE_SMOLLM, true, false, false},
    {"minerva-7b", TD_PRE_SMOLLM, true, false, false},
    {"gpt-2", TD_PRE_GPT2, true, false, false},
    {"phi-2", TD_PRE_GPT2, true, false, false},
    {"roberta-bpe", TD_PRE_GPT2, true, false, false},
    {"mpt", TD_PRE_GPT2, true, false, false},
    {"olmo", TD_PRE_GPT2, true, false, false},
    {"jais", TD_PRE_GPT2, true, false, false},
    {"llama3", TD_PRE_LLAMA3, true, true, true},
    {"llama-v3", TD_PRE_LLAMA3, true, true, true},
    {"llama-bpe", TD_PRE_LLAMA3, true, true, true},
    {"falcon3", TD_PRE_LLAMA3, true, true, true},
    {"dbrx", TD_PRE_LLAMA3, true, false, false},
    {"smaug-bpe", TD_PRE_LLAMA3, true, false, false},
    {"qwen2", TD_PRE_QWEN2, false, false, false},
    {"stablelm2", TD_PRE_QWEN2, true, false, false},
    {"megrez", TD_PRE_QWEN2, true, false, false},
};

static int32_t get_id_key(const td_gguf *g, const char *key, int32_t def, int32_t n_vocab)
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
    if (t->kind == TD_VOCAB_SPM) {
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

static int cmp_special(const void *a, const void *b, void *ctx)
{
    const td_tokenizer *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (t->text_len[x] != t->text_len[y]) return t->text_len[x] > t->text_len[y] ? -1 : 1;
    return x < y ? -1 : x > y;
}

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
    t->text = calloc(n, sizeof *t->text);
    t->text_len = calloc(n, sizeof *t->text_len);
    t->piece = calloc(n, sizeof *t->piece);
    t->piece_len = calloc(n, sizeof *t->piece_len);
    t->type = calloc(n, 1);
    t->score = calloc(n, sizeof *t->score);
    t->eog = calloc(n, 1);
    if (!t->text || !t->text_len || !t->piece || !t->piece_len || !t->type || !t->score || !t->eog)
        return TD_ENOMEM;

    /* texts go into one pool; offsets first, pointers once the pool stops moving */
    td_bytes pool = {0};
    size_t *off = malloc((n + nm + 1) * sizeof *off);
    if (!off) return TD_ENOMEM;
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
        free(off);
        free(pool.v);
        if (rc != TD_ENOMEM) TD_LOG_ERR("tokenizer: bad token or merge string");
        return rc;
    }
    t->pool = pool.v;

    /* token types and scores (optional arrays; a wrong length is a format error) */
    for (size_t i = 0; i < n; i++)
        t->type[i] = TD_TOKTYPE_NORMAL;
    size_t na;
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
    if (rc) {
        free(off);
        if (rc == TD_EFORMAT)
            TD_LOG_ERR("tokenizer: token_type/scores arrays do not match %zu tokens", n);
        return rc;
    }

    rc = strmap_init(&t->tok_map, n);
    if (!rc && nm) rc = strmap_init(&t->merge_map, nm);
    if (rc) {
        free(off);
        return rc;
    }
    for (size_t i = 0; i < n; i++) {
        t->text[i] = t->pool + off[i];
        strmap_put(&t->tok_map, t->text[i], t->text_len[i], (int32_t)i);
    }
    for (size_t i = 0; i < nm; i++) {
        const char *s = t->pool + off[n + i];
        size_t len = off[n + i + 1] - off[n + i];
        /* llama.cpp splits at the first space after position 0; a merge without one
         * has an empty pair, which never matches */
        const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        if (!sp) continue;
        /* keep the first rank of a duplicated merge, like emplace */
        if (strmap_get(&t->merge_map, s, len) < 0) strmap_put(&t->merge_map, s, len, (int32_t)i);
    }
    free(off);
    return 0;
}

static void find_specials(td_tokenizer *t, const td_gguf *g)
{
    static const char *const eot_names[] = {"<|eot_id|>",
                                            "<|im_end|>",
                                            "<|end|>",
                                            "<end_of_turn>",
                                            "<|endoftext|>",
                                            "<EOT>",
                                            "<\xef\xbd\x9c"
                                            "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>",
                                            NULL};
    static const char *const eog_names[] = {
        "<|eot_id|>",    "<|im_end|>", "<|end|>", "<end_of_turn>",
        "<|endoftext|>", "<|eom_id|>", "<EOT>",   NULL};
    static const char *const eom_names[] = {"<|eom_id|>", NULL};
    /* FIM names: llama.cpp forces these to control type; pad/rep/sep also end generation */
    static const char *const fim_other[] = {"<|fim_prefix|>",
                                            "<fim-prefix>",
                                            "<\xef\xbd\x9c"
                                            "fim\xe2\x96\x81"
                                            "begin\xef\xbd\x9c>",
                                            "<PRE>",
                                            "<|fim_suffix|>",
                                            "<fim-suffix>",
                                            "<\xef\xbd\x9c"
                                            "fim\xe2\x96\x81"
                                            "hole\xef\xbd\x9c>",
                                            "<SUF>",
                                            "<|fim_middle|>",
                                            "<fim-middle>",
                                            "<\xef\xbd\x9c"
                                            "fim\xe2\x96\x81"
                                            "end\xef\xbd\x9c>",
                                            "<MID>",
                                            NULL};
    static const char *const fim_eog[] = {"<|fim_pad|>",  "<fim-pad>",     "<PAD>",
                                          "<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
                                          "<REPO>",       "<|file_sep|>",  NULL};

    int32_t n = t->n_vocab;
    t->eot = get_id_key(g, "tokenizer.ggml.eot_token_id", -1, n);
    t->eom = get_id_key(g, "tokenizer.ggml.eom_token_id", -1, n);
    bool eot_given = t->eot >= 0, eom_given = t->eom >= 0;
    for (int32_t i = 0; i < n; i++) {
        /* only the id the text map resolves to counts, as llama.cpp iterates token_to_id */
        if (strmap_get(&t->tok_map, t->text[i], t->text_len[i]) != i) continue;
        const char *s = t->text[i];
        size_t len = t->text_len[i];
        bool is_eot = !eot_given && text_in(s, len, eot_names);
        bool is_eom = !eom_given && text_in(s, len, eom_names);
        bool is_eog = text_in(s, len, eog_names) || text_in(s, len, fim_eog) || is_eot || is_eom;
        if (is_eot && t->eot < 0) t->eot = i;
        if (is_eom && t->eom < 0) t->eom = i;
        if (is_eog || is_eot || is_eom || text_in(s, len, fim_other)) {
            if (t->type[i] != TD_TOKTYPE_CONTROL) {
                TD_LOG_WARN("tokenizer: control-looking token %d '%.*s' was not control-type;"
                            " treating it as control",
                            i, (int)len, s);
                t->type[i] = TD_TOKTYPE_CONTROL;
            }
        }
        if (is_eog) t->eog[i] = 1;
    }
    if (t->eos >= 0) t->eog[t->eos] = 1;
    if (t->eot >= 0) t->eog[t->eot] = 1;
    if (t->eom >= 0) t->eog[t->eom] = 1;
}

int td_tok_create(const td_gguf *g, td_tokenizer **out)
{
    if (!out) return TD_EINVAL;
    *out = NULL;
    if (!g) return TD_EINVAL;
    const char *model, *pre = NULL;
    size_t model_len, pre_len = 0;
    if (td_gguf_get_str(g, "tokenizer.ggml.model", &model, &model_len) != 0) {
        TD_LOG_ERR("tokenizer: tokenizer.ggml.model missing");
        return TD_EFORMAT;
    }
    if (td_gguf_get_str(g, "tokenizer.ggml.pre", &pre, &pre_len) != 0) pre = NULL;

    td_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return TD_ENOMEM;
    if (str_eq(model, model_len, "gpt2")) {
        t->kind = TD_VOCAB_BPE;
        const td_pre_entry *e = NULL;
        for (size_t i = 0; pre && i < sizeof pre_table / sizeof pre_table[0]; i++)
            if (str_eq(pre, pre_len, pre_table[i].name)) e = &pre_table[i];
        if (!e) {
            TD_LOG_ERR("tokenizer: unsupported pre-tokenizer '%.*s' for model gpt2 (supported: "
                       "smollm, llama3/llama-bpe, qwen2, gpt-2 and their aliases)",
                       pre ? (int)pre_len : 9, pre ? pre : "<missing>");
            free(t);
            return TD_EUNSUPP;
        }
        t->pre = e->kind;
        snprintf(t->pre_name, sizeof t->pre_name, "%s", e->name);
        t->clean_spaces = e->clean_spaces;
        t->add_bos = e->add_bos;
        t->ignore_merges = e->ignore_merges;
        t->add_space_prefix = false;
        t->bos = 11, t->eos = 11, t->unk = -1;
        byte_level_tables(t);
    } else if (str_eq(model, model_len, "llama")) {
        t->kind = TD_VOCAB_SPM;
        t->pre = TD_PRE_NONE;
        t->add_bos = true;
        t->add_space_prefix = true;
        t->bos = 1, t->eos = 2, t->unk = 0;
    } else {
        TD_LOG_ERR("tokenizer: unsupported tokenizer model '%.*s' (supported: gpt2, llama)",
                   (int)model_len, model);
        free(t);
        return TD_EUNSUPP;
    }
    t->add_space_prefix = get_bool_key(g, "tokenizer.ggml.add_space_prefix", t->add_space_prefix);

    int rc = load_vocab(t, g);
    if (rc) {
        td_tok_destroy(t);
        return rc;
    }
    int32_t n = t->n_vocab;
    if (t->bos >= n) t->bos = -1;
    if (t->eos >= n) t->eos = -1;
    if (t->unk >= n) t->unk = -1;
    t->bos = get_id_key(g, "tokenizer.ggml.bos_token_id", t->bos, n);
    t->eos = get_id_key(g, "tokenizer.ggml.eos_token_id", t->eos, n);
    t->unk = get_id_key(g, "tokenizer.ggml.unknown_token_id", t->unk, n);
    t->add_bos = get_bool_key(g, "tokenizer.ggml.add_bos_token", t->add_bos);
    t->add_eos = get_bool_key(g, "tokenizer.ggml.add_eos_token", t->add_eos);
    if (t->add_bos && t->bos < 0) t->add_bos = false;
    if (t->add_eos && t->eos < 0) t->add_eos = false;

    find_specials(t, g);

    /* pieces: decoded once, after the type overrides */
    td_bytes pieces = {0};
    size_t *poff = malloc(((size_t)n + 1) * sizeof *poff);
    if (!poff) rc = TD_ENOMEM;
    for (int32_t i = 0; !rc && i < n; i++) {
        poff[i] = pieces.n;
        rc = make_piece(t, i, &pieces);
        t->piece_len[i] = (uint32_t)(pieces.n - poff[i]);
    }
    if (!rc && td_bytes_reserve(&pieces, 1)) rc = TD_ENOMEM;
    if (rc) {
        free(poff);
        free(pieces.v);
        td_tok_destroy(t);
        return rc;
    }
    for (int32_t i = 0; i < n; i++)
        t->piece[i] = pieces.v + poff[i];
    free(poff);
    /* the piece buffer hangs off piece[0]; freed in destroy */

    /* special tokens, longest first */
    size_t ns = 0;
    for (int32_t i = 0; i < n; i++) {
        uint8_t ty = t->type[i];
        if (ty == TD_TOKTYPE_CONTROL || ty == TD_TOKTYPE_USER_DEFINED || ty == TD_TOKTYPE_UNKNOWN)
            ns++;
    }
    t->special = malloc((ns ? ns : 1) * sizeof *t->special);
    if (!t->special) {
        td_tok_destroy(t);
        return TD_ENOMEM;
    }
    for (int32_t i = 0; i < n; i++) {
        uint8_t ty = t->type[i];
        if (ty == TD_TOKTYPE_CONTROL || ty == TD_TOKTYPE_USER_DEFINED || ty == TD_TOKTYPE_UNKNOWN)
            t->special[t->n_special++] = i;
    }
    qsort_r(t->special, t->n_special, sizeof *t->special, cmp_special, t);

    if (t->kind == TD_VOCAB_SPM) {
        static const char hex[] = "0123456789ABCDEF";
        for (int b = 0; b < 256; b++) {
            char buf[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
            int32_t id = strmap_get(&t->tok_map, buf, 6);
            if (id < 0) {
                char c = (char)b;
                id = strmap_get(&t->tok_map, &c, 1);
            }
            t->byte_tok[b] = id;
        }
    }
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
    free(t->special);
    strmap_fini(&t->tok_map);
    strmap_fini(&t->merge_map);
    free(t);
}

int32_t td_tok_n_vocab(const td_tokenizer *t)
{
    return t->n_vocab;
}
int32_t td_tok_bos(const td_tokenizer *t)
{
    return t->bos;
}
int32_t td_tok_eos(const td_tokenizer *t)
{
    return t->eos;
}
bool td_tok_add_bos(const td_tokenizer *t)
{
    return t->add_bos;
}
bool td_tok_add_eos(const td_tokenizer *t)
{
    return t->add_eos;
}
bool td_tok_is_eog(const td_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab && t->eog[id];
}
int td_tok_type(const td_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab ? t->type[id] : -1;
}
bool td_tok_clean_spaces(const td_tokenizer *t)
{
    return t->clean_spaces;
}
const char *td_tok_model_name(const td_tokenizer *t)
{
    return t->kind == TD_VOCAB_BPE ? "gpt2" : "llama";
}
const char *td_tok_pre_name(const td_tokenizer *t)
{
    return t->pre_name;
}

/* ---- encoding ---- */

typedef struct {
    int32_t prev, next; /* neighbours in the live chain, -1 at the ends */
    uint32_t off, n;    /* bytes text[off, off+n); n == 0 once merged away */
} td_sym;

typedef struct {
    int32_t left, right;
    uint32_t ln, rn; /* lengths at push time: the pair is stale if either changed */
    float score;     /* spm: higher first */
    int32_t rank;    /* bpe: lower first */
} td_bigram;

typedef struct {
    td_bigram *v;
    size_t n, cap;
    bool spm;
} td_heap;

/* true if a should pop before b */
static bool bg_before(const td_heap *h, const td_bigram *a, const td_bigram *b)
{
    if (h->spm) {
        if (a->score != b->score) return a->score > b->score;
        return a->left < b->left;
    }
    if (a->rank != b->rank) return a->rank < b->rank;
    return a->left < b->left;
}

static int heap_push(td_heap *h, td_bigram b)
{
    if (h->n == h->cap) {
        size_t cap = h->cap ? 2 * h->cap : 64;
        td_bigram *p = realloc(h->v, cap * sizeof *p);
        if (!p) return TD_ENOMEM;
        h->v = p;
        h->cap = cap;
    }
    size_t i = h->n++;
    h->v[i] = b;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!bg_before(h, &h->v[i], &h->v[parent])) break;
        td_bigram tmp = h->v[i];
        h->v[i] = h->v[parent];
        h->v[parent] = tmp;
        i = parent;
    }
    return 0;
}

static td_bigram heap_pop(td_heap *h)
{
    td_bigram top = h->v[0];
    h->v[0] = h->v[--h->n];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, best = i;
        if (l < h->n && bg_before(h, &h->v[l], &h->v[best])) best = l;
        if (r < h->n && bg_before(h, &h->v[r], &h->v[best])) best = r;
        if (best == i) break;
        td_bigram tmp = h->v[i];
        h->v[i] = h->v[best];
        h->v[best] = tmp;
        i = best;
    }
    return top;
}

/* Scratch state of one encode call. */
typedef struct {
    const td_tokenizer *t;
    td_ids out;
    td_sym *sym;
    size_t n_sym, cap_sym;
    td_heap heap;
    td_bytes word;  /* current word's text (byte-level encoded for BPE) */
    td_bytes key;   /* merge lookup key "left right" */
    td_words words; /* pre-tokenizer output */
} td_enc;

static int enc_syms_reserve(td_enc *e, size_t n)
{
    if (n <= e->cap_sym) return 0;
    size_t cap = e->cap_sym ? e->cap_sym : 64;
    while (cap < n)
        cap *= 2;
    td_sym *p = realloc(e->sym, cap * sizeof *p);
    if (!p) return TD_ENOMEM;
    e->sym = p;
    e->cap_sym = cap;
    return 0;
}

/* Split e->word into one symbol per UTF-8 character. llama.cpp cuts by the lead byte's
 * length alone; that is the same for valid UTF-8 (BPE words always are), but for an invalid
 * byte in spm input it would swallow the next character, so an invalid byte is one
 * symbol here (and becomes a byte token). */
static int enc_make_symbols(td_enc *e)
{
    const uint8_t *s = (const uint8_t *)e->word.v;
    size_t n = e->word.n;
    if (enc_syms_reserve(e, n)) return TD_ENOMEM;
    e->n_sym = 0;
    for (size_t off = 0; off < n;) {
        size_t len;
        td_utf8_decode(s + off, n - off, &len);
        int32_t idx = (int32_t)e->n_sym;
        e->sym[e->n_sym++] = (td_sym){.prev = idx - 1,
                                      .next = off + len == n ? -1 : idx + 1,
                                      .off = (uint32_t)off,
                                      .n = (uint32_t)len};
        off += len;
    }
    return 0;
}

static int bpe_add_bigram(td_enc *e, int32_t left, int32_t right)
{
    if (left < 0 || right < 0) return 0;
    const td_sym *l = &e->sym[left], *r = &e->sym[right];
    e->key.n = 0;
    if (td_bytes_add(&e->key, e->word.v + l->off, l->n) || td_bytes_add(&e->key, " ", 1) ||
        td_bytes_add(&e->key, e->word.v + r->off, r->n))
        return TD_ENOMEM;
    int32_t rank = strmap_get(&e->t->merge_map, e->key.v, e->key.n);
    if (rank < 0) return 0;
    return heap_push(&e->heap, (td_bigram){left, right, l->n, r->n, 0.0f, rank});
}

/* BPE one word (already in e->word, byte-level encoded) and append its ids. */
static int bpe_word(td_enc *e)
{
    const td_tokenizer *t = e->t;
    if (t->ignore_merges) {
        int32_t id = strmap_get(&t->tok_map, e->word.v, e->word.n);
        if (id >= 0) return ids_push(&e->out, id);
    }
    if (enc_make_symbols(e)) return TD_ENOMEM;
    e->heap.n = 0;
    for (size_t i = 1; i < e->n_sym; i++)
        if (bpe_add_bigram(e, (int32_t)i - 1, (int32_t)i)) return TD_ENOMEM;
    while (e->heap.n) {
        td_bigram b = heap_pop(&e->heap);
        td_sym *l = &e->sym[b.left], *r = &e->sym[b.right];
        if (l->n == 0 || r->n == 0 || l->n != b.ln || r->n != b.rn) continue;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) e->sym[r->next].prev = b.left;
        if (bpe_add_bigram(e, l->prev, b.left) || bpe_add_bigram(e, b.left, l->next))
            return TD_ENOMEM;
    }
    for (size_t i = 0; i < e->n_sym; i++) {
        const td_sym *s = &e->sym[i];
        if (s->n == 0) continue;
        int32_t id = strmap_get(&t->tok_map, e->word.v + s->off, s->n);
        if (id >= 0) {
            if (ids_push(&e->out, id)) return TD_ENOMEM;
            continue;
        }
        /* not a token: each byte alone, if it is one (llama.cpp drops the rest) */
        for (uint32_t j = 0; j < s->n; j++) {
            int32_t bid = strmap_get(&t->tok_map, e->word.v + s->off + j, 1);
            if (bid >= 0 && ids_push(&e->out, bid)) return TD_ENOMEM;
        }
    }
    return 0;
}

static int bpe_fragment(td_enc *e, const char *text, size_t len)
{
    const td_tokenizer *t = e->t;
    int rc = td_pretokenize(t->pre, text, len, &e->words);
    if (rc) return rc;
    size_t c0 = 0;
    for (size_t w = 0; w < e->words.n_words; w++) {
        size_t nc = e->words.word_len[w];
        e->word.n = 0;
        for (size_t c = c0; c < c0 + nc; c++) {
            uint8_t u[4];
            size_t k = td_utf8_encode(e->words.cpts[c], u);
            for (size_t j = 0; j < k; j++)
                if (td_bytes_add(&e->word, t->byte_enc[u[j]], t->byte_enc_len[u[j]]))
                    return TD_ENOMEM;
        }
        c0 += nc;
        rc = bpe_word(e);
        if (rc) return rc;
    }
    return 0;
}

static int spm_add_bigram(td_enc *e, int32_t left, int32_t right)
{
    if (left < 0 || right < 0) return 0;
    const td_sym *l = &e->sym[left], *r = &e->sym[right];
    int32_t id = strmap_get(&e->t->tok_map, e->word.v + l->off, (size_t)l->n + r->n);
    if (id < 0) return 0;
    return heap_push(&e->heap, (td_bigram){left, right, l->n, r->n, e->t->score[id], 0});
}

static int spm_fragment(td_enc *e, const char *text, size_t len, bool prefix_space)
{
    const td_tokenizer *t = e->t;
    e->word.n = 0;
    if (prefix_space && td_bytes_add(&e->word, "\xe2\x96\x81", 3)) return TD_ENOMEM;
    for (size_t i = 0; i < len; i++) {
        int rc = text[i] == ' ' ? td_bytes_add(&e->word, "\xe2\x96\x81", 3)
                                : td_bytes_add(&e->word, text + i, 1);
        if (rc) return rc;
    }
    if (e->word.n == 0) return 0;
    if (enc_make_symbols(e)) return TD_ENOMEM;
    e->heap.n = 0;
    for (size_t i = 1; i < e->n_sym; i++)
        if (spm_add_bigram(e, (int32_t)i - 1, (int32_t)i)) return TD_ENOMEM;
    while (e->heap.n) {
        td_bigram b = heap_pop(&e->heap);
        td_sym *l = &e->sym[b.left], *r = &e->sym[b.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != b.ln + b.rn || l->n != b.ln) continue;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) e->sym[r->next].prev = b.left;
        if (spm_add_bigram(e, l->prev, b.left) || spm_add_bigram(e, b.left, l->next))
            return TD_ENOMEM;
    }
    for (int32_t i = 0; i != -1; i = e->sym[i].next) {
        const td_sym *s = &e->sym[i];
        int32_t id = strmap_get(&t->tok_map, e->word.v + s->off, s->n);
        if (id >= 0) {
            if (ids_push(&e->out, id)) return TD_ENOMEM;
            continue;
        }
        /* every merged symbol is a token, so this is one character without a token:
         * byte fallback */
        for (uint32_t j = 0; j < s->n; j++) {
            int32_t bid = t->byte_tok[(uint8_t)e->word.v[s->off + j]];
            if (bid < 0) bid = t->unk;
            if (bid >= 0 && ids_push(&e->out, bid)) return TD_ENOMEM;
        }
    }
    return 0;
}

/* A fragment of the input: raw text [off, off+len) or one special token. */
typedef struct {
    int32_t id; /* -1 for raw text */
    size_t off, len;
} td_frag;

typedef struct {
    td_frag *v;
    size_t n, cap;
} td_frags;

static int frags_push(td_frags *f, td_frag x)
{
    if (f->n == f->cap) {
        size_t cap = f->cap ? 2 * f->cap : 16;
        td_frag *p = realloc(f->v, cap * sizeof *p);
        if (!p) return TD_ENOMEM;
        f->v = p;
        f->cap = cap;
    }
    f->v[f->n++] = x;
    return 0;
}

/* tokenizer_st_partition: cut raw fragments at each special token's occurrences, the
 * longest tokens first. */
static int partition(const td_tokenizer *t, const char *text, size_t len, bool parse_special,
                     td_frags *out)
{
    td_frags a = {0}, b = {0};
    int rc = 0;
    if (len > 0) rc = frags_push(&a, (td_frag){-1, 0, len});
    for (size_t k = 0; !rc && k < t->n_special; k++) {
        int32_t id = t->special[k];
        uint8_t ty = t->type[id];
        if (!parse_special && (ty == TD_TOKTYPE_CONTROL || ty == TD_TOKTYPE_UNKNOWN)) continue;
        const char *st = t->text[id];
        size_t sl = t->text_len[id];
        b.n = 0;
        for (size_t i = 0; !rc && i < a.n; i++) {
            td_frag f = a.v[i];
            if (f.id >= 0 || f.len < sl) {
                rc = frags_push(&b, f);
                continue;
            }
            size_t pos = f.off, end = f.off + f.len;
            while (!rc && pos < end) {
                const char *m = memmem(text + pos, end - pos, st, sl);
                if (!m) {
                    rc = frags_push(&b, (td_frag){-1, pos, end - pos});
                    break;
                }
                size_t mo = (size_t)(m - text);
                if (mo > pos) rc = frags_push(&b, (td_frag){-1, pos, mo - pos});
                if (!rc) rc = frags_push(&b, (td_frag){id, mo, sl});
                pos = mo + sl;
            }
        }
        td_frags tmp = a;
        a = b;
        b = tmp;
    }
    free(b.v);
    if (rc) {
        free(a.v);
        return rc;
    }
    *out = a;
    return 0;
}

int td_tok_encode(const td_tokenizer *t, const char *text, size_t len, bool add_special,
                  bool parse_special, int32_t **ids, size_t *n_ids)
{
    if (!t || !ids || !n_ids || (!text && len)) return TD_EINVAL;
    *ids = NULL;
    *n_ids = 0;
    td_enc e = {.t = t};
    e.heap.spm = t->kind == TD_VOCAB_SPM;
    td_words_init(&e.words);
    td_frags frags = {0};
    int rc = partition(t, text, len, parse_special, &frags);
    if (!rc && add_special && t->add_bos) rc = ids_push(&e.out, t->bos);
    bool prev_special = true; /* spm: a space prefix goes before the first text */
    for (size_t i = 0; !rc && i < frags.n; i++) {
        const td_frag *f = &frags.v[i];
        if (f->id >= 0) {
            rc = ids_push(&e.out, f->id);
            prev_special = true;
        } else if (t->kind == TD_VOCAB_BPE) {
            rc = bpe_fragment(&e, text + f->off, f->len);
        } else {
            rc = spm_fragment(&e, text + f->off, f->len, t->add_space_prefix && prev_special);
            prev_special = false;
        }
    }
    if (!rc && add_special && t->add_eos) rc = ids_push(&e.out, t->eos);
    if (!rc && !e.out.v) { /* never NULL on success */
        e.out.v = malloc(sizeof *e.out.v);
        if (!e.out.v) rc = TD_ENOMEM;
    }
    free(frags.v);
    free(e.sym);
    free(e.heap.v);
    free(e.word.v);
    free(e.key.v);
    td_words_fini(&e.words);
    if (rc) {
        free(e.out.v);
        return rc;
    }
    *ids = e.out.v;
    *n_ids = e.out.n;
    return 0;
}
