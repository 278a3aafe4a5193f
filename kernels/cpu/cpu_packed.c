/* cpu_packed.c: the weights the engine handed to map_matrix, and the copies the q8 mode
 * packs of them (cpu_q8act.h, kn_q8_pack: the 32-block GEMM's, the K-quant dot's; the q16
 * mode's dots read the 32-block copies too, cpu_q16act.h).
 *
 * Purpose: a model's weight matrices stay read-only and alive for the engine's life, which
 * the backend's ends with (kn_runtime destroys the engine, then the backend, then the
 * model), so a copy made from one remains valid until kn_cpu_destroy. Only registered
 * matrices are packed: a product over memory nobody registered (tests, tools, scratch) keeps
 * packing per call, so a freed and reused address can never find a stale copy.
 * The copy is made on the first q8 or q16 product over the matrix (in the float32 mode it
 * would go unused), with the pool; it costs the matrix's own size once more (the default model:
 * 96.6 MB). An allocation that fails is logged once and that matrix packs per call.
 * Memory: the copies lie end to end in arenas of transparent huge pages (an anonymous
 * mapping sized for every registered matrix not packed yet, MADV_HUGEPAGE; touched only as
 * copies are made). A batch-1 decode step streams every copy once: on 4 KiB pages that is a
 * page walk per 4 KiB read, and the hardware prefetchers stop at each page's end.
 * TANDEM_CPU_HUGEPAGES=0 leaves the pages to the kernel's default (for measurements).
 * Threading: the caller's thread only (kn_cpu's one-caller rule), outside pool jobs.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cpu_backend.h"
#include "cpu_internal.h"
#include "cpu_q8act.h"
#include "td_err.h"

#define ARENA_ALIGN ((size_t)2 << 20) /* a huge page */

struct kn_cpu_arena {
    uint8_t *base;
    size_t cap, used;
    kn_cpu_arena *next;
};

struct kn_cpu_packed {
    kn_mat w;   /* as registered (data is the key) */
    void *copy; /* packed groups, or NULL */
    bool tried; /* packing was attempted (copy NULL: W cannot be packed, or no memory) */
};

static size_t slot_of(const void *data, size_t cap)
{
    uintptr_t h = (uintptr_t)data;
    h ^= h >> 17;
    h *= 0x9e3779b97f4a7c15ull;
    return (size_t)(h >> 20) & (cap - 1);
}

static bool same(const kn_mat *a, const kn_mat *b)
{
    return a->data == b->data && a->type == b->type && a->n_rows == b->n_rows &&
           a->n_cols == b->n_cols && a->row_stride == b->row_stride;
}

static kn_cpu_packed *find(kn_cpu *c, const kn_mat *w)
{
    if (!c->cap_packed) return NULL;
    for (size_t i = slot_of(w->data, c->cap_packed);; i = (i + 1) & (c->cap_packed - 1)) {
        kn_cpu_packed *e = &c->packed[i];
        if (!e->w.data) return NULL;
        if (same(&e->w, w)) return e;
    }
}

static int grow(kn_cpu *c)
{
    size_t cap = c->cap_packed ? 2 * c->cap_packed : 256;
    kn_cpu_packed *t = calloc(cap, sizeof *t);
    if (!t) return TD_ENOMEM;
    for (size_t i = 0; i < c->cap_packed; i++) {
        if (!c->packed[i].w.data) continue;
        size_t j = slot_of(c->packed[i].w.data, cap);
        while (t[j].w.data)
            j = (j + 1) & (cap - 1);
        t[j] = c->packed[i];
    }
    free(c->packed);
    c->packed = t;
    c->cap_packed = cap;
    return 0;
}

int kn_cpu_map_matrix(void *ctx, const kn_mat *w)
{
    kn_cpu *c = ctx;
    if (!w || !w->data || w->n_rows < 1 || find(c, w)) return 0;
    if (2 * (c->n_packed + 1) > c->cap_packed && grow(c)) {
        TD_LOG_WARN("cpu backend: out of memory registering a weight matrix: its q8 products "
                    "pack it per call");
        return 0; /* a hint: the product works without it */
    }
    size_t i = slot_of(w->data, c->cap_packed);
    while (c->packed[i].w.data)
        i = (i + 1) & (c->cap_packed - 1);
    c->packed[i] = (kn_cpu_packed){.w = *w};
    c->n_packed++;
    return 0;
}

