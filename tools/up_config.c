/* up_config.c: `tandem up --port N`'s copy of the cluster YAML (libyaml document API:
 * load, replace the port scalars, emit) and the bind test of every listening port before
 * a cluster starts. */
#define _GNU_SOURCE /* NI_MAXHOST */
#include "up_config.h"

#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <yaml.h>

#include "td_err.h"

/* --- the copy ------------------------------------------------------------------------------ */

/* Node ids, not pointers: adding a node may move the document's node array. */
static yaml_node_t *node(yaml_document_t *d, int id)
{
    return id ? yaml_document_get_node(d, id) : NULL;
}

/* The id of the value of key in mapping map_id (0: none), and the index of its pair. */
static int map_get(yaml_document_t *d, int map_id, const char *key, int *pair_ix)
{
    yaml_node_t *m = node(d, map_id);
    if (!m || m->type != YAML_MAPPING_NODE) return 0;
    for (yaml_node_pair_t *p = m->data.mapping.pairs.start; p < m->data.mapping.pairs.top; p++) {
        yaml_node_t *k = node(d, p->key);
        if (k && k->type == YAML_SCALAR_NODE && !strcmp((const char *)k->data.scalar.value, key)) {
            if (pair_ix) *pair_ix = (int)(p - m->data.mapping.pairs.start);
            return p->value;
        }
    }
    return 0;
}

static int add_scalar(yaml_document_t *d, const char *v)
{
    return yaml_document_add_scalar(d, NULL, (yaml_char_t *)v, -1, YAML_PLAIN_SCALAR_STYLE);
}

/* map_id[key] = value_id, replacing the value or appending the pair. 0 or TD_ENOMEM. */
static int map_set(yaml_document_t *d, int map_id, const char *key, int value_id)
{
    int ix = -1;
    if (!value_id) return TD_ENOMEM;
    if (map_get(d, map_id, key, &ix)) {
        node(d, map_id)->data.mapping.pairs.start[ix].value = value_id;
        return 0;
    }
    int k = add_scalar(d, key);
    if (!k || !yaml_document_append_mapping_pair(d, map_id, k, value_id)) return TD_ENOMEM;
    return 0;
}

static int set_port(yaml_document_t *d, int map_id, int port)
{
    char s[16];
    if (node(d, map_id)->type != YAML_MAPPING_NODE) return TD_EFORMAT; /* not validated */
    snprintf(s, sizeof s, "%d", port);
    return map_set(d, map_id, "port", add_scalar(d, s));
}

/* The length of sequence seq_id (0 if it is not a sequence) and its i-th item's id. */
static int seq_len(yaml_document_t *d, int seq_id)
{
    yaml_node_t *s = node(d, seq_id);
    if (!s || s->type != YAML_SEQUENCE_NODE) return 0;
    return (int)(s->data.sequence.items.top - s->data.sequence.items.start);
}

static int seq_item(yaml_document_t *d, int seq_id, int i)
{
    return node(d, seq_id)->data.sequence.items.start[i];
}

/* router.listen on port: "HOST:PORT" / "[V6]:PORT" keep their host; absent or not a
 * string: the default host, 127.0.0.1. */
static int set_listen(yaml_document_t *d, int root, int port)
{
    int router = map_get(d, root, "router", NULL);
    yaml_node_t *r = node(d, router);
    if (!r || r->type != YAML_MAPPING_NODE) { /* absent or null: every key default */
        router = yaml_document_add_mapping(d, NULL, YAML_BLOCK_MAPPING_STYLE);
        if (!router || map_set(d, root, "router", router)) return TD_ENOMEM;
    }
    char host[NI_MAXHOST + 2] = "127.0.0.1";
    yaml_node_t *old = node(d, map_get(d, router, "listen", NULL));
    if (old && old->type == YAML_SCALAR_NODE) {
        const char *v = (const char *)old->data.scalar.value;
        const char *colon = v[0] == '[' ? strstr(v, "]:") : strrchr(v, ':');
        if (colon && colon[0] == ']') colon++;
        if (colon && (size_t)(colon - v) < sizeof host)
            snprintf(host, sizeof host, "%.*s", (int)(colon - v), v);
    }
    char listen[sizeof host + 16];
    snprintf(listen, sizeof listen, "%s:%d", host, port);
    return map_set(d, router, "listen", add_scalar(d, listen));
}

