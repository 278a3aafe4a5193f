#define _GNU_SOURCE /* memmem */
/* test_tok_corpus.c: runs llama.cpp's tokenizer test vocabularies (ggml-vocab-NAME.gguf with
 * NAME.gguf.inp / NAME.gguf.out, as tests/test-tokenizer-0.cpp reads them) through
 * td_tok_encode and td_tok_decode.
 *
 *   test_tok_corpus --vocab F [--expect pass|load|refuse] [--texts F.inp [--ids F.out]
 *                   [--decoded F.dec]] [-v]
 *   test_tok_corpus --charsmap-cases [--vocab F]
 *
 * pass:   every case of F.inp encodes (add_special and parse_special off, as
 *         test-tokenizer-0 does) to exactly the ids of its line in F.out, and decodes back.
 * load:   td_tok_create accepts F (a vocabulary without cases); --texts F2.inp round-trips
 *         another vocabulary's inputs through it, and --ids gives the ids llama.cpp gives
 *         them (tests/ref/vocab_ids/).
 * refuse: td_tok_create refuses F with TD_EUNSUPP (an unsupported tokenizer type).
 * --charsmap-cases: the Unigram tokenizer (tokenizer.ggml.model "t5") on small vocabularies
 *         built here with a hand-made charsmap: normalization and segmentation as llama.cpp
 *         gives them, and every malformed charsmap (truncated size, a size beyond the blob,
 *         units or replacements pointing outside) refused with TD_EFORMAT, never a crash;
 *         with --vocab, that file's own charsmap mutated too (refused, or loaded and encoding).
 *
 * Round trip: decode(ids, special) gives the input back, after llama.cpp's clean_spaces
 * where the vocabulary has it (llama_detokenize applies it to every text); the incremental
 * detokenizer gives the same text as the whole decode when no spaces are cleaned.
 * Tokenizers that normalize their input (WordPiece lowercases and strips accents, Unigram
 * rewrites characters through its charsmap and merges whitespace) cannot give it back: with
 * --decoded, decode (whole and streamed) must give the text llama.cpp's llama_detokenize
 * gives for the same ids (remove_special off, unparse_special on; F.dec holds one per case,
 * separated as in an .inp file); without it the round trip is not checked. Prints one
 * summary line per vocabulary.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "td_err.h"
#include "tharness.h"
#include "tokenizer.h"

typedef struct {
    char *s;
    size_t n;
} blob;

typedef struct {
    blob text;
    int32_t *ids;
    size_t n_ids;
    blob decoded; /* with --decoded: what llama.cpp's detokenize gives for ids */
} tcase;

static const char *g_vocab, *g_expect = "pass", *g_texts, *g_ids, *g_decoded;
static bool g_verbose, g_charsmap_cases;
static td_tokenizer *g_tok;

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)(n > 0 ? n : 0) + 1);
    if (n < 0 || fread(buf, 1, (size_t)n, f) != (size_t)n) n = 0;
    buf[n] = '\0';
    fclose(f);
    *len = (size_t)n;
    return buf;
}

/* The texts of an .inp file: separated by "\n__ggml_vocab_test__\n" (the last one followed
 * by it too), exactly as test-tokenizer-0's read_tests splits them. */
static size_t read_texts(const char *path, blob **out)
{
    static const char sep[] = "\n__ggml_vocab_test__\n";
    size_t len, n = 0;
    char *raw = read_file(path, &len);
    if (!raw) return 0;
    blob *b = NULL;
    for (size_t pos = 0; pos < len;) {
        const char *m = memmem(raw + pos, len - pos, sep, sizeof sep - 1);
        size_t end = m ? (size_t)(m - raw) : len;
        b = realloc(b, (n + 1) * sizeof *b);
        b[n] = (blob){malloc(end - pos + 1), end - pos};
        memcpy(b[n].s, raw + pos, end - pos);
        n++;
        pos = m ? end + sizeof sep - 1 : len;
    }
    free(raw);
    *out = b;
    return n;
}

static size_t read_inputs(const char *path, tcase **out)
{
    blob *b = NULL;
    size_t n = read_texts(path, &b);
    tcase *c = calloc(n ? n : 1, sizeof *c);
    for (size_t i = 0; i < n; i++)
        c[i].text = b[i];
    free(b);
    *out = c;
    return n;
}

