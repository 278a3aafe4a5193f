/* pl_decode.c: the decode side of the simulator (continuous batching on tp devices per
 * instance) and pl_simulate, which runs prefill then decode over a workload (pl_sim.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pl_sim.h"
#include "td_err.h"

#define MEM_USABLE 0.9 /* as pl_sim.c: share of device memory for weights + KV */

typedef struct {
    double ready;             /* first token out (KV landed), ms */
    double finish;            /* last token, ms */
    int prompt, output, made; /* made: tokens out so far (the first from prefill) */
} dreq;

typedef struct {
    int *run, n_run;    /* (max_batch) running requests */
    int *queue, q0, q1; /* (n) waiting, FIFO [q0, q1) */
    double kv_used;     /* tokens reserved */
    double step_end;
    bool stepping;
} dinst;

typedef struct {
    const pl_model *m;
    const pl_hw *hw;
    int tp, max_batch;
    double kv_cap; /* tokens of KV an instance holds */
    dreq *r;
} dsim;

static void admit(dsim *d, dinst *in)
{
    while (in->q0 < in->q1 && in->n_run < d->max_batch) {
        dreq *q = &d->r[in->queue[in->q0]];
        double need = (double)q->prompt + q->output;
        if (in->kv_used + need > d->kv_cap) break;
        in->kv_used += need;
        in->run[in->n_run++] = in->queue[in->q0++];
    }
}

static void start_step(dsim *d, dinst *in, double now)
{
    admit(d, in);
    in->stepping = in->n_run > 0;
    if (!in->stepping) return;
    double S = 0;
    for (int i = 0; i < in->n_run; i++)
        S += d->r[in->run[i]].prompt + d->r[in->run[i]].made;
    in->step_end = now + pl_decode_step_ms(d->m, d->hw, d->tp, in->n_run, S);
}

static void end_step(dsim *d, dinst *in)
{
    int keep = 0;
    for (int i = 0; i < in->n_run; i++) {
        dreq *q = &d->r[in->run[i]];
        if (++q->made >= q->output) {
            q->finish = in->step_end;
            in->kv_used -= (double)q->prompt + q->output;
        } else {
            in->run[keep++] = in->run[i];
        }
    }
    in->n_run = keep;
    start_step(d, in, in->step_end);
}

/* The event loop over n_dec instances: arrivals (ready) and step ends, earliest first. */
static void run_decode(dsim *d, dinst *in, int n_dec, const int *order, int n)
{
    int next = 0;
    for (;;) {
        int e = -1;
        for (int i = 0; i < n_dec; i++)
            if (in[i].stepping && (e < 0 || in[i].step_end < in[e].step_end)) e = i;
        while (next < n && d->r[order[next]].made >= d->r[order[next]].output) {
            d->r[order[next]].finish = d->r[order[next]].ready; /* nothing left to decode */
            next++;
        }
        double ta = next < n ? d->r[order[next]].ready : INFINITY;
        if (e < 0 && next >= n) return;
        if (e < 0 || ta <= in[e].step_end) {
            int best = 0;
            for (int i = 1; i < n_dec; i++)
                if (in[i].n_run + in[i].q1 - in[i].q0 < in[best].n_run + in[best].q1 - in[best].q0)
                    best = i;
            in[best].queue[in[best].q1++] = order[next++];
            if (!in[best].stepping) start_step(d, &in[best], ta);
        } else {
            end_step(d, &in[e]);
        }
    }
}

static int pct_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* p-th percentile (nearest rank) of v (n, sorted in place), mean into *mean */
static double pct(double *v, int n, double p, double *mean)
{
    if (n < 1) return *mean = 0;
    qsort(v, (size_t)n, sizeof *v, pct_cmp);
    double s = 0;
    for (int i = 0; i < n; i++)
        s += v[i];
    *mean = s / n;
    int k = (int)ceil(p * n) - 1;
    return v[k < 0 ? 0 : k];
}

/* Weights and a request's KV in device memory: "" if they fit, else why not. */
static bool check_fit(const pl_model *m, const pl_hw *hw, const pl_cluster *cl, int max_tokens,
                      double *kv_cap, char *why, size_t cap)
{
    double mem = hw->mem_bytes * MEM_USABLE;
    int pd = cl->pf.pp * cl->pf.tp;
    double pf_need = (m->weight_bytes + (double)max_tokens * m->kv_bytes_token) / pd;
    if (pf_need > mem) {
        snprintf(why, cap, "prefill needs %.1f GiB a device", pf_need / 1073741824.0);
        return false;
    }
    *kv_cap = (mem * cl->dc.tp - m->weight_bytes) / m->kv_bytes_token;
    if (*kv_cap < max_tokens) {
        snprintf(why, cap, "decode tp %d holds %.0f KV tokens < %d", cl->dc.tp,
                 *kv_cap > 0 ? *kv_cap : 0, max_tokens);
        return false;
    }
    return true;
}

