/* pf_wire.h: the messages between the pipeline stages of one prefill instance.
 *
 * Purpose: stage 0 decides everything (which requests, which chunk sizes, the KV targets,
 * aborts) and its decisions flow down the stage chain 0 -> 1 -> ... -> pp-1 as one
 * ordered stream of messages on the activation pipe, so no stage ever schedules on its
 * own and the stages cannot diverge:
 *   CHUNK    a micro-batch: segments (request, token range [t0, t1), flags, sampling
 *            parameters) with their token ids and, after stage 0, the hidden states of
 *            every live row (rows of DEAD segments are left out);
 *   TARGETS  the decode ranks' kvxfer targets of a request (sent after its first chunk);
 *   ABORT    stop a request (cancel, deadline, a failed stage);
 *   RELEASE  stage 0 is done with a request (every stage reported, or it gave up): each
 *            stage drops its hold on the request's cached prefix blocks and, when the
 *            code is 1 (it succeeded on every stage), inserts its whole blocks into its
 *            prefix cache (pf_kvcache.h). Sent at the same point of the stream to every
 *            stage, so their caches stay identical.
 * Each stage s > 0 also sends REPORTs back to stage 0 (one per request it finished or
 * failed), as active messages; the last stage's report carries the first token's logprob
 * (sampling.logprobs), and before it the last stage sends LOGPROBS messages with the prompt
 * tokens' logprobs (sampling.prompt_logprobs), each at most PF_LP_MAX_BYTES (an active
 * message), in prompt order.
 * Format: little-endian, fixed-size header and segment records, then the sampler's lists
 * (logit bias, min_tokens ids, the grammar's schema text) of the segments that end a prompt
 * (LAST) only, then the token ids, then the 64-byte aligned payload. Other segments carry
 * no lists (their sampling.n_logit_bias and n_min_tokens_ids parse as 0, their
 * sampling.grammar as NULL; grammar_kind travels with every segment): a request's bias and
 * schema travel once. The schema texts of one chunk message add up to at most
 * PF_WIRE_GRAMMAR_BUDGET bytes (stage 0's planner keeps to it: pf_wire_seg_grammar_bytes).
 * Invariants: pf_wire_parse_* check every count and offset against the received length
 * and the limits given; a malformed message is TD_EFORMAT (never a crash).
 * Threading: pure functions. Ownership: parsed views point into the caller's buffer.
 */
#ifndef PF_WIRE_H
#define PF_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_sampling.h"

#define PF_WIRE_MAGIC   0x46504454u /* "TDPF" */
#define PF_WIRE_VERSION 6u
#define PF_MAX_SEGS     64 /* segments (requests) in one chunk */
#define PF_MAX_TARGETS  64 /* decode ranks of one request */
/* A schema's text, without its NUL (grammar/gr_grammar.h GR_MAX_TEXT), and the schema bytes
 * (padded, NULs included) of one chunk message: a few of the largest */
#define PF_MAX_GRAMMAR_TEXT    (1 << 16)
#define PF_WIRE_GRAMMAR_BUDGET (4 * (PF_MAX_GRAMMAR_TEXT + 4))

enum {
    PF_MSG_CHUNK = 1,
    PF_MSG_TARGETS = 2,
    PF_MSG_ABORT = 3,
    PF_MSG_REPORT = 4,
    PF_MSG_LOGPROBS = 5, /* last stage -> stage 0: prompt logprobs of a request */
    PF_MSG_RELEASE = 6,  /* stage 0 -> down the chain: a request's cache hold ends */
};

enum {
    PF_SEG_FIRST = 1, /* t0 == n_cached: the stage opens the request */
    PF_SEG_LAST = 2,  /* t1 == n_prompt: the stage finishes it (last stage samples) */
    PF_SEG_DEAD = 4,  /* failed on an earlier stage: no rows, the stage aborts it */
};

typedef struct {
    uint64_t req_id;
    uint32_t t0, t1, n_prompt;
    uint32_t flags;
    uint32_t chunk;        /* index of this chunk within the request: 0, 1, ... */
    uint32_t n_dst;        /* decode ranks of the request */
    uint32_t n_cached;     /* FIRST: tokens [0, n_cached) come from the prefix cache (whole
                              blocks, < n_prompt); 0 on other segments */
    uint64_t cached_id;    /* n_cached > 0: td_block_hash id of the last cached block */
    td_sampling sampling;  /* .skip_samples < n_prompt; parse: .grammar into the buffer */
    uint32_t grammar_len;  /* parse: bytes of sampling.grammar with its NUL, 0: none */
    const int32_t *tokens; /* parse: (t1 - t0) ids, unaligned-safe copy made by the parser */
} pf_seg;

/* Bytes of a chunk message with these segments (rows = live rows, embd floats each). */
size_t pf_wire_chunk_size(const pf_seg *segs, int n_segs, int64_t n_ids, int64_t rows, int n_embd);
/* The largest chunk message of n_ids ids and rows rows (PF_MAX_SEGS segments, full lists). */
size_t pf_wire_chunk_max_size(int64_t n_ids, int64_t rows, int n_embd);
/* Bytes that segment g's schema text adds to a chunk message (0 unless LAST with one). */
size_t pf_wire_seg_grammar_bytes(const pf_seg *g);
/* Offset of the payload (hidden states) inside a chunk message (64-byte aligned). */
size_t pf_wire_chunk_payload_off(const pf_seg *segs, int n_segs, int64_t n_ids);

