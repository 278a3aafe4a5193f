/* cpu_kquant.c: the 256-weight super-block types (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS):
 * the dequantizer and the decode dot products.
 *
 * Layouts (bytes of one 256-weight super-block; element e = 32 c + l, chunk c < 8, l < 32;
 * group g = e / 16):
 *   Q2_K (84): scales[16] | qs[64] | d f16 | dmin f16
 *       q = (qs[32 (c / 4) + l] >> 2 (c % 4)) & 3;  w = d (scales[g] & 15) q - dmin (scales[g] >>
 * 4) Q3_K (110): hmask[32] | qs[64] | scales[12] | d f16 q = the Q2_K crumb | ((hmask[l] >> c) & 1)
 * << 2, minus 4;  w = d (sc[g] - 32) q sc[g] = (scales[g % 8] >> 4 (g / 8)) & 15 | ((scales[8 + g %
 * 4] >> 2 (g / 4)) & 3) << 4 Q4_K (144): d f16 | dmin f16 | scales[12] | qs[128] q = (qs[32 (c / 2)
 * + l] >> 4 (c % 2)) & 15;  w = d sc[c] q - dmin mn[c] Q5_K (176): d f16 | dmin f16 | scales[12] |
 * qh[32] | qs[128] q = the Q4_K nibble | ((qh[l] >> c) & 1) << 4;  w = d sc[c] q - dmin mn[c] Q6_K
 * (210): ql[128] | qh[64] | scales[16] int8 | d f16;  with c = 4 h + k: q = ((ql[64 h + 32 (k % 2)
 * + l] >> 4 (k / 2)) & 15 | ((qh[32 h + l] >> 2 k) & 3) << 4) - 32;  w = d scales[g] q IQ4_XS
 * (136): d f16 | scales_h u16 | scales_l[4] | qs[128] n = qs[16 c + l % 16] >> 4 (l / 16) & 15;  w
 * = d (ls[c] - 32) kvalues_iq4nl[n] ls[c] = (scales_l[c / 2] >> 4 (c % 2)) & 15 | ((scales_h >> 2
 * c) & 3) << 4 Q4_K/Q5_K's sc and mn are 6-bit values packed in scales[12] (kn_kq_scale_min, gguf's
 * get_scale_min).
 *
 * Exactness: every product d * scale * q is exact in float32 (24 significant bits) in any
 * order and fused or not, since d (fp16) has at most 11 significant bits and the integer
 * factors at most: Q2_K 4 + 2 (17 bits), Q3_K |sc - 32| <= 32 (5) + |q| <= 4 (3) (19),
 * Q4_K/Q5_K 6 + 5 (22), Q6_K 7 + 5 plus signs (23), IQ4_XS |ls - 32| <= 32 (5) + |level|
 * <= 127 (7) (23); the mins dmin * mn are exact too (11 + 6 bits). Q2_K/Q4_K/Q5_K then
 * round once when subtracting the min. The result is therefore bit-identical to
 * gguf.quants' numpy (which rounds the same single step) for every finite d and dmin,
 * subnormal halves included: the bound is 0 ulp, unlike Q4_1's.
 *
 * Dot path: per chunk of 32 (Q2_K/Q3_K/Q6_K: per group of 16) the raw quants (IQ4_XS: the
 * levels) are dotted with x unscaled, then scaled once by d * sc; the mins contribute
 * dmin * mn * sum(x over the chunk or group) from the block sums cpu_matmul.c computes
 * (over 32, Q2_K: over 16). Tiling as in cpu_matmul.c's qdot: four rows of W at a time
 * for m == 1 (independent chains, prefetch), two rows of W times up to four rows of x
 * otherwise, every row of x with the arithmetic of m == 1. On AVX-512 Q4_K and Q6_K have
 * loops of their own (kq4_dot: the dequantized weights from a per-chunk table, no block
 * sums; kq6_dot: the weights built in the dword domain), and the Q2_K-Q5_K scales are
 * unpacked in registers: scalar stores read back as vectors stalled on store forwarding.
 */
#include "cpu_kquant_internal.h"

#include "cpu_quant.h"
#include "cpu_traits.h"

/* Prefetch distance along each row stream of the dot path, in bytes (as MM_PREFETCH). */
#ifndef KQ_PREFETCH
#define KQ_PREFETCH 8192
#endif

