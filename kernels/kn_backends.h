/* kn_backends.h: the backends this build has, and the one constructor that picks one by
 * name (kn_backend.h is the ops table they implement).
 *
 * Purpose: every process opens its backend here (through kn_runtime.h): the YAML's
 * `backend:` and the CLI's --backend name one. A backend that is not built in, or cannot
 * run on this machine, is a start-up error with its reason, never a silent fall-back.
 * Ownership: kn_backend_create fills *out, kn_backend_destroy frees it.
 */
#ifndef KN_BACKENDS_H
#define KN_BACKENDS_H

#include "kn_backend.h"

typedef struct {
    int n_threads; /* cpu: compute threads (<= 0: one per core) */
    int device;    /* cuda: device ordinal (< 0: rank % the devices this process sees) */
    int rank;      /* the process's TP rank (>= 0), for the default device: two ranks of one
                    * instance on a one-GPU machine share device 0 */
    const char *cpu_act; /* cpu, cpu-dev: "f32", "q8" or "q16" (kn_cpu_set_act); NULL: the
                          * TANDEM_CPU_ACT default. Not NULL with cuda: TD_EINVAL */
} kn_backend_options;

/* The names kn_backend_create knows, for messages: "cpu, cpu-dev, cuda" (cuda only when
 * built in). cpu-dev (cpu/cpu_dev.h) is the cpu backend behind a device backend's contract,
 * for testing the device paths (staging, collectives, KV upload) on machines without a GPU. */
const char *kn_backend_names(void);
/* Create backend `name` ("cpu", "cpu-dev" or "cuda"; NULL means "cpu"). Errors: TD_EINVAL for an
 * unknown name, TD_EUNSUPP (reason logged: not built in, no device, driver too old) when it cannot
 * run here, TD_ENOMEM. *out is zeroed on failure. */
int kn_backend_create(const char *name, const kn_backend_options *o, kn_backend *out);
/* Frees it (safe on a zeroed backend) and zeroes *b. */
void kn_backend_destroy(kn_backend *b);

/* What a backend computes with, for the nodes' Health (fields 27-33, docs/api.md "Metrics")
 * and logs: none of it changes while the process lives. Not while an op runs (the CPU
 * backend takes one caller at a time). */
typedef struct {
    const char *backend;     /* the backend's name: "cpu", "cuda", "cpu-dev" */
    const char *act;         /* the rest: the CPU backend's ("" for any other): "f32", "q8" or
                              * "q16" */
    const char *cpu_isa;     /* the CPU's, as the OS enables it (cpu_blas.h) */
    const char *kernels_isa; /* kn_cpu_isa() */
    char blas_core[64];      /* the OpenBLAS core in use */
    bool blas_older;         /* the BLAS core's instruction set is older than the CPU's */
    char paths[1024];        /* kn_cpu_describe_paths */
} kn_compute_info;
void kn_backend_compute_info(kn_backend be, kn_compute_info *out);

/* The CPU backend's thread pool, NULL for any other backend: host-side work between its
 * ops (sampling a batch's rows) runs on the same threads instead of starting its own.
 * Owned by the backend. */
struct kn_pool *kn_backend_host_pool(kn_backend be);

#endif
