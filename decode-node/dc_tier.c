/* dc_tier.c: the prefix cache's second tier on each rank of a decode instance
 * (decode[].prefix_cache_tier, docs/prefix-cache.md "Second tier"): its parameters, and at
 * tp > 1 the copies the leader's tier made, sent with the step plan (dc_plan.h) and repeated
 * by every other rank on its own pool and tier before the step computes (kv_tier.h "tensor
 * parallelism"). The leader's scheduler owns its tier (dc_sched, attached to the pool's cache); a
 * follower's is the node's.
 *
 * Why the copies cannot come late: a follower's pool is written only by the steps it runs
 * (colocated mode: no KV arrives from outside), every copy the leader makes happens while it
 * plans a step, and the follower makes them before that step's compute; a planning that
 * schedules nothing still sends its copies at once (a DC_PLAN_COPY plan). A put therefore
 * reads a block's KV before anything overwrites it, and a get lands before a step reads it.
 * The store is the file at path on every backend (memory-mapped host memory); a device
 * pool's blocks are copied through the backend's download/upload (kv_tier.c), tested with
 * the cpu-dev backend only: other device backends are refused until they ran.
 * Disaggregated mode at tp > 1: a KV transfer writes a follower's blocks as soon as the
 * prefill stages have the targets, so a block the leader evicted to the tier at Alloc could
 * be overwritten before the follower copied it out. So there the leader holds an Alloc's
 * reply while its allocation's copies are pending (dc_serve.c must_hold) and, at the next
 * point where no pass is in flight, publishes them in a copy plan that every rank ends
 * with a barrier (dc_tier_copy_barrier: a one-float allreduce), then sends the targets: no
 * writer can reach a block before every rank copied it out. Copies that ride on a step's
 * plan need no barrier: the blocks they free go to the step's own rows, which only the
 * step writes. */
#include <stdio.h>
#include <string.h>

#include "dc_node_int.h"
#include "kv_cache.h"
#include "kv_tier.h"
#include "td_err.h"
#include "td_tp.h"

int dc_tier_params(const dc_node *n, char *path, size_t cap, kn_kv_tier_params *out)
{
    *out = (kn_kv_tier_params){0};
    const td_cfg_decode *d = n->dcfg;
    if (!d->tier.path) return 0;
    /* a device pool's copies go through the backend's download/upload: tested with cpu-dev
       (the CPU kernels behind a device backend's contract) in colocated mode only */
    const char *dev = dc_kv(n)->dev.ops ? dc_kv(n)->dev.ops->name : NULL;
    if (dev && (strcmp(dev, "cpu-dev") || n->proc.disagg)) {
        TD_LOG_ERR("decode %s: prefix_cache_tier with the %s backend%s is not supported yet (a "
                   "device pool's tier is tested with cpu-dev in colocated mode only)",
                   n->p->instance, dev, n->proc.disagg ? " in disaggregated mode" : "");
        return TD_EUNSUPP;
    }
    if ((size_t)snprintf(path, cap, "%s.r%d", d->tier.path, n->p->rank) >= cap) return TD_EINVAL;
    *out = (kn_kv_tier_params){.path = path, .bytes = (size_t)d->tier.bytes};
    if (d->tp > 1) {
        /* the same slot count on every rank: what bytes hold of the rank with most KV heads */
        const kn_hparams *hp = &n->proc.rt.model->hp;
        int max_kv = td_tp_max_kv_heads(hp->n_head, hp->n_head_kv, d->tp);
        size_t sb =
            kn_kv_tier_block_bytes(dc_kv(n)) / (size_t)dc_kv(n)->n_kv_heads * (size_t)max_kv;
        size_t slots = (size_t)d->tier.bytes > 4096 ? ((size_t)d->tier.bytes - 4096) / sb : 0;
        if (slots < 1 || slots > INT32_MAX / 4) {
            TD_LOG_ERR("decode %s: prefix_cache_tier size %lld holds %zu blocks of %zu bytes (rank "
                       "with most KV heads) plus a 4096-byte header",
                       n->p->instance, (long long)d->tier.bytes, slots, sb);
            return TD_EINVAL;
        }
        out->slots = (int)slots;
        out->log = n->p->rank == 0;
    }
    TD_LOG_INFO("decode %s rank %d: prefix cache tier %s, %lld bytes", n->p->instance, n->p->rank,
                path, (long long)d->tier.bytes);
    return 0;
}

size_t dc_tier_plan_room(const dc_node *n)
{
    /* the copies of one planning: a put per block it evicts (at most every block), a get per
       block it reads back (at most every block too) */
    return n->dcfg->tier.path && n->dcfg->tp > 1 ? (size_t)dc_kv(n)->n_blocks * 2 * 12 + 64 : 0;
}

int dc_tier_follower_open(dc_node *n)
{
    char path[4096];
    kn_kv_tier_params tp;
    int rc = dc_tier_params(n, path, sizeof path, &tp);
    if (!rc && tp.bytes) rc = kn_kv_mem_add_tier(n->proc.mem, &tp);
    return rc;
}

int dc_tier_apply(dc_node *n, const dc_plan_view *v)
{
    if (v->n_copies && !kn_kv_mem_tier(n->proc.mem)) {
        TD_LOG_ERR("decode %s rank %d: step %llu carries %d tier copies and this rank has no tier",
                   n->p->instance, n->p->rank, (unsigned long long)v->step, v->n_copies);
        return TD_EFORMAT;
    }
    for (int i = 0; i < v->n_copies; i++) {
        int rc = kn_kv_tier_apply(kn_kv_mem_tier(n->proc.mem), dc_kv(n), &v->copies[i]);
        if (rc) {
            TD_LOG_ERR("decode %s rank %d: step %llu: tier copy %d of %d failed (%s): this rank's "
                       "KV would differ from rank 0's",
                       n->p->instance, n->p->rank, (unsigned long long)v->step, i, v->n_copies,
                       td_strerror(rc));
            return rc;
        }
    }
    return 0;
}

const kn_kv_tier_op *dc_tier_pending(dc_node *n, int *n_ops)
{
    kn_kv_tier *t =
        n->dcfg->tp > 1 && kn_kv_mem_cache(n->proc.mem) ? kn_kv_mem_tier(n->proc.mem) : NULL;
    *n_ops = 0;
    return t ? kn_kv_tier_ops(t, n_ops) : NULL;
}

void dc_tier_sent(dc_node *n)
{
    kn_kv_tier *t = kn_kv_mem_cache(n->proc.mem) ? kn_kv_mem_tier(n->proc.mem) : NULL;
    if (t) kn_kv_tier_ops_clear(t);
}

int dc_tier_flush(dc_node *n, uint64_t step)
{
    int nc;
    const kn_kv_tier_op *ops = dc_tier_pending(n, &nc);
    if (!nc) return 0;
    void *buf;
    size_t cap, len;
    int rc = dc_shm_plan_begin(n->form.shm, &buf, &cap);
    if (!rc) rc = dc_plan_encode(NULL, ops, nc, dc_kv(n)->block_size, step, 0, buf, cap, &len);
    if (!rc) rc = dc_shm_plan_commit(n->form.shm, len);
    if (!rc) dc_tier_sent(n);
    if (!rc) rc = dc_tier_copy_barrier(n);
    return rc;
}

int dc_tier_copy_barrier(dc_node *n)
{
    if (!n->proc.disagg) return 0;
    float none = 0.0f; /* the sum is not the point: every rank is past its copies */
    return dc_shm_allreduce(n->form.shm, &none, 1);
}
