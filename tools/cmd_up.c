/* cmd_up.c: `tandem up|down|status`: run and supervise every process of a cluster YAML on
 * this machine.
 *
 *   tandem up [-d] FILE [--port N] [--timeout S] [--grace S] [--no-restart] [--reprofile]
 *   tandem down FILE [--port N] [--grace S]
 *   tandem status FILE [--port N] [--json]
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
 */
#define _GNU_SOURCE /* memmem, strcasestr, pipe2 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "config.h"
#include "ctrl.h"
#include "td_err.h"
#include "http_client.h"
#include "up_config.h"

typedef struct {
    const char *role; /* "decode" | "prefill" | "router" */
    char instance[TD_CFG_NAME_MAX + 1];
    int rank; /* decode rank, prefill stage, 0 for the router */
    char log[PATH_MAX], pidfile[PATH_MAX];
    pid_t pid;                /* 0: none (or, from a pid file, waiting to be restarted) */
    unsigned long long start; /* starttime of pid (clock ticks since boot) */
    bool child, exited;       /* started by this process / reaped */
    int wstatus;              /* when exited */
    int restarts;             /* times the supervisor started it again (in the pid file) */
    bool pending;             /* pid file "0 0 N": the supervisor waits to restart it */
    double started_at;        /* now_s() of its last start (supervisor) */
    double backoff_s;         /* the delay before its last restart; 0: none yet */
    double restart_at;        /* now_s() when it is started again; 0: no restart pending */
    pid_t last_pid;           /* the process before the pending restart, and how it ended */
    char last_exit[128];
} up_proc;

/* Restart back-off of the supervisor: first delay, cap, and how long a process must have
 * run for the next delay to start again from the first. */
#define UP_BACKOFF_MIN_S   0.5
#define UP_BACKOFF_MAX_S   30.0
#define UP_BACKOFF_RESET_S 60.0

typedef struct {
    td_cfg *cfg;
    char cfg_path[PATH_MAX]; /* absolute */
    char name[256];          /* the file stem */
    char dir[PATH_MAX];      /* run_dir/name */
    char bindir[PATH_MAX];
    char up_pidfile[PATH_MAX];
    up_proc *p; /* (n) decode ranks, then prefill stages (YAML order), then the router */
    int n;
    char host[256]; /* where /health is asked (a wildcard listen becomes loopback) */
    int port;
    char endpoint[300]; /* http://HOST:PORT as the user reaches it */
    int port_override;  /* --port N (0: none): the cluster is named STEM-N, runs a copy */
    bool reprofile;     /* --reprofile: prefill stage 0 profiles anew at its first start */
} cluster;

static volatile sig_atomic_t g_signal;

static void on_signal(int sig)
{
    g_signal = sig;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int mkdir_p(const char *path)
{
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return TD_ERANGE;
    for (char *s = buf + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(buf, 0755) && errno != EEXIST) return TD_EIO;
        *s = '/';
    }
    if (mkdir(buf, 0755) && errno != EEXIST) return TD_EIO;
    return 0;
}

/* State and start time of a process from /proc/PID/stat; TD_ENOENT if there is none. */
static int proc_stat(pid_t pid, char *state, unsigned long long *start)
{
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return TD_ENOENT;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return TD_ENOENT;
    /* after ")": state (field 3) ... starttime (field 22) */
    char st;
    unsigned long long v = 0;
    if (sscanf(p + 1,
               " %c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu",
               &st, &v) != 2)
        return TD_ENOENT;
    *state = st;
    *start = v;
    return 0;
}

/* The process recorded in p still runs (same pid and start time, not a zombie). */
static bool proc_alive(up_proc *p)
{
    if (p->pid <= 0 || p->exited) return false;
    if (p->child) {
        int ws;
        pid_t r = waitpid(p->pid, &ws, WNOHANG);
        if (r == p->pid) {
            p->exited = true;
            p->wstatus = ws;
            return false;
        }
        return r == 0;
    }
    char st;
    unsigned long long start;
    if (proc_stat(p->pid, &st, &start)) return false;
    return st != 'Z' && st != 'X' && start == p->start;
}

