/* test_kvx_pipe.c: the pipe's contract, run on the fake and on UCX (two workers in one
 * process, over tcp and over shared memory): exported bytes, puts + flush, active
 * messages, tagged messages, malformed input, injected faults, an idle wait that sleeps. */
#define _GNU_SOURCE /* memfd_create */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvx_pipe.h"
#include "kvx_wire.h"
#include "td_clock.h"
#include "tharness.h"

typedef struct {
    int n, status;
    size_t len;
} done_rec;

static void on_done(void *arg, int status, size_t len)
{
    done_rec *d = arg;
    d->n++;
    d->status = status;
    d->len = len;
}

typedef struct {
    int n;
    char last[64];
} am_rec;

static void on_am(void *arg, const void *data, size_t len)
{
    am_rec *a = arg;
    a->n++;
    memset(a->last, 0, sizeof(a->last));
    memcpy(a->last, data, len < sizeof(a->last) - 1 ? len : sizeof(a->last) - 1);
}

typedef struct {
    int n;
    kvx_peer peer;
    int status;
} err_rec;

static void on_peer_err(void *arg, kvx_peer peer, int status)
{
    err_rec *e = arg;
    e->n++;
    e->peer = peer;
    e->status = status;
}

/* Progress both pipes until *flag >= want or 5 s pass. */
static int pump(kvx_pipe *a, kvx_pipe *b, const int *flag, int want)
{
    int64_t end = td_now_ms() + 5000;
    while (*flag < want && td_now_ms() < end) {
        kvx_pipe_progress(a);
        if (b) kvx_pipe_progress(b);
    }
    return *flag >= want;
}

