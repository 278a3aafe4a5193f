/* td_clock.c (fixture): the designated clock; its reads are never reported. */
#include <time.h>

long td_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

long td_wall_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* the wall clock is no monotonic read */
    return ts.tv_sec;
}
