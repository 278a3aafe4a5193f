/* config.c: the cluster YAML (libyaml document API) -> a validated td_cfg.
 *
 * Each section is a table of fields (key, type, offset, range); cfg_parse_map (config_yaml.c,
 * the machinery under the sections) walks a mapping against its table, rejecting unknown and
 * duplicate keys and bad values, and records the node of every key it saw so the checks that
 * span fields (pp vs the length of layer_partition, kv_blocks vs kv_memory, unique names and
 * ports) can point at the right line. The first error wins; messages are
 * "FILE:LINE:COLUMN: ...".
 */
#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <yaml.h>

#include "config_int.h"
#include "td_err.h"

#define MAX_FILE_BYTES (16u << 20)

/* ---- sections ------------------------------------------------------------------------ */

#define ROUTER_FIELDS(F, L, N)                                                                     \
    F(R_LISTEN, "listen", F_STR, listen, 0, 0)                                                     \
    F(R_APIKEY, "api_key", F_STR, api_key, 0, 0)                                                   \
    F(R_QUEUE, "max_queue", F_INT, max_queue, 1, 1 << 20)                                          \
    F(R_PROMPT, "max_prompt_tokens", F_INT, max_prompt_tokens, 1, 1 << 24)                         \
    F(R_MAXTOK, "max_tokens", F_INT, max_tokens, 1, 1 << 24)                                       \
    F(R_TEMPLATE, "chat_template", F_STR, chat_template, 0, 0)                                     \
    F(R_REASONING, "reasoning", F_BOOL, reasoning, 0, 0)                                           \
    F(R_TOOL_PARSER, "tool_parser", F_STR, tool_parser, 0, 0)                                      \
    F(R_HB, "heartbeat_ms", F_INT, heartbeat_ms, 10, 600000)                                       \
    F(R_TIMEOUT, "instance_timeout_ms", F_INT, instance_timeout_ms, 10, 3600000)                   \
    F(R_REQ_TIMEOUT, "request_timeout_ms", F_INT, request_timeout_ms, 1, 86400000)                 \
    F(R_MAX_REQ_TIMEOUT, "max_request_timeout_ms", F_INT, max_request_timeout_ms, 1, 86400000)     \
    F(R_DRAIN, "drain_timeout_ms", F_INT, drain_timeout_ms, 0, 3600000)                            \
    F(R_MAX_MIGRATIONS, "max_migrations", F_INT, max_migrations, 0, 100)                           \
    F(R_MIGRATE_WAIT, "migrate_wait_ms", F_INT, migrate_wait_ms, 0, 3600000)                       \
    F(R_MAX_N, "max_n", F_INT, max_n, 1, 1024)                                                     \
    F(R_MAX_BATCH, "max_batch_prompts", F_INT, max_batch_prompts, 1, 4096)                         \
    N(R_ROUTING, "routing")                                                                        \
    N(R_CACHE_AWARE, "cache_aware")                                                                \
    N(R_MEMBERSHIP, "membership")                                                                  \
    F(R_TLS_CERT, "tls_cert", F_PATH, tls_cert, 0, 0)                                              \
    F(R_TLS_KEY, "tls_key", F_PATH, tls_key, 0, 0)                                                 \
    F(R_TLS_CLIENT_CA, "tls_client_ca", F_PATH, tls_client_ca, 0, 0)
enum { ROUTER_FIELDS(ENUM_ID, ENUM_ID, ENUM_ID) R_N };
#define SECT td_cfg_router
static const td_cfg_field router_fields[R_N] = FIELD_TABLE(ROUTER_FIELDS);
#undef SECT

/* router.cache_aware (SGLang's cache-aware router: its names and defaults) */
#define CACHE_AWARE_FIELDS(F, L, N)                                                                \
    F(C_THRESHOLD, "cache_threshold", F_FLOAT, cache_threshold, 0, 1)                              \
    F(C_ABS, "balance_abs_threshold", F_INT, balance_abs_threshold, 0, 1 << 20)                    \
    F(C_REL, "balance_rel_threshold", F_FLOAT, balance_rel_threshold, 1, 1000)
enum { CACHE_AWARE_FIELDS(ENUM_ID, ENUM_ID, ENUM_ID) C_N };
#define SECT td_cfg_cache_aware
static const td_cfg_field cache_aware_fields[C_N] = FIELD_TABLE(CACHE_AWARE_FIELDS);
#undef SECT

/* router.membership: instances that join and leave at run time (docs/deploy.md, "Membership") */
#define MEMBERSHIP_FIELDS(F, L, N)                                                                 \
    F(M_LISTEN, "listen", F_STR, listen, 0, 0)                                                     \
    F(M_ADDRESS, "address", F_STR, address, 0, 0)                                                  \
    F(M_LEASE, "lease_ms", F_INT, lease_ms, 100, 3600000)                                          \
    F(M_SEED, "seed", F_BOOL, seed, 0, 0)                                                          \
    F(M_MAX, "max_instances", F_INT, max_instances, 1, 4096)
enum { MEMBERSHIP_FIELDS(ENUM_ID, ENUM_ID, ENUM_ID) M_N };
#define SECT td_cfg_membership
static const td_cfg_field membership_fields[M_N] = FIELD_TABLE(MEMBERSHIP_FIELDS);
#undef SECT

