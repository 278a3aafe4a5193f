/* cpu_quant.h: private SIMD helpers shared by cpu_quant.c and cpu_matmul.c: one vector
 * type for the build's ISA and loaders that turn weight blocks into float vectors.
 *
 * Purpose: the dequantizer and the matmul kernels are written once against `kn_vf`
 * (16 floats with AVX-512, 8 with AVX2, 1 without SIMD), so the three ISA paths share
 * the same code and differ only in these few helpers.
 * Invariants: a quantized block holds TD_QK = 32 weights; element i < 16 is the low
 * nibble of qs[i], element 16 + i the high nibble (Q4_0/Q4_1/Q5_0/Q5_1), and for Q5_0/Q5_1
 * bit i of the 32-bit qh is the 5th bit of element i; loaders return the raw quants as
 * floats (Q8_0: q, Q4_0: q - 8, Q4_1: q, Q5_0: q - 16, Q5_1: q, IQ4_NL: the level
 * kvalues_iq4nl[q] of its non-linear table), unscaled, in KN_NV vectors covering elements
 * 0..31 in order; IQ4_NL stores its nibbles as Q4_0 does. Every block starts with its fp16 scale d;
 * Q4_1/Q5_1 follow it with the fp16 min m. All loads are unaligned-safe.
 * Threading: pure functions.
 */
#ifndef KN_CPU_QUANT_H
#define KN_CPU_QUANT_H

#include <stdint.h>
#include <string.h>

#include "td_dtype.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define KN_ALWAYS_INLINE static inline __attribute__((always_inline))

/* Before a short loop over vector registers (rows of a tile, the vectors of a block) whose
 * count is a constant once inlined: the project builds with -O2, where GCC does not unroll
 * such loops completely, and the accumulator arrays they index then live on the stack, every
 * update a store and a reload on the dependency chain (the q8 GEMM ran 3-4x slower so). */
