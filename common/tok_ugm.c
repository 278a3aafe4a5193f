/* tok_ugm.c: the Unigram tokenizer (tokenizer.ggml.model "t5": SentencePiece's unigram
 * model, as llama.cpp's llm_tokenizer_ugm runs it). A raw text fragment is normalized (the
 * precompiled charsmap's longest-prefix replacements, then whitespace: runs of spaces merged
 * where remove_extra_whitespaces says, a U+2581 before the first word (add_space_prefix) or
 * before every word (merged runs), spaces escaped as U+2581), then cut by a Viterbi search
 * into the pieces of highest total score; a character no piece covers is the unknown token,
 * and unknowns in a row are one. The charsmap is untrusted input from the file: td_ugm_load
 * checks every unit a walk can reach and every replacement it can name, so a malformed one
 * is refused when the file is loaded, and the walk bounds-checks each read all the same.
 *
 * The charsmap (sentencepiece's precompiled_charsmap): a 4-byte little-endian size in bytes
 * of a Darts-clone double-array trie of 32-bit little-endian units, the trie, then the
 * replacement strings, each NUL-terminated. A unit packs: the label (byte) in bits 0-7 (bit
 * 31 set marks a value unit, which no byte matches), "has a leaf" in bit 8, and an offset in
 * bits 10-30 (shifted left 8 more when bit 9 is set). From a node at index i, the child for
 * byte c sits at (i ^ offset(i)) ^ c; a node with a leaf has, at i ^ offset(i), a value unit
 * whose low 31 bits are the byte offset of its replacement string.
 */
#define _GNU_SOURCE /* qsort_r */
#include "tokenizer.h"

#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"
#include "tok_internal.h"

#define UGM_KEY_CHARSMAP "tokenizer.ggml.precompiled_charsmap"
#define UGM_MAX_CHARSMAP (64u << 20)    /* bytes; sentencepiece's are under 1 MiB */
#define UGM_UNK_PENALTY  10.0f          /* sentencepiece's kUnkPenalty, llama.cpp's too */
#define UGM_SPACE        "\xe2\x96\x81" /* U+2581 */

/* ---- the charsmap's trie ---- */

static uint32_t unit_offset(uint32_t u)
{
    return (u >> 10) << ((u & (1u << 9)) >> 6);
}
static uint32_t unit_label(uint32_t u)
{
    return u & ((1u << 31) | 0xFFu);
}
static bool unit_has_leaf(uint32_t u)
{
    return (u >> 8) & 1u;
}
static uint32_t unit_value(uint32_t u)
{
    return u & ((1u << 31) - 1);
}

/* Every node a walk can reach from the root: the block of its children lies inside the
 * array (a walk probes block ^ c for whatever byte c comes next), and the replacement of each
 * key lies inside the strings, NUL-terminated before their end. Each unit is taken once, so
 * a malformed trie with cycles still ends. 0, TD_EFORMAT (logged) or TD_ENOMEM. */
