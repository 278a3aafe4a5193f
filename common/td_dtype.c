/* td_dtype.c: the type table and the rounding conversions to half precision. */
#include "td_dtype.h"

#include <stdio.h>

static const td_dtype_info infos[TD_DTYPE_COUNT] = {
    [TD_F32] = {"F32", 1, 4},         [TD_F16] = {"F16", 1, 2},
    [TD_Q4_0] = {"Q4_0", 32, 18},     [TD_Q4_1] = {"Q4_1", 32, 20},
    [TD_Q5_0] = {"Q5_0", 32, 22},     [TD_Q5_1] = {"Q5_1", 32, 24},
    [TD_Q8_0] = {"Q8_0", 32, 34},     [TD_Q8_1] = {"Q8_1", 32, 36},
    [TD_Q2_K] = {"Q2_K", 256, 84},    [TD_Q3_K] = {"Q3_K", 256, 110},
    [TD_Q4_K] = {"Q4_K", 256, 144},   [TD_Q5_K] = {"Q5_K", 256, 176},
    [TD_Q6_K] = {"Q6_K", 256, 210},   [TD_Q8_K] = {"Q8_K", 256, 292},
    [TD_IQ4_NL] = {"IQ4_NL", 32, 18}, [TD_IQ4_XS] = {"IQ4_XS", 256, 136},
    [TD_I8] = {"I8", 1, 1},           [TD_I16] = {"I16", 1, 2},
    [TD_I32] = {"I32", 1, 4},         [TD_I64] = {"I64", 1, 8},
    [TD_F64] = {"F64", 1, 8},         [TD_BF16] = {"BF16", 1, 2},
};

const td_dtype_info *td_dtype_get(uint32_t t)
{
    if (t >= TD_DTYPE_COUNT || !infos[t].name) return NULL;
    return &infos[t];
}

const char *td_dtype_name(uint32_t t)
{
    const td_dtype_info *i = td_dtype_get(t);
    return i ? i->name : "unknown";
}

size_t td_dtype_row_bytes(td_dtype t, int64_t ne0)
{
    const td_dtype_info *i = td_dtype_get(t);
    if (!i || ne0 <= 0 || ne0 % i->blck) return 0;
    return (size_t)(ne0 / i->blck) * i->type_size;
}

uint16_t td_fp32_to_fp16(float f)
{
    uint32_t x = td_fp32_to_bits(f);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) /* inf or nan */
        return (uint16_t)(sign | 0x7c00 | (absx > 0x7f800000u ? 0x200 : 0));
    if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds past 65504 */
    if (absx < 0x38800000u) {                                  /* result is subnormal or 0 */
        float a = td_fp32_from_bits(absx);
        /* scale so that the half subnormal unit is 1, then round to nearest even */
        float scaled = a * 16777216.0f;
        uint32_t m = (uint32_t)scaled;
        float rem = scaled - (float)m;
        if (rem > 0.5f || (rem == 0.5f && (m & 1))) m++;
        return (uint16_t)(sign | m);
    }
    uint32_t exp = ((absx >> 23) - 112) << 10;
    uint32_t mant = (absx >> 13) & 0x3ff;
    uint32_t low = absx & 0x1fff;
    uint32_t h = exp | mant;
    if (low > 0x1000 || (low == 0x1000 && (h & 1))) h++; /* carry may bump the exponent */
    return (uint16_t)(sign | h);
}

uint16_t td_fp32_to_bf16(float f)
{
    uint32_t x = td_fp32_to_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}
