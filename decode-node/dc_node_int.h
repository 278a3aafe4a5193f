/* dc_node_int.h: the state of one decode rank, shared by the files of tandem-decode:
 * dc_node.c (the rank's life: setup, the formations of the instance, the stop), dc_loop.c
 * (the leader's serving loop: the steps),
 * dc_serve.c (the leader's control plane: requests in, token and error events out, health),
 * dc_async.c (overlap), dc_node_xfer.c (the KV-transfer plane), dc_tier.c (the tier's copies).
 * Private to the tandem-decode binary.
 *
 * The state is in parts (dc_node below), each written by one file only, its owner: a field
 * another file must change is changed by a call to its owner.
 * Invariants: form.shm is the current formation's segment, NULL between formations (the
 * engine reaches it through the node, so a new segment needs no new engine). While
 * life.forming is set the leader admits nothing (Submit and Alloc get ERR_BUSY with
 * forming_why); requests exist only while a formation serves, so every route is free when
 * forming starts.
 * Threading: the rank's engine thread only (the control server's callbacks never see it;
 * overlap's forward thread sees only what dc_async_launch hands it).
 * Ownership: dc_node_run owns the node (on its stack) and everything it points to.
 */
#ifndef DC_NODE_INT_H
#define DC_NODE_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "ctrl.h"
#include "ctrl_join.h"
#include "dc_draft.h"
#include "dc_node.h"
#include "dc_plan.h"
#include "dc_sched.h"
#include "td_coreshare.h"
#include "gr_grammar.h"
#include "dc_shm.h"
#include "dc_xfer.h"
#include "dc_threads.h"
#include "gguf.h"
#include "kn_runtime.h"
#include "kv_mem.h"
#include "model.h"
#include "td_step_hist.h"

/* overlap (decode[].overlap): an event of the scheduler's sink held back while the step's
 * commit and the next plan run, sent once the next forward pass computes (dc_async.c) */
typedef struct {
    uint64_t id;
    bool prompt_lps;       /* on_prompt_logprobs (from, lps[n]) rather than on_tokens */
    int32_t *ids;          /* (n) on_tokens */
    td_logprob_entry *lps; /* (n) or NULL */
    int n;
    dc_finish finish;
    int32_t n_prompt, n_gen, n_cached, from;
} dc_held_event;

/* an Alloc whose KV targets wait for the ranks' tier copies (dc_serve_sync_allocs) */
typedef struct {
    td_ctrl_req *req;    /* the control request to answer (owned until answered) */
    uint64_t client_id;  /* whose */
    uint64_t request_id; /* the client's */
    uint64_t id;         /* the scheduler's (its route's index: reused once it ends) */
} dc_held_alloc;

typedef struct dc_fwd dc_fwd; /* the forward thread (dc_async.c) */

/* Where a scheduler request came from: events go back to (client, request id). */
typedef struct {
    uint64_t client_id, request_id;
    uint32_t seq; /* next TokenEvent.seq */
    bool used;
    Td__ErrorCode err_code; /* the ErrorEvent of a FINISH_ERROR, when not the default */
    char err_msg[320];
} dc_route;

/* The node's state, in parts by lifetime and role. Each part is written by one file only (its
 * owner, which also makes and frees it); the others read it or call the owner. The leader's
 * parts are empty on a follower. Teardown frees each part before those it uses: overlap,
 * KV plane, leader, serve, formation, process. */

/* The process's: the model and KV memory, made once at start-up and kept across formations.
 * Owner dc_node.c (proc_init at the start, proc_fini at the exit, both ranks). */
typedef struct {
    kn_runtime rt;         /* model file, this rank's shard, backend, engine */
    kn_kv_mem *mem;        /* this rank's KV memory (pool, prefix cache, tier) */
    char kv_shm_name[256]; /* disaggregated follower: its pool's segment name, else "" */
    dc_shm_params shmp;    /* the rendezvous (the same for every formation) */
    bool disagg;           /* the cluster has prefill instances: KV arrives through kvxfer */
    char token[32];        /* the instance's name token (shared-memory names) */
} dc_proc;

/* The current formation's rendezvous segment. Owner dc_node.c (opened by form and
 * follower_run, closed by close_shm when the formation ends and at exit). */
typedef struct {
    dc_shm *shm;           /* the current formation's segment, or NULL */
    dc_shm_stats shm_done; /* the stats of the segments already closed */
} dc_formation;

/* The data-parallel attention group this instance is a member of (decode[].dp > 1; the
 * segment's ranks are the members). Owner dc_group.c (dc_group_init at start-up; the segment
 * made by dc_group_form, closed by dc_group_close when the formation ends and at exit). */
