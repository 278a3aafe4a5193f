/* http_client.c: the tools' blocking HTTP client on libcurl (see http_client.h). */
#include "http_client.h"

#include <curl/curl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"

struct cli_http {
    CURL *curl;
};

/* What the write callback needs: the caller's request and whether it asked to stop. */
typedef struct {
    const cli_http_req *rq;
    int cb_rc; /* the first nonzero on_body return */
} http_call;

int cli_http_global_init(void)
{
    return curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK ? 0 : TD_EIO;
}

void cli_http_global_fini(void)
{
    curl_global_cleanup();
}

int cli_http_create(cli_http **out)
{
    *out = NULL;
    cli_http *h = calloc(1, sizeof *h);
    if (!h || !(h->curl = curl_easy_init())) {
        free(h);
        return TD_ENOMEM;
    }
    *out = h;
    return 0;
}

void cli_http_destroy(cli_http *h)
{
    if (!h) return;
    curl_easy_cleanup(h->curl);
    free(h);
}

/* libcurl calls this as the bytes of the body arrive (de-chunked); returning less than
 * n ends the transfer with CURLE_WRITE_ERROR, which cli_http_request reads as "stopped". */
static size_t on_write(char *data, size_t size, size_t nmemb, void *ctx)
{
    http_call *call = ctx;
    size_t n = size * nmemb;
    if (call->cb_rc) return 0;
    if (n && call->rq->on_body) call->cb_rc = call->rq->on_body(call->rq->ctx, data, n);
    return call->cb_rc ? 0 : n;
}

static int map_curl_error(CURLcode c)
{
    switch (c) {
    case CURLE_OPERATION_TIMEDOUT:
        return TD_ETIMEDOUT;
    case CURLE_OUT_OF_MEMORY:
        return TD_ENOMEM;
    case CURLE_URL_MALFORMAT:
    case CURLE_UNSUPPORTED_PROTOCOL:
    case CURLE_BAD_FUNCTION_ARGUMENT:
        return TD_EINVAL;
    case CURLE_WEIRD_SERVER_REPLY:
        return TD_EFORMAT;
    default: /* resolve, connect, send, receive, a body cut short */
        return TD_EIO;
    }
}

/* https: whom to trust (the request's CA file, else $CURL_CA_BUNDLE as the curl tool reads
 * it, else libcurl's default, the system's CAs), the client certificate, or no check. */
static void set_tls(CURL *c, const cli_http_req *rq)
{
    const char *ca = rq->cacert ? rq->cacert : getenv("CURL_CA_BUNDLE");
    if (ca && *ca) curl_easy_setopt(c, CURLOPT_CAINFO, ca);
    if (rq->cert) curl_easy_setopt(c, CURLOPT_SSLCERT, rq->cert);
    if (rq->key) curl_easy_setopt(c, CURLOPT_SSLKEY, rq->key);
    if (rq->insecure) {
        curl_easy_setopt(c, CURLOPT_SSL_VERIFYPEER, 0L);
        curl_easy_setopt(c, CURLOPT_SSL_VERIFYHOST, 0L);
    }
}

/* Sets up h for rq: URL, method, body, headers (*hdrs: the caller frees them). */
static int prepare(CURL *c, const cli_http_req *rq, http_call *call, struct curl_slist **hdrs,
                   char *errbuf)
{
    char url[1024];
    bool v6 = strchr(rq->host, ':') != NULL;
    if (snprintf(url, sizeof url, "%s://%s%s%s:%d%s", rq->tls ? "https" : "http", v6 ? "[" : "",
                 rq->host, v6 ? "]" : "", rq->port, rq->path) >= (int)sizeof url)
        return TD_EINVAL;
    bool post = !strcmp(rq->method, "POST");
    if (!post && strcmp(rq->method, "GET")) return TD_EINVAL;
    /* the exchange the hand-written client had: one connection per request, closed after
     * it; no "Expect: 100-continue" pause before a large body; no proxy from the environment */
    struct curl_slist *h = curl_slist_append(NULL, "Connection: close");
    if (h && rq->body) h = curl_slist_append(h, "Content-Type: application/json");
    if (h) h = curl_slist_append(h, "Expect:");
    if (h && rq->bearer && *rq->bearer) {
        char auth[600];
        if (snprintf(auth, sizeof auth, "Authorization: Bearer %s", rq->bearer) >=
            (int)sizeof auth) {
            curl_slist_free_all(h);
            return TD_EINVAL;
        }
        h = curl_slist_append(h, auth); /* libcurl copies it */
    }
    if (!h) return TD_ENOMEM;
    *hdrs = h;
    curl_easy_setopt(c, CURLOPT_URL, url); /* libcurl copies it */
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_USERAGENT, "tandem");
    curl_easy_setopt(c, CURLOPT_PROXY, "");
    curl_easy_setopt(c, CURLOPT_FORBID_REUSE, 1L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L); /* threads: no SIGALRM for DNS timeouts */
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)(rq->timeout_ms > 0 ? rq->timeout_ms : 30000));
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, call);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, errbuf);
    if (rq->tls) set_tls(c, rq);
    if (post) {
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, rq->body ? rq->body : "");
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE,
                         (curl_off_t)(rq->body ? strlen(rq->body) : 0));
    } else {
        curl_easy_setopt(c, CURLOPT_HTTPGET, 1L);
    }
    return 0;
}

int cli_http_request(cli_http *h, const cli_http_req *rq, int *status)
{
    *status = 0;
    if (rq->err && rq->err_cap) rq->err[0] = 0;
    cli_http *own = NULL;
    if (!h) {
        int rc = cli_http_create(&own);
        if (rc) return rc;
        h = own;
    }
    CURL *c = h->curl;
    curl_easy_reset(c);
    http_call call = {.rq = rq};
    struct curl_slist *hdrs = NULL;
    char errbuf[CURL_ERROR_SIZE] = "";
    int rc = prepare(c, rq, &call, &hdrs, errbuf);
    CURLcode cc = CURLE_OK;
    if (!rc) cc = curl_easy_perform(c);
    long code = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    *status = (int)code;
    if (!rc && cc != CURLE_OK && !(cc == CURLE_WRITE_ERROR && call.cb_rc)) {
        rc = map_curl_error(cc);
        if (rq->err && rq->err_cap)
            snprintf(rq->err, rq->err_cap, "%s", errbuf[0] ? errbuf : curl_easy_strerror(cc));
    }
    /* the handle must not keep pointers into this call's stack */
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, NULL);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, NULL);
    curl_slist_free_all(hdrs);
    cli_http_destroy(own);
    return rc;
}

int cli_parse_http_url(const char *url, char *host, size_t hcap, int *port, char *path, size_t pcap,
                       bool *tls)
{
    *tls = !strncmp(url, "https://", 8);
    if (strncmp(url, "http://", 7) && !*tls) return TD_EINVAL;
    const char *h = url + (*tls ? 8 : 7), *hend, *rest;
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
    *port = *tls ? 443 : 80;
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
