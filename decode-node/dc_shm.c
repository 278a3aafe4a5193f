/* dc_shm.c: the shared-memory collective of a decode instance (see dc_shm.h).
 *
 * Segment layout (offsets page-aligned):
 *   shm_hdr                         identity, futex words (each on its own line), rank slots
 *   partial[2][tp][stride] floats   each rank's input of the allreduce of each parity
 *   result[2][stride] floats        reduce-scatter target of the two-phase allreduce
 *   plan[2][plan_stride] bytes      plan slots, seq q uses slot q & 1
 * Allreduce k uses parity k & 1. A rank can start writing parity p again (allreduce k + 2)
 * only after passing the first barrier of allreduce k + 1, i.e. after every rank finished
 * allreduce k; so the one-barrier scheme needs no second barrier.
 */
#define _GNU_SOURCE
#include "dc_shm.h"

#include <errno.h>
#include <fcntl.h>
#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "td_err.h"

#define SHM_MAGIC   0x31304d4853445454ull /* "TTDSHM01" */
#define SHM_VERSION 2u                    /* 2: broken names the culprit too */
#define LINE        128 /* a pair of cache lines: keeps the adjacent-line prefetcher off */
#define PAGE        4096
#define RED_BLOCK   1024 /* floats reduced per block (L1-sized) */
/* Above this many floats (and tp >= 3) the allreduce reduce-scatters then gathers (reads
 * about 2n floats per rank) instead of every rank summing all tp inputs (tp * n). */
#define TWO_PHASE_MIN 4096

#define DEF_MAX_PLAN    (64 * 1024)
#define DEF_TIMEOUT_MS  30000
#define DEF_LIVENESS_MS 20
#define DEF_SPIN_US     50
/* longest sleep of a follower polling for rank 0's segment (find_segment) */
#define FIND_MAX_BACKOFF_NS (50 * 1000000ll)

enum { PLAN_KIND_PLAN = 1, PLAN_KIND_STOP = 2 };

_Static_assert(ATOMIC_INT_LOCK_FREE == 2 && ATOMIC_LLONG_LOCK_FREE == 2,
               "shared-memory atomics must be lock-free");

typedef struct {
    _Alignas(LINE) _Atomic uint32_t claim; /* 0 free, 1 taken (CAS by the joining rank) */
    _Atomic int32_t pid;                   /* the rank's process */
    _Atomic uint64_t start;                /* its start time (/proc/pid/stat field 22) */
    _Atomic uint64_t joined_epoch;         /* == hdr.epoch once joined (release) */
    _Atomic uint64_t arrived;              /* last barrier index it arrived at */
    _Atomic int64_t n[2];                  /* n of its allreduce of each parity */
    _Atomic uint32_t plan_taken;           /* followers: last plan seq taken */
} shm_rank;

typedef struct {
    /* identity: written by rank 0 before ready, read-only afterwards */
    uint64_t magic;
    uint32_t version;
    uint32_t tp;
    uint64_t stride;        /* floats per partial slot (max_floats rounded up) */
    uint64_t plan_stride;   /* bytes per plan slot (max_plan rounded up) */
    uint64_t total;         /* bytes of the segment */
    uint64_t epoch;         /* generation of this segment, nonzero */
    _Atomic uint32_t ready; /* 1 once the identity and rank 0's slot are written */

    _Alignas(LINE) _Atomic uint32_t join_word; /* ranks joined (futex) */
    _Atomic uint32_t join_waiters;
    _Alignas(LINE) _Atomic uint32_t broken;    /* 0, or BROKEN(detector, culprit) of the first
                                                  failure */
    _Atomic int32_t broken_err;                /* its td_err */
    _Alignas(LINE) _Atomic uint64_t bar_count; /* barrier arrivals since creation */
    _Alignas(LINE) _Atomic uint32_t bar_gen;   /* index of the last completed barrier (futex) */
    _Atomic uint32_t bar_waiters;
    _Alignas(LINE) _Atomic uint32_t plan_seq; /* seq of the last published plan (futex) */
    _Atomic uint32_t plan_waiters;
    _Atomic uint32_t plan_kind[2];              /* PLAN_KIND_* of the plan in each slot */
    _Atomic uint64_t plan_len[2];               /* bytes */
    _Alignas(LINE) _Atomic uint32_t taken_word; /* plans taken, summed over followers (futex) */
    _Atomic uint32_t taken_waiters;
    shm_rank ranks[DC_SHM_MAX_TP];
} shm_hdr;

struct dc_shm {
    shm_hdr *h;     /* the mapping (NULL before attach) */
    size_t size;    /* bytes mapped */
    char name[144]; /* /tandem-INSTANCE-TOKEN (8 + 64 + 1 + 64 + 1) */
    char inst[72];  /* instance name, for messages */
    int rank, tp;
    int64_t max_floats; /* as asked (the allreduce limit) */
    uint64_t stride;    /* floats per partial slot */
    size_t max_plan;
    uint64_t plan_stride;
    float *partial[2]; /* (tp, stride) each */
    float *result[2];  /* (stride) each */
    uint8_t *plan[2];  /* (plan_stride) each */
    uint64_t epoch;
    int64_t op_timeout_ns, liveness_ns, spin_ns;
    int timeout_ms;
    volatile sig_atomic_t *intr;
    pid_t pid;
    uint64_t start;
    int pidfd[DC_SHM_MAX_TP]; /* peers' pidfds once gathered (readable when they exit), or -1 */
    uint64_t bar_k;           /* barriers passed */
    uint64_t ar_k;            /* allreduces started */
    uint32_t plan_seq;        /* leader: last published; follower: last taken */
    bool in_plan;             /* leader: between plan_begin and plan_commit */
    bool gathered;            /* rendezvous done */
    bool stopped;             /* stop published (leader) or received (follower) */
    bool linked;              /* rank 0: the name still refers to this segment */
    dev_t dev;                /* the segment's file (to tell it from another one of the */
    ino_t ino;                /* same name) */
    int err;                  /* 0, or the error that broke this object */
    int culprit;              /* the rank found dead or silent before a fail(), or -1 */
    char err_msg[160];        /* what broke it, when known ("rank 1 died (pid 42)") */
    dc_shm_stats st;
    char why[256]; /* follower: why the last segment looked at was not usable */
};

