/* cpu_simd.h: SIMD helpers shared by the CPU backend's kernels (AVX2 + FMA builds). */
#ifndef KN_CPU_SIMD_H
#define KN_CPU_SIMD_H

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp(x) for 8 floats within ~2 ulp of expf (Cephes expf: range reduction x = n ln2 + r
 * with a two-part ln2, a degree-6 polynomial for exp(r), 2^n built in the exponent field).
 * Inputs above 88 saturate to exp(88) instead of inf; inputs below -87.33 (and -inf, and
 * nan) give exactly 0, which masks padded attention scores. */
static inline __m256 kn_exp8(__m256 x)
{
    const __m256 hi = _mm256_set1_ps(88.0f), lo = _mm256_set1_ps(-87.3365478515625f);
    const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}
#endif

#endif
