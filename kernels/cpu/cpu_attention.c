/* cpu_attention.c: the CPU backend's paged KV writes and causal attention through block
 * tables (pool layout in ARCHITECTURE.md section 4: one block's keys of one KV head are a
 * contiguous (block_size, head_dim) tile, found by kn_kv_tile: head-major (n_blocks,
 * n_kv_heads, block_size, head_dim), or a prefill stage's sliced pool, kn_backend.h).
 *
 * Attention work is cut into items (token, KV head, chunk of up to ATT_MAX_REP of the q
 * heads sharing that KV head; on a TP rank the KV heads at the ends of its range may serve
 * fewer q heads than the model's group, common/td_tp.h): an item reads each K/V tile once for all
 * its q heads and keeps an online softmax state (running max, running sum, unnormalized
 * accumulator) per q head. The items are laid end to end on a cost line (an item costs its number
 * of keys plus a fixed overhead) and the line is cut into equal parts, at most one per thread.
 * That keeps causal prefill balanced (later tokens see more keys) and, for decode with few
 * items, cuts single items across threads by key range; a cut item's partial softmax states
 * are merged by the caller after the join, in key order.
 *
 * Batch invariance: where a cut falls decides the order of the float sums, so a row's result
 * depends on its line. Each solo row (rows [0, m_solo): one-token decode rows, or every row
 * of a deterministic step) is a line of its own, cut exactly as a batch of that row alone
 * would cut it, so its output is bit-identical whatever shares its step; the other rows
 * share one line. The parts of all lines are then spread over the threads by cost (which
 * thread runs a part does not change its result).
 */
#include <assert.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ATT_SIMD 1
#endif

#include "cpu_backend.h"
#include "cpu_simd.h"
#include "cpu_internal.h"

#define ATT_MAX_HEAD_DIM 576 /* per-thread tiles live on the stack (deepseek2: 512 + 64) */
#define ATT_MAX_REP      8   /* q heads that share one pass over K/V */
#define ATT_TILE         16  /* keys scored and accumulated together */
#define ATT_ITEM_COST    16  /* fixed cost of an item, in keys (load q, finalize) */
/* Below this much work per thread (keys x q heads x head_dim) fewer threads take part:
 * a part this size runs for a few microseconds, about the price of a fork/join. */
#define ATT_MIN_PART_WORK 32768

/* ---- fp16 <-> fp32 rows ---- */

static void f16_to_f32(const uint16_t *src, float *dst, int64_t n)
{
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(dst + j, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + j))));
#endif
#ifdef ATT_SIMD
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + j))));
#endif
    for (; j < n; j++)
        dst[j] = td_fp16_to_fp32(src[j]);
}

/* Round to nearest even, overflow to inf: F16C with _MM_FROUND_TO_NEAREST_INT rounds
 * exactly as td_fp32_to_fp16 does. */
static void f32_to_f16(const float *src, uint16_t *dst, int64_t n)
{
    int64_t j = 0;
#ifdef ATT_SIMD
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(dst + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; j < n; j++)
        dst[j] = td_fp32_to_fp16(src[j]);
}

/* ---- kv_write ---- */

typedef struct {
    void *kpool, *vpool; /* tiles of (block_size, head_dim) of kv_type, laid out by slicing */
    td_dtype kv_type;
    int block_size, n_kv_heads, head_dim;
    const kn_kv_slicing *slicing; /* NULL: head-major */
    const float *k, *v;           /* (m, n_kv_heads, head_dim) */
    const int32_t *pos;           /* (m) */
    const int32_t *seq_of;        /* (m) */
    const kn_seq_view *seqs;
} kvw_job;

static void kvw_rows(void *arg, int64_t i0, int64_t i1, int tid)
{
    const kvw_job *J = arg;
    const int64_t hd = J->head_dim, nkv = J->n_kv_heads, bs = J->block_size;
    for (int64_t i = i0; i < i1; i++) {
        const kn_seq_view *sv = &J->seqs[J->seq_of[i]];
        const int64_t p = J->pos[i];
        assert(p >= 0 && p < sv->n_ctx);
        const int64_t blk = sv->block_table[p / bs], slot = p % bs;
        assert(blk >= 0);
        for (int64_t h = 0; h < nkv; h++) {
            const int64_t dst = (kn_kv_tile(J->slicing, (int)nkv, blk, (int)h) * bs + slot) * hd;
            const int64_t src = (i * nkv + h) * hd;
            const bool v_apart = J->vpool != J->kpool; /* else latent: V is K, written once */
            if (J->kv_type == TD_F16) {
                f32_to_f16(J->k + src, (uint16_t *)J->kpool + dst, hd);
                if (v_apart) f32_to_f16(J->v + src, (uint16_t *)J->vpool + dst, hd);
            } else {
                memcpy((float *)J->kpool + dst, J->k + src, (size_t)hd * sizeof(float));
                if (v_apart)
                    memcpy((float *)J->vpool + dst, J->v + src, (size_t)hd * sizeof(float));
            }
        }
    }
}