/* ---- time, futex, processes ---- */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void sleep_ns(int64_t ns)
{
    struct timespec ts = {.tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000};
    nanosleep(&ts, NULL);
}

static void futex_wait(_Atomic uint32_t *w, uint32_t val, int64_t ns)
{
    struct timespec ts = {.tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000};
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *w)
{
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* State and start time of a process from /proc/PID/stat. 1 found, 0 gone, -1 unknown. */
static int proc_stat(pid_t pid, char *state, uint64_t *start)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT ? 0 : -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0; /* exited between open and read */
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    if (!p || p[1] != ' ' || !p[2]) return -1;
    *state = p[2];
    p += 3; /* " ppid ..." */
    for (int field = 4; field <= 22; field++) {
        p = strchr(p, ' ');
        if (!p) return -1;
        p++;
    }
    *start = strtoull(p, NULL, 10);
    return 1;
}

/* Whether the process (pid, start) still runs: not gone, not a zombie, pid not reused. */
static bool proc_alive(pid_t pid, uint64_t start)
{
    if (pid <= 0) return false;
    char state = 0;
    uint64_t st = 0;
    int rc = proc_stat(pid, &state, &st);
    if (rc < 0) return kill(pid, 0) == 0 || errno == EPERM; /* no usable /proc */
    if (rc == 0 || state == 'Z' || state == 'X' || state == 'x') return false;
    return !start || st == start;
}

static uint64_t new_epoch(void)
{
    static _Atomic uint64_t counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t e = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    e ^= (uint64_t)getpid() << 40;
    e += atomic_fetch_add(&counter, 1) * 0x9e3779b97f4a7c15ull;
    return e ? e : 1;
}

/* ---- failure ---- */

static bool interrupted(const dc_shm *s)
{
    return s->intr && *s->intr;
}

static void wake_all(shm_hdr *h)
{
    futex_wake(&h->join_word);
    futex_wake(&h->bar_gen);
    futex_wake(&h->plan_seq);
    futex_wake(&h->taken_word);
}

/* Remember the first reason this object broke, for dc_shm_error (the callers' messages). */
static void note(dc_shm *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(dc_shm *s, const char *fmt, ...)
{
    if (s->err_msg[0]) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->err_msg, sizeof s->err_msg, fmt, ap);
    va_end(ap);
}

/* Break this object with err (the caller logged why) and the instance with it. The
 * segment records who saw it (detector) and whom it is about (culprit: a rank found dead
 * or silent, else the detector itself), in one word so a reader never sees half of it. */
#define BROKEN(detector, culprit) ((uint32_t)((detector) + 1) | (uint32_t)((culprit) + 1) << 8)

static int fail(dc_shm *s, int err)
{
    if (!s->err) s->err = err;
    if (s->h) {
        uint32_t zero = 0;
        atomic_store(&s->h->broken_err, s->err);
        atomic_compare_exchange_strong(&s->h->broken, &zero,
                                       BROKEN(s->rank, s->culprit >= 0 ? s->culprit : s->rank));
        wake_all(s->h);
    }
    return s->err;
}

/* If a peer broke the instance: log it once here, break this object too, return its code. */
static int peer_broke(dc_shm *s)
{
    uint32_t b = atomic_load(&s->h->broken);
    if (!b) return 0;
    int det = (int)(b & 0xff) - 1, cul = (int)(b >> 8 & 0xff) - 1;
    if (det == s->rank) return s->err ? s->err : TD_EIO;
    int err = atomic_load(&s->h->broken_err);
    if (err >= 0) err = TD_EIO;
    TD_LOG_ERR("dc_shm %s rank %d: instance failed at rank %d (%s)", s->inst, s->rank, det,
               td_strerror(err));
    if (cul != det && err == TD_EIO)
        note(s, "rank %d died (seen by rank %d)", cul, det);
    else if (cul != det && err == TD_ETIMEDOUT)
        note(s, "rank %d not answering (seen by rank %d)", cul, det);
    else if (err == TD_ESTATE) /* only an interrupt breaks with TD_ESTATE */
        note(s, "rank %d stopped (interrupted)", det);
    else
        note(s, "rank %d failed or left (%s)", det, td_strerror(err));
    if (!s->err) s->err = err;
    return s->err;
}

/* A joined peer whose process is gone, or -1. */
static int find_dead(dc_shm *s)
{
    for (int r = 0; r < s->tp; r++) {
        shm_rank *x = &s->h->ranks[r];
        if (r == s->rank || atomic_load(&x->joined_epoch) != s->epoch) continue;
        if (s->pidfd[r] >= 0) {
            struct pollfd pf = {.fd = s->pidfd[r], .events = POLLIN};
            if (poll(&pf, 1, 0) > 0) return r;
            continue;
        }
        pid_t pid = atomic_load(&x->pid);
        if (pid == s->pid) continue; /* ranks as threads of one process */
        if (!proc_alive(pid, atomic_load(&x->start))) return r;
    }
    return -1;
}