#define KN_UNROLL _Pragma("GCC unroll 16")

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KN_VL 16
typedef __m512 kn_vf;
KN_ALWAYS_INLINE kn_vf kn_vzero(void)
{
    return _mm512_setzero_ps();
}
KN_ALWAYS_INLINE kn_vf kn_vset1(float a)
{
    return _mm512_set1_ps(a);
}
KN_ALWAYS_INLINE kn_vf kn_vload(const float *p)
{
    return _mm512_loadu_ps(p);
}
KN_ALWAYS_INLINE void kn_vstore(float *p, kn_vf a)
{
    _mm512_storeu_ps(p, a);
}
KN_ALWAYS_INLINE kn_vf kn_vadd(kn_vf a, kn_vf b)
{
    return _mm512_add_ps(a, b);
}
KN_ALWAYS_INLINE kn_vf kn_vmul(kn_vf a, kn_vf b)
{
    return _mm512_mul_ps(a, b);
}
KN_ALWAYS_INLINE kn_vf kn_vfma(kn_vf a, kn_vf b, kn_vf c)
{
    return _mm512_fmadd_ps(a, b, c);
}
KN_ALWAYS_INLINE float kn_vsum(kn_vf a)
{
    return _mm512_reduce_add_ps(a);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KN_VL 8
typedef __m256 kn_vf;
KN_ALWAYS_INLINE kn_vf kn_vzero(void)
{
    return _mm256_setzero_ps();
}
KN_ALWAYS_INLINE kn_vf kn_vset1(float a)
{
    return _mm256_set1_ps(a);
}
KN_ALWAYS_INLINE kn_vf kn_vload(const float *p)
{
    return _mm256_loadu_ps(p);
}
KN_ALWAYS_INLINE void kn_vstore(float *p, kn_vf a)
{
    _mm256_storeu_ps(p, a);
}
KN_ALWAYS_INLINE kn_vf kn_vadd(kn_vf a, kn_vf b)
{
    return _mm256_add_ps(a, b);
}
KN_ALWAYS_INLINE kn_vf kn_vmul(kn_vf a, kn_vf b)
{
    return _mm256_mul_ps(a, b);
}
KN_ALWAYS_INLINE kn_vf kn_vfma(kn_vf a, kn_vf b, kn_vf c)
{
    return _mm256_fmadd_ps(a, b, c);
}
KN_ALWAYS_INLINE float kn_vsum(kn_vf a)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
#define KN_VL 1
typedef float kn_vf;
KN_ALWAYS_INLINE kn_vf kn_vzero(void)
{
    return 0.0f;
}
KN_ALWAYS_INLINE kn_vf kn_vset1(float a)
{
    return a;
}
KN_ALWAYS_INLINE kn_vf kn_vload(const float *p)
{
    return *p;
}
KN_ALWAYS_INLINE void kn_vstore(float *p, kn_vf a)
{
    *p = a;
}
KN_ALWAYS_INLINE kn_vf kn_vadd(kn_vf a, kn_vf b)
{
    return a + b;
}
KN_ALWAYS_INLINE kn_vf kn_vmul(kn_vf a, kn_vf b)
{
    return a * b;
}
KN_ALWAYS_INLINE kn_vf kn_vfma(kn_vf a, kn_vf b, kn_vf c)
{
    return a * b + c;
}
KN_ALWAYS_INLINE float kn_vsum(kn_vf a)
{
    return a;
}
#endif

#define KN_NV (TD_QK / KN_VL) /* vectors per quantized block */

/* Logs "op: weight type X not supported" the first time it sees type t (cpu_quant.c). */
void kn_cpu_log_unsupported(td_dtype t, const char *op);

/* Stops the compiler from fusing a product with the following add (gnu11 defaults to
 * -ffp-contract=fast): the dequantizers must round q * d before adding m, as ggml's
 * reference and numpy do. */
#define KN_NO_CONTRACT(v) __asm__("" : "+x"(v))

/* a * b + c, always fused where FMA exists: scalar code must round the same way whether
 * the compiler vectorizes it or not, so results do not depend on how rows are grouped. */
KN_ALWAYS_INLINE float kn_fmaf(float a, float b, float c)
{
#if defined(__FMA__)
    return __builtin_fmaf(a, b, c);
#else
    float p = a * b;
    KN_NO_CONTRACT(p);
    return p + c;
#endif
}

/* fp16 scale stored at p (any alignment) as float. */
KN_ALWAYS_INLINE float kn_h2f(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return td_fp16_to_fp32(h);
#endif
}

/* Bytes per block of the block-quantized types. */
KN_ALWAYS_INLINE size_t kn_q_block_bytes(td_dtype t)
{
    switch (t) {
    case TD_Q8_0:
        return sizeof(td_block_q8_0);
    case TD_Q4_0:
        return sizeof(td_block_q4_0);
    case TD_Q4_1:
        return sizeof(td_block_q4_1);
    case TD_Q5_0:
        return sizeof(td_block_q5_0);
    case TD_IQ4_NL:
        return 18;
    default:
        return sizeof(td_block_q5_1);
    }
}

/* True for the types with a min m (weight = q * d + m). */
KN_ALWAYS_INLINE int kn_q_has_min(td_dtype t)
{
    return t == TD_Q4_1 || t == TD_Q5_1;
}

KN_ALWAYS_INLINE int kn_q_is_q5(td_dtype t)
{
    return t == TD_Q5_0 || t == TD_Q5_1;
}

/* Offset of the quants (qs) inside a block; Q5_0/Q5_1 keep qh in the 4 bytes before. */
KN_ALWAYS_INLINE size_t kn_q_quant_offset(td_dtype t)
{
    return (kn_q_has_min(t) ? 4 : 2) + (kn_q_is_q5(t) ? 4 : 0);
}

/* The 32 high bits of a Q5_0/Q5_1 block at blk. */
KN_ALWAYS_INLINE uint32_t kn_q5_qh(td_dtype t, const uint8_t *blk)
{
    uint32_t qh;
    memcpy(&qh, blk + kn_q_quant_offset(t) - 4, 4);
    return qh;
}

/* IQ4_NL's 16 non-linear levels (ggml's kvalues_iq4nl, gguf.quants.IQ4_NL.kvalues); IQ4_XS
 * shares them. */
#define KN_IQ4NL_VALUES -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113

/* q (KN_NV vectors) = the 32 levels the nibbles of qs[16] pick (element i < 16: low nibble
 * of qs[i], 16 + i: its high nibble), as floats. */
KN_ALWAYS_INLINE void kn_nl_load(const uint8_t *qs, kn_vf q[KN_NV])
{
#if KN_VL == 16
    /* vpermps reads only the low 4 bits of each index */
    static const float lv[16] = {KN_IQ4NL_VALUES};
    const __m512 tbl = _mm512_loadu_ps(lv);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    q[0] = _mm512_permutexvar_ps(v, tbl);
    q[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tbl);
#elif KN_VL == 8
    /* pshufb looks the nibbles up as int8 levels */
    static const int8_t lv[16] = {KN_IQ4NL_VALUES};
    const __m128i tbl = _mm_loadu_si128((const __m128i *)lv), m4 = _mm_set1_epi8(0x0f);
    const __m128i v = _mm_loadu_si128((const __m128i *)qs);
    const __m128i lo = _mm_shuffle_epi8(tbl, _mm_and_si128(v, m4));
    const __m128i hi = _mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(v, 4), m4));
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
#else
    static const int8_t tbl[16] = {KN_IQ4NL_VALUES};
    for (int k = 0; k < TD_QK / 2; k++) {
        q[k] = (float)tbl[qs[k] & 0x0f];
        q[k + TD_QK / 2] = (float)tbl[qs[k] >> 4];
    }
