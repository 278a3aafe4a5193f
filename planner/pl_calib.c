/* pl_calib.c: `tandem calibrate`'s measurements (pl_calib.h). */
#include "pl_calib.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu_backend.h"
#include "pf_profile.h"
#include "pf_shard.h"
#include "pf_tune.h"
#include "td_clock.h"
#include "td_err.h"
#include "td_stats.h"

/* BENCHMARKS.md figures for what one process cannot measure (pl_calib.h) */
#define KVX_SM_GBPS    8.33
#define KVX_SM_LAT_US  40.0
#define KVX_TCP_GBPS   0.9
#define KVX_TCP_LAT_US 635.0

/* Batch-1 decode steps as the decode node runs them: one token a forward, a solo row, with
 * its logits (the LM head is part of every step; the prefill profile's forwards skip it).
 * steps warm-up steps, then steps timed; *ms their median. */
static int measure_decode(pf_shard *sh, int steps, double *ms)
{
    const kn_model *m = sh->rt.model;
    float *logits = malloc((size_t)m->hp.n_vocab * sizeof *logits);
    double *t = malloc((size_t)steps * sizeof *t);
    kn_kv_seq seq;
    kn_kv_seq_init(&seq);
    int rc = logits && t ? 0 : TD_ENOMEM;
    int32_t row = 0, seq_of = 0;
    for (int i = 0; i < 2 * steps && !rc; i++) {
        int32_t tok = (int32_t)((i * 7919u + 17) % (uint32_t)m->hp.n_vocab), pos = i;
        double s = (double)td_now_ns() / 1e6;
        rc = kn_kv_seq_reserve(sh->kv, &seq, i + 1);
        kn_seq_view view = {.block_table = seq.blocks, .n_ctx = i + 1};
        kn_batch b = {.n_tokens = 1,
                      .n_solo = 1,
                      .tokens = &tok,
                      .pos = &pos,
                      .seq_of = &seq_of,
                      .n_seqs = 1,
                      .seqs = &view,
                      .n_logits = 1,
                      .logit_rows = &row};
        if (!rc) rc = kn_engine_forward(sh->rt.engine, sh->kv, &b, logits);
        if (i >= steps) t[i - steps] = (double)td_now_ns() / 1e6 - s;
    }
    if (!rc) *ms = td_stats_median(t, (size_t)steps);
    kn_kv_seq_fini(sh->kv, &seq);
    free(logits);
    free(t);
    return rc;
}

/* Peak and efficiency from a measured rate: the peak is the ceiling probe unless the
 * model's path beat it (quantized dot products can), then the measured rate itself. */
static void rate_to_hw(double measured, double ceiling, double *peak, double *eff)
{
    if (measured > ceiling) ceiling = measured;
    *peak = ceiling;
    *eff = measured / ceiling;
}

static void fill_hw(pl_calib_result *r, int threads)
{
    pl_hw *hw = &r->hw;
    long cores = sysconf(_SC_NPROCESSORS_ONLN), pages = sysconf(_SC_PHYS_PAGES);
    long psz = sysconf(_SC_PAGESIZE);
    memset(hw, 0, sizeof *hw);
    snprintf(hw->name, sizeof hw->name, "this-machine-%dt", threads);
    hw->devices_per_node = cores > threads ? (int)(cores / threads) : 1;
    hw->mem_bytes = (double)pages * psz / hw->devices_per_node;
    rate_to_hw(r->matmul_gflops * 1e9, r->sgemm_gflops * 1e9, &hw->peak_f32, &hw->eff_matmul);
    /* attention above that peak is a fit's noise (a near 0 at short lengths): clamped */
    hw->eff_attn = r->attn_gflops * 1e9 < hw->peak_f32 ? r->attn_gflops * 1e9 / hw->peak_f32 : 1;
    snprintf(hw->matmul_type, sizeof hw->matmul_type, "f32");
    snprintf(hw->attention_type, sizeof hw->attention_type, "f32");
    hw->matmul_flops = hw->attn_flops = hw->peak_f32;
    rate_to_hw(r->decode_gbps * 1e9, r->mem_gbps * 1e9, &hw->hbm_bw, &hw->eff_mem);
    /* devices talk through shared memory (nvlink's role) or loopback TCP (the network's) */
    hw->nvlink_bw = KVX_SM_GBPS * 1e9;
    hw->nvlink_lat = r->allreduce_us[2] / 2 * 1e-6; /* tp 2: 2 (tp - 1) latencies */
    hw->net_bw = KVX_TCP_GBPS * 1e9;
    hw->net_lat = KVX_TCP_LAT_US * 1e-6;
    hw->eff_nvlink = hw->eff_net = 1; /* the figures are effective ones */
    hw->chunk_overhead = r->fit_c > 0 ? r->fit_c * 1e-3 : 0;
    hw->step_overhead = 0; /* folded into the memory efficiency (one decode figure) */
    hw->kvx_bw = KVX_SM_GBPS * 1e9;
    hw->kvx_lat = KVX_SM_LAT_US * 1e-6;
    hw->one_node = 1; /* more devices than cores time-share them */
    for (int tp = 2; tp <= PL_HW_MAX_AR_TP; tp++)
        hw->ar_lat[tp] = r->allreduce_us[tp] * 1e-6;
}

