/* cuda_matmul.cu: the CUDA backend's matmul, matmul_mixed and get_rows (kn_backend.h).
 *
 * Two paths, chosen by the number of rows m of x:
 *   m <= MM_GEMV_MAX_M (8, decode-shaped): a dequantizing GEMV that reads the quantized
 *     weights directly. One warp per output row; each lane takes chunks of 32 weights of
 *     the row (a 32-weight block, or one eighth of a K-quant super-block), dequantizes
 *     them with kn_elem.h (the CPU's exact values) and accumulates w * x with fmaf into
 *     one sum per row of x; the lanes' sums are joined by a fixed xor butterfly. Every row
 *     of x gets the same operations in the same order whatever m is, so a row's result is
 *     bit-identical to matmul of that row alone: matmul_mixed relies on it, and sends its
 *     solo rows (a decode batch) here in launches of up to 32 rows (kernel instances for
 *     8, 16 and 32 rows). Measured on an H200 (SmolLM2-135M, 64 solo rows per step): 70 ms
 *     a step with launches of 8 rows, 67 ms with launches of 32 (each warp then does 4x
 *     the FMAs: the kernel is bound by its per-warp arithmetic, not by reading W), 38 ms
 *     through the GEMM. A batched kernel that keeps rows' order of operations is the next
 *     step (docs/gpu.md).
 *   m > 8 (prefill-shaped): cublasSgemm on the backend's stream (pedantic math: no
 *     TF32), y = x W^T, on a float32 copy of W made at its first GEMM and kept (map
 *     entry f32, within the budget TANDEM_CUDA_F32_CACHE_MB); past the budget W is
 *     dequantized per call into float32 tiles of rows in device scratch (at most
 *     MM_TILE_BYTES per tile). F32 weights are used as they are. Measured on an H200
 *     (SmolLM2-135M, batch 64): per-call dequantization took 17 % of the step.
 * Why 8: the GEMV reads W once per call whatever m is, and its cost grows with m only in
 * the FMAs; past a handful of rows a GEMM that reuses each weight across rows from shared
 * memory/registers wins. 8 is where llama.cpp's CUDA backend stops its "mmvq" kernels; not
 * tuned yet. float32 rather than fp16 copies keep the prefill result within float32
 * rounding of the CPU's (BF16 weights and K-quant values do not all fit fp16); fp16/TF32
 * tensor cores are the obvious next step (prefill 512 tokens on an H200 runs its GEMMs at
 * 5.3 TFLOP/s in pedantic fp32).
 * Types: kn_elem.h's (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K);
 * others are refused with TD_EUNSUPP (map_matrix refuses them already at load).
 * W is found through the weight map (cuda_map.c); x, y and get_rows' ids are device memory.
 * get_rows cannot return a bad id it finds on the device: it zeroes that output row and
 * raises the backend's flag, which the next synchronize/download reports (TD_ERANGE).
 * State: compiled for sm_80..sm_100; run on an NVIDIA H200 (sm_90) (cuda_backend.h).
 */
#include "cuda_device.cuh"

#define MM_GEMV_MAX_M  8  /* more non-solo rows than this take the GEMM */
#define MM_GEMV_SOLO_M 32 /* solo rows per GEMV launch (kernel tiers 8, 16, 32) */
#define MM_GEMV_WARPS  4  /* output rows per block */
#define MM_TILE_BYTES  ((size_t)256 << 20)

/* The 32 weights of chunk u of a row at row (float types: elements 32 u .., zero past
 * n_cols). */
template <int T>
__device__ __forceinline__ void load_chunk(const uint8_t *row, int64_t u, int64_t n_cols,
                                           float wq[32])
{
    const td_dtype t = (td_dtype)T;
    if (kn_elem_is_float(t)) {
        const int es = kn_elem_block_bytes(t);
#pragma unroll
        for (int k = 0; k < 32; k++) {
            const int64_t e = u * 32 + k;
            wq[k] = e < n_cols ? kn_elem_float(t, row + e * es) : 0.0f;
        }
    } else if (kn_elem_is_k(t)) {
        kn_elem_kchunk(t, row + (u / 8) * kn_elem_block_bytes(t), (int)(u % 8), wq);
    } else {
        kn_elem_q32(t, row + u * kn_elem_block_bytes(t), wq);
    }
}