static int check_trie(const td_ugm *u)
{
    size_t n = u->n_units;
    if (n == 0) return 0;
    uint32_t root = unit_offset(u->units[0]);
    if ((size_t)(root | 0xFFu) >= n) {
        TD_LOG_ERR("tokenizer: %s: the root's children (unit %u) lie outside the trie's %zu "
                   "units",
                   UGM_KEY_CHARSMAP, root, n);
        return TD_EFORMAT;
    }
    uint32_t *stack = malloc((n + 1) * sizeof *stack); /* blocks still to visit */
    uint8_t *seen = calloc(n, 1);                      /* (n_units) child units taken */
    if (!stack || !seen) {
        free(stack);
        free(seen);
        return TD_ENOMEM;
    }
    size_t top = 0;
    int rc = 0;
    stack[top++] = root;
    while (!rc && top) {
        uint32_t block = stack[--top];
        for (uint32_t c = 1; c < 256; c++) {
            uint32_t i = block ^ c; /* < n: block | 0xFF is */
            if (unit_label(u->units[i]) != c || seen[i]) continue;
            seen[i] = 1;
            uint32_t next = i ^ unit_offset(u->units[i]);
            if ((size_t)(next | 0xFFu) >= n) {
                TD_LOG_ERR("tokenizer: %s: unit %u points to unit %u, outside the trie's %zu "
                           "units",
                           UGM_KEY_CHARSMAP, i, next, n);
                rc = TD_EFORMAT;
                break;
            }
            if (unit_has_leaf(u->units[i])) {
                uint32_t v = unit_value(u->units[next]);
                if (v >= u->n_repl || !memchr(u->repl + v, 0, u->n_repl - v)) {
                    TD_LOG_ERR("tokenizer: %s: unit %u names replacement string %u, outside "
                               "the %zu bytes of strings or not NUL-terminated",
                               UGM_KEY_CHARSMAP, next, v, u->n_repl);
                    rc = TD_EFORMAT;
                    break;
                }
            }
            stack[top++] = next;
        }
    }
    free(stack);
    free(seen);
    return rc;
}

/* The charsmap's bytes (an array of U8 or I8) into *out, (*n). 0, TD_EFORMAT or TD_ENOMEM. */
static int read_bytes(const td_gguf *g, uint8_t **out, size_t *n)
{
    td_gguf_vtype et;
    if (td_gguf_get_arr(g, UGM_KEY_CHARSMAP, &et, n) != 0 ||
        (et != TD_GGUF_U8 && et != TD_GGUF_I8)) {
        TD_LOG_ERR("tokenizer: %s is not an array of bytes", UGM_KEY_CHARSMAP);
        return TD_EFORMAT;
    }
    if (*n < 5 || *n > UGM_MAX_CHARSMAP) {
        TD_LOG_ERR("tokenizer: %s has %zu bytes (a 4-byte trie size, the trie and its strings "
                   "must fit in 5..%u)",
                   UGM_KEY_CHARSMAP, *n, UGM_MAX_CHARSMAP);
        return TD_EFORMAT;
    }
    int32_t *wide = malloc(*n * sizeof *wide);
    uint8_t *b = calloc(*n, 1); /* calloc: GCC cannot see that the loop below fills it */
    int rc = wide && b ? 0 : TD_ENOMEM;
    if (!rc && td_gguf_arr_read_i32(g, UGM_KEY_CHARSMAP, wide, *n) != 0) {
        TD_LOG_ERR("tokenizer: %s cannot be read", UGM_KEY_CHARSMAP);
        rc = TD_EFORMAT;
    }
    for (size_t i = 0; !rc && i < *n; i++)
        b[i] = (uint8_t)wide[i];
    free(wide);
    if (rc) {
        free(b);
        return rc;
    }
    *out = b;
    return 0;
}

/* The charsmap, if the file has one (without it, characters go through unchanged): its trie
 * units and strings copied out and the whole trie checked. */
