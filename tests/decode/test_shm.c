/* test_shm.c: the decode instance's shared-memory collective (decode-node/dc_shm.h).
 *
 * Ranks run as threads of this process and as forked processes (tp 1..4, started in random
 * order with delays). Checked: allreduce results are bit-identical to the rank-order float
 * sum on every rank and close to the double sum, for many sizes (both allreduce schemes);
 * plans arrive intact and in order; stop ends the followers; a rank that never comes times
 * out with a message naming it; a SIGKILLed rank is reported by the others within a second,
 * also mid-allreduce; a SIGSTOPped rank is "not answering" after the op timeout; an idle
 * follower uses < 5% of a core; stale segments of a killed run (and garbage) do not stop a
 * new run; bad sizes, mismatched layouts, duplicate ranks, leaving without stop, interrupt;
 * re-forming: the rendezvous in slices (dc_shm_begin/gather) stays intact, a rank that
 * joined and died is noticed, its restarted process waits for and joins the next segment,
 * a follower waiting without limit ends when rank 0 gives the segment up or dies (and
 * then removes the name rank 0 left behind); the column gather of the vocab-parallel LM
 * head: rank 0 gets every rank's columns bit for bit (uneven parts, parts larger than the
 * slot in pieces, interleaved with allreduces), the others' output is left alone, and a
 * gather paired with an allreduce breaks the instance. The split allreduce (post, then wait,
 * two in flight, blocking allreduces and gathers between them, ranks that run ahead by a
 * random delay) gives the blocking one's bits; a third post, or a wait out of order, breaks
 * the instance, and a segment opened without split_allreduce refuses a post.
 * usage: test_shm            run the tests
 *        test_shm --bench    allreduce latency (tp 2, n = 576 and 576 * 64)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../tharness.h"
#include "dc_shm.h"
#include "td_clock.h"
#include "td_err.h"

#define MAXF     (576 * 64) /* floats: 64 tokens of the default model's hidden size */
#define MAX_PLAN 4096
#define MAX_TP   4

/* Results of one rank, in memory shared with forked children. */
typedef struct {
    int rc;          /* last status of the call under test */
    int fails;       /* checks that failed in the rank */
    int64_t t_ns;    /* CLOCK_MONOTONIC when the call under test returned */
    uint64_t hash;   /* of every allreduce result, in order */
    uint64_t cpu_ns; /* CPU time of the measured wait */
    int64_t iters;   /* allreduces done */
    dc_shm_stats stats;
} rank_out;

static rank_out *outs; /* (MAX_TP + 1) */
static char tmpdir[64];

static void sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void new_token(char *tok, size_t cap)
{
    static int counter;
    snprintf(tok, cap, "t%d-%d", (int)getpid(), counter++);
}

static dc_shm_params params(const char *token, int rank, int tp)
{
    return (dc_shm_params){.instance = "d0",
                           .token = token,
                           .rank = rank,
                           .tp = tp,
                           .max_floats = MAXF,
                           .max_plan = MAX_PLAN,
                           .timeout_ms = 10000,
                           .op_timeout_ms = 10000};
}

/* ---- running ranks as threads or processes ---- */

typedef int (*rank_fn)(int rank, void *ctx);

typedef struct {
    rank_fn fn;
    void *ctx;
    int rank, delay_ms;
    pthread_t th;
} thread_rank;

static void *thread_main(void *arg)
{
    thread_rank *t = arg;
    if (t->delay_ms) sleep_ms(t->delay_ms);
    outs[t->rank].fails += t->fn(t->rank, t->ctx) != 0;
    return NULL;
}

/* Run tp ranks as threads; delays (ms) may be NULL. Returns the number of failed ranks. */
static int run_threads(int tp, rank_fn fn, void *ctx, const int *delays)
{
    thread_rank t[MAX_TP + 1];
    for (int r = 0; r < tp; r++) {
        t[r] = (thread_rank){.fn = fn, .ctx = ctx, .rank = r, .delay_ms = delays ? delays[r] : 0};
        pthread_create(&t[r].th, NULL, thread_main, &t[r]);
    }
    int bad = 0;
    for (int r = 0; r < tp; r++) {
        pthread_join(t[r].th, NULL);
        bad += outs[r].fails != 0;
    }
    return bad;
}

static void log_path(char *buf, size_t cap, int rank)
{
    snprintf(buf, cap, "%s/rank%d.log", tmpdir, rank);
}

/* Fork one rank (stderr to its log file when logged), after delay_ms. */
static pid_t spawn(int rank, rank_fn fn, void *ctx, int delay_ms, bool logged)
{
    fflush(stderr);
    pid_t pid = fork();
    if (pid != 0) return pid;
    if (logged) {
        char path[128];
        log_path(path, sizeof path, rank);
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) dup2(fd, 2);
    }
    if (delay_ms) sleep_ms(delay_ms);
    int rc = fn(rank, ctx);
    outs[rank].fails += rc != 0;
    _exit(rc ? 1 : 0);
}

/* Wait for a child for up to ms; a hung child is killed and counted as failed. */
static int reap(pid_t pid, int ms)
{
    int64_t end = td_now_ns() + (int64_t)ms * 1000000;
    int status;
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (td_now_ns() > end) {
            fprintf(stderr, "child %d hung: killing it\n", (int)pid);
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return -1;
        }
        sleep_ms(2);
    }
}

static int run_procs(int tp, rank_fn fn, void *ctx, const int *delays, int limit_ms)
{
    pid_t pids[MAX_TP + 1];
    for (int r = 0; r < tp; r++)
        pids[r] = spawn(r, fn, ctx, delays ? delays[r] : 0, false);
    int bad = 0;
    for (int r = 0; r < tp; r++)
        bad += reap(pids[r], limit_ms) != 0;
    return bad;
}

static bool log_has_q(int rank, const char *needle, bool quiet)
{
    char path[128], buf[8192];
    log_path(path, sizeof path, rank);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    if (!strstr(buf, needle)) {
        if (!quiet) fprintf(stderr, "rank %d log lacks \"%s\":\n%s", rank, needle, buf);
        return false;
    }
    return true;
}

static bool log_has(int rank, const char *needle)
{
    return log_has_q(rank, needle, false);
}

static void reset_outs(void)
{
    memset(outs, 0, sizeof *outs * (MAX_TP + 1));
}

/* ---- allreduce + plan workload ---- */

typedef struct {
    char token[64];
    int tp, iters;
    uint64_t seed;
    int spin_us;
} ar_ctx;

