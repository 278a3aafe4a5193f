/* test_ignored.c (fixture): tests/ is left out of every rule, so nothing here is reported. */
#include <time.h>
typedef struct { int a; } msg;
int shared_helper(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += 1;
    ts.tv_sec += 2;
    ts.tv_sec += 3;
    ts.tv_sec += 4;
    ts.tv_sec += 5;
    ts.tv_sec += 6;
    ts.tv_sec += 7;
    ts.tv_sec += 8;
    ts.tv_sec += 9;
    ts.tv_sec += 10;
    ts.tv_sec += 11;
    ts.tv_sec += 12;
    ts.tv_sec += 13;
    ts.tv_sec += 14;
    ts.tv_sec += 15;
    ts.tv_sec += 16;
    return (int)ts.tv_sec;
}
