/* test_gguf.c: tests of the GGUF reader (common/gguf.c).
 *
 * Without arguments: built-in tests that need no data (a hand-built valid file and its
 * mutations, an empty file, a directory, a missing path, tiny error buffers).
 * --corpus DIR: every file of DIR/manifest.txt (written by tests/ref/make_malformed.py) is
 *   opened from an exact-size heap copy (so ASan sees any over-read) and from its path; an
 *   "error" entry must fail cleanly with a message (printed), an "ok" entry must open and
 *   every key, string, array element and tensor byte must be readable, "any" may do either.
 * --expect FILE.gguf FILE.expect: the reader must report exactly the facts that
 *   tests/ref/gguf_expect.py (the gguf package's reader) wrote for the file.
 * Options may repeat. The process exits 1 if any check failed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf.h"
#include "td_err.h"
#include "tharness.h"

/* ---- helpers --------------------------------------------------------------------------- */

/* Reads a whole file into an exact-size heap buffer (NULL and *size 0 for empty files). */
static int read_file(const char *path, uint8_t **buf, size_t *size)
{
    *buf = NULL;
    *size = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    if (fseek(f, 0, SEEK_END)) {
        fclose(f);
        return -1;
    }
    long n = ftell(f);
    rewind(f);
    if (n < 0) {
        fclose(f);
        return -1;
    }
    if (n > 0) {
        *buf = malloc((size_t)n);
        if (!*buf || fread(*buf, 1, (size_t)n, f) != (size_t)n) {
            free(*buf);
            *buf = NULL;
            fclose(f);
            return -1;
        }
    }
    *size = (size_t)n;
    fclose(f);
    return 0;
}

/* The checksum gguf_expect.py writes: sum of byte[i] * (i % 251 + 1), modulo 2^64. */
static uint64_t checksum(const uint8_t *p, size_t n)
{
    uint64_t s = 0;
    for (size_t i = 0; i < n; i++)
        s += (uint64_t)p[i] * (uint64_t)(i % 251 + 1);
    return s;
}

static volatile uint64_t walk_sink; /* keeps the walk's reads from being optimized away */

/* Touches every key, value, array element and tensor byte an open file exposes and checks
 * that the accessors agree with each other. */
static void walk(const td_gguf *g)
{
    uint64_t acc = td_gguf_version(g) + td_gguf_alignment(g);
    size_t n_kv = td_gguf_n_kv(g);
    for (size_t i = 0; i < n_kv; i++) {
        const char *key = td_gguf_kv_key(g, i);
        TH_REQUIRE(key != NULL);
        TH_CHECK(td_gguf_find_kv(g, key) == (int64_t)i);
        acc += strlen(key);
        td_gguf_vtype t = td_gguf_kv_type(g, i);
        const char *s;
        size_t len;
        if (t == TD_GGUF_STRING) {
            TH_CHECK(td_gguf_get_str(g, key, &s, &len) == 0);
            acc += checksum((const uint8_t *)s, len);
        } else if (t == TD_GGUF_ARRAY) {
            td_gguf_vtype et;
            size_t n;
            TH_REQUIRE(td_gguf_get_arr(g, key, &et, &n) == 0);
            if (et == TD_GGUF_STRING) {
                for (size_t j = 0; j < n; j++) {
                    TH_REQUIRE(td_gguf_arr_str(g, key, j, &s, &len) == 0);
                    acc += checksum((const uint8_t *)s, len);
                }
                TH_CHECK(td_gguf_arr_str(g, key, n, &s, &len) == TD_ERANGE);
            } else {
                int32_t *iv = malloc((n ? n : 1) * sizeof *iv);
                float *fv = malloc((n ? n : 1) * sizeof *fv);
                TH_REQUIRE(iv && fv);
                if (td_gguf_arr_read_i32(g, key, iv, n) == 0)
                    for (size_t j = 0; j < n; j++)
                        acc += (uint32_t)iv[j];
                if (td_gguf_arr_read_f32(g, key, fv, n) == 0)
                    for (size_t j = 0; j < n; j++)
                        acc += (uint64_t)(fv[j] == fv[j]);
                free(iv);
                free(fv);
            }
        } else {
            int64_t v;
            float f;
            bool b;
            if (td_gguf_get_i64(g, key, &v) == 0) acc += (uint64_t)v;
            if (td_gguf_get_f32(g, key, &f) == 0) acc += (uint64_t)(f == f);
            if (td_gguf_get_bool(g, key, &b) == 0) acc += b;
        }
    }
    size_t n_t = td_gguf_n_tensors(g);
    for (size_t i = 0; i < n_t; i++) {
        const td_gguf_tensor *t = td_gguf_tensor_at(g, i);
        TH_REQUIRE(t != NULL && t->name != NULL);
        TH_CHECK(td_gguf_find_tensor(g, t->name) == t);
        TH_CHECK(t->n_dims >= 1 && t->n_dims <= 4);
        acc += checksum(t->data, t->nbytes);
    }
    TH_CHECK(td_gguf_tensor_at(g, n_t) == NULL);
    TH_CHECK(td_gguf_kv_key(g, n_kv) == NULL);
    walk_sink += acc;
}

