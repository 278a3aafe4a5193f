/* test_rt_pair.c: the router's disaggregated path end to end, against scripted fakes.
 *
 * Usage: test_rt_pair ROUTER_BIN MODEL_GGUF
 * This process plays two prefill leaders (p0 pp 2, p1) and two decode leaders (d0, d1), each
 * a td_ctrl_server answering per the current scenario, writes a YAML pointing at them,
 * starts the real tandem-router and checks what HTTP clients see and what each fake got:
 *   normal        Alloc + Prefill (no targets), KvTarget with exactly the AllocReply's
 *                 targets, PrefillDone, tokens streamed by the decode fake; metrics, log
 *   late done     PrefillDone 1 s after the decode side's last tokens: the tokens stream at
 *                 once, only the finish (with the usage) waits for it
 *   retry         prefill ErrorEvent on p0 -> retried on p1; Prefill reply error likewise;
 *                 ERR_TIMEOUT with p1 down -> retried on p0 itself
 *   no retry      p1 not ready, p0 fails -> 503 prefill_failed (also with stream: true);
 *                 but a stage of p0 died (ERR_PEER_FAILED) -> moved, p0 takes it again
 *   transfer      decode ERR_PEER_FAILED before the first token -> moved, succeeds
 *   cancel        client closes mid-prefill -> both fakes get Cancel
 *   busy          both decode fakes ERR_BUSY -> 503 instance_busy + Retry-After, prefill
 *                 attempts cancelled
 *   deadline      prefill never finishes -> 503 first_token_timeout, both sides cancelled
 *   prefill dies  p0 stops answering mid-prefill -> moved to p1
 *   prefill back  p1, the only prefill instance left, stops answering mid-prefill and a new
 *                 server answers on its port after the router marked it dead -> the
 *                 request waits for it and succeeds; a new request meanwhile: 503
 *   moved        d0 streams the first token, then a rank dies (ERR_PEER_FAILED): the request
 *                 moves with its prompt + that token (Alloc n=4, max 3) and the stream ends
 *                 normally
 *   decode dies   d0 stops answering mid-prefill -> the request moves (a new attempt on
 *                 d1, rt_loop_lose) and succeeds; the first attempt's prefill side gets
 *                 Cancel
 *   timeouts      a request's own deadline ("timeout": 1) while prefilling -> 504
 *                 request_timeout before the attempt's deadline, both sides cancelled;
 *                 streamed, after its first token (X-Tandem-Timeout-Ms) -> the text, an SSE
 *                 error event and [DONE], the decode side cancelled; the timeouts metric
 *   drain         SIGTERM with a stream open after its first token: new requests 503,
 *                 /health 503; after drain_timeout_ms (DRAIN_MS: the requests made while
 *                 draining must fit in it; a loaded 2-core machine took more than 2 s for
 *                 them, CI's load 5) the stream ends with an SSE error event and [DONE], the
 *                 decode side is cancelled, exit 0 within DRAIN_MS + 2 s with no leak (the
 *                 Polls to the instances killed earlier included)
 * The fakes run on one thread (fake_main); the main thread drives HTTP and reads the fakes'
 * records under g_mu. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ctrl.h"
#include "td_clock.h"
#include "tharness.h"

/* ---- the fakes ---- */

typedef enum {
    M_OK = 0,             /* prefill: Ack, PrefillDone after KvTarget; decode: AllocReply, tokens */
    M_HANG,               /* Ack / AllocReply, then nothing */
    M_BUSY,               /* reply ERR_BUSY */
    M_REPLY_ERR,          /* prefill: reply ERR_PEER_FAILED to Prefill */
    M_EVENT_ERR,          /* prefill: Ack, then an ErrorEvent ERR_INTERNAL */
    M_EVENT_DIED_ONCE,    /* prefill: Ack, ErrorEvent ERR_PEER_FAILED ("stage 1 died") once,
                             then M_OK (the chain re-formed) */
    M_EVENT_TIMEOUT_ONCE, /* prefill: Ack, ErrorEvent ERR_TIMEOUT once, then M_OK */
    M_XFER_FAIL_ONCE,     /* decode: ERR_PEER_FAILED + finish ERROR once, then M_OK */
    M_FIRST_HANG,         /* decode: the first token, then nothing (until Cancel) */
    M_FIRST_FAIL_ONCE,    /* decode: the first token, then ERR_PEER_FAILED ("a rank died")
                             + finish ERROR once, then M_OK */
    M_DONE_LATE,          /* prefill: as M_OK, but PrefillDone LATE_DONE_MS after the decode
                             fake streamed every token (a busy leader sends it between chunks) */
} fake_mode;

#define LATE_DONE_MS 1000
/* the router's drain_timeout_ms: test_drain's requests made while draining must fit in it */
#define DRAIN_MS     5000
#define DRAIN_MS_STR "5000"

typedef struct {
    uint64_t rid, client;
    uint32_t max_tokens;
} pend_req;

typedef struct {
    char name[8];
    bool prefill;
    int port;
    td_ctrl_server *s;
    fake_mode mode;
    bool ready;
    uint64_t queued;  /* prefill: queued_prompt_tokens reported */
    uint32_t kv_free; /* decode */
    bool health_dirty;
    bool kill;       /* the fake thread destroys the server (the instance "dies") */
    char log[65536]; /* one line per message received: "alloc RID ...", "cancel RID", ... */
    size_t log_len;
    pend_req pend[64]; /* decode: requests waiting for their KV; prefill: requests accepted in
                          M_OK mode (only those finish: a late KvTarget of a request failed
                          on purpose must not finish after the scenario changed the mode) */
    int n_pend;
    struct {
        uint64_t rid, client;
        int64_t due_ms;
    } late[8]; /* prefill, M_DONE_LATE: PrefillDone notices to send at due_ms */
    int n_late;
} fake;

enum { P0, P1, D0, D1, N_FAKES };
static fake g_f[N_FAKES];
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static volatile bool g_stop;

