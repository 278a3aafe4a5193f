/* ctrl.h: Tandem's control plane: envelope codec and NNG sockets (prefix td_ctrl_).
 *
 * Purpose: carry the messages of proto/tandem_ctrl.proto (generated types Td__*) between
 * a client (router, test client) and a server (decode rank 0, prefill stage 0).
 *
 * Pattern (docs/control-plane.md explains the choice): one NNG req/rep socket pair per
 * connection. Every request (Submit, Cancel, HealthRequest, Alloc, Prefill, KvTarget) gets
 * exactly one reply (Ack, ErrorEvent, Health, AllocReply) within the caller's deadline.
 * Events (token streams, asynchronous errors, prefill notices) flow server -> client
 * through long-poll Poll requests that the client layer keeps outstanding on its own:
 * each event carries a per-client sequence number and stays in the server's outbox until
 * a later Poll acknowledges it, so a reply lost to a timeout or a reconnect is sent again
 * and the client drops duplicates. Nothing is dropped silently: a client that stops
 * polling for opts.peer_timeout_ms (or whose connection closed and did not come back
 * within opts.peer_grace_ms) is reported once as TD_CTRL_IN_PEER_GONE so the owner can
 * cancel its requests.
 *
 * Invariants:
 *  - Decoding never trusts the input: size limit first, then protobuf-c unpack with a
 *    byte-budgeted allocator, then per-field limits (repeated counts, string and bytes
 *    lengths, token ids >= 0, finite floats). A malformed, truncated, oversized or
 *    wrong-version request is answered with ErrorEvent (ERR_MALFORMED, ERR_TOO_LARGE,
 *    ERR_VERSION, ERR_INVALID) by the server layer itself; the owner never sees it.
 *  - Every request has a deadline: a client call that gets no reply in time completes
 *    with err == TD_ETIMEDOUT, never hangs.
 *  - Reply to every TD_CTRL_IN_REQUEST exactly once (td_ctrl_server_reply*), or the
 *    client's call times out; td_ctrl_server_destroy releases unreplied handles.
 *
 * Threading: NNG callbacks only record the message in an inbox and wake the owner (the
 * client layer's callback also re-arms its Poll). Each td_ctrl_server / td_ctrl_client
 * belongs to one owner thread that calls every other function on it; objects of
 * different owners are independent. td_ctrl_encode/decode are reentrant.
 *
 * Ownership: decoded envelopes belong to the caller (td_ctrl_envelope_free). Messages
 * passed to send/reply functions are borrowed for the duration of the call. A
 * td_ctrl_server_in / td_ctrl_client_in owns what it points to until the next *_recv on
 * the same object or *_in_free, whichever comes first.
 */
#ifndef TD_CTRL_H
#define TD_CTRL_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "tandem_ctrl.pb-c.h"
#include "td_sampling.h"

#define TD_CTRL_VERSION 1u /* Envelope.version spoken by this build */

/* Hard limits checked by the decoder on top of td_ctrl_opts. */
#define TD_CTRL_MAX_STOP_IDS 64u
#define TD_CTRL_MAX_STRING   4096u      /* bytes of any string field but Sampling.grammar */
#define TD_CTRL_MAX_GRAMMAR  65536u     /* bytes of Sampling.grammar (GR_MAX_TEXT) */
#define TD_CTRL_MAX_BLOB     (1u << 20) /* bytes of kv_target */
#define TD_CTRL_MAX_CHUNKS   65536u     /* PrefillDone.chunk_sizes */
#define TD_CTRL_MAX_BATCH    4096u      /* events per Events reply */
#define TD_CTRL_MAX_LOGPROBS 20u        /* top alternatives per Logprob (OpenAI's limit) */
#define TD_CTRL_MAX_TAG      63u        /* bytes of Health's compute names (27-31) */
#define TD_CTRL_MAX_PATHS    1023u      /* bytes of Health.compute_paths */

