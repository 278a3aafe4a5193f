/* cpu_backend.c: the CPU backend object and its ops table. */
#include "cpu_backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu_blas.h"
#include "cpu_internal.h"
#include "td_err.h"

/* ---- memory: host memory, so staging is a copy ---- */

static void *cpu_alloc(void *ctx, size_t bytes)
{
    (void)ctx;
    return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
}

static void cpu_free(void *ctx, void *p)
{
    (void)ctx;
    free(p);
}

static int cpu_copy(void *ctx, void *dst, const void *src, size_t bytes)
{
    (void)ctx;
    if (bytes) memcpy(dst, src, bytes);
    return 0;
}

static int cpu_synchronize(void *ctx)
{
    (void)ctx;
    return 0; /* every op returned when its threads were done */
}

static void cpu_destroy(void *ctx)
{
    kn_cpu_destroy(ctx);
}

static void cpu_describe(void *ctx, char *buf, size_t cap)
{
    const kn_cpu *c = ctx;
    /* the activation mode, the BLAS core and the AMX GEMMs too: a prefill stage's cached
     * profile (pf_pcache.c) is keyed on this text; the q8 mode prefills about twice as fast,
     * a BLAS core older than the CPU a third as fast, the AMX-BF16 products about 1.7-2x */
    kn_blas_info b;
    kn_blas_info_get(&b);
    const bool amx = kn_cpu_gemm_amx(c);
    snprintf(buf, cap, "cpu %s, %d thread%s, blas %s%s%s", kn_cpu_isa(), c->n_threads,
             c->n_threads == 1 ? "" : "s", b.core,
             c->act_q8    ? ", q8 activations"
             : c->act_q16 ? ", q16 activations"
                          : "",
             !amx        ? ""
             : c->act_q8 ? ", amx-int8 gemm"
                         : ", amx-bf16 gemm");
}

/* The ops-table form of attention (kn_backend.h): solo rows each cut as if alone. */
static void cpu_attention_op(void *ctx, const float *q, const void *kpool, const void *vpool,
                             td_dtype kv_type, int block_size, const kn_kv_slicing *slicing,
                             int n_heads, int n_kv_heads, int group, int phase, int head_dim,
                             float scale, int window, float softcap, int64_t m, int64_t m_solo,
                             const int32_t *pos, const int32_t *seq_of, const kn_seq_view *seqs,
                             float *out)
{
    kn_cpu_attention(ctx, q, kpool, vpool, kv_type, block_size, slicing, n_heads, n_kv_heads, group,
                     phase, head_dim, scale, window, softcap, m, m_solo, pos, seq_of, seqs, out);
}

#define CPU_OPS_COMMON                                                                             \
    .name = "cpu", .destroy = cpu_destroy, .describe = cpu_describe, .host_memory = true,          \
    .alloc = cpu_alloc, .free = cpu_free, .upload = cpu_copy, .download = cpu_copy,                \
    .synchronize = cpu_synchronize, .matmul = kn_cpu_matmul, .matmul_mixed = kn_cpu_matmul_mixed,  \
    .rmsnorm = kn_cpu_rmsnorm, .rope = kn_cpu_rope, .swiglu = kn_cpu_swiglu,                       \
    .geglu = kn_cpu_geglu, .kv_write = kn_cpu_kv_write, .attention = cpu_attention_op,             \
    .get_rows = kn_cpu_get_rows, .add = kn_cpu_add, .add_row = kn_cpu_add_row,                     \
    .scale = kn_cpu_scale, .copy_rows = kn_cpu_copy_rows,                                          \
    .weighted_rows_sum = kn_cpu_weighted_rows_sum, .copy_2d = kn_cpu_copy_2d, .kv_sliced = true,   \
    .map_matrix = kn_cpu_map_matrix

/* The table, with the fused ops (cpu_fused.c) and without them (TANDEM_CPU_FUSED=0). */
static const kn_backend_ops cpu_ops = {CPU_OPS_COMMON, .matmul_multi = kn_cpu_matmul_multi,
                                       .glu_ffn = kn_cpu_glu_ffn, .matmul_add = kn_cpu_matmul_add,
                                       .experts_ffn = kn_cpu_experts_ffn};
static const kn_backend_ops cpu_ops_unfused = {CPU_OPS_COMMON};

int kn_cpu_create(int n_threads, kn_cpu **out)
{
    *out = NULL;
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    const char *act = getenv("TANDEM_CPU_ACT");
    /* auto is resolved where a model is opened (kn_act_runtime_open, act_check.h), which then
     * sets the mode; a backend made without a model runs float32 */
    kn_cpu_act_mode mode = KN_CPU_ACT_F32;
    if (act && strcmp(act, "auto") && kn_cpu_act_parse(act, &mode)) {
        TD_LOG_ERR("cpu backend: TANDEM_CPU_ACT=%s: expected q8, q16, f32 or auto", act);
        return TD_EINVAL;
    }
    const char *fused = getenv("TANDEM_CPU_FUSED");
    if (fused && *fused && strcmp(fused, "0") && strcmp(fused, "1")) {
        TD_LOG_ERR("cpu backend: TANDEM_CPU_FUSED=%s: expected 0 or 1", fused);
        return TD_EINVAL;
    }
    const char *amx = getenv("TANDEM_CPU_AMX"); /* read by kn_q8_gemm_amx at its first call */
    if (amx && *amx && strcmp(amx, "0") && strcmp(amx, "1")) {
        TD_LOG_ERR("cpu backend: TANDEM_CPU_AMX=%s: expected 0 or 1", amx);
        return TD_EINVAL;
    }
    kn_cpu *c = calloc(1, sizeof *c);
    if (!c) return TD_ENOMEM;
    kn_cpu_set_act(c, mode);
    c->fused = !(fused && !strcmp(fused, "0"));
    int rc = kn_pool_create(n_threads, &c->pool);
    if (rc) {
        free(c);
        return rc;
    }
    c->n_threads = n_threads;
    *out = c;
    return 0;
}

