/* cpu_kquant_internal.h: llama.cpp's 256-weight super-block types (the K-quants Q2_K, Q3_K,
 * Q4_K, Q5_K, Q6_K, and IQ4_XS) in the CPU backend: what cpu_kquant.c's kernels (the row
 * dequantizers and the dot path of matmul, reached through cpu_traits.h's table) and the q8
 * mode's K-quant files share. A private header (the _internal suffix): it includes
 * cpu_quant.h for KN_VL while cpu_quant.c includes it back.
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
 * Threading: pure functions; the dot kernels are called from pool jobs on disjoint row
 * ranges.
 */
#ifndef KN_CPU_KQUANT_INTERNAL_H
#define KN_CPU_KQUANT_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "cpu_quant.h"
#include "kn_backend.h"
#include "td_dtype.h"

#define KN_QK_K 256 /* weights per K-quant super-block */

/* On AVX-512 Q4_K and Q6_K take loops of their own (cpu_kquant.c's kq4_dot, kq6_dot);
 * kq4_dot folds each chunk's min into its weights, so Q4_K needs no block sums of x there:
 * the float32 dot path's sums of x for Q4_K are over groups of KN_KQ_Q4K_XSUM_GROUP (0:
 * none). */
#if KN_VL == 16
#define KN_KQ_AVX512_LOOPS   1
#define KN_KQ_Q4K_XSUM_GROUP 0
#else
#define KN_KQ_AVX512_LOOPS   0
#define KN_KQ_Q4K_XSUM_GROUP 32
#endif

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

#endif
