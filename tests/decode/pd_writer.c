/* pd_writer.c: a stand-in for a prefill instance in the disaggregated decode tests: it
 * prefills a prompt with the real engine (the whole model, one process), samples the first
 * token like the last prefill stage does, and pushes the KV into a tandem-decode
 * instance's targets with kvxfer over a real UCX pipe, chunk by chunk as it computes them.
 *
 *   pd_writer --model M.gguf --prompt-ids IDS --request-id R --targets HEX[,HEX...]
 *             [--stages 1|2] [--chunks N] [--delay-ms MS] [--tls T] [--block-size B]
 *             [--kv-type f16|f32] [--threads N] [--timeout-ms MS]
 *             [--temperature T] [--top-k K] [--top-p P] [--min-p P] [--seed S]
 *
 * --stages 2 splits the layers in two halves, each pushed by its own connector as stage
 * 0 and 1 (what a 2-stage pipeline does; only the last sends the first token). The prompt
 * is prefilled in --chunks pieces; after each one its KV goes out and the writer prints
 * "CHUNK k" (once every decode rank accepted the writer, so a kill after that line is a
 * writer dying mid-transfer), then progresses for --delay-ms. Then "FIRST <token>" and,
 * when every stage's request is final, "DONE <state> <reason>" per stage. Exit status 0
 * when every stage is DONE.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "gguf.h"
#include "kv_mem.h"
#include "kvx_conn.h"
#include "model.h"
#include "pd_util.h"
#include "sampler.h"
#include "td_clock.h"
#include "td_err.h"

#define MAX_TARGETS 64

typedef struct {
    const char *model, *ids, *targets, *tls, *kv_type;
    uint64_t req;
    int stages, chunks, delay_ms, block_size, threads, timeout_ms;
    td_sampling sp;
} opts;

static void usage(void)
{
    fprintf(stderr, "usage: pd_writer --model M --prompt-ids IDS --request-id R --targets HEX,... "
                    "[--stages 1|2] [--chunks N] [--delay-ms MS] [--tls T] [--block-size B] "
                    "[--kv-type f16|f32] [--threads N] [--timeout-ms MS] [--temperature T] "
                    "[--top-k K] [--top-p P] [--min-p P] [--seed S]\n");
    exit(2);
}

static void parse(int argc, char **argv, opts *o)
{
    *o = (opts){.stages = 1,
                .chunks = 3,
                .tls = "tcp",
                .kv_type = "f16",
                .block_size = 16,
                .threads = 1,
                .timeout_ms = 20000};
    for (int i = 1; i < argc; i += 2) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) usage();
        if (!strcmp(f, "--model"))
            o->model = v;
        else if (!strcmp(f, "--prompt-ids"))
            o->ids = v;
        else if (!strcmp(f, "--targets"))
            o->targets = v;
        else if (!strcmp(f, "--tls"))
            o->tls = v;
        else if (!strcmp(f, "--kv-type"))
            o->kv_type = v;
        else if (!strcmp(f, "--request-id"))
            o->req = strtoull(v, NULL, 10);
        else if (!strcmp(f, "--stages"))
            o->stages = atoi(v);
        else if (!strcmp(f, "--chunks"))
            o->chunks = atoi(v);
        else if (!strcmp(f, "--delay-ms"))
            o->delay_ms = atoi(v);
        else if (!strcmp(f, "--block-size"))
            o->block_size = atoi(v);
        else if (!strcmp(f, "--threads"))
            o->threads = atoi(v);
        else if (!strcmp(f, "--timeout-ms"))
            o->timeout_ms = atoi(v);
        else if (!strcmp(f, "--temperature"))
            o->sp.temperature = strtof(v, NULL);
        else if (!strcmp(f, "--top-k"))
            o->sp.top_k = atoi(v);
        else if (!strcmp(f, "--top-p"))
            o->sp.top_p = strtof(v, NULL);
        else if (!strcmp(f, "--min-p"))
            o->sp.min_p = strtof(v, NULL);
        else if (!strcmp(f, "--seed"))
            o->sp.seed = strtoull(v, NULL, 10);
        else
            usage();
    }
    if (!o->model || !o->ids || !o->targets || !o->req || o->stages < 1 || o->stages > 2 ||
        o->chunks < 1)
        usage();
}

/* Progress every stage's connector for about ms milliseconds. */
static void progress_for(kvx_conn **c, int n, int ms)
{
    int64_t end = td_now_ms() + ms;
    do {
        for (int s = 0; s < n; s++)
            kvx_conn_progress(c[s], n == 1 ? 5 : 2);
    } while (td_now_ms() < end);
}

