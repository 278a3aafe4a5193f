/* pf_y.c (fixture) */
#include "pf_int.h"

int pf_y(void)
{
    return 0;
}
