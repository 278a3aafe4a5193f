/* test_pool.c: the CPU backend's fork-join pool (kernels/cpu/cpu_pool.h): every item runs
 * exactly once in its static part, idle workers sleep, a caller waiting for a slow worker
 * blocks instead of spinning, the spin budget's environment variable. */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cpu_pool.h"
#include "td_err.h"

static int g_fail;
#define CHECK(c, ...)                                                                              \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                   \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            g_fail = 1;                                                                            \
        }                                                                                          \
    } while (0)

static double cpu_ms(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* --- every item once, in its part --------------------------------------------------- */

typedef struct {
    atomic_int *hits;     /* (n) */
    atomic_int parts[16]; /* calls per part */
    int64_t n;
    int active;
    atomic_int bad; /* a range that is not its part's static range */
} cover_job;

static void cover_fn(void *arg, int64_t i0, int64_t i1, int tid)
{
    cover_job *j = arg;
    int64_t T = j->active;
    if (tid < 0 || tid >= T || i0 != j->n * tid / T || i1 != j->n * (tid + 1) / T)
        atomic_fetch_add(&j->bad, 1);
    else
        atomic_fetch_add(&j->parts[tid], 1);
    for (int64_t i = i0; i < i1; i++)
        atomic_fetch_add(&j->hits[i], 1);
}

/* limit > 0: kn_pool_set_limit(limit) first, so at most that many parts a run */
static void test_cover(int threads, const char *spin_us, int limit)
{
    setenv("TANDEM_POOL_SPIN_US", spin_us, 1);
    kn_pool *p;
    CHECK(kn_pool_create(threads, &p) == 0, "create %d threads", threads);
    int most = threads;
    if (limit > 0) {
        kn_pool_set_limit(p, limit);
        most = limit < threads ? limit : threads;
    }
    CHECK(kn_pool_limit(p) == most, "limit %d of %d threads reads %d", limit, threads,
          kn_pool_limit(p));
    unsigned x = 12345;
    enum { MAXN = 3000 };
    atomic_int *hits = calloc(MAXN, sizeof *hits);
    for (int it = 0; it < 3000 && !g_fail; it++) {
        x = x * 1103515245u + 12345u;
        int64_t n = 1 + (x >> 8) % MAXN;
        int64_t mpt = (int64_t[]){1, 16, 700}[(x >> 4) % 3];
        int64_t want = n / mpt;
        cover_job j = {.hits = hits, .n = n};
        j.active = want < 1 ? 1 : (want < most ? (int)want : most);
        for (int64_t i = 0; i < n; i++)
            atomic_store(&hits[i], 0);
        kn_pool_run(p, n, mpt, cover_fn, &j);
        CHECK(atomic_load(&j.bad) == 0, "t%d n %lld: a call outside its part", threads,
              (long long)n);
        for (int t = 0; t < j.active; t++)
            CHECK(atomic_load(&j.parts[t]) == (n * (t + 1) / j.active > n * t / j.active),
                  "t%d n %lld part %d ran %d times", threads, (long long)n, t,
                  atomic_load(&j.parts[t]));
        for (int64_t i = 0; i < n; i++)
            if (atomic_load(&hits[i]) != 1) {
                CHECK(0, "t%d n %lld item %lld ran %d times", threads, (long long)n, (long long)i,
                      atomic_load(&hits[i]));
                break;
            }
    }
    free(hits);
    kn_pool_destroy(p);
    unsetenv("TANDEM_POOL_SPIN_US");
}

/* --- waits block -------------------------------------------------------------------- */

static void noop_fn(void *arg, int64_t i0, int64_t i1, int tid)
{
    (void)arg, (void)i0, (void)i1, (void)tid;
}

/* An idle pool: its workers cost (next to) no CPU time once the spin budget passed. */
static void test_idle(void)
{
    kn_pool *p;
    CHECK(kn_pool_create(4, &p) == 0, "create");
    kn_pool_run(p, 4, 1, noop_fn, NULL);
    usleep(20000); /* past the spin budget (<= 1 ms by default) */
    double c0 = cpu_ms(CLOCK_PROCESS_CPUTIME_ID);
    usleep(200000);
    double used = cpu_ms(CLOCK_PROCESS_CPUTIME_ID) - c0;
    printf("idle pool, 4 threads: %.2f ms of CPU time in 200 ms\n", used);
    CHECK(used < 10, "an idle pool used %.1f ms of CPU time in 200 ms", used);
    kn_pool_destroy(p);
}

typedef struct {
    atomic_int started; /* part 1 began (so its worker claimed it) */
} slow_job;

static void slow_fn(void *arg, int64_t i0, int64_t i1, int tid)
{
    (void)i0, (void)i1;
    slow_job *j = arg;
    if (tid == 1) {
        atomic_store(&j->started, 1);
        usleep(200000);
    } else {
        while (!atomic_load(&j->started)) /* let the worker claim part 1 */
            usleep(200);
    }
}

/* The caller waiting 200 ms for a worker's part sleeps rather than spins. */
static void test_caller_blocks(void)
{
    kn_pool *p;
    CHECK(kn_pool_create(2, &p) == 0, "create");
    slow_job j = {0};
    double c0 = cpu_ms(CLOCK_THREAD_CPUTIME_ID);
    kn_pool_run(p, 2, 1, slow_fn, &j);
    double used = cpu_ms(CLOCK_THREAD_CPUTIME_ID) - c0;
    printf("caller waiting 200 ms for a worker: %.2f ms of CPU time\n", used);
    CHECK(used < 20, "the waiting caller used %.1f ms of CPU time", used);
    kn_pool_destroy(p);
}

static void test_env(void)
{
    kn_pool *p = (kn_pool *)1;
    const char *bad[] = {"-1", "abc", "5x", "2000000"};
    for (int i = 0; i < 4; i++) {
        setenv("TANDEM_POOL_SPIN_US", bad[i], 1);
        CHECK(kn_pool_create(2, &p) == TD_EINVAL && !p, "TANDEM_POOL_SPIN_US=%s accepted", bad[i]);
    }
    unsetenv("TANDEM_POOL_SPIN_US");
    CHECK(kn_pool_create(0, &p) == TD_EINVAL, "0 threads accepted");
}

int main(void)
{
    for (int t = 1; t <= 4; t++) {
        test_cover(t, "200", 0);
        test_cover(t, "0", 0);       /* every wait blocks at once */
        for (int l = 1; l <= 5; l++) /* 5: clamped to the threads */
            test_cover(t, l % 2 ? "200" : "0", l);
    }
    test_idle();
    test_caller_blocks();
    test_env();
    if (g_fail) return 1;
    printf("test_pool: ok\n");
    return 0;
}
