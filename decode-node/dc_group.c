/* dc_group.c: this instance as a member of a data-parallel attention group (decode[].dp > 1,
 * common/config.h): the group's shared-memory segment (its rendezvous and its collectives,
 * decode-node/dc_shm_dp.c), the engine's dp collective calls (kernels/model.h kn_collective
 * dp_*), and the rounds that keep the members' forwards in lock step.
 *
 * Every member is an instance of its own (requests, KV pool, prefix cache, control port, the
 * router's choice), whose engine holds every tensor but its share of the routed experts. A
 * MoE layer needs every member in the same forward, so the members run rounds: round j is
 * each member's j-th forward. A member with rows asks for its next round (the segment's round
 * word, which wakes the sleeping members) and runs its forward; a member without rows that
 * sees a round asked for beyond those it joined runs the idle forward (kn_engine_forward_idle:
 * the others' rows through its experts). While idle, a member sleeps on the round word for at
 * most GROUP_IDLE_MS at a time between looks at its inbox, so a peer's round waits for it
 * microseconds, not an inbox wait (decode-node/dc_loop.c).
 * Failures: a member that dies or leaves breaks the segment; the others' next collective fails
 * (TD_EIO), their step fails its requests (the router moves them) and they form again, the
 * group segment made anew once every member is back (dc_node.c form()).
 * Threading: the node thread; with decode[].overlap the forward thread's pass also calls the
 * collectives, which read the segment, while the node thread leaves the group alone until the
 * pass is joined (its round is asked for before the launch, its idle part only between
 * passes). */
#include <stdio.h>

#include "dc_node_int.h"
#include "td_err.h"

static int grp_counts(void *ctx, const int64_t mine[2], int64_t *all)
{
    dc_node *n = ctx;
    return n->group.shm && n->group.ready ? dc_shm_dp_counts(n->group.shm, mine, all) : TD_ESTATE;
}

static int grp_gather(void *ctx, const float *mine, const int64_t *counts, int64_t n_cols,
                      float *all)
{
    dc_node *n = ctx;
    return n->group.shm && n->group.ready
               ? dc_shm_dp_gather(n->group.shm, mine, counts, n_cols, all)
               : TD_ESTATE;
}

static int grp_reduce(void *ctx, const float *all, const int64_t *counts, int64_t n_cols,
                      float *mine)
{
    dc_node *n = ctx;
    return n->group.shm && n->group.ready
               ? dc_shm_dp_reduce(n->group.shm, all, counts, n_cols, mine)
               : TD_ESTATE;
}

void dc_group_collective(dc_node *n, kn_collective *coll)
{
    if (n->dcfg->dp <= 1) return;
    coll->dp_counts = grp_counts;
    coll->dp_gather = grp_gather;
    coll->dp_reduce = grp_reduce;
}

void dc_group_init(dc_node *n, int64_t max_rows)
{
    const td_cfg_decode *d = n->dcfg;
    if (d->dp <= 1) return;
    const kn_hparams *hp = &n->proc.rt.model->hp;
    /* every member's port is member 0's + its K (config.c expand_dp): the token names the
     * group on this host */
    snprintf(n->group.token, sizeof n->group.token, "g%d", d->port - d->dp_rank);
    /* a member's rows with their choices (n_embd + 2 k floats a row) in one piece; the
     * reduce of every member's rows then takes about dp pieces */
    n->group.shmp = (dc_shm_params){
        .instance = d->dp_group,
        .token = n->group.token,
        .rank = d->dp_rank,
        .tp = d->dp,
        .max_floats = max_rows * (hp->n_embd + 2 * (int64_t)hp->n_expert_used),
        .timeout_ms = 200, /* dc_shm_begin's look for member 0's segment: form() retries */
        .op_timeout_ms = n->p->cfg->kvxfer.timeout_ms,
        .interrupt = n->p->stop,
    };
}

/* FORMING: make or find the group's segment and wait up to wait_ms for every member. 0: the
 * group is whole (at once without a group); TD_ETIMEDOUT: not yet (call again, serving the
 * inbox meanwhile); another error: this segment failed (closed here: the next call starts a
 * fresh rendezvous). */
int dc_group_form(dc_node *n, int wait_ms)
{
    dc_group *g = &n->group;
    if (n->dcfg->dp <= 1 || g->ready) return 0;
    int rc = 0;
    if (!g->shm && (rc = dc_shm_begin(&g->shmp, &g->shm))) {
        g->shm = NULL;
        return rc; /* TD_ETIMEDOUT: no segment of a live member 0 yet; else worse */
    }
    rc = dc_shm_gather(g->shm, wait_ms);
    if (rc == TD_ETIMEDOUT) return rc;
    if (rc) {
        TD_LOG_INFO("decode %s: dp group %s rendezvous failed (%s); starting a new one",
                    n->p->instance, n->dcfg->dp_group, td_strerror(rc));
        dc_group_close(n);
        return rc;
    }
    g->ready = true;
    g->joined = 0; /* a new segment: its rounds count from 0 on every member */
    TD_LOG_INFO("decode %s: member %d of dp group %s (%d members)", n->p->instance,
                n->dcfg->dp_rank, n->dcfg->dp_group, n->dcfg->dp);
    return 0;
}

void dc_group_stats(const dc_node *n, dc_shm_stats *st)
{
    *st = n->group.done;
    if (!n->group.shm) return;
    dc_shm_stats cur;
    dc_shm_get_stats(n->group.shm, &cur);
    st->n_allreduce += cur.n_allreduce, st->ns_allreduce += cur.ns_allreduce;
    st->n_gather += cur.n_gather, st->ns_gather += cur.ns_gather;
}

void dc_group_close(dc_node *n)
{
    dc_group_stats(n, &n->group.done);
    dc_shm_close(n->group.shm);
    n->group.shm = NULL;
    n->group.ready = false;
}

void dc_group_round(dc_node *n)
{
    dc_group *g = &n->group;
    if (n->dcfg->dp <= 1 || !g->ready) return;
    dc_shm_dp_request(g->shm, g->joined + 1);
    g->joined++;
    g->rounds++;
}

/* A forward with this member's rows: its round asked for first (the idle members wake). */
int dc_group_forward(dc_node *n, const kn_batch *b, float *logits)
{
    if (n->dcfg->dp > 1 && !n->group.ready) return TD_ESTATE;
    dc_group_round(n);
    return kn_engine_forward(n->proc.rt.engine, dc_kv(n), b, logits);
}

/* No rows of its own: the rounds the others asked for, waiting up to wait_ms for one. 1 when
 * a round ran, 0 when none was asked for, or the failure of the group. */
int dc_group_idle(dc_node *n, int wait_ms)
{
    dc_group *g = &n->group;
    if (n->dcfg->dp <= 1 || !g->ready) return 0;
    if (!dc_shm_dp_wanted(g->shm, g->joined, (int64_t)wait_ms * 1000000)) return 0;
    int rc = kn_engine_forward_idle(n->proc.rt.engine);
    g->joined++;
    g->rounds++;
    g->idle_rounds++;
    return rc ? rc : 1;
}

/* Between steps: a member that died or broke the group (TD_EIO and friends), else 0. */
int dc_group_check(dc_node *n)
{
    return n->dcfg->dp > 1 && n->group.shm ? dc_shm_check(n->group.shm) : 0;
}
