/* cpu_traits.c: the CPU backend's per-weight-type traits table (see cpu_traits.h). */
#include "cpu_traits.h"

#include "cpu_kquant_internal.h"

/* The 32-block types' integer slots (the q8 GEMM's four kernels, the q16 dot), named after the
 * type. */
#define Q8G_SLOTS(s)                                                                               \
    .q8_gemm512 = kn_q8g_gemm512_##s, .q8_pgemm512 = kn_q8g_pgemm512_##s,                          \
    .q8_gemm256 = kn_q8g_gemm256_##s, .q8_pack = kn_q8g_pack_##s, .q16_dot = kn_q16_dot_##s

static const kn_cpu_traits traits[TD_DTYPE_COUNT] = {
    [TD_F32] = {.dequant = kn_dequant_f32, .dot = kn_cpu_dot_f32},
    [TD_F16] = {.dequant = kn_dequant_f16, .dot = kn_cpu_dot_f16},
    [TD_BF16] = {.dequant = kn_dequant_bf16, .dot = kn_cpu_dot_bf16},
    [TD_Q8_0] = {.dequant = kn_dequant_q8_0,
                 .dot = kn_cpu_dot_q8_0,
                 .q8_block = TD_QK,
                 .q8_dot = kn_q8_dot_q8_0,
                 Q8G_SLOTS(q8_0)},
    [TD_Q4_0] = {.dequant = kn_dequant_q4_0,
                 .dot = kn_cpu_dot_q4_0,
                 .q8_block = TD_QK,
                 Q8G_SLOTS(q4_0)},
    [TD_Q4_1] = {.dequant = kn_dequant_q4_1,
                 .dot = kn_cpu_dot_q4_1,
                 .xsum_group = TD_QK,
                 .q8_block = TD_QK,
                 Q8G_SLOTS(q4_1)},
    [TD_Q5_0] = {.dequant = kn_dequant_q5_0,
                 .dot = kn_cpu_dot_q5_0,
                 .q8_block = TD_QK,
                 .q8_dot = kn_q8_dot_q5_0,
                 Q8G_SLOTS(q5_0)},
    [TD_Q5_1] = {.dequant = kn_dequant_q5_1, .dot = kn_cpu_dot_q5_1, .xsum_group = TD_QK},
    [TD_IQ4_NL] = {.dequant = kn_dequant_iq4_nl, .dot = kn_cpu_dot_iq4_nl},
    [TD_Q2_K] = {.dequant = kn_kq_dequant_q2_k, .dot = kn_kq_dot_q2_k, .xsum_group = 16},
    [TD_Q3_K] = {.dequant = kn_kq_dequant_q3_k, .dot = kn_kq_dot_q3_k},
    [TD_Q4_K] = {.dequant = kn_kq_dequant_q4_k,
                 .dot = kn_kq_dot_q4_k,
                 .xsum_group = KN_KQ_Q4K_XSUM_GROUP,
                 .q8_block = KN_QK_K,
                 .q8_dot = kn_q8_dot_q4_k,
                 .q8_dot_packed = kn_q8k_dot_packed_q4_k,
                 .q8_pack = kn_q8k_pack},
    [TD_Q5_K] = {.dequant = kn_kq_dequant_q5_k, .dot = kn_kq_dot_q5_k, .xsum_group = 32},
    [TD_Q6_K] = {.dequant = kn_kq_dequant_q6_k,
                 .dot = kn_kq_dot_q6_k,
                 .q8_block = KN_QK_K,
                 .q8_dot = kn_q8_dot_q6_k,
                 .q8_dot_packed = kn_q8k_dot_packed_q6_k,
                 .q8_pack = kn_q8k_pack},
    [TD_IQ4_XS] = {.dequant = kn_kq_dequant_iq4_xs, .dot = kn_kq_dot_iq4_xs},
};

const kn_cpu_traits *kn_cpu_traits_of(td_dtype t)
{
    return (unsigned)t < TD_DTYPE_COUNT && traits[t].dequant ? &traits[t] : NULL;
}
