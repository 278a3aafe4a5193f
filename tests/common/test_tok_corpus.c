#define _GNU_SOURCE /* memmem */
/* test_tok_corpus.c: runs llama.cpp's tokenizer test vocabularies (ggml-vocab-NAME.gguf with
 * NAME.gguf.inp / NAME.gguf.out, as tests/test-tokenizer-0.cpp reads them) through
 * td_tok_encode and td_tok_decode.
 *
 *   test_tok_corpus --vocab F [--expect pass|load|refuse] [--texts F.inp [--ids F.out]] [-v]
 *
 * pass:   every case of F.inp encodes (add_special and parse_special off, as
 *         test-tokenizer-0 does) to exactly the ids of its line in F.out, and decodes back.
 * load:   td_tok_create accepts F (a vocabulary without cases); --texts F2.inp round-trips
 *         another vocabulary's inputs through it, and --ids gives the ids llama.cpp gives
 *         them (tests/ref/vocab_ids/).
 * refuse: td_tok_create refuses F with TD_EUNSUPP (an unsupported tokenizer type).
 *
 * Round trip: decode(ids, special) gives the input back, after llama.cpp's clean_spaces
 * where the vocabulary has it (llama_detokenize applies it to every text); the incremental
 * detokenizer gives the same text as the whole decode when no spaces are cleaned.
 * Tokenizers that normalize their input (WordPiece lowercases and strips accents) cannot
 * give it back and are exempt. Prints one summary line per vocabulary.
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
} tcase;

static const char *g_vocab, *g_expect = "pass", *g_texts, *g_ids;
static bool g_verbose;
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

/* The inputs of an .inp file: texts separated by "\n__ggml_vocab_test__\n" (the last one
 * followed by it too), exactly as test-tokenizer-0's read_tests splits them. */
static size_t read_inputs(const char *path, tcase **out)
{
    static const char sep[] = "\n__ggml_vocab_test__\n";
    size_t len, n = 0;
    char *raw = read_file(path, &len);
    if (!raw) return 0;
    tcase *c = NULL;
    for (size_t pos = 0; pos < len;) {
        const char *m = memmem(raw + pos, len - pos, sep, sizeof sep - 1);
        size_t end = m ? (size_t)(m - raw) : len;
        c = realloc(c, (n + 1) * sizeof *c);
        c[n] = (tcase){{malloc(end - pos + 1), end - pos}, NULL, 0};
        memcpy(c[n].text.s, raw + pos, end - pos);
        n++;
        pos = m ? end + sizeof sep - 1 : len;
    }
    free(raw);
    *out = c;
    return n;
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

/* decode(ids) must be the input (cleaned as llama.cpp would); false if not. */
static bool round_trip(const blob *in, const int32_t *ids, size_t n, size_t idx)
{
    size_t got_n = 0, st_n = 0;
    char *got = decode_all(ids, n, &got_n);
    char *st = decode_stream(ids, n, &st_n);
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
        if (check_rt) ok_rt += round_trip(&c[i].text, ids, n_ids, i);
        free(ids);
    }
    printf("%s: %s", base_name(g_vocab), td_tok_type_name(g_tok));
    if (check_ids) printf(", ids %zu/%zu", ok_ids, n);
    if (check_rt)
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
    if (with_ids && !read_outputs(ids, c, n)) {
        TH_CHECK(!"the .inp and .out files disagree");
        free_cases(c, n);
        return;
    }
    run_cases(c, n, with_ids, td_tok_lossless(g_tok));
    free_cases(c, n);
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
    }
    if (!g_vocab ||
        (strcmp(g_expect, "pass") && strcmp(g_expect, "load") && strcmp(g_expect, "refuse"))) {
        fprintf(stderr, "usage: test_tok_corpus --vocab F [--expect pass|load|refuse] "
                        "[--texts F.inp [--ids F.out]] [-v]\n");
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
