/* http_client.h: the blocking HTTP client of the `tandem` tool (libcurl underneath):
 * `tandem bench`'s requests and `tandem up`'s router health probe.
 *
 * Contract: one request per connection (Connection: close, never a proxy), GET or POST
 * with an application/json body, over http or https (the server verified against the
 * request's CA file, else $CURL_CA_BUNDLE, else the system's CAs), one deadline for the
 * whole exchange (resolve, connect, TLS handshake, send, receive). The response body goes
 * to a callback as its bytes arrive, de-chunked, so that a caller can time each server-sent
 * event at the moment it is received. Any HTTP status is a completed exchange: the caller
 * reads *status.
 * Threading: cli_http_global_init once in main before any thread starts; after that, one
 * cli_http handle per thread (a handle is never used by two threads at once). Requests
 * on different handles run in parallel.
 * Ownership: the handle owns its libcurl easy handle; a request's strings are borrowed for
 * the duration of the call.
 */
#ifndef TANDEM_HTTP_CLIENT_H
#define TANDEM_HTTP_CLIENT_H

#include <stdbool.h>
#include <stddef.h>

/* Receives the next n bytes of the body (de-chunked); a nonzero return stops the transfer,
 * which then counts as complete (cli_http_request returns 0 with the status seen). */
typedef int (*cli_http_body_fn)(void *ctx, const char *data, size_t n);

typedef struct {
    const char *host; /* name or address (IPv6 without brackets) */
    int port;
    const char *method, *path; /* "GET" | "POST", "/health" */
    const char *body;          /* NULL: none; else sent as application/json */
    int timeout_ms;            /* whole exchange; 0: 30000 */
    bool tls;                  /* https */
    const char *cacert;        /* https: PEM CA file the server's certificate must chain to;
                                  NULL: $CURL_CA_BUNDLE if set, else the system's CAs */
    const char *cert, *key;    /* https: client certificate and its key (PEM files), or NULL */
    bool insecure;             /* https: the server is not verified (a local liveness probe) */
    const char *bearer;        /* "Authorization: Bearer BEARER" (router.api_key), or NULL */
    cli_http_body_fn on_body;  /* NULL: body discarded */
    void *ctx;
    char *err;      /* NULL, or where a failure is described (libcurl's words) */
    size_t err_cap; /* bytes at err */
} cli_http_req;

typedef struct cli_http cli_http; /* one client: a libcurl easy handle */

/* Once per process, before any thread starts (libcurl's global state). Returns 0 or TD_EIO. */
int cli_http_global_init(void);
void cli_http_global_fini(void);

/* A handle for one thread's requests, reused from one request to the next. Returns 0 with
 * *out set, or TD_ENOMEM. cli_http_destroy(NULL) does nothing. */
int cli_http_create(cli_http **out);
void cli_http_destroy(cli_http *h);

/* Runs one exchange on h (NULL: a handle made for this request only). Returns 0 with
 * *status the HTTP status, or a negative td_err with *status 0 (or what was received):
 * TD_EIO cannot resolve or connect, or the connection was lost; TD_EFORMAT a malformed
 * response; TD_ETIMEDOUT the exchange took over timeout_ms; TD_ENOMEM; TD_EINVAL a bad
 * request (method other than GET/POST, URL too long). rq->err, when given, says why in
 * words (libcurl's message). */
int cli_http_request(cli_http *h, const cli_http_req *rq, int *status);

/* "http://HOST[:PORT][/PATH]" or "https://..." -> host, port (80, or 443 for https), path
 * ("" if none), *tls (https); TD_EINVAL if not. */
int cli_parse_http_url(const char *url, char *host, size_t hcap, int *port, char *path, size_t pcap,
                       bool *tls);

#endif
