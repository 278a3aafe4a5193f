/* k8s_yaml.c: a small builder over libyaml's document API and the writer of `tandem k8s
 * render`'s documents (k8s_int.h). */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "k8s_int.h"
#include "td_err.h"

void cli_k8s_doc_init(cli_k8s_doc *d)
{
    memset(d, 0, sizeof *d);
    /* explicit "---" before every document */
    if (!yaml_document_initialize(&d->doc, NULL, NULL, NULL, 0, 1)) d->err = true;
}

static int checked(cli_k8s_doc *d, int id)
{
    if (!id) d->err = true;
    return id;
}

int cli_k8s_map(cli_k8s_doc *d)
{
    if (d->err) return 0;
    return checked(d, yaml_document_add_mapping(&d->doc, NULL, YAML_BLOCK_MAPPING_STYLE));
}

int cli_k8s_seq(cli_k8s_doc *d)
{
    if (d->err) return 0;
    return checked(d, yaml_document_add_sequence(&d->doc, NULL, YAML_BLOCK_SEQUENCE_STYLE));
}

/* Words a YAML 1.1 reader (Kubernetes' go-yaml) takes for a boolean or null. */
static bool yaml11_word(const char *s)
{
    static const char *const words[] = {"y",    "n",     "yes",  "no",  "on", "off",
                                        "true", "false", "null", "nil", NULL};
    for (int i = 0; words[i]; i++)
        if (!strcasecmp(s, words[i])) return true;
    return false;
}

/* Whether s reads as the same string without quotes in every YAML reader: a letter or '/'
 * first, then letters, digits and "-_./", and no boolean or null word. Anything else
 * (numbers, "8000", "1e3", ":" and spaces, the empty string) is double-quoted. */
bool cli_k8s_plain_ok(const char *s)
{
    if (!isalpha((unsigned char)s[0]) && s[0] != '/') return false;
    for (const char *p = s; *p; p++)
        if (!isalnum((unsigned char)*p) && !strchr("-_./", *p)) return false;
    return !yaml11_word(s);
}

int cli_k8s_str(cli_k8s_doc *d, const char *s)
{
    if (d->err) return 0;
    yaml_scalar_style_t st =
        cli_k8s_plain_ok(s) ? YAML_PLAIN_SCALAR_STYLE : YAML_DOUBLE_QUOTED_SCALAR_STYLE;
    return checked(d, yaml_document_add_scalar(&d->doc, NULL, (yaml_char_t *)s, -1, st));
}

int cli_k8s_text(cli_k8s_doc *d, const char *s)
{
    if (d->err) return 0;
    return checked(d, yaml_document_add_scalar(&d->doc, NULL, (yaml_char_t *)s, -1,
                                               YAML_LITERAL_SCALAR_STYLE));
}

int cli_k8s_num(cli_k8s_doc *d, long long v)
{
    if (d->err) return 0;
    char buf[32];
    snprintf(buf, sizeof buf, "%lld", v);
    /* the default tag and a plain style: written without a tag, read as an integer */
    return checked(d, yaml_document_add_scalar(&d->doc, NULL, (yaml_char_t *)buf, -1,
                                               YAML_PLAIN_SCALAR_STYLE));
}

void cli_k8s_put(cli_k8s_doc *d, int map, const char *key, int value)
{
    if (d->err || !map || !value) {
        d->err = true;
        return;
    }
    int k = cli_k8s_str(d, key);
    if (k && !yaml_document_append_mapping_pair(&d->doc, map, k, value)) d->err = true;
}

void cli_k8s_put_str(cli_k8s_doc *d, int map, const char *key, const char *s)
{
    cli_k8s_put(d, map, key, cli_k8s_str(d, s));
}

void cli_k8s_put_num(cli_k8s_doc *d, int map, const char *key, long long v)
{
    cli_k8s_put(d, map, key, cli_k8s_num(d, v));
}

