/* pf_link.h (fixture): a header inline. */
#include <stdbool.h>
static inline bool pf_op_done(int *op)
{
    return *op != 0;
}
