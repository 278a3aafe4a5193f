/* cpu_fused.c: the CPU backend's fused ops (kn_backend.h, optional members): several products
 * of one x in one pool dispatch (q, k, v), and the FFN's gate and up products with their
 * GLU activation in one, and a product with the residual add that follows it; and a
 * mixture-of-experts layer's experts, each on its own rows, in two dispatches (gate and up of
 * every expert, then every down) instead of two per expert.
 *
 * Why: at batch 1 a layer of a small model is a handful of products of a few hundred KiB
 * each, and every op is a fork-join of the pool (wake the workers, wait for the slowest).
 * Fusing cuts the products' dispatches per layer from 7 (q, k, v, o, gate, up, down) to 4
 * (plus attention's, where its context is long enough to split), and the parts of a fused dispatch
 * write disjoint outputs, so the one join at its end is the only barrier. (Parts that claim chunks
 * of rows from a shared counter instead of fixed halves were tried and measured slower on a busy
 * machine: BENCHMARKS.md "Engine".) Exactness: every row of W is computed by the dot path of
 * cpu_matmul.c (kn_cpu_dot_rows), which gives a row the same bits whichever thread computes it and
 * whichever rows it is grouped with, so y is bit-identical to kn_cpu_matmul_mixed's. In the q8
 * mode a packed 32-block matrix (cpu_packed.c) at m <= 4 goes through the integer GEMM's
 * panel-free kernel instead, and a packed K-quant matrix through the packed dot (cpu_q8kpack.c),
 * whose rows have the same property on 16-row groups: the parts then split on whole groups
 * (kn_cpu_dot's grain). When matmul_mixed would send the batch rows to the
 * gemm path (prefill), or the q8 GEMM would need a panel, the fused ops run the unfused
 * sequence instead. The activation runs per part on whole 8-element groups of the part's columns,
 * with the element loop of kn_cpu_swiglu/geglu (cpu_internal.h), so its bits match too; a row width
 * that is not a multiple of 8 runs the unfused activation after the dispatch. The residual
 * add is the float add of kn_cpu_add, element by element.
 * TANDEM_CPU_FUSED=0 at kn_cpu_create leaves these ops out of the table (cpu_backend.c), so the
 * engine runs the unfused sequence in the same binary.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_backend.h"
#include "cpu_internal.h"
#include "cpu_q8act.h"
#include "td_err.h"

/* Each thread gets at least this many weight bytes (as the dot path of cpu_matmul.c): a
 * fork-join costs about what one thread needs to stream 8 KiB. */
#define FUSED_MIN_BYTES (16 * 1024)
/* Columns of the GLU per item: the activation's SIMD width, so parts split on whole groups. */
#define GLU_GROUP 8

typedef struct {
    int n_w;
    int64_t grain; /* rows per item: the largest d[i].grain */
    kn_cpu_dot d[KN_MULTI_MAX];
    int64_t start[KN_MULTI_MAX + 1]; /* item offsets of each W in the concatenated items */
} multi_job;

/* Items [i0, i1) of products d[0..n) laid end to end (d[i]'s items [start[i], start[i+1]),
 * grain rows each). */
static void run_items(const kn_cpu_dot *d, const int64_t *start, int n, int64_t grain, int64_t i0,
                      int64_t i1)
{
    for (int i = 0; i < n; i++) {
        const int64_t a = i0 > start[i] ? i0 : start[i];
        const int64_t b = i1 < start[i + 1] ? i1 : start[i + 1];
        if (a >= b) continue;
        const int64_t rows = d[i].w->n_rows, r1 = (b - start[i]) * grain;
        kn_cpu_dot_rows(&d[i], (a - start[i]) * grain, r1 < rows ? r1 : rows);
    }
}

static void multi_part(void *arg, int64_t i0, int64_t i1, int tid)
{
    const multi_job *J = arg;
    run_items(J->d, J->start, J->n_w, J->grain, i0, i1);
    (void)tid;
}

