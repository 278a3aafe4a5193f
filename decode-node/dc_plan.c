/* dc_plan.c: flat encoding of a step's batch:
 *   u32 magic 'TDPL', u32 kind, u64 step, i32 n_tokens, i32 n_seqs, i32 n_solo, i32 n_logits,
 *   i32 tokens[n_tokens], i32 pos[n_tokens], i32 seq_of[n_tokens], i32 logit_rows[n_logits],
 *   per sequence: i32 n_ctx, then i32 blocks[ceil(n_ctx / block_size)]
 * The ranks of an instance share a host, so byte order is the host's. */
#include "dc_plan.h"

#include <stdlib.h>
#include <string.h>

#include "td_err.h"

#define PLAN_MAGIC   0x4c504454u /* "TDPL" */
#define HEADER_BYTES 32

static int blocks_for(int32_t n_ctx, int block_size)
{
    return (int)((n_ctx + block_size - 1) / block_size);
}

size_t dc_plan_size(const kn_batch *b, int block_size)
{
    if (!b) return HEADER_BYTES;
    size_t n =
        HEADER_BYTES + (size_t)b->n_tokens * 12 + (size_t)b->n_logits * 4 + (size_t)b->n_seqs * 4;
    for (int s = 0; s < b->n_seqs; s++)
        n += (size_t)blocks_for(b->seqs[s].n_ctx, block_size) * 4;
    return n;
}

static void put(uint8_t **p, const void *src, size_t n)
{
    memcpy(*p, src, n);
    *p += n;
}

int dc_plan_encode(const kn_batch *b, int block_size, uint64_t step, void *buf, size_t cap,
                   size_t *len)
{
    size_t need = dc_plan_size(b, block_size);
    if (need > cap) {
        TD_LOG_ERR("step %llu: plan of %zu bytes exceeds the plan area (%zu)",
                   (unsigned long long)step, need, cap);
        return TD_ERANGE;
    }
    uint8_t *p = buf;
    uint32_t magic = PLAN_MAGIC, kind = b ? DC_PLAN_RUN : DC_PLAN_SHUTDOWN;
    int32_t nt = b ? (int32_t)b->n_tokens : 0, ns = b ? b->n_seqs : 0;
    int32_t solo = b ? (int32_t)b->n_solo : 0, nl = b ? b->n_logits : 0;
    put(&p, &magic, 4);
    put(&p, &kind, 4);
    put(&p, &step, 8);
    put(&p, &nt, 4);
    put(&p, &ns, 4);
    put(&p, &solo, 4);
    put(&p, &nl, 4);
    if (b) {
        put(&p, b->tokens, (size_t)nt * 4);
        put(&p, b->pos, (size_t)nt * 4);
        put(&p, b->seq_of, (size_t)nt * 4);
        if (nl) put(&p, b->logit_rows, (size_t)nl * 4);
        for (int s = 0; s < ns; s++) {
            put(&p, &b->seqs[s].n_ctx, 4);
            put(&p, b->seqs[s].block_table, (size_t)blocks_for(b->seqs[s].n_ctx, block_size) * 4);
        }
    }
    *len = (size_t)(p - (uint8_t *)buf);
    return 0;
}

void dc_plan_view_init(dc_plan_view *v)
{
    memset(v, 0, sizeof *v);
}

void dc_plan_view_fini(dc_plan_view *v)
{
    free(v->views);
    free(v->scratch);
    memset(v, 0, sizeof *v);
}

static int bad(const char *what)
{
    TD_LOG_ERR("malformed step plan: %s", what);
    return TD_EFORMAT;
}

int dc_plan_decode(const void *buf, size_t len, int block_size, int n_blocks, dc_plan_view *v)
{
    const uint8_t *p = buf, *end = p + len;
    uint32_t magic, kind;
    int32_t nt, ns, solo, nl;
    if (len < HEADER_BYTES) return bad("shorter than its header");
    memcpy(&magic, p, 4);
    memcpy(&kind, p + 4, 4);
    memcpy(&v->step, p + 8, 8);
    memcpy(&nt, p + 16, 4);
    memcpy(&ns, p + 20, 4);
    memcpy(&solo, p + 24, 4);
    memcpy(&nl, p + 28, 4);
    p += HEADER_BYTES;
    if (magic != PLAN_MAGIC) return bad("bad magic");
    if (kind == DC_PLAN_SHUTDOWN) {
        v->kind = kind;
        memset(&v->batch, 0, sizeof v->batch);
        return 0;
    }
    if (kind != DC_PLAN_RUN || nt < 1 || ns < 1 || ns > nt || solo < 0 || solo > nt || nl < 0 ||
        nl > nt)
        return bad("bad kind or counts");
    /* the arrays and the tables must fit what is left; copy them into aligned scratch */
    size_t left = (size_t)(end - p);
    if ((size_t)nt * 12 + (size_t)nl * 4 > left) return bad("token arrays past the end");
    size_t words = left / 4;
    if (v->cap_scratch < words) {
        free(v->scratch);
        v->scratch = malloc(words * sizeof *v->scratch);
        if (!v->scratch) {
            v->cap_scratch = 0;
            return TD_ENOMEM;
        }
        v->cap_scratch = words;
    }
    if (v->cap_views < ns) {
        free(v->views);
        v->views = malloc((size_t)ns * sizeof *v->views);
        if (!v->views) {
            v->cap_views = 0;
            return TD_ENOMEM;
        }
        v->cap_views = ns;
    }
    memcpy(v->scratch, p, words * 4);
    int32_t *tok = v->scratch, *pos = tok + nt, *seq_of = pos + nt, *rows = seq_of + nt;
    int32_t *q = rows + nl;
    int32_t *qend = v->scratch + words;
    for (int s = 0; s < ns; s++) {
        if (q >= qend) return bad("sequence table past the end");
        int32_t n_ctx = *q++;
        if (n_ctx < 1) return bad("sequence with no context");
        int nb = blocks_for(n_ctx, block_size);
        if (nb > qend - q) return bad("block table past the end");
        for (int j = 0; j < nb; j++)
            if (q[j] < 0 || q[j] >= n_blocks) return bad("block id outside the pool");
        v->views[s] = (kn_seq_view){.block_table = q, .n_ctx = n_ctx};
        q += nb;
    }
    if (q != qend || (size_t)(end - p) != words * 4) return bad("trailing bytes");
    v->kind = kind;
    v->batch = (kn_batch){.n_tokens = nt,
                          .n_solo = solo,
                          .tokens = tok,
                          .pos = pos,
                          .seq_of = seq_of,
                          .n_seqs = ns,
                          .seqs = v->views,
                          .n_logits = nl,
                          .logit_rows = nl ? rows : NULL};
    return 0;
}
