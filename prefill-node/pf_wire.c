/* pf_wire.c: encoding and bounds-checked parsing of the stage-chain messages. */
#include "pf_wire.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"

#define HDR_BYTES 32
/* 8-byte aligned records; 88: logprobs (u8), 89: prompt_logprobs (bit 0), 90: grammar_kind
 * (u8); 92: bytes of the schema text (NUL included); 96: n_cached; 100: spare; 104: cached_id */
#define SEG_BYTES 112

static void put32(uint8_t *p, uint32_t v)
{
    memcpy(p, &v, 4); /* every supported host is little-endian (checked at build time) */
}
static void put64(uint8_t *p, uint64_t v)
{
    memcpy(p, &v, 8);
}
static uint32_t get32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
static void putf(uint8_t *p, float f)
{
    memcpy(p, &f, 4);
}
static float getf(const uint8_t *p)
{
    float f;
    memcpy(&f, p, 4);
    return f;
}

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "pf_wire assumes little-endian");

static void header(uint8_t *b, uint32_t kind, uint64_t seq)
{
    put32(b, PF_WIRE_MAGIC);
    put32(b + 4, PF_WIRE_VERSION | kind << 16);
    put64(b + 8, seq);
}

/* The sampler's variable-length lists travel only with the segment that samples (LAST; a
 * DEAD one too, so that the layout never depends on which requests failed): the logit bias
 * ids and values, then the min_tokens ids, 4 bytes each, then the grammar's schema text
 * (NUL-terminated, padded with zeros to 4 bytes). */
static bool has_lists(const pf_seg *g)
{
    return (g->flags & PF_SEG_LAST) != 0;
}

/* Bytes of the schema text with its NUL, 0 without one (none, or json_object). */
static size_t text_len(const pf_seg *g)
{
    if (!has_lists(g) || g->sampling.grammar_kind < TD_GRAMMAR_JSON_SCHEMA || !g->sampling.grammar)
        return 0;
    return strlen(g->sampling.grammar) + 1;
}

size_t pf_wire_seg_grammar_bytes(const pf_seg *g)
{
    return (text_len(g) + 3) & ~(size_t)3;
}

static size_t list_bytes(const pf_seg *g)
{
    if (!has_lists(g)) return 0;
    return (size_t)g->sampling.n_logit_bias * 8 + (size_t)g->sampling.n_min_tokens_ids * 4 +
           pf_wire_seg_grammar_bytes(g);
}

static size_t payload_off(size_t lists, int n_segs, int64_t n_ids)
{
    size_t off = HDR_BYTES + (size_t)n_segs * SEG_BYTES + lists + (size_t)n_ids * 4;
    return (off + 63) & ~(size_t)63;
}

static size_t lists_bytes(const pf_seg *segs, int n_segs)
{
    size_t b = 0;
    for (int i = 0; i < n_segs; i++)
        b += list_bytes(&segs[i]);
    return b;
}

size_t pf_wire_chunk_payload_off(const pf_seg *segs, int n_segs, int64_t n_ids)
{
    return payload_off(lists_bytes(segs, n_segs), n_segs, n_ids);
}

size_t pf_wire_chunk_size(const pf_seg *segs, int n_segs, int64_t n_ids, int64_t rows, int n_embd)
{
    return pf_wire_chunk_payload_off(segs, n_segs, n_ids) + (size_t)rows * (size_t)n_embd * 4;
}

size_t pf_wire_chunk_max_size(int64_t n_ids, int64_t rows, int n_embd)
{
    size_t lists = (size_t)PF_MAX_SEGS * (TD_MAX_LOGIT_BIAS * 8 + TD_MAX_MIN_TOKENS_IDS * 4) +
                   PF_WIRE_GRAMMAR_BUDGET;
    return payload_off(lists, PF_MAX_SEGS, n_ids) + (size_t)rows * (size_t)n_embd * 4;
}

static int64_t live_rows(const pf_seg *segs, int n)
{
    int64_t r = 0;
    for (int i = 0; i < n; i++)
        if (!(segs[i].flags & PF_SEG_DEAD)) r += segs[i].t1 - segs[i].t0;
    return r;
}

