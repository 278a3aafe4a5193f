/* rt_registry.h: the decode and prefill instances of the YAML, their liveness and load,
 * and the choice of instances for a new request (prefix rt_reg_).
 *
 * Purpose: one control-plane client per instance, heartbeats, the last health figures, and
 * rt_reg_pick / rt_reg_pick_prefill.
 * Invariants: an instance is alive when it was seen, reports ready (a prefill instance:
 * as ROLE_PREFILL) and was heard from within router.instance_timeout_ms; `active` counts
 * the router's own requests on it (decode: SUBMITTED or RUNNING; prefill: attempts with
 * pf_busy), released exactly once by whoever took the request off it.
 * Threading: the loop thread only.
 * Ownership: the registry owns the clients and the orphan lists; it borrows the config.
 */
#ifndef RT_REGISTRY_H
#define RT_REGISTRY_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h"
#include "ctrl.h"
#include "rt_cache.h"
#include "rt_metrics.h"
#include "td_step_hist.h"

typedef struct {
    uint64_t call_id;
    uint64_t rid; /* 0: health / cancel */
} rt_call;

typedef struct {
    const td_cfg_decode *cfg;   /* decode instance; NULL for a prefill instance */
    const td_cfg_prefill *pcfg; /* prefill instance; NULL for a decode instance */
    const char *name;           /* from the YAML */
    char url[160];
    const td_cfg_security *security; /* the YAML's control-plane TLS (the client dials with it) */
    td_ctrl_client *c;
    td_ctrl_client_in in;
    bool alive; /* answered within instance_timeout_ms and ready */
    bool ever_seen;
    bool silence_noted; /* marked dead for its current silence (rt_loop.c went_silent) */
    int64_t last_seen_ms;
    int64_t last_hb_ms;
    uint64_t hb_call; /* outstanding health call, 0 none */
    int64_t busy_until_ms;
    uint32_t running, waiting, kv_used, kv_free; /* last figures */
    bool ready;
    int active;             /* decode: router requests SUBMITTED or RUNNING on it; prefill: attempts
                               with pf_busy on it */
    int cap;                /* most requests the router gives it at once */
    uint64_t queued_tokens; /* prefill: Health.queued_prompt_tokens */
    uint64_t preemptions;   /* decode: Health.num_preemptions (since the instance started) */
    uint64_t pc[6];         /* decode: Health.prefix_{queried_tokens,hit_tokens,evictions}, then
                               Health.prefix_tier[0..2] (tier writes, reads, hit tokens) */
    uint64_t steps[TD_STEP_HIST_N + 2]; /* decode: Health.step_time_counts, step_time_us */
    uint64_t spec[RT_SPEC_N];           /* decode: Health.spec_drafts, spec_draft_tokens,
                                           spec_accepted_tokens, spec_accepted_per_pos[],
                                           spec_held_steps */
    uint64_t share[RT_SHARE_N];         /* decode: Health.share_claimed_steps, share_left_steps,
                                           share_switches */
    bool share_claiming;                /* decode: Health.share_claiming */
    uint64_t inflight_tokens;           /* prefill: prompt tokens of the router's attempts on it */
    bool role_warned;                   /* prefill: logged once that it does not say ROLE_PREFILL */
    bool ev_warned;                     /* logged once that its Health's KV events were malformed */
    rt_call *orphans;                   /* prefill: (n_orphans) Prefill calls of abandoned attempts:
                                           their Ack is answered with a Cancel */
    int n_orphans, cap_orphans;
    /* cache-aware routing (rt_route.h): what the router sent here, and the process it went to */
    rt_cidx cidx;       /* block ids of the prompts sent here (router.routing: cache_aware) */
    uint64_t boot_id;   /* Health.boot_id last seen; 0 none yet (or a node that sends none) */
    uint64_t uptime_ms; /* Health.uptime_ms last seen */
    rt_cache_stats cst; /* published to /metrics */
    rt_compute compute; /* Health 27-33 last seen, published to /metrics */
    /* run-time membership (router.membership, rt_member.h) */
    bool joined;                        /* added by a Join, not from the YAML */
    bool vacant;                        /* a forgotten joined instance's slot: no client */
    bool draining;                      /* leaving (Health.draining, Join.leaving): nothing new */
    bool left;                          /* its last Join said it leaves: a Health it sent before
                                           (draining false) does not undo that, a Join does */
    int64_t last_join_ms;               /* its last Join, 0: none */
    char name_buf[TD_CFG_NAME_MAX + 1]; /* a joined instance's name (name points here) */
    td_cfg_decode join_cfg;             /* a joined decode instance's settings (cfg points here:
                                           its template's, with the Join's name, tp, max_batch) */
    td_cfg_prefill join_pcfg;           /* likewise for a prefill instance (pp, max_queue) */
} rt_inst;

