/* ctrl_client.c: the client side of the control plane: an NNG req0 socket with one
 * context per call, plus the persistent event Poll.
 *
 * A call (one request, one reply):
 *
 *   SEND --sent (callback)--> RECV --reply or timeout (callback)--> DONE (in the inbox)
 *    ^ \--send timed out (callback)---------------------------------^
 *    |                          | transport error, deadline not passed
 *   SLEEP <---------------------+ (also from SEND)
 *
 * The deadline covers both phases (the send waits for a connection). A transport error
 * before the deadline (the connection reset under the request) sends the request again
 * after RETRY_MS (SLEEP state), so a request may reach the server twice: servers treat
 * Submit/Cancel of the same (client_id, request_id) as idempotent. DONE calls are freed
 * by the owner in td_ctrl_client_recv.
 *
 * NNG 1.5.2's req0 can complete a send with success while the message is still attached
 * to the aio (seen when a Poll's send to an instance whose server had gone timed out:
 * the send "succeeded" at its deadline, the receive that followed failed NNG_ESTATE, and
 * the next send's nng_aio_set_msg dropped the old message, a leak per dead instance).
 * A send that reports success but left its message with us was not sent: it is handled
 * as a failed send (the message is freed, the call retried or timed out).
 *
 * The Poll is one persistent call that never reaches DONE: its callback decodes the
 * Events reply, pushes the new events (seq > last_seq) into the inbox and posts the next
 * Poll acknowledging them. It pauses (poll_paused) while the owner has more than
 * MAX_QUEUED items waiting, so a slow owner pushes back on the server's outbox, and it
 * sleeps POLL_BACKOFF_MS after an error reply before it tries again.
 */
#include "ctrl_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nng/protocol/reqrep0/req.h>

#include "td_clock.h"
#include "td_err.h"

#define MAX_QUEUED      1024
#define POLL_BACKOFF_MS 250 /* after a bad reply */
#define RETRY_MS        20  /* after a transport error */
#define DEFAULT_TIMEOUT 10000

enum { CALL_SEND, CALL_RECV, CALL_DONE, CALL_SLEEP };
enum { IT_REPLY = 1, IT_EVENTS, IT_UP, IT_DOWN, IT_RESTARTED };

typedef struct call {
    td_ctrl_client *c;
    nng_ctx ctx;
    nng_aio *aio;
    uint64_t call_id;
    int state;        /* CALL_*; changed by the aio callback (one at a time per aio) */
    int64_t deadline; /* ms */
    nng_msg *req;     /* the request, kept for a resend (a copy goes out each time) */
    bool is_poll;
    struct call *next, *prev; /* c->calls, under c->mu */
} call;

struct td_ctrl_client {
    td_ctrl_opts o;
    char *url; /* for the log */
    nng_socket sock;
    bool sock_open;
    uint64_t id;
    uint64_t next_call; /* owner thread */
    pthread_mutex_t mu; /* calls list, closing, last_seq, poll_paused */
    call *calls;
    call *poll;
    bool closing;
    uint64_t last_seq; /* highest event seq pushed into the inbox */
    uint64_t epoch;    /* the server instance last_seq counts for; 0 none yet */
    bool poll_paused;
    td_ctrl_inbox ib;
    bool ib_ok;
    bool tls;                /* dials tls+tcp:// */
    td_ctrl_tls_watch watch; /* its refused handshakes (owner thread) */
};

static void call_cb(void *arg);

static void calls_add(td_ctrl_client *c, call *k)
{
    pthread_mutex_lock(&c->mu);
    k->prev = NULL;
    k->next = c->calls;
    if (c->calls) c->calls->prev = k;
    c->calls = k;
    pthread_mutex_unlock(&c->mu);
}

static void call_free(td_ctrl_client *c, call *k)
{
    pthread_mutex_lock(&c->mu);
    if (k->prev)
        k->prev->next = k->next;
    else
        c->calls = k->next;
    if (k->next) k->next->prev = k->prev;
    pthread_mutex_unlock(&c->mu);
    /* stop first (waits for a callback still running): a send posted by that callback on
     * a stopping aio fails without a callback and leaves its message attached to the aio,
     * which nng_aio_free would not free */
    nng_aio_stop(k->aio);
    nng_msg *left = nng_aio_get_msg(k->aio);
    if (left) nng_msg_free(left);
    nng_aio_free(k->aio);
    nng_ctx_close(k->ctx);
    if (k->req) nng_msg_free(k->req);
    free(k);
}

