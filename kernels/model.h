/* model.h: a model shard (layer range x tensor-parallel slice) loaded from GGUF, and the
 * engine that runs its forward pass over a batch against a paged KV pool.
 *
 * Purpose: the one compute path shared by prefill stages, decode ranks and the CLI.
 * A shard is layers [l0, l1) x TP slice (rank, size): the first stage (l0 == 0) embeds
 * tokens, the last stage (l1 == n_layer) applies the final norm and the LM head; middle
 * stages take and return hidden states. TP slices hold the query heads and KV heads
 * common/td_tp.h assigns to the rank (Q/K/V rows), rows of gate/up, and the matching
 * input columns of attn_output/ffn_down (fused attn_qkv and phi3's fused gate/up ffn_up are
 * viewed as their separate parts, row ranges of one tensor); the
 * engine calls the collective's allreduce_sum twice per layer so ranks stay identical.
 * The last stage's LM head is vocab-parallel: rank r holds output rows [v0, v1) with
 * v0 = r * n_vocab / tp (the even split, kn_split_even), computes that slice of the logits
 * and the collective's gather_cols assembles the whole logits on rank 0, the rank that
 * samples (the other ranks get none). token_embd stays whole for the first stage's lookup.
 * Splitting is exact: PP stages and TP slices compose to the unsplit model's logits up to
 * float reassociation.
 * TP needs tp to divide the head count; KV heads shared by the query heads of several
 * ranks are replicated (td_tp.h), so tp may exceed the KV-head count. The FFN is split evenly when
 * tp divides it into whole 32-weight blocks, else in whole 32-blocks with ranks differing by one
 * block (n_ff_local is per rank); a mixture-of-experts layer splits each expert's FFN (and the
 * shared experts') the same way, so every rank holds a slice of every expert, and the router
 * whole (tensor-parallel experts; expert parallelism is not built). A row-parallel slice that cuts
 * through a quant block (256-weight K types) is re-quantized to Q8_0 at load (docs/architecture.md:
 * effect). Invariants: weights are views into the GGUF mapping (never copied, except small 1-D
 * tensors converted to float32 and re-quantized slices); a loaded model is read-only. Threading: a
 * kn_model may be shared by engines; a kn_engine is driven by one thread. Ownership: kn_model
 * borrows the td_gguf (keep it open until kn_model_destroy); kn_engine borrows the model, the
 * backend and the collective.
 */
#ifndef KN_MODEL_H
#define KN_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "gguf.h"
#include "td_tp.h"
#include "kn_backend.h"
#include "kv_pool.h"

typedef enum {
    KN_ARCH_LLAMA,
    KN_ARCH_QWEN2,
    KN_ARCH_QWEN3,
    KN_ARCH_GEMMA3,
    KN_ARCH_SMOLLM3,
    KN_ARCH_GRANITE,
    KN_ARCH_PHI3,
    KN_ARCH_OLMO2,
    KN_ARCH_QWEN3MOE,
    KN_ARCH_DEEPSEEK2,
    KN_ARCH_GEMMA2,
} kn_arch;

/* How a mixture-of-experts router turns its logits into probabilities (llama.cpp's
 * expert_gating_func values). */
typedef enum {
    KN_MOE_SOFTMAX = 1,
    KN_MOE_SIGMOID = 2,
} kn_moe_gating;

