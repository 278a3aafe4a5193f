/* cuda_backend.c: the CUDA backend's device probe, context, memory ops, error reporting and
 * ops table (cuda_backend.h; the compute ops are in cuda_*.cu, the weight map in cuda_map.c).
 * Host code only (the CUDA runtime and cuBLAS APIs); compiled by the C compiler. */
#include "cuda_backend.h"

#include "cuda_internal.h"
#include "kn_elem.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_clock.h"
#include "td_err.h"

/* A failed CUDA call: logged with the call's text, mapped to a td_err. */
int kn_cu_error(cudaError_t e, const char *what)
{
    TD_LOG_ERR("cuda: %s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    return e == cudaErrorMemoryAllocation ? TD_ENOMEM : TD_EIO;
}

void kn_cu_fail(kn_cuda *c, int rc, const char *op)
{
    if (c->err) return;
    c->err = rc;
    snprintf(c->err_op, sizeof c->err_op, "%s", op);
}

/* TANDEM_CUDA_PROFILE: the time since the last op or copy, charged to op. */
static void prof_add(kn_cuda *c, const char *op)
{
    const int64_t now = td_now_ns();
    int i = 0;
    while (i < c->n_prof && strcmp(c->prof[i].op, op))
        i++;
    if (i == c->n_prof && c->n_prof < KN_CU_PROF_MAX) c->prof[c->n_prof++].op = op;
    if (i < c->n_prof) {
        c->prof[i].ms += (double)(now - c->prof_t) / 1e6;
        c->prof[i].calls++;
    }
    c->prof_t = now;
}

static void prof_print(const kn_cuda *c)
{
    double total = 0;
    for (int i = 0; i < c->n_prof; i++)
        total += c->prof[i].ms;
    if (c->n_prof == 0 || total <= 0) return;
    fprintf(stderr, "cuda profile (TANDEM_CUDA_PROFILE=1; each op synchronized): %.1f ms\n", total);
    bool done[KN_CU_PROF_MAX] = {false};
    for (int k = 0; k < c->n_prof; k++) {
        int best = -1;
        for (int i = 0; i < c->n_prof; i++)
            if (!done[i] && (best < 0 || c->prof[i].ms > c->prof[best].ms)) best = i;
        done[best] = true;
        fprintf(stderr, "  %-22s %10.2f ms %5.1f %% %9ld calls %8.1f us/call\n", c->prof[best].op,
                c->prof[best].ms, 100.0 * c->prof[best].ms / total, c->prof[best].calls,
                1000.0 * c->prof[best].ms / (double)c->prof[best].calls);
    }
}

int kn_cu_check(kn_cuda *c, const char *op)
{
    c->last_op = op;
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess && (c->sync_each || c->profile)) e = cudaStreamSynchronize(c->stream);
    if (c->profile) prof_add(c, op);
    if (e == cudaSuccess) return 0;
    char what[96];
    snprintf(what, sizeof what, "%s (%s)", op, c->sync_each ? "run" : "launch");
    int rc = kn_cu_error(e, what);
    kn_cu_fail(c, rc, op);
    return rc;
}

void *kn_cu_scratch(kn_cuda *c, size_t bytes)
{
    if (bytes <= c->scratch_cap) return c->scratch;
    if (c->scratch) {
        /* queued kernels may still read the old scratch */
        cudaStreamSynchronize(c->stream);
        cudaFree(c->scratch);
        c->scratch = NULL;
        c->scratch_cap = 0;
    }
    size_t cap = bytes + bytes / 4;
    cudaError_t e = cudaMalloc(&c->scratch, cap);
    if (e != cudaSuccess) {
        kn_cu_error(e, "scratch: cudaMalloc");
        c->scratch = NULL;
        return NULL;
    }
    c->scratch_cap = cap;
    return c->scratch;
}

#define CU_TRY(call)                                                                               \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) return kn_cu_error(e_, #call);                                      \
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
        kn_cu_error(e, "cudaMalloc");
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

