/* test_elem.c: kernels/kn_elem.h (the per-element math the CUDA kernels share with the
 * CPU) against the CPU backend, on the host: every dequantizer bit for bit against
 * kn_dequant_row on random blocks, fp16 conversions bit for bit against td_dtype.h on every
 * half and on random floats, silu / tanh-GELU / the rope rotation against the CPU backend's
 * swiglu, geglu and rope ops within a few ulps (the CPU ops use SIMD exp and may fuse). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "kn_elem.h"
#include "kn_test_util.h"
#include "tharness.h"

static uint64_t rng = 0x2545f4914f6cdd1dull;

/* A finite half drawn from the whole range, subnormals included, or small scales. */
static uint16_t rand_half(void)
{
    for (;;) {
        uint16_t h = (uint16_t)kt_xorshift64(&rng);
        if (((h >> 10) & 0x1f) == 0x1f) continue; /* inf/nan */
        if (kt_xorshift64(&rng) & 1) h = td_fp32_to_fp16(kt_frand(&rng, -0.05f, 0.05f));
        return h;
    }
}

/* Random bytes, with the fp16 scale fields finite. */
static void rand_block(td_dtype t, uint8_t *blk)
{
    const int bytes = kn_elem_block_bytes(t);
    for (int i = 0; i < bytes; i++)
        blk[i] = (uint8_t)kt_xorshift64(&rng);
    switch (t) {
    case TD_Q4_1:
    case TD_Q5_1:
    case TD_Q4_K:
    case TD_Q5_K:
        kt_put16(blk + 2, rand_half());
        kt_put16(blk, rand_half());
        break;
    case TD_Q6_K:
        kt_put16(blk + 208, rand_half());
        break;
    default:
        kt_put16(blk, rand_half());
        break;
    }
}

static void test_dequant_blocks(void)
{
    static const td_dtype types[] = {TD_Q8_0, TD_Q4_0, TD_Q4_1, TD_Q5_0,
                                     TD_Q5_1, TD_Q4_K, TD_Q5_K, TD_Q6_K};
    enum { NB = 4000 };
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        const td_dtype t = types[k];
        const int bl = kn_elem_block_len(t), bb = kn_elem_block_bytes(t);
        TH_REQUIRE(bb == (int)td_dtype_row_bytes(t, bl));
        uint8_t *src = malloc((size_t)NB * bb);
        float *ref = malloc(sizeof(float) * NB * bl), *got = malloc(sizeof(float) * NB * bl);
        for (int b = 0; b < NB; b++)
            rand_block(t, src + (size_t)b * bb);
        TH_REQUIRE(kn_dequant_row(t, src, ref, (int64_t)NB * bl) == 0);
        for (int b = 0; b < NB; b++)
            kn_elem_block(t, src + (size_t)b * bb, got + (size_t)b * bl);
        int bad = 0;
        for (int64_t i = 0; i < (int64_t)NB * bl; i++)
            if (memcmp(&ref[i], &got[i], 4) && !(isnan(ref[i]) && isnan(got[i]))) {
                if (!bad)
                    TH_CHECKF(0, "%s element %lld: kn_elem %.9g, kn_dequant_row %.9g",
                              td_dtype_name(t), (long long)i, got[i], ref[i]);
                bad++;
            }
        TH_CHECKF(bad == 0, "%s: %d of %d elements differ", td_dtype_name(t), bad, NB * bl);
        free(src);
        free(ref);
        free(got);
    }
}

static void test_float_types(void)
{
    static const td_dtype types[] = {TD_F32, TD_F16, TD_BF16};
    enum { N = 4096 };
    for (size_t k = 0; k < 3; k++) {
        const td_dtype t = types[k];
        const int es = kn_elem_block_bytes(t);
        uint8_t src[N * 4];
        float ref[N];
        for (int i = 0; i < N; i++) {
            if (t == TD_F16)
                kt_put16(src + 2 * i, rand_half());
            else if (t == TD_BF16)
                kt_put16(src + 2 * i, td_fp32_to_bf16(kt_frand(&rng, -100, 100)));
            else {
                const float f = kt_frand(&rng, -100, 100);
                memcpy(src + 4 * i, &f, 4);
            }
        }
        TH_REQUIRE(kn_dequant_row(t, src, ref, N) == 0);
        int bad = 0;
        for (int i = 0; i < N; i++) {
            const float g = kn_elem_float(t, src + (size_t)i * es);
            bad += memcmp(&g, &ref[i], 4) != 0;
        }
        TH_CHECKF(bad == 0, "%s: %d of %d elements differ", td_dtype_name(t), bad, N);
    }
}

