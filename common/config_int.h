/* config_int.h: what config.c's sections and config_yaml.c's machinery share (private to
 * the two files): the parse context, the field tables, and the helpers every section calls.
 * Errors: the first one wins (cfg_fail keeps it, later calls return its code); messages are
 * "FILE:LINE:COLUMN: ...". Threading: one parse per context. */
#ifndef TD_CONFIG_INT_H
#define TD_CONFIG_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <yaml.h>

#include "config.h"

#define MAX_LIST 64 /* entries of a list value */

typedef struct {
    const char *file;
    yaml_document_t *doc;
    char *err;
    size_t errcap;
    int rc;
    td_cfg_backend backend; /* the root's, parsed before the sections */
    unsigned flags;         /* TD_CFG_NO_FILE_CHECKS */
} td_cfg_ctx;

/* ---- tables -------------------------------------------------------------------------- */

typedef enum {
    F_STR,
    F_PATH,
    F_INT,
    F_I64,
    F_BOOL,
    F_FLOAT,
    F_SIZE,
    F_INTS,
    F_STRS,
    F_KV_DTYPE, /* "f16" | "f32" -> td_dtype (an unknown name is reported by the section) */
    F_NODE
} td_cfg_ftype;

typedef struct {
    const char *key;
    td_cfg_ftype t;
    size_t off; /* into the section struct */
    double lo, hi;
    size_t noff; /* F_INTS / F_STRS: offset of the int count */
} td_cfg_field;

/* Each section's keys are one X-macro list, from which both its enum of indices (into the
 * seen[] arrays of parse_map) and its table are generated, so the two cannot disagree. An
 * entry is FIELD(ID, "key", type, member, lo, hi), LIST(ID, "key", type, member,
 * count_member, lo, hi) for F_INTS / F_STRS, or NODE(ID, "key") for F_NODE. SECT names
 * the section's struct while its table is expanded. */
#define ENUM_ID(id, ...)            id,
#define FIELD(id, k, ty, m, l, h)   [id] = {k, ty, offsetof(SECT, m), l, h, 0},
#define LIST(id, k, ty, m, n, l, h) [id] = {k, ty, offsetof(SECT, m), l, h, offsetof(SECT, n)},
#define NODE(id, k)                 [id] = {k, F_NODE, 0, 0, 0, 0},
#define FIELD_TABLE(LIST_OF)                                                                       \
    {                                                                                              \
        LIST_OF(FIELD, LIST, NODE)                                                                 \
    }

/* The first error, at node n (NULL: the file's start); returns the error code. */
int cfg_fail(td_cfg_ctx *p, const yaml_node_t *n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
yaml_node_t *cfg_node_at(td_cfg_ctx *p, int i);
const char *cfg_sval(const yaml_node_t *n);
bool cfg_is_null(const yaml_node_t *n);
/* "a mapping", "a list", "nothing (null)" or "a string", for messages. */
const char *cfg_kind_name(const yaml_node_t *n);
/* strdup that records an out-of-memory error in p (NULL then). */
char *cfg_xstrdup(td_cfg_ctx *p, const char *s);
/* config_util.c: free n decode entries' strings and the array itself (NULL is fine). */
void cfg_free_decodes(td_cfg_decode *d, int n);
/* *dst = a copy of s (the old value freed); cfg_set_path expands a leading "~/". */
void cfg_set_str(td_cfg_ctx *p, char **dst, const char *s);
void cfg_set_path(td_cfg_ctx *p, char **dst, const char *s);
/* A scalar's string (an error for a mapping or a list). */
int cfg_get_str(td_cfg_ctx *p, const yaml_node_t *n, const char **out);
/* 1 for true/yes/on, 0 for false/no/off (plain scalars, any case), else -1. */
int cfg_bool_of(const yaml_node_t *n);
/* The KV cache types a decode instance may use: TD_F16 / TD_F32, or -1; and back. */
int cfg_kv_dtype_of(const char *s);
const char *cfg_kv_dtype_name(td_dtype t);
/* Walk mapping n against fields (nf of them) into the section struct at base; seen[i] receives
 * the value node of fields[i] (NULL if absent) and seen_key[i] its key node. A null n (e.g.
 * "router:" with nothing) is an empty mapping. Unknown and duplicate keys are errors. */
int cfg_parse_map(td_cfg_ctx *p, yaml_node_t *n, const char *what, const td_cfg_field *fields,
                  size_t nf, void *base, yaml_node_t **seen, yaml_node_t **seen_key);
/* An error unless the key was seen. */
int cfg_require(td_cfg_ctx *p, yaml_node_t *map, yaml_node_t *seen, const char *key,
                const char *what);

#endif
