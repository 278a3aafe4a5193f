/* test_coreshare.c: common/td_coreshare (cores shared by time between a decode instance's
 * steps and the prefill stages beside it), with a real second process as the stage (or the
 * decode): a stage's ops do not run while a step holds the cores and resume at its release;
 * the next claim leaves the stages their share (the period's rest, at least a quarter of the
 * step), and none when they are idle; a claim of a decode that died pauses no one after
 * TD_CORESHARE_STALE_MS, nor does a stage that died in its forward; a stage notices a
 * re-created segment (a restarted decode); the adaptive mode (share_cores: auto) leaves short
 * steps to the scheduler and claims once steps beside busy stages run past the period. Bounds on
 * how late something happens are loose (a loaded 2-core machine); the guarantees (nothing ran
 * inside a claim, a share was left) are exact. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "td_clock.h"
#include "td_coreshare.h"
#include "tharness.h"

#define MS      1000000ll
#define MAX_OPS 200000

/* What the stage process reports (an anonymous shared mapping). */
typedef struct {
    _Atomic int run;   /* 1: keep doing ops; 0: idle (no gate calls); -1: exit */
    _Atomic int n_ops; /* ops done */
    _Atomic int ready; /* the stage process is attached and looping */
    _Atomic uint64_t parks;
    int64_t op_ns[MAX_OPS]; /* when each op started (after its gate) */
} shared;

static shared *sh;
static char seg_name[96];

static void spin_ns(int64_t ns)
{
    int64_t t = td_now_ns();
    while (td_now_ns() - t < ns) {
    }
}

static void sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

/* The stage: ops (gate, then 0.2 ms of work) inside a forward begun as the prefill stage
 * does, ended while told to idle. */
static void stage_main(void)
{
    const char *names[] = {seg_name};
    td_coreshare_gate *g;
    if (td_coreshare_gate_create(names, 1, &g)) _exit(2);
    atomic_store(&sh->ready, 1);
    int64_t fwd_start = 0;
    for (;;) {
        int run = atomic_load(&sh->run);
        if (run < 0) break;
        if (run == 0) {
            td_coreshare_gate_end(g);
            fwd_start = 0;
            sleep_ms(1);
            continue;
        }
        /* one long forward while told to run (no gap between forwards: the decode takes a
         * stage between them that has not stamped for 5 ms as idle, and a loaded machine
         * may not schedule it that soon); begin again every 5 ms only re-checks the segment
         * (a restarted decode), the count stays */
        if (td_now_ns() - fwd_start > 5 * MS) {
            td_coreshare_gate_begin(g);
            fwd_start = td_now_ns();
        }
        td_coreshare_gate_wait(g);
        int i = atomic_load(&sh->n_ops);
        if (i < MAX_OPS) {
            sh->op_ns[i] = td_now_ns();
            atomic_store(&sh->n_ops, i + 1);
        }
        spin_ns(MS / 5);
        atomic_store(&sh->parks, td_coreshare_gate_get_stats(g).parks);
    }
    td_coreshare_gate_end(g);
    td_coreshare_gate_destroy(g);
    _exit(0);
}

static pid_t start_stage(void)
{
    atomic_store(&sh->ready, 0);
    atomic_store(&sh->run, 1);
    pid_t pid = fork();
    if (pid == 0) stage_main();
    while (!atomic_load(&sh->ready))
        sleep_ms(1);
    return pid;
}

