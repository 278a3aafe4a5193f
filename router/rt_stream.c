/* rt_stream.c: a request's output: incremental detokenization, stop strings with hold-back,
 * SSE chunks / the final JSON body, and error endings. Runs on the loop thread; writes to
 * the shared part of rt_req under its lock and wakes the connection.
 *
 * Hold-back: q->loop.held is text that has been detokenized but not sent. After every batch of
 * ids the earliest full stop-string match in held ends the request (text before it is
 * sent, the rest dropped); otherwise everything except the longest suffix that is a prefix
 * of some stop string is sent. So a match can only start inside held, and no byte of a
 * stop string ever reaches the client. */
#define _GNU_SOURCE /* memmem */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "rt.h"
#include "rt_logprobs.h"
#include "rt_stream.h"
#include "rt_tools.h"
#include "td_clock.h"
#include "td_err.h"

size_t rt_stop_holdback(const char *text, size_t len, char *const *stop, const size_t *stop_len,
                        int n_stop)
{
    size_t best = 0;
    for (int i = 0; i < n_stop; i++) {
        size_t k = stop_len[i] - 1 < len ? stop_len[i] - 1 : len;
        for (; k > best; k--)
            if (!memcmp(text + len - k, stop[i], k)) {
                best = k;
                break;
            }
    }
    return best;
}

long rt_stop_find(const char *text, size_t len, char *const *stop, const size_t *stop_len,
                  int n_stop)
{
    long best = -1;
    for (int i = 0; i < n_stop; i++) {
        if (stop_len[i] > len) continue;
        const char *hit = memmem(text, len, stop[i], stop_len[i]);
        if (hit && (best < 0 || hit - text < best)) best = hit - text;
    }
    return best;
}

/* ---- JSON pieces ---- */

/* Where q's bytes go: its parent's http for a choice of a fanned-out request (rt_choices.h),
 * else its own. */
static rt_req *out_of(rt_req *q)
{
    return q->ch.parent ? q->ch.parent : q;
}

/* The prompt tokens of q whose KV came from a prefix cache: the decode node's (its
 * TokenEvents' usage; in disaggregated mode also AllocReply.n_cached, the positions it held
 * and the prefill stages did not push) or the prefill stages' (PrefillDone), the larger:
 * the prompt's leading part that was not computed or not moved (docs/prefix-cache.md). */
static size_t req_cached(const rt_req *q)
{
    size_t d = q->loop.n_cached > 0 ? (size_t)q->loop.n_cached : 0;
    if (q->pair.dc_cached > d) d = q->pair.dc_cached;
    return q->pair.pf_cached > d ? q->pair.pf_cached : d;
}

/* Usage as vLLM reports it: every prompt's tokens once (not once per choice), the completion
 * tokens of every choice; prompt_tokens_details.cached_tokens (OpenAI's field): the prompt
 * tokens whose KV a prefix cache supplied (req_cached), per prompt the most any of its
 * choices got (n > 1: the first choice computes what the others share). */
static json_t *usage_obj(const rt_req *q)
{
    size_t prompt = q->p.n_prompt, gen = (size_t)q->loop.n_gen, cached = req_cached(q);
    if (q->ch.kids) {
        /* every prompt once; every child's generated tokens (best_of's unanswered candidates
           too: the work was done); cached: per prompt (a child's p.prompt names it) the most
           any of its children got */
        gen = cached = 0;
        for (int i = 0; i <= q->p.n_more; i++) {
            const int32_t *ids = i ? q->p.more[i - 1].ids : q->p.prompt;
            if (i) prompt += q->p.more[i - 1].n;
            size_t most = 0;
            for (int j = 0; j < q->ch.n_kids; j++)
                if (q->ch.kids[j]->p.prompt == ids && req_cached(q->ch.kids[j]) > most)
                    most = req_cached(q->ch.kids[j]);
            cached += most;
        }
        for (int i = 0; i < q->ch.n_kids; i++)
            gen += (size_t)q->ch.kids[i]->loop.n_gen;
    }
    return json_pack("{s:I, s:I, s:I, s:{s:I}}", "prompt_tokens", (json_int_t)prompt,
                     "completion_tokens", (json_int_t)gen, "total_tokens",
                     (json_int_t)(prompt + gen), "prompt_tokens_details", "cached_tokens",
                     (json_int_t)cached);
}

