/* rt.h: tandem-router, the OpenAI-compatible HTTP front door (prefix rt_).
 *
 * Purpose: accept /v1/completions and /v1/chat/completions over HTTP (libmicrohttpd),
 * tokenize on the router, send token ids to a decode instance over the control plane
 * (common/ctrl.h), detokenize the returned ids incrementally and answer as the OpenAI API
 * does (one JSON body, or Server-Sent Events). With prefill instances in the YAML every
 * request is served disaggregated: a prefill instance computes the prompt's KV and pushes it
 * to a decode instance, which then generates (rt_pair.c). Files, one concern each:
 *   rt_main.c      command line, model metadata (tokenizer, chat template), start/stop
 *   rt_http.c      libmicrohttpd glue: routing, bodies, suspend/resume, SSE reader
 *   rt_openai.c    request JSON parsing/validation, response and error JSON
 *   rt_stream.c    per-request output: detokenizer, stop strings with hold-back, chunks
 *   rt_table.c     request table (router request id -> request)
 *   rt_registry.c  decode and prefill instances: heartbeats, liveness, scheduling choice
 *   rt_loop.c      the router loop thread: owns the ctrl clients and the request table
 *   rt_pair.c      disaggregated mode: pairing, KV target relay, prefill failures, retries
 *   rt_fair.c      the router queue: one FIFO per client, served round robin
 *   rt_metrics.c   Prometheus counters, gauges and histograms
 *
 * A request's life (loop side, rt_loop.c):
 *
 *   HTTP thread: parse + validate --rt_loop_post--> INBOX
 *   INBOX --admit--> QUEUED (router queue, bounded by router.max_queue; full: 429 to the
 *         client holding the most queued requests, which may evict its newest one)
 *   QUEUED --dispatch (round robin over clients, rt_reg_pick)--> SUBMITTED (Submit sent)
 *   SUBMITTED --Ack--> RUNNING --TokenEvent*--> RUNNING --finish/stop string--> DONE
 *   SUBMITTED --ErrorEvent BUSY / timeout, nothing streamed--> QUEUED (retried)
 *   any --deadline (504) / instance dead / error / client gone / shutdown--> DONE
 * Every request has a deadline (expires_ms: arrival + router.request_timeout_ms or what
 * it asked for); time queued counts. Past it the loop cancels it on its instance(s) and
 * ends it with 504 request_timeout (or an SSE error event once streaming started).
 * Disaggregated mode (rt_pair.c has the details): dispatch sends Alloc to the decode leader
 * and Prefill to the prefill leader of one *attempt* (its own request id, used on both
 * sides); SUBMITTED waits for AllocReply, RUNNING means the decode side holds the request.
 * The prefill side is tracked beside the state (pf_busy, pf_acked): KvTarget is relayed
 * once both the Ack of Prefill and the AllocReply are in. A failure before the first token
 * cancels both sides and re-queues the request (one prefill retry), else ends it.
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
#include "td_sampling.h"
#include "tokenizer.h"

#define RT_MIN_BODY       (1u << 20)   /* floor of the body limit (rt_max_body) */
#define RT_MAX_BODY       (256u << 20) /* ceiling of the body limit */
#define RT_MAX_HEADERS    (32u << 10)  /* request line + headers (MHD's pool); more: 431 */
#define RT_MAX_STOP       4            /* stop strings per request */
#define RT_MAX_STOP_BYTES 1024         /* bytes of one stop string */
#define RT_POKE_MS        300          /* resume idle suspended connections this often */

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
    int status; /* HTTP status: 400, 401, 404, 405, 413, 429, 500, 503, 504 */
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
    td_sampling sampling; /* .skip_samples is set per attempt (rt_req_submit_msg) */
    bool ignore_eos;
    char *stop[RT_MAX_STOP]; /* NUL-terminated, malloc'd, non-empty */
    size_t stop_len[RT_MAX_STOP];
    int n_stop;
    bool stream, include_usage;
    int64_t timeout_ms; /* the body's "timeout" (seconds) in ms; 0: not given */
    bool no_migrate;    /* the body's "migrate": false: fail rather than move mid-stream */
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
    int64_t expires_ms;  /* the request's deadline (td_ctrl_now_ms clock); 0: none */
    uint64_t client;     /* fairness key: hash of the remote address and Authorization */
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
    int fd; /* conn's socket, -1 unknown: the loop peeks at it while conn is suspended */

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

    /* loop-owned: migration (rt_loop.c, "lost"): a request whose decode side was lost
       continues on another attempt from the prompt plus the tokens already received */
    int32_t *gen_ids; /* (cap_gen) the ids received so far, gen_ids[0..n_gen) */
    int cap_gen;
    int32_t *resume; /* (n_resume) prompt + gen_ids[0..gen_base): the current attempt's
                        prompt when gen_base > 0, else NULL (p.prompt) */
    size_t n_resume;
    int gen_base;    /* tokens received before the current attempt: its first token is the
                        one that makes n_gen > gen_base */
    int migrations;  /* times its decode side was lost and it moved (router.max_migrations) */
    int64_t lost_ms; /* when its decode side was lost; 0 once the next token arrived */

    /* loop-owned, disaggregated mode only (rt_pair.c) */
    int attempts;                 /* pairings started; each after the first takes a fresh rid */
    int busy;                     /* ERR_BUSY bounces from either side (not failures) */
    int pinst;                    /* prefill instance of the attempt, -1 none */
    uint64_t pf_call;             /* outstanding Prefill (until acked) or KvTarget call, 0 none */
    bool pf_busy;                 /* the prefill side may still work on the attempt */
    bool pf_acked;                /* Prefill was acknowledged (a Cancel can now reach it) */
    bool kvt_sent;                /* the KV targets went to the prefill side */
    bool pf_retried;              /* the one retry after a prefill failure was used */
    int pf_avoid;                 /* the retry's prefill instance must differ from this, -1 none */
    bool pf_same_ok;              /* ... unless no other is alive (the failure was a timeout) */
    int64_t deadline_ms;          /* the attempt's first token is due by then, 0 none */
    ProtobufCBinaryData *targets; /* (n_targets) AllocReply's targets until relayed */
    size_t n_targets;
    char pf_fail[320]; /* the first prefill failure, for the client's error message */

    struct rt_req *next;      /* inbox / queue link */
    struct rt_req *qprev;     /* queue: the previous request of the same client */
    int fslot;                /* queue: the client's slot in rt_fair, -1 not queued */
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
    const td_cfg_decode *cfg;   /* decode instance; NULL for a prefill instance */
    const td_cfg_prefill *pcfg; /* prefill instance; NULL for a decode instance */
    const char *name;           /* from the YAML */
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
    int active;             /* decode: router requests SUBMITTED or RUNNING on it; prefill: attempts
                               with pf_busy on it */
    int cap;                /* most requests the router gives it at once */
    uint64_t queued_tokens; /* prefill: Health.queued_prompt_tokens */
    uint64_t inflight_tokens; /* prefill: prompt tokens of the router's attempts on it */
    bool role_warned;         /* prefill: logged once that it does not say ROLE_PREFILL */
    rt_call *orphans;         /* prefill: (n_orphans) Prefill calls of abandoned attempts:
                                 their Ack is answered with a Cancel */
    int n_orphans, cap_orphans;
} rt_inst;

