/* cpu_q16act.c: integer dot products of 32-block weights with 16-bit activations (the q16
 * mode of the decode dot path; cpu_q16act.h gives the format, the arithmetic and the contract).
 *
 * Three forms of one arithmetic:
 *  - AVX512-VNNI, 16 rows of W per group: lane r of a vector is row r. A group's block comes
 *    from the q8 mode's packed copy (cpu_q8gemm.c's layout: per block the 4 vectors of raw
 *    nibble dwords, lane r holding bytes 4u..4u+3 of row r's quants, or Q8_0's 8 vectors of
 *    biased bytes, Q5_0's qh vector, then 16 f16 d and 16 f16 mins), or from the raw rows by
 *    the same 4x4 dword transpose (tr16) when W was never packed. The nibbles become the q8
 *    GEMM's 8 vectors of unsigned bytes, and 16 vpdpbusd per block and row of x (8 against
 *    x's high bytes, 8 against its low bytes; two independent chains) give the exact dots,
 *    half the instructions of widening the weights to int16 for vpdpwssd; then the float
 *    part lane-wise.
 *  - AVX2, one row at a time: the 32 quants widened to int16, madd_epi16 against q, summed.
 *  - scalar: s element by element.
 * s is exact in all three, and the float part is the same sequence of roundings per (row of
 * W, row of x), so the three give the same bits. Up to four rows of x share each decoded
 * block of W, every row with the arithmetic of one.
 */
#include "cpu_q16act.h"

#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "cpu_q8vnni.h"
#include "cpu_quant.h"
#include "cpu_traits.h"

#define Q16_PREFETCH 8192 /* bytes ahead along each weight row (unpacked W), as the float path */

/* ---- the type's constants (compile-time once inlined) ---- */

KN_ALWAYS_INLINE size_t q16_bs(td_dtype t)
{
    return t == TD_Q8_0 ? 34 : t == TD_Q4_1 ? 20 : t == TD_Q5_0 ? 22 : 18;
}

/* Offset of the quant bytes in a raw block. */
KN_ALWAYS_INLINE int q16_qoff(td_dtype t)
{
    return t == TD_Q4_1 ? 4 : t == TD_Q5_0 ? 6 : 2;
}

/* What the unsigned quants of the VNNI form carry on top of w_q (the packed copy's bias). */
KN_ALWAYS_INLINE int q16_bias(td_dtype t)
{
    return t == TD_Q4_0 ? 8 : t == TD_Q5_0 ? 16 : t == TD_Q8_0 ? 128 : 0;
}

bool kn_q16_supported(td_dtype t)
{
    const kn_cpu_traits *tr = kn_cpu_traits_of(t);
    return tr && tr->q16_dot;
}

size_t kn_q16_row_bytes(int64_t n)
{
    return (size_t)(n / TD_QK) * sizeof(kn_q16b);
}

/* ---- quantizing x ---- */

/* A block quantized to zeros: all zero, or so small (every |x| below ~1e-34) that
 * QMAX / amax overflows, where x * inf would give NaN for its zeros. */
static bool q16_zero_block(float amax)
{
    return amax == 0.0f || isinf((float)KN_Q16_QMAX / amax);
}

static int q16_isa(void);

