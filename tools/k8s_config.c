/* k8s_config.c: the cluster YAML as the pods of `tandem k8s render` read it (k8s_int.h).
 *
 * The user's file is loaded as a libyaml node tree and only the keys that must change in
 * pods are rewritten (every other key, including ones this file does not know, is kept as
 * written; comments are dropped):
 *   model, decode[].speculative.draft  -> /models/BASENAME (the model volume)
 *   run_dir                            -> /var/cache/tandem/run
 *   router.listen                      -> 0.0.0.0:PORT (its port kept)
 *   router.membership                  -> listen 0.0.0.0:MPORT, address BASE-join:MPORT (the
 *                                         Service nodes dial), seed false (the YAML's
 *                                         instances are templates: every pod joins under its
 *                                         own name); lease_ms and max_instances kept
 *   decode[].devices, prefill[].devices -> removed (each rank or stage container is given one
 *                                         GPU, its device 0)
 *   decode[].prefix_cache_tier.path    -> /var/lib/tandem/tier/BASENAME (an emptyDir)
 *   kvxfer.ucx_tls                     -> tcp, when the list has no tcp (pods share no memory)
 *   router.chat_template (a file)      -> /etc/tandem/chat_template.jinja (in the ConfigMap)
 *   security.*, router.tls_*           -> /etc/tandem/secret/BASENAME (the Secret BASE-secret)
 * Hosts and ports are kept: in a pod rank 0 and stage 0 bind 0.0.0.0 (--listen), announce
 * the pod's IP (--advertise) and later stages find stage 0 at 127.0.0.1 (--leader), so the
 * YAML's hosts are not used there.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "k8s_int.h"
#include "td_err.h"

typedef struct {
    yaml_document_t *doc;
    const cli_k8s_opts *o;
    bool err;
} rw_ctx;

static const char *base_name(const char *path)
{
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

int cli_k8s_port_of(const char *hostport)
{
    const char *c = hostport ? strrchr(hostport, ':') : NULL;
    return c ? atoi(c + 1) : 0;
}

static void note(const rw_ctx *r, const char *fmt, const char *a, const char *b)
{
    if (r->o->quiet) return;
    fprintf(stderr, "tandem k8s: note: ");
    fprintf(stderr, fmt, a, b);
    fputc('\n', stderr);
}

static const char *scalar_of(yaml_document_t *doc, int id)
{
    yaml_node_t *n = id ? yaml_document_get_node(doc, id) : NULL;
    return n && n->type == YAML_SCALAR_NODE ? (const char *)n->data.scalar.value : NULL;
}

/* A new scalar node: plain for numbers and booleans (is_plain) and for strings that read
 * back as themselves, else double-quoted. */
static int new_scalar(rw_ctx *r, const char *v, bool is_plain)
{
    int id =
        yaml_document_add_scalar(r->doc, NULL, (yaml_char_t *)v, -1,
                                 is_plain || cli_k8s_plain_ok(v) ? YAML_PLAIN_SCALAR_STYLE
                                                                 : YAML_DOUBLE_QUOTED_SCALAR_STYLE);
    if (!id) r->err = true;
    return id;
}

/* map[key] = value node (replaced, or appended). */
static void set_node(rw_ctx *r, int map, const char *key, int value)
{
    if (r->err || !value) return;
    yaml_node_t *m = yaml_document_get_node(r->doc, map);
    for (yaml_node_pair_t *p = m->data.mapping.pairs.start; p < m->data.mapping.pairs.top; p++) {
        const char *k = scalar_of(r->doc, p->key);
        if (k && !strcmp(k, key)) {
            p->value = value;
            return;
        }
    }
    int k = new_scalar(r, key, true);
    if (k && !yaml_document_append_mapping_pair(r->doc, map, k, value)) r->err = true;
}

static void set_str(rw_ctx *r, int map, const char *key, const char *v)
{
    set_node(r, map, key, new_scalar(r, v, false));
}

static void del_key(rw_ctx *r, int map, const char *key)
{
    yaml_node_t *m = yaml_document_get_node(r->doc, map);
    yaml_node_pair_t *p = m->data.mapping.pairs.start, *top = m->data.mapping.pairs.top;
    for (; p < top; p++) {
        const char *k = scalar_of(r->doc, p->key);
        if (k && !strcmp(k, key)) {
            memmove(p, p + 1, (size_t)(top - p - 1) * sizeof *p);
            m->data.mapping.pairs.top--;
            return;
        }
    }
}

/* The mapping under key, created when absent. */
static int sub_map(rw_ctx *r, int map, const char *key)
{
    int id = cli_k8s_get(r->doc, map, key);
    yaml_node_t *n = id ? yaml_document_get_node(r->doc, id) : NULL;
    if (n && n->type == YAML_MAPPING_NODE) return id;
    id = yaml_document_add_mapping(r->doc, NULL, YAML_BLOCK_MAPPING_STYLE);
    if (!id) r->err = true;
    set_node(r, map, key, id);
    return id;
}

