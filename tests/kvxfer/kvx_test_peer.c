/* kvx_test_peer.c: the other process of the two-process kvxfer tests and of kvx-bench's
 * correctness check. One role per process, commands on stdin, one reply line each.
 *
 *   kvx_test_peer --role decode --tls T --heads H --head-dim D --block-size B --blocks N
 *                 --layers L --rank R --tp P [--timeout MS]
 *     target REQ N_STAGES N_TOKENS RUN START  -> TARGET <hex>
 *     wait REQ MS                             -> STATE <state> <reason> <stages_done> <tok0>
 *     verify REQ N_TOKENS LAYER0 LAYER1 SALT  -> BAD <count>
 *     abort REQ | release REQ                 -> OK <rc>
 *     stats                                   -> STATS <requests> <peers> <rkeys> <ops>
 *                                                (after closing idle endpoints)
 *     quit
 *   kvx_test_peer --role prefill ... --layer0 A --layer1 B --stage S --rank R --tp P
 *                 [--first-token T]
 *     send REQ N_TOKENS CHUNK DELAY_MS SALT N_TARGETS HEX... -> PF <state> <reason>
 *     quit
 *
 * The decode role progresses in the connector's thread; the prefill role in its own loop.
 * Prints READY once set up. Exits when stdin closes.
 */
#define _GNU_SOURCE /* memfd_create (kvx_scenario.h) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvx_conn.h"
#include "kvx_scenario.h"
#include "td_clock.h"

typedef struct {
    const char *role, *tls;
    uint32_t heads, head_dim, block_size, blocks, layers, rank, tp, layer0, layer1, stage;
    int timeout_ms, first_token;
} opts;

#define MAX_REQS 64
static struct {
    bool used;
    uint64_t id;
    int32_t blocks[1024]; /* the request's decode block table */
} g_reqs[MAX_REQS];

static int req_slot(uint64_t id, bool create)
{
    for (int i = 0; i < MAX_REQS; i++)
        if (g_reqs[i].used && g_reqs[i].id == id) return i;
    for (int i = 0; create && i < MAX_REQS; i++)
        if (!g_reqs[i].used) {
            g_reqs[i].used = true;
            g_reqs[i].id = id;
            return i;
        }
    return -1;
}

static int run_decode(const opts *o, kvx_pipe *pipe)
{
    kvx_conn_params cp = {
        .timeout_ms = o->timeout_ms, .abort_timeout_ms = 1000, .progress_thread = true};
    kvx_conn *c;
    if (kvx_conn_create(pipe, &cp, &c)) return 1;
    kvx_layout l = {.layer0 = 0,
                    .n_layers = o->layers,
                    .n_kv_heads = o->heads,
                    .block_size = o->block_size,
                    .head_dim = o->head_dim,
                    .dtype_size = 2,
                    .n_blocks = o->blocks};
    td_tp_heads h; /* one query head per KV head */
    if (td_tp_heads_of_rank((int)o->heads, (int)o->heads, (int)o->tp, (int)o->rank, &h)) return 1;
    l.head0 = (uint32_t)h.kv0;
    l.n_heads = (uint32_t)h.n_kv;
    int fd;
    uint8_t *region = sc_region_register(c, &l, &fd);
    if (!region) return 1;
    printf("READY\n");
    fflush(stdout);
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, stdin) > 0) {
        unsigned long long req;
        unsigned a, b, d, e;
        int ms;
        if (sscanf(line, "target %llu %u %u %u %u", &req, &a, &b, &d, &e) == 5) {
            uint32_t nb = (b + o->block_size - 1) / o->block_size;
            int slot = req_slot(req, true);
            int32_t *blk = slot >= 0 ? g_reqs[slot].blocks : NULL;
            if (!blk || nb > 1024 || nb > o->blocks) {
                printf("TARGET -\n");
            } else {
                sc_blocks(blk, nb, o->blocks, d, e);
                kvx_dec_req_params dp = {
                    .n_stages = a, .rank = o->rank, .tp = o->tp, .blocks = blk, .n_blocks = nb};
                static uint8_t buf[16384];
                static char hex[32769];
                size_t len;
                int rc = kvx_dec_make_target(c, req, &dp, buf, sizeof(buf), &len);
                if (rc)
                    printf("TARGET -\n");
                else {
                    sc_hex(buf, len, hex);
                    printf("TARGET %s\n", hex);
                }
            }
        } else if (sscanf(line, "wait %llu %d", &req, &ms) == 2) {
            kvx_dec_status ds = {0};
            int64_t end = td_now_ms() + ms;
            int rc;
            while ((rc = kvx_dec_poll(c, req, &ds)) == 0 && !sc_final(ds.state) &&
                   td_now_ms() < end)
                usleep(1000);
            if (rc)
                printf("STATE -1 0 0 0\n");
            else
                printf("STATE %d %d %llu %d\n", ds.state, ds.reason,
                       (unsigned long long)ds.stages_done, ds.meta[ds.n_stages - 1].first_token);
        } else if (sscanf(line, "verify %llu %u %u %u %u", &req, &a, &b, &d, &e) == 5) {
            int slot = req_slot(req, false);
            int32_t *blk = slot >= 0 ? g_reqs[slot].blocks : NULL;
            uint32_t nb = (a + o->block_size - 1) / o->block_size;
            size_t bad = blk ? sc_verify(region, &l, blk, nb, a, b, d, e, 0) : (size_t)-1;
            printf("BAD %zu\n", bad);
        } else if (sscanf(line, "abort %llu", &req) == 1) {
            printf("OK %d\n", kvx_dec_abort(c, req));
        } else if (sscanf(line, "release %llu", &req) == 1) {
            int rc = kvx_dec_release(c, req);
            int slot = req_slot(req, false);
            if (!rc && slot >= 0) g_reqs[slot].used = false;
            printf("OK %d\n", rc);
        } else if (strncmp(line, "stats", 5) == 0) {
            usleep(20000);
            kvx_conn_close_idle(c);
            kvx_conn_stats st;
            kvx_conn_stats_get(c, &st);
            printf("STATS %d %d %d %d\n", st.dec_requests, st.peers, st.pipe.rkeys,
                   st.pipe.pending_ops);
        } else if (strncmp(line, "quit", 4) == 0) {
            break;
        } else {
            printf("ERR\n");
        }
        fflush(stdout);
    }
    free(line);
    kvx_conn_destroy(c);
    sc_region_free(region, &l, fd);
    return 0;
}

