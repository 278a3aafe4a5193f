/* sampler.c: the sampling chain over a candidate list. */
#include "sampler.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_pool.h"
#include "td_err.h"

struct kn_cand {
    int32_t id;
    float logit;
    float p;
};

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static uint64_t xoshiro_next(uint64_t *s)
{
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

/* uniform in [0, 1) with 53 random bits */
static double uniform(uint64_t *s)
{
    return (double)(xoshiro_next(s) >> 11) * 0x1.0p-53;
}

/* The logit bias and the min_tokens ids come from the network: every id must be in the
 * vocabulary and every bias finite, the counts within their caps. */
static int check_lists(const td_sampling *p, int32_t n_vocab)
{
    if (p->n_logit_bias < 0 || p->n_logit_bias > TD_MAX_LOGIT_BIAS || p->n_min_tokens_ids < 0 ||
        p->n_min_tokens_ids > TD_MAX_MIN_TOKENS_IDS || p->min_tokens < 0) {
        TD_LOG_ERR("sampler: logit bias or min_tokens list out of range");
        return TD_EINVAL;
    }
    for (int32_t i = 0; i < p->n_logit_bias; i++)
        if (p->logit_bias_ids[i] < 0 || p->logit_bias_ids[i] >= n_vocab ||
            !isfinite(p->logit_bias_values[i])) {
            TD_LOG_ERR("sampler: logit bias entry %d (id %d) is invalid", i, p->logit_bias_ids[i]);
            return TD_EINVAL;
        }
    for (int32_t i = 0; i < p->n_min_tokens_ids; i++)
        if (p->min_tokens_ids[i] < 0 || p->min_tokens_ids[i] >= n_vocab) {
            TD_LOG_ERR("sampler: min_tokens id %d is outside the vocabulary", p->min_tokens_ids[i]);
            return TD_EINVAL;
        }
    return 0;
}

int kn_sampler_init(kn_sampler *s, const td_sampling *p, int32_t n_vocab)
{
    memset(s, 0, sizeof *s);
    if (n_vocab < 1 || check_lists(p, n_vocab)) return TD_EINVAL;
    s->p = *p;
    if (s->p.repeat_last_n <= 0) s->p.repeat_last_n = 64;
    s->n_vocab = n_vocab;
    s->cand = malloc((size_t)n_vocab * sizeof *s->cand);
    s->cand2 = malloc((size_t)n_vocab * sizeof *s->cand2);
    bool counts = s->p.presence_penalty != 0 || s->p.frequency_penalty != 0;
    if (counts) s->count = calloc((size_t)n_vocab, sizeof *s->count);
    bool rep = s->p.repeat_penalty > 0 && s->p.repeat_penalty != 1.0f;
    if (rep) s->seen = calloc((size_t)n_vocab, sizeof *s->seen);
    if (!s->cand || !s->cand2 || (counts && !s->count) || (rep && !s->seen)) {
        kn_sampler_fini(s);
        return TD_ENOMEM;
    }
    uint64_t x = p->seed;
    for (int i = 0; i < 4; i++)
        s->rng[i] = splitmix64(&x);
    for (uint32_t k = 0; k < p->skip_samples; k++)
        kn_sampler_skip(s); /* the draws made elsewhere (td_sampling.skip_samples) */
    return 0;
}

void kn_sampler_fini(kn_sampler *s)
{
    free(s->cand);
    free(s->cand2);
    free(s->count);
    free(s->seen);
    s->cand = s->cand2 = NULL;
    s->count = NULL;
    s->seen = NULL;
}

static int by_logit_desc(const void *a, const void *b)
{
    const struct kn_cand *x = a, *y = b;
    if (x->logit != y->logit) return x->logit < y->logit ? 1 : -1;
    return x->id - y->id;
}

static bool worse(const struct kn_cand *a, const struct kn_cand *b)
{
    return a->logit < b->logit || (a->logit == b->logit && a->id > b->id);
}

static void sift_down(struct kn_cand *h, int32_t k, int32_t i)
{
    for (;;) {
        int32_t l = 2 * i + 1, r = l + 1, w = i;
        if (l < k && worse(&h[l], &h[w])) w = l;
        if (r < k && worse(&h[r], &h[w])) w = r;
        if (w == i) return;
        struct kn_cand t = h[i];
        h[i] = h[w];
        h[w] = t;
        i = w;
    }
}

/* Move the k best candidates to c[0..k) (unordered): a min-heap of the best k seen,
 * O(n log k) instead of sorting the whole vocabulary. */
static void select_top(struct kn_cand *c, int32_t n, int32_t k)
{
    for (int32_t i = k / 2 - 1; i >= 0; i--)
        sift_down(c, k, i);
    for (int32_t i = k; i < n; i++)
        if (worse(&c[0], &c[i])) {
            c[0] = c[i];
            sift_down(c, k, 0);
        }
}

static bool more_likely(const struct kn_cand *a, const struct kn_cand *b)
{
    return a->p > b->p || (a->p == b->p && a->id < b->id);
}

/* Top-p without a full sort: a max-heap over c[0..k) by probability, popped into out in
 * descending order until the popped mass reaches `mass`; the nucleus is copied back to
 * c[0..returned). O(k + m log k) for a nucleus of m tokens. */
static int32_t nucleus(struct kn_cand *c, int32_t k, struct kn_cand *out, double mass)
{
    for (int32_t i = k / 2 - 1; i >= 0; i--) {
        for (int32_t j = i;;) { /* sift down (max-heap) */
            int32_t l = 2 * j + 1, r = l + 1, b = j;
            if (l < k && more_likely(&c[l], &c[b])) b = l;
            if (r < k && more_likely(&c[r], &c[b])) b = r;
            if (b == j) break;
            struct kn_cand t = c[j];
            c[j] = c[b];
            c[b] = t;
            j = b;
        }
    }
    int32_t m = 0, left = k;
    double acc = 0;
    while (left > 0 && (m == 0 || acc < mass)) {
        out[m] = c[0];
        acc += c[0].p;
        m++;
        c[0] = c[--left];
        for (int32_t j = 0;;) {
            int32_t l = 2 * j + 1, r = l + 1, b = j;
            if (l < left && more_likely(&c[l], &c[b])) b = l;
            if (r < left && more_likely(&c[r], &c[b])) b = r;
            if (b == j) break;
            struct kn_cand t = c[j];
            c[j] = c[b];
            c[b] = t;
            j = b;
        }
    }
    memcpy(c, out, (size_t)m * sizeof *c);
    return m;
}

/* llama.cpp's repetition penalty: each distinct token of the last repeat_last_n once, in
 * O(window) (seen: the zeroed scratch, marked at each id's first visit and cleared after; the
 * router's window is the whole history, vLLM's repetition_penalty). */
static void repeat_penalty(const td_sampling *p, uint8_t *seen, struct kn_cand *c, int32_t n,
                           const int32_t *history, int64_t n_hist)
{
    int64_t from = n_hist > p->repeat_last_n ? n_hist - p->repeat_last_n : 0;
    for (int64_t i = from; i < n_hist; i++) {
        int32_t id = history[i];
        if (id < 0 || id >= n || seen[id]) continue;
        seen[id] = 1;
        float *l = &c[id].logit;
        *l = *l > 0 ? *l / p->repeat_penalty : *l * p->repeat_penalty;
    }
    for (int64_t i = from; i < n_hist; i++)
        if (history[i] >= 0 && history[i] < n) seen[history[i]] = 0;
}

/* vLLM's logits processors, before everything else: the logit bias is added, then the
 * min_tokens ids are masked while fewer than min_tokens tokens were generated. */
static void bias_and_mask(const td_sampling *p, struct kn_cand *c, int64_t n_out)
{
    for (int32_t i = 0; i < p->n_logit_bias; i++)
        c[p->logit_bias_ids[i]].logit += p->logit_bias_values[i];
    if (n_out < p->min_tokens)
        for (int32_t i = 0; i < p->n_min_tokens_ids; i++)
            c[p->min_tokens_ids[i]].logit = -INFINITY;
}

/* OpenAI's presence and frequency penalties over out (n_out generated tokens), in O(n_out):
 * count each id in the zeroed count array, then penalize and re-zero it at each id's first
 * visit. */
static void openai_penalties(const td_sampling *p, int32_t *count, struct kn_cand *c, int32_t n,
                             const int32_t *out, int64_t n_out)
{
    for (int64_t i = 0; i < n_out; i++)
        if (out[i] >= 0 && out[i] < n) count[out[i]]++;
    for (int64_t i = 0; i < n_out; i++) {
        int32_t id = out[i];
        if (id < 0 || id >= n || !count[id]) continue;
        c[id].logit -= p->frequency_penalty * (float)count[id] + p->presence_penalty;
        count[id] = 0;
    }
}

void kn_sampler_set_mask(kn_sampler *s, const uint32_t *mask)
{
    s->mask = mask;
}

/* ---- per-token passes, split in parts over the pool ----
 * Each part [i0, i1) of a pass writes only its own tokens and its own smp_part slot; the
 * slots are read back in part order, so every result (the first argmax, the maximum, each
 * token's p) is the one-thread pass's, bit for bit. Sums stay on the calling thread. */
#define SMP_MAX_PARTS 64
#define SMP_MIN_PART  4096 /* tokens: a smaller part costs more to hand out than to run */

typedef struct {
    int32_t best; /* first index of the part's largest logit; -1: the part did not run */
    int32_t n_ok; /* tokens the mask allows */
    float max;    /* the part's largest logit (meaningless if nan) */
    bool nan;     /* a logit is nan */
    char pad[48]; /* one cache line per part: parts run on different cores */
} smp_part;

typedef struct {
    struct kn_cand *c;   /* (n) the candidates */
    const float *logits; /* (n) */
    const uint32_t *mask;
    double maxl, temp; /* the exp pass: p = exp((logit - maxl) / temp) */
    smp_part part[SMP_MAX_PARTS];
} smp_job;

/* Run fn over [0, n): on the pool when the sampler has one and n is large enough, else as
 * one part here. Every slot starts "not run". */
static void smp_run(const kn_sampler *s, smp_job *J, int32_t n, kn_pool_fn fn)
{
    for (int t = 0; t < SMP_MAX_PARTS; t++)
        J->part[t].best = -1;
    int64_t min = (n + SMP_MAX_PARTS - 1) / SMP_MAX_PARTS; /* at most SMP_MAX_PARTS parts */
    if (min < SMP_MIN_PART) min = SMP_MIN_PART;
    if (s->pool)
        kn_pool_run(s->pool, n, min, fn, J);
    else if (n > 0)
        fn(J, 0, n, 0);
}

/* c[i] = (i, logits[i]), the structured-output mask applied (-inf where it says no) */
static void fill_part(void *arg, int64_t i0, int64_t i1, int tid)
{
    smp_job *J = arg;
    struct kn_cand *c = J->c;
    for (int64_t i = i0; i < i1; i++)
        c[i] = (struct kn_cand){.id = (int32_t)i, .logit = J->logits[i]};
    int32_t n_ok = 0;
    if (J->mask)
        for (int64_t i = i0; i < i1; i++) {
            if (J->mask[i >> 5] >> (i & 31) & 1)
                n_ok++;
            else
                c[i].logit = -INFINITY;
        }
    J->part[tid].n_ok = n_ok;
    J->part[tid].best = (int32_t)i0;
}

/* nan, the largest logit and its first index */
static void scan_part(void *arg, int64_t i0, int64_t i1, int tid)
{
    smp_job *J = arg;
    const struct kn_cand *c = J->c;
    float mx = c[i0].logit;
    int32_t best = (int32_t)i0;
    bool nan = false;
    for (int64_t i = i0; i < i1; i++) {
        float x = c[i].logit;
        nan |= isnan(x);
        if (x > mx) {
            mx = x;
            best = (int32_t)i;
        }
    }
    J->part[tid] = (smp_part){.best = best, .max = mx, .nan = nan};
}

/* 2^(j/32), j = 0..31, each within an ulp */
static const double exp2_32[32] = {
    0x1.0000000000000p+0, 0x1.059b0d3158574p+0, 0x1.0b5586cf9890fp+0, 0x1.11301d0125b51p+0,
    0x1.172b83c7d517bp+0, 0x1.1d4873168b9aap+0, 0x1.2387a6e756238p+0, 0x1.29e9df51fdee1p+0,
    0x1.306fe0a31b715p+0, 0x1.371a7373aa9cbp+0, 0x1.3dea64c123422p+0, 0x1.44e086061892dp+0,
    0x1.4bfdad5362a27p+0, 0x1.5342b569d4f82p+0, 0x1.5ab07dd485429p+0, 0x1.6247eb03a5585p+0,
    0x1.6a09e667f3bcdp+0, 0x1.71f75e8ec5f74p+0, 0x1.7a11473eb0187p+0, 0x1.82589994cce13p+0,
    0x1.8ace5422aa0dbp+0, 0x1.93737b0cdc5e5p+0, 0x1.9c49182a3f090p+0, 0x1.a5503b23e255dp+0,
    0x1.ae89f995ad3adp+0, 0x1.b7f76f2fb5e47p+0, 0x1.c199bdd85529cp+0, 0x1.cb720dcef9069p+0,
    0x1.d5818dcfba487p+0, 0x1.dfc97337b9b5fp+0, 0x1.ea4afa2a490dap+0, 0x1.f50765b6e4540p+0};

/* exp(x) for x in [-104, 0] within 1e-15 (relative), branch-free so that loops over it
 * vectorize: x = (32 m + j) ln2 / 32 + r, |r| <= ln2 / 64 (k = 32 m + j read from the low
 * bits of the 1.5 * 2^52 rounding; fdlibm's split of ln 2, over 32: k ln2_hi / 32 is exact
 * for |k| < 2^16), exp(x) = 2^m 2^(j/32) exp(r), exp(r) by its Taylor series to r^6
 * (truncation < 4e-18). */
static inline double exp_near(double x)
{
    double t = x * (32.0 * 1.4426950408889634) + 0x1.8p52, kd = t - 0x1.8p52;
    double r =
        (x - kd * (6.93147180369123816490e-01 / 32)) - kd * (1.90821492927058770002e-10 / 32);
    uint64_t tb;
    memcpy(&tb, &t, sizeof tb);
    int64_t k = (int32_t)(uint32_t)tb; /* in [-4802, 0] */
    double q = r * (1.0 / 720.0) + 1.0 / 120.0;
    q = q * r + 1.0 / 24.0;
    q = q * r + 1.0 / 6.0;
    q = q * r + 0.5;
    q = q * r + 1.0;
    q = q * r + 1.0;
    uint64_t sb = (uint64_t)((k >> 5) + 1023) << 52; /* 2^m, m = floor(k / 32) in [-151, 0] */
    double scale;
    memcpy(&scale, &sb, sizeof scale);
    return q * exp2_32[k & 31] * scale;
}

/* The float of y ~ exp(x) (exp_near): y is within 1e-15 of exp(x), libm's exp within 1 ulp,
 * so when the window y (1 +- 1e-13) rounds to one float, libm's exp(x) rounds to it too;
 * else (about once in 10^6), and outside [-104, 0], libm decides. */
static inline float exp_round(double x, double y)
{
    if (!(x >= -104.0 && x <= 0.0)) /* below -104, exp(x) < 2^-150 rounds to 0 in float */
        return x < -104.0 ? 0.0f : (float)exp(x);
    float lo = (float)(y * (1.0 - 1e-13)), hi = (float)(y * (1.0 + 1e-13));
    return lo == hi ? lo : (float)exp(x);
}

float kn_exp_to_float(double x)
{
    double xc = x < -104.0 ? -104.0 : (x > 0.0 ? 0.0 : x);
    return exp_round(x, exp_near(xc == xc ? xc : 0.0));
}

#define EXP_BLOCK 256

/* c[i].p = (float)exp((c[i].logit - maxl) / temp), as libm would give it: blocks of
 * EXP_BLOCK through the vectorized exp_near, then the rounding check */
static void exp_part(void *arg, int64_t i0, int64_t i1, int tid)
{
    smp_job *J = arg;
    struct kn_cand *c = J->c;
    double x[EXP_BLOCK], y[EXP_BLOCK];
    for (int64_t b = i0; b < i1; b += EXP_BLOCK) {
        int64_t m = i1 - b < EXP_BLOCK ? i1 - b : EXP_BLOCK;
        for (int64_t i = 0; i < m; i++)
            x[i] = ((double)c[b + i].logit - J->maxl) / J->temp;
        for (int64_t i = m; i < EXP_BLOCK; i++)
            x[i] = 0;
        for (int i = 0; i < EXP_BLOCK; i++) { /* a fixed count: vectorized at -O2 */
            double xc = x[i] < -104.0 ? -104.0 : (x[i] > 0.0 ? 0.0 : x[i]);
            y[i] = exp_near(xc);
        }
        for (int64_t i = 0; i < m; i++)
            c[b + i].p = exp_round(x[i], y[i]);
    }
    J->part[tid].best = (int32_t)i0;
}

/* The candidates with the mask applied; 0, or TD_EINVAL when the mask allows no token. */
static int fill(kn_sampler *s, smp_job *J, const float *logits)
{
    J->c = s->cand;
    J->logits = logits;
    J->mask = s->mask;
    s->mask = NULL; /* one call */
    smp_run(s, J, s->n_vocab, fill_part);
    if (!J->mask) return 0;
    int64_t n_ok = 0;
    for (int t = 0; t < SMP_MAX_PARTS; t++)
        if (J->part[t].best >= 0) n_ok += J->part[t].n_ok;
    if (n_ok) return 0;
    TD_LOG_ERR("the token mask allows no token");
    return TD_EINVAL;
}

/* The scan over c[0..n): true if a logit is nan; else *best (first argmax) and *max. */
static bool scan(const kn_sampler *s, smp_job *J, int32_t n, int32_t *best, float *max)
{
    smp_run(s, J, n, scan_part);
    int32_t b = -1;
    for (int t = 0; t < SMP_MAX_PARTS; t++) {
        const smp_part *q = &J->part[t];
        if (q->best < 0) continue;
        if (q->nan) return true;
        if (b < 0 || q->max > J->c[b].logit) b = q->best;
    }
    *best = b;
    *max = J->c[b].logit;
    return false;
}

/* Greedy: the first index of the largest logit; the one-thread scan when a logit is nan
 * (its answer then depends on where the nan is). */
static int32_t argmax(const kn_sampler *s, smp_job *J)
{
    int32_t best;
    float mx;
    if (!scan(s, J, s->n_vocab, &best, &mx)) return best;
    const struct kn_cand *c = J->c;
    best = 0;
    for (int32_t i = 1; i < s->n_vocab; i++)
        if (c[i].logit > c[best].logit) best = i;
    return best;
}

/* The draw from c[0..k) by weight p: the first i whose running sum exceeds r = u * sum,
 * by binary search over the running sums (cum, k doubles; the sums of a linear walk, so
 * the same token). */
static int32_t draw_token(kn_sampler *s, const struct kn_cand *c, int32_t k, double *cum)
{
    if (k < 1) { /* only with an infinite logit: its p is nan and fails min_p */
        TD_LOG_ERR("logits contain inf: no token left to draw");
        return TD_EINVAL;
    }
    double acc = 0;
    for (int32_t i = 0; i < k; i++)
        cum[i] = acc += c[i].p;
    double r = uniform(s->rng) * acc;
    int32_t lo = 0, hi = k;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (r < cum[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    return c[lo < k ? lo : k - 1].id;
}

void kn_sampler_set_pool(kn_sampler *s, struct kn_pool *pool)
{
    s->pool = pool;
}

int32_t kn_sample(kn_sampler *s, const float *logits, const int32_t *history, int64_t n_hist,
                  int64_t n_out)
{
    const td_sampling *p = &s->p;
    int32_t n = s->n_vocab;
    struct kn_cand *c = s->cand;
    if (n_out < 0 || n_out > n_hist || (n_out && !history)) return TD_EINVAL;
    smp_job J;
    if (fill(s, &J, logits)) return TD_EINVAL;

    bias_and_mask(p, c, n_out);
    if (s->seen && history) repeat_penalty(p, s->seen, c, n, history, n_hist);
    if (s->count && n_out) openai_penalties(p, s->count, c, n, history + (n_hist - n_out), n_out);
    if (p->temperature <= 0) return argmax(s, &J);
    int32_t best;
    float mx;
    if (scan(s, &J, n, &best, &mx)) {
        TD_LOG_ERR("logits contain nan");
        return TD_EINVAL;
    }
    /* top-k: the k best, sorted by logit. Without top-k the list stays in id order and is
     * never sorted whole (a 50k-entry sort costs more than a small model's decode step):
     * top-p then extracts the nucleus with a heap, min-p is a threshold. */
    int32_t k = n;
    bool sorted = false;
    double maxl = mx;
    if (p->top_k > 0 && p->top_k < n) {
        k = p->top_k;
        select_top(c, n, k);
        qsort(c, (size_t)k, sizeof *c, by_logit_desc);
        sorted = true;
        maxl = c[0].logit;
    }
    J.maxl = maxl;
    J.temp = p->temperature;
    smp_run(s, &J, k, exp_part);
    if (p->top_p > 0 && p->top_p < 1) {
        double sum = 0; /* in id (or top-k) order, as the nucleus' mass is defined */
        for (int32_t i = 0; i < k; i++)
            sum += c[i].p;
        if (!sorted) {
            k = nucleus(c, k, s->cand2, p->top_p * sum);
        } else {
            double acc = 0;
            int32_t keep = k;
            for (int32_t i = 0; i < k; i++) {
                acc += c[i].p / sum;
                if (acc >= p->top_p) {
                    keep = i + 1;
                    break;
                }
            }
            k = keep;
        }
    }
    if (p->min_p > 0) {
        /* relative to the most likely token, whose p is 1 (it survives every filter); a
         * min_p above 1 would keep nothing, so it is capped at 1 (keep the best only) */
        float min_p = p->min_p > 1.0f ? 1.0f : p->min_p;
        int32_t keep = 0;
        for (int32_t i = 0; i < k; i++)
            if (c[i].p >= min_p) c[keep++] = c[i];
        k = keep;
    }
    /* cand2 is free again (the nucleus went back to c): it holds the running sums */
    return draw_token(s, c, k, (double *)(void *)s->cand2);
}

void kn_sampler_skip(kn_sampler *s)
{
    /* mirrors kn_sample: greedy returns before the draw; otherwise exactly one uniform() */
    if (s->p.temperature > 0) (void)xoshiro_next(s->rng);
}

/* a before b in the top-k order: larger logit first, then lower id */
static bool lp_before(float la, int32_t ia, float lb, int32_t ib)
{
    return la > lb || (la == lb && ia < ib);
}

/* sift the heap root down; heap[0] is the entry that comes last in the top-k order */
static void lp_sift(td_logprob *h, int n, int i)
{
    for (;;) {
        int l = 2 * i + 1, r = l + 1, w = i;
        if (l < n && lp_before(h[w].logprob, h[w].id, h[l].logprob, h[l].id)) w = l;
        if (r < n && lp_before(h[w].logprob, h[w].id, h[r].logprob, h[r].id)) w = r;
        if (w == i) return;
        td_logprob t = h[i];
        h[i] = h[w];
        h[w] = t;
        i = w;
    }
}

/* exp(x) for x <= 0 in float, branch-free so the loops below vectorize: 2^n * p(r) with
 * n = round(x / ln 2) (the 1.5 * 2^23 trick), r = x - n ln 2 (ln 2 split in two), p
 * Cephes' degree-6 expf polynomial (relative error ~2e-7); x below -87 gives ~2^-126. */
static inline float lp_expf(float x)
{
    x = x < -87.0f ? -87.0f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#define LP_LANES 16

/* log(sum exp(l[i])) over n: the maximum subtracted, exp in float (lp_expf) summed in
 * LP_LANES float lanes per block of 1024 (vectorized without reassociation flags), the
 * blocks' sums in double. */
static double lp_logsumexp(const float *l, int32_t n)
{
    float mxl[LP_LANES];
    for (int j = 0; j < LP_LANES; j++)
        mxl[j] = l[0];
    int32_t n16 = n - n % LP_LANES;
    for (int32_t i = 0; i < n16; i += LP_LANES)
        for (int j = 0; j < LP_LANES; j++)
            mxl[j] = l[i + j] > mxl[j] ? l[i + j] : mxl[j];
    float mx = mxl[0];
    for (int j = 1; j < LP_LANES; j++)
        mx = mxl[j] > mx ? mxl[j] : mx;
    for (int32_t i = n16; i < n; i++)
        mx = l[i] > mx ? l[i] : mx;
    double sum = 0;
    for (int32_t b = 0; b < n16; b += 1024) {
        int32_t e = n16 - b < 1024 ? n16 : b + 1024;
        float acc[LP_LANES] = {0};
        for (int32_t i = b; i < e; i += LP_LANES)
            for (int j = 0; j < LP_LANES; j++)
                acc[j] += lp_expf(l[i + j] - mx);
        for (int j = 0; j < LP_LANES; j++)
            sum += (double)acc[j];
    }
    for (int32_t i = n16; i < n; i++)
        sum += (double)lp_expf(l[i] - mx);
    return (double)mx + log(sum);
}

int kn_logprobs(const float *logits, int32_t n_vocab, int32_t chosen, int k, td_logprob_entry *out)
{
    td_logprob *top = out->top;
    if (n_vocab < 1 || chosen < 0 || chosen >= n_vocab || k < 0 || k > TD_MAX_TOP_LOGPROBS ||
        k > n_vocab)
        return TD_EINVAL;
    double lse = lp_logsumexp(logits, n_vocab);
    out->logprob = (float)((double)logits[chosen] - lse);
    out->n_top = k;
    if (k == 0) return 0;
    /* heap of the k best seen so far, holding logits; its root is the worst of them */
    int n = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        float x = logits[i];
        if (n < k) {
            top[n++] = (td_logprob){.id = i, .logprob = x};
            for (int j = n / 2 - 1; n == k && j >= 0; j--)
                lp_sift(top, n, j);
        } else if (lp_before(x, i, top[0].logprob, top[0].id)) {
            top[0] = (td_logprob){.id = i, .logprob = x};
            lp_sift(top, n, 0);
        }
    }
    /* heap order -> best first: repeatedly move the worst to the end */
    for (int m = n; m > 1; m--) {
        td_logprob t = top[0];
        top[0] = top[m - 1];
        top[m - 1] = t;
        lp_sift(top, m - 1, 0);
    }
    for (int j = 0; j < n; j++)
        top[j].logprob = (float)((double)top[j].logprob - lse);
    return 0;
}

int32_t kn_argmax(const float *v, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}
