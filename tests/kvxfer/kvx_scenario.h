/* kvx_scenario.h: shared by the kvxfer tests and the peer helper: KV regions filled with
 * a pattern that names every element (request, layer, K/V, head, token, dim), block
 * tables, and a byte-exact check of a decode rank's region after a transfer.
 *
 * Element value (16 bits): a hash of (salt, global layer, kv, global head, token, dim),
 * never 0, so an element nobody wrote (0) is told from a written one. */
#ifndef KVX_SCENARIO_H
#define KVX_SCENARIO_H

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvx_conn.h"
#include "td_tp.h"

static inline uint16_t sc_value(uint32_t salt, uint32_t layer, uint32_t kv, uint32_t head,
                                uint32_t tok, uint32_t d)
{
    uint64_t x = ((uint64_t)salt << 40) ^ ((uint64_t)layer << 32) ^ ((uint64_t)kv << 31) ^
                 ((uint64_t)head << 24) ^ ((uint64_t)tok << 8) ^ d;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    uint16_t v = (uint16_t)x;
    return v ? v : 1;
}

static inline uint16_t *sc_elem(uint8_t *region, const kvx_layout *l, uint32_t ll, uint32_t kv,
                                uint32_t blk, uint32_t h, uint32_t tok, uint32_t d)
{
    return (uint16_t *)(region + kvx_layout_off(l, ll, kv, blk, h, tok)) + d; /* sliced too */
}

/* Fill positions [0, n_tokens) of a request (block table blocks) in a source region. */
static inline void sc_fill(uint8_t *region, const kvx_layout *l, const int32_t *blocks,
                           uint32_t n_tokens, uint32_t salt)
{
    for (uint32_t ll = 0; ll < l->n_layers; ll++)
        for (uint32_t kv = 0; kv < kvx_layout_arrays(l); kv++) /* a latent layout: K only */
            for (uint32_t p = 0; p < n_tokens; p++)
                for (uint32_t h = 0; h < l->n_heads; h++)
                    for (uint32_t d = 0; d < l->head_dim; d++)
                        *sc_elem(region, l, ll, kv, (uint32_t)blocks[p / l->block_size], h,
                                 p % l->block_size, d) =
                            sc_value(salt, l->layer0 + ll, kv, l->head0 + h, p, d);
}

/* Count wrong elements of a decode region: positions [0, n_tokens) of layers
 * [layer0, layer1) must hold the pattern; with check_rest, every other element of the
 * request's blocks and every block not in the table must be 0 (nothing written outside). */
static inline size_t sc_verify(uint8_t *region, const kvx_layout *l, const int32_t *blocks,
                               uint32_t n_blocks, uint32_t n_tokens, uint32_t layer0,
                               uint32_t layer1, uint32_t salt, int check_rest)
{
    size_t bad = 0;
    uint8_t *mine = calloc(l->n_blocks, 1);
    for (uint32_t i = 0; i < n_blocks; i++)
        mine[blocks[i]] = 1;
    for (uint32_t ll = 0; ll < l->n_layers; ll++) {
        uint32_t gl = l->layer0 + ll;
        int want_layer = gl >= layer0 && gl < layer1;
        for (uint32_t kv = 0; kv < kvx_layout_arrays(l); kv++) {
            for (uint32_t i = 0; i < n_blocks; i++)
                for (uint32_t h = 0; h < l->n_heads; h++)
                    for (uint32_t t = 0; t < l->block_size; t++) {
                        uint32_t p = i * l->block_size + t;
                        for (uint32_t d = 0; d < l->head_dim; d++) {
                            uint16_t got =
                                *sc_elem(region, l, ll, kv, (uint32_t)blocks[i], h, t, d);
                            if (want_layer && p < n_tokens)
                                bad += got != sc_value(salt, gl, kv, l->head0 + h, p, d);
                            else if (check_rest)
                                bad += got != 0;
                        }
                    }
            if (!check_rest) continue;
            for (uint32_t b = 0; b < l->n_blocks; b++) {
                if (mine[b]) continue;
                for (uint32_t h = 0; h < l->n_heads; h++)
                    for (uint32_t t = 0; t < l->block_size; t++)
                        for (uint32_t d = 0; d < l->head_dim; d++)
                            bad += *sc_elem(region, l, ll, kv, b, h, t, d) != 0;
            }
        }
    }
    free(mine);
    return bad;
}

/* A block table of n ids out of n_pool: runs of `run` consecutive ids, runs placed apart
 * (so coalescing has runs to merge and gaps it must not merge across). */
static inline void sc_blocks(int32_t *ids, uint32_t n, uint32_t n_pool, uint32_t run,
                             uint32_t start)
{
    uint32_t b = start % n_pool;
    for (uint32_t i = 0; i < n; i++) {
        if (i && run && i % run == 0) b += 1; /* a gap after each run */
        ids[i] = (int32_t)(b % n_pool);
        b++;
    }
}

/* --- a prefill-side source: one (stage, TP rank) with its own KV region ---------------- */

typedef struct {
    kvx_conn *c;
    uint8_t *reg;
    kvx_layout l;
    uint32_t stage, src_rank, src_tp, n_stages;
    int32_t sblk[1024]; /* the request's source block table */
} sc_src;