#define PREFILL_FIELDS(F, L, N)                                                                    \
    F(P_NAME, "name", F_STR, name, 0, 0)                                                           \
    F(P_PP, "pp", F_INT, pp, 1, TD_CFG_MAX_PARALLEL)                                               \
    L(P_PART, "layer_partition", F_INTS, layer_partition, n_layer_partition, 1, 1 << 16)           \
    F(P_CHUNK, "chunk_size", F_INT, chunk_size, 1, 1 << 20)                                        \
    F(P_DYN, "dynamic_chunking", F_BOOL, dynamic_chunking, 0, 0)                                   \
    F(P_SMOOTH, "smooth_factor", F_FLOAT, smooth_factor, 0, 1)                                     \
    F(P_THREADS, "threads", F_INT, threads, 1, 1024)                                               \
    L(P_HOSTS, "hosts", F_STRS, hosts, n_hosts, 0, 0)                                              \
    F(P_PORT, "port", F_INT, port, 1, 65535)                                                       \
    F(P_KVTOK, "kv_tokens", F_INT, kv_tokens, 64, 1 << 26)                                         \
    F(P_QUEUE, "max_queue", F_INT, max_queue, 1, 1 << 20)                                          \
    F(P_PROFILE, "profile_budget_ms", F_INT, profile_budget_ms, 0, 3600000)                        \
    F(P_PCACHE, "prefix_cache", F_BOOL, prefix_cache, 0, 0)                                        \
    F(P_DRAIN, "drain_timeout_ms", F_INT, drain_timeout_ms, 0, 3600000)                            \
    F(P_PCACHE_MB, "prefix_cache_mb", F_INT, prefix_cache_mb, 1, 1 << 20)                          \
    L(P_DEVICES, "devices", F_INTS, devices, n_devices, 0, 1023)
enum { PREFILL_FIELDS(ENUM_ID, ENUM_ID, ENUM_ID) P_N };
#define SECT td_cfg_prefill
static const td_cfg_field prefill_fields[P_N] = FIELD_TABLE(PREFILL_FIELDS);
#undef SECT

#define DECODE_FIELDS(F, L, N)                                                                     \
    F(D_NAME, "name", F_STR, name, 0, 0)                                                           \
    F(D_TP, "tp", F_INT, tp, 1, TD_CFG_MAX_PARALLEL)                                               \
    F(D_EP, "ep", F_INT, ep, 1, TD_CFG_MAX_PARALLEL)                                               \
    F(D_DP, "dp", F_INT, dp, 1, TD_CFG_MAX_PARALLEL)                                               \
    F(D_HOST, "host", F_STR, host, 0, 0)                                                           \
    F(D_THREADS, "threads", F_INT, threads, 1, 1024)                                               \
    F(D_BLOCK, "block_size", F_INT, block_size, 1, 1024)                                           \
    F(D_KVB, "kv_blocks", F_I64, kv_blocks, 1, 1ll << 32)                                          \
    F(D_KVM, "kv_memory", F_SIZE, kv_memory, 4096, 0)                                              \
    F(D_BATCH, "max_batch", F_INT, max_batch, 1, 1 << 16)                                          \
    F(D_STEP, "step_tokens", F_INT, step_tokens, 1, 1 << 20)                                       \
    F(D_ITL, "itl_target_ms", F_FLOAT, itl_target_ms, 0, 600000)                                   \
    F(D_DTYPE, "kv_dtype", F_KV_DTYPE, kv_dtype, 0, 0)                                             \
    F(D_PORT, "port", F_INT, port, 1, 65535)                                                       \
    F(D_DETERMINISTIC, "deterministic", F_BOOL, deterministic, 0, 0)                               \
    F(D_PREFIX_CACHE, "prefix_cache", F_BOOL, prefix_cache, 0, 0)                                  \
    F(D_OVERLAP, "overlap", F_BOOL, overlap, 0, 0)                                                 \
    F(D_TBO, "tbo_min_tokens", F_INT, tbo_min_tokens, 0, 1 << 20)                                  \
    F(D_ADAPTIVE_THREADS, "adaptive_threads", F_BOOL, adaptive_threads, 0, 0)                      \
    N(D_SHARE_CORES, "share_cores")                                                                \
    F(D_DRAIN, "drain_timeout_ms", F_INT, drain_timeout_ms, 0, 3600000)                            \
    L(D_DEVICES, "devices", F_INTS, devices, n_devices, 0, 1023)                                   \
    N(D_TIER, "prefix_cache_tier")                                                                 \
    N(D_SPEC, "speculative")
enum { DECODE_FIELDS(ENUM_ID, ENUM_ID, ENUM_ID) D_N };
#define SECT td_cfg_decode
static const td_cfg_field decode_fields[D_N] = FIELD_TABLE(DECODE_FIELDS);
#undef SECT

/* decode[].prefix_cache_tier */
#define TIER_FIELDS(F, L, N)                                                                       \
    F(TI_PATH, "path", F_PATH, path, 0, 0)                                                         \
    F(TI_SIZE, "size", F_SIZE, bytes, 1 << 20, 0)
enum { TIER_FIELDS(ENUM_ID, ENUM_ID, ENUM_ID) TI_N };
#define SECT td_cfg_tier
static const td_cfg_field tier_fields[TI_N] = FIELD_TABLE(TIER_FIELDS);
#undef SECT

/* decode[].speculative (method is read by parse_spec) */
#define SPEC_FIELDS(F, L, N)                                                                       \
    N(S_METHOD, "method")                                                                          \
    F(S_DRAFT, "draft", F_PATH, draft, 0, 0)                                                       \
    F(S_MAX_TOKENS, "max_tokens", F_INT, max_tokens, 1, TD_CFG_SPEC_MAX_TOKENS)                    \
    F(S_ADAPTIVE, "adaptive", F_BOOL, adaptive, 0, 0)                                              \
    F(S_GATE, "gate", F_BOOL, gate, 0, 0)                                                          \
    F(S_NGRAM_MIN, "ngram_min", F_INT, ngram_min, 1, TD_CFG_SPEC_MAX_NGRAM)                        \
    F(S_NGRAM_MAX, "ngram_max", F_INT, ngram_max, 1, TD_CFG_SPEC_MAX_NGRAM)
enum { SPEC_FIELDS(ENUM_ID, ENUM_ID, ENUM_ID) S_N };
#define SECT td_cfg_spec
static const td_cfg_field spec_fields[S_N] = FIELD_TABLE(SPEC_FIELDS);
#undef SECT

#define KVXFER_FIELDS(F, L, N)                                                                     \
    F(K_TLS, "ucx_tls", F_STR, ucx_tls, 0, 0)                                                      \
    F(K_TIMEOUT, "timeout_ms", F_INT, timeout_ms, 1, 3600000)