/* The size of iteration it: mostly decode-sized, some large (two-phase path), edges. */
static int64_t pick_n(const ar_ctx *c, int it)
{
    uint64_t h = mix(c->seed ^ (uint64_t)it * 7919);
    if (it == 0) return 576;
    if (it == 1) return MAXF;
    if (it % 23 == 5) return 0;
    if (it % 5 == 2) return (int64_t)(h % MAXF) + 1;
    return (int64_t)(h % 1200) + 1;
}

/* Rank r's input of iteration it: varied magnitudes, so the summation order matters. */
static void fill(const ar_ctx *c, int r, int it, float *x, int64_t n)
{
    uint64_t base = mix(c->seed ^ ((uint64_t)r << 48) ^ (uint64_t)it);
    for (int64_t i = 0; i < n; i++) {
        uint64_t h = mix(base + (uint64_t)i);
        float v = (float)((int64_t)(h >> 40) - (1 << 23)) / (float)(1 << 23);
        x[i] = ldexpf(v, (int)(h & 15) - 8);
    }
}

static void fill_plan(uint8_t *p, size_t len, int it)
{
    for (size_t j = 0; j < len; j++)
        p[j] = (uint8_t)(it * 31 + (int)j * 7);
}

static int body_allreduce(int rank, void *vctx)
{
    const ar_ctx *c = vctx;
    dc_shm_params p = params(c->token, rank, c->tp);
    p.spin_us = c->spin_us;
    dc_shm *s;
    int rc = dc_shm_open(&p, &s);
    if (rc) {
        fprintf(stderr, "rank %d: open: %s\n", rank, td_strerror(rc));
        return 1;
    }
    float *buf = malloc(MAXF * sizeof *buf), *ref = malloc(MAXF * sizeof *ref);
    float *tmp = malloc(MAXF * sizeof *tmp);
    double *dref = malloc(MAXF * sizeof *dref), *mag = malloc(MAXF * sizeof *mag);
    uint8_t plan[MAX_PLAN];
    int fails = 0;
    uint64_t hash = 1469598103934665603ull;
    for (int it = 0; it < c->iters && !fails; it++) {
        int64_t n = pick_n(c, it);
        size_t plen = (size_t)(mix((uint64_t)it) % (MAX_PLAN + 1));
        if (rank == 0) {
            fill_plan(plan, plen, it);
            memcpy(plan, &n, plen >= sizeof n ? sizeof n : 0);
            if ((rc = dc_shm_plan_publish(s, plan, plen))) {
                fprintf(stderr, "rank 0: publish %d: %s\n", it, td_strerror(rc));
                fails++;
                break;
            }
        } else {
            const void *got;
            size_t glen;
            if ((rc = dc_shm_plan_wait(s, 5000, &got, &glen))) {
                fprintf(stderr, "rank %d: plan_wait %d: %d\n", rank, it, rc);
                fails++;
                break;
            }
            fill_plan(plan, plen, it);
            memcpy(plan, &n, plen >= sizeof n ? sizeof n : 0);
            if (glen != plen || (plen && memcmp(got, plan, plen))) {
                fprintf(stderr, "rank %d: plan %d differs (%zu vs %zu bytes)\n", rank, it, glen,
                        plen);
                fails++;
            }
        }
        fill(c, rank, it, buf, n);
        rc = dc_shm_allreduce(s, buf, n);
        if (rc) {
            fprintf(stderr, "rank %d: allreduce %d: %s\n", rank, it, td_strerror(rc));
            fails++;
            break;
        }
        /* the rank-order float sum, and the exact-ish double sum */
        for (int r = 0; r < c->tp; r++) {
            fill(c, r, it, tmp, n);
            for (int64_t i = 0; i < n; i++) {
                ref[i] = r ? ref[i] + tmp[i] : tmp[i];
                dref[i] = r ? dref[i] + tmp[i] : tmp[i];
                mag[i] = r ? mag[i] + fabs(tmp[i]) : fabs(tmp[i]);
            }
        }
        if (n && memcmp(buf, ref, (size_t)n * sizeof *buf)) {
            fprintf(stderr, "rank %d: allreduce %d (n %lld) not bit-identical\n", rank, it,
                    (long long)n);
            fails++;
        }
        for (int64_t i = 0; i < n; i++)
            if (fabs(buf[i] - dref[i]) > 1e-6 * mag[i]) {
                fprintf(stderr, "rank %d: allreduce %d [%lld] %g vs %g\n", rank, it, (long long)i,
                        buf[i], dref[i]);
                fails++;
                break;
            }
        const uint8_t *b = (const uint8_t *)buf;
        for (size_t i = 0; i < (size_t)n * sizeof *buf; i++)
            hash = (hash ^ b[i]) * 1099511628211ull;
        outs[rank].iters++;
    }
    if (!fails) {
        if (rank == 0) {
            if ((rc = dc_shm_plan_stop(s))) fails++;
        } else {
            const void *got;
            size_t glen;
            if ((rc = dc_shm_plan_wait(s, 5000, &got, &glen)) != DC_SHM_STOP) {
                fprintf(stderr, "rank %d: expected stop, got %d\n", rank, rc);
                fails++;
            }
            /* after stop: no more collectives */
            if (dc_shm_plan_wait(s, 0, &got, &glen) != DC_SHM_STOP) fails++;
        }
        if (c->tp > 1 && dc_shm_allreduce(s, buf, 1) != TD_ESTATE) fails++;
    }
    outs[rank].hash = hash;
    dc_shm_get_stats(s, &outs[rank].stats);
    dc_shm_close(s);
    free(buf);
    free(ref);
    free(tmp);
    free(dref);
    free(mag);
    return fails;
}

static void check_same_hash(int tp)
{
    for (int r = 1; r < tp; r++)
        TH_CHECK(outs[r].hash == outs[0].hash);
}

static bool segment_exists(const char *token)
{
    char name[160];
    snprintf(name, sizeof name, "/tandem-d0-%s", token);
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0) return false;
    close(fd);
    return true;
}

static void random_delays(int *d, int tp, uint64_t seed, int max_ms)
{
    for (int r = 0; r < tp; r++)
        d[r] = (int)(mix(seed + (uint64_t)r) % (uint64_t)(max_ms + 1));
}

