/* cpu_traits.h: the CPU backend's per-weight-type traits table: for each td_dtype the
 * kernels the CPU paths run on it (one specialised copy per type, so the inner loops are
 * branch-free) and the constants they need, looked up once per op instead of a type switch
 * in every file (ggml's type_traits_cpu does the same).
 *
 * Purpose: adding a weight type, or a path to one, is one entry here plus its kernels; the
 * callers (cpu_quant.c, cpu_matmul.c, cpu_q8act.c, cpu_q8gemm.c, cpu_q8kpack.c, cpu_q16act.c)
 * ask the table which kernel takes the type instead of switching on it. Inside a kernel the type
 * is a compile-time constant (kn_q_block_bytes and friends fold away), so those stay tests on t.
 * Invariants: kn_cpu_traits_of(t) is NULL exactly for the types the backend does not compute
 * with (kn_cpu_type_supported); a supported type always has dequant and dot. The other
 * kernel slots are NULL where the type has no such path (q8 mode, integer GEMM, packing);
 * callers check the slot, or the kn_q8_*_supported predicate built on it, before calling.
 * Each slot holds a kernel specialised on its type at compile time: the table only picks
 * it, one indirect call per op or pool part, so it costs no speed and changes no bits.
 * Threading: the table is constant; the kernels are pure functions on the buffers given.
 */
#ifndef KN_CPU_TRAITS_H
#define KN_CPU_TRAITS_H

#include <stdint.h>

#include "kn_backend.h"
#include "td_dtype.h"

/* dst (n) = the n weights at src dequantized to float32; n a multiple of the block size. */
typedef void kn_cpu_dequant_fn(const uint8_t *src, float *dst, int64_t n);

/* The float32 dot path: y[i * w->n_rows + r] = dot(row r of W, row i of x) for r in
 * [r0, r1) and i < m. x: (m, w->n_cols); xs: (m, w->n_cols / xsum_group) sums of x over
 * groups of xsum_group when that is > 0, else unused. */
typedef void kn_cpu_dot_fn(const kn_mat *w, const float *x, const float *xs, int64_t m, float *y,
                           int64_t r0, int64_t r1);

/* The q8 mode's integer dot (kn_q8_dot's contract, cpu_q8act.h); packed: W packed by
 * q8_pack (the _packed slot only), xq: x from kn_q8_quant_rows. */
typedef void kn_q8_dot_fn(const kn_mat *w, const void *xq, int64_t m, float *y, int64_t r0,
                          int64_t r1);
typedef void kn_q8_dot_packed_fn(const kn_mat *w, const void *packed, const void *xq, int64_t m,
                                 float *y, int64_t r0, int64_t r1);

/* The q8 mode's integer GEMM over groups [g0, g1) of rows of W (kn_q8_gemm's contract,
 * cpu_q8act.h): VNNI with a per-call panel (16 rows), VNNI through the packed copy (16
 * rows; panel used only for m > 4), AVX2 with a per-call panel (8 rows). */
typedef void kn_q8_gemm_fn(const kn_mat *w, const void *packed, const void *xq, int64_t m, float *y,
                           int64_t g0, int64_t g1, void *panel);

/* The q16 mode's integer dot (kn_q16_dot's contract, cpu_q16act.h); packed: W packed by
 * q8_pack (32-block types), or NULL. */
typedef void kn_q16_dot_fn(const kn_mat *w, const void *packed, const void *xq, int64_t m, float *y,
                           int64_t r0, int64_t r1);

/* Packs groups [g0, g1) of 16 rows of W for the q8 mode (kn_q8_pack, cpu_q8act.h). */
typedef void kn_q8_pack_fn(const kn_mat *w, void *packed, int64_t g0, int64_t g1);

