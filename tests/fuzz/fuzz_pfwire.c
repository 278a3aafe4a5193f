/* fuzz_pfwire.c: libFuzzer target for the prefill stage-chain messages (prefill-node/
 * pf_wire.h): what a stage parses from the previous stage (CHUNK, TARGETS, ABORT) and
 * what stage 0 parses from the others (REPORT).
 *
 * Input: mode u8, then bytes.
 *   mode & 1 == 0  the bytes are a whole message, parsed as a chain message (with and
 *                  without a hidden-state payload) and as a report;
 *   mode & 1 == 1  the bytes describe up to 8 segments (a compact record each) that the
 *                  harness encodes with pf_wire_chunk_write (or a TARGETS message), then
 *                  flips the bytes named by the input's tail before parsing, so mutations
 *                  reach deep into an otherwise valid message.
 * Oracle: no crash, leak or out-of-bounds access; a parsed CHUNK's segments are consistent
 * (t0 < t1 <= n_prompt, FIRST/LAST flags agree, live rows add up, every token pointer and
 * the payload lie inside the buffer); a message the harness built and did not mutate
 * parses back to the same segments (the sampler's lists on the LAST segments only).
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pf_wire.h"
#include "td_err.h"

#define N_EMBD 4
#define MAXTOK 64

static void check_chunk(const pf_msg *m, const uint8_t *buf, size_t len)
{
    int64_t rows = 0;
    for (int i = 0; i < m->n_segs; i++) {
        const pf_seg *g = &m->segs[i];
        if (!(g->t0 < g->t1 && g->t1 <= g->n_prompt)) abort();
        if (!!(g->flags & PF_SEG_FIRST) != (g->t0 == g->n_cached)) abort();
        if (!(g->flags & PF_SEG_FIRST) && g->n_cached) abort();
        if (!g->n_cached && g->cached_id) abort();
        if (!!(g->flags & PF_SEG_LAST) != (g->t1 == g->n_prompt)) abort();
        if (!(g->flags & PF_SEG_DEAD)) {
            if (g->tokens < m->ids || g->tokens + (g->t1 - g->t0) > m->ids + m->n_rows) abort();
            rows += g->t1 - g->t0;
        }
    }
    if (rows != m->n_rows || rows > MAXTOK) abort();
    if (m->embd) {
        const uint8_t *e = (const uint8_t *)m->embd;
        if (e < buf || e + (size_t)m->n_rows * N_EMBD * sizeof(float) > buf + len) abort();
        volatile float sink = 0;
        for (int64_t i = 0; i < m->n_rows * N_EMBD; i++)
            sink += m->embd[i]; /* ASan: every payload float is readable */
        (void)sink;
    }
}

/* A parsed segment's lists: its sent ones when it ends a prompt, none otherwise. */
static bool lists_equal(const pf_seg *got, const pf_seg *sent)
{
    const td_sampling *a = &got->sampling, *b = &sent->sampling;
    bool last = sent->flags & PF_SEG_LAST;
    if (a->min_tokens != b->min_tokens) return false;
    if (a->n_logit_bias != (last ? b->n_logit_bias : 0)) return false;
    if (a->n_min_tokens_ids != (last ? b->n_min_tokens_ids : 0)) return false;
    for (int k = 0; k < a->n_logit_bias; k++)
        if (a->logit_bias_ids[k] != b->logit_bias_ids[k] ||
            a->logit_bias_values[k] != b->logit_bias_values[k])
            return false;
    for (int k = 0; k < a->n_min_tokens_ids; k++)
        if (a->min_tokens_ids[k] != b->min_tokens_ids[k]) return false;
    /* the grammar: its kind everywhere, a schema's text with the LAST segment only */
    if (a->grammar_kind != b->grammar_kind) return false;
    bool text = last && b->grammar_kind >= TD_GRAMMAR_JSON_SCHEMA;
    if (text ? !a->grammar || strcmp(a->grammar, b->grammar) : a->grammar != NULL) return false;
    return true;
}

