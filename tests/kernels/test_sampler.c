/* test_sampler.c: the sampling chain: greedy, seeds, top-k, top-p, min-p, temperature,
 * repetition penalty, the distribution it draws from, and kn_sampler_skip (a token
 * sampled elsewhere: the disaggregated first token). */
#include <string.h>

#include "../tharness.h"
#include "sampler.h"
#include "td_err.h"

#define V 6

static int32_t draw(kn_sampler *s, const float *logits)
{
    return kn_sample(s, logits, NULL, 0, 0);
}

static void test_greedy(void)
{
    kn_sampler s;
    td_sampling p = {.temperature = 0};
    TH_REQUIRE(kn_sampler_init(&s, &p, V) == 0);
    float l[V] = {0.1f, 2.0f, -1.0f, 2.0f, 0.5f, 1.9f};
    TH_CHECK(draw(&s, l) == 1); /* tie between 1 and 3 goes to the lower id */
    l[3] = 2.5f;
    TH_CHECK(draw(&s, l) == 3);
    kn_sampler_fini(&s);
}

static void test_same_seed_same_tokens(void)
{
    float l[V] = {1.0f, 1.1f, 0.9f, 1.05f, 0.95f, 1.0f};
    td_sampling p = {.temperature = 1.0f, .seed = 1234};
    kn_sampler a, b, c;
    TH_REQUIRE(kn_sampler_init(&a, &p, V) == 0 && kn_sampler_init(&b, &p, V) == 0);
    p.seed = 1235;
    TH_REQUIRE(kn_sampler_init(&c, &p, V) == 0);
    int differ = 0;
    for (int i = 0; i < 200; i++) {
        int32_t x = draw(&a, l), y = draw(&b, l), z = draw(&c, l);
        TH_CHECK(x == y);
        differ += x != z;
    }
    TH_CHECKF(differ > 50, "another seed changed only %d of 200 draws", differ);
    kn_sampler_fini(&a);
    kn_sampler_fini(&b);
    kn_sampler_fini(&c);
}

/* Frequencies of each token over n draws. */
static void histogram(td_sampling p, const float *l, int n, int *count)
{
    kn_sampler s;
    memset(count, 0, V * sizeof *count);
    if (kn_sampler_init(&s, &p, V)) return;
    for (int i = 0; i < n; i++) {
        int32_t t = draw(&s, l);
        if (t >= 0 && t < V) count[t]++;
    }
    kn_sampler_fini(&s);
}

static void test_distribution(void)
{
    /* softmax of log(p) is p: frequencies must follow 0.5 / 0.3 / 0.2 */
    float l[V] = {logf(0.5f), logf(0.3f), logf(0.2f), -INFINITY, -INFINITY, -INFINITY};
    int c[V], n = 40000;
    histogram((td_sampling){.temperature = 1.0f, .seed = 7}, l, n, c);
    TH_CHECKF(fabs(c[0] / (double)n - 0.5) < 0.015, "p0 %g", c[0] / (double)n);
    TH_CHECKF(fabs(c[1] / (double)n - 0.3) < 0.015, "p1 %g", c[1] / (double)n);
    TH_CHECKF(fabs(c[2] / (double)n - 0.2) < 0.015, "p2 %g", c[2] / (double)n);
    TH_CHECK(c[3] + c[4] + c[5] == 0);
    /* temperature 0.5 squares the odds: 25 : 9 : 4 */
    histogram((td_sampling){.temperature = 0.5f, .seed = 7}, l, n, c);
    TH_CHECKF(fabs(c[0] / (double)n - 25.0 / 38) < 0.015, "p0 at T=0.5 %g", c[0] / (double)n);
}

