/* kn_runtime.h: one shard of a model opened for compute: the GGUF file, the shard's
 * weights, the backend and the engine.
 *
 * Purpose: the one place a model is opened for compute: the CLI (tools/cli_session.c), a
 * decode rank (decode-node/dc_node.c), a prefill stage and its profiler
 * (prefill-node/pf_shard.c). Each caller then makes the KV pool it needs (the sizes are
 * the caller's policy: a context length, a memory budget, a shared segment), with
 * kn_model_kv_params and kv_pool.backend = &rt->be.
 * Errors: logged (prefixed with params.who), returned as a negative td_err; the backend's
 * own refusal (kn_backend_create: "cuda" without a usable GPU) passes through unchanged.
 * Ownership: kn_runtime_open fills *rt, which owns everything in it; kn_runtime_close
 * frees it (safe on a zeroed or half-opened runtime). The collective is borrowed.
 */
#ifndef KN_RUNTIME_H
#define KN_RUNTIME_H

#include "gguf.h"
#include "kn_backends.h"
#include "model.h"

typedef struct {
    td_gguf *gguf;
    kn_model *model;
    kn_backend be;
    kn_engine *engine;
} kn_runtime;

typedef struct {
    const char *model_path;
    kn_shard shard;                  /* layers and TP slice ({0}: the whole model) */
    const char *backend;             /* "cpu" (NULL) or "cuda" */
    kn_backend_options backend_opts; /* threads (cpu), device (cuda); a cpu_act of "auto"
                                      * only through kn_act_runtime_open (act_check.h) */
    const kn_collective *coll;       /* needed when shard.tp_size > 1 */
    const char *who;                 /* log prefix ("decode d0 rank 1"); NULL: "tandem" */
} kn_runtime_params;

int kn_runtime_open(kn_runtime *rt, const kn_runtime_params *p);
void kn_runtime_close(kn_runtime *rt);

#endif