static void q16b_quant(const float *x, kn_q16b *b, bool vec)
{
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* vec (the AVX512-VNNI form, not forced off): the scalar rule below on two vectors (finite
     * blocks; the others take it): the products, roundings (nearest even, as nearbyintf in the
     * default mode) and clamps are the same operations, max and the integer parts exact in any
     * order, so the same bits. It is most of the mode's cost outside the dots (a scalar loop
     * calling fmaxf per element was 28 % of the default model's prefill dot time, AMD EPYC). */
#define Q16_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
    const __m512 a = _mm512_loadu_ps(x), c = _mm512_loadu_ps(x + 16), z = _mm512_setzero_ps();
    const __mmask16 bad = _mm512_cmp_ps_mask(_mm512_sub_ps(a, a), z, _CMP_NEQ_UQ) |
                          _mm512_cmp_ps_mask(_mm512_sub_ps(c, c), z, _CMP_NEQ_UQ);
    if (vec && !bad) {
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
        if (q16_zero_block(amax)) {
            memset(b, 0, sizeof *b);
            return;
        }
        const __m512 id = _mm512_set1_ps((float)KN_Q16_QMAX / amax),
                     top = _mm512_set1_ps((float)KN_Q16_QMAX),
                     bot = _mm512_set1_ps(-(float)KN_Q16_QMAX);
        const __m512i qa = _mm512_cvtps_epi32(_mm512_max_ps(
            _mm512_min_ps(_mm512_roundscale_ps(_mm512_mul_ps(a, id), Q16_RNE), top), bot));
        const __m512i qc = _mm512_cvtps_epi32(_mm512_max_ps(
            _mm512_min_ps(_mm512_roundscale_ps(_mm512_mul_ps(c, id), Q16_RNE), top), bot));
        /* hi = floor((q + 128) / 256) by an arithmetic shift, lo = q - 256 hi */
        const __m512i r = _mm512_set1_epi32(128);
        const __m512i ha = _mm512_srai_epi32(_mm512_add_epi32(qa, r), 8),
                      hc = _mm512_srai_epi32(_mm512_add_epi32(qc, r), 8);
        const __m512i la = _mm512_sub_epi32(qa, _mm512_slli_epi32(ha, 8)),
                      lc = _mm512_sub_epi32(qc, _mm512_slli_epi32(hc, 8));
        _mm256_storeu_si256((__m256i *)(void *)b->qs, _mm512_cvtepi32_epi16(qa));
        _mm256_storeu_si256((__m256i *)(void *)(b->qs + 16), _mm512_cvtepi32_epi16(qc));
        _mm_storeu_si128((__m128i *)(void *)b->hi, _mm512_cvtepi32_epi8(ha));
        _mm_storeu_si128((__m128i *)(void *)(b->hi + 16), _mm512_cvtepi32_epi8(hc));
        _mm_storeu_si128((__m128i *)(void *)b->lo, _mm512_cvtepi32_epi8(la));
        _mm_storeu_si128((__m128i *)(void *)(b->lo + 16), _mm512_cvtepi32_epi8(lc));
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
        b->d = amax / (float)KN_Q16_QMAX;
        b->sum = sum;
        b->dsum = b->d * (float)sum;
        return;
    }
#undef Q16_RNE
#else
    (void)vec;
#endif
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < TD_QK; i++) {
        amax = fmaxf(amax, fabsf(x[i]));
        finite &= isfinite(x[i]) != 0;
    }
    memset(b, 0, sizeof *b);
    if (!finite || q16_zero_block(amax)) {
        b->d = finite ? 0.0f : NAN;
        b->dsum = b->d;
        return;
    }
    const float id = (float)KN_Q16_QMAX / amax;
    int32_t sum = 0;
    for (int i = 0; i < TD_QK; i++) {
        float v = nearbyintf(x[i] * id);
        v = v > KN_Q16_QMAX ? KN_Q16_QMAX : v < -KN_Q16_QMAX ? -KN_Q16_QMAX : v;
        const int q = (int)v, hi = (q + 128 + 32768) / 256 - 128; /* floor((q + 128) / 256) */
        b->qs[i] = (int16_t)q;
        b->hi[i] = (int8_t)hi;
        b->lo[i] = (int8_t)(q - 256 * hi);
        sum += q;
    }
    b->d = amax / (float)KN_Q16_QMAX;
    b->sum = sum;
    b->dsum = b->d * (float)sum;
}

void kn_q16_quant_rows(const float *x, int64_t m, int64_t n, void *xq)
{
    kn_q16b *b = xq;
    const bool vec = q16_isa() == 2;
    for (int64_t i = 0; i < m * (n / TD_QK); i++)
        q16b_quant(x + i * TD_QK, &b[i], vec);
}

/* ---- the instruction set ---- */

static atomic_int q16_isa_sel = -1; /* -1 not chosen, 0 scalar, 1 AVX2, 2 AVX512-VNNI */
static atomic_int q16_isa_cap = 2;  /* kn_q16_force_isa: the highest form allowed */

static int q16_isa(void)
{
    int s = atomic_load_explicit(&q16_isa_sel, memory_order_relaxed);
    if (s < 0) {
        __builtin_cpu_init();
        const bool vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
#if defined(__AVX2__) && defined(__FMA__)
        s = vnni ? 2 : 1;
#else
        s = vnni ? 2 : 0;
#endif
        atomic_store_explicit(&q16_isa_sel, s, memory_order_relaxed);
    }
    const int cap = atomic_load_explicit(&q16_isa_cap, memory_order_relaxed);
#if !defined(__AVX2__) || !defined(__FMA__)
    if (cap == 1) return 0;
#endif
    return s < cap ? s : cap;
}

