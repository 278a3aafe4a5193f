/* gr_vocab.c: the vocabulary's byte trie, the mask walk over it, and the grammar cache. */
#include <stdlib.h>
#include <string.h>

#include "gr_int.h"
#include "td_err.h"

typedef struct {
    gr_vocab *v;
    int32_t *ids; /* text tokens sorted by bytes */
    int32_t cap_nodes;
} build;

static int cmp_bytes(const gr_vocab *v, int32_t a, int32_t b)
{
    int64_t la = v->off[a + 1] - v->off[a], lb = v->off[b + 1] - v->off[b];
    int c = memcmp(v->bytes + v->off[a], v->bytes + v->off[b], (size_t)(la < lb ? la : lb));
    if (c) return c;
    return la < lb ? -1 : la > lb;
}

static const gr_vocab *sort_vocab; /* qsort has no context argument; build is not reentrant */
static int by_bytes(const void *a, const void *b)
{
    return cmp_bytes(sort_vocab, *(const int32_t *)a, *(const int32_t *)b);
}

static int32_t len_of(const gr_vocab *v, int32_t id)
{
    return (int32_t)(v->off[id + 1] - v->off[id]);
}

/* Fill node (its children first, as one block, then each child's subtree) from the sorted
 * tokens [lo, hi), which all share their first `depth` bytes. */
static int fill(build *bd, int32_t node, int32_t lo, int32_t hi, int depth)
{
    gr_vocab *v = bd->v;
    int32_t i = lo;
    v->nodes[node].tok0 = lo;
    while (i < hi && len_of(v, bd->ids[i]) == depth)
        i++;
    v->nodes[node].ntok = i - lo;
    int32_t n = 0;
    for (int32_t j = i; j < hi; n++) {
        uint8_t b = v->bytes[v->off[bd->ids[j]] + depth];
        while (j < hi && v->bytes[v->off[bd->ids[j]] + depth] == b)
            j++;
    }
    v->nodes[node].child0 = v->n_nodes;
    v->nodes[node].nchild = n;
    if (v->n_nodes + n > bd->cap_nodes) return TD_ENOMEM; /* cannot happen: cap is the total */
    int32_t first = v->n_nodes;
    v->n_nodes += n;
    for (int32_t j = i, k = 0; j < hi; k++) {
        uint8_t b = v->bytes[v->off[bd->ids[j]] + depth];
        int32_t s = j;
        while (j < hi && v->bytes[v->off[bd->ids[j]] + depth] == b)
            j++;
        v->nodes[first + k].byte = b;
        int rc = fill(bd, first + k, s, j, depth + 1);
        if (rc) return rc;
    }
    return 0;
}

static int copy_pieces(gr_vocab *v, const char *(*piece)(void *, int32_t, size_t *), void *ctx)
{
    int64_t total = 0;
    for (int32_t i = 0; i < v->n_vocab; i++) {
        size_t n = 0;
        const char *p = piece(ctx, i, &n);
        if (p && n > 0 && n <= GR_MAX_TOKEN_LEN && v->kind[i] != 2) {
            v->kind[i] = 1;
            total += (int64_t)n;
        }
    }
    v->bytes = malloc((size_t)(total ? total : 1));
    if (!v->bytes) return TD_ENOMEM;
    int64_t at = 0;
    for (int32_t i = 0; i < v->n_vocab; i++) {
        v->off[i] = at;
        if (v->kind[i] != 1) continue;
        size_t n = 0;
        const char *p = piece(ctx, i, &n);
        memcpy(v->bytes + at, p, n);
        at += (int64_t)n;
        if ((int)n > v->max_len) v->max_len = (int)n;
    }
    v->off[v->n_vocab] = at;
    return 0;
}

int gr_vocab_create(int32_t n_vocab, const char *(*piece)(void *ctx, int32_t id, size_t *len),
                    void *ctx, const int32_t *eog, int n_eog, gr_vocab **out)
{
    *out = NULL;
    if (n_vocab < 1 || !piece || n_eog < 0 || (n_eog && !eog)) return TD_EINVAL;
    gr_vocab *v = calloc(1, sizeof *v);
    if (!v) return TD_ENOMEM;
    v->n_vocab = n_vocab;
    v->words = (n_vocab + 31) / 32;
    v->kind = calloc((size_t)n_vocab, 1);
    v->off = calloc((size_t)n_vocab + 1, sizeof *v->off);
    v->eog_mask = calloc((size_t)v->words, sizeof *v->eog_mask);
    build bd = {.v = v};
    int rc = (!v->kind || !v->off || !v->eog_mask) ? TD_ENOMEM : 0;
    for (int i = 0; !rc && i < n_eog; i++) {
        if (eog[i] < 0 || eog[i] >= n_vocab) {
            rc = TD_EINVAL;
            break;
        }
        v->kind[eog[i]] = 2;
        v->eog_mask[eog[i] >> 5] |= 1u << (eog[i] & 31);
    }
    if (!rc) rc = copy_pieces(v, piece, ctx);
    int32_t n_text = 0;
    if (!rc) {
        bd.ids = malloc((size_t)n_vocab * sizeof *bd.ids);
        for (int32_t i = 0; bd.ids && i < n_vocab; i++)
            if (v->kind[i] == 1) bd.ids[n_text++] = i;
        /* nodes: at most one per byte of every token, plus the root */
        bd.cap_nodes = (int32_t)v->off[n_vocab] + 1;
        v->nodes = calloc((size_t)bd.cap_nodes, sizeof *v->nodes);
        v->scratch = malloc((size_t)(v->max_len + 2) * sizeof *v->scratch);
        if (!bd.ids || !v->nodes || !v->scratch) rc = TD_ENOMEM;
    }
    if (!rc) {
        sort_vocab = v;
        qsort(bd.ids, (size_t)n_text, sizeof *bd.ids, by_bytes);
        v->n_nodes = 1;
        rc = fill(&bd, 0, 0, n_text, 0);
        v->node_toks = bd.ids;
        bd.ids = NULL;
    }
    free(bd.ids);
    if (rc) {
        gr_vocab_destroy(v);
        return rc;
    }
    *out = v;
    return 0;
}

