/* test_tokenizer.c: the tokenizer test driver. tests/ref/tok_reference.py writes a corpus
 * (one hex-encoded string per line) and the ids an independent reference gives for it;
 * this driver encodes the same strings with td_tok_encode and checks ids, round trips,
 * the incremental detokenizer, special-token metadata and speed.
 *
 *   test_tokenizer --model F --corpus F --expect F [--parse-special 0|1]
 *   test_tokenizer --model F --expect-create-fail CODE
 *
 * Expect file: "#key values" lines (n_vocab, bos, eos, add_bos, eog, spm) then one line
 * per corpus string: "ids <id>* | text <hex>" or "skip | text <hex>" (skip: no reference
 * ids, only the round trip is checked); text is what decoding must give back.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gguf.h"
#include "td_err.h"
#include "tharness.h"
#include "tokenizer.h"

typedef struct {
    char *s;
    size_t n;
} blob;

typedef struct {
    bool skip;
    int32_t *ids;
    size_t n_ids;
    blob text;
} expect_line;

static const char *g_model, *g_corpus, *g_expect;
static int g_parse_special = 1;
static td_tokenizer *g_tok;
static blob *g_inputs;
static expect_line *g_exp;
static size_t g_n;
static long g_meta_bos = -2, g_meta_eos = -2, g_meta_add_bos = -2, g_meta_nvocab = -2;
static int32_t g_eog[64];
static size_t g_n_eog;
static bool g_has_eog;

static int hexval(int c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static blob unhex(const char *s, size_t n)
{
    blob b = {malloc(n / 2 + 1), 0};
    for (size_t i = 0; i + 1 < n; i += 2) {
        int h = hexval(s[i]), l = hexval(s[i + 1]);
        if (h < 0 || l < 0) break;
        b.s[b.n++] = (char)(h * 16 + l);
    }
    return b;
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) n = 0;
    buf[n] = '\0';
    fclose(f);
    *len = (size_t)n;
    return buf;
}

/* Split into lines in place; returns the count. */
static size_t split_lines(char *buf, char ***lines)
{
    size_t n = 0, cap = 64;
    *lines = malloc(cap * sizeof **lines);
    for (char *p = buf; *p;) {
        char *e = strchr(p, '\n');
        if (e) *e = '\0';
        if (n == cap) *lines = realloc(*lines, (cap *= 2) * sizeof **lines);
        (*lines)[n++] = p;
        if (!e) break;
        p = e + 1;
    }
    return n;
}

static bool load_inputs(void)
{
    size_t len;
    char *cbuf = read_file(g_corpus, &len), *ebuf = read_file(g_expect, &len);
    if (!cbuf || !ebuf) {
        fprintf(stderr, "cannot read corpus or expect file\n");
        return false;
    }
    char **cl, **el;
    size_t nc = split_lines(cbuf, &cl), ne = split_lines(ebuf, &el);
    g_inputs = calloc(nc + 1, sizeof *g_inputs);
    g_exp = calloc(nc + 1, sizeof *g_exp);
    for (size_t i = 0; i < nc; i++)
        g_inputs[g_n++] = unhex(cl[i], strlen(cl[i])); /* "" too */
    size_t k = 0;
    for (size_t i = 0; i < ne; i++) {
        char *l = el[i];
        if (l[0] == '#') {
            char key[32];
            long v;
            if (sscanf(l, "#%31s", key) != 1) continue;
            const char *vals = l + 1 + strlen(key);
            if (!strcmp(key, "eog")) {
                g_has_eog = true;
                char *end;
                for (const char *p = vals; g_n_eog < 64; p = end) {
                    v = strtol(p, &end, 10);
                    if (end == p) break;
                    g_eog[g_n_eog++] = (int32_t)v;
                }
                continue;
            }
            v = strtol(vals, NULL, 10);
            if (!strcmp(key, "bos")) g_meta_bos = v;
            if (!strcmp(key, "eos")) g_meta_eos = v;
            if (!strcmp(key, "add_bos")) g_meta_add_bos = v;
            if (!strcmp(key, "n_vocab")) g_meta_nvocab = v;
            continue;
        }
        if (!l[0] || k >= g_n) continue;
        expect_line *x = &g_exp[k++];
        char *bar = strstr(l, " | text ");
        if (!bar) continue;
        *bar = '\0';
        const char *th = bar + 8;
        x->text = unhex(th, strlen(th));
        if (!strncmp(l, "skip", 4)) {
            x->skip = true;
            continue;
        }
        x->ids = malloc((strlen(l) + 1) * sizeof *x->ids);
        char *end;
        for (const char *p = l + 3;; p = end) {
            long v = strtol(p, &end, 10);
            if (end == p) break;
            x->ids[x->n_ids++] = (int32_t)v;
        }
    }
    free(cl);
    free(el);
    free(cbuf);
    free(ebuf);
    if (k != g_n) fprintf(stderr, "corpus has %zu strings, expect file %zu\n", g_n, k);
    return k == g_n && g_n > 0;
}