/* Region for layers [layer0, layer1) and the heads of rank src_rank of src_tp. */
static inline int sc_src_init(sc_src *s, kvx_pipe *pipe, const kvx_conn_params *cp,
                              uint32_t n_kv_heads, uint32_t head_dim, uint32_t block_size,
                              uint32_t n_blocks, uint32_t layer0, uint32_t layer1, uint32_t stage,
                              uint32_t src_rank, uint32_t src_tp)
{
    memset(s, 0, sizeof(*s));
    s->l = (kvx_layout){.layer0 = layer0,
                        .n_layers = layer1 - layer0,
                        .n_kv_heads = n_kv_heads,
                        .block_size = block_size,
                        .head_dim = head_dim,
                        .dtype_size = 2,
                        .n_blocks = n_blocks};
    td_tp_heads h; /* one query head per KV head */
    if (td_tp_heads_of_rank((int)n_kv_heads, (int)n_kv_heads, (int)src_tp, (int)src_rank, &h))
        return TD_EINVAL;
    s->l.head0 = (uint32_t)h.kv0;
    s->l.n_heads = (uint32_t)h.n_kv;
    s->stage = stage;
    s->src_rank = src_rank;
    s->src_tp = src_tp;
    s->reg = calloc(1, kvx_layout_bytes(&s->l));
    int err = kvx_conn_create(pipe, cp, &s->c);
    if (!err) err = kvx_pf_register_source(s->c, s->reg, kvx_layout_bytes(&s->l), &s->l);
    return err;
}

static inline void sc_src_fini(sc_src *s)
{
    kvx_conn_destroy(s->c);
    free(s->reg);
    s->c = NULL;
    s->reg = NULL;
}

/* Fill the source for a request (blocks in reverse order) and open it. */
static inline int sc_src_open(sc_src *s, uint64_t req, uint32_t n_tokens, uint32_t salt,
                              int timeout_ms)
{
    uint32_t nb = (n_tokens + s->l.block_size - 1) / s->l.block_size;
    if (nb > s->l.n_blocks || nb > 1024) return TD_EINVAL;
    for (uint32_t b = 0; b < nb; b++)
        s->sblk[b] = (int32_t)(s->l.n_blocks - 1 - b);
    sc_fill(s->reg, &s->l, s->sblk, n_tokens, salt);
    kvx_pf_req_params pp = {
        .stage = s->stage, .src_rank = s->src_rank, .src_tp = s->src_tp, .timeout_ms = timeout_ms};
    return kvx_pf_open(s->c, req, &pp);
}

/* Chunk k of a request in the given order (0 in order, 1 reversed, 2 even then odd). */
static inline uint32_t sc_chunk_index(uint32_t k, uint32_t nch, int order)
{
    if (order == 1) return nch - 1 - k;
    if (order == 2) return k < (nch + 1) / 2 ? 2 * k : 2 * (k - (nch + 1) / 2) + 1;
    return k;
}

static inline int sc_src_send(sc_src *s, uint64_t req, uint32_t n_tokens, uint32_t chunk,
                              uint32_t k, int order)
{
    uint32_t nch = (n_tokens + chunk - 1) / chunk,
             nb = (n_tokens + s->l.block_size - 1) / s->l.block_size;
    uint32_t ci = sc_chunk_index(k, nch, order);
    uint32_t t0 = ci * chunk, t1 = t0 + chunk > n_tokens ? n_tokens : t0 + chunk;
    return kvx_pf_send_chunk(s->c, req, ci, t0, t1, s->sblk, nb);
}

static inline bool sc_final(kvx_req_state st)
{
    return st == KVX_REQ_DONE || st == KVX_REQ_FAILED;
}

/* Hex codec for passing bytes through a text pipe. */
static inline void sc_hex(const uint8_t *b, size_t n, char *out)
{
    static const char hx[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = hx[b[i] >> 4];
        out[2 * i + 1] = hx[b[i] & 15];
    }
    out[2 * n] = 0;
}

static inline size_t sc_unhex(const char *s, uint8_t *b, size_t cap)
{
    size_t n = 0;
    while (s[0] && s[1] && n < cap) {
        int v = 0;
        for (int k = 0; k < 2; k++) {
            char ch = s[k];
            int d = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
            if (d < 0) return n;
            v = v * 16 + d;
        }
        b[n++] = (uint8_t)v;
        s += 2;
    }
    return n;
}

/* A zeroed decode region of layout l, registered on c: private memory, or with
 * KVX_TEST_REGION=memfd in the environment a memfd mapped shared and registered with its
 * descriptor (*fd; the decode node's pools: a shared-memory writer then maps it,
 * kvx_pipe_ucx_cma.c). NULL on failure. Free with sc_region_free. */
static inline uint8_t *sc_region_register(kvx_conn *c, const kvx_layout *l, int *fd)
{
    size_t bytes = kvx_layout_bytes(l);
    const char *e = getenv("KVX_TEST_REGION");
    bool memfd = e && !strcmp(e, "memfd");
    *fd = memfd ? memfd_create("kvx-test", MFD_CLOEXEC) : -1;
    if (memfd && (*fd < 0 || ftruncate(*fd, (off_t)bytes))) return NULL;
    void *r = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                   *fd >= 0 ? MAP_SHARED : MAP_PRIVATE | MAP_ANONYMOUS, *fd, 0);
    if (r == MAP_FAILED) return NULL;
    if (kvx_dec_register_fd(c, r, bytes, l, *fd)) {
        munmap(r, bytes);
        return NULL;
    }
    return r;
}

static inline void sc_region_free(uint8_t *r, const kvx_layout *l, int fd)
{
    if (r) munmap(r, kvx_layout_bytes(l));
    if (fd >= 0) close(fd);
}

#endif
