/* cpu_q8gemm.c: the q8 mode's integer GEMM for 32-block weights (Q4_0, Q4_1, Q5_0, Q8_0),
 * every m (decode, batched decode, prefill); see cpu_q8act.h for the contract.
 *
 * Per group of G rows of W (16 with AVX512-VNNI, 8 with AVX2) the raw blocks are unpacked
 * once per call into a panel in the thread's scratch: per block 8 vectors of G int32 lanes,
 * lane r of vector t holding elements 4t..4t+3 of row r as unsigned bytes (q plus a bias:
 * Q4_0 8, Q5_0 16, Q8_0 128 with VNNI; AVX2 keeps Q8_0 signed), then G float d and G float
 * mins (Q4_1). The unpack is a 4x4 dword transpose of 16-byte row loads per 128-bit lane.
 * The microkernel runs up to four rows of x against the panel: per block and row of x,
 * 8 vpdpbusd (or maddubs + madd) of the panel vectors with the broadcast dwords of x give
 * the G exact int32 dots, then per lane, i.e. per row r of W and row j of x:
 *   s    = dot(u, xq) - bias * xsum        (exact integer, |s| < 2^24)
 *   acc  = fma((float)s, d_r * xd_j, acc)  (d_r * xd_j rounded once)
 *   acc  = fma(min_r, xd_j * (float)xsum, acc)   (Q4_1 only)
 * in block order; y = acc. Every operation is elementwise in (r, j), so a row's result
 * does not depend on the other rows of x or W, on the tile it falls in, the thread count,
 * or the ISA (the AVX2 and VNNI paths give the same bits).
 * A matrix the engine registered (cpu_packed.c) is packed once with VNNI (kn_q8_gemm_pack):
 * the transpose and the scale gathers are done at its first product and kept, so m <= 4 rows
 * of x read the packed blocks straight into the microkernel and larger m expand a group
 * into the panel with a mask and a shift; the operations on each lane are the ones above, so
 * the bits are those of the per-call panel. At m = 1 the per-call unpack cost more than the
 * dots (the decode step's products at 8-10 GB/s; packed, 21-29 GB/s).
 * With AMX-INT8 (kn_q8_gemm_amx) a call of Q8A_MIN_M rows of x or more runs the same panels, a
 * few groups at a time, against tiles of 16 rows of x (cpu_q8amx.h): the same bits.
 */
#include <cpuid.h>
#include <immintrin.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_q8act.h"
#include "cpu_q8amx.h"
#include "cpu_q8vnni.h"
#include "cpu_quant.h"
#include "cpu_traits.h"

#define Q8G_VEC_BYTES(g) ((size_t)(g)*4)

/* arch_prctl's request for an extended state component, and AMX's tile data (asm/prctl.h) */
#define Q8G_ARCH_REQ_XCOMP_PERM 0x1023
#define Q8G_XFEATURE_XTILEDATA  18

KN_ALWAYS_INLINE size_t q8g_bs(td_dtype t)
{
    return t == TD_Q8_0 ? 34 : t == TD_Q4_1 ? 20 : t == TD_Q5_0 ? 22 : 18;
}

KN_ALWAYS_INLINE int q8g_qoff(td_dtype t)
{
    return t == TD_Q4_1 ? 4 : t == TD_Q5_0 ? 6 : 2;
}

size_t kn_q8_gemm_panel_bytes(int64_t n_cols)
{
    const size_t nb = (size_t)(n_cols / TD_QK), panel = nb * 10 * Q8G_VEC_BYTES(16);
    /* AMX runs q8a_groups panels at once, with 16 floats per block after them (q8a_rows' xds),
     * whether or not kn_q8_gemm_force_amx_off holds */
    return kn_q8_amx_usable() ? (size_t)q8a_groups(panel) * panel + nb * 64 : panel;
}

bool kn_q8_gemm_supported(const kn_mat *w)
{
    const kn_cpu_traits *tr = kn_cpu_traits_of(w->type);
    return tr && tr->q8_gemm256 && w->row_stride <= INT32_MAX / 16;
}

