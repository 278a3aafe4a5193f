/* cpu_q8act.h: the CPU backend's opt-in 8-bit activation mode (kn_cpu_set_act_q8,
 * TANDEM_CPU_ACT=q8): each row of x is quantized to 8 bits once per matmul and dotted with
 * the raw weight quants in integer arithmetic, as llama.cpp does. K-types (Q4_K, Q6_K) on the
 * decode dot path (kn_q8_dot, m < 64 and solo rows; with AVX512-VNNI through a copy packed
 * by 16 rows, cpu_q8kpack.c) and, with AVX512-VNNI, the gemm path's batch rows through
 * cpu_q8kgemm.c (kn_q8k_gemm); 32-block types (Q4_0, Q4_1, Q5_0, Q8_0)
 * at every m through the integer GEMM of cpu_q8gemm.c (kn_q8_gemm). Where the CPU and the OS
 * allow AMX-INT8, both GEMMs run calls of many rows of x on AMX tiles (cpu_q8amx.h,
 * kn_q8_gemm_amx), with the bits of their VNNI form.
 *
 * Purpose: the float32 dot path unpacks every weight to float32 and is compute-bound at
 * batch 1; integer dots (AVX2 maddubs + madd, or AVX512-VNNI dpbusd on 256-bit vectors
 * where the CPU has it) do the same work in a fraction of the instructions.
 * Formats of a quantized row of x (n columns):
 *   K-types (Q4_K, Q6_K): n / 256 kn_q8k blocks, d = max|x| / 127, q = round(x / d) in
 *     [-127, 127], bsums[g] = sum of q over group g of 16;
 *   32-block types (Q4_0, Q4_1, Q5_0, Q8_0): n / 32 kn_q8b blocks, the same rule per 32,
 *     sum = sum of the 32 q (for the offsets and Q4_1's min).
 * Invariants: the integer part of every dot is exact; the float part is a fixed sequence
 * per row of x (no dependence on the other rows, the thread count or the ISA beyond
 * float reassociation), so results are deterministic and batch-invariant (the
 * matmul_mixed contract of kn_backend.h). Other weight types keep the float32 path.
 * Threading: pure functions; kn_q8_dot is called from pool jobs on disjoint row ranges.
 */
#ifndef KN_CPU_Q8ACT_H
#define KN_CPU_Q8ACT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kn_backend.h"
#include "td_dtype.h"

typedef struct {
    float d;           /* scale: x ~ d * q */
    int16_t bsums[16]; /* sums of q over each group of 16 */
    int16_t csums[8];  /* sums of q over each chunk of 32 */
    int8_t qs[256];
} kn_q8k;

typedef struct {
    float d;       /* scale: x ~ d * q */
    int16_t sum;   /* sum of qs (offsets and Q4_1's min) */
    int16_t sum16; /* sum of qs[0..15] (Q6_K's offsets per 16 in the K-quant GEMM) */
    int8_t qs[32];
} kn_q8b;

/* Whether the q8 mode has integer dots for weight type t (Q4_K, Q6_K: kn_q8_dot;
 * Q4_0, Q4_1, Q5_0, Q8_0: kn_q8_gemm). */
bool kn_q8_supported(td_dtype t);

/* Bytes of one row of n columns of x quantized for weights of type t (supported). */
size_t kn_q8_row_bytes(td_dtype t, int64_t n);

/* xq (m rows of kn_q8_row_bytes(t, n) bytes) = the m rows of x (m, n) quantized for
 * weights of type t; n a multiple of t's block size. Non-finite rows get d = NaN. */
void kn_q8_quant_rows(td_dtype t, const float *x, int64_t m, int64_t n, void *xq);

/* y[i * w->n_rows + r] = dot(row r of W, row i of xq) for r in [r0, r1) and i < m;
 * xq from kn_q8_quant_rows(w->type, x, m, w->n_cols, xq). packed: for a K-type W, W packed
 * by kn_q8k_pack (read by 16-row groups; any r0, r1, faster on group bounds), or NULL (the
 * rows as they are); both give the same bits. Ignored for the other types. */
void kn_q8_dot(const kn_mat *w, const void *packed, const void *xq, int64_t m, float *y, int64_t r0,
               int64_t r1);

/* ---- cpu_q8kpack.c: K-quant weights packed once for kn_q8_dot (AVX512-VNNI) ----
 * kn_q8k_packed_bytes: the bytes of W (Q4_K or Q6_K, whole super-blocks) packed in groups
 * of 16 rows, or 0 when it cannot be (another type, no AVX512-VNNI, kn_q8_gemm_force_avx2).
 * kn_q8k_pack fills groups [g0, g1) (any thread, disjoint groups); W must not change
 * afterwards. kn_q8k_dot_packed_q4_k and _q6_k (cpu_traits.h, the table's q8_dot_packed):
 * kn_q8_dot's product through the packed copy; Q4_K's calls of KN_Q8K_DOT_AMX_MIN_M rows of x or
 * more run on AMX-INT8 tiles where kn_q8_gemm_amx() holds, with the VNNI kernel's bits (measured
 * with bench_q8amx on the 1.5B model's shapes, hot: 0.9-1.0x at 5-6 rows, 1.1x at 7-8, 1.3x at
 * 9, 1.3-1.4x at 16). */