void kn_cpu_kv_write(void *ctx, void *kpool, void *vpool, td_dtype kv_type, int block_size,
                     const kn_kv_slicing *slicing, int n_kv_heads, int head_dim, const float *k,
                     const float *v, int64_t m, const int32_t *pos, const int32_t *seq_of,
                     const kn_seq_view *seqs)
{
    assert(kv_type == TD_F32 || kv_type == TD_F16);
    assert(block_size > 0 && (block_size & (block_size - 1)) == 0);
    kvw_job J = {.kpool = kpool,
                 .vpool = vpool,
                 .kv_type = kv_type,
                 .block_size = block_size,
                 .n_kv_heads = n_kv_heads,
                 .head_dim = head_dim,
                 .slicing = slicing,
                 .k = k,
                 .v = v,
                 .pos = pos,
                 .seq_of = seq_of,
                 .seqs = seqs};
    int64_t per_tok = (vpool == kpool ? 1 : 2) * (int64_t)n_kv_heads * head_dim;
    int64_t min_rows = 16384 / (per_tok > 0 ? per_tok : 1);
    kn_pool_run(kn_cpu_pool(ctx), m, min_rows > 1 ? min_rows : 1, kvw_rows, &J);
}

/* ---- attention: tile kernels ----
 * The three tile kernels are kept out of line on purpose: inlined into item_run, gcc runs
 * out of registers and spills the loop pointers, which measured 1.5-2x slower. */

#ifdef ATT_SIMD
static inline float hsum(__m256 a)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The 8 horizontal sums of a[0..7], as one vector: two hadd levels, then fold lanes. */
static inline __m256 hsum8(const __m256 a[8])
{
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

#endif

static float dot(const float *a, const float *b, int n)
{
    int d = 0;
    float s = 0.0f;
#ifdef ATT_SIMD
    __m256 acc = _mm256_setzero_ps();
    for (; d + 8 <= n; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    s = hsum(acc);
#endif
    for (; d < n; d++)
        s += a[d] * b[d];
    return s;
}

/* sc (n) = q (hd) . kt rows (n, hd); eight keys at a time share the q loads and one
 * horizontal reduction. The eight accumulators are spelled out: as an array indexed in an
 * inner loop, gcc -O2 keeps them in memory. */
__attribute__((noinline)) static void tile_scores(const float *q, const float *kt, int n, int hd,
                                                  float *sc)
{
    int s = 0;
#ifdef ATT_SIMD
    if (hd % 8 == 0) {
        for (; s + 8 <= n; s += 8) {
            __m256 a[8];
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
                   a7 = a0;
            const float *kr = kt + (int64_t)s * hd;
            for (int d = 0; d < hd; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 0 * hd + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 1 * hd + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 2 * hd + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 3 * hd + d), a3);
                a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 4 * hd + d), a4);
                a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 5 * hd + d), a5);
                a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 6 * hd + d), a6);
                a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 7 * hd + d), a7);
            }
            a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3, a[4] = a4, a[5] = a5, a[6] = a6;
            a[7] = a7;
            _mm256_storeu_ps(sc + s, hsum8(a));
        }
    }
#endif
    for (; s < n; s++)
        sc[s] = dot(q, kt + (int64_t)s * hd, hd);
}

/* acc (hd) += sum over s < n of p[s] * vt row s (n, hd); the accumulator stays in
 * registers for a 32-wide column strip across all n rows. */
