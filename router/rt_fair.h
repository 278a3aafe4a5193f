/* rt_fair.h: the router queue: one FIFO per client, served round robin (prefix rt_fair_).
 *
 * Purpose: the requests waiting for an instance, so that one client cannot starve the others
 * (rt_fair.c has the whole policy).
 * Invariants: c[s].n > 0 <=> slot s is in the ring <=> its list is non-empty; the sum of
 * c[s].n is len. A zeroed rt_fair is an empty queue; it never allocates.
 * Threading: the loop thread only.
 * Ownership: borrows the queued requests (linked through q->loop.next / qprev / fslot).
 */
#ifndef RT_FAIR_H
#define RT_FAIR_H

#include <stdint.h>

#include "rt_req.h"

#define RT_FAIR_CLIENTS 256 /* clients with a slot of their own; more share one slot */

typedef struct {
    uint64_t key;
    rt_req *head, *tail; /* queued requests, oldest first (a request put back at the head) */
    int n;               /* requests in the list; 0: the slot is free */
    int next, prev;      /* ring of slots with queued requests */
} rt_fair_client;

typedef struct {
    rt_fair_client c[RT_FAIR_CLIENTS + 1]; /* the last one: the overflow slot */
    int n_clients;                         /* slots in the ring */
    int cur;                               /* the slot served next (when n_clients > 0) */
    int len;                               /* requests queued in all */
} rt_fair;

/* Slot of key: its own, else a free one, else the overflow slot. */
int rt_fair_slot(const rt_fair *f, uint64_t key);
/* Requests queued under key's slot (what a newcomer with that key would join). */
int rt_fair_count(const rt_fair *f, uint64_t key);
/* Append q (key q->client) to its client's FIFO; sets q->fslot. */
void rt_fair_push(rt_fair *f, rt_req *q);
/* Put q at the head of its client's FIFO and serve that client next (a retry). */
void rt_fair_push_front(rt_fair *f, rt_req *q);
/* The request dispatch should take next, or NULL. */
rt_req *rt_fair_peek(const rt_fair *f);
/* Take the peeked request off the queue and move on to the next client. */
rt_req *rt_fair_pop(rt_fair *f);
/* Take q (queued) off the queue wherever it is. */
void rt_fair_remove(rt_fair *f, rt_req *q);
/* The queue is full and a request of key arrives: the newest queued request of the client
 * holding the most, if that client holds more than key's client would after admitting
 * the newcomer (so refusing it narrows the gap), else NULL (refuse the newcomer). */
rt_req *rt_fair_victim(const rt_fair *f, uint64_t key);

#endif