/* Replaces the path at map[key] by DIR/BASENAME; returns the base name (in the document) or
 * NULL when the key is absent. */
static const char *move_path(rw_ctx *r, int map, const char *key, const char *dir)
{
    const char *old = scalar_of(r->doc, cli_k8s_get(r->doc, map, key));
    if (!old || !*old) return NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, base_name(old));
    if (strcmp(path, old)) note(r, "%s -> %s", old, path);
    set_str(r, map, key, path);
    return base_name(old);
}

/* Appends word to a malloc'd space-separated list (once). */
static void add_word(rw_ctx *r, char **list, const char *word)
{
    size_t n = *list ? strlen(*list) : 0;
    if (*list) {
        for (const char *p = *list; (p = strstr(p, word)); p++)
            if ((p == *list || p[-1] == ' ') && (p[strlen(word)] == ' ' || !p[strlen(word)]))
                return;
    }
    char *s = realloc(*list, n + strlen(word) + 2);
    if (!s) {
        r->err = true;
        return;
    }
    if (n) s[n++] = ' ';
    strcpy(s + n, word);
    *list = s;
}

/* Each item of the sequence at root[key] that is a mapping: fn(r, item, c). */
static void each_item(rw_ctx *r, int root, const char *key, cli_k8s_cluster *c,
                      void (*fn)(rw_ctx *, int, cli_k8s_cluster *))
{
    int id = cli_k8s_get(r->doc, root, key);
    yaml_node_t *s = id ? yaml_document_get_node(r->doc, id) : NULL;
    if (!s || s->type != YAML_SEQUENCE_NODE) return;
    int n = (int)(s->data.sequence.items.top - s->data.sequence.items.start);
    for (int i = 0; i < n; i++) {
        s = yaml_document_get_node(r->doc, id); /* adding nodes moves them */
        int item = s->data.sequence.items.start[i];
        yaml_node_t *it = yaml_document_get_node(r->doc, item);
        if (it && it->type == YAML_MAPPING_NODE) fn(r, item, c);
    }
}

static void rw_decode(rw_ctx *r, int d, cli_k8s_cluster *c)
{
    if (cli_k8s_get(r->doc, d, "devices")) {
        note(r, "%s%s: devices removed (each rank's container is given one GPU, its device 0)",
             "decode", "[]");
        del_key(r, d, "devices");
    }
    int spec = cli_k8s_get(r->doc, d, "speculative");
    if (spec) {
        const char *draft = move_path(r, spec, "draft", CLI_K8S_MODEL_DIR);
        if (draft) add_word(r, &c->draft_names, draft);
    }
    int tier = cli_k8s_get(r->doc, d, "prefix_cache_tier");
    if (tier && move_path(r, tier, "path", CLI_K8S_TIER_DIR)) c->tier = true;
}

static void rw_prefill(rw_ctx *r, int p, cli_k8s_cluster *c)
{
    (void)c;
    if (cli_k8s_get(r->doc, p, "devices")) {
        note(r, "%s%s: devices removed (each stage's container is given one GPU, its device 0)",
             "prefill", "[]");
        del_key(r, p, "devices");
    }
}

/* router.listen and router.membership. */
static void rw_router(rw_ctx *r, int root, const td_cfg *orig, cli_k8s_cluster *c)
{
    int router = sub_map(r, root, "router");
    char v[512];
    c->http_port = cli_k8s_port_of(orig->router.listen);
    snprintf(v, sizeof v, "0.0.0.0:%d", c->http_port);
    if (strcmp(v, orig->router.listen)) note(r, "router.listen: %s -> %s", orig->router.listen, v);
    set_str(r, router, "listen", v);
    int mem = sub_map(r, router, "membership");
    int port = cli_k8s_port_of(orig->router.membership.listen);
    c->member_port = port ? port : CLI_K8S_MEMBER_PORT;
    snprintf(v, sizeof v, "0.0.0.0:%d", c->member_port);
    set_str(r, mem, "listen", v);
    snprintf(v, sizeof v, "%s-join:%d", r->o->base, c->member_port);
    if (strcmp(v, orig->router.membership.address))
        note(r, "router.membership.address: %s -> %s",
             *orig->router.membership.address ? orig->router.membership.address : "(none)", v);
    set_str(r, mem, "address", v);
    set_node(r, mem, "seed", new_scalar(r, "false", true));
}

