/* td_long.c (fixture): EXPECT: file-length (over the self-test's 120 lines). Traps for the
 * brace scan: braces in comments { { {, strings, character literals, macros and initializers. */
#include <stddef.h>

#define SWAP(a, b) do { int t_ = (a); (a) = (b); (b) = t_; } while (0)
#define BLOCK_BEGIN {
#define MULTI(x) \
    do {          \
        (x)++;    \
    } while (0)

/* a 21-line function: one over the self-test limit of 20 */
static int too_long(int x) /* EXPECT: function-length */
{
    x += 0; /* } */
    x += 1; /* } */
    x += 2; /* } */
    x += 3; /* } */
    x += 4; /* } */
    x += 5; /* } */
    x += 6; /* } */
    x += 7; /* } */
    x += 8; /* } */
    x += 9; /* } */
    x += 10; /* } */
    x += 11; /* } */
    x += 12; /* } */
    x += 13; /* } */
    x += 14; /* } */
    x += 15; /* } */
    x += 16; /* } */
    x += 17; /* } */
    x += 18; /* } */
}

/* exactly 20 lines: allowed */
static int just_right(int x)
{
    x += '{' + 0; // {
    x += '{' + 1; // {
    x += '{' + 2; // {
    x += '{' + 3; // {
    x += '{' + 4; // {
    x += '{' + 5; // {
    x += '{' + 6; // {
    x += '{' + 7; // {
    x += '{' + 8; // {
    x += '{' + 9; // {
    x += '{' + 10; // {
    x += '{' + 11; // {
    x += '{' + 12; // {
    x += '{' + 13; // {
    x += '{' + 14; // {
    x += '{' + 15; // {
    x += '{' + 16; // {
    x += '{' + 17; // {
}

/* a file-scope initializer is no function, however long */
static const int table[] = {
    0,
    1,
    2,
    3,
    4,
    5,
    6,
    7,
    8,
    9,
    10,
    11,
    12,
    13,
    14,
    15,
    16,
    17,
    18,
    19,
    20,
    21,
    22,
    23,
    24,
};

/* nor is a struct definition */
struct td_long_state {
    int f0;
    int f1;
    int f2;
    int f3;
    int f4;
    int f5;
    int f6;
    int f7;
    int f8;
    int f9;
    int f10;
    int f11;
    int f12;
    int f13;
    int f14;
    int f15;
    int f16;
    int f17;
    int f18;
    int f19;
    int f20;
    int f21;
};

/* attributes before the name, a signature over several lines */
static void __attribute__((unused)) attr_fn(int a, /* EXPECT: function-length */
                                             int b)
{
    const char *s = "}}}{{{";
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
    SWAP(a, b);
}

/* returns a function pointer: the name is inside the declarator */
static int (*pick(int k))(int) /* EXPECT: function-length */
{
#if defined(SOMETHING)
    if (k) {
#else
    if (!k) {
#endif
        k++;
    }
    k += 0;
    k += 1;
    k += 2;
    k += 3;
    k += 4;
    k += 5;
    k += 6;
    k += 7;
    k += 8;
    k += 9;
    k += 10;
    k += 11;
    k += 12;
    return NULL;
}

int use_all(void)
{
    return too_long(1) + just_right(2) + table[0] + (pick(0) != NULL) + (int)sizeof(struct td_long_state);
}
