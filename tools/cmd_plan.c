/* cmd_plan.c: `tandem plan` (simulate a cluster, search the cheapest configuration that meets
 * TTFT/TPOT targets, or reproduce SGLang's chunked-PP figures) and `tandem calibrate`
 * (measure this machine into a hardware profile); the planner module does the work
 * (planner/pl_plan.h, pl_calib.h, docs/planner.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "pl_calib.h"
#include "pl_plan.h"
#include "td_err.h"

#ifndef PL_HW_DIR
#define PL_HW_DIR "deploy/hw"
#endif

static int plan_usage(void)
{
    fprintf(
        stderr,
        "usage: tandem plan --model M --hw H.yaml --ttft-ms T --tpot-ms T [workload] [--json]\n"
        "       tandem plan --model M --hw H.yaml --prefill NxPPxTP --decode NxTP [workload]\n"
        "       tandem plan --model M --hw H.yaml --colocated NxTP [workload]\n"
        "       tandem plan --reproduce [--hw H20.yaml] [--batch N] [--json]\n"
        "  M: a GGUF file or a named shape (llama3-8b, llama3-70b, qwen2.5-7b, deepseek-v3)\n"
        "  workload: --requests N (64) --rate R req/s (1; 0: all at once) --prompt L[:H]\n"
        "            (1024) --output L[:H] (128) --seed S\n"
        "            --sequential (one client: each request when the last one finished)\n"
        "  prefill: --chunk C (0: chosen per request as the prefill node does)\n"
        "           --chunk-max C (2048) --smooth S (0.75; 0 fixed chunks)\n"
        "  colocated (N decode instances of tp TP prefill their own prompts):\n"
        "           --step-tokens T (512: prompt tokens a step, decode[].step_tokens)\n"
        "  decode:  --ep (a mixture-of-experts model's experts whole on the tp ranks,\n"
        "           decode[].ep: a step waits for the rank with the most expert work)\n"
        "           --dp G (with a given shape of tp 1: each decode instance a data-parallel\n"
        "           attention group of G member instances, decode[].dp; the search tries\n"
        "           groups of 2 and 4 for a mixture-of-experts model without --ep)\n"
        "           --tbo N (two-batch overlap for decode steps of N requests or more at\n"
        "           tp >= 2, decode[].tbo_min_tokens)\n"
        "  search:  --max-instances N (4) --max-devices N (no cap: devices = prefill instances x\n"
        "           pp x tp + decode instances x tp) --max-batch B (256) --all (every "
        "configuration)\n"
        "           --max-prefill-tp N (1: Tandem's prefill node has no tensor parallelism)\n");
    return TD_EINVAL;
}

typedef struct {
    const char *model, *hw;
    pl_workload w;
    pl_search_params sp;
    bool json, all, reproduce, have_cfg, have_ttft, have_tpot, sequential;
    bool pf_flag; /* --chunk, --chunk-max or --smooth given (prefill instances only) */
    int batch;
    int dp; /* --dp: each decode instance a data-parallel attention group (given shapes only) */
    pl_cluster cfg;
    int cfg_parts;
} plan_opts;

/* "L" or "L:H" */
static int parse_range(const char *f, const char *v, int *lo, int *hi)
{
    char a[32];
    const char *colon = v ? strchr(v, ':') : NULL;
    if (!colon) {
        int rc = cli_parse_int(f, v, 1, 1 << 24, lo);
        *hi = *lo;
        return rc;
    }
    snprintf(a, sizeof a, "%.*s", (int)(colon - v), v);
    int rc = cli_parse_int(f, a, 1, 1 << 24, lo);
    if (!rc) rc = cli_parse_int(f, colon + 1, *lo, 1 << 24, hi);
    return rc;
}

/* "NxPPxTP" (3 numbers) or "NxTP" (2) */
static int parse_shape(const char *f, const char *v, int want, int *out)
{
    int n = v ? sscanf(v, "%dx%dx%d", &out[0], &out[1], &out[2]) : 0;
    for (int i = 0; i < n; i++)
        if (out[i] < 1 || out[i] > 64) n = 0;
    if (n != want) {
        fprintf(stderr, "tandem: %s '%s': expected %s\n", f, v ? v : "",
                want == 3 ? "NxPPxTP, e.g. 1x2x1" : "NxTP, e.g. 2x1");
        return TD_EINVAL;
    }
    return 0;
}

