/* cpu_blas.h: which OpenBLAS kernels the process runs, whether they fit this CPU, and the
 * start-up step that makes them fit.
 *
 * Purpose: the float32 GEMM path (prefill rows, cpu_matmul.c) calls OpenBLAS's sgemm, and
 * Debian's OpenBLAS (DYNAMIC_ARCH) picks its kernel set ("core") from a CPUID table. A VM
 * that masks the CPU's model makes it fall back to a core from before AVX ("Prescott"): on an
 * AVX-512 Xeon it measured 40-45 GFLOP/s against 290-335 with the right core, and prefill ran
 * at a third of its speed, silently. OpenBLAS reads OPENBLAS_CORETYPE once, when the library
 * loads, before main; so the fix is a re-execution of the process with it set, at the top of
 * main, before any thread or file exists (kn_blas_fit_cpu).
 * The rule: a core whose instruction set is older than the CPU's (by the features the OS
 * enables, __builtin_cpu_supports) is replaced by the core for the CPU's features, whether
 * OpenBLAS chose it or OPENBLAS_CORETYPE asked for it. TANDEM_BLAS_CORE=keep keeps whatever
 * OpenBLAS runs (the mismatch is then only reported); TANDEM_BLAS_CORE=NAME asks for that
 * core by name; unset or "auto" is the rule.
 * Threading: kn_blas_fit_cpu at the top of main, before any other thread; the rest anywhere.
 */
#ifndef KN_CPU_BLAS_H
#define KN_CPU_BLAS_H

#include <stdbool.h>
#include <stddef.h>

/* What the process's BLAS runs, read now. */
typedef struct {
    char core[32];       /* openblas_get_corename(): "Cooperlake", "Haswell", "Prescott", ... */
    const char *core_isa; /* the core's instruction set: "avx512", "avx2", "avx", "sse", or
                             "unknown" (a name not in the table) */
    const char *cpu_isa;  /* the CPU's, as the OS enables it, in the same terms */
    const char *cpu_core; /* the core that fits the CPU's features (what the fix asks for) */
    char cpu_features[160]; /* the features the kernels and the BLAS care about, by name */
    bool fits;           /* the core's instruction set is the CPU's (or the core is unknown) */
    char fixed_from[32]; /* the core OpenBLAS ran before kn_blas_fit_cpu re-executed the
                            process (or an ancestor of it), or "" */
    bool kept;           /* TANDEM_BLAS_CORE=keep: a mismatch is reported, not fixed */
} kn_blas_info;

void kn_blas_info_get(kn_blas_info *out);

/* td_build_identity (td_cachefile.h) of the OpenBLAS library this process runs: a cache
 * key's part for what its float32 GEMM computes. */
void kn_blas_build_identity(char *out, size_t cap);

/* At the top of main: when the BLAS core is older than the CPU (and TANDEM_BLAS_CORE is not
 * "keep"), or TANDEM_BLAS_CORE names another core, set OPENBLAS_CORETYPE and re-execute
 * /proc/self/exe with argv (does not return then). A process re-executed once is never
 * re-executed again (TANDEM_BLAS_FIXED_FROM, which its children inherit with
 * OPENBLAS_CORETYPE). Returns TD_EINVAL (logged) for a TANDEM_BLAS_CORE that is neither
 * auto, keep nor a core name; else 0: an exec that fails is logged and the process goes on
 * with the core it has. */
int kn_blas_fit_cpu(char **argv);

/* One line for the start-up log under who: the CPU's features, the ISA the caller's kernels
 * were built for (kernels), the BLAS core and whether it fits (and what was fixed or kept).
 * At info level, or at warn level when the core does not fit. */
void kn_blas_log(const char *who, const char *kernels);

#endif