typedef struct {
    rt_inst *inst; /* (n) decode instances, YAML order */
    int n;
    rt_inst *pf; /* (n_pf) prefill instances, YAML order; none: colocated mode */
    int n_pf;
    unsigned pf_rr; /* round-robin start among equally loaded prefill instances */
} rt_registry;

int rt_reg_init(rt_registry *g, const td_cfg *cfg);
void rt_reg_fini(rt_registry *g);
/* Record a sign of life and health figures (h may be NULL) of s. A prefill instance must
 * say ROLE_PREFILL to count as ready. Returns true if the instance just came (back) up. */
bool rt_reg_seen(rt_inst *s, const Td__Health *h, int64_t now);
/* Send heartbeats that are due (decode and prefill instances). */
void rt_reg_heartbeat(rt_registry *g, const td_cfg_router *rc, int64_t now);
/* Index of the best decode instance for a new request, or -1 (none alive with room):
 * the most free KV blocks, then the fewest running + router-active requests. */
int rt_reg_pick(const rt_registry *g, int64_t now);
/* Index of the prefill instance for a new attempt, or -1 (none alive with room); never
 * `avoid` (-1: no exclusion). Least load first: max(reported queued prompt tokens, prompt
 * tokens of the router's own attempts on it: they count before a health report shows
 * them), then fewest waiting + running, then round robin (g->pf_rr advances past the
 * choice, so a run of idle instances is used in turn). */
int rt_reg_pick_prefill(rt_registry *g, int64_t now, int avoid);
int rt_reg_n_alive(const rt_registry *g);
/* Prefill instances alive (ready), not counting `avoid` (-1: count all). */
int rt_reg_n_pf_alive(const rt_registry *g, int avoid);

/* ---- the router queue: per-client FIFOs served round robin (loop thread; rt_fair.c) -- */

