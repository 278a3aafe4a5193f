/* pf_pcache.c: the on-disk cache of stage profiles: the key (what a profile depends on),
 * and whole-file load / atomic store (see pf_pcache.h for the key and the format). */
#define _GNU_SOURCE
#include "pf_pcache.h"

#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cpu_blas.h"
#include "pf_tune.h"
#include "td_cachefile.h"
#include "td_err.h"

#define MAGIC        "tandem stage profile 1\n"
#define FILE_MAX     (16 * 1024) /* bytes; a profile is ~1 KiB */

/* The model's shape: file size, hyper-parameters, tensor table (not the weights). */
static uint64_t model_hash(const pf_shard *r, int64_t size)
{
    const kn_hparams *hp = &r->rt.model->hp;
    uint64_t h = td_fnv_i64(TD_FNV_OFFSET, size);
    int64_t ints[] = {hp->arch,        hp->n_layer,   hp->n_embd,    hp->n_ff,
                      hp->n_head,      hp->n_head_kv, hp->head_dim,  hp->n_vocab,
                      hp->n_ctx_train, hp->n_rot,     hp->rope_neox, hp->tied_embd};
    for (size_t i = 0; i < sizeof ints / sizeof *ints; i++)
        h = td_fnv_i64(h, ints[i]);
    h = td_fnv_f32(h, hp->rope_base);
    h = td_fnv_f32(h, hp->rope_scale);
    h = td_fnv_f32(h, hp->rms_eps);
    h = td_fnv_gguf_tensors(h, r->rt.gguf);
    return h;
}

/* ---- key ---- */