/* "PID STARTTIME [RESTARTS]"; PID 0 (waiting for a restart) is returned as *pid = 0. */
static int read_pidfile(const char *path, pid_t *pid, unsigned long long *start, int *restarts)
{
    FILE *f = fopen(path, "r");
    if (!f) return TD_ENOENT;
    int ipid = -1, n = 0;
    int k = fscanf(f, "%d %llu %d", &ipid, start, &n);
    fclose(f);
    if (k < 2 || ipid < 0) return TD_EFORMAT;
    *pid = ipid;
    if (restarts) *restarts = k == 3 && n > 0 ? n : 0;
    return 0;
}

/* Writes "PID STARTTIME RESTARTS" atomically; pid 0 records a process waiting for a restart. */
static int write_pidfile(const char *path, pid_t pid, int restarts)
{
    char st;
    unsigned long long start = 0;
    if (pid > 0) proc_stat(pid, &st, &start);
    char tmp[PATH_MAX + 8];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return TD_EIO;
    fprintf(f, "%d %llu %d\n", (int)pid, start, restarts);
    if (fclose(f) || rename(tmp, path)) return TD_EIO;
    return 0;
}

/* Prints the last `lines` lines of a log file to stderr. */
static void print_tail(const char *path, int lines)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "  (no log at %s)\n", path);
        return;
    }
    char buf[8192];
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    long from = size > (long)sizeof buf - 1 ? size - (long)sizeof buf + 1 : 0;
    fseek(f, from, SEEK_SET);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    while (n && buf[n - 1] == '\n')
        buf[--n] = 0;
    char *s = buf + n;
    int seen = 0;
    while (s > buf && seen < lines)
        if (*--s == '\n') seen++;
    if (*s == '\n') s++;
    fprintf(stderr, "---- last lines of %s ----\n%s\n----\n", path, s);
}

static void proc_label(const up_proc *p, char *buf, size_t cap)
{
    if (!strcmp(p->role, "router"))
        snprintf(buf, cap, "router");
    else
        snprintf(buf, cap, "%s %s %s %d", p->role, p->instance,
                 strcmp(p->role, "prefill") ? "rank" : "stage", p->rank);
}

/* "HOST:PORT" or "[V6]:PORT" -> host to ask and endpoint; port_override (nonzero) replaces
 * PORT. */
static int parse_listen(cluster *c, const char *listen, int port_override)
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
    snprintf(c->endpoint, sizeof c->endpoint, "http://%s%s%s:%d", v6 ? "[" : "", c->host,
             v6 ? "]" : "", c->port);
    return 0;
}

static void cluster_close(cluster *c)
{
    td_cfg_free(c->cfg);
    free(c->p);
    memset(c, 0, sizeof *c);
}

/* Loads the YAML and lays out the processes and their files; port (--port N, 0: none)
 * names the cluster STEM-N and moves its endpoint (cluster_derive then writes the copy of
 * the YAML its processes read). Prints its errors. */
static int cluster_open(cluster *c, const char *path, int port)
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
        cluster_close(c);
        return TD_ERANGE;
    }
    if (parse_listen(c, c->cfg->router.listen, port)) {
        fprintf(stderr, "tandem: %s: cannot parse router.listen '%s'\n", path,
                c->cfg->router.listen);
        cluster_close(c);
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
        cluster_close(c);
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
            cluster_close(c);
            return TD_ERANGE;
        }
    }
    return 0;
}

/* Fills pid/start from the pid files (processes started by someone else). */
static void load_pids(cluster *c)
{
    for (int i = 0; i < c->n; i++) {
        up_proc *p = &c->p[i];
        p->child = false;
        p->exited = false;
        p->restarts = 0;
        if (read_pidfile(p->pidfile, &p->pid, &p->start, &p->restarts)) {
            p->pid = 0;
            p->pending = false;
        } else {
            p->pending = p->pid == 0;
        }
    }
}

/* Starts one process: log file, own session, pid file. note NULL: the first start (the log
 * is truncated); else a restart: the log is appended to, after the line note. */