/* MAXM: the most rows of x one launch takes (8, 16 or 32: the solo rows of a decode batch
 * go through here, in launches of up to 32 rows, each reading W once). A row's operations
 * do not depend on MAXM or m. */
template <int T, int MAXM>
__global__ void k_gemv(const uint8_t *w, size_t stride, int64_t n_rows, int64_t n_cols,
                       const float *x, int m, float *y)
{
    const int lane = threadIdx.x % KN_WARP;
    const int64_t r = (int64_t)blockIdx.x * MM_GEMV_WARPS + threadIdx.x / KN_WARP;
    if (r >= n_rows) return;
    const uint8_t *row = w + (size_t)r * stride;
    const int64_t n_units = (n_cols + 31) / 32;
    float acc[MAXM];
#pragma unroll
    for (int j = 0; j < MAXM; j++)
        acc[j] = 0.0f;
    for (int64_t u = lane; u < n_units; u += KN_WARP) {
        float wq[32];
        load_chunk<T>(row, u, n_cols, wq);
        const int kmax = n_cols - u * 32 < 32 ? (int)(n_cols - u * 32) : 32;
#pragma unroll
        for (int j = 0; j < MAXM; j++) {
            if (j >= m) break;
            const float *xj = x + (int64_t)j * n_cols + u * 32;
            float a = acc[j];
            /* unrolled with a guard: wq stays in registers (a loop to kmax indexes it) */
#pragma unroll
            for (int k = 0; k < 32; k++)
                if (k < kmax) a = fmaf(wq[k], __ldg(xj + k), a);
            acc[j] = a;
        }
    }
#pragma unroll
    for (int j = 0; j < MAXM; j++) {
        if (j >= m) break;
        const float s = kn_cu_warp_sum(acc[j]);
        if (lane == 0) y[(int64_t)j * n_rows + r] = s;
    }
}

/* out (R, n_cols) float32 = rows [r0, r0 + R) of W, dequantized; one thread per chunk. */
template <int T>
__global__ void k_dequant_rows(const uint8_t *w, size_t stride, int64_t r0, int64_t R,
                               int64_t n_cols, float *out)
{
    const int64_t n_units = (n_cols + 31) / 32;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < R * n_units;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = e / n_units, u = e % n_units;
        float wq[32];
        load_chunk<T>(w + (size_t)(r0 + r) * stride, u, n_cols, wq);
        float *o = out + r * n_cols + u * 32;
        const int kmax = n_cols - u * 32 < 32 ? (int)(n_cols - u * 32) : 32;
#pragma unroll
        for (int k = 0; k < 32; k++)
            if (k < kmax) o[k] = wq[k];
    }
}

/* One row of get_rows: out row i = row ids[i] of W, or zeros and the flag for a bad id. */
template <int T>
__global__ void k_get_rows(const uint8_t *w, size_t stride, int64_t n_rows, int64_t n_cols,
                           const int32_t *ids, float *out, int32_t *flag)
{
    const int64_t i = blockIdx.x;
    const int32_t id = ids[i];
    const int64_t n_units = (n_cols + 31) / 32;
    float *o = out + i * n_cols;
    if (id < 0 || id >= n_rows) {
        for (int64_t e = threadIdx.x; e < n_cols; e += blockDim.x)
            o[e] = 0.0f;
        if (threadIdx.x == 0) *flag = id;
        return;
    }
    for (int64_t u = threadIdx.x; u < n_units; u += blockDim.x) {
        float wq[32];
        load_chunk<T>(w + (size_t)id * stride, u, n_cols, wq);
        const int kmax = n_cols - u * 32 < 32 ? (int)(n_cols - u * 32) : 32;
#pragma unroll
        for (int k = 0; k < 32; k++)
            if (k < kmax) o[u * 32 + k] = wq[k];
    }
}