const char *kn_q16_isa(void)
{
    static const char *const names[] = {"scalar", "avx2", "avx512vnni"};
    return names[q16_isa()];
}

void kn_q16_force_isa(const char *isa)
{
    atomic_store(&q16_isa_cap, !isa ? 2 : !strcmp(isa, "avx2") ? 1 : 0);
}

/* ---- the float part (every form) ---- */

/* acc after one block: s the exact integer dot, dw and mw the row's d and min (Q4_1). */
KN_ALWAYS_INLINE float q16_acc(td_dtype t, int32_t s, float dw, float mw, const kn_q16b *x,
                               float acc)
{
    acc = kn_fmaf((float)s, dw * x->d, acc);
    if (t == TD_Q4_1) acc = kn_fmaf(mw, x->dsum, acc);
    return acc;
}

/* ---- scalar ---- */

/* w_q of element e of the raw block blk (signed: the type's offset taken off). */
KN_ALWAYS_INLINE int q16_wq(td_dtype t, const uint8_t *blk, int e)
{
    if (t == TD_Q8_0) return (int8_t)blk[2 + e];
    const uint8_t *qs = blk + q16_qoff(t);
    int q = e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
    if (t == TD_Q5_0) {
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        q |= (int)((qh >> e) & 1) << 4;
    }
    return q - (t == TD_Q4_1 ? 0 : q16_bias(t));
}

KN_ALWAYS_INLINE int32_t q16_isum_scalar(td_dtype t, const uint8_t *blk, const kn_q16b *x)
{
    int32_t s = 0;
    for (int e = 0; e < TD_QK; e++)
        s += q16_wq(t, blk, e) * x->qs[e];
    return s;
}

/* ---- AVX2: one row at a time ---- */

#if defined(__AVX2__) && defined(__FMA__)
/* Q5_0: v (16 int16 quants of elements e0..e0 + 15) with bit e of qh as bit 4 of lane e. */
KN_ALWAYS_INLINE __m256i q16_hb256(__m256i v, uint32_t qh16)
{
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                          8192, 16384, (short)32768);
    const __m256i h = _mm256_and_si256(_mm256_set1_epi16((short)qh16), bit);
    return _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi16(h, bit), _mm256_set1_epi16(16)));
}

KN_ALWAYS_INLINE int32_t q16_isum_avx2(td_dtype t, const uint8_t *blk, const kn_q16b *x)
{
    __m256i a, b; /* elements 0..15 and 16..31 as int16 */
    if (t == TD_Q8_0) {
        a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const void *)(blk + 2)));
        b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const void *)(blk + 18)));
    } else {
        const __m128i n = _mm_loadu_si128((const void *)(blk + q16_qoff(t))),
                      m4 = _mm_set1_epi8(0x0f);
        a = _mm256_cvtepu8_epi16(_mm_and_si128(n, m4));
        b = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(n, 4), m4));
        if (t == TD_Q5_0) {
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            a = q16_hb256(a, qh & 0xffff);
            b = q16_hb256(b, qh >> 16);
        }
    }
    const __m256i p =
        _mm256_add_epi32(_mm256_madd_epi16(a, _mm256_loadu_si256((const void *)x->qs)),
                         _mm256_madd_epi16(b, _mm256_loadu_si256((const void *)(x->qs + 16))));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    int32_t r = _mm_cvtsi128_si32(s);
    if (t == TD_Q4_0 || t == TD_Q5_0) r -= q16_bias(t) * x->sum;
    return r;
}
#endif