/* The decoded texts of F.dec, one per case; false if the counts differ. */
static bool read_decoded(const char *path, tcase *c, size_t n)
{
    blob *b = NULL;
    size_t k = read_texts(path, &b);
    for (size_t i = 0; i < k; i++) {
        if (i < n)
            c[i].decoded = b[i];
        else
            free(b[i].s);
    }
    free(b);
    if (k != n) fprintf(stderr, "%s: %zu decoded texts for %zu inputs\n", path, k, n);
    return k == n;
}

/* One line of ids per case in the .out file; returns false if the counts differ. */
static bool read_outputs(const char *path, tcase *c, size_t n)
{
    size_t len, k = 0;
    char *raw = read_file(path, &len);
    if (!raw) return false;
    for (char *p = raw; *p && k < n; k++) {
        char *e = strchr(p, '\n');
        if (e) *e = '\0';
        c[k].ids = malloc((strlen(p) / 2 + 1) * sizeof *c[k].ids);
        char *end;
        for (const char *q = p;; q = end) {
            long v = strtol(q, &end, 10);
            if (end == q) break;
            c[k].ids[c[k].n_ids++] = (int32_t)v;
        }
        if (!e) break;
        p = e + 1;
    }
    free(raw);
    if (k != n) fprintf(stderr, "%s: %zu lines of ids for %zu inputs\n", path, k, n);
    return k == n;
}

static const char *base_name(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

static void show_ids(const char *what, const int32_t *ids, size_t n)
{
    fprintf(stderr, "    %s:", what);
    for (size_t i = 0; i < n && i < 64; i++)
        fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, n > 64 ? " ...\n" : "\n");
}

/* llama.cpp's clean_spaces over text (an independent copy of llama_vocab::detokenize's
 * three passes): drop the space in " ?", " !", " .", " ,", around a lone "'" and before
 * "'s", "'m", "'re", "'ve". Returns the new length. */
static size_t clean_spaces(char *s, size_t n)
{
    size_t k = n ? 1 : 0;
    for (size_t i = 1; i < n; i++) {
        if (s[i - 1] == ' ' && strchr("?!.,", s[i]) && s[i]) k--;
        s[k++] = s[i];
    }
    n = k, k = n ? 1 : 0;
    for (size_t i = 1; i < n; i++) {
        char x = s[i];
        if (x == '\'' && i + 1 < n && s[i - 1] == ' ' && s[i + 1] == ' ') {
            k--;
            s[++i] = '\0';
        }
        s[k++] = x;
    }
    n = k, k = n ? 1 : 0;
    for (size_t i = 1; i < n; i++) {
        if (s[i - 1] == ' ' && s[i] == '\'' && i + 1 < n) {
            char a = s[i + 1], b = i + 2 < n ? s[i + 2] : 0;
            if (a == 's' || a == 'm' || (b && ((a == 'r' && b == 'e') || (a == 'v' && b == 'e'))))
                k--;
        }
        s[k++] = s[i];
    }
    return k;
}

static char *decode_all(const int32_t *ids, size_t n, size_t *len)
{
    long need = td_tok_decode(g_tok, ids, n, true, NULL, 0);
    if (need < 0) return NULL;
    char *buf = malloc((size_t)need + 1);
    if (td_tok_decode(g_tok, ids, n, true, buf, (size_t)need) != need) {
        free(buf);
        return NULL;
    }
    *len = (size_t)need;
    return buf;
}

static char *decode_stream(const int32_t *ids, size_t n, size_t *len)
{
    td_detok d;
    td_detok_init(&d, g_tok);
    d.special = true;
    size_t total = 0, cap = 256;
    char *all = malloc(cap);
    for (size_t i = 0; i <= n; i++) {
        char chunk[1024];
        int w = i < n ? td_detok_push(&d, ids[i], chunk, sizeof chunk)
                      : td_detok_flush(&d, chunk, sizeof chunk);
        if (w < 0) {
            free(all);
            return NULL;
        }
        while (total + (size_t)w > cap)
            all = realloc(all, cap *= 2);
        memcpy(all + total, chunk, (size_t)w);
        total += (size_t)w;
    }
    *len = total;
    return all;
}

/* decode(ids) must be the input (cleaned as llama.cpp would), or for a normalizing
 * tokenizer what llama.cpp decodes the ids to (dec); false if not. */
