/* dc_shm.h: the collective plane of a decode instance: rendezvous, all-reduce and plan
 * broadcast between the TP ranks of one instance through one POSIX shared-memory segment.
 *
 * Purpose. Every rank process (one per TP rank, all on one host, in one pid namespace)
 * calls dc_shm_open with the same instance name, token, tp and sizes; the call returns when
 * all tp ranks are present. Then, per decode step, rank 0 (the leader) publishes the step's
 * batch plan (an opaque byte blob) and every rank runs its forward pass, in which the engine
 * calls dc_shm_allreduce (through the decode node's kn_collective) twice per layer, and
 * dc_shm_gather_cols once per step for the vocab-parallel LM head's logits.
 *
 * Invariants.
 *   - All ranks call the collectives in the same order with the same n: allreduce k of rank
 *     a pairs with allreduce k of rank b (a gather with a gather of the same shape). A size
 *     mismatch (or a gather against an allreduce) is detected and breaks the instance.
 *   - dc_shm_allreduce is deterministic: the sum of element i is ((p0 + p1) + p2) + ...
 *     in rank order on every rank, so results are bit-identical across ranks.
 *     dc_shm_gather_cols only copies: rank 0's matrix is the ranks' parts, bit for bit.
 *   - Every wait is bounded (rendezvous: timeout_ms, or the wait_ms of dc_shm_gather;
 *     collectives: op_timeout_ms; only a caller that asks for it, with a negative wait to
 *     dc_shm_gather or dc_shm_plan_wait, waits for its event, a failure or the interrupt),
 *     and checks the peers' pids every liveness_ms while it sleeps: a peer that died is
 *     reported as "rank R died" (TD_EIO) within about liveness_ms, a live peer that does not
 *     arrive as "rank R not answering" (TD_ETIMEDOUT) after op_timeout_ms.
 *   - A failure on any rank breaks the whole instance: the rank that detects it marks the
 *     segment broken and wakes every waiter, so the other ranks fail at once instead of at
 *     their own timeout. A broken dc_shm fails every later call fast with the same code.
 *     Broken is final for a segment, not for the processes: each rank closes it and opens
 *     the next rendezvous (a fresh segment, a new epoch), which is how a decode instance
 *     re-forms after a rank died and was restarted (dc_node.h). Nothing of a segment
 *     carries over to the next one.
 *   - Waits spin for spin_us (with pause and periodic sched_yield, so 3 ranks on 2 cores
 *     still progress) and then sleep on a futex: an idle instance uses no CPU.
 *
 * Threading. One dc_shm per rank, used by one thread at a time (the rank's step loop; the
 * engine calls the allreduce from the thread that runs kn_engine_forward). The optional
 * params.interrupt flag may be set from any thread or a signal handler.
 *
 * Ownership. dc_shm_open (dc_shm_begin) allocates the object and maps the segment; dc_shm_close
 * unmaps and frees it (safe on NULL). A plan pointer returned by dc_shm_plan_wait stays valid until
 * the next dc_shm_plan_wait or dc_shm_close of that rank; the leader's plan buffer from
 * dc_shm_plan_begin until dc_shm_plan_commit. The name /tandem-INSTANCE-TOKEN exists only
 * while ranks gather: rank 0 unlinks it as soon as all ranks have mapped the segment (and
 * on failure or close), so a crash of a formed instance leaves nothing behind in /dev/shm.
 * A rank 0 killed while gathering (which may last: a re-forming leader waits for a
 * restarted rank) leaves the name; a joined follower that sees it die removes it (only if
 * the name still refers to that segment; a new rank 0 whose name vanishes anyway notices
 * in dc_shm_gather and makes another), else the next rank 0 replaces it.
 *
 * The segment (shared state; each transition names the function that makes it):
 *
 *        (no name) or a stale segment (its rank 0 pid dead, or the pid reused: the process
 *            |      start time differs; or a half-written/garbage header; or broken)
 *            | dc_shm_open / dc_shm_begin, rank 0: shm_unlink the stale name, create O_EXCL
 *            v   with a new epoch, fallocate, write header, join itself, ready = 1
 *        GATHERING   followers that came first poll for the name and skip stale segments
 *            |       (and one whose slot for their rank is held by a dead process: rank 0
 *            |       breaks it and makes a new one); a follower claims its rank slot,
 *            |       records pid + start time, join_word++
 *            | last rank joins (join_word == tp; dc_shm_open or dc_shm_gather returns 0);
 *            v   rank 0 unlinks the name
 *        RUNNING  --- dc_shm_plan_publish / dc_shm_allreduce, step after step
 *            |  \
 *            |   \-- a rank died / timed out / bad size / interrupted in a collective
 *            |        --> BROKEN (broken names the detector and the culprit, the rank found
 *            |            dead or silent; all waiters woken; terminal for this segment)
 *            | dc_shm_plan_stop (leader)
 *            v
 *        STOPPED  followers' dc_shm_plan_wait returns DC_SHM_STOP; the memory goes away when
 *                 the last rank calls dc_shm_close (or dies)
 *   GATHERING also goes to BROKEN: rendezvous timeout, a joined rank died, interrupted.
 *
 * Memory: ring * (tp + 1) * max_floats * 4 + 2 * max_plan bytes, ring 2 (4 with
 * split_allreduce) (+ a few KiB of header), on
 * tmpfs (/dev/shm); reserved with posix_fallocate, so a full /dev/shm is a clean TD_ENOMEM
 * at open rather than a SIGBUS later.
 */