/* Rows [r0, r1) of W one at a time (AVX2 or scalar), up to four rows of x per pass. */
KN_ALWAYS_INLINE void q16_rows1(td_dtype t, bool avx2, const kn_mat *w, const kn_q16b *xq,
                                int64_t m, float *y, int64_t r0, int64_t r1)
{
    const int64_t nb = w->n_cols / TD_QK;
    const size_t bs = q16_bs(t);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)r * w->row_stride;
        for (int64_t i = 0; i < m; i += 4) {
            const int M = m - i < 4 ? (int)(m - i) : 4;
            float acc[4] = {0, 0, 0, 0};
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + (size_t)b * bs;
                __builtin_prefetch(blk + Q16_PREFETCH);
                const float dw = kn_h2f(blk), mw = t == TD_Q4_1 ? kn_h2f(blk + 2) : 0.0f;
                for (int j = 0; j < M; j++) {
                    const kn_q16b *x = &xq[(i + j) * nb + b];
                    int32_t s;
#if defined(__AVX2__) && defined(__FMA__)
                    s = avx2 ? q16_isum_avx2(t, blk, x) : q16_isum_scalar(t, blk, x);
#else
                    (void)avx2;
                    s = q16_isum_scalar(t, blk, x);
#endif
                    acc[j] = q16_acc(t, s, dw, mw, x, acc[j]);
                }
            }
            for (int j = 0; j < M; j++)
                y[(i + j) * w->n_rows + r] = acc[j];
        }
    }
}

/* ---- AVX512-VNNI: 16 rows of W per group ---- */

#define Q16_T512 Q8G_T512
#define Q16_I512 Q8G_I512

/* vpdpbusd of w (unsigned bytes) with the 4 signed bytes at x4 broadcast to every lane. */
Q16_I512 __m512i q16_dpbusd(__m512i acc, __m512i w, const int8_t *x4)
{
    /* the broadcast as vpdpbusd's memory operand: GCC loads it into a register first, one
     * more instruction of the 16 per block and row of x */
    __asm__("vpdpbusd %2%{1to16%}, %1, %0"
            : "+v"(acc)
            : "v"(w), "m"(*(const int32_t *)(const void *)x4));
    return acc;
}

/* One block of a group (qv: the packed vectors, dv and mv: 16 rows' d and mins) against M rows
 * of x (xb[j] their blocks): the quants as unsigned bytes (the packed copy's bias on), dotted
 * with x's high and low byte planes by vpdpbusd, s = 256 dot(w, hi) + dot(w, lo) - bias sum
 * (exact), then the float part lane-wise. */
Q16_I512 void q16_block512(td_dtype t, int M, const __m512i *qv, __m512 dv, __m512 mv,
                           const kn_q16b *const *xb, __m512 acc[4])
{
    __m512i V[8];
    if (t == TD_Q8_0) {
        KN_UNROLL
        for (int u = 0; u < 8; u++)
            V[u] = qv[u];
    } else {
        const __m512i m4 = _mm512_set1_epi8(0x0f);
        KN_UNROLL
        for (int u = 0; u < 4; u++) {
            V[u] = _mm512_and_si512(qv[u], m4);
            V[4 + u] = _mm512_and_si512(_mm512_srli_epi32(qv[u], 4), m4);
        }
        if (t == TD_Q5_0) {
            KN_UNROLL
            for (int u = 0; u < 8; u++)
                V[u] = _mm512_or_si512(V[u], spread16(_mm512_srli_epi32(qv[4], 4 * u)));
        }
    }
    __m512i ih[4], il[4];
    KN_UNROLL
    for (int j = 0; j < M; j++)
        ih[j] = il[j] = _mm512_setzero_si512();
    KN_UNROLL
    for (int u = 0; u < 8; u++) {
        KN_UNROLL
        for (int j = 0; j < M; j++) {
            ih[j] = q16_dpbusd(ih[j], V[u], xb[j]->hi + 4 * u);
            il[j] = q16_dpbusd(il[j], V[u], xb[j]->lo + 4 * u);
        }
    }
    const int bias = q16_bias(t);
    KN_UNROLL
    for (int j = 0; j < M; j++) {
        const kn_q16b *x = xb[j];
        __m512i s = _mm512_add_epi32(_mm512_slli_epi32(ih[j], 8), il[j]);
        if (bias) s = _mm512_sub_epi32(s, _mm512_set1_epi32(bias * x->sum));
        acc[j] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(x->d)), acc[j]);
        if (t == TD_Q4_1) acc[j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x->dsum), acc[j]);
    }
}

