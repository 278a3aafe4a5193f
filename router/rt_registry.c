/* rt_registry.c: the decode and prefill instances of the YAML, their liveness and load, and
 * the choice of instances for a new request. Loop thread only.
 *
 * Liveness: every heartbeat_ms the loop sends HealthRequest (one outstanding per instance);
 * any reply or event from an instance counts as a sign of life. An instance that has been
 * seen, reports ready and was heard from within instance_timeout_ms is alive; the loop
 * (rt_loop.c) notices when one stops being alive and moves its requests (a prefill
 * instance's only those before their first token). A dead instance keeps being polled and
 * rejoins with its first ready Health. Decode and prefill instances are two arrays of the
 * same rt_inst so that the health and liveness code is shared; the choice functions differ
 * (rt.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rt_registry.h"
#include "td_err.h"

/* s->c dials s->url. */
static int dial(rt_inst *s, const char *kind)
{
    /* reconnect at least every 200 ms (NNG backs off up to 1 s by default): a restarted
       node is found, and the requests its old process held are moved (rt_loop_lose),
       within 200 ms of it listening again; a refused connect costs next to nothing */
    td_ctrl_opts opts = {.poll_wait_ms = 500, .reconnect_max_ms = 200, .security = s->security};
    int rc = td_ctrl_client_create(s->url, &opts, &s->c);
    if (rc)
        TD_LOG_ERR("router: cannot create the control client of %s instance %s (%s): %s", kind,
                   s->name, s->url, td_strerror(rc));
    return rc;
}

static int client_for(rt_inst *s, const char *kind, const char *host, int port)
{
    int rc = td_cfg_ctrl_url(host, port, s->url, sizeof s->url);
    return rc ? rc : dial(s, kind);
}

void rt_reg_caps(const td_cfg *cfg, int *cap, int *cap_pf)
{
    const td_cfg_membership *m = &cfg->router.membership;
    bool member = *m->listen != '\0';
    *cap = member && m->max_instances > cfg->n_decode ? m->max_instances : cfg->n_decode;
    /* a colocated cluster (no prefill template) takes no prefill instance */
    *cap_pf = member && cfg->n_prefill > 0 && m->max_instances > cfg->n_prefill ? m->max_instances
                                                                                : cfg->n_prefill;
}

int rt_reg_init(rt_registry *g, const td_cfg *cfg)
{
    const td_cfg_membership *m = &cfg->router.membership;
    bool seed = !*m->listen || m->seed;
    int n_dec = seed ? cfg->n_decode : 0;
    int n_pf = seed ? cfg->n_prefill : 0;
    rt_reg_caps(cfg, &g->cap, &g->cap_pf);
    g->inst = calloc((size_t)(g->cap > 0 ? g->cap : 1), sizeof *g->inst);
    g->pf = calloc((size_t)(g->cap_pf > 0 ? g->cap_pf : 1), sizeof *g->pf);
    if (!g->inst || !g->pf) return TD_ENOMEM;
    for (int i = 0; i < g->cap || i < g->cap_pf; i++) { /* joined instances dial with it too */
        if (i < g->cap) g->inst[i].security = &cfg->security;
        if (i < g->cap_pf) g->pf[i].security = &cfg->security;
    }
    g->n = n_dec;
    g->n_pf = n_pf;
    for (int i = 0; i < g->n; i++) {
        rt_inst *s = &g->inst[i];
        s->cfg = &cfg->decode[i];
        s->name = s->cfg->name;
        s->cap = 4 * s->cfg->max_batch;
        int rc = client_for(s, "decode", s->cfg->host, s->cfg->port);
        if (rc) return rc;
    }
    for (int j = 0; j < g->n_pf; j++) {
        rt_inst *s = &g->pf[j];
        s->pcfg = &cfg->prefill[j];
        s->name = s->pcfg->name;
        /* the node answers ERR_BUSY past its own queue; this only bounds the router's
           bookkeeping for one instance */
        s->cap = 2 * s->pcfg->max_queue + 8;
        int rc = client_for(s, "prefill", s->pcfg->hosts[0], s->pcfg->port);
        if (rc) return rc;
    }
    return 0;
}

static void inst_fini(rt_inst *s)
{
    rt_cidx_fini(&s->cidx);
    td_ctrl_client_in_free(&s->in);
    td_ctrl_client_destroy(s->c);
    free(s->orphans);
}

bool rt_reg_open(const rt_inst *s, int64_t now)
{
    return s->alive && !s->draining && s->active < s->cap && s->busy_until_ms <= now;
}