static void logf_(fake *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void logf_(fake *f, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(f->log + f->log_len, sizeof f->log - f->log_len, fmt, ap);
    va_end(ap);
    if (n > 0 && f->log_len + (size_t)n + 1 < sizeof f->log) {
        f->log_len += (size_t)n;
        f->log[f->log_len++] = '\n';
        f->log[f->log_len] = 0;
    }
}

static void set_health(fake *f)
{
    Td__Health h = TD__HEALTH__INIT;
    h.instance = f->name;
    h.role = f->prefill ? TD__ROLE__ROLE_PREFILL : TD__ROLE__ROLE_DECODE;
    h.ready = f->ready;
    h.queued_prompt_tokens = f->queued;
    h.kv_blocks_free = f->kv_free;
    h.kv_block_size = 16;
    td_ctrl_server_set_health(f->s, &h);
}

static fake *decode_named(const char *name)
{
    for (int i = D0; i <= D1; i++)
        if (!strcmp(g_f[i].name, name)) return &g_f[i];
    return NULL;
}

/* The KV of rid reached decode fake d: stream its tokens (or fail the transfer). */
static void kv_arrived(fake *d, uint64_t rid, int32_t first)
{
    for (int k = 0; k < d->n_pend; k++) {
        if (d->pend[k].rid != rid) continue;
        uint64_t client = d->pend[k].client;
        uint32_t max = d->pend[k].max_tokens;
        d->pend[k] = d->pend[--d->n_pend];
        if (d->mode == M_HANG || d->mode == M_FIRST_HANG) {
            d->pend[d->n_pend++] = (pend_req){rid, client, max};
            if (d->mode == M_FIRST_HANG)
                td_ctrl_server_send_tokens(d->s, client, rid, 0, &first, 1,
                                           TD__FINISH_REASON__FINISH_NONE, 3, 1, 0);
            return;
        }
        if (d->mode == M_FIRST_FAIL_ONCE) {
            d->mode = M_OK;
            td_ctrl_server_send_tokens(d->s, client, rid, 0, &first, 1,
                                       TD__FINISH_REASON__FINISH_NONE, 3, 1, 0);
            td_ctrl_server_send_error(d->s, client, rid, TD__ERROR_CODE__ERR_PEER_FAILED,
                                      "rank 1 died (fake)");
            td_ctrl_server_send_tokens(d->s, client, rid, 1, NULL, 0,
                                       TD__FINISH_REASON__FINISH_ERROR, 3, 1, 0);
            return;
        }
        if (d->mode == M_XFER_FAIL_ONCE) {
            d->mode = M_OK;
            td_ctrl_server_send_error(d->s, client, rid, TD__ERROR_CODE__ERR_PEER_FAILED,
                                      "kv transfer failed (fake)");
            td_ctrl_server_send_tokens(d->s, client, rid, 0, NULL, 0,
                                       TD__FINISH_REASON__FINISH_ERROR, 3, 0, 0);
            return;
        }
        int32_t toks[64];
        for (uint32_t i = 0; i < max && i < 64; i++)
            toks[i] = first + (int32_t)i;
        td_ctrl_server_send_tokens(d->s, client, rid, 0, toks, 1, TD__FINISH_REASON__FINISH_NONE, 3,
                                   1, 0);
        td_ctrl_server_send_tokens(d->s, client, rid, 1, toks + 1, max - 1,
                                   TD__FINISH_REASON__FINISH_LENGTH, 3, max, 0);
        return;
    }
}

/* The prefill fake's PrefillDone of rid (3 prompt tokens, two chunks). */
static void send_done(fake *f, uint64_t client, uint64_t rid)
{
    uint32_t chunks[2] = {64, 36};
    Td__PrefillDone d = TD__PREFILL_DONE__INIT;
    d.request_id = rid;
    d.first_token = 100;
    d.n_prompt_tokens = 3;
    d.chunk_sizes = chunks;
    d.n_chunk_sizes = 2;
    d.queued_ms = 3;
    d.prefill_ms = 17;
    Td__Event ev = TD__EVENT__INIT;
    ev.body_case = TD__EVENT__BODY_PREFILL_DONE;
    ev.prefill_done = &d;
    td_ctrl_server_send_event(f->s, client, &ev);
}

static void on_prefill_req(fake *f, td_ctrl_server_in *in)
{
    const Td__Envelope *env = in->env;
    if (env->body_case == TD__ENVELOPE__BODY_PREFILL) {
        const Td__Prefill *p = env->prefill;
        logf_(f, "prefill %llu n=%zu ranks=%u dec=%s targets=%zu",
              (unsigned long long)p->request_id, p->n_token_ids, p->n_decode_ranks,
              p->decode_instance, p->n_kv_targets);
        uint64_t rid = p->request_id;
        switch (f->mode) {
        case M_BUSY:
            td_ctrl_server_reply_error(f->s, in->req, rid, TD__ERROR_CODE__ERR_BUSY, "queue full");
            return;
        case M_REPLY_ERR:
            td_ctrl_server_reply_error(f->s, in->req, rid, TD__ERROR_CODE__ERR_PEER_FAILED,
                                       "stage 1 is down (fake)");
            return;
        case M_EVENT_ERR:
            td_ctrl_server_reply_ack(f->s, in->req, rid);
            td_ctrl_server_send_error(f->s, in->client_id, rid, TD__ERROR_CODE__ERR_INTERNAL,
                                      "stage 1 failed (fake)");
            return;
        case M_EVENT_DIED_ONCE:
            f->mode = M_OK;
            td_ctrl_server_reply_ack(f->s, in->req, rid);
            td_ctrl_server_send_error(f->s, in->client_id, rid, TD__ERROR_CODE__ERR_PEER_FAILED,
                                      "stage 1 died (fake)");
            return;
        case M_EVENT_TIMEOUT_ONCE:
            f->mode = M_OK;
            td_ctrl_server_reply_ack(f->s, in->req, rid);
            td_ctrl_server_send_error(f->s, in->client_id, rid, TD__ERROR_CODE__ERR_TIMEOUT,
                                      "no KV target in time (fake)");
            return;
        default:
            if ((f->mode == M_OK || f->mode == M_DONE_LATE) && f->n_pend < 64)
                f->pend[f->n_pend++] = (pend_req){.rid = rid};
            td_ctrl_server_reply_ack(f->s, in->req, rid);
            return;
        }
    }
    if (env->body_case == TD__ENVELOPE__BODY_KV_TARGET) {
        const Td__KvTarget *t = env->kv_target;
        char tg[256] = "";
        size_t o = 0;
        for (size_t k = 0; k < t->n_kv_targets && o < sizeof tg - 1; k++)
            o += (size_t)snprintf(tg + o, sizeof tg - o, "%s%.*s", k ? "," : "",
                                  (int)t->kv_targets[k].len, (const char *)t->kv_targets[k].data);
        logf_(f, "kvt %llu %s", (unsigned long long)t->request_id, tg);
        uint64_t rid = t->request_id;
        /* the target names its decode fake: "tgt-d0-RID" */
        char dn[8] = "";
        if (t->n_kv_targets && t->kv_targets[0].len > 6)
            snprintf(dn, sizeof dn, "%.2s", (const char *)t->kv_targets[0].data + 4);
        td_ctrl_server_reply_ack(f->s, in->req, rid); /* frees env */
        int k = 0;
        while (k < f->n_pend && f->pend[k].rid != rid)
            k++;
        if (k == f->n_pend) return; /* not accepted in M_OK mode: never finishes */
        f->pend[k] = f->pend[--f->n_pend];
        fake *dec = decode_named(dn);
        if (f->mode == M_DONE_LATE && f->n_late < 8) {
            if (dec && dec->s) kv_arrived(dec, rid, 100);
            f->late[f->n_late++].rid = rid;
            f->late[f->n_late - 1].client = in->client_id;
            f->late[f->n_late - 1].due_ms = td_now_ms() + LATE_DONE_MS;
            return;
        }
        send_done(f, in->client_id, rid);
        if (dec && dec->s) kv_arrived(dec, rid, 100);
        return;
    }
    if (env->body_case == TD__ENVELOPE__BODY_CANCEL) {
        uint64_t rid = env->cancel->request_id;
        logf_(f, "cancel %llu", (unsigned long long)rid);
        for (int k = 0; k < f->n_pend; k++)
            if (f->pend[k].rid == rid) f->pend[k--] = f->pend[--f->n_pend];
        td_ctrl_server_reply_ack(f->s, in->req, rid);
        return;
    }
    td_ctrl_server_reply_error(f->s, in->req, 0, TD__ERROR_CODE__ERR_UNSUPPORTED, "fake prefill");
}

static void on_decode_req(fake *f, td_ctrl_server_in *in)
{
    const Td__Envelope *env = in->env;
    if (env->body_case == TD__ENVELOPE__BODY_ALLOC) {
        const Td__Submit *sub = env->alloc->request;
        uint64_t rid = sub->request_id;
        logf_(f, "alloc %llu stages=%u n=%zu max=%u", (unsigned long long)rid, env->alloc->n_stages,
              sub->n_token_ids, sub->max_tokens);
        if (f->mode == M_BUSY) {
            td_ctrl_server_reply_error(f->s, in->req, rid, TD__ERROR_CODE__ERR_BUSY, "no room");
            return;
        }
        char tgt[64];
        int len = snprintf(tgt, sizeof tgt, "tgt-%s-%llu", f->name, (unsigned long long)rid);
        ProtobufCBinaryData b = {.len = (size_t)len, .data = (uint8_t *)tgt};
        Td__AllocReply ar = TD__ALLOC_REPLY__INIT;
        ar.request_id = rid;
        ar.kv_targets = &b;
        ar.n_kv_targets = 1;
        Td__Envelope rep = TD__ENVELOPE__INIT;
        rep.body_case = TD__ENVELOPE__BODY_ALLOC_REPLY;
        rep.alloc_reply = &ar;
        if (f->n_pend < 64) f->pend[f->n_pend++] = (pend_req){rid, in->client_id, sub->max_tokens};
        td_ctrl_server_reply(f->s, in->req, &rep);
        return;
    }
    if (env->body_case == TD__ENVELOPE__BODY_CANCEL) {
        uint64_t rid = env->cancel->request_id;
        logf_(f, "cancel %llu", (unsigned long long)rid);
        for (int k = 0; k < f->n_pend; k++)
            if (f->pend[k].rid == rid) {
                td_ctrl_server_send_tokens(f->s, f->pend[k].client, rid, 0, NULL, 0,
                                           TD__FINISH_REASON__FINISH_CANCELLED, 3, 0, 0);
                f->pend[k] = f->pend[--f->n_pend];
                break;
            }
        td_ctrl_server_reply_ack(f->s, in->req, rid);
        return;
    }
    td_ctrl_server_reply_error(f->s, in->req, 0, TD__ERROR_CODE__ERR_UNSUPPORTED, "fake decode");
}

static void *fake_main(void *arg)
{
    (void)arg;
    while (!g_stop) {
        struct pollfd fds[N_FAKES];
        int nf = 0;
        pthread_mutex_lock(&g_mu);
        for (int i = 0; i < N_FAKES; i++)
            if (g_f[i].s)
                fds[nf++] = (struct pollfd){.fd = td_ctrl_server_fd(g_f[i].s), .events = POLLIN};
        pthread_mutex_unlock(&g_mu);
        poll(fds, (nfds_t)nf, 10);
        pthread_mutex_lock(&g_mu);
        for (int i = 0; i < N_FAKES; i++) {
            fake *f = &g_f[i];
            if (!f->s) continue;
            if (f->kill) {
                td_ctrl_server_destroy(f->s);
                f->s = NULL;
                continue;
            }
            if (f->health_dirty) {
                set_health(f);
                f->health_dirty = false;
            }
            for (int k = 0; k < f->n_late; k++)
                if (td_now_ms() >= f->late[k].due_ms) {
                    send_done(f, f->late[k].client, f->late[k].rid);
                    f->late[k--] = f->late[--f->n_late];
                }
            td_ctrl_server_in in;
            while (td_ctrl_server_recv(f->s, &in, 0) == 0) {
                if (in.kind != TD_CTRL_IN_REQUEST) continue;
                if (f->prefill)
                    on_prefill_req(f, &in);
                else
                    on_decode_req(f, &in);
            }
        }
        pthread_mutex_unlock(&g_mu);
    }
    return NULL;
}

static int fake_start(fake *f, const char *name, bool prefill)
{
    snprintf(f->name, sizeof f->name, "%s", name);
    f->prefill = prefill;
    f->ready = true;
    char bound[128];
    if (td_ctrl_server_create(&(td_ctrl_opts){0}, &f->s) ||
        td_ctrl_server_listen(f->s, "tcp://127.0.0.1:0", bound, sizeof bound))
        return -1;
    f->port = atoi(strrchr(bound, ':') + 1);
    set_health(f);
    return 0;
}

/* Under g_mu: set modes/health; the fake thread applies health. */
static void set_fake(int i, fake_mode mode, bool ready)
{
    pthread_mutex_lock(&g_mu);
    g_f[i].mode = mode;
    if (g_f[i].ready != ready) g_f[i].health_dirty = true;
    g_f[i].ready = ready;
    pthread_mutex_unlock(&g_mu);
}

/* Start a scenario: let the late messages of the previous one (a KvTarget or Cancel still
 * on its way) arrive first, then forget everything. */
static void clear_logs(void)
{
    usleep(250000);
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < N_FAKES; i++) {
        g_f[i].log_len = 0;
        g_f[i].log[0] = 0;
    }
    pthread_mutex_unlock(&g_mu);
}

