/* pl_calib_ar.c: `tandem calibrate`'s all-reduce measurement (pl_calib.h): tp rank processes
 * of the decode node's own shared-memory collective (dc_shm), each one thread, timing
 * all-reduces of one token's hidden state, as a decode step of batch 1 makes 2 a layer. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dc_shm.h"
#include "pl_calib.h"
#include "td_clock.h"
#include "td_err.h"

#define AR_WARMUP 200

/* One rank: join, warm up, time iters all-reduces; rank 0 stores the mean (us). */
static int ar_rank(const char *token, int rank, int tp, int n, int iters, double *out)
{
    dc_shm_params p = {.instance = "calib",
                       .token = token,
                       .rank = rank,
                       .tp = tp,
                       .max_floats = n,
                       .timeout_ms = 10000,
                       .op_timeout_ms = 10000};
    dc_shm *s;
    int rc = dc_shm_open(&p, &s);
    if (rc) return rc;
    float *buf = calloc((size_t)n, sizeof *buf);
    rc = buf ? 0 : TD_ENOMEM;
    for (int i = 0; i < AR_WARMUP && !rc; i++)
        rc = dc_shm_allreduce(s, buf, n);
    int64_t t0 = td_now_ns();
    for (int i = 0; i < iters && !rc; i++)
        rc = dc_shm_allreduce(s, buf, n);
    if (!rc && rank == 0) *out = (double)(td_now_ns() - t0) / 1e3 / iters;
    dc_shm_close(s);
    free(buf);
    return rc;
}

int pl_calib_allreduce(int tp, int n_floats, int iters, double *us)
{
    if (tp < 2 || tp > DC_SHM_MAX_TP || n_floats < 1 || iters < 1) return TD_EINVAL;
    double *res =
        mmap(NULL, sizeof *res, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (res == MAP_FAILED) return TD_ENOMEM;
    *res = -1;
    char token[64];
    snprintf(token, sizeof token, "calib%ld", (long)getpid());
    pid_t pids[DC_SHM_MAX_TP];
    int started = 0, rc = 0;
    fflush(NULL);
    for (int r = 0; r < tp; r++, started++) {
        pids[r] = fork();
        if (pids[r] < 0) {
            rc = TD_EIO;
            break;
        }
        if (pids[r] == 0) _exit(ar_rank(token, r, tp, n_floats, iters, res) ? 1 : 0);
    }
    for (int r = 0; r < started; r++) {
        int st;
        if (rc) kill(pids[r], SIGKILL);
        if (waitpid(pids[r], &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st)) rc = TD_EIO;
    }
    if (!rc && *res > 0) *us = *res;
    if (!rc && *res <= 0) rc = TD_EIO;
    munmap(res, sizeof *res);
    if (rc) TD_LOG_ERR("calibrate: the tp %d all-reduce measurement failed", tp);
    return rc;
}