/* Once gathered: pidfds of the peer processes, so a liveness check is one poll (about
 * 0.2 us against 7 us for /proc/PID/stat) and immune to pid reuse. Without pidfd_open
 * (old kernel, seccomp) find_dead reads /proc. */
static void open_pidfds(dc_shm *s)
{
#ifdef SYS_pidfd_open
    for (int r = 0; r < s->tp; r++) {
        shm_rank *x = &s->h->ranks[r];
        pid_t pid = atomic_load(&x->pid);
        if (r == s->rank || pid == s->pid) continue;
        int fd = (int)syscall(SYS_pidfd_open, pid, 0);
        /* the pid may have been reused before the open: check the start time once */
        if (fd >= 0 && !proc_alive(pid, atomic_load(&x->start))) {
            close(fd);
            fd = -1;
        }
        s->pidfd[r] = fd;
    }
#else
    (void)s;
#endif
}

static int report_dead(dc_shm *s, int r)
{
    pid_t pid = atomic_load(&s->h->ranks[r].pid);
    TD_LOG_ERR("dc_shm %s rank %d: rank %d died (pid %d)", s->inst, s->rank, r, (int)pid);
    note(s, "rank %d died (pid %d)", r, (int)pid);
    s->culprit = r;
    return fail(s, TD_EIO);
}

/* ---- waiting ---- */

static inline bool reached(_Atomic uint32_t *w, uint32_t target)
{
    return (int32_t)(atomic_load_explicit(w, memory_order_acquire) - target) >= 0;
}

/* Wait until *word reaches target (wrapping compare): spin up to spin_ns (yielding once
 * the spin is a fifth over, so oversubscribed ranks progress), then sleep on the futex in
 * slices, checking the peers every liveness_ns. timeout_ns < 0: no limit.
 * Returns 0; TD_EIO and friends (logged, broken) when a peer died or broke the instance;
 * TD_ETIMEDOUT or DC_SHM_INTR (neither logged nor broken: the caller decides). */
static int wait_word(dc_shm *s, _Atomic uint32_t *word, _Atomic uint32_t *waiters, uint32_t target,
                     int64_t timeout_ns)
{
    if (reached(word, target)) return 0;
    shm_hdr *h = s->h;
    int64_t t0 = now_ns();
    if (s->spin_ns > 0) {
        int64_t yield_after = s->spin_ns / 5;
        for (uint32_t i = 1;; i++) {
            _mm_pause();
            if (reached(word, target)) return 0;
            if ((i & 63) == 0) {
                if (atomic_load_explicit(&h->broken, memory_order_relaxed)) break;
                int64_t spent = now_ns() - t0;
                if (spent > s->spin_ns) break;
                if (spent > yield_after) sched_yield();
            }
        }
    }
    s->st.n_sleeps++;
    int64_t deadline = timeout_ns < 0 ? INT64_MAX : t0 + timeout_ns;
    int64_t next_check = t0 + s->liveness_ns;
    for (;;) {
        if (reached(word, target)) return 0;
        int rc = peer_broke(s);
        if (rc) return rc;
        if (interrupted(s)) return DC_SHM_INTR;
        int64_t now = now_ns();
        if (now >= deadline) return TD_ETIMEDOUT;
        if (now >= next_check) {
            int dead = find_dead(s);
            if (dead >= 0) {
                if (reached(word, target)) return 0; /* e.g. the leader stopped, then exited */
                return report_dead(s, dead);
            }
            next_check = now + s->liveness_ns;
        }
        int64_t until = deadline < next_check ? deadline : next_check;
        atomic_fetch_add(waiters, 1);
        uint32_t v = atomic_load(word);
        if ((int32_t)(v - target) < 0) futex_wait(word, v, until - now);
        atomic_fetch_sub(waiters, 1);
    }
}

/* Store *word = val and wake its sleepers. */
static void post_word(_Atomic uint32_t *word, _Atomic uint32_t *waiters, uint32_t val)
{
    atomic_store(word, val);
    if (atomic_load(waiters)) futex_wake(word);
}

/* Log the ranks that have not reached a point (have[r] < want) as not answering. */
static void report_silent(dc_shm *s, const char *what, uint64_t want, bool plan)
{
    char list[256] = "";
    size_t len = 0;
    for (int r = 0; r < s->tp && len < sizeof list - 8; r++) {
        if (r == s->rank || (plan && r == 0)) continue;
        shm_rank *x = &s->h->ranks[r];
        bool behind = plan ? (int32_t)(atomic_load(&x->plan_taken) - (uint32_t)want) < 0
                           : atomic_load(&x->arrived) < want;
        if (!behind) continue;
        if (s->culprit < 0) s->culprit = r;
        len += (size_t)snprintf(list + len, sizeof list - len, "%s%d", len ? ", " : "", r);
    }
    TD_LOG_ERR("dc_shm %s rank %d: rank %s not answering (%s, %lld ms)", s->inst, s->rank,
               len ? list : "?", what, (long long)(s->op_timeout_ns / 1000000));
    note(s, "rank %s not answering (%s, %lld ms)", len ? list : "?", what,
         (long long)(s->op_timeout_ns / 1000000));
}

/* All ranks meet; every rank's writes before it are visible to all after it. */
static int barrier(dc_shm *s)
{
    shm_hdr *h = s->h;
    uint64_t k = ++s->bar_k;
    uint64_t c = atomic_fetch_add(&h->bar_count, 1) + 1;
    /* after the arrival, so a rank that is behind never looks arrived in report_silent */
    atomic_store_explicit(&h->ranks[s->rank].arrived, k, memory_order_relaxed);
    if (c == k * (uint64_t)s->tp) {
        post_word(&h->bar_gen, &h->bar_waiters, (uint32_t)k);
        return 0;
    }
    int rc = wait_word(s, &h->bar_gen, &h->bar_waiters, (uint32_t)k, s->op_timeout_ns);
    if (rc == TD_ETIMEDOUT) {
        report_silent(s, "allreduce barrier", k, false);
        return fail(s, TD_ETIMEDOUT);
    }
    if (rc == DC_SHM_INTR) {
        TD_LOG_ERR("dc_shm %s rank %d: interrupted in an allreduce", s->inst, s->rank);
        return fail(s, TD_ESTATE);
    }
    return rc;
}

