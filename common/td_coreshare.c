/* td_coreshare.c: cores shared by time between a decode instance's steps and the prefill
 * stages beside it (see td_coreshare.h). */
#define _GNU_SOURCE
#include "td_coreshare.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "td_clock.h"
#include "td_futex.h"
#include "td_stats.h"
#include "td_err.h"

#define SEG_MAGIC 0x54434f52u /* "TCOR" */
#define SEG_BYTES 4096
#define MS        1000000ll
#define STALE_NS  ((int64_t)TD_CORESHARE_STALE_MS * MS)
/* A stage stamps want_ns at most this often (its ops run thousands of times a second). */
#define STAMP_EVERY_NS (1 * MS)
/* No stage in a forward and no stamp for this long: the stages are idle (between chunks,
 * waiting for their input or a transfer), and a decode waiting to leave them their share
 * claims at once. */
#define IDLE_NS (5 * MS)
/* The decode's wait for the stages' share, in slices this long (it notices idle stages). */
#define WAIT_SLICE_NS (1 * MS)

/* The shared segment. claimed is the futex word; the rest plain atomics. */
typedef struct {
    uint32_t magic;
    _Atomic uint32_t claimed; /* 1 while a decode step holds the cores */
    _Atomic int64_t claim_ns; /* when the current (or last) claim began */
    _Atomic int64_t want_ns;  /* the last time a stage's op asked for the cores */
    _Atomic int32_t busy;     /* stages in a forward pass (td_coreshare_gate_begin/end) */
} seg;

void td_coreshare_name(int port, char *buf, size_t cap)
{
    snprintf(buf, cap, "/tandem-cores-%u-%d", (unsigned)getuid(), port);
}

