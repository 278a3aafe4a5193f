/* cpu_q8act.c: integer dot products of quantized weights with 8-bit activations (the q8
 * mode of the decode dot path; see cpu_q8act.h for the formats and the contract).
 *
 * Per weight block the raw quants (unsigned where the type has an offset) are dotted with
 * the int8 activations in integer lanes. K-types on AVX512-VNNI: 64 bytes at a time,
 * maddubs (u8 x s8 pairs to int16) then vpdpwssd by the sub-block scales as int16 (pairs
 * to int32, accumulated); elsewhere 32 bytes at a time, dot_us(u, s) = sums of 4 adjacent
 * u8 * s8 products (vpdpbusd with VNNI + VL, else maddubs + madd), times the scales.
 * maddubs never saturates here: |u| <= 128 (Q8_0's |w|), |s| <= 127, two products.
 *   Q4_K: y += xd (d sum_c sc[c] dot(q_c, x_c)) - xd dmin sum_c mn[c] csum_c
 *   Q6_K: y += xd d (sum_g sc[g] dot(q_g, x_g) - 32 sum_g sc[g] bsums[g]),  q_g in [0, 64)
 *   Q5_0: y += xd d dot(q - 16, x), signed quants by the sign trick (|w|, sign(x, w))
 *   Q8_0: y += xd d dot(q, x), likewise
 * 32-block types: the int32 lanes are converted to float and accumulated with one fma per
 * block by xd d into float lanes, summed once per row at the end. K-types: the lanes are
 * summed exactly per super-block (below 2^31), then one scalar sequence per super-block
 * (q4k_acc, q6k_acc): the one each lane of the packed kernel (cpu_q8kpack.c) runs, so a
 * packed and an unpacked W give the same bits, on every ISA. Up to four rows of x share
 * each decoded weight block, every row with the arithmetic of one.
 */
#include "cpu_q8act.h"

#include <math.h>
#include <string.h>

#include "cpu_kquant_internal.h"
#include "cpu_quant.h"
#include "cpu_traits.h"

#define Q8_PREFETCH 8192 /* bytes ahead along each weight row, as the float path */

bool kn_q8_supported(td_dtype t)
{
    const kn_cpu_traits *tr = kn_cpu_traits_of(t);
    return tr && tr->q8_block;
}

/* The K-quants, for the kernels specialised on t (the entry points, given t at run time,
 * ask the table's q8_block). */
KN_ALWAYS_INLINE bool q8_is_k(td_dtype t)
{
    return t == TD_Q4_K || t == TD_Q6_K;
}

size_t kn_q8_row_bytes(td_dtype t, int64_t n)
{
    const int qb = kn_cpu_traits_of(t)->q8_block;
    return (size_t)(n / qb) * (qb == KN_QK_K ? sizeof(kn_q8k) : sizeof(kn_q8b));
}

/* A block quantized to zeros: all zero, or so small (every |x| below ~4e-37) that
 * 127 / amax overflows, where x * inf would give NaN for its zeros. */
static bool q8_zero_block(float amax)
{
    return amax == 0.0f || isinf(127.0f / amax);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define Q8_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* 16 elements of x times id, rounded to nearest even and clamped to [-127, 127], as int32 */
static inline __m512i q8_round16(__m512 v, __m512 id)
{
    return _mm512_cvtps_epi32(_mm512_max_ps(
        _mm512_min_ps(_mm512_roundscale_ps(_mm512_mul_ps(v, id), Q8_RNE), _mm512_set1_ps(127.0f)),
        _mm512_set1_ps(-127.0f)));
}
#endif

/* q (len) = x (len) quantized with d = max|x| / 127; returns d (NaN for non-finite x). With
 * AVX-512 and len a multiple of 16 (the K-quants' 256-blocks) the same operations on vectors
 * (max exact in any order, the products, roundings and clamps lane by lane): the same bytes. */
static float q8_quant(const float *x, int len, int8_t *q)
{
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (len % 16 == 0) {
        const __m512 z = _mm512_setzero_ps();
        __m512 mx = z;
        __mmask16 bad = 0;
        for (int i = 0; i < len; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), z, _CMP_NEQ_UQ);
            mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
        }
        const float amax = _mm512_reduce_max_ps(mx);
        if (!bad && !q8_zero_block(amax)) {
            const __m512 id = _mm512_set1_ps(127.0f / amax);
            for (int i = 0; i < len; i += 16)
                _mm_storeu_si128((__m128i *)(void *)(q + i),
                                 _mm512_cvtepi32_epi8(q8_round16(_mm512_loadu_ps(x + i), id)));
            return amax / 127.0f;
        }
    }
