/* cmd_misc.c: `tandem logits` and `tandem dequant`: raw float32 dumps the reference tests
 * compare against the independent numpy/gguf implementation. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cpu_backend.h"
#include "sampler.h"
#include "td_err.h"

static int write_f32(const char *path, const float *x, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "tandem: cannot write '%s'\n", path);
        return TD_EIO;
    }
    size_t w = fwrite(x, sizeof *x, n, f);
    if (fclose(f) || w != n) {
        fprintf(stderr, "tandem: short write to '%s'\n", path);
        return TD_EIO;
    }
    return 0;
}

/* --mtp: the logits of the first token the model's MTP block (model.h kn_shard.mtp) proposes
 * after the prompt ids[0, n): the block reads rows p = 0..n, each the token x_p with the
 * trunk's hidden state of position p - 1 (zeros for p = 0), x_n the trunk's greedy token
 * after the prompt, and gives row n's logits (llama.cpp's draft-mtp: the prompt's process(),
 * then draft()). hidden: the trunk's (n, n_embd); logits in: the trunk's last, out: the MTP's. */
static int mtp_logits(cli_session *s, const int32_t *ids, int64_t n, const float *hidden,
                      float *logits)
{
    const kn_hparams *hp = &s->rt.model->hp;
    const int64_t E = hp->n_embd, rows = n + 1;
    kn_model *mm = NULL;
    kn_engine *me = NULL;
    kn_kv_mem *mem = NULL;
    kn_kv_seq seq;
    kn_kv_seq_init(&seq);
    int32_t *tok = malloc((size_t)rows * sizeof *tok), *pos = malloc((size_t)rows * sizeof *pos);
    int32_t *seq_of = calloc((size_t)rows, sizeof *seq_of);
    float *embd = calloc((size_t)(rows * E), sizeof *embd);
    int rc = tok && pos && seq_of && embd ? 0 : TD_ENOMEM;
    if (!rc) rc = kn_model_load(s->rt.gguf, &(kn_shard){.mtp = true}, &mm);
    if (!rc) rc = kn_engine_create(mm, s->rt.be, NULL, &me);
    if (!rc) {
        const int bs = 16;
        kn_kv_pool_params kp = kn_model_kv_params(mm, (int)((rows + bs - 1) / bs), bs, s->kv->type);
        kp.backend = &s->rt.be;
        rc = kn_kv_mem_create(&kp, &mem);
    }
    if (!rc) rc = kn_kv_seq_reserve(mem, &seq, rows);
    if (!rc) {
        int32_t next = kn_argmax(logits, hp->n_vocab); /* the trunk's greedy token after it */
        for (int64_t p = 0; p < rows; p++) {
            tok[p] = p < n ? ids[p] : next;
            pos[p] = (int32_t)p;
        }
        memcpy(embd + E, hidden, (size_t)(n * E) * sizeof *embd);
        kn_seq_view view = {.block_table = seq.blocks, .n_ctx = (int32_t)rows};
        int32_t last = (int32_t)n;
        kn_batch b = {.n_tokens = rows,
                      .tokens = tok,
                      .embd = embd,
                      .pos = pos,
                      .seq_of = seq_of,
                      .n_seqs = 1,
                      .seqs = &view,
                      .n_logits = 1,
                      .logit_rows = &last};
        rc = kn_engine_forward(me, kn_kv_mem_pool(mem), &b, logits);
    }
    if (rc) fprintf(stderr, "tandem: the MTP block failed: %s\n", td_strerror(rc));
    kn_kv_seq_fini(mem, &seq);
    kn_kv_mem_destroy(mem);
    kn_engine_destroy(me);
    kn_model_destroy(mm);
    free(tok);
    free(pos);
    free(seq_of);
    free(embd);
    return rc;
}

/* tandem logits --model PATH --prompt-ids IDS --out FILE [--kv-type] [--threads] [--chunk]
 *               [--mtp] */
