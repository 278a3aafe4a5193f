/* rt_main.c: `tandem-router --config FILE [--listen HOST:PORT]`: loads the cluster YAML and
 * the model's tokenizer metadata, starts the loop thread and the HTTP server, and runs
 * until SIGINT or SIGTERM, then shuts down in order:
 *   drain: new requests get 503 shutting_down (the listening socket stays open so that
 *          clients get an answer, not a refused connection), /health 503 "draining";
 *          requests already accepted (queued ones too) may finish, for up to
 *          router.drain_timeout_ms; a second SIGINT/SIGTERM ends the drain at once
 *   stop:  the requests still open are cancelled on their instances and answered (503, or
 *          an SSE error event + [DONE]); the HTTP server gets up to STOP_FLUSH_MS to hand
 *          those answers to the clients, then stops; everything is freed.
 * Exit status 0 after a stop (drained or not), 1 when start-up failed (the reason is
 * logged). The whole stop takes at most drain_timeout_ms + ~1.5 s, plus 1 s (and 0.1 s for
 * each later instance) when NNG's close of a control connection hangs (the close is given
 * up then: td_ctrl_teardown_bounded in common/ctrl_internal.h). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rt.h"
#include "rt_http.h"
#include "rt_loop.h"
#include "td_args.h"
#include "td_clock.h"
#include "td_err.h"

#define STOP_FLUSH_MS 1000 /* after the drain: bound on writing the last answers */

static void usage(void)
{
    fprintf(stderr, "usage: tandem-router --config FILE [--listen HOST:PORT]\n");
}

/* "HOST:PORT", "[V6]:PORT" -> host (malloc'd) and port. */
static int split_listen(const char *s, char **host, int *port)
{
    const char *colon = strrchr(s, ':');
    if (!colon || colon == s) return TD_EINVAL;
    char *end;
    long p = strtol(colon + 1, &end, 10);
    if (*end || p < 0 || p > 65535 || end == colon + 1) return TD_EINVAL;
    const char *h = s;
    size_t hl = (size_t)(colon - s);
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') {
        h++;
        hl -= 2;
    }
    *host = strndup(h, hl);
    *port = (int)p;
    return *host ? 0 : TD_ENOMEM;
}

static int load_model(rt_router *r)
{
    char err[512] = "";
    int rc = td_gguf_open(r->cfg->model, &r->gguf, err, sizeof err);
    if (rc) {
        TD_LOG_ERR("router: cannot open model '%s': %s", r->cfg->model, err);
        return rc;
    }
    if ((rc = td_tok_create(r->gguf, &r->model.tok))) return rc;
    r->model.limits = &r->cfg->router;
    const char *arch = NULL;
    size_t alen = 0;
    int64_t ctx = 0;
    if (!td_gguf_get_str(r->gguf, "general.architecture", &arch, &alen) && alen < 64) {
        char key[96];
        snprintf(key, sizeof key, "%.*s.context_length", (int)alen, arch);
        td_gguf_get_i64(r->gguf, key, &ctx);
    }
    r->model.n_ctx = ctx > 0 && ctx < INT32_MAX ? (int32_t)ctx : 2048;
    if (r->model.n_ctx > 8192) r->model.n_ctx = 8192; /* what the decode nodes allocate at most */

    err[0] = 0;
    if ((rc = rt_chat_tmpl_init(&r->model.chat, r->gguf, r->model.tok, r->cfg->router.chat_template,
                                err, sizeof err))) {
        TD_LOG_ERR("router: model '%s': %s", r->cfg->model, err);
        return rc;
    }
    const char *tp = r->cfg->router.tool_parser;
    bool pinned = tp && strcmp(tp, "auto") && rt_toolfmt_by_name(tp, &r->model.chat.tool_fmt);
    TD_LOG_INFO("router: chat template: %s%s; tool calls parsed as %s (%s); reasoning markers: %s",
                r->model.chat.source,
                r->model.chat.tool_use ? " (and its tool_use template for requests with tools)"
                                       : "",
                rt_toolfmt_name(r->model.chat.tool_fmt),
                pinned ? "router.tool_parser" : "found in the template",
                rt_reason_fmt_name(r->model.chat.thinks));
    /* the model name: the file name without directories and without ".gguf" */
    const char *base = strrchr(r->cfg->model, '/');
    base = base ? base + 1 : r->cfg->model;
    snprintf(r->model.name, sizeof r->model.name, "%s", base);
    size_t ml = strlen(r->model.name);
    if (ml > 5 && !strcmp(r->model.name + ml - 5, ".gguf")) r->model.name[ml - 5] = 0;
    return 0;
}

