/* cpu_bf16amx.c: the gemm path's bf16x3 products on AMX-BF16 tiles (cpu_bf16amx.h). */
#include "cpu_bf16amx.h"

#include <cpuid.h>
#include <immintrin.h>
#include <stdatomic.h>
#include <string.h>

#include "cpu_backend.h"
#include "cpu_q8act.h"
#include "cpu_quant.h"

#define BA_T                                                                                       \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
#define BA_I static inline __attribute__((always_inline)) BA_T

#define BA_TILE  1024 /* bytes of a tile: 16 rows x 64 bytes */
#define BA_PARTS KN_BF16AMX_PARTS
#define BA_PAIR  (BA_PARTS * BA_TILE) /* a block's tiles, one per part */
/* Most blocks of 32 K per pass over the C tiles (K blocking: the passes split K evenly). One
 * pass for K up to 1024 avoids storing and reloading C; passes of 8 blocks (the x pair's share
 * in L1) ran 4-10% slower at m 512 on SmolLM2-135M's shapes than one pass. */
#ifndef BA_KCB
#define BA_KCB 32
#endif
/* x tiles per block of x: the C partial sums kept between K blocks are BA_XBLK tiles per W
 * tile, whatever m. */
#ifndef BA_XBLK
#define BA_XBLK 16
#endif

/* The tile ops are inline asm that tell the compiler they read no memory (cpu_q8amx.h): a
 * barrier makes the stores they read land first, and keeps C's loads after a tile store. */
#define BA_BARRIER() __asm__ volatile("" ::: "memory")

static atomic_int ba_sel = -1; /* -1 not probed, 0 no, 1 usable */
static atomic_bool ba_off;

bool kn_bf16amx_usable(void)
{
    int s = atomic_load_explicit(&ba_sel, memory_order_relaxed);
    if (s < 0) {
        /* AMX-BF16: CPUID.(7, 0):EDX[22]; AVX512-BF16 (the conversions): CPUID.(7, 1):EAX[5].
         * kn_q8_amx_usable: AMX-TILE, the OS's tile state and permission, TANDEM_CPU_AMX. */
        unsigned a, b, c, d, a1 = 0, b1, c1, d1;
        s = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) &&
            __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && (a1 & (1u << 5)) && kn_q8_amx_usable();
        atomic_store_explicit(&ba_sel, s, memory_order_relaxed);
    }
    return s && !atomic_load_explicit(&ba_off, memory_order_relaxed);
}

void kn_bf16amx_force_off(bool on)
{
    atomic_store(&ba_off, on);
}

/* x tiles (16 rows each) in pairs */
static int64_t ba_x_tiles(int64_t m)
{
    return 2 * ((m + 31) / 32);
}

size_t kn_bf16amx_x_bytes(int64_t m, int64_t k)
{
    return (size_t)ba_x_tiles(m) * (size_t)((k + 31) / 32) * BA_PAIR;
}

size_t kn_bf16amx_scratch_bytes(int64_t n, int64_t k)
{
    const size_t nwt = (size_t)(2 * ((n + 31) / 32)), nkb = (size_t)((k + 31) / 32);
    return nwt * nkb * BA_PAIR + nwt * BA_XBLK * BA_TILE + (size_t)k * sizeof(float);
}

/* bf16 pairs of a and b (elements 0..15 from a) and, in *ra, *rb, what they leave of a, b. */
BA_I __m512i ba_round(__m512 a, __m512 b, __m512 *ra, __m512 *rb)
{
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(b, a);
    const __m512 ha = _mm512_castsi512_ps(
                     _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16)),
                 hb = _mm512_castsi512_ps(
                     _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
    *ra = _mm512_sub_ps(a, ha);
    *rb = _mm512_sub_ps(b, hb);
    return h;
}

/* The 32 floats at src (the first cnt, 0..32; the rest zero) as 16 pairs of bf16 per part:
 * lane p of part[0] holds (bf16(v[2p]), bf16(v[2p + 1])), of part[1] the same of v - part 0,
 * and so on (the differences are exact in float32). */
BA_I void ba_split(const float *src, int cnt, __m512i part[BA_PARTS])
{
    const __mmask16 m0 = cnt >= 16 ? 0xffff : (__mmask16)((1u << cnt) - 1),
                    m1 = cnt >= 32  ? 0xffff
                         : cnt > 16 ? (__mmask16)((1u << (cnt - 16)) - 1)
                                    : 0;
    __m512 a = _mm512_maskz_loadu_ps(m0, src), b = _mm512_maskz_loadu_ps(m1, src + 16);
    KN_UNROLL
    for (int q = 0; q < BA_PARTS - 1; q++)
        part[q] = ba_round(a, b, &a, &b);
    part[BA_PARTS - 1] = (__m512i)_mm512_cvtne2ps_pbh(b, a);
}

