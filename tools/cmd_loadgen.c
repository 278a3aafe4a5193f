/* cmd_loadgen.c: `tandem bench`: a load generator for the OpenAI HTTP API.
 *
 *   tandem bench --url URL --concurrency C --requests N --prompt-tokens P --max-tokens M
 *                [--stream] [--json] [--model NAME] [--temperature T] [--timeout-ms MS]
 *                [--prompt-seed S] [--ignore-eos] [--cacert FILE] [--cert FILE --key FILE]
 *                [--api-key KEY]
 *
 * URL is http:// or https:// (a TLS router: the server checked against --cacert, else
 * $CURL_CA_BUNDLE, else the system's CAs; --cert/--key for a router with tls_client_ca).
 * C threads, each a blocking client on its own connection, send N POST /v1/completions in
 * all; the prompt is an array of P token ids (pseudo-random in [100, 500), valid for the
 * default and the synthetic models), a function of the request's index and --prompt-seed
 * only: a run with the seed of an earlier run repeats its prompts (what a prefix cache
 * serves), a new seed gives fresh ones. --ignore-eos asks the server to generate all M
 * tokens (vLLM's and llama-server's `ignore_eos`), so that two servers are compared on the
 * same amount of output. The model name is asked from GET /v1/models unless
 * --model is given. The report follows the established serving benchmarks: requests/s,
 * output tokens/s (completion tokens from `usage`), and with --stream time to first token
 * (TTFT), time per output token after the first (TPOT = (last - first) / (tokens - 1)) and
 * inter-token latency (ITL: every gap between two content chunks), p50/p90/p99 in ms, plus
 * end-to-end latency. Without --stream, TTFT/TPOT/ITL cannot be observed: their JSON values
 * are null. Progress goes to stderr once a second. Exit status 0 when every request
 * succeeded, 1 otherwise (the summary is printed either way).
 *
 * HTTP: http_client.h (libcurl), one client handle per thread; the body of a streamed
 * response reaches on_stream_body as its bytes arrive, so every event is timed when it is
 * received.
 */
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "http_client.h"
#include "td_clock.h"
#include "td_err.h"
#include "td_stats.h"
#include "td_grow.h"

static double now_ms(void)
{
    return (double)td_now_ns() / 1e6;
}

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
    char path[512];                  /* POST target */
    bool tls;                        /* https:// URL */
    const char *cacert, *cert, *key; /* --cacert, --cert, --key (https), or NULL */
    const char *api_key;             /* --api-key, else $OPENAI_API_KEY, or NULL */
    const char *model;
    int concurrency, requests, prompt_tokens, max_tokens, timeout_ms;
    double temperature;
    bool stream, ignore_eos;
    uint32_t prompt_seed;
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
            (void)TD_GROW_INT(r->gaps, r->cap_gaps, r->n_gaps + 1, 64); /* else: gap lost */
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
    uint32_t x = 2463534242u ^ (uint32_t)(idx * 2654435761u) ^ (b->prompt_seed * 0x9e3779b9u);
    if (!x) x = 1; /* xorshift's one fixed point */
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
    if (b->ignore_eos) json_object_set_new(o, "ignore_eos", json_true());
    if (b->stream) {
        json_object_set_new(o, "stream", json_true());
        json_object_set_new(o, "stream_options", json_pack("{s:b}", "include_usage", 1));
    }
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

