/* test_planner.c: the planner's simulator, search, model shapes and hardware-profile loader
 * (planner/pl_sim.h, pl_plan.h, pl_model.h, pl_hw.h) against hand computations. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pl_calib.h"
#include "pl_plan.h"
#include "td_err.h"
#include "tharness.h"

/* Round figures: 1 TFLOP/s at efficiency 1, links fast enough to vanish except where set. */
static const char *HW_TEXT = "name: test\n"
                             "devices_per_node: 8\n"
                             "memory_gib: 64\n"
                             "peak_tflops: {bf16: 1, f32: 0.5}\n"
                             "matmul_type: bf16\n"
                             "attention_type: f32\n"
                             "hbm_gbps: 1000000\n"
                             "nvlink_gbps: 1000000\n"
                             "net_gbps: 1000000\n"
                             "latency_us: {nvlink: 0, net: 0}\n"
                             "efficiency: {matmul: 1, attention: 1, memory: 1, nvlink: 1, net: 1}\n"
                             "overhead_ms: {chunk: 2, step: 0.5}\n"
                             "kv_transfer: {gbps: 1000000, latency_us: 0}\n";

static pl_hw test_hw(void)
{
    pl_hw hw;
    char err[256];
    int rc = pl_hw_parse(HW_TEXT, strlen(HW_TEXT), "test", &hw, err, sizeof err);
    if (rc) fprintf(stderr, "test profile: %s\n", err);
    return hw;
}

/* 8 layers of 1e6 matrix weights: 2e6 FLOPs a token a layer = 2 us at 1 TFLOP/s, so
 * b = 0.016 ms a token for the whole model; attention 1e4 FLOPs a pair a layer at
 * 0.5 TFLOP/s = 20 ns, so a = 8 x 2e-8 s / 2 = 8e-5 ms. */
static pl_model test_model(void)
{
    pl_model m = {.n_layer = 8,
                  .n_embd = 64,
                  .n_head = 4,
                  .n_head_kv = 4,
                  .layer_params = 1e6,
                  .head_params = 1e5,
                  .weight_bytes = 1.7e7,
                  .kv_bytes_token = 1024,
                  .attn_flops_pair = 1e4,
                  .act_bytes = 2};
    snprintf(m.name, sizeof m.name, "test");
    return m;
}

static void test_single_request_pp1(void)
{
    pl_hw hw = test_hw();
    pl_model m = test_model();
    pl_prefill_cfg pf = {.pp = 1, .tp = 1, .chunk = 256, .chunk_max = 256};
    pl_request r = {.arrival_ms = 5, .prompt = 1024, .output = 1};
    double ttft;
    int64_t nc;
    TH_REQUIRE(pl_sim_prefill(&m, &hw, &pf, 1, &r, 1, &ttft, &nc) == 0);
    TH_CHECK(nc == 4);
    /* chunk k of 256 after L = 256 k: a x (2L + x) + b x + c, a = 8e-5, b = 0.016, c = 2 */
    double want = 0;
    for (int k = 0; k < 4; k++)
        want += 8e-5 * 256 * (2.0 * 256 * k + 256) + 0.016 * 256 + 2;
    TH_CHECKF(fabs(ttft - want) < 1e-6 * want, "ttft %.6f want %.6f", ttft, want);
}

static void test_single_request_pp2(void)
{
    pl_hw hw = test_hw();
    pl_model m = test_model();
    pl_prefill_cfg pf = {.pp = 2, .tp = 1, .chunk = 512, .chunk_max = 512};
    pl_request r = {.arrival_ms = 0, .prompt = 1024, .output = 1};
    double ttft;
    int64_t nc;
    TH_REQUIRE(pl_sim_prefill(&m, &hw, &pf, 1, &r, 1, &ttft, &nc) == 0);
    TH_CHECK(nc == 2);
    /* stages of 4 layers: a = 4e-5, b = 0.008. chunk 0: s0 [0, t00], s1 [t00, t00 + t10];
     * chunk 1: s0 [t00, t00 + t01], s1 starts at max(t00 + t10, t00 + t01) */
    double t0 = 4e-5 * 512 * 512 + 0.008 * 512 + 2;               /* L 0 */
    double t1 = 4e-5 * 512 * (2.0 * 512 + 512) + 0.008 * 512 + 2; /* L 512 */
    double want = t0 + fmax(t0, t1) + t1;
    TH_CHECKF(fabs(ttft - want) < 1e-6 * want, "ttft %.6f want %.6f", ttft, want);
}

/* More stages never lower a single request's compute: the stages' summed busy time over the
 * same chunks is at least the one-stage time, and the TTFT at pp is at least the one-stage
 * TTFT over pp. */