int64_t pf_wire_chunk_write(void *buf, size_t cap, uint64_t seq, const pf_seg *segs, int n_segs,
                            const int32_t *ids, int n_embd)
{
    if (n_segs < 1 || n_segs > PF_MAX_SEGS) return TD_EINVAL;
    size_t gbytes = 0;
    for (int i = 0; i < n_segs; i++) {
        const td_sampling *sp = &segs[i].sampling;
        if (sp->n_logit_bias < 0 || sp->n_logit_bias > TD_MAX_LOGIT_BIAS ||
            sp->n_min_tokens_ids < 0 || sp->n_min_tokens_ids > TD_MAX_MIN_TOKENS_IDS ||
            sp->grammar_kind < 0 || sp->grammar_kind > TD_GRAMMAR_JSON_SCHEMA_STRICT ||
            text_len(&segs[i]) > PF_MAX_GRAMMAR_TEXT + 1 ||
            (has_lists(&segs[i]) && sp->grammar_kind >= TD_GRAMMAR_JSON_SCHEMA && !sp->grammar))
            return TD_EINVAL;
        gbytes += pf_wire_seg_grammar_bytes(&segs[i]);
    }
    if (gbytes > PF_WIRE_GRAMMAR_BUDGET) return TD_EINVAL;
    int64_t rows = live_rows(segs, n_segs);
    size_t need = pf_wire_chunk_size(segs, n_segs, rows, n_embd > 0 ? rows : 0, n_embd);
    if (need > cap) return TD_ERANGE;
    uint8_t *b = buf;
    header(b, PF_MSG_CHUNK, seq);
    put32(b + 16, (uint32_t)n_segs);
    put32(b + 20, (uint32_t)rows);
    put32(b + 24, (uint32_t)n_embd);
    put32(b + 28, 0);
    for (int i = 0; i < n_segs; i++) {
        uint8_t *s = b + HDR_BYTES + (size_t)i * SEG_BYTES;
        const pf_seg *g = &segs[i];
        put64(s, g->req_id);
        put32(s + 8, g->t0);
        put32(s + 12, g->t1);
        put32(s + 16, g->n_prompt);
        put32(s + 20, g->flags);
        put32(s + 24, g->chunk);
        put32(s + 28, g->n_dst);
        putf(s + 32, g->sampling.temperature);
        putf(s + 36, g->sampling.top_p);
        putf(s + 40, g->sampling.min_p);
        putf(s + 44, g->sampling.repeat_penalty);
        put32(s + 48, (uint32_t)g->sampling.top_k);
        put32(s + 52, (uint32_t)g->sampling.repeat_last_n);
        put64(s + 56, g->sampling.seed);
        put32(s + 64, g->sampling.skip_samples);
        putf(s + 68, g->sampling.presence_penalty);
        putf(s + 72, g->sampling.frequency_penalty);
        put32(s + 76, (uint32_t)g->sampling.min_tokens);
        put32(s + 80, has_lists(g) ? (uint32_t)g->sampling.n_logit_bias : 0);
        put32(s + 84, has_lists(g) ? (uint32_t)g->sampling.n_min_tokens_ids : 0);
        put32(s + 88, (g->sampling.logprobs & 0xffu) | (uint32_t)g->sampling.prompt_logprobs << 8 |
                          (uint32_t)g->sampling.grammar_kind << 16);
        put32(s + 92, (uint32_t)text_len(g));
        put32(s + 96, g->n_cached);
        put32(s + 100, 0);
        put64(s + 104, g->cached_id);
    }
    uint8_t *l = b + HDR_BYTES + (size_t)n_segs * SEG_BYTES;
    for (int i = 0; i < n_segs; i++) {
        if (!has_lists(&segs[i])) continue;
        const td_sampling *sp = &segs[i].sampling;
        memcpy(l, sp->logit_bias_ids, (size_t)sp->n_logit_bias * 4);
        l += (size_t)sp->n_logit_bias * 4;
        memcpy(l, sp->logit_bias_values, (size_t)sp->n_logit_bias * 4);
        l += (size_t)sp->n_logit_bias * 4;
        memcpy(l, sp->min_tokens_ids, (size_t)sp->n_min_tokens_ids * 4);
        l += (size_t)sp->n_min_tokens_ids * 4;
        size_t tl = text_len(&segs[i]), pad = pf_wire_seg_grammar_bytes(&segs[i]);
        if (tl) memcpy(l, sp->grammar, tl);
        memset(l + tl, 0, pad - tl);
        l += pad;
    }
    if (rows) memcpy(l, ids, (size_t)rows * 4);
    return (int64_t)need;
}

