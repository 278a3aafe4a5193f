/* model_load.c: hyper-parameters from GGUF metadata and the shard's weight views. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h" /* kn_dequant_row, kn_cpu_type_supported: host-side loading */
#include "model_load_int.h"
#include "td_err.h"

/* The architectures the engine runs: GGUF name, rope pairing (llama.cpp's
 * llama_model_rope_type), the RMSNorm epsilon when the file has none. */
static const struct {
    const char *name;
    kn_arch arch;
    bool neox;
    float eps;
} ARCHS[] = {
    {"llama", KN_ARCH_LLAMA, false, 1e-5f},      {"qwen2", KN_ARCH_QWEN2, true, 1e-5f},
    {"qwen3", KN_ARCH_QWEN3, true, 1e-5f},       {"gemma3", KN_ARCH_GEMMA3, true, 1e-6f},
    {"smollm3", KN_ARCH_SMOLLM3, false, 1e-5f},  {"granite", KN_ARCH_GRANITE, false, 1e-5f},
    {"phi3", KN_ARCH_PHI3, true, 1e-5f},         {"olmo2", KN_ARCH_OLMO2, true, 1e-5f},
    {"qwen3moe", KN_ARCH_QWEN3MOE, true, 1e-6f}, {"deepseek2", KN_ARCH_DEEPSEEK2, false, 1e-6f},
    {"gemma2", KN_ARCH_GEMMA2, true, 1e-6f},
};
#define N_ARCHS (sizeof ARCHS / sizeof *ARCHS)

const char *kn_arch_name(kn_arch a)
{
    for (size_t i = 0; i < N_ARCHS; i++)
        if (ARCHS[i].arch == a) return ARCHS[i].name;
    return "?";
}

int kn_ld_u32(const td_gguf *g, const char *arch, const char *suffix, uint32_t *out, bool required)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = td_gguf_get_u32(g, key, out);
    if (rc == TD_ENOENT && !required) return TD_ENOENT;
    if (rc) TD_LOG_ERR("model metadata '%s': %s", key, rc == TD_ENOENT ? "missing" : "bad value");
    return rc;
}

int kn_ld_f32(const td_gguf *g, const char *arch, const char *suffix, float *out)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = td_gguf_get_f32(g, key, out);
    if (rc && rc != TD_ENOENT) TD_LOG_ERR("model metadata '%s': bad value", key);
    return rc;
}

/* What gemma3 adds to the Llama block, as llama.cpp's loader (src/llama-model.cpp,
 * LLM_ARCH_GEMMA3 in load_hparams) and graph (src/models/gemma3-iswa.cpp) read it:
 * embeddings scaled by sqrt(n_embd); GELU-gated FFN; post-attention and post-FFN RMSNorms
 * before each residual add; per-head Q/K norms; scores scaled by 1/sqrt(head_dim)
 * (1/sqrt(n_embd / n_head) for the 62-layer 27B model, whose query_pre_attn_scalar
 * differs; the GGUF carries no key for it); with attention.sliding_window set, every layer
 * but each 6th (pattern hard-coded there too) attends to that many positions and ropes
 * with base 10000, unscaled; the global layers use rope.freq_base and the rope scaling.
 * The converter already stores the norm weights as 1 + w, so they are used as they are. */
static int gemma3_hparams(const td_gguf *g, const char *arch, kn_hparams *hp)
{
    hp->embd_scale = sqrtf((float)hp->n_embd);
    if (hp->n_layer == 62) hp->attn_scale = 1.0f / sqrtf((float)(hp->n_embd / hp->n_head));
    hp->gelu_ffn = true;
    hp->post_norms = true;
    uint32_t v;
    int rc = kn_ld_u32(g, arch, "attention.sliding_window", &v, false);
    if (rc && rc != TD_ENOENT) return rc;
    if (rc == 0 && v > (1u << 30)) {
        TD_LOG_ERR("implausible sliding window %u", v);
        return TD_EFORMAT;
    }
    hp->swa_window = rc ? 0 : (int)v;
    hp->swa_pattern = 6;
    hp->rope_base_swa = 10000.0f;
    return 0;
}

/* smollm3 (src/models/smollm3.cpp): the llama block, but every 4th layer (il % 4 == 3)
 * has no rope (n_no_rope_layer_step, hard-coded to 4 by llama.cpp's loader). */
static int smollm3_hparams(const td_gguf *g, const char *arch, kn_hparams *hp)
{
    (void)g;
    (void)arch;
    hp->nope_step = 4;
    return 0;
}

/* An optional f32 key that llama.cpp treats as "unset" when 0: *out keeps its default. */
static int get_f32_nonzero(const td_gguf *g, const char *arch, const char *suffix, float *out)
{
    float v = 0.0f;
    int rc = kn_ld_f32(g, arch, suffix, &v);
    if (rc && rc != TD_ENOENT) return rc;
    if (rc == 0 && v != 0.0f) {
        if (!isfinite(v)) {
            TD_LOG_ERR("model metadata '%s.%s': not finite", arch, suffix);
            return TD_EFORMAT;
        }
        *out = v;
    }
    return 0;
}

/* granite (src/models/granite.cpp): the llama block with four scalars: embeddings times
 * embedding_scale, scores times attention.scale (instead of 1/sqrt(head_dim)), each block's
 * output times residual_scale before its residual add, logits times 1/logit_scale (the one
 * required key). rope.scaling.finetuned false means no rope at all: refused. */