static void test_more_stages(void)
{
    pl_hw hw = test_hw();
    pl_model m = test_model();
    pl_request r = {.arrival_ms = 0, .prompt = 4096, .output = 1};
    double t1 = 0, busy1 = 0, ttft;
    int64_t nc;
    for (int pp = 1; pp <= 8; pp *= 2) {
        pl_prefill_cfg pf = {.pp = pp, .tp = 1, .chunk = 512, .chunk_max = 512, .smooth = 0.75};
        TH_REQUIRE(pl_sim_prefill(&m, &hw, &pf, 1, &r, 1, &ttft, &nc) == 0);
        if (pp == 1) t1 = ttft;
        TH_CHECKF(ttft >= t1 / pp - 1e-9, "pp %d ttft %.3f < %.3f / pp", pp, ttft, t1);
        int counts[8];
        TH_REQUIRE(pf_layer_partition(m.n_layer, pp, NULL, 0, counts) == 0);
        double busy = 0;
        for (int s = 0; s < pp; s++) {
            pl_stage st;
            TH_REQUIRE(pl_stage_make(&m, &hw, counts[s], 1, false, false, &st) == 0);
            for (int64_t L = 0; L < 4096; L += 512)
                busy += pl_stage_ms(&m, &st, L, 512);
        }
        if (pp == 1) busy1 = busy;
        TH_CHECKF(busy >= busy1 - 1e-9, "pp %d busy %.3f < %.3f", pp, busy, busy1);
    }
}

/* Decode: one request alone makes output - 1 steps of the hand-computed step time. */
static void test_decode_alone(void)
{
    pl_hw hw = test_hw();
    pl_model m = test_model();
    pl_cluster cl = {
        .n_prefill = 1, .n_decode = 1, .pf = {.pp = 1, .tp = 1, .chunk = 256}, .dc = {.tp = 1}};
    pl_request r = {.arrival_ms = 0, .prompt = 100, .output = 3};
    pl_result res;
    TH_REQUIRE(pl_simulate(&m, &hw, &cl, &r, 1, &res) == 0);
    TH_REQUIRE(res.fits);
    /* step with context S: max(memory ~0, 2 x 8.1e6 FLOPs / 1e12 + 8 x 1e4 S / 5e11) + 0.5 */
    double s1 = 1e3 * (2 * 8.1e6 / 1e12 + 8 * 1e4 * 101 / 5e11) + 0.5;
    double s2 = 1e3 * (2 * 8.1e6 / 1e12 + 8 * 1e4 * 102 / 5e11) + 0.5;
    TH_CHECKF(fabs(res.tpot_p50 - (s1 + s2) / 2) < 1e-6, "tpot %.6f want %.6f", res.tpot_p50,
              (s1 + s2) / 2);
}

/* Colocated: the decode instance prefills the prompt in chunks of step_tokens (each a forward
 * of the whole model: a x (2L + x) + b x + c) and then steps as in test_decode_alone. */
static void test_colocated(void)
{
    pl_hw hw = test_hw();
    pl_model m = test_model();
    pl_cluster cl = {.n_prefill = 0, .n_decode = 1, .dc = {.tp = 1, .step_tokens = 64}};
    pl_request r = {.arrival_ms = 0, .prompt = 100, .output = 3};
    pl_result res;
    TH_REQUIRE(pl_simulate(&m, &hw, &cl, &r, 1, &res) == 0);
    TH_REQUIRE(res.fits);
    TH_CHECK(res.devices == 1);
    double want = 8e-5 * 64 * 64 + 0.016 * 64 + 2 + 8e-5 * 36 * (2.0 * 64 + 36) + 0.016 * 36 + 2;
    TH_CHECKF(fabs(res.ttft_p50 - want) < 1e-6, "ttft %.6f want %.6f", res.ttft_p50, want);
    double s1 = 1e3 * (2 * 8.1e6 / 1e12 + 8 * 1e4 * 101 / 5e11) + 0.5;
    double s2 = 1e3 * (2 * 8.1e6 / 1e12 + 8 * 1e4 * 102 / 5e11) + 0.5;
    TH_CHECKF(fabs(res.tpot_p50 - (s1 + s2) / 2) < 1e-6, "tpot %.6f want %.6f", res.tpot_p50,
              (s1 + s2) / 2);
}

/* Sequential: two requests that would overlap if they arrived together get the TTFT each
 * has alone; simulated together at time 0 the second one waits. */
static void test_sequential(void)
{
    pl_hw hw = test_hw();
    pl_model m = test_model();
    pl_cluster cl = {.n_prefill = 0, .n_decode = 1, .dc = {.tp = 1, .step_tokens = 512}};
    pl_request r[2] = {{.prompt = 256, .output = 4}, {.prompt = 256, .output = 4}};
    pl_result seq, one, both;
    TH_REQUIRE(pl_simulate_sequential(&m, &hw, &cl, r, 2, &seq) == 0);
    TH_REQUIRE(pl_simulate(&m, &hw, &cl, r, 1, &one) == 0);
    TH_REQUIRE(pl_simulate(&m, &hw, &cl, r, 2, &both) == 0);
    TH_CHECKF(fabs(seq.ttft_p90 - one.ttft_p50) < 1e-9, "seq %.6f alone %.6f", seq.ttft_p90,
              one.ttft_p50);
    TH_CHECK(both.ttft_p90 > one.ttft_p50 * 1.5);
    TH_CHECKF(fabs(seq.makespan_ms - 2 * one.makespan_ms) < 1e-9, "span %.6f", seq.makespan_ms);
}