static void parse_all(const uint8_t *buf, size_t len)
{
    for (int embd = 0; embd < 2; embd++) {
        pf_msg m;
        if (pf_wire_parse(buf, len, N_EMBD, embd, MAXTOK, &m) == 0) {
            if (m.kind == PF_MSG_CHUNK) check_chunk(&m, buf, len);
            if (m.kind == PF_MSG_TARGETS)
                for (int i = 0; i < m.n_targets; i++)
                    if (m.target[i] < buf || m.target[i] + m.target_len[i] > buf + len) abort();
        }
        pf_msg_fini(&m);
    }
    pf_report r;
    pf_wire_report_parse(buf, len, &r);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    td_log_set_level(TD_LOG_ERROR); /* rejected messages are warnings: keep the run quiet */
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    uint8_t mode = data[0];
    data++, size--;
    if (!(mode & 1)) {
        uint8_t *copy = malloc(size ? size : 1); /* exact size: reads past it are caught */
        memcpy(copy, data, size);
        parse_all(copy, size);
        free(copy);
        return 0;
    }
    /* build: segments of 6 bytes each (t0, len, n_prompt extra, flags-ish) */
    pf_seg segs[8];
    int32_t ids[MAXTOK];
    int n = 0;
    int64_t rows = 0;
    size_t off = 0;
    while (n < 8 && off + 6 <= size && n < (mode >> 1 & 7) + 1) {
        const uint8_t *r = data + off;
        off += 6;
        uint32_t t0 = r[0] % 32, l = r[1] % 16 + 1, extra = r[2] % 8;
        bool dead = r[3] & 1;
        if (!dead && rows + l > MAXTOK) break;
        segs[n] = (pf_seg){.req_id = (uint64_t)r[4] + 1,
                           .t0 = t0,
                           .t1 = t0 + l,
                           .n_prompt = t0 + l + extra,
                           .chunk = r[5],
                           .n_dst = 1 + r[5] % 4};
        bool first = t0 == 0 || (r[3] & 2); /* after a cached prefix of t0 tokens */
        segs[n].flags =
            (first ? PF_SEG_FIRST : 0) | (extra == 0 ? PF_SEG_LAST : 0) | (dead ? PF_SEG_DEAD : 0);
        segs[n].n_cached = first ? t0 : 0;
        segs[n].cached_id = first && t0 ? (uint64_t)r[4] << 32 | r[5] | 1 : 0;
        segs[n].sampling.seed = (uint64_t)r[5] << 40 | r[4];
        segs[n].sampling.skip_samples = r[2] % segs[n].n_prompt; /* < n_prompt */
        segs[n].sampling.presence_penalty = (float)(r[3] >> 1) / 32 - 2;
        segs[n].sampling.frequency_penalty = (float)r[5] / 64 - 2;
        /* the sampler's lists: written for LAST segments only, parsed back as they were */
        segs[n].sampling.min_tokens = r[1] % 5;
        segs[n].sampling.n_logit_bias = r[0] % 3;
        segs[n].sampling.n_min_tokens_ids = r[4] % 3;
        for (int k = 0; k < 3; k++) {
            segs[n].sampling.logit_bias_ids[k] = r[k] + k;
            segs[n].sampling.logit_bias_values[k] = (float)r[5 - k] - 100;
            segs[n].sampling.min_tokens_ids[k] = r[5 - k];
        }
        /* a grammar: none, json_object, or a schema text of 0..6 bytes (+ NUL: padding) */
        static const char *texts[] = {"{}", "{\"a\":1}", "true", "[1,2]", "{\"b\":[]}", "x"};
        segs[n].sampling.grammar_kind = r[2] % 4;
        if (segs[n].sampling.grammar_kind >= TD_GRAMMAR_JSON_SCHEMA)
            segs[n].sampling.grammar = texts[r[3] % 6];
        for (uint32_t k = 0; !dead && k < l; k++)
            ids[rows + k] = (int32_t)(r[4] * 31 + k);
        if (!dead) rows += l;
        n++;
    }
    if (!n) return 0;
    size_t cap = pf_wire_chunk_size(segs, n, rows, rows, N_EMBD);
    uint8_t *buf = calloc(1, cap);
    int64_t len = pf_wire_chunk_write(buf, cap, 1, segs, n, ids, N_EMBD);
    if (len < 0 || (size_t)len != cap) abort();
    pf_msg m;
    if (pf_wire_parse(buf, (size_t)len, N_EMBD, 1, MAXTOK, &m) != 0) abort(); /* round trip */
    if (m.n_segs != n || m.n_rows != rows) abort();
    for (int i = 0; i < n; i++)
        if (m.segs[i].req_id != segs[i].req_id || m.segs[i].t1 != segs[i].t1 ||
            m.segs[i].flags != segs[i].flags || m.segs[i].n_cached != segs[i].n_cached ||
            m.segs[i].cached_id != segs[i].cached_id ||
            m.segs[i].sampling.seed != segs[i].sampling.seed ||
            m.segs[i].sampling.skip_samples != segs[i].sampling.skip_samples ||
            m.segs[i].sampling.presence_penalty != segs[i].sampling.presence_penalty ||
            m.segs[i].sampling.frequency_penalty != segs[i].sampling.frequency_penalty ||
            !lists_equal(&m.segs[i], &segs[i]))
            abort();
    pf_msg_fini(&m);
    /* the rest of the input: (offset u16, xor u8) flips, and maybe a truncation */
    for (; off + 3 <= size; off += 3) {
        size_t at = ((size_t)data[off] | (size_t)data[off + 1] << 8) % (size_t)len;
        buf[at] ^= data[off + 2];
    }
    size_t cut =
        (mode & 0x80) ? (size_t)len - (size_t)(data[size - 1] % (len > 1 ? len : 1)) : (size_t)len;
    parse_all(buf, cut);
    free(buf);
    return 0;
}
