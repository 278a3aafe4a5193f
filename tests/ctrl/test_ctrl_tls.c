/* test_ctrl_tls.c: the control plane's mutual TLS (td_ctrl_opts.security) over real sockets
 * on loopback, with PEM files made by openssl at test time (tests/ctrl/make_certs.sh).
 *
 *   test_ctrl_tls MAKE_CERTS_SH
 *
 * A server with the cluster's certificate serves a client with it (Health and Submit over
 * tls+tcp://, the tcp:// URL rewritten by the layer); a plain tcp client, a TLS client
 * without a certificate, one whose certificate another CA signed, a self-signed one and one
 * that does not trust the server's CA all get no reply, and the server counts (and logs) the
 * refused handshakes; the good client is still served after them. ipc:// stays plain. Files
 * that are missing or not PEM fail create with a logged reason; a tls+tcp:// URL without
 * settings is TD_EINVAL. Exit 77 (skipped) without openssl.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ctrl.h"
#include "td_clock.h"
#include "td_err.h"
#include "tharness.h"

static char g_dir[256];

static char *pem(const char *name)
{
    static char bufs[16][320];
    static int next;
    char *b = bufs[next++ % 16];
    snprintf(b, sizeof bufs[0], "%s/%s", g_dir, name);
    return b;
}

/* ---- a server owned by a thread: acks every Submit ---- */

typedef struct {
    td_ctrl_server *s;
    atomic_bool stop;
    atomic_ullong refused, requests;
    pthread_t th;
} server_run;

static void *server_main(void *arg)
{
    server_run *r = arg;
    while (!atomic_load(&r->stop)) {
        td_ctrl_server_in in;
        bool got = td_ctrl_server_recv(r->s, &in, 20) == 0 && in.kind == TD_CTRL_IN_REQUEST;
        /* the counts before the reply: a client that has its reply reads them current */
        td_ctrl_server_stats st;
        td_ctrl_server_get_stats(r->s, &st);
        atomic_store(&r->refused, st.refused);
        atomic_store(&r->requests, st.requests);
        if (got)
            td_ctrl_server_reply_ack(r->s, in.req, in.env->submit ? in.env->submit->request_id : 0);
    }
    return NULL;
}

static bool server_start(server_run *r, const td_cfg_security *sec, const char *url, char *bound,
                         size_t cap)
{
    td_ctrl_opts o = {.security = sec};
    if (td_ctrl_server_create(&o, &r->s)) return false;
    if (td_ctrl_server_listen(r->s, url, bound, cap)) {
        td_ctrl_server_destroy(r->s);
        return false;
    }
    return pthread_create(&r->th, NULL, server_main, r) == 0;
}

static void server_stop(server_run *r)
{
    atomic_store(&r->stop, true);
    pthread_join(r->th, NULL);
    td_ctrl_server_destroy(r->s);
}

/* One call on c (health, or a Submit when rid != 0): the reply's err, or TD_ETIMEDOUT. */
static int call(td_ctrl_client *c, uint64_t rid, int timeout_ms, Td__Envelope__BodyCase *body)
{
    uint64_t id;
    int rc;
    if (rid) {
        int32_t prompt[] = {1, 2, 3};
        Td__Submit sub = TD__SUBMIT__INIT;
        sub.request_id = rid;
        sub.n_token_ids = 3;
        sub.token_ids = prompt;
        sub.max_tokens = 1;
        rc = td_ctrl_client_submit(c, &sub, timeout_ms, &id);
    } else {
        rc = td_ctrl_client_health(c, timeout_ms, &id);
    }
    if (rc) return rc;
    int64_t end = td_now_ms() + timeout_ms + 2000;
    td_ctrl_client_in in = {0};
    rc = TD_ETIMEDOUT;
    while (td_now_ms() < end) {
        if (td_ctrl_client_recv(c, &in, 50) || in.kind != TD_CTRL_IN_REPLY || in.call_id != id)
            continue;
        rc = in.err;
        if (body) *body = in.env ? in.env->body_case : TD__ENVELOPE__BODY__NOT_SET;
        break;
    }
    td_ctrl_client_in_free(&in);
    return rc;
}

static td_ctrl_client *client(const char *url, const td_cfg_security *sec)
{
    td_ctrl_opts o = {.security = sec, .reconnect_max_ms = 200};
    td_ctrl_client *c = NULL;
    return td_ctrl_client_create(url, &o, &c) ? NULL : c;
}

