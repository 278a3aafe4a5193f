/* cpu_kquant_internal.h: llama.cpp's 256-weight super-block types (the K-quants Q2_K, Q3_K,
 * Q4_K, Q5_K, Q6_K, and IQ4_XS) in the CPU backend: row dequantization and the dot path of
 * matmul. cpu_quant.c and cpu_matmul.c call in
 * here from their type switches; the gemm path reaches the dequantizer through
 * kn_dequant_row. A private header (the _internal suffix): cpu_kquant.c includes
 * cpu_quant.h for the kn_vf helpers while cpu_quant.c calls back in here.
 *
 * Purpose: the files people download (Q4_K_M, Q3_K_M, Q2_K, IQ4_XS and friends) hold these
 * types. A super-block holds KN_QK_K = 256 weights: 8 sub-blocks of 32 with 6-bit packed
 * scales and mins (Q4_K, Q5_K) or 6-bit scales and IQ4_NL's non-linear levels (IQ4_XS), or
 * 16 groups of 16 with 4-bit scales and mins (Q2_K), 6-bit scales (Q3_K) or int8 scales
 * (Q6_K); the layouts are gguf.quants' (the classes of the same names), which this code
 * follows bit for bit (cpu_kquant.c draws them).
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

/* The 8 six-bit scales and mins of a Q4_K/Q5_K super-block, from scales[12] (gguf's
 * get_scale_min): bytes 0-3 hold sc[0..3] (low 6 bits) and the top bits of sc[4..7]; bytes
 * 4-7 mn[0..3] and the top bits of mn[4..7]; bytes 8-11 the low nibbles of sc[4..7] and
 * mn[4..7]. */
static inline __attribute__((always_inline)) void kn_kq_scale_min(const uint8_t *s, int sc[8],
                                                                  int mn[8])
{
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* Q2_K, Q3_K, Q4_K, Q5_K, Q6_K or IQ4_XS. */
bool kn_kq_is_ktype(td_dtype t);

/* The length of the groups the dot path wants sums of x over (their mins multiply them,
 * as Q4_1's do): 32 for Q4_K and Q5_K, 16 for Q2_K; 0 for the types without mins. */
int kn_kq_xsum_group(td_dtype t);

/* dst (nsb * 256) = the nsb super-blocks of type t at src, dequantized. */
void kn_kq_dequant(td_dtype t, const uint8_t *src, float *dst, int64_t nsb);

/* y[i * w->n_rows + r] = dot(row r of W, row i of x) for r in [r0, r1) and i < m.
 * x: (m, w->n_cols); xs: (m, w->n_cols / g) sums of x over groups of g =
 * kn_kq_xsum_group(w->type) when g > 0, else unused; w->type is a super-block type
 * (kn_kq_is_ktype) and w->n_cols a multiple of 256. */
void kn_kq_dot(const kn_mat *w, const float *x, const float *xs, int64_t m, float *y, int64_t r0,
               int64_t r1);

#endif