static atomic_int q8g_isa_sel = -1; /* -1 not chosen, 0 AVX2, 1 VNNI */
static atomic_bool q8g_force_avx2;
static atomic_int q8g_amx_sel = -1; /* -1 not chosen, 0 no AMX, 1 AMX-INT8 usable */
static atomic_bool q8g_amx_off;

/* Whether this process may run AMX-INT8: the CPU lists AMX-TILE and AMX-INT8, the OS enabled
 * their state (XCR0 bits 17, 18), the kernel grants the tile data permission (a VM may list
 * AMX and still refuse it: then no AMX, never a SIGILL), and TANDEM_CPU_AMX is not 0. */
static bool q8g_amx_probe(void)
{
    const char *env = getenv("TANDEM_CPU_AMX");
    if (env && !strcmp(env, "0")) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE)) return false;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
        return false;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
    return syscall(SYS_arch_prctl, Q8G_ARCH_REQ_XCOMP_PERM, Q8G_XFEATURE_XTILEDATA) == 0;
}

static bool q8g_vnni(void)
{
    int s = atomic_load_explicit(&q8g_isa_sel, memory_order_relaxed);
    if (s < 0) {
        __builtin_cpu_init();
        s = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
        atomic_store_explicit(&q8g_isa_sel, s, memory_order_relaxed);
    }
    return s && !atomic_load_explicit(&q8g_force_avx2, memory_order_relaxed);
}

void kn_q8_gemm_force_avx2(bool on)
{
    atomic_store(&q8g_force_avx2, on);
}

bool kn_q8_amx_usable(void)
{
    int s = atomic_load_explicit(&q8g_amx_sel, memory_order_relaxed);
    if (s < 0) {
        __builtin_cpu_init();
        s = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
            q8g_amx_probe();
        atomic_store_explicit(&q8g_amx_sel, s, memory_order_relaxed);
    }
    return s;
}

bool kn_q8_gemm_amx(void)
{
    return q8g_vnni() && kn_q8_amx_usable() &&
           !atomic_load_explicit(&q8g_amx_off, memory_order_relaxed);
}

void kn_q8_gemm_force_amx_off(bool on)
{
    atomic_store(&q8g_amx_off, on);
}

const char *kn_q8_gemm_isa(void)
{
    return kn_q8_gemm_amx() ? "amx-int8" : q8g_vnni() ? "avx512vnni" : "avx2";
}

/* Whether a GEMM over m rows of x runs its tiles on AMX. */
static bool q8g_use_amx(int64_t m)
{
    return m >= Q8A_MIN_M && kn_q8_gemm_amx();
}

int kn_q8_gemm_group_rows(void)
{
    return q8g_vnni() ? 16 : 8;
}

/* ---- AVX512-VNNI: groups of 16 rows ---- */

Q8G_I512 void pack512(td_dtype t, const uint8_t *w, const int32_t *idx, int64_t nb, size_t next,
                      uint8_t *panel)
{
    const __m512i vi = _mm512_loadu_si512(idx), m4 = _mm512_set1_epi8(0x0f);
    const size_t bs = q8g_bs(t);
    const int64_t pf_every = 64 / (int64_t)bs;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + (size_t)b * bs;
        if (b % pf_every == 0)
            for (int r = 0; r < 16; r++)
                __builtin_prefetch(p + idx[r] + next);
        uint8_t *o = panel + (size_t)b * Q8G_PANEL_BLOCK;
        __m512i T[4], V[8];
        tr16(p, idx, q8g_qoff(t), T);
        if (t == TD_Q8_0) {
            __m512i U[4];
            tr16(p, idx, 18, U);
            KN_UNROLL
            for (int u = 0; u < 4; u++) {
                V[u] = _mm512_xor_si512(T[u], _mm512_set1_epi8((char)0x80));
                V[4 + u] = _mm512_xor_si512(U[u], _mm512_set1_epi8((char)0x80));
            }
        } else {
            KN_UNROLL
            for (int u = 0; u < 4; u++) {
                V[u] = _mm512_and_si512(T[u], m4);
                V[4 + u] = _mm512_and_si512(_mm512_srli_epi32(T[u], 4), m4);
            }
        }
        if (t == TD_Q5_0) {
            const __m512i h = _mm512_i32gather_epi32(vi, (const void *)(p + 2), 1);
            KN_UNROLL
            for (int u = 0; u < 8; u++)
                V[u] = _mm512_or_si512(V[u], spread16(_mm512_srli_epi32(h, 4 * u)));
        }
        KN_UNROLL
        for (int u = 0; u < 8; u++)
            _mm512_storeu_si512(o + 64 * u, V[u]);
        const __m512i g = _mm512_i32gather_epi32(vi, (const void *)p, 1);
        _mm512_storeu_ps(o + Q8G_PANEL_D, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
        if (t == TD_Q4_1)
            _mm512_storeu_ps(o + Q8G_PANEL_MIN,
                             _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))));
    }
}

