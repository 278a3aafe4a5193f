/* bench_fused.c: batch-1 decode with the CPU backend's fused ops against TANDEM_CPU_FUSED=0,
 * in one process, alternated in short runs, so that a shared machine's changing load hits both
 * alike (BENCHMARKS.md "Engine", "Fused decode ops").
 *
 *   bench_fused MODEL [THREADS [ROUNDS [TOKENS]]]     defaults 2, 20, 32
 *
 * Each round runs TOKENS greedy decode steps at batch 1 from an empty context on each engine
 * (order swapped every round) and prints one line; the summary gives the median tok/s of each
 * and the median of the per-round ratios, plus the pool dispatches and parts the caller ran
 * for an absent worker, per token (kn_pool_get_stats, with TANDEM_CPU_PROFILE=1). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "kn_backends.h"
#include "kn_test_util.h"
#include "kv_mem.h"
#include "model.h"

typedef struct {
    kn_backend be;
    kn_engine *eng;
    kn_kv_mem *mem;
} rig;

static kn_model *model;

static int rig_open(rig *r, const char *fused, int threads)
{
    memset(r, 0, sizeof *r);
    setenv("TANDEM_CPU_FUSED", fused, 1);
    int rc = kn_backend_create("cpu", &(kn_backend_options){.n_threads = threads}, &r->be);
    unsetenv("TANDEM_CPU_FUSED");
    if (rc) return rc;
    if ((rc = kn_engine_create(model, r->be, NULL, &r->eng))) return rc;
    kn_kv_pool_params kp = kn_model_kv_params(model, 64, 16, TD_F16);
    return kn_kv_mem_create(&kp, &r->mem);
}

/* tokens greedy steps at batch 1 from an empty context: seconds, or < 0 on error. */
static double decode(rig *r, int tokens, float *lg)
{
    const int nv = model->hp.n_vocab;
    kn_kv_seq seq;
    kn_kv_seq_init(&seq);
    int32_t tok = 17, so = 0, row = 0;
    int rc = 0;
    double t0 = kt_now_s();
    for (int32_t pos = 0; pos < tokens && !rc; pos++) {
        if ((rc = kn_kv_seq_reserve(r->mem, &seq, pos + 1))) break;
        kn_seq_view v = {.block_table = seq.blocks, .n_ctx = pos + 1};
        kn_batch b = {.n_tokens = 1,
                      .n_solo = 1,
                      .tokens = &tok,
                      .pos = &pos,
                      .seq_of = &so,
                      .n_seqs = 1,
                      .seqs = &v,
                      .n_logits = 1,
                      .logit_rows = &row};
        rc = kn_engine_forward(r->eng, kn_kv_mem_pool(r->mem), &b, lg);
        int best = 0;
        for (int i = 1; i < nv; i++)
            if (lg[i] > lg[best]) best = i;
        tok = best;
    }
    double dt = kt_now_s() - t0;
    kn_kv_seq_fini(r->mem, &seq);
    return rc ? -1 : dt;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: bench_fused MODEL [THREADS [ROUNDS [TOKENS]]]\n");
        return 2;
    }
    const int threads = argc > 2 ? atoi(argv[2]) : 2, rounds = argc > 3 ? atoi(argv[3]) : 20,
              tokens = argc > 4 ? atoi(argv[4]) : 32;
    if (threads < 1 || rounds < 1 || rounds > 1000 || tokens < 1 || tokens > 1000) {
        fprintf(stderr, "bench_fused: bad threads, rounds or tokens\n");
        return 2;
    }
    td_gguf *g;
    if (kt_open_model(argv[1], &g, &model)) return 1;
    rig r[2]; /* 0 fused, 1 unfused */
    float *lg = malloc((size_t)model->hp.n_vocab * sizeof *lg);
    double *tps[2] = {calloc((size_t)rounds, sizeof(double)),
                      calloc((size_t)rounds, sizeof(double))};
    double *ratio = calloc((size_t)rounds, sizeof(double));
    if (!lg || !tps[0] || !tps[1] || !ratio || rig_open(&r[0], "1", threads) ||
        rig_open(&r[1], "0", threads)) {
        fprintf(stderr, "bench_fused: setup failed\n");
        return 1;
    }
    for (int k = 0; k < 2; k++) /* warm-up: page in the weights, wake the threads */
        if (decode(&r[k], 8, lg) < 0) return 1;
    kn_pool_stats st0[2], st1[2];
    for (int k = 0; k < 2; k++)
        kn_pool_get_stats(kn_cpu_pool(kn_cpu_of(r[k].be)), &st0[k]);
    for (int i = 0; i < rounds; i++) {
        for (int j = 0; j < 2; j++) {
            const int k = (i + j) % 2;
            double dt = decode(&r[k], tokens, lg);
            if (dt < 0) return 1;
            tps[k][i] = tokens / dt;
        }
        ratio[i] = tps[0][i] / tps[1][i];
        printf("round %d: fused %.1f tok/s, unfused %.1f tok/s, ratio %.3f\n", i, tps[0][i],
               tps[1][i], ratio[i]);
    }
    const double n_tok = (double)rounds * tokens;
    for (int k = 0; k < 2; k++) {
        kn_pool_get_stats(kn_cpu_pool(kn_cpu_of(r[k].be)), &st1[k]);
        printf("%s: per token %.1f dispatches, %.1f parts run by the caller for a worker\n",
               k ? "unfused" : "fused", (st1[k].dispatches - st0[k].dispatches) / n_tok,
               (st1[k].stolen - st0[k].stolen) / n_tok);
    }
    printf("threads %d, %d rounds of %d tokens: fused %.1f tok/s, unfused %.1f tok/s (medians), "
           "median ratio %.3f\n",
           threads, rounds, tokens, kt_median(tps[0], rounds), kt_median(tps[1], rounds),
           kt_median(ratio, rounds));
    return 0;
}
