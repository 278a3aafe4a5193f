/* model_split.c: how a shard divides the model (kernels/model.h kn_shard): the checks of a
 * layer range, a tensor-parallel split, expert parallelism and a data-parallel attention
 * group against the model's shape, and the FFN widths a tp rank holds. Part of the loader
 * (model_load_int.h). */
#include "model_load_int.h"
#include "td_err.h"

int kn_ld_check_split(const kn_hparams *hp, const kn_shard *s)
{
    if (s->l0 < 0 || s->l0 >= s->l1 || s->l1 > hp->n_layer + (s->mtp ? 1 : 0)) {
        TD_LOG_ERR("bad layer range [%d, %d) for a model of %d layers", s->l0, s->l1, hp->n_layer);
        return TD_EINVAL;
    }
    if (s->tp_size < 1 || s->tp_rank < 0 || s->tp_rank >= s->tp_size) {
        TD_LOG_ERR("bad tensor-parallel rank %d of %d", s->tp_rank, s->tp_size);
        return TD_EINVAL;
    }
    if (hp->qk_norm_whole && s->tp_size > 1) {
        TD_LOG_ERR("tp %d: %s normalizes Q and K over every head at once, which a split "
                   "shard cannot; run it at tp 1",
                   s->tp_size, kn_arch_name(hp->arch));
        return TD_EUNSUPP;
    }
    if (hp->n_head % s->tp_size) {
        TD_LOG_ERR("tp %d does not divide the %d attention heads", s->tp_size, hp->n_head);
        return TD_EUNSUPP;
    }
    if (hp->n_vocab < s->tp_size) {
        TD_LOG_ERR("tp %d exceeds the %d vocabulary rows of the LM head", s->tp_size, hp->n_vocab);
        return TD_EUNSUPP;
    }
    if (s->ep && hp->n_expert < s->tp_size) {
        if (!hp->n_expert)
            TD_LOG_ERR("ep: the model (%s) has no experts to divide among the ranks",
                       kn_arch_name(hp->arch));
        else
            TD_LOG_ERR("ep %d: the model has %d experts, fewer than the ranks to divide them "
                       "among",
                       s->tp_size, hp->n_expert);
        return TD_EUNSUPP;
    }
    if (s->dp_size < 1 || s->dp_rank < 0 || s->dp_rank >= s->dp_size) {
        TD_LOG_ERR("bad data-parallel member %d of %d", s->dp_rank, s->dp_size);
        return TD_EINVAL;
    }
    if (s->dp_size > 1 && (s->tp_size > 1 || s->ep || s->mtp)) {
        TD_LOG_ERR("dp attention %d: every tensor but the experts is whole on a member; "
                   "tp %d%s%s cannot split it as well",
                   s->dp_size, s->tp_size, s->ep ? ", ep" : "", s->mtp ? ", an MTP block" : "");
        return TD_EUNSUPP;
    }
    if (s->dp_size > 1 && hp->n_expert < s->dp_size) {
        if (!hp->n_expert)
            TD_LOG_ERR("dp attention: the model (%s) has no experts to divide among the members; "
                       "run separate instances",
                       kn_arch_name(hp->arch));
        else
            TD_LOG_ERR("dp attention %d: the model has %d experts, fewer than the members",
                       s->dp_size, hp->n_expert);
        return TD_EUNSUPP;
    }
    if (!kn_ld_ffn_splits(hp->n_ff, s->tp_size, "ffn") ||
        (hp->n_expert && !s->ep && !kn_ld_ffn_splits(hp->n_ff_exp, s->tp_size, "expert ffn")) ||
        (hp->n_ff_shexp && !kn_ld_ffn_splits(hp->n_ff_shexp, s->tp_size, "shared expert ffn")))
        return TD_EUNSUPP;
    return 0;
}

bool kn_ld_ffn_splits(int n_ff, int tp, const char *what)
{
    if (n_ff % tp == 0 || (n_ff % TD_QK == 0 && n_ff / TD_QK >= tp)) return true;
    TD_LOG_ERR("tp %d splits neither the %s width %d evenly nor into whole %d-blocks", tp, what,
               n_ff, TD_QK);
    return false;
}

/* Ranks differ by one block at most in the uneven case. */
void kn_ld_ffn_split(int n_ff, const kn_shard *s, int *f0, int *nf)
{
    int tp = s->tp_size, r = s->tp_rank;
    if ((n_ff % tp == 0 && (n_ff / tp) % TD_QK == 0) || n_ff % TD_QK) {
        *nf = n_ff / tp;
        *f0 = r * *nf;
        return;
    }
    int64_t nb = n_ff / TD_QK;
    int64_t b0 = r * nb / tp, b1 = (r + 1) * nb / tp;
    *f0 = (int)(b0 * TD_QK);
    *nf = (int)((b1 - b0) * TD_QK);
}
