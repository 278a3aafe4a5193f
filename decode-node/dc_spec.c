/* dc_spec.c: speculative decoding's proposals and acceptance records (see dc_spec.h). */
#include "dc_spec.h"

#include <string.h>

/* The acceptance estimates: running means over their trials (a step's first proposal for
 * accept; each later one reached, after an accepted one, for cont), weighted so that about
 * the last 8 count; without trials (the request did not speculate in a step) they drift
 * back toward the start, so a request whose text turned copy-like again is tried again
 * after a while instead of never (an estimate cannot move without trials). */
#define ACCEPT_START  0.6
#define ACCEPT_WEIGHT 0.125
#define ACCEPT_DRIFT  0.02

void dc_spec_req_init(dc_spec_req *q)
{
    q->accept = q->cont = ACCEPT_START;
}

static void trial(double *est, bool ok)
{
    *est += ((ok ? 1.0 : 0.0) - *est) * ACCEPT_WEIGHT;
}

void dc_spec_req_observe(dc_spec_req *q, int n_proposed, int n_accepted)
{
    if (n_proposed <= 0) {
        q->accept += (ACCEPT_START - q->accept) * ACCEPT_DRIFT;
        q->cont += (ACCEPT_START - q->cont) * ACCEPT_DRIFT;
        return;
    }
    trial(&q->accept, n_accepted > 0);
    /* proposals 2.. n_accepted + 1 were reached after an accepted one */
    for (int j = 2; j <= n_proposed && j <= n_accepted + 1; j++)
        trial(&q->cont, j <= n_accepted);
}

/* The next proposal of a request: its chance (the j-th is accepted with accept cont^(j-1),
 * less than the one before, so the best next proposal of each request is its next one),
 * kept in next as takes grow (no pow in the loops: they run per step over the batch). */
static double next_p(const dc_spec_cand *c)
{
    return c->next;
}

static void take_one(dc_spec_cand *c)
{
    c->take++;
    c->next *= c->cont;
}

/* The requests that can take a proposal at depth + 1 (their take is depth), likeliest first,
 * ties by index: the one after (p, i) in that order, or -1. */
static int layer_next(const dc_spec_cand *c, int n, int depth, double p, int i)
{
    int k = -1;
    double pk = 0;
    for (int j = 0; j < n; j++) {
        if (c[j].take != depth || c[j].n_cand <= depth) continue;
        double pj = next_p(&c[j]);
        if ((pj < p || (pj == p && j > i)) && (k < 0 || pj > pk)) k = j, pk = pj;
    }
    return k;
}

void dc_spec_choose(dc_spec_cand *c, int n, double tokens, double ms,
                    double (*row_ms)(const void *ctx, int32_t pos), const void *ctx, double pass_ms)
{
    int depth = 0; /* the deepest take so far: the proposer's passes */
    for (int i = 0; i < n; i++) {
        c[i].take = 0;
        c[i].next = c[i].accept;
    }
    /* Each round weighs two moves by expected tokens per ms: (a) the likeliest proposal no
     * deeper than depth (a row, no pass), (b) a new depth: one pass and the rows of the
     * likeliest requests that can go one deeper, as many as give the best ratio (a pass
     * shared by several requests pays where one request's alone would not). With no pass
     * cost (prompt lookup) both are single proposals, the likeliest first. */
    for (;;) {
        int a = -1;
        double pa = 0, ca = 0;
        for (int i = 0; i < n; i++)
            if (c[i].take < depth && c[i].take < c[i].n_cand && (a < 0 || next_p(&c[i]) > pa))
                a = i, pa = next_p(&c[i]);
        if (a >= 0) ca = row_ms(ctx, c[a].pos0 + c[a].take);
        double pb = 0, cb = 0, gain = 0, cost = pass_ms, pk = 2;
        int mb = 0, m = 0;
        for (int k = layer_next(c, n, depth, pk, -1); k >= 0; k = layer_next(c, n, depth, pk, k)) {
            pk = next_p(&c[k]);
            gain += pk;
            cost += row_ms(ctx, c[k].pos0 + c[k].take);
            /* the chances fall along the walk: once one lowers the ratio, the rest would */
            if (!(++m == 1 || gain * cb > pb * cost)) break;
            pb = gain, cb = cost, mb = m;
        }
        bool take_a = a >= 0 && (mb == 0 || pa * cb >= pb * ca);
        double gp = take_a ? pa : pb, gc = take_a ? ca : cb;
        /* (tokens + gp) / (ms + gc) > tokens / ms */
        if ((!take_a && mb == 0) || !(gp * ms > tokens * gc)) return;
        tokens += gp;
        ms += gc;
        if (take_a) {
            take_one(&c[a]);
            continue;
        }
        /* the layer's first mb members (each marked once its chance is read: a marked one
         * leaves the layer, and the walk goes on after it) */
        pk = 2;
        for (int j = 0, k = layer_next(c, n, depth, pk, -1); j < mb && k >= 0; j++) {
            pk = next_p(&c[k]);
            take_one(&c[k]); /* its take was depth */
            k = layer_next(c, n, depth, pk, k);
        }
        depth++;
    }
}

