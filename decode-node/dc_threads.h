/* dc_threads.h: the compute threads of each decode step, chosen from measured step times
 * (decode[].adaptive_threads).
 *
 * Purpose: a decode rank may share its cores with other busy processes: on one machine, the
 * prefill stages of `tandem up`'s default cluster (two stage threads and two decode threads
 * on two cores). A pool thread is then often descheduled, and the step waits for it at each
 * of its few hundred joins: in the fresh-prompt benchmark 2 decode threads took 17 ms a step
 * where 1 thread took 9 and left the stages more of the machine, while with repeated prompts
 * (little prefill) 2 threads were 1.6x faster (BENCHMARKS.md, "Decode threads chosen by
 * measurement"). Which count is faster changes with the load from one second to the next, so
 * the node measures it instead of being told.
 * How: the levels are the configured count halved down to 1 (T, T/2, ..., 1). Each level's
 * speed is the ratio of a step's measured time to the step cost model's prediction for its
 * shape (dc_plan.h; the model follows the recent steps, so the level most steps run at reads
 * about 1 and the others read their speed relative to it), averaged over its recent steps.
 * One step in DC_THREADS_PROBE runs at a neighbouring level (alternately above and below);
 * the others run at the level whose score, the ratio times threads^DC_THREADS_COST, is
 * lowest, and a switch needs a lead of DC_THREADS_MARGIN so that noise does not flip it.
 * The threads' own term is there because a step's time is not all that counts: a thread
 * that shortens the step by little takes a core the processes beside it would have used
 * (the prefill stages: fresh prompts' TTFT), so twice the threads must cut the step time by
 * about a fifth to be chosen; with free cores they cut it by 35-45 %.
 * Output: the count changes no result (cpu_pool.h, kn_pool_set_limit; the plan carries it to
 * every rank, dc_plan.h), only which threads compute it.
 * Threading: the leader loop only.
 */
#ifndef DC_THREADS_H
#define DC_THREADS_H

#include <stdbool.h>
#include <stdint.h>

#define DC_THREADS_LEVELS 11   /* 1024 threads halve 10 times */
#define DC_THREADS_PROBE  16   /* one step in this many tries a neighbouring level */
#define DC_THREADS_MARGIN 0.9  /* a level replaces the current one below this share of its score */
#define DC_THREADS_COST   0.35 /* score = ratio * threads^this: 2x threads must be 0.78x the time */
/* Weight of a step in its level's running ratio: the level most steps run at averages many; a
 * probe is the one fresh reading of its level, and what it last read may be seconds old */
#define DC_THREADS_ALPHA       0.25
#define DC_THREADS_ALPHA_PROBE 0.5

typedef struct {
    int max;                         /* decode[].threads */
    int n_levels;                    /* 1: fixed at max (adaptive off, or max 1) */
    int cur;                         /* the level steps run at, probes aside */
    int step_level;                  /* the level of the last step dc_threads_next gave */
    bool probe_up;                   /* the next probe tries the level above (more threads) */
    double ratio[DC_THREADS_LEVELS]; /* measured / predicted step time; < 0: not measured */
    uint64_t steps;                  /* steps dc_threads_next gave */
    uint64_t at[DC_THREADS_LEVELS];  /* of those, run at each level (the stats line) */
} dc_threads;

/* max >= 1 threads; adaptive false: every step at max. */
void dc_threads_init(dc_threads *t, int max, bool adaptive);
/* The threads of the next step. */
int dc_threads_next(dc_threads *t);
/* That step took ms where the cost model predicted predicted_ms (before it saw the step);
 * a step with either not positive is ignored. */
void dc_threads_observe(dc_threads *t, double ms, double predicted_ms);
/* Threads of level i. */
int dc_threads_of(const dc_threads *t, int level);

#endif
