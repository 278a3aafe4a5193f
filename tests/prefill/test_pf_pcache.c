/* test_pf_pcache.c: the stage-profile cache (prefill-node/pf_pcache.h) and the profile's
 * stop flag (pf_profile.h), on the synthetic model: the key is stable and changes with
 * every input it names (threads, layers, KV dtype, chunk size, the CPU activation mode) but
 * not with the model file's path; a stored profile loads back bit for bit; every truncation, every
 * altered byte, another key's file, a huge file and a directory are refused with TD_EFORMAT and a
 * reason; store errors are reported, never a crash; the cache directory follows
 * TANDEM_CACHE / HOME; a profile stops before its next forward once the flag is set.
 * usage: test_pf_pcache MODEL.gguf
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../tharness.h"
#include "pf_pcache.h"
#include "pf_profile.h"
#include "td_clock.h"
#include "td_err.h"

static const char *model_path;
static char tmpdir[256];

static double now_ms(void)
{
    return (double)td_now_ns() * 1e-6;
}

static int open_shard(pf_shard *r, const char *path, int pp, int stage, int threads, td_dtype kv)
{
    pf_shard_params rp = {.model_path = path,
                          .pp = pp,
                          .stage = stage,
                          .threads = threads,
                          .ctx = 1024,
                          .kv_type = kv};
    return pf_shard_open(r, &rp);
}

static int key_of(const char *path, int pp, int stage, int threads, td_dtype kv, int chunk,
                  pf_pcache_key *k)
{
    pf_shard r;
    int rc = open_shard(&r, path, pp, stage, threads, kv);
    if (rc) return rc;
    pf_profile_params p = {.chunk_size = chunk};
    rc = pf_pcache_key_make(&r, path, &p, k);
    pf_shard_close(&r);
    return rc;
}

static char *read_file(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *b = malloc(1 << 16);
    *n = b ? fread(b, 1, 1 << 16, f) : 0;
    fclose(f);
    return b;
}

static void write_file(const char *path, const char *b, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fwrite(b, 1, n, f);
    fclose(f);
}

/* ---- key ---- */

static void test_key(void)
{
    pf_pcache_key a, b;
    TH_REQUIRE(key_of(model_path, 1, 0, 1, TD_F16, 128, &a) == 0);
    TH_REQUIRE(key_of(model_path, 1, 0, 1, TD_F16, 128, &b) == 0);
    TH_CHECK(a.hash == b.hash && !strcmp(a.desc, b.desc));
    fprintf(stderr, "  key %016llx:\n%s", (unsigned long long)a.hash, a.desc);
    TH_CHECK(strstr(a.desc, "threads 1\n") && strstr(a.desc, "layers [0, 6) of 6\n"));
    TH_CHECK(strstr(a.desc, "budget_ms 20000") && strstr(a.desc, "max_len 160 "));
    TH_CHECK(strstr(a.desc, "build exe ") && !strstr(a.desc, "build exe unknown"));
    TH_CHECK(strstr(a.desc, "\ncpu "));

    /* explicit defaults are the same profile */
    pf_shard r;
    TH_REQUIRE(open_shard(&r, model_path, 1, 0, 1, TD_F16) == 0);
    pf_profile_params p = {.chunk_size = 128, .max_len = 160, .budget_ms = 20000, .reps = 3};
    TH_CHECK(pf_pcache_key_make(&r, model_path, &p, &b) == 0 && b.hash == a.hash);
    p.budget_ms = 5000;
    TH_CHECK(pf_pcache_key_make(&r, model_path, &p, &b) == 0 && b.hash != a.hash);
    TH_CHECK(pf_pcache_key_make(&r, "/nonexistent/model.gguf", &p, &b) == TD_EIO);
    pf_shard_close(&r);

    /* every input changes it */
    TH_CHECK(key_of(model_path, 1, 0, 2, TD_F16, 128, &b) == 0 && b.hash != a.hash);
    TH_CHECK(strstr(b.desc, "threads 2\n") != NULL);
    TH_CHECK(key_of(model_path, 2, 0, 1, TD_F16, 128, &b) == 0 && b.hash != a.hash);
    TH_CHECK(strstr(b.desc, "layers [0, 3) of 6\n") != NULL);
    TH_CHECK(key_of(model_path, 2, 1, 1, TD_F16, 128, &b) == 0 && b.hash != a.hash);
    TH_CHECK(key_of(model_path, 1, 0, 1, TD_F32, 128, &b) == 0 && b.hash != a.hash);
    TH_CHECK(key_of(model_path, 1, 0, 1, TD_F16, 256, &b) == 0 && b.hash != a.hash);
    /* the CPU backend's activation mode (q8 prefills about twice as fast) */
    TH_REQUIRE(setenv("TANDEM_CPU_ACT", "q8", 1) == 0);
    TH_CHECK(key_of(model_path, 1, 0, 1, TD_F16, 128, &b) == 0 && b.hash != a.hash);
    TH_CHECK(strstr(b.desc, "q8 activations") != NULL && !strstr(a.desc, "q8 activations"));
    TH_REQUIRE(unsetenv("TANDEM_CPU_ACT") == 0);

    /* the same file elsewhere is the same model; path and mtime are not in the key */
    char copy[512];
    snprintf(copy, sizeof copy, "%s/copy.gguf", tmpdir);
    size_t n = 0;
    FILE *in = fopen(model_path, "rb"), *out = fopen(copy, "wb");
    TH_REQUIRE(in && out);
    char buf[65536];
    while ((n = fread(buf, 1, sizeof buf, in)) > 0)
        fwrite(buf, 1, n, out);
    fclose(in);
    fclose(out);
    TH_CHECK(key_of(copy, 1, 0, 1, TD_F16, 128, &b) == 0 && b.hash == a.hash);
    /* ...but one byte more is another file */
    out = fopen(copy, "ab");
    TH_REQUIRE(out);
    fputc(0, out);
    fclose(out);
    TH_CHECK(key_of(copy, 1, 0, 1, TD_F16, 128, &b) == 0 && b.hash != a.hash);
    unlink(copy);
}

