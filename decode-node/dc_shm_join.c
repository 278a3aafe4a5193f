/* dc_shm_join.c: the rendezvous of dc_shm (see dc_shm.h): rank 0 creates the segment
 * (replacing a stale one), followers find and join it, every rank waits until all tp have
 * joined; and closing. The peers' liveness (/proc, pidfds) is here too.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "dc_shm_int.h"
#include "td_clock.h"
#include "td_err.h"

#define SHM_MAGIC   0x31304d4853445454ull /* "TTDSHM01" */
#define SHM_VERSION                                                                                \
    4u /* 2: broken names the culprit too; 3: a dp group's round word;                             \
           4: four slot sets, barriers by arrival index (split allreduce) */
#define PAGE        4096

#define DEF_MAX_PLAN    (64 * 1024)
#define DEF_TIMEOUT_MS  30000
#define DEF_LIVENESS_MS 20
#define DEF_SPIN_US     50
/* longest sleep of a follower polling for rank 0's segment (find_segment) */
#define FIND_MAX_BACKOFF_NS (50 * 1000000ll)

/* ---- processes ---- */

static void sleep_ns(int64_t ns)
{
    struct timespec ts = {.tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000};
    nanosleep(&ts, NULL);
}

/* State and start time of a process from /proc/PID/stat. 1 found, 0 gone, -1 unknown. */
static int proc_stat(pid_t pid, char *state, uint64_t *start)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT ? 0 : -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0; /* exited between open and read */
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    if (!p || p[1] != ' ' || !p[2]) return -1;
    *state = p[2];
    p += 3; /* " ppid ..." */
    for (int field = 4; field <= 22; field++) {
        p = strchr(p, ' ');
        if (!p) return -1;
        p++;
    }
    *start = strtoull(p, NULL, 10);
    return 1;
}

bool dc_shm_proc_alive(pid_t pid, uint64_t start)
{
    if (pid <= 0) return false;
    char state = 0;
    uint64_t st = 0;
    int rc = proc_stat(pid, &state, &st);
    if (rc < 0) return kill(pid, 0) == 0 || errno == EPERM; /* no usable /proc */
    if (rc == 0 || state == 'Z' || state == 'X' || state == 'x') return false;
    return !start || st == start;
}

static uint64_t new_epoch(void)
{
    static _Atomic uint64_t counter;
    /* an identifier, not a time: the wall clock keeps it distinct from the epochs of
     * segments made before a reboot or by an earlier process with the same pid */
    struct timespec ts = td_wall_now();
    uint64_t e = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    e ^= (uint64_t)getpid() << 40;
    e += atomic_fetch_add(&counter, 1) * 0x9e3779b97f4a7c15ull;
    return e ? e : 1;
}

/* Once gathered: pidfds of the peer processes, so a liveness check is one poll (about
 * 0.2 us against 7 us for /proc/PID/stat) and immune to pid reuse. Without pidfd_open
 * (old kernel, seccomp) find_dead reads /proc. */
static void open_pidfds(dc_shm *s)
{
#ifdef SYS_pidfd_open
    for (int r = 0; r < s->tp; r++) {
        dc_shm_slot *x = &s->h->ranks[r];
        pid_t pid = atomic_load(&x->pid);
        if (r == s->rank || pid == s->pid) continue;
        int fd = (int)syscall(SYS_pidfd_open, pid, 0);
        /* the pid may have been reused before the open: check the start time once */
        if (fd >= 0 && !dc_shm_proc_alive(pid, atomic_load(&x->start))) {
            close(fd);
            fd = -1;
        }
        s->pidfd[r] = fd;
    }
#else
    (void)s;
#endif
}

/* ---- rendezvous ---- */

static bool name_ok(const char *x, size_t max)
{
    size_t n = x ? strlen(x) : 0;
    if (n == 0 || n > max) return false;
    for (size_t i = 0; i < n; i++) {
        char c = x[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '.' || c == '-'))
            return false;
    }
    return true;
}

static void set_views(dc_shm *s)
{
    uint8_t *base = (uint8_t *)s->h;
    size_t off = (sizeof(dc_shm_hdr) + PAGE - 1) & ~(size_t)(PAGE - 1);
    size_t part = (size_t)s->tp * s->stride * sizeof(float);
    for (int p = 0; p < s->ring; p++)
        s->partial[p] = (float *)(base + off + (size_t)p * part);
    off += (size_t)s->ring * part;
    for (int p = 0; p < s->ring; p++)
        s->result[p] = (float *)(base + off + (size_t)p * s->stride * sizeof(float));
    off += (size_t)s->ring * s->stride * sizeof(float);
    for (int p = 0; p < 2; p++)
        s->plan[p] = base + off + (size_t)p * s->plan_stride;
}

