/* test_kvx_2proc.c: kvxfer between real processes over UCX (loopback).
 *
 *   test_kvx_2proc --tls TLS --peer PATH/kvx_test_peer [--only TEST_NAME]
 *
 * This process plays the prefill side (one connector per source stage x TP rank) against
 * decode ranks in child processes, and the decode side against prefill children in the
 * kill test. Checked: byte-exact blocks for TP 1->1, 1->2, 1->4, 2->1, 2->4 and PP layer
 * ranges, chunks out of order, a late target, per-chunk times (ordered; a queued chunk is
 * issued after the targets arrived; once a chunk landed the decode process's memory holds
 * its tokens and not yet the next chunk's), abort mid-transfer, a receiver that never
 * answers, a writer without the request's key (refused), and SIGKILL of either peer
 * mid-transfer (the survivor fails the request within the timeout, frees everything, and
 * serves the next request). Children die with this
 * process (PR_SET_PDEATHSIG) and are killed on every path.
 */
#define _GNU_SOURCE /* memfd_create (kvx_scenario.h) */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvx_conn.h"
#include "kvx_scenario.h"
#include "kvx_wire.h"
#include "td_clock.h"
#include "tharness.h"

static const char *g_tls = "tcp";
static const char *g_peer;
static const char *g_only; /* --only NAME: run that test alone */

/* TH_RUN unless --only names another test. */
#define RUN(fn)                                                                                    \
    do {                                                                                           \
        if (!g_only || !strcmp(g_only, #fn)) TH_RUN(fn);                                           \
    } while (0)

/* geometry of every test: 4 KV heads, head_dim 8, 16-token blocks, 4 layers */
#define HEADS  4
#define HDIM   8
#define BS     16
#define NBLK   64
#define LAYERS 4
#define TMO    5000

typedef struct {
    pid_t pid;
    int in, out; /* our ends: write commands to in, read replies from out */
    char buf[65536];
    size_t len;
} child;

#define MAX_CHILDREN 16
static child *g_children[MAX_CHILDREN];

static void child_kill(child *ch)
{
    if (ch->pid > 0) {
        kill(ch->pid, SIGKILL);
        waitpid(ch->pid, NULL, 0);
        ch->pid = 0;
    }
    if (ch->in > 0) close(ch->in);
    if (ch->out > 0) close(ch->out);
    ch->in = ch->out = -1;
    for (int i = 0; i < MAX_CHILDREN; i++)
        if (g_children[i] == ch) g_children[i] = NULL;
}

static void kill_all(void)
{
    for (int i = 0; i < MAX_CHILDREN; i++)
        if (g_children[i]) child_kill(g_children[i]);
}

/* One reply line (without the newline) within ms; returns false on timeout or EOF. */
static bool child_line(child *ch, char *out, size_t cap, int ms)
{
    int64_t end = td_now_ms() + ms;
    for (;;) {
        char *nl = memchr(ch->buf, '\n', ch->len);
        if (nl) {
            size_t n = (size_t)(nl - ch->buf);
            size_t c = n < cap - 1 ? n : cap - 1;
            memcpy(out, ch->buf, c);
            out[c] = 0;
            memmove(ch->buf, nl + 1, ch->len - n - 1);
            ch->len -= n + 1;
            return true;
        }
        int left = (int)(end - td_now_ms());
        if (left <= 0 || ch->len == sizeof(ch->buf)) return false;
        struct pollfd p = {.fd = ch->out, .events = POLLIN};
        if (poll(&p, 1, left) <= 0) continue;
        ssize_t r = read(ch->out, ch->buf + ch->len, sizeof(ch->buf) - ch->len);
        if (r <= 0) return false;
        ch->len += (size_t)r;
    }
}

/* Send a command line and read its reply (ms bound). */
static bool child_cmd(child *ch, char *reply, size_t cap, int ms, const char *fmt, ...)
{
    char line[70000];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
    va_end(ap);
    if (n < 0 || n >= (int)sizeof(line) - 1) return false;
    line[n++] = '\n';
    bool ok = write(ch->in, line, (size_t)n) == n && child_line(ch, reply, cap, ms);
    if (!ok) {
        int status = 0;
        pid_t w = waitpid(ch->pid, &status, WNOHANG);
        fprintf(stderr, "  peer %d: no reply to '%.40s': %s (status 0x%x)\n", (int)ch->pid, line,
                w == 0 ? "alive" : "exited", status);
        if (w == ch->pid) ch->pid = 0;
        reply[0] = 0;
    }
    return ok;
}

static bool child_spawn(child *ch, const char *role, const char *extra_fmt, ...)
{
    char extra[512];
    va_list ap;
    va_start(ap, extra_fmt);
    vsnprintf(extra, sizeof(extra), extra_fmt, ap);
    va_end(ap);
    char *argv[64];
    int argc = 0;
    argv[argc++] = (char *)g_peer;
    argv[argc++] = "--role";
    argv[argc++] = (char *)role;
    argv[argc++] = "--tls";
    argv[argc++] = (char *)g_tls;
    for (char *tok = strtok(extra, " "); tok && argc < 62; tok = strtok(NULL, " "))
        argv[argc++] = tok;
    argv[argc] = NULL;
    int pin[2], pout[2];
    if (pipe(pin) || pipe(pout)) return false;
    memset(ch, 0, sizeof(*ch));
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) return false;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(1);
        dup2(pin[0], 0);
        dup2(pout[1], 1);
        close(pin[0]);
        close(pin[1]);
        close(pout[0]);
        close(pout[1]);
        execv(g_peer, argv);
        _exit(127);
    }
    close(pin[0]);
    close(pout[1]);
    ch->pid = pid;
    ch->in = pin[1];
    ch->out = pout[0];
    fcntl(ch->in, F_SETFD, FD_CLOEXEC);
    fcntl(ch->out, F_SETFD, FD_CLOEXEC);
    for (int i = 0; i < MAX_CHILDREN; i++)
        if (!g_children[i]) {
            g_children[i] = ch;
            break;
        }
    char r[64];
    if (!child_line(ch, r, sizeof(r), 20000) || strcmp(r, "READY")) {
        fprintf(stderr, "peer %s did not start (%s)\n", role, r);
        child_kill(ch);
        return false;
    }
    return true;
}

