/* rt_tls.h: TLS of the router's HTTP listener (router.tls_cert, tls_key, tls_client_ca;
 * GnuTLS underneath libmicrohttpd; prefix rt_tls_).
 *
 * Purpose: read and check the PEM files at start-up, so that a missing, unreadable or
 * malformed file (or a key that is not the certificate's) is named before the listener
 * opens; hand their text to MHD (rt_tls_mhd_options); and, with tls_client_ca, make every
 * handshake require a client certificate that chains to it (MHD alone only asks for one
 * and lets a client without it in). rt_tls_client_ok checks the same again per request.
 * Invariants: after rt_tls_load returned 0 with t->on, cert and key hold NUL-terminated PEM
 * text GnuTLS parsed, the key matching the first certificate; ca (when set) holds at least
 * one certificate.
 * Threading: rt_tls_load and rt_tls_fini on the main thread, before the daemon starts and
 * after it stopped; the connection hooks on MHD's threads (they read t only).
 * Ownership: t owns the texts; MHD borrows them (and t) until MHD_stop_daemon, so
 * rt_tls_fini comes after it. The key's bytes are wiped when freed.
 */
#ifndef RT_TLS_H
#define RT_TLS_H

#include <stdbool.h>
#include <stddef.h>

#include "config.h"

struct MHD_Connection;
struct MHD_OptionItem;

#define RT_TLS_MAX_FILE  (1u << 20) /* bytes of one PEM file at most */
#define RT_TLS_N_OPTIONS 5          /* rt_tls_mhd_options' entries, MHD_OPTION_END included */

typedef struct {
    bool on;    /* tls_cert and tls_key given: https */
    char *cert; /* PEM text of tls_cert (the chain) */
    char *key;  /* PEM text of tls_key */
    char *ca;   /* PEM text of tls_client_ca, or NULL: no client certificate asked */
    int n_ca;   /* certificates in ca */
} rt_tls;

/* Reads and checks the files cfg names (none: t->on false, 0). Returns 0, or TD_EUNSUPP
 * (this libmicrohttpd has no TLS), TD_EIO (a file cannot be read or is empty or too
 * large), TD_EFORMAT (GnuTLS refuses a file, or the key is not the certificate's),
 * TD_ENOMEM; the error is logged naming the key and the file. t is zeroed first. */
int rt_tls_load(rt_tls *t, const td_cfg_router *cfg);
void rt_tls_fini(rt_tls *t); /* zeroed or loaded t; the key wiped */

/* MHD options for t into opts (RT_TLS_N_OPTIONS entries, MHD_OPTION_END terminated; just
 * that when !t->on), to pass with MHD_OPTION_ARRAY; returns the daemon flag (MHD_USE_TLS
 * or 0). */
unsigned rt_tls_mhd_options(rt_tls *t, struct MHD_OptionItem *opts);

/* With a client CA: whether conn's peer presented a certificate that verified against it
 * (always true otherwise). Logged at info when false. */
bool rt_tls_client_ok(const rt_tls *t, struct MHD_Connection *conn);

#endif
