/* cuda_device.cuh: device helpers the CUDA backend's .cu files share (warp reductions,
 * launch geometry) and the one way they include the project's C headers.
 * Included only by nvcc (C++). Run on an NVIDIA H200 (cuda_backend.h).
 */
#ifndef KN_CUDA_DEVICE_CUH
#define KN_CUDA_DEVICE_CUH

/* C and C++ system headers first, outside extern "C" (their include guards then keep the
 * C headers below from reopening them inside it) */
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cuda_runtime.h>

#include "cuda_internal.h"

extern "C" {
#include "kn_elem.h"
#include "td_err.h"
}

#define KN_WARP 32

__device__ __forceinline__ float kn_cu_warp_sum(float v)
{
#pragma unroll
    for (int o = KN_WARP / 2; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float kn_cu_warp_max(float v)
{
#pragma unroll
    for (int o = KN_WARP / 2; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Blocks for n elements at `threads` per block, capped (kernels loop grid-stride). */
static inline unsigned kn_cu_blocks(int64_t n, int threads)
{
    int64_t b = (n + threads - 1) / threads;
    if (b < 1) b = 1;
    if (b > 65535 * 16) b = 65535 * 16;
    return (unsigned)b;
}

#endif
