/* cmd_loadgen.c: `tandem bench`: a load generator for the OpenAI HTTP API, plus the small
 * blocking HTTP/1.1 client it (and `tandem up`'s health wait) uses.
 *
 *   tandem bench --url URL --concurrency C --requests N --prompt-tokens P --max-tokens M
 *                [--stream] [--json] [--model NAME] [--temperature T] [--timeout-ms MS]
 *
 * C threads, each a blocking client on its own connection, send N POST /v1/completions in
 * all; the prompt is an array of P token ids (pseudo-random in [100, 500), valid for the
 * default and the synthetic models). The model name is asked from GET /v1/models unless
 * --model is given. The report follows the established serving benchmarks: requests/s,
 * output tokens/s (completion tokens from `usage`), and with --stream time to first token
 * (TTFT), time per output token after the first (TPOT = (last - first) / (tokens - 1)) and
 * inter-token latency (ITL: every gap between two content chunks), p50/p90/p99 in ms, plus
 * end-to-end latency. Without --stream, TTFT/TPOT/ITL cannot be observed: their JSON values
 * are null. Progress goes to stderr once a second. Exit status 0 when every request
 * succeeded, 1 otherwise (the summary is printed either way).
 *
 * HTTP: requests are HTTP/1.1 with Connection: close; responses may be chunked or
 * length-delimited or end at close; the body is handed to a callback, de-chunked, as it
 * arrives (so SSE events can be timed).
 */
#define _GNU_SOURCE /* memmem, strcasestr, pipe2 */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "td_err.h"

/* ---- HTTP client ---------------------------------------------------------------- */

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Connects with a deadline; returns the socket or a negative td_err. */
static int http_connect(const char *host, int port, double deadline)
{
    char ports[16];
    snprintf(ports, sizeof ports, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res;
    if (getaddrinfo(host, ports, &hints, &res)) return TD_EIO;
    int fd = -1, rc = TD_EIO;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
            rc = 0;
            break;
        }
        if (errno == EINPROGRESS) {
            struct pollfd p = {.fd = fd, .events = POLLOUT};
            int left = (int)(deadline - now_ms());
            if (left > 0 && poll(&p, 1, left) == 1) {
                int e = 0;
                socklen_t l = sizeof e;
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &l);
                if (!e) {
                    rc = 0;
                    break;
                }
            } else if (left <= 0) {
                rc = TD_ETIMEDOUT;
            }
        }
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    return rc ? rc : fd;
}

static int http_send_all(int fd, const char *p, size_t n, double deadline)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w > 0) {
            p += w;
            n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno != EAGAIN && errno != EINTR) return TD_EIO;
        struct pollfd pf = {.fd = fd, .events = POLLOUT};
        int left = (int)(deadline - now_ms());
        if (left <= 0) return TD_ETIMEDOUT;
        poll(&pf, 1, left);
    }
    return 0;
}

/* Response parser state: header, then body (chunked, sized or until close). */
typedef struct {
    char *buf; /* unparsed bytes */
    size_t len, cap;
    bool in_body, chunked, done;
    long long remaining; /* sized body: bytes left; chunked: bytes left in chunk, -1 size line */
    int status;
    const cli_http_req *rq;
    int cb_rc;
} http_parse;

static int deliver(http_parse *ps, const char *p, size_t n)
{
    if (!n || !ps->rq->on_body || ps->cb_rc) return 0;
    ps->cb_rc = ps->rq->on_body(ps->rq->ctx, p, n);
    return ps->cb_rc;
}