/* The types with a min per chunk or group (w = d sc q - dmin mn). */
KN_ALWAYS_INLINE bool kq_has_min(td_dtype t)
{
    return t == TD_Q2_K || t == TD_Q4_K || t == TD_Q5_K;
}

/* The types with a scale per group of 16 rather than per chunk of 32. */
KN_ALWAYS_INLINE bool kq_g16(td_dtype t)
{
    return t == TD_Q2_K || t == TD_Q3_K || t == TD_Q6_K;
}

KN_ALWAYS_INLINE size_t kq_block_bytes(td_dtype t)
{
    switch (t) {
    case TD_Q2_K:
        return 84;
    case TD_Q3_K:
        return 110;
    case TD_Q4_K:
        return 144;
    case TD_Q5_K:
        return 176;
    case TD_IQ4_XS:
        return 136;
    default:
        return 210;
    }
}

/* ds[g] = d * s[g] for the 16 int8 scales s (exact products), vectorized: unpacking 16
 * scales one by one is a large part of the dot time of the 16-group types. */
KN_ALWAYS_INLINE void kq_scale16(const int8_t *s, float d, float *ds)
{
#if KN_VL == 16
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)s));
    _mm512_storeu_ps(ds, _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(d)));
#elif KN_VL == 8
    const __m128i v = _mm_loadu_si128((const __m128i *)s);
    const __m256 vd = _mm256_set1_ps(d);
    _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), vd));
    _mm256_storeu_ps(
        ds + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), vd));
#else
    for (int g = 0; g < 16; g++)
        ds[g] = d * (float)s[g];
#endif
}

#if KN_VL == 16
/* kq_scale16 of 16 int8 scales already in a register. */
KN_ALWAYS_INLINE void kq_scale16v(__m128i s, float d, float *ds)
{
    _mm512_storeu_ps(ds,
                     _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s)), _mm512_set1_ps(d)));
}
#endif

/* The 16 six-bit scales of a Q3_K super-block minus 32, from scales[12] (ggml's kmask
 * shuffle: word k of the result holds groups 4 k .. 4 k + 3). */
KN_ALWAYS_INLINE void kq_q3_scales(const uint8_t *s, int8_t sc[16])
{
    uint32_t a[3], o[4];
    memcpy(a, s, 12);
    const uint32_t m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    o[0] = (a[0] & m4) | ((a[2] & m2) << 4);
    o[1] = (a[1] & m4) | (((a[2] >> 2) & m2) << 4);
    o[2] = ((a[0] >> 4) & m4) | (((a[2] >> 4) & m2) << 4);
    o[3] = ((a[1] >> 4) & m4) | (((a[2] >> 6) & m2) << 4);
    /* each byte b (0..63) becomes b - 32 as int8: b | 0x80 minus 32 never borrows from the
     * next byte, and flipping the top bit back gives (b - 32) mod 256 */
    for (int k = 0; k < 4; k++)
        o[k] = ((o[k] | 0x80808080u) - 0x20202020u) ^ 0x80808080u;
    memcpy(sc, o, 16);
}

#if KN_VL == 16
/* sm[c] = d sc[c] and sm[8 + c] = dmin mn[c] of a Q4_K/Q5_K super-block, c < 8 (exact
 * products, as kq_scales): the bytes of kn_kq_scale_min's unpacking four at a time (scales bytes
 * 0-3 a, 4-7 b, 8-11 c: sc[0..3] = a & 63, mn[0..3] = b & 63, sc[4..7] = c's low nibbles | a's top
 * two bits << 4, mn[4..7] = c's high nibbles | b's top two bits << 4), widened and scaled in one
 * vector. */
KN_ALWAYS_INLINE void kq4_scales(const uint8_t *blk, float sm[16])
{
    /* lanes a, b, c (and 4 bytes of qs) of scales; built in registers, since scalar words
     * stored and read back as one vector stall on store forwarding */
    const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 4));
    const __m128i lo = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)),
                                      _mm_setr_epi32(0, 0, 0, 4)); /* a, c, b, c >> 4 */
    const __m128i hi = _mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 6);
    const __m128i u = _mm_or_si128(
        _mm_and_si128(lo, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f)),
        _mm_slli_epi32(_mm_and_si128(hi, _mm_setr_epi32(0, 0x03030303, 0, 0x03030303)), 4));
    const __m512 f =
        _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(kn_h2f(blk)), _mm512_set1_ps(kn_h2f(blk + 2)));
    _mm512_storeu_ps(sm, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u)), f));
}
#endif

