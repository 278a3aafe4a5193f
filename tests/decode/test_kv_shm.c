/* test_kv_shm.c: KV pools in POSIX shared memory (how a decode leader reaches its
 * followers' pools in disaggregated mode): another process maps the region and sees the
 * same bytes both ways; names are exclusive, unlinked by the mapper or by destroy; a
 * segment of the wrong size or a missing one is an error; a pool larger than /dev/shm is
 * a clean TD_ENOMEM at create (posix_fallocate), not a SIGBUS later; stale segments of
 * dead ranks are swept, live ones kept; a pool's file descriptor (named or memfd) maps the
 * same bytes.
 * usage: test_kv_shm
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../tharness.h"
#include "dc_xfer.h"
#include "kv_pool.h"
#include "td_err.h"

static char g_name[128];

static kn_kv_pool_params shape(void)
{
    return (kn_kv_pool_params){.n_layers = 2,
                               .n_kv_heads = 2,
                               .head_dim = 8,
                               .block_size = 16,
                               .n_blocks = 8,
                               .type = TD_F16,
                               .shm_name = g_name};
}

static bool name_exists(const char *name)
{
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd >= 0) close(fd);
    return fd >= 0;
}

static void test_shared_both_ways(void)
{
    kn_kv_pool_params p = shape();
    kn_kv_pool *pool;
    TH_REQUIRE(kn_kv_pool_create(&p, &pool) == 0);
    TH_CHECK(pool->region_bytes == kn_kv_pool_region_bytes(&p));
    TH_CHECK(name_exists(g_name));
    kn_kv_pool *again;
    TH_CHECK(kn_kv_pool_create(&p, &again) == TD_ESTATE); /* exclusive */
    memset(pool->k[1], 0x5a, pool->block_bytes);          /* layer 1, K, block 0 */
    pid_t child = fork();
    if (child == 0) {
        /* the mapper: sees the creator's bytes, writes its own, unlinks the name */
        void *r;
        size_t bytes;
        if (kn_kv_region_map(&p, true, &r, &bytes, NULL) || bytes != pool->region_bytes) _exit(1);
        const unsigned char *k1 =
            (const unsigned char *)r + ((char *)pool->k[1] - (char *)pool->region);
        if (k1[0] != 0x5a || k1[pool->block_bytes - 1] != 0x5a) _exit(2);
        memset((char *)r + ((char *)pool->v[0] - (char *)pool->region) + 3 * pool->block_bytes,
               0xa5, pool->block_bytes);
        kn_kv_region_unmap(r, bytes);
        _exit(0);
    }
    int st = -1;
    waitpid(child, &st, 0);
    TH_CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "mapper exited with %d", st);
    const unsigned char *v3 = (const unsigned char *)pool->v[0] + 3 * pool->block_bytes;
    TH_CHECK(v3[0] == 0xa5 && v3[pool->block_bytes - 1] == 0xa5 && v3[pool->block_bytes] == 0);
    TH_CHECK(!name_exists(g_name)); /* the mapper unlinked it; the memory lives on */
    kn_kv_pool_destroy(pool);       /* unlinking again is harmless */

    /* destroy removes a name nobody mapped */
    TH_REQUIRE(kn_kv_pool_create(&p, &pool) == 0);
    kn_kv_pool_destroy(pool);
    TH_CHECK(!name_exists(g_name));
}

/* The pool's file (kn_kv_pool_fd): a fd_backed pool's memfd and a named pool's segment
 * stay open with the pool and hold the region's bytes (a second mapping of the descriptor,
 * what kvxfer's shared-memory writer makes, sees and writes the same memory); a private
 * pool has none; kn_kv_region_map hands out the segment's descriptor on request. */