/* Count lines of fake i starting with prefix. */
static int count(int i, const char *prefix)
{
    int n = 0;
    pthread_mutex_lock(&g_mu);
    size_t pl = strlen(prefix);
    for (const char *l = g_f[i].log; *l;) {
        if (!strncmp(l, prefix, pl)) n++;
        const char *nl = strchr(l, '\n');
        if (!nl) break;
        l = nl + 1;
    }
    pthread_mutex_unlock(&g_mu);
    return n;
}

/* The request id of the k-th line of fake i starting with prefix (0 if none). */
static uint64_t rid_of(int i, const char *prefix, int k)
{
    uint64_t rid = 0;
    pthread_mutex_lock(&g_mu);
    size_t pl = strlen(prefix);
    for (const char *l = g_f[i].log; *l;) {
        if (!strncmp(l, prefix, pl) && k-- == 0) {
            rid = strtoull(l + pl, NULL, 10);
            break;
        }
        const char *nl = strchr(l, '\n');
        if (!nl) break;
        l = nl + 1;
    }
    pthread_mutex_unlock(&g_mu);
    return rid;
}

static bool has(int i, const char *line)
{
    pthread_mutex_lock(&g_mu);
    bool yes = strstr(g_f[i].log, line) != NULL;
    pthread_mutex_unlock(&g_mu);
    return yes;
}

static bool wait_count(int i, const char *prefix, int n, int ms)
{
    for (int t = 0; t < ms; t += 10) {
        if (count(i, prefix) >= n) return true;
        usleep(10000);
    }
    return count(i, prefix) >= n;
}

