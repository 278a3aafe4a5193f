/* cmd_k8s.c: `tandem k8s render FILE [--image IMAGE] [--namespace NS] [--name NAME]
 * [--out DIR|-] [--model-pvc CLAIM] [--model-file PATH] [--grace S] [--quiet]`: Kubernetes
 * manifests for the cluster of a YAML file (docs/deploy.md, "Kubernetes").
 *
 * The file is loaded with td_cfg_load (its errors as FILE:LINE:COLUMN), rewritten for pods
 * (k8s_config.c), loaded again as rewritten, and the manifests (k8s_manifest.c) are written
 * as one multi-document stream on stdout or one file per object into DIR. Notes (what was
 * rewritten, what could not be estimated) go to stderr; exit status 1 on any error.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "k8s_int.h"
#include "td_err.h"

static void k8s_usage(void)
{
    fprintf(stderr,
            "usage: tandem k8s render FILE [--image IMAGE] [--namespace NS] [--name NAME]\n"
            "                         [--out DIR|-] [--model-pvc CLAIM] [--model-file PATH]\n"
            "                         [--grace S] [--quiet]\n"
            "  Kubernetes manifests for the cluster YAML FILE: a ConfigMap with the YAML\n"
            "  rewritten for pods, the router (Deployment, Services), a StatefulSet per decode\n"
            "  instance, a Deployment per prefill instance, PodDisruptionBudgets.\n"
            "  --image IMAGE      the image built from Containerfile (default tandem:latest)\n"
            "  --namespace NS     put every object in NS and write the Namespace too\n"
            "  --name NAME        prefix of every object's name (default: FILE's stem)\n"
            "  --out DIR|-        one file per object into DIR (default -: stdout)\n"
            "  --model-pvc CLAIM  the model volume is this PersistentVolumeClaim (default: an\n"
            "                     emptyDir per pod, filled by the init container)\n"
            "  --model-file PATH  read the model here for the memory requests (default: the\n"
            "                     YAML's model, else its file name in $TANDEM_MODELS or\n"
            "                     ~/.cache/tandem/models)\n"
            "  --grace S          terminationGracePeriodSeconds (default: the drain time + 15 s:\n"
            "                     router.drain_timeout_ms, decode[].drain_timeout_ms; 15 s for\n"
            "                     prefill)\n"
            "  --quiet            no notes on stderr\n"
            "docs/deploy.md, \"Kubernetes\"\n");
}

/* The file's stem as a DNS label ("deploy/multi-host.yaml" -> "multi-host"). */
static bool stem_name(const char *file, char *out, size_t cap)
{
    const char *b = strrchr(file, '/');
    b = b ? b + 1 : file;
    char stem[256];
    snprintf(stem, sizeof stem, "%s", b);
    char *dot = strrchr(stem, '.');
    if (dot && (!strcmp(dot, ".yaml") || !strcmp(dot, ".yml"))) *dot = 0;
    return cli_k8s_dns_name(stem, out, cap);
}

static int need_value(int i, int argc, char **argv)
{
    if (i + 1 < argc) return 0;
    fprintf(stderr, "tandem k8s: %s needs a value\n", argv[i]);
    return TD_EINVAL;
}

static int parse_render(int argc, char **argv, cli_k8s_opts *o, const char **out_dir)
{
    *o = (cli_k8s_opts){.image = "tandem:latest"};
    *out_dir = "-";
    struct {
        const char *flag;
        const char **dst;
    } strs[] = {{"--image", &o->image},         {"--namespace", &o->ns},
                {"--name", &o->base},           {"--out", out_dir},
                {"--model-pvc", &o->model_pvc}, {"--model-file", &o->model_file}};
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) return 1;
        if (!strcmp(a, "--quiet")) {
            o->quiet = true;
            continue;
        }
        if (!strcmp(a, "--grace")) {
            if (need_value(i, argc, argv) ||
                cli_parse_int("--grace", argv[++i], 1, 86400, &o->grace_s))
                return TD_EINVAL;
            continue;
        }
        size_t k = 0;
        for (; k < sizeof strs / sizeof strs[0]; k++)
            if (!strcmp(a, strs[k].flag)) break;
        if (k < sizeof strs / sizeof strs[0]) {
            if (need_value(i, argc, argv)) return TD_EINVAL;
            *strs[k].dst = argv[++i];
            continue;
        }
        if (a[0] == '-' || o->file) {
            fprintf(stderr, "tandem k8s: unexpected argument '%s'\n", a);
            return TD_EINVAL;
        }
        o->file = a;
    }
    if (!o->file) {
        fprintf(stderr, "tandem k8s render: a cluster YAML file is needed\n");
        return TD_EINVAL;
    }
    return 0;
}