/* ---- store / load ---- */

static pf_profile_result measured;
static pf_pcache_key key_a;
static char path_a[512];

static void test_roundtrip(void)
{
    pf_shard r;
    TH_REQUIRE(open_shard(&r, model_path, 1, 0, 1, TD_F16) == 0);
    pf_profile_params p = {.chunk_size = 128, .n_lengths = 8, .reps = 2, .budget_ms = 300};
    TH_CHECK(pf_profile_stage(&r, &p, &measured) == 0);
    TH_CHECK(pf_pcache_key_make(&r, model_path, &p, &key_a) == 0);
    pf_shard_close(&r);
    TH_REQUIRE(measured.n_lengths >= 3);

    char dir[300];
    snprintf(dir, sizeof dir, "%s/a/b/profiles", tmpdir); /* parents do not exist yet */
    TH_REQUIRE(pf_pcache_path(dir, &key_a, path_a, sizeof path_a) == 0);
    char why[256];
    pf_profile_result got;
    TH_CHECK(pf_pcache_load(path_a, &key_a, &got, why, sizeof why) == TD_ENOENT);
    TH_CHECK(pf_pcache_store(path_a, &key_a, &measured, why, sizeof why) == 0);
    TH_CHECKF(pf_pcache_load(path_a, &key_a, &got, why, sizeof why) == 0, "%s", why);
    TH_CHECK(got.n_lengths == measured.n_lengths && got.budget_hit == measured.budget_hit);
    for (int i = 0; i < got.n_lengths; i++)
        TH_CHECK(got.len[i] == measured.len[i] && got.ms[i] == measured.ms[i] &&
                 got.n_runs[i] == measured.n_runs[i]);
    TH_CHECK(fabs(got.elapsed_ms - measured.elapsed_ms) < 1e-3);
    TH_CHECK(got.fit.a == measured.fit.a && got.fit.b == measured.fit.b &&
             got.fit.c == measured.fit.c && got.fit.dynamic == measured.fit.dynamic);
    /* no temporary file left next to it */
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path_a, (long)getpid());
    TH_CHECK(access(tmp, F_OK) != 0);
    /* storing again replaces it */
    TH_CHECK(pf_pcache_store(path_a, &key_a, &measured, why, sizeof why) == 0);
    TH_CHECK(pf_pcache_load(path_a, &key_a, &got, why, sizeof why) == 0);
}

