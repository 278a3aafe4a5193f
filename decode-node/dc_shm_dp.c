/* dc_shm_dp.c: the collectives of a data-parallel attention group (dc_shm.h: dc_shm_dp_*)
 * on the segment dc_shm.c runs: the members are the segment's ranks.
 *
 * Each operation (or each piece of one) takes the next parity of the partial slots and one
 * barrier, as dc_shm.c's all-reduce does, so the same reuse argument holds across all of
 * them: a rank writes parity p again only after every rank passed the barrier of the
 * operation in between, i.e. finished reading p. A member's rows (a gather) or the whole
 * gathered matrix (a reduce) larger than a slot travel in slot-sized pieces, the piece count
 * computed alike on every member from the counts. The size words tell the three operations
 * apart from each other and from the all-reduce and the column gather, so members that
 * disagree on the sequence break the group (TD_EINVAL) instead of mixing data. */
#include <string.h>

#include "dc_shm_int.h"
#include "td_clock.h"
#include "td_err.h"
#include "td_futex.h"
#include "td_tp.h"

#define WORD_COUNTS (-(INT64_C(3) << 60))
#define WORD_GATHER (-(INT64_C(2) << 60)) /* minus the gathered floats */
#define WORD_REDUCE (-(INT64_C(1) << 60)) /* minus the reduced floats */

/* Publish this member's size word for the operation of parity par and meet the others. */
static int meet(dc_shm *s, int par, int64_t word)
{
    atomic_store_explicit(&s->h->ranks[s->rank].n[par], word, memory_order_relaxed);
    int rc = dc_shm_barrier(s);
    return rc ? rc : dc_shm_check_sizes(s, par, word);
}

static int bad_counts(dc_shm *s, const int64_t *counts, int64_t n_cols, int64_t *n_all)
{
    int64_t N = 0;
    for (int q = 0; q < s->tp; q++) {
        if (counts[2 * q] < 0 || counts[2 * q + 1] < 0 || counts[2 * q + 1] > counts[2 * q] ||
            counts[2 * q] > (INT64_C(1) << 40))
            break;
        N += counts[2 * q];
        if (q == s->tp - 1 && n_cols > 0 && N <= (INT64_C(1) << 50) / n_cols) {
            *n_all = N;
            return 0;
        }
    }
    TD_LOG_ERR("dc_shm %s member %d: bad dp counts or width (%lld columns)", s->inst, s->rank,
               (long long)n_cols);
    return dc_shm_fail(s, TD_EINVAL);
}

int dc_shm_dp_counts(dc_shm *s, const int64_t mine[2], int64_t *all)
{
    int rc = dc_shm_check_usable(s, "dp counts");
    if (rc) return rc;
    if (mine[0] < 0 || mine[1] < 0 || mine[1] > mine[0]) {
        TD_LOG_ERR("dc_shm %s member %d: dp counts %lld rows, %lld solo", s->inst, s->rank,
                   (long long)mine[0], (long long)mine[1]);
        return dc_shm_fail(s, TD_EINVAL);
    }
    if (s->tp == 1) {
        all[0] = mine[0], all[1] = mine[1];
        return 0;
    }
    if (s->stride < 4) {
        TD_LOG_ERR("dc_shm %s: slots of %llu floats cannot carry dp counts", s->inst,
                   (unsigned long long)s->stride);
        return dc_shm_fail(s, TD_EINVAL);
    }
    int par = dc_shm_next_slot(s);
    if (par < 0) return s->err;
    float *slot = s->partial[par] + (size_t)s->rank * s->stride; /* stride >= 4 floats */
    memcpy(slot, mine, 2 * sizeof *mine);
    if ((rc = meet(s, par, WORD_COUNTS))) return rc;
    for (int q = 0; q < s->tp; q++)
        memcpy(all + 2 * q, s->partial[par] + (size_t)q * s->stride, 2 * sizeof *all);
    return 0;
}

/* Floats [f0, f1) of member q's rows (their order: its solo rows, then the others) into
 * their places in all; src holds float f0. */
static void place_rows(float *all, int64_t n_cols, int64_t at, int64_t rest_at, int64_t solo,
                       const float *src, int64_t f0, int64_t f1)
{
    const int64_t split = solo * n_cols; /* where its solo rows end */
    if (f0 < split) {
        int64_t e = f1 < split ? f1 : split;
        memcpy(all + at * n_cols + f0, src, (size_t)(e - f0) * sizeof *all);
        src += e - f0;
        f0 = e;
    }
    if (f0 < f1)
        memcpy(all + rest_at * n_cols + (f0 - split), src, (size_t)(f1 - f0) * sizeof *all);
}

