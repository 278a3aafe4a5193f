/* kn_backends.c: the one backend constructor (kn_backends.h). */
#include "kn_backends.h"

#include <stdio.h>
#include <string.h>

#include "cpu_backend.h"
#include "cpu_blas.h"
#include "cpu_dev.h"
#include "td_err.h"
#ifdef TANDEM_HAVE_CUDA
#include "cuda_backend.h"
#endif

const char *kn_backend_names(void)
{
#ifdef TANDEM_HAVE_CUDA
    return "cpu, cpu-dev, cuda";
#else
    return "cpu, cpu-dev";
#endif
}

int kn_backend_create(const char *name, const kn_backend_options *o, kn_backend *out)
{
    memset(out, 0, sizeof *out);
    kn_backend_options def = {.n_threads = 0, .device = -1, .rank = 0};
    if (!o) o = &def;
    const bool cpu = !name || !strcmp(name, "cpu"), cpudev = name && !strcmp(name, "cpu-dev");
    kn_cpu_act_mode act = KN_CPU_ACT_F32;
    if (o->cpu_act && kn_cpu_act_parse(o->cpu_act, &act)) {
        /* "auto" is resolved with the model, before this (kn_act_runtime_open) */
        TD_LOG_ERR("cpu_act '%s': expected f32, q8 or q16%s", o->cpu_act,
                   strcmp(o->cpu_act, "auto") ? "" : " (auto needs a model: kn_act_runtime_open)");
        return TD_EINVAL;
    }
    if (o->cpu_act && name && !strcmp(name, "cuda")) { /* other names: unknown, below */
        TD_LOG_ERR("cpu_act: only for the cpu backends, not '%s'", name);
        return TD_EINVAL;
    }
    if (cpu) {
        kn_cpu *c;
        int rc = kn_cpu_create(o->n_threads, &c);
        if (rc) return rc;
        if (o->cpu_act) kn_cpu_set_act(c, act);
        *out = kn_cpu_backend(c);
        return 0;
    }
    if (cpudev) return kn_cpudev_create(o->n_threads, o->cpu_act, out);
    if (!strcmp(name, "cuda")) {
#ifdef TANDEM_HAVE_CUDA
        return kn_cuda_create(o->device, o->rank, out);
#else
        TD_LOG_ERR("backend 'cuda': this build has no CUDA backend (it is built when CMake finds "
                   "nvcc, or with -DTANDEM_CUDA=ON); use backend 'cpu'");
        return TD_EUNSUPP;
#endif
    }
    TD_LOG_ERR("unknown backend '%s' (known: %s)", name, kn_backend_names());
    return TD_EINVAL;
}

void kn_backend_destroy(kn_backend *b)
{
    if (b && b->ops && b->ops->destroy) b->ops->destroy(b->ctx);
    if (b) memset(b, 0, sizeof *b);
}

void kn_backend_compute_info(kn_backend be, kn_compute_info *out)
{
    *out = (kn_compute_info){
        .backend = be.ops->name, .act = "", .cpu_isa = "", .kernels_isa = ""};
    const kn_cpu *cpu = kn_cpu_of(be);
    if (!cpu) return;
    kn_blas_info b;
    kn_blas_info_get(&b);
    out->act = kn_cpu_act_name(kn_cpu_act(cpu));
    out->cpu_isa = b.cpu_isa;
    out->kernels_isa = kn_cpu_isa();
    snprintf(out->blas_core, sizeof out->blas_core, "%s", b.core);
    out->blas_older = !b.fits;
    kn_cpu_describe_paths(cpu, out->paths, sizeof out->paths);
}

struct kn_pool *kn_backend_host_pool(kn_backend be)
{
    kn_cpu *cpu = kn_cpu_of(be);
    return cpu ? kn_cpu_pool(cpu) : NULL;
}