static int plan_flag(plan_opts *o, const char *f, const char *v)
{
    float x;
    int rc, s[3];
    if (!strcmp(f, "--chunk") || !strcmp(f, "--chunk-max") || !strcmp(f, "--smooth"))
        o->pf_flag = true;
    if (!strcmp(f, "--model"))
        o->model = v;
    else if (!strcmp(f, "--hw"))
        o->hw = v;
    else if (!strcmp(f, "--requests"))
        return cli_parse_int(f, v, 1, 1000000, &o->w.n_requests);
    else if (!strcmp(f, "--rate")) {
        if ((rc = cli_parse_float(f, v, &x)) || x < 0) return rc ? rc : plan_usage();
        o->w.rate = x;
    } else if (!strcmp(f, "--prompt"))
        return parse_range(f, v, &o->w.prompt_lo, &o->w.prompt_hi);
    else if (!strcmp(f, "--output"))
        return parse_range(f, v, &o->w.output_lo, &o->w.output_hi);
    else if (!strcmp(f, "--seed"))
        return cli_parse_u64(f, v, &o->w.seed);
    else if (!strcmp(f, "--ttft-ms") || !strcmp(f, "--tpot-ms")) {
        if ((rc = cli_parse_float(f, v, &x)) || !(x > 0)) return rc ? rc : plan_usage();
        bool t = !strcmp(f, "--ttft-ms");
        *(t ? &o->sp.ttft_ms : &o->sp.tpot_ms) = x;
        *(t ? &o->have_ttft : &o->have_tpot) = true;
    } else if (!strcmp(f, "--chunk"))
        return cli_parse_int(f, v, 0, 1 << 20, &o->sp.pf.chunk);
    else if (!strcmp(f, "--chunk-max"))
        return cli_parse_int(f, v, 1, 1 << 20, &o->sp.pf.chunk_max);
    else if (!strcmp(f, "--smooth")) {
        if ((rc = cli_parse_float(f, v, &x)) || x < 0 || x > 1) return rc ? rc : plan_usage();
        o->sp.pf.smooth = x;
    } else if (!strcmp(f, "--max-instances"))
        return cli_parse_int(f, v, 1, 16, &o->sp.max_instances);
    else if (!strcmp(f, "--max-devices"))
        return cli_parse_int(f, v, 1, 1 << 20, &o->sp.max_devices);
    else if (!strcmp(f, "--max-batch"))
        return cli_parse_int(f, v, 1, 65536, &o->sp.max_batch);
    else if (!strcmp(f, "--batch"))
        return cli_parse_int(f, v, 1, 16, &o->batch);
    else if (!strcmp(f, "--dp"))
        return cli_parse_int(f, v, 1, 64, &o->dp);
    else if (!strcmp(f, "--tbo"))
        return cli_parse_int(f, v, 1, 1 << 20, &o->sp.tbo_min);
    else if (!strcmp(f, "--prefill")) {
        if ((rc = parse_shape(f, v, 3, s))) return rc;
        o->cfg.n_prefill = s[0], o->cfg.pf.pp = s[1], o->cfg.pf.tp = s[2];
        o->cfg_parts |= 1;
    } else if (!strcmp(f, "--decode") || !strcmp(f, "--colocated")) {
        if ((rc = parse_shape(f, v, 2, s))) return rc;
        o->cfg.n_decode = s[0], o->cfg.dc.tp = s[1];
        o->cfg_parts |= !strcmp(f, "--decode") ? 2 : 4;
    } else if (!strcmp(f, "--step-tokens"))
        return cli_parse_int(f, v, 1, 1 << 20, &o->cfg.dc.step_tokens);
    else
        return plan_usage();
    return 0;
}