static void test_mutual_tls(void)
{
    td_cfg_security node = {pem("ca.pem"), pem("node.pem"), pem("node.key")};
    server_run sr = {0};
    char bound[256];
    TH_REQUIRE(server_start(&sr, &node, "tcp://127.0.0.1:0", bound, sizeof bound));
    TH_CHECKF(!strncmp(bound, "tls+tcp://127.0.0.1:", 20), "bound %s", bound);
    char url[256]; /* what the YAML's host and port give (td_cfg_ctrl_url) */
    snprintf(url, sizeof url, "tcp://%s", strstr(bound, "127.0.0.1"));

    td_ctrl_client *good = client(url, &node);
    TH_REQUIRE(good);
    Td__Envelope__BodyCase body = 0;
    TH_CHECK(call(good, 0, 5000, &body) == 0 && body == TD__ENVELOPE__BODY_HEALTH);
    TH_CHECK(call(good, 42, 5000, &body) == 0 && body == TD__ENVELOPE__BODY_ACK);
    TH_CHECK(atomic_load(&sr.requests) == 1);

    /* every one of these is refused before a message goes through */
    td_cfg_security no_cert = {pem("ca.pem"), NULL, NULL};
    td_cfg_security other_ca = {pem("ca.pem"), pem("other.pem"), pem("other.key")};
    td_cfg_security self_signed = {pem("ca.pem"), pem("self.pem"), pem("self.key")};
    td_cfg_security distrust = {pem("other-ca.pem"), pem("node.pem"), pem("node.key")};
    const struct {
        const char *what;
        const td_cfg_security *sec;
    } bad[] = {{"plain tcp", NULL},
               {"TLS without a certificate", &no_cert},
               {"a certificate from another CA", &other_ca},
               {"a self-signed certificate", &self_signed},
               {"a client that does not trust the server's CA", &distrust}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint64_t before = atomic_load(&sr.refused);
        td_ctrl_client *c = client(url, bad[i].sec);
        TH_REQUIRE(c);
        int rc = call(c, 0, 1500, NULL);
        TH_CHECKF(rc != 0, "%s: a reply came (rc %d)", bad[i].what, rc);
        rc = call(c, 7, 500, NULL);
        TH_CHECKF(rc != 0, "%s: Submit was answered (rc %d)", bad[i].what, rc);
        /* the server sees the failed handshakes at its next look (once a second) */
        int64_t end = td_now_ms() + 3000;
        while (atomic_load(&sr.refused) == before && td_now_ms() < end)
            usleep(50 * 1000);
        TH_CHECKF(atomic_load(&sr.refused) > before, "%s: the server counted no refusal",
                  bad[i].what);
        td_ctrl_client_destroy(c);
        fprintf(stderr, "test_ctrl_tls: %s: refused\n", bad[i].what);
    }
    TH_CHECK(atomic_load(&sr.requests) == 1); /* nothing of theirs reached the owner */
    TH_CHECK(call(good, 0, 5000, &body) == 0 && body == TD__ENVELOPE__BODY_HEALTH);
    td_ctrl_client_destroy(good);
    server_stop(&sr);
}

/* ipc:// is one host's: it stays plain even with security set. */
static void test_ipc_stays_plain(void)
{
    td_cfg_security node = {pem("ca.pem"), pem("node.pem"), pem("node.key")};
    char url[300], bound[300];
    snprintf(url, sizeof url, "ipc://%s/ctrl.sock", g_dir);
    server_run sr = {0};
    TH_REQUIRE(server_start(&sr, &node, url, bound, sizeof bound));
    TH_CHECK(!strcmp(bound, url));
    td_ctrl_client *c = client(url, NULL);
    TH_REQUIRE(c);
    Td__Envelope__BodyCase body = 0;
    TH_CHECK(call(c, 0, 5000, &body) == 0 && body == TD__ENVELOPE__BODY_HEALTH);
    td_ctrl_client_destroy(c);
    server_stop(&sr);
}

static void test_bad_files(void)
{
    td_ctrl_server *s = NULL;
    td_ctrl_client *c = NULL;
    td_cfg_security missing = {pem("nope.pem"), pem("node.pem"), pem("node.key")};
    td_cfg_security not_pem = {pem("openssl.cnf"), pem("node.pem"), pem("node.key")};
    td_ctrl_opts o = {.security = &missing};
    TH_CHECK(td_ctrl_server_create(&o, &s) == TD_EIO && !s);
    TH_CHECK(td_ctrl_client_create("tcp://127.0.0.1:1", &o, &c) == TD_EIO && !c);
    o.security = &not_pem;
    TH_CHECK(td_ctrl_server_create(&o, &s) != 0 && !s);
    TH_CHECK(td_ctrl_client_create("tcp://127.0.0.1:1", &o, &c) != 0 && !c);
    /* (a key that is not the certificate's is only found by the first handshake: NNG 1.5.2
       does not compare them) */
    /* a tls+tcp:// URL needs the settings */
    TH_CHECK(td_ctrl_client_create("tls+tcp://127.0.0.1:1", NULL, &c) == TD_EINVAL && !c);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: test_ctrl_tls MAKE_CERTS_SH\n");
        return 2;
    }
    snprintf(g_dir, sizeof g_dir, "/tmp/tandem-ctrl-tls-XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "sh '%s' '%s'", argv[1], g_dir);
    int st = system(cmd);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 77) {
        fprintf(stderr, "test_ctrl_tls: skipped: openssl is not installed\n");
        return 77;
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "test_ctrl_tls: %s failed\n", argv[1]);
        return 1;
    }
    TH_RUN(test_bad_files);
    TH_RUN(test_mutual_tls);
    TH_RUN(test_ipc_stays_plain);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd)) { /* a leftover directory in /tmp */
    }
    TH_EXIT();
}
