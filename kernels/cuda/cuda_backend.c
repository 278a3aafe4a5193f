/* cuda_backend.c: the CUDA backend's device probe, context and memory ops (cuda_backend.h).
 * Host code only (the CUDA runtime and cuBLAS APIs); compiled by the C compiler. */
#include "cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"

typedef struct {
    int device;
    cudaStream_t stream;
    cublasHandle_t blas;
    char name[256];
    int cc_major, cc_minor;
    size_t mem_bytes;
} kn_cuda;

/* A failed CUDA call: logged with the call's text, mapped to a td_err. */
static int cuda_fail(cudaError_t e, const char *what)
{
    TD_LOG_ERR("cuda: %s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    return e == cudaErrorMemoryAllocation ? TD_ENOMEM : TD_EIO;
}

#define CU_TRY(call)                                                                               \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) return cuda_fail(e_, #call);                                        \
    } while (0)

int kn_cuda_device_count(char *reason, size_t cap)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        if (reason) snprintf(reason, cap, "cudaGetDeviceCount: %s", cudaGetErrorString(e));
        return 0;
    }
    if (n == 0 && reason) snprintf(reason, cap, "the driver reports no CUDA device");
    return n;
}

/* ---- memory ---- */

static void *cu_alloc(void *ctx, size_t bytes)
{
    kn_cuda *c = ctx;
    void *p = NULL;
    if (cudaSetDevice(c->device) != cudaSuccess) return NULL;
    /* cudaMalloc is 256-byte aligned */
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        cuda_fail(e, "cudaMalloc");
        return NULL;
    }
    return p;
}

static void cu_free(void *ctx, void *p)
{
    kn_cuda *c = ctx;
    if (!p) return;
    /* the stream may still use p: free after its queued work */
    cudaStreamSynchronize(c->stream);
    cudaFree(p);
}

static int cu_upload(void *ctx, void *dst, const void *src, size_t bytes)
{
    kn_cuda *c = ctx;
    /* from pageable memory, cudaMemcpyAsync returns once src was staged: src is reusable */
    CU_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream));
    return 0;
}

static int cu_download(void *ctx, void *dst, const void *src, size_t bytes)
{
    kn_cuda *c = ctx;
    CU_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    CU_TRY(cudaStreamSynchronize(c->stream));
    return 0;
}

static int cu_synchronize(void *ctx)
{
    kn_cuda *c = ctx;
    CU_TRY(cudaStreamSynchronize(c->stream));
    return 0;
}

static void cu_destroy(void *ctx)
{
    kn_cuda *c = ctx;
    if (!c) return;
    cudaSetDevice(c->device);
    if (c->blas) cublasDestroy(c->blas);
    if (c->stream) cudaStreamDestroy(c->stream);
    free(c);
}

static void cu_describe(void *ctx, char *buf, size_t cap)
{
    const kn_cuda *c = ctx;
    snprintf(buf, cap, "cuda %s (device %d, sm_%d%d, %.0f GiB)", c->name, c->device, c->cc_major,
             c->cc_minor, (double)c->mem_bytes / (1024.0 * 1024 * 1024));
}

static const kn_backend_ops cuda_ops = {
    .name = "cuda",
    .destroy = cu_destroy,
    .describe = cu_describe,
    .host_memory = false,
    .alloc = cu_alloc,
    .free = cu_free,
    .upload = cu_upload,
    .download = cu_download,
    .synchronize = cu_synchronize,
};

/* The compute ops the engine needs and this table lacks, comma-separated ("" if none). */
static void missing_ops(const kn_backend_ops *o, char *buf, size_t cap)
{
    struct {
        const char *name;
        bool have;
    } req[] = {{"matmul", o->matmul},       {"rmsnorm", o->rmsnorm},   {"rope", o->rope},
               {"swiglu", o->swiglu},       {"geglu", o->geglu},       {"kv_write", o->kv_write},
               {"attention", o->attention}, {"get_rows", o->get_rows}, {"add", o->add},
               {"add_row", o->add_row},     {"scale", o->scale},       {"copy_rows", o->copy_rows}};
    size_t len = 0;
    buf[0] = 0;
    for (size_t i = 0; i < sizeof req / sizeof req[0]; i++)
        if (!req[i].have && len < cap)
            len += (size_t)snprintf(buf + len, cap - len, "%s%s", len ? ", " : "", req[i].name);
}

static int open_device(kn_cuda *c, int device)
{
    char why[256];
    int n = kn_cuda_device_count(why, sizeof why);
    if (n == 0) {
        TD_LOG_ERR("backend 'cuda': no usable GPU: %s", why);
        return TD_EUNSUPP;
    }
    if (device >= n) {
        TD_LOG_ERR("backend 'cuda': device %d asked for, this process sees %d device%s", device, n,
                   n == 1 ? "" : "s");
        return TD_EUNSUPP;
    }
    struct cudaDeviceProp prop;
    CU_TRY(cudaGetDeviceProperties(&prop, device));
    CU_TRY(cudaSetDevice(device));
    c->device = device;
    snprintf(c->name, sizeof c->name, "%s", prop.name);
    c->cc_major = prop.major;
    c->cc_minor = prop.minor;
    c->mem_bytes = prop.totalGlobalMem;
    CU_TRY(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    cublasStatus_t bs = cublasCreate(&c->blas);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        TD_LOG_ERR("backend 'cuda': cublasCreate failed (status %d)", (int)bs);
        return TD_EIO;
    }
    if (cublasSetStream(c->blas, c->stream) != CUBLAS_STATUS_SUCCESS) return TD_EIO;
    return 0;
}

int kn_cuda_create(int device, kn_backend *out)
{
    memset(out, 0, sizeof *out);
    kn_cuda *c = calloc(1, sizeof *c);
    if (!c) return TD_ENOMEM;
    int rc = open_device(c, device);
    if (rc) {
        cu_destroy(c);
        return rc;
    }
    char missing[256];
    missing_ops(&cuda_ops, missing, sizeof missing);
    if (missing[0]) {
        char desc[320];
        cu_describe(c, desc, sizeof desc);
        TD_LOG_ERR("backend 'cuda': found %s, but the CUDA backend's compute ops are not built "
                   "yet (missing: %s); use backend 'cpu'",
                   desc, missing);
        cu_destroy(c);
        return TD_EUNSUPP;
    }
    *out = (kn_backend){.ops = &cuda_ops, .ctx = c};
    return 0;
}