static int granite_hparams(const td_gguf *g, const char *arch, kn_hparams *hp)
{
    int rc = kn_ld_f32(g, arch, "logit_scale", &hp->logit_scale);
    if (rc) {
        if (rc == TD_ENOENT) TD_LOG_ERR("model metadata '%s.logit_scale': missing", arch);
        return rc;
    }
    if (!(hp->logit_scale != 0.0f) || !isfinite(hp->logit_scale)) {
        TD_LOG_ERR("bad logit scale %g", hp->logit_scale);
        return TD_EFORMAT;
    }
    if ((rc = get_f32_nonzero(g, arch, "residual_scale", &hp->residual_scale)) ||
        (rc = get_f32_nonzero(g, arch, "embedding_scale", &hp->embd_scale)) ||
        (rc = get_f32_nonzero(g, arch, "attention.scale", &hp->attn_scale)))
        return rc;
    char key[128];
    bool finetuned = true;
    snprintf(key, sizeof key, "%s.rope.scaling.finetuned", arch);
    rc = td_gguf_get_bool(g, key, &finetuned);
    if (rc && rc != TD_ENOENT) return rc;
    if (!finetuned) {
        TD_LOG_ERR("granite without rope ('%s' false) is not supported", key);
        return TD_EUNSUPP;
    }
    return 0;
}

/* phi3 (src/models/phi3.cpp): the llama block with NEOX rope, Q, K, V fused in attn_qkv
 * and gate, up fused in ffn_up (2 * n_ff rows, gate first) -- both taken as row views by
 * the loader. llama.cpp ignores the sliding window the files carry (disabled there), so
 * does this. LongRoPE (rope_factors_long/short, Phi-3 128k and Phi-3.5) is refused. */
static int phi3_hparams(const td_gguf *g, const char *arch, kn_hparams *hp)
{
    (void)arch;
    (void)hp;
    if (td_gguf_find_tensor(g, "rope_factors_long.weight") ||
        td_gguf_find_tensor(g, "rope_factors_short.weight")) {
        TD_LOG_ERR("phi3 with LongRoPE (rope_factors_long/short.weight) is not supported");
        return TD_EUNSUPP;
    }
    return 0;
}

/* olmo2 (src/models/olmo2.cpp): no norm before the blocks; RMSNorm after attention and
 * after the FFN (post_attention_norm, post_ffw_norm) before each residual add; Q and K
 * RMSNorm over the whole projection (n_head * head_dim, n_head_kv * head_dim) before rope,
 * so a TP rank would need the other ranks' heads: tp > 1 is refused (check_split). The
 * sliding-window variant (OLMo 3) is refused. */
static int olmo2_hparams(const td_gguf *g, const char *arch, kn_hparams *hp)
{
    uint32_t v;
    int rc = kn_ld_u32(g, arch, "attention.sliding_window", &v, false);
    if (rc && rc != TD_ENOENT) return rc;
    if (rc == 0 && v > 0) {
        TD_LOG_ERR("olmo2 with a sliding window (%u; OLMo 3 style) is not supported", v);
        return TD_EUNSUPP;
    }
    hp->no_pre_norms = true;
    hp->post_norms = true;
    hp->qk_norm_whole = true;
    return 0;
}

/* general.architecture, as one of ARCHS; the architecture's name in arch (cap bytes). */
static int read_arch(const td_gguf *g, kn_hparams *hp, char *arch, size_t cap, size_t *ai)
{
    const char *s;
    size_t len;
    if (td_gguf_get_str(g, "general.architecture", &s, &len)) {
        TD_LOG_ERR("model has no general.architecture");
        return TD_EFORMAT;
    }
    if (len >= cap) len = cap - 1;
    memcpy(arch, s, len);
    arch[len] = '\0';
    for (size_t i = 0; i < N_ARCHS; i++)
        if (!strcmp(arch, ARCHS[i].name)) {
            hp->arch = ARCHS[i].arch;
            *ai = i;
            return 0;
        }
    char names[160];
    size_t n = 0;
    for (size_t i = 0; i < N_ARCHS && n < sizeof names; i++)
        n += (size_t)snprintf(names + n, sizeof names - n, "%s%s", i ? ", " : "", ARCHS[i].name);
    TD_LOG_ERR("unsupported architecture '%s' (%s are supported)", arch, names);
    return TD_EUNSUPP;
}

