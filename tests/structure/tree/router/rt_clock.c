/* rt_clock.c (fixture): more clock reads: a raw monotonic clock and a helper's clock id. */
#include <time.h>
#include "rt_int.h"

static long raw_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_RAW, &ts); /* EXPECT: monotonic-clock */
    return ts.tv_nsec;
}

static long read_clock(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts); /* EXPECT: monotonic-clock */
    return ts.tv_nsec;
}

static int tiny(void)
{
    return 2;
}

static int parse_line(const char *s)
{
    return s[1];
}

int shared_helper(void) /* EXPECT: duplicate-function */
{
    return (int)(raw_ns() + read_clock(CLOCK_REALTIME)) + parse_line("ab") + tiny();
}

/* a type of another module's header defined again here */
typedef struct {
    int n;
} pf_seg; /* EXPECT: duplicate-type */

typedef struct {
    int n;
} rt_local; /* a private type of this file: fine */

int main(void)
{
    pf_seg s = {0};
    rt_local l = {0};
    return shared_helper() + s.n + l.n;
}