Q8G_I512 void groups512(td_dtype t, const kn_mat *w, const kn_q8b *xq, int64_t m, float *y,
                        int64_t g0, int64_t g1, uint8_t *panel)
{
    const int64_t nb = w->n_cols / TD_QK;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t r0 = 16 * g;
        int32_t idx[16];
        const int nr = q8g_group_idx(w, r0, 16, idx);
        pack512(t, (const uint8_t *)w->data + (size_t)r0 * w->row_stride, idx, nb,
                16 * w->row_stride, panel);
        rows512(t, panel, xq, m, nb, y + r0, w->n_rows, nr);
    }
}

/* groups512 with the rows of x on AMX (cpu_q8amx.h): the same panel, the same bits. */
Q8G_IAMX void groups_amx(td_dtype t, const kn_mat *w, const kn_q8b *xq, int64_t m, float *y,
                         int64_t g0, int64_t g1, uint8_t *panel)
{
    const int64_t nb = w->n_cols / TD_QK;
    const size_t pstride = (size_t)nb * Q8G_PANEL_BLOCK;
    const int G = q8a_groups(pstride);
    float *xds = (float *)(void *)(panel + (size_t)G * pstride);
    int cfg = 0;
    for (int64_t gb = g0; gb < g1; gb += G) {
        const int ng = (int)(g1 - gb < G ? g1 - gb : G);
        int nr = 16;
        for (int k = 0; k < ng; k++) {
            const int64_t r0 = 16 * (gb + k);
            int32_t idx[16];
            nr = q8g_group_idx(w, r0, 16, idx);
            pack512(t, (const uint8_t *)w->data + (size_t)r0 * w->row_stride, idx, nb,
                    16 * w->row_stride, panel + (size_t)k * pstride);
            q8a_unbias(t, panel + (size_t)k * pstride, nb);
        }
        q8a_rows(t, panel, pstride, ng, nr, xq, m, nb, y + 16 * gb, w->n_rows, xds, &cfg);
    }
    _tile_release();
}

/* The VNNI GEMM kernels of cpu_traits.h's table (per-call panel), one copy per type; from
 * Q8A_MIN_M rows of x on, AMX where the process may use it. */
#define Q8G_GEMM512(name, T)                                                                       \
    static Q8G_TAMX void name##_amx(const kn_mat *w, const void *xq, int64_t m, float *y,          \
                                    int64_t g0, int64_t g1, void *panel)                           \
    {                                                                                              \
        groups_amx(T, w, xq, m, y, g0, g1, panel);                                                 \
    }                                                                                              \
    Q8G_T512 void name(const kn_mat *w, const void *packed, const void *xq, int64_t m, float *y,   \
                       int64_t g0, int64_t g1, void *panel)                                        \
    {                                                                                              \
        (void)packed;                                                                              \
        if (q8g_use_amx(m))                                                                        \
            name##_amx(w, xq, m, y, g0, g1, panel);                                                \
        else                                                                                       \
            groups512(T, w, xq, m, y, g0, g1, panel);                                              \
    }
Q8G_GEMM512(kn_q8g_gemm512_q4_0, TD_Q4_0)
Q8G_GEMM512(kn_q8g_gemm512_q4_1, TD_Q4_1)
Q8G_GEMM512(kn_q8g_gemm512_q5_0, TD_Q5_0)
Q8G_GEMM512(kn_q8g_gemm512_q8_0, TD_Q8_0)