static call *call_new(td_ctrl_client *c, bool is_poll)
{
    call *k = calloc(1, sizeof *k);
    if (!k) return NULL;
    k->c = c;
    k->is_poll = is_poll;
    int rv = nng_ctx_open(&k->ctx, c->sock);
    if (!rv) rv = nng_aio_alloc(&k->aio, call_cb, k);
    if (rv) {
        TD_LOG_ERR("ctrl: cannot open a request context: %s", nng_strerror(rv));
        if (k->aio) nng_aio_free(k->aio);
        free(k);
        return NULL;
    }
    calls_add(c, k);
    return k;
}

/* Send a copy of k->req with what is left of the deadline. Returns an NNG error if no
 * copy could be made (then the callback is not called). */
static int call_send(call *k)
{
    int64_t left = k->deadline - td_now_ms();
    nng_msg *m;
    int rv = nng_msg_dup(&m, k->req);
    if (rv) return rv;
    k->state = CALL_SEND;
    nng_aio_set_msg(k->aio, m);
    nng_aio_set_timeout(k->aio, left > 0 ? (nng_duration)left : 1);
    nng_ctx_send(k->ctx, k->aio);
    return 0;
}

/* Start a call of msg on k (takes msg). */
static int call_start(call *k, nng_msg *msg, int timeout_ms)
{
    if (k->req) nng_msg_free(k->req);
    k->req = msg;
    k->deadline = td_now_ms() + timeout_ms;
    return call_send(k);
}

static void push_item(td_ctrl_client *c, int kind, void *ptr, nng_msg *msg, int rv)
{
    td_ctrl_item *it = calloc(1, sizeof *it);
    if (!it) { /* nothing to deliver it with: the caller's wait times out */
        if (msg) nng_msg_free(msg);
        if (kind == IT_EVENTS) td_ctrl_envelope_free(ptr);
        return;
    }
    it->kind = kind;
    it->ptr = ptr;
    it->msg = msg;
    it->rv = rv;
    td_ctrl_inbox_push(&c->ib, it);
}

/* Post the next Poll (callback or owner thread). */
static void poll_start(td_ctrl_client *c)
{
    call *k = c->poll;
    pthread_mutex_lock(&c->mu);
    bool closing = c->closing;
    uint64_t ack = c->last_seq, epoch = c->epoch;
    pthread_mutex_unlock(&c->mu);
    if (closing) return;
    Td__Poll p = TD__POLL__INIT;
    p.ack_seq = ack;
    p.wait_ms = (uint32_t)c->o.poll_wait_ms;
    p.epoch = epoch;
    int timeout = c->o.poll_wait_ms + (c->o.poll_wait_ms > 2000 ? c->o.poll_wait_ms : 2000);
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.client_id = c->id;
    e.timeout_ms = (uint32_t)timeout;
    e.body_case = TD__ENVELOPE__BODY_POLL;
    e.poll = &p;
    nng_msg *m;
    if (td_ctrl_pack_msg(&e, &c->o, &m)) {
        k->state = CALL_SLEEP;
        nng_sleep_aio(POLL_BACKOFF_MS, k->aio);
        return;
    }
    if (call_start(k, m, timeout)) {
        k->state = CALL_SLEEP;
        nng_sleep_aio(POLL_BACKOFF_MS, k->aio);
    }
}

