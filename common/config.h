/* config.h: the cluster configuration (YAML, ARCHITECTURE.md section 7; prefix td_cfg_).
 *
 * Purpose: one file describes a cluster: the model, the backend, the router, the
 * prefill and decode instances and the KV transfer settings. Every binary loads the same
 * file and looks up its own instance by name. docs/config.md lists every key with its
 * default; the YAML files in deploy/ are commented examples.
 * Invariants: td_cfg_load either returns a fully validated td_cfg with every default
 * filled in, or an error "FILE:LINE:COLUMN: message" (1-based) naming the first problem:
 * YAML syntax, unknown key, duplicate key, wrong type, value out of range, a missing
 * required key, duplicate instance names or control ports. Paths have `~/` expanded.
 * After success: prefill[i].hosts has pp entries; layer_partition is NULL (default) or
 * has pp entries; exactly one of decode[i].kv_blocks / kv_memory is nonzero;
 * decode[i].speculative.ngram_min <= ngram_max; speculative.draft is set exactly when its
 * method is draft.
 * Threading: a loaded td_cfg is read-only; any thread may read it.
 * Ownership: td_cfg_load allocates; td_cfg_free frees the whole tree (strings included).
 */
#ifndef TD_CONFIG_H
#define TD_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_dtype.h"

#define TD_CFG_NAME_MAX     63 /* instance names: [A-Za-z0-9_.-], 1..63 bytes */
#define TD_CFG_MAX_PARALLEL 64 /* pp and tp */

typedef enum {
    TD_CFG_BACKEND_CPU = 0,
    TD_CFG_BACKEND_CUDA = 1,
    TD_CFG_BACKEND_CPU_DEV = 2, /* the cpu kernels behind a device's contract: for tests */
} td_cfg_backend;
/* "cpu", "cuda", "cpu-dev": the name kn_backend_create takes. */
const char *td_cfg_backend_name(td_cfg_backend b);

/* cpu_act: the CPU backend's activations (kn_cpu_set_act, kernels/cpu/cpu_backend.h). */
typedef enum {
    TD_CFG_ACT_ENV = 0, /* key absent: TANDEM_CPU_ACT decides (float32 when unset) */
    TD_CFG_ACT_F32,     /* "f32": float32 activations (the exactness tests' path) */
    TD_CFG_ACT_Q8,      /* "q8": 8-bit activations and integer GEMMs (BENCHMARKS.md) */
    TD_CFG_ACT_AUTO,    /* "auto": q8 where a measured check finds the model's greedy answers
                           unchanged, else q16 where it finds them so, else f32
                           (kernels/act_check.h) */
    TD_CFG_ACT_Q16,     /* "q16": 16-bit activations on the decode dot path (32-block weights) */
} td_cfg_act;
/* "f32", "q8", "q16", "auto", or NULL for TD_CFG_ACT_ENV: kn_backend_options.cpu_act. */
const char *td_cfg_act_name(td_cfg_act a);

/* decode[].share_cores: false, true or "auto". */
typedef enum {
    TD_CFG_SHARE_OFF = 0, /* false (default): the stages compute beside the steps */
    TD_CFG_SHARE_ON,      /* true: every step claims the host's cores */
    TD_CFG_SHARE_AUTO,    /* "auto": steps claim them only while measured to pay: those left
                             to the scheduler beside busy stages stretched (against probe
                             claims) and nearly all longer than itl_target_ms */
} td_cfg_share;

/* router.routing: how a request's instance is chosen (router/rt_route.h). */
typedef enum {
    TD_CFG_ROUTING_LOAD = 0,    /* "load": the least loaded instance (default) */
    TD_CFG_ROUTING_CACHE_AWARE, /* "cache_aware": the longest cached prefix unless overloaded */
    TD_CFG_ROUTING_ROUND_ROBIN, /* "round_robin": the next instance in turn that has room */
} td_cfg_routing;

/* router.cache_aware: SGLang's cache-aware policy knobs (its names and defaults). */
typedef struct {
    double cache_threshold;       /* 0.5: the match beyond the prefix all instances hold, over the
                                   * prompt beyond it, must exceed this, in [0, 1] */
    int balance_abs_threshold;    /* 32: the match's instance is overloaded when its load exceeds */
    double balance_rel_threshold; /* 1.1: the least loaded's by more than abs AND more than rel x */
} td_cfg_cache_aware;

/* router.membership: instances that join and leave at run time (docs/deploy.md,
 * "Membership"). Off while listen is "". */
