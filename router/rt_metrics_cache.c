/* rt_metrics_cache.c: the cache-aware routing series (router.routing: cache_aware), per
 * instance with labels role="decode"|"prefill" and instance="NAME":
 *   tandem_router_cache_route_hits_total            requests sent there for their prefix match
 *   tandem_router_cache_route_load_total            requests sent there by the load order (no
 *                                                   match above cache_threshold, or the match's
 *                                                   instance overloaded)
 *   tandem_router_cache_route_overloaded_total      times it had the longest match but was
 *                                                   overloaded (the request went elsewhere)
 *   tandem_router_cache_route_matched_tokens_total  prompt tokens matched there, over the
 *                                                   requests sent there
 *   tandem_router_cache_route_index_drops_total     times its index was dropped (restart, dead)
 *   tandem_router_cache_route_index_blocks          blocks in its index now (gauge)
 *   tandem_router_cache_route_events_total          KV events from the node applied to it
 *   tandem_router_cache_route_event_gaps_total      times KV events were lost (index dropped)
 *   tandem_router_cache_route_index_exact           1: its index is fed by KV events without a
 *                                                   gap (what the node holds), 0: an estimate
 * The figures are rt_inst_gauge.cache and rt_pf_gauge.cache as the loop published them
 * (rt_metrics_inst.c); this file only renders them. The caller holds m->mu
 * (rt_metrics_render). */
#include "rt_metrics.h"

typedef enum {
    S_HITS = 0,
    S_LOAD,
    S_OVER,
    S_TOKENS,
    S_DROPS,
    S_BLOCKS,
    S_EVENTS,
    S_GAPS,
    S_EXACT,
    S_N
} series;

static double value(const rt_cache_stats *c, series k)
{
    switch (k) {
    case S_HITS:
        return (double)c->by_cache;
    case S_LOAD:
        return (double)c->by_load;
    case S_OVER:
        return (double)c->overloaded;
    case S_TOKENS:
        return (double)c->matched_tokens;
    case S_DROPS:
        return (double)c->drops;
    case S_EVENTS:
        return (double)c->events;
    case S_GAPS:
        return (double)c->event_gaps;
    case S_EXACT:
        return c->exact ? 1.0 : 0.0;
    default:
        return (double)c->blocks;
    }
}

void rt_metrics_cache_render(rt_mw *w, const rt_metrics *m)
{
    static const char *const names[S_N] = {"tandem_router_cache_route_hits_total",
                                           "tandem_router_cache_route_load_total",
                                           "tandem_router_cache_route_overloaded_total",
                                           "tandem_router_cache_route_matched_tokens_total",
                                           "tandem_router_cache_route_index_drops_total",
                                           "tandem_router_cache_route_index_blocks",
                                           "tandem_router_cache_route_events_total",
                                           "tandem_router_cache_route_event_gaps_total",
                                           "tandem_router_cache_route_index_exact"};
    static const char *const helps[S_N] = {
        "Requests sent to the instance because their prompt's prefix matched there the most.",
        "Requests sent to the instance by the load order (no match above "
        "router.cache_aware.cache_threshold, or the matching instance was overloaded).",
        "Times the instance had the longest prefix match but was overloaded against the least "
        "loaded one (the request went there instead).",
        "Prompt tokens of the requests sent to the instance that its prefix index matched.",
        "Times the instance's prefix index was dropped (restart, marked dead).",
        "KV blocks in the router's prefix index of the instance.",
        "KV events (blocks stored, removed, all cleared) from the instance applied to its index.",
        "Times KV events of the instance were lost (its index dropped, estimated again).",
        "1 if the instance's index is fed by its KV events without a gap (exact), 0 if it is "
        "an estimate."};
    rt_labels l;
    for (int k = 0; k < S_N; k++) {
        rt_mw_family(w, names[k], k == S_BLOCKS || k == S_EXACT ? RT_MT_GAUGE : RT_MT_COUNTER,
                     helps[k]);
        for (int i = 0; i < m->n_inst; i++) {
            if (!m->inst[i].name[0]) continue;
            rt_labels_reset(&l);
            rt_labels_add(&l, "role", "decode");
            rt_labels_add(&l, "instance", m->inst[i].name);
            rt_mw_real(w, &l, value(&m->inst[i].cache, (series)k), 17);
        }
        for (int j = 0; j < m->n_pf; j++) {
            if (!m->pf[j].name[0]) continue;
            rt_labels_reset(&l);
            rt_labels_add(&l, "role", "prefill");
            rt_labels_add(&l, "instance", m->pf[j].name);
            rt_mw_real(w, &l, value(&m->pf[j].cache, (series)k), 17);
        }
    }
}