static bool round_trip(const blob *in, const blob *dec, const int32_t *ids, size_t n, size_t idx)
{
    size_t got_n = 0, st_n = 0;
    char *got = decode_all(ids, n, &got_n);
    char *st = decode_stream(ids, n, &st_n);
    if (dec->s) in = dec;
    char *want = malloc(in->n + 1);
    memcpy(want, in->s, in->n);
    size_t want_n = td_tok_clean_spaces(g_tok) ? clean_spaces(want, in->n) : in->n;
    bool ok = got && got_n == want_n && !memcmp(got, want, want_n);
    /* the streamed text skips clean_spaces, so it is the input itself */
    bool st_ok = st && st_n == in->n && !memcmp(st, in->s, in->n);
    if ((!ok || !st_ok) && g_verbose)
        fprintf(stderr, "  case %zu: round trip '%.*s' -> '%.*s' (stream '%.*s')\n", idx,
                (int)in->n, in->s, got ? (int)got_n : 0, got ? got : "", st ? (int)st_n : 0,
                st ? st : "");
    free(got);
    free(st);
    free(want);
    return ok && st_ok;
}

/* Encode every case; count exact id matches and round trips. */
static void run_cases(tcase *c, size_t n, bool check_ids, bool check_rt)
{
    size_t ok_ids = 0, ok_rt = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t *ids = NULL;
        size_t n_ids = 0;
        int rc = td_tok_encode(g_tok, c[i].text.s, c[i].text.n, false, false, &ids, &n_ids);
        TH_CHECKF(rc == 0, "case %zu: td_tok_encode gave %d", i, rc);
        if (rc) continue;
        if (check_ids) {
            bool same =
                c[i].n_ids == n_ids && (n_ids == 0 || !memcmp(c[i].ids, ids, n_ids * sizeof *ids));
            ok_ids += same;
            if (!same) {
                fprintf(stderr, "  case %zu: ids differ for '%.*s'\n", i, (int)c[i].text.n,
                        c[i].text.s);
                show_ids("want", c[i].ids, c[i].n_ids);
                show_ids("got ", ids, n_ids);
            }
        }
        if (check_rt) ok_rt += round_trip(&c[i].text, &c[i].decoded, ids, n_ids, i);
        free(ids);
    }
    printf("%s: %s", base_name(g_vocab), td_tok_type_name(g_tok));
    if (check_ids) printf(", ids %zu/%zu", ok_ids, n);
    if (check_rt && !td_tok_lossless(g_tok))
        printf(", decode as llama.cpp's %zu/%zu", ok_rt, n);
    else if (check_rt)
        printf(", round trip %zu/%zu%s", ok_rt, n,
               td_tok_clean_spaces(g_tok) ? " (after clean_spaces)" : "");
    else
        printf(", round trip not checked (the tokenizer normalizes its input)");
    printf("\n");
    TH_CHECKF(!check_ids || ok_ids == n, "%zu of %zu cases give other ids", n - ok_ids, n);
    TH_CHECKF(!check_rt || ok_rt == n, "%zu of %zu cases do not round-trip", n - ok_rt, n);
}

static void free_cases(tcase *c, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(c[i].text.s);
        free(c[i].ids);
        free(c[i].decoded.s);
    }
    free(c);
}

static void test_corpus(void)
{
    char inp[4096], outp[4096];
    const char *texts = g_texts, *ids = g_ids;
    if (!strcmp(g_expect, "pass")) {
        snprintf(inp, sizeof inp, "%s.inp", g_vocab);
        snprintf(outp, sizeof outp, "%s.out", g_vocab);
        texts = inp, ids = outp;
    }
    bool with_ids = ids != NULL;
    if (!texts) {
        printf("%s: %s, loaded (no cases)\n", base_name(g_vocab), td_tok_type_name(g_tok));
        return;
    }
    tcase *c = NULL;
    size_t n = read_inputs(texts, &c);
    TH_REQUIRE(n > 0);
    if ((with_ids && !read_outputs(ids, c, n)) || (g_decoded && !read_decoded(g_decoded, c, n))) {
        TH_CHECK(!"the .inp and .out (or .dec) files disagree");
        free_cases(c, n);
        return;
    }
    run_cases(c, n, with_ids, td_tok_lossless(g_tok) || g_decoded);
    free_cases(c, n);
}

/* ---- Unigram: small vocabularies and charsmaps built here ---- */