/* The Poll's reply: deliver new events; returns false if the reply was not usable. */
static bool poll_reply(td_ctrl_client *c, nng_msg *m)
{
    char err[256];
    Td__Envelope *env;
    int rc = td_ctrl_decode(nng_msg_body(m), nng_msg_len(m), &c->o, &env, err, sizeof err);
    nng_msg_free(m);
    if (rc) {
        TD_LOG_WARN("ctrl: bad poll reply from the server: %s", err);
        return false;
    }
    if (env->body_case != TD__ENVELOPE__BODY_EVENTS) {
        if (env->body_case == TD__ENVELOPE__BODY_ERROR)
            TD_LOG_WARN("ctrl: server refused the event poll: %s: %s",
                        td_ctrl_err_name(env->error->code), env->error->message);
        td_ctrl_envelope_free(env);
        return false;
    }
    const Td__Events *ev = env->events;
    pthread_mutex_lock(&c->mu);
    bool restarted = false;
    if (ev->epoch != c->epoch) { /* a new server instance: its seq starts over */
        restarted = c->epoch != 0;
        if (restarted) TD_LOG_INFO("ctrl: the server restarted (new event epoch)");
        c->epoch = ev->epoch;
        c->last_seq = 0;
    }
    size_t start = 0;
    while (start < ev->n_events && ev->events[start]->seq <= c->last_seq)
        start++;
    if (start < ev->n_events) {
        if (ev->events[start]->seq != c->last_seq + 1)
            TD_LOG_WARN("ctrl: events %llu..%llu from the server are missing",
                        (unsigned long long)c->last_seq + 1,
                        (unsigned long long)ev->events[start]->seq - 1);
        c->last_seq = ev->events[ev->n_events - 1]->seq;
    }
    pthread_mutex_unlock(&c->mu);
    /* before the new process's events: the owner must first forget the old one's work */
    if (restarted) push_item(c, IT_RESTARTED, NULL, NULL, 0);
    if (start < ev->n_events)
        push_item(c, IT_EVENTS, env, NULL, (int)start);
    else
        td_ctrl_envelope_free(env);
    return true;
}

static void poll_cb(call *k, int rv)
{
    td_ctrl_client *c = k->c;
    if (rv == NNG_ECLOSED || rv == NNG_ECANCELED) {
        /* a send that did not happen leaves its message with us (NNG's rule) */
        if (k->state == CALL_SEND) {
            nng_msg_free(nng_aio_get_msg(k->aio));
            nng_aio_set_msg(k->aio, NULL);
        }
        return;
    }
    if (k->state == CALL_SLEEP) {
        poll_start(c);
        return;
    }
    if (k->state == CALL_SEND && rv == 0 && nng_aio_get_msg(k->aio))
        rv = NNG_ETIMEDOUT; /* not sent after all (see the top of this file): ask again at once */
    if (k->state == CALL_SEND && rv == 0) {
        int64_t left = k->deadline - td_now_ms();
        k->state = CALL_RECV;
        nng_aio_set_timeout(k->aio, left > 0 ? (nng_duration)left : 1);
        nng_ctx_recv(k->ctx, k->aio);
        return;
    }
    bool ok = false;
    if (k->state == CALL_SEND) {
        nng_msg_free(nng_aio_get_msg(k->aio));
        nng_aio_set_msg(k->aio, NULL);
    } else if (rv == 0) {
        nng_msg *m = nng_aio_get_msg(k->aio);
        nng_aio_set_msg(k->aio, NULL);
        /* NNG 1.5.2 can complete a receive with success and no message (nanomsg/nng#1620
         * territory): treat it as a failed poll and ask again after the back-off */
        ok = m && poll_reply(c, m);
    }
    if (rv == NNG_ETIMEDOUT) ok = true; /* no server (yet): ask again at once */
    if (!ok) {
        k->state = CALL_SLEEP;
        nng_sleep_aio(rv ? RETRY_MS : POLL_BACKOFF_MS, k->aio);
        return;
    }
    pthread_mutex_lock(&c->mu);
    bool pause = td_ctrl_inbox_len(&c->ib) > MAX_QUEUED;
    c->poll_paused = pause;
    pthread_mutex_unlock(&c->mu);
    if (!pause) poll_start(c);
}

