/* cmd_bench.c: `tandem bench-engine`: the llama-bench workloads (prefill of 512 tokens,
 * 128 generated tokens at batch 1) plus decode at batch 8, next to this machine's
 * ceilings measured in the same run, each figure reported as a ratio of its roofline:
 *   decode roofline  = read bandwidth / weight bytes read per step (tokens/s)
 *   prefill roofline = sgemm rate / (2 x parameters) (tokens/s)
 * With --backend cuda the same workloads run on the GPU and are reported in absolute
 * figures (a GPU's clocks are stable enough), with the weight bytes a decode step reads
 * per second beside them, to compare with the device's memory bandwidth; this machine's
 * CPU ceilings say nothing about the GPU and are not measured then.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cpu_backend.h"
#include "cpu_blas.h"
#include "td_clock.h"
#include "td_err.h"
#include "td_stats.h"

/* Prompt tokens of the prefill workload (llama-bench's pp512). */
enum { n_prefill = 512 };

static double now_s(void)
{
    return (double)td_now_ns() * 1e-9;
}

/* Deterministic token ids spread over the vocabulary (not a repeated token, so the
 * embedding rows and attention patterns are those of real text's variety). */
static void fill_ids(int32_t *ids, int64_t n, int32_t n_vocab, uint64_t seed)
{
    uint64_t x = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (int64_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((x >> 33) % (uint64_t)n_vocab);
    }
}

/* One timed run of n_steps decode steps for n_seq sequences from an empty context. */
static int run_decode(cli_session *s, int n_seq, int n_steps, float *logits, double *secs)
{
    kn_kv_seq *seqs = calloc((size_t)n_seq, sizeof *seqs);
    kn_seq_view *views = calloc((size_t)n_seq, sizeof *views);
    int32_t *tok = malloc((size_t)n_seq * sizeof *tok), *pos = malloc((size_t)n_seq * sizeof *pos);
    int32_t *seq_of = malloc((size_t)n_seq * sizeof *seq_of);
    int32_t *rows = malloc((size_t)n_seq * sizeof *rows);
    int rc = (!seqs || !views || !tok || !pos || !seq_of || !rows) ? TD_ENOMEM : 0;
    for (int i = 0; i < n_seq && !rc; i++) {
        kn_kv_seq_init(&seqs[i]);
        seq_of[i] = rows[i] = i;
    }
    if (!rc) fill_ids(tok, n_seq, s->rt.model->hp.n_vocab, 7);
    double t0 = now_s();
    for (int step = 0; step < n_steps && !rc; step++) {
        for (int i = 0; i < n_seq && !rc; i++) {
            rc = kn_kv_seq_reserve(s->mem, &seqs[i], step + 1);
            views[i] = (kn_seq_view){.block_table = seqs[i].blocks, .n_ctx = step + 1};
            pos[i] = step;
        }
        if (rc) break;
        /* one-token decode rows are the batch's solo rows, as the decode node makes them */
        kn_batch b = {.n_tokens = n_seq,
                      .n_solo = n_seq,
                      .tokens = tok,
                      .pos = pos,
                      .seq_of = seq_of,
                      .n_seqs = n_seq,
                      .seqs = views,
                      .n_logits = n_seq,
                      .logit_rows = rows};
        rc = kn_engine_forward(s->rt.engine, s->kv, &b, logits);
        /* greedy next tokens, as a real generation loop would feed them */
        for (int i = 0; i < n_seq && !rc; i++) {
            const float *l = logits + (size_t)i * (size_t)s->rt.model->hp.n_vocab;
            int32_t best = 0;
            for (int32_t v = 1; v < s->rt.model->hp.n_vocab; v++)
                if (l[v] > l[best]) best = v;
            tok[i] = best;
        }
    }
    *secs = now_s() - t0;
    for (int i = 0; i < n_seq && seqs; i++)
        kn_kv_seq_fini(s->mem, &seqs[i]);
    free(seqs);
    free(views);
    free(tok);
    free(pos);
    free(seq_of);
    free(rows);
    return rc;
}

