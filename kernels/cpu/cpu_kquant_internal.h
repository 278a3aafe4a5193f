/* cpu_kquant_internal.h: llama.cpp's K-quant weight types (Q4_K, Q5_K, Q6_K) in the CPU
 * backend: row dequantization and the dot path of matmul. cpu_quant.c and cpu_matmul.c call in
 * here from their type switches; the gemm path reaches the dequantizer through
 * kn_dequant_row. A private header (the _internal suffix): cpu_kquant.c includes
 * cpu_quant.h for the kn_vf helpers while cpu_quant.c calls back in here.
 *
 * Purpose: the files people download (Q4_K_M and friends) hold these types. A K-quant
 * super-block holds KN_QK_K = 256 weights: 8 sub-blocks of 32 with 6-bit packed scales
 * and mins (Q4_K, Q5_K) or 16 groups of 16 with int8 scales (Q6_K); the layouts are
 * gguf.quants' (Q4_K, Q5_K, Q6_K classes), which this code follows bit for bit.
 * Invariants: rows are whole super-blocks (n_cols % 256 == 0, checked by the callers);
 * the dequantized values equal gguf.quants.dequantize's exactly (see cpu_kquant.c for
 * why no rounding order can change them); the dot path gives every row of x the
 * arithmetic of m == 1, so results do not depend on the batch.
 * Threading: pure functions; kn_kq_dot is called from pool jobs on disjoint row ranges.
 */
#ifndef KN_CPU_KQUANT_INTERNAL_H
#define KN_CPU_KQUANT_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "kn_backend.h"
#include "td_dtype.h"

#define KN_QK_K 256 /* weights per K-quant super-block */

/* Q4_K, Q5_K or Q6_K. */
bool kn_kq_is_ktype(td_dtype t);

/* Q4_K and Q5_K: the dot path wants the sums of x over each block of 32 (their mins
 * multiply them), as Q4_1's does. */
bool kn_kq_needs_xsum(td_dtype t);

/* dst (nsb * 256) = the nsb super-blocks of type t at src, dequantized. */
void kn_kq_dequant(td_dtype t, const uint8_t *src, float *dst, int64_t nsb);

/* y[i * w->n_rows + r] = dot(row r of W, row i of x) for r in [r0, r1) and i < m.
 * x: (m, w->n_cols); xs: (m, w->n_cols / 32) block sums of x when kn_kq_needs_xsum,
 * else unused; w->type is a K type and w->n_cols a multiple of 256. */
void kn_kq_dot(const kn_mat *w, const float *x, const float *xs, int64_t m, float *y, int64_t r0,
               int64_t r1);

#endif