#define RT_FAIR_CLIENTS 256 /* clients with a slot of their own; more share one slot */

typedef struct {
    uint64_t key;
    rt_req *head, *tail; /* queued requests, oldest first (a request put back at the head) */
    int n;               /* requests in the list; 0: the slot is free */
    int next, prev;      /* ring of slots with queued requests */
} rt_fair_client;

typedef struct {
    rt_fair_client c[RT_FAIR_CLIENTS + 1]; /* the last one: the overflow slot */
    int n_clients;                         /* slots in the ring */
    int cur;                               /* the slot served next (when n_clients > 0) */
    int len;                               /* requests queued in all */
} rt_fair;

/* Slot of key: its own, else a free one, else the overflow slot. */
int rt_fair_slot(const rt_fair *f, uint64_t key);
/* Requests queued under key's slot (what a newcomer with that key would join). */
int rt_fair_count(const rt_fair *f, uint64_t key);
/* Append q (key q->client) to its client's FIFO; sets q->fslot. */
void rt_fair_push(rt_fair *f, rt_req *q);
/* Put q at the head of its client's FIFO and serve that client next (a retry). */
void rt_fair_push_front(rt_fair *f, rt_req *q);
/* The request dispatch should take next, or NULL. */
rt_req *rt_fair_peek(const rt_fair *f);
/* Take the peeked request off the queue and move on to the next client. */
rt_req *rt_fair_pop(rt_fair *f);
/* Take q (queued) off the queue wherever it is. */
void rt_fair_remove(rt_fair *f, rt_req *q);
/* The queue is full and a request of key arrives: the newest queued request of the client
 * holding the most, if that client holds more than key's client would after admitting
 * the newcomer (so refusing it narrows the gap), else NULL (refuse the newcomer). */
rt_req *rt_fair_victim(const rt_fair *f, uint64_t key);

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
    uint64_t queued_tokens;
    uint32_t running, waiting;
    int active; /* the router's attempts on it */
    bool alive;
} rt_pf_gauge;

/* Where a request was when its deadline passed (metric label). */
typedef enum {
    RT_TO_QUEUED = 0, /* in the router queue */
    RT_TO_WAITING,    /* on its instance(s), no token yet (disaggregated: prefilling) */
    RT_TO_GENERATING, /* tokens were coming */
    RT_TO_N
} rt_timeout_state;

/* Why a disaggregated attempt failed before its first token (metric label). */
typedef enum {
    RT_PF_ERROR = 0, /* the prefill instance reported an error (reply or ErrorEvent) */
    RT_PF_DEAD,      /* the prefill instance was marked dead */
    RT_PF_TRANSFER,  /* the decode side reported the KV transfer failed / timed out */
    RT_PF_DEADLINE,  /* no first token by the attempt's deadline */
    RT_PF_N
} rt_pf_fail;

typedef struct {
    pthread_mutex_t mu;
    uint64_t by_status[600]; /* responses by HTTP status */
    uint64_t prompt_tokens, generation_tokens;
    rt_hist ttft, tpot, e2e; /* seconds */
    rt_hist write_delay;     /* seconds: token event received -> its bytes handed to the socket */
    rt_inst_gauge *inst;     /* (n_inst) */
    int n_inst;
    int queue;                  /* requests in the router queue */
    int active;                 /* requests on instances */
    uint64_t timeouts[RT_TO_N]; /* requests ended by their deadline */
    uint64_t evictions;         /* queued requests refused to make room for a quieter client */
    uint64_t migrations;        /* times a request's decode side was lost and it moved */
    rt_hist migrate_pause;      /* seconds: decode side lost -> the next token (moved requests) */
    bool draining;              /* SIGTERM/SIGINT received */
    /* disaggregated mode */
    uint64_t pf_requests; /* Prefill messages sent (attempts) */
    uint64_t pf_retries;  /* attempts retried after a prefill failure */
    uint64_t pf_failures[RT_PF_N];
    uint64_t busy_decode, busy_prefill; /* ERR_BUSY bounces */
    rt_hist chunk;                      /* tokens: chunk sizes from PrefillDone */
    rt_hist pf_time, pf_queued;         /* seconds: PrefillDone.prefill_ms, queued_ms */
    rt_pf_gauge *pf;                    /* (n_pf) */
    int n_pf;
    uint64_t *http; /* (RT_PATH_N, 600) responses to non-generation requests by path and
                      status (rt_metrics_http) */
} rt_metrics;