/* Consumes what it can of ps->buf. Returns 0, or TD_EFORMAT on a malformed response. */
static int http_consume(http_parse *ps)
{
    size_t off = 0;
    if (!ps->in_body) {
        char *end = memmem(ps->buf, ps->len, "\r\n\r\n", 4);
        if (!end) return ps->len > 65536 ? TD_EFORMAT : 0;
        *end = 0;
        if (sscanf(ps->buf, "HTTP/%*d.%*d %d", &ps->status) != 1) return TD_EFORMAT;
        ps->remaining = -2; /* until close */
        for (char *line = strstr(ps->buf, "\r\n"); line; line = strstr(line + 2, "\r\n")) {
            char *h = line + 2;
            if (!strncasecmp(h, "Transfer-Encoding:", 18) && strcasestr(h, "chunked"))
                ps->chunked = true;
            else if (!strncasecmp(h, "Content-Length:", 15))
                ps->remaining = atoll(h + 15);
        }
        if (ps->chunked) ps->remaining = -1;
        ps->in_body = true;
        off = (size_t)(end - ps->buf) + 4;
        if (ps->remaining == 0) ps->done = true;
    }
    while (off < ps->len && !ps->done) {
        char *p = ps->buf + off;
        size_t avail = ps->len - off;
        if (!ps->chunked) {
            size_t n = avail;
            if (ps->remaining >= 0 && (long long)n > ps->remaining) n = (size_t)ps->remaining;
            deliver(ps, p, n);
            off += n;
            if (ps->remaining >= 0) {
                ps->remaining -= (long long)n;
                if (!ps->remaining) ps->done = true;
            }
        } else if (ps->remaining < 0) { /* size line, or the CRLF after a chunk (-3) */
            char *eol = memmem(p, avail, "\r\n", 2);
            if (!eol) break;
            if (ps->remaining == -3) {
                ps->remaining = -1;
            } else {
                char *e;
                long long sz = strtoll(p, &e, 16);
                if (e == p || sz < 0) return TD_EFORMAT;
                if (sz == 0) ps->done = true;
                ps->remaining = sz;
            }
            off += (size_t)(eol - p) + 2;
        } else {
            size_t n = avail < (size_t)ps->remaining ? avail : (size_t)ps->remaining;
            deliver(ps, p, n);
            off += n;
            ps->remaining -= (long long)n;
            if (!ps->remaining) ps->remaining = -3;
        }
    }
    memmove(ps->buf, ps->buf + off, ps->len - off);
    ps->len -= off;
    return 0;
}

int cli_http_request(const cli_http_req *rq, int *status)
{
    double deadline = now_ms() + (rq->timeout_ms > 0 ? rq->timeout_ms : 30000);
    *status = 0;
    int fd = http_connect(rq->host, rq->port, deadline);
    if (fd < 0) return fd;
    size_t blen = rq->body ? strlen(rq->body) : 0;
    char head[1024];
    bool v6 = strchr(rq->host, ':') != NULL;
    int hn = snprintf(head, sizeof head,
                      "%s %s HTTP/1.1\r\nHost: %s%s%s:%d\r\nConnection: close\r\n"
                      "Accept: */*\r\nUser-Agent: tandem\r\n",
                      rq->method, rq->path, v6 ? "[" : "", rq->host, v6 ? "]" : "", rq->port);
    if (rq->body)
        hn += snprintf(head + hn, sizeof head - (size_t)hn,
                       "Content-Type: application/json\r\nContent-Length: %zu\r\n", blen);
    hn += snprintf(head + hn, sizeof head - (size_t)hn, "\r\n");
    int rc = (size_t)hn >= sizeof head ? TD_EINVAL : http_send_all(fd, head, (size_t)hn, deadline);
    if (!rc && blen) rc = http_send_all(fd, rq->body, blen, deadline);
    http_parse ps = {.rq = rq, .cap = 16384};
    ps.buf = malloc(ps.cap);
    if (!ps.buf) rc = TD_ENOMEM;
    while (!rc && !ps.done && !ps.cb_rc) {
        if (ps.cap - ps.len < 4096) {
            char *nb = realloc(ps.buf, ps.cap * 2);
            if (!nb) {
                rc = TD_ENOMEM;
                break;
            }
            ps.buf = nb;
            ps.cap *= 2;
        }
        ssize_t r = recv(fd, ps.buf + ps.len, ps.cap - ps.len, 0);
        if (r > 0) {
            ps.len += (size_t)r;
            rc = http_consume(&ps);
        } else if (r == 0) {
            /* closed: complete only if the body was delimited by the close */
            if (!ps.in_body || ps.remaining != -2) rc = TD_EIO;
            break;
        } else if (errno == EAGAIN || errno == EINTR) {
            struct pollfd pf = {.fd = fd, .events = POLLIN};
            int left = (int)(deadline - now_ms());
            if (left <= 0)
                rc = TD_ETIMEDOUT;
            else
                poll(&pf, 1, left);
        } else {
            rc = TD_EIO;
        }
    }
    free(ps.buf);
    close(fd);
    *status = ps.status;
    return rc;
}