static int run_prefill(cli_session *s, int n, float *logits, double *secs)
{
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    if (!ids) return TD_ENOMEM;
    fill_ids(ids, n, s->rt.model->hp.n_vocab, 3);
    kn_kv_seq seq;
    kn_kv_seq_init(&seq);
    double t0 = now_s();
    int rc = cli_prefill(s, &seq, ids, n, 0, n, logits, NULL);
    *secs = now_s() - t0;
    kn_kv_seq_fini(s->mem, &seq);
    free(ids);
    return rc;
}

/* Weight bytes a decode step reads and the parameters of the matrix products: every
 * tensor of the file except the embedding lookup, which reads one row (but counts once
 * as the LM head when the embeddings are tied). Of a mixture-of-experts layer's 3-D expert
 * tensors, the experts one token takes (n_expert_used of n_expert): what a batch-1 step
 * reads and what a token computes. */
static void model_weights(const cli_session *s, double *bytes, double *params)
{
    const kn_hparams *hp = &s->rt.model->hp;
    *bytes = 0;
    *params = 0;
    for (size_t i = 0; i < td_gguf_n_tensors(s->rt.gguf); i++) {
        const td_gguf_tensor *t = td_gguf_tensor_at(s->rt.gguf, i);
        bool embd = !strcmp(t->name, "token_embd.weight");
        if (embd && !hp->tied_embd) continue;
        bool experts = t->n_dims == 3 && hp->n_expert > 0 && t->ne[2] == hp->n_expert;
        double share = experts ? (double)hp->n_expert_used / hp->n_expert : 1.0;
        *bytes += (double)t->nbytes * share;
        if (t->n_dims >= 2) *params += (double)t->ne[0] * (double)t->ne[1] * t->ne[2] * share;
    }
}

/* The figures of a device backend: absolute, with the weight bytes read per second by
 * batch-1 decode (one read of every weight per step) for a comparison with the device's
 * memory bandwidth. */
static void report_device(const cli_session *s, bool json, double pp, double tg, double bn,
                          int batch, int n_gen)
{
    char desc[320];
    s->rt.be.ops->describe(s->rt.be.ctx, desc, sizeof desc);
    double wbytes, params;
    model_weights(s, &wbytes, &params);
    if (json) {
        printf("{\"backend\": \"%s\", \"device\": \"%s\", \"prefill_tps\": %.2f, "
               "\"decode_tps\": %.2f, \"decode_batch\": %d, \"decode_batch_tps\": %.2f, "
               "\"gen\": %d, \"weight_bytes\": %.0f, \"params\": %.0f, "
               "\"decode_weight_gbps\": %.2f}\n",
               s->rt.be.ops->name, desc, pp, tg, batch, bn, n_gen, wbytes, params,
               tg * wbytes / 1e9);
        return;
    }
    printf("backend %s: %s\n", s->rt.be.ops->name, desc);
    printf("weights read per decode step %.1f MB, %.1f M params in matrix products\n", wbytes / 1e6,
           params / 1e6);
    printf("prefill pp512 : %9.1f tok/s  (%.2f TFLOP/s in matrix products)\n", pp,
           pp * 2 * params / 1e12);
    printf("decode  tg%d : %9.1f tok/s  %.3f ms/token, weights read at %.1f GB/s\n", n_gen, tg,
           1e3 / tg, tg * wbytes / 1e9);
    printf("decode  b%d   : %9.1f tok/s  (%.2fx batch 1), %.3f ms/step\n", batch, bn, bn / tg,
           1e3 * batch / bn);
}

/* KV room (tokens) for the workloads: batch sequences of n_gen + 1 tokens, the prefill, and
 * at least 4096. */
static int bench_ctx(int batch, int n_gen, int n_prompt)
{
    int ctx = batch * (n_gen + 1) > n_prompt ? batch * (n_gen + 1) : n_prompt;
    return ctx < 4096 ? 4096 : ctx;
}

