/* rt_format.h: `response_format` (structured output) of a completions or chat request.
 *
 * Purpose: {"type": "text"} asks for nothing; {"type": "json_object"} and {"type":
 * "json_schema", "json_schema": {"name", "schema", "strict", "description"}} set the
 * request's grammar (td_sampling.grammar_kind / .grammar), which the node that samples
 * compiles into a token mask (grammar/gr_grammar.h). The schema is compiled here once too,
 * so an unsupported keyword is a 400 naming it before any node sees the request.
 * Ownership: the schema text is malloc'd into *text (the caller frees it, rt_params_fini
 * for rt_params.grammar); sp->grammar points at it.
 */
#ifndef RT_FORMAT_H
#define RT_FORMAT_H

#include <jansson.h>

#include "rt_buf.h"
#include "td_sampling.h"

/* Parse o's response_format (absent: nothing) into sp's grammar fields and *text. Returns
 * 0, or the HTTP status with e set. */
int rt_format_parse(json_t *o, td_sampling *sp, char **text, rt_error *e);

#endif