__attribute__((noinline)) static void tile_accumulate(float *acc, const float *p, const float *vt,
                                                      int n, int hd)
{
    int d = 0;
#ifdef ATT_SIMD
    for (; d + 32 <= hd; d += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
        __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
        for (int s = 0; s < n; s++) {
            const float *vr = vt + (int64_t)s * hd + d;
            __m256 ps = _mm256_set1_ps(p[s]);
            a0 = _mm256_fmadd_ps(ps, _mm256_loadu_ps(vr), a0);
            a1 = _mm256_fmadd_ps(ps, _mm256_loadu_ps(vr + 8), a1);
            a2 = _mm256_fmadd_ps(ps, _mm256_loadu_ps(vr + 16), a2);
            a3 = _mm256_fmadd_ps(ps, _mm256_loadu_ps(vr + 24), a3);
        }
        _mm256_storeu_ps(acc + d, a0);
        _mm256_storeu_ps(acc + d + 8, a1);
        _mm256_storeu_ps(acc + d + 16, a2);
        _mm256_storeu_ps(acc + d + 24, a3);
    }
    for (; d + 8 <= hd; d += 8) {
        __m256 a = _mm256_loadu_ps(acc + d);
        for (int s = 0; s < n; s++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(p[s]), _mm256_loadu_ps(vt + (int64_t)s * hd + d), a);
        _mm256_storeu_ps(acc + d, a);
    }
#endif
    for (; d < hd; d++) {
        float a = acc[d];
        for (int s = 0; s < n; s++)
            a += p[s] * vt[(int64_t)s * hd + d];
        acc[d] = a;
    }
}

/* Online softmax step for one q head over a tile of n scores: scale them, raise the
 * running max *mx if the tile holds a larger score (rescaling *l and acc (hd) to the new
 * max), then turn sc into exp(score - max) and add them to *l. */
__attribute__((noinline)) static void tile_softmax(float *sc, int n, float scale, float *mx,
                                                   float *l, float *acc, int hd)
{
#ifdef ATT_SIMD
    _Static_assert(ATT_TILE == 16, "the SIMD softmax handles a tile as two vectors");
    const __m256 ninf = _mm256_set1_ps(-INFINITY), vn = _mm256_set1_ps((float)n);
    const __m256 idx0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 idx1 = _mm256_add_ps(idx0, _mm256_set1_ps(8));
    const __m256 vs = _mm256_set1_ps(scale);
    /* lanes at or past n become -inf, which kn_exp8 maps to 0 */
    __m256 s0 = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_load_ps(sc), vs),
                                 _mm256_cmp_ps(idx0, vn, _CMP_LT_OQ));
    __m256 s1 = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_load_ps(sc + 8), vs),
                                 _mm256_cmp_ps(idx1, vn, _CMP_LT_OQ));
    __m256 m8 = _mm256_max_ps(s0, s1);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float tmax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
    float tmax = -INFINITY;
    for (int t = 0; t < n; t++) {
        sc[t] *= scale;
        tmax = sc[t] > tmax ? sc[t] : tmax;
    }
#endif
    if (tmax > *mx) {
        /* the max grew: rescale what was summed relative to the old max */
        if (*mx != -INFINITY) {
            const float alpha = expf(*mx - tmax);
            *l *= alpha;
            for (int d = 0; d < hd; d++)
                acc[d] *= alpha;
        }
        *mx = tmax;
    }
#ifdef ATT_SIMD
    const __m256 mv = _mm256_set1_ps(*mx);
    const __m256 e0 = kn_exp8(_mm256_sub_ps(s0, mv)), e1 = kn_exp8(_mm256_sub_ps(s1, mv));
    _mm256_store_ps(sc, e0);
    _mm256_store_ps(sc + 8, e1);
    *l += hsum(_mm256_add_ps(e0, e1));
#else
    float lsum = 0.0f;
    for (int t = 0; t < n; t++) {
        sc[t] = expf(sc[t] - *mx);
        lsum += sc[t];
    }
    *l += lsum;
#endif
}

/* Soft-capping of a tile's n raw scores (gemma2): s = q.k * scale becomes
 * softcap * tanh(s / softcap), so the softmax then takes them with scale 1. Only the capped
 * path runs it: an uncapped call's scores and their bits are those of tile_softmax alone.
 * Eight at a time tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2 |y|) in (0, 1] (no
 * overflow; absolute error ~1e-7, so ~1e-7 * softcap in a score): a capped prefill's
 * attention then costs ~1.25x the uncapped one (2.5x with tanhf). */
