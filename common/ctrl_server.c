/* ctrl_server.c: the server side of the control plane: an NNG rep0 socket with a pool of
 * contexts, per-client event outboxes served by long-poll, bad-input replies.
 *
 * A context (td_ctrl_req) moves through these states:
 *
 *   IDLE --keep_receiving--> RECV --message (callback)--> HELD --reply--> SEND
 *    ^                                                                     |
 *    +----------------------- send completed (callback) -------------------+
 *
 * RECV: posted nng_ctx_recv; the callback moves it to HELD and pushes the message into
 *       the inbox. The socket keeps N_RECV contexts in RECV, so a held request (an Alloc
 *       waiting for blocks, a parked Poll) never stops the server from receiving.
 * HELD: owned by the owner thread: either handed out as a td_ctrl_server_in request, or a
 *       client's parked Poll, or being rejected. Leaves only through srv_send.
 * SEND: posted nng_ctx_send with a bounded timeout; back to IDLE (free list) after.
 * Every context is on s->all from creation to td_ctrl_server_destroy.
 */
#include "ctrl_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nng/protocol/reqrep0/rep.h>

#include "td_clock.h"
#include "td_err.h"

#define N_RECV            8    /* contexts kept receiving */
#define MAX_CTX           4096 /* requests held at once (beyond: NNG queues in the pipes) */
#define MAX_CLIENTS       1024
#define MAX_TLS_LISTENERS 4 /* tls+tcp listeners watched for refused handshakes */

enum { SC_IDLE, SC_RECV, SC_HELD, SC_SEND };
enum { IT_MSG = 1, IT_PIPE_REM };

struct td_ctrl_req {
    td_ctrl_server *s;
    nng_ctx ctx;
    nng_aio *aio;
    int state;           /* SC_*; changed under s->mu by callbacks, by the owner in HELD */
    uint64_t call_id;    /* HELD: the request's call id (echoed in the reply) */
    Td__Envelope *env;   /* HELD: the decoded request, freed at reply */
    int64_t poll_expire; /* HELD as a parked Poll: when to answer it empty */
    struct td_ctrl_req *all_next, *free_next;
};

typedef struct client {
    uint64_t id;
    uint32_t pipe;       /* pipe its last message came on */
    int64_t last_seen;   /* ms */
    int64_t gone_at;     /* its pipe closed: gone at this time unless it comes back; 0 */
    td_ctrl_req *parked; /* its held Poll, or NULL */
    uint64_t next_seq;   /* seq of the next queued event (from 1) */
    Td__Event **ob;      /* (ob_cap) ring of unacknowledged events, owned */
    size_t ob_head, ob_n, ob_cap;
    struct client *next;
} client;

struct td_ctrl_server {
    td_ctrl_opts o;
    nng_socket sock;
    bool sock_open;
    pthread_mutex_t mu; /* ctx lists, states, counts, closing */
    td_ctrl_req *all, *free;
    int n_recv, n_ctx;
    bool closing;
    td_ctrl_inbox ib;
    bool ib_ok;
    client *clients; /* owner thread only */
    uint32_t n_clients;
    Td__Health *health; /* owned copy, or NULL; replaced under health_mu */
    pthread_mutex_t health_mu;
    uint64_t epoch; /* random, nonzero: Events.epoch */
    td_ctrl_server_stats st;
    nng_tls_config *tls;                        /* opts.security's, or NULL: plain tcp */
    td_ctrl_tls_watch watch[MAX_TLS_LISTENERS]; /* owner thread */
    char watch_url[MAX_TLS_LISTENERS][256];
    int n_watch;
};

/* ---- contexts ------------------------------------------------------------------------ */

static void ctx_cb(void *arg);

