/* cpu_backend.h: the CPU backend: a thread pool plus SIMD kernels behind kn_backend_ops.
 *
 * Purpose: run the engine on x86-64 CPUs. Decode-shaped products (few rows of x) use
 * SIMD dot products that dequantize weights on the fly; prefill-shaped products (many
 * rows) dequantize weight slices to float32 and call OpenBLAS sgemm per thread, or, where
 * AMX-BF16 is usable, multiply them as three bf16 products on AMX tiles (cpu_bf16amx.h).
 * Invariants: activations are float32 (the opt-in q8 and q16 modes, kn_cpu_set_act, quantize
 * them to 8 or 16 bits inside the integer products); every kernel gives the same result for
 * any thread count up to float reassociation inside a dot product.
 * Threading: one caller at a time (see cpu_pool.h).
 * Ownership: kn_cpu_create/kn_cpu_destroy; the ops table returned by kn_cpu_backend
 * borrows the kn_cpu.
 */
#ifndef KN_CPU_BACKEND_H
#define KN_CPU_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu_pool.h"
#include "kn_backend.h"

typedef struct kn_cpu kn_cpu;

int kn_cpu_create(int n_threads, kn_cpu **out); /* n_threads <= 0: number of cores */
void kn_cpu_destroy(kn_cpu *c);
kn_backend kn_cpu_backend(kn_cpu *c);
/* The kn_cpu behind a backend made by kn_cpu_backend or kn_backend_create("cpu"), or NULL
 * for any other backend (for CPU-only tools: the ceilings, the pool). */
kn_cpu *kn_cpu_of(kn_backend b);
kn_pool *kn_cpu_pool(kn_cpu *c);
int kn_cpu_n_threads(const kn_cpu *c);

/* The activation mode of the products (KN_CPU_ACT_F32 by default).
 * KN_CPU_ACT_Q8: matmul rows that take the dot path (m below the gemm threshold, and
 * matmul_mixed's solo rows) are quantized to 8 bits once per call (Q8_K-style 256-blocks for
 * Q4_K and Q6_K weights, 32-blocks for Q5_0 and Q8_0) and dotted in integer arithmetic
 * (cpu_q8act.h); Q4_0, Q4_1, Q5_0 and Q8_0 weights take the integer GEMM at every m; other
 * weight types stay float32. Results differ from float32 by the rounding of x to 8 bits
 * (|x - d q| <= d / 2 with d = max|x| / 127 over the block).
 * KN_CPU_ACT_Q16: the dot path's rows of Q4_0, Q4_1, Q5_0 and Q8_0 weights are quantized to
 * 16 bits per 32-block (d = max|x| / 32767) and dotted in integer arithmetic (cpu_q16act.h);
 * the gemm path's batch rows and the other weight types stay float32.
 * Both are deterministic and batch-invariant. kn_cpu_create reads TANDEM_CPU_ACT once: unset or
 * "f32" KN_CPU_ACT_F32, "q8", "q16", "auto" F32 here (it is resolved for a model by
 * kn_act_runtime_open, act_check.h, which then sets the mode), anything else an error
 * (TD_EINVAL). Not to be called while an op runs. */
typedef enum { KN_CPU_ACT_F32 = 0, KN_CPU_ACT_Q8, KN_CPU_ACT_Q16 } kn_cpu_act_mode;
void kn_cpu_set_act(kn_cpu *c, kn_cpu_act_mode a);
kn_cpu_act_mode kn_cpu_act(const kn_cpu *c);
/* "f32", "q8", "q16". */
const char *kn_cpu_act_name(kn_cpu_act_mode a);
/* The mode named s ("f32", "q8", "q16"): 0, or TD_EINVAL for any other name (NULL too). */
int kn_cpu_act_parse(const char *s, kn_cpu_act_mode *out);
/* kn_cpu_set_act(c, on ? KN_CPU_ACT_Q8 : KN_CPU_ACT_F32), and whether the mode is Q8. */
void kn_cpu_set_act_q8(kn_cpu *c, bool on);
bool kn_cpu_act_q8(const kn_cpu *c);

/* map_matrix of the ops table (kn_backend.h): w is a model weight, read-only and alive
 * until kn_cpu_destroy. The q8 mode's integer GEMM keeps a packed copy of such a Q4_0,
 * Q4_1, Q5_0 or Q8_0 matrix, made on its first product (cpu_packed.c; the bits do not change).
 * Always 0 (registration is a hint; a failure to register is logged). */
int kn_cpu_map_matrix(void *ctx, const kn_mat *w);
/* Bytes held by the packed copies. */
size_t kn_cpu_packed_bytes(const kn_cpu *c);

/* Which kernel each kind of row of a product over w takes now (the activation mode
 * included): *batch for the rows of a batch large enough for the gemm path (prefill),
 * *solo for decode rows. Static strings. */
void kn_cpu_matmul_paths(const kn_cpu *c, const kn_mat *w, const char **batch,
                         const char **solo);
/* Whether the gemm path runs on AMX tiles in c's activation mode (the q8 mode's AMX-INT8
 * GEMMs, the others' AMX-BF16 products): part of what a prefill profile depends on. */
bool kn_cpu_gemm_amx(const kn_cpu *c);
/* "TYPE: batch PATH, solo PATH; ..." for each weight type registered with map_matrix (the
 * model's), into buf; "" when none is. */
