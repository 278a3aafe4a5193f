/* test_attention.c: the CPU backend's paged kv_write and attention against a float64
 * softmax attention over contiguous K/V.
 *
 * Each case builds a pool whose blocks are handed to the sequences in a random order,
 * writes K/V in batches that interleave sequences (chunked prefill, then single-token
 * decode steps), and after every batch checks the batch's attention output. Sequences
 * carry V values offset by 10 * (sequence + 1), so a token that saw another sequence's
 * keys would be off by several units, far beyond the tolerance.
 * `test_attention bench` prints timings instead of testing.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "kn_test_util.h"
#include "tharness.h"

static uint64_t rng = 0x2545f4914f6cdd1dull;

static const int seq_lens[] = {1, 15, 16, 17, 100, 600};
#define N_SEQ ((int)(sizeof seq_lens / sizeof seq_lens[0]))

typedef struct {
    int block_size, n_heads, n_kv_heads, head_dim;
    td_dtype kv_type;
    /* q head h reads KV head (phase + h) / group (common/td_tp.h); group 0: the unsplit
     * mapping, n_heads / n_kv_heads and phase 0 */
    int group, phase;
} att_case;

static int case_group(const att_case *c)
{
    return c->group ? c->group : c->n_heads / c->n_kv_heads;
}

typedef struct {
    att_case c;
    int n_blocks;
    int32_t *tables[N_SEQ];         /* (ceil(len / block_size)) block ids */
    float *k[N_SEQ], *v[N_SEQ];     /* (len, n_kv_heads, head_dim), as the kernel will read them */
    float *kin[N_SEQ], *vin[N_SEQ]; /* (len, n_kv_heads, head_dim) as written */
    float *q[N_SEQ];                /* (len, n_heads, head_dim) */
    float *ref[N_SEQ];              /* (len, n_heads, head_dim) float64 attention, rounded */
    void *kpool, *vpool;
} fixture;

static float round_kv(td_dtype t, float x)
{
    return t == TD_F16 ? td_fp16_to_fp32(td_fp32_to_fp16(x)) : x;
}

