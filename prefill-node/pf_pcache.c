/* pf_pcache.c: the on-disk cache of stage profiles: the key (what a profile depends on),
 * and whole-file load / atomic store (see pf_pcache.h for the key and the format). */
#define _GNU_SOURCE
#include "pf_pcache.h"

#include <cblas.h>
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <math.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pf_tune.h"
#include "td_err.h"

#define MAGIC        "tandem stage profile 1\n"
#define FILE_MAX     (16 * 1024) /* bytes; a profile is ~1 KiB */
#define BUILD_ID_MAX 64          /* bytes of a build id note (SHA-1 ones are 20) */

/* ---- hashing ---- */

#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME  0x100000001b3ull

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * FNV_PRIME;
    return h;
}

static uint64_t fnv_i64(uint64_t h, int64_t v)
{
    return fnv(h, &v, sizeof v);
}

static uint64_t fnv_f32(uint64_t h, float v)
{
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return fnv(h, &bits, sizeof bits);
}

/* The model's shape: file size, hyper-parameters, tensor table (not the weights). */
static uint64_t model_hash(const pf_shard *r, int64_t size)
{
    const kn_hparams *hp = &r->rt.model->hp;
    uint64_t h = fnv_i64(FNV_OFFSET, size);
    int64_t ints[] = {hp->arch,        hp->n_layer,   hp->n_embd,    hp->n_ff,
                      hp->n_head,      hp->n_head_kv, hp->head_dim,  hp->n_vocab,
                      hp->n_ctx_train, hp->n_rot,     hp->rope_neox, hp->tied_embd};
    for (size_t i = 0; i < sizeof ints / sizeof *ints; i++)
        h = fnv_i64(h, ints[i]);
    h = fnv_f32(h, hp->rope_base);
    h = fnv_f32(h, hp->rope_scale);
    h = fnv_f32(h, hp->rms_eps);
    size_t nt = td_gguf_n_tensors(r->rt.gguf);
    for (size_t i = 0; i < nt; i++) {
        const td_gguf_tensor *t = td_gguf_tensor_at(r->rt.gguf, i);
        h = fnv(h, t->name, strlen(t->name) + 1);
        h = fnv_i64(h, t->type);
        h = fnv_i64(h, t->n_dims);
        for (int d = 0; d < 4; d++)
            h = fnv_i64(h, t->ne[d]);
    }
    return h;
}

/* ---- build ids ---- */

typedef struct {
    uintptr_t addr; /* find the object mapping this address; 0: the first (the executable) */
    bool found;
    char hex[2 * BUILD_ID_MAX + 1];
} pf_build_id_q;

static void note_build_id(const struct dl_phdr_info *info, pf_build_id_q *q)
{
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_NOTE) continue;
        const unsigned char *p = (const unsigned char *)(info->dlpi_addr + ph->p_vaddr);
        size_t off = 0;
        while (off + sizeof(ElfW(Nhdr)) <= ph->p_memsz) {
            ElfW(Nhdr) nh;
            memcpy(&nh, p + off, sizeof nh);
            size_t name_off = off + sizeof nh;
            size_t desc_off = name_off + ((nh.n_namesz + 3u) & ~3u);
            size_t next = desc_off + ((nh.n_descsz + 3u) & ~3u);
            if (next > ph->p_memsz || next <= off) break;
            if (nh.n_type == NT_GNU_BUILD_ID && nh.n_namesz == 4 &&
                !memcmp(p + name_off, "GNU", 4) && nh.n_descsz > 0 && nh.n_descsz <= BUILD_ID_MAX) {
                for (size_t k = 0; k < nh.n_descsz; k++)
                    snprintf(q->hex + 2 * k, 3, "%02x", p[desc_off + k]);
                q->found = true;
                return;
            }
            off = next;
        }
    }
}

static int find_object(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    pf_build_id_q *q = arg;
    bool hit = q->addr == 0;
    for (int i = 0; i < info->dlpi_phnum && !hit; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uintptr_t lo = info->dlpi_addr + ph->p_vaddr;
        hit = ph->p_type == PT_LOAD && q->addr >= lo && q->addr < lo + ph->p_memsz;
    }
    if (!hit) return 0;
    note_build_id(info, q);
    return 1; /* stop: this is the object */
}

/* "build id HEX" of the object mapping addr (0: the executable); else the executable's
 * path, size and mtime (a build without --build-id), or "unknown". */
