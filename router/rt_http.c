/* rt_http.c: libmicrohttpd glue: routing, authentication, bodies, and the hand-off of
 * generation requests to the loop thread with suspend/resume.
 *
 * A generation request on its connection (MHD's threads):
 *   headers --route/auth, client key, X-Tandem-Timeout-Ms--> BODY (collected up to
 *           r->max_body, the rest read and dropped)
 *   BODY complete --parse ok--> suspend, rt_loop_post --loop resumes--> handler again:
 *     q->http.sse: queue the SSE response (reader: copy q->http.out, suspend when empty, end at
 * done) q->http.done: queue q->http.out as JSON with q->http.status neither (a poke): suspend again
 *   request-completed callback: mark http_gone, tell the loop if the request is open.
 * Errors found before the hand-off (404, 405, 401, 413, 400, 503 while draining) are
 * answered here, each logged at info in one line without the body (the request's status,
 * method, path, error type, param and code; the message, which may quote the body, at
 * debug). Counting: responses to generation requests go to tandem_router_requests_total,
 * the others (health and metrics polls, /v1/models, unknown paths; /tokenize, /detokenize and
 * /version count as "other") to
 * tandem_router_http_requests_total{path}. Limits: request line + headers RT_MAX_HEADERS (MHD's
 * per-connection memory pool: MHD itself answers 431), bodies r->max_body (413). While the router
 * drains every response carries "Connection: close", so keep-alive clients go elsewhere.
 * With router.tls_cert the daemon speaks TLS (rt_tls.h); with router.tls_client_ca a request
 * on a connection without a verified client certificate closes it (the handshake refuses
 * such clients already). */
#include <arpa/inet.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <microhttpd.h>

#include "rt.h"
#include "rt_http.h"
#include "rt_loop.h"
#include "rt_tls.h"
#include "rt_tokenize.h"
#include "td_clock.h"
#include "td_err.h"

typedef enum {
    K_NONE = 0,
    K_COMPLETIONS,
    K_CHAT,
    K_MODELS,
    K_HEALTH,
    K_METRICS,
    K_TOKENIZE,   /* POST /tokenize (rt_tokenize.h) */
    K_DETOKENIZE, /* POST /detokenize */
    K_VERSION,    /* GET /version */
    K_INSTANCES,  /* GET /instances: the live set (rt_metrics_instances_json) */
} conn_kind;

typedef struct {
    conn_kind kind;
    rt_error err; /* err.status != 0: answer this once the body is read */
    rt_buf body;  /* (<= r->max_body) */
    bool too_large;
    bool one_model;     /* K_MODELS: GET /v1/models/{id} of the served model */
    uint64_t client;    /* fairness key (rt_client_key) */
    int64_t timeout_ms; /* X-Tandem-Timeout-Ms, 0: not given */
    rt_req *q;          /* after the hand-off */
    char method[16];    /* for the log: the method, */
    char path[104];     /* and the path (cut, unprintable bytes as '?') */
} conn_ctx;

static atomic_uint_fast64_t g_seq;
static uint64_t g_salt;

static bool is_generation(conn_kind kind)
{
    return kind == K_COMPLETIONS || kind == K_CHAT;
}

/* Requests whose body is read (up to r->max_body). */
static bool has_body(conn_kind kind)
{
    return is_generation(kind) || kind == K_TOKENIZE || kind == K_DETOKENIZE;
}

/* Count a response to a request of that kind. */
static void count(rt_router *r, conn_kind kind, int status)
{
    if (is_generation(kind)) {
        rt_metrics_status(&r->metrics, status);
        return;
    }
    rt_path path = kind == K_HEALTH    ? RT_PATH_HEALTH
                   : kind == K_METRICS ? RT_PATH_METRICS
                   : kind == K_MODELS  ? RT_PATH_MODELS
                                       : RT_PATH_OTHER;
    rt_metrics_http(&r->metrics, path, status);
}

