/* dc_node_xfer.c: the decode leader's KV-transfer plane of one formation (disaggregated
 * mode): every rank's pool as this process reaches it (rank 0's own, the followers' named
 * segments mapped here), with the file each is a mapping of, so that a prefill stage on this
 * host can map them too (kvx_dec_register_fd), and the dc_xfer connectors over them.
 * This file owns the node's dc_kvplane part (dc_node_int.h). */
#include <stdlib.h>
#include <unistd.h>

#include "dc_node_int.h"
#include "td_err.h"

/* Disaggregated mode: map the followers' pools of this formation (their segments exist:
 * each follower makes one before it joins) and start the KV-transfer plane over every
 * rank's pool. */
int dc_node_xfer_setup(dc_node *n)
{
    dc_kvplane *pl = &n->plane;
    int tp = n->dcfg->tp;
    const kn_hparams *hp = &n->proc.rt.model->hp;
    kn_kv_pool_params kp = kn_model_kv_params(n->proc.rt.model, dc_kv(n)->n_blocks,
                                              dc_kv(n)->block_size, dc_kv(n)->type);
    kp.backend = &n->proc.rt.be; /* a device's pools are host copies with flags (kv_pool.h) */
    kp.host_stage = true;
    pl->peer_regions = calloc((size_t)tp, sizeof *pl->peer_regions);
    pl->peer_bytes = calloc((size_t)tp, sizeof *pl->peer_bytes);
    pl->peer_fds = malloc((size_t)tp * sizeof *pl->peer_fds);
    if (!pl->peer_regions || !pl->peer_bytes || !pl->peer_fds) return TD_ENOMEM;
    for (int r = 0; r < tp; r++)
        pl->peer_fds[r] = -1;
    pl->peer_regions[0] = kn_kv_xfer_region(dc_kv(n));
    pl->peer_fds[0] = kn_kv_pool_fd(dc_kv(n));
    pl->peer_bytes[0] = dc_kv(n)->region_bytes + (dc_kv(n)->host ? (size_t)dc_kv(n)->n_blocks : 0);
    for (int r = 1; r < tp; r++) {
        char name[256];
        int rc = dc_xfer_kv_shm_name(n->p->instance, n->proc.token, r,
                                     dc_shm_rank_pid(n->form.shm, r), name, sizeof name);
        td_tp_heads heads; /* rank r's pool holds its own number of KV heads */
        if (!rc) rc = td_tp_heads_of_rank(hp->n_head, hp->n_head_kv, tp, r, &heads);
        kp.n_kv_heads = heads.n_kv;
        kp.shm_name = name;
        /* unlink at once: from now on the memory lives exactly as long as its mappings */
        if (!rc)
            rc = kn_kv_region_map(&kp, true, &pl->peer_regions[r], &pl->peer_bytes[r],
                                  &pl->peer_fds[r]);
        if (rc) {
            TD_LOG_ERR("decode %s: cannot map rank %d's KV pool: %s", n->p->instance, r,
                       td_strerror(rc));
            return rc;
        }
    }
    dc_xfer_params xp = {
        .instance = n->p->instance,
        .tp = tp,
        .regions = pl->peer_regions,
        .region_bytes = pl->peer_bytes,
        .region_fds = pl->peer_fds,
        .n_layers = (uint32_t)hp->n_layer,
        .n_heads = (uint32_t)hp->n_head,
        .n_kv_heads = (uint32_t)hp->n_head_kv,
        .head_dim = (uint32_t)hp->head_dim,
        .block_size = (uint32_t)dc_kv(n)->block_size,
        .dtype_size = dc_kv(n)->type == TD_F16 ? 2 : 4,
        .n_blocks = (uint32_t)dc_kv(n)->n_blocks,
        .latent = dc_kv(n)->layout == KN_KV_LAYOUT_LATENT,
        .tls = n->p->cfg->kvxfer.ucx_tls,
        /* a replica started from a template is reached at its --advertise host, not the
           template's: its KV plane listens on that host's device */
        .host = n->p->advertise ? n->p->advertise : n->dcfg->host,
        .timeout_ms = n->p->cfg->kvxfer.timeout_ms,
        .staged = dc_kv(n)->host != NULL,
    };
    return dc_xfer_create(&xp, &pl->xfer);
}

/* Leader: the KV-transfer plane of a formation and its mappings of the followers' pools.
 * Only once no transfer is alive (dc_xfer.h: the regions are borrowed until destroy, and
 * a writer may still write into them before its transfer is final). */
void dc_node_xfer_teardown(dc_node *n)
{
    dc_kvplane *pl = &n->plane;
    dc_xfer_destroy(pl->xfer); /* the connectors first: they have the pools registered */
    for (int r = 1; pl->peer_regions && r < n->dcfg->tp; r++) {
        kn_kv_region_unmap(pl->peer_regions[r], pl->peer_bytes[r]);
        if (pl->peer_fds[r] >= 0) close(pl->peer_fds[r]);
    }
    free(pl->peer_regions);
    free(pl->peer_bytes);
    free(pl->peer_fds);
    *pl = (dc_kvplane){0};
}
