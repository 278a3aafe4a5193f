/* test_engine_device.c: the engine drives a device backend (kn_backend.h: host_memory
 * false) without ever handing it host memory, and gets the same logits.
 *
 * The "shadow" backend below is the CPU backend behind a device-style contract: alloc
 * returns memory it tracks, map_matrix / map_vector keep private copies of the weights,
 * and every op checks each pointer it is given: activations, batch arrays, seq views and
 * the block tables they point to must be its own allocations, weights must be mapped host
 * pointers (which it swaps for its copies, as a GPU backend does). Any other pointer is a
 * violation (counted, named). The KV pool is created in the shadow's memory too. The
 * engine then runs a chunked prefill, greedy decode and a two-sequence batch on a
 * synthetic model, once on the plain CPU backend and once on the shadow: the logits must
 * be bit-identical (same kernels, same thread count) and the violations zero. This is the
 * CPU-side proof of the staging a CUDA backend relies on (engine_stage.c).
 * usage: test_engine_device MODEL.gguf
 */
#include <stdlib.h>
#include <string.h>

#include "../tharness.h"
#include "cpu_backend.h"
#include "kn_backends.h"
#include "model.h"
#include "td_err.h"

#define MAX_BUFS 4096

typedef struct {
    const char *p;
    size_t n;
    const char *host; /* mapped weights: the host range this copy stands for, else NULL */
} sh_buf;

typedef struct {
    kn_backend cpu;
    sh_buf bufs[MAX_BUFS];
    int n_bufs;
    int violations;
    char first[160]; /* the first violation */
} shadow;

static void violation(shadow *s, const char *op, const char *arg, const void *p)
{
    if (!s->violations++)
        snprintf(s->first, sizeof s->first, "%s: %s %p is not backend memory", op, arg, p);
}

/* p in the shadow's own memory (n bytes from p)? */
static bool is_dev(const shadow *s, const void *p, size_t n)
{
    const char *c = p;
    for (int i = 0; i < s->n_bufs; i++)
        if (!s->bufs[i].host && c >= s->bufs[i].p && c + n <= s->bufs[i].p + s->bufs[i].n)
            return true;
    return false;
}

static const void *dev(shadow *s, const char *op, const char *arg, const void *p, size_t n)
{
    if (p && !is_dev(s, p, n)) violation(s, op, arg, p);
    return p;
}

/* The copy of mapped host data at p, or p itself (counted) when unmapped. */
static const void *weight(shadow *s, const char *op, const void *p)
{
    const char *c = p;
    for (int i = 0; i < s->n_bufs; i++)
        if (s->bufs[i].host && c >= s->bufs[i].host && c < s->bufs[i].host + s->bufs[i].n)
            return s->bufs[i].p + (c - s->bufs[i].host);
    if (p) violation(s, op, "weight", p);
    return p;
}

static kn_mat mat(shadow *s, const char *op, const kn_mat *w)
{
    kn_mat d = *w;
    d.data = weight(s, op, w->data);
    return d;
}

static void seqs_ok(shadow *s, const char *op, const kn_seq_view *v, const int32_t *seq_of,
                    int64_t m)
{
    int n = 0;
    for (int64_t i = 0; i < m; i++)
        n = seq_of[i] + 1 > n ? seq_of[i] + 1 : n;
    dev(s, op, "seqs", v, (size_t)n * sizeof *v);
    for (int i = 0; i < n; i++)
        dev(s, op, "block_table", v[i].block_table, 4);
}

static void *sh_alloc(void *ctx, size_t bytes)
{
    shadow *s = ctx;
    if (s->n_bufs == MAX_BUFS) return NULL;
    char *p = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (p) s->bufs[s->n_bufs++] = (sh_buf){.p = p, .n = bytes};
    return p;
}

static void sh_free(void *ctx, void *p)
{
    shadow *s = ctx;
    for (int i = 0; i < s->n_bufs; i++)
        if (s->bufs[i].p == p && !s->bufs[i].host) {
            free(p);
            s->bufs[i] = s->bufs[--s->n_bufs];
            return;
        }
    if (p) violation(s, "free", "p", p);
}

static int sh_upload(void *ctx, void *dst, const void *src, size_t n)
{
    memcpy((void *)dev(ctx, "upload", "dst", dst, n), src, n);
    return 0;
}

