/* dc_shm_int.h: the segment layout and object of dc_shm, shared by its two files:
 * dc_shm.c (the collectives: barrier, allreduce, plans, failure detection) and dc_shm_join.c
 * (the rendezvous: creating, finding and joining a segment, closing it). Private to dc_shm.
 *
 * Invariants, threading and ownership are dc_shm.h's. The header's identity fields are
 * written by rank 0 before ready and read-only after; every other shared field is an atomic.
 */
#ifndef DC_SHM_INT_H
#define DC_SHM_INT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "dc_shm.h"

#define DC_SHM_LINE 128 /* a pair of cache lines: keeps the adjacent-line prefetcher off */
/* Slot sets of the collectives: operation k uses set k % ring, ring 2, or DC_SHM_RING with
 * the split allreduce (dc_shm_params.split_allreduce). Blocking collectives only: a rank
 * starts k once k - 1 completed, so every rank finished k - 2. With the split allreduce a
 * rank starts k with at most k - 1 in flight, so every rank has finished k - 4 (dc_shm.c). */
#define DC_SHM_RING 4

enum { DC_SHM_PLAN = 1, DC_SHM_PLAN_STOP = 2 }; /* plan_kind of a plan slot */

_Static_assert(ATOMIC_INT_LOCK_FREE == 2 && ATOMIC_LLONG_LOCK_FREE == 2,
               "shared-memory atomics must be lock-free");

typedef struct {
    _Alignas(DC_SHM_LINE) _Atomic uint32_t claim; /* 0 free, 1 taken (CAS by the joining rank) */
    _Atomic int32_t pid;                          /* the rank's process */
    _Atomic uint64_t start;                       /* its start time (/proc/pid/stat field 22) */
    _Atomic uint64_t joined_epoch;                /* == hdr.epoch once joined (release) */
    _Atomic uint64_t arrived;                     /* last barrier index it arrived at */
    _Atomic int64_t n[DC_SHM_RING]; /* size word of its collective in each slot set: an
                                       allreduce's n, or -1 - rows * n_cols for a gather piece */
    _Atomic uint32_t plan_taken; /* followers: last plan seq taken */
} dc_shm_slot;

typedef struct {
    /* identity: written by rank 0 before ready, read-only afterwards */
    uint64_t magic;
    uint32_t version;
    uint32_t tp;
    uint32_t ring;          /* slot sets: 2, or DC_SHM_RING with the split allreduce */
    uint64_t stride;        /* floats per partial slot (max_floats rounded up) */
    uint64_t plan_stride;   /* bytes per plan slot (max_plan rounded up) */
    uint64_t total;         /* bytes of the segment */
    uint64_t epoch;         /* generation of this segment, nonzero */
    _Atomic uint32_t ready; /* 1 once the identity and rank 0's slot are written */

    _Alignas(DC_SHM_LINE) _Atomic uint32_t join_word; /* ranks joined (futex) */
    _Atomic uint32_t join_waiters;
    _Alignas(DC_SHM_LINE) _Atomic uint32_t broken; /* 0, or BROKEN(detector, culprit) of the first
                                               failure */
    _Atomic int32_t broken_err;                    /* its td_err */
    _Alignas(DC_SHM_LINE) _Atomic uint32_t bar_gen; /* the last completed barrier (futex) */
    _Atomic uint32_t bar_waiters;
    _Alignas(DC_SHM_LINE) _Atomic uint32_t plan_seq; /* seq of the last published plan (futex) */
    _Atomic uint32_t plan_waiters;
    _Atomic uint32_t plan_kind[2]; /* DC_SHM_PLAN_* of the plan in each slot */
    _Atomic uint64_t plan_len[2];  /* bytes */
    _Alignas(DC_SHM_LINE) _Atomic uint32_t
        taken_word; /* plans taken, summed over followers (futex) */
    _Atomic uint32_t taken_waiters;
    _Alignas(DC_SHM_LINE) _Atomic uint32_t dp_round; /* a dp group: the last round a member
                                                        asked for (futex) */
    _Atomic uint32_t dp_round_waiters;
    dc_shm_slot ranks[DC_SHM_MAX_TP];
} dc_shm_hdr;