/* Layers, widths, heads, head and rope dimensions, with their plausibility checks. */
static int read_shape(const td_gguf *g, const char *arch, kn_hparams *hp)
{
    uint32_t v;
    int rc;
    if ((rc = kn_ld_u32(g, arch, "block_count", &v, true))) return rc;
    hp->n_layer = (int)v;
    /* multi-token prediction blocks follow the trunk and are counted in block_count (llama.cpp:
     * n_layer() = block_count - nextn_predict_layers): the trunk never runs them */
    rc = kn_ld_u32(g, arch, "nextn_predict_layers", &v, false);
    if (rc && rc != TD_ENOENT) return rc;
    if (!rc) {
        if (v >= (uint32_t)hp->n_layer) {
            TD_LOG_ERR("%u prediction layers (nextn_predict_layers) of %d blocks leave no trunk", v,
                       hp->n_layer);
            return TD_EFORMAT;
        }
        hp->n_layer_nextn = (int)v;
        hp->n_layer -= (int)v;
    }
    if ((rc = kn_ld_u32(g, arch, "embedding_length", &v, true))) return rc;
    hp->n_embd = (int)v;
    if ((rc = kn_ld_u32(g, arch, "feed_forward_length", &v, true))) return rc;
    hp->n_ff = (int)v;
    if ((rc = kn_ld_u32(g, arch, "attention.head_count", &v, true))) return rc;
    hp->n_head = (int)v;
    rc = kn_ld_u32(g, arch, "attention.head_count_kv", &v, false);
    if (rc && rc != TD_ENOENT) return rc;
    hp->n_head_kv = rc ? hp->n_head : (int)v;
    if (hp->n_layer < 1 || hp->n_layer > 4096 || hp->n_embd < 1 || hp->n_embd > (1 << 20) ||
        hp->n_ff < 1 || hp->n_ff > (1 << 22) || hp->n_head < 1 || hp->n_head > 4096 ||
        hp->n_head_kv < 1 || hp->n_head % hp->n_head_kv) {
        TD_LOG_ERR("implausible model shape: layers %d embd %d ff %d heads %d kv heads %d",
                   hp->n_layer, hp->n_embd, hp->n_ff, hp->n_head, hp->n_head_kv);
        return TD_EFORMAT;
    }
    rc = kn_ld_u32(g, arch, "attention.key_length", &v, false);
    if (rc && rc != TD_ENOENT) return rc;
    if (rc == TD_ENOENT && hp->n_embd % hp->n_head) {
        TD_LOG_ERR("embedding %d not divisible by %d heads and no key_length", hp->n_embd,
                   hp->n_head);
        return TD_EFORMAT;
    }
    hp->head_dim = rc ? hp->n_embd / hp->n_head : (int)v;
    /* the CPU attention keeps a head's accumulators on the stack: 256 dims at most, 576 for
     * deepseek2's latent (model_mla.c checks its shape) */
    const int max_hd = hp->arch == KN_ARCH_DEEPSEEK2 ? 576 : 256;
    if (hp->head_dim < 2 || hp->head_dim > max_hd || hp->head_dim % 2) {
        TD_LOG_ERR("unsupported head dim %d", hp->head_dim);
        return TD_EUNSUPP;
    }
    rc = kn_ld_u32(g, arch, "rope.dimension_count", &v, false);
    if (rc && rc != TD_ENOENT) return rc;
    hp->n_rot = rc ? hp->head_dim : (int)v;
    if (hp->n_rot < 2 || hp->n_rot > hp->head_dim || hp->n_rot % 2) {
        TD_LOG_ERR("bad rope dimension count %d (head dim %d)", hp->n_rot, hp->head_dim);
        return TD_EFORMAT;
    }
    rc = kn_ld_u32(g, arch, "context_length", &v, false);
    if (rc && rc != TD_ENOENT) return rc;
    hp->n_ctx_train = rc ? 2048 : (int)v;
    return 0;
}

/* deepseek2's YaRN, as llama.cpp computes it for these files (src/llama-model.cpp,
 * models/deepseek2.cpp, ggml's rope_yarn): pair i's frequency base^(-2i/n_rot) times
 * (1/factor (1 - r_i) + r_i), r_i = 1 - clamp((i - low) / max(0.001, high - low), 0, 1), with
 * low/high the pairs whose wavelengths fit beta_fast 32 / beta_slow 1 turns into
 * original_context_length; the rotation's magnitude cancels to 1 when the file has
 * yarn_log_multiplier (DeepSeek's do), and the attention scale gains mscale^2 (model_mla.c).
 * Without it (or with rope.scaling.attn_factor) the magnitude would not be 1: refused. */
static int read_yarn(const td_gguf *g, const char *arch, kn_hparams *hp)
{
    float f = 0.0f, log_mul = 0.0f, attn_factor = 1.0f;
    uint32_t orig = 0;
    int rc = kn_ld_f32(g, arch, "rope.scaling.factor", &f);
    if (rc == 0) rc = kn_ld_f32(g, arch, "rope.scaling.yarn_log_multiplier", &log_mul);
    if (rc == 0) rc = kn_ld_u32(g, arch, "rope.scaling.original_context_length", &orig, false);
    if (rc == TD_ENOENT) orig = (uint32_t)hp->n_ctx_train, rc = 0;
    int rc_af = kn_ld_f32(g, arch, "rope.scaling.attn_factor", &attn_factor);
    if (rc == TD_ENOENT || (rc == 0 && (log_mul == 0.0f || (rc_af == 0 && attn_factor != 1.0f)))) {
        TD_LOG_ERR("yarn rope scaling needs rope.scaling.factor and a non-zero "
                   "yarn_log_multiplier, and no attn_factor (the files DeepSeek's converter "
                   "writes)");
        return TD_EUNSUPP;
    }
    if (rc) return rc;
    if (!(f >= 1.0f) || !isfinite(f) || !isfinite(log_mul) || orig < 1 || orig > (1u << 30)) {
        TD_LOG_ERR("bad yarn scaling: factor %g, log multiplier %g, original context %u", f,
                   log_mul, orig);
        return TD_EFORMAT;
    }
    hp->yarn_factor = f;
    hp->yarn_log_mul = log_mul / 0.1f; /* the converter stores 0.1 * mscale_all_dim */
    hp->yarn_orig_ctx = (int)orig;
    return 0;
}