/* ---- allreduce ---- */

/* out[i] = ((src[0][i] + src[1][i]) + src[2][i]) + ... for i in [0, n), tp >= 2; out does
 * not overlap the sources. The same order on every rank makes the sums bit-identical. */
static void reduce(float *restrict out, const float *const *src, int tp, int64_t n)
{
    for (int64_t b = 0; b < n; b += RED_BLOCK) {
        int64_t m = n - b < RED_BLOCK ? n - b : RED_BLOCK;
        float *restrict o = out + b;
        const float *restrict s0 = src[0] + b;
        const float *restrict s1 = src[1] + b;
        for (int64_t i = 0; i < m; i++)
            o[i] = s0[i] + s1[i];
        for (int r = 2; r < tp; r++) {
            const float *restrict sr = src[r] + b;
            for (int64_t i = 0; i < m; i++)
                o[i] += sr[i];
        }
    }
}

static int check_usable(dc_shm *s, const char *what)
{
    if (s->err) return s->err;
    if (!s->gathered) return TD_ESTATE;
    if (s->stopped) {
        TD_LOG_ERR("dc_shm %s rank %d: %s after stop", s->inst, s->rank, what);
        return TD_ESTATE;
    }
    return 0;
}

int dc_shm_allreduce(dc_shm *s, float *buf, int64_t n)
{
    int rc = check_usable(s, "allreduce");
    if (rc) return rc;
    if (n < 0 || n > s->max_floats || (n > 0 && !buf)) {
        TD_LOG_ERR("dc_shm %s rank %d: allreduce of %lld floats (max %lld)", s->inst, s->rank,
                   (long long)n, (long long)s->max_floats);
        return fail(s, TD_EINVAL);
    }
    s->st.n_allreduce++;
    if (s->tp == 1) return 0;
    int64_t t0 = now_ns();
    shm_hdr *h = s->h;
    int par = (int)(s->ar_k++ & 1);
    float *part = s->partial[par];
    if (n > 0) memcpy(part + (size_t)s->rank * s->stride, buf, (size_t)n * sizeof(float));
    atomic_store_explicit(&h->ranks[s->rank].n[par], n, memory_order_relaxed);
    if ((rc = barrier(s))) return rc;
    for (int r = 0; r < s->tp; r++) {
        int64_t nr = atomic_load_explicit(&h->ranks[r].n[par], memory_order_relaxed);
        if (nr != n) {
            TD_LOG_ERR("dc_shm %s rank %d: allreduce %llu size mismatch: rank %d has %lld "
                       "floats, rank %d has %lld",
                       s->inst, s->rank, (unsigned long long)s->ar_k, s->rank, (long long)n, r,
                       (long long)nr);
            return fail(s, TD_EINVAL);
        }
    }
    const float *src[DC_SHM_MAX_TP];
    if (s->tp >= 3 && n >= TWO_PHASE_MIN) {
        /* reduce-scatter: rank r sums slice r (64-byte aligned) into result; then gather */
        int64_t chunk = ((n + s->tp - 1) / s->tp + 15) & ~(int64_t)15;
        int64_t lo = (int64_t)s->rank * chunk, hi = lo + chunk;
        if (lo > n) lo = n;
        if (hi > n) hi = n;
        for (int r = 0; r < s->tp; r++)
            src[r] = part + (size_t)r * s->stride + lo;
        reduce(s->result[par] + lo, src, s->tp, hi - lo);
        if ((rc = barrier(s))) return rc;
        if (n > 0) memcpy(buf, s->result[par], (size_t)n * sizeof(float));
    } else {
        for (int r = 0; r < s->tp; r++)
            src[r] = part + (size_t)r * s->stride;
        reduce(buf, src, s->tp, n);
    }
    s->st.ns_allreduce += (uint64_t)(now_ns() - t0);
    return 0;
}

static int coll_allreduce(void *ctx, float *buf, int64_t n)
{
    return dc_shm_allreduce(ctx, buf, n);
}

kn_collective dc_shm_collective(dc_shm *s)
{
    return (kn_collective){.ctx = s, .allreduce_sum = coll_allreduce};
}

/* ---- plan broadcast ---- */

int dc_shm_plan_begin(dc_shm *s, void **buf, size_t *cap)
{
    int rc = check_usable(s, "plan");
    if (rc) return rc;
    if (s->rank != 0 || !buf || !cap) {
        TD_LOG_ERR("dc_shm %s rank %d: only rank 0 publishes plans", s->inst, s->rank);
        return TD_EINVAL;
    }
    uint32_t q = s->plan_seq + 1;
    if (s->tp > 1) {
        /* slot q & 1 held plan q - 2: free once every follower took plan q - 1 */
        uint32_t want = (q - 1) * (uint32_t)(s->tp - 1);
        rc = wait_word(s, &s->h->taken_word, &s->h->taken_waiters, want, s->op_timeout_ns);
        if (rc == TD_ETIMEDOUT) {
            report_silent(s, "previous plan not taken", q - 1, true);
            return fail(s, TD_ETIMEDOUT);
        }
        if (rc == DC_SHM_INTR) {
            TD_LOG_ERR("dc_shm %s rank 0: interrupted publishing a plan", s->inst);
            return fail(s, TD_ESTATE);
        }
        if (rc) return rc;
    }
    s->in_plan = true;
    *buf = s->plan[q & 1];
    *cap = s->max_plan;
    return 0;
}

