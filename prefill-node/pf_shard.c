/* pf_shard.c: opening one pipeline stage's shard of the model (see pf_shard.h). */
#include "pf_shard.h"

#include <string.h>

#include "pf_chunk.h"
#include "td_err.h"

int pf_shard_open(pf_shard *s, const pf_shard_params *p)
{
    memset(s, 0, sizeof *s);
    char err[512];
    int rc = td_gguf_open(p->model_path, &s->gguf, err, sizeof err);
    if (rc) {
        TD_LOG_ERR("%s", err);
        return rc;
    }
    kn_hparams hp;
    if ((rc = kn_hparams_read(s->gguf, &hp))) goto fail;
    s->pp = p->pp ? p->pp : 1;
    s->stage = p->stage;
    int counts[PF_MAX_STAGES];
    if (s->pp > PF_MAX_STAGES) {
        TD_LOG_ERR("pp %d: at most %d stages", s->pp, PF_MAX_STAGES);
        rc = TD_EINVAL;
        goto fail;
    }
    if ((rc =
             pf_layer_partition(hp.n_layer, s->pp, p->partition, p->partition ? s->pp : 0, counts)))
        goto fail;
    if ((rc = pf_stage_range(counts, s->pp, s->stage, &s->l0, &s->l1))) goto fail;
    kn_shard shard = {.l0 = s->l0, .l1 = s->l1};
    if ((rc = kn_model_load(s->gguf, &shard, &s->model))) {
        TD_LOG_ERR("cannot load layers [%d, %d) of '%s': %s", s->l0, s->l1, p->model_path,
                   td_strerror(rc));
        goto fail;
    }
    s->threads = p->threads > 0 ? p->threads : 1;
    if ((rc = kn_cpu_create(s->threads, &s->cpu))) goto fail;
    if ((rc = kn_engine_create(s->model, kn_cpu_backend(s->cpu), NULL, &s->engine))) goto fail;
    s->ctx = p->ctx > 0 ? p->ctx : 8192;
    int bs = p->block_size > 0 ? p->block_size : 16;
    kn_kv_pool_params kp = kn_model_kv_params(s->model, (s->ctx + bs - 1) / bs, bs, p->kv_type);
    if ((rc = kn_kv_pool_create(&kp, &s->kv))) goto fail;
    return 0;
fail:
    pf_shard_close(s);
    return rc;
}

void pf_shard_close(pf_shard *s)
{
    kn_kv_pool_destroy(s->kv);
    kn_engine_destroy(s->engine);
    kn_cpu_destroy(s->cpu);
    kn_model_destroy(s->model);
    td_gguf_close(s->gguf);
    memset(s, 0, sizeof *s);
}