static int spawn(cluster *c, up_proc *p, const char *note)
{
    char bin[PATH_MAX], rank[16];
    if (snprintf(bin, sizeof bin, "%s/tandem-%s", c->bindir, p->role) >= (int)sizeof bin)
        return TD_ERANGE;
    snprintf(rank, sizeof rank, "%d", p->rank);
    char *argv_decode[] = {bin,         "--config", c->cfg_path, "--instance",
                           p->instance, "--rank",   rank,        NULL};
    /* --reprofile: stage 0's first start only; a restart re-uses the profile it made */
    bool reprofile = c->reprofile && p->rank == 0 && !note;
    char *argv_prefill[] = {bin,         "--config", c->cfg_path, "--instance",
                            p->instance, "--stage",  rank,        reprofile ? "--reprofile" : NULL,
                            NULL};
    char *argv_router[] = {bin, "--config", c->cfg_path, NULL};
    char **argv = !strcmp(p->role, "router")    ? argv_router
                  : !strcmp(p->role, "prefill") ? argv_prefill
                                                : argv_decode;
    int logfd = open(p->log, O_WRONLY | O_CREAT | O_CLOEXEC | (note ? O_APPEND : O_TRUNC), 0644);
    if (logfd < 0) {
        fprintf(stderr, "tandem: cannot create %s: %s\n", p->log, strerror(errno));
        return TD_EIO;
    }
    if (note) {
        ssize_t w = write(logfd, note, strlen(note));
        (void)w; /* the log line is informative only */
    }
    int ep[2];
    if (pipe2(ep, O_CLOEXEC)) {
        close(logfd);
        return TD_EIO;
    }
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "tandem: fork: %s\n", strerror(errno));
        close(logfd);
        close(ep[0]);
        close(ep[1]);
        return TD_EIO;
    }
    if (pid == 0) {
        setsid();
        int nul = open("/dev/null", O_RDONLY);
        if (nul >= 0) dup2(nul, 0);
        dup2(logfd, 1);
        dup2(logfd, 2);
        struct sigaction sa = {.sa_handler = SIG_DFL};
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, NULL);
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGHUP, &sa, NULL);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        execv(bin, argv);
        int e = errno;
        ssize_t w = write(ep[1], &e, sizeof e);
        (void)w;
        _exit(127);
    }
    close(ep[1]);
    close(logfd);
    int e = 0;
    ssize_t r;
    do
        r = read(ep[0], &e, sizeof e);
    while (r < 0 && errno == EINTR);
    close(ep[0]);
    if (r == (ssize_t)sizeof e) {
        waitpid(pid, NULL, 0);
        fprintf(stderr,
                "tandem: cannot run %s: %s (set TANDEM_BIN to the directory of the "
                "tandem binaries)\n",
                bin, strerror(e));
        return TD_ENOENT;
    }
    p->pid = pid;
    p->child = true;
    p->exited = false;
    p->pending = false;
    p->started_at = now_s();
    char st;
    proc_stat(pid, &st, &p->start);
    if (write_pidfile(p->pidfile, pid, p->restarts)) {
        fprintf(stderr, "tandem: cannot write %s\n", p->pidfile);
        return TD_EIO;
    }
    return 0;
}

static void signal_proc(up_proc *p, int sig)
{
    if (!proc_alive(p)) return;
    if (kill(-p->pid, sig)) kill(p->pid, sig); /* its process group, else the process */
}

/* A process stopped by SIGSTOP would not handle its SIGTERM: SIGCONT to it. Only to a
 * stopped one: a SIGCONT sent to a process group while a sanitizer's leak checker attaches
 * to the threads at exit (ptrace) cancels a thread's stop and hangs the checker. */
static void cont_if_stopped(up_proc *p)
{
    char st;
    unsigned long long start;
    if (proc_alive(p) && !proc_stat(p->pid, &st, &start) && st == 'T') kill(p->pid, SIGCONT);
}

/* SIGTERM (and SIGCONT to a stopped one) to the processes of c whose role is (routers) or is not
 * (!routers) the router, wait up to grace_s, then SIGKILL. Returns how many were running. */
static int stop_set(cluster *c, bool routers, double grace_s)
{
    int running = 0;
    for (int i = c->n - 1; i >= 0; i--)
        if (!strcmp(c->p[i].role, "router") == routers && proc_alive(&c->p[i])) {
            running++;
            signal_proc(&c->p[i], SIGTERM);
            cont_if_stopped(&c->p[i]);
        }
    double end = now_s() + grace_s;
    bool killed = false;
    for (;;) {
        int alive = 0;
        for (int i = 0; i < c->n; i++)
            alive += !strcmp(c->p[i].role, "router") == routers && proc_alive(&c->p[i]);
        if (!alive) break;
        if (now_s() > end) {
            if (killed && now_s() > end + 10) {
                fprintf(stderr, "tandem: %d processes did not go away after SIGKILL\n", alive);
                break;
            }
            if (!killed) {
                for (int i = 0; i < c->n; i++)
                    if (!strcmp(c->p[i].role, "router") == routers && proc_alive(&c->p[i])) {
                        char l[128];
                        proc_label(&c->p[i], l, sizeof l);
                        fprintf(stderr, "tandem: %s (pid %d) ignored SIGTERM for %.0f s: SIGKILL\n",
                                l, (int)c->p[i].pid, grace_s);
                        signal_proc(&c->p[i], SIGKILL);
                    }
                killed = true;
            }
        }
        sleep_ms(50);
    }
    return running;
}