static int bad(const char *why)
{
    TD_LOG_WARN("stage message rejected: %s", why);
    return TD_EFORMAT;
}

/* One segment record; the counts of its lists are checked against the caps. */
static int parse_seg(const uint8_t *s, pf_seg *g)
{
    g->req_id = get64(s);
    g->t0 = get32(s + 8);
    g->t1 = get32(s + 12);
    g->n_prompt = get32(s + 16);
    g->flags = get32(s + 20);
    g->chunk = get32(s + 24);
    g->n_dst = get32(s + 28);
    g->sampling.temperature = getf(s + 32);
    g->sampling.top_p = getf(s + 36);
    g->sampling.min_p = getf(s + 40);
    g->sampling.repeat_penalty = getf(s + 44);
    g->sampling.top_k = (int32_t)get32(s + 48);
    g->sampling.repeat_last_n = (int32_t)get32(s + 52);
    g->sampling.seed = get64(s + 56);
    g->sampling.skip_samples = get32(s + 64);
    g->sampling.presence_penalty = getf(s + 68);
    g->sampling.frequency_penalty = getf(s + 72);
    uint32_t min_tokens = get32(s + 76), nb = get32(s + 80), nm = get32(s + 84);
    g->n_cached = get32(s + 96);
    g->cached_id = get64(s + 104);
    if (!g->req_id || g->t0 >= g->t1 || g->t1 > g->n_prompt || g->n_dst < 1 ||
        g->sampling.skip_samples >= g->n_prompt || g->n_dst > PF_MAX_TARGETS || (g->flags & ~7u) ||
        !!(g->flags & PF_SEG_FIRST) != (g->t0 == g->n_cached) || get32(s + 100) ||
        (!g->n_cached && g->cached_id) || (!(g->flags & PF_SEG_FIRST) && g->n_cached) ||
        !!(g->flags & PF_SEG_LAST) != (g->t1 == g->n_prompt))
        return bad("inconsistent segment");
    if (min_tokens > INT32_MAX || nb > TD_MAX_LOGIT_BIAS || nm > TD_MAX_MIN_TOKENS_IDS ||
        (!has_lists(g) && (nb || nm)))
        return bad("sampling lists out of range");
    g->sampling.min_tokens = (int32_t)min_tokens;
    g->sampling.n_logit_bias = (int32_t)nb;
    g->sampling.n_min_tokens_ids = (int32_t)nm;
    uint32_t lp = get32(s + 88), tl = get32(s + 92);
    g->sampling.logprobs = lp & 0xffu;
    g->sampling.prompt_logprobs = (lp >> 8) & 1u;
    if ((lp & 0xfe00u) || g->sampling.logprobs > TD_MAX_TOP_LOGPROBS + 1 ||
        (g->sampling.prompt_logprobs && !g->sampling.logprobs))
        return bad("segment logprobs");
    /* a schema text comes with a LAST segment of a schema kind, and only then (parse_chunk
     * reads it) */
    uint32_t kind = lp >> 16;
    bool schema = kind == TD_GRAMMAR_JSON_SCHEMA || kind == TD_GRAMMAR_JSON_SCHEMA_STRICT;
    if (kind > TD_GRAMMAR_JSON_SCHEMA_STRICT || tl > PF_MAX_GRAMMAR_TEXT + 1 ||
        (tl != 0) != (schema && has_lists(g)))
        return bad("segment grammar");
    g->sampling.grammar_kind = (int32_t)kind;
    g->sampling.grammar = NULL;
    g->grammar_len = tl;
    return 0;
}