static void test_threads_allreduce(void)
{
    for (int tp = 1; tp <= 4; tp++) {
        ar_ctx c = {.tp = tp, .iters = 150, .seed = 100 + (uint64_t)tp};
        new_token(c.token, sizeof c.token);
        int delays[MAX_TP];
        random_delays(delays, tp, c.seed, 60);
        reset_outs();
        int64_t t0 = td_now_ns();
        TH_CHECK(run_threads(tp, body_allreduce, &c, delays) == 0);
        for (int r = 0; r < tp; r++)
            TH_CHECK(outs[r].iters == c.iters);
        check_same_hash(tp);
        TH_CHECK(!segment_exists(c.token));
        fprintf(stderr, "  threads tp %d: %d allreduces + plans in %.0f ms\n", tp, c.iters,
                (td_now_ns() - t0) / 1e6);
    }
}

static void test_procs_allreduce(void)
{
    for (int tp = 1; tp <= 4; tp++) {
        ar_ctx c = {.tp = tp, .iters = 150, .seed = 200 + (uint64_t)tp};
        new_token(c.token, sizeof c.token);
        int delays[MAX_TP];
        random_delays(delays, tp, c.seed, 80);
        reset_outs();
        int64_t t0 = td_now_ns();
        TH_CHECK(run_procs(tp, body_allreduce, &c, delays, 30000) == 0);
        for (int r = 0; r < tp; r++) {
            TH_CHECK(outs[r].fails == 0);
            TH_CHECK(outs[r].iters == c.iters);
        }
        check_same_hash(tp);
        TH_CHECK(!segment_exists(c.token));
        fprintf(stderr, "  procs tp %d (start order by delays %d %d %d %d ms): %.0f ms\n", tp,
                delays[0], tp > 1 ? delays[1] : 0, tp > 2 ? delays[2] : 0, tp > 3 ? delays[3] : 0,
                (td_now_ns() - t0) / 1e6);
    }
}

/* 3 ranks pinned to one CPU: spinning ranks must yield and sleep so the others progress. */
static int body_pinned(int rank, void *ctx)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(0, &set);
    sched_setaffinity(0, sizeof set, &set);
    return body_allreduce(rank, ctx);
}

static void test_oversubscribed(void)
{
    ar_ctx c = {.tp = 3, .iters = 150, .seed = 300};
    new_token(c.token, sizeof c.token);
    reset_outs();
    int64_t t0 = td_now_ns();
    TH_CHECK(run_procs(3, body_pinned, &c, NULL, 30000) == 0);
    check_same_hash(3);
    fprintf(stderr, "  tp 3 on one cpu: %d steps in %.0f ms (%llu futex sleeps on rank 0)\n",
            c.iters, (td_now_ns() - t0) / 1e6, (unsigned long long)outs[0].stats.n_sleeps);
}

/* ---- rendezvous failures ---- */

typedef struct {
    char token[64];
    int tp, timeout_ms, op_timeout_ms;
    int64_t max_floats[MAX_TP + 1]; /* per rank; 0: MAXF */
    int rank_of[MAX_TP + 1];        /* rank of worker i (for duplicates); -1: i */
    bool hold;                      /* after open: loop allreduce until an error */
} open_ctx;

static int body_open(int worker, void *vctx)
{
    const open_ctx *c = vctx;
    int rank = c->rank_of[worker] >= 0 ? c->rank_of[worker] : worker;
    dc_shm_params p = params(c->token, rank, c->tp);
    p.timeout_ms = c->timeout_ms;
    p.op_timeout_ms = c->op_timeout_ms;
    if (c->max_floats[worker]) p.max_floats = c->max_floats[worker];
    dc_shm *s = NULL;
    int rc = dc_shm_open(&p, &s);
    outs[worker].rc = rc;
    outs[worker].t_ns = td_now_ns();
    if (rc || !c->hold) {
        dc_shm_close(s);
        return 0;
    }
    float buf[576];
    for (int64_t it = 0;; it++) {
        for (int i = 0; i < 576; i++)
            buf[i] = (float)(rank + i);
        rc = dc_shm_allreduce(s, buf, 576);
        if (rc) break;
        outs[worker].iters = it + 1;
    }
    outs[worker].rc = rc;
    outs[worker].t_ns = td_now_ns();
    /* broken: every later call fails fast with the same code */
    int64_t t0 = td_now_ns();
    int again = dc_shm_allreduce(s, buf, 576);
    const void *pl;
    size_t len;
    int again2 = rank ? dc_shm_plan_wait(s, 1000, &pl, &len) : dc_shm_plan_publish(s, buf, 4);
    if (again != rc || again2 != rc || td_now_ns() - t0 > 500000000) outs[worker].fails++;
    dc_shm_close(s);
    return 0;
}

static open_ctx open_ctx_new(int tp, int timeout_ms)
{
    open_ctx c = {.tp = tp, .timeout_ms = timeout_ms, .op_timeout_ms = 10000};
    new_token(c.token, sizeof c.token);
    for (int i = 0; i <= MAX_TP; i++)
        c.rank_of[i] = -1;
    return c;
}

static void test_missing_rank(void)
{
    open_ctx c = open_ctx_new(3, 300);
    reset_outs();
    int64_t t0 = td_now_ns();
    pid_t a = spawn(0, body_open, &c, 0, true), b = spawn(1, body_open, &c, 50, true);
    TH_CHECK(reap(a, 5000) == 0);
    TH_CHECK(reap(b, 5000) == 0);
    TH_CHECK(outs[0].rc == TD_ETIMEDOUT);
    TH_CHECK(outs[1].rc == TD_ETIMEDOUT);
    TH_CHECK(outs[0].t_ns - t0 < 3000000000ll);
    TH_CHECK(log_has(0, "rendezvous timed out after 300 ms: missing rank 2 (of tp 3)"));
    TH_CHECK(!segment_exists(c.token)); /* rank 0 cleaned up after the failure */

    /* only followers: rank 0 never comes */
    c = open_ctx_new(2, 200);
    reset_outs();
    b = spawn(1, body_open, &c, 0, true);
    TH_CHECK(reap(b, 5000) == 0);
    TH_CHECK(outs[1].rc == TD_ETIMEDOUT);
    TH_CHECK(log_has(1, "missing rank 0 (no segment /tandem-d0-"));
}