static enum MHD_Result respond(rt_router *r, struct MHD_Connection *conn, conn_kind kind,
                               int status, const char *body, size_t len, const char *ctype)
{
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (status == 429 || status == 503) MHD_add_response_header(resp, "Retry-After", "1");
    if (status == 405) MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, "GET, POST");
    if (atomic_load(&r->draining))
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result ok = MHD_queue_response(conn, (unsigned)status, resp);
    MHD_destroy_response(resp);
    count(r, kind, status);
    return ok;
}

/* A request answered here with an error, before the loop saw it: one line at info (at
 * warn for a 500), never the body or a credential; the message (it may quote the body,
 * a header or the model asked for) only at debug. */
static void log_refusal(const conn_ctx *c, const rt_error *e)
{
    const char *param = e->param ? e->param : "-", *code = e->code ? e->code : "-";
    const char *type = e->type ? e->type : "-";
    if (e->status >= 500 && e->status != 503)
        TD_LOG_WARN("router: refused %s %s status %d %s param %s code %s", c->method, c->path,
                    e->status, type, param, code);
    else
        TD_LOG_INFO("router: refused %s %s status %d %s param %s code %s", c->method, c->path,
                    e->status, type, param, code);
    TD_LOG_DEBUG("router: refused %s %s status %d: %s", c->method, c->path, e->status, e->message);
}

static enum MHD_Result respond_error(rt_router *r, struct MHD_Connection *conn, const conn_ctx *c,
                                     const rt_error *e)
{
    log_refusal(c, e);
    char *s = rt_error_json(e);
    static const char fallback[] = "{\"error\":{\"message\":\"internal error\",\"type\":"
                                   "\"server_error\",\"param\":null,\"code\":null}}";
    enum MHD_Result ok = respond(r, conn, c->kind, e->status, s ? s : fallback,
                                 strlen(s ? s : fallback), "application/json");
    free(s);
    return ok;
}

/* ---- streaming ---- */

static ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    rt_req *q = cls;
    ssize_t n;
    double delay = -1;
    pthread_mutex_lock(&q->mu);
    if (q->http.out.len) {
        size_t k = q->http.out.len < max ? q->http.out.len : max;
        memcpy(buf, q->http.out.buf, k);
        rt_buf_consume(&q->http.out, k);
        n = (ssize_t)k;
        if (q->http.t_pending_ns) {
            delay = (double)(td_now_ns() - q->http.t_pending_ns) / 1e9;
            /* what is left was produced no earlier than what just went out */
            q->http.t_pending_ns = q->http.out.len ? q->http.t_pending_ns : 0;
        }
    } else if (q->http.done) {
        n = MHD_CONTENT_READER_END_OF_STREAM;
    } else {
        q->http.suspended = true;
        MHD_suspend_connection(q->http.conn);
        n = 0;
    }
    pthread_mutex_unlock(&q->mu);
    if (delay >= 0 && q->http.router) rt_metrics_write_delay(&q->http.router->metrics, delay);
    return n;
}

static void sse_free(void *cls)
{
    rt_req_release(cls);
}

static enum MHD_Result start_sse(rt_router *r, struct MHD_Connection *conn, rt_req *q)
{
    pthread_mutex_lock(&q->mu);
    q->http.router = r;
    pthread_mutex_unlock(&q->mu);
    rt_req_retain(q);
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, sse_read, q, sse_free);
    if (!resp) {
        rt_req_release(q);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    if (atomic_load(&r->draining))
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result ok = MHD_queue_response(conn, 200, resp);
    MHD_destroy_response(resp);
    rt_metrics_status(&r->metrics, 200); /* a generation request's */
    return ok;
}

/* ---- limits, credentials, clients ---- */

size_t rt_max_body(const td_cfg *cfg)
{
    size_t b = (size_t)cfg->router.max_prompt_tokens * 64;
    return b < RT_MIN_BODY ? RT_MIN_BODY : b > RT_MAX_BODY ? RT_MAX_BODY : b;
}

bool rt_key_equal(const char *given, const char *expected)
{
    size_t g = strlen(given), n = strlen(expected);
    volatile unsigned char d = g != n; /* volatile: no early exit once a byte differs */
    for (size_t i = 0; i < n; i++)
        d |= (unsigned char)((i < g ? (unsigned char)given[i] : 0) ^ (unsigned char)expected[i]);
    return d == 0;
}

