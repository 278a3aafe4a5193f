/* test_moe_route.c: the mixture-of-experts routing (kernels/moe_route.h) against a
 * reference written here from llama.cpp's build_moe_ffn (sort every expert by its score,
 * in double), and the CPU backend's weighted_rows_sum combine:
 *   - softmax routing (qwen3moe): the k best experts, weights renormalised;
 *   - sigmoid + choice bias + groups (DeepSeek V3): the choice reads probs + bias within the
 *     best groups (a group scores its two best), the weights the unbiased probs, scaled;
 *   - the grouping: offsets, tokens ascending in each group, slots that point back;
 *   - a token's routing is the same alone as in any batch;
 *   - a non-finite logit is an error, not a choice.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "kn_test_util.h"
#include "moe_route.h"
#include "td_err.h"
#include "tharness.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static void rand_logits(float *l, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        l[i] = (float)(kt_unit(&rng) * 8.0 - 4.0);
}

/* The reference: token row l's k experts (best first) and weights, in double. */
static void ref_route(const kn_hparams *hp, const float *bias, const float *l, int *ex, double *w)
{
    const int X = hp->n_expert, k = hp->n_expert_used;
    double p[256], s[256];
    double mx = l[0], sum = 0;
    for (int x = 1; x < X; x++)
        mx = fmax(mx, l[x]);
    for (int x = 0; x < X; x++) {
        p[x] = hp->moe_gating == KN_MOE_SIGMOID ? 1 / (1 + exp(-(double)l[x])) : exp(l[x] - mx);
        sum += p[x];
    }
    for (int x = 0; x < X; x++) {
        if (hp->moe_gating == KN_MOE_SOFTMAX) p[x] /= sum;
        s[x] = p[x] + (bias ? bias[x] : 0);
    }
    if (hp->n_expert_groups > 1) { /* keep the n_group_used groups of the best two-sums */
        const int G = hp->n_expert_groups, per = X / G;
        double gs[64];
        for (int g = 0; g < G; g++) {
            double a = -INFINITY, b = -INFINITY;
            for (int x = 0; x < per; x++) {
                double v = s[g * per + x];
                if (v > a) {
                    b = a;
                    a = v;
                } else if (v > b) {
                    b = v;
                }
            }
            gs[g] = a + b;
        }
        for (int g = 0; g < G; g++) {
            int better = 0;
            for (int h = 0; h < G; h++)
                better += gs[h] > gs[g];
            if (better >= hp->n_group_used)
                for (int x = 0; x < per; x++)
                    s[g * per + x] = -INFINITY;
        }
    }
    double wsum = 0;
    for (int j = 0; j < k; j++) {
        int b = -1;
        for (int x = 0; x < X; x++) {
            bool taken = false;
            for (int i = 0; i < j; i++)
                taken |= ex[i] == x;
            if (!taken && (b < 0 || s[x] > s[b])) b = x;
        }
        ex[j] = b;
        wsum += w[j] = p[b];
    }
    for (int j = 0; j < k; j++)
        w[j] = (hp->moe_norm_w ? w[j] / wsum : w[j]) * hp->moe_w_scale;
}

/* Route n random tokens and check every choice, weight and the grouping. */
static void check_routing(const kn_hparams *hp, const float *bias, int64_t n)
{
    const int X = hp->n_expert, k = hp->n_expert_used;
    float *l = malloc((size_t)(n * X) * sizeof *l);
    rand_logits(l, n * X);
    kn_moe_plan p = {0};
    TH_REQUIRE(kn_moe_route(hp, bias, l, n, &p) == 0);
    int bad_ex = 0, bad_w = 0;
    for (int64_t i = 0; i < n; i++) {
        int ex[64];
        double w[64];
        ref_route(hp, bias, l + i * X, ex, w);
        for (int j = 0; j < k; j++) {
            bad_ex += p.expert[i * k + j] != ex[j];
            bad_w += fabs(p.weight[i * k + j] - w[j]) > 1e-5 * fabs(w[j]) + 1e-7;
        }
    }
    TH_CHECKF(bad_ex == 0, "%d choices differ from the reference", bad_ex);
    TH_CHECKF(bad_w == 0, "%d weights differ from the reference", bad_w);
    /* the grouping */
    TH_CHECK(p.offset[0] == 0 && p.offset[X] == n * k);
    int bad_group = 0;
    for (int x = 0; x < X; x++)
        for (int32_t a = p.offset[x]; a < p.offset[x + 1]; a++)
            bad_group += (a > p.offset[x] && p.token[a] <= p.token[a - 1]) || p.token[a] < 0 ||
                         p.token[a] >= n;
    for (int64_t c = 0; c < n * k; c++) {
        int32_t at = p.slot[c], x = p.expert[c];
        bad_group += p.token[at] != c / k || at < p.offset[x] || at >= p.offset[x + 1];
    }
    TH_CHECKF(bad_group == 0, "%d grouping errors", bad_group);
    /* each token alone gets the same experts and the same weights, bit for bit */
    kn_moe_plan one = {0};
    int bad_alone = 0;
    for (int64_t i = 0; i < n; i++) {
        TH_REQUIRE(kn_moe_route(hp, bias, l + i * X, 1, &one) == 0);
        bad_alone += memcmp(one.expert, p.expert + i * k, (size_t)k * 4) != 0 ||
                     memcmp(one.weight, p.weight + i * k, (size_t)k * 4) != 0;
    }
    TH_CHECKF(bad_alone == 0, "%d tokens route differently alone", bad_alone);
    kn_moe_plan_free(&one);
    kn_moe_plan_free(&p);
    free(l);
}

