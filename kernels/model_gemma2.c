/* model_gemma2.c: the hyper-parameters of gemma2 (Gemma 2 2B / 9B / 27B), as llama.cpp reads
 * the files its converter writes (src/models/gemma2.cpp, conversion/gemma.py): the gemma
 * block's switches gemma3 also uses (kn_hparams) plus the two soft-caps, applied by
 * forward.c (the attention op's softcap, finish_logits). */
#include <math.h>

#include "model_load_int.h"
#include "td_err.h"

/* A soft-cap key of gemma2 (*cap keeps llama.cpp's default when absent): finite, >= 0; 0 is
 * no cap here (llama.cpp would divide by it). */
static int read_softcap(const td_gguf *g, const char *arch, const char *suffix, float *cap)
{
    int rc = kn_ld_f32(g, arch, suffix, cap);
    if (rc && rc != TD_ENOENT) return rc;
    if (!(*cap >= 0.0f) || !isfinite(*cap)) {
        TD_LOG_ERR("model metadata '%s.%s': bad soft-cap %g", arch, suffix, *cap);
        return TD_EFORMAT;
    }
    return 0;
}

/* gemma2 as llama.cpp reads it (src/models/gemma2.cpp, load_arch_hparams and the graph):
 * gemma3's block without the per-head Q/K norms (embeddings * sqrt(n_embd), GELU-gated FFN,
 * post-attention and post-FFN RMSNorms); scores scaled by 1/sqrt(head_dim), 1/sqrt(n_embd /
 * n_head) for the 46-layer 27B model; the even layers (load_swa_pattern(ml, 2): il % 2 <
 * 1, unless attention.sliding_window_pattern says otherwise) attend to
 * attention.sliding_window positions (4096 when absent) with the global layers' rope base
 * (rope.freq_base_swa overrides it) and scaling; every layer's scores soft-capped by
 * attn_logit_softcapping (50 when absent) after the scale and before the mask and softmax,
 * the logits by final_logit_softcapping (30 when absent) after the LM head; the LM head is
 * token_embd (llama.cpp reads no output.weight: one is refused). Norm weights as gemma3's. */
int kn_gemma2_hparams(const td_gguf *g, const char *arch, kn_hparams *hp)
{
    if (!hp->tied_embd) {
        TD_LOG_ERR("gemma2 with an output.weight: its LM head is token_embd (llama.cpp reads "
                   "no output.weight)");
        return TD_EFORMAT;
    }
    hp->embd_scale = sqrtf((float)hp->n_embd);
    if (hp->n_layer == 46) hp->attn_scale = 1.0f / sqrtf((float)(hp->n_embd / hp->n_head));
    hp->gelu_ffn = true;
    hp->post_norms = true;
    uint32_t window = 4096, pattern = 2; /* llama.cpp's defaults (kept when absent) */
    int rc = kn_ld_u32(g, arch, "attention.sliding_window", &window, false);
    if (rc && rc != TD_ENOENT) return rc;
    rc = kn_ld_u32(g, arch, "attention.sliding_window_pattern", &pattern, false);
    if (rc && rc != TD_ENOENT) return rc;
    if (window < 1 || window > (1u << 30) || pattern < 1 || pattern > (1u << 30)) {
        TD_LOG_ERR("gemma2: unsupported sliding window %u or pattern %u", window, pattern);
        return TD_EUNSUPP;
    }
    hp->swa_window = (int)window;
    hp->swa_pattern = (int)pattern;
    hp->rope_base_swa = hp->rope_base;
    hp->rope_scale_swa = hp->rope_scale;
    rc = kn_ld_f32(g, arch, "rope.freq_base_swa", &hp->rope_base_swa);
    if (rc && rc != TD_ENOENT) return rc;
    if (!(hp->rope_base_swa > 0.0f) || !isfinite(hp->rope_base_swa)) {
        TD_LOG_ERR("gemma2: bad sliding-window rope base %g", hp->rope_base_swa);
        return TD_EFORMAT;
    }
    hp->attn_softcap = 50.0f;
    hp->final_softcap = 30.0f;
    if ((rc = read_softcap(g, arch, "attn_logit_softcapping", &hp->attn_softcap))) return rc;
    return read_softcap(g, arch, "final_logit_softcapping", &hp->final_softcap);
}