__attribute__((noinline)) static void tile_softcap(float *sc, int n, float scale, float softcap)
{
    const float inv = scale / softcap;
    int t = 0;
#ifdef ATT_SIMD
    const __m256 vi = _mm256_set1_ps(inv), vc = _mm256_set1_ps(softcap);
    const __m256 one = _mm256_set1_ps(1.0f), m2 = _mm256_set1_ps(-2.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; t + 8 <= n; t += 8) {
        const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(sc + t), vi);
        const __m256 e = kn_exp8(_mm256_mul_ps(_mm256_andnot_ps(sign, y), m2));
        const __m256 th = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
        _mm256_storeu_ps(sc + t, _mm256_mul_ps(vc, _mm256_or_ps(th, _mm256_and_ps(sign, y))));
    }
#endif
    for (; t < n; t++)
        sc[t] = softcap * tanhf(sc[t] * inv);
}

/* ---- attention: items, lines, parts and softmax states ---- */

/* Online softmax state of up to ATT_MAX_REP q heads: out = acc / l, where acc and l are
 * taken relative to the running max mx. */
typedef struct {
    float mx[ATT_MAX_REP];                                 /* running max of scaled scores */
    float l[ATT_MAX_REP];                                  /* sum of exp(score - mx) */
    _Alignas(32) float acc[ATT_MAX_REP][ATT_MAX_HEAD_DIM]; /* sum of exp(score - mx) v */
} att_state;

/* A cost line: the items of tokens [t0, t1) laid end to end, cut into n_parts equal parts.
 * Each solo row is a line of its own, cut exactly as a batch of that one row would be; the
 * batch rows after them share one line. */
typedef struct {
    int64_t t0, t1; /* tokens */
    int64_t total;  /* length of the line */
    int n_parts;    /* equal cuts of the line */
    int64_t v0;     /* index of its first part among the job's parts */
} att_line;

typedef struct {
    const float *q;               /* (m, n_heads, head_dim) */
    const void *kpool, *vpool;    /* tiles of (block_size, head_dim), laid out by slicing */
    const kn_kv_slicing *slicing; /* NULL: head-major */
    td_dtype kv_type;
    int block_size, n_heads, n_kv_heads, head_dim;
    int group, phase; /* q head h reads KV head (phase + h) / group */
    float scale;
    int window;                  /* > 0: token at p sees keys [p - window + 1, p] only */
    float softcap;               /* > 0: scores s -> softcap * tanh(s / softcap) (gemma2) */
    const int32_t *pos, *seq_of; /* (m) */
    const kn_seq_view *seqs;
    float *out;        /* (m, n_heads, head_dim) */
    int n_rep;         /* most q heads of one KV head: min(group, n_heads) */
    int n_chunk;       /* q-head chunks per KV head: ceil(n_rep / ATT_MAX_REP) */
    int items_per_tok; /* n_kv_heads * n_chunk */
    int64_t m;
    att_line *lines; /* (n_lines) */
    int64_t n_lines;
    int64_t n_vparts;   /* parts of all lines together */
    int32_t *vline;     /* (n_vparts) line of each part */
    int64_t *vcost;     /* (n_vparts + 1) running cost at each part's start */
    int64_t *part_item; /* (n_vparts, 2) item of each partial slot, -1 if unused */
    int64_t *part_slot; /* (n_vparts) first of its two state slots, -1: a line of one part */
    float *part_state;  /* (slots with states, slot_floats) */
    size_t slot_floats; /* 2 * rep + rep * head_dim, rep = min(n_rep, ATT_MAX_REP) */
    int n_threads;      /* threads the parts are spread over */
} att_job;

/* First key token t attends to: 0, or the start of its sliding window. Keys before it are
 * simply not visited (no mask), so a windowed layer also costs only window keys. */
static int64_t key_lo(const att_job *J, int64_t t)
{
    const int64_t lo = J->window > 0 ? (int64_t)J->pos[t] + 1 - J->window : 0;
    return lo > 0 ? lo : 0;
}

/* The q heads [h0, h0 + nr) of item j (nr may be 0: a chunk past the end of a KV head
 * that serves fewer than n_rep q heads), and its token. */
