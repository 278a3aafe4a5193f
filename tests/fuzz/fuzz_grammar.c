/* fuzz_grammar.c: libFuzzer target for structured output (grammar/gr_grammar.h): the JSON
 * schema compiler and the matcher.
 *
 * Input: a schema's JSON text, a NUL byte, then a document's bytes. The schema is compiled
 * (strict when the first document byte is odd); if it compiles, a matcher over a small
 * byte-level vocabulary (all 256 single bytes plus a few JSON-ish multi-byte tokens, EOG
 * last) is fed the document one byte at a time; at each step the mask is computed and
 * checked against gr_matcher_accept_token for every token. Without a NUL the whole input is
 * a document for json_object.
 * Oracle: no crash, leak or out-of-bounds access; compile errors come with a message; the
 * mask and accept_token agree; a rejected byte leaves the state unchanged.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gr_grammar.h"
#include "td_err.h"

static const char *multi[] = {"{\"", "\":", "\",", "\"}",  "true", "null",
                              "[]",  "{}",  "  ",  "\n  ", "12",   "\\u00"};
#define N_MULTI ((int32_t)(sizeof multi / sizeof multi[0]))
#define NV      (256 + N_MULTI + 1)

static char bytes1[256];

static const char *piece(void *ctx, int32_t id, size_t *len)
{
    (void)ctx;
    if (id < 256) {
        *len = 1;
        return &bytes1[id];
    }
    if (id < 256 + N_MULTI) {
        *len = strlen(multi[id - 256]);
        return multi[id - 256];
    }
    return NULL;
}

static gr_vocab *vocab(void)
{
    static gr_vocab *v;
    if (!v) {
        for (int i = 0; i < 256; i++)
            bytes1[i] = (char)i;
        int32_t eog = NV - 1;
        if (gr_vocab_create(NV, piece, NULL, &eog, 1, &v)) abort();
    }
    return v;
}

static void check_mask(gr_grammar *g, gr_matcher *m, const uint8_t *doc, size_t k)
{
    const uint32_t *mask;
    int rc = gr_matcher_mask(m, &mask);
    if (rc == TD_ENOMEM) return;
    if (rc && rc != TD_ESTATE) abort();
    uint32_t copy[(NV + 31) / 32];
    memcpy(copy, mask, sizeof copy);
    for (int32_t id = 0; id < NV; id += 7) { /* a sample of the tokens keeps it fast */
        gr_matcher *t = NULL;
        if (gr_matcher_create(g, vocab(), &t)) return;
        if (gr_matcher_accept_bytes(t, (const char *)doc, k)) abort();
        int ok = gr_matcher_accept_token(t, id) == 0;
        if (ok != (int)(copy[id >> 5] >> (id & 31) & 1)) abort();
        gr_matcher_destroy(t);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = memchr(data, 0, size);
    gr_grammar *g = NULL;
    char err[256] = "";
    const uint8_t *doc = data;
    size_t n = size;
    if (nul) {
        size_t sl = (size_t)(nul - data);
        char *text = malloc(sl + 1);
        if (!text) return 0;
        memcpy(text, data, sl);
        text[sl] = 0;
        doc = nul + 1;
        n = size - sl - 1;
        int32_t kind = n && (doc[0] & 1) ? TD_GRAMMAR_JSON_SCHEMA_STRICT : TD_GRAMMAR_JSON_SCHEMA;
        int rc = gr_compile_text(kind, text, &g, err, sizeof err);
        free(text);
        if (rc) {
            if (!err[0]) abort(); /* every error says why */
            return 0;
        }
    } else if (gr_compile_json_object(&g)) {
        return 0;
    }
    gr_matcher *m = NULL;
    if (gr_matcher_create(g, vocab(), &m)) {
        gr_grammar_unref(g);
        return 0;
    }
    if (n > 256) n = 256;
    size_t k = 0;
    for (; k < n; k++) {
        if (k < 24) check_mask(g, m, doc, k);
        if (gr_matcher_accept_bytes(m, (const char *)doc + k, 1)) break;
    }
    (void)gr_matcher_done(m);
    gr_matcher_destroy(m);
    gr_grammar_unref(g);
    return 0;
}
