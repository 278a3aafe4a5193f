/* kvx_pipe.c: what every pipe implementation shares: the sleeping wait. */
#include <errno.h>
#include <poll.h>

#include "kvx_pipe.h"

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
