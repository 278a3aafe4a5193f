/* sampler.c: the sampling chain over a candidate list. */
#include "sampler.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

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

/* Structured output: -inf on every token the mask leaves out (then cleared: one call). 0, or
 * TD_EINVAL when it allows none. */
static int apply_mask(kn_sampler *s, struct kn_cand *c, int32_t n)
{
    const uint32_t *m = s->mask;
    s->mask = NULL;
    int32_t n_ok = 0;
    for (int32_t i = 0; i < n; i++) {
        if (m[i >> 5] >> (i & 31) & 1)
            n_ok++;
        else
            c[i].logit = -INFINITY;
    }
    if (n_ok) return 0;
    TD_LOG_ERR("the token mask allows no token");
    return TD_EINVAL;
}

int32_t kn_sample(kn_sampler *s, const float *logits, const int32_t *history, int64_t n_hist,
                  int64_t n_out)
{
    const td_sampling *p = &s->p;
    int32_t n = s->n_vocab;
    struct kn_cand *c = s->cand;
    if (n_out < 0 || n_out > n_hist || (n_out && !history)) return TD_EINVAL;
    for (int32_t i = 0; i < n; i++)
        c[i] = (struct kn_cand){.id = i, .logit = logits[i]};
    if (s->mask && apply_mask(s, c, n)) return TD_EINVAL;

    bias_and_mask(p, c, n_out);
    if (s->seen && history) repeat_penalty(p, s->seen, c, n, history, n_hist);
    if (s->count && n_out) openai_penalties(p, s->count, c, n, history + (n_hist - n_out), n_out);
    if (p->temperature <= 0) {
        int32_t best = 0;
        for (int32_t i = 1; i < n; i++)
            if (c[i].logit > c[best].logit) best = i;
        return best;
    }
    for (int32_t i = 0; i < n; i++)
        if (isnan(c[i].logit)) {
            TD_LOG_ERR("logits contain nan");
            return TD_EINVAL;
        }
    /* top-k: the k best, sorted by logit. Without top-k the list stays in id order and is
     * never sorted whole (a 50k-entry sort costs more than a small model's decode step):
     * top-p then extracts the nucleus with a heap, min-p is a threshold. */
    int32_t k = n;
    bool sorted = false;
    if (p->top_k > 0 && p->top_k < n) {
        k = p->top_k;
        select_top(c, n, k);
        qsort(c, (size_t)k, sizeof *c, by_logit_desc);
        sorted = true;
    }
    double maxl = c[0].logit, sum = 0;
    for (int32_t i = 1; i < k; i++)
        if (c[i].logit > maxl) maxl = c[i].logit;
    for (int32_t i = 0; i < k; i++) {
        c[i].p = (float)exp(((double)c[i].logit - maxl) / p->temperature);
        sum += c[i].p;
    }
    if (p->top_p > 0 && p->top_p < 1) {
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
    sum = 0;
    for (int32_t i = 0; i < k; i++)
        sum += c[i].p;
    double r = uniform(s->rng) * sum, acc = 0;
    for (int32_t i = 0; i < k; i++) {
        acc += c[i].p;
        if (r < acc) return c[i].id;
    }
    return c[k - 1].id;
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