void kn_cpu_describe_paths(const kn_cpu *c, char *buf, size_t cap);
/* The start-up report of what runs (cpu_blas.h's line, then the paths), logged under who. */
void kn_cpu_log_what_runs(const kn_cpu *c, const char *who);

/* Which ISA the SIMD kernels use on this machine ("avx512", "avx2", "scalar"). */
const char *kn_cpu_isa(void);

/* ---- implemented in cpu_quant.c / cpu_matmul.c ---- */
/* F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 IQ4_NL Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_XS */
bool kn_cpu_type_supported(td_dtype t);
/* dst (n) = dequantized src; n a multiple of the block size. */
int kn_dequant_row(td_dtype t, const void *src, float *dst, int64_t n);
/* dst (n / 32 Q8_0 blocks) = src quantized by llama.cpp's reference rule (d = max|x| / 127,
 * q = round(x / d)); n a multiple of 32. Used to re-quantize tensor-parallel slices. */
int kn_quant_row_q8_0(const float *src, void *dst, int64_t n);
int kn_cpu_matmul(void *ctx, const kn_mat *w, const float *x, int64_t m, float *y);
int kn_cpu_matmul_mixed(void *ctx, const kn_mat *w, const float *x, int64_t m, int64_t m_solo,
                        float *y);
int kn_cpu_get_rows(void *ctx, const kn_mat *w, const int32_t *ids, int64_t m, float *out);

/* ---- implemented in cpu_fused.c (kn_backend.h's fused ops) ---- */
int kn_cpu_matmul_multi(void *ctx, int n_w, const kn_mat *const *w, const float *x, int64_t m,
                        int64_t m_solo, float *const *y);
int kn_cpu_glu_ffn(void *ctx, const kn_mat *wg, const kn_mat *wu, const float *x, int64_t m,
                   int64_t m_solo, bool gelu, float *gate, float *up, float *out);
int kn_cpu_matmul_add(void *ctx, const kn_mat *w, const float *x, int64_t m, int64_t m_solo,
                      float *y, float *acc);
/* Whether kn_cpu_backend's table carries the fused ops: on unless TANDEM_CPU_FUSED=0 at
 * kn_cpu_create (the same binary then runs the unfused sequences, for A/B measurements);
 * any other value than 0 or 1 is an error (TD_EINVAL). */
bool kn_cpu_fused(const kn_cpu *c);

/* ---- implemented in cpu_ops.c / cpu_attention.c ---- */
void kn_cpu_rmsnorm(void *ctx, const float *x, const float *weight, float *y, int64_t m, int64_t n,
                    float eps);
void kn_cpu_rope(void *ctx, float *x, int64_t m, int n_heads, int head_dim, int n_rot,
                 const int32_t *pos, const float *freq, bool neox);
void kn_cpu_swiglu(void *ctx, const float *gate, const float *up, float *out, int64_t m, int64_t n);
void kn_cpu_geglu(void *ctx, const float *gate, const float *up, float *out, int64_t m, int64_t n);
void kn_cpu_kv_write(void *ctx, void *kpool, void *vpool, td_dtype kv_type, int block_size,
                     const kn_kv_slicing *slicing, int n_kv_heads, int head_dim, const float *k,
                     const float *v, int64_t m, const int32_t *pos, const int32_t *seq_of,
                     const kn_seq_view *seqs);
void kn_cpu_attention(void *ctx, const float *q, const void *kpool, const void *vpool,
                      td_dtype kv_type, int block_size, const kn_kv_slicing *slicing, int n_heads,
                      int n_kv_heads, int group, int phase, int head_dim, float scale, int window,
                      float softcap, int64_t m, int64_t m_solo, const int32_t *pos,
                      const int32_t *seq_of, const kn_seq_view *seqs, float *out);

/* ---- implemented in cpu_arith.c ---- */
void kn_cpu_add(void *ctx, float *y, const float *x, int64_t m, int64_t n);
void kn_cpu_add_row(void *ctx, float *y, const float *b, int64_t m, int64_t n);
void kn_cpu_scale(void *ctx, float *x, int64_t n, float s);
void kn_cpu_copy_rows(void *ctx, const float *src, const int32_t *rows, int64_t m, int64_t n,
                      float *dst);
int kn_cpu_experts_ffn(void *ctx, int n, const kn_mat *const *wg, const kn_mat *const *wu,
                       const kn_mat *const *wd, const float *const *x, const int64_t *m,
                       const int64_t *m_solo, bool gelu, float *const *gate, float *const *up,
                       float *const *y);
void kn_cpu_weighted_rows_sum(void *ctx, const float *x, const int32_t *idx, const float *w, int k,
                              int64_t m, int64_t n, float *y);
void kn_cpu_copy_2d(void *ctx, const float *src, int64_t src_stride, float *dst, int64_t dst_stride,
                    int64_t m, int64_t n);

/* ---- machine ceilings for benchmarks (cpu_ceilings.c) ---- */
/* Streaming-sum read bandwidth over a buffer of `bytes`, all pool threads: GB/s (median
 * of reps). */
double kn_cpu_mem_read_gbps(kn_cpu *c, size_t bytes, int reps);
/* OpenBLAS sgemm n x n x n with the pool's thread count: GFLOP/s (median of reps). */
double kn_cpu_sgemm_gflops(kn_cpu *c, int n, int reps);

#endif
