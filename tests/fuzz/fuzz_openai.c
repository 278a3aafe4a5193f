/* fuzz_openai.c: libFuzzer target for the router's request parser/validator
 * (rt_openai_parse in router/rt_openai.c: JSON -> validated rt_params).
 *
 * Input: one selector byte, then the request body. The selector picks the endpoint
 * (completions / chat), the chat template (the model's, or the built-in chatml, llama3 or
 * gemma, each compiled once by the Jinja engine as the router does at start) and the
 * limits (model context, router.max_prompt_tokens, router.max_tokens), so the limit checks
 * run at their edges too. Each input builds its own rt_router on the stack; only the
 * tokenizer and the model's chat template are shared, read-only, as in the real router
 * (rt.h: "The tokenizer and the config are read-only after start"). The tokenizer comes
 * from the GGUF named by $TD_FUZZ_MODEL (scripts/test.sh makes a tiny synthetic one with
 * tests/ref/make_synth.py --tiny).
 *
 * Oracle: never crash, leak or read out of bounds; a rejection is a 4xx with a message and
 * leaves the parameters empty, and its error JSON renders; an acceptance keeps every limit:
 * 1 <= prompt tokens <= max_prompt_tokens, every id in [0, n_vocab), 1 <= max_tokens <=
 * router.max_tokens, prompt + max_tokens <= the context, sampling values in their ranges,
 * at most RT_MAX_STOP non-empty stop strings of at most RT_MAX_STOP_BYTES, logit bias,
 * min_tokens and stop ids within their caps and the vocabulary, min_tokens <= max_tokens,
 * biases in [-100, 100]; n and a batch's prompts within router.max_n, max_batch_prompts and
 * max_queue, each prompt of a batch held to the same limits as the first. A 500 is only
 * acceptable for "out of memory".
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "rt_openai.h"
#include "td_err.h"

static td_tokenizer *g_tok;
static rt_chat_tmpl g_tmpl[4]; /* the model's, chatml, llama3, gemma */

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    td_log_set_level(TD_LOG_ERROR);
    json_object_seed(1); /* the same hash order on every run: reproducible inputs */
    const char *path = getenv("TD_FUZZ_MODEL");
    if (!path || !*path) {
        fprintf(stderr, "fuzz_openai: set TD_FUZZ_MODEL to a GGUF with a tokenizer\n");
        exit(2);
    }
    static td_gguf *g;
    static const char *const forced[] = {"", "chatml", "llama3", "gemma"};
    char err[256] = "";
    int rc = td_gguf_open(path, &g, err, sizeof err);
    if (!rc) rc = td_tok_create(g, &g_tok);
    for (int i = 0; i < 4 && !rc; i++)
        rc = rt_chat_tmpl_init(&g_tmpl[i], g, g_tok, forced[i], err, sizeof err);
    if (rc) {
        fprintf(stderr, "fuzz_openai: cannot load %s: %s\n", path, err);
        exit(2);
    }
    return 0;
}