/* ---- built-in tests (no data files) ------------------------------------------------------ */

/* A minimal valid file: 2 keys (general.architecture = "llama", test.n = 7 as u32), one
 * F32 tensor "w" of 4 values at offset 0. Returns the size written into buf (>= 160). */
static size_t build_minimal(uint8_t *buf, uint32_t version)
{
    size_t p = 0;
#define PUT(v, n)                                                                                  \
    do {                                                                                           \
        uint64_t v_ = (v);                                                                         \
        memcpy(buf + p, &v_, n);                                                                   \
        p += n;                                                                                    \
    } while (0)
#define PUTS(s)                                                                                    \
    do {                                                                                           \
        PUT(strlen(s), 8);                                                                         \
        memcpy(buf + p, s, strlen(s));                                                             \
        p += strlen(s);                                                                            \
    } while (0)
    PUT(0x46554747u, 4);
    PUT(version, 4);
    PUT(1, 8); /* tensors */
    PUT(2, 8); /* keys */
    PUTS("general.architecture");
    PUT(TD_GGUF_STRING, 4);
    PUTS("llama");
    PUTS("test.n");
    PUT(TD_GGUF_U32, 4);
    PUT(7, 4);
    PUTS("w");
    PUT(1, 4);      /* n_dims */
    PUT(4, 8);      /* ne[0] */
    PUT(TD_F32, 4); /* type */
    PUT(0, 8);      /* offset */
    while (p % 32)
        buf[p++] = 0;
    for (int i = 0; i < 4; i++) {
        float f = (float)i + 0.5f;
        memcpy(buf + p, &f, 4);
        p += 4;
    }
#undef PUT
#undef PUTS
    return p;
}

static void test_minimal_valid(void)
{
    uint8_t buf[256];
    size_t n = build_minimal(buf, 3);
    td_gguf *g = NULL;
    char err[256] = "";
    int rc = td_gguf_open_buffer(buf, n, &g, err, sizeof err);
    TH_CHECKF(rc == 0, "rc %d: %s", rc, err);
    TH_REQUIRE(g != NULL);
    TH_CHECK(td_gguf_version(g) == 3);
    TH_CHECK(td_gguf_alignment(g) == 32);
    TH_CHECK(td_gguf_n_kv(g) == 2 && td_gguf_n_tensors(g) == 1);
    const char *s;
    size_t len;
    TH_CHECK(td_gguf_get_str(g, "general.architecture", &s, &len) == 0 && len == 5 &&
             !memcmp(s, "llama", 5));
    uint32_t u;
    TH_CHECK(td_gguf_get_u32(g, "test.n", &u) == 0 && u == 7);
    TH_CHECK(td_gguf_get_u32(g, "test.missing", &u) == TD_ENOENT);
    TH_CHECK(td_gguf_get_str(g, "test.n", &s, &len) == TD_EFORMAT);
    TH_CHECK(td_gguf_get_u32(g, "general.architecture", &u) == TD_EFORMAT);
    float f;
    TH_CHECK(td_gguf_get_f32(g, "test.n", &f) == TD_EFORMAT);
    const td_gguf_tensor *t = td_gguf_find_tensor(g, "w");
    TH_REQUIRE(t != NULL);
    TH_CHECK(t->type == TD_F32 && t->n_dims == 1 && t->ne[0] == 4 && t->ne[1] == 1);
    TH_CHECK(t->nbytes == 16);
    TH_CHECK((const uint8_t *)t->data == buf + n - 16);
    float v[4];
    memcpy(v, t->data, sizeof v);
    TH_CHECK(v[0] == 0.5f && v[3] == 3.5f);
    TH_CHECK(td_gguf_find_tensor(g, "x") == NULL);
    walk(g);
    td_gguf_close(g);

    /* version 2 has the same layout */
    n = build_minimal(buf, 2);
    rc = td_gguf_open_buffer(buf, n, &g, err, sizeof err);
    TH_CHECKF(rc == 0 && g && td_gguf_version(g) == 2, "rc %d: %s", rc, err);
    td_gguf_close(g);
}

