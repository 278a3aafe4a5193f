/* test_log.c: the logger's line format (UTC timestamp with milliseconds, program name and
 * pid, level, message, file:line on warn/error), level filtering, and whole lines when
 * several threads log at once. stderr is redirected to a temporary file and read back. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "td_err.h"
#include "tharness.h"

static char g_path[] = "/tmp/tandem-test-log-XXXXXX";
static int g_fd = -1;     /* the temporary file */
static int g_stderr = -1; /* the real stderr, for the harness's own messages */

/* Send stderr to the (emptied) temporary file. */
static void capture(void)
{
    fflush(stderr);
    if (ftruncate(g_fd, 0)) perror("ftruncate");
    lseek(g_fd, 0, SEEK_SET);
    dup2(g_fd, 2);
}

/* Restore stderr; returns what was logged (malloc'd, NUL-terminated). */
static char *captured(void)
{
    fflush(stderr);
    dup2(g_stderr, 2);
    off_t n = lseek(g_fd, 0, SEEK_END);
    char *s = calloc((size_t)n + 1, 1);
    if (!s) return NULL;
    if (pread(g_fd, s, (size_t)n, 0) != n) s[0] = 0;
    return s;
}

/* "YYYY-MM-DDTHH:MM:SS.mmmZ " at s: the time in seconds since the epoch, -1 if malformed. */
static double parse_ts(const char *s)
{
    struct tm tm = {0};
    int ms = -1, used = 0;
    if (sscanf(s, "%4d-%2d-%2dT%2d:%2d:%2d.%3dZ %n", &tm.tm_year, &tm.tm_mon, &tm.tm_mday,
               &tm.tm_hour, &tm.tm_min, &tm.tm_sec, &ms, &used) != 7 ||
        used != 25 || ms < 0 || ms > 999)
        return -1;
    tm.tm_year -= 1900;
    tm.tm_mon -= 1;
    return (double)timegm(&tm) + ms / 1000.0;
}

static void test_format(void)
{
    td_log_set_level(TD_LOG_INFO);
    struct timespec t0, t1;
    clock_gettime(CLOCK_REALTIME, &t0);
    capture();
    TD_LOG_INFO("hello %d", 42);
    int warn_line = __LINE__ + 1;
    TD_LOG_WARN("careful: %s", "x");
    char *s = captured();
    clock_gettime(CLOCK_REALTIME, &t1);
    TH_REQUIRE(s != NULL);
    char want[128];
    snprintf(want, sizeof want, " %s[%d] info: hello 42\n", program_invocation_short_name,
             (int)getpid());
    char *nl = strchr(s, '\n');
    TH_REQUIRE(nl != NULL);
    double ts = parse_ts(s);
    TH_CHECKF(ts >= (double)t0.tv_sec && ts <= (double)t1.tv_sec + 1.0, "line: %s", s);
    TH_CHECKF(!strncmp(s + 24, want, strlen(want)), "line: %s", s);
    snprintf(want, sizeof want, " %s[%d] warn: careful: x (test_log.c:%d)\n",
             program_invocation_short_name, (int)getpid(), warn_line);
    TH_CHECKF(parse_ts(nl + 1) >= ts, "second line: %s", nl + 1);
    TH_CHECKF(!strcmp(nl + 1 + 24, want), "second line: %s (want%s)", nl + 1, want);
    free(s);

    char buf[32];
    TH_CHECK(td_log_timestamp(buf, sizeof buf) == 24);
    TH_CHECK(strlen(buf) == 24 && buf[10] == 'T' && buf[19] == '.' && buf[23] == 'Z');
    TH_CHECK(td_log_timestamp(buf, 8) == 7 && strlen(buf) == 7); /* cut, still terminated */
}

