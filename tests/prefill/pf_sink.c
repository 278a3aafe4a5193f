/* pf_sink.c: a stand-in for a decode instance, to test tandem-prefill on its own.
 *
 * It computes the prompt's KV and the greedy first token with the whole model in this
 * process (the reference), plays `tp` decode ranks (one kvxfer connector each, holding
 * its head slice of a KV region, blocks in scrambled order), sends Prefill (with the
 * targets, or the targets later with KvTarget, or never) to a prefill instance, waits for
 * PrefillDone / ErrorEvent and the kvxfer notices, and compares the received KV and first
 * token with the reference.
 *
 * usage: pf_sink --model M --url URL --tokens N [--tp K] [--tls T] [--late-targets]
 *                [--no-targets] [--expect-error] [--id R] [--timeout MS] [--no-check]
 * --penalties sends greedy sampling with presence and frequency penalties of -2 and
 * skip_samples = N/2 (a moved request: the last N/2 prompt tokens are its output), which the
 * last stage must count; the reference samples the same way and must differ from the plain
 * greedy token (else the run could not tell a stage that ignores them).
 * --no-check skips the reference (benchmarks: tools/bench_prefill.py); the line then
 * reports the time from sending Prefill to PrefillDone and to the last rank's KV.
 * Prints one line "ok ..." or "error CODE ..." and exits 0 when the outcome is the one
 * expected, 1 otherwise.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ctrl.h"
#include "kvx_conn.h"
#include "td_tp.h"
#include "pf_profile.h"
#include "sampler.h"
#include "td_clock.h"
#include "td_dtype.h"
#include "td_err.h"

#define MAXTP 8

static float elem(const kn_kv_pool *kv, int layer, int v, int block, int head, int t, int d)
{
    size_t idx = (((size_t)block * (size_t)kv->n_kv_heads + (size_t)head) * (size_t)kv->block_size +
                  (size_t)t) *
                     (size_t)kv->head_dim +
                 (size_t)d;
    const void *base = v ? kv->v[layer] : kv->k[layer];
    return kv->type == TD_F16 ? td_fp16_to_fp32(((const uint16_t *)base)[idx])
                              : ((const float *)base)[idx];
}

static float dst_elem(const uint8_t *region, const kvx_layout *l, int layer, int v, int block,
                      int head, int t, int d)
{
    size_t per = (size_t)l->n_blocks * l->n_heads * l->block_size * l->head_dim;
    size_t idx =
        ((size_t)kvx_layout_arrays(l) * (size_t)layer + (size_t)v % kvx_layout_arrays(l)) * per +
        (((size_t)block * l->n_heads + (size_t)head) * l->block_size + (size_t)t) * l->head_dim +
        (size_t)d;
    return l->dtype_size == 2 ? td_fp16_to_fp32(((const uint16_t *)region)[idx])
                              : ((const float *)region)[idx];
}

int main(int argc, char **argv)
{
    const char *model = NULL, *url = NULL, *tls = "sm,tcp,self";
    int n_tok = 0, tp = 1, timeout = 20000;
    int late = 0, never = 0, expect_error = 0, no_check = 0, penalties = 0;
    uint64_t id = 77;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(a, "--model"))
            model = v, i++;
        else if (!strcmp(a, "--url"))
            url = v, i++;
        else if (!strcmp(a, "--tls"))
            tls = v, i++;
        else if (!strcmp(a, "--tokens"))
            n_tok = atoi(v), i++;
        else if (!strcmp(a, "--tp"))
            tp = atoi(v), i++;
        else if (!strcmp(a, "--id"))
            id = strtoull(v, NULL, 10), i++;
        else if (!strcmp(a, "--timeout"))
            timeout = atoi(v), i++;
        else if (!strcmp(a, "--late-targets"))
            late = 1;
        else if (!strcmp(a, "--no-targets"))
            never = 1;
        else if (!strcmp(a, "--expect-error"))
            expect_error = 1;
        else if (!strcmp(a, "--no-check"))
            no_check = 1;
        else if (!strcmp(a, "--penalties"))
            penalties = 1;
        else {
            fprintf(stderr, "pf_sink: unknown option %s\n", a);
            return 2;
        }
    }
    if (!model || !url || n_tok < 1 || tp < 1 || tp > MAXTP) {
        fprintf(stderr, "usage: see pf_sink.c\n");
        return 2;
    }
    /* the reference: the whole model in this process */
    pf_shard shard;
    pf_shard_params rp = {
        .model_path = model, .pp = 1, .ctx = n_tok + 64, .block_size = 16, .kv_type = TD_F16};
    if (pf_shard_open(&shard, &rp)) return 2;
    const kn_hparams *hp = &shard.rt.model->hp;
    int32_t *prompt = malloc((size_t)n_tok * sizeof *prompt), *pos = malloc((size_t)n_tok * 4);
    int32_t *seq0 = calloc((size_t)n_tok, 4);
    for (int i = 0; i < n_tok; i++) {
        prompt[i] = (int32_t)((i * 7919u + 13u) % (unsigned)(hp->n_vocab - 1)) + 1;
        pos[i] = i;
    }
    kn_kv_seq seq;
    kn_kv_seq_init(&seq);
    if (kn_kv_seq_reserve(shard.mem, &seq, n_tok)) return 2;
    kn_seq_view view = {.block_table = seq.blocks, .n_ctx = n_tok};
    int32_t last = n_tok - 1;
    float *logits = malloc((size_t)hp->n_vocab * sizeof *logits);
    kn_batch b = {.n_tokens = n_tok,
                  .tokens = prompt,
                  .pos = pos,
                  .seq_of = seq0,
                  .n_seqs = 1,
                  .seqs = &view,
                  .n_logits = 1,
                  .logit_rows = &last};
    int32_t expect_tok = -1;
    td_sampling sp = {0};
    if (penalties)
        sp = (td_sampling){
            .presence_penalty = -2, .frequency_penalty = -2, .skip_samples = (uint32_t)n_tok / 2};
    if (!no_check) {
        if (kn_engine_forward(shard.rt.engine, shard.kv, &b, logits)) return 2;
        kn_sampler smp, plain;
        td_sampling sp0 = {0};
        kn_sampler_init(&smp, &sp, hp->n_vocab);
        kn_sampler_init(&plain, &sp0, hp->n_vocab);
        expect_tok = kn_sample(&smp, logits, prompt, n_tok, sp.skip_samples);
        int32_t plain_tok = kn_sample(&plain, logits, prompt, n_tok, 0);
        kn_sampler_fini(&smp);
        kn_sampler_fini(&plain);
        if (penalties && expect_tok == plain_tok) {
            printf("error: the penalties do not change the first token (%d): pick another "
                   "--tokens\n",
                   plain_tok);
            return 1;
        }
    }

    /* the decode ranks */
    int bs = 16, nb = (n_tok + bs - 1) / bs, n_blocks = nb + 5;
    int32_t blocks[MAXTP][4096];
    if (nb > 4096) return 2;
    kvx_conn *conn[MAXTP];
    kvx_layout lay[MAXTP];
    uint8_t *region[MAXTP];
    ProtobufCBinaryData targets[MAXTP];
    static uint8_t tbuf[MAXTP][65536];
    for (int r = 0; r < tp; r++) {
        kvx_pipe *pipe;
        kvx_pipe_params pp = {.tls = tls};
        if (kvx_pipe_ucx_create(&pp, &pipe)) return 2;
        kvx_conn_params cp = {.timeout_ms = timeout, .progress_thread = true};
        if (kvx_conn_create(pipe, &cp, &conn[r])) return 2;
        td_tp_heads th;
        if (td_tp_heads_of_rank(hp->n_head, hp->n_head_kv, tp, r, &th)) return 2;
        uint32_t h0 = (uint32_t)th.kv0, nh = (uint32_t)th.n_kv;
        lay[r] = (kvx_layout){.layer0 = 0,
                              .n_layers = (uint32_t)hp->n_layer,
                              .n_kv_heads = (uint32_t)hp->n_head_kv,
                              .head0 = h0,
                              .n_heads = nh,
                              .block_size = (uint32_t)bs,
                              .head_dim = (uint32_t)hp->head_dim,
                              .dtype_size = 2,
                              .n_blocks = (uint32_t)n_blocks,
                              .kv_arrays = hp->kv_lora_rank > 0 ? 1 : 2}; /* the model's */
        region[r] = calloc(1, kvx_layout_bytes(&lay[r]));
        if (kvx_dec_register(conn[r], region[r], kvx_layout_bytes(&lay[r]), &lay[r])) return 2;
        for (int i = 0; i < nb; i++)
            blocks[r][i] = (int32_t)((i * 3 + 2) % n_blocks); /* scrambled (3 is coprime) */
        if (n_blocks % 3 == 0)
            for (int i = 0; i < nb; i++)
                blocks[r][i] = n_blocks - 1 - i;
        kvx_dec_req_params dp = {.n_stages = 0,
                                 .rank = (uint32_t)r,
                                 .tp = (uint32_t)tp,
                                 .blocks = blocks[r],
                                 .n_blocks = (uint32_t)nb,
                                 .timeout_ms = timeout};
        size_t len;
        /* n_stages: asked from the instance's pp, passed in the URL-less way: the test
         * gives it in the environment */
        const char *ns = getenv("PF_SINK_STAGES");
        dp.n_stages = ns ? (uint32_t)atoi(ns) : 1;
        if (kvx_dec_make_target(conn[r], id, &dp, tbuf[r], sizeof tbuf[r], &len)) return 2;
        targets[r] = (ProtobufCBinaryData){len, tbuf[r]};
    }

    td_ctrl_client *cli;
    td_ctrl_opts co = {0};
    if (td_ctrl_client_create(url, &co, &cli)) return 2;
    Td__Sampling samp;
    td_ctrl_sampling_to_pb(&sp, &samp);
    Td__Prefill pf = TD__PREFILL__INIT;
    pf.request_id = id;
    pf.n_token_ids = (size_t)n_tok;
    pf.token_ids = prompt;
    pf.sampling = &samp;
    pf.decode_instance = "sink";
    pf.n_decode_ranks = (uint32_t)tp;
    if (!late && !never) {
        pf.n_kv_targets = (size_t)tp;
        pf.kv_targets = targets;
    }
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.body_case = TD__ENVELOPE__BODY_PREFILL;
    e.prefill = &pf;
    uint64_t call, tcall = 0;
    td_ctrl_client_call(cli, &e, 10000, &call);
    int64_t t0 = td_now_ms();
    int got = 0, code = 0, first = -1;
    int64_t t_done = 0, t_kv = 0;
    char msg[512] = "";
    td_ctrl_client_in in = {0};
    while (!got && td_now_ms() - t0 < 3 * timeout + 10000) {
        if (td_ctrl_client_recv(cli, &in, 100)) continue;
        if (in.kind == TD_CTRL_IN_REPLY && in.call_id == call) {
            if (in.err || in.env->body_case == TD__ENVELOPE__BODY_ERROR) {
                code = in.err ? -1 : (int)in.env->error->code;
                snprintf(msg, sizeof msg, "%s",
                         in.err ? td_strerror(in.err) : in.env->error->message);
                got = 1;
            } else if (late) {
                usleep(200000);
                Td__KvTarget kt = TD__KV_TARGET__INIT;
                kt.request_id = id;
                kt.n_kv_targets = (size_t)tp;
                kt.kv_targets = targets;
                Td__Envelope e2 = TD__ENVELOPE__INIT;
                e2.body_case = TD__ENVELOPE__BODY_KV_TARGET;
                e2.kv_target = &kt;
                td_ctrl_client_call(cli, &e2, 10000, &tcall);
            }
        } else if (in.kind == TD_CTRL_IN_EVENTS) {
            for (size_t i = 0; i < in.n_events; i++) {
                Td__Event *ev = in.events[i];
                if (ev->body_case == TD__EVENT__BODY_PREFILL_DONE &&
                    ev->prefill_done->request_id == id) {
                    first = ev->prefill_done->first_token;
                    t_done = td_now_ms();
                    int off = snprintf(msg, sizeof msg, "chunks");
                    for (size_t k = 0; k < ev->prefill_done->n_chunk_sizes && off < 400; k++)
                        off += snprintf(msg + off, sizeof msg - (size_t)off, " %u",
                                        ev->prefill_done->chunk_sizes[k]);
                    got = 1;
                } else if (ev->body_case == TD__EVENT__BODY_ERROR && ev->error->request_id == id) {
                    code = (int)ev->error->code;
                    snprintf(msg, sizeof msg, "%s", ev->error->message);
                    got = 1;
                }
            }
        }
    }
    td_ctrl_client_in_free(&in);
    int ok = 1;
    if (!got) {
        printf("error timeout: no answer from the prefill instance\n");
        ok = 0;
    } else if (code) {
        printf("error %d %s\n", code, msg);
        ok = expect_error;
    } else {
        /* the decode ranks' view: every stage's notice, then compare the KV */
        double maxd = 0, maxref = 0;
        for (int r = 0; r < tp && ok; r++) {
            kvx_dec_status st;
            int64_t t1 = td_now_ms();
            while (!kvx_dec_poll(conn[r], id, &st) && st.state != KVX_REQ_DONE &&
                   st.state != KVX_REQ_FAILED && td_now_ms() - t1 < timeout)
                usleep(2000);
            if (st.state != KVX_REQ_DONE) {
                printf("error rank %d transfer %s\n", r, kvx_req_state_name(st.state));
                ok = 0;
                break;
            }
            if (st.meta[st.n_stages - 1].first_token != first) {
                printf("error rank %d notice first token %d, event %d\n", r,
                       st.meta[st.n_stages - 1].first_token, first);
                ok = 0;
            }
            t_kv = td_now_ms();
            for (int l = 0; !no_check && l < hp->n_layer; l++)
                for (int v = 0; v < 2; v++)
                    for (int t = 0; t < n_tok; t++)
                        for (uint32_t h = 0; h < lay[r].n_heads; h++)
                            for (int d = 0; d < hp->head_dim; d++) {
                                float ref = elem(shard.kv, l, v, seq.blocks[t / bs],
                                                 (int)(lay[r].head0 + h), t % bs, d);
                                float got_v = dst_elem(region[r], &lay[r], l, v, blocks[r][t / bs],
                                                       (int)h, t % bs, d);
                                double dd = fabs((double)ref - got_v);
                                if (dd > maxd) maxd = dd;
                                if (fabs(ref) > maxref) maxref = fabs(ref);
                            }
        }
        if (ok && no_check) {
            printf("ok ttft_ms %lld kv_ms %lld %s\n", (long long)(t_done - t0),
                   (long long)(t_kv - t0), msg);
        } else if (ok) {
            int kv_ok = maxd <= 1e-2 * maxref + 1e-3;
            printf("%s first_token %d expected %d kv_max_diff %.3g (max |kv| %.3g) %s\n",
                   kv_ok && first == expect_tok ? "ok" : "error mismatch", first, expect_tok, maxd,
                   maxref, msg);
            ok = kv_ok && first == expect_tok && !expect_error;
        }
    }
    (void)tcall;
    td_ctrl_client_destroy(cli);
    for (int r = 0; r < tp; r++) {
        kvx_conn_destroy(conn[r]);
        free(region[r]);
    }
    kn_kv_seq_fini(shard.mem, &seq);
    pf_shard_close(&shard);
    free(prompt);
    free(pos);
    free(seq0);
    free(logits);
    return ok ? 0 : 1;
}
