/* pl_calib_chunk.c: `tandem calibrate`'s prefill chunks after a prefix (pl_calib.h): the
 * shape the prefill node computes (a chunk of x tokens whose attention reads L earlier
 * ones), measured, and the cost model fitted to them together with the start-up profile. */
#include <stdlib.h>
#include <string.h>

#include "pl_calib.h"
#include "td_clock.h"
#include "td_err.h"
#include "td_linsolve.h"
#include "td_stats.h"

/* One forward of x tokens at positions [L, L + x) of one sequence whose [0, L) is in the
 * pool, no logits (the prefill profile's forwards compute none either); ms. */
static int chunk_once(pf_shard *sh, int L, int x, double *ms)
{
    const kn_model *m = sh->rt.model;
    int32_t *tok = malloc((size_t)x * sizeof *tok), *pos = malloc((size_t)x * sizeof *pos);
    int32_t *seq_of = calloc((size_t)x, sizeof *seq_of);
    kn_kv_seq seq;
    kn_kv_seq_init(&seq);
    int rc = tok && pos && seq_of ? kn_kv_seq_reserve(sh->mem, &seq, L + x) : TD_ENOMEM;
    for (int i = 0; i < x && !rc; i++) {
        tok[i] = (int32_t)(((uint32_t)(L + i) * 7919u + 17) % (uint32_t)m->hp.n_vocab);
        pos[i] = L + i;
    }
    kn_seq_view view = {.block_table = seq.blocks, .n_ctx = L + x};
    kn_batch b = {
        .n_tokens = x, .tokens = tok, .pos = pos, .seq_of = seq_of, .n_seqs = 1, .seqs = &view};
    int64_t t0 = td_now_ns();
    if (!rc) rc = kn_engine_forward(sh->rt.engine, sh->kv, &b, NULL);
    *ms = (double)(td_now_ns() - t0) / 1e6;
    kn_kv_seq_fini(sh->mem, &seq);
    free(tok);
    free(pos);
    free(seq_of);
    return rc;
}

int pl_calib_chunks(pf_shard *sh, int long_ctx, int x, int n, int reps, pl_calib_chunk *out)
{
    if (x < 1 || n < 1 || n > PL_CALIB_MAX_CHUNKS || reps < 1 || reps > 16) return TD_EINVAL;
    /* KV pages never written are the kernel's zero page (pl_calib_decode_steps) */
    memset(sh->kv->region, 0x3c, sh->kv->region_bytes);
    int rc = 0;
    for (int k = 0; k < n && !rc; k++) {
        double t[16];
        out[k].L = (double)k * long_ctx / n;
        out[k].x = x;
        for (int r = 0; r < reps && !rc; r++)
            rc = chunk_once(sh, (int)out[k].L, x, &t[r]);
        if (!rc) out[k].ms = td_stats_median(t, (size_t)reps);
    }
    return rc;
}

int pl_calib_fit_joint(const double *len, const double *t, int n_prof, const pl_calib_chunk *ch,
                       int n_ch, pf_cost_model *fit)
{
    /* columns scaled to O(1) so the normal equations stay well conditioned */
    const double s2 = 1e-6, s1 = 1e-3;
    double A[9] = {0}, y[3] = {0}, p[3];
    int n = n_prof + n_ch;
    for (int i = 0; i < n; i++) {
        double q, l, ti;
        if (i < n_prof) {
            q = len[i] * len[i], l = len[i], ti = t[i];
        } else {
            const pl_calib_chunk *c = &ch[i - n_prof];
            q = c->x * (2.0 * c->L + c->x), l = c->x, ti = c->ms;
        }
        double row[3] = {q * s2, l * s1, 1};
        for (int j = 0; j < 3; j++) {
            for (int k = 0; k < 3; k++)
                A[j * 3 + k] += row[j] * row[k];
            y[j] += row[j] * ti;
        }
    }
    /* the pivot floor guards the division only */
    if (n < 3 || !td_solve_dense(3, A, y, p, 1e-300)) return TD_ERANGE;
    double a = p[0] * s2, b = p[1] * s1;
    if (!(a > 0) || !(b > 0)) return TD_ERANGE; /* not a convex cost: keep the profile's */
    fit->a = a;
    fit->b = fit->b_fit = b;
    fit->c = p[2];
    return 0;
}
