/* kvx_conn_put.c: the prefill side's puts: head slicing (each decode rank gets the heads it
 * holds; a sliced source gives one piece per slice), coalescing of contiguous pieces into
 * single puts, and the staging arenas that gather small pieces contiguous only at the
 * destination (a head-major source with more heads than the destination). */
#include <stdlib.h>
#include <string.h>

#include "kvx_conn_int.h"

/* Coalescer: pieces contiguous on both sides become one put. Small pieces that are
 * contiguous at the destination only (a head slice of consecutive blocks when the source
 * holds more heads than the destination) are gathered into a staging buffer and go as one
 * put; the buffer lives until the chunk's flush of that target completed. Only isolated
 * pieces are staged: a run of source-contiguous pieces (a sliced source's run of blocks)
 * goes as it is where the source's run breaks, and a staged run ends where the source's
 * pieces become contiguous again, so a sliced source whose block table has gaps copies at
 * most the isolated blocks around them. */
#define STAGE_PIECE_MAX (64u << 10)         /* bytes: larger pieces go directly */
#define STAGE_MAX       (1u << 20)          /* bytes per staged put */
#define STAGE_POOL_MAX  ((size_t)512 << 20) /* bytes of idle arenas kept for reuse */

typedef struct {
    kvx_conn *c;
    kvxi_pf_req *r;
    kvxi_pf_target *t;
    const uint8_t *src;
    uint64_t dst;
    size_t len;
    bool staged;            /* the current run lives in the arena */
    int n_run;              /* pieces in the current run */
    const uint8_t *last;    /* end of the last piece's source bytes */
    kvxi_chunk_copy *arena; /* staging bytes of this call (one target), taken on first use */
    size_t arena_need;      /* upper bound of what this call can stage */
    size_t used;            /* arena bytes used (the current staged run ends here) */
    int err;
} coalescer;

static void co_flush(coalescer *co)
{
    if (!co->len || co->err) {
        co->len = 0;
        co->staged = false;
        return;
    }
    kvxi_peer *p = &co->c->peers[co->t->peer];
    int err = kvx_pipe_put(co->c->pipe, p->peer, co->src, co->len, co->dst, p->rkey);
    if (err) co->err = err;
    co->r->puts++;
    co->r->bytes += co->len;
    co->len = 0;
    co->staged = false;
}

/* A staging arena of at least `need` bytes: a recycled one or a new one. */
static kvxi_chunk_copy *arena_get(kvx_conn *c, size_t need)
{
    for (kvxi_chunk_copy **pp = &c->stage_pool; *pp; pp = &(*pp)->next)
        if ((*pp)->bytes >= need) {
            kvxi_chunk_copy *a = *pp;
            *pp = a->next;
            c->stage_pool_bytes -= a->bytes;
            a->next = NULL;
            return a;
        }
    kvxi_chunk_copy *a = malloc(sizeof(*a) + need);
    if (!a) return NULL;
    *a = (kvxi_chunk_copy){.bytes = need};
    c->held_bytes += need;
    return a;
}

void kvxi_arena_put(kvx_conn *c, kvxi_chunk_copy *a)
{
    if (c->stage_pool_bytes + a->bytes <= STAGE_POOL_MAX) {
        a->next = c->stage_pool;
        c->stage_pool = a;
        c->stage_pool_bytes += a->bytes;
        return;
    }
    c->held_bytes -= a->bytes;
    free(a);
}

static void co_add(coalescer *co, const uint8_t *src, uint64_t dst, size_t len)
{
    co->r->pieces++;
    const bool resumes = co->last == src; /* the source's pieces are contiguous again */
    co->last = src + len;
    if (co->len && co->dst + co->len == dst) {
        if (!co->staged && co->src + co->len == src) {
            co->len += len;
            co->n_run++;
            return;
        }
        if (len <= STAGE_PIECE_MAX && co->len + len <= STAGE_MAX &&
            (co->staged ? !resumes : co->n_run == 1)) {
            if (!co->arena) co->arena = arena_get(co->c, co->arena_need);
            if (co->arena && !co->staged && co->used + co->len + len <= co->arena->bytes) {
                memcpy(co->arena->data + co->used, co->src, co->len);
                co->r->staged += co->len;
                co->src = co->arena->data + co->used;
                co->staged = true;
            }
            if (co->staged && co->used + co->len + len <= co->arena->bytes) {
                memcpy(co->arena->data + co->used + co->len, src, len);
                co->r->staged += len;
                co->len += len;
                co->n_run++;
                return;
            }
        }
    }
    if (co->staged) co->used += co->len;
    co_flush(co);
    co->src = src;
    co->dst = dst;
    co->len = len;
    co->n_run = 1;
}

