/* td_stats.h: small order statistics for timings (benchmarks, profiling, ceilings).
 *
 * Purpose: one median / percentile definition for every measurement Tandem reports, so a
 * "median" in BENCHMARKS.md means the same thing whichever tool printed it.
 * Definition: the values are sorted ascending (in place); percentile p in [0, 100] is linearly
 * interpolated between the closest ranks (numpy's default, "linear"); the median is p = 50.
 * An empty array gives NAN.
 */
#ifndef TD_STATS_H
#define TD_STATS_H

#include <stddef.h>

/* Sort v ascending in place (NaNs last). */
void td_stats_sort(double *v, size_t n);
/* Percentile p of v (sorts v in place). */
double td_stats_percentile(double *v, size_t n, double p);
/* Percentile p of an already sorted array (does not modify it). */
double td_stats_percentile_sorted(const double *v, size_t n, double p);
/* td_stats_percentile(v, n, 50). */
double td_stats_median(double *v, size_t n);

#endif
