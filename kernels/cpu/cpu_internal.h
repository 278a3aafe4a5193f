/* cpu_internal.h: the kn_cpu struct, shared by the CPU backend's files only. */
#ifndef KN_CPU_INTERNAL_H
#define KN_CPU_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>

#include "cpu_backend.h"

#define KN_CPU_MAX_THREADS 256
/* The scratch slot of the thread that calls an op, for use outside pool jobs. */
#define KN_CPU_CALLER KN_CPU_MAX_THREADS

struct kn_cpu {
    kn_pool *pool;
    int n_threads;
    bool act_q8; /* quantize x to 8 bits on the dot path (kn_cpu_set_act_q8) */
    float *scratch[KN_CPU_MAX_THREADS + 1];     /* per-thread float scratch, grown on demand;
                                                   the last slot is KN_CPU_CALLER's */
    size_t scratch_cap[KN_CPU_MAX_THREADS + 1]; /* floats */
};

/* Per-thread scratch of at least n_floats, 64-byte aligned; valid until the next call
 * with the same tid. NULL on allocation failure. Called from inside pool jobs: thread tid
 * only touches its own slot; tid KN_CPU_CALLER is the calling thread's, outside jobs. */
float *kn_cpu_scratch(kn_cpu *c, int tid, size_t n_floats);

#endif