static void test_corrupt(void)
{
    size_t n;
    char *good = read_file(path_a, &n);
    TH_REQUIRE(good && n > 100);
    char bad[600], why[256];
    snprintf(bad, sizeof bad, "%s/bad.profile", tmpdir);
    pf_profile_result got;
    int accepted = 0, wrong_code = 0;
    for (size_t cut = 0; cut < n; cut++) { /* every truncation (a torn write) */
        write_file(bad, good, cut);
        int rc = pf_pcache_load(bad, &key_a, &got, why, sizeof why);
        accepted += rc == 0;
        wrong_code += rc != 0 && rc != TD_EFORMAT;
    }
    TH_CHECKF(accepted == 0 && wrong_code == 0, "%d truncations accepted, %d other codes", accepted,
              wrong_code);
    char *alt = malloc(n);
    TH_REQUIRE(alt);
    for (size_t i = 0; i < n; i++) { /* every single altered byte */
        memcpy(alt, good, n);
        alt[i] = alt[i] == '\n' ? ' ' : (char)(alt[i] ^ 0x01);
        write_file(bad, alt, n);
        int rc = pf_pcache_load(bad, &key_a, &got, why, sizeof why);
        accepted += rc == 0;
        wrong_code += rc != 0 && rc != TD_EFORMAT;
        if (rc == 0) fprintf(stderr, "  byte %zu altered: accepted\n", i);
    }
    TH_CHECKF(accepted == 0 && wrong_code == 0, "%d altered files accepted, %d other codes",
              accepted, wrong_code);
    free(alt);
    /* trailing garbage, a NUL, another key's file, a huge file, a directory */
    char *more = malloc(n + 8);
    TH_REQUIRE(more);
    memcpy(more, good, n);
    memcpy(more + n, "x\n", 2);
    write_file(bad, more, n + 2);
    TH_CHECK(pf_pcache_load(bad, &key_a, &got, why, sizeof why) == TD_EFORMAT);
    more[10] = 0;
    write_file(bad, more, n);
    TH_CHECK(pf_pcache_load(bad, &key_a, &got, why, sizeof why) == TD_EFORMAT);
    free(more);
    pf_pcache_key other = key_a;
    other.desc[strlen(other.desc) - 2] ^= 1; /* same length, one character off */
    TH_CHECK(pf_pcache_store(bad, &other, &measured, why, sizeof why) == 0);
    TH_CHECK(pf_pcache_load(bad, &key_a, &got, why, sizeof why) == TD_EFORMAT);
    TH_CHECKF(strstr(why, "another key") != NULL, "%s", why);
    TH_CHECK(got.n_lengths == 0); /* nothing half-filled */
    char *huge = calloc(1, 1 << 16);
    TH_REQUIRE(huge);
    memcpy(huge, good, n);
    write_file(bad, huge, 1 << 16);
    free(huge);
    TH_CHECK(pf_pcache_load(bad, &key_a, &got, why, sizeof why) == TD_EFORMAT);
    unlink(bad);
    TH_REQUIRE(mkdir(bad, 0755) == 0);
    TH_CHECK(pf_pcache_load(bad, &key_a, &got, why, sizeof why) == TD_EFORMAT);
    /* storing over a directory fails cleanly, and leaves no temporary file */
    TH_CHECK(pf_pcache_store(bad, &key_a, &measured, why, sizeof why) == TD_EIO);
    TH_CHECKF(strstr(why, "rename") != NULL, "%s", why);
    char tmp[700];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", bad, (long)getpid());
    TH_CHECK(access(tmp, F_OK) != 0);
    rmdir(bad);
    free(good);
}

static void test_store_errors(void)
{
    char file[400], path[600], why[256];
    snprintf(file, sizeof file, "%s/plain", tmpdir);
    write_file(file, "x", 1);
    snprintf(path, sizeof path, "%s/sub/stage-0.profile", file); /* parent is a file */
    TH_CHECK(pf_pcache_store(path, &key_a, &measured, why, sizeof why) == TD_EIO);
    TH_CHECKF(strstr(why, "directory") != NULL, "%s", why);
    pf_profile_result empty = {0};
    snprintf(path, sizeof path, "%s/empty.profile", tmpdir);
    TH_CHECK(pf_pcache_store(path, &key_a, &empty, why, sizeof why) == TD_EINVAL);
    TH_CHECK(access(path, F_OK) != 0);
    unlink(file);
}