/* Stops every process in c: the router first, given max(grace_s, router.drain_timeout_ms +
 * 5 s) (on SIGTERM it lets the requests in flight finish on the instances, which still
 * run), then the prefill stages and decode ranks together, grace_s; SIGKILL after those
 * bounds. Removes the pid files. Returns how many were running. */
static int stop_all(cluster *c, double grace_s)
{
    double drain_s = c->cfg->router.drain_timeout_ms / 1000.0 + 5;
    int running = stop_set(c, true, fmax(grace_s, drain_s));
    running += stop_set(c, false, grace_s);
    for (int i = 0; i < c->n; i++) {
        unlink(c->p[i].pidfile);
        c->p[i].pid = 0;
        c->p[i].restart_at = 0;
    }
    return running;
}

static void describe_exit(const up_proc *p, char *buf, size_t cap)
{
    if (WIFEXITED(p->wstatus))
        snprintf(buf, cap, "exited with status %d", WEXITSTATUS(p->wstatus));
    else if (WIFSIGNALED(p->wstatus))
        snprintf(buf, cap, "was killed by signal %d (%s)", WTERMSIG(p->wstatus),
                 strsignal(WTERMSIG(p->wstatus)));
    else
        snprintf(buf, cap, "is gone");
}

/* The first of our children that has exited, or NULL. */
static up_proc *find_exited(cluster *c)
{
    for (int i = 0; i < c->n; i++) {
        up_proc *p = &c->p[i];
        if (p->pid && p->child && !proc_alive(p)) return p;
    }
    return NULL;
}

/* One supervisor event (a death, a restart, a kill) on stderr, which is up.log under -d:
 * stamped like the processes' own log lines, so the two can be read side by side. */
static void __attribute__((format(printf, 1, 2))) up_event(const char *fmt, ...)
{
    char ts[40], msg[1024];
    td_log_timestamp(ts, sizeof ts);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s tandem: %s\n", ts, msg);
}

static void report_exit(const up_proc *p, const char *when)
{
    char l[128], how[128];
    proc_label(p, l, sizeof l);
    describe_exit(p, how, sizeof how);
    up_event("%s (pid %d) %s %s", l, (int)p->pid, how, when);
    print_tail(p->log, 20);
}

/* Every binary the cluster needs is there and executable (checked before anything runs,
 * so a missing one never leaves a half-started cluster behind). Prints the first missing. */
static int check_binaries(const cluster *c)
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

/* Readiness of a prefill instance: its stage 0 answers HealthRequest with ready = true
 * once every stage joined (and its start-up profile is done). One control-plane client
 * per instance; calls are asynchronous, so polling never blocks the start-up loop. */
typedef struct {
    const char *instance;
    char url[320];
    td_ctrl_client *cl;
    bool ready, asked; /* asked: a health call is in flight (call) */
    uint64_t call;
    const up_proc *stage0; /* whose log tail explains a timeout */
} pf_probe;

static void probes_close(pf_probe *pp, int n)
{
    for (int i = 0; pp && i < n; i++)
        td_ctrl_client_destroy(pp[i].cl);
    free(pp);
}

