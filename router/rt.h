/* rt.h: tandem-router, the OpenAI-compatible HTTP front door (prefix rt_).
 *
 * Purpose: accept /v1/completions and /v1/chat/completions over HTTP (libmicrohttpd),
 * tokenize on the router, send token ids to a decode instance over the control plane
 * (common/ctrl.h), detokenize the returned ids incrementally and answer as the OpenAI API
 * does (one JSON body, or Server-Sent Events). Files, one concern each:
 *   rt_main.c      command line, model metadata (tokenizer, chat template), start/stop
 *   rt_http.c      libmicrohttpd glue: routing, bodies, suspend/resume, SSE reader
 *   rt_openai.c    request JSON parsing/validation, response and error JSON
 *   rt_stream.c    per-request output: detokenizer, stop strings with hold-back, chunks
 *   rt_table.c     request table (router request id -> request)
 *   rt_registry.c  decode instances: heartbeats, liveness, scheduling choice
 *   rt_loop.c      the router loop thread: owns the ctrl clients and the request table
 *   rt_metrics.c   Prometheus counters, gauges and histograms
 *
 * A request's life (loop side, rt_loop.c):
 *
 *   HTTP thread: parse + validate --rt_loop_post--> INBOX
 *   INBOX --admit--> QUEUED (router queue, bounded by router.max_queue; full: 429)
 *   QUEUED --dispatch (rt_reg_pick)--> SUBMITTED (Submit sent, waiting for the Ack)
 *   SUBMITTED --Ack--> RUNNING --TokenEvent*--> RUNNING --finish/stop string--> DONE
 *   SUBMITTED --ErrorEvent BUSY / timeout, nothing streamed--> QUEUED (retried)
 *   any --instance dead / error / client gone / shutdown--> DONE
 * DONE requests are out of the table; their remaining bytes sit in rt_req.out until the
 * HTTP side has written them.
 *
 * Invariants:
 *  - Nothing reaches the client that could be part of a stop string (rt_stream.c keeps the
 *    longest text suffix that is a prefix of a stop string until it can be decided).
 *  - An rt_req is referenced by the HTTP connection, the loop and (streaming) the MHD
 *    response; it is freed when the last of them lets go (rt_req_release).
 *  - The HTTP side never waits for the control plane: it posts to the loop and suspends
 *    the connection; the loop resumes it when bytes or a final status are ready.
 *
 * Threading: MHD's internal threads run rt_http.c; one loop thread runs rt_loop.c,
 * rt_registry.c, rt_table.c and rt_stream.c. They share only: rt_req's fields marked
 * "shared" (under rt_req.mu), the inbox (rt_router.in_mu), rt_metrics (its own lock),
 * and the atomics of rt_router. The tokenizer and the config are read-only after start.
 *
 * Ownership: rt_router owns the config, the tokenizer, the daemon and the loop. Parsed
 * request parameters (rt_params) belong to their rt_req.
 */
#ifndef RT_H
#define RT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chat_template.h"
#include "config.h"
#include "ctrl.h"
#include "tokenizer.h"

#define RT_MAX_BODY       (4u << 20) /* bytes of a request body; more: 413 */
#define RT_MAX_STOP       4          /* stop strings per request */
#define RT_MAX_STOP_BYTES 1024       /* bytes of one stop string */
#define RT_POKE_MS        300        /* resume idle suspended connections this often */

/* ---- byte buffer ---------------------------------------------------------------------- */

typedef struct {
    char *buf;  /* (cap) bytes, buf[len] == 0 when cap > 0 */
    size_t len; /* bytes used */
    size_t cap;
} rt_buf;

int rt_buf_append(rt_buf *b, const void *p, size_t n); /* 0 or TD_ENOMEM */
int rt_buf_puts(rt_buf *b, const char *s);
void rt_buf_consume(rt_buf *b, size_t n); /* drop the first n bytes */
void rt_buf_free(rt_buf *b);

