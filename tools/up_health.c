/* up_health.c: the start-up of a `tandem up` cluster: every process started, then polled
 * until the router's GET /health answers 200 and every prefill instance's stage 0 answers a
 * control-plane HealthRequest with ready = true, or a process dies, a signal arrives or
 * the start-up bound passes.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "ctrl.h"
#include "http_client.h"
#include "td_err.h"
#include "up_int.h"

/* Readiness of a prefill instance: its stage 0 answers HealthRequest with ready = true
 * once every stage joined (and its start-up profile is done). One control-plane client
 * per instance; calls are asynchronous, so polling never blocks the start-up loop. */
typedef struct {
    const char *instance;
    char url[320];
    td_ctrl_client *cl;
    bool ready, asked; /* asked: a health call is in flight (call) */
    uint64_t call;
    const up_proc *stage0; /* whose log tail explains a timeout */
} up_pf_probe;

static void probes_close(up_pf_probe *pp, int n)
{
    for (int i = 0; pp && i < n; i++)
        td_ctrl_client_destroy(pp[i].cl);
    free(pp);
}

static int probes_open(const up_cluster *c, up_pf_probe **out)
{
    int n = c->cfg->n_prefill;
    *out = NULL;
    if (!n) return 0;
    up_pf_probe *pp = calloc((size_t)n, sizeof *pp);
    if (!pp) return TD_ENOMEM;
    for (int i = 0; i < n; i++) {
        const td_cfg_prefill *pf = &c->cfg->prefill[i];
        const char *host = pf->hosts[0];
        if (!strcmp(host, "0.0.0.0") || !host[0]) host = "127.0.0.1";
        if (!strcmp(host, "::")) host = "::1";
        pp[i].instance = pf->name;
        for (int k = 0; k < c->n; k++)
            if (!strcmp(c->p[k].role, "prefill") && !strcmp(c->p[k].instance, pf->name) &&
                c->p[k].rank == 0)
                pp[i].stage0 = &c->p[k];
        td_ctrl_opts opts = {.security = &c->cfg->security};
        int rc = td_cfg_ctrl_url(host, pf->port, pp[i].url, sizeof pp[i].url);
        if (!rc) rc = td_ctrl_client_create(pp[i].url, &opts, &pp[i].cl);
        if (rc) {
            fprintf(stderr, "tandem: prefill %s: cannot reach %s: %s\n", pf->name, pp[i].url,
                    td_strerror(rc));
            probes_close(pp, n);
            return rc;
        }
    }
    *out = pp;
    return 0;
}

/* Collect answers and ask again where needed, without blocking; returns the first prefill
 * instance that is not ready yet, or NULL when all are. */
static up_pf_probe *probes_poll(up_pf_probe *pp, int n)
{
    up_pf_probe *first = NULL;
    for (int i = 0; i < n; i++) {
        up_pf_probe *p = &pp[i];
        td_ctrl_client_in in = {0};
        while (!p->ready && td_ctrl_client_recv(p->cl, &in, 0) == 0) {
            const Td__Health *h = NULL;
            if (in.kind == TD_CTRL_IN_REPLY && in.call_id == p->call) {
                p->asked = false;
                if (!in.err && in.env && in.env->body_case == TD__ENVELOPE__BODY_HEALTH)
                    h = in.env->health;
            } else if (in.kind == TD_CTRL_IN_EVENTS) {
                h = in.health;
            }
            if (h && h->ready) p->ready = true;
        }
        td_ctrl_client_in_free(&in);
        if (!p->ready && !p->asked && td_ctrl_client_health(p->cl, 2000, &p->call) == 0)
            p->asked = true;
        if (!p->ready && !first) first = p;
    }
    return first;
}

/* GET /health of the router: its HTTP status, or a negative td_err (cannot connect yet...).
 * Over TLS the probe does not verify the router (its own process at a known address; it
 * sends nothing secret); with router.tls_client_ca it presents the router's own certificate
 * and key, which the router accepts when the client CA issued them (docs/deploy.md, TLS). */
static int health(const up_cluster *c, int timeout_ms)
{
    const td_cfg_router *r = &c->cfg->router;
    cli_http_req rq = {.host = c->host,
                       .port = c->port,
                       .method = "GET",
                       .path = "/health",
                       .timeout_ms = timeout_ms,
                       .tls = r->tls_cert != NULL,
                       .insecure = true,
                       .cert = r->tls_client_ca ? r->tls_cert : NULL,
                       .key = r->tls_client_ca ? r->tls_key : NULL};
    int status = 0;
    int rc = cli_http_request(NULL, &rq, &status);
    return rc ? rc : status;
}