static size_t layout_size(const dc_shm *s)
{
    size_t off = (sizeof(dc_shm_hdr) + PAGE - 1) & ~(size_t)(PAGE - 1);
    off += (size_t)s->ring * ((size_t)s->tp + 1) * s->stride * sizeof(float);
    off += 2 * s->plan_stride;
    return (off + PAGE - 1) & ~(size_t)(PAGE - 1);
}

/* Whether s->name still names this object's segment (and not a newer one). */
static bool name_is_ours(const dc_shm *s)
{
    int fd = shm_open(s->name, O_RDONLY, 0);
    if (fd < 0) return false;
    struct stat st;
    bool same = fstat(fd, &st) == 0 && st.st_dev == s->dev && st.st_ino == s->ino;
    close(fd);
    return same;
}

/* Rank 0: remove a stale segment (refuse a live one), create a fresh one, join it. */
static int create_segment(dc_shm *s)
{
    int fd = shm_open(s->name, O_RDWR, 0);
    if (fd >= 0) {
        struct stat st;
        if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(dc_shm_hdr)) {
            dc_shm_hdr *old = mmap(NULL, sizeof(dc_shm_hdr), PROT_READ, MAP_SHARED, fd, 0);
            if (old != MAP_FAILED) {
                bool live = old->magic == SHM_MAGIC && atomic_load(&old->ready) &&
                            !atomic_load(&old->broken) &&
                            atomic_load(&old->ranks[0].pid) != s->pid &&
                            dc_shm_proc_alive(atomic_load(&old->ranks[0].pid),
                                              atomic_load(&old->ranks[0].start));
                pid_t opid = atomic_load(&old->ranks[0].pid);
                munmap(old, sizeof(dc_shm_hdr));
                if (live) {
                    close(fd);
                    TD_LOG_ERR("dc_shm %s rank 0: instance already running: %s belongs to "
                               "rank 0 pid %d",
                               s->inst, s->name, (int)opid);
                    return TD_ESTATE;
                }
            }
        }
        close(fd);
        TD_LOG_INFO("dc_shm %s rank 0: replacing stale segment %s", s->inst, s->name);
        if (shm_unlink(s->name) && errno != ENOENT) {
            TD_LOG_ERR("dc_shm %s rank 0: shm_unlink %s: %s", s->inst, s->name, strerror(errno));
            return TD_EIO;
        }
    }
    fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        TD_LOG_ERR("dc_shm %s rank 0: shm_open %s: %s%s", s->inst, s->name, strerror(errno),
                   errno == EEXIST ? " (another rank 0 is starting)" : "");
        return errno == EEXIST ? TD_ESTATE : TD_EIO;
    }
    s->linked = true;
    struct stat st;
    if (fstat(fd, &st) == 0) {
        s->dev = st.st_dev;
        s->ino = st.st_ino;
    }
    size_t size = layout_size(s);
    int err = ftruncate(fd, (off_t)size) ? errno : posix_fallocate(fd, 0, (off_t)size);
    if (err) {
        close(fd);
        TD_LOG_ERR("dc_shm %s rank 0: cannot reserve %zu MiB for %s: %s", s->inst, size >> 20,
                   s->name, strerror(err));
        return err == ENOSPC || err == ENOMEM ? TD_ENOMEM : TD_EIO;
    }
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        TD_LOG_ERR("dc_shm %s rank 0: mmap %s: %s", s->inst, s->name, strerror(errno));
        return TD_ENOMEM;
    }
    s->h = m;
    s->size = size;
    dc_shm_hdr *h = s->h;
    h->magic = SHM_MAGIC;
    h->version = SHM_VERSION;
    h->tp = (uint32_t)s->tp;
    h->ring = (uint32_t)s->ring;
    h->stride = s->stride;
    h->plan_stride = s->plan_stride;
    h->total = size;
    h->epoch = s->epoch = new_epoch();
    atomic_store(&h->ranks[0].claim, 1);
    atomic_store(&h->ranks[0].pid, s->pid);
    atomic_store(&h->ranks[0].start, s->start);
    atomic_store(&h->ranks[0].joined_epoch, s->epoch);
    atomic_store(&h->join_word, 1);
    atomic_store_explicit(&h->ready, 1, memory_order_release);
    return 0;
}

