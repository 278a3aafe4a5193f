/* rt_int.h (fixture): the router's private header; it may include the files that include it. */
#ifndef RT_INT_H
#define RT_INT_H
#include "rt_a.h"
#include "rt_b.h"
#endif
