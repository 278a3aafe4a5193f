/* td_err.h: Tandem's one error enum, its messages, and the logging helpers.
 *
 * Invariants: 0 is success; every failure is a negative TD_E* code. A function that
 * fails logs the reason once, where it is first detected (TD_LOG_ERR records file and
 * line), and its callers only propagate the code.
 * Threading: td_strerror is pure; logging writes one line per call to stderr under a
 * lock, so lines from different threads never interleave.
 *
 * A log line: "2026-11-25T11:40:02.123Z tandem-router[4242] info: MESSAGE", the time in
 * UTC with milliseconds, then the program name and pid; warn and error lines end with
 * " (file.c:LINE)".
 */
#ifndef TD_ERR_H
#define TD_ERR_H

#include <stdarg.h>
#include <stddef.h>

typedef enum {
    TD_OK = 0,
    TD_EINVAL = -1,    /* bad argument or bad input from outside */
    TD_ENOMEM = -2,    /* allocation failed */
    TD_EIO = -3,       /* read/open/mmap failed */
    TD_EFORMAT = -4,   /* malformed file (GGUF) */
    TD_EUNSUPP = -5,   /* valid but not supported (type, architecture, template) */
    TD_ERANGE = -6,    /* value out of range (context full, token id too large) */
    TD_ENOENT = -7,    /* missing key, tensor or file */
    TD_ENOSPC = -8,    /* KV pool out of blocks */
    TD_ETIMEDOUT = -9, /* a bounded wait ran out */
    TD_ESTATE = -10,   /* call not valid in the object's current state */
} td_err;

const char *td_strerror(int err);

typedef enum { TD_LOG_DEBUG, TD_LOG_INFO, TD_LOG_WARN, TD_LOG_ERROR } td_log_level;

/* Messages below this level are dropped. Default INFO; TANDEM_LOG=debug|info|warn|error. */
void td_log_set_level(td_log_level level);
void td_log_write(td_log_level level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* The current time, UTC, "YYYY-MM-DDTHH:MM:SS.mmmZ" (24 bytes), into buf (cap >= 25 for
 * all of it); returns the length written. */
size_t td_log_timestamp(char *buf, size_t cap);

#define TD_LOG_ERR(...)   td_log_write(TD_LOG_ERROR, __FILE__, __LINE__, __VA_ARGS__)
#define TD_LOG_WARN(...)  td_log_write(TD_LOG_WARN, __FILE__, __LINE__, __VA_ARGS__)
#define TD_LOG_INFO(...)  td_log_write(TD_LOG_INFO, __FILE__, __LINE__, __VA_ARGS__)
#define TD_LOG_DEBUG(...) td_log_write(TD_LOG_DEBUG, __FILE__, __LINE__, __VA_ARGS__)

/* Format an error message into a caller buffer (used where the caller wants the text,
 * e.g. the GGUF reader reports "tensor 'x': offset past end of file"). */
void td_errbuf_set(char *buf, unsigned long cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