void cli_k8s_put_bool(cli_k8s_doc *d, int map, const char *key, bool v)
{
    if (d->err) return;
    int id = yaml_document_add_scalar(&d->doc, NULL, (yaml_char_t *)(v ? "true" : "false"), -1,
                                      YAML_PLAIN_SCALAR_STYLE);
    cli_k8s_put(d, map, key, checked(d, id));
}

int cli_k8s_put_map(cli_k8s_doc *d, int map, const char *key)
{
    int m = cli_k8s_map(d);
    cli_k8s_put(d, map, key, m);
    return m;
}

int cli_k8s_put_seq(cli_k8s_doc *d, int map, const char *key)
{
    int s = cli_k8s_seq(d);
    cli_k8s_put(d, map, key, s);
    return s;
}

void cli_k8s_push(cli_k8s_doc *d, int seq, int item)
{
    if (d->err || !seq || !item) {
        d->err = true;
        return;
    }
    if (!yaml_document_append_sequence_item(&d->doc, seq, item)) d->err = true;
}

void cli_k8s_push_str(cli_k8s_doc *d, int seq, const char *s)
{
    cli_k8s_push(d, seq, cli_k8s_str(d, s));
}

int cli_k8s_get(yaml_document_t *doc, int map, const char *key)
{
    yaml_node_t *m = yaml_document_get_node(doc, map);
    if (!m || m->type != YAML_MAPPING_NODE) return 0;
    for (yaml_node_pair_t *p = m->data.mapping.pairs.start; p < m->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(doc, p->key);
        if (k && k->type == YAML_SCALAR_NODE && !strcmp((char *)k->data.scalar.value, key))
            return p->value;
    }
    return 0;
}

/* ---- the set of documents ---- */

cli_k8s_doc *cli_k8s_out_add(cli_k8s_out *out, const char *api, const char *kind, const char *name,
                             const char *ns, int *meta)
{
    if (out->n == out->cap) {
        int cap = out->cap ? out->cap * 2 : 16;
        cli_k8s_doc *docs = realloc(out->docs, (size_t)cap * sizeof *docs);
        if (docs) out->docs = docs;
        char(*names)[128] = docs ? realloc(out->names, (size_t)cap * sizeof *names) : NULL;
        if (!docs || !names) {
            fprintf(stderr, "tandem k8s: out of memory\n");
            return NULL;
        }
        out->names = names;
        out->cap = cap;
    }
    cli_k8s_doc *d = &out->docs[out->n];
    cli_k8s_doc_init(d);
    char lower[64];
    size_t i = 0;
    for (; kind[i] && i < sizeof lower - 1; i++)
        lower[i] = (char)tolower((unsigned char)kind[i]);
    lower[i] = 0;
    snprintf(out->names[out->n], sizeof out->names[0], "%02d-%s-%s.yaml", out->n, lower, name);
    out->n++;
    int root = cli_k8s_map(d);
    cli_k8s_put_str(d, root, "apiVersion", api);
    cli_k8s_put_str(d, root, "kind", kind);
    *meta = cli_k8s_put_map(d, root, "metadata");
    cli_k8s_put_str(d, *meta, "name", name);
    if (ns) cli_k8s_put_str(d, *meta, "namespace", ns);
    return d;
}

static void emitter_setup(yaml_emitter_t *e)
{
    yaml_emitter_set_unicode(e, 1);
    yaml_emitter_set_width(e, -1); /* no folding of long scalars */
    yaml_emitter_set_indent(e, 2);
}

/* Dumps doc (consumed) into an opened emitter. */
static int dump(yaml_emitter_t *e, yaml_document_t *doc)
{
    if (!yaml_emitter_dump(e, doc)) {
        fprintf(stderr, "tandem k8s: yaml emitter: %s\n", e->problem ? e->problem : "error");
        return TD_EIO;
    }
    return 0;
}

