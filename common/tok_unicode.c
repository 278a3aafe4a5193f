/* tok_unicode.c: the tokenizer's view of Unicode: UTF-8 decoding and encoding, and lookups in
 * the generated tables of unicode_tables.h (codepoint classes for the pre-tokenizers,
 * lowercase and NFD for WordPiece's normalizer). The only file that includes those tables. */
#include "tok_internal.h"

#include "unicode_tables.h"

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
    if (cpt < 0x80) return td_ucd_ascii[cpt];
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

uint32_t td_cpt_lower(uint32_t cpt)
{
    size_t lo = 0, hi = TD_UCD_N_LOWER; /* find the entry for cpt */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (td_ucd_lower[mid][0] < cpt)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < TD_UCD_N_LOWER && td_ucd_lower[lo][0] == cpt ? td_ucd_lower[lo][1] : cpt;
}

uint32_t td_cpt_nfd_first(uint32_t cpt)
{
    size_t lo = 0, hi = TD_UCD_N_NFD; /* the first range starting after cpt */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (td_ucd_nfd[mid][0] <= cpt)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0 || cpt > td_ucd_nfd[lo - 1][1]) return cpt;
    return td_ucd_nfd[lo - 1][2];
}
