/* rt_table.h: the loop's request table: control-plane request id -> request (prefix rt_).
 *
 * Purpose: find the request a reply or event is about in one array index.
 * Invariants: a request id is (generation << 20) | slot, never 0, never reused while a late
 * event for a finished request may still arrive; count requests are in the table.
 * Threading: the loop thread only.
 * Ownership: the table borrows its requests (the loop holds their reference).
 */
#ifndef RT_TABLE_H
#define RT_TABLE_H

#include <stdint.h>

struct rt_req;

typedef struct {
    struct rt_req **slots; /* (cap) */
    uint32_t *free_list;
    uint32_t n_free, cap, count;
    uint64_t gen; /* makes request ids unique over time */
} rt_table;

int rt_table_add(rt_table *t, struct rt_req *q); /* sets q->loop.rid; 0 or TD_ENOMEM */
struct rt_req *rt_table_get(const rt_table *t, uint64_t rid);
void rt_table_remove(rt_table *t, struct rt_req *q);
void rt_table_fini(rt_table *t);

#endif
