/* cpu_q8kgemm.c: the q8 mode's integer GEMM for the K-quant weights people download most
 * (Q4_K, Q6_K: the Q4_K_M files), for the gemm path's batch rows (prefill chunks); AVX512-VNNI
 * only (elsewhere those rows keep dequantize + sgemm). See cpu_q8act.h for the contract.
 *
 * Why: prefill of Q4_K/Q6_K matrices dequantized W to float32 slices for sgemm, bound by the
 * float32 FMA rate, while the 32-block types ran integer dots at several times that rate
 * (BENCHMARKS.md, "8-bit activations"); the 0.5B and 1.5B models are mostly K-quants.
 *
 * How: per group of 16 rows of W, each 32-column sub-block is unpacked once per call into a
 * panel in the thread's scratch, then up to four rows of x (quantized to kn_q8b 32-blocks)
 * at a time run against it with vpdpbusd (cpu_q8vnni.h):
 *  - Q4_K: w = (d sc) q - (dmin mn) per sub-block of 32, q in [0, 16): exactly Q4_1's form
 *    with d_r = d * sc and min_r = -(dmin * mn), so the panel is the 32-block GEMM's Q4_1
 *    panel and its microkernel runs unchanged:
 *      acc = fma((float)dot(q, xq), d_r * xd, acc);  acc = fma(min_r, xd * xsum, acc)
 *  - Q6_K: w = d sc_g (q - 32) per group g of 16, q in [0, 64). A sub-block of 32 holds two
 *    groups; their dots are kept apart (vectors 0-3 of the panel hold columns 0-15, 4-7
 *    columns 16-31) and combined exactly in integers:
 *      s   = sc_a (dot_a - 32 xsum16) + sc_b (dot_b - 32 (xsum - xsum16))   (|s| < 2^24)
 *      acc = fma((float)s, d * xd, acc)
 * in sub-block order; y = acc. Every operation is elementwise in (row of W, row of x), so a
 * row's result does not depend on m, the other rows or the thread split (as the 32-block
 * GEMM's); it differs from the dot path's kn_q8k rows (x quantized per 256, not per 32),
 * which the batch rows of the gemm path are allowed to (kn_backend.h, matmul_mixed).
 */
#include <stdint.h>

#include "cpu_kquant_internal.h"
#include "cpu_q8act.h"
#include "cpu_q8vnni.h"

#define Q4K_BYTES 144 /* d, dmin (f16), scales[12], qs[128] */
#define Q6K_BYTES 210 /* ql[128], qh[64], scales[16] (int8), d (f16) */
#define Q6K_PANEL 704 /* per sub-block: 8 quant vectors, d, sc_a, sc_b (64 bytes each) */

bool kn_q8k_gemm_supported(const kn_mat *w)
{
    return (w->type == TD_Q4_K || w->type == TD_Q6_K) && w->n_cols % KN_QK_K == 0 &&
           w->row_stride <= INT32_MAX / 16 && kn_q8_gemm_group_rows() == 16;
}

size_t kn_q8k_gemm_panel_bytes(int64_t n_cols)
{
    return (size_t)(n_cols / TD_QK) * Q6K_PANEL;
}