static void sleep_ns(int64_t ns)
{
    struct timespec ts = {.tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

/* ---- decode leader ---- */

/* A window of the last samples (TD_CORESHARE_AUTO_SAMPLES at most). */
typedef struct {
    double v[TD_CORESHARE_AUTO_SAMPLES];
    int n, next;
} ring;

/* Adds x; returns its slot. */
static int ring_add(ring *r, double x)
{
    int at = r->next;
    r->v[at] = x;
    r->next = (r->next + 1) % TD_CORESHARE_AUTO_SAMPLES;
    if (r->n < TD_CORESHARE_AUTO_SAMPLES) r->n++;
    return at;
}

/* Percentile p (0..100, td_stats.h's definition) of v's first n, v kept as it is. */
static double percentile_of(const double *v, int n, double p)
{
    double copy[TD_CORESHARE_AUTO_SAMPLES];
    memcpy(copy, v, (size_t)n * sizeof *v);
    return td_stats_percentile(copy, (size_t)n, p);
}

struct td_coreshare {
    char name[96];
    seg *s;
    int64_t claim_ns;    /* this step's start (0: none yet) */
    int64_t released_ns; /* the last release (0: none yet) */
    int64_t share_ns;    /* the stages' share after it */
    bool holding;        /* this step claimed the cores */
    /* adaptive (share_cores: auto): two windows of steps that ran beside active stages,
     * each step's time over the cost model's prediction for its shape (so steps of any size
     * compare): the unclaimed ones (and their times), and the claimed ones (probes) */
    bool adaptive;
    bool claiming;         /* steps claim (but the reverse probes); else they are measured */
    bool sample;           /* this step ran beside active stages: it is a sample */
    uint64_t active_steps; /* steps begun beside active stages (picks the probes) */
    ring unclaimed, claimed;
    double unclaimed_ms[TD_CORESHARE_AUTO_SAMPLES]; /* the unclaimed window's step times */
    td_coreshare_stats st;
};

int td_coreshare_create(const char *name, bool adaptive, td_coreshare **out)
{
    *out = NULL;
    td_coreshare *cs = calloc(1, sizeof *cs);
    if (!cs) return TD_ENOMEM;
    cs->adaptive = adaptive;
    snprintf(cs->name, sizeof cs->name, "%s", name);
    int fd = shm_open(name, O_CREAT | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, SEG_BYTES)) {
        TD_LOG_ERR("share_cores: cannot create the shared segment %s: %s", name, strerror(errno));
        if (fd >= 0) close(fd);
        free(cs);
        return TD_EIO;
    }
    void *p = mmap(NULL, SEG_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        TD_LOG_ERR("share_cores: cannot map %s: %s", name, strerror(errno));
        free(cs);
        return TD_EIO;
    }
    cs->s = p;
    /* a segment left by a decode that died keeps its inode: stages attached to it stay */
    atomic_store(&cs->s->claimed, 0);
    atomic_store(&cs->s->want_ns, 0);
    /* busy stays: stages still attached to a dead decode's segment keep their counts (a new
     * segment starts at zero); a count a dead stage left is ignored once it is silent */
    cs->s->magic = SEG_MAGIC;
    td_futex_wake(&cs->s->claimed, INT_MAX, true);
    *out = cs;
    return 0;
}

void td_coreshare_destroy(td_coreshare *cs)
{
    if (!cs) return;
    atomic_store(&cs->s->claimed, 0);
    td_futex_wake(&cs->s->claimed, INT_MAX, true);
    munmap(cs->s, SEG_BYTES);
    shm_unlink(cs->name);
    free(cs);
}

/* A stage is computing or asked lately: one in a forward (unless silent so long it died in
 * it), or an op that asked within IDLE_NS. */
static bool stages_active(const seg *s, int64_t now)
{
    int64_t quiet = now - atomic_load(&s->want_ns);
    return quiet < IDLE_NS || (atomic_load(&s->busy) > 0 && quiet < STALE_NS);
}

/* Adaptive, before a step: whether it claims. Beside idle stages nothing is at stake (and
 * nothing measured): left. Beside active ones: measuring, every TD_CORESHARE_AUTO_PROBE_EVERY-th
 * claims (a probe, for the uncontended times); claiming, every
 * TD_CORESHARE_AUTO_REVERSE_EVERY-th is left (fewer than one gap in a hundred stretched). */
static bool auto_claims(td_coreshare *cs, int64_t now)
{
    cs->sample = stages_active(cs->s, now);
    if (!cs->sample) return false;
    uint64_t k = cs->active_steps++;
    return cs->claiming ? k % TD_CORESHARE_AUTO_REVERSE_EVERY != 0
                        : k % TD_CORESHARE_AUTO_PROBE_EVERY == 0;
}

/* Adaptive, after a step beside active stages that took step_ms against predicted_ms: add it
 * to its window and decide again. Claiming pays when both hold: the scheduler stretches the
 * steps (unclaimed over claimed, medians per predicted ms, at least
 * TD_CORESHARE_AUTO_STRETCH) and the stretched steps run past the period nearly always (three
 * in four of them: a window whose median alone crossed it was seen where claiming only cost):
 * else claiming sets every gap to the period and takes the stages' time for nothing. */
static void auto_measure(td_coreshare *cs, bool claimed, double step_ms, double predicted_ms,
                         double period_ms)
{
    if (!cs->sample || !(predicted_ms > 0)) return;
    if (claimed) {
        ring_add(&cs->claimed, step_ms / predicted_ms);
    } else {
        int at = ring_add(&cs->unclaimed, step_ms / predicted_ms);
        cs->unclaimed_ms[at] = step_ms;
    }
    if (cs->unclaimed.n < TD_CORESHARE_AUTO_SAMPLES || cs->claimed.n < 4 || period_ms <= 0) return;
    double stretch = percentile_of(cs->unclaimed.v, cs->unclaimed.n, 50) /
                     percentile_of(cs->claimed.v, cs->claimed.n, 50),
           p25 = percentile_of(cs->unclaimed_ms, cs->unclaimed.n, 25);
    bool claim = stretch >= TD_CORESHARE_AUTO_STRETCH && p25 > period_ms;
    cs->st.stretch = stretch;
    cs->st.p25_ms = p25;
    if (claim == cs->claiming) return;
    cs->claiming = claim;
    if (claim) cs->st.switches++;
    /* the first switch says what auto found on this machine; later ones are routine */
    td_log_write(claim && cs->st.switches == 1 ? TD_LOG_INFO : TD_LOG_DEBUG, __FILE__, __LINE__,
                 "share_cores auto: steps beside busy prefill stages took %.2fx their time "
                 "when they claim the cores, three in four more than %.1f ms (period target "
                 "%.1f): %s",
                 stretch, p25, period_ms,
                 claim ? "steps claim the cores" : "steps left to the scheduler");
}

void td_coreshare_claim(td_coreshare *cs)
{
    int64_t now = td_now_ns();
    seg *s = cs->s;
    if (cs->adaptive && !auto_claims(cs, now)) {
        cs->holding = false;
        cs->claim_ns = now;
        cs->st.unclaimed++;
        return;
    }
    cs->holding = true;
    /* a stage is in a forward, or asked for the cores since the last claim: leave the stages
     * their share */
    if (cs->released_ns &&
        (atomic_load(&s->busy) > 0 || atomic_load(&s->want_ns) >= cs->claim_ns)) {
        int64_t until = cs->released_ns + cs->share_ns, t0 = now;
        if (now < until) cs->st.waits++;
        while (now < until) {
            int64_t quiet = now - atomic_load(&s->want_ns);
            int busy = atomic_load(&s->busy);
            /* no stage in a forward and none asking (after the first IDLE_NS of the share, in
             * which a stage the release woke stamps again): the time is not needed; or a
             * stage that died in its forward (counted busy, silent for long) */
            if ((busy <= 0 && quiet >= IDLE_NS && now - cs->released_ns >= IDLE_NS) ||
                quiet >= STALE_NS)
                break;
            sleep_ns(until - now < WAIT_SLICE_NS ? until - now : WAIT_SLICE_NS);
            now = td_now_ns();
        }
        cs->st.wait_ms += (double)(now - t0) / 1e6;
    }
    cs->claim_ns = now;
    atomic_store(&cs->s->claim_ns, now); /* before claimed: a stage that sees it sees this */
    atomic_store(&cs->s->claimed, 1);
    cs->st.steps++;
}

void td_coreshare_release(td_coreshare *cs, double period_ms, double predicted_ms)
{
    int64_t now = td_now_ns(), step = now - cs->claim_ns;
    if (cs->adaptive) auto_measure(cs, cs->holding, (double)step / 1e6, predicted_ms, period_ms);
    if (!cs->holding) { /* adaptive, left to the scheduler: nothing to leave the stages */
        cs->released_ns = now;
        cs->share_ns = 0;
        return;
    }
    cs->holding = false;
    atomic_store(&cs->s->claimed, 0);
    td_futex_wake(&cs->s->claimed, INT_MAX, true);
    int64_t period = (int64_t)(period_ms * 1e6);
    int64_t rest = period - step, floor = step / 4;
    cs->share_ns = period <= 0 ? step : rest > floor ? rest : floor;
    cs->released_ns = now;
    cs->st.claimed_ms += (double)step / 1e6;
}

td_coreshare_stats td_coreshare_get_stats(const td_coreshare *cs)
{
    td_coreshare_stats st = cs->st;
    st.claiming = !cs->adaptive || cs->claiming;
    return st;
}

/* ---- prefill stage ---- */

typedef struct {
    char name[96];
    seg *s;        /* mapped, or NULL (the decode is not there) */
    ino_t ino;     /* of the mapped segment */
    int64_t stamp; /* when this stage last stamped want_ns */
    bool counted;  /* this stage's forward is counted in the segment's busy */
} gate_seg;

struct td_coreshare_gate {
    int n;
    gate_seg *segs;
    td_coreshare_gate_stats st;
};

int td_coreshare_gate_create(const char *const *names, int n, td_coreshare_gate **out)
{
    *out = NULL;
    td_coreshare_gate *g = calloc(1, sizeof *g);
    if (!g || (n > 0 && !(g->segs = calloc((size_t)n, sizeof *g->segs)))) {
        free(g);
        return TD_ENOMEM;
    }
    g->n = n;
    for (int i = 0; i < n; i++)
        snprintf(g->segs[i].name, sizeof g->segs[i].name, "%s", names[i]);
    td_coreshare_gate_begin(g);
    td_coreshare_gate_end(g);
    *out = g;
    return 0;
}

static void detach(gate_seg *gs)
{
    if (gs->s && gs->counted) atomic_fetch_sub(&gs->s->busy, 1);
    if (gs->s) munmap(gs->s, SEG_BYTES);
    gs->s = NULL;
    gs->counted = false;
}

void td_coreshare_gate_destroy(td_coreshare_gate *g)
{
    if (!g) return;
    for (int i = 0; i < g->n; i++)
        detach(&g->segs[i]);
    free(g->segs);
    free(g);
}

void td_coreshare_gate_begin(td_coreshare_gate *g)
{
    for (int i = 0; i < g->n; i++) {
        gate_seg *gs = &g->segs[i];
        int fd = shm_open(gs->name, O_RDWR, 0);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) || st.st_size < SEG_BYTES) {
            detach(gs); /* gone (the decode stopped), or not ready */
            if (fd >= 0) close(fd);
            continue;
        }
        if (gs->s && st.st_ino == gs->ino) {
            close(fd);
            if (!gs->counted) atomic_fetch_add(&gs->s->busy, 1);
            gs->counted = true;
            continue;
        }
        detach(gs); /* a new segment: the decode restarted */
        void *p = mmap(NULL, SEG_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (p == MAP_FAILED) continue;
        gs->s = p;
        gs->ino = st.st_ino;
        gs->stamp = 0;
        atomic_fetch_add(&gs->s->busy, 1);
        gs->counted = true;
    }
}