/* Post receives until N_RECV contexts wait (at most MAX_CTX contexts exist). */
static void keep_receiving(td_ctrl_server *s)
{
    td_ctrl_req *post[N_RECV];
    int n = 0;
    pthread_mutex_lock(&s->mu);
    while (!s->closing && s->n_recv < N_RECV) {
        td_ctrl_req *r = s->free;
        if (r) {
            s->free = r->free_next;
        } else {
            if (s->n_ctx >= MAX_CTX) break;
            r = calloc(1, sizeof *r);
            if (!r) break;
            r->s = s;
            if (nng_ctx_open(&r->ctx, s->sock) || nng_aio_alloc(&r->aio, ctx_cb, r)) {
                if (r->aio) nng_aio_free(r->aio);
                free(r);
                break;
            }
            r->all_next = s->all;
            s->all = r;
            s->n_ctx++;
        }
        r->state = SC_RECV;
        s->n_recv++;
        post[n++] = r;
    }
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < n; i++)
        nng_ctx_recv(post[i]->ctx, post[i]->aio);
}

static int srv_send(td_ctrl_server *s, td_ctrl_req *r, const Td__Envelope *reply);

/* A HealthRequest is answered right here on NNG's thread: a node whose owner thread is
 * inside a long computation (a prefill chunk of an 8K-token prompt, a large decode step)
 * still shows the router that it is alive and what its load is. Everything else goes to
 * the owner's inbox. Returns true (and consumes msg) if it answered. */
static bool answer_health(td_ctrl_server *s, td_ctrl_req *r, nng_msg *msg)
{
    Td__Envelope *env = NULL;
    if (td_ctrl_decode(nng_msg_body(msg), nng_msg_len(msg), &s->o, &env, NULL, 0)) return false;
    if (env->body_case != TD__ENVELOPE__BODY_HEALTH_REQUEST) {
        td_ctrl_envelope_free(env);
        return false;
    }
    r->call_id = env->call_id;
    r->env = NULL;
    td_ctrl_envelope_free(env);
    nng_msg_free(msg);
    Td__Health empty = TD__HEALTH__INIT;
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.body_case = TD__ENVELOPE__BODY_HEALTH;
    pthread_mutex_lock(&s->health_mu);
    e.health = s->health ? s->health : &empty;
    srv_send(s, r, &e); /* packs the reply before returning: the lock covers the read */
    pthread_mutex_unlock(&s->health_mu);
    return true;
}

static void ctx_cb(void *arg)
{
    td_ctrl_req *r = arg;
    td_ctrl_server *s = r->s;
    int rv = nng_aio_result(r->aio);
    td_ctrl_item *it = NULL;
    bool refill = false;
    pthread_mutex_lock(&s->mu);
    if (r->state == SC_RECV) {
        s->n_recv--;
        if (rv == 0 && (it = calloc(1, sizeof *it))) {
            nng_msg *m = nng_aio_get_msg(r->aio);
            nng_aio_set_msg(r->aio, NULL);
            it->kind = IT_MSG;
            it->ptr = r;
            it->msg = m;
            it->pipe = nng_pipe_id(nng_msg_get_pipe(m));
            r->state = SC_HELD;
        } else {
            if (rv == 0) nng_msg_free(nng_aio_get_msg(r->aio));
            r->state = SC_IDLE;
            r->free_next = s->free;
            s->free = r;
        }
        refill = true;
    } else if (r->state == SC_SEND) {
        if (rv) nng_msg_free(nng_aio_get_msg(r->aio)); /* on failure the message is ours */
        nng_aio_set_msg(r->aio, NULL);
        r->state = SC_IDLE;
        r->free_next = s->free;
        s->free = r;
        refill = true;
    }
    bool closing = s->closing;
    pthread_mutex_unlock(&s->mu);
    if (it && !closing && answer_health(s, r, it->msg)) {
        free(it);
        it = NULL;
    }
    if (it) td_ctrl_inbox_push(&s->ib, it);
    if (refill && !closing) keep_receiving(s);
}