int cli_parse_http_url(const char *url, char *host, size_t hcap, int *port, char *path, size_t pcap)
{
    if (strncmp(url, "http://", 7)) return TD_EINVAL;
    const char *h = url + 7, *hend, *rest;
    if (*h == '[') {
        hend = strchr(h, ']');
        if (!hend) return TD_EINVAL;
        h++;
        rest = hend + 1;
    } else {
        hend = h + strcspn(h, ":/");
        rest = hend;
    }
    size_t hl = (size_t)(hend - h);
    if (!hl || hl >= hcap) return TD_EINVAL;
    memcpy(host, h, hl);
    host[hl] = 0;
    *port = 80;
    if (*rest == ':') {
        char *e;
        long p = strtol(rest + 1, &e, 10);
        if (e == rest + 1 || p < 1 || p > 65535) return TD_EINVAL;
        *port = (int)p;
        rest = e;
    }
    if (*rest && *rest != '/') return TD_EINVAL;
    if (strlen(rest) >= pcap) return TD_EINVAL;
    strcpy(path, rest);
    return 0;
}

/* ---- the benchmark ---------------------------------------------------------------- */

typedef struct {
    double t_start, t_first, t_last, t_end; /* ms, monotonic */
    int out_tokens;                         /* from usage, else counted chunks */
    int chunks;                             /* content chunks seen (stream) */
    double *gaps;                           /* (chunks - 1) ms between chunks */
    int n_gaps, cap_gaps;
    bool ok;
} bench_result;

typedef struct {
    char host[256];
    int port;
    char path[512]; /* POST target */
    const char *model;
    int concurrency, requests, prompt_tokens, max_tokens, timeout_ms;
    double temperature;
    bool stream;
    atomic_int next;                 /* next request index to send */
    atomic_int done, errors, tokens; /* finished requests, failures, completion tokens */
    bench_result *res;               /* (requests) */
    pthread_mutex_t err_mu;
    int errs_printed;
} bench;

/* Per-request stream state: the SSE event buffer. */
typedef struct {
    bench *b;
    bench_result *r;
    char *buf; /* (len) bytes not yet forming a whole event / the whole body */
    size_t len, cap;
    char err[256];
    bool got_done;
} req_ctx;

static void bench_error(bench *b, int idx, const char *msg)
{
    pthread_mutex_lock(&b->err_mu);
    if (b->errs_printed < 5) {
        fprintf(stderr, "\ntandem: bench: request %d: %s\n", idx, msg);
        if (++b->errs_printed == 5) fprintf(stderr, "tandem: bench: (further errors not shown)\n");
    }
    pthread_mutex_unlock(&b->err_mu);
}

static int append(req_ctx *c, const char *p, size_t n)
{
    if (c->len + n + 1 > c->cap) {
        size_t nc = c->cap ? c->cap : 4096;
        while (nc < c->len + n + 1)
            nc *= 2;
        char *nb = realloc(c->buf, nc);
        if (!nb) return TD_ENOMEM;
        c->buf = nb;
        c->cap = nc;
    }
    memcpy(c->buf + c->len, p, n);
    c->len += n;
    c->buf[c->len] = 0;
    return 0;
}

/* One JSON object of a response or a stream chunk: records usage, errors and (stream)
 * content chunk times. */
static void take_json(req_ctx *c, const char *text, bool stream)
{
    json_error_t je;
    json_t *o = json_loads(text, JSON_ALLOW_NUL, &je); /* the text may hold U+0000 */
    if (!o || !json_is_object(o)) {
        int k = snprintf(c->err, sizeof c->err,
                         "response is not a JSON object (%.100s): ", o ? "not an object" : je.text);
        if (k > 0 && (size_t)k < sizeof c->err)
            snprintf(c->err + k, sizeof c->err - (size_t)k, "%s", text);
        json_decref(o);
        return;
    }
    json_t *err = json_object_get(o, "error");
    if (err) {
        json_t *m = json_is_object(err) ? json_object_get(err, "message") : NULL;
        snprintf(c->err, sizeof c->err, "error: %s",
                 json_is_string(m) ? json_string_value(m) : "(no message)");
    }
    json_t *usage = json_object_get(o, "usage");
    json_t *ct = json_is_object(usage) ? json_object_get(usage, "completion_tokens") : NULL;
    if (json_is_integer(ct)) c->r->out_tokens = (int)json_integer_value(ct);
    json_t *choices = json_object_get(o, "choices");
    json_t *ch0 = json_is_array(choices) ? json_array_get(choices, 0) : NULL;
    json_t *txt = json_is_object(ch0) ? json_object_get(ch0, "text") : NULL;
    if (stream && json_is_string(txt) && json_string_length(txt) > 0) {
        double t = now_ms();
        bench_result *r = c->r;
        if (!r->chunks) {
            r->t_first = t;
        } else {
            if (r->n_gaps == r->cap_gaps) {
                int nc = r->cap_gaps ? r->cap_gaps * 2 : 64;
                double *ng = realloc(r->gaps, sizeof *ng * (size_t)nc);
                if (ng) {
                    r->gaps = ng;
                    r->cap_gaps = nc;
                }
            }
            if (r->n_gaps < r->cap_gaps) r->gaps[r->n_gaps++] = t - r->t_last;
        }
        r->t_last = t;
        r->chunks++;
    }
    if (!stream && !ch0 && !err)
        snprintf(c->err, sizeof c->err, "response without choices: %.120s", text);
    json_decref(o);
}