/* The panel of 16 rows (rows at w + idx[r]) of nsb Q4_K super-blocks, in Q4_1's layout. */
Q8G_I512 void pack_q4k(const uint8_t *w, const int32_t *idx, int64_t nsb, uint8_t *panel)
{
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *p = w + (size_t)s * Q4K_BYTES;
        float dv[8][16], mv[8][16];
        for (int r = 0; r < 16; r++) {
            const uint8_t *b = p + idx[r];
            const float d = kn_h2f(b), dmin = kn_h2f(b + 2);
            int sc[8], mn[8];
            kn_kq_scale_min(b + 4, sc, mn);
            for (int c = 0; c < 8; c++) {
                dv[c][r] = d * (float)sc[c];
                mv[c][r] = -(dmin * (float)mn[c]);
            }
        }
        /* qs byte i of pair q: column i of sub-block 2q (low nibble) and of 2q + 1 (high) */
        for (int q = 0; q < 4; q++) {
            __m512i T[8];
            tr16(p, idx, 16 + 32 * q, T);
            tr16(p, idx, 32 + 32 * q, T + 4);
            uint8_t *lo = panel + (size_t)(8 * s + 2 * q) * Q8G_PANEL_BLOCK,
                    *hi = lo + Q8G_PANEL_BLOCK;
            KN_UNROLL
            for (int u = 0; u < 8; u++) {
                _mm512_storeu_si512(lo + 64 * u, _mm512_and_si512(T[u], m4));
                _mm512_storeu_si512(hi + 64 * u, _mm512_and_si512(_mm512_srli_epi32(T[u], 4), m4));
            }
            memcpy(lo + Q8G_PANEL_D, dv[2 * q], 64);
            memcpy(lo + Q8G_PANEL_MIN, mv[2 * q], 64);
            memcpy(hi + Q8G_PANEL_D, dv[2 * q + 1], 64);
            memcpy(hi + Q8G_PANEL_MIN, mv[2 * q + 1], 64);
        }
    }
}

/* The panel of 16 rows of nsb Q6_K super-blocks: per sub-block of 32 the unsigned 6-bit
 * quants, d, and the int8 scales of its two groups of 16 as int32 lanes. */
Q8G_I512 void pack_q6k(const uint8_t *w, const int32_t *idx, int64_t nsb, uint8_t *panel)
{
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(3);
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *p = w + (size_t)s * Q6K_BYTES;
        float d[16];
        int32_t sc[16][16]; /* [group][row] */
        for (int r = 0; r < 16; r++) {
            const uint8_t *b = p + idx[r];
            d[r] = kn_h2f(b + 208);
            for (int g = 0; g < 16; g++)
                sc[g][r] = (int8_t)b[192 + g];
        }
        /* half h: column l of sub-block 4h + k from ql[64h + l + 32 (k & 1)] (low nibble for
         * k < 2, high for k >= 2) and bits 2k..2k+1 of qh[32h + l] (gguf's Q6_K layout) */
        for (int h = 0; h < 2; h++) {
            __m512i A[8], B[8], H[8];
            tr16(p, idx, 64 * h, A);
            tr16(p, idx, 64 * h + 16, A + 4);
            tr16(p, idx, 64 * h + 32, B);
            tr16(p, idx, 64 * h + 48, B + 4);
            tr16(p, idx, 128 + 32 * h, H);
            tr16(p, idx, 128 + 32 * h + 16, H + 4);
            for (int k = 0; k < 4; k++) {
                const int j = 4 * h + k;
                uint8_t *o = panel + (size_t)(8 * s + j) * Q6K_PANEL;
                KN_UNROLL
                for (int u = 0; u < 8; u++) {
                    const __m512i l = k & 1 ? B[u] : A[u];
                    const __m512i lo = _mm512_and_si512(k < 2 ? l : _mm512_srli_epi32(l, 4), m4);
                    const __m512i hb = _mm512_and_si512(_mm512_srli_epi32(H[u], 2 * k), m2);
                    _mm512_storeu_si512(o + 64 * u, _mm512_or_si512(lo, _mm512_slli_epi32(hb, 4)));
                }
                memcpy(o + 512, d, 64);
                memcpy(o + 576, sc[2 * j], 64);
                memcpy(o + 640, sc[2 * j + 1], 64);
            }
        }
    }
}

