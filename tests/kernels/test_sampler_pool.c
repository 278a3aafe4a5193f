/* test_sampler_pool.c: kn_sample spread over a CPU pool (kn_sampler_set_pool) draws the
 * tokens of the one-thread sampler, and both draw the tokens of a plain reference of the
 * chain (copy, argmax or max, exp, top-k by full sort, top-p by full sort, min-p, a linear
 * walk of the running sum: the sampler as it was before its passes were split and its
 * draw became a binary search), over a 49152-token vocabulary (several parts per pass),
 * for greedy, temperature, top-k, top-p, min-p, penalties, a mask, ties across part
 * boundaries and nan logits. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../tharness.h"
#include "cpu_pool.h"
#include "sampler.h"
#include "td_clock.h"
#include "td_err.h"

#define NV    49152
#define DRAWS 24

/* ---- the reference: the chain written plainly, its own copy of the RNG ---- */
typedef struct {
    int32_t id;
    float logit, p;
} ref_cand;

static uint64_t ref_splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t ref_rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static double ref_uniform(uint64_t *s)
{
    uint64_t r = ref_rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = ref_rotl(s[3], 45);
    return (double)(r >> 11) * 0x1.0p-53;
}

static int by_logit(const void *a, const void *b)
{
    const ref_cand *x = a, *y = b;
    if (x->logit != y->logit) return x->logit < y->logit ? 1 : -1;
    return x->id - y->id;
}

static int by_p(const void *a, const void *b)
{
    const ref_cand *x = a, *y = b;
    if (x->p != y->p) return x->p < y->p ? 1 : -1;
    return x->id - y->id;
}

