/* td_args.h: the command line of Tandem's server binaries (tandem-decode, tandem-prefill,
 * tandem-router), parsed from one table.
 *
 * Purpose: each server takes a few long options (--config FILE, --rank R, --reprofile, ...);
 * one parser gives them the same behaviour: "--name VALUE" and "--name=VALUE", -h/--help,
 * a clear message naming the program for an unknown option, a missing value, a bad
 * number, an option given twice or a required one left out.
 * Errors: printed to stderr as "PROG: message"; the caller then exits 1.
 */
#ifndef TD_ARGS_H
#define TD_ARGS_H

#include <stdbool.h>

typedef enum {
    TD_ARG_STRING, /* out: const char ** (points into argv) */
    TD_ARG_INT,    /* out: int *, within [min, max] */
    TD_ARG_FLAG,   /* out: bool *, set to true; takes no value */
} td_arg_kind;

typedef struct {
    const char *name; /* "--config" */
    td_arg_kind kind;
    void *out;
    bool required;
    int min, max; /* TD_ARG_INT */
} td_arg;

typedef enum {
    TD_ARGS_OK = 0,
    TD_ARGS_HELP = 1,   /* -h or --help: print the usage, exit 0 */
    TD_ARGS_ERROR = -1, /* the message is printed: print the usage, exit 1 */
} td_args_result;

/* v as a decimal integer in [lo, hi] into *out: 0, or TD_EINVAL with "PROG: FLAG needs an
 * integer in [lo, hi], got 'v'" on stderr (v NULL, empty, trailing text, out of range). The
 * one integer rule of every command line (td_args_parse, the tandem CLI's cli_parse_int). */
int td_args_int(const char *prog, const char *flag, const char *v, long lo, long hi, int *out);

/* Parse argv[1..argc) against spec[0..n). Outputs of options not given are left as they
 * are (the caller's defaults). */
td_args_result td_args_parse(const char *prog, int argc, char **argv, const td_arg *spec, int n);

#endif