static int bench_usage(void)
{
    fprintf(stderr, "usage: tandem bench-engine --model PATH [--threads N] [--reps N] "
                    "[--kv-type f16|f32] [--act q8|q16|f32] [--batch B] [--gen N] "
                    "[--backend cpu|cuda|cpu-dev] [--json]\n");
    return TD_EINVAL;
}

/* The CPU figures beside this machine's ceilings, measured now, and what ran (the CPU's
 * features, the BLAS core, each weight type's kernels). */
static void report_cpu(cli_session *s, kn_cpu *cpu, const char *model_path, td_dtype kv_type,
                       bool json, double pp, double tg, double b8, int batch, int n_gen)
{
    double mem = kn_cpu_mem_read_gbps(cpu, 0, 5);
    double gemm = kn_cpu_sgemm_gflops(cpu, 2048, 3);
    double wbytes, params;
    model_weights(s, &wbytes, &params);
    double tg_roof = mem * 1e9 / wbytes, pp_roof = gemm * 1e9 / (2 * params);
    int th = kn_cpu_n_threads(cpu);
    kn_blas_info bi;
    kn_blas_info_get(&bi);
    char paths[1024];
    kn_cpu_describe_paths(cpu, paths, sizeof paths);
    if (json) {
        printf("{\"threads\": %d, \"isa\": \"%s\", \"act\": \"%s\", \"prefill_tps\": %.2f, "
               "\"decode_tps\": %.2f, "
               "\"decode_batch\": %d, \"decode_b8_tps\": %.2f, \"mem_gbps\": %.2f, "
               "\"gemm_gflops\": %.2f, "
               "\"weight_bytes\": %.0f, \"params\": %.0f, \"decode_roofline_tps\": %.2f, "
               "\"prefill_roofline_tps\": %.2f, \"decode_ratio\": %.3f, "
               "\"prefill_ratio\": %.3f, \"cpu_isa\": \"%s\", \"cpu_features\": \"%s\", "
               "\"blas_core\": \"%s\", \"blas_core_isa\": \"%s\", \"blas_fits\": %s, "
               "\"blas_fixed_from\": \"%s\", \"paths\": \"%s\"}\n",
               th, kn_cpu_isa(), kn_cpu_act_name(kn_cpu_act(cpu)), pp, tg, batch, b8, mem, gemm,
               wbytes, params, tg_roof, pp_roof, tg / tg_roof, pp / pp_roof, bi.cpu_isa,
               bi.cpu_features, bi.core, bi.core_isa, bi.fits ? "true" : "false", bi.fixed_from,
               paths);
    } else {
        printf("model %s, %d threads, isa %s, kv %s, act %s\n", model_path, th, kn_cpu_isa(),
               td_dtype_name(kv_type), kn_cpu_act_name(kn_cpu_act(cpu)));
        printf("cpu %s (%s); blas OpenBLAS core %s (%s)%s%s%s\n", bi.cpu_isa, bi.cpu_features,
               bi.core, bi.core_isa, bi.fits ? "" : ": OLDER THAN THIS CPU",
               bi.fixed_from[0] ? ", set for this cpu; OpenBLAS chose " : "", bi.fixed_from);
        printf("products: %s\n", paths);
        printf("ceilings: memory read %.1f GB/s, sgemm %.1f GFLOP/s\n", mem, gemm);
        printf("weights read per decode step %.1f MB, %.1f M params in matrix products\n",
               wbytes / 1e6, params / 1e6);
        printf("prefill pp%d : %8.1f tok/s  roofline %8.1f  ratio %.2f\n", n_prefill, pp, pp_roof,
               pp / pp_roof);
        printf("decode  tg%d : %8.1f tok/s  roofline %8.1f  ratio %.2f\n", n_gen, tg, tg_roof,
               tg / tg_roof);
        printf("decode  b%d  : %8.1f tok/s  (%.2fx batch 1)\n", batch, b8, b8 / tg);
    }
}

