/* rt_req.h: one generation request, shared by its HTTP connection and the loop (prefix rt_).
 *
 * Purpose: everything the router knows about one /v1/completions or /v1/chat/completions
 * request from its parsed body to its last byte: the immutable request, the output the
 * client reads, the loop's scheduling state, and (disaggregated mode) its pairing state.
 * Its states (the loop's side; rt_loop.h and router/README.md have the transitions):
 *
 *   INBOX --admit--> QUEUED --dispatch--> SUBMITTED --Ack / AllocReply--> RUNNING --> DONE
 *     ^ QUEUED again: busy bounce, retry, or lost (migration: rt_req_prompt resumes)
 *
 * Invariants:
 *  - refs counts the holders: the HTTP connection, the loop (from rt_loop_post until it
 *    retires the request), the SSE response while it streams; the last rt_req_release frees.
 *  - The fields are grouped by owner. Immutable ones are written by the HTTP thread before
 *    rt_loop_post and only read after. `http` is shared (rt_req.mu). `loop` belongs to the
 *    loop thread (its links in the inbox lists are written under rt_router.in_mu before the
 *    loop takes them). `pair` belongs to the loop thread too and is used in disaggregated
 *    mode only: rt_pair.c writes it, the loop reads it.
 *  - gen_ids[0..n_gen) are the tokens received; gen_base of them came before the current
 *    attempt, whose prompt is rt_req_prompt (the prompt followed by those gen_base tokens).
 * Threading: rt_req_create/retain/release/wake on any thread; the rest as its group says.
 * Ownership: the request owns p, the buffers, gen_ids, resume and the relayed targets; a
 * parent owns its children (ch.kids); a child borrows its parent's p (its own copy of the
 * struct points into the parent's prompts, stop strings, ...) and frees none of it.
 */
#ifndef RT_REQ_H
#define RT_REQ_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ctrl.h"
#include "rt_buf.h"
#include "rt_openai.h"
#include "rt_reason.h"
#include "tokenizer.h"

struct rt_router;
struct MHD_Connection;

typedef enum {
    RT_ST_INBOX = 0, /* posted, or off the queue and on no instance */
    RT_ST_QUEUED,    /* in the router queue (rt_fair) */
    RT_ST_SUBMITTED, /* Submit (colocated) / Alloc (disaggregated) sent, not answered */
    RT_ST_RUNNING,   /* its decode instance holds it */
    RT_ST_DONE,      /* out of the loop; what is left of http.out waits for the client */
} rt_state;

/* HTTP side: shared by the connection (MHD threads), the SSE reader and the loop; under
 * rt_req.mu. */
typedef struct {
    rt_buf out;     /* bytes for the client: SSE text, or the whole JSON body */
    int status;     /* 0: not final yet; else the HTTP status of out (non-stream/errors) */
    bool done;      /* the loop has written everything it will write */
    bool sse;       /* out holds SSE bytes: the response is (or will be) a stream */
    bool suspended; /* the connection is suspended waiting for the loop */
    bool gone;      /* the connection is closed; never resume it again */
    struct rt_router *router; /* set before the SSE response starts (metrics) */
    int64_t t_pending_ns;     /* SSE: when the token events behind the oldest unsent bytes of out
                                 reached the loop (0: out empty); the router-overhead histogram */
    struct MHD_Connection *conn;
    int fd; /* conn's socket, -1 unknown: the loop peeks at it while conn is suspended */
} rt_req_http;

/* Loop side: the loop thread (rt_loop.c, rt_dispatch.c, rt_stream.c; rt_pair.c runs the
 * decode side of a disaggregated attempt: state, inst, call_id). */