#endif
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < len; i++) {
        amax = fmaxf(amax, fabsf(x[i]));
        finite &= isfinite(x[i]) != 0;
    }
    if (!finite) {
        memset(q, 0, (size_t)len);
        return NAN;
    }
    if (q8_zero_block(amax)) {
        memset(q, 0, (size_t)len);
        return 0.0f;
    }
    const float id = 127.0f / amax;
    for (int i = 0; i < len; i++) {
        float v = nearbyintf(x[i] * id);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q[i] = (int8_t)v;
    }
    return amax / 127.0f;
}

/* One 32-block: q8_quant's rule and the sum of q. With AVX-512 the same operations on
 * two vectors (finite blocks; the others take q8_quant), so the same bits. */
static void q8b_quant(const float *x, kn_q8b *b)
{
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 a = _mm512_loadu_ps(x), c = _mm512_loadu_ps(x + 16), z = _mm512_setzero_ps();
    const __mmask16 bad = _mm512_cmp_ps_mask(_mm512_sub_ps(a, a), z, _CMP_NEQ_UQ) |
                          _mm512_cmp_ps_mask(_mm512_sub_ps(c, c), z, _CMP_NEQ_UQ);
    if (!bad) {
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
        if (q8_zero_block(amax)) {
            memset(b->qs, 0, sizeof b->qs);
            b->d = 0.0f, b->sum = 0, b->sum16 = 0;
            return;
        }
        const __m512 id = _mm512_set1_ps(127.0f / amax);
        const __m512i qa = q8_round16(a, id), qc = q8_round16(c, id);
        _mm_storeu_si128((__m128i *)(void *)b->qs, _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(void *)(b->qs + 16), _mm512_cvtepi32_epi8(qc));
        b->d = amax / 127.0f;
        b->sum = (int16_t)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
        b->sum16 = (int16_t)_mm512_reduce_add_epi32(qa);
        return;
    }
#endif
    b->d = q8_quant(x, TD_QK, b->qs);
    int s = 0, s16 = 0;
    for (int k = 0; k < TD_QK; k++) {
        s += b->qs[k];
        if (k < 16) s16 += b->qs[k];
    }
    b->sum = (int16_t)s;
    b->sum16 = (int16_t)s16;
}

void kn_q8_quant_rows(td_dtype t, const float *x, int64_t m, int64_t n, void *xq)
{
    if (kn_cpu_traits_of(t)->q8_block == KN_QK_K) {
        kn_q8k *b = xq;
        for (int64_t i = 0; i < m * (n / KN_QK_K); i++, b++) {
            b->d = q8_quant(x + i * KN_QK_K, KN_QK_K, b->qs);
            for (int g = 0; g < 16; g++) {
                int s = 0;
                for (int k = 0; k < 16; k++)
                    s += b->qs[16 * g + k];
                b->bsums[g] = (int16_t)s;
            }
            for (int c = 0; c < 8; c++)
                b->csums[c] = (int16_t)(b->bsums[2 * c] + b->bsums[2 * c + 1]);
        }
        return;
    }
    kn_q8b *b = xq;
    for (int64_t i = 0; i < m * (n / TD_QK); i++, b++)
        q8b_quant(x + i * TD_QK, b);
}

/* The float part of a K-type dot, per super-block, from its exact integer sums (every ISA
 * here and each lane of cpu_q8kpack.c's packed kernel: the same bits). Q4_K: isum =
 * sum_c sc[c] dot(q_c, x_c), msum = sum_c mn[c] csums[c]; Q6_K: s = sum_g sc[g] (dot(q_g,
 * x_g) - 32 bsums[g]). */
KN_ALWAYS_INLINE float q4k_acc(float acc, int isum, int msum, float xd, float d, float dmin)
{
    acc = fmaf((float)isum, xd * d, acc);
    return fmaf(-(float)msum, xd * dmin, acc);
}
KN_ALWAYS_INLINE float q6k_acc(float acc, int s, float xd, float d)
{
    return fmaf((float)s, xd * d, acc);
}

#if defined(__AVX2__)
#include <immintrin.h>

