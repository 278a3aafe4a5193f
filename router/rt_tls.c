/* rt_tls.c: the router's TLS material and client-certificate policy (see rt_tls.h).
 *
 * The files are parsed here with GnuTLS before MHD sees them, because MHD_start_daemon
 * answers a bad certificate, a bad key or a key that is not the certificate's alike (NULL,
 * nothing said): each check below names the key and the file it is about. */
#include "rt_tls.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <gnutls/gnutls.h>
#include <gnutls/x509.h>
#include <microhttpd.h>

#include "td_err.h"

/* The whole file at path as a NUL-terminated string in *out (malloc'd). Logs and returns
 * TD_EIO when it cannot be read, is empty or larger than RT_TLS_MAX_FILE. */
static int read_pem(const char *key, const char *path, char **out)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        TD_LOG_ERR("router: cannot read router.%s '%s': %s", key, path, strerror(errno));
        return TD_EIO;
    }
    char *buf = malloc(RT_TLS_MAX_FILE + 1);
    size_t n = buf ? fread(buf, 1, RT_TLS_MAX_FILE + 1, f) : 0;
    int rerr = ferror(f) ? errno : 0;
    fclose(f);
    if (!buf) return TD_ENOMEM;
    const char *why = rerr                  ? strerror(rerr)
                      : n > RT_TLS_MAX_FILE ? "larger than 1 MiB"
                      : n == 0              ? "the file is empty"
                      : memchr(buf, 0, n)   ? "not PEM text (a NUL byte)"
                                            : NULL;
    if (why) {
        TD_LOG_ERR("router: cannot read router.%s '%s': %s", key, path, why);
        free(buf);
        return TD_EIO;
    }
    buf[n] = 0;
    *out = buf;
    return 0;
}

static gnutls_datum_t datum(const char *s)
{
    return (gnutls_datum_t){.data = (unsigned char *)s, .size = (unsigned)strlen(s)};
}

/* The certificate chain: at least one certificate; its first one's subject and expiry
 * logged (a warning once expired or not yet valid). */
static int check_cert(const rt_tls *t, const char *path)
{
    gnutls_x509_crt_t *crts = NULL;
    unsigned n = 0;
    gnutls_datum_t d = datum(t->cert);
    int g = gnutls_x509_crt_list_import2(&crts, &n, &d, GNUTLS_X509_FMT_PEM, 0);
    if (g < 0 || n == 0) {
        TD_LOG_ERR("router: router.tls_cert '%s' is not a PEM certificate chain: %s", path,
                   g < 0 ? gnutls_strerror(g) : "no certificate in it");
        return TD_EFORMAT;
    }
    gnutls_datum_t dn = {0};
    time_t now = time(NULL), end = gnutls_x509_crt_get_expiration_time(crts[0]);
    time_t start = gnutls_x509_crt_get_activation_time(crts[0]);
    char until[32] = "?";
    struct tm tm;
    if (end != (time_t)-1 && gmtime_r(&end, &tm)) strftime(until, sizeof until, "%Y-%m-%d", &tm);
    bool has_dn = gnutls_x509_crt_get_dn2(crts[0], &dn) >= 0;
    const char *subject = has_dn ? (const char *)dn.data : "?";
    if ((end != (time_t)-1 && end < now) || (start != (time_t)-1 && start > now))
        TD_LOG_WARN("router: router.tls_cert '%s' (%s) is not valid now (valid until %s): "
                    "clients that check it will refuse the connection",
                    path, subject, until);
    else
        TD_LOG_INFO("router: TLS certificate %s, %u in the chain, valid until %s", subject, n,
                    until);
    if (has_dn) gnutls_free(dn.data);
    for (unsigned i = 0; i < n; i++)
        gnutls_x509_crt_deinit(crts[i]);
    gnutls_free(crts);
    return 0;
}

static int check_key(const rt_tls *t, const char *path)
{
    gnutls_x509_privkey_t k;
    if (gnutls_x509_privkey_init(&k) < 0) return TD_ENOMEM;
    gnutls_datum_t d = datum(t->key);
    int g = gnutls_x509_privkey_import2(k, &d, GNUTLS_X509_FMT_PEM, NULL, 0);
    gnutls_x509_privkey_deinit(k);
    if (g < 0) {
        TD_LOG_ERR("router: router.tls_key '%s' is not an unencrypted PEM private key: %s", path,
                   gnutls_strerror(g));
        return TD_EFORMAT;
    }
    return 0;
}

/* The key belongs to the certificate, and the client CA file holds certificates: the same
 * calls MHD makes on the same texts. */
