/* k8s_int.h: the parts of `tandem k8s render` (cmd_k8s.c): the cluster YAML rewritten for
 * pods (k8s_config.c), the size estimates (k8s_size.c), the manifests (k8s_manifest.c) and
 * a small builder over libyaml's document API that writes them (k8s_yaml.c).
 *
 * Contract: the manifests are libyaml documents, so every string is quoted by the emitter's
 * rules (a scalar that would read as another type, such as "8000", "true" or "1e3", is
 * double-quoted; the cluster YAML goes into the ConfigMap as a literal block).
 * Errors: the builder records the first failure (out of memory) in cli_k8s_doc.err and
 * every later call does nothing; the caller checks it once per document. Other failures
 * print "tandem k8s: ..." and return a negative td_err.
 * Ownership: cli_k8s_out owns the documents it collected until cli_k8s_out_write/free.
 */
#ifndef TANDEM_K8S_INT_H
#define TANDEM_K8S_INT_H

#include <stdbool.h>
#include <stdint.h>
#include <yaml.h>

#include "config.h"

/* ---- k8s_yaml.c: building documents ---- */

typedef struct {
    yaml_document_t doc;
    bool err; /* a libyaml call failed (memory): the document is incomplete */
} cli_k8s_doc;

void cli_k8s_doc_init(cli_k8s_doc *d);
int cli_k8s_map(cli_k8s_doc *d);                /* a new mapping node: its id */
int cli_k8s_seq(cli_k8s_doc *d);                /* a new sequence node */
int cli_k8s_str(cli_k8s_doc *d, const char *s); /* a string, quoted when it must be */
/* Whether s reads back as the same string without quotes in every YAML reader. */
bool cli_k8s_plain_ok(const char *s);
int cli_k8s_num(cli_k8s_doc *d, long long v);    /* a plain integer */
int cli_k8s_text(cli_k8s_doc *d, const char *s); /* a multi-line string: a literal block */
void cli_k8s_put(cli_k8s_doc *d, int map, const char *key, int value);
void cli_k8s_put_str(cli_k8s_doc *d, int map, const char *key, const char *s);
void cli_k8s_put_num(cli_k8s_doc *d, int map, const char *key, long long v);
void cli_k8s_put_bool(cli_k8s_doc *d, int map, const char *key, bool v);
int cli_k8s_put_map(cli_k8s_doc *d, int map, const char *key); /* a new mapping under key */
int cli_k8s_put_seq(cli_k8s_doc *d, int map, const char *key); /* a new sequence under key */
void cli_k8s_push(cli_k8s_doc *d, int seq, int item);
void cli_k8s_push_str(cli_k8s_doc *d, int seq, const char *s);
/* A value is only appended by these calls; cli_k8s_get looks a key up (0: none). */
int cli_k8s_get(yaml_document_t *doc, int map, const char *key);

/* The documents of one render, in apply order, each with a file name for --out DIR. */
typedef struct {
    cli_k8s_doc *docs;
    char (*names)[128];
    int n, cap;
} cli_k8s_out;

/* A new document in out: its root mapping (node 1) has apiVersion, kind and metadata
 * (name, and the namespace when ns is set; *meta is the metadata mapping, for labels).
 * Returns the document or NULL (out of memory, printed). */
cli_k8s_doc *cli_k8s_out_add(cli_k8s_out *out, const char *api, const char *kind, const char *name,
                             const char *ns, int *meta);
/* Writes every document: to stdout as one multi-document stream (dir "-" or NULL), or one
 * file per document into dir (created if missing). Frees the documents. */
int cli_k8s_out_write(cli_k8s_out *out, const char *dir);
void cli_k8s_out_free(cli_k8s_out *out);
/* Emits doc (consumed) as one YAML document into a malloc'd NUL-terminated string. */
int cli_k8s_emit_string(yaml_document_t *doc, char **out);

/* ---- k8s_size.c: estimates from the model file ---- */

typedef struct {
    bool known;           /* the model file could be read: the figures below are set */
    int64_t file_bytes;   /* the GGUF's size */
    int n_layer;          /* the model's layers */
    int64_t kv_tok_layer; /* KV bytes of one token in one layer with every KV head (f16) */
    int n_head, n_head_kv;
    bool latent; /* latent attention: one vector per token and layer, not split by tp */
} cli_k8s_model;

/* Reads the model's shape from path (nothing is loaded beyond the header); known stays
 * false when it cannot be read (a note on stderr says so). */
void cli_k8s_model_read(const char *path, cli_k8s_model *m);
/* Memory of one decode rank / one prefill stage (bytes): weights share + KV + fixed
 * overhead (docs/deploy.md, "Kubernetes": the formula); 0 when the model is unknown. */
