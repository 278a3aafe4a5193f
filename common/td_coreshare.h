/* td_coreshare.h: one host's cores shared by time between a decode instance's steps and the
 * prefill stages that run beside it (`decode[].share_cores`, docs/config.md).
 *
 * Purpose: on a machine where prefill stages and a decode rank share the cores, the
 * scheduler slices their threads together, and a decode step, which joins its threads ~100
 * times, waits at each join for a thread the stages preempted: its steps stretch 2-4x and the
 * inter-token tail follows (BENCHMARKS.md "Where the inter-token tail is"). Priorities do
 * not fix it (SCHED_IDLE stages starve; nice does nothing measurable). Here the decode leader
 * claims the cores for each step; the stages' compute threads pause at their next op (the
 * CPU pool's gate, kernels/cpu/cpu_pool.h) until the step ends; after it the stages get a
 * share of time before the next claim: what is left of the decode's period target, and at
 * least a quarter of the step. So a step runs at its uncontended speed, the time between two
 * tokens stays near the target while prompts are prefilled, and prefill gets the rest.
 *
 * Mechanism: a small shared-memory segment per decode instance (named by its rank 0's
 * control port and the user, /dev/shm), created by the decode leader and unlinked at its
 * exit; a futex word says "claimed". Stages never create it: they attach when it exists and
 * notice a new one (a restarted decode) by its inode, at each forward (td_coreshare_gate_begin).
 * A claim older than TD_CORESHARE_STALE_MS (a decode that died in a step) no longer pauses
 * anyone. Stages tell the decode they want the cores by a count of stages in a forward pass
 * and a stamp at each op; a decode whose stages are idle (none in a forward, no stamp for a
 * few ms) claims at once, and one whose stage died in a forward (counted, silent for
 * TD_CORESHARE_STALE_MS) too.
 *
 * Adaptive (share_cores: auto): the claims cost the stages' throughput and pay only where the
 * scheduler stretches the steps well past their own time and past the period target (the
 * Intel type with AMX prefill: steps 2-4x); where it does not (the AMD type without AMX),
 * sharing only cost (BENCHMARKS.md). So an adaptive leader measures both: of the steps begun
 * beside active stages, it leaves most to the scheduler and claims every
 * TD_CORESHARE_AUTO_PROBE_EVERY-th (a probe), each step's time taken over the cost model's
 * prediction for its shape. It claims from then on while the unclaimed steps' median ratio is
 * at least TD_CORESHARE_AUTO_STRETCH times the claimed ones' and three in four of them take
 * longer than the period; while claiming, every TD_CORESHARE_AUTO_REVERSE_EVERY-th such step is
 * left to the scheduler, so the windows (the last TD_CORESHARE_AUTO_SAMPLES of each) follow a
 * change of workload. Steps beside idle stages neither claim nor count.
 *
 * Ownership: create/destroy (decode leader), gate_create/gate_destroy (a stage). Threading:
 * a td_coreshare is used by one thread (the decode's step loop); a gate's wait by the
 * stage's compute thread, its busy call by the thread that runs the forward (the same).
 */
#ifndef TD_CORESHARE_H
#define TD_CORESHARE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TD_CORESHARE_STALE_MS 2000 /* a claim this old pauses no one */
/* adaptive: the windows of unclaimed and claimed steps beside active stages */
#define TD_CORESHARE_AUTO_SAMPLES 32
/* adaptive, measuring: every this many steps beside active stages one claims (a probe) */
#define TD_CORESHARE_AUTO_PROBE_EVERY 4
/* adaptive, claiming: every this many steps beside active stages one is left (the tail's
 * 99th percentile does not see them) */
#define TD_CORESHARE_AUTO_REVERSE_EVERY 128
/* adaptive: claim when the unclaimed steps take at least this many times the claimed ones'
 * (per predicted ms) */
#define TD_CORESHARE_AUTO_STRETCH 1.5

/* The segment name of the decode instance whose rank 0 listens on port (with the uid, so
 * users of one host do not meet). */
void td_coreshare_name(int port, char *buf, size_t cap);

/* ---- decode leader ---- */

typedef struct td_coreshare td_coreshare;

typedef struct {
    uint64_t steps;     /* claims */
    uint64_t waits;     /* claims that first left the stages their share */
    double wait_ms;     /* total time those waited */
    double claimed_ms;  /* total time the cores were claimed */
    uint64_t unclaimed; /* adaptive: steps left to the scheduler */
    uint64_t switches;  /* adaptive: times it began claiming (after measuring) */
    double stretch;     /* adaptive: the last decision's unclaimed / claimed (0: none yet) */
    double p25_ms;      /* adaptive: and the unclaimed steps' time three in four exceed */
    bool claiming;      /* steps beside busy stages claim now (always, unless adaptive) */
} td_coreshare_stats;

/* Create (or take over a stale one of the same name) and clear the claim; adaptive: claim
 * only while the measured steps ask for it (above). TD_EIO with a logged reason when /dev/shm
 * refuses. */
int td_coreshare_create(const char *name, bool adaptive, td_coreshare **out);
void td_coreshare_destroy(td_coreshare *cs); /* releases, unlinks; NULL is fine */

/* Before a step: when a stage wanted the cores since the last claim, wait until its share
 * after the last step has passed (or the stages went idle), then claim. Adaptive, a step
 * left to the scheduler: only notes its start. */
void td_coreshare_claim(td_coreshare *cs);
/* After the step: release, wake the stages, and set their share before the next claim:
 * max(period_ms - the step's time, the step's time / 4); period_ms 0: the step's time
 * (half the machine each while both have work). Adaptive: the step is a sample, taken over
 * predicted_ms (the step's predicted time; <= 0: not a sample), and period_ms the time the
 * unclaimed steps are measured against (0: never claims). */
void td_coreshare_release(td_coreshare *cs, double period_ms, double predicted_ms);
td_coreshare_stats td_coreshare_get_stats(const td_coreshare *cs);

/* ---- prefill stage ---- */

typedef struct td_coreshare_gate td_coreshare_gate;

typedef struct {
    uint64_t parks;   /* ops that waited for a step */
    double parked_ms; /* total time they waited */
} td_coreshare_gate_stats;

/* A gate on the segments of these names (the decode instances on the stage's host that
 * share cores); n may be 0 (a gate that never waits). */
int td_coreshare_gate_create(const char *const *names, int n, td_coreshare_gate **out);
void td_coreshare_gate_destroy(td_coreshare_gate *g);
/* Around each forward pass: begin attaches to segments that appeared or were re-created and
 * counts the stage as computing (the decode then leaves it its share even while it waits
 * for the cores); end uncounts it. */
void td_coreshare_gate_begin(td_coreshare_gate *g);
void td_coreshare_gate_end(td_coreshare_gate *g);
/* The pool's gate (kn_pool_gate_fn): mark that the stage wants the cores, and wait while a
 * decode step holds them. ctx is the td_coreshare_gate. */
void td_coreshare_gate_wait(void *ctx);
td_coreshare_gate_stats td_coreshare_gate_get_stats(const td_coreshare_gate *g);

#endif