/* ---- errors as the OpenAI API shows them ----------------------------------------------- */

typedef struct {
    int status; /* HTTP status: 400, 401, 404, 405, 413, 429, 500, 503 */
    char message[512];
    const char *type;  /* "invalid_request_error", ... */
    const char *param; /* the offending field or NULL */
    const char *code;  /* a machine-readable code or NULL */
} rt_error;

/* Fill e and return e->status. type NULL: derived from the status. */
int rt_error_set(rt_error *e, int status, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* {"error": {...}} as a malloc'd NUL-terminated string (NULL on allocation failure). */
char *rt_error_json(const rt_error *e);

/* ---- parsed request ------------------------------------------------------------------- */

typedef enum { RT_EP_COMPLETIONS = 0, RT_EP_CHAT = 1 } rt_endpoint;

typedef struct {
    rt_endpoint ep;
    int32_t *prompt; /* (n_prompt) token ids, malloc'd */
    size_t n_prompt;
    int max_tokens;
    float temperature; /* 0: greedy */
    float top_p, min_p, repeat_penalty;
    int top_k;
    uint64_t seed;
    bool ignore_eos;
    char *stop[RT_MAX_STOP]; /* NUL-terminated, malloc'd, non-empty */
    size_t stop_len[RT_MAX_STOP];
    int n_stop;
    bool stream, include_usage;
} rt_params;

void rt_params_fini(rt_params *p);

struct rt_router;

/* Parse and validate a request body for ep. Returns 0 with *p filled, or the HTTP
 * status with e filled (p is then empty). */
int rt_openai_parse(const struct rt_router *r, rt_endpoint ep, const char *body, size_t len,
                    rt_params *p, rt_error *e);

/* /v1/models body (malloc'd). */
char *rt_openai_models(const struct rt_router *r);

/* ---- a request shared by the HTTP side and the loop ------------------------------------ */

typedef enum {
    RT_ST_INBOX = 0,
    RT_ST_QUEUED,
    RT_ST_SUBMITTED,
    RT_ST_RUNNING,
    RT_ST_DONE,
} rt_state;

typedef struct rt_req {
    /* immutable once posted to the loop */
    char oid[48];        /* "cmpl-..." / "chatcmpl-..." */
    int64_t created;     /* unix seconds */
    int64_t t_arrive_ms; /* td_ctrl_now_ms() when the body was complete */
    rt_params p;

    /* shared, under mu */
    pthread_mutex_t mu;
    int refs;
    rt_buf out;     /* bytes for the client: SSE text, or the whole JSON body */
    int status;     /* 0: not final yet; else the HTTP status of out (non-stream/errors) */
    bool done;      /* the loop has written everything it will write */
    bool sse;       /* out holds SSE bytes: the response is (or will be) a stream */
    bool suspended; /* the connection is suspended waiting for the loop */
    bool http_gone; /* the connection is closed; never resume it again */
    struct rt_router *router; /* set before the SSE response starts (metrics) */
    int64_t t_pending_ns;     /* SSE: when the token events behind the oldest unsent bytes of out
                                 reached the loop (0: out empty); the router-overhead histogram */
    struct MHD_Connection *conn;

    /* loop-owned */
    rt_state state;
    uint64_t rid;     /* control-plane request id (rt_table) */
    int inst;         /* instance index, -1 none */
    uint64_t call_id; /* the Submit call while SUBMITTED */
    int retries;      /* re-queued after BUSY / timeout */
    bool gone_posted; /* http side: GONE was posted */
    td_detok dt;
    bool dt_init;
    rt_buf held;    /* detokenized text not yet emitted (possible stop prefix) */
    rt_buf text;    /* non-stream: emitted text */
    bool role_sent; /* chat stream: the role chunk went out */
    bool stop_hit;  /* a stop string matched: the rest of the text is dropped */
    int n_gen;      /* tokens received */
    int64_t t_first_ms, t_last_ms;
    struct rt_req *next;      /* inbox / queue link */
    struct rt_req *gone_next; /* gone list link */
} rt_req;

rt_req *rt_req_create(void);
void rt_req_retain(rt_req *q);
void rt_req_release(rt_req *q); /* frees at 0 */

/* ---- output (loop thread; rt_stream.c) --------------------------------------------------- */

typedef enum { RT_FIN_NONE = 0, RT_FIN_STOP, RT_FIN_LENGTH } rt_finish;

/* Longest suffix of text[0..len) that is a proper prefix of one of the stop strings. */
size_t rt_stop_holdback(const char *text, size_t len, char *const *stop, const size_t *stop_len,
                        int n_stop);
/* Offset of the earliest full stop-string match in text, or -1. */
long rt_stop_find(const char *text, size_t len, char *const *stop, const size_t *stop_len,
                  int n_stop);

/* Feed generated ids. Emits the text that can no longer be part of a stop string (as an
 * SSE chunk or into q->text). Returns RT_FIN_STOP when a stop string matched (the text up
 * to it was emitted and the request is finished), else RT_FIN_NONE; negative td_err on
 * allocation failure or an invalid id. Caller holds nothing; takes q->mu itself. */
int rt_stream_tokens(const struct rt_router *r, rt_req *q, const int32_t *ids, size_t n);
/* Finish: flush the detokenizer and the held text (cut at a stop string), write the last
 * chunk with finish_reason, the usage chunk and [DONE] (stream) or the whole JSON body
 * (status 200), and mark done. */
int rt_stream_finish(const struct rt_router *r, rt_req *q, rt_finish fin);
/* Fail: status e->status as JSON if nothing was streamed yet, else an SSE error event and
 * [DONE]; marks done. */
void rt_stream_fail(rt_req *q, const rt_error *e);

/* ---- request table (loop thread) --------------------------------------------------------- */

typedef struct {
    rt_req **slots; /* (cap) */
    uint32_t *free_list;
    uint32_t n_free, cap, count;
    uint64_t gen; /* makes request ids unique over time */
} rt_table;

int rt_table_add(rt_table *t, rt_req *q); /* sets q->rid */
rt_req *rt_table_get(const rt_table *t, uint64_t rid);
void rt_table_remove(rt_table *t, rt_req *q);
void rt_table_fini(rt_table *t);

/* ---- instance registry (loop thread) ------------------------------------------------------ */

typedef struct {
    uint64_t call_id;
    uint64_t rid; /* 0: health / cancel */
} rt_call;

typedef struct {
    const td_cfg_decode *cfg;
    char url[160];
    td_ctrl_client *c;
    td_ctrl_client_in in;
    bool alive; /* answered within instance_timeout_ms and ready */
    bool ever_seen;
    int64_t last_seen_ms;
    int64_t last_hb_ms;
    uint64_t hb_call; /* outstanding health call, 0 none */
    int64_t busy_until_ms;
    uint32_t running, waiting, kv_used, kv_free; /* last figures */
    bool ready;
    int active; /* router requests SUBMITTED or RUNNING on it */
    int cap;    /* most requests the router gives it at once */
} rt_inst;

typedef struct {
    rt_inst *inst; /* (n) */
    int n;
} rt_registry;

int rt_reg_init(rt_registry *g, const td_cfg *cfg);
void rt_reg_fini(rt_registry *g);
/* Record a sign of life and health figures (h may be NULL). Returns true if the instance
 * just came (back) up. */
bool rt_reg_seen(rt_registry *g, int i, const Td__Health *h, int64_t now);
/* Send heartbeats that are due. */
void rt_reg_heartbeat(rt_registry *g, const td_cfg_router *rc, int64_t now);
/* Index of the best instance for a new request, or -1 (none alive with room). */
int rt_reg_pick(const rt_registry *g, int64_t now);
int rt_reg_n_alive(const rt_registry *g);

/* ---- metrics (any thread) ----------------------------------------------------------------- */

#define RT_HIST_BUCKETS 16

typedef struct {
    uint64_t counts[RT_HIST_BUCKETS + 1]; /* per bucket, last: +Inf */
    double sum;
    uint64_t n;
} rt_hist;

typedef struct {
    uint32_t running, waiting, kv_used, kv_free;
    bool alive;
} rt_inst_gauge;

typedef struct {
    pthread_mutex_t mu;
    uint64_t by_status[600]; /* responses by HTTP status */
    uint64_t prompt_tokens, generation_tokens;
    rt_hist ttft, tpot, e2e; /* seconds */
    rt_hist write_delay;     /* seconds: token event received -> its bytes handed to the socket */
    rt_inst_gauge *inst;     /* (n_inst) */
    int n_inst;
    int queue;  /* requests in the router queue */
    int active; /* requests on instances */
} rt_metrics;

int rt_metrics_init(rt_metrics *m, int n_inst);
void rt_metrics_fini(rt_metrics *m);
void rt_metrics_status(rt_metrics *m, int status);
void rt_metrics_request_done(rt_metrics *m, const rt_req *q, int64_t now_ms);
void rt_metrics_write_delay(rt_metrics *m, double seconds);
int64_t rt_now_ns(void); /* CLOCK_MONOTONIC */
/* Prometheus text exposition (malloc'd). */
char *rt_metrics_render(rt_metrics *m, const struct rt_router *r);

/* ---- the router --------------------------------------------------------------------------- */

typedef struct rt_router {
    td_cfg *cfg;
    td_gguf *gguf;
    td_tokenizer *tok;
    const char *tmpl; /* chat template text (into gguf, or a built-in one) */
    size_t tmpl_len;
    int32_t n_ctx; /* model context length */
    char model_name[256];
    char api_key_hdr[512]; /* "Bearer KEY", or "" */
    struct MHD_Daemon *mhd;

    /* inbox: HTTP -> loop */
    pthread_mutex_t in_mu;
    rt_req *in_head, *in_tail; /* new requests */
    rt_req *gone_head;         /* closed connections */
    bool closing;              /* shutting down: nothing more is posted */
    int wake_fd;               /* eventfd */
    atomic_bool stop;
    atomic_int n_alive; /* instances able to serve (for /health) */
    atomic_int queued;  /* requests posted but not yet on an instance */
    atomic_int open;    /* generation requests whose response is not complete */

    pthread_t loop;
    bool loop_started;
    int64_t t_events_ns;     /* loop-owned: when the batch of events in hand was received */
    rt_registry reg;         /* loop-owned */
    rt_table table;          /* loop-owned */
    rt_req *q_head, *q_tail; /* loop-owned router queue */
    int q_len;

    rt_metrics metrics;
} rt_router;

/* rt_loop.c */
int rt_loop_start(rt_router *r);
/* Answer every open request (503), join the thread. Call with closing set. */
void rt_loop_stop(rt_router *r);
/* After the HTTP server stopped: free the loop's structures. */
void rt_loop_drain(rt_router *r);
/* Hand a parsed request to the loop (takes a reference); suspends q->conn first, under
 * the inbox lock. false when the router is closing (nothing was done). */
bool rt_loop_post(rt_router *r, rt_req *q);
/* The connection of q closed (the loop cancels it on its instance). */
void rt_loop_gone(rt_router *r, rt_req *q);
/* Resume q's connection if it is suspended (any thread; takes q->mu). */
void rt_req_wake(rt_req *q);

/* rt_http.c */
int rt_http_start(rt_router *r, const char *host, int port);
/* Stop taking connections, give open responses up to wait_ms to finish, stop. */
void rt_http_stop(rt_router *r, int wait_ms);

#endif
