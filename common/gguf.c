/* gguf.c: GGUF parsing with a bounds-checked cursor; nothing is read before it is
 * checked against the end of the buffer. */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "td_err.h"

#define GGUF_MAGIC             0x46554747u /* "GGUF" little-endian */
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_DIMS          4
#define GGUF_MAX_NAME          65535 /* longer keys or names are treated as corruption */

typedef struct {
    char *key;
    td_gguf_vtype type;
    td_gguf_vtype elem; /* arrays only */
    uint64_t n;         /* arrays only: element count */
    size_t off;         /* offset of the value (arrays: of the first element) */
    size_t *str_off;    /* string arrays only: offset of each element's length field */
} gguf_kv;

struct td_gguf {
    const uint8_t *base; /* whole file */
    size_t size;
    bool mapped; /* base came from mmap and must be unmapped */
    uint32_t version;
    size_t alignment;
    gguf_kv *kvs;
    size_t n_kvs;
    td_gguf_tensor *tensors;
    size_t n_tensors;
};

typedef struct {
    const uint8_t *p;
    size_t pos, size;
    char *err;
    size_t errcap;
} cursor;

static int fail(cursor *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(cursor *c, const char *fmt, ...)
{
    if (c->err && c->errcap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->err, c->errcap, fmt, ap);
        va_end(ap);
    }
    return TD_EFORMAT;
}

static bool has(const cursor *c, size_t n)
{
    return c->pos <= c->size && n <= c->size - c->pos;
}

static int rd(cursor *c, void *out, size_t n, const char *what)
{
    if (!has(c, n))
        return fail(c, "truncated file: %s at offset %zu needs %zu bytes, file has %zu", what,
                    c->pos, n, c->size);
    memcpy(out, c->p + c->pos, n);
    c->pos += n;
    return 0;
}

static int skip(cursor *c, uint64_t n, const char *what)
{
    if (!has(c, 0) || n > c->size - c->pos)
        return fail(c, "truncated file: %s at offset %zu needs %llu bytes, file has %zu", what,
                    c->pos, (unsigned long long)n, c->size);
    c->pos += (size_t)n;
    return 0;
}

static size_t scalar_size(td_gguf_vtype t)
{
    switch (t) {
    case TD_GGUF_U8:
    case TD_GGUF_I8:
    case TD_GGUF_BOOL:
        return 1;
    case TD_GGUF_U16:
    case TD_GGUF_I16:
        return 2;
    case TD_GGUF_U32:
    case TD_GGUF_I32:
    case TD_GGUF_F32:
        return 4;
    case TD_GGUF_U64:
    case TD_GGUF_I64:
    case TD_GGUF_F64:
        return 8;
    default:
        return 0;
    }
}

/* Reads a string header, leaves the cursor after the bytes; *s and *len point into the file. */
static int rd_str(cursor *c, const char **s, uint64_t *len, const char *what)
{
    int rc = rd(c, len, 8, what);
    if (rc) return rc;
    if (!has(c, 0) || *len > c->size - c->pos)
        return fail(c, "%s at offset %zu: string length %llu runs past end of file (%zu)", what,
                    c->pos - 8, (unsigned long long)*len, c->size);
    *s = (const char *)c->p + c->pos;
    c->pos += (size_t)*len;
    return 0;
}

static char *dup_name(cursor *c, const char *s, uint64_t len, const char *what, int *rc)
{
    if (len == 0 || len > GGUF_MAX_NAME) {
        *rc = fail(c, "%s has bad length %llu", what, (unsigned long long)len);
        return NULL;
    }
    if (memchr(s, '\0', (size_t)len)) {
        *rc = fail(c, "%s contains a NUL byte", what);
        return NULL;
    }
    char *d = malloc((size_t)len + 1);
    if (!d) {
        *rc = TD_ENOMEM;
        return NULL;
    }
    memcpy(d, s, (size_t)len);
    d[len] = '\0';
    *rc = 0;
    return d;
}

