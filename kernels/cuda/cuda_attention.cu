/* cuda_attention.cu: the CUDA backend's paged KV writes and causal attention (kn_backend.h
 * has the contracts, cpu_attention.c the reference; pool layout (n_blocks, n_kv_heads,
 * block_size, head_dim), F32 or F16).
 *
 * kv_write: one thread per (token, KV head, dim) through the token's block table; F16
 * rounds with kn_elem_f2h, the CPU's rounding, so both backends write the same bits.
 * attention: online softmax (running max, running sum, unnormalized accumulator), GQA
 * with q head h reading KV head (phase + h) / group, sliding window (window > 0: keys
 * [pos - window + 1, pos]), head_dim up to 256 (each lane of a warp holds dims lane,
 * lane + 32, ...; a score is a warp-wide sum). Two kernels:
 *   decode (the solo rows, any number: kn_backend.h; the other rows when at most
 *     ATT_DECODE_MAX_M): split-K. Block (split s, q head h, token i) of 4
 *     warps takes the s-th of n_split equal slices of the token's key range (the split
 *     count is fixed from the head count and the SM count only, never from m, so a token's
 *     result does not depend on the batch size, and a solo row always comes here); the
 *     warps take keys round-robin, merge their states in shared memory and write a partial
 *     (max, sum, accumulator) to scratch; k_att_combine merges the splits.
 *   prefill (more non-solo rows): block (tile of ATT_QT consecutive tokens, q head h), 4 warps of
 *     ATT_QT / 4 tokens each. The tile is cut into runs of tokens of one sequence; for each
 *     run, K/V tiles of ATT_KT keys covering the union of the run's key ranges are staged
 *     in shared memory (converted to float) and every warp scores its tokens against them,
 *     each token masked to its own causal / window range.
 * Positions, seq_of and the seq views (with their block tables) are device memory. A
 * position outside [0, n_ctx) or a negative block id raises the backend's flag (reported
 * by the next synchronize/download, TD_ERANGE) and that token's write or output is skipped
 * (attention writes zeros).
 * State: compiled for sm_80..sm_100; run on an NVIDIA H200 (sm_90) (cuda_backend.h).
 */
#include <cuda_fp16.h>

#include "cuda_device.cuh"

#define ATT_MAX_HD       256
#define ATT_NJ           (ATT_MAX_HD / KN_WARP) /* dims per lane */
#define ATT_WARPS        4
#define ATT_DECODE_MAX_M 16
#define ATT_MAX_SPLIT    32
#define ATT_QT           16 /* tokens per prefill block */
#define ATT_QW           (ATT_QT / ATT_WARPS)
#define ATT_KT           16 /* keys per shared-memory tile: 2 x 16 x 256 floats = 32 KiB */

template <int F16> __device__ __forceinline__ float kv_load(const void *pool, int64_t idx)
{
    if (F16) return __half2float(__ushort_as_half(((const unsigned short *)pool)[idx]));
    return ((const float *)pool)[idx];
}

/* ---- kv_write ---- */

template <int F16>
__global__ void k_kv_write(void *kpool, void *vpool, int bs, int nkv, int hd, const float *k,
                           const float *v, int64_t m, const int32_t *pos, const int32_t *seq_of,
                           const kn_seq_view *seqs, int32_t *flag)
{
    const int64_t per_tok = (int64_t)nkv * hd;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < m * per_tok;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = e / per_tok, hdim = e % per_tok;
        const kn_seq_view sv = seqs[seq_of[i]];
        const int32_t p = pos[i];
        const int32_t blk = p >= 0 && p < sv.n_ctx ? sv.block_table[p / bs] : -1;
        if (blk < 0) {
            flag[1] = p;
            continue;
        }
        const int64_t dst = (((int64_t)blk * nkv + hdim / hd) * bs + p % bs) * hd + hdim % hd;
        const bool v_apart = vpool != kpool; /* else a latent pool: V is K, written once */
        if (F16) {
            ((unsigned short *)kpool)[dst] = kn_elem_f2h(k[e]);
            if (v_apart) ((unsigned short *)vpool)[dst] = kn_elem_f2h(v[e]);
        } else {
            ((float *)kpool)[dst] = k[e];
            if (v_apart) ((float *)vpool)[dst] = v[e];
        }
    }
}

