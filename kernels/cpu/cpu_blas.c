/* cpu_blas.c: the OpenBLAS core against the CPU's features, and the re-execution that fixes
 * a core older than the CPU (cpu_blas.h). */
#include "cpu_blas.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "td_cachefile.h"
#include "td_err.h"

#include <cblas.h>

#define ENV_WANT  "TANDEM_BLAS_CORE"       /* auto | keep | a core name */
#define ENV_FIXED "TANDEM_BLAS_FIXED_FROM" /* set before the re-execution */

/* Instruction-set levels, in order: a core fits when its level is the CPU's. */
enum { ISA_UNKNOWN, ISA_SSE, ISA_AVX, ISA_AVX2, ISA_AVX512 };
static const char *const isa_names[] = {"unknown", "sse", "avx", "avx2", "avx512"};

/* The x86-64 cores of OpenBLAS 0.3.21's DYNAMIC_ARCH (driver/others/dynamic.c) by the
 * instruction set their kernels use. Excavator's kernels are Piledriver's (AVX). */
static const struct {
    const char *name;
    int isa;
} cores[] = {
    {"SkylakeX", ISA_AVX512},     {"Cooperlake", ISA_AVX512},  {"SapphireRapids", ISA_AVX512},
    {"Haswell", ISA_AVX2},        {"Zen", ISA_AVX2},           {"Sandybridge", ISA_AVX},
    {"Bulldozer", ISA_AVX},       {"Piledriver", ISA_AVX},     {"Steamroller", ISA_AVX},
    {"Excavator", ISA_AVX},       {"Katmai", ISA_SSE},         {"Coppermine", ISA_SSE},
    {"Northwood", ISA_SSE},       {"Prescott", ISA_SSE},       {"Banias", ISA_SSE},
    {"Atom", ISA_SSE},            {"Core2", ISA_SSE},          {"Penryn", ISA_SSE},
    {"Dunnington", ISA_SSE},      {"Nehalem", ISA_SSE},        {"Athlon", ISA_SSE},
    {"Opteron", ISA_SSE},         {"Opteron_SSE3", ISA_SSE},   {"Barcelona", ISA_SSE},
    {"Nano", ISA_SSE},            {"Bobcat", ISA_SSE},
};

static int core_isa(const char *name)
{
    for (size_t i = 0; i < sizeof cores / sizeof *cores; i++)
        if (!strcasecmp(name, cores[i].name)) return cores[i].isa;
    return ISA_UNKNOWN;
}

/* The CPU's level by what the OS enables (libgcc's cpu model checks XCR0 too), and the core
 * that fits it. The AVX-512 cores need F, BW, VL, DQ and CD, as OpenBLAS's SkylakeX does. */
static int cpu_isa(const char **core)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512cd")) {
        *core = __builtin_cpu_supports("avx512bf16") ? "Cooperlake" : "SkylakeX";
        return ISA_AVX512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        *core = "Haswell";
        return ISA_AVX2;
    }
    if (__builtin_cpu_supports("avx")) {
        *core = "Sandybridge";
        return ISA_AVX;
    }
    *core = NULL; /* nothing to ask for: every core fits */
    return ISA_SSE;
}

static void cpu_features(char *buf, size_t cap)
{
    /* the ones Tandem's kernels or the BLAS kernels are chosen by */
#define FEAT(s) {s, __builtin_cpu_supports(s)}
    const struct {
        const char *name;
        int on;
    } f[] = {FEAT("avx512f"),  FEAT("avx512bw"),   FEAT("avx512vl"), FEAT("avx512dq"),
             FEAT("avx512vnni"), FEAT("avx512bf16"), FEAT("avx2"),     FEAT("fma"),
             FEAT("f16c"),      FEAT("avx")};
#undef FEAT
    size_t n = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof f / sizeof *f && n < cap; i++)
        if (f[i].on) n += (size_t)snprintf(buf + n, cap - n, "%s%s", n ? " " : "", f[i].name);
    if (!n) snprintf(buf, cap, "none of avx, avx2, avx512");
}