static int parse_kv(cursor *c, td_gguf *g, size_t idx)
{
    gguf_kv *kv = &g->kvs[idx];
    const char *ks;
    uint64_t klen = 0;
    char what[64];
    snprintf(what, sizeof what, "metadata key %zu", idx);
    int rc = rd_str(c, &ks, &klen, what);
    if (rc) return rc;
    kv->key = dup_name(c, ks, klen, what, &rc);
    if (rc) return rc;
    for (size_t j = 0; j < idx; j++)
        if (!strcmp(g->kvs[j].key, kv->key))
            return fail(c, "metadata key '%s' appears twice", kv->key);
    uint32_t t = 0;
    if ((rc = rd(c, &t, 4, "metadata type"))) return rc;
    if (t > TD_GGUF_F64) return fail(c, "metadata '%s': unknown value type %u", kv->key, t);
    kv->type = (td_gguf_vtype)t;
    kv->off = c->pos;
    if (t == TD_GGUF_STRING) {
        const char *s;
        uint64_t len = 0;
        return rd_str(c, &s, &len, kv->key);
    }
    if (t != TD_GGUF_ARRAY) return skip(c, scalar_size(kv->type), kv->key);

    uint32_t et = 0;
    if ((rc = rd(c, &et, 4, "array element type"))) return rc;
    if ((rc = rd(c, &kv->n, 8, "array length"))) return rc;
    if (et > TD_GGUF_F64)
        return fail(c, "metadata '%s': unknown array element type %u", kv->key, et);
    if (et == TD_GGUF_ARRAY)
        return fail(c, "metadata '%s': nested arrays are not supported", kv->key);
    kv->elem = (td_gguf_vtype)et;
    kv->off = c->pos;
    if (et != TD_GGUF_STRING) {
        size_t es = scalar_size(kv->elem);
        if (kv->n > (c->size - c->pos) / es)
            return fail(c, "metadata '%s': array of %llu elements runs past end of file", kv->key,
                        (unsigned long long)kv->n);
        return skip(c, kv->n * es, kv->key);
    }
    /* each string needs at least its 8-byte length: bound the count before allocating */
    if (kv->n > (c->size - c->pos) / 8)
        return fail(c, "metadata '%s': string array of %llu elements runs past end of file",
                    kv->key, (unsigned long long)kv->n);
    kv->str_off = malloc((size_t)(kv->n ? kv->n : 1) * sizeof(size_t));
    if (!kv->str_off) return TD_ENOMEM;
    for (uint64_t i = 0; i < kv->n; i++) {
        const char *s;
        uint64_t len = 0;
        kv->str_off[i] = c->pos;
        if ((rc = rd_str(c, &s, &len, kv->key))) return rc;
    }
    return 0;
}

static int parse_tensor(cursor *c, td_gguf *g, size_t idx, uint64_t *offsets)
{
    td_gguf_tensor *t = &g->tensors[idx];
    const char *s;
    uint64_t len = 0;
    char what[64];
    snprintf(what, sizeof what, "tensor %zu name", idx);
    int rc = rd_str(c, &s, &len, what);
    if (rc) return rc;
    char *name = dup_name(c, s, len, what, &rc);
    if (rc) return rc;
    t->name = name;
    uint32_t nd = 0;
    if ((rc = rd(c, &nd, 4, "tensor n_dims"))) return rc;
    if (nd < 1 || nd > GGUF_MAX_DIMS)
        return fail(c, "tensor '%s': %u dimensions (1..%d allowed)", name, nd, GGUF_MAX_DIMS);
    t->n_dims = (int)nd;
    for (int d = 0; d < 4; d++)
        t->ne[d] = 1;
    uint64_t total = 1;
    for (uint32_t d = 0; d < nd; d++) {
        uint64_t ne = 0;
        if ((rc = rd(c, &ne, 8, "tensor dimension"))) return rc;
        if (ne == 0 || ne > (uint64_t)INT64_MAX / total)
            return fail(c, "tensor '%s': dimension %u is %llu (zero or overflowing)", name, d,
                        (unsigned long long)ne);
        t->ne[d] = (int64_t)ne;
        total *= ne;
    }
    uint32_t type = 0;
    if ((rc = rd(c, &type, 4, "tensor type"))) return rc;
    const td_dtype_info *ti = td_dtype_get(type);
    if (!ti) return fail(c, "tensor '%s': unknown type %u", name, type);
    t->type = (td_dtype)type;
    if (t->ne[0] % ti->blck)
        return fail(c, "tensor '%s': row of %lld elements is not a whole number of %s blocks (%u)",
                    name, (long long)t->ne[0], ti->name, ti->blck);
    uint64_t blocks = total / ti->blck;
    if (blocks > SIZE_MAX / ti->type_size) return fail(c, "tensor '%s': size overflows", name);
    t->nbytes = (size_t)(blocks * ti->type_size);
    if ((rc = rd(c, &offsets[idx], 8, "tensor offset"))) return rc;
    for (size_t j = 0; j < idx; j++)
        if (!strcmp(g->tensors[j].name, name)) return fail(c, "tensor '%s' appears twice", name);
    return 0;
}