/* The kernels here address head-major pools only (kv_sliced false in the ops table, so
 * kn_kv_pool_create refuses a sliced pool on cuda): a sliced layout reaching an op is a
 * caller's bug, failed clearly rather than written to the wrong tiles. */
static bool sliced_refused(kn_cuda *c, const kn_kv_slicing *slicing, const char *op)
{
    if (!slicing || slicing->n_slices <= 1) return false;
    TD_LOG_ERR("cuda %s: a sliced KV pool (%d slices) is not supported on cuda", op,
               slicing->n_slices);
    kn_cu_fail(c, TD_EUNSUPP, op);
    return true;
}

extern "C" void kn_cu_kv_write(void *ctx, void *kpool, void *vpool, td_dtype kv_type,
                               int block_size, const kn_kv_slicing *slicing, int n_kv_heads,
                               int head_dim, const float *k, const float *v, int64_t m,
                               const int32_t *pos, const int32_t *seq_of, const kn_seq_view *seqs)
{
    kn_cuda *c = (kn_cuda *)ctx;
    if ((kv_type != TD_F32 && kv_type != TD_F16) || block_size <= 0 || n_kv_heads <= 0 ||
        head_dim <= 0 || m < 0) {
        TD_LOG_ERR("cuda kv_write: bad arguments (kv type %s, block size %d, %d kv heads, head "
                   "dim %d, m %lld)",
                   td_dtype_name((uint32_t)kv_type), block_size, n_kv_heads, head_dim,
                   (long long)m);
        kn_cu_fail(c, TD_EINVAL, "kv_write");
        return;
    }
    if (sliced_refused(c, slicing, "kv_write")) return;
    if (m == 0) return;
    const int64_t n = m * n_kv_heads * head_dim;
    if (kv_type == TD_F16)
        k_kv_write<1><<<kn_cu_blocks(n, 256), 256, 0, c->stream>>>(kpool, vpool, block_size,
                                                                   n_kv_heads, head_dim, k, v, m,
                                                                   pos, seq_of, seqs, c->dev_flag);
    else
        k_kv_write<0><<<kn_cu_blocks(n, 256), 256, 0, c->stream>>>(kpool, vpool, block_size,
                                                                   n_kv_heads, head_dim, k, v, m,
                                                                   pos, seq_of, seqs, c->dev_flag);
    kn_cu_check(c, "kv_write");
}

/* ---- shared pieces ---- */

typedef struct {
    const void *kpool, *vpool;
    int bs, n_heads, nkv, group, phase, hd, window, n_split;
    float scale;
    float softcap; /* > 0: scores s -> softcap * tanh(s / softcap) (gemma2); 0: none */
    int64_t m;
    const int32_t *pos, *seq_of;
    const kn_seq_view *seqs;
    const float *q;
    float *out, *part; /* part: (m, n_heads, n_split, hd + 2) */
    int32_t *flag;
} att_args;

/* The token's first visible key (window) and its sequence view; false (flag raised) for
 * a position outside the view. */
__device__ __forceinline__ bool att_token(const att_args &a, int64_t i, int32_t *lo,
                                          kn_seq_view *sv)
{
    *sv = a.seqs[a.seq_of[i]];
    const int32_t p = a.pos[i];
    if (p < 0 || p >= sv->n_ctx) {
        a.flag[1] = p;
        return false;
    }
    *lo = a.window > 0 && p - a.window + 1 > 0 ? p - a.window + 1 : 0;
    return true;
}

/* Element offset of (key position kpos, KV head kvh, dim 0) in the pool; -1 for a bad
 * block id. */
