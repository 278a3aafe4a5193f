/* k8s_size.c: memory estimates for `tandem k8s render` from the model file's header
 * (k8s_int.h). The formula, which docs/deploy.md ("Kubernetes") states and
 * tests/deploy/test_k8s.py recomputes:
 *   decode rank    = GGUF bytes / tp + KV pool of the rank + 256 MiB
 *   prefill stage  = GGUF bytes x (its layers / all layers) + kv_tokens x its layers x KV
 *                    bytes of a token in a layer (every KV head) + prefix_cache_mb MiB + 256 MiB
 * where a rank's KV pool is kv_memory when given, else kv_blocks x block_size x layers x
 * (2 x the rank's KV heads x head_dim, or head_dim for latent attention) x 2 or 4 bytes
 * (f16, f32). The weights are mapped from the file (page cache charged to the pod), the
 * 256 MiB cover activations, buffers and the runtime. An estimate, not a measurement. */
#include <stdio.h>
#include <sys/stat.h>

#include "gguf.h"
#include "k8s_int.h"
#include "model.h"
#include "td_tp.h"

#define OVERHEAD_BYTES (256ll << 20)

void cli_k8s_model_read(const char *path, cli_k8s_model *m)
{
    *m = (cli_k8s_model){0};
    struct stat st;
    char err[256] = "";
    td_gguf *g = NULL;
    kn_hparams hp;
    if (stat(path, &st) || td_gguf_open(path, &g, err, sizeof err) || kn_hparams_read(g, &hp)) {
        fprintf(stderr,
                "tandem k8s: note: the model %s cannot be read here%s%s: no memory requests "
                "(--model-file PATH reads a copy)\n",
                path, err[0] ? ": " : "", err);
        td_gguf_close(g);
        return;
    }
    td_gguf_close(g);
    m->known = true;
    m->file_bytes = (int64_t)st.st_size;
    m->n_layer = hp.n_layer;
    m->n_head = hp.n_head;
    m->n_head_kv = hp.n_head_kv;
    m->latent = hp.kv_lora_rank > 0;
    /* f16 bytes of one token in one layer, every KV head (K and V) or the latent vector */
    m->kv_tok_layer =
        m->latent ? (int64_t)hp.head_dim * 2 : (int64_t)2 * hp.n_head_kv * hp.head_dim * 2;
}

static int dtype_scale(td_dtype t)
{
    return t == TD_F32 ? 2 : 1; /* against the f16 figure */
}

int64_t cli_k8s_decode_kv_bytes(const cli_k8s_model *m, const td_cfg_decode *d)
{
    if (!m->known) return 0;
    if (d->kv_memory) return d->kv_memory;
    int64_t per_tok_layer = m->kv_tok_layer;
    if (!m->latent && m->n_head_kv > 0) {
        int kv_rank = td_tp_max_kv_heads(m->n_head, m->n_head_kv, d->tp);
        if (kv_rank > 0) per_tok_layer = m->kv_tok_layer / m->n_head_kv * kv_rank;
    }
    return d->kv_blocks * d->block_size * m->n_layer * per_tok_layer * dtype_scale(d->kv_dtype);
}

int64_t cli_k8s_decode_rank_bytes(const cli_k8s_model *m, const td_cfg_decode *d)
{
    if (!m->known) return 0;
    return m->file_bytes / d->tp + cli_k8s_decode_kv_bytes(m, d) + OVERHEAD_BYTES;
}

/* Layers of stage s: layer_partition, else equal shares with the extra layers to the later
 * stages (as the prefill node splits them). */
static int stage_layers(const cli_k8s_model *m, const td_cfg_prefill *p, int s)
{
    if (p->layer_partition && s < p->n_layer_partition) return p->layer_partition[s];
    int base = m->n_layer / p->pp, extra = m->n_layer % p->pp;
    return base + (s >= p->pp - extra ? 1 : 0);
}

int64_t cli_k8s_prefill_stage_bytes(const cli_k8s_model *m, const td_cfg_prefill *p,
                                    const td_cfg_decode *d0, int stage)
{
    if (!m->known || m->n_layer <= 0) return 0;
    int layers = stage_layers(m, p, stage);
    int64_t weights = m->file_bytes * layers / m->n_layer;
    int64_t kv = (int64_t)p->kv_tokens * layers * m->kv_tok_layer * dtype_scale(d0->kv_dtype);
    int64_t cache = p->prefix_cache ? ((int64_t)p->prefix_cache_mb << 20) : 0;
    return weights + kv + cache + OVERHEAD_BYTES;
}

void cli_k8s_mib(int64_t bytes, char *buf, size_t cap)
{
    snprintf(buf, cap, "%lldMi", (long long)((bytes + (1ll << 20) - 1) >> 20));
}