/* Returns 0, 1 (--help) or a td_err (printed). */
static int plan_parse(int argc, char **argv, plan_opts *o)
{
    *o = (plan_opts){.w = {.n_requests = 64,
                           .rate = 1,
                           .prompt_lo = 1024,
                           .prompt_hi = 1024,
                           .output_lo = 128,
                           .output_hi = 128},
                     .sp = {.pf = {.chunk_max = 2048, .smooth = 0.75}},
                     .batch = 8};
    for (int i = 0; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
            plan_usage();
            return 1;
        }
        bool *flag = !strcmp(f, "--json")         ? &o->json
                     : !strcmp(f, "--all")        ? &o->all
                     : !strcmp(f, "--reproduce")  ? &o->reproduce
                     : !strcmp(f, "--sequential") ? &o->sequential
                     : !strcmp(f, "--ep")         ? &o->sp.ep
                                                  : NULL;
        if (flag) {
            *flag = true;
            continue;
        }
        if (!v) {
            fprintf(stderr, "tandem: %s needs a value\n", f);
            return TD_EINVAL;
        }
        int rc = plan_flag(o, f, v);
        if (rc) return rc;
        i++;
    }
    if (o->reproduce) return 0;
    o->have_cfg = o->cfg_parts == 3 || o->cfg_parts == 4; /* colocated: no prefill */
    if (!o->model || !o->hw || (o->cfg_parts && !o->have_cfg) ||
        (!o->have_cfg && (!o->have_ttft || !o->have_tpot))) {
        fprintf(stderr, "tandem: plan needs --model and --hw, and either --ttft-ms and "
                        "--tpot-ms, both --prefill and --decode, or --colocated\n");
        return plan_usage();
    }
    if (o->pf_flag && o->cfg_parts == 4) {
        fprintf(stderr, "tandem: --chunk, --chunk-max and --smooth are a prefill instance's; "
                        "a colocated decode instance takes --step-tokens\n");
        return TD_EINVAL;
    }
    if (o->cfg.dc.step_tokens && o->cfg_parts != 4) {
        fprintf(stderr, "tandem: --step-tokens is for --colocated (the decode instance's prompt "
                        "chunks)\n");
        return TD_EINVAL;
    }
    if (o->sequential && !o->have_cfg) {
        fprintf(stderr, "tandem: --sequential simulates one configuration (--prefill and "
                        "--decode, or --colocated), not a search\n");
        return TD_EINVAL;
    }
    if (o->sp.tbo_min && o->have_cfg && (o->cfg.dc.tp < 2 || o->dp > 1)) {
        fprintf(stderr, "tandem: --tbo needs a decode shape of tp >= 2 without --dp\n");
        return TD_EINVAL;
    }
    if (o->dp > 1 && (!o->have_cfg || o->cfg.dc.tp != 1 || o->sp.ep)) {
        fprintf(stderr,
                "tandem: --dp %d prices a given decode shape of tp 1 without --ep "
                "(--colocated Nx1 or --decode Nx1): each instance a group of %d members\n",
                o->dp, o->dp);
        return TD_EINVAL;
    }
    return 0;
}

static int load_hw(const char *path, pl_hw *hw)
{
    char err[512];
    int rc = pl_hw_load(path, hw, err, sizeof err);
    if (rc) fprintf(stderr, "tandem: %s\n", err);
    return rc;
}

static int do_reproduce(const plan_opts *o)
{
    pl_hw hw;
    int rc = load_hw(o->hw ? o->hw : PL_HW_DIR "/h20.yaml", &hw);
    pl_repro_row rows[PL_REPRO_ROWS];
    if (!rc) rc = pl_reproduce(&hw, o->batch, rows);
    if (rc) {
        fprintf(stderr, "tandem: reproduction failed: %s\n", td_strerror(rc));
        return rc;
    }
    if (o->json)
        printf("{\"hw\": \"%s\", \"model\": \"deepseek-v3\", \"batch\": %d, \"rows\": [", hw.name,
               o->batch);
    else
        printf("SGLang chunked pipeline parallelism, DeepSeek-V3.1 on %s, 128K-token prompts "
               "(throughput over %d prompts, TTFT of one)\n%-56s %10s %10s %7s\n",
               hw.name, o->batch, "figure", "published", "simulated", "ratio");
    for (int i = 0; i < PL_REPRO_ROWS; i++) {
        const pl_repro_row *r = &rows[i];
        if (o->json)
            printf("%s{\"what\": \"%s\", \"unit\": \"%s\", \"published\": %.4g, \"simulated\": "
                   "%.4g, \"ratio\": %.4f}",
                   i ? ", " : "", r->what, r->unit, r->published, r->simulated,
                   r->simulated / r->published);
        else
            printf("%-56s %9.4g%s %9.4g%s %7.3f\n", r->what, r->published, r->unit, r->simulated,
                   r->unit, r->simulated / r->published);
    }
    if (o->json) printf("]}\n");
    return 0;
}

