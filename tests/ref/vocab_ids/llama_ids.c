/* llama_ids.c: what llama.cpp's library gives for each text of an .inp file (texts separated
 * by "\n__ggml_vocab_test__\n"): OUT.out, one line of ids per text (llama_tokenize with
 * add_special and parse_special off, as write_ids.sh asks llama-tokenize), and OUT.dec, the
 * text llama_detokenize gives back for those ids (remove_special off, unparse_special on),
 * in the .inp format. For the vocabularies that normalize their input (Unigram), the .dec is
 * what test_tok_corpus --decoded compares td_tok_decode with.
 *
 * Built against a llama.cpp build tree (not part of Tandem's build):
 *   cc -O1 -o llama_ids llama_ids.c -I$LLAMA/include -I$LLAMA/ggml/include \
 *      -L$LLAMA/build/bin -lllama -Wl,-rpath,$LLAMA/build/bin
 * usage: llama_ids VOCAB.gguf TEXTS.inp OUT
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static const char sep[] = "\n__ggml_vocab_test__\n";

static const char *find_sep(const char *s, size_t n)
{
    size_t k = sizeof sep - 1;
    for (size_t i = 0; i + k <= n; i++)
        if (!memcmp(s + i, sep, k)) return s + i;
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: llama_ids VOCAB.gguf TEXTS.inp OUT\n");
        return 2;
    }
    struct llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 1;
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    FILE *f = fopen(argv[2], "rb");
    if (!f) return 1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *raw = malloc((size_t)n + 1);
    if (!raw || fread(raw, 1, (size_t)n, f) != (size_t)n) return 1;
    fclose(f);
    char path_ids[4096], path_dec[4096];
    snprintf(path_ids, sizeof path_ids, "%s.out", argv[3]);
    snprintf(path_dec, sizeof path_dec, "%s.dec", argv[3]);
    FILE *fo = fopen(path_ids, "wb"), *fd = fopen(path_dec, "wb");
    if (!fo || !fd) return 1;
    int32_t *ids = NULL;
    char *text = NULL;
    for (long pos = 0; pos < n;) {
        const char *m = find_sep(raw + pos, (size_t)(n - pos));
        long end = m ? m - raw : n;
        int32_t len = (int32_t)(end - pos), cap = len + 8;
        ids = realloc(ids, (size_t)cap * sizeof *ids); /* a text has at most len + 2 ids */
        int k = llama_tokenize(vocab, raw + pos, len, ids, cap, false, false);
        if (k < 0) return 3;
        for (int i = 0; i < k; i++)
            fprintf(fo, i ? " %d" : "%d", ids[i]);
        fputc('\n', fo);
        int w = llama_detokenize(vocab, ids, k, NULL, 0, false, true);
        text = realloc(text, (size_t)(w < 0 ? -w : w) + 1);
        if (w < 0) w = llama_detokenize(vocab, ids, k, text, -w, false, true);
        if (w < 0) return 3;
        fwrite(text, 1, (size_t)w, fd);
        fputs(sep, fd);
        pos = m ? end + (long)sizeof sep - 1 : n;
    }
    fclose(fo);
    fclose(fd);
    free(ids);
    free(text);
    free(raw);
    llama_model_free(model);
    return 0;
}