static int sh_download(void *ctx, void *dst, const void *src, size_t n)
{
    memcpy(dst, dev(ctx, "download", "src", src, n), n);
    return 0;
}

static int sh_sync(void *ctx)
{
    return 0;
}

static int sh_map(shadow *s, const void *host, size_t n)
{
    for (int i = 0; i < s->n_bufs; i++)
        if (s->bufs[i].host == host) return 0;
    if (s->n_bufs == MAX_BUFS) return TD_ENOMEM;
    char *p = malloc(n);
    if (!p) return TD_ENOMEM;
    memcpy(p, host, n);
    s->bufs[s->n_bufs++] = (sh_buf){.p = p, .n = n, .host = host};
    return 0;
}

static int sh_map_matrix(void *ctx, const kn_mat *w)
{
    const td_dtype_info *ti = td_dtype_get(w->type);
    size_t row = (size_t)w->n_cols / ti->blck * ti->type_size;
    return sh_map(ctx, w->data, (size_t)(w->n_rows - 1) * w->row_stride + row);
}

static int sh_map_vector(void *ctx, const float *v, int64_t n)
{
    return sh_map(ctx, v, (size_t)n * sizeof *v);
}

#define FL(n) ((size_t)(n) * sizeof(float))
#define CPU   (((shadow *)ctx)->cpu)

static int sh_matmul(void *ctx, const kn_mat *w, const float *x, int64_t m, float *y)
{
    kn_mat d = mat(ctx, "matmul", w);
    dev(ctx, "matmul", "x", x, FL(m * w->n_cols));
    dev(ctx, "matmul", "y", y, FL(m * w->n_rows));
    return CPU.ops->matmul(CPU.ctx, &d, x, m, y);
}

static int sh_matmul_mixed(void *ctx, const kn_mat *w, const float *x, int64_t m, int64_t solo,
                           float *y)
{
    kn_mat d = mat(ctx, "matmul_mixed", w);
    dev(ctx, "matmul_mixed", "x", x, FL(m * w->n_cols));
    dev(ctx, "matmul_mixed", "y", y, FL(m * w->n_rows));
    return CPU.ops->matmul_mixed(CPU.ctx, &d, x, m, solo, y);
}

static void sh_rmsnorm(void *ctx, const float *x, const float *wt, float *y, int64_t m, int64_t n,
                       float eps)
{
    dev(ctx, "rmsnorm", "x", x, FL(m * n));
    dev(ctx, "rmsnorm", "y", y, FL(m * n));
    CPU.ops->rmsnorm(CPU.ctx, x, weight(ctx, "rmsnorm", wt), y, m, n, eps);
}

static void sh_rope(void *ctx, float *x, int64_t m, int nh, int hd, int n_rot, const int32_t *pos,
                    const float *freq, bool neox)
{
    dev(ctx, "rope", "x", x, FL(m * nh * hd));
    dev(ctx, "rope", "pos", pos, (size_t)m * 4);
    CPU.ops->rope(CPU.ctx, x, m, nh, hd, n_rot, pos, weight(ctx, "rope", freq), neox);
}

static void sh_swiglu(void *ctx, const float *g, const float *u, float *o, int64_t m, int64_t n)
{
    dev(ctx, "swiglu", "gate", g, FL(m * n));
    dev(ctx, "swiglu", "up", u, FL(m * n));
    dev(ctx, "swiglu", "out", o, FL(m * n));
    CPU.ops->swiglu(CPU.ctx, g, u, o, m, n);
}

static void sh_geglu(void *ctx, const float *g, const float *u, float *o, int64_t m, int64_t n)
{
    dev(ctx, "geglu", "gate", g, FL(m * n));
    dev(ctx, "geglu", "up", u, FL(m * n));
    dev(ctx, "geglu", "out", o, FL(m * n));
    CPU.ops->geglu(CPU.ctx, g, u, o, m, n);
}

