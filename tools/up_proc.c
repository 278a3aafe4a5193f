/* up_proc.c: one process of a `tandem up` cluster: its identity in /proc (pid and start
 * time, so that a reused pid is never taken for ours), its pid file, starting it in its own
 * session with its log file, stopping it (SIGTERM, then SIGKILL), its log tail.
 */
#define _GNU_SOURCE /* pipe2 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "td_err.h"
#include "up_int.h"

void up_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

int up_mkdir_p(const char *path)
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
bool up_proc_alive(up_proc *p)
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
int up_read_pidfile(const char *path, pid_t *pid, unsigned long long *start, int *restarts)
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
int up_write_pidfile(const char *path, pid_t pid, int restarts)
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
void up_print_tail(const char *path, int lines)
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

void up_proc_label(const up_proc *p, char *buf, size_t cap)
{
    if (!strcmp(p->role, "router"))
        snprintf(buf, cap, "router");
    else
        snprintf(buf, cap, "%s %s %s %d", p->role, p->instance,
                 strcmp(p->role, "prefill") ? "rank" : "stage", p->rank);
}

void up_describe_exit(const up_proc *p, char *buf, size_t cap)
{
    if (WIFEXITED(p->wstatus))
        snprintf(buf, cap, "exited with status %d", WEXITSTATUS(p->wstatus));
    else if (WIFSIGNALED(p->wstatus))
        snprintf(buf, cap, "was killed by signal %d (%s)", WTERMSIG(p->wstatus),
                 strsignal(WTERMSIG(p->wstatus)));
    else
        snprintf(buf, cap, "is gone");
}

/* Starts one process: log file, own session, pid file. note NULL: the first start (the log
 * is truncated); else a restart: the log is appended to, after the line note. */
int up_spawn(up_cluster *c, up_proc *p, const char *note)
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
    p->started_at = up_now_s();
    char st;
    proc_stat(pid, &st, &p->start);
    if (up_write_pidfile(p->pidfile, pid, p->restarts)) {
        fprintf(stderr, "tandem: cannot write %s\n", p->pidfile);
        return TD_EIO;
    }
    return 0;
}

static void signal_proc(up_proc *p, int sig)
{
    if (!up_proc_alive(p)) return;
    if (kill(-p->pid, sig)) kill(p->pid, sig); /* its process group, else the process */
}

/* A process stopped by SIGSTOP would not handle its SIGTERM: SIGCONT to it. Only to a
 * stopped one: a SIGCONT sent to a process group while a sanitizer's leak checker attaches
 * to the threads at exit (ptrace) cancels a thread's stop and hangs the checker. */
void up_cont_if_stopped(up_proc *p)
{
    char st;
    unsigned long long start;
    if (up_proc_alive(p) && !proc_stat(p->pid, &st, &start) && st == 'T') kill(p->pid, SIGCONT);
}

/* SIGTERM (and SIGCONT to a stopped one) to the processes of c whose role is (routers) or is not
 * (!routers) the router, wait up to grace_s, then SIGKILL. Returns how many were running. */
static int stop_set(up_cluster *c, bool routers, double grace_s)
{
    int running = 0;
    for (int i = c->n - 1; i >= 0; i--)
        if (!strcmp(c->p[i].role, "router") == routers && up_proc_alive(&c->p[i])) {
            running++;
            signal_proc(&c->p[i], SIGTERM);
            up_cont_if_stopped(&c->p[i]);
        }
    double end = up_now_s() + grace_s;
    bool killed = false;
    for (;;) {
        int alive = 0;
        for (int i = 0; i < c->n; i++)
            alive += !strcmp(c->p[i].role, "router") == routers && up_proc_alive(&c->p[i]);
        if (!alive) break;
        if (up_now_s() > end) {
            if (killed && up_now_s() > end + 10) {
                fprintf(stderr, "tandem: %d processes did not go away after SIGKILL\n", alive);
                break;
            }
            if (!killed) {
                for (int i = 0; i < c->n; i++)
                    if (!strcmp(c->p[i].role, "router") == routers && up_proc_alive(&c->p[i])) {
                        char l[128];
                        up_proc_label(&c->p[i], l, sizeof l);
                        fprintf(stderr, "tandem: %s (pid %d) ignored SIGTERM for %.0f s: SIGKILL\n",
                                l, (int)c->p[i].pid, grace_s);
                        signal_proc(&c->p[i], SIGKILL);
                    }
                killed = true;
            }
        }
        up_sleep_ms(50);
    }
    return running;
}

/* Stops every process in c: the router first, given max(grace_s, router.drain_timeout_ms +
 * 5 s) (on SIGTERM it lets the requests in flight finish on the instances, which still
 * run), then the prefill stages and decode ranks together, grace_s; SIGKILL after those
 * bounds. Removes the pid files. Returns how many were running. */
int up_stop_all(up_cluster *c, double grace_s)
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

/* The first of our children that has exited, or NULL. */
up_proc *up_find_exited(up_cluster *c)
{
    for (int i = 0; i < c->n; i++) {
        up_proc *p = &c->p[i];
        if (p->pid && p->child && !up_proc_alive(p)) return p;
    }
    return NULL;
}