typedef struct {
    kn_cpu_dequant_fn *dequant; /* rows to float32: get_rows, the gemm path's tiles */
    kn_cpu_dot_fn *dot;         /* the float32 dot path (decode, small batches) */
    int xsum_group;             /* weights per sum of x that dot wants (the mins); 0: none */
    int q8_block;               /* q8 mode: weights per quantized block of x (32: kn_q8b,
                                   256: kn_q8k); 0: the type has no q8 mode */
    kn_q8_dot_fn *q8_dot;       /* q8 dot of W as it is (K-types, Q5_0, Q8_0) */
    kn_q8_dot_packed_fn *q8_dot_packed; /* q8 dot through q8_pack's copy (K-types) */
    kn_q8_gemm_fn *q8_gemm512;          /* q8 integer GEMM (32-block types): VNNI */
    kn_q8_gemm_fn *q8_pgemm512;         /* VNNI, W packed */
    kn_q8_gemm_fn *q8_gemm256;          /* AVX2 */
    kn_q8_pack_fn *q8_pack;             /* packs W for q8_pgemm512 or q8_dot_packed */
    kn_q16_dot_fn *q16_dot;             /* q16 mode's dot (32-block types; reads q8_pack's copy) */
} kn_cpu_traits;

/* The traits of weight type t, or NULL when the CPU backend does not support it. */
const kn_cpu_traits *kn_cpu_traits_of(td_dtype t);

/* ---- the kernels the table holds, by the file that defines them ---- */

/* cpu_quant.c */
kn_cpu_dequant_fn kn_dequant_f32, kn_dequant_f16, kn_dequant_bf16, kn_dequant_q8_0, kn_dequant_q4_0,
    kn_dequant_q4_1, kn_dequant_q5_0, kn_dequant_q5_1, kn_dequant_iq4_nl;
/* cpu_kquant.c */
kn_cpu_dequant_fn kn_kq_dequant_q2_k, kn_kq_dequant_q3_k, kn_kq_dequant_q4_k, kn_kq_dequant_q5_k,
    kn_kq_dequant_q6_k, kn_kq_dequant_iq4_xs;
kn_cpu_dot_fn kn_kq_dot_q2_k, kn_kq_dot_q3_k, kn_kq_dot_q4_k, kn_kq_dot_q5_k, kn_kq_dot_q6_k,
    kn_kq_dot_iq4_xs;
/* cpu_matmul.c */
kn_cpu_dot_fn kn_cpu_dot_f32, kn_cpu_dot_f16, kn_cpu_dot_bf16, kn_cpu_dot_q8_0, kn_cpu_dot_q4_0,
    kn_cpu_dot_q4_1, kn_cpu_dot_q5_0, kn_cpu_dot_q5_1, kn_cpu_dot_iq4_nl;
/* cpu_q8act.c */
kn_q8_dot_fn kn_q8_dot_q4_k, kn_q8_dot_q6_k, kn_q8_dot_q5_0, kn_q8_dot_q8_0;
/* cpu_q8kpack.c (AVX512-VNNI) */
kn_q8_dot_packed_fn kn_q8k_dot_packed_q4_k, kn_q8k_dot_packed_q6_k;
kn_q8_pack_fn kn_q8k_pack;
/* cpu_q8gemm.c */
kn_q8_gemm_fn kn_q8g_gemm512_q4_0, kn_q8g_gemm512_q4_1, kn_q8g_gemm512_q5_0, kn_q8g_gemm512_q8_0;
kn_q8_gemm_fn kn_q8g_pgemm512_q4_0, kn_q8g_pgemm512_q4_1, kn_q8g_pgemm512_q5_0,
    kn_q8g_pgemm512_q8_0;
kn_q8_gemm_fn kn_q8g_gemm256_q4_0, kn_q8g_gemm256_q4_1, kn_q8g_gemm256_q5_0, kn_q8g_gemm256_q8_0;
kn_q8_pack_fn kn_q8g_pack_q4_0, kn_q8g_pack_q4_1, kn_q8g_pack_q5_0, kn_q8g_pack_q8_0;
/* cpu_q16act.c */
kn_q16_dot_fn kn_q16_dot_q4_0, kn_q16_dot_q4_1, kn_q16_dot_q5_0, kn_q16_dot_q8_0;

#endif