static void dump_logs(void)
{
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < N_FAKES; i++)
        fprintf(stderr, "--- %s\n%s", g_f[i].name, g_f[i].log);
    pthread_mutex_unlock(&g_mu);
}

/* ---- HTTP ---- */

static int g_http_port;

static int http_connect(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)g_http_port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {.tv_sec = 30};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* hdrs: extra header lines, each ending in \r\n ("" none). */
static void http_send_h(int fd, const char *method, const char *path, const char *body,
                        const char *hdrs)
{
    char req[4096];
    int n = snprintf(req, sizeof req,
                     "%s %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n%s\r\n%s",
                     method, path, body ? strlen(body) : 0, hdrs, body ? body : "");
    ssize_t w = write(fd, req, (size_t)n);
    (void)w;
}

static void http_send(int fd, const char *method, const char *path, const char *body)
{
    http_send_h(fd, method, path, body, "");
}

/* Read until the server closes (or cap), appending to resp[*len]. */
static void http_read_all(int fd, char *resp, size_t cap, size_t *len)
{
    ssize_t k;
    while (*len < cap - 1 && (k = read(fd, resp + *len, cap - 1 - *len)) > 0)
        *len += (size_t)k;
    resp[*len] = 0;
}

/* One request; returns the status, the whole response (headers + body) in resp. */
static int http_h(const char *method, const char *path, const char *body, const char *hdrs,
                  char *resp, size_t cap)
{
    resp[0] = 0;
    int fd = http_connect();
    if (fd < 0) return -1;
    http_send_h(fd, method, path, body, hdrs);
    size_t len = 0;
    http_read_all(fd, resp, cap, &len);
    close(fd);
    int status = -1;
    if (sscanf(resp, "HTTP/1.%*d %d", &status) != 1) return -1;
    return status;
}

static int http(const char *method, const char *path, const char *body, char *resp, size_t cap)
{
    return http_h(method, path, body, "", resp, cap);
}

static const char *REQ = "{\"prompt\": [1, 2, 3], \"max_tokens\": 4}";
static const char *REQ_STREAM = "{\"prompt\": [1, 2, 3], \"max_tokens\": 4, \"stream\": true}";

/* ---- the router process ---- */

static pid_t g_router;
static char g_dir[256], g_logpath[300];

/* SIGTERM and wait: the exit status (0 after a clean stop; a sanitizer report makes it
 * nonzero), -1 if it was not running. */
static int stop_router(void)
{
    int st = -1;
    if (g_router > 0) {
        kill(g_router, SIGTERM);
        waitpid(g_router, &st, 0);
        g_router = 0;
        st = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    return st;
}

static void stop_router_atexit(void)
{
    stop_router();
}

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof a;
    bind(fd, (struct sockaddr *)&a, sizeof a);
    getsockname(fd, (struct sockaddr *)&a, &al);
    close(fd);
    return ntohs(a.sin_port);
}

static int start_router(const char *bin, const char *model)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/tandem-rt-pair-XXXXXX");
    if (!mkdtemp(g_dir)) return -1;
    char cfg[300];
    snprintf(cfg, sizeof cfg, "%s/cluster.yaml", g_dir);
    snprintf(g_logpath, sizeof g_logpath, "%s/router.log", g_dir);
    g_http_port = free_port();
    FILE *f = fopen(cfg, "w");
    if (!f) return -1;
    fprintf(f,
            "model: %s\n"
            "router:\n  listen: 127.0.0.1:%d\n  heartbeat_ms: 100\n  instance_timeout_ms: 1500\n"
            "  max_queue: 16\n  drain_timeout_ms: " DRAIN_MS_STR "\n"
            "prefill:\n  - name: p0\n    pp: 2\n    port: %d\n  - name: p1\n    port: %d\n"
            "decode:\n  - name: d0\n    port: %d\n  - name: d1\n    port: %d\n"
            "kvxfer:\n  timeout_ms: 1000\n",
            model, g_http_port, g_f[P0].port, g_f[P1].port, g_f[D0].port, g_f[D1].port);
    fclose(f);
    g_router = fork();
    if (g_router == 0) {
        FILE *lf = freopen(g_logpath, "w", stderr);
        (void)lf;
        dup2(2, 1);
        execl(bin, bin, "--config", cfg, (char *)NULL);
        _exit(127);
    }
    atexit(stop_router_atexit);
    char resp[4096];
    for (int t = 0; t < 200; t++) {
        if (http("GET", "/health", NULL, resp, sizeof resp) == 200) return 0;
        usleep(50000);
    }
    return -1;
}

static bool router_log_has(const char *s)
{
    FILE *f = fopen(g_logpath, "r");
    if (!f) return false;
    static char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    return strstr(buf, s) != NULL;
}

/* /health's prefill_instances_alive == n (waits up to 3 s). */
static bool wait_pf_alive(int n)
{
    char resp[4096], want[64];
    snprintf(want, sizeof want, "\"prefill_instances_alive\":%d", n);
    for (int t = 0; t < 300; t++) {
        http("GET", "/health", NULL, resp, sizeof resp);
        if (strstr(resp, want)) return true;
        usleep(10000);
    }
    return false;
}

static int64_t now_ms(void)
{
    return td_now_ms();
}

/* ---- scenarios ---- */

static char g_resp[1 << 16];

static void test_normal(void)
{
    clear_logs();
    int st = http("POST", "/v1/completions", REQ, g_resp, sizeof g_resp);
    TH_CHECKF(st == 200, "status %d: %s", st, g_resp);
    TH_CHECK(strstr(g_resp, "\"completion_tokens\":4") != NULL);
    TH_CHECK(strstr(g_resp, "\"finish_reason\":\"length\"") != NULL);
    uint64_t rid = rid_of(P0, "prefill ", 0);
    TH_REQUIRE(rid != 0);
    char line[160];
    snprintf(line, sizeof line, "prefill %llu n=3 ranks=1 dec=d0 targets=0\nkvt %llu tgt-d0-%llu\n",
             (unsigned long long)rid, (unsigned long long)rid, (unsigned long long)rid);
    TH_CHECKF(has(P0, line), "p0 got Prefill then KvTarget of rid %llu", (unsigned long long)rid);
    snprintf(line, sizeof line, "alloc %llu stages=2 n=3 max=4", (unsigned long long)rid);
    TH_CHECK(has(D0, line));
    TH_CHECK(count(P1, "prefill ") == 0 && count(D1, "alloc ") == 0);
    TH_CHECK(count(P0, "cancel ") == 0 && count(D0, "cancel ") == 0);

    /* streaming */
    clear_logs();
    st = http("POST", "/v1/completions", REQ_STREAM, g_resp, sizeof g_resp);
    TH_CHECKF(st == 200 && strstr(g_resp, "data: [DONE]"), "status %d: %s", st, g_resp);
    TH_CHECK(strstr(g_resp, "\"finish_reason\":\"length\"") != NULL);
    TH_CHECK(!strstr(g_resp, "\"error\""));

    /* the INFO line per PrefillDone, and the metrics */
    TH_CHECK(router_log_has("prefill done on p0: 3 prompt tokens, chunks [64 36], queued 3 ms"));
    http("GET", "/metrics", NULL, g_resp, sizeof g_resp);
    TH_CHECK(strstr(g_resp, "tandem_router_prefill_requests_total 2\n") != NULL);
    TH_CHECK(strstr(g_resp, "tandem_router_prefill_chunk_size_tokens_bucket{le=\"32\"} 0\n"));
    TH_CHECK(strstr(g_resp, "tandem_router_prefill_chunk_size_tokens_bucket{le=\"64\"} 4\n"));
    TH_CHECK(strstr(g_resp, "tandem_router_prefill_chunk_size_tokens_count 4\n"));
    TH_CHECK(strstr(g_resp, "tandem_router_prefill_seconds_count 2\n"));
    TH_CHECK(strstr(g_resp, "tandem_router_prefill_queue_seconds_count 2\n"));
    TH_CHECK(strstr(g_resp, "tandem_prefill_instance_up{instance=\"p0\"} 1\n"));
    TH_CHECK(
        strstr(g_resp, "tandem_prefill_instance_queued_prompt_tokens{instance=\"p1\"} 100000\n"));
    TH_CHECK(strstr(g_resp, "tandem_instance_up{instance=\"d0\"} 1\n"));
    http("GET", "/health", NULL, g_resp, sizeof g_resp);
    TH_CHECKF(
        strstr(g_resp, "{\"status\":\"ok\",\"instances_alive\":2,\"prefill_instances_alive\":2}"),
        "%s", g_resp);
}