static int probes_open(const cluster *c, pf_probe **out)
{
    int n = c->cfg->n_prefill;
    *out = NULL;
    if (!n) return 0;
    pf_probe *pp = calloc((size_t)n, sizeof *pp);
    if (!pp) return TD_ENOMEM;
    for (int i = 0; i < n; i++) {
        const td_cfg_prefill *pf = &c->cfg->prefill[i];
        const char *host = pf->hosts[0];
        if (!strcmp(host, "0.0.0.0") || !host[0]) host = "127.0.0.1";
        if (!strcmp(host, "::")) host = "::1";
        pp[i].instance = pf->name;
        for (int k = 0; k < c->n; k++)
            if (!strcmp(c->p[k].role, "prefill") && !strcmp(c->p[k].instance, pf->name) &&
                c->p[k].rank == 0)
                pp[i].stage0 = &c->p[k];
        td_ctrl_opts opts = {0};
        int rc = td_cfg_ctrl_url(host, pf->port, pp[i].url, sizeof pp[i].url);
        if (!rc) rc = td_ctrl_client_create(pp[i].url, &opts, &pp[i].cl);
        if (rc) {
            fprintf(stderr, "tandem: prefill %s: cannot reach %s: %s\n", pf->name, pp[i].url,
                    td_strerror(rc));
            probes_close(pp, n);
            return rc;
        }
    }
    *out = pp;
    return 0;
}

/* Collect answers and ask again where needed, without blocking; returns the first prefill
 * instance that is not ready yet, or NULL when all are. */
static pf_probe *probes_poll(pf_probe *pp, int n)
{
    pf_probe *first = NULL;
    for (int i = 0; i < n; i++) {
        pf_probe *p = &pp[i];
        td_ctrl_client_in in = {0};
        while (!p->ready && td_ctrl_client_recv(p->cl, &in, 0) == 0) {
            const Td__Health *h = NULL;
            if (in.kind == TD_CTRL_IN_REPLY && in.call_id == p->call) {
                p->asked = false;
                if (!in.err && in.env && in.env->body_case == TD__ENVELOPE__BODY_HEALTH)
                    h = in.env->health;
            } else if (in.kind == TD_CTRL_IN_EVENTS) {
                h = in.health;
            }
            if (h && h->ready) p->ready = true;
        }
        td_ctrl_client_in_free(&in);
        if (!p->ready && !p->asked && td_ctrl_client_health(p->cl, 2000, &p->call) == 0)
            p->asked = true;
        if (!p->ready && !first) first = p;
    }
    return first;
}

static int health(const cluster *c, int timeout_ms)
{
    cli_http_req rq = {.host = c->host,
                       .port = c->port,
                       .method = "GET",
                       .path = "/health",
                       .timeout_ms = timeout_ms};
    int status = 0;
    int rc = cli_http_request(NULL, &rq, &status);
    return rc ? rc : status;
}

/* The supervising `tandem up` recorded in up.pid if it still runs, else 0. */
static pid_t supervisor_pid(const cluster *c)
{
    up_proc sup = {.role = "up"};
    if (read_pidfile(c->up_pidfile, &sup.pid, &sup.start, NULL) || !proc_alive(&sup)) return 0;
    return sup.pid;
}

/* Any process of the cluster still running from an earlier up? */
static bool already_running(cluster *c)
{
    load_pids(c);
    for (int i = 0; i < c->n; i++)
        if (proc_alive(&c->p[i])) return true;
    return supervisor_pid(c) != 0;
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
            "       tandem status FILE [--port N] [--json]\n"
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
            "  status: ROLE INSTANCE RANK PID RESTARTS STATE per process\n"
            "  binaries: $TANDEM_BIN, else the directory of this tandem executable\n");
}

/* Common option parsing: FILE plus flags. */
typedef struct {
    const char *file;
    bool detach, json, restart, reprofile;
    double timeout_s, grace_s;
    int port; /* --port N, 0: the YAML's ports */
} up_opts;

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

/* Starts every process and waits until the cluster is ready. On error the log tail of the
 * process concerned has been printed; the caller stops what runs. */