/* 8 int32 lanes, lane k = sum of u[4k + i] * s[4k + i] for i < 4 (u unsigned, s signed). */
KN_ALWAYS_INLINE __m256i dot_us(__m256i u, __m256i s)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* The same for two signed vectors (no -128 in x): |a| times s with a's signs. */
KN_ALWAYS_INLINE __m256i dot_ss(__m256i a, __m256i s)
{
    return dot_us(_mm256_sign_epi8(a, a), _mm256_sign_epi8(s, a));
}

KN_ALWAYS_INLINE float hsum_ps(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define Q8_ACC        __m256
#define Q8_ACC_ZERO   _mm256_setzero_ps()
#define Q8_ACC_SUM(a) hsum_ps(a)

KN_ALWAYS_INLINE int hsum_epi32(__m128i v)
{
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4e));
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xb1));
    return _mm_cvtsi128_si32(v);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* 512-bit K-type dots: maddubs (u8 x s8 pairs to int16, no saturation: 63 * 127 * 2 <
 * 2^15) then dpwssd against the scales as int16 (pairs to int32, accumulated). */
/* Q4_K's scales (bytes 0-7) and mins (bytes 8-15) from scales[12] (ggml's kmask
 * shuffle, the same values as kn_kq_scale_min). */
KN_ALWAYS_INLINE void q4k_scale_min8(const uint8_t *s, uint32_t u[4])
{
    memcpy(u, s, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t mn_lo = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = mn_lo;
    u[0] &= 0x3f3f3f3f;
}

/* int16 lane l of the result = lane l / g + first of s, for the 32 lanes (g 16 or 8). */
KN_ALWAYS_INLINE __m512i bcast_scales(__m512i s, int g, int first)
{
    const __m512i lane =
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13,
                         12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i idx =
        _mm512_add_epi16(g == 16 ? _mm512_srli_epi16(lane, 4) : _mm512_srli_epi16(lane, 3),
                         _mm512_set1_epi16((short)first));
    return _mm512_permutexvar_epi16(idx, s);
}

/* For the M rows of x at xb (xs blocks apart): acc[j] = q4k_acc(acc[j], ...); the weights
 * decoded once for all M. */
KN_ALWAYS_INLINE void q4k_blocks(const uint8_t *blk, const kn_q8k *xb, int64_t xs, int M,
                                 float *acc)
{
    uint32_t u[4];
    q4k_scale_min8(blk + 4, u);
    const __m512i sc =
        _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)u)));
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i a[4];
    for (int j = 0; j < M; j++)
        a[j] = _mm512_setzero_si512();
    for (int c2 = 0; c2 < 4; c2++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c2));
        const __m512i q = _mm512_and_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), m4);
        const __m512i s = bcast_scales(sc, 16, 2 * c2);
        for (int j = 0; j < M; j++) {
            const __m512i p = _mm512_maddubs_epi16(q, _mm512_loadu_si512(xb[j * xs].qs + 64 * c2));
            a[j] = _mm512_dpwssd_epi32(a[j], p, s);
        }
    }
    const float d = kn_h2f(blk), dmin = kn_h2f(blk + 2);
    const __m128i mn = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(u + 2)));
    for (int j = 0; j < M; j++) {
        const kn_q8k *x = xb + j * xs;
        const int msum = hsum_epi32(_mm_madd_epi16(mn, _mm_loadu_si128((const __m128i *)x->csums)));
        acc[j] = q4k_acc(acc[j], _mm512_reduce_add_epi32(a[j]), msum, x->d, d, dmin);
    }
}