static void item_heads(const att_job *J, int64_t j, int64_t *tok, int *g, int *h0, int *nr)
{
    *tok = j / J->items_per_tok;
    int rem = (int)(j % J->items_per_tok);
    *g = rem / J->n_chunk;
    int c = rem % J->n_chunk;
    const int lo = *g * J->group - J->phase, hi = (*g + 1) * J->group - J->phase;
    *h0 = (lo > 0 ? lo : 0) + c * ATT_MAX_REP;
    const int left = (hi < J->n_heads ? hi : J->n_heads) - *h0;
    *nr = left < 0 ? 0 : (left < ATT_MAX_REP ? left : ATT_MAX_REP);
}

/* Fold keys [k0, k1) of item j into st (freshly initialized here). */
static void item_run(const att_job *J, int64_t j, int64_t k0, int64_t k1, att_state *st)
{
    _Alignas(32) float kbuf[ATT_TILE * ATT_MAX_HEAD_DIM]; /* (ATT_TILE, head_dim) */
    _Alignas(32) float vbuf[ATT_TILE * ATT_MAX_HEAD_DIM]; /* (ATT_TILE, head_dim) */
    _Alignas(32) float sc[ATT_TILE] = {0};                /* scores, then probabilities */
    int64_t tok;
    int g, h0, nr;
    item_heads(J, j, &tok, &g, &h0, &nr);
    const int hd = J->head_dim;
    const int64_t bs = J->block_size, nkv = J->n_kv_heads;
    const kn_seq_view *sv = &J->seqs[J->seq_of[tok]];
    const float *q = J->q + (tok * J->n_heads + h0) * hd; /* (nr, hd) */
    /* a capped call scales in tile_softcap, so the softmax takes its scores as they are */
    const bool cap = J->softcap > 0.0f;
    const float sm_scale = cap ? 1.0f : J->scale;
    for (int r = 0; r < nr; r++) {
        st->mx[r] = -INFINITY;
        st->l[r] = 0.0f;
        memset(st->acc[r], 0, (size_t)hd * sizeof(float));
    }
    if (nr == 0) return;
    for (int64_t b = k0 / bs; b * bs < k1; b++) {
        const int64_t blk = sv->block_table[b];
        assert(blk >= 0);
        const int64_t tile0 = kn_kv_tile(J->slicing, (int)nkv, blk, g) * bs * hd; /* (blk, g) */
        const int64_t s1 = (k1 < (b + 1) * bs ? k1 : (b + 1) * bs) - b * bs;
        for (int64_t s = (k0 > b * bs ? k0 : b * bs) - b * bs; s < s1; s += ATT_TILE) {
            const int n = (int)(s1 - s < ATT_TILE ? s1 - s : ATT_TILE);
            const float *kt, *vt; /* (n, hd) */
            if (J->kv_type == TD_F16) {
                f16_to_f32((const uint16_t *)J->kpool + tile0 + s * hd, kbuf, (int64_t)n * hd);
                f16_to_f32((const uint16_t *)J->vpool + tile0 + s * hd, vbuf, (int64_t)n * hd);
                kt = kbuf;
                vt = vbuf;
            } else {
                kt = (const float *)J->kpool + tile0 + s * hd;
                vt = (const float *)J->vpool + tile0 + s * hd;
            }
            for (int r = 0; r < nr; r++) {
                tile_scores(q + (int64_t)r * hd, kt, n, hd, sc);
                if (cap) tile_softcap(sc, n, J->scale, J->softcap);
                tile_softmax(sc, n, sm_scale, &st->mx[r], &st->l[r], st->acc[r], hd);
                tile_accumulate(st->acc[r], sc, vt, n, hd);
            }
        }
    }
}

static void state_write_out(const att_job *J, int64_t j, const att_state *st)
{
    int64_t tok;
    int g, h0, nr;
    item_heads(J, j, &tok, &g, &h0, &nr);
    const int hd = J->head_dim;
    for (int r = 0; r < nr; r++) {
        assert(st->l[r] > 0.0f);
        const float inv = 1.0f / st->l[r];
        float *o = J->out + (tok * J->n_heads + h0 + r) * hd;
        for (int d = 0; d < hd; d++)
            o[d] = st->acc[r][d] * inv;
    }
}

/* slot layout: mx (rep), l (rep), acc (rep, head_dim) */
static float *slot_at(const att_job *J, int64_t v, int slot)
{
    assert(J->part_slot[v] >= 0);
    return J->part_state + (size_t)(J->part_slot[v] + slot) * J->slot_floats;
}