static const char *finish_name(rt_finish f)
{
    return f == RT_FIN_STOP ? "stop" : "length";
}

/* One SSE event "data: {chunk}\n\n" appended to out_of(q)->http.out (caller holds its mu).
 * choice NULL: an empty choices array (the usage chunk). Steals choice and usage. */
static int sse_chunk(const rt_router *r, rt_req *q, json_t *choice, json_t *usage)
{
    rt_req *to = out_of(q);
    bool chat = q->p.ep == RT_EP_CHAT;
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:[]}", "id", q->oid, "object",
                          chat ? "chat.completion.chunk" : "text_completion", "created",
                          (json_int_t)q->created, "model", r->model.name, "choices");
    if (!o) {
        json_decref(choice);
        json_decref(usage);
        return TD_ENOMEM;
    }
    if (choice) json_array_append_new(json_object_get(o, "choices"), choice);
    if (usage)
        json_object_set_new(o, "usage", usage);
    else if (q->p.include_usage)
        json_object_set_new(o, "usage", json_null());
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!s) return TD_ENOMEM;
    if (to->http.out.len == 0 && !to->http.t_pending_ns)
        to->http.t_pending_ns = r->t_events_ns ? r->t_events_ns : td_now_ns();
    int rc = rt_buf_puts(&to->http.out, "data: ");
    if (!rc) rc = rt_buf_puts(&to->http.out, s);
    if (!rc) rc = rt_buf_puts(&to->http.out, "\n\n");
    free(s);
    to->http.sse = true;
    return rc;
}

static json_t *text_choice(const rt_req *q, const char *text, size_t len, const char *finish)
{
    json_t *fin = finish ? json_string(finish) : json_null();
    if (q->p.ep == RT_EP_CHAT) {
        json_t *delta = len || !finish ? json_pack("{s:s%}", "content", text, len) : json_object();
        return json_pack("{s:i, s:o, s:n, s:o}", "index", q->ch.index, "delta", delta, "logprobs",
                         "finish_reason", fin);
    }
    return json_pack("{s:i, s:s%, s:n, s:o}", "index", q->ch.index, "text", text, len, "logprobs",
                     "finish_reason", fin);
}

/* echo: the prompt's text (malloc'd, *len bytes; NULL: no memory) */
static char *prompt_text(const rt_router *r, const rt_req *q, size_t *len)
{
    /* through the incremental detokenizer, as generated text is: bytes that are not UTF-8
       (a prompt of token ids may cut a character) become U+FFFD, which a JSON string can
       carry (td_tok_decode's raw bytes made the response a 500) */
    rt_buf b = {0};
    td_detok d;
    td_detok_init(&d, r->model.tok);
    char *piece = NULL;
    size_t cap = 0;
    int rc = 0;
    for (size_t i = 0; i < q->p.n_prompt && !rc; i++) {
        size_t plen = 0;
        if (!td_tok_piece(r->model.tok, q->p.prompt[i], &plen)) rc = TD_EINVAL;
        if (!rc && 4 * plen + 8 > cap) {
            char *np = realloc(piece, 4 * plen + 8);
            rc = np ? 0 : TD_ENOMEM;
            if (np) piece = np, cap = 4 * plen + 8;
        }
        int k = rc ? rc : td_detok_push(&d, q->p.prompt[i], piece, cap);
        rc = k < 0 ? k : rt_buf_append(&b, piece, (size_t)k);
    }
    char tail[16];
    int k = rc ? rc : td_detok_flush(&d, tail, sizeof tail);
    rc = k < 0 ? k : rt_buf_append(&b, tail, (size_t)k);
    td_detok_fini(&d);
    free(piece);
    if (!rc && !b.buf) rc = rt_buf_append(&b, "", 0);
    if (rc || !b.buf) {
        rt_buf_free(&b);
        return NULL;
    }
    *len = b.len;
    return b.buf;
}