/* Options; zero means the default shown. */
typedef struct {
    size_t max_msg_bytes; /* encoded envelope size limit; 0: 4 MiB */
    uint32_t max_tokens;  /* token ids per message (prompt, event); 0: 1 << 20 */
    uint32_t max_outbox;  /* server: unacknowledged events per client; 0: 1 << 16 */
    int poll_wait_ms;     /* client: how long the server holds a Poll; 0: 1000 */
    int peer_timeout_ms;  /* server: a client that has not polled this long is gone; 0: 10000 */
    int peer_grace_ms;    /* server: after its connection closed; 0: 2000 */
    int reconnect_min_ms; /* client dialer back-off; 0: 50 */
    int reconnect_max_ms; /* 0: 1000 */
    int send_timeout_ms;  /* server: bound on writing one reply; 0: 5000 */
    /* Mutual TLS (borrowed during create; the files are read then). NULL or ca NULL: plain
     * tcp://. Otherwise every tcp:// URL given to td_ctrl_server_listen or
     * td_ctrl_client_create is served as tls+tcp:// (ipc:// stays as it is): this side
     * presents cert/key and accepts only a peer whose certificate chains to ca (no host
     * name check: one cluster certificate may serve every host). cert and key NULL: no
     * certificate is presented (tests of the refusal). A tls+tcp:// URL without it is
     * TD_EINVAL. docs/control-plane.md, "Security". */
    const td_cfg_security *security;
} td_ctrl_opts;

/* ---- codec -------------------------------------------------------------------------- */

/* Pack env (version is set to TD_CTRL_VERSION when 0) into a malloc'd buffer. Fails with
 * TD_ERANGE when the result would exceed max_msg_bytes, TD_EINVAL on a missing body. */
int td_ctrl_encode(const Td__Envelope *env, const td_ctrl_opts *opts, uint8_t **buf, size_t *len);

/* Decode and validate one envelope. On success *out is the message (free with
 * td_ctrl_envelope_free). Errors (err, if not NULL, holds the reason):
 *   TD_ERANGE   over max_msg_bytes, a repeated-field limit or the decode memory budget
 *   TD_EFORMAT  not a protobuf Envelope (malformed, truncated)
 *   TD_EUNSUPP  Envelope.version differs from TD_CTRL_VERSION (detected even when the
 *               rest does not decode)
 *   TD_EINVAL   decodable but invalid (no body, negative token id, NaN, empty prompt)
 * Does not log: the caller decides (the server logs each rejected request once). */
int td_ctrl_decode(const void *buf, size_t len, const td_ctrl_opts *opts, Td__Envelope **out,
                   char *err, size_t errcap);

void td_ctrl_envelope_free(Td__Envelope *env); /* NULL is fine */

/* The wire code for a td_err from td_ctrl_decode (ERR_MALFORMED, ERR_TOO_LARGE, ...). */
Td__ErrorCode td_ctrl_err_code(int err);
const char *td_ctrl_err_name(Td__ErrorCode code);

/* Sampling parameters between td_sampling and the wire (the only conversion; a missing
 * Sampling message is all-zero: greedy). to_pb initializes pb. */
void td_ctrl_sampling_to_pb(const td_sampling *s, Td__Sampling *pb);
td_sampling td_ctrl_sampling_from_pb(const Td__Sampling *pb);

/* Logprob entries (n) to the wire: one malloc'd block holding n message pointers, the
 * messages and their arrays; free() it. NULL when n == 0 or on allocation failure. */
Td__Logprob **td_ctrl_logprobs_to_pb(const td_logprob_entry *e, size_t n);
/* One entry from the wire (a checked message: at most TD_MAX_TOP_LOGPROBS alternatives). */
void td_ctrl_logprob_from_pb(const Td__Logprob *pb, td_logprob_entry *e);
const char *td_ctrl_body_name(Td__Envelope__BodyCase body);
/* "HOST:PORT" or "[V6]:PORT" (a YAML address: router.membership's) -> "tcp://HOST:PORT"
 * (brackets for an IPv6 literal). TD_EINVAL without a port, TD_ERANGE if it does not fit. */
int td_ctrl_hostport_url(const char *hostport, char *url, size_t cap);