struct live_body {
    char *data;
    size_t len;
};

static int keep_body(void *ctx, const char *data, size_t n)
{
    struct live_body *b = ctx;
    if (b->len + n > (1u << 20)) return TD_ERANGE; /* a live set is small */
    char *nb = realloc(b->data, b->len + n + 1);
    if (!nb) return TD_ENOMEM;
    memcpy(nb + b->len, data, n);
    b->data = nb;
    b->len += n;
    b->data[b->len] = '\0';
    return 0;
}

json_t *up_live_set(const up_cluster *c, int timeout_ms)
{
    const td_cfg_router *r = &c->cfg->router;
    struct live_body body = {0};
    cli_http_req rq = {.host = c->host,
                       .port = c->port,
                       .method = "GET",
                       .path = "/instances",
                       .timeout_ms = timeout_ms,
                       .tls = r->tls_cert != NULL,
                       .insecure = true,
                       .cert = r->tls_client_ca ? r->tls_cert : NULL,
                       .key = r->tls_client_ca ? r->tls_key : NULL,
                       .bearer = r->api_key,
                       .on_body = keep_body,
                       .ctx = &body};
    int status = 0;
    int rc = cli_http_request(NULL, &rq, &status);
    json_t *js = !rc && status == 200 && body.data ? json_loads(body.data, 0, NULL) : NULL;
    free(body.data);
    return js;
}

/* Starts every process and waits until the cluster is ready. On error the log tail of the
 * process concerned has been printed; the caller stops what runs. */
int up_start_cluster(up_cluster *c, const up_opts *o, double t0)
{
    int rc = 0;
    for (int i = 0; i < c->n && !rc; i++) /* decode ranks, prefill stages, then the router */
        rc = up_spawn(c, &c->p[i], NULL);
    up_pf_probe *probes = NULL;
    int n_probes = c->cfg->n_prefill;
    if (!rc) rc = probes_open(c, &probes);
    double last_note = t0;
    bool router_ok = false;
    while (!rc) {
        up_proc *dead = up_find_exited(c);
        if (dead) {
            up_report_exit(dead, "during start-up");
            rc = TD_EIO;
            break;
        }
        if (up_signal) {
            fprintf(stderr, "tandem: %s during start-up: stopping\n", strsignal(up_signal));
            rc = TD_ESTATE;
            break;
        }
        up_pf_probe *waiting = probes_poll(probes, n_probes);
        int h = router_ok ? 200 : health(c, 2000);
        router_ok = h == 200;
        if (router_ok && !waiting) break;
        if (up_now_s() - t0 > o->timeout_s) {
            if (!router_ok) {
                fprintf(stderr, "tandem: %s/health did not answer 200 within %.0f s (last: %s)\n",
                        c->endpoint, o->timeout_s, h > 0 ? "an HTTP error status" : td_strerror(h));
                if (h < 0 && c->cfg->router.tls_client_ca)
                    fprintf(stderr, "tandem: the probe presents router.tls_cert as its client "
                                    "certificate: was it issued by router.tls_client_ca? "
                                    "(docs/deploy.md, TLS)\n");
                up_print_tail(c->p[c->n - 1].log, 20);
            } else {
                fprintf(stderr,
                        "tandem: prefill %s (%s) did not report ready within %.0f s "
                        "(stage 0 says ready once every stage joined)\n",
                        waiting->instance, waiting->url, o->timeout_s);
                if (waiting->stage0) up_print_tail(waiting->stage0->log, 20);
            }
            rc = TD_ETIMEDOUT;
            break;
        }
        if (up_now_s() - last_note > 15) {
            last_note = up_now_s();
            if (!router_ok)
                fprintf(stderr, "tandem: waiting for %s/health (%.0f s)\n", c->endpoint,
                        last_note - t0);
            else
                fprintf(stderr, "tandem: waiting for prefill %s to be ready (%.0f s)\n",
                        waiting->instance, last_note - t0);
        }
        up_sleep_ms(250);
    }
    probes_close(probes, n_probes);
    return rc;
}
