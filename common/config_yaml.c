/* config_yaml.c: the machinery under config.c's sections (config_int.h): the first error
 * with its place in the file, scalars checked against their ranges, and a mapping walked
 * against a section's table of fields. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "config_int.h"
#include "td_err.h"

int cfg_fail(td_cfg_ctx *p, const yaml_node_t *n, const char *fmt, ...)
{
    if (p->rc) return p->rc;
    p->rc = TD_EINVAL;
    if (!p->err || !p->errcap) return p->rc;
    int k = snprintf(p->err, p->errcap, "%s:%zu:%zu: ", p->file, n ? n->start_mark.line + 1 : 1,
                     n ? n->start_mark.column + 1 : 1);
    if (k < 0 || (size_t)k >= p->errcap) return p->rc;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->err + k, p->errcap - (size_t)k, fmt, ap);
    va_end(ap);
    return p->rc;
}

yaml_node_t *cfg_node_at(td_cfg_ctx *p, int i)
{
    return yaml_document_get_node(p->doc, i);
}

const char *cfg_sval(const yaml_node_t *n)
{
    return (const char *)n->data.scalar.value;
}

bool cfg_is_null(const yaml_node_t *n)
{
    if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return false;
    const char *v = cfg_sval(n);
    return !*v || !strcmp(v, "~") || !strcmp(v, "null") || !strcmp(v, "Null") || !strcmp(v, "NULL");
}

const char *cfg_kind_name(const yaml_node_t *n)
{
    if (n->type == YAML_MAPPING_NODE) return "a mapping";
    if (n->type == YAML_SEQUENCE_NODE) return "a list";
    if (cfg_is_null(n)) return "nothing (null)";
    return "a string";
}

char *cfg_xstrdup(td_cfg_ctx *p, const char *s)
{
    char *d = strdup(s);
    if (!d && !p->rc) {
        p->rc = TD_ENOMEM;
        td_errbuf_set(p->err, p->errcap, "%s: out of memory", p->file);
    }
    return d;
}

void cfg_set_str(td_cfg_ctx *p, char **dst, const char *s)
{
    char *d = cfg_xstrdup(p, s);
    if (!d) return;
    free(*dst);
    *dst = d;
}

/* "~/x" -> "$HOME/x"; anything else unchanged. */
void cfg_set_path(td_cfg_ctx *p, char **dst, const char *s)
{
    const char *home = getenv("HOME");
    if ((s[0] == '~' && (s[1] == '/' || !s[1])) && home && *home) {
        size_t n = strlen(home) + strlen(s);
        char *d = malloc(n);
        if (!d) {
            if (!p->rc) td_errbuf_set(p->err, p->errcap, "%s: out of memory", p->file);
            p->rc = p->rc ? p->rc : TD_ENOMEM;
            return;
        }
        snprintf(d, n, "%s%s", home, s + 1);
        free(*dst);
        *dst = d;
        return;
    }
    cfg_set_str(p, dst, s);
}

/* ---- scalars ------------------------------------------------------------------------- */

static int get_int(td_cfg_ctx *p, const yaml_node_t *n, int64_t lo, int64_t hi, int64_t *out)
{
    if (n->type != YAML_SCALAR_NODE || cfg_is_null(n) ||
        n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return cfg_fail(p, n, "expected an integer, got %s", cfg_kind_name(n));
    const char *s = cfg_sval(n);
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end || errno) return cfg_fail(p, n, "expected an integer, got '%s'", s);
    if (v < lo || v > hi)
        return cfg_fail(p, n, "%lld is out of range [%lld, %lld]", v, (long long)lo, (long long)hi);
    *out = v;
    return 0;
}

static int get_float(td_cfg_ctx *p, const yaml_node_t *n, double lo, double hi, double *out)
{
    if (n->type != YAML_SCALAR_NODE || cfg_is_null(n) ||
        n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return cfg_fail(p, n, "expected a number, got %s", cfg_kind_name(n));
    const char *s = cfg_sval(n);
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !isfinite(v))
        return cfg_fail(p, n, "expected a number, got '%s'", s);
    if (v < lo || v > hi) return cfg_fail(p, n, "%g is out of range [%g, %g]", v, lo, hi);
    *out = v;
    return 0;
}