/* Follower: use the segment behind fd if it is this run's. 1 attached, 0 not (yet) usable
 * (s->why says why), or a negative td_err. */
static int try_attach(dc_shm *s, int fd)
{
    struct stat st;
    if (fstat(fd, &st) || (size_t)st.st_size < sizeof(dc_shm_hdr)) {
        snprintf(s->why, sizeof s->why, "segment %s being created", s->name);
        return 0;
    }
    size_t size = (size_t)st.st_size;
    dc_shm_hdr *h = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (h == MAP_FAILED) {
        TD_LOG_ERR("dc_shm %s rank %d: mmap %s: %s", s->inst, s->rank, s->name, strerror(errno));
        return TD_ENOMEM;
    }
    if (!atomic_load_explicit(&h->ready, memory_order_acquire) || h->magic != SHM_MAGIC ||
        h->version != SHM_VERSION) {
        snprintf(s->why, sizeof s->why, "segment %s not initialised", s->name);
        munmap(h, size);
        return 0;
    }
    pid_t pid0 = atomic_load(&h->ranks[0].pid);
    if (!dc_shm_proc_alive(pid0, atomic_load(&h->ranks[0].start)) || atomic_load(&h->broken)) {
        snprintf(s->why, sizeof s->why, "stale segment %s of rank 0 pid %d", s->name, (int)pid0);
        munmap(h, size);
        return 0;
    }
    if (h->tp != (uint32_t)s->tp || h->ring != (uint32_t)s->ring || h->stride != s->stride ||
        h->plan_stride != s->plan_stride || h->total != size || size != layout_size(s)) {
        TD_LOG_ERR("dc_shm %s rank %d: rank 0 (pid %d) has tp %u, %u slot sets, %llu floats, "
                   "%llu plan bytes; this rank has tp %d, %d slot sets, %llu floats, %llu plan "
                   "bytes",
                   s->inst, s->rank, (int)pid0, h->tp, h->ring, (unsigned long long)h->stride,
                   (unsigned long long)h->plan_stride, s->tp, s->ring,
                   (unsigned long long)s->stride, (unsigned long long)s->plan_stride);
        munmap(h, size);
        return TD_EINVAL;
    }
    dc_shm_slot *me = &h->ranks[s->rank];
    uint32_t zero = 0;
    if (!atomic_compare_exchange_strong(&me->claim, &zero, 1)) {
        pid_t owner = atomic_load(&me->pid);
        if (owner != s->pid && !dc_shm_proc_alive(owner, atomic_load(&me->start))) {
            /* this rank's previous process joined and died: rank 0 notices within
             * liveness_ms, breaks this segment and makes a fresh one; wait for that */
            snprintf(s->why, sizeof s->why, "rank %d of segment %s held by dead pid %d", s->rank,
                     s->name, (int)owner);
            munmap(h, size);
            return 0;
        }
        TD_LOG_ERR("dc_shm %s rank %d: rank %d already taken by pid %d", s->inst, s->rank, s->rank,
                   (int)owner);
        munmap(h, size);
        return TD_ESTATE;
    }
    s->h = h;
    s->size = size;
    s->dev = st.st_dev;
    s->ino = st.st_ino;
    s->epoch = h->epoch;
    atomic_store(&me->pid, s->pid);
    atomic_store(&me->start, s->start);
    atomic_store(&me->joined_epoch, s->epoch);
    atomic_fetch_add(&h->join_word, 1);
    dc_shm_futex_wake(&h->join_word);
    return 1;
}

/* Follower: poll for this run's segment until the deadline. The poll backs off from 1 ms
 * to FIND_MAX_BACKOFF: quick when the ranks start together, and a follower waiting a long
 * time for a (new) leader wakes only FIND_MAX_BACKOFF^-1 times a second. */
