/* cpu_q8kpack.c: K-quant weights (Q4_K, Q6_K) packed once for the q8 mode's decode dot path
 * (kn_q8_dot with a packed copy, cpu_q8act.h), AVX512-VNNI; Q4_K's calls of many rows of x on
 * AMX-INT8 tiles (below).
 *
 * Why: the row-wise dot (cpu_q8act.c) spends most of its instructions on each row's own
 * bookkeeping: a 256-bit load widened to 512 bits per 64 weights, the scales broadcast by a
 * permute, the mins and offsets through scalar sums, a horizontal reduction per row. At batch
 * 1 the 1.5B model's decode ran at 0.64 of the memory roofline, compute-bound, where
 * llama.cpp reached 0.81 (BENCHMARKS.md, "Packed K-quant weights"). With 16 rows side by
 * side, lane r of every vector belongs to row r: each weight dword is one vpdpbusd against a
 * broadcast dword of x, the scales are vectors of 16 rows, and nothing is reduced across lanes.
 *
 * Layout: the groups of 16 rows end to end, each its super-blocks in order; in a super-block
 * "vector (i)" is 64 bytes whose dword r is row r's i-th dword of the named raw bytes.
 *   Q4_K (2368 bytes per 16 rows, 144 x 16 raw): vector 8c + u (c < 4, u < 8) = dword u of
 *     qs[32c .. 32c + 31], low nibbles sub-block 2c, high 2c + 1; then sc as u8 [sub][row]
 *     (128 bytes), the mins as u8 [c][row][2] (sub-blocks 2c, 2c + 1; 128 bytes), 16 f16 d,
 *     16 f16 dmin.
 *   Q6_K (3360 bytes, as raw): per half h < 2 (1536 bytes): vectors of ql[64h ..] (A, 8),
 *     ql[64h + 32 ..] (B, 8), qh[32h ..] (H, 8); then sc as int8 [group][row] (256 bytes),
 *     16 f16 d.
 * Arithmetic per lane (row r of W, row j of x), per super-block, exact in int32:
 *   Q4_K: isum = sum_c sc[c] dot(q_c, x_c), msum = sum_c mn[c] csums[c];
 *         acc = fma((float)isum, d * xd, acc); acc = fma(-(float)msum, dmin * xd, acc)
 *   Q6_K: s = sum_g sc[g] (dot(q_g, x_g) - 32 bsums[g]);  acc = fma((float)s, d * xd, acc)
 * in super-block order, y = acc: the sequence the row-wise dot gives every row, so a packed
 * and an unpacked W give the same bits (the tests check it), whatever m, the group, the
 * thread split or the ISA.
 */
#include <immintrin.h>
#include <string.h>

#include "cpu_kquant_internal.h"
#include "cpu_q8act.h"
#include "cpu_q8amx.h"
#include "cpu_q8vnni.h"
#include "cpu_traits.h"

#define Q4K_RAW 144
#define Q6K_RAW 210
#define Q4K_PB  2368 /* one packed super-block of 16 rows */
#define Q6K_PB  3360
/* offsets in a packed Q4_K super-block */
#define Q4K_SC   2048
#define Q4K_MN   2176
#define Q4K_D    2304
#define Q4K_DMIN 2336
/* in a packed Q6_K super-block */
#define Q6K_HALF 1536
#define Q6K_SC   3072
#define Q6K_D    3328

KN_ALWAYS_INLINE size_t packed_block(td_dtype t)
{
    return t == TD_Q4_K ? Q4K_PB : Q6K_PB;
}

size_t kn_q8k_packed_bytes(const kn_mat *w)
{
    if ((w->type != TD_Q4_K && w->type != TD_Q6_K) || w->n_rows < 1 || w->n_cols % KN_QK_K != 0 ||
        w->row_stride > INT32_MAX / 16 || kn_q8_gemm_group_rows() != 16)
        return 0;
    return (size_t)((w->n_rows + 15) / 16) * (size_t)(w->n_cols / KN_QK_K) * packed_block(w->type);
}

/* 8 vectors at o: dwords 0-7 of the 32 raw bytes at offset off of the 16 rows. */
Q8G_I512 void store_tr32(const uint8_t *p, const int32_t *idx, int off, uint8_t *o)
{
    __m512i T[4];
    tr16(p, idx, off, T);
    for (int u = 0; u < 4; u++)
        _mm512_storeu_si512(o + 64 * u, T[u]);
    tr16(p, idx, off + 16, T);
    for (int u = 0; u < 4; u++)
        _mm512_storeu_si512(o + 64 * (4 + u), T[u]);
}

