/* cmd_up.c: `tandem up|down|status`: run and supervise every process of a cluster YAML on
 * this machine.
 *
 *   tandem up [-d] FILE [--port N] [--timeout S] [--grace S] [--no-restart] [--reprofile]
 *   tandem down FILE [--port N] [--grace S]
 *   tandem status FILE [--port N] [--json] [--instances]
 *
 * Processes, started in this order (each one waits for or retries its peers by itself, so
 * the order only makes the logs read naturally): every rank of every decode instance
 * (tandem-decode --config FILE --instance NAME --rank R), every stage of every prefill
 * instance (tandem-prefill --config FILE --instance NAME --stage S; stage 0 serves the
 * instance's control socket, the others join it), then the router (tandem-router --config
 * FILE). Every process of the YAML runs on this machine, whatever its host (several hosts:
 * deploy/start-*.sh on each). Binaries are taken from $TANDEM_BIN (a directory) or the
 * directory of this `tandem` executable; all of them are checked before anything starts.
 *
 * Ports: --port N moves the cluster: the router listens on N, the control ports of the
 * decode instances and then the prefill instances are N+1, N+2, ... (up_config.h); up
 * writes that copy of the YAML into the run directory and starts every process on it. The
 * cluster is then named <file stem>-N (its run directory), so that two clusters of one YAML
 * run side by side; down and status take the same --port. Before anything starts, up binds
 * every listening port once (router.listen, each decode rank 0's and prefill stage 0's
 * control port) and stops with a clear error if one is taken.
 *
 * Run directory: RUN_DIR/<file stem>/ (run_dir from the YAML): per process
 * <role>-<instance>-<rank>.log (stdout + stderr, truncated at each up, appended to at each
 * restart; for a prefill stage, rank is the stage) and .pid ("PID STARTTIME RESTARTS": the
 * start time from /proc/PID/stat tells a pid that was reused from the process we started;
 * PID 0 while the supervisor waits to restart it), plus up.pid (the supervising `tandem up`
 * itself) and, with -d, up.log (what the detached supervisor prints once the cluster is up).
 *
 * Start-up: processes start in their own session (setsid) with stdin from /dev/null; up
 * waits until the router's GET /health answers 200 and, with prefill instances, every
 * prefill stage 0 answers a control-plane HealthRequest with ready = true (all its stages
 * joined, model loaded, start-up profile done) (--timeout, default 300 s), then prints the
 * endpoint and an example request (curl). --reprofile passes --reprofile to each prefill
 * stage 0 at its first start (a new start-up profile, not the cached one). If a process
 * exits meanwhile, the timeout passes or a signal arrives, up prints the log tail of the
 * process concerned, stops everything and exits non-zero (a process that cannot start is a
 * configuration error: restarting it would only loop).
 *
 * Supervision, once the cluster is up: a child that dies (any exit, any signal) is reported
 * with its log tail and started again with the same command line after a back-off: 0.5 s,
 * doubled at each death up to 30 s, back to 0.5 s once the process had run 60 s. Nothing
 * else is restarted: every process rejoins its peers by itself (docs/deploy.md). The
 * restart count is in the pid file (tandem status). --no-restart keeps the strict mode: a
 * child that dies stops the whole cluster, exit status 1. Until SIGINT/SIGTERM/SIGHUP, then
 * everything is stopped. With -d the supervisor detaches: `up` forks before starting
 * anything; the child (its own session, up.pid) starts and supervises the cluster, the
 * parent relays the start-up and exits once the child reports the cluster up (0) or gives
 * up (1). The detached supervisor then logs to up.log; `tandem down` stops it, which stops
 * its processes.
 *
 * Stopping: SIGTERM to the router's process group first, which drains (requests in flight
 * may finish, up to router.drain_timeout_ms; SIGKILL after max(--grace, drain + 5 s)), then
 * to the prefill stages' and decode ranks' groups, --grace seconds (default 10), then
 * SIGKILL; pid files are removed. `down` first stops the supervisor (up.pid; SIGKILL if it
 * has not gone once those bounds and 15 s more passed), then whatever the pid files still
 * name.
 *
 * Status: per process "ROLE INSTANCE RANK PID RESTARTS STATE", STATE running (pid file,
 * process alive and the same one), restarting (the supervisor waits to start it again),
 * dead (pid file but the process is gone) or stopped (no pid file); --json prints one
 * object {"cluster", "run_dir", "endpoint", "supervisor", "processes": [...]}.
 *
 * This file: the commands (options, up / down / status, what they print); the rest is in
 * up_cluster.c, up_proc.c, up_health.c and up_supervise.c (up_int.h).
 */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "td_err.h"
