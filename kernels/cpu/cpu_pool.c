/* cpu_pool.c: spin-then-futex fork-join pool with part stealing (contract in cpu_pool.h).
 *
 * Job protocol. The caller writes the job (fn, arg, n, n_active), marks each worker part
 * t in [1, n_active) available (slot[t] = 2*job, even), then bumps gen (the futex word the
 * idle workers wait on). A part is claimed by whoever moves slot[t] from 2*job to 2*job+1
 * first: its worker, or the caller once it finished part 0. The job's fields stay unchanged
 * until every part was claimed and finished (`pending` counts the parts workers claimed and
 * have not finished), so a worker that claimed a part reads the job it claimed. Workers
 * never check in for jobs they take no part in.
 *
 * Waits (both spin for spin_ns, pausing and yielding now and then, then block):
 *   worker: gen unchanged        -> futex_wait(gen);     woken by kn_pool_run if sleeping > 0
 *   caller: pending > 0          -> futex_wait(pending); woken by the worker that ends it
 * Each side announces it may sleep (sleeping / caller_waits) before it re-checks its
 * condition, and the other side publishes before it reads that announcement (all seq_cst),
 * so a wake-up is never lost; futex_wait returns at once if the word already changed. */
#define _GNU_SOURCE
#include "cpu_pool.h"

#include <errno.h>
#include <immintrin.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "td_clock.h"
#include "td_err.h"
#include "td_futex.h"

/* While spinning, yield the core this often (pauses): when the machine is oversubscribed,
 * the thread we wait for may need our core. The clock is read every POOL_CLOCK_EVERY. */
#define POOL_YIELD_EVERY 1024
#define POOL_CLOCK_EVERY 64

typedef struct {
    kn_pool *pool;
    int tid;
} worker_arg;

struct kn_pool {
    int n_threads;
    int64_t spin_ns; /* spinning before a wait blocks */
    pthread_t *threads;
    worker_arg *args;
    _Atomic uint64_t *slot; /* (n_threads) part t of job j: 2j available, 2j+1 claimed */
    /* the current job: written by the caller before gen is bumped */
    kn_pool_fn fn;
    void *arg;
    int64_t n;
    int n_active;            /* parts of this job (<= n_threads) */
    uint64_t job;            /* job number, from 1 */
    atomic_uint gen;         /* futex word: bumped per job and at stop */
    atomic_uint pending;     /* futex word: parts workers claimed and have not finished */
    atomic_int sleeping;     /* workers blocked (or about to block) on gen */
    atomic_int caller_waits; /* the caller blocked (or about to block) on pending */
    atomic_bool stop;
    atomic_int limit;     /* kn_pool_set_limit: most threads a run uses (0: n_threads) */
    kn_pool_gate_fn gate; /* kn_pool_set_gate: called by the caller before each run, or NULL */
    void *gate_ctx;
    bool profile;        /* TANDEM_CPU_PROFILE: keep stats */
    kn_pool_stats stats; /* caller-side only */
};

/* One step of a spin: pause, or yield now and then. False once spin_ns passed since
 * *t0 (set on the first call, *t0 == 0). */
static bool spin_step(const kn_pool *p, unsigned *i, int64_t *t0)
{
    ++*i;
    if (*i % POOL_CLOCK_EVERY == 0) {
        int64_t now = td_now_ns();
        if (!*t0) *t0 = now;
        if (now - *t0 >= p->spin_ns) return false;
    }
    if (*i % POOL_YIELD_EVERY == 0)
        sched_yield();
    else
        _mm_pause();
    return true;
}

static void run_part(kn_pool *p, int tid)
{
    int64_t T = p->n_active;
    int64_t i0 = p->n * tid / T, i1 = p->n * (tid + 1) / T;
    if (i0 < i1) p->fn(p->arg, i0, i1, tid);
}

/* Claim part tid if it is available: true if this thread now owns it. */
static bool claim(kn_pool *p, int tid)
{
    uint64_t v = atomic_load(&p->slot[tid]);
    return !(v & 1) && atomic_compare_exchange_strong(&p->slot[tid], &v, v | 1);
}

/* Worker: wait until gen differs from last (or stop); returns the gen seen. */
static unsigned worker_wait(kn_pool *p, unsigned last)
{
    unsigned g, i = 0;
    int64_t t0 = 0;
    if (p->spin_ns > 0)
        while ((g = atomic_load(&p->gen)) == last)
            if (!spin_step(p, &i, &t0)) break;
    atomic_fetch_add(&p->sleeping, 1);
    while ((g = atomic_load(&p->gen)) == last)
        td_futex_wait(&p->gen, last, -1, false);
    atomic_fetch_sub(&p->sleeping, 1);
    return g;
}

static void part_done(kn_pool *p)
{
    if (atomic_fetch_sub(&p->pending, 1) == 1 && atomic_load(&p->caller_waits))
        td_futex_wake(&p->pending, 1, false);
}

static void *worker_main(void *v)
{
    worker_arg *wa = v;
    kn_pool *p = wa->pool;
    unsigned last = 0;
    for (;;) {
        last = worker_wait(p, last);
        if (atomic_load(&p->stop)) break;
        if (claim(p, wa->tid)) {
            run_part(p, wa->tid);
            part_done(p);
        }
    }
    return NULL;
}

