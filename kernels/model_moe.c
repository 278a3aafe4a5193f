/* model_moe.c: the hyper-parameters and weights of mixture-of-experts layers, as llama.cpp
 * reads them (src/llama-model.cpp's common expert keys, src/models/qwen3moe.cpp).
 *
 * A MoE layer keeps the dense layer's attention and norms; its FFN is a router
 * (ffn_gate_inp, (n_embd, n_expert)) and n_expert experts stored as 3-D tensors
 * ffn_gate_exps / ffn_up_exps (n_embd, n_ff_exp, n_expert) and ffn_down_exps
 * (n_ff_exp, n_embd, n_expert), optionally beside shared experts (ffn_*_shexp, a dense FFN of
 * n_ff_shexp) that every token takes. Each expert is a view of its rows; a TP rank takes
 * the same FFN columns of every expert (kn_ld_ffn_split of n_ff_exp), so experts compose
 * across ranks exactly as the dense FFN does. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "model_load_int.h"
#include "td_err.h"

/* The keys every MoE architecture shares (llama.cpp reads them for all in load_hparams). */
static int common_keys(const td_gguf *g, const char *arch, kn_hparams *hp)
{
    uint32_t v;
    int rc;
    if ((rc = kn_ld_u32(g, arch, "expert_count", &v, true))) return rc;
    hp->n_expert = v > 4096 ? -1 : (int)v;
    if ((rc = kn_ld_u32(g, arch, "expert_used_count", &v, true))) return rc;
    hp->n_expert_used = v > 4096 ? -1 : (int)v;
    rc = kn_ld_u32(g, arch, "expert_feed_forward_length", &v, false);
    if (rc && rc != TD_ENOENT) return rc;
    /* llama.cpp's default when the key is absent */
    int64_t ffe = rc ? (hp->n_expert_used > 0 ? hp->n_ff / hp->n_expert_used : 0) : (int64_t)v;
    hp->n_ff_exp = ffe > (1 << 22) ? -1 : (int)ffe;
    for (int i = 0; i < 2; i++) {
        rc = kn_ld_u32(g, arch, i ? "expert_group_used_count" : "expert_group_count", &v, false);
        if (rc && rc != TD_ENOENT) return rc;
        int *dst = i ? &hp->n_group_used : &hp->n_expert_groups;
        *dst = rc ? 0 : v > 4096 ? -1 : (int)v;
    }
    return 0;
}

/* The bounds llama.cpp asserts, as errors that name the values. */
static int check_experts(const kn_hparams *hp)
{
    if (hp->n_expert < 1 || hp->n_expert_used < 1 || hp->n_expert_used > hp->n_expert ||
        hp->n_ff_exp < 1) {
        TD_LOG_ERR("implausible experts: %d experts, %d used per token, expert ffn %d",
                   hp->n_expert, hp->n_expert_used, hp->n_ff_exp);
        return TD_EFORMAT;
    }
    if (hp->n_expert_groups > 1) {
        const int per = hp->n_expert / hp->n_expert_groups;
        if (hp->n_expert_groups >= hp->n_expert || hp->n_expert % hp->n_expert_groups ||
            hp->n_group_used < 1 || hp->n_group_used >= hp->n_expert_groups ||
            hp->n_expert_used > hp->n_group_used * per || per < 2) {
            TD_LOG_ERR("implausible expert groups: %d groups of %d experts, %d used, %d "
                       "experts per token",
                       hp->n_expert_groups, hp->n_expert, hp->n_group_used, hp->n_expert_used);
            return TD_EFORMAT;
        }
    } else if (hp->n_expert_groups < 0) {
        TD_LOG_ERR("implausible expert group count %d", hp->n_expert_groups);
        return TD_EFORMAT;
    }
    return 0;
}

/* deepseek2's expert keys (src/models/deepseek2.cpp): leading dense layers, shared experts
 * (n_ff_exp each), the gating function (absent: softmax, for V2/V2.5 files, sigmoid for
 * GLM 4.7 Lite's shape as llama.cpp decides), whether the
 * weights are renormalised (absent: no) and their scale (absent or 0: none). */
static int deepseek2_keys(const td_gguf *g, const char *arch, kn_hparams *hp)
{
    uint32_t v;
    int rc = kn_ld_u32(g, arch, "leading_dense_block_count", &v, false);
    if (rc && rc != TD_ENOENT) return rc;
    hp->n_layer_dense_lead = rc ? 0 : v > (uint32_t)hp->n_layer ? hp->n_layer : (int)v;
    if ((rc = kn_ld_u32(g, arch, "expert_shared_count", &v, true))) return rc;
    if (v > 64) {
        TD_LOG_ERR("implausible shared expert count %u", v);
        return TD_EFORMAT;
    }
    hp->n_ff_shexp = (int)v * hp->n_ff_exp;
    rc = kn_ld_u32(g, arch, "expert_gating_func", &v, false);
    if (rc && rc != TD_ENOENT) return rc;
    if (rc == 0 && v != 0 && v != KN_MOE_SOFTMAX && v != KN_MOE_SIGMOID) {
        TD_LOG_ERR("expert gating function %u is not supported (1 softmax, 2 sigmoid)", v);
        return TD_EUNSUPP;
    }
    hp->moe_gating = rc == 0 && v == KN_MOE_SIGMOID ? KN_MOE_SIGMOID : KN_MOE_SOFTMAX;
    /* llama.cpp's rule for GLM 4.7 Lite files written without the key */
    if ((rc || v == 0) && (hp->n_layer == 47 || hp->n_layer == 48) && hp->n_vocab == 154880)
        hp->moe_gating = KN_MOE_SIGMOID;
    char key[128];
    snprintf(key, sizeof key, "%s.expert_weights_norm", arch);
    hp->moe_norm_w = false;
    rc = td_gguf_get_bool(g, key, &hp->moe_norm_w);
    if (rc && rc != TD_ENOENT) {
        TD_LOG_ERR("model metadata '%s': bad value", key);
        return rc;
    }
    float scale = 0.0f;
    rc = kn_ld_f32(g, arch, "expert_weights_scale", &scale);
    if (rc && rc != TD_ENOENT) return rc;
    if (!isfinite(scale)) {
        TD_LOG_ERR("model metadata '%s.expert_weights_scale': not finite", arch);
        return TD_EFORMAT;
    }
    hp->moe_w_scale = scale != 0.0f ? scale : 1.0f;
    return 0;
}

