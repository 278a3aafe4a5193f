/* pf_health.h: the pool, prefix-cache and compute parts of a prefill leader's Health
 * (pf_leader.c publishes it): the requests' share of stage 0's KV pool, the cache's budget
 * and its KV events (docs/prefix-cache.md, "KV events"), and what stage 0 computes with.
 * Stage 0's cache decides for every stage of the instance (a prefix is used only where
 * stage 0 found it, and every stage applies the same decisions at the same points of the
 * stage stream), so its events describe the instance: a stage chain re-formed flushes it
 * (one CLEARED event), a new leader process numbers its events from 1 again (and has a new
 * boot id).
 */
#ifndef PF_HEALTH_H
#define PF_HEALTH_H

#include "pf_int.h"

/* The arrays h points into after pf_health_cache: keep it alive until h is sent. */
typedef struct {
    uint8_t kind[PF_KVC_EVENT_LOG];
    uint64_t ids[PF_KVC_EVENT_LOG];
} pf_health_buf;

/* Fill h's kv_blocks_used/free (the requests' share: the cache's blocks are its own
 * budget), kv_block_size, prefix_cache_blocks and kv_event_* from stage st. No cache: no
 * events (kv_event_seq 0, the router estimates) and prefix_cache_blocks 0. */
void pf_health_cache(const pf_stage *st, Td__Health *h, pf_health_buf *b);

/* Point h's fields 27-33 at c's strings (kn_backend_compute_info of stage 0's backend,
 * made once before the leader serves): keep c alive until h is sent. */
void pf_health_compute(const kn_compute_info *c, Td__Health *h);

#endif