/* A GGUF file written into memory. */
typedef struct {
    uint8_t *v;
    size_t n, cap;
} gbuf;

static void gb_put(gbuf *b, const void *p, size_t n)
{
    while (b->n + n > b->cap)
        b->v = realloc(b->v, b->cap = b->cap ? 2 * b->cap : 4096);
    memcpy(b->v + b->n, p, n);
    b->n += n;
}

static void gb_u32(gbuf *b, uint32_t x)
{
    gb_put(b, &x, 4);
}

static void gb_u64(gbuf *b, uint64_t x)
{
    gb_put(b, &x, 8);
}

static void gb_str(gbuf *b, const char *s)
{
    gb_u64(b, strlen(s));
    gb_put(b, s, strlen(s));
}

static void gb_key(gbuf *b, const char *key, uint32_t type)
{
    gb_str(b, key);
    gb_u32(b, type);
}

#define SP "\xe2\x96\x81" /* U+2581 */

/* The vocabulary of the synthetic "t5" files. */
static const struct {
    const char *text;
    int32_t type;
    float score;
} syn_vocab[] = {
    {"<pad>", TD_TOKTYPE_CONTROL, 0.0f},       /* 0 */
    {"</s>", TD_TOKTYPE_CONTROL, 0.0f},        /* 1 */
    {"<unk>", TD_TOKTYPE_UNKNOWN, 0.0f},       /* 2 */
    {SP, TD_TOKTYPE_NORMAL, -2.0f},            /* 3 */
    {"y", TD_TOKTYPE_NORMAL, -1.0f},           /* 4 */
    {"Q", TD_TOKTYPE_NORMAL, -1.0f},           /* 5 */
    {SP "y", TD_TOKTYPE_NORMAL, -1.5f},        /* 6 */
    {"yQ", TD_TOKTYPE_NORMAL, -1.0f},          /* 7 */
    {"<user>", TD_TOKTYPE_USER_DEFINED, 0.0f}, /* 8 */
    {"[unused]", TD_TOKTYPE_UNUSED, -100.0f},  /* 9 */
    {"xo!", TD_TOKTYPE_USER_DEFINED, 0.0f},    /* 10: only where a case asks for it */
};
#define SYN_N (sizeof syn_vocab / sizeof syn_vocab[0])

/* A "t5" GGUF with syn_vocab and, unless cm is NULL, cm[0..cm_n) as the charsmap (an array
 * of cm_type: U8, or another type to see it refused). */
static void build_t5(gbuf *b, const uint8_t *cm, size_t cm_n, uint32_t cm_type, bool prefix,
                     bool merge, size_t n_vocab)
{
    b->n = 0;
    gb_u32(b, 0x46554747u); /* "GGUF" */
    gb_u32(b, 3);
    gb_u64(b, 0);          /* tensors */
    gb_u64(b, cm ? 7 : 6); /* keys */
    gb_key(b, "tokenizer.ggml.model", TD_GGUF_STRING);
    gb_str(b, "t5");
    gb_key(b, "tokenizer.ggml.tokens", TD_GGUF_ARRAY);
    gb_u32(b, TD_GGUF_STRING);
    gb_u64(b, n_vocab);
    for (size_t i = 0; i < n_vocab; i++)
        gb_str(b, syn_vocab[i].text);
    gb_key(b, "tokenizer.ggml.scores", TD_GGUF_ARRAY);
    gb_u32(b, TD_GGUF_F32);
    gb_u64(b, n_vocab);
    for (size_t i = 0; i < n_vocab; i++)
        gb_put(b, &syn_vocab[i].score, 4);
    gb_key(b, "tokenizer.ggml.token_type", TD_GGUF_ARRAY);
    gb_u32(b, TD_GGUF_I32);
    gb_u64(b, n_vocab);
    for (size_t i = 0; i < n_vocab; i++)
        gb_put(b, &syn_vocab[i].type, 4);
    gb_key(b, "tokenizer.ggml.add_space_prefix", TD_GGUF_BOOL);
    gb_put(b, &(uint8_t){prefix}, 1);
    gb_key(b, "tokenizer.ggml.remove_extra_whitespaces", TD_GGUF_BOOL);
    gb_put(b, &(uint8_t){merge}, 1);
    if (cm) {
        gb_key(b, "tokenizer.ggml.precompiled_charsmap", TD_GGUF_ARRAY);
        gb_u32(b, cm_type);
        gb_u64(b, cm_n);
        for (size_t i = 0; i < cm_n; i++) {
            uint32_t v = cm[i];
            gb_put(b, &v, cm_type == TD_GGUF_U8 || cm_type == TD_GGUF_I8 ? 1 : 4);
        }
    }
    while (b->n % 32)
        gb_put(b, "", 1);
}