static int start_cluster(cluster *c, const up_opts *o, double t0)
{
    int rc = 0;
    for (int i = 0; i < c->n && !rc; i++) /* decode ranks, prefill stages, then the router */
        rc = spawn(c, &c->p[i], NULL);
    pf_probe *probes = NULL;
    int n_probes = c->cfg->n_prefill;
    if (!rc) rc = probes_open(c, &probes);
    double last_note = t0;
    bool router_ok = false;
    while (!rc) {
        up_proc *dead = find_exited(c);
        if (dead) {
            report_exit(dead, "during start-up");
            rc = TD_EIO;
            break;
        }
        if (g_signal) {
            fprintf(stderr, "tandem: %s during start-up: stopping\n", strsignal(g_signal));
            rc = TD_ESTATE;
            break;
        }
        pf_probe *waiting = probes_poll(probes, n_probes);
        int h = router_ok ? 200 : health(c, 2000);
        router_ok = h == 200;
        if (router_ok && !waiting) break;
        if (now_s() - t0 > o->timeout_s) {
            if (!router_ok) {
                fprintf(stderr, "tandem: %s/health did not answer 200 within %.0f s (last: %s)\n",
                        c->endpoint, o->timeout_s, h > 0 ? "an HTTP error status" : td_strerror(h));
                print_tail(c->p[c->n - 1].log, 20);
            } else {
                fprintf(stderr,
                        "tandem: prefill %s (%s) did not report ready within %.0f s "
                        "(stage 0 says ready once every stage joined)\n",
                        waiting->instance, waiting->url, o->timeout_s);
                if (waiting->stage0) print_tail(waiting->stage0->log, 20);
            }
            rc = TD_ETIMEDOUT;
            break;
        }
        if (now_s() - last_note > 15) {
            last_note = now_s();
            if (!router_ok)
                fprintf(stderr, "tandem: waiting for %s/health (%.0f s)\n", c->endpoint,
                        last_note - t0);
            else
                fprintf(stderr, "tandem: waiting for prefill %s to be ready (%.0f s)\n",
                        waiting->instance, last_note - t0);
        }
        sleep_ms(250);
    }
    probes_close(probes, n_probes);
    return rc;
}

/* --port N: writes the copy of the YAML with the ports moved into the run directory
 * (DIR/BASENAME) and loads the configuration from it; every process is started on it.
 * On error nothing of it is left. */
static int cluster_derive(cluster *c)
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

/* The example request printed once the cluster is up: a short greedy chat completion. */
static void print_example(const cluster *c)
{
    bool v6 = strchr(c->host, ':') != NULL; /* curl reads [ ] as a glob without -g */
    printf("tandem: try: curl -s%s %s/v1/chat/completions -H 'Content-Type: application/json'%s "
           "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of "
           "France?\"}], \"max_tokens\": 32, \"temperature\": 0}'\n",
           v6 ? " -g" : "", c->endpoint,
           c->cfg->router.api_key[0] ? " -H 'Authorization: Bearer YOUR_API_KEY'" : "");
}

/* p has died while supervised: report it and schedule its restart after the back-off. */
static void schedule_restart(up_proc *p, double t)
{
    char l[128];
    proc_label(p, l, sizeof l);
    describe_exit(p, p->last_exit, sizeof p->last_exit);
    p->last_pid = p->pid;
    double ran = t - p->started_at;
    p->backoff_s = !p->backoff_s || ran >= UP_BACKOFF_RESET_S
                       ? UP_BACKOFF_MIN_S
                       : fmin(2 * p->backoff_s, UP_BACKOFF_MAX_S);
    p->restart_at = t + p->backoff_s;
    up_event("%s (pid %d) %s after %.1f s: restarting it in %.1f s", l, (int)p->pid, p->last_exit,
             ran, p->backoff_s);
    print_tail(p->log, 10);
    p->pid = 0;
    p->child = false;
    write_pidfile(p->pidfile, 0, p->restarts); /* tandem status: restarting */
}

/* Starts p again (its restart is due): same command line, its log appended to. */
static void restart(cluster *c, up_proc *p, double t)
{
    char l[128], when[64], note[512];
    proc_label(p, l, sizeof l);
    time_t wall = time(NULL);
    struct tm tm;
    localtime_r(&wall, &tm);
    strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
    snprintf(note, sizeof note,
             "---- tandem up: restart %d of %s at %s (the previous process, pid %d, %s) ----\n",
             p->restarts + 1, l, when, (int)p->last_pid, p->last_exit);
    p->restart_at = 0;
    p->restarts++; /* before spawn: the new pid file carries it */
    int rc = spawn(c, p, note);
    if (p->pid > 0) { /* running (a pid file that could not be written was reported) */
        up_event("%s restarted (pid %d, restart %d)", l, (int)p->pid, p->restarts);
        return;
    }
    p->restarts--;
    /* it did not start (spawn said why): try again after a longer back-off */
    p->started_at = t;
    p->backoff_s = fmin(2 * p->backoff_s, UP_BACKOFF_MAX_S);
    p->restart_at = t + p->backoff_s;
    up_event("could not restart %s (%s): trying again in %.1f s", l, td_strerror(rc), p->backoff_s);
}