/* Calls F<T>::run(args...) for the runtime type t; false for a type not handled here. */
#define MM_DISPATCH(t, F, ...)                                                                     \
    ([&]() -> bool {                                                                               \
        switch (t) {                                                                               \
        case TD_F32:                                                                               \
            F<TD_F32>(__VA_ARGS__);                                                                \
            return true;                                                                           \
        case TD_F16:                                                                               \
            F<TD_F16>(__VA_ARGS__);                                                                \
            return true;                                                                           \
        case TD_BF16:                                                                              \
            F<TD_BF16>(__VA_ARGS__);                                                               \
            return true;                                                                           \
        case TD_Q8_0:                                                                              \
            F<TD_Q8_0>(__VA_ARGS__);                                                               \
            return true;                                                                           \
        case TD_Q4_0:                                                                              \
            F<TD_Q4_0>(__VA_ARGS__);                                                               \
            return true;                                                                           \
        case TD_Q4_1:                                                                              \
            F<TD_Q4_1>(__VA_ARGS__);                                                               \
            return true;                                                                           \
        case TD_Q5_0:                                                                              \
            F<TD_Q5_0>(__VA_ARGS__);                                                               \
            return true;                                                                           \
        case TD_Q5_1:                                                                              \
            F<TD_Q5_1>(__VA_ARGS__);                                                               \
            return true;                                                                           \
        case TD_Q4_K:                                                                              \
            F<TD_Q4_K>(__VA_ARGS__);                                                               \
            return true;                                                                           \
        case TD_Q5_K:                                                                              \
            F<TD_Q5_K>(__VA_ARGS__);                                                               \
            return true;                                                                           \
        case TD_Q6_K:                                                                              \
            F<TD_Q6_K>(__VA_ARGS__);                                                               \
            return true;                                                                           \
        default:                                                                                   \
            return false;                                                                          \
        }                                                                                          \
    }())

template <int T>
static void launch_gemv(cudaStream_t s, const kn_mat *w, const float *x, int m, float *y)
{
    const unsigned blocks = (unsigned)((w->n_rows + MM_GEMV_WARPS - 1) / MM_GEMV_WARPS);
    const uint8_t *d = (const uint8_t *)w->data;
    if (m <= MM_GEMV_MAX_M)
        k_gemv<T, MM_GEMV_MAX_M><<<blocks, MM_GEMV_WARPS * KN_WARP, 0, s>>>(
            d, w->row_stride, w->n_rows, w->n_cols, x, m, y);
    else if (m <= 2 * MM_GEMV_MAX_M)
        k_gemv<T, 2 * MM_GEMV_MAX_M><<<blocks, MM_GEMV_WARPS * KN_WARP, 0, s>>>(
            d, w->row_stride, w->n_rows, w->n_cols, x, m, y);
    else
        k_gemv<T, MM_GEMV_SOLO_M><<<blocks, MM_GEMV_WARPS * KN_WARP, 0, s>>>(
            d, w->row_stride, w->n_rows, w->n_cols, x, m, y);
}

template <int T>
static void launch_dequant(cudaStream_t s, const kn_mat *w, int64_t r0, int64_t R, float *out)
{
    const int64_t units = R * ((w->n_cols + 31) / 32);
    k_dequant_rows<T><<<kn_cu_blocks(units, 256), 256, 0, s>>>(
        (const uint8_t *)w->data, w->row_stride, r0, R, w->n_cols, out);
}

template <int T>
static void launch_get_rows(cudaStream_t s, const kn_mat *w, const int32_t *ids, int64_t m,
                            float *out, int32_t *flag)
{
    k_get_rows<T><<<(unsigned)m, 128, 0, s>>>((const uint8_t *)w->data, w->row_stride, w->n_rows,
                                              w->n_cols, ids, out, flag);
}

