/* pf_pub.h (fixture): a public header of a PUBLIC_ONLY module (prefill-node/include/, a layer
 * below the planner): it may include other modules' headers, never its own module's private
 * ones. */
#include "td_api.h"
#include "pf_x.h" /* EXPECT: public-header */
int pf_pub(void);
