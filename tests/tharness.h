/* tharness.h: the tiny test harness every C test uses.
 *
 * A test file defines test functions and a main that calls TH_RUN on each; TH_CHECK
 * records a failure (file:line and the expression) and goes on, TH_REQUIRE returns from
 * the test function. The process exits 1 if any check failed, so ctest sees it.
 */
#ifndef THARNESS_H
#define THARNESS_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static int th_failures;
static int th_checks;

#define TH_CHECK(cond)                                                                             \
    do {                                                                                           \
        th_checks++;                                                                               \
        if (!(cond)) {                                                                             \
            th_failures++;                                                                         \
            fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);                        \
        }                                                                                          \
    } while (0)

#define TH_CHECKF(cond, ...)                                                                       \
    do {                                                                                           \
        th_checks++;                                                                               \
        if (!(cond)) {                                                                             \
            th_failures++;                                                                         \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
        }                                                                                          \
    } while (0)

#define TH_REQUIRE(cond)                                                                           \
    do {                                                                                           \
        th_checks++;                                                                               \
        if (!(cond)) {                                                                             \
            th_failures++;                                                                         \
            fprintf(stderr, "FAIL %s:%d: %s (stopping this test)\n", __FILE__, __LINE__, #cond);   \
            return;                                                                                \
        }                                                                                          \
    } while (0)

#define TH_RUN(fn)                                                                                 \
    do {                                                                                           \
        int before_ = th_failures;                                                                 \
        fn();                                                                                      \
        fprintf(stderr, "%s %s\n", th_failures == before_ ? "ok  " : "FAIL", #fn);                 \
    } while (0)

#define TH_EXIT()                                                                                  \
    do {                                                                                           \
        fprintf(stderr, "%d checks, %d failed\n", th_checks, th_failures);                         \
        return th_failures ? 1 : 0;                                                                \
    } while (0)

#endif