static double cpu_seconds(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec +
           (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

/* A sender thread for the wake-on-arrival check: after 50 ms, one active message from a,
 * then a's progress until it completed (the pipes are distinct, so two threads may each
 * drive one). */
typedef struct {
    kvx_pipe *a;
    kvx_peer ab;
    done_rec sent;
    int64_t sent_ns;
} late_send;

static void *late_send_main(void *v)
{
    late_send *s = v;
    usleep(50000);
    s->sent_ns = td_now_ns();
    if (kvx_pipe_am_send(s->a, s->ab, 3, "late", 4, on_done, &s->sent)) return NULL;
    int64_t end = td_now_ms() + 5000;
    while (!s->sent.n && td_now_ms() < end)
        kvx_pipe_wait(s->a, 10);
    return NULL;
}

static double thread_cpu_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* A sleeping wait wakes when a message arrives, long before its timeout, and costs next to
 * no CPU time meanwhile. */
static void check_wake_on_arrival(kvx_pipe *a, kvx_pipe *b, kvx_peer ab, am_rec *am)
{
    int before = am->n;
    late_send s = {.a = a, .ab = ab};
    pthread_t th;
    TH_REQUIRE(pthread_create(&th, NULL, late_send_main, &s) == 0);
    double c0 = thread_cpu_ms();
    int64_t end = td_now_ms() + 3000;
    while (am->n == before && td_now_ms() < end)
        kvx_pipe_wait(b, 2000);
    int64_t woke = td_now_ns();
    double used = thread_cpu_ms() - c0;
    pthread_join(th, NULL);
    TH_CHECKF(am->n == before + 1 && !strcmp(am->last, "late"), "the late message not received");
    double lat_ms = (woke - s.sent_ns) / 1e6;
    printf("  wake on arrival: %.3f ms after the send, %.2f ms of CPU while waiting\n", lat_ms,
           used);
    TH_CHECKF(lat_ms < 500, "a wait woke %.1f ms after the message was sent", lat_ms);
    TH_CHECKF(used < 20, "a sleeping wait used %.1f ms of CPU time", used);
}

typedef int (*make_fn)(const kvx_pipe_params *, kvx_pipe **);
static kvx_fake_fabric *g_fab;
static const char *g_tls;
static const char *g_host; /* kvx_pipe_params.host of make_ucx's pipes */
static int make_fake(const kvx_pipe_params *pp, kvx_pipe **out)
{
    return kvx_pipe_fake_create(g_fab, pp, out);
}
static int make_ucx(const kvx_pipe_params *pp, kvx_pipe **out)
{
    kvx_pipe_params q = *pp;
    q.tls = g_tls;
    q.host = g_host;
    return kvx_pipe_ucx_create(&q, out);
}

/* The contract every implementation keeps. */
static void contract(make_fn make, const char *what)
{
    fprintf(stderr, "  pipe contract on %s\n", what);
    err_rec ea = {0}, eb = {0};
    kvx_pipe_params pa = {.peer_err_cb = on_peer_err, .peer_err_arg = &ea};
    kvx_pipe_params pb = {.peer_err_cb = on_peer_err, .peer_err_arg = &eb};
    kvx_pipe *a = NULL, *b = NULL;
    TH_REQUIRE(make(&pa, &a) == 0);
    if (make(&pb, &b) != 0) {
        kvx_pipe_destroy(a);
        TH_REQUIRE(0);
    }

    uint8_t addr_b[KVX_ADDR_MAX], addr_a[KVX_ADDR_MAX];
    size_t la = 0, lb = 0;
    TH_CHECK(kvx_pipe_address(b, addr_b, sizeof(addr_b), &lb) == 0);
    TH_CHECK(kvx_pipe_address(a, addr_a, sizeof(addr_a), &la) == 0);
    TH_CHECK(kvx_pipe_address(a, addr_a, 8, &la) == TD_ERANGE);
    TH_CHECK(kvx_pipe_address(a, addr_a, sizeof(addr_a), &la) == 0);

    /* malformed addresses: truncated, corrupted, garbage, empty */
    kvx_peer bad;
    TH_CHECK(kvx_pipe_connect(a, addr_b, lb - 1, &bad) < 0);
    TH_CHECK(kvx_pipe_connect(a, addr_b, 3, &bad) < 0);
    TH_CHECK(kvx_pipe_connect(a, NULL, 0, &bad) < 0);
    uint8_t corrupt[KVX_ADDR_MAX];
    memcpy(corrupt, addr_b, lb);
    corrupt[lb - 1] ^= 0x5a;
    TH_CHECK(kvx_pipe_connect(a, corrupt, lb, &bad) < 0);

    kvx_peer ab, ba;
    TH_REQUIRE(kvx_pipe_connect(a, addr_b, lb, &ab) == 0);
    TH_REQUIRE(kvx_pipe_connect(b, addr_a, la, &ba) == 0);
    TH_CHECK(kvx_pipe_peer_status(a, ab) == 0);

    /* b registers a region, a puts into it */
    size_t region_len = 1 << 20;
    uint8_t *region = calloc(1, region_len);
    uint8_t *src = malloc(region_len);
    for (size_t i = 0; i < region_len; i++)
        src[i] = (uint8_t)(i * 131 + 7);
    kvx_mem *mem = NULL;
    TH_REQUIRE(kvx_pipe_mem_reg(b, region, region_len, &mem) == 0);
    uint8_t rkb[KVX_RKEY_MAX];
    size_t rkl = 0;
    TH_CHECK(kvx_pipe_rkey_pack(b, mem, rkb, sizeof(rkb), &rkl) == 0);
    kvx_rkey *rk = NULL;
    TH_CHECK(kvx_pipe_rkey_unpack(a, ab, rkb, rkl - 2, &rk) < 0);
    TH_CHECK(kvx_pipe_rkey_unpack(a, ab, rkb, 0, &rk) < 0);
    TH_REQUIRE(kvx_pipe_rkey_unpack(a, ab, rkb, rkl, &rk) == 0);

    TH_CHECK(kvx_pipe_put(a, ab, src, 4096, (uint64_t)(uintptr_t)region, rk) == 0);
    TH_CHECK(kvx_pipe_put(a, ab, src + 8192, region_len - 8192,
                          (uint64_t)(uintptr_t)(region + 8192), rk) == 0);
    done_rec fl = {0};
    TH_CHECK(kvx_pipe_flush(a, ab, on_done, &fl) == 0);
    TH_CHECK(fl.n == 0); /* never from inside the call */
    TH_CHECK(pump(a, b, &fl.n, 1));
    TH_CHECK(fl.status == 0);
    TH_CHECK(memcmp(region, src, 4096) == 0);
    TH_CHECK(region[4096] == 0 && region[8191] == 0);
    TH_CHECK(memcmp(region + 8192, src + 8192, region_len - 8192) == 0);

    /* active messages, in order */
    am_rec am = {0};
    TH_CHECK(kvx_pipe_set_am_handler(b, 3, on_am, &am) == 0);
    TH_CHECK(kvx_pipe_set_am_handler(b, KVX_AM_IDS, on_am, &am) == TD_EINVAL);
    done_rec sd = {0};
    TH_CHECK(kvx_pipe_am_send(a, ab, 3, "hello", 5, on_done, &sd) == 0);
    TH_CHECK(kvx_pipe_am_send(a, ab, 3, "world", 5, NULL, NULL) == 0);
    TH_CHECK(pump(a, b, &am.n, 2));
    TH_CHECK(strcmp(am.last, "world") == 0);
    TH_CHECK(pump(a, b, &sd.n, 1) && sd.status == 0);
    static uint8_t big[KVX_AM_MAX + 1];
    TH_CHECK(kvx_pipe_am_send(a, ab, 3, big, sizeof(big), NULL, NULL) == TD_EINVAL);

    /* tagged: posted before and after the send; a too-small buffer is TD_ERANGE */
    char rbuf[64] = {0};
    done_rec rv = {0}, ts = {0};
    TH_CHECK(kvx_pipe_tag_recv(b, 77, rbuf, sizeof(rbuf), on_done, &rv) == 0);
    TH_CHECK(kvx_pipe_tag_send(a, ab, 77, "activation", 10, on_done, &ts) == 0);
    TH_CHECK(pump(a, b, &rv.n, 1));
    TH_CHECK(rv.status == 0 && rv.len == 10 && memcmp(rbuf, "activation", 10) == 0);
    TH_CHECK(pump(a, b, &ts.n, 1) && ts.status == 0);
    done_rec rv2 = {0}, ts2 = {0};
    TH_CHECK(kvx_pipe_tag_send(b, ba, 5, "back", 4, on_done, &ts2) == 0);
    for (int i = 0; i < 50; i++) {
        kvx_pipe_progress(a);
        kvx_pipe_progress(b);
    }
    TH_CHECK(kvx_pipe_tag_recv(a, 5, rbuf, sizeof(rbuf), on_done, &rv2) == 0);
    TH_CHECK(pump(a, b, &rv2.n, 1));
    TH_CHECK(rv2.status == 0 && rv2.len == 4 && memcmp(rbuf, "back", 4) == 0);
    TH_CHECK(pump(a, b, &ts2.n, 1));

    /* an idle wait sleeps: 300 ms of waiting costs far less than 300 ms of CPU */
    for (int i = 0; i < 20; i++) {
        kvx_pipe_progress(a);
        kvx_pipe_progress(b);
    }
    double c0 = cpu_seconds();
    int64_t t0 = td_now_ms();
    while (td_now_ms() - t0 < 300)
        TH_CHECK(kvx_pipe_wait(a, 100) >= 0);
    double used = cpu_seconds() - c0;
    TH_CHECKF(used < 0.1, "idle wait used %.3f s of CPU in 0.3 s", used);

    check_wake_on_arrival(a, b, ab, &am);

    /* a signal wakes a waiter at once */
    kvx_pipe_signal(a);
    int64_t t1 = td_now_ms();
    kvx_pipe_wait(a, 2000);
    TH_CHECKF(td_now_ms() - t1 < 1000, "signal did not wake the wait");

    kvx_pipe_stats st;
    kvx_pipe_rkey_destroy(a, rk);
    kvx_pipe_mem_dereg(b, mem);
    kvx_pipe_disconnect(a, ab, false);
    kvx_pipe_disconnect(b, ba, false);
    for (int i = 0; i < 20; i++) {
        kvx_pipe_progress(a);
        kvx_pipe_progress(b);
    }
    kvx_pipe_stats_get(a, &st);
    TH_CHECK(st.peers == 0 && st.mems == 0 && st.rkeys == 0 && st.pending_ops == 0);
    kvx_pipe_stats_get(b, &st);
    TH_CHECK(st.peers == 0 && st.mems == 0 && st.rkeys == 0 && st.pending_ops == 0);
    kvx_pipe_destroy(a);
    kvx_pipe_destroy(b);
    free(region);
    free(src);
}

static void test_fake_contract(void)
{
    TH_REQUIRE(kvx_fake_fabric_create(&g_fab) == 0);
    contract(make_fake, "fake");
    kvx_fake_fabric_destroy(g_fab);
}

static void test_ucx_contract_tcp(void)
{
    g_tls = "tcp";
    contract(make_ucx, "ucx tcp");
}

/* The pipes bound to the loopback device: host 127.0.0.1 -> NET_DEVICES lo (unless the
 * environment sets UCX_NET_DEVICES). */
static void test_ucx_contract_tcp_lo(void)
{
    g_tls = "tcp";
    g_host = "127.0.0.1";
    contract(make_ucx, "ucx tcp on the loopback device");
    g_host = NULL;
}

/* kvx_net_devices_for_host against this machine's interfaces (getifaddrs). */
static void test_net_devices(void)
{
    char lo[IF_NAMESIZE] = "", buf[256];
    struct ifaddrs *ifs = NULL;
    TH_REQUIRE(getifaddrs(&ifs) == 0);
    for (struct ifaddrs *i = ifs; i; i = i->ifa_next)
        if ((i->ifa_flags & IFF_LOOPBACK) && (i->ifa_flags & IFF_UP) && !lo[0])
            snprintf(lo, sizeof lo, "%s", i->ifa_name);
    TH_CHECK(kvx_net_devices_for_host("127.0.0.1", buf, sizeof buf) == 0 && !strcmp(buf, lo));
    TH_CHECK(kvx_net_devices_for_host("127.0.0.5", buf, sizeof buf) == 0 && !strcmp(buf, lo));
    TH_CHECK(kvx_net_devices_for_host("localhost", buf, sizeof buf) == 0 && !strcmp(buf, lo));
    /* every other IPv4 address of this machine -> the interface that has it */
    int n_addr = 0;
    for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_LOOPBACK) ||
            !(i->ifa_flags & IFF_UP))
            continue;
        char ip[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &((struct sockaddr_in *)i->ifa_addr)->sin_addr, ip, sizeof ip);
        int rc = kvx_net_devices_for_host(ip, buf, sizeof buf);
        TH_CHECKF(rc == 0 && strstr(buf, i->ifa_name), "%s: rc %d, devices '%s', want %s", ip, rc,
                  buf, i->ifa_name);
        fprintf(stderr, "  %s -> %s\n", ip, buf);
        n_addr++;
    }
    fprintf(stderr, "  %d non-loopback IPv4 address(es) checked\n", n_addr);
    freeifaddrs(ifs);
    TH_CHECK(kvx_net_devices_for_host("0.0.0.0", buf, sizeof buf) == TD_EINVAL);
    TH_CHECK(kvx_net_devices_for_host("::", buf, sizeof buf) == TD_EINVAL);
    TH_CHECK(kvx_net_devices_for_host("", buf, sizeof buf) == TD_EINVAL);
    TH_CHECK(kvx_net_devices_for_host(NULL, buf, sizeof buf) == TD_EINVAL);
    /* an address no interface here has (TEST-NET-3), a name that does not resolve */
    TH_CHECK(kvx_net_devices_for_host("203.0.113.77", buf, sizeof buf) == TD_ENOENT);
    TH_CHECK(kvx_net_devices_for_host("no-such-host.invalid", buf, sizeof buf) == TD_ENOENT);
    TH_CHECK(kvx_net_devices_for_host("127.0.0.1", buf, 2) == TD_ERANGE);
}

