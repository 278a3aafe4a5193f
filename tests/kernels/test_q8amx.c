/* test_q8amx.c: the AMX-INT8 form of the q8 mode's integer GEMMs (cpu_q8amx.h) against the
 * AVX512-VNNI form (kn_q8_gemm_force_amx_off): the same bits (memcmp) for Q4_0, Q4_1, Q5_0,
 * Q8_0 (kn_q8_gemm, per-call panels and W packed) and Q4_K, Q6_K (kn_q8k_gemm), m 5 to 100
 * (full tiles of 16 rows of x, partial last tiles of 1 and 8 rows, m below the AMX threshold), row
 * counts of W that are not multiples of 16, odd and even block counts (the double-buffered tile
 * loop), a row of x at full scale, group ranges split in two, nothing stored outside the rows asked
 * for; then the backend's matmul with 1, 2 and 3 threads, weights mapped (packed) or not; the
 * GEMM ISA's name and TANDEM_CPU_AMX's values. Also the packed Q4_K dot of decode rows
 * (kn_q8_dot through kn_q8k_pack's copy) on the tiles against its VNNI form. Exits 77 (ctest's
 * skip) where AMX is unusable: no AMX on the CPU, the OS refusing the tile state, or
 * TANDEM_CPU_AMX=0.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "cpu_q8act.h"
#include "kn_test_util.h"
#include "td_dtype.h"
#include "td_err.h"
#include "tharness.h"

#define SENTINEL (-12345.0f)

static uint64_t rng = 0x243f6a8885a308d3ull;

/* m rows of x in [-1, 1), the last at full scale (every |q| 127: the integer sums at their
 * largest). */
static float *make_x(int64_t m, int64_t n)
{
    float *x = malloc((size_t)(m * n) * sizeof(float));
    if (!x) return NULL;
    for (int64_t i = 0; i < m * n; i++)
        x[i] = (float)(kt_u32(&rng) & 0xffff) / 32768.0f - 1.0f;
    for (int64_t e = 0; e < n; e++)
        x[(m - 1) * n + e] = e % 3 ? -1.0f : 1.0f;
    return x;
}

/* The product of groups [g0, g1) into y (m rows of ldy floats; rows past n_rows keep the
 * sentinel): kn_q8_gemm (packed or not) or, for K-types, kn_q8k_gemm. */
static void gemm(const kn_mat *w, const void *packed, const void *xq, int64_t m, float *y,
                 int64_t ldy, int64_t g0, int64_t g1, void *panel)
{
    if (w->type == TD_Q4_K || w->type == TD_Q6_K)
        kn_q8k_gemm(w, xq, m, y, ldy, g0, g1, panel);
    else
        kn_q8_gemm(w, packed, xq, m, y, 16, g0, g1, panel);
}

/* AMX against VNNI for W of type t (n_rows x n_cols) at m rows of x: the whole product, the
 * groups in two calls, through the per-call panel and (32-block types) the packed copy. */
static void check_kernel(td_dtype t, int64_t n_rows, int64_t n_cols, int64_t m)
{
    const bool ktype = t == TD_Q4_K || t == TD_Q6_K;
    kn_mat w;
    uint8_t *buf = kt_make_w(&rng, t, n_rows, n_cols, &w);
    float *x = make_x(m, n_cols);
    const td_dtype xt = ktype ? TD_Q8_0 : t; /* K-types' GEMM takes x in 32-blocks */
    void *xq = malloc((size_t)m * kn_q8_row_bytes(xt, n_cols));
    /* K-types: y rows 5 floats wider than W, so a store past row n_rows - 1 shows */
    const int64_t ldy = ktype ? n_rows + 5 : n_rows, groups = (n_rows + 15) / 16;
    const size_t ny = (size_t)(m * ldy);
    float *yv = malloc(ny * sizeof(float)), *ya = malloc(ny * sizeof(float));
    const size_t pbytes = ktype ? kn_q8k_gemm_panel_bytes(n_cols) : kn_q8_gemm_panel_bytes(n_cols);
    void *panel = malloc(pbytes);
    const size_t kbytes = ktype ? 0 : kn_q8_gemm_packed_bytes(&w);
    void *packed = kbytes ? malloc(kbytes) : NULL;
    TH_REQUIRE(buf && x && xq && yv && ya && panel && (ktype || packed));
    kn_q8_quant_rows(xt, x, m, n_cols, xq);
    if (packed) kn_q8_gemm_pack(&w, packed, 0, groups);
    for (int pk = 0; pk < (packed ? 2 : 1); pk++) {
        const void *pw = pk ? packed : NULL;
        kn_q8_gemm_force_amx_off(true);
        kt_fill(yv, ny, SENTINEL);
        gemm(&w, pw, xq, m, yv, ldy, 0, groups, panel);
        kn_q8_gemm_force_amx_off(false);
        kt_fill(ya, ny, SENTINEL);
        gemm(&w, pw, xq, m, ya, ldy, 0, groups, panel);
        int64_t diff = 0, outside = 0;
        for (int64_t i = 0; i < m; i++)
            for (int64_t r = 0; r < ldy; r++) {
                const float a = yv[i * ldy + r], b = ya[i * ldy + r];
                if (r < n_rows)
                    diff += memcmp(&a, &b, sizeof a) != 0 || a == SENTINEL;
                else
                    outside += a != SENTINEL || b != SENTINEL;
            }
        TH_CHECKF(diff == 0 && outside == 0,
                  "%s %lldx%lld m %lld%s: %lld values differ from VNNI's, %lld stored outside",
                  td_dtype_name(t), (long long)n_rows, (long long)n_cols, (long long)m,
                  pk ? " packed" : "", (long long)diff, (long long)outside);
        /* two calls, as two threads would make them */
        kt_fill(ya, ny, SENTINEL);
        gemm(&w, pw, xq, m, ya, ldy, 0, 1, panel);
        gemm(&w, pw, xq, m, ya, ldy, 1, groups, panel);
        TH_CHECKF(memcmp(yv, ya, ny * sizeof(float)) == 0, "%s m %lld%s: split groups differ",
                  td_dtype_name(t), (long long)m, pk ? " packed" : "");
    }
    free(buf), free(x), free(xq), free(yv), free(ya), free(panel), free(packed);
}

