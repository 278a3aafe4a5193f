/* cpu_dev.c: the cpu-dev backend (cpu_dev.h): the cpu backend's kernels behind a device
 * backend's contract, every pointer checked against the backend's own allocations. */
#include "cpu_dev.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "td_err.h"

/* One range of backend memory: an allocation (host NULL) or the copy of mapped host data
 * [host, host + n). */
typedef struct {
    const char *p;
    size_t n;
    const char *host;
} cd_buf;

/* A sorted set of ranges, by p (allocations) or by host (mapped copies). */
typedef struct {
    cd_buf *v;
    int n, cap;
} cd_set;

typedef struct {
    kn_backend cpu;
    cd_set dev; /* allocations, sorted by p */
    cd_set map; /* weight copies, sorted by host */
    kn_cpudev_stats st;
} kn_cpudev;

static const kn_backend_ops cpudev_ops;

static const char *key(const cd_set *s, int i, bool by_host)
{
    return by_host ? s->v[i].host : s->v[i].p;
}

/* Index of the last range whose key is <= k, or -1. */
static int floor_of(const cd_set *s, const char *k, bool by_host)
{
    int lo = 0, hi = s->n - 1, at = -1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (key(s, mid, by_host) <= k) {
            at = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return at;
}

static int set_insert(cd_set *s, cd_buf b, bool by_host)
{
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 256;
        cd_buf *v = realloc(s->v, (size_t)cap * sizeof *v);
        if (!v) return TD_ENOMEM;
        s->v = v;
        s->cap = cap;
    }
    int at = floor_of(s, by_host ? b.host : b.p, by_host) + 1;
    memmove(s->v + at + 1, s->v + at, (size_t)(s->n - at) * sizeof *s->v);
    s->v[at] = b;
    s->n++;
    return 0;
}

static void violation(kn_cpudev *d, const char *op, const char *arg, const void *p, size_t n)
{
    if (!d->st.n_violations++) {
        snprintf(d->st.first, sizeof d->st.first, "%s: %s %p (%zu bytes) is not %s memory", op, arg,
                 p, n, cpudev_ops.name);
        TD_LOG_ERR("backend %s: %s", cpudev_ops.name, d->st.first);
    }
}

/* p (n bytes from p) must lie in one allocation; returns p. */
static const void *dev(kn_cpudev *d, const char *op, const char *arg, const void *p, size_t n)
{
    if (!p) return p;
    int i = floor_of(&d->dev, p, false);
    const char *c = p;
    if (i < 0 || c + n > d->dev.v[i].p + d->dev.v[i].n) violation(d, op, arg, p, n);
    return p;
}

/* The copy of mapped host data at p (a violation, and p itself, when unmapped). */
static const void *weight(kn_cpudev *d, const char *op, const void *p)
{
    if (!p) return p;
    const char *c = p;
    int i = floor_of(&d->map, c, true);
    if (i >= 0 && c < d->map.v[i].host + d->map.v[i].n)
        return d->map.v[i].p + (c - d->map.v[i].host);
    violation(d, op, "weight", p, 0);
    return p;
}

static kn_mat mat(kn_cpudev *d, const char *op, const kn_mat *w)
{
    kn_mat m = *w;
    m.data = weight(d, op, w->data);
    return m;
}

static void seqs_ok(kn_cpudev *d, const char *op, const kn_seq_view *v, const int32_t *seq_of,
                    int64_t m)
{
    int n = 0;
    for (int64_t i = 0; i < m; i++) /* seq_of was checked as backend memory: readable */
        n = seq_of[i] + 1 > n ? seq_of[i] + 1 : n;
    dev(d, op, "seqs", v, (size_t)n * sizeof *v);
    for (int i = 0; v && i < n; i++)
        dev(d, op, "block_table", v[i].block_table, 4);
}

/* ---- lifetime and memory ---- */

static void cd_destroy(void *ctx)
{
    kn_cpudev *d = ctx;
    for (int i = 0; i < d->dev.n; i++)
        free((void *)d->dev.v[i].p);
    for (int i = 0; i < d->map.n; i++)
        free((void *)d->map.v[i].p);
    free(d->dev.v);
    free(d->map.v);
    d->cpu.ops->destroy(d->cpu.ctx);
    free(d);
}