/* one_node: tp beyond devices_per_node time-shares (compute over devices_per_node, not tp) and
 * its all-reduces stay on the node's links; a measured allreduce_us replaces the latency term. */
static void test_one_node(void)
{
    pl_hw hw = test_hw();
    pl_model m = test_model();
    hw.devices_per_node = 2;
    hw.net_lat = 1e-3;
    double shared_net = pl_decode_step_ms(&m, &hw, 3, false, 1, 100);
    TH_CHECK(pl_allreduce_ms(&hw, 3, 0) > 3.9); /* 2 x 2 x 1 ms over the network */
    hw.one_node = 1;
    TH_CHECK(pl_hw_parallel(&hw, 3) == 1.5 && pl_hw_parallel(&hw, 2) == 2 &&
             pl_hw_parallel(&hw, 4) == 2);
    double comp2 = 1e3 * (2 * 8.1e6 / 1e12 + 8 * 1e4 * 100 / 5e11) / 1.5;
    TH_CHECKF(fabs(pl_decode_step_ms(&m, &hw, 3, false, 1, 100) - (comp2 + 0.5)) < 1e-6,
              "step %.6f", pl_decode_step_ms(&m, &hw, 3, false, 1, 100));
    TH_CHECK(shared_net > pl_decode_step_ms(&m, &hw, 3, false, 1, 100));
    hw.ar_lat[3] = 50e-6;
    TH_CHECKF(fabs(pl_allreduce_ms(&hw, 3, 0) - 0.05) < 1e-9, "ar %.6f",
              pl_allreduce_ms(&hw, 3, 0));
    const char *t =
        "name: x\ndevices_per_node: 2\nmemory_gib: 1\npeak_tflops: {f32: 1}\n"
        "matmul_type: f32\nattention_type: f32\nhbm_gbps: 1\nnvlink_gbps: 1\n"
        "net_gbps: 1\nlatency_us: {nvlink: 1, net: 1}\nefficiency: {matmul: 1, "
        "attention: 1, memory: 1, nvlink: 1, net: 1}\noverhead_ms: {chunk: 0, step: 0}\n"
        "one_node: 1\nallreduce_us: {tp2: 10, tp3: 40}\n";
    pl_hw h2;
    char err[256];
    TH_REQUIRE(pl_hw_parse(t, strlen(t), "t", &h2, err, sizeof err) == 0);
    TH_CHECK(h2.one_node == 1 && fabs(h2.ar_lat[3] - 40e-6) < 1e-12 && h2.ar_lat[4] == 0);
    /* written and read back, with a gap in the measured tp counts */
    h2.ar_lat[3] = 0;
    h2.ar_lat[4] = 70e-6;
    h2.decode_speedup[3] = 1.25;
    char path[] = "/tmp/test_planner_hw_XXXXXX";
    int fd = mkstemp(path);
    TH_REQUIRE(fd >= 0);
    close(fd);
    TH_REQUIRE(pl_hw_write(&h2, "# round trip\n", path) == 0);
    pl_hw h3;
    TH_CHECKF(pl_hw_load(path, &h3, err, sizeof err) == 0, "%s", err);
    TH_CHECK(fabs(h3.ar_lat[2] - 10e-6) < 1e-12 && h3.ar_lat[3] == 0 &&
             fabs(h3.ar_lat[4] - 70e-6) < 1e-12 && h3.decode_speedup[3] == 1.25);
    unlink(path);
    const char *bad = "name: x\none_node: 2\n";
    TH_CHECK(pl_hw_parse(bad, strlen(bad), "t", &h2, err, sizeof err) == TD_EINVAL);
    TH_CHECKF(strstr(err, "one_node: 2 is outside [0, 1]") != NULL, "%s", err);
}

static void test_search_meets(void)
{
    pl_hw hw = test_hw();
    pl_model m = test_model();
    pl_workload w = {.n_requests = 32,
                     .rate = 20,
                     .prompt_lo = 512,
                     .prompt_hi = 2048,
                     .output_lo = 16,
                     .output_hi = 64,
                     .seed = 1};
    pl_request reqs[32];
    TH_REQUIRE(pl_workload_make(&w, reqs) == 0);
    pl_search_params sp = {
        .ttft_ms = 400, .tpot_ms = 2, .max_instances = 2, .pf = {.chunk_max = 512, .smooth = 0.75}};
    pl_candidate *c = NULL;
    int n = 0, best = -1;
    TH_REQUIRE(pl_search(&m, &hw, reqs, 32, &sp, &c, &n, &best) == 0);
    TH_REQUIRE(best >= 0);
    TH_CHECK(c[best].r.fits && c[best].r.ttft_p90 <= 400 && c[best].r.tpot_p90 <= 2);
    for (int i = 0; i < n; i++) /* nothing cheaper meets them */
        if (c[i].r.devices < c[best].r.devices) TH_CHECK(!c[i].meets);
    /* the smallest cluster misses the TTFT target at this rate: the search had to grow */
    TH_CHECK(c[best].r.devices > 2);
    free(c);
    sp.ttft_ms = 1e-3; /* impossible */
    TH_REQUIRE(pl_search(&m, &hw, reqs, 32, &sp, &c, &n, &best) == 0);
    TH_CHECK(best == -1);
    free(c);
    sp.max_prefill_tp = 0; /* as Tandem: no prefill tp */
    TH_REQUIRE(pl_search(&m, &hw, reqs, 32, &sp, &c, &n, &best) == 0);
    for (int i = 0; i < n; i++)
        TH_CHECK(c[i].cl.pf.tp == 1);
    free(c);
    sp.max_devices = 3; /* a machine with 3 cores or GPUs */
    TH_REQUIRE(pl_search(&m, &hw, reqs, 32, &sp, &c, &n, &best) == 0);
    TH_CHECK(n > 0);
    for (int i = 0; i < n; i++)
        TH_CHECKF(c[i].r.devices <= 3, "a %d-device configuration past the cap", c[i].r.devices);
    free(c);
}