#endif
}

/* q (KN_NV vectors) = the 32 quants of the block at blk as unscaled floats (see the
 * header comment). */
KN_ALWAYS_INLINE void kn_q_load(td_dtype t, const uint8_t *blk, kn_vf q[KN_NV])
{
    const uint8_t *qs = blk + kn_q_quant_offset(t);
    if (t == TD_IQ4_NL) {
        kn_nl_load(qs, q);
        return;
    }
#if KN_VL == 16
    if (t == TD_Q8_0) {
        q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs)));
        q[1] =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))));
        return;
    }
    /* a 16-entry table lookup turns nibbles into floats: vpermps reads only the low 4 bits
     * of each index, so the low nibbles need no mask and the high ones one shift; the 5th
     * bit of Q5_0/Q5_1 then adds 16 under a mask taken straight from qh */
    const __m512 tbl =
        t == TD_Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
        : t == TD_Q5_0
            ? _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1)
            : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    q[0] = _mm512_permutexvar_ps(v, tbl);
    q[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tbl);
    if (kn_q_is_q5(t)) {
        const uint32_t qh = kn_q5_qh(t, blk);
        const __m512 c16 = _mm512_set1_ps(16.0f);
        q[0] = _mm512_mask_add_ps(q[0], (__mmask16)qh, q[0], c16);
        q[1] = _mm512_mask_add_ps(q[1], (__mmask16)(qh >> 16), q[1], c16);
    }
#elif KN_VL == 8
    if (t == TD_Q8_0) {
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * k))));
        return;
    }
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i v = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    if (kn_q_is_q5(t)) {
        /* all 32 quants as bytes: nibbles plus the 5th bit, spread from qh by one byte
         * shuffle (lane i reads qh byte i / 8) and one bit test per lane; Q5_0 folds its
         * -16 into the same add (+0 where the bit is set, -16 where it is not) */
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
        const __m256i sel = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                             2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        __m256i hb = _mm256_shuffle_epi8(_mm256_set1_epi32((int)kn_q5_qh(t, blk)), sel);
        hb = _mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit);
        hb = t == TD_Q5_0 ? _mm256_andnot_si256(hb, _mm256_set1_epi8(-16))
                          : _mm256_and_si256(hb, _mm256_set1_epi8(16));
        const __m256i b = _mm256_add_epi8(_mm256_set_m128i(hi, lo), hb);
        lo = _mm256_castsi256_si128(b);
        hi = _mm256_extracti128_si256(b, 1);
    } else if (t == TD_Q4_0) {
        lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
        hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    }
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
#else
    if (t == TD_Q8_0) {
        for (int k = 0; k < TD_QK; k++)
            q[k] = (float)(int8_t)qs[k];
        return;
    }
    const int off = t == TD_Q4_0 ? 8 : t == TD_Q5_0 ? 16 : 0;
    const uint32_t qh = kn_q_is_q5(t) ? kn_q5_qh(t, blk) : 0;
    for (int k = 0; k < TD_QK / 2; k++) {
        const int h0 = (int)((qh >> k) & 1) << 4, h1 = (int)((qh >> (k + 16)) & 1) << 4;
        q[k] = (float)(((qs[k] & 0x0f) | h0) - off);
        q[k + TD_QK / 2] = (float)(((qs[k] >> 4) | h1) - off);
    }
#endif
}

/* One weight of a float-like type at p (any alignment). */
KN_ALWAYS_INLINE float kn_f_load1(td_dtype t, const uint8_t *p)
{
    if (t == TD_F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    return t == TD_F16 ? td_fp16_to_fp32(h) : td_bf16_to_fp32(h);
}

/* KN_VL weights of a float-like type (F32, F16, BF16) at p as floats. */
KN_ALWAYS_INLINE kn_vf kn_f_load(td_dtype t, const uint8_t *p)
{
#if KN_VL == 16
    if (t == TD_F32) return _mm512_loadu_ps(p);
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (t == TD_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif KN_VL == 8
    if (t == TD_F32) return _mm256_loadu_ps((const float *)(const void *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (t == TD_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
    return kn_f_load1(t, p);
#endif
}

#endif