/* ds = d * scale per chunk (8: Q4_K, Q5_K, IQ4_XS) or group (16: Q2_K, Q3_K, Q6_K), dm =
 * dmin * min likewise (Q2_K, Q4_K, Q5_K); all exact products. */
KN_ALWAYS_INLINE void kq_scales(td_dtype t, const uint8_t *blk, float *ds, float *dm)
{
    if (t == TD_Q6_K) {
        kq_scale16((const int8_t *)(blk + 192), kn_h2f(blk + 208), ds);
        return;
    }
#if KN_VL == 16
    /* the 16-group types' scales unpacked in registers (bytes stored one by one and read
     * back as a vector stall on store forwarding) */
    if (t == TD_Q3_K) {
        /* scales[12] (a mask load: 16 bytes would pass the end of the last block) */
        const __m128i v = _mm_maskz_loadu_epi8(0x0fff, blk + 96);
        const __m128i lo =
            _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 1, 0)),
                                         _mm_setr_epi32(0, 0, 4, 4)),
                          _mm_set1_epi8(0x0f));
        const __m128i hi =
            _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 2, 2)),
                                         _mm_setr_epi32(0, 2, 4, 6)),
                          _mm_set1_epi8(0x03));
        const __m128i sc = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi32(hi, 4)), _mm_set1_epi8(32));
        kq_scale16v(sc, kn_h2f(blk + 108), ds);
        return;
    }
    if (t == TD_Q2_K) {
        const __m128i v = _mm_loadu_si128((const __m128i *)blk);
        kq_scale16v(_mm_and_si128(v, _mm_set1_epi8(0x0f)), kn_h2f(blk + 80), ds);
        kq_scale16v(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f)), kn_h2f(blk + 82), dm);
        return;
    }
#endif
    if (t == TD_Q3_K) {
        int8_t sc[16];
        kq_q3_scales(blk + 96, sc);
        kq_scale16(sc, kn_h2f(blk + 108), ds);
        return;
    }
    if (t == TD_Q2_K) {
        int8_t sc[16], mn[16];
        for (int g = 0; g < 16; g++) {
            sc[g] = (int8_t)(blk[g] & 15);
            mn[g] = (int8_t)(blk[g] >> 4);
        }
        kq_scale16(sc, kn_h2f(blk + 80), ds);
        kq_scale16(mn, kn_h2f(blk + 82), dm);
        return;
    }
    if (t == TD_IQ4_XS) {
        const float d = kn_h2f(blk);
        const unsigned sh = blk[2] | (unsigned)blk[3] << 8;
        for (int c = 0; c < 8; c++) {
            const int ls = ((blk[4 + c / 2] >> (4 * (c % 2))) & 15) | ((sh >> (2 * c)) & 3) << 4;
            ds[c] = d * (float)(ls - 32);
        }
        return;
    }
#if KN_VL == 16
    float sm[16];
    kq4_scales(blk, sm);
    memcpy(ds, sm, 8 * sizeof(float));
    memcpy(dm, sm + 8, 8 * sizeof(float));
    return;
#endif
    int sc[8], mn[8];
    kn_kq_scale_min(blk + 4, sc, mn);
    const float d = kn_h2f(blk), dmin = kn_h2f(blk + 2);
    for (int c = 0; c < 8; c++) {
        ds[c] = d * (float)sc[c];
        dm[c] = dmin * (float)mn[c];
    }
}

/* q (KN_NV vectors, elements 0..31 in order) = ((lo[i] >> ls) & lm | ((hi[i] >> hs) & hm)
 * << hp) - off as floats, for i < 32; hi NULL: no high bits. */