static int find_segment(dc_shm *s, int64_t deadline)
{
    int64_t backoff = 1000000;
    snprintf(s->why, sizeof s->why, "no segment %s", s->name);
    for (;;) {
        int fd = shm_open(s->name, O_RDWR, 0);
        if (fd >= 0) {
            int rc = try_attach(s, fd);
            close(fd);
            if (rc) return rc < 0 ? rc : 0;
        } else if (errno != ENOENT) {
            TD_LOG_ERR("dc_shm %s rank %d: shm_open %s: %s", s->inst, s->rank, s->name,
                       strerror(errno));
            return TD_EIO;
        }
        if (dc_shm_interrupted(s)) {
            TD_LOG_ERR("dc_shm %s rank %d: interrupted waiting for rank 0", s->inst, s->rank);
            return TD_ESTATE;
        }
        int64_t now = td_now_ns();
        if (now >= deadline) {
            TD_LOG_ERR("dc_shm %s rank %d: rendezvous timed out after %d ms: missing rank 0 (%s)",
                       s->inst, s->rank, s->timeout_ms, s->why);
            return TD_ETIMEDOUT;
        }
        sleep_ns(deadline - now < backoff ? deadline - now : backoff);
        backoff = backoff * 2 < FIND_MAX_BACKOFF_NS ? backoff * 2 : FIND_MAX_BACKOFF_NS;
    }
}

/* Every rank, once attached: wait until all tp ranks joined, until deadline (INT64_MAX:
 * no limit). final (dc_shm_open): running out of time fails the instance; otherwise
 * (dc_shm_gather) it is TD_ETIMEDOUT, not logged, and the caller may wait again. */
static int gather(dc_shm *s, int64_t deadline, bool final)
{
    if (s->err) return s->err;
    if (s->gathered) return 0;
    dc_shm_hdr *h = s->h;
    int64_t left = deadline == INT64_MAX ? -1 : deadline - td_now_ns();
    if (deadline != INT64_MAX && left < 0) left = 0;
    int rc = dc_shm_wait_word(s, &h->join_word, &h->join_waiters, (uint32_t)s->tp, left);
    if (rc == TD_ETIMEDOUT && !final) {
        if (s->rank == 0 && s->linked && !name_is_ours(s)) {
            /* removed by a follower that took it for its dead rank 0's (dc_shm_close) */
            TD_LOG_ERR("dc_shm %s rank 0: %s was removed while the ranks gathered", s->inst,
                       s->name);
            s->linked = false;
            dc_shm_note(s, "rendezvous segment %s removed", s->name);
            return dc_shm_fail(s, TD_EIO);
        }
        return TD_ETIMEDOUT;
    }
    if (rc == TD_ETIMEDOUT) {
        char list[256] = "";
        size_t len = 0;
        for (int r = 0; r < s->tp && len < sizeof list - 8; r++)
            if (atomic_load(&h->ranks[r].joined_epoch) != s->epoch)
                len += (size_t)snprintf(list + len, sizeof list - len, "%s%d", len ? ", " : "", r);
        TD_LOG_ERR("dc_shm %s rank %d: rendezvous timed out after %d ms: missing rank %s "
                   "(of tp %d)",
                   s->inst, s->rank, s->timeout_ms, len ? list : "?", s->tp);
        return dc_shm_fail(s, TD_ETIMEDOUT);
    }
    if (rc == DC_SHM_INTR) {
        TD_LOG_ERR("dc_shm %s rank %d: interrupted in the rendezvous", s->inst, s->rank);
        return dc_shm_fail(s, TD_ESTATE);
    }
    if (rc) return rc;
    s->gathered = true;
    open_pidfds(s);
    if (s->rank == 0) {
        shm_unlink(s->name); /* everyone has it mapped: nothing can go stale from here on */
        s->linked = false;
    }
    return 0;
}

/* Check p, allocate the object and create (rank 0) or find and join (followers, until
 * *deadline) the segment. */
