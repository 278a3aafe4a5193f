/* dc_spec.c: speculative decoding's proposals and acceptance records (see dc_spec.h). */
#include "dc_spec.h"

#include <math.h>
#include <string.h>

/* The acceptance estimate: a running mean over reached proposals (each a trial), weighted
 * so that about the last 8 count; without trials (the request did not speculate in a
 * step) it drifts back toward the start, so a request whose text turned copy-like again
 * is tried again after a while instead of never (its estimate cannot move without
 * trials). */
#define ACCEPT_START  0.6
#define ACCEPT_WEIGHT 0.125
#define ACCEPT_DRIFT  0.02

void dc_spec_req_init(dc_spec_req *q)
{
    q->accept = ACCEPT_START;
}

void dc_spec_req_observe(dc_spec_req *q, int n_proposed, int n_accepted)
{
    if (n_proposed <= 0) {
        q->accept += (ACCEPT_START - q->accept) * ACCEPT_DRIFT;
        return;
    }
    for (int j = 0; j < n_accepted; j++)
        q->accept += (1.0 - q->accept) * ACCEPT_WEIGHT;
    if (n_accepted < n_proposed) q->accept -= q->accept * ACCEPT_WEIGHT; /* the rejected one */
}

void dc_spec_choose(dc_spec_cand *c, int n, double tokens, double ms,
                    double (*row_ms)(const void *ctx, int32_t pos), const void *ctx)
{
    /* the j-th proposal of a request is accepted with accept^j, less than the one before:
     * the best next proposal of each request is its next one */
    for (int i = 0; i < n; i++)
        c[i].take = 0;
    for (;;) {
        int best = -1;
        double p = 0;
        for (int i = 0; i < n; i++) {
            double pi = pow(c[i].accept, c[i].take + 1);
            if (c[i].take < c[i].n_cand && (best < 0 || pi > p)) best = i, p = pi;
        }
        if (best < 0) return;
        double cost = row_ms(ctx, c[best].pos0 + c[best].take);
        /* (tokens + p) / (ms + cost) > tokens / ms */
        if (!(p * ms > tokens * cost)) return;
        tokens += p;
        ms += cost;
        c[best].take++;
    }
}

int dc_spec_ngram(const int32_t *tokens, int32_t n, int ngram_min, int ngram_max, int k,
                  int32_t *out)
{
    if (k <= 0 || ngram_min < 1 || ngram_max < ngram_min || n <= ngram_min) return 0;
    /* an earlier occurrence ends before position e (tokens[e - len, e) equals the last len
     * tokens), e < n; scanned from the most recent, the first of the longest wins */
    int best = 0;
    int32_t best_e = 0;
    for (int32_t e = n - 1; e >= ngram_min; e--) {
        int len = 0;
        while (len < ngram_max && len < e && tokens[e - 1 - len] == tokens[n - 1 - len])
            len++;
        if (len >= ngram_min && len > best) {
            best = len;
            best_e = e;
            if (len == ngram_max) break;
        }
    }
    if (!best) return 0;
    int32_t m = n - best_e < k ? n - best_e : k; /* what followed it, up to the end */
    memcpy(out, tokens + best_e, (size_t)m * sizeof *out);
    return (int)m;
}
