/* td_step_hist.h: the buckets of a decode instance's step-time histogram.
 *
 * Purpose: one definition of the bounds for the two processes that use them: the decode
 * leader counts each step (planning to commit, the time its decodes wait for it) per bucket
 * and sends the counts in Health.step_time_counts; the router renders them per instance as
 * the histogram tandem_decode_step_seconds. The step-time tail is what the inter-token
 * latency tail is made of, seen from the node rather than the client.
 * Changing the bounds: a router and decode nodes of different versions would disagree on
 * what the counts mean, so the router ignores counts whose number is not TD_STEP_HIST_N + 1.
 */
#ifndef TD_STEP_HIST_H
#define TD_STEP_HIST_H

#define TD_STEP_HIST_N 16 /* finite upper bounds; the count after them is +Inf */

/* The finite upper bounds, seconds, ascending. */
static inline const double *td_step_hist_le(void)
{
    static const double le[TD_STEP_HIST_N] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075,
                                              0.1,   0.15,   0.2,   0.3,  0.5,  1.0,  2.5,  5.0};
    return le;
}

/* The bucket of a step of s seconds: the first bound >= s, or TD_STEP_HIST_N (+Inf). */
static inline int td_step_hist_bucket(double s)
{
    const double *le = td_step_hist_le();
    int i = 0;
    while (i < TD_STEP_HIST_N && s > le[i])
        i++;
    return i;
}

#endif