static void test_ucx_contract_sm(void)
{
    g_tls = getenv("KVX_TEST_SM_TLS") ? getenv("KVX_TEST_SM_TLS") : "posix,cma,self";
    contract(make_ucx, g_tls);
}

/* Faults the fake injects: out-of-bounds puts, failing puts, a killed peer. */
static void test_fake_faults(void)
{
    kvx_fake_fabric *f;
    TH_REQUIRE(kvx_fake_fabric_create(&f) == 0);
    err_rec ea = {0}, eb = {0};
    kvx_pipe_params pa = {.peer_err_cb = on_peer_err, .peer_err_arg = &ea};
    kvx_pipe_params pb = {.peer_err_cb = on_peer_err, .peer_err_arg = &eb};
    kvx_pipe *a, *b, *c;
    TH_REQUIRE(kvx_pipe_fake_create(f, &pa, &a) == 0);
    TH_REQUIRE(kvx_pipe_fake_create(f, &pb, &b) == 0);
    TH_REQUIRE(kvx_pipe_fake_create(f, NULL, &c) == 0);
    uint8_t addr[KVX_ADDR_MAX], rkb[KVX_RKEY_MAX];
    size_t n, rkl;
    kvx_peer ab, ba, ac;
    TH_REQUIRE(kvx_pipe_address(b, addr, sizeof(addr), &n) == 0);
    TH_REQUIRE(kvx_pipe_connect(a, addr, n, &ab) == 0);
    TH_REQUIRE(kvx_pipe_address(c, addr, sizeof(addr), &n) == 0);
    TH_REQUIRE(kvx_pipe_connect(a, addr, n, &ac) == 0);
    TH_REQUIRE(kvx_pipe_address(a, addr, sizeof(addr), &n) == 0);
    TH_REQUIRE(kvx_pipe_connect(b, addr, n, &ba) == 0);

    uint8_t region[256] = {0}, src[256];
    memset(src, 0xab, sizeof(src));
    kvx_mem *m;
    kvx_rkey *rk, *rk_wrong;
    TH_REQUIRE(kvx_pipe_mem_reg(b, region, sizeof(region), &m) == 0);
    TH_REQUIRE(kvx_pipe_rkey_pack(b, m, rkb, sizeof(rkb), &rkl) == 0);
    TH_REQUIRE(kvx_pipe_rkey_unpack(a, ab, rkb, rkl, &rk) == 0);
    /* an rkey of b cannot be used towards c */
    TH_CHECK(kvx_pipe_rkey_unpack(a, ac, rkb, rkl, &rk_wrong) == TD_EINVAL);

    TH_CHECK(kvx_pipe_put(a, ab, src, 16, (uint64_t)(uintptr_t)(region + 250), rk) == TD_ERANGE);
    TH_CHECK(kvx_pipe_put(a, ab, src, 16, (uint64_t)(uintptr_t)region - 1, rk) == TD_ERANGE);
    TH_CHECK(kvx_pipe_put(a, ab, src, 16, (uint64_t)(uintptr_t)(region + 240), rk) == 0);
    TH_CHECK(region[255] == 0xab && region[239] == 0);

    /* the third put fails: the flush reports it and the peer fails once */
    kvx_pipe_fake_fail_puts_after(a, 1);
    TH_CHECK(kvx_pipe_put(a, ab, src, 8, (uint64_t)(uintptr_t)region, rk) == 0);
    TH_CHECK(kvx_pipe_put(a, ab, src, 8, (uint64_t)(uintptr_t)region, rk) == 0);
    done_rec fl = {0};
    TH_CHECK(kvx_pipe_flush(a, ab, on_done, &fl) == 0);
    TH_CHECK(pump(a, b, &fl.n, 1) && fl.status == TD_EIO);
    TH_CHECK(pump(a, b, &ea.n, 1) && ea.peer == ab);
    TH_CHECK(kvx_pipe_peer_status(a, ab) == TD_EIO);
    TH_CHECK(kvx_pipe_put(a, ab, src, 8, (uint64_t)(uintptr_t)region, rk) < 0);
    kvx_pipe_fake_fail_puts_after(a, -1);

    /* a dies: b's endpoint to a fails, and b's wait wakes up for it */
    kvx_pipe_fake_kill(a);
    TH_CHECK(kvx_pipe_wait(b, 1000) >= 0);
    TH_CHECK(eb.n == 1 && eb.peer == ba && eb.status == TD_EIO);
    TH_CHECK(kvx_pipe_am_send(b, ba, 0, "x", 1, NULL, NULL) == TD_EIO);
    TH_CHECK(kvx_pipe_fake_puts(a) == 6);

    kvx_pipe_mem_dereg(b, m);
    kvx_pipe_destroy(a);
    kvx_pipe_destroy(b);
    kvx_pipe_destroy(c);
    kvx_fake_fabric_destroy(f);
}