/* The checks every op taking a weight makes; logs and returns the error. */
static int mm_check(const kn_mat *w, const char *op)
{
    if (!kn_elem_type_supported(w->type)) {
        TD_LOG_ERR("cuda %s: weight type %s (%d) not supported by the cuda backend (it computes "
                   "with %s)",
                   op, td_dtype_name((uint32_t)w->type), (int)w->type, KN_ELEM_TYPES);
        return TD_EUNSUPP;
    }
    if (w->n_rows < 0 || w->n_rows > INT32_MAX || w->n_cols <= 0 || w->n_cols > INT32_MAX ||
        w->n_cols % kn_elem_block_len(w->type)) {
        TD_LOG_ERR("cuda %s: bad shape %lld x %lld for %s", op, (long long)w->n_rows,
                   (long long)w->n_cols, td_dtype_name((uint32_t)w->type));
        return TD_EINVAL;
    }
    return 0;
}

/* The float32 copy of quantized matrix w (its map entry e), made now if the budget
 * allows; NULL otherwise (the caller dequantizes tiles per call). The copy holds the
 * entry's rows, dequantized by the same kernel as the tiles: the same values. */
static const float *mm_f32_copy(kn_cuda *c, kn_cu_map_entry *e)
{
    if (!e || e->type == TD_F32 || e->n_rows <= 1) return NULL;
    if (e->f32) return e->f32;
    const size_t bytes = (size_t)e->n_rows * (size_t)e->n_cols * sizeof(float);
    if (c->map.f32_bytes + bytes > c->map.f32_budget) return NULL;
    float *p = NULL;
    if (cudaMalloc((void **)&p, bytes) != cudaSuccess) {
        cudaGetLastError(); /* out of memory here is not an error: tiles work too */
        c->map.f32_budget = c->map.f32_bytes; /* stop trying */
        return NULL;
    }
    kn_mat src = {.type = e->type,
                  .n_rows = e->n_rows,
                  .n_cols = e->n_cols,
                  .row_stride = e->dev_stride,
                  .data = e->dev};
    MM_DISPATCH(src.type, launch_dequant, c->stream, &src, 0, src.n_rows, p);
    if (kn_cu_check(c, "matmul (dequantize once)")) {
        cudaStreamSynchronize(c->stream);
        cudaFree(p);
        return NULL;
    }
    e->f32 = p;
    c->map.f32_bytes += bytes;
    return p;
}

/* y (m, n_rows) = x W^T by cublasSgemm on W's float32 copy, or on dequantized tiles when
 * it has none (dw: the device view; e: W's map entry). */
static int mm_gemm(kn_cuda *c, kn_cu_map_entry *e, const kn_mat *dw, const float *x, int64_t m,
                   float *y)
{
    const int64_t K = dw->n_cols, N = dw->n_rows;
    const float one = 1.0f, zero = 0.0f;
    const float *f32 = mm_f32_copy(c, e);
    if (f32) {
        cublasStatus_t st = cublasSgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)m, (int)K,
                                        &one, f32, (int)K, x, (int)K, &zero, y, (int)N);
        if (st != CUBLAS_STATUS_SUCCESS) {
            TD_LOG_ERR("cuda matmul: cublasSgemm failed (status %d)", (int)st);
            return TD_EIO;
        }
        return kn_cu_check(c, "matmul (sgemm)");
    }
    if (dw->type == TD_F32 && dw->row_stride % 4 == 0) {
        cublasStatus_t st = cublasSgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)m, (int)K,
                                        &one, (const float *)dw->data, (int)(dw->row_stride / 4), x,
                                        (int)K, &zero, y, (int)N);
        if (st != CUBLAS_STATUS_SUCCESS) {
            TD_LOG_ERR("cuda matmul: cublasSgemm failed (status %d)", (int)st);
            return TD_EIO;
        }
        return kn_cu_check(c, "matmul (sgemm)");
    }
    int64_t R = (int64_t)(MM_TILE_BYTES / ((size_t)K * sizeof(float)));
    if (R < 1) R = 1;
    if (R > N) R = N;
    float *tile = (float *)kn_cu_scratch(c, (size_t)R * K * sizeof(float));
    if (!tile) return TD_ENOMEM;
    for (int64_t r0 = 0; r0 < N; r0 += R) {
        const int64_t rn = N - r0 < R ? N - r0 : R;
        MM_DISPATCH(dw->type, launch_dequant, c->stream, dw, r0, rn, tile);
        int rc = kn_cu_check(c, "matmul (dequantize)");
        if (rc) return rc;
        cublasStatus_t st = cublasSgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)rn, (int)m, (int)K,
                                        &one, tile, (int)K, x, (int)K, &zero, y + r0, (int)N);
        if (st != CUBLAS_STATUS_SUCCESS) {
            TD_LOG_ERR("cuda matmul: cublasSgemm failed (status %d)", (int)st);
            return TD_EIO;
        }
        if ((rc = kn_cu_check(c, "matmul (sgemm)"))) return rc;
    }
    return 0;
}

