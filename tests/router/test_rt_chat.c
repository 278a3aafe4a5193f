/* test_rt_chat.c: render a chat request body's messages and tools with a chat template
 * through the router's own path (rt_chat_prompt), for tests/router/test_chat_tools.py.
 *
 *   test_rt_chat TEMPLATE_FILE BODY_JSON_FILE   prints the prompt text (exit 0), or the
 *                                               error as {"status": N, "message": ...} (exit 3)
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rt_chat.h"

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (!b || fread(b, 1, (size_t)n, f) != (size_t)n) n = 0;
    if (b) b[n] = '\0';
    fclose(f);
    *len = (size_t)n;
    return b;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: test_rt_chat TEMPLATE_FILE BODY_JSON_FILE\n");
        return 2;
    }
    size_t tlen = 0;
    char *tmpl = slurp(argv[1], &tlen);
    json_error_t jerr;
    json_t *body = json_load_file(argv[2], JSON_REJECT_DUPLICATES, &jerr);
    if (!tmpl || !body) {
        fprintf(stderr, "cannot read %s or %s\n", argv[1], argv[2]);
        return 2;
    }
    rt_chat_tmpl t;
    char err[512];
    if (rt_chat_tmpl_init_text(&t, tmpl, tlen, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 2;
    }
    rt_chat_tools p = {0};
    rt_error e = {0};
    char *text = NULL;
    int rc = rt_chat_prompt(&t, body, true, &p, &text, &e);
    if (rc) {
        printf("{\"status\": %d, \"message\": \"%s\"}\n", e.status, e.message);
    } else {
        fwrite(text, 1, strlen(text), stdout);
        fprintf(stderr, "tool_parse %d parallel %d\n", p.parse, p.parallel);
        if (p.forced) fprintf(stderr, "forced strict %d grammar %s\n", p.strict, p.grammar);
    }
    free(text);
    rt_chat_tools_fini(&p);
    rt_chat_tmpl_fini(&t);
    json_decref(body);
    free(tmpl);
    return rc ? 3 : 0;
}