/* UCX: a peer that goes away makes the survivor's operations fail, not hang. */
static void test_ucx_peer_gone(void)
{
    err_rec ea = {0};
    kvx_pipe_params pa = {.peer_err_cb = on_peer_err, .peer_err_arg = &ea, .tls = "tcp"};
    kvx_pipe_params pb = {.tls = "tcp"};
    kvx_pipe *a, *b;
    TH_REQUIRE(kvx_pipe_ucx_create(&pa, &a) == 0);
    TH_REQUIRE(kvx_pipe_ucx_create(&pb, &b) == 0);
    uint8_t addr[KVX_ADDR_MAX];
    size_t n;
    kvx_peer ab;
    TH_REQUIRE(kvx_pipe_address(b, addr, sizeof(addr), &n) == 0);
    TH_REQUIRE(kvx_pipe_connect(a, addr, n, &ab) == 0);
    am_rec am = {0};
    TH_REQUIRE(kvx_pipe_set_am_handler(b, 1, on_am, &am) == 0);
    TH_REQUIRE(kvx_pipe_am_send(a, ab, 1, "hi", 2, NULL, NULL) == 0);
    TH_CHECK(pump(a, b, &am.n, 1));
    kvx_pipe_destroy(b);
    int64_t end = td_now_ms() + 10000;
    int sent = 0;
    while (!ea.n && td_now_ms() < end) {
        if (sent < 100 && kvx_pipe_am_send(a, ab, 1, "hi", 2, NULL, NULL) == 0) sent++;
        kvx_pipe_wait(a, 50);
    }
    TH_CHECKF(ea.n == 1, "no peer error after the peer went away");
    TH_CHECK(kvx_pipe_peer_status(a, ab) < 0);
    kvx_pipe_disconnect(a, ab, false);
    kvx_pipe_stats st;
    kvx_pipe_stats_get(a, &st);
    TH_CHECK(st.peers == 0 && st.pending_ops == 0);
    kvx_pipe_destroy(a);
}

/* Two pipes, a connected to b, b holding a registered region whose rkey a unpacked; the
 * region is private memory, or (fd >= 0) a memfd mapped shared and registered with it. */