static void test_bad_open(void)
{
    /* a follower with another layout than rank 0: refused at once */
    open_ctx c = open_ctx_new(2, 400);
    c.max_floats[1] = 1000;
    reset_outs();
    TH_CHECK(run_threads(2, body_open, &c, (int[]){0, 30}) == 0);
    TH_CHECK(outs[1].rc == TD_EINVAL);
    TH_CHECK(outs[0].rc == TD_ETIMEDOUT);

    /* a rank claimed twice; the instance still forms with the first claimant */
    c = open_ctx_new(3, 3000);
    c.rank_of[3] = 1;
    reset_outs();
    TH_CHECK(run_threads(4, body_open, &c, (int[]){0, 0, 300, 100}) == 0);
    TH_CHECK(outs[0].rc == 0 && outs[1].rc == 0 && outs[2].rc == 0);
    TH_CHECK(outs[3].rc == TD_ESTATE);

    dc_shm *s = (dc_shm *)1;
    dc_shm_params p = params("x", 0, 2);
    p.instance = "bad/name";
    TH_CHECK(dc_shm_open(&p, &s) == TD_EINVAL && s == NULL);
    p = params("x", 2, 2);
    TH_CHECK(dc_shm_open(&p, &s) == TD_EINVAL);
    p = params("x", 0, 2);
    p.max_floats = 0;
    TH_CHECK(dc_shm_open(&p, &s) == TD_EINVAL);
    dc_shm_close(NULL);
}

/* ---- failures of a formed instance ---- */

/* n mismatch between ranks and n > max: TD_EINVAL on every rank, then broken. */
typedef struct {
    char token[64];
    int64_t n[2];
} size_ctx;

static int body_sizes(int rank, void *vctx)
{
    const size_ctx *c = vctx;
    dc_shm_params p = params(c->token, rank, 2);
    dc_shm *s;
    if (dc_shm_open(&p, &s)) return 1;
    static float bufs[2][MAXF + 1];
    float *buf = bufs[rank];
    int rc = dc_shm_allreduce(s, buf, 8); /* a good one first */
    if (!rc) rc = dc_shm_allreduce(s, buf, c->n[rank]);
    outs[rank].rc = rc;
    int64_t t0 = td_now_ns();
    outs[rank].fails += dc_shm_allreduce(s, buf, 8) != rc || dc_shm_check(s) != rc;
    outs[rank].fails += td_now_ns() - t0 > 500000000;
    dc_shm_close(s);
    return 0;
}

static void test_bad_sizes(void)
{
    size_ctx c = {.n = {100, 200}};
    new_token(c.token, sizeof c.token);
    reset_outs();
    TH_CHECK(run_threads(2, body_sizes, &c, NULL) == 0);
    TH_CHECK(outs[0].rc == TD_EINVAL && outs[1].rc == TD_EINVAL);

    /* rank 1 asks for too much: rank 0, waiting in the barrier, fails at once */
    c = (size_ctx){.n = {100, MAXF + 1}};
    new_token(c.token, sizeof c.token);
    reset_outs();
    int64_t t0 = td_now_ns();
    TH_CHECK(run_threads(2, body_sizes, &c, NULL) == 0);
    TH_CHECK(outs[0].rc == TD_EINVAL && outs[1].rc == TD_EINVAL);
    TH_CHECK(td_now_ns() - t0 < 3000000000ll);
}

/* ---- split allreduce (two-batch overlap) ---- */

/* Every iteration: post A, (a random stall), post B, wait A, a blocking allreduce C or a
 * gather with B in flight, wait B: the shape of kn_engine's two micro-batches. Each result is
 * checked against the rank-order sum. */
static int check_sum(const ar_ctx *c, int rank, int tag, const float *got, int64_t n, float *tmp,
                     float *ref)
{
    for (int r = 0; r < c->tp; r++) {
        fill(c, r, tag, tmp, n);
        for (int64_t i = 0; i < n; i++)
            ref[i] = r ? ref[i] + tmp[i] : tmp[i];
    }
    if (!n || !memcmp(got, ref, (size_t)n * sizeof *got)) return 0;
    fprintf(stderr, "rank %d: split allreduce %d (n %lld) not the rank-order sum\n", rank, tag,
            (long long)n);
    return 1;
}

static int body_split(int rank, void *vctx)
{
    const ar_ctx *c = vctx;
    dc_shm_params p = params(c->token, rank, c->tp);
    p.split_allreduce = true;
    dc_shm *s;
    if (dc_shm_open(&p, &s)) return 1;
    float *a = malloc(MAXF * sizeof *a), *b = malloc(MAXF * sizeof *b);
    float *x = malloc(MAXF * sizeof *x), *tmp = malloc(MAXF * sizeof *tmp);
    float *ref = malloc(MAXF * sizeof *ref);
    int fails = 0, rc = 0;
    for (int it = 0; it < c->iters && !fails && !rc; it++) {
        const int64_t na = pick_n(c, it), nb = pick_n(c, it + 1000), nx = pick_n(c, it + 2000);
        uint64_t ta, tb;
        fill(c, rank, 3 * it, a, na);
        fill(c, rank, 3 * it + 1, b, nb);
        fill(c, rank, 3 * it + 2, x, nx);
        if ((rc = dc_shm_allreduce_post(s, a, na, &ta))) break;
        if (mix(c->seed ^ (uint64_t)(it * 4 + rank)) % 7 == 0) sleep_ms(1);
        if ((rc = dc_shm_allreduce_post(s, b, nb, &tb)) ||
            (rc = dc_shm_allreduce_wait(s, ta, a, na)))
            break;
        fails += check_sum(c, rank, 3 * it, a, na, tmp, ref);
        if (it % 3 == 1) { /* a gather between: only rank 0 gets the columns */
            if ((rc = dc_shm_gather_cols(s, x, 1, (int64_t)c->tp * 5, rank ? NULL : tmp))) break;
        } else if (!(rc = dc_shm_allreduce(s, x, nx))) {
            fails += check_sum(c, rank, 3 * it + 2, x, nx, tmp, ref);
        }
        if (rc || (rc = dc_shm_allreduce_wait(s, tb, b, nb))) break;
        fails += check_sum(c, rank, 3 * it + 1, b, nb, tmp, ref);
        outs[rank].iters++;
    }
    if (rc) fprintf(stderr, "rank %d: split allreduce: %s\n", rank, td_strerror(rc));
    if (!rc && !fails && c->tp > 1) { /* a third post breaks the instance */
        uint64_t t[3];
        rc = dc_shm_allreduce_post(s, a, 4, &t[0]);
        if (!rc) rc = dc_shm_allreduce_post(s, b, 4, &t[1]);
        fails += rc != 0 || dc_shm_allreduce_post(s, x, 4, &t[2]) != TD_ESTATE;
        fails += dc_shm_allreduce_wait(s, t[0], a, 4) != TD_ESTATE;
        rc = 0;
    }
    dc_shm_close(s);
    free(a);
    free(b);
    free(x);
    free(tmp);
    free(ref);
    return fails || rc;
}