/* Runs until a signal: children that die are restarted (o->restart) or stop the cluster
 * (TD_EIO). */
static int supervise(cluster *c, const up_opts *o)
{
    while (!g_signal) {
        double t = now_s();
        for (int i = 0; i < c->n; i++) {
            up_proc *p = &c->p[i];
            if (p->pid && p->child && !proc_alive(p)) {
                if (!o->restart) {
                    report_exit(p, "while running: stopping the cluster");
                    return TD_EIO;
                }
                schedule_restart(p, t);
            } else if (!p->pid && p->restart_at && t >= p->restart_at) {
                restart(c, p, t);
            }
        }
        sleep_ms(100);
    }
    return 0;
}

/* -d: forks the supervisor. In the child (its own session, stdin from /dev/null) returns 0
 * with *notify the pipe to write one byte to once the cluster is up. In the parent waits for
 * that byte (0) or the child's end (TD_EIO: it printed why), forwarding SIGINT/SIGTERM/SIGHUP
 * as SIGTERM, and sets *parent. */
static int detach(int *notify, bool *parent)
{
    int ep[2];
    *parent = false;
    if (pipe2(ep, O_CLOEXEC)) {
        fprintf(stderr, "tandem: pipe: %s\n", strerror(errno));
        return TD_EIO;
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "tandem: fork: %s\n", strerror(errno));
        close(ep[0]);
        close(ep[1]);
        return TD_EIO;
    }
    if (pid == 0) {
        close(ep[0]);
        setsid();
        int nul = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (nul >= 0) {
            dup2(nul, 0);
            close(nul);
        }
        *notify = ep[1];
        return 0;
    }
    *parent = true;
    close(ep[1]);
    bool forwarded = false;
    int rc;
    for (;;) {
        char b;
        ssize_t r = read(ep[0], &b, 1);
        if (r == 1) {
            rc = 0;
            break;
        }
        if (r < 0 && errno == EINTR) {
            if (g_signal && !forwarded) {
                kill(pid, SIGTERM);
                forwarded = true;
            }
            continue;
        }
        int ws;
        while (waitpid(pid, &ws, 0) < 0 && errno == EINTR)
            ;
        rc = TD_EIO;
        break;
    }
    close(ep[0]);
    return rc;
}

/* The detached supervisor, once the cluster is up: its output goes to up.log from now on,
 * and the waiting parent is released. */
static void detach_done(const cluster *c, const up_opts *o, const char *port_arg, int notify)
{
    char path[PATH_MAX + 8];
    snprintf(path, sizeof path, "%s/up.log", c->dir);
    fprintf(stderr,
            "tandem: supervising in the background (pid %d, messages in %s); 'tandem status "
            "%s%s', 'tandem down %s%s'\n",
            (int)getpid(), path, o->file, port_arg, o->file, port_arg);
    fflush(stdout);
    fflush(stderr);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
    }
    char b = 1;
    ssize_t w = write(notify, &b, 1);
    (void)w; /* a parent that is gone needs no answer */
    close(notify);
}