static void cd_describe(void *ctx, char *buf, size_t cap)
{
    kn_cpudev *d = ctx;
    char inner[128];
    d->cpu.ops->describe(d->cpu.ctx, inner, sizeof inner);
    snprintf(buf, cap, "cpu-dev (device contract checked, for tests) over %s", inner);
}

static void *cd_alloc(void *ctx, size_t bytes)
{
    kn_cpudev *d = ctx;
    size_t n = bytes ? bytes : 1;
    char *p = aligned_alloc(64, (n + 63) & ~(size_t)63);
    if (!p) return NULL;
    if (set_insert(&d->dev, (cd_buf){.p = p, .n = n}, false)) {
        free(p);
        return NULL;
    }
    d->st.n_live++;
    return p;
}

static void cd_free(void *ctx, void *p)
{
    kn_cpudev *d = ctx;
    if (!p) return;
    int i = floor_of(&d->dev, p, false);
    if (i < 0 || d->dev.v[i].p != p) {
        violation(d, "free", "p", p, 0);
        return;
    }
    free(p);
    memmove(d->dev.v + i, d->dev.v + i + 1, (size_t)(d->dev.n - i - 1) * sizeof *d->dev.v);
    d->dev.n--;
    d->st.n_live--;
}

/* The first violation is the asynchronous error every later download and synchronize
 * reports. */
static int async_error(const kn_cpudev *d)
{
    return d->st.n_violations ? TD_ESTATE : 0;
}

static int cd_upload(void *ctx, void *dst, const void *src, size_t n)
{
    kn_cpudev *d = ctx;
    memcpy((void *)dev(d, "upload", "dst", dst, n), src, n);
    d->st.n_upload++;
    d->st.bytes_upload += n;
    return 0;
}

static int cd_download(void *ctx, void *dst, const void *src, size_t n)
{
    kn_cpudev *d = ctx;
    memcpy(dst, dev(d, "download", "src", src, n), n);
    d->st.n_download++;
    d->st.bytes_download += n;
    return async_error(d);
}

static int cd_sync(void *ctx)
{
    return async_error(ctx);
}

static void *cd_host_alloc(void *ctx, size_t bytes)
{
    kn_cpudev *d = ctx;
    void *p = aligned_alloc(64, ((bytes ? bytes : 1) + 63) & ~(size_t)63);
    if (p) d->st.n_host_live++;
    return p;
}

static void cd_host_free(void *ctx, void *p)
{
    kn_cpudev *d = ctx;
    if (!p) return;
    free(p);
    d->st.n_host_live--;
}

static int cd_map(kn_cpudev *d, const void *host, size_t n)
{
    int i = floor_of(&d->map, host, true);
    if (i >= 0 && d->map.v[i].host == host) return 0;
    char *p = malloc(n ? n : 1);
    if (!p) return TD_ENOMEM;
    memcpy(p, host, n);
    if (set_insert(&d->map, (cd_buf){.p = p, .n = n, .host = host}, true)) {
        free(p);
        return TD_ENOMEM;
    }
    d->st.n_mapped++;
    return 0;
}

static int cd_map_matrix(void *ctx, const kn_mat *w)
{
    const td_dtype_info *ti = td_dtype_get(w->type);
    size_t row = (size_t)w->n_cols / ti->blck * ti->type_size;
    return cd_map(ctx, w->data, (size_t)(w->n_rows - 1) * w->row_stride + row);
}

static int cd_map_vector(void *ctx, const float *v, int64_t n)
{
    return cd_map(ctx, v, (size_t)n * sizeof *v);
}

/* ---- compute: check, then the cpu kernel ---- */

#define FL(n) ((size_t)(n) * sizeof(float))
#define CPU   (((kn_cpudev *)ctx)->cpu)

static int cd_matmul(void *ctx, const kn_mat *w, const float *x, int64_t m, float *y)
{
    kn_mat c = mat(ctx, "matmul", w);
    dev(ctx, "matmul", "x", x, FL(m * w->n_cols));
    dev(ctx, "matmul", "y", y, FL(m * w->n_rows));
    return CPU.ops->matmul(CPU.ctx, &c, x, m, y);
}

static int cd_matmul_mixed(void *ctx, const kn_mat *w, const float *x, int64_t m, int64_t solo,
                           float *y)
{
    kn_mat c = mat(ctx, "matmul_mixed", w);
    dev(ctx, "matmul_mixed", "x", x, FL(m * w->n_cols));
    dev(ctx, "matmul_mixed", "y", y, FL(m * w->n_rows));
    return CPU.ops->matmul_mixed(CPU.ctx, &c, x, m, solo, y);
}