static void test_kernels(void)
{
    static const td_dtype types[] = {TD_Q4_0, TD_Q4_1, TD_Q5_0, TD_Q8_0, TD_Q4_K, TD_Q6_K};
    static const int64_t ms[] = {5, 16, 17, 24, 33, 40, 64, 100};
    for (size_t k = 0; k < sizeof types / sizeof *types; k++) {
        const bool ktype = types[k] == TD_Q4_K || types[k] == TD_Q6_K;
        /* block counts of 32: 24 and 8 even, 27 and 1 odd (K-types: whole super-blocks) */
        const int64_t cols[] = {ktype ? 3 * 256 : 27 * 32, ktype ? 256 : 32};
        for (size_t i = 0; i < sizeof ms / sizeof *ms; i++) {
            check_kernel(types[k], 53, cols[0], ms[i]);
            check_kernel(types[k], 16 + (int64_t)i, cols[1], ms[i]);
        }
    }
}

/* The packed Q4_K dot (kn_q8k_pack, kn_q8_dot: the decode rows' product) on the tiles against its
 * VNNI form: the same bits for m from the AMX threshold up (one tile of x, full tiles of 16,
 * partial last tiles), 1 to 4 super-blocks (the pipeline's odd and even counts), a partial last
 * group of W, row ranges that start and end inside groups (nothing written outside them); m below
 * the threshold takes the VNNI kernel either way. */
static void check_kdot(int64_t n_rows, int64_t nsb, int64_t m)
{
    static const int64_t ranges[][2] = {{0, 53}, {3, 29}, {16, 32}, {17, 18}, {40, 53}};
    const int64_t n_cols = nsb * 256, groups = (n_rows + 15) / 16;
    kn_mat w;
    uint8_t *buf = kt_make_w(&rng, TD_Q4_K, n_rows, n_cols, &w);
    float *x = make_x(m, n_cols);
    void *xq = malloc((size_t)m * kn_q8_row_bytes(TD_Q4_K, n_cols));
    const size_t ny = (size_t)(m * n_rows), pbytes = kn_q8k_packed_bytes(&w);
    float *yv = malloc(ny * sizeof(float)), *ya = malloc(ny * sizeof(float));
    void *packed = malloc(pbytes);
    TH_REQUIRE(buf && x && xq && yv && ya && pbytes && packed);
    kn_q8_quant_rows(TD_Q4_K, x, m, n_cols, xq);
    kn_q8k_pack(&w, packed, 0, groups);
    for (size_t k = 0; k < sizeof ranges / sizeof *ranges; k++) {
        const int64_t r0 = ranges[k][0], r1 = ranges[k][1] < n_rows ? ranges[k][1] : n_rows;
        if (r0 >= r1) continue;
        kn_q8_gemm_force_amx_off(true);
        kt_fill(yv, ny, SENTINEL);
        kn_q8_dot(&w, packed, xq, m, yv, r0, r1);
        kn_q8_gemm_force_amx_off(false);
        kt_fill(ya, ny, SENTINEL);
        kn_q8_dot(&w, packed, xq, m, ya, r0, r1);
        int64_t diff = 0, outside = 0;
        for (int64_t i = 0; i < m; i++)
            for (int64_t r = 0; r < n_rows; r++) {
                const float a = yv[i * n_rows + r], b = ya[i * n_rows + r];
                if (r >= r0 && r < r1)
                    diff += memcmp(&a, &b, sizeof a) != 0 || a == SENTINEL;
                else
                    outside += a != SENTINEL || b != SENTINEL;
            }
        TH_CHECKF(diff == 0 && outside == 0,
                  "Q4_K packed dot %lldx%lld m %lld rows [%lld, %lld): %lld values differ from "
                  "VNNI's, %lld written outside",
                  (long long)n_rows, (long long)n_cols, (long long)m, (long long)r0, (long long)r1,
                  (long long)diff, (long long)outside);
    }
    free(buf), free(x), free(xq), free(yv), free(ya), free(packed);
}