/* ---- server (decode rank 0, prefill stage 0) ------------------------------------------ */

typedef struct td_ctrl_server td_ctrl_server;
typedef struct td_ctrl_req td_ctrl_req; /* a request awaiting its reply */

int td_ctrl_server_create(const td_ctrl_opts *opts, td_ctrl_server **out);
/* Stops the sockets, replies to nothing more, frees every handle. NULL is fine. */
void td_ctrl_server_destroy(td_ctrl_server *s);

/* Listen on ipc://PATH or tcp://HOST:PORT (may be called several times). tcp port 0 picks
 * a free port; bound (if not NULL) receives the URL actually bound. */
int td_ctrl_server_listen(td_ctrl_server *s, const char *url, char *bound, size_t boundcap);

/* The load figures answered to HealthRequest and attached to every Events reply
 * (copied). Call whenever they change (e.g. once per step). HealthRequest is answered on
 * NNG's thread with the last figures set here, even while the owner is busy computing.
 * boot_id is set here to the server's event epoch (random per process): whatever the caller
 * put there is replaced. */
int td_ctrl_server_set_health(td_ctrl_server *s, const Td__Health *h);

typedef enum {
    TD_CTRL_IN_REQUEST = 1, /* env, req, client_id, deadline_ms */
    TD_CTRL_IN_PEER_GONE,   /* client_id: cancel its requests (it will not poll again) */
} td_ctrl_server_in_kind;

typedef struct {
    td_ctrl_server_in_kind kind;
    uint64_t client_id;      /* who sent it: events for this request go to this id */
    const Td__Envelope *env; /* REQUEST: body is submit/cancel/alloc/prefill/kv_target */
    td_ctrl_req *req;        /* REQUEST: reply handle, valid until replied */
    int64_t deadline_ms;     /* REQUEST: td_now_ms() when the client stops waiting */
} td_ctrl_server_in;

/* Wait up to timeout_ms (0: poll, < 0: forever) for the next request or peer event.
 * Also answers Poll, rejects bad messages, expires held Polls and
 * detects gone peers, so call it at least every poll_wait_ms while clients are connected
 * (a loop that calls it between steps does). Returns 0, TD_ETIMEDOUT, or TD_ESTATE when
 * the server is shutting down. The env stays valid until the request is replied. */
int td_ctrl_server_recv(td_ctrl_server *s, td_ctrl_server_in *in, int timeout_ms);

/* Reply to a request; the layer sets version and call_id. Consumes req in all cases
 * (also when it fails: the client then times out). */
