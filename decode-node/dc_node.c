/* dc_node.c: a decode rank's life: load the shard, then form the instance with its sibling
 * ranks, run steps until the instance breaks or stops, and form it again (dc_node.h has
 * the leader's states). The leader's serving loop (its steps) is in dc_loop.c, its control
 * plane (requests in, events out) in dc_serve.c, its figures at exit in dc_report.c. This
 * file owns the node's parts dc_proc, dc_formation, dc_life and dc_leader (dc_node_int.h),
 * and makes and frees every part in teardown's order. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "act_check.h"
#include "cpu_backend.h"
#include "cpu_pool.h"
#include "dc_node_int.h"
#include "dc_plan.h"
#include "kn_backends.h"
#include "td_clock.h"
#include "td_err.h"
#include "tokenizer.h"

#define FORM_WAIT_MS  50    /* forming: one wait for the missing ranks (then the inbox again) */
#define DRAIN_WAIT_MS 10    /* forming, every rank in: one inbox wait while old transfers end */
#define RETRY_MS      1000  /* forming: pause after a failed attempt (segment, KV plane) */
#define FORM_LOG_MS   10000 /* forming: say what it waits for this often */
#define STOP_DRAIN_MS 500   /* after SIGTERM with requests in flight: errors get out */
#define STOP_XFER_MS  3000  /* ... and longer, up to this, while aborted transfers still end */
/* a follower stopped on its own SIGTERM: this rank's own signal may follow within this */
#define PEER_STOP_GRACE_MS 500

/* Interrupted early by a signal (no SA_RESTART): SIGTERM ends the pause at once. */
static void sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

/* ---- setup ---- */

static int kv_blocks_of(const dc_node *n)
{
    if (n->dcfg->kv_blocks > 0)
        return (int)(n->dcfg->kv_blocks > (1 << 30) ? 1 << 30 : n->dcfg->kv_blocks);
    /* every rank sizes its blocks for the rank that holds the most KV heads, so that all
     * ranks get the same number of blocks (the leader's block ids index every pool) */
    const kn_hparams *hp = &n->proc.rt.model->hp;
    kn_kv_pool_params kp =
        kn_model_kv_params(n->proc.rt.model, 1, n->dcfg->block_size, n->dcfg->kv_dtype);
    kp.n_kv_heads = td_tp_max_kv_heads(hp->n_head, hp->n_head_kv, n->dcfg->tp);
    /* K and V, or a latent pool's one array (half the bytes: twice the blocks) */
    size_t per_block = kn_kv_pool_params_block_bytes(&kp);
    if (!per_block) return 0;
    int64_t nb = n->dcfg->kv_memory / (int64_t)per_block;
    return nb > (1 << 30) ? 1 << 30 : (int)nb;
}

/* The engine's collective: the current formation's segment. A forward pass only runs
 * inside a formation, so "no segment" is a bug caught here rather than a crash. */
static int node_allreduce(void *ctx, float *buf, int64_t n_floats)
{
    dc_node *n = ctx;
    return n->form.shm ? dc_shm_allreduce(n->form.shm, buf, n_floats) : TD_ESTATE;
}

/* Two-batch overlap's halves of the allreduce (kernels/forward_tbo.c). */
static int node_allreduce_post(void *ctx, const float *buf, int64_t n_floats, uint64_t *ticket)
{
    dc_node *n = ctx;
    return n->form.shm ? dc_shm_allreduce_post(n->form.shm, buf, n_floats, ticket) : TD_ESTATE;
}

static int node_allreduce_wait(void *ctx, uint64_t ticket, float *buf, int64_t n_floats)
{
    dc_node *n = ctx;
    return n->form.shm ? dc_shm_allreduce_wait(n->form.shm, ticket, buf, n_floats) : TD_ESTATE;
}

/* The LM head's logit slices to the leader, which samples (followers pass out NULL). */
static int node_gather_cols(void *ctx, const float *part, int64_t rows, int64_t n_cols, float *out)
{
    dc_node *n = ctx;
    return n->form.shm ? dc_shm_gather_cols(n->form.shm, part, rows, n_cols, out) : TD_ESTATE;
}