/* The rows per item a dispatch over d[0..n) must split on (kn_cpu_dot_rows's grain). */
static int64_t grain_of(const kn_cpu_dot *d, int n)
{
    int64_t g = 1;
    for (int i = 0; i < n; i++)
        if (d[i].grain > g) g = d[i].grain;
    return g;
}

static int64_t row_bytes(const kn_mat *w)
{
    const int64_t rb = (int64_t)td_dtype_row_bytes(w->type, w->n_cols);
    return rb > 0 ? rb : 1;
}

static int64_t min_rows_for(const kn_mat *w)
{
    const int64_t r = FUSED_MIN_BYTES / row_bytes(w);
    return r < 4 ? 4 : r;
}

/* The side floats prepare_in needs for d[i], i < n, of one x of m rows. */
static size_t side_floats(kn_cpu *c, int n, const kn_mat *const *w, int64_t m)
{
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += kn_cpu_dot_side_floats(c, w[i], m);
    return total;
}

/* Prepares d[i] for y[i] = x W_i^T, i < n, sharing x's side data between matrices of one
 * type, in side (side_floats of them). 0, 1 (the gemm path: run the unfused sequence) or a
 * TD_ error. */
static int prepare_in(kn_cpu *c, int n, const kn_mat *const *w, const float *x, int64_t m,
                      int64_t m_solo, float *const *y, kn_cpu_dot *d, float *side)
{
    for (int i = 0; i < n; i++) {
        if (w[i]->n_cols != w[0]->n_cols) {
            TD_LOG_ERR("fused matmul: matrix %d has %lld columns, matrix 0 %lld", i,
                       (long long)w[i]->n_cols, (long long)w[0]->n_cols);
            return TD_EINVAL;
        }
        int same = -1;
        for (int k = 0; k < i && same < 0; k++)
            if (w[k]->type == w[i]->type) same = k;
        if (same >= 0) { /* same type and x: the same side data */
            d[i] = d[same];
            d[i].w = w[i];
            d[i].y = y[i];
            /* a packed kernel needs this matrix's own copy; without one, the q8 GEMM
             * would need a panel, while the K-quant dot reads the rows as they are */
            if (d[i].packed && !(d[i].packed = kn_cpu_packed_of(c, w[i]))) {
                if (kn_q8_gemm_supported(w[i])) return 1;
                d[i].grain = 1;
            }
            continue;
        }
        int rc = kn_cpu_dot_init(c, w[i], x, m, m_solo, side, y[i], &d[i]);
        if (rc) return rc;
        side += kn_cpu_dot_side_floats(c, w[i], m);
    }
    return 0;
}

/* prepare_in with the caller's scratch as the side buffer. */
static int prepare(kn_cpu *c, int n, const kn_mat *const *w, const float *x, int64_t m,
                   int64_t m_solo, float *const *y, kn_cpu_dot *d)
{
    size_t side_total = side_floats(c, n, w, m);
    float *side = kn_cpu_scratch(c, KN_CPU_CALLER, side_total ? side_total : 1);
    if (!side) {
        TD_LOG_ERR("fused matmul: out of memory for %zu floats of side data", side_total);
        return TD_ENOMEM;
    }
    return prepare_in(c, n, w, x, m, m_solo, y, d, side);
}