/* Load a built file; returns td_tok_create's code (*out the tokenizer on success). */
static int load_built(const gbuf *b, td_tokenizer **out)
{
    char err[256];
    td_gguf *g = NULL;
    *out = NULL;
    if (td_gguf_open_buffer(b->v, b->n, &g, err, sizeof err) != 0) {
        fprintf(stderr, "  built file does not open: %s\n", err);
        return -1000;
    }
    int rc = td_tok_create(g, out);
    td_gguf_close(g);
    return rc;
}

/* The hand-made charsmap: "x" -> "y", "a" -> "  ", "ab" -> "Q". Darts-clone blocks of 256
 * units: the root (unit 0) has its children at 256, x's value unit is at 512, a's children
 * (its value unit and b) at 768, ab's value unit at 1024. */
#define CM_UNITS   1280
#define CM_X       (256 ^ 'x')
#define CM_A       (256 ^ 'a')
#define CM_AB      (768 ^ 'b')
#define CM_STRINGS "y\0  \0Q" /* offsets 0, 2 and 5, each NUL-terminated */
#define CM_BYTES   (4 + 4 * CM_UNITS + sizeof CM_STRINGS)

static uint32_t cm_node(uint32_t label, bool leaf, uint32_t offset)
{
    return offset << 10 | (uint32_t)leaf << 8 | label;
}

static void cm_units(uint32_t *u)
{
    memset(u, 0, CM_UNITS * sizeof *u);
    u[0] = cm_node(0, false, 256);
    u[CM_X] = cm_node('x', true, CM_X ^ 512);
    u[512] = 1u << 31 | 0;
    u[CM_A] = cm_node('a', true, CM_A ^ 768);
    u[768] = 1u << 31 | 2;
    u[CM_AB] = cm_node('b', true, CM_AB ^ 1024);
    u[1024] = 1u << 31 | 5;
}

/* size, the first n_units units and the strings into out (up to CM_BYTES); returns the
 * byte count */
static size_t cm_bytes_n(const uint32_t *u, size_t n_units, uint8_t *out)
{
    uint32_t size = 4 * (uint32_t)n_units;
    memcpy(out, &size, 4);
    memcpy(out + 4, u, 4 * n_units);
    memcpy(out + 4 + 4 * n_units, CM_STRINGS, sizeof CM_STRINGS);
    return 4 + 4 * n_units + sizeof CM_STRINGS;
}

static size_t cm_bytes(const uint32_t *u, uint8_t *out)
{
    return cm_bytes_n(u, CM_UNITS, out);
}

/* encode text (add_special off, parse_special off) and compare with want[0..n) */
static void expect_ids(td_tokenizer *t, const char *text, size_t len, const int32_t *want, size_t n,
                       const char *decoded)
{
    int32_t *ids = NULL;
    size_t n_ids = 0;
    int rc = td_tok_encode(t, text, len, false, false, &ids, &n_ids);
    TH_CHECKF(rc == 0, "encode '%.*s' gave %d", (int)len, text, rc);
    bool same = rc == 0 && n_ids == n && (n == 0 || !memcmp(ids, want, n * sizeof *ids));
    TH_CHECKF(same, "'%.*s' gives other ids", (int)len, text);
    if (!same) {
        show_ids("want", want, n);
        show_ids("got ", ids, n_ids);
    }
    if (decoded && rc == 0) {
        char buf[256];
        long k = td_tok_decode(t, ids, n_ids, true, buf, sizeof buf);
        TH_CHECKF(k == (long)strlen(decoded) && !memcmp(buf, decoded, (size_t)k),
                  "'%.*s' decodes to '%.*s', want '%s'", (int)len, text, k > 0 ? (int)k : 0, buf,
                  decoded);
    }
    free(ids);
}