static void show_ids(const char *what, const int32_t *ids, size_t n)
{
    fprintf(stderr, "  %s:", what);
    for (size_t i = 0; i < n && i < 40; i++)
        fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, n > 40 ? " ...\n" : "\n");
}

static void test_reference_ids(void)
{
    size_t matched = 0, compared = 0;
    for (size_t i = 0; i < g_n; i++) {
        int32_t *ids = NULL;
        size_t n = 0;
        int rc = td_tok_encode(g_tok, g_inputs[i].s, g_inputs[i].n, false, g_parse_special != 0,
                               &ids, &n);
        TH_CHECKF(rc == 0, "string %zu: encode failed %d", i, rc);
        for (size_t j = 0; j < n; j++)
            TH_CHECK(ids[j] >= 0 && ids[j] < td_tok_n_vocab(g_tok));
        if (!g_exp[i].skip) {
            compared++;
            bool same = n == g_exp[i].n_ids && !memcmp(ids, g_exp[i].ids, n * sizeof *ids);
            TH_CHECKF(same, "string %zu (%zu bytes): ids differ from the reference", i,
                      g_inputs[i].n);
            if (same)
                matched++;
            else {
                fprintf(stderr, "  input: '%.*s'\n", (int)g_inputs[i].n, g_inputs[i].s);
                show_ids("ours", ids, n);
                show_ids("reference", g_exp[i].ids, g_exp[i].n_ids);
            }
        }
        free(ids);
    }
    fprintf(stderr, "reference: %zu/%zu strings matched (%zu without reference ids)\n", matched,
            compared, g_n - compared);
}

/* Decode ids through the incremental detokenizer; checks that every chunk is whole UTF-8
 * characters. Returns the malloc'd text. */
static char *stream_decode(const int32_t *ids, size_t n, size_t *len)
{
    td_detok d;
    td_detok_init(&d, g_tok);
    d.special = true;
    size_t cap = 64, total = 0;
    char *all = malloc(cap);
    for (size_t i = 0; i <= n; i++) {
        char chunk[1024];
        int w = i < n ? td_detok_push(&d, ids[i], chunk, sizeof chunk)
                      : td_detok_flush(&d, chunk, sizeof chunk);
        TH_CHECK(w >= 0);
        if (w <= 0) continue;
        /* a chunk never ends inside a character: its last lead byte is complete */
        size_t k = (size_t)w;
        size_t lead = k - 1;
        while (lead > 0 && ((uint8_t)chunk[lead] & 0xC0) == 0x80)
            lead--;
        uint8_t c = (uint8_t)chunk[lead];
        size_t need = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        TH_CHECKF(k - lead == need, "chunk of token %zu ends inside a character", i);
        while (total + k > cap)
            all = realloc(all, cap *= 2);
        memcpy(all + total, chunk, k);
        total += k;
    }
    td_detok_fini(&d);
    *len = total;
    return all;
}

static void test_round_trip(void)
{
    for (size_t i = 0; i < g_n; i++) {
        int32_t *ids = NULL;
        size_t n = 0;
        if (td_tok_encode(g_tok, g_inputs[i].s, g_inputs[i].n, false, g_parse_special != 0, &ids,
                          &n) != 0)
            continue;
        size_t len;
        char *text = stream_decode(ids, n, &len);
        const blob *want = &g_exp[i].text;
        TH_CHECKF(len == want->n && !memcmp(text, want->s, len),
                  "string %zu: streamed decode differs from the expected text ('%.*s' vs '%.*s')",
                  i, (int)len, text, (int)want->n, want->s);
        /* whole decode equals the streamed one for valid text (and no space clean-up) */
        long whole = td_tok_decode(g_tok, ids, n, true, NULL, 0);
        TH_CHECK(whole >= 0);
        char *buf = malloc((size_t)whole + 1);
        TH_CHECK(td_tok_decode(g_tok, ids, n, true, buf, (size_t)whole) == whole);
        bool valid_in = want->n == g_inputs[i].n && !memcmp(want->s, g_inputs[i].s, want->n);
        if (valid_in && (whole == (long)len) && memcmp(buf, text, len) == 0) {
            /* fine */
        } else if (valid_in) {
            /* allowed to differ only through llama.cpp's clean_spaces */
            TH_CHECKF(td_tok_clean_spaces(g_tok),
                      "string %zu: td_tok_decode differs from the streamed decode", i);
        }
        free(buf);
        free(text);
        free(ids);
    }
}

