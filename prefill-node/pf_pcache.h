/* pf_pcache.h: the on-disk cache of stage profiles, so that a restarted stage 0 re-uses
 * the cost model it measured last time instead of profiling for ~20 s again.
 *
 * Purpose: a profile (pf_profile_result) is a function of the stage's work and of the
 * machine; the key names everything it depends on, one field per line (pf_pcache_key.desc):
 *   model    a 64-bit FNV-1a hash of what shapes the forward: the file size, the
 *            hyper-parameters (kn_hparams) and the tensor table (name, type, dims of every
 *            tensor). The weights' values do not change a forward's time, so a copied,
 *            moved or touched file keeps its profile, while another quantization or model
 *            gets its own. Path and mtime are deliberately not in it.
 *   layers   the stage's layer range [l0, l1) of n_layer (pp and layer_partition matter
 *            only through it; first / last stage follow from it)
 *   threads  compute threads of the stage's backend
 *   kv       KV dtype and block size (attention reads the KV pool)
 *   profile  the resolved profile parameters (chunk size, longest length, lengths, reps,
 *            budget, seed): they decide which lengths are timed
 *   build    the GNU build id of the running executable (the kernels are linked into it,
 *            so it changes with their code, the compiler and its flags) and of the shared
 *            object that holds cblas_sgemm (OpenBLAS); without a build id note, the file's
 *            path, size and mtime
 *   cpu      /proc/cpuinfo's first "model name", online CPUs and CPUs this process may use
 * The file name is stage-<hash of desc>.profile; the file repeats desc and is used only
 * when it matches byte for byte, so a hash collision cannot hand out a wrong profile.
 * Location: $TANDEM_CACHE/profiles, else $HOME/.cache/tandem/profiles.
 * File (text): "tandem stage profile 1", the desc lines, "--", "elapsed_ms X",
 * "budget_hit 0|1", "points N", N lines "LEN MS RUNS" (ascending LEN, MS a median in ms
 * printed with 17 digits so it reads back exactly), "end SUM" with SUM the FNV-1a of every
 * byte before that line. The fit is recomputed from the points on load
 * (pf_fit_quadratic), so the file holds only data.
 * Invariants: a file is written to a temporary name in the same directory and renamed,
 * so a reader sees a whole file or none; anything that does not parse exactly (torn,
 * edited, another version, another key) is refused with TD_EFORMAT and a reason, never
 * trusted in part.
 * Threading: no shared state; safe from any thread. Several processes may write the same
 * file at once (the last rename wins; each file is whole).
 */
#ifndef PF_PCACHE_H
#define PF_PCACHE_H

#include <stddef.h>
#include <stdint.h>

#include "pf_profile.h"

#define PF_PCACHE_DESC_MAX 1024

typedef struct {
    char desc[PF_PCACHE_DESC_MAX]; /* key lines, each ending in '\n' */
    uint64_t hash;                 /* FNV-1a of desc: the file name */
} pf_pcache_key;

/* Build the key of shard r's stage with parameters p. Returns 0, or TD_ERANGE if
 * the description does not fit (a pathological CPU name), TD_EIO if the model file cannot
 * be stat'ed. */
int pf_pcache_key_make(const pf_shard *r, const char *model_path, const pf_profile_params *p,
                       pf_pcache_key *k);

/* The cache directory: $TANDEM_CACHE/profiles, else $HOME/.cache/tandem/profiles.
 * Returns 0, or TD_ENOENT when neither variable is set, TD_ERANGE if it does not fit. */
int pf_pcache_dir(char *buf, size_t cap);

/* dir/stage-<hash>.profile. Returns 0 or TD_ERANGE. */
int pf_pcache_path(const char *dir, const pf_pcache_key *k, char *buf, size_t cap);

/* Load the profile at path if it was stored under key k: fills out (points, elapsed_ms,
 * budget_hit, and the fit recomputed). Returns 0; TD_ENOENT if there is no such file;
 * TD_EIO if it cannot be read; TD_EFORMAT if it is not a whole profile of this key (why
 * holds the reason: "line 9: bad point", "another key", ...). Nothing is logged. */
int pf_pcache_load(const char *path, const pf_pcache_key *k, pf_profile_result *out, char *why,
                   size_t why_cap);

/* Store res under key k at path (parent directories created), atomically: a temporary
 * file in the same directory, written, fsync'ed, then renamed over path. Returns 0, or
 * TD_EIO (why says what failed; the temporary file is removed), TD_EINVAL for a result
 * without points. */
int pf_pcache_store(const char *path, const pf_pcache_key *k, const pf_profile_result *res,
                    char *why, size_t why_cap);

#endif