int rt_reg_put(rt_registry *g, bool pf, int k, const char *name, const char *url,
               const td_cfg_decode *dc, const td_cfg_prefill *pc)
{
    rt_inst *arr = pf ? g->pf : g->inst;
    int *n = pf ? &g->n_pf : &g->n, cap = pf ? g->cap_pf : g->cap;
    if (k < 0 || k > *n || k >= cap || (k < *n && !arr[k].vacant)) return TD_EINVAL;
    if (strlen(url) >= sizeof arr[k].url || strlen(name) >= sizeof arr[k].name_buf)
        return TD_ERANGE; /* before the slot is touched: a vacant one stays vacant */
    rt_inst *s = &arr[k];
    inst_fini(s);                             /* a vacant slot's leftovers (its index, its input) */
    const td_cfg_security *sec = s->security; /* set for every slot by rt_reg_init */
    *s = (rt_inst){.joined = true, .security = sec};
    snprintf(s->name_buf, sizeof s->name_buf, "%s", name);
    s->name = s->name_buf;
    snprintf(s->url, sizeof s->url, "%s", url);
    if (pf) {
        s->join_pcfg = *pc;
        s->join_pcfg.name = s->name_buf;
        s->pcfg = &s->join_pcfg;
        s->cap = 2 * s->pcfg->max_queue + 8;
    } else {
        s->join_cfg = *dc;
        s->join_cfg.name = s->name_buf;
        s->cfg = &s->join_cfg;
        s->cap = 4 * s->cfg->max_batch;
    }
    int rc = dial(s, pf ? "prefill" : "decode");
    if (rc) {
        s->vacant = true;
        return rc;
    }
    if (k == *n) (*n)++;
    return 0;
}

int rt_reg_readdress(rt_inst *s, const char *url)
{
    if (strlen(url) >= sizeof s->url) return TD_ERANGE;
    td_ctrl_client_in_free(&s->in);
    td_ctrl_client_destroy(s->c);
    s->c = NULL;
    s->hb_call = 0;
    s->alive = s->ready = s->ever_seen = false;
    free(s->orphans); /* their Prefill calls went to the old address: no Ack comes back */
    s->orphans = NULL;
    s->n_orphans = s->cap_orphans = 0;
    snprintf(s->url, sizeof s->url, "%s", url);
    return dial(s, s->pcfg ? "prefill" : "decode");
}

void rt_reg_vacate(rt_inst *s)
{
    td_ctrl_client_in_free(&s->in);
    td_ctrl_client_destroy(s->c);
    s->c = NULL;
    rt_cidx_clear(&s->cidx);
    free(s->orphans);
    s->orphans = NULL;
    s->n_orphans = s->cap_orphans = 0;
    s->alive = s->ready = s->draining = s->left = false;
    s->hb_call = 0;
    s->vacant = true;
}

void rt_reg_fini(rt_registry *g)
{
    for (int i = 0; i < g->n; i++)
        inst_fini(&g->inst[i]);
    for (int j = 0; j < g->n_pf; j++)
        inst_fini(&g->pf[j]);
    free(g->inst);
    free(g->pf);
    rt_cache_ids_fini(&g->ids);
    *g = (rt_registry){0};
}

void rt_reg_forget(rt_inst *s, const char *why)
{
    if (s->cidx.n)
        TD_LOG_INFO("router: %s instance %s: prefix index dropped (%u blocks): %s",
                    s->pcfg ? "prefill" : "decode", s->name, s->cidx.n, why);
    if (s->cidx.n) s->cst.drops++;
    rt_cidx_clear(&s->cidx);
    s->cst.blocks = 0;
}

void rt_reg_restarted(rt_inst *s, uint64_t epoch)
{
    if (epoch && epoch == s->boot_id) return; /* seen in its Health already: dropped then */
    rt_reg_forget(s, "restarted (new event epoch)");
    s->boot_id = epoch; /* its Health will carry it: not a second restart */
    s->uptime_ms = 0;
}

/* The KV events of a Health (decode nodes, prefill leaders: docs/prefix-cache.md, "KV events").
 * Every Health carries the node's latest events, so the router needs no acknowledgement: it applies
 * those past the last it applied (rt_cidx.ev_next); if it polled too seldom to see them all, the
 * report shows a gap and the index falls back to the estimate. */
static void seen_events(rt_inst *s, const Td__Health *h)
{
    rt_cidx_ev_result r;
    int rc = rt_cidx_events(&s->cidx, h->kv_event_seq, h->kv_event_kind.data, h->kv_event_kind.len,
                            h->kv_event_ids, h->n_kv_event_ids, &r);
    if (rc) {
        if (!s->ev_warned)
            TD_LOG_ERR("router: instance %s: bad KV events in its health (%s): the prefix "
                       "index estimates",
                       s->name, td_strerror(rc));
        s->ev_warned = true;
        rt_cidx_events(&s->cidx, 0, NULL, 0, NULL, 0, &r); /* the estimate from now on */
        return;
    }
    s->cst.events += r.applied;
    if (r.gap) {
        s->cst.event_gaps++;
        TD_LOG_INFO("router: %s instance %s: KV events lost (its report starts at %llu): its "
                    "prefix index was dropped and estimates again",
                    s->pcfg ? "prefill" : "decode", s->name, (unsigned long long)h->kv_event_seq);
    }
}

