/* engine_int.h: the kn_engine object, shared by forward.c (the forward pass, in parts),
 * forward_moe.c / forward_mla.c (experts, latent attention), forward_tbo.c (two-batch overlap:
 * the parts of two micro-batches interleaved) and engine_stage.c (device backends: the model's
 * weights mapped once, each batch's inputs staged into backend memory). Private to kernels/. */
#ifndef KN_ENGINE_INT_H
#define KN_ENGINE_INT_H

#include "model.h"
#include "moe_route.h"

/* A mixture-of-experts layer's scratch (forward_moe.c), for the engine's cap tokens; NULL
 * for a dense model. */
/* The experts with tokens in one layer, as experts_ffn takes them (host arrays of
 * n_expert; group i is an expert's rows of the plan's grouped order). */
typedef struct {
    const kn_mat **wg, **wu, **wd;
    const float **x;
    int64_t *m, *solo;
    float **g, **u, **y;
} kn_engine_groups;

typedef struct {
    int64_t cap;
    float *rl;            /* (cap, n_expert) the router's logits */
    float *xe;            /* (cap * k, n_embd) every choice's token, grouped by expert */
    float *ge, *ue;       /* (cap * k, n_ffe_local) their gate (then activation) and up */
    float *ye;            /* (cap * k, n_embd) every choice's expert output, grouped by expert */
    kn_engine_groups grp; /* the layer's groups */
    float *mo;            /* (cap, n_embd) the layer's output before the all-reduce */
    kn_moe_plan plan;     /* the routing, on the host */
    float *h_rl;          /* (cap, n_expert) host copy of rl (device backends) */
    int32_t *tok, *slot;  /* (cap * k) the plan's token and slot in backend memory (device) */
    float *wt;            /* (cap * k) and its weights */
    /* data-parallel attention (kn_shard.dp_size > 1; host memory): cap counts the rows of
     * every member */
    kn_moe_plan own; /* the routing of this member's rows */
    float *pk, *pa;  /* (cap, n_embd + 2k) rows packed with their choices and weights: this
                        member's, then every member's (solo-first layout) */
    float *ha, *ma;  /* (cap, n_embd) every member's rows, their experts' combined output */
} kn_engine_moe;

/* A latent-attention layer's scratch (forward_mla.c), for the engine's cap tokens; NULL for
 * other models. nh is the rank's heads, QD = mla_nope + n_rot, R = kv_lora_rank. */
typedef struct {
    int64_t cap;
    float *qa;  /* (cap, q_lora_rank) */
    float *q;   /* (cap, nh * QD) the queries as projected */
    float *c;   /* (cap, R) the compressed KV, then normed */
    float *pe;  /* (cap, n_rot) the key's rope part */
    float *qpe; /* (cap * nh, n_rot) every head's query rope part */
    float *qn;  /* (cap, mla_nope) one head's query without rope */
    float *ql;  /* (cap, R) one head's query in latent space, or its output there */
    float *ov;  /* (cap, mla_v) one head's value output */
    float *av;  /* (cap, nh * mla_v) every head's value output */
} kn_engine_mla;

/* A batch's host arrays as a device backend reads them: copies in backend memory, grown on
 * demand. h_seqs / h_tables are the host-side packing buffers of the seq views. */
typedef struct {
    int64_t cap_tok;
    int32_t *tokens, *pos, *seq_of; /* (cap_tok) */
    int cap_rows;
    int32_t *rows; /* (cap_rows) logit rows */
    int cap_seqs;
    kn_seq_view *seqs, *h_seqs; /* (cap_seqs) device copy (pointing into tables), host pack */
    int64_t cap_tab;
    int32_t *tables, *h_tables; /* (cap_tab) every sequence's block table, end to end */
    int64_t cap_out;
    float *out; /* (cap_out) logits before they are downloaded */
    int64_t cap_host;
    float *host; /* (cap_host) host memory the tp collectives run on (host_alloc if offered) */
    int cap_first;
    int32_t *first; /* (cap_first) each sequence's first position in the batch (staged pools) */
    int64_t cap_up;
    int32_t *up; /* (cap_up) blocks to upload from a staged pool's host copy */
} kn_engine_stage;

/* An all-reduce a micro-batch posted and what follows it (kn_engine_reduce_add). */
typedef struct {
    bool on;
    float *buf; /* (rows, n_embd) posted; receives the sum */
    int64_t rows;
    const float *post_norm; /* then x += [post_norm] buf [* residual_scale] */
    bool scaled;
    uint64_t ticket;
} kn_engine_pending;

