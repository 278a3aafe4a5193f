/* td_tp.h: how tensor parallelism divides the attention heads: the one rule the engine, the
 * decode node's KV pools and the KV transfer all follow; and how a data-parallel attention
 * group lays out its members' gathered rows (td_dp_layout), the rule the engine and the
 * group's collectives share.
 *
 * Rank r of tp holds query heads [q0, q0 + n_q), n_q = n_head / tp (tp must divide n_head),
 * and exactly the KV heads those query heads read under grouped-query attention (group =
 * n_head / n_head_kv query heads per KV head): [kv0, kv0 + n_kv) with kv0 = q0 / group and
 * kv0 + n_kv - 1 = (q0 + n_q - 1) / group.
 *   - tp divides n_head_kv: the KV ranges partition the KV heads (n_kv = n_head_kv / tp,
 *     every rank the same), the usual Megatron split.
 *   - otherwise (tp > n_head_kv, as vLLM allows, or a tp like 7 over 2 KV heads): ranks
 *     whose query heads read the same KV head each hold a copy of it (replication), and
 *     counts may differ between ranks (Qwen2.5 0.5B, 14 heads over 2 KV heads, at tp 7:
 *     rank 3 holds query heads 6, 7 and both KV heads, the others one). Each copy is
 *     computed by its rank (K/V projection rows of that head) and filled by the KV transfer
 *     (each decode rank receives the heads of its range, shared ones included).
 * Inside a rank, local query head h reads local KV head (phase + h) / group, where phase =
 * q0 - kv0 * group (0 when tp divides n_head_kv).
 */
#ifndef TD_TP_H
#define TD_TP_H

#include <stdint.h>

typedef struct {
    int q0, n_q;   /* query heads [q0, q0 + n_q) */
    int kv0, n_kv; /* KV heads [kv0, kv0 + n_kv) */
    int group;     /* query heads per KV head (the model's) */
    int phase;     /* q0 - kv0 * group: local query head h reads local KV head (phase+h)/group */
} td_tp_heads;

/* The heads of rank `rank` of `tp`. TD_EINVAL (nothing written) unless n_head_kv > 0
 * divides n_head > 0, tp >= 1 divides n_head and 0 <= rank < tp. */
int td_tp_heads_of_rank(int n_head, int n_head_kv, int tp, int rank, td_tp_heads *out);

/* The largest n_kv of any rank (the KV pool of every rank is sized for it, so that all
 * ranks of an instance have the same number of blocks under one memory budget). 0 when
 * the arguments are invalid. */
int td_tp_max_kv_heads(int n_head, int n_head_kv, int tp);

/* Data-parallel attention's gathered rows, solo-first: counts[2q] is member q's rows and
 * counts[2q + 1] its leading solo rows (decode rows computed as if alone), q < dp. Every
 * member's solo rows come before any other row, each kind in member order: member r's solo
 * rows at [*solo_at, *solo_at + counts[2r + 1]), its other rows at [*rest_at, *rest_at +
 * counts[2r] - counts[2r + 1]); *n_all the rows of all members, *n_solo their solo rows. */
static inline void td_dp_layout(const int64_t *counts, int dp, int r, int64_t *solo_at,
                                int64_t *rest_at, int64_t *n_all, int64_t *n_solo)
{
    int64_t S = 0, N = 0, s_before = 0, r_before = 0;
    for (int q = 0; q < dp; q++) {
        if (q == r) s_before = S, r_before = N - S;
        S += counts[2 * q + 1];
        N += counts[2 * q];
    }
    *solo_at = s_before;
    *rest_at = S + r_before;
    *n_all = N;
    *n_solo = S;
}

#endif
