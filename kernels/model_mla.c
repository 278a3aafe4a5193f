/* model_mla.c: the hyper-parameters and weights of multi-head latent attention (deepseek2:
 * DeepSeek V2/V3 and the models built on them), as llama.cpp's src/models/deepseek2.cpp
 * reads the files its converter writes today (attn_k_b / attn_v_b; the legacy attn_kv_b
 * layout is refused with a message).
 *
 * The file describes the latent KV as an MQA head: attention.head_count_kv 1,
 * attention.key_length = kv_lora_rank + n_rot (the pool's head_dim), value_length =
 * kv_lora_rank; the per-head query/key and value widths are key_length_mla (mla_nope +
 * n_rot) and value_length_mla (mla_v). Per head h (forward_mla.c):
 *   q_h = [q_nope_h | q_pe_h]            from wq, or wq_b(rmsnorm(wq_a h))
 *   c = rmsnorm(h Wkv_c), k_pe = rope(h Wkv_pe)     (one latent per token: the KV)
 *   score = (q_nope_h Wk_b_h^T) . c + rope(q_pe_h) . k_pe, times mscale^2 / sqrt(nope + rope)
 *   out_h = (softmax . c) Wv_b_h^T
 * A TP rank holds its heads' rows of wq / wq_b, their wk_b / wv_b and wo's columns; the
 * latent (wkv_a_mqa and its norm) is whole on every rank, so each rank's pool holds it. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "model_load_int.h"
#include "td_err.h"

/* The latent dims the attention ops take (the CPU attention keeps a head on the stack). */
#define MLA_MAX_HEAD_DIM 576

int kn_mla_hparams(const td_gguf *g, const char *arch, kn_hparams *hp)
{
    uint32_t v, k_mla = 0, v_mla = 0;
    int rc = kn_ld_u32(g, arch, "attention.q_lora_rank", &v, false);
    if (rc && rc != TD_ENOENT) return rc;
    hp->q_lora_rank = rc ? 0 : (int)(v > (1u << 20) ? 0 : v);
    if ((rc = kn_ld_u32(g, arch, "attention.kv_lora_rank", &v, true))) return rc;
    hp->kv_lora_rank = v > (1u << 20) ? -1 : (int)v;
    rc = kn_ld_u32(g, arch, "attention.key_length_mla", &k_mla, false);
    if (rc == 0) rc = kn_ld_u32(g, arch, "attention.value_length_mla", &v_mla, true);
    if (rc == TD_ENOENT) {
        TD_LOG_ERR("%s file without attention.key_length_mla: the legacy attn_kv_b layout is not "
                   "supported (convert the model again with a current llama.cpp)",
                   arch);
        return TD_EUNSUPP;
    }
    if (rc) return rc;
    hp->mla_nope = (int)k_mla - hp->n_rot;
    hp->mla_v = v_mla > 4096 ? -1 : (int)v_mla;
    if (hp->kv_lora_rank < 1 || hp->n_head_kv != 1 ||
        hp->head_dim != hp->kv_lora_rank + hp->n_rot || k_mla > 4096 || hp->mla_nope < 1 ||
        hp->mla_v < 1 || hp->kv_lora_rank % 2) {
        TD_LOG_ERR("implausible latent attention: kv_lora_rank %d, rope %d, key_length %d, "
                   "kv heads %d, key_length_mla %u, value_length_mla %u",
                   hp->kv_lora_rank, hp->n_rot, hp->head_dim, hp->n_head_kv, k_mla, v_mla);
        return TD_EFORMAT;
    }
    if (hp->head_dim > MLA_MAX_HEAD_DIM) {
        TD_LOG_ERR("latent width %d exceeds the %d the attention computes", hp->head_dim,
                   MLA_MAX_HEAD_DIM);
        return TD_EUNSUPP;
    }
    /* llama.cpp: kq_scale = mscale^2 / sqrt(key_length_mla), mscale = 1 + 0.1 log_mul
     * ln(factor) with YaRN (model_load.c's read_yarn), 1 without */
    float mscale =
        hp->yarn_factor > 0.0f ? 1.0f + 0.1f * hp->yarn_log_mul * logf(hp->yarn_factor) : 1.0f;
    hp->attn_scale = mscale * mscale / sqrtf((float)k_mla);
    return kn_moe_hparams(g, arch, hp);
}

/* Layer il's latent attention weights, this rank's heads [q0, q0 + nh). */
void kn_mla_load_layer(kn_loader *L, kn_layer *ly, int il)
{
    const kn_model *m = L->m;
    const kn_hparams *hp = &m->hp;
    const int64_t E = hp->n_embd, R = hp->kv_lora_rank, P = hp->n_rot, N = hp->mla_nope;
    const int64_t V = hp->mla_v, QL = hp->q_lora_rank, H = hp->n_head;
    const int64_t q0 = m->heads.q0, nh = m->heads.n_q, QD = N + P;
    char nm[96];
#define NAME(fmt) (snprintf(nm, sizeof nm, "blk.%d." fmt, il), nm)
    if (QL > 0) {
        ly->wq_a = kn_ld_view(L, NAME("attn_q_a.weight"), E, QL, 0, QL, 0, E);
        ly->q_a_norm = kn_ld_vec(L, NAME("attn_q_a_norm.weight"), QL, 0, QL, false);
        ly->wq_b = kn_ld_view(L, NAME("attn_q_b.weight"), QL, H * QD, q0 * QD, nh * QD, 0, QL);
    } else {
        ly->wq = kn_ld_view(L, NAME("attn_q.weight"), E, H * QD, q0 * QD, nh * QD, 0, E);
    }
    ly->wkv_c = kn_ld_view(L, NAME("attn_kv_a_mqa.weight"), E, R + P, 0, R, 0, E);
    ly->wkv_pe = kn_ld_view(L, nm, E, R + P, R, P, 0, E);
    ly->kv_a_norm = kn_ld_vec(L, NAME("attn_kv_a_norm.weight"), R, 0, R, false);
    const td_gguf_tensor *tk = kn_ld_need(L, NAME("attn_k_b.weight"), N, R, H);
    const td_gguf_tensor *tv = kn_ld_need(L, NAME("attn_v_b.weight"), R, V, H);
    if (L->rc) return;
    ly->wk_b = calloc((size_t)nh, sizeof *ly->wk_b);
    ly->wv_b = calloc((size_t)nh, sizeof *ly->wv_b);
    if (!ly->wk_b || !ly->wv_b) {
        L->rc = TD_ENOMEM;
        return;
    }
    for (int64_t h = 0; h < nh; h++) {
        ly->wk_b[h] = kn_ld_view_of(L, tk, "attn_k_b.weight", (q0 + h) * R, R, 0, N);
        ly->wv_b[h] = kn_ld_view_of(L, tv, "attn_v_b.weight", (q0 + h) * V, V, 0, R);
    }
    const td_gguf_tensor *to = kn_ld_need(L, NAME("attn_output.weight"), H * V, E, 1);
    ly->wo = kn_ld_cols_of(L, KN_LD_ATTN_OUTPUT, to, nm, 0, E, q0 * V, nh * V);
#undef NAME
}

void kn_mla_free_layer(kn_layer *ly)
{
    free(ly->q_a_norm);
    free(ly->kv_a_norm);
    free(ly->wk_b);
    free(ly->wv_b);
}