static void cd_rmsnorm(void *ctx, const float *x, const float *wt, float *y, int64_t m, int64_t n,
                       float eps)
{
    dev(ctx, "rmsnorm", "x", x, FL(m * n));
    dev(ctx, "rmsnorm", "y", y, FL(m * n));
    CPU.ops->rmsnorm(CPU.ctx, x, weight(ctx, "rmsnorm", wt), y, m, n, eps);
}

static void cd_rope(void *ctx, float *x, int64_t m, int nh, int hd, int n_rot, const int32_t *pos,
                    const float *freq, bool neox)
{
    dev(ctx, "rope", "x", x, FL(m * nh * hd));
    dev(ctx, "rope", "pos", pos, (size_t)m * 4);
    CPU.ops->rope(CPU.ctx, x, m, nh, hd, n_rot, pos, weight(ctx, "rope", freq), neox);
}

static void cd_swiglu(void *ctx, const float *g, const float *u, float *o, int64_t m, int64_t n)
{
    dev(ctx, "swiglu", "gate", g, FL(m * n));
    dev(ctx, "swiglu", "up", u, FL(m * n));
    dev(ctx, "swiglu", "out", o, FL(m * n));
    CPU.ops->swiglu(CPU.ctx, g, u, o, m, n);
}

static void cd_geglu(void *ctx, const float *g, const float *u, float *o, int64_t m, int64_t n)
{
    dev(ctx, "geglu", "gate", g, FL(m * n));
    dev(ctx, "geglu", "up", u, FL(m * n));
    dev(ctx, "geglu", "out", o, FL(m * n));
    CPU.ops->geglu(CPU.ctx, g, u, o, m, n);
}

static void cd_kv_write(void *ctx, void *kp, void *vp, td_dtype t, int bs, const kn_kv_slicing *sl,
                        int nkv, int hd, const float *k, const float *v, int64_t m,
                        const int32_t *pos, const int32_t *seq_of, const kn_seq_view *seqs)
{
    dev(ctx, "kv_write", "kpool", kp, 1);
    dev(ctx, "kv_write", "k", k, FL(m * nkv * hd));
    if (vp != kp) { /* else a latent pool: K only is written, v is not read (kn_backend.h) */
        dev(ctx, "kv_write", "vpool", vp, 1);
        dev(ctx, "kv_write", "v", v, FL(m * nkv * hd));
    }
    dev(ctx, "kv_write", "pos", pos, (size_t)m * 4);
    dev(ctx, "kv_write", "seq_of", seq_of, (size_t)m * 4);
    seqs_ok(ctx, "kv_write", seqs, seq_of, m);
    CPU.ops->kv_write(CPU.ctx, kp, vp, t, bs, sl, nkv, hd, k, v, m, pos, seq_of, seqs);
}

static void cd_attention(void *ctx, const float *q, const void *kp, const void *vp, td_dtype t,
                         int bs, const kn_kv_slicing *sl, int nh, int nkv, int group, int phase,
                         int hd, float scale, int window, float softcap, int64_t m, int64_t m_solo,
                         const int32_t *pos, const int32_t *seq_of, const kn_seq_view *seqs,
                         float *out)
{
    dev(ctx, "attention", "q", q, FL(m * nh * hd));
    dev(ctx, "attention", "kpool", kp, 1);
    dev(ctx, "attention", "vpool", vp, 1);
    dev(ctx, "attention", "pos", pos, (size_t)m * 4);
    dev(ctx, "attention", "seq_of", seq_of, (size_t)m * 4);
    dev(ctx, "attention", "out", out, FL(m * nh * hd));
    seqs_ok(ctx, "attention", seqs, seq_of, m);
    CPU.ops->attention(CPU.ctx, q, kp, vp, t, bs, sl, nh, nkv, group, phase, hd, scale, window,
                       softcap, m, m_solo, pos, seq_of, seqs, out);
}

static int cd_get_rows(void *ctx, const kn_mat *w, const int32_t *ids, int64_t m, float *out)
{
    kn_mat c = mat(ctx, "get_rows", w);
    dev(ctx, "get_rows", "ids", ids, (size_t)m * 4);
    dev(ctx, "get_rows", "out", out, FL(m * w->n_cols));
    return CPU.ops->get_rows(CPU.ctx, &c, ids, m, out);
}

