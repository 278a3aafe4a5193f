/* rt_http.h: the router's HTTP server (libmicrohttpd): routing, credentials, limits, and the
 * hand-off of generation requests to the loop (prefix rt_).
 *
 * Purpose: accept the API's requests, answer what needs no instance (/health, /metrics,
 * /v1/models, errors), and post generation requests to the loop, suspending their
 * connection until the loop has bytes or a final status for them (rt_http.c has the
 * sequence).
 * Invariants: an HTTP thread never waits on the control plane.
 * Threading: MHD's internal threads; rt_http_start/stop on the main thread.
 * Ownership: the daemon belongs to the router (r->mhd).
 */
#ifndef RT_HTTP_H
#define RT_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"

#define RT_MIN_BODY    (1u << 20)   /* floor of the body limit (rt_max_body) */
#define RT_MAX_BODY    (256u << 20) /* ceiling of the body limit */
#define RT_MAX_HEADERS (32u << 10)  /* request line + headers (MHD's pool); more: 431 */

struct rt_router;

/* The body limit for cfg: 64 bytes per router.max_prompt_tokens (a prompt as JSON text
 * with room for escapes and chat framing), within [RT_MIN_BODY, RT_MAX_BODY]. */
size_t rt_max_body(const td_cfg *cfg);
/* Constant-time equality of a presented credential with the expected one (the time
 * depends on the expected length only). */
bool rt_key_equal(const char *given, const char *expected);
/* The fairness key of a client: its remote address and its Authorization header value
 * (either may be absent). */
uint64_t rt_client_key(const void *addr, size_t addr_len, const char *auth);
int rt_http_start(struct rt_router *r, const char *host, int port);
/* Stop taking connections, give open responses up to wait_ms to finish, stop. */
void rt_http_stop(struct rt_router *r, int wait_ms);

#endif
