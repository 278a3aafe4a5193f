/* td_grow.h: growable arrays: the one rule by which an array makes room, wherever one grows.
 *
 * An array is a pointer, a capacity and a count, kept by its owner (in its own struct, with
 * its own names). Before an append, TD_GROW(items, cap, need, min_cap) makes room for need
 * elements: the capacity becomes the largest of need, twice the old capacity and min_cap,
 * so n appends cost O(n) copies in all; the elements held are kept. items may be NULL while
 * cap is 0.
 * Errors: TD_ENOMEM (out of memory) or TD_ERANGE (the bytes would overflow size_t, or a
 * negative int capacity): nothing changed, the array stays valid. An int capacity stops at
 * INT_MAX.
 * Two forms: TD_GROW for a size_t capacity, TD_GROW_INT for an int (or int32_t) one.
 */
#ifndef TD_GROW_H
#define TD_GROW_H

#include <stddef.h>

/* items_ptr: the address of the array's pointer (T **); elem: sizeof(T). */
int td_grow_size(void *items_ptr, size_t *cap, size_t need, size_t elem, size_t min_cap);
int td_grow_int(void *items_ptr, int *cap, int need, size_t elem, int min_cap);

/* The room check is inline (appends in loops pay a compare, not a call); the arguments are
 * evaluated more than once: pass plain lvalues and side-effect-free sizes. */
#define TD_GROW(items, cap, need, min_cap)                                                         \
    ((size_t)(need) <= (cap) ? 0                                                                   \
                             : td_grow_size(&(items), &(cap), (need), sizeof *(items), (min_cap)))
#define TD_GROW_INT(items, cap, need, min_cap)                                                     \
    ((need) <= (cap) ? 0 : td_grow_int(&(items), &(cap), (need), sizeof *(items), (min_cap)))

#endif