#define KN_Q8K_DOT_AMX_MIN_M 7
size_t kn_q8k_packed_bytes(const kn_mat *w);
void kn_q8k_pack(const kn_mat *w, void *packed, int64_t g0, int64_t g1);

/* The packed copy the q8 mode keeps of W (cpu_packed.c): kn_q8_gemm_pack's for 32-block
 * types, kn_q8k_pack's for K-types. kn_q8_packed_bytes: its bytes, 0 when W is not packed. */
size_t kn_q8_packed_bytes(const kn_mat *w);
void kn_q8_pack(const kn_mat *w, void *packed, int64_t g0, int64_t g1);

/* ---- cpu_q8gemm.c: 32-block weights, every m ----
 * Whether kn_q8_gemm takes W (Q4_0, Q4_1, Q5_0, Q8_0, row stride <= INT32_MAX / 16). */
bool kn_q8_gemm_supported(const kn_mat *w);

/* Rows of W per group (16 with AVX512-VNNI, 8 with AVX2): chosen by cpuid at first use,
 * AVX2 when kn_q8_gemm_force_avx2(true) (a test hook). */
int kn_q8_gemm_group_rows(void);
void kn_q8_gemm_force_avx2(bool on);

/* Whether the VNNI GEMMs (kn_q8_gemm, kn_q8k_gemm) run calls of many rows of x (m of at least
 * 24, Q8A_MIN_M) on AMX-INT8 (cpu_q8amx.h), with the same bits: the CPU has AMX-TILE and AMX-INT8,
 * the OS granted this process the tile state (asked once, at the first call), TANDEM_CPU_AMX
 * was not 0 then, and neither kn_q8_gemm_force_amx_off(true) (a test hook) nor
 * kn_q8_gemm_force_avx2(true) holds. */
bool kn_q8_gemm_amx(void);
void kn_q8_gemm_force_amx_off(bool on);
/* The same without the test hooks: what the panel scratch is sized for (AMX runs several
 * panels at once, so kn_q8_gemm_panel_bytes and kn_q8k_gemm_panel_bytes grow with it). */
bool kn_q8_amx_usable(void);

/* The GEMMs' instruction set: "amx-int8" (kn_q8_gemm_amx; below 24 rows of x, AVX512-VNNI),
 * "avx512vnni" or "avx2". */
const char *kn_q8_gemm_isa(void);

/* Scratch bytes of one thread's panel for W of n_cols columns (enough for either ISA). */
size_t kn_q8_gemm_panel_bytes(int64_t n_cols);

/* y[i * w->n_rows + r] = dot(row r of W, row i of xq) for i < m and the rows r of groups
 * [g0, g1) of G = kn_q8_gemm_group_rows() rows (the last group may be partial); xq from
 * kn_q8_quant_rows(w->type, ...); panel: kn_q8_gemm_panel_bytes(w->n_cols) of scratch
 * owned by the calling thread. packed: W packed by kn_q8_gemm_pack (used when G is 16), or
 * NULL (each call packs its groups into the panel). A row's result depends only on that row
 * of x and of W (not on m, the other rows, G, the thread split or packed): bit-identical
 * across all of them. */
void kn_q8_gemm(const kn_mat *w, const void *packed, const void *xq, int64_t m, float *y, int G,
                int64_t g0, int64_t g1, void *panel);

/* W packed once for the VNNI GEMM: what every call would otherwise redo in its panel (the
 * 4x4 dword transpose of 16 rows, the gathered scales), kept in as many bytes as W's own
 * blocks. At m = 1 the panel's write and read-back cost more than the dots themselves
 * (BENCHMARKS.md, "Packed weights for the q8 GEMM"); with W packed, m <= 4 rows of x read
 * it directly and larger m unpack a group with one mask and one shift per vector.
 * kn_q8_gemm_packed_bytes: the bytes of W packed, or 0 when W cannot be (not a type of
 * kn_q8_gemm_supported, no AVX512-VNNI, or kn_q8_gemm_force_avx2). kn_q8_gemm_pack fills groups
 * [g0, g1) of 16 rows (any thread, disjoint groups); W must not change afterwards. */
size_t kn_q8_gemm_packed_bytes(const kn_mat *w);
void kn_q8_gemm_pack(const kn_mat *w, void *packed, int64_t g0, int64_t g1);

/* ---- cpu_q8kgemm.c: K-quant weights, the gemm path's batch rows ----
 * Whether kn_q8k_gemm takes W: Q4_K or Q6_K with whole super-blocks, AVX512-VNNI (groups
 * of 16 rows; not under kn_q8_gemm_force_avx2), row stride <= INT32_MAX / 16. */
bool kn_q8k_gemm_supported(const kn_mat *w);
/* Scratch bytes of one thread's panel for W of n_cols columns. */
size_t kn_q8k_gemm_panel_bytes(int64_t n_cols);
/* y[i * ldy + r] = dot(row r of W, row i of xq) for i < m and the rows r of groups [g0, g1)
 * of 16 rows (the last may be partial); xq: m rows of kn_q8b 32-blocks
 * (kn_q8_quant_rows with a 32-block type, e.g. TD_Q8_0); panel: kn_q8k_gemm_panel_bytes of
 * scratch owned by the calling thread. A row's result depends only on that row of x and of
 * W (not on m, the other rows or the group split). */
void kn_q8k_gemm(const kn_mat *w, const void *xq, int64_t m, float *y, int64_t ldy, int64_t g0,
                 int64_t g1, void *panel);
#endif
