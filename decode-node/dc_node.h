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
 * (created before each rendezvous, mapped and unlinked by the leader after it; reserved in
 * full, so it counts against /dev/shm; after a failure the old segment lives on in the
 * leader's mapping until its transfers ended, so for a moment a rank needs room for two).
 * Followers never touch kvxfer.
 *
 * Formations. The tp processes form the instance in a rendezvous (dc_shm); when a rank
 * fails, the others do not exit: they form it again with the rank's restarted process,
 * without reloading anything. The leader's states (dc_node.c):
 *
 *   start: load, listen
 *      |
 *      v
 *   FORMING  serves the control socket: polls and Health answered (ready = false),
 *      |     Submit/Alloc refused with ERR_BUSY "re-forming (waiting for rank R)";
 *      |     a new segment (dc_shm_begin), waited for in 50 ms slices (dc_shm_gather);
 *      |     a rank that joins and dies: a fresh segment
 *      | every rank joined and every transfer of the failed formation is final
 *      | (disaggregated: then the KV plane is rebuilt: the followers' new pool segments
 *      v  mapped, one new kvxfer connector per rank)
 *   SERVING  (ready) steps, Submit, Alloc
 *      |
 *      | a rank died or is silent, a step failed (the segment broke for any reason but
 *      | the leader's own death): every request in flight fails (error events), every
 *      | transfer is aborted, the segment is closed
 *      v
 *   FORMING ...            SIGTERM in any state: requests end with ERR_SHUTDOWN, a
 *                          formed instance gets the stop plan, exit 0.
 *
 * A follower: join a formation (waiting without limit, asleep, for a leader), run its
 * plans, and when the formation ends (a rank died, the leader died or stopped) go back to
 * the rendezvous, in disaggregated mode with a fresh pool segment (the old one's name was
 * unlinked by the leader that mapped it). A follower started while the leader serves waits
 * for the next rendezvous. Only its own SIGTERM ends it (exit 0); the leader then re-forms.
 *
 * Invariants: only the leader decides; followers run exactly the leader's plans. No KV
 * survives a failure: every request of the failed formation ended, so every block is free
 * (a follower's pool in disaggregated mode is even a new segment), and a block of an aborted
 * transfer is reused only once no prefill writer can write into it (dc_xfer.h; the leader
 * stays FORMING until then, and keeps the old pool mappings and connectors until then).
 * An idle rank sleeps (futex or NNG wait), it never spins: a forming leader waits in 50 ms
 * slices, a follower waiting for a leader polls for its segment at most every 50 ms; while
 * only transfers are in flight the leader waits 2 ms at a time in its inbox.
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
    const char *instance;      /* the instance's name (--name, else --instance) */
    const char *template_name; /* the YAML decode instance its settings come from */
    int rank;
    const char *listen;          /* leader: URL override (tests); NULL: from the config */
    const char *advertise;       /* leader: the host in the URL it announces to the router
                                    (router.membership); NULL: the YAML's host. Every rank:
                                    the host whose device its KV plane uses */
    volatile sig_atomic_t *stop; /* set by SIGTERM/SIGINT: clean shutdown */
} dc_node_params;

/* Run the rank until *stop (SIGTERM). Returns 0 on a clean stop (also when the signal ended
 * a wait or a failed formation), a negative td_err when the rank cannot run at all (model,
 * listen address, a leader already owning the instance at start-up, a layout mismatch,
 * another live process with this rank). */
int dc_node_run(const dc_node_params *p);

#endif