static void pipe_cb(nng_pipe p, nng_pipe_ev ev, void *arg)
{
    td_ctrl_server *s = arg;
    if (ev != NNG_PIPE_EV_REM_POST) return;
    td_ctrl_item *it = calloc(1, sizeof *it);
    if (!it) return;
    it->kind = IT_PIPE_REM;
    it->pipe = nng_pipe_id(p);
    td_ctrl_inbox_push(&s->ib, it);
}

/* Send a reply on a held context (owner thread). Consumes r. */
static int srv_send(td_ctrl_server *s, td_ctrl_req *r, const Td__Envelope *reply)
{
    Td__Envelope e = *reply;
    e.version = TD_CTRL_VERSION;
    e.call_id = r->call_id;
    e.client_id = 0;
    nng_msg *m = NULL;
    int rc = td_ctrl_pack_msg(&e, &s->o, &m);
    if (rc) { /* logged; the client still gets an answer */
        Td__ErrorEvent er = TD__ERROR_EVENT__INIT;
        er.code = TD__ERROR_CODE__ERR_INTERNAL;
        er.message = "reply could not be encoded (see the server log)";
        Td__Envelope ee = TD__ENVELOPE__INIT;
        ee.call_id = r->call_id;
        ee.body_case = TD__ENVELOPE__BODY_ERROR;
        ee.error = &er;
        if (td_ctrl_pack_msg(&ee, &s->o, &m)) m = NULL;
    }
    td_ctrl_envelope_free(r->env);
    r->env = NULL;
    if (!m) { /* out of memory: recycle the context, the client times out */
        pthread_mutex_lock(&s->mu);
        r->state = SC_IDLE;
        r->free_next = s->free;
        s->free = r;
        pthread_mutex_unlock(&s->mu);
        return TD_ENOMEM;
    }
    nng_aio_set_msg(r->aio, m);
    nng_aio_set_timeout(r->aio, s->o.send_timeout_ms);
    pthread_mutex_lock(&s->mu);
    r->state = SC_SEND;
    pthread_mutex_unlock(&s->mu);
    nng_ctx_send(r->ctx, r->aio);
    return rc;
}

static int srv_send_error(td_ctrl_server *s, td_ctrl_req *r, uint64_t request_id,
                          Td__ErrorCode code, const char *msg)
{
    Td__ErrorEvent er = TD__ERROR_EVENT__INIT;
    er.request_id = request_id;
    er.code = code;
    er.message = (char *)msg;
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.body_case = TD__ENVELOPE__BODY_ERROR;
    e.error = &er;
    return srv_send(s, r, &e);
}

/* ---- clients and their outboxes ------------------------------------------------------ */

static client *client_find(td_ctrl_server *s, uint64_t id)
{
    for (client *c = s->clients; c; c = c->next)
        if (c->id == id) return c;
    return NULL;
}

static void outbox_pop(client *c)
{
    td__event__free_unpacked(c->ob[c->ob_head], NULL);
    c->ob[c->ob_head] = NULL;
    c->ob_head = (c->ob_head + 1) % c->ob_cap;
    c->ob_n--;
}

static Td__Event *outbox_at(client *c, size_t i)
{
    return c->ob[(c->ob_head + i) % c->ob_cap];
}

static void client_free(client *c)
{
    while (c->ob_n)
        outbox_pop(c);
    free(c->ob);
    free(c);
}

/* Answer c's parked Poll with the oldest unacknowledged events (possibly none). */
static void reply_events(td_ctrl_server *s, client *c)
{
    td_ctrl_req *r = c->parked;
    if (!r) return;
    c->parked = NULL;
    size_t n = c->ob_n < TD_CTRL_MAX_BATCH ? c->ob_n : TD_CTRL_MAX_BATCH;
    Td__Event *none[1];
    Td__Event **list = n ? malloc(n * sizeof *list) : none;
    if (!list) {
        n = 0;
        list = none;
    }
    size_t bytes = 64, k = 0;
    for (; k < n; k++) {
        Td__Event *ev = outbox_at(c, k);
        size_t sz = td__event__get_packed_size(ev) + 8;
        if (k && bytes + sz > s->o.max_msg_bytes / 2) break;
        bytes += sz;
        list[k] = ev;
    }
    Td__Events body = TD__EVENTS__INIT;
    body.n_events = k;
    body.events = list;
    body.health = s->health;
    body.epoch = s->epoch;
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.body_case = TD__ENVELOPE__BODY_EVENTS;
    e.events = &body;
    srv_send(s, r, &e);
    if (list != none) free(list);
    s->st.polls++;
}

