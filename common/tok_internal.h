/* tok_internal.h: pieces shared by the tokenizer's files (not a public header).
 *
 * Purpose: the tokenizer's state (built by tok_vocab.c with tok_special.c, read by
 * tokenizer.c, which encodes, tok_wpm.c and tok_decode.c), its string map, UTF-8 decoding and
 * codepoint classes as the tokenizer sees them (tok_unicode.c), and the pre-tokenizers that
 * cut a text fragment into words before BPE (tok_pretok.c), and the Unigram model's
 * normalizer and pieces (tok_ugm.c). Invariants: td_utf8_decode never
 * reads past len and always advances by at least 1. Threading: pure functions over caller
 * buffers. Ownership: a td_words owns its arrays; td_words_fini frees them.
 */
#ifndef TD_TOK_INTERNAL_H
#define TD_TOK_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

#define TD_CPT_REPLACEMENT 0xFFFDu

/* Pre-tokenizer kinds: llama.cpp's LLAMA_VOCAB_PRE_TYPE_* we implement, each a sequence of
 * regex passes (llm_tokenizer_bpe's regex_exprs; tok_pretok.c lists them). */
typedef enum {
    TD_PRE_NONE = 0, /* spm, wpm: no pre-tokenizer */
    TD_PRE_DEFAULT,  /* gpt2 files without tokenizer.ggml.pre (aquila, gpt-neox) */
    TD_PRE_GPT2,     /* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S) */
    TD_PRE_SMOLLM,   /* \p{N} isolated, then TD_PRE_GPT2 (starcoder, refact, ...) */
    TD_PRE_FALCON,   /* punctuation runs, TD_PRE_GPT2, then [0-9]{3} */
    TD_PRE_LLAMA3, /* (?i:'s|..)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|.. */
    TD_PRE_QWEN2,  /* as TD_PRE_LLAMA3 with \p{N} (single digits) */
    TD_PRE_QWEN35, /* as TD_PRE_QWEN2 with combining marks in letter runs */
    TD_PRE_DEEPSEEK_LLM,   /* newlines, letters, punctuation, trailing spaces, CJK, numbers */
    TD_PRE_DEEPSEEK_CODER, /* newlines, \s?\p{L}+, \s?\p{P}+, CJK, single digits */
    TD_PRE_NEWLINES,       /* gemma4: [^\n]+|[\n]+ */
} td_pre_kind;

/* Decode one codepoint at s[0..len) (len >= 1) the way the tokenizer does: a valid
 * sequence gives its codepoint and length; anything else (stray continuation byte,
 * truncated sequence, overlong form, surrogate, > U+10FFFF, 0xF8..0xFF) gives U+FFFD and
 * length 1, so every invalid byte becomes one replacement character. */
uint32_t td_utf8_decode(const uint8_t *s, size_t len, size_t *n);
/* Encode cpt (<= 0x10FFFF) into out[0..4); returns its length. */
size_t td_utf8_encode(uint32_t cpt, uint8_t *out);

/* Codepoint classes (unicode_tables.h holds them in this encoding): a category group in
 * the low bits plus the White_Space bit. */
#define TD_UCD_OTHER     0u /* unassigned (Cn) */
#define TD_UCD_LETTER    1u /* \p{L} */
#define TD_UCD_NUMBER    2u /* \p{N} */
#define TD_UCD_MARK      3u /* \p{M} */
#define TD_UCD_PUNCT     4u /* \p{P} */
#define TD_UCD_SYMBOL    5u /* \p{S} */
#define TD_UCD_SEPARATOR 6u /* \p{Z} */
#define TD_UCD_CONTROL   7u /* \p{C} other than Cn */
#define TD_UCD_CAT_MASK  7u
#define TD_UCD_WS        8u /* bit: White_Space */

/* Class of a codepoint (tok_unicode.c, from unicode_tables.h): its category group
 * (TD_UCD_LETTER, _NUMBER, _MARK, _PUNCT, _SYMBOL, _SEPARATOR, _CONTROL, or _OTHER for
 * unassigned ones) in the TD_UCD_CAT_MASK bits, plus TD_UCD_WS for White_Space. */
unsigned td_cpt_class(uint32_t cpt);
/* Simple lowercase mapping (cpt itself if none). */
uint32_t td_cpt_lower(uint32_t cpt);
/* First codepoint of cpt's canonical decomposition (NFD), cpt itself if none. */
uint32_t td_cpt_nfd_first(uint32_t cpt);