void td_coreshare_gate_end(td_coreshare_gate *g)
{
    for (int i = 0; i < g->n; i++) {
        gate_seg *gs = &g->segs[i];
        if (gs->s && gs->counted) atomic_fetch_sub(&gs->s->busy, 1);
        gs->counted = false;
    }
}

void td_coreshare_gate_wait(void *ctx)
{
    td_coreshare_gate *g = ctx;
    for (int i = 0; i < g->n; i++) {
        gate_seg *gs = &g->segs[i];
        seg *s = gs->s;
        if (!s || s->magic != SEG_MAGIC) continue;
        int64_t now = td_now_ns(), t0 = now;
        bool claimed = atomic_load(&s->claimed);
        if (claimed) now = td_now_ns(); /* after the claim's time (stored before the word) */
        /* about to pause: always stamp, so the claim that pauses this op sees the stage asked
         * (the decode then leaves it its share at once, before this stage stamps again) */
        if (claimed || now - gs->stamp >= STAMP_EVERY_NS) {
            atomic_store(&s->want_ns, now);
            gs->stamp = now;
        }
        bool parked = false;
        while (atomic_load(&s->claimed)) {
            int64_t left = atomic_load(&s->claim_ns) + STALE_NS - now;
            if (left <= 0) break; /* a decode that died in its step pauses no one */
            parked = true;
            td_futex_wait(&s->claimed, 1, left, true);
            now = td_now_ns();
        }
        if (parked) {
            /* asking again: the decode measures the share it leaves from here */
            atomic_store(&s->want_ns, now);
            gs->stamp = now;
            g->st.parks++;
            g->st.parked_ms += (double)(now - t0) / 1e6;
        }
    }
}

td_coreshare_gate_stats td_coreshare_gate_get_stats(const td_coreshare_gate *g)
{
    return g->st;
}