int kn_cpu_matmul_multi(void *ctx, int n_w, const kn_mat *const *w, const float *x, int64_t m,
                        int64_t m_solo, float *const *y)
{
    kn_cpu *c = ctx;
    if (n_w < 1 || n_w > KN_MULTI_MAX) {
        TD_LOG_ERR("fused matmul: %d matrices (1..%d)", n_w, KN_MULTI_MAX);
        return TD_EINVAL;
    }
    if (m == 0) return 0;
    multi_job J = {.n_w = n_w};
    int rc = prepare(c, n_w, w, x, m, m_solo, y, J.d);
    if (rc < 0) return rc;
    if (rc == 1) { /* the batch rows take the gemm path */
        for (int i = 0; i < n_w; i++)
            if ((rc = kn_cpu_matmul_mixed(ctx, w[i], x, m, m_solo, y[i]))) return rc;
        return 0;
    }
    J.grain = grain_of(J.d, n_w);
    int64_t min_rows = 0;
    for (int i = 0; i < n_w; i++) {
        J.start[i + 1] = J.start[i] + (w[i]->n_rows + J.grain - 1) / J.grain;
        if (min_rows_for(w[i]) > min_rows) min_rows = min_rows_for(w[i]);
    }
    kn_pool_run(kn_cpu_pool(c), J.start[n_w], (min_rows + J.grain - 1) / J.grain, multi_part, &J);
    return 0;
}

typedef struct {
    kn_cpu_dot g, u;
    const float *gate, *up; /* (m, F) */
    float *out;             /* (m, F) */
    int64_t m, F;
    int64_t cols;   /* columns per item: GLU_GROUP, or the dots' grain (a multiple of it) */
    bool gelu, act; /* act: the parts run the activation */
} glu_job;

static void glu_part(void *arg, int64_t i0, int64_t i1, int tid)
{
    const glu_job *J = arg;
    const int64_t r0 = i0 * J->cols, r1 = i1 * J->cols < J->F ? i1 * J->cols : J->F;
    kn_cpu_dot_rows(&J->g, r0, r1);
    kn_cpu_dot_rows(&J->u, r0, r1);
    if (!J->act) return;
    for (int64_t i = 0; i < J->m; i++) {
        const int64_t e0 = i * J->F + r0, e1 = i * J->F + r1;
        if (J->gelu)
            kn_cpu_geglu_span(J->gate, J->up, J->out, e0, e1);
        else
            kn_cpu_swiglu_span(J->gate, J->up, J->out, e0, e1);
    }
    (void)tid;
}

static void glu_unfused_act(void *ctx, const glu_job *J)
{
    if (J->gelu)
        kn_cpu_geglu(ctx, J->gate, J->up, J->out, J->m, J->F);
    else
        kn_cpu_swiglu(ctx, J->gate, J->up, J->out, J->m, J->F);
}

int kn_cpu_glu_ffn(void *ctx, const kn_mat *wg, const kn_mat *wu, const float *x, int64_t m,
                   int64_t m_solo, bool gelu, float *gate, float *up, float *out)
{
    kn_cpu *c = ctx;
    if (wg->n_rows != wu->n_rows) {
        TD_LOG_ERR("fused glu: gate has %lld rows, up %lld", (long long)wg->n_rows,
                   (long long)wu->n_rows);
        return TD_EINVAL;
    }
    if (m == 0) return 0;
    const int64_t F = wg->n_rows;
    glu_job J = {.gate = gate, .up = up, .out = out, .m = m, .F = F, .gelu = gelu};
    const kn_mat *w[2] = {wg, wu};
    float *const y[2] = {gate, up};
    kn_cpu_dot d[2];
    int rc = prepare(c, 2, w, x, m, m_solo, y, d);
    if (rc < 0) return rc;
    if (rc == 1) { /* the batch rows take the gemm path: the unfused sequence */
        if ((rc = kn_cpu_matmul_mixed(ctx, wg, x, m, m_solo, gate))) return rc;
        if ((rc = kn_cpu_matmul_mixed(ctx, wu, x, m, m_solo, up))) return rc;
        glu_unfused_act(ctx, &J);
        return 0;
    }
    J.g = d[0];
    J.u = d[1];
    const int64_t grain = grain_of(d, 2);
    J.cols = grain > GLU_GROUP ? grain : GLU_GROUP; /* 8 or 16: whole activation groups */
    /* swiglu's flat spans keep every element on its SIMD loop only for widths of whole groups */
    J.act = gelu || F % GLU_GROUP == 0;
    const int64_t r = min_rows_for(wg) > min_rows_for(wu) ? min_rows_for(wg) : min_rows_for(wu);
    const int64_t items = (F + J.cols - 1) / J.cols;
    kn_pool_run(kn_cpu_pool(c), items, (r + J.cols - 1) / J.cols, glu_part, &J);
    if (!J.act) glu_unfused_act(ctx, &J);
    return 0;
}

