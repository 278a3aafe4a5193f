/* td_grow.c: see td_grow.h. */
#include "td_grow.h"

#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"

/* *items_ptr (a T *) reallocated to n elements of elem bytes. */
static int resize(void *items_ptr, size_t n, size_t elem)
{
    if (!elem || n > SIZE_MAX / elem) return TD_ERANGE;
    void *p; /* the caller's T * read and written as bytes: any object pointer fits a void * */
    memcpy(&p, items_ptr, sizeof p);
    void *q = realloc(p, n * elem);
    if (!q) return TD_ENOMEM;
    memcpy(items_ptr, &q, sizeof q);
    return 0;
}

int td_grow_size(void *items_ptr, size_t *cap, size_t need, size_t elem, size_t min_cap)
{
    if (need <= *cap) return 0;
    size_t n = *cap > SIZE_MAX / 2 ? SIZE_MAX : *cap * 2;
    if (n < min_cap) n = min_cap;
    if (n < need) n = need;
    /* a doubling the size cannot hold falls back to exactly what is needed */
    if (elem && n > SIZE_MAX / elem && need <= SIZE_MAX / elem) n = need;
    int rc = resize(items_ptr, n, elem);
    if (!rc) *cap = n;
    return rc;
}

int td_grow_int(void *items_ptr, int *cap, int need, size_t elem, int min_cap)
{
    if (need <= *cap) return 0;
    if (*cap < 0) return TD_ERANGE;
    int n = *cap > INT_MAX / 2 ? INT_MAX : *cap * 2; /* an int capacity stops at INT_MAX */
    if (n < min_cap) n = min_cap;
    if (n < need) n = need;
    int rc = resize(items_ptr, (size_t)n, elem);
    if (!rc) *cap = n;
    return rc;
}