/* --name and --namespace must be DNS labels; the default name is the file's stem. */
static int check_names(cli_k8s_opts *o, char *base, size_t cap)
{
    char tmp[64];
    if (o->ns && (!cli_k8s_dns_name(o->ns, tmp, sizeof tmp) || strcmp(tmp, o->ns))) {
        fprintf(stderr, "tandem k8s: --namespace '%s' is not a DNS label (a-z 0-9 -)\n", o->ns);
        return TD_EINVAL;
    }
    if (o->base) {
        if (!cli_k8s_dns_name(o->base, base, cap) || strcmp(base, o->base)) {
            fprintf(stderr, "tandem k8s: --name '%s' is not a DNS label (a-z 0-9 -)\n", o->base);
            return TD_EINVAL;
        }
    } else if (!stem_name(o->file, base, cap)) {
        fprintf(stderr,
                "tandem k8s: the name of %s does not make a Kubernetes name: give --name NAME\n",
                o->file);
        return TD_EINVAL;
    }
    o->base = base;
    return 0;
}

/* Where the model is read for the memory requests: --model-file, else the YAML's path,
 * else its file name in the model cache of scripts/setup.sh and fetch_model.py
 * (${TANDEM_MODELS:-~/.cache/tandem/models}), where a YAML written for pods (/models/...)
 * finds it on the machine that renders. */
static const char *model_here(const cli_k8s_opts *o, const cli_k8s_cluster *c, const td_cfg *orig,
                              char *buf, size_t cap)
{
    if (o->model_file) return o->model_file;
    if (!access(orig->model, R_OK)) return orig->model;
    const char *dir = getenv("TANDEM_MODELS"), *home = getenv("HOME");
    if (dir && *dir)
        snprintf(buf, cap, "%s/%s", dir, c->model_name);
    else
        snprintf(buf, cap, "%s/.cache/tandem/models/%s", home ? home : "", c->model_name);
    return access(buf, R_OK) ? orig->model : buf;
}

/* What the user must create besides the manifests. */
static void secret_note(const cli_k8s_opts *o, const cli_k8s_cluster *c)
{
    if (!c->secret || o->quiet) return;
    fprintf(stderr,
            "tandem k8s: note: the pods mount the Secret %s-secret at %s: create it from the "
            "files %s, e.g. kubectl create secret generic %s-secret%s%s --from-file=FILE ...\n",
            o->base, CLI_K8S_SECRET_DIR, c->secret_files, o->base, o->ns ? " -n " : "",
            o->ns ? o->ns : "");
}

static int k8s_render(int argc, char **argv)
{
    cli_k8s_opts o;
    const char *out_dir;
    int rc = parse_render(argc, argv, &o, &out_dir);
    if (rc) {
        k8s_usage();
        return rc > 0 ? 0 : rc;
    }
    char base[64];
    if ((rc = check_names(&o, base, sizeof base))) return rc;
    char err[1024];
    td_cfg *orig = NULL;
    /* the security files are the Secret's, mounted in the pods: not needed here */
    if ((rc = td_cfg_load_flags(o.file, TD_CFG_NO_FILE_CHECKS, &orig, err, sizeof err))) {
        fprintf(stderr, "tandem k8s: %s\n", err);
        return rc;
    }
    cli_k8s_cluster c = {0};
    rc = cli_k8s_check_names(o.base, orig);
    if (!rc) rc = cli_k8s_cluster_build(&o, orig, &c);
    cli_k8s_model m = {0};
    char path[4096];
    if (!rc) cli_k8s_model_read(model_here(&o, &c, orig, path, sizeof path), &m);
    cli_k8s_out out = {0};
    if (!rc) rc = cli_k8s_manifests(&o, &c, &m, &out);
    if (!rc) rc = cli_k8s_out_write(&out, out_dir);
    if (!rc) secret_note(&o, &c);
    cli_k8s_out_free(&out);
    cli_k8s_cluster_free(&c);
    td_cfg_free(orig);
    return rc;
}

int cmd_k8s(int argc, char **argv)
{
    if (argc < 1 || !strcmp(argv[0], "-h") || !strcmp(argv[0], "--help")) {
        k8s_usage();
        return argc < 1 ? TD_EINVAL : 0;
    }
    if (!strcmp(argv[0], "render")) return k8s_render(argc - 1, argv + 1);
    fprintf(stderr, "tandem k8s: unknown subcommand '%s' (known: render)\n", argv[0]);
    k8s_usage();
    return TD_EINVAL;
}
