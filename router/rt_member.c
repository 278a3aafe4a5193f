/* rt_member.c: run-time membership (rt_member.h): the Join socket, new instances, moved
 * ones, and forgetting those that left. Loop thread. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rt_loop_int.h"
#include "rt_member.h"
#include "td_err.h"

#define REFUSAL_LOG_MS 1000 /* at most one "Join refused" line this often */

struct rt_member {
    td_ctrl_server *srv;
    td_ctrl_server_in in;
    int64_t last_refusal_log_ms; /* when a refused Join was last logged */
};

int rt_member_start(rt_router *r, rt_member **out)
{
    *out = NULL;
    const td_cfg_membership *mc = &r->cfg->router.membership;
    if (!*mc->listen) return 0;
    rt_member *m = calloc(1, sizeof *m);
    if (!m) return TD_ENOMEM;
    char url[300], bound[300] = "";
    td_ctrl_opts o = {.security = &r->cfg->security};
    int rc = td_ctrl_hostport_url(mc->listen, url, sizeof url);
    if (!rc) rc = td_ctrl_server_create(&o, &m->srv);
    if (!rc) rc = td_ctrl_server_listen(m->srv, url, bound, sizeof bound);
    if (rc) {
        TD_LOG_ERR("router: membership: cannot listen on %s: %s", mc->listen, td_strerror(rc));
        rt_member_stop(m);
        return rc;
    }
    TD_LOG_INFO("router: membership: instances announce themselves at %s (listening on %s); "
                "lease %d ms; the YAML's instances %s",
                mc->address, bound, mc->lease_ms,
                mc->seed ? "are the initial set" : "are templates only");
    *out = m;
    return 0;
}

void rt_member_stop(rt_member *m)
{
    if (!m) return;
    td_ctrl_server_destroy(m->srv);
    free(m);
}

int rt_member_fd(const rt_member *m)
{
    return m ? td_ctrl_server_fd(m->srv) : -1;
}

static int find(const rt_registry *g, bool pf, const char *name)
{
    const rt_inst *arr = pf ? g->pf : g->inst;
    int n = pf ? g->n_pf : g->n;
    for (int k = 0; k < n; k++)
        if (!arr[k].vacant && !strcmp(arr[k].name, name)) return k;
    return -1;
}

/* Does a request in the table name slot k (its decode side, or its prefill attempt)? */
static bool referenced(const rt_router *r, bool pf, int k)
{
    for (uint32_t i = 0; i < r->table.cap; i++) {
        const rt_req *q = r->table.slots[i];
        if (q && (pf ? q->pair.pinst : q->loop.inst) == k) return true;
    }
    return false;
}

/* A slot for a new instance: a vacant one nobody refers to, else the next one; -1: full. */
static int free_slot(const rt_router *r, bool pf)
{
    const rt_registry *g = &r->reg;
    const rt_inst *arr = pf ? g->pf : g->inst;
    int n = pf ? g->n_pf : g->n, cap = pf ? g->cap_pf : g->cap;
    for (int k = 0; k < n; k++)
        if (arr[k].vacant && !referenced(r, pf, k)) return k;
    return n < cap ? n : -1;
}

static int add(rt_router *r, const Td__Join *j, int64_t now, char *err, size_t cap)
{
    bool pf = j->role == TD__ROLE__ROLE_PREFILL;
    const td_cfg *cfg = r->cfg;
    int k = free_slot(r, pf);
    if (k < 0) {
        snprintf(err, cap, "no room for another %s instance (router.membership.max_instances %d)",
                 pf ? "prefill" : "decode", cfg->router.membership.max_instances);
        return TD_ENOSPC;
    }
    /* the settings of the YAML instance it was started from; the role's first otherwise (a
       node started from another revision of the file) */
    const td_cfg_decode *dt = td_cfg_find_decode(cfg, j->template_name);
    const td_cfg_prefill *pt = td_cfg_find_prefill(cfg, j->template_name);
    if (pf ? !pt : !dt)
        TD_LOG_WARN("router: %s instance %s names template '%s', which this router's YAML does "
                    "not have: settings of its first %s instance",
                    pf ? "prefill" : "decode", j->name, j->template_name ? j->template_name : "",
                    pf ? "prefill" : "decode");
    td_cfg_decode dc = dt ? *dt : cfg->decode[0];
    td_cfg_prefill pc = pf ? (pt ? *pt : cfg->prefill[0]) : (td_cfg_prefill){0};
    if (j->tp) dc.tp = (int)j->tp;
    if (j->max_batch) dc.max_batch = (int)j->max_batch;
    if (j->pp) pc.pp = (int)j->pp;
    if (j->max_queue) pc.max_queue = (int)j->max_queue;
    int rc = rt_reg_put(&r->reg, pf, k, j->name, j->url, &dc, &pc);
    if (rc) {
        snprintf(err, cap, "cannot add it: %s", td_strerror(rc));
        return rc;
    }
    rt_inst *s = pf ? &r->reg.pf[k] : &r->reg.inst[k];
    s->last_join_ms = now;
    s->draining = s->left = j->leaving;
    TD_LOG_INFO("router: %s instance %s joined at %s (template %s, %s %d)",
                pf ? "prefill" : "decode", s->name, s->url,
                j->template_name && *j->template_name ? j->template_name : "-", pf ? "pp" : "tp",
                pf ? pc.pp : dc.tp);
    return 0;
}