/* stream, echo: the prompt's chunk (text and logprobs) before any other. Caller holds
 * out_of(q)->mu. */
static int emit_echo(const rt_router *r, rt_req *q)
{
    q->loop.echo_sent = true;
    size_t len = 0;
    char *t = prompt_text(r, q, &len);
    if (!t) return TD_ENOMEM;
    json_t *c = text_choice(q, t, len, NULL);
    free(t);
    if (c) json_object_set_new(c, "logprobs", rt_logprobs_json(r->model.tok, q, true, 0));
    return sse_chunk(r, q, c, NULL);
}

static int role_chunk(const rt_router *r, rt_req *q)
{
    if (q->p.ep != RT_EP_CHAT || q->loop.role_sent) return 0;
    q->loop.role_sent = true;
    return sse_chunk(r, q,
                     json_pack("{s:i, s:{s:s, s:s}, s:n, s:n}", "index", q->ch.index, "delta",
                               "role", "assistant", "content", "", "logprobs", "finish_reason"),
                     NULL);
}

/* A tool parser event as a chunk (stream) */
typedef struct {
    const rt_router *r;
    rt_req *q;
} rt_tool_sink;

static int tool_chunk(void *ctx, const rt_tool_ev *ev)
{
    rt_tool_sink *k = ctx;
    int rc = role_chunk(k->r, k->q);
    json_t *d = rt_tool_ev_delta(ev);
    if (rc || !d) {
        json_decref(d);
        return rc ? rc : TD_ENOMEM;
    }
    return sse_chunk(k->r, k->q,
                     json_pack("{s:i, s:o, s:n, s:n}", "index", k->q->ch.index, "delta", d,
                               "logprobs", "finish_reason"),
                     NULL);
}

/* Chat with tool parsing: the text goes through the parser; finish also ends it, and
 * "stop" becomes "tool_calls" when a call was made. */
static int emit_tools(const rt_router *r, rt_req *q, const char *text, size_t len,
                      const char **finish)
{
    if (!q->loop.toolp && !(q->loop.toolp = rt_toolp_create_fmt(
                                q->p.tools.fmt, q->p.tools.tools, q->oid, q->p.tools.parallel,
                                (const char *const *)q->p.tools.names, q->p.tools.n_names)))
        return TD_ENOMEM;
    rt_tool_sink k = {r, q};
    rt_tool_ev_fn fn = q->p.stream ? tool_chunk : NULL;
    int rc = rt_toolp_feed(q->loop.toolp, text, len, fn, &k);
    if (rc || !*finish) return rc;
    if ((rc = rt_toolp_finish(q->loop.toolp, fn, &k))) return rc;
    if (rt_toolp_n_calls(q->loop.toolp) && !strcmp(*finish, "stop")) *finish = "tool_calls";
    if (!q->p.stream) return 0;
    if ((rc = role_chunk(r, q))) return rc;
    return sse_chunk(r, q, text_choice(q, "", 0, *finish), NULL);
}

/* The answer's content: len bytes of text (finish NULL: more follows; a tool-call answer
 * may change it) with the logprobs received so far. */
static int emit_content(const rt_router *r, rt_req *q, const char *text, size_t len,
                        const char **finish)
{
    if (q->p.tools.parse) return emit_tools(r, q, text, len, finish);
    if (!q->p.stream) return rt_buf_append(&q->loop.text, text, len);
    if (!len && !*finish) return 0;
    int rc = 0;
    if (q->p.echo && !q->loop.echo_sent && (rc = emit_echo(r, q))) return rc;
    rc = role_chunk(r, q);
    json_t *c = rc ? NULL : text_choice(q, text, len, *finish);
    if (c && q->p.sampling.logprobs)
        json_object_set_new(c, "logprobs", rt_logprobs_json(r->model.tok, q, false, q->loop.n_lps));
    if (!rc) rc = sse_chunk(r, q, c, NULL);
    return rc;
}