/* A whole block's common heads [i0, i1) (global ids): one piece per source slice they
 * touch (one piece in a head-major source). */
static void put_block(coalescer *co, const uint8_t *src, const kvx_layout *sl, uint32_t ll,
                      uint32_t kv, uint32_t sb, const kvxi_pf_target *t, uint32_t dll, uint32_t db,
                      uint32_t i0, uint32_t i1)
{
    const kvx_layout *dl = &t->layout;
    uint32_t n_sl = sl->n_slices > 1 ? sl->n_slices : 1, s0 = sl->head0;
    for (uint32_t s = 0; s < n_sl && s0 < i1; s++) {
        uint32_t s1 = n_sl > 1 ? s0 + sl->slice_heads[s] : sl->head0 + sl->n_heads;
        uint32_t a = s0 > i0 ? s0 : i0, b = s1 < i1 ? s1 : i1;
        if (a < b)
            co_add(co, src + kvxi_kv_off(sl, ll, kv, sb, a - sl->head0, 0),
                   t->base + kvxi_kv_off(dl, dll, kv, db, a - dl->head0, 0),
                   (size_t)(b - a) * kvxi_head_bytes(sl));
        s0 = s1;
    }
}

int kvxi_pf_put_range(kvx_conn *c, kvxi_pf_req *r, kvxi_pf_target *t, const uint8_t *src,
                      const kvx_layout *sl, const uint32_t *sblk, uint32_t sfirst, uint32_t t0,
                      uint32_t t1, kvxi_chunk_copy **arena)
{
    const kvx_layout *dl = &t->layout;
    uint32_t i0 = sl->head0 > dl->head0 ? sl->head0 : dl->head0;
    uint32_t e0 = sl->head0 + sl->n_heads, e1 = dl->head0 + dl->n_heads;
    uint32_t i1 = e0 < e1 ? e0 : e1;
    *arena = NULL;
    if (t0 < t->first_pos) t0 = t->first_pos; /* the decode rank holds those positions */
    if (i0 >= i1 || t0 >= t1) return 0;       /* no common heads, or nothing to put */
    uint32_t bs = sl->block_size;
    size_t tokb = (size_t)sl->head_dim * sl->dtype_size;
    coalescer co = {.c = c, .r = r, .t = t};
    const uint32_t na = kvx_layout_arrays(sl); /* == the target's (kvx_pf_add_target) */
    co.arena_need =
        (size_t)sl->n_layers * na * ((t1 - 1) / bs - t0 / bs + 1) * (i1 - i0) * kvxi_head_bytes(sl);
    for (uint32_t ll = 0; ll < sl->n_layers; ll++) {
        uint32_t dll = sl->layer0 + ll - dl->layer0;
        for (uint32_t kv = 0; kv < na; kv++)
            for (uint32_t b = t0 / bs; b <= (t1 - 1) / bs; b++) {
                uint32_t a = b * bs > t0 ? 0 : t0 - b * bs;
                uint32_t e = (b + 1) * bs < t1 ? bs : t1 - b * bs;
                uint32_t sb = sblk[b - sfirst], db = t->blocks[b];
                if (a == 0 && e == bs) { /* whole block: common heads contiguous per slice */
                    put_block(&co, src, sl, ll, kv, sb, t, dll, db, i0, i1);
                    continue;
                }
                for (uint32_t h = i0; h < i1; h++)
                    co_add(&co, src + kvxi_kv_off(sl, ll, kv, sb, h - sl->head0, a),
                           t->base + kvxi_kv_off(dl, dll, kv, db, h - dl->head0, a),
                           (size_t)(e - a) * tokb);
            }
    }
    co_flush(&co);
    *arena = co.arena;
    return co.err;
}

int kvxi_pf_check_fit(kvxi_pf_req *r, const kvxi_pf_target *t, const kvx_layout *sl, uint32_t t1)
{
    const kvx_layout *dl = &t->layout;
    if ((uint64_t)t->n_blocks * dl->block_size < t1 || sl->layer0 < dl->layer0 ||
        sl->layer0 + sl->n_layers > dl->layer0 + dl->n_layers) {
        TD_LOG_ERR("kvx conn: req %llu rank %u: chunk up to token %u, layers %u-%u do not fit "
                   "the target (%u blocks, layers %u-%u)",
                   (unsigned long long)r->id, t->rank, t1, sl->layer0, sl->layer0 + sl->n_layers,
                   t->n_blocks, dl->layer0, dl->layer0 + dl->n_layers);
        return TD_ERANGE;
    }
    return 0;
}
