/* pf_chunking.c: stage 0's chunk planner set-up at start: fixed chunks, or dynamic chunking
 * over the stage profile, loaded from the profile cache (pf_pcache.h) or measured on the
 * stage's shard (pf_profile.h) and stored, fitted robustly and then refitted online from the
 * chunks served (pf_tune.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pf_int.h"
#include "pf_pcache.h"
#include "td_clock.h"
#include "td_err.h"

/* The stage profile: loaded from the cache (pf_pcache.h) unless --reprofile, else
 * measured and stored. Fills res; returns 0, TD_ESTATE if *stop ended the measurement,
 * or another td_err from the profile. Cache trouble is only ever a warning. */
static int get_profile(pf_stage *st, const pf_profile_params *pp, pf_profile_result *res)
{
    const char *inst = st->p->instance;
    char dir[2048], path[2200], why[512] = "";
    pf_pcache_key key;
    int krc = pf_pcache_key_make(&st->shard, st->p->cfg->model, pp, &key);
    int drc = krc ? krc : pf_pcache_dir(dir, sizeof dir);
    if (!drc) drc = pf_pcache_path(dir, &key, path, sizeof path);
    if (drc)
        TD_LOG_WARN("prefill %s: no profile cache (%s): the profile is measured every start", inst,
                    krc                ? td_strerror(krc)
                    : drc == TD_ENOENT ? "neither TANDEM_CACHE nor HOME is set"
                                       : td_strerror(drc));
    int64_t t0 = td_now_ms();
    const char *reason = st->p->reprofile ? "--reprofile" : "no cached profile";
    if (!drc && !st->p->reprofile) {
        int rc = pf_pcache_load(path, &key, res, why, sizeof why);
        if (!rc) {
            TD_LOG_INFO("prefill %s: stage profile loaded from the cache in %lld ms (%s; %d "
                        "lengths, measured in %.0f ms); --reprofile measures it again",
                        inst, (long long)(td_now_ms() - t0), path, res->n_lengths, res->elapsed_ms);
            return 0;
        }
        if (rc != TD_ENOENT) {
            TD_LOG_WARN("prefill %s: ignoring the cached profile %s: %s", inst, path,
                        why[0] ? why : td_strerror(rc));
            reason = "the cached one is unusable";
        }
    }
    pf_profile_params p = pf_profile_resolve(pp);
    TD_LOG_INFO("prefill %s: measuring the stage profile (%s): %d lengths up to %d tokens, "
                "at most ~%d ms",
                inst, reason, p.n_lengths, p.max_len, p.budget_ms);
    if (st->p->profiling) *st->p->profiling = 1;
    int rc = pf_profile_stage(&st->shard, pp, res);
    if (st->p->profiling) *st->p->profiling = 0;
    if (rc == TD_ESTATE && res->stopped) {
        TD_LOG_INFO("prefill %s: stopped while profiling (after %lld ms)", inst,
                    (long long)(td_now_ms() - t0));
        return rc;
    }
    if (rc) return rc;
    TD_LOG_INFO("prefill %s: stage profile measured in %lld ms (%d lengths%s)", inst,
                (long long)(td_now_ms() - t0), res->n_lengths,
                res->budget_hit ? ", cut short by profile_budget_ms" : "");
    if (drc) return 0;
    int src = pf_pcache_store(path, &key, res, why, sizeof why);
    if (src)
        TD_LOG_WARN("prefill %s: cannot cache the stage profile: %s", inst,
                    why[0] ? why : td_strerror(src));
    else
        TD_LOG_INFO("prefill %s: stage profile cached in %s", inst, path);
    return 0;
}

/* TANDEM_PF_ONLINE_REFIT=1 turns the online refit on; unset or 0 keeps the start-up fit
 * only. Off by default: measured at pp 2 on a 6K prompt (BENCHMARKS.md, "Prefill chunk
 * planner"), the refit's fit took in stage 0's waits as a per-chunk constant that the
 * equal-cost planner ignores, and its plans were 1.3-1.7x slower than the start-up fit's;
 * it stays until the planner weighs that constant. Another value is an error. */
