/* kn_backend.h: the compute backend ops table the model code calls, and the weight
 * matrix view (kn_mat) every backend understands.
 *
 * Purpose: the forward pass (kernels/model_*.c) never calls a CPU or CUDA kernel by name;
 * it calls backend->ops->x(backend->ctx, ...), so a CUDA backend slots in without touching
 * the model code.
 * Invariants: all buffers passed to ops live in the backend's memory (host memory for cpu,
 * from ops->alloc for a device backend) and are row-major float32 unless stated; shapes are
 * in the comments. A device backend queues its ops in order on one stream: an op's result
 * is visible to the next op at once, and to the host after download or synchronize (the
 * cpu backend fans out to its thread pool and returns when all threads are done, so for it
 * every op is synchronous).
 * Construction: kn_backend_create(name, options) (kn_backends.h) is the one constructor;
 * a backend that is not built in, or has no usable device, is a clear error at start-up
 * (TD_EUNSUPP, the reason logged), never a silent fall-back to another backend.
 * Threading: one thread drives a backend at a time (the process's engine loop).
 * Ownership: a kn_mat borrows its data (usually the GGUF mapping); the backend owns its
 * thread pool, streams, scratch and every buffer it allocated; kn_backend_destroy frees it.
 */
#ifndef KN_BACKEND_H
#define KN_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_dtype.h"

/* A weight matrix W of n_rows x n_cols in GGUF storage type. Row r starts at
 * data + r * row_stride. A tensor-parallel slice is just a view: column-parallel slices
 * move data by whole rows; row-parallel slices move data by whole blocks within a row and
 * keep the full row_stride (so n_cols must be a multiple of the type's block size). */
typedef struct {
    td_dtype type;
    int64_t n_rows;    /* output features */
    int64_t n_cols;    /* input features (k) */
    size_t row_stride; /* bytes between consecutive rows */
    const void *data;  /* first used element of row 0 */
} kn_mat;

/* One sequence's view of a paged KV layer, as the attention op reads it. */
typedef struct {
    const int32_t *block_table; /* (n_blocks_used) block ids of this sequence */
    int32_t n_ctx;              /* positions [0, n_ctx) are valid in the pool */
} kn_seq_view;

/* How one layer's K (or V) array of a paged KV pool lays out its tiles: a tile is one
 * (block, KV head) pair's (block_size, head_dim) elements, contiguous in every layout.
 * Head-major (NULL, or n_slices 0 or 1; the default): (n_blocks, n_kv_heads, block_size,
 * head_dim). Sliced (n_slices > 1, a prefill stage's pool whose decode ranks hold parts of
 * its heads): the KV heads are cut into n_slices consecutive slices of slice_heads[s]
 * heads (summing to n_kv_heads), and the array holds slice 0's (n_blocks, slice_heads[0],
 * block_size, head_dim), then slice 1's, ...: kvxfer's sliced source layout
 * (kvxfer/kvx_conn.h, kvx_layout_off), so a slice's part of a run of consecutive blocks is
 * one contiguous range. */
#define KN_KV_MAX_SLICES 16
typedef struct {
    int32_t n_blocks; /* blocks per layer array (needed only when sliced) */
    int32_t n_slices; /* 0 or 1: head-major */
    int32_t slice_heads[KN_KV_MAX_SLICES];
} kn_kv_slicing;

/* The tile of (block blk, KV head h, 0 <= h < n_kv_heads) in a layer array laid out by s
 * (NULL: head-major): its elements start at tile * block_size * head_dim. The one place a
 * (block, head) becomes an offset: every kernel and block copy addresses the pool through
 * it. For head-major pools it is blk * n_kv_heads + h, as before slicing existed. */
static inline int64_t kn_kv_tile(const kn_kv_slicing *s, int n_kv_heads, int64_t blk, int h)
{
    if (!s || s->n_slices <= 1) return blk * n_kv_heads + h;
    int s0 = 0, i = 0; /* slice i holds heads [s0, s0 + slice_heads[i]) */
    while (i + 1 < s->n_slices && h >= s0 + s->slice_heads[i])
        s0 += s->slice_heads[i++];
    return (int64_t)s0 * s->n_blocks + blk * s->slice_heads[i] + (h - s0);
}