/* One draw of the chain without penalties or mask; rng advanced when temperature > 0. */
static int32_t ref_sample(const td_sampling *p, uint64_t *rng, const float *l, ref_cand *c)
{
    int32_t n = NV, k = n;
    for (int32_t i = 0; i < n; i++)
        c[i] = (ref_cand){.id = i, .logit = l[i]};
    if (p->temperature <= 0) {
        int32_t best = 0;
        for (int32_t i = 1; i < n; i++)
            if (c[i].logit > c[best].logit) best = i;
        return best;
    }
    bool sorted = p->top_k > 0 && p->top_k < n;
    if (sorted) {
        qsort(c, (size_t)n, sizeof *c, by_logit);
        k = p->top_k;
    }
    double maxl = c[0].logit, sum = 0;
    for (int32_t i = 1; i < k; i++)
        if (c[i].logit > maxl) maxl = c[i].logit;
    for (int32_t i = 0; i < k; i++) {
        c[i].p = (float)exp(((double)c[i].logit - maxl) / p->temperature);
        sum += c[i].p;
    }
    if (p->top_p > 0 && p->top_p < 1) {
        int32_t keep = k;
        double acc = 0;
        if (!sorted) { /* the nucleus, most likely first, until its mass reaches top_p */
            qsort(c, (size_t)k, sizeof *c, by_p);
            for (keep = 0; keep < k && (keep == 0 || acc < p->top_p * sum); keep++)
                acc += c[keep].p;
        } else {
            for (int32_t i = 0; i < k; i++) {
                acc += c[i].p / sum;
                if (acc >= p->top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        k = keep;
    }
    if (p->min_p > 0) {
        int32_t keep = 0;
        for (int32_t i = 0; i < k; i++)
            if (c[i].p >= p->min_p) c[keep++] = c[i];
        k = keep;
    }
    sum = 0;
    for (int32_t i = 0; i < k; i++)
        sum += c[i].p;
    double r = ref_uniform(rng) * sum, acc = 0;
    for (int32_t i = 0; i < k; i++) {
        acc += c[i].p;
        if (r < acc) return c[i].id;
    }
    return c[k - 1].id;
}

/* logits of a model-like shape: a few large values over a broad tail */
static void fill_logits(float *l, unsigned seed)
{
    srand(seed);
    for (int32_t i = 0; i < NV; i++)
        l[i] = (float)(rand() % 20000) / 1000.0f - 10.0f;
    for (int j = 0; j < 8; j++)
        l[rand() % NV] = 12.0f + (float)j * 0.25f;
}

static kn_pool *pool2, *pool3;

/* DRAWS draws of p over fresh logits: reference, one thread, pool of 2, pool of 3 agree */
static void agree(td_sampling p, unsigned seed)
{
    float *l = malloc(NV * sizeof *l);
    ref_cand *rc = malloc(NV * sizeof *rc);
    kn_sampler s1, s2, s3;
    TH_REQUIRE(l && rc);
    TH_REQUIRE(kn_sampler_init(&s1, &p, NV) == 0 && kn_sampler_init(&s2, &p, NV) == 0 &&
               kn_sampler_init(&s3, &p, NV) == 0);
    kn_sampler_set_pool(&s2, pool2);
    kn_sampler_set_pool(&s3, pool3);
    uint64_t rng[4], x = p.seed;
    for (int i = 0; i < 4; i++)
        rng[i] = ref_splitmix(&x);
    int bad = 0;
    for (int d = 0; d < DRAWS; d++) {
        fill_logits(l, seed * 1000 + (unsigned)d);
        int32_t want = ref_sample(&p, rng, l, rc);
        int32_t a = kn_sample(&s1, l, NULL, 0, 0), b = kn_sample(&s2, l, NULL, 0, 0),
                c = kn_sample(&s3, l, NULL, 0, 0);
        bad += a != want || b != want || c != want;
    }
    TH_CHECKF(bad == 0, "T %.2f top_k %d top_p %.2f min_p %.2f: %d of %d draws differ",
              p.temperature, p.top_k, p.top_p, p.min_p, bad, DRAWS);
    kn_sampler_fini(&s1);
    kn_sampler_fini(&s2);
    kn_sampler_fini(&s3);
    free(l);
    free(rc);
}

static void test_against_reference(void)
{
    agree((td_sampling){.temperature = 0}, 1);
    agree((td_sampling){.temperature = 0.8f, .seed = 7}, 2);
    agree((td_sampling){.temperature = 1.0f, .seed = 8}, 3);
    agree((td_sampling){.temperature = 3.0f, .seed = 9}, 4); /* a flat distribution */
    agree((td_sampling){.temperature = 0.8f, .top_k = 40, .seed = 10}, 5);
    agree((td_sampling){.temperature = 0.8f, .top_p = 0.9f, .seed = 11}, 6);
    agree((td_sampling){.temperature = 2.0f, .top_p = 0.5f, .seed = 12}, 7);
    agree((td_sampling){.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .seed = 13}, 8);
    agree((td_sampling){.temperature = 1.5f, .min_p = 0.05f, .seed = 14}, 9);
    agree(
        (td_sampling){.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f, .seed = 15},
        10);
}

/* kn_exp_to_float is (float)exp bit for bit: 4M random points over the range the sampler
 * uses and beyond, the edges of the float range (0, subnormals, the rounding to 0) and the
 * special values. */
static void test_exp_to_float(void)
{
    static const double edge[] = {0.0,         -0.0,      -1e-300,  -1e-17, -0.5,
                                  -0.34657359, -0.34658,  -87.3365, -87.34, -103.278,
                                  -103.9721,   -103.9720, -104.0,   -104.1, -745.2,
                                  -1e300,      -INFINITY, 0.5,      88.0,   NAN};
    int bad = 0;
    for (size_t i = 0; i < sizeof edge / sizeof *edge; i++) {
        float a = kn_exp_to_float(edge[i]), b = (float)exp(edge[i]);
        bad += memcmp(&a, &b, sizeof a) != 0 && !(isnan(a) && isnan(b));
    }
    TH_CHECKF(bad == 0, "%d special values differ", bad);
    uint64_t x = 12345;
    for (int i = 0; i < 4000000; i++) {
        double v = -110.0 * (double)(ref_splitmix(&x) >> 11) * 0x1.0p-53;
        if (i % 4 == 0) v /= 64.0; /* more points near 0, where most logits land */
        float a = kn_exp_to_float(v), b = (float)exp(v);
        if (memcmp(&a, &b, sizeof a)) {
            if (bad < 5) fprintf(stderr, "exp(%.17g): %a against %a\n", v, a, b);
            bad++;
        }
    }
    TH_CHECKF(bad == 0, "%d of 4000000 random points differ", bad);
}

/* Greedy ties: the lowest id wins wherever the parts split the vocabulary. */
static void test_ties_across_parts(void)
{
    float *l = calloc(NV, sizeof *l);
    kn_sampler s;
    td_sampling p = {.temperature = 0};
    TH_REQUIRE(l && kn_sampler_init(&s, &p, NV) == 0);
    kn_sampler_set_pool(&s, pool3);
    l[NV - 1] = l[NV / 2] = l[NV / 3 + 1] = 5.0f;
    TH_CHECK(kn_sample(&s, l, NULL, 0, 0) == NV / 3 + 1);
    l[5] = 5.0f;
    TH_CHECK(kn_sample(&s, l, NULL, 0, 0) == 5);
    for (int32_t i = 0; i < NV; i++)
        l[i] = -INFINITY;
    TH_CHECK(kn_sample(&s, l, NULL, 0, 0) == 0);
    kn_sampler_fini(&s);
    free(l);
}

/* nan: greedy answers as the one-thread scan does (a nan in the second part is skipped,
 * at id 0 it wins), sampling fails with TD_EINVAL on every path. */
static void test_nan(void)
{
    float *l = malloc(NV * sizeof *l);
    kn_sampler g1, g2, t2;
    td_sampling pg = {.temperature = 0}, pt = {.temperature = 1.0f, .seed = 3};
    TH_REQUIRE(l && kn_sampler_init(&g1, &pg, NV) == 0 && kn_sampler_init(&g2, &pg, NV) == 0 &&
               kn_sampler_init(&t2, &pt, NV) == 0);
    kn_sampler_set_pool(&g2, pool2);
    kn_sampler_set_pool(&t2, pool2);
    fill_logits(l, 99);
    l[NV - 10] = NAN;
    l[NV - 5] = 100.0f;
    TH_CHECK(kn_sample(&g1, l, NULL, 0, 0) == NV - 5);
    TH_CHECK(kn_sample(&g2, l, NULL, 0, 0) == NV - 5);
    l[0] = NAN;
    TH_CHECK(kn_sample(&g1, l, NULL, 0, 0) == kn_sample(&g2, l, NULL, 0, 0));
    TH_CHECK(kn_sample(&t2, l, NULL, 0, 0) == TD_EINVAL);
    kn_sampler_fini(&g1);
    kn_sampler_fini(&g2);
    kn_sampler_fini(&t2);
    free(l);
}

/* The mask, the logit bias and every penalty: pooled and one-thread samplers agree draw by
 * draw; a mask that allows nothing fails on the pooled path too. */
static void test_mask_and_penalties(void)
{
    float *l = malloc(NV * sizeof *l);
    uint32_t *mask = malloc((NV / 32) * sizeof *mask);
    int32_t hist[64];
    TH_REQUIRE(l && mask);
    for (int i = 0; i < 64; i++)
        hist[i] = (i * 7919) % NV;
    td_sampling p = {.temperature = 0.9f,
                     .seed = 21,
                     .repeat_penalty = 1.3f,
                     .presence_penalty = 0.5f,
                     .frequency_penalty = 0.3f,
                     .n_logit_bias = 1,
                     .logit_bias_ids = {NV - 3},
                     .logit_bias_values = {4.0f}};
    for (int greedy = 0; greedy < 2; greedy++) {
        p.temperature = greedy ? 0 : 0.9f;
        kn_sampler a, b;
        TH_REQUIRE(kn_sampler_init(&a, &p, NV) == 0 && kn_sampler_init(&b, &p, NV) == 0);
        kn_sampler_set_pool(&b, pool3);
        int bad = 0;
        for (int d = 0; d < DRAWS; d++) {
            fill_logits(l, 500 + (unsigned)d);
            for (int w = 0; w < NV / 32; w++)
                mask[w] = (uint32_t)rand() | 1u; /* token 32 w always allowed */
            kn_sampler_set_mask(&a, d % 2 ? mask : NULL);
            kn_sampler_set_mask(&b, d % 2 ? mask : NULL);
            bad += kn_sample(&a, l, hist, 64, 16) != kn_sample(&b, l, hist, 64, 16);
        }
        TH_CHECKF(bad == 0, "greedy %d: %d of %d draws differ", greedy, bad, DRAWS);
        memset(mask, 0, (NV / 32) * sizeof *mask);
        kn_sampler_set_mask(&b, mask);
        TH_CHECK(kn_sample(&b, l, hist, 64, 16) == TD_EINVAL);
        kn_sampler_fini(&a);
        kn_sampler_fini(&b);
    }
    free(l);
    free(mask);
}

/* CPU time of this process, ns: what a pass costs, whatever else runs on the machine */
static int64_t cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* --bench: microseconds per draw at temperature 0.8 (the decode benchmark's setting) and
 * greedy, for the reference (the old chain's passes: copy, max, exp and sum, sum, walk), the
 * sampler on one thread and on pools of 2 and 3. */
static void bench(void)
{
    float *l = malloc(NV * sizeof *l);
    ref_cand *rc = malloc(NV * sizeof *rc);
    if (!l || !rc) return;
    fill_logits(l, 1);
    for (int greedy = 0; greedy < 2; greedy++) {
        td_sampling p = {.temperature = greedy ? 0 : 0.8f, .seed = 1};
        uint64_t rng[4] = {1, 2, 3, 4};
        kn_pool *pools[3] = {NULL, pool2, pool3};
        double us[4], cpu[4];
        int reps = 300;
        int64_t t0 = td_now_ns(), c0 = cpu_ns();
        for (int i = 0; i < reps; i++)
            (void)ref_sample(&p, rng, l, rc);
        us[0] = (double)(td_now_ns() - t0) / 1e3 / reps;
        cpu[0] = (double)(cpu_ns() - c0) / 1e3 / reps;
        for (int k = 0; k < 3; k++) {
            kn_sampler s;
            if (kn_sampler_init(&s, &p, NV)) return;
            kn_sampler_set_pool(&s, pools[k]);
            t0 = td_now_ns();
            c0 = cpu_ns();
            for (int i = 0; i < reps; i++)
                (void)kn_sample(&s, l, NULL, 0, 0);
            us[k + 1] = (double)(td_now_ns() - t0) / 1e3 / reps;
            cpu[k + 1] = (double)(cpu_ns() - c0) / 1e3 / reps;
            kn_sampler_fini(&s);
        }
        printf("%s, %d tokens, us per draw (wall / process CPU): reference %.1f / %.1f, one "
               "thread %.1f / %.1f, pool of 2 %.1f / %.1f, pool of 3 %.1f / %.1f\n",
               greedy ? "greedy" : "temperature 0.8", NV, us[0], cpu[0], us[1], cpu[1], us[2],
               cpu[2], us[3], cpu[3]);
    }
    free(l);
    free(rc);
}

int main(int argc, char **argv)
{
    if (kn_pool_create(2, &pool2) || kn_pool_create(3, &pool3)) {
        fprintf(stderr, "cannot create the pools\n");
        return 1;
    }
    if (argc > 1 && !strcmp(argv[1], "--bench")) {
        bench();
        kn_pool_destroy(pool2);
        kn_pool_destroy(pool3);
        return 0;
    }
    TH_RUN(test_exp_to_float);
    TH_RUN(test_against_reference);
    TH_RUN(test_ties_across_parts);
    TH_RUN(test_nan);
    TH_RUN(test_mask_and_penalties);
    kn_pool_destroy(pool2);
    kn_pool_destroy(pool3);
    TH_EXIT();
}