/* ---- AVX512-VNNI: W packed once (kn_q8_gemm_pack) ----
 * The panel of a group is pack512's work minus the part that depends on m: the transposed
 * quant dwords are stored as they are (Q4_0/Q4_1: the 4 vectors of raw nibble bytes, whose
 * low and high nibbles become the panel's 8 vectors with one mask and one shift; Q8_0: the 8
 * biased vectors; Q5_0: the nibbles and the gathered high bits), then the 16 f16 d and, for
 * Q4_1, the 16 f16 mins. A block of 16 rows takes as many bytes as the 16 raw blocks (Q4_0 288,
 * Q4_1 320, Q5_0 352, Q8_0 544), the groups end to end. */

/* 64-byte vectors before the scales: Q8_0's 8 biased quant vectors; the 4 nibble vectors,
 * and for Q5_0 a fifth, lane r holding row r's 32 high bits (qh). */
KN_ALWAYS_INLINE int q8p_qvecs(td_dtype t)
{
    return t == TD_Q8_0 ? 8 : t == TD_Q5_0 ? 5 : 4;
}

KN_ALWAYS_INLINE size_t q8p_block_bytes(td_dtype t)
{
    return (size_t)q8p_qvecs(t) * 64 + (t == TD_Q4_1 ? 64 : 32);
}

Q8G_I512 void repack512(td_dtype t, const uint8_t *w, const int32_t *idx, int64_t nb, uint8_t *out)
{
    const __m512i vi = _mm512_loadu_si512(idx);
    const size_t bs = q8g_bs(t), pb = q8p_block_bytes(t);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + (size_t)b * bs;
        uint8_t *o = out + (size_t)b * pb;
        __m512i T[4];
        tr16(p, idx, q8g_qoff(t), T);
        if (t == TD_Q8_0) {
            __m512i U[4];
            tr16(p, idx, 18, U);
            KN_UNROLL
            for (int u = 0; u < 4; u++) {
                _mm512_storeu_si512(o + 64 * u,
                                    _mm512_xor_si512(T[u], _mm512_set1_epi8((char)0x80)));
                _mm512_storeu_si512(o + 64 * (4 + u),
                                    _mm512_xor_si512(U[u], _mm512_set1_epi8((char)0x80)));
            }
        } else {
            KN_UNROLL
            for (int u = 0; u < 4; u++)
                _mm512_storeu_si512(o + 64 * u, T[u]);
            if (t == TD_Q5_0)
                _mm512_storeu_si512(o + 256, _mm512_i32gather_epi32(vi, (const void *)(p + 2), 1));
        }
        /* the first dword of each block: d, then (Q4_1) the min */
        const __m512i g = _mm512_i32gather_epi32(vi, (const void *)p, 1);
        uint8_t *h = o + 64 * q8p_qvecs(t);
        _mm256_storeu_si256((void *)h, _mm512_cvtepi32_epi16(g));
        if (t == TD_Q4_1)
            _mm256_storeu_si256((void *)(h + 32), _mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
    }
}

/* Packed block o as pack512 leaves it in the panel: the 8 quant vectors, d and the mins. */
Q8G_I512 void unpack512(td_dtype t, const uint8_t *o, __m512i V[8], __m512 *dv, __m512 *mv)
{
    if (t == TD_Q8_0) {
        KN_UNROLL
        for (int u = 0; u < 8; u++)
            V[u] = _mm512_loadu_si512(o + 64 * u);
    } else {
        const __m512i m4 = _mm512_set1_epi8(0x0f);
        KN_UNROLL
        for (int u = 0; u < 4; u++) {
            const __m512i n = _mm512_loadu_si512(o + 64 * u);
            V[u] = _mm512_and_si512(n, m4);
            V[4 + u] = _mm512_and_si512(_mm512_srli_epi32(n, 4), m4);
        }
        if (t == TD_Q5_0) {
            const __m512i h = _mm512_loadu_si512(o + 256);
            KN_UNROLL
            for (int u = 0; u < 8; u++)
                V[u] = _mm512_or_si512(V[u], spread16(_mm512_srli_epi32(h, 4 * u)));
        }
    }
    const uint8_t *h = o + 64 * q8p_qvecs(t);
    *dv = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)h));
    *mv = t == TD_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(h + 32)))
                       : _mm512_setzero_ps();
}

