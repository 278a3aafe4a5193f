/* pf_tune.c: robust profile fit, online refit of the cost model from served chunks, and the
 * model's initial chunk size (see pf_tune.h). */
#include "pf_tune.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"
#include "td_linsolve.h"

#define NP            4 /* parameters: a, b, c_p (profile constant), c_o (chunk constant) */
#define MAX_PTS       (PF_TUNE_CAP + PF_TUNE_MAX_PROFILE)
#define REJECT_SIGMAS 3.5
#define REJECT_ROUNDS 3
#define MIN_PIVOT     1e-9

typedef struct {
    double f[NP]; /* features: (l^2, l, 1, 0) for a profile point, (q, x, 0, 1) for a chunk */
    double t, w;  /* ms, weight */
    bool keep;
} fit_pt;

/* Weighted least squares over the kept points on the columns in `mask`, with each column
 * scaled by its largest magnitude. theta (NP) gets 0 for columns left out. Returns false
 * when a pivot is not above MIN_PIVOT of the largest diagonal entry (poorly conditioned) or
 * theta is not finite. */
static bool wls(const fit_pt *p, int n, unsigned mask, double *theta)
{
    int col[NP], k = 0;
    double sc[NP] = {0};
    for (int j = 0; j < NP; j++)
        if (mask & (1u << j)) col[k++] = j;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < k; j++)
            if (p[i].keep && p[i].w > 0) sc[j] = fmax(sc[j], fabs(p[i].f[col[j]]));
    double A[NP * NP] = {0}, y[NP] = {0};
    for (int j = 0; j < k; j++)
        if (!(sc[j] > 0)) return false;
    for (int i = 0; i < n; i++) {
        if (!p[i].keep || !(p[i].w > 0)) continue;
        for (int r = 0; r < k; r++) {
            double fr = p[i].f[col[r]] / sc[r];
            for (int c = 0; c < k; c++)
                A[r * k + c] += p[i].w * fr * p[i].f[col[c]] / sc[c];
            y[r] += p[i].w * fr * p[i].t;
        }
    }
    double big = 0;
    for (int r = 0; r < k; r++)
        big = fmax(big, fabs(A[r * k + r]));
    if (!td_solve_dense(k, A, y, y, MIN_PIVOT * big)) return false;
    memset(theta, 0, NP * sizeof *theta);
    for (int j = 0; j < k; j++) {
        theta[col[j]] = y[j] / sc[j];
        if (!isfinite(theta[col[j]])) return false;
    }
    return true;
}

static double resid(const fit_pt *p, const double *theta)
{
    double e = p->t;
    for (int j = 0; j < NP; j++)
        e -= theta[j] * p->f[j];
    return e;
}

