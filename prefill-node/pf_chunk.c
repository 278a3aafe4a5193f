/* pf_chunk.c: layer partition, least-squares quadratic cost model and the dynamic chunk
 * planner of the prefill node (see pf_chunk.h and BACKGROUND.md section 5). */
#include "pf_chunk.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "td_err.h"
#include "td_linsolve.h"

#define PF_MIN_ALIGN 64 /* tokens: dynamic chunks are multiples of max(page, this) */

/* ---- layer partition ---- */

int pf_layer_partition(int n_layer, int pp, const int *parts, int n_parts, int *counts)
{
    if (n_layer < 1 || pp < 1 || pp > n_layer) {
        TD_LOG_ERR("layer partition: %d layers cannot be split into %d stages", n_layer, pp);
        return TD_EINVAL;
    }
    if (parts) {
        if (n_parts != pp) {
            TD_LOG_ERR("layer partition: %d entries for %d stages", n_parts, pp);
            return TD_EINVAL;
        }
        long sum = 0;
        for (int s = 0; s < pp; s++) {
            if (parts[s] < 1) {
                TD_LOG_ERR("layer partition: stage %d has %d layers (must be > 0)", s, parts[s]);
                return TD_EINVAL;
            }
            sum += parts[s];
        }
        if (sum != n_layer) {
            TD_LOG_ERR("layer partition: sums to %ld layers, the model has %d", sum, n_layer);
            return TD_EINVAL;
        }
        memcpy(counts, parts, (size_t)pp * sizeof *counts);
        return 0;
    }
    /* the first pp - extra stages get the floor, the last `extra` one more layer */
    int base = n_layer / pp, extra = n_layer % pp;
    for (int s = 0; s < pp; s++)
        counts[s] = base + (s >= pp - extra ? 1 : 0);
    return 0;
}

int pf_stage_range(const int *counts, int pp, int stage, int *l0, int *l1)
{
    if (stage < 0 || stage >= pp) {
        TD_LOG_ERR("stage %d out of range (pp %d)", stage, pp);
        return TD_EINVAL;
    }
    int start = 0;
    for (int s = 0; s < stage; s++)
        start += counts[s];
    *l0 = start;
    *l1 = start + counts[stage];
    return 0;
}

/* ---- least-squares quadratic ---- */

int pf_fit_quadratic(const double *len, const double *t, int n, pf_cost_model *m)
{
    memset(m, 0, sizeof *m);
    if (n < 3 || !len || !t) return TD_EINVAL;
    double lo = INFINITY, hi = -INFINITY, mean = 0;
    for (int i = 0; i < n; i++) {
        if (!isfinite(len[i]) || !isfinite(t[i])) return TD_EINVAL;
        lo = fmin(lo, len[i]);
        hi = fmax(hi, len[i]);
        mean += len[i];
    }
    mean /= n;
    /* at least 3 distinct lengths */
    int distinct = 1;
    double second = NAN;
    for (int i = 0; i < n && distinct < 3; i++) {
        if (len[i] == lo) continue;
        if (isnan(second)) {
            second = len[i];
            distinct = 2;
        } else if (len[i] != second) {
            distinct = 3;
        }
    }
    if (distinct < 3) return TD_EINVAL;
    /* u = (l - mean) / half_range lies in about [-1, 1]: the normal equations stay well
     * conditioned whatever the magnitude of the lengths */
    double half = 0.5 * (hi - lo);
    double S[5] = {0}, R[3] = {0};
    for (int i = 0; i < n; i++) {
        double u = (len[i] - mean) / half, up = 1;
        for (int k = 0; k < 5; k++) {
            S[k] += up;
            if (k < 3) R[k] += up * t[i];
            up *= u;
        }
    }
    double A[9] = {S[0], S[1], S[2], S[1], S[2], S[3], S[2], S[3], S[4]};
    double p[3]; /* t ~ p0 + p1 u + p2 u^2 */
    /* singular: a pivot negligible against the matrix's largest entry */
    double scale = 0;
    for (int i = 0; i < 9; i++)
        scale = fmax(scale, fabs(A[i]));
    if (!td_solve_dense(3, A, R, p, 1e-12 * scale)) return TD_EINVAL;
    if (!isfinite(p[0]) || !isfinite(p[1]) || !isfinite(p[2])) return TD_EINVAL;
    /* goodness of fit in u space (no conversion error) */
    double tmean = 0;
    for (int i = 0; i < n; i++)
        tmean += t[i];
    tmean /= n;
    double ss_res = 0, ss_tot = 0;
    for (int i = 0; i < n; i++) {
        double u = (len[i] - mean) / half;
        double e = t[i] - (p[0] + u * (p[1] + u * p[2]));
        ss_res += e * e;
        ss_tot += (t[i] - tmean) * (t[i] - tmean);
    }
    /* back to l: u = (l - mean) / half */
    double a = p[2] / (half * half);
    double b = p[1] / half - 2 * p[2] * mean / (half * half);
    double c = p[0] - p[1] * mean / half + p[2] * mean * mean / (half * half);
    if (!isfinite(a) || !isfinite(b) || !isfinite(c)) return TD_EINVAL;
    m->a = a;
    m->b_fit = b;
    m->b = b > 0 ? b : 0;
    m->c = c;
    /* constant times: a constant is in the family, the fit is exact up to round-off */
    m->r2 = ss_tot > 0 ? 1 - ss_res / ss_tot : 1;
    m->n_samples = n;
    m->valid = true;
    /* a > 0, beyond round-off: its effect over the sampled range must show in the times */
    double tmax = 0;
    for (int i = 0; i < n; i++)
        tmax = fmax(tmax, fabs(t[i]));
    m->dynamic = a > 0 && p[2] > 1e-9 * tmax;
    return 0;
}