static void state_save(const att_job *J, int nr, const att_state *st, float *dst)
{
    const int rep = J->n_rep < ATT_MAX_REP ? J->n_rep : ATT_MAX_REP;
    const int hd = J->head_dim;
    for (int r = 0; r < nr; r++) {
        dst[r] = st->mx[r];
        dst[rep + r] = st->l[r];
        memcpy(dst + 2 * rep + (size_t)r * hd, st->acc[r], (size_t)hd * sizeof(float));
    }
}

/* st = merge(st, partial src): both rescaled to the larger of the two maxima. */
static void state_merge(const att_job *J, int nr, att_state *st, const float *src)
{
    const int rep = J->n_rep < ATT_MAX_REP ? J->n_rep : ATT_MAX_REP;
    const int hd = J->head_dim;
    for (int r = 0; r < nr; r++) {
        const float m2 = src[r], l2 = src[rep + r];
        const float *a2 = src + 2 * rep + (size_t)r * hd;
        const float mx = st->mx[r] > m2 ? st->mx[r] : m2;
        const float f1 = expf(st->mx[r] - mx), f2 = expf(m2 - mx);
        st->l[r] = st->l[r] * f1 + l2 * f2;
        for (int d = 0; d < hd; d++)
            st->acc[r][d] = st->acc[r][d] * f1 + a2[d] * f2;
        st->mx[r] = mx;
    }
}

/* Length of token t's items on a cost line: each is ATT_ITEM_COST of overhead followed by
 * one unit per key. */
static int64_t tok_cost(const att_job *J, int64_t t)
{
    return ((int64_t)J->pos[t] + 1 - key_lo(J, t) + ATT_ITEM_COST) * J->items_per_tok;
}

/* Part v covers [total * p / P, total * (p + 1) / P) of its line (p its index there, P the
 * line's parts) and processes the keys that fall in its range. Items it covers whole are
 * written out; the (at most two) cut ones at its ends are saved to its partial slots. */
static void run_part(const att_job *J, int64_t v, att_state *st)
{
    const att_line *L = &J->lines[J->vline[v]];
    const int64_t p = v - L->v0;
    const int64_t c0 = L->total * p / L->n_parts, c1 = L->total * (p + 1) / L->n_parts;
    int used = 0;
    int64_t start = 0; /* line offset of the current token's first item */
    for (int64_t t = L->t0; t < L->t1 && start < c1; t++) {
        /* the item's keys are [lo, lo + nk); the line counts them from lo */
        const int64_t lo = key_lo(J, t);
        const int64_t nk = (int64_t)J->pos[t] + 1 - lo, cost = nk + ATT_ITEM_COST;
        assert(J->pos[t] >= 0 && J->pos[t] < J->seqs[J->seq_of[t]].n_ctx);
        if (start + cost * J->items_per_tok <= c0) {
            start += cost * J->items_per_tok;
            continue;
        }
        for (int64_t c = 0; c < J->items_per_tok; c++, start += cost) {
            if (start + cost <= c0 || start >= c1) continue;
            int64_t ka = c0 - start - ATT_ITEM_COST, kb = c1 - start - ATT_ITEM_COST;
            ka = ka < 0 ? 0 : (ka > nk ? nk : ka);
            kb = kb < 0 ? 0 : (kb > nk ? nk : kb);
            if (ka >= kb) continue;
            const int64_t j = t * J->items_per_tok + c;
            item_run(J, j, lo + ka, lo + kb, st);
            if (ka == 0 && kb == nk) {
                state_write_out(J, j, st);
                continue;
            }
            assert(used < 2);
            int64_t tok;
            int g, h0, nr;
            item_heads(J, j, &tok, &g, &h0, &nr);
            state_save(J, nr, st, slot_at(J, v, used));
            J->part_item[v * 2 + used] = j;
            used++;
        }
    }
    for (; used < 2; used++)
        J->part_item[v * 2 + used] = -1;
}

