/* dc_shm.c: the shared-memory collective of a decode instance (see dc_shm.h): barrier,
 * allreduce, plan broadcast and failure detection (the rendezvous is in dc_shm_join.c).
 *
 * Segment layout (offsets page-aligned):
 *   dc_shm_hdr                      identity, futex words (each on its own line), rank slots
 *   partial[ring][tp][stride] floats  each rank's input of the operation in each slot set
 *   result[ring][stride] floats       reduce-scatter target of the two-phase allreduce
 *   plan[2][plan_stride] bytes      plan slots, seq q uses slot q & 1
 * Operation k (an allreduce, a gather piece, a dp collective) uses slot set k % ring. With
 * blocking collectives only (ring 2) a rank starts k once k - 1 completed, whose barrier every
 * rank passed, so every rank finished k - 2. With the split allreduce (ring 4) a rank starts
 * operation k with nothing in flight but, at most, operation k - 1 (posted, not yet waited),
 * so it has completed k - 2, whose barrier every rank passed; each rank started k - 2 by the
 * same rule, having completed k - 4 (its reads of the set included). Either way one barrier
 * an operation suffices, no second one to free the slots. A barrier
 * completes when every rank's arrival index reached it (ranks may arrive at a later one first: a
 * split allreduce posts without waiting), whoever sees that last posts it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <immintrin.h>
#include <limits.h>
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

#include "dc_shm_int.h"
#include "td_clock.h"
#include "td_err.h"
#include "td_futex.h"

#define RED_BLOCK 1024 /* floats reduced per block (L1-sized) */
/* Above this many floats (and tp >= 3) the allreduce reduce-scatters then gathers (reads
 * about 2n floats per rank) instead of every rank summing all tp inputs (tp * n). */
#define TWO_PHASE_MIN 4096

/* ---- futex ---- */

void dc_shm_futex_wake(_Atomic uint32_t *w)
{
    td_futex_wake(w, INT_MAX, true);
}

/* ---- failure ---- */

static void wake_all(dc_shm_hdr *h)
{
    dc_shm_futex_wake(&h->join_word);
    dc_shm_futex_wake(&h->bar_gen);
    dc_shm_futex_wake(&h->plan_seq);
    dc_shm_futex_wake(&h->taken_word);
}

/* Remember the first reason this object broke, for dc_shm_error (the callers' messages). */
void dc_shm_note(dc_shm *s, const char *fmt, ...)
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

int dc_shm_fail(dc_shm *s, int err)
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
        dc_shm_note(s, "rank %d died (seen by rank %d)", cul, det);
    else if (cul != det && err == TD_ETIMEDOUT)
        dc_shm_note(s, "rank %d not answering (seen by rank %d)", cul, det);
    else if (err == TD_ESTATE) /* only an interrupt breaks with TD_ESTATE */
        dc_shm_note(s, "rank %d stopped (interrupted)", det);
    else
        dc_shm_note(s, "rank %d failed or left (%s)", det, td_strerror(err));
    if (!s->err) s->err = err;
    return s->err;
}

/* A joined peer whose process is gone, or -1. */
static int find_dead(dc_shm *s)
{
    for (int r = 0; r < s->tp; r++) {
        dc_shm_slot *x = &s->h->ranks[r];
        if (r == s->rank || atomic_load(&x->joined_epoch) != s->epoch) continue;
        if (s->pidfd[r] >= 0) {
            struct pollfd pf = {.fd = s->pidfd[r], .events = POLLIN};
            if (poll(&pf, 1, 0) > 0) return r;
            continue;
        }
        pid_t pid = atomic_load(&x->pid);
        if (pid == s->pid) continue; /* ranks as threads of one process */
        if (!dc_shm_proc_alive(pid, atomic_load(&x->start))) return r;
    }
    return -1;
}

