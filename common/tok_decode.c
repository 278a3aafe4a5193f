/* tok_decode.c: token ids back to text: pieces, whole decode (with llama.cpp's
 * clean_spaces) and the incremental UTF-8-safe detokenizer (see tokenizer.h). */
#include <stdlib.h>
#include <string.h>

#include "td_err.h"
#include "tok_internal.h"
#include "tokenizer.h"

/* ---- decoding ---- */

const char *td_tok_piece(const td_tokenizer *t, int32_t id, size_t *len)
{
    if (!t || id < 0 || id >= t->n_vocab) return NULL;
    if (len) *len = t->piece_len[id];
    return t->piece[id];
}

const char *td_tok_piece_render(const td_tokenizer *t, int32_t id, bool special, size_t *len)
{
    if (!t || id < 0 || id >= t->n_vocab) return NULL;
    uint8_t ty = t->type[id];
    if (!special && (ty == TD_TOKTYPE_CONTROL || ty == TD_TOKTYPE_UNKNOWN)) {
        if (len) *len = 0;
        return t->piece[id];
    }
    if (len) *len = t->piece_len[id];
    return t->piece[id];
}

/* llama.cpp's clean_spaces passes over the decoded text, in place; returns the new length */
static size_t clean_spaces(char *s, size_t total)
{
    size_t n = total ? 1 : 0;
    for (size_t i = 1; i < total; i++) { /* " ?", " !", " .", " ," */
        char x = s[i];
        if (s[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ',')) n--;
        s[n++] = x;
    }
    total = n;
    n = total ? 1 : 0;
    for (size_t i = 1; i < total; i++) { /* " ' " */
        char x = s[i];
        if (x == '\'' && i + 1 < total && s[i - 1] == ' ' && s[i + 1] == ' ') {
            n--;
            s[++i] = '\0';
        }
        s[n++] = x;
    }
    total = n;
    n = total ? 1 : 0;
    for (size_t i = 1; i < total; i++) { /* " 's", " 'm", " 're", " 've" */
        char x = s[i];
        if (s[i - 1] == ' ' && x == '\'' && i + 1 < total) {
            char x1 = s[i + 1];
            if (x1 == 's' || x1 == 'm') {
                n--;
            } else if (x1 != 't' && x1 != 'd' && i + 2 < total) {
                char x2 = s[i + 2];
                if ((x1 == 'r' && x2 == 'e') || (x1 == 'v' && x2 == 'e')) n--;
            }
        }
        s[n++] = x;
    }
    return n;
}

long td_tok_decode(const td_tokenizer *t, const int32_t *ids, size_t n, bool special, char *out,
                   size_t cap)
{
    if (!t || (!ids && n) || (!out && cap)) return TD_EINVAL;
    td_bytes b = {0};
    bool strip = t->add_space_prefix;
    for (size_t i = 0; i < n; i++) {
        size_t len;
        const char *p = td_tok_piece_render(t, ids[i], special, &len);
        if (!p) {
            free(b.v);
            TD_LOG_ERR("tokenizer: decode: invalid token id %d", ids[i]);
            return TD_EINVAL;
        }
        if (strip && len > 0 && p[0] == ' ') p++, len--;
        strip = false;
        if (td_bytes_add(&b, p, len)) {
            free(b.v);
            return TD_ENOMEM;
        }
    }
    size_t total = b.n;
    if (t->clean_spaces && total) total = clean_spaces(b.v, total);
    if (cap && total) memcpy(out, b.v, total < cap ? total : cap); /* b.v is NULL if empty */
    free(b.v);
    return (long)total;
}

void td_detok_init(td_detok *d, const td_tokenizer *t)
{
    *d = (td_detok){.tok = t, .first = true};
}

void td_detok_fini(td_detok *d)
{
    *d = (td_detok){0};
}

/* Length of the valid prefix a UTF-8 character can have after lead byte c with the bytes
 * seen so far; returns the full length needed, or 0 if s[0..n) is already invalid at
 * some byte (then *bad is the number of bytes forming the maximal invalid subpart). */
static size_t utf8_need(const uint8_t *s, size_t n, size_t *bad)
{
    uint8_t c = s[0];
    size_t need;
    uint8_t lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF)
        need = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        need = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else {
        *bad = 1;
        return 0;
    }
    for (size_t i = 1; i < n && i < need; i++) {
        uint8_t l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
        if (s[i] < l || s[i] > h) {
            *bad = i;
            return 0;
        }
    }
    return need;
}

/* Move the complete characters of buf[0..n) into out; keep an unfinished tail in d.
 * Returns bytes written or TD_ERANGE. */
static int detok_emit(td_detok *d, const uint8_t *buf, size_t n, char *out, size_t cap, bool final)
{
    size_t w = 0, i = 0;
    while (i < n) {
        if (buf[i] < 0x80) {
            if (w + 1 > cap) return TD_ERANGE;
            out[w++] = (char)buf[i++];
            continue;
        }
        size_t bad = 0, need = utf8_need(buf + i, n - i, &bad);
        if (need && i + need <= n) {
            if (w + need > cap) return TD_ERANGE;
            memcpy(out + w, buf + i, need);
            w += need;
            i += need;
        } else if (need && !final) { /* unfinished but still valid: hold it */
            d->n_pending = (uint8_t)(n - i);
            memcpy(d->pending, buf + i, n - i);
            return (int)w;
        } else {
            if (w + 3 > cap) return TD_ERANGE;
            memcpy(out + w, "\xef\xbf\xbd", 3);
            w += 3;
            i += need ? n - i : bad;
        }
    }
    d->n_pending = 0;
    return (int)w;
}

int td_detok_push(td_detok *d, int32_t id, char *out, size_t cap)
{
    size_t len;
    const char *p = td_tok_piece_render(d->tok, id, d->special, &len);
    if (!p) return TD_EINVAL;
    if (d->first && d->tok->add_space_prefix && len > 0 && p[0] == ' ') p++, len--;
    d->first = false;
    uint8_t stack[256];
    size_t n = d->n_pending + len;
    uint8_t *buf = n <= sizeof stack ? stack : malloc(n);
    if (!buf) return TD_ENOMEM;
    memcpy(buf, d->pending, d->n_pending);
    memcpy(buf + d->n_pending, p, len);
    td_detok saved = *d;
    int rc = detok_emit(d, buf, n, out, cap, false);
    if (rc < 0) *d = saved;
    if (buf != stack) free(buf);
    return rc;
}

int td_detok_flush(td_detok *d, char *out, size_t cap)
{
    uint8_t buf[4];
    size_t n = d->n_pending;
    memcpy(buf, d->pending, n);
    td_detok saved = *d;
    int rc = detok_emit(d, buf, n, out, cap, true);
    if (rc < 0) *d = saved;
    return rc;
}
