/* cpu_internal.h: the kn_cpu struct, shared by the CPU backend's files only. */
#ifndef KN_CPU_INTERNAL_H
#define KN_CPU_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>

#include "cpu_backend.h"

#define KN_CPU_MAX_THREADS 256
/* The scratch slot of the thread that calls an op, for use outside pool jobs. */
#define KN_CPU_CALLER KN_CPU_MAX_THREADS

typedef struct kn_cpu_packed kn_cpu_packed;
typedef struct kn_cpu_arena kn_cpu_arena;

struct kn_cpu {
    kn_pool *pool;
    int n_threads;
    bool act_q8;  /* quantize x to 8 bits on the dot path (kn_cpu_set_act: KN_CPU_ACT_Q8) */
    bool act_q16; /* to 16 bits, 32-block weights' dot path only (KN_CPU_ACT_Q16); never
                     both */
    bool fused;   /* the ops table carries the fused ops (TANDEM_CPU_FUSED) */
    float *scratch[KN_CPU_MAX_THREADS + 1];     /* per-thread float scratch, grown on demand;
                                                   the last slot is KN_CPU_CALLER's */
    size_t scratch_cap[KN_CPU_MAX_THREADS + 1]; /* floats */
    /* the matrices map_matrix registered, and their packed copies (cpu_packed.c) */
    kn_cpu_packed *packed; /* open addressing on w->data, cap_packed a power of 2 */
    size_t n_packed, cap_packed, packed_bytes;
    kn_cpu_arena *arenas; /* the copies' memory (cpu_packed.c), newest first */
    bool packed_oom;      /* a packed copy could not be allocated (logged once) */
};

/* Up to cap of the matrices map_matrix registered, one per weight type, into out; returns
 * how many (cpu_packed.c). */
size_t kn_cpu_mapped_kinds(const kn_cpu *c, kn_mat *out, size_t cap);
/* The q8 mode's packed copy of w (kn_q8_pack; made on the first call, cpu_packed.c; the q16
 * dots read it for 32-block types), or NULL when w was
 * never registered with kn_cpu_map_matrix, cannot be packed, or its copy found no memory.
 * On the caller's thread, outside pool jobs. */
const void *kn_cpu_packed_of(kn_cpu *c, const kn_mat *w);
void kn_cpu_packed_free(kn_cpu *c);

/* Per-thread scratch of at least n_floats, 64-byte aligned; valid until the next call
 * with the same tid. NULL on allocation failure. Called from inside pool jobs: thread tid
 * only touches its own slot; tid KN_CPU_CALLER is the calling thread's, outside jobs. */
float *kn_cpu_scratch(kn_cpu *c, int tid, size_t n_floats);

/* The dot path of matmul (cpu_matmul.c) in pieces, for fused ops (cpu_fused.c): a product
 * y (m, w->n_rows) = x (m, w->n_cols) W^T whose rows of W any thread may compute, any
 * subset at a time, with the bits of kn_cpu_matmul_mixed. */
typedef struct {
    kn_cpu *c;
    const kn_mat *w;
    const float *x;     /* (m, n_cols) */
    const float *xsum;  /* block sums of x, in the caller's side buffer, or NULL */
    const void *xq;     /* x in 8 bits (q8 mode), in the side buffer, or NULL */
    const void *xq16;   /* x in 16 bits (q16 mode), in the side buffer, or NULL */
    const void *packed; /* W packed by the q8 mode (cpu_packed.c; the q16 dots read it too):
                           rows go through it */
    int64_t m;
    float *y;  /* (m, n_rows) */
    int grain; /* kn_cpu_dot_rows takes row ranges on multiples of this (1, or the packed
                  copy's 16-row groups) */
} kn_cpu_dot;
/* Floats of side buffer kn_cpu_dot_init needs for w and m rows of x (0: none). */
size_t kn_cpu_dot_side_floats(const kn_cpu *c, const kn_mat *w, int64_t m);
/* Prepares d (fills side, kn_cpu_dot_side_floats(c, w, m) floats): 0; 1 when matmul_mixed
 * would send rows [m_solo, m) to the gemm path, or the q8 mode these rows to the integer
 * GEMM through a per-call panel (W not packed, or m > 4: the caller must use matmul_mixed
 * instead); a negative TD_ error for a bad w or row count (logged). A packed W at m <= 4
 * runs the GEMM's panel-free kernel in kn_cpu_dot_rows (d->grain 16). */
int kn_cpu_dot_init(kn_cpu *c, const kn_mat *w, const float *x, int64_t m, int64_t m_solo,
                    float *side, float *y, kn_cpu_dot *d);
/* Rows [r0, r1) of W into d->y: from any thread, in a pool part. r0 a multiple of d->grain,
 * r1 one too or w->n_rows. */
void kn_cpu_dot_rows(const kn_cpu_dot *d, int64_t r0, int64_t r1);

/* The element loops of swiglu and geglu (cpu_ops.c) over the flat element range [e0, e1) of
 * gate, up and out. kn_cpu_swiglu runs the span over whole rows; an element gets the same
 * bits from any two spans that both send it through the 8-wide SIMD loop (both of length a
 * multiple of 8) or both through the scalar tail. geglu is scalar: any spans agree. */
void kn_cpu_swiglu_span(const float *g, const float *u, float *o, int64_t e0, int64_t e1);
void kn_cpu_geglu_span(const float *g, const float *u, float *o, int64_t e0, int64_t e1);

#endif
