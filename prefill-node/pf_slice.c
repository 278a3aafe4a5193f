/* pf_slice.c: how a prefill stage slices its KV pool's heads (kvmem/kv_pool.h) for the
 * decode instances it pushes to: the router may pair a prefill instance with any decode
 * instance of the cluster, so the cut is kvx_layout_slice's over the KV head range of every
 * rank of every decode instance (common/td_tp.h): each rank's heads are then a union of
 * slices, and a rank whose heads are one slice gets its KV without a staging pass. A rank
 * spanning several slices (a tp 1 instance next to a tp 3 one, or ranks sharing replicated
 * KV heads) still has its pieces gathered per block: one layout cannot serve both without
 * staging, and the cut favours the split ranks (a head-major pool favoured the tp 1 ones).
 * TANDEM_PF_KV_SLICED=0 keeps the pool head-major whatever the ranks (for A/B runs of the
 * two layouts in one build, tools/bench_disagg.py --head-major); unset or 1: sliced. */
#include <stdlib.h>
#include <string.h>

#include "pf_int.h"
#include "td_err.h"
#include "td_tp.h"

_Static_assert(KN_KV_MAX_SLICES == KVX_MAX_SLICES, "kv pool slices are kvxfer's source slices");

int pf_stage_slicing(const td_cfg *cfg, const char *who, int *n_slices, int *slice_heads)
{
    *n_slices = 0; /* head-major unless a decode rank holds a part of the heads */
    const char *env = getenv("TANDEM_PF_KV_SLICED");
    if (env && strcmp(env, "1")) {
        if (strcmp(env, "0")) {
            TD_LOG_ERR("%s: TANDEM_PF_KV_SLICED must be 0 or 1, not '%s'", who, env);
            return TD_EINVAL;
        }
        TD_LOG_INFO("%s: TANDEM_PF_KV_SLICED=0: the KV pool stays head-major", who);
        return 0;
    }
    kn_hparams hp;
    int rc = pf_model_hparams(cfg->model, &hp);
    if (rc) return rc;
    const int n_head = hp.n_head, n_kv = hp.n_head_kv;
    int n = 0;
    for (int i = 0; i < cfg->n_decode; i++)
        n += cfg->decode[i].tp;
    uint32_t *ranges = malloc((size_t)n * 2 * sizeof *ranges);
    if (!ranges) return TD_ENOMEM;
    n = 0;
    for (int i = 0; i < cfg->n_decode && !rc; i++)
        for (int r = 0; r < cfg->decode[i].tp && !rc; r++) {
            td_tp_heads h;
            if ((rc = td_tp_heads_of_rank(n_head, n_kv, cfg->decode[i].tp, r, &h))) {
                TD_LOG_ERR("%s: decode instance %s: tp %d does not divide the model's %d heads",
                           who, cfg->decode[i].name, cfg->decode[i].tp, n_head);
                break;
            }
            ranges[2 * n] = (uint32_t)h.kv0;
            ranges[2 * n + 1] = (uint32_t)(h.kv0 + h.n_kv);
            n++;
        }
    kvx_layout l = {.n_kv_heads = (uint32_t)n_kv, .head0 = 0, .n_heads = (uint32_t)n_kv};
    if (!rc && (rc = kvx_layout_slice(&l, ranges, (uint32_t)n)) == TD_ERANGE) {
        TD_LOG_INFO("%s: the decode ranks' head ranges need more than %d slices: the KV pool "
                    "stays head-major (kvxfer stages the pieces of tp > 1 ranks)",
                    who, KVX_MAX_SLICES);
        rc = 0;
    } else if (!rc && l.n_slices > 1) {
        *n_slices = (int)l.n_slices;
        for (uint32_t s = 0; s < l.n_slices; s++)
            slice_heads[s] = (int)l.slice_heads[s];
    }
    free(ranges);
    return rc;
}