static int report_dead(dc_shm *s, int r)
{
    pid_t pid = atomic_load(&s->h->ranks[r].pid);
    TD_LOG_ERR("dc_shm %s rank %d: rank %d died (pid %d)", s->inst, s->rank, r, (int)pid);
    dc_shm_note(s, "rank %d died (pid %d)", r, (int)pid);
    s->culprit = r;
    return dc_shm_fail(s, TD_EIO);
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
int dc_shm_wait_word(dc_shm *s, _Atomic uint32_t *word, _Atomic uint32_t *waiters, uint32_t target,
                     int64_t timeout_ns)
{
    if (reached(word, target)) return 0;
    dc_shm_hdr *h = s->h;
    int64_t t0 = td_now_ns();
    if (s->spin_ns > 0) {
        int64_t yield_after = s->spin_ns / 5;
        for (uint32_t i = 1;; i++) {
            _mm_pause();
            if (reached(word, target)) return 0;
            if ((i & 63) == 0) {
                if (atomic_load_explicit(&h->broken, memory_order_relaxed)) break;
                int64_t spent = td_now_ns() - t0;
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
        if (dc_shm_interrupted(s)) return DC_SHM_INTR;
        int64_t now = td_now_ns();
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
        if ((int32_t)(v - target) < 0) td_futex_wait(word, v, until - now, true);
        atomic_fetch_sub(waiters, 1);
    }
}

/* Store *word = val and wake its sleepers. */
void dc_shm_post_word(_Atomic uint32_t *word, _Atomic uint32_t *waiters, uint32_t val)
{
    atomic_store(word, val);
    if (atomic_load(waiters)) dc_shm_futex_wake(word);
}

/* Log the ranks that have not reached a point (have[r] < want) as not answering. */
static void report_silent(dc_shm *s, const char *what, uint64_t want, bool plan)
{
    char list[256] = "";
    size_t len = 0;
    for (int r = 0; r < s->tp && len < sizeof list - 8; r++) {
        if (r == s->rank || (plan && r == 0)) continue;
        dc_shm_slot *x = &s->h->ranks[r];
        bool behind = plan ? (int32_t)(atomic_load(&x->plan_taken) - (uint32_t)want) < 0
                           : atomic_load(&x->arrived) < want;
        if (!behind) continue;
        if (s->culprit < 0) s->culprit = r;
        len += (size_t)snprintf(list + len, sizeof list - len, "%s%d", len ? ", " : "", r);
    }
    TD_LOG_ERR("dc_shm %s rank %d: rank %s not answering (%s, %lld ms)", s->inst, s->rank,
               len ? list : "?", what, (long long)(s->op_timeout_ns / 1000000));
    dc_shm_note(s, "rank %s not answering (%s, %lld ms)", len ? list : "?", what,
                (long long)(s->op_timeout_ns / 1000000));
}

/* Arrive at the next barrier (its index): whoever sees every rank there posts it. The
 * arrival and the look at the others are sequentially consistent, so of two ranks arriving
 * at once at least one sees the other: the last arrival is never missed. */
static uint64_t arrive(dc_shm *s)
{
    dc_shm_hdr *h = s->h;
    uint64_t k = ++s->bar_k;
    atomic_store(&h->ranks[s->rank].arrived, k);
    for (int r = 0; r < s->tp; r++)
        if (atomic_load(&h->ranks[r].arrived) < k) return k;
    uint32_t v = atomic_load(&h->bar_gen);
    while ((int32_t)((uint32_t)k - v) > 0 &&
           !atomic_compare_exchange_weak(&h->bar_gen, &v, (uint32_t)k)) {
    }
    if (atomic_load(&h->bar_waiters)) dc_shm_futex_wake(&h->bar_gen);
    return k;
}

/* Wait until barrier k completed. */
static int await_barrier(dc_shm *s, uint64_t k)
{
    dc_shm_hdr *h = s->h;
    int rc = dc_shm_wait_word(s, &h->bar_gen, &h->bar_waiters, (uint32_t)k, s->op_timeout_ns);
    if (rc == TD_ETIMEDOUT) {
        report_silent(s, "allreduce barrier", k, false);
        return dc_shm_fail(s, TD_ETIMEDOUT);
    }
    if (rc == DC_SHM_INTR) {
        TD_LOG_ERR("dc_shm %s rank %d: interrupted in an allreduce", s->inst, s->rank);
        return dc_shm_fail(s, TD_ESTATE);
    }
    return rc;
}

/* All ranks meet; every rank's writes before it are visible to all after it. */
int dc_shm_barrier(dc_shm *s)
{
    return await_barrier(s, arrive(s));
}

int dc_shm_next_slot(dc_shm *s)
{
    if (s->posted >= 2 || (s->posted == 1 && s->post_k[0] + 1 != s->ar_k)) {
        TD_LOG_ERR("dc_shm %s rank %d: a collective with %s in flight", s->inst, s->rank,
                   s->posted >= 2 ? "two split allreduces" : "an older split allreduce");
        dc_shm_fail(s, TD_ESTATE);
        return -1;
    }
    return (int)(s->ar_k++ % (uint64_t)s->ring);
}

/* ---- allreduce ---- */

/* out[i] = ((src[0][i] + src[1][i]) + src[2][i]) + ... for i in [0, n), tp >= 2; out does
 * not overlap the sources. The same order on every rank makes the sums bit-identical. */
void dc_shm_reduce_sum(float *restrict out, const float *const *src, int tp, int64_t n)
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

int dc_shm_check_usable(dc_shm *s, const char *what)
{
    if (s->err) return s->err;
    if (!s->gathered) return TD_ESTATE;
    if (s->stopped) {
        TD_LOG_ERR("dc_shm %s rank %d: %s after stop", s->inst, s->rank, what);
        return TD_ESTATE;
    }
    return 0;
}

/* After the barrier of an operation (its slot set par): every rank published the same size
 * word (an allreduce's n, or gather_word of a gather), else the instance breaks. */
int dc_shm_check_sizes(dc_shm *s, int par, int64_t word)
{
    for (int r = 0; r < s->tp; r++) {
        int64_t wr = atomic_load_explicit(&s->h->ranks[r].n[par], memory_order_relaxed);
        if (wr != word) {
            TD_LOG_ERR("dc_shm %s rank %d: collective size mismatch: rank %d has %lld (%s), "
                       "rank %d has %lld (%s)",
                       s->inst, s->rank, s->rank, (long long)word,
                       word < 0 ? "gather" : "allreduce floats", r, (long long)wr,
                       wr < 0 ? "gather" : "allreduce floats");
            return dc_shm_fail(s, TD_EINVAL);
        }
    }
    return 0;
}

static int bad_allreduce(dc_shm *s, const float *buf, int64_t n)
{
    int rc = dc_shm_check_usable(s, "allreduce");
    if (rc) return rc;
    if (n >= 0 && n <= s->max_floats && (n == 0 || buf)) return 0;
    TD_LOG_ERR("dc_shm %s rank %d: allreduce of %lld floats (max %lld)", s->inst, s->rank,
               (long long)n, (long long)s->max_floats);
    return dc_shm_fail(s, TD_EINVAL);
}

/* This rank's input of an allreduce into the next slot set, and its arrival at the barrier
 * (the operation's slot set in *par, its barrier in *bar). */
static int post_input(dc_shm *s, const float *buf, int64_t n, int *par, uint64_t *bar)
{
    if ((*par = dc_shm_next_slot(s)) < 0) return s->err;
    if (n > 0)
        memcpy(s->partial[*par] + (size_t)s->rank * s->stride, buf, (size_t)n * sizeof(float));
    atomic_store_explicit(&s->h->ranks[s->rank].n[*par], n, memory_order_relaxed);
    *bar = arrive(s);
    return 0;
}

/* Once barrier bar completed: every rank's input of slot set par summed into buf, by every
 * rank over all inputs, or (two_phase) reduce-scattered and gathered (fewer reads for a
 * large n and tp >= 3; one more barrier; the same sums, in the same order). */
static int sum_inputs(dc_shm *s, int par, uint64_t bar, float *buf, int64_t n, bool two_phase)
{
    int rc = await_barrier(s, bar);
    if (rc || (rc = dc_shm_check_sizes(s, par, n))) return rc;
    const float *src[DC_SHM_MAX_TP];
    float *part = s->partial[par];
    if (two_phase) {
        int64_t chunk = ((n + s->tp - 1) / s->tp + 15) & ~(int64_t)15;
        int64_t lo = (int64_t)s->rank * chunk, hi = lo + chunk;
        if (lo > n) lo = n;
        if (hi > n) hi = n;
        for (int r = 0; r < s->tp; r++)
            src[r] = part + (size_t)r * s->stride + lo;
        dc_shm_reduce_sum(s->result[par] + lo, src, s->tp, hi - lo);
        if ((rc = dc_shm_barrier(s))) return rc;
        if (n > 0) memcpy(buf, s->result[par], (size_t)n * sizeof(float));
        return 0;
    }
    for (int r = 0; r < s->tp; r++)
        src[r] = part + (size_t)r * s->stride;
    dc_shm_reduce_sum(buf, src, s->tp, n);
    return 0;
}

int dc_shm_allreduce(dc_shm *s, float *buf, int64_t n)
{
    int rc = bad_allreduce(s, buf, n);
    if (rc) return rc;
    s->st.n_allreduce++;
    if (s->tp == 1) return 0;
    int64_t t0 = td_now_ns();
    int par;
    uint64_t bar;
    const bool two_phase = s->tp >= 3 && n >= TWO_PHASE_MIN;
    if ((rc = post_input(s, buf, n, &par, &bar)) ||
        (rc = sum_inputs(s, par, bar, buf, n, two_phase)))
        return rc;
    s->st.ns_allreduce += (uint64_t)(td_now_ns() - t0);
    return 0;
}

int dc_shm_allreduce_post(dc_shm *s, const float *buf, int64_t n, uint64_t *ticket)
{
    int rc = bad_allreduce(s, buf, n);
    if (rc) return rc;
    *ticket = s->ar_k;
    if (s->tp == 1) return 0;
    if (s->ring < DC_SHM_RING) {
        TD_LOG_ERR("dc_shm %s rank %d: a split allreduce on a segment opened without "
                   "split_allreduce",
                   s->inst, s->rank);
        return dc_shm_fail(s, TD_EINVAL);
    }
    int64_t t0 = td_now_ns();
    int par;
    uint64_t bar;
    if ((rc = post_input(s, buf, n, &par, &bar))) return rc;
    s->post_k[s->posted] = *ticket;
    s->post_bar[s->posted++] = bar;
    s->st.ns_allreduce += (uint64_t)(td_now_ns() - t0);
    return 0;
}

int dc_shm_allreduce_wait(dc_shm *s, uint64_t ticket, float *buf, int64_t n)
{
    int rc = bad_allreduce(s, buf, n);
    if (rc) return rc;
    s->st.n_allreduce++;
    if (s->tp == 1) return 0;
    if (!s->posted || s->post_k[0] != ticket) {
        TD_LOG_ERR("dc_shm %s rank %d: wait for allreduce %llu, not the oldest posted", s->inst,
                   s->rank, (unsigned long long)ticket);
        return dc_shm_fail(s, TD_ESTATE);
    }
    int64_t t0 = td_now_ns();
    const uint64_t bar = s->post_bar[0];
    s->post_k[0] = s->post_k[1];
    s->post_bar[0] = s->post_bar[1];
    s->posted--;
    /* one phase: the two-phase one's second barrier would wait for the ranks' other
     * micro-batch */
    if ((rc = sum_inputs(s, (int)(ticket % (uint64_t)s->ring), bar, buf, n, false))) return rc;
    s->st.ns_allreduce += (uint64_t)(td_now_ns() - t0);
    return 0;
}

/* ---- column gather ---- */

/* The size word of a gather of a (rows, n_cols) matrix: negative, so it never equals an
 * allreduce's n and a gather paired with an allreduce is a size mismatch. */
static int64_t gather_word(int64_t rows, int64_t n_cols)
{
    return -1 - rows * n_cols;
}

/* Floats [f0, f1) of a part (rows, nc) row-major into columns [c0, c0 + nc) of out
 * (rows, n_cols); src holds float f0 of the part. */
static void place(float *out, int64_t n_cols, int64_t c0, int64_t nc, const float *src, int64_t f0,
                  int64_t f1)
{
    while (f0 < f1) {
        int64_t row = f0 / nc, col = f0 % nc;
        int64_t len = nc - col < f1 - f0 ? nc - col : f1 - f0;
        memcpy(out + row * n_cols + c0 + col, src, (size_t)len * sizeof(float));
        src += len;
        f0 += len;
    }
}

static int bad_gather(dc_shm *s, int64_t rows, int64_t n_cols, const float *part, const float *out)
{
    int64_t c0 = (int64_t)s->rank * n_cols / s->tp, c1 = (int64_t)(s->rank + 1) * n_cols / s->tp;
    if (rows >= 0 && n_cols >= s->tp && rows <= INT64_MAX / n_cols &&
        (rows * (c1 - c0) == 0 || part) && (s->rank != 0 || rows == 0 || out))
        return 0;
    TD_LOG_ERR("dc_shm %s rank %d: gather of (%lld, %lld) floats%s%s", s->inst, s->rank,
               (long long)rows, (long long)n_cols, part ? "" : " without input",
               s->rank || out ? "" : " without output");
    return dc_shm_fail(s, TD_EINVAL);
}

int dc_shm_gather_cols(dc_shm *s, const float *part, int64_t rows, int64_t n_cols, float *out)
{
    int rc = dc_shm_check_usable(s, "gather");
    if (rc || (rc = bad_gather(s, rows, n_cols, part, out))) return rc;
    s->st.n_gather++;
    if (s->tp == 1) {
        if (rows > 0) memcpy(out, part, (size_t)(rows * n_cols) * sizeof(float));
        return 0;
    }
    int64_t t0 = td_now_ns();
    const int64_t S = (int64_t)s->stride, word = gather_word(rows, n_cols);
    const int64_t most = rows * ((n_cols + s->tp - 1) / s->tp); /* the largest part */
    const int64_t mine =
        rows * ((int64_t)(s->rank + 1) * n_cols / s->tp - (int64_t)s->rank * n_cols / s->tp);
    const int64_t pieces = most > S ? (most + S - 1) / S : 1;
    for (int64_t k = 0; k < pieces; k++) {
        int par = dc_shm_next_slot(s);
        if (par < 0) return s->err;
        const int64_t f0 = k * S;
        int64_t f1 = f0 + S < mine ? f0 + S : mine;
        /* rank 0 reads its own part in place */
        if (s->rank > 0 && f1 > f0)
            memcpy(s->partial[par] + (size_t)s->rank * s->stride, part + f0,
                   (size_t)(f1 - f0) * sizeof(float));
        atomic_store_explicit(&s->h->ranks[s->rank].n[par], word, memory_order_relaxed);
        if ((rc = dc_shm_barrier(s)) || (rc = dc_shm_check_sizes(s, par, word))) return rc;
        if (s->rank != 0) continue;
        for (int r = 0; r < s->tp; r++) {
            int64_t c0 = (int64_t)r * n_cols / s->tp, nc = (int64_t)(r + 1) * n_cols / s->tp - c0;
            int64_t g1 = f0 + S < rows * nc ? f0 + S : rows * nc;
            const float *src = r ? s->partial[par] + (size_t)r * s->stride : part + f0;
            if (g1 > f0) place(out, n_cols, c0, nc, src, f0, g1);
        }
    }
    s->st.ns_gather += (uint64_t)(td_now_ns() - t0);
    return 0;
}

int dc_shm_plan_begin(dc_shm *s, void **buf, size_t *cap)
{
    int rc = dc_shm_check_usable(s, "plan");
    if (rc) return rc;
    if (s->rank != 0 || !buf || !cap) {
        TD_LOG_ERR("dc_shm %s rank %d: only rank 0 publishes plans", s->inst, s->rank);
        return TD_EINVAL;
    }
    uint32_t q = s->plan_seq + 1;
    if (s->tp > 1) {
        /* slot q & 1 held plan q - 2: free once every follower took plan q - 1 */
        uint32_t want = (q - 1) * (uint32_t)(s->tp - 1);
        rc = dc_shm_wait_word(s, &s->h->taken_word, &s->h->taken_waiters, want, s->op_timeout_ns);
        if (rc == TD_ETIMEDOUT) {
            report_silent(s, "previous plan not taken", q - 1, true);
            return dc_shm_fail(s, TD_ETIMEDOUT);
        }
        if (rc == DC_SHM_INTR) {
            TD_LOG_ERR("dc_shm %s rank 0: interrupted publishing a plan", s->inst);
            return dc_shm_fail(s, TD_ESTATE);
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
    dc_shm_hdr *h = s->h;
    uint32_t q = ++s->plan_seq;
    atomic_store_explicit(&h->plan_kind[q & 1], kind, memory_order_relaxed);
    atomic_store_explicit(&h->plan_len[q & 1], len, memory_order_relaxed);
    dc_shm_post_word(&h->plan_seq, &h->plan_waiters, q);
    s->in_plan = false;
}

int dc_shm_plan_commit(dc_shm *s, size_t len)
{
    int rc = dc_shm_check_usable(s, "plan");
    if (rc) return rc;
    if (!s->in_plan || len > s->max_plan) {
        TD_LOG_ERR("dc_shm %s rank %d: plan commit of %zu bytes (max %zu)%s", s->inst, s->rank, len,
                   s->max_plan, s->in_plan ? "" : " without plan_begin");
        return TD_EINVAL;
    }
    publish(s, DC_SHM_PLAN, len);
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
    publish(s, DC_SHM_PLAN_STOP, 0);
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
    dc_shm_hdr *h = s->h;
    uint32_t q = s->plan_seq + 1;
    int64_t tmo = timeout_ms < 0 ? -1 : (int64_t)timeout_ms * 1000000;
    int rc = dc_shm_wait_word(s, &h->plan_seq, &h->plan_waiters, q, tmo);
    if (rc) return rc; /* TD_ETIMEDOUT and DC_SHM_INTR leave the instance intact */
    s->plan_seq = q;
    atomic_store(&h->ranks[s->rank].plan_taken, q);
    /* done with plan q - 1: the leader may reuse its slot for plan q + 1 */
    atomic_fetch_add(&h->taken_word, 1);
    if (atomic_load(&h->taken_waiters)) dc_shm_futex_wake(&h->taken_word);
    uint32_t kind = atomic_load_explicit(&h->plan_kind[q & 1], memory_order_relaxed);
    uint64_t n = atomic_load_explicit(&h->plan_len[q & 1], memory_order_relaxed);
    if (kind == DC_SHM_PLAN_STOP) {
        s->stopped = true;
        return DC_SHM_STOP;
    }
    if (kind != DC_SHM_PLAN || n > s->max_plan) {
        TD_LOG_ERR("dc_shm %s rank %d: corrupt plan %u (kind %u, %llu bytes)", s->inst, s->rank, q,
                   kind, (unsigned long long)n);
        return dc_shm_fail(s, TD_EIO);
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

const char *dc_shm_error(const dc_shm *s)
{
    if (!s || !s->err) return "";
    return s->err_msg[0] ? s->err_msg : td_strerror(s->err);
}

void dc_shm_leave_stopped(dc_shm *s)
{
    if (s && !s->stopped) dc_shm_fail(s, TD_ESTATE);
}

bool dc_shm_peer_stopped(const dc_shm *s)
{
    if (!s || !s->h) return false;
    uint32_t b = atomic_load(&s->h->broken);
    /* only an interrupt breaks with TD_ESTATE (dc_shm_fail's callers) */
    return b && (int)(b & 0xff) - 1 != s->rank && atomic_load(&s->h->broken_err) == TD_ESTATE;
}

void dc_shm_get_stats(const dc_shm *s, dc_shm_stats *out)
{
    *out = s->st;
}