/* Health figures for the prefix index: a new process forgets, the sizes follow. */
static void seen_cache(rt_inst *s, const Td__Health *h)
{
    bool new_boot = h->boot_id && s->boot_id && h->boot_id != s->boot_id;
    bool went_back = h->uptime_ms < s->uptime_ms;
    if (new_boot || went_back)
        rt_reg_forget(s, new_boot ? "a new process answers (boot id)" : "its uptime went back");
    if (h->boot_id) s->boot_id = h->boot_id;
    s->uptime_ms = h->uptime_ms;
    uint64_t pool = (uint64_t)h->kv_blocks_used + h->kv_blocks_free;
    /* a prefill instance's cache is its own budget beside the requests' pool: the bound of
     * what it can hold (and of the index, exact or estimated) */
    if (s->pcfg && h->prefix_cache_blocks) pool = h->prefix_cache_blocks;
    rt_cidx_configure(&s->cidx, h->kv_block_size, pool > UINT32_MAX ? UINT32_MAX : (uint32_t)pool);
    seen_events(s, h);
    s->cst.blocks = s->cidx.n;
    s->cst.exact = s->cidx.exact;
}

/* src (NULL: "") into out, cut to cap - 1 bytes; a byte outside printable ASCII but the line
 * feed becomes '?': the strings go into label values, which must be UTF-8 (the line feed is
 * escaped there), and a node's bad bytes must not make the whole exposition unreadable. */
static void copy_label(char *out, size_t cap, const char *src)
{
    size_t n = 0;
    for (; src && src[n] && n + 1 < cap; n++) {
        const unsigned char c = (unsigned char)src[n];
        out[n] = (c >= 0x20 && c < 0x7f) || c == '\n' ? (char)c : '?';
    }
    out[n] = '\0';
}

/* Health 27-33: what the instance computes with. */
static void seen_compute(rt_compute *c, const Td__Health *h)
{
    c->seen = true;
    copy_label(c->backend, sizeof c->backend, h->backend);
    copy_label(c->act, sizeof c->act, h->act);
    copy_label(c->cpu_isa, sizeof c->cpu_isa, h->cpu_isa);
    copy_label(c->kernels_isa, sizeof c->kernels_isa, h->kernels_isa);
    copy_label(c->blas_core, sizeof c->blas_core, h->blas_core);
    c->blas_older = h->blas_core_older;
    copy_label(c->paths, sizeof c->paths, h->compute_paths);
}

bool rt_reg_seen(rt_inst *s, const Td__Health *h, int64_t now)
{
    bool was = s->alive;
    s->ever_seen = true;
    s->silence_noted = false;
    s->last_seen_ms = now;
    if (h) {
        s->ready = h->ready;
        if (h->draining && !s->draining)
            TD_LOG_INFO("router: %s instance %s is leaving: no new requests go to it",
                        s->pcfg ? "prefill" : "decode", s->name);
        s->draining = h->draining || s->left;
        if (s->pcfg && h->role != TD__ROLE__ROLE_PREFILL) {
            /* a decode leader on a prefill port would take Prefill for Submit: never use it */
            if (!s->role_warned)
                TD_LOG_ERR("router: prefill instance %s (%s) answers as role %d, not a prefill "
                           "leader: not used",
                           s->name, s->url, (int)h->role);
            s->role_warned = true;
            s->ready = false;
        }
        s->running = h->running;
        s->waiting = h->waiting;
        s->kv_used = h->kv_blocks_used;
        s->kv_free = h->kv_blocks_free;
        s->queued_tokens = h->queued_prompt_tokens;
        s->preemptions = h->num_preemptions;
        seen_cache(s, h);
        s->pc[0] = h->prefix_queried_tokens;
        s->pc[1] = h->prefix_hit_tokens;
        s->pc[2] = h->prefix_evictions;
        for (int k = 0; k < 3; k++)
            s->pc[3 + k] = (size_t)k < h->n_prefix_tier ? h->prefix_tier[k] : 0;
        /* counts of other bounds (another version) would be misread: none then */
        bool steps = h->n_step_time_counts == TD_STEP_HIST_N + 1;
        for (int k = 0; k <= TD_STEP_HIST_N; k++)
            s->steps[k] = steps ? h->step_time_counts[k] : 0;
        s->steps[TD_STEP_HIST_N + 1] = steps ? h->step_time_us : 0;
        s->spec[0] = h->spec_drafts;
        s->spec[1] = h->spec_draft_tokens;
        s->spec[2] = h->spec_accepted_tokens;
        for (int k = 0; k < RT_SPEC_POS; k++) /* absent: none accepted there */
            s->spec[3 + k] =
                (size_t)k < h->n_spec_accepted_per_pos ? h->spec_accepted_per_pos[k] : 0;
        s->spec[RT_SPEC_HELD] = h->spec_held_steps;
        s->share[0] = h->share_claimed_steps;
        s->share[1] = h->share_left_steps;
        s->share[2] = h->share_switches;
        s->share_claiming = h->share_claiming;
        seen_compute(&s->compute, h);
    }
    s->alive = s->ready;
    return s->alive && !was;
}

