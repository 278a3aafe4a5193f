/* td_err.c: error strings and the line-atomic stderr logger. */
#define _GNU_SOURCE /* program_invocation_short_name */
#include "td_err.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "td_clock.h"

const char *td_strerror(int err)
{
    switch (err) {
    case TD_OK:
        return "success";
    case TD_EINVAL:
        return "invalid argument";
    case TD_ENOMEM:
        return "out of memory";
    case TD_EIO:
        return "i/o error";
    case TD_EFORMAT:
        return "malformed file";
    case TD_EUNSUPP:
        return "not supported";
    case TD_ERANGE:
        return "out of range";
    case TD_ENOENT:
        return "not found";
    case TD_ENOSPC:
        return "out of space";
    case TD_ETIMEDOUT:
        return "timed out";
    case TD_ESTATE:
        return "invalid state";
    default:
        return "unknown error";
    }
}

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static int log_level = -1; /* -1: not read from the environment yet */

void td_log_set_level(td_log_level level)
{
    log_level = (int)level;
}

static int current_level(void)
{
    if (log_level >= 0) return log_level;
    const char *env = getenv("TANDEM_LOG");
    int lvl = TD_LOG_INFO;
    if (env) {
        if (!strcasecmp(env, "debug"))
            lvl = TD_LOG_DEBUG;
        else if (!strcasecmp(env, "warn"))
            lvl = TD_LOG_WARN;
        else if (!strcasecmp(env, "error"))
            lvl = TD_LOG_ERROR;
    }
    log_level = lvl;
    return lvl;
}

size_t td_log_timestamp(char *buf, size_t cap)
{
    struct timespec ts = td_wall_now();
    struct tm tm;
    time_t sec = ts.tv_sec;
    if (cap == 0) return 0;
    if (!gmtime_r(&sec, &tm)) {
        buf[0] = 0;
        return 0;
    }
    int n =
        snprintf(buf, cap, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
                 tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, (int)(ts.tv_nsec / 1000000));
    return n < 0 ? 0 : (size_t)n < cap ? (size_t)n : cap - 1;
}

void td_log_write(td_log_level level, const char *file, int line, const char *fmt, ...)
{
    if ((int)level < current_level()) return;
    static const char *names[] = {"debug", "info", "warn", "error"};
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    char when[32];
    td_log_timestamp(when, sizeof when);
    /* the process: its program name and pid (what `tandem status` shows) */
    const char *prog = program_invocation_short_name;
    int pid = (int)getpid();
    pthread_mutex_lock(&log_lock);
    if (level >= TD_LOG_WARN)
        fprintf(stderr, "%s %s[%d] %s: %s (%s:%d)\n", when, prog, pid, names[level], msg, base,
                line);
    else
        fprintf(stderr, "%s %s[%d] %s: %s\n", when, prog, pid, names[level], msg);
    pthread_mutex_unlock(&log_lock);
}

void td_errbuf_set(char *buf, unsigned long cap, const char *fmt, ...)
{
    if (!buf || cap == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, cap, fmt, ap);
    va_end(ap);
}