static void summarize(const pl_request *reqs, const dreq *r, int n, double *tmp, pl_result *res)
{
    double t0 = INFINITY, pend = 0, end = 0, in_tok = 0, out_tok = 0;
    for (int i = 0; i < n; i++) {
        t0 = fmin(t0, reqs[i].arrival_ms);
        pend = fmax(pend, r[i].ready);
        end = fmax(end, r[i].finish);
        in_tok += reqs[i].prompt;
        out_tok += reqs[i].output;
        tmp[i] = r[i].ready - reqs[i].arrival_ms;
    }
    res->ttft_p50 = pct(tmp, n, 0.5, &res->ttft_mean);
    res->ttft_p90 = pct(tmp, n, 0.9, &res->ttft_mean);
    int k = 0;
    for (int i = 0; i < n; i++)
        if (reqs[i].output > 1) tmp[k++] = (r[i].finish - r[i].ready) / (reqs[i].output - 1);
    res->tpot_p50 = pct(tmp, k, 0.5, &res->tpot_mean);
    res->tpot_p90 = pct(tmp, k, 0.9, &res->tpot_mean);
    res->makespan_ms = end - t0;
    res->prefill_end_ms = pend - t0;
    res->prefill_tps = pend > t0 ? in_tok / ((pend - t0) * 1e-3) : 0;
    res->output_tps = end > t0 ? out_tok / ((end - t0) * 1e-3) : 0;
}

int pl_simulate(const pl_model *m, const pl_hw *hw, const pl_cluster *cl, const pl_request *reqs,
                int n, pl_result *res)
{
    memset(res, 0, sizeof *res);
    if (cl->n_prefill < 1 || cl->n_decode < 1 || cl->dc.tp < 1 || cl->dc.max_batch < 0 || n < 1)
        return TD_EINVAL;
    res->devices = cl->n_prefill * cl->pf.pp * cl->pf.tp + cl->n_decode * cl->dc.tp;
    int max_tokens = 0;
    for (int i = 0; i < n; i++)
        if (reqs[i].prompt + reqs[i].output > max_tokens)
            max_tokens = reqs[i].prompt + reqs[i].output;
    dsim d = {
        .m = m, .hw = hw, .tp = cl->dc.tp, .max_batch = cl->dc.max_batch ? cl->dc.max_batch : 256};
    res->fits = check_fit(m, hw, cl, max_tokens, &d.kv_cap, res->why, sizeof res->why);
    if (!res->fits) return 0;
    double *tmp = malloc((size_t)n * sizeof *tmp);
    pl_key *keys = malloc((size_t)n * sizeof *keys);
    int *order = malloc((size_t)n * sizeof *order);
    d.r = calloc((size_t)n, sizeof *d.r);
    dinst *in = calloc((size_t)cl->n_decode, sizeof *in);
    int rc = tmp && keys && order && d.r && in ? 0 : TD_ENOMEM;
    if (!rc) rc = pl_sim_prefill(m, hw, &cl->pf, cl->n_prefill, reqs, n, tmp, &res->n_chunks);
    for (int i = 0; i < cl->n_decode && !rc; i++) {
        in[i].run = malloc((size_t)d.max_batch * sizeof *in[i].run);
        in[i].queue = malloc((size_t)n * sizeof *in[i].queue);
        if (!in[i].run || !in[i].queue) rc = TD_ENOMEM;
    }
    for (int i = 0; i < n && !rc; i++) {
        d.r[i] = (dreq){.ready = reqs[i].arrival_ms + tmp[i],
                        .prompt = reqs[i].prompt,
                        .output = reqs[i].output,
                        .made = 1};
        keys[i] = (pl_key){.t = d.r[i].ready, .i = i};
    }
    if (!rc) {
        pl_sort_keys(keys, n);
        for (int i = 0; i < n; i++)
            order[i] = keys[i].i;
        run_decode(&d, in, cl->n_decode, order, n);
        summarize(reqs, d.r, n, tmp, res);
    }
    for (int i = 0; in && i < cl->n_decode; i++) {
        free(in[i].run);
        free(in[i].queue);
    }
    free(in);
    free(d.r);
    free(order);
    free(keys);
    free(tmp);
    return rc;
}