#include "up_config.h"
#include "up_int.h"

volatile sig_atomic_t up_signal;

static void on_signal(int sig)
{
    up_signal = sig;
}

static int parse_seconds(const char *flag, const char *v, double *out)
{
    char *e;
    double d = strtod(v, &e);
    if (e == v || *e || !(d >= 0) || d > 86400) {
        fprintf(stderr, "tandem: bad value for %s: '%s'\n", flag, v);
        return TD_EINVAL;
    }
    *out = d;
    return 0;
}

static int parse_port(const char *v, int *out)
{
    char *e;
    long p = strtol(v, &e, 10);
    if (e == v || *e || p < 1 || p > 65535) {
        fprintf(stderr, "tandem: bad value for --port: '%s' (1..65535)\n", v);
        return TD_EINVAL;
    }
    *out = (int)p;
    return 0;
}

static void usage_up(void)
{
    fprintf(stderr,
            "usage: tandem up [-d] FILE [--port N] [--timeout S] [--grace S] [--no-restart]\n"
            "                 [--reprofile]\n"
            "       tandem down FILE [--port N] [--grace S]\n"
            "       tandem status FILE [--port N] [--json] [--instances]\n"
            "  up: start every process of the cluster YAML on this machine (decode ranks,\n"
            "      prefill stages, router), wait for the router's /health and every prefill\n"
            "      stage 0's ready, print the endpoint, then supervise until Ctrl-C/SIGTERM:\n"
            "      a process that dies is restarted (back-off 0.5 s doubling to 30 s)\n"
            "  -d: supervise in the background (a detached 'tandem up'); returns once the\n"
            "      cluster is ready; 'tandem down' stops the supervisor and every process\n"
            "  --no-restart  a process that dies stops the whole cluster (exit status 1)\n"
            "  --timeout S  start-up bound (default 300)   --grace S  SIGTERM to SIGKILL (10)\n"
            "  --port N  the router on port N, the control ports of the decode instances and\n"
            "      then the prefill instances on N+1, N+2, ... (a copy of the YAML in the run\n"
            "      directory); the cluster is named STEM-N: give down and status the same --port\n"
            "  --reprofile  every prefill stage 0 profiles itself anew instead of re-using\n"
            "      its cached start-up profile\n"
            "  up checks that the router's and the control ports are free before it starts\n"
            "  status: ROLE INSTANCE RANK PID RESTARTS STATE per process of this machine;\n"
            "      --instances: the router's live set instead (GET /instances: with\n"
            "      router.membership, instances started anywhere), ROLE NAME URL STATE ORIGIN\n"
            "  binaries: $TANDEM_BIN, else the directory of this tandem executable\n");
}

static int parse_opts(int argc, char **argv, up_opts *o, bool is_up, bool allow_json)
{
    *o = (up_opts){.timeout_s = 300, .grace_s = 10, .restart = true};
    for (int i = 0; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
            usage_up();
            return 1;
        } else if (is_up && (!strcmp(f, "-d") || !strcmp(f, "--detach"))) {
            o->detach = true;
        } else if (is_up && !strcmp(f, "--no-restart")) {
            o->restart = false;
        } else if (is_up && !strcmp(f, "--reprofile")) {
            o->reprofile = true;
        } else if (!strcmp(f, "--port")) {
            if (!v) {
                fprintf(stderr, "tandem: --port needs a value\n");
                return TD_EINVAL;
            }
            rc = parse_port(v, &o->port);
            i++;
        } else if (allow_json && !strcmp(f, "--json")) {
            o->json = true;
        } else if (allow_json && !strcmp(f, "--instances")) {
            o->instances = true;
        } else if (!strcmp(f, "--timeout") || !strcmp(f, "--grace")) {
            if (!v) {
                fprintf(stderr, "tandem: %s needs a value\n", f);
                return TD_EINVAL;
            }
            rc = parse_seconds(f, v, f[2] == 't' ? &o->timeout_s : &o->grace_s);
            i++;
        } else if (f[0] == '-' || o->file) {
            fprintf(stderr, "tandem: unexpected argument '%s'\n", f);
            usage_up();
            return TD_EINVAL;
        } else {
            o->file = f;
        }
        if (rc) return rc;
    }
    if (!o->file) {
        usage_up();
        return TD_EINVAL;
    }
    return 0;
}

