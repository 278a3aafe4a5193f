/* pl_sim.c: the cluster simulator (pl_sim.h): stage and step costs, the chunked pipeline of a
 * prefill instance, continuous batching on decode instances. */
#include "pl_sim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pf_tune.h"
#include "td_err.h"

#define MEM_USABLE 0.9 /* share of device memory for weights + KV (activations, runtime) */

double pl_allreduce_ms(const pl_hw *hw, int tp, double bytes)
{
    if (tp <= 1) return 0;
    bool net = tp > hw->devices_per_node && !hw->one_node;
    double bw = net ? hw->net_bw * hw->eff_net : hw->nvlink_bw * hw->eff_nvlink;
    double lat = net ? hw->net_lat : hw->nvlink_lat;
    double fixed = 2.0 * (tp - 1) * lat;
    if (!net && tp <= PL_HW_MAX_AR_TP && hw->ar_lat[tp] > 0) fixed = hw->ar_lat[tp]; /* measured */
    return 1e3 * (2.0 * (tp - 1) / tp * bytes / bw + fixed);
}

/* The per-token and per-call parts of 2 n_l all-reduces of x n_embd act_bytes. */
static void allreduce_parts(const pl_model *m, const pl_hw *hw, int n_layers, int tp,
                            double *per_token, double *fixed)
{
    double one = pl_allreduce_ms(hw, tp, (double)m->n_embd * m->act_bytes);
    double zero = pl_allreduce_ms(hw, tp, 0);
    *per_token = 2.0 * n_layers * (one - zero);
    *fixed = 2.0 * n_layers * zero;
}

int pl_stage_make(const pl_model *m, const pl_hw *hw, int n_layers, int tp, bool ep, bool pp_cross,
                  pl_stage *st)
{
    if (n_layers < 1 || n_layers > m->n_layer || tp < 1) return TD_EINVAL;
    memset(st, 0, sizeof *st);
    st->n_layers = n_layers;
    st->tp = tp;
    double par = pl_hw_parallel(hw, tp); /* tp beyond a one_node profile's cores time-shares */
    /* measured: the whole chunk's speed-up, its all-reduces and overhead in it (with whole
     * experts on the ranks, its own) */
    ep = ep && tp > 1 && m->n_expert > 0;
    double meas = tp > 1 && tp <= PL_HW_MAX_AR_TP
                      ? (ep && hw->prefill_speedup_ep[tp] > 0 ? hw->prefill_speedup_ep[tp]
                                                              : hw->prefill_speedup[tp])
                      : 0;
    if (meas > 0) par = meas;
    double mm = par * hw->matmul_flops * hw->eff_matmul, att = par * hw->attn_flops * hw->eff_attn;
    /* attention over a chunk: A n_l x (L + x/2) = a x (2L + x) with a = A n_l / 2 */
    st->a = 1e3 * m->attn_flops_pair * n_layers / (2.0 * att);
    st->b_comp = 1e3 * 2.0 * m->layer_params * n_layers / mm;
    double ar_fixed = 0;
    if (meas > 0)
        st->c = hw->chunk_overhead * 1e3 / par;
    else {
        allreduce_parts(m, hw, n_layers, tp, &st->b_comm, &ar_fixed);
        st->c = hw->chunk_overhead * 1e3 + ar_fixed;
    }
    st->weight_frac = (double)n_layers / m->n_layer;
    st->weight_ms_full = 1e3 * (m->weight_bytes - m->embd_bytes) * st->weight_frac /
                         (par * hw->hbm_bw * hw->eff_mem);
    double bw = pp_cross ? hw->net_bw * hw->eff_net : hw->nvlink_bw * hw->eff_nvlink;
    st->send_ms_token = 1e3 * m->n_embd * m->act_bytes / bw;
    st->send_ms = 1e3 * (pp_cross ? hw->net_lat : hw->nvlink_lat);
    /* every device of the stage sends its own heads' KV on its own link */
    st->kv_ms_token = 1e3 * m->kv_bytes_token * st->weight_frac / (tp * hw->kvx_bw);
    st->kv_ms = 1e3 * hw->kvx_lat;
    st->fit = (pf_cost_model){.a = st->a,
                              .b = st->b_comp + st->b_comm,
                              .b_fit = st->b_comp + st->b_comm,
                              .c = st->c,
                              .r2 = 1,
                              .n_samples = 0,
                              .valid = true,
                              .dynamic = st->a > 0};
    return 0;
}