static void call_cb(void *arg)
{
    call *k = arg;
    td_ctrl_client *c = k->c;
    int rv = nng_aio_result(k->aio);
    if (k->is_poll) {
        poll_cb(k, rv);
        return;
    }
    int64_t left = k->deadline - td_now_ms();
    if (k->state == CALL_SEND && rv == 0 && nng_aio_get_msg(k->aio))
        rv = left > RETRY_MS ? NNG_ECONNSHUT : NNG_ETIMEDOUT; /* not sent after all */
    if (k->state == CALL_SLEEP) {
        if (rv == 0 && call_send(k) == 0) return;
        if (rv == 0) rv = NNG_ENOMEM;
    } else if (k->state == CALL_SEND) {
        if (rv == 0) {
            k->state = CALL_RECV;
            nng_aio_set_timeout(k->aio, left > 0 ? (nng_duration)left : 1);
            nng_ctx_recv(k->ctx, k->aio);
            return;
        }
        nng_msg_free(nng_aio_get_msg(k->aio));
        nng_aio_set_msg(k->aio, NULL);
    }
    if (rv && rv != NNG_ETIMEDOUT && rv != NNG_ECLOSED && rv != NNG_ECANCELED && rv != NNG_ENOMEM &&
        left > RETRY_MS) { /* connection lost under the call: again */
        TD_LOG_DEBUG("ctrl: call %llu: %s; sending it again", (unsigned long long)k->call_id,
                     nng_strerror(rv));
        k->state = CALL_SLEEP;
        nng_sleep_aio(RETRY_MS, k->aio);
        return;
    }
    nng_msg *m = NULL;
    if (rv == 0) {
        m = nng_aio_get_msg(k->aio);
        nng_aio_set_msg(k->aio, NULL);
        if (!m) rv = NNG_EPROTO; /* success without a message (see poll_cb): a failed call */
    }
    k->state = CALL_DONE;
    push_item(c, IT_REPLY, k, m, rv);
}

static void pipe_cb(nng_pipe p, nng_pipe_ev ev, void *arg)
{
    (void)p;
    td_ctrl_client *c = arg;
    push_item(c, ev == NNG_PIPE_EV_ADD_POST ? IT_UP : IT_DOWN, NULL, NULL, 0);
}

/* ---- owner API ----------------------------------------------------------------------- */

static int call_msg(td_ctrl_client *c, nng_msg *m, int timeout_ms, uint64_t *call_id)
{
    call *k = call_new(c, false);
    if (!k) {
        nng_msg_free(m);
        return TD_ENOMEM;
    }
    k->call_id = c->next_call;
    if (call_id) *call_id = k->call_id;
    if (call_start(k, m, timeout_ms)) {
        call_free(c, k);
        return TD_ENOMEM;
    }
    return 0;
}

int td_ctrl_client_call(td_ctrl_client *c, const Td__Envelope *req, int timeout_ms,
                        uint64_t *call_id)
{
    if (!c) return TD_EINVAL; /* e.g. a router's instance whose new address failed to dial */
    if (timeout_ms <= 0) timeout_ms = DEFAULT_TIMEOUT;
    Td__Envelope e = *req;
    e.version = TD_CTRL_VERSION;
    e.client_id = c->id;
    e.call_id = ++c->next_call;
    e.timeout_ms = (uint32_t)timeout_ms;
    nng_msg *m;
    int rc = td_ctrl_pack_msg(&e, &c->o, &m);
    if (rc) return rc;
    return call_msg(c, m, timeout_ms, call_id);
}

int td_ctrl_client_call_raw(td_ctrl_client *c, const void *buf, size_t len, int timeout_ms,
                            uint64_t *call_id)
{
    if (timeout_ms <= 0) timeout_ms = DEFAULT_TIMEOUT;
    nng_msg *m;
    if (nng_msg_alloc(&m, len)) return TD_ENOMEM;
    if (len) memcpy(nng_msg_body(m), buf, len);
    ++c->next_call;
    return call_msg(c, m, timeout_ms, call_id);
}

int td_ctrl_client_submit(td_ctrl_client *c, const Td__Submit *sub, int timeout_ms,
                          uint64_t *call_id)
{
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.body_case = TD__ENVELOPE__BODY_SUBMIT;
    e.submit = (Td__Submit *)sub;
    return td_ctrl_client_call(c, &e, timeout_ms, call_id);
}

int td_ctrl_client_cancel(td_ctrl_client *c, uint64_t request_id, int timeout_ms, uint64_t *call_id)
{
    Td__Cancel x = TD__CANCEL__INIT;
    x.request_id = request_id;
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.body_case = TD__ENVELOPE__BODY_CANCEL;
    e.cancel = &x;
    return td_ctrl_client_call(c, &e, timeout_ms, call_id);
}