#define EXPECT(t, text, dec, ...)                                                                  \
    do {                                                                                           \
        static const int32_t w_[] = {__VA_ARGS__};                                                 \
        expect_ids(t, text, sizeof text - 1, w_, sizeof w_ / sizeof w_[0], dec);                   \
    } while (0)
#define EXPECT_NONE(t, text) expect_ids(t, text, sizeof text - 1, NULL, 0, "")

static void test_ugm_synthetic(void)
{
    uint32_t u[CM_UNITS];
    uint8_t cm[CM_BYTES];
    gbuf b = {0};
    td_tokenizer *t;
    cm_units(u);
    size_t n = cm_bytes(u, cm);

    /* add_space_prefix and remove_extra_whitespaces, as nomic-bert-moe */
    build_t5(&b, cm, n, TD_GGUF_U8, true, true, SYN_N - 1);
    TH_REQUIRE(load_built(&b, &t) == 0);
    TH_CHECK(!strcmp(td_tok_type_name(t), "UGM") && !td_tok_lossless(t));
    EXPECT(t, "xab", "yQ", 6, 5); /* "ab" is longer than "a": Q; then " y" + "Q" */
    EXPECT_NONE(t, "a");          /* two spaces only: nothing */
    EXPECT_NONE(t, "");
    EXPECT_NONE(t, "   ");
    /* whitespace is ' ' only: a tab is one where the charsmap makes it ' ' (sentencepiece's
     * do; this one does not) */
    EXPECT(t, " \t ", "<unk>", 3, 2);
    EXPECT(t, "x  x", "y y", 6, 6);                      /* runs of spaces merged */
    EXPECT(t, "  x a x  ", "y y", 6, 6);                 /* "a" becomes spaces, merged too */
    EXPECT(t, "x \xc3\xa9\xc3\xa9", "y <unk>", 6, 3, 2); /* two unknowns in a row: one */
    EXPECT(t, "\xff", "<unk>", 3, 2);                    /* an invalid byte: U+FFFD, unknown */
    /* a user-defined token is always its own; the text after it is a fragment of its own,
     * with its own U+2581 prefix, which decode keeps (only the first is dropped) */
    EXPECT(t, "y<user>y", "y<user> y", 6, 8, 6);
    td_tok_destroy(t);

    /* as llama.cpp: text that starts some user-defined token's text ("xo!") is kept as is,
     * so neither "x" here becomes "y" */
    build_t5(&b, cm, n, TD_GGUF_U8, true, true, SYN_N);
    TH_REQUIRE(load_built(&b, &t) == 0);
    EXPECT(t, "xo", "<unk>", 3, 2);
    EXPECT(t, "x", "<unk>", 3, 2);
    EXPECT(t, "xo!", "xo!", 10);
    td_tok_destroy(t);

    /* neither: spaces kept (escaped), no prefix */
    build_t5(&b, cm, n, TD_GGUF_U8, false, false, SYN_N - 1);
    TH_REQUIRE(load_built(&b, &t) == 0);
    EXPECT(t, "x  x", "y  y", 4, 3, 6);
    td_tok_destroy(t);

    /* remove_extra_whitespaces alone still puts U+2581 before every word (llama.cpp) */
    build_t5(&b, cm, n, TD_GGUF_U8, false, true, SYN_N - 1);
    TH_REQUIRE(load_built(&b, &t) == 0);
    EXPECT(t, "x", " y", 6);
    td_tok_destroy(t);

    /* no charsmap: nothing is replaced */
    build_t5(&b, NULL, 0, TD_GGUF_U8, true, true, SYN_N - 1);
    TH_REQUIRE(load_built(&b, &t) == 0);
    EXPECT(t, "xab", "<unk>", 3, 2);
    td_tok_destroy(t);

    /* a child that leads back to the root's children (a cycle, not a tree): loads, and a
     * walk over it ends with the input */
    u[CM_AB] = cm_node('b', false, CM_AB ^ 256);
    n = cm_bytes(u, cm);
    build_t5(&b, cm, n, TD_GGUF_U8, true, true, SYN_N - 1);
    TH_REQUIRE(load_built(&b, &t) == 0);
    int32_t *ids = NULL;
    size_t n_ids;
    TH_CHECK(td_tok_encode(t, "abababab", 8, false, false, &ids, &n_ids) == 0);
    free(ids);
    td_tok_destroy(t);
    free(b.v);
}

