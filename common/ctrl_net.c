/* ctrl_net.c: the inbox between NNG callbacks and the owner thread, and NNG helpers. */
#include "ctrl_internal.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "td_clock.h"
#include "td_err.h"

uint64_t td_ctrl_random_id(void)
{
    uint64_t id = 0;
    if (getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id) {
        struct timespec ts = td_wall_now(); /* a seed, not a time */
        id = ((uint64_t)ts.tv_nsec << 32) ^ (uint64_t)ts.tv_sec ^ ((uint64_t)getpid() << 16);
    }
    return id ? id : 1;
}

int td_ctrl_nng_err(int rv)
{
    switch (rv) {
    case 0:
        return 0;
    case NNG_ETIMEDOUT:
        return TD_ETIMEDOUT;
    case NNG_ECLOSED:
    case NNG_ECANCELED:
        return TD_ESTATE;
    case NNG_ENOMEM:
        return TD_ENOMEM;
    case NNG_EINVAL:
    case NNG_EADDRINVAL:
    case NNG_ENOTSUP:
        return TD_EINVAL;
    default:
        return TD_EIO;
    }
}

int td_ctrl_pack_msg(const Td__Envelope *env, const td_ctrl_opts *opts, nng_msg **out)
{
    *out = NULL;
    if (!env || env->body_case == TD__ENVELOPE__BODY__NOT_SET) {
        TD_LOG_ERR("ctrl: envelope without a body");
        return TD_EINVAL;
    }
    Td__Envelope e = *env;
    if (!e.version) e.version = TD_CTRL_VERSION;
    size_t n = td__envelope__get_packed_size(&e);
    if (n > opts->max_msg_bytes) {
        TD_LOG_ERR("ctrl: %s message of %zu bytes exceeds the limit of %zu bytes",
                   td_ctrl_body_name(e.body_case), n, opts->max_msg_bytes);
        return TD_ERANGE;
    }
    nng_msg *m;
    int rv = nng_msg_alloc(&m, n);
    if (rv) return TD_ENOMEM;
    td__envelope__pack(&e, nng_msg_body(m));
    *out = m;
    return 0;
}

/* ---- inbox --------------------------------------------------------------------------- */

int td_ctrl_inbox_init(td_ctrl_inbox *ib)
{
    memset(ib, 0, sizeof *ib);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&ib->mu, NULL);
    pthread_cond_init(&ib->cv, &ca);
    pthread_condattr_destroy(&ca);
    ib->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (ib->efd < 0) {
        TD_LOG_ERR("ctrl: eventfd: %s", strerror(errno));
        pthread_cond_destroy(&ib->cv);
        pthread_mutex_destroy(&ib->mu);
        return TD_EIO;
    }
    return 0;
}

void td_ctrl_inbox_fini(td_ctrl_inbox *ib)
{
    td_ctrl_item *it = ib->head;
    while (it) {
        td_ctrl_item *next = it->next;
        if (it->msg) nng_msg_free(it->msg);
        free(it);
        it = next;
    }
    ib->head = ib->tail = NULL;
    if (ib->efd >= 0) close(ib->efd);
    ib->efd = -1;
    pthread_cond_destroy(&ib->cv);
    pthread_mutex_destroy(&ib->mu);
}

void td_ctrl_inbox_push(td_ctrl_inbox *ib, td_ctrl_item *it)
{
    it->next = NULL;
    pthread_mutex_lock(&ib->mu);
    if (ib->tail)
        ib->tail->next = it;
    else
        ib->head = it;
    ib->tail = it;
    if (ib->n++ == 0) {
        uint64_t one = 1;
        if (write(ib->efd, &one, sizeof one) < 0) { /* counter full: already readable */
        }
    }
    pthread_cond_signal(&ib->cv);
    pthread_mutex_unlock(&ib->mu);
}