static int desc_add(pf_pcache_key *k, size_t *off, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int desc_add(pf_pcache_key *k, size_t *off, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(k->desc + *off, sizeof k->desc - *off, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof k->desc - *off) return TD_ERANGE;
    *off += (size_t)n;
    return 0;
}

int pf_pcache_key_make(const pf_shard *r, const char *model_path, const pf_profile_params *p_in,
                       pf_pcache_key *k)
{
    memset(k, 0, sizeof *k);
    struct stat st;
    if (stat(model_path, &st)) return TD_EIO;
    pf_profile_params p = pf_profile_resolve(p_in);
    char exe[TD_BUILD_IDENTITY_MAX], blas[TD_BUILD_IDENTITY_MAX], cpu[160];
    td_build_identity(0, exe, sizeof exe);
    kn_blas_build_identity(blas, sizeof blas);
    td_cpu_model_name(cpu, sizeof cpu);
    cpu_set_t set;
    int usable = sched_getaffinity(0, sizeof set, &set) ? -1 : CPU_COUNT(&set);
    size_t off = 0;
    int rc = 0;
    rc |= desc_add(k, &off, "model %016llx (%lld bytes, %s, %zu tensors)\n",
                   (unsigned long long)model_hash(r, (int64_t)st.st_size), (long long)st.st_size,
                   kn_arch_name(r->rt.model->hp.arch), td_gguf_n_tensors(r->rt.gguf));
    rc |= desc_add(k, &off, "layers [%d, %d) of %d\n", r->l0, r->l1, r->rt.model->hp.n_layer);
    char be[160]; /* a profile measured on one backend says nothing about another */
    r->rt.be.ops->describe(r->rt.be.ctx, be, sizeof be);
    rc |= desc_add(k, &off, "backend %s; threads %d\n", be, r->threads);
    rc |= desc_add(k, &off, "kv %s block %d\n", td_dtype_name(r->kv->type), r->kv->block_size);
    rc |= desc_add(
        k, &off, "profile chunk %d max_len %d lengths %d reps %d budget_ms %d seed %llu\n",
        p.chunk_size, p.max_len, p.n_lengths, p.reps, p.budget_ms, (unsigned long long)p.seed);
    rc |= desc_add(k, &off, "build exe %s blas %s\n", exe, blas);
    rc |= desc_add(k, &off, "cpu %s; %ld online, %d usable\n", cpu, sysconf(_SC_NPROCESSORS_ONLN),
                   usable);
    if (rc) return TD_ERANGE;
    k->hash = td_fnv(TD_FNV_OFFSET, k->desc, off);
    return 0;
}

/* ---- paths ---- */

int pf_pcache_dir(char *buf, size_t cap)
{
    return td_cache_dir("profiles", buf, cap);
}

int pf_pcache_path(const char *dir, const pf_pcache_key *k, char *buf, size_t cap)
{
    int n = snprintf(buf, cap, "%s/stage-%016llx.profile", dir, (unsigned long long)k->hash);
    return n < 0 || (size_t)n >= cap ? TD_ERANGE : 0;
}

/* ---- load ---- */

typedef struct {
    char *p;  /* next unread byte */
    int line; /* 1-based number of the next line */
} pf_cursor;

/* The next line, NUL-terminated in place; NULL if no whole line is left. */
static char *next_line(pf_cursor *c)
{
    char *nl = strchr(c->p, '\n');
    if (!nl) return NULL;
    *nl = 0;
    char *l = c->p;
    c->p = nl + 1;
    c->line++;
    return l;
}

static int refuse(char *why, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int refuse(char *why, size_t cap, const char *fmt, ...)
{
    if (why && cap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, cap, fmt, ap);
        va_end(ap);
    }
    return TD_EFORMAT;
}

/* "NAME VALUE" with VALUE a finite double. */
static bool field_double(const char *l, const char *name, double *v)
{
    size_t n = strlen(name);
    if (strncmp(l, name, n) || l[n] != ' ') return false;
    char *end;
    errno = 0;
    *v = strtod(l + n + 1, &end);
    return !errno && end != l + n + 1 && !*end && isfinite(*v);
}

static bool field_long(const char *l, const char *name, long *v)
{
    size_t n = strlen(name);
    if (strncmp(l, name, n) || l[n] != ' ' || l[n + 1] == '-' || l[n + 1] == '+') return false;
    char *end;
    errno = 0;
    *v = strtol(l + n + 1, &end, 10);
    return !errno && end != l + n + 1 && !*end;
}

static int parse(char *text, const pf_pcache_key *k, pf_profile_result *out, char *why, size_t cap)
{
    size_t ml = strlen(MAGIC), dl = strlen(k->desc), len = strlen(text);
    if (strncmp(text, MAGIC, ml)) return refuse(why, cap, "not a profile of this version");
    if (text[len - 1] != '\n') return refuse(why, cap, "cut short (no final newline)");
    /* the checksum covers every byte before the last line; taken before lines are cut */
    size_t body = len - 1;
    while (body > 0 && text[body - 1] != '\n')
        body--;
    char want[32];
    snprintf(want, sizeof want, "end %016llx", (unsigned long long)td_fnv(TD_FNV_OFFSET, text, body));
    if (strncmp(text + ml, k->desc, dl)) return refuse(why, cap, "stored under another key");
    pf_cursor c = {.p = text + ml + dl, .line = 2};
    for (const char *d = k->desc; *d; d++)
        c.line += *d == '\n';
    char *l = next_line(&c);
    double v;
    long n;
    if (!l || strcmp(l, "--")) return refuse(why, cap, "line %d: no end of the key", c.line - 1);
    if (!(l = next_line(&c)) || !field_double(l, "elapsed_ms", &v) || v < 0)
        return refuse(why, cap, "line %d: bad elapsed_ms", c.line - 1);
    out->elapsed_ms = v;
    if (!(l = next_line(&c)) || !field_long(l, "budget_hit", &n) || n > 1)
        return refuse(why, cap, "line %d: bad budget_hit", c.line - 1);
    out->budget_hit = n == 1;
    if (!(l = next_line(&c)) || !field_long(l, "points", &n) || n < 1 || n > PF_PROFILE_MAX_LENGTHS)
        return refuse(why, cap, "line %d: bad point count", c.line - 1);
    int np = (int)n;
    double xs[PF_PROFILE_MAX_LENGTHS];
    for (int i = 0; i < np; i++) {
        if (!(l = next_line(&c))) return refuse(why, cap, "cut short after %d of %d points", i, np);
        char *e1, *e2 = NULL, *e3 = NULL;
        errno = 0;
        long tok = strtol(l, &e1, 10);
        double ms = e1 != l && *e1 == ' ' ? strtod(e1 + 1, &e2) : NAN;
        long runs = isfinite(ms) && e2 != e1 + 1 && *e2 == ' ' ? strtol(e2 + 1, &e3, 10) : -1;
        if (errno || runs < 1 || runs > 1000 || e3 == e2 + 1 || *e3 || tok < 1 ||
            tok > (1L << 24) || !(ms > 0 && ms < 1e9) || (i && tok <= out->len[i - 1]))
            return refuse(why, cap, "line %d: bad point '%s'", c.line - 1, l);
        out->len[i] = (int32_t)tok;
        out->ms[i] = ms;
        out->n_runs[i] = (int)runs;
        xs[i] = (double)tok;
    }
    out->n_lengths = np;
    if (c.p != text + body || !(l = next_line(&c)) || strncmp(l, "end ", 4))
        return refuse(why, cap, "line %d: no end line", c.line - 1);
    if (strcmp(l, want)) return refuse(why, cap, "checksum mismatch (the file was altered)");
    /* the same robust fit the profiler made (pf_profile.c), so a loaded fit equals it */
    pf_fit_robust(xs, out->ms, out->n_lengths, &out->fit, NULL);
    return 0;
}

int pf_pcache_load(const char *path, const pf_pcache_key *k, pf_profile_result *out, char *why,
                   size_t why_cap)
{
    memset(out, 0, sizeof *out);
    if (why && why_cap) why[0] = 0;
    char *text;
    size_t got;
    int rc = td_cache_read(path, FILE_MAX, &text, &got, why, why_cap);
    if (rc) return rc;
    rc = parse(text, k, out, why, why_cap);
    free(text);
    if (rc) memset(out, 0, sizeof *out);
    return rc;
}

/* ---- store ---- */

int pf_pcache_store(const char *path, const pf_pcache_key *k, const pf_profile_result *res,
                    char *why, size_t why_cap)
{
    if (why && why_cap) why[0] = 0;
    if (res->n_lengths < 1 || res->n_lengths > PF_PROFILE_MAX_LENGTHS) return TD_EINVAL;
    size_t cap = FILE_MAX, off = 0;
    char *b = malloc(cap);
    if (!b) return TD_ENOMEM;
    int n = snprintf(b, cap, "%s%s--\nelapsed_ms %.3f\nbudget_hit %d\npoints %d\n", MAGIC, k->desc,
                     res->elapsed_ms, res->budget_hit ? 1 : 0, res->n_lengths);
    off = n > 0 ? (size_t)n : cap;
    for (int i = 0; i < res->n_lengths && off < cap; i++) {
        /* %.17g: the same double back on load, so a loaded fit equals the measured one */
        n = snprintf(b + off, cap - off, "%d %.17g %d\n", res->len[i], res->ms[i], res->n_runs[i]);
        off = n > 0 && (size_t)n < cap - off ? off + (size_t)n : cap;
    }
    if (off < cap) {
        n = snprintf(b + off, cap - off, "end %016llx\n",
                     (unsigned long long)td_fnv(TD_FNV_OFFSET, b, off));
        off = n > 0 && (size_t)n < cap - off ? off + (size_t)n : cap;
    }
    if (off >= cap) {
        free(b);
        return TD_ERANGE;
    }
    int rc = td_cache_write(path, b, off, why, why_cap);
    free(b);
    return rc;
}
