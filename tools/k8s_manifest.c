/* k8s_manifest.c: the Kubernetes objects of `tandem k8s render` (k8s_int.h), in apply
 * order: the Namespace (with --namespace), the ConfigMap with the cluster YAML, the router
 * (Deployment, its HTTP Service and the membership Service the nodes dial), then per
 * decode instance (or data-parallel group) a headless Service, a StatefulSet (one pod per
 * replica, one container per tensor-parallel rank, per member of a group) and a
 * PodDisruptionBudget, per prefill instance a Deployment
 * (one pod per replica, one container per pipeline stage) and a PodDisruptionBudget.
 * docs/deploy.md ("Kubernetes") says why each choice. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k8s_int.h"
#include "td_err.h"

#define CFG_PATH CLI_K8S_CONFIG_DIR "/cluster.yaml"

/* Longest object name of an instance: a Deployment's pods are NAME-<10>-<5>, and a pod's
 * name is the instance name it joins under (at most 63 bytes). */
#define INST_NAME_MAX 46

bool cli_k8s_dns_name(const char *in, char *out, size_t cap)
{
    size_t n = strlen(in);
    if (!n || n + 1 > cap) return false;
    for (size_t i = 0; i < n; i++) {
        char ch = (char)tolower((unsigned char)in[i]);
        out[i] = ch == '_' || ch == '.' ? '-' : ch;
        if (!isalnum((unsigned char)out[i]) && out[i] != '-') return false;
    }
    out[n] = 0;
    return isalnum((unsigned char)out[0]) && isalnum((unsigned char)out[n - 1]);
}

typedef struct {
    const cli_k8s_opts *o;
    const cli_k8s_cluster *c;
    const cli_k8s_model *m;
    cli_k8s_out *out;
    char hash[24]; /* of the ConfigMap's contents: a pod template annotation */
} mf_ctx;

/* terminationGracePeriodSeconds: --grace, else the pod's drain time on SIGTERM (the
 * router's drain_timeout_ms, a decode or prefill instance's own) + 15 s to hand back what is
 * left and exit. */
static int grace_of(const mf_ctx *x, int drain_ms)
{
    return x->o->grace_s ? x->o->grace_s : (drain_ms + 999) / 1000 + 15;
}