int cfg_bool_of(const yaml_node_t *n)
{
    if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE) return -1;
    const char *s = cfg_sval(n);
    if (!strcasecmp(s, "true") || !strcasecmp(s, "yes") || !strcasecmp(s, "on")) return 1;
    if (!strcasecmp(s, "false") || !strcasecmp(s, "no") || !strcasecmp(s, "off")) return 0;
    return -1;
}

static int get_bool(td_cfg_ctx *p, const yaml_node_t *n, bool *out)
{
    int b = cfg_bool_of(n);
    if (b >= 0) {
        *out = b;
        return 0;
    }
    if (n->type == YAML_SCALAR_NODE && n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
        !cfg_is_null(n))
        return cfg_fail(p, n, "expected true or false, got '%s'", cfg_sval(n));
    return cfg_fail(p, n, "expected true or false, got %s", cfg_kind_name(n));
}

int cfg_get_str(td_cfg_ctx *p, const yaml_node_t *n, const char **out)
{
    if (n->type != YAML_SCALAR_NODE || cfg_is_null(n))
        return cfg_fail(p, n, "expected a string, got %s", cfg_kind_name(n));
    *out = cfg_sval(n);
    return 0;
}

static int get_size(td_cfg_ctx *p, const yaml_node_t *n, int64_t lo, int64_t *out)
{
    const char *s;
    if (cfg_get_str(p, n, &s)) return p->rc;
    int64_t v;
    int rc = td_cfg_parse_size(s, &v);
    if (rc == TD_ERANGE) return cfg_fail(p, n, "size '%s' is too large", s);
    if (rc) return cfg_fail(p, n, "expected a size such as 1GiB, 512MiB or 4096, got '%s'", s);
    if (v < lo) return cfg_fail(p, n, "size '%s' is smaller than %lld bytes", s, (long long)lo);
    *out = v;
    return 0;
}

/* The KV cache types a decode instance may use: TD_F16 / TD_F32, or -1. */
int cfg_kv_dtype_of(const char *s)
{
    if (!strcmp(s, "f16")) return TD_F16;
    if (!strcmp(s, "f32")) return TD_F32;
    return -1;
}

const char *cfg_kv_dtype_name(td_dtype t)
{
    return t == TD_F32 ? "f32" : "f16";
}

static void list_keys(const td_cfg_field *f, size_t nf, char *buf, size_t cap)
{
    size_t k = 0;
    buf[0] = 0;
    for (size_t i = 0; i < nf && k < cap; i++) {
        int w = snprintf(buf + k, cap - k, "%s%s", i ? ", " : "", f[i].key);
        if (w < 0) break;
        k += (size_t)w;
    }
}