static int emit(yaml_document_t *d, const char *src, int port, const char *dst, char *err,
                size_t errcap)
{
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", dst) >= (int)sizeof tmp) {
        yaml_document_delete(d);
        td_errbuf_set(err, errcap, "%s: path too long", dst);
        return TD_ERANGE;
    }
    FILE *f = fopen(tmp, "w");
    if (!f) {
        yaml_document_delete(d);
        td_errbuf_set(err, errcap, "%s: %s", tmp, strerror(errno));
        return TD_EIO;
    }
    fprintf(f,
            "# written by `tandem up --port %d` from\n#   %s\n"
            "# the same cluster with the router on port %d and the control ports from %d on\n"
            "# (comments dropped); edit that file, not this copy.\n",
            port, src, port, port + 1);
    yaml_emitter_t e;
    int ok = yaml_emitter_initialize(&e);
    if (ok) {
        yaml_emitter_set_output_file(&e, f);
        yaml_emitter_set_unicode(&e, 1);
        yaml_emitter_set_width(&e, -1);                          /* never fold a long scalar */
        ok = yaml_emitter_dump(&e, d) && yaml_emitter_close(&e); /* dump frees d */
        ok = ok && yaml_emitter_flush(&e);
        if (!ok && e.problem) td_errbuf_set(err, errcap, "%s: %s", dst, e.problem);
        yaml_emitter_delete(&e);
    } else {
        yaml_document_delete(d);
        td_errbuf_set(err, errcap, "%s: out of memory", dst);
    }
    if (fclose(f) && ok) {
        ok = 0;
        td_errbuf_set(err, errcap, "%s: %s", tmp, strerror(errno));
    }
    if (ok && rename(tmp, dst)) {
        ok = 0;
        td_errbuf_set(err, errcap, "%s: %s", dst, strerror(errno));
    }
    if (!ok) {
        unlink(tmp);
        return TD_EIO;
    }
    return 0;
}

int up_config_derive(const char *src, int port, const char *dst, char *err, size_t errcap)
{
    FILE *f = fopen(src, "rb");
    if (!f) {
        td_errbuf_set(err, errcap, "%s: %s", src, strerror(errno));
        return TD_EIO;
    }
    yaml_parser_t parser;
    yaml_document_t d;
    if (!yaml_parser_initialize(&parser)) {
        fclose(f);
        td_errbuf_set(err, errcap, "%s: out of memory", src);
        return TD_ENOMEM;
    }
    yaml_parser_set_input_file(&parser, f);
    int loaded = yaml_parser_load(&parser, &d);
    if (!loaded)
        td_errbuf_set(err, errcap, "%s:%zu: %s", src, parser.problem_mark.line + 1,
                      parser.problem ? parser.problem : "YAML error");
    yaml_parser_delete(&parser);
    fclose(f);
    if (!loaded) return TD_EFORMAT;
    int root = yaml_document_get_root_node(&d) ? 1 : 0;
    int decode = map_get(&d, root, "decode", NULL), prefill = map_get(&d, root, "prefill", NULL);
    int n_decode = seq_len(&d, decode), n_prefill = seq_len(&d, prefill);
    if (!root || node(&d, root)->type != YAML_MAPPING_NODE) {
        td_errbuf_set(err, errcap, "%s: not a cluster YAML (no mapping at the top)", src);
        yaml_document_delete(&d);
        return TD_EFORMAT;
    }
    if (port < 1 || port + n_decode + n_prefill > 65535) {
        td_errbuf_set(err, errcap,
                      "--port %d: the router and %d control ports need %d..%d, past 65535", port,
                      n_decode + n_prefill, port, port + n_decode + n_prefill);
        yaml_document_delete(&d);
        return TD_ERANGE;
    }
    int rc = set_listen(&d, root, port);
    for (int i = 0; !rc && i < n_decode; i++)
        rc = set_port(&d, seq_item(&d, decode, i), port + 1 + i);
    for (int i = 0; !rc && i < n_prefill; i++)
        rc = set_port(&d, seq_item(&d, prefill, i), port + 1 + n_decode + i);
    if (rc) {
        td_errbuf_set(err, errcap, "%s: %s", src,
                      rc == TD_ENOMEM ? "out of memory" : "an instance is not a mapping");
        yaml_document_delete(&d);
        return rc;
    }
    return emit(&d, src, port, dst, err, errcap);
}

