/* tokenizer.h: text <-> token ids from a GGUF file's tokenizer.ggml.* metadata, matching
 * llama.cpp (llama-vocab.cpp) for the same file.
 *
 * Purpose: encode prompts and decode generated ids for the serving nodes and the CLI.
 * Supported (tokenizer.ggml.model): "gpt2", byte-level BPE, with the pre-tokenizers
 * (tokenizer.ggml.pre) gpt-2, mpt, falcon, starcoder, refact, smollm, command-r,
 * llama3/llama-bpe, qwen2, qwen35, deepseek-llm, deepseek-coder, llama.cpp's "default" where
 * the file names none, and their aliases (tok_vocab.c's pre_table); "gemma4", BPE over raw
 * UTF-8 with spaces as U+2581; "llama", SentencePiece (score-ordered merges, byte fallback);
 * "bert", WordPiece (BERT's normalizer, greedy longest match); "t5", SentencePiece Unigram
 * (the file's precompiled charsmap and whitespace rules, then the Viterbi segmentation of
 * highest score; a malformed charsmap fails td_tok_create with TD_EFORMAT). Anything else
 * (rwkv, plamo2, other pre-tokenizers) fails td_tok_create with TD_EUNSUPP and a logged
 * message naming it: a vocabulary is never tokenized by a near match.
 * Checked against llama.cpp's own test vocabularies (tests/tokenizer.cmake, tok_corpus_*).
 *
 * Invariants: after td_tok_create succeeds, every id in [0, n_vocab) has a piece (possibly
 * empty); td_tok_encode only returns ids in [0, n_vocab). Input text is arbitrary bytes:
 * invalid UTF-8 never fails. BPE tokenizes each invalid byte as U+FFFD, as llama.cpp does
 * (overlong forms and surrogates count as invalid here; llama.cpp re-encodes them); spm
 * keeps each invalid byte as a byte-fallback token, so decoding gives the bytes back; Unigram
 * normalizes each invalid byte to U+FFFD with llama.cpp's own looser check (overlong forms
 * and surrogates pass) and tokenizes it as unknown.
 * Control tokens (token_type 3) and user-defined ones (4) are found in the raw text first,
 * longest first, when parse_special is true (user-defined ones always), never split.
 *
 * Threading: a created td_tokenizer is read-only; any number of threads may encode and
 * decode with it at once. A td_detok is used by one thread at a time.
 *
 * Ownership: td_tok_create copies what it needs; the td_gguf may be closed afterwards.
 * Pieces returned by td_tok_piece stay valid until td_tok_destroy. A td_detok borrows its
 * tokenizer until td_detok_fini.
 */
#ifndef TD_TOKENIZER_H
#define TD_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

typedef struct td_tokenizer td_tokenizer;

/* Token types of tokenizer.ggml.token_type (llama.cpp's LLAMA_TOKEN_TYPE_*). */
enum {
    TD_TOKTYPE_UNDEFINED = 0,
    TD_TOKTYPE_NORMAL = 1,
    TD_TOKTYPE_UNKNOWN = 2,
    TD_TOKTYPE_CONTROL = 3,
    TD_TOKTYPE_USER_DEFINED = 4,
    TD_TOKTYPE_UNUSED = 5,
    TD_TOKTYPE_BYTE = 6,
};

/* Build from metadata. Returns 0, or TD_EUNSUPP (unknown model/pre), TD_EFORMAT (missing or
 * inconsistent arrays), TD_ENOMEM; the reason is logged. *out is NULL on error. */
int td_tok_create(const td_gguf *g, td_tokenizer **out);
void td_tok_destroy(td_tokenizer *t); /* NULL is fine */

int32_t td_tok_n_vocab(const td_tokenizer *t);
int32_t td_tok_bos(const td_tokenizer *t); /* -1 if none */
int32_t td_tok_eos(const td_tokenizer *t); /* -1 if none */
bool td_tok_add_bos(const td_tokenizer *t);
/* End of generation: eos, eot/eom and tokens named like <|im_end|>, <|eot_id|>,
 * <|endoftext|>, <|end|>, <end_of_turn>, <|eom_id|>, <EOT> (llama.cpp's list). */
