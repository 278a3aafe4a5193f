/* bench_mask.c: the per-token cost of structured output in the decode loop, replayed over
 * recorded documents (tools/bench_grammar.py --record writes them).
 *
 * usage: bench_grammar_mask MODEL.gguf DOCS.jsonl [rounds]
 *   DOCS.jsonl: one JSON object per line, {"kind": "json_object" | "json_schema",
 *   "schema": <schema or null>, "text": <the generated document>}.
 *
 * Each document is tokenized with the model's tokenizer (the ids the model generated are not
 * kept by the API, so this is a re-tokenization of the same text) and replayed as the decode
 * node does it per token (decode-node/dc_sched.c dc_sched_commit): gr_matcher_mask, then
 * gr_matcher_accept_token, then the EOG at the end. Two passes per round:
 *   cold: a freshly compiled grammar (empty mask cache): every new matcher configuration
 *         walks the vocabulary trie, as the first request with a schema pays;
 *   warm: the same grammar again (the decode node keeps grammars in a gr_cache per schema).
 * A third pass (warm) also times, at every step, kn_sample at temperature 1.0 on random logits
 * (N(0, 2), fixed seed, n_vocab wide) with that step's mask and without a mask, so the
 * sampler's part of the grammar's cost (masked tokens are dropped before the softmax) is in
 * the figure. Prints per-token medians over rounds (us); the grammar's cost of a batch-16
 * step is 16 x (mask + accept + masked sample - unmasked sample). */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "gr_grammar.h"
#include "sampler.h"
#include "td_clock.h"
#include "td_err.h"
#include "tokenizer.h"

typedef struct {
    gr_grammar *g; /* NULL: compiled per cold pass from kind/schema */
    int32_t kind;
    char *schema; /* JSON text, or NULL */
    int32_t *ids;
    size_t n;
} doc;

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static int load_docs(const char *path, const td_tokenizer *t, doc **out, int *n_out)
{
    FILE *f = fopen(path, "r");
    if (!f) return fprintf(stderr, "cannot open %s\n", path), -1;
    char *line = NULL;
    size_t cap = 0;
    int n = 0;
    doc *d = NULL;
    while (getline(&line, &cap, f) > 0) {
        json_error_t je;
        json_t *o = json_loads(line, 0, &je);
        const char *kind = o ? json_string_value(json_object_get(o, "kind")) : NULL;
        const char *text = o ? json_string_value(json_object_get(o, "text")) : NULL;
        if (!kind || !text) return fprintf(stderr, "%s: bad line %d\n", path, n + 1), -1;
        d = realloc(d, (size_t)(n + 1) * sizeof *d);
        doc *x = &d[n++];
        memset(x, 0, sizeof *x);
        json_t *s = json_object_get(o, "schema");
        x->kind =
            strcmp(kind, "json_object") ? TD_GRAMMAR_JSON_SCHEMA_STRICT : TD_GRAMMAR_JSON_OBJECT;
        x->schema = s && !json_is_null(s) ? json_dumps(s, JSON_COMPACT) : NULL;
        if (td_tok_encode(t, text, strlen(text), false, false, &x->ids, &x->n)) return -1;
        json_decref(o);
    }
    free(line);
    fclose(f);
    *out = d;
    *n_out = n;
    return n ? 0 : -1;
}

typedef struct {
    kn_sampler *s;       /* NULL: do not time the sampler */
    const float *logits; /* (n_vocab) */
    int64_t masked_ns, plain_ns;
} sample_timer;

/* kn_sample with mask, then without: their times into t. */
static int time_sample(sample_timer *t, const uint32_t *mask)
{
    int32_t hist[1] = {0};
    int64_t t0 = td_now_ns();
    kn_sampler_set_mask(t->s, mask);
    int rc = kn_sample(t->s, t->logits, hist, 1, 0);
    int64_t t1 = td_now_ns();
    rc = rc < 0 ? rc : kn_sample(t->s, t->logits, hist, 1, 0);
    t->masked_ns += t1 - t0;
    t->plain_ns += td_now_ns() - t1;
    return rc < 0 ? rc : 0;
}

/* One pass over every document: ns spent in mask+accept (the sampler's time, with st, is
 * left out of it), tokens replayed. */