static void check_ok(const rt_model *r, rt_endpoint ep, const rt_params *p)
{
    const td_cfg_router *rc = r->limits;
    int32_t nv = td_tok_n_vocab(r->tok);
    if (p->ep != ep || !p->prompt || p->n_prompt < 1 || p->n_prompt > (size_t)rc->max_prompt_tokens)
        abort();
    for (size_t i = 0; i < p->n_prompt; i++)
        if (p->prompt[i] < 0 || p->prompt[i] >= nv) abort();
    if (p->max_tokens < 1 || p->max_tokens > rc->max_tokens) abort();
    if ((long long)p->n_prompt + p->max_tokens > r->n_ctx) abort();
    const td_sampling *sp = &p->sampling;
    if (!(sp->temperature >= 0 && sp->temperature <= 2) || !(sp->top_p >= 0 && sp->top_p <= 1) ||
        !(sp->min_p >= 0 && sp->min_p <= 1) ||
        !(sp->repeat_penalty > 0 && sp->repeat_penalty <= 10) || sp->top_k < 0 ||
        !(sp->presence_penalty >= -2 && sp->presence_penalty <= 2) ||
        !(sp->frequency_penalty >= -2 && sp->frequency_penalty <= 2) || sp->skip_samples != 0)
        abort();
    if (p->n_stop < 0 || p->n_stop > RT_MAX_STOP) abort();
    for (int i = 0; i < p->n_stop; i++)
        if (!p->stop[i] || p->stop_len[i] < 1 || p->stop_len[i] > RT_MAX_STOP_BYTES ||
            p->stop[i][p->stop_len[i]])
            abort();
    if (p->include_usage && !p->stream) abort();
    /* logit bias, min_tokens, stop ids: counts within their caps, ids in the vocabulary */
    if (sp->n_logit_bias < 0 || sp->n_logit_bias > TD_MAX_LOGIT_BIAS || sp->min_tokens < 0 ||
        sp->min_tokens > p->max_tokens || sp->n_min_tokens_ids < 0 ||
        sp->n_min_tokens_ids > TD_MAX_MIN_TOKENS_IDS ||
        (sp->min_tokens == 0 && sp->n_min_tokens_ids) || p->n_stop_ids < 0 ||
        p->n_stop_ids > RT_MAX_STOP_IDS)
        abort();
    for (int i = 0; i < sp->n_logit_bias; i++)
        if (sp->logit_bias_ids[i] < 0 || sp->logit_bias_ids[i] >= nv ||
            !(sp->logit_bias_values[i] >= -100 && sp->logit_bias_values[i] <= 100))
            abort();
    for (int i = 0; i < sp->n_min_tokens_ids; i++)
        if (sp->min_tokens_ids[i] < 0 || sp->min_tokens_ids[i] >= nv) abort();
    for (int i = 0; i < p->n_stop_ids; i++)
        if (p->stop_ids[i] < 0 || p->stop_ids[i] >= nv) abort();
    /* n and batches (router/rt_choices.h): within router.max_n, max_batch_prompts and the
       queue, every prompt of a batch within the limits as the first one is */
    if (p->n < 1 || p->n > rc->max_n || p->n_more < 0 || p->n_more + 1 > rc->max_batch_prompts ||
        (long long)p->n * (1 + p->n_more) > (p->n * (1 + p->n_more) > 1 ? rc->max_queue : 1) ||
        (p->n_more > 0) != (p->more != NULL))
        abort();
    for (int k = 0; k < p->n_more; k++) {
        const rt_prompt *m = &p->more[k];
        if (!m->ids || m->n < 1 || m->n > (size_t)rc->max_prompt_tokens || m->max_tokens < 1 ||
            m->max_tokens > rc->max_tokens || (long long)m->n + m->max_tokens > r->n_ctx)
            abort();
        for (size_t i = 0; i < m->n; i++)
            if (m->ids[i] < 0 || m->ids[i] >= nv) abort();
    }
}

static void check_err(rt_endpoint ep, const rt_params *p, const rt_error *e, int rc)
{
    if (rc != e->status || !e->message[0] || !e->type) abort();
    if (rc == 500 && !strstr(e->message, "out of memory")) abort(); /* client input: 4xx */
    if (rc < 400 || rc > 499) {
        if (rc != 500) abort();
    }
    if (p->ep != ep || p->prompt || p->n_prompt || p->n_stop || p->more || p->n_more)
        abort(); /* nothing left */
    char *j = rt_error_json(e);
    if (!j) abort();
    free(j);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    uint8_t sel = data[0];
    static const int32_t ctx[] = {4, 64, 2048, 8192};
    static const int prompt_max[] = {2, 48, 8192, 1};
    static const int tok_max[] = {1, 8, 4096, 3};

    td_cfg cfg = {0};
    cfg.router.max_prompt_tokens = prompt_max[(sel >> 5) & 3];
    cfg.router.max_tokens = tok_max[(sel >> 3) & 3];
    cfg.router.request_timeout_ms = 600000; /* the defaults: a "timeout" field can be valid */
    cfg.router.max_request_timeout_ms = (sel & 0x80) ? 1000 : 3600000;
    cfg.router.max_n = 4; /* n and batches at their edges: 4 x 3 prompts > max_queue */
    cfg.router.max_batch_prompts = 3;
    cfg.router.max_queue = 8;
    cfg.router.reasoning = true;
    rt_model r = {.tok = g_tok, .limits = &cfg.router, .chat = g_tmpl[(sel >> 1) & 3]};
    r.n_ctx = ctx[(sel >> 7) | (((sel >> 3) & 1) << 1)];
    snprintf(r.name, sizeof r.name, "tiny");

    rt_endpoint ep = (sel & 1) ? RT_EP_CHAT : RT_EP_COMPLETIONS;
    /* an exact-size heap copy: ASan sees any read past the body */
    size_t len = size - 1;
    char *body = malloc(len ? len : 1);
    if (!body) return 0;
    memcpy(body, data + 1, len);
    rt_params p;
    rt_error e;
    memset(&e, 0, sizeof e);
    int rc = rt_openai_parse(&r, ep, body, len, &p, &e);
    if (rc == 0)
        check_ok(&r, ep, &p);
    else
        check_err(ep, &p, &e, rc);
    rt_params_fini(&p);
    free(body);
    return 0;
}