enum { KVXFER_FIELDS(ENUM_ID, ENUM_ID, ENUM_ID) K_N };
#define SECT td_cfg_kvxfer
static const td_cfg_field kvxfer_fields[K_N] = FIELD_TABLE(KVXFER_FIELDS);
#undef SECT

/* security: the control plane's mutual TLS (all three or the section is absent) */
#define SECURITY_FIELDS(F, L, N)                                                                   \
    F(SE_CA, "ca", F_PATH, ca, 0, 0)                                                               \
    F(SE_CERT, "cert", F_PATH, cert, 0, 0)                                                         \
    F(SE_KEY, "key", F_PATH, key, 0, 0)
enum { SECURITY_FIELDS(ENUM_ID, ENUM_ID, ENUM_ID) SE_N };
#define SECT td_cfg_security
static const td_cfg_field security_fields[SE_N] = FIELD_TABLE(SECURITY_FIELDS);
#undef SECT

/* NODE: only the node is recorded; the section parsers below take it from there. */
#define ROOT_FIELDS(F, L, N)                                                                       \
    F(T_MODEL, "model", F_PATH, model, 0, 0)                                                       \
    N(T_BACKEND, "backend")                                                                        \
    N(T_CPU_ACT, "cpu_act")                                                                        \
    F(T_RUNDIR, "run_dir", F_PATH, run_dir, 0, 0)                                                  \
    N(T_ROUTER, "router")                                                                          \
    N(T_PREFILL, "prefill")                                                                        \
    N(T_DECODE, "decode")                                                                          \
    N(T_KVXFER, "kvxfer")                                                                          \
    N(T_SECURITY, "security")
enum { ROOT_FIELDS(ENUM_ID, ENUM_ID, ENUM_ID) T_N };
#define SECT td_cfg
static const td_cfg_field root_fields[T_N] = FIELD_TABLE(ROOT_FIELDS);
#undef SECT

static int check_host(td_cfg_ctx *p, yaml_node_t *n, const char *h)
{
    if (!*h || strlen(h) > 253 || strpbrk(h, " /\t"))
        return cfg_fail(p, n, "'%s' is not a host name or address", h);
    return 0;
}

static int check_listen(td_cfg_ctx *p, yaml_node_t *n, const char *s)
{
    const char *c = strrchr(s, ':');
    char *end;
    long port = c ? strtol(c + 1, &end, 10) : 0;
    if (!c || c == s || !c[1] || *end || port < 1 || port > 65535)
        return cfg_fail(p, n, "expected HOST:PORT (port 1..65535), got '%s'", s);
    return 0;
}

static void router_defaults(td_cfg_ctx *p, td_cfg_router *r)
{
    cfg_set_str(p, &r->listen, "127.0.0.1:8000");
    cfg_set_str(p, &r->api_key, "");
    r->max_queue = 256;
    r->max_prompt_tokens = 8192;
    r->max_tokens = 4096;
    cfg_set_str(p, &r->chat_template, "");
    r->reasoning = true;
    cfg_set_str(p, &r->tool_parser, "auto");
    r->heartbeat_ms = 500;
    r->instance_timeout_ms = 3000;
    r->request_timeout_ms = 600000;
    r->max_request_timeout_ms = 3600000;
    r->drain_timeout_ms = 30000;
    r->max_migrations = 3;
    r->migrate_wait_ms = 15000;
    r->max_n = 16;
    r->max_batch_prompts = 64;
    r->routing = TD_CFG_ROUTING_LOAD;
    r->cache_aware = (td_cfg_cache_aware){
        .cache_threshold = 0.5, .balance_abs_threshold = 32, .balance_rel_threshold = 1.1};
    cfg_set_str(p, &r->membership.listen, "");
    cfg_set_str(p, &r->membership.address, "");
    r->membership.lease_ms = 5000;
    r->membership.seed = true;
    r->membership.max_instances = 64;
}

/* router.membership: listen and address are HOST:PORT; address defaults to listen (one
 * machine), and needs it (a node announcing itself to a router that does not listen). */
static int parse_membership(td_cfg_ctx *p, yaml_node_t *n, td_cfg_membership *m)
{
    yaml_node_t *seen[M_N], *keys[M_N];
    if (!n) return 0;
    if (cfg_parse_map(p, n, "router.membership", membership_fields, M_N, m, seen, keys))
        return p->rc;
    if (seen[M_LISTEN] && *m->listen && check_listen(p, seen[M_LISTEN], m->listen)) return p->rc;
    if (seen[M_ADDRESS] && *m->address && check_listen(p, seen[M_ADDRESS], m->address))
        return p->rc;
    if (*m->address && !*m->listen)
        return cfg_fail(p, n,
                        "router.membership: address is given but listen is not (the router "
                        "listens there for the instances' announcements)");
    if (!*m->address) cfg_set_str(p, &m->address, m->listen);
    return p->rc;
}

/* router.routing and router.cache_aware */
static int parse_routing(td_cfg_ctx *p, yaml_node_t *routing, yaml_node_t *ca, td_cfg_router *r)
{
    const char *s;
    if (routing && cfg_get_str(p, routing, &s)) return p->rc;
    if (routing) {
        if (!strcmp(s, "load"))
            r->routing = TD_CFG_ROUTING_LOAD;
        else if (!strcmp(s, "cache_aware"))
            r->routing = TD_CFG_ROUTING_CACHE_AWARE;
        else if (!strcmp(s, "round_robin"))
            r->routing = TD_CFG_ROUTING_ROUND_ROBIN;
        else
            return cfg_fail(p, routing,
                            "unknown routing '%s' (known: load, cache_aware, round_robin)", s);
    }
    yaml_node_t *seen[C_N], *keys[C_N];
    if (!ca) return 0;
    return cfg_parse_map(p, ca, "router.cache_aware", cache_aware_fields, C_N, &r->cache_aware,
                         seen, keys);
}

