/* kn_elem.h: the per-element math shared by the CPU and the CUDA code: fp16/bf16 <->
 * fp32, the block dequantizers of the weight types the CUDA backend computes with, silu,
 * tanh-GELU and the rope rotation of one pair.
 *
 * Purpose: one definition of each formula, compiled by the C compiler (static inline) and
 * by nvcc (__host__ __device__), so the GPU kernels dequantize exactly as the CPU does.
 * tests/kernels/test_elem.c checks every dequantizer here bit for bit against the CPU
 * backend's kn_dequant_row on random blocks, and the other helpers against the CPU ops.
 * Invariants: kn_elem_chunk gives the exact values of kn_dequant_row (cpu_quant.c,
 * cpu_kquant.c): products that are not exact (Q4_1/Q5_1's q * d) are rounded before the
 * min is added (kn_elem_mul_rn / kn_elem_add_rn never fuse, on either compiler); the
 * K-quant products are exact in float32 (cpu_kquant.c's "Exactness"), so their order does
 * not matter. Byte loads only: blocks are 18, 20, 22, 34, ... bytes, so their fields have
 * no alignment. Block layouts: td_dtype.h (the 32-weight types) and the top of
 * cpu_kquant.c (Q4_K, Q5_K, Q6_K).
 * Types: F32, F16, BF16 (element-wise), Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (blocks of 32), Q4_K,
 * Q5_K, Q6_K (super-blocks of 256 read as 8 chunks of 32). kn_elem_type_supported says
 * which; the others (IQ4_NL, Q2_K, Q3_K, IQ4_XS, ...) are not here.
 * Threading: pure functions.
 */
#ifndef KN_ELEM_H
#define KN_ELEM_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "td_dtype.h"

#if defined(__CUDACC__)
#define KN_HD static inline __host__ __device__
#else
#define KN_HD static inline
#endif

#define KN_ELEM_QK_K 256 /* weights per K-quant super-block */

/* ---- bits and rounding ---- */