static int run_prefill(const opts *o, kvx_pipe *pipe)
{
    kvx_conn_params cp = {.timeout_ms = o->timeout_ms, .abort_timeout_ms = 1000};
    sc_src s;
    if (sc_src_init(&s, pipe, &cp, o->heads, o->head_dim, o->block_size, o->blocks, o->layer0,
                    o->layer1, o->stage, o->rank, o->tp))
        return 1;
    printf("READY\n");
    fflush(stdout);
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, stdin) > 0) {
        unsigned long long req;
        unsigned n_tokens, chunk, salt, n_tgt;
        int delay, used;
        if (sscanf(line, "send %llu %u %u %d %u %u%n", &req, &n_tokens, &chunk, &delay, &salt,
                   &n_tgt, &used) == 6) {
            int rc = sc_src_open(&s, req, n_tokens, salt, 0);
            const char *p = line + used;
            static uint8_t buf[16384];
            for (unsigned t = 0; !rc && t < n_tgt; t++) {
                while (*p == ' ')
                    p++;
                size_t n = sc_unhex(p, buf, sizeof(buf));
                p += 2 * n;
                rc = kvx_pf_add_target(s.c, req, buf, n);
            }
            uint32_t nch = (n_tokens + chunk - 1) / chunk;
            for (uint32_t k = 0; !rc && k < nch; k++) {
                rc = sc_src_send(&s, req, n_tokens, chunk, k, 0);
                int64_t end = td_now_ms() + delay;
                do
                    kvx_conn_progress(s.c, 1);
                while (td_now_ms() < end);
            }
            kvx_meta m = {.first_token = o->first_token, .n_tokens = n_tokens};
            if (!rc) rc = kvx_pf_finish(s.c, req, &m);
            kvx_pf_status ps = {0};
            int64_t end = td_now_ms() + o->timeout_ms + 3000;
            while (kvx_pf_poll(s.c, req, &ps) == 0 && !sc_final(ps.state) && td_now_ms() < end)
                kvx_conn_progress(s.c, 10);
            printf("PF %d %d\n", rc ? -1 : (int)ps.state, ps.reason);
            kvx_pf_release(s.c, req);
        } else if (strncmp(line, "quit", 4) == 0) {
            break;
        } else {
            printf("ERR\n");
        }
        fflush(stdout);
    }
    free(line);
    sc_src_fini(&s);
    return 0;
}

int main(int argc, char **argv)
{
    opts o = {.role = "decode",
              .heads = 4,
              .head_dim = 8,
              .block_size = 16,
              .blocks = 64,
              .layers = 4,
              .tp = 1,
              .layer1 = 4,
              .timeout_ms = 5000,
              .first_token = -1};
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        unsigned u = (unsigned)strtoul(v, NULL, 10);
        if (!strcmp(k, "--role"))
            o.role = v;
        else if (!strcmp(k, "--tls"))
            o.tls = v;
        else if (!strcmp(k, "--heads"))
            o.heads = u;
        else if (!strcmp(k, "--head-dim"))
            o.head_dim = u;
        else if (!strcmp(k, "--block-size"))
            o.block_size = u;
        else if (!strcmp(k, "--blocks"))
            o.blocks = u;
        else if (!strcmp(k, "--layers"))
            o.layers = u;
        else if (!strcmp(k, "--rank"))
            o.rank = u;
        else if (!strcmp(k, "--tp"))
            o.tp = u;
        else if (!strcmp(k, "--layer0"))
            o.layer0 = u;
        else if (!strcmp(k, "--layer1"))
            o.layer1 = u;
        else if (!strcmp(k, "--stage"))
            o.stage = u;
        else if (!strcmp(k, "--timeout"))
            o.timeout_ms = (int)u;
        else if (!strcmp(k, "--first-token"))
            o.first_token = atoi(v);
        else {
            fprintf(stderr, "kvx_test_peer: unknown option %s\n", k);
            return 2;
        }
    }
    kvx_pipe_params pp = {.tls = o.tls};
    kvx_pipe *pipe;
    if (kvx_pipe_ucx_create(&pp, &pipe)) return 1;
    return !strcmp(o.role, "prefill") ? run_prefill(&o, pipe) : run_decode(&o, pipe);
}
