/* tokenizer.c: special-token partition, BPE and SentencePiece encoding, and the tokenizer's
 * getters (see tokenizer.h; follows llama-vocab.cpp; loading is in tok_vocab.c, the
 * pre-tokenizers in tok_pretok.c, WordPiece in tok_wpm.c, Unigram in tok_ugm.c, decoding in
 * tok_decode.c). */
#define _GNU_SOURCE /* memmem */
#include "tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"
#include "tok_internal.h"
#include "td_grow.h"

/* ---- growable buffers ---- */

int td_ids_push(td_ids *a, int32_t id)
{
    int rc = TD_GROW(a->v, a->cap, a->n + 1, 64);
    if (rc) return rc;
    a->v[a->n++] = id;
    return 0;
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
bool td_tok_is_eog(const td_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab && t->eog[id];
}
bool td_tok_clean_spaces(const td_tokenizer *t)
{
    return t->clean_spaces;
}
const char *td_tok_type_name(const td_tokenizer *t)
{
    switch (t->kind) {
    case TD_VOCAB_SPM:
        return "SPM";
    case TD_VOCAB_WPM:
        return "WPM";
    case TD_VOCAB_UGM:
        return "UGM";
    default:
        return "BPE";
    }
}
const char *td_tok_pre_name(const td_tokenizer *t)
{
    return t->pre_name;
}
bool td_tok_lossless(const td_tokenizer *t)
{
    return t->kind != TD_VOCAB_WPM && t->kind != TD_VOCAB_UGM;
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
    int rc = TD_GROW(h->v, h->cap, h->n + 1, 64);
    if (rc) return rc;
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
    td_bytes esc;   /* the fragment with its spaces escaped (gemma4) */
    td_words words; /* pre-tokenizer output */
} td_enc;

static int enc_syms_reserve(td_enc *e, size_t n)
{
    return TD_GROW(e->sym, e->cap_sym, n, 64);
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
    int32_t rank = td_strmap_get(&e->t->merge_map, e->key.v, e->key.n);
    if (rank < 0) return 0;
    return heap_push(&e->heap, (td_bigram){left, right, l->n, r->n, 0.0f, rank});
}

/* The whole word is one token: ignore_merges vocabularies (llama3) take it as is, and
 * gemma4 a word of newlines (llama.cpp#21343: its merges do not build those tokens). */
static int32_t bpe_whole_word(const td_enc *e)
{
    const td_tokenizer *t = e->t;
    bool newlines = t->pre == TD_PRE_NEWLINES && e->word.n > 0;
    for (size_t i = 0; newlines && i < e->word.n; i++)
        newlines = e->word.v[i] == '\n';
    if (!t->ignore_merges && !newlines) return -1;
    return td_strmap_get(&t->tok_map, e->word.v, e->word.n);
}

/* BPE one word (already in e->word, byte-level encoded where the vocabulary is) and append
 * its ids. */
static int bpe_word(td_enc *e)
{
    const td_tokenizer *t = e->t;
    int32_t whole = bpe_whole_word(e);
    if (whole >= 0) return td_ids_push(&e->out, whole);
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
        int32_t id = td_strmap_get(&t->tok_map, e->word.v + s->off, s->n);
        if (id >= 0) {
            if (td_ids_push(&e->out, id)) return TD_ENOMEM;
            continue;
        }
        /* not a token: each byte alone, if it is one (llama.cpp drops the rest): the
         * byte-level character, or <0xXX> in a vocabulary of raw UTF-8 */
        for (uint32_t j = 0; j < s->n; j++) {
            uint8_t c = (uint8_t)e->word.v[s->off + j];
            int32_t bid = t->byte_encode ? td_strmap_get(&t->tok_map, e->word.v + s->off + j, 1)
                                         : t->byte_tok[c];
            if (bid >= 0 && td_ids_push(&e->out, bid)) return TD_ENOMEM;
        }
    }
    return 0;
}

/* text with each space as U+2581 (llama_escape_whitespace), into e->esc */
static int escape_spaces(td_enc *e, const char *text, size_t len)
{
    e->esc.n = 0;
    for (size_t i = 0; i < len; i++) {
        int rc = text[i] == ' ' ? td_bytes_add(&e->esc, "\xe2\x96\x81", 3)
                                : td_bytes_add(&e->esc, text + i, 1);
        if (rc) return rc;
    }
    return 0;
}