typedef struct {
    rt_state state;
    uint64_t rid;     /* control-plane request id (rt_table) */
    int inst;         /* decode instance index, -1 none */
    uint64_t inst_boot; /* inst's boot id when the request went there (0: none known yet): a
                           restart notice moves only requests sent to an earlier process */
    uint64_t call_id; /* the Submit (Alloc) call while SUBMITTED */
    int retries;      /* re-queued after BUSY / timeout */

    /* output (rt_stream.c) */
    td_detok dt;
    bool dt_init;
    rt_buf held;            /* detokenized text not yet emitted (possible stop prefix) */
    rt_buf text;            /* non-stream: emitted text */
    bool role_sent;         /* chat stream: the role chunk went out */
    bool stop_hit;          /* a stop string matched: the rest of the text is dropped */
    struct rt_toolp *toolp; /* p.tool_parse: the tool-call parser (rt_tools.h), else NULL */
    rt_reason reason;       /* p.reasoning: reasoning apart from content (rt_reason.h) */
    bool reason_init;
    rt_buf reasoning;       /* non-stream, p.reasoning: the reasoning text */
    int n_gen;              /* tokens received */
    int n_cached;           /* prompt tokens the decode node found in its prefix cache (usage
                               prompt_tokens_details.cached_tokens; <= p.n_prompt) */
    int64_t t_first_ms, t_last_ms;
    int64_t t_dispatch_ms; /* first sent to an instance (metrics: queue time), 0 not yet */
    int64_t t_tok_ns;      /* td_now_ns of its latest tokens (metrics: inter-token latency) */

    /* migration (rt_dispatch.c, "lost"): a request whose decode side (or, before its first
       token, prefill side) was lost continues on another attempt from the prompt plus the
       tokens already received */
    int32_t *gen_ids; /* (cap_gen) the ids received so far, gen_ids[0..n_gen) */
    int cap_gen;
    int32_t *resume; /* (n_resume) prompt + gen_ids[0..gen_base): the current attempt's
                        prompt when gen_base > 0, else NULL (p.prompt) */
    size_t n_resume;
    int gen_base;    /* tokens received before the current attempt: its first token is the
                        one that makes n_gen > gen_base */
    int migrations;  /* times its decode side was lost and it moved (router.max_migrations) */
    int64_t lost_ms; /* when its decode (or prefill) side was lost; 0 once the next token arrived */

    /* logprobs (p.sampling.logprobs): lps[i] belongs to gen_ids[i]; plps[q] to prompt
       position q (1 <= q < n_prompt, from the first attempt's TokenEvents) */
    td_logprob_entry *lps;  /* (cap_gen) */
    int n_lps, lp_sent;     /* entries received; streamed (their chunk went out) */
    td_logprob_entry *plps; /* (p.n_prompt), NULL until the first arrives */
    bool echo_sent;         /* stream: the echoed prompt's chunk went out */
    size_t lp_off;          /* completions: text_offset of the next token (characters) */
    /* disaggregated: the attempt's first token has its logprob in the prefill's
       PrefillDone, which may come after the decode side's first TokenEvents: those wait in
       lp_hold (each a u32 length and the packed event) until PrefillDone is in (pd_seen) */
    bool pd_seen, first_lp_set;
    td_logprob_entry first_lp;
    rt_buf lp_hold;

    /* links */
    struct rt_req *next;      /* inbox / queue link */
    struct rt_req *qprev;     /* queue: the previous request of the same client */
    int fslot;                /* queue: the client's slot in rt_fair, -1 not queued */
    struct rt_req *gone_next; /* gone list link */
} rt_req_loop;

/* Pairing side: disaggregated mode only; written by rt_pair.c on the loop thread. */
typedef struct {
    int attempts;                 /* pairings started; each after the first takes a fresh rid */
    int busy;                     /* ERR_BUSY bounces from either side (not failures) */
    int pinst;                    /* prefill instance of the attempt, -1 none */
    uint64_t pf_boot;             /* pinst's boot id when the attempt went there (inst_boot) */
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
    char pf_fail[320];  /* the first prefill failure, for the client's error message */
    uint32_t pf_cached; /* PrefillDone.cached_tokens of the attempt that served the prompt */
    uint32_t dc_cached; /* AllocReply.n_cached of the attempt: prompt positions the decode
                           instance held (its targets say so; not pushed) */
} rt_req_pair;

/* Choices (rt_choices.h): a request with n > 1 or several prompts is a parent that holds the
 * HTTP connection, and never goes to an instance; its children, one per prompt x choice, go
 * through the loop as plain requests and write into the parent's http (rt_stream.c). Set by
 * rt_choices_admit on the loop thread; loop-owned after. */
typedef struct {
    struct rt_req *parent; /* child: its parent (borrowed: a parent outlives its children) */
    int index;             /* child: the choice's index, prompt * n + choice (best_of: prompt *
                              best_of + candidate until rt_choices ranks them); else 0 */
    bool finished;         /* child: ended normally (rt_stream_finish wrote its finish) */
    int fin;               /* child, finished: its rt_finish (rt_stream.h) */
    struct rt_req **kids;  /* parent: (n_kids) its children, one reference each; else NULL */
    int n_kids;
    int n_out;     /* parent: the choices answered, kids[0 .. n_out) in index order: n_kids,
                      or with best_of the n best of each prompt (rt_choices.c rank) */
    int n_live;    /* parent: children in the loop (admitted, not retired) */
    bool failed;   /* parent: a child failed or the client left: the others are cancelled */
    bool sweeping; /* parent: rt_choices is retiring the children still live */
} rt_req_choices;

typedef struct rt_req {
    /* immutable once posted to the loop */
    char oid[48];        /* "cmpl-..." / "chatcmpl-..." */
    int64_t created;     /* unix seconds */
    int64_t t_arrive_ms; /* td_now_ms() when the body was complete */
    int64_t expires_ms;  /* the request's deadline (td_now_ms clock); 0: none */
    uint64_t client;     /* fairness key: hash of the remote address and Authorization */
    rt_params p;

    pthread_mutex_t mu; /* guards refs and http */
    int refs;
    rt_req_http http;
    rt_req_loop loop;
    rt_req_pair pair;
    rt_req_choices ch;
} rt_req;

/* A new request with one reference (the caller's), on no instance; NULL out of memory. */
rt_req *rt_req_create(void);
void rt_req_retain(rt_req *q);
void rt_req_release(rt_req *q); /* frees at 0 */
/* Resume q's connection if it is suspended (any thread; takes q->mu). */
void rt_req_wake(rt_req *q);

/* The prompt of q's current attempt: p.prompt, or the resumed one (migration). */
int32_t *rt_req_prompt(const rt_req *q, size_t *n);
/* The Submit (and its Sampling) of q's current attempt, for a colocated Submit or inside an
 * Alloc; both point into q (valid while q and its attempt are). */
void rt_req_submit_msg(const rt_req *q, Td__Sampling *sm, Td__Submit *sub);
/* Does a decode ErrorEvent with this code mean the request's decode side was lost (a rank
 * died, the instance is stopping), so that it should move rather than fail? */
bool rt_code_lost(int code);

#endif