/* y[j * ldy + r] for j < M, r < nr: the Q6_K panel against M rows of x (xs blocks apart). */
Q8G_I512 void tile_q6k(int M, const uint8_t *panel, const kn_q8b *xb, int64_t xs, int64_t nb,
                       float *y, int64_t ldy, int nr)
{
    __m512 acc[4];
    KN_UNROLL
    for (int j = 0; j < M; j++)
        acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = panel + (size_t)b * Q6K_PANEL;
        __m512i ia[4], ib[4];
        KN_UNROLL
        for (int j = 0; j < M; j++)
            ia[j] = ib[j] = _mm512_setzero_si512();
        KN_UNROLL
        for (int u = 0; u < 8; u++) {
            const __m512i v = _mm512_loadu_si512(o + 64 * u);
            KN_UNROLL
            for (int j = 0; j < M; j++) {
                int32_t xd4;
                memcpy(&xd4, xb[j * xs + b].qs + 4 * u, 4);
                if (u < 4)
                    ia[j] = _mm512_dpbusd_epi32(ia[j], v, _mm512_set1_epi32(xd4));
                else
                    ib[j] = _mm512_dpbusd_epi32(ib[j], v, _mm512_set1_epi32(xd4));
            }
        }
        const __m512 dv = _mm512_loadu_ps(o + 512);
        const __m512i sa = _mm512_loadu_si512(o + 576), sb = _mm512_loadu_si512(o + 640);
        KN_UNROLL
        for (int j = 0; j < M; j++) {
            const kn_q8b *x = &xb[j * xs + b];
            const __m512i ta = _mm512_sub_epi32(ia[j], _mm512_set1_epi32(32 * x->sum16));
            const __m512i tb = _mm512_sub_epi32(ib[j], _mm512_set1_epi32(32 * (x->sum - x->sum16)));
            const __m512i s =
                _mm512_add_epi32(_mm512_mullo_epi32(sa, ta), _mm512_mullo_epi32(sb, tb));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(x->d)),
                                     acc[j]);
        }
    }
    const __mmask16 k = (__mmask16)((1u << nr) - 1);
    KN_UNROLL
    for (int j = 0; j < M; j++)
        _mm512_mask_storeu_ps(y + j * ldy, k, acc[j]);
}

Q8G_I512 void rows_q6k(const uint8_t *panel, const kn_q8b *xq, int64_t m, int64_t nb, float *y,
                       int64_t ldy, int nr)
{
    int64_t i = 0;
    for (; i + 4 <= m; i += 4)
        tile_q6k(4, panel, xq + i * nb, nb, nb, y + i * ldy, ldy, nr);
    switch (m - i) {
    case 3:
        tile_q6k(3, panel, xq + i * nb, nb, nb, y + i * ldy, ldy, nr);
        break;
    case 2:
        tile_q6k(2, panel, xq + i * nb, nb, nb, y + i * ldy, ldy, nr);
        break;
    case 1:
        tile_q6k(1, panel, xq + i * nb, nb, nb, y + i * ldy, ldy, nr);
        break;
    default:
        break;
    }
}

static Q8G_T512 void kgemm512(const kn_mat *w, const kn_q8b *xq, int64_t m, float *y, int64_t ldy,
                              int64_t g0, int64_t g1, uint8_t *panel)
{
    const int64_t nb = w->n_cols / TD_QK, nsb = w->n_cols / KN_QK_K;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t r0 = 16 * g;
        const int nr = (int)(w->n_rows - r0 < 16 ? w->n_rows - r0 : 16);
        int32_t idx[16]; /* rows past the end repeat the last one (never stored) */
        for (int r = 0; r < 16; r++)
            idx[r] = (int32_t)((r < nr ? r : nr - 1) * (int64_t)w->row_stride);
        const uint8_t *src = (const uint8_t *)w->data + (size_t)r0 * w->row_stride;
        if (w->type == TD_Q4_K) {
            pack_q4k(src, idx, nsb, panel);
            rows512(TD_Q4_1, panel, xq, m, nb, y + r0, ldy, nr);
        } else {
            pack_q6k(src, idx, nsb, panel);
            rows_q6k(panel, xq, m, nb, y + r0, ldy, nr);
        }
    }
}

void kn_q8k_gemm(const kn_mat *w, const void *xq, int64_t m, float *y, int64_t ldy, int64_t g0,
                 int64_t g1, void *panel)
{
    kgemm512(w, xq, m, y, ldy, g0, g1, panel);
}