static void stop_stage(pid_t pid)
{
    atomic_store(&sh->run, -1);
    int st;
    TH_CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* ops started in [a, b) */
static int ops_between(int64_t a, int64_t b)
{
    int n = atomic_load(&sh->n_ops), c = 0;
    for (int i = 0; i < n; i++)
        c += sh->op_ns[i] >= a && sh->op_ns[i] < b;
    return c;
}

/* Wait (up to 5 s) until the stage did an op after t: it runs. */
static bool ran_after(int64_t t)
{
    for (int i = 0; i < 5000; i++) {
        int n = atomic_load(&sh->n_ops);
        if (n > 0 && sh->op_ns[n - 1] > t) return true;
        sleep_ms(1);
    }
    return false;
}

/* Hold the cores ms milliseconds: no op of the stage starts inside the claim (one already
 * past its gate may start right at it: it began 0.2 ms before), and it runs again after. */
static void claim_pauses(td_coreshare *cs, int ms, const char *what)
{
    td_coreshare_claim(cs);
    int64_t t_claim = td_now_ns();
    sleep_ms(ms);
    int64_t t_release = td_now_ns();
    td_coreshare_release(cs, 0, 0);
    int inside = ops_between(t_claim + MS, t_release);
    TH_CHECKF(inside == 0, "%d ops inside %s", inside, what);
    TH_CHECK(ran_after(t_release));
}

static void test_name(void)
{
    char a[96], b[96];
    td_coreshare_name(9000, a, sizeof a);
    td_coreshare_name(9001, b, sizeof b);
    TH_CHECK(a[0] == '/' && strstr(a, "9000") && strcmp(a, b) != 0);
}

/* A claim pauses the stage's ops; the release resumes them. The stage attached before the
 * decode existed (a later forward finds the segment). */
static void test_pause(void)
{
    atomic_store(&sh->n_ops, 0);
    pid_t pid = start_stage();
    TH_CHECK(ran_after(td_now_ns())); /* no segment yet: the gate never waits */
    td_coreshare *cs;
    TH_REQUIRE(td_coreshare_create(seg_name, false, &cs) == 0);
    sleep_ms(20); /* the stage's next forward attaches */
    for (int round = 0; round < 3; round++)
        claim_pauses(cs, 60, "the claim");
    TH_CHECK(atomic_load(&sh->parks) >= 3);
    stop_stage(pid);
    td_coreshare_destroy(cs);
}

/* The share after a step: period 0 -> as long as the step; period 100 ms after a 40 ms step
 * -> 60 ms; period 10 ms -> a quarter of the step (10 ms). With idle stages: no wait. */
static void test_share(void)
{
    atomic_store(&sh->n_ops, 0);
    td_coreshare *cs;
    TH_REQUIRE(td_coreshare_create(seg_name, false, &cs) == 0);
    pid_t pid = start_stage();
    sleep_ms(20);
    struct {
        double period, expect_ms;
    } cases[] = {{0, 40}, {100, 60}, {10, 10}};
    for (int i = 0; i < 3; i++) {
        /* the step as the decode measures it lies in [lo, hi] (a loaded machine may stall this
         * process around the calls): the share is at least the least it can be over that range,
         * and the wait for it runs from the release, which comes after t_rel */
        int64_t t_a = td_now_ns();
        td_coreshare_claim(cs);
        int64_t t_c = td_now_ns();
        sleep_ms(40);
        int64_t t_rel = td_now_ns();
        td_coreshare_release(cs, cases[i].period, 0);
        int64_t t_r1 = td_now_ns();
        double lo = (double)(t_rel - t_c) / 1e6, hi = (double)(t_r1 - t_a) / 1e6;
        double kink = cases[i].period * 0.8, least = 1e9;
        double steps[3] = {lo, hi, kink < lo ? lo : kink > hi ? hi : kink};
        for (int k = 0; k < 3; k++) {
            double p = cases[i].period, st = steps[k];
            double share = p <= 0 ? st : (p - st > st / 4 ? p - st : st / 4);
            if (share < least) least = share;
        }
        td_coreshare_claim(cs); /* the stage wants the cores: it gets its share first */
        double waited = (double)(td_now_ns() - t_rel) / 1e6;
        td_coreshare_release(cs, 0, 0);
        TH_CHECKF(waited >= least - 1 && waited <= cases[i].expect_ms + 500,
                  "period %.0f: waited %.1f ms, expected %.0f (at least %.1f)", cases[i].period,
                  waited, cases[i].expect_ms, least);
        sleep_ms(50);
    }
    /* the stage idle (no gate calls since before the last claim): the next waits for no one */
    atomic_store(&sh->run, 0);
    sleep_ms(20);
    td_coreshare_claim(cs);
    sleep_ms(40);
    td_coreshare_release(cs, 0, 0); /* a share of 40 ms, were the stage asking */
    td_coreshare_stats before = td_coreshare_get_stats(cs);
    td_coreshare_claim(cs);
    td_coreshare_release(cs, 0, 0);
    td_coreshare_stats after = td_coreshare_get_stats(cs);
    TH_CHECK(after.waits == before.waits && after.steps == before.steps + 1);
    TH_CHECK(after.steps == 8 && after.waits == 3);
    stop_stage(pid);
    td_coreshare_destroy(cs);
}

/* A decode that dies holding the claim: the stage resumes after TD_CORESHARE_STALE_MS. Then
 * a decode re-created under the same name pauses the stage again (a new inode, found at the next
 * forward). */
static void test_stale_and_restart(void)
{
    atomic_store(&sh->n_ops, 0);
    pid_t pid = start_stage();
    pid_t dec = fork();
    if (dec == 0) {
        td_coreshare *cs;
        if (td_coreshare_create(seg_name, false, &cs)) _exit(2);
        sleep_ms(30);
        td_coreshare_claim(cs);
        _exit(0); /* dies in its step: no release, no unlink */
    }
    int st;
    TH_CHECK(waitpid(dec, &st, 0) == dec && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    int64_t t_dead = td_now_ns();
    sleep_ms(50);
    int n_dead = ops_between(t_dead + 10 * MS, t_dead + 50 * MS);
    TH_CHECKF(n_dead == 0, "%d ops while the dead decode's claim was fresh", n_dead);
    TH_CHECK(ran_after(t_dead));
    int64_t resumed = sh->op_ns[atomic_load(&sh->n_ops) - 1];
    TH_CHECKF(resumed - t_dead >= (TD_CORESHARE_STALE_MS - 100) * MS,
              "resumed %.0f ms after the claim", (double)(resumed - t_dead) / 1e6);
    /* a restarted decode: unlink the dead one's segment (its name is reused), create anew */
    td_coreshare *old;
    TH_REQUIRE(td_coreshare_create(seg_name, false, &old) == 0);
    td_coreshare_destroy(old); /* unlinks */
    td_coreshare *cs;
    TH_REQUIRE(td_coreshare_create(seg_name, false, &cs) == 0);
    sleep_ms(30); /* the stage's next forward maps the new segment */
    claim_pauses(cs, 50, "the new decode's claim");
    stop_stage(pid);
    td_coreshare_destroy(cs);
}

/* A stage that died inside a forward (still counted computing, silent): after
 * TD_CORESHARE_STALE_MS without a stamp the decode no longer leaves it a share. */
static void test_dead_stage(void)
{
    td_coreshare *cs;
    TH_REQUIRE(td_coreshare_create(seg_name, false, &cs) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        const char *names[] = {seg_name};
        td_coreshare_gate *g;
        if (td_coreshare_gate_create(names, 1, &g)) _exit(2);
        td_coreshare_gate_begin(g);
        _exit(0); /* dies in its forward: never uncounted, never stamps */
    }
    int st;
    TH_CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    td_coreshare_claim(cs);
    sleep_ms(40);
    td_coreshare_release(cs, 100, 0); /* a share of 60 ms, were a live stage asking */
    int64_t t0 = td_now_ns();
    td_coreshare_claim(cs);
    double waited = (double)(td_now_ns() - t0) / 1e6;
    td_coreshare_release(cs, 0, 0);
    TH_CHECKF(waited < 30, "waited %.1f ms for a dead stage", waited);
    td_coreshare_destroy(cs);
}

static int ops_in_claims; /* test_auto: stage ops that started inside a claimed step */

/* One step as the decode runs it (claim, work, release against period): it takes ms_claimed
 * if it claimed the cores, else ms_left (the scheduler's stretch beside the stage,
 * simulated); the cost model predicts ms_claimed (the step's own size). Whether it claimed. */
static bool step_of(td_coreshare *cs, int ms_claimed, int ms_left, double period)
{
    uint64_t before = td_coreshare_get_stats(cs).steps;
    td_coreshare_claim(cs);
    bool claimed = td_coreshare_get_stats(cs).steps > before;
    int64_t t0 = td_now_ns();
    sleep_ms(claimed ? ms_claimed : ms_left);
    int64_t t1 = td_now_ns();
    td_coreshare_release(cs, period, ms_claimed);
    if (claimed) ops_in_claims += ops_between(t0 + MS, t1);
    return claimed;
}

/* n steps; how many claimed */
static int steps_of(td_coreshare *cs, int n, int ms_claimed, int ms_left, double period)
{
    int c = 0;
    for (int i = 0; i < n; i++)
        c += step_of(cs, ms_claimed, ms_left, period);
    return c;
}

/* share_cores: auto, beside a busy stage: one step in TD_CORESHARE_AUTO_PROBE_EVERY claims (a
 * probe) while it measures; it claims every step but one in TD_CORESHARE_AUTO_REVERSE_EVERY
 * only when the unclaimed steps are both stretched (TD_CORESHARE_AUTO_STRETCH over the probes)
 * and longer than the period; back when that ends. Beside an idle stage nothing claims. */
static void test_auto(void)
{
    enum { N = TD_CORESHARE_AUTO_SAMPLES, P = TD_CORESHARE_AUTO_PROBE_EVERY };
    const double period = 30;
    const int warm = N * P / (P - 1) + P; /* enough steps to fill both windows */
    atomic_store(&sh->n_ops, 0);
    td_coreshare *cs;
    TH_REQUIRE(td_coreshare_create(seg_name, true, &cs) == 0);
    pid_t pid = start_stage();
    sleep_ms(20);
    /* not stretched, short: probes only */
    int c = steps_of(cs, warm, 3, 3, period);
    TH_CHECKF(c == (warm + P - 1) / P, "short steps: %d of %d claimed", c, warm);
    /* stretched 3x but under the period: probes only */
    c = steps_of(cs, warm, 3, 9, period);
    TH_CHECKF(c == (2 * warm + P - 1) / P - (warm + P - 1) / P, "stretched short steps: %d claimed",
              c);
    /* past the period but hardly stretched (the step's own size): probes only */
    c = steps_of(cs, warm, 36, 40, period);
    td_coreshare_stats a = td_coreshare_get_stats(cs);
    TH_CHECKF(a.switches == 0 && c <= warm / P + 1,
              "long unstretched steps: %d claimed, %llu "
              "switches",
              c, (unsigned long long)a.switches);
    /* stretched and past the period: claiming once they are the windows' medians */
    int k = 0;
    while (k < 4 * N && td_coreshare_get_stats(cs).switches == 0) {
        step_of(cs, 15, 45, period);
        k++;
    }
    TH_CHECKF(td_coreshare_get_stats(cs).switches == 1,
              "stretched long steps: no claiming after "
              "%d",
              k);
    c = steps_of(cs, 40, 15, 45, period);
    TH_CHECKF(c >= 39, "claiming: %d of 40 claimed", c);
    /* the stage idle: nothing claims, nothing counts */
    atomic_store(&sh->run, 0);
    sleep_ms(30);
    a = td_coreshare_get_stats(cs);
    c = steps_of(cs, 8, 15, 45, period);
    td_coreshare_stats b = td_coreshare_get_stats(cs);
    TH_CHECKF(c == 0 && b.unclaimed == a.unclaimed + 8, "idle stage: %d claimed", c);
    /* busy again and the stretch gone: the reverse probes bring the steps back (short steps
     * and a short period, whose share after a claim is a quarter of the step, keep it quick) */
    atomic_store(&sh->run, 1);
    TH_CHECK(ran_after(td_now_ns()));
    int left = 0;
    for (int i = 0; i < 3 * TD_CORESHARE_AUTO_REVERSE_EVERY * N && left < 2 * P; i++)
        left += !step_of(cs, 1, 1, 0.5);
    TH_CHECKF(left >= 2 * P, "the stretch gone: still claiming (%d left)", left);
    TH_CHECKF(ops_in_claims == 0, "%d stage ops inside claimed steps", ops_in_claims);
    stop_stage(pid);
    td_coreshare_destroy(cs);
}

int main(void)
{
    sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) return 1;
    /* a name of its own per run: ports of real instances are below 65536 */
    td_coreshare_name(100000 + (int)getpid(), seg_name, sizeof seg_name);
    TH_RUN(test_name);
    TH_RUN(test_pause);
    TH_RUN(test_share);
    TH_RUN(test_stale_and_restart);
    TH_RUN(test_dead_stage);
    TH_RUN(test_auto);
    shm_unlink(seg_name);
    TH_EXIT();
}
