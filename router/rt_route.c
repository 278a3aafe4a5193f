/* rt_route.c: the instance for a request, by router.routing (rt_route.h): the load order,
 * round robin, or the cache-aware choice (rt_cache_choose) over the instances that can take it now.
 * Loop thread. */
#include <stdlib.h>

#include "rt_route.h"

/* The cache-aware choice among insts[0..n) (fallback: the load order's choice, >= 0). */
static int choose(rt_registry *g, const td_cfg_router *rc, rt_inst *insts, int n, int fallback,
                  int avoid, const int32_t *prompt, size_t n_prompt, int64_t now,
                  rt_route_pick *out)
{
    rt_cache_cand stack[16], *c = n <= 16 ? stack : malloc((size_t)n * sizeof *c);
    if (!c) return fallback; /* out of memory: the load order */
    int m = 0;
    for (int k = -1; k < n; k++) { /* the fallback first: rt_cache_choose's c[0] */
        int i = k < 0 ? fallback : k;
        if ((k >= 0 && i == fallback) || i == avoid || !rt_reg_open(&insts[i], now)) continue;
        const rt_inst *s = &insts[i];
        size_t n_ids = 0;
        const uint64_t *ids =
            s->cidx.n ? rt_cache_ids_get(&g->ids, prompt, n_prompt, s->cidx.block_size, &n_ids)
                      : NULL;
        size_t blocks = ids ? rt_cidx_match(&s->cidx, ids, n_ids) : 0;
        c[m++] = (rt_cache_cand){.inst = i,
                                 .load = (uint32_t)s->active,
                                 .matched = (uint32_t)(blocks * s->cidx.block_size),
                                 .fork = ids && rt_cidx_forks(&s->cidx, ids, n_ids, blocks)};
    }
    int skipped;
    int pos = rt_cache_choose(c, m, n_prompt, &rc->cache_aware, &out->why, &skipped);
    out->matched = c[pos].matched;
    out->skipped = skipped >= 0 ? c[skipped].inst : -1;
    int inst = c[pos].inst;
    if (c != stack) free(c);
    return inst;
}

static void pick_init(rt_route_pick *out, int inst)
{
    *out = (rt_route_pick){.inst = inst, .why = RT_ROUTE_BY_LOAD, .skipped = -1};
}

/* routing: round_robin: the first instance from *next on (wrapping) that can take a request
 * now and is not `avoid`; *next moves past it. Ignores load and cache: the baseline the
 * cache-aware policy is measured against (issue 16), as a user of a plain L4 balancer has. */
static int round_robin(rt_inst *insts, int n, unsigned *next, int avoid, int64_t now)
{
    for (int k = 0; k < n; k++) {
        int i = (int)((*next + (unsigned)k) % (unsigned)n);
        if (i == avoid || !rt_reg_open(&insts[i], now)) continue;
        *next = (unsigned)i + 1;
        return i;
    }
    return -1;
}

int rt_route_decode(rt_registry *g, const td_cfg_router *rc, const int32_t *prompt, size_t n,
                    int64_t now, rt_route_pick *out)
{
    g->ids.tokens = NULL; /* a new request: the ids of the last one (its buffer may be gone) */
    int i = rc->routing == TD_CFG_ROUTING_ROUND_ROBIN
                ? round_robin(g->inst, g->n, &g->rr_next, -1, now)
                : rt_reg_pick(g, now);
    pick_init(out, i);
    if (i < 0 || rc->routing != TD_CFG_ROUTING_CACHE_AWARE) return i;
    out->cache_aware = true;
    out->inst = choose(g, rc, g->inst, g->n, i, -1, prompt, n, now, out);
    return out->inst;
}

int rt_route_prefill(rt_registry *g, const td_cfg_router *rc, const int32_t *prompt, size_t n,
                     int64_t now, int avoid, rt_route_pick *out)
{
    int j = rc->routing == TD_CFG_ROUTING_ROUND_ROBIN
                ? round_robin(g->pf, g->n_pf, &g->pf_rr_next, avoid, now)
                : rt_reg_pick_prefill(g, now, avoid);
    pick_init(out, j);
    if (j < 0 || rc->routing != TD_CFG_ROUTING_CACHE_AWARE) return j;
    out->cache_aware = true;
    out->inst = choose(g, rc, g->pf, g->n_pf, j, avoid, prompt, n, now, out);
    return out->inst;
}

void rt_route_commit(rt_registry *g, rt_inst *insts, const int32_t *prompt, size_t n,
                     const rt_route_pick *pk)
{
    if (!pk->cache_aware || pk->inst < 0) return;
    rt_inst *s = &insts[pk->inst];
    if (pk->why == RT_ROUTE_BY_CACHE)
        s->cst.by_cache++;
    else
        s->cst.by_load++;
    s->cst.matched_tokens += pk->matched;
    if (pk->skipped >= 0) insts[pk->skipped].cst.overloaded++;
    size_t n_ids = 0;
    const uint64_t *ids = rt_cache_ids_get(&g->ids, prompt, n, s->cidx.block_size, &n_ids);
    if (ids && rt_cidx_insert(&s->cidx, ids, n_ids))
        rt_reg_forget(s, "out of memory while indexing a prompt");
    s->cst.blocks = s->cidx.n;
}