typedef struct {
    kn_cpu_dot d;
    float *acc; /* (m, n_rows) */
} add_job;

static void add_part(void *arg, int64_t i0, int64_t i1, int tid)
{
    const add_job *J = arg;
    const int64_t N = J->d.w->n_rows, g = J->d.grain;
    const int64_t r0 = i0 * g, r1 = i1 * g < N ? i1 * g : N;
    kn_cpu_dot_rows(&J->d, r0, r1);
    for (int64_t i = 0; i < J->d.m; i++) {
        float *a = J->acc + i * N;
        const float *y = J->d.y + i * N;
        for (int64_t r = r0; r < r1; r++)
            a[r] += y[r];
    }
    (void)tid;
}

int kn_cpu_matmul_add(void *ctx, const kn_mat *w, const float *x, int64_t m, int64_t m_solo,
                      float *y, float *acc)
{
    kn_cpu *c = ctx;
    if (m == 0) return 0;
    add_job J = {.acc = acc};
    const kn_mat *wp[1] = {w};
    float *const yp[1] = {y};
    int rc = prepare(c, 1, wp, x, m, m_solo, yp, &J.d);
    if (rc < 0) return rc;
    if (rc == 1) { /* the batch rows take the gemm path: the unfused sequence */
        if ((rc = kn_cpu_matmul_mixed(ctx, w, x, m, m_solo, y))) return rc;
        kn_cpu_add(ctx, acc, y, m, w->n_rows);
        return 0;
    }
    const int64_t g = J.d.grain;
    kn_pool_run(kn_cpu_pool(c), (w->n_rows + g - 1) / g, (min_rows_for(w) + g - 1) / g, add_part,
                &J);
    return 0;
}

typedef struct {
    int n;
    int64_t grain;
    const kn_cpu_dot *d;  /* (n) */
    const int64_t *start; /* (n + 1) */
} group_job;

static void group_part(void *arg, int64_t i0, int64_t i1, int tid)
{
    const group_job *J = arg;
    run_items(J->d, J->start, J->n, J->grain, i0, i1);
    (void)tid;
}

/* The products d[0..n) in one dispatch, items on the largest grain. */
static void run_group(kn_cpu *c, const kn_cpu_dot *d, int n, int64_t *start)
{
    if (n == 0) return;
    group_job J = {.n = n, .d = d, .start = start, .grain = grain_of(d, n)};
    int64_t min_rows = 0;
    start[0] = 0;
    for (int i = 0; i < n; i++) {
        start[i + 1] = start[i] + (d[i].w->n_rows + J.grain - 1) / J.grain;
        if (min_rows_for(d[i].w) > min_rows) min_rows = min_rows_for(d[i].w);
    }
    kn_pool_run(kn_cpu_pool(c), start[n], (min_rows + J.grain - 1) / J.grain, group_part, &J);
}

/* Stage 1 of kn_cpu_experts_ffn: every group's gate and up products whose rows take the dot
 * path in one dispatch, the others (gemm path, per-call q8 panel) by glu_ffn after it;
 * then the activation of the dispatched ones. done[i]: group i ran whole (activation too). */
