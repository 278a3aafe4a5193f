/* test_clock_stats.c: common/td_clock (monotonic, consistent units, deadlines in the future)
 * and common/td_stats (median and percentiles as numpy's "linear" method computes them). */
#include <math.h>
#include <stdlib.h>
#include <stdint.h>

#include "td_clock.h"
#include "td_stats.h"
#include "tharness.h"

static void test_clock(void)
{
    int64_t a = td_now_ns(), ms = td_now_ms();
    struct timespec d = td_deadline_ts(250);
    int64_t b = td_now_ns();
    TH_CHECK(b >= a);
    TH_CHECK(llabs(ms - a / 1000000) <= 1);
    int64_t dns = (int64_t)d.tv_sec * 1000000000 + d.tv_nsec;
    TH_CHECK(dns >= a + 250 * 1000000 && dns <= b + 250 * 1000000 + 1000000);
    TH_CHECK(d.tv_nsec >= 0 && d.tv_nsec < 1000000000);
    struct timespec neg = td_deadline_ts(-5); /* a past deadline is now, not before */
    TH_CHECK((int64_t)neg.tv_sec * 1000000000 + neg.tv_nsec >= b);
    struct timespec w = td_wall_now();
    TH_CHECK(w.tv_sec > 1700000000); /* after 2023: a wall clock, not the monotonic one */
    for (int i = 0; i < 1000; i++) { /* never goes back */
        int64_t x = td_now_ns();
        TH_CHECK(x >= b);
        b = x;
    }
}

static void test_stats(void)
{
    double v[] = {5, 1, 4, 2, 3};
    TH_CHECK(td_stats_median(v, 5) == 3);
    TH_CHECK(v[0] == 1 && v[4] == 5); /* sorted in place */
    double e[] = {4, 1, 3, 2};
    TH_CHECK(td_stats_median(e, 4) == 2.5);
    /* numpy.percentile([1,2,3,4], 90) == 3.7; 0 and 100 are the extremes */
    TH_CHECK(fabs(td_stats_percentile_sorted(e, 4, 90) - 3.7) < 1e-12);
    TH_CHECK(td_stats_percentile_sorted(e, 4, 0) == 1 &&
             td_stats_percentile_sorted(e, 4, 100) == 4);
    TH_CHECK(fabs(td_stats_percentile_sorted(e, 4, 99) - 3.97) < 1e-12);
    double one[] = {7};
    TH_CHECK(td_stats_median(one, 1) == 7 && td_stats_percentile(one, 1, 99) == 7);
    TH_CHECK(isnan(td_stats_median(NULL, 0)));
    double withnan[] = {NAN, 2, 1};
    td_stats_sort(withnan, 3);
    TH_CHECK(withnan[0] == 1 && withnan[1] == 2 && isnan(withnan[2]));
}

int main(void)
{
    TH_RUN(test_clock);
    TH_RUN(test_stats);
    TH_EXIT();
}