static bool final(kvx_req_state st)
{
    return st == KVX_REQ_DONE || st == KVX_REQ_FAILED;
}

int main(int argc, char **argv)
{
    opts o;
    parse(argc, argv, &o);
    int n_prompt;
    int32_t *ids = pd_parse_ids(o.ids, &n_prompt);

    /* the targets, one per decode rank */
    uint8_t *tg[MAX_TARGETS];
    size_t tg_len[MAX_TARGETS];
    int n_tg = 0;
    for (const char *p = o.targets; *p && n_tg < MAX_TARGETS;) {
        size_t len = strcspn(p, ",");
        tg[n_tg] = pd_unhex(p, len, &tg_len[n_tg]);
        n_tg++;
        p += len + (p[len] == ',');
    }

    /* the whole model in this process: prefill into our own pool */
    char err[512];
    td_gguf *g;
    kn_model *m;
    kn_cpu *cpu;
    kn_engine *e;
    kn_kv_mem *mem;
    if (td_gguf_open(o.model, &g, err, sizeof err)) {
        fprintf(stderr, "pd_writer: %s\n", err);
        return 1;
    }
    kn_shard shard = {0};
    td_dtype kt = strcmp(o.kv_type, "f32") ? TD_F16 : TD_F32;
    int nb = (n_prompt + o.block_size - 1) / o.block_size;
    if (kn_model_load(g, &shard, &m) || kn_cpu_create(o.threads, &cpu) ||
        kn_engine_create(m, kn_cpu_backend(cpu), NULL, &e))
        return 1;
    kn_kv_pool_params kp = kn_model_kv_params(m, nb + 1, o.block_size, kt);
    if (kn_kv_mem_create(&kp, &mem)) return 1;
    kn_kv_pool *kv = kn_kv_mem_pool(mem);
    kn_kv_seq seq;
    kn_kv_seq_init(&seq);
    if (kn_kv_seq_reserve(mem, &seq, n_prompt)) return 1;

    /* one connector per stage, each the source of its layer range of our pool */
    int L = m->hp.n_layer, half = L / 2;
    kvx_conn *c[2] = {0};
    /* K and V of a layer, or its latent array once (kv_pool.h) */
    size_t layer_bytes = kv->block_bytes * (size_t)kv->n_blocks * (size_t)kn_kv_pool_arrays(kv);
    for (int s = 0; s < o.stages; s++) {
        int l0 = o.stages == 1 ? 0 : s * half, l1 = o.stages == 1 || s == 1 ? L : half;
        kvx_layout l = {.layer0 = (uint32_t)l0,
                        .n_layers = (uint32_t)(l1 - l0),
                        .n_kv_heads = (uint32_t)m->hp.n_head_kv,
                        .head0 = 0,
                        .n_heads = (uint32_t)m->hp.n_head_kv,
                        .block_size = (uint32_t)o.block_size,
                        .head_dim = (uint32_t)m->hp.head_dim,
                        .dtype_size = kt == TD_F16 ? 2 : 4,
                        .n_blocks = (uint32_t)kv->n_blocks,
                        .kv_arrays = (uint32_t)kn_kv_pool_arrays(kv)};
        kvx_pipe *pipe;
        if (kvx_pipe_ucx_create(&(kvx_pipe_params){.tls = o.tls}, &pipe) ||
            kvx_conn_create(pipe, &(kvx_conn_params){.timeout_ms = o.timeout_ms}, &c[s]) ||
            kvx_pf_register_source(c[s], (char *)kv->region + (size_t)l0 * layer_bytes,
                                   (size_t)(l1 - l0) * layer_bytes, &l))
            return 1;
        kvx_pf_req_params pp = {.stage = (uint32_t)s,
                                .src_rank = 0,
                                .src_tp = 1,
                                .n_dst = (uint32_t)n_tg,
                                .timeout_ms = o.timeout_ms};
        if (kvx_pf_open(c[s], o.req, &pp)) return 1;
        for (int t = 0; t < n_tg; t++)
            if (kvx_pf_add_target(c[s], o.req, tg[t], tg_len[t])) return 1;
    }

    /* prefill chunk by chunk; each chunk's KV goes out as soon as it is computed */
    float *logits = malloc((size_t)m->hp.n_vocab * sizeof *logits);
    int32_t *pos = malloc((size_t)n_prompt * sizeof *pos), *seq_of = calloc(n_prompt, 4);
    int per = (n_prompt + o.chunks - 1) / o.chunks, rc = 0;
    for (int k = 0, t0 = 0; t0 < n_prompt && !rc; k++, t0 += per) {
        int t1 = t0 + per < n_prompt ? t0 + per : n_prompt;
        for (int i = t0; i < t1; i++)
            pos[i] = i;
        kn_seq_view view = {.block_table = seq.blocks, .n_ctx = t1};
        int32_t last = t1 - t0 - 1;
        kn_batch b = {.n_tokens = t1 - t0,
                      .tokens = ids + t0,
                      .pos = pos + t0,
                      .seq_of = seq_of,
                      .n_seqs = 1,
                      .seqs = &view,
                      .n_logits = t1 == n_prompt,
                      .logit_rows = &last};
        if ((rc = kn_engine_forward(e, kv, &b, logits))) break;
        for (int s = 0; s < o.stages && !rc; s++) {
            while ((rc = kvx_pf_send_chunk(c[s], o.req, (uint32_t)k, (uint32_t)t0, (uint32_t)t1,
                                           seq.blocks, (uint32_t)seq.n_blocks)) == TD_ENOSPC)
                progress_for(c, o.stages, 5);
        }
        /* "CHUNK k" only once every rank accepted every stage: from then on a kill is
         * seen by the decode side as a writer that died */
        int64_t end = td_now_ms() + o.timeout_ms;
        for (bool ready = false; !rc && !ready && td_now_ms() < end;) {
            ready = true;
            for (int s = 0; s < o.stages; s++) {
                kvx_pf_status st = {0};
                if (kvx_pf_poll(c[s], o.req, &st)) rc = TD_EIO;
                if (final(st.state) || st.state == KVX_REQ_ABORTING) rc = TD_EIO;
                ready = ready && st.n_accepted == st.n_targets;
            }
            if (!ready) progress_for(c, o.stages, 1);
        }
        printf("CHUNK %d\n", k);
        fflush(stdout);
        progress_for(c, o.stages, o.delay_ms);
    }
    kn_sampler smp;
    int32_t first = -1;
    if (!rc && !(rc = kn_sampler_init(&smp, &o.sp, m->hp.n_vocab))) {
        first = kn_sample(&smp, logits, ids, n_prompt, o.sp.skip_samples);
        kn_sampler_fini(&smp);
    }
    printf("FIRST %d\n", first);
    fflush(stdout);
    for (int s = 0; s < o.stages && !rc; s++) {
        kvx_meta meta = {.first_token = s == o.stages - 1 ? first : -1,
                         .n_tokens = (uint32_t)n_prompt};
        rc = kvx_pf_finish(c[s], o.req, &meta);
    }
    if (rc)
        for (int s = 0; s < o.stages; s++)
            kvx_pf_abort(c[s], o.req);
    int64_t end = td_now_ms() + o.timeout_ms + 5000;
    bool all_done = true;
    for (int s = 0; s < o.stages; s++) {
        kvx_pf_status st = {0};
        while (kvx_pf_poll(c[s], o.req, &st) == 0 && !final(st.state) && td_now_ms() < end)
            progress_for(c, o.stages, 2);
        printf("DONE %s %d\n", kvx_req_state_name(st.state), (int)st.reason);
        all_done = all_done && st.state == KVX_REQ_DONE;
        kvx_pf_release(c[s], o.req);
    }
    fflush(stdout);
    for (int s = 0; s < o.stages; s++)
        kvx_conn_destroy(c[s]);
    for (int t = 0; t < n_tg; t++)
        free(tg[t]);
    free(logits);
    free(pos);
    free(seq_of);
    free(ids);
    kn_kv_seq_fini(mem, &seq);
    kn_kv_mem_destroy(mem);
    kn_engine_destroy(e);
    kn_cpu_destroy(cpu);
    kn_model_destroy(m);
    td_gguf_close(g);
    return rc || !all_done ? 1 : 0;
}