int td_ctrl_client_health(td_ctrl_client *c, int timeout_ms, uint64_t *call_id)
{
    Td__HealthRequest h = TD__HEALTH_REQUEST__INIT;
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.body_case = TD__ENVELOPE__BODY_HEALTH_REQUEST;
    e.health_request = &h;
    return td_ctrl_client_call(c, &e, timeout_ms, call_id);
}

void td_ctrl_client_in_free(td_ctrl_client_in *in)
{
    td_ctrl_envelope_free(in->env);
    td_ctrl_envelope_free(in->priv_);
    memset(in, 0, sizeof *in);
}

/* Log the TLS handshakes that failed since the last look (at most once a second). */
static void watch_tls(td_ctrl_client *c)
{
    uint64_t n;
    td_ctrl_tls_failures(&c->watch, &n);
    if (n)
        TD_LOG_WARN("ctrl: %s: %llu TLS handshake%s failed (the server's certificate is not "
                    "signed by the cluster's CA, or the server refused this side's)",
                    c->url, (unsigned long long)n, n == 1 ? "" : "s");
}

int td_ctrl_client_recv(td_ctrl_client *c, td_ctrl_client_in *in, int timeout_ms)
{
    td_ctrl_client_in_free(in);
    if (c->tls) watch_tls(c);
    int64_t end = timeout_ms < 0 ? -1 : td_now_ms() + timeout_ms;
    td_ctrl_item *it = td_ctrl_inbox_pop(&c->ib, end);
    if (!it) return TD_ETIMEDOUT;
    switch (it->kind) {
    case IT_REPLY: {
        call *k = it->ptr;
        in->kind = TD_CTRL_IN_REPLY;
        in->call_id = k->call_id;
        in->err = td_ctrl_nng_err(it->rv);
        if (!it->rv) {
            char err[256];
            in->err = td_ctrl_decode(nng_msg_body(it->msg), nng_msg_len(it->msg), &c->o, &in->env,
                                     err, sizeof err);
            if (in->err)
                TD_LOG_WARN("ctrl: bad reply to call %llu: %s", (unsigned long long)k->call_id,
                            err);
        } else if (in->err == TD_ESTATE) {
            in->err = TD_EIO;
        }
        call_free(c, k);
        break;
    }
    case IT_EVENTS: {
        Td__Envelope *env = it->ptr;
        in->kind = TD_CTRL_IN_EVENTS;
        in->events = env->events->events + it->rv;
        in->n_events = env->events->n_events - (size_t)it->rv;
        in->health = env->events->health;
        in->priv_ = env;
        break;
    }
    case IT_UP:
        in->kind = TD_CTRL_IN_CONNECTED;
        break;
    case IT_RESTARTED:
        in->kind = TD_CTRL_IN_RESTARTED;
        break;
    default:
        in->kind = TD_CTRL_IN_DISCONNECTED;
        break;
    }
    if (it->msg) nng_msg_free(it->msg);
    free(it);
    pthread_mutex_lock(&c->mu);
    bool resume = c->poll_paused && td_ctrl_inbox_len(&c->ib) < MAX_QUEUED / 2;
    if (resume) c->poll_paused = false;
    pthread_mutex_unlock(&c->mu);
    if (resume) poll_start(c);
    return 0;
}

int td_ctrl_client_fd(const td_ctrl_client *c)
{
    return c->ib.efd;
}

uint64_t td_ctrl_client_epoch(td_ctrl_client *c)
{
    pthread_mutex_lock(&c->mu);
    uint64_t e = c->epoch;
    pthread_mutex_unlock(&c->mu);
    return e;
}

/* ---- lifetime ------------------------------------------------------------------------ */