static void print_cand(const pl_candidate *c, bool json, bool first, bool best)
{
    const pl_cluster *k = &c->cl;
    const pl_result *r = &c->r;
    if (json) {
        printf("%s{\"prefill\": {\"instances\": %d, \"pp\": %d, \"tp\": %d}, \"decode\": "
               "{\"instances\": %d, \"tp\": %d, \"ep\": %s, \"dp\": %d, \"tbo_min\": %d}, "
               "\"devices\": %d, "
               "\"fits\": %s, "
               "\"meets\": %s, "
               "\"ttft_ms\": {\"p50\": %.3f, \"p90\": %.3f}, \"tpot_ms\": {\"p50\": %.4f, "
               "\"p90\": %.4f}, \"output_tps\": %.3f, \"prefill_tps\": %.3f}",
               first ? "" : ", ", k->n_prefill, k->pf.pp, k->pf.tp, k->n_decode, k->dc.tp,
               k->dc.ep ? "true" : "false", k->dc.dp > 1 ? k->dc.dp : 1, k->dc.tbo_min, r->devices,
               r->fits ? "true" : "false", c->meets ? "true" : "false", r->ttft_p50, r->ttft_p90,
               r->tpot_p50, r->tpot_p90, r->output_tps, r->prefill_tps);
        return;
    }
    char dc[24];
    if (k->dc.dp > 1)
        snprintf(dc, sizeof dc, "%dxdp%d", k->n_decode, k->dc.dp);
    else
        snprintf(dc, sizeof dc, "%dx%d", k->n_decode, k->dc.tp);
    if (!r->fits) {
        printf("%7d  %dx%dx%-4d %-6s  does not fit: %s\n", r->devices, k->n_prefill, k->pf.pp,
               k->pf.tp, dc, r->why);
        return;
    }
    char pf[16];
    if (k->n_prefill)
        snprintf(pf, sizeof pf, "%dx%dx%d", k->n_prefill, k->pf.pp, k->pf.tp);
    else
        snprintf(pf, sizeof pf, "colocated");
    printf("%7d  %-10s %-6s %10.1f %10.1f %9.3f %9.3f %10.1f %10.1f  %s%s\n", r->devices, pf, dc,
           r->ttft_p50, r->ttft_p90, r->tpot_p50, r->tpot_p90, r->output_tps, r->prefill_tps,
           c->meets ? "yes" : "no", best ? "  <- cheapest that meets the targets" : "");
}

