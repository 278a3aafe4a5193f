/* cuda_ops.cu: the CUDA backend's element ops: rmsnorm, rope, swiglu, geglu, add, add_row,
 * scale and copy_rows (kn_backend.h has their contracts, kernels/cpu their reference).
 *
 * The formulas are kn_elem.h's (silu, tanh-GELU, the rope rotation in float64 angles), so
 * they match the CPU backend to a few ulps (its SIMD exp and fused multiply-adds differ);
 * rmsnorm sums squares in float64 as cpu_ops.c does. Weight vectors (rmsnorm's weight,
 * add_row's bias, rope's freq) are host pointers looked up in the weight map
 * (cuda_map.c); everything else is device memory. pos and rows arrays are device memory.
 * These ops return void: a launch failure is recorded (kn_cu_check) and returned by the
 * next synchronize or download.
 * State: compiled for sm_80..sm_100; run on an NVIDIA H200 (sm_90) (cuda_backend.h).
 */
#include "cuda_device.cuh"

/* ---- rmsnorm: one block per row ---- */

#define RMS_THREADS 256

__global__ void k_rmsnorm(const float *x, const float *w, float *y, int64_t n, float eps)
{
    const float *xr = x + (int64_t)blockIdx.x * n;
    float *yr = y + (int64_t)blockIdx.x * n;
    double s = 0.0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
        s += (double)xr[j] * (double)xr[j];
    __shared__ double part[RMS_THREADS / KN_WARP];
#pragma unroll
    for (int o = KN_WARP / 2; o > 0; o >>= 1)
        s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x % KN_WARP == 0) part[threadIdx.x / KN_WARP] = s;
    __syncthreads();
    double tot = 0.0;
    for (int i = 0; i < RMS_THREADS / KN_WARP; i++)
        tot += part[i];
    const float scale = (float)(1.0 / sqrt(tot / (double)n + (double)eps));
    /* (x * scale) * weight, as cpu_ops.c (y may equal x: each element read then written
     * by the same thread) */
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
        yr[j] = __fmul_rn(xr[j], scale) * w[j];
}

extern "C" void kn_cu_rmsnorm(void *ctx, const float *x, const float *weight, float *y, int64_t m,
                              int64_t n, float eps)
{
    kn_cuda *c = (kn_cuda *)ctx;
    if (m <= 0) return;
    if (n <= 0 || m > INT32_MAX) {
        TD_LOG_ERR("cuda rmsnorm: bad shape m %lld, n %lld", (long long)m, (long long)n);
        kn_cu_fail(c, TD_EINVAL, "rmsnorm");
        return;
    }
    const float *w = (const float *)kn_cu_ptr(c, weight);
    k_rmsnorm<<<(unsigned)m, RMS_THREADS, 0, c->stream>>>(x, w, y, n, eps);
    kn_cu_check(c, "rmsnorm");
}

/* ---- rope: one thread per (token, pair), over all heads ---- */

__global__ void k_rope(float *x, int64_t m, int n_heads, int head_dim, int half, const int32_t *pos,
                       const float *freq, int neox)
{
    const int stride = neox ? 1 : 2, off = neox ? half : 1;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < m * half;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = e / half;
        const int i = (int)(e % half);
        float cs, sn;
        kn_elem_rope_cs(pos[t], freq[i], &cs, &sn);
        float *row = x + t * n_heads * head_dim + (int64_t)i * stride;
        for (int h = 0; h < n_heads; h++) {
            float *a = row + (int64_t)h * head_dim;
            kn_elem_rope_pair(&a[0], &a[off], cs, sn);
        }
    }
}

extern "C" void kn_cu_rope(void *ctx, float *x, int64_t m, int n_heads, int head_dim, int n_rot,
                           const int32_t *pos, const float *freq, bool neox)
{
    kn_cuda *c = (kn_cuda *)ctx;
    if (n_rot < 0 || n_rot > head_dim || n_rot % 2 || n_heads <= 0) {
        TD_LOG_ERR("cuda rope: bad n_rot %d (head_dim %d, %d heads)", n_rot, head_dim, n_heads);
        kn_cu_fail(c, TD_EINVAL, "rope");
        return;
    }
    if (m <= 0 || n_rot == 0) return;
    const float *f = (const float *)kn_cu_ptr(c, freq);
    const int half = n_rot / 2;
    k_rope<<<kn_cu_blocks(m * half, 128), 128, 0, c->stream>>>(x, m, n_heads, head_dim, half, pos,
                                                               f, neox ? 1 : 0);
    kn_cu_check(c, "rope");
}