/* r[i] lane l becomes r[l] lane i (a 16 x 16 transpose of 32-bit lanes). */
BA_I void ba_tr16(__m512i r[16])
{
    __m512i t[16];
    KN_UNROLL
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    KN_UNROLL
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* r[4q + s] lane 4c + e: row 4q + e, column 4c + s (c the 128-bit lane) */
    KN_UNROLL
    for (int s = 0; s < 4; s++) {
        t[s] = _mm512_shuffle_i32x4(r[s], r[4 + s], 0x88);
        t[4 + s] = _mm512_shuffle_i32x4(r[s], r[4 + s], 0xdd);
        t[8 + s] = _mm512_shuffle_i32x4(r[8 + s], r[12 + s], 0x88);
        t[12 + s] = _mm512_shuffle_i32x4(r[8 + s], r[12 + s], 0xdd);
    }
    KN_UNROLL
    for (int s = 0; s < 8; s++) {
        r[s] = _mm512_shuffle_i32x4(t[s], t[8 + s], 0x88);
        r[8 + s] = _mm512_shuffle_i32x4(t[s], t[8 + s], 0xdd);
    }
}

BA_T void kn_bf16amx_pack_x(const float *x, int64_t m, int64_t k, int64_t t0, int64_t t1, void *xp)
{
    const int64_t nkb = (k + 31) / 32;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t b = 0; b < nkb; b++) {
            const int cnt = (int)(k - 32 * b < 32 ? k - 32 * b : 32);
            __m512i v[BA_PARTS][16];
            for (int j = 0; j < 16; j++) {
                const int64_t row = 16 * t + j;
                __m512i p[BA_PARTS];
                KN_UNROLL
                for (int q = 0; q < BA_PARTS; q++)
                    p[q] = _mm512_setzero_si512();
                if (row < m) ba_split(x + row * k + 32 * b, cnt, p);
                KN_UNROLL
                for (int q = 0; q < BA_PARTS; q++)
                    v[q][j] = p[q];
            }
            uint8_t *o = (uint8_t *)xp + (size_t)(t * nkb + b) * BA_PAIR;
            KN_UNROLL
            for (int q = 0; q < BA_PARTS; q++) {
                ba_tr16(v[q]);
                KN_UNROLL
                for (int kk = 0; kk < 16; kk++)
                    _mm512_store_si512(o + q * BA_TILE + 64 * kk, v[q][kk]);
            }
        }
}

/* Rows [r0, r0 + n) of W into the slice's tiles at panel (np rows, the rows past n zero): a
 * row of A tile (W tile i / 16, block b) is row i's 32 K of that block. */
static BA_T int ba_slice(const kn_mat *w, int64_t r0, int64_t n, int64_t np, uint8_t *panel,
                         float *fbuf)
{
    const int64_t k = w->n_cols, nkb = (k + 31) / 32;
    const uint8_t *base = (const uint8_t *)w->data;
    const bool direct = w->type == TD_F32 && w->row_stride % sizeof(float) == 0 &&
                        (uintptr_t)w->data % sizeof(float) == 0;
    for (int64_t i = 0; i < np; i++) {
        uint8_t *o = panel + (size_t)((i / 16) * nkb) * BA_PAIR + (size_t)(i % 16) * 64;
        if (i >= n) {
            for (int64_t b = 0; b < nkb; b++)
                for (int q = 0; q < BA_PARTS; q++)
                    memset(o + (size_t)b * BA_PAIR + (size_t)q * BA_TILE, 0, 64);
            continue;
        }
        const uint8_t *row = base + (size_t)(r0 + i) * w->row_stride;
        const float *src = (const float *)(const void *)row;
        if (!direct) {
            const int rc = kn_dequant_row(w->type, row, fbuf, k);
            if (rc) return rc;
            src = fbuf;
        }
        for (int64_t b = 0; b < nkb; b++) {
            __m512i p[BA_PARTS];
            ba_split(src + 32 * b, (int)(k - 32 * b < 32 ? k - 32 * b : 32), p);
            KN_UNROLL
            for (int q = 0; q < BA_PARTS; q++)
                _mm512_store_si512(o + (size_t)b * BA_PAIR + (size_t)q * BA_TILE, p[q]);
        }
    }
    return 0;
}

/* The tiles' shapes (ldtilecfg's 64 bytes, palette 1): tmm0-7 all 16 rows x 64 bytes. */
BA_I void ba_config(void)
{
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++)
        c.colsb[t] = 64, c.rows[t] = 16;
    BA_BARRIER();
    _tile_loadconfig(&c);
}

/* The products of each block, in order: (part of W, part of x). bf16x3: hi.hi, hi.lo, lo.hi;
 * bf16x6 (BA_PARTS 3): hi.hi, hi.mid, hi.lo, mid.mid, mid.hi, lo.hi (ordered so that each
 * product reloads one operand, or both where neither is loaded). */
#if BA_PARTS == 2
#define BA_NPROD 3
static const int ba_prod[BA_NPROD][2] = {{0, 0}, {0, 1}, {1, 0}};
#else
#define BA_NPROD 6
static const int ba_prod[BA_NPROD][2] = {{0, 0}, {0, 1}, {0, 2}, {1, 1}, {1, 0}, {2, 0}};
#endif

/* tmm0-3 (C of W tiles w, w + 1 against x tiles x, x + 1) += blocks [0, nb) of the tiles at w
 * (the second W tile ws bytes on) and x (the second xs bytes on): per block the products of
 * ba_prod, in that order for every C. */