typedef struct {
    kvx_pipe *a, *b;
    kvx_peer ab;
    uint8_t *region;
    size_t len;
    int fd;
    kvx_mem *mem;
    kvx_rkey *rk;
    err_rec ea;
} tcp_pair;

static int pair_open_mem(tcp_pair *t, size_t len, const char *tls, bool memfd)
{
    memset(t, 0, sizeof(*t));
    t->fd = memfd ? memfd_create("test-kvx", MFD_CLOEXEC) : -1;
    if (memfd && (t->fd < 0 || ftruncate(t->fd, (off_t)len))) return -1;
    kvx_pipe_params pa = {.peer_err_cb = on_peer_err, .peer_err_arg = &t->ea, .tls = tls};
    kvx_pipe_params pb = {.tls = tls};
    uint8_t buf[KVX_ADDR_MAX];
    size_t n;
    t->len = len;
    t->region = mmap(NULL, len, PROT_READ | PROT_WRITE,
                     memfd ? MAP_SHARED : MAP_PRIVATE | MAP_ANONYMOUS, t->fd, 0);
    if (t->region == MAP_FAILED) t->region = NULL;
    if (!t->region || kvx_pipe_ucx_create(&pa, &t->a) || kvx_pipe_ucx_create(&pb, &t->b)) return -1;
    if (kvx_pipe_address(t->b, buf, sizeof(buf), &n) || kvx_pipe_connect(t->a, buf, n, &t->ab))
        return -1;
    if (kvx_pipe_mem_reg_fd(t->b, t->region, len, t->fd, 0, &t->mem) ||
        kvx_pipe_rkey_pack(t->b, t->mem, buf, sizeof(buf), &n) ||
        kvx_pipe_rkey_unpack(t->a, t->ab, buf, n, &t->rk))
        return -1;
    return 0;
}

static int tcp_pair_open(tcp_pair *t, size_t len)
{
    return pair_open_mem(t, len, "tcp", false);
}

static void pair_unmap(tcp_pair *t)
{
    if (t->region) munmap(t->region, t->len);
    if (t->fd >= 0) close(t->fd);
}

static void pair_close(tcp_pair *t)
{
    kvx_pipe_rkey_destroy(t->a, t->rk);
    kvx_pipe_disconnect(t->a, t->ab, false);
    kvx_pipe_mem_dereg(t->b, t->mem);
    kvx_pipe_destroy(t->a);
    kvx_pipe_destroy(t->b);
    pair_unmap(t);
}

/* Over shared memory puts are copied into the receiver's memory by the sender
 * (kvx_pipe_ucx_cma.c): into its mapping of the region's file (memfd), or written into the
 * process (private memory). They land, and their flush completes, while the receiver never
 * progresses (once the endpoint is wired up); more puts than one batch of writes holds
 * (KVXI_CMA_IOV) land whole, in any order; a message sent after puts (no flush between)
 * finds their bytes there; a put outside the region is refused at once and copies nothing.
 * Mapped, a put has landed when it returns. */
static void one_sided(bool memfd, bool mapped)
{
    const char *tls = getenv("KVX_TEST_SM_TLS") ? getenv("KVX_TEST_SM_TLS") : "posix,cma,self";
    fprintf(stderr, "  one-sided puts into %s\n", memfd ? "a memfd" : "private memory");
    tcp_pair t;
    TH_REQUIRE(pair_open_mem(&t, 1 << 20, tls, memfd) == 0);
    enum { PIECE = 512, N = (1 << 20) / PIECE }; /* 2048 pieces: two batches */
    uint8_t *src = malloc(t.len);
    TH_REQUIRE(src);
    for (size_t i = 0; i < t.len; i++)
        src[i] = (uint8_t)(i * 29 + 3);
    uint64_t base = (uint64_t)(uintptr_t)t.region;
    /* a first flush with both sides progressing: UCX's endpoint wire-up needs b once */
    done_rec fl0 = {0};
    TH_CHECK(kvx_pipe_flush(t.a, t.ab, on_done, &fl0) == 0);
    TH_CHECK(pump(t.a, t.b, &fl0.n, 1) && fl0.status == 0);
    for (int k = 0; k < N; k++) { /* odd pieces first, then even: not one run */
        int i = k < N / 2 ? 2 * k + 1 : 2 * (k - N / 2);
        TH_CHECK(kvx_pipe_put(t.a, t.ab, src + (size_t)i * PIECE, PIECE, base + (uint64_t)i * PIECE,
                              t.rk) == 0);
    }
    if (mapped) TH_CHECKF(memcmp(t.region, src, t.len) == 0, "mapped puts not landed at once");
    done_rec fl = {0};
    TH_CHECK(kvx_pipe_flush(t.a, t.ab, on_done, &fl) == 0);
    int64_t end = td_now_ms() + 5000;
    while (!fl.n && td_now_ms() < end)
        kvx_pipe_progress(t.a); /* a alone: b never runs */
    TH_CHECKF(fl.n == 1 && fl.status == 0, "flush without the receiver: %d callbacks, status %d",
              fl.n, fl.status);
    TH_CHECK(memcmp(t.region, src, t.len) == 0);

    /* put, then a message: b's handler sees the put's bytes */
    am_rec am = {0};
    TH_CHECK(kvx_pipe_set_am_handler(t.b, 2, on_am, &am) == 0);
    memset(src, 0x5c, 4096);
    TH_CHECK(kvx_pipe_put(t.a, t.ab, src, 4096, base, t.rk) == 0);
    TH_CHECK(kvx_pipe_am_send(t.a, t.ab, 2, "landed", 6, NULL, NULL) == 0);
    TH_CHECK(pump(t.a, t.b, &am.n, 1));
    TH_CHECK(t.region[0] == 0x5c && t.region[4095] == 0x5c);

    /* outside the region: refused, nothing written, the pipe stays usable */
    uint8_t before = t.region[t.len - 1];
    TH_CHECK(kvx_pipe_put(t.a, t.ab, src, 16, base + t.len - 15, t.rk) == TD_EINVAL);
    TH_CHECK(kvx_pipe_put(t.a, t.ab, src, 16, base - 16, t.rk) == TD_EINVAL);
    done_rec fl2 = {0};
    TH_CHECK(kvx_pipe_flush(t.a, t.ab, on_done, &fl2) == 0);
    TH_CHECK(pump(t.a, t.b, &fl2.n, 1) && fl2.status == 0);
    TH_CHECK(t.region[t.len - 1] == before);
    TH_CHECK(kvx_pipe_peer_status(t.a, t.ab) == 0);
    pair_close(&t);
    free(src);
}