typedef struct {
    char *listen;      /* "": off; HOST:PORT the router binds for the instances' Join messages */
    char *address;     /* HOST:PORT the nodes send them to (a Service name); default: listen */
    int lease_ms;      /* 5000: a joined instance that is dead and silent this long is forgotten;
                          nodes announce themselves every lease_ms / 4 */
    bool seed;         /* true: the YAML's instances are dialled from the start; false: they are
                          templates only, the set is whoever joins */
    int max_instances; /* 64: decode and prefill instances each (the YAML's included) */
} td_cfg_membership;

typedef struct {
    char *listen;               /* "127.0.0.1:8000" (host:port of the HTTP API) */
    char *api_key;              /* "": no key required */
    int max_queue;              /* 256: requests waiting for an instance */
    int max_prompt_tokens;      /* 8192 */
    int max_tokens;             /* 4096: cap on a request's max_tokens */
    char *chat_template;        /* "": the model file's; chatml | llama3 | llama2 | gemma: a
                                   built-in one; else a Jinja template file */
    bool reasoning;             /* true: a thinking template's <think> block is answered as
                                   reasoning_content (router/rt_reason.h); false: as content */
    char *tool_parser;          /* "auto": the call format the chat template teaches; else one
                                   of hermes, llama3_json, mistral, deepseek_v3, deepseek_v31,
                                   qwen3_coder, glm45, kimi_k2, pythonic (router/rt_toolfmt.h) */
    int heartbeat_ms;           /* 500: health poll period per instance */
    int instance_timeout_ms;    /* 3000: no answer this long -> instance dead */
    int request_timeout_ms;     /* 600000 (or max_request_timeout_ms if smaller): a request's
                                   deadline from arrival unless it asks for another */
    int max_request_timeout_ms; /* 3600000: the longest deadline a request may ask for */
    int drain_timeout_ms;       /* 30000: SIGTERM/SIGINT: in-flight requests get this long */
    int max_migrations;         /* 3: times a request may move to another decode instance after
                                   its instance died (0: never; it fails instead) */
    int migrate_wait_ms;        /* 15000: how long a moving request waits for a live instance */
    int max_n;                  /* 16: choices per prompt a request may ask for ("n") */
    int max_batch_prompts;      /* 64: prompts in one batched /v1/completions request */
    td_cfg_routing routing;     /* load (default) | cache_aware */
    td_cfg_cache_aware cache_aware;
    td_cfg_membership membership;
    /* TLS of the HTTP listener (files read by the router at start; ~ expanded): NULL: plain
     * http. tls_cert and tls_key are both set or both NULL; tls_client_ca needs them. */
    char *tls_cert;      /* PEM certificate chain, the server's certificate first */
    char *tls_key;       /* PEM private key (unencrypted) */
    char *tls_client_ca; /* PEM CA(s) a client's certificate must chain to; NULL: none asked */
} td_cfg_router;

typedef struct {
    char *name;
    int pp;               /* 1: pipeline stages */
    int *layer_partition; /* (pp) layers per stage, or NULL: equal, extra to later stages */
    int n_layer_partition;
    int chunk_size;        /* initial chunk size (tokens); 0 (left out): chosen per request */
    bool dynamic_chunking; /* true */
    double smooth_factor;  /* 0.75, in [0, 1] */
    int threads;           /* 1: per stage */
    char **hosts;          /* (pp) host of each stage; default 127.0.0.1 */
    int n_hosts;
    int port;              /* control port of stage 0; default 9100 + index */
    int kv_tokens;         /* 32768: KV capacity of each stage (prompt tokens in flight) */
    int max_queue;         /* 64: prefill requests waiting at stage 0 before ERR_BUSY */
    int profile_budget_ms; /* 20000: bound on stage 0's start-up profile (0: no profile) */
    int drain_timeout_ms;  /* 0: SIGTERM fails the prompts in flight (the router starts them
                              again elsewhere); > 0: they may finish first, for up to this long,
                              no new ones taken (docs/config.md) */
    bool prefix_cache;     /* true: each stage keeps the KV of recent prompts' whole blocks */
    int prefix_cache_mb;   /* 256: its budget per stage (MiB, on top of kv_tokens) */
    int *devices;          /* (pp) GPU index of each stage, or NULL: stage % visible GPUs */
    int n_devices;
} td_cfg_prefill;

/* decode[].prefix_cache_tier: where blocks evicted from the prefix cache go. */
typedef struct {
    char *path;    /* a file on a local disk (~ expanded; rank r uses PATH.rR), NULL: no tier */
    int64_t bytes; /* "size": the file's size per rank */
} td_cfg_tier;