/* First part whose running cost at its start is >= c (n_vparts if none). */
static int64_t part_at_cost(const att_job *J, int64_t c)
{
    int64_t lo = 0, hi = J->n_vparts;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (J->vcost[mid] < c)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Thread slice i of n_threads takes the parts that start in its equal share of the summed
 * cost of all lines. Which thread runs a part never changes its result. */
static void att_threads(void *arg, int64_t i0, int64_t i1, int tid)
{
    (void)tid;
    const att_job *J = arg;
    const int64_t total = J->vcost[J->n_vparts];
    att_state st;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t v0 = part_at_cost(J, total * i / J->n_threads);
        const int64_t v1 =
            i + 1 == J->n_threads ? J->n_vparts : part_at_cost(J, total * (i + 1) / J->n_threads);
        for (int64_t v = v0; v < v1; v++)
            run_part(J, v, &st);
    }
}

/* Merge the cut items' partial states; slots of one item are adjacent in (part, slot)
 * order because a line's parts are consecutive ranges of it. */
static void merge_parts(const att_job *J)
{
    att_state st;
    int64_t cur = -1;
    int nr = 0;
    for (int64_t s = 0; s < J->n_vparts * 2; s++) {
        const int64_t j = J->part_item[s];
        if (j < 0) continue;
        const float *src = slot_at(J, s / 2, (int)(s % 2));
        if (j != cur) {
            if (cur >= 0) state_write_out(J, cur, &st);
            int64_t tok;
            int g, h0;
            item_heads(J, j, &tok, &g, &h0, &nr);
            for (int r = 0; r < nr; r++) {
                st.mx[r] = -INFINITY;
                st.l[r] = 0.0f;
                memset(st.acc[r], 0, (size_t)J->head_dim * sizeof(float));
            }
            cur = j;
        }
        state_merge(J, nr, &st, src);
    }
    if (cur >= 0) state_write_out(J, cur, &st);
}

/* Parts of a line of this length: one per ATT_MIN_PART_WORK of work, 1 to max_parts. */
static int line_parts(const att_job *J, int64_t total, int max_parts)
{
    const int rep = J->n_rep < ATT_MAX_REP ? J->n_rep : ATT_MAX_REP;
    const int64_t want = total * rep * J->head_dim / ATT_MIN_PART_WORK;
    return want < 1 ? 1 : (want < max_parts ? (int)want : max_parts);
}

/* Line k of the job: solo rows [0, n_solo) one each, then the other rows together. */
static att_line line_of(const att_job *J, int64_t k, int64_t n_solo)
{
    att_line L = {.t0 = k, .t1 = k < n_solo ? k + 1 : J->m};
    for (int64_t t = L.t0; t < L.t1; t++)
        L.total += tok_cost(J, t);
    return L;
}

/* Sizes of the job's tables; returns the bytes they take together (64-byte aligned each). */
static size_t plan_size(const att_job *J, int64_t n_solo, int max_parts, int64_t *n_vparts,
                        int64_t *n_slots)
{
    *n_vparts = *n_slots = 0;
    for (int64_t k = 0; k < J->n_lines; k++) {
        const int np = line_parts(J, line_of(J, k, n_solo).total, max_parts);
        *n_vparts += np;
        if (np > 1) *n_slots += 2 * (int64_t)np;
    }
#define ATT_AL(b) (((size_t)(b) + 63) & ~(size_t)63)
    return ATT_AL(J->n_lines * sizeof(att_line)) + ATT_AL(*n_vparts * sizeof(int32_t)) +
           ATT_AL((*n_vparts + 1) * sizeof(int64_t)) + ATT_AL(*n_vparts * 2 * sizeof(int64_t)) +
           ATT_AL(*n_vparts * sizeof(int64_t)) +
           ATT_AL((size_t)*n_slots * J->slot_floats * sizeof(float));
}

/* Carve the tables out of buf (plan_size bytes) and fill them. */
static void plan_fill(att_job *J, char *buf, int64_t n_solo, int max_parts, int64_t n_vparts)
{
    J->lines = (att_line *)buf;
    buf += ATT_AL(J->n_lines * sizeof(att_line));
    J->vline = (int32_t *)buf;
    buf += ATT_AL(n_vparts * sizeof(int32_t));
    J->vcost = (int64_t *)buf;
    buf += ATT_AL((n_vparts + 1) * sizeof(int64_t));
    J->part_item = (int64_t *)buf;
    buf += ATT_AL(n_vparts * 2 * sizeof(int64_t));
    J->part_slot = (int64_t *)buf;
    buf += ATT_AL(n_vparts * sizeof(int64_t));
    J->part_state = (float *)buf;
#undef ATT_AL
    J->n_vparts = n_vparts;
    int64_t v = 0, cum = 0, slot = 0;
    for (int64_t k = 0; k < J->n_lines; k++) {
        att_line *L = &J->lines[k];
        *L = line_of(J, k, n_solo);
        L->n_parts = line_parts(J, L->total, max_parts);
        L->v0 = v;
        for (int p = 0; p < L->n_parts; p++, v++) {
            J->vline[v] = (int32_t)k;
            J->vcost[v] = cum;
            cum += L->total * (p + 1) / L->n_parts - L->total * p / L->n_parts;
            J->part_slot[v] = L->n_parts > 1 ? slot : -1;
            if (L->n_parts > 1) slot += 2;
        }
    }
    J->vcost[v] = cum;
}