static void test_ucx_sm_one_sided(void)
{
    one_sided(true, true);
    one_sided(false, false);
    setenv("KVX_UCX_PUTS", "cma", 1); /* the writes even where a mapping could be made */
    one_sided(true, false);
    unsetenv("KVX_UCX_PUTS");
}

/* A sandbox that refuses both one-sided ways (a seccomp filter answers pidfd_getfd and
 * process_vm_writev with EPERM, as a container's default profile does without
 * CAP_SYS_PTRACE): the pipe falls back to UCX's puts and the contract holds, into a memfd
 * and into private memory. In a child process: the filter cannot be lifted. */
static void test_ucx_sm_refused(void)
{
    pid_t child = fork();
    TH_REQUIRE(child >= 0);
    if (child == 0) {
        struct sock_filter f[] = {
            BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
            BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_process_vm_writev, 2, 0),
            BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_pidfd_getfd, 1, 0),
            BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
            BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        };
        struct sock_fprog prog = {.len = sizeof(f) / sizeof(f[0]), .filter = f};
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) ||
            prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0))
            _exit(77);
        g_tls = getenv("KVX_TEST_SM_TLS") ? getenv("KVX_TEST_SM_TLS") : "posix,cma,self";
        contract(make_ucx, "shared memory, one-sided ways refused (private memory)");
        tcp_pair t;
        if (pair_open_mem(&t, 1 << 16, g_tls, true)) _exit(2);
        static uint8_t src[1 << 16];
        memset(src, 0x6b, sizeof(src));
        TH_CHECK(kvx_pipe_put(t.a, t.ab, src, sizeof(src), (uint64_t)(uintptr_t)t.region, t.rk) ==
                 0);
        done_rec fl = {0};
        TH_CHECK(kvx_pipe_flush(t.a, t.ab, on_done, &fl) == 0);
        TH_CHECK(pump(t.a, t.b, &fl.n, 1) && fl.status == 0);
        TH_CHECK(memcmp(t.region, src, sizeof(src)) == 0);
        pair_close(&t);
        _exit(th_failures ? 1 : 0);
    }
    int st = -1;
    waitpid(child, &st, 0);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 77) {
        fprintf(stderr, "  no seccomp here: skipped\n");
        return;
    }
    TH_CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "refused sandbox: child status %d", st);
}

/* The contract over shared memory with UCX's own (emulated) puts, the fallback where the
 * kernel refuses the writes. */
static void test_ucx_contract_sm_rma(void)
{
    setenv("KVX_UCX_PUTS", "rma", 1);
    g_tls = getenv("KVX_TEST_SM_TLS") ? getenv("KVX_TEST_SM_TLS") : "posix,cma,self";
    contract(make_ucx, "shared memory, UCX's puts");
    unsetenv("KVX_UCX_PUTS");
}

/* Over tcp puts are the pipe's own active messages (kvx_pipe_ucx_amput.c): one that falls
 * outside b's registrations is dropped and fails the next flush with TD_EINVAL; the flush
 * after it succeeds again. */
static void test_ucx_tcp_put_outside(void)
{
    tcp_pair t;
    TH_REQUIRE(tcp_pair_open(&t, 64 << 10) == 0);
    uint8_t src[4096];
    memset(src, 0xab, sizeof(src));
    uint64_t base = (uint64_t)(uintptr_t)t.region;
    /* the last byte one past the end, then wholly past it */
    TH_CHECK(kvx_pipe_put(t.a, t.ab, src, sizeof(src), base + t.len - sizeof(src) + 1, t.rk) == 0);
    TH_CHECK(kvx_pipe_put(t.a, t.ab, src, 16, base + t.len, t.rk) == 0);
    done_rec fl = {0};
    TH_CHECK(kvx_pipe_flush(t.a, t.ab, on_done, &fl) == 0);
    TH_CHECK(pump(t.a, t.b, &fl.n, 1));
    TH_CHECKF(fl.status == TD_EINVAL, "flush after a put outside the region: %d", fl.status);
    size_t zero = 0;
    for (size_t i = 0; i < t.len; i++)
        zero += t.region[i] == 0;
    TH_CHECKF(zero == t.len, "a put outside the region wrote %zu bytes of it", t.len - zero);
    TH_CHECK(kvx_pipe_put(t.a, t.ab, src, sizeof(src), base + t.len - sizeof(src), t.rk) == 0);
    done_rec fl2 = {0};
    TH_CHECK(kvx_pipe_flush(t.a, t.ab, on_done, &fl2) == 0);
    TH_CHECK(pump(t.a, t.b, &fl2.n, 1) && fl2.status == 0);
    TH_CHECK(memcmp(t.region + t.len - sizeof(src), src, sizeof(src)) == 0);
    TH_CHECK(kvx_pipe_peer_status(t.a, t.ab) == 0);
    kvx_pipe_rkey_destroy(t.a, t.rk);
    kvx_pipe_disconnect(t.a, t.ab, false);
    kvx_pipe_destroy(t.a);
    kvx_pipe_destroy(t.b);
    pair_unmap(&t);
}

