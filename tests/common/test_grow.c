/* test_grow.c: growable arrays (common/td_grow.h): doubling, the minimum, what is kept,
 * and the limits refused without touching the array. */
#include <stdint.h>
#include <stdlib.h>

#include "td_err.h"
#include "td_grow.h"
#include "tharness.h"

static void test_size(void)
{
    int64_t *a = NULL;
    size_t cap = 0;
    TH_CHECK(TD_GROW(a, cap, 3, 16) == 0 && a && cap == 16); /* the minimum first */
    for (int i = 0; i < 16; i++)
        a[i] = i * 7;
    TH_CHECK(TD_GROW(a, cap, 16, 16) == 0 && cap == 16);   /* room already: nothing changes */
    TH_CHECK(TD_GROW(a, cap, 17, 16) == 0 && cap == 32);   /* doubled */
    TH_CHECK(TD_GROW(a, cap, 100, 16) == 0 && cap == 100); /* more than double: what is needed */
    int kept = 1;
    for (int i = 0; i < 16; i++)
        kept &= a[i] == i * 7;
    TH_CHECK(kept);
    int64_t *before = a;
    TH_CHECK(TD_GROW(a, cap, SIZE_MAX / 4, 1) == TD_ERANGE); /* bytes overflow size_t */
    TH_CHECK(a == before && cap == 100);
    free(a);
}

static void test_int(void)
{
    char *s = NULL;
    int cap = 0;
    TH_CHECK(TD_GROW_INT(s, cap, 1, 0) == 0 && cap == 1); /* min 0: exactly what is needed */
    TH_CHECK(TD_GROW_INT(s, cap, 2, 0) == 0 && cap == 2);
    TH_CHECK(TD_GROW_INT(s, cap, 3, 0) == 0 && cap == 4);
    s[3] = 'x';
    int neg = -1;
    TH_CHECK(TD_GROW_INT(s, neg, 5, 0) == TD_ERANGE && neg == -1);
    free(s);
}

int main(void)
{
    TH_RUN(test_size);
    TH_RUN(test_int);
    TH_EXIT();
}