/* SSE: events end with a blank line; every "data:" line of an event is one payload. */
static int on_stream_body(void *ctx, const char *data, size_t n)
{
    req_ctx *c = ctx;
    if (append(c, data, n)) return TD_ENOMEM;
    for (;;) {
        char *end = strstr(c->buf, "\n\n");
        char *end_crlf = strstr(c->buf, "\r\n\r\n");
        size_t skip = 2;
        if (end_crlf && (!end || end_crlf < end)) {
            end = end_crlf;
            skip = 4;
        }
        if (!end) break;
        *end = 0;
        for (char *line = c->buf; line && *line;) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = 0;
            size_t ll = strlen(line);
            if (ll && line[ll - 1] == '\r') line[ll - 1] = 0;
            if (!strncmp(line, "data:", 5)) {
                const char *payload = line + 5 + (line[5] == ' ');
                if (!strcmp(payload, "[DONE]"))
                    c->got_done = true;
                else
                    take_json(c, payload, true);
            }
            line = nl ? nl + 1 : NULL;
        }
        size_t used = (size_t)(end - c->buf) + skip;
        memmove(c->buf, c->buf + used, c->len - used + 1);
        c->len -= used;
    }
    return 0;
}

static int on_plain_body(void *ctx, const char *data, size_t n)
{
    return append(ctx, data, n);
}