/* After the first stop signal: refuse new requests and wait for the open ones to complete
 * (every generation response written), up to router.drain_timeout_ms or a second signal. */
static void drain(rt_router *r, int sig, const sigset_t *set)
{
    atomic_store(&r->draining, true);
    int ms = r->cfg->router.drain_timeout_ms;
    TD_LOG_INFO("router: signal %d: draining: %d request(s) open, waiting up to %d ms", sig,
                atomic_load(&r->open), ms);
    int64_t end = td_now_ms() + ms;
    while (atomic_load(&r->open) > 0 && td_now_ms() < end) {
        struct timespec ts = {.tv_nsec = 20 * 1000 * 1000};
        int again = sigtimedwait(set, NULL, &ts);
        if (again > 0) {
            TD_LOG_INFO("router: signal %d again: stopping now", again);
            break;
        }
    }
    int left = atomic_load(&r->open);
    if (left)
        TD_LOG_WARN("router: %d request(s) still open after the drain: cancelling them", left);
    else
        TD_LOG_INFO("router: drained: no request open, stopping");
}

int main(int argc, char **argv)
{
    const char *config = NULL, *listen = NULL;
    const td_arg spec[] = {
        {.name = "--config", .kind = TD_ARG_STRING, .out = &config, .required = true},
        {.name = "--listen", .kind = TD_ARG_STRING, .out = &listen},
    };
    td_args_result ar =
        td_args_parse("tandem-router", argc, argv, spec, sizeof spec / sizeof *spec);
    if (ar != TD_ARGS_OK) {
        usage();
        return ar == TD_ARGS_HELP ? 0 : 1;
    }
    const char *lvl = getenv("TANDEM_LOG");
    if (lvl && !strcmp(lvl, "debug")) td_log_set_level(TD_LOG_DEBUG);

    /* block the stop signals in every thread; the main thread waits for them */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);

    static rt_router router;
    rt_router *r = &router;
    r->wake_fd = -1;
    pthread_mutex_init(&r->in_mu, NULL);
    char err[1024] = "";
    int rc = td_cfg_load(config, &r->cfg, err, sizeof err);
    char *host = NULL;
    int port = 0;
    if (rc) {
        fprintf(stderr, "tandem-router: %s\n", err);
    } else if ((rc = split_listen(listen ? listen : r->cfg->router.listen, &host, &port))) {
        fprintf(stderr, "tandem-router: bad listen address '%s' (want HOST:PORT)\n",
                listen ? listen : r->cfg->router.listen);
    }
    if (!rc && r->cfg->router.api_key && r->cfg->router.api_key[0])
        snprintf(r->api_key_hdr, sizeof r->api_key_hdr, "Bearer %s", r->cfg->router.api_key);
    if (!rc) r->max_body = rt_max_body(r->cfg);
    if (!rc) rc = rt_tls_load(&r->tls, &r->cfg->router);
    if (!rc) rc = load_model(r);
    int cap = 0, cap_pf = 0;
    if (!rc) rt_reg_caps(r->cfg, &cap, &cap_pf);
    if (!rc) rc = rt_metrics_init(&r->metrics, cap, cap_pf);
    if (!rc) rt_metrics_set_model(&r->metrics, r->model.name, r->model.n_ctx);
    if (!rc) rc = rt_loop_start(r);
    if (!rc) rc = rt_http_start(r, host, port);
    if (!rc) {
        TD_LOG_INFO(
            "router: model %s (context %d), %d decode instance(s), %d prefill instance(s)%s",
            r->model.name, r->model.n_ctx, r->cfg->n_decode, r->cfg->n_prefill,
            r->cfg->n_prefill ? " (disaggregated)" : " (colocated)");
        int sig = 0;
        sigwait(&set, &sig);
        drain(r, sig, &set);
    }
    pthread_mutex_lock(&r->in_mu);
    r->closing = true;
    pthread_mutex_unlock(&r->in_mu);
    rt_loop_stop(r); /* answers every open request, so no connection stays suspended */
    rt_http_stop(r, STOP_FLUSH_MS);
    rt_tls_fini(&r->tls); /* after the daemon, which borrowed its texts */
    rt_loop_drain(r);
    rt_metrics_fini(&r->metrics);
    rt_chat_tmpl_fini(&r->model.chat);
    td_tok_destroy(r->model.tok);
    td_gguf_close(r->gguf);
    td_cfg_free(r->cfg);
    free(host);
    pthread_mutex_destroy(&r->in_mu);
    return rc ? 1 : 0;
}
