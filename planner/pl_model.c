/* pl_model.c: model shapes for the planner: named architectures and GGUF headers. */
#include "pl_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "model.h"
#include "td_err.h"

const char *const pl_model_names[] = {"llama3-8b", "llama3-70b", "qwen2.5-7b", "deepseek-v3", NULL};

/* A dense GQA transformer (Llama/Qwen layout): Q and O n_embd x n_head hd, K and V
 * n_embd x n_kv hd, a SwiGLU FFN (3 n_embd n_ff), untied embeddings. */
static void dense_shape(pl_model *m, const char *name, int n_layer, int n_embd, int n_head,
                        int n_kv, int hd, int n_ff, int n_vocab, double bytes_per_weight)
{
    memset(m, 0, sizeof *m);
    snprintf(m->name, sizeof m->name, "%s", name);
    m->n_layer = n_layer;
    m->n_embd = n_embd;
    m->n_head = n_head;
    m->n_head_kv = n_kv;
    double attn = (double)n_embd * hd * (2.0 * n_head + 2.0 * n_kv);
    m->layer_params = attn + 3.0 * n_embd * n_ff;
    m->head_params = (double)n_vocab * n_embd;
    m->weight_bytes = (n_layer * m->layer_params + 2 * m->head_params) * bytes_per_weight;
    m->embd_bytes = m->head_params * bytes_per_weight;
    m->kv_bytes_token = 2.0 * n_layer * n_kv * hd * 2; /* K and V, bf16 */
    m->attn_flops_pair = 2.0 * 2.0 * n_head * hd;      /* q.k and p.v, a multiply-add each */
    m->act_bytes = 2;
}

/* DeepSeek-V3 (and V3.1, the same shape): 61 layers, hidden 7168, 128 heads with MLA
 * (q_lora_rank 1536, kv_lora_rank 512, qk_nope 128 + qk_rope 64 per head, v_head_dim 128),
 * the first 3 layers dense (intermediate 18432), the other 58 MoE with 256 routed experts
 * of intermediate 2048, 8 per token, plus 1 shared expert; vocab 129280; FP8 weights.
 * Source: deepseek-ai/DeepSeek-V3 config.json on Hugging Face and the technical report
 * (arXiv 2412.19437: 671B total, 37B activated per token). The sums below give 671.0B total
 * and 37.5B activated (with the embedding row). Prefill attention runs MLA in its
 * non-absorbed (MHA) form: per pair 2 x 128 x 192 (q.k) + 2 x 128 x 128 (p.v) FLOPs; the KV
 * cache holds the 512 + 64 latent values per layer, bf16 (SGLang's default). */
static void deepseek_v3(pl_model *m)
{
    memset(m, 0, sizeof *m);
    snprintf(m->name, sizeof m->name, "deepseek-v3");
    const double h = 7168, nh = 128, qk = 192, v = 128;
    m->n_layer = 61;
    m->n_embd = 7168;
    m->n_head = 128;
    m->n_head_kv = 128;
    double attn = h * 1536 + 1536 * nh * qk + h * (512 + 64) + 512 * nh * (128 + v) + nh * v * h;
    double dense_ffn = 3 * h * 18432, expert = 3 * h * 2048;
    double per_token = 61 * attn + 3 * dense_ffn + 58 * (9 * expert + h * 256);
    m->layer_params = per_token / 61;
    m->head_params = 129280 * h;
    m->n_expert = 256;
    m->n_expert_used = 8;
    m->moe_expert_bytes = 58 * 256 * expert; /* FP8: a byte a weight */
    m->moe_active_params = 58 * 8 * expert;
    double all = 61 * attn + 3 * dense_ffn + 58 * (expert + h * 256) + 2 * m->head_params;
    m->weight_bytes = all + m->moe_expert_bytes;
    m->embd_bytes = m->head_params;
    m->kv_bytes_token = 61.0 * (512 + 64) * 2;
    m->attn_flops_pair = 2 * nh * qk + 2 * nh * v;
    m->act_bytes = 2;
}

int pl_model_named(const char *name, pl_model *m)
{
    /* Llama 3: meta-llama/Meta-Llama-3-8B and -70B config.json (Hugging Face), bf16 */
    if (!strcmp(name, "llama3-8b"))
        dense_shape(m, name, 32, 4096, 32, 8, 128, 14336, 128256, 2);
    else if (!strcmp(name, "llama3-70b"))
        dense_shape(m, name, 80, 8192, 64, 8, 128, 28672, 128256, 2);
    else if (!strcmp(name, "qwen2.5-7b")) /* Qwen/Qwen2.5-7B-Instruct config.json, bf16 */
        dense_shape(m, name, 28, 3584, 28, 4, 128, 18944, 152064, 2);
    else if (!strcmp(name, "deepseek-v3"))
        deepseek_v3(m);
    else {
        char known[256] = "";
        for (int i = 0; pl_model_names[i]; i++)
            snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", i ? ", " : "",
                     pl_model_names[i]);
        TD_LOG_ERR("planner: unknown model shape '%s' (known: %s; or a .gguf path)", name, known);
        return TD_ENOENT;
    }
    return 0;
}

