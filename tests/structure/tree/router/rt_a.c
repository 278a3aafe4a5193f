/* rt_a.c (fixture): rt_a and rt_b include each other's header: a cycle between files. */
#include "rt_int.h"
#include "rt_a.h"
#include "rt_b.h" /* EXPECT: include-cycle */

int rt_a(void)
{
    return rt_b() + 1;
}
