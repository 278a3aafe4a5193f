/* td_args.c: see td_args.h. */
#include "td_args.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_err.h"

/* The spec entry whose name is arg's ("--name" or "--name=..."), or NULL. *value: the text
 * after '=' when there is one, else NULL. */
static const td_arg *find(const char *arg, const td_arg *spec, int n, const char **value)
{
    for (int i = 0; i < n; i++) {
        size_t len = strlen(spec[i].name);
        if (strncmp(arg, spec[i].name, len)) continue;
        if (arg[len] == '\0') {
            *value = NULL;
            return &spec[i];
        }
        if (arg[len] == '=') {
            *value = arg + len + 1;
            return &spec[i];
        }
    }
    return NULL;
}

int td_args_int(const char *prog, const char *flag, const char *v, long lo, long hi, int *out)
{
    char *end = NULL;
    errno = 0;
    long x = v ? strtol(v, &end, 10) : 0;
    if (!v || errno || *end || end == v || x < lo || x > hi) {
        fprintf(stderr, "%s: %s needs an integer in [%ld, %ld], got '%s'\n", prog, flag, lo, hi,
                v ? v : "");
        return TD_EINVAL;
    }
    *out = (int)x;
    return 0;
}

static int store(const char *prog, const td_arg *a, const char *v)
{
    if (a->kind == TD_ARG_STRING) {
        *(const char **)a->out = v;
        return 0;
    }
    return td_args_int(prog, a->name, v, a->min, a->max, a->out);
}

td_args_result td_args_parse(const char *prog, int argc, char **argv, const td_arg *spec, int n)
{
    unsigned char seen[64] = {0};
    if (n > (int)sizeof seen) {
        fprintf(stderr, "%s: too many options in the parser's table (bug)\n", prog);
        return TD_ARGS_ERROR;
    }
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i], *v;
        if (!strcmp(arg, "-h") || !strcmp(arg, "--help")) return TD_ARGS_HELP;
        const td_arg *a = find(arg, spec, n, &v);
        if (!a) {
            fprintf(stderr, "%s: unknown option '%s'\n", prog, arg);
            return TD_ARGS_ERROR;
        }
        if (seen[a - spec]++) {
            fprintf(stderr, "%s: %s given twice\n", prog, a->name);
            return TD_ARGS_ERROR;
        }
        if (a->kind == TD_ARG_FLAG) {
            if (v) {
                fprintf(stderr, "%s: %s takes no value\n", prog, a->name);
                return TD_ARGS_ERROR;
            }
            *(bool *)a->out = true;
            continue;
        }
        if (!v) {
            if (i + 1 >= argc) {
                fprintf(stderr, "%s: %s needs a value\n", prog, a->name);
                return TD_ARGS_ERROR;
            }
            v = argv[++i];
        }
        if (store(prog, a, v)) return TD_ARGS_ERROR;
    }
    for (int i = 0; i < n; i++)
        if (spec[i].required && !seen[i]) {
            fprintf(stderr, "%s: %s is required\n", prog, spec[i].name);
            return TD_ARGS_ERROR;
        }
    return TD_ARGS_OK;
}
