/* ctrl_internal.h: shared pieces of the control-plane layer (not for callers).
 *
 * Purpose: option defaults, the NNG message helpers and the inbox that NNG callbacks fill
 * and the owner thread drains.
 * Invariants: an inbox item is owned by the inbox from push until pop, then by the popper.
 * Threading: td_ctrl_inbox_* are thread-safe (one mutex); push never blocks on the owner.
 * Ownership: the inbox frees nothing it holds; its owner drains it before destroying it.
 */
#ifndef TD_CTRL_INTERNAL_H
#define TD_CTRL_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>

#include <nng/nng.h>
#include <nng/supplemental/tls/tls.h>

#include "ctrl.h"

/* opts with every zero replaced by its default (in may be NULL); ctrl_codec.c. */
void td_ctrl_opts_fill(const td_ctrl_opts *in, td_ctrl_opts *out);

/* Pack env into a new NNG message (size checked against opts). */
int td_ctrl_pack_msg(const Td__Envelope *env, const td_ctrl_opts *opts, nng_msg **out);

/* A random nonzero 64-bit id (client ids, server epochs). */
uint64_t td_ctrl_random_id(void);

/* Map an NNG error to a td_err (NNG_ETIMEDOUT -> TD_ETIMEDOUT, NNG_ECLOSED -> TD_ESTATE,
 * NNG_ENOMEM -> TD_ENOMEM, anything else TD_EIO). */
int td_ctrl_nng_err(int rv);

/* A FIFO of items pushed by callbacks; the owner waits on the condition variable or on
 * the eventfd (readable while the FIFO is not empty). */
typedef struct td_ctrl_item {
    struct td_ctrl_item *next;
    int kind;      /* owner-defined */
    void *ptr;     /* owner-defined */
    nng_msg *msg;  /* received message, or NULL */
    int rv;        /* NNG result */
    uint32_t pipe; /* pipe id (pipe events, received messages) */
} td_ctrl_item;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    td_ctrl_item *head, *tail;
    size_t n;
    int efd; /* eventfd, -1 if it could not be created */
} td_ctrl_inbox;

int td_ctrl_inbox_init(td_ctrl_inbox *ib);
void td_ctrl_inbox_fini(td_ctrl_inbox *ib); /* frees remaining items and their messages */
/* Push (takes the item; never fails). Locks ib->mu: not for use with it held. */
void td_ctrl_inbox_push(td_ctrl_inbox *ib, td_ctrl_item *it);
/* Pop the oldest item, waiting until deadline_ms (td_now_ms clock; < 0 forever).
 * Returns NULL on timeout. */
td_ctrl_item *td_ctrl_inbox_pop(td_ctrl_inbox *ib, int64_t deadline_ms);
size_t td_ctrl_inbox_len(td_ctrl_inbox *ib);

/* ---- mutual TLS (td_ctrl_opts.security; ctrl_tls.c) ---- */

/* Whether o asks for TLS on tcp sockets (security given with a CA). */
bool td_ctrl_tls_on(const td_ctrl_opts *o);
/* The URL a socket really uses: tcp://, tcp4://, tcp6:// become tls+tcp... when tls;
 * anything else is copied. TD_EINVAL (logged) for a tls+ URL without TLS settings, TD_ERANGE
 * when buf is too small. */
int td_ctrl_tls_url(bool tls, const char *url, char *buf, size_t cap);
/* A TLS configuration from o->security for a listener (server true) or a dialer: this
 * side's certificate and key, the CA, peer authentication required. The files are read
 * here; every failure is logged with the file and the reason. Free with
 * nng_tls_config_free (an endpoint holds its own reference). */
int td_ctrl_tls_config(const td_ctrl_opts *o, bool server, nng_tls_config **out);

/* Failed TLS handshakes of one endpoint, from NNG's "auth" statistic of the listener or
 * dialer (NNG has no callback for a connection refused before it became a pipe, and no
 * peer address for it). */
typedef struct {
    bool is_listener;
    nng_listener l;
    nng_dialer d;
    uint64_t seen;       /* failures already counted */
    int64_t next_ms;     /* td_now_ms() of the next look (at most one a second) */
    uint64_t unlogged;   /* failures counted but not logged yet */
    int64_t next_log_ms; /* the next log line (at most one every TD_CTRL_TLS_LOG_MS) */
} td_ctrl_tls_watch;
#define TD_CTRL_TLS_LOG_MS 10000
/* How many handshakes failed since the last call that looked (0 between looks, or when NNG
 * was built without statistics). *log receives how many to log now (0: nothing yet): the
 * first failures at once, later ones summed up at most once every TD_CTRL_TLS_LOG_MS, so a
 * peer that keeps redialling does not flood the log. */
uint64_t td_ctrl_tls_failures(td_ctrl_tls_watch *w, uint64_t *log);

/* Run fn(arg) (a teardown that calls nng_close) on a thread of its own and wait for it at
 * most TD_CTRL_TEARDOWN_MS (TD_CTRL_TEARDOWN_STUCK_MS once a teardown of this process has
 * been given up: NNG is then stuck for good). Returns true if fn returned in time; false
 * if it did not: fn goes on (or hangs) on its thread, so fn(arg) must own everything it
 * touches (the caller forgets arg), and a warning naming `what` is logged.
 * Why: NNG 1.5.2's nng_close can hang forever when the peer drops the connection while the
 * socket closes: its reaper thread waits in the protocol's pipe stop for the pipe's receive
 * aio, which nothing completes (nanomsg/nng#1543); every later nng_close of the process
 * then waits for that reaper too. A process that shuts down must still exit.
 * Also seen: a server closing while its client's next Poll arrives (the rep0 pipe's receive
 * aio begun, never completed; NNG 1.9.0 aborts such an aio in nni_aio_stop). The reaper
 * is also what redials: a dialer tries again only once its lost connection was reaped, so
 * once it hangs no connection this process loses comes back. The nodes and the router
 * close their sockets only when they stop; a test that restarts a server its own client
 * must reconnect to runs that server in another process (test_ctrl's reconnect test). */
#define TD_CTRL_TEARDOWN_MS       1000
#define TD_CTRL_TEARDOWN_STUCK_MS 100
bool td_ctrl_teardown_bounded(void (*fn)(void *), void *arg, const char *what);

#endif