static int bpe_fragment(td_enc *e, const char *text, size_t len)
{
    const td_tokenizer *t = e->t;
    if (t->escape_ws) {
        if (escape_spaces(e, text, len)) return TD_ENOMEM;
        text = e->esc.v, len = e->esc.n;
    }
    int rc = td_pretokenize(t->pre, text, len, &e->words);
    if (rc) return rc;
    size_t c0 = 0;
    for (size_t w = 0; w < e->words.n_words; w++) {
        size_t nc = e->words.word_len[w];
        e->word.n = 0;
        for (size_t c = c0; c < c0 + nc; c++) {
            uint8_t u[4];
            size_t k = td_utf8_encode(e->words.cpts[c], u);
            for (size_t j = 0; j < k; j++) {
                rc = t->byte_encode
                         ? td_bytes_add(&e->word, t->byte_enc[u[j]], t->byte_enc_len[u[j]])
                         : td_bytes_add(&e->word, u + j, 1);
                if (rc) return rc;
            }
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
    int32_t id = td_strmap_get(&e->t->tok_map, e->word.v + l->off, (size_t)l->n + r->n);
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
        int32_t id = td_strmap_get(&t->tok_map, e->word.v + s->off, s->n);
        if (id >= 0) {
            if (td_ids_push(&e->out, id)) return TD_ENOMEM;
            continue;
        }
        /* every merged symbol is a token, so this is one character without a token:
         * byte fallback */
        for (uint32_t j = 0; j < s->n; j++) {
            int32_t bid = t->byte_tok[(uint8_t)e->word.v[s->off + j]];
            if (bid < 0) bid = t->unk;
            if (bid >= 0 && td_ids_push(&e->out, bid)) return TD_ENOMEM;
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
    int rc = TD_GROW(f->v, f->cap, f->n + 1, 16);
    if (rc) return rc;
    f->v[f->n++] = x;
    return 0;
}

/* isspace() in the C locale, as llama.cpp's partition strips */
static bool is_space(char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r');
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
                size_t mo = (size_t)(m - text), left = mo;
                /* lstrip / rstrip: the token takes the ASCII whitespace next to it away */
                while ((t->strip[id] & TD_STRIP_LEFT) && left > pos && is_space(text[left - 1]))
                    left--;
                if (left > pos) rc = frags_push(&b, (td_frag){-1, pos, left - pos});
                if (!rc) rc = frags_push(&b, (td_frag){id, mo, sl});
                pos = mo + sl;
                while ((t->strip[id] & TD_STRIP_RIGHT) && pos < end && is_space(text[pos]))
                    pos++;
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
    if (!rc && add_special && t->add_bos) rc = td_ids_push(&e.out, t->bos);
    bool prev_special = true; /* spm: a space prefix goes before the first text */
    for (size_t i = 0; !rc && i < frags.n; i++) {
        const td_frag *f = &frags.v[i];
        if (f->id >= 0) {
            rc = td_ids_push(&e.out, f->id);
            prev_special = true;
        } else if (t->kind == TD_VOCAB_BPE) {
            rc = bpe_fragment(&e, text + f->off, f->len);
        } else if (t->kind == TD_VOCAB_WPM) {
            rc = td_wpm_fragment(t, text + f->off, f->len, &e.out);
        } else if (t->kind == TD_VOCAB_UGM) {
            rc = td_ugm_fragment(t, text + f->off, f->len, &e.out);
        } else {
            rc = spm_fragment(&e, text + f->off, f->len, t->add_space_prefix && prev_special);
            prev_special = false;
        }
    }
    if (!rc && add_special && t->add_eos) rc = td_ids_push(&e.out, t->eos);
    if (!rc && add_special && t->add_sep) rc = td_ids_push(&e.out, t->sep); /* wpm: [SEP] */
    if (!rc && !e.out.v) { /* never NULL on success */
        e.out.v = malloc(sizeof *e.out.v);
        if (!e.out.v) rc = TD_ENOMEM;
    }
    free(frags.v);
    free(e.sym);
    free(e.heap.v);
    free(e.word.v);
    free(e.key.v);
    free(e.esc.v);
    td_words_fini(&e.words);
    if (rc) {
        free(e.out.v);
        return rc;
    }
    *ids = e.out.v;
    *n_ids = e.out.n;
    return 0;
}
