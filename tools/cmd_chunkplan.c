/* cmd_chunkplan.c: `tandem chunk-plan`: profile one pipeline stage on the engine, fit the
 * dynamic-chunking cost model (prefill-node/pf_chunk.h), print the fixed and dynamic chunk
 * plans of a prompt with their predicted per-chunk stage times, then run both plans
 * through the stage and time every chunk (the real check of the model: dynamic chunks
 * should take nearly equal times, fixed ones grow along the prompt).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "pf_chunk.h"
#include "pf_profile.h"
#include "td_err.h"
#include "td_stats.h"

typedef struct {
    const char *name;
    int32_t *chunks; /* (n) */
    int64_t n;
    double *pred;  /* (n) predicted ms */
    double *meas;  /* (n) measured ms (median over runs) */
    double **runs; /* (reps) per-run timings, each (n) */
} plan;

static void plan_free(plan *p, int reps)
{
    for (int r = 0; p->runs && r < reps; r++)
        free(p->runs[r]);
    free(p->runs);
    free(p->chunks);
    free(p->pred);
    free(p->meas);
}

static int plan_make(plan *p, const char *name, const pf_cost_model *m, const pf_chunk_params *cp,
                     int64_t n_tokens, int reps)
{
    memset(p, 0, sizeof *p);
    p->name = name;
    int64_t cap = pf_plan_max_chunks(cp, n_tokens);
    p->chunks = malloc((size_t)cap * sizeof *p->chunks);
    p->pred = malloc((size_t)cap * sizeof *p->pred);
    p->meas = calloc((size_t)cap, sizeof *p->meas);
    p->runs = calloc((size_t)reps, sizeof *p->runs);
    if (!p->chunks || !p->pred || !p->meas || !p->runs) return TD_ENOMEM;
    for (int r = 0; r < reps; r++)
        if (!(p->runs[r] = calloc((size_t)cap, sizeof **p->runs))) return TD_ENOMEM;
    int rc = pf_plan_chunks(m, cp, n_tokens, p->chunks, cap, &p->n);
    int64_t done = 0;
    for (int64_t k = 0; k < p->n && !rc; k++) {
        p->pred[k] = m->valid ? pf_cost_chunk(m, done, p->chunks[k]) : 0;
        done += p->chunks[k];
    }
    return rc;
}

/* max / min of v[0..n) (n >= 1), and the sum */
static void spread(const double *v, int64_t n, double *mx, double *mn, double *sum)
{
    *mx = *mn = v[0];
    *sum = 0;
    for (int64_t i = 0; i < n; i++) {
        if (v[i] > *mx) *mx = v[i];
        if (v[i] < *mn) *mn = v[i];
        *sum += v[i];
    }
}

static void print_plan(const plan *p, bool measured)
{
    printf("\n%s plan: %lld chunks\n", p->name, (long long)p->n);
    printf("  %5s %7s %6s %12s", "chunk", "start", "size", "predicted_ms");
    if (measured) printf(" %11s", "measured_ms");
    printf("\n");
    int64_t done = 0;
    for (int64_t k = 0; k < p->n; k++) {
        printf("  %5lld %7lld %6d %12.2f", (long long)k, (long long)done, p->chunks[k], p->pred[k]);
        if (measured) printf(" %11.2f", p->meas[k]);
        printf("\n");
        done += p->chunks[k];
    }
    /* the final chunk is whatever remains of the prompt: left out of the spread */
    int64_t m = p->n > 1 ? p->n - 1 : p->n;
    double mx, mn, sum, tot;
    spread(p->pred, p->n, &mx, &mn, &tot);
    spread(p->pred, m, &mx, &mn, &sum);
    printf("  predicted: max/min %.3f (chunks 0..%lld), total %.1f ms\n", mn > 0 ? mx / mn : 0,
           (long long)(m - 1), tot);
    if (measured) {
        spread(p->meas, p->n, &mx, &mn, &tot);
        spread(p->meas, m, &mx, &mn, &sum);
        printf("  measured : max/min %.3f (chunks 0..%lld), max %.1f min %.1f ms, total %.1f ms\n",
               mn > 0 ? mx / mn : 0, (long long)(m - 1), mx, mn, tot);
    }
}

