/* pl_model.h: the planner's view of a model: the sizes that set its compute, memory and
 * traffic costs (matrix parameters per token, weight bytes, KV bytes per token, attention
 * FLOPs per query-key pair), read from a GGUF header or taken from a named shape.
 *
 * Purpose: the simulator (pl_sim.h) prices a forward from these numbers and a hardware
 * profile (pl_hw.h); nothing here runs the model.
 * Invariants: a filled pl_model has n_layer, n_embd > 0 and every size > 0; for a dense
 * model moe_expert_bytes = 0 and n_expert = 0.
 * Threading: pure functions. Ownership: plain values.
 */
#ifndef PL_MODEL_H
#define PL_MODEL_H

#include <stdbool.h>

typedef struct {
    char name[64];
    int n_layer, n_embd, n_head, n_head_kv;
    double layer_params;         /* matrix weights one token meets per layer, mean over layers */
    double head_params;          /* LM head (n_vocab x n_embd) */
    double weight_bytes;         /* all weights as stored, bytes */
    double embd_bytes;           /* the token embedding table when not tied (in weight_bytes): held,
                                  * but a forward reads only its rows */
    double moe_expert_bytes;     /* routed experts' bytes (in weight_bytes); 0 for dense */
    double moe_active_params;    /* the routed experts' matrix weights one token meets, all layers
                                    (in n_layer x layer_params); 0 for dense */
    int n_expert, n_expert_used; /* routed experts and experts per token; 0 for dense */
    double kv_bytes_token;       /* KV cache of one token, all layers, bytes */
    double attn_flops_pair;      /* FLOPs of one (query, key) pair in one layer: QK^T + PV */
    double act_bytes;            /* bytes per activation element on the wire (all-reduce, pp) */
} pl_model;

/* Names pl_model_named knows, NULL-terminated. */
extern const char *const pl_model_names[];

/* A named shape (pl_model_names). Returns 0 or TD_ENOENT (logged, with the known names). */
int pl_model_named(const char *name, pl_model *m);

/* The shape of a GGUF file from its header (kernels' loader, no tensor data read):
 * weights are counted from the tensor table as stored, the KV cache is f16 (Tandem's
 * default kv_type). Returns 0 or the loader's error (logged). */
int pl_model_gguf(const char *path, pl_model *m);

/* A name from pl_model_names, else a GGUF path. */
int pl_model_load(const char *name_or_path, pl_model *m);

/* Weight bytes one forward over `tokens` tokens reads: every dense weight but the embedding
 * table, and of the
 * routed experts the expected share touched, 1 - (1 - k/E)^tokens (uniform routing). */
double pl_model_weights_read(const pl_model *m, double tokens);

/* Matrix parameters one token meets: n_layer x layer_params + head_params. */
double pl_model_active_params(const pl_model *m);

/* Expert parallelism (decode[].ep: each of `ranks` ranks holds n_expert / ranks experts
 * whole) makes a step wait for the rank with the most expert work. For a step of `tokens`
 * tokens, each choosing n_expert_used distinct experts uniformly (the planner's routing), the
 * expected most on one rank over its mean, for the experts' bytes read (*mem: experts
 * touched) and for their products (*comp: token-expert choices). Both 1 for a dense model,
 * ranks 1 or tokens 0. The expected maximum of `ranks` equicorrelated counts is taken as
 * normal: mean + c_R sigma sqrt(1 - rho), c_R the expected maximum of R standard normals
 * (docs/planner.md "Expert parallelism"). */
void pl_model_ep_imbalance(const pl_model *m, int ranks, double tokens, double *mem, double *comp);

#endif