/* decode[].speculative: speculative decoding by prompt lookup, a draft model or the model's
 * MTP block (decode-node/dc_spec.h, dc_draft.h). */
typedef enum {
    TD_CFG_SPEC_OFF = 0, /* "off": one token per request and step */
    TD_CFG_SPEC_NGRAM,   /* "ngram": prompt lookup (the default) */
    TD_CFG_SPEC_DRAFT,   /* "draft": a draft model (draft, its GGUF) */
    TD_CFG_SPEC_MTP,     /* "mtp": the model's own multi-token prediction block (deepseek2
                            files with nextn_predict_layers) */
} td_cfg_spec_method;

#define TD_CFG_SPEC_MAX_TOKENS 32 /* bound on max_tokens (the scheduler's DC_SPEC_MAX_TOKENS) */
#define TD_CFG_SPEC_MAX_NGRAM  16 /* bound on ngram_min and ngram_max */

typedef struct {
    td_cfg_spec_method method; /* ngram; draft when draft is given without a method */
    char *draft;               /* method draft: the draft model's GGUF (~ expanded), else NULL */
    int max_tokens;            /* 8: most proposed tokens a request verifies in one step */
    bool adaptive;             /* true: the scheduler picks how many pay off (0 at large
                                  batches or poor acceptance); false: up to max_tokens */
    bool gate;                 /* true: adaptive also measures, per batch size, the time per
                                  token with speculation and without, and holds it off where
                                  it does not pay (dc_spec.h, the measured gate) */
    int ngram_min;             /* 2: shortest suffix matched, <= ngram_max */
    int ngram_max;             /* 4: longest */
} td_cfg_spec;

typedef struct {
    char *name;
    int tp;             /* 1: tensor-parallel ranks (same host) */
    int ep;             /* 1, or tp: a mixture-of-experts model's experts are divided whole
                           among the ranks instead of each split across them */
    /* data-parallel attention (decode[].dp, a mixture-of-experts model): the YAML entry
     * stands for dp members named NAME.K (K < dp), each its own instance (requests, KV,
     * control port) with every tensor whole but its share of the routed experts, which the
     * members run for each other's tokens in lock step (decode-node/dc_group.c); 1: none */
    int dp;
    int dp_rank;        /* this member's K */
    /* two-batch overlap (kernels/forward_tbo.c): a step of at least this many tokens runs as
     * two micro-batches, each one's all-reduces in flight while the other computes; 0: off.
     * tp >= 2, no dp */
    int tbo_min_tokens;
    char *dp_group;     /* the YAML entry's name (the group's), NULL when dp is 1 */
    char *host;         /* 127.0.0.1 */
    int threads;        /* 1: per rank */
    int block_size;     /* 16: tokens per KV block, a power of two */
    int64_t kv_blocks;  /* 4096 unless kv_memory is given */
    int64_t kv_memory;  /* bytes per rank ("1GiB"), 0 unless given */
    int max_batch;      /* 64: running requests */
    int step_tokens;    /* 512: prefill tokens per step (colocated), besides the decodes */
    bool deterministic; /* false: prefill rows of a step may take the faster batched path;
                           true: every row is computed as if alone (docs/config.md) */
    bool prefix_cache;  /* true: reuse the KV of cached prompt prefixes (docs/prefix-cache.md) */
    td_cfg_tier tier;   /* prefix_cache_tier: the cache's second tier; off unless given */
    td_dtype kv_dtype;  /* TD_F16 ("f16", default) | TD_F32 ("f32") */
    int port;           /* control port of rank 0; default 9000 + index */

    /* 0 (off): colocated, the step time (ms) within which a step with running decodes keeps
     * its prefill share (docs/config.md) */
    double itl_target_ms;
    /* false: one thing after another; true: rank 0 streams a step's tokens and serves its
     * inbox while the next step computes (docs/config.md) */
    bool overlap;
    /* false: every step computes with `threads`; true: each step's threads (threads, or fewer)
     * chosen from measured step times (decode-node/dc_threads.h, docs/config.md) */
    bool adaptive_threads;
    /* off: the prefill stages of its host compute beside its steps; on: each step claims the
     * host's cores and those stages pause meanwhile, then get the rest of itl_target_ms; auto:
     * claims only while measured to pay (common/td_coreshare.h, docs/config.md) */
    td_cfg_share share_cores;
    /* 0: SIGTERM ends the requests in flight at once with ERR_SHUTDOWN (the router moves
     * them); > 0: they may finish for up to this long first, no new ones taken (docs/config.md) */
    int drain_timeout_ms;
    td_cfg_spec speculative; /* speculative decoding; on (ngram) unless method is off */
    int *devices;            /* (tp) GPU index of each rank, or NULL: rank % visible GPUs */
    int n_devices;
} td_cfg_decode;

