/* kvx_pipe_int.h (fixture): the body of the opaque kvx_pipe; unprefixed private types. */
#ifndef KVX_PIPE_INT_H
#define KVX_PIPE_INT_H
#include "kvx_pipe.h"

struct kvx_pipe {
    int fd;
};

typedef struct {
    int len;
} msg; /* EXPECT: type-prefix */

typedef struct pf_req { /* EXPECT: duplicate-type */
    struct pf_req *next;
} pf_req; /* EXPECT: type-prefix */

#endif