int64_t cli_k8s_decode_rank_bytes(const cli_k8s_model *m, const td_cfg_decode *d);
int64_t cli_k8s_decode_kv_bytes(const cli_k8s_model *m, const td_cfg_decode *d);
int64_t cli_k8s_prefill_stage_bytes(const cli_k8s_model *m, const td_cfg_prefill *p,
                                    const td_cfg_decode *d0, int stage);
/* "123Mi": bytes rounded up to MiB. */
void cli_k8s_mib(int64_t bytes, char *buf, size_t cap);

/* ---- k8s_config.c: the cluster YAML for pods ---- */

#define CLI_K8S_CONFIG_DIR  "/etc/tandem"       /* the ConfigMap's mount */
#define CLI_K8S_MODEL_DIR   "/models"           /* the model volume's mount */
#define CLI_K8S_CACHE_DIR   "/var/cache/tandem" /* TANDEM_CACHE, HOME, run_dir below it */
#define CLI_K8S_SECRET_DIR  "/etc/tandem/secret"
#define CLI_K8S_TIER_DIR    "/var/lib/tandem/tier"
#define CLI_K8S_MEMBER_PORT 9300 /* router.membership's port when the YAML has none */

typedef struct {
    const char *file;       /* the cluster YAML given */
    const char *base;       /* object name prefix (--name or the file's stem, DNS-safe) */
    const char *ns;         /* --namespace or NULL */
    const char *image;      /* --image */
    const char *model_pvc;  /* --model-pvc CLAIM or NULL: an emptyDir per pod */
    const char *model_file; /* --model-file: where the model is read here for the sizes */
    int grace_s;            /* --grace, or 0: from router.drain_timeout_ms */
    bool quiet;             /* --quiet: no notes */
} cli_k8s_opts;

/* What the render writes, after the rewrite: the text for the ConfigMap and what the
 * manifests need that the text alone does not say. */
typedef struct {
    char *text;          /* the cluster YAML as the pods read it */
    char *template_text; /* router.chat_template's file, or NULL */
    td_cfg *cfg;         /* text loaded (with the secret files at their local paths) */
    char *model_name;    /* the model file's base name (the init container fetches it) */
    char *draft_names;   /* draft models' base names, space-separated, or NULL */
    bool secret;         /* security or router TLS: the Secret <base>-secret is mounted */
    char *secret_files;  /* their base names, space-separated (for the docs' command) */
    bool tier;           /* a decode instance has prefix_cache_tier */
    int member_port;     /* router.membership's port */
    int http_port;       /* router.listen's port */
} cli_k8s_cluster;

int cli_k8s_cluster_build(const cli_k8s_opts *o, const td_cfg *orig, cli_k8s_cluster *c);
void cli_k8s_cluster_free(cli_k8s_cluster *c);
/* The port of "HOST:PORT" (0 if none). */
int cli_k8s_port_of(const char *hostport);

/* ---- k8s_pod.c: what every pod shares ---- */

typedef struct {
    const cli_k8s_opts *o;
    const cli_k8s_cluster *c;
    const cli_k8s_model *m;
    bool shm;           /* an emptyDir {medium: Memory} at /dev/shm (decode, prefill) */
    int64_t shm_bytes;  /* its sizeLimit (0: none) */
    bool tier;          /* the prefix cache tier's emptyDir */
    int64_t tier_bytes; /* its sizeLimit */
    bool fetch;         /* the init container: the model volume writable, no shm or tier */
} cli_k8s_pod;

void cli_k8s_labels(cli_k8s_doc *d, int map, const char *base, const char *component,
                    const char *inst);
void cli_k8s_pod_security(cli_k8s_doc *d, int spec);
int cli_k8s_container(cli_k8s_doc *d, int list, const cli_k8s_pod *p, const char *name,
                      const char *const *argv, int argc);
void cli_k8s_volumes(cli_k8s_doc *d, int spec, const cli_k8s_pod *p);
void cli_k8s_init_fetch(cli_k8s_doc *d, int spec, const cli_k8s_pod *p);
void cli_k8s_exec_probe(cli_k8s_doc *d, int ctr, const char *key, bool alive, int port, int period,
                        int failures);
void cli_k8s_resources(cli_k8s_doc *d, int ctr, int threads, int64_t bytes, bool gpu);

/* ---- k8s_manifest.c ---- */

/* A DNS-1123 label from an instance name: lower case, [_.] -> '-'. false when the result
 * is not a valid label or over cap - 1 bytes. */
bool cli_k8s_dns_name(const char *in, char *out, size_t cap);
/* The instances' object names (base-INST): DNS labels, within a pod name's length, no clash
 * with each other or with the router's objects; the reason is printed. */
int cli_k8s_check_names(const char *base, const td_cfg *cfg);
int cli_k8s_manifests(const cli_k8s_opts *o, const cli_k8s_cluster *c, const cli_k8s_model *m,
                      cli_k8s_out *out);

#endif
