/* rt_logprobs.c: the logprobs object of a choice (chat and legacy completions shapes). */
#include "rt_logprobs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"

/* Whether s[0..n) is valid UTF-8 (jansson refuses strings that are not). */
static bool utf8_ok(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!k || i + k > n || (k == 2 && c < 0xc2)) return false;
        for (size_t j = 1; j < k; j++)
            if ((s[i + j] & 0xc0) != 0x80) return false;
        i += k;
    }
    return true;
}

/* The token's text (json string) and, into *len, its length in characters (as vLLM's
 * text_offset, a Python str's length): the bytes that start a UTF-8 character, so a
 * character split over two tokens counts once, at the token holding its first byte. */
static json_t *token_str(const td_tokenizer *tok, int32_t id, size_t *len)
{
    size_t n = 0;
    const char *b = td_tok_piece(tok, id, &n);
    if (!b) b = "", n = 0;
    *len = 0;
    for (size_t i = 0; i < n; i++)
        *len += ((unsigned char)b[i] & 0xc0) != 0x80;
    if (utf8_ok((const unsigned char *)b, n)) return json_stringn(b, n);
    char out[6 + 4 * 64 + 1];
    size_t o = (size_t)snprintf(out, sizeof out, "bytes:");
    for (size_t i = 0; i < n && o + 4 < sizeof out; i++)
        o += (size_t)snprintf(out + o, sizeof out - o, "\\x%02x", (unsigned char)b[i]);
    return json_stringn(out, o);
}

static json_t *token_bytes(const td_tokenizer *tok, int32_t id)
{
    size_t n = 0;
    const char *b = td_tok_piece(tok, id, &n);
    json_t *a = json_array();
    for (size_t i = 0; a && b && i < n; i++)
        json_array_append_new(a, json_integer((unsigned char)b[i]));
    return a;
}

/* chat: {token, logprob, bytes} (+ top_logprobs when top) */
static json_t *chat_item(const td_tokenizer *tok, int32_t id, float lp, const td_logprob_entry *top)
{
    size_t len;
    json_t *o = json_pack("{s:o, s:f, s:o}", "token", token_str(tok, id, &len), "logprob",
                          (double)lp, "bytes", token_bytes(tok, id));
    if (!o || !top) return o;
    json_t *a = json_array();
    for (int j = 0; a && j < top->n_top; j++)
        json_array_append_new(a, chat_item(tok, top->top[j].id, top->top[j].logprob, NULL));
    json_object_set_new(o, "top_logprobs", a ? a : json_null());
    return o;
}

static json_t *chat_json(const td_tokenizer *tok, rt_req *q, int to)
{
    json_t *c = json_array();
    for (int i = q->loop.lp_sent; c && i < to; i++) {
        const td_logprob_entry *e = &q->loop.lps[i];
        json_array_append_new(c, chat_item(tok, q->loop.gen_ids[i], e->logprob, e));
    }
    return json_pack("{s:o}", "content", c);
}

/* one position of the legacy shape; e NULL: the first prompt token (null logprobs) */
static void legacy_add(const td_tokenizer *tok, rt_req *q, json_t *o, int32_t id,
                       const td_logprob_entry *e)
{
    size_t len;
    json_array_append_new(json_object_get(o, "tokens"), token_str(tok, id, &len));
    json_array_append_new(json_object_get(o, "token_logprobs"),
                          e ? json_real((double)e->logprob) : json_null());
    json_t *top = e ? json_object() : json_null();
    for (int j = 0; e && top && j < e->n_top; j++) {
        size_t l;
        json_t *k = token_str(tok, e->top[j].id, &l);
        if (k) json_object_set_new(top, json_string_value(k), json_real(e->top[j].logprob));
        json_decref(k);
    }
    json_array_append_new(json_object_get(o, "top_logprobs"), top);
    json_array_append_new(json_object_get(o, "text_offset"),
                          json_integer((json_int_t)q->loop.lp_off));
    q->loop.lp_off += len;
}

static json_t *legacy_json(const td_tokenizer *tok, rt_req *q, bool prompt, int to)
{
    json_t *o = json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs",
                          "text_offset");
    if (!o) return NULL;
    for (size_t p = 0; prompt && p < q->p.n_prompt; p++)
        legacy_add(tok, q, o, q->p.prompt[p], p && q->loop.plps ? &q->loop.plps[p] : NULL);
    for (int i = q->loop.lp_sent; i < to; i++)
        legacy_add(tok, q, o, q->loop.gen_ids[i], &q->loop.lps[i]);
    return o;
}

json_t *rt_logprobs_json(const td_tokenizer *tok, rt_req *q, bool prompt, int to)
{
    if (!q->p.sampling.logprobs || q->p.lp_hidden) return json_null();
    if (to > q->loop.n_lps) to = q->loop.n_lps;
    if (to < q->loop.lp_sent) to = q->loop.lp_sent;
    json_t *o = q->p.ep == RT_EP_CHAT ? chat_json(tok, q, to) : legacy_json(tok, q, prompt, to);
    if (o) q->loop.lp_sent = to;
    return o;
}

int rt_logprobs_keep(rt_req *q, const Td__TokenEvent *t)
{
    if (!q->p.sampling.logprobs) return 0;
    for (size_t k = 0; k < t->n_prompt_logprobs; k++) {
        size_t pos = (size_t)t->prompt_from + k;
        if (!q->loop.plps && !(q->loop.plps = calloc(q->p.n_prompt, sizeof *q->loop.plps)))
            return TD_ENOMEM;
        if (pos >= 1 && pos < q->p.n_prompt)
            td_ctrl_logprob_from_pb(t->prompt_logprobs[k], &q->loop.plps[pos]);
    }
    if (!t->n_token_ids || q->p.gen_none) return 0;
    /* a disaggregated attempt's first token: its logprob came in PrefillDone */
    bool first = !t->n_logprobs && t->n_token_ids == 1 && q->loop.first_lp_set;
    if (!first && t->n_logprobs != t->n_token_ids) return TD_EINVAL;
    if (q->loop.n_lps + (int)t->n_token_ids > q->loop.cap_gen) return TD_ESTATE;
    td_logprob_entry *l = realloc(q->loop.lps, (size_t)q->loop.cap_gen * sizeof *l);
    if (!l) return TD_ENOMEM;
    q->loop.lps = l;
    if (first) {
        q->loop.lps[q->loop.n_lps++] = q->loop.first_lp;
        q->loop.first_lp_set = false;
        return 0;
    }
    for (size_t k = 0; k < t->n_token_ids; k++)
        td_ctrl_logprob_from_pb(t->logprobs[k], &q->loop.lps[q->loop.n_lps++]);
    return 0;
}