int pl_stage_make_dp(const pl_model *m, const pl_hw *hw, int dp, pl_stage *st)
{
    int rc = pl_stage_make(m, hw, m->n_layer, 1, false, false, st);
    double s = dp > 1 && dp <= PL_HW_MAX_AR_TP ? hw->prefill_speedup_dp[dp] : 0;
    if (rc || !(s > 0)) return rc;
    st->a /= s, st->b_comp /= s, st->c /= s, st->weight_ms_full /= s;
    st->fit.a = st->a, st->fit.b = st->fit.b_fit = st->b_comp + st->b_comm, st->fit.c = st->c;
    return 0;
}

double pl_stage_ms(const pl_model *m, const pl_stage *st, int64_t L, int64_t x)
{
    double comp = st->a * (double)x * (2.0 * L + x) + st->b_comp * (double)x;
    double wread = st->weight_ms_full;
    if (m->n_expert > 0) /* only the experts x tokens touch are read */
        wread *= pl_model_weights_read(m, (double)x) / (m->weight_bytes - m->embd_bytes);
    return (comp > wread ? comp : wread) + st->b_comm * (double)x + st->c;
}

/* A decode step's parts, ms: its products and attention (compute) and its all-reduces (ar;
 * 0 where the profile's measured speed-up holds them). */
static void step_parts(const pl_model *m, const pl_hw *hw, int tp, bool ep, int B, double S,
                       double *compute, double *ar)
{
    double par = pl_hw_parallel(hw, tp); /* tp beyond a one_node profile's cores time-shares */
    /* measured: the speed-up with the all-reduces of a batch-1 step in it (with whole experts
     * on the ranks, its own: the measured step holds one token's imbalance) */
    ep = ep && tp > 1 && m->n_expert > 0;
    bool meas_ep = ep && tp <= PL_HW_MAX_AR_TP && hw->decode_speedup_ep[tp] > 0;
    bool meas = meas_ep || (tp > 1 && tp <= PL_HW_MAX_AR_TP && hw->decode_speedup[tp] > 0);
    if (meas) par = meas_ep ? hw->decode_speedup_ep[tp] : hw->decode_speedup[tp];
    double bw = par * hw->hbm_bw * hw->eff_mem;
    /* a roofline per phase: the weight products and the attention over the KV are separate
     * kernels, one after the other, each bound by its own memory or compute */
    double w_read = pl_model_weights_read(m, B), p_active = pl_model_active_params(m);
    if (ep) { /* the step waits for the rank with the most expert work */
        double f_mem, f_comp;
        pl_model_ep_imbalance(m, tp, B, &f_mem, &f_comp);
        if (meas_ep) { /* relative to the one token the measured step had */
            double f1_mem, f1_comp;
            pl_model_ep_imbalance(m, tp, 1, &f1_mem, &f1_comp);
            f_mem /= f1_mem;
            f_comp /= f1_comp;
        }
        double touched =
            m->moe_expert_bytes * (1.0 - pow(1.0 - (double)m->n_expert_used / m->n_expert, B));
        w_read += touched * (f_mem - 1);
        p_active += m->moe_active_params * (f_comp - 1);
    }
    double w_mem = w_read / bw;
    double w_comp = 2.0 * p_active * B / (par * hw->matmul_flops * hw->eff_matmul);
    double a_mem = S * m->kv_bytes_token / bw;
    double a_comp = m->n_layer * m->attn_flops_pair * S / (par * hw->attn_flops * hw->eff_attn);
    if (hw->decode_attn > 0) a_mem = a_comp = S * hw->decode_attn / par; /* measured */
    *compute = 1e3 * (fmax(w_mem, w_comp) + fmax(a_mem, a_comp));
    *ar =
        meas ? 0 : 2.0 * m->n_layer * pl_allreduce_ms(hw, tp, (double)B * m->n_embd * m->act_bytes);
}