static char *request_body(const bench *b, int idx)
{
    json_t *ids = json_array();
    uint32_t x = 2463534242u ^ (uint32_t)(idx * 2654435761u);
    for (int i = 0; i < b->prompt_tokens; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        json_array_append_new(ids, json_integer(100 + x % 400));
    }
    json_t *o = json_object();
    if (b->model) json_object_set_new(o, "model", json_string(b->model));
    json_object_set_new(o, "prompt", ids);
    json_object_set_new(o, "max_tokens", json_integer(b->max_tokens));
    json_object_set_new(o, "temperature", json_real(b->temperature));
    json_object_set_new(o, "seed", json_integer(idx + 1));
    if (b->stream) {
        json_object_set_new(o, "stream", json_true());
        json_object_set_new(o, "stream_options", json_pack("{s:b}", "include_usage", 1));
    }
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

static void run_one(bench *b, int idx)
{
    bench_result *r = &b->res[idx];
    req_ctx c = {.b = b, .r = r};
    char *body = request_body(b, idx);
    cli_http_req rq = {.host = b->host,
                       .port = b->port,
                       .method = "POST",
                       .path = b->path,
                       .body = body,
                       .timeout_ms = b->timeout_ms,
                       .on_body = b->stream ? on_stream_body : on_plain_body,
                       .ctx = &c};
    int status = 0;
    r->t_start = now_ms();
    int rc = body ? cli_http_request(&rq, &status) : TD_ENOMEM;
    r->t_end = now_ms();
    if (!rc && !b->stream && c.buf && status == 200) take_json(&c, c.buf, false);
    if (rc)
        snprintf(c.err, sizeof c.err, "http: %s", td_strerror(rc));
    else if (status != 200 && !c.err[0])
        snprintf(c.err, sizeof c.err, "status %d: %.160s", status, c.buf ? c.buf : "");
    else if (status != 200)
        snprintf(c.err + strlen(c.err), sizeof c.err - strlen(c.err), " (status %d)", status);
    else if (b->stream && !c.got_done && !c.err[0])
        snprintf(c.err, sizeof c.err, "stream ended without [DONE]");
    if (b->stream && !r->out_tokens) r->out_tokens = r->chunks;
    r->ok = !c.err[0];
    if (r->ok) {
        atomic_fetch_add(&b->tokens, r->out_tokens);
    } else {
        atomic_fetch_add(&b->errors, 1);
        bench_error(b, idx, c.err);
    }
    atomic_fetch_add(&b->done, 1);
    free(c.buf);
    free(body);
}

static void *worker(void *arg)
{
    bench *b = arg;
    for (;;) {
        int idx = atomic_fetch_add(&b->next, 1);
        if (idx >= b->requests) break;
        run_one(b, idx);
    }
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Percentile with linear interpolation (numpy's default); v sorted, n >= 1. */
static double pct(const double *v, int n, double q)
{
    double pos = q / 100.0 * (n - 1);
    int lo = (int)floor(pos), hi = lo + 1 < n ? lo + 1 : lo;
    return v[lo] + (v[hi] - v[lo]) * (pos - lo);
}

typedef struct {
    const char *name;
    double *v;
    int n;
} series;

static void put_series(json_t *o, const series *s)
{
    static const double qs[] = {50, 90, 99};
    static const char *qn[] = {"p50", "p90", "p99"};
    char key[64];
    for (int i = 0; i < 3; i++) {
        snprintf(key, sizeof key, "%s_ms_%s", s->name, qn[i]);
        json_object_set_new(o, key, s->n ? json_real(pct(s->v, s->n, qs[i])) : json_null());
    }
    double sum = 0;
    for (int i = 0; i < s->n; i++)
        sum += s->v[i];
    snprintf(key, sizeof key, "%s_ms_mean", s->name);
    json_object_set_new(o, key, s->n ? json_real(sum / s->n) : json_null());
}

/* GET /v1/models: the first model's id (malloc'd) or NULL. */
static char *first_model(const bench *b)
{
    req_ctx c = {0};
    char path[600];
    size_t pl = strlen(b->path) - strlen("/completions");
    snprintf(path, sizeof path, "%.*s/models", (int)pl, b->path);
    cli_http_req rq = {.host = b->host,
                       .port = b->port,
                       .method = "GET",
                       .path = path,
                       .timeout_ms = 10000,
                       .on_body = on_plain_body,
                       .ctx = &c};
    int status;
    char *id = NULL;
    if (!cli_http_request(&rq, &status) && status == 200 && c.buf) {
        json_error_t je;
        json_t *o = json_loads(c.buf, 0, &je);
        json_t *d = json_is_object(o) ? json_object_get(o, "data") : NULL;
        json_t *m = json_is_array(d) ? json_array_get(d, 0) : NULL;
        json_t *s = json_is_object(m) ? json_object_get(m, "id") : NULL;
        if (json_is_string(s)) id = strdup(json_string_value(s));
        json_decref(o);
    }
    free(c.buf);
    return id;
}

static void usage_bench(void)
{
    fprintf(stderr,
            "usage: tandem bench --url URL [--concurrency C] [--requests N] [--prompt-tokens P]\n"
            "                    [--max-tokens M] [--stream] [--json] [--model NAME]\n"
            "                    [--temperature T] [--timeout-ms MS]\n"
            "  URL: http://HOST:PORT of the router (POST /v1/completions)\n"
            "  defaults: C 1, N 16, P 32, M 32, T 0 (greedy), timeout 300000 per request\n");
}

int cmd_bench(int argc, char **argv)
{
    bench b = {.concurrency = 1,
               .requests = 16,
               .prompt_tokens = 32,
               .max_tokens = 32,
               .timeout_ms = 300000};
    const char *url = NULL;
    bool as_json = false;
    char *model_owned = NULL;
    for (int i = 0; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
            usage_bench();
            return 0;
        } else if (!strcmp(f, "--stream")) {
            b.stream = true;
            continue;
        } else if (!strcmp(f, "--json")) {
            as_json = true;
            continue;
        } else if (!v) {
            fprintf(stderr, "tandem: %s needs a value\n", f);
            return TD_EINVAL;
        } else if (!strcmp(f, "--url"))
            url = v;
        else if (!strcmp(f, "--model"))
            b.model = v;
        else if (!strcmp(f, "--concurrency"))
            rc = cli_parse_int(f, v, 1, 4096, &b.concurrency);
        else if (!strcmp(f, "--requests"))
            rc = cli_parse_int(f, v, 1, 1000000, &b.requests);
        else if (!strcmp(f, "--prompt-tokens"))
            rc = cli_parse_int(f, v, 1, 1 << 20, &b.prompt_tokens);
        else if (!strcmp(f, "--max-tokens"))
            rc = cli_parse_int(f, v, 1, 1 << 20, &b.max_tokens);
        else if (!strcmp(f, "--timeout-ms"))
            rc = cli_parse_int(f, v, 1, 86400000, &b.timeout_ms);
        else if (!strcmp(f, "--temperature")) {
            float t;
            rc = cli_parse_float(f, v, &t);
            b.temperature = t;
        } else {
            fprintf(stderr, "tandem: unknown option '%s'\n", f);
            usage_bench();
            return TD_EINVAL;
        }
        if (rc) return rc;
        i++;
    }
    char path[512];
    if (!url || cli_parse_http_url(url, b.host, sizeof b.host, &b.port, path, sizeof path)) {
        fprintf(stderr, "tandem: bench needs --url http://HOST:PORT%s%s\n", url ? ", got " : "",
                url ? url : "");
        return TD_EINVAL;
    }
    size_t pl = strlen(path);
    while (pl && path[pl - 1] == '/')
        path[--pl] = 0;
    if (pl >= 3 && !strcmp(path + pl - 3, "/v1"))
        snprintf(b.path, sizeof b.path, "%s/completions", path);
    else
        snprintf(b.path, sizeof b.path, "%s/v1/completions", path);
    if (!b.model) b.model = model_owned = first_model(&b);
    if (b.concurrency > b.requests) b.concurrency = b.requests;
    b.res = calloc((size_t)b.requests, sizeof *b.res);
    pthread_t *th = calloc((size_t)b.concurrency, sizeof *th);
    if (!b.res || !th) {
        free(b.res);
        free(th);
        free(model_owned);
        fprintf(stderr, "tandem: out of memory\n");
        return TD_ENOMEM;
    }
    pthread_mutex_init(&b.err_mu, NULL);
    fprintf(stderr,
            "bench: %d requests, concurrency %d, prompt %d tokens, max %d tokens%s, "
            "model %s, %s:%d%s\n",
            b.requests, b.concurrency, b.prompt_tokens, b.max_tokens, b.stream ? ", stream" : "",
            b.model ? b.model : "(none)", b.host, b.port, b.path);
    double t0 = now_ms();
    int started = 0, rc = 0;
    for (; started < b.concurrency; started++) {
        if (pthread_create(&th[started], NULL, worker, &b)) {
            fprintf(stderr, "tandem: cannot start thread %d\n", started);
            break;
        }
    }
    if (!started) {
        /* nothing can run: count everything as failed */
        atomic_store(&b.errors, b.requests);
        atomic_store(&b.done, b.requests);
        rc = TD_ENOMEM;
    }
    bool tty = isatty(2);
    double last_print = t0;
    while (atomic_load(&b.done) < b.requests) {
        usleep(100 * 1000);
        double t = now_ms();
        if (t - last_print >= (tty ? 1000 : 5000)) {
            last_print = t;
            fprintf(stderr, "%sbench: %d/%d done, %d errors, %.1f output tokens/s, %.0f s%s",
                    tty ? "\r" : "", atomic_load(&b.done), b.requests, atomic_load(&b.errors),
                    atomic_load(&b.tokens) / ((t - t0) / 1e3), (t - t0) / 1e3, tty ? "" : "\n");
        }
    }
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    double dur_s = (now_ms() - t0) / 1e3;
    if (tty) fprintf(stderr, "\n");

    /* Collect the series over successful requests. */
    int n_ok = 0, n_gaps = 0;
    long long out_tokens = 0;
    for (int i = 0; i < b.requests; i++)
        if (b.res[i].ok) n_gaps += b.res[i].n_gaps;
    double *ttft = calloc((size_t)b.requests + 1, sizeof(double));
    double *tpot = calloc((size_t)b.requests + 1, sizeof(double));
    double *e2e = calloc((size_t)b.requests + 1, sizeof(double));
    double *itl = calloc((size_t)n_gaps + 1, sizeof(double));
    int n_ttft = 0, n_tpot = 0, n_itl = 0;
    if (ttft && tpot && e2e && itl) {
        for (int i = 0; i < b.requests; i++) {
            bench_result *r = &b.res[i];
            if (!r->ok) continue;
            n_ok++;
            out_tokens += r->out_tokens;
            e2e[n_ok - 1] = r->t_end - r->t_start;
            if (b.stream && r->chunks) {
                ttft[n_ttft++] = r->t_first - r->t_start;
                if (r->out_tokens > 1)
                    tpot[n_tpot++] = (r->t_last - r->t_first) / (r->out_tokens - 1);
            }
            for (int k = 0; k < r->n_gaps; k++)
                itl[n_itl++] = r->gaps[k];
        }
    } else {
        rc = TD_ENOMEM;
    }
    series ss[] = {
        {"ttft", ttft, n_ttft}, {"tpot", tpot, n_tpot}, {"itl", itl, n_itl}, {"e2el", e2e, n_ok}};
    for (size_t i = 0; i < sizeof ss / sizeof ss[0]; i++)
        if (ss[i].v) qsort(ss[i].v, (size_t)ss[i].n, sizeof(double), cmp_double);
    int errors = atomic_load(&b.errors);
    json_t *o = json_object();
    json_object_set_new(o, "url", json_string(url));
    json_object_set_new(o, "model", b.model ? json_string(b.model) : json_null());
    json_object_set_new(o, "stream", json_boolean(b.stream));
    json_object_set_new(o, "concurrency", json_integer(b.concurrency));
    json_object_set_new(o, "requests", json_integer(b.requests));
    json_object_set_new(o, "completed", json_integer(n_ok));
    json_object_set_new(o, "errors", json_integer(errors));
    json_object_set_new(o, "prompt_tokens", json_integer(b.prompt_tokens));
    json_object_set_new(o, "max_tokens", json_integer(b.max_tokens));
    json_object_set_new(o, "duration_s", json_real(dur_s));
    json_object_set_new(o, "total_output_tokens", json_integer(out_tokens));
    json_object_set_new(o, "requests_per_s", json_real(n_ok / dur_s));
    json_object_set_new(o, "output_tokens_per_s", json_real((double)out_tokens / dur_s));
    json_object_set_new(o, "total_tokens_per_s",
                        json_real(((double)out_tokens + (double)n_ok * b.prompt_tokens) / dur_s));
    for (size_t i = 0; i < sizeof ss / sizeof ss[0]; i++)
        if (ss[i].v) put_series(o, &ss[i]);
    if (as_json) {
        char *s = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(6));
        if (s) printf("%s\n", s);
        free(s);
    } else {
        printf("requests            %d (%d ok, %d errors) in %.2f s\n", b.requests, n_ok, errors,
               dur_s);
        printf("request throughput  %.3f req/s\n", n_ok / dur_s);
        printf("output throughput   %.1f tokens/s (%lld tokens)\n", (double)out_tokens / dur_s,
               out_tokens);
        printf("%-20s %10s %10s %10s %10s\n", "latency (ms)", "mean", "p50", "p90", "p99");
        static const char *labels[] = {"time to first token", "time per output tok",
                                       "inter-token latency", "end-to-end"};
        for (size_t i = 0; i < sizeof ss / sizeof ss[0]; i++) {
            if (!ss[i].v || !ss[i].n) {
                printf("%-20s %10s\n", labels[i], b.stream ? "-" : "- (needs --stream)");
                continue;
            }
            double sum = 0;
            for (int k = 0; k < ss[i].n; k++)
                sum += ss[i].v[k];
            printf("%-20s %10.2f %10.2f %10.2f %10.2f\n", labels[i], sum / ss[i].n,
                   pct(ss[i].v, ss[i].n, 50), pct(ss[i].v, ss[i].n, 90), pct(ss[i].v, ss[i].n, 99));
        }
    }
    fflush(stdout);
    json_decref(o);
    for (int i = 0; i < b.requests; i++)
        free(b.res[i].gaps);
    free(ttft);
    free(tpot);
    free(e2e);
    free(itl);
    free(b.res);
    free(th);
    free(model_owned);
    pthread_mutex_destroy(&b.err_mu);
    if (rc) return rc;
    return errors ? TD_EIO : 0;
}
