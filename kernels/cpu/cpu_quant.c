/* cpu_quant.c: which weight types the CPU backend computes with (those of cpu_traits.h's
 * table), row dequantization (bit-exact with ggml's reference dequantizers and the gguf
 * python package), and the Q8_0 quantizer the loader re-quantizes tensor-parallel slices
 * with. */
#include <math.h>
#include <stdatomic.h>

#include "cpu_backend.h"
#include "cpu_quant.h"
#include "cpu_traits.h"
#include "td_err.h"

bool kn_cpu_type_supported(td_dtype t)
{
    return kn_cpu_traits_of(t) != NULL;
}

/* One log line per type and process: a model with an unsupported tensor would otherwise
 * print it on every layer of every step. */
void kn_cpu_log_unsupported(td_dtype t, const char *op)
{
    static atomic_uint_least64_t seen;
    uint64_t bit = (unsigned)t < 64 ? (uint64_t)1 << (unsigned)t : (uint64_t)1 << 63;
    if (atomic_fetch_or(&seen, bit) & bit) return;
    TD_LOG_ERR("%s: weight type %s (%d) not supported by the cpu backend", op,
               td_dtype_name((uint32_t)t), (int)t);
}

KN_ALWAYS_INLINE void dequant_blocks(td_dtype t, const uint8_t *src, float *dst, int64_t nb)
{
    const size_t bs = kn_q_block_bytes(t);
    for (int64_t b = 0; b < nb; b++, src += bs, dst += TD_QK) {
        kn_vf q[KN_NV];
        kn_q_load(t, src, q);
        const kn_vf d = kn_vset1(kn_h2f(src));
        if (kn_q_has_min(t)) {
            const kn_vf m = kn_vset1(kn_h2f(src + 2));
            for (int k = 0; k < KN_NV; k++) {
                kn_vf p = kn_vmul(q[k], d);
                KN_NO_CONTRACT(p); /* round q * d, then add m: as ggml and numpy do */
                kn_vstore(dst + k * KN_VL, kn_vadd(p, m));
            }
        } else {
            for (int k = 0; k < KN_NV; k++)
                kn_vstore(dst + k * KN_VL, kn_vmul(q[k], d));
        }
    }
}

KN_ALWAYS_INLINE void dequant_floats(td_dtype t, const uint8_t *src, float *dst, int64_t n)
{
    const size_t es = t == TD_F32 ? 4 : 2;
    if (t == TD_F32) {
        memcpy(dst, src, (size_t)n * 4);
        return;
    }
    int64_t i = 0;
    for (; i + KN_VL <= n; i += KN_VL)
        kn_vstore(dst + i, kn_f_load(t, src + (size_t)i * es));
    for (; i < n; i++)
        dst[i] = kn_f_load1(t, src + (size_t)i * es);
}

/* The row dequantizers of cpu_traits.h's table, one specialised copy per type. */
#define DEQUANT_BLOCKS(name, T)                                                                    \
    void name(const uint8_t *src, float *dst, int64_t n)                                           \
    {                                                                                              \
        dequant_blocks(T, src, dst, n / TD_QK);                                                    \
    }
#define DEQUANT_FLOATS(name, T)                                                                    \
    void name(const uint8_t *src, float *dst, int64_t n)                                           \
    {                                                                                              \
        dequant_floats(T, src, dst, n);                                                            \
    }
DEQUANT_FLOATS(kn_dequant_f32, TD_F32)
DEQUANT_FLOATS(kn_dequant_f16, TD_F16)
DEQUANT_FLOATS(kn_dequant_bf16, TD_BF16)
DEQUANT_BLOCKS(kn_dequant_q8_0, TD_Q8_0)
DEQUANT_BLOCKS(kn_dequant_q4_0, TD_Q4_0)
DEQUANT_BLOCKS(kn_dequant_q4_1, TD_Q4_1)
DEQUANT_BLOCKS(kn_dequant_q5_0, TD_Q5_0)
DEQUANT_BLOCKS(kn_dequant_q5_1, TD_Q5_1)
DEQUANT_BLOCKS(kn_dequant_iq4_nl, TD_IQ4_NL)

int kn_dequant_row(td_dtype t, const void *src, float *dst, int64_t n)
{
    const kn_cpu_traits *tr = kn_cpu_traits_of(t);
    if (!tr) {
        kn_cpu_log_unsupported(t, "dequant");
        return TD_EUNSUPP;
    }
    const td_dtype_info *info = td_dtype_get((uint32_t)t);
    if (n < 0 || n % info->blck) {
        TD_LOG_ERR("dequant: %lld elements is not a multiple of the %s block size %u", (long long)n,
                   info->name, info->blck);
        return TD_EINVAL;
    }
    tr->dequant(src, dst, n);
    return 0;
}

int kn_quant_row_q8_0(const float *src, void *dst, int64_t n)
{
    if (n < 0 || n % TD_QK) {
        TD_LOG_ERR("quantize q8_0: %lld elements is not a multiple of %d", (long long)n, TD_QK);
        return TD_EINVAL;
    }
    uint8_t *o = dst;
    for (int64_t b = 0; b < n / TD_QK; b++, src += TD_QK, o += 2 + TD_QK) {
        float amax = 0;
        for (int i = 0; i < TD_QK; i++)
            amax = fmaxf(amax, fabsf(src[i]));
        /* ggml's quantize_row_q8_0_ref and gguf.quants: the quants use the float32 scale
         * (x * (1 / d), rounded half away from zero); only the stored d is rounded to fp16 */
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const uint16_t dh = td_fp32_to_fp16(d);
        memcpy(o, &dh, 2);
        for (int i = 0; i < TD_QK; i++)
            o[2 + i] = (uint8_t)(int8_t)roundf(src[i] * id);
    }
    return 0;
}
