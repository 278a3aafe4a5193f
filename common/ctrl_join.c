/* ctrl_join.c: a node's announcements to the router (ctrl_join.h). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ctrl.h"
#include "ctrl_join.h"
#include "td_clock.h"
#include "td_err.h"

#define JOIN_TICK_MS       100 /* how often the thread looks at the stop and leave flags */
#define JOIN_LEAVE_WAIT_MS 500 /* td_join_stop: the most it waits for the leaving Join's answer */

struct td_join {
    td_join_params p;
    char *router, *name, *url, *template_name; /* the copies p points to */
    td_ctrl_client *c;
    pthread_t thread;
    atomic_bool stop, leave;
    atomic_bool left;  /* the router answered a Join that said leaving */
    uint64_t call;     /* the outstanding Join, 0 none */
    bool call_leaving; /* the outstanding Join said leaving */
    char last[320];    /* the last outcome logged ("ok" or the refusal) */
};

/* The URL others reach a control socket at: bound with its host replaced by host (NULL or
 * "": kept); ipc:// as is. */
static int join_url(const char *bound, const char *host, char *out, size_t cap)
{
    const char *colon = strrchr(bound, ':');
    bool tcp = !strncmp(bound, "tcp://", 6) || !strncmp(bound, "tls+tcp://", 10);
    int n;
    if (!tcp || !host || !*host || !colon) {
        n = snprintf(out, cap, "%s", bound);
    } else {
        bool v6 = strchr(host, ':') != NULL;
        size_t scheme = (size_t)(strstr(bound, "://") - bound) + 3;
        n = snprintf(out, cap, "%.*s%s%s%s%s", (int)scheme, bound, v6 ? "[" : "", host,
                     v6 ? "]" : "", colon);
    }
    return n > 0 && (size_t)n < cap ? 0 : TD_ERANGE;
}

static void send_join(td_join *j)
{
    Td__Join m = TD__JOIN__INIT;
    m.role = j->p.role;
    m.name = j->name;
    m.url = j->url;
    m.template_name = j->template_name;
    m.tp = j->p.tp;
    m.pp = j->p.pp;
    m.max_batch = j->p.max_batch;
    m.max_queue = j->p.max_queue;
    m.leaving = atomic_load(&j->leave);
    Td__Envelope env = TD__ENVELOPE__INIT;
    env.body_case = TD__ENVELOPE__BODY_JOIN;
    env.join = &m;
    j->call_leaving = m.leaving;
    if (td_ctrl_client_call(j->c, &env, j->p.period_ms, &j->call)) j->call = 0;
}

/* The router's answer: logged when it differs from the last one. */
static void on_reply(td_join *j, const td_ctrl_client_in *in)
{
    char now[320];
    if (in->err == TD_ETIMEDOUT) return; /* no router yet (or a busy one): not news */
    if (in->err)
        snprintf(now, sizeof now, "a bad answer (%s)", td_strerror(in->err));
    else if (in->env->body_case == TD__ENVELOPE__BODY_ERROR)
        snprintf(now, sizeof now, "refused: %s", in->env->error->message);
    else
        snprintf(now, sizeof now, "ok");
    if (!strcmp(now, j->last)) return;
    snprintf(j->last, sizeof j->last, "%s", now);
    if (!strcmp(now, "ok"))
        TD_LOG_INFO("%s: announced to the router at %s as %s", j->name, j->router, j->url);
    else
        TD_LOG_ERR("%s: the router at %s answers the announcement: %s", j->name, j->router, now);
}

static void *join_main(void *arg)
{
    td_join *j = arg;
    td_ctrl_client_in in = {0};
    int64_t next = 0;
    bool said_leave = false;
    while (!atomic_load(&j->stop)) {
        int64_t now = td_now_ms();
        bool leave = atomic_load(&j->leave);
        if (!j->call && (now >= next || (leave && !said_leave))) {
            send_join(j);
            said_leave = leave;
            next = now + j->p.period_ms;
        }
        if (td_ctrl_client_recv(j->c, &in, JOIN_TICK_MS)) continue;
        if (in.kind == TD_CTRL_IN_REPLY && in.call_id == j->call) {
            j->call = 0;
            if (!in.err && j->call_leaving) atomic_store(&j->left, true);
            on_reply(j, &in);
        }
    }
    td_ctrl_client_in_free(&in);
    return NULL;
}

static void join_free(td_join *j)
{
    td_ctrl_client_destroy(j->c);
    free(j->router);
    free(j->name);
    free(j->url);
    free(j->template_name);
    free(j);
}

static int join_start(const td_join_params *p, const char *self, td_join **out)
{
    td_join *j = calloc(1, sizeof *j);
    if (!j) return TD_ENOMEM;
    j->p = *p;
    j->router = strdup(p->router);
    j->name = strdup(p->name);
    j->url = strdup(self);
    j->template_name = strdup(p->template_name ? p->template_name : "");
    char url[300];
    int rc = !j->router || !j->name || !j->url || !j->template_name ? TD_ENOMEM : 0;
    if (!rc) rc = td_ctrl_hostport_url(p->router, url, sizeof url);
    td_ctrl_opts o = {.reconnect_max_ms = 500, .security = p->security};
    if (!rc) rc = td_ctrl_client_create(url, &o, &j->c);
    if (!rc && pthread_create(&j->thread, NULL, join_main, j)) rc = TD_ENOMEM;
    if (rc) {
        join_free(j);
        return rc;
    }
    *out = j;
    return 0;
}

int td_join_start(const td_join_params *p, td_join **out)
{
    *out = NULL;
    char self[300] = "";
    int rc = !p->router || !p->name || !p->bound || p->period_ms <= 0 ? TD_EINVAL : 0;
    if (!rc) rc = join_url(p->bound, p->host, self, sizeof self);
    if (!rc) rc = join_start(p, self, out);
    if (rc)
        TD_LOG_ERR("%s: cannot announce itself to the router at %s: %s", p->name ? p->name : "?",
                   p->router ? p->router : "?", td_strerror(rc));
    else
        TD_LOG_INFO("%s: announces itself as %s to the router at %s every %d ms", p->name, self,
                    p->router, p->period_ms);
    return rc;
}

void td_join_leave(td_join *j)
{
    if (j) atomic_store(&j->leave, true);
}

void td_join_stop(td_join *j)
{
    if (!j) return;
    /* a node that said it leaves: give that Join a moment to reach the router (it then
       forgets a joined instance at once instead of after its lease) */
    int64_t until = td_now_ms() + JOIN_LEAVE_WAIT_MS;
    while (atomic_load(&j->leave) && !atomic_load(&j->left) && td_now_ms() < until) {
        struct timespec ts = {.tv_nsec = 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    atomic_store(&j->stop, true);
    pthread_join(j->thread, NULL);
    join_free(j);
}