static void publish(dc_shm *s, uint32_t kind, size_t len)
{
    shm_hdr *h = s->h;
    uint32_t q = ++s->plan_seq;
    atomic_store_explicit(&h->plan_kind[q & 1], kind, memory_order_relaxed);
    atomic_store_explicit(&h->plan_len[q & 1], len, memory_order_relaxed);
    post_word(&h->plan_seq, &h->plan_waiters, q);
    s->in_plan = false;
}

int dc_shm_plan_commit(dc_shm *s, size_t len)
{
    int rc = check_usable(s, "plan");
    if (rc) return rc;
    if (!s->in_plan || len > s->max_plan) {
        TD_LOG_ERR("dc_shm %s rank %d: plan commit of %zu bytes (max %zu)%s", s->inst, s->rank, len,
                   s->max_plan, s->in_plan ? "" : " without plan_begin");
        return TD_EINVAL;
    }
    publish(s, PLAN_KIND_PLAN, len);
    s->st.n_plans++;
    return 0;
}

int dc_shm_plan_publish(dc_shm *s, const void *plan, size_t len)
{
    if (!s->err && len > s->max_plan) {
        TD_LOG_ERR("dc_shm %s rank %d: plan of %zu bytes (max %zu)", s->inst, s->rank, len,
                   s->max_plan);
        return TD_EINVAL;
    }
    void *buf;
    size_t cap;
    int rc = dc_shm_plan_begin(s, &buf, &cap);
    if (rc) return rc;
    if (len) memcpy(buf, plan, len);
    return dc_shm_plan_commit(s, len);
}

int dc_shm_plan_stop(dc_shm *s)
{
    void *buf;
    size_t cap;
    int rc = dc_shm_plan_begin(s, &buf, &cap);
    if (rc) return rc;
    publish(s, PLAN_KIND_STOP, 0);
    s->stopped = true;
    return 0;
}

int dc_shm_plan_wait(dc_shm *s, int timeout_ms, const void **plan, size_t *len)
{
    if (s->err) return s->err;
    if (s->stopped) return DC_SHM_STOP;
    if (!s->gathered || s->rank == 0 || !plan || !len) {
        TD_LOG_ERR("dc_shm %s rank %d: plan_wait is for followers", s->inst, s->rank);
        return TD_EINVAL;
    }
    shm_hdr *h = s->h;
    uint32_t q = s->plan_seq + 1;
    int64_t tmo = timeout_ms < 0 ? -1 : (int64_t)timeout_ms * 1000000;
    int rc = wait_word(s, &h->plan_seq, &h->plan_waiters, q, tmo);
    if (rc) return rc; /* TD_ETIMEDOUT and DC_SHM_INTR leave the instance intact */
    s->plan_seq = q;
    atomic_store(&h->ranks[s->rank].plan_taken, q);
    /* done with plan q - 1: the leader may reuse its slot for plan q + 1 */
    atomic_fetch_add(&h->taken_word, 1);
    if (atomic_load(&h->taken_waiters)) futex_wake(&h->taken_word);
    uint32_t kind = atomic_load_explicit(&h->plan_kind[q & 1], memory_order_relaxed);
    uint64_t n = atomic_load_explicit(&h->plan_len[q & 1], memory_order_relaxed);
    if (kind == PLAN_KIND_STOP) {
        s->stopped = true;
        return DC_SHM_STOP;
    }
    if (kind != PLAN_KIND_PLAN || n > s->max_plan) {
        TD_LOG_ERR("dc_shm %s rank %d: corrupt plan %u (kind %u, %llu bytes)", s->inst, s->rank, q,
                   kind, (unsigned long long)n);
        return fail(s, TD_EIO);
    }
    *plan = s->plan[q & 1];
    *len = (size_t)n;
    s->st.n_plans++;
    return 0;
}

int dc_shm_check(dc_shm *s)
{
    if (s->err) return s->err;
    if (!s->h) return TD_ESTATE;
    int rc = peer_broke(s);
    if (rc) return rc;
    int dead = find_dead(s);
    return dead >= 0 ? report_dead(s, dead) : 0;
}

/* ---- rendezvous ---- */

static bool name_ok(const char *x, size_t max)
{
    size_t n = x ? strlen(x) : 0;
    if (n == 0 || n > max) return false;
    for (size_t i = 0; i < n; i++) {
        char c = x[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '.' || c == '-'))
            return false;
    }
    return true;
}

static void set_views(dc_shm *s)
{
    uint8_t *base = (uint8_t *)s->h;
    size_t off = (sizeof(shm_hdr) + PAGE - 1) & ~(size_t)(PAGE - 1);
    size_t part = (size_t)s->tp * s->stride * sizeof(float);
    for (int p = 0; p < 2; p++)
        s->partial[p] = (float *)(base + off + (size_t)p * part);
    off += 2 * part;
    for (int p = 0; p < 2; p++)
        s->result[p] = (float *)(base + off + (size_t)p * s->stride * sizeof(float));
    off += 2 * s->stride * sizeof(float);
    for (int p = 0; p < 2; p++)
        s->plan[p] = base + off + (size_t)p * s->plan_stride;
}

static size_t layout_size(const dc_shm *s)
{
    size_t off = (sizeof(shm_hdr) + PAGE - 1) & ~(size_t)(PAGE - 1);
    off += (2 * (size_t)s->tp + 2) * s->stride * sizeof(float);
    off += 2 * s->plan_stride;
    return (off + PAGE - 1) & ~(size_t)(PAGE - 1);
}