/* Every truncation and a few field corruptions of the minimal file fail cleanly. */
static void test_minimal_mutations(void)
{
    uint8_t buf[256];
    size_t n = build_minimal(buf, 3);
    int bad = 0;
    for (size_t cut = 0; cut < n; cut++) {
        uint8_t *copy = malloc(cut ? cut : 1); /* exact size: ASan sees over-reads */
        TH_REQUIRE(copy != NULL);
        memcpy(copy, buf, cut);
        td_gguf *g = (td_gguf *)1;
        char err[256] = "";
        int rc = td_gguf_open_buffer(copy, cut, &g, err, sizeof err);
        if (rc >= 0 || g != NULL || !err[0]) {
            bad++;
            fprintf(stderr, "  truncation to %zu bytes: rc %d, err '%s'\n", cut, rc, err);
        }
        td_gguf_close(g == (td_gguf *)1 ? NULL : g);
        free(copy);
    }
    TH_CHECKF(bad == 0, "%d truncations of the minimal file were accepted", bad);

    static const struct {
        size_t off;
        uint64_t val;
        int width;
        const char *what;
    } muts[] = {
        {0, 0x47475546, 4, "byte-swapped magic"},        {4, 1, 4, "version 1"},
        {8, UINT64_MAX, 8, "tensor count 2^64-1"},       {16, UINT64_MAX, 8, "key count 2^64-1"},
        {24, UINT64_MAX, 8, "first key length 2^64-1"},  {52, 13, 4, "unknown value type"},
        {56, UINT64_MAX - 2, 8, "string length 2^64-3"},
    };
    for (size_t i = 0; i < sizeof muts / sizeof muts[0]; i++) {
        uint8_t copy[256];
        memcpy(copy, buf, n);
        memcpy(copy + muts[i].off, &muts[i].val, (size_t)muts[i].width);
        td_gguf *g = NULL;
        char err[256] = "";
        int rc = td_gguf_open_buffer(copy, n, &g, err, sizeof err);
        TH_CHECKF(rc < 0 && g == NULL && err[0], "%s: rc %d", muts[i].what, rc);
        fprintf(stderr, "  %-26s -> %s\n", muts[i].what, err);
        td_gguf_close(g);
    }
}