static int parse(td_gguf *g, char *err, size_t errcap)
{
    cursor c = {.p = g->base, .pos = 0, .size = g->size, .err = err, .errcap = errcap};
    uint32_t magic = 0;
    int rc;
    if ((rc = rd(&c, &magic, 4, "magic"))) return rc;
    if (magic != GGUF_MAGIC) return fail(&c, "not a GGUF file (bad magic 0x%08x)", magic);
    if ((rc = rd(&c, &g->version, 4, "version"))) return rc;
    if (g->version != 2 && g->version != 3)
        return fail(&c, "unsupported GGUF version %u (2 and 3 are supported)", g->version);
    uint64_t n_tensors = 0, n_kv = 0;
    if ((rc = rd(&c, &n_tensors, 8, "tensor count"))) return rc;
    if ((rc = rd(&c, &n_kv, 8, "metadata count"))) return rc;
    /* every entry takes at least this many bytes: bound counts before allocating */
    size_t rest = c.size - c.pos;
    if (n_kv > rest / 13)
        return fail(&c, "metadata count %llu is impossible for a file of %zu bytes",
                    (unsigned long long)n_kv, c.size);
    if (n_tensors > rest / 25)
        return fail(&c, "tensor count %llu is impossible for a file of %zu bytes",
                    (unsigned long long)n_tensors, c.size);
    g->kvs = calloc(n_kv ? n_kv : 1, sizeof *g->kvs);
    g->tensors = calloc(n_tensors ? n_tensors : 1, sizeof *g->tensors);
    uint64_t *offsets = calloc(n_tensors ? n_tensors : 1, sizeof *offsets);
    if (!g->kvs || !g->tensors || !offsets) {
        free(offsets);
        return TD_ENOMEM;
    }
    for (size_t i = 0; i < n_kv; i++) {
        g->n_kvs = i + 1;
        if ((rc = parse_kv(&c, g, i))) goto out;
    }
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t ai = td_gguf_find_kv(g, "general.alignment");
    if (ai >= 0) {
        uint32_t a;
        if (td_gguf_get_u32(g, "general.alignment", &a) || a == 0 || (a & (a - 1))) {
            rc = fail(&c, "general.alignment must be a power of two u32");
            goto out;
        }
        g->alignment = a;
    }
    for (size_t i = 0; i < n_tensors; i++) {
        g->n_tensors = i + 1;
        if ((rc = parse_tensor(&c, g, i, offsets))) goto out;
    }
    size_t data_start = (c.pos + g->alignment - 1) / g->alignment * g->alignment;
    if (data_start > c.size && n_tensors > 0) {
        rc = fail(&c, "tensor data section starts at %zu, past end of file (%zu)", data_start,
                  c.size);
        goto out;
    }
    for (size_t i = 0; i < n_tensors; i++) {
        td_gguf_tensor *t = &g->tensors[i];
        if (offsets[i] % g->alignment) {
            rc = fail(&c, "tensor '%s': offset %llu is not a multiple of the alignment %zu",
                      t->name, (unsigned long long)offsets[i], g->alignment);
            goto out;
        }
        size_t avail = c.size - data_start;
        if (offsets[i] > avail || t->nbytes > avail - offsets[i]) {
            rc = fail(&c, "tensor '%s': data [%llu, +%zu) lies past end of file (%zu data bytes)",
                      t->name, (unsigned long long)offsets[i], t->nbytes, avail);
            goto out;
        }
        t->data = g->base + data_start + offsets[i];
    }
    rc = 0;
out:
    free(offsets);
    return rc;
}

static int open_common(td_gguf *g, td_gguf **out, char *err, size_t errcap)
{
    int rc = parse(g, err, errcap);
    if (rc) {
        if (rc == TD_ENOMEM) td_errbuf_set(err, errcap, "out of memory while reading GGUF");
        td_gguf_close(g);
        return rc;
    }
    *out = g;
    return 0;
}

int td_gguf_open_buffer(const void *buf, size_t size, td_gguf **out, char *err, size_t errcap)
{
    *out = NULL;
    td_gguf *g = calloc(1, sizeof *g);
    if (!g) return TD_ENOMEM;
    g->base = buf;
    g->size = size;
    return open_common(g, out, err, errcap);
}

