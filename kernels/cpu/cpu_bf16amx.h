/* cpu_bf16amx.h: the float32 gemm path's product (cpu_matmul.c, prefill's batch rows) on
 * AMX-BF16 tiles in three bf16 products ("bf16x3": Henry, Tang, Heinecke, "Leveraging the
 * bfloat16 AI datatype for higher-precision computations", 2019).
 *
 * Why: single-threaded OpenBLAS sgemm reaches ~115-150 GFLOP/s per core; tdpbf16ps does
 * 16 x 16 x 32 products in one instruction, about 16x AVX-512's fp32 FMA rate, so even three
 * passes leave several times sgemm's rate (SmolLM2-135M's shapes at m 512, one core: 350-450
 * GFLOP/s against sgemm's 135-150) at an accuracy far closer to float32 than the q8 mode's
 * integer GEMMs (which change the default model's answers).
 * The math: every float v of x and of W splits as v = hi + lo + e, hi = bf16(v) (round to
 * nearest even), lo = bf16(v - hi), |e| <= 2^-16 |v|; y = x_hi.w_hi + x_hi.w_lo + x_lo.w_hi, the
 * dropped x_lo.w_lo term up to 2^-16 relative, all accumulated in fp32 by tdpbf16ps.
 * Accuracy (tests/kernels/test_bf16amx.c, random data against float64): bf16x3's relative
 * error per row of y is 2e-6 to 1.4e-5 (about 2^-17, what a 16-bit significand gives),
 * 6-12x sgemm's at K 8960, 15-40x at K 576-2304, up to 175x at K 32 where sgemm is nearly
 * exact. That is not float32's 2^-24: KN_BF16AMX_PARTS 3 (bf16x6, below) is within 3.1x of
 * sgemm everywhere, at about 0.6x of bf16x3's speed (still 1.5x sgemm's).
 * The roles are swapped (y^T = W x^T): A tiles are 16 rows of W by 32 K (W's rows as they
 * are, split per slice of rows into hi and lo tiles), B tiles are x in AMX's pair layout
 * (row kk of a tile = for each of 16 rows j of x, (x[j][2kk], x[j][2kk + 1])), converted once
 * per matmul (kn_bf16amx_pack_x); a C tile (16 rows of W x 16 rows of x) is transposed into y
 * when its K is done. Tiles: tmm0-3 C (2 x 2), tmm4-5 W, tmm6-7 x; per block of 32 K, 12
 * tdpbf16ps (hi.hi, hi.lo, lo.hi for each of the 4 C tiles) and 10 tile loads (bf16x6: 24
 * and 16).
 * Layouts (bytes): a tile is 1 KiB (16 rows x 64 bytes); K is padded with zeros to kp, a
 * multiple of 32 (nkb = kp / 32 blocks), rows of W and of x to a multiple of 32 (tiles in
 * pairs) with zero rows.
 *   x packed (kn_bf16amx_x_bytes): [x tile t][block b][part] tiles, t < 2 * ceil(m / 32).
 *   per-slice scratch (kn_bf16amx_scratch_bytes): W's slice as [W tile][block][part] tiles,
 *   then K-block partial sums of C ([W tile][x tile of the current x block] tiles), then one
 *   row of W dequantized to float32.
 * Invariants: each element of y is the sum over blocks of 32 K, in block order, of hi.hi,
 * hi.lo, lo.hi of its own row of x and row of W: it does not depend on m, on the other rows,
 * on the slice or thread that computed it, or on the K blocking (partial sums go through
 * memory in fp32, exactly), so a row's result computed alone equals its result in any batch
 * (bit for bit; tests/kernels/test_bf16amx.c checks it). Infinities and values beyond bf16's
 * range (|v| > ~3.39e38) give NaN where sgemm would not; denormals are flushed to zero
 * (tdpbf16ps, the conversion) and lose their part of the sum.
 * Callers run the products only where kn_bf16amx_usable() holds (AMX-TILE, AMX-INT8 and the
 * tile permission through kn_q8_amx_usable's probe, plus AMX-BF16 and AVX512-BF16; off with
 * TANDEM_CPU_AMX=0 or kn_bf16amx_force_off). Every call loads its tile configuration and calls
 * _tile_release before it returns: no tile state is left behind.
 * Threading: the functions are pure apart from their output and scratch; kn_bf16amx_rows is
 * called from pool parts on disjoint row ranges of W, each with its own scratch, all reading
 * one packed x.
 */
#ifndef KN_CPU_BF16AMX_H
#define KN_CPU_BF16AMX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kn_backend.h"

/* Parts each float is split into: 2 (hi, lo; the three products of bf16x3, the default) or 3
 * (hi, mid, lo; bf16x6: hi.hi, hi.mid, hi.lo, mid.mid, mid.hi, lo.hi, the terms above 2^-24
 * relative, float32's accuracy for twice the tile work). Chosen at build time
 * (-DKN_BF16AMX_PARTS=3); KN_BF16AMX_NAME names the products for the logs. */
#ifndef KN_BF16AMX_PARTS
#define KN_BF16AMX_PARTS 2
#endif
#if KN_BF16AMX_PARTS == 2
#define KN_BF16AMX_NAME "AMX-BF16x3 GEMM"
#elif KN_BF16AMX_PARTS == 3
#define KN_BF16AMX_NAME "AMX-BF16x6 GEMM"
#else
#error "KN_BF16AMX_PARTS must be 2 or 3"
#endif

/* Rows of W per kn_bf16amx_rows call that the gemm path aims for (a multiple of 32): x is
 * read from memory once per slice. */
#define KN_BF16AMX_SLICE_ROWS 512

/* Whether the products may run here (see the top comment); the CPU is probed once. */
bool kn_bf16amx_usable(void);
/* Test hook: true turns the products off (the gemm path takes dequantize + sgemm). */
void kn_bf16amx_force_off(bool on);

/* Bytes of x's packed form for m rows of k columns (64-byte multiple). */
size_t kn_bf16amx_x_bytes(int64_t m, int64_t k);
/* x (m, k) floats into xp (kn_bf16amx_x_bytes(m, k), 64-byte aligned): the pair tiles of x
 * tiles [t0, t1) (16 rows each, t1 <= 2 * ceil(m / 32)), rows past m zero. */
void kn_bf16amx_pack_x(const float *x, int64_t m, int64_t k, int64_t t0, int64_t t1, void *xp);
/* Bytes of scratch kn_bf16amx_rows needs for slices of up to n rows of W with k columns. */
size_t kn_bf16amx_scratch_bytes(int64_t n, int64_t k);
/* y[j * ldy + r - r0] for rows r in [r0, r0 + n) of w (any type kn_dequant_row takes, float32
 * read in place) and j < m: the bf16x3 products of W's rows and x, packed by
 * kn_bf16amx_pack_x (all its tiles); scratch: kn_bf16amx_scratch_bytes(n, w->n_cols),
 * 64-byte aligned. Returns 0, or the error of kn_dequant_row. */
int kn_bf16amx_rows(const kn_mat *w, int64_t r0, int64_t n, const void *xp, int64_t m, float *y,
                    int64_t ldy, void *scratch);

#endif