Q8G_I512 void pack_q4k(const uint8_t *p, const int32_t *idx, uint8_t *o)
{
    for (int c = 0; c < 4; c++)
        store_tr32(p, idx, 16 + 32 * c, o + 64 * 8 * c);
    for (int r = 0; r < 16; r++) {
        const uint8_t *blk = p + idx[r];
        int sc[8], mn[8];
        kn_kq_scale_min(blk + 4, sc, mn);
        for (int s = 0; s < 8; s++) {
            o[Q4K_SC + 16 * s + r] = (uint8_t)sc[s];
            o[Q4K_MN + 32 * (s / 2) + 2 * r + s % 2] = (uint8_t)mn[s];
        }
        memcpy(o + Q4K_D + 2 * r, blk, 2);
        memcpy(o + Q4K_DMIN + 2 * r, blk + 2, 2);
    }
}

Q8G_I512 void pack_q6k(const uint8_t *p, const int32_t *idx, uint8_t *o)
{
    for (int h = 0; h < 2; h++) {
        store_tr32(p, idx, 64 * h, o + Q6K_HALF * h);
        store_tr32(p, idx, 64 * h + 32, o + Q6K_HALF * h + 512);
        store_tr32(p, idx, 128 + 32 * h, o + Q6K_HALF * h + 1024);
    }
    for (int r = 0; r < 16; r++) {
        const uint8_t *blk = p + idx[r];
        for (int g = 0; g < 16; g++)
            o[Q6K_SC + 16 * g + r] = blk[192 + g];
        memcpy(o + Q6K_D + 2 * r, blk + 208, 2);
    }
}

Q8G_T512 void kn_q8k_pack(const kn_mat *w, void *packed, int64_t g0, int64_t g1)
{
    const td_dtype t = w->type;
    const int64_t nb = w->n_cols / KN_QK_K;
    const size_t raw = t == TD_Q4_K ? Q4K_RAW : Q6K_RAW, pb = packed_block(t);
    for (int64_t g = g0; g < g1; g++) {
        const int64_t r0 = 16 * g;
        int32_t idx[16];
        (void)q8g_group_idx(w, r0, 16, idx);
        const uint8_t *src = (const uint8_t *)w->data + (size_t)r0 * w->row_stride;
        uint8_t *dst = (uint8_t *)packed + (size_t)g * (size_t)nb * pb;
        for (int64_t b = 0; b < nb; b++) {
            if (t == TD_Q4_K)
                pack_q4k(src + (size_t)b * raw, idx, dst + (size_t)b * pb);
            else
                pack_q6k(src + (size_t)b * raw, idx, dst + (size_t)b * pb);
        }
    }
}

Q8G_I512 __m512i bcast_dword(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* One packed Q4_K super-block P against M rows of x (xb[j * xs]). */
Q8G_I512 void q4k_super(int M, const uint8_t *P, const kn_q8k *xb, int64_t xs, __m512 acc[4])
{
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i isum[4], msum[4];
    KN_UNROLL
    for (int j = 0; j < M; j++)
        isum[j] = msum[j] = _mm512_setzero_si512();
    KN_UNROLL
    for (int c = 0; c < 4; c++) {
        __m512i lo[4], hi[4];
        KN_UNROLL
        for (int j = 0; j < M; j++)
            lo[j] = hi[j] = _mm512_setzero_si512();
        KN_UNROLL
        for (int u = 0; u < 8; u++) {
            const __m512i v = _mm512_loadu_si512(P + 64 * (8 * c + u));
            const __m512i vl = _mm512_and_si512(v, m4);
            const __m512i vh = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            KN_UNROLL
            for (int j = 0; j < M; j++) {
                const int8_t *x = xb[j * xs].qs + 64 * c + 4 * u;
                lo[j] = _mm512_dpbusd_epi32(lo[j], vl, bcast_dword(x));
                hi[j] = _mm512_dpbusd_epi32(hi[j], vh, bcast_dword(x + 32));
            }
        }
        const __m512i s0 =
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(P + Q4K_SC + 32 * c)));
        const __m512i s1 =
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(P + Q4K_SC + 32 * c + 16)));
        const __m512i mn =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256((const void *)(P + Q4K_MN + 32 * c)));
        KN_UNROLL
        for (int j = 0; j < M; j++) {
            isum[j] = _mm512_add_epi32(isum[j], _mm512_add_epi32(_mm512_mullo_epi32(lo[j], s0),
                                                                 _mm512_mullo_epi32(hi[j], s1)));
            msum[j] = _mm512_dpwssd_epi32(msum[j], mn, bcast_dword(xb[j * xs].csums + 2 * c));
        }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(P + Q4K_D)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(P + Q4K_DMIN)));
    KN_UNROLL
    for (int j = 0; j < M; j++) {
        const __m512 xd = _mm512_set1_ps(xb[j * xs].d);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j]), _mm512_mul_ps(d, xd), acc[j]);
        acc[j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum[j]), _mm512_mul_ps(dmin, xd), acc[j]);
    }
}

