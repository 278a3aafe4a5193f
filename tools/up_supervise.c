/* up_supervise.c: a `tandem up` cluster once it is up: a process that dies is reported
 * and started again after a back-off (or, with --no-restart, stops the cluster); with -d
 * the supervisor runs detached, its messages in up.log.
 */
#define _GNU_SOURCE /* pipe2 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "td_err.h"
#include "up_int.h"

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

void up_report_exit(const up_proc *p, const char *when)
{
    char l[128], how[128];
    up_proc_label(p, l, sizeof l);
    up_describe_exit(p, how, sizeof how);
    up_event("%s (pid %d) %s %s", l, (int)p->pid, how, when);
    up_print_tail(p->log, 20);
}

/* p has died while supervised: report it and schedule its restart after the back-off. */
static void schedule_restart(up_proc *p, double t)
{
    char l[128];
    up_proc_label(p, l, sizeof l);
    up_describe_exit(p, p->last_exit, sizeof p->last_exit);
    p->last_pid = p->pid;
    double ran = t - p->started_at;
    p->backoff_s = !p->backoff_s || ran >= UP_BACKOFF_RESET_S
                       ? UP_BACKOFF_MIN_S
                       : fmin(2 * p->backoff_s, UP_BACKOFF_MAX_S);
    p->restart_at = t + p->backoff_s;
    up_event("%s (pid %d) %s after %.1f s: restarting it in %.1f s", l, (int)p->pid, p->last_exit,
             ran, p->backoff_s);
    up_print_tail(p->log, 10);
    p->pid = 0;
    p->child = false;
    up_write_pidfile(p->pidfile, 0, p->restarts); /* tandem status: restarting */
}

/* Starts p again (its restart is due): same command line, its log appended to. */
static void restart(up_cluster *c, up_proc *p, double t)
{
    char l[128], when[64], note[512];
    up_proc_label(p, l, sizeof l);
    time_t wall = time(NULL);
    struct tm tm;
    localtime_r(&wall, &tm);
    strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
    snprintf(note, sizeof note,
             "---- tandem up: restart %d of %s at %s (the previous process, pid %d, %s) ----\n",
             p->restarts + 1, l, when, (int)p->last_pid, p->last_exit);
    p->restart_at = 0;
    p->restarts++; /* before up_spawn: the new pid file carries it */
    int rc = up_spawn(c, p, note);
    if (p->pid > 0) { /* running (a pid file that could not be written was reported) */
        up_event("%s restarted (pid %d, restart %d)", l, (int)p->pid, p->restarts);
        return;
    }
    p->restarts--;
    /* it did not start (up_spawn said why): try again after a longer back-off */
    p->started_at = t;
    p->backoff_s = fmin(2 * p->backoff_s, UP_BACKOFF_MAX_S);
    p->restart_at = t + p->backoff_s;
    up_event("could not restart %s (%s): trying again in %.1f s", l, td_strerror(rc), p->backoff_s);
}

/* Runs until a signal: children that die are restarted (o->restart) or stop the up_cluster
 * (TD_EIO). */
int up_supervise(up_cluster *c, const up_opts *o)
{
    while (!up_signal) {
        double t = up_now_s();
        for (int i = 0; i < c->n; i++) {
            up_proc *p = &c->p[i];
            if (p->pid && p->child && !up_proc_alive(p)) {
                if (!o->restart) {
                    up_report_exit(p, "while running: stopping the cluster");
                    return TD_EIO;
                }
                schedule_restart(p, t);
            } else if (!p->pid && p->restart_at && t >= p->restart_at) {
                restart(c, p, t);
            }
        }
        up_sleep_ms(100);
    }
    return 0;
}

/* -d: forks the supervisor. In the child (its own session, stdin from /dev/null) returns 0
 * with *notify the pipe to write one byte to once the cluster is up. In the parent waits for
 * that byte (0) or the child's end (TD_EIO: it printed why), forwarding SIGINT/SIGTERM/SIGHUP
 * as SIGTERM, and sets *parent. */
int up_detach(int *notify, bool *parent)
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
            if (up_signal && !forwarded) {
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
void up_detach_done(const up_cluster *c, const up_opts *o, const char *port_arg, int notify)
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