/* router.tls_cert / tls_key: both or neither; tls_client_ca only with them. The files are
 * read by the router at start (other hosts load the same YAML without them). */
static int check_tls(td_cfg_ctx *p, yaml_node_t **keys)
{
    yaml_node_t *cert = keys[R_TLS_CERT], *key = keys[R_TLS_KEY], *ca = keys[R_TLS_CLIENT_CA];
    if (cert && !key)
        return cfg_fail(p, cert, "router: tls_cert is given but tls_key is missing (give both)");
    if (key && !cert)
        return cfg_fail(p, key, "router: tls_key is given but tls_cert is missing (give both)");
    if (ca && !cert)
        return cfg_fail(p, ca,
                        "router: tls_client_ca needs tls_cert and tls_key (client certificates are "
                        "asked for over TLS only)");
    return 0;
}

static int parse_router(td_cfg_ctx *p, yaml_node_t *n, td_cfg_router *r)
{
    yaml_node_t *seen[R_N], *keys[R_N];
    if (cfg_parse_map(p, n, "router", router_fields, R_N, r, seen, keys)) return p->rc;
    if (seen[R_LISTEN] && check_listen(p, seen[R_LISTEN], r->listen)) return p->rc;
    if (check_tls(p, keys)) return p->rc;
    if (parse_routing(p, seen[R_ROUTING], seen[R_CACHE_AWARE], r)) return p->rc;
    if (parse_membership(p, seen[R_MEMBERSHIP], &r->membership)) return p->rc;
    if (!td_cfg_chat_template_ok(r->chat_template))
        return cfg_fail(
            p, seen[R_TEMPLATE],
            "chat_template '%s' is neither chatml, llama3, llama2, gemma nor a readable "
            "template file (empty: the model's own)",
            r->chat_template);
    if (!td_cfg_tool_parser_known(r->tool_parser))
        return cfg_fail(p, seen[R_TOOL_PARSER], "unknown tool_parser '%s' (known: %s)",
                        r->tool_parser, TD_CFG_TOOL_PARSERS);
    /* the default deadline follows a smaller maximum; an explicit one must fit under it */
    if (!seen[R_REQ_TIMEOUT] && r->request_timeout_ms > r->max_request_timeout_ms)
        r->request_timeout_ms = r->max_request_timeout_ms;
    if (r->request_timeout_ms > r->max_request_timeout_ms)
        return cfg_fail(p, seen[R_REQ_TIMEOUT],
                        "request_timeout_ms (%d) is larger than max_request_timeout_ms (%d)",
                        r->request_timeout_ms, r->max_request_timeout_ms);
    return 0;
}

/* security: ca, cert and key are all required, and each must be readable here: every
 * process of a secured cluster opens control sockets with them (a missing file is
 * reported with the YAML's line rather than by the first socket that needs it), unless
 * the caller only rewrites the YAML for machines that hold them (TD_CFG_NO_FILE_CHECKS). */
static int parse_security(td_cfg_ctx *p, yaml_node_t *n, td_cfg_security *x)
{
    yaml_node_t *seen[SE_N], *keys[SE_N];
    if (cfg_parse_map(p, n, "security", security_fields, SE_N, x, seen, keys)) return p->rc;
    static const char *const names[SE_N] = {"ca", "cert", "key"};
    char *const paths[SE_N] = {x->ca, x->cert, x->key};
    for (int i = 0; i < SE_N; i++) {
        if (cfg_require(p, n, seen[i], names[i], "security")) return p->rc;
        if (p->flags & TD_CFG_NO_FILE_CHECKS) continue;
        FILE *f = fopen(paths[i], "r");
        if (!f)
            return cfg_fail(p, seen[i], "security.%s: cannot read '%s': %s", names[i], paths[i],
                            strerror(errno));
        fclose(f);
    }
    return 0;
}

/* Instances: name rules and the nodes needed for the cross-instance checks. */
typedef struct {
    const char *name;
    yaml_node_t *name_node;
    const char *host;
    int port;
    yaml_node_t *port_node; /* where to point for a port clash */
} inst_ref;

/* devices: one GPU index per stage (prefill) or rank (decode); only a GPU backend has them */
static int check_devices(td_cfg_ctx *p, yaml_node_t *n, int n_devices, int want, const char *count,
                         const char *per)
{
    if (!n) return 0;
    if (p->backend != TD_CFG_BACKEND_CUDA)
        return cfg_fail(p, n, "devices: only for backend cuda (GPU indices)");
    if (n_devices != want)
        return cfg_fail(p, n, "devices has %d entries but %s is %d (one per %s)", n_devices, count,
                        want, per);
    return 0;
}

static int parse_prefill(td_cfg_ctx *p, yaml_node_t *n, int idx, td_cfg_prefill *x, inst_ref *ref)
{
    yaml_node_t *seen[P_N], *keys[P_N];
    x->pp = 1;
    x->chunk_size = 0; /* left out: chosen per request by stage 0 (prefill-node/pf_tune.h) */
    x->dynamic_chunking = true;
    x->smooth_factor = 0.75;
    x->threads = 1;
    x->port = 9100 + idx;
    x->kv_tokens = 32768;
    x->max_queue = 64;
    x->profile_budget_ms = 20000;
    x->prefix_cache = true;
    x->prefix_cache_mb = 256;
    if (n->type != YAML_MAPPING_NODE)
        return cfg_fail(p, n, "prefill[%d]: expected a mapping, got %s", idx, cfg_kind_name(n));
    char what[64];
    snprintf(what, sizeof what, "prefill[%d]", idx);
    if (cfg_parse_map(p, n, what, prefill_fields, P_N, x, seen, keys)) return p->rc;
    if (cfg_require(p, n, seen[P_NAME], "name", what)) return p->rc;
    if (!td_cfg_name_ok(x->name))
        return cfg_fail(p, seen[P_NAME], "instance name '%s': use 1..%d of A-Z a-z 0-9 _ . -",
                        x->name, TD_CFG_NAME_MAX);
    if (x->layer_partition && x->n_layer_partition != x->pp)
        return cfg_fail(p, seen[P_PART], "layer_partition has %d entries but pp is %d",
                        x->n_layer_partition, x->pp);
    if (check_devices(p, seen[P_DEVICES], x->n_devices, x->pp, "pp", "stage")) return p->rc;
    if (x->hosts) {
        if (x->n_hosts != x->pp)
            return cfg_fail(p, seen[P_HOSTS], "hosts has %d entries but pp is %d (one per stage)",
                            x->n_hosts, x->pp);
        yaml_node_t *hl = seen[P_HOSTS];
        for (int i = 0; i < x->n_hosts; i++)
            if (check_host(p, cfg_node_at(p, hl->data.sequence.items.start[i]), x->hosts[i]))
                return p->rc;
    } else {
        x->hosts = calloc((size_t)x->pp, sizeof *x->hosts);
        if (!x->hosts) return cfg_fail(p, n, "out of memory");
        x->n_hosts = x->pp;
        for (int i = 0; i < x->pp; i++)
            if (!(x->hosts[i] = cfg_xstrdup(p, "127.0.0.1"))) return p->rc;
    }
    *ref = (inst_ref){x->name, seen[P_NAME], x->hosts[0], x->port,
                      seen[P_PORT] ? seen[P_PORT] : seen[P_NAME]};
    return 0;
}