/* tile512 reading the packed group gp (its panel is never written): the same operations in
 * the same order, so the same bits. For m <= 4, where a panel would be read only once. */
Q8G_I512 void tile512p(td_dtype t, int M, const uint8_t *gp, const kn_q8b *xb, int64_t xs,
                       int64_t nb, float *y, int64_t ldy, int nr)
{
    const size_t pb = q8p_block_bytes(t);
    __m512 acc[4];
    KN_UNROLL
    for (int j = 0; j < M; j++)
        acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = gp + (size_t)b * pb;
        for (size_t off = 0; off < pb; off += 64) /* the group streams: 8 blocks ahead */
            __builtin_prefetch(o + 8 * pb + off);
        __m512i V[8];
        __m512 dv, mv;
        unpack512(t, o, V, &dv, &mv);
        block512(t, M, V, dv, mv, xb, xs, b, acc);
    }
    const __mmask16 k = (__mmask16)((1u << nr) - 1);
    KN_UNROLL
    for (int j = 0; j < M; j++)
        _mm512_mask_storeu_ps(y + j * ldy, k, acc[j]);
}

/* The panel pack512 would make, from the packed group gp: for m > 4 rows of x. */
Q8G_I512 void expand512(td_dtype t, const uint8_t *gp, int64_t nb, uint8_t *panel)
{
    const size_t pb = q8p_block_bytes(t);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *o = panel + (size_t)b * Q8G_PANEL_BLOCK;
        __m512i V[8];
        __m512 dv, mv;
        unpack512(t, gp + (size_t)b * pb, V, &dv, &mv);
        KN_UNROLL
        for (int u = 0; u < 8; u++)
            _mm512_storeu_si512(o + 64 * u, V[u]);
        _mm512_storeu_ps(o + Q8G_PANEL_D, dv);
        if (t == TD_Q4_1) _mm512_storeu_ps(o + Q8G_PANEL_MIN, mv);
    }
}

Q8G_I512 void pgroups512(td_dtype t, const kn_mat *w, const uint8_t *packed, const kn_q8b *xq,
                         int64_t m, float *y, int64_t g0, int64_t g1, uint8_t *panel)
{
    const int64_t nb = w->n_cols / TD_QK;
    const size_t gbytes = (size_t)nb * q8p_block_bytes(t);
    for (int64_t g = g0; g < g1; g++) {
        const int64_t r0 = 16 * g;
        const int nr = (int)(w->n_rows - r0 < 16 ? w->n_rows - r0 : 16);
        const uint8_t *gp = packed + (size_t)g * gbytes;
        switch (m) {
        case 1:
            tile512p(t, 1, gp, xq, nb, nb, y + r0, w->n_rows, nr);
            break;
        case 2:
            tile512p(t, 2, gp, xq, nb, nb, y + r0, w->n_rows, nr);
            break;
        case 3:
            tile512p(t, 3, gp, xq, nb, nb, y + r0, w->n_rows, nr);
            break;
        case 4:
            tile512p(t, 4, gp, xq, nb, nb, y + r0, w->n_rows, nr);
            break;
        default:
            expand512(t, gp, nb, panel);
            rows512(t, panel, xq, m, nb, y + r0, w->n_rows, nr);
            break;
        }
    }
}

/* pgroups512's expand512 branch with the rows of x on AMX: the same panel, the same bits. */
Q8G_IAMX void pgroups_amx(td_dtype t, const kn_mat *w, const uint8_t *packed, const kn_q8b *xq,
                          int64_t m, float *y, int64_t g0, int64_t g1, uint8_t *panel)
{
    const int64_t nb = w->n_cols / TD_QK;
    const size_t gbytes = (size_t)nb * q8p_block_bytes(t), pstride = (size_t)nb * Q8G_PANEL_BLOCK;
    const int G = q8a_groups(pstride);
    float *xds = (float *)(void *)(panel + (size_t)G * pstride);
    int cfg = 0;
    for (int64_t gb = g0; gb < g1; gb += G) {
        const int ng = (int)(g1 - gb < G ? g1 - gb : G);
        for (int k = 0; k < ng; k++) {
            expand512(t, packed + (size_t)(gb + k) * gbytes, nb, panel + (size_t)k * pstride);
            q8a_unbias(t, panel + (size_t)k * pstride, nb);
        }
        const int64_t rl = 16 * (gb + ng - 1); /* the last group's first row */
        const int nr = (int)(w->n_rows - rl < 16 ? w->n_rows - rl : 16);
        q8a_rows(t, panel, pstride, ng, nr, xq, m, nb, y + 16 * gb, w->n_rows, xds, &cfg);
    }
    _tile_release();
}