/* --- the bind test ------------------------------------------------------------------------- */

typedef struct {
    char what[160]; /* "router.listen 127.0.0.1:8000", "decode d0's control port ..." */
    const char *host;
    int port;
    int fd;
} bind_slot;

/* Binds s (kept open, so that a port given twice is seen). 0, or the errno. */
static int bind_one(bind_slot *s, int *gai)
{
    char ps[16];
    snprintf(ps, sizeof ps, "%d", s->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    const char *host = s->host[0] ? s->host : NULL;
    *gai = getaddrinfo(host, ps, &hints, &ai);
    if (*gai) return 0;
    int e = 0;
    s->fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (s->fd < 0) {
        e = errno;
    } else {
        int one = 1;
        setsockopt(s->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(s->fd, ai->ai_addr, ai->ai_addrlen)) e = errno;
    }
    freeaddrinfo(ai);
    return e;
}

/* "HOST:PORT" / "[V6]:PORT" (already validated by td_cfg_load) -> host and port. */
static void split_listen(const char *listen, char *host, size_t cap, int *port)
{
    const char *colon = strrchr(listen, ':');
    const char *h = listen;
    size_t n = colon ? (size_t)(colon - listen) : 0;
    if (listen[0] == '[' && n >= 2 && listen[n - 1] == ']') {
        h++;
        n -= 2;
    }
    snprintf(host, cap, "%.*s", (int)(n < cap ? n : cap - 1), h);
    *port = colon ? atoi(colon + 1) : 0;
}

int up_ports_check(const td_cfg *cfg)
{
    int n = 1 + cfg->n_decode + cfg->n_prefill, rc = 0;
    bind_slot *s = calloc((size_t)n, sizeof *s);
    char router_host[NI_MAXHOST];
    if (!s) return TD_ENOMEM;
    split_listen(cfg->router.listen, router_host, sizeof router_host, &s[0].port);
    s[0].host = router_host;
    snprintf(s[0].what, sizeof s[0].what, "router.listen %s", cfg->router.listen);
    for (int i = 0; i < cfg->n_decode; i++) {
        bind_slot *b = &s[1 + i];
        b->host = cfg->decode[i].host;
        b->port = cfg->decode[i].port;
        snprintf(b->what, sizeof b->what, "decode %s's control port, rank 0 on %s",
                 cfg->decode[i].name, b->host);
    }
    for (int i = 0; i < cfg->n_prefill; i++) {
        bind_slot *b = &s[1 + cfg->n_decode + i];
        b->host = cfg->prefill[i].hosts[0];
        b->port = cfg->prefill[i].port;
        snprintf(b->what, sizeof b->what, "prefill %s's control port, stage 0 on %s",
                 cfg->prefill[i].name, b->host);
    }
    for (int i = 0; i < n; i++)
        s[i].fd = -1;
    for (int i = 0; i < n && !rc; i++) {
        int gai = 0, e = bind_one(&s[i], &gai);
        if (gai) {
            fprintf(stderr, "tandem: %s: cannot resolve host '%s': %s\n", s[i].what, s[i].host,
                    gai_strerror(gai));
            rc = TD_EINVAL;
        } else if (e == EADDRINUSE) {
            int twice = -1;
            for (int j = 0; j < i && twice < 0; j++)
                if (s[j].port == s[i].port) twice = j;
            if (twice >= 0)
                fprintf(stderr, "tandem: port %d is given twice (%s; %s)\n", s[i].port,
                        s[twice].what, s[i].what);
            else
                fprintf(stderr,
                        "tandem: port %d (%s) is in use: stop what listens there, or move the "
                        "cluster with `tandem up FILE --port N` (scripts/run.sh --port N)\n",
                        s[i].port, s[i].what);
            rc = TD_ESTATE;
        } else if (e) {
            fprintf(stderr, "tandem: cannot listen on port %d (%s): %s%s\n", s[i].port, s[i].what,
                    strerror(e),
                    e == EADDRNOTAVAIL ? " (tandem up runs every process on this machine; "
                                         "start the processes of other hosts there with "
                                         "deploy/start-*.sh)"
                    : e == EACCES      ? " (ports below 1024 need privileges)"
                                       : "");
            rc = TD_EINVAL;
        }
    }
    for (int i = 0; i < n; i++)
        if (s[i].fd >= 0) close(s[i].fd);
    free(s);
    return rc;
}