/* Words of a fragment as codepoint counts. */
typedef struct {
    uint32_t *cpts; /* (n_cpts) decoded codepoints of the fragment */
    uint8_t *cls;   /* (n_cpts) their classes */
    size_t n_cpts;
    size_t *word_len; /* (n_words) codepoints per word, in order, summing to n_cpts */
    size_t n_words;
    size_t *prev_len; /* scratch: the previous pass's words */
    size_t cap_cpts, cap_cls, cap_words, cap_prev;
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

/* Growable id list (zero-initialised is empty). */
typedef struct {
    int32_t *v;
    size_t n, cap;
} td_ids;
int td_ids_push(td_ids *a, int32_t id); /* 0 or TD_ENOMEM */

/* Vocabulary kind: tokenizer.ggml.model "gpt2" and "gemma4" (BPE), "llama" (SentencePiece),
 * "bert" (WordPiece), "t5" (SentencePiece Unigram). */
typedef enum { TD_VOCAB_BPE, TD_VOCAB_SPM, TD_VOCAB_WPM, TD_VOCAB_UGM } td_vocab_kind;

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

/* Unigram (tokenizer.ggml.model "t5"; tok_ugm.c): the precompiled normalization charsmap,
 * checked whole when loaded (every unit a walk can reach, every replacement it can name), and
 * the token texts the Viterbi search matches. Built by td_ugm_load, freed by td_ugm_fini. */
typedef struct {
    uint32_t *units; /* (n_units) the charsmap's double-array trie (Darts-clone), host order */
    size_t n_units;  /* 0: no charsmap (characters go through unchanged) */
    char *repl;      /* (n_repl) the replacement strings, each NUL-terminated */
    size_t n_repl;
    int32_t *pieces; /* (n_pieces) normal, user-defined and unused ids sorted by text (bytes),
                      * one id per text (the last, as llama.cpp's trie keeps) */
    size_t n_pieces;
    size_t piece_from[257]; /* pieces[piece_from[b], piece_from[b + 1]) start with byte b */
    int32_t *user;          /* (n_user) user-defined ids sorted by text */
    size_t n_user;
    double unk_score;     /* score of an unknown character: the lowest normal score - 10 */
    bool remove_extra_ws; /* tokenizer.ggml.remove_extra_whitespaces */
} td_ugm;

/* Where a special token, found in raw text, takes the whitespace next to it away
 * (llama.cpp's LLAMA_TOKEN_ATTR_LSTRIP / _RSTRIP). */
#define TD_STRIP_LEFT  1u
#define TD_STRIP_RIGHT 2u

/* The tokenizer (typedef'd in tokenizer.h). Built by td_tok_create, read-only after. */
struct td_tokenizer {
    td_vocab_kind kind;
    td_pre_kind pre;
    char pre_name[32]; /* tokenizer.ggml.pre as given ("default" if missing) */
    int32_t n_vocab;
    char *pool;          /* token texts, then pieces, then merges, back to back */
    const char **text;   /* (n_vocab) token text as in the file (byte-level encoded for BPE) */
    uint32_t *text_len;  /* (n_vocab) */
    const char **piece;  /* (n_vocab) bytes the token stands for (control text included) */
    uint32_t *piece_len; /* (n_vocab) */
    uint8_t *type;       /* (n_vocab) TD_TOKTYPE_* */
    float *score;        /* (n_vocab) spm merge scores */
    uint8_t *eog;        /* (n_vocab) 1 if end of generation */
    uint8_t *strip;      /* (n_vocab) TD_STRIP_* of a special token */
    int32_t *special;    /* (n_special) control/user-defined/unknown ids, longest text first */
    size_t n_special;
    td_strmap tok_map;   /* text -> id (last id wins for duplicate texts) */
    td_strmap merge_map; /* "left right" -> rank (BPE) */
    int32_t bos, eos, unk, eot, eom, sep;
    bool add_bos, add_eos, add_sep, add_space_prefix, clean_spaces, ignore_merges;
    /* BPE: words are GPT-2 byte-level encoded (false for gemma4's SentencePiece-style BPE,
     * which merges raw UTF-8 and falls back to <0xXX> byte tokens) */
    bool byte_encode;
    bool escape_ws;                        /* spaces become U+2581 before pre-tokenizing (gemma4) */
    bool wpm_lowercase, wpm_strip_accents; /* wpm: BertNormalizer's options */
    uint32_t max_token_len;                /* longest token text in bytes (wpm's longest match) */
    int32_t byte_tok[256]; /* spm, non-byte-level BPE: id of <0xXX> (spm also the 1-byte
                            * text), -1 if none */
    char byte_enc[256][3]; /* BPE: GPT-2 byte-to-unicode, UTF-8, NUL-padded */
    uint8_t byte_enc_len[256];
    int16_t byte_dec[0x144]; /* BPE: codepoint (< 0x144) -> byte, -1 if not a byte char */
    td_ugm ugm;              /* Unigram only */
};

/* tok_vocab.c: the id under key, or def if it is missing or not in [0, n_vocab) (logged). */
int32_t td_tok_key_id(const td_gguf *g, const char *key, int32_t def, int32_t n_vocab);

/* tok_special.c: special tokens by name, as llama.cpp's loader finds them: eot / eom / fim
 * ids, end-of-generation tokens, control types forced on control-looking tokens, and the
 * strip attributes some models give their special tokens. Run after the special ids are
 * read, before the pieces are built. 0 (nothing can fail but allocation: TD_ENOMEM). */
int td_tok_find_specials(struct td_tokenizer *t, const td_gguf *g);
/* The special tokens (control, user-defined, unknown), longest text first, into
 * t->special, as td_tok_encode's partition tries them. 0 or TD_ENOMEM. */
int td_tok_collect_specials(struct td_tokenizer *t);

/* WordPiece (tok_wpm.c): BERT's normalizer and greedy longest-match over one raw text
 * fragment, appending ids to out. 0 or TD_ENOMEM. */
int td_wpm_fragment(const struct td_tokenizer *t, const char *text, size_t len, td_ids *out);

/* Unigram (tok_ugm.c). td_ugm_load: the charsmap (refused with TD_EFORMAT and a logged
 * reason if any part of it is malformed) and the piece index; run once the token types are
 * final. 0, TD_EFORMAT or TD_ENOMEM. td_ugm_fini frees it (safe on a zeroed one).
 * td_ugm_fragment: normalize one raw text fragment and append its best segmentation's ids to
 * out. 0 or TD_ENOMEM. */
int td_ugm_load(struct td_tokenizer *t, const td_gguf *g);
void td_ugm_fini(td_ugm *u);
int td_ugm_fragment(const struct td_tokenizer *t, const char *text, size_t len, td_ids *out);

#endif