static void child_quit(child *ch)
{
    if (ch->pid <= 0) return;
    if (write(ch->in, "quit\n", 5) == 5) {
        int64_t end = td_now_ms() + 5000;
        while (td_now_ms() < end) {
            if (waitpid(ch->pid, NULL, WNOHANG) == ch->pid) {
                ch->pid = 0;
                break;
            }
            usleep(5000);
        }
    }
    child_kill(ch);
}

static bool dec_spawn(child *ch, uint32_t rank, uint32_t tp)
{
    return child_spawn(ch, "decode",
                       "--heads %d --head-dim %d --block-size %d --blocks %d --layers %d "
                       "--rank %u --tp %u --timeout %d",
                       HEADS, HDIM, BS, NBLK, LAYERS, rank, tp, TMO);
}

/* Ask a decode child for a target; bytes into buf. */
static size_t dec_target(child *ch, uint64_t req, uint32_t n_stages, uint32_t n_tokens,
                         uint32_t run, uint32_t start, uint8_t *buf, size_t cap)
{
    static char r[40000];
    if (!child_cmd(ch, r, sizeof(r), 10000, "target %llu %u %u %u %u", (unsigned long long)req,
                   n_stages, n_tokens, run, start) ||
        strncmp(r, "TARGET ", 7) || r[7] == '-')
        return 0;
    return sc_unhex(r + 7, buf, cap);
}

static int dec_wait(child *ch, uint64_t req, int ms, int *reason, int *tok0)
{
    char r[256];
    int st = -1, rs = 0, tk = 0;
    unsigned long long done = 0;
    if (child_cmd(ch, r, sizeof(r), ms + 5000, "wait %llu %d", (unsigned long long)req, ms))
        sscanf(r, "STATE %d %d %llu %d", &st, &rs, &done, &tk);
    if (reason) *reason = rs;
    if (tok0) *tok0 = tk;
    return st;
}

static long dec_verify(child *ch, uint64_t req, uint32_t n_tokens, uint32_t salt)
{
    char r[256];
    long bad = -1;
    if (child_cmd(ch, r, sizeof(r), 10000, "verify %llu %u 0 %d %u", (unsigned long long)req,
                  n_tokens, LAYERS, salt))
        sscanf(r, "BAD %ld", &bad);
    return bad;
}

static void dec_release(child *ch, uint64_t req)
{
    char r[64];
    child_cmd(ch, r, sizeof(r), 5000, "release %llu", (unsigned long long)req);
}

/* After release: no requests, endpoints, rkeys or operations left in the child. */
static bool dec_clean(child *ch)
{
    char r[128];
    int a = -1, b = -1, c = -1, d = -1;
    if (child_cmd(ch, r, sizeof(r), 5000, "stats")) sscanf(r, "STATS %d %d %d %d", &a, &b, &c, &d);
    if (a || b || c || d) fprintf(stderr, "  child stats: %s\n", r);
    return a == 0 && b == 0 && c == 0 && d == 0;
}

static kvx_pipe *ucx_pipe(void)
{
    kvx_pipe_params pp = {.tls = g_tls};
    kvx_pipe *p = NULL;
    if (kvx_pipe_ucx_create(&pp, &p)) return NULL;
    return p;
}

static void src_pump(sc_src *s, int n, int ms)
{
    for (int i = 0; i < n; i++)
        kvx_conn_progress(s[i].c, ms);
}

static kvx_req_state src_state(sc_src *s, uint64_t req, kvx_pf_status *ps)
{
    kvx_pf_status tmp;
    if (!ps) ps = &tmp;
    return kvx_pf_poll(s->c, req, ps) == 0 ? ps->state : (kvx_req_state)-1;
}

static bool src_wait_final(sc_src *s, int n, uint64_t req, int ms)
{
    int64_t end = td_now_ms() + ms;
    for (;;) {
        bool all = true;
        for (int i = 0; i < n; i++)
            all = all && sc_final(src_state(&s[i], req, NULL));
        if (all) return true;
        if (td_now_ms() > end) return false;
        src_pump(s, n, 1);
    }
}

/* Until both sides agreed (the decode ranks accepted): puts go out directly. */
static bool src_wait_ready(sc_src *s, uint64_t req)
{
    int64_t end = td_now_ms() + TMO;
    while (src_state(s, req, NULL) != KVX_REQ_READY && td_now_ms() < end)
        src_pump(s, 1, 2);
    return src_state(s, req, NULL) == KVX_REQ_READY;
}