#ifndef DC_SHM_H
#define DC_SHM_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define DC_SHM_MAX_TP 64

typedef struct {
    const char *instance; /* instance name, [A-Za-z0-9_.-]{1,64} (e.g. "d0"); required */
    const char *token;    /* makes the name unique per cluster run/user, same charset, <= 64;
                             NULL or "": the uid */
    int rank;             /* 0 .. tp-1; rank 0 is the leader */
    int tp;               /* number of ranks, 1 .. DC_SHM_MAX_TP */
    int64_t max_floats;   /* largest allreduce (floats), e.g. max_tokens * n_embd; required */
    size_t max_plan;      /* largest plan (bytes); 0: 64 KiB */
    int timeout_ms;       /* rendezvous: wait this long for all ranks; 0: 30000 */
    int op_timeout_ms;    /* one collective wait: a live peer silent this long is "not
                             answering"; 0: 30000 */
    int liveness_ms;      /* a sleeping wait checks the peers' pids this often; 0: 20 */
    int spin_us;          /* spin this long before sleeping on the futex; 0: 50; < 0: none */
    bool split_allreduce; /* allow dc_shm_allreduce_post/wait (two-batch overlap): 4 slot sets
                             instead of 2, twice the slots' memory; every rank alike */
    volatile sig_atomic_t *interrupt; /* optional, borrowed until dc_shm_close: when it
                             becomes non-zero (e.g. set by a SIGTERM handler) the current wait
                             returns within liveness_ms (DC_SHM_INTR from dc_shm_plan_wait,
                             TD_ESTATE and broken from the rendezvous or a collective) */
} dc_shm_params;

typedef struct dc_shm dc_shm;

/* Positive (non-error) results of dc_shm_plan_wait. */
enum {
    DC_SHM_STOP = 1, /* the leader published the shutdown plan */
    DC_SHM_INTR = 2, /* params.interrupt became non-zero */
};

typedef struct {
    uint64_t n_allreduce;  /* allreduces done */
    uint64_t ns_allreduce; /* wall time inside dc_shm_allreduce (ns) */
    uint64_t n_gather;     /* column gathers done */
    uint64_t ns_gather;    /* wall time inside dc_shm_gather_cols (ns) */
    uint64_t n_plans;      /* plans published (leader) or received (followers) */
    uint64_t n_sleeps;     /* waits that went to sleep on the futex (spin was not enough) */
} dc_shm_stats;

/* Join (rank 0: create) the instance's segment and wait until all tp ranks are present.
 * Ranks may start in any order. Returns 0 and *out, or a negative td_err (logged):
 * TD_EINVAL bad params or a rank 0 with a different layout, TD_ETIMEDOUT (the message names
 * the missing ranks), TD_EIO a joined rank died, TD_ESTATE the rank is already taken (by a
 * live process) or the instance is already running, TD_ENOMEM /dev/shm or memory full.
 * Equivalent to dc_shm_begin, then dc_shm_gather until the same deadline. */
int dc_shm_open(const dc_shm_params *p, dc_shm **out);