typedef struct {
    dc_shm_params shmp;   /* its rendezvous (instance = the group's name) */
    char token[32];       /* its name token on this host: g + member 0's port */
    dc_shm *shm;          /* the current group segment, or NULL (no group, or between them) */
    bool ready;           /* every member joined it */
    uint32_t joined;      /* rounds (forwards of every member) this member took part in */
    uint64_t rounds;      /* rounds of every group segment this member served in */
    uint64_t idle_rounds; /* of them, without rows of its own */
    dc_shm_stats done;    /* the collectives of the group segments already closed */
} dc_group;

/* Where the leader is in its life (dc_node.h's states), for the control plane's answers.
 * Owner dc_node.c (form, fail_in_flight, dc_node_step_failed, the stop); dc_serve.c reads
 * it. Plain values: zero at the start, nothing to free. */
typedef struct {
    bool forming;           /* not every rank is in (or old transfers still end): not ready */
    int formations;         /* formations completed (1 once the instance first served) */
    char forming_why[160];  /* the ERR_BUSY text while forming: "re-forming (waiting for
                               rank 1)" */
    char fail_why[192];     /* while a failure fails every request: why, for their events */
    bool stopping;          /* SIGTERM: in-flight requests end with ERR_SHUTDOWN */
    bool draining;          /* after the loop: new requests are refused */
    bool leaving;           /* SIGTERM with decode[].drain_timeout_ms: draining while the
                               requests in flight finish, still serving (Health.draining) */
    int64_t leave_until_ms; /* leaving: when the requests left end with ERR_SHUTDOWN */
} dc_life;

/* The leader's KV-transfer plane of one formation (disaggregated mode). Owner
 * dc_node_xfer.c (dc_node_xfer_setup/teardown, once per formation). */
typedef struct {
    dc_xfer *xfer;       /* the plane, or NULL (colocated, or between formations) */
    void **peer_regions; /* (tp) rank r > 0: its pool region mapped here */
    int *peer_fds;       /* (tp) each region's file (rank 0: its pool's, owned by the pool;
                            r > 0: the segment, kept open while mapped), or -1 */
    size_t *peer_bytes;  /* (tp) bytes of each rank's region (they differ where ranks hold
                          * different numbers of KV heads, common/td_tp.h) */
} dc_kvplane;

/* What the leader decides and samples with, for the process's life. Owner dc_node.c
 * (leader_init at the leader's start, leader_fini at exit; dc_node_grow_logits while
 * planning). */
typedef struct {
    dc_sched *sched;
    dc_draft *draft;     /* speculative.method draft: the proposer, else NULL */
    gr_vocab *gvocab;    /* structured output: the vocabulary's trie */
    gr_cache *grammars;  /* compiled grammars by schema text */
    float *logits;       /* (logit_rows, n_vocab) */
    int logit_rows;      /* max_batch; grown on demand for prompt logprobs (a row per token) */
    dc_threads threads;  /* each step's compute threads (decode[].adaptive_threads) */
    td_coreshare *cores; /* decode[].share_cores: each step claims the host's cores, or NULL */
} dc_leader;

/* The leader's control plane. Owner dc_serve.c (dc_serve_init/fini; the inbox, the sink). */
typedef struct {
    td_ctrl_server *srv;
    dc_route *routes; /* (n_routes) indexed by scheduler id */
    size_t n_routes;
    /* disaggregated at tp > 1 with a tier: Alloc replies held until every rank made the tier
     * copies the allocation logged (dc_serve_sync_allocs; dc_tier.c says why) */
    dc_held_alloc *held_allocs;
    int n_held_allocs, cap_held_allocs;
    bool load_changed; /* an Alloc or a transfer event: publish the health now */
    int64_t started_ms;
    /* what rank 0 computes with, for Health 27-33: made at the leader's first report,
     * before any pass (dc_serve_health) */
    kn_compute_info compute;
    bool compute_made;
    int64_t ns_stream; /* the token events' time (dc_serve_on_tokens; logged with dc_stats) */
    td_join *join;     /* announcements to the router (router.membership), or NULL */
} dc_serve;

/* Overlap (decode[].overlap): the thread that runs forward passes while the node thread
 * serves, and the sink's events held back while hold_events is set. Owner dc_async.c
 * (dc_async_start/stop, dc_async_hold). */
typedef struct {
    dc_fwd *fwd; /* NULL without overlap */
    bool hold_events;
    dc_held_event *held;
    int n_held, cap_held;
    /* the pass itself (on its thread), the two hand-offs between the threads (waking for
     * the job, waking for its end), and the time the node thread's own work outlasted the
     * pass (dc_async_join) */
    int64_t ns_pass, ns_handoff, ns_io_over;
} dc_overlap;