static void expect_error(const char *text, const char *needle)
{
    pl_hw hw;
    char err[256] = "";
    int rc = pl_hw_parse(text, strlen(text), "bad.yaml", &hw, err, sizeof err);
    TH_CHECKF(rc != 0 && strstr(err, needle), "error '%s' lacks '%s'", err, needle);
}

static void replace(char *out, size_t cap, const char *from, const char *to)
{
    const char *p = strstr(HW_TEXT, from);
    snprintf(out, cap, "%.*s%s%s", (int)(p - HW_TEXT), HW_TEXT, to, p + strlen(from));
}

static void test_hw_errors(void)
{
    char t[2048];
    replace(t, sizeof t, "hbm_gbps: 1000000\n", "");
    expect_error(t, "missing key 'hbm_gbps'");
    replace(t, sizeof t, "hbm_gbps:", "hbm_gbs:");
    expect_error(t, "bad.yaml:7:1: unknown key 'hbm_gbs'");
    replace(t, sizeof t, "matmul: 1,", "matmul: 1.5,");
    expect_error(t, "efficiency.matmul: 1.5 is outside");
    replace(t, sizeof t, "memory_gib: 64", "memory_gib: lots");
    expect_error(t, "memory_gib: 'lots' is not a number");
    replace(t, sizeof t, "matmul_type: bf16", "matmul_type: fp8");
    expect_error(t, "matmul_type fp8 has no peak_tflops.fp8");
    replace(t, sizeof t, "matmul_type: bf16", "matmul_type: int4");
    expect_error(t, "expected fp8, bf16 or f32");
    replace(t, sizeof t, "devices_per_node: 8", "devices_per_node: 2.5");
    expect_error(t, "not a whole number");
    expect_error("name: [unclosed\n", "not YAML");
    expect_error("- a\n- b\n", "expected a mapping");
    pl_hw hw = test_hw();
    TH_CHECK(hw.kvx_bw == 1e15 && hw.chunk_overhead == 2e-3 && hw.attn_flops == 0.5e12);
}

static void test_named_shapes(void)
{
    pl_model m;
    TH_REQUIRE(pl_model_named("deepseek-v3", &m) == 0);
    TH_CHECKF(fabs(m.weight_bytes / 671e9 - 1) < 0.01, "total %.4g", m.weight_bytes);
    TH_CHECKF(fabs((pl_model_active_params(&m) + 129280 * 7168.0) / 37e9 - 1) < 0.03, "active %.4g",
              pl_model_active_params(&m));
    TH_CHECK(m.kv_bytes_token == 61 * 576 * 2);
    TH_REQUIRE(pl_model_named("llama3-8b", &m) == 0);
    TH_CHECKF(fabs(m.weight_bytes / 2 / 8.03e9 - 1) < 0.01, "params %.4g", m.weight_bytes / 2);
    TH_REQUIRE(pl_model_named("llama3-70b", &m) == 0);
    TH_CHECK(m.kv_bytes_token == 327680);
    TH_CHECK(pl_model_named("gpt-5", &m) == TD_ENOENT);
    /* MoE decode reads more experts as the batch grows, never more than all of them */
    TH_REQUIRE(pl_model_named("deepseek-v3", &m) == 0);
    double w1 = pl_model_weights_read(&m, 1), w64 = pl_model_weights_read(&m, 64);
    TH_CHECK(w1 < w64 && w64 <= m.weight_bytes - m.embd_bytes);
}

/* A mixture-of-experts GGUF header (the synthetic qwen3moe of make_synth.py: 4 layers,
 * n_embd 256, 8 query heads / 4 KV heads of 64, 8 experts of 128 of which 2 per token): a
 * token meets its 2 experts, not all 8; the experts' bytes are what decode reads in part. */
static const char *synth_dir;

static void test_moe_gguf(void)
{
    char path[512];
    snprintf(path, sizeof path, "%s/qwen3moe.gguf", synth_dir);
    pl_model m;
    TH_REQUIRE(pl_model_gguf(path, &m) == 0);
    const double attn = 256.0 * 512 * 2 + 256.0 * 256 * 2, router = 256.0 * 8;
    const double experts = 2 * 3 * 256.0 * 128;
    TH_CHECKF(m.layer_params == attn + router + experts, "layer params %.0f", m.layer_params);
    TH_CHECK(m.n_expert == 8 && m.n_expert_used == 2);
    TH_CHECK(m.moe_expert_bytes > 0 && m.moe_expert_bytes < m.weight_bytes);
    double w1 = pl_model_weights_read(&m, 1), w512 = pl_model_weights_read(&m, 512);
    TH_CHECK(w1 < w512 && w512 <= m.weight_bytes - m.embd_bytes);
}

