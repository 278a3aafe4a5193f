/* kvx_pipe.c: what every pipe implementation shares: the sleeping wait (and the old clock
 * wrappers, see kvx_pipe.h). */
#include <errno.h>
#include <poll.h>

#include "kvx_pipe.h"
#include "td_clock.h"

/* Thin wrappers kept for the modules that still call them (the lead removes them in a final
 * sweep): kvxfer itself reads td_clock. */
int64_t kvx_now_ms(void)
{
    return td_now_ms();
}

uint64_t kvx_now_ns(void)
{
    return (uint64_t)td_now_ns();
}

int kvx_pipe_wait(kvx_pipe *p, int timeout_ms)
{
    int n = kvx_pipe_progress(p);
    if (n > 0 || timeout_ms <= 0) return n;
    if (!kvx_pipe_arm(p)) return kvx_pipe_progress(p);
    struct pollfd pfd = {.fd = kvx_pipe_event_fd(p), .events = POLLIN};
    int r = poll(&pfd, 1, timeout_ms);
    if (r < 0 && errno != EINTR) {
        TD_LOG_ERR("kvx pipe: poll on the event fd failed (errno %d)", errno);
        return TD_EIO;
    }
    return kvx_pipe_progress(p);
}
