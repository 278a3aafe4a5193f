/* rt.h: tandem-router, the OpenAI-compatible HTTP front door (prefix rt_): the router object.
 *
 * Purpose: accept /v1/completions and /v1/chat/completions over HTTP (libmicrohttpd),
 * tokenize on the router, send token ids to a decode instance over the control plane
 * (common/ctrl.h), detokenize the returned ids incrementally and answer as the OpenAI API
 * does (one JSON body, or Server-Sent Events). With prefill instances in the YAML every
 * request is served disaggregated: a prefill instance computes the prompt's KV and pushes it
 * to a decode instance, which then generates (rt_pair.h). Files and their headers, one
 * concern each (calls go down this list, never up):
 *   rt_main.c                  command line, model metadata, start/stop
 *   rt_http.{h,c}              libmicrohttpd glue: routing, bodies, suspend/resume, SSE reader
 *   rt_tls.{h,c}               TLS of the listener: the PEM files, client certificates
 *   rt_loop.{h,c}              the loop thread: inbox, instances' input, liveness, deadlines,
 *                              stop (rt_loop_int.h: private to rt_loop.c and rt_dispatch.c)
 *   rt_dispatch.c              admission, dispatch, request endings, migration
 *   rt_choices.{h,c}           n > 1 and batched prompts: child requests, their join
 *   rt_pair.{h,c}              disaggregated mode: pairing, KV target relay, prefill failures
 *   rt_stream.{h,c}            per-request output: detokenizer, stop strings, chunks
 *   rt_route.{h,c}             router.routing: load order or cache-aware choice
 *   rt_registry.{h,c}          decode and prefill instances: heartbeats, liveness, choice
 *   rt_member.{h,c}            router.membership: instances that join and leave at run time
 *   rt_cache.{h,c}             per-instance prefix index (block ids), SGLang's choice
 *   rt_fair.{h,c}              the router queue: one FIFO per client, served round robin
 *   rt_table.{h,c}             request table (router request id -> request)
 *   rt_metrics.{h,c}           Prometheus counters, gauges and histograms (rt_metrics_inst.c:
 *                              the instances; _vllm.c: vLLM/SGLang names; _cache.c:
 *                              cache-aware routing)
 *   rt_metrics_text.{h,c}      the Prometheus text writer: one family at a time
 *   rt_req.{h,c}               the request object: lifetime, wake, its Submit
 *   rt_openai.{h,c}            request JSON parsing/validation, /v1/models
 *   rt_buf.{h,c}               byte buffer, OpenAI error objects
 *
 * Invariants:
 *  - An rt_req is referenced by the HTTP connection, the loop and (streaming) the MHD
 *    response; it is freed when the last of them lets go (rt_req_release).
 *  - The HTTP side never waits for the control plane: it posts to the loop and suspends
 *    the connection; the loop resumes it when bytes or a final status are ready.
 *
 * Threading: MHD's internal threads run rt_http.c; one loop thread runs everything else
 * but rt_main.c. They share only: rt_req's `http` fields (under rt_req.mu), the inbox
 * (rt_router.in_mu), rt_metrics (its own lock), and the atomics of rt_router. The
 * tokenizer and the config are read-only after start.
 *
 * Ownership: rt_router owns the config, the tokenizer, the daemon and the loop's
 * structures. Parsed request parameters (rt_params) belong to their rt_req.
 */
#ifndef RT_H
#define RT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "gguf.h"
#include "rt_fair.h"
#include "rt_metrics.h"
#include "rt_registry.h"
#include "rt_req.h"
#include "rt_table.h"
#include "rt_tls.h"
#include "tokenizer.h"

typedef struct rt_router {
    td_cfg *cfg;
    td_gguf *gguf;
    rt_model model; /* the tokenizer it owns, the chat template, the context length, the name */
    char api_key_hdr[512]; /* "Bearer KEY", or "" */
    size_t max_body;       /* bytes of a request body (rt_max_body); more: 413 */
    rt_tls tls;            /* router.tls_*: the PEM texts the daemon borrows (off: http) */
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
    struct rt_member *member; /* loop-owned: router.membership's Join socket, NULL: off */
    rt_table table;      /* loop-owned */
    rt_fair fair;        /* loop-owned router queue (fair.len requests) */

    rt_metrics metrics;
} rt_router;

#endif