static int cmp_dbl(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

/* Fit, then drop the points beyond REJECT_SIGMAS robust sigmas (largest first, at most a
 * quarter of all points in all rounds) and refit. Returns false if a fit failed; *dropped
 * counts the points rejected. */
static bool robust_wls(fit_pt *p, int n, unsigned mask, double *theta, int *dropped)
{
    double r[MAX_PTS], sorted[MAX_PTS];
    int n_drop = 0;
    for (int round = 0; round <= REJECT_ROUNDS; round++) {
        if (!wls(p, n, mask, theta)) return false;
        if (round == REJECT_ROUNDS) break;
        int m = 0;
        double tmax = 0;
        for (int i = 0; i < n; i++) {
            r[i] = fabs(resid(&p[i], theta));
            if (p[i].keep) sorted[m++] = r[i], tmax = fmax(tmax, fabs(p[i].t));
        }
        qsort(sorted, (size_t)m, sizeof *sorted, cmp_dbl);
        double sigma = 1.4826 * (m % 2 ? sorted[m / 2] : 0.5 * (sorted[m / 2 - 1] + sorted[m / 2]));
        double thresh = fmax(REJECT_SIGMAS * sigma, 1e-9 * tmax);
        int before = n_drop;
        while (n_drop < n / 4) {
            int worst = -1;
            for (int i = 0; i < n; i++)
                if (p[i].keep && r[i] > thresh && (worst < 0 || r[i] > r[worst])) worst = i;
            if (worst < 0) break;
            p[worst].keep = false;
            n_drop++;
        }
        if (n_drop == before) break;
    }
    *dropped = n_drop;
    return true;
}

int pf_fit_robust(const double *len, const double *t, int n, pf_cost_model *m, int *n_rejected)
{
    if (n_rejected) *n_rejected = 0;
    if (n < 3 || n > MAX_PTS || !len || !t) return pf_fit_quadratic(len, t, n, m);
    fit_pt p[MAX_PTS];
    for (int i = 0; i < n; i++)
        p[i] = (fit_pt){.f = {len[i] * len[i], len[i], 1, 0}, .t = t[i], .w = 1, .keep = true};
    double theta[NP];
    int dropped = 0;
    if (!robust_wls(p, n, 0x7, theta, &dropped) || dropped == 0)
        return pf_fit_quadratic(len, t, n, m);
    double kl[MAX_PTS], kt[MAX_PTS];
    int k = 0;
    for (int i = 0; i < n; i++)
        if (p[i].keep) kl[k] = len[i], kt[k++] = t[i];
    int rc = pf_fit_quadratic(kl, kt, k, m);
    if (rc) return pf_fit_quadratic(len, t, n, m); /* the kept points degenerate: use all */
    if (n_rejected) *n_rejected = dropped;
    return 0;
}

void pf_tune_init(pf_tune *tu, const pf_cost_model *prior, const double *len, const double *ms,
                  int n, double decay)
{
    memset(tu, 0, sizeof *tu);
    tu->prior = *prior;
    tu->cur = *prior;
    tu->decay = decay > 0 && decay <= 1 ? decay : 0.97;
    if (n > PF_TUNE_MAX_PROFILE) n = PF_TUNE_MAX_PROFILE;
    for (int i = 0; i < n && len && ms; i++) {
        tu->plen[i] = len[i];
        tu->pms[i] = ms[i];
    }
    tu->n_prof = len && ms && n > 0 ? n : 0;
}

/* The online fit into *m and *c_o; false when it is not to be used (pf_tune.h's bound). */
static bool online_fit(const pf_tune *tu, pf_cost_model *m, double *c_o)
{
    if (tu->n_obs < PF_TUNE_MIN_CHUNKS || !tu->prior.dynamic || tu->n_prof < 3) return false;
    fit_pt p[MAX_PTS];
    int n = 0;
    for (int i = 0; i < tu->n_prof; i++)
        p[n++] = (fit_pt){.f = {tu->plen[i] * tu->plen[i], tu->plen[i], 1, 0},
                          .t = tu->pms[i],
                          .w = PF_TUNE_PRIOR_WEIGHT / tu->n_prof,
                          .keep = true};
    double w = 1;
    for (int k = 0; k < tu->n_obs; k++, w *= tu->decay) { /* newest first */
        const pf_tune_obs *o = &tu->ring[(tu->head - 1 - k + PF_TUNE_CAP) % PF_TUNE_CAP];
        p[n++] = (fit_pt){.f = {o->q, o->x, 0, 1}, .t = o->t, .w = w, .keep = true};
    }
    double th[NP];
    int dropped = 0;
    if (!robust_wls(p, n, 0xf, th, &dropped)) return false;
    double a0 = tu->prior.a;
    if (!(th[0] > 0) || th[0] > PF_TUNE_MAX_RATIO * a0 || th[0] < a0 / PF_TUNE_MAX_RATIO)
        return false;
    /* goodness of fit over the kept chunks (weighted) */
    double sw = 0, st = 0, ss_res = 0, ss_tot = 0;
    for (int i = tu->n_prof; i < n; i++)
        if (p[i].keep) sw += p[i].w, st += p[i].w * p[i].t;
    double tmean = sw > 0 ? st / sw : 0;
    for (int i = tu->n_prof; i < n; i++) {
        if (!p[i].keep) continue;
        double e = resid(&p[i], th);
        ss_res += p[i].w * e * e;
        ss_tot += p[i].w * (p[i].t - tmean) * (p[i].t - tmean);
    }
    *m = (pf_cost_model){.a = th[0],
                         .b = th[1] > 0 ? th[1] : 0,
                         .b_fit = th[1],
                         .c = th[2],
                         .r2 = ss_tot > 0 ? 1 - ss_res / ss_tot : 1,
                         .n_samples = n - dropped,
                         .valid = true,
                         .dynamic = true};
    *c_o = th[3];
    return true;
}

int pf_tune_observe(pf_tune *tu, const int64_t *L, const int64_t *x, int n_segs, double ms)
{
    if (n_segs < 1 || !isfinite(ms) || ms < 0) return TD_EINVAL;
    pf_tune_obs o = {.t = ms};
    for (int i = 0; i < n_segs; i++) {
        if (L[i] < 0 || x[i] < 1) return TD_EINVAL;
        o.q += (double)x[i] * (2.0 * (double)L[i] + (double)x[i]);
        o.x += (double)x[i];
    }
    tu->ring[tu->head] = o;
    tu->head = (tu->head + 1) % PF_TUNE_CAP;
    if (tu->n_obs < PF_TUNE_CAP) tu->n_obs++;
    tu->n_seen++;
    pf_cost_model m;
    double c_o = 0;
    if (online_fit(tu, &m, &c_o)) {
        tu->cur = m;
        tu->c_online = c_o;
        tu->online = true;
        tu->n_refits++;
    } else {
        tu->cur = tu->prior;
        tu->online = false;
        if (tu->n_obs >= PF_TUNE_MIN_CHUNKS) tu->n_kept_prior++;
    }
    return 0;
}

const pf_cost_model *pf_tune_model(const pf_tune *tu)
{
    return &tu->cur;
}

int pf_tune_initial_chunk(const pf_tune *tu, int64_t n, int pp, int align, int cap)
{
    if (align < 1) align = 1;
    if (cap < align) return cap;
    const pf_cost_model *m = &tu->cur;
    double c = tu->online ? tu->c_online : m->c;
    if (pp <= 1 || !m->valid || !(m->a >= 0) || !(m->b >= 0) || n < 1) return cap;
    double c_min = PF_TUNE_C_FLOOR * (m->a * align * (double)align + m->b * align);
    if (!(c >= c_min)) c = c_min; /* also a NaN */
    if (!(c > 0)) return cap;
    double nd = (double)n, F = m->a * nd * nd + m->b * nd;
    if (!(F > 0)) return cap;
    double nk = sqrt(F * (pp - 1) / c);
    if (nk < 1) nk = 1;
    double T = F / nk, C;
    if (m->a > 0)
        C = 2 * T / (m->b + sqrt(m->b * m->b + 4 * m->a * T));
    else
        C = m->b > 0 ? T / m->b : (double)cap;
    if (!(C < (double)cap)) return cap;
    int ci = (int)C / align * align;
    return ci < align ? align : ci;
}