/* page-locked host memory: the engine's staging buffers for host collectives */
static void *cu_host_alloc(void *ctx, size_t bytes)
{
    kn_cuda *c = ctx;
    void *p = NULL;
    if (cudaSetDevice(c->device) != cudaSuccess) return NULL;
    cudaError_t e = cudaMallocHost(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        kn_cu_error(e, "cudaMallocHost");
        return NULL;
    }
    return p;
}

static void cu_host_free(void *ctx, void *p)
{
    kn_cuda *c = ctx;
    if (!p) return;
    cudaStreamSynchronize(c->stream); /* an upload from p may still be reading it */
    cudaFreeHost(p);
}

static int cu_upload(void *ctx, void *dst, const void *src, size_t bytes)
{
    kn_cuda *c = ctx;
    /* from pageable memory, cudaMemcpyAsync returns once src was staged: src is reusable */
    CU_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream));
    if (c->profile) c->prof_t = td_now_ns();
    return 0;
}

/* After the stream drained (e: its status): an asynchronous kernel error (naming the last
 * op queued, which ran at or after the failing kernel), the first failure of a void op,
 * or bad input a kernel flagged; each reported once. */
static int drain_status(kn_cuda *c, cudaError_t e)
{
    if (e != cudaSuccess) {
        char what[128];
        snprintf(what, sizeof what,
                 "a kernel failed (last op queued: %s; TANDEM_CUDA_SYNC=1 "
                 "names the failing op)",
                 c->last_op ? c->last_op : "none");
        return kn_cu_error(e, what);
    }
    if (c->err) {
        int rc = c->err;
        TD_LOG_ERR("cuda: op %s failed earlier (its error was logged then)", c->err_op);
        c->err = 0;
        return rc;
    }
    if (c->host_flag[0] != -1 || c->host_flag[1] != -1) {
        if (c->host_flag[0] != -1)
            TD_LOG_ERR("cuda get_rows: row id %d out of range (its output row was zeroed)",
                       (int)c->host_flag[0]);
        if (c->host_flag[1] != -1)
            TD_LOG_ERR("cuda kv_write/attention: position %d outside its sequence view, or a "
                       "negative block id (that token was skipped)",
                       (int)c->host_flag[1]);
        c->host_flag[0] = c->host_flag[1] = -1;
        CU_TRY(cudaMemsetAsync(c->dev_flag, 0xff, 2 * sizeof(int32_t), c->stream));
        return TD_ERANGE;
    }
    return 0;
}

/* Drain the stream, reading the kernels' bad-input flag on the way. */
static int drain(kn_cuda *c)
{
    cudaError_t e = cudaMemcpyAsync(c->host_flag, c->dev_flag, 2 * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, c->stream);
    cudaError_t s = cudaStreamSynchronize(c->stream);
    if (c->profile) c->prof_t = td_now_ns();
    return drain_status(c, e != cudaSuccess ? e : s);
}

static int cu_download(void *ctx, void *dst, const void *src, size_t bytes)
{
    kn_cuda *c = ctx;
    CU_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    return drain(c);
}

static int cu_synchronize(void *ctx)
{
    return drain(ctx);
}