void gr_vocab_destroy(gr_vocab *v)
{
    if (!v) return;
    free(v->eog_mask);
    free(v->bytes);
    free(v->off);
    free(v->kind);
    free(v->nodes);
    free(v->node_toks);
    free(v->scratch);
    free(v);
}

int32_t gr_vocab_n_vocab(const gr_vocab *v)
{
    return v->n_vocab;
}

/* Depth-first over the trie below node: a child whose byte some configuration of sets[d]
 * takes is alive; its tokens are allowed, and its subtree is walked while configurations
 * remain. Dead branches are never entered. */
static void walk(gr_vocab *v, const gr_grammar *g, int32_t node, int d, uint32_t *mask)
{
    const gr_node *nd = &v->nodes[node];
    const gr_set *in = &v->scratch[d];
    gr_set *out = &v->scratch[d + 1];
    for (int32_t k = 0; k < nd->nchild; k++) {
        const gr_node *ch = &v->nodes[nd->child0 + k];
        gr_set_step(g, in, ch->byte, out);
        if (!out->consumed) continue;
        for (int32_t t = 0; t < ch->ntok; t++) {
            int32_t id = v->node_toks[ch->tok0 + t];
            mask[id >> 5] |= 1u << (id & 31);
        }
        if (ch->nchild && out->n) walk(v, g, nd->child0 + k, d + 1, mask);
    }
}

void gr_vocab_walk(gr_vocab *v, const gr_grammar *g, const gr_set *s, uint32_t *mask)
{
    memset(mask, 0, (size_t)v->words * sizeof *mask);
    if (s->accept)
        for (int32_t i = 0; i < v->words; i++)
            mask[i] |= v->eog_mask[i];
    if (!s->n) return;
    v->scratch[0] = *s;
    walk(v, g, 0, 0, mask);
}

/* ---- gr_cache ---- */

typedef struct {
    uint64_t hash;
    int32_t kind;
    char *text;
    gr_grammar *g;
    uint64_t used; /* tick of the last get */
} cache_ent;

struct gr_cache {
    cache_ent *e;
    int n, cap;
    uint64_t tick;
};

int gr_cache_create(int max_entries, gr_cache **out)
{
    *out = NULL;
    gr_cache *c = calloc(1, sizeof *c);
    if (!c) return TD_ENOMEM;
    c->cap = max_entries > 0 ? max_entries : 64;
    c->e = calloc((size_t)c->cap, sizeof *c->e);
    if (!c->e) {
        free(c);
        return TD_ENOMEM;
    }
    *out = c;
    return 0;
}

void gr_cache_destroy(gr_cache *c)
{
    if (!c) return;
    for (int i = 0; i < c->n; i++) {
        free(c->e[i].text);
        gr_grammar_unref(c->e[i].g);
    }
    free(c->e);
    free(c);
}

int gr_cache_get(gr_cache *c, int32_t kind, const char *text, gr_grammar **out, char *err,
                 size_t err_cap)
{
    *out = NULL;
    if (kind == TD_GRAMMAR_JSON_OBJECT) text = "";
    if (!text) text = "";
    uint64_t h = 1469598103934665603ull ^ (uint64_t)(uint32_t)kind;
    for (const char *p = text; *p; p++)
        h = (h ^ (uint8_t)*p) * 1099511628211ull;
    c->tick++;
    for (int i = 0; i < c->n; i++)
        if (c->e[i].hash == h && c->e[i].kind == kind && !strcmp(c->e[i].text, text)) {
            c->e[i].used = c->tick;
            *out = gr_grammar_ref(c->e[i].g);
            return 0;
        }
    gr_grammar *g;
    int rc = gr_compile_text(kind, text, &g, err, err_cap);
    if (rc) return rc;
    char *copy = strdup(text);
    if (!copy) {
        gr_grammar_unref(g);
        return TD_ENOMEM;
    }
    int slot = c->n;
    if (c->n == c->cap) { /* drop the least recently used */
        slot = 0;
        for (int i = 1; i < c->n; i++)
            if (c->e[i].used < c->e[slot].used) slot = i;
        free(c->e[slot].text);
        gr_grammar_unref(c->e[slot].g);
    } else {
        c->n++;
    }
    c->e[slot] = (cache_ent){.hash = h, .kind = kind, .text = copy, .g = g, .used = c->tick};
    *out = gr_grammar_ref(g);
    return 0;
}