static void test_filters(void)
{
    float l[V] = {3.0f, 2.9f, 2.8f, 0.0f, -1.0f, 2.7f};
    int c[V], n = 4000;
    histogram((td_sampling){.temperature = 5.0f, .top_k = 1, .seed = 3}, l, n, c);
    TH_CHECK(c[0] == n);
    histogram((td_sampling){.temperature = 5.0f, .top_k = 2, .seed = 3}, l, n, c);
    TH_CHECK(c[0] + c[1] == n && c[0] > 0 && c[1] > 0);
    /* top-p 0.1: the first token alone reaches it */
    histogram((td_sampling){.temperature = 1.0f, .top_p = 0.1f, .seed = 3}, l, n, c);
    TH_CHECK(c[0] == n);
    /* min-p 0.5 at T=1: keep tokens with p >= 0.5 p_max: logits within ln 2 of the max */
    histogram((td_sampling){.temperature = 1.0f, .min_p = 0.5f, .seed = 3}, l, n, c);
    TH_CHECK(c[3] == 0 && c[4] == 0 && c[0] > 0 && c[5] > 0);
}

static void test_top_p_paths_agree(void)
{
    /* the heap nucleus (no top-k) and the sorted prefix (top-k) keep the same set */
    float l[V] = {logf(0.1f), logf(0.4f), logf(0.05f), logf(0.3f), logf(0.1f), logf(0.05f)};
    int a[V], b[V], n = 20000;
    histogram((td_sampling){.temperature = 1.0f, .top_p = 0.5f, .seed = 9}, l, n, a);
    histogram((td_sampling){.temperature = 1.0f, .top_p = 0.5f, .top_k = V - 1, .seed = 9}, l, n,
              b);
    for (int i = 0; i < V; i++)
        TH_CHECKF((a[i] > 0) == (i == 1 || i == 3) && (b[i] > 0) == (i == 1 || i == 3),
                  "token %d drawn %d / %d times", i, a[i], b[i]);
    TH_CHECKF(fabs(a[1] / (double)n - 4.0 / 7) < 0.02, "p1 %g", a[1] / (double)n);
}

static void test_repetition_penalty(void)
{
    kn_sampler s;
    td_sampling p = {.temperature = 0, .repeat_penalty = 2.0f, .repeat_last_n = 4};
    TH_REQUIRE(kn_sampler_init(&s, &p, V) == 0);
    float l[V] = {2.0f, 1.5f, 0.0f, -1.0f, 0.0f, 0.0f};
    int32_t hist[] = {0, 0, 0};
    TH_CHECK(kn_sample(&s, l, hist, 3, 0) == 1); /* 2.0 / 2 = 1.0 < 1.5 */
    int32_t old[] = {0, 3, 3, 3, 3};             /* token 0 fell out of the window */
    TH_CHECK(kn_sample(&s, l, old, 5, 0) == 0);
    kn_sampler_fini(&s);
}

/* Greedy over {logit of token 0 after the penalties, x}: 0 on a tie (lowest id), 1 when x is
 * above. Probing x at the exact expected value and one ulp-ish step above pins the arithmetic. */
static int32_t probe(const td_sampling *p, float l0, float x, const int32_t *hist, int64_t n_hist,
                     int64_t n_out)
{
    kn_sampler s;
    if (kn_sampler_init(&s, p, V)) return -1000;
    float l[V] = {l0, x, -100.0f, -100.0f, -100.0f, -100.0f};
    int32_t id = kn_sample(&s, l, hist, n_hist, n_out);
    kn_sampler_fini(&s);
    return id;
}

/* OpenAI's penalties: logit[t] -= frequency * count(t) + presence * (count(t) > 0), counted over
 * the last n_out tokens of the history only (the generated ones), exact in float here. */
