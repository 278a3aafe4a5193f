/* pl_calib_kvx.c: `tandem calibrate`'s KV transfer figures (pl_calib.h): kvx-bench, the
 * kvxfer loopback benchmark built beside the tandem binary, run in the model's KV shape over
 * shared memory and over TCP (one decode rank, no ucx_perftest), its medians parsed. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pl_calib.h"
#include "td_err.h"

/* kvx-bench next to this executable, into path; 0 or TD_ENOENT. */
static int find_bench(char *path, size_t cap)
{
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return TD_ENOENT;
    self[n] = 0;
    char *slash = strrchr(self, '/');
    if (!slash) return TD_ENOENT;
    *slash = 0;
    if ((size_t)snprintf(path, cap, "%s/kvx-bench", self) >= cap) return TD_ENOENT;
    return access(path, X_OK) == 0 ? 0 : TD_ENOENT;
}

/* One run over tls: GB/s of a 4096-token chunk and the latency of a one-block chunk. */
static int run_bench(const char *bench, const char *tls, const kn_hparams *hp, double *gbps,
                     double *lat_us)
{
    char cmd[PATH_MAX + 256];
    snprintf(cmd, sizeof cmd,
             "timeout 120 '%s' --tls %s --dst-ranks 1 --no-perftest --layers %d --heads %d "
             "--head-dim %d 2>/dev/null",
             bench, tls, hp->n_layer, hp->n_head_kv, hp->head_dim);
    FILE *f = popen(cmd, "r");
    if (!f) return TD_EIO;
    char line[512];
    int got = 0;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "kvxfer: %lf GB/s median", gbps) == 1) got |= 1;
        if (sscanf(line, "1-block chunk (%*d bytes): %lf us median", lat_us) == 1) got |= 2;
    }
    int st = pclose(f);
    return st == 0 && got == 3 && *gbps > 0 && *lat_us > 0 ? 0 : TD_EIO;
}

int pl_calib_kvx(const kn_hparams *hp, pl_calib_result *r)
{
    char bench[PATH_MAX];
    int rc = find_bench(bench, sizeof bench);
    if (rc) {
        TD_LOG_WARN("calibrate: no kvx-bench beside this binary: KV transfer figures from "
                    "BENCHMARKS.md");
        return rc;
    }
    double g[2], l[2];
    if ((rc = run_bench(bench, "sm", hp, &g[0], &l[0])) ||
        (rc = run_bench(bench, "tcp", hp, &g[1], &l[1]))) {
        TD_LOG_WARN("calibrate: kvx-bench failed: KV transfer figures from BENCHMARKS.md");
        return rc;
    }
    for (int i = 0; i < 2; i++) {
        r->kvx_gbps[i] = g[i];
        r->kvx_lat_us[i] = l[i];
    }
    r->kvx_measured = 1;
    return 0;
}
