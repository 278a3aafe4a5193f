/* rt_route.h: which instance a request goes to, by router.routing (prefix rt_route_).
 *
 * Purpose: `load` (the default) is the registry's load order (rt_reg_pick: most free KV
 * blocks, then fewest running; rt_reg_pick_prefill: fewest queued prompt tokens, round
 * robin among equals). `round_robin` takes the instances in turn, skipping those that cannot
 * take a request now (dead, full, paused): the plain balancer baseline. `cache_aware` is SGLang's
 * cache-aware policy over the instances that can take the request now, scored by the distinguishing
 * match (rt_cache_choose: the match beyond what every candidate holds, nothing for a match ending
 * at a fork, so a shared system prompt does not decide), unless it is too short
 * (router.cache_aware. cache_threshold of the prompt beyond the shared part) or that instance is
 * overloaded against the least loaded one (balance_abs_threshold and balance_rel_threshold, in
 * requests the router has on each); otherwise the load order's choice. Decode instances in
 * colocated mode; decode and prefill instances, each chosen this way, in disaggregated mode.
 * rt_route_commit then records the prompt's blocks in the chosen instances' indexes, so the next
 * turn of a conversation (the same prefix, longer) finds them there. Invariants: a pick only names
 * an instance rt_reg_pick / rt_reg_pick_prefill could have named (alive, with room, not paused, not
 * `avoid`); the indexes change only in rt_route_commit and rt_reg_seen / rt_reg_forget (restarts,
 * deaths). Threading: the loop thread only. Ownership: borrows the registry, the config and the
 * prompt (only during the call).
 */
#ifndef RT_ROUTE_H
#define RT_ROUTE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "rt_cache.h"
#include "rt_registry.h"

typedef struct {
    int inst;         /* the choice (index in its array), or -1: none can take it now */
    bool cache_aware; /* chosen by the cache-aware policy (commit records it) */
    rt_route_why why;
    uint32_t matched; /* prompt tokens matched on the choice */
    int skipped;      /* RT_ROUTE_OVERLOADED: the instance with the longest match; else -1 */
} rt_route_pick;

/* The decode instance for a request whose current prompt is prompt[0..n). Called first for
 * each request (it forgets the block ids computed for the previous one). */
int rt_route_decode(rt_registry *g, const td_cfg_router *rc, const int32_t *prompt, size_t n,
                    int64_t now, rt_route_pick *out);
/* The prefill instance (never `avoid`, -1: none excluded). */
int rt_route_prefill(rt_registry *g, const td_cfg_router *rc, const int32_t *prompt, size_t n,
                     int64_t now, int avoid, rt_route_pick *out);
/* The request went to s (chosen as pk says, pk->inst is s's index): with cache_aware its
 * prompt's blocks go into s's index, and the counters of s (and of the skipped instance,
 * `insts` being s's array) count the decision. Nothing with routing: load. */
void rt_route_commit(rt_registry *g, rt_inst *insts, const int32_t *prompt, size_t n,
                     const rt_route_pick *pk);

#endif
