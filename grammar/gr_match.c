/* gr_match.c: configuration sets (closure, byte steps) and the per-sequence matcher. */
#include <stdlib.h>
#include <string.h>

#include "gr_int.h"
#include "td_err.h"

#define MAX_VISIT 256 /* configurations one closure may visit */

typedef struct {
    int n;
    gr_cfg v[MAX_VISIT];
} visit;

static bool cfg_eq(const gr_cfg *a, const gr_cfg *b)
{
    return a->state == b->state && a->depth == b->depth &&
           !memcmp(a->stack, b->stack, (size_t)a->depth * sizeof a->stack[0]);
}

/* Add c and everything reachable from it without consuming a byte; keep the
 * configurations whose state has byte edges; a rule end at depth 0 accepts. */
static void close_cfg(const gr_grammar *g, gr_set *out, const gr_cfg *c, visit *vis)
{
    for (int i = 0; i < vis->n; i++)
        if (cfg_eq(&vis->v[i], c)) return;
    if (vis->n == MAX_VISIT) return;
    vis->v[vis->n++] = *c;
    const gr_state *st = &g->st[c->state];
    if (st->ne && out->n < GR_MAX_CONFIGS) out->c[out->n++] = *c;
    gr_cfg d;
    if (st->ret) {
        if (c->depth == 0) {
            out->accept = true;
        } else {
            d = *c;
            d.state = d.stack[--d.depth];
            close_cfg(g, out, &d, vis);
        }
    }
    for (int32_t k = 0; k < st->nx; k++) {
        const gr_eps *x = &g->eps[st->x0 + k];
        d = *c;
        if (x->ret >= 0) {
            if (d.depth == GR_MAX_STACK) continue; /* too deep: this way is closed */
            d.stack[d.depth++] = x->ret;
        }
        d.state = x->to;
        close_cfg(g, out, &d, vis);
    }
}

void gr_set_start(const gr_grammar *g, gr_set *out)
{
    visit *vis = malloc(sizeof *vis);
    out->n = 0;
    out->accept = out->consumed = false;
    if (!vis) return;
    vis->n = 0;
    gr_cfg c = {.state = g->start};
    close_cfg(g, out, &c, vis);
    free(vis);
}

void gr_set_step(const gr_grammar *g, const gr_set *in, uint8_t b, gr_set *out)
{
    out->n = 0;
    out->accept = out->consumed = false;
    visit vis;
    vis.n = 0;
    for (int i = 0; i < in->n; i++) {
        const gr_cfg *c = &in->c[i];
        const gr_state *st = &g->st[c->state];
        const gr_edge *e = &g->edges[st->e0];
        for (int32_t k = 0; k < st->ne; k++)
            if (b >= e[k].lo && b <= e[k].hi) {
                gr_cfg d = *c;
                d.state = e[k].to;
                out->consumed = true;
                close_cfg(g, out, &d, &vis);
            }
    }
}

uint64_t gr_set_hash(const gr_set *s)
{
    uint64_t h = 1469598103934665603ull ^ (uint64_t)s->accept;
    for (int i = 0; i < s->n; i++) {
        const gr_cfg *c = &s->c[i];
        h = (h ^ (uint64_t)(uint32_t)c->state) * 1099511628211ull;
        for (int32_t k = 0; k < c->depth; k++)
            h = (h ^ (uint64_t)(uint32_t)c->stack[k]) * 1099511628211ull;
        h = (h ^ 0xffu) * 1099511628211ull;
    }
    return h;
}

bool gr_set_equal(const gr_set *a, const gr_set *b)
{
    if (a->n != b->n || a->accept != b->accept) return false;
    for (int i = 0; i < a->n; i++)
        if (!cfg_eq(&a->c[i], &b->c[i])) return false;
    return true;
}

/* ---- matcher ---- */

struct gr_matcher {
    gr_grammar *g;
    gr_vocab *v;
    gr_set cur;
    gr_set tmp;
    bool ended; /* an EOG token was accepted */
};

int gr_matcher_create(gr_grammar *g, gr_vocab *v, gr_matcher **out)
{
    *out = NULL;
    if (!g || !v) return TD_EINVAL;
    gr_matcher *m = calloc(1, sizeof *m);
    if (!m) return TD_ENOMEM;
    m->g = gr_grammar_ref(g);
    m->v = v;
    gr_set_start(g, &m->cur);
    *out = m;
    return 0;
}