/* Expert parallelism's imbalance: at one token, 4 choices of 32 experts over 2 ranks of 16
 * land 4-0, 3-1 or 2-2 (hypergeometric): the busier rank takes 2.698 on average against the
 * mean 2, 1.349x (the normal form gives 1.379); many tokens even it out; ep at tp 1, a dense
 * model or no tokens: 1. The decode step with ep is the balanced one with the experts' share
 * scaled. */
static void test_ep_imbalance(void)
{
    pl_model m = {
        .n_expert = 32, .n_expert_used = 4, .moe_expert_bytes = 1e9, .moe_active_params = 1e8};
    double mem, comp;
    pl_model_ep_imbalance(&m, 2, 1, &mem, &comp);
    TH_CHECKF(fabs(comp - 1.349) < 0.04 && fabs(mem - comp) < 1e-9, "one token: mem %.4f comp %.4f",
              mem, comp);
    double mem64, comp64, mem4, comp4;
    pl_model_ep_imbalance(&m, 2, 64, &mem64, &comp64);
    pl_model_ep_imbalance(&m, 4, 64, &mem4, &comp4);
    TH_CHECKF(comp64 > 1 && comp64 < 1.1 && mem64 >= 1 && mem64 < 1.05 && comp4 > comp64,
              "64 tokens: mem %.4f comp %.4f (4 ranks: comp %.4f)", mem64, comp64, comp4);
    pl_model_ep_imbalance(&m, 1, 8, &mem, &comp);
    TH_CHECK(mem == 1 && comp == 1);
    pl_model dense = {0};
    pl_model_ep_imbalance(&dense, 2, 8, &mem, &comp);
    TH_CHECK(mem == 1 && comp == 1);
    /* in a step: the experts' bytes are all that differs (bandwidth-bound here) */
    pl_hw hw = test_hw();
    pl_model t = test_model();
    t.n_expert = 32, t.n_expert_used = 4, t.moe_expert_bytes = t.weight_bytes / 2;
    t.moe_active_params = t.layer_params * t.n_layer / 4;
    double bal = pl_decode_step_ms(&t, &hw, 2, false, 1, 100);
    double ep = pl_decode_step_ms(&t, &hw, 2, true, 1, 100);
    TH_CHECKF(ep > bal && pl_decode_step_ms(&t, &hw, 1, true, 1, 100) ==
                              pl_decode_step_ms(&t, &hw, 1, false, 1, 100),
              "tp 2: balanced %.4f ms, ep %.4f ms", bal, ep);
    /* a measured ep step (decode_speedup_ep) holds one token's imbalance: at batch 1 it is the
     * step; larger batches scale the experts' share by their imbalance over one token's */
    pl_hw meas = hw, as_split = hw;
    meas.decode_speedup[2] = 1.8, meas.decode_speedup_ep[2] = 1.5;
    as_split.decode_speedup[2] = 1.5;
    TH_CHECK(fabs(pl_decode_step_ms(&t, &meas, 2, true, 1, 100) -
                  pl_decode_step_ms(&t, &as_split, 2, false, 1, 100)) < 1e-12);
    TH_CHECK(pl_decode_step_ms(&t, &meas, 2, true, 64, 100) <
             pl_decode_step_ms(&t, &as_split, 2, false, 64, 100));
}

static void test_reproduce_runs(void)
{
    pl_hw hw = test_hw();
    pl_repro_row rows[PL_REPRO_ROWS];
    TH_REQUIRE(pl_reproduce(&hw, 4, rows) == 0);
    for (int i = 0; i < PL_REPRO_ROWS; i++)
        TH_CHECKF(rows[i].simulated > 0 && isfinite(rows[i].simulated), "%s", rows[i].what);
    /* four stages cannot go faster than four times one stage */
    TH_CHECK(rows[0].simulated <= 4.0 + 1e-9);
}

/* Measured decode terms: decode_speedup replaces the lock-step rounds and the all-reduces of a
 * decode step, decode_attention_us_per_token the KV roofline; both load and write back. */
