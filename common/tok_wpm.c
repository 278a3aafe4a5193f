/* tok_wpm.c: WordPiece (tokenizer.ggml.model "bert"), as llama.cpp's llm_tokenizer_wpm_session:
 * BERT's normalizer cuts a text fragment into words (whitespace separates them; punctuation,
 * ASCII symbols and CJK ideographs are words of their own; control characters are dropped;
 * accents are stripped (first codepoint of the NFD, marks dropped) and letters lowercased
 * unless tokenizer.ggml.normalizer.* turn that off), then each
 * word, prefixed with U+2581 as the converted vocabulary spells word starts, is covered by
 * greedy longest-prefix matches; a word that cannot be covered becomes the unknown token. */
#include "tokenizer.h"

#include "tok_internal.h"

#include <stdlib.h>

#include "td_err.h"

/* The CJK ideograph blocks BERT isolates (HF's _is_chinese_char, with its 0x2B920 start of
 * Extension E that llama.cpp copies). */
static bool is_chinese_char(uint32_t c)
{
    return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
           (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
           (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
           (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

/* Tokens for one word (w holds U+2581 and then the word): at each position the longest
 * token that starts there; if some position has none, the whole word is [UNK]. */
static int wpm_word(const td_tokenizer *t, const td_bytes *w, td_ids *out)
{
    size_t n = w->n, first = out->n;
    for (size_t i = 0; i < n;) {
        size_t j = i + t->max_token_len < n ? i + t->max_token_len : n;
        int32_t id = -1;
        for (; j > i; j--)
            if ((id = td_strmap_get(&t->tok_map, w->v + i, j - i)) >= 0) break;
        if (id < 0) {
            out->n = first; /* discard the word's tokens so far */
            break;
        }
        if (td_ids_push(out, id)) return TD_ENOMEM;
        i = j;
    }
    if (out->n == first && t->unk >= 0) return td_ids_push(out, t->unk);
    return 0;
}

/* End the current word (if it has any character) and tokenize it. */
static int flush_word(const td_tokenizer *t, td_bytes *w, td_ids *out)
{
    int rc = 0;
    if (w->n > 3) rc = wpm_word(t, w, out);
    w->n = 3; /* keep the U+2581 prefix */
    return rc;
}

int td_wpm_fragment(const td_tokenizer *t, const char *text, size_t len, td_ids *out)
{
    td_bytes w = {0};
    int rc = td_bytes_add(&w, "\xe2\x96\x81", 3);
    const uint8_t *s = (const uint8_t *)text;
    for (size_t off = 0; !rc && off < len;) {
        size_t k;
        uint32_t cpt = td_utf8_decode(s + off, len - off, &k);
        off += k;
        if (t->wpm_strip_accents) cpt = td_cpt_nfd_first(cpt);
        unsigned cls = td_cpt_class(cpt), cat = cls & TD_UCD_CAT_MASK;
        if (cls & TD_UCD_WS) {
            rc = flush_word(t, &w, out);
            continue;
        }
        if (cpt == 0 || cpt == TD_CPT_REPLACEMENT || cat == TD_UCD_CONTROL) continue;
        if (t->wpm_strip_accents && cat == TD_UCD_MARK) continue;
        uint8_t u[4];
        size_t n = td_utf8_encode(t->wpm_lowercase ? td_cpt_lower(cpt) : cpt, u);
        if (cat == TD_UCD_PUNCT || (cpt < 0x7F && cat == TD_UCD_SYMBOL) || is_chinese_char(cpt)) {
            rc = flush_word(t, &w, out); /* a word of its own */
            if (!rc) rc = td_bytes_add(&w, u, n);
            if (!rc) rc = flush_word(t, &w, out);
        } else {
            rc = td_bytes_add(&w, u, n);
        }
    }
    if (!rc) rc = flush_word(t, &w, out);
    free(w.v);
    return rc;
}
