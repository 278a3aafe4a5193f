/* td_clock.c: the only reads of CLOCK_MONOTONIC in Tandem (see td_clock.h). */
#include "td_clock.h"

int64_t td_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t td_now_ms(void)
{
    return td_now_ns() / 1000000;
}

struct timespec td_deadline_ts(int64_t ms)
{
    if (ms < 0) ms = 0;
    int64_t ns = td_now_ns() + ms * 1000000;
    return (struct timespec){.tv_sec = (time_t)(ns / 1000000000),
                             .tv_nsec = (long)(ns % 1000000000)};
}

struct timespec td_wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts;
}
