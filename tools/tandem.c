/* tandem.c: the `tandem` command-line tool: dispatch to the subcommands. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "cpu_blas.h"
#include "http_client.h"

static void usage(void)
{
    fprintf(stderr, "usage: tandem <command> [options]\n"
                    "commands:\n"
                    "  generate      generate text from a prompt in this process\n"
                    "  bench-engine  prefill/decode throughput against this machine's ceilings\n"
                    "  logits        write the last position's logits (raw float32)\n"
                    "  dequant       write a tensor dequantized (raw float32)\n"
                    "  client        submit requests to an instance over the control plane\n"
                    "  up            start a cluster from its YAML (-d: in the background)\n"
                    "  down          stop a cluster started with 'tandem up -d'\n"
                    "  status        the processes of a cluster and their state\n"
                    "  bench         load generator against the OpenAI HTTP API\n"
                    "  chunk-plan    profile a prefill stage, fit the dynamic-chunking cost model\n"
                    "  plan          simulate a cluster, pick the cheapest config meeting targets\n"
                    "  calibrate     measure this machine into a hardware profile for plan\n"
                    "  template      render a chat template with a conversation (as the router)\n"
                    "  tokenize      text to token ids and back with a GGUF's vocabulary\n"
                    "  k8s           Kubernetes manifests from a cluster YAML (k8s render)\n"
                    "  health        one health check of an instance or router, as exit status\n"
                    "run 'tandem <command> --help' for its options\n");
}

int main(int argc, char **argv)
{
    /* before any thread: a BLAS core older than the CPU is fixed by re-executing */
    if (kn_blas_fit_cpu(argv)) return 1;
    if (argc < 2) {
        usage();
        return 2;
    }
    const char *cmd = argv[1];
    /* libcurl's global state, before any command starts a thread (bench) */
    if (cli_http_global_init()) {
        fprintf(stderr, "tandem: cannot initialize libcurl\n");
        return 1;
    }
    int rc;
    if (!strcmp(cmd, "generate"))
        rc = cmd_generate(argc - 2, argv + 2);
    else if (!strcmp(cmd, "logits"))
        rc = cmd_logits(argc - 2, argv + 2);
    else if (!strcmp(cmd, "dequant"))
        rc = cmd_dequant(argc - 2, argv + 2);
    else if (!strcmp(cmd, "bench-engine"))
        rc = cmd_bench_engine(argc - 2, argv + 2);
    else if (!strcmp(cmd, "client"))
        rc = cmd_client(argc - 2, argv + 2);
    else if (!strcmp(cmd, "up"))
        rc = cmd_up(argc - 2, argv + 2);
    else if (!strcmp(cmd, "down"))
        rc = cmd_down(argc - 2, argv + 2);
    else if (!strcmp(cmd, "status"))
        rc = cmd_status(argc - 2, argv + 2);
    else if (!strcmp(cmd, "bench"))
        rc = cmd_bench(argc - 2, argv + 2);
    else if (!strcmp(cmd, "chunk-plan"))
        rc = cmd_chunk_plan(argc - 2, argv + 2);
    else if (!strcmp(cmd, "plan"))
        rc = cmd_plan(argc - 2, argv + 2);
    else if (!strcmp(cmd, "calibrate"))
        rc = cmd_calibrate(argc - 2, argv + 2);
    else if (!strcmp(cmd, "template"))
        rc = cmd_template(argc - 2, argv + 2);
    else if (!strcmp(cmd, "tokenize"))
        rc = cmd_tokenize(argc - 2, argv + 2);
    else if (!strcmp(cmd, "k8s"))
        rc = cmd_k8s(argc - 2, argv + 2);
    else if (!strcmp(cmd, "health"))
        rc = cmd_health(argc - 2, argv + 2);
    else if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h")) {
        usage();
        rc = 0;
    } else {
        fprintf(stderr, "tandem: unknown command '%s'\n", cmd);
        usage();
        rc = 1;
    }
    cli_http_global_fini();
    return rc ? 1 : 0;
}
