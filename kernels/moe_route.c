/* moe_route.c: a mixture-of-experts layer's routing on the host (moe_route.h). */
#include "moe_route.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"

/* llama.cpp clamps the weights' sum at the smallest normal float16 before dividing. */
#define MIN_WEIGHT_SUM 6.103515625e-5f

void kn_moe_plan_free(kn_moe_plan *p)
{
    free(p->expert);
    free(p->weight);
    free(p->offset);
    free(p->token);
    free(p->slot);
    free(p->prob);
    free(p->sel);
    memset(p, 0, sizeof *p);
}

int kn_moe_plan_reserve(kn_moe_plan *p, int64_t n, int k, int n_expert)
{
    if (n * k <= p->cap && n_expert == p->n_expert) {
        p->k = k;
        return 0;
    }
    int64_t cap = n * k > p->cap ? n * k : p->cap;
    kn_moe_plan q = {.cap = cap};
    q.expert = malloc((size_t)cap * sizeof *q.expert);
    q.weight = malloc((size_t)cap * sizeof *q.weight);
    q.token = malloc((size_t)cap * sizeof *q.token);
    q.slot = malloc((size_t)cap * sizeof *q.slot);
    q.offset = malloc((size_t)(n_expert + 1) * sizeof *q.offset);
    q.prob = malloc((size_t)n_expert * sizeof *q.prob);
    q.sel = malloc((size_t)n_expert * sizeof *q.sel);
    if (!q.expert || !q.weight || !q.token || !q.slot || !q.offset || !q.prob || !q.sel) {
        kn_moe_plan_free(&q);
        return TD_ENOMEM;
    }
    kn_moe_plan_free(p);
    *p = q;
    p->n_expert = n_expert;
    p->k = k;
    return 0;
}

static void probabilities(kn_moe_gating gating, const float *l, float *pr, int n)
{
    if (gating == KN_MOE_SIGMOID) {
        for (int x = 0; x < n; x++)
            pr[x] = 1.0f / (1.0f + expf(-l[x]));
        return;
    }
    float mx = l[0], sum = 0.0f;
    for (int x = 1; x < n; x++)
        mx = l[x] > mx ? l[x] : mx;
    for (int x = 0; x < n; x++)
        sum += pr[x] = expf(l[x] - mx);
    for (int x = 0; x < n; x++)
        pr[x] /= sum;
}

/* The index of the largest of v[0..n) not yet taken (NaN marks taken), ties to the lower. */
static int best_of(const float *v, int n)
{
    int b = -1;
    for (int x = 0; x < n; x++)
        if (!isnan(v[x]) && (b < 0 || v[x] > v[b])) b = x;
    return b;
}

/* DeepSeek V3's group-limited choice: a group scores the sum of its two best scores; the
 * experts outside the n_group_used best groups are masked out (-inf). */
static void mask_groups(const kn_hparams *hp, float *sel)
{
    const int G = hp->n_expert_groups, per = hp->n_expert / G;
    float score[4096];
    for (int g = 0; g < G; g++) {
        const float *s = sel + g * per;
        int a = best_of(s, per), b = -1;
        for (int x = 0; x < per; x++)
            if (x != a && (b < 0 || s[x] > s[b])) b = x;
        score[g] = s[a] + s[b];
    }
    for (int u = 0; u < hp->n_group_used; u++)
        score[best_of(score, G)] = NAN; /* taken */
    for (int g = 0; g < G; g++)
        if (!isnan(score[g]))
            for (int x = 0; x < per; x++)
                sel[g * per + x] = -INFINITY;
}

/* Token row i's k choices and weights. */
static void choose(const kn_hparams *hp, const float *bias, kn_moe_plan *p, int64_t i)
{
    const int X = hp->n_expert, k = hp->n_expert_used;
    for (int x = 0; x < X; x++)
        p->sel[x] = bias ? p->prob[x] + bias[x] : p->prob[x];
    if (hp->n_expert_groups > 1) mask_groups(hp, p->sel);
    int32_t *ex = p->expert + i * k;
    float *w = p->weight + i * k;
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        ex[j] = best_of(p->sel, X);
        p->sel[ex[j]] = NAN;
        sum += w[j] = p->prob[ex[j]];
    }
    if (hp->moe_norm_w) {
        sum = sum > MIN_WEIGHT_SUM ? sum : MIN_WEIGHT_SUM;
        for (int j = 0; j < k; j++)
            w[j] /= sum;
    }
    if (hp->moe_w_scale != 1.0f)
        for (int j = 0; j < k; j++)
            w[j] *= hp->moe_w_scale;
}

int kn_moe_route(const kn_hparams *hp, const float *bias, const float *logits, int64_t n,
                 kn_moe_plan *p)
{
    int rc = kn_moe_choose(hp, bias, logits, n, p);
    if (!rc) kn_moe_group(p, n);
    return rc;
}

int kn_moe_choose(const kn_hparams *hp, const float *bias, const float *logits, int64_t n,
                  kn_moe_plan *p)
{
    const int X = hp->n_expert, k = hp->n_expert_used;
    int rc = kn_moe_plan_reserve(p, n, k, X);
    if (rc) return rc;
    p->n_tokens = n;
    for (int64_t i = 0; i < n; i++) {
        const float *l = logits + i * X;
        for (int x = 0; x < X; x++)
            if (!isfinite(l[x])) {
                TD_LOG_ERR("token %lld: the router's logit for expert %d is %g", (long long)i, x,
                           (double)l[x]);
                return TD_EINVAL;
            }
        probabilities(hp->moe_gating, l, p->prob, X);
        choose(hp, bias, p, i);
    }
    return 0;
}

void kn_moe_group(kn_moe_plan *p, int64_t n)
{
    const int X = p->n_expert, k = p->k;
    p->n_tokens = n;
    /* a counting sort, tokens ascending within each group */
    memset(p->offset, 0, (size_t)(X + 1) * sizeof *p->offset);
    for (int64_t c = 0; c < n * k; c++)
        p->offset[p->expert[c] + 1]++;
    for (int x = 0; x < X; x++)
        p->offset[x + 1] += p->offset[x];
    for (int64_t c = 0; c < n * k; c++) {
        int32_t at = p->offset[p->expert[c]]++;
        p->token[at] = (int32_t)(c / k);
        p->slot[c] = at;
    }
    for (int x = X; x > 0; x--) /* the fill moved each start to the next group's */
        p->offset[x] = p->offset[x - 1];
    p->offset[0] = 0;
}