/* A piece of the reasoning parser's output: reasoning as its own delta (stream) or kept for
 * the message; content on to the content path. */
typedef struct {
    const rt_router *r;
    rt_req *q;
} rt_reason_sink;

static int reason_piece(void *ctx, bool reasoning, const char *text, size_t len)
{
    rt_reason_sink *k = ctx;
    rt_req *q = k->q;
    const char *more = NULL;
    if (!reasoning) return emit_content(k->r, q, text, len, &more);
    if (!q->p.stream) return rt_buf_append(&q->loop.reasoning, text, len);
    int rc = role_chunk(k->r, q);
    json_t *d = rc ? NULL : json_pack("{s:s%}", "reasoning_content", text, len);
    if (rc || !d) return rc ? rc : TD_ENOMEM;
    return sse_chunk(k->r, q,
                     json_pack("{s:i, s:o, s:n, s:n}", "index", q->ch.index, "delta", d, "logprobs",
                               "finish_reason"),
                     NULL);
}

/* Send len bytes of generated text (finish NULL: more follows): through the reasoning
 * parser first when the chat's template thinks. Caller holds out_of(q)->mu. */
static int emit(const rt_router *r, rt_req *q, const char *text, size_t len, const char **finish)
{
    if (!q->p.reasoning) return emit_content(r, q, text, len, finish);
    if (!q->loop.reason_init) {
        rt_reason_init(&q->loop.reason, q->p.reasoning_fmt, q->p.reasoning_open);
        q->loop.reason_init = true;
    }
    rt_reason_sink k = {r, q};
    int rc = rt_reason_feed(&q->loop.reason, text, len, reason_piece, &k);
    if (rc || !*finish) return rc;
    if ((rc = rt_reason_finish(&q->loop.reason, reason_piece, &k))) return rc;
    return emit_content(r, q, "", 0, finish);
}

static int push_id(rt_req *q, int32_t id, const td_tokenizer *tok)
{
    char stack[1024];
    size_t plen = 0;
    if (!td_tok_piece(tok, id, &plen)) return TD_EINVAL;
    size_t need = 4 * plen + 8;
    char *buf = need <= sizeof stack ? stack : malloc(need);
    if (!buf) return TD_ENOMEM;
    int n = td_detok_push(&q->loop.dt, id, buf, need);
    int rc = n < 0 ? n : rt_buf_append(&q->loop.held, buf, (size_t)n);
    if (buf != stack) free(buf);
    return rc;
}

int rt_stream_tokens(const rt_router *r, rt_req *q, const int32_t *ids, size_t n)
{
    if (q->p.gen_none) return 0; /* echo, max_tokens 0: the one generated token is dropped */
    if (!q->loop.dt_init) {
        td_detok_init(&q->loop.dt, r->model.tok);
        q->loop.dt.special = !q->p.skip_special; /* skip_special_tokens: false keeps their text */
        /* a call format whose markers are control tokens needs them (vLLM's mistral parser) */
        if (q->p.tools.parse && rt_toolfmt_shows_special(q->p.tools.fmt)) q->loop.dt.special = true;
        q->loop.dt_init = true;
    }
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        q->loop.n_gen++;
        rc = push_id(q, ids[i], r->model.tok);
    }
    if (rc) return rc;
    long at =
        rt_stop_find(q->loop.held.buf, q->loop.held.len, q->p.stop, q->p.stop_len, q->p.n_stop);
    if (at >= 0) {
        q->loop.held.len = (size_t)at; /* the stop string and what follows are dropped */
        q->loop.stop_hit = true;
        return RT_FIN_STOP;
    }
    size_t keep =
        rt_stop_holdback(q->loop.held.buf, q->loop.held.len, q->p.stop, q->p.stop_len, q->p.n_stop);
    size_t send = q->loop.held.len - keep;
    if (!send) return 0;
    rt_req *o = out_of(q);
    pthread_mutex_lock(&o->mu);
    const char *more = NULL;
    rc = emit(r, q, q->loop.held.buf, send, &more);
    pthread_mutex_unlock(&o->mu);
    rt_buf_consume(&q->loop.held, send);
    if (q->p.stream) rt_req_wake(o);
    return rc;
}