static int write_stream(FILE *f, cli_k8s_doc *docs, int n)
{
    yaml_emitter_t e;
    if (!yaml_emitter_initialize(&e)) return TD_ENOMEM;
    emitter_setup(&e);
    yaml_emitter_set_output_file(&e, f);
    int rc = yaml_emitter_open(&e) ? 0 : TD_EIO, i = 0;
    for (; i < n && !rc; i++)
        rc = dump(&e, &docs[i].doc); /* dumped or not: consumed */
    for (; i < n; i++)
        yaml_document_delete(&docs[i].doc);
    if (!rc && !yaml_emitter_close(&e)) rc = TD_EIO;
    if (!rc && !yaml_emitter_flush(&e)) rc = TD_EIO;
    yaml_emitter_delete(&e);
    return rc;
}

int cli_k8s_out_write(cli_k8s_out *out, const char *dir)
{
    for (int i = 0; i < out->n; i++)
        if (out->docs[i].err) {
            fprintf(stderr, "tandem k8s: out of memory building %s\n", out->names[i]);
            return TD_ENOMEM;
        }
    if (!dir || !strcmp(dir, "-")) {
        int rc = write_stream(stdout, out->docs, out->n);
        out->n = 0; /* dumped: libyaml deleted them */
        if (!rc && fflush(stdout)) rc = TD_EIO;
        if (rc) fprintf(stderr, "tandem k8s: cannot write the manifests to stdout\n");
        return rc;
    }
    if (mkdir(dir, 0777) && errno != EEXIST) {
        fprintf(stderr, "tandem k8s: cannot create %s: %s\n", dir, strerror(errno));
        return TD_EIO;
    }
    int rc = 0, n = out->n;
    for (int i = 0; i < n; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, out->names[i]);
        FILE *f = rc ? NULL : fopen(path, "w");
        if (!rc && !f) {
            fprintf(stderr, "tandem k8s: cannot write %s: %s\n", path, strerror(errno));
            rc = TD_EIO;
        }
        if (f) {
            rc = write_stream(f, &out->docs[i], 1); /* consumes it */
            if (fclose(f) && !rc) rc = TD_EIO;
            if (rc) fprintf(stderr, "tandem k8s: cannot write %s\n", path);
        } else {
            yaml_document_delete(&out->docs[i].doc);
        }
    }
    out->n = 0;
    return rc;
}

void cli_k8s_out_free(cli_k8s_out *out)
{
    for (int i = 0; i < out->n; i++)
        yaml_document_delete(&out->docs[i].doc);
    free(out->docs);
    free(out->names);
    memset(out, 0, sizeof *out);
}

/* ---- one document into a string ---- */

typedef struct {
    char *buf;
    size_t len, cap;
} strbuf;

static int str_write(void *ctx, unsigned char *data, size_t size)
{
    strbuf *b = ctx;
    if (b->len + size + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + size + 1)
            cap *= 2;
        char *nb = realloc(b->buf, cap);
        if (!nb) return 0;
        b->buf = nb;
        b->cap = cap;
    }
    memcpy(b->buf + b->len, data, size);
    b->len += size;
    b->buf[b->len] = 0;
    return 1;
}

int cli_k8s_emit_string(yaml_document_t *doc, char **out)
{
    *out = NULL;
    strbuf b = {0};
    yaml_emitter_t e;
    if (!yaml_emitter_initialize(&e)) {
        yaml_document_delete(doc);
        return TD_ENOMEM;
    }
    emitter_setup(&e);
    yaml_emitter_set_output(&e, str_write, &b);
    int rc = 0;
    if (!yaml_emitter_open(&e)) {
        yaml_document_delete(doc);
        rc = TD_EIO;
    }
    if (!rc) rc = dump(&e, doc);
    if (!rc && (!yaml_emitter_close(&e) || !yaml_emitter_flush(&e))) rc = TD_EIO;
    yaml_emitter_delete(&e);
    if (rc || !b.buf) {
        free(b.buf);
        return rc ? rc : TD_EIO;
    }
    *out = b.buf;
    return 0;
}
