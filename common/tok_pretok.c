/* tok_pretok.c: the pre-tokenizers that cut a BPE text fragment into words, as llama.cpp's
 * unicode_regex_split does for each pre-tokenizer's regex_exprs (llama-vocab.cpp).
 *
 * A pre-tokenizer is a list of passes; each pass cuts every word the previous one left
 * (at first the whole fragment) into its regex matches and the gaps between them. Passes
 * llama.cpp runs as hand-written code (unicode.cpp's custom gpt2 / llama3 / qwen2 / qwen35
 * splitters) are written the same way here; the ones it hands to std::regex are class runs
 * ("\s?[C]+", "[C]", "\s+$", "[0-9]{3}") matched leftmost-first as ECMAScript does, with the
 * character classes std::regex sees: on the codepoints for plain regexes (non-ASCII
 * whitespace read as U+000B) and by category for \p{..} ones (the "collapsed" text). */
#include "tok_internal.h"

#include <stdlib.h>
#include <string.h>

#include "td_err.h"
#include "td_grow.h"

void td_words_init(td_words *w)
{
    *w = (td_words){0};
}

void td_words_fini(td_words *w)
{
    free(w->cpts);
    free(w->cls);
    free(w->word_len);
    free(w->prev_len);
    *w = (td_words){0};
}

/* The matchers see a window [ini, end) of the fragment's codepoints (one word of the
 * previous pass); positions outside it read as "no character", as llama.cpp's _get_flags. */