/* For the M rows of x at xb (xs blocks apart): acc[j] = q6k_acc(acc[j], ...). */
KN_ALWAYS_INLINE void q6k_blocks(const uint8_t *blk, const kn_q8k *xb, int64_t xs, int M,
                                 float *acc)
{
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    const __m512i sc = _mm512_castsi256_si512(sc16);
    const __m512i m4 = _mm512_set1_epi8(0x0f), m3 = _mm512_set1_epi8(3);
    __m512i a[4];
    for (int j = 0; j < M; j++)
        a[j] = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const __m512i l = _mm512_loadu_si512(blk + 64 * h);
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        const __m512i hx =
            _mm512_inserti64x4(_mm512_castsi256_si512(hb), _mm256_srli_epi16(hb, 2), 1);
        /* chunks 4h, 4h + 1 and 4h + 2, 4h + 3 */
        const __m512i q01 = _mm512_or_si512(_mm512_and_si512(l, m4),
                                            _mm512_slli_epi16(_mm512_and_si512(hx, m3), 4));
        const __m512i q23 =
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hx, 4), m3), 4));
        const __m512i s01 = bcast_scales(sc, 8, 8 * h), s23 = bcast_scales(sc, 8, 8 * h + 4);
        for (int j = 0; j < M; j++) {
            const int8_t *xq = xb[j * xs].qs + 128 * h;
            const __m512i p01 = _mm512_maddubs_epi16(q01, _mm512_loadu_si512(xq));
            const __m512i p23 = _mm512_maddubs_epi16(q23, _mm512_loadu_si512(xq + 64));
            a[j] = _mm512_dpwssd_epi32(a[j], p01, s01);
            a[j] = _mm512_dpwssd_epi32(a[j], p23, s23);
        }
    }
    const float d = kn_h2f(blk + 208);
    for (int j = 0; j < M; j++) {
        const kn_q8k *x = xb + j * xs;
        const __m256i o = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)x->bsums));
        const int osum =
            hsum_epi32(_mm_add_epi32(_mm256_castsi256_si128(o), _mm256_extracti128_si256(o, 1)));
        acc[j] = q6k_acc(acc[j], _mm512_reduce_add_epi32(a[j]) - 32 * osum, x->d, d);
    }
}
#else
KN_ALWAYS_INLINE int hsum256_epi32(__m256i v)
{
    return hsum_epi32(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

/* *acc = q4k_acc(*acc, ...) for one row of x. */
KN_ALWAYS_INLINE void q4k_block(const uint8_t *blk, const kn_q8k *xb, float *acc)
{
    int sc[8], mn[8];
    kn_kq_scale_min(blk + 4, sc, mn);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i a = _mm256_setzero_si256();
    for (int c2 = 0; c2 < 4; c2++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c2));
        const __m256i lo = _mm256_and_si256(v, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        const __m256i plo = dot_us(lo, _mm256_loadu_si256((const __m256i *)(xb->qs + 64 * c2)));
        const __m256i phi =
            dot_us(hi, _mm256_loadu_si256((const __m256i *)(xb->qs + 64 * c2 + 32)));
        a = _mm256_add_epi32(a, _mm256_mullo_epi32(plo, _mm256_set1_epi32(sc[2 * c2])));
        a = _mm256_add_epi32(a, _mm256_mullo_epi32(phi, _mm256_set1_epi32(sc[2 * c2 + 1])));
    }
    int msum = 0;
    for (int c = 0; c < 8; c++)
        msum += mn[c] * xb->csums[c];
    *acc = q4k_acc(*acc, hsum256_epi32(a), msum, xb->d, kn_h2f(blk), kn_h2f(blk + 2));
}

/* *acc = q6k_acc(*acc, ...) for one row of x, q in [0, 64). */
KN_ALWAYS_INLINE void q6k_block(const uint8_t *blk, const kn_q8k *xb, float *acc)
{
    const int8_t *sc = (const int8_t *)(blk + 192);
    const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(3);
    __m256i a = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4),
                               _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
        q[1] =
            _mm256_or_si256(_mm256_and_si256(l1, m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4));
        q[2] =
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m3), 4));
        q[3] =
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m3), 4));
        for (int k = 0; k < 4; k++) {
            const int c = 4 * h + k;
            const __m256i p = dot_us(q[k], _mm256_loadu_si256((const __m256i *)(xb->qs + 32 * c)));
            const __m256i s =
                _mm256_set_m128i(_mm_set1_epi32(sc[2 * c + 1]), _mm_set1_epi32(sc[2 * c]));
            a = _mm256_add_epi32(a, _mm256_mullo_epi32(p, s));
        }
    }
    int osum = 0;
    for (int g = 0; g < 16; g++)
        osum += sc[g] * xb->bsums[g];
    *acc = q6k_acc(*acc, hsum256_epi32(a) - 32 * osum, xb->d, kn_h2f(blk + 208));
}

/* The M-row forms of the two above, one row of x after the other. */
KN_ALWAYS_INLINE void q4k_blocks(const uint8_t *blk, const kn_q8k *xb, int64_t xs, int M,
                                 float *acc)
{
    for (int j = 0; j < M; j++)
        q4k_block(blk, xb + j * xs, &acc[j]);
}
KN_ALWAYS_INLINE void q6k_blocks(const uint8_t *blk, const kn_q8k *xb, int64_t xs, int M,
                                 float *acc)
{
    for (int j = 0; j < M; j++)
        q6k_block(blk, xb + j * xs, &acc[j]);
}
#endif /* 512-bit K-types */

