/* cpu_pool.h: a fork-join thread pool for the CPU backend's data-parallel kernels.
 *
 * Purpose: decode runs ~300 small ops per token; the fork/join cost must be a few
 * hundred nanoseconds on a quiet machine, and the pool must not collapse when it shares
 * its cores with other busy processes (prefill stages, decode ranks, builds). So every wait
 * spins briefly and then blocks on a futex: idle workers wait for the next job, the caller
 * waits for the parts workers took. A part whose worker has not claimed it by the time the
 * caller finished its own is run by the caller (a descheduled or sleeping worker does not
 * hold the job up).
 * Invariants: kn_pool_run returns only after every part ran; each part [n*t/T, n*(t+1)/T)
 * of T active parts runs exactly once, as fn(arg, i0, i1, t), on one thread (its worker, or
 * the caller, which always runs part 0); no two parts with the same t of one job exist, so
 * scratch indexed by t is never shared. Spin budget: TANDEM_POOL_SPIN_US (microseconds of
 * spinning before a wait blocks; 0 blocks at once), read at kn_pool_create; default
 * KN_POOL_SPIN_US_DEFAULT (see BENCHMARKS.md "Engine" for how it was chosen).
 * Threading: one thread at a time calls kn_pool_run (the engine loop); fn must not call
 * kn_pool_run itself.
 * Ownership: kn_pool_create/kn_pool_destroy; destroy joins the workers.
 */
#ifndef KN_CPU_POOL_H
#define KN_CPU_POOL_H

#include <stdint.h>

#define KN_POOL_SPIN_US_DEFAULT 200

typedef struct kn_pool kn_pool;

/* fn handles items [i0, i1) as part tid (0..n_threads-1). */
typedef void (*kn_pool_fn)(void *arg, int64_t i0, int64_t i1, int tid);

/* n_threads >= 1. TD_EINVAL for a bad n_threads or a TANDEM_POOL_SPIN_US that is not a
 * number in [0, 1000000]. */
int kn_pool_create(int n_threads, kn_pool **out);
void kn_pool_destroy(kn_pool *p); /* NULL is fine */

/* Run fn over [0, n) split across the threads. With n small (< n_threads * min_per_thread)
 * fewer threads take part, so tiny ops do not pay for waking everyone. */
void kn_pool_run(kn_pool *p, int64_t n, int64_t min_per_thread, kn_pool_fn fn, void *arg);

/* At most n (clamped to [1, n_threads]) threads take part in the runs that start after this;
 * the others stay blocked. For sharing the cores with other busy processes (the decode node's
 * thread choice, decode-node/dc_threads.h). It changes only how [0, n) is split: the CPU
 * backend's kernels give each item (a row of W or of x, a head) the same bits however it is
 * split, and cpu_attention.c cuts its work by n_threads (kn_cpu_n_threads), not by the limit,
 * so no result depends on it (tests/decode/test_sched.c checks whole requests). Any thread;
 * read at the start of each run.
 * kn_pool_limit: the limit now (n_threads when none was set). */
void kn_pool_set_limit(kn_pool *p, int n);
int kn_pool_limit(const kn_pool *p);

/* A gate the caller passes at the start of every run (n > 0), before any thread takes part:
 * gate(ctx) may block, so the process's compute pauses between two ops (a prefill stage
 * waiting while a decode step beside it holds the cores: common/td_coreshare.h). NULL: none.
 * Set before the runs it should see, from the thread that calls kn_pool_run (or before that
 * thread starts); not thread-safe against a run in progress. */
typedef void (*kn_pool_gate_fn)(void *ctx);
void kn_pool_set_gate(kn_pool *p, kn_pool_gate_fn gate, void *ctx);

/* Counters for profiling, kept only when TANDEM_CPU_PROFILE is set (non-empty, not "0") at
 * kn_pool_create; all zero otherwise. With it set, kn_pool_destroy prints them to stderr. */
typedef struct {
    uint64_t runs;       /* kn_pool_run calls with n > 0 */
    uint64_t dispatches; /* of those, the ones that woke workers (more than one part) */
    uint64_t stolen;     /* worker parts the caller ran itself */
    uint64_t run_ns;     /* wall time inside dispatching runs, caller's view */
    uint64_t wait_ns;    /* of that, the caller waiting for workers after its own parts */
} kn_pool_stats;
void kn_pool_get_stats(const kn_pool *p, kn_pool_stats *out);

#endif