/* decode[].prefix_cache_tier: {path, size}, both required; needs the prefix cache (at tp > 1
 * each rank has its own tier PATH.rR). */
static int parse_tier(td_cfg_ctx *p, yaml_node_t *n, const char *inst, td_cfg_decode *x)
{
    yaml_node_t *seen[TI_N], *keys[TI_N];
    char what[96];
    snprintf(what, sizeof what, "%s.prefix_cache_tier", inst);
    if (cfg_parse_map(p, n, what, tier_fields, TI_N, &x->tier, seen, keys)) return p->rc;
    if (cfg_require(p, n, seen[TI_PATH], "path", what) ||
        cfg_require(p, n, seen[TI_SIZE], "size", what))
        return p->rc;
    if (!x->prefix_cache)
        return cfg_fail(
            p, n, "%s: the tier holds blocks the prefix cache evicts; prefix_cache is false", what);
    return 0;
}

/* decode[].speculative: {method, draft, max_tokens, adaptive, gate, ngram_min, ngram_max}, each
 * optional (x holds the defaults); draft alone means method draft, which requires it. */
static int parse_spec(td_cfg_ctx *p, yaml_node_t *n, const char *inst, td_cfg_spec *x)
{
    yaml_node_t *seen[S_N], *keys[S_N];
    char what[96];
    snprintf(what, sizeof what, "%s.speculative", inst);
    if (cfg_parse_map(p, n, what, spec_fields, S_N, x, seen, keys)) return p->rc;
    if (seen[S_METHOD]) {
        const char *m;
        if (cfg_get_str(p, seen[S_METHOD], &m)) return p->rc;
        if (!strcmp(m, "ngram"))
            x->method = TD_CFG_SPEC_NGRAM;
        else if (!strcmp(m, "off"))
            x->method = TD_CFG_SPEC_OFF;
        else if (!strcmp(m, "draft"))
            x->method = TD_CFG_SPEC_DRAFT;
        else if (!strcmp(m, "mtp"))
            x->method = TD_CFG_SPEC_MTP;
        else
            return cfg_fail(p, seen[S_METHOD],
                            "unknown speculative method '%s' (known: ngram, draft, mtp, off)", m);
    } else if (seen[S_DRAFT]) {
        x->method = TD_CFG_SPEC_DRAFT;
    }
    if (x->method == TD_CFG_SPEC_DRAFT && !seen[S_DRAFT])
        return cfg_fail(p, seen[S_METHOD], "%s: method draft needs draft (the draft model's GGUF)",
                        what);
    if (x->method != TD_CFG_SPEC_DRAFT && seen[S_DRAFT])
        return cfg_fail(p, keys[S_DRAFT], "%s: draft is the draft model of method draft, not %s",
                        what,
                        x->method == TD_CFG_SPEC_OFF   ? "off"
                        : x->method == TD_CFG_SPEC_MTP ? "mtp"
                                                       : "ngram");
    if (x->ngram_min > x->ngram_max)
        return cfg_fail(p, seen[S_NGRAM_MIN] ? seen[S_NGRAM_MIN] : seen[S_NGRAM_MAX],
                        "%s: ngram_min (%d) is larger than ngram_max (%d)", what, x->ngram_min,
                        x->ngram_max);
    return 0;
}

/* decode[].share_cores: a bool, or "auto" (which decides by itl_target_ms, so needs one). */
static int parse_share_cores(td_cfg_ctx *p, yaml_node_t *v, td_cfg_decode *x)
{
    if (v->type == YAML_SCALAR_NODE && !strcmp(cfg_sval(v), "auto")) {
        if (x->itl_target_ms <= 0)
            return cfg_fail(p, v,
                            "share_cores: auto claims the cores while steps run longer than "
                            "itl_target_ms: set itl_target_ms (> 0)");
        x->share_cores = TD_CFG_SHARE_AUTO;
        return 0;
    }
    int on = cfg_bool_of(v);
    if (on < 0)
        return cfg_fail(p, v, "share_cores: expected true, false or auto, got %s",
                        v->type == YAML_SCALAR_NODE ? cfg_sval(v) : cfg_kind_name(v));
    x->share_cores = on ? TD_CFG_SHARE_ON : TD_CFG_SHARE_OFF;
    return 0;
}