/* Whether s->name still names this object's segment (and not a newer one). */
static bool name_is_ours(const dc_shm *s)
{
    int fd = shm_open(s->name, O_RDONLY, 0);
    if (fd < 0) return false;
    struct stat st;
    bool same = fstat(fd, &st) == 0 && st.st_dev == s->dev && st.st_ino == s->ino;
    close(fd);
    return same;
}

/* Rank 0: remove a stale segment (refuse a live one), create a fresh one, join it. */
static int create_segment(dc_shm *s)
{
    int fd = shm_open(s->name, O_RDWR, 0);
    if (fd >= 0) {
        struct stat st;
        if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(shm_hdr)) {
            shm_hdr *old = mmap(NULL, sizeof(shm_hdr), PROT_READ, MAP_SHARED, fd, 0);
            if (old != MAP_FAILED) {
                bool live =
                    old->magic == SHM_MAGIC && atomic_load(&old->ready) &&
                    !atomic_load(&old->broken) && atomic_load(&old->ranks[0].pid) != s->pid &&
                    proc_alive(atomic_load(&old->ranks[0].pid), atomic_load(&old->ranks[0].start));
                pid_t opid = atomic_load(&old->ranks[0].pid);
                munmap(old, sizeof(shm_hdr));
                if (live) {
                    close(fd);
                    TD_LOG_ERR("dc_shm %s rank 0: instance already running: %s belongs to "
                               "rank 0 pid %d",
                               s->inst, s->name, (int)opid);
                    return TD_ESTATE;
                }
            }
        }
        close(fd);
        TD_LOG_INFO("dc_shm %s rank 0: replacing stale segment %s", s->inst, s->name);
        if (shm_unlink(s->name) && errno != ENOENT) {
            TD_LOG_ERR("dc_shm %s rank 0: shm_unlink %s: %s", s->inst, s->name, strerror(errno));
            return TD_EIO;
        }
    }
    fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        TD_LOG_ERR("dc_shm %s rank 0: shm_open %s: %s%s", s->inst, s->name, strerror(errno),
                   errno == EEXIST ? " (another rank 0 is starting)" : "");
        return errno == EEXIST ? TD_ESTATE : TD_EIO;
    }
    s->linked = true;
    struct stat st;
    if (fstat(fd, &st) == 0) {
        s->dev = st.st_dev;
        s->ino = st.st_ino;
    }
    size_t size = layout_size(s);
    int err = ftruncate(fd, (off_t)size) ? errno : posix_fallocate(fd, 0, (off_t)size);
    if (err) {
        close(fd);
        TD_LOG_ERR("dc_shm %s rank 0: cannot reserve %zu MiB for %s: %s", s->inst, size >> 20,
                   s->name, strerror(err));
        return err == ENOSPC || err == ENOMEM ? TD_ENOMEM : TD_EIO;
    }
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        TD_LOG_ERR("dc_shm %s rank 0: mmap %s: %s", s->inst, s->name, strerror(errno));
        return TD_ENOMEM;
    }
    s->h = m;
    s->size = size;
    shm_hdr *h = s->h;
    h->magic = SHM_MAGIC;
    h->version = SHM_VERSION;
    h->tp = (uint32_t)s->tp;
    h->stride = s->stride;
    h->plan_stride = s->plan_stride;
    h->total = size;
    h->epoch = s->epoch = new_epoch();
    atomic_store(&h->ranks[0].claim, 1);
    atomic_store(&h->ranks[0].pid, s->pid);
    atomic_store(&h->ranks[0].start, s->start);
    atomic_store(&h->ranks[0].joined_epoch, s->epoch);
    atomic_store(&h->join_word, 1);
    atomic_store_explicit(&h->ready, 1, memory_order_release);
    return 0;
}

/* Follower: use the segment behind fd if it is this run's. 1 attached, 0 not (yet) usable
 * (s->why says why), or a negative td_err. */
static int try_attach(dc_shm *s, int fd)
{
    struct stat st;
    if (fstat(fd, &st) || (size_t)st.st_size < sizeof(shm_hdr)) {
        snprintf(s->why, sizeof s->why, "segment %s being created", s->name);
        return 0;
    }
    size_t size = (size_t)st.st_size;
    shm_hdr *h = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (h == MAP_FAILED) {
        TD_LOG_ERR("dc_shm %s rank %d: mmap %s: %s", s->inst, s->rank, s->name, strerror(errno));
        return TD_ENOMEM;
    }
    if (!atomic_load_explicit(&h->ready, memory_order_acquire) || h->magic != SHM_MAGIC ||
        h->version != SHM_VERSION) {
        snprintf(s->why, sizeof s->why, "segment %s not initialised", s->name);
        munmap(h, size);
        return 0;
    }
    pid_t pid0 = atomic_load(&h->ranks[0].pid);
    if (!proc_alive(pid0, atomic_load(&h->ranks[0].start)) || atomic_load(&h->broken)) {
        snprintf(s->why, sizeof s->why, "stale segment %s of rank 0 pid %d", s->name, (int)pid0);
        munmap(h, size);
        return 0;
    }
    if (h->tp != (uint32_t)s->tp || h->stride != s->stride || h->plan_stride != s->plan_stride ||
        h->total != size || size != layout_size(s)) {
        TD_LOG_ERR("dc_shm %s rank %d: rank 0 (pid %d) has tp %u, %llu floats, %llu plan "
                   "bytes; this rank has tp %d, %llu floats, %llu plan bytes",
                   s->inst, s->rank, (int)pid0, h->tp, (unsigned long long)h->stride,
                   (unsigned long long)h->plan_stride, s->tp, (unsigned long long)s->stride,
                   (unsigned long long)s->plan_stride);
        munmap(h, size);
        return TD_EINVAL;
    }
    shm_rank *me = &h->ranks[s->rank];
    uint32_t zero = 0;
    if (!atomic_compare_exchange_strong(&me->claim, &zero, 1)) {
        pid_t owner = atomic_load(&me->pid);
        if (owner != s->pid && !proc_alive(owner, atomic_load(&me->start))) {
            /* this rank's previous process joined and died: rank 0 notices within
             * liveness_ms, breaks this segment and makes a fresh one; wait for that */
            snprintf(s->why, sizeof s->why, "rank %d of segment %s held by dead pid %d", s->rank,
                     s->name, (int)owner);
            munmap(h, size);
            return 0;
        }
        TD_LOG_ERR("dc_shm %s rank %d: rank %d already taken by pid %d", s->inst, s->rank, s->rank,
                   (int)owner);
        munmap(h, size);
        return TD_ESTATE;
    }
    s->h = h;
    s->size = size;
    s->dev = st.st_dev;
    s->ino = st.st_ino;
    s->epoch = h->epoch;
    atomic_store(&me->pid, s->pid);
    atomic_store(&me->start, s->start);
    atomic_store(&me->joined_epoch, s->epoch);
    atomic_fetch_add(&h->join_word, 1);
    futex_wake(&h->join_word);
    return 1;
}