/* Leak check of our side: no requests, endpoints, rkeys, operations or queued bytes. */
static bool src_clean(sc_src *s, int n)
{
    bool ok = true;
    for (int i = 0; i < n; i++) {
        src_pump(&s[i], 1, 0);
        kvx_conn_close_idle(s[i].c);
        kvx_conn_stats st;
        kvx_conn_stats_get(s[i].c, &st);
        bool c = st.pf_requests == 0 && st.peers == 0 && st.pipe.peers == 0 && st.pipe.rkeys == 0 &&
                 st.pipe.pending_ops == 0 && st.queued_chunks == 0 && st.held_bytes == 0;
        if (!c)
            fprintf(stderr, "  source %d: requests %d peers %d/%d rkeys %d ops %d queued %d\n", i,
                    st.pf_requests, st.peers, st.pipe.peers, st.pipe.rkeys, st.pipe.pending_ops,
                    st.queued_chunks);
        ok = ok && c;
    }
    return ok;
}

typedef struct {
    uint32_t src_tp, dst_tp, pp;
    uint32_t split[3];
    uint32_t n_tokens, chunk;
    int order;
    bool late;
} xcfg;

/* One full transfer from in-process sources to decode children. */
static void run_case(const xcfg *x, uint64_t req, uint32_t salt)
{
    child ch[4];
    sc_src src[8];
    int n_src = (int)(x->src_tp * x->pp), n_dec = (int)x->dst_tp;
    int ok_children = 0, ok_src = 0;
    kvx_conn_params cp = {.timeout_ms = TMO, .abort_timeout_ms = 1000};
    for (int d = 0; d < n_dec; d++) {
        if (!dec_spawn(&ch[d], (uint32_t)d, x->dst_tp)) break;
        ok_children++;
    }
    for (uint32_t s = 0; s < x->pp && ok_children == n_dec; s++)
        for (uint32_t r = 0; r < x->src_tp; r++) {
            kvx_pipe *p = ucx_pipe();
            if (!p) goto out;
            if (sc_src_init(&src[ok_src], p, &cp, HEADS, HDIM, BS, NBLK, x->split[s],
                            x->split[s + 1], s, r, x->src_tp)) {
                sc_src_fini(&src[ok_src]); /* the connector owned the pipe */
                goto out;
            }
            ok_src++;
        }
    if (ok_children != n_dec || ok_src != n_src) {
        TH_CHECK(!"could not start the peers");
        goto out; /* the children live in this frame: quit them before returning */
    }
    static uint8_t tgt[4][16384];
    size_t tl[4];
    for (int d = 0; d < n_dec; d++) {
        tl[d] = dec_target(&ch[d], req, x->pp, x->n_tokens, 3, 5 + (uint32_t)d, tgt[d], 16384);
        TH_CHECK(tl[d] > 0);
    }
    for (int i = 0; i < n_src; i++) {
        TH_CHECK(sc_src_open(&src[i], req, x->n_tokens, salt, 0) == 0);
        for (int d = 0; d < n_dec && !x->late; d++)
            TH_CHECK(kvx_pf_add_target(src[i].c, req, tgt[d], tl[d]) == 0);
    }
    uint32_t nch = (x->n_tokens + x->chunk - 1) / x->chunk;
    for (uint32_t k = 0; k < nch; k++)
        for (int i = 0; i < n_src; i++) {
            TH_CHECK(sc_src_send(&src[i], req, x->n_tokens, x->chunk, k, x->order) == 0);
            src_pump(&src[i], 1, 0);
        }
    uint64_t t_target = 0;
    if (x->late) {
        kvx_conn_stats st;
        kvx_conn_stats_get(src[0].c, &st);
        TH_CHECK(st.queued_chunks == (int)nch);
        t_target = (uint64_t)td_now_ns();
        for (int i = 0; i < n_src; i++)
            for (int d = 0; d < n_dec; d++)
                TH_CHECK(kvx_pf_add_target(src[i].c, req, tgt[d], tl[d]) == 0);
    }
    for (int i = 0; i < n_src; i++) {
        kvx_meta m = {.first_token = src[i].stage == x->pp - 1 ? 777 : -1, .n_tokens = x->n_tokens};
        TH_CHECK(kvx_pf_finish(src[i].c, req, &m) == 0);
    }
    TH_CHECK(src_wait_final(src, n_src, req, TMO + 3000));
    uint64_t puts = 0, pieces = 0;
    for (int i = 0; i < n_src; i++)
        for (uint32_t k = 0; k < nch; k++) {
            kvx_chunk_times ct = {0};
            TH_CHECK(kvx_pf_chunk_times(src[i].c, req, k, &ct) == 0);
            TH_CHECKF(ct.handed_ns && ct.handed_ns <= ct.issued_ns &&
                          ct.issued_ns <= ct.landed_ns && ct.issued_ns >= t_target,
                      "source %d chunk %u: handed %llu issued %llu landed %llu (targets %llu)", i,
                      k, (unsigned long long)ct.handed_ns, (unsigned long long)ct.issued_ns,
                      (unsigned long long)ct.landed_ns, (unsigned long long)t_target);
        }
    for (int i = 0; i < n_src; i++) {
        kvx_pf_status ps;
        TH_CHECKF(src_state(&src[i], req, &ps) == KVX_REQ_DONE, "source %d: %s", i,
                  kvx_req_state_name(ps.state));
        puts += ps.puts;
        pieces += ps.pieces;
        kvx_pf_release(src[i].c, req);
    }
    for (int d = 0; d < n_dec; d++) {
        int reason, tok0;
        int st = dec_wait(&ch[d], req, TMO, &reason, &tok0);
        TH_CHECKF(st == KVX_REQ_DONE && tok0 == 777, "rank %d: state %d reason %d token %d", d, st,
                  reason, tok0);
        long bad = dec_verify(&ch[d], req, x->n_tokens, salt);
        TH_CHECKF(bad == 0, "rank %d: %ld wrong elements", d, bad);
        dec_release(&ch[d], req);
        TH_CHECK(dec_clean(&ch[d]));
    }
    TH_CHECK(src_clean(src, n_src));
    fprintf(stderr, "  %s tp %u->%u pp %u: %llu pieces, %llu puts\n", g_tls, x->src_tp, x->dst_tp,
            x->pp, (unsigned long long)pieces, (unsigned long long)puts);
out:
    for (int i = 0; i < ok_src; i++)
        sc_src_fini(&src[i]);
    for (int d = 0; d < ok_children; d++)
        child_quit(&ch[d]);
}