void kn_blas_info_get(kn_blas_info *out)
{
    memset(out, 0, sizeof *out);
    const char *name = openblas_get_corename();
    snprintf(out->core, sizeof out->core, "%s", name ? name : "?");
    const int have = core_isa(out->core);
    const int cpu = cpu_isa(&out->cpu_core);
    out->core_isa = isa_names[have];
    out->cpu_isa = isa_names[cpu];
    if (!out->cpu_core) out->cpu_core = out->core;
    cpu_features(out->cpu_features, sizeof out->cpu_features);
    out->fits = have == ISA_UNKNOWN || have >= cpu;
    const char *fixed = getenv(ENV_FIXED);
    snprintf(out->fixed_from, sizeof out->fixed_from, "%s", fixed ? fixed : "");
    const char *want = getenv(ENV_WANT);
    out->kept = want && !strcmp(want, "keep");
}

int kn_blas_fit_cpu(char **argv)
{
    kn_blas_info b;
    kn_blas_info_get(&b);
    const char *want = getenv(ENV_WANT);
    const char *ask = NULL; /* the core to re-execute with */
    if (!want || !*want || !strcmp(want, "auto")) {
        if (!b.fits) ask = b.cpu_core;
    } else if (!strcmp(want, "keep")) {
        return 0; /* kn_blas_log reports a mismatch */
    } else if (core_isa(want) == ISA_UNKNOWN) {
        TD_LOG_ERR("%s=%s: expected auto, keep or an OpenBLAS core name (SkylakeX, Cooperlake, "
                   "Haswell, Zen, Sandybridge, ...)",
                   ENV_WANT, want);
        return TD_EINVAL;
    } else if (strcasecmp(want, b.core)) {
        ask = want;
    }
    if (!ask) return 0;
    if (b.fixed_from[0]) {
        /* already re-executed once (here or in an ancestor): OpenBLAS did not take it */
        TD_LOG_WARN("blas: OPENBLAS_CORETYPE=%s did not take (core %s); going on with it",
                    getenv("OPENBLAS_CORETYPE") ? getenv("OPENBLAS_CORETYPE") : "", b.core);
        return 0;
    }
    if (setenv("OPENBLAS_CORETYPE", ask, 1) || setenv(ENV_FIXED, b.core, 1)) {
        TD_LOG_WARN("blas: cannot set OPENBLAS_CORETYPE: %s", strerror(errno));
        return 0;
    }
    fflush(NULL);
    execv("/proc/self/exe", argv);
    /* only on failure: go on as we are, and say so */
    TD_LOG_WARN("blas: re-executing with OPENBLAS_CORETYPE=%s failed (%s); core stays %s", ask,
                strerror(errno), b.core);
    unsetenv(ENV_FIXED);
    return 0;
}

void kn_blas_log(const char *who, const char *kernels)
{
    kn_blas_info b;
    kn_blas_info_get(&b);
    if (b.fits) {
        char fixed[96] = "";
        if (b.fixed_from[0])
            snprintf(fixed, sizeof fixed, ", set for this cpu (OpenBLAS chose %s)", b.fixed_from);
        TD_LOG_INFO("%s: cpu %s (%s), kernels %s; blas OpenBLAS core %s (%s)%s", who, b.cpu_isa,
                    b.cpu_features, kernels, b.core, b.core_isa, fixed);
    } else {
        const char *want = getenv(ENV_WANT);
        char why[96];
        if (b.kept)
            snprintf(why, sizeof why, ENV_WANT "=keep keeps it");
        else if (want && *want && strcmp(want, "auto"))
            snprintf(why, sizeof why, ENV_WANT "=%s asked for it", want);
        else
            snprintf(why, sizeof why, "OPENBLAS_CORETYPE did not take");
        TD_LOG_WARN("%s: cpu %s (%s), kernels %s; blas OpenBLAS core %s (%s) is older than this "
                    "cpu: float32 prefill runs at a fraction of its rate (%s; unset it, or set "
                    "OPENBLAS_CORETYPE=%s)",
                    who, b.cpu_isa, b.cpu_features, kernels, b.core, b.core_isa,
                    why, b.cpu_core);
    }
}

void kn_blas_build_identity(char *out, size_t cap)
{
    void (*sgemm)(void) = (void (*)(void))cblas_sgemm; /* an address inside the library */
    uintptr_t addr;
    memcpy(&addr, &sgemm, sizeof addr);
    td_build_identity(addr, out, cap);
}