/* The VNNI GEMM kernels of cpu_traits.h's table through W packed, one copy per type; from
 * Q8A_MIN_M rows of x on, AMX where the process may use it. */
#define Q8G_PGEMM512(name, T)                                                                      \
    static Q8G_TAMX void name##_amx(const kn_mat *w, const void *packed, const void *xq,           \
                                    int64_t m, float *y, int64_t g0, int64_t g1, void *panel)      \
    {                                                                                              \
        pgroups_amx(T, w, packed, xq, m, y, g0, g1, panel);                                        \
    }                                                                                              \
    Q8G_T512 void name(const kn_mat *w, const void *packed, const void *xq, int64_t m, float *y,   \
                       int64_t g0, int64_t g1, void *panel)                                        \
    {                                                                                              \
        if (q8g_use_amx(m) && m > 4)                                                               \
            name##_amx(w, packed, xq, m, y, g0, g1, panel);                                        \
        else                                                                                       \
            pgroups512(T, w, packed, xq, m, y, g0, g1, panel);                                     \
    }
Q8G_PGEMM512(kn_q8g_pgemm512_q4_0, TD_Q4_0)
Q8G_PGEMM512(kn_q8g_pgemm512_q4_1, TD_Q4_1)
Q8G_PGEMM512(kn_q8g_pgemm512_q5_0, TD_Q5_0)
Q8G_PGEMM512(kn_q8g_pgemm512_q8_0, TD_Q8_0)

Q8G_I512 void repack_groups512(td_dtype t, const kn_mat *w, void *packed, int64_t g0, int64_t g1)
{
    const int64_t nb = w->n_cols / TD_QK;
    const size_t gbytes = (size_t)nb * q8p_block_bytes(t);
    for (int64_t g = g0; g < g1; g++) {
        const int64_t r0 = 16 * g;
        int32_t idx[16];
        (void)q8g_group_idx(w, r0, 16, idx);
        const uint8_t *src = (const uint8_t *)w->data + (size_t)r0 * w->row_stride;
        uint8_t *dst = (uint8_t *)packed + (size_t)g * gbytes;
        repack512(t, src, idx, nb, dst);
    }
}

/* The VNNI packers of cpu_traits.h's table, one copy per type. */
#define Q8G_PACK(name, T)                                                                          \
    Q8G_T512 void name(const kn_mat *w, void *packed, int64_t g0, int64_t g1)                      \
    {                                                                                              \
        repack_groups512(T, w, packed, g0, g1);                                                    \
    }
Q8G_PACK(kn_q8g_pack_q4_0, TD_Q4_0)
Q8G_PACK(kn_q8g_pack_q4_1, TD_Q4_1)
Q8G_PACK(kn_q8g_pack_q5_0, TD_Q5_0)
Q8G_PACK(kn_q8g_pack_q8_0, TD_Q8_0)

size_t kn_q8_gemm_packed_bytes(const kn_mat *w)
{
    const td_dtype t = w->type;
    if (!kn_q8_gemm_supported(w) || !q8g_vnni() || w->n_rows < 1) return 0;
    return (size_t)((w->n_rows + 15) / 16) * (size_t)(w->n_cols / TD_QK) * q8p_block_bytes(t);
}

void kn_q8_gemm_pack(const kn_mat *w, void *packed, int64_t g0, int64_t g1)
{
    kn_cpu_traits_of(w->type)->q8_pack(w, packed, g0, g1);
}

/* ---- AVX2: groups of 8 rows, maddubs + madd ---- */