rt_inst_gauge rt_reg_gauge(const rt_inst *s)
{
    rt_inst_gauge g = {.running = s->running,
                       .waiting = s->waiting,
                       .kv_used = s->kv_used,
                       .kv_free = s->kv_free,
                       .preemptions = s->preemptions,
                       .boot_id = s->boot_id,
                       .share_claiming = s->share_claiming,
                       .alive = s->alive,
                       .compute = s->compute,
                       .cache = s->cst};
    if (!s->vacant) {
        snprintf(g.name, sizeof g.name, "%s", s->name);
        snprintf(g.url, sizeof g.url, "%s", s->url);
    }
    g.joined = s->joined;
    g.draining = s->draining;
    _Static_assert(sizeof g.pc == sizeof s->pc && sizeof g.steps == sizeof s->steps &&
                       sizeof g.spec == sizeof s->spec && sizeof g.share == sizeof s->share,
                   "rt_inst's counts are rt_inst_gauge's");
    memcpy(g.pc, s->pc, sizeof g.pc);
    memcpy(g.steps, s->steps, sizeof g.steps);
    memcpy(g.spec, s->spec, sizeof g.spec);
    memcpy(g.share, s->share, sizeof g.share);
    return g;
}

static void heartbeat(rt_inst *s, const td_cfg_router *rc, int timeout, int64_t now)
{
    /* no client: a vacant slot, or a new address NNG could not dial (its next Join tries
       again) */
    if (!s->c || s->hb_call || now - s->last_hb_ms < rc->heartbeat_ms) return;
    s->last_hb_ms = now;
    if (td_ctrl_client_health(s->c, timeout, &s->hb_call)) s->hb_call = 0;
}

void rt_reg_heartbeat(rt_registry *g, const td_cfg_router *rc, int64_t now)
{
    int timeout = 2 * rc->heartbeat_ms < 250 ? 250 : 2 * rc->heartbeat_ms;
    if (timeout > rc->instance_timeout_ms) timeout = rc->instance_timeout_ms;
    for (int i = 0; i < g->n; i++)
        heartbeat(&g->inst[i], rc, timeout, now);
    for (int j = 0; j < g->n_pf; j++)
        heartbeat(&g->pf[j], rc, timeout, now);
}

int rt_reg_pick(const rt_registry *g, int64_t now)
{
    int best = -1;
    for (int i = 0; i < g->n; i++) {
        const rt_inst *s = &g->inst[i];
        if (!rt_reg_open(s, now)) continue;
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

static uint64_t pf_tokens(const rt_inst *s)
{
    return s->queued_tokens > s->inflight_tokens ? s->queued_tokens : s->inflight_tokens;
}

int rt_reg_pick_prefill(rt_registry *g, int64_t now, int avoid)
{
    int best = -1;
    for (int k = 0; k < g->n_pf; k++) {
        /* visiting in round-robin order and replacing only on strictly less load makes
           ties go to the first instance after the previous choice */
        int j = (int)((g->pf_rr + (unsigned)k) % (unsigned)g->n_pf);
        const rt_inst *s = &g->pf[j];
        if (j == avoid || !rt_reg_open(s, now)) continue;
        if (best < 0) {
            best = j;
            continue;
        }
        const rt_inst *b = &g->pf[best];
        uint64_t ts = pf_tokens(s), tb = pf_tokens(b);
        uint32_t ws = s->waiting + s->running, wb = b->waiting + b->running;
        if (ts < tb || (ts == tb && ws < wb)) best = j;
    }
    if (best >= 0) g->pf_rr = (unsigned)best + 1;
    return best;
}

int rt_reg_n_alive(const rt_registry *g)
{
    int n = 0;
    for (int i = 0; i < g->n; i++)
        n += g->inst[i].alive;
    return n;
}

int rt_reg_n_pf_alive(const rt_registry *g, int avoid)
{
    int n = 0;
    for (int j = 0; j < g->n_pf; j++)
        n += j != avoid && g->pf[j].alive;
    return n;
}