static int replay(doc *d, int n_docs, gr_vocab *v, int32_t eog, sample_timer *st, int64_t *ns,
                  int64_t *tokens)
{
    *ns = 0;
    *tokens = 0;
    for (int i = 0; i < n_docs; i++) {
        gr_matcher *m;
        if (gr_matcher_create(d[i].g, v, &m)) return -1;
        int64_t t0 = td_now_ns();
        for (size_t j = 0; j <= d[i].n; j++) {
            const uint32_t *mask;
            int32_t id = j < d[i].n ? d[i].ids[j] : eog;
            if (gr_matcher_mask(m, &mask) || !(mask[id >> 5] >> (id & 31) & 1u) ||
                gr_matcher_accept_token(m, id)) {
                fprintf(stderr, "doc %d token %zu (id %d) not allowed\n", i, j, id);
                gr_matcher_destroy(m);
                return -1;
            }
            if (st && st->s) {
                int64_t t1 = td_now_ns();
                if (time_sample(st, mask)) return -1;
                t0 += td_now_ns() - t1; /* not the grammar's time */
            }
        }
        *ns += td_now_ns() - t0;
        *tokens += (int64_t)d[i].n + 1;
        gr_matcher_destroy(m);
    }
    return 0;
}

static int compile_all(doc *d, int n)
{
    for (int i = 0; i < n; i++) {
        gr_grammar_unref(d[i].g);
        char err[256];
        if (gr_compile_text(d[i].kind, d[i].schema, &d[i].g, err, sizeof err))
            return fprintf(stderr, "compile: %s\n", err), -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3) return fprintf(stderr, "usage: %s MODEL.gguf DOCS.jsonl [rounds]\n", argv[0]), 2;
    int rounds = argc > 3 ? atoi(argv[3]) : 7;
    if (rounds < 1 || rounds > 1000) return fprintf(stderr, "rounds: 1..1000\n"), 2;
    char err[256];
    td_gguf *g;
    td_tokenizer *t;
    gr_vocab *v;
    if (td_gguf_open(argv[1], &g, err, sizeof err)) return fprintf(stderr, "%s\n", err), 1;
    if (td_tok_create(g, &t) || gr_vocab_from_tok(t, &v)) return 1;
    doc *d;
    int n_docs;
    if (load_docs(argv[2], t, &d, &n_docs)) return 1;
    int32_t nv = td_tok_n_vocab(t), eog = td_tok_eos(t);
    double cold[1000], warm[1000], smask[1000], splain[1000];
    int64_t ns, tokens = 0;
    float *logits = malloc((size_t)nv * sizeof *logits);
    uint64_t x = 88172645463325252ull;
    for (int32_t i = 0; i < nv; i++) { /* Box-Muller over xorshift, N(0, 2) */
        double u1, u2;
        x ^= x << 13, x ^= x >> 7, x ^= x << 17, u1 = ((x >> 11) + 1.0) / 9007199254740993.0;
        x ^= x << 13, x ^= x >> 7, x ^= x << 17, u2 = (x >> 11) / 9007199254740992.0;
        logits[i] = (float)(2.0 * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
    }
    td_sampling sp1 = {.temperature = 1.0f, .seed = 7};
    kn_sampler smp;
    if (kn_sampler_init(&smp, &sp1, nv)) return 1;
    for (int r = 0; r < rounds; r++) {
        sample_timer st = {&smp, logits, 0, 0};
        if (compile_all(d, n_docs) || replay(d, n_docs, v, eog, NULL, &ns, &tokens)) return 1;
        cold[r] = (double)ns / (double)tokens / 1e3;
        if (replay(d, n_docs, v, eog, NULL, &ns, &tokens)) return 1;
        warm[r] = (double)ns / (double)tokens / 1e3;
        if (replay(d, n_docs, v, eog, &st, &ns, &tokens)) return 1;
        smask[r] = (double)st.masked_ns / (double)tokens / 1e3;
        splain[r] = (double)st.plain_ns / (double)tokens / 1e3;
    }
    kn_sampler_fini(&smp);
    double c = median(cold, rounds), w = median(warm, rounds);
    double sp = median(splain, rounds), sm = median(smask, rounds);
    printf("docs %d, tokens per pass %lld, n_vocab %d, rounds %d (medians, us per token)\n", n_docs,
           (long long)tokens, nv, rounds);
    printf("mask+accept cold (fresh grammar) %.2f  warm (cached masks) %.2f\n", c, w);
    printf("kn_sample t=1.0 unmasked %.2f  masked %.2f  (mask extra %.2f)\n", sp, sm, sm - sp);
    printf("grammar cost of a batch-16 step: cold %.0f us, warm %.0f us\n", 16 * (c + sm - sp),
           16 * (w + sm - sp));
    return 0;
}