/* A malformed charsmap: td_tok_create must refuse it with TD_EFORMAT. */
static void expect_refused(const char *what, const uint8_t *cm, size_t n, uint32_t type)
{
    gbuf b = {0};
    td_tokenizer *t;
    build_t5(&b, cm, n, type, true, true, SYN_N - 1);
    int rc = load_built(&b, &t);
    TH_CHECKF(rc == TD_EFORMAT && !t, "%s: td_tok_create gave %d, want TD_EFORMAT", what, rc);
    printf("charsmap %s: %s\n", what, rc == TD_EFORMAT ? "refused" : "NOT refused");
    td_tok_destroy(t);
    free(b.v);
}

static void put_size(uint8_t *cm, uint32_t size)
{
    memcpy(cm, &size, 4);
}

static void test_ugm_malformed(void)
{
    uint32_t u[CM_UNITS];
    uint8_t cm[CM_BYTES];
    cm_units(u);
    size_t n = cm_bytes(u, cm);

    expect_refused("of 3 bytes (truncated size)", cm, 3, TD_GGUF_U8);
    expect_refused("of 0 bytes", cm, 0, TD_GGUF_U8);
    put_size(cm, 0xFFFFFFF0u);
    expect_refused("with a size beyond the blob", cm, n, TD_GGUF_U8);
    put_size(cm, (uint32_t)(n - 4));
    expect_refused("with no strings after the trie", cm, n, TD_GGUF_U8);
    put_size(cm, 4 * CM_UNITS + 2);
    expect_refused("with a size of part of a unit", cm, n, TD_GGUF_U8);
    n = cm_bytes(u, cm);
    expect_refused("cut inside the trie", cm, 4 + 4 * 100, TD_GGUF_U8);
    expect_refused("as an array of u32", cm, n, TD_GGUF_U32);

    uint32_t saved = u[0];
    u[0] = cm_node(0, false, 4096); /* the root's children past the end */
    n = cm_bytes(u, cm);
    expect_refused("with the root pointing outside", cm, n, TD_GGUF_U8);
    u[0] = saved;

    saved = u[CM_X];
    u[CM_X] = cm_node('x', true, CM_X ^ (1u << 20)); /* x's children past the end */
    n = cm_bytes(u, cm);
    expect_refused("with a unit pointing outside", cm, n, TD_GGUF_U8);
    u[CM_X] = saved;
    /* the array cut after ab's value unit: a walk past "ab" would probe 1024 ^ c */
    n = cm_bytes_n(u, 1025, cm);
    expect_refused("with a block running past the end", cm, n, TD_GGUF_U8);

    u[512] = 1u << 31 | 1000; /* x's replacement past the strings */
    n = cm_bytes(u, cm);
    expect_refused("with a replacement outside the strings", cm, n, TD_GGUF_U8);
    u[512] = 1u << 31 | 0;

    n = cm_bytes(u, cm);
    cm[n - 1] = 'Q'; /* the last string, ab's, no longer ends */
    expect_refused("with an unterminated replacement", cm, n, TD_GGUF_U8);
}

/* --vocab's own charsmap, mutated: the size broken, then single units overwritten with
 * pseudo-random values (a fixed sequence): each is refused, or loads and encodes. */
