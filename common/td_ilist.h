/* td_ilist.h: a doubly linked list threaded through index arrays (prefix td_ilist_): the
 * least-recently-used order of things that live in arrays (KV blocks, tier slots), with
 * unlink and append in O(1) and no allocation per element.
 *
 * Invariants: an element is an index; its links are prev[i] and next[i], in arrays the
 * owner allocates, sizes and frees (one entry per element); -1 ends the list. head is the
 * element appended first (the least recently used), tail the last. An element is in the
 * list at most once, and only an element in the list may be unlinked: the owner knows which
 * are (the list keeps no membership of its own).
 * Threading: none; the owner serializes.
 */
#ifndef TD_ILIST_H
#define TD_ILIST_H

#include <stdint.h>

typedef struct {
    int32_t *prev, *next; /* the owner's arrays */
    int32_t head, tail;   /* -1: empty */
} td_ilist;

/* Empty (the arrays' contents are not read again before an append). */
static inline void td_ilist_clear(td_ilist *l)
{
    l->head = l->tail = -1;
}

static inline void td_ilist_unlink(td_ilist *l, int32_t i)
{
    if (l->prev[i] >= 0)
        l->next[l->prev[i]] = l->next[i];
    else
        l->head = l->next[i];
    if (l->next[i] >= 0)
        l->prev[l->next[i]] = l->prev[i];
    else
        l->tail = l->prev[i];
}

/* i becomes the most recently used. */
static inline void td_ilist_append(td_ilist *l, int32_t i)
{
    l->prev[i] = l->tail;
    l->next[i] = -1;
    if (l->tail >= 0)
        l->next[l->tail] = i;
    else
        l->head = i;
    l->tail = i;
}

#endif