static const char *finish_str(const rt_req *q, rt_finish fin)
{
    return finish_name(q->loop.stop_hit ? RT_FIN_STOP : fin);
}

/* The message of a chat answer with tool parsing: content (null if none) and tool_calls
 * (left out if none). */
static json_t *tool_message(const rt_req *q)
{
    size_t len = 0;
    const char *c = q->loop.toolp ? rt_toolp_content(q->loop.toolp, &len) : NULL;
    json_t *m = json_pack("{s:s, s:o}", "role", "assistant", "content",
                          c ? json_stringn(c, len) : json_null());
    if (m && q->loop.toolp && rt_toolp_n_calls(q->loop.toolp))
        json_object_set_new(m, "tool_calls", rt_toolp_calls_json(q->loop.toolp));
    return m;
}

/* The choice object of a non-streamed response (with echo, the prompt's text first). */
static json_t *final_choice(const rt_router *r, rt_req *q, const char *finish)
{
    rt_buf echo = {0};
    const char *text = q->loop.text.buf ? q->loop.text.buf : "";
    size_t len = q->loop.text.len;
    if (q->p.echo) {
        size_t plen = 0;
        char *t = prompt_text(r, q, &plen);
        int rc = t ? rt_buf_append(&echo, t, plen) : TD_ENOMEM;
        if (!rc && len) rc = rt_buf_append(&echo, text, len);
        free(t);
        if (rc) {
            rt_buf_free(&echo);
            return NULL;
        }
        text = echo.buf ? echo.buf : "";
        len = echo.len;
    }
    json_t *lp = rt_logprobs_json(r->model.tok, q, q->p.echo, q->loop.n_lps);
    json_t *c, *reasoning = NULL;
    if (q->p.reasoning)
        reasoning = q->loop.reasoning.len
                        ? json_stringn(q->loop.reasoning.buf, q->loop.reasoning.len)
                        : json_null();
    if (q->p.tools.parse) {
        /* a choice of several ends with its rt_finish: "tool_calls" is the parser's word */
        if (q->loop.toolp && rt_toolp_n_calls(q->loop.toolp) && !strcmp(finish, "stop"))
            finish = "tool_calls";
        c = json_pack("{s:i, s:o, s:o, s:s}", "index", q->ch.index, "message", tool_message(q),
                      "logprobs", lp, "finish_reason", finish);
    } else if (q->p.ep == RT_EP_CHAT)
        c = json_pack("{s:i, s:{s:s, s:o}, s:o, s:s}", "index", q->ch.index, "message", "role",
                      "assistant", "content",
                      /* a thinking answer without content has none (vLLM's null) */
                      !len && q->p.reasoning ? json_null() : json_stringn(text, len), "logprobs",
                      lp, "finish_reason", finish);
    else
        c = json_pack("{s:i, s:s%, s:o, s:s}", "index", q->ch.index, "text", text, len, "logprobs",
                      lp, "finish_reason", finish);
    rt_buf_free(&echo);
    if (reasoning && c)
        json_object_set_new(json_object_get(c, "message"), "reasoning_content", reasoning);
    else
        json_decref(reasoning);
    return c;
}

/* The whole non-streamed body of q: its one choice, or its children's in index order. */
static char *final_body(const rt_router *r, rt_req *q, const char *finish)
{
    json_t *choices = json_array();
    if (!choices) return NULL;
    if (!q->ch.kids) json_array_append_new(choices, final_choice(r, q, finish));
    for (int i = 0; i < q->ch.n_out; i++) {
        rt_req *k = q->ch.kids[i];
        json_array_append_new(choices, final_choice(r, k, finish_str(k, k->ch.fin)));
    }
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:o, s:o}", "id", q->oid, "object",
                          q->p.ep == RT_EP_CHAT ? "chat.completion" : "text_completion", "created",
                          (json_int_t)q->created, "model", r->model.name, "choices", choices,
                          "usage", usage_obj(q));
    if (!o || json_array_size(choices) != (size_t)(q->ch.kids ? q->ch.n_out : 1)) {
        json_decref(o);
        return NULL;
    }
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