static int load_charsmap(td_ugm *u, const td_gguf *g)
{
    if (td_gguf_find_kv(g, UGM_KEY_CHARSMAP) < 0) return 0;
    uint8_t *b = NULL;
    size_t n = 0;
    int rc = read_bytes(g, &b, &n);
    if (rc) return rc;
    uint32_t trie = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
                    (uint32_t)b[3] << 24; /* bytes */
    if (trie % 4 != 0 || (size_t)trie >= n - 4) {
        /* as llama.cpp, at least one byte of strings must follow the trie */
        TD_LOG_ERR("tokenizer: %s: a trie of %u bytes %s the %zu bytes after its size",
                   UGM_KEY_CHARSMAP, trie, trie % 4 ? "is not whole 4-byte units in" : "overruns",
                   n - 4);
        free(b);
        return TD_EFORMAT;
    }
    u->n_units = trie / 4;
    u->n_repl = n - 4 - trie;
    u->units = malloc((u->n_units ? u->n_units : 1) * sizeof *u->units);
    u->repl = malloc(u->n_repl);
    if (!u->units || !u->repl) rc = TD_ENOMEM;
    for (size_t i = 0; !rc && i < u->n_units; i++) {
        const uint8_t *p = b + 4 + 4 * i;
        u->units[i] =
            (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    }
    if (!rc) memcpy(u->repl, b + 4 + trie, u->n_repl);
    free(b);
    return rc ? rc : check_trie(u);
}

/* The longest charsmap key that starts s[0..n) (a NUL byte ends the walk): its length, 0 if
 * none; *repl / *repl_len its replacement. */
static size_t charsmap_match(const td_ugm *u, const uint8_t *s, size_t n, const char **repl,
                             size_t *repl_len)
{
    if (u->n_units == 0) return 0;
    size_t best = 0;
    uint32_t value = 0;
    uint32_t node = unit_offset(u->units[0]); /* block of the current node's children */
    for (size_t k = 0; k < n && s[k]; k++) {
        uint32_t i = node ^ s[k];
        if (i >= u->n_units || unit_label(u->units[i]) != s[k]) break;
        node = i ^ unit_offset(u->units[i]);
        if (node >= u->n_units) break;
        if (unit_has_leaf(u->units[i])) {
            best = k + 1;
            value = unit_value(u->units[node]);
        }
    }
    if (best == 0 || value >= u->n_repl) return 0;
    *repl = u->repl + value;
    *repl_len = strnlen(*repl, u->n_repl - value);
    return best;
}

/* ---- pieces ---- */

static int cmp_text(const void *a, const void *b, void *ctx)
{
    const td_tokenizer *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint32_t nx = t->text_len[x], ny = t->text_len[y];
    int c = memcmp(t->text[x], t->text[y], nx < ny ? nx : ny);
    if (c) return c;
    if (nx != ny) return nx < ny ? -1 : 1;
    return x < y ? -1 : x > y;
}

/* Byte d of token id's text, -1 past its end (shorter texts sort first). */
static int byte_at(const td_tokenizer *t, int32_t id, size_t d)
{
    return t->text_len[id] > d ? (uint8_t)t->text[id][d] : -1;
}

/* ids[*lo, *hi) all share their first d bytes and are sorted by text: narrow it to the ids
 * whose byte d is c. */
static void narrow(const td_tokenizer *t, const int32_t *ids, size_t *lo, size_t *hi, size_t d,
                   uint8_t c)
{
    size_t a = *lo, b = *hi;
    while (a < b) {
        size_t m = a + (b - a) / 2;
        if (byte_at(t, ids[m], d) < c)
            a = m + 1;
        else
            b = m;
    }
    size_t first = a;
    b = *hi;
    while (a < b) {
        size_t m = a + (b - a) / 2;
        if (byte_at(t, ids[m], d) <= c)
            a = m + 1;
        else
            b = m;
    }
    *lo = first;
    *hi = a;
}

/* The pieces Viterbi matches (normal, user-defined and unused tokens, as llama.cpp's
 * token_matcher), the user-defined ones the normalizer keeps whole, and the unknown score. */
static int index_pieces(td_tokenizer *t)
{
    td_ugm *u = &t->ugm;
    size_t n = (size_t)t->n_vocab;
    u->pieces = malloc(n * sizeof *u->pieces);
    u->user = malloc(n * sizeof *u->user);
    if (!u->pieces || !u->user) return TD_ENOMEM;
    float min_score = FLT_MAX;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        uint8_t ty = t->type[id];
        if (ty == TD_TOKTYPE_NORMAL && t->score[id] < min_score) min_score = t->score[id];
        if (ty == TD_TOKTYPE_NORMAL || ty == TD_TOKTYPE_USER_DEFINED || ty == TD_TOKTYPE_UNUSED)
            u->pieces[u->n_pieces++] = id;
        if (ty == TD_TOKTYPE_USER_DEFINED) u->user[u->n_user++] = id;
    }
    u->unk_score = (double)(min_score - UGM_UNK_PENALTY);
    qsort_r(u->pieces, u->n_pieces, sizeof *u->pieces, cmp_text, t);
    qsort_r(u->user, u->n_user, sizeof *u->user, cmp_text, t);
    /* one id per text: the last (llama.cpp's trie keeps the last inserted) */
    size_t k = 0;
    for (size_t i = 0; i < u->n_pieces; i++) {
        int32_t id = u->pieces[i];
        if (k > 0 && t->text_len[u->pieces[k - 1]] == t->text_len[id] &&
            !memcmp(t->text[u->pieces[k - 1]], t->text[id], t->text_len[id]))
            k--;
        u->pieces[k++] = id;
    }
    u->n_pieces = k;
    size_t i = 0; /* texts are never empty (tok_vocab.c names empty ones) */
    for (int b = 0; b < 256; b++) {
        u->piece_from[b] = i;
        while (i < u->n_pieces && byte_at(t, u->pieces[i], 0) == b)
            i++;
    }
    u->piece_from[256] = i;
    return 0;
}

