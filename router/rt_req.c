/* rt_req.c: a request's lifetime (reference count), waking its connection, and what its
 * current attempt sends (the prompt, resumed after a move, and the Submit message). */
#include <stdlib.h>

#include <microhttpd.h>

#include "rt_req.h"
#include "rt_tools.h"

rt_req *rt_req_create(void)
{
    rt_req *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    pthread_mutex_init(&q->mu, NULL);
    q->refs = 1;
    q->http.fd = -1;
    q->loop.inst = -1;
    q->loop.fslot = -1;
    q->pair.pinst = -1;
    q->pair.pf_avoid = -1;
    return q;
}

void rt_req_retain(rt_req *q)
{
    pthread_mutex_lock(&q->mu);
    q->refs++;
    pthread_mutex_unlock(&q->mu);
}

void rt_req_release(rt_req *q)
{
    if (!q) return;
    pthread_mutex_lock(&q->mu);
    int left = --q->refs;
    pthread_mutex_unlock(&q->mu);
    if (left) return;
    for (int i = 0; i < q->ch.n_kids; i++)
        rt_req_release(q->ch.kids[i]);
    free(q->ch.kids);
    if (!q->ch.parent) rt_params_fini(&q->p); /* a child's p is its parent's (borrowed) */
    if (q->loop.dt_init) td_detok_fini(&q->loop.dt);
    rt_buf_free(&q->loop.held);
    rt_buf_free(&q->loop.text);
    rt_buf_free(&q->loop.reasoning);
    rt_toolp_destroy(q->loop.toolp);
    rt_buf_free(&q->http.out);
    free(q->loop.gen_ids);
    free(q->loop.lps);
    free(q->loop.plps);
    rt_buf_free(&q->loop.lp_hold);
    free(q->loop.resume);
    for (size_t i = 0; i < q->pair.n_targets; i++)
        free(q->pair.targets[i].data);
    free(q->pair.targets);
    pthread_mutex_destroy(&q->mu);
    free(q);
}

void rt_req_wake(rt_req *q)
{
    struct MHD_Connection *conn = NULL;
    pthread_mutex_lock(&q->mu);
    if (q->http.suspended && !q->http.gone) {
        q->http.suspended = false;
        conn = q->http.conn;
    }
    pthread_mutex_unlock(&q->mu);
    /* the connection cannot complete while suspended, so conn is still valid here */
    if (conn) MHD_resume_connection(conn);
}

int32_t *rt_req_prompt(const rt_req *q, size_t *n)
{
    *n = q->loop.resume ? q->loop.n_resume : q->p.n_prompt;
    return q->loop.resume ? q->loop.resume : q->p.prompt;
}

void rt_req_submit_msg(const rt_req *q, Td__Sampling *sm, Td__Submit *sub)
{
    /* sm borrows the request's lists (logit bias, min_tokens ids): q outlives the message */
    td_ctrl_sampling_to_pb(&q->p.sampling, sm);
    sm->skip_samples = (uint32_t)q->loop.gen_base; /* a moved request: the draws already made */
    /* a moved request's prompt logprobs came with its first attempt (every one of them
       precedes its first token) */
    sm->prompt_logprobs = sm->prompt_logprobs && q->loop.gen_base == 0;
    td__submit__init(sub);
    sub->request_id = q->loop.rid;
    sub->token_ids = rt_req_prompt(q, &sub->n_token_ids);
    sub->sampling = sm;
    sub->max_tokens = (uint32_t)(q->p.max_tokens - q->loop.gen_base);
    sub->ignore_eos = q->p.ignore_eos;
    sub->n_stop_token_ids = (size_t)q->p.n_stop_ids;
    sub->stop_token_ids = q->p.n_stop_ids ? (int32_t *)q->p.stop_ids : NULL;
}

bool rt_code_lost(int code)
{
    return code == TD__ERROR_CODE__ERR_PEER_FAILED || code == TD__ERROR_CODE__ERR_SHUTDOWN;
}
