/* cpu_pool.c: spin-then-sleep fork-join pool (see cpu_pool.h for the contract). */
#include "cpu_pool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

#include "td_err.h"

/* Spin iterations (each a pause, ~10-40 ns) before a worker sleeps: long enough to cover
 * the gap between two ops of a decode step and between two steps (waking a sleeping vCPU
 * costs tens to hundreds of microseconds), short enough that an idle server sleeps. */
#define POOL_SPIN 100000
/* While spinning, yield the core this often: when the machine is oversubscribed, the
 * thread we wait for may need our core to finish its part. */
#define POOL_YIELD_EVERY 1024

typedef struct {
    kn_pool *pool;
    int tid;
} worker_arg;

struct kn_pool {
    int n_threads;
    pthread_t *threads;
    worker_arg *args;
    /* the current job: written by the caller before gen is bumped */
    kn_pool_fn fn;
    void *arg;
    int64_t n;
    int n_active;        /* threads taking part in this job (<= n_threads) */
    atomic_uint gen;     /* job generation; workers wait for it to change */
    atomic_int pending;  /* workers of this job not finished yet */
    atomic_int sleeping; /* workers blocked (or about to block) on cv */
    atomic_bool stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

static void run_part(kn_pool *p, int tid)
{
    int64_t T = p->n_active;
    int64_t i0 = p->n * tid / T, i1 = p->n * (tid + 1) / T;
    if (i0 < i1) p->fn(p->arg, i0, i1, tid);
}

static void *worker_main(void *v)
{
    worker_arg *wa = v;
    kn_pool *p = wa->pool;
    unsigned last = 0;
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load(&p->gen)) == last && !atomic_load(&p->stop)) {
            if (++spins < POOL_SPIN) {
                if (spins % POOL_YIELD_EVERY == 0)
                    sched_yield();
                else
                    _mm_pause();
                continue;
            }
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleeping, 1);
            while (atomic_load(&p->gen) == last && !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv, &p->mu);
            atomic_fetch_sub(&p->sleeping, 1);
            pthread_mutex_unlock(&p->mu);
            spins = 0;
        }
        if (atomic_load(&p->stop)) break;
        last = g;
        /* every worker checks in for every job, active or not: the caller waits for all,
         * so no worker can still be reading this job's fields when the next is posted */
        if (wa->tid < p->n_active) run_part(p, wa->tid);
        atomic_fetch_sub_explicit(&p->pending, 1, memory_order_release);
    }
    return NULL;
}

int kn_pool_create(int n_threads, kn_pool **out)
{
    *out = NULL;
    if (n_threads < 1) return TD_EINVAL;
    kn_pool *p = calloc(1, sizeof *p);
    if (!p) return TD_ENOMEM;
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->threads = calloc((size_t)n_threads, sizeof *p->threads);
    p->args = calloc((size_t)n_threads, sizeof *p->args);
    if (!p->threads || !p->args) {
        kn_pool_destroy(p);
        return TD_ENOMEM;
    }
    for (int t = 1; t < n_threads; t++) {
        p->args[t] = (worker_arg){.pool = p, .tid = t};
        if (pthread_create(&p->threads[t], NULL, worker_main, &p->args[t])) {
            TD_LOG_ERR("cannot start pool thread %d", t);
            p->n_threads = t; /* join only the started ones */
            kn_pool_destroy(p);
            return TD_ENOMEM;
        }
    }
    *out = p;
    return 0;
}

void kn_pool_destroy(kn_pool *p)
{
    if (!p) return;
    if (p->threads) {
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->stop, true);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        for (int t = 1; t < p->n_threads; t++)
            if (p->threads[t]) pthread_join(p->threads[t], NULL);
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->threads);
    free(p->args);
    free(p);
}

void kn_pool_run(kn_pool *p, int64_t n, int64_t min_per_thread, kn_pool_fn fn, void *arg)
{
    if (n <= 0) return;
    if (min_per_thread < 1) min_per_thread = 1;
    int64_t want = n / min_per_thread;
    int active = want < 1 ? 1 : (want < p->n_threads ? (int)want : p->n_threads);
    if (active == 1) {
        fn(arg, 0, n, 0);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    p->n = n;
    p->n_active = active;
    atomic_store(&p->pending, p->n_threads - 1);
    atomic_fetch_add(&p->gen, 1);
    if (atomic_load(&p->sleeping) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    run_part(p, 0);
    for (unsigned spins = 1; atomic_load_explicit(&p->pending, memory_order_acquire) > 0; spins++) {
        if (spins % POOL_YIELD_EVERY == 0)
            sched_yield();
        else
            _mm_pause();
    }
}
