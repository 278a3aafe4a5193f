/* tok_internal.h: pieces shared by the tokenizer's files (not a public header).
 *
 * Purpose: the tokenizer's state (built by tok_vocab.c, read by tokenizer.c, which encodes,
 * and tok_decode.c), its string map, UTF-8 decoding as the tokenizer sees it, codepoint classes,
 * and the pre-tokenizers that cut a text fragment into words before BPE. Invariants: td_utf8_decode
 * never reads past len and always advances by at least 1. Threading: pure functions over caller
 * buffers. Ownership: a td_words owns its arrays; td_words_fini frees them.
 */
#ifndef TD_TOK_INTERNAL_H
#define TD_TOK_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TD_CPT_REPLACEMENT 0xFFFDu

/* Pre-tokenizer kinds (llama.cpp's LLAMA_VOCAB_PRE_TYPE_* we implement). */
typedef enum {
    TD_PRE_NONE = 0, /* spm: no pre-tokenizer */
    TD_PRE_GPT2,   /* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
    TD_PRE_SMOLLM, /* \p{N} isolated, then TD_PRE_GPT2 */
    TD_PRE_LLAMA3, /* (?i:'s|..)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|...
                    */
    TD_PRE_QWEN2,  /* as TD_PRE_LLAMA3 with \p{N} (single digits) */
} td_pre_kind;

/* Decode one codepoint at s[0..len) (len >= 1) the way the tokenizer does: a valid
 * sequence gives its codepoint and length; anything else (stray continuation byte,
 * truncated sequence, overlong form, surrogate, > U+10FFFF, 0xF8..0xFF) gives U+FFFD and
 * length 1, so every invalid byte becomes one replacement character. */
uint32_t td_utf8_decode(const uint8_t *s, size_t len, size_t *n);
/* Encode cpt (<= 0x10FFFF) into out[0..4); returns its length. */
size_t td_utf8_encode(uint32_t cpt, uint8_t *out);

/* Class bits of a codepoint: TD_UCD_LETTER / TD_UCD_NUMBER / TD_UCD_OTHER | TD_UCD_WS. */
unsigned td_cpt_class(uint32_t cpt);

/* Words of a fragment as codepoint counts. */
typedef struct {
    uint32_t *cpts; /* (n_cpts) decoded codepoints of the fragment */
    size_t n_cpts;
    size_t *word_len; /* (n_words) codepoints per word, in order, summing to n_cpts */
    size_t n_words;
    size_t cap_cpts, cap_words;
} td_words;

void td_words_init(td_words *w);
void td_words_fini(td_words *w);
/* Decode text and split it with the pre-tokenizer; replaces w's contents. Returns 0 or
 * TD_ENOMEM. */
int td_pretokenize(td_pre_kind kind, const char *text, size_t len, td_words *w);

/* Growable byte buffer (zero-initialised is empty). */
typedef struct {
    char *v;
    size_t n, cap;
} td_bytes;
int td_bytes_reserve(td_bytes *b, size_t extra); /* 0 or TD_ENOMEM */
int td_bytes_add(td_bytes *b, const void *s, size_t n);

/* Vocabulary kind: tokenizer.ggml.model "gpt2" or "llama". */
typedef enum { TD_VOCAB_BPE, TD_VOCAB_SPM } td_vocab_kind;

/* Open-addressing hash map from a byte string (borrowed, stored as pointer + length) to
 * an int32 value. Keys must outlive the map. */
typedef struct {
    const char **key; /* (cap) NULL = empty slot */
    uint32_t *klen;   /* (cap) */
    int32_t *val;     /* (cap) */
    size_t cap;       /* power of two */
    size_t n;
} td_strmap;

/* Room for n_expected entries (the map never fills: capacity is >= 2x that). 0 or
 * TD_ENOMEM. td_strmap_fini frees it (safe on a zeroed map). */
int td_strmap_init(td_strmap *m, size_t n_expected);
void td_strmap_fini(td_strmap *m);
/* Insert or overwrite. */
void td_strmap_put(td_strmap *m, const char *k, size_t n, int32_t v);
/* The value of key k[0..n), or -1 (also on a map never initialised). */
int32_t td_strmap_get(const td_strmap *m, const char *k, size_t n);

/* The tokenizer (typedef'd in tokenizer.h). Built by td_tok_create, read-only after. */
struct td_tokenizer {
    td_vocab_kind kind;
    td_pre_kind pre;
    int32_t n_vocab;
    char *pool;          /* token texts, then pieces, then merges, back to back */
    const char **text;   /* (n_vocab) token text as in the file (byte-level encoded for BPE) */
    uint32_t *text_len;  /* (n_vocab) */
    const char **piece;  /* (n_vocab) bytes the token stands for (control text included) */
    uint32_t *piece_len; /* (n_vocab) */
    uint8_t *type;       /* (n_vocab) TD_TOKTYPE_* */
    float *score;        /* (n_vocab) spm merge scores */
    uint8_t *eog;        /* (n_vocab) 1 if end of generation */
    int32_t *special;    /* (n_special) control/user-defined/unknown ids, longest text first */
    size_t n_special;
    td_strmap tok_map;   /* text -> id (last id wins for duplicate texts) */
    td_strmap merge_map; /* "left right" -> rank (BPE) */
    int32_t bos, eos, unk, eot, eom;
    bool add_bos, add_eos, add_space_prefix, clean_spaces, ignore_merges;
    int32_t byte_tok[256]; /* spm: id of <0xXX> (or the 1-byte text), -1 if none */
    char byte_enc[256][3]; /* BPE: GPT-2 byte-to-unicode, UTF-8, NUL-padded */
    uint8_t byte_enc_len[256];
    int16_t byte_dec[0x144]; /* BPE: codepoint (< 0x144) -> byte, -1 if not a byte char */
};

#endif