static void cd_add(void *ctx, float *y, const float *x, int64_t m, int64_t n)
{
    dev(ctx, "add", "y", y, FL(m * n));
    dev(ctx, "add", "x", x, FL(m * n));
    CPU.ops->add(CPU.ctx, y, x, m, n);
}

static void cd_add_row(void *ctx, float *y, const float *b, int64_t m, int64_t n)
{
    dev(ctx, "add_row", "y", y, FL(m * n));
    CPU.ops->add_row(CPU.ctx, y, weight(ctx, "add_row", b), m, n);
}

static void cd_scale(void *ctx, float *x, int64_t n, float f)
{
    dev(ctx, "scale", "x", x, FL(n));
    CPU.ops->scale(CPU.ctx, x, n, f);
}

static void cd_copy_rows(void *ctx, const float *src, const int32_t *rows, int64_t m, int64_t n,
                         float *dst)
{
    dev(ctx, "copy_rows", "src", src, FL(n));
    dev(ctx, "copy_rows", "rows", rows, (size_t)m * 4);
    dev(ctx, "copy_rows", "dst", dst, FL(m * n));
    CPU.ops->copy_rows(CPU.ctx, src, rows, m, n, dst);
}

static void cd_weighted_rows_sum(void *ctx, const float *x, const int32_t *idx, const float *w,
                                 int k, int64_t m, int64_t n, float *y)
{
    dev(ctx, "weighted_rows_sum", "x", x, FL(n));
    dev(ctx, "weighted_rows_sum", "idx", idx, (size_t)(m * k) * 4);
    dev(ctx, "weighted_rows_sum", "w", w, FL(m * k));
    dev(ctx, "weighted_rows_sum", "y", y, FL(m * n));
    CPU.ops->weighted_rows_sum(CPU.ctx, x, idx, w, k, m, n, y);
}

static void cd_copy_2d(void *ctx, const float *src, int64_t ss, float *dst, int64_t ds, int64_t m,
                       int64_t n)
{
    if (m > 0) {
        dev(ctx, "copy_2d", "src", src, FL((m - 1) * ss + n));
        dev(ctx, "copy_2d", "dst", dst, FL((m - 1) * ds + n));
    }
    CPU.ops->copy_2d(CPU.ctx, src, ss, dst, ds, m, n);
}

static const kn_backend_ops cpudev_ops = {
    .name = "cpu-dev",
    .destroy = cd_destroy,
    .describe = cd_describe,
    .host_memory = false,
    .kv_sliced = true, /* the CPU kernels */
    .alloc = cd_alloc,
    .free = cd_free,
    .upload = cd_upload,
    .download = cd_download,
    .synchronize = cd_sync,
    .host_alloc = cd_host_alloc,
    .host_free = cd_host_free,
    .map_matrix = cd_map_matrix,
    .map_vector = cd_map_vector,
    .matmul = cd_matmul,
    .matmul_mixed = cd_matmul_mixed,
    .rmsnorm = cd_rmsnorm,
    .rope = cd_rope,
    .swiglu = cd_swiglu,
    .geglu = cd_geglu,
    .kv_write = cd_kv_write,
    .attention = cd_attention,
    .get_rows = cd_get_rows,
    .add = cd_add,
    .add_row = cd_add_row,
    .scale = cd_scale,
    .copy_rows = cd_copy_rows,
    .weighted_rows_sum = cd_weighted_rows_sum,
    .copy_2d = cd_copy_2d,
};

int kn_cpudev_create(int n_threads, const char *cpu_act, kn_backend *out)
{
    memset(out, 0, sizeof *out);
    kn_cpudev *d = calloc(1, sizeof *d);
    if (!d) return TD_ENOMEM;
    kn_cpu *c;
    int rc = kn_cpu_create(n_threads, &c);
    if (rc) {
        free(d);
        return rc;
    }
    kn_cpu_act_mode a;
    if (cpu_act && !kn_cpu_act_parse(cpu_act, &a)) kn_cpu_set_act(c, a);
    d->cpu = kn_cpu_backend(c);
    *out = (kn_backend){.ops = &cpudev_ops, .ctx = d};
    return 0;
}

int kn_cpudev_stats_of(kn_backend b, kn_cpudev_stats *out)
{
    if (b.ops != &cpudev_ops) return TD_EINVAL;
    *out = ((const kn_cpudev *)b.ctx)->st;
    return 0;
}
