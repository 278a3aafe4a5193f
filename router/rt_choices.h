/* rt_choices.h: requests with several choices, n > 1 or batched prompts (prefix rt_choices_).
 *
 * Purpose: a request that asks for n choices of each of its prompts fans out into child
 * requests, one per prompt x choice, that go through the loop exactly as a single request
 * does (router queue and fairness, dispatch, pairing, migration, deadlines: nothing there
 * knows about choices); their outputs join in the parent's response (rt_stream.c writes a
 * child's chunks into its parent's http with the child's index). The parent holds the HTTP
 * connection and never goes to an instance: it is in no table and no queue. Each child
 * prefills its prompt itself (the decode pool has no shared blocks yet; docs/api.md).
 *
 * A parent's states (loop thread):
 *
 *   INBOX --rt_choices_admit--> OPEN: n_live children queued (all of them, or none: 429 when
 *         the queue cannot take them all now, and the caller refuses the parent)
 *   OPEN --a child retires finished (rt_choices_retired)--> OPEN, n_live - 1
 *   OPEN --the last child retires finished--> DONE (rt_stream_close: usage and [DONE], or the
 *         JSON body with every choice in index order; with best_of, each prompt's candidates
 *         ranked first and only its n best answered)
 *   OPEN --a child retires unfinished (its error is the response, rt_stream_fail) or
 *         rt_choices_abort (the client left)--> FAILED: every other child is cancelled on its
 *         instances and retired at once --> DONE
 *
 * Invariants:
 *  - child (prompt i, choice c): index i * n + c; its p is the parent's with the prompt i, its
 *    max_tokens, n = 1 and seed + c (vLLM's rule: the choices differ, the request stays
 *    reproducible; greedy choices are equal, and choice 0 equals the request with n = 1).
 *  - best_of > n (completions, never streamed): best_of children per prompt, candidate c at
 *    index i * best_of + c with seed + c (so candidate c equals choice c of n = best_of);
 *    they carry sampling.logprobs (p.lp_hidden when the client did not ask for them). When
 *    the last one retires, each prompt's candidates are sorted by the sum of their
 *    generated tokens' logprobs (highest first, ties: lower candidate), the n first get the
 *    indexes i * n + rank and kids[0 .. ch.n_out); usage counts every candidate's tokens.
 *  - The loop holds one reference to the parent from rt_loop_post until its last child
 *    retires (or until it is refused); a child retiring never outlives the call that drops it.
 * Threading: the loop thread only.
 * Ownership: the parent owns its children (rt_req.ch.kids); a child borrows its parent.
 */
#ifndef RT_CHOICES_H
#define RT_CHOICES_H

#include <stdbool.h>

#include "rt.h"

/* Does q fan out (n > 1, or several prompts)? */
bool rt_choices_many(const rt_req *q);
/* Admit parent q: its children into the table and the router queue, all or none. 0, or the
 * HTTP status with e filled (nothing was admitted; the caller refuses q). */
int rt_choices_admit(rt_router *r, rt_req *q, rt_error *e);
/* Child k left the loop (rt_loop_retire; k->loop.state is DONE): a failure ends the parent
 * (its other children are cancelled and retired), the last child's finish ends the response;
 * the parent's last child drops the loop's reference to it. */
void rt_choices_retired(rt_router *r, rt_req *k);
/* End parent q with an error (its client left, ...): the response gets it, unless complete,
 * and every child still live is cancelled and retired. Nothing if q is not open. */
void rt_choices_abort(rt_router *r, rt_req *q, int status, const char *code, const char *msg);

#endif
