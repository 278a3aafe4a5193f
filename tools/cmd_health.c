/* cmd_health.c: `tandem health [--alive] [--config FILE] [--timeout-ms MS] URL`: one health
 * check as an exit status, for probes (the Kubernetes manifests' exec probes, scripts).
 *
 *   tcp://HOST:PORT (a decode instance's rank 0, a prefill instance's stage 0): a control-plane
 *     HealthRequest; exit 0 when the reply says ready (every rank or stage joined, not
 *     draining), with --alive when any reply comes.
 *   http://HOST:PORT or https:// (the router): GET /health; exit 0 on 200 (it can serve), with
 *     --alive on any HTTP answer (https: the certificate is not checked).
 * One line on stdout says what was seen; exit 1 when not ready or no answer came within
 * --timeout-ms (default 3000) and on bad usage. --config FILE: the cluster YAML whose
 * `security` section (mutual TLS) the control-plane connection uses.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "config.h"
#include "ctrl.h"
#include "http_client.h"
#include "td_clock.h"
#include "td_err.h"

typedef struct {
    bool alive;
    const char *config, *url;
    int timeout_ms;
} health_opts;

static int health_args(int argc, char **argv, health_opts *o)
{
    *o = (health_opts){.timeout_ms = 3000};
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--alive")) {
            o->alive = true;
        } else if (!strcmp(a, "--config") && i + 1 < argc) {
            o->config = argv[++i];
        } else if (!strcmp(a, "--timeout-ms") && i + 1 < argc) {
            if (cli_parse_int("--timeout-ms", argv[++i], 1, 600000, &o->timeout_ms))
                return TD_EINVAL;
        } else if (a[0] != '-' && !o->url) {
            o->url = a;
        } else {
            if (strcmp(a, "-h") && strcmp(a, "--help"))
                fprintf(stderr, "tandem health: unexpected argument '%s'\n", a);
            o->url = NULL;
            break;
        }
    }
    if (o->url) return 0;
    fprintf(stderr, "usage: tandem health [--alive] [--config FILE] [--timeout-ms MS] URL\n"
                    "  URL tcp://HOST:PORT (an instance's control socket: exit 0 when ready)\n"
                    "      or http://HOST:PORT (the router: exit 0 when GET /health is 200)\n"
                    "  --alive  exit 0 on any answer (ready or not)\n"
                    "  --config FILE  the cluster YAML (its security section: mutual TLS)\n");
    return TD_EINVAL;
}

static int health_http(const health_opts *o)
{
    char host[256], path[512];
    int port, status = 0;
    char err[256] = "";
    bool tls = false;
    if (cli_parse_http_url(o->url, host, sizeof host, &port, path, sizeof path, &tls)) {
        fprintf(stderr, "tandem health: bad URL '%s'\n", o->url);
        return TD_EINVAL;
    }
    cli_http_req rq = {.host = host,
                       .port = port,
                       .method = "GET",
                       .path = "/health",
                       .timeout_ms = o->timeout_ms,
                       .err = err,
                       .err_cap = sizeof err};
    int rc = cli_http_request(NULL, &rq, &status);
    if (rc) {
        printf("%s: no answer: %s\n", o->url, err[0] ? err : td_strerror(rc));
        return TD_EIO;
    }
    printf("%s: GET /health %d\n", o->url, status);
    return status == 200 || o->alive ? 0 : TD_EIO;
}

static int health_ctrl(const health_opts *o, const td_cfg *cfg)
{
    td_ctrl_opts opts = {.security = cfg ? &cfg->security : NULL};
    td_ctrl_client *c = NULL;
    int rc = td_ctrl_client_create(o->url, &opts, &c);
    uint64_t call = 0;
    if (!rc) rc = td_ctrl_client_health(c, o->timeout_ms, &call);
    td_ctrl_client_in in = {0};
    int64_t deadline = td_now_ms() + o->timeout_ms + 1000;
    int err = rc ? rc : TD_ETIMEDOUT;
    while (!rc && td_now_ms() < deadline) {
        if (td_ctrl_client_recv(c, &in, 200)) continue;
        if (in.kind == TD_CTRL_IN_REPLY && in.call_id == call) {
            err = in.err;
            break;
        }
    }
    const Td__Envelope *env = err ? NULL : in.env;
    int out = TD_EIO;
    if (env && env->body_case == TD__ENVELOPE__BODY_HEALTH) {
        const Td__Health *h = env->health;
        printf("%s: instance %s %s (running %u, waiting %u)\n", o->url, h->instance,
               h->ready ? "ready" : "not ready", h->running, h->waiting);
        out = h->ready || o->alive ? 0 : TD_EIO;
    } else if (env) {
        printf("%s: answered without a health reply\n", o->url);
        out = o->alive ? 0 : TD_EIO;
    } else {
        printf("%s: no answer: %s\n", o->url, td_strerror(err));
    }
    td_ctrl_client_in_free(&in);
    td_ctrl_client_destroy(c);
    return out;
}

int cmd_health(int argc, char **argv)
{
    health_opts o;
    if (health_args(argc, argv, &o)) return TD_EINVAL;
    if (!strncmp(o.url, "http://", 7) || !strncmp(o.url, "https://", 8)) return health_http(&o);
    td_cfg *cfg = NULL;
    char err[1024];
    if (o.config && td_cfg_load(o.config, &cfg, err, sizeof err)) {
        fprintf(stderr, "tandem health: %s\n", err);
        return TD_EINVAL;
    }
    int rc = health_ctrl(&o, cfg);
    fflush(stdout);
    td_cfg_free(cfg);
    return rc;
}