/* Follower: poll for this run's segment until the deadline. The poll backs off from 1 ms
 * to FIND_MAX_BACKOFF: quick when the ranks start together, and a follower waiting a long
 * time for a (new) leader wakes only FIND_MAX_BACKOFF^-1 times a second. */
static int find_segment(dc_shm *s, int64_t deadline)
{
    int64_t backoff = 1000000;
    snprintf(s->why, sizeof s->why, "no segment %s", s->name);
    for (;;) {
        int fd = shm_open(s->name, O_RDWR, 0);
        if (fd >= 0) {
            int rc = try_attach(s, fd);
            close(fd);
            if (rc) return rc < 0 ? rc : 0;
        } else if (errno != ENOENT) {
            TD_LOG_ERR("dc_shm %s rank %d: shm_open %s: %s", s->inst, s->rank, s->name,
                       strerror(errno));
            return TD_EIO;
        }
        if (interrupted(s)) {
            TD_LOG_ERR("dc_shm %s rank %d: interrupted waiting for rank 0", s->inst, s->rank);
            return TD_ESTATE;
        }
        int64_t now = now_ns();
        if (now >= deadline) {
            TD_LOG_ERR("dc_shm %s rank %d: rendezvous timed out after %d ms: missing rank 0 (%s)",
                       s->inst, s->rank, s->timeout_ms, s->why);
            return TD_ETIMEDOUT;
        }
        sleep_ns(deadline - now < backoff ? deadline - now : backoff);
        backoff = backoff * 2 < FIND_MAX_BACKOFF_NS ? backoff * 2 : FIND_MAX_BACKOFF_NS;
    }
}

/* Every rank, once attached: wait until all tp ranks joined, until deadline (INT64_MAX:
 * no limit). final (dc_shm_open): running out of time fails the instance; otherwise
 * (dc_shm_gather) it is TD_ETIMEDOUT, not logged, and the caller may wait again. */
static int gather(dc_shm *s, int64_t deadline, bool final)
{
    if (s->err) return s->err;
    if (s->gathered) return 0;
    shm_hdr *h = s->h;
    int64_t left = deadline == INT64_MAX ? -1 : deadline - now_ns();
    if (deadline != INT64_MAX && left < 0) left = 0;
    int rc = wait_word(s, &h->join_word, &h->join_waiters, (uint32_t)s->tp, left);
    if (rc == TD_ETIMEDOUT && !final) {
        if (s->rank == 0 && s->linked && !name_is_ours(s)) {
            /* removed by a follower that took it for its dead rank 0's (dc_shm_close) */
            TD_LOG_ERR("dc_shm %s rank 0: %s was removed while the ranks gathered", s->inst,
                       s->name);
            s->linked = false;
            note(s, "rendezvous segment %s removed", s->name);
            return fail(s, TD_EIO);
        }
        return TD_ETIMEDOUT;
    }
    if (rc == TD_ETIMEDOUT) {
        char list[256] = "";
        size_t len = 0;
        for (int r = 0; r < s->tp && len < sizeof list - 8; r++)
            if (atomic_load(&h->ranks[r].joined_epoch) != s->epoch)
                len += (size_t)snprintf(list + len, sizeof list - len, "%s%d", len ? ", " : "", r);
        TD_LOG_ERR("dc_shm %s rank %d: rendezvous timed out after %d ms: missing rank %s "
                   "(of tp %d)",
                   s->inst, s->rank, s->timeout_ms, len ? list : "?", s->tp);
        return fail(s, TD_ETIMEDOUT);
    }
    if (rc == DC_SHM_INTR) {
        TD_LOG_ERR("dc_shm %s rank %d: interrupted in the rendezvous", s->inst, s->rank);
        return fail(s, TD_ESTATE);
    }
    if (rc) return rc;
    s->gathered = true;
    open_pidfds(s);
    if (s->rank == 0) {
        shm_unlink(s->name); /* everyone has it mapped: nothing can go stale from here on */
        s->linked = false;
    }
    return 0;
}

/* Check p, allocate the object and create (rank 0) or find and join (followers, until
 * *deadline) the segment. */