/* Rows of x through the GEMV, up to MM_GEMV_SOLO_M at a time. */
static int mm_gemv_rows(kn_cuda *c, const kn_mat *dw, const float *x, int64_t m, float *y)
{
    for (int64_t i = 0; i < m; i += MM_GEMV_SOLO_M) {
        const int mi = (int)(m - i < MM_GEMV_SOLO_M ? m - i : MM_GEMV_SOLO_M);
        MM_DISPATCH(dw->type, launch_gemv, c->stream, dw, x + i * dw->n_cols, mi,
                    y + i * dw->n_rows);
        int rc = kn_cu_check(c, "matmul (gemv)");
        if (rc) return rc;
    }
    return 0;
}

extern "C" int kn_cu_matmul_mixed(void *ctx, const kn_mat *w, const float *x, int64_t m,
                                  int64_t m_solo, float *y)
{
    kn_cuda *c = (kn_cuda *)ctx;
    int rc = mm_check(w, "matmul");
    if (rc) return rc;
    if (m < 0 || m > INT32_MAX || m_solo < 0 || m_solo > m) {
        TD_LOG_ERR("cuda matmul: bad row counts m %lld, solo %lld", (long long)m,
                   (long long)m_solo);
        return TD_EINVAL;
    }
    if (m == 0 || w->n_rows == 0) return 0;
    kn_mat dw;
    kn_cu_mat(c, w, &dw);
    /* solo rows: the GEMV, which gives each row the bits of m == 1 */
    if (m_solo && (rc = mm_gemv_rows(c, &dw, x, m_solo, y))) return rc;
    const int64_t mb = m - m_solo;
    if (mb == 0) return 0;
    const float *xb = x + m_solo * w->n_cols;
    float *yb = y + m_solo * w->n_rows;
    return mb <= MM_GEMV_MAX_M ? mm_gemv_rows(c, &dw, xb, mb, yb)
                               : mm_gemm(c, kn_cu_map_entry_of(c, w->data), &dw, xb, mb, yb);
}

extern "C" int kn_cu_matmul(void *ctx, const kn_mat *w, const float *x, int64_t m, float *y)
{
    return kn_cu_matmul_mixed(ctx, w, x, m, 0, y);
}

extern "C" int kn_cu_get_rows(void *ctx, const kn_mat *w, const int32_t *ids, int64_t m, float *out)
{
    kn_cuda *c = (kn_cuda *)ctx;
    int rc = mm_check(w, "get_rows");
    if (rc) return rc;
    if (m < 0 || m > INT32_MAX) {
        TD_LOG_ERR("cuda get_rows: bad id count %lld", (long long)m);
        return TD_EINVAL;
    }
    if (m == 0) return 0;
    kn_mat dw;
    kn_cu_mat(c, w, &dw);
    MM_DISPATCH(dw.type, launch_get_rows, c->stream, &dw, ids, m, out, c->dev_flag);
    return kn_cu_check(c, "get_rows");
}