/* ---- gated activations, add, scale ---- */

template <int GELU> __global__ void k_glu(const float *g, const float *u, float *o, int64_t n)
{
    for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; j < n;
         j += (int64_t)gridDim.x * blockDim.x)
        o[j] = (GELU ? kn_elem_gelu_tanh(g[j]) : kn_elem_silu(g[j])) * u[j];
}

static void glu(kn_cuda *c, const float *gate, const float *up, float *out, int64_t m, int64_t n,
                bool gelu)
{
    const char *op = gelu ? "geglu" : "swiglu";
    if (m < 0 || n <= 0) {
        TD_LOG_ERR("cuda %s: bad shape m %lld, n %lld", op, (long long)m, (long long)n);
        kn_cu_fail(c, TD_EINVAL, op);
        return;
    }
    if (m == 0) return;
    const int64_t total = m * n;
    if (gelu)
        k_glu<1><<<kn_cu_blocks(total, 256), 256, 0, c->stream>>>(gate, up, out, total);
    else
        k_glu<0><<<kn_cu_blocks(total, 256), 256, 0, c->stream>>>(gate, up, out, total);
    kn_cu_check(c, op);
}

extern "C" void kn_cu_swiglu(void *ctx, const float *gate, const float *up, float *out, int64_t m,
                             int64_t n)
{
    glu((kn_cuda *)ctx, gate, up, out, m, n, false);
}

extern "C" void kn_cu_geglu(void *ctx, const float *gate, const float *up, float *out, int64_t m,
                            int64_t n)
{
    glu((kn_cuda *)ctx, gate, up, out, m, n, true);
}

/* y (total) += x; with n > 0 x is one row of n added to every row (add_row). */
__global__ void k_add(float *y, const float *x, int64_t total, int64_t n)
{
    for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; j < total;
         j += (int64_t)gridDim.x * blockDim.x)
        y[j] += x[n ? j % n : j];
}

__global__ void k_scale(float *x, int64_t n, float s)
{
    for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; j < n;
         j += (int64_t)gridDim.x * blockDim.x)
        x[j] *= s;
}

static bool bad_shape(kn_cuda *c, const char *op, int64_t m, int64_t n)
{
    if (m >= 0 && n >= 0) return false;
    TD_LOG_ERR("cuda %s: bad shape m %lld, n %lld", op, (long long)m, (long long)n);
    kn_cu_fail(c, TD_EINVAL, op);
    return true;
}

extern "C" void kn_cu_add(void *ctx, float *y, const float *x, int64_t m, int64_t n)
{
    kn_cuda *c = (kn_cuda *)ctx;
    if (bad_shape(c, "add", m, n) || m * n == 0) return;
    k_add<<<kn_cu_blocks(m * n, 256), 256, 0, c->stream>>>(y, x, m * n, 0);
    kn_cu_check(c, "add");
}

extern "C" void kn_cu_add_row(void *ctx, float *y, const float *b, int64_t m, int64_t n)
{
    kn_cuda *c = (kn_cuda *)ctx;
    if (bad_shape(c, "add_row", m, n) || m * n == 0) return;
    const float *db = (const float *)kn_cu_ptr(c, b);
    k_add<<<kn_cu_blocks(m * n, 256), 256, 0, c->stream>>>(y, db, m * n, n);
    kn_cu_check(c, "add_row");
}

extern "C" void kn_cu_scale(void *ctx, float *x, int64_t n, float s)
{
    kn_cuda *c = (kn_cuda *)ctx;
    if (bad_shape(c, "scale", 1, n) || n == 0) return;
    k_scale<<<kn_cu_blocks(n, 256), 256, 0, c->stream>>>(x, n, s);
    kn_cu_check(c, "scale");
}

/* ---- copy_rows: dst row r = src row rows[r] ---- */

__global__ void k_copy_rows(const float *src, const int32_t *rows, int64_t m, int64_t n, float *dst)
{
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < m * n;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = e / n, j = e % n;
        dst[e] = src[(int64_t)rows[r] * n + j];
    }
}

extern "C" void kn_cu_copy_rows(void *ctx, const float *src, const int32_t *rows, int64_t m,
                                int64_t n, float *dst)
{
    kn_cuda *c = (kn_cuda *)ctx;
    if (bad_shape(c, "copy_rows", m, n) || m * n == 0) return;
    k_copy_rows<<<kn_cu_blocks(m * n, 256), 256, 0, c->stream>>>(src, rows, m, n, dst);
    kn_cu_check(c, "copy_rows");
}