static void test_tp_pairs(void)
{
    static const uint32_t pairs[][2] = {{1, 1}, {1, 2}, {1, 4}, {2, 1}, {2, 4}};
    for (int p = 0; p < 5; p++) {
        xcfg x = {.src_tp = pairs[p][0],
                  .dst_tp = pairs[p][1],
                  .pp = 1,
                  .split = {0, LAYERS},
                  .n_tokens = 150,
                  .chunk = 37,
                  .order = p % 3};
        run_case(&x, 100 + (uint64_t)p, 11 + (uint32_t)p);
    }
}

static void test_pp_range(void)
{
    xcfg x = {.src_tp = 1,
              .dst_tp = 2,
              .pp = 2,
              .split = {0, 1, LAYERS},
              .n_tokens = 100,
              .chunk = 24,
              .order = 1};
    run_case(&x, 200, 21);
}

static void test_late_target(void)
{
    xcfg x = {.src_tp = 2,
              .dst_tp = 2,
              .pp = 1,
              .split = {0, LAYERS},
              .n_tokens = 90,
              .chunk = 16,
              .order = 2,
              .late = true};
    run_case(&x, 300, 31);
}

/* Chunk by chunk over UCX to two decode processes: after chunk k is sent, wait until it
 * landed (no finish yet), then ask every decode process for its memory: tokens up to the
 * end of chunk k are there byte-exact, those of chunk k + 1 (not sent yet) are not. The
 * times are ordered and the staging buffers of a chunk are free once it landed. */
static void test_chunk_landing(void)
{
    child ch[2];
    sc_src s;
    kvx_conn_params cp = {.timeout_ms = TMO, .abort_timeout_ms = 1000};
    TH_REQUIRE(dec_spawn(&ch[0], 0, 2));
    if (!dec_spawn(&ch[1], 1, 2)) {
        child_quit(&ch[0]);
        TH_REQUIRE(0);
    }
    kvx_pipe *p = ucx_pipe();
    if (!p || sc_src_init(&s, p, &cp, HEADS, HDIM, BS, NBLK, 0, LAYERS, 0, 0, 1)) {
        child_quit(&ch[0]);
        child_quit(&ch[1]);
        TH_REQUIRE(0);
    }
    const uint64_t req = 350;
    const uint32_t n_tokens = 200, chunk = 48, salt = 35;
    uint8_t tgt[2][16384];
    size_t tl[2];
    for (int d = 0; d < 2; d++) {
        tl[d] = dec_target(&ch[d], req, 1, n_tokens, 4, 2 + (uint32_t)d, tgt[d], 16384);
        TH_CHECK(tl[d] > 0);
    }
    TH_CHECK(sc_src_open(&s, req, n_tokens, salt, 0) == 0);
    for (int d = 0; d < 2; d++)
        TH_CHECK(kvx_pf_add_target(s.c, req, tgt[d], tl[d]) == 0);
    TH_CHECK(src_wait_ready(&s, req));
    uint32_t nch = (n_tokens + chunk - 1) / chunk;
    uint64_t prev_landed = 0;
    for (uint32_t k = 0; k < nch; k++) {
        TH_CHECK(sc_src_send(&s, req, n_tokens, chunk, k, 0) == 0);
        kvx_chunk_times ct = {0};
        int64_t end = td_now_ms() + TMO;
        while ((kvx_pf_chunk_times(s.c, req, k, &ct) || !ct.landed_ns) && td_now_ms() < end)
            src_pump(&s, 1, 1);
        TH_CHECKF(ct.landed_ns && ct.handed_ns <= ct.issued_ns && ct.issued_ns <= ct.landed_ns &&
                      ct.handed_ns >= prev_landed,
                  "chunk %u: handed %llu issued %llu landed %llu", k,
                  (unsigned long long)ct.handed_ns, (unsigned long long)ct.issued_ns,
                  (unsigned long long)ct.landed_ns);
        prev_landed = ct.landed_ns;
        TH_CHECK(src_state(&s, req, NULL) == KVX_REQ_READY);
        kvx_conn_stats st;
        kvx_conn_stats_get(s.c, &st);
        TH_CHECKF(st.held_bytes == 0, "chunk %u landed: %zu bytes still held", k, st.held_bytes);
        uint32_t t1 = (k + 1) * chunk < n_tokens ? (k + 1) * chunk : n_tokens;
        for (int d = 0; d < 2; d++) {
            long bad = dec_verify(&ch[d], req, t1, salt);
            TH_CHECKF(bad == 0, "rank %d: chunk %u landed, but %ld of its elements are not there",
                      d, k, bad);
            if (k + 1 < nch) {
                bad = dec_verify(&ch[d], req, t1 + 1, salt);
                TH_CHECKF(bad > 0, "rank %d: token %u (chunk %u, not sent) is already there", d, t1,
                          k + 1);
            }
        }
        fprintf(stderr, "  %s chunk %u: issued +%.1f us, landed +%.1f us after send_chunk\n", g_tls,
                k, (ct.issued_ns - ct.handed_ns) / 1e3, (ct.landed_ns - ct.handed_ns) / 1e3);
    }
    kvx_meta m = {.first_token = 3, .n_tokens = n_tokens};
    TH_CHECK(kvx_pf_finish(s.c, req, &m) == 0);
    TH_CHECK(src_wait_final(&s, 1, req, TMO + 3000));
    TH_CHECK(src_state(&s, req, NULL) == KVX_REQ_DONE);
    for (int d = 0; d < 2; d++) {
        TH_CHECK(dec_wait(&ch[d], req, TMO, NULL, NULL) == KVX_REQ_DONE);
        TH_CHECK(dec_verify(&ch[d], req, n_tokens, salt) == 0);
        dec_release(&ch[d], req);
        TH_CHECK(dec_clean(&ch[d]));
    }
    kvx_pf_release(s.c, req);
    TH_CHECK(src_clean(&s, 1));
    sc_src_fini(&s);
    child_quit(&ch[0]);
    child_quit(&ch[1]);
}

