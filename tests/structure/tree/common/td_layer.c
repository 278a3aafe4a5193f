/* td_layer.c (fixture): common is the bottom layer: a header of a module above it is refused,
 * its own headers and system ones are fine. */
#include <stdio.h>

#include "td_api.h"
#include "rt_a.h"   /* EXPECT: layer-order, public-header */
#include "pf_pub.h" /* EXPECT: layer-order */
