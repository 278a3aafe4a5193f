/* model_load_int.h: the loader's state and weight views, shared by model_load.c (the dense
 * model: hyper-parameters, attention, FFN) and the files of the other parts (model_moe.c,
 * model_mla.c, model_mtp.c, model_gemma2.c).
 * Private to kernels/.
 * Every function here records its first error in L->rc (logged with the tensor's name) and
 * does nothing once L->rc is set, so a loader can call them in sequence and check once. */
#ifndef KN_MODEL_LOAD_INT_H
#define KN_MODEL_LOAD_INT_H

#include "model.h"

/* Row-parallel tensors whose column slices may be re-quantized (each logged once a type). */
typedef enum {
    KN_LD_ATTN_OUTPUT,
    KN_LD_FFN_DOWN,
    KN_LD_FFN_DOWN_EXPS,
    KN_LD_FFN_DOWN_SHEXP,
    KN_LD_KINDS
} kn_ld_kind;

typedef struct {
    const td_gguf *g;
    kn_model *m;
    int rc;
    int cap_owned;
    uint64_t logged[KN_LD_KINDS]; /* re-quantized source types already logged, per kind */
} kn_loader;

/* The metadata key "<arch>.<suffix>": 0, TD_ENOENT when absent (logged only if required),
 * or an error for a value of another type. */
int kn_ld_u32(const td_gguf *g, const char *arch, const char *suffix, uint32_t *out, bool required);
int kn_ld_f32(const td_gguf *g, const char *arch, const char *suffix, float *out);

/* The tensor name of shape (ne0, ne1, ne2) (0: 1) in a type the engine computes with. */
const td_gguf_tensor *kn_ld_need(kn_loader *L, const char *name, int64_t ne0, int64_t ne1,
                                 int64_t ne2);
/* Rows [r0, r0 + nr) and columns [c0, c0 + nc) of a checked tensor t as a kn_mat; a 3-D
 * tensor's rows run through its ne1 * ne2 rows (expert x's row r is x * ne1 + r). Columns
 * must be whole blocks of the type. */
kn_mat kn_ld_view_of(kn_loader *L, const td_gguf_tensor *t, const char *name, int64_t r0,
                     int64_t nr, int64_t c0, int64_t nc);
/* kn_ld_view_of of the 2-D tensor name (ne0, ne1). */
kn_mat kn_ld_view(kn_loader *L, const char *name, int64_t ne0, int64_t ne1, int64_t r0, int64_t nr,
                  int64_t c0, int64_t nc);
/* Columns [c0, c0 + nc) of rows [r0, r0 + nr) of a row-parallel tensor: a view, or where the
 * slice cuts through the type's blocks (the 256-weight K types) a copy dequantized and
 * re-quantized into Q8_0, whose 32-weight blocks fit any slice the split makes (the
 * rounding this adds is measured in docs/architecture.md); the model owns the copy. */
kn_mat kn_ld_cols_of(kn_loader *L, kn_ld_kind kind, const td_gguf_tensor *t, const char *name,
                     int64_t r0, int64_t nr, int64_t c0, int64_t nc);
/* Elements [off, off + n) of a 1-D tensor of ne0 elements, converted to float32 (malloc'd,
 * the caller frees); NULL when optional and absent. */
float *kn_ld_vec(kn_loader *L, const char *name, int64_t ne0, int64_t off, int64_t n,
                 bool optional);

/* This rank's part of an FFN width n_ff: an even split when tp divides it into whole
 * 32-weight blocks (or the width is not a multiple of 32, float weights), else whole
 * 32-blocks with rank r taking blocks [r * nb / tp, (r + 1) * nb / tp). */
void kn_ld_ffn_split(int n_ff, const kn_shard *s, int *f0, int *nf);
/* model_split.c: whether shard s (tp_size and dp_size already 1 where they were 0) fits the
 * model: 0, or TD_EINVAL / TD_EUNSUPP with the reason logged. */
int kn_ld_check_split(const kn_hparams *hp, const kn_shard *s);
/* Whether tp can split the width n_ff (kn_ld_ffn_split); logs what names it when not. */
bool kn_ld_ffn_splits(int n_ff, int tp, const char *what);

/* ---- model_moe.c ---- */
/* The expert keys of a mixture-of-experts architecture (expert_count, expert_used_count,
 * expert_feed_forward_length, and the gating, weighting and group keys) into hp. */
int kn_moe_hparams(const td_gguf *g, const char *arch, kn_hparams *hp);
/* Layer il's router, experts and shared experts (this rank's slices), when it is MoE. */
void kn_moe_load_layer(kn_loader *L, kn_layer *ly, int il);
/* Frees what kn_moe_load_layer allocated. */
void kn_moe_free_layer(kn_layer *ly);

/* ---- model_mla.c ---- */
/* deepseek2's latent attention keys (then its expert keys, kn_moe_hparams) into hp. */
int kn_mla_hparams(const td_gguf *g, const char *arch, kn_hparams *hp);
/* Layer il's latent attention weights (this rank's heads), in place of Q, K, V. */
void kn_mla_load_layer(kn_loader *L, kn_layer *ly, int il);
/* Frees what kn_mla_load_layer allocated. */
void kn_mla_free_layer(kn_layer *ly);

/* ---- model_mtp.c ---- */
/* The shard of the MTP block (kn_shard.mtp): its layer [n_layer, n_layer + 1), whole; TD_EINVAL
 * (no block, tp > 1, ep) or TD_EUNSUPP (not deepseek2), logged. */
int kn_mtp_shard(const kn_hparams *hp, kn_shard *s);
/* The block's own embedding, LM head and final norm names (cap bytes each) where the file
 * has them, il its layer; the trunk's names stay otherwise. */
void kn_mtp_names(const td_gguf *g, int il, char *embd, char *head, char *norm, size_t cap);
/* The block's input weights (eh_proj, enorm, hnorm) into m (m->shard is the block's). */
void kn_mtp_load_input(kn_loader *L, kn_model *m);

/* ---- model_gemma2.c ---- */
/* gemma2's keys (the gemma block, the sliding window, the soft-caps) into hp, after the
 * shape, the rope and tied_embd are read. */
int kn_gemma2_hparams(const td_gguf *g, const char *arch, kn_hparams *hp);

#endif