/* The leader's step figures (logged at the stop; Health 25-26). Owner dc_loop.c (the step
 * and the serving loops). Plain values: zero at the start, nothing to free. */
typedef struct {
    uint64_t step;
    int64_t step_ns;     /* wall time of all steps */
    int64_t step_tokens; /* tokens of all steps */
    /* steps by duration (td_step_hist.h buckets) and their total time: Health 25-26 */
    uint64_t step_hist[TD_STEP_HIST_N + 1];
    uint64_t step_us;
    /* where the serving loop's time goes (ns, SERVING only): the inbox, transfers and
     * health; planning; the plan's encoding and publication; the forward pass; the commit
     * (sampling, stop rules, grammar, logprobs); the token events are dc_serve's ns_stream
     * (inside the commit, or with overlap inside the inbox's time) */
    int64_t ns_inbox, ns_plan, ns_encode, ns_forward, ns_commit, ns_serve;
    int64_t ns_join; /* overlap: waiting for the pass after the inbox (ns_forward is then
                        from its launch to its join, the inbox's time included) */
} dc_stats;

typedef struct {
    const dc_node_params *p; /* both set once by dc_node_run */
    const td_cfg_decode *dcfg;
    dc_proc proc;
    dc_formation form;
    dc_group group;
    dc_life life;     /* leader */
    dc_kvplane plane; /* leader */
    dc_leader leader; /* leader */
    dc_serve serve;   /* leader */
    dc_overlap ovl;   /* leader */
    dc_stats stats;   /* leader */
} dc_node;

/* This rank's pool (its layout and region; kn_kv_mem_renew_pool may replace it). */
static inline kn_kv_pool *dc_kv(const dc_node *n)
{
    return kn_kv_mem_pool(n->proc.mem);
}

/* dc_node_xfer.c: the leader's KV-transfer plane of a formation (maps the followers' pools,
 * starts n->plane.xfer): form() calls setup once every rank joined, and teardown once no
 * transfer is alive (dc_xfer.h), before the next setup and at exit. */
int dc_node_xfer_setup(dc_node *n);
void dc_node_xfer_teardown(dc_node *n);

/* dc_serve.c. Its part's start and end: the control server listening (leader_run, after
 * the scheduler: dc_serve_health reads it) and everything it holds freed (teardown, after
 * the scheduler and overlap, whose events it sends). */
int dc_serve_init(dc_node *n);
void dc_serve_fini(dc_node *n);
/* The scheduler's sink: token events (and error events) to the clients. */
void dc_serve_on_tokens(void *ctx, uint64_t id, const int32_t *ids, int n_ids,
                        const td_logprob_entry *lps, dc_finish finish, int32_t n_prompt,
                        int32_t n_gen, int32_t n_cached);
void dc_serve_on_prompt_logprobs(void *ctx, uint64_t id, int32_t from, const td_logprob_entry *e,
                                 int n_e);
/* Drain the inbox: wait up to timeout_ms for the first message, then take all pending.
 * Answers polls and health on the way. *ns_wait (may be NULL): the wait for the first
 * message (ns; 0 without a timeout), which the serving loops leave out of the step's
 * inbox time (an idle wait that ended with a new request is not the first step's).
 * Returns 0, or the control server's failure. */
int dc_serve_inbox(dc_node *n, int timeout_ms, int64_t *ns_wait);
/* Apply the transfers' events to the scheduler (arrived KV joins the batch, failed and
 * cancelled transfers end: their blocks are safe to reuse now). */
void dc_serve_transfers(dc_node *n);
/* Publish Health (ready unless forming, stopping or draining). */
void dc_serve_health(dc_node *n);
/* Publish Health if the load changed (an Alloc, a transfer event) or 100 ms passed since
 * *last_ms (the loop's own clock, 0 at its start; updated here). After each inbox. */
void dc_serve_health_tick(dc_node *n, int64_t *last_ms);
/* Send the held Alloc replies once every rank has made the pending tier copies (a copy plan
 * and a barrier, dc_tier_flush), at a point where no forward pass is in flight. 0, or the
 * segment's failure (the held requests are then answered with an error). */
int dc_serve_sync_allocs(dc_node *n);
/* Answer every held Alloc with an error (the formation ends). */
void dc_serve_fail_allocs(dc_node *n);

/* dc_async.c. The scheduler's sink as the leader installs it: straight to dc_serve_on_* or,
 * while held (dc_async_hold), in order until dc_async_flush. */
void dc_async_on_tokens(void *ctx, uint64_t id, const int32_t *ids, int n_ids,
                        const td_logprob_entry *lps, dc_finish finish, int32_t n_prompt,
                        int32_t n_gen, int32_t n_cached);