/* 6-bit quants: the low nibble of lo (bits 0-3) under the two high bits already at 4-5 in hs. */
Q8G_I512 __m512i q6_join(__m512i lo, __m512i hs)
{
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    /* bitwise m4 ? lo : (hs & 0x30) */
    return _mm512_ternarylogic_epi32(lo, _mm512_and_si512(hs, m30), m4, 0xe4);
}

/* One packed Q6_K super-block P against M rows of x. Group g = 8h + 2k + uh holds columns
 * 128h + 32k + 16uh .. + 15: k picks the nibble (A or B, low or high) and the qh bit pair.
 * One group at a time, its vectors loaded again from L1 for each k: M accumulators live at
 * once, so M = 4 stays in registers. */
Q8G_I512 void q6k_super(int M, const uint8_t *P, const kn_q8k *xb, int64_t xs, __m512 acc[4])
{
    __m512i s[4];
    KN_UNROLL
    for (int j = 0; j < M; j++)
        s[j] = _mm512_setzero_si512();
    KN_UNROLL
    for (int h = 0; h < 2; h++) {
        const uint8_t *Ph = P + Q6K_HALF * h;
        KN_UNROLL
        for (int k = 0; k < 4; k++) {
            KN_UNROLL
            for (int uh = 0; uh < 2; uh++) {
                __m512i a[4];
                KN_UNROLL
                for (int j = 0; j < M; j++)
                    a[j] = _mm512_setzero_si512();
                KN_UNROLL
                for (int u = 4 * uh; u < 4 * uh + 4; u++) {
                    const __m512i L = _mm512_loadu_si512(Ph + 512 * (k & 1) + 64 * u);
                    const __m512i H = _mm512_loadu_si512(Ph + 1024 + 64 * u);
                    const __m512i q = q6_join(k < 2 ? L : _mm512_srli_epi16(L, 4),
                                              k == 0   ? _mm512_slli_epi16(H, 4)
                                              : k == 1 ? _mm512_slli_epi16(H, 2)
                                              : k == 2 ? H
                                                       : _mm512_srli_epi16(H, 2));
                    KN_UNROLL
                    for (int j = 0; j < M; j++)
                        a[j] = _mm512_dpbusd_epi32(
                            a[j], q, bcast_dword(xb[j * xs].qs + 128 * h + 32 * k + 4 * u));
                }
                const int g = 8 * h + 2 * k + uh;
                const __m512i sc =
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(P + Q6K_SC + 16 * g)));
                KN_UNROLL
                for (int j = 0; j < M; j++) {
                    const __m512i off = _mm512_set1_epi32(32 * xb[j * xs].bsums[g]);
                    s[j] =
                        _mm512_add_epi32(s[j], _mm512_mullo_epi32(_mm512_sub_epi32(a[j], off), sc));
                }
            }
        }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(P + Q6K_D)));
    KN_UNROLL
    for (int j = 0; j < M; j++)
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[j]),
                                 _mm512_mul_ps(d, _mm512_set1_ps(xb[j * xs].d)), acc[j]);
}

/* The lanes of mask k of the packed group P (nb super-blocks) against M rows of x: y[j * ldy
 * + lane]. */
Q8G_I512 void tile(td_dtype t, int M, const uint8_t *P, int64_t nb, const kn_q8k *xb, int64_t xs,
                   float *y, int64_t ldy, __mmask16 k)
{
    __m512 acc[4];
    KN_UNROLL
    for (int j = 0; j < M; j++)
        acc[j] = _mm512_setzero_ps();
    const size_t pb = packed_block(t);
    for (int64_t b = 0; b < nb; b++, P += pb) {
        if (t == TD_Q4_K)
            q4k_super(M, P, xb + b, xs, acc);
        else
            q6k_super(M, P, xb + b, xs, acc);
    }
    KN_UNROLL
    for (int j = 0; j < M; j++)
        _mm512_mask_storeu_ps(y + j * ldy, k, acc[j]);
}

