/* ctrl_tls.c: the control plane's mutual TLS (td_ctrl_opts.security): the URL a socket
 * really uses, the NNG TLS configuration read from the cluster's PEM files, and the count
 * of refused handshakes that NNG keeps as a listener's or dialer's statistic.
 *
 * NNG 1.5.2 (Debian's, built with mbedTLS 2.28) gives no callback for a connection whose
 * TLS handshake failed: it never becomes a pipe, so pipe events do not see it, and the
 * peer's address is not kept. What it does keep is a per-endpoint counter ("auth": the
 * handshake failed, NNG_EPEERAUTH or NNG_ECRYPTO), which td_ctrl_tls_failures reads. */
#include "ctrl_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_clock.h"
#include "td_err.h"

#define MAX_PEM_BYTES (1u << 20)
#define WATCH_MS      1000

bool td_ctrl_tls_on(const td_ctrl_opts *o)
{
    return o && o->security && o->security->ca;
}

int td_ctrl_tls_url(bool tls, const char *url, char *buf, size_t cap)
{
    const char *prefix = "";
    if (!strncmp(url, "tls+", 4)) {
        if (!tls) {
            TD_LOG_ERR("ctrl: %s needs TLS settings (the YAML's security: ca, cert, key)", url);
            return TD_EINVAL;
        }
    } else if (tls && (!strncmp(url, "tcp://", 6) || !strncmp(url, "tcp4://", 7) ||
                       !strncmp(url, "tcp6://", 7))) {
        prefix = "tls+";
    }
    int n = snprintf(buf, cap, "%s%s", prefix, url);
    return n < 0 || (size_t)n >= cap ? TD_ERANGE : 0;
}

/* The whole file as a NUL-terminated string (PEM is text), or NULL (logged). */
static char *read_pem(const char *what, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        TD_LOG_ERR("ctrl: security.%s: cannot read '%s': %s", what, path, strerror(errno));
        return NULL;
    }
    char *buf = malloc(MAX_PEM_BYTES + 1);
    size_t n = buf ? fread(buf, 1, MAX_PEM_BYTES + 1, f) : 0;
    bool err = ferror(f);
    fclose(f);
    if (!buf || err || n == 0 || n > MAX_PEM_BYTES) {
        TD_LOG_ERR("ctrl: security.%s: cannot read '%s': %s", what, path,
                   !buf  ? "out of memory"
                   : err ? "read error"
                   : n   ? "larger than 1 MiB"
                         : "empty file");
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    return buf;
}

int td_ctrl_tls_config(const td_ctrl_opts *o, bool server, nng_tls_config **out)
{
    *out = NULL;
    const td_cfg_security *sec = o->security;
    char *ca = read_pem("ca", sec->ca);
    char *cert = sec->cert ? read_pem("cert", sec->cert) : NULL;
    char *key = sec->key ? read_pem("key", sec->key) : NULL;
    int rc = TD_EIO;
    nng_tls_config *cfg = NULL;
    if (!ca || (sec->cert && !cert) || (sec->key && !key)) goto out;
    int rv = nng_tls_config_alloc(&cfg, server ? NNG_TLS_MODE_SERVER : NNG_TLS_MODE_CLIENT);
    if (rv) {
        TD_LOG_ERR("ctrl: TLS is not available in this NNG build: %s", nng_strerror(rv));
        rc = td_ctrl_nng_err(rv);
        goto out;
    }
    /* no server name: the peer is checked against the CA only (one cluster certificate
       may serve every host, whatever name or address the YAML reaches it by) */
    if ((rv = nng_tls_config_auth_mode(cfg, NNG_TLS_AUTH_MODE_REQUIRED))) {
        TD_LOG_ERR("ctrl: TLS peer authentication: %s", nng_strerror(rv));
        goto out;
    }
    if ((rv = nng_tls_config_ca_chain(cfg, ca, NULL))) {
        TD_LOG_ERR("ctrl: security.ca '%s': not a usable PEM CA certificate: %s", sec->ca,
                   nng_strerror(rv));
        goto out;
    }
    if (cert && key && (rv = nng_tls_config_own_cert(cfg, cert, key, NULL))) {
        TD_LOG_ERR("ctrl: security.cert '%s' / key '%s': not a usable PEM certificate and its "
                   "unencrypted private key: %s",
                   sec->cert, sec->key, nng_strerror(rv));
        goto out;
    }
    *out = cfg;
    cfg = NULL;
    rc = 0;
out:
    if (cfg) nng_tls_config_free(cfg);
    free(ca);
    free(cert);
    free(key);
    return rc;
}

/* The scope of one endpoint among the snapshot's top-level scopes. NNG 1.5.2's
 * nng_stat_find_listener / _dialer return the first endpoint of that kind whatever its id
 * (their search below the root ignores the id), so the id is compared here: a scope's value
 * is its id (a union, zeroed beyond the int). */
static nng_stat *find_endpoint(nng_stat *root, const char *kind, int id)
{
    for (nng_stat *c = nng_stat_child(root); c; c = nng_stat_next(c))
        if (nng_stat_type(c) == NNG_STAT_SCOPE && !strcmp(nng_stat_name(c), kind) &&
            (int)(uint32_t)nng_stat_value(c) == id)
            return c;
    return NULL;
}

uint64_t td_ctrl_tls_failures(td_ctrl_tls_watch *w, uint64_t *log)
{
    int64_t now = td_now_ms();
    *log = 0;
    if (now < w->next_ms) return 0;
    w->next_ms = now + WATCH_MS;
    nng_stat *root = NULL;
    if (nng_stats_get(&root)) return 0; /* NNG without statistics: nothing to say */
    nng_stat *ep = w->is_listener ? find_endpoint(root, "listener", nng_listener_id(w->l))
                                  : find_endpoint(root, "dialer", nng_dialer_id(w->d));
    nng_stat *auth = ep ? nng_stat_find(ep, "auth") : NULL;
    uint64_t v = auth ? nng_stat_value(auth) : w->seen;
    nng_stats_free(root);
    uint64_t fresh = v > w->seen ? v - w->seen : 0;
    w->seen = v;
    w->unlogged += fresh;
    if (w->unlogged && now >= w->next_log_ms) {
        *log = w->unlogged;
        w->unlogged = 0;
        w->next_log_ms = now + TD_CTRL_TLS_LOG_MS;
    }
    return fresh;
}