/* Most matrices one matmul_multi call takes (q, k and v). */
#define KN_MULTI_MAX 3

typedef struct {
    const char *name;

    /* ---- lifetime and memory ---- */
    /* Frees the backend (ctx) and everything it allocated. */
    void (*destroy)(void *ctx);
    /* One line for logs: "cpu avx512, 2 threads", "cuda NVIDIA H100 (sm_90, 79 GiB)". */
    void (*describe)(void *ctx, char *buf, size_t cap);
    /* true: the backend computes on host memory, so host arrays (batch inputs, model
     * weights) may be passed to ops as they are, and alloc/upload/download are malloc and
     * memcpy. false: the caller stages host data through alloc + upload. */
    bool host_memory;
    /* true: kv_write and attention address a sliced pool (kn_kv_slicing); false: they take
     * head-major pools only (kn_kv_pool_create refuses a sliced pool on this backend). */
    bool kv_sliced;
    /* bytes of backend memory, 64-byte aligned, or NULL (out of memory). free(NULL) is a
     * no-op. */
    void *(*alloc)(void *ctx, size_t bytes);
    void (*free)(void *ctx, void *p);
    /* dst (backend memory) = src (host), bytes; ordered after the ops queued before it, and
     * src may be reused when it returns. */
    int (*upload)(void *ctx, void *dst, const void *src, size_t bytes);
    /* dst (host) = src (backend memory), bytes; waits for the ops queued before it. */
    int (*download)(void *ctx, void *dst, const void *src, size_t bytes);
    /* Waits until every queued op finished; returns the first asynchronous error, if any. */
    int (*synchronize)(void *ctx);
    /* Optional (NULL: the caller stages through malloc'ed memory): bytes of host memory the
     * device copies to and from fastest (page-locked: cudaMallocHost), 64-byte aligned, or
     * NULL. An upload from it may still be reading it when upload returns: the caller
     * rewrites it only after a later download or synchronize. host_free(NULL) is a no-op.
     * The engine stages its tensor-parallel collectives through it (engine_stage.c). */
    void *(*host_alloc)(void *ctx, size_t bytes);
    void (*host_free)(void *ctx, void *p);
    /* Device backends (host_memory false), NULL otherwise (but see below): make the backend's own
     * copy of a model's read-only host data, once, before the first op that reads it (the engine
     * calls these for every weight matrix and vector of its shard at kn_engine_create).
     * From then on ops take the host pointer (w->data, a norm's weight, a bias, the rope
     * frequencies) and read the copy, so the model code passes the same pointers to every
     * backend. map_matrix may repack a strided slice (row-parallel TP views) compactly;
     * map_vector copies n floats. Mapping the same pointer again is a no-op.
     * A host-memory backend may set map_matrix alone (map_vector NULL): the engine then
     * names the shard's weight matrices to it, read-only and alive until the backend is
     * destroyed, and the backend may keep derived copies (the CPU backend's packed q8
     * weights, cpu_packed.c); ops still take w->data. */
    int (*map_matrix)(void *ctx, const kn_mat *w);
    int (*map_vector)(void *ctx, const float *v, int64_t n);

    /* y (m, w->n_rows) = x (m, w->n_cols) * W^T. */
    int (*matmul)(void *ctx, const kn_mat *w, const float *x, int64_t m, float *y);

    /* Optional (NULL: the engine calls matmul on each of the first m_solo rows alone, then
     * once on the rest). y (m, w->n_rows) = x (m, w->n_cols) * W^T where each of the first
     * m_solo rows is computed as if it were alone: its row of y is bit-identical to matmul
     * of that one row (m == 1), whatever the other rows are and however many; rows
     * [m_solo, m) are bit-identical to matmul of those rows alone. 0 <= m_solo <= m.
     * The decode scheduler puts its one-token decode rows first, so a request's tokens do
     * not depend on what else is batched with it, while prefill rows keep batch kernels. */
    int (*matmul_mixed)(void *ctx, const kn_mat *w, const float *x, int64_t m, int64_t m_solo,
                        float *y);

    /* ---- optional fused ops: NULL, and the engine runs the sequence each one names. A
     * backend's fused op gives the bits of that sequence on its own ops, on every row. ---- */
    /* y[i] (m, w[i]->n_rows) = x (m, n_cols) * W_i^T for i < n_w (1..KN_MULTI_MAX), all W_i
     * of n_cols columns, rows [0, m_solo) solo: the sequence matmul_mixed(w[i], x, m, m_solo,
     * y[i]) for each i (matmul when m_solo is 0), in one pass over the threads (q, k, v). */
    int (*matmul_multi)(void *ctx, int n_w, const kn_mat *const *w, const float *x, int64_t m,
                        int64_t m_solo, float *const *y);
    /* out (m, F) = act(x Wg^T) * (x Wu^T), act silu (gelu false) or gelu (tanh), with gate
     * and up (m, F) holding the two products (F = wg->n_rows = wu->n_rows); out may equal
     * gate. The sequence: matmul_mixed(wg, x, m, m_solo, gate), matmul_mixed(wu, ..., up),
     * swiglu or geglu(gate, up, out, m, F). */
    int (*glu_ffn)(void *ctx, const kn_mat *wg, const kn_mat *wu, const float *x, int64_t m,
                   int64_t m_solo, bool gelu, float *gate, float *up, float *out);
    /* acc (m, w->n_rows) += x (m, w->n_cols) * W^T, with y (m, n_rows) holding the product:
     * the sequence matmul_mixed(w, x, m, m_solo, y), add(acc, y, m, n_rows) (an output
     * projection and its residual add). */
    int (*matmul_add)(void *ctx, const kn_mat *w, const float *x, int64_t m, int64_t m_solo,
                      float *y, float *acc);

    /* The experts of a mixture-of-experts layer, each on its own rows: for each group
     * i < n, gate[i] = act(x[i] Wg_i^T) * (x[i] Wu_i^T) (up[i] holding the up product) and
     * y[i] = gate[i] Wd_i^T, x[i] (m[i], n_cols) with rows [0, m_solo[i]) solo: the sequence
     * glu_ffn(wg[i], wu[i], x[i], m[i], m_solo[i], gelu, gate[i], up[i], gate[i]),
     * matmul_mixed(wd[i], gate[i], m[i], m_solo[i], y[i]) for each i, with its bits. */
    int (*experts_ffn)(void *ctx, int n, const kn_mat *const *wg, const kn_mat *const *wu,
                       const kn_mat *const *wd, const float *const *x, const int64_t *m,
                       const int64_t *m_solo, bool gelu, float *const *gate, float *const *up,
                       float *const *y);

    /* y (m, n) = x / rms(x) * weight (n); y may equal x. */
    void (*rmsnorm)(void *ctx, const float *x, const float *weight, float *y, int64_t m, int64_t n,
                    float eps);

    /* Rotate x (m, n_heads, head_dim) in place at positions pos (m). freq (head_dim/2) are
     * the per-pair inverse frequencies (rope scaling already folded in); neox selects the
     * pairing (i, i + d/2) instead of (2i, 2i+1). Only the first n_rot dims rotate. */
    void (*rope)(void *ctx, float *x, int64_t m, int n_heads, int head_dim, int n_rot,
                 const int32_t *pos, const float *freq, bool neox);

    /* out (m, n) = silu(gate) * up, gate/up (m, n). */
    void (*swiglu)(void *ctx, const float *gate, const float *up, float *out, int64_t m, int64_t n);

    /* out (m, n) = gelu(gate) * up with the tanh approximation of GELU (gemma's FFN). */
    void (*geglu)(void *ctx, const float *gate, const float *up, float *out, int64_t m, int64_t n);

    /* Write k, v (m, n_kv_heads, head_dim) of tokens at positions pos into the paged pool
     * layer (kpool/vpool: tiles of (block_size, head_dim) laid out by slicing, NULL
     * head-major (n_blocks, n_kv_heads, block_size, head_dim); kv_type F32/F16) through
     * each token's sequence view seq[seq_of[i]]. vpool == kpool (a latent pool, kv_pool.h
     * KN_KV_LAYOUT_LATENT: its V is its K): k only is written, once, and v is not read. */
    void (*kv_write)(void *ctx, void *kpool, void *vpool, td_dtype kv_type, int block_size,
                     const kn_kv_slicing *slicing, int n_kv_heads, int head_dim, const float *k,
                     const float *v, int64_t m, const int32_t *pos, const int32_t *seq_of,
                     const kn_seq_view *seqs);

    /* Causal attention with an online softmax: token i (at pos[i], sequence seq_of[i])
     * attends to positions [0, pos[i]] of its sequence, or with window > 0 (sliding-window
     * layers) to the window positions [max(0, pos[i] - window + 1), pos[i]] only.
     * q (m, n_heads, head_dim), out (m, n_heads, head_dim). Head h reads KV head
     * (phase + h) / group of the n_kv_heads in the pool (common/td_tp.h: group is the
     * model's query heads per KV head, phase the rank's offset into its first group; an
     * unsplit model has group n_heads / n_kv_heads and phase 0).
     * Rows [0, m_solo) are the batch's solo rows (model.h: one-token decode rows): a
     * backend that picks its kernel by the row count must compute them as it would a batch
     * of that one row, so their results never depend on the batch (cuda and cpu do: the
     * cpu backend cuts each solo row's keys across threads as it would cut that row alone,
     * and only the rows [m_solo, m) share one cut). The pool's layout (slicing) as in
     * kv_write. softcap > 0 (gemma2's attention logit soft-capping) turns each score
     * s = q.k * scale into softcap * tanh(s / softcap) before the softmax (llama.cpp's order:
     * after the scale, before the mask); 0: no cap, and the uncapped bits. */
    void (*attention)(void *ctx, const float *q, const void *kpool, const void *vpool,
                      td_dtype kv_type, int block_size, const kn_kv_slicing *slicing, int n_heads,
                      int n_kv_heads, int group, int phase, int head_dim, float scale, int window,
                      float softcap, int64_t m, int64_t m_solo, const int32_t *pos,
                      const int32_t *seq_of, const kn_seq_view *seqs, float *out);

    /* out (m, n_cols) = rows ids[i] of W (any supported type), dequantized. */
    int (*get_rows)(void *ctx, const kn_mat *w, const int32_t *ids, int64_t m, float *out);

    /* y (m, n) += x (m, n). */
    void (*add)(void *ctx, float *y, const float *x, int64_t m, int64_t n);
    /* y (m, n) += b (n) on every row. */
    void (*add_row)(void *ctx, float *y, const float *b, int64_t m, int64_t n);
    /* x (n) *= s (gemma3's embedding scale). */
    void (*scale)(void *ctx, float *x, int64_t n, float s);
    /* dst (m, n) = src rows rows[i] (each of n floats). */
    void (*copy_rows)(void *ctx, const float *src, const int32_t *rows, int64_t m, int64_t n,
                      float *dst);

    /* Optional (NULL: the engine refuses mixture-of-experts models on the backend).
     * y (m, n): y[i] = sum over j < k of w[i * k + j] * x[idx[i * k + j]], the j terms added
     * in order from 0.0f; x (rows, n), idx and w (m, k). A mixture-of-experts layer's combine:
     * row i's k chosen experts' outputs, weighted by their gate values. Row i's result reads
     * only its own idx, w and x rows, so it does not depend on the other rows. */
    void (*weighted_rows_sum)(void *ctx, const float *x, const int32_t *idx, const float *w, int k,
                              int64_t m, int64_t n, float *y);
    /* Optional (NULL: the engine refuses latent-attention models on the backend).
     * dst[i * dst_stride + j] = src[i * src_stride + j] for i < m, j < n: a strided 2-D copy
     * (a block of columns of one row-major matrix into another's; src and dst do not
     * overlap). */
    void (*copy_2d)(void *ctx, const float *src, int64_t src_stride, float *dst, int64_t dst_stride,
                    int64_t m, int64_t n);
} kn_backend_ops;

typedef struct {
    const kn_backend_ops *ops;
    void *ctx;
} kn_backend;

#endif