/* The process's part (dc_proc): the model, the KV memory, the rendezvous' parameters. */
static int proc_init(dc_node *n)
{
    const dc_node_params *p = n->p;
    char who[96];
    snprintf(who, sizeof who, "decode %s rank %d", p->instance, p->rank);
    kn_collective coll = {.ctx = n,
                          .allreduce_sum = node_allreduce,
                          .gather_cols = node_gather_cols,
                          .allreduce_post = node_allreduce_post,
                          .allreduce_wait = node_allreduce_wait};
    dc_group_collective(n, &coll); /* a dp group's calls (dc_group.c) */
    kn_runtime_params rp = {
        .model_path = p->cfg->model,
        .shard = {.tp_rank = p->rank,
                  .tp_size = n->dcfg->tp,
                  .ep = n->dcfg->ep > 1,
                  .dp_rank = n->dcfg->dp_rank,
                  .dp_size = n->dcfg->dp},
        .backend = td_cfg_backend_name(p->cfg->backend),
        .backend_opts = {.n_threads = n->dcfg->threads,
                         .device = n->dcfg->devices ? n->dcfg->devices[p->rank] : -1,
                         .rank = p->rank,
                         .cpu_act = td_cfg_act_name(p->cfg->cpu_act)},
        .coll = &coll,
        .who = who};
    int rc = kn_act_runtime_open(&n->proc.rt, &rp);
    if (rc) return rc;
    if (n->dcfg->tbo_min_tokens &&
        (rc = kn_engine_set_tbo(n->proc.rt.engine, n->dcfg->tbo_min_tokens)))
        return rc;
    int n_blocks = kv_blocks_of(n);
    if (n_blocks < 1) {
        TD_LOG_ERR("decode %s: kv_memory %lld bytes holds no block", p->instance,
                   (long long)n->dcfg->kv_memory);
        return TD_EINVAL;
    }
    td_dtype kv_type = n->dcfg->kv_dtype;
    /* the pool's shape (kn_kv_mem keeps a copy; the leader maps followers' pools by its own) */
    kn_kv_pool_params kvp =
        kn_model_kv_params(n->proc.rt.model, n_blocks, n->dcfg->block_size, kv_type);
    kvp.backend = &n->proc.rt.be;
    snprintf(n->proc.token, sizeof n->proc.token, "p%d", n->dcfg->port);
    /* disaggregated: the leader receives every rank's KV (dc_xfer.h), so a follower's pool
     * is shared memory the leader maps after each rendezvous (it is created before, so it
     * exists once the rendezvous completes). On a device backend the KV lands in the pool's
     * host staging copy, and each rank's engine uploads a request's received blocks before
     * its first step reads them (kv_pool.h) */
    n->proc.disagg = p->cfg->n_prefill > 0;
    kvp.host_stage = n->proc.disagg;
    /* rank 0's own pool: a memfd, so a prefill stage on this host maps it and copies its KV
     * in (kvx_dec_register_fd); followers' pools are named segments, below */
    kvp.fd_backed = n->proc.disagg && p->rank == 0;
    if (n->proc.disagg && p->rank > 0) {
        dc_xfer_kv_shm_sweep(p->instance, n->proc.token);
        if ((rc = dc_xfer_kv_shm_name(p->instance, n->proc.token, p->rank, (int)getpid(),
                                      n->proc.kv_shm_name, sizeof n->proc.kv_shm_name)))
            return rc;
        kvp.shm_name = n->proc.kv_shm_name;
    }
    if ((rc = kn_kv_mem_create(&kvp, &n->proc.mem))) return rc;
    if (p->rank > 0 && (rc = dc_tier_follower_open(n))) return rc;

    int32_t max_ctx = n->proc.rt.model->hp.n_ctx_train;
    int bpseq = (max_ctx + n->dcfg->block_size - 1) / n->dcfg->block_size;
    /* a step holds the prefill budget plus one token per running request and its
     * proposals (speculative decoding), each row with at most one logit row (a prompt
     * logprobs row, a decode or verification row) */
    const td_cfg_spec *spec = &n->dcfg->speculative;
    int64_t max_step = (int64_t)n->dcfg->step_tokens +
                       (int64_t)n->dcfg->max_batch *
                           (1 + (spec->method == TD_CFG_SPEC_OFF ? 0 : spec->max_tokens));
    size_t max_plan = 64 + (size_t)max_step * 16 +
                      (size_t)n->dcfg->max_batch * (4 + (size_t)bpseq * 4) + dc_tier_plan_room(n);
    n->proc.shmp = (dc_shm_params){
        .instance = p->instance,
        .token = n->proc.token,
        .rank = p->rank,
        .tp = n->dcfg->tp,
        .max_floats = max_step * n->proc.rt.model->hp.n_embd,
        .split_allreduce = n->dcfg->tbo_min_tokens > 0, /* two-batch overlap's posts */
        .max_plan = max_plan,
        .timeout_ms = p->cfg->kvxfer.timeout_ms,
        .interrupt = p->stop,
    };
    dc_group_init(n, max_step);
    char be[160];
    n->proc.rt.be.ops->describe(n->proc.rt.be.ctx, be, sizeof be);
    TD_LOG_INFO("decode %s rank %d/%d: %s layers, %d heads/%d kv heads local, %d kv blocks of %d "
                "(%s), %s",
                p->instance, p->rank, n->dcfg->tp, kn_arch_name(n->proc.rt.model->hp.arch),
                n->proc.rt.model->heads.n_q, n->proc.rt.model->heads.n_kv, n_blocks,
                n->dcfg->block_size, td_dtype_name(kv_type), be);
    return 0;
}

/* End this formation on this rank (a segment that is not cleanly stopped breaks, so the
 * other ranks notice at once) and keep its figures for the final log. */
static void close_shm(dc_node *n)
{
    dc_group_close(n); /* a dp group forms again with the instance */
    if (!n->form.shm) return;
    dc_shm_stats st;
    dc_shm_get_stats(n->form.shm, &st);
    n->form.shm_done.n_allreduce += st.n_allreduce;
    n->form.shm_done.ns_allreduce += st.ns_allreduce;
    n->form.shm_done.n_gather += st.n_gather;
    n->form.shm_done.ns_gather += st.ns_gather;
    n->form.shm_done.n_plans += st.n_plans;
    n->form.shm_done.n_sleeps += st.n_sleeps;
    dc_shm_close(n->form.shm);
    n->form.shm = NULL;
}

static void proc_fini(dc_node *n)
{
    kn_kv_mem_destroy(n->proc.mem); /* before the backend whose memory it may be */
    kn_runtime_close(&n->proc.rt);
}