__device__ __forceinline__ int64_t att_key_off(const att_args &a, const kn_seq_view &sv,
                                               int32_t kpos, int kvh)
{
    const int32_t blk = sv.block_table[kpos / a.bs];
    if (blk < 0) return -1;
    return (((int64_t)blk * a.nkv + kvh) * a.bs + kpos % a.bs) * a.hd;
}

/* A raw score q.k scaled, and soft-capped when the call has a cap (the same for every
 * thread: no divergence; an uncapped call's scores are the plain product's bits). */
__device__ __forceinline__ float att_score(const att_args &a, float dot)
{
    const float s = dot * a.scale;
    return a.softcap > 0.0f ? a.softcap * tanhf(s / a.softcap) : s;
}

/* One online-softmax step of a warp: score s (already scaled) with value row vrow (lane
 * dims), or from shared memory when vs is set. */
__device__ __forceinline__ void att_step(float s, const float vv[ATT_NJ], float *mx, float *l,
                                         float acc[ATT_NJ])
{
    const float mnew = fmaxf(*mx, s);
    const float corr = *mx == -INFINITY ? 0.0f : expf(*mx - mnew);
    const float p = expf(s - mnew);
    *l = *l * corr + p;
#pragma unroll
    for (int j = 0; j < ATT_NJ; j++)
        acc[j] = acc[j] * corr + p * vv[j];
    *mx = mnew;
}

/* ---- decode: split-K ---- */

template <int F16> __global__ void k_att_decode(att_args a)
{
    const int s = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / KN_WARP;
    const int lane = threadIdx.x % KN_WARP;
    const int64_t i = blockIdx.z;
    const int kvh = (a.phase + h) / a.group;
    __shared__ float sm_mx[ATT_WARPS], sm_l[ATT_WARPS], sm_acc[ATT_WARPS][ATT_MAX_HD];
    float qr[ATT_NJ], acc[ATT_NJ], mx = -INFINITY, l = 0.0f;
    const float *qi = a.q + (i * a.n_heads + h) * a.hd;
#pragma unroll
    for (int j = 0; j < ATT_NJ; j++) {
        const int d = lane + KN_WARP * j;
        qr[j] = d < a.hd ? qi[d] : 0.0f;
        acc[j] = 0.0f;
    }
    int32_t lo = 0;
    kn_seq_view sv;
    const bool ok = att_token(a, i, &lo, &sv);
    if (ok) {
        const int32_t p = a.pos[i], n_keys = p - lo + 1;
        const int32_t chunk = (n_keys + a.n_split - 1) / a.n_split;
        const int32_t k0 = lo + s * chunk, k1 = min(p + 1, k0 + chunk);
        for (int32_t kp = k0 + warp; kp < k1; kp += ATT_WARPS) {
            const int64_t off = att_key_off(a, sv, kp, kvh);
            if (off < 0) {
                a.flag[1] = kp;
                break;
            }
            float dot = 0.0f, vv[ATT_NJ];
#pragma unroll
            for (int j = 0; j < ATT_NJ; j++) {
                const int d = lane + KN_WARP * j;
                dot += d < a.hd ? qr[j] * kv_load<F16>(a.kpool, off + d) : 0.0f;
                vv[j] = d < a.hd ? kv_load<F16>(a.vpool, off + d) : 0.0f;
            }
            att_step(att_score(a, kn_cu_warp_sum(dot)), vv, &mx, &l, acc);
        }
    }
    if (lane == 0) {
        sm_mx[warp] = mx;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < ATT_NJ; j++)
        sm_acc[warp][lane + KN_WARP * j] = acc[j];
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < ATT_WARPS; w++)
        M = fmaxf(M, sm_mx[w]);
    float *part = a.part + ((i * a.n_heads + h) * a.n_split + s) * (a.hd + 2);
    float L = 0.0f;
    for (int w = 0; w < ATT_WARPS; w++)
        L += sm_mx[w] == -INFINITY ? 0.0f : sm_l[w] * expf(sm_mx[w] - M);
    for (int d = threadIdx.x; d < a.hd; d += blockDim.x) {
        float A = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++)
            A += sm_mx[w] == -INFINITY ? 0.0f : sm_acc[w][d] * expf(sm_mx[w] - M);
        part[2 + d] = A;
    }
    if (threadIdx.x == 0) {
        part[0] = M;
        part[1] = L;
    }
}