int td_ugm_load(td_tokenizer *t, const td_gguf *g)
{
    bool v;
    t->ugm.remove_extra_ws =
        td_gguf_get_bool(g, "tokenizer.ggml.remove_extra_whitespaces", &v) == 0 && v;
    int rc = load_charsmap(&t->ugm, g);
    return rc ? rc : index_pieces(t);
}

void td_ugm_fini(td_ugm *u)
{
    free(u->units);
    free(u->repl);
    free(u->pieces);
    free(u->user);
    *u = (td_ugm){0};
}

/* ---- normalizer ---- */

/* How far s[0..n) follows some user-defined token's text (llama.cpp's naive_trie
 * get_longest_prefix: the depth its walk reaches, whether or not a token ends there). */
static size_t user_prefix(const td_tokenizer *t, const uint8_t *s, size_t n)
{
    const td_ugm *u = &t->ugm;
    size_t lo = 0, hi = u->n_user, d = 0;
    while (d < n) {
        narrow(t, u->user, &lo, &hi, d, s[d]);
        if (lo == hi) break;
        d++;
    }
    return d;
}

/* The length of the UTF-8 character at s[0..n) as llama.cpp's normalizer checks it (a lead
 * byte and the continuation bytes it announces; overlong forms and surrogates pass), 0 if
 * s does not start with one. */