/* The text of an SSE body's chunks, concatenated (the "text" fields in order). */
static void sse_text(const char *body, char *out, size_t cap)
{
    size_t o = 0;
    for (const char *p = strstr(body, "\"text\":\""); p && o + 1 < cap;
         p = strstr(p, "\"text\":\"")) {
        p += strlen("\"text\":\"");
        while (*p && *p != '"' && o + 1 < cap) {
            if (*p == '\\' && p[1]) out[o++] = *p++;
            out[o++] = *p++;
        }
    }
    out[o] = 0;
}

static void test_late_done(void)
{
    clear_logs();
    set_fake(P0, M_DONE_LATE, true);
    int fd = http_connect();
    TH_REQUIRE(fd >= 0);
    const int64_t t0 = now_ms();
    http_send(fd, "POST", "/v1/completions", REQ_STREAM);
    /* what arrives in the first half of the notice's delay: every token's text */
    static char early[1 << 14];
    size_t len = 0;
    while (now_ms() - t0 < LATE_DONE_MS / 2 && len < sizeof early - 1) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, 20) <= 0) continue;
        ssize_t k = read(fd, early + len, sizeof early - 1 - len);
        if (k <= 0) break;
        len += (size_t)k;
    }
    early[len] = 0;
    memcpy(g_resp, early, len + 1);
    http_read_all(fd, g_resp, sizeof g_resp, &len); /* on from len */
    close(fd);
    const int64_t took = now_ms() - t0;
    set_fake(P0, M_OK, true);
    static char a[4096], b[4096];
    sse_text(early, a, sizeof a);
    sse_text(g_resp, b, sizeof b);
    TH_CHECKF(!strstr(early, "finish_reason\":\"length") && a[0] && !strcmp(a, b),
              "early text '%s', all '%s'", a, b);
    TH_CHECKF(strstr(g_resp, "\"finish_reason\":\"length\"") && strstr(g_resp, "data: [DONE]"),
              "%s", g_resp);
    TH_CHECKF(took >= LATE_DONE_MS - 50, "the stream ended %lld ms after the request",
              (long long)took);
}

static void test_retry(void)
{
    /* an ErrorEvent from p0 after its Ack: retried on p1 */
    clear_logs();
    set_fake(P0, M_EVENT_ERR, true);
    int st = http("POST", "/v1/completions", REQ, g_resp, sizeof g_resp);
    TH_CHECKF(st == 200 && strstr(g_resp, "\"completion_tokens\":4"), "status %d: %s", st, g_resp);
    /* p0's KvTarget may or may not have gone out before its error reached the router */
    TH_CHECK(count(P0, "prefill ") == 1 && count(P0, "cancel ") == 0);
    TH_CHECK(count(P1, "prefill ") == 1 && count(P1, "kvt ") == 1);
    uint64_t r1 = rid_of(D0, "alloc ", 0), r2 = rid_of(D0, "alloc ", 1);
    TH_CHECK(r1 && r2 && r1 != r2);            /* fresh ids per attempt */
    TH_CHECK(rid_of(P0, "prefill ", 0) == r1); /* the same id on both sides */
    TH_CHECK(rid_of(P1, "prefill ", 0) == r2);
    char line[64];
    snprintf(line, sizeof line, "cancel %llu", (unsigned long long)r1);
    TH_CHECK(wait_count(D0, "cancel ", 1, 2000) && has(D0, line)); /* first reservation freed */

    /* Prefill answered with an error: the same */
    clear_logs();
    set_fake(P0, M_REPLY_ERR, true);
    st = http("POST", "/v1/completions", REQ, g_resp, sizeof g_resp);
    TH_CHECKF(st == 200, "status %d: %s", st, g_resp);
    TH_CHECK(count(P1, "kvt ") == 1);

    /* ERR_TIMEOUT and p1 down: the same instance may retry */
    set_fake(P1, M_OK, false);
    TH_CHECK(wait_pf_alive(1));
    clear_logs();
    set_fake(P0, M_EVENT_TIMEOUT_ONCE, true);
    st = http("POST", "/v1/completions", REQ, g_resp, sizeof g_resp);
    TH_CHECKF(st == 200, "status %d: %s", st, g_resp);
    uint64_t r2nd = rid_of(P0, "prefill ", 1);
    char kvt[64];
    snprintf(kvt, sizeof kvt, "kvt %llu tgt-d0-%llu", (unsigned long long)r2nd,
             (unsigned long long)r2nd);
    TH_CHECK(count(P0, "prefill ") == 2 && has(P0, kvt) && count(P1, "prefill ") == 0);
    set_fake(P1, M_OK, true);
    TH_CHECK(wait_pf_alive(2));
    set_fake(P0, M_OK, true);
    http("GET", "/metrics", NULL, g_resp, sizeof g_resp);
    TH_CHECK(strstr(g_resp, "tandem_router_prefill_retries_total 3\n"));
    TH_CHECK(strstr(g_resp, "tandem_router_prefill_failures_total{reason=\"prefill_error\"} 3\n"));
}

