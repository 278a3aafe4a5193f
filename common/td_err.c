/* td_err.c: error strings and the line-atomic stderr logger. */
#include "td_err.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

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
    pthread_mutex_lock(&log_lock);
    if (level >= TD_LOG_WARN)
        fprintf(stderr, "tandem %s: %s (%s:%d)\n", names[level], msg, base, line);
    else
        fprintf(stderr, "tandem %s: %s\n", names[level], msg);
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