static void test_fp16(void)
{
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        const float a = kn_elem_h2f((uint16_t)h), b = td_fp16_to_fp32((uint16_t)h);
        bad += memcmp(&a, &b, 4) != 0;
    }
    TH_CHECKF(bad == 0, "h2f: %d of 65536 halves differ from td_fp16_to_fp32", bad);
    bad = 0;
    static const float special[] = {0.0f,     -0.0f,    65504.0f,   65520.0f, 65519.99f, 1e-8f,
                                    5.96e-8f, 2.98e-8f, 6.1035e-5f, INFINITY, -INFINITY, NAN};
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++)
        bad += kn_elem_f2h(special[i]) != td_fp32_to_fp16(special[i]);
    for (int i = 0; i < 1000000; i++) {
        /* random bit patterns: every exponent, subnormal and rounding case */
        const float f = kn_elem_from_bits((uint32_t)kt_xorshift64(&rng));
        bad += kn_elem_f2h(f) != td_fp32_to_fp16(f);
    }
    TH_CHECKF(bad == 0, "f2h: %d values differ from td_fp32_to_fp16", bad);
}

/* |a - b| within tol relative (or absolute near 0). */
static int close_rel(float a, float b, float tol)
{
    const float d = fabsf(a - b), s = fmaxf(fabsf(a), fabsf(b));
    return d <= tol * fmaxf(s, 1e-6f);
}

static void test_activations(kn_cpu *c)
{
    enum { N = 9973 };
    float *g = malloc(sizeof(float) * N), *u = malloc(sizeof(float) * N);
    float *o = malloc(sizeof(float) * N);
    for (int i = 0; i < N; i++) {
        g[i] = kt_frand(&rng, -20, 20);
        u[i] = kt_frand(&rng, -3, 3);
    }
    kn_cpu_swiglu(c, g, u, o, 1, N);
    int bad = 0;
    for (int i = 0; i < N; i++)
        bad += !close_rel(kn_elem_silu(g[i]) * u[i], o[i], 4e-6f);
    TH_CHECKF(bad == 0, "silu: %d of %d outside 4e-6 of the cpu swiglu", bad, N);
    kn_cpu_geglu(c, g, u, o, 1, N);
    bad = 0;
    for (int i = 0; i < N; i++)
        bad += !close_rel(kn_elem_gelu_tanh(g[i]) * u[i], o[i], 4e-6f);
    TH_CHECKF(bad == 0, "gelu_tanh: %d of %d outside 4e-6 of the cpu geglu", bad, N);
    free(g);
    free(u);
    free(o);
}

/* Both pairings, n_rot < head_dim, against kn_cpu_rope. */
static void test_rope(kn_cpu *c)
{
    enum { M = 7, NH = 3, HD = 64, NROT = 48 };
    float freq[HD / 2], x[M * NH * HD], ref[M * NH * HD], got[M * NH * HD];
    int32_t pos[M] = {0, 1, 17, 500, 4095, 32768, 131071};
    for (int i = 0; i < HD / 2; i++)
        freq[i] = powf(10000.0f, -2.0f * (float)i / (float)NROT);
    for (int neox = 0; neox < 2; neox++) {
        for (int i = 0; i < M * NH * HD; i++)
            x[i] = kt_frand(&rng, -4, 4);
        memcpy(ref, x, sizeof x);
        memcpy(got, x, sizeof x);
        kn_cpu_rope(c, ref, M, NH, HD, NROT, pos, freq, neox);
        const int half = NROT / 2, stride = neox ? 1 : 2, off = neox ? half : 1;
        for (int t = 0; t < M; t++)
            for (int i = 0; i < half; i++) {
                float cs, sn;
                kn_elem_rope_cs(pos[t], freq[i], &cs, &sn);
                for (int h = 0; h < NH; h++) {
                    float *a = got + (t * NH + h) * HD + i * stride;
                    kn_elem_rope_pair(&a[0], &a[off], cs, sn);
                }
            }
        int bad = 0, untouched = 0;
        for (int i = 0; i < M * NH * HD; i++) {
            bad += fabsf(got[i] - ref[i]) > 2e-6f * 8.0f;
            /* dims past n_rot stay as they were */
            const int d = i % HD;
            if ((neox ? d >= NROT : d >= NROT) && memcmp(&got[i], &x[i], 4)) untouched++;
        }
        TH_CHECKF(bad == 0, "rope (neox %d): %d values differ from the cpu rope", neox, bad);
        TH_CHECKF(untouched == 0, "rope (neox %d): %d dims past n_rot changed", neox, untouched);
    }
}

static void test_cpu_ops(void)
{
    kn_cpu *c;
    TH_REQUIRE(kn_cpu_create(1, &c) == 0);
    test_activations(c);
    test_rope(c);
    kn_cpu_destroy(c);
}

int main(void)
{
    TH_RUN(test_dequant_blocks);
    TH_RUN(test_float_types);
    TH_RUN(test_fp16);
    TH_RUN(test_cpu_ops);
    TH_EXIT();
}