int rt_metrics_init(rt_metrics *m, int n_inst, int n_pf);
void rt_metrics_fini(rt_metrics *m);
void rt_metrics_status(rt_metrics *m, int status);
void rt_metrics_write_delay(rt_metrics *m, double seconds);
void rt_metrics_prefill_done(rt_metrics *m, const Td__PrefillDone *d);
typedef enum {
    RT_PM_SENT = 0,     /* a Prefill went out (an attempt) */
    RT_PM_RETRY,        /* a request is retried after a prefill failure */
    RT_PM_BUSY_DECODE,  /* ERR_BUSY to Alloc */
    RT_PM_BUSY_PREFILL, /* ERR_BUSY to Prefill */
    RT_PM_FAIL,         /* an attempt failed before its first token (why) */
} rt_pair_metric;
void rt_metrics_pair(rt_metrics *m, rt_pair_metric what, rt_pf_fail why);
void rt_metrics_timeout(rt_metrics *m, rt_timeout_state where);
void rt_metrics_eviction(rt_metrics *m);
/* A request moved (rt_loop_lose); a moved request's next token came `pause` s after. */
void rt_metrics_migration(rt_metrics *m);
void rt_metrics_migrated(rt_metrics *m, double pause);
int64_t rt_now_ns(void); /* CLOCK_MONOTONIC */
/* Prometheus text exposition (malloc'd). */
char *rt_metrics_render(rt_metrics *m, const struct rt_router *r);
/* Non-generation paths, counted apart from the API (generation) requests. */
typedef enum {
    RT_PATH_HEALTH = 0, /* /health */
    RT_PATH_METRICS,    /* /metrics */
    RT_PATH_MODELS,     /* /v1/models */
    RT_PATH_OTHER,      /* anything else (404) */
    RT_PATH_N
} rt_path;
/* A response with status (100..599) to a request on a non-generation path. */
void rt_metrics_http(rt_metrics *m, rt_path path, int status);
/* A generation request ended, however: finished (status 200, outcome its finish reason
 * "stop" / "length"), failed, timed out, refused or left by its client (status: the HTTP
 * status its answer has or would have had, also when it goes out as an SSE error event;
 * outcome: the error code, or NULL). Logs the request's one info line (id, endpoint,
 * status, outcome, prompt and output tokens, TTFT, total time, instances; never the
 * prompt) and, finished, records its tokens and latencies. Loop thread, before q is
 * retired. */
void rt_metrics_request_end(struct rt_router *r, const rt_req *q, int64_t now_ms, int status,
                            const char *outcome);

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
    size_t max_body;       /* bytes of a request body (rt_max_body); more: 413 */
    struct MHD_Daemon *mhd;

    /* inbox: HTTP -> loop */
    pthread_mutex_t in_mu;
    rt_req *in_head, *in_tail; /* new requests */
    rt_req *gone_head;         /* closed connections */
    bool closing;              /* shutting down: nothing more is posted */
    int wake_fd;               /* eventfd */
    atomic_bool stop;
    bool disagg;           /* prefill instances configured (read-only after start) */
    atomic_int n_alive;    /* decode instances able to serve (for /health) */
    atomic_int n_pf_alive; /* prefill instances able to serve */
    atomic_int queued;     /* requests posted but not yet on an instance */
    atomic_int open;       /* generation requests whose response is not complete */
    atomic_bool draining;  /* stop signal: new requests get 503, in-flight ones may finish */

    pthread_t loop;
    bool loop_started;
    int64_t t_events_ns; /* loop-owned: when the batch of events in hand was received */
    rt_registry reg;     /* loop-owned */
    rt_table table;      /* loop-owned */
    rt_fair fair;        /* loop-owned router queue (fair.len requests) */

    rt_metrics metrics;
} rt_router;

/* rt_loop.c */
int rt_loop_start(rt_router *r);
/* Answer every open request (503 shutting_down, cancelled on its instances; the Cancels
 * are given up to 500 ms to reach them), join the thread. Call with closing set. */
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

/* rt_loop.c internals shared with rt_pair.c (loop thread). */
/* Take q out of the loop's structures (cancelling a busy prefill side), drop the loop's
 * reference. */
void rt_loop_retire(rt_router *r, rt_req *q);
/* End q with an error (JSON status if nothing was streamed, else an SSE error event). */
void rt_loop_fail(rt_router *r, rt_req *q, int status, const char *code, const char *msg);
/* Put q back at the head of the router queue (counts a retry). */
void rt_loop_requeue(rt_router *r, rt_req *q);
/* Cancel q's request id on its decode instance (if any). */
void rt_loop_cancel_decode(rt_router *r, rt_req *q);
/* q's decode side is lost (its instance died, restarted, failed the request or is
 * stopping: why says which), maybe after tokens were streamed. Migration: q goes back to
 * the head of the router queue and its next attempt sends the prompt followed by every
 * token received so far, with max_tokens reduced by as many, so the instance that takes it
 * over computes their KV and goes on from the next token: the client's stream continues
 * with nothing repeated or missing (greedy output equals an uninterrupted run up to float rounding:
 * the streamed tokens' KV is recomputed in a prefill chunk). A request that may not move (the body
 * said "migrate": false, router.max_migrations reached) ends with 503 instance_unavailable (an SSE
 * error event once streaming started); a moving request waits up to router.migrate_wait_ms for a
 * live instance (liveness). */