/* out (token i, head h) = the merge of the n_split partials; zeros when no key was seen. */
__global__ void k_att_combine(att_args a)
{
    const int64_t ih = blockIdx.x; /* i * n_heads + h */
    const float *part = a.part + ih * a.n_split * (a.hd + 2);
    float M = -INFINITY;
    for (int s = 0; s < a.n_split; s++)
        M = fmaxf(M, part[s * (a.hd + 2)]);
    float L = 0.0f;
    for (int s = 0; s < a.n_split; s++) {
        const float ms = part[s * (a.hd + 2)];
        L += ms == -INFINITY ? 0.0f : part[s * (a.hd + 2) + 1] * expf(ms - M);
    }
    for (int d = threadIdx.x; d < a.hd; d += blockDim.x) {
        float A = 0.0f;
        for (int s = 0; s < a.n_split; s++) {
            const float ms = part[s * (a.hd + 2)];
            A += ms == -INFINITY ? 0.0f : part[s * (a.hd + 2) + 2 + d] * expf(ms - M);
        }
        a.out[ih * a.hd + d] = L > 0.0f ? A / L : 0.0f;
    }
}

/* ---- prefill: query tiles, K/V tiles in shared memory ---- */

/* The union [*klo, *khi] of the key ranges of tokens [r0, r1) (one sequence); empty
 * (khi < klo) when none of them has a valid position. */
__device__ void att_run_range(const att_args &a, int64_t r0, int64_t r1, int32_t *klo, int32_t *khi)
{
    *klo = INT32_MAX;
    *khi = -1;
    for (int64_t t = r0; t < r1; t++) {
        const kn_seq_view sv = a.seqs[a.seq_of[t]];
        const int32_t p = a.pos[t];
        if (p < 0 || p >= sv.n_ctx) continue;
        const int32_t lo = a.window > 0 && p - a.window + 1 > 0 ? p - a.window + 1 : 0;
        *klo = min(*klo, lo);
        *khi = max(*khi, p);
    }
}

/* Stage keys [kt, kt + ATT_KT) (those <= khi) of KV head kvh into shared memory. */
template <int F16>
__device__ void att_stage(const att_args &a, const kn_seq_view &sv, int kvh, int32_t kt,
                          int32_t khi, float (*ks)[ATT_MAX_HD], float (*vs)[ATT_MAX_HD])
{
    for (int e = threadIdx.x; e < ATT_KT * a.hd; e += blockDim.x) {
        const int r = e / a.hd, d = e % a.hd;
        const int32_t kp = kt + r;
        float kv = 0.0f, vv = 0.0f;
        if (kp <= khi) {
            const int64_t off = att_key_off(a, sv, kp, kvh);
            if (off >= 0) {
                kv = kv_load<F16>(a.kpool, off + d);
                vv = kv_load<F16>(a.vpool, off + d);
            } else {
                a.flag[1] = kp;
            }
        }
        ks[r][d] = kv;
        vs[r][d] = vv;
    }
}

