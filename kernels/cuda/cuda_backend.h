/* cuda_backend.h: the CUDA backend: one device, one stream, cuBLAS, behind kn_backend_ops.
 *
 * Purpose: run the engine on an NVIDIA GPU (issue 14). kn_backend_create("cuda") is the only
 * caller of kn_cuda_create.
 * State (what exists, what does not): everything below compiles cleanly (nvcc 13,
 * sm_80/86/89/90/100 + compute_90 PTX, warnings as errors) and ran on an NVIDIA H200
 * (sm_90) on 2026-11-27: tests/kernels/test_cuda.c, the parity and serving tests of
 * tests/gpu/ and compute-sanitizer memcheck passed there (docs/gpu.md has what ran and
 * the figures); no other GPU has run it. What exists: the device probe, the context (device,
 * stream, cuBLAS handle in pedantic fp32 math), the memory ops (alloc, free, upload, download,
 * synchronize), the weight map (map_matrix / map_vector, cuda_map.c), and every compute op
 * of kn_backend_ops: matmul and matmul_mixed (dequantizing GEMV for m <= 8 and for the
 * solo rows, cublasSgemm on a cached fp32 copy above; cuda_matmul.cu), get_rows, rmsnorm, rope,
 * swiglu, geglu, add, add_row, scale, copy_rows (cuda_ops.cu), kv_write and attention (split-K
 * decode kernel, shared-memory tiled prefill kernel; cuda_attention.cu). Weight types: F32, F16,
 * BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (kn_elem.h, whose dequantizers
 * tests/kernels/test_elem.c checks bit for bit against the CPU's on the host); others
 * (IQ4_NL, Q2_K, Q3_K, IQ4_XS) are refused at map_matrix and by the ops with TD_EUNSUPP.
 * tests/kernels/test_cuda.c compares matmul, get_rows, rmsnorm, swiglu, kv_write and
 * attention with the CPU backend when a GPU is present (without one it checks the refusal
 * only); rope, geglu and the small ops are covered end to end by the parity tests (logits
 * against the CPU on six synthetic architectures and SmolLM2). kn_cuda_create still
 * refuses (TD_EUNSUPP) if any compute op were missing from the table.
 * Speed (docs/gpu.md): correct but not yet fast: a batch-1 decode step is bound by kernel
 * launches (no CUDA graphs yet), GEMMs run in pedantic fp32 (no tensor cores).
 * Errors: the ops that return int return the failure; the void ops record the first one,
 * which the next synchronize/download returns; asynchronous kernel faults surface there
 * too, naming the last op queued (TANDEM_CUDA_SYNC=1 synchronizes after every op, naming
 * the failing one). Bad positions/ids found on the device: TD_ERANGE at the next
 * synchronize/download.
 * Invariants: every op is queued on the backend's one stream, in call order; download and
 * synchronize wait for it. Memory from alloc is device memory (cudaMalloc).
 * Threading: one thread drives the backend (kn_backend.h); the CUDA current device is set
 * by every call that needs it, so several backends (one per device) may live in one process.
 * Ownership: the kn_cuda object owns the stream and the cuBLAS handle; ops->destroy frees
 * them.
 */
#ifndef KN_CUDA_BACKEND_H
#define KN_CUDA_BACKEND_H

#include "kn_backend.h"

/* Probe device `device` (< 0: rank % the devices this process sees, so the TP ranks of an
 * instance spread over the GPUs, and share one on a one-GPU machine) and create the backend
 * on it. TD_EUNSUPP with the reason logged (no driver, no device, an ordinal out of range, a
 * compute op missing from the table). */
int kn_cuda_create(int device, int rank, kn_backend *out);

/* The number of CUDA devices this process can use (0 when there is no driver or no
 * device); reason (may be NULL) gets why there are none. */
int kn_cuda_device_count(char *reason, size_t cap);

#endif