typedef struct {
    kn_arch arch;
    int n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, n_vocab, n_ctx_train;
    int n_rot; /* rotated dims per head */
    float rope_base;
    float rope_scale; /* linear scaling factor (positions divided by it); 1 = none */
    /* YaRN (deepseek2 only; yarn_factor 0: none): pair i's frequency is mixed between the
     * interpolated (/ factor) and the original by a ramp over the pairs (model_load.c) */
    float yarn_factor, yarn_log_mul; /* rope.scaling.factor; yarn_log_multiplier / 0.1 */
    int yarn_orig_ctx;               /* rope.scaling.original_context_length */
    bool rope_neox;                  /* qwen: pairs (i, i+n_rot/2); llama: (2i, 2i+1) */
    float rms_eps;
    bool tied_embd; /* no output.weight: the LM head is token_embd */
    /* gemma3 and gemma2 (1 and 0 / false elsewhere): */
    float embd_scale;     /* token embeddings are multiplied by it (gemma: sqrt(n_embd)) */
    float attn_scale;     /* scores are q.k * attn_scale (1/sqrt(head_dim) by default) */
    bool gelu_ffn;        /* FFN is gelu(gate) * up instead of silu(gate) * up */
    bool post_norms;      /* sandwich norms after attention and after the FFN */
    int swa_window;       /* > 0: sliding-window layers see this many positions */
    int swa_pattern;      /* layer il is global when il % swa_pattern == swa_pattern - 1 */
    float rope_base_swa;  /* rope base of the sliding-window layers */
    float rope_scale_swa; /* their linear rope scaling (gemma3: 1; gemma2: rope_scale) */
    /* gemma2's soft-caps (0 elsewhere: none): */
    float attn_softcap;  /* scores s (q.k * attn_scale) -> attn_softcap * tanh(s / attn_softcap) */
    float final_softcap; /* logits l -> final_softcap * tanh(l / final_softcap), the last step */
    /* the other architectures' switches (neutral values elsewhere: 0, 1, false) */
    int nope_step;        /* smollm3: layer il skips rope when (il + 1) % nope_step == 0 */
    float residual_scale; /* granite: block outputs are multiplied by it before each add */
    float logit_scale;    /* granite: logits are multiplied by 1 / logit_scale */
    bool no_pre_norms;    /* olmo2: no attn_norm / ffn_norm, the blocks read x itself */
    bool qk_norm_whole;   /* olmo2: Q and K RMSNorm over the whole projection, not per head */
    /* mixture of experts (n_expert 0: every layer's FFN is dense) */
    int n_expert, n_expert_used;       /* experts of a MoE layer; how many each token takes */
    int n_ff_exp;                      /* one expert's FFN width */
    int n_ff_shexp;                    /* the shared experts' FFN width, all of them (0: none) */
    int n_layer_dense_lead;            /* the first layers keep a dense FFN */
    kn_moe_gating moe_gating;          /* router logits -> probabilities */
    bool moe_norm_w;                   /* the chosen weights renormalised to sum 1 */
    float moe_w_scale;                 /* the chosen weights times it (1: none) */
    int n_expert_groups, n_group_used; /* choice limited to the best groups (0: no groups) */
    /* multi-head latent attention (deepseek2; kv_lora_rank 0: none): the KV pool holds one
     * latent vector per token and layer, head_dim = kv_lora_rank + n_rot with n_head_kv 1
     * (model_mla.c) */
    int q_lora_rank;  /* > 0: q = (rmsnorm(h Wq_a)) Wq_b; 0: q = h Wq */
    int kv_lora_rank; /* the compressed KV's width */
    int mla_nope;     /* a head's query/key dims without rope (qk_nope_head_dim) */
    int mla_v;        /* a head's value dims (v_head_dim) */
    /* multi-token prediction (deepseek2's nextn_predict_layers; 0: none): blocks stored after
     * the trunk as layers n_layer.. (block_count counts them, n_layer does not); each predicts
     * one token further from the trunk's last hidden state (kn_shard.mtp) */
    int n_layer_nextn;
} kn_hparams;

/* Whether layer il (global index) applies rope to Q and K. */
bool kn_layer_has_rope(const kn_hparams *hp, int il);

/* Whether layer il (global index) uses sliding-window attention. */
bool kn_layer_is_swa(const kn_hparams *hp, int il);

/* Whether layer il (global index) has a mixture-of-experts FFN. */
bool kn_layer_is_moe(const kn_hparams *hp, int il);

/* The FFN width one token computes in layer il: n_ff, or in a MoE layer its experts'
 * (n_expert_used * n_ff_exp) and the shared experts' (n_ff_shexp): cost models' FFN term. */
int64_t kn_layer_ffn_active(const kn_hparams *hp, int il);