/* A segment opened without split_allreduce (2 slot sets) refuses a post. */
static int body_split_refused(int rank, void *vctx)
{
    const ar_ctx *c = vctx;
    dc_shm_params p = params(c->token, rank, c->tp);
    dc_shm *s;
    if (dc_shm_open(&p, &s)) return 1;
    float x[4] = {1, 2, 3, 4};
    uint64_t t;
    outs[rank].rc = dc_shm_allreduce_post(s, x, 4, &t);
    dc_shm_close(s);
    return 0;
}

static void test_split_allreduce(void)
{
    ar_ctx r = {.tp = 2};
    new_token(r.token, sizeof r.token);
    reset_outs();
    TH_CHECK(run_threads(2, body_split_refused, &r, NULL) == 0);
    TH_CHECK(outs[0].rc == TD_EINVAL && outs[1].rc == TD_EINVAL);
    for (int tp = 1; tp <= 4; tp++) {
        ar_ctx c = {.tp = tp, .iters = 120, .seed = 300 + (uint64_t)tp};
        new_token(c.token, sizeof c.token);
        int delays[MAX_TP];
        random_delays(delays, tp, c.seed, 40);
        reset_outs();
        TH_CHECK(run_procs(tp, body_split, &c, delays, 60000) == 0);
        for (int r = 0; r < tp; r++)
            TH_CHECK(outs[r].iters == c.iters);
    }
}

/* ---- column gather ---- */

typedef struct {
    char token[64];
    int tp;
    bool mismatch; /* rank 1 calls an allreduce where the others gather */
} gather_ctx;

/* (rows, n_cols): decode-sized; odd widths (uneven parts); parts of several slots (pieces);
 * no rows */
static const int64_t gshapes[][2] = {
    {1, 49152}, {3, 509}, {5, 49152 + 7}, {0, 100}, {24, 151936 / 2 + 3}};
#define GMAX (24 * (151936 / 2 + 3))

static float gval(int it, int64_t i, int64_t j)
{
    return (float)((it * 7919 + i * 1000003 + j) % 16777213);
}

static int gather_one(dc_shm *s, int rank, int tp, int it, float *part, float *out)
{
    const int64_t rows = gshapes[it % 5][0], nc = gshapes[it % 5][1];
    const int64_t c0 = rank * nc / tp, c1 = (rank + 1) * nc / tp;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = c0; j < c1; j++)
            part[i * (c1 - c0) + j - c0] = gval(it, i, j);
    const uint32_t sentinel = 0x7fc0beefu;
    for (int64_t k = 0; k < rows * nc; k++)
        memcpy(&out[k], &sentinel, 4);
    /* rank 1 passes no output at all, as the decode node's followers do */
    int rc = dc_shm_gather_cols(s, part, rows, nc, rank == 1 ? NULL : out);
    if (rc) {
        fprintf(stderr, "rank %d: gather %d: %s\n", rank, it, td_strerror(rc));
        return 1;
    }
    for (int64_t k = 0; k < rows * nc && rank > 1; k++)
        if (memcmp(&out[k], &sentinel, 4)) {
            fprintf(stderr, "rank %d: gather %d wrote its output at %lld\n", rank, it,
                    (long long)k);
            return 1;
        }
    for (int64_t k = 0; k < rows * nc && rank == 0; k++)
        if (out[k] != gval(it, k / nc, k % nc)) {
            fprintf(stderr, "rank 0: gather %d (%lld x %lld, tp %d): [%lld] %g\n", it,
                    (long long)rows, (long long)nc, tp, (long long)k, out[k]);
            return 1;
        }
    return 0;
}

static int body_gather(int rank, void *vctx)
{
    const gather_ctx *c = vctx;
    dc_shm_params p = params(c->token, rank, c->tp);
    dc_shm *s;
    if (dc_shm_open(&p, &s)) return 1;
    float *part = malloc(GMAX * sizeof *part), *out = malloc(GMAX * sizeof *out);
    float ar[576];
    int fails = 0;
    if (c->mismatch) {
        outs[rank].rc =
            rank == 1 ? dc_shm_allreduce(s, ar, 8) : dc_shm_gather_cols(s, part, 1, 509, out);
        fails += dc_shm_check(s) != outs[rank].rc;
    }
    for (int it = 0; it < 20 && !c->mismatch && !fails; it++) {
        fails += gather_one(s, rank, c->tp, it, part, out);
        /* an allreduce between gathers: the parities stay paired */
        for (int i = 0; i < 576; i++)
            ar[i] = (float)(rank + i);
        if (dc_shm_allreduce(s, ar, 576)) fails++;
        for (int i = 0; i < 576 && !fails; i++)
            fails += ar[i] != (float)(c->tp * i + c->tp * (c->tp - 1) / 2);
        outs[rank].iters++;
    }
    dc_shm_get_stats(s, &outs[rank].stats);
    if (!c->mismatch && rank == 0) fails += dc_shm_plan_stop(s) != 0;
    if (!c->mismatch && rank > 0) {
        const void *got;
        size_t glen;
        fails += dc_shm_plan_wait(s, 5000, &got, &glen) != DC_SHM_STOP;
    }
    dc_shm_close(s);
    free(part);
    free(out);
    return fails;
}

static void test_gather_cols(void)
{
    for (int tp = 1; tp <= 4; tp++) {
        gather_ctx c = {.tp = tp};
        new_token(c.token, sizeof c.token);
        reset_outs();
        int64_t t0 = td_now_ns();
        TH_CHECK((tp == 3 ? run_procs(tp, body_gather, &c, NULL, 60000)
                          : run_threads(tp, body_gather, &c, NULL)) == 0);
        for (int r = 0; r < tp; r++)
            TH_CHECK(outs[r].iters == 20 && outs[r].stats.n_gather == 20);
        fprintf(stderr, "  %s tp %d: 20 gathers + allreduces in %.0f ms\n",
                tp == 3 ? "procs" : "threads", tp, (td_now_ns() - t0) / 1e6);
    }
    /* a gather against an allreduce is a size mismatch: both fail, the instance breaks */
    gather_ctx c = {.tp = 2, .mismatch = true};
    new_token(c.token, sizeof c.token);
    reset_outs();
    TH_CHECK(run_threads(2, body_gather, &c, NULL) == 0);
    TH_CHECK(outs[0].rc == TD_EINVAL && outs[1].rc == TD_EINVAL);
}

