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
 * With AMX-INT8 (kn_q8_gemm_amx) the same panels run against tiles of 16 rows of x
 * (cpu_q8amx.h; Q6_K's two groups as two dots of K = 16): the same bits.
 */
#include <stdint.h>

#include "cpu_kquant_internal.h"
#include "cpu_q8act.h"
#include "cpu_q8amx.h"
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
    const size_t nb = (size_t)(n_cols / TD_QK), panel = nb * Q6K_PANEL;
    /* AMX runs q8a_groups panels at once (of at most this size: Q4_K's are smaller), with 16
     * floats per block after them (q8a_rows' xds) */
    return kn_q8_amx_usable() ? (size_t)q8a_groups(panel) * panel + nb * 64 : panel;
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
        int32_t idx[16]; /* rows past the end repeat the last one (never stored) */
        const int nr = q8g_group_idx(w, r0, 16, idx);
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

/* ---- AMX-INT8 (cpu_q8amx.h): the same panels, the same bits ----
 * Q4_K's panel is Q4_1's and takes q8a_rows as it is. Q6_K keeps the dots of its two groups
 * of 16 apart: per block two tdpbssd with K = 16 (the panel made signed, q6a_unbias), A the columns
 * 0-15 (16 bytes of each row of x) against B the panel's vectors 0-3 (4 x 64 bytes), and columns
 * 16-31 against vectors 4-7. Tiles: tmm0/tmm1 A (rows x 16 bytes), tmm2/tmm3 B (4 x 64), tmm4/tmm5
 * and tmm6/tmm7 the C pairs of consecutive blocks. */

/* The panel's quants (q in [0, 64)) made signed, q - 32, in place (nb sub-blocks): tdpbssd then
 * gives dot_a - 32 xsum16 and dot_b - 32 (xsum - xsum16) exactly, tile_q6k's ta and tb. */
Q8G_IAMX void q6a_unbias(uint8_t *panel, int64_t nb)
{
    const __m512i bv = _mm512_set1_epi8(32);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *o = panel + (size_t)b * Q6K_PANEL;
        KN_UNROLL
        for (int u = 0; u < 8; u++)
            _mm512_storeu_si512(o + 64 * u, _mm512_sub_epi8(_mm512_loadu_si512(o + 64 * u), bv));
    }
}

/* Loads the Q6_K configuration for mr rows of x (1..16). */
Q8G_IAMX void q6a_config(int mr)
{
    kn_q8a_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int k = 0; k < 2; k++) {
        c.rows[k] = (uint8_t)mr, c.colsb[k] = 16;
        c.rows[2 + k] = 4, c.colsb[2 + k] = 64;
    }
    for (int k = 4; k < 8; k++)
        c.rows[k] = (uint8_t)mr, c.colsb[k] = 64;
    Q8A_BARRIER();
    _tile_loadconfig(&c);
}

/* The two groups' dots of block b into tiles ca and cb. */
#define Q6A_DOTS(ca, cb, xb, xs, panel, b)                                                         \
    do {                                                                                           \
        const uint8_t *o_ = (panel) + (size_t)(b)*Q6K_PANEL;                                       \
        _tile_loadd(0, (xb)[b].qs, xs);                                                            \
        _tile_loadd(1, (xb)[b].qs + 16, xs);                                                       \
        _tile_loadd(2, o_, 64);                                                                    \
        _tile_loadd(3, o_ + 256, 64);                                                              \
        _tile_zero(ca);                                                                            \
        _tile_zero(cb);                                                                            \
        _tile_dpbssd(ca, 0, 2);                                                                    \
        _tile_dpbssd(cb, 1, 3);                                                                    \
    } while (0)

/* tile_q6k's float part for block b from the dots of its two groups (cd[0], cd[1]). */
Q8G_IAMX void q6a_epilogue(int M, const int32_t (*cd)[256], const uint8_t *o, const kn_q8b *xb,
                           int64_t nb, int64_t b, __m512 acc[16])
{
    /* s = sc_a ta + sc_b tb in float, exactly tile_q6k's (float)s: |ta|, |tb| < 2^16 and
     * |sc| <= 2^7, so both products are exact, and the fma rounds their exact sum once, as
     * the conversion of the exact integer s does (and s is below 2^24 anyway): the same bits,
     * without vpmulld (two uops on one port) */
    const __m512 dv = _mm512_loadu_ps(o + 512);
    const __m512 sa = _mm512_cvtepi32_ps(_mm512_loadu_si512(o + 576)),
                 sb = _mm512_cvtepi32_ps(_mm512_loadu_si512(o + 640));
    KN_UNROLL
    for (int j = 0; j < M; j++) {
        const kn_q8b *x = &xb[j * nb + b];
        /* the offsets are out (q6a_unbias) */
        const __m512 ta = _mm512_cvtepi32_ps(_mm512_load_si512(cd[0] + 16 * j)),
                     tb = _mm512_cvtepi32_ps(_mm512_load_si512(cd[1] + 16 * j));
        const __m512 s = _mm512_fmadd_ps(sa, ta, _mm512_mul_ps(sb, tb));
        acc[j] = _mm512_fmadd_ps(s, _mm512_mul_ps(dv, _mm512_set1_ps(x->d)), acc[j]);
    }
}

