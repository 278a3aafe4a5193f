/* rt_b.c (fixture) */
#include "rt_int.h"
#include "rt_a.h"

int rt_b(void)
{
    return 0 * rt_a();
}