/* Drop the pool's content after a failed formation: every block is free already, and
 * MADV_DONTNEED (private memory) or MADV_REMOVE (rank 0's memfd in disaggregated mode: the
 * file's pages go, not just this mapping of them) gives the pages back (they read as zeros
 * when touched again), so nothing of the failed formation's KV survives and a waiting rank
 * holds no KV memory. Only for a pool no kvxfer connector has registered any more; a
 * disaggregated follower gets a new segment instead (renew_pool). */
static void drop_kv(dc_node *n)
{
    if (n->proc.kv_shm_name[0] || !n->proc.rt.be.ops->host_memory) return;
    int how = kn_kv_pool_fd(dc_kv(n)) >= 0 ? MADV_REMOVE : MADV_DONTNEED;
    if (madvise(dc_kv(n)->region, dc_kv(n)->region_bytes, how))
        TD_LOG_WARN("decode %s rank %d: cannot drop the KV pool's pages: %s", n->p->instance,
                    n->p->rank, strerror(errno));
}

/* The CPU pool's threads for the next forward pass (0: as configured; dc_threads.h). */
void dc_node_use_threads(dc_node *n, int threads)
{
    kn_cpu *c = kn_cpu_of(n->proc.rt.be);
    if (c) kn_pool_set_limit(kn_cpu_pool(c), threads > 0 ? threads : kn_cpu_n_threads(c));
}

/* ---- follower ---- */

/* Run the leader's plans until this formation ends: DC_SHM_STOP (the leader stopped it),
 * DC_SHM_INTR (SIGTERM), or a negative td_err (the instance broke, or this rank failed). */
static int follower_steps(dc_node *n)
{
    dc_plan_view v;
    dc_plan_view_init(&v);
    int rc;
    for (;;) {
        const void *plan;
        size_t len;
        rc = dc_shm_plan_wait(n->form.shm, -1, &plan, &len);
        if (rc) break;
        if ((rc = dc_plan_decode(plan, len, dc_kv(n)->block_size, dc_kv(n)->n_blocks, &v))) {
            TD_LOG_ERR("decode %s rank %d: bad step plan: %s", n->p->instance, n->p->rank,
                       td_strerror(rc));
            break;
        }
        if (v.kind == DC_PLAN_SHUTDOWN) {
            rc = DC_SHM_STOP;
            break;
        }
        if ((rc = dc_tier_apply(n, &v)) || v.kind == DC_PLAN_COPY) {
            if (rc || (rc = dc_tier_copy_barrier(n))) break;
            continue;
        }
        dc_node_use_threads(n, v.threads);
        if ((rc = kn_engine_forward(n->proc.rt.engine, dc_kv(n), &v.batch, NULL))) {
            if (!*n->p->stop)
                TD_LOG_ERR("decode %s rank %d: step %llu failed: %s", n->p->instance, n->p->rank,
                           (unsigned long long)v.step, td_strerror(rc));
            break;
        }
    }
    dc_plan_view_fini(&v);
    return rc;
}

/* Disaggregated follower, before the next rendezvous: a fresh pool segment. The leader of
 * the last formation mapped the old one and unlinked its name, so a new leader could not
 * find it; the old memory lives on in that leader's mapping until it rebuilt its KV plane.
 * Its content is dropped: every request of the last formation failed. */
static int renew_pool(dc_node *n)
{
    int rc = kn_kv_mem_renew_pool(n->proc.mem);
    if (rc)
        TD_LOG_ERR("decode %s rank %d: cannot make a new KV pool segment %s: %s", n->p->instance,
                   n->p->rank, n->proc.kv_shm_name, td_strerror(rc));
    return rc;
}

/* A follower's life: join a formation, run its plans, and when it ends for any reason but
 * this rank's own SIGTERM (a rank died, the leader died or stopped), go back to the
 * rendezvous with the model loaded, waiting as long as it takes (asleep) for a leader. */
static int follower_run(dc_node *n)
{
    const dc_node_params *p = n->p;
    bool pool_used = false; /* the pool took part in a formation (its name may be gone) */
    int64_t t_left = 0;     /* when it left the last formation */
    while (!*p->stop) {
        int rc;
        if (pool_used && n->proc.disagg && (rc = renew_pool(n))) return rc;
        if (pool_used && !n->proc.disagg) drop_kv(n);
        pool_used = false;
        rc = dc_shm_begin(&n->proc.shmp, &n->form.shm);
        if (rc == TD_ETIMEDOUT) continue; /* no leader for timeout_ms (logged): wait on */
        if (rc) {
            if (*p->stop) break;
            /* another layout than rank 0's, or this rank runs in another live process */
            if (rc == TD_EINVAL || rc == TD_ESTATE) return rc;
            sleep_ms(RETRY_MS);
            continue;
        }
        /* no limit: rank 0 is watched (its death ends the wait), and it may wait for a
         * restarted rank as long as the operator needs */
        if ((rc = dc_shm_gather(n->form.shm, -1))) {
            close_shm(n); /* the leader gave this segment up (a rank died while gathering) */
            continue;
        }
        pool_used = true;
        kn_kv_mem_clear(n->proc.mem); /* its tier: the leader's starts empty too */
        if (t_left)
            TD_LOG_INFO("decode %s rank %d: joined the instance again (%.1f s after leaving it)",
                        p->instance, p->rank, (double)(td_now_ms() - t_left) / 1e3);
        else
            TD_LOG_INFO("decode %s rank %d: joined the instance", p->instance, p->rank);
        rc = follower_steps(n);
        /* this rank's SIGTERM: say so in the segment (not the "left" of a bare close), so
           that rank 0 can tell a stop from a failure (leader_run) */
        if (rc == DC_SHM_INTR) dc_shm_leave_stopped(n->form.shm);
        char why[192];
        snprintf(why, sizeof why, "%s",
                 rc == DC_SHM_STOP              ? "rank 0 stopped the instance"
                 : rc == DC_SHM_INTR            ? "stopping"
                 : dc_shm_error(n->form.shm)[0] ? dc_shm_error(n->form.shm)
                                                : td_strerror(rc));
        close_shm(n);
        t_left = td_now_ms();
        if (*p->stop) break;
        TD_LOG_INFO("decode %s rank %d: left the instance (%s); waiting for rank 0 to form it "
                    "again",
                    p->instance, p->rank, why);
    }
    return 0;
}