static int online_refit_env(const char *inst, bool *on)
{
    const char *e = getenv("TANDEM_PF_ONLINE_REFIT");
    *on = false;
    if (!e || !strcmp(e, "0")) return 0;
    if (!strcmp(e, "1")) {
        *on = true;
        TD_LOG_INFO("prefill %s: TANDEM_PF_ONLINE_REFIT=1: the cost model is refitted online "
                    "from the chunks' stage times",
                    inst);
        return 0;
    }
    TD_LOG_ERR("prefill %s: TANDEM_PF_ONLINE_REFIT is '%s': expected 0 or 1", inst, e);
    return TD_EINVAL;
}

/* chunk_size left out of the YAML and no usable model: fixed chunks of PF_TUNE_AUTO_FIXED */
static int fixed_size(const pf_stage *st)
{
    if (st->cfg->chunk_size > 0 || st->chunk_max < PF_TUNE_AUTO_FIXED) return st->chunk_max;
    return PF_TUNE_AUTO_FIXED;
}

int pf_chunking_initial(const pf_stage *st, const pf_tune *tune, const pf_chunk_params *chunking,
                        uint64_t request_id, int64_t n_cached, int64_t n_prompt)
{
    if (st->cfg->chunk_size > 0 || !chunking->dynamic || n_prompt - n_cached < 1)
        return chunking->chunk_size;
    int align = pf_chunk_align(chunking);
    int c = pf_tune_initial_chunk(tune, n_prompt - n_cached, st->pp, align, st->chunk_max);
    TD_LOG_INFO("prefill %s: request %llu: %lld tokens (%lld cached), pp %d: initial chunk %d "
                "(%s, chunk constant %.3g ms)",
                st->p->instance, (unsigned long long)request_id, (long long)n_prompt,
                (long long)n_cached, st->pp, c, tune->online ? "online refit" : "start-up fit",
                tune->online ? tune->c_online : tune->cur.c);
    return c;
}