/* Rope base and scaling (none, linear, or deepseek2's yarn), the RMSNorm epsilon. */
static int read_rope(const td_gguf *g, const char *arch, kn_hparams *hp)
{
    hp->rope_base = 10000.0f;
    int rc = kn_ld_f32(g, arch, "rope.freq_base", &hp->rope_base);
    if (rc && rc != TD_ENOENT) return rc;
    rc = kn_ld_f32(g, arch, "attention.layer_norm_rms_epsilon", &hp->rms_eps);
    if (rc && rc != TD_ENOENT) return rc;
    if (!(hp->rope_base > 0) || !(hp->rms_eps > 0) || !(hp->rms_eps < 1)) {
        TD_LOG_ERR("bad rope base %g or rms epsilon %g", hp->rope_base, hp->rms_eps);
        return TD_EFORMAT;
    }
    hp->rope_scale = 1.0f;
    char key[128];
    const char *s;
    size_t len;
    snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
    if (!td_gguf_get_str(g, key, &s, &len) && !(len == 4 && !memcmp(s, "none", 4))) {
        if (len == 4 && !memcmp(s, "yarn", 4) && hp->arch == KN_ARCH_DEEPSEEK2)
            return read_yarn(g, arch, hp);
        if (!(len == 6 && !memcmp(s, "linear", 6))) {
            TD_LOG_ERR("unsupported rope scaling type '%.*s' (none, linear, llama3 rope_freqs, "
                       "and yarn for deepseek2 are supported)",
                       (int)len, s);
            return TD_EUNSUPP;
        }
        float f = 1.0f;
        rc = kn_ld_f32(g, arch, "rope.scaling.factor", &f);
        if (rc && rc != TD_ENOENT) return rc;
        if (!(f > 0)) {
            TD_LOG_ERR("bad rope scaling factor %g", f);
            return TD_EFORMAT;
        }
        hp->rope_scale = f;
    }
    return 0;
}

int kn_hparams_read(const td_gguf *g, kn_hparams *hp)
{
    memset(hp, 0, sizeof *hp);
    char arch[32];
    size_t ai = 0;
    int rc;
    if ((rc = read_arch(g, hp, arch, sizeof arch, &ai))) return rc;
    if ((rc = read_shape(g, arch, hp))) return rc;
    hp->rms_eps = ARCHS[ai].eps;
    if ((rc = read_rope(g, arch, hp))) return rc;
    hp->rope_neox = ARCHS[ai].neox;
    const td_gguf_tensor *te = td_gguf_find_tensor(g, "token_embd.weight");
    if (!te || te->n_dims != 2 || te->ne[0] != hp->n_embd) {
        TD_LOG_ERR("token_embd.weight missing or not (%d, n_vocab)", hp->n_embd);
        return TD_EFORMAT;
    }
    if (te->ne[1] > INT32_MAX) return TD_EFORMAT;
    hp->n_vocab = (int)te->ne[1];
    hp->tied_embd = td_gguf_find_tensor(g, "output.weight") == NULL;
    hp->embd_scale = 1.0f;
    hp->attn_scale = 1.0f / sqrtf((float)hp->head_dim);
    hp->residual_scale = 1.0f;
    hp->logit_scale = 1.0f;
    hp->rope_scale_swa = 1.0f;
    switch (hp->arch) {
    case KN_ARCH_GEMMA3:
        return gemma3_hparams(g, arch, hp);
    case KN_ARCH_GEMMA2:
        return kn_gemma2_hparams(g, arch, hp);
    case KN_ARCH_SMOLLM3:
        return smollm3_hparams(g, arch, hp);
    case KN_ARCH_GRANITE:
        return granite_hparams(g, arch, hp);
    case KN_ARCH_PHI3:
        return phi3_hparams(g, arch, hp);
    case KN_ARCH_OLMO2:
        return olmo2_hparams(g, arch, hp);
    case KN_ARCH_QWEN3MOE:
        return kn_moe_hparams(g, arch, hp);
    case KN_ARCH_DEEPSEEK2:
        return kn_mla_hparams(g, arch, hp);
    default:
        return 0;
    }
}

bool kn_layer_has_rope(const kn_hparams *hp, int il)
{
    return hp->nope_step <= 0 || (il + 1) % hp->nope_step != 0;
}

bool kn_layer_is_swa(const kn_hparams *hp, int il)
{
    return hp->swa_window > 0 && il % hp->swa_pattern != hp->swa_pattern - 1;
}

bool kn_layer_is_moe(const kn_hparams *hp, int il)
{
    return hp->n_expert > 0 && il >= hp->n_layer_dense_lead;
}

int64_t kn_layer_ffn_active(const kn_hparams *hp, int il)
{
    if (!kn_layer_is_moe(hp, il)) return hp->n_ff;
    return (int64_t)hp->n_expert_used * hp->n_ff_exp + hp->n_ff_shexp;
}

/* ---- weight views ---- */

/* out = the names of the weight types the backend computes with, comma-separated (the list
 * grows with the kernels, so it is read from them rather than written here). */
static void supported_types(char *out, size_t cap)
{
    size_t n = 0;
    out[0] = 0;
    for (uint32_t t = 0; t < TD_DTYPE_COUNT && n < cap; t++)
        if (td_dtype_get(t) && kn_cpu_type_supported((td_dtype)t)) {
            int k = snprintf(out + n, cap - n, "%s%s", n ? ", " : "", td_dtype_name(t));
            if (k < 0) break;
            n += (size_t)k;
        }
}

