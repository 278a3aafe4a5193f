/* gr_int.h: the grammar module's private types: the automaton, configurations, the trie.
 *
 * The automaton is a recursive transition network over bytes: states with byte-range edges,
 * epsilon edges (a "call" epsilon pushes a return state and jumps to a rule's entry) and
 * rule ends (pop, or accept at the root). A configuration is a state plus its stack; a
 * matcher holds the set of configurations (the automaton may be nondeterministic: anyOf,
 * optional properties) closed under epsilon moves, keeping only states with byte edges,
 * plus whether the root rule has ended (accept).
 */
#ifndef GR_INT_H
#define GR_INT_H

#include "gr_grammar.h"

#define GR_MAX_CONFIGS 32 /* configurations of one set; more are dropped (never invalid) */

typedef struct {
    uint8_t lo, hi; /* byte range, inclusive */
    int32_t to;
} gr_edge;

typedef struct {
    int32_t to;
    int32_t ret; /* >= 0: a call: push ret, continue at to (a rule entry); -1: plain */
} gr_eps;

typedef struct {
    int32_t e0, ne; /* byte edges g->edges[e0, e0 + ne) */
    int32_t x0, nx; /* epsilon edges g->eps[x0, x0 + nx) */
    bool ret;       /* a rule ends here */
} gr_state;

typedef struct gr_mask_entry gr_mask_entry;

struct gr_grammar {
    int refs;
    gr_state *st; /* (n_st) */
    int32_t n_st;
    gr_edge *edges; /* grouped by state */
    gr_eps *eps;
    int32_t start;
    /* mask cache: sets of configurations -> token bitsets, for one vocabulary */
    const gr_vocab *cache_vocab;
    gr_mask_entry **buckets; /* (n_buckets) chains */
    int n_buckets, n_entries;
};

typedef struct {
    int32_t state, depth;
    int32_t stack[GR_MAX_STACK]; /* return states, [0, depth) */
} gr_cfg;

typedef struct {
    int n;
    bool accept;   /* the root rule ended: the document is complete */
    bool consumed; /* step: at least one configuration took the byte */
    gr_cfg c[GR_MAX_CONFIGS];
} gr_set;

/* gr_match.c */
void gr_set_start(const gr_grammar *g, gr_set *out);
/* out = the closure of every configuration of in after byte b; out->consumed says whether
 * any took it (out may then still be empty with accept set). */
void gr_set_step(const gr_grammar *g, const gr_set *in, uint8_t b, gr_set *out);
uint64_t gr_set_hash(const gr_set *s);
bool gr_set_equal(const gr_set *a, const gr_set *b);

/* gr_vocab.c: the trie */
typedef struct {
    int32_t child0, nchild; /* children in v->nodes[child0, child0 + nchild), bytes ascending */
    int32_t tok0, ntok;     /* tokens whose bytes end here: v->node_toks[tok0, tok0 + ntok) */
    uint8_t byte;           /* the byte leading here from the parent */
} gr_node;

struct gr_vocab {
    int32_t n_vocab, words; /* words: 32-bit words of a mask */
    uint32_t *eog_mask;     /* (words) */
    uint8_t *bytes;         /* every allowed token's bytes, concatenated */
    int64_t *off;           /* (n_vocab + 1) into bytes */
    uint8_t *kind;          /* (n_vocab) 0: never, 1: text token, 2: EOG */
    gr_node *nodes;         /* [0] is the root */
    int32_t n_nodes;
    int32_t *node_toks;
    int max_len;     /* longest token in bytes */
    gr_set *scratch; /* (max_len + 1) sets for the trie walk */
};

/* Compute the mask of set s into mask (words), via the trie. */
void gr_vocab_walk(gr_vocab *v, const gr_grammar *g, const gr_set *s, uint32_t *mask);

#endif