BA_I void ba_pair(const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w0 = w + (size_t)b * BA_PAIR, *x0 = x + (size_t)b * BA_PAIR;
        KN_UNROLL
        for (int p = 0; p < BA_NPROD; p++) {
            const int pw = ba_prod[p][0], px = ba_prod[p][1];
            if (!p || ba_prod[p - 1][0] != pw) {
                _tile_loadd(4, w0 + pw * BA_TILE, 64);
                _tile_loadd(5, w0 + ws + pw * BA_TILE, 64);
            }
            if (!p || ba_prod[p - 1][1] != px) {
                _tile_loadd(6, x0 + px * BA_TILE, 64);
                _tile_loadd(7, x0 + xs + px * BA_TILE, 64);
            }
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* A finished C tile c (16 rows of W x 16 rows of x) into y: its rows of x below mr, its rows
 * of W below nr (y's columns). */
BA_I void ba_put(const float *c, float *y, int64_t ldy, int mr, int nr)
{
    __m512i v[16];
    KN_UNROLL
    for (int i = 0; i < 16; i++)
        v[i] = _mm512_load_si512(c + 16 * i);
    ba_tr16(v);
    const __mmask16 k = nr >= 16 ? 0xffff : (__mmask16)((1u << nr) - 1);
    for (int j = 0; j < mr; j++)
        _mm512_mask_storeu_ps(y + j * ldy, k, _mm512_castsi512_ps(v[j]));
}

BA_T int kn_bf16amx_rows(const kn_mat *w, int64_t r0, int64_t n, const void *xp, int64_t m,
                         float *y, int64_t ldy, void *scratch)
{
    if (n <= 0 || m <= 0) return 0;
    const int64_t k = w->n_cols, nkb = (k + 31) / 32, np = 32 * ((n + 31) / 32), nwt = np / 16,
                  mt = ba_x_tiles(m);
    const size_t ts = (size_t)nkb * BA_PAIR; /* bytes from a tile's blocks to the next tile's */
    const int64_t passes = (nkb + BA_KCB - 1) / BA_KCB, kcb = (nkb + passes - 1) / passes;
    uint8_t *panel = scratch, *cbuf = panel + (size_t)nwt * ts;
    float *fbuf = (float *)(void *)(cbuf + (size_t)nwt * BA_XBLK * BA_TILE);
    const int rc = ba_slice(w, r0, n, np, panel, fbuf);
    if (rc) return rc;
    const uint8_t *xq = xp;
    _Alignas(64) float cd[4][256];
    ba_config();
    for (int64_t xb0 = 0; xb0 < mt; xb0 += BA_XBLK) {
        const int64_t xb1 = mt - xb0 < BA_XBLK ? mt : xb0 + BA_XBLK;
        for (int64_t kb0 = 0; kb0 < nkb; kb0 += kcb) {
            const int64_t nb = nkb - kb0 < kcb ? nkb - kb0 : kcb;
            const bool first = kb0 == 0, last = kb0 + nb == nkb;
            for (int64_t xt = xb0; xt < xb1; xt += 2)
                for (int64_t wt = 0; wt < nwt; wt += 2) {
                    /* the partial sums of C (wt + a, xt + b) at cb + (a * BA_XBLK + b) tiles */
                    uint8_t *cb = cbuf + (size_t)(wt * BA_XBLK + xt - xb0) * BA_TILE;
                    const size_t cw = (size_t)BA_XBLK * BA_TILE;
                    if (first) {
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                    } else {
                        BA_BARRIER();
                        _tile_loadd(0, cb, 64);
                        _tile_loadd(1, cb + BA_TILE, 64);
                        _tile_loadd(2, cb + cw, 64);
                        _tile_loadd(3, cb + cw + BA_TILE, 64);
                    }
                    ba_pair(panel + (size_t)wt * ts + (size_t)kb0 * BA_PAIR, ts,
                            xq + (size_t)xt * ts + (size_t)kb0 * BA_PAIR, ts, nb);
                    if (!last) {
                        _tile_stored(0, cb, 64);
                        _tile_stored(1, cb + BA_TILE, 64);
                        _tile_stored(2, cb + cw, 64);
                        _tile_stored(3, cb + cw + BA_TILE, 64);
                        BA_BARRIER();
                        continue;
                    }
                    BA_BARRIER();
                    _tile_stored(0, cd[0], 64);
                    _tile_stored(1, cd[1], 64);
                    _tile_stored(2, cd[2], 64);
                    _tile_stored(3, cd[3], 64);
                    BA_BARRIER();
                    for (int a = 0; a < 2; a++)
                        for (int b = 0; b < 2; b++) {
                            const int64_t r = 16 * (wt + a), j = 16 * (xt + b);
                            if (r >= n || j >= m) continue;
                            ba_put(cd[2 * a + b], y + j * ldy + r, ldy,
                                   (int)(m - j < 16 ? m - j : 16), (int)(n - r < 16 ? n - r : 16));
                        }
                }
        }
    }
    _tile_release();
    return 0;
}