static void test_measured_decode(void)
{
    pl_hw hw = test_hw();
    pl_model m = test_model();
    hw.devices_per_node = 2;
    hw.one_node = 1;
    hw.ar_lat[3] = 50e-6;
    double w = 1e3 * 2 * 8.1e6 / 1e12; /* weights, compute-bound as in test_one_node */
    hw.decode_speedup[3] = 1.25;
    hw.decode_attn = 2e-6; /* 2 us a token of context */
    double want = (w + 100 * 2e-6 * 1e3) / 1.25 + 0.5;
    TH_CHECKF(fabs(pl_decode_step_ms(&m, &hw, 3, false, 1, 100) - want) < 1e-9,
              "step %.6f want %.6f", pl_decode_step_ms(&m, &hw, 3, false, 1, 100), want);
    /* tp 1 takes the measured attention, not the speed-up */
    TH_CHECK(fabs(pl_decode_step_ms(&m, &hw, 1, false, 1, 100) - (w + 0.2 + 0.5)) < 1e-9);
    const char *t =
        "name: x\ndevices_per_node: 2\nmemory_gib: 1\npeak_tflops: {f32: 1}\n"
        "matmul_type: f32\nattention_type: f32\nhbm_gbps: 1\nnvlink_gbps: 1\n"
        "net_gbps: 1\nlatency_us: {nvlink: 1, net: 1}\nefficiency: {matmul: 1, "
        "attention: 1, memory: 1, nvlink: 1, net: 1}\noverhead_ms: {chunk: 0, step: 0}\n"
        "decode_speedup: {tp3: 1.05}\ndecode_attention_us_per_token: 3.5\n";
    pl_hw h2;
    char err[256];
    TH_REQUIRE(pl_hw_parse(t, strlen(t), "t", &h2, err, sizeof err) == 0);
    TH_CHECK(fabs(h2.decode_speedup[3] - 1.05) < 1e-12 && h2.decode_speedup[2] == 0 &&
             fabs(h2.decode_attn - 3.5e-6) < 1e-15);
    const char *bad = "name: x\ndecode_speedup: {tp3: -1}\n";
    TH_CHECK(pl_hw_parse(bad, strlen(bad), "t", &h2, err, sizeof err) == TD_EINVAL);
}

/* Measured prefill terms: prefill_speedup replaces the lock-step rounds, the all-reduces and
 * the whole per-chunk overhead of a chunk at that tp (s31's tp 2 TTFTs were 1.43-1.49x long
 * with the overhead kept whole); prefill_speedup_ep serves the experts whole on the ranks,
 * prefill_speedup the rest; both load and write back. */
static void test_measured_prefill(void)
{
    pl_hw hw = test_hw();
    pl_model m = test_model();
    hw.devices_per_node = 2;
    hw.one_node = 1;
    hw.chunk_overhead = 40e-3;
    pl_stage one, meas, moe, moe_ep;
    TH_REQUIRE(pl_stage_make(&m, &hw, m.n_layer, 1, false, false, &one) == 0);
    hw.prefill_speedup[2] = 1.6;
    hw.prefill_speedup_ep[2] = 1.25;
    TH_REQUIRE(pl_stage_make(&m, &hw, m.n_layer, 2, false, false, &meas) == 0);
    for (int64_t x = 64; x <= 4096; x *= 4) {
        double t1 = pl_stage_ms(&m, &one, 1000, x), t2 = pl_stage_ms(&m, &meas, 1000, x);
        TH_CHECKF(fabs(t2 - t1 / 1.6) < 1e-9 * t1, "x %lld: tp 1 %.6f ms, tp 2 %.6f ms",
                  (long long)x, t1, t2);
    }
    /* a dense model has no experts to hold whole: ep takes prefill_speedup */
    TH_REQUIRE(pl_stage_make(&m, &hw, m.n_layer, 2, true, false, &moe_ep) == 0);
    TH_CHECK(fabs(pl_stage_ms(&m, &moe_ep, 0, 512) - pl_stage_ms(&m, &meas, 0, 512)) < 1e-12);
    pl_model e = m;
    e.n_expert = 8, e.n_expert_used = 2, e.moe_expert_bytes = e.weight_bytes / 2;
    e.moe_active_params = e.layer_params * e.n_layer / 2;
    TH_REQUIRE(pl_stage_make(&e, &hw, e.n_layer, 1, false, false, &one) == 0);
    TH_REQUIRE(pl_stage_make(&e, &hw, e.n_layer, 2, false, false, &moe) == 0);
    TH_REQUIRE(pl_stage_make(&e, &hw, e.n_layer, 2, true, false, &moe_ep) == 0);
    double t1 = pl_stage_ms(&e, &one, 0, 512);
    TH_CHECK(fabs(pl_stage_ms(&e, &moe, 0, 512) - t1 / 1.6) < 1e-9 * t1);
    TH_CHECK(fabs(pl_stage_ms(&e, &moe_ep, 0, 512) - t1 / 1.25) < 1e-9 * t1);
    /* tp 4 has no measurement: the rounds and all-reduces as before, the overhead whole */
    pl_stage four;
    TH_REQUIRE(pl_stage_make(&m, &hw, m.n_layer, 4, false, false, &four) == 0);
    TH_CHECK(four.c >= hw.chunk_overhead * 1e3);
    char path[] = "/tmp/test_planner_hw_XXXXXX";
    int fd = mkstemp(path);
    TH_REQUIRE(fd >= 0);
    close(fd);
    hw.prefill_speedup[4] = 2.5; /* with a gap at tp 3 */
    TH_REQUIRE(pl_hw_write(&hw, NULL, path) == 0);
    pl_hw h2;
    char err[256];
    TH_CHECKF(pl_hw_load(path, &h2, err, sizeof err) == 0, "%s", err);
    TH_CHECK(h2.prefill_speedup[2] == 1.6 && h2.prefill_speedup[3] == 0 &&
             h2.prefill_speedup[4] == 2.5 && h2.prefill_speedup_ep[2] == 1.25);
    unlink(path);
}