static void client_gone(td_ctrl_server *s, client *c)
{
    client **pp = &s->clients;
    while (*pp != c)
        pp = &(*pp)->next;
    *pp = c->next;
    s->n_clients--;
    reply_events(s, c); /* recycle a parked Poll (its peer is gone or late) */
    client_free(c);
}

/* Expire parked Polls; report one gone client. Returns the next time housekeeping has
 * work (ms), and sets *gone to the id of a client that went away (0 if none). drained:
 * the inbox is empty. A client is declared gone only then: after the owner was busy for
 * longer than peer_timeout_ms (a long prefill chunk), the Polls that kept arriving are
 * still in the inbox, and the client is not silent at all. */
static int64_t housekeeping(td_ctrl_server *s, int64_t now, bool drained, uint64_t *gone)
{
    int64_t next = now + s->o.poll_wait_ms;
    *gone = 0;
    for (client *c = s->clients; c; c = c->next) {
        int64_t dead_at = c->last_seen + s->o.peer_timeout_ms;
        if (c->gone_at && c->gone_at < dead_at) dead_at = c->gone_at;
        if (drained && now >= dead_at) {
            *gone = c->id;
            TD_LOG_INFO("ctrl: client %016llx gone (%s)", (unsigned long long)c->id,
                        c->gone_at && now >= c->gone_at ? "connection closed" : "silent");
            client_gone(s, c);
            return now;
        }
        if (dead_at < next) next = dead_at;
        if (c->parked) {
            if (now >= c->parked->poll_expire)
                reply_events(s, c);
            else if (c->parked->poll_expire < next)
                next = c->parked->poll_expire;
        }
    }
    return next;
}

/* ---- receiving ----------------------------------------------------------------------- */

static bool is_request(Td__Envelope__BodyCase b)
{
    return b == TD__ENVELOPE__BODY_SUBMIT || b == TD__ENVELOPE__BODY_CANCEL ||
           b == TD__ENVELOPE__BODY_ALLOC || b == TD__ENVELOPE__BODY_PREFILL ||
           b == TD__ENVELOPE__BODY_KV_TARGET || b == TD__ENVELOPE__BODY_STAGE_HELLO ||
           b == TD__ENVELOPE__BODY_JOIN;
}

