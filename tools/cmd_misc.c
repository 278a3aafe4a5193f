/* cmd_misc.c: `tandem logits` and `tandem dequant`: raw float32 dumps the reference tests
 * compare against the independent numpy/gguf implementation. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cpu_backend.h"
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

/* tandem logits --model PATH --prompt-ids IDS --out FILE [--kv-type] [--threads] [--chunk] */
int cmd_logits(int argc, char **argv)
{
    cli_session_params sp = {.kv_type = TD_F16};
    const char *ids_s = NULL, *out = NULL;
    int chunk = 512, rc = 0;
    for (int i = 0; i + 1 < argc && !rc; i += 2) {
        const char *f = argv[i], *v = argv[i + 1];
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
    if (argc % 2 || !sp.model_path || !ids_s || !out) {
        fprintf(stderr,
                "usage: tandem logits --model PATH --prompt-ids IDS --out FILE "
                "[--kv-type f16|f32] [--threads N] [--chunk N] [--backend cpu|cuda|cpu-dev]\n");
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
    if (!logits)
        rc = TD_ENOMEM;
    else if (n > s.ctx) {
        fprintf(stderr, "tandem: %lld tokens do not fit the context (%d)\n", (long long)n, s.ctx);
        rc = TD_ERANGE;
    } else if ((rc = cli_prefill(&s, &seq, ids, n, 0, chunk, logits)))
        fprintf(stderr, "tandem: forward failed: %s\n", td_strerror(rc));
    else
        rc = write_f32(out, logits, (size_t)s.rt.model->hp.n_vocab);
    free(logits);
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
