/* up_cluster.c: the cluster of a `tandem up`: its YAML (and the copy --port N writes), its
 * name and run directory, the table of its processes with their log and pid files, and
 * what the pid files say about an earlier run.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "up_config.h"
#include "td_err.h"
#include "up_int.h"

/* "HOST:PORT" or "[V6]:PORT" -> host to ask and endpoint; port_override (nonzero) replaces
 * PORT. */
static int parse_listen(up_cluster *c, const char *listen, int port_override)
{
    char host[256];
    const char *colon;
    if (listen[0] == '[') {
        const char *e = strchr(listen, ']');
        if (!e || e[1] != ':' || (size_t)(e - listen - 1) >= sizeof host) return TD_EINVAL;
        snprintf(host, sizeof host, "%.*s", (int)(e - listen - 1), listen + 1);
        colon = e + 1;
    } else {
        colon = strrchr(listen, ':');
        if (!colon || (size_t)(colon - listen) >= sizeof host) return TD_EINVAL;
        snprintf(host, sizeof host, "%.*s", (int)(colon - listen), listen);
    }
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (*end || port < 1 || port > 65535) return TD_EINVAL;
    c->port = port_override ? port_override : (int)port;
    if (!strcmp(host, "0.0.0.0") || !host[0])
        snprintf(c->host, sizeof c->host, "127.0.0.1");
    else if (!strcmp(host, "::"))
        snprintf(c->host, sizeof c->host, "::1");
    else
        snprintf(c->host, sizeof c->host, "%s", host);
    bool v6 = strchr(c->host, ':') != NULL;
    snprintf(c->endpoint, sizeof c->endpoint, "%s://%s%s%s:%d",
             c->cfg->router.tls_cert ? "https" : "http", v6 ? "[" : "", c->host, v6 ? "]" : "",
             c->port);
    return 0;
}

void up_cluster_close(up_cluster *c)
{
    td_cfg_free(c->cfg);
    free(c->p);
    memset(c, 0, sizeof *c);
}

/* Loads the YAML and lays out the processes and their files; port (--port N, 0: none)
 * names the cluster STEM-N and moves its endpoint (up_cluster_derive then writes the copy of
 * the YAML its processes read). Prints its errors. */
int up_cluster_open(up_cluster *c, const char *path, int port)
{
    memset(c, 0, sizeof *c);
    char err[512];
    int rc = td_cfg_load(path, &c->cfg, err, sizeof err);
    if (rc) {
        fprintf(stderr, "tandem: %s\n", err);
        return rc;
    }
    if (!realpath(path, c->cfg_path)) snprintf(c->cfg_path, sizeof c->cfg_path, "%s", path);
    const char *base = strrchr(c->cfg_path, '/');
    base = base ? base + 1 : c->cfg_path;
    if (snprintf(c->name, sizeof c->name, "%s", base) >= (int)sizeof c->name)
        snprintf(c->name, sizeof c->name, "cluster");
    char *dot = strrchr(c->name, '.');
    if (dot && dot != c->name && (!strcmp(dot, ".yaml") || !strcmp(dot, ".yml"))) *dot = 0;
    c->port_override = port;
    if (port) {
        size_t l = strlen(c->name);
        if (l > sizeof c->name - 8) l = sizeof c->name - 8;
        snprintf(c->name + l, sizeof c->name - l, "-%d", port);
    }
    if (snprintf(c->dir, sizeof c->dir, "%s/%s", c->cfg->run_dir, c->name) >= (int)sizeof c->dir ||
        snprintf(c->up_pidfile, sizeof c->up_pidfile, "%s/up.pid", c->dir) >=
            (int)sizeof c->up_pidfile) {
        fprintf(stderr, "tandem: run directory path too long\n");
        up_cluster_close(c);
        return TD_ERANGE;
    }
    if (parse_listen(c, c->cfg->router.listen, port)) {
        fprintf(stderr, "tandem: %s: cannot parse router.listen '%s'\n", path,
                c->cfg->router.listen);
        up_cluster_close(c);
        return TD_EINVAL;
    }
    const char *env = getenv("TANDEM_BIN");
    if (env && *env) {
        snprintf(c->bindir, sizeof c->bindir, "%s", env);
    } else {
        ssize_t l = readlink("/proc/self/exe", c->bindir, sizeof c->bindir - 1);
        c->bindir[l > 0 ? l : 0] = 0;
        char *slash = strrchr(c->bindir, '/');
        if (slash)
            *slash = 0;
        else
            snprintf(c->bindir, sizeof c->bindir, ".");
    }
    int n = 1;
    for (int i = 0; i < c->cfg->n_decode; i++)
        n += c->cfg->decode[i].tp;
    for (int i = 0; i < c->cfg->n_prefill; i++)
        n += c->cfg->prefill[i].pp;
    c->p = calloc((size_t)n, sizeof *c->p);
    if (!c->p) {
        up_cluster_close(c);
        return TD_ENOMEM;
    }
    for (int i = 0; i < c->cfg->n_decode; i++)
        for (int r = 0; r < c->cfg->decode[i].tp; r++) {
            up_proc *p = &c->p[c->n++];
            p->role = "decode";
            snprintf(p->instance, sizeof p->instance, "%s", c->cfg->decode[i].name);
            p->rank = r;
        }
    for (int i = 0; i < c->cfg->n_prefill; i++)
        for (int s = 0; s < c->cfg->prefill[i].pp; s++) {
            up_proc *p = &c->p[c->n++];
            p->role = "prefill";
            snprintf(p->instance, sizeof p->instance, "%s", c->cfg->prefill[i].name);
            p->rank = s;
        }
    up_proc *rt = &c->p[c->n++];
    rt->role = "router";
    snprintf(rt->instance, sizeof rt->instance, "router");
    for (int i = 0; i < c->n; i++) {
        up_proc *p = &c->p[i];
        if (snprintf(p->log, sizeof p->log, "%s/%s-%s-%d.log", c->dir, p->role, p->instance,
                     p->rank) >= (int)sizeof p->log ||
            snprintf(p->pidfile, sizeof p->pidfile, "%s/%s-%s-%d.pid", c->dir, p->role, p->instance,
                     p->rank) >= (int)sizeof p->pidfile) {
            fprintf(stderr, "tandem: run directory path too long\n");
            up_cluster_close(c);
            return TD_ERANGE;
        }
    }
    return 0;
}

