/* pf_shard.c: opening one pipeline stage's shard of the model (see pf_shard.h). */
#include "pf_shard.h"

#include <stdio.h>
#include <string.h>

#include "act_check.h"
#include "pf_chunk.h"
#include "td_err.h"

int pf_model_hparams(const char *path, kn_hparams *hp)
{
    char err[512];
    td_gguf *g;
    int rc = td_gguf_open(path, &g, err, sizeof err);
    if (rc) {
        TD_LOG_ERR("%s", err);
        return rc;
    }
    rc = kn_hparams_read(g, hp);
    td_gguf_close(g);
    return rc;
}

int pf_shard_open(pf_shard *s, const pf_shard_params *p)
{
    memset(s, 0, sizeof *s);
    s->pp = p->pp ? p->pp : 1;
    s->stage = p->stage;
    if (s->pp > PF_MAX_STAGES) {
        TD_LOG_ERR("pp %d: at most %d stages", s->pp, PF_MAX_STAGES);
        return TD_EINVAL;
    }
    /* the layer count decides the stage's range: read the header before loading the shard */
    kn_hparams hp;
    int rc = pf_model_hparams(p->model_path, &hp);
    if (rc) return rc;
    int counts[PF_MAX_STAGES];
    if ((rc =
             pf_layer_partition(hp.n_layer, s->pp, p->partition, p->partition ? s->pp : 0, counts)))
        return rc;
    if ((rc = pf_stage_range(counts, s->pp, s->stage, &s->l0, &s->l1))) return rc;
    s->threads = p->threads > 0 ? p->threads : 1;
    char who[64];
    snprintf(who, sizeof who, "prefill stage %d/%d", s->stage, s->pp);
    kn_runtime_params rp = {.model_path = p->model_path,
                            .shard = {.l0 = s->l0, .l1 = s->l1},
                            .backend = p->backend,
                            .backend_opts = {.n_threads = s->threads,
                                             .device = p->devices ? p->devices[s->stage] : -1,
                                             .rank = s->stage,
                                             .cpu_act = p->cpu_act},
                            .who = who};
    if ((rc = kn_act_runtime_open(&s->rt, &rp))) goto fail;
    s->ctx = p->ctx > 0 ? p->ctx : 8192;
    int bs = p->block_size > 0 ? p->block_size : 16;
    kn_kv_pool_params kp = kn_model_kv_params(s->rt.model, (s->ctx + bs - 1) / bs, bs, p->kv_type);
    /* the prefix cache's blocks come on top, as many on every stage: its bytes over the
     * largest stage's block (K and V of its layers, or their latent arrays once) */
    int most = 0;
    for (int i = 0; i < s->pp; i++)
        if (counts[i] > most) most = counts[i];
    kn_kv_pool_params largest = kp;
    largest.n_layers = most;
    size_t block = kn_kv_pool_params_block_bytes(&largest);
    size_t extra = block ? p->cache_bytes / block : 0;
    s->cache_blocks = extra > (1u << 24) ? 1 << 24 : (int)extra;
    kp.n_blocks += s->cache_blocks;
    kp.backend = &s->rt.be;
    kp.host_stage = true; /* kvxfer pushes the KV from host memory */
    if (p->n_slices > 1 && !s->rt.be.ops->kv_sliced) {
        TD_LOG_INFO("%s: the %s backend's kernels take head-major KV pools only: the pool stays "
                    "head-major (kvxfer stages the pieces of decode ranks holding part of it)",
                    who, s->rt.be.ops->name);
    } else if (p->n_slices > 1) {
        kp.n_slices = p->n_slices;
        memcpy(kp.slice_heads, p->slice_heads, sizeof kp.slice_heads);
    }
    if ((rc = kn_kv_mem_create(&kp, &s->mem))) goto fail;
    s->kv = kn_kv_mem_pool(s->mem);
    return 0;
fail:
    pf_shard_close(s);
    return rc;
}

void pf_shard_close(pf_shard *s)
{
    kn_kv_mem_destroy(s->mem);
    kn_runtime_close(&s->rt);
    memset(s, 0, sizeof *s);
}