static void test_files(void)
{
    char dir[] = "/tmp/tandem-test-gguf-XXXXXX";
    TH_REQUIRE(mkdtemp(dir) != NULL);
    char path[512];
    td_gguf *g = (td_gguf *)1;
    char err[256] = "";

    /* an empty file */
    snprintf(path, sizeof path, "%s/empty.gguf", dir);
    FILE *f = fopen(path, "wb");
    TH_REQUIRE(f != NULL);
    fclose(f);
    int rc = td_gguf_open(path, &g, err, sizeof err);
    TH_CHECKF(rc < 0 && g == NULL && err[0], "empty file: rc %d", rc);
    fprintf(stderr, "  empty file        -> %s (%s)\n", err, td_strerror(rc));
    unlink(path);

    /* a directory */
    err[0] = '\0';
    g = (td_gguf *)1;
    rc = td_gguf_open(dir, &g, err, sizeof err);
    TH_CHECKF(rc < 0 && g == NULL && err[0], "directory: rc %d", rc);
    fprintf(stderr, "  directory         -> %s (%s)\n", err, td_strerror(rc));

    /* a missing file */
    err[0] = '\0';
    snprintf(path, sizeof path, "%s/missing.gguf", dir);
    rc = td_gguf_open(path, &g, err, sizeof err);
    TH_CHECKF(rc == TD_ENOENT && g == NULL && err[0], "missing file: rc %d", rc);
    fprintf(stderr, "  missing file      -> %s (%s)\n", err, td_strerror(rc));

    /* a valid file through the mmap path, then truncated on disk */
    uint8_t buf[256];
    size_t n = build_minimal(buf, 3);
    snprintf(path, sizeof path, "%s/minimal.gguf", dir);
    f = fopen(path, "wb");
    TH_REQUIRE(f != NULL);
    TH_CHECK(fwrite(buf, 1, n, f) == n);
    fclose(f);
    rc = td_gguf_open(path, &g, err, sizeof err);
    TH_CHECKF(rc == 0 && g != NULL, "minimal file: rc %d %s", rc, err);
    if (g) {
        const td_gguf_tensor *t = td_gguf_find_tensor(g, "w");
        TH_CHECK(t && ((const float *)t->data)[2] == 2.5f);
        walk(g);
        td_gguf_close(g);
    }
    TH_CHECK(truncate(path, (off_t)n - 1) == 0);
    err[0] = '\0';
    rc = td_gguf_open(path, &g, err, sizeof err);
    TH_CHECKF(rc < 0 && g == NULL && err[0], "truncated file: rc %d", rc);
    fprintf(stderr, "  truncated on disk -> %s\n", err);
    unlink(path);
    rmdir(dir);

    /* no error buffer, and a tiny one: must not crash or overflow */
    uint8_t bad[8] = {'G', 'G', 'U', 'F', 9, 0, 0, 0};
    TH_CHECK(td_gguf_open_buffer(bad, sizeof bad, &g, NULL, 0) < 0 && g == NULL);
    char tiny[4] = {'x', 'x', 'x', 'x'};
    TH_CHECK(td_gguf_open_buffer(bad, sizeof bad, &g, tiny, 3) < 0 && g == NULL);
    TH_CHECK(tiny[2] == '\0' && tiny[3] == 'x');
    TH_CHECK(td_gguf_open_buffer(bad, 0, &g, NULL, 0) < 0 && g == NULL);
    td_gguf_close(NULL);
}

/* ---- the generated corpus ----------------------------------------------------------------- */

static void run_corpus(const char *dir)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/manifest.txt", dir);
    FILE *m = fopen(path, "r");
    TH_CHECKF(m != NULL, "cannot open %s: %s", path, strerror(errno));
    if (!m) return;
    char *line = NULL;
    size_t cap = 0;
    int n_total = 0, n_error = 0, n_ok = 0, bad = 0;
    while (getline(&line, &cap, m) > 0) {
        if (line[0] == '#' || line[0] == '\n') continue;
        char *expect = strtok(line, "\t");
        char *file = strtok(NULL, "\t");
        char *desc = strtok(NULL, "\n");
        TH_CHECKF(expect && file && desc, "bad manifest line %d", n_total + 1);
        if (!expect || !file || !desc) continue;
        n_total++;
        snprintf(path, sizeof path, "%s/%s", dir, file);
        uint8_t *buf;
        size_t size;
        if (read_file(path, &buf, &size)) {
            TH_CHECKF(0, "cannot read %s", path);
            bad++;
            continue;
        }
        td_gguf *g = NULL, *g2 = NULL;
        char err[512] = "", err2[512] = "";
        int rc = td_gguf_open_buffer(buf ? buf : (const uint8_t *)"", size, &g, err, sizeof err);
        int rc2 = td_gguf_open(path, &g2, err2, sizeof err2);
        bool ok_expected = !strcmp(expect, "ok"), any = !strcmp(expect, "any");
        bool good;
        if (rc == 0) {
            good = ok_expected || any;
            walk(g);
        } else {
            good = !ok_expected && err[0] && g == NULL;
        }
        /* the path and the buffer must agree (an empty file's message differs) */
        bool agree = (rc == 0) == (rc2 == 0);
        if (!good || !agree) bad++;
        fprintf(stderr, "  %s %-5s %-32s %s: %s\n", good && agree ? "ok  " : "FAIL", expect, file,
                desc, rc == 0 ? "opened" : err);
        if (!agree) fprintf(stderr, "       td_gguf_open disagrees: rc %d (%s)\n", rc2, err2);
        n_error += !strcmp(expect, "error");
        n_ok += ok_expected;
        td_gguf_close(g);
        td_gguf_close(g2);
        free(buf);
    }
    free(line);
    fclose(m);
    fprintf(stderr, "  corpus: %d files (%d must fail, %d must open), %d wrong\n", n_total, n_error,
            n_ok, bad);
    TH_CHECKF(n_error >= 50 && n_ok >= 1, "corpus too small: %d error / %d ok entries", n_error,
              n_ok);
    TH_CHECK(bad == 0);
}