KN_HD float kn_elem_from_bits(uint32_t u)
{
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

KN_HD uint32_t kn_elem_to_bits(float f)
{
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

/* a * b rounded to float, never fused with a following add (gnu11 and nvcc both contract
 * a * b + c into an fma by default). */
KN_HD float kn_elem_mul_rn(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    float p = a * b;
#if defined(__x86_64__) || defined(__i386__)
    __asm__("" : "+x"(p));
#elif defined(__aarch64__)
    __asm__("" : "+w"(p));
#else
    volatile float v = p;
    p = v;
#endif
    return p;
#endif
}

KN_HD float kn_elem_add_rn(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

/* ---- fp16 / bf16 ---- */

/* IEEE half -> float, exact for every input (the algorithm of td_fp16_to_fp32). */
KN_HD float kn_elem_h2f(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0x1f) return kn_elem_from_bits(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        if (mant == 0) return kn_elem_from_bits(sign);
        const float v = (float)mant * (1.0f / 16777216.0f); /* exact: mant * 2^-24 */
        return sign ? -v : v;
    }
    return kn_elem_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
}

/* float -> IEEE half, round to nearest even, overflow to inf, nan stays nan (the
 * algorithm of td_fp32_to_fp16, so a GPU-written F16 KV pool holds the CPU's bits). */
KN_HD uint16_t kn_elem_f2h(float f)
{
    const uint32_t x = kn_elem_to_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000, absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (absx > 0x7f800000u ? 0x200 : 0));
    if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);
    if (absx < 0x38800000u) {
        const float scaled = kn_elem_from_bits(absx) * 16777216.0f; /* exact power of 2 */
        uint32_t m = (uint32_t)scaled;
        const float rem = scaled - (float)m;
        if (rem > 0.5f || (rem == 0.5f && (m & 1))) m++;
        return (uint16_t)(sign | m);
    }
    const uint32_t low = absx & 0x1fff;
    uint32_t h = (((absx >> 23) - 112) << 10) | ((absx >> 13) & 0x3ff);
    if (low > 0x1000 || (low == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

KN_HD float kn_elem_bf2f(uint16_t b)
{
    return kn_elem_from_bits((uint32_t)b << 16);
}

/* Little-endian 16- and 32-bit loads from any alignment. */
KN_HD uint16_t kn_elem_ld16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (unsigned)p[1] << 8);
}

KN_HD uint32_t kn_elem_ld32(const uint8_t *p)
{
    return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* ---- which types, block geometry ---- */

KN_HD bool kn_elem_type_supported(td_dtype t)
{
    switch (t) {
    case TD_F32:
    case TD_F16:
    case TD_BF16:
    case TD_Q8_0:
    case TD_Q4_0:
    case TD_Q4_1:
    case TD_Q5_0:
    case TD_Q5_1:
    case TD_Q4_K:
    case TD_Q5_K:
    case TD_Q6_K:
        return true;
    default:
        return false;
    }
}

/* For messages: the list kn_elem_type_supported accepts. */
#define KN_ELEM_TYPES "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K"

KN_HD bool kn_elem_is_float(td_dtype t)
{
    return t == TD_F32 || t == TD_F16 || t == TD_BF16;
}

KN_HD bool kn_elem_is_k(td_dtype t)
{
    return t == TD_Q4_K || t == TD_Q5_K || t == TD_Q6_K;
}

/* Weights per block: 1 for the float types, 32, or 256 for the K-quants. */
KN_HD int kn_elem_block_len(td_dtype t)
{
    return kn_elem_is_float(t) ? 1 : kn_elem_is_k(t) ? KN_ELEM_QK_K : 32;
}

/* Bytes per block (per element for the float types); 0 for a type not supported here. */
KN_HD int kn_elem_block_bytes(td_dtype t)
{
    switch (t) {
    case TD_F32:
        return 4;
    case TD_F16:
    case TD_BF16:
        return 2;
    case TD_Q8_0:
        return 34;
    case TD_Q4_0:
        return 18;
    case TD_Q4_1:
        return 20;
    case TD_Q5_0:
        return 22;
    case TD_Q5_1:
        return 24;
    case TD_Q4_K:
        return 144;
    case TD_Q5_K:
        return 176;
    case TD_Q6_K:
        return 210;
    default:
        return 0;
    }
}

/* ---- dequantizers ---- */

/* One element of a float type at p. */
KN_HD float kn_elem_float(td_dtype t, const uint8_t *p)
{
    if (t == TD_F32) return kn_elem_from_bits(kn_elem_ld32(p));
    const uint16_t h = kn_elem_ld16(p);
    return t == TD_F16 ? kn_elem_h2f(h) : kn_elem_bf2f(h);
}

/* The 32 weights of a Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 block (td_dtype.h's layouts). */
KN_HD void kn_elem_q32(td_dtype t, const uint8_t *blk, float out[32])
{
    const float d = kn_elem_h2f(kn_elem_ld16(blk));
    if (t == TD_Q8_0) {
        for (int i = 0; i < 32; i++)
            out[i] = (float)(int8_t)blk[2 + i] * d;
        return;
    }
    const bool has_min = t == TD_Q4_1 || t == TD_Q5_1, q5 = t == TD_Q5_0 || t == TD_Q5_1;
    const float mn = has_min ? kn_elem_h2f(kn_elem_ld16(blk + 2)) : 0.0f;
    const int qoff = (has_min ? 4 : 2) + (q5 ? 4 : 0), off = t == TD_Q4_0   ? 8
                                                             : t == TD_Q5_0 ? 16
                                                                            : 0;
    const uint32_t qh = q5 ? kn_elem_ld32(blk + qoff - 4) : 0;
    const uint8_t *qs = blk + qoff;
    for (int i = 0; i < 16; i++) {
        const int h0 = (int)((qh >> i) & 1) << 4, h1 = (int)((qh >> (i + 16)) & 1) << 4;
        const float q0 = (float)(((qs[i] & 0x0f) | h0) - off);
        const float q1 = (float)(((qs[i] >> 4) | h1) - off);
        if (has_min) {
            out[i] = kn_elem_add_rn(kn_elem_mul_rn(q0, d), mn);
            out[i + 16] = kn_elem_add_rn(kn_elem_mul_rn(q1, d), mn);
        } else {
            out[i] = q0 * d;
            out[i + 16] = q1 * d;
        }
    }
}

/* Scale and min (6 bits each) of chunk c of a Q4_K/Q5_K super-block from scales[12]
 * (gguf's get_scale_min). */
KN_HD void kn_elem_k_scale_min(const uint8_t *s, int c, int *sc, int *mn)
{
    if (c < 4) {
        *sc = s[c] & 63;
        *mn = s[c + 4] & 63;
    } else {
        *sc = (s[c + 4] & 0x0f) | ((s[c - 4] >> 6) << 4);
        *mn = (s[c + 4] >> 4) | ((s[c] >> 6) << 4);
    }
}

/* The 32 weights of chunk c (0..7: elements 32 c .. 32 c + 31) of a Q4_K, Q5_K or Q6_K
 * super-block (cpu_kquant.c's layouts). Every product is exact (see the header). */
KN_HD void kn_elem_kchunk(td_dtype t, const uint8_t *blk, int c, float out[32])
{
    if (t == TD_Q6_K) {
        /* ql[128] | qh[64] | scales[16] int8 | d; c = 4 h + k */
        const float d = kn_elem_h2f(kn_elem_ld16(blk + 208));
        const int h = c / 4, k = c % 4;
        const uint8_t *ql = blk + 64 * h + 32 * (k % 2), *qh = blk + 128 + 32 * h;
        for (int l = 0; l < 32; l++) {
            const int q = (((ql[l] >> (4 * (k / 2))) & 15) | ((qh[l] >> (2 * k)) & 3) << 4) - 32;
            const float ds = d * (float)(int8_t)blk[192 + 2 * c + l / 16];
            out[l] = (float)q * ds;
        }
        return;
    }
    /* Q4_K: d | dmin | scales[12] | qs[128]; Q5_K: the same with qh[32] before qs */
    int sc, mn;
    kn_elem_k_scale_min(blk + 4, c, &sc, &mn);
    const float ds = kn_elem_h2f(kn_elem_ld16(blk)) * (float)sc;
    const float dm = kn_elem_h2f(kn_elem_ld16(blk + 2)) * (float)mn;
    const bool q5 = t == TD_Q5_K;
    const uint8_t *qs = blk + (q5 ? 48 : 16) + 32 * (c / 2), *qh = blk + 16;
    for (int l = 0; l < 32; l++) {
        int q = (qs[l] >> (4 * (c % 2))) & 15;
        if (q5) q |= ((qh[l] >> c) & 1) << 4;
        out[l] = kn_elem_add_rn((float)q * ds, -dm);
    }
}

/* The 32 weights of chunk c of the block at blk: the 32-weight types have one chunk (c 0),
 * the K-quants eight. */
KN_HD void kn_elem_chunk(td_dtype t, const uint8_t *blk, int c, float out[32])
{
    if (kn_elem_is_k(t))
        kn_elem_kchunk(t, blk, c, out);
    else
        kn_elem_q32(t, blk, out);
}

/* All kn_elem_block_len(t) weights of the block at blk (t quantized). */
KN_HD void kn_elem_block(td_dtype t, const uint8_t *blk, float *out)
{
    const int nc = kn_elem_block_len(t) / 32;
    for (int c = 0; c < nc; c++)
        kn_elem_chunk(t, blk, c, out + 32 * c);
}

/* ---- activations and rope ---- */

/* silu(x) = x / (1 + e^-x). */
KN_HD float kn_elem_silu(float x)
{
    return x / (1.0f + expf(-x));
}

/* GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
KN_HD float kn_elem_gelu_tanh(float x)
{
    const float c = 0.7978845608028654f;
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

/* cos and sin of theta = pos * freq, formed and evaluated in float64, then rounded (as
 * cpu_ops.c does). */
KN_HD void kn_elem_rope_cs(int32_t pos, float freq, float *c, float *s)
{
    const double theta = (double)pos * (double)freq;
    *c = (float)cos(theta);
    *s = (float)sin(theta);
}

/* Rotate the pair (x0, x1) by (c, s): x0 c - x1 s, x0 s + x1 c, each product rounded
 * before the add (no fma), so host and device give the same bits. */
KN_HD void kn_elem_rope_pair(float *x0, float *x1, float c, float s)
{
    const float a = *x0, b = *x1;
    *x0 = kn_elem_add_rn(kn_elem_mul_rn(a, c), -kn_elem_mul_rn(b, s));
    *x1 = kn_elem_add_rn(kn_elem_mul_rn(a, s), kn_elem_mul_rn(b, c));
}

#endif