struct dc_shm {
    dc_shm_hdr *h;  /* the mapping (NULL before attach) */
    size_t size;    /* bytes mapped */
    char name[144]; /* /tandem-INSTANCE-TOKEN (8 + 64 + 1 + 64 + 1) */
    char inst[72];  /* instance name, for messages */
    int rank, tp;
    int ring;           /* slot sets (dc_shm_hdr.ring) */
    int64_t max_floats; /* as asked (the allreduce limit) */
    uint64_t stride;    /* floats per partial slot */
    size_t max_plan;
    uint64_t plan_stride;
    float *partial[DC_SHM_RING]; /* (tp, stride) each */
    float *result[DC_SHM_RING];  /* (stride) each */
    uint8_t *plan[2];  /* (plan_stride) each */
    uint64_t epoch;
    int64_t op_timeout_ns, liveness_ns, spin_ns;
    int timeout_ms;
    volatile sig_atomic_t *intr;
    pid_t pid;
    uint64_t start;
    int pidfd[DC_SHM_MAX_TP]; /* peers' pidfds once gathered (readable when they exit), or -1 */
    uint64_t bar_k;           /* barriers passed */
    uint64_t ar_k;            /* collectives (and gather pieces) started */
    int posted;               /* split allreduces posted and not yet waited (0..2) */
    uint64_t post_k[2];       /* their operation indices, oldest first */
    uint64_t post_bar[2];     /* and their barriers */
    uint32_t plan_seq;        /* leader: last published; follower: last taken */
    bool in_plan;             /* leader: between plan_begin and plan_commit */
    bool gathered;            /* rendezvous done */
    bool stopped;             /* stop published (leader) or received (follower) */
    bool linked;              /* rank 0: the name still refers to this segment */
    dev_t dev;                /* the segment's file (to tell it from another one of the */
    ino_t ino;                /* same name) */
    int err;                  /* 0, or the error that broke this object */
    int culprit;              /* the rank found dead or silent before a dc_shm_fail(), or -1 */
    char err_msg[160];        /* what broke it, when known ("rank 1 died (pid 42)") */
    dc_shm_stats st;
    char why[256]; /* follower: why the last segment looked at was not usable */
};

static inline bool dc_shm_interrupted(const dc_shm *s)
{
    return s->intr && *s->intr;
}

/* dc_shm.c. Break this object with err (the caller logged why) and the instance with it;
 * returns the object's error. */
int dc_shm_fail(dc_shm *s, int err);
/* Remember the first reason this object broke, for dc_shm_error. */
void dc_shm_note(dc_shm *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Wait until *word reaches target (wrapping compare), at most timeout_ns (< 0: no limit):
 * 0; TD_EIO and friends (logged, broken) when a peer died or broke the instance;
 * TD_ETIMEDOUT or DC_SHM_INTR (neither logged nor broken: the caller decides). */
int dc_shm_wait_word(dc_shm *s, _Atomic uint32_t *word, _Atomic uint32_t *waiters, uint32_t target,
                     int64_t timeout_ns);
void dc_shm_futex_wake(_Atomic uint32_t *w);

/* dc_shm.c, for dc_shm_dp.c. All ranks meet; every rank's writes before it are visible to
 * all after it (0, or the error that broke the object, logged). */
int dc_shm_barrier(dc_shm *s);
/* The slot set of the next operation (and counts it started), or -1 (logged, broken) when
 * anything but the operation just before it is in flight (two split allreduces, or an older
 * one): the caller must wait first. */
int dc_shm_next_slot(dc_shm *s);
/* out[i] = ((src[0][i] + src[1][i]) + src[2][i]) + ... for i in [0, n), tp >= 2, the same
 * order on every rank; out does not overlap the sources. */
void dc_shm_reduce_sum(float *restrict out, const float *const *src, int tp, int64_t n);
/* 0 if collectives may run (gathered, not stopped, not broken), else the error. */
int dc_shm_check_usable(dc_shm *s, const char *what);
/* After the barrier of operation ar_k (parity par): every rank published the same size
 * word, else the instance breaks (TD_EINVAL, logged). */
int dc_shm_check_sizes(dc_shm *s, int par, int64_t word);
/* Store val into *word and wake its waiters (if any). */
void dc_shm_post_word(_Atomic uint32_t *word, _Atomic uint32_t *waiters, uint32_t val);

/* dc_shm_join.c. Whether the process (pid, start) still runs: not gone, not a zombie, pid
 * not reused (start 0: not checked). */
bool dc_shm_proc_alive(pid_t pid, uint64_t start);

#endif