static void sh_kv_write(void *ctx, void *kp, void *vp, td_dtype t, int bs, int nkv, int hd,
                        const float *k, const float *v, int64_t m, const int32_t *pos,
                        const int32_t *seq_of, const kn_seq_view *seqs)
{
    dev(ctx, "kv_write", "kpool", kp, 1);
    dev(ctx, "kv_write", "vpool", vp, 1);
    dev(ctx, "kv_write", "k", k, FL(m * nkv * hd));
    dev(ctx, "kv_write", "v", v, FL(m * nkv * hd));
    dev(ctx, "kv_write", "pos", pos, (size_t)m * 4);
    dev(ctx, "kv_write", "seq_of", seq_of, (size_t)m * 4);
    seqs_ok(ctx, "kv_write", seqs, seq_of, m);
    CPU.ops->kv_write(CPU.ctx, kp, vp, t, bs, nkv, hd, k, v, m, pos, seq_of, seqs);
}

static void sh_attention(void *ctx, const float *q, const void *kp, const void *vp, td_dtype t,
                         int bs, int nh, int nkv, int group, int phase, int hd, float scale,
                         int window, int64_t m, int64_t m_solo, const int32_t *pos,
                         const int32_t *seq_of, const kn_seq_view *seqs, float *out)
{
    dev(ctx, "attention", "q", q, FL(m * nh * hd));
    dev(ctx, "attention", "kpool", kp, 1);
    dev(ctx, "attention", "vpool", vp, 1);
    dev(ctx, "attention", "pos", pos, (size_t)m * 4);
    dev(ctx, "attention", "seq_of", seq_of, (size_t)m * 4);
    dev(ctx, "attention", "out", out, FL(m * nh * hd));
    seqs_ok(ctx, "attention", seqs, seq_of, m);
    CPU.ops->attention(CPU.ctx, q, kp, vp, t, bs, nh, nkv, group, phase, hd, scale, window, m,
                       m_solo, pos, seq_of, seqs, out);
}

static int sh_get_rows(void *ctx, const kn_mat *w, const int32_t *ids, int64_t m, float *out)
{
    kn_mat d = mat(ctx, "get_rows", w);
    dev(ctx, "get_rows", "ids", ids, (size_t)m * 4);
    dev(ctx, "get_rows", "out", out, FL(m * w->n_cols));
    return CPU.ops->get_rows(CPU.ctx, &d, ids, m, out);
}

static void sh_add(void *ctx, float *y, const float *x, int64_t m, int64_t n)
{
    dev(ctx, "add", "y", y, FL(m * n));
    dev(ctx, "add", "x", x, FL(m * n));
    CPU.ops->add(CPU.ctx, y, x, m, n);
}

static void sh_add_row(void *ctx, float *y, const float *b, int64_t m, int64_t n)
{
    dev(ctx, "add_row", "y", y, FL(m * n));
    CPU.ops->add_row(CPU.ctx, y, weight(ctx, "add_row", b), m, n);
}

static void sh_scale(void *ctx, float *x, int64_t n, float f)
{
    dev(ctx, "scale", "x", x, FL(n));
    CPU.ops->scale(CPU.ctx, x, n, f);
}

static void sh_copy_rows(void *ctx, const float *src, const int32_t *rows, int64_t m, int64_t n,
                         float *dst)
{
    dev(ctx, "copy_rows", "src", src, FL(n));
    dev(ctx, "copy_rows", "rows", rows, (size_t)m * 4);
    dev(ctx, "copy_rows", "dst", dst, FL(m * n));
    CPU.ops->copy_rows(CPU.ctx, src, rows, m, n, dst);
}

static const kn_backend_ops shadow_ops = {
    .name = "shadow",
    .host_memory = false,
    .alloc = sh_alloc,
    .free = sh_free,
    .upload = sh_upload,
    .download = sh_download,
    .synchronize = sh_sync,
    .map_matrix = sh_map_matrix,
    .map_vector = sh_map_vector,
    .matmul = sh_matmul,
    .matmul_mixed = sh_matmul_mixed,
    .rmsnorm = sh_rmsnorm,
    .rope = sh_rope,
    .swiglu = sh_swiglu,
    .geglu = sh_geglu,
    .kv_write = sh_kv_write,
    .attention = sh_attention,
    .get_rows = sh_get_rows,
    .add = sh_add,
    .add_row = sh_add_row,
    .scale = sh_scale,
    .copy_rows = sh_copy_rows,
};

/* ---- one engine + pool on a backend, and the run both backends must agree on ---- */

#define PROMPT 37
#define STEPS  5
#define BLOCK  16

static td_gguf *gguf;
static kn_model *model;

