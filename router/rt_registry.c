/* rt_registry.c: the decode instances of the YAML, their liveness and load, and the choice
 * of an instance for a new request. Loop thread only.
 *
 * Liveness: every heartbeat_ms the loop sends HealthRequest (one outstanding per instance);
 * any reply or event from an instance counts as a sign of life. An instance that has been
 * seen, reports ready and was heard from within instance_timeout_ms is alive; the loop
 * (rt_loop.c) notices when one stops being alive and fails its requests. A dead instance
 * keeps being polled and rejoins with its first ready answer. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rt.h"
#include "td_err.h"

int rt_reg_init(rt_registry *g, const td_cfg *cfg)
{
    g->inst = calloc((size_t)cfg->n_decode, sizeof *g->inst);
    if (!g->inst) return TD_ENOMEM;
    g->n = cfg->n_decode;
    td_ctrl_opts opts = {.poll_wait_ms = 500};
    for (int i = 0; i < g->n; i++) {
        rt_inst *s = &g->inst[i];
        s->cfg = &cfg->decode[i];
        s->cap = 4 * s->cfg->max_batch;
        int rc = td_cfg_ctrl_url(s->cfg->host, s->cfg->port, s->url, sizeof s->url);
        if (!rc) rc = td_ctrl_client_create(s->url, &opts, &s->c);
        if (rc) {
            TD_LOG_ERR("router: cannot create the control client of decode instance %s (%s): %s",
                       s->cfg->name, s->url, td_strerror(rc));
            return rc;
        }
    }
    return 0;
}

void rt_reg_fini(rt_registry *g)
{
    for (int i = 0; i < g->n; i++) {
        td_ctrl_client_in_free(&g->inst[i].in);
        td_ctrl_client_destroy(g->inst[i].c);
    }
    free(g->inst);
    *g = (rt_registry){0};
}

bool rt_reg_seen(rt_registry *g, int i, const Td__Health *h, int64_t now)
{
    rt_inst *s = &g->inst[i];
    bool was = s->alive;
    s->ever_seen = true;
    s->last_seen_ms = now;
    if (h) {
        s->ready = h->ready;
        s->running = h->running;
        s->waiting = h->waiting;
        s->kv_used = h->kv_blocks_used;
        s->kv_free = h->kv_blocks_free;
    }
    s->alive = s->ready;
    return s->alive && !was;
}

void rt_reg_heartbeat(rt_registry *g, const td_cfg_router *rc, int64_t now)
{
    int timeout = 2 * rc->heartbeat_ms < 250 ? 250 : 2 * rc->heartbeat_ms;
    if (timeout > rc->instance_timeout_ms) timeout = rc->instance_timeout_ms;
    for (int i = 0; i < g->n; i++) {
        rt_inst *s = &g->inst[i];
        if (s->hb_call || now - s->last_hb_ms < rc->heartbeat_ms) continue;
        s->last_hb_ms = now;
        if (td_ctrl_client_health(s->c, timeout, &s->hb_call)) s->hb_call = 0;
    }
}

int rt_reg_pick(const rt_registry *g, int64_t now)
{
    int best = -1;
    for (int i = 0; i < g->n; i++) {
        const rt_inst *s = &g->inst[i];
        if (!s->alive || s->active >= s->cap || s->busy_until_ms > now) continue;
        if (best < 0) {
            best = i;
            continue;
        }
        const rt_inst *b = &g->inst[best];
        uint32_t load_s = s->running + (uint32_t)s->active,
                 load_b = b->running + (uint32_t)b->active;
        if (s->kv_free > b->kv_free || (s->kv_free == b->kv_free && load_s < load_b)) best = i;
    }
    return best;
}

int rt_reg_n_alive(const rt_registry *g)
{
    int n = 0;
    for (int i = 0; i < g->n; i++)
        n += g->inst[i].alive;
    return n;
}