static void test_meta(void)
{
    if (g_meta_nvocab != -2) TH_CHECK(td_tok_n_vocab(g_tok) == g_meta_nvocab);
    if (g_meta_bos != -2) TH_CHECK(td_tok_bos(g_tok) == g_meta_bos);
    if (g_meta_eos != -2) TH_CHECK(td_tok_eos(g_tok) == g_meta_eos);
    if (g_meta_add_bos != -2) TH_CHECK(td_tok_add_bos(g_tok) == (g_meta_add_bos != 0));
    if (g_has_eog) {
        size_t n_eog = 0;
        for (int32_t id = 0; id < td_tok_n_vocab(g_tok); id++)
            n_eog += td_tok_is_eog(g_tok, id);
        TH_CHECKF(n_eog == g_n_eog, "%zu eog tokens, expected %zu", n_eog, g_n_eog);
        for (size_t i = 0; i < g_n_eog; i++)
            TH_CHECKF(td_tok_is_eog(g_tok, g_eog[i]), "token %d should be eog", g_eog[i]);
    }
    TH_CHECK(!td_tok_is_eog(g_tok, -1) && !td_tok_is_eog(g_tok, td_tok_n_vocab(g_tok)));
    TH_CHECK(td_tok_piece(g_tok, -1, NULL) == NULL);
    TH_CHECK(td_tok_piece(g_tok, td_tok_n_vocab(g_tok), NULL) == NULL);
    /* add_special adds BOS exactly when the metadata says */
    int32_t *ids;
    size_t n;
    TH_REQUIRE(td_tok_encode(g_tok, "hi", 2, true, false, &ids, &n) == 0);
    TH_CHECK(n > 0);
    if (n > 0) TH_CHECK((ids[0] == td_tok_bos(g_tok)) == td_tok_add_bos(g_tok));
    free(ids);
    TH_REQUIRE(td_tok_encode(g_tok, "", 0, false, false, &ids, &n) == 0);
    TH_CHECK(n == 0 && ids != NULL);
    free(ids);
    td_detok d;
    td_detok_init(&d, g_tok);
    char small[1];
    TH_CHECK(td_detok_push(&d, -5, small, sizeof small) == TD_EINVAL);
    td_detok_fini(&d);
}

/* Streaming an emoji split across byte tokens holds bytes back until complete. */
static void test_detok_partial(void)
{
    static const char text[] = "a\xF0\x9F\x98\x80"
                               "b\xE4\xB8\xAD";
    int32_t *ids;
    size_t n;
    TH_REQUIRE(td_tok_encode(g_tok, text, sizeof text - 1, false, false, &ids, &n) == 0);
    size_t len;
    char *out = stream_decode(ids, n, &len);
    TH_CHECK(len == sizeof text - 1 && !memcmp(out, text, len));
    free(out);
    free(ids);
}

static void test_perf(void)
{
    size_t cap = 100 * 1024, len = 0;
    char *big = malloc(cap);
    for (size_t i = 0; len < cap; i = (i + 1) % g_n) {
        size_t k = g_inputs[i].n < cap - len ? g_inputs[i].n : cap - len;
        memcpy(big + len, g_inputs[i].s, k);
        len += k;
        if (g_n == 0) break;
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int32_t *ids;
    size_t n;
    int rc = td_tok_encode(g_tok, big, len, false, true, &ids, &n);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    fprintf(stderr, "perf: %zu bytes -> %zu tokens in %.3f s\n", len, rc == 0 ? n : 0, s);
    TH_CHECK(rc == 0);
    TH_CHECKF(s < 1.0, "100 KB took %.3f s", s);
    if (rc == 0) free(ids);
    free(big);
}

int main(int argc, char **argv)
{
    long expect_fail = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--model"))
            g_model = argv[i + 1];
        else if (!strcmp(argv[i], "--corpus"))
            g_corpus = argv[i + 1];
        else if (!strcmp(argv[i], "--expect"))
            g_expect = argv[i + 1];
        else if (!strcmp(argv[i], "--parse-special"))
            g_parse_special = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--expect-create-fail"))
            expect_fail = atol(argv[i + 1]);
    }
    if (!g_model) {
        fprintf(stderr, "usage: test_tokenizer --model F --corpus F --expect F\n");
        return 2;
    }
    char err[256] = "";
    td_gguf *g = NULL;
    if (td_gguf_open(g_model, &g, err, sizeof err) != 0) {
        fprintf(stderr, "cannot open %s: %s\n", g_model, err);
        return 1;
    }
    int rc = td_tok_create(g, &g_tok);
    td_gguf_close(g); /* the tokenizer must not need the file any more */
    if (expect_fail) {
        TH_CHECKF(rc == expect_fail && g_tok == NULL, "td_tok_create gave %d, want %ld", rc,
                  expect_fail);
        td_tok_destroy(g_tok);
        TH_EXIT();
    }
    if (rc != 0) {
        fprintf(stderr, "td_tok_create: %s\n", td_strerror(rc));
        return 1;
    }
    if (!load_inputs()) return 1;
    TH_RUN(test_meta);
    TH_RUN(test_reference_ids);
    TH_RUN(test_round_trip);
    TH_RUN(test_detok_partial);
    TH_RUN(test_perf);
    for (size_t i = 0; i < g_n; i++) {
        free(g_inputs[i].s);
        free(g_exp[i].ids);
        free(g_exp[i].text.s);
    }
    free(g_inputs);
    free(g_exp);
    td_tok_destroy(g_tok);
    TH_EXIT();
}