Q8G_I512 void dot_packed(td_dtype t, const kn_mat *w, const uint8_t *packed, const void *xq,
                         int64_t m, float *y, int64_t r0, int64_t r1)
{
    const int64_t nb = w->n_cols / KN_QK_K, ldy = w->n_rows;
    const size_t gbytes = (size_t)nb * packed_block(t);
    const int64_t xs = nb; /* kn_q8k blocks per row of x */
    const kn_q8k *x = xq;
    for (int64_t g = r0 / 16; 16 * g < r1; g++) {
        const int64_t lo = r0 > 16 * g ? r0 : 16 * g, hi = r1 < 16 * g + 16 ? r1 : 16 * g + 16;
        const __mmask16 k = (__mmask16)(((1u << (hi - lo)) - 1) << (lo - 16 * g));
        const uint8_t *P = packed + (size_t)g * gbytes;
        float *yg = y + 16 * g;
        int64_t i = 0;
        for (; i + 4 <= m; i += 4)
            tile(t, 4, P, nb, x + i * xs, xs, yg + i * ldy, ldy, k);
        switch (m - i) {
        case 3:
            tile(t, 3, P, nb, x + i * xs, xs, yg + i * ldy, ldy, k);
            break;
        case 2:
            tile(t, 2, P, nb, x + i * xs, xs, yg + i * ldy, ldy, k);
            break;
        case 1:
            tile(t, 1, P, nb, x + i * xs, xs, yg + i * ldy, ldy, k);
            break;
        default:
            break;
        }
    }
}

/* ---- Q4_K's packed dot on AMX-INT8 tiles, for calls of KN_Q8K_DOT_AMX_MIN_M rows of x and more
 * Why: past a few rows of x the kernel above is bound by its vpdpbusd, one per 64 products and
 * row of x (a verification step's 9 rows cost 1.9x one row's time on the 1.5B model's gate
 * shape, cold); a tile instruction does 16 x 16 x 64. The sub-block scales are folded into the
 * weights so a super-block's whole isum accumulates in the tiles: sc = sl + 16 sh (sl < 16,
 * sh < 4), q sl <= 225 and q sh <= 45 are unsigned bytes, and
 *   isum = sum_c dot(q_c sl_c, x_c) + 16 sum_c dot(q_c sh_c, x_c)
 * exactly in int32: two tiles, C_l and C_h, from tdpbsud (x signed, weights unsigned). Each
 * weight vector is scaled by one vpmullw per scale: a word of bytes b0, b1 (< 16) times s < 16
 * is b0 s + 256 b1 s with b0 s < 256, no carry between the bytes. msum and the float part per
 * super-block are q4k_super's, in super-block order: the bits are the VNNI kernel's (the tests
 * compare them), so a row's result does not depend on which kernel its call took.
 * What bounds it: building the B tiles (8 KiB of scaled bytes per super-block of 16 rows, one
 * 64-byte store and one vpmullw each), about half the time at 9 rows of x on the 1.5B model's
 * gate shape (1 thread, hot: without it 2.8x VNNI, with it 1.3x); then the tile loads and the
 * float part.
 * So the tiles win from 7 rows of x (KN_Q8K_DOT_AMX_MIN_M), not from 1: at batch 1 the VNNI
 * kernel reads the weights at memory speed. */

/* The configuration for mr rows of x: A tiles tmm0 and tmm1, C_l/C_h pairs tmm2/tmm3 and
 * tmm4/tmm5 (two sets: the dots of super-block b + 1 run while the vector units read b's), B tiles
 * tmm6 and tmm7. */
Q8G_IAMX void q4ka_config(int mr)
{
    kn_q8a_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)(t < 6 ? mr : 16);
        c.colsb[t] = 64;
    }
    Q8A_BARRIER();
    _tile_loadconfig(&c);
}

/* The B tiles of the packed super-block P: bt[2c] the weights of chunk c (64 columns) times
 * sl, bt[2c + 1] times sh; row u < 8 of either holds sub-block 2c's dwords u (the low nibbles
 * of vector 8c + u), row 8 + u sub-block 2c + 1's (the high nibbles). */
