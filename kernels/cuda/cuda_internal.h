/* cuda_internal.h: what the CUDA backend's files share: the backend object, the map from
 * host weight pointers to their device copies, the sticky error of the void ops, device
 * scratch, and the ops the .cu files export to cuda_backend.c's table.
 *
 * Purpose: cuda_backend.c (host C: context, memory ops, the table), cuda_map.c (host C:
 * map_matrix / map_vector and lookups), cuda_matmul.cu (matmul, get_rows), cuda_ops.cu
 * (element ops), cuda_attention.cu (kv_write, attention) meet here. Included from C and
 * from nvcc's C++ (the declarations are extern "C").
 * Invariants: every op queues on c->stream. An op that returns void and fails (a launch
 * error, an unsupported shape) records the first such failure in c->err / c->err_op
 * (kn_cu_fail); synchronize and download return it (and clear it), so no failure passes
 * silently. c->last_op names the last op queued, for asynchronous errors (with
 * TANDEM_CUDA_SYNC=1 in the environment every op synchronizes, naming the failing kernel).
 * Threading: one thread drives a backend (kn_backend.h).
 */
#ifndef KN_CUDA_INTERNAL_H
#define KN_CUDA_INTERNAL_H

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "kn_backend.h"

/* One mapped host pointer: its device copy (matrices packed compactly: row stride
 * dev_stride = the bytes of one row). */
typedef struct {
    const void *host; /* NULL: empty slot */
    void *dev;
    td_dtype type;
    int64_t n_rows, n_cols; /* a vector: n_rows 1, type F32 */
    size_t dev_stride;
    float *f32; /* the matrix dequantized to float32 for the GEMM path, made at its first
                 * GEMM while the cache budget lasts (NULL: not made, or over budget) */
} kn_cu_map_entry;

typedef struct {
    kn_cu_map_entry *slots; /* open addressing, linear probing; cap a power of 2 */
    size_t cap, used;
    size_t bytes;      /* device bytes held by the copies */
    size_t f32_bytes;  /* of them, by float32 copies of quantized matrices */
    size_t f32_budget; /* most bytes the float32 copies may take (TANDEM_CUDA_F32_CACHE_MB) */
} kn_cu_map;

#define KN_CU_PROF_MAX 32

typedef struct {
    int device;
    cudaStream_t stream;
    cublasHandle_t blas;
    char name[256];
    int cc_major, cc_minor, n_sm;
    size_t mem_bytes;
    kn_cu_map map;
    /* device scratch, grown on demand (freed after the stream drained) */
    void *scratch;
    size_t scratch_cap;
    /* device flags the kernels raise on bad input they cannot return: [0] a get_rows id
     * out of range, [1] a kv_write/attention position outside its sequence view (or a
     * negative block id); -1 when clear; read back at synchronize/download (host_flag is
     * pinned) */
    int32_t *dev_flag, *host_flag;
    int err;          /* first failure of a void op (TD_E*), 0 if none */
    char err_op[160]; /* what failed */
    const char *last_op;
    bool sync_each; /* TANDEM_CUDA_SYNC=1 */
    /* TANDEM_CUDA_PROFILE=1: every op synchronizes and its wall time (launches and run,
     * from the end of the previous op or copy) is summed per op name; the table goes to
     * stderr when the backend is destroyed. Slows the ops down (no overlap of launches
     * with work): a breakdown, not a throughput figure. */
    bool profile;
    int64_t prof_t;
    struct {
        const char *op;
        double ms;
        long calls;
    } prof[KN_CU_PROF_MAX];
    int n_prof;
} kn_cuda;

/* ---- errors ---- */

/* Logs "cuda: <what>: <error>" and maps the error to TD_ENOMEM / TD_EIO. */
int kn_cu_error(cudaError_t e, const char *what);
/* Records the first failure of a void op (logged by the caller). */
void kn_cu_fail(kn_cuda *c, int rc, const char *op);
/* After queueing op's kernels: the launch error, if any (recorded and returned), and with
 * sync_each a stream synchronize naming op. */
int kn_cu_check(kn_cuda *c, const char *op);

/* ---- scratch ---- */

/* Device scratch of at least bytes (contents undefined; valid until the next call). */
void *kn_cu_scratch(kn_cuda *c, size_t bytes);

/* ---- weight map (cuda_map.c) ---- */

void kn_cu_map_free(kn_cuda *c);
int kn_cu_map_matrix(void *ctx, const kn_mat *w);
int kn_cu_map_vector(void *ctx, const float *v, int64_t n);
/* The map entry of host pointer p, NULL when p is not mapped. */
kn_cu_map_entry *kn_cu_map_entry_of(kn_cuda *c, const void *p);
/* The device copy of host pointer p, or p itself when it is not mapped (then it is taken
 * as device memory already: an activation from ops->alloc). */
const void *kn_cu_ptr(const kn_cuda *c, const void *p);
/* *dw = w with data and row_stride of its device copy (w itself when not mapped). */
void kn_cu_mat(const kn_cuda *c, const kn_mat *w, kn_mat *dw);

/* ---- ops (cuda_matmul.cu, cuda_ops.cu, cuda_attention.cu) ---- */

int kn_cu_matmul(void *ctx, const kn_mat *w, const float *x, int64_t m, float *y);
int kn_cu_matmul_mixed(void *ctx, const kn_mat *w, const float *x, int64_t m, int64_t m_solo,
                       float *y);
int kn_cu_get_rows(void *ctx, const kn_mat *w, const int32_t *ids, int64_t m, float *out);
void kn_cu_rmsnorm(void *ctx, const float *x, const float *weight, float *y, int64_t m, int64_t n,
                   float eps);
void kn_cu_rope(void *ctx, float *x, int64_t m, int n_heads, int head_dim, int n_rot,
                const int32_t *pos, const float *freq, bool neox);
void kn_cu_swiglu(void *ctx, const float *gate, const float *up, float *out, int64_t m, int64_t n);
void kn_cu_geglu(void *ctx, const float *gate, const float *up, float *out, int64_t m, int64_t n);
void kn_cu_add(void *ctx, float *y, const float *x, int64_t m, int64_t n);
void kn_cu_add_row(void *ctx, float *y, const float *b, int64_t m, int64_t n);
void kn_cu_scale(void *ctx, float *x, int64_t n, float s);
void kn_cu_copy_rows(void *ctx, const float *src, const int32_t *rows, int64_t m, int64_t n,
                     float *dst);
void kn_cu_kv_write(void *ctx, void *kpool, void *vpool, td_dtype kv_type, int block_size,
                    const kn_kv_slicing *slicing, int n_kv_heads, int head_dim, const float *k,
                    const float *v, int64_t m, const int32_t *pos, const int32_t *seq_of,
                    const kn_seq_view *seqs);
void kn_cu_attention(void *ctx, const float *q, const void *kpool, const void *vpool,
                     td_dtype kv_type, int block_size, const kn_kv_slicing *slicing, int n_heads,
                     int n_kv_heads, int group, int phase, int head_dim, float scale, int window,
                     float softcap, int64_t m, int64_t m_solo, const int32_t *pos,
                     const int32_t *seq_of, const kn_seq_view *seqs, float *out);

#ifdef __cplusplus
}
#endif

#endif