static void test_no_retry(void)
{
    set_fake(P1, M_OK, false);
    TH_CHECK(wait_pf_alive(1));
    for (int stream = 0; stream < 2; stream++) {
        clear_logs();
        set_fake(P0, M_EVENT_ERR, true);
        int st = http("POST", "/v1/completions", stream ? REQ_STREAM : REQ, g_resp, sizeof g_resp);
        TH_CHECKF(st == 503, "status %d: %s", st, g_resp);
        TH_CHECK(strstr(g_resp, "Retry-After: 1") != NULL);
        TH_CHECKF(strstr(g_resp, "\"code\":\"prefill_failed\"") &&
                      strstr(g_resp, "no other prefill instance is available") &&
                      strstr(g_resp, "stage 1 failed (fake)"),
                  "%s", g_resp);
        /* the Alloc goes out with the Prefill, but the 503 can come before d0 read it */
        TH_CHECK(count(P0, "prefill ") == 1 && wait_count(D0, "alloc ", 1, 2000) &&
                 count(D0, "alloc ") == 1);
        TH_CHECK(wait_count(D0, "cancel ", 1, 2000)); /* the reservation is freed */
    }
    /* a stage of p0, the only prefill instance, died (ERR_PEER_FAILED): not the request's
       fault, it moves and p0 takes it again once re-formed (issue 44: it was 503) */
    clear_logs();
    set_fake(P0, M_EVENT_DIED_ONCE, true);
    int st = http("POST", "/v1/completions", REQ, g_resp, sizeof g_resp);
    TH_CHECKF(st == 200 && strstr(g_resp, "\"completion_tokens\":4"), "status %d: %s", st,
              g_resp);
    /* (the first attempt's KvTarget may have gone out before its error came back) */
    TH_CHECK(count(P0, "prefill ") == 2 && count(P0, "kvt ") >= 1);
    /* both instances fail: one retry, then the error names both failures */
    set_fake(P0, M_EVENT_ERR, true);
    set_fake(P1, M_EVENT_ERR, true);
    TH_CHECK(wait_pf_alive(2));
    clear_logs();
    st = http("POST", "/v1/completions", REQ, g_resp, sizeof g_resp);
    TH_CHECKF(st == 503 && strstr(g_resp, "failed twice"), "status %d: %s", st, g_resp);
    TH_CHECK(count(P0, "prefill ") + count(P1, "prefill ") == 2);
    set_fake(P0, M_OK, true);
    set_fake(P1, M_OK, true);
}

static void test_transfer(void)
{
    clear_logs();
    set_fake(D0, M_XFER_FAIL_ONCE, true);
    int st = http("POST", "/v1/completions", REQ, g_resp, sizeof g_resp);
    TH_CHECKF(st == 200 && strstr(g_resp, "\"completion_tokens\":4"), "status %d: %s", st, g_resp);
    TH_CHECKF(count(D0, "alloc ") == 2, "%d allocs", count(D0, "alloc "));
    /* a rank (or a writer) died: the request moves, a new attempt on any instance */
    TH_CHECK(count(P0, "kvt ") + count(P1, "kvt ") == 2);
    http("GET", "/metrics", NULL, g_resp, sizeof g_resp);
    TH_CHECK(strstr(g_resp, "tandem_router_prefill_failures_total{reason=\"transfer\"} 1\n"));
    TH_CHECK(strstr(g_resp, "tandem_router_migrations_total 2\n")); /* test_no_retry's too */
}

static void test_cancel(void)
{
    clear_logs();
    set_fake(P0, M_HANG, true);
    set_fake(D0, M_HANG, true);
    int fd = http_connect();
    TH_REQUIRE(fd >= 0);
    http_send(fd, "POST", "/v1/completions", REQ_STREAM);
    TH_CHECK(wait_count(P0, "kvt ", 1, 3000));
    close(fd);
    uint64_t rid = rid_of(P0, "prefill ", 0);
    TH_CHECK(wait_count(P0, "cancel ", 1, 3000) && wait_count(D0, "cancel ", 1, 3000));
    TH_CHECK(rid_of(P0, "cancel ", 0) == rid && rid_of(D0, "cancel ", 0) == rid);
    usleep(300000);
    TH_CHECKF(count(P0, "cancel ") == 1 && count(D0, "cancel ") == 1, "%d, %d cancels",
              count(P0, "cancel "), count(D0, "cancel "));
    set_fake(P0, M_OK, true);
    set_fake(D0, M_OK, true);
}

static void test_busy(void)
{
    clear_logs();
    set_fake(D0, M_BUSY, true);
    set_fake(D1, M_BUSY, true);
    int64_t t0 = now_ms();
    int st = http("POST", "/v1/completions", REQ, g_resp, sizeof g_resp);
    TH_CHECKF(st == 503 && strstr(g_resp, "\"code\":\"instance_busy\"") &&
                  strstr(g_resp, "Retry-After: 1"),
              "status %d: %s", st, g_resp);
    fprintf(stderr, "busy: answered after %lld ms\n", (long long)(now_ms() - t0));
    TH_CHECK(count(D0, "alloc ") > 0 && count(D1, "alloc ") > 0);
    /* every prefill attempt is cancelled (some only once their Ack is in; the last Prefill
       may still be on its way when the client has its answer) */
    int n_pf = 0, n_cancel = 0;
    for (int t = 0; t < 200; t++) {
        n_pf = count(P0, "prefill ") + count(P1, "prefill ");
        n_cancel = count(P0, "cancel ") + count(P1, "cancel ");
        if (n_cancel == n_pf && t >= 30) break;
        usleep(10000);
    }
    TH_CHECKF(n_pf > 0 && n_cancel == n_pf, "%d prefills, %d cancels", n_pf, n_cancel);
    set_fake(D0, M_OK, true);
    set_fake(D1, M_OK, true);
}

static void test_deadline(void)
{
    clear_logs();
    set_fake(P0, M_HANG, true);
    int64_t t0 = now_ms();
    int st = http("POST", "/v1/completions", REQ, g_resp, sizeof g_resp);
    int64_t took = now_ms() - t0;
    TH_CHECKF(st == 503 && strstr(g_resp, "\"code\":\"first_token_timeout\""), "status %d: %s", st,
              g_resp);
    /* kvxfer.timeout_ms 1000 + instance_timeout_ms 1500 + 2000 */
    TH_CHECKF(took >= 4400 && took < 8000, "took %lld ms", (long long)took);
    TH_CHECK(wait_count(P0, "cancel ", 1, 2000) && wait_count(D0, "cancel ", 1, 2000));
    set_fake(P0, M_OK, true);
}