/* Issue 44: over tcp, a process that reaches the receiver's worker but was never given the
 * region's rkey (it travels inside the decode target, over the authenticated control plane)
 * cannot write into the region. (1) Our puts with a guessed key (the rkey's 128-bit key
 * changed, the frame re-sealed) are dropped and their flush fails; (2) UCX's own emulated
 * put, from a sender with KVX_UCX_PUTS=rma, which on a receiver that installed UCX's
 * emulation is written wherever its message says (with any rkey: the emulation checks
 * nothing), is dropped as an unknown message (the receiver's context has no
 * UCP_FEATURE_RMA). The real key then writes. */
static void test_ucx_tcp_put_unkeyed(void)
{
    tcp_pair t;
    TH_REQUIRE(tcp_pair_open(&t, 64 << 10) == 0);
    uint8_t key[KVX_RKEY_MAX], forged[KVX_RKEY_MAX];
    size_t kn, fn;
    TH_REQUIRE(kvx_pipe_rkey_pack(t.b, t.mem, key, sizeof(key), &kn) == 0);
    const void *pl;
    size_t pn;
    TH_REQUIRE(kvx_frame_read(key, kn, KVX_MAGIC_RKEY, KVX_KIND_UCX, &pl, &pn) == 0 && pn > 16);
    uint8_t body[KVX_RKEY_MAX];
    memcpy(body, pl, pn);
    body[3] ^= 0x40; /* one bit of the key */
    TH_REQUIRE(
        kvx_frame_write(forged, sizeof(forged), KVX_MAGIC_RKEY, KVX_KIND_UCX, body, pn, &fn));
    kvx_pipe_rkey_destroy(t.a, t.rk);
    TH_REQUIRE(kvx_pipe_rkey_unpack(t.a, t.ab, forged, fn, &t.rk) == 0);
    uint8_t src[4096];
    memset(src, 0xab, sizeof(src));
    uint64_t base = (uint64_t)(uintptr_t)t.region;
    TH_CHECK(kvx_pipe_put(t.a, t.ab, src, sizeof(src), base, t.rk) == 0);
    done_rec fl = {0};
    TH_CHECK(kvx_pipe_flush(t.a, t.ab, on_done, &fl) == 0);
    TH_CHECK(pump(t.a, t.b, &fl.n, 1));
    TH_CHECKF(fl.status == TD_EINVAL, "flush after a put with a forged key: %d", fl.status);

    /* UCX's emulated put, from a third pipe holding the real key (its rkey's flags changed
     * so that it uses UCX's puts, as a writer of its own would) */
    setenv("KVX_UCX_PUTS", "rma", 1);
    kvx_pipe_params pr = {.tls = "tcp"};
    kvx_pipe *r = NULL;
    int rc = kvx_pipe_ucx_create(&pr, &r);
    unsetenv("KVX_UCX_PUTS");
    TH_REQUIRE(rc == 0);
    uint8_t addr[KVX_ADDR_MAX];
    size_t an;
    kvx_peer rb;
    kvx_rkey *rrk = NULL;
    TH_REQUIRE(kvx_pipe_address(t.b, addr, sizeof(addr), &an) == 0);
    TH_REQUIRE(kvx_pipe_connect(r, addr, an, &rb) == 0);
    memcpy(body, pl, pn);
    memset(body + 16, 0, 4); /* the flags: "UCX's puts welcome", so the writer uses them */
    TH_REQUIRE(
        kvx_frame_write(forged, sizeof(forged), KVX_MAGIC_RKEY, KVX_KIND_UCX, body, pn, &fn));
    TH_REQUIRE(kvx_pipe_rkey_unpack(r, rb, forged, fn, &rrk) == 0);
    TH_CHECK(kvx_pipe_put(r, rb, src, sizeof(src), base + sizeof(src), rrk) == 0);
    done_rec rf = {0};
    TH_CHECK(kvx_pipe_flush(r, rb, on_done, &rf) == 0);
    int64_t end = td_now_ms() + 1500; /* no completion comes: the receiver dropped the put */
    while (td_now_ms() < end && !rf.n) {
        kvx_pipe_progress(r);
        kvx_pipe_progress(t.b);
    }
    size_t zero = 0;
    for (size_t i = 0; i < t.len; i++)
        zero += t.region[i] == 0;
    TH_CHECKF(zero == t.len, "puts without the region's key wrote %zu bytes of it", t.len - zero);
    kvx_pipe_rkey_destroy(r, rrk);
    kvx_pipe_disconnect(r, rb, true);
    for (int i = 0; i < 20; i++)
        kvx_pipe_progress(r);
    kvx_pipe_destroy(r);

    /* the real key */
    kvx_pipe_rkey_destroy(t.a, t.rk);
    TH_REQUIRE(kvx_pipe_rkey_unpack(t.a, t.ab, key, kn, &t.rk) == 0);
    TH_CHECK(kvx_pipe_put(t.a, t.ab, src, sizeof(src), base, t.rk) == 0);
    done_rec fl2 = {0};
    TH_CHECK(kvx_pipe_flush(t.a, t.ab, on_done, &fl2) == 0);
    TH_CHECK(pump(t.a, t.b, &fl2.n, 1) && fl2.status == 0);
    TH_CHECK(memcmp(t.region, src, sizeof(src)) == 0);
    pair_close(&t);
}

/* Writers and receivers that decided differently about UCX's puts (KVX_UCX_PUTS, or a host
 * with an RDMA device beside one without): a receiver without UCX's puts says so in its
 * rkey, and a writer that would use UCX's puts sends the pipe's own to it; a writer of the
 * pipe's own puts works with a receiver that has UCX's too. Both ways the bytes land and
 * the flush completes. */