/* ---- leader ---- */

_Static_assert(TD_CFG_SPEC_MAX_TOKENS == DC_SPEC_MAX_TOKENS,
               "decode[].speculative.max_tokens is bounded by the scheduler's bound");

/* how many proposals a step takes, for the start-up log */
static const char *spec_mode(const td_cfg_spec *c)
{
    return !c->adaptive ? "pinned" : c->gate ? "adaptive, measured gate" : "adaptive";
}

/* decode[].speculative -> the scheduler's dc_spec_params (adaptive: false pins k); draft:
 * methods draft's and mtp's proposer (NULL otherwise) */
static dc_spec_params spec_params(const td_cfg_spec *c, dc_draft *draft)
{
    dc_spec_params sp = {.method = c->method == TD_CFG_SPEC_NGRAM ? DC_SPEC_NGRAM
                                   : c->method == TD_CFG_SPEC_DRAFT || c->method == TD_CFG_SPEC_MTP
                                       ? DC_SPEC_DRAFT
                                       : DC_SPEC_OFF,
                         .max_tokens = c->max_tokens,
                         .pinned = !c->adaptive,
                         .gate = c->gate,
                         .ngram_min = c->ngram_min,
                         .ngram_max = c->ngram_max};
    if (draft) sp.proposer = dc_draft_proposer(draft);
    return sp;
}

/* Methods draft and mtp: the draft model or the target's MTP block, on this rank's backend
 * (one thread pool for both models) with a KV pool of the target's token capacity; logs what
 * it is. */
static int draft_init(dc_node *n)
{
    const td_cfg_spec *spec = &n->dcfg->speculative;
    bool mtp = spec->method == TD_CFG_SPEC_MTP;
    if (spec->method != TD_CFG_SPEC_DRAFT && !mtp) return 0;
    char who[96];
    snprintf(who, sizeof who, "decode %s", n->p->instance);
    const kn_kv_pool *kv = dc_kv(n);
    dc_draft_params dp = {.path = mtp ? NULL : spec->draft,
                          .mtp = mtp,
                          .be = n->proc.rt.be,
                          .target = n->proc.rt.model,
                          .target_gguf = n->proc.rt.gguf,
                          .kv_tokens = (int64_t)kv->n_blocks * kv->block_size,
                          .block_size = kv->block_size,
                          .kv_type = n->dcfg->kv_dtype,
                          /* a prompt's catch-up a step: the step's prefill share */
                          .chunk_tokens = n->dcfg->step_tokens,
                          .who = who};
    int rc = dc_draft_create(&dp, &n->leader.draft);
    if (rc) return rc;
    dc_draft_info in = dc_draft_get_info(n->leader.draft);
    TD_LOG_INFO("decode %s: speculative decoding by %s%s (%s, %d layer%s, n_embd %d, "
                "%.1f MiB of weights; KV pool %d blocks, %.1f MiB; warm-up %.0f ms), up to %d "
                "tokens a step, %s",
                n->p->instance,
                mtp ? "the model's MTP block" : "a draft model: ", mtp ? "" : spec->draft,
                kn_arch_name(in.arch), mtp ? 1 : in.n_layer, mtp || in.n_layer == 1 ? "" : "s",
                in.n_embd, (double)in.weight_bytes / (1 << 20), in.kv_blocks,
                (double)in.kv_bytes / (1 << 20), in.warm_ms, spec->max_tokens, spec_mode(spec));
    return 0;
}

/* The leader's part (dc_leader): the scheduler (with the structured-output vocabulary and
 * grammars it checks against) and the logits it samples from. */
/* decode[].share_cores: the segment the prefill stages of this host pause on while a step
 * runs (common/td_coreshare.h). */