/* The decode rank aborts mid-transfer; the sender learns it and stops. */
static void test_abort_mid(void)
{
    child ch;
    sc_src s;
    kvx_conn_params cp = {.timeout_ms = TMO, .abort_timeout_ms = 1000};
    TH_REQUIRE(dec_spawn(&ch, 0, 1));
    kvx_pipe *p = ucx_pipe();
    if (!p || sc_src_init(&s, p, &cp, HEADS, HDIM, BS, NBLK, 0, LAYERS, 0, 0, 1)) {
        child_quit(&ch);
        TH_REQUIRE(0);
    }
    uint8_t tgt[16384];
    size_t tl = dec_target(&ch, 400, 1, 128, 2, 0, tgt, sizeof(tgt));
    TH_CHECK(tl > 0);
    TH_CHECK(sc_src_open(&s, 400, 128, 41, 0) == 0);
    TH_CHECK(kvx_pf_add_target(s.c, 400, tgt, tl) == 0);
    TH_CHECK(src_wait_ready(&s, 400));
    for (uint32_t k = 0; k < 3; k++) {
        TH_CHECK(sc_src_send(&s, 400, 128, 16, k, 0) == 0);
        src_pump(&s, 1, 1);
    }
    char r[64];
    TH_CHECK(child_cmd(&ch, r, sizeof(r), 5000, "abort 400") && !strcmp(r, "OK 0"));
    int64_t end = td_now_ms() + TMO;
    kvx_pf_status ps;
    while (!sc_final(src_state(&s, 400, &ps)) && td_now_ms() < end)
        src_pump(&s, 1, 5);
    TH_CHECKF(ps.state == KVX_REQ_FAILED && ps.reason == KVX_FAIL_PEER_ABORTED, "%s %d",
              kvx_req_state_name(ps.state), ps.reason);
    int reason;
    TH_CHECK(dec_wait(&ch, 400, TMO, &reason, NULL) == KVX_REQ_FAILED &&
             reason == KVX_FAIL_ABORTED);
    TH_CHECK(sc_src_send(&s, 400, 128, 16, 4, 0) < 0);
    kvx_pf_release(s.c, 400);
    dec_release(&ch, 400);
    TH_CHECK(dec_clean(&ch));
    TH_CHECK(src_clean(&s, 1));
    sc_src_fini(&s);
    child_quit(&ch);
}

/* Issue 44, between processes over UCX: a writer whose target differs from the decode
 * rank's only in the request's 128-bit key (what a process that reaches the rank's worker
 * but was never given the target over the control plane would have to guess) is not
 * accepted: the rank keeps waiting, nothing is written; the real target's writer then
 * transfers the same request byte for byte. */