Q8G_IAMX void q4ka_b(const uint8_t *P, uint8_t bt[8][1024])
{
    const __m512i m4 = _mm512_set1_epi8(0x0f), m15 = _mm512_set1_epi32(15);
    KN_UNROLL
    for (int c = 0; c < 4; c++) {
        __m512i sl[2], sh[2];
        KN_UNROLL
        for (int h = 0; h < 2; h++) {
            const __m512i s =
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(P + Q4K_SC + 32 * c + 16 * h)));
            const __m512i l = _mm512_and_si512(s, m15), hh = _mm512_srli_epi32(s, 4);
            sl[h] = _mm512_or_si512(l, _mm512_slli_epi32(l, 16)); /* both words of the dword */
            sh[h] = _mm512_or_si512(hh, _mm512_slli_epi32(hh, 16));
        }
        KN_UNROLL
        for (int u = 0; u < 8; u++) {
            const __m512i v = _mm512_loadu_si512(P + 64 * (8 * c + u));
            const __m512i lo = _mm512_and_si512(v, m4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            _mm512_store_si512(bt[2 * c] + 64 * u, _mm512_mullo_epi16(lo, sl[0]));
            _mm512_store_si512(bt[2 * c] + 64 * (8 + u), _mm512_mullo_epi16(hi, sl[1]));
            _mm512_store_si512(bt[2 * c + 1] + 64 * u, _mm512_mullo_epi16(lo, sh[0]));
            _mm512_store_si512(bt[2 * c + 1] + 64 * (8 + u), _mm512_mullo_epi16(hi, sh[1]));
        }
    }
}

/* C_l (tile cl) and C_h (ch) of the super-block whose B tiles are bt against the rows of x in
 * tile a, from xb (the rows' kn_q8k blocks of this super-block, xs bytes apart). */
#define Q4KA_DOTS(a, cl, ch, xb, xs, bt)                                                           \
    do {                                                                                           \
        Q8A_BARRIER(); /* the B tiles' stores first */                                             \
        _tile_zero(cl);                                                                            \
        _tile_zero(ch);                                                                            \
        KN_UNROLL                                                                                  \
        for (int c_ = 0; c_ < 4; c_++) {                                                           \
            _tile_loadd(a, (xb)->qs + 64 * c_, xs);                                                \
            _tile_loadd(6, (bt)[2 * c_], 64);                                                      \
            _tile_loadd(7, (bt)[2 * c_ + 1], 64);                                                  \
            _tile_dpbsud(cl, a, 6);                                                                \
            _tile_dpbsud(ch, a, 7);                                                                \
        }                                                                                          \
    } while (0)

/* q4k_super's float part for the M rows of x of super-block P from the tiles' sums in cd. */
Q8G_IAMX void q4ka_epilogue(int M, int32_t cd[2][256], const uint8_t *P, const kn_q8k *xb,
                            int64_t xs, __m512 acc[16])
{
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(P + Q4K_D)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(P + Q4K_DMIN)));
    __m512i mn[4];
    KN_UNROLL
    for (int c = 0; c < 4; c++)
        mn[c] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const void *)(P + Q4K_MN + 32 * c)));
    KN_UNROLL
    for (int j = 0; j < 16; j++) {
        if (j >= M) break;
        const kn_q8k *x = xb + j * xs;
        const __m512i isum =
            _mm512_add_epi32(_mm512_load_si512(cd[0] + 16 * j),
                             _mm512_slli_epi32(_mm512_load_si512(cd[1] + 16 * j), 4));
        __m512i msum = _mm512_setzero_si512();
        KN_UNROLL
        for (int c = 0; c < 4; c++)
            msum = _mm512_dpwssd_epi32(msum, mn[c], bcast_dword(x->csums + 2 * c));
        const __m512 xd = _mm512_set1_ps(x->d);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, xd), acc[j]);
        acc[j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, xd), acc[j]);
    }
}

/* One group of 16 rows of W (packed at P, nb super-blocks) against M rows of x (xb, nb blocks
 * each; the configuration loaded for M rows): y[j * ldy + lane] under mask k. A pipeline over
 * the super-blocks: the tile unit runs the dots of b + 1 while the vector units run b's float
 * part and build the B tiles of b + 2 (two buffers, two tile sets). */