template <int F16> __global__ void k_att_prefill(att_args a)
{
    const int h = blockIdx.y, warp = threadIdx.x / KN_WARP, lane = threadIdx.x % KN_WARP;
    const int kvh = (a.phase + h) / a.group;
    const int64_t i0 = (int64_t)blockIdx.x * ATT_QT;
    const int64_t i1 = i0 + ATT_QT < a.m ? i0 + ATT_QT : a.m;
    __shared__ float ks[ATT_KT][ATT_MAX_HD], vs[ATT_KT][ATT_MAX_HD];
    float qr[ATT_QW][ATT_NJ], acc[ATT_QW][ATT_NJ], mx[ATT_QW], l[ATT_QW];
#pragma unroll
    for (int qq = 0; qq < ATT_QW; qq++) {
        const int64_t i = i0 + warp * ATT_QW + qq;
        mx[qq] = -INFINITY;
        l[qq] = 0.0f;
#pragma unroll
        for (int j = 0; j < ATT_NJ; j++) {
            const int d = lane + KN_WARP * j;
            qr[qq][j] = i < i1 && d < a.hd ? a.q[(i * a.n_heads + h) * a.hd + d] : 0.0f;
            acc[qq][j] = 0.0f;
        }
    }
    for (int64_t r0 = i0; r0 < i1;) {
        /* a run of tokens of one sequence; every thread finds the same runs */
        int64_t r1 = r0 + 1;
        while (r1 < i1 && a.seq_of[r1] == a.seq_of[r0])
            r1++;
        int32_t klo, khi;
        att_run_range(a, r0, r1, &klo, &khi);
        const kn_seq_view sv = a.seqs[a.seq_of[r0]];
        for (int32_t kt = klo; kt <= khi; kt += ATT_KT) {
            __syncthreads(); /* the previous tile is no longer read */
            att_stage<F16>(a, sv, kvh, kt, khi, ks, vs);
            __syncthreads();
#pragma unroll
            for (int qq = 0; qq < ATT_QW; qq++) {
                const int64_t i = i0 + warp * ATT_QW + qq;
                if (i < r0 || i >= r1) continue;
                const int32_t p = a.pos[i];
                if (p < 0 || p >= sv.n_ctx) continue;
                const int32_t lo = a.window > 0 && p - a.window + 1 > 0 ? p - a.window + 1 : 0;
                const int32_t ka = max(kt, lo), kb = min(p, min(khi, kt + ATT_KT - 1));
                for (int32_t kp = ka; kp <= kb; kp++) {
                    const int r = kp - kt;
                    float dot = 0.0f, vv[ATT_NJ];
#pragma unroll
                    for (int j = 0; j < ATT_NJ; j++) {
                        const int d = lane + KN_WARP * j;
                        dot += d < a.hd ? qr[qq][j] * ks[r][d] : 0.0f;
                        vv[j] = d < a.hd ? vs[r][d] : 0.0f;
                    }
                    att_step(att_score(a, kn_cu_warp_sum(dot)), vv, &mx[qq], &l[qq], acc[qq]);
                }
            }
        }
        r0 = r1;
    }
#pragma unroll
    for (int qq = 0; qq < ATT_QW; qq++) {
        const int64_t i = i0 + warp * ATT_QW + qq;
        if (i >= i1) continue;
#pragma unroll
        for (int j = 0; j < ATT_NJ; j++) {
            const int d = lane + KN_WARP * j;
            if (d < a.hd)
                a.out[(i * a.n_heads + h) * a.hd + d] = l[qq] > 0.0f ? acc[qq][j] / l[qq] : 0.0f;
        }
    }
}

/* ---- the op ---- */

static bool att_bad_args(kn_cuda *c, td_dtype kv_type, int block_size, int n_heads, int n_kv_heads,
                         int group, int phase, int head_dim, int64_t m)
{
    if ((kv_type == TD_F32 || kv_type == TD_F16) && block_size > 0 && n_heads > 0 && group > 0 &&
        phase >= 0 && phase < group && n_kv_heads == (phase + n_heads - 1) / group + 1 &&
        head_dim > 0 && head_dim <= ATT_MAX_HD && m >= 0 && m <= INT32_MAX)
        return false;
    TD_LOG_ERR("cuda attention: bad arguments (kv type %s, block size %d, %d heads, %d kv heads, "
               "group %d, phase %d, head dim %d (at most %d), m %lld)",
               td_dtype_name((uint32_t)kv_type), block_size, n_heads, n_kv_heads, group, phase,
               head_dim, ATT_MAX_HD, (long long)m);
    kn_cu_fail(c, TD_EINVAL, "attention");
    return true;
}

/* Splits of a decode token's keys: enough blocks to cover the SMs twice over at one token,
 * from the head count only (never from m or the context length, so a token's result does
 * not depend on its batch). */