static void fixture_init(fixture *F, att_case c)
{
    memset(F, 0, sizeof *F);
    F->c = c;
    const int bs = c.block_size, hd = c.head_dim, nkv = c.n_kv_heads, nh = c.n_heads;
    for (int s = 0; s < N_SEQ; s++)
        F->n_blocks += (seq_lens[s] + bs - 1) / bs;
    F->n_blocks += 3; /* unused blocks, so not every id is taken */
    int32_t *perm = malloc(sizeof(int32_t) * F->n_blocks);
    for (int i = 0; i < F->n_blocks; i++)
        perm[i] = i;
    for (int i = F->n_blocks - 1; i > 0; i--) {
        int j = (int)(kt_unit(&rng) * (i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    const size_t esz = c.kv_type == TD_F16 ? 2 : 4;
    const size_t pool_elems = (size_t)F->n_blocks * nkv * bs * hd;
    F->kpool = malloc(pool_elems * esz);
    F->vpool = malloc(pool_elems * esz);
    memset(F->kpool, 0xff, pool_elems * esz); /* nan everywhere not written */
    memset(F->vpool, 0xff, pool_elems * esz);
    int next = 0;
    const float scale = 1.0f / sqrtf((float)hd);
    for (int s = 0; s < N_SEQ; s++) {
        const int len = seq_lens[s], nb = (len + bs - 1) / bs;
        F->tables[s] = malloc(sizeof(int32_t) * nb);
        for (int b = 0; b < nb; b++)
            F->tables[s][b] = perm[next++];
        const size_t kvn = (size_t)len * nkv * hd, qn = (size_t)len * nh * hd;
        F->k[s] = malloc(sizeof(float) * kvn);
        F->v[s] = malloc(sizeof(float) * kvn);
        F->kin[s] = malloc(sizeof(float) * kvn);
        F->vin[s] = malloc(sizeof(float) * kvn);
        F->q[s] = malloc(sizeof(float) * qn);
        F->ref[s] = malloc(sizeof(float) * qn);
        const float off = 10.0f * (float)(s + 1);
        for (size_t i = 0; i < kvn; i++) {
            F->kin[s][i] = kt_frand(&rng, -1, 1);
            F->vin[s][i] = off + kt_frand(&rng, -1, 1);
            F->k[s][i] = round_kv(c.kv_type, F->kin[s][i]);
            F->v[s][i] = round_kv(c.kv_type, F->vin[s][i]);
        }
        /* large q so the softmax is peaked, not a plain mean */
        for (size_t i = 0; i < qn; i++)
            F->q[s][i] = kt_frand(&rng, -4, 4);
        double *w = malloc(sizeof(double) * len);
        for (int p = 0; p < len; p++)
            for (int h = 0; h < nh; h++) {
                const int g = (c.phase + h) / case_group(&c);
                const float *qr = F->q[s] + ((size_t)p * nh + h) * hd;
                double mx = -INFINITY, sum = 0;
                for (int j = 0; j <= p; j++) {
                    const float *kr = F->k[s] + ((size_t)j * nkv + g) * hd;
                    double d = 0;
                    for (int e = 0; e < hd; e++)
                        d += (double)qr[e] * kr[e];
                    w[j] = d * scale;
                    mx = w[j] > mx ? w[j] : mx;
                }
                for (int j = 0; j <= p; j++)
                    sum += w[j] = exp(w[j] - mx);
                for (int e = 0; e < hd; e++) {
                    double o = 0;
                    for (int j = 0; j <= p; j++)
                        o += w[j] * F->v[s][((size_t)j * nkv + g) * hd + e];
                    F->ref[s][((size_t)p * nh + h) * hd + e] = (float)(o / sum);
                }
            }
        free(w);
    }
    free(perm);
}

static void fixture_fini(fixture *F)
{
    for (int s = 0; s < N_SEQ; s++) {
        free(F->tables[s]);
        free(F->k[s]);
        free(F->v[s]);
        free(F->kin[s]);
        free(F->vin[s]);
        free(F->q[s]);
        free(F->ref[s]);
    }
    free(F->kpool);
    free(F->vpool);
}

/* One batch: tokens of several sequences, written then attended. */
typedef struct {
    int64_t m;
    int32_t *pos, *seq_of; /* (m) */
    float *k, *v;          /* (m, n_kv_heads, head_dim) */
    float *q, *out;        /* (m, n_heads, head_dim) */
} batch;

/* Whether pool element `at` holds x as kv_write must store it (f16: rounded to nearest
 * even like td_fp32_to_fp16; f32: bit for bit). */
static bool pool_holds(const void *pool, td_dtype t, size_t at, float x)
{
    if (t == TD_F16) {
        uint16_t h;
        memcpy(&h, (const char *)pool + at * 2, 2);
        return h == td_fp32_to_fp16(x);
    }
    float f;
    memcpy(&f, (const char *)pool + at * 4, 4);
    return memcmp(&f, &x, 4) == 0;
}

/* Runs the whole write/attend schedule on c; returns the worst error relative to
 * (1 + |ref|), and counts pool layout mismatches. */
static double run_schedule(fixture *F, kn_cpu *c, int *layout_bad)
{
    const att_case C = F->c;
    const int hd = C.head_dim, nkv = C.n_kv_heads, nh = C.n_heads, bs = C.block_size;
    int done[N_SEQ] = {0};
    kn_seq_view views[N_SEQ];
    double worst = 0;
    int total = 0;
    for (int s = 0; s < N_SEQ; s++)
        total += seq_lens[s];
    batch B;
    B.pos = malloc(sizeof(int32_t) * total);
    B.seq_of = malloc(sizeof(int32_t) * total);
    B.k = malloc(sizeof(float) * (size_t)total * nkv * hd);
    B.v = malloc(sizeof(float) * (size_t)total * nkv * hd);
    B.q = malloc(sizeof(float) * (size_t)total * nh * hd);
    B.out = malloc(sizeof(float) * (size_t)total * nh * hd);
    for (int left = total; left > 0;) {
        /* each unfinished sequence contributes a chunk: up to 70 tokens while more than 4
         * remain (prefill), then one token per step (decode); sequences enter in a
         * rotating order so batches interleave them differently */
        B.m = 0;
        const int first = (int)(kt_unit(&rng) * N_SEQ);
        for (int k = 0; k < N_SEQ; k++) {
            const int s = (first + k) % N_SEQ, rem = seq_lens[s] - done[s];
            if (rem == 0 || kt_unit(&rng) < 0.2) continue;
            int n = rem > 4 ? 1 + (int)(kt_unit(&rng) * (rem - 4 < 70 ? rem - 4 : 70)) : 1;
            for (int t = 0; t < n; t++) {
                const int64_t i = B.m++;
                const int p = done[s] + t;
                B.pos[i] = p;
                B.seq_of[i] = s;
                memcpy(B.k + i * nkv * hd, F->kin[s] + (size_t)p * nkv * hd,
                       sizeof(float) * nkv * hd);
                memcpy(B.v + i * nkv * hd, F->vin[s] + (size_t)p * nkv * hd,
                       sizeof(float) * nkv * hd);
                memcpy(B.q + i * nh * hd, F->q[s] + (size_t)p * nh * hd, sizeof(float) * nh * hd);
            }
            done[s] += n;
            left -= n;
        }
        if (B.m == 0) continue;
        for (int s = 0; s < N_SEQ; s++)
            views[s] = (kn_seq_view){.block_table = F->tables[s], .n_ctx = done[s]};
        kn_cpu_kv_write(c, F->kpool, F->vpool, C.kv_type, bs, NULL, nkv, hd, B.k, B.v, B.m, B.pos,
                        B.seq_of, views);
        kn_cpu_attention(c, B.q, F->kpool, F->vpool, C.kv_type, bs, NULL, nh, nkv, case_group(&C),
                         C.phase, hd, 1.0f / sqrtf((float)hd), 0, 0.0f, B.m, 0, B.pos, B.seq_of,
                         views, B.out);
        for (int64_t i = 0; i < B.m; i++) {
            const int s = B.seq_of[i], p = B.pos[i];
            const float *ref = F->ref[s] + (size_t)p * nh * hd;
            for (int e = 0; e < nh * hd; e++) {
                double err = fabs(B.out[i * nh * hd + e] - ref[e]) / (1.0 + fabs(ref[e]));
                if (isnan(err) || err > worst) worst = err; /* nan sticks */
            }
            /* head-major layout: element (block, head, slot, d) */
            const int32_t blk = F->tables[s][p / bs];
            for (int h = 0; h < nkv; h++)
                for (int d = 0; d < hd; d++) {
                    const size_t at = (((size_t)blk * nkv + h) * bs + p % bs) * hd + d;
                    const size_t src = ((size_t)p * nkv + h) * hd + d;
                    *layout_bad += !pool_holds(F->kpool, C.kv_type, at, F->kin[s][src]);
                    *layout_bad += !pool_holds(F->vpool, C.kv_type, at, F->vin[s][src]);
                }
        }
    }
    free(B.pos);
    free(B.seq_of);
    free(B.k);
    free(B.v);
    free(B.q);
    free(B.out);
    return worst;
}

static void test_paged_attention(void)
{
    static const att_case cases[] = {
        {16, 4, 4, 32, TD_F32, 0, 0},
        {32, 4, 4, 64, TD_F16, 0, 0},
        {16, 9, 3, 64, TD_F32, 0, 0},
        {32, 9, 3, 64, TD_F16, 0, 0},
        {16, 8, 2, 64, TD_F16, 0, 0},
        {32, 12, 3, 32, TD_F32, 0, 0},
        {16, 16, 1, 32, TD_F32, 0, 0}, /* 16 q heads per KV head: two q-head chunks */
        /* TP ranks whose KV heads are shared with neighbours (td_tp.h): Qwen2.5 0.5B (14
         * heads, 2 KV heads) at tp 7, rank 3 (heads 6, 7 read KV heads 0, 1) and rank 0 */
        {16, 2, 2, 64, TD_F32, 7, 6},
        {32, 2, 1, 64, TD_F16, 7, 0},
        /* 12 heads over 6 KV heads at tp 4: rank 1 holds heads 3-5, KV heads 1-2 */
        {16, 3, 2, 32, TD_F32, 2, 1},
        /* groups of 12 entered at phase 4: each KV head's second q-head chunk is empty */
        {16, 16, 2, 32, TD_F32, 12, 4},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        fixture F;
        fixture_init(&F, cases[k]);
        for (int nt = 1; nt <= 3; nt++) {
            kn_cpu *c;
            TH_REQUIRE(kn_cpu_create(nt, &c) == 0);
            int bad = 0;
            double worst = run_schedule(&F, c, &bad);
            const att_case *C = &cases[k];
            TH_CHECKF(worst < 1e-5, "bs %d heads %d/%d hd %d %s threads %d: err %g", C->block_size,
                      C->n_heads, C->n_kv_heads, C->head_dim, C->kv_type == TD_F16 ? "f16" : "f32",
                      nt, worst);
            TH_CHECKF(bad == 0, "%d pool elements not where the layout puts them", bad);
            kn_cpu_destroy(c);
        }
        fixture_fini(&F);
    }
}

/* Attention of rows (s[i], p[i]) of F's sequences, whose KV is all written; rows [0, m_solo)
 * solo. out (m, n_heads, head_dim). */
static void attend_rows(const fixture *F, kn_cpu *c, int window, int m, int m_solo,
                        const int32_t *s, const int32_t *p, float *out)
{
    const att_case C = F->c;
    const int hd = C.head_dim, nh = C.n_heads;
    kn_seq_view views[N_SEQ];
    for (int k = 0; k < N_SEQ; k++)
        views[k] = (kn_seq_view){.block_table = F->tables[k], .n_ctx = seq_lens[k]};
    float *q = malloc(sizeof(float) * (size_t)m * nh * hd);
    for (int i = 0; i < m; i++)
        memcpy(q + (size_t)i * nh * hd, F->q[s[i]] + (size_t)p[i] * nh * hd,
               sizeof(float) * nh * hd);
    kn_cpu_attention(c, q, F->kpool, F->vpool, C.kv_type, C.block_size, NULL, nh, C.n_kv_heads,
                     case_group(&C), C.phase, hd, 1.0f / sqrtf((float)hd), window, 0.0f, m, m_solo,
                     p, s, views, out);
    free(q);
}

/* Solo rows are batch-invariant: each solo row's output is bit-identical to the same row
 * attended alone, whatever other solo and batch rows share the call (the decode node's
 * promise that a running request's tokens do not depend on its batch). Long rows are cut
 * across threads, so the old single-line cut fails this at 2+ threads. */
static void test_solo_rows_batch_invariant(void)
{
    static const att_case cases[] = {
        {16, 9, 3, 64, TD_F16, 0, 0},
        {16, 16, 1, 32, TD_F32, 0, 0},
        {32, 2, 1, 64, TD_F16, 7, 0},
    };
    enum { MAXM = 200 };
    int32_t s[MAXM], p[MAXM];
    float *out = malloc(sizeof(float) * MAXM * 16 * 64), *alone = malloc(sizeof(float) * 16 * 64);
    int old_differs = 0, checked = 0;
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        fixture F;
        fixture_init(&F, cases[k]);
        const att_case C = F.c;
        const int row = C.n_heads * C.head_dim;
        kn_cpu *c1;
        TH_REQUIRE(kn_cpu_create(1, &c1) == 0);
        for (int q = 0; q < N_SEQ; q++) { /* write every sequence's KV */
            int32_t *pos = malloc(sizeof(int32_t) * seq_lens[q]), *so = malloc(4 * seq_lens[q]);
            kn_seq_view v[N_SEQ] = {0};
            v[q] = (kn_seq_view){.block_table = F.tables[q], .n_ctx = seq_lens[q]};
            for (int i = 0; i < seq_lens[q]; i++)
                pos[i] = i, so[i] = q;
            kn_cpu_kv_write(c1, F.kpool, F.vpool, C.kv_type, C.block_size, NULL, C.n_kv_heads,
                            C.head_dim, F.kin[q], F.vin[q], seq_lens[q], pos, so, v);
            free(pos);
            free(so);
        }
        kn_cpu_destroy(c1);
        for (int nt = 1; nt <= 4; nt++) {
            kn_cpu *c;
            TH_REQUIRE(kn_cpu_create(nt, &c) == 0);
            for (int round = 0; round < 24; round++) {
                const int window = round % 4 == 3 ? 64 : 0;
                const int n_solo = 1 + (int)(kt_unit(&rng) * 8);
                const int n_batch = round % 3 == 0 ? 0 : 1 + (int)(kt_unit(&rng) * 120);
                for (int i = 0; i < n_solo + n_batch; i++) {
                    /* solo rows lean to the longest sequence: its rows are cut */
                    s[i] = kt_unit(&rng) < 0.5 ? N_SEQ - 1 : (int)(kt_unit(&rng) * N_SEQ);
                    p[i] = (int)(kt_unit(&rng) * seq_lens[s[i]]);
                    if (i < n_solo && kt_unit(&rng) < 0.5) p[i] = seq_lens[s[i]] - 1;
                }
                for (int pass = 0; pass < 2; pass++) { /* pass 1: the single-line cut */
                    const int m_solo = pass ? 0 : n_solo;
                    attend_rows(&F, c, window, n_solo + n_batch, m_solo, s, p, out);
                    for (int i = 0; i < n_solo; i++) {
                        attend_rows(&F, c, window, 1, 1, s + i, p + i, alone);
                        const bool same =
                            !memcmp(out + (size_t)i * row, alone, sizeof(float) * row);
                        if (pass) {
                            old_differs += !same;
                            continue;
                        }
                        checked++;
                        TH_CHECKF(same,
                                  "case %zu threads %d round %d: solo row %d (seq %d pos %d) "
                                  "differs from the row alone",
                                  k, nt, round, i, s[i], p[i]);
                        /* a lone row is the same whether called solo or not */
                        float *again = out + (size_t)(MAXM - 1) * row;
                        attend_rows(&F, c, window, 1, 0, s + i, p + i, again);
                        TH_CHECK(!memcmp(again, alone, sizeof(float) * row));
                    }
                    if (pass || window) continue;
                    for (int i = 0; i < n_solo + n_batch; i++) { /* and every row is right */
                        const float *ref = F.ref[s[i]] + (size_t)p[i] * row;
                        double worst = 0;
                        for (int e = 0; e < row; e++) {
                            double err =
                                fabs(out[(size_t)i * row + e] - ref[e]) / (1.0 + fabs(ref[e]));
                            if (isnan(err) || err > worst) worst = err;
                        }
                        TH_CHECKF(worst < 1e-5, "case %zu row %d: err %g", k, i, worst);
                    }
                }
            }
            kn_cpu_destroy(c);
        }
        fixture_fini(&F);
    }
    printf("solo rows: %d checked bit for bit; with one shared cut %d of them would differ\n",
           checked, old_differs);
    free(out);
    free(alone);
}

/* fp32 -> fp16 in kv_write rounds like td_fp32_to_fp16 at the awkward values: ties,
 * subnormals, overflow. */
static void test_kv_write_f16_rounding(void)
{
    enum { HD = 40 }; /* 5 SIMD groups, no tail, plus a tail run below */
    float k[HD + 3], v[HD + 3];
    const float special[] = {0.0f,
                             -0.0f,
                             1.0f + 1.0f / 2048,
                             1.0f + 3.0f / 2048,
                             65504.0f,
                             65520.0f,
                             70000.0f,
                             -1e9f,
                             5.96e-8f,
                             2.98e-8f,
                             1e-6f,
                             -3.0e-5f,
                             6.1035e-5f,
                             6.1e-5f,
                             0.1f,
                             1.0f / 3};
    for (int d = 0; d < HD + 3; d++) {
        k[d] = d < (int)(sizeof special / sizeof special[0]) ? special[d] : kt_frand(&rng, -5, 5);
        v[d] = -k[d];
    }
    for (int hd = HD; hd <= HD + 3; hd += 3) {
        uint16_t kp[2 * (HD + 3)], vp[2 * (HD + 3)]; /* 2 blocks of 1 head, block_size 1 */
        int32_t table[1] = {1}, pos[1] = {0}, seq_of[1] = {0};
        kn_seq_view view = {.block_table = table, .n_ctx = 1};
        kn_cpu *c;
        TH_REQUIRE(kn_cpu_create(1, &c) == 0);
        kn_cpu_kv_write(c, kp, vp, TD_F16, 1, NULL, 1, hd, k, v, 1, pos, seq_of, &view);
        int bad = 0;
        for (int d = 0; d < hd; d++)
            bad += kp[hd + d] != td_fp32_to_fp16(k[d]) || vp[hd + d] != td_fp32_to_fp16(v[d]);
        TH_CHECKF(bad == 0, "head_dim %d: %d values rounded differently", hd, bad);
        kn_cpu_destroy(c);
    }
}

/* kv_write into a latent pool (kv_pool.h KN_KV_LAYOUT_LATENT: vpool == kpool): K only is
 * written, once (v is not read: NULL here), the same bytes a K+V write puts in its K pool;
 * the attention reading V from those tiles equals one reading an identical V pool, bit for
 * bit. f32 and f16, several blocks and threads. */
static void test_kv_write_latent(void)
{
    enum { HD = 20, M = 37, BS = 8, NB = 6, NH = 4 };
    const size_t n = (size_t)NB * BS * HD;
    float k[M * HD], q[M * NH * HD], o1[M * NH * HD], o2[M * NH * HD];
    int32_t table[5] = {4, 0, 5, 2, 1}, pos[M], seq_of[M];
    for (int i = 0; i < M * HD; i++)
        k[i] = kt_frand(&rng, -2, 2);
    for (int i = 0; i < M * NH * HD; i++)
        q[i] = kt_frand(&rng, -1, 1);
    for (int i = 0; i < M; i++)
        pos[i] = i, seq_of[i] = 0;
    kn_seq_view view = {.block_table = table, .n_ctx = M};
    kn_cpu *c;
    TH_REQUIRE(kn_cpu_create(2, &c) == 0);
    for (int f = 0; f < 2; f++) {
        const td_dtype t = f ? TD_F16 : TD_F32;
        const size_t es = f ? 2 : 4;
        uint8_t *lp = calloc(n, es), *kp = calloc(n, es), *vp = calloc(n, es);
        kn_cpu_kv_write(c, lp, lp, t, BS, NULL, 1, HD, k, NULL, M, pos, seq_of, &view);
        kn_cpu_kv_write(c, kp, vp, t, BS, NULL, 1, HD, k, k, M, pos, seq_of, &view);
        TH_CHECK(!memcmp(lp, kp, n * es) && !memcmp(kp, vp, n * es));
        kn_cpu_attention(c, q, lp, lp, t, BS, NULL, NH, 1, NH, 0, HD, 0.2f, 0, 0.0f, M, 0, pos,
                         seq_of, &view, o1);
        kn_cpu_attention(c, q, kp, vp, t, BS, NULL, NH, 1, NH, 0, HD, 0.2f, 0, 0.0f, M, 0, pos,
                         seq_of, &view, o2);
        TH_CHECKF(!memcmp(o1, o2, sizeof o1), "%s: the latent pool's attention differs",
                  f ? "f16" : "f32");
        free(lp);
        free(kp);
        free(vp);
    }
    kn_cpu_destroy(c);
}

/* Soft-capped scores (gemma2; kn_backend.h attention's softcap): against a float64 attention
 * whose scores s = q.k * scale become cap * tanh(s / cap) before the softmax, with and
 * without a sliding window, f32 and f16 pools, two q heads per KV head, 1-3 threads, solo
 * rows (cut as if alone) and batch rows. The scores are large enough that many saturate
 * (|s| > cap; the share is printed), and the capped output must differ clearly from the
 * uncapped one. */
static void test_softcap(void)
{
    enum { HD = 64, NH = 4, NKV = 2, BS = 16, L = 150, NB = (L + BS - 1) / BS, SOLO = 5 };
    const float scale = 0.125f, cap = 1.5f;
    const size_t nkv = (size_t)L * NKV * HD, nq = (size_t)L * NH * HD;
    float *k = malloc(sizeof(float) * nkv), *v = malloc(sizeof(float) * nkv);
    float *q = malloc(sizeof(float) * nq), *out = malloc(sizeof(float) * nq);
    float *plain = malloc(sizeof(float) * nq);
    double *w = malloc(sizeof(double) * L);
    int32_t table[NB], pos[L], seq_of[L];
    for (int b = 0; b < NB; b++)
        table[b] = NB - 1 - b;
    for (int i = 0; i < L; i++)
        pos[i] = i, seq_of[i] = 0;
    for (size_t i = 0; i < nkv; i++) {
        k[i] = kt_frand(&rng, -1, 1);
        v[i] = kt_frand(&rng, -1, 1);
    }
    for (size_t i = 0; i < nq; i++)
        q[i] = kt_frand(&rng, -4, 4);
    kn_seq_view view = {.block_table = table, .n_ctx = L};
    long saturated = 0, scores = 0;
    for (int f = 0; f < 2; f++) {
        const td_dtype t = f ? TD_F16 : TD_F32;
        const size_t es = f ? 2 : 4, pool = (size_t)NB * NKV * BS * HD;
        void *kp = calloc(pool, es), *vp = calloc(pool, es);
        kn_cpu *c1;
        TH_REQUIRE(kn_cpu_create(1, &c1) == 0);
        kn_cpu_kv_write(c1, kp, vp, t, BS, NULL, NKV, HD, k, v, L, pos, seq_of, &view);
        kn_cpu_destroy(c1);
        for (int window = 0; window <= 40; window += 40) {
            double worst = 0, moved = 0;
            for (int nt = 1; nt <= 3; nt++) {
                kn_cpu *c;
                TH_REQUIRE(kn_cpu_create(nt, &c) == 0);
                kn_cpu_attention(c, q, kp, vp, t, BS, NULL, NH, NKV, NH / NKV, 0, HD, scale, window,
                                 cap, L, SOLO, pos, seq_of, &view, out);
                kn_cpu_attention(c, q, kp, vp, t, BS, NULL, NH, NKV, NH / NKV, 0, HD, scale, window,
                                 0.0f, L, SOLO, pos, seq_of, &view, plain);
                kn_cpu_destroy(c);
                for (int p = 0; p < L; p++)
                    for (int h = 0; h < NH; h++) {
                        const int g = h / (NH / NKV),
                                  lo = window && p >= window ? p - window + 1 : 0;
                        const float *qr = q + ((size_t)p * NH + h) * HD;
                        double mx = -INFINITY, sum = 0;
                        for (int j = lo; j <= p; j++) {
                            double d = 0;
                            for (int e = 0; e < HD; e++)
                                d += (double)qr[e] * round_kv(t, k[((size_t)j * NKV + g) * HD + e]);
                            d *= scale;
                            saturated += fabs(d) > cap;
                            scores++;
                            w[j] = cap * tanh(d / cap);
                            mx = w[j] > mx ? w[j] : mx;
                        }
                        for (int j = lo; j <= p; j++)
                            sum += w[j] = exp(w[j] - mx);
                        for (int e = 0; e < HD; e++) {
                            double o = 0;
                            for (int j = lo; j <= p; j++)
                                o += w[j] * round_kv(t, v[((size_t)j * NKV + g) * HD + e]);
                            o /= sum;
                            const size_t at = ((size_t)p * NH + h) * HD + e;
                            const double err = fabs(out[at] - o) / (1.0 + fabs(o));
                            if (isnan(err) || err > worst) worst = err;
                            if (fabs(plain[at] - o) > moved) moved = fabs(plain[at] - o);
                        }
                    }
            }
            TH_CHECKF(worst < 1e-5, "%s window %d: capped attention err %g", f ? "f16" : "f32",
                      window, worst);
            TH_CHECKF(moved > 0.1, "%s window %d: the cap moved the output by %g only",
                      f ? "f16" : "f32", window, moved);
        }
        free(kp);
        free(vp);
    }
    printf("softcap: %.0f%% of the scores past the cap\n", 100.0 * (double)saturated / scores);
    free(k);
    free(v);
    free(q);
    free(out);
    free(plain);
    free(w);
}

/* Attention time for one sequence of ctx positions, the last m of them queried; softcap > 0:
 * the scores soft-capped (gemma2). */
static void bench_one(kn_cpu *c, td_dtype t, int m, int ctx, int nh, int nkv, int hd, float softcap)
{
    const int bs = 16, nb = (ctx + bs - 1) / bs;
    const size_t esz = t == TD_F16 ? 2 : 4, pool = (size_t)nb * nkv * bs * hd;
    void *kp = calloc(pool, esz), *vp = calloc(pool, esz);
    float *k = malloc(sizeof(float) * (size_t)ctx * nkv * hd);
    float *v = malloc(sizeof(float) * (size_t)ctx * nkv * hd);
    float *q = malloc(sizeof(float) * (size_t)m * nh * hd);
    float *out = malloc(sizeof(float) * (size_t)m * nh * hd);
    int32_t *table = malloc(sizeof(int32_t) * nb), *pos = malloc(sizeof(int32_t) * ctx);
    int32_t *seq_of = calloc((size_t)ctx, sizeof(int32_t));
    for (int b = 0; b < nb; b++)
        table[b] = nb - 1 - b;
    for (int i = 0; i < ctx; i++)
        pos[i] = i;
    for (size_t i = 0; i < (size_t)ctx * nkv * hd; i++) {
        k[i] = kt_frand(&rng, -1, 1);
        v[i] = kt_frand(&rng, -1, 1);
    }
    for (size_t i = 0; i < (size_t)m * nh * hd; i++)
        q[i] = kt_frand(&rng, -1, 1);
    kn_seq_view view = {.block_table = table, .n_ctx = ctx};
    kn_cpu_kv_write(c, kp, vp, t, bs, NULL, nkv, hd, k, v, ctx, pos, seq_of, &view);
    const int reps = m == 1 ? 2000 : 20;
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = kt_now_s();
        kn_cpu_attention(c, q, kp, vp, t, bs, NULL, nh, nkv, nh / nkv, 0, hd, 0.125f, 0, softcap, m,
                         0, pos + ctx - m, seq_of, &view, out);
        double dt = kt_now_s() - t0;
        best = dt < best ? dt : best;
    }
    printf("attention %s threads %d heads %d/%d hd %d m %d ctx %d%s: %.1f us\n",
           t == TD_F16 ? "f16" : "f32", kn_cpu_n_threads(c), nh, nkv, hd, m, ctx,
           softcap > 0.0f ? " softcap" : "", best * 1e6);
    free(kp);
    free(vp);
    free(k);
    free(v);
    free(q);
    free(out);
    free(table);
    free(pos);
    free(seq_of);
}

/* A decode step's attention: n rows, one per sequence of ctx positions, as solo rows (each cut
 * as if alone) against one shared cut (m_solo 0, the cut before solo rows had their own),
 * alternated; best of reps each. */
static void bench_solo(kn_cpu *c, int n, int ctx)
{
    const int bs = 16, nh = 9, nkv = 3, hd = 64, nb = (ctx + bs - 1) / bs;
    const size_t pool = (size_t)n * nb * nkv * bs * hd;
    void *kp = calloc(pool, 2), *vp = calloc(pool, 2);
    float *q = malloc(sizeof(float) * (size_t)n * nh * hd);
    float *out = malloc(sizeof(float) * (size_t)n * nh * hd);
    float *k = malloc(sizeof(float) * (size_t)ctx * nkv * hd);
    int32_t *table = malloc(sizeof(int32_t) * (size_t)n * nb), *pos = malloc(sizeof(int32_t) * ctx);
    int32_t *seq_of = malloc(sizeof(int32_t) * (size_t)(ctx > n ? ctx : n));
    kn_seq_view *views = malloc(sizeof(kn_seq_view) * n);
    for (size_t i = 0; i < (size_t)ctx * nkv * hd; i++)
        k[i] = kt_frand(&rng, -1, 1);
    for (size_t i = 0; i < (size_t)n * nh * hd; i++)
        q[i] = kt_frand(&rng, -1, 1);
    for (int s = 0; s < n; s++) {
        for (int b = 0; b < nb; b++)
            table[s * nb + b] = s * nb + (b * 7) % nb; /* scattered within the sequence */
        views[s] = (kn_seq_view){.block_table = table + s * nb, .n_ctx = ctx};
        for (int i = 0; i < ctx; i++)
            pos[i] = i, seq_of[i] = s;
        kn_cpu_kv_write(c, kp, vp, TD_F16, bs, NULL, nkv, hd, k, k, ctx, pos, seq_of, views);
    }
    for (int s = 0; s < n; s++)
        pos[s] = ctx - 1, seq_of[s] = s;
    double best[2] = {1e30, 1e30};
    for (int r = 0; r < 400; r++)
        for (int solo = 0; solo < 2; solo++) {
            double t0 = kt_now_s();
            kn_cpu_attention(c, q, kp, vp, TD_F16, bs, NULL, nh, nkv, nh / nkv, 0, hd, 0.125f, 0,
                             0.0f, n, solo ? n : 0, pos, seq_of, views, out);
            double dt = kt_now_s() - t0;
            best[solo] = dt < best[solo] ? dt : best[solo];
        }
    printf("decode attention f16 threads %d rows %d ctx %d: solo rows %.1f us, one shared cut "
           "%.1f us (x%.3f)\n",
           kn_cpu_n_threads(c), n, ctx, best[1] * 1e6, best[0] * 1e6, best[1] / best[0]);
    free(kp);
    free(vp);
    free(q);
    free(out);
    free(k);
    free(table);
    free(pos);
    free(seq_of);
    free(views);
}

static int bench(void)
{
    for (int nt = 1; nt <= 2; nt++) {
        kn_cpu *c;
        if (kn_cpu_create(nt, &c)) return 1;
        for (int f = 0; f < 2; f++) {
            td_dtype t = f ? TD_F16 : TD_F32;
            bench_one(c, t, 1, 512, 9, 3, 64, 0.0f);
            bench_one(c, t, 512, 512, 9, 3, 64, 0.0f);
            bench_one(c, t, 512, 512, 9, 3, 64, 50.0f);
        }
        for (int n = 1; n <= 64; n *= 4)
            for (int ctx = 256; ctx <= 4096; ctx *= 4)
                bench_solo(c, n, ctx);
        kn_cpu_destroy(c);
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "bench") == 0) return bench();
    TH_RUN(test_kv_write_f16_rounding);
    TH_RUN(test_kv_write_latent);
    TH_RUN(test_paged_attention);
    TH_RUN(test_solo_rows_batch_invariant);
    TH_RUN(test_softcap);
    TH_EXIT();
}
