/* pf_health.c: the pool, prefix-cache and compute parts of a prefill leader's Health
 * (pf_health.h). */
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

_Static_assert(sizeof((kn_compute_info *)0)->blas_core <= TD_CTRL_MAX_TAG + 1 &&
                   sizeof((kn_compute_info *)0)->paths <= TD_CTRL_MAX_PATHS + 1,
               "Health's compute strings must fit the decoder's limits");
void pf_health_compute(const kn_compute_info *c, Td__Health *h)
{
    h->backend = (char *)c->backend;
    h->act = (char *)c->act;
    h->cpu_isa = (char *)c->cpu_isa;
    h->kernels_isa = (char *)c->kernels_isa;
    h->blas_core = (char *)c->blas_core;
    h->blas_core_older = c->blas_older;
    h->compute_paths = (char *)c->paths;
}