/* The example request printed once the cluster is up: a short greedy chat completion. */
static void print_example(const up_cluster *c)
{
    bool v6 = strchr(c->host, ':') != NULL; /* curl reads [ ] as a glob without -g */
    const td_cfg_router *r = &c->cfg->router;
    printf(
        "tandem: try: curl -s%s%s%s %s/v1/chat/completions -H 'Content-Type: application/json'%s "
        "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of "
        "France?\"}], \"max_tokens\": 32, \"temperature\": 0}'\n",
        v6 ? " -g" : "", r->tls_cert ? " --cacert CA.pem" : "",
        r->tls_client_ca ? " --cert CLIENT.pem --key CLIENT.key" : "", c->endpoint,
        c->cfg->router.api_key[0] ? " -H 'Authorization: Bearer YOUR_API_KEY'" : "");
}

int cmd_up(int argc, char **argv)
{
    up_opts o;
    int rc = parse_opts(argc, argv, &o, true, false);
    if (rc) return rc > 0 ? 0 : rc;
    up_cluster c;
    if ((rc = up_cluster_open(&c, o.file, o.port))) return rc;
    if ((rc = up_check_binaries(&c))) {
        up_cluster_close(&c);
        return rc;
    }
    char port_arg[24] = "";
    if (o.port) snprintf(port_arg, sizeof port_arg, " --port %d", o.port);
    if ((rc = up_mkdir_p(c.dir))) {
        fprintf(stderr, "tandem: cannot create run directory %s: %s\n", c.dir, strerror(errno));
        up_cluster_close(&c);
        return rc;
    }
    if (up_already_running(&c)) {
        fprintf(stderr,
                "tandem: cluster '%s' is already running (run directory %s); "
                "'tandem down %s%s' first\n",
                c.name, c.dir, o.file, port_arg);
        up_cluster_close(&c);
        return TD_ESTATE;
    }
    c.reprofile = o.reprofile;
    /* before anything starts (a prefill stage 0 profiles itself for ~20 s first) */
    if (o.port && (rc = up_cluster_derive(&c))) {
        rmdir(c.dir); /* if this up made it and it holds nothing (the copy is removed) */
        up_cluster_close(&c);
        return rc;
    }
    if ((rc = up_ports_check(c.cfg))) {
        if (o.port) unlink(c.cfg_path); /* the copy up_cluster_derive wrote */
        rmdir(c.dir);
        up_cluster_close(&c);
        return rc;
    }
    up_signal = 0;
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    int notify = -1;
    if (o.detach) {
        bool parent;
        rc = up_detach(&notify, &parent);
        if (rc || parent) {
            up_cluster_close(&c);
            return rc;
        }
    }
    for (int i = 0; i < c.n; i++) {
        c.p[i].pid = 0;
        unlink(c.p[i].pidfile);
    }
    up_write_pidfile(c.up_pidfile, getpid(), 0);

    fprintf(stderr, "tandem: starting cluster '%s' (%d processes, logs in %s)\n", c.name, c.n,
            c.dir);
    double t0 = up_now_s();
    rc = up_start_cluster(&c, &o, t0);
    if (rc) {
        up_stop_all(&c, o.grace_s);
        unlink(c.up_pidfile);
        fprintf(stderr, "tandem: cluster '%s' did not come up; every process is stopped\n", c.name);
        up_cluster_close(&c);
        if (notify >= 0) close(notify);
        return rc;
    }
    printf("tandem: cluster '%s' is up in %.1f s: %s (OpenAI API at %s/v1)\n", c.name,
           up_now_s() - t0, c.endpoint, c.endpoint);
    print_example(&c);
    fflush(stdout);
    if (o.detach)
        up_detach_done(&c, &o, port_arg, notify);
    else
        fprintf(stderr, "tandem: Ctrl-C or SIGTERM stops the cluster%s\n",
                o.restart ? "; a process that dies is restarted" : "");
    rc = up_supervise(&c, &o);
    if (!rc) fprintf(stderr, "tandem: %s: stopping the cluster\n", strsignal(up_signal));
    int n = up_stop_all(&c, o.grace_s);
    unlink(c.up_pidfile);
    fprintf(stderr, "tandem: cluster '%s' stopped (%d processes)\n", c.name, n);
    up_cluster_close(&c);
    return rc;
}