int pf_chunking_setup(pf_stage *st, pf_tune *tune, pf_chunk_params *chunking)
{
    pf_cost_model none = {0}, *model = &none;
    pf_tune_init(tune, &none, NULL, NULL, 0, 0);
    bool refit = true;
    if (online_refit_env(st->p->instance, &refit)) return TD_EINVAL;
    *chunking = (pf_chunk_params){.chunk_size = fixed_size(st),
                                  .smooth = st->cfg->smooth_factor,
                                  .page_size = st->shard.kv->block_size,
                                  .max_batch_tokens = st->chunk_max,
                                  .dynamic = false};
    bool dynamic = st->cfg->dynamic_chunking && st->cfg->smooth_factor != 0;
    if (!dynamic || st->cfg->profile_budget_ms <= 0) {
        if (!dynamic)
            TD_LOG_INFO("prefill %s: fixed chunks of %d tokens", st->p->instance,
                        chunking->chunk_size);
        else
            TD_LOG_WARN("prefill %s: dynamic chunking without a profile (profile_budget_ms 0): "
                        "fixed chunks of %d tokens",
                        st->p->instance, chunking->chunk_size);
        if (st->p->reprofile)
            TD_LOG_INFO("prefill %s: --reprofile: nothing to profile with fixed chunks",
                        st->p->instance);
        return 0;
    }
    pf_profile_params pp = {
        .chunk_size = st->chunk_max, .budget_ms = st->cfg->profile_budget_ms, .stop = st->p->stop};
    int max_len = st->chunk_max + st->chunk_max / 4;
    if (max_len > st->shard.ctx) pp.max_len = st->shard.ctx;
    pf_profile_result res;
    int rc = get_profile(st, &pp, &res);
    if (rc == TD_ESTATE) return rc;
    double xs[PF_PROFILE_MAX_LENGTHS];
    int n_rej = 0;
    for (int i = 0; !rc && i < res.n_lengths; i++)
        xs[i] = res.len[i];
    if (!rc) pf_fit_robust(xs, res.ms, res.n_lengths, &res.fit, &n_rej); /* a cached one too */
    if (n_rej)
        TD_LOG_WARN("prefill %s: %d of %d profile lengths rejected as outliers (a busy moment?)",
                    st->p->instance, n_rej, res.n_lengths);
    if (rc || !res.fit.dynamic) {
        TD_LOG_WARN("prefill %s: the stage profile gave no usable cost model (%s; a=%g b=%g "
                    "over %d lengths): fixed chunks of %d tokens",
                    st->p->instance, rc ? td_strerror(rc) : "not convex", res.fit.a, res.fit.b_fit,
                    res.n_lengths, chunking->chunk_size);
        return 0;
    }
    pf_tune_init(tune, &res.fit, xs, res.ms, res.n_lengths, 0);
    tune->frozen = !refit;
    model = &tune->prior;
    chunking->dynamic = true;
    chunking->chunk_size = st->chunk_max;
    int64_t example = 8 * (int64_t)st->chunk_max < st->shard.ctx ? 8 * (int64_t)st->chunk_max
                                                                 : (int64_t)st->shard.ctx;
    int32_t plan[64];
    int64_t np = 0;
    if (pf_plan_chunks(model, chunking, example, plan, 64, &np)) np = 0;
    if (st->cfg->chunk_size == 0) {
        chunking->chunk_size =
            pf_tune_initial_chunk(tune, example, st->pp, pf_chunk_align(chunking), st->chunk_max);
        if (pf_plan_chunks(model, chunking, example, plan, 64, &np)) np = 0;
    }
    char sizes[200] = "";
    int off = 0;
    for (int64_t i = 0; i < np && off < (int)sizeof sizes - 16; i++)
        off += snprintf(sizes + off, sizeof sizes - (size_t)off, "%s%d", i ? "," : "", plan[i]);
    TD_LOG_INFO("prefill %s: dynamic chunking: f(l) = %.3g l^2 + %.3g l + %.3g ms (r2 %.4f, %d "
                "lengths), smoothing %.2f; initial chunk %s%d; a %lld-token prompt goes as [%s]; "
                "%s",
                st->p->instance, model->a, model->b, model->c, model->r2, res.n_lengths,
                st->cfg->smooth_factor, st->cfg->chunk_size ? "" : "chosen per request, e.g. ",
                chunking->chunk_size, (long long)example, sizes,
                refit ? "refitted online" : "no online refit");
    chunking->chunk_size = st->chunk_max;
    return 0;
}

void pf_chunking_observe(pf_stage *st, pf_tune *tune, const pf_seg *segs, int n_segs, double ms)
{
    int64_t L[PF_MAX_SEGS], x[PF_MAX_SEGS];
    if (!tune->prior.dynamic || tune->frozen || n_segs > PF_MAX_SEGS) return;
    for (int i = 0; i < n_segs; i++) {
        if (segs[i].flags & PF_SEG_DEAD) return;
        L[i] = segs[i].t0; /* a cached prefix is attended to like a computed one */
        x[i] = (int64_t)segs[i].t1 - segs[i].t0;
    }
    bool was = tune->online;
    if (pf_tune_observe(tune, L, x, n_segs, ms)) return;
    const pf_cost_model *m = pf_tune_model(tune);
    if (tune->online != was || tune->n_seen % 64 == 0)
        TD_LOG_INFO("prefill %s: cost model after %llu chunks: %s, f(l) = %.3g l^2 + %.3g l ms, "
                    "chunk constant %.3g ms (start-up a %.3g b %.3g; %llu refits refused)",
                    st->p->instance, (unsigned long long)tune->n_seen,
                    tune->online ? "online refit" : "start-up fit", m->a, m->b, tune->c_online,
                    tune->prior.a, tune->prior.b, (unsigned long long)tune->n_kept_prior);
}
