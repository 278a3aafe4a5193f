/* cpu_q8vnni.h: the AVX512-VNNI core of the q8 mode's integer GEMMs, shared by the 32-block
 * GEMM (cpu_q8gemm.c), the K-quant GEMM (cpu_q8kgemm.c) and the q16 mode's dots
 * (cpu_q16act.c): the 4x4 dword transpose that turns 16 rows of W into vectors of 16 lanes,
 * Q5_0's fifth bits spread to bytes, and the microkernel over a panel in the 32-block
 * layout (per block of 32 columns: 8 vectors of 16 int32 lanes, lane r of vector t holding
 * elements 4t..4t+3 of row r as unsigned bytes, then 16 float d and 16 float mins), against
 * up to four rows of x quantized to kn_q8b blocks. cpu_q8gemm.c's header comment gives the
 * arithmetic and why a row's result does not depend on the tile it falls in.
 * A private header (static inline functions only, compiled for VNNI by their target attribute).
 */
#ifndef KN_CPU_Q8VNNI_H
#define KN_CPU_Q8VNNI_H
#include <immintrin.h>
#include <string.h>

#include "cpu_q8act.h"
#include "cpu_quant.h"

#define Q8G_T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define Q8G_I512 static inline __attribute__((always_inline)) Q8G_T512

/* The group of G rows of W from row r0 as byte offsets from row r0 (idx[0..G)) for the
 * transposes; rows past W's end repeat its last row (their lanes are never stored). Returns
 * the group's real rows, 1..G. (Plain C: the AVX2 path's groups of 8 use it too.) */
KN_ALWAYS_INLINE int q8g_group_idx(const kn_mat *w, int64_t r0, int G, int32_t *idx)
{
    const int nr = (int)(w->n_rows - r0 < G ? w->n_rows - r0 : G);
    for (int r = 0; r < G; r++)
        idx[r] = (int32_t)((r < nr ? r : nr - 1) * (int64_t)w->row_stride);
    return nr;
}

/* Bytes of one block of the panel (tile512's layout): 8 quant vectors, then d at
 * Q8G_PANEL_D and the mins at Q8G_PANEL_MIN (16 floats each). */
#define Q8G_PANEL_BLOCK (10 * 64)
#define Q8G_PANEL_D     512
#define Q8G_PANEL_MIN   576

/* Bias added to the quants in the panel (subtracted again through the x block sums). */
KN_ALWAYS_INLINE int q8g_bias(td_dtype t, bool vnni)
{
    return t == TD_Q4_0 ? 8 : t == TD_Q5_0 ? 16 : t == TD_Q8_0 && vnni ? 128 : 0;
}

/* Bits 0..3 of each lane of v to bit 4 of bytes 0..3 (Q5_0's fifth bits). */
Q8G_I512 __m512i spread16(__m512i v)
{
    v = _mm512_mullo_epi32(_mm512_and_si512(v, _mm512_set1_epi32(15)), _mm512_set1_epi32(0x204081));
    return _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x01010101)), 4);
}

/* T[u] lane r = dword u of the 16 bytes at p + off of row r (rows at p + idx[r]). */
Q8G_I512 void tr16(const uint8_t *p, const int32_t *idx, int off, __m512i T[4])
{
    __m512i Z[4];
    for (int k = 0; k < 4; k++) {
        __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const void *)(p + idx[k] + off)));
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const void *)(p + idx[4 + k] + off)), 1);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const void *)(p + idx[8 + k] + off)), 2);
        Z[k] = _mm512_inserti32x4(z, _mm_loadu_si128((const void *)(p + idx[12 + k] + off)), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(Z[0], Z[1]), t1 = _mm512_unpacklo_epi32(Z[2], Z[3]);
    const __m512i t2 = _mm512_unpackhi_epi32(Z[0], Z[1]), t3 = _mm512_unpackhi_epi32(Z[2], Z[3]);
    T[0] = _mm512_unpacklo_epi64(t0, t1);
    T[1] = _mm512_unpackhi_epi64(t0, t1);
    T[2] = _mm512_unpacklo_epi64(t2, t3);
    T[3] = _mm512_unpackhi_epi64(t2, t3);
}

