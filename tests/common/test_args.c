/* test_args.c: the server binaries' command-line parser (common/td_args.h): both value
 * forms, flags, defaults kept, and every error a user can make. */
#include <stdbool.h>
#include <string.h>

#include "td_args.h"
#include "tharness.h"

typedef struct {
    const char *config, *listen;
    int rank;
    bool reprofile;
} opts;

/* Parses the NULL-terminated words after the program name. */
static td_args_result parse(opts *o, const char *const *words)
{
    char *argv[16] = {"prog"};
    int argc = 1;
    while (*words && argc < 15)
        argv[argc++] = (char *)*words++;
    *o = (opts){.listen = "default", .rank = -1};
    const td_arg spec[] = {
        {.name = "--config", .kind = TD_ARG_STRING, .out = &o->config, .required = true},
        {.name = "--rank",
         .kind = TD_ARG_INT,
         .out = &o->rank,
         .required = true,
         .min = 0,
         .max = 1023},
        {.name = "--listen", .kind = TD_ARG_STRING, .out = &o->listen},
        {.name = "--reprofile", .kind = TD_ARG_FLAG, .out = &o->reprofile},
    };
    return td_args_parse("prog", argc, argv, spec, sizeof spec / sizeof *spec);
}

static void test_accepted(void)
{
    opts o;
    TH_CHECK(parse(&o, (const char *[]){"--config", "a.yaml", "--rank", "3", NULL}) == TD_ARGS_OK);
    TH_CHECK(!strcmp(o.config, "a.yaml") && o.rank == 3);
    TH_CHECK(!strcmp(o.listen, "default") && !o.reprofile); /* not given: the default stays */
    TH_CHECK(parse(&o, (const char *[]){"--rank=0", "--reprofile", "--config=b.yaml", "--listen",
                                        "tcp://x:1", NULL}) == TD_ARGS_OK);
    TH_CHECK(!strcmp(o.config, "b.yaml") && o.rank == 0 && o.reprofile);
    TH_CHECK(!strcmp(o.listen, "tcp://x:1"));
    TH_CHECK(parse(&o, (const char *[]){"--config=", "--rank", "1023", NULL}) == TD_ARGS_OK);
    TH_CHECK(!strcmp(o.config, "") && o.rank == 1023); /* an empty value is the caller's call */
    TH_CHECK(parse(&o, (const char *[]){"--config", "a", "-h", NULL}) == TD_ARGS_HELP);
    TH_CHECK(parse(&o, (const char *[]){"--help", NULL}) == TD_ARGS_HELP);
}

static void test_refused(void)
{
    opts o;
    const char *const *bad[] = {
        (const char *[]){"--config", "a", NULL},                          /* --rank required */
        (const char *[]){"--rank", "1", NULL},                            /* --config required */
        (const char *[]){"--config", "a", "--rank", NULL},                /* no value */
        (const char *[]){"--config", "a", "--rank", "x", NULL},           /* not a number */
        (const char *[]){"--config", "a", "--rank", "1024", NULL},        /* out of range */
        (const char *[]){"--config", "a", "--rank", "-1", NULL},          /* out of range */
        (const char *[]){"--config", "a", "--rank", "2x", NULL},          /* trailing text */
        (const char *[]){"--config", "a", "--rank", "", NULL},            /* empty number */
        (const char *[]){"--config", "a", "--rank", "99999999999", NULL}, /* overflow */
        (const char *[]){"--config", "a", "--rank", "1", "--frob", NULL}, /* unknown */
        (const char *[]){"--config", "a", "--ranks", "1", NULL},          /* a longer name */
        (const char *[]){"--config", "a", "--config", "b", "--rank", "1", NULL}, /* twice */
        (const char *[]){"--config", "a", "--rank", "1", "--reprofile=1", NULL}, /* flag value */
        (const char *[]){"config", "a", "--rank", "1", NULL},                    /* not an option */
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        TH_CHECKF(parse(&o, bad[i]) == TD_ARGS_ERROR, "case %zu", i);
}

int main(void)
{
    TH_RUN(test_accepted);
    TH_RUN(test_refused);
    TH_EXIT();
}
