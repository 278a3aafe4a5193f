/* dc_async.c: the leader's overlap (decode[].overlap, dc_loop.c serve_overlap): the forward
 * pass of step N runs on a thread of its own (the CPU pool's caller) while the node thread
 * sends step N-1's token events, serves the inbox, the transfers and the health; and the
 * scheduler's events, held back while a step is committed and the next one planned, so that
 * they leave once the next pass computes. The order of the events is the scheduler's.
 * This file owns the node's dc_overlap part (dc_node_int.h). */
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "dc_node_int.h"
#include "td_clock.h"
#include "td_err.h"
#include "td_grow.h"

enum { FWD_IDLE, FWD_JOB, FWD_DONE, FWD_STOP };

struct dc_fwd {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int state; /* FWD_*: the node thread posts JOB or STOP, the thread answers DONE */
    /* the job (set by dc_async_launch): the thread reaches the node through nothing else */
    kn_engine *engine;
    kn_kv_pool *kv;
    const kn_batch *b;
    float *logits;
    int rc;
    int64_t t_post, t_start, t_end; /* job posted, pass began, pass ended (ns) */
};

/* ---- held events ---- */

static dc_held_event *hold_slot(dc_node *n)
{
    if (TD_GROW_INT(n->ovl.held, n->ovl.cap_held, n->ovl.n_held + 1, 64)) return NULL;
    return &n->ovl.held[n->ovl.n_held];
}

/* A copy of the event at the end of the queue; false when out of memory (the caller sends
 * what is held and then this event at once: the order stays the scheduler's). */
static bool hold(dc_node *n, const dc_held_event *e, const int32_t *ids,
                 const td_logprob_entry *lps)
{
    dc_held_event *h = hold_slot(n);
    if (!h) return false;
    *h = *e;
    h->ids = NULL;
    h->lps = NULL;
    if (ids && e->n) {
        h->ids = malloc((size_t)e->n * sizeof *ids);
        if (!h->ids) return false;
        memcpy(h->ids, ids, (size_t)e->n * sizeof *ids);
    }
    if (lps && e->n) {
        h->lps = malloc((size_t)e->n * sizeof *lps);
        if (!h->lps) {
            free(h->ids);
            return false;
        }
        memcpy(h->lps, lps, (size_t)e->n * sizeof *lps);
    }
    n->ovl.n_held++;
    return true;
}

void dc_async_on_tokens(void *ctx, uint64_t id, const int32_t *ids, int n_ids,
                        const td_logprob_entry *lps, dc_finish finish, int32_t n_prompt,
                        int32_t n_gen, int32_t n_cached)
{
    dc_node *n = ctx;
    dc_held_event e = {.id = id,
                       .n = n_ids,
                       .finish = finish,
                       .n_prompt = n_prompt,
                       .n_gen = n_gen,
                       .n_cached = n_cached};
    if (n->ovl.hold_events && hold(n, &e, ids, lps)) return;
    dc_async_flush(n);
    dc_serve_on_tokens(ctx, id, ids, n_ids, lps, finish, n_prompt, n_gen, n_cached);
}

void dc_async_on_prompt_logprobs(void *ctx, uint64_t id, int32_t from, const td_logprob_entry *e,
                                 int n_e)
{
    dc_node *n = ctx;
    dc_held_event h = {.id = id, .prompt_lps = true, .n = n_e, .from = from};
    if (n->ovl.hold_events && hold(n, &h, NULL, e)) return;
    dc_async_flush(n);
    dc_serve_on_prompt_logprobs(ctx, id, from, e, n_e);
}

void dc_async_hold(dc_node *n, bool on)
{
    n->ovl.hold_events = on;
}

void dc_async_flush(dc_node *n)
{
    /* n_held may not grow meanwhile: dc_serve_on_* send, they never call the sink */
    for (int i = 0; i < n->ovl.n_held; i++) {
        dc_held_event *e = &n->ovl.held[i];
        if (e->prompt_lps)
            dc_serve_on_prompt_logprobs(n, e->id, e->from, e->lps, e->n);
        else
            dc_serve_on_tokens(n, e->id, e->ids, e->n, e->lps, e->finish, e->n_prompt, e->n_gen,
                               e->n_cached);
        free(e->ids);
        free(e->lps);
    }
    n->ovl.n_held = 0;
}