static size_t utf8_len_loose(const uint8_t *s, size_t n)
{
    uint8_t c = s[0];
    size_t k = c < 0x80 ? 1 : c < 0xC0 ? 0 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : c < 0xF8 ? 4 : 0;
    if (k == 0 || k > n) return 0;
    for (size_t i = 1; i < k; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    return k;
}

/* text[0..len) normalized into out: at each position a user-defined token's prefix as is,
 * else the longest charsmap key's replacement, else one UTF-8 character as is (an invalid
 * byte: U+FFFD); then each space of that either dropped (remove_extra_whitespaces) or
 * escaped, and a U+2581 before the first word (add_space_prefix) or, with
 * remove_extra_whitespaces, before every word (llama.cpp's normalize). */
static int normalize(const td_tokenizer *t, const char *text, size_t len, td_bytes *out)
{
    const td_ugm *u = &t->ugm;
    const uint8_t *s = (const uint8_t *)text;
    bool merge = u->remove_extra_ws, prepended = false, in_word = false;
    int rc = 0;
    out->n = 0;
    for (size_t off = 0; !rc && off < len;) {
        const char *r;
        size_t rn, used = user_prefix(t, s + off, len - off);
        if (used) {
            r = text + off, rn = used;
        } else if ((used = charsmap_match(u, s + off, len - off, &r, &rn)) == 0) {
            used = utf8_len_loose(s + off, len - off);
            if (used)
                r = text + off, rn = used;
            else
                r = "\xef\xbf\xbd", rn = 3, used = 1;
        }
        if (td_bytes_reserve(out, 3 * rn + 3)) return TD_ENOMEM;
        for (size_t i = 0; !rc && i < rn; i++) {
            if (r[i] != ' ') {
                if (!in_word) {
                    in_word = true;
                    if ((t->add_space_prefix && !prepended) || merge) {
                        rc = td_bytes_add(out, UGM_SPACE, 3);
                        prepended = true;
                    }
                }
                if (!rc) rc = td_bytes_add(out, r + i, 1);
            } else {
                in_word = false;
                if (!merge) rc = td_bytes_add(out, UGM_SPACE, 3);
            }
        }
        off += used;
    }
    return rc;
}

/* ---- segmentation ---- */

/* The best segmentation of the normalized text's first `at` bytes so far. */
typedef struct {
    int32_t id;   /* its last token */
    size_t from;  /* where that token starts */
    double score; /* sum of its tokens' scores */
} ugm_best;

/* The bytes of the character that starts with byte c (llama.cpp's unicode_len_utf8). */
static size_t char_len(uint8_t c)
{
    return c < 0xC0 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
}

/* Viterbi over s[0..n) (normalized, n > 0), one character at a time: every piece that
 * starts at the character offers its end a better total; a character that no single piece
 * covers offers the unknown token. The best path is read back from the end, unknowns in a
 * row kept as one, and appended to out. */
static int viterbi(const td_tokenizer *t, const uint8_t *s, size_t n, ugm_best *best, td_ids *out)
{
    const td_ugm *u = &t->ugm;
    for (size_t i = 0; i <= n; i++)
        best[i] = (ugm_best){t->unk, 0, -DBL_MAX};
    best[0].score = 0.0;
    for (size_t off = 0; off < n;) {
        size_t cl = char_len(s[off]);
        if (cl > n - off) cl = n - off;
        bool whole_char = false;
        double base = best[off].score;
        size_t lo = u->piece_from[s[off]], hi = u->piece_from[s[off] + 1];
        for (size_t d = 1; lo < hi; d++) { /* [lo, hi): the pieces starting with s[off, off+d) */
            int32_t id = u->pieces[lo];
            if (t->text_len[id] == d) { /* shortest first: a piece ends here */
                whole_char = whole_char || d == cl;
                /* user-defined tokens score 0, as llama.cpp gives them */
                double sc = base + (t->type[id] == TD_TOKTYPE_USER_DEFINED ? 0.0 : t->score[id]);
                if (sc > best[off + d].score) best[off + d] = (ugm_best){id, off, sc};
            }
            if (off + d >= n) break;
            narrow(t, u->pieces, &lo, &hi, d, s[off + d]);
        }
        if (!whole_char) {
            double sc = base + u->unk_score;
            if (sc > best[off + cl].score) best[off + cl] = (ugm_best){t->unk, off, sc};
        }
        off += cl;
    }
    size_t first = out->n;
    bool prev_unk = false;
    for (size_t at = n;;) {
        const ugm_best *b = &best[at];
        bool unk = b->id == t->unk;
        if (!(prev_unk && unk) && b->id >= 0 && td_ids_push(out, b->id)) return TD_ENOMEM;
        if (b->from == 0) break;
        prev_unk = unk;
        at = b->from;
    }
    for (size_t i = first, j = out->n; i + 1 < j; i++, j--) {
        int32_t x = out->v[i];
        out->v[i] = out->v[j - 1];
        out->v[j - 1] = x;
    }
    return 0;
}

int td_ugm_fragment(const td_tokenizer *t, const char *text, size_t len, td_ids *out)
{
    td_bytes norm = {0};
    int rc = normalize(t, text, len, &norm);
    if (rc || norm.n == 0) {
        free(norm.v);
        return rc;
    }
    ugm_best *best = malloc((norm.n + 1) * sizeof *best); /* (normalized bytes + 1) */
    rc = best ? viterbi(t, (const uint8_t *)norm.v, norm.n, best, out) : TD_ENOMEM;
    free(best);
    free(norm.v);
    return rc;
}
