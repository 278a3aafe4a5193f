/* cpu_pool.h: a fork-join thread pool for the CPU backend's data-parallel kernels.
 *
 * Purpose: decode runs ~300 small ops per token; the fork/join cost must be a few
 * hundred nanoseconds, so idle workers spin briefly on a generation counter before they
 * sleep on a condition variable.
 * Invariants: kn_pool_run returns only after every thread finished its part; the caller
 * thread is thread 0 and does its share. Work is split statically: thread t of T gets
 * items [n*t/T, n*(t+1)/T).
 * Threading: one thread at a time calls kn_pool_run (the engine loop); fn must not call
 * kn_pool_run itself.
 * Ownership: kn_pool_create/kn_pool_destroy; destroy joins the workers.
 */
#ifndef KN_CPU_POOL_H
#define KN_CPU_POOL_H

#include <stdint.h>

typedef struct kn_pool kn_pool;

/* fn handles items [i0, i1) on thread tid (0..n_threads-1). */
typedef void (*kn_pool_fn)(void *arg, int64_t i0, int64_t i1, int tid);

int kn_pool_create(int n_threads, kn_pool **out); /* n_threads >= 1 */
void kn_pool_destroy(kn_pool *p);                 /* NULL is fine */

/* Run fn over [0, n) split across the threads. With n small (< n_threads * min_per_thread)
 * fewer threads take part, so tiny ops do not pay for waking everyone. */
void kn_pool_run(kn_pool *p, int64_t n, int64_t min_per_thread, kn_pool_fn fn, void *arg);

#endif