/* T[u] lane r = dword u of the 16 bytes at p + off of row r. */
KN_ALWAYS_INLINE void tr8(const uint8_t *p, const int32_t *idx, int off, __m256i T[4])
{
    __m256i Z[4];
    for (int k = 0; k < 4; k++)
        Z[k] = _mm256_loadu2_m128i((const void *)(p + idx[4 + k] + off),
                                   (const void *)(p + idx[k] + off));
    const __m256i t0 = _mm256_unpacklo_epi32(Z[0], Z[1]), t1 = _mm256_unpacklo_epi32(Z[2], Z[3]);
    const __m256i t2 = _mm256_unpackhi_epi32(Z[0], Z[1]), t3 = _mm256_unpackhi_epi32(Z[2], Z[3]);
    T[0] = _mm256_unpacklo_epi64(t0, t1);
    T[1] = _mm256_unpackhi_epi64(t0, t1);
    T[2] = _mm256_unpacklo_epi64(t2, t3);
    T[3] = _mm256_unpackhi_epi64(t2, t3);
}

KN_ALWAYS_INLINE __m256i spread8(__m256i v)
{
    v = _mm256_mullo_epi32(_mm256_and_si256(v, _mm256_set1_epi32(15)), _mm256_set1_epi32(0x204081));
    return _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x01010101)), 4);
}

KN_ALWAYS_INLINE void pack256(td_dtype t, const uint8_t *w, const int32_t *idx, int64_t nb,
                              size_t next, uint8_t *panel)
{
    const __m256i vi = _mm256_loadu_si256((const void *)idx), m4 = _mm256_set1_epi8(0x0f);
    const size_t bs = q8g_bs(t);
    const int64_t pf_every = 64 / (int64_t)bs;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + (size_t)b * bs;
        if (b % pf_every == 0)
            for (int r = 0; r < 8; r++)
                __builtin_prefetch(p + idx[r] + next);
        uint8_t *o = panel + (size_t)b * 10 * 32;
        __m256i T[4], V[8];
        tr8(p, idx, q8g_qoff(t), T);
        if (t == TD_Q8_0) {
            __m256i U[4];
            tr8(p, idx, 18, U);
            KN_UNROLL
            for (int u = 0; u < 4; u++)
                V[u] = T[u], V[4 + u] = U[u];
        } else {
            KN_UNROLL
            for (int u = 0; u < 4; u++) {
                V[u] = _mm256_and_si256(T[u], m4);
                V[4 + u] = _mm256_and_si256(_mm256_srli_epi32(T[u], 4), m4);
            }
        }
        if (t == TD_Q5_0) {
            const __m256i h = _mm256_i32gather_epi32((const void *)(p + 2), vi, 1);
            KN_UNROLL
            for (int u = 0; u < 8; u++)
                V[u] = _mm256_or_si256(V[u], spread8(_mm256_srli_epi32(h, 4 * u)));
        }
        KN_UNROLL
        for (int u = 0; u < 8; u++)
            _mm256_storeu_si256((void *)(o + 32 * u), V[u]);
        const __m256i g = _mm256_i32gather_epi32((const void *)p, vi, 1);
        const __m256i lo = _mm256_and_si256(g, _mm256_set1_epi32(0xffff));
        const __m128i d16 =
            _mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
        _mm256_storeu_ps((float *)(void *)(o + 256), _mm256_cvtph_ps(d16));
        if (t == TD_Q4_1) {
            const __m256i hi = _mm256_srli_epi32(g, 16);
            const __m128i m16 =
                _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
            _mm256_storeu_ps((float *)(void *)(o + 288), _mm256_cvtph_ps(m16));
        }
    }
}

