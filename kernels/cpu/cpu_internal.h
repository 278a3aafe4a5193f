/* cpu_internal.h: the kn_cpu struct, shared by the CPU backend's files only. */
#ifndef KN_CPU_INTERNAL_H
#define KN_CPU_INTERNAL_H

#include <stddef.h>

#include "cpu_backend.h"

#define KN_CPU_MAX_THREADS 256

struct kn_cpu {
    kn_pool *pool;
    int n_threads;
    float *scratch[KN_CPU_MAX_THREADS];     /* per-thread float scratch, grown on demand */
    size_t scratch_cap[KN_CPU_MAX_THREADS]; /* floats */
};

/* Per-thread scratch of at least n_floats, 64-byte aligned; valid until the next call
 * with the same tid. NULL on allocation failure. Called from inside pool jobs: thread tid
 * only touches its own slot. */
float *kn_cpu_scratch(kn_cpu *c, int tid, size_t n_floats);

#endif