void rt_loop_lose(rt_router *r, rt_req *q, const char *why, int64_t now);
/* Does a decode ErrorEvent with this code mean the request's decode side was lost (a rank
 * died, the instance is stopping), so that it should move rather than fail? */
bool rt_code_lost(int code);
/* The prompt of q's current attempt: p.prompt, or the resumed one (rt_loop_lose). */
int32_t *rt_req_prompt(const rt_req *q, size_t *n);

/* rt_pair.c: disaggregated mode (loop thread). */
/* Start an attempt of q (off the queue) on decode instance d and prefill instance p:
 * Alloc and Prefill (without targets) at once; an attempt after the first takes a fresh
 * request id. 0, or a td_err (nothing is left on either instance; the caller fails q). */
int rt_pair_start(rt_router *r, rt_req *q, int d, int p, int64_t now);
/* The Submit (and its Sampling) of a request, for a colocated Submit or inside an Alloc
 * (rt_loop.c); both point into q. */
void rt_req_submit_msg(const rt_req *q, Td__Sampling *sm, Td__Submit *sub);
/* The reply to q's Alloc on decode instance i. */
void rt_pair_on_alloc(rt_router *r, rt_req *q, int i, const td_ctrl_client_in *in, int64_t now);
/* An AllocReply that matches no live attempt: cancel it on decode instance i. */
void rt_pair_orphan_alloc(rt_router *r, int i, const Td__Envelope *env);
/* A decode ErrorEvent for q (an attempt on instance q->inst). */
void rt_pair_on_decode_error(rt_router *r, rt_req *q, const Td__ErrorEvent *e, int64_t now);
/* End q's current attempt on both sides (cancelled where they may hold it); q is then on no
 * instance (inst -1, state INBOX). */
void rt_pair_abandon(rt_router *r, rt_req *q);
/* Replies and events from prefill instance j. */
void rt_pair_on_reply(rt_router *r, int j, const td_ctrl_client_in *in, int64_t now);
void rt_pair_on_events(rt_router *r, int j, const td_ctrl_client_in *in, int64_t now);
/* Prefill instance j stopped answering: its attempts before their first token fail over. */
void rt_pair_prefill_died(rt_router *r, int j);
/* A new process answers for prefill instance j: its attempts before their first token
 * start again (on it or another one, rt_loop_lose). */
void rt_pair_prefill_restarted(rt_router *r, int j, int64_t now);
/* Attempts past their deadline: cancel both sides, fail the request. */
void rt_pair_deadlines(rt_router *r, int64_t now);
/* The request ends: cancel its prefill side if still busy, free the relay buffers. */
void rt_pair_release(rt_router *r, rt_req *q);
/* Dispatch check for the queue head q when no prefill instance can take it now: true when
 * it can never be served (its retry must avoid the only alive instance); then it was
 * failed. */
bool rt_pair_unservable(rt_router *r, rt_req *q);
/* First-token deadline of an attempt started at now: kvxfer.timeout_ms (the nodes' own
 * bound on every KV wait, so their error normally comes first) + instance_timeout_ms (a
 * dead node is noticed by then) + 2 s for the messages. */
int64_t rt_pair_deadline(const td_cfg *cfg, int64_t now);

/* rt_http.c */
/* The body limit for cfg: 64 bytes per router.max_prompt_tokens (a prompt as JSON text
 * with room for escapes and chat framing), within [RT_MIN_BODY, RT_MAX_BODY]. */
size_t rt_max_body(const td_cfg *cfg);
/* Constant-time equality of a presented credential with the expected one (the time
 * depends on the expected length only). */
bool rt_key_equal(const char *given, const char *expected);
/* The fairness key of a client: its remote address and its Authorization header value
 * (either may be absent). */
uint64_t rt_client_key(const void *addr, size_t addr_len, const char *auth);
int rt_http_start(rt_router *r, const char *host, int port);
/* Stop taking connections, give open responses up to wait_ms to finish, stop. */
void rt_http_stop(rt_router *r, int wait_ms);

#endif
