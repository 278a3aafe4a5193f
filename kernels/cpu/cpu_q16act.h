/* cpu_q16act.h: the CPU backend's 16-bit activation mode (kn_cpu_set_act(c, KN_CPU_ACT_Q16),
 * TANDEM_CPU_ACT=q16): on the dot path (decode rows, m below the gemm threshold, and every
 * solo row of matmul_mixed) each row of x is quantized per 32-block to int16 once per matmul
 * and dotted with the raw weight quants in integer arithmetic. 32-block types only (Q4_0, Q4_1,
 * Q5_0, Q8_0); the other types, and the batch rows where a gemm path runs them (AMX-BF16;
 * sgemm without AVX512-VNNI: cpu_matmul.c's mm_gemm_rows), stay float32.
 *
 * Purpose: the float32 dot path unpacks every weight to float32 and is compute-bound at
 * batch 1; the q8 mode's integer dots are 1.7x faster but round x to 8 bits, which changes
 * the greedy answers of small models (SmolLM2-135M). 16 bits keep x within ~1.5e-5 of its
 * block's largest value (q8: ~4e-3), and the dots still run on integer lanes.
 * Format of a quantized row of x (n columns): n / 32 kn_q16b blocks, d = max|x| / 32512,
 * q = round(x / d) in [-32512, 32512] (= 127 * 256, so that q = 256 hi + lo with hi and lo
 * signed bytes: hi = floor((q + 128) / 256) in [-127, 127], lo in [-128, 127]), sum = the sum
 * of the 32 q, dsum = d * (float)sum; q, hi and lo in element order. round is to nearest even
 * of x times the float 32512 / max|x|; a block where that overflows (max|x| below ~1e-34) is
 * all zeros with d 0. The AVX-512 and scalar quantizers give the same bytes.
 * Arithmetic of a row r of W against a row of x, block by block in order (acc = 0):
 *   s   = sum of the 32 w_q * q           (exact int32; w_q Q4_0 q-8, Q4_1 q, Q5_0 q-16, Q8_0 q)
 *   acc = fma((float)s, d_r * d, acc)     (d_r * d rounded once)
 *   acc = fma(m_r, dsum, acc)             (Q4_1 only)
 * and y = acc. |s| < 2^28, so the integer part is exact on every ISA; the float part is that
 * fixed sequence per (row of W, row of x), whether it runs in a lane of 16 rows (AVX512-VNNI:
 * the unsigned quants u = w_q + bias against hi and lo by vpdpbusd, s = 256 u.hi + u.lo -
 * bias sum; W read through the q8 mode's packed copy when the engine registered it, else
 * transposed on the fly), of one row (AVX2: the quants widened to int16, madd_epi16 with q)
 * or in scalar code: the same bits on every ISA, for any m, thread count or split of W's rows
 * (deterministic and batch-invariant).
 * Error: |x - d q| <= d / 2 per element (plus the float rounding of x / d), so
 * |y - y_exact| <= sum_b |w_b| . d_b / 2 plus the float rounding of the accumulation.
 * Threading: pure functions; kn_q16_dot is called from pool jobs on disjoint row ranges.
 */
#ifndef KN_CPU_Q16ACT_H
#define KN_CPU_Q16ACT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kn_backend.h"
#include "td_dtype.h"

#define KN_Q16_QMAX 32512 /* largest |q|: 127 * 256 */

typedef struct {
    float d;        /* scale: x ~ d * q */
    int32_t sum;    /* sum of the 32 q (the offsets) */
    float dsum;     /* d * (float)sum (Q4_1's min) */
    int16_t qs[32]; /* q (AVX2, scalar) */
    int8_t hi[32];  /* q = 256 hi + lo (AVX512-VNNI) */
    int8_t lo[32];
} kn_q16b;

/* Whether the q16 mode has integer dots for weight type t (Q4_0, Q4_1, Q5_0, Q8_0). */
bool kn_q16_supported(td_dtype t);

/* Bytes of one row of n columns of x quantized (n a multiple of 32). */
size_t kn_q16_row_bytes(int64_t n);

/* xq (m rows of kn_q16_row_bytes(n) bytes) = the m rows of x (m, n) quantized; n a multiple
 * of 32. A block with a non-finite element gets d = NaN (its products are NaN). */
void kn_q16_quant_rows(const float *x, int64_t m, int64_t n, void *xq);

/* y[i * w->n_rows + r] = dot(row r of W, row i of xq) for r in [r0, r1) and i < m; W of a
 * supported type, xq from kn_q16_quant_rows(x, m, w->n_cols, xq). packed: W packed by
 * kn_q8_gemm_pack (cpu_q8act.h; read by 16-row groups, fastest when r0 and r1 are group
 * bounds), or NULL; both give the same bits. */
void kn_q16_dot(const kn_mat *w, const void *packed, const void *xq, int64_t m, float *y,
                int64_t r0, int64_t r1);

/* The kernels' instruction set: "avx512vnni" (16 rows of W per lane group), "avx2" or
 * "scalar" (one row at a time), chosen by cpuid at first use. kn_q16_force_isa("avx2") or
 * ("scalar") forces a slower form, of the dots and (below AVX512-VNNI) of kn_q16_quant_rows
 * too (a test hook: the same bits), NULL undoes it. */
const char *kn_q16_isa(void);
void kn_q16_force_isa(const char *isa);

#endif