static void test_unkeyed_writer(void)
{
    child ch;
    sc_src rogue, s;
    kvx_conn_params cp = {.timeout_ms = TMO, .abort_timeout_ms = 1000};
    TH_REQUIRE(dec_spawn(&ch, 0, 1));
    kvx_pipe *p = ucx_pipe(), *q = ucx_pipe();
    if (!p || !q || sc_src_init(&rogue, p, &cp, HEADS, HDIM, BS, NBLK, 0, LAYERS, 0, 0, 1) ||
        sc_src_init(&s, q, &cp, HEADS, HDIM, BS, NBLK, 0, LAYERS, 0, 0, 1)) {
        child_quit(&ch);
        TH_REQUIRE(0);
    }
    static uint8_t tgt[16384], body[16384], forged[16384];
    size_t tl = dec_target(&ch, 450, 1, 64, 2, 0, tgt, sizeof(tgt)), pn = 0, fl = 0;
    const void *pl = NULL;
    TH_REQUIRE(tl > 0 && kvx_frame_read(tgt, tl, KVX_MAGIC_TARGET, KVX_KIND_UCX, &pl, &pn) == 0);
    memcpy(body, pl, pn);
    body[16 + 11] ^= 0x02; /* the key follows the request id and the epoch */
    TH_REQUIRE(
        kvx_frame_write(forged, sizeof(forged), KVX_MAGIC_TARGET, KVX_KIND_UCX, body, pn, &fl));
    TH_CHECK(sc_src_open(&rogue, 450, 64, 43, 0) == 0);
    TH_CHECK(kvx_pf_add_target(rogue.c, 450, forged, fl) == 0);
    for (uint32_t k = 0; k < 4; k++)
        TH_CHECK(sc_src_send(&rogue, 450, 64, 16, k, 0) == 0);
    int64_t end = td_now_ms() + 700;
    while (td_now_ms() < end)
        src_pump(&rogue, 1, 5);
    TH_CHECK(src_state(&rogue, 450, NULL) != KVX_REQ_READY);
    TH_CHECKF(dec_wait(&ch, 450, 50, NULL, NULL) == KVX_REQ_WAITING,
              "the rank no longer waits after a writer without the key");
    kvx_pf_abort(rogue.c, 450);
    TH_CHECK(src_wait_final(&rogue, 1, 450, TMO));
    TH_CHECK(kvx_pf_release(rogue.c, 450) == 0);
    /* the real target */
    TH_CHECK(sc_src_open(&s, 450, 64, 43, 0) == 0);
    TH_CHECK(kvx_pf_add_target(s.c, 450, tgt, tl) == 0);
    for (uint32_t k = 0; k < 4; k++)
        TH_CHECK(sc_src_send(&s, 450, 64, 16, k, 0) == 0);
    kvx_meta m = {.first_token = 777, .n_tokens = 64};
    TH_CHECK(kvx_pf_finish(s.c, 450, &m) == 0);
    TH_CHECK(src_wait_final(&s, 1, 450, TMO + 3000));
    TH_CHECK(src_state(&s, 450, NULL) == KVX_REQ_DONE);
    kvx_pf_release(s.c, 450);
    int tok0 = 0;
    TH_CHECK(dec_wait(&ch, 450, TMO, NULL, &tok0) == KVX_REQ_DONE && tok0 == 777);
    TH_CHECKF(dec_verify(&ch, 450, 64, 43) == 0, "the real writer's bytes");
    dec_release(&ch, 450);
    TH_CHECK(dec_clean(&ch));
    TH_CHECK(src_clean(&s, 1) && src_clean(&rogue, 1));
    sc_src_fini(&rogue);
    sc_src_fini(&s);
    child_quit(&ch);
}

/* No target ever arrives (the receiver never registered the request): timeout. */
static void test_no_receiver(void)
{
    sc_src s;
    kvx_conn_params cp = {.timeout_ms = 500, .abort_timeout_ms = 500};
    kvx_pipe *p = ucx_pipe();
    TH_REQUIRE(p && sc_src_init(&s, p, &cp, HEADS, HDIM, BS, NBLK, 0, LAYERS, 0, 0, 1) == 0);
    TH_CHECK(sc_src_open(&s, 500, 64, 1, 0) == 0);
    for (uint32_t k = 0; k < 4; k++)
        TH_CHECK(sc_src_send(&s, 500, 64, 16, k, 0) == 0);
    int64_t t0 = td_now_ms();
    kvx_pf_status ps;
    while (!sc_final(src_state(&s, 500, &ps)) && td_now_ms() - t0 < 5000)
        src_pump(&s, 1, 50);
    int64_t dt = td_now_ms() - t0;
    TH_CHECKF(ps.state == KVX_REQ_FAILED && ps.reason == KVX_FAIL_TIMEOUT && dt < 1500,
              "%s after %lld ms", kvx_req_state_name(ps.state), (long long)dt);
    kvx_pf_release(s.c, 500);
    TH_CHECK(src_clean(&s, 1));
    sc_src_fini(&s);
}

/* A decode rank is SIGKILLed mid-transfer: the sender fails within the timeout, frees
 * everything, and the next request (to a new rank) goes through. */
static void test_kill_decode(void)
{
    child ch[2];
    sc_src s;
    kvx_conn_params cp = {.timeout_ms = TMO, .abort_timeout_ms = 1000};
    TH_REQUIRE(dec_spawn(&ch[0], 0, 2));
    if (!dec_spawn(&ch[1], 1, 2)) {
        child_quit(&ch[0]);
        TH_REQUIRE(0);
    }
    kvx_pipe *p = ucx_pipe();
    if (!p || sc_src_init(&s, p, &cp, HEADS, HDIM, BS, NBLK, 0, LAYERS, 0, 0, 1)) {
        child_quit(&ch[0]);
        child_quit(&ch[1]);
        TH_REQUIRE(0);
    }
    uint8_t tgt[2][16384];
    size_t tl[2];
    for (int d = 0; d < 2; d++)
        tl[d] = dec_target(&ch[d], 600, 1, 256, 4, 0, tgt[d], 16384);
    TH_CHECK(sc_src_open(&s, 600, 256, 61, 0) == 0);
    for (int d = 0; d < 2; d++)
        TH_CHECK(kvx_pf_add_target(s.c, 600, tgt[d], tl[d]) == 0);
    TH_CHECK(src_wait_ready(&s, 600));
    int64_t t0 = 0;
    kvx_pf_status ps;
    for (uint32_t k = 0; k < 16; k++) {
        if (k == 6) {
            child_kill(&ch[1]);
            t0 = td_now_ms();
        }
        if (sc_src_send(&s, 600, 256, 16, k, 0) != 0) break;
        src_pump(&s, 1, 10);
    }
    kvx_meta m = {.first_token = 1, .n_tokens = 256};
    kvx_pf_finish(s.c, 600, &m);
    while (!sc_final(src_state(&s, 600, &ps)) && td_now_ms() - t0 < TMO + 3000)
        src_pump(&s, 1, 5);
    int64_t dt = td_now_ms() - t0;
    TH_CHECKF(ps.state == KVX_REQ_FAILED && dt <= TMO, "%s reason %d after %lld ms",
              kvx_req_state_name(ps.state), ps.reason, (long long)dt);
    fprintf(stderr, "  %s: sender failed %lld ms after the kill (reason %d)\n", g_tls,
            (long long)dt, ps.reason);
    int reason;
    int st = dec_wait(&ch[0], 600, TMO + 3000, &reason, NULL);
    TH_CHECKF(st == KVX_REQ_FAILED, "surviving rank: state %d", st);
    kvx_pf_release(s.c, 600);
    dec_release(&ch[0], 600);
    TH_CHECK(src_clean(&s, 1));
    TH_CHECK(dec_clean(&ch[0]));
    /* keep serving: a new rank 1 and the next request */
    if (dec_spawn(&ch[1], 1, 2)) {
        for (int d = 0; d < 2; d++)
            tl[d] = dec_target(&ch[d], 601, 1, 96, 4, 9, tgt[d], 16384);
        TH_CHECK(sc_src_open(&s, 601, 96, 62, 0) == 0);
        for (int d = 0; d < 2; d++)
            TH_CHECK(kvx_pf_add_target(s.c, 601, tgt[d], tl[d]) == 0);
        for (uint32_t k = 0; k < 3; k++)
            TH_CHECK(sc_src_send(&s, 601, 96, 32, k, 1) == 0);
        TH_CHECK(kvx_pf_finish(s.c, 601, &m) == 0);
        TH_CHECK(src_wait_final(&s, 1, 601, TMO + 3000));
        TH_CHECK(src_state(&s, 601, NULL) == KVX_REQ_DONE);
        for (int d = 0; d < 2; d++) {
            TH_CHECK(dec_wait(&ch[d], 601, TMO, NULL, NULL) == KVX_REQ_DONE);
            TH_CHECK(dec_verify(&ch[d], 601, 96, 62) == 0);
            dec_release(&ch[d], 601);
        }
        kvx_pf_release(s.c, 601);
        TH_CHECK(src_clean(&s, 1));
    } else {
        TH_CHECK(0);
    }
    sc_src_fini(&s);
    child_quit(&ch[0]);
    child_quit(&ch[1]);
}

