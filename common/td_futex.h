/* td_futex.h: the Linux futex calls behind the project's wait/wake words: the CPU pool's
 * (private to a process), the decode ranks' collective and the core sharing's (in shared
 * memory other processes map).
 *
 * A waiter sleeps only while the word still holds the value it read, so a wake between its
 * read and its sleep is never lost; returns may be spurious: callers re-check their word.
 * The including file defines _GNU_SOURCE (syscall()). */
#ifndef TD_FUTEX_H
#define TD_FUTEX_H

#include <linux/futex.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Sleep while the 32-bit word at w equals val, at most ns nanoseconds (ns < 0: no limit),
 * until woken. shared: the word lies in memory other processes may map. */
static inline void td_futex_wait(const void *w, uint32_t val, int64_t ns, bool shared)
{
    struct timespec ts = {.tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000};
    syscall(SYS_futex, (uint32_t *)w, shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE, val,
            ns < 0 ? NULL : &ts, NULL, 0);
}

/* Wake up to n waiters on the word at w (INT_MAX: all). */
static inline void td_futex_wake(const void *w, int n, bool shared)
{
    syscall(SYS_futex, (uint32_t *)w, shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

#endif