/* Q5_0's 32 quants minus 16 as int8 (elements 0..15 the low nibbles, 16..31 the high). */
KN_ALWAYS_INLINE __m256i q5_0_quants(const uint8_t *blk)
{
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    const __m128i t = _mm_loadu_si128((const __m128i *)(blk + 6));
    const __m256i nib =
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0f));
    /* byte i of the high bits: qh byte i / 8, tested against bit i % 8 */
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i bits = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), shuf);
    bits = _mm256_or_si256(bits, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    bits = _mm256_cmpeq_epi8(bits, _mm256_set1_epi64x(-1));
    const __m256i q = _mm256_or_si256(nib, _mm256_and_si256(bits, _mm256_set1_epi8(0x10)));
    return _mm256_sub_epi8(q, _mm256_set1_epi8(16));
}

/* acc += xd d dot(w, x) for one 32-block of Q5_0 or Q8_0. */
KN_ALWAYS_INLINE void q32_block(td_dtype t, const uint8_t *blk, const kn_q8b *xb, __m256 *acc)
{
    const __m256i w =
        t == TD_Q8_0 ? _mm256_loadu_si256((const __m256i *)(blk + 2)) : q5_0_quants(blk);
    const __m256i p = dot_ss(w, _mm256_loadu_si256((const __m256i *)xb->qs));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(xb->d * kn_h2f(blk)), *acc);
}

#else /* scalar: the same integer sums, one float accumulator */

#define Q8_ACC        float
#define Q8_ACC_ZERO   0.0f
#define Q8_ACC_SUM(a) (a)
KN_ALWAYS_INLINE void q4k_block(const uint8_t *blk, const kn_q8k *xb, float *acc)
{
    int sc[8], mn[8];
    kn_kq_scale_min(blk + 4, sc, mn);
    int isum = 0, msum = 0;
    for (int c = 0; c < 8; c++) {
        int s = 0;
        for (int l = 0; l < 32; l++)
            s += ((blk[16 + 32 * (c / 2) + l] >> (4 * (c % 2))) & 15) * xb->qs[32 * c + l];
        isum += sc[c] * s;
        msum += mn[c] * xb->csums[c];
    }
    *acc = q4k_acc(*acc, isum, msum, xb->d, kn_h2f(blk), kn_h2f(blk + 2));
}