KN_ALWAYS_INLINE void kq_bits(const uint8_t *lo, int ls, int lm, const uint8_t *hi, int hs, int hm,
                              int hp, int off, kn_vf q[KN_NV])
{
#if KN_VL > 1
    __m256i a = _mm256_loadu_si256((const __m256i *)lo);
    a = _mm256_and_si256(_mm256_srli_epi16(a, ls), _mm256_set1_epi8((char)lm));
    if (hi) {
        __m256i b = _mm256_loadu_si256((const __m256i *)hi);
        b = _mm256_and_si256(_mm256_srli_epi16(b, hs), _mm256_set1_epi8((char)hm));
        /* b << hp < 64: no carry between bytes */
        a = _mm256_or_si256(a, _mm256_slli_epi16(b, hp));
    }
    if (off) a = _mm256_sub_epi8(a, _mm256_set1_epi8((char)off));
    const __m128i a0 = _mm256_castsi256_si128(a), a1 = _mm256_extracti128_si256(a, 1);
#if KN_VL == 16
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a0));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a1));
#else
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a0));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a0, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a1));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a1, 8)));
#endif
#else
    for (int i = 0; i < 32; i++) {
        int v = (lo[i] >> ls) & lm;
        if (hi) v |= ((hi[i] >> hs) & hm) << hp;
        q[i] = (float)(v - off);
    }
#endif
}

/* q = the raw quants (IQ4_XS: their levels) of chunk c (elements 32 c .. 32 c + 31) of
 * the super-block blk. */
KN_ALWAYS_INLINE void kq_load(td_dtype t, const uint8_t *blk, int c, kn_vf q[KN_NV])
{
    if (t == TD_Q2_K)
        kq_bits(blk + 16 + 32 * (c / 4), 2 * (c % 4), 3, NULL, 0, 0, 0, 0, q);
    else if (t == TD_Q3_K)
        kq_bits(blk + 32 + 32 * (c / 4), 2 * (c % 4), 3, blk, c, 1, 2, 4, q);
    else if (t == TD_Q4_K)
        kq_bits(blk + 16 + 32 * (c / 2), 4 * (c % 2), 15, NULL, 0, 0, 0, 0, q);
    else if (t == TD_Q5_K)
        kq_bits(blk + 48 + 32 * (c / 2), 4 * (c % 2), 15, blk + 16, c, 1, 4, 0, q);
    else if (t == TD_IQ4_XS)
        kn_nl_load(blk + 8 + 16 * c, q);
    else
        kq_bits(blk + 64 * (c / 4) + 32 * (c % 2), 4 * ((c % 4) / 2), 15, blk + 128 + 32 * (c / 4),
                2 * (c % 4), 3, 4, 32, q);
}

/* Vector k of chunk c covers elements 32 c + k KN_VL ..; the group of 16 it falls in. */
#define KQ_GROUP(c, k) (2 * (c) + (k)*KN_VL / 16)

static void kq_dequant_t(td_dtype t, const uint8_t *src, float *dst, int64_t nsb)
{
    const size_t bs = kq_block_bytes(t);
    for (int64_t b = 0; b < nsb; b++, src += bs) {
        float ds[16], dm[16];
        kq_scales(t, src, ds, dm);
        for (int c = 0; c < 8; c++, dst += 32) {
            kn_vf q[KN_NV];
            kq_load(t, src, c, q);
            for (int k = 0; k < KN_NV; k++) {
                const int g = kq_g16(t) ? KQ_GROUP(c, k) : c;
                kn_vf v = kn_vmul(q[k], kn_vset1(ds[g]));
                /* the product is exact, so fusing it with the add changes nothing;
                 * p + (-dm) is p - dm bit for bit */
                if (kq_has_min(t)) v = kn_vadd(v, kn_vset1(-dm[g]));
                kn_vstore(dst + k * KN_VL, v);
            }
        }
    }
}

/* The row dequantizers of cpu_traits.h's table, one specialised copy per type. */
#define KQ_DEQUANT(name, T)                                                                        \
    void name(const uint8_t *src, float *dst, int64_t n)                                           \
    {                                                                                              \
        kq_dequant_t(T, src, dst, n / KN_QK_K);                                                    \
    }
KQ_DEQUANT(kn_kq_dequant_q2_k, TD_Q2_K)
KQ_DEQUANT(kn_kq_dequant_q3_k, TD_Q3_K)
KQ_DEQUANT(kn_kq_dequant_q4_k, TD_Q4_K)
KQ_DEQUANT(kn_kq_dequant_q5_k, TD_Q5_K)
KQ_DEQUANT(kn_kq_dequant_q6_k, TD_Q6_K)
KQ_DEQUANT(kn_kq_dequant_iq4_xs, TD_IQ4_XS)