static void test_ugm_mutated(void)
{
    char err[256];
    td_gguf *g = NULL;
    TH_REQUIRE(td_gguf_open(g_vocab, &g, err, sizeof err) == 0);
    static const char key[] = "tokenizer.ggml.precompiled_charsmap";
    td_gguf_vtype et;
    size_t n = 0;
    int32_t *wide = NULL;
    if (td_gguf_get_arr(g, key, &et, &n) == 0 && (wide = malloc(n * sizeof *wide)) &&
        td_gguf_arr_read_i32(g, key, wide, n) != 0)
        n = 0;
    td_gguf_close(g);
    TH_REQUIRE(n > 8 && wide);
    uint8_t *cm = malloc(n);
    for (size_t i = 0; i < n; i++)
        cm[i] = (uint8_t)wide[i];
    free(wide);
    uint32_t size;
    memcpy(&size, cm, 4);
    size_t n_units = size / 4;
    TH_REQUIRE(size % 4 == 0 && size + 4 < n);

    static const char text[] = "Ｈｅｌｌｏ ﬁne café Ⅻ ①  \t日本語 한국어 \xff x\xe2\x80\x8by";
    gbuf b = {0};
    td_tokenizer *t;
    build_t5(&b, cm, n, TD_GGUF_U8, true, true, SYN_N - 1);
    TH_REQUIRE(load_built(&b, &t) == 0);
    td_tok_destroy(t);
    expect_refused("of the file, truncated", cm, 3, TD_GGUF_U8);
    put_size(cm, (uint32_t)n);
    expect_refused("of the file, its size past the end", cm, n, TD_GGUF_U8);
    put_size(cm, size);

    uint64_t x = 0x9E3779B97F4A7C15ull;
    int refused = 0, loaded = 0;
    for (int k = 0; k < 300; k++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        size_t unit = k < 20 ? (size_t)k : (size_t)(x >> 33) % n_units; /* the root's first */
        uint32_t v = (uint32_t)(x >> 7), old;
        memcpy(&old, cm + 4 + 4 * unit, 4);
        memcpy(cm + 4 + 4 * unit, &v, 4);
        build_t5(&b, cm, n, TD_GGUF_U8, true, true, SYN_N - 1);
        int rc = load_built(&b, &t);
        TH_CHECKF(rc == 0 || rc == TD_EFORMAT, "unit %zu = %08x: td_tok_create gave %d", unit, v,
                  rc);
        if (rc == 0) {
            int32_t *ids = NULL;
            size_t n_ids = 0;
            TH_CHECK(td_tok_encode(t, text, sizeof text - 1, false, false, &ids, &n_ids) == 0);
            for (size_t i = 0; i < n_ids; i++)
                TH_CHECK(ids[i] >= 0 && ids[i] < (int32_t)SYN_N);
            free(ids);
            loaded++;
        } else {
            refused++;
        }
        td_tok_destroy(t);
        memcpy(cm + 4 + 4 * unit, &old, 4);
    }
    printf("charsmap of %s with one unit overwritten: %d refused, %d loaded and encoded\n",
           base_name(g_vocab), refused, loaded);
    free(b.v);
    free(cm);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-v"))
            g_verbose = true;
        else if (i + 1 < argc && !strcmp(argv[i], "--vocab"))
            g_vocab = argv[++i];
        else if (i + 1 < argc && !strcmp(argv[i], "--expect"))
            g_expect = argv[++i];
        else if (i + 1 < argc && !strcmp(argv[i], "--texts"))
            g_texts = argv[++i];
        else if (i + 1 < argc && !strcmp(argv[i], "--ids"))
            g_ids = argv[++i];
        else if (i + 1 < argc && !strcmp(argv[i], "--decoded"))
            g_decoded = argv[++i];
        else if (!strcmp(argv[i], "--charsmap-cases"))
            g_charsmap_cases = true;
    }
    if (g_charsmap_cases) {
        TH_RUN(test_ugm_synthetic);
        TH_RUN(test_ugm_malformed);
        if (g_vocab) TH_RUN(test_ugm_mutated);
        TH_EXIT();
    }
    if (!g_vocab ||
        (strcmp(g_expect, "pass") && strcmp(g_expect, "load") && strcmp(g_expect, "refuse"))) {
        fprintf(stderr, "usage: test_tok_corpus --vocab F [--expect pass|load|refuse] "
                        "[--texts F.inp [--ids F.out] [--decoded F.dec]] [-v]\n"
                        "       test_tok_corpus --charsmap-cases [--vocab F]\n");
        return 2;
    }
    char err[256] = "";
    td_gguf *g = NULL;
    if (td_gguf_open(g_vocab, &g, err, sizeof err) != 0) {
        fprintf(stderr, "cannot open %s: %s\n", g_vocab, err);
        return 1;
    }
    int rc = td_tok_create(g, &g_tok);
    td_gguf_close(g); /* the tokenizer must not need the file any more */
    if (!strcmp(g_expect, "refuse")) {
        TH_CHECKF(rc == TD_EUNSUPP && !g_tok, "td_tok_create gave %d, want TD_EUNSUPP", rc);
        printf("%s: refused (%s)\n", base_name(g_vocab), td_strerror(rc));
        td_tok_destroy(g_tok);
        TH_EXIT();
    }
    if (rc != 0) {
        fprintf(stderr, "td_tok_create: %s\n", td_strerror(rc));
        return 1;
    }
    TH_RUN(test_corpus);
    td_tok_destroy(g_tok);
    TH_EXIT();
}