static int share_cores_init(dc_node *n)
{
    if (!n->dcfg->share_cores) return 0;
    if (!kn_cpu_of(n->proc.rt.be)) {
        TD_LOG_WARN("decode %s: decode[].share_cores: the %s backend computes on no CPU cores to "
                    "share: off",
                    n->p->instance, n->proc.rt.be.ops->name);
        return 0;
    }
    char name[96];
    td_coreshare_name(n->dcfg->port, name, sizeof name);
    bool adaptive = n->dcfg->share_cores == TD_CFG_SHARE_AUTO;
    int rc = td_coreshare_create(name, adaptive, &n->leader.cores);
    if (!rc && adaptive)
        TD_LOG_INFO("decode %s: steps claim the cores of host %s only while the ones left to "
                    "the scheduler beside its busy prefill stages take %.1fx their claimed time "
                    "and three in four of them more than itl_target_ms (%.1f ms), measured over "
                    "the last %d; the stages then compute between steps for the rest of it "
                    "(decode[].share_cores: auto)",
                    n->p->instance, n->dcfg->host, TD_CORESHARE_AUTO_STRETCH,
                    n->dcfg->itl_target_ms, TD_CORESHARE_AUTO_SAMPLES);
    else if (!rc)
        TD_LOG_INFO("decode %s: each step claims the cores of host %s; its prefill stages compute "
                    "between steps for %s (decode[].share_cores)",
                    n->p->instance, n->dcfg->host,
                    n->dcfg->itl_target_ms > 0 ? "the rest of itl_target_ms" : "as long as a step");
    return rc;
}

static int leader_init(dc_node *n)
{
    int rc = 0;
    td_tokenizer *tok = NULL;
    int32_t *eog = NULL;
    int n_eog = 0;
    /* end-of-generation ids come from the tokenizer metadata (absent: no EOG ids) */
    if (td_tok_create(n->proc.rt.gguf, &tok) == 0) {
        int32_t nv = td_tok_n_vocab(tok);
        eog = malloc((size_t)nv * sizeof *eog);
        for (int32_t i = 0; eog && i < nv; i++)
            if (td_tok_is_eog(tok, i)) eog[n_eog++] = i;
        /* structured output needs the token strings; without them it is refused */
        if (nv == n->proc.rt.model->hp.n_vocab &&
            (rc = gr_vocab_from_tok(tok, &n->leader.gvocab)) == 0)
            rc = gr_cache_create(0, &n->leader.grammars);
        td_tok_destroy(tok);
        if (rc) {
            free(eog);
            return rc;
        }
    }
    if ((rc = draft_init(n))) {
        free(eog);
        return rc;
    }
    dc_sched_params sp = {.max_running = n->dcfg->max_batch,
                          .step_tokens = n->dcfg->step_tokens,
                          .deterministic = n->dcfg->deterministic,
                          .eog_ids = eog,
                          .n_eog = n_eog,
                          .vocab = n->leader.gvocab,
                          .grammars = n->leader.grammars,
                          .prefix_cache = n->dcfg->prefix_cache,
                          .itl_target_ms = n->dcfg->itl_target_ms,
                          .sample_pool = kn_backend_host_pool(n->proc.rt.be),
                          .spec = spec_params(&n->dcfg->speculative, n->leader.draft)};
    char tier_path[4096];
    rc = dc_tier_params(n, tier_path, sizeof tier_path, &sp.tier);
    if (!rc)
        rc = dc_sched_create(&sp, n->proc.rt.model, n->proc.mem,
                             (dc_sink){.ctx = n,
                                       .on_tokens = dc_async_on_tokens,
                                       .on_prompt_logprobs = dc_async_on_prompt_logprobs},
                             &n->leader.sched);
    free(eog);
    if (rc) return rc;
    const td_cfg_spec *spec = &n->dcfg->speculative;
    if (spec->method == TD_CFG_SPEC_OFF)
        TD_LOG_INFO("decode %s: speculative decoding off", n->p->instance);
    else if (spec->method == TD_CFG_SPEC_NGRAM)
        TD_LOG_INFO("decode %s: speculative decoding by prompt lookup (n-grams %d..%d), up to %d "
                    "tokens a step, %s",
                    n->p->instance, spec->ngram_min, spec->ngram_max, spec->max_tokens,
                    spec_mode(spec));
    bool adaptive = n->dcfg->adaptive_threads && n->dcfg->threads > 1;
    if (adaptive && !kn_cpu_of(n->proc.rt.be)) {
        TD_LOG_WARN("decode %s: decode[].adaptive_threads: the %s backend has no CPU threads to "
                    "choose: off",
                    n->p->instance, n->proc.rt.be.ops->name);
        adaptive = false;
    }
    dc_threads_init(&n->leader.threads, n->dcfg->threads, adaptive);
    if (adaptive)
        TD_LOG_INFO("decode %s: each step's threads (%d or fewer) chosen from measured step times",
                    n->p->instance, n->dcfg->threads);
    if ((rc = share_cores_init(n))) return rc;
    n->leader.logits =
        malloc((size_t)n->dcfg->max_batch * (size_t)n->proc.rt.model->hp.n_vocab * sizeof(float));
    if (!n->leader.logits) return TD_ENOMEM;
    n->leader.logit_rows = n->dcfg->max_batch;
    return 0;
}

/* The scheduler before what it refers to (its sink's events were sent before: overlap's
 * held ones at dc_async_stop), the draft model among them (the backend it shares runs
 * nothing more before proc_fini destroys it: dc_draft.h). */
static void leader_fini(dc_node *n)
{
    dc_sched_destroy(n->leader.sched);
    dc_draft_destroy(n->leader.draft);
    gr_cache_destroy(n->leader.grammars);
    gr_vocab_destroy(n->leader.gvocab);
    free(n->leader.logits);
    td_coreshare_destroy(n->leader.cores);
    n->leader = (dc_leader){0};
}