static void test_timeouts(void)
{
    /* the request's own deadline (1 s) comes before the attempt's (4.5 s) */
    clear_logs();
    set_fake(P0, M_HANG, true);
    int64_t t0 = now_ms();
    int st =
        http("POST", "/v1/completions",
             "{\"prompt\": [1, 2, 3], \"max_tokens\": 4, \"timeout\": 1}", g_resp, sizeof g_resp);
    int64_t took = now_ms() - t0;
    TH_CHECKF(st == 504 && strstr(g_resp, "\"code\":\"request_timeout\"") &&
                  !strstr(g_resp, "Retry-After"),
              "status %d: %s", st, g_resp);
    TH_CHECKF(took >= 950 && took < 2000, "took %lld ms", (long long)took);
    /* both sides held it (the Prefill was acked, the Alloc answered): both cancelled */
    TH_CHECK(wait_count(P0, "cancel ", 1, 2000) && wait_count(D0, "cancel ", 1, 2000));
    set_fake(P0, M_OK, true);

    /* streamed, after the first token: the text, then an error event and [DONE] */
    clear_logs();
    set_fake(D0, M_FIRST_HANG, true);
    t0 = now_ms();
    st = http_h("POST", "/v1/completions", REQ_STREAM, "X-Tandem-Timeout-Ms: 1000\r\n", g_resp,
                sizeof g_resp);
    took = now_ms() - t0;
    char *text = strstr(g_resp, "\"text\":\""), *err = strstr(g_resp, "data: {\"error\"");
    TH_CHECKF(st == 200 && text && err && text < err &&
                  strstr(err, "\"code\":\"request_timeout\"") && strstr(err, "data: [DONE]") &&
                  strstr(err, "generating; tokens generated: 1"),
              "status %d: %s", st, g_resp);
    TH_CHECKF(!strstr(g_resp, "\"finish_reason\":\""), "%s", g_resp); /* never finished */
    TH_CHECKF(took >= 950 && took < 2000, "took %lld ms", (long long)took);
    TH_CHECK(wait_count(D0, "cancel ", 1, 2000) && count(P0, "cancel ") == 0);
    set_fake(D0, M_OK, true);
    http("GET", "/metrics", NULL, g_resp, sizeof g_resp);
    TH_CHECK(strstr(g_resp, "tandem_router_request_timeouts_total{state=\"waiting\"} 1\n"));
    TH_CHECK(strstr(g_resp, "tandem_router_request_timeouts_total{state=\"generating\"} 1\n"));
    TH_CHECK(strstr(g_resp, "tandem_router_request_timeouts_total{state=\"queued\"} 0\n"));
}

/* A request whose prefill on fake i hangs (after its KvTarget), then fake i dies; what it
 * does if it comes back: then_mode. Returns the client's connection (-1: none). */
static int prefill_dies_mid_request(int i, fake_mode then_mode)
{
    clear_logs();
    set_fake(i, M_HANG, true);
    int fd = http_connect();
    if (fd < 0) return -1;
    http_send(fd, "POST", "/v1/completions", REQ);
    TH_CHECK(wait_count(i, "kvt ", 1, 3000));
    pthread_mutex_lock(&g_mu);
    g_f[i].kill = true;
    g_f[i].mode = then_mode;
    pthread_mutex_unlock(&g_mu);
    return fd;
}

static void test_prefill_dies(void)
{
    int fd = prefill_dies_mid_request(P0, M_HANG);
    TH_REQUIRE(fd >= 0);
    size_t len = 0;
    ssize_t k;
    while (len < sizeof g_resp - 1 && (k = read(fd, g_resp + len, sizeof g_resp - 1 - len)) > 0)
        len += (size_t)k;
    g_resp[len] = 0;
    close(fd);
    TH_CHECKF(strstr(g_resp, "HTTP/1.1 200") && strstr(g_resp, "\"completion_tokens\":4"), "%s",
              g_resp);
    TH_CHECK(count(P1, "kvt ") == 1);
    TH_CHECK(wait_pf_alive(1));
    http("GET", "/metrics", NULL, g_resp, sizeof g_resp);
    TH_CHECK(strstr(g_resp, "tandem_router_prefill_failures_total{reason=\"instance_dead\"} 1\n"));
    TH_CHECK(strstr(g_resp, "tandem_prefill_instance_up{instance=\"p0\"} 0\n"));
}

/* Restart fake i's server on its port, as a supervisor restarts a dead process there. */
static int fake_revive(int i)
{
    fake *f = &g_f[i];
    bool gone = false;
    for (int t = 0; t < 200 && !gone; t++) { /* the fake thread destroys the old one */
        pthread_mutex_lock(&g_mu);
        gone = f->s == NULL;
        pthread_mutex_unlock(&g_mu);
        if (!gone) usleep(10000);
    }
    if (!gone) return -1;
    char url[64], bound[128];
    snprintf(url, sizeof url, "tcp://127.0.0.1:%d", f->port);
    td_ctrl_server *s = NULL;
    int rc = td_ctrl_server_create(&(td_ctrl_opts){0}, &s);
    if (!rc) rc = td_ctrl_server_listen(s, url, bound, sizeof bound);
    if (rc) {
        if (s) td_ctrl_server_destroy(s);
        return -1;
    }
    pthread_mutex_lock(&g_mu);
    f->s = s;
    f->kill = false;
    set_health(f);
    pthread_mutex_unlock(&g_mu);
    return 0;
}

static void test_prefill_back(void)
{
    /* p0 is dead (test_prefill_dies). p1, the only prefill instance left, dies mid-prefill
       and comes back only after the router marked it dead (a supervised stage restarting
       slowly): the request moves, waits for it (router.migrate_wait_ms) and is served by
       the new process, while a new request finds no prefill instance (503 at once) */
    int fd = prefill_dies_mid_request(P1, M_OK); /* M_OK: what the new process does */
    TH_REQUIRE(fd >= 0);
    char dead[128];
    snprintf(dead, sizeof dead, "prefill instance p1 (tcp://127.0.0.1:%d) silent for",
             g_f[P1].port);
    bool marked = false;
    for (int t = 0; t < 500 && !marked; t++) {
        marked = router_log_has(dead);
        if (!marked) usleep(10000);
    }
    TH_REQUIRE(marked);
    static char r2[1 << 14];
    int st = http("POST", "/v1/completions", REQ, r2, sizeof r2);
    TH_CHECKF(st == 503 && strstr(r2, "\"code\":\"no_instance\""), "status %d: %s", st, r2);
    usleep(300000); /* the moving request outlives liveness passes with no prefill instance */
    TH_REQUIRE(fake_revive(P1) == 0);
    size_t len = 0;
    http_read_all(fd, g_resp, sizeof g_resp, &len);
    close(fd);
    TH_CHECKF(strstr(g_resp, "HTTP/1.1 200") && strstr(g_resp, "\"completion_tokens\":4"), "%s",
              g_resp);
    TH_CHECKF(count(P1, "prefill ") == 2 && count(P1, "kvt ") == 2, "p1 got: %s", g_f[P1].log);
    TH_CHECK(router_log_has("prefill instance p1 stopped answering after 0 tokens: moving it"));
    /* once: the new process's restart notice does not move what was sent to it already */
    TH_CHECK(router_log_has("prefill p1 moved 1\n"));
    TH_CHECK(wait_pf_alive(1));
    http("GET", "/metrics", NULL, g_resp, sizeof g_resp);
    TH_CHECK(strstr(g_resp, "tandem_router_prefill_failures_total{reason=\"instance_dead\"} 2\n"));
}

