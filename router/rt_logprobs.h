/* rt_logprobs.h: the "logprobs" object of a choice, in OpenAI's shapes (prefix rt_).
 *
 * Purpose: chat: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]};
 * completions (legacy, as vLLM): {tokens, token_logprobs, top_logprobs (a list of
 * {token: logprob}), text_offset}; with echo the prompt's tokens come first, the first with
 * a null logprob. Token text is the token's bytes; bytes that are not valid UTF-8 are
 * written "bytes:\xNN..." (as vLLM and OpenAI).
 * Threading: the loop thread (reads q->loop, advances q->loop.lp_off and lp_sent).
 */
#ifndef RT_LOGPROBS_H
#define RT_LOGPROBS_H

#include <jansson.h>
#include <stdbool.h>

#include "ctrl.h"
#include "rt_req.h"
#include "tokenizer.h"

/* The logprobs of q's generated entries [q->loop.lp_sent, to), preceded by the prompt's
 * when prompt is set (echo), as a new JSON value; marks them sent. json null when q did not
 * ask for logprobs; NULL when out of memory. */
json_t *rt_logprobs_json(const td_tokenizer *tok, rt_req *q, bool prompt, int to);

/* The event's logprobs into q: the prompt's (TokenEvent.prompt_logprobs: from the decode
 * instance when colocated, from the prefill instance when disaggregated) into plps; the
 * tokens' beside gen_ids (a token without one: the first of a disaggregated attempt, whose
 * logprob came in PrefillDone, q->loop.first_lp). 0; TD_EINVAL: tokens without the
 * logprobs the request asked for; TD_ENOMEM. */
int rt_logprobs_keep(rt_req *q, const Td__TokenEvent *t);

#endif