size_t kn_cpu_mapped_kinds(const kn_cpu *c, kn_mat *out, size_t cap)
{
    size_t n = 0;
    for (size_t i = 0; i < c->cap_packed; i++) {
        const kn_mat *w = &c->packed[i].w;
        if (!w->data) continue;
        size_t k = 0;
        while (k < n && out[k].type != w->type)
            k++;
        if (k == n && n < cap) out[n++] = *w;
    }
    return n;
}

typedef struct {
    const kn_mat *w;
    void *copy;
} pack_job;

static void pack_part(void *arg, int64_t g0, int64_t g1, int tid)
{
    (void)tid;
    const pack_job *j = arg;
    kn_q8_pack(j->w, j->copy, g0, g1);
}

static bool huge_pages_wanted(void)
{
    const char *env = getenv("TANDEM_CPU_HUGEPAGES");
    return !(env && strcmp(env, "0") == 0);
}

/* bytes (a multiple of 64) for a copy: from the newest arena, or a new one sized for every
 * registered matrix still unpacked (the first copy's arena holds the model's). NULL if no
 * memory. */
static void *arena_alloc(kn_cpu *c, size_t bytes)
{
    kn_cpu_arena *a = c->arenas;
    if (!a || a->cap - a->used < bytes) {
        size_t want = 0; /* the matrix asking is one of the untried */
        for (size_t i = 0; i < c->cap_packed; i++) {
            const kn_cpu_packed *e = &c->packed[i];
            if (e->w.data && !e->tried) want += (kn_q8_packed_bytes(&e->w) + 63) & ~(size_t)63;
        }
        if (want < bytes) want = bytes;
        want = (want + ARENA_ALIGN - 1) & ~(ARENA_ALIGN - 1);
        a = calloc(1, sizeof *a);
        if (!a) return NULL;
        /* MAP_NORESERVE: pages are committed as copies fill them (some may never be made) */
        void *p = mmap(NULL, want + ARENA_ALIGN, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            free(a);
            return NULL;
        }
        /* the base on a huge page boundary, the slack before and after it returned */
        uintptr_t u = (uintptr_t)p, b = (u + ARENA_ALIGN - 1) & ~(uintptr_t)(ARENA_ALIGN - 1);
        if (b > u) munmap(p, b - u);
        munmap((void *)(b + want), ARENA_ALIGN - (b - u));
        a->base = (uint8_t *)b;
        a->cap = want;
        /* a hint: where the kernel has no huge pages the copies work on small ones */
        if (huge_pages_wanted()) (void)madvise(a->base, a->cap, MADV_HUGEPAGE);
        a->next = c->arenas;
        c->arenas = a;
    }
    void *p = a->base + a->used;
    a->used += bytes;
    return p;
}

const void *kn_cpu_packed_of(kn_cpu *c, const kn_mat *w)
{
    kn_cpu_packed *e = find(c, w);
    if (!e) return NULL;
    if (e->tried) return e->copy;
    const size_t bytes = kn_q8_packed_bytes(w);
    void *copy = bytes ? arena_alloc(c, (bytes + 63) & ~(size_t)63) : NULL;
    e->tried = true; /* after arena_alloc, which sizes a new arena by the untried ones */
    if (!bytes) return NULL;
    if (!copy) {
        if (!c->packed_oom)
            TD_LOG_WARN("cpu backend: no memory for a packed copy of a weight matrix (%zu "
                        "bytes): its q8 products pack it per call",
                        bytes);
        c->packed_oom = true;
        return NULL;
    }
    pack_job j = {.w = w, .copy = copy};
    kn_pool_run(c->pool, (w->n_rows + 15) / 16, 8, pack_part, &j);
    e->copy = copy;
    c->packed_bytes += bytes;
    return copy;
}

size_t kn_cpu_packed_bytes(const kn_cpu *c)
{
    return c->packed_bytes;
}

void kn_cpu_packed_free(kn_cpu *c)
{
    while (c->arenas) {
        kn_cpu_arena *a = c->arenas;
        c->arenas = a->next;
        munmap(a->base, a->cap);
        free(a);
    }
    free(c->packed);
    c->packed = NULL;
    c->cap_packed = c->n_packed = c->packed_bytes = 0;
}