Q8G_IAMX void q4ka_panel(int M, const uint8_t *P, const kn_q8k *xb, int64_t nb, float *y,
                         int64_t ldy, __mmask16 k)
{
    const size_t xs = (size_t)nb * sizeof(kn_q8k);
    _Alignas(64) uint8_t bt[2][8][1024];
    _Alignas(64) int32_t cd[2][2][256];
    __m512 acc[16];
    KN_UNROLL
    for (int j = 0; j < 16; j++)
        acc[j] = _mm512_setzero_ps();
    q4ka_b(P, bt[0]);
    if (nb > 1) q4ka_b(P + Q4K_PB, bt[1]);
    Q4KA_DOTS(0, 2, 3, xb, xs, bt[0]);
    Q8A_STORE(2, cd[0][0]);
    Q8A_STORE(3, cd[0][1]);
    for (int64_t b = 0; b < nb; b++) {
        const bool odd = b & 1;
        if (b + 1 < nb) {
            if (odd)
                Q4KA_DOTS(0, 2, 3, xb + b + 1, xs, bt[0]);
            else
                Q4KA_DOTS(1, 4, 5, xb + b + 1, xs, bt[1]);
        }
        q4ka_epilogue(M, cd[odd], P + (size_t)b * Q4K_PB, xb + b, nb, acc);
        if (b + 2 < nb) {
            Q8A_BARRIER(); /* dots(b) loaded bt[odd] before these stores (in order) */
            q4ka_b(P + (size_t)(b + 2) * Q4K_PB, bt[odd]);
        }
        if (b + 1 < nb) {
            if (odd) {
                Q8A_STORE(2, cd[0][0]);
                Q8A_STORE(3, cd[0][1]);
            } else {
                Q8A_STORE(4, cd[1][0]);
                Q8A_STORE(5, cd[1][1]);
            }
        }
    }
    KN_UNROLL
    for (int j = 0; j < 16; j++) {
        if (j >= M) break;
        _mm512_mask_storeu_ps(y + j * ldy, k, acc[j]);
    }
}

/* dot_packed for Q4_K on the tiles: per group of 16 rows of W, each tile of up to 16 rows of x
 * through q4ka_panel (the B tiles built again per tile of x: the decode calls this serves have
 * one). */
static Q8G_TAMX void q4k_amx(const kn_mat *w, const uint8_t *packed, const kn_q8k *x, int64_t m,
                             float *y, int64_t r0, int64_t r1)
{
    const int64_t nb = w->n_cols / KN_QK_K, ldy = w->n_rows;
    const size_t gbytes = (size_t)nb * Q4K_PB;
    int cfg = 0;
    for (int64_t g = r0 / 16; 16 * g < r1; g++) {
        const int64_t lo = r0 > 16 * g ? r0 : 16 * g, hi = r1 < 16 * g + 16 ? r1 : 16 * g + 16;
        const __mmask16 k = (__mmask16)(((1u << (hi - lo)) - 1) << (lo - 16 * g));
        const uint8_t *P = packed + (size_t)g * gbytes;
        for (int64_t i = 0; i < m; i += 16) {
            const int mr = (int)(m - i < 16 ? m - i : 16);
            if (cfg != mr) {
                q4ka_config(mr);
                cfg = mr;
            }
            if (mr == 16)
                q4ka_panel(16, P, x + i * nb, nb, y + i * ldy + 16 * g, ldy, k);
            else
                q4ka_panel(mr, P, x + i * nb, nb, y + i * ldy + 16 * g, ldy, k);
        }
    }
    _tile_release();
}

/* The packed q8 dot kernels of cpu_traits.h's table, one specialised copy per type. */
Q8G_T512 void kn_q8k_dot_packed_q4_k(const kn_mat *w, const void *packed, const void *xq, int64_t m,
                                     float *y, int64_t r0, int64_t r1)
{
    if (m >= KN_Q8K_DOT_AMX_MIN_M && kn_q8_gemm_amx())
        q4k_amx(w, packed, xq, m, y, r0, r1);
    else
        dot_packed(TD_Q4_K, w, packed, xq, m, y, r0, r1);
}

Q8G_T512 void kn_q8k_dot_packed_q6_k(const kn_mat *w, const void *packed, const void *xq, int64_t m,
                                     float *y, int64_t r0, int64_t r1)
{
    dot_packed(TD_Q6_K, w, packed, xq, m, y, r0, r1);
}

size_t kn_q8_packed_bytes(const kn_mat *w)
{
    const size_t b = kn_q8_gemm_packed_bytes(w);
    return b ? b : kn_q8k_packed_bytes(w);
}

void kn_q8_pack(const kn_mat *w, void *packed, int64_t g0, int64_t g1)
{
    /* kn_q8_packed_bytes was not 0 for w, so its type has a packer */
    kn_cpu_traits_of(w->type)->q8_pack(w, packed, g0, g1);
}
