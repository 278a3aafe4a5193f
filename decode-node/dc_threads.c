/* dc_threads.c: each decode step's thread count from measured step times (dc_threads.h). */
#include "dc_threads.h"

#include <math.h>

void dc_threads_init(dc_threads *t, int max, bool adaptive)
{
    *t = (dc_threads){.max = max < 1 ? 1 : max, .n_levels = 1};
    if (adaptive)
        while (t->n_levels < DC_THREADS_LEVELS && (t->max >> t->n_levels) >= 1)
            t->n_levels++;
    for (int i = 0; i < DC_THREADS_LEVELS; i++)
        t->ratio[i] = -1;
}

int dc_threads_of(const dc_threads *t, int level)
{
    return t->max >> level;
}

int dc_threads_next(dc_threads *t)
{
    int level = t->cur;
    t->steps++;
    if (t->n_levels > 1 && t->steps % DC_THREADS_PROBE == 0) {
        /* a neighbour: above (more threads, a lower level) or below, alternately where both
           exist */
        bool up = t->cur == t->n_levels - 1 || (t->cur > 0 && t->probe_up);
        level = up ? t->cur - 1 : t->cur + 1;
        t->probe_up = !up;
    }
    t->step_level = level;
    t->at[level]++;
    return dc_threads_of(t, level);
}

/* Level i's measured speed with its threads' cost (dc_threads.h). */
static double score(const dc_threads *t, int i)
{
    return t->ratio[i] * pow(dc_threads_of(t, i), DC_THREADS_COST);
}

void dc_threads_observe(dc_threads *t, double ms, double predicted_ms)
{
    if (t->n_levels == 1 || !(ms > 0) || !(predicted_ms > 0)) return;
    double r = ms / predicted_ms, *x = &t->ratio[t->step_level];
    double a = t->step_level == t->cur ? DC_THREADS_ALPHA : DC_THREADS_ALPHA_PROBE;
    *x = *x < 0 ? r : *x + a * (r - *x);
    int best = t->cur;
    for (int i = 0; i < t->n_levels; i++)
        if (t->ratio[i] >= 0 && score(t, i) < DC_THREADS_MARGIN * score(t, best)) best = i;
    t->cur = best;
}
