/* dc_node.h: one rank of a decode instance (the tandem-decode process).
 *
 * Purpose: tie together the pieces of a decode rank: its model shard and KV pool, the
 * shared-memory collective with its sibling ranks, and, on rank 0 (the leader), the
 * control server, the scheduler and (disaggregated mode) the KV-transfer plane.
 *
 *   leader (rank 0):   control inbox -> scheduler -> plan -> [shm] -> forward -> sample -> events
 *                      kvxfer (dc_xfer) -> arrived KV -> scheduler
 *   follower (rank r):                              [shm] -> plan -> forward (its heads)
 *
 * Modes: colocated (the YAML has no prefill instances): Submit only, the instance
 * prefills its prompts. Disaggregated (prefill instances exist): Alloc as well (see
 * docs/control-plane.md): the leader reserves the prompt's blocks, answers one kvxfer
 * target per rank and polls the transfers; every kvxfer connector lives in the leader,
 * each registering one rank's pool, so a follower's pool is a POSIX shared-memory segment
 * (created before the rendezvous, mapped and unlinked by the leader after it; reserved in
 * full at start-up, so it counts against /dev/shm). Followers never touch kvxfer.
 *
 * Invariants: only the leader decides; followers run exactly the leader's plans. Every
 * failure of a sibling rank fails all in-flight requests (transferring ones too) with an
 * error event and ends the process with a non-zero status (followers exit when the leader
 * dies). An idle rank sleeps (futex or NNG wait), it never spins; while only transfers
 * are in flight the leader waits 2 ms at a time in its inbox. Blocks of a transfer are
 * reused only once no prefill writer can write into them (dc_xfer.h).
 * Threading: one engine thread per process (plus the CPU pool's workers and NNG's; the
 * leader also has one kvxfer progress thread per rank in disaggregated mode).
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