int cmd_up(int argc, char **argv)
{
    up_opts o;
    int rc = parse_opts(argc, argv, &o, true, false);
    if (rc) return rc > 0 ? 0 : rc;
    cluster c;
    if ((rc = cluster_open(&c, o.file, o.port))) return rc;
    if ((rc = check_binaries(&c))) {
        cluster_close(&c);
        return rc;
    }
    char port_arg[24] = "";
    if (o.port) snprintf(port_arg, sizeof port_arg, " --port %d", o.port);
    if ((rc = mkdir_p(c.dir))) {
        fprintf(stderr, "tandem: cannot create run directory %s: %s\n", c.dir, strerror(errno));
        cluster_close(&c);
        return rc;
    }
    if (already_running(&c)) {
        fprintf(stderr,
                "tandem: cluster '%s' is already running (run directory %s); "
                "'tandem down %s%s' first\n",
                c.name, c.dir, o.file, port_arg);
        cluster_close(&c);
        return TD_ESTATE;
    }
    c.reprofile = o.reprofile;
    /* before anything starts (a prefill stage 0 profiles itself for ~20 s first) */
    if (o.port && (rc = cluster_derive(&c))) {
        rmdir(c.dir); /* if this up made it and it holds nothing (the copy is removed) */
        cluster_close(&c);
        return rc;
    }
    if ((rc = up_ports_check(c.cfg))) {
        if (o.port) unlink(c.cfg_path); /* the copy cluster_derive wrote */
        rmdir(c.dir);
        cluster_close(&c);
        return rc;
    }
    g_signal = 0;
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    int notify = -1;
    if (o.detach) {
        bool parent;
        rc = detach(&notify, &parent);
        if (rc || parent) {
            cluster_close(&c);
            return rc;
        }
    }
    for (int i = 0; i < c.n; i++) {
        c.p[i].pid = 0;
        unlink(c.p[i].pidfile);
    }
    write_pidfile(c.up_pidfile, getpid(), 0);

    fprintf(stderr, "tandem: starting cluster '%s' (%d processes, logs in %s)\n", c.name, c.n,
            c.dir);
    double t0 = now_s();
    rc = start_cluster(&c, &o, t0);
    if (rc) {
        stop_all(&c, o.grace_s);
        unlink(c.up_pidfile);
        fprintf(stderr, "tandem: cluster '%s' did not come up; every process is stopped\n", c.name);
        cluster_close(&c);
        if (notify >= 0) close(notify);
        return rc;
    }
    printf("tandem: cluster '%s' is up in %.1f s: %s (OpenAI API at %s/v1)\n", c.name, now_s() - t0,
           c.endpoint, c.endpoint);
    print_example(&c);
    fflush(stdout);
    if (o.detach)
        detach_done(&c, &o, port_arg, notify);
    else
        fprintf(stderr, "tandem: Ctrl-C or SIGTERM stops the cluster%s\n",
                o.restart ? "; a process that dies is restarted" : "");
    rc = supervise(&c, &o);
    if (!rc) fprintf(stderr, "tandem: %s: stopping the cluster\n", strsignal(g_signal));
    int n = stop_all(&c, o.grace_s);
    unlink(c.up_pidfile);
    fprintf(stderr, "tandem: cluster '%s' stopped (%d processes)\n", c.name, n);
    cluster_close(&c);
    return rc;
}

int cmd_down(int argc, char **argv)
{
    up_opts o;
    int rc = parse_opts(argc, argv, &o, false, false);
    if (rc) return rc > 0 ? 0 : rc;
    cluster c;
    if ((rc = cluster_open(&c, o.file, o.port))) return rc;
    int n = 0;
    up_proc sup = {.role = "up"};
    if (!read_pidfile(c.up_pidfile, &sup.pid, &sup.start, NULL) && proc_alive(&sup)) {
        /* the supervising up (foreground or -d): it stops its own processes */
        kill(sup.pid, SIGTERM);
        cont_if_stopped(&sup);
        /* its stop_all: the router's drain bound, then the others' grace */
        double drain_s = c.cfg->router.drain_timeout_ms / 1000.0 + 5;
        double end = now_s() + fmax(o.grace_s, drain_s) + o.grace_s + 15;
        while (proc_alive(&sup) && now_s() < end)
            sleep_ms(50);
        if (proc_alive(&sup)) {
            /* so that it restarts nothing while its processes are stopped below */
            fprintf(stderr, "tandem: the supervising 'tandem up' (pid %d) did not stop: SIGKILL\n",
                    (int)sup.pid);
            kill(sup.pid, SIGKILL);
            end = now_s() + 10;
            while (proc_alive(&sup) && now_s() < end)
                sleep_ms(50);
        }
        n++;
    }
    unlink(c.up_pidfile);
    load_pids(&c);
    n += stop_all(&c, o.grace_s);
    if (n)
        printf("tandem: cluster '%s' stopped\n", c.name);
    else
        printf("tandem: cluster '%s' was not running\n", c.name);
    cluster_close(&c);
    return 0;
}

int cmd_status(int argc, char **argv)
{
    up_opts o;
    int rc = parse_opts(argc, argv, &o, false, true);
    if (rc) return rc > 0 ? 0 : rc;
    cluster c;
    if ((rc = cluster_open(&c, o.file, o.port))) return rc;
    load_pids(&c);
    pid_t sup = supervisor_pid(&c);
    json_t *arr = json_array();
    for (int i = 0; i < c.n; i++) {
        up_proc *p = &c.p[i];
        const char *state = p->pending      ? (sup ? "restarting" : "dead")
                            : !p->pid       ? "stopped"
                            : proc_alive(p) ? "running"
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
    cluster_close(&c);
    return 0;
}