double pf_cost_eval(const pf_cost_model *m, double l)
{
    return (m->a * l + m->b) * l + m->c;
}

double pf_cost_chunk(const pf_cost_model *m, int64_t L, int64_t x)
{
    double xl = (double)x;
    return m->a * xl * (2.0 * (double)L + xl) + m->b * xl;
}

/* ---- chunk planner ---- */

int pf_chunk_align(const pf_chunk_params *p)
{
    return p->page_size > PF_MIN_ALIGN ? p->page_size : PF_MIN_ALIGN;
}

static bool params_ok(const pf_chunk_params *p)
{
    return p && p->chunk_size >= 1 && p->smooth >= 0 && p->smooth <= 1 && p->page_size >= 0 &&
           p->max_batch_tokens >= 0;
}

int64_t pf_next_chunk(const pf_cost_model *m, const pf_chunk_params *p, int64_t done,
                      int64_t remaining)
{
    if (!params_ok(p) || done < 0 || remaining < 1) return TD_EINVAL;
    const int64_t C = p->chunk_size;
    int64_t next = C;
    bool fixed = done == 0 || !p->dynamic || p->smooth == 0 || !m || !m->dynamic;
    if (!fixed) {
        double a = m->a, b = m->b > 0 ? m->b : 0, Cd = (double)C;
        double T = a * Cd * Cd + b * Cd;
        double B = 2 * a * (double)done + b;
        double x = 2 * T / (B + sqrt(B * B + 4 * a * T)); /* positive root, stable form */
        double want = Cd + p->smooth * (x - Cd);
        double floor_ = Cd / 4;
        if (!(want >= floor_)) want = floor_; /* also catches NaN */
        int64_t align = pf_chunk_align(p);
        int64_t w = want < (double)INT64_MAX / 2 ? (int64_t)want : C;
        next = w / align * align;
        if (next < align) next = align;
    }
    if (next > remaining) next = remaining;
    if (p->max_batch_tokens > 0 && next > p->max_batch_tokens) next = p->max_batch_tokens;
    return next;
}

int64_t pf_plan_max_chunks(const pf_chunk_params *p, int64_t n_tokens)
{
    if (!params_ok(p) || n_tokens < 0) return 0;
    /* every chunk but the last is at least min(C, align, max_batch_tokens) */
    int64_t lo = p->chunk_size, align = pf_chunk_align(p);
    if (align < lo) lo = align;
    if (p->max_batch_tokens > 0 && p->max_batch_tokens < lo) lo = p->max_batch_tokens;
    return (n_tokens + lo - 1) / lo;
}

int pf_plan_chunks(const pf_cost_model *m, const pf_chunk_params *p, int64_t n_tokens,
                   int32_t *chunks, int64_t cap, int64_t *n_chunks)
{
    *n_chunks = 0;
    if (!params_ok(p) || n_tokens < 1 || cap < 0) return TD_EINVAL;
    int64_t done = 0, k = 0;
    while (done < n_tokens) {
        int64_t x = pf_next_chunk(m, p, done, n_tokens - done);
        if (x < 1) return TD_EINVAL;
        if (k >= cap) return TD_ERANGE;
        chunks[k++] = (int32_t)x;
        done += x;
    }
    *n_chunks = k;
    return 0;
}