const td_gguf_tensor *kn_ld_need(kn_loader *L, const char *name, int64_t ne0, int64_t ne1,
                                 int64_t ne2)
{
    if (L->rc) return NULL;
    const td_gguf_tensor *t = td_gguf_find_tensor(L->g, name);
    if (!t) {
        TD_LOG_ERR("tensor '%s' missing", name);
        L->rc = TD_EFORMAT;
        return NULL;
    }
    int64_t want1 = ne1 ? ne1 : 1, want2 = ne2 ? ne2 : 1;
    if (t->ne[0] != ne0 || t->ne[1] != want1 || t->ne[2] != want2 || t->ne[3] != 1) {
        TD_LOG_ERR("tensor '%s' has shape (%lld, %lld, %lld, %lld), expected (%lld, %lld, %lld)",
                   name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                   (long long)t->ne[3], (long long)ne0, (long long)want1, (long long)want2);
        L->rc = TD_EFORMAT;
        return NULL;
    }
    if (!kn_cpu_type_supported(t->type)) {
        char types[256];
        supported_types(types, sizeof types);
        TD_LOG_ERR("tensor '%s' has type %s, which the engine does not compute with (%s)", name,
                   td_dtype_name(t->type), types);
        L->rc = TD_EUNSUPP;
        return NULL;
    }
    return t;
}

kn_mat kn_ld_view_of(kn_loader *L, const td_gguf_tensor *t, const char *name, int64_t r0,
                     int64_t nr, int64_t c0, int64_t nc)
{
    kn_mat w = {0};
    if (!t) return w;
    const td_dtype_info *ti = td_dtype_get(t->type);
    const int64_t ne0 = t->ne[0];
    if (c0 % ti->blck || nc % ti->blck) {
        TD_LOG_ERR("tensor '%s' (%s): tp %d rank %d would take columns [%lld, +%lld) of %lld, "
                   "not whole %u-element %s blocks; choose a tp that splits %lld into multiples "
                   "of %u",
                   name, ti->name, L->m->shard.tp_size, L->m->shard.tp_rank, (long long)c0,
                   (long long)nc, (long long)ne0, ti->blck, ti->name, (long long)ne0, ti->blck);
        L->rc = TD_EUNSUPP;
        return w;
    }
    w.type = t->type;
    w.n_rows = nr;
    w.n_cols = nc;
    w.row_stride = td_dtype_row_bytes(t->type, ne0);
    w.data =
        (const char *)t->data + (size_t)r0 * w.row_stride + (size_t)(c0 / ti->blck) * ti->type_size;
    return w;
}

kn_mat kn_ld_view(kn_loader *L, const char *name, int64_t ne0, int64_t ne1, int64_t r0, int64_t nr,
                  int64_t c0, int64_t nc)
{
    return kn_ld_view_of(L, kn_ld_need(L, name, ne0, ne1, 1), name, r0, nr, c0, nc);
}

static void *own(kn_loader *L, size_t bytes)
{
    kn_model *m = L->m;
    if (m->n_owned == L->cap_owned) {
        int cap = L->cap_owned ? 2 * L->cap_owned : 16;
        void **o = realloc(m->owned, (size_t)cap * sizeof *o);
        if (!o) return NULL;
        m->owned = o;
        L->cap_owned = cap;
    }
    void *p = malloc(bytes);
    if (p) m->owned[m->n_owned++] = p;
    return p;
}

kn_mat kn_ld_cols_of(kn_loader *L, kn_ld_kind kind, const td_gguf_tensor *t, const char *name,
                     int64_t r0, int64_t nr, int64_t c0, int64_t nc)
{
    static const char *const kinds[KN_LD_KINDS] = {"attn_output", "ffn_down", "ffn_down_exps",
                                                   "ffn_down_shexp"};
    if (!t) return (kn_mat){0};
    const td_dtype_info *ti = td_dtype_get(t->type);
    const int64_t ne0 = t->ne[0];
    bool cut = c0 % ti->blck || nc % ti->blck;
    bool forced = L->m->shard.requant_all && ti->blck > TD_QK;
    if ((!cut && !forced) || c0 % TD_QK || nc % TD_QK)
        return kn_ld_view_of(L, t, name, r0, nr, c0, nc); /* whole blocks, or the error */
    if (!(L->logged[kind] >> t->type & 1)) {
        L->logged[kind] |= (uint64_t)1 << t->type;
        TD_LOG_INFO("tp %d rank %d: %s columns [%lld, +%lld) of %lld %s whole %u-weight %s "
                    "blocks: re-quantized %s -> q8_0 at load (every layer's)",
                    L->m->shard.tp_size, L->m->shard.tp_rank, kinds[kind], (long long)c0,
                    (long long)nc, (long long)ne0, cut ? "are not" : "(requant_all) are", ti->blck,
                    ti->name, ti->name);
    }
    const size_t out_row = (size_t)(nc / TD_QK) * td_dtype_get(TD_Q8_0)->type_size;
    const size_t in_row = td_dtype_row_bytes(t->type, ne0);
    uint8_t *dst = own(L, out_row * (size_t)nr);
    float *row = malloc((size_t)ne0 * sizeof *row);
    if (!dst || !row) {
        free(row);
        L->rc = TD_ENOMEM;
        return (kn_mat){0};
    }
    for (int64_t r = 0; r < nr && !L->rc; r++)
        if (kn_dequant_row(t->type, (const char *)t->data + (size_t)(r0 + r) * in_row, row, ne0) ||
            kn_quant_row_q8_0(row + c0, dst + (size_t)r * out_row, nc))
            L->rc = TD_EINVAL;
    free(row);
    return (kn_mat){
        .type = TD_Q8_0, .n_rows = nr, .n_cols = nc, .row_stride = out_row, .data = dst};
}

