/* rt_table.c: the loop's request table: router request id -> rt_req.
 * A request id is (generation << 20) | slot, so ids are never reused while a late event
 * for a finished request may still arrive, and lookups are one array index plus a check.
 * Loop thread only. */
#include <stdlib.h>

#include "rt_req.h"
#include "rt_table.h"
#include "td_err.h"

#define SLOT_BITS 20u
#define SLOT_MASK ((1u << SLOT_BITS) - 1)

int rt_table_add(rt_table *t, rt_req *q)
{
    if (!t->n_free) {
        uint32_t cap = t->cap ? 2 * t->cap : 256;
        if (cap > SLOT_MASK) return TD_ENOSPC;
        rt_req **s = realloc(t->slots, cap * sizeof *s);
        if (!s) return TD_ENOMEM;
        t->slots = s;
        uint32_t *f = realloc(t->free_list, cap * sizeof *f);
        if (!f) return TD_ENOMEM;
        t->free_list = f;
        for (uint32_t i = cap; i > t->cap; i--) {
            t->slots[i - 1] = NULL;
            t->free_list[t->n_free++] = i - 1;
        }
        t->cap = cap;
    }
    uint32_t slot = t->free_list[--t->n_free];
    t->slots[slot] = q;
    q->loop.rid = (++t->gen << SLOT_BITS) | slot;
    t->count++;
    return 0;
}

rt_req *rt_table_get(const rt_table *t, uint64_t rid)
{
    uint64_t slot = rid & SLOT_MASK;
    if (slot >= t->cap || !t->slots[slot] || t->slots[slot]->loop.rid != rid) return NULL;
    return t->slots[slot];
}

void rt_table_remove(rt_table *t, rt_req *q)
{
    if (!q->loop.rid || rt_table_get(t, q->loop.rid) != q) return;
    uint32_t slot = (uint32_t)(q->loop.rid & SLOT_MASK);
    t->slots[slot] = NULL;
    t->free_list[t->n_free++] = slot;
    t->count--;
}

void rt_table_fini(rt_table *t)
{
    free(t->slots);
    free(t->free_list);
    *t = (rt_table){0};
}
