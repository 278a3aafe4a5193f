/* up_int.h: private header of `tandem up|down|status` (cmd_up.c and its up_*.c files).
 *
 * Purpose: the state the files of `tandem up` share: the cluster (its YAML, run directory
 * and process table) and one entry per process, plus the functions each file offers the
 * others:
 *   up_cluster.c    the cluster: YAML, names and paths, the --port copy, binaries, pid files read
 *   up_proc.c       one process: /proc, pid files, start (spawn), stop, log tail
 *   up_health.c     start-up: start every process, wait for the router's /health and
 *                   every prefill stage 0's ready
 *   up_supervise.c  once up: restart policy (back-off), -d (detach), event lines
 *   cmd_up.c        the commands: options, up / down / status, what they print
 * Invariants: c->p holds the decode ranks, then the prefill stages (YAML order), then the
 * router, last (c->p[c->n - 1]). An up_proc with pid 0 runs nothing (or, read from a pid
 * file, waits to be restarted: pending).
 * Threading: none; up_signal is written by the signal handler only.
 * Ownership: up_cluster_open/up_cluster_close own cfg and p.
 */
#ifndef TANDEM_UP_INT_H
#define TANDEM_UP_INT_H

#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "config.h"
#include "td_clock.h"

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
    double started_at;        /* up_now_s() of its last start (supervisor) */
    double backoff_s;         /* the delay before its last restart; 0: none yet */
    double restart_at;        /* up_now_s() when it is started again; 0: no restart pending */
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
    char endpoint[300]; /* http(s)://HOST:PORT as the user reaches it */
    int port_override;  /* --port N (0: none): the cluster is named STEM-N, runs a copy */
    bool reprofile;     /* --reprofile: prefill stage 0 profiles anew at its first start */
} up_cluster;

/* The command line of up, down and status: FILE plus flags. */
typedef struct {
    const char *file;
    bool detach, json, restart, reprofile;
    bool instances; /* status --instances: the router's live set */
    double timeout_s, grace_s;
    int port; /* --port N, 0: the YAML's ports */
} up_opts;

/* The last SIGINT/SIGTERM/SIGHUP received by `tandem up` (0: none); set by its handler. */
extern volatile sig_atomic_t up_signal;

/* Seconds on the monotonic clock (td_clock). */
static inline double up_now_s(void)
{
    return (double)td_now_ns() / 1e9;
}

/* ---- up_cluster.c ---- */

/* Loads the YAML and lays out the processes and their files; port (--port N, 0: none)
 * names the cluster STEM-N and moves its endpoint (up_cluster_derive then writes the copy
 * of the YAML its processes read). Prints its errors. */
int up_cluster_open(up_cluster *c, const char *path, int port);
void up_cluster_close(up_cluster *c);
/* --port N: writes the copy of the YAML with the ports moved into the run directory and
 * loads the configuration from it. On error nothing of it is left. Prints its errors. */
int up_cluster_derive(up_cluster *c);
/* Every binary the cluster needs is there and executable. Prints the first missing. */
int up_check_binaries(const up_cluster *c);
/* Fills pid/start/restarts of every process from the pid files. */
void up_load_pids(up_cluster *c);
/* The supervising `tandem up` recorded in up.pid if it still runs, else 0. */
pid_t up_supervisor_pid(const up_cluster *c);
/* Any process of the cluster (or its supervisor) still running from an earlier up? */
bool up_already_running(up_cluster *c);

/* ---- up_proc.c ---- */

void up_sleep_ms(int ms);
/* mkdir -p; TD_EIO or TD_ERANGE. */
int up_mkdir_p(const char *path);
/* The process recorded in p still runs (same pid and start time, not a zombie); reaps a
 * child of ours that has exited (p->exited, p->wstatus). */
bool up_proc_alive(up_proc *p);
/* "PID STARTTIME [RESTARTS]"; PID 0 (waiting for a restart) is returned as *pid = 0. */
int up_read_pidfile(const char *path, pid_t *pid, unsigned long long *start, int *restarts);
/* Writes "PID STARTTIME RESTARTS" atomically; pid 0 records a process waiting for a restart. */
int up_write_pidfile(const char *path, pid_t pid, int restarts);
/* Prints the last `lines` lines of a log file to stderr. */
void up_print_tail(const char *path, int lines);
/* "router", "decode d0 rank 1", "prefill p0 stage 0". */
void up_proc_label(const up_proc *p, char *buf, size_t cap);
/* "exited with status N", "was killed by signal N (NAME)". */
void up_describe_exit(const up_proc *p, char *buf, size_t cap);
/* Starts one process: log file, own session, pid file. note NULL: the first start (the log
 * is truncated); else a restart: the log is appended to, after the line note. */
int up_spawn(up_cluster *c, up_proc *p, const char *note);
/* SIGCONT to p if it is stopped (SIGSTOP), so that it can handle a SIGTERM. */
void up_cont_if_stopped(up_proc *p);
/* Stops every process in c (the router first, given its drain bound), SIGKILL after the
 * bounds; removes the pid files. Returns how many were running. */
int up_stop_all(up_cluster *c, double grace_s);
/* The first of our children that has exited, or NULL. */
up_proc *up_find_exited(up_cluster *c);

/* ---- up_health.c ---- */

/* Starts every process and waits until the cluster is ready (o->timeout_s from t0). On
 * error the log tail of the process concerned has been printed; the caller stops what
 * runs. */
int up_start_cluster(up_cluster *c, const up_opts *o, double t0);
/* The router's live set (GET /instances: docs/api.md), parsed; NULL when the router does not
 * answer it (down, or an older router). The caller json_decref()s it. */
struct json_t *up_live_set(const up_cluster *c, int timeout_ms);

/* ---- up_supervise.c ---- */

/* Prints "<time> tandem: LABEL (pid N) HOW WHEN" and the log tail of p. */
void up_report_exit(const up_proc *p, const char *when);
/* Runs until a signal: children that die are restarted (o->restart) or stop the cluster
 * (TD_EIO). */
int up_supervise(up_cluster *c, const up_opts *o);
/* -d: forks the supervisor. In the child returns 0 with *notify the pipe to write to once
 * the cluster is up; in the parent waits for that (0) or the child's end (TD_EIO) and
 * sets *parent. */
int up_detach(int *notify, bool *parent);
/* The detached supervisor, once the cluster is up: output to up.log, parent released. */
void up_detach_done(const up_cluster *c, const up_opts *o, const char *port_arg, int notify);

#endif
