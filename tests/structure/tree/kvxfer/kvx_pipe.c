/* kvx_pipe.c (fixture): a clock read outside td_clock.c, and what is no read. */
#include <pthread.h>
#include <time.h>
#include "kvx_pipe_int.h"

/* clock_gettime(CLOCK_MONOTONIC, &ts) in a comment is no read */
static const char *doc = "clock_gettime(CLOCK_MONOTONIC, &ts)";

static long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* EXPECT: monotonic-clock */
    return ts.tv_sec * 1000L + ts.tv_nsec / 1000000;
}

static void cond_init(pthread_cond_t *c)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* a clock choice, not a read */
    pthread_cond_init(c, &ca);
}

/* a static named like another module's header inline */
static void pf_op_done(void *arg) /* EXPECT: static-clash */
{
    (void)arg;
}

/* static through a macro: private too */
#define KVX_HELPER static inline __attribute__((always_inline))
KVX_HELPER int tiny(void)
{
    return 1;
}

/* a static named like another module's static: both private, fine */
static int parse_line(const char *s)
{
    return s[0];
}

int shared_helper(void) /* EXPECT: duplicate-function */
{
    pthread_cond_t c;
    cond_init(&c);
    pf_op_done(0);
    return (int)now_ms() + parse_line(doc) + tiny();
}