int td_ctrl_client_create(const char *url_in, const td_ctrl_opts *opts, td_ctrl_client **out)
{
    *out = NULL;
    char url[512];
    int rc = td_ctrl_tls_url(td_ctrl_tls_on(opts), url_in, url, sizeof url);
    if (rc) return rc;
    nng_tls_config *tls = NULL;
    if (!strncmp(url, "tls+", 4) && (rc = td_ctrl_tls_config(opts, false, &tls))) return rc;
    td_ctrl_client *c = calloc(1, sizeof *c);
    if (!c) {
        if (tls) nng_tls_config_free(tls);
        return TD_ENOMEM;
    }
    td_ctrl_opts_fill(opts, &c->o);
    c->o.security = NULL; /* borrowed during create only */
    c->tls = tls != NULL;
    c->url = strdup(url);
    c->id = td_ctrl_random_id();
    pthread_mutex_init(&c->mu, NULL);
    rc = td_ctrl_inbox_init(&c->ib);
    if (rc) {
        if (tls) nng_tls_config_free(tls);
        pthread_mutex_destroy(&c->mu);
        free(c->url);
        free(c);
        return rc;
    }
    c->ib_ok = true;
    int rv = nng_req0_open(&c->sock);
    if (rv) {
        TD_LOG_ERR("ctrl: nng_req0_open: %s", nng_strerror(rv));
        if (tls) nng_tls_config_free(tls);
        td_ctrl_client_destroy(c);
        return td_ctrl_nng_err(rv);
    }
    c->sock_open = true;
    /* no blind resends: a request is delivered once or its deadline reports it */
    nng_socket_set_ms(c->sock, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE);
    nng_socket_set_ms(c->sock, NNG_OPT_RECONNMINT, c->o.reconnect_min_ms);
    nng_socket_set_ms(c->sock, NNG_OPT_RECONNMAXT, c->o.reconnect_max_ms);
    nng_socket_set_size(c->sock, NNG_OPT_RECVMAXSZ, 2 * c->o.max_msg_bytes + 4096);
    nng_pipe_notify(c->sock, NNG_PIPE_EV_ADD_POST, pipe_cb, c);
    nng_pipe_notify(c->sock, NNG_PIPE_EV_REM_POST, pipe_cb, c);
    nng_dialer d;
    rv = nng_dialer_create(&d, c->sock, url);
    if (!rv && tls) rv = nng_dialer_set_ptr(d, NNG_OPT_TLS_CONFIG, tls);
    if (tls) nng_tls_config_free(tls); /* the dialer holds its own reference */
    if (!rv) rv = nng_dialer_start(d, NNG_FLAG_NONBLOCK);
    if (!rv && c->tls) {
        c->watch = (td_ctrl_tls_watch){.d = d};
        uint64_t none;
        td_ctrl_tls_failures(&c->watch, &none); /* from here on */
    }
    if (rv) {
        TD_LOG_ERR("ctrl: dial %s: %s", url, nng_strerror(rv));
        td_ctrl_client_destroy(c);
        return td_ctrl_nng_err(rv);
    }
    c->poll = call_new(c, true);
    if (!c->poll) {
        td_ctrl_client_destroy(c);
        return TD_ENOMEM;
    }
    poll_start(c);
    *out = c;
    return 0;
}

/* Everything after `closing`: close the socket (NNG then completes or cancels every call and
 * the Poll), stop the aios and free. Runs on its own thread (td_ctrl_teardown_bounded). */
static void client_teardown(void *arg)
{
    td_ctrl_client *c = arg;
    if (c->sock_open) nng_close(c->sock);
    for (call *k = c->calls; k; k = k->next)
        nng_aio_stop(k->aio);
    if (c->ib_ok) {
        td_ctrl_item *it;
        while ((it = td_ctrl_inbox_pop(&c->ib, 0))) {
            if (it->kind == IT_EVENTS) td_ctrl_envelope_free(it->ptr);
            if (it->msg) nng_msg_free(it->msg);
            free(it);
        }
    }
    while (c->calls) {
        call *k = c->calls;
        c->calls = k->next;
        nng_msg *m = nng_aio_get_msg(k->aio);
        if (m) nng_msg_free(m);
        if (k->req) nng_msg_free(k->req);
        nng_aio_free(k->aio);
        free(k);
    }
    if (c->ib_ok) td_ctrl_inbox_fini(&c->ib);
    pthread_mutex_destroy(&c->mu);
    free(c->url);
    free(c);
}

void td_ctrl_client_destroy(td_ctrl_client *c)
{
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    c->closing = true;
    pthread_mutex_unlock(&c->mu);
    if (!c->sock_open) {
        client_teardown(c);
        return;
    }
    /* nng_close may never return (ctrl_internal.h): the owner goes on after a bound, and
       the client is left to NNG (never freed) if its close hangs */
    char what[320];
    snprintf(what, sizeof what, "the control client of %s", c->url ? c->url : "?");
    td_ctrl_teardown_bounded(client_teardown, c, what);
}
