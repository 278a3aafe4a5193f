/* rt_loop.h: the router loop thread (prefix rt_loop_).
 *
 * Purpose: the one thread that owns the control-plane clients (one per decode and prefill
 * instance, via rt_registry), the request table and the router queue, and takes every
 * scheduling decision. A request's life on it:
 *
 *   HTTP thread: parse + validate --rt_loop_post--> INBOX
 *   INBOX --admit--> QUEUED (router queue, bounded by router.max_queue; full: 429 to the
 *         client holding the most queued requests, which may evict its newest one)
 *   QUEUED --dispatch (round robin over clients, rt_reg_pick)--> SUBMITTED (Submit sent)
 *   SUBMITTED --Ack--> RUNNING --TokenEvent*--> RUNNING --finish/stop string--> DONE
 *   SUBMITTED --ErrorEvent BUSY / timeout, nothing streamed--> QUEUED (retried)
 *   SUBMITTED / RUNNING --lost (instance dead / restarted / ERR_PEER_FAILED / ERR_SHUTDOWN)-->
 *         QUEUED (migration: the prompt plus the tokens received) or DONE (cannot move)
 *   any --deadline (504) / error / client gone / evicted (429) / shutdown--> DONE
 * Disaggregated mode (rt_pair.h): dispatch starts an attempt (Alloc to the decode leader,
 * Prefill to the prefill leader); SUBMITTED waits for AllocReply, RUNNING means the decode
 * side holds the request; a failure before the first token re-queues it (one prefill retry)
 * or ends it.
 * Invariants: every request has a deadline (expires_ms); time queued counts. DONE requests
 * are out of the table; their remaining bytes sit in q->http.out until written.
 * Threading: rt_loop_post and rt_loop_gone on the HTTP threads (they take the inbox lock and
 * wake the loop through an eventfd); the rest on the main thread.
 * Ownership: the loop holds one reference to each request from rt_loop_post until it
 * retires it.
 */
#ifndef RT_LOOP_H
#define RT_LOOP_H

#include <stdbool.h>

struct rt_router;
struct rt_req;

int rt_loop_start(struct rt_router *r);
/* Answer every open request (503 shutting_down, cancelled on its instances; the Cancels
 * are given up to 500 ms to reach them), join the thread. Call with closing set. */
void rt_loop_stop(struct rt_router *r);
/* After the HTTP server stopped: free the loop's structures. */
void rt_loop_drain(struct rt_router *r);
/* Hand a parsed request to the loop (takes a reference); suspends q's connection first,
 * under the inbox lock. false when the router is closing (nothing was done). */
bool rt_loop_post(struct rt_router *r, struct rt_req *q);
/* The connection of q closed (the loop cancels it on its instance). */
void rt_loop_gone(struct rt_router *r, struct rt_req *q);

#endif
