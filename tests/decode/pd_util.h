/* pd_util.h: helpers shared by the disaggregated-decode test programs (pd_writer,
 * pd_client): token id lists and hex strings on the command line. Header-only; aborting
 * on a bad command line is fine here (test programs, input from the test script). */
#ifndef PD_UTIL_H
#define PD_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* "1,2,3" -> malloc'd ids; exits on bad input. */
static inline int32_t *pd_parse_ids(const char *s, int *n)
{
    int cap = 16;
    int32_t *a = malloc((size_t)cap * sizeof *a);
    *n = 0;
    while (a && *s) {
        char *end;
        long x = strtol(s, &end, 10);
        if (end == s || x < 0 || x > INT32_MAX) {
            fprintf(stderr, "bad token id list near '%.20s'\n", s);
            exit(2);
        }
        if (*n == cap) a = realloc(a, (size_t)(cap *= 2) * sizeof *a);
        if (a) a[(*n)++] = (int32_t)x;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') {
            fprintf(stderr, "bad token id list near '%.20s'\n", end);
            exit(2);
        }
    }
    if (!a || !*n) {
        fprintf(stderr, "empty token id list\n");
        exit(2);
    }
    return a;
}

static inline void pd_hex_print(FILE *f, const uint8_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        fprintf(f, "%02x", b[i]);
}

/* Hex of `len` chars (even) -> malloc'd bytes; exits on bad input. */
static inline uint8_t *pd_unhex(const char *s, size_t len, size_t *n)
{
    if (len % 2) {
        fprintf(stderr, "odd hex length\n");
        exit(2);
    }
    uint8_t *b = malloc(len / 2 + 1);
    for (size_t i = 0; b && i < len / 2; i++) {
        unsigned v;
        if (sscanf(s + 2 * i, "%2x", &v) != 1) {
            fprintf(stderr, "bad hex\n");
            exit(2);
        }
        b[i] = (uint8_t)v;
    }
    *n = len / 2;
    return b;
}

#endif