int td_ctrl_server_reply(td_ctrl_server *s, td_ctrl_req *req, const Td__Envelope *reply);
int td_ctrl_server_reply_ack(td_ctrl_server *s, td_ctrl_req *req, uint64_t request_id);
int td_ctrl_server_reply_error(td_ctrl_server *s, td_ctrl_req *req, uint64_t request_id,
                               Td__ErrorCode code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* Queue an event for a client (copied; seq is set by the layer). Returns TD_ENOENT if
 * the client is unknown or gone (its requests should be dropped), TD_ENOSPC when its
 * outbox is full (the client is then reported gone). */
int td_ctrl_server_send_event(td_ctrl_server *s, uint64_t client_id, const Td__Event *ev);
int td_ctrl_server_send_tokens(td_ctrl_server *s, uint64_t client_id, uint64_t request_id,
                               uint32_t seq, const int32_t *tokens, size_t n_tokens,
                               Td__FinishReason finish, uint32_t prompt_tokens,
                               uint32_t completion_tokens, uint32_t cached_tokens);
int td_ctrl_server_send_error(td_ctrl_server *s, uint64_t client_id, uint64_t request_id,
                              Td__ErrorCode code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* An eventfd that is readable while td_ctrl_server_recv has work (for poll(2)); the
 * owner must still call recv at least every poll_wait_ms. */
int td_ctrl_server_fd(const td_ctrl_server *s);

typedef struct {
    uint64_t requests; /* requests handed to the owner */
    uint64_t rejected; /* bad messages answered with an error by the layer */
    uint64_t polls;    /* Poll requests served */
    uint64_t events;   /* events queued */
    uint32_t clients;  /* clients currently known */
    uint32_t pending;  /* requests not yet replied */
    uint32_t unacked;  /* events queued and not yet acknowledged by the known clients */
    uint64_t refused;  /* TLS: connections whose handshake failed, as counted by NNG (seen by
                          td_ctrl_server_recv at most once a second, and logged there) */
} td_ctrl_server_stats;
void td_ctrl_server_get_stats(const td_ctrl_server *s, td_ctrl_server_stats *st);

/* ---- client (router, test client) ------------------------------------------------------ */

typedef struct td_ctrl_client td_ctrl_client;

/* Dial url without waiting: the dialer connects (and reconnects) in the background and
 * the event Poll starts at once. A server that is not there yet is not an error; calls
 * time out until it comes. */
int td_ctrl_client_create(const char *url, const td_ctrl_opts *opts, td_ctrl_client **out);
void td_ctrl_client_destroy(td_ctrl_client *c); /* NULL is fine; pending calls are dropped */

/* Start a call (asynchronous): the reply, or the timeout, arrives as TD_CTRL_IN_REPLY
 * with the same call_id. The layer sets version, client_id, call_id and timeout_ms. */
int td_ctrl_client_call(td_ctrl_client *c, const Td__Envelope *req, int timeout_ms,
                        uint64_t *call_id);
int td_ctrl_client_submit(td_ctrl_client *c, const Td__Submit *sub, int timeout_ms,
                          uint64_t *call_id);
int td_ctrl_client_cancel(td_ctrl_client *c, uint64_t request_id, int timeout_ms,
                          uint64_t *call_id);
int td_ctrl_client_health(td_ctrl_client *c, int timeout_ms, uint64_t *call_id);
/* Send raw bytes as a request (tests of the server's handling of bad input). */
int td_ctrl_client_call_raw(td_ctrl_client *c, const void *buf, size_t len, int timeout_ms,
                            uint64_t *call_id);

typedef enum {
    TD_CTRL_IN_REPLY = 1,    /* call_id, err, env */
    TD_CTRL_IN_EVENTS,       /* events[0..n_events), health (may be NULL) */
    TD_CTRL_IN_CONNECTED,    /* a connection to the server came up */
    TD_CTRL_IN_DISCONNECTED, /* it went down (the dialer keeps retrying) */
    TD_CTRL_IN_RESTARTED,    /* a new server process answers (a new event epoch): whatever
                                the old one was doing for this client is lost; delivered
                                before any event of the new process */
} td_ctrl_client_in_kind;

typedef struct {
    td_ctrl_client_in_kind kind;
    uint64_t call_id;   /* REPLY */
    int err;            /* REPLY: 0 (env is the reply), TD_ETIMEDOUT (deadline passed),
                           TD_EFORMAT/TD_ERANGE/TD_EUNSUPP (bad reply), TD_EIO */
    Td__Envelope *env;  /* REPLY with err 0: ack, error, health, alloc_reply */
    Td__Event **events; /* EVENTS: new events in seq order, each exactly once */
    size_t n_events;
    const Td__Health *health; /* EVENTS: the server's load at the time, or NULL */
    void *priv_;              /* layer-owned storage */
} td_ctrl_client_in;

/* Wait up to timeout_ms (0: poll, < 0: forever) for a reply, events or a connection
 * change. Returns 0 or TD_ETIMEDOUT. Frees the previous in's storage first. */
int td_ctrl_client_recv(td_ctrl_client *c, td_ctrl_client_in *in, int timeout_ms);
void td_ctrl_client_in_free(td_ctrl_client_in *in); /* zeroed in is fine */

/* Readable while td_ctrl_client_recv has something (a router polls many clients). */
int td_ctrl_client_fd(const td_ctrl_client *c);
/* The server process's event epoch last seen by the event poll (0: none yet); a server
 * reports the same value as Health.boot_id. */
uint64_t td_ctrl_client_epoch(td_ctrl_client *c);

#endif