void dc_async_on_prompt_logprobs(void *ctx, uint64_t id, int32_t from, const td_logprob_entry *e,
                                 int n_e);
/* Hold the sink's events from now on (serve_overlap, while a step commits and the next one
 * is planned), or stop holding (what is held stays until dc_async_flush). */
void dc_async_hold(dc_node *n, bool on);
/* Send the held events, in the order the scheduler reported them. */
void dc_async_flush(dc_node *n);
/* The part's start and end: dc_async_start makes the forward thread (leader_run, with
 * decode[].overlap); dc_async_stop ends it (none in flight: the serving loop joined it),
 * sends what is held and frees the part (teardown, first: its events go to dc_serve). */
int dc_async_start(dc_node *n);
void dc_async_stop(dc_node *n);
/* Run one forward pass on the thread: batch b on this rank's engine and pool, its logits
 * into logits (b and logits stay untouched until the join); wait for it (its td_err). */
void dc_async_launch(dc_node *n, const kn_batch *b, float *logits);
int dc_async_join(dc_node *n);

/* dc_tier.c. The prefix cache's second tier of this rank (decode[].prefix_cache_tier):
 * its parameters (the file PATH.rR; at tp > 1 the slot count every rank shares, and the
 * leader's copy log); out->bytes 0: no tier. path is cap bytes and backs out->path. */
int dc_tier_params(const dc_node *n, char *path, size_t cap, kn_kv_tier_params *out);
/* Plan-area bytes the tier copies of one step may need (0 without a tier at tp > 1). */
size_t dc_tier_plan_room(const dc_node *n);
/* Follower: add its own tier to its KV memory (none without a tier). */
int dc_tier_follower_open(dc_node *n);
/* Follower: make the plan's tier copies on this rank, in order, before its compute. A
 * failure means this rank's KV would differ from the leader's: the formation must end. */
int dc_tier_apply(dc_node *n, const dc_plan_view *v);
/* Leader at tp > 1: the copies its tier made since they were last sent (NULL, 0: none);
 * dc_tier_sent once a plan carrying them is published; dc_tier_flush publishes them alone
 * (a DC_PLAN_COPY plan, numbered step) when the step plans nothing to compute, or before
 * held Alloc replies go out; in disaggregated mode it returns only once every rank made them (the
 * barrier below). Only where no forward pass is in flight. */
const kn_kv_tier_op *dc_tier_pending(dc_node *n, int *n_ops);
void dc_tier_sent(dc_node *n);
int dc_tier_flush(dc_node *n, uint64_t step);
/* Any rank, after a DC_PLAN_COPY plan in disaggregated mode: a one-float allreduce, so the
 * leader knows every rank's copies are done (0 in colocated mode, which needs none). */
int dc_tier_copy_barrier(dc_node *n);

/* dc_node.c, for the serving loop (dc_loop.c):
 *   dc_node_use_threads: the CPU pool's threads for the next forward pass (0: as configured;
 *     dc_threads.h), any rank;
 *   dc_node_grow_logits: room for rows logit rows (more than one per request only for prompt
 *     logprobs);
 *   dc_node_step_failed: a step failed with rc: why, for its requests' error events;
 *   dc_node_stop_now: after SIGTERM, whether the serving loop ends now; with
 *     decode[].drain_timeout_ms the instance first leaves (Health.draining) while the requests
 *     in flight finish, for up to that long. */
void dc_group_collective(dc_node *n, kn_collective *coll);
void dc_group_init(dc_node *n, int64_t max_rows);
int dc_group_form(dc_node *n, int wait_ms);
void dc_group_close(dc_node *n);
void dc_group_stats(const dc_node *n, dc_shm_stats *st);
void dc_group_round(dc_node *n);
int dc_group_forward(dc_node *n, const kn_batch *b, float *logits);
int dc_group_idle(dc_node *n, int wait_ms);
int dc_group_check(dc_node *n);

void dc_node_use_threads(dc_node *n, int threads);
int dc_node_grow_logits(dc_node *n, int rows);
void dc_node_step_failed(dc_node *n, int rc);
bool dc_node_stop_now(dc_node *n);

/* dc_loop.c. SERVING until the stop (0), a failure of the instance (a rank died or is
 * silent, a step failed: the caller re-forms), or, with *fatal, a failure of the control
 * server; no pass in flight and no event held when it returns. */
int dc_loop_serve(dc_node *n, bool *fatal);

/* dc_report.c. The leader's figures at exit into its log (leader_stop): what the decode
 * benchmarks and tests read (steps, collectives, threads, speculation, phases, transfers). */
void dc_report_log(const dc_node *n);

#endif