static void run_one(bench *b, cli_http *h, int idx)
{
    bench_result *r = &b->res[idx];
    req_ctx c = {.b = b, .r = r};
    char *body = request_body(b, idx);
    char why[200];
    cli_http_req rq = {.host = b->host,
                       .port = b->port,
                       .method = "POST",
                       .path = b->path,
                       .body = body,
                       .timeout_ms = b->timeout_ms,
                       .tls = b->tls,
                       .cacert = b->cacert,
                       .cert = b->cert,
                       .key = b->key,
                       .bearer = b->api_key,
                       .on_body = b->stream ? on_stream_body : on_plain_body,
                       .ctx = &c,
                       .err = why,
                       .err_cap = sizeof why};
    int status = 0;
    r->t_start = now_ms();
    int rc = body ? cli_http_request(h, &rq, &status) : TD_ENOMEM;
    r->t_end = now_ms();
    if (!rc && !b->stream && c.buf && status == 200) take_json(&c, c.buf, false);
    if (rc && body)
        snprintf(c.err, sizeof c.err, "http: %s (%s)", td_strerror(rc), why);
    else if (rc)
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

/* One client thread: takes the next request index until none is left; its own HTTP
 * handle (NULL if none could be made: then one per request). */
static void *worker(void *arg)
{
    bench *b = arg;
    cli_http *h = NULL;
    cli_http_create(&h);
    for (;;) {
        int idx = atomic_fetch_add(&b->next, 1);
        if (idx >= b->requests) break;
        run_one(b, h, idx);
    }
    cli_http_destroy(h);
    return NULL;
}

/* One latency series of the report, sorted ascending. */
typedef struct {
    const char *name;
    double *v; /* (n) ms */
    int n;
} series;

enum { S_TTFT, S_TPOT, S_ITL, S_E2EL, N_SERIES };

static double series_mean(const series *s)
{
    double sum = 0;
    for (int i = 0; i < s->n; i++)
        sum += s->v[i];
    return sum / s->n;
}

static void put_series(json_t *o, const series *s)
{
    static const double qs[] = {50, 90, 99};
    static const char *qn[] = {"p50", "p90", "p99"};
    char key[64];
    for (int i = 0; i < 3; i++) {
        snprintf(key, sizeof key, "%s_ms_%s", s->name, qn[i]);
        json_object_set_new(o, key,
                            s->n ? json_real(td_stats_percentile_sorted(s->v, (size_t)s->n, qs[i]))
                                 : json_null());
    }
    snprintf(key, sizeof key, "%s_ms_mean", s->name);
    json_object_set_new(o, key, s->n ? json_real(series_mean(s)) : json_null());
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
                       .tls = b->tls,
                       .cacert = b->cacert,
                       .cert = b->cert,
                       .key = b->key,
                       .bearer = b->api_key,
                       .on_body = on_plain_body,
                       .ctx = &c};
    int status;
    char *id = NULL;
    if (!cli_http_request(NULL, &rq, &status) && status == 200 && c.buf) {
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
            "                    [--temperature T] [--timeout-ms MS] [--prompt-seed S]\n"
            "                    [--ignore-eos] [--cacert FILE] [--cert FILE --key FILE]\n"
            "                    [--api-key KEY]\n"
            "  URL: http://HOST:PORT or https://HOST:PORT of the router (POST /v1/completions)\n"
            "  https: the server is verified against --cacert FILE (PEM), else $CURL_CA_BUNDLE,\n"
            "  else the system's CAs; --cert/--key: a client certificate (router.tls_client_ca)\n"
            "  --api-key: sent as Authorization: Bearer KEY (router.api_key), else\n"
            "  $OPENAI_API_KEY when set\n"
            "  defaults: C 1, N 16, P 32, M 32, T 0 (greedy), timeout 300000 per request,\n"
            "  S 0 (prompts depend on the request index and S only)\n");
}

/* The command line into b, *url and *as_json. Returns 0, 1 (--help: done) or a negative
 * td_err (printed). */
static int bench_parse_args(int argc, char **argv, bench *b, const char **url, bool *as_json)
{
    for (int i = 0; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
            usage_bench();
            return 1;
        } else if (!strcmp(f, "--stream")) {
            b->stream = true;
            continue;
        } else if (!strcmp(f, "--json")) {
            *as_json = true;
            continue;
        } else if (!strcmp(f, "--ignore-eos")) {
            b->ignore_eos = true;
            continue;
        } else if (!v) {
            fprintf(stderr, "tandem: %s needs a value\n", f);
            return TD_EINVAL;
        } else if (!strcmp(f, "--url"))
            *url = v;
        else if (!strcmp(f, "--model"))
            b->model = v;
        else if (!strcmp(f, "--cacert"))
            b->cacert = v;
        else if (!strcmp(f, "--cert"))
            b->cert = v;
        else if (!strcmp(f, "--key"))
            b->key = v;
        else if (!strcmp(f, "--api-key"))
            b->api_key = v;
        else if (!strcmp(f, "--concurrency"))
            rc = cli_parse_int(f, v, 1, 4096, &b->concurrency);
        else if (!strcmp(f, "--requests"))
            rc = cli_parse_int(f, v, 1, 1000000, &b->requests);
        else if (!strcmp(f, "--prompt-tokens"))
            rc = cli_parse_int(f, v, 1, 1 << 20, &b->prompt_tokens);
        else if (!strcmp(f, "--max-tokens"))
            rc = cli_parse_int(f, v, 1, 1 << 20, &b->max_tokens);
        else if (!strcmp(f, "--prompt-seed")) {
            int seed;
            rc = cli_parse_int(f, v, 0, 1 << 30, &seed);
            b->prompt_seed = (uint32_t)seed;
        } else if (!strcmp(f, "--timeout-ms"))
            rc = cli_parse_int(f, v, 1, 86400000, &b->timeout_ms);
        else if (!strcmp(f, "--temperature")) {
            float t;
            rc = cli_parse_float(f, v, &t);
            b->temperature = t;
        } else {
            fprintf(stderr, "tandem: unknown option '%s'\n", f);
            usage_bench();
            return TD_EINVAL;
        }
        if (rc) return rc;
        i++;
    }
    return 0;
}