/* ---- checking against gguf_expect.py --------------------------------------------------------- */

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* True if the hex text (or "-" for empty) spells exactly the len bytes at s. */
static bool hex_equals(const char *hex, const char *s, size_t len)
{
    if (!strcmp(hex, "-")) return len == 0;
    if (strlen(hex) != 2 * len) return false;
    for (size_t i = 0; i < len; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0 || (uint8_t)s[i] != (uint8_t)(hi * 16 + lo)) return false;
    }
    return true;
}

static void run_expect(const char *model, const char *expect_path)
{
    fprintf(stderr, "  checking %s against %s\n", model, expect_path);
    uint8_t *buf;
    size_t size;
    TH_REQUIRE(read_file(model, &buf, &size) == 0 && buf != NULL);
    td_gguf *g = NULL;
    char err[512] = "";
    int rc = td_gguf_open_buffer(buf, size, &g, err, sizeof err);
    TH_CHECKF(rc == 0, "%s: %s", model, err);
    FILE *f = fopen(expect_path, "r");
    TH_CHECKF(f != NULL, "cannot open %s", expect_path);
    if (rc || !f) {
        if (f) fclose(f);
        td_gguf_close(g);
        free(buf);
        return;
    }
    char *line = NULL;
    size_t cap = 0;
    int facts = 0, tensors = 0, before = th_failures;
    while (getline(&line, &cap, f) > 0) {
        line[strcspn(line, "\n")] = '\0';
        char *w[12] = {0};
        int nw = 0;
        for (char *tok = strtok(line, " "); tok && nw < 12; tok = strtok(NULL, " "))
            w[nw++] = tok;
        if (nw < 2) continue;
        facts++;
        const char *k = w[1];
        if (!strcmp(w[0], "version")) {
            TH_CHECK(td_gguf_version(g) == strtoul(w[1], NULL, 10));
        } else if (!strcmp(w[0], "alignment")) {
            TH_CHECK(td_gguf_alignment(g) == strtoul(w[1], NULL, 10));
        } else if (!strcmp(w[0], "n_kv")) {
            TH_CHECK(td_gguf_n_kv(g) == strtoul(w[1], NULL, 10));
        } else if (!strcmp(w[0], "n_tensors")) {
            TH_CHECK(td_gguf_n_tensors(g) == strtoul(w[1], NULL, 10));
        } else if (!strcmp(w[0], "kv") && nw == 4) {
            size_t i = strtoul(w[1], NULL, 10);
            const char *key = td_gguf_kv_key(g, i);
            TH_CHECKF(key && !strcmp(key, w[2]), "key %zu is '%s', expected '%s'", i,
                      key ? key : "(none)", w[2]);
            if (key)
                TH_CHECKF((unsigned)td_gguf_kv_type(g, i) == strtoul(w[3], NULL, 10),
                          "key '%s' type %d", key, (int)td_gguf_kv_type(g, i));
            TH_CHECK(td_gguf_find_kv(g, w[2]) == (int64_t)i);
        } else if (!strcmp(w[0], "uint") || !strcmp(w[0], "int")) {
            bool is_u = w[0][0] == 'u';
            uint64_t uv = strtoull(w[2], NULL, 10);
            int64_t sv = strtoll(w[2], NULL, 10);
            int64_t got;
            int r = td_gguf_get_i64(g, k, &got);
            if (is_u && uv > (uint64_t)INT64_MAX) {
                TH_CHECKF(r == TD_ERANGE, "'%s': %s must be out of range of get_i64 (rc %d)", k,
                          w[2], r);
            } else {
                int64_t want = is_u ? (int64_t)uv : sv;
                TH_CHECKF(r == 0 && got == want, "'%s': get_i64 rc %d %" PRId64 ", expected %s", k,
                          r, got, w[2]);
                uint32_t u32;
                r = td_gguf_get_u32(g, k, &u32);
                if (want >= 0 && want <= (int64_t)UINT32_MAX)
                    TH_CHECKF(r == 0 && u32 == (uint32_t)want, "'%s': get_u32 rc %d", k, r);
                else
                    TH_CHECKF(r == TD_ERANGE, "'%s': get_u32 of %s rc %d", k, w[2], r);
            }
            const char *s;
            size_t len;
            TH_CHECK(td_gguf_get_str(g, k, &s, &len) == TD_EFORMAT);
        } else if (!strcmp(w[0], "float")) {
            float got;
            int r = td_gguf_get_f32(g, k, &got);
            TH_CHECKF(r == 0 && td_fp32_to_bits(got) == strtoul(w[2], NULL, 10),
                      "'%s': get_f32 rc %d value %g", k, r, (double)got);
            int64_t iv;
            TH_CHECK(td_gguf_get_i64(g, k, &iv) == TD_EFORMAT);
        } else if (!strcmp(w[0], "bool")) {
            bool b;
            TH_CHECK(td_gguf_get_bool(g, k, &b) == 0 && b == (w[2][0] == '1'));
        } else if (!strcmp(w[0], "str") && nw == 4) {
            const char *s;
            size_t len;
            int r = td_gguf_get_str(g, k, &s, &len);
            TH_CHECKF(r == 0 && len == strtoull(w[2], NULL, 10) && hex_equals(w[3], s, len),
                      "'%s': get_str rc %d len %zu", k, r, len);
        } else if (!strcmp(w[0], "arr") && nw == 4) {
            td_gguf_vtype et;
            size_t n;
            int r = td_gguf_get_arr(g, k, &et, &n);
            TH_CHECKF(r == 0 && (unsigned)et == strtoul(w[2], NULL, 10) &&
                          n == strtoull(w[3], NULL, 10),
                      "'%s': get_arr rc %d type %d n %zu", k, r, (int)et, n);
        } else if (!strcmp(w[0], "arrstr") && nw == 5) {
            const char *s;
            size_t len;
            int r = td_gguf_arr_str(g, k, strtoull(w[2], NULL, 10), &s, &len);
            TH_CHECKF(r == 0 && len == strtoull(w[3], NULL, 10) && hex_equals(w[4], s, len),
                      "'%s'[%s]: arr_str rc %d", k, w[2], r);
        } else if (!strcmp(w[0], "arrint") && nw == 4) {
            size_t n = strtoull(w[2], NULL, 10);
            int32_t *v = malloc((n + 1) * sizeof *v);
            TH_REQUIRE(v != NULL);
            int r = td_gguf_arr_read_i32(g, k, v, n);
            int64_t sum = 0;
            for (size_t i = 0; r == 0 && i < n; i++)
                sum += v[i];
            TH_CHECKF(r == 0 && sum == strtoll(w[3], NULL, 10), "'%s': read_i32 rc %d sum %" PRId64,
                      k, r, sum);
            TH_CHECK(td_gguf_arr_read_i32(g, k, v, n + 1) == TD_ERANGE);
            free(v);
        } else if (!strcmp(w[0], "arrf32") && nw == 4) {
            td_gguf_vtype et;
            size_t n = 0, i = strtoull(w[2], NULL, 10);
            TH_REQUIRE(td_gguf_get_arr(g, k, &et, &n) == 0 && i < n);
            float *v = malloc(n * sizeof *v);
            TH_REQUIRE(v != NULL);
            int r = td_gguf_arr_read_f32(g, k, v, n);
            TH_CHECKF(r == 0 && td_fp32_to_bits(v[i]) == strtoul(w[3], NULL, 10),
                      "'%s'[%zu]: read_f32 rc %d", k, i, r);
            free(v);
        } else if (!strcmp(w[0], "tensor") && nw == 11) {
            tensors++;
            const td_gguf_tensor *t = td_gguf_find_tensor(g, w[1]);
            TH_CHECKF(t != NULL, "tensor '%s' not found", w[1]);
            if (!t) continue;
            bool dims_ok = (unsigned)t->type == strtoul(w[2], NULL, 10) && t->n_dims == atoi(w[3]);
            for (int d = 0; d < 4; d++)
                dims_ok = dims_ok && t->ne[d] == strtoll(w[4 + d], NULL, 10);
            TH_CHECKF(dims_ok, "tensor '%s': type %d, %d dims, ne %lld %lld %lld %lld", w[1],
                      (int)t->type, t->n_dims, (long long)t->ne[0], (long long)t->ne[1],
                      (long long)t->ne[2], (long long)t->ne[3]);
            size_t off = (size_t)((const uint8_t *)t->data - buf);
            TH_CHECKF(off == strtoull(w[8], NULL, 10) && t->nbytes == strtoull(w[9], NULL, 10),
                      "tensor '%s': data at %zu (+%zu bytes), expected %s (+%s)", w[1], off,
                      t->nbytes, w[8], w[9]);
            if (off + t->nbytes <= size)
                TH_CHECKF(checksum(t->data, t->nbytes) == strtoull(w[10], NULL, 10),
                          "tensor '%s': data checksum differs", w[1]);
        } else {
            TH_CHECKF(0, "unknown expect line kind '%s'", w[0]);
        }
    }
    free(line);
    fclose(f);
    TH_CHECKF(facts > 4 && tensors > 0, "%s: only %d facts, %d tensors", expect_path, facts,
              tensors);
    /* absent things stay absent */
    uint32_t u;
    TH_CHECK(td_gguf_find_kv(g, "tandem.no.such.key") == -1);
    TH_CHECK(td_gguf_get_u32(g, "tandem.no.such.key", &u) == TD_ENOENT);
    TH_CHECK(td_gguf_find_tensor(g, "no.such.tensor") == NULL);
    walk(g);
    fprintf(stderr, "  %d facts (%d tensors) checked, %d failed\n", facts, tensors,
            th_failures - before);
    td_gguf_close(g);
    free(buf);
}

