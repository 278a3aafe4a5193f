/* dc_main.c: `tandem-decode --config FILE --instance NAME --rank R [--listen URL]
 * [--name NAME] [--advertise HOST]`. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_blas.h"
#include "config.h"
#include "dc_node.h"
#include "td_args.h"
#include "td_err.h"

static volatile sig_atomic_t g_stop;

static void on_signal(int sig)
{
    (void)sig;
    g_stop = 1;
}

static void usage(void)
{
    fprintf(stderr,
            "usage: tandem-decode --config FILE --instance NAME --rank R [--listen URL]\n"
            "                     [--name NAME] [--advertise HOST]\n"
            "  one process per tensor-parallel rank; rank 0 serves the control socket\n"
            "  (tcp://HOST:PORT of the instance in the config, or --listen)\n"
            "  --name: this instance's own name (default: --instance, then only the YAML\n"
            "          entry its settings come from); every rank of it gives the same\n"
            "  --advertise: the host the router reaches rank 0 at (router.membership), and\n"
            "               whose network device the KV plane uses\n");
}

int main(int argc, char **argv)
{
    /* before any thread: a BLAS core older than the CPU is fixed by re-executing */
    if (kn_blas_fit_cpu(argv)) return 1;
    const char *path = NULL, *instance = NULL, *listen = NULL, *name = NULL, *advertise = NULL;
    int rank = -1;
    const td_arg spec[] = {
        {.name = "--config", .kind = TD_ARG_STRING, .out = &path, .required = true},
        {.name = "--instance", .kind = TD_ARG_STRING, .out = &instance, .required = true},
        {.name = "--rank",
         .kind = TD_ARG_INT,
         .out = &rank,
         .required = true,
         .min = 0,
         .max = 1023},
        {.name = "--listen", .kind = TD_ARG_STRING, .out = &listen},
        {.name = "--name", .kind = TD_ARG_STRING, .out = &name},
        {.name = "--advertise", .kind = TD_ARG_STRING, .out = &advertise},
    };
    td_args_result ar =
        td_args_parse("tandem-decode", argc, argv, spec, sizeof spec / sizeof *spec);
    if (ar != TD_ARGS_OK) {
        usage();
        return ar == TD_ARGS_HELP ? 0 : 1;
    }
    if (name && !td_cfg_name_ok(name)) {
        fprintf(stderr,
                "tandem-decode: --name '%s' is not an instance name ([A-Za-z0-9_.-], "
                "1..%d bytes)\n",
                name, TD_CFG_NAME_MAX);
        return 1;
    }
    char err[512];
    td_cfg *cfg;
    int rc = td_cfg_load(path, &cfg, err, sizeof err);
    if (rc) {
        fprintf(stderr, "tandem-decode: %s\n", err);
        return 1;
    }
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    dc_node_params p = {.cfg = cfg,
                        .instance = name ? name : instance,
                        .template_name = instance,
                        .rank = rank,
                        .listen = listen,
                        .advertise = advertise,
                        .stop = &g_stop};
    rc = dc_node_run(&p);
    td_cfg_free(cfg);
    return rc ? 1 : 0;
}
