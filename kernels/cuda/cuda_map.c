/* cuda_map.c: the CUDA backend's device copies of model weights (ops->map_matrix,
 * ops->map_vector) and the lookup every op does on a weight pointer.
 *
 * A hash table (open addressing, linear probing, power-of-two capacity, at most half
 * full) from the host pointer to its device copy: a lookup is one multiply and usually
 * one probe. A matrix view with row_stride larger than its rows' bytes (a row-parallel
 * TP slice) is packed compactly on the way up (cudaMemcpy2D), so device rows are
 * back to back. Copies are made once, synchronously (model load), and live until the
 * backend is destroyed. A pointer not in the table is taken as device memory already
 * (activations from ops->alloc), so the lookup never fails; mapping every weight is the
 * engine's job (kn_backend.h). The key is the host address alone: a mapped host buffer
 * must outlive the backend (model weights do: the GGUF mapping), or a later allocation at
 * the same address would be taken for it.
 * Only types the CUDA kernels compute with (kn_elem.h) are accepted: an unsupported
 * weight type fails at load, not at the first step.
 * A quantized matrix may also get a float32 copy for the GEMM path (cuda_matmul.cu), made
 * at its first GEMM and kept while the total stays within map.f32_budget.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "kn_elem.h"
#include "td_err.h"

static size_t map_hash(const void *p, size_t cap)
{
    uint64_t h = (uint64_t)(uintptr_t)p;
    h ^= h >> 29;
    h *= 0x9e3779b97f4a7c15ull;
    return (size_t)(h >> 17) & (cap - 1);
}

static kn_cu_map_entry *map_find(const kn_cu_map *m, const void *p)
{
    if (!m->cap || !p) return NULL;
    for (size_t i = map_hash(p, m->cap);; i = (i + 1) & (m->cap - 1)) {
        kn_cu_map_entry *e = &m->slots[i];
        if (e->host == p) return e;
        if (!e->host) return NULL;
    }
}

static int map_grow(kn_cu_map *m)
{
    size_t cap = m->cap ? m->cap * 2 : 256;
    kn_cu_map_entry *s = calloc(cap, sizeof *s);
    if (!s) return TD_ENOMEM;
    for (size_t j = 0; j < m->cap; j++) {
        if (!m->slots[j].host) continue;
        size_t i = map_hash(m->slots[j].host, cap);
        while (s[i].host)
            i = (i + 1) & (cap - 1);
        s[i] = m->slots[j];
    }
    free(m->slots);
    m->slots = s;
    m->cap = cap;
    return 0;
}

static int map_insert(kn_cu_map *m, const kn_cu_map_entry *e)
{
    if ((m->used + 1) * 2 > m->cap) {
        int rc = map_grow(m);
        if (rc) return rc;
    }
    size_t i = map_hash(e->host, m->cap);
    while (m->slots[i].host)
        i = (i + 1) & (m->cap - 1);
    m->slots[i] = *e;
    m->used++;
    return 0;
}

void kn_cu_map_free(kn_cuda *c)
{
    for (size_t i = 0; i < c->map.cap; i++)
        if (c->map.slots[i].host) {
            cudaFree(c->map.slots[i].dev);
            cudaFree(c->map.slots[i].f32);
        }
    free(c->map.slots);
    const size_t budget = c->map.f32_budget;
    memset(&c->map, 0, sizeof c->map);
    c->map.f32_budget = budget;
}

int kn_cu_map_matrix(void *ctx, const kn_mat *w)
{
    kn_cuda *c = ctx;
    if (!w || !w->data || w->n_rows <= 0 || w->n_cols <= 0) {
        TD_LOG_ERR("cuda map_matrix: empty or NULL matrix");
        return TD_EINVAL;
    }
    if (!kn_elem_type_supported(w->type)) {
        TD_LOG_ERR("cuda map_matrix: weight type %s (%d) is not supported by the cuda backend "
                   "(it computes with %s)",
                   td_dtype_name((uint32_t)w->type), (int)w->type, KN_ELEM_TYPES);
        return TD_EUNSUPP;
    }
    const size_t row_bytes = td_dtype_row_bytes(w->type, w->n_cols);
    if (!row_bytes || w->row_stride < row_bytes) {
        TD_LOG_ERR("cuda map_matrix: %lld columns of %s: not whole blocks, or row stride %zu < "
                   "%zu",
                   (long long)w->n_cols, td_dtype_name((uint32_t)w->type), w->row_stride,
                   row_bytes);
        return TD_EINVAL;
    }
    const kn_cu_map_entry *old = map_find(&c->map, w->data);
    if (old) {
        if (old->type == w->type && old->n_cols == w->n_cols && old->n_rows >= w->n_rows) return 0;
        TD_LOG_ERR("cuda map_matrix: %p mapped before as %lld x %lld %s, now %lld x %lld %s",
                   w->data, (long long)old->n_rows, (long long)old->n_cols,
                   td_dtype_name((uint32_t)old->type), (long long)w->n_rows, (long long)w->n_cols,
                   td_dtype_name((uint32_t)w->type));
        return TD_EINVAL;
    }
    const size_t bytes = row_bytes * (size_t)w->n_rows;
    void *dev = NULL;
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess) e = cudaMalloc(&dev, bytes);
    if (e != cudaSuccess) return kn_cu_error(e, "map_matrix: cudaMalloc");
    if (w->row_stride == row_bytes)
        e = cudaMemcpy(dev, w->data, bytes, cudaMemcpyHostToDevice);
    else
        e = cudaMemcpy2D(dev, row_bytes, w->data, w->row_stride, row_bytes, (size_t)w->n_rows,
                         cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
        cudaFree(dev);
        return kn_cu_error(e, "map_matrix: cudaMemcpy");
    }
    kn_cu_map_entry en = {.host = w->data,
                          .dev = dev,
                          .type = w->type,
                          .n_rows = w->n_rows,
                          .n_cols = w->n_cols,
                          .dev_stride = row_bytes};
    int rc = map_insert(&c->map, &en);
    if (rc) {
        cudaFree(dev);
        return rc;
    }
    c->map.bytes += bytes;
    return 0;
}

int kn_cu_map_vector(void *ctx, const float *v, int64_t n)
{
    kn_cuda *c = ctx;
    if (!v || n <= 0) {
        TD_LOG_ERR("cuda map_vector: empty or NULL vector");
        return TD_EINVAL;
    }
    const kn_cu_map_entry *old = map_find(&c->map, v);
    if (old) {
        if (old->n_rows == 1 && old->n_cols >= n) return 0;
        TD_LOG_ERR("cuda map_vector: %p mapped before as a different object", (const void *)v);
        return TD_EINVAL;
    }
    const size_t bytes = (size_t)n * sizeof(float);
    void *dev = NULL;
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess) e = cudaMalloc(&dev, bytes);
    if (e != cudaSuccess) return kn_cu_error(e, "map_vector: cudaMalloc");
    e = cudaMemcpy(dev, v, bytes, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
        cudaFree(dev);
        return kn_cu_error(e, "map_vector: cudaMemcpy");
    }
    kn_cu_map_entry en = {
        .host = v, .dev = dev, .type = TD_F32, .n_rows = 1, .n_cols = n, .dev_stride = bytes};
    int rc = map_insert(&c->map, &en);
    if (rc) {
        cudaFree(dev);
        return rc;
    }
    c->map.bytes += bytes;
    return 0;
}

kn_cu_map_entry *kn_cu_map_entry_of(kn_cuda *c, const void *p)
{
    return map_find(&c->map, p);
}

const void *kn_cu_ptr(const kn_cuda *c, const void *p)
{
    const kn_cu_map_entry *e = map_find(&c->map, p);
    return e ? e->dev : p;
}

void kn_cu_mat(const kn_cuda *c, const kn_mat *w, kn_mat *dw)
{
    *dw = *w;
    const kn_cu_map_entry *e = map_find(&c->map, w->data);
    if (e) {
        dw->data = e->dev;
        dw->row_stride = e->dev_stride;
    }
}