/* Bytes of a packed block (cpu_q8gemm.c's q8p_block_bytes) and its quant vectors. */
KN_ALWAYS_INLINE int q16_pvecs(td_dtype t)
{
    return t == TD_Q8_0 ? 8 : t == TD_Q5_0 ? 5 : 4;
}
KN_ALWAYS_INLINE size_t q16_pblock(td_dtype t)
{
    return (size_t)q16_pvecs(t) * 64 + (t == TD_Q4_1 ? 64 : 32);
}

/* Packed block o into qv, dv, mv. */
Q16_I512 void q16_load_packed(td_dtype t, const uint8_t *o, __m512i *qv, __m512 *dv, __m512 *mv)
{
    KN_UNROLL
    for (int u = 0; u < q16_pvecs(t); u++)
        qv[u] = _mm512_loadu_si512(o + 64 * u);
    const uint8_t *h = o + 64 * q16_pvecs(t);
    *dv = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)h));
    *mv = t == TD_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(h + 32)))
                       : _mm512_setzero_ps();
}

/* The same block from 16 raw rows (p: the block of the group's first row, idx: the rows'
 * byte offsets): the transposes the packer runs (cpu_q8gemm.c's repack512), in registers. */
Q16_I512 void q16_load_raw(td_dtype t, const uint8_t *p, const int32_t *idx, __m512i vi,
                           __m512i *qv, __m512 *dv, __m512 *mv)
{
    __m512i T[4];
    tr16(p, idx, q16_qoff(t), T);
    if (t == TD_Q8_0) {
        __m512i U[4];
        tr16(p, idx, 18, U);
        KN_UNROLL
        for (int u = 0; u < 4; u++) {
            qv[u] = _mm512_xor_si512(T[u], _mm512_set1_epi8((char)0x80));
            qv[4 + u] = _mm512_xor_si512(U[u], _mm512_set1_epi8((char)0x80));
        }
    } else {
        KN_UNROLL
        for (int u = 0; u < 4; u++)
            qv[u] = T[u];
        if (t == TD_Q5_0) qv[4] = _mm512_i32gather_epi32(vi, (const void *)(p + 2), 1);
    }
    const __m512i g = _mm512_i32gather_epi32(vi, (const void *)p, 1);
    *dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
    *mv = t == TD_Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)))
                       : _mm512_setzero_ps();
}

/* y rows [g_r0, g_r0 + 16) masked by k, for M rows of x from xq's row i: the group read from
 * gp (packed) or from the raw rows at p (idx). */
Q16_I512 void q16_tile512(td_dtype t, int M, const uint8_t *gp, const uint8_t *p,
                          const int32_t *idx, const kn_q16b *xq, int64_t nb, float *y, int64_t ldy,
                          __mmask16 k)
{
    const size_t pb = q16_pblock(t), bs = q16_bs(t);
    const __m512i vi = _mm512_loadu_si512(idx);
    __m512 acc[4];
    KN_UNROLL
    for (int j = 0; j < M; j++)
        acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i qv[8];
        __m512 dv, mv;
        if (gp) {
            const uint8_t *o = gp + (size_t)b * pb;
            for (size_t off = 0; off < pb; off += 64) /* the group streams: 8 blocks ahead */
                __builtin_prefetch(o + 8 * pb + off);
            q16_load_packed(t, o, qv, &dv, &mv);
        } else {
            const uint8_t *o = p + (size_t)b * bs;
            if (b % 2 == 0)
                for (int r = 0; r < 16; r++)
                    __builtin_prefetch(o + idx[r] + Q16_PREFETCH);
            q16_load_raw(t, o, idx, vi, qv, &dv, &mv);
        }
        const kn_q16b *xb[4];
        KN_UNROLL
        for (int j = 0; j < M; j++)
            xb[j] = xq + j * nb + b;
        q16_block512(t, M, qv, dv, mv, xb, acc);
    }
    KN_UNROLL
    for (int j = 0; j < M; j++)
        _mm512_mask_storeu_ps(y + j * ldy, k, acc[j]);
}

Q16_I512 void q16_group512(td_dtype t, const uint8_t *gp, const uint8_t *p, const int32_t *idx,
                           const kn_q16b *xq, int64_t m, int64_t nb, float *y, int64_t ldy,
                           __mmask16 k)
{
    int64_t i = 0;
    for (; i + 4 <= m; i += 4)
        q16_tile512(t, 4, gp, p, idx, xq + i * nb, nb, y + i * ldy, ldy, k);
    switch (m - i) {
    case 3:
        q16_tile512(t, 3, gp, p, idx, xq + i * nb, nb, y + i * ldy, ldy, k);
        break;
    case 2:
        q16_tile512(t, 2, gp, p, idx, xq + i * nb, nb, y + i * ldy, ldy, k);
        break;
    case 1:
        q16_tile512(t, 1, gp, p, idx, xq + i * nb, nb, y + i * ldy, ldy, k);
        break;
    default:
        break;
    }
}

