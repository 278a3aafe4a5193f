/* cuda_backend.h: the CUDA backend: one device, one stream, cuBLAS, behind kn_backend_ops.
 *
 * Purpose: run the engine on an NVIDIA GPU (issue 14). kn_backend_create("cuda") is the only
 * caller of kn_cuda_create.
 * State (what exists, what does not): the device probe, the context (device, stream, cuBLAS
 * handle) and the memory ops (alloc, free, upload, download, synchronize) are here and
 * compiled in CI; NONE of it has run on a GPU yet (no GPU was at hand when it was written).
 * The compute ops (matmul, norms, rope, attention, ...) are not written yet: kn_cuda_create
 * probes the device and then refuses with TD_EUNSUPP naming what is missing, so
 * `backend: cuda` is never a silent CPU run and never a half-working GPU run.
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

/* Probe device `device` and create the backend on it. TD_EUNSUPP with the reason logged
 * (no driver, no device, an ordinal out of range, the compute ops not built yet). */
int kn_cuda_create(int device, kn_backend *out);

/* The number of CUDA devices this process can use (0 when there is no driver or no
 * device); reason (may be NULL) gets why there are none. */
int kn_cuda_device_count(char *reason, size_t cap);

#endif
