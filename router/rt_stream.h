/* rt_stream.h: a request's output: incremental detokenization, stop strings with hold-back,
 * SSE chunks or the final JSON body, and error endings (prefix rt_).
 *
 * Purpose: turn the token ids the loop receives for a request into the bytes its client
 * reads (q->http.out), as the OpenAI API writes them. A choice of a fanned-out request
 * (rt_choices.h) writes into its parent's http under the parent's lock, with its own index.
 * Invariants: nothing reaches the client that could be part of a stop string (the longest
 * text suffix that is a prefix of a stop string is held back until it can be decided); the
 * text sent equals the generated text cut at the first stop string to complete.
 * Threading: the loop thread; writes q->http under q->mu and wakes the connection
 * (rt_req_wake). It calls nothing of the loop.
 * Ownership: borrows the router (tokenizer, model name) and the request.
 */
#ifndef RT_STREAM_H
#define RT_STREAM_H

#include <stddef.h>
#include <stdint.h>

#include "rt_buf.h"
#include "rt_req.h"

struct rt_router;

typedef enum { RT_FIN_NONE = 0, RT_FIN_STOP, RT_FIN_LENGTH } rt_finish;

/* Longest suffix of text[0..len) that is a proper prefix of one of the stop strings. */
size_t rt_stop_holdback(const char *text, size_t len, char *const *stop, const size_t *stop_len,
                        int n_stop);
/* Offset of the earliest full stop-string match in text, or -1. */
long rt_stop_find(const char *text, size_t len, char *const *stop, const size_t *stop_len,
                  int n_stop);

/* Feed generated ids. Emits the text that can no longer be part of a stop string (as an
 * SSE chunk or into q->loop.text). Returns RT_FIN_STOP when a stop string matched (the text
 * up to it was emitted and the request is finished), else RT_FIN_NONE; negative td_err on
 * allocation failure or an invalid id. Caller holds nothing; takes q->mu itself. */
int rt_stream_tokens(const struct rt_router *r, rt_req *q, const int32_t *ids, size_t n);
/* Finish: flush the detokenizer and the held text (cut at a stop string), write the last
 * chunk with finish_reason, the usage chunk and [DONE] (stream) or the whole JSON body
 * (status 200), and mark done. A choice of a fanned-out request (q->ch.parent) writes only
 * its own last chunk (stream) and records its finish (q->ch.finished, q->ch.fin): its
 * parent's response ends with rt_stream_close. */
int rt_stream_finish(const struct rt_router *r, rt_req *q, rt_finish fin);
/* End a fanned-out request q whose every choice finished: the usage chunk (every prompt's
 * tokens once, every choice's completion tokens) and [DONE], or the JSON body with every
 * choice in index order; marks done. Nothing if q is done already. */
int rt_stream_close(const struct rt_router *r, rt_req *q);
/* Fail: status e->status as JSON if nothing was streamed yet, else an SSE error event and
 * [DONE]; marks done (a choice: its parent's response; nothing if that is done already). */
void rt_stream_fail(rt_req *q, const rt_error *e);

#endif
