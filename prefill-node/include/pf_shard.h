/* pf_shard.h: one pipeline stage's shard of the model, loaded in this process: the model
 * file, the stage's layer range, a CPU backend, the engine and the KV pool.
 *
 * Purpose: the one place that opens a stage for compute. The production stage
 * (pf_stage.c) opens its shard here, and so do the profiler (pf_profile.h), the profile
 * cache's key (pf_pcache.h), `tandem chunk-plan` and the tests' stand-in decode instance.
 * The layer range comes from the partition (pf_layer_partition: equal shares, the extra
 * layers on the later stages, or the YAML's explicit layer_partition).
 * Invariants: after pf_shard_open, model holds layers [l0, l1) and kv holds ctx tokens of
 * one sequence (ceil(ctx / block_size) blocks), head-major or sliced as the params ask
 * (kv->slicing says which); TP 1. The backend is the one the params
 * name (kernels/kn_runtime.h opens file, model, backend and engine).
 * Threading: the engine and pool are driven by one thread at a time (the stage's main
 * thread, or the profiler before the stage serves).
 * Ownership: the shard owns everything it points to; pf_shard_close frees it all.
 */
#ifndef PF_SHARD_H
#define PF_SHARD_H

#include "gguf.h"
#include "kn_runtime.h"
#include "kv_mem.h"
#include "model.h"
#include "td_dtype.h"

typedef struct {
    kn_runtime rt; /* file, model (layers [l0, l1)), backend, engine */
    kn_kv_mem *mem;   /* the stage's KV memory: blocks are allocated through it */
    kn_kv_pool *kv;   /* its pool (stable for the shard's life): the layout the engine and
                         kvxfer address */
    int l0, l1;       /* the stage's layer range */
    int ctx;          /* tokens of KV the pool holds for one sequence */
    int cache_blocks; /* blocks on top of ctx for the prefix cache (the same on every stage) */
    int threads;      /* compute threads of the backend */
    int pp, stage;
} pf_shard;

typedef struct {
    const char *model_path;
    int pp, stage;        /* pp 0 means 1 */
    const int *partition; /* (pp) explicit layer partition or NULL (pf_layer_partition) */
    int threads;          /* 0: 1 (one thread per stage process) */
    const char *backend;  /* "cpu" (NULL) or "cuda" (the YAML's backend) */
    const char *cpu_act;  /* "f32", "q8" or NULL (TANDEM_CPU_ACT): the YAML's cpu_act */
    const int *devices;   /* (pp) GPU index of each stage (prefill[].devices), or NULL: the
                             stage's number modulo the GPUs the process sees */
    int ctx;              /* KV capacity, tokens; 0: 8192 */
    int block_size;       /* 0: 16 */
    td_dtype kv_type;     /* TD_F32 (0) or TD_F16 */
    size_t cache_bytes;   /* prefix cache budget: cache_blocks = this over the block bytes of the
                             largest stage (K and V of its layers), so every stage of an
                             instance gets the same count; 0: none */
    int n_slices;         /* the KV pool's head slicing (kv_pool.h; pf_stage_slicing picks it
                             for the decode ranks): 0 or 1 head-major, else slices of
                             slice_heads[i] heads; a backend whose kernels take head-major
                             pools only (cuda) keeps head-major, logged */
    int slice_heads[KN_KV_MAX_SLICES];
} pf_shard_params;

/* Load the stage and build its engine and KV pool. Errors are logged; returns 0 or a
 * negative td_err (TD_EINVAL for a stage or partition that does not fit the model), and
 * *s is zeroed on failure. */
int pf_shard_open(pf_shard *s, const pf_shard_params *p);
void pf_shard_close(pf_shard *s); /* safe on a zeroed shard */

/* The model's hyperparameters from the GGUF header at path, without loading a tensor (the
 * layer count decides a stage's range, the head counts its pool's slicing). 0 or a negative
 * td_err, logged. */
int pf_model_hparams(const char *path, kn_hparams *hp);

#endif
