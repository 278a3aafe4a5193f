/* td_tp.c: the tensor-parallel head rule (td_tp.h). */
#include "td_tp.h"

#include "td_err.h"

int td_tp_heads_of_rank(int n_head, int n_head_kv, int tp, int rank, td_tp_heads *out)
{
    if (n_head <= 0 || n_head_kv <= 0 || n_head % n_head_kv || tp < 1 || n_head % tp || rank < 0 ||
        rank >= tp)
        return TD_EINVAL;
    const int group = n_head / n_head_kv, n_q = n_head / tp, q0 = rank * n_q;
    const int kv0 = q0 / group, kv_last = (q0 + n_q - 1) / group;
    *out = (td_tp_heads){.q0 = q0,
                         .n_q = n_q,
                         .kv0 = kv0,
                         .n_kv = kv_last - kv0 + 1,
                         .group = group,
                         .phase = q0 - kv0 * group};
    return 0;
}

int td_tp_max_kv_heads(int n_head, int n_head_kv, int tp)
{
    int best = 0;
    for (int r = 0; r < tp; r++) {
        td_tp_heads h;
        if (td_tp_heads_of_rank(n_head, n_head_kv, tp, r, &h)) return 0;
        if (h.n_kv > best) best = h.n_kv;
    }
    return best;
}