double pl_decode_step_ms(const pl_model *m, const pl_hw *hw, int tp, bool ep, int B, double S)
{
    double compute, ar;
    step_parts(m, hw, tp, ep, B, S, &compute, &ar);
    return compute + ar + hw->step_overhead * 1e3;
}

double pl_decode_step_ms_tbo(const pl_model *m, const pl_hw *hw, int tp, bool ep, int B, double S)
{
    if (tp < 2 || B < 2) return pl_decode_step_ms(m, hw, tp, ep, B, S);
    const int Ba = (B + 1) / 2, Bb = B - Ba;
    const double Sa = S * Ba / B;
    double ca, ara, cb, arb;
    step_parts(m, hw, tp, ep, Ba, Sa, &ca, &ara);
    step_parts(m, hw, tp, ep, Bb, S - Sa, &cb, &arb);
    /* each micro-batch's all-reduces run behind the other's compute; what sticks out stays */
    return ca + cb + fmax(0, ara - cb) + fmax(0, arb - ca) + hw->step_overhead * 1e3;
}

/* ---- prefill ---- */

typedef struct {
    pl_stage st[PF_MAX_STAGES];
    double free_at[PF_MAX_STAGES]; /* stage busy until */
    double kv_free[PF_MAX_STAGES]; /* its KV link busy until */
    double *last_done;             /* (pp) ring: when the last pp chunks left the last stage */
    int64_t n_chunks;
    int pp;
} pl_inst;

/* The chunk sizes of one request, planned as stage 0 plans them. */
static int plan_request(const pl_inst *in, const pl_prefill_cfg *pf, int64_t n, int32_t **buf,
                        int64_t *cap, int64_t *nc)
{
    int chunk_max = pf->chunk_max > 0 ? pf->chunk_max : PF_TUNE_AUTO_CAP;
    pf_chunk_params cp = {.chunk_size = pf->chunk > 0 ? pf->chunk : chunk_max,
                          .smooth = pf->smooth,
                          .page_size = pf->page > 0 ? pf->page : 16,
                          .max_batch_tokens = chunk_max > pf->chunk ? chunk_max : pf->chunk,
                          .dynamic = pf->smooth > 0};
    const pf_cost_model *fit = &in->st[0].fit;
    if (pf->chunk <= 0 && cp.dynamic) {
        pf_tune tu;
        pf_tune_init(&tu, fit, NULL, NULL, 0, 0);
        cp.chunk_size = pf_tune_initial_chunk(&tu, n, in->pp, pf_chunk_align(&cp), chunk_max);
    }
    int64_t need = pf_plan_max_chunks(&cp, n);
    if (need < 1) return TD_EINVAL;
    if (need > *cap) {
        int32_t *nb = realloc(*buf, (size_t)need * sizeof *nb);
        if (!nb) return TD_ENOMEM;
        *buf = nb;
        *cap = need;
    }
    return pf_plan_chunks(fit, &cp, n, *buf, *cap, nc);
}

/* Run one request's chunks through instance in from time t0; returns when its KV landed. */
static double run_request(const pl_model *m, pl_inst *in, const int32_t *chunks, int64_t nc,
                          double t0)
{
    int pp = in->pp;
    double landed = t0;
    int64_t L = 0;
    for (int64_t k = 0; k < nc; k++) {
        int64_t x = chunks[k];
        int64_t slot = in->n_chunks % pp;
        double ready = t0 > in->last_done[slot] ? t0 : in->last_done[slot];
        for (int s = 0; s < pp; s++) {
            const pl_stage *st = &in->st[s];
            double start = ready > in->free_at[s] ? ready : in->free_at[s];
            double done = start + pl_stage_ms(m, st, L, x);
            in->free_at[s] = done;
            double ks = done > in->kv_free[s] ? done : in->kv_free[s];
            in->kv_free[s] = ks + st->kv_ms + st->kv_ms_token * (double)x;
            if (k == nc - 1 && in->kv_free[s] > landed) landed = in->kv_free[s];
            ready = done + (s < pp - 1 ? st->send_ms + st->send_ms_token * (double)x : 0);
            if (s == pp - 1) {
                in->last_done[slot] = done;
                if (done > landed) landed = done;
            }
        }
        in->n_chunks++;
        L += x;
    }
    return landed;
}