static void test_presence_frequency_penalties(void)
{
    const float up = 1.0f / 1024; /* exact in float near these values */
    td_sampling p = {.temperature = 0, .frequency_penalty = 0.5f, .presence_penalty = 0.25f};
    /* prompt {0, 0}, then generated {0, 0, 0, 2}: token 0 counts 3, not 5 */
    int32_t hist[] = {0, 0, 0, 0, 0, 2};
    TH_CHECK(probe(&p, 10.0f, 8.25f, hist, 6, 4) == 0);      /* 10 - 1.5 - 0.25 = 8.25: tie */
    TH_CHECK(probe(&p, 10.0f, 8.25f + up, hist, 6, 4) == 1); /* just above */
    /* token 1 (the probe) appears once among the generated too:
     * 10 - 1.75 = 8.25 against 9 - 0.75 = 8.25, a tie (token 0) */
    int32_t hist1[] = {0, 0, 0, 1};
    TH_CHECK(probe(&p, 10.0f, 9.0f, hist1, 4, 4) == 0);
    TH_CHECK(probe(&p, 10.0f, 9.0f + up, hist1, 4, 4) == 1);
    /* no generated tokens (the first token): no penalty, whatever the prompt holds */
    TH_CHECK(probe(&p, 10.0f, 10.0f - up, hist, 6, 0) == 0);
    /* only presence: once per distinct token, whatever the count */
    td_sampling pp = {.temperature = 0, .presence_penalty = 1.5f};
    TH_CHECK(probe(&pp, 10.0f, 8.5f, hist, 6, 4) == 0);
    TH_CHECK(probe(&pp, 10.0f, 8.5f + up, hist, 6, 4) == 1);
    /* negative penalties favour repetition */
    td_sampling neg = {.temperature = 0, .frequency_penalty = -2.0f};
    int32_t h1[] = {1, 1};
    TH_CHECK(probe(&neg, 10.0f, 6.0f + up, h1, 2, 2) == 1); /* 6 + 4 > 10 */
    TH_CHECK(probe(&neg, 10.0f, 6.0f, h1, 2, 2) == 0);      /* 6 + 4 == 10: tie */
    /* with the repetition penalty first (llama.cpp's and vLLM's order): 10 / 2 - 0.5 * 3 */
    td_sampling both = {.temperature = 0, .repeat_penalty = 2.0f, .frequency_penalty = 0.5f};
    TH_CHECK(probe(&both, 10.0f, 3.5f, hist, 6, 4) == 0);
    TH_CHECK(probe(&both, 10.0f, 3.5f + up, hist, 6, 4) == 1);
    /* n_out outside [0, n_hist] is a caller bug, refused */
    kn_sampler s;
    TH_REQUIRE(kn_sampler_init(&s, &p, V) == 0);
    float l[V] = {0};
    TH_CHECK(kn_sample(&s, l, hist, 6, 7) == TD_EINVAL);
    TH_CHECK(kn_sample(&s, l, hist, 6, -1) == TD_EINVAL);
    kn_sampler_fini(&s);
}

/* With temperature 1 the penalty shifts the odds by exactly exp(-penalty). */
static void test_penalty_distribution(void)
{
    kn_sampler s;
    td_sampling p = {
        .temperature = 1.0f, .frequency_penalty = 0.5f, .presence_penalty = 0.193147f, .seed = 5};
    TH_REQUIRE(kn_sampler_init(&s, &p, V) == 0);
    /* token 0 generated twice: its logit falls by 1 + 0.193 = ln 2 + 0.5; equal logits for 0
     * and 1 otherwise, so p0 / p1 = exp(-(1.193147)) = 0.3033 */
    float l[V] = {0.0f, 0.0f, -100.0f, -100.0f, -100.0f, -100.0f};
    int32_t hist[] = {0, 0};
    int c[V] = {0}, n = 20000;
    for (int i = 0; i < n; i++) {
        int32_t id = kn_sample(&s, l, hist, 2, 2);
        TH_REQUIRE(id >= 0 && id < V);
        c[id]++;
    }
    double r = c[0] / (double)c[1];
    TH_CHECKF(fabs(r - exp(-1.193147)) < 0.03, "p0/p1 %g, expected %g", r, exp(-1.193147));
    kn_sampler_fini(&s);
}

