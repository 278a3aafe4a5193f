/* pf_main.c: `tandem-prefill --config FILE --instance NAME --stage S [--listen URL]
 * [--leader URL] [--reprofile]`, and pf_node_run (one stage's life: set up, then lead or follow).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu_blas.h"
#include "pf_int.h"
#include "td_args.h"
#include "td_clock.h"
#include "td_err.h"

int pf_node_run(const pf_node_params *p)
{
    pf_stage *st = calloc(1, sizeof *st);
    if (!st) return TD_ENOMEM;
    st->p = p;
    const char *tmpl = p->template_name ? p->template_name : p->instance;
    st->cfg = td_cfg_find_prefill(p->cfg, tmpl);
    int rc = TD_EINVAL;
    if (!st->cfg) {
        TD_LOG_ERR("no prefill instance '%s' in %s", tmpl, p->cfg->path);
        goto out;
    }
    st->pp = st->cfg->pp;
    st->stage = p->stage;
    if (p->stage < 0 || p->stage >= st->pp) {
        TD_LOG_ERR("stage %d is outside prefill instance %s (pp %d)", p->stage, p->instance,
                   st->pp);
        goto out;
    }
    /* the wall clock: differs between starts of the same pid, across reboots too */
    struct timespec ts = td_wall_now();
    st->boot_id = ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ (uint64_t)ts.tv_sec << 20;
    if (!st->boot_id) st->boot_id = 1;
    rc = pf_stage_setup(st);
    if (!rc) rc = st->stage == 0 ? pf_leader_run(st) : pf_follower_run(st);
out:
    if (rc) TD_LOG_ERR("prefill %s stage %d: exiting: %s", p->instance, p->stage, td_strerror(rc));
    pf_stage_teardown(st);
    free(st);
    return rc;
}

static volatile sig_atomic_t g_stop, g_profiling;

/* SIGTERM / SIGINT: stop. While stage 0 profiles, the profile stops before its next forward;
 * the forward in progress (up to ~1.25 chunk_size tokens of the stage: seconds on a busy
 * CPU) is given STOP_GRACE_S, then the process exits 0 at once (on_alarm). */
#define STOP_GRACE_S 1

static void on_signal(int sig)
{
    (void)sig;
    g_stop = 1;
    if (g_profiling) alarm(STOP_GRACE_S);
}

/* The grace after a stop during the profile ran out with the forward still going. Nothing
 * is in flight then (no request accepted, no transfer, no peer holds state on this
 * process; the cache file is written only after the profile), so what a normal stop would
 * tear down is memory and sockets, which the kernel reclaims. Async-signal-safe. */
static void on_alarm(int sig)
{
    (void)sig;
    if (!g_profiling) return; /* the profile ended meanwhile: the normal stop runs */
    static const char msg[] = "tandem-prefill: stopped while profiling, without waiting for "
                              "the forward in progress\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    (void)w;
    _exit(0);
}

static void usage(void)
{
    fprintf(stderr,
            "usage: tandem-prefill --config FILE --instance NAME --stage S [--listen URL] "
            "[--leader URL] [--reprofile]\n"
            "                      [--name NAME] [--advertise HOST]\n"
            "  one process per pipeline stage; stage 0 serves the control socket\n"
            "  (tcp://hosts[0]:port of the instance in the config, or --listen); the other\n"
            "  stages join it there (or at --leader)\n"
            "  --reprofile  stage 0 measures its stage profile (dynamic chunking) even if one\n"
            "               is cached for this model, layers, threads, build and CPU\n"
            "               ($TANDEM_CACHE/profiles, else ~/.cache/tandem/profiles)\n"
            "  --name       this instance's own name (default: --instance, then only the\n"
            "               YAML entry its settings come from); every stage gives the same\n"
            "  --advertise  the host the router reaches stage 0 at (router.membership), and\n"
            "               whose network device the KV plane uses\n");
}

int main(int argc, char **argv)
{
    /* before any thread: a BLAS core older than the CPU is fixed by re-executing */
    if (kn_blas_fit_cpu(argv)) return 1;
    const char *path = NULL, *instance = NULL, *listen = NULL, *leader = NULL, *name = NULL,
               *advertise = NULL;
    int stage = -1;
    bool reprofile = false;
    const td_arg spec[] = {
        {.name = "--config", .kind = TD_ARG_STRING, .out = &path, .required = true},
        {.name = "--instance", .kind = TD_ARG_STRING, .out = &instance, .required = true},
        {.name = "--stage",
         .kind = TD_ARG_INT,
         .out = &stage,
         .required = true,
         .min = 0,
         .max = 1023},
        {.name = "--listen", .kind = TD_ARG_STRING, .out = &listen},
        {.name = "--leader", .kind = TD_ARG_STRING, .out = &leader},
        {.name = "--reprofile", .kind = TD_ARG_FLAG, .out = &reprofile},
        {.name = "--name", .kind = TD_ARG_STRING, .out = &name},
        {.name = "--advertise", .kind = TD_ARG_STRING, .out = &advertise},
    };
    td_args_result ar =
        td_args_parse("tandem-prefill", argc, argv, spec, sizeof spec / sizeof *spec);
    if (ar != TD_ARGS_OK) {
        usage();
        return ar == TD_ARGS_HELP ? 0 : 1;
    }
    if (reprofile && stage != 0) {
        fprintf(stderr,
                "tandem-prefill: --reprofile is for stage 0 (only it profiles), not "
                "stage %d\n",
                stage);
        return 1;
    }
    if (name && !td_cfg_name_ok(name)) {
        fprintf(stderr,
                "tandem-prefill: --name '%s' is not an instance name ([A-Za-z0-9_.-], 1..%d "
                "bytes)\n",
                name, TD_CFG_NAME_MAX);
        return 1;
    }
    char err[512];
    td_cfg *cfg;
    if (td_cfg_load(path, &cfg, err, sizeof err)) {
        fprintf(stderr, "tandem-prefill: %s\n", err);
        return 1;
    }
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    struct sigaction al = {.sa_handler = on_alarm, .sa_flags = SA_RESTART};
    sigemptyset(&al.sa_mask);
    sigaction(SIGALRM, &al, NULL);
    signal(SIGPIPE, SIG_IGN);
    pf_node_params p = {.cfg = cfg,
                        .instance = name ? name : instance,
                        .template_name = instance,
                        .advertise = advertise,
                        .stage = stage,
                        .listen = listen,
                        .leader = leader,
                        .reprofile = reprofile,
                        .stop = &g_stop,
                        .profiling = &g_profiling};
    int rc = pf_node_run(&p);
    td_cfg_free(cfg);
    return rc ? 1 : 0;
}