/* A prefill stage is SIGKILLed mid-transfer: this (decode) side fails the request within
 * the timeout, frees everything, and serves the next stage's request. */
static void test_kill_prefill(void)
{
    kvx_pipe *p = ucx_pipe();
    TH_REQUIRE(p);
    kvx_conn *dc;
    kvx_conn_params cp = {.timeout_ms = TMO, .abort_timeout_ms = 1000};
    TH_REQUIRE(kvx_conn_create(p, &cp, &dc) == 0);
    kvx_layout l = {.layer0 = 0,
                    .n_layers = LAYERS,
                    .n_kv_heads = HEADS,
                    .head0 = 0,
                    .n_heads = HEADS,
                    .block_size = BS,
                    .head_dim = HDIM,
                    .dtype_size = 2,
                    .n_blocks = NBLK};
    int fd;
    uint8_t *region = sc_region_register(dc, &l, &fd);
    TH_REQUIRE(region);
    static char hex[40000];
    uint8_t tgt[16384];
    size_t tl;
    int32_t blocks[32];
    for (int round = 0; round < 2; round++) {
        uint64_t req = 700 + (uint64_t)round;
        child ch;
        if (!child_spawn(&ch, "prefill",
                         "--heads %d --head-dim %d --block-size %d --blocks %d --layer0 0 "
                         "--layer1 %d --stage 0 --rank 0 --tp 1 --timeout %d --first-token 9",
                         HEADS, HDIM, BS, NBLK, LAYERS, TMO)) {
            TH_CHECK(0);
            break;
        }
        sc_blocks(blocks, 16, NBLK, 4, 3 + (uint32_t)round * 20);
        kvx_dec_req_params dp = {.n_stages = 1, .tp = 1, .blocks = blocks, .n_blocks = 16};
        TH_CHECK(kvx_dec_make_target(dc, req, &dp, tgt, sizeof(tgt), &tl) == 0);
        sc_hex(tgt, tl, hex);
        /* round 0: 16 chunks, 100 ms apart, killed after ~400 ms; round 1: runs through */
        char cmd[40100];
        snprintf(cmd, sizeof(cmd), "send %llu 256 16 %d 71 1 %s\n", (unsigned long long)req,
                 round == 0 ? 100 : 1, hex);
        TH_CHECK(write(ch.in, cmd, strlen(cmd)) == (ssize_t)strlen(cmd));
        int64_t t_start = td_now_ms(), t_kill = 0;
        kvx_dec_status ds;
        for (;;) {
            kvx_conn_progress(dc, 5);
            TH_CHECK(kvx_dec_poll(dc, req, &ds) == 0);
            if (round == 0 && !t_kill && td_now_ms() - t_start > 400) {
                TH_CHECK(ds.state == KVX_REQ_TRANSFERRING);
                child_kill(&ch);
                t_kill = td_now_ms();
            }
            if (sc_final(ds.state) || td_now_ms() - t_start > 3 * TMO) break;
        }
        if (round == 0) {
            int64_t dt = td_now_ms() - t_kill;
            TH_CHECKF(ds.state == KVX_REQ_FAILED && dt <= TMO, "%s reason %d after %lld ms",
                      kvx_req_state_name(ds.state), ds.reason, (long long)dt);
            fprintf(stderr, "  %s: decode side failed %lld ms after the kill (reason %d)\n", g_tls,
                    (long long)dt, ds.reason);
        } else {
            char r[64];
            TH_CHECK(child_line(&ch, r, sizeof(r), TMO) && !strcmp(r, "PF 2 0"));
            TH_CHECKF(ds.state == KVX_REQ_DONE && ds.meta[0].first_token == 9, "%s",
                      kvx_req_state_name(ds.state));
            TH_CHECK(sc_verify(region, &l, blocks, 16, 256, 0, LAYERS, 71, 0) == 0);
            child_quit(&ch);
        }
        TH_CHECK(kvx_dec_release(dc, req) == 0);
        for (int k = 0; k < 5; k++)
            kvx_conn_progress(dc, 1);
        kvx_conn_close_idle(dc);
        kvx_conn_stats st;
        kvx_conn_stats_get(dc, &st);
        TH_CHECKF(st.dec_requests == 0 && st.peers == 0 && st.pipe.peers == 0 &&
                      st.pipe.pending_ops == 0 && st.pipe.mems == 1,
                  "requests %d peers %d/%d ops %d mems %d", st.dec_requests, st.peers,
                  st.pipe.peers, st.pipe.pending_ops, st.pipe.mems);
    }
    kvx_conn_destroy(dc);
    sc_region_free(region, &l, fd);
}