static int att_splits(const kn_cuda *c, int n_heads)
{
    int s = (2 * c->n_sm + n_heads - 1) / n_heads;
    return s < 1 ? 1 : s > ATT_MAX_SPLIT ? ATT_MAX_SPLIT : s;
}

/* Rows [r0, r1) of a through one kernel: the split-K decode kernel or the tiled prefill
 * kernel. */
static void att_launch(kn_cuda *c, att_args a, int64_t r0, int64_t r1, bool decode, bool f16)
{
    const int64_t qoff = r0 * a.n_heads * a.hd;
    a.q += qoff;
    a.out += qoff;
    a.pos += r0;
    a.seq_of += r0;
    a.m = r1 - r0;
    if (decode) {
        a.n_split = att_splits(c, a.n_heads);
        const size_t bytes = (size_t)a.m * a.n_heads * a.n_split * (a.hd + 2) * sizeof(float);
        a.part = (float *)kn_cu_scratch(c, bytes);
        if (!a.part) {
            kn_cu_fail(c, TD_ENOMEM, "attention (split scratch)");
            return;
        }
        const dim3 grid((unsigned)a.n_split, (unsigned)a.n_heads, (unsigned)a.m);
        if (f16)
            k_att_decode<1><<<grid, ATT_WARPS * KN_WARP, 0, c->stream>>>(a);
        else
            k_att_decode<0><<<grid, ATT_WARPS * KN_WARP, 0, c->stream>>>(a);
        if (kn_cu_check(c, "attention (decode)")) return;
        k_att_combine<<<(unsigned)(a.m * a.n_heads), 128, 0, c->stream>>>(a);
        kn_cu_check(c, "attention (combine)");
        return;
    }
    const dim3 grid((unsigned)((a.m + ATT_QT - 1) / ATT_QT), (unsigned)a.n_heads);
    if (f16)
        k_att_prefill<1><<<grid, ATT_WARPS * KN_WARP, 0, c->stream>>>(a);
    else
        k_att_prefill<0><<<grid, ATT_WARPS * KN_WARP, 0, c->stream>>>(a);
    kn_cu_check(c, "attention (prefill)");
}

/* The solo rows (one-token decode rows) always take the decode kernel, whatever their
 * count: their results never depend on the batch. The other rows take the decode kernel
 * when they are few, the prefill kernel (K/V tiles shared by a run's tokens) otherwise. */
extern "C" void kn_cu_attention(void *ctx, const float *q, const void *kpool, const void *vpool,
                                td_dtype kv_type, int block_size, const kn_kv_slicing *slicing,
                                int n_heads, int n_kv_heads, int group, int phase, int head_dim,
                                float scale, int window, float softcap, int64_t m, int64_t m_solo,
                                const int32_t *pos, const int32_t *seq_of, const kn_seq_view *seqs,
                                float *out)
{
    kn_cuda *c = (kn_cuda *)ctx;
    if (att_bad_args(c, kv_type, block_size, n_heads, n_kv_heads, group, phase, head_dim, m))
        return;
    if (sliced_refused(c, slicing, "attention")) return;
    if (m_solo < 0 || m_solo > m || !(softcap >= 0.0f)) {
        TD_LOG_ERR("cuda attention: %lld solo rows of %lld, soft cap %g", (long long)m_solo,
                   (long long)m, (double)softcap);
        kn_cu_fail(c, TD_EINVAL, "attention");
        return;
    }
    if (m == 0) return;
    const att_args a = {kpool,    vpool,  block_size, n_heads, n_kv_heads, group,      phase,
                        head_dim, window, 1,          scale,   softcap,    m,          pos,
                        seq_of,   seqs,   q,          out,     NULL,       c->dev_flag};
    const bool f16 = kv_type == TD_F16;
    if (m_solo) att_launch(c, a, 0, m_solo, true, f16);
    if (m > m_solo) att_launch(c, a, m_solo, m, m - m_solo <= ATT_DECODE_MAX_M, f16);
}
