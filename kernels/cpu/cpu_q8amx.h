/* cpu_q8amx.h: the AMX-INT8 form of the q8 mode's integer GEMMs (cpu_q8gemm.c, cpu_q8kgemm.c)
 * for many rows of x: the tile configuration and the microkernel that runs a panel of 16 rows
 * of W (cpu_q8vnni.h's 32-block layout) against the rows of x, 16 at a time.
 *
 * Why: the panel's block (8 vectors of 16 int32 lanes, lane r of vector t = elements 4t..4t+3
 * of row r) is AMX's B tile for K = 32 as it is, and 16 rows of x's kn_q8b blocks for one block
 * column are an A tile (16 rows of 32 signed bytes, one row of x every nb blocks). With the
 * panel's bias taken out of its bytes once per group (q8a_unbias), one tdpbssd gives the 16 x 16
 * exact int32 dots that block512 gets from 8 vpdpbusd and a subtraction per row of x; the float
 * part (cvt, fma with d_r * xd_j, Q4_1's min) then runs per row of x on the lanes exactly as
 * block512 runs it, in block order, so the bits are the VNNI path's.
 * Tiles: tmm0/tmm3 A (up to 16 rows x 32 bytes), tmm1/tmm4 B (8 x 64 bytes), tmm2/tmm5 C
 * (rows x 64 bytes): two sets, so the dots of block b + 1 are issued before the float part of
 * block b reads its C (stored to the stack: the float part needs vectors).
 * What bounds it: the float part, per block of 32 columns and per row of x (the bits demand it:
 * one fma per block with d_r * xd_j rounded), 3 vector ops per 16 lanes, and the tile store it
 * reads through; the AMX unit's part of a block (A, B, dots, store C: about 11 ns measured) and
 * the float part (about as long) overlap little. So AMX gains 1.1-1.6x over VNNI at m = 512
 * (tests/kernels/bench_q8amx.c on Qwen2.5-0.5B's and SmolLM2-135M's shapes), not the 8x of
 * its dot rate.
 * Invariants: callers run these only where kn_q8_gemm_amx() holds (AMX-TILE, AMX-INT8, the OS's
 * permission granted); every caller loads a configuration before its first tile op and calls
 * _tile_release before it returns, so a thread leaves no tile state behind.
 * A private header (static inline functions only, compiled for AMX by their target attribute).
 */
#ifndef KN_CPU_Q8AMX_H
#define KN_CPU_Q8AMX_H
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#include "cpu_q8act.h"
#include "cpu_q8vnni.h"

#define Q8G_TAMX                                                                                   \
    __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,"       \
                          "f16c")))
#define Q8G_IAMX static inline __attribute__((always_inline)) Q8G_TAMX

/* Panels of 16 rows of W that one pass over the tiles of x runs against (q8a_rows): as many as
 * fit Q8A_PANELS_BYTES (the rest of L2 keeps x's tiles), 1 to Q8A_GROUPS_MAX. More panels per
 * pass write y in longer runs per row: Q4_1 4864 x 896 at m 512 ran at 0.94x VNNI with 4, 1.44x
 * with 8. q8a_groups: the panels per pass for panels of pstride bytes. */
#define Q8A_GROUPS_MAX   8
#define Q8A_PANELS_BYTES ((size_t)512 << 10)

KN_ALWAYS_INLINE int q8a_groups(size_t pstride)
{
    const size_t g = Q8A_PANELS_BYTES / pstride;
    return g < 1 ? 1 : g > Q8A_GROUPS_MAX ? Q8A_GROUPS_MAX : (int)g;
}

/* Smallest m (rows of x) that takes AMX. A tile of x costs the same at 1 row as at 16, so below
 * 16 rows VNNI wins and a partial last tile weighs on the next few m: Q4_0 4864 x 896, 1 thread,
 * AMX against VNNI: m 8 0.73x, 16 1.10x, 17 0.88x, 20 0.89x, 24 1.04x, 32 1.36x. */
#define Q8A_MIN_M 24