typedef struct {
    int l0, l1;           /* layers [l0, l1); l1 = 0 means n_layer */
    int tp_rank, tp_size; /* tp_size 0 means 1 */
    /* re-quantize every row-parallel tensor whose blocks are wider than 32 weights into
     * Q8_0 even where the slice is whole blocks: a tp-1 reference carrying the rounding a
     * split shard gets (the split tests compare against it) */
    bool requant_all;
    /* expert parallelism across the TP ranks (ep = tp): rank r holds experts
     * kn_split_even(n_expert, tp, r) whole instead of a slice of every expert; refused for
     * a model without experts */
    bool ep;
    /* data-parallel attention (SGLang's DP attention): this shard is member dp_rank of a group
     * of dp_size that each run their own batches (their own requests and KV). Every tensor is
     * whole on every member but the routed experts, which the members divide whole
     * (kn_split_even(n_expert, dp_size, dp_rank)); a MoE layer gathers every member's rows,
     * runs the experts this member holds on all of them and sums the members' shares back to
     * each row's own member (kn_collective's dp_*). Needs tp_size 1, a model with at least
     * dp_size experts and a host backend. dp_size 0 means 1 (no group). */
    int dp_rank, dp_size;
    /* the model's first MTP block (layer n_layer, hparams.n_layer_nextn > 0) instead of trunk
     * layers (l0/l1 ignored; tp 1): a one-layer model whose forward takes the tokens and, in
     * kn_batch.embd, the trunk's normed hidden states of the positions before them (llama.cpp's
     * h_nextn: kn_batch.hidden_out) and gives the logits of the token after each; its KV pool
     * has that one layer. Its embedding, final norm and LM head are the block's own
     * (nextn.embed_tokens, shared_head_norm, shared_head_head) where the file has them, else the
     * trunk's. deepseek2 only. */
    bool mtp;
} kn_shard;

typedef struct {
    kn_mat wq, wk, wv, wo; /* local slices */
    kn_mat w_gate, w_up, w_down;
    float *attn_norm, *ffn_norm;           /* (n_embd), NULL for olmo2 */
    float *bq, *bk, *bv;                   /* local slices of the QKV biases or NULL */
    float *q_norm, *k_norm;                /* (head_dim) qwen3/gemma3 per-head norms, (n_head *
                                            * head_dim) / (n_head_kv * head_dim) olmo2, or NULL */
    float *attn_post_norm, *ffn_post_norm; /* (n_embd) gemma2/3 sandwich norms or NULL */
    /* a mixture-of-experts layer's FFN (kn_layer_is_moe; w_gate/w_up/w_down unused there) */
    kn_mat gate_inp;                /* (n_expert, n_embd) the router, whole on every rank */
    float *exp_probs_b;             /* (n_expert) bias added for the choice only, or NULL */
    kn_mat *exp_gate, *exp_up;      /* (n_expert) rows [ffe0, +n_ffe_local) of each expert held
                                     * ([x0, x0 + n_x_local); the others' data NULL) */
    kn_mat *exp_down;               /* (n_expert) the same columns of each expert's down */
    kn_mat sh_gate, sh_up, sh_down; /* the shared experts' slices (data NULL: none) */
    /* multi-head latent attention (hp.kv_lora_rank > 0; wq is then h -> this rank's heads'
     * (mla_nope + n_rot) query dims, or wq_a / q_a_norm / wq_b when q_lora_rank > 0; wk, wv
     * unused; wo takes this rank's heads' mla_v columns) */
    kn_mat wq_a, wq_b;    /* (q_lora_rank, n_embd), (local heads' query dims, q_lora_rank) */
    float *q_a_norm;      /* (q_lora_rank) or NULL */
    kn_mat wkv_c, wkv_pe; /* (kv_lora_rank, n_embd), (n_rot, n_embd): rows of kv_a_mqa */
    float *kv_a_norm;     /* (kv_lora_rank) */
    kn_mat *wk_b, *wv_b;  /* (local heads): (kv_lora_rank, mla_nope), (mla_v, kv_lora_rank) */
} kn_layer;

