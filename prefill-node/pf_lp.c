/* pf_lp.c: the last prefill stage's logprobs: the first token's (in its report) and the
 * prompt tokens' (LOGPROBS messages to stage 0), see pf_int.h and pf_wire.h. */
#include <stdlib.h>
#include <string.h>

#include "pf_int.h"
#include "td_err.h"

/* A queued LOGPROBS message (stage 0 as the last stage). */
struct pf_lp_blob {
    struct pf_lp_blob *next;
    size_t len;
    uint8_t data[];
};

int pf_lp_first(pf_stage *st, pf_req *r, const float *row, int32_t token)
{
    int rc = kn_logprobs(row, st->n_vocab, token, (int)r->sampling.logprobs - 1, &r->first_lp);
    r->has_first_lp = !rc;
    return rc;
}

/* Stage 0 queues its own messages for the leader's loop; the others send them to stage 0
 * (after the chunk messages before it, before the request's report: one peer, in order). */
static int lp_out(pf_stage *st, const uint8_t *msg, size_t len)
{
    if (st->stage != 0) {
        pf_chain_report_msg(&st->chain, msg, len);
        return 0;
    }
    struct pf_lp_blob *b = malloc(sizeof *b + len);
    if (!b) return TD_ENOMEM;
    b->next = NULL;
    b->len = len;
    memcpy(b->data, msg, len);
    if (st->lp_tail)
        st->lp_tail->next = b;
    else
        st->lp_head = b;
    st->lp_tail = b;
    return 0;
}

bool pf_stage_take_lp(pf_stage *st, uint8_t *buf, size_t *len)
{
    struct pf_lp_blob *b = st->lp_head;
    if (!b) return false;
    st->lp_head = b->next;
    if (!st->lp_head) st->lp_tail = NULL;
    memcpy(buf, b->data, b->len);
    *len = b->len;
    free(b);
    return true;
}

void pf_lp_drop_all(pf_stage *st)
{
    while (st->lp_head) {
        struct pf_lp_blob *b = st->lp_head;
        st->lp_head = b->next;
        free(b);
    }
    st->lp_tail = NULL;
}

/* Entries e (n) of positions from .. from + n - 1 out, in messages of at most
 * PF_LP_MAX_BYTES. */
static int lp_ship(pf_stage *st, pf_req *r, int32_t from, const td_logprob_entry *e, int n, int k)
{
    uint8_t msg[PF_LP_MAX_BYTES];
    int per = pf_wire_lp_max_entries(k);
    for (int i = 0; i < n; i += per) {
        int m = n - i < per ? n - i : per;
        int64_t len =
            pf_wire_lp_write(msg, sizeof msg, st->epoch, r->id, (uint32_t)(from + i), e + i, m, k);
        if (len < 0) return (int)len;
        int rc = lp_out(st, msg, (size_t)len);
        if (rc) return rc;
    }
    return 0;
}

int pf_lp_prompt(pf_stage *st, pf_req *r, const pf_seg *g, const float *rows)
{
    size_t V = (size_t)st->n_vocab;
    int k = (int)r->sampling.logprobs - 1;
    int32_t t0 = (int32_t)g->t0, t1 = (int32_t)g->t1;
    int32_t from = t0 > 0 ? t0 : 1, n = t1 - from;
    if (t0 > 0 && !r->plp_row_set) return TD_ESTATE; /* the previous chunk's row is missing */
    td_logprob_entry *e = n > 0 ? malloc((size_t)n * sizeof *e) : NULL;
    if (n > 0 && !e) return TD_ENOMEM;
    int rc = 0;
    for (int32_t p = from; p < t1 && !rc; p++) {
        /* position p is scored by row p - 1: the saved one for p == t0 */
        const float *row = p == t0 ? r->plp_row : rows + (size_t)(p - 1 - t0) * V;
        rc = kn_logprobs(row, st->n_vocab, r->hist[p], k, &e[p - from]);
    }
    if (!rc && n > 0) rc = lp_ship(st, r, from, e, n, k);
    free(e);
    if (rc || t1 == r->n_prompt) return rc;
    /* the last row scores the next chunk's first token */
    if (!r->plp_row && !(r->plp_row = malloc(V * sizeof *r->plp_row))) return TD_ENOMEM;
    memcpy(r->plp_row, rows + (size_t)(t1 - 1 - t0) * V, V * sizeof *r->plp_row);
    r->plp_row_set = true;
    return 0;
}