/* --url into b's host, port and POST target (.../v1/completions). Prints its error. */
static int bench_target(bench *b, const char *url)
{
    char path[512];
    if (!url ||
        cli_parse_http_url(url, b->host, sizeof b->host, &b->port, path, sizeof path, &b->tls)) {
        fprintf(stderr, "tandem: bench needs --url http://HOST:PORT (or https://)%s%s\n",
                url ? ", got " : "", url ? url : "");
        return TD_EINVAL;
    }
    if (!b->tls && (b->cacert || b->cert || b->key)) {
        fprintf(stderr, "tandem: --cacert, --cert and --key are for an https:// URL\n");
        return TD_EINVAL;
    }
    if (!b->cert != !b->key) {
        fprintf(stderr, "tandem: --cert and --key go together\n");
        return TD_EINVAL;
    }
    size_t pl = strlen(path);
    while (pl && path[pl - 1] == '/')
        path[--pl] = 0;
    if (pl >= 3 && !strcmp(path + pl - 3, "/v1"))
        snprintf(b->path, sizeof b->path, "%s/completions", path);
    else
        snprintf(b->path, sizeof b->path, "%s/v1/completions", path);
    return 0;
}

/* Runs every request on b->concurrency threads, printing progress to stderr, and sets
 * *dur_s to the wall time of the whole run. Returns 0, or TD_ENOMEM when no thread started
 * (then every request counts as failed). */
static int bench_run(bench *b, pthread_t *th, double *dur_s)
{
    double t0 = now_ms();
    int started = 0, rc = 0;
    for (; started < b->concurrency; started++) {
        if (pthread_create(&th[started], NULL, worker, b)) {
            fprintf(stderr, "tandem: cannot start thread %d\n", started);
            break;
        }
    }
    if (!started) {
        /* nothing can run: count everything as failed */
        atomic_store(&b->errors, b->requests);
        atomic_store(&b->done, b->requests);
        rc = TD_ENOMEM;
    }
    bool tty = isatty(2);
    double last_print = t0;
    while (atomic_load(&b->done) < b->requests) {
        usleep(100 * 1000);
        double t = now_ms();
        if (t - last_print >= (tty ? 1000 : 5000)) {
            last_print = t;
            fprintf(stderr, "%sbench: %d/%d done, %d errors, %.1f output tokens/s, %.0f s%s",
                    tty ? "\r" : "", atomic_load(&b->done), b->requests, atomic_load(&b->errors),
                    atomic_load(&b->tokens) / ((t - t0) / 1e3), (t - t0) / 1e3, tty ? "" : "\n");
        }
    }
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    *dur_s = (now_ms() - t0) / 1e3;
    if (tty) fprintf(stderr, "\n");
    return rc;
}

/* The series over the successful requests, each sorted (ss[k].v malloc'd; the caller frees
 * them), their count and output tokens. Returns 0 or TD_ENOMEM. */
static int bench_collect(const bench *b, series ss[N_SERIES], int *n_ok, long long *out_tokens)
{
    static const char *names[N_SERIES] = {"ttft", "tpot", "itl", "e2el"};
    int n_gaps = 0;
    *n_ok = 0;
    *out_tokens = 0;
    for (int i = 0; i < b->requests; i++)
        if (b->res[i].ok) n_gaps += b->res[i].n_gaps;
    for (int k = 0; k < N_SERIES; k++) {
        ss[k] = (series){.name = names[k]};
        ss[k].v = calloc((size_t)(k == S_ITL ? n_gaps : b->requests) + 1, sizeof(double));
    }
    for (int k = 0; k < N_SERIES; k++)
        if (!ss[k].v) return TD_ENOMEM;
    for (int i = 0; i < b->requests; i++) {
        const bench_result *r = &b->res[i];
        if (!r->ok) continue;
        (*n_ok)++;
        *out_tokens += r->out_tokens;
        ss[S_E2EL].v[ss[S_E2EL].n++] = r->t_end - r->t_start;
        if (b->stream && r->chunks) {
            ss[S_TTFT].v[ss[S_TTFT].n++] = r->t_first - r->t_start;
            if (r->out_tokens > 1)
                ss[S_TPOT].v[ss[S_TPOT].n++] = (r->t_last - r->t_first) / (r->out_tokens - 1);
        }
        for (int k = 0; k < r->n_gaps; k++)
            ss[S_ITL].v[ss[S_ITL].n++] = r->gaps[k];
    }
    for (int k = 0; k < N_SERIES; k++)
        td_stats_sort(ss[k].v, (size_t)ss[k].n);
    return 0;
}