typedef struct {
    kn_backend be;
    kn_engine *eng;
    kn_kv_pool *kv;
    kn_kv_seq seq[2];
} rig;

static int rig_open(rig *r, kn_backend be)
{
    memset(r, 0, sizeof *r);
    r->be = be;
    int rc = kn_engine_create(model, be, NULL, &r->eng);
    if (rc) return rc;
    kn_kv_pool_params kp = kn_model_kv_params(model, 32, BLOCK, TD_F16);
    kp.backend = &r->be;
    if ((rc = kn_kv_pool_create(&kp, &r->kv))) return rc;
    kn_kv_seq_init(&r->seq[0]);
    kn_kv_seq_init(&r->seq[1]);
    return 0;
}

static void rig_close(rig *r)
{
    if (r->kv) {
        kn_kv_seq_fini(r->kv, &r->seq[0]);
        kn_kv_seq_fini(r->kv, &r->seq[1]);
    }
    kn_kv_pool_destroy(r->kv);
    kn_engine_destroy(r->eng);
}

/* Sequence 0 prefilled in chunks of 9 with sequence 1 (a shorter prompt) in the same
 * batches, then STEPS greedy steps of both together (decode rows solo); logits of every
 * step of both sequences into lg ((1 + STEPS) * 2 rows of n_vocab). */
static int run(rig *r, float *lg)
{
    const int nv = model->hp.n_vocab;
    int32_t tok[2][PROMPT + STEPS], len[2] = {PROMPT, PROMPT / 3};
    for (int i = 0; i < PROMPT; i++) {
        tok[0][i] = (i * 131 + 7) % nv;
        tok[1][i] = (i * 71 + 3) % nv;
    }
    int done[2] = {0, 0};
    int rc = 0;
    while (!rc && (done[0] < len[0] || done[1] < len[1])) {
        int32_t t[18], pos[18], so[18], rows[2];
        int n = 0, nl = 0;
        for (int s = 0; s < 2; s++)
            for (int k = 0; k < 9 && done[s] < len[s]; k++, done[s]++) {
                t[n] = tok[s][done[s]], pos[n] = done[s], so[n] = s;
                if (done[s] + 1 == len[s]) rows[nl++] = n;
                n++;
            }
        kn_seq_view v[2];
        for (int s = 0; s < 2 && !rc; s++) {
            rc = kn_kv_seq_reserve(r->kv, &r->seq[s], done[s]);
            v[s] = (kn_seq_view){.block_table = r->seq[s].blocks, .n_ctx = done[s]};
        }
        kn_batch b = {.n_tokens = n,
                      .tokens = t,
                      .pos = pos,
                      .seq_of = so,
                      .n_seqs = 2,
                      .seqs = v,
                      .n_logits = nl,
                      .logit_rows = rows};
        float tmp[2 * 512];
        if (!rc) rc = kn_engine_forward(r->eng, r->kv, &b, nl ? tmp : NULL);
        for (int i = 0; i < nl && !rc; i++) {
            int s = so[rows[i]];
            memcpy(lg + (size_t)s * nv, tmp + (size_t)i * nv, (size_t)nv * 4);
        }
    }
    for (int step = 0; step < STEPS && !rc; step++) {
        int32_t t[2], pos[2], so[2] = {0, 1}, rows[2] = {0, 1};
        kn_seq_view v[2];
        for (int s = 0; s < 2 && !rc; s++) {
            const float *l = lg + ((size_t)step * 2 + s) * nv;
            int best = 0;
            for (int i = 1; i < nv; i++)
                if (l[i] > l[best]) best = i;
            t[s] = best;
            pos[s] = len[s] + step;
            rc = kn_kv_seq_reserve(r->kv, &r->seq[s], pos[s] + 1);
            v[s] = (kn_seq_view){.block_table = r->seq[s].blocks, .n_ctx = pos[s] + 1};
        }
        kn_batch b = {.n_tokens = 2,
                      .n_solo = 2,
                      .tokens = t,
                      .pos = pos,
                      .seq_of = so,
                      .n_seqs = 2,
                      .seqs = v,
                      .n_logits = 2,
                      .logit_rows = rows};
        if (!rc) rc = kn_engine_forward(r->eng, r->kv, &b, lg + (size_t)(step + 1) * 2 * nv);
    }
    return rc;
}