/* What a forming leader waits for, for the ERR_BUSY text and its log. */
static void set_forming_why(dc_node *n, bool gathered, const char *no_segment)
{
    const char *what = n->life.formations ? "re-forming" : "forming";
    if (!n->form.shm) {
        snprintf(n->life.forming_why, sizeof n->life.forming_why, "%s (no rendezvous segment: %s)",
                 what, no_segment);
        return;
    }
    if (gathered) {
        snprintf(n->life.forming_why, sizeof n->life.forming_why,
                 "%s (waiting for %d KV transfers of the failed formation to end)", what,
                 dc_xfer_pending(n->plane.xfer));
        return;
    }
    uint64_t joined = dc_shm_joined(n->form.shm);
    char list[96] = "";
    size_t len = 0;
    for (int r = 0; r < n->dcfg->tp && len < sizeof list - 8; r++)
        if (!(joined >> r & 1))
            len += (size_t)snprintf(list + len, sizeof list - len, "%s%d", len ? ", " : "", r);
    snprintf(n->life.forming_why, sizeof n->life.forming_why, "%s (waiting for rank %s)", what,
             list);
}

/* FORMING: make a rendezvous segment and keep serving the control socket (polls and
 * health answered, not ready; Submit and Alloc refused with ERR_BUSY) until every rank
 * joined and every transfer of the failed formation is final; then rebuild the KV plane
 * over the followers' pools of this formation. Every wait is a short slice. Returns 0 once
 * SERVING or when *stop was set (the caller checks), or a fatal td_err: on the first
 * formation, what made the start-up fail before (a live leader already owns the instance,
 * /dev/shm full, UCX does not start); later ones retry after RETRY_MS instead. */
static int form(dc_node *n)
{
    const dc_node_params *p = n->p;
    bool first = n->life.formations == 0;
    int64_t t0 = td_now_ms(), next_try = 0, last_health = 0, next_log = t0 + FORM_LOG_MS;
    bool gathered = false;
    char no_segment[64] = "not made yet";
    n->life.forming = true;
    dc_serve_health(n);
    /* a follower killed before its leader mapped its pool leaves the segment behind (here,
     * after a failed rendezvous and at the stop) */
    if (n->proc.disagg) dc_xfer_kv_shm_sweep(p->instance, n->proc.token);
    while (!*p->stop) {
        int rc;
        if (n->dcfg->dp > 1 && !n->group.ready) { /* the dp group first (its members are tp 1) */
            rc = dc_group_form(n, FORM_WAIT_MS);
            snprintf(n->life.forming_why, sizeof n->life.forming_why,
                     "%s (waiting for the members of dp group %s: %s)",
                     first ? "forming" : "re-forming", n->dcfg->dp_group,
                     rc == TD_ETIMEDOUT || !rc ? "not all in yet" : td_strerror(rc));
            if ((rc = dc_serve_inbox(n, rc && rc != TD_ETIMEDOUT ? FORM_WAIT_MS : 0, NULL)))
                return rc;
            dc_serve_health_tick(n, &last_health);
            if (td_now_ms() >= next_log) {
                TD_LOG_INFO("decode %s: %s for %.0f s", p->instance, n->life.forming_why,
                            (double)(td_now_ms() - t0) / 1e3);
                next_log = td_now_ms() + FORM_LOG_MS;
            }
            continue;
        }
        if (!n->form.shm && td_now_ms() >= next_try) {
            gathered = false;
            if ((rc = dc_shm_begin(&n->proc.shmp, &n->form.shm))) {
                if (first) return rc;
                snprintf(no_segment, sizeof no_segment, "%s", td_strerror(rc));
                next_try = td_now_ms() + RETRY_MS;
            }
        }
        set_forming_why(n, gathered, no_segment);
        if (td_now_ms() >= next_log) {
            TD_LOG_INFO("decode %s: %s for %.0f s", p->instance, n->life.forming_why,
                        (double)(td_now_ms() - t0) / 1e3);
            next_log = td_now_ms() + FORM_LOG_MS;
        }
        /* the inbox first, then the ranks: neither waits long for the other */
        int wait = !n->form.shm ? FORM_WAIT_MS : gathered ? DRAIN_WAIT_MS : 0;
        if ((rc = dc_serve_inbox(n, wait, NULL))) return rc;
        dc_serve_transfers(n);
        dc_serve_health_tick(n, &last_health);
        if (!n->form.shm) continue;
        rc = gathered ? dc_shm_check(n->form.shm) : dc_shm_gather(n->form.shm, FORM_WAIT_MS);
        if (rc == TD_ETIMEDOUT) continue;
        gathered = !rc;
        /* every rank is in; the blocks of the failed formation's transfers are not safe
         * to reuse (nor the pools to unmap) before each transfer is final */
        if (!rc && dc_xfer_pending(n->plane.xfer)) continue;
        if (!rc) {
            /* no writer can reach any pool now: the old KV plane goes (and with it the last
             * registration of rank 0's pool, whose pages can go too) */
            dc_node_xfer_teardown(n);
            if (!first) drop_kv(n);
            if (n->proc.disagg && (rc = dc_node_xfer_setup(n))) {
                dc_node_xfer_teardown(n);
                if (first) return rc;
                next_try = td_now_ms() + RETRY_MS;
                snprintf(no_segment, sizeof no_segment, "KV-transfer plane: %s", td_strerror(rc));
            }
        }
        if (rc) {
            /* a rank died while gathering, or the segment broke: start over with a fresh
             * one (the followers find it by themselves) */
            TD_LOG_INFO("decode %s: rendezvous failed (%s); starting a new one", p->instance,
                        dc_shm_error(n->form.shm)[0] ? dc_shm_error(n->form.shm) : td_strerror(rc));
            close_shm(n);
            if (n->proc.disagg) dc_xfer_kv_shm_sweep(p->instance, n->proc.token);
            continue;
        }
        n->life.forming = false;
        n->life.formations++;
        TD_LOG_INFO("decode %s: instance of %d ranks %s in %.3f s: ready", p->instance, n->dcfg->tp,
                    first ? "formed" : "re-formed", (double)(td_now_ms() - t0) / 1e3);
        dc_serve_health(n);
        return 0;
    }
    return 0;
}