int pl_model_gguf(const char *path, pl_model *m)
{
    td_gguf *g = NULL;
    char err[256] = "";
    int rc = td_gguf_open(path, &g, err, sizeof err);
    if (rc) {
        TD_LOG_ERR("planner: cannot read '%s': %s", path, err[0] ? err : td_strerror(rc));
        return rc;
    }
    kn_hparams hp;
    if ((rc = kn_hparams_read(g, &hp))) {
        TD_LOG_ERR("planner: '%s': no usable model header: %s", path, td_strerror(rc));
        td_gguf_close(g);
        return rc;
    }
    memset(m, 0, sizeof *m);
    const char *base = strrchr(path, '/');
    snprintf(m->name, sizeof m->name, "%s", base ? base + 1 : path);
    m->n_layer = hp.n_layer;
    m->n_embd = hp.n_embd;
    m->n_head = hp.n_head;
    m->n_head_kv = hp.n_head_kv;
    m->n_expert = hp.n_expert;
    m->n_expert_used = hp.n_expert_used;
    double layers = 0;
    for (size_t i = 0; i < td_gguf_n_tensors(g); i++) {
        const td_gguf_tensor *t = td_gguf_tensor_at(g, i);
        m->weight_bytes += (double)t->nbytes;
        if (!strcmp(t->name, "token_embd.weight") && !hp.tied_embd)
            m->embd_bytes = (double)t->nbytes;
        if (t->n_dims < 2 || strncmp(t->name, "blk.", 4)) continue;
        /* a multi-token prediction block (layers n_layer..) is no part of the trunk's forward:
         * held only where speculative decoding uses it */
        if (atoi(t->name + 4) >= hp.n_layer) {
            m->weight_bytes -= (double)t->nbytes;
            continue;
        }
        /* a MoE layer's 3-D expert tensors: a token meets n_expert_used of the experts */
        const bool experts = t->n_dims == 3 && hp.n_expert > 0 && t->ne[2] == hp.n_expert;
        double p = (double)t->ne[0] * (double)t->ne[1] * (experts ? hp.n_expert_used : t->ne[2]);
        layers += p;
        if (experts) m->moe_expert_bytes += (double)t->nbytes, m->moe_active_params += p;
    }
    td_gguf_close(g);
    m->layer_params = layers / hp.n_layer;
    m->head_params = (double)hp.n_vocab * hp.n_embd; /* the LM head, tied or not */
    /* f16 K and V of each KV head; a latent-attention model's pool holds its one latent
     * head once (kv_pool.h KN_KV_LAYOUT_LATENT) */
    m->kv_bytes_token =
        (hp.kv_lora_rank > 0 ? 1.0 : 2.0) * hp.n_layer * hp.n_head_kv * hp.head_dim * 2;
    m->attn_flops_pair = 4.0 * hp.n_head * hp.head_dim;
    m->act_bytes = 4; /* Tandem sends float32 hidden states and sums float32 */
    return 0;
}

int pl_model_load(const char *name_or_path, pl_model *m)
{
    for (int i = 0; pl_model_names[i]; i++)
        if (!strcmp(name_or_path, pl_model_names[i])) return pl_model_named(name_or_path, m);
    return pl_model_gguf(name_or_path, m);
}

double pl_model_weights_read(const pl_model *m, double tokens)
{
    double all = m->weight_bytes - m->embd_bytes;
    if (m->n_expert <= 0 || tokens <= 0) return all;
    double miss = pow(1.0 - (double)m->n_expert_used / m->n_expert, tokens);
    return all - m->moe_expert_bytes * miss;
}

double pl_model_active_params(const pl_model *m)
{
    return m->n_layer * m->layer_params + m->head_params;
}

/* The expected maximum of R independent standard normals (R = 1..16), then the asymptote. */
static double max_normal(int r)
{
    static const double c[] = {0,      0,      0.5642, 0.8463, 1.0294, 1.1630,
                               1.2672, 1.3522, 1.4236, 1.4850, 1.5388, 1.5864,
                               1.6292, 1.6680, 1.7034, 1.7359, 1.7660};
    if (r < (int)(sizeof c / sizeof *c)) return c[r < 0 ? 0 : r];
    double l = sqrt(2.0 * log((double)r));
    return l - (log(log((double)r)) + log(4.0 * 3.14159265358979323846)) / (2.0 * l);
}

/* mean + c_R sigma sqrt(1 - rho) over the mean (rho clamped to [-1 / (R - 1), 1]). */
static double max_over_mean(double mean, double var, double rho, int r)
{
    if (mean <= 0 || var <= 0) return 1;
    double lo = -1.0 / (r - 1);
    rho = rho < lo ? lo : rho > 1 ? 1 : rho;
    return (mean + max_normal(r) * sqrt(var) * sqrt(1.0 - rho)) / mean;
}

void pl_model_ep_imbalance(const pl_model *m, int ranks, double tokens, double *mem, double *comp)
{
    *mem = *comp = 1;
    const double E = m->n_expert, k = m->n_expert_used;
    if (E <= 0 || k <= 0 || ranks <= 1 || tokens <= 0 || E < ranks) return;
    const double n = E / ranks; /* experts a rank holds */
    /* experts touched on one rank: n indicators, each touched with q; two distinct experts
     * both untouched with p2 (a token takes k of E without repeats) */
    double u = pow(1.0 - k / E, tokens), q = 1.0 - u;
    double p2 = pow((E - k) * (E - k - 1) / (E * (E - 1)), tokens);
    double cov1 = p2 - u * u; /* of two experts' indicators */
    double var = n * q * (1 - q) + n * (n - 1) * cov1;
    *mem = max_over_mean(n * q, var, var > 0 ? n * n * cov1 / var : 0, ranks);
    /* choices landing on one rank: each token's k choices fall n of E (hypergeometric); the
     * ranks' counts sum to tokens k, so they are correlated -1 / (R - 1) */
    double var_c = tokens * k * (n / E) * (1 - n / E) * (E - k) / (E - 1);
    *comp = max_over_mean(tokens * k / ranks, var_c, -1.0 / (ranks - 1), ranks);
}