int cmd_logits(int argc, char **argv)
{
    cli_session_params sp = {.kv_type = TD_F16};
    const char *ids_s = NULL, *out = NULL;
    int chunk = 512, rc = 0;
    bool mtp = false, odd = false;
    for (int i = 0; i < argc && !rc; i++) {
        const char *f = argv[i];
        if (!strcmp(f, "--mtp")) {
            mtp = true;
            continue;
        }
        if (i + 1 >= argc) {
            odd = true; /* a flag without its value */
            break;
        }
        const char *v = argv[++i];
        if (!strcmp(f, "--model"))
            sp.model_path = v;
        else if (!strcmp(f, "--prompt-ids"))
            ids_s = v;
        else if (!strcmp(f, "--out"))
            out = v;
        else if (!strcmp(f, "--kv-type"))
            rc = cli_parse_kv_type(v, &sp.kv_type);
        else if (!strcmp(f, "--threads"))
            rc = cli_parse_int(f, v, 1, 256, &sp.threads);
        else if (!strcmp(f, "--backend"))
            sp.backend = v;
        else if (!strcmp(f, "--chunk"))
            rc = cli_parse_int(f, v, 1, 1 << 20, &chunk);
        else {
            fprintf(stderr, "tandem: logits: unknown option '%s'\n", f);
            return TD_EINVAL;
        }
    }
    if (rc) return rc;
    if (odd || !sp.model_path || !ids_s || !out) {
        fprintf(stderr,
                "usage: tandem logits --model PATH --prompt-ids IDS --out FILE "
                "[--kv-type f16|f32] [--threads N] [--chunk N] [--backend cpu|cuda|cpu-dev] "
                "[--mtp]\n"
                "  --mtp: the logits of the model's multi-token prediction block's first\n"
                "         proposal after the prompt instead of the last position's\n");
        return TD_EINVAL;
    }
    int32_t *ids;
    int64_t n;
    if ((rc = cli_parse_ids(ids_s, &ids, &n))) return rc;
    cli_session s;
    if ((rc = cli_session_open(&s, &sp))) {
        free(ids);
        return rc;
    }
    kn_kv_seq seq;
    kn_kv_seq_init(&seq);
    float *logits = malloc((size_t)s.rt.model->hp.n_vocab * sizeof *logits);
    float *hidden = mtp ? malloc((size_t)(n * s.rt.model->hp.n_embd) * sizeof *hidden) : NULL;
    if (!logits || (mtp && !hidden))
        rc = TD_ENOMEM;
    else if (n > s.ctx) {
        fprintf(stderr, "tandem: %lld tokens do not fit the context (%d)\n", (long long)n, s.ctx);
        rc = TD_ERANGE;
    } else if ((rc = cli_prefill(&s, &seq, ids, n, 0, chunk, logits, hidden)))
        fprintf(stderr, "tandem: forward failed: %s\n", td_strerror(rc));
    else if (!mtp || !(rc = mtp_logits(&s, ids, n, hidden, logits)))
        rc = write_f32(out, logits, (size_t)s.rt.model->hp.n_vocab);
    free(logits);
    free(hidden);
    free(ids);
    kn_kv_seq_fini(s.mem, &seq);
    cli_session_close(&s);
    return rc;
}

/* tandem dequant --model PATH --tensor NAME --out FILE */
int cmd_dequant(int argc, char **argv)
{
    const char *path = NULL, *name = NULL, *out = NULL;
    for (int i = 0; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--model"))
            path = argv[i + 1];
        else if (!strcmp(argv[i], "--tensor"))
            name = argv[i + 1];
        else if (!strcmp(argv[i], "--out"))
            out = argv[i + 1];
        else {
            fprintf(stderr, "tandem: dequant: unknown option '%s'\n", argv[i]);
            return TD_EINVAL;
        }
    }
    if (argc % 2 || !path || !name || !out) {
        fprintf(stderr, "usage: tandem dequant --model PATH --tensor NAME --out FILE\n");
        return TD_EINVAL;
    }
    char err[512];
    td_gguf *g;
    int rc = td_gguf_open(path, &g, err, sizeof err);
    if (rc) {
        fprintf(stderr, "tandem: %s\n", err);
        return rc;
    }
    const td_gguf_tensor *t = td_gguf_find_tensor(g, name);
    if (!t) {
        fprintf(stderr, "tandem: no tensor '%s' in '%s'\n", name, path);
        td_gguf_close(g);
        return TD_ENOENT;
    }
    int64_t rows = t->ne[1] * t->ne[2] * t->ne[3], cols = t->ne[0];
    size_t rb = td_dtype_row_bytes(t->type, cols);
    float *x = malloc((size_t)(rows * cols) * sizeof *x);
    if (!x) rc = TD_ENOMEM;
    for (int64_t r = 0; r < rows && !rc; r++)
        rc = kn_dequant_row(t->type, (const char *)t->data + (size_t)r * rb, x + r * cols, cols);
    if (rc)
        fprintf(stderr, "tandem: cannot dequantize '%s' (%s): %s\n", name, td_dtype_name(t->type),
                td_strerror(rc));
    else
        rc = write_f32(out, x, (size_t)(rows * cols));
    free(x);
    td_gguf_close(g);
    return rc;
}