static void cu_destroy(void *ctx)
{
    kn_cuda *c = ctx;
    if (!c) return;
    cudaSetDevice(c->device);
    if (c->stream) cudaStreamSynchronize(c->stream);
    if (c->profile) prof_print(c);
    kn_cu_map_free(c);
    cudaFree(c->scratch);
    cudaFree(c->dev_flag);
    cudaFreeHost(c->host_flag);
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
    .kv_sliced = false, /* cuda_attention.cu addresses head-major pools only */
    .alloc = cu_alloc,
    .free = cu_free,
    .upload = cu_upload,
    .host_alloc = cu_host_alloc,
    .host_free = cu_host_free,
    .download = cu_download,
    .synchronize = cu_synchronize,
    .map_matrix = kn_cu_map_matrix,
    .map_vector = kn_cu_map_vector,
    .matmul = kn_cu_matmul,
    .matmul_mixed = kn_cu_matmul_mixed,
    .rmsnorm = kn_cu_rmsnorm,
    .rope = kn_cu_rope,
    .swiglu = kn_cu_swiglu,
    .geglu = kn_cu_geglu,
    .kv_write = kn_cu_kv_write,
    .attention = kn_cu_attention,
    .get_rows = kn_cu_get_rows,
    .add = kn_cu_add,
    .add_row = kn_cu_add_row,
    .scale = kn_cu_scale,
    .copy_rows = kn_cu_copy_rows,
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

static int open_device(kn_cuda *c, int device, int rank)
{
    char why[256];
    int n = kn_cuda_device_count(why, sizeof why);
    if (n == 0) {
        TD_LOG_ERR("backend 'cuda': no usable GPU: %s", why);
        return TD_EUNSUPP;
    }
    if (device < 0) device = (rank < 0 ? 0 : rank) % n;
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
    c->n_sm = prop.multiProcessorCount;
    const char *sync = getenv("TANDEM_CUDA_SYNC");
    c->sync_each = sync && strcmp(sync, "1") == 0;
    /* float32 copies of quantized weights for the GEMM path (cuda_matmul.cu): by default
     * up to 40 % of the device's memory; TANDEM_CUDA_F32_CACHE_MB sets it (0: none) */
    const char *cache = getenv("TANDEM_CUDA_F32_CACHE_MB");
    c->map.f32_budget = cache ? (size_t)strtoull(cache, NULL, 10) << 20 : c->mem_bytes / 5 * 2;
    const char *prof = getenv("TANDEM_CUDA_PROFILE");
    c->profile = prof && strcmp(prof, "1") == 0;
    c->prof_t = td_now_ns();
    CU_TRY(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    cublasStatus_t bs = cublasCreate(&c->blas);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        TD_LOG_ERR("backend 'cuda': cublasCreate failed (status %d)", (int)bs);
        return TD_EIO;
    }
    if (cublasSetStream(c->blas, c->stream) != CUBLAS_STATUS_SUCCESS) return TD_EIO;
    /* plain fp32 GEMMs: no TF32 tensor-core rounding of the inputs */
    if (cublasSetMathMode(c->blas, CUBLAS_PEDANTIC_MATH) != CUBLAS_STATUS_SUCCESS) return TD_EIO;
    CU_TRY(cudaMalloc((void **)&c->dev_flag, 2 * sizeof(int32_t)));
    CU_TRY(cudaMemset(c->dev_flag, 0xff, 2 * sizeof(int32_t)));
    CU_TRY(cudaMallocHost((void **)&c->host_flag, 2 * sizeof(int32_t)));
    c->host_flag[0] = c->host_flag[1] = -1;
    return 0;
}

int kn_cuda_create(int device, int rank, kn_backend *out)
{
    memset(out, 0, sizeof *out);
    kn_cuda *c = calloc(1, sizeof *c);
    if (!c) return TD_ENOMEM;
    int rc = open_device(c, device, rank);
    if (rc) {
        cu_destroy(c);
        return rc;
    }
    char missing[256];
    missing_ops(&cuda_ops, missing, sizeof missing);
    if (missing[0]) {
        char desc[320];
        cu_describe(c, desc, sizeof desc);
        TD_LOG_ERR("backend 'cuda': found %s, but the CUDA backend lacks compute ops "
                   "(missing: %s); use backend 'cpu'",
                   desc, missing);
        cu_destroy(c);
        return TD_EUNSUPP;
    }
    char desc[320];
    cu_describe(c, desc, sizeof desc);
    TD_LOG_INFO("backend 'cuda': %s; weight types %s (others are refused at load)", desc,
                KN_ELEM_TYPES);
    *out = (kn_backend){.ops = &cuda_ops, .ctx = c};
    return 0;
}
