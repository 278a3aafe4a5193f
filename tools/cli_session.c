/* cli_session.c: loading a whole model into one process, and chunked prefill. */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "act_check.h"
#include "cli.h"
#include "td_args.h"
#include "td_err.h"
#include "td_grow.h"

int cli_session_open(cli_session *s, const cli_session_params *p)
{
    memset(s, 0, sizeof *s);
    kn_runtime_params rp = {.model_path = p->model_path,
                            .backend = p->backend,
                            .backend_opts = {.n_threads = p->threads, .device = -1}};
    int rc = kn_act_runtime_open(&s->rt, &rp);
    if (rc) return rc;
    if ((rc = td_tok_create(s->rt.gguf, &s->tok))) {
        if (p->need_tokenizer) {
            fprintf(stderr, "tandem: cannot build the tokenizer of '%s': %s\n", p->model_path,
                    td_strerror(rc));
            goto fail;
        }
        s->tok = NULL;
    }
    s->ctx = p->ctx ? p->ctx : s->rt.model->hp.n_ctx_train;
    if (!p->ctx && s->ctx > 8192) s->ctx = 8192;
    int bs = p->block_size ? p->block_size : 16;
    int n_blocks = (s->ctx + bs - 1) / bs;
    kn_kv_pool_params kp = kn_model_kv_params(s->rt.model, n_blocks, bs, p->kv_type);
    kp.backend = &s->rt.be;
    if ((rc = kn_kv_mem_create(&kp, &s->mem))) goto fail;
    s->kv = kn_kv_mem_pool(s->mem);
    return 0;
fail:
    cli_session_close(s);
    return rc;
}

void cli_session_close(cli_session *s)
{
    kn_kv_mem_destroy(s->mem);
    if (s->tok) td_tok_destroy(s->tok);
    kn_runtime_close(&s->rt);
    memset(s, 0, sizeof *s);
}

int cli_prefill(cli_session *s, kn_kv_seq *seq, const int32_t *ids, int64_t n, int64_t start_pos,
                int chunk, float *logits, float *hidden)
{
    if (chunk <= 0) chunk = 512;
    int32_t *pos = malloc((size_t)chunk * sizeof *pos);
    int32_t *seq_of = calloc((size_t)chunk, sizeof *seq_of);
    if (!pos || !seq_of) {
        free(pos);
        free(seq_of);
        return TD_ENOMEM;
    }
    int rc = 0;
    for (int64_t done = 0; done < n && !rc;) {
        int64_t len = n - done < chunk ? n - done : chunk;
        int64_t end = start_pos + done + len;
        if ((rc = kn_kv_seq_reserve(s->mem, seq, end))) break;
        for (int64_t i = 0; i < len; i++)
            pos[i] = (int32_t)(start_pos + done + i);
        kn_seq_view view = {.block_table = seq->blocks, .n_ctx = (int32_t)end};
        int32_t last = (int32_t)(len - 1);
        bool final = done + len == n;
        kn_batch b = {
            .n_tokens = len,
            .tokens = ids + done,
            .pos = pos,
            .seq_of = seq_of,
            .n_seqs = 1,
            .seqs = &view,
            .n_logits = final ? 1 : 0,
            .logit_rows = &last,
            .hidden_out = hidden ? hidden + done * s->rt.model->hp.n_embd : NULL,
        };
        rc = kn_engine_forward(s->rt.engine, s->kv, &b, logits);
        done += len;
    }
    free(pos);
    free(seq_of);
    return rc;
}

int cli_parse_int(const char *flag, const char *v, long lo, long hi, int *out)
{
    return td_args_int("tandem", flag, v, lo, hi, out);
}

int cli_parse_float(const char *flag, const char *v, float *out)
{
    char *end;
    errno = 0;
    float x = v ? strtof(v, &end) : 0;
    if (!v || errno || *end || end == v || x != x) {
        fprintf(stderr, "tandem: %s needs a number, got '%s'\n", flag, v ? v : "");
        return TD_EINVAL;
    }
    *out = x;
    return 0;
}

int cli_parse_u64(const char *flag, const char *v, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long x = v ? strtoull(v, &end, 10) : 0;
    if (!v || errno || *end || end == v || v[0] == '-') {
        fprintf(stderr, "tandem: %s needs a non-negative integer, got '%s'\n", flag, v ? v : "");
        return TD_EINVAL;
    }
    *out = x;
    return 0;
}

int cli_parse_ids(const char *v, int32_t **ids, int64_t *n)
{
    *ids = NULL;
    *n = 0;
    size_t cap = 0;
    int32_t *a = NULL;
    const char *p = v;
    while (*p) {
        while (*p == ',' || *p == ' ')
            p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (end == p || errno || x < 0 || x > INT32_MAX) {
            fprintf(stderr, "tandem: bad token id list near '%.20s'\n", p);
            free(a);
            return TD_EINVAL;
        }
        if (TD_GROW(a, cap, (size_t)*n + 1, 16)) {
            free(a);
            return TD_ENOMEM;
        }
        a[(*n)++] = (int32_t)x;
        p = end;
    }
    if (*n == 0) {
        fprintf(stderr, "tandem: empty token id list\n");
        free(a);
        return TD_EINVAL;
    }
    *ids = a;
    return 0;
}

int cli_parse_kv_type(const char *v, td_dtype *out)
{
    if (v && !strcmp(v, "f16"))
        *out = TD_F16;
    else if (v && !strcmp(v, "f32"))
        *out = TD_F32;
    else {
        fprintf(stderr, "tandem: --kv-type must be f16 or f32, got '%s'\n", v ? v : "");
        return TD_EINVAL;
    }
    return 0;
}

char *cli_read_file(const char *cmd, const char *path, size_t *len)
{
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f) {
        fprintf(stderr, "tandem %s: cannot open '%s': %s\n", cmd, path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n - 1, f);
        if (n < cap - 1) break;
        char *nb = cap < ((size_t)1 << 30) ? realloc(buf, cap * 2) : NULL;
        if (!nb) {
            free(buf);
            buf = NULL;
            fprintf(stderr, "tandem %s: '%s' is too large\n", cmd, path);
            break;
        }
        buf = nb;
        cap *= 2;
    }
    bool err = ferror(f);
    if (f != stdin) fclose(f);
    if (buf && err) {
        fprintf(stderr, "tandem %s: cannot read '%s'\n", cmd, path);
        free(buf);
        return NULL;
    }
    if (buf) buf[n] = '\0';
    *len = n;
    return buf;
}