void gr_matcher_destroy(gr_matcher *m)
{
    if (!m) return;
    gr_grammar_unref(m->g);
    free(m);
}

int gr_matcher_accept_bytes(gr_matcher *m, const char *bytes, size_t len)
{
    if (m->ended) return len ? TD_EINVAL : 0;
    gr_set *a = &m->cur, *b = &m->tmp;
    gr_set save = m->cur;
    for (size_t i = 0; i < len; i++) {
        gr_set_step(m->g, a, (uint8_t)bytes[i], b);
        if (!b->consumed) {
            m->cur = save;
            return TD_EINVAL;
        }
        gr_set *t = a;
        a = b;
        b = t;
    }
    if (a != &m->cur) m->cur = *a;
    return 0;
}

int gr_matcher_accept_token(gr_matcher *m, int32_t id)
{
    const gr_vocab *v = m->v;
    if (id < 0 || id >= v->n_vocab) return TD_ERANGE;
    if (v->kind[id] == 2) {
        if (!m->cur.accept || m->ended) return TD_EINVAL;
        m->ended = true;
        return 0;
    }
    if (v->kind[id] != 1) return TD_EINVAL;
    int64_t n = v->off[id + 1] - v->off[id];
    if (n == 0) return TD_EINVAL;
    return gr_matcher_accept_bytes(m, (const char *)v->bytes + v->off[id], (size_t)n);
}

int gr_matcher_accept_tokens(gr_matcher *m, const int32_t *ids, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        int rc = gr_matcher_accept_token(m, ids[i]);
        if (rc) return rc;
    }
    return 0;
}

bool gr_matcher_can_end(const gr_matcher *m)
{
    return m->cur.accept && !m->ended;
}

bool gr_matcher_done(const gr_matcher *m)
{
    return m->ended || (m->cur.accept && m->cur.n == 0);
}

/* ---- the mask cache (per grammar; see gr_grammar.h's threading note) ---- */

struct gr_mask_entry {
    gr_mask_entry *next;
    uint64_t hash;
    gr_set key;
    uint32_t mask[]; /* (words) */
};

#define CACHE_BUCKETS 256
#define CACHE_MAX     512 /* entries per grammar; all dropped when full */

static void cache_clear(gr_grammar *g)
{
    for (int i = 0; g->buckets && i < g->n_buckets; i++)
        while (g->buckets[i]) {
            gr_mask_entry *e = g->buckets[i];
            g->buckets[i] = e->next;
            free(e);
        }
    g->n_entries = 0;
}

void gr_grammar_unref(gr_grammar *g)
{
    if (!g || --g->refs > 0) return;
    cache_clear(g);
    free(g->buckets);
    free(g->st);
    free(g->edges);
    free(g->eps);
    free(g);
}

int gr_matcher_mask(gr_matcher *m, const uint32_t **mask)
{
    gr_grammar *g = m->g;
    gr_vocab *v = m->v;
    *mask = NULL;
    if (g->cache_vocab != v) {
        cache_clear(g);
        g->cache_vocab = v;
    }
    if (!g->buckets) {
        g->buckets = calloc(CACHE_BUCKETS, sizeof *g->buckets);
        if (!g->buckets) return TD_ENOMEM;
        g->n_buckets = CACHE_BUCKETS;
    }
    gr_set key = m->cur;
    key.consumed = false;
    if (m->ended) key.accept = false, key.n = 0;
    uint64_t h = gr_set_hash(&key);
    gr_mask_entry **b = &g->buckets[h % (uint64_t)g->n_buckets], *e;
    for (e = *b; e; e = e->next)
        if (e->hash == h && gr_set_equal(&e->key, &key)) break;
    if (!e) {
        if (g->n_entries >= CACHE_MAX) cache_clear(g);
        e = malloc(sizeof *e + (size_t)v->words * sizeof(uint32_t));
        if (!e) return TD_ENOMEM;
        e->hash = h;
        e->key = key;
        gr_vocab_walk(v, g, &key, e->mask);
        e->next = *b;
        *b = e;
        g->n_entries++;
    }
    *mask = e->mask;
    for (int32_t i = 0; i < v->words; i++)
        if (e->mask[i]) return 0;
    return TD_ESTATE;
}
