/* td_api.h (fixture): C++ guards, forward declarations and uses of foreign types. */
#ifndef TD_API_H
#define TD_API_H
#ifdef __cplusplus
extern "C" {
#endif

struct MHD_Daemon; /* a forward declaration defines nothing */

typedef struct td_api {
    struct MHD_Connection *conn; /* a use of a foreign tag */
    int n;
} td_api;

static inline int td_api_n(const td_api *a)
{
    return a->n;
}

#ifdef __cplusplus
}
#endif
#endif