#if KN_KQ_AVX512_LOOPS
/* *p in every lane, as a broadcast from memory (a load-port operation): left to itself
 * the compiler keeps sm in a register and broadcasts with vpermd, on the shuffle port the
 * table lookups already saturate. */
KN_ALWAYS_INLINE __m512 kq_bcast(const float *p)
{
    __m512 v;
    __asm__("vbroadcastss %1, %0" : "=v"(v) : "m"(*p));
    return v;
}

/* Q4_K on AVX-512, the dot of kq_dot's contract without xs: per chunk c a 16-entry table
 * T_c[q] = d sc[c] q - dmin mn[c] (one fma, rounded once: the dequantized weight, bit for
 * bit), looked up by the nibbles themselves (vpermps reads an index's low 4 bits, so the
 * low nibble needs no mask), then one fma per 16 weights and row of x. Against the generic
 * loop (shift, mask, widen, convert, multiply by x, then scale the chunk's sum, and the
 * mins from block sums of x) this is about half the vector operations per weight; the
 * weights it multiplies are exactly the dequantizer's, so the gemm path's x W^T is the same
 * sum in another order. Every (row of W, row of x) pair runs the same operations in the
 * same order for any R and M (batch invariance). */
KN_ALWAYS_INLINE void kq4_dot(int R, int M, const uint8_t *w, size_t ws, int64_t nsb,
                              const float *x, int64_t ldx, float *y, int64_t ldy)
{
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < M; j++)
            acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = w + (size_t)r * ws + (size_t)b * 144;
#if KQ_PREFETCH
            __builtin_prefetch(blk + KQ_PREFETCH);
            __builtin_prefetch(blk + KQ_PREFETCH + 64);
            __builtin_prefetch(blk + KQ_PREFETCH + 128);
#endif
            /* sm[c] = d sc[c], sm[8 + c] = dmin mn[c] */
            float sm[16];
            kq4_scales(blk, sm);
            /* 32 bytes of qs hold chunk 2 p (low nibbles) and 2 p + 1 (high nibbles) */
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                const uint8_t *qs = blk + 16 + 32 * p;
                const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
                const __m512i b1 =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)));
                const __m512 tl =
                    _mm512_fmsub_ps(levels, kq_bcast(&sm[2 * p]), kq_bcast(&sm[8 + 2 * p]));
                const __m512 th =
                    _mm512_fmsub_ps(levels, kq_bcast(&sm[2 * p + 1]), kq_bcast(&sm[8 + 2 * p + 1]));
                const __m512 w0 = _mm512_permutexvar_ps(b0, tl);
                const __m512 w1 = _mm512_permutexvar_ps(b1, tl);
                const __m512 w2 = _mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), th);
                const __m512 w3 = _mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), th);
#pragma GCC unroll 4
                for (int j = 0; j < M; j++) {
                    const float *xj = x + j * ldx + b * KN_QK_K + 64 * p;
                    __m512 a = acc[r][j];
                    a = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xj), a);
                    a = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xj + 16), a);
                    a = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xj + 32), a);
                    acc[r][j] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xj + 48), a);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < M; j++)
            y[j * ldy + r] = kn_vsum(acc[r][j]);
}

/* Q6_K on AVX-512, kq_dot's contract: per half h of the super-block (128 weights) the 64
 * bytes of ql and 32 of qh are widened to dwords once; each vector of 16 quants is then
 * nibble | high bits (one ternary-logic op), converted, and made the dequantized weight
 * d sc[g] (q - 32) = fma(q, d sc[g], -32 d sc[g]) (exact: the products have at most 23
 * significant bits), then one fma per row of x. Against the generic loop (byte-domain
 * unpacking, two widenings and an extract per 32 quants) fewer shuffle-port operations,
 * and at m > 1 the weights are built once for up to four rows of x. The same operations
 * in the same order for every (row of W, row of x) pair, any R and M. */
KN_ALWAYS_INLINE void kq6_dot(int R, int M, const uint8_t *w, size_t ws, int64_t nsb,
                              const float *x, int64_t ldx, float *y, int64_t ldy)
{
    const __m512i m15 = _mm512_set1_epi32(15), m48 = _mm512_set1_epi32(0x30);
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < M; j++)
            acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = w + (size_t)r * ws + (size_t)b * 210;
#if KQ_PREFETCH
            for (size_t o = 0; o < 210; o += 64)
                __builtin_prefetch(blk + KQ_PREFETCH + o);