static int parse_decode(td_cfg_ctx *p, yaml_node_t *n, int idx, td_cfg_decode *x, inst_ref *ref)
{
    yaml_node_t *seen[D_N], *keys[D_N];
    x->tp = 1;
    x->ep = 1;
    x->dp = 1;
    cfg_set_str(p, &x->host, "127.0.0.1");
    x->threads = 1;
    x->block_size = 16;
    x->kv_blocks = 4096;
    x->max_batch = 64;
    x->step_tokens = 512;
    x->kv_dtype = TD_F16;
    x->port = 9000 + idx;
    x->prefix_cache = true;
    x->speculative = (td_cfg_spec){.method = TD_CFG_SPEC_NGRAM,
                                   .max_tokens = 8,
                                   .adaptive = true,
                                   .gate = true,
                                   .ngram_min = 2,
                                   .ngram_max = 4};
    if (p->rc) return p->rc;
    if (n->type != YAML_MAPPING_NODE)
        return cfg_fail(p, n, "decode[%d]: expected a mapping, got %s", idx, cfg_kind_name(n));
    char what[64];
    snprintf(what, sizeof what, "decode[%d]", idx);
    if (cfg_parse_map(p, n, what, decode_fields, D_N, x, seen, keys)) return p->rc;
    if (cfg_require(p, n, seen[D_NAME], "name", what)) return p->rc;
    if (!td_cfg_name_ok(x->name))
        return cfg_fail(p, seen[D_NAME], "instance name '%s': use 1..%d of A-Z a-z 0-9 _ . -",
                        x->name, TD_CFG_NAME_MAX);
    if (seen[D_HOST] && check_host(p, seen[D_HOST], x->host)) return p->rc;
    if (x->block_size & (x->block_size - 1))
        return cfg_fail(p, seen[D_BLOCK], "block_size %d is not a power of two", x->block_size);
    if (x->ep != 1 && x->ep != x->tp)
        return cfg_fail(p, seen[D_EP], "ep %d: 1 or the instance's tp (%d)", x->ep, x->tp);
    if (seen[D_KVB] && seen[D_KVM])
        return cfg_fail(p, keys[D_KVM], "give kv_blocks or kv_memory, not both");
    if (seen[D_KVM]) x->kv_blocks = 0;
    if (seen[D_DTYPE] && cfg_kv_dtype_of(cfg_sval(seen[D_DTYPE])) < 0)
        return cfg_fail(p, seen[D_DTYPE], "kv_dtype '%s': expected f16 or f32",
                        cfg_sval(seen[D_DTYPE]));
    if (x->dp > 1 && (x->tp > 1 || x->ep > 1))
        return cfg_fail(p, seen[D_DP],
                        "dp %d: each member holds the model whole but its experts; tp and ep "
                        "stay 1 (tp %d, ep %d)",
                        x->dp, x->tp, x->ep);
    if (x->dp > 1 && seen[D_DEVICES])
        return cfg_fail(p, seen[D_DP], "dp > 1 runs on the cpu backend (no devices)");
    if (x->tbo_min_tokens > 0 && (x->tp < 2 || x->dp > 1))
        return cfg_fail(p, seen[D_TBO],
                        "tbo_min_tokens (two-batch overlap) needs tp >= 2 and no dp (tp %d, dp "
                        "%d)",
                        x->tp, x->dp);
    if (seen[D_SHARE_CORES] && parse_share_cores(p, seen[D_SHARE_CORES], x)) return p->rc;
    if (check_devices(p, seen[D_DEVICES], x->n_devices, x->tp, "tp", "rank")) return p->rc;
    if (seen[D_TIER] && parse_tier(p, seen[D_TIER], what, x)) return p->rc;
    if (seen[D_SPEC] && parse_spec(p, seen[D_SPEC], what, &x->speculative)) return p->rc;
    if (x->dp > 1 && x->speculative.method == TD_CFG_SPEC_MTP)
        return cfg_fail(p, seen[D_SPEC], "speculative method mtp with dp > 1 is not built yet");
    *ref = (inst_ref){x->name, seen[D_NAME], x->host, x->port, seen[D_PORT] ? seen[D_PORT] : NULL};
    return 0;
}

static char *dup_suffixed(td_cfg_ctx *p, const char *s, int k)
{
    size_t cap = strlen(s) + 16;
    char *d = malloc(cap);
    if (!d) {
        p->rc = TD_ENOMEM;
        return NULL;
    }
    snprintf(d, cap, "%s.%d", s, k);
    return d;
}

/* A data-parallel entry (dp > 1) becomes its members, NAME.K at port + K (the YAML's port) or
 * 9000 + their place in the list; x is the parsed entry, out its members (dp of them, zeroed),
 * at list index *at onwards. The members own copies of every string; x keeps its own. */
static int expand_dp(td_cfg_ctx *p, const td_cfg_decode *x, const inst_ref *ref, int at,
                     td_cfg_decode *out, inst_ref *refs)
{
    for (int k = 0; k < x->dp && !p->rc; k++) {
        td_cfg_decode *m = &out[k];
        *m = *x; /* then none of x's strings: each member owns its copies */
        m->name = m->dp_group = m->host = m->tier.path = m->speculative.draft = NULL;
        m->devices = NULL, m->n_devices = 0;
        m->dp_rank = k;
        m->name = dup_suffixed(p, x->name, k);
        if (m->name && !td_cfg_name_ok(m->name))
            return cfg_fail(p, ref->name_node,
                            "dp %d: member name '%s' is longer than %d bytes: shorten '%s'", x->dp,
                            m->name, TD_CFG_NAME_MAX, x->name);
        m->dp_group = cfg_xstrdup(p, x->name);
        m->host = cfg_xstrdup(p, x->host);
        /* one prefix-cache tier file a member */
        m->tier.path = x->tier.path ? dup_suffixed(p, x->tier.path, k) : NULL;
        m->speculative.draft = x->speculative.draft ? cfg_xstrdup(p, x->speculative.draft) : NULL;
        m->port = ref->port_node ? x->port + k : 9000 + at + k;
        if (m->port > 65535)
            return cfg_fail(p, ref->port_node ? ref->port_node : ref->name_node,
                            "dp %d: member %d's port %d is beyond 65535", x->dp, k, m->port);
        refs[k] = (inst_ref){m->name, ref->name_node, m->host, m->port,
                             ref->port_node ? ref->port_node : ref->name_node};
    }
    return p->rc;
}