/* The end of q's response: the usage chunk and [DONE], or the JSON body; marks it done. rc:
 * an error so far (out of memory), or one while closing: the response ends as best it can.
 * Caller holds q->mu. */
static int close_response(const rt_router *r, rt_req *q, const char *finish, int rc)
{
    if (!rc && q->p.stream) {
        if (q->p.include_usage) rc = sse_chunk(r, q, NULL, usage_obj(q));
        if (!rc) rc = rt_buf_puts(&q->http.out, "data: [DONE]\n\n");
    } else if (!rc) {
        char *body = final_body(r, q, finish);
        if (!body) rc = TD_ENOMEM;
        if (!rc) rc = rt_buf_puts(&q->http.out, body);
        free(body);
        q->http.status = 200;
    }
    if (rc) {
        /* out of memory while finishing: end the response as best we can */
        rt_buf_free(&q->http.out);
        if (q->http.sse)
            rt_buf_puts(&q->http.out, "data: [DONE]\n\n");
        else
            q->http.status = 500;
    }
    q->http.done = true;
    return rc;
}

int rt_stream_finish(const rt_router *r, rt_req *q, rt_finish fin)
{
    int rc = 0;
    if (!q->loop.stop_hit && q->loop.dt_init) {
        char buf[64];
        int k = td_detok_flush(&q->loop.dt, buf, sizeof buf);
        if (k > 0) rc = rt_buf_append(&q->loop.held, buf, (size_t)k);
        long at =
            rt_stop_find(q->loop.held.buf, q->loop.held.len, q->p.stop, q->p.stop_len, q->p.n_stop);
        if (at >= 0) {
            q->loop.held.len = (size_t)at;
            q->loop.stop_hit = true;
        }
    }
    if (q->p.gen_none) fin = RT_FIN_LENGTH; /* echo with max_tokens 0 */
    const char *finish = finish_str(q, fin);
    rt_req *o = out_of(q);
    pthread_mutex_lock(&o->mu);
    if (!rc) rc = emit(r, q, q->loop.held.buf ? q->loop.held.buf : "", q->loop.held.len, &finish);
    if (o != q) {
        /* a choice: its parent's response ends with the last choice (rt_stream_close) */
        q->ch.fin = q->loop.stop_hit ? RT_FIN_STOP : fin;
        q->ch.finished = !rc;
    } else {
        rc = close_response(r, q, finish, rc);
    }
    pthread_mutex_unlock(&o->mu);
    rt_buf_consume(&q->loop.held, q->loop.held.len);
    rt_req_wake(o);
    return rc;
}

int rt_stream_close(const rt_router *r, rt_req *q)
{
    pthread_mutex_lock(&q->mu);
    int rc = q->http.done ? 0 : close_response(r, q, NULL, 0);
    pthread_mutex_unlock(&q->mu);
    rt_req_wake(q);
    return rc;
}

void rt_stream_fail(rt_req *q, const rt_error *e)
{
    char *err = rt_error_json(e);
    q = out_of(q);
    pthread_mutex_lock(&q->mu);
    if (q->http.done) {
        /* complete already (a choice failing after its parent's response ended) */
    } else if (q->http.sse) {
        rt_buf_puts(&q->http.out, "data: ");
        rt_buf_puts(&q->http.out, err ? err : "{\"error\":{\"message\":\"internal error\"}}");
        rt_buf_puts(&q->http.out, "\n\ndata: [DONE]\n\n");
    } else {
        rt_buf_free(&q->http.out);
        if (err) rt_buf_puts(&q->http.out, err);
        q->http.status = e->status;
    }
    q->http.done = true;
    pthread_mutex_unlock(&q->mu);
    free(err);
    rt_req_wake(q);
}