static void print_head(const plan_opts *o, const pl_model *m, const pl_hw *hw)
{
    printf("model %s (%d layers, %.2f GB weights, %.0f KB KV/token) on %s; %d requests at "
           "%.3g/s, prompt %d-%d, output %d-%d tokens\n",
           m->name, m->n_layer, m->weight_bytes / 1e9, m->kv_bytes_token / 1e3, hw->name,
           o->w.n_requests, o->w.rate, o->w.prompt_lo, o->w.prompt_hi, o->w.output_lo,
           o->w.output_hi);
    printf("%7s  %-10s %-6s %10s %10s %9s %9s %10s %10s  %s\n", "devices", "prefill", "decode",
           "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "out_tok/s", "in_tok/s", "meets");
}

static int do_plan(const plan_opts *o, const pl_model *m, const pl_hw *hw, pl_request *reqs)
{
    pl_candidate one = {.cl = o->cfg}, *c = &one;
    int n = 1, best = -1, rc;
    if (o->have_cfg) {
        one.cl.pf = o->sp.pf;
        one.cl.pf.pp = o->cfg.pf.pp;
        one.cl.pf.tp = o->cfg.pf.tp;
        one.cl.dc.max_batch = o->sp.max_batch;
        one.cl.dc.ep = o->sp.ep;
        one.cl.dc.dp = o->dp;
        one.cl.dc.tbo_min = o->sp.tbo_min;
        rc = (o->sequential ? pl_simulate_sequential : pl_simulate)(m, hw, &one.cl, reqs,
                                                                    o->w.n_requests, &one.r);
        one.meets = one.r.fits && (!o->have_ttft || one.r.ttft_p90 <= o->sp.ttft_ms) &&
                    (!o->have_tpot || one.r.tpot_p90 <= o->sp.tpot_ms);
    } else {
        rc = pl_search(m, hw, reqs, o->w.n_requests, &o->sp, &c, &n, &best);
    }
    if (rc) {
        fprintf(stderr, "tandem: simulation failed: %s\n", td_strerror(rc));
        return rc;
    }
    if (o->json)
        printf("{\"model\": \"%s\", \"hw\": \"%s\", \"configs\": [", m->name, hw->name);
    else
        print_head(o, m, hw);
    for (int i = 0, shown = 0; i < n; i++)
        if (o->json || o->all || o->have_cfg || (c[i].r.fits && shown < 12) || i == best)
            print_cand(&c[i], o->json, !shown++, i == best && !o->json);
    if (o->json) {
        printf("], \"best\": ");
        if (best >= 0)
            print_cand(&c[best], true, true, false);
        else
            printf("null");
        printf("}\n");
    } else if (!o->have_cfg) {
        printf("%d configurations simulated; ", n);
        if (best < 0)
            printf("none meets p90 TTFT <= %g ms and p90 TPOT <= %g ms\n", o->sp.ttft_ms,
                   o->sp.tpot_ms);
        else
            printf("cheapest meeting p90 TTFT <= %g ms and TPOT <= %g ms: prefill %dx pp%d tp%d, "
                   "decode %dx %s%d (%d devices)\n",
                   o->sp.ttft_ms, o->sp.tpot_ms, c[best].cl.n_prefill, c[best].cl.pf.pp,
                   c[best].cl.pf.tp, c[best].cl.n_decode, c[best].cl.dc.dp > 1 ? "dp" : "tp",
                   c[best].cl.dc.dp > 1 ? c[best].cl.dc.dp : c[best].cl.dc.tp, c[best].r.devices);
    }
    if (c != &one) free(c);
    return 0;
}

int cmd_plan(int argc, char **argv)
{
    plan_opts o;
    int rc = plan_parse(argc, argv, &o);
    if (rc) return rc > 0 ? 0 : rc;
    if (o.reproduce) return do_reproduce(&o);
    pl_model m;
    pl_hw hw;
    if ((rc = pl_model_load(o.model, &m))) {
        fprintf(stderr, "tandem: no model shape from '%s': a GGUF file or one of", o.model);
        for (int i = 0; pl_model_names[i]; i++)
            fprintf(stderr, " %s", pl_model_names[i]);
        fprintf(stderr, "\n");
        return rc;
    }
    if ((rc = load_hw(o.hw, &hw))) return rc;
    pl_request *reqs = malloc((size_t)o.w.n_requests * sizeof *reqs);
    if (!reqs) return TD_ENOMEM;
    rc = pl_workload_make(&o.w, reqs);
    if (rc)
        fprintf(stderr, "tandem: bad workload\n");
    else
        rc = do_plan(&o, &m, &hw, reqs);
    free(reqs);
    return rc;
}

int cmd_calibrate(int argc, char **argv)
{
    pl_calib_params p = {0};
    const char *out = NULL;
    int rc = 0;
    for (int i = 0; i < argc && !rc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v || (strcmp(f, "--model") && strcmp(f, "--out") && strcmp(f, "--threads") &&
                   strcmp(f, "--chunk") && strcmp(f, "--budget-ms") && strcmp(f, "--long-ctx"))) {
            fprintf(stderr, "usage: tandem calibrate --model M.gguf [--out F.yaml] [--threads N] "
                            "[--chunk C] [--budget-ms MS] [--long-ctx T]\n");
            return TD_EINVAL;
        }
        if (!strcmp(f, "--model"))
            p.model_path = v;
        else if (!strcmp(f, "--out"))
            out = v;
        else if (!strcmp(f, "--threads"))
            rc = cli_parse_int(f, v, 1, 256, &p.threads);
        else if (!strcmp(f, "--chunk"))
            rc = cli_parse_int(f, v, 16, 1 << 16, &p.chunk);
        else if (!strcmp(f, "--long-ctx"))
            rc = cli_parse_int(f, v, 256, 1 << 17, &p.long_ctx);
        else
            rc = cli_parse_int(f, v, 100, 3600000, &p.budget_ms);
        i++;
    }
    if (rc) return rc;
    if (!p.model_path) {
        fprintf(stderr, "tandem: calibrate needs --model (a GGUF file)\n");
        return TD_EINVAL;
    }
    pl_calib_result r;
    if ((rc = pl_calibrate(&p, &r))) {
        fprintf(stderr, "tandem: calibration failed: %s\n", td_strerror(rc));
        return rc;
    }
    char comment[2048];
    pl_calib_comment(&r, comment, sizeof comment);
    if (out) {
        fputs(comment, stdout);
        printf("profile written to %s\n", out);
    }
    return pl_hw_write(&r.hw, comment, out ? out : "/dev/stdout");
}
