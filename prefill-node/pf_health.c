/* pf_health.c: the pool and prefix-cache part of a prefill leader's Health (pf_health.h). */
#include "pf_health.h"

void pf_health_cache(const pf_stage *st, Td__Health *h, pf_health_buf *b)
{
    const kn_kv_pool *kv = st->shard.kv;
    pf_kvc_stats cs = {0};
    if (st->kvc) pf_kvc_get_stats(st->kvc, &cs);
    int used = kv->n_blocks - kv->n_free - cs.n_indexed - cs.n_detached;
    h->kv_blocks_used = (uint32_t)(used > 0 ? used : 0);
    int n_free = kv->n_blocks - st->shard.cache_blocks - (int)h->kv_blocks_used;
    h->kv_blocks_free = (uint32_t)(n_free > 0 ? n_free : 0);
    h->kv_block_size = (uint32_t)kv->block_size;
    if (!st->kvc) return;
    h->prefix_cache_blocks = (uint32_t)st->shard.cache_blocks;
    /* the latest events the ring holds: a router that polls at any moment sees those since
     * its last poll, or learns from kv_event_seq that it missed some (as for decode) */
    int n_ids = 0;
    int n = pf_kvc_events(st->kvc, PF_KVC_EVENT_LOG, b->kind, b->ids, &n_ids, &h->kv_event_seq);
    h->kv_event_kind = (ProtobufCBinaryData){.len = (size_t)n, .data = b->kind};
    h->n_kv_event_ids = (size_t)n_ids;
    h->kv_event_ids = b->ids;
}