int pl_calibrate(const pl_calib_params *p, pl_calib_result *r)
{
    memset(r, 0, sizeof *r);
    int threads = p->threads > 0 ? p->threads : 1, chunk = p->chunk > 0 ? p->chunk : 1024;
    int steps = p->decode_steps > 0 ? p->decode_steps : 32;
    int rc = pl_model_gguf(p->model_path, &r->model);
    if (rc) return rc;
    pf_shard sh;
    memset(&sh, 0, sizeof sh);
    pf_shard_params sp = {.model_path = p->model_path,
                          .pp = 1,
                          .threads = threads,
                          .ctx = chunk + chunk / 4 + 2 * steps + 64,
                          .kv_type = TD_F16};
    if ((rc = pf_shard_open(&sh, &sp))) return rc;
    kn_cpu *cpu = kn_cpu_of(sh.rt.be);
    if (!cpu) {
        TD_LOG_ERR("calibrate: measures the cpu backend only");
        pf_shard_close(&sh);
        return TD_EUNSUPP;
    }
    r->mem_gbps = kn_cpu_mem_read_gbps(cpu, 0, 5);
    r->sgemm_gflops = kn_cpu_sgemm_gflops(cpu, 2048, 3);
    pf_profile_params pp = {.chunk_size = chunk, .budget_ms = p->budget_ms ? p->budget_ms : 20000};
    pf_profile_result pr;
    rc = pf_profile_stage(&sh, &pp, &pr);
    if (!rc) rc = measure_decode(&sh, steps, &r->decode_ms);
    int n_embd = sh.rt.model->hp.n_embd;
    pf_shard_close(&sh);
    for (int tp = 2; tp <= PL_HW_MAX_AR_TP && !rc; tp++)
        rc = pl_calib_allreduce(tp, n_embd, 2000, &r->allreduce_us[tp]);
    if (rc) return rc;
    /* robustly, as the prefill node fits its profile (pf_chunking.c): a busy moment is an
     * outlier, not a change of the model */
    double len[PF_PROFILE_MAX_LENGTHS];
    for (int i = 0; i < pr.n_lengths; i++)
        len[i] = pr.len[i];
    int n_rej = 0;
    pf_fit_robust(len, pr.ms, pr.n_lengths, &pr.fit, &n_rej);
    if (n_rej)
        TD_LOG_WARN("calibrate: %d of %d profile lengths rejected as outliers", n_rej,
                    pr.n_lengths);
    r->fit_a = pr.fit.a;
    r->fit_b = pr.fit.b;
    r->fit_c = pr.fit.c;
    r->fit_r2 = pr.fit.r2;
    if (!pr.fit.dynamic || pr.fit.b <= 0) {
        TD_LOG_ERR("calibrate: the prefill profile gave no convex fit (a %g, b %g): the machine "
                   "was too noisy; run again",
                   pr.fit.a, pr.fit.b);
        return TD_ESTATE;
    }
    const pl_model *m = &r->model;
    r->matmul_gflops = 2.0 * m->layer_params * m->n_layer / (pr.fit.b * 1e-3) / 1e9;
    r->attn_gflops = m->attn_flops_pair * m->n_layer / (2.0 * pr.fit.a * 1e-3) / 1e9;
    r->decode_gbps = pl_model_weights_read(m, 1) / (r->decode_ms * 1e-3) / 1e9;
    fill_hw(r, threads);
    return 0;
}

void pl_calib_comment(const pl_calib_result *r, char *buf, size_t cap)
{
    snprintf(
        buf, cap,
        "# written by `tandem calibrate` for %s (%d layers, %.1f MB of weights)\n"
        "# measured: sgemm %.2f GFLOP/s, memory read %.2f GB/s (kernels' ceiling probes);\n"
        "#   prefill profile f(l) = %.4g l^2 + %.4g l + %.4g ms (R^2 %.4f): the model's\n"
        "#   matrix products at %.2f GFLOP/s, attention at %.2f GFLOP/s;\n"
        "#   batch-1 decode step with its logits %.3f ms: weights read at %.2f GB/s;\n"
        "#   decode all-reduce of %d floats (dc_shm, one-thread rank processes): tp 2 %.1f us,\n"
        "#   tp 3 %.1f us, tp 4 %.1f us.\n"
        "# peak_tflops.f32 is the faster of sgemm and the matrix-product rate; efficiencies\n"
        "#   are measured / peak (attention clamped at 1).\n"
        "# not measured here (BENCHMARKS.md): nvlink bandwidth = shared memory between\n"
        "#   processes, kvxfer sm %.2f GB/s; net = loopback TCP, kvxfer %.2f GB/s, %.0f us;\n"
        "#   kv_transfer = kvxfer sm, 1 rank, %.0f us a chunk.\n",
        r->model.name, r->model.n_layer, r->model.weight_bytes / 1e6, r->sgemm_gflops, r->mem_gbps,
        r->fit_a, r->fit_b, r->fit_c, r->fit_r2, r->matmul_gflops, r->attn_gflops, r->decode_ms,
        r->decode_gbps, r->model.n_embd, r->allreduce_us[2], r->allreduce_us[3], r->allreduce_us[4],
        KVX_SM_GBPS, KVX_TCP_GBPS, KVX_TCP_LAT_US, KVX_SM_LAT_US);
}