static void test_shadow_equals_cpu(void)
{
    const int nv = model->hp.n_vocab;
    TH_REQUIRE(nv <= 512);
    size_t n = (size_t)(1 + STEPS) * 2 * nv;
    float *a = calloc(n, 4), *b = calloc(n, 4);
    kn_backend cpu;
    TH_REQUIRE(kn_backend_create("cpu", &(kn_backend_options){.n_threads = 2}, &cpu) == 0);
    shadow *sh = calloc(1, sizeof *sh);
    TH_REQUIRE(kn_backend_create("cpu", &(kn_backend_options){.n_threads = 2}, &sh->cpu) == 0);
    rig r1, r2;
    TH_REQUIRE(rig_open(&r1, cpu) == 0);
    TH_REQUIRE(rig_open(&r2, (kn_backend){.ops = &shadow_ops, .ctx = sh}) == 0);
    TH_CHECK(is_dev(sh, r2.kv->region, r2.kv->region_bytes)); /* the pool is device memory */
    TH_CHECK(run(&r1, a) == 0);
    TH_CHECK(run(&r2, b) == 0);
    TH_CHECKF(sh->violations == 0, "%d host pointers given to the device backend; first: %s",
              sh->violations, sh->first);
    TH_CHECK(memcmp(a, b, n * 4) == 0);
    float spread = 0;
    for (int i = 1; i < nv; i++)
        spread = fmaxf(spread, fabsf(a[i] - a[0]));
    TH_CHECK(spread > 0.1f); /* not a degenerate model: the comparison means something */
    rig_close(&r1);
    rig_close(&r2);
    TH_CHECKF(sh->n_bufs > 0, "weights stay mapped until the backend is destroyed");
    int left = 0;
    for (int i = 0; i < sh->n_bufs; i++)
        left += !sh->bufs[i].host;
    TH_CHECKF(left == 0, "%d device buffers not freed by engine and pool", left);
    for (int i = 0; i < sh->n_bufs; i++)
        free((void *)sh->bufs[i].p);
    kn_backend_destroy(&sh->cpu);
    kn_backend_destroy(&cpu);
    free(sh);
    free(a);
    free(b);
}

/* Device backends get tp 1 only until the NCCL collective exists; a shared (kvxfer) pool
 * cannot live in device memory yet: both are refused clearly, not run wrongly. */
static void test_refusals(void)
{
    shadow *sh = calloc(1, sizeof *sh);
    TH_REQUIRE(kn_backend_create("cpu", NULL, &sh->cpu) == 0);
    kn_backend be = {.ops = &shadow_ops, .ctx = sh};
    kn_kv_pool_params kp = kn_model_kv_params(model, 4, BLOCK, TD_F16);
    kp.backend = &be;
    kp.shm_name = "/tandem-test-device-pool";
    kn_kv_pool *kv = NULL;
    TH_CHECK(kn_kv_pool_create(&kp, &kv) == TD_EUNSUPP && !kv);
    kn_backend x;
    TH_CHECK(kn_backend_create("nope", NULL, &x) == TD_EINVAL && !x.ops);
    kn_backend_destroy(&sh->cpu);
    free(sh);
}

/* backend 'cuda' where it cannot run: a clear TD_EUNSUPP, never a CPU run in disguise */
static void test_cuda_refused_without_gpu(void)
{
    kn_backend b;
    int rc = kn_backend_create("cuda", NULL, &b);
    if (rc == 0) { /* a GPU and a complete CUDA backend: nothing to refuse */
        kn_backend_destroy(&b);
        return;
    }
    TH_CHECK(rc == TD_EUNSUPP && !b.ops);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: test_engine_device MODEL.gguf\n");
        return 2;
    }
    char err[256];
    if (td_gguf_open(argv[1], &gguf, err, sizeof err)) {
        fprintf(stderr, "cannot open %s: %s\n", argv[1], err);
        return 1;
    }
    if (kn_model_load(gguf, &(kn_shard){0}, &model)) return 1;
    TH_RUN(test_shadow_equals_cpu);
    TH_RUN(test_refusals);
    TH_RUN(test_cuda_refused_without_gpu);
    kn_model_destroy(model);
    td_gguf_close(gguf);
    TH_EXIT();
}
