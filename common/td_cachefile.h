/* td_cachefile.h: what Tandem's small on-disk caches share: the identity of what a cached
 * result depends on (hashes, build ids, the CPU's name), where the caches live, and whole-file
 * read / atomic write.
 *
 * Purpose: a measured result (a prefill stage's profile, pf_pcache.h; a model's activation
 * mode, kernels/act_check.h) is kept so that the next start skips the measurement; each is
 * valid only for what it was measured on, so its key names the model, the build and the
 * machine, and a file is trusted only whole.
 * Invariants: td_cache_write makes a temporary file in the same directory and renames it,
 * so a reader sees a whole file or none (several processes may write at once: the last
 * rename wins).
 * Threading: no shared state.
 */
#ifndef TD_CACHEFILE_H
#define TD_CACHEFILE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "gguf.h"

/* 64-bit FNV-1a */
#define TD_FNV_OFFSET 0xcbf29ce484222325ull
#define TD_FNV_PRIME  0x100000001b3ull

static inline uint64_t td_fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * TD_FNV_PRIME;
    return h;
}
static inline uint64_t td_fnv_i64(uint64_t h, int64_t v)
{
    return td_fnv(h, &v, sizeof v);
}
static inline uint64_t td_fnv_f32(uint64_t h, float v)
{
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return td_fnv(h, &bits, sizeof bits);
}

/* Bytes td_build_identity writes at most (a path, size and mtime without a build id). */
#define TD_BUILD_IDENTITY_MAX 640

/* Hex GNU build id of the object that maps addr (0: the executable; the address of
 * cblas_sgemm: OpenBLAS); else, for the executable, its path, size and mtime (a build
 * without --build-id), or "unknown". */
void td_build_identity(uintptr_t addr, char *out, size_t cap);
/* h extended by a GGUF's tensor table (every tensor's name, type and dimensions): what
 * shapes a model's compute, not its weights' values. */
uint64_t td_fnv_gguf_tensors(uint64_t h, const td_gguf *g);

/* /proc/cpuinfo's first "model name" (printable ASCII), or "unknown". */
void td_cpu_model_name(char *out, size_t cap);

/* $TANDEM_CACHE/SUB, else $HOME/.cache/tandem/SUB, into buf. TD_ENOENT (neither is set),
 * TD_ERANGE. */
int td_cache_dir(const char *sub, char *buf, size_t cap);

/* The whole regular file at path, NUL-terminated, into a malloc'd *text (*len bytes, no NUL
 * inside). TD_ENOENT (no such file), TD_EFORMAT (not a regular file, over max bytes, a NUL
 * byte), TD_EIO, TD_ENOMEM; a reason in why except for TD_ENOENT. */
int td_cache_read(const char *path, size_t max, char **text, size_t *len, char *why,
                  size_t why_cap);
/* len bytes of b into path, atomically (temporary file, fsync, rename; parent directories
 * made). TD_EIO or TD_ERANGE with a reason in why. */
int td_cache_write(const char *path, const char *b, size_t len, char *why, size_t why_cap);

/* An exclusive lock on PATH.lock (made with its directories when missing), for the one
 * process that measures what others then read: blocks while another holds it. Returns the
 * descriptor to close(2) when done (the lock goes with it), or -1 (errno set) when the
 * file cannot be made: go on unlocked. */
int td_cache_lock(const char *path);

#endif
