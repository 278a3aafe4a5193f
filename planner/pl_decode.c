/* pl_decode.c: the decode side of the simulator (continuous batching on tp devices per
 * instance; colocated: the instance also prefills its prompts, a chunk of at most step_tokens
 * a step) and pl_simulate, which runs prefill then decode over a workload (pl_sim.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pl_sim.h"
#include "td_err.h"

#define MEM_USABLE 0.9 /* as pl_sim.c: share of device memory for weights + KV */

typedef struct {
    double ready;             /* at the decode instance: KV landed (colocated: arrival), ms */
    double first;             /* first token out, ms */
    double finish;            /* last token, ms */
    int prompt, output, made; /* made: tokens out so far (the first from prefill) */
    int pf_left;              /* colocated: prompt tokens not yet prefilled */
} dreq;

typedef struct {
    int *run, n_run;    /* (max_batch) running requests */
    int *queue, q0, q1; /* (n) waiting, FIFO [q0, q1) */
    double kv_used;     /* tokens reserved */
    double step_end;
    int pf_req, pf_x; /* the request whose chunk of pf_x tokens this step prefills; -1: none */
    bool stepping;
} dinst;

typedef struct {
    const pl_model *m;
    const pl_hw *hw;
    int tp, max_batch;
    bool ep;       /* experts whole on the ranks (pl_decode_cfg.ep) */
    int dp;        /* > 1: every instance a member of a dp group of this many (pl_decode_cfg.dp) */
    int tbo_min;   /* pl_decode_cfg.tbo_min */
    double kv_cap; /* tokens of KV an instance holds */
    dreq *r;
    bool colocated;
    int step_tokens;
    pl_stage whole; /* colocated: the whole model on tp devices, a prompt chunk's cost */
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

/* A step: one token for every running request past its prompt and (colocated) a chunk of
 * the first running request still prefilling, priced as a forward of the whole model. */
static void start_step(dsim *d, dinst *in, double now)
{
    admit(d, in);
    in->stepping = in->n_run > 0;
    if (!in->stepping) return;
    double S = 0;
    int B = 0;
    in->pf_req = -1;
    for (int i = 0; i < in->n_run; i++) {
        const dreq *q = &d->r[in->run[i]];
        if (q->pf_left > 0) {
            if (in->pf_req < 0) in->pf_req = in->run[i];
            continue;
        }
        S += q->prompt + q->made;
        B++;
    }
    double ms = !B          ? 0
                : d->dp > 1 ? pl_decode_step_ms_dp(d->m, d->hw, d->dp, B, S)
                : d->tbo_min && B >= d->tbo_min
                    ? pl_decode_step_ms_tbo(d->m, d->hw, d->tp, d->ep, B, S)
                    : pl_decode_step_ms(d->m, d->hw, d->tp, d->ep, B, S);
    if (in->pf_req >= 0) {
        const dreq *q = &d->r[in->pf_req];
        in->pf_x = q->pf_left < d->step_tokens ? q->pf_left : d->step_tokens;
        /* the step's fixed cost once: the chunk's forward carries it */
        ms += pl_stage_ms(d->m, &d->whole, q->prompt - q->pf_left, in->pf_x) -
              (B ? d->hw->step_overhead * 1e3 : 0);
    }
    in->step_end = now + ms;
}

static void end_step(dsim *d, dinst *in)
{
    int keep = 0;
    for (int i = 0; i < in->n_run; i++) {
        dreq *q = &d->r[in->run[i]];
        bool done = false;
        if (q->pf_left == 0) {
            done = ++q->made >= q->output;
        } else if (in->run[i] == in->pf_req && (q->pf_left -= in->pf_x) == 0) {
            q->first = in->step_end; /* the prompt's last chunk samples the first token */
            q->made = 1;
            done = q->output <= 1;
        }
        if (done) {
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
    if (cl->n_prefill > 0 && pf_need > mem) {
        snprintf(why, cap, "prefill needs %.1f GiB a device", pf_need / 1073741824.0);
        return false;
    }
    /* a dp member holds every weight but the routed experts, of which its share */
    double w = m->weight_bytes;
    if (cl->dc.dp > 1) w -= m->moe_expert_bytes * (1.0 - 1.0 / cl->dc.dp);
    *kv_cap = (mem * cl->dc.tp - w) / m->kv_bytes_token;
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
        pend = fmax(pend, r[i].first);
        end = fmax(end, r[i].finish);
        in_tok += reqs[i].prompt;
        out_tok += reqs[i].output;
        tmp[i] = r[i].first - reqs[i].arrival_ms;
    }
    res->ttft_p50 = pct(tmp, n, 0.5, &res->ttft_mean);
    res->ttft_p90 = pct(tmp, n, 0.9, &res->ttft_mean);
    int k = 0;
    for (int i = 0; i < n; i++)
        if (reqs[i].output > 1) tmp[k++] = (r[i].finish - r[i].first) / (reqs[i].output - 1);
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
    const int dp = cl->dc.dp > 1 ? cl->dc.dp : 1;
    if (cl->n_prefill < 0 || cl->n_decode < 1 || cl->dc.tp < 1 || cl->dc.max_batch < 0 ||
        cl->dc.step_tokens < 0 || n < 1 || cl->dc.dp < 0 || cl->dc.tbo_min < 0 ||
        (cl->dc.tbo_min > 0 && (dp > 1 || cl->dc.tp < 2)) ||
        (dp > 1 && (cl->dc.tp != 1 || cl->dc.ep || m->n_expert < dp)))
        return TD_EINVAL;
    /* a dp group's members are instances of their own (the router's choice among them) */
    const int n_inst = cl->n_decode * dp;
    res->devices = cl->n_prefill * cl->pf.pp * cl->pf.tp + n_inst * cl->dc.tp;
    int max_tokens = 0;
    for (int i = 0; i < n; i++)
        if (reqs[i].prompt + reqs[i].output > max_tokens)
            max_tokens = reqs[i].prompt + reqs[i].output;
    dsim d = {.m = m,
              .hw = hw,
              .tp = cl->dc.tp,
              .ep = cl->dc.ep,
              .dp = dp,
              .tbo_min = cl->dc.tbo_min,
              .max_batch = cl->dc.max_batch ? cl->dc.max_batch : 256,
              .colocated = cl->n_prefill == 0,
              .step_tokens = cl->dc.step_tokens ? cl->dc.step_tokens : 512};
    if (d.colocated &&
        (dp > 1 ? pl_stage_make_dp(m, hw, dp, &d.whole)
                : pl_stage_make(m, hw, m->n_layer, cl->dc.tp, cl->dc.ep, false, &d.whole)))
        return TD_EINVAL;
    res->fits = check_fit(m, hw, cl, max_tokens, &d.kv_cap, res->why, sizeof res->why);
    if (!res->fits) return 0;
    double *tmp = malloc((size_t)n * sizeof *tmp);
    pl_key *keys = malloc((size_t)n * sizeof *keys);
    int *order = malloc((size_t)n * sizeof *order);
    d.r = calloc((size_t)n, sizeof *d.r);
    dinst *in = calloc((size_t)n_inst, sizeof *in);
    int rc = tmp && keys && order && d.r && in ? 0 : TD_ENOMEM;
    if (!rc && d.colocated)
        memset(tmp, 0, (size_t)n * sizeof *tmp); /* prompts go straight to decode */
    else if (!rc)
        rc = pl_sim_prefill(m, hw, &cl->pf, cl->n_prefill, reqs, n, tmp, &res->n_chunks);
    for (int i = 0; i < n_inst && !rc; i++) {
        in[i].run = malloc((size_t)d.max_batch * sizeof *in[i].run);
        in[i].queue = malloc((size_t)n * sizeof *in[i].queue);
        if (!in[i].run || !in[i].queue) rc = TD_ENOMEM;
    }
    for (int i = 0; i < n && !rc; i++) {
        double ready = reqs[i].arrival_ms + tmp[i];
        d.r[i] = (dreq){.ready = ready,
                        .first = d.colocated ? INFINITY : ready,
                        .prompt = reqs[i].prompt,
                        .output = reqs[i].output,
                        .made = d.colocated ? 0 : 1,
                        .pf_left = d.colocated ? reqs[i].prompt : 0};
        keys[i] = (pl_key){.t = d.r[i].ready, .i = i};
    }
    if (!rc) {
        pl_sort_keys(keys, n);
        for (int i = 0; i < n; i++)
            order[i] = keys[i].i;
        run_decode(&d, in, n_inst, order, n);
        summarize(reqs, d.r, n, tmp, res);
    }
    for (int i = 0; in && i < n_inst; i++) {
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

int pl_simulate_sequential(const pl_model *m, const pl_hw *hw, const pl_cluster *cl,
                           const pl_request *reqs, int n, pl_result *res)
{
    memset(res, 0, sizeof *res);
    if (n < 1) return TD_EINVAL;
    double *ttft = malloc((size_t)n * sizeof *ttft), *tpot = malloc((size_t)n * sizeof *tpot);
    int rc = ttft && tpot ? 0 : TD_ENOMEM, k = 0;
    double span = 0, pspan = 0, in_tok = 0, out_tok = 0;
    int64_t chunks = 0;
    for (int i = 0; i < n && !rc; i++) {
        pl_request one = reqs[i];
        one.arrival_ms = 0; /* alone: the cluster is idle when it arrives */
        rc = pl_simulate(m, hw, cl, &one, 1, res);
        if (rc || !res->fits) break;
        ttft[i] = res->ttft_p50;
        if (one.output > 1) tpot[k++] = res->tpot_p50;
        span += res->makespan_ms;
        pspan += res->prefill_end_ms;
        in_tok += one.prompt;
        out_tok += one.output;
        chunks += res->n_chunks;
    }
    if (!rc && res->fits) {
        res->ttft_p50 = pct(ttft, n, 0.5, &res->ttft_mean);
        res->ttft_p90 = pct(ttft, n, 0.9, &res->ttft_mean);
        res->tpot_p50 = pct(tpot, k, 0.5, &res->tpot_mean);
        res->tpot_p90 = pct(tpot, k, 0.9, &res->tpot_mean);
        res->makespan_ms = span;
        res->prefill_end_ms = pspan;
        res->prefill_tps = pspan > 0 ? in_tok / (pspan * 1e-3) : 0;
        res->output_tps = span > 0 ? out_tok / (span * 1e-3) : 0;
        res->n_chunks = chunks;
    }
    free(ttft);
    free(tpot);
    return rc;
}