KN_ALWAYS_INLINE void tile256(td_dtype t, int M, const uint8_t *panel, const kn_q8b *xb, int64_t xs,
                              int64_t nb, float *y, int64_t ldy, int nr)
{
    const int bias = q8g_bias(t, false);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    KN_UNROLL
    for (int j = 0; j < M; j++)
        acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = panel + (size_t)b * 10 * 32;
        __m256i ia[4];
        KN_UNROLL
        for (int j = 0; j < M; j++)
            ia[j] = _mm256_setzero_si256();
        KN_UNROLL
        for (int u = 0; u < 8; u++) {
            const __m256i wv = _mm256_loadu_si256((const void *)(o + 32 * u));
            /* Q8_0: |w| and x with w's signs, so the pair sums stay below 2^15 */
            const __m256i wa = t == TD_Q8_0 ? _mm256_sign_epi8(wv, wv) : wv;
            KN_UNROLL
            for (int j = 0; j < M; j++) {
                int32_t xd4;
                memcpy(&xd4, xb[j * xs + b].qs + 4 * u, 4);
                __m256i xv = _mm256_set1_epi32(xd4);
                if (t == TD_Q8_0) xv = _mm256_sign_epi8(xv, wv);
                ia[j] =
                    _mm256_add_epi32(ia[j], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xv), ones));
            }
        }
        const __m256 dv = _mm256_loadu_ps((const float *)(const void *)(o + 256));
        KN_UNROLL
        for (int j = 0; j < M; j++) {
            const kn_q8b *x = &xb[j * xs + b];
            if (bias) ia[j] = _mm256_sub_epi32(ia[j], _mm256_set1_epi32(bias * x->sum));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[j]),
                                     _mm256_mul_ps(dv, _mm256_set1_ps(x->d)), acc[j]);
            if (t == TD_Q4_1)
                acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps((const float *)(const void *)(o + 288)),
                                         _mm256_set1_ps(x->d * (float)x->sum), acc[j]);
        }
    }
    KN_UNROLL
    for (int j = 0; j < M; j++) {
        float tmp[8];
        _mm256_storeu_ps(tmp, acc[j]);
        memcpy(y + j * ldy, tmp, (size_t)nr * sizeof(float));
    }
}

KN_ALWAYS_INLINE void groups256(td_dtype t, const kn_mat *w, const kn_q8b *xq, int64_t m, float *y,
                                int64_t g0, int64_t g1, uint8_t *panel)
{
    const int64_t nb = w->n_cols / TD_QK;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t r0 = 8 * g;
        int32_t idx[8];
        const int nr = q8g_group_idx(w, r0, 8, idx);
        pack256(t, (const uint8_t *)w->data + (size_t)r0 * w->row_stride, idx, nb,
                16 * w->row_stride, panel);
        int64_t i = 0;
        for (; i + 4 <= m; i += 4)
            tile256(t, 4, panel, xq + i * nb, nb, nb, y + i * w->n_rows + r0, w->n_rows, nr);
        for (; i < m; i++)
            tile256(t, 1, panel, xq + i * nb, nb, nb, y + i * w->n_rows + r0, w->n_rows, nr);
    }
}

/* The AVX2 GEMM kernels of cpu_traits.h's table, one copy per type. */
#define Q8G_GEMM256(name, T)                                                                       \
    void name(const kn_mat *w, const void *packed, const void *xq, int64_t m, float *y,            \
              int64_t g0, int64_t g1, void *panel)                                                 \
    {                                                                                              \
        (void)packed;                                                                              \
        groups256(T, w, xq, m, y, g0, g1, panel);                                                  \
    }
Q8G_GEMM256(kn_q8g_gemm256_q4_0, TD_Q4_0)
Q8G_GEMM256(kn_q8g_gemm256_q4_1, TD_Q4_1)
Q8G_GEMM256(kn_q8g_gemm256_q5_0, TD_Q5_0)
Q8G_GEMM256(kn_q8g_gemm256_q8_0, TD_Q8_0)

void kn_q8_gemm(const kn_mat *w, const void *packed, const void *xq, int64_t m, float *y, int G,
                int64_t g0, int64_t g1, void *panel)
{
    const kn_cpu_traits *tr = kn_cpu_traits_of(w->type); /* kn_q8_gemm_supported(w) */
    if (packed && G == 16)
        tr->q8_pgemm512(w, packed, xq, m, y, g0, g1, panel);
    else if (G == 16)
        tr->q8_gemm512(w, NULL, xq, m, y, g0, g1, panel);
    else
        tr->q8_gemm256(w, NULL, xq, m, y, g0, g1, panel);
}