static void usage(void)
{
    fprintf(stderr,
            "usage: tandem chunk-plan --model PATH [--pp N --stage S] [--chunk C] [--smooth S]\n"
            "         [--prompt-tokens L] [--threads N] [--budget-ms MS] [--block-size B]\n"
            "         [--lengths N] [--profile-reps N] [--plan-reps N] [--no-run]\n"
            "  profiles stage S of a pp-stage split (layers: equal, extras to later stages) on\n"
            "  single-request prefills up to 1.25 C tokens, fits f(l) = a l^2 + b l + c, prints\n"
            "  the fixed and dynamic chunk plans of an L-token prompt with predicted times, and\n"
            "  (unless --no-run) runs both plans through the stage, timing each chunk.\n"
            "  defaults: pp 1, stage 0, chunk 512, smooth 0.75, prompt 8192, threads 1,\n"
            "  budget 20000 ms, block size 16, 16 lengths, 3 profile reps, 1 plan rep\n");
}

/* The command line. */
typedef struct {
    pf_shard_params rp;
    pf_profile_params pp;
    float smooth;
    int prompt, plan_reps;
    bool run;
} chunkplan_opts;

/* Returns 0, 1 (--help: done) or a negative td_err (printed). */
static int chunkplan_parse_args(int argc, char **argv, chunkplan_opts *o)
{
    *o = (chunkplan_opts){
        .rp = {.pp = 1, .threads = 1, .kv_type = TD_F16, .block_size = 16},
        .pp = {.chunk_size = 512, .budget_ms = 20000, .reps = 3, .n_lengths = 16},
        .smooth = 0.75f,
        .prompt = 8192,
        .plan_reps = 1,
        .run = true,
    };
    pf_shard_params *rp = &o->rp;
    pf_profile_params *pp = &o->pp;
    int rc = 0;
    for (int i = 0; i < argc && !rc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(f, "--no-run")) {
            o->run = false;
            continue;
        }
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
            usage();
            return 1;
        }
        if (!strcmp(f, "--model"))
            rp->model_path = v;
        else if (!strcmp(f, "--pp"))
            rc = cli_parse_int(f, v, 1, PF_MAX_STAGES, &rp->pp);
        else if (!strcmp(f, "--stage"))
            rc = cli_parse_int(f, v, 0, PF_MAX_STAGES - 1, &rp->stage);
        else if (!strcmp(f, "--chunk"))
            rc = cli_parse_int(f, v, 1, 1 << 20, &pp->chunk_size);
        else if (!strcmp(f, "--smooth"))
            rc = cli_parse_float(f, v, &o->smooth);
        else if (!strcmp(f, "--prompt-tokens"))
            rc = cli_parse_int(f, v, 1, 1 << 22, &o->prompt);
        else if (!strcmp(f, "--threads"))
            rc = cli_parse_int(f, v, 1, 256, &rp->threads);
        else if (!strcmp(f, "--budget-ms"))
            rc = cli_parse_int(f, v, 1, 3600000, &pp->budget_ms);
        else if (!strcmp(f, "--block-size"))
            rc = cli_parse_int(f, v, 1, 4096, &rp->block_size);
        else if (!strcmp(f, "--lengths"))
            rc = cli_parse_int(f, v, 3, PF_PROFILE_MAX_LENGTHS, &pp->n_lengths);
        else if (!strcmp(f, "--profile-reps"))
            rc = cli_parse_int(f, v, 1, 16, &pp->reps);
        else if (!strcmp(f, "--plan-reps"))
            rc = cli_parse_int(f, v, 1, 16, &o->plan_reps);
        else {
            usage();
            return TD_EINVAL;
        }
        if (!v) {
            fprintf(stderr, "tandem: %s needs a value\n", f);
            return TD_EINVAL;
        }
        i++;
    }
    if (rc) return rc;
    if (!rp->model_path) {
        fprintf(stderr, "tandem: chunk-plan needs --model\n");
        return TD_EINVAL;
    }
    if (!(o->smooth >= 0 && o->smooth <= 1)) {
        fprintf(stderr, "tandem: --smooth needs a number in [0, 1]\n");
        return TD_EINVAL;
    }
    if (rp->stage >= rp->pp) {
        fprintf(stderr, "tandem: --stage %d needs --pp > %d\n", rp->stage, rp->stage);
        return TD_EINVAL;
    }
    return 0;
}

