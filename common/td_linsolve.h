/* td_linsolve.h: a small dense linear solver for the least-squares fits of the cost models.
 *
 * Purpose: the decode step cost (decode-node/dc_plan.c), the prefill chunk cost
 * (prefill-node/pf_chunk.c, pf_tune.c) and the planner's joint fit (planner/pl_calib_chunk.c)
 * each solve normal equations of at most a handful of unknowns; one elimination serves them
 * all, so a fix or a check made here holds for every fit.
 * Method: Gaussian elimination with partial pivoting (the first row of largest magnitude in
 * the column), then back substitution; O(n^3), no allocation, meant for n up to about 10.
 * Rejection: the caller says what "singular" means for its problem by the pivot floor: the
 * solve fails as soon as a pivot's magnitude is not above it (a NaN pivot fails too). A fit
 * that wants a relative test passes its own scale times a ratio (the largest entry, the
 * largest diagonal entry); one that wants only to avoid dividing by zero passes a tiny
 * absolute floor. Whether x is finite is left to the caller (what is finite enough depends on
 * how it scales x back).
 */
#ifndef TD_LINSOLVE_H
#define TD_LINSOLVE_H

#include <stdbool.h>

/* Solve A x = b for n unknowns. A is n x n row-major; A and b are overwritten. x (n values;
 * it may be b) is written only on success. Returns false, leaving x as it was, if a pivot's
 * magnitude is not above pivot_min. */
bool td_solve_dense(int n, double *A, double *b, double *x, double pivot_min);

#endif
