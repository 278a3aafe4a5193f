/* test_linsolve.c: the dense solver (common/td_linsolve.h): known systems of 1 to 6 unknowns
 * (some needing the row exchanges), singular ones, a badly conditioned one refused or accepted
 * by the pivot floor, and x left as it was when a solve fails. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "td_linsolve.h"
#include "tharness.h"

#define MAXN 6

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

/* a small integer in [-9, 9], from a fixed sequence so failures reproduce */
static double small_int(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)((int)(rng_state >> 33) % 19 - 9);
}

/* b = A x for a row-major n x n A */
static void mul(int n, const double *A, const double *x, double *b)
{
    for (int i = 0; i < n; i++) {
        b[i] = 0;
        for (int j = 0; j < n; j++)
            b[i] += A[i * n + j] * x[j];
    }
}

static double max_err(int n, const double *x, const double *want)
{
    double e = 0;
    for (int i = 0; i < n; i++)
        e = fmax(e, fabs(x[i] - want[i]));
    return e;
}

/* Exact answers: the arithmetic is exact on these, so the results are too. */
static void test_exact(void)
{
    double A1[1] = {4}, b1[1] = {2}, x1[1];
    TH_CHECK(td_solve_dense(1, A1, b1, x1, 0) && x1[0] == 0.5);
    double A2[4] = {2, 1, 1, 3}, b2[2] = {3, 5}, x2[2];
    TH_CHECK(td_solve_dense(2, A2, b2, x2, 0));
    TH_CHECK(fabs(x2[0] - 0.8) < 1e-15 && fabs(x2[1] - 1.4) < 1e-15);
    /* a zero on the diagonal: solvable only with the rows exchanged */
    double P[4] = {0, 1, 1, 0}, bp[2] = {2, 3}, xp[2];
    TH_CHECK(td_solve_dense(2, P, bp, xp, 0) && xp[0] == 3 && xp[1] == 2);
    /* x may be b */
    double A3[9] = {0, 0, 2, 0, 4, 0, 8, 0, 0}, b3[3] = {2, 4, 8};
    TH_CHECK(td_solve_dense(3, A3, b3, b3, 0) && b3[0] == 1 && b3[1] == 1 && b3[2] == 1);
}

/* Random well conditioned systems (diagonally dominant, rows shuffled so the pivoting has
 * work to do) with integer solutions, n = 1..6. */
static void test_known(void)
{
    for (int n = 1; n <= MAXN; n++) {
        for (int rep = 0; rep < 20; rep++) {
            double A[MAXN * MAXN], M[MAXN * MAXN], want[MAXN], b[MAXN], x[MAXN];
            for (int i = 0; i < n; i++) {
                double row = 0;
                for (int j = 0; j < n; j++)
                    row += fabs(M[i * n + j] = small_int());
                M[i * n + i] = row + 1;
                want[i] = small_int();
            }
            for (int i = 0; i < n; i++) /* row i of A is row (i + rep) mod n of M */
                memcpy(&A[i * n], &M[((i + rep) % n) * n], sizeof(double) * n);
            mul(n, A, want, b);
            bool ok = td_solve_dense(n, A, b, x, 1e-12);
            TH_CHECKF(ok && max_err(n, x, want) < 1e-12, "n %d rep %d err %g", n, rep,
                      ok ? max_err(n, x, want) : NAN);
        }
    }
}

/* Singular systems are refused, x untouched: a repeated row gives an exact zero pivot (the
 * two copies are changed alike until one eliminates the other), as do a zero column and an
 * all-zero matrix; a NaN pivot is refused even with a floor of 0. */
static void test_singular(void)
{
    for (int n = 2; n <= MAXN; n++) {
        double A[MAXN * MAXN], b[MAXN], x[MAXN];
        for (int i = 0; i < n; i++) {
            for (int j = 0; j < n; j++)
                A[i * n + j] = small_int();
            b[i] = small_int();
            x[i] = -123;
        }
        memcpy(&A[(n - 1) * n], &A[0], sizeof(double) * n);
        TH_CHECKF(!td_solve_dense(n, A, b, x, 0), "repeated row, n %d", n);
        bool kept = true;
        for (int i = 0; i < n; i++)
            kept = kept && x[i] == -123;
        TH_CHECKF(kept, "x written on failure, n %d", n);
    }
    double Z[9] = {1, 0, 2, 3, 0, 4, 5, 0, 6}, bz[3] = {1, 2, 3}, xz[3];
    TH_CHECK(!td_solve_dense(3, Z, bz, xz, 0)); /* column 1 is zero */
    double O[4] = {0}, bo[2] = {1, 1}, xo[2];
    TH_CHECK(!td_solve_dense(2, O, bo, xo, 0));
    double N[4] = {NAN, 1, 1, 2}, bn[2] = {1, 1}, xn[2];
    TH_CHECK(!td_solve_dense(2, N, bn, xn, 0));
}

/* The floor is strict: a pivot equal to it is refused. */
static void test_floor(void)
{
    double a[1] = {1e-300}, b[1] = {1e-300}, x[1];
    TH_CHECK(!td_solve_dense(1, a, b, x, 1e-300));
    a[0] = 2e-300, b[0] = 1e-300;
    TH_CHECK(td_solve_dense(1, a, b, x, 1e-300) && x[0] == 0.5);
    a[0] = -3, b[0] = 6;
    TH_CHECK(td_solve_dense(1, a, b, x, 2.9) && x[0] == -2);
    a[0] = -3, b[0] = 6;
    TH_CHECK(!td_solve_dense(1, a, b, x, 3));
}

/* The 6 x 6 Hilbert matrix (condition number about 1.5e7): its smallest pivot is about
 * 5.7e-7 of its largest entry (1), so a relative floor of 1e-6 refuses it, and the 1e-9 of
 * the prefill fit accepts it with the error its conditioning allows. */
static void test_ill_conditioned(void)
{
    double H[MAXN * MAXN], A[MAXN * MAXN], want[MAXN], b[MAXN], x[MAXN];
    const int n = MAXN;
    for (int i = 0; i < n; i++) {
        want[i] = 1;
        for (int j = 0; j < n; j++)
            H[i * n + j] = 1.0 / (i + j + 1);
    }
    memcpy(A, H, sizeof H);
    mul(n, H, want, b);
    TH_CHECK(!td_solve_dense(n, A, b, x, 1e-6 * 1.0));
    memcpy(A, H, sizeof H);
    mul(n, H, want, b);
    TH_CHECK(td_solve_dense(n, A, b, x, 1e-9 * 1.0));
    TH_CHECKF(max_err(n, x, want) < 1e-6, "err %g", max_err(n, x, want));
    /* two nearly equal rows: a pivot of about 1e-10 against a scale of 1 */
    double B[4] = {1, 1, 1, 1 + 1e-10}, bb[2] = {2, 2 + 1e-10}, xb[2];
    TH_CHECK(!td_solve_dense(2, B, bb, xb, 1e-9));
    double C[4] = {1, 1, 1, 1 + 1e-10}, bc[2] = {2, 2 + 1e-10}, xc[2];
    TH_CHECK(td_solve_dense(2, C, bc, xc, 1e-12));
    TH_CHECKF(fabs(xc[0] - 1) < 1e-5 && fabs(xc[1] - 1) < 1e-5, "x %g %g", xc[0], xc[1]);
}

int main(void)
{
    TH_RUN(test_exact);
    TH_RUN(test_known);
    TH_RUN(test_singular);
    TH_RUN(test_floor);
    TH_RUN(test_ill_conditioned);
    TH_EXIT();
}