/* Handle one received message. Returns true when in was filled for the owner. */
static bool handle_msg(td_ctrl_server *s, td_ctrl_req *r, nng_msg *m, uint32_t pipe,
                       td_ctrl_server_in *in)
{
    char err[256];
    Td__Envelope *env = NULL;
    int rc = td_ctrl_decode(nng_msg_body(m), nng_msg_len(m), &s->o, &env, err, sizeof err);
    size_t len = nng_msg_len(m);
    nng_msg_free(m);
    r->call_id = 0;
    if (rc) {
        TD_LOG_WARN("ctrl: rejected a %zu-byte message on pipe %u: %s", len, pipe, err);
        s->st.rejected++;
        srv_send_error(s, r, 0, td_ctrl_err_code(rc), err);
        return false;
    }
    r->env = env;
    r->call_id = env->call_id;
    int64_t now = td_now_ms();
    if (!env->client_id) {
        TD_LOG_WARN("ctrl: rejected a %s message on pipe %u: client_id 0",
                    td_ctrl_body_name(env->body_case), pipe);
        s->st.rejected++;
        srv_send_error(s, r, 0, TD__ERROR_CODE__ERR_INVALID, "client_id 0");
        return false;
    }
    client *c = client_find(s, env->client_id);
    if (!c) {
        if (s->n_clients >= MAX_CLIENTS || !(c = calloc(1, sizeof *c))) {
            TD_LOG_WARN("ctrl: refused client %016llx: %u clients connected",
                        (unsigned long long)env->client_id, s->n_clients);
            srv_send_error(s, r, 0, TD__ERROR_CODE__ERR_BUSY, "too many clients");
            return false;
        }
        c->id = env->client_id;
        c->next_seq = 1;
        c->next = s->clients;
        s->clients = c;
        s->n_clients++;
        TD_LOG_DEBUG("ctrl: client %016llx connected on pipe %u", (unsigned long long)c->id, pipe);
    }
    c->pipe = pipe;
    c->last_seen = now;
    c->gone_at = 0;

    switch (env->body_case) {
    case TD__ENVELOPE__BODY_POLL: {
        uint64_t ack = env->poll->epoch == s->epoch ? env->poll->ack_seq : 0;
        while (c->ob_n && outbox_at(c, 0)->seq <= ack)
            outbox_pop(c);
        if (c->parked) reply_events(s, c); /* stale: the client only has one Poll out */
        c->parked = r;
        r->poll_expire = now + env->poll->wait_ms;
        /* a client that knew another epoch (a previous process of this server) is answered
           at once: the new epoch tells it that what the old process held is lost, and it
           should not wait a whole poll_wait for that (request migration) */
        bool stale = env->poll->epoch && env->poll->epoch != s->epoch;
        if (c->ob_n || !env->poll->wait_ms || stale) reply_events(s, c);
        return false;
    }
    case TD__ENVELOPE__BODY_HEALTH_REQUEST: {
        Td__Health empty = TD__HEALTH__INIT;
        Td__Envelope e = TD__ENVELOPE__INIT;
        e.body_case = TD__ENVELOPE__BODY_HEALTH;
        e.health = s->health ? s->health : &empty;
        srv_send(s, r, &e);
        return false;
    }
    default:
        break;
    }
    if (!is_request(env->body_case)) {
        TD_LOG_WARN("ctrl: rejected a %s message from client %016llx: not a request",
                    td_ctrl_body_name(env->body_case), (unsigned long long)c->id);
        s->st.rejected++;
        srv_send_error(s, r, 0, TD__ERROR_CODE__ERR_INVALID, "not a request");
        return false;
    }
    in->kind = TD_CTRL_IN_REQUEST;
    in->client_id = c->id;
    in->env = env;
    in->req = r;
    in->deadline_ms = env->timeout_ms ? now + env->timeout_ms : INT64_MAX;
    s->st.requests++;
    s->st.pending++;
    return true;
}

/* Log the connections refused since the last look (owner thread, at most once a second). */
static void watch_tls(td_ctrl_server *s)
{
    for (int i = 0; i < s->n_watch; i++) {
        uint64_t n;
        s->st.refused += td_ctrl_tls_failures(&s->watch[i], &n);
        if (n)
            TD_LOG_WARN("ctrl: refused %llu connection%s on %s: TLS handshake failed (no "
                        "certificate signed by the cluster's CA, or not TLS at all; at most one "
                        "such line every %d s)",
                        (unsigned long long)n, n == 1 ? "" : "s", s->watch_url[i],
                        TD_CTRL_TLS_LOG_MS / 1000);
    }
}