/* The profile's table and the fitted cost model. */
static void print_profile(const chunkplan_opts *o, const pf_profile_result *pr)
{
    const pf_cost_model *m = &pr->fit;
    printf("profile: %d lengths in [%d, %d], %.0f ms%s\n", pr->n_lengths,
           pr->n_lengths ? pr->len[0] : 0, pr->n_lengths ? pr->len[pr->n_lengths - 1] : 0,
           pr->elapsed_ms, pr->budget_hit ? " (budget hit)" : "");
    printf("  %6s %10s %10s %4s\n", "length", "median_ms", "fit_ms", "runs");
    for (int i = 0; i < pr->n_lengths; i++)
        printf("  %6d %10.3f %10.3f %4d\n", pr->len[i], pr->ms[i],
               m->valid ? pf_cost_eval(m, pr->len[i]) : 0.0, pr->n_runs[i]);
    printf("fit: f(l) = a l^2 + b l + c (ms): a = %.6e, b = %.6e (fitted %.6e), c = %.4f, "
           "R^2 = %.5f\n",
           m->a, m->b, m->b_fit, m->c, m->r2);
    if (!m->valid)
        printf("fit failed: dynamic chunking falls back to fixed chunks\n");
    else if (!m->dynamic)
        printf("fit is not convex (a <= 0): dynamic chunking falls back to fixed chunks\n");
    else
        printf("T = f(C) - f(0) = %.2f ms for C = %d; predicted f(%d) = %.1f ms\n",
               pf_cost_chunk(m, 0, o->pp.chunk_size), o->pp.chunk_size, o->prompt,
               pf_cost_eval(m, o->prompt));
}

/* The fixed and the dynamic plan of the prompt: made, run through the stage (unless
 * --no-run, alternating so that drift hits both) and printed. */
static int run_plans(const chunkplan_opts *o, pf_shard *rig, const pf_cost_model *m)
{
    int reps = o->plan_reps;
    pf_chunk_params fixed = {.chunk_size = o->pp.chunk_size, .page_size = o->rp.block_size};
    pf_chunk_params dyn = fixed;
    dyn.dynamic = true;
    dyn.smooth = o->smooth;
    plan plans[2];
    memset(plans, 0, sizeof plans);
    int rc = plan_make(&plans[0], "fixed", m, &fixed, o->prompt, reps);
    char dname[64];
    snprintf(dname, sizeof dname, "dynamic (s = %.2f)", o->smooth);
    if (!rc) rc = plan_make(&plans[1], dname, m, &dyn, o->prompt, reps);
    for (int r = 0; r < reps && o->run && !rc; r++)
        for (int k = 0; k < 2 && !rc; k++)
            rc = pf_profile_run_plan(rig, plans[k].chunks, plans[k].n, 5, plans[k].runs[r]);
    if (rc) {
        fprintf(stderr, "tandem: chunk-plan failed: %s\n", td_strerror(rc));
    } else {
        double col[16];
        for (int k = 0; k < 2; k++) {
            for (int64_t c = 0; c < plans[k].n && o->run; c++) {
                for (int r = 0; r < reps; r++)
                    col[r] = plans[k].runs[r][c];
                plans[k].meas[c] = td_stats_median(col, (size_t)reps);
            }
            print_plan(&plans[k], o->run);
        }
    }
    for (int k = 0; k < 2; k++)
        plan_free(&plans[k], reps);
    return rc;
}

int cmd_chunk_plan(int argc, char **argv)
{
    chunkplan_opts o;
    int rc = chunkplan_parse_args(argc, argv, &o);
    if (rc) return rc > 0 ? 0 : rc;
    int hi = o.pp.chunk_size + o.pp.chunk_size / 4;
    o.rp.ctx = o.prompt > hi ? o.prompt : hi;
    pf_shard rig;
    if ((rc = pf_shard_open(&rig, &o.rp))) {
        fprintf(stderr, "tandem: cannot set up stage %d of '%s': %s\n", o.rp.stage, o.rp.model_path,
                td_strerror(rc));
        return rc;
    }
    char be[160];
    rig.rt.be.ops->describe(rig.rt.be.ctx, be, sizeof be);
    printf("model %s, stage %d of %d: layers [%d, %d), %s\n", o.rp.model_path, rig.stage, rig.pp,
           rig.l0, rig.l1, be);
    pf_profile_result pr;
    if ((rc = pf_profile_stage(&rig, &o.pp, &pr))) {
        fprintf(stderr, "tandem: profile failed: %s\n", td_strerror(rc));
        pf_shard_close(&rig);
        return rc;
    }
    print_profile(&o, &pr);
    rc = run_plans(&o, &rig, &pr.fit);
    pf_shard_close(&rig);
    return rc;
}