int cmd_bench_engine(int argc, char **argv)
{
    cli_session_params sp = {.kv_type = TD_F16};
    bool json = false, act_set = false;
    kn_cpu_act_mode act = KN_CPU_ACT_F32;
    int reps = 3, rc = 0, batch = 8, n_gen = 128;
    for (int i = 0; i < argc && !rc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(f, "--json")) {
            json = true;
            continue;
        }
        if (!strcmp(f, "--model"))
            sp.model_path = v;
        else if (!strcmp(f, "--threads"))
            rc = cli_parse_int(f, v, 1, 256, &sp.threads);
        else if (!strcmp(f, "--reps"))
            rc = cli_parse_int(f, v, 1, 100, &reps);
        else if (!strcmp(f, "--batch"))
            rc = cli_parse_int(f, v, 1, 1024, &batch);
        else if (!strcmp(f, "--gen"))
            rc = cli_parse_int(f, v, 1, 8192, &n_gen);
        else if (!strcmp(f, "--backend"))
            sp.backend = v;
        else if (!strcmp(f, "--kv-type"))
            rc = cli_parse_kv_type(v, &sp.kv_type);
        else if (!strcmp(f, "--act")) {
            if (v && kn_cpu_act_parse(v, &act)) {
                fprintf(stderr, "tandem: --act %s: expected q8, q16 or f32\n", v);
                return TD_EINVAL;
            }
            act_set = true;
        } else {
            return bench_usage();
        }
        if (!v) {
            fprintf(stderr, "tandem: %s needs a value\n", f);
            return TD_EINVAL;
        }
        i++;
    }
    if (rc) return rc;
    if (!sp.model_path) {
        fprintf(stderr, "tandem: bench-engine needs --model\n");
        return TD_EINVAL;
    }
    sp.ctx = bench_ctx(batch, n_gen, n_prefill);
    cli_session s;
    if ((rc = cli_session_open(&s, &sp))) return rc;
    kn_cpu *cpu = kn_cpu_of(s.rt.be); /* NULL on another backend */
    if (act_set && !cpu) {
        fprintf(stderr, "tandem: --act applies to the cpu backend only\n");
        cli_session_close(&s);
        return TD_EINVAL;
    }
    /* --act overrides TANDEM_CPU_ACT only when given */
    if (act_set) kn_cpu_set_act(cpu, act);
    float *logits = malloc((size_t)batch * (size_t)s.rt.model->hp.n_vocab * sizeof *logits);
    double *t_pp = calloc((size_t)reps, sizeof(double)),
           *t_tg = calloc((size_t)reps, sizeof(double));
    double *t_b8 = calloc((size_t)reps, sizeof(double));
    if (!logits || !t_pp || !t_tg || !t_b8) rc = TD_ENOMEM;
    double warm;
    /* warm-up: page in the weights, start the threads, size the scratch */
    if (!rc) rc = run_prefill(&s, n_prefill, logits, &warm);
    if (!rc) rc = run_decode(&s, batch, 4, logits, &warm);
    /* alternate the workloads so drift hits all of them */
    for (int r = 0; r < reps && !rc; r++) {
        if (!rc) rc = run_prefill(&s, n_prefill, logits, &t_pp[r]);
        if (!rc) rc = run_decode(&s, 1, n_gen, logits, &t_tg[r]);
        if (!rc) rc = run_decode(&s, batch, n_gen, logits, &t_b8[r]);
    }
    if (rc) {
        fprintf(stderr, "tandem: bench-engine failed: %s\n", td_strerror(rc));
    } else {
        double pp = n_prefill / td_stats_median(t_pp, (size_t)reps),
               tg = n_gen / td_stats_median(t_tg, (size_t)reps);
        double b8 = batch * n_gen / td_stats_median(t_b8, (size_t)reps);
        if (!cpu) {
            report_device(&s, json, pp, tg, b8, batch, n_gen);
            goto done;
        }
        report_cpu(&s, cpu, sp.model_path, sp.kv_type, json, pp, tg, b8, batch, n_gen);
    }
done:
    free(logits);
    free(t_pp);
    free(t_tg);
    free(t_b8);
    cli_session_close(&s);
    return rc;
}