typedef struct {
    rt_inst *inst; /* (n) decode instances: the YAML's in its order, then joined ones; room for
                      cap (slots never move: requests hold indices) */
    int n, cap;
    rt_inst *pf; /* (n_pf) prefill instances, likewise (cap_pf); none: colocated mode */
    int n_pf, cap_pf;
    unsigned pf_rr;               /* round-robin start among equally loaded prefill instances */
    unsigned rr_next, pf_rr_next; /* routing: round_robin: the next decode / prefill turn */
    rt_cache_ids ids;             /* the block ids of the request being routed (rt_route.c) */
} rt_registry;

/* Room for instances of each role: the YAML's, or router.membership.max_instances when
 * membership is on (and the cluster has the role). */
void rt_reg_caps(const td_cfg *cfg, int *cap, int *cap_pf);
/* The YAML's instances (none when router.membership.seed is false), with room for
 * router.membership.max_instances of each role when membership is on. */
int rt_reg_init(rt_registry *g, const td_cfg *cfg);
void rt_reg_fini(rt_registry *g);
/* Whether a new request may go to s now: alive, not leaving, under its cap, not bounced. */
bool rt_reg_open(const rt_inst *s, int64_t now);
/* Slot k of a role (pf: prefill) as a joined instance name at url (tcp://HOST:PORT) with
 * settings from dc / pc (the template's, overridden by the Join; the other NULL); k is a
 * vacant slot or n (n_pf), which grows. A fresh client dials url. */
int rt_reg_put(rt_registry *g, bool pf, int k, const char *name, const char *url,
               const td_cfg_decode *dc, const td_cfg_prefill *pc);
/* s's control client dials url from now on (a joined instance at a new address). */
int rt_reg_readdress(rt_inst *s, const char *url);
/* A joined instance is forgotten: its client closed, its slot vacant (reusable once no
 * request refers to it). */
void rt_reg_vacate(rt_inst *s);
/* Record a sign of life and health figures (h may be NULL) of s. A prefill instance must
 * say ROLE_PREFILL to count as ready. A new boot_id or an uptime that went back means a
 * new process: its prefix index is dropped (rt_reg_forget). The index takes the block
 * size and pool size (kv_blocks_used + kv_blocks_free) reported, s->compute what the
 * instance computes with (fields 27-33). Returns true if the instance just came (back) up. */
bool rt_reg_seen(rt_inst *s, const Td__Health *h, int64_t now);
/* Decode instance s's figures as the loop publishes them (rt_metrics_publish_inst). */
rt_inst_gauge rt_reg_gauge(const rt_inst *s);
/* What the router knew of s's prefix cache is stale (a restart, marked dead): drop it.
 * why is logged (an index that was empty is dropped silently). */
void rt_reg_forget(rt_inst *s, const char *why);
/* The control client reports a new server process with event epoch `epoch` (its boot id):
 * the index is dropped unless a Health of that same process already told (then what was
 * learnt since is about the new process and stays). */
void rt_reg_restarted(rt_inst *s, uint64_t epoch);
/* Send heartbeats that are due (decode and prefill instances). */
void rt_reg_heartbeat(rt_registry *g, const td_cfg_router *rc, int64_t now);
/* Index of the best decode instance for a new request, or -1 (none alive with room):
 * the most free KV blocks, then the fewest running + router-active requests. */
int rt_reg_pick(const rt_registry *g, int64_t now);
/* Index of the prefill instance for a new attempt, or -1 (none alive with room); never
 * `avoid` (-1: no exclusion). Least load first: max(reported queued prompt tokens, prompt
 * tokens of the router's own attempts on it: they count before a health report shows
 * them), then fewest waiting + running, then round robin (g->pf_rr advances past the
 * choice, so a run of idle instances is used in turn). */
int rt_reg_pick_prefill(rt_registry *g, int64_t now, int avoid);
int rt_reg_n_alive(const rt_registry *g);
/* Prefill instances alive (ready), not counting `avoid` (-1: count all). */
int rt_reg_n_pf_alive(const rt_registry *g, int avoid);

#endif