static void test_bad_input(void)
{
    kn_sampler s;
    td_sampling p = {.temperature = 1.0f};
    TH_CHECK(kn_sampler_init(&s, &p, 0) == TD_EINVAL);
    TH_REQUIRE(kn_sampler_init(&s, &p, V) == 0);
    float l[V] = {0, NAN, 0, 0, 0, 0};
    TH_CHECK(draw(&s, l) == TD_EINVAL);
    kn_sampler_fini(&s);
}

/* kn_sampler_skip must leave the sampler exactly where one kn_sample call leaves it, for
 * every chain (greedy, each filter, the penalty): a decode node that skips the first token
 * a prefill stage sampled then draws the same tokens as a node that sampled it itself. */
static void test_skip_equals_one_sample(void)
{
    td_sampling ps[] = {
        {.temperature = 0},
        {.temperature = 0.8f, .seed = 11},
        {.temperature = 0.8f, .top_k = 3, .seed = 12},
        {.temperature = 1.0f, .top_p = 0.7f, .seed = 13},
        {.temperature = 1.0f, .top_k = 4, .top_p = 0.9f, .min_p = 0.05f, .seed = 14},
        {.temperature = 1.3f, .repeat_penalty = 1.5f, .repeat_last_n = 3, .seed = 15},
        {.temperature = 1.1f, .presence_penalty = 0.7f, .frequency_penalty = 0.4f, .seed = 16},
    };
    float first[V] = {0.3f, 1.0f, 0.2f, 0.9f, -0.5f, 0.8f};
    for (size_t k = 0; k < sizeof ps / sizeof ps[0]; k++) {
        kn_sampler a, b, fresh;
        TH_REQUIRE(kn_sampler_init(&a, &ps[k], V) == 0 && kn_sampler_init(&b, &ps[k], V) == 0 &&
                   kn_sampler_init(&fresh, &ps[k], V) == 0);
        int32_t hist[64] = {1, 2, 3};
        int64_t n = 3;
        TH_CHECK(kn_sample(&a, first, hist, n, 0) >= 0);
        kn_sampler_skip(&b);
        int differ_fresh = 0;
        for (int i = 0; i < 40; i++) {
            float l[V];
            for (int j = 0; j < V; j++)
                l[j] = 0.1f * (float)((i * 7 + j * 3) % 11);
            /* hist[0..3) is the prompt, the rest the generated tokens */
            int32_t x = kn_sample(&a, l, hist, n, n - 3), y = kn_sample(&b, l, hist, n, n - 3),
                    z = kn_sample(&fresh, l, hist, n, n - 3);
            TH_CHECKF(x == y, "params %zu draw %d: sampled %d, skipped %d", k, i, x, y);
            differ_fresh += x != z;
            if (n < 64) hist[n++] = x;
        }
        /* the skip is not a no-op when the chain draws: a fresh sampler (one draw behind)
         * gives other tokens */
        if (ps[k].temperature > 0)
            TH_CHECKF(differ_fresh > 0, "params %zu: skipping changed nothing", k);
        else
            TH_CHECK(differ_fresh == 0);
        kn_sampler_fini(&a);
        kn_sampler_fini(&b);
        kn_sampler_fini(&fresh);
    }
}

/* td_sampling.skip_samples = N: kn_sampler_init leaves the sampler where N kn_sampler_skip
 * calls leave it (a moved request's sampler, built from the wire's parameters). */
static void test_init_skips(void)
{
    td_sampling p = {.temperature = 0.9f, .top_k = 4, .seed = 21};
    td_sampling q = p;
    q.skip_samples = 3;
    kn_sampler a, b;
    TH_REQUIRE(kn_sampler_init(&a, &p, V) == 0 && kn_sampler_init(&b, &q, V) == 0);
    for (int k = 0; k < 3; k++)
        kn_sampler_skip(&a);
    int32_t hist[1] = {0};
    int differ = 0;
    for (int i = 0; i < 40; i++) {
        float l[V];
        for (int j = 0; j < V; j++)
            l[j] = 0.1f * (float)((i * 5 + j * 7) % 13);
        int32_t x = kn_sample(&a, l, hist, 1, 0), y = kn_sample(&b, l, hist, 1, 0);
        differ += x != y;
    }
    TH_CHECKF(differ == 0, "%d of 40 draws differ", differ);
    kn_sampler_fini(&a);
    kn_sampler_fini(&b);
}