typedef struct {
    kn_hparams hp;
    kn_shard shard;
    td_tp_heads heads;     /* this rank's query and KV heads (td_tp.h) */
    int n_ff_local, ff0;   /* this rank's FFN columns [ff0, ff0 + n_ff_local); may differ by rank */
    int n_ffe_local, ffe0; /* the same for each expert's FFN (n_ff_exp; whole with ep) */
    int x0, n_x_local;     /* the experts this rank holds: all, or its share with ep */
    int n_ffs_local, ffs0; /* and for the shared experts' FFN (n_ff_shexp) */
    bool first, last;
    kn_mat tok_embd; /* (n_vocab, n_embd) whole; first stage */
    kn_mat output;   /* (n_vocab_local, n_embd) rows [vocab0, +n_vocab_local); last stage */
    int vocab0, n_vocab_local; /* this rank's LM head rows (the whole vocab when tp is 1) */
    float *output_norm;        /* (n_embd); last stage */
    kn_layer *layers;          /* (l1 - l0) */
    /* shard.mtp: the block's input, x = eh_proj [rmsnorm(embd(token)) * enorm,
     * rmsnorm(h) * hnorm] (llama.cpp's concatenation order) */
    kn_mat mtp_eh_proj;           /* (n_embd, 2 * n_embd) */
    float *mtp_enorm, *mtp_hnorm; /* (n_embd) each */
    float *rope_freq;     /* (n_rot / 2) inverse frequency of each pair, scaling folded in */
    float *rope_freq_swa; /* (n_rot / 2) the same for sliding-window layers, or NULL */
    char name[128];       /* general.name (truncated) or "" */
    void **owned;         /* (n_owned) re-quantized slices the views above point into */
    int n_owned;
} kn_model;

/* Load shard s of the model in g. Checks the architecture, every tensor's presence,
 * shape and type, and that the TP split divides the heads and cuts the FFN and the
 * row-parallel slices at 32-weight boundaries; errors are logged with the tensor name. */
int kn_model_load(const td_gguf *g, const kn_shard *s, kn_model **out);
void kn_model_destroy(kn_model *m);
/* Read only the hyper-parameters (no shard, no tensors checked beyond the embedding). */
int kn_hparams_read(const td_gguf *g, kn_hparams *hp);
const char *kn_arch_name(kn_arch a);

/* KV pool shape for this shard with n_blocks blocks: K and V of its KV heads, or for a
 * latent-attention model (kv_lora_rank > 0) the latent layout (kv_pool.h), one array a layer. */
kn_kv_pool_params kn_model_kv_params(const kn_model *m, int n_blocks, int block_size,
                                     td_dtype type);

/* Rank r's part of n split evenly across parts ranks: [r * n / parts, (r + 1) * n / parts)
 * (sizes differ by at most one). The LM head's vocab rows and gather_cols use it. */
static inline void kn_split_even(int64_t n, int parts, int r, int64_t *lo, int64_t *hi)
{
    *lo = (int64_t)r * n / parts;
    *hi = (int64_t)(r + 1) * n / parts;
}

/* The tensor-parallel collectives of one instance's ranks. Every rank calls them in the
 * same order with the same sizes. All return 0 or a negative td_err.
 *   allreduce_sum: sum buf (n floats) across the ranks in place; every rank gets the sum.
 *   gather_cols:   rank r passes part (rows, c1 - c0) row-major, columns [c0, c1) of a
 *                  (rows, n_cols) matrix (kn_split_even(n_cols, tp, r)); rank 0 gets the
 *                  whole matrix in out (rows, n_cols); the other ranks' out is neither read
 *                  nor written (may be NULL). Needed by a last stage with tp > 1.
 *
 * The data-parallel group's collectives (kn_shard.dp_size > 1: members, not ranks, each with
 * its own rows; every member calls them in the same order, once per forward and twice per
 * MoE layer, a member without rows too):
 *   dp_counts: member r passes mine = {its rows, its leading solo rows}; every member gets
 *              all (2 dp_size): member q's two at all[2q], all[2q + 1].
 *   dp_gather: member r passes its rows (its count, n_cols); every member gets all of them in
 *              all (N, n_cols), N the sum of the counts, in the solo-first layout of
 *              td_dp_layout (every member's solo rows before any other row).
 *   dp_reduce: every member passes all (N, n_cols) in that layout; member r gets in mine its
 *              own rows, each summed over the members in member order (bit-identical on every
 *              member, whatever the other rows).
 *   counts is dp_counts' all. */