/* Room for rows logit rows: more than one per request only for prompt logprobs. */
int dc_node_grow_logits(dc_node *n, int rows)
{
    float *l = realloc(n->leader.logits,
                       (size_t)rows * (size_t)n->proc.rt.model->hp.n_vocab * sizeof(float));
    if (!l) return TD_ENOMEM;
    n->leader.logits = l;
    n->leader.logit_rows = rows;
    return 0;
}

/* After SIGTERM: whether the serving loop ends now. With decode[].drain_timeout_ms the
 * instance first leaves (Health.draining, the router told at once, new requests refused with
 * ERR_SHUTDOWN: the router sends them elsewhere) while the requests in flight finish, for up
 * to that long; what is left then ends with ERR_SHUTDOWN (leader_stop), and moves. */
void dc_node_step_failed(dc_node *n, int rc)
{
    snprintf(n->life.fail_why, sizeof n->life.fail_why, "%s",
             dc_shm_error(n->form.shm)[0] ? dc_shm_error(n->form.shm) : td_strerror(rc));
}

bool dc_node_stop_now(dc_node *n)
{
    if (!*n->p->stop) return false;
    bool idle = dc_sched_idle(n->leader.sched) && dc_xfer_pending(n->plane.xfer) == 0;
    if (n->life.leaving) return idle || td_now_ms() >= n->life.leave_until_ms;
    if (n->dcfg->drain_timeout_ms <= 0 || idle) return true;
    n->life.leaving = n->life.draining = true;
    n->life.leave_until_ms = td_now_ms() + n->dcfg->drain_timeout_ms;
    td_join_leave(n->serve.join);
    dc_serve_health(n);
    dc_sched_stats st = dc_sched_get_stats(n->leader.sched);
    TD_LOG_INFO("decode %s: leaving: %d running and %d waiting requests may finish within %d ms "
                "(decode[].drain_timeout_ms); no new ones",
                n->p->instance, st.running, st.waiting, n->dcfg->drain_timeout_ms);
    return false;
}

/* The instance failed: every request in flight ends with an error event (the forming loop
 * keeps answering polls, so they reach their clients), every transfer is aborted (its
 * blocks become reusable only once kvxfer says no writer can write: form() waits for
 * that), and the segment is closed. The pools keep nothing: every block is free again. */
static void fail_in_flight(dc_node *n, int rc)
{
    if (!n->life.fail_why[0])
        snprintf(n->life.fail_why, sizeof n->life.fail_why, "%s",
                 n->form.shm && dc_shm_error(n->form.shm)[0] ? dc_shm_error(n->form.shm)
                                                             : td_strerror(rc));
    dc_sched_stats st = dc_sched_get_stats(n->leader.sched);
    TD_LOG_ERR("decode %s: the instance failed (%s); failing what is still in flight (%d "
               "running, %d waiting, %d transferring), then re-forming",
               n->p->instance, n->life.fail_why, st.running, st.waiting, st.transferring);
    n->life.forming = true;
    dc_xfer_abort_all(n->plane.xfer, DC_XFER_END_STOPPED);
    dc_sched_fail_all(n->leader.sched);
    n->life.fail_why[0] = 0;
    st = dc_sched_get_stats(n->leader.sched);
    if (st.kv_blocks_used)
        TD_LOG_ERR("decode %s: %d KV blocks still in use after failing every request (bug)",
                   n->p->instance, st.kv_blocks_used);
    close_shm(n);
    dc_serve_health(n);
}

/* SIGTERM: requests still in flight end with ERR_SHUTDOWN; a formed instance gets the stop
 * plan (its followers go back to the rendezvous, or exit if they were signalled too). */