/* Parse TANDEM_POOL_SPIN_US; TD_EINVAL if set and not a number in [0, 1e6]. */
static int spin_budget(int64_t *ns)
{
    const char *s = getenv("TANDEM_POOL_SPIN_US");
    *ns = (int64_t)KN_POOL_SPIN_US_DEFAULT * 1000;
    if (!s || !*s) return 0;
    char *end;
    errno = 0;
    long us = strtol(s, &end, 10);
    if (errno || *end || us < 0 || us > 1000000) {
        TD_LOG_ERR("TANDEM_POOL_SPIN_US='%s': expected microseconds in [0, 1000000]", s);
        return TD_EINVAL;
    }
    *ns = (int64_t)us * 1000;
    return 0;
}

int kn_pool_create(int n_threads, kn_pool **out)
{
    *out = NULL;
    if (n_threads < 1) return TD_EINVAL;
    int64_t spin_ns;
    int rc = spin_budget(&spin_ns);
    if (rc) return rc;
    kn_pool *p = calloc(1, sizeof *p);
    if (!p) return TD_ENOMEM;
    p->n_threads = n_threads;
    p->spin_ns = spin_ns;
    const char *prof = getenv("TANDEM_CPU_PROFILE");
    p->profile = prof && *prof && strcmp(prof, "0");
    p->threads = calloc((size_t)n_threads, sizeof *p->threads);
    p->args = calloc((size_t)n_threads, sizeof *p->args);
    p->slot = calloc((size_t)n_threads, sizeof *p->slot);
    if (!p->threads || !p->args || !p->slot) {
        kn_pool_destroy(p);
        return TD_ENOMEM;
    }
    for (int t = 0; t < n_threads; t++)
        atomic_store(&p->slot[t], 1); /* job 0, claimed: nothing to take */
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

void kn_pool_set_limit(kn_pool *p, int n)
{
    atomic_store_explicit(&p->limit,
                          n < 1              ? 1
                          : n > p->n_threads ? p->n_threads
                                             : n,
                          memory_order_relaxed);
}

void kn_pool_set_gate(kn_pool *p, kn_pool_gate_fn gate, void *ctx)
{
    p->gate = gate;
    p->gate_ctx = ctx;
}

int kn_pool_limit(const kn_pool *p)
{
    int n = atomic_load_explicit(&p->limit, memory_order_relaxed);
    return n > 0 ? n : p->n_threads;
}

void kn_pool_get_stats(const kn_pool *p, kn_pool_stats *out)
{
    *out = p->stats;
}

void kn_pool_destroy(kn_pool *p)
{
    if (!p) return;
    if (p->profile) {
        const kn_pool_stats *st = &p->stats;
        fprintf(stderr,
                "cpu pool profile (%d threads): %llu runs, %llu dispatches, %llu parts stolen, "
                "%.1f ms in dispatches, %.1f ms of it waiting for workers\n",
                p->n_threads, (unsigned long long)st->runs, (unsigned long long)st->dispatches,
                (unsigned long long)st->stolen, st->run_ns / 1e6, st->wait_ns / 1e6);
    }
    if (p->threads) {
        atomic_store(&p->stop, true);
        atomic_fetch_add(&p->gen, 1);
        td_futex_wake(&p->gen, INT_MAX, false);
        for (int t = 1; t < p->n_threads; t++)
            if (p->threads[t]) pthread_join(p->threads[t], NULL);
    }
    free(p->threads);
    free(p->args);
    free((void *)p->slot);
    free(p);
}

/* Caller: wait until the parts workers claimed are finished. */
static void caller_wait(kn_pool *p)
{
    unsigned v, i = 0;
    int64_t t0 = 0;
    if (p->spin_ns > 0)
        while (atomic_load(&p->pending) > 0)
            if (!spin_step(p, &i, &t0)) break;
    atomic_store(&p->caller_waits, 1);
    while ((v = atomic_load(&p->pending)) > 0)
        td_futex_wait(&p->pending, v, -1, false);
    atomic_store(&p->caller_waits, 0);
}

void kn_pool_run(kn_pool *p, int64_t n, int64_t min_per_thread, kn_pool_fn fn, void *arg)
{
    if (n <= 0) return;
    if (p->gate) p->gate(p->gate_ctx);
    if (min_per_thread < 1) min_per_thread = 1;
    int64_t want = n / min_per_thread;
    int most = atomic_load_explicit(&p->limit, memory_order_relaxed);
    if (most <= 0 || most > p->n_threads) most = p->n_threads;
    int active = want < 1 ? 1 : (want < most ? (int)want : most);
    if (p->profile) p->stats.runs++;
    if (active == 1) {
        fn(arg, 0, n, 0);
        return;
    }
    const int64_t t0 = p->profile ? td_now_ns() : 0;
    p->fn = fn;
    p->arg = arg;
    p->n = n;
    p->n_active = active;
    p->job++;
    atomic_store(&p->pending, (unsigned)(active - 1));
    for (int t = 1; t < active; t++)
        atomic_store(&p->slot[t], 2 * p->job);
    atomic_fetch_add(&p->gen, 1);
    if (atomic_load(&p->sleeping) > 0) td_futex_wake(&p->gen, INT_MAX, false);
    run_part(p, 0);
    for (int t = 1; t < active; t++)
        if (claim(p, t)) { /* its worker has not started: run it here */
            run_part(p, t);
            atomic_fetch_sub(&p->pending, 1);
            if (p->profile) p->stats.stolen++;
        }
    const int64_t t1 = p->profile ? td_now_ns() : 0;
    caller_wait(p);
    if (p->profile) {
        const int64_t t2 = td_now_ns();
        p->stats.dispatches++;
        p->stats.run_ns += (uint64_t)(t2 - t0);
        p->stats.wait_ns += (uint64_t)(t2 - t1);
    }
}
