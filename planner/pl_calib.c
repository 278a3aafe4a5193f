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

int pl_calib_decode_steps(kn_engine *eng, kn_kv_mem *mem, int n_vocab, int ctx0, int steps,
                          const pl_calib_step_hook *hook, double *ms)
{
    kn_kv_pool *kv = kn_kv_mem_pool(mem);
    float *logits = malloc((size_t)n_vocab * sizeof *logits);
    double *t = malloc((size_t)steps * sizeof *t);
    kn_kv_seq seq;
    kn_kv_seq_init(&seq);
    int rc = logits && t ? 0 : TD_ENOMEM;
    int32_t row = 0, seq_of = 0;
    /* KV pages never written are the kernel's zero page: attention would read one cached
     * page, not ctx0 tokens of memory. 0x3c3c is a finite f16 (1.06). */
    if (ctx0 > 0) memset(kv->region, 0x3c, kv->region_bytes);
    for (int i = 0; i < 2 * steps && !rc; i++) {
        int32_t tok = (int32_t)((i * 7919u + 17) % (uint32_t)n_vocab), pos = ctx0 + i;
        double s = (double)td_now_ns() / 1e6;
        rc = hook ? hook->fn(hook->ctx) : 0;
        if (!rc) rc = kn_kv_seq_reserve(mem, &seq, pos + 1);
        kn_seq_view view = {.block_table = seq.blocks, .n_ctx = pos + 1};
        kn_batch b = {.n_tokens = 1,
                      .n_solo = 1,
                      .tokens = &tok,
                      .pos = &pos,
                      .seq_of = &seq_of,
                      .n_seqs = 1,
                      .seqs = &view,
                      .n_logits = 1,
                      .logit_rows = &row};
        if (!rc) rc = kn_engine_forward(eng, kv, &b, logits);
        if (i >= steps) t[i - steps] = (double)td_now_ns() / 1e6 - s;
    }
    if (!rc) *ms = td_stats_median(t, (size_t)steps);
    kn_kv_seq_fini(mem, &seq);
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
    hw->nvlink_bw = r->kvx_gbps[0] * 1e9;
    hw->nvlink_lat = r->allreduce_us[2] / 2 * 1e-6; /* tp 2: 2 (tp - 1) latencies */
    hw->net_bw = r->kvx_gbps[1] * 1e9;
    hw->net_lat = r->kvx_lat_us[1] * 1e-6;
    hw->eff_nvlink = hw->eff_net = 1; /* the figures are effective ones */
    hw->chunk_overhead = r->fit_c > 0 ? r->fit_c * 1e-3 : 0;
    hw->step_overhead = 0; /* folded into the memory efficiency (one decode figure) */
    hw->kvx_bw = r->kvx_gbps[0] * 1e9;
    hw->kvx_lat = r->kvx_lat_us[0] * 1e-6;
    hw->one_node = 1; /* more devices than cores time-share them */
    for (int tp = 2; tp <= PL_HW_MAX_AR_TP; tp++) {
        hw->ar_lat[tp] = r->allreduce_us[tp] * 1e-6;
        hw->decode_speedup[tp] = r->decode_speedup[tp];
        hw->decode_speedup_ep[tp] = r->decode_speedup_ep[tp];
        hw->prefill_speedup[tp] = r->prefill_speedup[tp];
        hw->prefill_speedup_ep[tp] = r->prefill_speedup_ep[tp];
        hw->decode_speedup_dp[tp] = r->decode_speedup_dp[tp];
        hw->prefill_speedup_dp[tp] = r->prefill_speedup_dp[tp];
    }
}