/* A data-parallel attention group (pl_decode_cfg.dp): its members are instances of tp 1 at
 * the measured dp step (decode_speedup_dp) or, unmeasured, the tp 1 step plus the gather and
 * reduce; their chunks at prefill_speedup_dp; a member holds its share of the experts only,
 * so its KV room grows; a dense model, tp 2 or ep with dp are refused; both keys load back. */
static void test_dp(void)
{
    pl_hw hw = test_hw();
    pl_model e = test_model();
    e.n_expert = 8, e.n_expert_used = 2, e.moe_expert_bytes = e.weight_bytes / 2;
    e.moe_active_params = e.layer_params * e.n_layer / 2;
    double t1 = pl_decode_step_ms(&e, &hw, 1, false, 4, 400);
    TH_CHECK(pl_decode_step_ms_dp(&e, &hw, 2, 4, 400) > t1); /* the gather and reduce */
    hw.decode_speedup_dp[2] = 0.8;
    TH_CHECK(fabs(pl_decode_step_ms_dp(&e, &hw, 2, 4, 400) - t1 / 0.8) < 1e-9 * t1);
    pl_stage one, st;
    TH_REQUIRE(pl_stage_make(&e, &hw, e.n_layer, 1, false, false, &one) == 0);
    hw.prefill_speedup_dp[2] = 0.5;
    TH_REQUIRE(pl_stage_make_dp(&e, &hw, 2, &st) == 0);
    TH_CHECK(fabs(pl_stage_ms(&e, &st, 0, 256) - 2 * pl_stage_ms(&e, &one, 0, 256)) < 1e-9);
    /* a colocated group of 2 against one instance: two devices, twice the instances */
    pl_cluster cl = {.n_prefill = 0, .n_decode = 1, .dc = {.tp = 1, .dp = 2}};
    pl_request reqs[4];
    for (int i = 0; i < 4; i++)
        reqs[i] = (pl_request){.arrival_ms = 0, .prompt = 64, .output = 8};
    pl_result r;
    TH_REQUIRE(pl_simulate(&e, &hw, &cl, reqs, 4, &r) == 0);
    TH_CHECK(r.fits && r.devices == 2 && r.tpot_p50 > 0);
    cl.dc.tp = 2;
    TH_CHECK(pl_simulate(&e, &hw, &cl, reqs, 4, &r) == TD_EINVAL);
    cl.dc.tp = 1, cl.dc.ep = true;
    TH_CHECK(pl_simulate(&e, &hw, &cl, reqs, 4, &r) == TD_EINVAL);
    cl.dc.ep = false;
    pl_model dense = test_model();
    TH_CHECK(pl_simulate(&dense, &hw, &cl, reqs, 4, &r) == TD_EINVAL);
    char path[] = "/tmp/test_planner_hw_XXXXXX";
    int fd = mkstemp(path);
    TH_REQUIRE(fd >= 0);
    close(fd);
    TH_REQUIRE(pl_hw_write(&hw, NULL, path) == 0);
    pl_hw h2;
    char err[256];
    TH_CHECKF(pl_hw_load(path, &h2, err, sizeof err) == 0, "%s", err);
    TH_CHECK(h2.decode_speedup_dp[2] == 0.8 && h2.prefill_speedup_dp[2] == 0.5);
    unlink(path);
    /* the search tries dp groups for the MoE model only (and never with ep) */
    pl_search_params sp = {.ttft_ms = 1e9, .tpot_ms = 1e9, .max_instances = 1};
    pl_candidate *c = NULL;
    int nc = 0, best = -1, with_dp = 0;
    hw.devices_per_node = 4;
    TH_REQUIRE(pl_search(&e, &hw, reqs, 4, &sp, &c, &nc, &best) == 0);
    for (int i = 0; i < nc; i++)
        with_dp +=
            c[i].cl.dc.dp > 1 &&
            c[i].r.devices == c[i].cl.n_prefill * c[i].cl.pf.pp * c[i].cl.pf.tp + c[i].cl.dc.dp;
    free(c);
    TH_CHECK(with_dp > 0);
    TH_REQUIRE(pl_search(&dense, &hw, reqs, 4, &sp, &c, &nc, &best) == 0);
    for (int i = 0; i < nc; i++)
        TH_CHECK(c[i].cl.dc.dp <= 1);
    free(c);
}

/* Two-batch overlap (pl_decode_step_ms_tbo): the two micro-batches' steps, each all-reduce
 * hidden behind the other's compute but for what sticks out. At B 1 or tp 1 the plain step.
 * With the all-reduces priced apart and longer than nothing, the overlap pays where the step
 * computes (many rows) and loses where it reads weights (few rows: twice); with a measured
 * speed-up (the all-reduces in it) only the second read is left. The simulator takes it for
 * steps of tbo_min requests or more, and refuses it at tp 1 and with dp. */
