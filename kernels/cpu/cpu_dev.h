/* cpu_dev.h: "cpu-dev", the cpu backend behind a device backend's contract, for testing the
 * device paths (batch staging, host-staged collectives, KV uploads) without a GPU.
 *
 * Purpose: a device backend (kn_backend.h: host_memory false) may only be handed its own
 * allocations and the host pointers of weights it has mapped; a GPU faults on anything else,
 * usually far from the cause. cpu-dev computes with the cpu backend's kernels but checks
 * every pointer each op is given: activations, batch arrays, seq views and their block
 * tables must lie inside its own allocations (alloc), weights must be mapped (map_matrix /
 * map_vector: it keeps private copies and reads those, as a GPU backend does). Any other
 * pointer is a violation: counted, the first one logged, and reported as the "asynchronous
 * error" of the next download or synchronize (TD_ESTATE), as a GPU reports a fault. Same
 * kernels and thread count as cpu: logits are bit-identical to the cpu backend's.
 * It is slower than cpu (weights copied, pointer checks, staging copies) and is for tests.
 * Invariants: allocations never overlap; a mapped copy is never handed out by alloc.
 * Threading: one thread drives it at a time (kn_backend.h).
 * Ownership: destroy frees the cpu backend, the weight copies and any buffer still allocated
 * (counted in the stats before, so a test can check nothing leaked).
 */
#ifndef KN_CPU_DEV_H
#define KN_CPU_DEV_H

#include <stdint.h>

#include "kn_backend.h"

typedef struct {
    int64_t n_violations; /* pointers that were not backend memory, or unmapped weights */
    char first[192];      /* the first violation, "" if none */
    int n_live;           /* buffers from alloc not yet freed */
    int n_mapped;         /* weight copies (map_matrix / map_vector) */
    int n_host_live;      /* host_alloc buffers not yet freed */
    uint64_t n_upload, bytes_upload;     /* host -> "device" copies, and bytes */
    uint64_t n_download, bytes_download; /* "device" -> host copies, and bytes */
} kn_cpudev_stats;

/* A cpu-dev backend over a cpu backend of n_threads (<= 0: one per core), its activation
 * mode cpu_act ("f32", "q8", "q16"; NULL: TANDEM_CPU_ACT's). 0, TD_ENOMEM. */
int kn_cpudev_create(int n_threads, const char *cpu_act, kn_backend *out);
/* b's counters; TD_EINVAL if b is not a cpu-dev backend. */
int kn_cpudev_stats_of(kn_backend b, kn_cpudev_stats *out);

#endif