/* Write the header, segments and token ids of a chunk into buf (cap bytes); the caller
 * writes rows * n_embd floats at pf_wire_chunk_payload_off. ids: the concatenated token
 * ids of the live segments in order. Returns bytes of the whole message, TD_ERANGE (cap), or
 * TD_EINVAL (a list count outside its cap; a LAST segment's schema kind without its text, or
 * a text over PF_MAX_GRAMMAR_TEXT; the texts over PF_WIRE_GRAMMAR_BUDGET). */
int64_t pf_wire_chunk_write(void *buf, size_t cap, uint64_t seq, const pf_seg *segs, int n_segs,
                            const int32_t *ids, int n_embd);

typedef struct {
    uint32_t kind;
    uint64_t seq;
    /* CHUNK */
    int n_segs;
    pf_seg segs[PF_MAX_SEGS];
    int64_t n_rows;    /* live rows */
    int32_t *ids;      /* (n_rows) token ids (owned by the view) */
    const float *embd; /* (n_rows, n_embd) into the buffer, or NULL if the message has none */
    /* TARGETS / ABORT */
    uint64_t req_id;
    int n_targets;
    const uint8_t *target[PF_MAX_TARGETS];
    size_t target_len[PF_MAX_TARGETS];
    int32_t code; /* ABORT: td_err */
} pf_msg;

/* Parse a chain message. embd_expected: payload must be present (stages > 0). On
 * success the view's ids are malloc'd (free with pf_msg_fini). */
int pf_wire_parse(const void *buf, size_t len, int n_embd, int embd_expected, int max_tokens,
                  pf_msg *out);
void pf_msg_fini(pf_msg *m);

int64_t pf_wire_targets_write(void *buf, size_t cap, uint64_t seq, uint64_t req_id,
                              const uint8_t *const *targets, const size_t *lens, int n);
size_t pf_wire_targets_size(const size_t *lens, int n);
int64_t pf_wire_abort_write(void *buf, size_t cap, uint64_t seq, uint64_t req_id, int32_t code);
/* RELEASE: the ABORT layout, code = insert (0 or 1); parsed into pf_msg.code. */
int64_t pf_wire_release_write(void *buf, size_t cap, uint64_t seq, uint64_t req_id, bool insert);

/* A stage's report to stage 0 about one request it is done with. */
typedef struct {
    uint64_t epoch;
    uint64_t req_id;
    uint32_t stage;
    int32_t status;      /* 0: its transfer completed; else a td_err */
    int32_t first_token; /* last stage: the sampled first token; else -1 */
    uint32_t reason;     /* kvx_fail_reason when status != 0 */
    int64_t end_ms;      /* td_now_ms when the transfer ended */
    /* the stage's KV push, for the router's metrics (0 when the transfer failed) */
    uint64_t kv_bytes;      /* bytes put to the decode ranks */
    uint32_t kv_xfer_us;    /* time some of its puts were in flight (issued to landed) */
    uint32_t kv_exposed_us; /* its last chunk's compute end to its last chunk landing */
    uint64_t cache_hit_tokens, cache_evicted; /* the stage's prefix cache so far */
    bool has_lp; /* last stage, sampling.logprobs: first_lp is the first token's */
    td_logprob_entry first_lp;
} pf_report;

/* 64 bytes (ids, status, KV push figures), then the logprob: has_lp, n_top, logprob, 4 spare,
 * the prefix cache's hit blocks and evictions (8 each), 20 (id, logprob) pairs;
 * <= PF_LINK_REPORT_MAX */
#define PF_REPORT_BYTES (96 + 8 * TD_MAX_TOP_LOGPROBS)
void pf_wire_report_write(uint8_t buf[PF_REPORT_BYTES], const pf_report *r);
int pf_wire_report_parse(const void *buf, size_t len, pf_report *out);

/* Prompt logprobs (last stage -> stage 0): entries e (n) of prompt positions from .. from+n-1
 * of request req_id, k alternatives each (sampling.logprobs - 1; every entry has n_top k).
 * A message is at most PF_LP_MAX_BYTES: pf_wire_lp_max_entries(k) entries. */
#define PF_LP_MAX_BYTES 4096 /* KVX_AM_MAX */
int pf_wire_lp_max_entries(int k);
int64_t pf_wire_lp_write(void *buf, size_t cap, uint64_t epoch, uint64_t req_id, uint32_t from,
                         const td_logprob_entry *e, int n, int k);
typedef struct {
    uint64_t epoch, req_id;
    uint32_t from;
    int n, k;
    const uint8_t *entries; /* n * (4 + 8 k) bytes: logprob, then k (id, logprob) */
} pf_lp_msg;
/* TD_EFORMAT unless buf is a well-formed LOGPROBS message (k <= TD_MAX_TOP_LOGPROBS, ids
 * >= 0, logprobs not NaN and <= 0). */
int pf_wire_lp_parse(const void *buf, size_t len, pf_lp_msg *out);
/* Entry i of a parsed message. */
void pf_wire_lp_entry(const pf_lp_msg *m, int i, td_logprob_entry *e);
/* The kind of a chain or report message (its header), or 0 if it has no valid header. */
uint32_t pf_wire_kind(const void *buf, size_t len);

#endif
