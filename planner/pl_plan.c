/* pl_plan.c: workloads, the configuration search and the SGLang reproduction (pl_plan.h). */
#include "pl_plan.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"

static uint64_t rng_next(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 11;
}

static double rng_unit(uint64_t *s) /* in (0, 1) */
{
    return ((double)rng_next(s) + 0.5) / 9007199254740992.0;
}

static int rng_range(uint64_t *s, int lo, int hi)
{
    return lo + (int)(rng_unit(s) * (hi - lo + 1));
}

int pl_workload_make(const pl_workload *w, pl_request *out)
{
    if (w->n_requests < 1 || w->rate < 0 || !isfinite(w->rate) || w->prompt_lo < 1 ||
        w->prompt_hi < w->prompt_lo || w->output_lo < 1 || w->output_hi < w->output_lo)
        return TD_EINVAL;
    uint64_t s = w->seed * 2654435761u + 12345;
    double t = 0;
    for (int i = 0; i < w->n_requests; i++) {
        if (w->rate > 0 && i > 0) t += -log(rng_unit(&s)) / w->rate * 1e3;
        out[i] = (pl_request){.arrival_ms = t,
                              .prompt = rng_range(&s, w->prompt_lo, w->prompt_hi),
                              .output = rng_range(&s, w->output_lo, w->output_hi)};
    }
    return 0;
}

static int cand_cmp(const void *a, const void *b)
{
    const pl_candidate *x = a, *y = b;
    if (x->r.devices != y->r.devices) return x->r.devices - y->r.devices;
    return (x->r.output_tps < y->r.output_tps) - (x->r.output_tps > y->r.output_tps);
}

int pl_search(const pl_model *m, const pl_hw *hw, const pl_request *reqs, int n,
              const pl_search_params *p, pl_candidate **out, int *n_out, int *best)
{
    static const int par[] = {1, 2, 4, 8};
    /* decode shapes: tp 1, 2, 4, 8; then data-parallel attention groups of 2 and 4 members
     * of tp 1 (a mixture-of-experts model, without ep) */
    static const int dshape_tp[] = {1, 2, 4, 8, 1, 1}, dshape_dp[] = {1, 1, 1, 1, 2, 4};
    int mi = p->max_instances > 0 ? p->max_instances : 4;
    int max_tpp = p->max_prefill_tp > 0 ? p->max_prefill_tp : 1;
    int total = mi * mi * 4 * 4 * 6, k = 0, rc = 0;
    pl_candidate *c = calloc((size_t)total, sizeof *c);
    if (!c) return TD_ENOMEM;
    for (int np = 1; np <= mi && !rc; np++)
        for (int a = 0; a < 4 && !rc; a++)
            for (int b = 0; b < 4 && !rc; b++)
                for (int nd = 1; nd <= mi && !rc; nd++)
                    for (int d = 0; d < 6 && !rc; d++) {
                        int pp = par[a], tpp = par[b], tpd = dshape_tp[d], dp = dshape_dp[d];
                        if (pp > m->n_layer || tpp > hw->devices_per_node || tpp > max_tpp ||
                            tpd > hw->devices_per_node ||
                            (dp > 1 && (p->ep || m->n_expert < dp || dp > hw->devices_per_node)) ||
                            (p->max_devices > 0 && np * pp * tpp + nd * tpd * dp > p->max_devices))
                            continue;
                        pl_candidate *x = &c[k];
                        x->cl =
                            (pl_cluster){.n_prefill = np,
                                         .n_decode = nd,
                                         .pf = p->pf,
                                         .dc = {.tp = tpd,
                                                .max_batch = p->max_batch,
                                                .ep = p->ep,
                                                .dp = dp,
                                                .tbo_min = tpd > 1 && dp == 1 ? p->tbo_min : 0}};
                        x->cl.pf.pp = pp;
                        x->cl.pf.tp = tpp;
                        rc = pl_simulate(m, hw, &x->cl, reqs, n, &x->r);
                        x->meets = !rc && x->r.fits && x->r.ttft_p90 <= p->ttft_ms &&
                                   x->r.tpot_p90 <= p->tpot_ms;
                        k++;
                    }
    if (rc) {
        free(c);
        return rc;
    }
    qsort(c, (size_t)k, sizeof *c, cand_cmp);
    *best = -1;
    for (int i = 0; i < k && *best < 0; i++)
        if (c[i].meets) *best = i;
    *out = c;
    *n_out = k;
    return 0;
}