void kn_cpu_destroy(kn_cpu *c)
{
    if (!c) return;
    kn_pool_destroy(c->pool);
    kn_cpu_packed_free(c);
    for (int t = 0; t <= KN_CPU_CALLER; t++)
        free(c->scratch[t]);
    free(c);
}

kn_backend kn_cpu_backend(kn_cpu *c)
{
    return (kn_backend){.ops = c->fused ? &cpu_ops : &cpu_ops_unfused, .ctx = c};
}
kn_cpu *kn_cpu_of(kn_backend b)
{
    return b.ops == &cpu_ops || b.ops == &cpu_ops_unfused ? b.ctx : NULL;
}
bool kn_cpu_fused(const kn_cpu *c)
{
    return c->fused;
}

kn_pool *kn_cpu_pool(kn_cpu *c)
{
    return c->pool;
}
int kn_cpu_n_threads(const kn_cpu *c)
{
    return c->n_threads;
}

void kn_cpu_set_act(kn_cpu *c, kn_cpu_act_mode a)
{
    c->act_q8 = a == KN_CPU_ACT_Q8;
    c->act_q16 = a == KN_CPU_ACT_Q16;
}
kn_cpu_act_mode kn_cpu_act(const kn_cpu *c)
{
    return c->act_q8 ? KN_CPU_ACT_Q8 : c->act_q16 ? KN_CPU_ACT_Q16 : KN_CPU_ACT_F32;
}
const char *kn_cpu_act_name(kn_cpu_act_mode a)
{
    return a == KN_CPU_ACT_Q8 ? "q8" : a == KN_CPU_ACT_Q16 ? "q16" : "f32";
}
int kn_cpu_act_parse(const char *s, kn_cpu_act_mode *out)
{
    static const kn_cpu_act_mode modes[] = {KN_CPU_ACT_F32, KN_CPU_ACT_Q8, KN_CPU_ACT_Q16};
    for (size_t i = 0; s && i < sizeof modes / sizeof *modes; i++)
        if (!strcmp(s, kn_cpu_act_name(modes[i]))) {
            *out = modes[i];
            return 0;
        }
    return TD_EINVAL;
}
void kn_cpu_set_act_q8(kn_cpu *c, bool on)
{
    kn_cpu_set_act(c, on ? KN_CPU_ACT_Q8 : KN_CPU_ACT_F32);
}
bool kn_cpu_act_q8(const kn_cpu *c)
{
    return c->act_q8;
}

const char *kn_cpu_isa(void)
{
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
}

float *kn_cpu_scratch(kn_cpu *c, int tid, size_t n_floats)
{
    if (tid < 0 || tid > KN_CPU_CALLER) return NULL;
    if (c->scratch_cap[tid] < n_floats) {
        free(c->scratch[tid]);
        c->scratch[tid] = NULL;
        c->scratch_cap[tid] = 0;
        void *p = NULL;
        if (posix_memalign(&p, 64, n_floats * sizeof(float))) return NULL;
        c->scratch[tid] = p;
        c->scratch_cap[tid] = n_floats;
    }
    return c->scratch[tid];
}

void kn_cpu_describe_paths(const kn_cpu *c, char *buf, size_t cap)
{
    kn_mat kinds[32];
    const size_t n = kn_cpu_mapped_kinds(c, kinds, sizeof kinds / sizeof *kinds);
    /* by type, so the text does not depend on where the weights were mapped (it is a
     * label of /metrics' tandem_instance_products_info) */
    for (size_t i = 1; i < n; i++)
        for (size_t k = i; k > 0 && kinds[k - 1].type > kinds[k].type; k--) {
            const kn_mat t = kinds[k];
            kinds[k] = kinds[k - 1];
            kinds[k - 1] = t;
        }
    size_t len = 0;
    if (cap) buf[0] = '\0';
    for (size_t i = 0; i < n && len < cap; i++) {
        const char *batch, *solo;
        kn_cpu_matmul_paths(c, &kinds[i], &batch, &solo);
        len += (size_t)snprintf(buf + len, cap - len, "%s%s: batch %s, solo %s", i ? "; " : "",
                                td_dtype_name(kinds[i].type), batch, solo);
    }
}

void kn_cpu_log_what_runs(const kn_cpu *c, const char *who)
{
    kn_blas_log(who, kn_cpu_isa());
    char paths[1024];
    kn_cpu_describe_paths(c, paths, sizeof paths);
    TD_LOG_INFO("%s: %s activations, %d thread%s; products by weight type: %s", who,
                c->act_q8    ? "q8"
                : c->act_q16 ? "q16"
                             : "float32",
                c->n_threads, c->n_threads == 1 ? "" : "s",
                paths[0] ? paths : "(no weights registered)");
}