/* Columns [c0, c0 + nc) of every row of a 2-D row-parallel tensor (kn_ld_cols_of). */
static kn_mat view_cols(kn_loader *L, kn_ld_kind kind, const char *name, int64_t ne0, int64_t ne1,
                        int64_t c0, int64_t nc)
{
    return kn_ld_cols_of(L, kind, kn_ld_need(L, name, ne0, ne1, 1), name, 0, ne1, c0, nc);
}

/* Elements [off, off + n) of a 1-D tensor of ne0 elements, converted to float32. */
float *kn_ld_vec(kn_loader *L, const char *name, int64_t ne0, int64_t off, int64_t n, bool optional)
{
    if (L->rc) return NULL;
    if (optional && !td_gguf_find_tensor(L->g, name)) return NULL;
    const td_gguf_tensor *t = kn_ld_need(L, name, ne0, 0, 0);
    if (!t) return NULL;
    float *full = malloc((size_t)ne0 * sizeof *full);
    float *out = malloc((size_t)n * sizeof *out);
    if (!full || !out || kn_dequant_row(t->type, t->data, full, ne0)) {
        free(full);
        free(out);
        L->rc = TD_ENOMEM;
        return NULL;
    }
    memcpy(out, full + off, (size_t)n * sizeof *out);
    free(full);
    return out;
}

/* Tensors a file may carry that no supported architecture computes with here (biases
 * llama.cpp's loaders accept as optional): refused rather than ignored. il < 0: the
 * model-wide ones. */
static void refuse_unused(kn_loader *L, int il)
{
    static const char *const layer[] = {"attn_qkv.bias", "attn_output.bias", "ffn_gate.bias",
                                        "ffn_up.bias",   "ffn_down.bias",    "attn_norm.bias",
                                        "ffn_norm.bias"};
    static const char *const model[] = {"output.bias", "output_norm.bias"};
    const char *const *names = il < 0 ? model : layer;
    size_t n = il < 0 ? sizeof model / sizeof *model : sizeof layer / sizeof *layer;
    char nm[96];
    for (size_t i = 0; i < n && !L->rc; i++) {
        if (il < 0)
            snprintf(nm, sizeof nm, "%s", names[i]);
        else
            snprintf(nm, sizeof nm, "blk.%d.%s", il, names[i]);
        if (td_gguf_find_tensor(L->g, nm)) {
            TD_LOG_ERR("tensor '%s' (%s): the engine does not compute with it", nm,
                       kn_arch_name(L->m->hp.arch));
            L->rc = TD_EUNSUPP;
        }
    }
}

/* Layer il's Q, K, V: this rank's rows of attn_q/k/v, or of the fused attn_qkv (rows
 * [0, QT) Q, [QT, QT + KVT) K, then V), as views. */
static void load_qkv(kn_loader *L, kn_layer *ly, int il)
{
    const kn_model *m = L->m;
    const int64_t E = m->hp.n_embd, HD = m->hp.head_dim;
    const int64_t nq = (int64_t)m->heads.n_q * HD, nkv = (int64_t)m->heads.n_kv * HD;
    const int64_t q0 = (int64_t)m->heads.q0 * HD, kv0 = (int64_t)m->heads.kv0 * HD;
    const int64_t QT = (int64_t)m->hp.n_head * HD, KVT = (int64_t)m->hp.n_head_kv * HD;
    char nm[96];
#define NAME(fmt) (snprintf(nm, sizeof nm, "blk.%d." fmt, il), nm)
    if (td_gguf_find_tensor(L->g, NAME("attn_qkv.weight"))) {
        const int64_t R = QT + 2 * KVT;
        ly->wq = kn_ld_view(L, nm, E, R, q0, nq, 0, E);
        ly->wk = kn_ld_view(L, nm, E, R, QT + kv0, nkv, 0, E);
        ly->wv = kn_ld_view(L, nm, E, R, QT + KVT + kv0, nkv, 0, E);
    } else {
        ly->wq = kn_ld_view(L, NAME("attn_q.weight"), E, QT, q0, nq, 0, E);
        ly->wk = kn_ld_view(L, NAME("attn_k.weight"), E, KVT, kv0, nkv, 0, E);
        ly->wv = kn_ld_view(L, NAME("attn_v.weight"), E, KVT, kv0, nkv, 0, E);
    }
    ly->wo = view_cols(L, KN_LD_ATTN_OUTPUT, NAME("attn_output.weight"), QT, E, q0, nq);
    ly->bq = kn_ld_vec(L, NAME("attn_q.bias"), QT, q0, nq, true);
    ly->bk = kn_ld_vec(L, NAME("attn_k.bias"), KVT, kv0, nkv, true);
    ly->bv = kn_ld_vec(L, NAME("attn_v.bias"), KVT, kv0, nkv, true);
    if (m->hp.qk_norm_whole) { /* tp 1 (check_split): the whole projection */
        ly->q_norm = kn_ld_vec(L, NAME("attn_q_norm.weight"), QT, 0, QT, false);
        ly->k_norm = kn_ld_vec(L, NAME("attn_k_norm.weight"), KVT, 0, KVT, false);
    } else {
        const bool qk_norm = m->hp.arch == KN_ARCH_QWEN3 || m->hp.arch == KN_ARCH_GEMMA3 ||
                             m->hp.arch == KN_ARCH_QWEN3MOE;
        ly->q_norm = kn_ld_vec(L, NAME("attn_q_norm.weight"), HD, 0, HD, !qk_norm);
        ly->k_norm = kn_ld_vec(L, NAME("attn_k_norm.weight"), HD, 0, HD, !qk_norm);
    }
#undef NAME
}

