/* td_linsolve.c: Gaussian elimination with partial pivoting (see td_linsolve.h). */
#include "td_linsolve.h"

#include <math.h>

bool td_solve_dense(int n, double *A, double *b, double *x, double pivot_min)
{
    for (int k = 0; k < n; k++) {
        int piv = k;
        for (int i = k + 1; i < n; i++)
            if (fabs(A[i * n + k]) > fabs(A[piv * n + k])) piv = i;
        /* written so that a NaN pivot fails as well */
        if (!(fabs(A[piv * n + k]) > pivot_min)) return false;
        if (piv != k) {
            for (int j = k; j < n; j++) { /* the columns before k are zero in both rows */
                double t = A[k * n + j];
                A[k * n + j] = A[piv * n + j];
                A[piv * n + j] = t;
            }
            double t = b[k];
            b[k] = b[piv];
            b[piv] = t;
        }
        for (int i = k + 1; i < n; i++) {
            double f = A[i * n + k] / A[k * n + k];
            for (int j = k + 1; j < n; j++)
                A[i * n + j] -= f * A[k * n + j];
            A[i * n + k] = 0;
            b[i] -= f * b[k];
        }
    }
    /* back substitution in place of b, so x is untouched until the solve has succeeded */
    for (int k = n - 1; k >= 0; k--) {
        double s = b[k];
        for (int j = k + 1; j < n; j++)
            s -= A[k * n + j] * b[j];
        b[k] = s / A[k * n + k];
    }
    for (int k = 0; k < n; k++)
        x[k] = b[k];
    return true;
}