void dc_spec_gate_init(dc_spec_gate *g, bool on)
{
    *g = (dc_spec_gate){.on = on, .step_bucket = -1, .reprobe = -1};
    for (int b = 0; b < DC_SPEC_GATE_BUCKETS; b++)
        g->ms_tok[b][0] = g->ms_tok[b][1] = -1;
}

int dc_spec_gate_bucket(int n_decode)
{
    int b = 0;
    while (b < DC_SPEC_GATE_BUCKETS - 1 && n_decode >= 2 << b)
        b++;
    return b;
}

bool dc_spec_gate_allow(dc_spec_gate *g, int n_decode)
{
    if (!g->on || n_decode < 1) {
        g->step_bucket = -1;
        return true;
    }
    int b = dc_spec_gate_bucket(n_decode);
    bool allow = !g->held[b];
    double cur = g->ms_tok[b][allow], other = g->ms_tok[b][!allow];
    /* the other way: probed often while unmeasured or close, rarely once far behind */
    int every = other >= 0 && cur >= 0 && cur < DC_SPEC_GATE_FAR * other ? DC_SPEC_GATE_PROBE_FAR
                                                                         : DC_SPEC_GATE_PROBE;
    if (g->reprobe == b) { /* the step that stands in for a skipped one */
        g->reprobe = -1;
        allow = true;
    } else if (++g->steps[b] % (uint64_t)every == 0) {
        allow = !allow;
    } else if (!allow) {
        g->held_steps++;
    }
    g->step_bucket = b;
    g->step_allowed = allow;
    return allow;
}

void dc_spec_gate_skip(dc_spec_gate *g)
{
    if (g->step_bucket >= 0 && g->step_allowed) g->reprobe = g->step_bucket;
    g->step_bucket = -1;
}

void dc_spec_gate_observe(dc_spec_gate *g, double ms, int tokens)
{
    int b = g->step_bucket, w = g->step_allowed;
    g->step_bucket = -1;
    if (b < 0 || !(ms > 0) || tokens < 1) return;
    double r = ms / tokens, *x = &g->ms_tok[b][w];
    if (*x < 0) {
        *x = r;
    } else {
        if (r > 2 * *x) r = 2 * *x; /* an outlier moves the mean as twice the mean would */
        *x += (w == !g->held[b] ? DC_SPEC_GATE_ALPHA : DC_SPEC_GATE_ALPHA_PROBE) * (r - *x);
    }
    if (g->n_obs[b][w] < UINT32_MAX) g->n_obs[b][w]++;
    bool allow = !g->held[b];
    double cur = g->ms_tok[b][allow], other = g->ms_tok[b][!allow];
    if (g->n_obs[b][0] >= DC_SPEC_GATE_MIN_OBS && g->n_obs[b][1] >= DC_SPEC_GATE_MIN_OBS &&
        other < DC_SPEC_GATE_MARGIN * cur)
        g->held[b] = allow;
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
