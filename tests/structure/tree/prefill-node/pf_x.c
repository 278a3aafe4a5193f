/* pf_x.c (fixture) */
#include "pf_int.h"

int pf_x(void)
{
    return pf_y();
}