static void test_dir(void)
{
    char *home = getenv("HOME") ? strdup(getenv("HOME")) : NULL;
    char *cache = getenv("TANDEM_CACHE") ? strdup(getenv("TANDEM_CACHE")) : NULL;
    char d[256];
    setenv("TANDEM_CACHE", "/x/y", 1);
    TH_CHECK(pf_pcache_dir(d, sizeof d) == 0 && !strcmp(d, "/x/y/profiles"));
    TH_CHECK(pf_pcache_dir(d, 8) == TD_ERANGE);
    setenv("TANDEM_CACHE", "", 1); /* empty: as unset */
    setenv("HOME", "/h", 1);
    TH_CHECK(pf_pcache_dir(d, sizeof d) == 0 && !strcmp(d, "/h/.cache/tandem/profiles"));
    unsetenv("TANDEM_CACHE");
    unsetenv("HOME");
    TH_CHECK(pf_pcache_dir(d, sizeof d) == TD_ENOENT);
    if (home) setenv("HOME", home, 1);
    if (cache) setenv("TANDEM_CACHE", cache, 1);
    free(home);
    free(cache);
    pf_pcache_key k = {.hash = 0xabcull};
    TH_CHECK(pf_pcache_path("/c", &k, d, sizeof d) == 0 &&
             !strcmp(d, "/c/stage-0000000000000abc.profile"));
    TH_CHECK(pf_pcache_path("/c", &k, d, 10) == TD_ERANGE);
}

/* ---- stop ---- */

static volatile sig_atomic_t stop_flag;

static void *set_stop(void *arg)
{
    (void)arg;
    usleep(150 * 1000);
    stop_flag = 1;
    return NULL;
}

static void test_stop(void)
{
    pf_shard r;
    TH_REQUIRE(open_shard(&r, model_path, 1, 0, 1, TD_F16) == 0);
    pf_profile_result res;
    stop_flag = 1; /* already set: not even the warm-up runs */
    pf_profile_params p = {.chunk_size = 512, .budget_ms = 60000, .stop = &stop_flag};
    double t0 = now_ms();
    TH_CHECK(pf_profile_stage(&r, &p, &res) == TD_ESTATE && res.stopped);
    TH_CHECK(res.n_lengths == 0 && now_ms() - t0 < 1000);
    /* set while it runs: it stops before the next forward (~100 ms each under ASan) */
    stop_flag = 0;
    pthread_t th;
    TH_REQUIRE(pthread_create(&th, NULL, set_stop, NULL) == 0);
    t0 = now_ms();
    int rc = pf_profile_stage(&r, &p, &res);
    double took = now_ms() - t0;
    pthread_join(th, NULL);
    fprintf(stderr, "  stopped after %.0f ms (flag set at 150 ms)\n", took);
    TH_CHECK(rc == TD_ESTATE && res.stopped && res.n_lengths == 0);
    TH_CHECKF(took < 150 + 3000, "%.0f ms", took);
    /* the shard is still usable: a profile without the flag completes */
    stop_flag = 0;
    p = (pf_profile_params){.chunk_size = 64, .n_lengths = 4, .reps = 1, .stop = &stop_flag};
    TH_CHECK(pf_profile_stage(&r, &p, &res) == 0 && !res.stopped && res.n_lengths == 4);
    pf_shard_close(&r);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: test_pf_pcache MODEL.gguf\n");
        return 2;
    }
    model_path = argv[1];
    unsetenv("TANDEM_CPU_ACT"); /* test_key's first keys are the float32 mode's */
    snprintf(tmpdir, sizeof tmpdir, "/tmp/test_pf_pcache.XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 2;
    }
    TH_RUN(test_key);
    TH_RUN(test_roundtrip);
    TH_RUN(test_corrupt);
    TH_RUN(test_store_errors);
    TH_RUN(test_dir);
    TH_RUN(test_stop);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd)) fprintf(stderr, "cannot remove %s\n", tmpdir);
    TH_EXIT();
}