static int parse_chunk(const uint8_t *b, size_t len, int n_embd, int embd_expected, int max_tokens,
                       pf_msg *out)
{
    if (len < HDR_BYTES) return bad("short chunk header");
    uint32_t n_segs = get32(b + 16), rows = get32(b + 20), embd = get32(b + 24);
    if (n_segs < 1 || n_segs > PF_MAX_SEGS) return bad("segment count");
    if (rows > (uint32_t)max_tokens) return bad("too many rows");
    if (embd_expected ? embd != (uint32_t)n_embd : embd != 0)
        return bad("hidden-state width differs from the model's");
    if (len < HDR_BYTES + (size_t)n_segs * SEG_BYTES) return bad("short segment table");
    int64_t sum = 0;
    for (uint32_t i = 0; i < n_segs; i++) {
        pf_seg *g = &out->segs[i];
        if (parse_seg(b + HDR_BYTES + (size_t)i * SEG_BYTES, g)) return TD_EFORMAT;
        if (!(g->flags & PF_SEG_DEAD)) sum += g->t1 - g->t0;
    }
    if (sum != rows) return bad("rows do not add up");
    size_t lists = 0, gbytes = 0;
    for (uint32_t i = 0; i < n_segs; i++) {
        const pf_seg *g = &out->segs[i];
        size_t pad = ((size_t)g->grammar_len + 3) & ~(size_t)3;
        gbytes += pad;
        if (has_lists(g))
            lists += (size_t)g->sampling.n_logit_bias * 8 +
                     (size_t)g->sampling.n_min_tokens_ids * 4 + pad;
    }
    if (gbytes > PF_WIRE_GRAMMAR_BUDGET) return bad("schema texts over the budget");
    size_t need = payload_off(lists, (int)n_segs, rows) + (size_t)(embd ? rows : 0) * embd * 4;
    if (need != len) return bad("length does not match the counts");
    const uint8_t *l = b + HDR_BYTES + (size_t)n_segs * SEG_BYTES;
    for (uint32_t i = 0; i < n_segs; i++) {
        td_sampling *sp = &out->segs[i].sampling;
        memcpy(sp->logit_bias_ids, l, (size_t)sp->n_logit_bias * 4);
        l += (size_t)sp->n_logit_bias * 4;
        memcpy(sp->logit_bias_values, l, (size_t)sp->n_logit_bias * 4);
        l += (size_t)sp->n_logit_bias * 4;
        memcpy(sp->min_tokens_ids, l, (size_t)sp->n_min_tokens_ids * 4);
        l += (size_t)sp->n_min_tokens_ids * 4;
        uint32_t tl = out->segs[i].grammar_len;
        if (tl) {
            /* one NUL, at the end; the padding is zeros */
            if (l[tl - 1] || memchr(l, 0, tl - 1)) return bad("schema text not NUL-terminated");
            sp->grammar = (const char *)l;
            for (uint32_t k = tl; k < ((tl + 3) & ~3u); k++)
                if (l[k]) return bad("schema text padding");
            l += (tl + 3) & ~3u;
        }
    }
    out->n_segs = (int)n_segs;
    out->n_rows = rows;
    out->ids = malloc((rows ? rows : 1) * sizeof *out->ids);
    if (!out->ids) return TD_ENOMEM;
    memcpy(out->ids, l, (size_t)rows * 4);
    const int32_t *ids = out->ids;
    for (uint32_t i = 0; i < n_segs; i++)
        if (!(out->segs[i].flags & PF_SEG_DEAD)) {
            out->segs[i].tokens = ids;
            ids += out->segs[i].t1 - out->segs[i].t0;
        }
    out->embd = embd ? (const float *)(b + payload_off(lists, (int)n_segs, rows)) : NULL;
    return 0;
}

int pf_wire_parse(const void *buf, size_t len, int n_embd, int embd_expected, int max_tokens,
                  pf_msg *out)
{
    memset(out, 0, sizeof *out);
    const uint8_t *b = buf;
    if (len < 16 || get32(b) != PF_WIRE_MAGIC || (get32(b + 4) & 0xffff) != PF_WIRE_VERSION)
        return bad("bad magic or version");
    out->kind = get32(b + 4) >> 16;
    out->seq = get64(b + 8);
    switch (out->kind) {
    case PF_MSG_CHUNK:
        return parse_chunk(b, len, n_embd, embd_expected, max_tokens, out);
    case PF_MSG_TARGETS: {
        if (len < 28) return bad("short targets message");
        out->req_id = get64(b + 16);
        uint32_t n = get32(b + 24);
        if (n < 1 || n > PF_MAX_TARGETS) return bad("target count");
        size_t off = 28;
        for (uint32_t i = 0; i < n; i++) {
            if (len - off < 4) return bad("truncated target");
            uint32_t l = get32(b + off);
            off += 4;
            if (l > len - off) return bad("target past the end");
            out->target[i] = b + off;
            out->target_len[i] = l;
            off += l;
        }
        if (off != len) return bad("trailing bytes after the targets");
        out->n_targets = (int)n;
        return 0;
    }
    case PF_MSG_ABORT:
    case PF_MSG_RELEASE:
        if (len != 28) return bad("abort message length");
        out->req_id = get64(b + 16);
        out->code = (int32_t)get32(b + 24);
        if (out->kind == PF_MSG_RELEASE && (uint32_t)out->code > 1) return bad("release code");
        return 0;
    default:
        return bad("unknown message kind");
    }
}