int td_gguf_open(const char *path, td_gguf **out, char *err, size_t errcap)
{
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        td_errbuf_set(err, errcap, "cannot open '%s': %s", path, strerror(errno));
        return errno == ENOENT ? TD_ENOENT : TD_EIO;
    }
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
        td_errbuf_set(err, errcap, "'%s' is not a regular file", path);
        close(fd);
        return TD_EIO;
    }
    if (st.st_size == 0) {
        td_errbuf_set(err, errcap, "'%s' is empty", path);
        close(fd);
        return TD_EFORMAT;
    }
    void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        td_errbuf_set(err, errcap, "cannot map '%s': %s", path, strerror(errno));
        return TD_EIO;
    }
    td_gguf *g = calloc(1, sizeof *g);
    if (!g) {
        munmap(m, (size_t)st.st_size);
        return TD_ENOMEM;
    }
    g->base = m;
    g->size = (size_t)st.st_size;
    g->mapped = true;
    return open_common(g, out, err, errcap);
}

void td_gguf_close(td_gguf *g)
{
    if (!g) return;
    for (size_t i = 0; i < g->n_kvs; i++) {
        free(g->kvs[i].key);
        free(g->kvs[i].str_off);
    }
    for (size_t i = 0; i < g->n_tensors; i++)
        free((char *)g->tensors[i].name);
    free(g->kvs);
    free(g->tensors);
    if (g->mapped) munmap((void *)g->base, g->size);
    free(g);
}

uint32_t td_gguf_version(const td_gguf *g)
{
    return g->version;
}
size_t td_gguf_alignment(const td_gguf *g)
{
    return g->alignment;
}
size_t td_gguf_n_kv(const td_gguf *g)
{
    return g->n_kvs;
}
const char *td_gguf_kv_key(const td_gguf *g, size_t i)
{
    return i < g->n_kvs ? g->kvs[i].key : NULL;
}
td_gguf_vtype td_gguf_kv_type(const td_gguf *g, size_t i)
{
    return g->kvs[i].type;
}

int64_t td_gguf_find_kv(const td_gguf *g, const char *key)
{
    for (size_t i = 0; i < g->n_kvs; i++)
        if (g->kvs[i].key && !strcmp(g->kvs[i].key, key)) return (int64_t)i;
    return -1;
}

static const gguf_kv *kv_of(const td_gguf *g, const char *key)
{
    int64_t i = td_gguf_find_kv(g, key);
    return i < 0 ? NULL : &g->kvs[i];
}

/* Reads an integer of any width at off; false if t is not an integer type. */
static bool read_int(const td_gguf *g, td_gguf_vtype t, size_t off, int64_t *v, uint64_t *uv,
                     bool *is_unsigned)
{
    const uint8_t *p = g->base + off;
    *is_unsigned = false;
    switch (t) {
    case TD_GGUF_U8: {
        uint8_t x;
        memcpy(&x, p, 1);
        *v = x;
        return true;
    }
    case TD_GGUF_I8: {
        int8_t x;
        memcpy(&x, p, 1);
        *v = x;
        return true;
    }
    case TD_GGUF_U16: {
        uint16_t x;
        memcpy(&x, p, 2);
        *v = x;
        return true;
    }
    case TD_GGUF_I16: {
        int16_t x;
        memcpy(&x, p, 2);
        *v = x;
        return true;
    }
    case TD_GGUF_U32: {
        uint32_t x;
        memcpy(&x, p, 4);
        *v = x;
        return true;
    }
    case TD_GGUF_I32: {
        int32_t x;
        memcpy(&x, p, 4);
        *v = x;
        return true;
    }
    case TD_GGUF_I64: {
        int64_t x;
        memcpy(&x, p, 8);
        *v = x;
        return true;
    }
    case TD_GGUF_U64: {
        memcpy(uv, p, 8);
        *is_unsigned = true;
        *v = *uv > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)*uv;
        return true;
    }
    default:
        return false;
    }
}

int td_gguf_get_i64(const td_gguf *g, const char *key, int64_t *out)
{
    const gguf_kv *kv = kv_of(g, key);
    if (!kv) return TD_ENOENT;
    uint64_t uv;
    bool u;
    if (!read_int(g, kv->type, kv->off, out, &uv, &u)) return TD_EFORMAT;
    if (u && uv > (uint64_t)INT64_MAX) return TD_ERANGE;
    return 0;
}

int td_gguf_get_u32(const td_gguf *g, const char *key, uint32_t *out)
{
    int64_t v;
    int rc = td_gguf_get_i64(g, key, &v);
    if (rc) return rc;
    if (v < 0 || v > UINT32_MAX) return TD_ERANGE;
    *out = (uint32_t)v;
    return 0;
}