static int check_pair(rt_tls *t, const td_cfg_router *cfg)
{
    gnutls_certificate_credentials_t cred;
    if (gnutls_certificate_allocate_credentials(&cred) < 0) return TD_ENOMEM;
    int rc = 0;
    gnutls_datum_t c = datum(t->cert), k = datum(t->key);
    int g = gnutls_certificate_set_x509_key_mem2(cred, &c, &k, GNUTLS_X509_FMT_PEM, NULL, 0);
    if (g < 0) {
        TD_LOG_ERR("router: router.tls_key '%s' does not go with router.tls_cert '%s': %s",
                   cfg->tls_key, cfg->tls_cert, gnutls_strerror(g));
        rc = TD_EFORMAT;
    }
    if (!rc && t->ca) {
        gnutls_datum_t a = datum(t->ca);
        g = gnutls_certificate_set_x509_trust_mem(cred, &a, GNUTLS_X509_FMT_PEM);
        if (g <= 0) {
            TD_LOG_ERR("router: router.tls_client_ca '%s' holds no PEM certificate%s%s",
                       cfg->tls_client_ca, g < 0 ? ": " : "", g < 0 ? gnutls_strerror(g) : "");
            rc = TD_EFORMAT;
        }
        t->n_ca = g;
    }
    gnutls_certificate_free_credentials(cred);
    return rc;
}

int rt_tls_load(rt_tls *t, const td_cfg_router *cfg)
{
    *t = (rt_tls){0};
    if (!cfg->tls_cert) return 0;
    if (MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES) {
        TD_LOG_ERR("router: router.tls_cert is set but this libmicrohttpd was built without TLS "
                   "(GnuTLS): install one with it (Debian's libmicrohttpd12 has it) or remove "
                   "the tls_ keys");
        return TD_EUNSUPP;
    }
    int rc = read_pem("tls_cert", cfg->tls_cert, &t->cert);
    if (!rc) rc = read_pem("tls_key", cfg->tls_key, &t->key);
    if (!rc && cfg->tls_client_ca) rc = read_pem("tls_client_ca", cfg->tls_client_ca, &t->ca);
    if (!rc) rc = check_cert(t, cfg->tls_cert);
    if (!rc) rc = check_key(t, cfg->tls_key);
    if (!rc) rc = check_pair(t, cfg);
    if (rc) {
        rt_tls_fini(t);
        return rc;
    }
    t->on = true;
    return 0;
}

void rt_tls_fini(rt_tls *t)
{
    if (t->key) {
        volatile char *p = t->key; /* volatile: the wipe is not optimized away */
        for (size_t i = 0; p[i]; i++)
            p[i] = 0;
    }
    free(t->key);
    free(t->cert);
    free(t->ca);
    *t = (rt_tls){0};
}

/* MHD_OPTION_NOTIFY_CONNECTION, with a client CA: before the handshake (the session exists,
 * nothing was read yet), turn MHD's "request a certificate" into "require one that
 * verifies against the trust list" (the client CA), so that the handshake itself fails for
 * a client without one. */
static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe)
{
    (void)cls;
    (void)socket_context;
    if (toe != MHD_CONNECTION_NOTIFY_STARTED) return;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_GNUTLS_SESSION);
    if (!ci || !ci->tls_session) return; /* rt_tls_client_ok refuses its requests */
    gnutls_session_t s = ci->tls_session;
    gnutls_certificate_server_set_request(s, GNUTLS_CERT_REQUIRE);
    gnutls_session_set_verify_cert(s, NULL, 0);
}

unsigned rt_tls_mhd_options(rt_tls *t, struct MHD_OptionItem *opts)
{
    int n = 0;
    if (t->on) {
        opts[n++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_CERT, 0, t->cert};
        opts[n++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_KEY, 0, t->key};
        if (t->ca) {
            opts[n++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_TRUST, 0, t->ca};
            opts[n++] =
                (struct MHD_OptionItem){MHD_OPTION_NOTIFY_CONNECTION, (intptr_t)on_connection, t};
        }
    }
    opts[n] = (struct MHD_OptionItem){MHD_OPTION_END, 0, NULL};
    return t->on ? MHD_USE_TLS : 0;
}

bool rt_tls_client_ok(const rt_tls *t, struct MHD_Connection *conn)
{
    if (!t->on || !t->ca) return true;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_GNUTLS_SESSION);
    const char *why = NULL;
    unsigned n = 0, status = 0;
    if (!ci || !ci->tls_session)
        why = "no TLS session";
    else if (!gnutls_certificate_get_peers(ci->tls_session, &n) || !n)
        why = "no client certificate";
    else if (gnutls_certificate_verify_peers2(ci->tls_session, &status) < 0 || status)
        why = "the client certificate does not verify against router.tls_client_ca";
    if (why) TD_LOG_INFO("router: refused a request: %s", why);
    return !why;
}