/* Every data-parallel entry into its members (expand_dp), every entry's default port 9000 +
 * its place in the list that results; *refs (np prefill ones first) grows with it. */
static int expand_groups(td_cfg_ctx *p, td_cfg *c, inst_ref **refs, size_t np)
{
    int total = 0;
    for (int i = 0; i < c->n_decode; i++)
        total += c->decode[i].dp;
    td_cfg_decode *out = calloc((size_t)total, sizeof *out);
    inst_ref *r = calloc(np + (size_t)total, sizeof *r);
    if (!out || !r) {
        free(out);
        free(r);
        return p->rc = TD_ENOMEM;
    }
    memcpy(r, *refs, np * sizeof *r);
    int at = 0;
    for (int i = 0; i < c->n_decode; i++) {
        td_cfg_decode *x = &c->decode[i];
        inst_ref *xr = &(*refs)[np + i];
        if (x->dp == 1) {
            out[at] = *x;
            if (!xr->port_node) out[at].port = 9000 + at;
            r[np + at] = (inst_ref){out[at].name, xr->name_node, out[at].host, out[at].port,
                                    xr->port_node ? xr->port_node : xr->name_node};
            memset(x, 0, sizeof *x); /* moved */
            at++;
            continue;
        }
        if (expand_dp(p, x, xr, at, out + at, r + np + at)) {
            /* the members made so far and every entry not yet moved are freed below */
            at += x->dp;
            break;
        }
        at += x->dp;
    }
    /* what stayed in the parsed entries (the dp ones' strings, or all after a failure) */
    cfg_free_decodes(c->decode, c->n_decode);
    c->decode = out;
    c->n_decode = at;
    free(*refs);
    *refs = r;
    return p->rc;
}

static int check_instances(td_cfg_ctx *p, inst_ref *r, int n)
{
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++) {
            if (!strcmp(r[i].name, r[j].name))
                return cfg_fail(p, r[i].name_node,
                                "duplicate instance name '%s' (first at line %zu)", r[i].name,
                                r[j].name_node->start_mark.line + 1);
            if (r[i].port == r[j].port && !strcmp(r[i].host, r[j].host))
                return cfg_fail(p, r[i].port_node,
                                "control port %d on %s is already used by instance '%s' (line %zu)",
                                r[i].port, r[i].host, r[j].name,
                                r[j].name_node->start_mark.line + 1);
        }
    return 0;
}