static void test_min_p_above_one(void)
{
    /* min-p > 1 would filter out every token: it keeps the most likely one instead */
    float l[V] = {0.1f, 0.2f, 3.0f, 0.0f, 0.3f, 0.2f};
    int c[V], n = 200;
    histogram((td_sampling){.temperature = 1.0f, .min_p = 5.0f, .seed = 3}, l, n, c);
    TH_CHECK(c[2] == n);
}

/* logit_bias: added to the raw logits before the penalties; +100 forces a token, -100 bans it
 * (greedy and sampled). */
static void test_logit_bias(void)
{
    const float up = 1.0f / 1024;
    td_sampling p = {.temperature = 0, .n_logit_bias = 1};
    p.logit_bias_ids[0] = 0;
    p.logit_bias_values[0] = 0.5f;
    TH_CHECK(probe(&p, 1.0f, 1.5f, NULL, 0, 0) == 0); /* 1 + 0.5 = 1.5: tie */
    TH_CHECK(probe(&p, 1.0f, 1.5f + up, NULL, 0, 0) == 1);
    p.logit_bias_ids[0] = 4;
    p.logit_bias_values[0] = 100.0f; /* -100 + 100 = 0 > ... */
    TH_CHECK(probe(&p, -1.0f, -0.5f, NULL, 0, 0) == 4);
    p.logit_bias_ids[0] = 1;
    p.logit_bias_values[0] = -100.0f;
    TH_CHECK(probe(&p, 1.0f, 30.0f, NULL, 0, 0) == 0); /* the greedy token is banned */
    /* before the repetition penalty: (2 + 2) / 2 = 2 against 2: a tie */
    td_sampling rp = {.temperature = 0, .repeat_penalty = 2.0f, .n_logit_bias = 1};
    rp.logit_bias_ids[0] = 0;
    rp.logit_bias_values[0] = 2.0f;
    int32_t hist[] = {0};
    TH_CHECK(probe(&rp, 2.0f, 2.0f, hist, 1, 0) == 0);
    TH_CHECK(probe(&rp, 2.0f, 2.0f + up, hist, 1, 0) == 1);
    /* sampled: a banned token is never drawn, a forced one always */
    float l[V] = {1.0f, 1.1f, 0.9f, 1.05f, 0.95f, 1.0f};
    int c[V], n = 300;
    td_sampling ban = {.temperature = 1.0f, .seed = 5, .n_logit_bias = 2};
    ban.logit_bias_ids[0] = 1;
    ban.logit_bias_values[0] = -100.0f;
    ban.logit_bias_ids[1] = 3;
    ban.logit_bias_values[1] = -100.0f;
    histogram(ban, l, n, c);
    TH_CHECKF(c[1] == 0 && c[3] == 0 && c[0] > 0, "banned drawn %d, %d times", c[1], c[3]);
    td_sampling force = {.temperature = 1.0f, .seed = 5, .n_logit_bias = 1};
    force.logit_bias_ids[0] = 2;
    force.logit_bias_values[0] = 100.0f;
    histogram(force, l, n, c);
    TH_CHECKF(c[2] == n, "forced token drawn %d of %d times", c[2], n);
}

/* min_tokens: the listed ids are masked while fewer than min_tokens were generated (n_out),
 * whatever their logits; after that they compete again. */