/* qwen3moe (src/models/qwen3moe.cpp): qwen3's attention; every layer MoE, softmax over the
 * experts, the chosen weights renormalised, no scale, no shared experts (the graph passes
 * these, whatever the file's keys say). deepseek2: deepseek2_keys. */
int kn_moe_hparams(const td_gguf *g, const char *arch, kn_hparams *hp)
{
    int rc = common_keys(g, arch, hp);
    if (rc) return rc;
    if (hp->arch == KN_ARCH_DEEPSEEK2) {
        if ((rc = deepseek2_keys(g, arch, hp))) return rc;
    } else {
        hp->moe_gating = KN_MOE_SOFTMAX;
        hp->moe_norm_w = true;
        hp->moe_w_scale = 1.0f;
    }
    return check_experts(hp);
}

void kn_moe_load_layer(kn_loader *L, kn_layer *ly, int il)
{
    const kn_model *m = L->m;
    const kn_hparams *hp = &m->hp;
    const int64_t E = hp->n_embd, X = hp->n_expert, FE = hp->n_ff_exp;
    const int64_t f0 = m->ffe0, nf = m->n_ffe_local;
    char nm[96];
#define NAME(fmt) (snprintf(nm, sizeof nm, "blk.%d." fmt, il), nm)
    ly->gate_inp = kn_ld_view(L, NAME("ffn_gate_inp.weight"), E, X, 0, X, 0, E);
    /* the choice's bias (DeepSeek V3); qwen3moe's graph has none */
    if (hp->arch != KN_ARCH_QWEN3MOE)
        ly->exp_probs_b = kn_ld_vec(L, NAME("exp_probs_b.bias"), X, 0, X, true);
    for (int64_t x = 0; ly->exp_probs_b && x < X && !L->rc; x++)
        if (!isfinite(ly->exp_probs_b[x])) {
            TD_LOG_ERR("tensor '%s': element %lld is not finite", nm, (long long)x);
            L->rc = TD_EFORMAT;
        }
    if (L->rc) return;
    ly->exp_gate = calloc((size_t)X, sizeof *ly->exp_gate);
    ly->exp_up = calloc((size_t)X, sizeof *ly->exp_up);
    ly->exp_down = calloc((size_t)X, sizeof *ly->exp_down);
    if (!ly->exp_gate || !ly->exp_up || !ly->exp_down) {
        L->rc = TD_ENOMEM;
        return;
    }
    /* the experts this rank holds: all of them (a slice of each), or its share (ep) whole */
    const int64_t x0 = m->x0, x1 = m->x0 + m->n_x_local;
    const td_gguf_tensor *tg = kn_ld_need(L, NAME("ffn_gate_exps.weight"), E, FE, X);
    for (int64_t x = x0; tg && x < x1; x++)
        ly->exp_gate[x] = kn_ld_view_of(L, tg, nm, x * FE + f0, nf, 0, E);
    const td_gguf_tensor *tu = kn_ld_need(L, NAME("ffn_up_exps.weight"), E, FE, X);
    for (int64_t x = x0; tu && x < x1; x++)
        ly->exp_up[x] = kn_ld_view_of(L, tu, nm, x * FE + f0, nf, 0, E);
    const td_gguf_tensor *td = kn_ld_need(L, NAME("ffn_down_exps.weight"), FE, E, X);
    for (int64_t x = x0; td && x < x1; x++)
        ly->exp_down[x] = kn_ld_cols_of(L, KN_LD_FFN_DOWN_EXPS, td, nm, x * E, E, f0, nf);
    if (hp->n_ff_shexp > 0) {
        const int64_t FS = hp->n_ff_shexp, s0 = m->ffs0, ns = m->n_ffs_local;
        ly->sh_gate = kn_ld_view(L, NAME("ffn_gate_shexp.weight"), E, FS, s0, ns, 0, E);
        ly->sh_up = kn_ld_view(L, NAME("ffn_up_shexp.weight"), E, FS, s0, ns, 0, E);
        const td_gguf_tensor *ts = kn_ld_need(L, NAME("ffn_down_shexp.weight"), FS, E, 1);
        ly->sh_down = kn_ld_cols_of(L, KN_LD_FFN_DOWN_SHEXP, ts, nm, 0, E, s0, ns);
    } else if (td_gguf_find_tensor(L->g, NAME("ffn_gate_shexp.weight"))) {
        TD_LOG_ERR("tensor '%s': %s has no shared experts here (the engine does not compute "
                   "with it)",
                   nm, kn_arch_name(hp->arch));
        L->rc = TD_EUNSUPP;
    }
#undef NAME
}

void kn_moe_free_layer(kn_layer *ly)
{
    free(ly->exp_probs_b);
    free(ly->exp_gate);
    free(ly->exp_up);
    free(ly->exp_down);
}