/* Layer il's weights: norms, attention, FFN (gate and up from ffn_gate / ffn_up, or both
 * from phi3's fused ffn_up of 2 * n_ff rows, gate first). */
static void load_layer(kn_loader *L, kn_layer *ly, int il)
{
    const kn_model *m = L->m;
    const kn_hparams *hp = &m->hp;
    const int64_t E = hp->n_embd, F = m->n_ff_local, f0 = m->ff0, FT = hp->n_ff;
    char nm[96];
#define NAME(fmt) (snprintf(nm, sizeof nm, "blk.%d." fmt, il), nm)
    if (!hp->no_pre_norms) {
        ly->attn_norm = kn_ld_vec(L, NAME("attn_norm.weight"), E, 0, E, false);
        ly->ffn_norm = kn_ld_vec(L, NAME("ffn_norm.weight"), E, 0, E, false);
    }
    if (hp->kv_lora_rank > 0)
        kn_mla_load_layer(L, ly, il);
    else
        load_qkv(L, ly, il);
    if (kn_layer_is_moe(hp, il)) {
        kn_moe_load_layer(L, ly, il);
    } else if (hp->arch == KN_ARCH_PHI3) {
        ly->w_gate = kn_ld_view(L, NAME("ffn_up.weight"), E, 2 * FT, f0, F, 0, E);
        ly->w_up = kn_ld_view(L, nm, E, 2 * FT, FT + f0, F, 0, E);
    } else {
        ly->w_gate = kn_ld_view(L, NAME("ffn_gate.weight"), E, FT, f0, F, 0, E);
        ly->w_up = kn_ld_view(L, NAME("ffn_up.weight"), E, FT, f0, F, 0, E);
    }
    if (!kn_layer_is_moe(hp, il))
        ly->w_down = view_cols(L, KN_LD_FFN_DOWN, NAME("ffn_down.weight"), FT, E, f0, F);
    if (hp->post_norms) {
        ly->attn_post_norm = kn_ld_vec(L, NAME("post_attention_norm.weight"), E, 0, E, false);
        ly->ffn_post_norm = kn_ld_vec(L, NAME("post_ffw_norm.weight"), E, 0, E, false);
    }
#undef NAME
    refuse_unused(L, il);
}

/* YaRN's ramp over the pairs (read_yarn): the dims where a wavelength of beta turns fit
 * orig_ctx positions, as ggml_rope_yarn_corr_dims computes them (float math). */
static float yarn_corr_dim(const kn_hparams *hp, float beta)
{
    return (float)hp->n_rot *
           logf((float)hp->yarn_orig_ctx / (beta * 2.0f * 3.14159265358979323846f)) /
           (2.0f * logf(hp->rope_base));
}

static void build_rope_freq(const kn_hparams *hp, float base, float scale, float *freq,
                            const float *factors)
{
    float low = 0.0f, high = 0.0f;
    if (hp->yarn_factor > 0.0f) {
        low = fmaxf(0.0f, floorf(yarn_corr_dim(hp, 32.0f)));
        high = fminf((float)(hp->n_rot - 1), ceilf(yarn_corr_dim(hp, 1.0f)));
    }
    for (int i = 0; i < hp->n_rot / 2; i++) {
        double f = pow((double)base, -2.0 * i / hp->n_rot) / scale;
        if (factors) f /= factors[i];
        if (hp->yarn_factor > 0.0f) {
            float y = ((float)i - low) / fmaxf(0.001f, high - low);
            float r = 1.0f - fminf(1.0f, fmaxf(0.0f, y)); /* 1: the original frequency */
            f *= (1.0f / hp->yarn_factor) * (1.0f - r) + r;
        }
        freq[i] = (float)f;
    }
}