typedef struct {
    char *ucx_tls;  /* "sm,tcp,self" */
    int timeout_ms; /* 120000: a whole transfer (the prefill of the longest prompt included) */
} td_cfg_kvxfer;

/* security: mutual TLS on every tcp control socket (docs/control-plane.md, "Security").
 * All NULL (section absent): plain tcp://. Otherwise all three are set (~ expanded) and
 * were readable when the file was loaded. */
typedef struct {
    char *ca;   /* PEM CA certificate(s): a peer's certificate must chain to one of them */
    char *cert; /* PEM certificate (chain) this process presents, signed by the CA */
    char *key;  /* PEM private key of cert (unencrypted) */
} td_cfg_security;

typedef struct {
    char *path;             /* the file it was loaded from */
    char *model;            /* required; ~ expanded */
    td_cfg_backend backend; /* cpu */
    td_cfg_act cpu_act;     /* cpu, cpu-dev only; absent: TANDEM_CPU_ACT */
    char *run_dir;          /* "~/.cache/tandem/run" expanded: logs, pids, ipc sockets */
    td_cfg_router router;
    td_cfg_prefill *prefill; /* (n_prefill); none: decode instances prefill themselves */
    int n_prefill;
    td_cfg_decode *decode; /* (n_decode), at least one */
    int n_decode;
    td_cfg_kvxfer kvxfer;
    td_cfg_security security; /* control-plane TLS; all NULL: off */
} td_cfg;

/* The router's names: router.chat_template is "" (the model's), a built-in family or a
 * readable file; router.tool_parser one of TD_CFG_TOOL_PARSERS (router/rt_toolfmt.h's
 * formats and "auto"). */
#define TD_CFG_TOOL_PARSERS                                                                        \
    "auto, hermes, llama3_json, mistral, deepseek_v3, deepseek_v31, qwen3_coder, glm45, "          \
    "kimi_k2, pythonic"
bool td_cfg_chat_template_ok(const char *t);
bool td_cfg_tool_parser_known(const char *name);

/* Load and validate a file. On error returns a negative td_err (TD_EIO: cannot read;
 * TD_EFORMAT: YAML syntax; TD_EINVAL: schema; TD_ENOMEM), *out is NULL, and err holds
 * "FILE:LINE:COLUMN: message". Nothing is logged: the caller prints err. */
int td_cfg_load(const char *path, td_cfg **out, char *err, size_t errcap);
/* The same over text in memory; name is used in messages (tests, fuzzing). */
int td_cfg_parse(const char *text, size_t len, const char *name, td_cfg **out, char *err,
                 size_t errcap);
/* flags for the _flags forms (0: as td_cfg_load / td_cfg_parse):
 * TD_CFG_NO_FILE_CHECKS: security.ca/cert/key are not opened. For a tool that rewrites the
 * YAML for other machines, where those files are mounted (tandem k8s render: the Secret);
 * every process that serves with the YAML loads it with the checks. */
#define TD_CFG_NO_FILE_CHECKS 1u
int td_cfg_load_flags(const char *path, unsigned flags, td_cfg **out, char *err, size_t errcap);
int td_cfg_parse_flags(const char *text, size_t len, const char *name, unsigned flags, td_cfg **out,
                       char *err, size_t errcap);
void td_cfg_free(td_cfg *cfg); /* NULL is fine */

/* An instance name: [A-Za-z0-9_.-], 1..TD_CFG_NAME_MAX bytes (the YAML's and --name's). */
bool td_cfg_name_ok(const char *s);
/* Lookups by instance name; NULL if there is none. */
const td_cfg_decode *td_cfg_find_decode(const td_cfg *cfg, const char *name);
const td_cfg_prefill *td_cfg_find_prefill(const td_cfg *cfg, const char *name);

/* "tcp://HOST:PORT" of an instance leader's control socket (HOST in brackets if IPv6). */
int td_cfg_ctrl_url(const char *host, int port, char *buf, size_t cap);

/* "1GiB", "512MiB", "64KiB", "2GB", "1000" (bytes) -> bytes. TD_EINVAL if malformed,
 * TD_ERANGE on overflow. Units: B, KiB/MiB/GiB/TiB (1024^n), KB/MB/GB/TB (1000^n). */
int td_cfg_parse_size(const char *s, int64_t *out);

#endif