static void test_kill_mid_allreduce(void)
{
    for (int victim = 0; victim < 3; victim++) {
        open_ctx c = open_ctx_new(3, 5000);
        c.hold = true;
        reset_outs();
        pid_t pids[3];
        for (int r = 0; r < 3; r++)
            pids[r] = spawn(r, body_open, &c, 0, true);
        /* let them run allreduces for a while (a loaded CI machine is slow: wait for a
         * count, not for a time) */
        int64_t end = td_now_ns() + 20000000000ll;
        while (outs[0].iters < 200 && td_now_ns() < end)
            sleep_ms(5);
        TH_CHECK(outs[0].iters >= 200);
        int64_t t_kill = td_now_ns();
        kill(pids[victim], SIGKILL);
        /* the victim stays a zombie until the survivors are done: must count as dead */
        for (int r = 0; r < 3; r++)
            if (r != victim) TH_CHECK(reap(pids[r], 5000) == 0);
        reap(pids[victim], 1000);
        for (int r = 0; r < 3; r++) {
            if (r == victim) continue;
            TH_CHECKF(outs[r].rc == TD_EIO, "rank %d rc %d", r, outs[r].rc);
            TH_CHECKF(outs[r].t_ns - t_kill < 3000000000ll, "rank %d noticed after %.0f ms", r,
                      (outs[r].t_ns - t_kill) / 1e6);
            TH_CHECK(outs[r].fails == 0);
        }
        int first = victim == 0 ? 1 : 0;
        char msg[64];
        snprintf(msg, sizeof msg, "rank %d died", victim);
        /* at least one survivor detected the death itself; the other may have been told */
        bool said = log_has_q(first, msg, true) || log_has(3 - victim - first, msg);
        TH_CHECK(said);
        fprintf(stderr, "  killed rank %d after %lld allreduces: survivors noticed in %.0f ms\n",
                victim, (long long)outs[first].iters, (outs[first].t_ns - t_kill) / 1e6);
    }
}

static void test_not_answering(void)
{
    open_ctx c = open_ctx_new(2, 5000);
    c.hold = true;
    c.op_timeout_ms = 300;
    reset_outs();
    pid_t pids[2];
    for (int r = 0; r < 2; r++)
        pids[r] = spawn(r, body_open, &c, 0, true);
    int64_t end = td_now_ns() + 3000000000ll;
    while (outs[0].iters < 1000 && td_now_ns() < end)
        sleep_ms(5);
    int64_t t_stop = td_now_ns();
    kill(pids[1], SIGSTOP);
    TH_CHECK(reap(pids[0], 5000) == 0);
    TH_CHECK(outs[0].rc == TD_ETIMEDOUT);
    int64_t waited = outs[0].t_ns - t_stop;
    TH_CHECKF(waited >= 250000000 && waited < 5000000000ll, "%.0f ms", waited / 1e6);
    TH_CHECK(log_has(0, "rank 1 not answering (allreduce barrier, 300 ms)"));
    /* the stopped rank, resumed, finds the instance broken */
    kill(pids[1], SIGCONT);
    TH_CHECK(reap(pids[1], 5000) == 0);
    TH_CHECK(outs[1].rc == TD_ETIMEDOUT);
}

/* ---- plans: idle followers, dead leader, leaving without stop, interrupt ---- */

typedef struct {
    char token[64];
    int tp;
    int leader_sleep_ms; /* before the one plan */
    bool leader_dies;    /* leader SIGKILLs itself instead of publishing */
    bool leader_no_stop; /* leader closes without stop */
    volatile sig_atomic_t *intr;
} plan_ctx;

static int body_plan(int rank, void *vctx)
{
    const plan_ctx *c = vctx;
    dc_shm_params p = params(c->token, rank, c->tp);
    p.interrupt = rank ? c->intr : NULL;
    dc_shm *s;
    if (dc_shm_open(&p, &s)) return 1;
    int fails = 0;
    if (rank == 0) {
        sleep_ms(c->leader_sleep_ms);
        if (c->leader_dies) raise(SIGKILL);
        if (!c->leader_no_stop) {
            fails += dc_shm_plan_publish(s, "step", 4) != 0;
            fails += dc_shm_plan_stop(s) != 0;
            fails += dc_shm_plan_publish(s, "x", 1) != TD_ESTATE;
        }
    } else {
        const void *pl;
        size_t len;
        struct timespec c0, c1;
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
        int rc = dc_shm_plan_wait(s, -1, &pl, &len);
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
        outs[rank].cpu_ns =
            (uint64_t)((c1.tv_sec - c0.tv_sec) * 1000000000ll + (c1.tv_nsec - c0.tv_nsec));
        outs[rank].rc = rc;
        outs[rank].t_ns = td_now_ns();
        if (rc == DC_SHM_INTR) {
            *c->intr = 0;
            rc = dc_shm_plan_wait(s, -1, &pl, &len);
        }
        if (rc == 0) {
            fails += len != 4 || memcmp(pl, "step", 4) != 0;
            fails += dc_shm_plan_wait(s, 5000, &pl, &len) != DC_SHM_STOP;
        }
    }
    dc_shm_close(s);
    return fails;
}

static void test_idle_follower_cpu(void)
{
    plan_ctx c = {.tp = 3, .leader_sleep_ms = 2000};
    new_token(c.token, sizeof c.token);
    reset_outs();
    TH_CHECK(run_procs(3, body_plan, &c, NULL, 10000) == 0);
    for (int r = 1; r < 3; r++) {
        TH_CHECK(outs[r].rc == 0);
        TH_CHECKF(outs[r].cpu_ns < 100000000, "rank %d used %.1f ms of cpu in 2 s", r,
                  outs[r].cpu_ns / 1e6);
        fprintf(stderr, "  idle follower rank %d: %.2f ms cpu while waiting 2 s for a plan\n", r,
                outs[r].cpu_ns / 1e6);
    }
}

static void test_leader_dies_idle(void)
{
    plan_ctx c = {.tp = 3, .leader_sleep_ms = 300, .leader_dies = true};
    new_token(c.token, sizeof c.token);
    reset_outs();
    pid_t pids[3];
    for (int r = 0; r < 3; r++)
        pids[r] = spawn(r, body_plan, &c, 0, r > 0);
    int status;
    waitpid(pids[0], &status, 0); /* reaped: /proc entry gone */
    int64_t t_death = td_now_ns();
    TH_CHECK(WIFSIGNALED(status));
    for (int r = 1; r < 3; r++) {
        reap(pids[r], 5000);
        TH_CHECK(outs[r].rc == TD_EIO);
        TH_CHECKF(outs[r].t_ns - t_death < 3000000000ll, "%.0f ms", (outs[r].t_ns - t_death) / 1e6);
    }
    TH_CHECK(log_has_q(1, "rank 0 died", true) || log_has(2, "rank 0 died"));
}