/* Two-batch overlap (forward_tbo.c): the second micro-batch's engine and its logit rows. */
typedef struct {
    int64_t min_tokens; /* split forwards of at least this many tokens; 0: never */
    kn_engine *twin;    /* the second micro-batch's scratch (shares m, be, coll) */
    int cap_rows;
    int32_t *rows;    /* (cap_rows) its logit rows, counted from its first row */
    uint64_t n_split; /* forwards run as two micro-batches */
} kn_engine_tbo;

struct kn_engine {
    const kn_model *m;
    kn_backend be;
    bool dev; /* the backend computes on its own memory (kn_backend.h: host_memory false) */
    kn_collective coll;
    int64_t cap;  /* tokens the scratch below holds (backend memory) */
    float *x;     /* (cap, n_embd) residual stream */
    float *h;     /* (cap, n_embd) normed input / projection output */
    float *q;     /* (cap, heads.n_q * head_dim) */
    float *k, *v; /* (cap, heads.n_kv * head_dim) */
    float *att;   /* (cap, heads.n_q * head_dim) */
    float *g, *u; /* (cap, n_ff_local) */
    float *sel;   /* (cap, n_embd) rows that need logits */
    float *cat;   /* (cap, 2 * n_embd) an MTP block's input before eh_proj; shard.mtp only */
    int cap_lg;   /* logit rows lg holds */
    float *lg;    /* (cap_lg, n_vocab_local) this rank's logit slice; tp > 1 only */
    kn_engine_stage st;
    /* data-parallel attention (kn_shard.dp_size > 1): this forward's dp_counts and the
     * rows of all members (all) and their leading solo rows (all_solo) */
    int64_t *dp_counts; /* (2 dp_size) */
    int64_t dp_all, dp_all_solo;
    kn_engine_moe moe;
    kn_engine_mla mla;
    bool defer;             /* a micro-batch of a two-batch forward: all-reduces post */
    kn_engine_pending pend; /* its posted all-reduce */
    kn_engine_tbo tbo;
};

/* One scratch buffer of elems 4-byte elements (floats or int32) in backend memory. */
typedef struct {
    void **buf;
    int64_t elems;
} kn_engine_buf;

/* Allocates each of the n buffers (a NULL buf entry is skipped); on failure frees what it
 * allocated, logs what for, and returns TD_ENOMEM. */
int kn_engine_alloc_bufs(kn_engine *e, const kn_engine_buf *b, size_t n, const char *what);
/* Frees each non-NULL *bufs[i] and sets it NULL. */
void kn_engine_free_bufs(kn_engine *e, void **const *bufs, size_t n);

/* ---- forward.c, for forward_moe.c ---- */
/* y (m, w->n_rows) = x W^T with rows [0, solo) each computed as if alone (model.h). */
int kn_engine_matmul(const kn_engine *e, const kn_mat *w, const float *x, int64_t m, int64_t solo,
                     float *y);
/* g (m, F) = act(x Wg^T) * (x Wu^T), u (m, F) holding the up product, act the model's. */
int kn_engine_glu(const kn_engine *e, const kn_mat *wg, const kn_mat *wu, const float *x, int64_t m,
                  int64_t solo, float *g, float *u);
/* buf (n floats) summed across the TP ranks (a no-op at tp 1). */
int kn_engine_allreduce(kn_engine *e, float *buf, int64_t n);
/* x += [post_norm] allreduce(buf) [* residual_scale if scaled] (buf: (n, n_embd)); on an
 * engine that defers (a micro-batch, e->defer) the all-reduce is posted and the rest waits
 * for kn_engine_settle. */
int kn_engine_reduce_add(kn_engine *e, float *buf, int64_t n, const float *post_norm, bool scaled);
/* The posted all-reduce waited and its residual add done (0 at once when none is posted). */
int kn_engine_settle(kn_engine *e);
/* x += [post_norm] allreduce(in W) [* residual_scale] (in: (n, w->n_cols)). */
int kn_engine_project_add(kn_engine *e, const kn_mat *w, const float *in, const float *post_norm,
                          int64_t n, int64_t solo);