int pl_calibrate(const pl_calib_params *p, pl_calib_result *r)
{
    memset(r, 0, sizeof *r);
    int threads = p->threads > 0 ? p->threads : 1, chunk = p->chunk > 0 ? p->chunk : 1024;
    int lc = r->long_ctx = p->long_ctx > 0 ? p->long_ctx : PL_CALIB_LONG_CTX;
    int steps = p->decode_steps > 0 ? p->decode_steps : 32;
    int rc = pl_model_gguf(p->model_path, &r->model);
    if (rc) return rc;
    pf_shard sh;
    memset(&sh, 0, sizeof sh);
    pf_shard_params sp = {.model_path = p->model_path,
                          .pp = 1,
                          .threads = threads,
                          .ctx = (chunk + chunk / 4 > lc + 512 ? chunk + chunk / 4 : lc + 512) +
                                 2 * steps + 64,
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
    pl_calib_chunk ch[4];
    r->chunk_x = chunk < 512 ? chunk : 512;
    if (!rc) rc = pl_calib_chunks(&sh, lc, r->chunk_x, 4, 2, ch);
    int n_vocab = sh.rt.model->hp.n_vocab;
    if (!rc)
        rc = pl_calib_decode_steps(sh.rt.engine, sh.mem, n_vocab, 0, steps, NULL, &r->decode_ms);
    if (!rc)
        rc = pl_calib_decode_steps(sh.rt.engine, sh.mem, n_vocab, lc, steps, NULL,
                                   &r->decode_long_ms);
    int n_embd = sh.rt.model->hp.n_embd;
    r->kvx_gbps[0] = KVX_SM_GBPS, r->kvx_lat_us[0] = KVX_SM_LAT_US;
    r->kvx_gbps[1] = KVX_TCP_GBPS, r->kvx_lat_us[1] = KVX_TCP_LAT_US;
    if (!rc) pl_calib_kvx(&sh.rt.model->hp, r); /* keeps those where it cannot measure */
    pf_shard_close(&sh);
    for (int tp = 2; tp <= PL_HW_MAX_AR_TP && !rc; tp++)
        rc = pl_calib_allreduce(tp, n_embd, 2000, &r->allreduce_us[tp]);
    /* the whole tp step where the model splits (heads divide): its speed-up over tp 1 */
    for (int tp = 2; tp <= PL_HW_MAX_AR_TP && !rc; tp++)
        if (r->model.n_head % tp == 0 && r->model.n_head_kv % tp == 0 &&
            !(rc = pl_calib_decode_tp(p->model_path, tp, false, threads, steps,
                                      &r->decode_tp_ms[tp])))
            r->decode_speedup[tp] = r->decode_ms / r->decode_tp_ms[tp];
    /* and with the experts whole on the ranks (decode[].ep), where they divide */
    for (int tp = 2; tp <= PL_HW_MAX_AR_TP && !rc; tp++)
        if (r->decode_tp_ms[tp] > 0 && r->model.n_expert >= tp &&
            !(rc = pl_calib_decode_tp(p->model_path, tp, true, threads, steps,
                                      &r->decode_tp_ep_ms[tp])))
            r->decode_speedup_ep[tp] = r->decode_ms / r->decode_tp_ep_ms[tp];
    /* a prefill chunk at those tp (the colocated decode instance's prompt chunks): its
     * speed-up over chunk_ms[0]. The fitted overhead c holds work tp divides (a model's
     * experts run at a few rows each; s31's tp 2 TTFTs came out 1.43-1.49x too long when the
     * planner kept c whole), so the whole chunk is measured, not its parts. */
    for (int tp = 2; tp <= PL_HW_MAX_AR_TP && !rc; tp++)
        for (int ep = 0; ep <= (r->model.n_expert >= tp) && !rc; ep++) {
            double *t = ep ? &r->chunk_tp_ep_ms[tp] : &r->chunk_tp_ms[tp];
            if (r->decode_tp_ms[tp] > 0 &&
                !(rc = pl_calib_chunk_tp(p->model_path, tp, ep, threads, r->chunk_x, 2, t)))
                (ep ? r->prefill_speedup_ep : r->prefill_speedup)[tp] = ch[0].ms / *t;
        }
    /* a data-parallel attention group of that many members (decode[].dp): a member's step
     * with every member stepping, member 0's chunk with the others idle */
    for (int g = 2; g <= PL_HW_MAX_AR_TP && !rc && r->model.n_expert >= g; g++)
        if (!(rc = pl_calib_dp(p->model_path, g, threads, steps, 0, &r->decode_dp_ms[g])) &&
            !(rc = pl_calib_dp(p->model_path, g, threads, steps, r->chunk_x, &r->chunk_dp_ms[g]))) {
            r->decode_speedup_dp[g] = r->decode_ms / r->decode_dp_ms[g];
            r->prefill_speedup_dp[g] = ch[0].ms / r->chunk_dp_ms[g];
        }
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
    /* the chunks after long prefixes pin the attention term a that forwards from an empty
     * context of at most 1.25 x chunk leave loose (a and b trade off there) */
    pf_cost_model joint = pr.fit;
    if (!pl_calib_fit_joint(len, pr.ms, pr.n_lengths, ch, 4, &joint)) {
        r->joint = 1;
        pr.fit.dynamic = true; /* convex: pl_calib_fit_joint checked a > 0 and b > 0 */
        pr.fit.a = r->fit_a = joint.a;
        pr.fit.b = r->fit_b = joint.b;
        pr.fit.c = r->fit_c = joint.c;
    }
    for (int k = 0; k < 4; k++)
        r->chunk_ms[k] = ch[k].ms;
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
    /* a step that got faster with more context is noise: then the roofline stays */
    if (r->decode_long_ms > r->decode_ms)
        r->hw.decode_attn = (r->decode_long_ms - r->decode_ms) * 1e-3 / lc;
    return 0;
}

void pl_calib_comment(const pl_calib_result *r, char *buf, size_t cap)
{
    snprintf(
        buf, cap,
        "# written by `tandem calibrate` for %s (%d layers, %.1f MB of weights)\n"
        "# measured: sgemm %.2f GFLOP/s, memory read %.2f GB/s (kernels' ceiling probes);\n"
        "#   %d-token prefill chunks after 0, 1/4, 1/2, 3/4 of %d tokens: %.1f / %.1f / %.1f /\n"
        "#   %.1f ms;\n"
        "#   prefill fit (%s):\n"
        "#   f(l) = %.4g l^2 + %.4g l + %.4g ms (the profile's own fit: R^2 %.4f); the model's\n"
        "#   matrix products at %.2f GFLOP/s, attention at %.2f GFLOP/s;\n"
        "#   batch-1 decode step with its logits %.3f ms: weights read at %.2f GB/s;\n"
        "#   the same after %d more tokens of context %.3f ms: attention %.3f us a token;\n"
        "#   decode all-reduce of %d floats (dc_shm, one-thread rank processes): tp 2 %.1f us,\n"
        "#   tp 3 %.1f us, tp 4 %.1f us;\n"
        "#   the batch-1 decode step at tp 2/3/4 (forked ranks, dc_shm, 0: the model's heads do\n"
        "#   not split): %.3f / %.3f / %.3f ms; with the experts whole on the ranks (ep; 0:\n"
        "#   no experts to divide): %.3f / %.3f / %.3f ms;\n"
        "#   the %d-token prefill chunk at tp 2/3/4: %.1f / %.1f / %.1f ms; with the experts\n"
        "#   whole: %.1f / %.1f / %.1f ms;\n"
        "#   a dp group of 2/3/4 members (0: not measured): each member's batch-1 step %.3f /\n"
        "#   %.3f / %.3f ms, member 0's chunk %.1f / %.1f / %.1f ms.\n"
        "# peak_tflops.f32 is the faster of sgemm and the matrix-product rate; efficiencies\n"
        "#   are measured / peak (attention clamped at 1).\n"
        "# KV transfer, %s:\n"
        "#   nvlink = shared memory between processes, kvxfer sm %.2f GB/s; net = loopback\n"
        "#   TCP, kvxfer %.2f GB/s, %.0f us; kv_transfer = kvxfer sm, 1 rank, %.0f us a\n"
        "#   one-block chunk.\n",
        r->model.name, r->model.n_layer, r->model.weight_bytes / 1e6, r->sgemm_gflops, r->mem_gbps,
        r->chunk_x, r->long_ctx, r->chunk_ms[0], r->chunk_ms[1], r->chunk_ms[2], r->chunk_ms[3],
        r->joint ? "the profile and those chunks" : "the profile alone", r->fit_a, r->fit_b,
        r->fit_c, r->fit_r2, r->matmul_gflops, r->attn_gflops, r->decode_ms, r->decode_gbps,
        r->long_ctx, r->decode_long_ms, r->hw.decode_attn * 1e6, r->model.n_embd,
        r->allreduce_us[2], r->allreduce_us[3], r->allreduce_us[4], r->decode_tp_ms[2],
        r->decode_tp_ms[3], r->decode_tp_ms[4], r->decode_tp_ep_ms[2], r->decode_tp_ep_ms[3],
        r->decode_tp_ep_ms[4], r->chunk_x, r->chunk_tp_ms[2], r->chunk_tp_ms[3], r->chunk_tp_ms[4],
        r->chunk_tp_ep_ms[2], r->chunk_tp_ep_ms[3], r->chunk_tp_ep_ms[4], r->decode_dp_ms[2],
        r->decode_dp_ms[3], r->decode_dp_ms[4], r->chunk_dp_ms[2], r->chunk_dp_ms[3],
        r->chunk_dp_ms[4],
        r->kvx_measured ? "measured (kvx-bench, the model's KV shape)"
                        : "not measured here (BENCHMARKS.md)",
        r->kvx_gbps[0], r->kvx_gbps[1], r->kvx_lat_us[1], r->kvx_lat_us[0]);
}
