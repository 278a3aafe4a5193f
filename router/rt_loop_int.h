/* rt_loop_int.h: private to the loop's files (rt_loop.c, rt_dispatch.c, rt_choices.c) and
 * their unit tests: how the loop starts, moves and ends requests (rt_dispatch.c).
 *
 * Invariants: a request leaves the loop only through rt_loop_retire (directly or via
 * rt_loop_finish / rt_loop_fail), which takes it out of the queue, the table and its
 * instances' counts and drops the loop's reference; after it q may be freed.
 * Threading: the loop thread only.
 */
#ifndef RT_LOOP_INT_H
#define RT_LOOP_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "rt.h"
#include "rt_pair.h"
#include "rt_stream.h"

#define RT_POKE_MS 300 /* resume idle suspended connections this often */

/* A new request from the inbox: into the router queue, or refused (429 / 503 / 500). */
void rt_loop_admit(rt_router *r, rt_req *q);
/* Send queued requests to instances while some can take them, round robin over clients. */
void rt_loop_dispatch(rt_router *r, int64_t now);

/* Cancel q's request id on its decode instance (if any). */
void rt_loop_cancel(rt_router *r, rt_req *q);
/* Cancel q's decode side if the instance may hold it: colocated, also while the Submit is
 * unanswered (the Cancel follows it on the same connection); disaggregated, an unanswered
 * Alloc is cancelled when its reply comes (rt_pair_orphan_alloc), once q is out of the
 * table. The prefill side is rt_loop_retire's (rt_pair_release). */
void rt_loop_cancel_decode_side(rt_router *r, rt_req *q);
/* Take q out of the loop's structures (cancelling a busy prefill side), drop the loop's
 * reference. */
void rt_loop_retire(rt_router *r, rt_req *q);
/* End q normally: the last text and finish_reason (rt_stream_finish), then retire it. */
void rt_loop_finish(rt_router *r, rt_req *q, rt_finish fin);
/* End q with an error (JSON status if nothing was streamed, else an SSE error event). */
void rt_loop_fail(rt_router *r, rt_req *q, int status, const char *code, const char *msg);
/* Put q back at the head of the router queue; counted: as a retry (not: a busy bounce). */
void rt_loop_requeue(rt_router *r, rt_req *q, bool counted);
/* q's decode side is lost (its instance died, restarted, failed the request or is
 * stopping: why says which), maybe after tokens were streamed. Migration: q goes back to
 * the head of the router queue and its next attempt sends the prompt followed by every
 * token received so far, with max_tokens reduced by as many, so the instance that takes it
 * over computes their KV and goes on from the next token: the client's stream continues
 * with nothing repeated or missing (greedy output equals an uninterrupted run up to float
 * rounding: the streamed tokens' KV is recomputed in a prefill chunk). A request that may
 * not move (the body said "migrate": false, router.max_migrations reached) ends with 503
 * instance_unavailable (an SSE error event once streaming started); a moving request waits
 * up to router.migrate_wait_ms for a live instance (liveness). */
void rt_loop_lose(rt_router *r, rt_req *q, const char *why, int64_t now);
/* rt_loop_lose, counted toward router.max_migrations or not: a side lost before it took
 * the attempt (an Alloc or Submit unanswered, a Prefill unacknowledged: sent to a process
 * that had just died) cannot have been brought down by the request, so that loss is not
 * counted (the wait, router.migrate_wait_ms from the first loss, still bounds it). Without
 * this, one kill cost two moves: the attempt it broke, and the next one, sent to the dead
 * process before the router knew. */
void rt_loop_move(rt_router *r, rt_req *q, const char *why, bool counted, int64_t now);
/* Do what the pairing decided for o->q (rt_pair.h). */
void rt_loop_act(rt_router *r, const rt_pair_out *o, int64_t now);
/* Instance k of a role (pf: prefill) lost every request it held (it moved to another
 * address: rt_member.c): they move on as from a dead instance. */
void rt_loop_inst_lost(rt_router *r, bool pf, int k, const char *why, int64_t now);

#endif