static int begin(const dc_shm_params *p, dc_shm **out, int64_t *deadline)
{
    if (!out) return TD_EINVAL;
    *out = NULL;
    if (!p || !name_ok(p->instance, 64) || (p->token && p->token[0] && !name_ok(p->token, 64)) ||
        p->tp < 1 || p->tp > DC_SHM_MAX_TP || p->rank < 0 || p->rank >= p->tp ||
        p->max_floats <= 0 || p->max_floats > ((int64_t)1 << 40) ||
        p->max_plan > ((size_t)1 << 34)) {
        TD_LOG_ERR("dc_shm: bad params (instance '%s', token '%s', rank %d, tp %d, max_floats "
                   "%lld, max_plan %zu)",
                   p && p->instance ? p->instance : "", p && p->token ? p->token : "",
                   p ? p->rank : -1, p ? p->tp : 0, p ? (long long)p->max_floats : 0LL,
                   p ? p->max_plan : 0);
        return TD_EINVAL;
    }
    dc_shm *s = calloc(1, sizeof *s);
    if (!s) return TD_ENOMEM;
    for (int r = 0; r < DC_SHM_MAX_TP; r++)
        s->pidfd[r] = -1;
    s->culprit = -1;
    char tok[32];
    const char *token = p->token && p->token[0] ? p->token : tok;
    snprintf(tok, sizeof tok, "%u", (unsigned)getuid());
    snprintf(s->name, sizeof s->name, "/tandem-%s-%s", p->instance, token);
    snprintf(s->inst, sizeof s->inst, "%s", p->instance);
    s->rank = p->rank;
    s->tp = p->tp;
    s->ring = p->split_allreduce ? DC_SHM_RING : 2;
    s->max_floats = p->max_floats;
    s->stride = ((uint64_t)p->max_floats + 31) & ~(uint64_t)31;
    s->max_plan = p->max_plan ? p->max_plan : DEF_MAX_PLAN;
    s->plan_stride = (s->max_plan + DC_SHM_LINE - 1) & ~(uint64_t)(DC_SHM_LINE - 1);
    s->timeout_ms = p->timeout_ms > 0 ? p->timeout_ms : DEF_TIMEOUT_MS;
    s->op_timeout_ns =
        (int64_t)(p->op_timeout_ms > 0 ? p->op_timeout_ms : DEF_TIMEOUT_MS) * 1000000;
    s->liveness_ns = (int64_t)(p->liveness_ms > 0 ? p->liveness_ms : DEF_LIVENESS_MS) * 1000000;
    s->spin_ns = p->spin_us < 0 ? 0 : (int64_t)(p->spin_us ? p->spin_us : DEF_SPIN_US) * 1000;
    s->intr = p->interrupt;
    s->pid = getpid();
    char state;
    if (proc_stat(s->pid, &state, &s->start) != 1) s->start = 0;

    *deadline = td_now_ns() + (int64_t)s->timeout_ms * 1000000;
    int rc = s->rank == 0 ? create_segment(s) : find_segment(s, *deadline);
    if (rc) {
        dc_shm_close(s);
        return rc;
    }
    set_views(s);
    *out = s;
    return 0;
}

int dc_shm_open(const dc_shm_params *p, dc_shm **out)
{
    int64_t deadline;
    int rc = begin(p, out, &deadline);
    if (rc) return rc;
    if ((rc = gather(*out, deadline, true))) {
        dc_shm_close(*out);
        *out = NULL;
    }
    return rc;
}

int dc_shm_begin(const dc_shm_params *p, dc_shm **out)
{
    int64_t deadline;
    return begin(p, out, &deadline);
}

int dc_shm_gather(dc_shm *s, int wait_ms)
{
    return gather(s, wait_ms < 0 ? INT64_MAX : td_now_ns() + (int64_t)wait_ms * 1000000, false);
}

uint64_t dc_shm_joined(const dc_shm *s)
{
    uint64_t m = 0;
    for (int r = 0; s && s->h && r < s->tp; r++)
        if (atomic_load(&s->h->ranks[r].joined_epoch) == s->epoch) m |= (uint64_t)1 << r;
    return m;
}

void dc_shm_close(dc_shm *s)
{
    if (!s) return;
    if (s->linked && name_is_ours(s)) shm_unlink(s->name);
    /* a follower whose rank 0 died while the ranks gathered: nobody else would remove that
     * name until the next rank 0 starts (a leader may wait long for a restarted rank). The
     * check is not atomic with the unlink: a new rank 0 replacing the name in between
     * loses its name, notices (gather) and makes another segment. */
    if (s->rank > 0 && s->h && !s->gathered && s->culprit == 0 && name_is_ours(s)) {
        TD_LOG_INFO("dc_shm %s rank %d: removing %s (its rank 0 died)", s->inst, s->rank, s->name);
        shm_unlink(s->name);
    }
    if (s->h) {
        if (!s->stopped && !s->err) {
            /* leaving without a clean stop: the peers must not wait for this rank */
            TD_LOG_DEBUG("dc_shm %s rank %d: closing without stop", s->inst, s->rank);
            dc_shm_fail(s, TD_EIO);
        }
        munmap(s->h, s->size);
    }
    for (int r = 0; r < DC_SHM_MAX_TP; r++)
        if (s->pidfd[r] >= 0) close(s->pidfd[r]);
    free(s);
}

int dc_shm_rank_pid(const dc_shm *s, int rank)
{
    if (!s->gathered || rank < 0 || rank >= s->tp) return -1;
    return (int)atomic_load(&s->h->ranks[rank].pid);
}
