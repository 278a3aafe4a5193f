/* pf_int.h (fixture): the prefill node's private header. It includes pf_x.h and pf_y.h, whose
 * .c files include it back: cycles through the private header are allowed. pf_z.h includes
 * it back, a cycle of headers: not allowed. */
#ifndef PF_INT_H
#define PF_INT_H
#include "pf_x.h"
#include "pf_y.h"
#include "pf_z.h" /* EXPECT: include-cycle */

typedef struct pf_req { /* EXPECT: duplicate-type */
    struct pf_req *next;
} pf_req;

typedef struct {
    int n;
} pf_seg;

#endif