typedef struct {
    const uint32_t *cpts;
    const uint8_t *cls; /* class per codepoint */
    size_t ini, end;
    size_t prev_end;
    bool marks; /* \p{M} counts as a letter (qwen35) */
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
static unsigned sp_cat(const td_split *s, size_t pos)
{
    return s->cls[pos] & TD_UCD_CAT_MASK;
}
static bool sp_letter(const td_split *s, size_t pos)
{
    return sp_in(s, pos) &&
           (sp_cat(s, pos) == TD_UCD_LETTER || (s->marks && sp_cat(s, pos) == TD_UCD_MARK));
}
static bool sp_number(const td_split *s, size_t pos)
{
    return sp_in(s, pos) && sp_cat(s, pos) == TD_UCD_NUMBER;
}
static bool sp_space(const td_split *s, size_t pos)
{
    return sp_in(s, pos) && (s->cls[pos] & TD_UCD_WS);
}
/* [^\s\p{L}\p{N}] (qwen35: [^\s\p{L}\p{M}\p{N}]) and inside the window */
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

/* 's|'t|'re|'ve|'m|'ll|'d: returns the match length (0 if none). */
static size_t sp_contraction(const td_split *s, size_t pos, bool icase)
{
    if (sp_cpt(s, pos) != '\'' || pos + 1 >= s->end) return 0;
    uint32_t a = sp_cpt(s, pos + 1);
    if (icase) a = td_cpt_lower(a);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (pos + 2 >= s->end) return 0;
    uint32_t b = sp_cpt(s, pos + 2);
    if (icase) b = td_cpt_lower(b);
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

/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static void split_gpt2(td_split *s)
{
    size_t pos = s->ini;
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

/* (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}|
 *  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * (llama3: max_digits 3; qwen2: 1; qwen35: 1 and s->marks, \p{L} read as [\p{L}\p{M}]) */
static void split_llama3(td_split *s, size_t max_digits)
{
    size_t pos = s->ini;
    while (pos < s->end) {
        uint32_t cpt = sp_cpt(s, pos);
        size_t c = sp_contraction(s, pos, true);
        if (c) {
            pos += sp_add(s, pos + c);
            continue;
        }
        /* [^\r\n\p{L}\p{N}]?\p{L}+ (qwen35 lets a mark start the run too) */
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

/* ---- the passes llama.cpp gives to std::regex ---- */

/* A character class as std::regex sees it. */
typedef bool (*td_cclass)(uint32_t cpt, unsigned cls);

typedef struct {
    uint32_t lo, hi;
} td_crange;

static bool in_ranges(const td_crange *r, size_t n, uint32_t cpt)
{
    size_t lo = 0, hi = n; /* the first range ending at or after cpt */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (r[mid].hi < cpt)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && r[lo].lo <= cpt;
}

/* A plain (std::wregex) class sees non-ASCII whitespace as U+000B, which none of these
 * classes holds: such a codepoint is never in them, even when its value is in a range. */
static bool wide_space(uint32_t cpt, unsigned cls)
{
    return cpt >= 0x80 && (cls & TD_UCD_WS);
}

static bool cc_newline(uint32_t cpt, unsigned cls)
{
    (void)cls;
    return cpt == '\r' || cpt == '\n';
}

static bool cc_ascii_digit(uint32_t cpt, unsigned cls)
{
    (void)cls;
    return cpt >= '0' && cpt <= '9';
}

static bool cc_letter(uint32_t cpt, unsigned cls) /* \p{L} */
{
    (void)cpt;
    return (cls & TD_UCD_CAT_MASK) == TD_UCD_LETTER;
}

static bool cc_number(uint32_t cpt, unsigned cls) /* \p{N} */
{
    (void)cpt;
    return (cls & TD_UCD_CAT_MASK) == TD_UCD_NUMBER;
}

static bool cc_punct(uint32_t cpt, unsigned cls) /* \p{P} */
{
    (void)cpt;
    return (cls & TD_UCD_CAT_MASK) == TD_UCD_PUNCT;
}

static bool cc_punct_default(uint32_t cpt, unsigned cls) /* [\p{P}\$\+<=>\^~\|] */
{
    return cc_punct(cpt, cls) || (cpt != 0 && cpt < 0x80 && strchr("$+<=>^~|", (int)cpt));
}

static bool cc_punct_falcon(uint32_t cpt, unsigned cls) /* [\p{P}\$\+<=>\^~\|`] */
{
    return cc_punct_default(cpt, cls) || cpt == '`';
}

/* deepseek-llm's letters:
 * [A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-Ⴥ...],
 * its ranges sorted and merged */
static const td_crange ds_letters[] = {
    {0x41, 0x5A},       {0x61, 0x7A},       {0xB5, 0xB5},       {0xC0, 0xD6},
    {0xD8, 0xF6},       {0xF8, 0x1BA},      {0x1BC, 0x1BF},     {0x1C4, 0x293},
    {0x295, 0x2AF},     {0x370, 0x373},     {0x376, 0x377},     {0x37B, 0x37D},
    {0x37F, 0x37F},     {0x386, 0x386},     {0x388, 0x38A},     {0x38C, 0x38C},
    {0x38E, 0x3A1},     {0x3A3, 0x3F5},     {0x3F7, 0x481},     {0x48A, 0x52F},
    {0x531, 0x556},     {0x10A0, 0x10C5},   {0x13A0, 0x13F5},   {0x13F8, 0x13FD},
    {0x1C90, 0x1CBA},   {0x1CBD, 0x1CBF},   {0x1D00, 0x1D2B},   {0x1D6B, 0x1D77},
    {0x1D79, 0x1D9A},   {0x1E00, 0x1F15},   {0x1F18, 0x1F1D},   {0x1F20, 0x1F45},
    {0x1F48, 0x1F4D},   {0x1F50, 0x1F57},   {0x1F59, 0x1F59},   {0x1F5B, 0x1F5B},
    {0x1F5D, 0x1F5D},   {0x1F5F, 0x1F7D},   {0x1F80, 0x1FB4},   {0x1FB6, 0x1FBC},
    {0x1FBE, 0x1FBE},   {0x1FC2, 0x1FC4},   {0x1FC6, 0x1FCC},   {0x1FD0, 0x1FD3},
    {0x1FD6, 0x1FDB},   {0x1FE0, 0x1FEC},   {0x1FF2, 0x1FF4},   {0x1FF6, 0x1FFC},
    {0x2102, 0x2102},   {0x2107, 0x2107},   {0x210A, 0x2113},   {0x2115, 0x2115},
    {0x2119, 0x211D},   {0x2124, 0x2124},   {0x2126, 0x2126},   {0x2128, 0x2128},
    {0x212A, 0x212D},   {0x212F, 0x2134},   {0x2139, 0x2139},   {0x213C, 0x213F},
    {0x2145, 0x2149},   {0x214E, 0x214E},   {0x2183, 0x2184},   {0x2C00, 0x2C7B},
    {0x2C7E, 0x2CE4},   {0x2CEB, 0x2CEE},   {0x2CF2, 0x2CF3},   {0xA640, 0xA66D},
    {0xA680, 0xA69B},   {0xA722, 0xA76F},   {0xA771, 0xA787},   {0xA78B, 0xA78E},
    {0xAB70, 0xABBF},   {0xFB00, 0xFB06},   {0xFB13, 0xFB17},   {0xFF21, 0xFF3A},
    {0xFF41, 0xFF5A},   {0x10400, 0x1044F}, {0x104B0, 0x104D3}, {0x104D8, 0x104FB},
    {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2}, {0x118A0, 0x118DF}, {0x1E900, 0x1E943},
};

static bool cc_ds_letter(uint32_t cpt, unsigned cls)
{
    return !wide_space(cpt, cls) &&
           in_ranges(ds_letters, sizeof ds_letters / sizeof ds_letters[0], cpt);
}

/* deepseek-llm's punctuation: [!-/:-~！-／：-～‘-‟　-。] (ASCII letters included) */
static bool cc_ds_punct(uint32_t cpt, unsigned cls)
{
    static const td_crange r[] = {{0x21, 0x2F},     {0x3A, 0x7E},     {0x2018, 0x201F},
                                  {0x3000, 0x3002}, {0xFF01, 0xFF0F}, {0xFF1A, 0xFF5E}};
    return !wide_space(cpt, cls) && in_ranges(r, sizeof r / sizeof r[0], cpt);
}

/* deepseek's CJK: [一-龥ࠀ-一가-퟿] */
static bool cc_ds_cjk(uint32_t cpt, unsigned cls)
{
    return !wide_space(cpt, cls) &&
           ((cpt >= 0x800 && cpt <= 0x9FA5) || (cpt >= 0xAC00 && cpt <= 0xD7FF));
}

/* "\s?[C]+" (lead_ws), "[C]+", or "[C]" (single): emit each leftmost match; the gaps
 * between matches become words too (sp_add of a match's start). */
static void split_class(td_split *s, td_cclass in, bool lead_ws, bool single)
{
    size_t pos = s->ini;
#define IN(p) (sp_in(s, p) && in(s->cpts[p], s->cls[p]))
    while (pos < s->end) {
        size_t start = pos, run;
        if (lead_ws && sp_space(s, pos) && IN(pos + 1))
            run = pos + 1;
        else if (IN(pos))
            run = pos;
        else {
            pos++;
            continue;
        }
        pos = run + 1;
        while (!single && IN(pos))
            pos++;
        sp_add(s, start);
        sp_add(s, pos);
    }
#undef IN
}

/* "\s+$": the whitespace that ends the word, if any */
static void split_trailing_space(td_split *s)
{
    size_t pos = s->end;
    while (pos > s->ini && sp_space(s, pos - 1))
        pos--;
    sp_add(s, pos);
}

/* "[0-9][0-9][0-9]": leftmost runs of three ASCII digits */
static void split_digits3(td_split *s)
{
    for (size_t pos = s->ini; pos < s->end;) {
        if (pos + 3 <= s->end && cc_ascii_digit(s->cpts[pos], 0) &&
            cc_ascii_digit(s->cpts[pos + 1], 0) && cc_ascii_digit(s->cpts[pos + 2], 0)) {
            sp_add(s, pos);
            sp_add(s, pos + 3);
            pos += 3;
        } else {
            pos++;
        }
    }
}

/* "[^\n]+|[\n]+": runs of newlines and runs of anything else */
static void split_newlines(td_split *s)
{
    for (size_t pos = s->ini; pos < s->end;) {
        bool nl = s->cpts[pos] == '\n';
        while (pos < s->end && (s->cpts[pos] == '\n') == nl)
            pos++;
        sp_add(s, pos);
    }
}

/* ---- the pre-tokenizers ---- */

typedef enum {
    PASS_END = 0,
    PASS_GPT2,
    PASS_LLAMA3,
    PASS_QWEN2,
    PASS_QWEN35,
    PASS_CLASS,
    PASS_TRAILING_SPACE,
    PASS_DIGITS3,
    PASS_NEWLINES,
} td_pass_kind;

typedef struct {
    td_pass_kind kind;
    td_cclass in; /* PASS_CLASS */
    bool lead_ws, single;
} td_pass;

/* llama_vocab's regex_exprs for each pre-tokenizer, in order; a list ends with {0}, a class
 * pass is {PASS_CLASS, class, lead_ws, single}. */
static const td_pass *passes_of(td_pre_kind kind)
{
    static const td_pass gpt2[] = {{.kind = PASS_GPT2}, {0}};
    static const td_pass smollm[] = {
        {PASS_CLASS, cc_number, false, true}, {.kind = PASS_GPT2}, {0}};
    static const td_pass llama3[] = {{.kind = PASS_LLAMA3}, {0}};
    static const td_pass qwen2[] = {{.kind = PASS_QWEN2}, {0}};
    static const td_pass qwen35[] = {{.kind = PASS_QWEN35}, {0}};
    static const td_pass newlines[] = {{.kind = PASS_NEWLINES}, {0}};
    static const td_pass deflt[] = {{PASS_CLASS, cc_punct_default, false, false},
                                    {.kind = PASS_GPT2},
                                    {PASS_CLASS, cc_number, false, false},
                                    {.kind = PASS_DIGITS3},
                                    {0}};
    static const td_pass falcon[] = {{PASS_CLASS, cc_punct_falcon, false, false},
                                     {.kind = PASS_GPT2},
                                     {.kind = PASS_DIGITS3},
                                     {0}};
    static const td_pass deepseek_llm[] = {{PASS_CLASS, cc_newline, false, true},
                                           {PASS_CLASS, cc_ds_letter, true, false},
                                           {PASS_CLASS, cc_ds_punct, true, false},
                                           {.kind = PASS_TRAILING_SPACE},
                                           {PASS_CLASS, cc_ds_cjk, false, false},
                                           {PASS_CLASS, cc_number, false, false},
                                           {0}};
    static const td_pass deepseek_coder[] = {
        {PASS_CLASS, cc_newline, false, true}, {PASS_CLASS, cc_letter, true, false},
        {PASS_CLASS, cc_punct, true, false},   {PASS_CLASS, cc_ds_cjk, false, false},
        {PASS_CLASS, cc_number, false, true},  {0}};
    switch (kind) {
    case TD_PRE_NONE:
        return NULL;
    case TD_PRE_DEFAULT:
        return deflt;
    case TD_PRE_GPT2:
        return gpt2;
    case TD_PRE_SMOLLM:
        return smollm;
    case TD_PRE_FALCON:
        return falcon;
    case TD_PRE_LLAMA3:
        return llama3;
    case TD_PRE_QWEN2:
        return qwen2;
    case TD_PRE_QWEN35:
        return qwen35;
    case TD_PRE_DEEPSEEK_LLM:
        return deepseek_llm;
    case TD_PRE_DEEPSEEK_CODER:
        return deepseek_coder;
    case TD_PRE_NEWLINES:
        return newlines;
    }
    return NULL;
}

static void split_window(td_split *s, const td_pass *p)
{
    s->marks = p->kind == PASS_QWEN35;
    switch (p->kind) {
    case PASS_GPT2:
        split_gpt2(s);
        break;
    case PASS_LLAMA3:
        split_llama3(s, 3);
        break;
    case PASS_QWEN2:
    case PASS_QWEN35:
        split_llama3(s, 1);
        break;
    case PASS_CLASS:
        split_class(s, p->in, p->lead_ws, p->single);
        break;
    case PASS_TRAILING_SPACE:
        split_trailing_space(s);
        break;
    case PASS_DIGITS3:
        split_digits3(s);
        break;
    case PASS_NEWLINES:
        split_newlines(s);
        break;
    case PASS_END:
        break;
    }
    sp_add(s, s->end); /* what no match took is a word too */
}

/* One pass over every word of the previous one. */
static int run_pass(td_split *s, const td_pass *p)
{
    td_words *w = s->w;
    if (TD_GROW(w->prev_len, w->cap_prev, w->n_words, 64)) return TD_ENOMEM;
    memcpy(w->prev_len, w->word_len, w->n_words * sizeof *w->prev_len);
    size_t n_prev = w->n_words, start = 0;
    w->n_words = 0;
    for (size_t i = 0; i < n_prev && !s->oom; i++) {
        s->ini = s->prev_end = start;
        s->end = start + w->prev_len[i];
        split_window(s, p);
        start = s->end;
    }
    return s->oom ? TD_ENOMEM : 0;
}

/* Decode text into w->cpts / w->cls. */
static int decode_text(const char *text, size_t len, td_words *w)
{
    if (TD_GROW(w->cpts, w->cap_cpts, len, 0) || TD_GROW(w->cls, w->cap_cls, len, 0))
        return TD_ENOMEM;
    const uint8_t *s = (const uint8_t *)text;
    for (size_t off = 0; off < len;) {
        size_t n;
        uint32_t cpt = td_utf8_decode(s + off, len - off, &n);
        w->cls[w->n_cpts] = (uint8_t)td_cpt_class(cpt);
        w->cpts[w->n_cpts++] = cpt;
        off += n;
    }
    return 0;
}

int td_pretokenize(td_pre_kind kind, const char *text, size_t len, td_words *w)
{
    w->n_cpts = 0;
    w->n_words = 0;
    int rc = decode_text(text, len, w);
    if (rc || w->n_cpts == 0) return rc;
    if (TD_GROW(w->word_len, w->cap_words, 1, 64)) return TD_ENOMEM;
    w->word_len[w->n_words++] = w->n_cpts; /* the whole fragment, before the first pass */
    td_split sp = {.cpts = w->cpts, .cls = w->cls, .w = w};
    for (const td_pass *p = passes_of(kind); p && p->kind != PASS_END && !rc; p++)
        rc = run_pass(&sp, p);
    return rc;
}