static void test_leader_leaves_without_stop(void)
{
    plan_ctx c = {.tp = 2, .leader_sleep_ms = 50, .leader_no_stop = true};
    new_token(c.token, sizeof c.token);
    reset_outs();
    int64_t t0 = td_now_ns();
    run_threads(2, body_plan, &c, NULL);
    TH_CHECK(outs[1].rc == TD_EIO);
    TH_CHECK(td_now_ns() - t0 < 3000000000ll);
}

static volatile sig_atomic_t intr_flag;

static void *set_intr(void *arg)
{
    sleep_ms(100);
    intr_flag = 1;
    return arg;
}

static void test_interrupt(void)
{
    plan_ctx c = {.tp = 2, .leader_sleep_ms = 400, .intr = &intr_flag};
    new_token(c.token, sizeof c.token);
    reset_outs();
    intr_flag = 0;
    pthread_t th;
    pthread_create(&th, NULL, set_intr, NULL);
    int64_t t0 = td_now_ns();
    TH_CHECK(run_threads(2, body_plan, &c, NULL) == 0);
    pthread_join(th, NULL);
    TH_CHECK(outs[1].rc == DC_SHM_INTR);
    TH_CHECK(outs[1].t_ns - t0 < 350000000);
}

/* ---- stale segments ---- */

static int body_hang(int rank, void *vctx)
{
    const open_ctx *c = vctx;
    dc_shm_params p = params(c->token, rank, c->tp);
    dc_shm *s;
    dc_shm_open(&p, &s); /* waits for ranks that never come; killed meanwhile */
    return 1;
}

static void write_garbage(const char *token, size_t size)
{
    char name[160];
    snprintf(name, sizeof name, "/tandem-d0-%s", token);
    int fd = shm_open(name, O_RDWR | O_CREAT, 0600);
    if (fd < 0) return;
    if (ftruncate(fd, (off_t)size)) return;
    uint8_t junk[4096];
    for (size_t i = 0; i < sizeof junk; i++)
        junk[i] = (uint8_t)mix(i);
    for (size_t off = 0; off < size; off += sizeof junk)
        if (write(fd, junk, size - off < sizeof junk ? size - off : sizeof junk) < 0) break;
    close(fd);
}

static void test_stale_segment(void)
{
    for (int variant = 0; variant < 4; variant++) {
        ar_ctx a = {.tp = 2, .iters = 20, .seed = 400 + (uint64_t)variant};
        new_token(a.token, sizeof a.token);
        if (variant < 2) {
            /* a rank 0 (tp 2 or 3) killed while its instance was gathering */
            open_ctx o = open_ctx_new(2 + variant, 10000);
            memcpy(o.token, a.token, sizeof o.token);
            pid_t pid = spawn(0, body_hang, &o, 0, false);
            int64_t end = td_now_ns() + 2000000000ll;
            while (!segment_exists(a.token) && td_now_ns() < end)
                sleep_ms(2);
            sleep_ms(20);
            kill(pid, SIGKILL);
            reap(pid, 2000);
        } else {
            write_garbage(a.token, variant == 2 ? 100 : 3 << 20);
        }
        TH_CHECK(segment_exists(a.token));
        reset_outs();
        /* the follower comes first and must skip the stale segment */
        TH_CHECK(run_threads(2, body_allreduce, &a, (int[]){150, 0}) == 0);
        check_same_hash(2);
        TH_CHECK(!segment_exists(a.token));
    }
    /* a live rank 0 gathering: a second rank 0 is refused */
    open_ctx o = open_ctx_new(2, 3000);
    pid_t pid = spawn(0, body_hang, &o, 0, false);
    int64_t end = td_now_ns() + 2000000000ll;
    while (!segment_exists(o.token) && td_now_ns() < end)
        sleep_ms(2);
    sleep_ms(20);
    dc_shm_params p = params(o.token, 0, 2);
    dc_shm *s;
    TH_CHECK(dc_shm_open(&p, &s) == TD_ESTATE);
    kill(pid, SIGKILL);
    reap(pid, 2000);
    char name[160];
    snprintf(name, sizeof name, "/tandem-d0-%s", o.token);
    shm_unlink(name);
}

/* ---- re-forming: the rendezvous in steps, a rank restarted while rank 0 waits ---- */

/* A follower that joins (dc_shm_begin) and waits for the rest without limit (dc_shm_gather
 * -1): outs[rank] gets the gather's result and when it returned. */
static int body_join(int rank, void *vctx)
{
    const open_ctx *c = vctx;
    dc_shm_params p = params(c->token, rank, c->tp);
    p.timeout_ms = c->timeout_ms;
    dc_shm *s = NULL;
    int rc = dc_shm_begin(&p, &s);
    if (!rc) rc = dc_shm_gather(s, -1);
    outs[rank].rc = rc;
    outs[rank].t_ns = td_now_ns();
    dc_shm_close(s);
    return 0;
}

/* Rank 0 in this process: gather in slices until mask is joined (or ms pass). */
static bool wait_joined(dc_shm *s, uint64_t mask, int ms)
{
    int64_t end = td_now_ns() + (int64_t)ms * 1000000;
    while ((dc_shm_joined(s) & mask) != mask && td_now_ns() < end)
        if (dc_shm_gather(s, 10) != TD_ETIMEDOUT) break;
    return (dc_shm_joined(s) & mask) == mask;
}