int td_gguf_get_f32(const td_gguf *g, const char *key, float *out)
{
    const gguf_kv *kv = kv_of(g, key);
    if (!kv) return TD_ENOENT;
    if (kv->type == TD_GGUF_F32) {
        memcpy(out, g->base + kv->off, 4);
        return 0;
    }
    if (kv->type == TD_GGUF_F64) {
        double d;
        memcpy(&d, g->base + kv->off, 8);
        *out = (float)d;
        return 0;
    }
    return TD_EFORMAT;
}

int td_gguf_get_bool(const td_gguf *g, const char *key, bool *out)
{
    const gguf_kv *kv = kv_of(g, key);
    if (!kv) return TD_ENOENT;
    if (kv->type != TD_GGUF_BOOL) return TD_EFORMAT;
    *out = g->base[kv->off] != 0;
    return 0;
}

int td_gguf_get_str(const td_gguf *g, const char *key, const char **s, size_t *len)
{
    const gguf_kv *kv = kv_of(g, key);
    if (!kv) return TD_ENOENT;
    if (kv->type != TD_GGUF_STRING) return TD_EFORMAT;
    uint64_t l;
    memcpy(&l, g->base + kv->off, 8);
    *s = (const char *)g->base + kv->off + 8;
    *len = (size_t)l;
    return 0;
}

int td_gguf_get_arr(const td_gguf *g, const char *key, td_gguf_vtype *elem, size_t *n)
{
    const gguf_kv *kv = kv_of(g, key);
    if (!kv) return TD_ENOENT;
    if (kv->type != TD_GGUF_ARRAY) return TD_EFORMAT;
    *elem = kv->elem;
    *n = (size_t)kv->n;
    return 0;
}

int td_gguf_arr_str(const td_gguf *g, const char *key, size_t i, const char **s, size_t *len)
{
    const gguf_kv *kv = kv_of(g, key);
    if (!kv) return TD_ENOENT;
    if (kv->type != TD_GGUF_ARRAY || kv->elem != TD_GGUF_STRING) return TD_EFORMAT;
    if (i >= kv->n) return TD_ERANGE;
    uint64_t l;
    memcpy(&l, g->base + kv->str_off[i], 8);
    *s = (const char *)g->base + kv->str_off[i] + 8;
    *len = (size_t)l;
    return 0;
}

int td_gguf_arr_read_i32(const td_gguf *g, const char *key, int32_t *out, size_t n)
{
    const gguf_kv *kv = kv_of(g, key);
    if (!kv) return TD_ENOENT;
    if (kv->type != TD_GGUF_ARRAY) return TD_EFORMAT;
    if (n > kv->n) return TD_ERANGE;
    size_t es = scalar_size(kv->elem);
    for (size_t i = 0; i < n; i++) {
        int64_t v;
        uint64_t uv;
        bool u;
        if (!read_int(g, kv->elem, kv->off + i * es, &v, &uv, &u)) return TD_EFORMAT;
        if (v < INT32_MIN || v > INT32_MAX) return TD_ERANGE;
        out[i] = (int32_t)v;
    }
    return 0;
}

int td_gguf_arr_read_f32(const td_gguf *g, const char *key, float *out, size_t n)
{
    const gguf_kv *kv = kv_of(g, key);
    if (!kv) return TD_ENOENT;
    if (kv->type != TD_GGUF_ARRAY) return TD_EFORMAT;
    if (n > kv->n) return TD_ERANGE;
    for (size_t i = 0; i < n; i++) {
        if (kv->elem == TD_GGUF_F32) {
            memcpy(&out[i], g->base + kv->off + i * 4, 4);
        } else if (kv->elem == TD_GGUF_F64) {
            double d;
            memcpy(&d, g->base + kv->off + i * 8, 8);
            out[i] = (float)d;
        } else {
            return TD_EFORMAT;
        }
    }
    return 0;
}

size_t td_gguf_n_tensors(const td_gguf *g)
{
    return g->n_tensors;
}

const td_gguf_tensor *td_gguf_tensor_at(const td_gguf *g, size_t i)
{
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const td_gguf_tensor *td_gguf_find_tensor(const td_gguf *g, const char *name)
{
    for (size_t i = 0; i < g->n_tensors; i++)
        if (!strcmp(g->tensors[i].name, name)) return &g->tensors[i];
    return NULL;
}