/* The rendezvous in two halves, for a rank that does other work while it waits (the
 * decode leader keeps answering its control socket while the instance re-forms).
 * dc_shm_begin: rank 0 creates the segment and returns at once; a follower polls (sleeping)
 * up to timeout_ms for rank 0's segment and joins it. Errors as dc_shm_open (TD_ETIMEDOUT:
 * no segment of a live rank 0 appeared). The object is not usable for collectives until
 * dc_shm_gather returned 0. */
int dc_shm_begin(const dc_shm_params *p, dc_shm **out);
/* Wait up to wait_ms (0: just look; < 0: no limit, only a failure or the interrupt ends
 * the wait) until every rank joined: 0 (done; later calls return 0 at once), TD_ETIMEDOUT
 * not yet (neither logged nor broken: call again), or a failure that breaks the segment
 * (logged): TD_EIO a joined rank died or another rank broke it, TD_ESTATE interrupted. */
int dc_shm_gather(dc_shm *s, int wait_ms);
/* Ranks that joined this segment so far (bit r: rank r), e.g. to name the missing ones. */
uint64_t dc_shm_joined(const dc_shm *s);

/* Unmap and free (rank 0 also unlinks the name if it still exists). Safe on NULL. Clean
 * shutdown: the leader calls dc_shm_plan_stop, followers close after DC_SHM_STOP. Closing
 * a working instance any other way breaks it, so the peers fail at once (TD_EIO) instead
 * of waiting for their timeout. */
void dc_shm_close(dc_shm *s);

/* Sum buf (n floats, 0 <= n <= max_floats) across the ranks in place; every rank gets the
 * bit-identical sum. Returns 0 or a negative td_err (logged where detected); any error
 * breaks the instance. tp == 1: no-op. */
int dc_shm_allreduce(dc_shm *s, float *buf, int64_t n);

/* The allreduce in two halves, for a rank that computes something else while the others
 * arrive (two-batch overlap, kernels/forward_tbo.c): post copies buf (n floats) into the
 * segment, arrives and returns at once with a ticket; wait (the same n, buf to receive the
 * sum, which may be the posted one) waits for the others' inputs and sums them as
 * dc_shm_allreduce does, bit for bit (always in one phase: every rank reads all inputs).
 * Posts pair across ranks, in order, with allreduces and posts. A collective (a post
 * included) starts only with nothing in flight but the collective just before it, and waits
 * come in the order posted: post A, post B, wait A, post C, wait B, ... (the engine's two
 * micro-batches); a breach breaks the instance (TD_ESTATE, logged), as every other error
 * does. Needs params.split_allreduce (else TD_EINVAL, broken). */
int dc_shm_allreduce_post(dc_shm *s, const float *buf, int64_t n, uint64_t *ticket);
int dc_shm_allreduce_wait(dc_shm *s, uint64_t ticket, float *buf, int64_t n);

/* Column gather (the vocab-parallel LM head's logits): rank r passes part (rows, c1 - c0)
 * row-major, columns [c0, c1) = [r * n_cols / tp, (r + 1) * n_cols / tp) of a
 * (rows, n_cols) matrix (kn_split_even in kernels/model.h); rank 0 gets the whole matrix
 * in out (rows, n_cols); the other ranks' out is neither read nor written (may be NULL).
 * Needs n_cols >= tp. A part larger than max_floats travels in pieces of the slot size,
 * one barrier each, so the segment (sized by max_floats) does not grow with the
 * vocabulary. Returns 0 or a negative td_err (logged where detected); any error breaks the
 * instance, as for the allreduce. tp == 1: rank 0 copies part into out. */
int dc_shm_gather_cols(dc_shm *s, const float *part, int64_t rows, int64_t n_cols, float *out);

/* The collectives of a data-parallel attention group (kernels/model.h kn_collective dp_*;
 * the segment's ranks are the group's members, each with its own rows; every member calls
 * the same sequence, a member without rows too):
 *   dp_counts: every member's {rows, leading solo rows} (mine) into all (2 tp, member q's at
 *              all[2q]); needs max_floats >= 4.
 *   dp_gather: every member's rows (counts from dp_counts, n_cols each) into all (N, n_cols)
 *              in td_dp_layout's solo-first places (common/td_tp.h); mine may be NULL with
 *              no rows.
 *   dp_reduce: every member passes all (N, n_cols) in that layout; mine gets this member's
 *              rows summed over the members in member order (bit-identical whatever the
 *              other rows).
 * Data larger than a slot (max_floats) travels in pieces, one barrier each. Returns 0 or a
 * negative td_err (logged where detected); any error, a size disagreement between members
 * included, breaks the group as for the all-reduce. Counted in the stats as gathers and
 * all-reduces. tp == 1: local copies. */