/* Soak over UCX: back-to-back requests to one decode process, a third of them aborted by
 * either side mid-way; finished ones byte-exact; both sides clean at the end.
 * Duration: KVX_SOAK_SECONDS (default 1). */
static void test_soak(void)
{
    const char *env = getenv("KVX_SOAK_SECONDS");
    int64_t ms = (int64_t)((env ? atof(env) : 1.0) * 1000);
    child ch;
    sc_src s;
    kvx_conn_params cp = {.timeout_ms = TMO, .abort_timeout_ms = 1000};
    TH_REQUIRE(dec_spawn(&ch, 0, 1));
    kvx_pipe *p = ucx_pipe();
    if (!p || sc_src_init(&s, p, &cp, HEADS, HDIM, BS, NBLK, 0, LAYERS, 0, 0, 1)) {
        child_quit(&ch);
        TH_REQUIRE(0);
    }
    static uint8_t tgt[16384];
    int done = 0, aborted = 0;
    td_log_set_level(TD_LOG_ERROR + 1);
    int64_t end = td_now_ms() + ms;
    for (uint64_t req = 900; td_now_ms() < end; req++) {
        int action = (int)(req % 3); /* 0: finish, 1: decode aborts, 2: prefill aborts */
        uint32_t n_tokens = 16 + (uint32_t)(req * 37 % 200), salt = (uint32_t)req;
        size_t tl = dec_target(&ch, req, 1, n_tokens, 1 + (uint32_t)(req % 5), 0, tgt, sizeof(tgt));
        TH_CHECK(tl > 0);
        TH_CHECK(sc_src_open(&s, req, n_tokens, salt, 0) == 0);
        TH_CHECK(kvx_pf_add_target(s.c, req, tgt, tl) == 0);
        uint32_t nch = (n_tokens + 23) / 24;
        for (uint32_t k = 0; k < nch; k++) {
            if (action && k == nch / 2) {
                char r[64];
                if (action == 1)
                    child_cmd(&ch, r, sizeof(r), 5000, "abort %llu", (unsigned long long)req);
                else
                    kvx_pf_abort(s.c, req);
                break;
            }
            TH_CHECK(sc_src_send(&s, req, n_tokens, 24, k, (int)(req % 3)) == 0);
            src_pump(&s, 1, 0);
        }
        kvx_meta m = {.first_token = 5, .n_tokens = n_tokens};
        if (!action) TH_CHECK(kvx_pf_finish(s.c, req, &m) == 0);
        TH_CHECK(src_wait_final(&s, 1, req, TMO + 3000));
        int st = dec_wait(&ch, req, TMO + 3000, NULL, NULL);
        if (!action) {
            TH_CHECK(src_state(&s, req, NULL) == KVX_REQ_DONE && st == KVX_REQ_DONE);
            TH_CHECK(dec_verify(&ch, req, n_tokens, salt) == 0);
            done++;
        } else {
            TH_CHECK(src_state(&s, req, NULL) == KVX_REQ_FAILED && st == KVX_REQ_FAILED);
            aborted++;
        }
        kvx_pf_release(s.c, req);
        dec_release(&ch, req);
    }
    td_log_set_level(TD_LOG_INFO);
    fprintf(stderr, "  %s soak: %d transfers, %d aborted\n", g_tls, done, aborted);
    TH_CHECK(done > 0);
    TH_CHECK(src_clean(&s, 1));
    TH_CHECK(dec_clean(&ch));
    sc_src_fini(&s);
    child_quit(&ch);
}

static void on_signal(int sig)
{
    kill_all();
    signal(sig, SIG_DFL);
    raise(sig);
}

int main(int argc, char **argv)
{
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--tls"))
            g_tls = argv[i + 1];
        else if (!strcmp(argv[i], "--peer"))
            g_peer = argv[i + 1];
        else if (!strcmp(argv[i], "--only"))
            g_only = argv[i + 1];
    }
    if (!g_peer) {
        fprintf(stderr, "usage: test_kvx_2proc --tls TLS --peer PATH [--only TEST]\n");
        return 2;
    }
    atexit(kill_all);
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    signal(SIGPIPE, SIG_IGN);
    RUN(test_tp_pairs);
    RUN(test_pp_range);
    RUN(test_late_target);
    RUN(test_chunk_landing);
    RUN(test_abort_mid);
    RUN(test_unkeyed_writer);
    RUN(test_no_receiver);
    RUN(test_kill_decode);
    RUN(test_kill_prefill);
    RUN(test_soak);
    kill_all();
    TH_EXIT();
}