td_ctrl_item *td_ctrl_inbox_pop(td_ctrl_inbox *ib, int64_t deadline_ms)
{
    pthread_mutex_lock(&ib->mu);
    while (!ib->head) {
        if (deadline_ms < 0) {
            pthread_cond_wait(&ib->cv, &ib->mu);
            continue;
        }
        int64_t now = td_now_ms();
        if (now >= deadline_ms) break;
        struct timespec ts = td_deadline_ts(deadline_ms - now);
        pthread_cond_timedwait(&ib->cv, &ib->mu, &ts);
    }
    td_ctrl_item *it = ib->head;
    if (it) {
        ib->head = it->next;
        if (!ib->head) ib->tail = NULL;
        if (--ib->n == 0) {
            uint64_t v;
            if (read(ib->efd, &v, sizeof v) < 0) { /* not readable: nothing to clear */
            }
        }
    }
    pthread_mutex_unlock(&ib->mu);
    return it;
}

size_t td_ctrl_inbox_len(td_ctrl_inbox *ib)
{
    pthread_mutex_lock(&ib->mu);
    size_t n = ib->n;
    pthread_mutex_unlock(&ib->mu);
    return n;
}

/* ---- bounded teardown ---------------------------------------------------------------- */

typedef struct {
    void (*fn)(void *);
    void *arg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done; /* fn returned */
    int refs;  /* the waiting caller and the thread, under mu */
} teardown;

static atomic_bool g_teardown_stuck; /* a teardown of this process was given up */

static void teardown_unref(teardown *t)
{
    pthread_mutex_lock(&t->mu);
    int left = --t->refs;
    pthread_mutex_unlock(&t->mu);
    if (left) return;
    pthread_cond_destroy(&t->cv);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

static void *teardown_main(void *arg)
{
    teardown *t = arg;
    t->fn(t->arg);
    pthread_mutex_lock(&t->mu);
    t->done = true;
    pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
    teardown_unref(t);
    return NULL;
}

bool td_ctrl_teardown_bounded(void (*fn)(void *), void *arg, const char *what)
{
    int wait_ms = atomic_load(&g_teardown_stuck) ? TD_CTRL_TEARDOWN_STUCK_MS : TD_CTRL_TEARDOWN_MS;
    teardown *t = calloc(1, sizeof *t);
    if (!t) { /* no thread to spare it: the teardown itself, unbounded */
        fn(arg);
        return true;
    }
    t->fn = fn;
    t->arg = arg;
    t->refs = 2;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t th;
    int err = pthread_create(&th, &attr, teardown_main, t);
    pthread_attr_destroy(&attr);
    if (err) {
        t->refs = 1;
        teardown_unref(t);
        fn(arg);
        return true;
    }
    struct timespec until = td_deadline_ts(wait_ms);
    pthread_mutex_lock(&t->mu);
    while (!t->done)
        if (pthread_cond_timedwait(&t->cv, &t->mu, &until) == ETIMEDOUT) break;
    bool done = t->done;
    pthread_mutex_unlock(&t->mu);
    teardown_unref(t);
    if (!done) {
        atomic_store(&g_teardown_stuck, true);
        TD_LOG_WARN("ctrl: closing %s did not finish within %d ms (NNG's close hangs: "
                    "nanomsg/nng#1543); going on without it, its memory is not freed",
                    what, wait_ms);
    }
    return done;
}

int td_ctrl_hostport_url(const char *hp, char *url, size_t cap)
{
    const char *colon = hp ? strrchr(hp, ':') : NULL;
    if (!colon || colon == hp) return TD_EINVAL;
    char host[256];
    size_t hl = (size_t)(colon - hp);
    if (hl >= 2 && hp[0] == '[' && hp[hl - 1] == ']') {
        hp++;
        hl -= 2;
    }
    if (hl >= sizeof host) return TD_ERANGE;
    memcpy(host, hp, hl);
    host[hl] = '\0';
    bool v6 = strchr(host, ':') != NULL;
    int n =
        snprintf(url, cap, "tcp://%s%s%s:%d", v6 ? "[" : "", host, v6 ? "]" : "", atoi(colon + 1));
    return n > 0 && (size_t)n < cap ? 0 : TD_ERANGE;
}