static void test_decode_dies(void)
{
    clear_logs();
    set_fake(P1, M_HANG, true);
    set_fake(D0, M_HANG, true);
    int fd = http_connect();
    TH_REQUIRE(fd >= 0);
    http_send(fd, "POST", "/v1/completions", REQ);
    TH_CHECK(wait_count(P1, "kvt ", 1, 3000));
    int d1_allocs = count(D1, "alloc ");
    pthread_mutex_lock(&g_mu);
    g_f[D0].kill = true;
    pthread_mutex_unlock(&g_mu);
    set_fake(P1, M_OK, true); /* the next attempt's prefill finishes */
    size_t len = 0;
    ssize_t k;
    while (len < sizeof g_resp - 1 && (k = read(fd, g_resp + len, sizeof g_resp - 1 - len)) > 0)
        len += (size_t)k;
    g_resp[len] = 0;
    close(fd);
    TH_CHECKF(strstr(g_resp, "HTTP/1.1 200") && strstr(g_resp, "\"finish_reason\""), "%s", g_resp);
    TH_CHECK(count(D1, "alloc ") == d1_allocs + 1);
    uint64_t rid = rid_of(P1, "prefill ", 0);
    TH_CHECK(wait_count(P1, "cancel ", 1, 2000) && rid_of(P1, "cancel ", 0) == rid);
}

static void test_moved(void)
{
    clear_logs();
    set_fake(P0, M_OK, true);
    set_fake(D0, M_FIRST_FAIL_ONCE, true);
    int st = http("POST", "/v1/completions", REQ_STREAM, g_resp, sizeof g_resp);
    TH_CHECKF(st == 200 && strstr(g_resp, "data: [DONE]") && !strstr(g_resp, "\"error\"") &&
                  strstr(g_resp, "\"finish_reason\":\"length\""),
              "status %d: %s", st, g_resp);
    /* the first attempt: the prompt (3), max 4; the move: prompt + the first token, max 3 */
    uint64_t r1 = rid_of(D0, "alloc ", 0), r2 = rid_of(D0, "alloc ", 1);
    char want[96];
    snprintf(want, sizeof want, "alloc %llu stages=2 n=4 max=3", (unsigned long long)r2);
    pthread_mutex_lock(&g_mu);
    bool moved = r1 && r2 && r1 != r2 && strstr(g_f[D0].log, want);
    pthread_mutex_unlock(&g_mu);
    TH_CHECKF(moved, "decode log: %s", g_f[D0].log);
    TH_CHECK(count(P0, "prefill ") == 2);
}

static int g_drain_exit = -1; /* the router's exit status after test_drain */

static void test_drain(void)
{
    clear_logs();
    set_fake(P1, M_OK, true);
    set_fake(D1, M_FIRST_HANG, true);
    int fd = http_connect();
    TH_REQUIRE(fd >= 0);
    http_send(fd, "POST", "/v1/completions", REQ_STREAM);
    /* wait for the first token's chunk (of this response: g_resp holds the last test's) */
    g_resp[0] = 0;
    size_t len = 0;
    ssize_t k;
    while (!strstr(g_resp, "\"text\":\"") && len < sizeof g_resp - 1 &&
           (k = read(fd, g_resp + len, sizeof g_resp - 1 - len)) > 0) {
        len += (size_t)k;
        g_resp[len] = 0;
    }
    TH_REQUIRE(strstr(g_resp, "\"text\":\""));
    int64_t t0 = now_ms();
    kill(g_router, SIGTERM);
    static char r2[1 << 14];
    /* until the router has taken the signal: a request sent before that is served (and held
     * open by the drain), so the refusal is asked for only once /health says draining */
    int st = -1;
    for (int t = 0; t < 200 && !(st == 503 && strstr(r2, "\"status\":\"draining\"")); t++) {
        st = http("GET", "/health", NULL, r2, sizeof r2);
        if (st != 503) usleep(10000);
    }
    TH_CHECKF(st == 503 && strstr(r2, "\"status\":\"draining\""), "status %d: %s", st, r2);
    st = http("POST", "/v1/completions", REQ, r2, sizeof r2);
    TH_CHECKF(st == 503 && strstr(r2, "\"code\":\"shutting_down\"") &&
                  strstr(r2, "Retry-After: 1") && strstr(r2, "Connection: close"),
              "status %d: %s", st, r2);
    http_read_all(fd, g_resp, sizeof g_resp, &len);
    close(fd);
    int64_t took = now_ms() - t0;
    char *err = strstr(g_resp, "data: {\"error\"");
    TH_CHECKF(err && strstr(err, "\"code\":\"shutting_down\"") && strstr(err, "data: [DONE]"), "%s",
              g_resp);
    TH_CHECKF(took >= DRAIN_MS - 50, "the stream ended %lld ms after SIGTERM", (long long)took);
    int ws = 0;
    waitpid(g_router, &ws, 0);
    g_router = 0;
    took = now_ms() - t0;
    g_drain_exit = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
    TH_CHECKF(took < DRAIN_MS + 2000, "exit %lld ms after SIGTERM (drain %d ms)", (long long)took,
              DRAIN_MS);
    TH_CHECK(wait_count(D1, "cancel ", 1, 2000));
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: test_rt_pair ROUTER_BIN MODEL_GGUF\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    if (fake_start(&g_f[P0], "p0", true) || fake_start(&g_f[P1], "p1", true) ||
        fake_start(&g_f[D0], "d0", false) || fake_start(&g_f[D1], "d1", false)) {
        fprintf(stderr, "cannot start the fake leaders\n");
        return 1;
    }
    /* steer the choices: p0 is the less loaded prefill, d0 the decode with more room */
    g_f[P1].queued = 100000;
    g_f[D0].kv_free = 1000;
    g_f[D1].kv_free = 500;
    for (int i = 0; i < N_FAKES; i++)
        set_health(&g_f[i]);
    pthread_t th;
    pthread_create(&th, NULL, fake_main, NULL);
    if (start_router(argv[1], argv[2])) {
        fprintf(stderr, "the router did not become healthy (log %s)\n", g_logpath);
        TH_CHECK(0);
    } else {
        TH_RUN(test_normal);
        TH_RUN(test_late_done);
        TH_RUN(test_retry);
        TH_RUN(test_no_retry);
        TH_RUN(test_transfer);
        TH_RUN(test_cancel);
        TH_RUN(test_busy);
        TH_RUN(test_deadline);
        TH_RUN(test_timeouts);
        TH_RUN(test_moved);
        TH_RUN(test_prefill_dies); /* leaves p0 dead */
        TH_RUN(test_prefill_back);
        TH_RUN(test_decode_dies); /* leaves d0 dead */
        TH_RUN(test_drain); /* the router exits */
    }
    if (th_failures) {
        dump_logs();
        fprintf(stderr, "router log: %s\n", g_logpath);
    }
    int st = g_router ? stop_router() : g_drain_exit;
    TH_CHECKF(st == 0, "the router exited with status %d (log %s)", st, g_logpath);
    g_stop = true;
    pthread_join(th, NULL);
    for (int i = 0; i < N_FAKES; i++)
        td_ctrl_server_destroy(g_f[i].s);
    if (!th_failures) {
        unlink(g_logpath);
        char cfg[320];
        snprintf(cfg, sizeof cfg, "%s/cluster.yaml", g_dir);
        unlink(cfg);
        rmdir(g_dir);
    }
    TH_EXIT();
}
