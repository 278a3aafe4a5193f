/* rt_buf.c: the router's byte buffer and OpenAI error objects (rt_buf.h). */
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rt_buf.h"
#include "td_err.h"
#include "td_grow.h"

/* ---- buffers ---- */

int rt_buf_append(rt_buf *b, const void *p, size_t n)
{
    int rc = TD_GROW(b->buf, b->cap, b->len + n + 1, 256);
    if (rc) return rc;
    if (n) memcpy(b->buf + b->len, p, n);
    b->len += n;
    b->buf[b->len] = 0;
    return 0;
}

int rt_buf_puts(rt_buf *b, const char *s)
{
    return rt_buf_append(b, s, strlen(s));
}

void rt_buf_consume(rt_buf *b, size_t n)
{
    if (n >= b->len) {
        b->len = 0;
        if (b->buf) b->buf[0] = 0;
        return;
    }
    memmove(b->buf, b->buf + n, b->len - n);
    b->len -= n;
    b->buf[b->len] = 0;
}

void rt_buf_free(rt_buf *b)
{
    free(b->buf);
    *b = (rt_buf){0};
}

/* ---- errors ---- */

static const char *type_for(int status)
{
    switch (status) {
    case 401:
        return "authentication_error";
    case 404:
        return "not_found_error";
    case 429:
        return "rate_limit_error";
    case 500:
    case 503:
    case 504:
        return "server_error";
    default:
        return "invalid_request_error";
    }
}

int rt_error_set(rt_error *e, int status, const char *param, const char *code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    e->status = status;
    e->type = type_for(status);
    e->param = param;
    e->code = code;
    return status;
}

int rt_error_own_param(rt_error *e, const char *name)
{
    /* fuzz_openai found: a long key cut inside a UTF-8 sequence made the error JSON invalid
     * (tests/fuzz/regress/openai-error-param-utf8): a cut drops the partial character */
    size_t n = strlen(name), cap = sizeof e->param_own - 1;
    if (n > cap) {
        n = cap;
        while (n > 0 && ((unsigned char)name[n] & 0xc0) == 0x80) /* name[n]: the first byte cut */
            n--;
    }
    memcpy(e->param_own, name, n);
    e->param_own[n] = 0;
    e->param = e->param_own;
    return e->status;
}

char *rt_error_json(const rt_error *e)
{
    /* fuzz_openai found: a message cut inside a UTF-8 sequence (jansson's error text quotes
     * the input up to the bad byte; "%.200s" of a model name) is invalid UTF-8, json_pack
     * refused it and the client got "internal error" instead of the 400's reason
     * (tests/fuzz/regress/openai-error-json-utf8). Such a message goes out with its
     * non-ASCII bytes as '?'. */
    char msg[sizeof e->message];
    memcpy(msg, e->message, sizeof msg);
    msg[sizeof msg - 1] = 0;
    json_t *m = json_string(msg);
    if (!m) {
        for (char *c = msg; *c; c++)
            if ((unsigned char)*c >= 0x80) *c = '?';
        m = json_string(msg);
    }
    json_t *o = json_pack("{s:{s:o, s:s, s:o, s:o}}", "error", "message", m, "type",
                          e->type ? e->type : type_for(e->status), "param",
                          e->param ? json_string(e->param) : json_null(), "code",
                          e->code ? json_string(e->code) : json_null());
    if (!o) return NULL;
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}
