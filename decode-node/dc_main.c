/* dc_main.c: `tandem-decode --config FILE --instance NAME --rank R [--listen URL]`. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_blas.h"
#include "config.h"
#include "dc_node.h"
#include "td_err.h"

static volatile sig_atomic_t g_stop;

static void on_signal(int sig)
{
    (void)sig;
    g_stop = 1;
}

static void usage(void)
{
    fprintf(stderr, "usage: tandem-decode --config FILE --instance NAME --rank R [--listen URL]\n"
                    "  one process per tensor-parallel rank; rank 0 serves the control socket\n"
                    "  (tcp://HOST:PORT of the instance in the config, or --listen)\n");
}

int main(int argc, char **argv)
{
    /* before any thread: a BLAS core older than the CPU is fixed by re-executing */
    if (kn_blas_fit_cpu(argv)) return 1;
    const char *path = NULL, *instance = NULL, *listen = NULL;
    int rank = -1;
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
            usage();
            return 0;
        }
        if (!v) {
            fprintf(stderr, "tandem-decode: %s needs a value\n", f);
            return 1;
        }
        if (!strcmp(f, "--config"))
            path = v;
        else if (!strcmp(f, "--instance"))
            instance = v;
        else if (!strcmp(f, "--listen"))
            listen = v;
        else if (!strcmp(f, "--rank")) {
            char *end;
            long r = strtol(v, &end, 10);
            if (*end || r < 0 || r > 1023) {
                fprintf(stderr, "tandem-decode: bad --rank '%s'\n", v);
                return 1;
            }
            rank = (int)r;
        } else {
            fprintf(stderr, "tandem-decode: unknown option '%s'\n", f);
            usage();
            return 1;
        }
        i++;
    }
    if (!path || !instance || rank < 0) {
        usage();
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
    dc_node_params p = {
        .cfg = cfg, .instance = instance, .rank = rank, .listen = listen, .stop = &g_stop};
    rc = dc_node_run(&p);
    td_cfg_free(cfg);
    return rc ? 1 : 0;
}
