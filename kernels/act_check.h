/* act_check.h: the CPU activation mode chosen per model by a measured check (cpu_act: auto).
 *
 * Purpose: the q8 mode (cpu_backend.h, kn_cpu_set_act) runs the products in integer
 * arithmetic on activations rounded to 8 bits, 1.5-4x faster than float32; some models
 * keep their answers under that rounding (Qwen2.5-Coder 0.5B and 1.5B answer the quick
 * start's question as in float32), others do not (SmolLM2-135M answers it wrongly, as
 * llama.cpp does on the same file). The q16 mode rounds them to 16 bits on the dot path
 * of 32-block weights (decode rows; prompt rows too without AMX-BF16), slower than q8 and faster
 * than float32, with a rounding ~250x smaller. Which modes a model tolerates cannot be read off its
 * file, so it is measured: a fixed set of chat prompts, greedy, in float32 and q8 on the whole
 * model, then (when q8 differs) in q16; the first of q8, q16 whose every prompt's first
 * KN_ACT_CHECK_TOKENS tokens are float32's is chosen, else f32. The verdict is cached
 * ($TANDEM_CACHE/act, else ~/.cache/tandem/act), keyed on what it depends on: the model's shape
 * (file size, tensor table), the build of the executable and of OpenBLAS, the BLAS core, the
 * kernels' ISA, the CPU's name and the check itself; so the processes of one executable (a
 * cluster's prefill stages, its decode ranks) read the same verdict, and only the first start of
 * each executable on a machine and build pays for the check (the default model: about 5 s on 2
 * cores, q16 included). Processes that start together take turns on a lock file: one measures, the
 * others read its verdict. The cost grows with the model: 2 x 8 prompts of ~30 tokens and 16 greedy
 * steps each on the whole model in one process (its weights mapped, not copied), 3 x 8 when q8
 * differs; seconds for the 0.5B-1.5B models here, minutes for a 7B one on 2 cores; a model too
 * large for one machine cannot be checked (pin f32, q8 or q16 then). Threading: any thread; the
 * check creates its own backend (n_threads) and model runtime.
 */
#ifndef KN_ACT_CHECK_H
#define KN_ACT_CHECK_H

#include <stdbool.h>

#include "kn_runtime.h"

#define KN_ACT_CHECK_TOKENS 16 /* greedy tokens compared per prompt */

/* One mode's tokens against float32's. */
typedef struct {
    bool measured;     /* compared (q16 only when q8 differs) */
    int agree_prompts; /* prompts whose KN_ACT_CHECK_TOKENS tokens agree */
    double agreement;  /* mean over the prompts of the agreeing prefix / the tokens */
    int first_diff;    /* the first prompt that differs (-1: none) */
} kn_act_agreement;

typedef struct {
    const char *act;      /* the verdict: "q8", "q16" or "f32" (a static string) */
    int n_prompts;        /* prompts in the check */
    kn_act_agreement q8;  /* q8 against float32 */
    kn_act_agreement q16; /* q16 against float32 (when q8 differs) */
    bool cached;          /* read from the cache (else measured now) */
    double check_ms;      /* time the measurement took (when it was measured) */
    char path[512];       /* the cache file ("" when there is no cache directory) */
} kn_act_verdict;

/* The verdict for the model at model_path, from the cache or measured now with a CPU backend
 * of n_threads (<= 0: all cores) and stored. who prefixes the log lines. 0, or the error of
 * opening or running the model (logged); a cache that cannot be read or written is logged
 * and the check measured again. */
int kn_act_choose(const char *model_path, int n_threads, const char *who, kn_act_verdict *out);

/* "q8", "q16" or "f32" for a cpu_act value: "auto" resolved by kn_act_choose, the others as they
 * are (NULL stays NULL: TANDEM_CPU_ACT decides, which may say "auto" too). On an error
 * *out is NULL and the error is returned. */
int kn_act_resolve(const char *cpu_act, const char *model_path, int n_threads, const char *who,
                   const char **out);

/* kn_runtime_open with the CPU backends' cpu_act "auto" (or NULL with TANDEM_CPU_ACT=auto)
 * resolved first for p->model_path: what every process that serves a model opens it with. */
int kn_act_runtime_open(kn_runtime *rt, const kn_runtime_params *p);

#endif
