/* gguf.h: a validating, memory-mapped reader of GGUF model files (versions 2 and 3).
 *
 * Purpose: give the tokenizer and the model loader typed access to metadata and tensor
 * data without copying weights.
 * Invariants: td_gguf_open checks everything before it returns success: magic, version,
 * every metadata type and length, tensor count, dimensions (1..4, each >= 1, product
 * without overflow, rows whole blocks), types, alignment, and that every tensor's bytes
 * lie inside the file. After success no accessor can read outside the mapping.
 * Threading: an open td_gguf is read-only; any number of threads may read it.
 * Ownership: the td_gguf owns the mapping; names, strings and tensor data pointers stay
 * valid until td_gguf_close. Strings in the file are not NUL-terminated: string
 * accessors return (pointer, length). Keys and tensor names are copied NUL-terminated.
 */
#ifndef TD_GGUF_H
#define TD_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_dtype.h"

typedef enum {
    TD_GGUF_U8 = 0,
    TD_GGUF_I8 = 1,
    TD_GGUF_U16 = 2,
    TD_GGUF_I16 = 3,
    TD_GGUF_U32 = 4,
    TD_GGUF_I32 = 5,
    TD_GGUF_F32 = 6,
    TD_GGUF_BOOL = 7,
    TD_GGUF_STRING = 8,
    TD_GGUF_ARRAY = 9,
    TD_GGUF_U64 = 10,
    TD_GGUF_I64 = 11,
    TD_GGUF_F64 = 12,
} td_gguf_vtype;

typedef struct {
    const char *name; /* NUL-terminated copy */
    td_dtype type;
    int n_dims;       /* 1..4 */
    int64_t ne[4];    /* ne[0] is contiguous (a row); unused dims are 1 */
    const void *data; /* into the mapping, aligned to the file's alignment */
    size_t nbytes;
} td_gguf_tensor;

typedef struct td_gguf td_gguf;

/* Map and validate a file. On error returns a negative td_err, *out is NULL, and err
 * (if not NULL) holds a message naming the problem, e.g.
 * "tensor 12 'blk.0.attn_q.weight': data ends at 1234, past end of file (1000)". */
int td_gguf_open(const char *path, td_gguf **out, char *err, size_t errcap);

/* Same, over a caller buffer that must outlive the td_gguf (fuzzing, tests). */
int td_gguf_open_buffer(const void *buf, size_t size, td_gguf **out, char *err, size_t errcap);

void td_gguf_close(td_gguf *g); /* NULL is fine */

uint32_t td_gguf_version(const td_gguf *g);
size_t td_gguf_alignment(const td_gguf *g);

/* Metadata. Lookups return -1 / TD_ENOENT when the key is missing, TD_EFORMAT when the
 * value has another type (integers of any width convert when the value fits). */
int64_t td_gguf_find_kv(const td_gguf *g, const char *key);
size_t td_gguf_n_kv(const td_gguf *g);
const char *td_gguf_kv_key(const td_gguf *g, size_t i);
td_gguf_vtype td_gguf_kv_type(const td_gguf *g, size_t i);

int td_gguf_get_u32(const td_gguf *g, const char *key, uint32_t *out);
int td_gguf_get_i64(const td_gguf *g, const char *key, int64_t *out);
int td_gguf_get_f32(const td_gguf *g, const char *key, float *out);
int td_gguf_get_bool(const td_gguf *g, const char *key, bool *out);
int td_gguf_get_str(const td_gguf *g, const char *key, const char **s, size_t *len);

/* Arrays: element type and count. */
int td_gguf_get_arr(const td_gguf *g, const char *key, td_gguf_vtype *elem, size_t *n);
/* Element i of a string array. */
int td_gguf_arr_str(const td_gguf *g, const char *key, size_t i, const char **s, size_t *len);
/* Copy a numeric array into out[0..n), converting each element to int32 (integer
 * arrays; TD_ERANGE if an element does not fit) or float (F32/F64 arrays). */
int td_gguf_arr_read_i32(const td_gguf *g, const char *key, int32_t *out, size_t n);
int td_gguf_arr_read_f32(const td_gguf *g, const char *key, float *out, size_t n);

/* Tensors. */
size_t td_gguf_n_tensors(const td_gguf *g);
const td_gguf_tensor *td_gguf_tensor_at(const td_gguf *g, size_t i);
const td_gguf_tensor *td_gguf_find_tensor(const td_gguf *g, const char *name); /* NULL if absent */

#endif
