/* rt_buf.h: the router's growable byte buffer and its OpenAI-style error (prefix rt_).
 *
 * Purpose: rt_buf collects bytes for a client (SSE text, JSON bodies, metrics text);
 * rt_error is an error as the OpenAI API shows it ({"error": {message, type, param,
 * code}}) together with its HTTP status.
 * Invariants: a zeroed rt_buf is empty and valid; once it holds memory, buf[len] == 0.
 * Threading: none; the caller serializes access to one buffer (rt_req.mu for a request's
 * output).
 * Ownership: an rt_buf owns buf (rt_buf_free). rt_error's type, param and code point to
 * static strings.
 */
#ifndef RT_BUF_H
#define RT_BUF_H

#include <stddef.h>

typedef struct {
    char *buf;  /* (cap) bytes, buf[len] == 0 when cap > 0 */
    size_t len; /* bytes used */
    size_t cap;
} rt_buf;

int rt_buf_append(rt_buf *b, const void *p, size_t n); /* 0 or TD_ENOMEM */
int rt_buf_puts(rt_buf *b, const char *s);
void rt_buf_consume(rt_buf *b, size_t n); /* drop the first n bytes */
void rt_buf_free(rt_buf *b);

typedef struct {
    int status; /* HTTP status: 400, 401, 404, 405, 413, 429, 500, 503, 504 */
    char message[512];
    const char *type;   /* "invalid_request_error", ... */
    const char *param;  /* the offending field or NULL: static, or param_own */
    const char *code;   /* a machine-readable code or NULL */
    char param_own[64]; /* a field name taken from the request (rt_error_own_param) */
} rt_error;

/* Fill e and return e->status. type NULL: derived from the status. */
int rt_error_set(rt_error *e, int status, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* Point e->param at a copy of name (cut at 63 bytes): for a name that lives in the request,
 * which is freed before the error is written. Returns e->status. */
int rt_error_own_param(rt_error *e, const char *name);
/* {"error": {...}} as a malloc'd NUL-terminated string (NULL on allocation failure). */
char *rt_error_json(const rt_error *e);

#endif