int cmd_down(int argc, char **argv)
{
    up_opts o;
    int rc = parse_opts(argc, argv, &o, false, false);
    if (rc) return rc > 0 ? 0 : rc;
    up_cluster c;
    if ((rc = up_cluster_open(&c, o.file, o.port))) return rc;
    int n = 0;
    up_proc sup = {.role = "up"};
    if (!up_read_pidfile(c.up_pidfile, &sup.pid, &sup.start, NULL) && up_proc_alive(&sup)) {
        /* the supervising up (foreground or -d): it stops its own processes */
        kill(sup.pid, SIGTERM);
        up_cont_if_stopped(&sup);
        /* its up_stop_all: the router's drain bound, then the others' grace */
        double drain_s = c.cfg->router.drain_timeout_ms / 1000.0 + 5;
        double end = up_now_s() + fmax(o.grace_s, drain_s) + o.grace_s + 15;
        while (up_proc_alive(&sup) && up_now_s() < end)
            up_sleep_ms(50);
        if (up_proc_alive(&sup)) {
            /* so that it restarts nothing while its processes are stopped below */
            fprintf(stderr, "tandem: the supervising 'tandem up' (pid %d) did not stop: SIGKILL\n",
                    (int)sup.pid);
            kill(sup.pid, SIGKILL);
            end = up_now_s() + 10;
            while (up_proc_alive(&sup) && up_now_s() < end)
                up_sleep_ms(50);
        }
        n++;
    }
    unlink(c.up_pidfile);
    up_load_pids(&c);
    n += up_stop_all(&c, o.grace_s);
    if (n)
        printf("tandem: cluster '%s' stopped\n", c.name);
    else
        printf("tandem: cluster '%s' was not running\n", c.name);
    up_cluster_close(&c);
    return 0;
}

/* --instances: the router's live set (GET /instances), its JSON as it is or one line per
 * instance: ROLE NAME URL STATE ORIGIN LOAD. 1 when the router does not answer. */
static int print_live_set(const up_cluster *c, bool as_json)
{
    json_t *live = up_live_set(c, 5000);
    if (!live) {
        fprintf(stderr, "tandem: the router at %s does not answer GET /instances\n", c->endpoint);
        return 1;
    }
    if (as_json) {
        char *s = json_dumps(live, JSON_COMPACT);
        if (s) printf("%s\n", s);
        free(s);
        json_decref(live);
        return 0;
    }
    const char *roles[] = {"decode", "prefill"};
    for (int k = 0; k < 2; k++) {
        size_t i;
        json_t *x;
        json_array_foreach(json_object_get(live, roles[k]), i, x)
        {
            bool alive = json_is_true(json_object_get(x, "alive"));
            bool draining = json_is_true(json_object_get(x, "draining"));
            printf("%-8s %-16s %-28s %-8s %-6s running %lld waiting %lld\n", roles[k],
                   json_string_value(json_object_get(x, "name")),
                   json_string_value(json_object_get(x, "url")),
                   !alive ? "dead" : draining ? "leaving" : "serving",
                   json_is_true(json_object_get(x, "joined")) ? "joined" : "yaml",
                   (long long)json_integer_value(json_object_get(x, "running")),
                   (long long)json_integer_value(json_object_get(x, "waiting")));
        }
    }
    json_decref(live);
    return 0;
}

int cmd_status(int argc, char **argv)
{
    up_opts o;
    int rc = parse_opts(argc, argv, &o, false, true);
    if (rc) return rc > 0 ? 0 : rc;
    up_cluster c;
    if ((rc = up_cluster_open(&c, o.file, o.port))) return rc;
    if (o.instances) { /* the router's live set instead of this machine's processes */
        rc = print_live_set(&c, o.json);
        up_cluster_close(&c);
        return rc;
    }
    up_load_pids(&c);
    pid_t sup = up_supervisor_pid(&c);
    json_t *arr = json_array();
    for (int i = 0; i < c.n; i++) {
        up_proc *p = &c.p[i];
        const char *state = p->pending         ? (sup ? "restarting" : "dead")
                            : !p->pid          ? "stopped"
                            : up_proc_alive(p) ? "running"
                                               : "dead";
        if (o.json) {
            json_array_append_new(arr,
                                  json_pack("{s:s, s:s, s:i, s:o, s:i, s:s, s:s}", "role", p->role,
                                            "instance", p->instance, "rank", p->rank, "pid",
                                            p->pid ? json_integer(p->pid) : json_null(), "restarts",
                                            p->restarts, "state", state, "log", p->log));
        } else {
            char pid[16];
            snprintf(pid, sizeof pid, p->pid ? "%d" : "-", (int)p->pid);
            printf("%-8s %-16s %4d %8s %3d  %s\n", p->role, p->instance, p->rank, pid, p->restarts,
                   state);
        }
    }
    if (o.json) {
        json_t *root = json_pack("{s:s, s:s, s:s, s:{s:o, s:s}, s:o}", "cluster", c.name, "run_dir",
                                 c.dir, "endpoint", c.endpoint, "supervisor", "pid",
                                 sup ? json_integer(sup) : json_null(), "state",
                                 sup ? "running" : "stopped", "processes", arr);
        char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
        if (s) printf("%s\n", s);
        free(s);
        json_decref(root);
    } else {
        json_decref(arr);
    }
    up_cluster_close(&c);
    return 0;
}