static kn_hparams qwen3moe_like(int X, int k)
{
    return (kn_hparams){.n_expert = X,
                        .n_expert_used = k,
                        .moe_gating = KN_MOE_SOFTMAX,
                        .moe_norm_w = true,
                        .moe_w_scale = 1.0f};
}

static void test_softmax(void)
{
    kn_hparams hp = qwen3moe_like(8, 2);
    check_routing(&hp, NULL, 64);
    hp = qwen3moe_like(128, 8); /* Qwen3-30B-A3B's shape */
    check_routing(&hp, NULL, 37);
    hp.moe_norm_w = false;
    check_routing(&hp, NULL, 5);
}

static void test_sigmoid_groups(void)
{
    kn_hparams hp = {.n_expert = 64,
                     .n_expert_used = 6,
                     .moe_gating = KN_MOE_SIGMOID,
                     .moe_norm_w = true,
                     .moe_w_scale = 2.5f,
                     .n_expert_groups = 8,
                     .n_group_used = 3};
    float bias[64];
    for (int x = 0; x < 64; x++)
        bias[x] = (float)(kt_unit(&rng) * 0.4 - 0.2);
    check_routing(&hp, bias, 50);
    hp.n_expert_groups = hp.n_group_used = 0; /* the bias without groups */
    check_routing(&hp, bias, 20);
}

static void test_bad_logits(void)
{
    kn_hparams hp = qwen3moe_like(8, 2);
    float l[16];
    rand_logits(l, 16);
    kn_moe_plan p = {0};
    l[11] = NAN;
    TH_CHECK(kn_moe_route(&hp, NULL, l, 2, &p) == TD_EINVAL);
    l[11] = INFINITY;
    TH_CHECK(kn_moe_route(&hp, NULL, l, 2, &p) == TD_EINVAL);
    l[11] = 0.5f;
    TH_CHECK(kn_moe_route(&hp, NULL, l, 2, &p) == 0);
    kn_moe_plan_free(&p);
}

/* The combine: y[i] = sum_j w[i k + j] x[idx[i k + j]], added in j order from 0. */
static void test_weighted_rows_sum(void)
{
    enum { ROWS = 12, M = 5, K = 3, N = 37 };
    float x[ROWS * N], w[M * K], y[M * N];
    int32_t idx[M * K];
    rand_logits(x, ROWS * N);
    for (int i = 0; i < M * K; i++) {
        idx[i] = (int32_t)(kt_unit(&rng) * ROWS);
        w[i] = (float)kt_unit(&rng);
    }
    kn_cpu_weighted_rows_sum(NULL, x, idx, w, K, M, N, y);
    int bad = 0;
    for (int i = 0; i < M; i++)
        for (int c = 0; c < N; c++) {
            float want = 0.0f;
            for (int j = 0; j < K; j++)
                want += w[i * K + j] * x[idx[i * K + j] * N + c];
            bad += fabsf(y[i * N + c] - want) > 1e-6f * (1.0f + fabsf(want)); /* FMA or not */
        }
    TH_CHECKF(bad == 0, "%d combined elements differ", bad);
}

int main(void)
{
    TH_RUN(test_softmax);
    TH_RUN(test_sigmoid_groups);
    TH_RUN(test_bad_logits);
    TH_RUN(test_weighted_rows_sum);
    TH_EXIT();
}