int dc_shm_dp_counts(dc_shm *s, const int64_t mine[2], int64_t *all);
int dc_shm_dp_gather(dc_shm *s, const float *mine, const int64_t *counts, int64_t n_cols,
                     float *all);
int dc_shm_dp_reduce(dc_shm *s, const float *all, const int64_t *counts, int64_t n_cols,
                     float *mine);
/* A dp group's rounds (one forward of every member each, in order; decode-node/dc_group.c):
 * a member about to run round `round` with rows asks for it (the group's round word becomes
 * at least round; sleeping members wake); a member that has joined `joined` rounds learns
 * whether a later one was asked for, waiting up to wait_ns (0: just look) on the word. */
void dc_shm_dp_request(dc_shm *s, uint32_t round);
bool dc_shm_dp_wanted(dc_shm *s, uint32_t joined, int64_t wait_ns);

/* Leader (rank 0) only. Publish the next step's plan: copies len <= max_plan bytes into
 * the segment and wakes the followers. Returns 0 or a negative td_err: TD_EINVAL for a plan
 * larger than max_plan or a call from a follower (logged; the instance stays intact),
 * TD_ESTATE after dc_shm_plan_stop, the failure of a broken instance. */
int dc_shm_plan_publish(dc_shm *s, const void *plan, size_t len);

/* Leader, zero-copy variant: *buf (capacity *cap = max_plan bytes) is the next plan slot;
 * serialize into it, then dc_shm_plan_commit(s, len) publishes it. Begin waits (bounded
 * by op_timeout_ms) until every follower has taken the previous plan, so the slot of the
 * one before is free; in a step loop (plan, forward with allreduces) that always holds. */
int dc_shm_plan_begin(dc_shm *s, void **buf, size_t *cap);
int dc_shm_plan_commit(dc_shm *s, size_t len);

/* Leader: publish the shutdown plan; the followers' dc_shm_plan_wait returns DC_SHM_STOP.
 * Later publishes and allreduces fail with TD_ESTATE. */
int dc_shm_plan_stop(dc_shm *s);

/* Followers (rank > 0). Wait for the next plan: 0 and *plan, *len (valid until the next
 * dc_shm_plan_wait or dc_shm_close); DC_SHM_STOP; DC_SHM_INTR; TD_ETIMEDOUT after
 * timeout_ms (< 0: no limit) without a plan, which does NOT break the instance (an idle
 * leader is normal); TD_EIO the leader or a peer died or the instance is broken. Sleeps on
 * a futex while waiting (checking the peers every liveness_ms). */
int dc_shm_plan_wait(dc_shm *s, int timeout_ms, const void **plan, size_t *len);

/* Any rank, between steps (e.g. the leader on its heartbeat timer while idle): 0 if every
 * peer is alive and the instance is not broken, else TD_EIO (logged once) and broken. */
int dc_shm_check(dc_shm *s);

/* What broke this object, for messages: "rank 1 died (pid 42)" (seen here), "rank 1 died
 * (seen by rank 2)", "rank 2 not answering (allreduce barrier, 30000 ms)", "rank 1 failed
 * or left (I/O error)" (a rank that broke the segment itself, e.g. closed it and exited),
 * "rank 1 stopped (interrupted)" (its params.interrupt, e.g. SIGTERM, ended a wait), or
 * the error's text; "" while it is intact. Valid until dc_shm_close. */
const char *dc_shm_error(const dc_shm *s);

/* This rank leaves on its own interrupt (its SIGTERM) between steps: breaks the instance
 * as an interrupted wait does, so that the peers read "rank 1 stopped (interrupted)" and
 * dc_shm_peer_stopped, not the "failed or left" of a bare dc_shm_close. */
void dc_shm_leave_stopped(dc_shm *s);
/* Whether the instance broke because another rank stopped on its own interrupt, rather than
 * dying, falling silent or failing. */
bool dc_shm_peer_stopped(const dc_shm *s);

/* The pid of rank's process as it joined the rendezvous (-1 before it completed or for
 * a bad rank): a peer's names that carry its pid (its KV pool segment) can be found. */
int dc_shm_rank_pid(const dc_shm *s, int rank);
void dc_shm_get_stats(const dc_shm *s, dc_shm_stats *out);

#endif