int dc_shm_dp_gather(dc_shm *s, const float *mine, const int64_t *counts, int64_t n_cols,
                     float *all)
{
    int rc = dc_shm_check_usable(s, "dp gather");
    int64_t N = 0;
    if (rc || (rc = bad_counts(s, counts, n_cols, &N))) return rc;
    const int64_t S = (int64_t)s->stride, word = WORD_GATHER - N * n_cols;
    int64_t most = 0; /* the largest member's floats: the pieces */
    for (int q = 0; q < s->tp; q++)
        if (counts[2 * q] * n_cols > most) most = counts[2 * q] * n_cols;
    const int64_t own = counts[2 * s->rank] * n_cols;
    if (own > 0 && !mine) {
        TD_LOG_ERR("dc_shm %s member %d: dp gather of %lld rows without them", s->inst, s->rank,
                   (long long)counts[2 * s->rank]);
        return dc_shm_fail(s, TD_EINVAL);
    }
    if (s->tp == 1) {
        if (own > 0) memcpy(all, mine, (size_t)own * sizeof *all);
        return 0;
    }
    int64_t t0 = td_now_ns();
    const int64_t pieces = most > S ? (most + S - 1) / S : 1;
    for (int64_t k = 0; k < pieces; k++) {
        int par = dc_shm_next_slot(s);
        if (par < 0) return s->err;
        const int64_t f0 = k * S;
        if (own > f0)
            memcpy(s->partial[par] + (size_t)s->rank * s->stride, mine + f0,
                   (size_t)((own < f0 + S ? own : f0 + S) - f0) * sizeof *mine);
        if ((rc = meet(s, par, word))) return rc;
        for (int q = 0; q < s->tp; q++) {
            const int64_t fq = counts[2 * q] * n_cols;
            if (fq <= f0) continue;
            int64_t at, rest_at, n_all, n_solo;
            td_dp_layout(counts, s->tp, q, &at, &rest_at, &n_all, &n_solo);
            place_rows(all, n_cols, at, rest_at, counts[2 * q + 1],
                       s->partial[par] + (size_t)q * s->stride, f0, fq < f0 + S ? fq : f0 + S);
        }
    }
    s->st.ns_gather += (uint64_t)(td_now_ns() - t0);
    s->st.n_gather++;
    return 0;
}

int dc_shm_dp_reduce(dc_shm *s, const float *all, const int64_t *counts, int64_t n_cols,
                     float *mine)
{
    int rc = dc_shm_check_usable(s, "dp reduce");
    int64_t N = 0;
    if (rc || (rc = bad_counts(s, counts, n_cols, &N))) return rc;
    const int64_t total = N * n_cols, S = (int64_t)s->stride, word = WORD_REDUCE - total;
    if (total > 0 && !all) {
        TD_LOG_ERR("dc_shm %s member %d: dp reduce of %lld floats without them", s->inst, s->rank,
                   (long long)total);
        return dc_shm_fail(s, TD_EINVAL);
    }
    int64_t at, rest_at, n_all, n_solo;
    td_dp_layout(counts, s->tp, s->rank, &at, &rest_at, &n_all, &n_solo);
    const int64_t solo = counts[2 * s->rank + 1], rows = counts[2 * s->rank];
    /* this member's two float ranges of the gathered matrix and where they go in mine */
    const int64_t rng[2][3] = {{at * n_cols, (at + solo) * n_cols, 0},
                               {rest_at * n_cols, (rest_at + rows - solo) * n_cols, solo * n_cols}};
    if (s->tp == 1) {
        for (int i = 0; i < 2; i++)
            if (rng[i][1] > rng[i][0])
                memcpy(mine + rng[i][2], all + rng[i][0],
                       (size_t)(rng[i][1] - rng[i][0]) * sizeof *mine);
        return 0;
    }
    int64_t t0 = td_now_ns();
    const int64_t pieces = total > S ? (total + S - 1) / S : 1;
    for (int64_t k = 0; k < pieces; k++) {
        int par = dc_shm_next_slot(s);
        if (par < 0) return s->err;
        const int64_t f0 = k * S, f1 = total < f0 + S ? total : f0 + S;
        if (f1 > f0)
            memcpy(s->partial[par] + (size_t)s->rank * s->stride, all + f0,
                   (size_t)(f1 - f0) * sizeof *all);
        if ((rc = meet(s, par, word))) return rc;
        for (int i = 0; i < 2; i++) {
            int64_t a = rng[i][0] > f0 ? rng[i][0] : f0, b = rng[i][1] < f1 ? rng[i][1] : f1;
            if (b <= a) continue;
            const float *src[DC_SHM_MAX_TP];
            for (int q = 0; q < s->tp; q++)
                src[q] = s->partial[par] + (size_t)q * s->stride + (a - f0);
            dc_shm_reduce_sum(mine + rng[i][2] + (a - rng[i][0]), src, s->tp, b - a);
        }
    }
    s->st.ns_allreduce += (uint64_t)(td_now_ns() - t0);
    s->st.n_allreduce++;
    return 0;
}

/* ---- rounds: a member with rows wakes the idle ones ---- */

void dc_shm_dp_request(dc_shm *s, uint32_t round)
{
    dc_shm_hdr *h = s->h;
    uint32_t v = atomic_load(&h->dp_round);
    while ((int32_t)(round - v) > 0 && !atomic_compare_exchange_weak(&h->dp_round, &v, round)) {
    }
    if (atomic_load(&h->dp_round_waiters)) dc_shm_futex_wake(&h->dp_round);
}

bool dc_shm_dp_wanted(dc_shm *s, uint32_t joined, int64_t wait_ns)
{
    dc_shm_hdr *h = s->h;
    uint32_t v = atomic_load(&h->dp_round);
    if ((int32_t)(v - joined) > 0 || wait_ns <= 0 || s->err) return (int32_t)(v - joined) > 0;
    atomic_fetch_add(&h->dp_round_waiters, 1);
    v = atomic_load(&h->dp_round);
    if ((int32_t)(v - joined) <= 0) td_futex_wait(&h->dp_round, v, wait_ns, true);
    atomic_fetch_sub(&h->dp_round_waiters, 1);
    return (int32_t)(atomic_load(&h->dp_round) - joined) > 0;
}
