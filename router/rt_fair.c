/* rt_fair.c: the router queue with per-client fairness (loop thread only).
 *
 * Requests wait in one FIFO per client; the clients that have queued requests form a ring
 * that dispatch walks round robin: one request of a client, then one of the next client.
 * A client that gets its first queued request joins the ring just before the client
 * served next, that is at the end of the current round, so it waits for at most one
 * request of every other client. A request put back (rt_fair_push_front: busy instance,
 * prefill retry) goes to the head of its client's FIFO and that client is served next,
 * as the single queue served it first before.
 *
 * Clients are identified by a 64-bit key (rt_http.c: hash of the remote address and the
 * Authorization header). At most RT_FAIR_CLIENTS clients have a slot of their own; while
 * all are taken, the requests of further clients share the overflow slot, which counts as
 * one client. A slot is free again as soon as its client has no queued request, so the
 * structure is a fixed array: no per-client memory is ever allocated.
 *
 * Invariants: c[s].n > 0 <=> slot s is in the ring <=> its list is non-empty; the sum of
 * c[s].n is len; n_clients counts the ring; cur is a ring member while n_clients > 0.
 * A zeroed rt_fair is an empty queue. */
#include "rt_fair.h"

static int find_slot(const rt_fair *f, uint64_t key)
{
    if (f->n_clients) {
        int s = f->cur;
        do {
            if (s != RT_FAIR_CLIENTS && f->c[s].key == key) return s;
            s = f->c[s].next;
        } while (s != f->cur);
    }
    return -1;
}

int rt_fair_slot(const rt_fair *f, uint64_t key)
{
    int s = find_slot(f, key);
    if (s >= 0) return s;
    for (s = 0; s < RT_FAIR_CLIENTS; s++)
        if (!f->c[s].n) return s;
    return RT_FAIR_CLIENTS;
}

int rt_fair_count(const rt_fair *f, uint64_t key)
{
    return f->c[rt_fair_slot(f, key)].n;
}

/* Slot s gets its first request: join the ring at the end of the current round. */
static void ring_join(rt_fair *f, int s, uint64_t key)
{
    rt_fair_client *c = &f->c[s];
    c->key = key;
    if (!f->n_clients) {
        c->next = c->prev = s;
        f->cur = s;
    } else {
        int before = f->c[f->cur].prev;
        c->prev = before;
        c->next = f->cur;
        f->c[before].next = s;
        f->c[f->cur].prev = s;
    }
    f->n_clients++;
}

static void ring_leave(rt_fair *f, int s)
{
    rt_fair_client *c = &f->c[s];
    if (--f->n_clients == 0) return;
    f->c[c->prev].next = c->next;
    f->c[c->next].prev = c->prev;
    if (f->cur == s) f->cur = c->next;
}

static int take_slot(rt_fair *f, rt_req *q)
{
    int s = rt_fair_slot(f, q->client);
    if (!f->c[s].n) ring_join(f, s, q->client);
    q->loop.fslot = s;
    f->c[s].n++;
    f->len++;
    return s;
}

void rt_fair_push(rt_fair *f, rt_req *q)
{
    rt_fair_client *c = &f->c[take_slot(f, q)];
    q->loop.next = NULL;
    q->loop.qprev = c->tail;
    if (c->tail)
        c->tail->loop.next = q;
    else
        c->head = q;
    c->tail = q;
}

void rt_fair_push_front(rt_fair *f, rt_req *q)
{
    int s = take_slot(f, q);
    rt_fair_client *c = &f->c[s];
    q->loop.qprev = NULL;
    q->loop.next = c->head;
    if (c->head)
        c->head->loop.qprev = q;
    else
        c->tail = q;
    c->head = q;
    f->cur = s;
}

rt_req *rt_fair_peek(const rt_fair *f)
{
    return f->n_clients ? f->c[f->cur].head : NULL;
}

void rt_fair_remove(rt_fair *f, rt_req *q)
{
    int s = q->loop.fslot;
    if (s < 0) return;
    rt_fair_client *c = &f->c[s];
    if (q->loop.qprev)
        q->loop.qprev->loop.next = q->loop.next;
    else
        c->head = q->loop.next;
    if (q->loop.next)
        q->loop.next->loop.qprev = q->loop.qprev;
    else
        c->tail = q->loop.qprev;
    q->loop.next = q->loop.qprev = NULL;
    q->loop.fslot = -1;
    f->len--;
    if (--c->n == 0) ring_leave(f, s);
}

rt_req *rt_fair_pop(rt_fair *f)
{
    rt_req *q = rt_fair_peek(f);
    if (!q) return NULL;
    int s = f->cur;
    rt_fair_remove(f, q);
    /* round robin: the next client goes first, whether or not this one has more */
    if (f->n_clients && f->c[s].n) f->cur = f->c[s].next;
    return q;
}

rt_req *rt_fair_victim(const rt_fair *f, uint64_t key)
{
    if (!f->n_clients) return NULL;
    int heavy = f->cur, s = f->cur;
    do {
        if (f->c[s].n > f->c[heavy].n) heavy = s;
        s = f->c[s].next;
    } while (s != f->cur);
    /* only when the newcomer's client still holds fewer than the heaviest one afterwards */
    if (f->c[heavy].n <= rt_fair_count(f, key) + 1) return NULL;
    return f->c[heavy].tail;
}