static void build_identity(uintptr_t addr, char *out, size_t cap)
{
    pf_build_id_q q = {.addr = addr};
    dl_iterate_phdr(find_object, &q);
    if (q.found) {
        snprintf(out, cap, "%s", q.hex);
        return;
    }
    char exe[512];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    struct stat st;
    if (addr == 0 && n > 0) {
        exe[n] = 0;
        if (!stat(exe, &st)) {
            snprintf(out, cap, "%s:%lld:%lld.%09ld", exe, (long long)st.st_size,
                     (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
            return;
        }
    }
    snprintf(out, cap, "unknown");
}

/* ---- CPU ---- */

static void cpu_name(char *out, size_t cap)
{
    snprintf(out, cap, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10)) continue;
        char *v = strchr(line, ':');
        if (!v) continue;
        v++;
        while (*v == ' ' || *v == '\t')
            v++;
        size_t k = 0;
        for (; v[k] && v[k] != '\n' && k + 1 < cap; k++)
            out[k] = (v[k] >= 0x20 && v[k] < 0x7f) ? v[k] : '?';
        out[k] = 0;
        break;
    }
    fclose(f);
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
    char exe[2 * BUILD_ID_MAX + 600], blas[2 * BUILD_ID_MAX + 600], cpu[160];
    void (*sgemm)(void) = (void (*)(void))cblas_sgemm;
    uintptr_t blas_addr;
    memcpy(&blas_addr, &sgemm, sizeof blas_addr);
    build_identity(0, exe, sizeof exe);
    build_identity(blas_addr, blas, sizeof blas);
    cpu_name(cpu, sizeof cpu);
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
    k->hash = fnv(FNV_OFFSET, k->desc, off);
    return 0;
}

/* ---- paths ---- */

int pf_pcache_dir(char *buf, size_t cap)
{
    const char *base = getenv("TANDEM_CACHE");
    int n;
    if (base && *base)
        n = snprintf(buf, cap, "%s/profiles", base);
    else if ((base = getenv("HOME")) && *base)
        n = snprintf(buf, cap, "%s/.cache/tandem/profiles", base);
    else
        return TD_ENOENT;
    return n < 0 || (size_t)n >= cap ? TD_ERANGE : 0;
}

int pf_pcache_path(const char *dir, const pf_pcache_key *k, char *buf, size_t cap)
{
    int n = snprintf(buf, cap, "%s/stage-%016llx.profile", dir, (unsigned long long)k->hash);
    return n < 0 || (size_t)n >= cap ? TD_ERANGE : 0;
}

/* mkdir -p of the directory part of path. Returns 0 or -1 (errno set). */
static int make_parents(const char *path)
{
    char d[4096];
    size_t n = strlen(path);
    if (n >= sizeof d) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(d, path, n + 1);
    char *slash = strrchr(d, '/');
    if (!slash || slash == d) return 0;
    *slash = 0;
    for (char *p = d + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(d, 0755) && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(d, 0755) && errno != EEXIST) return -1;
    return 0;
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
    snprintf(want, sizeof want, "end %016llx", (unsigned long long)fnv(FNV_OFFSET, text, body));
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
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) return TD_ENOENT;
        snprintf(why, why_cap, "cannot open: %s", strerror(errno));
        return TD_EIO;
    }
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
        close(fd);
        return refuse(why, why_cap, "not a regular file");
    }
    if (st.st_size > FILE_MAX) {
        close(fd);
        return refuse(why, why_cap, "%lld bytes (a profile has ~1 KiB)", (long long)st.st_size);
    }
    char *text = malloc((size_t)st.st_size + 1);
    if (!text) {
        close(fd);
        return TD_ENOMEM;
    }
    size_t got = 0;
    while (got < (size_t)st.st_size) {
        ssize_t r = read(fd, text + got, (size_t)st.st_size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    close(fd);
    if (got != (size_t)st.st_size) {
        free(text);
        snprintf(why, why_cap, "short read (%zu of %lld bytes)", got, (long long)st.st_size);
        return TD_EIO;
    }
    text[got] = 0;
    int rc = strlen(text) != got ? refuse(why, why_cap, "NUL byte in the file")
                                 : parse(text, k, out, why, why_cap);
    free(text);
    if (rc) memset(out, 0, sizeof *out);
    return rc;
}

/* ---- store ---- */

static int write_all(int fd, const char *b, size_t n)
{
    while (n) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

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
                     (unsigned long long)fnv(FNV_OFFSET, b, off));
        off = n > 0 && (size_t)n < cap - off ? off + (size_t)n : cap;
    }
    if (off >= cap) {
        free(b);
        return TD_ERANGE;
    }
    char tmp[4200];
    int rc = 0;
    if (make_parents(path)) {
        snprintf(why, why_cap, "cannot create the directory of %s: %s", path, strerror(errno));
        rc = TD_EIO;
    } else if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp) {
        rc = TD_ERANGE;
    } else {
        unlink(tmp); /* a left-over of a crashed process that had our pid */
        int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0) {
            snprintf(why, why_cap, "cannot create %s: %s", tmp, strerror(errno));
            rc = TD_EIO;
        } else {
            if (write_all(fd, b, off) || fsync(fd)) {
                snprintf(why, why_cap, "cannot write %s: %s", tmp, strerror(errno));
                rc = TD_EIO;
            }
            if (close(fd) && !rc) {
                snprintf(why, why_cap, "cannot write %s: %s", tmp, strerror(errno));
                rc = TD_EIO;
            }
            if (!rc && rename(tmp, path)) {
                snprintf(why, why_cap, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
                rc = TD_EIO;
            }
            if (rc) unlink(tmp);
        }
    }
    free(b);
    return rc;
}