#endif
            /* ds[g] = d sc[g], ds[16 + g] = -32 d sc[g] */
            float ds[32];
            const __m512 vds = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                 _mm_loadu_si128((const __m128i *)(blk + 192)))),
                                             _mm512_set1_ps(kn_h2f(blk + 208)));
            _mm512_storeu_ps(ds, vds);
            _mm512_storeu_ps(ds + 16, _mm512_mul_ps(vds, _mm512_set1_ps(-32.0f)));
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m512i L[4], H[2];
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++)
                    L[i] = _mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(blk + 64 * h + 16 * i)));
#pragma GCC unroll 2
                for (int i = 0; i < 2; i++) {
                    H[i] = _mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(blk + 128 + 32 * h + 16 * i)));
                }
                /* chunk c = 4 h + k, its two groups of 16 (i): elements 32 c + 16 i .. */
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++)
#pragma GCC unroll 2
                    for (int i = 0; i < 2; i++) {
                        const __m512i l = L[2 * (k % 2) + i];
                        const __m512i nib =
                            k < 2 ? _mm512_and_si512(l, m15) : _mm512_srli_epi32(l, 4);
                        /* the two high bits (qh >> 2 k) & 3 moved to bits 4-5 */
                        const __m512i hs = k == 0   ? _mm512_slli_epi32(H[i], 4)
                                           : k == 1 ? _mm512_slli_epi32(H[i], 2)
                                           : k == 2 ? H[i]
                                                    : _mm512_srli_epi32(H[i], 2);
                        /* nib | (hs & 0x30) */
                        const __m512i q = _mm512_ternarylogic_epi32(nib, hs, m48, 0xf8);
                        const int g = 2 * (4 * h + k) + i;
                        const __m512 wv = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), kq_bcast(&ds[g]),
                                                          kq_bcast(&ds[16 + g]));
#pragma GCC unroll 4
                        for (int j = 0; j < M; j++)
                            acc[r][j] = _mm512_fmadd_ps(
                                wv, _mm512_loadu_ps(x + j * ldx + b * KN_QK_K + 16 * g), acc[r][j]);
                    }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < M; j++)
            y[j * ldy + r] = kn_vsum(acc[r][j]);
}
#endif

/* y[j * ldy + r] = dot(row r of W, row j of x) for R rows of W at w (row stride ws) and
 * M rows of x (row stride ldx), nsb super-blocks per row; xs: block sums of x over the
 * min groups (Q4_K/Q5_K: 32, row stride 8 nsb; Q2_K: 16, row stride 16 nsb). */
KN_ALWAYS_INLINE void kq_dot(td_dtype t, int R, int M, const uint8_t *w, size_t ws, int64_t nsb,
                             const float *x, int64_t ldx, const float *xs, float *y, int64_t ldy)
{
#if KN_KQ_AVX512_LOOPS
    if (t == TD_Q4_K) {
        kq4_dot(R, M, w, ws, nsb, x, ldx, y, ldy);
        return;
    }
    if (t == TD_Q6_K) {
        kq6_dot(R, M, w, ws, nsb, x, ldx, y, ldy);
        return;
    }
#endif
    const size_t bs = kq_block_bytes(t);
    const int ng = kq_g16(t) ? 16 : 8; /* scale (and min) groups per super-block */
    kn_vf acc[4][4];
    float macc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < M; j++) {
            acc[r][j] = kn_vzero();
            macc[r][j] = 0.0f;
        }
    for (int64_t b = 0; b < nsb; b++) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = w + (size_t)r * ws + (size_t)b * bs;
#if KQ_PREFETCH
            for (size_t o = 0; o < bs; o += 64)
                __builtin_prefetch(blk + KQ_PREFETCH + o);