static int key_cmp(const void *a, const void *b)
{
    const pl_key *x = a, *y = b;
    return x->t < y->t ? -1 : x->t > y->t ? 1 : x->i - y->i;
}

void pl_sort_keys(pl_key *k, int n)
{
    qsort(k, (size_t)n, sizeof *k, key_cmp);
}

static int inst_init(const pl_model *m, const pl_hw *hw, const pl_prefill_cfg *pf, pl_inst *in)
{
    int counts[PF_MAX_STAGES];
    memset(in, 0, sizeof *in);
    in->pp = pf->pp;
    int rc = pf_layer_partition(m->n_layer, pf->pp, NULL, 0, counts);
    bool cross = pf->pp * pf->tp > hw->devices_per_node && !hw->one_node;
    for (int s = 0; s < pf->pp && !rc; s++)
        rc = pl_stage_make(m, hw, counts[s], pf->tp, false, cross, &in->st[s]);
    if (rc) return rc;
    in->last_done = calloc((size_t)pf->pp, sizeof *in->last_done);
    return in->last_done ? 0 : TD_ENOMEM;
}

int pl_sim_prefill(const pl_model *m, const pl_hw *hw, const pl_prefill_cfg *pf, int n_prefill,
                   const pl_request *reqs, int n, double *ttft, int64_t *n_chunks)
{
    if (n_prefill < 1 || pf->pp < 1 || pf->pp > PF_MAX_STAGES || pf->pp > m->n_layer ||
        pf->tp < 1 || pf->smooth < 0 || pf->smooth > 1 || n < 0)
        return TD_EINVAL;
    for (int i = 0; i < n; i++)
        if (reqs[i].prompt < 1 || reqs[i].output < 1 || !(reqs[i].arrival_ms >= 0))
            return TD_EINVAL;
    pl_inst *in = calloc((size_t)n_prefill, sizeof *in);
    pl_key *order = malloc((size_t)(n ? n : 1) * sizeof *order);
    int32_t *buf = NULL;
    int64_t cap = 0, nc = 0;
    int rc = in && order ? 0 : TD_ENOMEM;
    for (int i = 0; i < n_prefill && !rc; i++)
        rc = inst_init(m, hw, pf, &in[i]);
    for (int i = 0; i < n && !rc; i++)
        order[i] = (pl_key){.t = reqs[i].arrival_ms, .i = i};
    if (!rc) pl_sort_keys(order, n);
    for (int j = 0; j < n && !rc; j++) {
        const pl_request *r = &reqs[order[j].i];
        int best = 0;
        for (int i = 1; i < n_prefill; i++)
            if (in[i].free_at[0] < in[best].free_at[0]) best = i;
        rc = plan_request(&in[best], pf, r->prompt, &buf, &cap, &nc);
        if (!rc)
            ttft[order[j].i] = run_request(m, &in[best], buf, nc, r->arrival_ms) - r->arrival_ms;
    }
    *n_chunks = 0;
    for (int i = 0; in && i < n_prefill; i++) {
        *n_chunks += in[i].n_chunks;
        free(in[i].last_done);
    }
    free(in);
    free(order);
    free(buf);
    return rc;
}

double pl_decode_step_ms_dp(const pl_model *m, const pl_hw *hw, int dp, int B, double S)
{
    double t1 = pl_decode_step_ms(m, hw, 1, false, B, S);
    if (dp <= 1) return t1;
    if (dp <= PL_HW_MAX_AR_TP && hw->decode_speedup_dp[dp] > 0)
        return t1 / hw->decode_speedup_dp[dp];
    int moe_layers = m->n_expert > 0 ? m->n_layer : 0; /* leading dense layers counted too */
    return t1 +
           2.0 * moe_layers * pl_allreduce_ms(hw, dp, (double)dp * B * m->n_embd * m->act_bytes);
}
