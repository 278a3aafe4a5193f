/* rt_metrics_inst.c: the instances in the router's metrics, as the loop publishes them: the
 * gauges of each decode and prefill instance (rt_metrics.inst, .pf, with their compute facts
 * and cache-aware routing figures), and each decode instance's counts summed across its
 * restarts (rt_metrics.tally). The only writer of those fields; the vLLM-named series
 * (rt_metrics_vllm.c) and the cache-aware ones (rt_metrics_cache.c) read them.
 * Series: per decode instance tandem_instance_{up,running,waiting,kv_blocks_used,
 * kv_blocks_free,kv_usage_ratio}; per prefill instance tandem_prefill_instance_{up,
 * queued_prompt_tokens,running,waiting,requests}; per decode and prefill instance that
 * reported tandem_instance_compute_info, tandem_instance_blas_core_older_than_cpu,
 * tandem_instance_products_info (label role). Also GET /instances.
 * Threading: rt_metrics_publish_* and the renders run with m->mu held by the caller;
 * rt_metrics_instances_json takes it. */
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "rt_metrics.h"
#include "td_err.h"

int rt_metrics_inst_init(rt_metrics *m, int n_inst, int n_pf)
{
    size_t ni = (size_t)(n_inst > 0 ? n_inst : 1), np = (size_t)(n_pf > 0 ? n_pf : 1);
    m->inst = calloc(ni, sizeof *m->inst);
    m->tally = calloc(ni, sizeof *m->tally);
    m->pf = calloc(np, sizeof *m->pf);
    if (!m->inst || !m->tally || !m->pf) return TD_ENOMEM;
    m->n_inst = n_inst;
    m->n_pf = n_pf;
    return 0;
}

void rt_metrics_inst_fini(rt_metrics *m)
{
    free(m->inst);
    free(m->tally);
    free(m->pf);
    m->inst = NULL;
    m->tally = NULL;
    m->pf = NULL;
    m->n_inst = m->n_pf = 0;
}

/* Add what the n counters cur gained since last (from 0 after a restart: one went back, or
 * the instance's boot id changed) to total. */
static void accumulate(uint64_t *total, uint64_t *last, const uint64_t *cur, int n, bool restarted)
{
    for (int k = 0; k < n; k++) {
        if (restarted) last[k] = 0;
        total[k] += cur[k] >= last[k] ? cur[k] - last[k] : cur[k];
        last[k] = cur[k];
    }
}

void rt_metrics_publish_inst(rt_metrics *m, int i, const rt_inst_gauge *g)
{
    if (i < 0 || i >= m->n_inst) return;
    rt_inst_tally *t = &m->tally[i];
    if (strcmp(m->inst[i].name, g->name)) /* another instance in the slot: counts from 0 */
        memset(t, 0, sizeof *t);
    bool restarted = g->boot_id && t->boot && g->boot_id != t->boot;
    if (g->boot_id) t->boot = g->boot_id;
    accumulate(&t->total.preempt, &t->last.preempt, &g->preemptions, 1, restarted);
    accumulate(t->total.pc, t->last.pc, g->pc, RT_PC_N, restarted);
    accumulate(t->total.steps, t->last.steps, g->steps, RT_STEP_N, restarted);
    accumulate(t->total.spec, t->last.spec, g->spec, RT_SPEC_N, restarted);
    accumulate(t->total.share, t->last.share, g->share, RT_SHARE_N, restarted);
    m->inst[i] = *g;
}

void rt_metrics_publish_pf(rt_metrics *m, int j, const rt_pf_gauge *g)
{
    if (j >= 0 && j < m->n_pf) m->pf[j] = *g;
}

static const rt_labels *inst_label(rt_labels *l, const char *name)
{
    rt_labels_reset(l);
    rt_labels_add(l, "instance", name);
    return l;
}

void rt_metrics_inst_render_decode(rt_mw *w, const rt_metrics *m)
{
    static const char *const names[] = {"tandem_instance_up",
                                        "tandem_instance_running",
                                        "tandem_instance_waiting",
                                        "tandem_instance_kv_blocks_used",
                                        "tandem_instance_kv_blocks_free",
                                        "tandem_instance_kv_usage_ratio"};
    static const char *const helps[] = {"1 when the decode instance is alive and ready.",
                                        "Requests in the instance's batch.",
                                        "Requests admitted by the instance but waiting.",
                                        "KV blocks in use.",
                                        "KV blocks free.",
                                        "Fraction of the KV pool in use."};
    rt_labels l;
    for (int k = 0; k < 6; k++) {
        rt_mw_family(w, names[k], RT_MT_GAUGE, helps[k]);
        for (int i = 0; i < m->n_inst; i++) {
            if (!m->inst[i].name[0]) continue;
            const rt_inst_gauge *g = &m->inst[i];
            double v = k == 0   ? g->alive
                       : k == 1 ? g->running
                       : k == 2 ? g->waiting
                       : k == 3 ? g->kv_used
                       : k == 4 ? g->kv_free
                       : g->kv_used + g->kv_free
                           ? (double)g->kv_used / (double)(g->kv_used + g->kv_free)
                           : 0.0;
            rt_mw_real(w, inst_label(&l, g->name), v, 6);
        }
    }
}

