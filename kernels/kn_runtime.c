/* kn_runtime.c: opening one shard of a model for compute (kn_runtime.h). */
#include "kn_runtime.h"

#include <string.h>

#include "cpu_backend.h"
#include "td_err.h"

int kn_runtime_open(kn_runtime *rt, const kn_runtime_params *p)
{
    memset(rt, 0, sizeof *rt);
    const char *who = p->who ? p->who : "tandem";
    /* the backend first: a backend that cannot run here fails before the model is read */
    int rc = kn_backend_create(p->backend, &p->backend_opts, &rt->be);
    if (rc) {
        TD_LOG_ERR("%s: cannot start backend '%s': %s", who, p->backend ? p->backend : "cpu",
                   td_strerror(rc));
        return rc;
    }
    char err[512];
    if ((rc = td_gguf_open(p->model_path, &rt->gguf, err, sizeof err))) {
        TD_LOG_ERR("%s: %s", who, err);
        goto fail;
    }
    if ((rc = kn_model_load(rt->gguf, &p->shard, &rt->model))) {
        TD_LOG_ERR("%s: cannot load layers [%d, %d) tp %d/%d of '%s': %s", who, p->shard.l0,
                   p->shard.l1, p->shard.tp_rank, p->shard.tp_size, p->model_path, td_strerror(rc));
        goto fail;
    }
    if ((rc = kn_engine_create(rt->model, rt->be, p->coll, &rt->engine))) {
        TD_LOG_ERR("%s: cannot create the engine: %s", who, td_strerror(rc));
        goto fail;
    }
    /* what runs: the CPU's features, the BLAS core, each weight type's kernels */
    const kn_cpu *cpu = kn_cpu_of(rt->be);
    if (cpu) kn_cpu_log_what_runs(cpu, who);
    return 0;
fail:
    kn_runtime_close(rt);
    return rc;
}

void kn_runtime_close(kn_runtime *rt)
{
    kn_engine_destroy(rt->engine);
    kn_backend_destroy(&rt->be);
    kn_model_destroy(rt->model);
    td_gguf_close(rt->gguf);
    memset(rt, 0, sizeof *rt);
}