typedef struct {
    void *ctx;
    int (*allreduce_sum)(void *ctx, float *buf, int64_t n);
    int (*gather_cols)(void *ctx, const float *part, int64_t rows, int64_t n_cols, float *out);
    int (*dp_counts)(void *ctx, const int64_t mine[2], int64_t *all);
    int (*dp_gather)(void *ctx, const float *mine, const int64_t *counts, int64_t n_cols,
                     float *all);
    int (*dp_reduce)(void *ctx, const float *all, const int64_t *counts, int64_t n_cols,
                     float *mine);
    /* Optional, for two-batch overlap (kn_engine_set_tbo): allreduce_sum in two halves. post
     * hands buf (n floats) over and returns at once with a ticket; wait (the same n) puts
     * the sum into buf. Posts pair across ranks in order with allreduces, at most two in
     * flight, waited in the order posted. */
    int (*allreduce_post)(void *ctx, const float *buf, int64_t n, uint64_t *ticket);
    int (*allreduce_wait)(void *ctx, uint64_t ticket, float *buf, int64_t n);
} kn_collective;

/* One forward batch: tokens of several sequences at arbitrary positions. Tokens of one
 * sequence must come in position order; positions [0, pos] of every token's sequence must
 * be in the KV pool after this batch (earlier positions from earlier batches).
 * Rows [0, n_solo) are computed as if each were alone in the batch: their hidden states
 * and logits are bit-identical whatever else is batched with them (the decode scheduler
 * puts its one-token decode rows there, so a seeded request samples the same tokens under
 * any load); the other rows may take faster kernels whose rounding depends on the batch.
 * Their logit rows must come before any other logit row. 0: no such rows (prefill). */
typedef struct {
    int64_t n_tokens;
    int64_t n_solo;        /* leading rows computed as if each were alone; 0..n_tokens */
    const int32_t *tokens; /* (n_tokens) first stage */
    const float *embd;     /* (n_tokens, n_embd) input hidden states: other stages; an MTP
                              block (kn_shard.mtp) the trunk's, beside its tokens */
    const int32_t *pos;    /* (n_tokens) */
    const int32_t *seq_of; /* (n_tokens) index into seqs */
    int n_seqs;
    const kn_seq_view *seqs;   /* (n_seqs) block tables and n_ctx after this batch */
    int n_logits;              /* last stage: rows that need logits */
    const int32_t *logit_rows; /* (n_logits) token indices into the batch */
    /* last stage, optional (NULL: none): (n_tokens, n_embd) host memory for every row's final
     * hidden state normed (rmsnorm * output_norm, what the LM head reads: an MTP block's input,
     * kn_shard.mtp), the same on every TP rank */
    float *hidden_out;
} kn_batch;

typedef struct kn_engine kn_engine;

/* coll may be NULL when tp_size and dp_size are 1. */
int kn_engine_create(const kn_model *m, kn_backend be, const kn_collective *coll, kn_engine **out);
void kn_engine_destroy(kn_engine *e);

/* Run the shard over the batch. Writes K/V of its layers into kv. out:
 *   last stage, rank 0 (or tp 1): (n_logits, n_vocab) logits of the requested rows;
 *   last stage, rank > 0: not used (may be NULL): the rank computes its vocab slice,
 *     which the collective's gather_cols hands to rank 0; every rank must get the same
 *     n_logits and logit_rows;
 *   other stages: (n_tokens, n_embd) hidden states for the next stage (every rank).
 * Bad input (token id out of range, position past the block table, missing tokens or
 * embd) is TD_EINVAL / TD_ERANGE with a logged message, never a crash. */
int kn_engine_forward(kn_engine *e, kn_kv_pool *kv, const kn_batch *b, float *out);

/* Two-batch overlap (forward_tbo.c): a forward of at least min_tokens tokens (>= 2) runs as
 * two micro-batches whose layers interleave, so each one's all-reduces are in flight while
 * the other computes; 0 turns it off. The result is the whole batch's (solo rows bit for
 * bit). Needs tp >= 2, the collective's allreduce_post/wait, no dp, not an MTP block: else
 * TD_EUNSUPP (logged); a device backend stages each micro-batch's all-reduce through host
 * memory as the plain forward does. Every rank of an instance sets the same
 * min_tokens (they must split alike). kn_engine_tbo_count: forwards that ran split. */
int kn_engine_set_tbo(kn_engine *e, int64_t min_tokens);
uint64_t kn_engine_tbo_count(const kn_engine *e);

/* Data-parallel attention (kn_shard.dp_size > 1): a member with no rows for a forward the
 * others run takes its part in the group's collectives this way (the other members' rows
 * through the experts it holds). A bad batch given to kn_engine_forward does the same before
 * its error returns. 0 at once without a group. */
int kn_engine_forward_idle(kn_engine *e);

#endif