uint64_t rt_client_key(const void *addr, size_t addr_len, const char *auth)
{
    /* FNV-1a: a collision only merges two clients' queues */
    uint64_t h = 0xcbf29ce484222325ull;
    const unsigned char *p = addr;
    for (size_t i = 0; i < addr_len; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    h = (h ^ 0xff) * 0x100000001b3ull; /* address | credential */
    for (const char *c = auth ? auth : ""; *c; c++)
        h = (h ^ (unsigned char)*c) * 0x100000001b3ull;
    return h;
}

/* The client's IP address (no port: one host's connections are one client), and the
 * Authorization header: with router.api_key set every client presents the same key, so
 * the address tells them apart; without it the header (unverified) tells apart the
 * clients behind one proxy. */
static uint64_t conn_client(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    const void *a = NULL;
    size_t alen = 0;
    if (ci && ci->client_addr) {
        const struct sockaddr *sa = ci->client_addr;
        if (sa->sa_family == AF_INET) {
            a = &((const struct sockaddr_in *)(const void *)sa)->sin_addr;
            alen = sizeof(struct in_addr);
        } else if (sa->sa_family == AF_INET6) {
            a = &((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr;
            alen = sizeof(struct in6_addr);
        }
    }
    const char *auth =
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    return rt_client_key(a, alen, auth);
}

/* X-Tandem-Timeout-Ms: digits only, 1..router.max_request_timeout_ms; 0 if absent,
 * else c->err is set. */
static void header_timeout(rt_router *r, struct MHD_Connection *conn, conn_ctx *c)
{
    const char *v = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "X-Tandem-Timeout-Ms");
    if (!v) return;
    int max = r->cfg->router.max_request_timeout_ms;
    long long ms = 0;
    const char *p = v;
    while (*p >= '0' && *p <= '9' && ms <= max)
        ms = ms * 10 + (*p++ - '0');
    if (p == v || *p || ms < 1 || ms > max) {
        rt_error_set(&c->err, 400, "X-Tandem-Timeout-Ms", NULL,
                     "X-Tandem-Timeout-Ms must be an integer number of milliseconds in [1, %d] "
                     "(router.max_request_timeout_ms), got '%.40s'",
                     max, v);
        return;
    }
    c->timeout_ms = ms;
}

/* ---- routing ---- */

/* s for a log line: at most cap - 1 bytes, bytes outside printable ASCII as '?'. */
static void log_name(char *out, size_t cap, const char *s)
{
    size_t n = 0;
    for (; s && s[n] && n + 1 < cap; n++)
        out[n] = s[n] > ' ' && s[n] < 0x7f ? s[n] : '?';
    out[n] = 0;
}

static void route(rt_router *r, struct MHD_Connection *conn, conn_ctx *c, const char *url,
                  const char *method)
{
    static const struct {
        const char *path, *method;
        conn_kind kind;
    } routes[] = {
        {"/v1/completions", "POST", K_COMPLETIONS},
        {"/v1/chat/completions", "POST", K_CHAT},
        {"/v1/models", "GET", K_MODELS},
        {"/health", "GET", K_HEALTH},
        {"/metrics", "GET", K_METRICS},
        {"/tokenize", "POST", K_TOKENIZE},
        {"/detokenize", "POST", K_DETOKENIZE},
        {"/version", "GET", K_VERSION},
        {"/instances", "GET", K_INSTANCES},
    };
    bool head = !strcmp(method, "HEAD");
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++) {
        if (strcmp(url, routes[i].path)) continue;
        c->kind = routes[i].kind; /* a 405 is counted under the path it was meant for */
        if (strcmp(method, routes[i].method) && !(head && !strcmp(routes[i].method, "GET"))) {
            rt_error_set(&c->err, 405, NULL, "method_not_allowed",
                         "%s is not allowed on %s (use %s)", method, url, routes[i].method);
            return;
        }
        break;
    }
    if (c->kind == K_NONE && !strncmp(url, "/v1/models/", 11)) {
        c->kind = K_MODELS;
        if (strcmp(method, "GET") && !head) {
            rt_error_set(&c->err, 405, NULL, "method_not_allowed",
                         "%s is not allowed on %.200s (use GET)", method, url);
            return;
        }
        c->one_model = rt_openai_model_is(&r->model, url + 11);
        if (!c->one_model)
            rt_error_set(&c->err, 404, "model", "model_not_found",
                         "The model '%.200s' does not exist", url + 11);
    }
    if (c->kind == K_NONE) {
        rt_error_set(&c->err, 404, NULL, "not_found", "no such endpoint: %s %.200s", method, url);
        return;
    }
    /* /instances names the instances' addresses: the key guards it as it guards the API */
    bool keyed = !strncmp(url, "/v1/", 4) || c->kind == K_TOKENIZE || c->kind == K_DETOKENIZE ||
                 c->kind == K_INSTANCES;
    if (r->api_key_hdr[0] && keyed) {
        const char *auth =
            MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
        if (!auth || !rt_key_equal(auth, r->api_key_hdr))
            rt_error_set(&c->err, 401, NULL, "invalid_api_key",
                         auth ? "invalid API key" : "missing API key (Authorization: Bearer KEY)");
    }
    if (!c->err.status && (c->kind == K_COMPLETIONS || c->kind == K_CHAT)) {
        c->client = conn_client(conn);
        header_timeout(r, conn, c);
    }
}

static enum MHD_Result simple_get(rt_router *r, struct MHD_Connection *conn, const conn_ctx *c)
{
    conn_kind kind = c->kind;
    char buf[128];
    char *s = NULL;
    enum MHD_Result ok;
    switch (kind) {
    case K_MODELS:
        s = c->one_model ? rt_openai_model(&r->model) : rt_openai_models(&r->model);
        if (!s) break;
        ok = respond(r, conn, kind, 200, s, strlen(s), "application/json");
        free(s);
        return ok;
    case K_HEALTH: {
        /* disaggregated: serving needs a decode and a prefill instance */
        int n = atomic_load(&r->n_alive), np = atomic_load(&r->n_pf_alive);
        bool draining = atomic_load(&r->draining);
        bool ok = n > 0 && (!r->disagg || np > 0) && !draining;
        int len = snprintf(buf, sizeof buf, "{\"status\":\"%s\",\"instances_alive\":%d",
                           draining ? "draining"
                           : ok     ? "ok"
                                    : "unavailable",
                           n);
        if (r->disagg)
            len += snprintf(buf + len, sizeof buf - (size_t)len, ",\"prefill_instances_alive\":%d",
                            np);
        len += snprintf(buf + len, sizeof buf - (size_t)len, "}");
        return respond(r, conn, kind, ok ? 200 : 503, buf, (size_t)len, "application/json");
    }
    case K_METRICS:
        s = rt_metrics_render(&r->metrics, r->cfg);
        if (!s) break;
        ok = respond(r, conn, kind, 200, s, strlen(s), "text/plain; version=0.0.4");
        free(s);
        return ok;
    case K_INSTANCES:
        if (!(s = rt_metrics_instances_json(&r->metrics))) break;
        ok = respond(r, conn, kind, 200, s, strlen(s), "application/json");
        free(s);
        return ok;
    case K_VERSION:
        if (!(s = rt_version_json())) break;
        ok = respond(r, conn, kind, 200, s, strlen(s), "application/json");
        free(s);
        return ok;
    default:
        break;
    }
    rt_error e;
    rt_error_set(&e, 500, NULL, NULL, "out of memory");
    return respond_error(r, conn, c, &e);
}

/* POST /tokenize and /detokenize, answered here on the HTTP thread (no instance involved). */
static enum MHD_Result token_endpoint(rt_router *r, struct MHD_Connection *conn, conn_ctx *c)
{
    rt_error e;
    char *out = NULL;
    const char *body = c->body.buf ? c->body.buf : "";
    int status = c->kind == K_TOKENIZE ? rt_tokenize(&r->model, body, c->body.len, &out, &e)
                                       : rt_detokenize(&r->model, body, c->body.len, &out, &e);
    rt_buf_free(&c->body);
    if (status != 200) return respond_error(r, conn, c, &e);
    enum MHD_Result ok = respond(r, conn, c->kind, 200, out, strlen(out), "application/json");
    free(out);
    return ok;
}

/* Body complete: parse, then hand off (suspending the connection). */
static enum MHD_Result start_generation(rt_router *r, struct MHD_Connection *conn, conn_ctx *c)
{
    rt_req *q = rt_req_create();
    if (!q) {
        rt_error e;
        rt_error_set(&e, 500, NULL, NULL, "out of memory");
        return respond_error(r, conn, c, &e);
    }
    rt_endpoint ep = c->kind == K_CHAT ? RT_EP_CHAT : RT_EP_COMPLETIONS;
    rt_error e;
    if (rt_openai_parse(&r->model, ep, c->body.buf ? c->body.buf : "", c->body.len, &q->p, &e)) {
        rt_req_release(q);
        return respond_error(r, conn, c, &e);
    }
    rt_buf_free(&c->body);
    /* the body's "timeout" and the header both ask for an earlier end: the smaller wins */
    int64_t timeout = r->cfg->router.request_timeout_ms;
    if (q->p.timeout_ms || c->timeout_ms) {
        timeout = q->p.timeout_ms ? q->p.timeout_ms : c->timeout_ms;
        if (c->timeout_ms && c->timeout_ms < timeout) timeout = c->timeout_ms;
    }
    q->client = c->client;
    uint64_t seq = atomic_fetch_add(&g_seq, 1) + 1;
    snprintf(q->oid, sizeof q->oid, "%s-%016llx%08llx", ep == RT_EP_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)(g_salt ^ (seq * 0x9e3779b97f4a7c15ull)),
             (unsigned long long)(seq & 0xffffffffu));
    q->created = (int64_t)td_wall_now().tv_sec;
    q->t_arrive_ms = td_now_ms();
    q->expires_ms = q->t_arrive_ms + timeout;
    q->http.conn = conn;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    q->http.fd = ci ? ci->connect_fd : -1;
    if (!rt_loop_post(r, q)) {
        rt_req_release(q);
        rt_error_set(&e, 503, NULL, "shutting_down", "the router is shutting down");
        return respond_error(r, conn, c, &e);
    }
    c->q = q;
    atomic_fetch_add(&r->open, 1);
    return MHD_YES;
}