static void test_pool_files(void)
{
    kn_kv_pool_params p = shape();
    p.shm_name = NULL;
    kn_kv_pool *priv, *mfd, *named;
    TH_REQUIRE(kn_kv_pool_create(&p, &priv) == 0);
    TH_CHECK(kn_kv_pool_fd(priv) == -1);
    kn_kv_pool_destroy(priv);
    p.fd_backed = true;
    TH_REQUIRE(kn_kv_pool_create(&p, &mfd) == 0);
    kn_kv_pool_params q = shape();
    TH_REQUIRE(kn_kv_pool_create(&q, &named) == 0);
    kn_kv_pool *pools[2] = {mfd, named};
    for (int i = 0; i < 2; i++) {
        kn_kv_pool *pool = pools[i];
        int fd = kn_kv_pool_fd(pool);
        struct stat st;
        TH_REQUIRE(fd >= 0 && fstat(fd, &st) == 0);
        TH_CHECK((size_t)st.st_size == pool->region_bytes);
        unsigned char *m =
            mmap(NULL, pool->region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        TH_REQUIRE(m != MAP_FAILED);
        memset(pool->k[1], 0x33, pool->block_bytes);
        size_t k1 = (size_t)((char *)pool->k[1] - (char *)pool->region);
        TH_CHECK(m[k1] == 0x33 && m[k1 + pool->block_bytes - 1] == 0x33);
        m[0] = 0x77;
        TH_CHECK(((unsigned char *)pool->region)[0] == 0x77);
        munmap(m, pool->region_bytes);
    }
    void *r;
    size_t bytes;
    int fd = -1;
    TH_REQUIRE(kn_kv_region_map(&q, true, &r, &bytes, &fd) == 0);
    TH_CHECK(fd >= 0 && ((unsigned char *)r)[0] == 0x77);
    kn_kv_region_unmap(r, bytes);
    if (fd >= 0) close(fd);
    kn_kv_pool_destroy(mfd);
    kn_kv_pool_destroy(named);
}

static void test_map_errors(void)
{
    kn_kv_pool_params p = shape();
    void *r;
    size_t bytes;
    TH_CHECK(kn_kv_region_map(&p, false, &r, &bytes, NULL) == TD_ENOENT);
    kn_kv_pool *pool;
    TH_REQUIRE(kn_kv_pool_create(&p, &pool) == 0);
    kn_kv_pool_params other = p;
    other.n_blocks = 9;
    TH_CHECK(kn_kv_region_map(&other, true, &r, &bytes, NULL) == TD_EFORMAT);
    TH_CHECK(name_exists(g_name)); /* a failed map does not unlink */
    kn_kv_pool_params bad = p;
    bad.shm_name = "no-slash";
    kn_kv_pool *none;
    TH_CHECK(kn_kv_region_map(&bad, false, &r, &bytes, NULL) == TD_EINVAL);
    TH_CHECK(kn_kv_pool_create(&bad, &none) == TD_EINVAL && !none);
    kn_kv_pool_destroy(pool);
    TH_CHECK(!name_exists(g_name));
}

static void test_too_large_for_dev_shm(void)
{
    struct statvfs vs;
    if (statvfs("/dev/shm", &vs) || vs.f_blocks == 0) {
        fprintf(stderr, "  /dev/shm has no size limit: skipped\n");
        return;
    }
    double limit = (double)vs.f_blocks * (double)vs.f_frsize;
    kn_kv_pool_params p = shape();
    p.head_dim = 1024;
    p.type = TD_F32;
    /* 2 layers x K/V x 2 heads x 16 x 1024 x 4 bytes = 512 KiB per block */
    double per_block = 2.0 * 2 * 2 * 16 * 1024 * 4;
    double want = 2 * limit / per_block + 1;
    if (want > 1 << 30) {
        fprintf(stderr, "  /dev/shm too large to exceed: skipped\n");
        return;
    }
    p.n_blocks = (int)want;
    kn_kv_pool *pool;
    TH_CHECK(kn_kv_pool_create(&p, &pool) == TD_ENOMEM);
    TH_CHECK(!name_exists(g_name)); /* nothing left behind */
}

static void test_names_and_sweep(void)
{
    char name[256];
    TH_CHECK(dc_xfer_kv_shm_name("d0", "p9000", 2, 1234, name, sizeof name) == 0);
    TH_CHECK(!strcmp(name, "/tandem-kv-d0-p9000-r2-1234"));
    TH_CHECK(dc_xfer_kv_shm_name("d0", "p9000", 2, 1234, name, 10) == TD_ERANGE);

    /* a dead rank's segment goes, a live one (ours) and another instance's stay */
    pid_t child = fork();
    if (child == 0) _exit(0);
    waitpid(child, NULL, 0);
    char dead[256], live[256], other[256];
    char inst[64];
    snprintf(inst, sizeof inst, "sw%d", (int)getpid());
    dc_xfer_kv_shm_name(inst, "p1", 1, (int)child, dead, sizeof dead);
    dc_xfer_kv_shm_name(inst, "p1", 2, (int)getpid(), live, sizeof live);
    dc_xfer_kv_shm_name(inst, "p2", 1, (int)child, other, sizeof other);
    const char *all[] = {dead, live, other};
    for (int i = 0; i < 3; i++) {
        int fd = shm_open(all[i], O_RDWR | O_CREAT | O_EXCL, 0600);
        TH_REQUIRE(fd >= 0);
        close(fd);
    }
    dc_xfer_kv_shm_sweep(inst, "p1");
    TH_CHECK(!name_exists(dead));
    TH_CHECK(name_exists(live));
    TH_CHECK(name_exists(other));
    shm_unlink(live);
    shm_unlink(other);
}

int main(void)
{
    snprintf(g_name, sizeof g_name, "/tandem-test-kvshm-%d", (int)getpid());
    TH_RUN(test_shared_both_ways);
    TH_RUN(test_pool_files);
    TH_RUN(test_map_errors);
    TH_RUN(test_too_large_for_dev_shm);
    TH_RUN(test_names_and_sweep);
    shm_unlink(g_name);
    TH_EXIT();
}