int kn_model_load(const td_gguf *g, const kn_shard *shard, kn_model **out)
{
    *out = NULL;
    kn_model *m = calloc(1, sizeof *m);
    if (!m) return TD_ENOMEM;
    int rc = kn_hparams_read(g, &m->hp);
    if (rc) goto fail;
    const kn_hparams *hp = &m->hp;
    kn_shard s = *shard;
    if (s.mtp && (rc = kn_mtp_shard(hp, &s))) goto fail;
    if (s.l1 == 0) s.l1 = hp->n_layer;
    if (s.tp_size == 0) s.tp_size = 1;
    if (s.dp_size == 0) s.dp_size = 1;
    if ((rc = kn_ld_check_split(hp, &s))) goto fail;
    m->shard = s;
    m->first = s.l0 == 0 || s.mtp;
    m->last = s.l1 == hp->n_layer || s.mtp;
    /* kn_hparams_read checked that n_head_kv divides n_head, check_split that tp does */
    if ((rc = td_tp_heads_of_rank(hp->n_head, hp->n_head_kv, s.tp_size, s.tp_rank, &m->heads)))
        goto fail;
    kn_ld_ffn_split(hp->n_ff, &s, &m->ff0, &m->n_ff_local);
    kn_ld_ffn_split(hp->n_ff_exp, &s, &m->ffe0, &m->n_ffe_local);
    m->n_x_local = hp->n_expert;
    if (s.ep) { /* whole experts, this rank's share */
        int64_t x0, x1;
        kn_split_even(hp->n_expert, s.tp_size, s.tp_rank, &x0, &x1);
        m->x0 = (int)x0;
        m->n_x_local = (int)(x1 - x0);
        m->ffe0 = 0;
        m->n_ffe_local = hp->n_ff_exp;
        TD_LOG_INFO("ep %d rank %d: experts [%d, %d) of %d, whole", s.tp_size, s.tp_rank, m->x0,
                    m->x0 + m->n_x_local, hp->n_expert);
    } else if (s.dp_size > 1) { /* dp attention: the member's share of the experts */
        int64_t x0, x1;
        kn_split_even(hp->n_expert, s.dp_size, s.dp_rank, &x0, &x1);
        m->x0 = (int)x0;
        m->n_x_local = (int)(x1 - x0);
        TD_LOG_INFO("dp attention %d member %d: experts [%d, %d) of %d, the rest whole", s.dp_size,
                    s.dp_rank, m->x0, m->x0 + m->n_x_local, hp->n_expert);
    }
    kn_ld_ffn_split(hp->n_ff_shexp, &s, &m->ffs0, &m->n_ffs_local);
    const char *name;
    size_t name_len;
    if (!td_gguf_get_str(g, "general.name", &name, &name_len))
        snprintf(m->name, sizeof m->name, "%.*s", (int)(name_len < 127 ? name_len : 127), name);

    kn_loader L = {.g = g, .m = m};
    const int64_t E = hp->n_embd;

    /* an MTP block's own embedding, LM head and final norm where the file has them */
    char embd_nm[96] = "token_embd.weight", head_nm[96], norm_nm[96] = "output_norm.weight";
    snprintf(head_nm, sizeof head_nm, "%s", hp->tied_embd ? "token_embd.weight" : "output.weight");
    if (s.mtp) kn_mtp_names(g, s.l0, embd_nm, head_nm, norm_nm, sizeof embd_nm);
    if (m->first) m->tok_embd = kn_ld_view(&L, embd_nm, E, hp->n_vocab, 0, hp->n_vocab, 0, E);
    if (m->last) {
        /* vocab-parallel LM head: this rank's rows (whole vectors, so no block is cut) */
        int64_t v0, v1;
        kn_split_even(hp->n_vocab, s.tp_size, s.tp_rank, &v0, &v1);
        m->vocab0 = (int)v0;
        m->n_vocab_local = (int)(v1 - v0);
        m->output = kn_ld_view(&L, head_nm, E, hp->n_vocab, v0, v1 - v0, 0, E);
        m->output_norm = kn_ld_vec(&L, norm_nm, E, 0, E, false);
    }
    if (s.mtp) kn_mtp_load_input(&L, m);
    int n_local = s.l1 - s.l0;
    m->layers = calloc((size_t)n_local, sizeof *m->layers);
    if (!m->layers) {
        rc = TD_ENOMEM;
        goto fail;
    }
    for (int i = 0; i < n_local && !L.rc; i++)
        load_layer(&L, &m->layers[i], s.l0 + i);
    refuse_unused(&L, -1);
    float *factors = kn_ld_vec(&L, "rope_freqs.weight", hp->n_rot / 2, 0, hp->n_rot / 2, true);
    if ((rc = L.rc)) {
        free(factors);
        goto fail;
    }
    m->rope_freq = malloc((size_t)(hp->n_rot / 2) * sizeof *m->rope_freq);
    if (!m->rope_freq) {
        free(factors);
        rc = TD_ENOMEM;
        goto fail;
    }
    build_rope_freq(hp, hp->rope_base, hp->rope_scale, m->rope_freq, factors);
    free(factors);
    if (hp->swa_window > 0) {
        m->rope_freq_swa = malloc((size_t)(hp->n_rot / 2) * sizeof *m->rope_freq_swa);
        if (!m->rope_freq_swa) {
            rc = TD_ENOMEM;
            goto fail;
        }
        build_rope_freq(hp, hp->rope_base_swa, hp->rope_scale_swa, m->rope_freq_swa, NULL);
    }
    *out = m;
    return 0;
fail:
    kn_model_destroy(m);
    return rc;
}

void kn_model_destroy(kn_model *m)
{
    if (!m) return;
    if (m->layers) {
        for (int i = 0; i < m->shard.l1 - m->shard.l0; i++) {
            kn_layer *ly = &m->layers[i];
            free(ly->attn_norm);
            free(ly->ffn_norm);
            free(ly->bq);
            free(ly->bk);
            free(ly->bv);
            free(ly->q_norm);
            free(ly->k_norm);
            free(ly->attn_post_norm);
            free(ly->ffn_post_norm);
            kn_moe_free_layer(ly);
            kn_mla_free_layer(ly);
        }
    }
    free(m->layers);
    for (int i = 0; i < m->n_owned; i++)
        free(m->owned[i]);
    free(m->owned);
    free(m->output_norm);
    free(m->mtp_enorm);
    free(m->mtp_hnorm);
    free(m->rope_freq);
    free(m->rope_freq_swa);
    free(m);
}

kn_kv_pool_params kn_model_kv_params(const kn_model *m, int n_blocks, int block_size, td_dtype type)
{
    return (kn_kv_pool_params){
        .n_layers = m->shard.l1 - m->shard.l0,
        .n_kv_heads = m->heads.n_kv,
        .head_dim = m->hp.head_dim,
        .block_size = block_size,
        .n_blocks = n_blocks,
        .type = type,
        /* latent attention: the pool's one KV head is the latent, its prefix the value */
        .layout = m->hp.kv_lora_rank > 0 ? KN_KV_LAYOUT_LATENT : KN_KV_LAYOUT_KV,
    };
}