/* ---- the forward thread ---- */

static void *fwd_main(void *arg)
{
    dc_fwd *f = arg;
    pthread_mutex_lock(&f->mu);
    for (;;) {
        while (f->state != FWD_JOB && f->state != FWD_STOP)
            pthread_cond_wait(&f->cv, &f->mu);
        if (f->state == FWD_STOP) break;
        kn_engine *e = f->engine;
        kn_kv_pool *kv = f->kv;
        const kn_batch *b = f->b;
        float *logits = f->logits;
        pthread_mutex_unlock(&f->mu);
        int64_t t_start = td_now_ns();
        int rc = kn_engine_forward(e, kv, b, logits);
        int64_t t_end = td_now_ns();
        pthread_mutex_lock(&f->mu);
        f->t_start = t_start;
        f->t_end = t_end;
        f->rc = rc;
        f->state = FWD_DONE;
        pthread_cond_broadcast(&f->cv);
    }
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

int dc_async_start(dc_node *n)
{
    dc_fwd *f = calloc(1, sizeof *f);
    if (!f) return TD_ENOMEM;
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    /* signals (SIGTERM) stay with the node thread: the thread starts with all blocked */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&f->th, NULL, fwd_main, f);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc) {
        TD_LOG_ERR("decode %s: cannot start the forward thread: %s", n->p->instance, strerror(rc));
        pthread_cond_destroy(&f->cv);
        pthread_mutex_destroy(&f->mu);
        free(f);
        return TD_ENOMEM;
    }
    n->ovl.fwd = f;
    return 0;
}

void dc_async_launch(dc_node *n, const kn_batch *b, float *logits)
{
    dc_fwd *f = n->ovl.fwd;
    pthread_mutex_lock(&f->mu);
    f->engine = n->proc.rt.engine;
    f->kv = dc_kv(n);
    f->b = b;
    f->logits = logits;
    f->state = FWD_JOB;
    f->t_post = td_now_ns();
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

int dc_async_join(dc_node *n)
{
    dc_fwd *f = n->ovl.fwd;
    int64_t t_enter = td_now_ns();
    pthread_mutex_lock(&f->mu);
    while (f->state == FWD_JOB)
        pthread_cond_wait(&f->cv, &f->mu);
    int rc = f->state == FWD_DONE ? f->rc : TD_ESTATE;
    f->state = FWD_IDLE;
    pthread_mutex_unlock(&f->mu);
    if (rc == TD_ESTATE) return rc;
    int64_t t_back = td_now_ns();
    /* the hand-offs: the thread waking for the job, this one waking for its end; or, when
     * the pass ended before this thread came to join it, its own work was longer */
    n->ovl.ns_handoff += f->t_start - f->t_post;
    if (t_enter < f->t_end)
        n->ovl.ns_handoff += t_back - f->t_end;
    else
        n->ovl.ns_io_over += t_enter - f->t_end;
    n->ovl.ns_pass += f->t_end - f->t_start;
    return rc;
}

void dc_async_stop(dc_node *n)
{
    dc_fwd *f = n->ovl.fwd;
    if (f) {
        pthread_mutex_lock(&f->mu);
        while (f->state == FWD_JOB) /* a pass in flight ends first */
            pthread_cond_wait(&f->cv, &f->mu);
        f->state = FWD_STOP;
        pthread_cond_broadcast(&f->cv);
        pthread_mutex_unlock(&f->mu);
        pthread_join(f->th, NULL);
        pthread_cond_destroy(&f->cv);
        pthread_mutex_destroy(&f->mu);
        free(f);
    }
    n->ovl.hold_events = false;
    dc_async_flush(n);
    free(n->ovl.held);
    n->ovl = (dc_overlap){0};
}