/* tile_q6k on AMX: y[j * ldy + r] for j < M, r < nr; the configuration loaded for M rows. */
Q8G_IAMX void q6a_tile(int M, const uint8_t *panel, const kn_q8b *xb, int64_t nb, float *y,
                       int64_t ldy, int nr)
{
    _Alignas(64) int32_t cd[2][2][256];
    const size_t xs = (size_t)nb * sizeof(kn_q8b);
    __m512 acc[16]; /* all set: the rows past M are never read, but M may not be a constant */
    KN_UNROLL
    for (int j = 0; j < 16; j++)
        acc[j] = _mm512_setzero_ps();
    Q6A_DOTS(4, 5, xb, xs, panel, 0); /* stores before the next dots: see q8a_tile */
    for (int64_t b = 0; b < nb; b += 2) {
        Q8A_STORE(4, cd[0][0]);
        Q8A_STORE(5, cd[0][1]);
        if (b + 1 < nb) Q6A_DOTS(6, 7, xb, xs, panel, b + 1);
        q6a_epilogue(M, (const int32_t(*)[256])cd[0], panel + (size_t)b * Q6K_PANEL, xb, nb, b,
                     acc);
        if (b + 1 >= nb) break;
        Q8A_STORE(6, cd[1][0]);
        Q8A_STORE(7, cd[1][1]);
        if (b + 2 < nb) Q6A_DOTS(4, 5, xb, xs, panel, b + 2);
        q6a_epilogue(M, (const int32_t(*)[256])cd[1], panel + (size_t)(b + 1) * Q6K_PANEL, xb, nb,
                     b + 1, acc);
    }
    const __mmask16 k = (__mmask16)((1u << nr) - 1);
    KN_UNROLL
    for (int j = 0; j < M; j++)
        _mm512_mask_storeu_ps(y + j * ldy, k, acc[j]);
}

/* rows_q6k on AMX for ng panels (pstride bytes apart; the last with nr_last real rows), as
 * q8a_rows runs the 32-block panels: each tile of x against the ng panels in turn. */
Q8G_IAMX void q6a_rows(const uint8_t *panels, size_t pstride, int ng, int nr_last, const kn_q8b *xq,
                       int64_t m, int64_t nb, float *y, int64_t ldy, int *cfg)
{
    Q8A_BARRIER(); /* the panels' stores before the tile loads */
    for (int64_t i = 0; i < m; i += 16) {
        const int mr = (int)(m - i < 16 ? m - i : 16);
        if (*cfg != mr) {
            q6a_config(mr);
            *cfg = mr;
        }
        for (int k = 0; k < ng; k++) {
            const uint8_t *panel = panels + (size_t)k * pstride;
            float *yk = y + i * ldy + 16 * k;
            const int nr = k == ng - 1 ? nr_last : 16;
            if (mr == 16)
                q6a_tile(16, panel, xq + i * nb, nb, yk, ldy, nr);
            else
                q6a_tile(mr, panel, xq + i * nb, nb, yk, ldy, nr);
        }
    }
}

static Q8G_TAMX void kgemm_amx(const kn_mat *w, const kn_q8b *xq, int64_t m, float *y, int64_t ldy,
                               int64_t g0, int64_t g1, uint8_t *panel)
{
    const int64_t nb = w->n_cols / TD_QK, nsb = w->n_cols / KN_QK_K;
    const bool q4k = w->type == TD_Q4_K;
    const size_t pstride = (size_t)nb * (q4k ? Q8G_PANEL_BLOCK : Q6K_PANEL);
    /* Q4_K's smaller panels: as many as Q6_K's fit in kn_q8k_gemm_panel_bytes */
    const int G = q8a_groups((size_t)nb * Q6K_PANEL);
    int cfg = 0;
    for (int64_t gb = g0; gb < g1; gb += G) {
        const int ng = (int)(g1 - gb < G ? g1 - gb : G);
        int nr = 16;
        for (int k = 0; k < ng; k++) {
            const int64_t r0 = 16 * (gb + k);
            int32_t idx[16]; /* rows past the end repeat the last one (never stored) */
            nr = q8g_group_idx(w, r0, 16, idx);
            const uint8_t *src = (const uint8_t *)w->data + (size_t)r0 * w->row_stride;
            if (q4k)
                pack_q4k(src, idx, nsb, panel + (size_t)k * pstride);
            else
                pack_q6k(src, idx, nsb, panel + (size_t)k * pstride);
            if (!q4k) q6a_unbias(panel + (size_t)k * pstride, nb);
        }
        if (q4k)
            q8a_rows(TD_Q4_1, panel, pstride, ng, nr, xq, m, nb, y + 16 * gb, ldy,
                     (float *)(void *)(panel + (size_t)G * pstride), &cfg);
        else
            q6a_rows(panel, pstride, ng, nr, xq, m, nb, y + 16 * gb, ldy, &cfg);
    }
    _tile_release();
}

void kn_q8k_gemm(const kn_mat *w, const void *xq, int64_t m, float *y, int64_t ldy, int64_t g0,
                 int64_t g1, void *panel)
{
    if (m >= Q8A_MIN_M && kn_q8_gemm_amx())
        kgemm_amx(w, xq, m, y, ldy, g0, g1, panel);
    else
        kgemm512(w, xq, m, y, ldy, g0, g1, panel);
}