void rt_metrics_inst_render_prefill(rt_mw *w, const rt_metrics *m)
{
    static const char *const names[] = {
        "tandem_prefill_instance_up", "tandem_prefill_instance_queued_prompt_tokens",
        "tandem_prefill_instance_running", "tandem_prefill_instance_waiting",
        "tandem_prefill_instance_requests"};
    static const char *const helps[] = {
        "1 when the prefill instance is alive and ready (all stages joined).",
        "Prompt tokens queued or being prefilled on the instance.",
        "Requests the instance is prefilling.", "Requests waiting at the instance's stage 0.",
        "The router's attempts on the instance not yet done."};
    rt_labels l;
    for (int k = 0; k < 5; k++) {
        rt_mw_family(w, names[k], RT_MT_GAUGE, helps[k]);
        for (int j = 0; j < m->n_pf; j++) {
            if (!m->pf[j].name[0]) continue;
            const rt_pf_gauge *g = &m->pf[j];
            double v = k == 0   ? g->alive
                       : k == 1 ? (double)g->queued_tokens
                       : k == 2 ? (double)g->running
                       : k == 3 ? (double)g->waiting
                                : (double)g->active;
            rt_mw_real(w, inst_label(&l, g->name), v, 6);
        }
    }
}

/* What each decode and prefill instance computes with, as its last Health said (instances
 * that have not reported yet: no series): two info series (value 1, the facts in the labels)
 * and whether its OpenBLAS core is older than its CPU. */
void rt_metrics_inst_render_compute(rt_mw *w, const rt_metrics *m)
{
    static const char *const names[3] = {"tandem_instance_compute_info",
                                         "tandem_instance_blas_core_older_than_cpu",
                                         "tandem_instance_products_info"};
    static const char *const helps[3] = {
        "What the instance computes with (decode: rank 0, prefill: stage 0): the backend, and "
        "the CPU backend's activation mode, CPU and kernel instruction sets and OpenBLAS core "
        "(empty for other backends). Always 1.",
        "1 when the instance's OpenBLAS core is older than its CPU: its float32 GEMM (prefill "
        "rows) runs at a fraction of the CPU's speed.",
        "The kernels of the instance's products by weight type (batch rows, solo rows; the CPU "
        "backend's). Always 1."};
    rt_labels l;
    for (int f = 0; f < 3; f++) {
        rt_mw_family(w, names[f], RT_MT_GAUGE, helps[f]);
        for (int k = 0; k < m->n_inst + m->n_pf; k++) {
            const bool dec = k < m->n_inst;
            const rt_compute *c = dec ? &m->inst[k].compute : &m->pf[k - m->n_inst].compute;
            const char *name = dec ? m->inst[k].name : m->pf[k - m->n_inst].name;
            if (!c->seen || !name[0]) continue;
            inst_label(&l, name);
            rt_labels_add(&l, "role", dec ? "decode" : "prefill");
            if (f == 0) {
                rt_labels_add(&l, "backend", c->backend);
                rt_labels_add(&l, "act", c->act);
                rt_labels_add(&l, "cpu_isa", c->cpu_isa);
                rt_labels_add(&l, "kernels_isa", c->kernels_isa);
                rt_labels_add(&l, "blas_core", c->blas_core);
            } else if (f == 2) {
                rt_labels_add(&l, "paths", c->paths);
            }
            rt_mw_int(w, &l, f == 1 && !c->blas_older ? 0 : 1);
        }
    }
}

char *rt_metrics_instances_json(rt_metrics *m)
{
    json_t *dec = json_array(), *pf = json_array();
    pthread_mutex_lock(&m->mu);
    for (int i = 0; dec && i < m->n_inst; i++) {
        const rt_inst_gauge *g = &m->inst[i];
        if (!g->name[0]) continue;
        json_array_append_new(
            dec, json_pack("{s:s, s:s, s:b, s:b, s:b, s:I, s:I, s:I, s:I}", "name", g->name, "url",
                           g->url, "alive", g->alive, "draining", g->draining, "joined", g->joined,
                           "running", (json_int_t)g->running, "waiting", (json_int_t)g->waiting,
                           "kv_blocks_used", (json_int_t)g->kv_used, "kv_blocks_free",
                           (json_int_t)g->kv_free));
    }
    for (int j = 0; pf && j < m->n_pf; j++) {
        const rt_pf_gauge *g = &m->pf[j];
        if (!g->name[0]) continue;
        json_array_append_new(
            pf, json_pack("{s:s, s:s, s:b, s:b, s:b, s:I, s:I, s:I}", "name", g->name, "url",
                          g->url, "alive", g->alive, "draining", g->draining, "joined", g->joined,
                          "running", (json_int_t)g->running, "waiting", (json_int_t)g->waiting,
                          "queued_prompt_tokens", (json_int_t)g->queued_tokens));
    }
    pthread_mutex_unlock(&m->mu);
    json_t *root = dec && pf ? json_pack("{s:o, s:o}", "decode", dec, "prefill", pf) : NULL;
    if (!root) {
        json_decref(dec);
        json_decref(pf);
        return NULL;
    }
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}