/* Rows [r0, r1): with the packed copy by its 16-row groups (rows outside [r0, r1) computed
 * but not stored), else by groups of 16 raw rows from r0 (the last repeats its last row). */
Q16_I512 void q16_rows512(td_dtype t, const kn_mat *w, const uint8_t *packed, const kn_q16b *xq,
                          int64_t m, float *y, int64_t r0, int64_t r1)
{
    const int64_t nb = w->n_cols / TD_QK;
    int32_t idx[16];
    if (packed) {
        const size_t gbytes = (size_t)nb * q16_pblock(t);
        for (int64_t g = r0 / 16; 16 * g < r1; g++) {
            const int64_t a = 16 * g > r0 ? 16 * g : r0, e = 16 * g + 16 < r1 ? 16 * g + 16 : r1;
            const __mmask16 k = (__mmask16)(((1u << (e - a)) - 1) << (a - 16 * g));
            q16_group512(t, packed + (size_t)g * gbytes, NULL, idx, xq, m, nb, y + 16 * g,
                         w->n_rows, k);
        }
        return;
    }
    for (int64_t r = r0; r < r1; r += 16) {
        const int nr = (int)(r1 - r < 16 ? r1 - r : 16);
        for (int i = 0; i < 16; i++)
            idx[i] = (int32_t)((i < nr ? i : nr - 1) * (int64_t)w->row_stride);
        q16_group512(t, NULL, (const uint8_t *)w->data + (size_t)r * w->row_stride, idx, xq, m, nb,
                     y + r, w->n_rows, (__mmask16)((1u << nr) - 1));
    }
}

/* ---- the entry points ---- */

/* The q16 kernels of cpu_traits.h's table: one specialised copy per type and form. */
#define Q16_DOT(name, T)                                                                           \
    static Q16_T512 void name##_512(const kn_mat *w, const void *packed, const void *xq,           \
                                    int64_t m, float *y, int64_t r0, int64_t r1)                   \
    {                                                                                              \
        q16_rows512(T, w, packed, xq, m, y, r0, r1);                                               \
    }                                                                                              \
    static void name##_avx2(const kn_mat *w, const void *xq, int64_t m, float *y, int64_t r0,      \
                            int64_t r1)                                                            \
    {                                                                                              \
        q16_rows1(T, true, w, xq, m, y, r0, r1);                                                   \
    }                                                                                              \
    static void name##_scalar(const kn_mat *w, const void *xq, int64_t m, float *y, int64_t r0,    \
                              int64_t r1)                                                          \
    {                                                                                              \
        q16_rows1(T, false, w, xq, m, y, r0, r1);                                                  \
    }                                                                                              \
    void name(const kn_mat *w, const void *packed, const void *xq, int64_t m, float *y,            \
              int64_t r0, int64_t r1)                                                              \
    {                                                                                              \
        switch (q16_isa()) {                                                                       \
        case 2:                                                                                    \
            name##_512(w, packed, xq, m, y, r0, r1);                                               \
            break;                                                                                 \
        case 1:                                                                                    \
            name##_avx2(w, xq, m, y, r0, r1);                                                      \
            break;                                                                                 \
        default:                                                                                   \
            name##_scalar(w, xq, m, y, r0, r1);                                                    \
            break;                                                                                 \
        }                                                                                          \
    }
Q16_DOT(kn_q16_dot_q4_0, TD_Q4_0)
Q16_DOT(kn_q16_dot_q4_1, TD_Q4_1)
Q16_DOT(kn_q16_dot_q5_0, TD_Q5_0)
Q16_DOT(kn_q16_dot_q8_0, TD_Q8_0)

void kn_q16_dot(const kn_mat *w, const void *packed, const void *xq, int64_t m, float *y,
                int64_t r0, int64_t r1)
{
    kn_cpu_traits_of(w->type)->q16_dot(w, packed, xq, m, y, r0, r1);
}