static void test_min_tokens(void)
{
    td_sampling p = {.temperature = 0, .min_tokens = 2, .n_min_tokens_ids = 2};
    p.min_tokens_ids[0] = 1;
    p.min_tokens_ids[1] = 3;
    kn_sampler s;
    TH_REQUIRE(kn_sampler_init(&s, &p, V) == 0);
    float l[V] = {0.1f, 9.0f, -1.0f, 8.0f, 0.5f, 0.2f};
    int32_t hist[] = {5, 4, 4, 4};
    TH_CHECK(kn_sample(&s, l, hist, 2, 0) == 4); /* first token: 1 and 3 masked */
    TH_CHECK(kn_sample(&s, l, hist, 3, 1) == 4);
    TH_CHECK(kn_sample(&s, l, hist, 4, 2) == 1); /* two generated: unmasked */
    kn_sampler_fini(&s);
    /* a moved request's earlier tokens count (n_out includes them) */
    p.temperature = 1.0f;
    p.seed = 9;
    TH_REQUIRE(kn_sampler_init(&s, &p, V) == 0);
    int drawn = 0;
    for (int i = 0; i < 200; i++) {
        int32_t id = kn_sample(&s, l, hist, 3, 1);
        drawn += id == 1 || id == 3;
    }
    TH_CHECKF(drawn == 0, "a masked id was drawn %d times", drawn);
    kn_sampler_fini(&s);
}

/* The repetition penalty over a window as long as the history (the router's
 * repetition_penalty): a token far back counts, and each distinct token once. */
static void test_repetition_whole_history(void)
{
    enum { N = 5000 };
    static int32_t hist[N];
    for (int i = 0; i < N; i++)
        hist[i] = i == 0 ? 0 : 2; /* token 0 only at the very start */
    td_sampling p = {.temperature = 0, .repeat_penalty = 2.0f, .repeat_last_n = 1 << 30};
    TH_CHECK(probe(&p, 4.0f, 2.0f, hist, N, 0) == 0); /* 4 / 2 = 2: tie, once only */
    TH_CHECK(probe(&p, 4.0f, 2.0f + 1.0f / 1024, hist, N, 0) == 1);
    p.repeat_last_n = 64; /* the CLI's default window no longer sees it */
    TH_CHECK(probe(&p, 4.0f, 3.0f, hist, N, 0) == 0);
}

/* Lists from the network are checked at init. */
static void test_bad_lists(void)
{
    kn_sampler s;
    td_sampling p = {.n_logit_bias = 1};
    p.logit_bias_ids[0] = V;
    p.logit_bias_values[0] = 1.0f;
    TH_CHECK(kn_sampler_init(&s, &p, V) == TD_EINVAL);
    p.logit_bias_ids[0] = 1;
    p.logit_bias_values[0] = NAN;
    TH_CHECK(kn_sampler_init(&s, &p, V) == TD_EINVAL);
    p.logit_bias_values[0] = 1.0f;
    p.n_logit_bias = TD_MAX_LOGIT_BIAS + 1;
    TH_CHECK(kn_sampler_init(&s, &p, V) == TD_EINVAL);
    td_sampling m = {.min_tokens = 1, .n_min_tokens_ids = 1};
    m.min_tokens_ids[0] = -1;
    TH_CHECK(kn_sampler_init(&s, &m, V) == TD_EINVAL);
    m.min_tokens_ids[0] = 2;
    TH_CHECK(kn_sampler_init(&s, &m, V) == 0);
    kn_sampler_fini(&s);
}

int main(void)
{
    TH_RUN(test_greedy);
    TH_RUN(test_same_seed_same_tokens);
    TH_RUN(test_distribution);
    TH_RUN(test_filters);
    TH_RUN(test_top_p_paths_agree);
    TH_RUN(test_repetition_penalty);
    TH_RUN(test_presence_frequency_penalties);
    TH_RUN(test_penalty_distribution);
    TH_RUN(test_bad_input);
    TH_RUN(test_skip_equals_one_sample);
    TH_RUN(test_init_skips);
    TH_RUN(test_min_p_above_one);
    TH_RUN(test_logit_bias);
    TH_RUN(test_min_tokens);
    TH_RUN(test_repetition_whole_history);
    TH_RUN(test_bad_lists);
    TH_EXIT();
}