/* The activations of n tokens, in the backend's memory (grown on demand). */
int kn_engine_reserve(kn_engine *e, int64_t n);
/* The forward pass in its parts (kn_engine_forward: input, the halves of every local layer,
 * output), for forward_tbo.c's interleaving. db is b with its arrays in backend memory. */
int kn_engine_input(kn_engine *e, const kn_batch *b, const kn_batch *db);
int kn_engine_attn_half(kn_engine *e, kn_kv_pool *kv, const kn_batch *b, int li);
int kn_engine_ffn_half(kn_engine *e, const kn_batch *b, int li);
int kn_engine_output(kn_engine *e, const kn_batch *b, const kn_batch *db, float *out);

/* ---- forward_tbo.c ---- */
/* Where a validated batch splits into two micro-batches (the first's tokens), or 0: run it
 * whole (overlap off, too small, or logit rows that do not split in order). */
int64_t kn_engine_tbo_split(const kn_engine *e, const kn_batch *b);
/* The forward as two micro-batches, rows [0, split) and the rest, interleaved layer half by
 * layer half so each one's all-reduce runs while the other computes. */
int kn_engine_forward_tbo(kn_engine *e, kn_kv_pool *kv, const kn_batch *b, int64_t split,
                          float *out);
void kn_engine_tbo_free(kn_engine *e);

/* ---- forward_moe.c ---- */
/* The widest FFN a layer of the model computes (dense, one expert, shared experts). */
int64_t kn_engine_ffn_width(const kn_model *m);
/* The MoE scratch for n tokens (grown on demand); 0 at once for a dense model. */
int kn_engine_moe_reserve(kn_engine *e, int64_t n);
void kn_engine_moe_free(kn_engine *e);
/* x += allreduce(moe(h)): h (n, n_embd) the FFN's normed input. With data-parallel
 * attention the experts run on every member's rows (e->dp_*; n may be 0: h NULL) and
 * x += this member's rows of the members' summed shares. */
int kn_engine_moe_ffn(kn_engine *e, const kn_layer *ly, const float *h, int64_t n, int64_t solo);

/* ---- forward_mla.c ---- */
/* The latent-attention scratch for n tokens (grown on demand); 0 at once for other models. */
int kn_engine_mla_reserve(kn_engine *e, int64_t n);
void kn_engine_mla_free(kn_engine *e);
/* Local layer li's attention block on latent KV: x += allreduce(attention(h) Wo), h the
 * layer's normed input; writes the layer's latent KV of the batch into kv. */
int kn_engine_mla_attention(kn_engine *e, kn_kv_pool *kv, const kn_batch *b, int li,
                            const float *h);

/* Every weight matrix and vector of the shard, mapped into the device backend
 * (ops->map_matrix / map_vector). */
int kn_engine_map_model(kn_engine *e);
/* db = b with every array in backend memory (b already validated against kv). A staged
 * pool (kv_pool.h: host copy for the KV transfer) first gets every block the batch reads
 * but does not write uploaded, unless its device copy is current (on_dev); the blocks the
 * batch writes are current after it. */
int kn_engine_stage_batch(kn_engine *e, kn_kv_pool *kv, const kn_batch *b, kn_batch *db);
/* A device buffer for n floats of logits (grown on demand), or NULL. */
float *kn_engine_stage_out(kn_engine *e, int64_t n);
void kn_engine_stage_free(kn_engine *e);
/* Tensor parallelism on a device backend, through host memory (tp > 1 only):
 * allreduce: buf (n floats, backend memory) downloaded, summed across the ranks by the
 * host collective, uploaded back. gather: each rank's logit slice part (rows, its
 * n_vocab_local columns, backend memory) downloaded and gathered into rank 0's host out
 * (rows, n_vocab); other ranks pass out NULL. Each moves 4 bytes a float each way per
 * rank over the host link (docs/gpu.md has the sums). */
int kn_engine_allreduce_staged(kn_engine *e, float *buf, int64_t n);
/* The staged all-reduce in two halves (a two-batch overlap micro-batch): post downloads buf
 * into the engine's host staging and posts it; wait waits for the sum there and uploads it
 * into buf. Nothing else may stage on the engine in between. */
int kn_engine_allreduce_post_staged(kn_engine *e, const float *buf, int64_t n, uint64_t *ticket);
int kn_engine_allreduce_wait_staged(kn_engine *e, uint64_t ticket, float *buf, int64_t n);
int kn_engine_gather_staged(kn_engine *e, const float *part, int64_t rows, float *out);

#endif