/* --port N: writes the copy of the YAML with the ports moved into the run directory
 * (DIR/BASENAME) and loads the configuration from it; every process is started on it.
 * On error nothing of it is left. */
int up_cluster_derive(up_cluster *c)
{
    char path[PATH_MAX], err[512];
    const char *base = strrchr(c->cfg_path, '/');
    base = base ? base + 1 : c->cfg_path;
    if (snprintf(path, sizeof path, "%s/%s", c->dir, base) >= (int)sizeof path) {
        fprintf(stderr, "tandem: run directory path too long\n");
        return TD_ERANGE;
    }
    int rc = up_config_derive(c->cfg_path, c->port_override, path, err, sizeof err);
    if (rc) {
        fprintf(stderr, "tandem: %s\n", err);
        return rc;
    }
    td_cfg *cfg;
    if ((rc = td_cfg_load(path, &cfg, err, sizeof err))) {
        fprintf(stderr, "tandem: the copy of %s for --port %d does not load: %s\n", c->cfg_path,
                c->port_override, err);
        unlink(path);
        return rc;
    }
    td_cfg_free(c->cfg);
    c->cfg = cfg;
    snprintf(c->cfg_path, sizeof c->cfg_path, "%s", path);
    return 0;
}

/* Every binary the cluster needs is there and executable (checked before anything runs,
 * so a missing one never leaves a half-started cluster behind). Prints the first missing. */
int up_check_binaries(const up_cluster *c)
{
    for (int i = 0; i < c->n; i++) {
        char bin[PATH_MAX];
        if (snprintf(bin, sizeof bin, "%s/tandem-%s", c->bindir, c->p[i].role) >= (int)sizeof bin)
            return TD_ERANGE;
        if (access(bin, X_OK)) {
            fprintf(stderr,
                    "tandem: cannot run %s: %s (set TANDEM_BIN to the directory of the "
                    "tandem binaries)\n",
                    bin, strerror(errno));
            return TD_ENOENT;
        }
    }
    return 0;
}

/* Fills pid/start from the pid files (processes started by someone else). */
void up_load_pids(up_cluster *c)
{
    for (int i = 0; i < c->n; i++) {
        up_proc *p = &c->p[i];
        p->child = false;
        p->exited = false;
        p->restarts = 0;
        if (up_read_pidfile(p->pidfile, &p->pid, &p->start, &p->restarts)) {
            p->pid = 0;
            p->pending = false;
        } else {
            p->pending = p->pid == 0;
        }
    }
}

/* The supervising `tandem up` recorded in up.pid if it still runs, else 0. */
pid_t up_supervisor_pid(const up_cluster *c)
{
    up_proc sup = {.role = "up"};
    if (up_read_pidfile(c->up_pidfile, &sup.pid, &sup.start, NULL) || !up_proc_alive(&sup))
        return 0;
    return sup.pid;
}

/* Any process of the cluster still running from an earlier up? */
bool up_already_running(up_cluster *c)
{
    up_load_pids(c);
    for (int i = 0; i < c->n; i++)
        if (up_proc_alive(&c->p[i])) return true;
    return up_supervisor_pid(c) != 0;
}
