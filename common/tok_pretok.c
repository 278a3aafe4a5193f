/* tok_pretok.c: UTF-8 decoding, codepoint classes and the hand-written pre-tokenizer
 * matchers (the regexes of llama.cpp's unicode.cpp custom splitters, same semantics). */
#include "tok_internal.h"

#include <stdlib.h>

#include "td_err.h"
#include "unicode_tables.h"
#include "td_grow.h"

uint32_t td_utf8_decode(const uint8_t *s, size_t len, size_t *n)
{
    uint8_t c = s[0];
    *n = 1;
    if (c < 0x80) return c;
    size_t need;
    uint32_t cpt, min;
    if (c >= 0xC2 && c <= 0xDF) {
        need = 2, cpt = c & 0x1Fu, min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
        need = 3, cpt = c & 0x0Fu, min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 4, cpt = c & 0x07u, min = 0x10000;
    } else {
        return TD_CPT_REPLACEMENT;
    }
    if (len < need) return TD_CPT_REPLACEMENT;
    for (size_t i = 1; i < need; i++) {
        if ((s[i] & 0xC0) != 0x80) return TD_CPT_REPLACEMENT;
        cpt = (cpt << 6) | (s[i] & 0x3Fu);
    }
    if (cpt < min || cpt > 0x10FFFF || (cpt >= 0xD800 && cpt <= 0xDFFF)) return TD_CPT_REPLACEMENT;
    *n = need;
    return cpt;
}

size_t td_utf8_encode(uint32_t cpt, uint8_t *out)
{
    if (cpt < 0x80) {
        out[0] = (uint8_t)cpt;
        return 1;
    }
    if (cpt < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cpt >> 6));
        out[1] = (uint8_t)(0x80 | (cpt & 0x3F));
        return 2;
    }
    if (cpt < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cpt >> 12));
        out[1] = (uint8_t)(0x80 | ((cpt >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cpt & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cpt >> 18));
    out[1] = (uint8_t)(0x80 | ((cpt >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cpt >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cpt & 0x3F));
    return 4;
}

unsigned td_cpt_class(uint32_t cpt)
{
    if (cpt > 0x10FFFF) return TD_UCD_OTHER;
    uint32_t key = (cpt << 8) | 0xFFu;
    size_t lo = 0, hi = TD_UCD_N_RANGES; /* find the last range with start <= cpt */
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (td_ucd_ranges[mid] <= key)
            lo = mid;
        else
            hi = mid;
    }
    return td_ucd_ranges[lo] & 0xFFu;
}

void td_words_init(td_words *w)
{
    *w = (td_words){0};
}

void td_words_fini(td_words *w)
{
    free(w->cpts);
    free(w->word_len);
    *w = (td_words){0};
}

/* The matchers see a window [ini, end) of the fragment's codepoints; positions outside
 * it read as "no character" (class 0 with in_range false), as llama.cpp's _get_flags. */
typedef struct {
    const uint32_t *cpts;
    const uint8_t *cls; /* class per codepoint */
    size_t ini, end;
    size_t prev_end;
    td_words *w;
    bool oom;
} td_split;

#define OUT_OF_RANGE 0xFFFFFFFFu

static uint32_t sp_cpt(const td_split *s, size_t pos)
{
    return pos >= s->ini && pos < s->end ? s->cpts[pos] : OUT_OF_RANGE;
}
static bool sp_in(const td_split *s, size_t pos)
{
    return pos >= s->ini && pos < s->end;
}
static bool sp_letter(const td_split *s, size_t pos)
{
    return sp_in(s, pos) && (s->cls[pos] & 3u) == TD_UCD_LETTER;
}
static bool sp_number(const td_split *s, size_t pos)
{
    return sp_in(s, pos) && (s->cls[pos] & 3u) == TD_UCD_NUMBER;
}
static bool sp_space(const td_split *s, size_t pos)
{
    return sp_in(s, pos) && (s->cls[pos] & TD_UCD_WS);
}
/* [^\s\p{L}\p{N}] and inside the window */
static bool sp_other(const td_split *s, size_t pos)
{
    return sp_in(s, pos) && !sp_space(s, pos) && !sp_letter(s, pos) && !sp_number(s, pos);
}

static size_t sp_add(td_split *s, size_t end)
{
    size_t len = end - s->prev_end;
    if (len > 0) {
        td_words *w = s->w;
        if (TD_GROW(w->word_len, w->cap_words, w->n_words + 1, 64)) {
            s->oom = true;
            s->prev_end = end;
            return len;
        }
        w->word_len[w->n_words++] = len;
    }
    s->prev_end = end;
    return len;
}

static uint32_t ascii_lower(uint32_t c)
{
    return c >= 'A' && c <= 'Z' ? c + 32 : c;
}

