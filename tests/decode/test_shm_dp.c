/* test_shm_dp.c: the data-parallel attention group's collectives on the shared-memory segment
 * (dc_shm_dp_counts / dp_gather / dp_reduce), members as threads of this process.
 *
 * For 1..4 members and 60 rounds of random row counts (members with none, members with only
 * solo rows, wide and narrow rows): every member gets every member's counts, the gathered
 * rows in td_dp_layout's places, and its own rows of the reduce summed over the members,
 * exactly (small integers). Slots of 96 floats make most rounds travel in pieces. A member
 * that gathers while another reduces breaks the group on both (TD_EINVAL).
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../tharness.h"
#include "dc_shm.h"
#include "td_err.h"
#include "td_tp.h"

#define MAX_DP 4
#define ROUNDS 60
#define MAXF   96 /* floats a slot: small, so the pieces run */
#define MAXR   40 /* rows a member */
#define MAXC   24 /* columns */

typedef struct {
    char token[64];
    int dp;
    bool mismatch;
    int fails[MAX_DP], rc[MAX_DP];
} group;

typedef struct {
    group *g;
    int rank;
} member_arg;

/* The round's counts and width, the same on every member (a shared seed). */
static void round_shape(int dp, int it, int64_t *counts, int64_t *n_cols)
{
    uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(it + 1);
    for (int q = 0; q < dp; q++) {
        x ^= x >> 29, x *= 0xbf58476d1ce4e5b9ull, x ^= x >> 32;
        int64_t rows = (int64_t)(x % 4 == 0 ? 0 : x % (MAXR + 1));
        int64_t solo = (int64_t)((x >> 8) % (uint64_t)(rows + 1));
        if (it % 7 == 3) solo = rows; /* decode rows only */
        counts[2 * q] = rows, counts[2 * q + 1] = solo;
    }
    *n_cols = 1 + (int64_t)((x >> 16) % MAXC);
}

static float val(int q, int64_t row, int64_t col)
{
    return (float)((q * 31 + row * 7 + col) % 17);
}

static int member_rounds(group *g, dc_shm *s, int r)
{
    int fails = 0;
    float *mine = malloc(MAXR * MAXC * sizeof *mine), *all = malloc(MAX_DP * MAXR * MAXC * 4);
    float *back = malloc(MAXR * MAXC * sizeof *back);
    for (int it = 0; it < ROUNDS && !fails; it++) {
        int64_t want[2 * MAX_DP], got[2 * MAX_DP], nc;
        round_shape(g->dp, it, want, &nc);
        if (dc_shm_dp_counts(s, &want[2 * r], got)) return 1;
        fails += memcmp(got, want, (size_t)(2 * g->dp) * sizeof *got) != 0;
        const int64_t rows = want[2 * r];
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < nc; j++)
                mine[i * nc + j] = val(r, i, j);
        if (dc_shm_dp_gather(s, mine, want, nc, all)) return 1;
        int64_t N = 0;
        for (int q = 0; q < g->dp; q++) {
            int64_t at, rest_at, n_all, n_solo;
            td_dp_layout(want, g->dp, q, &at, &rest_at, &n_all, &n_solo);
            N = n_all;
            for (int64_t i = 0; i < want[2 * q]; i++) {
                int64_t to = i < want[2 * q + 1] ? at + i : rest_at + i - want[2 * q + 1];
                for (int64_t j = 0; j < nc; j++)
                    fails += all[to * nc + j] != val(q, i, j);
            }
        }
        /* each member's contribution: the gathered matrix times (member + 1) */
        for (int64_t k = 0; k < N * nc; k++)
            all[k] *= (float)(r + 1);
        if (dc_shm_dp_reduce(s, all, want, nc, back)) return 1;
        const float scale = (float)(g->dp * (g->dp + 1) / 2);
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < nc; j++)
                fails += back[i * nc + j] != scale * val(r, i, j);
        if (fails) fprintf(stderr, "member %d of %d: round %d wrong\n", r, g->dp, it);
    }
    free(mine);
    free(all);
    free(back);
    return fails;
}

static void *member_main(void *v)
{
    member_arg *a = v;
    group *g = a->g;
    dc_shm_params p = {.instance = "dpgroup",
                       .token = g->token,
                       .rank = a->rank,
                       .tp = g->dp,
                       .max_floats = MAXF,
                       .timeout_ms = 10000,
                       .op_timeout_ms = 10000};
    dc_shm *s;
    if ((g->rc[a->rank] = dc_shm_open(&p, &s))) {
        g->fails[a->rank]++;
        return NULL;
    }
    if (g->mismatch) {
        int64_t counts[4] = {2, 0, 2, 0};
        float buf[2 * 2 * 4] = {0}, out[2 * 4];
        g->rc[a->rank] = a->rank == 0 ? dc_shm_dp_gather(s, buf, counts, 4, buf)
                                      : dc_shm_dp_reduce(s, buf, counts, 4, out);
    } else {
        g->fails[a->rank] += member_rounds(g, s, a->rank);
    }
    dc_shm_close(s);
    return NULL;
}

static void run_group(group *g)
{
    pthread_t th[MAX_DP];
    member_arg a[MAX_DP];
    for (int r = 0; r < g->dp; r++) {
        a[r] = (member_arg){.g = g, .rank = r};
        pthread_create(&th[r], NULL, member_main, &a[r]);
    }
    for (int r = 0; r < g->dp; r++)
        pthread_join(th[r], NULL);
}

static void test_rounds(void)
{
    for (int dp = 1; dp <= MAX_DP; dp++) {
        group g = {.dp = dp};
        snprintf(g.token, sizeof g.token, "dp%d-%d", (int)getpid(), dp);
        run_group(&g);
        for (int r = 0; r < dp; r++)
            TH_CHECKF(g.fails[r] == 0 && g.rc[r] == 0, "dp %d member %d: %d fails, rc %d", dp, r,
                      g.fails[r], g.rc[r]);
    }
}

static void test_mismatch(void)
{
    group g = {.dp = 2, .mismatch = true};
    snprintf(g.token, sizeof g.token, "dpm-%d", (int)getpid());
    run_group(&g);
    TH_CHECKF(g.rc[0] == TD_EINVAL && g.rc[1] == TD_EINVAL, "%d, %d", g.rc[0], g.rc[1]);
}

int main(void)
{
    TH_RUN(test_rounds);
    TH_RUN(test_mismatch);
    TH_EXIT();
}