static int parse_list(td_cfg_ctx *p, yaml_node_t *n, const char *what, size_t *count)
{
    *count = 0;
    if (!n || cfg_is_null(n)) return 0;
    if (n->type != YAML_SEQUENCE_NODE)
        return cfg_fail(p, n, "%s: expected a list of instances, got %s", what, cfg_kind_name(n));
    *count = (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    if (*count > MAX_LIST) return cfg_fail(p, n, "%s: more than %d instances", what, MAX_LIST);
    return 0;
}

static int parse_root(td_cfg_ctx *p, yaml_node_t *root, td_cfg *c)
{
    yaml_node_t *seen[T_N], *keys[T_N];
    if (!root || cfg_is_null(root))
        return cfg_fail(p, root,
                        "empty configuration: expected a mapping with at least 'model' "
                        "and 'decode'");
    if (root->type != YAML_MAPPING_NODE)
        return cfg_fail(p, root, "expected a mapping at the top level, got %s",
                        cfg_kind_name(root));
    cfg_set_path(p, &c->run_dir, "~/.cache/tandem/run");
    router_defaults(p, &c->router);
    cfg_set_str(p, &c->kvxfer.ucx_tls, "sm,tcp,self");
    c->kvxfer.timeout_ms = 120000;
    if (p->rc) return p->rc;

    if (cfg_parse_map(p, root, "the top level", root_fields, T_N, c, seen, keys)) return p->rc;
    if (cfg_require(p, root, seen[T_MODEL], "model", "the top level")) return p->rc;
    if (seen[T_BACKEND]) {
        const char *b;
        if (cfg_get_str(p, seen[T_BACKEND], &b)) return p->rc;
        if (!strcmp(b, "cpu"))
            c->backend = TD_CFG_BACKEND_CPU;
        else if (!strcmp(b, "cuda"))
            c->backend = TD_CFG_BACKEND_CUDA;
        else if (!strcmp(b, "cpu-dev"))
            c->backend = TD_CFG_BACKEND_CPU_DEV;
        else
            return cfg_fail(p, seen[T_BACKEND], "unknown backend '%s' (known: cpu, cuda, cpu-dev)",
                            b);
    }
    p->backend = c->backend;
    if (seen[T_CPU_ACT]) {
        const char *a;
        if (cfg_get_str(p, seen[T_CPU_ACT], &a)) return p->rc;
        if (c->backend == TD_CFG_BACKEND_CUDA)
            return cfg_fail(p, seen[T_CPU_ACT],
                            "cpu_act: only for the cpu backends (backend is cuda)");
        if (!strcmp(a, "f32"))
            c->cpu_act = TD_CFG_ACT_F32;
        else if (!strcmp(a, "q8"))
            c->cpu_act = TD_CFG_ACT_Q8;
        else if (!strcmp(a, "q16"))
            c->cpu_act = TD_CFG_ACT_Q16;
        else if (!strcmp(a, "auto"))
            c->cpu_act = TD_CFG_ACT_AUTO;
        else
            return cfg_fail(p, seen[T_CPU_ACT], "unknown cpu_act '%s' (known: f32, q8, q16, auto)",
                            a);
    }
    if (seen[T_ROUTER] && parse_router(p, seen[T_ROUTER], &c->router)) return p->rc;
    if (seen[T_KVXFER]) {
        yaml_node_t *s2[K_N], *k2[K_N];
        if (cfg_parse_map(p, seen[T_KVXFER], "kvxfer", kvxfer_fields, K_N, &c->kvxfer, s2, k2))
            return p->rc;
    }
    if (seen[T_SECURITY] && parse_security(p, seen[T_SECURITY], &c->security)) return p->rc;

    size_t np, nd;
    if (parse_list(p, seen[T_PREFILL], "prefill", &np) ||
        parse_list(p, seen[T_DECODE], "decode", &nd))
        return p->rc;
    if (!nd)
        return cfg_fail(p, seen[T_DECODE] ? seen[T_DECODE] : root,
                        "no decode instance: 'decode' needs at least one entry");
    c->prefill = calloc(np ? np : 1, sizeof *c->prefill);
    c->decode = calloc(nd, sizeof *c->decode);
    inst_ref *refs = calloc(np + nd, sizeof *refs);
    if (!c->prefill || !c->decode || !refs) {
        free(refs);
        return cfg_fail(p, root, "out of memory");
    }
    for (size_t i = 0; i < np && !p->rc; i++) {
        c->n_prefill = (int)i + 1;
        parse_prefill(p, cfg_node_at(p, seen[T_PREFILL]->data.sequence.items.start[i]), (int)i,
                      &c->prefill[i], &refs[i]);
    }
    for (size_t i = 0; i < nd && !p->rc; i++) {
        c->n_decode = (int)i + 1;
        parse_decode(p, cfg_node_at(p, seen[T_DECODE]->data.sequence.items.start[i]), (int)i,
                     &c->decode[i], &refs[np + i]);
    }
    if (!p->rc) expand_groups(p, c, &refs, np);
    if (!p->rc) check_instances(p, refs, (int)np + c->n_decode);
    /* prefill stages write straight into decode blocks: one block size and KV type for
     * every decode instance (the prefill stages use the same) */
    for (int i = 1; np && !p->rc && i < c->n_decode; i++)
        if (c->decode[i].block_size != c->decode[0].block_size ||
            c->decode[i].kv_dtype != c->decode[0].kv_dtype)
            cfg_fail(p, refs[np + i].name_node,
                     "decode instance '%s' has block_size %d / kv_dtype %s but '%s' has %d / %s: "
                     "with prefill instances every decode instance needs the same",
                     c->decode[i].name, c->decode[i].block_size,
                     cfg_kv_dtype_name(c->decode[i].kv_dtype), c->decode[0].name,
                     c->decode[0].block_size, cfg_kv_dtype_name(c->decode[0].kv_dtype));
    free(refs);
    return p->rc;
}

/* ---- entry points -------------------------------------------------------------------- */

int td_cfg_parse(const char *text, size_t len, const char *name, td_cfg **out, char *err,
                 size_t errcap)
{
    return td_cfg_parse_flags(text, len, name, 0, out, err, errcap);
}

int td_cfg_parse_flags(const char *text, size_t len, const char *name, unsigned flags, td_cfg **out,
                       char *err, size_t errcap)
{
    *out = NULL;
    if (err && errcap) err[0] = 0;
    td_cfg_ctx p = {.file = name ? name : "<config>", .err = err, .errcap = errcap, .flags = flags};
    yaml_parser_t parser;
    yaml_document_t doc;
    if (!yaml_parser_initialize(&parser)) {
        td_errbuf_set(err, errcap, "%s: out of memory", p.file);
        return TD_ENOMEM;
    }
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    if (!yaml_parser_load(&parser, &doc)) {
        yaml_mark_t m = parser.problem_mark;
        td_errbuf_set(err, errcap, "%s:%zu:%zu: yaml: %s%s%s", p.file, m.line + 1, m.column + 1,
                      parser.problem ? parser.problem : "syntax error", parser.context ? " " : "",
                      parser.context ? parser.context : "");
        yaml_parser_delete(&parser);
        return TD_EFORMAT;
    }
    p.doc = &doc;
    td_cfg *c = calloc(1, sizeof *c);
    if (!c) {
        p.rc = TD_ENOMEM;
        td_errbuf_set(err, errcap, "%s: out of memory", p.file);
    } else {
        c->path = cfg_xstrdup(&p, p.file);
        if (!p.rc) parse_root(&p, yaml_document_get_root_node(&doc), c);
    }
    if (!p.rc) { /* a second document would be ignored silently: refuse it */
        yaml_document_t doc2;
        if (yaml_parser_load(&parser, &doc2)) {
            yaml_node_t *r2 = yaml_document_get_root_node(&doc2);
            if (r2) cfg_fail(&p, r2, "more than one YAML document");
            yaml_document_delete(&doc2);
        } else {
            yaml_mark_t m = parser.problem_mark;
            p.rc = TD_EFORMAT;
            td_errbuf_set(err, errcap, "%s:%zu:%zu: yaml: %s", p.file, m.line + 1, m.column + 1,
                          parser.problem ? parser.problem : "syntax error");
        }
    }
    yaml_document_delete(&doc);
    yaml_parser_delete(&parser);
    if (p.rc) {
        td_cfg_free(c);
        return p.rc;
    }
    *out = c;
    return 0;
}

int td_cfg_load(const char *path, td_cfg **out, char *err, size_t errcap)
{
    return td_cfg_load_flags(path, 0, out, err, errcap);
}

int td_cfg_load_flags(const char *path, unsigned flags, td_cfg **out, char *err, size_t errcap)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        td_errbuf_set(err, errcap, "%s:1:1: cannot open: %s", path, strerror(errno));
        return TD_EIO;
    }
    char *buf = malloc(MAX_FILE_BYTES + 1);
    size_t n = buf ? fread(buf, 1, MAX_FILE_BYTES + 1, f) : 0;
    int rerr = ferror(f);
    fclose(f);
    if (!buf) {
        td_errbuf_set(err, errcap, "%s: out of memory", path);
        return TD_ENOMEM;
    }
    if (rerr || n > MAX_FILE_BYTES) {
        td_errbuf_set(err, errcap, "%s:1:1: %s", path, rerr ? "read error" : "larger than 16 MiB");
        free(buf);
        return TD_EIO;
    }
    int rc = td_cfg_parse_flags(buf, n, path, flags, out, err, errcap);
    free(buf);
    return rc;
}
