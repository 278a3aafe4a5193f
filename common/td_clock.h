/* td_clock.h: the one clock of every Tandem process.
 *
 * Purpose: deadlines, timeouts, latencies and timestamps read CLOCK_MONOTONIC through these
 * functions and nothing else, so that times taken in different modules (and, on one host,
 * different processes: the kernel's monotonic clock is shared) compare directly.
 * The wall clock is only for what a person or a client reads (log lines, "created" fields).
 * Threading: every function is thread-safe and does not block.
 */
#ifndef TD_CLOCK_H
#define TD_CLOCK_H

#include <stdint.h>
#include <time.h>

/* CLOCK_MONOTONIC in nanoseconds / milliseconds. */
int64_t td_now_ns(void);
int64_t td_now_ms(void);

/* The absolute CLOCK_MONOTONIC time `ms` milliseconds from now, as pthread_cond_timedwait
 * wants it for a condition variable created with pthread_condattr_setclock(CLOCK_MONOTONIC). */
struct timespec td_deadline_ts(int64_t ms);

/* CLOCK_REALTIME: seconds and nanoseconds since the epoch (log lines, API timestamps). */
struct timespec td_wall_now(void);

#endif