/* Called again after the loop resumed the connection. */
static enum MHD_Result continue_generation(rt_router *r, struct MHD_Connection *conn, conn_ctx *c)
{
    rt_req *q = c->q;
    pthread_mutex_lock(&q->mu);
    if (q->http.sse) {
        pthread_mutex_unlock(&q->mu);
        return start_sse(r, conn, q);
    }
    if (q->http.done) {
        int status = q->http.status ? q->http.status : 500;
        char *body = q->http.out.buf;
        size_t len = q->http.out.len;
        q->http.out = (rt_buf){0};
        pthread_mutex_unlock(&q->mu);
        enum MHD_Result ok = respond(r, conn, c->kind, status, body ? body : "{}", body ? len : 2,
                                     "application/json");
        free(body);
        return ok;
    }
    q->http.suspended = true; /* woken with nothing to do (a poke): wait again */
    MHD_suspend_connection(conn);
    pthread_mutex_unlock(&q->mu);
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls)
{
    rt_router *r = cls;
    conn_ctx *c = *con_cls;
    if (!c) {
        if (!rt_tls_client_ok(&r->tls, conn)) return MHD_NO; /* closes the connection */
        c = calloc(1, sizeof *c);
        if (!c) return MHD_NO;
        *con_cls = c;
        log_name(c->method, sizeof c->method, method);
        log_name(c->path, sizeof c->path, url);
        route(r, conn, c, url, method);
        const char *cl =
            MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl && strtoull(cl, NULL, 10) > r->max_body) c->too_large = true;
        return MHD_YES;
    }
    if (*upload_size) {
        bool keep = !c->err.status && has_body(c->kind);
        if (keep && !c->too_large && c->body.len + *upload_size <= r->max_body) {
            if (rt_buf_append(&c->body, upload, *upload_size)) return MHD_NO;
        } else if (keep) {
            c->too_large = true;
            rt_buf_free(&c->body);
        }
        *upload_size = 0;
        return MHD_YES;
    }
    if (c->q) return continue_generation(r, conn, c);
    if (c->err.status) return respond_error(r, conn, c, &c->err);
    if (has_body(c->kind)) {
        rt_error e;
        if (c->too_large) {
            rt_error_set(&e, 413, NULL, "request_too_large",
                         "the request body is larger than %zu bytes", r->max_body);
            return respond_error(r, conn, c, &e);
        }
        if (!is_generation(c->kind)) return token_endpoint(r, conn, c);
        if (atomic_load(&r->draining)) {
            rt_error_set(&e, 503, NULL, "shutting_down",
                         "the router is shutting down (draining): retry on another one");
            return respond_error(r, conn, c, &e);
        }
        return start_generation(r, conn, c);
    }
    return simple_get(r, conn, c);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    rt_router *r = cls;
    conn_ctx *c = *con_cls;
    if (!c) return;
    if (c->q) {
        rt_req *q = c->q;
        pthread_mutex_lock(&q->mu);
        q->http.gone = true;
        bool open = !q->http.done;
        pthread_mutex_unlock(&q->mu);
        if (open) rt_loop_gone(r, q);
        rt_req_release(q);
        atomic_fetch_sub(&r->open, 1);
    }
    rt_buf_free(&c->body);
    free(c);
    *con_cls = NULL;
}