void pf_msg_fini(pf_msg *m)
{
    free(m->ids);
    m->ids = NULL;
}

size_t pf_wire_targets_size(const size_t *lens, int n)
{
    size_t s = 28;
    for (int i = 0; i < n; i++)
        s += 4 + lens[i];
    return s;
}

int64_t pf_wire_targets_write(void *buf, size_t cap, uint64_t seq, uint64_t req_id,
                              const uint8_t *const *targets, const size_t *lens, int n)
{
    if (n < 1 || n > PF_MAX_TARGETS) return TD_EINVAL;
    size_t need = pf_wire_targets_size(lens, n);
    if (need > cap) return TD_ERANGE;
    uint8_t *b = buf;
    header(b, PF_MSG_TARGETS, seq);
    put64(b + 16, req_id);
    put32(b + 24, (uint32_t)n);
    size_t off = 28;
    for (int i = 0; i < n; i++) {
        put32(b + off, (uint32_t)lens[i]);
        memcpy(b + off + 4, targets[i], lens[i]);
        off += 4 + lens[i];
    }
    return (int64_t)need;
}

int64_t pf_wire_abort_write(void *buf, size_t cap, uint64_t seq, uint64_t req_id, int32_t code)
{
    if (cap < 28) return TD_ERANGE;
    uint8_t *b = buf;
    header(b, PF_MSG_ABORT, seq);
    put64(b + 16, req_id);
    put32(b + 24, (uint32_t)code);
    return 28;
}

int64_t pf_wire_release_write(void *buf, size_t cap, uint64_t seq, uint64_t req_id, bool insert)
{
    int64_t n = pf_wire_abort_write(buf, cap, seq, req_id, insert);
    if (n > 0) header(buf, PF_MSG_RELEASE, seq);
    return n;
}

void pf_wire_report_write(uint8_t b[PF_REPORT_BYTES], const pf_report *r)
{
    header(b, PF_MSG_REPORT, r->epoch);
    put64(b + 16, r->req_id);
    put32(b + 24, r->stage);
    put32(b + 28, (uint32_t)r->status);
    put32(b + 32, (uint32_t)r->first_token);
    put32(b + 36, r->reason);
    put64(b + 40, (uint64_t)r->end_ms);
    put64(b + 48, r->kv_bytes);
    put32(b + 56, r->kv_xfer_us);
    put32(b + 60, r->kv_exposed_us);
    memset(b + 64, 0, PF_REPORT_BYTES - 64);
    put64(b + 80, r->cache_hit_tokens);
    put64(b + 88, r->cache_evicted);
    if (!r->has_lp) return;
    put32(b + 64, 1);
    put32(b + 68, (uint32_t)r->first_lp.n_top);
    putf(b + 72, r->first_lp.logprob);
    for (int j = 0; j < r->first_lp.n_top && j < TD_MAX_TOP_LOGPROBS; j++) {
        put32(b + 96 + 8 * j, (uint32_t)r->first_lp.top[j].id);
        putf(b + 100 + 8 * j, r->first_lp.top[j].logprob);
    }
}

/* A logprob as the router's control codec accepts it: not NaN, <= 0 (or -inf). */
static bool lp_ok(float x)
{
    return !isnan(x) && x <= 0;
}

int pf_wire_report_parse(const void *buf, size_t len, pf_report *out)
{
    const uint8_t *b = buf;
    if (len != PF_REPORT_BYTES || get32(b) != PF_WIRE_MAGIC ||
        get32(b + 4) != (PF_WIRE_VERSION | (uint32_t)PF_MSG_REPORT << 16))
        return bad("bad report");
    out->epoch = get64(b + 8);
    out->req_id = get64(b + 16);
    out->stage = get32(b + 24);
    out->status = (int32_t)get32(b + 28);
    out->first_token = (int32_t)get32(b + 32);
    out->reason = get32(b + 36);
    out->end_ms = (int64_t)get64(b + 40);
    out->kv_bytes = get64(b + 48);
    out->kv_xfer_us = get32(b + 56);
    out->kv_exposed_us = get32(b + 60);
    out->cache_hit_tokens = get64(b + 80);
    out->cache_evicted = get64(b + 88);
    out->has_lp = get32(b + 64) != 0;
    uint32_t k = get32(b + 68);
    if (get32(b + 64) > 1 || k > TD_MAX_TOP_LOGPROBS) return bad("report logprob");
    out->first_lp.n_top = (int32_t)k;
    out->first_lp.logprob = getf(b + 72);
    if (out->has_lp && !lp_ok(out->first_lp.logprob)) return bad("report logprob value");
    for (uint32_t j = 0; j < k; j++) {
        out->first_lp.top[j].id = (int32_t)get32(b + 96 + 8 * j);
        out->first_lp.top[j].logprob = getf(b + 100 + 8 * j);
        if (out->first_lp.top[j].id < 0 || !lp_ok(out->first_lp.top[j].logprob))
            return bad("report logprob alternative");
    }
    return 0;
}