/* Extra facts about the corpus's valid.gguf that gguf_expect.py cannot express. */
static void check_valid_extras(const char *model)
{
    uint8_t *buf;
    size_t size;
    TH_REQUIRE(read_file(model, &buf, &size) == 0 && buf != NULL);
    td_gguf *g = NULL;
    char err[256] = "";
    int rc = td_gguf_open_buffer(buf, size, &g, err, sizeof err);
    TH_CHECKF(rc == 0, "%s", err);
    if (g && td_gguf_find_kv(g, "tandem.test.i8") >= 0) {
        uint32_t u;
        int64_t v;
        float f;
        TH_CHECK(td_gguf_get_u32(g, "tandem.test.i8", &u) == TD_ERANGE); /* -100 */
        TH_CHECK(td_gguf_get_i64(g, "tandem.test.u64big", &v) == TD_ERANGE);
        TH_CHECK(td_gguf_get_f32(g, "tandem.test.f64", &f) == 0 && f == 2.25f);
        int32_t iv[3];
        TH_CHECK(td_gguf_arr_read_i32(g, "tandem.test.arr_i64", iv, 3) == 0 && iv[0] == 1 &&
                 iv[1] == -2 && iv[2] == 3);
        TH_CHECK(td_gguf_arr_read_f32(g, "tandem.test.arr_i64", (float *)iv, 3) == TD_EFORMAT);
        float fv[3];
        TH_CHECK(td_gguf_arr_read_f32(g, "tandem.test.arr_f32", fv, 3) == 0 && fv[1] == -2.5f);
        TH_CHECK(td_gguf_arr_read_i32(g, "tandem.test.arr_f32", iv, 3) == TD_EFORMAT);
        const char *s;
        size_t len;
        TH_CHECK(td_gguf_arr_str(g, "tandem.test.arr_f32", 0, &s, &len) == TD_EFORMAT);
    }
    td_gguf_close(g);
    free(buf);
}

int main(int argc, char **argv)
{
    TH_RUN(test_minimal_valid);
    TH_RUN(test_minimal_mutations);
    TH_RUN(test_files);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--corpus") && i + 1 < argc) {
            const char *dir = argv[++i];
            fprintf(stderr, "corpus %s\n", dir);
            int before = th_failures;
            run_corpus(dir);
            fprintf(stderr, "%s run_corpus\n", th_failures == before ? "ok  " : "FAIL");
        } else if (!strcmp(argv[i], "--expect") && i + 2 < argc) {
            const char *model = argv[i + 1], *expect = argv[i + 2];
            i += 2;
            int before = th_failures;
            run_expect(model, expect);
            check_valid_extras(model);
            fprintf(stderr, "%s run_expect %s\n", th_failures == before ? "ok  " : "FAIL", model);
        } else {
            fprintf(stderr, "usage: %s [--corpus DIR] [--expect FILE.gguf FILE.expect]...\n",
                    argv[0]);
            return 2;
        }
    }
    TH_EXIT();
}
