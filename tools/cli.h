/* cli.h: shared pieces of the `tandem` command-line tool: argument parsing helpers and a
 * single-process "session" (model file, full shard, backend, engine: a kn_runtime; KV
 * pool, tokenizer) that generate, logits and bench build on.
 *
 * Ownership: cli_session_open/close own everything inside the session.
 * Errors: every failure is printed to stderr once, as "tandem: ..." and returned as a
 * negative td_err; main turns it into exit status 1.
 */
#ifndef TANDEM_CLI_H
#define TANDEM_CLI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gguf.h"
#include "kn_runtime.h"
#include "kv_mem.h"
#include "model.h"
#include "tokenizer.h"

typedef struct {
    const char *model_path;
    int threads;         /* 0: all cores */
    const char *backend; /* --backend: "cpu" (NULL) or "cuda" */
    td_dtype kv_type;    /* TD_F16 default */
    int ctx;             /* context length of the session; 0: min(model's, 8192) */
    int block_size;      /* 0: 16 */
    bool need_tokenizer;
} cli_session_params;

typedef struct {
    kn_runtime rt;     /* file, model, backend, engine */
    kn_kv_mem *mem;    /* the session's KV memory: blocks come from it */
    kn_kv_pool *kv;    /* its pool (stable): the layout the engine addresses */
    td_tokenizer *tok; /* NULL when not needed and absent */
    int ctx;
} cli_session;

int cli_session_open(cli_session *s, const cli_session_params *p);
void cli_session_close(cli_session *s);

/* Run ids[0..n) of one sequence through the model in chunks of `chunk` tokens starting
 * at position start_pos; writes the logits of the last token into logits (n_vocab) and, when
 * hidden is not NULL, every token's normed final hidden state into it (n, n_embd:
 * kn_batch.hidden_out). */
int cli_prefill(cli_session *s, kn_kv_seq *seq, const int32_t *ids, int64_t n, int64_t start_pos,
                int chunk, float *logits, float *hidden);

/* Argument helpers: return 0 and store, or print "tandem: bad value for --x" and return
 * TD_EINVAL. */
int cli_parse_int(const char *flag, const char *v, long lo, long hi, int *out);
int cli_parse_float(const char *flag, const char *v, float *out);
int cli_parse_u64(const char *flag, const char *v, uint64_t *out);
/* "1,2,3" or "1 2 3" -> malloc'd ids. */
int cli_parse_ids(const char *v, int32_t **ids, int64_t *n);
/* The whole of a file ('-': stdin), NUL-terminated (*len bytes before the NUL); NULL with
 * "tandem CMD: ..." on stderr when it cannot be read or is over 1 GiB. */
char *cli_read_file(const char *cmd, const char *path, size_t *len);
int cli_parse_kv_type(const char *v, td_dtype *out);

int cmd_generate(int argc, char **argv);
int cmd_logits(int argc, char **argv);
int cmd_dequant(int argc, char **argv);
int cmd_bench_engine(int argc, char **argv);
int cmd_client(int argc, char **argv);
int cmd_up(int argc, char **argv);         /* tandem up [-d] FILE (cmd_up.c) */
int cmd_down(int argc, char **argv);       /* tandem down FILE */
int cmd_status(int argc, char **argv);     /* tandem status FILE [--json] */
int cmd_bench(int argc, char **argv);      /* tandem bench: HTTP load generator (cmd_loadgen.c) */
int cmd_chunk_plan(int argc, char **argv); /* tandem chunk-plan (cmd_chunkplan.c) */
int cmd_plan(int argc, char **argv);       /* tandem plan (cmd_plan.c, planner/) */
int cmd_calibrate(int argc, char **argv);  /* tandem calibrate (cmd_plan.c, planner/) */
int cmd_template(int argc, char **argv);   /* tandem template (cmd_template.c, jinja/) */
int cmd_tokenize(int argc, char **argv);   /* tandem tokenize (cmd_tokenize.c) */
int cmd_k8s(int argc, char **argv);        /* tandem k8s render (cmd_k8s.c) */
int cmd_health(int argc, char **argv);     /* tandem health URL (cmd_health.c) */

#endif