KN_ALWAYS_INLINE void q6k_block(const uint8_t *blk, const kn_q8k *xb, float *acc)
{
    const int8_t *sc = (const int8_t *)(blk + 192);
    int isum = 0, osum = 0;
    for (int c = 0; c < 8; c++) {
        const int h = c / 4, k = c % 4;
        for (int g = 0; g < 2; g++) {
            int s = 0;
            for (int l = 16 * g; l < 16 * g + 16; l++) {
                const int q = ((blk[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 15) |
                              ((blk[128 + 32 * h + l] >> (2 * k)) & 3) << 4;
                s += q * xb->qs[32 * c + l];
            }
            isum += sc[2 * c + g] * s;
        }
    }
    for (int g = 0; g < 16; g++)
        osum += sc[g] * xb->bsums[g];
    *acc = q6k_acc(*acc, isum - 32 * osum, xb->d, kn_h2f(blk + 208));
}

/* The M-row forms of the two above, one row of x after the other. */
KN_ALWAYS_INLINE void q4k_blocks(const uint8_t *blk, const kn_q8k *xb, int64_t xs, int M,
                                 float *acc)
{
    for (int j = 0; j < M; j++)
        q4k_block(blk, xb + j * xs, &acc[j]);
}
KN_ALWAYS_INLINE void q6k_blocks(const uint8_t *blk, const kn_q8k *xb, int64_t xs, int M,
                                 float *acc)
{
    for (int j = 0; j < M; j++)
        q6k_block(blk, xb + j * xs, &acc[j]);
}

KN_ALWAYS_INLINE void q32_block(td_dtype t, const uint8_t *blk, const kn_q8b *xb, float *acc)
{
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    int s = 0;
    for (int l = 0; l < 32; l++) {
        const int q =
            t == TD_Q8_0
                ? (int8_t)blk[2 + l]
                : (((blk[6 + l % 16] >> (4 * (l / 16))) & 15) | (int)((qh >> l) & 1) << 4) - 16;
        s += q * xb->qs[l];
    }
    *acc = fmaf((float)s, xb->d * kn_h2f(blk), *acc);
}
#endif

/* y[j * ldy] = dot(one row of W at w, row j of the quantized x at xq) for j < M (rows
 * xrow bytes apart), nb blocks of type t; each weight block is decoded once for all M
 * rows, and every row gets the arithmetic of M == 1. */
KN_ALWAYS_INLINE void q8_tile(td_dtype t, int M, const uint8_t *w, const uint8_t *xq, size_t xrow,
                              int64_t nb, float *y, int64_t ldy)
{
    if (t == TD_Q4_K || t == TD_Q6_K) {
        const size_t bs = t == TD_Q4_K ? 144 : 210;
        const int64_t xs = (int64_t)(xrow / sizeof(kn_q8k));
        const kn_q8k *xb = (const kn_q8k *)(const void *)xq;
        float acc[4] = {0};
        for (int64_t b = 0; b < nb; b++, w += bs, xb++) {
            for (size_t o = 0; o < bs; o += 64)
                __builtin_prefetch(w + Q8_PREFETCH + o);
            if (t == TD_Q4_K)
                q4k_blocks(w, xb, xs, M, acc);
            else
                q6k_blocks(w, xb, xs, M, acc);
        }
        for (int j = 0; j < M; j++)
            y[j * ldy] = acc[j];
        return;
    }
    const size_t bs = t == TD_Q8_0 ? 34 : 22;
    const int64_t xs = (int64_t)(xrow / sizeof(kn_q8b));
    const kn_q8b *xb = (const kn_q8b *)(const void *)xq;
    Q8_ACC acc[4];
    for (int j = 0; j < M; j++)
        acc[j] = Q8_ACC_ZERO;
    for (int64_t b = 0; b < nb; b++, w += bs, xb++) {
        if (b % 2 == 0) __builtin_prefetch(w + Q8_PREFETCH);
        for (int j = 0; j < M; j++)
            q32_block(t, w, xb + j * xs, &acc[j]);
    }
    for (int j = 0; j < M; j++)
        y[j * ldy] = Q8_ACC_SUM(acc[j]);
}

/* Rows [r0, r1) of W against all m rows of x, four rows of x at a time. */
KN_ALWAYS_INLINE void q8_range(td_dtype t, const kn_mat *w, const void *xq, int64_t m, float *y,
                               int64_t r0, int64_t r1)
{
    const int64_t nb = w->n_cols / (q8_is_k(t) ? KN_QK_K : TD_QK);
    const size_t xrow = kn_q8_row_bytes(t, w->n_cols);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * w->row_stride;
        const uint8_t *x = xq;
        int64_t i = 0;
        for (; i + 4 <= m; i += 4)
            q8_tile(t, 4, wr, x + i * xrow, xrow, nb, y + i * w->n_rows + r, w->n_rows);
        switch (m - i) {
        case 3:
            q8_tile(t, 3, wr, x + i * xrow, xrow, nb, y + i * w->n_rows + r, w->n_rows);
            break;
        case 2:
            q8_tile(t, 2, wr, x + i * xrow, xrow, nb, y + i * w->n_rows + r, w->n_rows);
            break;
        case 1:
            q8_tile(t, 1, wr, x + i * xrow, xrow, nb, y + i * w->n_rows + r, w->n_rows);
            break;
        default:
            break;
        }
    }
}

/* The q8 dot kernels of cpu_traits.h's table, one specialised copy per type. */
#define Q8_DOT(name, T)                                                                            \
    void name(const kn_mat *w, const void *xq, int64_t m, float *y, int64_t r0, int64_t r1)        \
    {                                                                                              \
        q8_range(T, w, xq, m, y, r0, r1);                                                          \
    }
Q8_DOT(kn_q8_dot_q4_k, TD_Q4_K)
Q8_DOT(kn_q8_dot_q6_k, TD_Q6_K)
Q8_DOT(kn_q8_dot_q5_0, TD_Q5_0)
Q8_DOT(kn_q8_dot_q8_0, TD_Q8_0)

void kn_q8_dot(const kn_mat *w, const void *packed, const void *xq, int64_t m, float *y,
               int64_t r0, int64_t r1)
{
    const kn_cpu_traits *tr = kn_cpu_traits_of(w->type);
    if (!tr) return; /* callers check kn_q8_supported */
    if (packed && tr->q8_dot_packed)
        tr->q8_dot_packed(w, packed, xq, m, y, r0, r1);
    else if (tr->q8_dot)
        tr->q8_dot(w, xq, m, y, r0, r1);
}
