/* td_dtype.h: tensor element types as GGUF numbers them (ggml_type), their block
 * geometry, and fp16/bf16 scalar conversions.
 *
 * Invariants: a row of ne0 elements of type t occupies ne0 / blck * type_size bytes and
 * ne0 must be a multiple of blck. Types the reader knows but the kernels cannot compute
 * with are still sized here, so a file holding them parses and the error names the type.
 * Threading: pure functions.
 */
#ifndef TD_DTYPE_H
#define TD_DTYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef enum {
    TD_F32 = 0,
    TD_F16 = 1,
    TD_Q4_0 = 2,
    TD_Q4_1 = 3,
    TD_Q5_0 = 6,
    TD_Q5_1 = 7,
    TD_Q8_0 = 8,
    TD_Q8_1 = 9,
    TD_Q2_K = 10,
    TD_Q3_K = 11,
    TD_Q4_K = 12,
    TD_Q5_K = 13,
    TD_Q6_K = 14,
    TD_Q8_K = 15,
    TD_IQ4_NL = 20,
    TD_IQ4_XS = 23,
    TD_I8 = 24,
    TD_I16 = 25,
    TD_I32 = 26,
    TD_I64 = 27,
    TD_F64 = 28,
    TD_BF16 = 30,
    TD_DTYPE_COUNT = 40, /* upper bound of the numbering, not a type */
} td_dtype;

typedef struct {
    const char *name;   /* "Q4_1"; NULL when the number is not a known type */
    uint32_t blck;      /* elements per block */
    uint32_t type_size; /* bytes per block */
} td_dtype_info;

/* NULL when t is not a known type. */
const td_dtype_info *td_dtype_get(uint32_t t);
const char *td_dtype_name(uint32_t t); /* "unknown(N)" style text for unknown types */

/* Bytes of a row of ne0 elements; 0 when ne0 is not a multiple of the block size. */
size_t td_dtype_row_bytes(td_dtype t, int64_t ne0);

/* Block layouts of the quantized types the kernels compute with (as in ggml). */
#define TD_QK 32
typedef struct {
    uint16_t d;
    uint8_t qs[TD_QK / 2];
} td_block_q4_0; /* 18 bytes */
typedef struct {
    uint16_t d, m;
    uint8_t qs[TD_QK / 2];
} td_block_q4_1; /* 20 bytes */
typedef struct {
    uint16_t d;
    int8_t qs[TD_QK];
} td_block_q8_0; /* 34 bytes */
/* Q5_0/Q5_1: bit i of qh (little-endian) is the 5th bit of weight i; the low nibbles are
 * stored as in Q4_0/Q4_1. */
typedef struct {
    uint16_t d;
    uint8_t qh[4];
    uint8_t qs[TD_QK / 2];
} td_block_q5_0; /* 22 bytes */
typedef struct {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[TD_QK / 2];
} td_block_q5_1; /* 24 bytes */

static inline float td_fp32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint32_t td_fp32_to_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* IEEE half -> float, exact for every input including subnormals, inf and nan. */
static inline float td_fp16_to_fp32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0x1f) return td_fp32_from_bits(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        if (mant == 0) return td_fp32_from_bits(sign);
        /* subnormal: value = mant * 2^-24 */
        float v = (float)mant * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    return td_fp32_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
}

/* float -> IEEE half, round to nearest even, overflow to inf. */
uint16_t td_fp32_to_fp16(float f);

static inline float td_bf16_to_fp32(uint16_t b)
{
    return td_fp32_from_bits((uint32_t)b << 16);
}
uint16_t td_fp32_to_bf16(float f); /* round to nearest even; nan stays nan */

#endif