int td_ctrl_server_recv(td_ctrl_server *s, td_ctrl_server_in *in, int timeout_ms)
{
    memset(in, 0, sizeof *in);
    int64_t end = timeout_ms < 0 ? INT64_MAX : td_now_ms() + timeout_ms;
    for (;;) {
        if (s->closing) return TD_ESTATE;
        if (s->n_watch) watch_tls(s);
        int64_t now = td_now_ms();
        uint64_t gone;
        int64_t wake = housekeeping(s, now, td_ctrl_inbox_len(&s->ib) == 0, &gone);
        if (gone) {
            in->kind = TD_CTRL_IN_PEER_GONE;
            in->client_id = gone;
            return 0;
        }
        if (now >= end && td_ctrl_inbox_len(&s->ib) == 0) return TD_ETIMEDOUT;
        td_ctrl_item *it = td_ctrl_inbox_pop(&s->ib, wake < end ? wake : end);
        if (!it) continue;
        bool got = false;
        if (it->kind == IT_MSG) {
            got = handle_msg(s, it->ptr, it->msg, it->pipe, in);
        } else if (it->kind == IT_PIPE_REM) {
            int64_t t = td_now_ms() + s->o.peer_grace_ms;
            for (client *c = s->clients; c; c = c->next)
                if (c->pipe == it->pipe && !c->gone_at) c->gone_at = t;
        }
        free(it);
        if (got) return 0;
    }
}

/* ---- owner API ----------------------------------------------------------------------- */

int td_ctrl_server_reply(td_ctrl_server *s, td_ctrl_req *req, const Td__Envelope *reply)
{
    if (!req) return TD_EINVAL;
    s->st.pending--;
    return srv_send(s, req, reply);
}

int td_ctrl_server_reply_ack(td_ctrl_server *s, td_ctrl_req *req, uint64_t request_id)
{
    Td__Ack ack = TD__ACK__INIT;
    ack.request_id = request_id;
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.body_case = TD__ENVELOPE__BODY_ACK;
    e.ack = &ack;
    return td_ctrl_server_reply(s, req, &e);
}

int td_ctrl_server_reply_error(td_ctrl_server *s, td_ctrl_req *req, uint64_t request_id,
                               Td__ErrorCode code, const char *fmt, ...)
{
    char msg[TD_CTRL_MAX_STRING];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (!req) return TD_EINVAL;
    s->st.pending--;
    return srv_send_error(s, req, request_id, code, msg);
}

/* Deep copy of a protobuf-c message through pack + unpack (validated sizes). */
static void *copy_msg(const ProtobufCMessage *m, const ProtobufCMessageDescriptor *d)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) return NULL;
    protobuf_c_message_pack(m, buf);
    void *copy = protobuf_c_message_unpack(d, NULL, n, buf);
    free(buf);
    return copy;
}

int td_ctrl_server_send_event(td_ctrl_server *s, uint64_t client_id, const Td__Event *ev)
{
    client *c = client_find(s, client_id);
    if (!c) {
        TD_LOG_DEBUG("ctrl: event for unknown client %016llx dropped",
                     (unsigned long long)client_id);
        return TD_ENOENT;
    }
    if (ev->body_case == TD__EVENT__BODY__NOT_SET) {
        TD_LOG_ERR("ctrl: event without a body");
        return TD_EINVAL;
    }
    size_t sz = td__event__get_packed_size(ev);
    if (sz + 256 > s->o.max_msg_bytes / 2) {
        TD_LOG_ERR("ctrl: event of %zu bytes is too large for max_msg_bytes %zu", sz,
                   s->o.max_msg_bytes);
        return TD_ERANGE;
    }
    if (c->ob_n >= s->o.max_outbox) {
        TD_LOG_WARN("ctrl: client %016llx has %zu unacknowledged events: treating it as gone",
                    (unsigned long long)c->id, c->ob_n);
        c->gone_at = td_now_ms();
        return TD_ENOSPC;
    }
    if (c->ob_n == c->ob_cap) {
        size_t cap = c->ob_cap ? 2 * c->ob_cap : 64;
        Td__Event **nb = malloc(cap * sizeof *nb);
        if (!nb) return TD_ENOMEM;
        for (size_t i = 0; i < c->ob_n; i++)
            nb[i] = outbox_at(c, i);
        free(c->ob);
        c->ob = nb;
        c->ob_cap = cap;
        c->ob_head = 0;
    }
    Td__Event *copy = copy_msg(&ev->base, &td__event__descriptor);
    if (!copy) return TD_ENOMEM;
    copy->seq = c->next_seq++;
    c->ob[(c->ob_head + c->ob_n) % c->ob_cap] = copy;
    c->ob_n++;
    s->st.events++;
    if (c->parked) reply_events(s, c);
    return 0;
}

