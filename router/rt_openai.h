/* rt_openai.h: OpenAI request bodies -> validated request parameters (prefix rt_).
 *
 * Purpose: parse and validate /v1/completions and /v1/chat/completions bodies (tokenizing
 * the prompt, rendering the chat template) into rt_params, refusing bad input with a 400 or
 * 404 rt_error that names the field; the /v1/models body.
 * Invariants: a parsed rt_params has 1 <= n_prompt <= router.max_prompt_tokens (so has every
 * prompt of a batch, 1 + n_more <= router.max_batch_prompts), 1 <= n <= router.max_n with
 * n * (1 + n_more) <= router.max_queue, n_stop <= RT_MAX_STOP non-empty stop strings of at
 * most RT_MAX_STOP_BYTES, at most RT_MAX_STOP_IDS stop ids, and sampling values the sampler
 * accepts (logit bias and min_tokens ids in the vocabulary, min_tokens <= max_tokens).
 * Threading: called on the HTTP threads; reads only the router's read-only state (config,
 * tokenizer, chat template).
 * Ownership: rt_params owns its prompt and stop strings (rt_params_fini); it belongs to its
 * rt_req once posted.
 */
#ifndef RT_OPENAI_H
#define RT_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "rt_buf.h"
#include "rt_chat.h"
#include "td_sampling.h"
#include "tokenizer.h"

#define RT_MAX_STOP       4    /* stop strings per request */
#define RT_MAX_STOP_BYTES 1024 /* bytes of one stop string */
#define RT_MAX_STOP_IDS   64   /* stop_token_ids (TD_CTRL_MAX_STOP_IDS) */

/* The served model as the API sees it: what parsing a request, streaming its text and
 * answering /v1/models need. Set up once at start (rt_main.c), read-only after, so any
 * thread may read it. */
typedef struct {
    td_tokenizer *tok;
    rt_chat_tmpl chat;           /* the chat template(s), compiled (rt_chat.h) */
    int32_t n_ctx;               /* model context length */
    char name[256];              /* the model id clients send and see */
    const td_cfg_router *limits; /* max_prompt_tokens, max_tokens, request timeouts, max_n,
                                    max_batch_prompts, max_queue */
} rt_model;

typedef enum { RT_EP_COMPLETIONS = 0, RT_EP_CHAT = 1 } rt_endpoint;

/* One more prompt of a batched /v1/completions request (the first is rt_params.prompt). */
typedef struct {
    int32_t *ids; /* (n) token ids, malloc'd */
    size_t n;
    int max_tokens; /* its own: the default and the context check depend on its length */
} rt_prompt;

typedef struct {
    rt_endpoint ep;
    int32_t *prompt; /* (n_prompt) token ids, malloc'd */
    size_t n_prompt;
    int max_tokens;
    td_sampling sampling; /* .skip_samples is set per attempt (rt_req_submit_msg);
                             .grammar points at grammar */
    char *grammar;        /* response_format's schema text, malloc'd (rt_format.h); or NULL */
    bool ignore_eos;
    int32_t stop_ids[RT_MAX_STOP_IDS]; /* stop_token_ids: each ends the request (not sent) */
    int n_stop_ids;
    bool skip_special;       /* skip_special_tokens (default true): control tokens render empty */
    char *stop[RT_MAX_STOP]; /* NUL-terminated, malloc'd, non-empty */
    size_t stop_len[RT_MAX_STOP];
    int n_stop;
    bool stream, include_usage;
    int64_t timeout_ms; /* the body's "timeout" (seconds) in ms; 0: not given */
    bool no_migrate;    /* the body's "migrate": false: fail rather than move mid-stream */
    int n;              /* choices per prompt, 1..router.max_n */
    int best_of;        /* completions best_of > n: candidates per prompt (<= router.max_n),
                           the n with the highest cumulative logprob answered; else 0 */
    bool lp_hidden;     /* sampling.logprobs set for best_of's ranking only: not answered */
    rt_prompt *more;    /* (n_more) a batch's prompts after the first, malloc'd; NULL: one */
    int n_more;         /* n > 1 or n_more > 0: the request fans out (rt_choices.h) */
    /* logprobs (sampling.logprobs = 1 + top alternatives when asked; docs/api.md) */
    bool echo;           /* completions: the prompt's text (and logprobs) before the output */
    bool gen_none;       /* completions "max_tokens": 0 with echo: the one token the decode
                            side generates (max_tokens 1) is dropped; only the prompt is answered */
    rt_chat_tools tools; /* chat: tools, tool_choice, parallel_tool_calls (rt_chat.h) */
    bool reasoning;      /* chat with a thinking template: reasoning apart (rt_reason.h) */
    rt_reason_fmt reasoning_fmt; /* ... its markers */
    bool reasoning_open; /* ... and the prompt left the thinking block open */
} rt_params;

void rt_params_fini(rt_params *p);

/* Parse and validate a request body for ep. Returns 0 with *p filled, or the HTTP
 * status with e filled (p is then empty). */
int rt_openai_parse(const rt_model *m, rt_endpoint ep, const char *body, size_t len, rt_params *p,
                    rt_error *e);

/* The parts /tokenize shares with the generation endpoints. Both fill p->prompt and
 * p->n_prompt (malloc'd; rt_params_fini frees it) or return the HTTP status with e filled.
 * rt_openai_messages renders o's "messages" with the model's chat template (the template
 * writes BOS where the model wants one); rt_openai_tokenize encodes text, with control-token
 * text recognised and, if add_special, BOS/EOS as the model's metadata says. */
struct json_t;
int rt_openai_messages(const rt_model *m, struct json_t *o, bool add_generation_prompt,
                       rt_params *p, rt_error *e);
int rt_openai_tokenize(const rt_model *m, const char *text, size_t len, bool add_special,
                       rt_params *p, rt_error *e);

/* /v1/models body (malloc'd). */
char *rt_openai_models(const rt_model *m);
/* GET /v1/models/{id}: true when id names the served model (its name, or with .gguf). */
bool rt_openai_model_is(const rt_model *m, const char *id);
/* GET /v1/models/{id} of the served model: the model object, malloc'd JSON (NULL: no memory). */
char *rt_openai_model(const rt_model *m);

#endif