/* Prefill of n prompts of len tokens all at time 0 on one instance: the time the last
 * one's KV landed (ms), and the first one's TTFT when n is 1. */
static int prefill_span(const pl_model *m, const pl_hw *hw, const pl_prefill_cfg *pf, int n,
                        int len, double *span)
{
    pl_request r[16] = {{0}};
    double ttft[16];
    int64_t nc;
    if (n < 1 || n > 16) return TD_EINVAL;
    for (int i = 0; i < n; i++)
        r[i] = (pl_request){.arrival_ms = 0, .prompt = len, .output = 1};
    int rc = pl_sim_prefill(m, hw, pf, 1, r, n, ttft, &nc);
    *span = 0;
    for (int i = 0; i < n && !rc; i++)
        *span = fmax(*span, ttft[i]);
    return rc;
}

int pl_reproduce(const pl_hw *h20, int n_batch, pl_repro_row *rows)
{
    pl_model m;
    int rc = pl_model_named("deepseek-v3", &m);
    if (rc) return rc;
    const int len = 131072; /* SGLang's 128K-token prompts */
    /* TP8 and TP32: SGLang's default chunked prefill (16K chunks; one pipeline stage, so
     * the chunk size changes only the per-chunk overhead) */
    pl_prefill_cfg tp8 = {.pp = 1, .tp = 8, .chunk = 16384, .chunk_max = 16384};
    pl_prefill_cfg tp32 = tp8;
    tp32.tp = 32;
    pl_prefill_cfg pp4 = {.pp = 4, .tp = 8, .chunk = 12288, .chunk_max = 12288, .smooth = 0.65};
    pl_prefill_cfg pp4f = {.pp = 4, .tp = 8, .chunk = 4096, .chunk_max = 4096};
    double s8, s32, s4, s4f, t8, t4;
    if ((rc = prefill_span(&m, h20, &tp8, n_batch, len, &s8)) ||
        (rc = prefill_span(&m, h20, &tp32, n_batch, len, &s32)) ||
        (rc = prefill_span(&m, h20, &pp4, n_batch, len, &s4)) ||
        (rc = prefill_span(&m, h20, &pp4f, n_batch, len, &s4f)) ||
        (rc = prefill_span(&m, h20, &tp8, 1, len, &t8)) ||
        (rc = prefill_span(&m, h20, &pp4, 1, len, &t4)))
        return rc;
    pl_repro_row r[PL_REPRO_ROWS] = {
        {"prefill throughput PP4xTP8 / TP8 (dynamic 12K, s 0.65)", "x", 3.31, s8 / s4},
        {"prefill throughput TP32 / TP8", "x", 2.54, s8 / s32},
        {"prefill throughput PP4xTP8 / TP32", "x", 1.305, s32 / s4},
        {"strong-scaling efficiency PP4xTP8 (speed-up / 4)", "%", 82.8, 100 * s8 / s4 / 4},
        {"prefill throughput PP4xTP8 / TP8 (best fixed 4K)", "x", 3.20, s8 / s4f},
        {"TTFT TP8, one 128K prompt", "s", 48.5, t8 / 1e3},
        {"TTFT PP4xTP8, one 128K prompt", "s", 15.5, t4 / 1e3},
        {"TTFT reduction PP4xTP8 vs TP8", "%", 67.9, 100 * (1 - t4 / t8)},
    };
    memcpy(rows, r, sizeof r);
    return 0;
}