static void test_tbo(void)
{
    pl_hw hw = test_hw();
    pl_model m = test_model();
    hw.devices_per_node = 4;
    TH_CHECK(pl_decode_step_ms_tbo(&m, &hw, 2, false, 1, 100) ==
             pl_decode_step_ms(&m, &hw, 2, false, 1, 100));
    TH_CHECK(pl_decode_step_ms_tbo(&m, &hw, 1, false, 8, 100) ==
             pl_decode_step_ms(&m, &hw, 1, false, 8, 100));
    hw.nvlink_bw = 2e9; /* the all-reduces take time: 64 x 2 bytes a row at 1 GB/s a phase */
    hw.nvlink_lat = 1e-6;
    const int big = 4096; /* compute-bound: the products cost more than the weights' read */
    double plain = pl_decode_step_ms(&m, &hw, 2, false, big, 0);
    double tbo = pl_decode_step_ms_tbo(&m, &hw, 2, false, big, 0);
    TH_CHECKF(tbo < plain, "batch %d: tbo %.4f ms, plain %.4f ms", big, tbo, plain);
    hw.hbm_bw = 1e9; /* bandwidth-bound at a few rows: the second read costs more */
    plain = pl_decode_step_ms(&m, &hw, 2, false, 2, 0);
    tbo = pl_decode_step_ms_tbo(&m, &hw, 2, false, 2, 0);
    TH_CHECKF(tbo > plain, "batch 2: tbo %.4f ms, plain %.4f ms", tbo, plain);
    hw.decode_speedup[2] = 1.5; /* measured, the all-reduces in it: nothing left to hide */
    plain = pl_decode_step_ms(&m, &hw, 2, false, big, 0);
    tbo = pl_decode_step_ms_tbo(&m, &hw, 2, false, big, 0);
    double half = pl_decode_step_ms(&m, &hw, 2, false, big / 2, 0) - hw.step_overhead * 1e3;
    TH_CHECK(fabs(tbo - (2 * half + hw.step_overhead * 1e3)) < 1e-9 * tbo && tbo >= plain);
    pl_cluster cl = {.n_prefill = 0, .n_decode = 1, .dc = {.tp = 2, .tbo_min = 2}};
    pl_request reqs[4];
    for (int i = 0; i < 4; i++)
        reqs[i] = (pl_request){.arrival_ms = 0, .prompt = 64, .output = 8};
    pl_result with, without;
    TH_REQUIRE(pl_simulate(&m, &hw, &cl, reqs, 4, &with) == 0);
    cl.dc.tbo_min = 0;
    TH_REQUIRE(pl_simulate(&m, &hw, &cl, reqs, 4, &without) == 0);
    TH_CHECK(with.tpot_p50 > without.tpot_p50); /* the measured profile: the read only */
    cl.dc.tbo_min = 2, cl.dc.tp = 1;
    TH_CHECK(pl_simulate(&m, &hw, &cl, reqs, 4, &with) == TD_EINVAL);
}

/* The joint fit of profile forwards and chunks after a prefix recovers the model that made
 * them; a set that is not convex is refused and leaves the fit alone. */
static void test_joint_fit(void)
{
    const double a = 9e-4, b = 2.2, c = 30;
    double len[6], t[6];
    for (int i = 0; i < 6; i++) {
        len[i] = 128.0 * (i + 1);
        t[i] = a * len[i] * len[i] + b * len[i] + c;
    }
    pl_calib_chunk ch[4];
    for (int k = 0; k < 4; k++) {
        ch[k].L = 1024.0 * k;
        ch[k].x = 512;
        ch[k].ms = a * 512 * (2 * ch[k].L + 512) + b * 512 + c;
    }
    pf_cost_model f = {0};
    TH_REQUIRE(pl_calib_fit_joint(len, t, 6, ch, 4, &f) == 0);
    TH_CHECKF(fabs(f.a - a) < 1e-9 && fabs(f.b - b) < 1e-6 && fabs(f.c - c) < 1e-3,
              "a %g b %g c %g", f.a, f.b, f.c);
    for (int k = 0; k < 4; k++)
        ch[k].ms = 100; /* longer prefixes no slower: no convex model */
    for (int i = 0; i < 6; i++)
        t[i] = 100;
    f.a = 7;
    TH_CHECK(pl_calib_fit_joint(len, t, 6, ch, 4, &f) == TD_ERANGE && f.a == 7);
    TH_CHECK(pl_calib_fit_joint(len, t, 1, ch, 1, &f) == TD_ERANGE);
}

int main(int argc, char **argv)
{
    synth_dir = argc > 1 ? argv[1] : NULL;
    TH_RUN(test_single_request_pp1);
    TH_RUN(test_single_request_pp2);
    TH_RUN(test_more_stages);
    TH_RUN(test_decode_alone);
    TH_RUN(test_colocated);
    TH_RUN(test_sequential);
    TH_RUN(test_one_node);
    TH_RUN(test_measured_decode);
    TH_RUN(test_measured_prefill);
    TH_RUN(test_dp);
    TH_RUN(test_joint_fit);
    TH_RUN(test_search_meets);
    TH_RUN(test_hw_errors);
    TH_RUN(test_named_shapes);
    if (synth_dir) TH_RUN(test_moe_gguf);
    TH_RUN(test_ep_imbalance);
    TH_RUN(test_tbo);
    TH_RUN(test_reproduce_runs);
    TH_EXIT();
}
