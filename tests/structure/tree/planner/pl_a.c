/* pl_a.c (fixture): the planner sits above the nodes' public headers (prefill-node/include)
 * and below the rest of the node folders. */
#include "pf_pub.h"
#include "pf_y.h" /* EXPECT: layer-order, public-header */

int pl_a(void)
{
    return pf_pub();
}