void kn_cpu_attention(void *ctx, const float *q, const void *kpool, const void *vpool,
                      td_dtype kv_type, int block_size, const kn_kv_slicing *slicing, int n_heads,
                      int n_kv_heads, int group, int phase, int head_dim, float scale, int window,
                      float softcap, int64_t m, int64_t m_solo, const int32_t *pos,
                      const int32_t *seq_of, const kn_seq_view *seqs, float *out)
{
    assert(kv_type == TD_F32 || kv_type == TD_F16);
    assert(block_size > 0 && (block_size & (block_size - 1)) == 0);
    assert(group > 0 && phase >= 0 && phase < group && n_heads > 0);
    assert(n_kv_heads == (phase + n_heads - 1) / group + 1);
    assert(head_dim > 0 && head_dim <= ATT_MAX_HEAD_DIM);
    assert(m_solo >= 0 && m_solo <= m);
    assert(softcap >= 0.0f);
    if (m <= 0) return;
    kn_cpu *c = ctx;
    att_job J = {.q = q,
                 .kpool = kpool,
                 .vpool = vpool,
                 .slicing = slicing,
                 .kv_type = kv_type,
                 .block_size = block_size,
                 .n_heads = n_heads,
                 .n_kv_heads = n_kv_heads,
                 .group = group,
                 .phase = phase,
                 .head_dim = head_dim,
                 .scale = scale,
                 .window = window,
                 .softcap = softcap,
                 .pos = pos,
                 .seq_of = seq_of,
                 .seqs = seqs,
                 .out = out,
                 .m = m};
    J.n_rep = group < n_heads ? group : n_heads;
    J.n_chunk = (J.n_rep + ATT_MAX_REP - 1) / ATT_MAX_REP;
    J.items_per_tok = n_kv_heads * J.n_chunk;
    const int rep = J.n_rep < ATT_MAX_REP ? J.n_rep : ATT_MAX_REP;
    J.slot_floats = (size_t)rep * (2 + (size_t)head_dim);
    const int64_t n_solo = m_solo < 0 ? 0 : (m_solo > m ? m : m_solo);
    J.n_lines = n_solo + (m > n_solo);

    /* the tables live in thread 0's scratch: thread 0 takes no scratch inside the job (its
     * tiles are on the stack) */
    const int max_parts = kn_cpu_n_threads(c);
    int64_t n_vparts, n_slots;
    const size_t bytes = plan_size(&J, n_solo, max_parts, &n_vparts, &n_slots);
    char *buf = (char *)kn_cpu_scratch(c, 0, bytes / sizeof(float) + 16);
    att_line one;
    int32_t one_line = 0;
    int64_t one_cost[2], one_item[2], one_slot = -1;
    if (buf) {
        plan_fill(&J, buf, n_solo, max_parts, n_vparts);
    } else {
        /* no room for the tables: every row on one uncut line, run by one thread */
        one = line_of(&J, 0, 0);
        one.n_parts = 1;
        one_cost[0] = 0;
        one_cost[1] = one.total;
        J.lines = &one;
        J.n_lines = 1;
        J.n_vparts = 1;
        J.vline = &one_line;
        J.vcost = one_cost;
        J.part_item = one_item;
        J.part_slot = &one_slot;
    }
    const int64_t work = J.vcost[J.n_vparts] * rep * head_dim / ATT_MIN_PART_WORK;
    const int64_t most = J.n_vparts < max_parts ? J.n_vparts : max_parts;
    J.n_threads = work < 1 ? 1 : (int)(work < most ? work : most);
    kn_pool_run(kn_cpu_pool(c), J.n_threads, 1, att_threads, &J);
    merge_parts(&J);
}
