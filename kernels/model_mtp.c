/* model_mtp.c: a model's multi-token prediction block (deepseek2's nextn layers) loaded as
 * a model of its own (model.h kn_shard.mtp), as llama.cpp's src/models/deepseek2.cpp reads it:
 * the block is layer n_layer (after the trunk; block_count counts it), a deepseek2 MoE layer
 * plus nextn.eh_proj, nextn.enorm and nextn.hnorm (its input, forward.c), and optionally its
 * own nextn.embed_tokens, nextn.shared_head_head and nextn.shared_head_norm in place of the
 * trunk's embedding, LM head and final norm. */
#include <stdio.h>

#include "model_load_int.h"
#include "td_err.h"

int kn_mtp_shard(const kn_hparams *hp, kn_shard *s)
{
    if (!hp->n_layer_nextn) {
        TD_LOG_ERR("the model has no multi-token prediction block (nextn_predict_layers)");
        return TD_EINVAL;
    }
    if (hp->arch != KN_ARCH_DEEPSEEK2) { /* the block's input is deepseek2's (forward.c) */
        TD_LOG_ERR("multi-token prediction blocks of %s are not supported (deepseek2 only)",
                   kn_arch_name(hp->arch));
        return TD_EUNSUPP;
    }
    if (s->tp_size > 1 || s->ep) {
        TD_LOG_ERR("an MTP block loads whole (tp 1, no ep)");
        return TD_EINVAL;
    }
    s->l0 = hp->n_layer;
    s->l1 = hp->n_layer + 1;
    s->tp_size = 1;
    s->tp_rank = 0;
    return 0;
}

/* name = blk.<il>.nextn.<what>.weight where the file has it (else left as it is). */
static void own(const td_gguf *g, int il, const char *what, char *name, size_t cap)
{
    char nm[96];
    snprintf(nm, sizeof nm, "blk.%d.nextn.%s.weight", il, what);
    if (td_gguf_find_tensor(g, nm)) snprintf(name, cap, "%s", nm);
}

void kn_mtp_names(const td_gguf *g, int il, char *embd, char *head, char *norm, size_t cap)
{
    own(g, il, "embed_tokens", embd, cap);
    own(g, il, "shared_head_head", head, cap);
    own(g, il, "shared_head_norm", norm, cap);
}

void kn_mtp_load_input(kn_loader *L, kn_model *m)
{
    const int64_t E = m->hp.n_embd;
    const int il = m->shard.l0;
    char nm[96];
    snprintf(nm, sizeof nm, "blk.%d.nextn.eh_proj.weight", il);
    m->mtp_eh_proj = kn_ld_view(L, nm, 2 * E, E, 0, E, 0, 2 * E);
    snprintf(nm, sizeof nm, "blk.%d.nextn.enorm.weight", il);
    m->mtp_enorm = kn_ld_vec(L, nm, E, 0, E, false);
    snprintf(nm, sizeof nm, "blk.%d.nextn.hnorm.weight", il);
    m->mtp_hnorm = kn_ld_vec(L, nm, E, 0, E, false);
}