/* The summary: one JSON object (--json) or the table. */
static void bench_report(const bench *b, const char *url, bool as_json, double dur_s,
                         const series ss[N_SERIES], int n_ok, long long out_tokens)
{
    int errors = atomic_load(&b->errors);
    json_t *o = json_object();
    json_object_set_new(o, "url", json_string(url));
    json_object_set_new(o, "model", b->model ? json_string(b->model) : json_null());
    json_object_set_new(o, "stream", json_boolean(b->stream));
    json_object_set_new(o, "concurrency", json_integer(b->concurrency));
    json_object_set_new(o, "requests", json_integer(b->requests));
    json_object_set_new(o, "completed", json_integer(n_ok));
    json_object_set_new(o, "errors", json_integer(errors));
    json_object_set_new(o, "prompt_tokens", json_integer(b->prompt_tokens));
    json_object_set_new(o, "max_tokens", json_integer(b->max_tokens));
    json_object_set_new(o, "duration_s", json_real(dur_s));
    json_object_set_new(o, "total_output_tokens", json_integer(out_tokens));
    json_object_set_new(o, "requests_per_s", json_real(n_ok / dur_s));
    json_object_set_new(o, "output_tokens_per_s", json_real((double)out_tokens / dur_s));
    json_object_set_new(o, "total_tokens_per_s",
                        json_real(((double)out_tokens + (double)n_ok * b->prompt_tokens) / dur_s));
    for (int i = 0; i < N_SERIES; i++)
        if (ss[i].v) put_series(o, &ss[i]);
    if (as_json) {
        char *s = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(6));
        if (s) printf("%s\n", s);
        free(s);
    } else {
        printf("requests            %d (%d ok, %d errors) in %.2f s\n", b->requests, n_ok, errors,
               dur_s);
        printf("request throughput  %.3f req/s\n", n_ok / dur_s);
        printf("output throughput   %.1f tokens/s (%lld tokens)\n", (double)out_tokens / dur_s,
               out_tokens);
        printf("%-20s %10s %10s %10s %10s\n", "latency (ms)", "mean", "p50", "p90", "p99");
        static const char *labels[] = {"time to first token", "time per output tok",
                                       "inter-token latency", "end-to-end"};
        for (int i = 0; i < N_SERIES; i++) {
            const series *s = &ss[i];
            if (!s->v || !s->n) {
                printf("%-20s %10s\n", labels[i], b->stream ? "-" : "- (needs --stream)");
                continue;
            }
            printf("%-20s %10.2f %10.2f %10.2f %10.2f\n", labels[i], series_mean(s),
                   td_stats_percentile_sorted(s->v, (size_t)s->n, 50),
                   td_stats_percentile_sorted(s->v, (size_t)s->n, 90),
                   td_stats_percentile_sorted(s->v, (size_t)s->n, 99));
        }
    }
    fflush(stdout);
    json_decref(o);
}

int cmd_bench(int argc, char **argv)
{
    bench b = {.concurrency = 1,
               .requests = 16,
               .prompt_tokens = 32,
               .max_tokens = 32,
               .timeout_ms = 300000,
               .api_key = getenv("OPENAI_API_KEY")};
    const char *url = NULL;
    bool as_json = false;
    int rc = bench_parse_args(argc, argv, &b, &url, &as_json);
    if (rc) return rc > 0 ? 0 : rc;
    if ((rc = bench_target(&b, url))) return rc;
    char *model_owned = NULL;
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
    double dur_s = 0;
    rc = bench_run(&b, th, &dur_s);
    series ss[N_SERIES];
    int n_ok = 0;
    long long out_tokens = 0;
    int crc = bench_collect(&b, ss, &n_ok, &out_tokens);
    if (crc) rc = crc;
    bench_report(&b, url, as_json, dur_s, ss, n_ok, out_tokens);
    int errors = atomic_load(&b.errors);
    for (int k = 0; k < N_SERIES; k++)
        free(ss[k].v);
    for (int i = 0; i < b.requests; i++)
        free(b.res[i].gaps);
    free(b.res);
    free(th);
    free(model_owned);
    pthread_mutex_destroy(&b.err_mu);
    if (rc) return rc;
    return errors ? TD_EIO : 0;
}