int rt_http_start(rt_router *r, const char *host, int port)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int gai = getaddrinfo(host, ps, &hints, &ai);
    if (gai || !ai) {
        TD_LOG_ERR("router: cannot resolve listen address '%s': %s", host, gai_strerror(gai));
        return TD_EINVAL;
    }
    struct timespec ts = td_wall_now();
    g_salt = ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)ts.tv_nsec ^ (uint64_t)getpid() << 16;
    struct MHD_OptionItem tls_opts[RT_TLS_N_OPTIONS];
    unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME |
                     rt_tls_mhd_options(&r->tls, tls_opts);
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    r->mhd =
        MHD_start_daemon(flags, (uint16_t)port, NULL, NULL, on_request, r, MHD_OPTION_SOCK_ADDR,
                         ai->ai_addr, MHD_OPTION_NOTIFY_COMPLETED, on_completed, r,
                         MHD_OPTION_THREAD_POOL_SIZE, 2u, MHD_OPTION_CONNECTION_TIMEOUT, 300u,
                         MHD_OPTION_CONNECTION_LIMIT, 4000u, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
                         (size_t)RT_MAX_HEADERS, MHD_OPTION_ARRAY, tls_opts, MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!r->mhd) {
        TD_LOG_ERR("router: cannot listen on %s:%d (address in use or not local?%s)", host, port,
                   r->tls.on ? " or libmicrohttpd refused the TLS certificate or key" : "");
        return TD_EIO;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(r->mhd, MHD_DAEMON_INFO_BIND_PORT);
    bool v6 = strchr(host, ':') != NULL;
    char mode[128];
    if (!r->tls.on)
        snprintf(mode, sizeof mode, "plain HTTP, no TLS");
    else if (r->tls.ca)
        snprintf(mode, sizeof mode,
                 "TLS; clients need a certificate from router.tls_client_ca, %d CA(s)",
                 r->tls.n_ca);
    else
        snprintf(mode, sizeof mode, "TLS");
    TD_LOG_INFO("router: listening on %s://%s%s%s:%u (%s)", r->tls.on ? "https" : "http",
                v6 ? "[" : "", host, v6 ? "]" : "", di ? di->port : (unsigned)port, mode);
    return 0;
}

void rt_http_stop(rt_router *r, int wait_ms)
{
    if (!r->mhd) return;
    MHD_socket ls = MHD_quiesce_daemon(r->mhd);
    if (ls != MHD_INVALID_SOCKET) close(ls);
    /* the loop has answered every open request: let those answers reach the clients */
    for (int t = 0; t < wait_ms && atomic_load(&r->open) > 0; t += 10)
        usleep(10 * 1000);
    MHD_stop_daemon(r->mhd);
    r->mhd = NULL;
}
