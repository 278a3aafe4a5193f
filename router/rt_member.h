/* rt_member.h: run-time membership (router.membership; prefix rt_member_): instances that
 * join and leave while the router runs.
 *
 * Purpose: the router listens on membership.listen for Join messages (proto/tandem_ctrl.proto)
 * that every decode rank 0 and prefill stage 0 sends every lease_ms / 4 (common/td_join.h).
 * A name the router does not know becomes a new instance (settings from its YAML template,
 * overridden by the Join); a known name at a new address moves its requests and is dialled
 * there; Join.leaving (or Health.draining) stops new requests to it. A joined instance that is
 * dead and has not announced itself for lease_ms (at once once it said it was leaving) is
 * forgotten, and its slot is reused once no request refers to it. The YAML's instances are
 * the initial set (membership.seed) and are never forgotten. docs/deploy.md, "Membership".
 * Invariants: registry slots never move (requests hold indices); a slot is reused only when no
 * request in the table names it.
 * Threading: the loop thread only.
 * Ownership: the rt_member owns its control server.
 */
#ifndef RT_MEMBER_H
#define RT_MEMBER_H

#include <stdint.h>

struct rt_router;

typedef struct rt_member rt_member;

/* NULL in *out (and 0) when membership is off (membership.listen ""). */
int rt_member_start(struct rt_router *r, rt_member **out);
void rt_member_stop(rt_member *m); /* NULL is fine */
/* Readable while Joins wait (for poll(2)); -1 for NULL. */
int rt_member_fd(const rt_member *m);
/* Answer the Joins that arrived, forget the instances whose lease ran out. NULL: nothing. */
void rt_member_poll(struct rt_router *r, rt_member *m, int64_t now);

#endif