static void test_ucx_tcp_mixed_puts(void)
{
    for (int way = 0; way < 2; way++) {
        kvx_pipe *w = NULL, *r = NULL;
        kvx_pipe_params pp = {.tls = "tcp"};
        setenv("KVX_UCX_PUTS", way ? "am" : "rma", 1);
        int rc = kvx_pipe_ucx_create(&pp, &w);
        setenv("KVX_UCX_PUTS", way ? "rma" : "am", 1);
        rc = rc ? rc : kvx_pipe_ucx_create(&pp, &r);
        unsetenv("KVX_UCX_PUTS");
        TH_REQUIRE(rc == 0);
        static uint8_t region[1 << 16], src[1 << 16];
        memset(region, 0, sizeof(region));
        for (size_t i = 0; i < sizeof(src); i++)
            src[i] = (uint8_t)(i * 7 + way);
        uint8_t buf[KVX_ADDR_MAX];
        size_t n;
        kvx_peer wr;
        kvx_mem *m = NULL;
        kvx_rkey *rk = NULL;
        TH_REQUIRE(kvx_pipe_address(r, buf, sizeof(buf), &n) == 0 &&
                   kvx_pipe_connect(w, buf, n, &wr) == 0);
        TH_REQUIRE(kvx_pipe_mem_reg(r, region, sizeof(region), &m) == 0 &&
                   kvx_pipe_rkey_pack(r, m, buf, sizeof(buf), &n) == 0 &&
                   kvx_pipe_rkey_unpack(w, wr, buf, n, &rk) == 0);
        TH_CHECK(kvx_pipe_put(w, wr, src, sizeof(src), (uint64_t)(uintptr_t)region, rk) == 0);
        done_rec fl = {0};
        TH_CHECK(kvx_pipe_flush(w, wr, on_done, &fl) == 0);
        TH_CHECKF(pump(w, r, &fl.n, 1) && fl.status == 0, "%s writer, %s receiver: flush %d/%d",
                  way ? "am" : "rma", way ? "rma" : "am", fl.n, fl.status);
        TH_CHECK(memcmp(region, src, sizeof(src)) == 0);
        kvx_pipe_rkey_destroy(w, rk);
        kvx_pipe_disconnect(w, wr, false);
        kvx_pipe_mem_dereg(r, m);
        kvx_pipe_destroy(w);
        kvx_pipe_destroy(r);
    }
}

/* A flush waiting for its ACK when the receiver goes away fails (it does not hang), and
 * nothing stays pending. */
static void test_ucx_tcp_flush_peer_gone(void)
{
    tcp_pair t;
    TH_REQUIRE(tcp_pair_open(&t, 1 << 20) == 0);
    static uint8_t src[1 << 20];
    TH_CHECK(kvx_pipe_put(t.a, t.ab, src, sizeof(src), (uint64_t)(uintptr_t)t.region, t.rk) == 0);
    done_rec fl = {0};
    int rc = kvx_pipe_flush(t.a, t.ab, on_done, &fl);
    kvx_pipe_mem_dereg(t.b, t.mem);
    kvx_pipe_destroy(t.b); /* before it ever progressed: nothing was received */
    int64_t end = td_now_ms() + 10000;
    while (rc == 0 && !fl.n && td_now_ms() < end)
        kvx_pipe_wait(t.a, 50);
    TH_CHECKF(rc < 0 || (fl.n == 1 && fl.status < 0), "flush to a dead peer: rc %d, %d callbacks, "
              "status %d", rc, fl.n, fl.status);
    kvx_pipe_rkey_destroy(t.a, t.rk);
    kvx_pipe_disconnect(t.a, t.ab, false);
    for (int i = 0; i < 20; i++)
        kvx_pipe_progress(t.a);
    kvx_pipe_stats st;
    kvx_pipe_stats_get(t.a, &st);
    TH_CHECKF(st.peers == 0 && st.pending_ops == 0, "left: %d peers, %d operations", st.peers,
              st.pending_ops);
    kvx_pipe_destroy(t.a);
    pair_unmap(&t);
}

/* The contract over tcp with UCX's own (emulated) puts, as on a host with RDMA transports. */
static void test_ucx_contract_tcp_rma(void)
{
    setenv("KVX_UCX_PUTS", "rma", 1);
    g_tls = "tcp";
    contract(make_ucx, "ucx tcp, UCX's puts");
    setenv("KVX_UCX_PUTS", "fast", 1); /* neither am nor rma: refused, not ignored */
    kvx_pipe_params pp = {.tls = "tcp"};
    kvx_pipe *p = NULL;
    TH_CHECK(kvx_pipe_ucx_create(&pp, &p) == TD_EINVAL && !p);
    unsetenv("KVX_UCX_PUTS");
}

int main(void)
{
    TH_RUN(test_fake_contract);
    TH_RUN(test_fake_faults);
    TH_RUN(test_ucx_contract_tcp);
    TH_RUN(test_net_devices);
    TH_RUN(test_ucx_contract_tcp_lo);
    TH_RUN(test_ucx_contract_sm);
    TH_RUN(test_ucx_peer_gone);
    TH_RUN(test_ucx_tcp_put_outside);
    TH_RUN(test_ucx_tcp_put_unkeyed);
    TH_RUN(test_ucx_tcp_mixed_puts);
    TH_RUN(test_ucx_tcp_flush_peer_gone);
    TH_RUN(test_ucx_contract_tcp_rma);
    TH_RUN(test_ucx_sm_one_sided);
    TH_RUN(test_ucx_contract_sm_rma);
    TH_RUN(test_ucx_sm_refused);
    TH_EXIT();
}
