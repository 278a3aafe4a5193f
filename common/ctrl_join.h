/* ctrl_join.h: a node's announcements to the router (router.membership; prefix td_join_).
 *
 * Purpose: decode rank 0 and prefill stage 0 tell the router they exist, where their control
 * socket is and what they are (proto Join), every period_ms, so that a router that starts
 * later, restarts, or never had them in its YAML finds them; and, once they start to drain,
 * that they are leaving. docs/deploy.md, "Membership".
 * Invariants: announcements continue until td_join_stop, whatever the router answers (a
 * refusal is logged once per distinct reason, and again once it is accepted); td_join_leave
 * sends the next one at once.
 * Threading: one thread of its own owns the control client; td_join_leave and td_join_stop
 * may be called from any one thread (the node's).
 * Ownership: td_join_start copies the strings of its parameters.
 */
#ifndef TD_CTRL_JOIN_H
#define TD_CTRL_JOIN_H

#include <stdint.h>

#include "config.h"
#include "tandem_ctrl.pb-c.h"

typedef struct {
    const char *router;        /* HOST:PORT: router.membership.address */
    Td__Role role;             /* TD__ROLE__ROLE_DECODE or TD__ROLE__ROLE_PREFILL */
    const char *name;          /* the instance's name (--name) */
    const char *bound;         /* its control socket as bound (tcp://0.0.0.0:9000, ipc://...) */
    const char *host;          /* the host others reach it at (--advertise, else the YAML's):
                                  it replaces bound's; NULL or "": bound as it is */
    const char *template_name; /* the YAML instance it was started from */
    uint32_t tp, pp, max_batch, max_queue;
    int period_ms;                   /* between announcements: router.membership.lease_ms / 4 */
    const td_cfg_security *security; /* the YAML's control-plane TLS (the router's membership
                                        socket speaks it too), or NULL */
} td_join_params;

typedef struct td_join td_join;

/* Start announcing (logged, as is a failure: the node serves all the same, a router that
 * dials it still finds it). */
int td_join_start(const td_join_params *p, td_join **out);
/* From now on the announcements say leaving (the next goes out at once). */
void td_join_leave(td_join *j);
/* Stop announcing, join the thread, free. After td_join_leave it first waits (up to 0.5 s)
 * for the router's answer to the leaving Join. NULL is fine. */
void td_join_stop(td_join *j);

#endif