/* The tile registers' shapes (ldtilecfg's 64 bytes, palette 1). */
typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16]; /* bytes per row of tmm0..tmm15 */
    uint8_t rows[16];   /* rows of tmm0..tmm15 */
} kn_q8a_cfg;

/* The tile ops are inline asm that tell the compiler they read no memory: a barrier before
 * them makes the stores they read (the panel, the configuration) land first. */
#define Q8A_BARRIER() __asm__ volatile("" ::: "memory")
/* A tile store the compiler sees: without the barriers the C code's loads of dst (the float
 * part's) could be moved across the store's asm, or served from an earlier load of dst. */
#define Q8A_STORE(tile, dst)                                                                       \
    do {                                                                                           \
        Q8A_BARRIER();                                                                             \
        _tile_stored(tile, dst, 64);                                                               \
        Q8A_BARRIER();                                                                             \
    } while (0)

/* Loads the 32-block configuration for mr rows of x (1..16): two sets of A (mr x 32 bytes),
 * B (8 x 64) and C (mr x 64): tmm0-tmm2 and tmm3-tmm5. */
Q8G_IAMX void q8a_config32(int mr)
{
    kn_q8a_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int s = 0; s < 2; s++) {
        c.rows[3 * s] = (uint8_t)mr, c.colsb[3 * s] = 32;
        c.rows[3 * s + 1] = 8, c.colsb[3 * s + 1] = 64;
        c.rows[3 * s + 2] = (uint8_t)mr, c.colsb[3 * s + 2] = 64;
    }
    Q8A_BARRIER();
    _tile_loadconfig(&c);
}

/* The panel's biased quants made signed again, in place (nb blocks): u - bias fits a signed
 * byte (Q4_0 [-8, 7], Q5_0 [-16, 15], Q8_0 the raw q), so tdpbssd gives dot(u, x) - bias * xsum,
 * the integer block512 gets after its subtraction: the float part starts from the same int32
 * without the subtraction. Once per group, against every tile of x. */
Q8G_IAMX void q8a_unbias(td_dtype t, uint8_t *panel, int64_t nb)
{
    const int bias = q8g_bias(t, true);
    if (!bias) return;
    const __m512i bv = _mm512_set1_epi8((char)bias);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *o = panel + (size_t)b * Q8G_PANEL_BLOCK;
        KN_UNROLL
        for (int u = 0; u < 8; u++)
            _mm512_storeu_si512(o + 64 * u, _mm512_sub_epi8(_mm512_loadu_si512(o + 64 * u), bv));
    }
}

/* The exact dots of block blk: A (the rows of x at xb, xs bytes apart) in tile a, B (the
 * panel's block) in tile bt, C in tile c. */
#define Q8A_DOTS(a, bt, c, blk)                                                                    \
    do {                                                                                           \
        _tile_loadd(a, xb[blk].qs, xs);                                                            \
        _tile_loadd(bt, panel + (size_t)(blk)*Q8G_PANEL_BLOCK, 64);                                \
        _tile_zero(c);                                                                             \
        _tile_dpbssd(c, a, bt);                                                                    \
    } while (0)

/* block512's float part for block b: acc[j] from the M rows of dots in cd (16 int32 each);
 * xds: Q4_1's xd_j * xsum_j of block b, j < M (q8a_rows), the same float block512 computes. */
Q8G_IAMX void q8a_epilogue(td_dtype t, int M, const int32_t *cd, const uint8_t *o, const kn_q8b *xb,
                           int64_t nb, int64_t b, const float *xds, __m512 acc[16])
{
    const __m512 dv = _mm512_loadu_ps(o + Q8G_PANEL_D);
    const __m512 mv = t == TD_Q4_1 ? _mm512_loadu_ps(o + Q8G_PANEL_MIN) : _mm512_setzero_ps();
    KN_UNROLL
    for (int j = 0; j < M; j++) {
        const kn_q8b *x = &xb[j * nb + b];
        const __m512i ia = _mm512_load_si512(cd + 16 * j); /* no bias: q8a_unbias */
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(dv, _mm512_set1_ps(x->d)),
                                 acc[j]);
        if (t == TD_Q4_1) acc[j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xds[j]), acc[j]);
    }
}

