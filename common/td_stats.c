/* td_stats.c: median and percentiles (see td_stats.h). */
#include "td_stats.h"

#include <math.h>
#include <stdlib.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    if (isnan(x) || isnan(y)) return isnan(x) - isnan(y);
    return (x > y) - (x < y);
}

void td_stats_sort(double *v, size_t n)
{
    if (n > 1) qsort(v, n, sizeof *v, cmp_double);
}

double td_stats_percentile_sorted(const double *v, size_t n, double p)
{
    if (n == 0) return NAN;
    if (p <= 0) return v[0];
    if (p >= 100) return v[n - 1];
    double rank = p / 100.0 * (double)(n - 1);
    size_t lo = (size_t)rank;
    if (lo + 1 >= n) return v[n - 1];
    double frac = rank - (double)lo;
    return v[lo] + frac * (v[lo + 1] - v[lo]);
}

double td_stats_percentile(double *v, size_t n, double p)
{
    td_stats_sort(v, n);
    return td_stats_percentile_sorted(v, n, p);
}

double td_stats_median(double *v, size_t n)
{
    return td_stats_percentile(v, n, 50.0);
}