static int on_join(rt_router *r, const Td__Join *j, int64_t now, char *err, size_t cap)
{
    bool pf = j->role == TD__ROLE__ROLE_PREFILL;
    if (!td_cfg_name_ok(j->name)) {
        snprintf(err, cap, "'%.80s' is not an instance name ([A-Za-z0-9_.-], 1..%d bytes)", j->name,
                 TD_CFG_NAME_MAX);
        return TD_EINVAL;
    }
    if (strncmp(j->url, "tcp://", 6) && strncmp(j->url, "tls+tcp://", 10) &&
        strncmp(j->url, "ipc://", 6)) {
        snprintf(err, cap, "url '%.100s' is not tcp://HOST:PORT or ipc://PATH", j->url);
        return TD_EINVAL;
    }
    if (pf && r->reg.cap_pf == 0) {
        snprintf(err, cap,
                 "this cluster has no prefill instances (colocated: its YAML lists none)");
        return TD_EINVAL;
    }
    if (find(&r->reg, !pf, j->name) >= 0) {
        snprintf(err, cap, "the name %s is taken by a %s instance", j->name,
                 pf ? "decode" : "prefill");
        return TD_EINVAL;
    }
    int k = find(&r->reg, pf, j->name);
    if (k < 0) return add(r, j, now, err, cap);
    rt_inst *s = pf ? &r->reg.pf[k] : &r->reg.inst[k];
    s->last_join_ms = now;
    if (j->leaving && !s->draining)
        TD_LOG_INFO("router: %s instance %s is leaving: no new requests go to it",
                    pf ? "prefill" : "decode", s->name);
    if (j->leaving) s->draining = true;
    s->left = j->leaving;
    if (strcmp(s->url, j->url)) {
        char why[200];
        snprintf(why, sizeof why, "%s instance %s moved to %s", pf ? "prefill" : "decode", s->name,
                 j->url);
        TD_LOG_WARN("router: %s instance %s moved from %s to %s: its requests move on",
                    pf ? "prefill" : "decode", s->name, s->url, j->url);
        rt_loop_inst_lost(r, pf, k, why, now);
    } else if (s->c) {
        return 0;
    }
    /* a new address, or one that could not be dialled before (no client: nothing held) */
    int rc = rt_reg_readdress(s, j->url);
    if (rc) {
        snprintf(err, cap, "cannot dial %s: %s", j->url, td_strerror(rc));
        return rc;
    }
    return 0;
}

/* Joined instances that are dead and either said they were leaving or have not announced
 * themselves for lease_ms: forgotten, once no request refers to them. */
static void expire(rt_router *r, int64_t now)
{
    int lease = r->cfg->router.membership.lease_ms;
    for (int pf = 0; pf < 2; pf++) {
        rt_inst *arr = pf ? r->reg.pf : r->reg.inst;
        int n = pf ? r->reg.n_pf : r->reg.n;
        for (int k = 0; k < n; k++) {
            rt_inst *s = &arr[k];
            if (!s->joined || s->vacant || s->alive) continue;
            bool silent = now - s->last_join_ms > lease;
            if (!(silent || (s->draining && s->ever_seen)) || referenced(r, pf, k)) continue;
            TD_LOG_INFO("router: %s instance %s (%s) forgotten: %s", pf ? "prefill" : "decode",
                        s->name, s->url,
                        s->draining ? "it left" : "dead and no announcement within the lease");
            rt_reg_vacate(s);
        }
    }
}

void rt_member_poll(rt_router *r, rt_member *m, int64_t now)
{
    if (!m) return;
    while (td_ctrl_server_recv(m->srv, &m->in, 0) == 0) {
        if (m->in.kind != TD_CTRL_IN_REQUEST) continue; /* a node went away: nothing to cancel */
        const Td__Envelope *env = m->in.env;
        if (env->body_case != TD__ENVELOPE__BODY_JOIN) {
            td_ctrl_server_reply_error(m->srv, m->in.req, 0, TD__ERROR_CODE__ERR_UNSUPPORTED,
                                       "the router's membership socket takes Join only, not %s",
                                       td_ctrl_body_name(env->body_case));
            continue;
        }
        char err[300] = "";
        if (on_join(r, env->join, now, err, sizeof err)) {
            /* a refused node announces itself again every lease / 4: one line a second at
               most, whatever the number of such nodes (each logs its own refusal once) */
            if (now - m->last_refusal_log_ms >= REFUSAL_LOG_MS) {
                TD_LOG_WARN("router: membership: Join of %.80s refused: %s", env->join->name, err);
                m->last_refusal_log_ms = now;
            }
            td_ctrl_server_reply_error(m->srv, m->in.req, 0, TD__ERROR_CODE__ERR_INVALID, "%s",
                                       err);
        } else {
            td_ctrl_server_reply_ack(m->srv, m->in.req, 0);
        }
    }
    expire(r, now);
}