int td_ctrl_server_send_tokens(td_ctrl_server *s, uint64_t client_id, uint64_t request_id,
                               uint32_t seq, const int32_t *tokens, size_t n_tokens,
                               Td__FinishReason finish, uint32_t prompt_tokens,
                               uint32_t completion_tokens, uint32_t cached_tokens)
{
    Td__Usage u = TD__USAGE__INIT;
    u.prompt_tokens = prompt_tokens;
    u.completion_tokens = completion_tokens;
    u.cached_tokens = cached_tokens;
    Td__TokenEvent t = TD__TOKEN_EVENT__INIT;
    t.request_id = request_id;
    t.seq = seq;
    t.n_token_ids = n_tokens;
    t.token_ids = (int32_t *)tokens;
    t.finish = finish;
    t.usage = &u;
    Td__Event ev = TD__EVENT__INIT;
    ev.body_case = TD__EVENT__BODY_TOKEN;
    ev.token = &t;
    return td_ctrl_server_send_event(s, client_id, &ev);
}

int td_ctrl_server_send_error(td_ctrl_server *s, uint64_t client_id, uint64_t request_id,
                              Td__ErrorCode code, const char *fmt, ...)
{
    char msg[TD_CTRL_MAX_STRING];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    Td__ErrorEvent er = TD__ERROR_EVENT__INIT;
    er.request_id = request_id;
    er.code = code;
    er.message = msg;
    Td__Event ev = TD__EVENT__INIT;
    ev.body_case = TD__EVENT__BODY_ERROR;
    ev.error = &er;
    return td_ctrl_server_send_event(s, client_id, &ev);
}

int td_ctrl_server_set_health(td_ctrl_server *s, const Td__Health *h)
{
    Td__Health *copy = copy_msg(&h->base, &td__health__descriptor);
    if (!copy) return TD_ENOMEM;
    copy->boot_id = s->epoch; /* the process's identity: the router drops its prefix index */
    pthread_mutex_lock(&s->health_mu);
    Td__Health *old = s->health;
    s->health = copy;
    pthread_mutex_unlock(&s->health_mu);
    if (old) td__health__free_unpacked(old, NULL);
    return 0;
}

int td_ctrl_server_fd(const td_ctrl_server *s)
{
    return s->ib.efd;
}

void td_ctrl_server_get_stats(const td_ctrl_server *s, td_ctrl_server_stats *st)
{
    *st = s->st;
    st->clients = s->n_clients;
    st->unacked = 0;
    for (const client *c = s->clients; c; c = c->next)
        st->unacked += (uint32_t)c->ob_n;
}

/* ---- lifetime ------------------------------------------------------------------------ */

int td_ctrl_server_create(const td_ctrl_opts *opts, td_ctrl_server **out)
{
    *out = NULL;
    td_ctrl_server *s = calloc(1, sizeof *s);
    if (!s) return TD_ENOMEM;
    td_ctrl_opts_fill(opts, &s->o);
    s->epoch = td_ctrl_random_id();
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->health_mu, NULL);
    int rc = td_ctrl_inbox_init(&s->ib);
    if (rc) {
        pthread_mutex_destroy(&s->mu);
        pthread_mutex_destroy(&s->health_mu);
        free(s);
        return rc;
    }
    s->ib_ok = true;
    if (td_ctrl_tls_on(&s->o) && (rc = td_ctrl_tls_config(&s->o, true, &s->tls))) {
        td_ctrl_server_destroy(s);
        return rc;
    }
    s->o.security = NULL; /* borrowed during create only */
    int rv = nng_rep0_open(&s->sock);
    if (rv) {
        TD_LOG_ERR("ctrl: nng_rep0_open: %s", nng_strerror(rv));
        td_ctrl_server_destroy(s);
        return td_ctrl_nng_err(rv);
    }
    s->sock_open = true;
    /* Messages a little over the limit still reach the decoder (and get ERR_TOO_LARGE);
     * much larger ones are cut off by NNG, which closes that connection. */
    nng_socket_set_size(s->sock, NNG_OPT_RECVMAXSZ, 2 * s->o.max_msg_bytes + 4096);
    nng_pipe_notify(s->sock, NNG_PIPE_EV_REM_POST, pipe_cb, s);
    keep_receiving(s);
    *out = s;
    return 0;
}