static int parse_value(td_cfg_ctx *p, const td_cfg_field *f, yaml_node_t *v, char *base)
{
    void *dst = base + f->off;
    int64_t iv;
    switch (f->t) {
    case F_STR:
    case F_PATH: {
        const char *s;
        if (cfg_get_str(p, v, &s)) return p->rc;
        if (f->t == F_PATH && !*s) return cfg_fail(p, v, "empty path");
        if (f->t == F_PATH)
            cfg_set_path(p, dst, s);
        else
            cfg_set_str(p, dst, s);
        return p->rc;
    }
    case F_INT:
        if (get_int(p, v, (int64_t)f->lo, (int64_t)f->hi, &iv)) return p->rc;
        *(int *)dst = (int)iv;
        return 0;
    case F_I64:
        if (get_int(p, v, (int64_t)f->lo, (int64_t)f->hi, &iv)) return p->rc;
        *(int64_t *)dst = iv;
        return 0;
    case F_BOOL:
        return get_bool(p, v, dst);
    case F_FLOAT:
        return get_float(p, v, f->lo, f->hi, dst);
    case F_SIZE:
        return get_size(p, v, (int64_t)f->lo, dst);
    case F_INTS:
    case F_STRS: {
        if (v->type != YAML_SEQUENCE_NODE)
            return cfg_fail(p, v, "expected a list, got %s", cfg_kind_name(v));
        size_t n = (size_t)(v->data.sequence.items.top - v->data.sequence.items.start);
        if (n == 0) return cfg_fail(p, v, "empty list");
        if (n > MAX_LIST) return cfg_fail(p, v, "list of %zu entries, more than %d", n, MAX_LIST);
        void *arr = calloc(n, f->t == F_INTS ? sizeof(int) : sizeof(char *));
        if (!arr) return cfg_fail(p, v, "out of memory");
        if (f->t == F_INTS) {
            free(*(int **)dst);
            *(int **)dst = arr;
        } else {
            char **old = *(char ***)dst;
            for (int i = 0; old && i < *(int *)(base + f->noff); i++)
                free(old[i]);
            free(old);
            *(char ***)dst = arr;
        }
        *(int *)(base + f->noff) = (int)n;
        for (size_t i = 0; i < n; i++) {
            yaml_node_t *it = cfg_node_at(p, v->data.sequence.items.start[i]);
            if (f->t == F_INTS) {
                if (get_int(p, it, (int64_t)f->lo, (int64_t)f->hi, &iv)) return p->rc;
                ((int *)arr)[i] = (int)iv;
            } else {
                const char *s;
                if (cfg_get_str(p, it, &s)) return p->rc;
                if (!*s) return cfg_fail(p, it, "empty string");
                ((char **)arr)[i] = cfg_xstrdup(p, s);
                if (p->rc) return p->rc;
            }
        }
        return 0;
    }
    case F_KV_DTYPE: {
        const char *s;
        if (cfg_get_str(p, v, &s)) return p->rc;
        int t = cfg_kv_dtype_of(s);
        if (t >= 0) *(td_dtype *)dst = (td_dtype)t;
        return 0;
    }
    case F_NODE:
        return 0;
    }
    return 0;
}

/* Walk mapping n against fields; seen[i] receives the value node of fields[i] (NULL if
 * absent) and seen_key[i] its key node. A null n (e.g. "router:" with nothing) is an
 * empty mapping. */
int cfg_parse_map(td_cfg_ctx *p, yaml_node_t *n, const char *what, const td_cfg_field *fields,
                  size_t nf, void *base, yaml_node_t **seen, yaml_node_t **seen_key)
{
    for (size_t i = 0; i < nf; i++)
        seen[i] = seen_key[i] = NULL;
    if (cfg_is_null(n)) return 0;
    if (n->type != YAML_MAPPING_NODE)
        return cfg_fail(p, n, "%s: expected a mapping, got %s", what, cfg_kind_name(n));
    for (yaml_node_pair_t *pr = n->data.mapping.pairs.start; pr < n->data.mapping.pairs.top; pr++) {
        yaml_node_t *k = cfg_node_at(p, pr->key), *v = cfg_node_at(p, pr->value);
        if (k->type != YAML_SCALAR_NODE) return cfg_fail(p, k, "%s: keys must be strings", what);
        size_t i = 0;
        while (i < nf && strcmp(fields[i].key, cfg_sval(k)))
            i++;
        if (i == nf) {
            char keys[512];
            list_keys(fields, nf, keys, sizeof keys);
            return cfg_fail(p, k, "unknown key '%s' in %s (known: %s)", cfg_sval(k), what, keys);
        }
        if (seen[i])
            return cfg_fail(p, k, "duplicate key '%s' in %s (first at line %zu)", cfg_sval(k), what,
                            seen_key[i]->start_mark.line + 1);
        seen[i] = v;
        seen_key[i] = k;
        if (parse_value(p, &fields[i], v, base)) return p->rc;
    }
    return 0;
}

int cfg_require(td_cfg_ctx *p, yaml_node_t *map, yaml_node_t *seen, const char *key,
                const char *what)
{
    if (seen) return 0;
    return cfg_fail(p, map, "%s: missing required key '%s'", what, key);
}