/* y[j * ldy + r] for j < M, r < nr: the panel against M rows of x (xb, nb blocks each); the
 * configuration loaded for M rows. Two tile sets: the AMX unit runs the dots of block b + 1
 * while the float part reads those of b (stored to cd a step earlier). */
Q8G_IAMX void q8a_tile(td_dtype t, int M, const uint8_t *panel, const kn_q8b *xb, int64_t nb,
                       const float *xds, float *y, int64_t ldy, int nr)
{
    _Alignas(64) int32_t cd[2][256];
    const size_t xs = (size_t)nb * sizeof(kn_q8b);
    __m512 acc[16]; /* all set: the rows past M are never read, but M may not be a constant */
    KN_UNROLL
    for (int j = 0; j < 16; j++)
        acc[j] = _mm512_setzero_ps();
    Q8A_DOTS(0, 1, 2, 0);
    Q8A_STORE(2, cd[0]);
    for (int64_t b = 0; b < nb; b += 2) {
        if (b + 1 < nb) Q8A_DOTS(3, 4, 5, b + 1);
        q8a_epilogue(t, M, cd[0], panel + (size_t)b * Q8G_PANEL_BLOCK, xb, nb, b, xds + 16 * b,
                     acc);
        if (b + 1 >= nb) break;
        Q8A_STORE(5, cd[1]);
        if (b + 2 < nb) Q8A_DOTS(0, 1, 2, b + 2);
        q8a_epilogue(t, M, cd[1], panel + (size_t)(b + 1) * Q8G_PANEL_BLOCK, xb, nb, b + 1,
                     xds + 16 * (b + 1), acc);
        if (b + 2 < nb) Q8A_STORE(2, cd[0]);
    }
    const __mmask16 k = (__mmask16)((1u << nr) - 1);
    KN_UNROLL
    for (int j = 0; j < M; j++)
        _mm512_mask_storeu_ps(y + j * ldy, k, acc[j]);
}

/* rows512 with AMX for ng panels of 16 rows of W (1..Q8A_GROUPS_MAX, pstride bytes apart; the last
 * has nr_last real rows, the others 16) against the m rows of x, 16 at a time, each tile of x
 * against the ng panels in turn: the stores to y of one tile of x go to ng consecutive lines
 * of each row (one panel at a time, the y rows far apart, their store misses stalled the float
 * part, which reads C through memory: Q4_0 4864 x 896 at m 512 ran at 0.75x VNNI). The last
 * tile of x has fewer rows by the configuration (never a row past xq's end). xds: scratch of
 * 16 nb floats (Q4_1 only: xd * xsum per block and row of the tile, computed once for the ng
 * panels). *cfg: the rows the loaded configuration has, 0 for none yet; updated. */
Q8G_IAMX void q8a_rows(td_dtype t, const uint8_t *panels, size_t pstride, int ng, int nr_last,
                       const kn_q8b *xq, int64_t m, int64_t nb, float *y, int64_t ldy, float *xds,
                       int *cfg)
{
    Q8A_BARRIER(); /* the panels' stores before the tile loads */
    for (int64_t i = 0; i < m; i += 16) {
        const int mr = (int)(m - i < 16 ? m - i : 16);
        if (*cfg != mr) {
            q8a_config32(mr);
            *cfg = mr;
        }
        const kn_q8b *xb = xq + i * nb;
        if (t == TD_Q4_1)
            for (int64_t b = 0; b < nb; b++)
                for (int j = 0; j < mr; j++)
                    xds[16 * b + j] = xb[j * nb + b].d * (float)xb[j * nb + b].sum;
        for (int k = 0; k < ng; k++) {
            const uint8_t *panel = panels + (size_t)k * pstride;
            float *yk = y + i * ldy + 16 * k;
            const int nr = k == ng - 1 ? nr_last : 16;
            if (mr == 16)
                q8a_tile(t, 16, panel, xb, nb, xds, yk, ldy, nr);
            else
                q8a_tile(t, mr, panel, xb, nb, xds, yk, ldy, nr);
        }
    }
}

#endif