static void test_levels(void)
{
    capture();
    td_log_set_level(TD_LOG_WARN);
    TD_LOG_DEBUG("d1");
    TD_LOG_INFO("i1");
    TD_LOG_WARN("w1");
    TD_LOG_ERR("e1");
    td_log_set_level(TD_LOG_DEBUG);
    TD_LOG_DEBUG("d2");
    td_log_set_level(TD_LOG_ERROR);
    TD_LOG_WARN("w2");
    TD_LOG_ERR("e2");
    td_log_set_level(TD_LOG_INFO);
    char *s = captured();
    TH_REQUIRE(s != NULL);
    TH_CHECKF(!strstr(s, ": d1") && !strstr(s, ": i1") && !strstr(s, ": w2"), "%s", s);
    TH_CHECKF(strstr(s, " warn: w1 (") && strstr(s, " error: e1 (") && strstr(s, " debug: d2\n") &&
                  strstr(s, " error: e2 ("),
              "%s", s);
    free(s);
}

#define N_THREADS 4
#define N_LINES   500

static void *writer(void *arg)
{
    int id = (int)(long)arg;
    for (int i = 0; i < N_LINES; i++)
        TD_LOG_INFO("thread %d line %d %s", id, i, "padding-padding-padding-padding-padding");
    return NULL;
}

static void test_threads(void)
{
    capture();
    pthread_t t[N_THREADS];
    for (long k = 0; k < N_THREADS; k++)
        pthread_create(&t[k], NULL, writer, (void *)k);
    for (int k = 0; k < N_THREADS; k++)
        pthread_join(t[k], NULL);
    char *s = captured();
    TH_REQUIRE(s != NULL);
    int seen[N_THREADS] = {0}, bad = 0;
    for (char *line = s, *nl; *line; line = nl + 1) {
        nl = strchr(line, '\n');
        if (!nl) {
            bad++;
            break;
        }
        *nl = 0;
        int id = -1, i = -1;
        const char *m = strstr(line, " info: thread ");
        if (parse_ts(line) < 0 || !m || sscanf(m, " info: thread %d line %d", &id, &i) != 2 ||
            id < 0 || id >= N_THREADS || i != seen[id] || strcmp(nl - 7, "padding"))
            bad++;
        else
            seen[id]++;
    }
    TH_CHECK(bad == 0);
    for (int k = 0; k < N_THREADS; k++)
        TH_CHECKF(seen[k] == N_LINES, "thread %d: %d lines", k, seen[k]);
    free(s);
}

/* Run with TANDEM_LOG set (by ctest): levels below it are dropped, the others kept. */
static const char *g_env_level;

static void test_env_level(void)
{
    static const char *const names[] = {"debug", "info", "warn", "error"};
    capture(); /* nothing called td_log_set_level yet: the level comes from TANDEM_LOG */
    TD_LOG_DEBUG("at debug");
    TD_LOG_INFO("at info");
    TD_LOG_WARN("at warn");
    TD_LOG_ERR("at error");
    char *s = captured();
    TH_REQUIRE(s != NULL);
    int want = 0;
    while (want < 4 && strcmp(names[want], g_env_level))
        want++;
    TH_REQUIRE(want < 4);
    for (int k = 0; k < 4; k++) {
        char m[32];
        snprintf(m, sizeof m, " %s: at %s", names[k], names[k]);
        TH_CHECKF((strstr(s, m) != NULL) == (k >= want), "TANDEM_LOG=%s, %s: %s", g_env_level,
                  names[k], s);
    }
    free(s);
}

/* test_log [--env-level LEVEL]: with it, only the TANDEM_LOG check (LEVEL: what was set). */
int main(int argc, char **argv)
{
    g_fd = mkstemp(g_path);
    g_stderr = dup(2);
    if (g_fd < 0 || g_stderr < 0) {
        perror("test_log");
        return 1;
    }
    unlink(g_path);
    if (argc == 3 && !strcmp(argv[1], "--env-level")) {
        g_env_level = argv[2];
        TH_RUN(test_env_level);
        close(g_fd);
        TH_EXIT();
    }
    TH_RUN(test_format);
    TH_RUN(test_levels);
    TH_RUN(test_threads);
    close(g_fd);
    TH_EXIT();
}