static void test_kdot(void)
{
    static const int64_t ms[] = {3, 7, 9, 16, 17, 31, 33};
    for (size_t i = 0; i < sizeof ms / sizeof *ms; i++)
        for (int64_t nsb = 1; nsb <= 4; nsb++) {
            check_kdot(53, nsb, ms[i]);
            check_kdot(16, nsb, ms[i]);
        }
}

/* The backend's matmul in the q8 mode, AMX against VNNI, with 1, 2 and 3 threads, W as it is
 * and mapped (the packed copy): the same bits everywhere. */
static void test_backend(void)
{
    static const td_dtype types[] = {TD_Q4_0, TD_Q4_1, TD_Q5_0, TD_Q8_0, TD_Q4_K, TD_Q6_K};
    const int64_t n_rows = 203, n_cols = 4 * 256, m = 100;
    kn_cpu *cpus[3];
    for (int i = 0; i < 3; i++)
        TH_REQUIRE(kn_cpu_create(i + 1, &cpus[i]) == 0);
    for (size_t k = 0; k < sizeof types / sizeof *types; k++) {
        kn_mat w;
        uint8_t *buf = kt_make_w(&rng, types[k], n_rows, n_cols, &w);
        float *x = make_x(m, n_cols);
        const size_t ny = (size_t)(m * n_rows);
        float *yv = malloc(ny * sizeof(float)), *ya = malloc(ny * sizeof(float));
        TH_REQUIRE(buf && x && yv && ya);
        kn_q8_gemm_force_amx_off(true);
        kn_cpu_set_act_q8(cpus[0], true);
        TH_REQUIRE(kn_cpu_matmul(cpus[0], &w, x, m, yv) == 0);
        kn_q8_gemm_force_amx_off(false);
        for (int mapped = 0; mapped < 2; mapped++)
            for (int i = 0; i < 3; i++) {
                if (mapped) TH_REQUIRE(kn_cpu_map_matrix(cpus[i], &w) == 0);
                kn_cpu_set_act_q8(cpus[i], true);
                kt_fill(ya, ny, SENTINEL);
                TH_REQUIRE(kn_cpu_matmul(cpus[i], &w, x, m, ya) == 0);
                TH_CHECKF(memcmp(yv, ya, ny * sizeof(float)) == 0,
                          "%s: %d threads%s: AMX differs from VNNI", td_dtype_name(types[k]), i + 1,
                          mapped ? ", mapped" : "");
            }
        for (int i = 0; i < 3; i++)
            kn_cpu_set_act_q8(cpus[i], false);
        free(buf), free(x), free(yv), free(ya);
        /* the next type's matrix may land at this one's address: fresh backends */
        for (int i = 0; i < 3; i++) {
            kn_cpu_destroy(cpus[i]);
            TH_REQUIRE(kn_cpu_create(i + 1, &cpus[i]) == 0);
        }
    }
    for (int i = 0; i < 3; i++)
        kn_cpu_destroy(cpus[i]);
}

/* The name the GEMM reports, and TANDEM_CPU_AMX's values at backend creation. */
static void test_names_env(void)
{
    TH_CHECK(!strcmp(kn_q8_gemm_isa(), "amx-int8"));
    kn_q8_gemm_force_amx_off(true);
    TH_CHECK(!kn_q8_gemm_amx() && !strcmp(kn_q8_gemm_isa(), "avx512vnni"));
    kn_q8_gemm_force_amx_off(false);
    kn_q8_gemm_force_avx2(true);
    TH_CHECK(!kn_q8_gemm_amx() && !strcmp(kn_q8_gemm_isa(), "avx2"));
    kn_q8_gemm_force_avx2(false);
    TH_CHECK(kn_q8_gemm_amx());
    kn_cpu *c = NULL;
    TH_REQUIRE(setenv("TANDEM_CPU_AMX", "yes", 1) == 0);
    TH_CHECK(kn_cpu_create(1, &c) == TD_EINVAL && !c);
    TH_REQUIRE(setenv("TANDEM_CPU_AMX", "1", 1) == 0);
    TH_CHECK(kn_cpu_create(1, &c) == 0);
    kn_cpu_destroy(c);
    TH_REQUIRE(unsetenv("TANDEM_CPU_AMX") == 0);
}

int main(void)
{
    if (!kn_q8_gemm_amx())
        return kt_skip("AMX-INT8 is not usable here (no AMX, the OS refused the tile state, no "
                       "AVX512-VNNI, or TANDEM_CPU_AMX=0)");
    TH_RUN(test_kernels);
    TH_RUN(test_kdot);
    TH_RUN(test_backend);
    TH_RUN(test_names_env);
    TH_EXIT();
}