static int begin(const dc_shm_params *p, dc_shm **out, int64_t *deadline)
{
    if (!out) return TD_EINVAL;
    *out = NULL;
    if (!p || !name_ok(p->instance, 64) || (p->token && p->token[0] && !name_ok(p->token, 64)) ||
        p->tp < 1 || p->tp > DC_SHM_MAX_TP || p->rank < 0 || p->rank >= p->tp ||
        p->max_floats <= 0 || p->max_floats > ((int64_t)1 << 40) ||
        p->max_plan > ((size_t)1 << 34)) {
        TD_LOG_ERR("dc_shm: bad params (instance '%s', token '%s', rank %d, tp %d, max_floats "
                   "%lld, max_plan %zu)",
                   p && p->instance ? p->instance : "", p && p->token ? p->token : "",
                   p ? p->rank : -1, p ? p->tp : 0, p ? (long long)p->max_floats : 0LL,
                   p ? p->max_plan : 0);
        return TD_EINVAL;
    }
    dc_shm *s = calloc(1, sizeof *s);
    if (!s) return TD_ENOMEM;
    for (int r = 0; r < DC_SHM_MAX_TP; r++)
        s->pidfd[r] = -1;
    s->culprit = -1;
    char tok[32];
    const char *token = p->token && p->token[0] ? p->token : tok;
    snprintf(tok, sizeof tok, "%u", (unsigned)getuid());
    snprintf(s->name, sizeof s->name, "/tandem-%s-%s", p->instance, token);
    snprintf(s->inst, sizeof s->inst, "%s", p->instance);
    s->rank = p->rank;
    s->tp = p->tp;
    s->max_floats = p->max_floats;
    s->stride = ((uint64_t)p->max_floats + 31) & ~(uint64_t)31;
    s->max_plan = p->max_plan ? p->max_plan : DEF_MAX_PLAN;
    s->plan_stride = (s->max_plan + LINE - 1) & ~(uint64_t)(LINE - 1);
    s->timeout_ms = p->timeout_ms > 0 ? p->timeout_ms : DEF_TIMEOUT_MS;
    s->op_timeout_ns =
        (int64_t)(p->op_timeout_ms > 0 ? p->op_timeout_ms : DEF_TIMEOUT_MS) * 1000000;
    s->liveness_ns = (int64_t)(p->liveness_ms > 0 ? p->liveness_ms : DEF_LIVENESS_MS) * 1000000;
    s->spin_ns = p->spin_us < 0 ? 0 : (int64_t)(p->spin_us ? p->spin_us : DEF_SPIN_US) * 1000;
    s->intr = p->interrupt;
    s->pid = getpid();
    char state;
    if (proc_stat(s->pid, &state, &s->start) != 1) s->start = 0;

    *deadline = now_ns() + (int64_t)s->timeout_ms * 1000000;
    int rc = s->rank == 0 ? create_segment(s) : find_segment(s, *deadline);
    if (rc) {
        dc_shm_close(s);
        return rc;
    }
    set_views(s);
    *out = s;
    return 0;
}

int dc_shm_open(const dc_shm_params *p, dc_shm **out)
{
    int64_t deadline;
    int rc = begin(p, out, &deadline);
    if (rc) return rc;
    if ((rc = gather(*out, deadline, true))) {
        dc_shm_close(*out);
        *out = NULL;
    }
    return rc;
}

int dc_shm_begin(const dc_shm_params *p, dc_shm **out)
{
    int64_t deadline;
    return begin(p, out, &deadline);
}

int dc_shm_gather(dc_shm *s, int wait_ms)
{
    return gather(s, wait_ms < 0 ? INT64_MAX : now_ns() + (int64_t)wait_ms * 1000000, false);
}

uint64_t dc_shm_joined(const dc_shm *s)
{
    uint64_t m = 0;
    for (int r = 0; s && s->h && r < s->tp; r++)
        if (atomic_load(&s->h->ranks[r].joined_epoch) == s->epoch) m |= (uint64_t)1 << r;
    return m;
}

void dc_shm_close(dc_shm *s)
{
    if (!s) return;
    if (s->linked && name_is_ours(s)) shm_unlink(s->name);
    /* a follower whose rank 0 died while the ranks gathered: nobody else would remove that
     * name until the next rank 0 starts (a leader may wait long for a restarted rank). The
     * check is not atomic with the unlink: a new rank 0 replacing the name in between
     * loses its name, notices (gather) and makes another segment. */
    if (s->rank > 0 && s->h && !s->gathered && s->culprit == 0 && name_is_ours(s)) {
        TD_LOG_INFO("dc_shm %s rank %d: removing %s (its rank 0 died)", s->inst, s->rank, s->name);
        shm_unlink(s->name);
    }
    if (s->h) {
        if (!s->stopped && !s->err) {
            /* leaving without a clean stop: the peers must not wait for this rank */
            TD_LOG_DEBUG("dc_shm %s rank %d: closing without stop", s->inst, s->rank);
            fail(s, TD_EIO);
        }
        munmap(s->h, s->size);
    }
    for (int r = 0; r < DC_SHM_MAX_TP; r++)
        if (s->pidfd[r] >= 0) close(s->pidfd[r]);
    free(s);
}

const char *dc_shm_error(const dc_shm *s)
{
    if (!s || !s->err) return "";
    return s->err_msg[0] ? s->err_msg : td_strerror(s->err);
}

int dc_shm_rank(const dc_shm *s)
{
    return s->rank;
}

int dc_shm_tp(const dc_shm *s)
{
    return s->tp;
}

int dc_shm_rank_pid(const dc_shm *s, int rank)
{
    if (!s->gathered || rank < 0 || rank >= s->tp) return -1;
    return (int)atomic_load(&s->h->ranks[rank].pid);
}

void dc_shm_get_stats(const dc_shm *s, dc_shm_stats *out)
{
    *out = s->st;
}