#endif
            float ds[16], dm[16];
            kq_scales(t, blk, ds, dm);
            for (int c = 0; c < 8; c++) {
                kn_vf q[KN_NV];
                kq_load(t, blk, c, q);
#pragma GCC unroll 4
                for (int j = 0; j < M; j++) {
                    const float *xj = x + j * ldx + b * KN_QK_K + c * 32;
                    if (kq_g16(t)) {
                        /* two groups of 16, each with its own scale */
#pragma GCC unroll 2
                        for (int g = 0; g < 2; g++) {
                            const int k0 = g * KN_NV / 2;
                            kn_vf p = kn_vmul(q[k0], kn_vload(xj + k0 * KN_VL));
#pragma GCC unroll 16
                            for (int k = k0 + 1; k < k0 + KN_NV / 2; k++)
                                p = kn_vfma(q[k], kn_vload(xj + k * KN_VL), p);
                            acc[r][j] = kn_vfma(p, kn_vset1(ds[2 * c + g]), acc[r][j]);
                        }
                    } else {
                        kn_vf p = kn_vmul(q[0], kn_vload(xj));
#pragma GCC unroll 32
                        for (int k = 1; k < KN_NV; k++)
                            p = kn_vfma(q[k], kn_vload(xj + k * KN_VL), p);
                        acc[r][j] = kn_vfma(p, kn_vset1(ds[c]), acc[r][j]);
                    }
                }
            }
            if (kq_has_min(t))
#pragma GCC unroll 4
                for (int j = 0; j < M; j++)
                    for (int g = 0; g < ng; g++)
                        macc[r][j] = kn_fmaf(dm[g], xs[j * ng * nsb + ng * b + g], macc[r][j]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < M; j++)
            y[j * ldy + r] = kn_vsum(acc[r][j]) - macc[r][j];
}

/* R rows of W from row r against rows [i, i + M) of x. */
KN_ALWAYS_INLINE void kq_tile(td_dtype t, int R, int M, const kn_mat *w, const float *x,
                              const float *xs, float *y, int64_t r, int64_t i)
{
    const int64_t nsb = w->n_cols / KN_QK_K, ng = kq_g16(t) ? 16 : 8;
    kq_dot(t, R, M, (const uint8_t *)w->data + (size_t)r * w->row_stride, w->row_stride, nsb,
           x + i * w->n_cols, w->n_cols, xs ? xs + i * ng * nsb : NULL, y + i * w->n_rows + r,
           w->n_rows);
}

/* R rows of W from row r against all m rows of x, four rows of x at a time. */
KN_ALWAYS_INLINE void kq_rows(td_dtype t, int R, const kn_mat *w, const float *x, const float *xs,
                              int64_t m, float *y, int64_t r)
{
    int64_t i = 0;
    for (; i + 4 <= m; i += 4)
        kq_tile(t, R, 4, w, x, xs, y, r, i);
    switch (m - i) {
    case 3:
        kq_tile(t, R, 3, w, x, xs, y, r, i);
        break;
    case 2:
        kq_tile(t, R, 2, w, x, xs, y, r, i);
        break;
    case 1:
        kq_tile(t, R, 1, w, x, xs, y, r, i);
        break;
    default:
        break;
    }
}

KN_ALWAYS_INLINE void kq_range(td_dtype t, const kn_mat *w, const float *x, const float *xs,
                               int64_t m, float *y, int64_t r0, int64_t r1)
{
    int64_t r = r0;
    if (m == 1) {
        for (; r + 4 <= r1; r += 4)
            kq_tile(t, 4, 1, w, x, xs, y, r, 0);
        for (; r < r1; r++)
            kq_tile(t, 1, 1, w, x, xs, y, r, 0);
        return;
    }
    for (; r + 2 <= r1; r += 2)
        kq_rows(t, 2, w, x, xs, m, y, r);
    for (; r < r1; r++)
        kq_rows(t, 1, w, x, xs, m, y, r);
}

/* The float32 dot kernels of cpu_traits.h's table: one specialised copy per type, so every
 * inner loop is branch-free. */
#define KQ_RANGE(name, T)                                                                          \
    void name(const kn_mat *w, const float *x, const float *xs, int64_t m, float *y, int64_t r0,   \
              int64_t r1)                                                                          \
    {                                                                                              \
        kq_range(T, w, x, xs, m, y, r0, r1);                                                       \
    }
KQ_RANGE(kn_kq_dot_q2_k, TD_Q2_K)
KQ_RANGE(kn_kq_dot_q3_k, TD_Q3_K)
KQ_RANGE(kn_kq_dot_q4_k, TD_Q4_K)
KQ_RANGE(kn_kq_dot_q5_k, TD_Q5_K)
KQ_RANGE(kn_kq_dot_q6_k, TD_Q6_K)
KQ_RANGE(kn_kq_dot_iq4_xs, TD_IQ4_XS)