static uint64_t fnv1a(uint64_t h, const char *s)
{
    for (; s && *s; s++)
        h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

static cli_k8s_doc *begin(mf_ctx *x, const char *api, const char *kind, const char *name,
                          const char *component, const char *inst)
{
    int meta;
    cli_k8s_doc *d = cli_k8s_out_add(x->out, api, kind, name, x->o->ns, &meta);
    if (d) cli_k8s_labels(d, cli_k8s_put_map(d, meta, "labels"), x->o->base, component, inst);
    return d;
}

static void selector(mf_ctx *x, cli_k8s_doc *d, int map, const char *component, const char *inst)
{
    cli_k8s_labels(d, map, x->o->base, component, inst);
}

static int config_map(mf_ctx *x)
{
    char name[160];
    snprintf(name, sizeof name, "%s-config", x->o->base);
    cli_k8s_doc *d = begin(x, "v1", "ConfigMap", name, "config", NULL);
    if (!d) return TD_ENOMEM;
    int data = cli_k8s_put_map(d, 1, "data");
    cli_k8s_put(d, data, "cluster.yaml", cli_k8s_text(d, x->c->text));
    if (x->c->template_text)
        cli_k8s_put(d, data, "chat_template.jinja", cli_k8s_text(d, x->c->template_text));
    return 0;
}

/* A Service over the pods of component/inst with n ports (port_names[i] on ports[i]).
 * headless: clusterIP None (a StatefulSet's pods' DNS names). not_ready: its endpoints
 * include pods that are not ready. */
static int service_ports(mf_ctx *x, const char *name, const char *component, const char *inst,
                         const char *const *port_names, const int *ports, int n, bool headless,
                         bool not_ready)
{
    cli_k8s_doc *d = begin(x, "v1", "Service", name, component, inst);
    if (!d) return TD_ENOMEM;
    int spec = cli_k8s_put_map(d, 1, "spec");
    if (headless) cli_k8s_put_str(d, spec, "clusterIP", "None");
    if (not_ready) cli_k8s_put_bool(d, spec, "publishNotReadyAddresses", true);
    selector(x, d, cli_k8s_put_map(d, spec, "selector"), component, inst);
    int seq = cli_k8s_put_seq(d, spec, "ports");
    for (int i = 0; i < n; i++) {
        int p = cli_k8s_map(d);
        cli_k8s_push(d, seq, p);
        cli_k8s_put_str(d, p, "name", port_names[i]);
        cli_k8s_put_num(d, p, "port", ports[i]);
        cli_k8s_put_str(d, p, "targetPort", port_names[i]);
        cli_k8s_put_str(d, p, "protocol", "TCP");
    }
    return 0;
}

static int service(mf_ctx *x, const char *name, const char *component, const char *inst,
                   const char *port_name, int port, bool headless, bool not_ready)
{
    return service_ports(x, name, component, inst, &port_name, &port, 1, headless, not_ready);
}

static int pdb(mf_ctx *x, const char *name, const char *component, const char *inst)
{
    cli_k8s_doc *d = begin(x, "policy/v1", "PodDisruptionBudget", name, component, inst);
    if (!d) return TD_ENOMEM;
    int spec = cli_k8s_put_map(d, 1, "spec");
    cli_k8s_put_num(d, spec, "maxUnavailable", 1);
    int sel = cli_k8s_put_map(d, spec, "selector");
    selector(x, d, cli_k8s_put_map(d, sel, "matchLabels"), component, inst);
    return 0;
}

/* The pod template's metadata (labels, the config hash, annotations) and its spec. */
static int pod_template(mf_ctx *x, cli_k8s_doc *d, int spec, const char *component,
                        const char *inst, bool scrape, int grace_s)
{
    int tmpl = cli_k8s_put_map(d, spec, "template");
    int meta = cli_k8s_put_map(d, tmpl, "metadata");
    cli_k8s_labels(d, cli_k8s_put_map(d, meta, "labels"), x->o->base, component, inst);
    int ann = cli_k8s_put_map(d, meta, "annotations");
    cli_k8s_put_str(d, ann, "checksum/config", x->hash); /* a new YAML rolls the pods */
    if (scrape) {
        char port[16];
        snprintf(port, sizeof port, "%d", x->c->http_port);
        cli_k8s_put_str(d, ann, "prometheus.io/scrape", "true");
        cli_k8s_put_str(d, ann, "prometheus.io/port", port);
        cli_k8s_put_str(d, ann, "prometheus.io/path", "/metrics");
        if (x->c->cfg->router.tls_cert) cli_k8s_put_str(d, ann, "prometheus.io/scheme", "https");
    }
    int pspec = cli_k8s_put_map(d, tmpl, "spec");
    cli_k8s_put_num(d, pspec, "terminationGracePeriodSeconds", grace_s);
    cli_k8s_pod_security(d, pspec);
    return pspec;
}

static void container_port(cli_k8s_doc *d, int ports, const char *name, int port)
{
    int p = cli_k8s_map(d);
    cli_k8s_push(d, ports, p);
    cli_k8s_put_str(d, p, "name", name);
    cli_k8s_put_num(d, p, "containerPort", port);
    cli_k8s_put_str(d, p, "protocol", "TCP");
}

static void http_probe(mf_ctx *x, cli_k8s_doc *d, int ctr, const char *key, const char *path,
                       int period, int failures)
{
    int pr = cli_k8s_put_map(d, ctr, key);
    int get = cli_k8s_put_map(d, pr, "httpGet");
    cli_k8s_put_str(d, get, "path", path);
    cli_k8s_put_str(d, get, "port", "http");
    if (x->c->cfg->router.tls_cert) cli_k8s_put_str(d, get, "scheme", "HTTPS");
    cli_k8s_put_num(d, pr, "periodSeconds", period);
    cli_k8s_put_num(d, pr, "timeoutSeconds", 3);
    cli_k8s_put_num(d, pr, "failureThreshold", failures);
}

/* The router: one replica (the membership lives in it), replaced by Recreate: the nodes
 * keep their connection to the old router until it exits, so a second router started
 * beside it would not learn them and never turn ready. Readiness is GET /health (200 once
 * it can serve), liveness GET /version (200 whatever the instances do). */
static int router(mf_ctx *x)
{
    char name[160];
    snprintf(name, sizeof name, "%s-router", x->o->base);
    cli_k8s_doc *d = begin(x, "apps/v1", "Deployment", name, "router", NULL);
    if (!d) return TD_ENOMEM;
    int spec = cli_k8s_put_map(d, 1, "spec");
    cli_k8s_put_num(d, spec, "replicas", 1);
    cli_k8s_put_str(d, cli_k8s_put_map(d, spec, "strategy"), "type", "Recreate");
    int sel = cli_k8s_put_map(d, spec, "selector");
    selector(x, d, cli_k8s_put_map(d, sel, "matchLabels"), "router", NULL);
    int pspec = pod_template(x, d, spec, "router", NULL, true,
                             grace_of(x, x->c->cfg->router.drain_timeout_ms));
    cli_k8s_pod p = {.o = x->o, .c = x->c, .m = x->m};
    cli_k8s_init_fetch(d, pspec, &p);
    const char *argv[] = {"tandem-router", "--config", CFG_PATH};
    int ctr = cli_k8s_container(d, cli_k8s_put_seq(d, pspec, "containers"), &p, "router", argv, 3);
    int ports = cli_k8s_put_seq(d, ctr, "ports");
    container_port(d, ports, "http", x->c->http_port);
    container_port(d, ports, "membership", x->c->member_port);
    http_probe(x, d, ctr, "startupProbe", "/version", 5, 60);
    http_probe(x, d, ctr, "readinessProbe", "/health", 5, 2);
    http_probe(x, d, ctr, "livenessProbe", "/version", 10, 6);
    int res = cli_k8s_put_map(d, ctr, "resources");
    int req = cli_k8s_put_map(d, res, "requests");
    cli_k8s_put_str(d, req, "cpu", "1");
    cli_k8s_put_str(d, req, "memory", "512Mi");
    cli_k8s_volumes(d, pspec, &p);
    int rc = service(x, name, "router", NULL, "http", x->c->http_port, false, false);
    /* the nodes join through this one: its endpoint exists before the router is ready
     * (it turns ready once instances joined) */
    snprintf(name, sizeof name, "%s-join", x->o->base);
    if (!rc) rc = service(x, name, "router", NULL, "membership", x->c->member_port, false, true);
    return rc;
}

/* The control port's name of member k of a dp group (dp > 1), or of the instance. */
static void control_port_name(const td_cfg_decode *dc, char *buf, size_t cap)
{
    if (dc->dp > 1)
        snprintf(buf, cap, "control-%d", dc->dp_rank);
    else
        snprintf(buf, cap, "control");
}

/* Rank r's container of the instance dc (a dp group's member dc->dp_rank): tandem-decode
 * joining under the pod's name (a member under POD.K, its member name's suffix); rank 0
 * serves the instance's control socket on every address and is probed with `tandem health`. */
static void decode_rank(mf_ctx *x, cli_k8s_doc *d, int list, const cli_k8s_pod *p,
                        const td_cfg_decode *dc, int r, int64_t bytes)
{
    char rank[16], listen[64], cname[32], join[32], port_name[16];
    snprintf(rank, sizeof rank, "%d", r);
    snprintf(listen, sizeof listen, "tcp://0.0.0.0:%d", dc->port);
    if (dc->dp > 1) {
        snprintf(cname, sizeof cname, "m%d-rank-%d", dc->dp_rank, r);
        snprintf(join, sizeof join, "$(POD_NAME).%d", dc->dp_rank);
    } else {
        snprintf(cname, sizeof cname, "rank-%d", r);
        snprintf(join, sizeof join, "$(POD_NAME)");
    }
    control_port_name(dc, port_name, sizeof port_name);
    const char *argv[] = {"tandem-decode", "--config", CFG_PATH, "--instance", dc->name,
                          "--rank",        rank,       "--name", join,         "--advertise",
                          "$(POD_IP)",     "--listen", listen};
    int ctr = cli_k8s_container(d, list, p, cname, argv, r == 0 ? 13 : 11);
    if (r == 0) {
        container_port(d, cli_k8s_put_seq(d, ctr, "ports"), port_name, dc->port);
        cli_k8s_exec_probe(d, ctr, "startupProbe", true, dc->port, 5, 120);
        cli_k8s_exec_probe(d, ctr, "readinessProbe", false, dc->port, 5, 2);
        cli_k8s_exec_probe(d, ctr, "livenessProbe", true, dc->port, 15, 4);
    }
    cli_k8s_resources(d, ctr, dc->threads, bytes, x->c->cfg->backend == TD_CFG_BACKEND_CUDA);
}

/* A decode instance, or a dp group's n members (dc[0 .. n), consecutive in the config: its
 * dp entry expanded), in one pod: the members meet in the pod's shared memory and run their
 * MoE layers in lock step, so they live and move together; each member joins the router as
 * an instance of its own (POD.K at its own port). inst: the object's DNS name (the
 * instance's, or the group's). */
static int decode(mf_ctx *x, const td_cfg_decode *dc, int n, const char *inst)
{
    char name[160];
    snprintf(name, sizeof name, "%s-%s", x->o->base, inst);
    char port_names[TD_CFG_MAX_PARALLEL][16];
    const char *pn[TD_CFG_MAX_PARALLEL];
    int ports[TD_CFG_MAX_PARALLEL];
    for (int k = 0; k < n; k++) {
        control_port_name(&dc[k], port_names[k], sizeof port_names[k]);
        pn[k] = port_names[k];
        ports[k] = dc[k].port;
    }
    int rc = service_ports(x, name, "decode", inst, pn, ports, n, true, true);
    cli_k8s_doc *d = rc ? NULL : begin(x, "apps/v1", "StatefulSet", name, "decode", inst);
    if (!d) return TD_ENOMEM;
    int spec = cli_k8s_put_map(d, 1, "spec");
    cli_k8s_put_str(d, spec, "serviceName", name);
    cli_k8s_put_num(d, spec, "replicas", 1);
    cli_k8s_put_str(d, spec, "podManagementPolicy", "Parallel"); /* each pod joins alone */
    int upd = cli_k8s_put_map(d, spec, "updateStrategy");
    cli_k8s_put_str(d, upd, "type", "RollingUpdate");
    int sel = cli_k8s_put_map(d, spec, "selector");
    selector(x, d, cli_k8s_put_map(d, sel, "matchLabels"), "decode", inst);
    int pspec = pod_template(x, d, spec, "decode", inst, false, grace_of(x, dc->drain_timeout_ms));
    /* the ranks (and a group's members) meet in shared memory (/dev/shm) and watch each
     * other's pids */
    cli_k8s_put_bool(d, pspec, "shareProcessNamespace", true);
    int64_t kv = cli_k8s_decode_kv_bytes(x->m, dc);
    cli_k8s_pod p = {.o = x->o, .c = x->c, .m = x->m, .shm = true, .tier = dc->tier.path != NULL};
    /* per member: its followers' KV pools are segments in /dev/shm (disaggregated), plus its
     * ranks' rendezvous; a group adds its members' segment, budgeted as one more */
    if (x->m->known)
        p.shm_bytes =
            n * (x->c->cfg->n_prefill ? kv * (dc->tp - 1) : 0) + (n + (n > 1)) * (64ll << 20);
    p.tier_bytes = dc->tier.path ? n * dc->tier.bytes * dc->tp + (16ll << 20) : 0;
    cli_k8s_init_fetch(d, pspec, &p);
    int list = cli_k8s_put_seq(d, pspec, "containers");
    for (int k = 0; k < n; k++) {
        int64_t bytes = cli_k8s_decode_rank_bytes(x->m, &dc[k]);
        for (int r = 0; r < dc[k].tp; r++)
            decode_rank(x, d, list, &p, &dc[k], r, bytes);
    }
    cli_k8s_volumes(d, pspec, &p);
    return pdb(x, name, "decode", inst);
}

static void prefill_stage(mf_ctx *x, cli_k8s_doc *d, int list, const cli_k8s_pod *p,
                          const td_cfg_prefill *pc, int s)
{
    char stage[16], url[64], cname[32];
    snprintf(stage, sizeof stage, "%d", s);
    snprintf(url, sizeof url, "tcp://%s:%d", s == 0 ? "0.0.0.0" : "127.0.0.1", pc->port);
    snprintf(cname, sizeof cname, "stage-%d", s);
    const char *argv[] = {"tandem-prefill",
                          "--config",
                          CFG_PATH,
                          "--instance",
                          pc->name,
                          "--stage",
                          stage,
                          "--name",
                          "$(POD_NAME)",
                          "--advertise",
                          "$(POD_IP)",
                          s == 0 ? "--listen" : "--leader",
                          url};
    int ctr = cli_k8s_container(d, list, p, cname, argv, 13);
    if (s == 0) {
        container_port(d, cli_k8s_put_seq(d, ctr, "ports"), "control", pc->port);
        /* stage 0 profiles itself at its first start (profile_budget_ms) */
        int startup = 120 + pc->profile_budget_ms / 5000;
        cli_k8s_exec_probe(d, ctr, "startupProbe", true, pc->port, 5, startup);
        cli_k8s_exec_probe(d, ctr, "readinessProbe", false, pc->port, 5, 2);
        cli_k8s_exec_probe(d, ctr, "livenessProbe", true, pc->port, 15, 4);
    }
    int64_t bytes = cli_k8s_prefill_stage_bytes(x->m, pc, &x->c->cfg->decode[0], s);
    cli_k8s_resources(d, ctr, pc->threads, bytes, x->c->cfg->backend == TD_CFG_BACKEND_CUDA);
}

static int prefill(mf_ctx *x, const td_cfg_prefill *pc, const char *inst)
{
    char name[160];
    snprintf(name, sizeof name, "%s-%s", x->o->base, inst);
    cli_k8s_doc *d = begin(x, "apps/v1", "Deployment", name, "prefill", inst);
    if (!d) return TD_ENOMEM;
    int spec = cli_k8s_put_map(d, 1, "spec");
    cli_k8s_put_num(d, spec, "replicas", 1);
    int strat = cli_k8s_put_map(d, spec, "strategy");
    cli_k8s_put_str(d, strat, "type", "RollingUpdate");
    int ru = cli_k8s_put_map(d, strat, "rollingUpdate");
    cli_k8s_put_num(d, ru, "maxSurge", 1);
    cli_k8s_put_num(d, ru, "maxUnavailable", 0);
    int sel = cli_k8s_put_map(d, spec, "selector");
    selector(x, d, cli_k8s_put_map(d, sel, "matchLabels"), "prefill", inst);
    int pspec = pod_template(x, d, spec, "prefill", inst, false, grace_of(x, pc->drain_timeout_ms));
    cli_k8s_put_bool(d, pspec, "shareProcessNamespace", true);
    cli_k8s_pod p = {.o = x->o, .c = x->c, .m = x->m, .shm = true, .shm_bytes = 0};
    cli_k8s_init_fetch(d, pspec, &p);
    int list = cli_k8s_put_seq(d, pspec, "containers");
    for (int s = 0; s < pc->pp; s++)
        prefill_stage(x, d, list, &p, pc, s);
    cli_k8s_volumes(d, pspec, &p);
    return pdb(x, name, "prefill", inst);
}

/* A dp group's members (decode[i], decode[j] of one group): one pod, one object name. */
static bool same_group(const td_cfg *cfg, int i, int j)
{
    if (i >= cfg->n_decode || j >= cfg->n_decode) return false;
    const td_cfg_decode *a = &cfg->decode[i], *b = &cfg->decode[j];
    return a->dp > 1 && b->dp > 1 && !strcmp(a->dp_group, b->dp_group);
}

/* Every instance's DNS-safe object name (a dp group member's: its group's), checked for
 * length and clashes. */
static int instance_names(const char *base, const td_cfg *cfg, char (*names)[64])
{
    static const char *const taken[] = {"router", "join", "config", "secret"};
    int n = cfg->n_decode + cfg->n_prefill;
    for (int i = 0; i < n; i++) {
        const char *in = i >= cfg->n_decode      ? cfg->prefill[i - cfg->n_decode].name
                         : cfg->decode[i].dp > 1 ? cfg->decode[i].dp_group
                                                 : cfg->decode[i].name;
        if (!cli_k8s_dns_name(in, names[i], 64)) {
            fprintf(stderr,
                    "tandem k8s: instance name '%s' does not make a Kubernetes name (lower case "
                    "letters, digits and '-', starting and ending with a letter or digit)\n",
                    in);
            return TD_EINVAL;
        }
        if (strlen(base) + 1 + strlen(names[i]) > INST_NAME_MAX) {
            fprintf(stderr,
                    "tandem k8s: %s-%s is longer than %d bytes (a pod's name, under which it "
                    "joins, must stay within 63): use a shorter --name or instance name\n",
                    base, names[i], INST_NAME_MAX);
            return TD_EINVAL;
        }
        for (int j = 0; j < 4; j++)
            if (!strcmp(names[i], taken[j])) {
                fprintf(stderr, "tandem k8s: instance name '%s' is taken by the %s-%s object\n", in,
                        base, taken[j]);
                return TD_EINVAL;
            }
        for (int j = 0; j < i; j++)
            if (!same_group(cfg, i, j) && !strcmp(names[i], names[j])) {
                fprintf(stderr, "tandem k8s: two instances make the same Kubernetes name '%s'\n",
                        names[i]);
                return TD_EINVAL;
            }
    }
    return 0;
}

int cli_k8s_check_names(const char *base, const td_cfg *cfg)
{
    char(*names)[64] = calloc((size_t)(cfg->n_decode + cfg->n_prefill), sizeof *names);
    if (!names) return TD_ENOMEM;
    int rc = instance_names(base, cfg, names);
    free(names);
    return rc;
}

int cli_k8s_manifests(const cli_k8s_opts *o, const cli_k8s_cluster *c, const cli_k8s_model *m,
                      cli_k8s_out *out)
{
    mf_ctx x = {.o = o, .c = c, .m = m, .out = out};
    uint64_t h = fnv1a(fnv1a(0xcbf29ce484222325ull, c->text), c->template_text);
    snprintf(x.hash, sizeof x.hash, "%016llx", (unsigned long long)h);
    char(*names)[64] = calloc((size_t)(c->cfg->n_decode + c->cfg->n_prefill), sizeof *names);
    if (!names) return TD_ENOMEM;
    int rc = instance_names(o->base, c->cfg, names);
    if (!rc && o->ns) {
        int meta;
        cli_k8s_doc *d = cli_k8s_out_add(out, "v1", "Namespace", o->ns, NULL, &meta);
        if (!d)
            rc = TD_ENOMEM;
        else
            cli_k8s_labels(d, cli_k8s_put_map(d, meta, "labels"), o->base, "namespace", NULL);
    }
    if (!rc) rc = config_map(&x);
    if (!rc) rc = router(&x);
    for (int i = 0; !rc && i < c->cfg->n_decode; i++) {
        const td_cfg_decode *dc = &c->cfg->decode[i];
        if (dc->dp > 1 && dc->dp_rank > 0) continue; /* in its group's pod, with member 0 */
        rc = decode(&x, dc, dc->dp > 1 ? dc->dp : 1, names[i]);
    }
    for (int i = 0; !rc && i < c->cfg->n_prefill; i++)
        rc = prefill(&x, &c->cfg->prefill[i], names[c->cfg->n_decode + i]);
    free(names);
    return rc;
}