/* Everything but the files that come from the Secret and the ConfigMap's template. */
static void rw_common(rw_ctx *r, const td_cfg *orig, cli_k8s_cluster *c)
{
    int root = 1;
    const char *model = move_path(r, root, "model", CLI_K8S_MODEL_DIR);
    if (model && !c->model_name && !(c->model_name = strdup(model))) r->err = true;
    set_str(r, root, "run_dir", CLI_K8S_CACHE_DIR "/run");
    rw_router(r, root, orig, c);
    each_item(r, root, "decode", c, rw_decode);
    each_item(r, root, "prefill", c, rw_prefill);
    if (!strstr(orig->kvxfer.ucx_tls, "tcp")) {
        note(r, "kvxfer.ucx_tls: %s -> %s (pods share no memory: KV moves over tcp)",
             orig->kvxfer.ucx_tls, "tcp");
        set_str(r, sub_map(r, root, "kvxfer"), "ucx_tls", "tcp");
    }
}

/* security.* and router.tls_*: into the Secret's mount; the chat template into the
 * ConfigMap's. */
static void rw_files(rw_ctx *r, const td_cfg *orig, cli_k8s_cluster *c)
{
    int router = sub_map(r, 1, "router");
    static const char *const tls[] = {"tls_cert", "tls_key", "tls_client_ca"};
    for (int i = 0; i < 3; i++) {
        const char *b = move_path(r, router, tls[i], CLI_K8S_SECRET_DIR);
        if (b) {
            c->secret = true;
            add_word(r, &c->secret_files, b);
        }
    }
    int sec = cli_k8s_get(r->doc, 1, "security");
    static const char *const keys[] = {"ca", "cert", "key"};
    for (int i = 0; sec && i < 3; i++) {
        const char *b = move_path(r, sec, keys[i], CLI_K8S_SECRET_DIR);
        if (b) {
            c->secret = true;
            add_word(r, &c->secret_files, b);
        }
    }
    const char *t = orig->router.chat_template;
    if (*t && strcmp(t, "chatml") && strcmp(t, "llama3") && strcmp(t, "llama2") &&
        strcmp(t, "gemma")) {
        size_t len;
        c->template_text = cli_read_file("k8s", t, &len);
        if (!c->template_text) r->err = true;
        set_str(r, router, "chat_template", CLI_K8S_CONFIG_DIR "/chat_template.jinja");
    }
}

/* Loads text as a node tree, rewrites it (files too when final) and emits it. */
static int rewrite(const cli_k8s_opts *o, const char *text, size_t len, const td_cfg *orig,
                   cli_k8s_cluster *c, bool final, char **out)
{
    yaml_parser_t ps;
    yaml_document_t doc;
    if (!yaml_parser_initialize(&ps)) return TD_ENOMEM;
    yaml_parser_set_input_string(&ps, (const unsigned char *)text, len);
    int ok = yaml_parser_load(&ps, &doc);
    yaml_parser_delete(&ps);
    if (!ok) return TD_EFORMAT; /* td_cfg_load read it: not expected */
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (!root || root->type != YAML_MAPPING_NODE) {
        yaml_document_delete(&doc);
        return TD_EFORMAT;
    }
    cli_k8s_opts quiet = *o;
    quiet.quiet = o->quiet || !final; /* notes once */
    rw_ctx r = {.doc = &doc, .o = &quiet};
    rw_common(&r, orig, c);
    if (final) rw_files(&r, orig, c);
    if (r.err) {
        yaml_document_delete(&doc);
        return TD_ENOMEM;
    }
    return cli_k8s_emit_string(&doc, out);
}

int cli_k8s_cluster_build(const cli_k8s_opts *o, const td_cfg *orig, cli_k8s_cluster *c)
{
    memset(c, 0, sizeof *c);
    size_t len;
    char *text = cli_read_file("k8s", o->file, &len);
    if (!text) return TD_EIO;
    char *check = NULL;
    /* the check copy keeps the chat template where it is here, so that td_cfg_parse can
     * read it (the Secret's files are not opened: they need not be here); the pods' copy
     * names their mounts */
    int rc = rewrite(o, text, len, orig, c, false, &check);
    if (!rc) rc = rewrite(o, text, len, orig, c, true, &c->text);
    free(text);
    if (rc) {
        fprintf(stderr, "tandem k8s: cannot rewrite %s for pods: %s\n", o->file, td_strerror(rc));
        free(check);
        return rc;
    }
    char err[1024], name[512];
    snprintf(name, sizeof name, "%s (rewritten for pods)", o->file);
    rc = td_cfg_parse_flags(check, strlen(check), name, TD_CFG_NO_FILE_CHECKS, &c->cfg, err,
                            sizeof err);
    free(check);
    if (rc) {
        fprintf(stderr, "tandem k8s: %s\n", err);
        return rc;
    }
    if (!c->model_name) {
        fprintf(stderr, "tandem k8s: %s: no model\n", o->file);
        return TD_EINVAL;
    }
    return 0;
}

void cli_k8s_cluster_free(cli_k8s_cluster *c)
{
    free(c->text);
    free(c->template_text);
    td_cfg_free(c->cfg);
    free(c->model_name);
    free(c->draft_names);
    free(c->secret_files);
    memset(c, 0, sizeof *c);
}