static void leader_stop(dc_node *n)
{
    n->life.draining = true;
    td_join_leave(n->serve.join); /* the router hears it before the connection drops, mostly */
    bool busy = !dc_sched_idle(n->leader.sched);
    if (busy) {
        /* stopped with work in flight: end every request with a clear error and give the
         * events a moment to reach their clients (they long-poll, so ~ms) */
        dc_sched_stats st = dc_sched_get_stats(n->leader.sched);
        TD_LOG_INFO("decode %s: stopping; %d running and %d waiting requests end with an error",
                    n->p->instance, st.running, st.waiting);
        n->life.stopping = true;
        dc_xfer_abort_all(n->plane.xfer, DC_XFER_END_STOPPED);
        dc_sched_fail_all(n->leader.sched);
        dc_serve_health(n);
    }
    /* also when a failure just before the stop ended the requests (fail_in_flight): their
       transfers' aborts may still be ending, and their error events still queued */
    if (busy || dc_xfer_pending(n->plane.xfer) > 0) {
        /* a transfer's abort ends when every rank released it: on a loaded machine (CI
           under ASan) that once took longer than STOP_DRAIN_MS, and the leak check at the
           exit found it still alive */
        int64_t t0 = td_now_ms();
        for (;;) {
            int64_t el = td_now_ms() - t0;
            if (el >= STOP_DRAIN_MS && (dc_xfer_pending(n->plane.xfer) == 0 || el >= STOP_XFER_MS))
                break;
            dc_serve_inbox(n, 50, NULL);
            dc_serve_transfers(n);
        }
    }
    if (n->life.leaving) {
        /* drained: the last tokens are in the outbox until the clients' next poll takes them
           (~ms); leaving before would make the router move finished requests */
        int64_t t0 = td_now_ms();
        td_ctrl_server_stats cs;
        do {
            dc_serve_inbox(n, 20, NULL);
            td_ctrl_server_get_stats(n->serve.srv, &cs);
        } while (cs.unacked && td_now_ms() - t0 < STOP_XFER_MS);
    }
    /* a broken or unfinished formation (a follower stopped first: `tandem down` signals
     * every rank) just closes */
    if (n->form.shm && !n->life.forming) dc_shm_plan_stop(n->form.shm);
    if (n->proc.disagg) dc_xfer_kv_shm_sweep(n->p->instance, n->proc.token);
    dc_report_log(n);
}

/* A follower stopped on its own SIGTERM. `tandem down`, a pod's deletion and systemd stop
 * every rank at once, and a follower may leave before this rank's signal arrives: wait a
 * moment for it (answering the inbox), so that the requests in flight end as a stop
 * (ERR_SHUTDOWN, which the router moves uncounted) and their transfers are waited for, not
 * as an instance failure followed by a re-formation that the stop then cuts short. A
 * follower stopped alone is still a failure once the moment is over. */
static void await_own_stop(dc_node *n)
{
    int64_t t0 = td_now_ms();
    while (!*n->p->stop && td_now_ms() - t0 < PEER_STOP_GRACE_MS)
        dc_serve_inbox(n, 20, NULL);
}

/* The leader's life: FORMING -> SERVING -> (a rank failed) FORMING -> ... until SIGTERM. */
static int leader_run(dc_node *n)
{
    int rc = leader_init(n);
    if (!rc && n->dcfg->overlap) rc = dc_async_start(n);
    if (!rc) rc = dc_serve_init(n);
    if (rc) return rc;
    bool fatal = false;
    for (;;) {
        if ((rc = form(n))) {
            fatal = true;
            break;
        }
        if (*n->p->stop) break;
        rc = dc_loop_serve(n, &fatal);
        dc_serve_fail_allocs(n); /* held replies of a formation that ended */
        if (rc && !fatal && !*n->p->stop && dc_shm_peer_stopped(n->form.shm)) await_own_stop(n);
        if (fatal || *n->p->stop) break;
        fail_in_flight(n, rc);
    }
    if (fatal && !*n->p->stop) {
        TD_LOG_ERR("decode %s: stopping after a failure (%s); failing every request",
                   n->p->instance, td_strerror(rc));
        /* transfers are aborted (their writers stop) but not waited for: nothing is
         * allocated any more, and the process ends */
        n->life.draining = true;
        dc_xfer_abort_all(n->plane.xfer, DC_XFER_END_STOPPED);
        dc_sched_fail_all(n->leader.sched);
        dc_serve_health(n);
        dc_serve_inbox(n, 100, NULL); /* a last chance for the error events */
        return rc;
    }
    if (rc)
        TD_LOG_INFO("decode %s: stopping (another rank stopped first: %s)", n->p->instance,
                    td_strerror(rc));
    leader_stop(n);
    return 0;
}

/* Every part, each after those that use it (dc_node_int.h): overlap's held events go out
 * through the control plane; the KV plane borrows the pools; the scheduler holds the KV
 * memory; the segment and the KV memory are the engine's. */
static void teardown(dc_node *n)
{
    dc_async_stop(n); /* no pass in flight any more: the serving loop joined it */
    dc_node_xfer_teardown(n);
    leader_fini(n);
    dc_serve_fini(n);
    close_shm(n);
    proc_fini(n);
}

int dc_node_run(const dc_node_params *p)
{
    dc_node n = {.p = p};
    const char *tmpl = p->template_name ? p->template_name : p->instance;
    n.dcfg = td_cfg_find_decode(p->cfg, tmpl);
    if (!n.dcfg) {
        TD_LOG_ERR("no decode instance '%s' in %s", tmpl, p->cfg->path);
        return TD_EINVAL;
    }
    if (p->rank >= n.dcfg->tp) {
        TD_LOG_ERR("rank %d is outside decode instance %s (tp %d)", p->rank, p->instance,
                   n.dcfg->tp);
        return TD_EINVAL;
    }
    int rc = proc_init(&n);
    if (!rc) rc = p->rank == 0 ? leader_run(&n) : follower_run(&n);
    if (rc && *p->stop) rc = 0; /* SIGTERM ended whatever this rank was waiting for */
    if (rc) TD_LOG_ERR("decode %s rank %d: exiting: %s", p->instance, p->rank, td_strerror(rc));
    teardown(&n);
    return rc;
}