/* One block of 16 rows of W (the 8 quant vectors V, d and the mins mv as pack512 leaves them)
 * against M rows of x (xs blocks apart): the exact integer dots, then the lane-wise float
 * update of each acc[j]. Every kernel of the VNNI path goes through here, so they share bits. */
Q8G_I512 void block512(td_dtype t, int M, const __m512i V[8], __m512 dv, __m512 mv,
                       const kn_q8b *xb, int64_t xs, int64_t b, __m512 acc[4])
{
    const int bias = q8g_bias(t, true);
    __m512i ia[4];
    KN_UNROLL
    for (int j = 0; j < M; j++)
        ia[j] = _mm512_setzero_si512();
    KN_UNROLL
    for (int u = 0; u < 8; u++) {
        KN_UNROLL
        for (int j = 0; j < M; j++) {
            int32_t xd4;
            memcpy(&xd4, xb[j * xs + b].qs + 4 * u, 4);
            ia[j] = _mm512_dpbusd_epi32(ia[j], V[u], _mm512_set1_epi32(xd4));
        }
    }
    KN_UNROLL
    for (int j = 0; j < M; j++) {
        const kn_q8b *x = &xb[j * xs + b];
        if (bias) ia[j] = _mm512_sub_epi32(ia[j], _mm512_set1_epi32(bias * x->sum));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[j]), _mm512_mul_ps(dv, _mm512_set1_ps(x->d)),
                                 acc[j]);
        if (t == TD_Q4_1)
            acc[j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x->d * (float)x->sum), acc[j]);
    }
}

/* y[j * ldy + r] for j < M, r < nr: the panel against M rows of x (xs blocks apart). */
Q8G_I512 void tile512(td_dtype t, int M, const uint8_t *panel, const kn_q8b *xb, int64_t xs,
                      int64_t nb, float *y, int64_t ldy, int nr)
{
    __m512 acc[4];
    KN_UNROLL
    for (int j = 0; j < M; j++)
        acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = panel + (size_t)b * Q8G_PANEL_BLOCK;
        __m512i V[8];
        KN_UNROLL
        for (int u = 0; u < 8; u++)
            V[u] = _mm512_loadu_si512(o + 64 * u);
        const __m512 mv = t == TD_Q4_1 ? _mm512_loadu_ps(o + Q8G_PANEL_MIN) : _mm512_setzero_ps();
        block512(t, M, V, _mm512_loadu_ps(o + Q8G_PANEL_D), mv, xb, xs, b, acc);
    }
    const __mmask16 k = (__mmask16)((1u << nr) - 1);
    KN_UNROLL
    for (int j = 0; j < M; j++)
        _mm512_mask_storeu_ps(y + j * ldy, k, acc[j]);
}

Q8G_I512 void rows512(td_dtype t, const uint8_t *panel, const kn_q8b *xq, int64_t m, int64_t nb,
                      float *y, int64_t ldy, int nr)
{
    int64_t i = 0;
    for (; i + 4 <= m; i += 4)
        tile512(t, 4, panel, xq + i * nb, nb, nb, y + i * ldy, ldy, nr);
    switch (m - i) {
    case 3:
        tile512(t, 3, panel, xq + i * nb, nb, nb, y + i * ldy, ldy, nr);
        break;
    case 2:
        tile512(t, 2, panel, xq + i * nb, nb, nb, y + i * ldy, ldy, nr);
        break;
    case 1:
        tile512(t, 1, panel, xq + i * nb, nb, nb, y + i * ldy, ldy, nr);
        break;
    default:
        break;
    }
}

#endif