bool td_tok_is_eog(const td_tokenizer *t, int32_t id);
/* llama.cpp's clean_spaces: td_tok_decode drops the space in " ?", " 's" and the like. */
bool td_tok_clean_spaces(const td_tokenizer *t);
/* "BPE", "SPM", "WPM" or "UGM" (llama.cpp's vocabulary type names). */
const char *td_tok_type_name(const td_tokenizer *t);
/* The pre-tokenizer's name as the file gives it ("default" for a BPE file without one,
 * "none" for SentencePiece and WordPiece). Valid until td_tok_destroy. */
const char *td_tok_pre_name(const td_tokenizer *t);
/* Whether decoding gives back the text that was encoded (valid UTF-8, no special-token
 * text, before clean_spaces): false for WordPiece, which lowercases and strips accents, and
 * Unigram, which rewrites characters through its charsmap and merges whitespace (its decode
 * gives the normalized text, as llama.cpp's detokenize does). */
bool td_tok_lossless(const td_tokenizer *t);

/* Encode len bytes of text. add_special: prepend BOS / append EOS as the metadata says.
 * parse_special: recognise control-token text like "<|im_start|>". *ids is malloc'd
 * (never NULL on success, even when *n_ids is 0), caller frees. Returns 0, TD_EINVAL
 * (NULL arguments), TD_ENOMEM. */
int td_tok_encode(const td_tokenizer *t, const char *text, size_t len, bool add_special,
                  bool parse_special, int32_t **ids, size_t *n_ids);

/* Bytes of one token (not NUL-terminated), NULL for an invalid id. Control and unknown
 * tokens give their text ("<|im_end|>"); use td_tok_piece_render to hide them. */
const char *td_tok_piece(const td_tokenizer *t, int32_t id, size_t *len);
/* As the text of a reply shows it: control and unknown tokens are empty unless special. */
const char *td_tok_piece_render(const td_tokenizer *t, int32_t id, bool special, size_t *len);

/* Decode ids into out (up to cap bytes, not NUL-terminated), like llama.cpp's
 * llama_detokenize with remove_special=false: control tokens render only if special; a
 * leading space added by add_space_prefix is removed. Returns the number of bytes the
 * whole text needs (may be > cap: then only cap bytes were written), or TD_EINVAL for an
 * invalid id. */
long td_tok_decode(const td_tokenizer *t, const int32_t *ids, size_t n, bool special, char *out,
                   size_t cap);

/* Incremental detokenizer: fed ids one at a time, emits only complete UTF-8 characters.
 * A partial multi-byte sequence is held until it completes; bytes that can no longer
 * become a valid character are emitted as U+FFFD (one per maximal invalid subpart).
 *
 *   init --push*--> (pending holds 0..3 bytes of an unfinished character) --flush--> empty
 *
 * Control tokens render as empty unless special is set. The leading space that
 * add_space_prefix put before the first word is dropped, as llama.cpp's detokenize does. */
typedef struct {
    const td_tokenizer *tok; /* borrowed */
    bool special;            /* render control tokens' text */
    bool first;              /* no text emitted yet (for the space prefix) */
    uint8_t pending[4];      /* bytes of an unfinished UTF-8 character */
    uint8_t n_pending;
} td_detok;

void td_detok_init(td_detok *d, const td_tokenizer *t);
void td_detok_fini(td_detok *d);
/* Feed one id; appends the text that is now complete to out (up to cap bytes), returns
 * bytes written, TD_EINVAL for an invalid id, TD_ERANGE if cap is too small (nothing is
 * consumed then; 4 * piece length + 8 is always enough). */
int td_detok_push(td_detok *d, int32_t id, char *out, size_t cap);
/* Emit whatever is held (as U+FFFD: it can no longer complete). Returns bytes written or
 * TD_ERANGE if cap < 3 * pending. */
int td_detok_flush(td_detok *d, char *out, size_t cap);

#endif