/* ---- LOGPROBS: header 16, req_id 8, from 4, n 4, k 4, spare 4; entries ---- */

#define LP_HDR 40

int pf_wire_lp_max_entries(int k)
{
    return (PF_LP_MAX_BYTES - LP_HDR) / (4 + 8 * k);
}

int64_t pf_wire_lp_write(void *buf, size_t cap, uint64_t epoch, uint64_t req_id, uint32_t from,
                         const td_logprob_entry *e, int n, int k)
{
    if (n < 1 || k < 0 || k > TD_MAX_TOP_LOGPROBS || n > pf_wire_lp_max_entries(k))
        return TD_EINVAL;
    size_t need = LP_HDR + (size_t)n * (4 + 8 * (size_t)k);
    if (need > cap) return TD_ERANGE;
    uint8_t *b = buf;
    header(b, PF_MSG_LOGPROBS, epoch);
    put64(b + 16, req_id);
    put32(b + 24, from);
    put32(b + 28, (uint32_t)n);
    put32(b + 32, (uint32_t)k);
    put32(b + 36, 0);
    uint8_t *p = b + LP_HDR;
    for (int i = 0; i < n; i++) {
        if (e[i].n_top != k) return TD_EINVAL;
        putf(p, e[i].logprob);
        p += 4;
        for (int j = 0; j < k; j++, p += 8) {
            put32(p, (uint32_t)e[i].top[j].id);
            putf(p + 4, e[i].top[j].logprob);
        }
    }
    return (int64_t)need;
}

int pf_wire_lp_parse(const void *buf, size_t len, pf_lp_msg *out)
{
    const uint8_t *b = buf;
    if (len < LP_HDR || len > PF_LP_MAX_BYTES || pf_wire_kind(buf, len) != PF_MSG_LOGPROBS)
        return bad("bad logprobs message");
    out->epoch = get64(b + 8);
    out->req_id = get64(b + 16);
    out->from = get32(b + 24);
    uint32_t n = get32(b + 28), k = get32(b + 32);
    if (k > TD_MAX_TOP_LOGPROBS || n < 1 || n > (uint32_t)pf_wire_lp_max_entries((int)k) ||
        len != LP_HDR + (size_t)n * (4 + 8 * (size_t)k))
        return bad("logprobs message counts");
    out->n = (int)n;
    out->k = (int)k;
    out->entries = b + LP_HDR;
    const uint8_t *p = out->entries;
    for (uint32_t i = 0; i < n; i++) {
        if (!lp_ok(getf(p))) return bad("logprobs message value");
        p += 4;
        for (uint32_t j = 0; j < k; j++, p += 8)
            if ((int32_t)get32(p) < 0 || !lp_ok(getf(p + 4)))
                return bad("logprobs message alternative");
    }
    return 0;
}

void pf_wire_lp_entry(const pf_lp_msg *m, int i, td_logprob_entry *e)
{
    const uint8_t *p = m->entries + (size_t)i * (4 + 8 * (size_t)m->k);
    e->logprob = getf(p);
    e->n_top = m->k;
    for (int j = 0; j < m->k; j++)
        e->top[j] =
            (td_logprob){.id = (int32_t)get32(p + 4 + 8 * j), .logprob = getf(p + 8 + 8 * j)};
}

uint32_t pf_wire_kind(const void *buf, size_t len)
{
    const uint8_t *b = buf;
    if (len < 16 || get32(b) != PF_WIRE_MAGIC || (get32(b + 4) & 0xffff) != PF_WIRE_VERSION)
        return 0;
    return get32(b + 4) >> 16;
}
