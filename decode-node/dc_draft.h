/* dc_draft.h: a draft model as speculative decoding's proposer (dc_spec.h, DC_SPEC_DRAFT):
 * a smaller model of the target's vocabulary, run on the decode leader beside the target,
 * that proposes each request's next tokens by greedy decoding. Or (params.mtp) the target's
 * own multi-token prediction block (model.h kn_shard.mtp: DeepSeek's nextn layer), run the
 * same way as a one-layer draft whose row for position p also reads the target's final hidden
 * state of position p - 1 (dc_spec_proposer.hidden: the scheduler hands each step's rows over;
 * zeros where the target's is not known: position 0, a prompt the prefill stages computed in
 * disaggregated mode, a prefix the cache served) and, for a chain's later proposals, the
 * block's own of the row before (llama.cpp's draft-mtp). A record's KV past the positions
 * computed from the target's states is dropped at keep even where its tokens were right, and
 * a prompt's chunk of more than DC_SPEC_MAX_TOKENS + 1 positions is caught up as its rows
 * arrive, so the rows are not kept and its catch-up does not land in one decode step.
 *
 * Purpose: prompt lookup proposes only where output repeats its context; a draft model
 * proposes everywhere, at the price of its own forward passes. Its proposals are greedy
 * (argmax, a point mass), so the scheduler's sample-and-compare stays exact rejection
 * sampling: output is the target's with the draft or without it, greedy or seeded. Only
 * speed depends on the draft (how often it agrees, what its passes cost).
 * How (dc_draft_proposer's propose, for all requests of a step at once): each request has a
 * sequence in the draft's own KV memory and the tokens whose KV it holds. A call rolls each
 * back to the longest prefix it shares with the request's tokens now, then catches every
 * request up in batched passes of at most chunk_tokens tokens (the prompt too, the first
 * time; a logit row for a request's last token only), takes the argmax as proposal 1, and
 * runs up to k - 1 more passes of one row per request still wanting more, each argmax the
 * next proposal. Rows are not solo (model.h): a proposal's rounding never changes output.
 * A request more than DC_SPEC_MAX_TOKENS + 1 tokens behind (its prompt, the first time, or
 * all of it again after a preemption) gets no proposals in that call, and is caught up by at
 * most chunk_tokens tokens a call (all such requests together), the rest in the next calls:
 * the step's time then holds a prefill, which the scheduler's step cost model would charge to
 * the step's verification rows (a verification row would look as dear as a prompt's
 * prefill, and the adaptive choice would stop proposing for good), and a whole prompt's
 * catch-up in one step would stall every other request's next token; it proposes once it is
 * near. In colocated mode a prompt's prefill chunks reach the proposer as the target computes
 * them (dc_spec_proposer.computed) and are caught up then, so its first decode step has
 * little to do; a prompt the prefill stages computed, or the prefix cache served, is caught
 * up by the calls.
 * A request's record:
 *
 *      (none) --propose: first call--> HOLDS (KV of toks[0, n_held)) --drop--> (none)
 *                                        | ^
 *                      propose, keep ----+-+  (roll back to the common prefix, compute on)
 *
 * In HOLDS the sequence's blocks hold the KV of positions [0, n_held) of the tokens
 * recorded with it (those the target gave it, then the proposals it fed itself), and may
 * reach past them (room a call reserved for proposals it did not make); keep and drop give
 * blocks back, propose takes what it needs.
 * Invariants: the draft's token list equals the target's (tokenizer.ggml.tokens, checked
 * at create: another vocabulary is refused); proposals are token ids below both models'
 * embedding rows (a padded embedding's extra rows are never proposed), and a request
 * holding a token the draft cannot embed gets none. A request the draft's pool cannot hold
 * gets no proposals (its record is emptied); the call never fails for it.
 * Threading: none: the scheduler's thread calls everything, on the backend the target's
 * engine uses, never while a target pass is in flight (the backend's one-caller rule).
 * Ownership: the draft owns its file, model, engine, KV memory and records; the backend is
 * borrowed until dc_draft_destroy. The backend keeps the draft's weight matrices registered
 * until it is destroyed itself (kn_backend.h map_matrix): destroy the draft only when the
 * backend runs nothing more before its own destroy (the node's teardown), or give each draft
 * a backend of its own (the tests).
 */
#ifndef DC_DRAFT_H
#define DC_DRAFT_H

#include <stdbool.h>
#include <stdint.h>

#include "dc_spec.h"
#include "gguf.h"
#include "kn_backend.h"
#include "model.h"
#include "td_dtype.h"

typedef struct dc_draft dc_draft;

typedef struct {
    const char *path;           /* the draft's GGUF: a whole model (no shard); NULL with mtp */
    bool mtp;                   /* the target's own multi-token prediction block instead (see
                                   the top): its file is target_gguf */
    kn_backend be;              /* the target's backend, which computes the draft too */
    const kn_model *target;     /* the target: its vocabulary rows */
    const td_gguf *target_gguf; /* the target's file: its token list */
    int64_t kv_tokens;          /* the draft's KV capacity, tokens (whole blocks of it) */
    int block_size;             /* tokens per KV block, a power of two; 0: 16 */
    td_dtype kv_type;           /* TD_F32 (0) or TD_F16 */
    int chunk_tokens;           /* most tokens of one catch-up pass, and of a prompt's catch-up
                                   in one call (the rest in the next calls); 0: 512 */
    const char *who;            /* log prefix ("decode d0"); NULL: "draft" */
} dc_draft_params;

/* What the draft is, for the start-up log. */
typedef struct {
    kn_arch arch;
    int n_layer, n_embd, n_vocab;
    uint64_t weight_bytes; /* bytes of its tensors in the file */
    uint64_t kv_bytes;     /* bytes of its KV pool */
    int kv_blocks;         /* blocks of block_size tokens in it */
    double warm_ms;        /* create's first passes (their one-time costs paid there) */
} dc_draft_info;

/* Its work so far (the stop log). */
typedef struct {
    uint64_t calls;     /* propose calls and computed's catch-ups */
    uint64_t passes;    /* forward passes */
    uint64_t rows;      /* tokens computed (catch-up and proposals) */
    uint64_t proposals; /* tokens proposed */
    uint64_t refused;   /* requests given nothing: no room in the pool, a token it cannot read */
    int64_t ns;         /* time in propose and in computed's catch-ups */
} dc_draft_stats;

/* Opens p->path, checks its vocabulary against the target's, loads it whole, makes its
 * engine (on p->be) and KV memory, and runs a first catch-up and proposal pass (their
 * one-time costs: pages read in, the backend's copies of the weights). TD_EINVAL: another
 * vocabulary, a bad parameter; the reader's, the loader's and the pool's errors; each logged with
 * p->who. */
int dc_draft_create(const dc_draft_params *p, dc_draft **out);
void dc_draft_destroy(dc_draft *d); /* NULL is fine; see Ownership */

/* The proposer the scheduler calls (dc_spec_params.proposer), valid until destroy. */
dc_spec_proposer dc_draft_proposer(dc_draft *d);

dc_draft_info dc_draft_get_info(const dc_draft *d);
dc_draft_stats dc_draft_get_stats(const dc_draft *d);
/* Blocks its records hold now (0 once every request was dropped). */
int dc_draft_blocks_used(const dc_draft *d);

#endif