int td_ctrl_server_listen(td_ctrl_server *s, const char *url_in, char *bound, size_t boundcap)
{
    char url[512];
    int rc = td_ctrl_tls_url(s->tls != NULL, url_in, url, sizeof url);
    if (rc) return rc;
    bool tls = !strncmp(url, "tls+", 4);
    nng_listener l;
    int rv = nng_listener_create(&l, s->sock, url);
    if (!rv && tls) rv = nng_listener_set_ptr(l, NNG_OPT_TLS_CONFIG, s->tls);
    if (!rv) rv = nng_listener_start(l, 0);
    if (rv) {
        TD_LOG_ERR("ctrl: listen on %s: %s", url, nng_strerror(rv));
        return td_ctrl_nng_err(rv);
    }
    if (bound && boundcap) {
        size_t n = strlen(url);
        int port = 0;
        const char *tcp = url + (tls ? 4 : 0);
        if (!strncmp(tcp, "tcp://", 6) && n >= 2 && !strcmp(url + n - 2, ":0") &&
            nng_listener_get_int(l, NNG_OPT_TCP_BOUND_PORT, &port) == 0)
            snprintf(bound, boundcap, "%.*s:%d", (int)(n - 2), url, port);
        else
            snprintf(bound, boundcap, "%s", url);
    }
    if (tls && s->n_watch < MAX_TLS_LISTENERS) {
        td_ctrl_tls_watch *w = &s->watch[s->n_watch];
        *w = (td_ctrl_tls_watch){.is_listener = true, .l = l};
        uint64_t none;
        td_ctrl_tls_failures(w, &none); /* from here on */
        snprintf(s->watch_url[s->n_watch++], sizeof s->watch_url[0], "%s",
                 bound && boundcap ? bound : url);
    }
    TD_LOG_DEBUG("ctrl: listening on %s", url);
    return 0;
}

/* Everything after `closing`: close the socket, stop the aios, free. Runs on its own
 * thread (td_ctrl_teardown_bounded). */
static void server_teardown(void *arg)
{
    td_ctrl_server *s = arg;
    if (s->sock_open) nng_close(s->sock);
    for (td_ctrl_req *r = s->all; r; r = r->all_next)
        nng_aio_stop(r->aio);
    while (s->all) {
        td_ctrl_req *r = s->all;
        s->all = r->all_next;
        nng_msg *m = nng_aio_get_msg(r->aio);
        if (m) nng_msg_free(m);
        nng_aio_free(r->aio);
        td_ctrl_envelope_free(r->env);
        free(r);
    }
    while (s->clients) {
        client *c = s->clients;
        s->clients = c->next;
        client_free(c);
    }
    if (s->health) td__health__free_unpacked(s->health, NULL);
    if (s->tls) nng_tls_config_free(s->tls);
    if (s->ib_ok) td_ctrl_inbox_fini(&s->ib);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->health_mu);
    free(s);
}

void td_ctrl_server_destroy(td_ctrl_server *s)
{
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->closing = true;
    pthread_mutex_unlock(&s->mu);
    if (s->sock_open) /* nng_close may never return (ctrl_internal.h) */
        td_ctrl_teardown_bounded(server_teardown, s, "the control server");
    else
        server_teardown(s);
}
