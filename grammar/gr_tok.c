/* gr_tok.c: a gr_vocab from the model's tokenizer (gr_vocab_from_tok). */
#include "gr_int.h"
#include "td_err.h"
#include "tokenizer.h"

#include <stdlib.h>

/* text of a token as a reply shows it; control, unknown and EOG tokens never are text */
static const char *tok_piece(void *ctx, int32_t id, size_t *len)
{
    const td_tokenizer *t = ctx;
    if (td_tok_is_eog(t, id)) return NULL;
    const char *p = td_tok_piece_render(t, id, false, len);
    return p && *len ? p : NULL;
}

int gr_vocab_from_tok(const td_tokenizer *t, gr_vocab **out)
{
    *out = NULL;
    int32_t nv = td_tok_n_vocab(t);
    if (nv < 1) return TD_EINVAL;
    int32_t *eog = malloc((size_t)nv * sizeof *eog);
    if (!eog) return TD_ENOMEM;
    int n_eog = 0;
    for (int32_t i = 0; i < nv; i++)
        if (td_tok_is_eog(t, i)) eog[n_eog++] = i;
    int rc = gr_vocab_create(nv, tok_piece, (void *)t, eog, n_eog, out);
    free(eog);
    return rc;
}