/* 's|'t|'re|'ve|'m|'ll|'d: returns the match length (0 if none). */
static size_t sp_contraction(const td_split *s, size_t pos, bool icase)
{
    if (sp_cpt(s, pos) != '\'' || pos + 1 >= s->end) return 0;
    uint32_t a = sp_cpt(s, pos + 1);
    if (icase) a = ascii_lower(a);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (pos + 2 >= s->end) return 0;
    uint32_t b = sp_cpt(s, pos + 2);
    if (icase) b = ascii_lower(b);
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

/* Trailing whitespace rules shared by both regex families: \s+(?!\S) | \s+ */
static void sp_spaces(td_split *s, size_t *pos, size_t n_ws)
{
    if (n_ws > 1 && sp_cpt(s, *pos + n_ws) != OUT_OF_RANGE) {
        *pos += n_ws - 1;
        sp_add(s, *pos);
    } else if (n_ws > 0) {
        *pos += n_ws;
        sp_add(s, *pos);
    } else {
        sp_add(s, ++*pos);
    }
}

static void split_gpt2(td_split *s)
{
    size_t pos = s->ini;
    s->prev_end = s->ini;
    while (pos < s->end) {
        uint32_t cpt = sp_cpt(s, pos);
        size_t c = sp_contraction(s, pos, false);
        if (c) {
            pos += sp_add(s, pos + c);
            continue;
        }
        size_t p2 = cpt == ' ' ? pos + 1 : pos; /* optional leading space */
        if (sp_letter(s, p2)) {
            pos = p2;
            while (sp_letter(s, pos))
                pos++;
            sp_add(s, pos);
            continue;
        }
        if (sp_number(s, p2)) {
            pos = p2;
            while (sp_number(s, pos))
                pos++;
            sp_add(s, pos);
            continue;
        }
        if (sp_other(s, p2)) {
            pos = p2;
            while (sp_other(s, pos))
                pos++;
            sp_add(s, pos);
            continue;
        }
        size_t n_ws = 0;
        while (sp_space(s, pos + n_ws))
            n_ws++;
        sp_spaces(s, &pos, n_ws);
    }
}

static void split_llama3(td_split *s, size_t max_digits)
{
    size_t pos = s->ini;
    s->prev_end = s->ini;
    while (pos < s->end) {
        uint32_t cpt = sp_cpt(s, pos);
        size_t c = sp_contraction(s, pos, true);
        if (c) {
            pos += sp_add(s, pos + c);
            continue;
        }
        /* [^\r\n\p{L}\p{N}]?\p{L}+ */
        if (!(cpt == '\r' || cpt == '\n' || sp_number(s, pos))) {
            if (sp_letter(s, pos) || sp_letter(s, pos + 1)) {
                pos++;
                while (sp_letter(s, pos))
                    pos++;
                sp_add(s, pos);
                continue;
            }
        }
        /* \p{N}{1,max_digits} */
        if (sp_number(s, pos)) {
            size_t ini = pos;
            while (sp_number(s, pos)) {
                if (++pos - ini >= max_digits) {
                    sp_add(s, pos);
                    ini = pos;
                }
            }
            sp_add(s, pos);
            continue;
        }
        /*  ?[^\s\p{L}\p{N}]+[\r\n]* */
        size_t p2 = cpt == ' ' ? pos + 1 : pos;
        if (sp_other(s, p2)) {
            pos = p2;
            while (sp_other(s, pos))
                pos++;
            while (sp_cpt(s, pos) == '\r' || sp_cpt(s, pos) == '\n')
                pos++;
            sp_add(s, pos);
            continue;
        }
        /* \s*[\r\n]+ */
        size_t n_ws = 0, last_nl = 0;
        while (sp_space(s, pos + n_ws)) {
            uint32_t c2 = sp_cpt(s, pos + n_ws);
            if (c2 == '\r' || c2 == '\n') last_nl = pos + n_ws + 1;
            n_ws++;
        }
        if (last_nl > 0) {
            pos = last_nl;
            sp_add(s, pos);
            continue;
        }
        sp_spaces(s, &pos, n_ws);
    }
}

int td_pretokenize(td_pre_kind kind, const char *text, size_t len, td_words *w)
{
    w->n_cpts = 0;
    w->n_words = 0;
    int rc = TD_GROW(w->cpts, w->cap_cpts, len, 0);
    if (rc) return rc;
    uint8_t *cls = malloc(len ? len : 1);
    if (!cls) return TD_ENOMEM;
    const uint8_t *s = (const uint8_t *)text;
    for (size_t off = 0; off < len;) {
        size_t n;
        uint32_t cpt = td_utf8_decode(s + off, len - off, &n);
        cls[w->n_cpts] =
            (uint8_t)(cpt < 0x80 ? (cpt >= 'a' && cpt <= 'z') || (cpt >= 'A' && cpt <= 'Z')
                                       ? TD_UCD_LETTER
                                   : (cpt >= '0' && cpt <= '9')              ? TD_UCD_NUMBER
                                   : (cpt == ' ' || (cpt >= 9 && cpt <= 13)) ? TD_UCD_WS
                                                                             : TD_UCD_OTHER
                                 : td_cpt_class(cpt));
        w->cpts[w->n_cpts++] = cpt;
        off += n;
    }
    td_split sp = {.cpts = w->cpts, .cls = cls, .w = w};
    switch (kind) {
    case TD_PRE_GPT2:
        sp.ini = 0, sp.end = w->n_cpts;
        split_gpt2(&sp);
        break;
    case TD_PRE_SMOLLM: {
        /* first regex \p{N}: every number codepoint is its own piece; the GPT-2 regex then
         * runs on each piece separately */
        size_t i = 0;
        while (i < w->n_cpts) {
            if ((cls[i] & 3u) == TD_UCD_NUMBER) {
                sp.ini = i, sp.end = i + 1;
                split_gpt2(&sp);
                i++;
                continue;
            }
            size_t j = i;
            while (j < w->n_cpts && (cls[j] & 3u) != TD_UCD_NUMBER)
                j++;
            sp.ini = i, sp.end = j;
            split_gpt2(&sp);
            i = j;
        }
        break;
    }
    case TD_PRE_LLAMA3:
        sp.ini = 0, sp.end = w->n_cpts;
        split_llama3(&sp, 3);
        break;
    case TD_PRE_QWEN2:
        sp.ini = 0, sp.end = w->n_cpts;
        split_llama3(&sp, 1);
        break;
    case TD_PRE_NONE:
        sp.ini = 0, sp.end = w->n_cpts;
        sp.prev_end = 0;
        sp_add(&sp, w->n_cpts);
        break;
    }
    free(cls);
    return sp.oom ? TD_ENOMEM : 0;
}
