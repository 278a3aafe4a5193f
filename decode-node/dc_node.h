/* dc_node.h: one rank of a decode instance (the tandem-decode process).
 *
 * Purpose: tie together the pieces of a decode rank: its model shard and KV pool, the
 * shared-memory collective with its sibling ranks, and, on rank 0 (the leader), the
 * control server and the scheduler.
 *
 *   leader (rank 0):   control inbox -> scheduler -> plan -> [shm] -> forward -> sample -> events
 *   follower (rank r):                              [shm] -> plan -> forward (its heads)
 *
 * Invariants: only the leader decides; followers run exactly the leader's plans. Every
 * failure of a sibling rank fails all in-flight requests with an error event and ends
 * the process with a non-zero status (followers exit when the leader dies). An idle rank
 * sleeps (futex or NNG wait), it never spins.
 * Threading: one engine thread per process (plus the CPU pool's workers and NNG's).
 * Ownership: dc_node_run owns everything it creates and frees it before returning.
 */
#ifndef DC_NODE_H
#define DC_NODE_H

#include <signal.h>

#include "config.h"

typedef struct {
    const td_cfg *cfg;
    const char *instance;
    int rank;
    const char *listen;          /* leader: URL override (tests); NULL: from the config */
    volatile sig_atomic_t *stop; /* set by SIGTERM/SIGINT: clean shutdown */
} dc_node_params;

/* Run the rank until shutdown. Returns 0 on a clean stop, a negative td_err otherwise. */
int dc_node_run(const dc_node_params *p);

#endif