static void test_reform(void)
{
    /* rank 0 begins at once and waits in slices that leave the rendezvous intact */
    open_ctx c = open_ctx_new(3, 5000);
    reset_outs();
    dc_shm_params p = params(c.token, 0, 3);
    dc_shm *s = NULL;
    TH_CHECK(dc_shm_begin(&p, &s) == 0);
    TH_CHECK(dc_shm_gather(s, 0) == TD_ETIMEDOUT);
    TH_CHECK(dc_shm_gather(s, 30) == TD_ETIMEDOUT);
    TH_CHECK(dc_shm_joined(s) == 1);
    TH_CHECK(!strcmp(dc_shm_error(s), ""));

    /* rank 1 joins, then dies before rank 2 came; restarted at once, it must wait for a
     * fresh segment instead of failing on its dead predecessor's slot */
    pid_t a = spawn(1, body_join, &c, 0, false);
    TH_CHECK(wait_joined(s, 3, 3000));
    TH_CHECK(dc_shm_gather(s, 20) == TD_ETIMEDOUT);
    kill(a, SIGKILL);
    reap(a, 2000);
    a = spawn(1, body_join, &c, 0, false);
    int64_t t0 = td_now_ns();
    int rc;
    while ((rc = dc_shm_gather(s, 50)) == TD_ETIMEDOUT && td_now_ns() - t0 < 3000000000ll) {
    }
    TH_CHECK(rc == TD_EIO);
    TH_CHECKF(strstr(dc_shm_error(s), "rank 1 died") != NULL, "error '%s'", dc_shm_error(s));
    dc_shm_close(s);
    TH_CHECK(!segment_exists(c.token));

    /* the next rendezvous: the restarted rank 1 and a late rank 2 join it */
    TH_CHECK(dc_shm_begin(&p, &s) == 0);
    pid_t b = spawn(2, body_join, &c, 100, false);
    t0 = td_now_ns();
    while ((rc = dc_shm_gather(s, 50)) == TD_ETIMEDOUT && td_now_ns() - t0 < 5000000000ll) {
    }
    TH_CHECK(rc == 0);
    TH_CHECK(dc_shm_joined(s) == 7);
    TH_CHECK(dc_shm_gather(s, 0) == 0); /* done stays done */
    TH_CHECK(!segment_exists(c.token)); /* unlinked once everyone is in */
    TH_CHECK(dc_shm_plan_stop(s) == 0);
    TH_CHECK(reap(a, 3000) == 0 && reap(b, 3000) == 0);
    TH_CHECK(outs[1].rc == 0 && outs[2].rc == 0);
    dc_shm_close(s);

    /* a follower waiting without limit ends at once when rank 0 gives the segment up */
    c = open_ctx_new(3, 5000);
    reset_outs();
    p = params(c.token, 0, 3);
    TH_CHECK(dc_shm_begin(&p, &s) == 0);
    a = spawn(1, body_join, &c, 0, true);
    TH_CHECK(wait_joined(s, 3, 3000));
    sleep_ms(50);
    t0 = td_now_ns();
    dc_shm_close(s);
    TH_CHECK(reap(a, 3000) == 0);
    TH_CHECK(outs[1].rc == TD_EIO);
    TH_CHECKF(outs[1].t_ns - t0 < 500000000, "%.0f ms", (outs[1].t_ns - t0) / 1e6);
    TH_CHECK(!segment_exists(c.token));

    /* ... and when rank 0 dies meanwhile, the follower removes the name it left behind */
    c = open_ctx_new(3, 5000);
    reset_outs();
    pid_t leader = spawn(0, body_hang, &c, 0, false);
    a = spawn(1, body_join, &c, 20, true);
    sleep_ms(300);
    TH_CHECK(segment_exists(c.token));
    kill(leader, SIGKILL);
    reap(leader, 2000);
    TH_CHECK(reap(a, 3000) == 0);
    TH_CHECK(outs[1].rc == TD_EIO);
    TH_CHECK(!segment_exists(c.token));
    TH_CHECK(log_has(1, "its rank 0 died"));
}

/* ---- micro-benchmark ---- */

typedef struct {
    char token[64];
    int tp;
} bench_ctx;

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int body_bench(int rank, void *vctx)
{
    const bench_ctx *c = vctx;
    dc_shm_params p = params(c->token, rank, c->tp);
    dc_shm *s;
    if (dc_shm_open(&p, &s)) return 1;
    float *buf = calloc(MAXF, sizeof *buf);
    int64_t ns[2] = {576, MAXF}, iters[2] = {100000, 10000};
    int64_t *lat = malloc(100000 * sizeof *lat);
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < 1000; i++)
            dc_shm_allreduce(s, buf, ns[k]);
        int64_t t0 = td_now_ns();
        for (int64_t i = 0; i < iters[k]; i++) {
            int64_t a = td_now_ns();
            dc_shm_allreduce(s, buf, ns[k]);
            lat[i] = td_now_ns() - a;
        }
        int64_t total = td_now_ns() - t0;
        qsort(lat, (size_t)iters[k], sizeof *lat, cmp_i64);
        if (rank == 0)
            printf("tp %d n %6lld: mean %7.2f us  p50 %7.2f us  p99 %7.2f us  (%lld calls)\n",
                   c->tp, (long long)ns[k], total / 1e3 / (double)iters[k], lat[iters[k] / 2] / 1e3,
                   lat[iters[k] * 99 / 100] / 1e3, (long long)iters[k]);
    }
    dc_shm_stats st;
    dc_shm_get_stats(s, &st);
    if (rank == 0)
        printf("  rank 0: %llu futex sleeps in %llu allreduces\n", (unsigned long long)st.n_sleeps,
               (unsigned long long)st.n_allreduce);
    fflush(stdout);
    dc_shm_close(s);
    free(buf);
    free(lat);
    return 0;
}

static int bench(void)
{
    for (int tp = 2; tp <= 3; tp++) {
        bench_ctx c = {.tp = tp};
        new_token(c.token, sizeof c.token);
        run_procs(tp, body_bench, &c, NULL, 300000);
    }
    return 0;
}

int main(int argc, char **argv)
{
    outs = mmap(NULL, sizeof *outs * (MAX_TP + 1), PROT_READ | PROT_WRITE,
                MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (outs == MAP_FAILED) return 1;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/test_shm.XXXXXX");
    if (!mkdtemp(tmpdir)) return 1;
    if (argc > 1 && !strcmp(argv[1], "--bench")) return bench();
    /* test_shm [NAME-SUBSTRING [REPEAT]]: run only the matching tests, REPEAT times */
    const char *only = argc > 1 ? argv[1] : NULL;
    int repeat = argc > 2 ? atoi(argv[2]) : 1;
#define RUN(fn)                                                                                    \
    for (int i_ = 0; i_ < repeat; i_++)                                                            \
        if (!only || strstr(#fn, only)) TH_RUN(fn)
    RUN(test_threads_allreduce);
    RUN(test_procs_allreduce);
    RUN(test_oversubscribed);
    RUN(test_missing_rank);
    RUN(test_bad_open);
    RUN(test_bad_sizes);
    RUN(test_gather_cols);
    RUN(test_split_allreduce);
    RUN(test_kill_mid_allreduce);
    RUN(test_not_answering);
    RUN(test_idle_follower_cpu);
    RUN(test_leader_dies_idle);
    RUN(test_leader_leaves_without_stop);
    RUN(test_interrupt);
    RUN(test_stale_segment);
    RUN(test_reform);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmpdir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", tmpdir);
    TH_EXIT();
}