static int experts_glu(kn_cpu *c, int n, const kn_mat *const *wg, const kn_mat *const *wu,
                       const float *const *x, const int64_t *m, const int64_t *m_solo, bool gelu,
                       float *const *gate, float *const *up, kn_cpu_dot *d, int64_t *start,
                       bool *done, float *side)
{
    int nd = 0, rc = 0;
    for (int i = 0; i < n; i++) {
        const kn_mat *w2[2] = {wg[i], wu[i]};
        float *const y2[2] = {gate[i], up[i]};
        int r = prepare_in(c, 2, w2, x[i], m[i], m_solo[i], y2, d + nd, side);
        if (r < 0) return r;
        side += side_floats(c, 2, w2, m[i]);
        done[i] = r == 1;
        if (r == 0) nd += 2;
    }
    run_group(c, d, nd, start);
    for (int i = 0; i < n; i++) {
        if (done[i]) {
            if ((rc = kn_cpu_glu_ffn(c, wg[i], wu[i], x[i], m[i], m_solo[i], gelu, gate[i], up[i],
                                     gate[i])))
                return rc;
        } else if (gelu) {
            kn_cpu_geglu(c, gate[i], up[i], gate[i], m[i], wg[i]->n_rows);
        } else {
            kn_cpu_swiglu(c, gate[i], up[i], gate[i], m[i], wg[i]->n_rows);
        }
    }
    return 0;
}

int kn_cpu_experts_ffn(void *ctx, int n, const kn_mat *const *wg, const kn_mat *const *wu,
                       const kn_mat *const *wd, const float *const *x, const int64_t *m,
                       const int64_t *m_solo, bool gelu, float *const *gate, float *const *up,
                       float *const *y)
{
    kn_cpu *c = ctx;
    if (n <= 0) return 0;
    size_t side1 = 0, side2 = 0;
    for (int i = 0; i < n; i++) {
        if (wg[i]->n_rows != wu[i]->n_rows || wd[i]->n_cols != wg[i]->n_rows || m[i] < 1) {
            TD_LOG_ERR("experts ffn: group %d: gate %lld rows, up %lld, down %lld columns, "
                       "%lld rows of x",
                       i, (long long)wg[i]->n_rows, (long long)wu[i]->n_rows,
                       (long long)wd[i]->n_cols, (long long)m[i]);
            return TD_EINVAL;
        }
        const kn_mat *w2[2] = {wg[i], wu[i]};
        side1 += side_floats(c, 2, w2, m[i]);
        side2 += side_floats(c, 1, &wd[i], m[i]);
    }
    const size_t side_n = (side1 > side2 ? side1 : side2) + 1;
    float *side = kn_cpu_scratch(c, KN_CPU_CALLER, side_n);
    kn_cpu_dot *d = malloc((size_t)(2 * n) * sizeof *d);
    int64_t *start = malloc((size_t)(2 * n + 1) * sizeof *start);
    bool *late = malloc((size_t)n * sizeof *late);
    int rc = side && d && start && late ? 0 : TD_ENOMEM;
    if (!rc) rc = experts_glu(c, n, wg, wu, x, m, m_solo, gelu, gate, up, d, start, late, side);
    /* stage 2: the down products; glu_ffn above may have reused the scratch, so the side
     * data is prepared again from its start */
    if (!rc && !(side = kn_cpu_scratch(c, KN_CPU_CALLER, side_n))) rc = TD_ENOMEM;
    int nd = 0;
    float *s = side;
    for (int i = 0; i < n && !rc; i++) {
        int r = prepare_in(c, 1, &wd[i], gate[i], m[i], m_solo[i], &y[i], d + nd, s);
        s += side_floats(c, 1, &wd[i], m[i]);
        if (r < 0) rc = r;
        late[i] = r == 1;
        if (r == 0) nd++;
    }
    if (!rc) {
        run_group(c, d, nd, start);
        for (int i = 0; i < n && !rc; i++)
            if (late[i]) rc = kn_cpu_matmul_mixed(ctx, wd[i], gate[i], m[i], m_solo[i], y[i]);
    }
    if (rc == TD_ENOMEM) TD_LOG_ERR("experts ffn: out of memory for %d groups", n);
    free(d);
    free(start);
    free(late);
    return rc;
}
