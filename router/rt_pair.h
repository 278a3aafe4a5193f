/* rt_pair.h: disaggregated serving: one prefill instance and one decode instance per request
 * attempt, the KV target relay, and failures before the first token (prefix rt_pair_).
 *
 * Purpose: run the two sides of an attempt (rt_pair.c has the message sequence and the
 * failure rules). The loop feeds it what the instances answer; it updates the request's
 * pairing side (q->pair) and the decode side of the attempt (q->loop.state, inst, call_id)
 * and tells the loop what to do with the request next through an rt_pair_out: it never
 * calls back into the loop.
 * Invariants: q->pair.pf_busy <=> the attempt counts in its prefill instance's `active` and
 * `inflight_tokens`; a decode side counts in `active` while SUBMITTED or RUNNING. Before
 * returning RT_PAIR_RETRY, RT_PAIR_BOUNCE or RT_PAIR_FAILED the attempt was abandoned: q is
 * on no instance (inst -1, state INBOX) and both sides were cancelled where they may hold it.
 * Threading: the loop thread only.
 * Ownership: borrows the router and the requests; the relayed targets belong to q.
 */
#ifndef RT_PAIR_H
#define RT_PAIR_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h"
#include "ctrl.h"
#include "rt_req.h"
#include "rt_route.h"

struct rt_router;

/* What the loop does with the request next. */
typedef enum {
    RT_PAIR_OK = 0, /* nothing (the attempt goes on, or the input concerned no request) */
    RT_PAIR_RETRY,  /* back to the head of the queue, counted as a retry */
    RT_PAIR_BOUNCE, /* back to the head of the queue, not counted (ERR_BUSY) */
    RT_PAIR_LOST,   /* an instance of it is lost: move it (migration); msg says why */
    RT_PAIR_FAILED, /* end it with status, code and msg */
} rt_pair_verdict;

typedef struct {
    rt_pair_verdict verdict;
    rt_req *q;        /* the request (NULL with RT_PAIR_OK when none) */
    int status;       /* RT_PAIR_FAILED: the HTTP status */
    const char *code; /* RT_PAIR_FAILED: the error code (static) or NULL */
    char msg[800];    /* RT_PAIR_LOST / RT_PAIR_FAILED: why */
    bool uncounted;   /* RT_PAIR_LOST: the lost side had not taken the attempt yet (its
                         Prefill unacknowledged): not counted as a move (rt_loop_move) */
} rt_pair_out;

/* Start an attempt of q (off the queue) on decode instance d and prefill instance p:
 * Alloc and Prefill (without targets) at once; an attempt after the first takes a fresh
 * request id. 0, or a td_err (nothing is left on either instance; the caller fails q). */
int rt_pair_start(struct rt_router *r, rt_req *q, int d, int p, int64_t now);
/* The prefill instance for q's next attempt (never the one its retry must avoid, unless
 * that failure was a timeout and no other is alive), or -1: none can take it now; chosen
 * by router.routing (rt_route_prefill, which fills *pk for rt_route_commit). */
int rt_pair_pick(struct rt_router *r, const rt_req *q, int64_t now, rt_route_pick *pk);
/* q heads the queue and rt_pair_pick found nothing: RT_PAIR_FAILED when it can never be
 * served (its retry must avoid the only alive instance), else RT_PAIR_OK (it waits). */
rt_pair_out rt_pair_unservable(struct rt_router *r, rt_req *q);

/* The reply to q's Alloc on decode instance i. */
rt_pair_out rt_pair_on_alloc(struct rt_router *r, rt_req *q, int i, const td_ctrl_client_in *in,
                             int64_t now);
/* An AllocReply that matches no live attempt: cancel it on decode instance i. */
void rt_pair_orphan_alloc(struct rt_router *r, int i, const Td__Envelope *env);
/* A decode ErrorEvent for q (an attempt on instance q->loop.inst). */
rt_pair_out rt_pair_on_decode_error(struct rt_router *r, rt_req *q, const Td__ErrorEvent *e);
/* A reply from prefill instance j (a heartbeat's, a Prefill's or a KvTarget's). */
rt_pair_out rt_pair_on_reply(struct rt_router *r, int j, const td_ctrl_client_in *in, int64_t now);
/* One event from prefill instance j (PrefillDone, ErrorEvent). */
rt_pair_out rt_pair_on_event(struct rt_router *r, int j, const Td__Event *ev);
/* Prefill instance j stopped answering (restarted false) or a new process answers for it
 * (restarted true): q, if it has no first token yet, starts again on it or another one as a
 * moved request does (RT_PAIR_LOST); for each request q of the table. RT_PAIR_OK for a
 * request not on j. */
rt_pair_out rt_pair_prefill_lost(struct rt_router *r, rt_req *q, int j, bool restarted);
/* q's attempt past its first-token deadline: both sides cancelled, RT_PAIR_FAILED; else
 * RT_PAIR_OK. */
rt_pair_out rt_pair_expire(struct rt_router *r, rt_req *q, int64_t now);

/* End q's current attempt on both sides (cancelled where they may hold it); q is then on no
 * instance (inst -1, state INBOX). */
void rt_pair_abandon(struct rt_router *r, rt_req *q);
/* q moves (its decode side, or before its first token its prefill side, was lost): a fresh
 * start for its attempts (any prefill instance, one retry, no bounces counted). */
void rt_pair_moved(rt_req *q);
/* The request ends: cancel its prefill side if still busy, free the relay buffers. */
void rt_pair_release(struct rt_router *r, rt_req *q);
/* First-token deadline of an attempt started at now: kvxfer.timeout_ms (the nodes' own
 * bound on every KV wait, so their error normally comes first) + instance_timeout_ms (a
 * dead node is noticed by then) + 2 s for the messages. */
int64_t rt_pair_deadline(const td_cfg *cfg, int64_t now);

#endif
