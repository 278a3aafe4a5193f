/* test_rt_unit.c: router units without processes: stop-string hold-back (random texts
 * fed character by character: the emitted text is exactly the text before the first stop
 * string to complete), the request table, the fair queue (round robin, put-back, the
 * victim when full, the overflow slot), the API key comparison, client keys and the body
 * limit, the choice of decode and prefill instances, the disaggregated pairing's
 * bookkeeping (replies and events fed by hand, the verdicts carried out by the loop's
 * rt_loop_act; the control clients dial ports nobody listens on, so calls just stay
 * pending), the per-instance counters' series (summed across restarts; speculative
 * decoding's from a Health message to the exposition), and rt_stream over a real tokenizer
 * (argv[1]: a GGUF) with the per-request "timeout" field. */
#include <stdlib.h>
#include <string.h>

#include "rt.h"
#include "rt_http.h"
#include "rt_loop_int.h"
#include "rt_pair.h"
#include "rt_stream.h"
#include "tharness.h"

/* the emitter's rule applied to text arriving a character at a time */
static void holdback_once(unsigned seed)
{
    srand(seed);
    char text[200];
    size_t n = (size_t)(rand() % 150) + 1;
    for (size_t i = 0; i < n; i++)
        text[i] = "abc"[rand() % 3];
    text[n] = 0;
    char *stop[RT_MAX_STOP];
    size_t stop_len[RT_MAX_STOP];
    int n_stop = rand() % RT_MAX_STOP + 1;
    char bufs[RT_MAX_STOP][8];
    for (int i = 0; i < n_stop; i++) {
        stop_len[i] = (size_t)(rand() % 5) + 1;
        for (size_t k = 0; k < stop_len[i]; k++)
            bufs[i][k] = "abc"[rand() % 3];
        bufs[i][stop_len[i]] = 0;
        stop[i] = bufs[i];
    }
    /* the request ends when the first stop string completes, cut where that one starts */
    size_t want = n;
    for (size_t e = 1; e <= n; e++) {
        long at = rt_stop_find(text, e, stop, stop_len, n_stop);
        if (at >= 0) {
            want = (size_t)at;
            break;
        }
    }
    char held[256], out[256];
    size_t nh = 0, no = 0, pos = 0;
    bool stopped = false;
    while (pos < n && !stopped) {
        size_t k = 1; /* one character at a time (see rt_stream.c for several) */
        if (k > n - pos) k = n - pos;
        memcpy(held + nh, text + pos, k);
        nh += k;
        pos += k;
        long at = rt_stop_find(held, nh, stop, stop_len, n_stop);
        if (at >= 0) {
            memcpy(out + no, held, (size_t)at);
            no += (size_t)at;
            stopped = true;
            break;
        }
        size_t keep = rt_stop_holdback(held, nh, stop, stop_len, n_stop);
        memcpy(out + no, held, nh - keep);
        no += nh - keep;
        memmove(held, held + nh - keep, keep);
        nh = keep;
    }
    if (!stopped) {
        memcpy(out + no, held, nh);
        no += nh;
    }
    TH_CHECKF(no == want && !memcmp(out, text, want), "seed %u: '%s' emitted %zu want %zu", seed,
              text, no, want);
}

static void test_holdback(void)
{
    for (unsigned s = 1; s <= 3000; s++)
        holdback_once(s);
    char *stop[] = {"END"};
    size_t len[] = {3};
    TH_CHECK(rt_stop_holdback("abcEN", 5, stop, len, 1) == 2);
    TH_CHECK(rt_stop_holdback("abcE", 4, stop, len, 1) == 1);
    TH_CHECK(rt_stop_holdback("abc", 3, stop, len, 1) == 0);
    TH_CHECK(rt_stop_find("xxENDyy", 7, stop, len, 1) == 2);
}

static void test_table(void)
{
    rt_table t = {0};
    rt_req reqs[600];
    memset(reqs, 0, sizeof reqs);
    for (int i = 0; i < 600; i++)
        TH_REQUIRE(rt_table_add(&t, &reqs[i]) == 0);
    for (int i = 0; i < 600; i++)
        TH_CHECK(rt_table_get(&t, reqs[i].loop.rid) == &reqs[i]);
    uint64_t old = reqs[5].loop.rid;
    rt_table_remove(&t, &reqs[5]);
    TH_CHECK(rt_table_get(&t, old) == NULL);
    TH_CHECK(rt_table_add(&t, &reqs[5]) == 0);
    TH_CHECK(reqs[5].loop.rid != old && rt_table_get(&t, old) == NULL);
    TH_CHECK(rt_table_get(&t, reqs[5].loop.rid) == &reqs[5]);
    TH_CHECK(t.count == 600);
    rt_table_fini(&t);
}

/* ---- the fair queue (rt_fair.c) ---- */

static rt_req *freq(rt_req *q, uint64_t client)
{
    memset(q, 0, sizeof *q);
    q->client = client;
    q->loop.fslot = -1;
    return q;
}

/* Pop everything; the clients' keys in order, as a string ("ABAC..."). */
static void pop_order(rt_fair *f, char *out, size_t cap)
{
    size_t n = 0;
    rt_req *q;
    while ((q = rt_fair_pop(f)) && n + 1 < cap)
        out[n++] = (char)q->client;
    out[n] = 0;
}

static void test_fair(void)
{
    static rt_fair f; /* zeroed: empty */
    static rt_req r[600];
    char order[600];
    TH_CHECK(rt_fair_peek(&f) == NULL && rt_fair_pop(&f) == NULL);

    /* round robin over clients, FIFO within one */
    for (int i = 0; i < 3; i++)
        rt_fair_push(&f, freq(&r[i], 'A'));
    for (int i = 3; i < 5; i++)
        rt_fair_push(&f, freq(&r[i], 'B'));
    rt_fair_push(&f, freq(&r[5], 'C'));
    TH_CHECK(f.len == 6 && f.n_clients == 3 && rt_fair_count(&f, 'A') == 3);
    TH_CHECK(rt_fair_peek(&f) == &r[0]);
    pop_order(&f, order, sizeof order);
    TH_CHECKF(!strcmp(order, "ABCABA"), "%s", order);
    TH_CHECK(f.len == 0 && f.n_clients == 0);

    /* a client that arrives mid-round waits for one turn of each active client */
    for (int i = 0; i < 2; i++)
        rt_fair_push(&f, freq(&r[i], 'A'));
    for (int i = 2; i < 4; i++)
        rt_fair_push(&f, freq(&r[i], 'B'));
    TH_CHECK(rt_fair_pop(&f) == &r[0]); /* A; B is next */
    rt_fair_push(&f, freq(&r[4], 'D'));
    pop_order(&f, order, sizeof order);
    TH_CHECKF(!strcmp(order, "BADB"), "%s", order);

    /* a request put back goes first, and its client is served next */
    for (int i = 0; i < 2; i++)
        rt_fair_push(&f, freq(&r[i], 'A'));
    rt_fair_push(&f, freq(&r[2], 'B'));
    rt_req *a0 = rt_fair_pop(&f); /* A; B next */
    TH_CHECK(a0 == &r[0]);
    rt_fair_push_front(&f, a0);
    TH_CHECK(rt_fair_peek(&f) == a0);
    pop_order(&f, order, sizeof order);
    TH_CHECKF(!strcmp(order, "ABA"), "%s", order);

    /* removal anywhere; an emptied client leaves the ring */
    for (int i = 0; i < 3; i++)
        rt_fair_push(&f, freq(&r[i], 'A'));
    rt_fair_push(&f, freq(&r[3], 'B'));
    rt_fair_remove(&f, &r[1]);
    rt_fair_remove(&f, &r[3]);
    TH_CHECK(r[1].loop.fslot == -1 && f.n_clients == 1 && f.len == 2);
    TH_CHECK(rt_fair_pop(&f) == &r[0] && rt_fair_pop(&f) == &r[2] && !rt_fair_peek(&f));

    /* the queue is full: the heaviest client gives up its newest request when that narrows
       the gap, never for a newcomer of its own */
    for (int i = 0; i < 5; i++)
        rt_fair_push(&f, freq(&r[i], 'G'));
    TH_CHECK(rt_fair_victim(&f, 'Q') == &r[4]);
    TH_CHECK(rt_fair_victim(&f, 'G') == NULL);
    for (int i = 5; i < 8; i++)
        rt_fair_push(&f, freq(&r[i], 'Q'));
    TH_CHECK(rt_fair_victim(&f, 'Q') == &r[4]); /* 5 > 3 + 1 */
    rt_fair_push(&f, freq(&r[8], 'Q'));
    TH_CHECK(rt_fair_victim(&f, 'Q') == NULL); /* 5 <= 4 + 1 */
    TH_CHECK(rt_fair_victim(&f, 'Z') == &r[4]);
    pop_order(&f, order, sizeof order);
    TH_CHECKF(!strcmp(order, "GQGQGQGQG"), "%s", order);

    /* more clients than slots: the rest share the overflow slot, which is one client */
    for (int i = 0; i < RT_FAIR_CLIENTS + 2; i++)
        rt_fair_push(&f, freq(&r[i], 1000 + (uint64_t)i));
    rt_fair_push(&f, freq(&r[RT_FAIR_CLIENTS + 2], 1000)); /* the first client again */
    TH_CHECK(f.n_clients == RT_FAIR_CLIENTS + 1 && f.len == RT_FAIR_CLIENTS + 3);
    TH_CHECK(r[RT_FAIR_CLIENTS].loop.fslot == RT_FAIR_CLIENTS &&
             r[RT_FAIR_CLIENTS + 1].loop.fslot == RT_FAIR_CLIENTS);
    TH_CHECK(rt_fair_count(&f, 1000) == 2 && rt_fair_count(&f, 99999) == 2);
    int popped = 0;
    while (rt_fair_pop(&f))
        popped++;
    TH_CHECK(popped == RT_FAIR_CLIENTS + 3 && f.len == 0 && f.n_clients == 0);
    for (int s = 0; s <= RT_FAIR_CLIENTS; s++)
        TH_CHECK(!f.c[s].n && !f.c[s].head && !f.c[s].tail);
}

static void test_keys(void)
{
    TH_CHECK(rt_key_equal("Bearer sk-1", "Bearer sk-1"));
    TH_CHECK(!rt_key_equal("Bearer sk-2", "Bearer sk-1"));
    TH_CHECK(!rt_key_equal("Bearer sk-", "Bearer sk-1"));
    TH_CHECK(!rt_key_equal("Bearer sk-11", "Bearer sk-1"));
    TH_CHECK(!rt_key_equal("", "Bearer sk-1") && rt_key_equal("", ""));
    unsigned char a1[4] = {127, 0, 0, 1}, a2[4] = {127, 0, 0, 2};
    uint64_t k = rt_client_key(a1, 4, NULL);
    TH_CHECK(k == rt_client_key(a1, 4, ""));
    TH_CHECK(k != rt_client_key(a2, 4, NULL) && k != rt_client_key(a1, 4, "Bearer x"));
    TH_CHECK(rt_client_key(a1, 4, "Bearer x") != rt_client_key(a1, 4, "Bearer y"));
    td_cfg cfg = {0};
    cfg.router.max_prompt_tokens = 8192;
    TH_CHECK(rt_max_body(&cfg) == RT_MIN_BODY);
    cfg.router.max_prompt_tokens = 100000;
    TH_CHECK(rt_max_body(&cfg) == 6400000);
    cfg.router.max_prompt_tokens = 1 << 24;
    TH_CHECK(rt_max_body(&cfg) == RT_MAX_BODY);
}

/* ---- instance choice ---- */

static void test_pick(void)
{
    rt_inst d[3] = {0}, p[3] = {0};
    rt_registry g = {.inst = d, .n = 3, .pf = p, .n_pf = 3};
    for (int i = 0; i < 3; i++) {
        d[i] = (rt_inst){.alive = true, .cap = 4, .kv_free = 100};
        p[i] = (rt_inst){.alive = true, .cap = 4};
    }
    /* decode: most free blocks, then least running + active; never dead, full or busy */
    d[1].kv_free = 200;
    TH_CHECK(rt_reg_pick(&g, 0) == 1);
    d[1].busy_until_ms = 50;
    TH_CHECK(rt_reg_pick(&g, 10) == 0 && rt_reg_pick(&g, 60) == 1);
    d[1].active = 4;
    TH_CHECK(rt_reg_pick(&g, 60) == 0);
    d[0].running = 3;
    TH_CHECK(rt_reg_pick(&g, 60) == 2);
    d[0].alive = d[1].alive = d[2].alive = false;
    TH_CHECK(rt_reg_pick(&g, 60) == -1);

    /* prefill: idle instances in turn */
    int seen[3] = {0};
    for (int k = 0; k < 6; k++)
        seen[rt_reg_pick_prefill(&g, 0, -1)]++;
    TH_CHECK(seen[0] == 2 && seen[1] == 2 && seen[2] == 2);
    /* least load: the larger of the reported queue and the router's own attempts */
    p[0].queued_tokens = 500;
    p[1].inflight_tokens = 300;
    p[2].queued_tokens = 100;
    p[2].inflight_tokens = 400;
    TH_CHECK(rt_reg_pick_prefill(&g, 0, -1) == 1);
    p[1].queued_tokens = 450;
    TH_CHECK(rt_reg_pick_prefill(&g, 0, -1) == 2);
    /* equal tokens: fewer waiting + running */
    p[0].queued_tokens = p[1].queued_tokens = 400;
    p[0].inflight_tokens = p[1].inflight_tokens = p[2].inflight_tokens = 0;
    p[2].queued_tokens = 1000;
    p[0].waiting = 2;
    p[1].running = 1;
    TH_CHECK(rt_reg_pick_prefill(&g, 0, -1) == 1);
    TH_CHECK(rt_reg_pick_prefill(&g, 0, 1) == 0); /* avoid */
    TH_CHECK(rt_reg_pick_prefill(&g, 0, 0) == 1);
    p[1].busy_until_ms = 100;
    TH_CHECK(rt_reg_pick_prefill(&g, 50, -1) == 0);
    TH_CHECK(rt_reg_pick_prefill(&g, 150, -1) == 1);
    p[0].active = 4; /* at its cap */
    TH_CHECK(rt_reg_pick_prefill(&g, 50, -1) == 2);
    p[2].alive = false;
    TH_CHECK(rt_reg_pick_prefill(&g, 50, -1) == -1);
    p[2].alive = true;
    TH_CHECK(rt_reg_n_pf_alive(&g, -1) == 3 && rt_reg_n_pf_alive(&g, 0) == 2);
    p[1].alive = false;
    TH_CHECK(rt_reg_n_pf_alive(&g, 0) == 1);

    /* a prefill entry must answer as a prefill leader to be ready */
    rt_inst x = {.pcfg = &(td_cfg_prefill){.name = "p"}, .name = "p"};
    Td__Health h = TD__HEALTH__INIT;
    h.ready = true;
    h.role = TD__ROLE__ROLE_DECODE;
    h.queued_prompt_tokens = 77;
    TH_CHECK(!rt_reg_seen(&x, &h, 1) && !x.alive);
    h.role = TD__ROLE__ROLE_PREFILL;
    TH_CHECK(rt_reg_seen(&x, &h, 2) && x.alive && x.queued_tokens == 77);

    /* a member whose Join said it leaves stays leaving when a Health it sent before arrives
       after the Join (the two come on different sockets): seen in a CI run, where the late
       Health's draining = false made the router send it requests and forget it as dead */
    x.left = x.draining = true;
    h.draining = false;
    rt_reg_seen(&x, &h, 3);
    TH_CHECK(x.alive && x.draining);
    x.left = false; /* a later Join without Join.leaving: the Health decides again */
    rt_reg_seen(&x, &h, 4);
    TH_CHECK(x.alive && !x.draining);
}

/* ---- per-instance counters across restarts (rt_metrics_inst.c) ---- */

/* The value of series `want` (name and labels, up to the value) in the rendered text. */
static double series(const char *text, const char *want)
{
    const char *p = strstr(text, want);
    return p ? strtod(p + strlen(want), NULL) : -1;
}

/* A decode instance's counters (preemptions, step times) are summed across its restarts:
 * a restart seen as counts going back, or as a new boot id while the counts grew past the
 * old process's (which "went back" alone would miss). */
static void test_inst_counters(void)
{
    static const char yaml[] = "model: /nonexistent.gguf\ndecode: [{name: d0, port: 3}]\n";
    char err[256];
    td_cfg *cfg = NULL;
    TH_REQUIRE(td_cfg_parse(yaml, strlen(yaml), "unit", &cfg, err, sizeof err) == 0);
    rt_metrics m;
    TH_REQUIRE(rt_metrics_init(&m, 1, 0) == 0);
    rt_metrics_set_model(&m, "x", 1);
    /* (boot id, preemptions, steps in the 0.05 s bucket, their time in us) */
    const uint64_t seen[][4] = {{7, 2, 10, 400000},
                                {7, 3, 12, 500000},  /* one process */
                                {7, 1, 4, 100000},   /* went back */
                                {9, 5, 20, 900000}}; /* new boot, grew */
    for (int k = 0; k < 4; k++) {
        rt_inst_gauge g = {
            .preemptions = seen[k][1], .boot_id = seen[k][0], .alive = true, .name = "d0"};
        g.steps[td_step_hist_bucket(0.04)] = seen[k][2];
        g.steps[TD_STEP_HIST_N + 1] = seen[k][3];
        rt_metrics_publish_inst(&m, 0, &g);
    }
    char *text = rt_metrics_render(&m, cfg);
    TH_REQUIRE(text);
    /* 3 + 1 + 5 preemptions; 12 + 4 + 20 steps, (0.5 + 0.1 + 0.9) s */
    TH_CHECK(series(text, "vllm:num_preemptions_total{model_name=\"x\",instance=\"d0\"} ") == 9);
    TH_CHECK(series(text, "tandem_decode_step_seconds_count{model_name=\"x\",instance=\"d0\"} ") ==
             36);
    TH_CHECK(series(text, "tandem_decode_step_seconds_sum{model_name=\"x\",instance=\"d0\"} ") ==
             1.5);
    TH_CHECK(series(text, "tandem_decode_step_seconds_bucket{model_name=\"x\",instance=\"d0\","
                          "le=\"0.03\"} ") == 0);
    TH_CHECK(series(text, "tandem_decode_step_seconds_bucket{model_name=\"x\",instance=\"d0\","
                          "le=\"0.05\"} ") == 36);
    free(text);
    /* the slot goes to another instance (router.membership: d0 forgotten, d9 joined): its
       counts start from 0, and d0's series are gone */
    rt_inst_gauge g9 = {.preemptions = 1, .boot_id = 11, .alive = true, .name = "d9"};
    rt_metrics_publish_inst(&m, 0, &g9);
    text = rt_metrics_render(&m, cfg);
    TH_REQUIRE(text);
    TH_CHECK(series(text, "vllm:num_preemptions_total{model_name=\"x\",instance=\"d9\"} ") == 1);
    TH_CHECK(series(text, "tandem_decode_step_seconds_count{model_name=\"x\",instance=\"d9\"} ") ==
             0);
    TH_CHECK(!strstr(text, "instance=\"d0\""));
    free(text);
    rt_metrics_fini(&m);
    td_cfg_free(cfg);
}

/* Speculative decoding's counts (Health 34-37, 39) from a Health through rt_reg_seen, the
 * loop's snapshot (rt_reg_gauge) and rt_metrics_publish_inst to vLLM's series: summed
 * across restarts (counts that went back, a new boot id), positions past the message's end
 * counted 0, those past RT_SPEC_POS dropped, per-position series up to the last position
 * with an accepted token, an instance that never speculated at 0 with no position. */
static void test_spec_counters(void)
{
    static const char yaml[] = "model: /nonexistent.gguf\n"
                               "decode: [{name: d0, port: 3}, {name: d1, port: 4}]\n";
    char err[256];
    td_cfg *cfg = NULL;
    TH_REQUIRE(td_cfg_parse(yaml, strlen(yaml), "unit", &cfg, err, sizeof err) == 0);
    rt_metrics m;
    TH_REQUIRE(rt_metrics_init(&m, 2, 0) == 0);
    rt_metrics_set_model(&m, "x", 1);
    rt_inst d0 = {.cfg = &cfg->decode[0], .name = "d0"};
    rt_inst d1 = {.cfg = &cfg->decode[1], .name = "d1"};
    /* (boot id, uptime ms, drafts, draft tokens, accepted, accepted at positions 0-2) */
    const uint64_t seen[][8] = {{7, 100, 4, 12, 5, 3, 2, 0},
                                {7, 200, 10, 30, 14, 8, 4, 2},    /* one process */
                                {7, 50, 2, 6, 1, 1, 0, 0},        /* went back */
                                {9, 900, 20, 60, 30, 15, 10, 5}}; /* new boot, grew */
    uint64_t pos[RT_SPEC_POS + 2];
    for (int k = 0; k < 4; k++) {
        Td__Health h = TD__HEALTH__INIT;
        h.ready = true;
        h.role = TD__ROLE__ROLE_DECODE;
        h.boot_id = seen[k][0];
        h.uptime_ms = seen[k][1];
        h.spec_drafts = seen[k][2];
        h.spec_draft_tokens = seen[k][3];
        h.spec_accepted_tokens = seen[k][4];
        memset(pos, 0, sizeof pos);
        size_t n = 0; /* up to the last nonzero position, as dc_serve.c sends them */
        for (int j = 0; j < 3; j++)
            if ((pos[j] = seen[k][5 + j])) n = (size_t)j + 1;
        if (k == 3) { /* a node with more positions than the router keeps */
            pos[RT_SPEC_POS - 1] = 4;
            pos[RT_SPEC_POS + 1] = 6;
            n = RT_SPEC_POS + 2;
        }
        h.n_spec_accepted_per_pos = n;
        h.spec_accepted_per_pos = pos;
        h.spec_held_steps = seen[k][2] / 2; /* 5, 1, 10: summed across the restart */
        /* share_cores's counters: as drafts, draft tokens, accepted (the same sums) */
        h.share_claimed_steps = seen[k][2];
        h.share_left_steps = seen[k][3];
        h.share_switches = seen[k][4];
        h.share_claiming = k == 3;
        rt_reg_seen(&d0, &h, 1 + k);
        TH_CHECK(d0.spec[0] == seen[k][2] && d0.spec[3 + 2] == seen[k][7] && d0.spec[3 + 3] == 0);
        rt_inst_gauge g = rt_reg_gauge(&d0);
        rt_metrics_publish_inst(&m, 0, &g);
    }
    Td__Health none = TD__HEALTH__INIT; /* d1: no speculation (or an older node) */
    none.ready = true;
    rt_reg_seen(&d1, &none, 1);
    rt_inst_gauge g1 = rt_reg_gauge(&d1);
    rt_metrics_publish_inst(&m, 1, &g1);
    char *text = rt_metrics_render(&m, cfg);
    TH_REQUIRE(text);
    /* 10 + 2 + 20 drafts; 30 + 6 + 60 draft tokens; 14 + 1 + 30 accepted */
    TH_CHECK(series(text, "vllm:spec_decode_num_drafts_total{model_name=\"x\",instance=\"d0\"} ") ==
             32);
    TH_CHECK(series(text, "vllm:spec_decode_num_draft_tokens_total{model_name=\"x\","
                          "instance=\"d0\"} ") == 96);
    TH_CHECK(series(text, "vllm:spec_decode_num_accepted_tokens_total{model_name=\"x\","
                          "instance=\"d0\"} ") == 45);
    TH_CHECK(series(text, "tandem_spec_decode_gate_held_steps_total{model_name=\"x\","
                          "instance=\"d0\"} ") == 16);
    TH_CHECK(series(text, "tandem_spec_decode_gate_held_steps_total{model_name=\"x\","
                          "instance=\"d1\"} ") == 0);
    TH_CHECK(series(text, "tandem_decode_share_cores_claimed_steps_total{model_name=\"x\","
                          "instance=\"d0\"} ") == 32);
    TH_CHECK(series(text, "tandem_decode_share_cores_left_steps_total{model_name=\"x\","
                          "instance=\"d0\"} ") == 96);
    TH_CHECK(series(text, "tandem_decode_share_cores_claiming_started_total{model_name=\"x\","
                          "instance=\"d0\"} ") == 45);
    TH_CHECK(series(text, "tandem_decode_share_cores_claiming{model_name=\"x\","
                          "instance=\"d0\"} ") == 1);
    TH_CHECK(series(text, "tandem_decode_share_cores_claiming{model_name=\"x\","
                          "instance=\"d1\"} ") == 0);
    TH_CHECK(series(text, "tandem_decode_share_cores_claimed_steps_total{model_name=\"x\","
                          "instance=\"d1\"} ") == 0);
    /* positions: 8 + 1 + 15, 4 + 0 + 10, 2 + 0 + 5; the last kept one 4, later dropped */
    static const struct {
        int pos;
        double want;
    } at[] = {{0, 24}, {1, 14}, {2, 7}, {3, 0}, {RT_SPEC_POS - 1, 4}};
    for (size_t k = 0; k < sizeof at / sizeof at[0]; k++) {
        char want[256];
        snprintf(want, sizeof want,
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=\"x\","
                 "instance=\"d0\",position=\"%d\"} ",
                 at[k].pos);
        TH_CHECKF(series(text, want) == at[k].want, "position %d: %g, want %g", at[k].pos,
                  series(text, want), at[k].want);
    }
    char past[64];
    snprintf(past, sizeof past, "position=\"%d\"", RT_SPEC_POS);
    TH_CHECK(!strstr(text, past));
    TH_CHECK(series(text, "vllm:spec_decode_num_drafts_total{model_name=\"x\",instance=\"d1\"} ") ==
             0);
    TH_CHECK(series(text, "vllm:spec_decode_num_accepted_tokens_total{model_name=\"x\","
                          "instance=\"d1\"} ") == 0);
    TH_CHECK(!strstr(text, "instance=\"d1\",position="));
    const char *t = strstr(text, "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total "
                                 "counter\n");
    TH_CHECK(t && !strstr(t + 1, "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total "));
    free(text);
    rt_cidx_fini(&d0.cidx);
    rt_cidx_fini(&d1.cidx);
    rt_metrics_fini(&m);
    td_cfg_free(cfg);
}

/* What each instance computes with: Health 27-33 through rt_reg_seen into rt_inst, the
 * loop's copy into the gauges, and the three series per instance that reported (label
 * values escaped, bytes outside printable ASCII replaced). */
static void test_compute_series(void)
{
    static const char yaml[] = "model: /nonexistent.gguf\n"
                               "prefill: [{name: p0, port: 1}]\n"
                               "decode: [{name: d0, port: 3}, {name: d1, port: 4}]\n";
    char err[256];
    td_cfg *cfg = NULL;
    TH_REQUIRE(td_cfg_parse(yaml, strlen(yaml), "unit", &cfg, err, sizeof err) == 0);
    rt_metrics m;
    TH_REQUIRE(rt_metrics_init(&m, 2, 1) == 0);
    rt_metrics_set_model(&m, "x", 1);
    rt_inst d0 = {.cfg = &cfg->decode[0], .name = "d0"};
    rt_inst p0 = {.pcfg = &cfg->prefill[0], .name = "p0"};
    Td__Health h = TD__HEALTH__INIT;
    h.ready = true;
    h.role = TD__ROLE__ROLE_DECODE;
    h.backend = "cpu";
    h.act = "f32";
    h.cpu_isa = "avx512";
    h.kernels_isa = "avx512";
    h.blas_core = "Cooperlake";
    h.compute_paths = "Q4_1: batch float32 tiles + OpenBLAS sgemm, solo float32 dot";
    TH_CHECK(rt_reg_seen(&d0, &h, 1) && d0.compute.seen && !d0.compute.blas_older);
    /* a prefill instance on a VM that hides the CPU's model: OpenBLAS fell back */
    h.role = TD__ROLE__ROLE_PREFILL;
    h.act = "q8";
    h.kernels_isa = "avx2";
    h.blas_core = "Prescott";
    h.blas_core_older = true;
    h.compute_paths = "Q8_0: a \"quoted\" \\ path\nnext \xc3\xa9";
    TH_CHECK(rt_reg_seen(&p0, &h, 1) && p0.compute.blas_older);
    /* the loop's snapshot (rt_loop.c, publish_metrics); d1 never reported */
    rt_inst_gauge g = {.alive = true, .compute = d0.compute, .name = "d0"};
    rt_metrics_publish_inst(&m, 0, &g);
    rt_pf_gauge pg = {.alive = true, .compute = p0.compute, .name = "p0"};
    rt_metrics_publish_pf(&m, 0, &pg);
    char *text = rt_metrics_render(&m, cfg);
    TH_REQUIRE(text);
    TH_CHECK(series(text, "tandem_instance_compute_info{instance=\"d0\",role=\"decode\","
                          "backend=\"cpu\",act=\"f32\",cpu_isa=\"avx512\","
                          "kernels_isa=\"avx512\",blas_core=\"Cooperlake\"} ") == 1);
    TH_CHECK(series(text, "tandem_instance_compute_info{instance=\"p0\",role=\"prefill\","
                          "backend=\"cpu\",act=\"q8\",cpu_isa=\"avx512\","
                          "kernels_isa=\"avx2\",blas_core=\"Prescott\"} ") == 1);
    TH_CHECK(series(text, "tandem_instance_blas_core_older_than_cpu{instance=\"d0\","
                          "role=\"decode\"} ") == 0);
    TH_CHECK(series(text, "tandem_instance_blas_core_older_than_cpu{instance=\"p0\","
                          "role=\"prefill\"} ") == 1);
    TH_CHECK(series(text, "tandem_instance_products_info{instance=\"d0\",role=\"decode\","
                          "paths=\"Q4_1: batch float32 tiles + OpenBLAS sgemm, solo float32 "
                          "dot\"} ") == 1);
    TH_CHECK(series(text, "tandem_instance_products_info{instance=\"p0\",role=\"prefill\","
                          "paths=\"Q8_0: a \\\"quoted\\\" \\\\ path\\nnext ??\"} ") == 1);
    TH_CHECK(!strstr(text, "{instance=\"d1\",role="));
    const char *t = strstr(text, "# TYPE tandem_instance_compute_info gauge\n");
    TH_CHECK(t && !strstr(t + 1, "# TYPE tandem_instance_compute_info "));
    free(text);
    /* an older node says nothing of it: empty labels, and "fits" */
    Td__Health old = TD__HEALTH__INIT;
    old.ready = true;
    rt_reg_seen(&d0, &old, 2);
    g.compute = d0.compute;
    rt_metrics_publish_inst(&m, 0, &g);
    text = rt_metrics_render(&m, cfg);
    TH_REQUIRE(text);
    TH_CHECK(series(text, "tandem_instance_compute_info{instance=\"d0\",role=\"decode\","
                          "backend=\"\",act=\"\",cpu_isa=\"\",kernels_isa=\"\","
                          "blas_core=\"\"} ") == 1);
    TH_CHECK(series(text, "tandem_instance_blas_core_older_than_cpu{instance=\"d0\","
                          "role=\"decode\"} ") == 0);
    free(text);
    rt_cidx_fini(&d0.cidx);
    rt_cidx_fini(&p0.cidx);
    rt_metrics_fini(&m);
    td_cfg_free(cfg);
}

/* ---- pairing bookkeeping (rt_pair.c) ---- */

static rt_router g_r;

static int pair_setup(void)
{
    static const char yaml[] = "model: /nonexistent.gguf\n"
                               "router: {instance_timeout_ms: 1000}\n"
                               "kvxfer: {timeout_ms: 2000}\n"
                               "prefill: [{name: p0, pp: 2, port: 1}, {name: p1, port: 2}]\n"
                               "decode: [{name: d0, port: 3}]\n";
    char err[256];
    memset(&g_r, 0, sizeof g_r);
    if (td_cfg_parse(yaml, strlen(yaml), "unit", &g_r.cfg, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return -1;
    }
    g_r.disagg = true;
    if (rt_reg_init(&g_r.reg, g_r.cfg) || rt_metrics_init(&g_r.metrics, 1, 2)) return -1;
    /* as after their first ready health answer (replies and events keep alive == ready) */
    rt_inst *all[3] = {&g_r.reg.inst[0], &g_r.reg.pf[0], &g_r.reg.pf[1]};
    for (int i = 0; i < 3; i++)
        all[i]->alive = all[i]->ready = all[i]->ever_seen = true;
    return 0;
}

static void pair_teardown(void)
{
    rt_reg_fini(&g_r.reg);
    rt_table_fini(&g_r.table);
    rt_metrics_fini(&g_r.metrics);
    td_cfg_free(g_r.cfg);
}

/* A request as the loop holds it after admission (plus a reference for the test). */
static rt_req *pair_req(void)
{
    rt_req *q = rt_req_create();
    q->p.prompt = malloc(3 * sizeof *q->p.prompt);
    q->p.prompt[0] = 1, q->p.prompt[1] = 2, q->p.prompt[2] = 3;
    q->p.n_prompt = 3;
    q->p.max_tokens = 4;
    snprintf(q->oid, sizeof q->oid, "cmpl-unit");
    rt_req_retain(q);
    rt_table_add(&g_r.table, q);
    return q;
}

/* Take q off the router queue as dispatch does. */
static void pair_unqueue(rt_req *q)
{
    TH_CHECK(rt_fair_pop(&g_r.fair) == q);
    atomic_fetch_sub(&g_r.queued, 1);
    q->loop.state = RT_ST_INBOX;
}

/* What the loop does with a verdict of the pairing. */
static void act(rt_pair_out o, int64_t now)
{
    rt_loop_act(&g_r, &o, now);
}

static void reply(int pf, uint64_t call, Td__Envelope *env)
{
    td_ctrl_client_in in = {.kind = TD_CTRL_IN_REPLY, .call_id = call, .env = env};
    if (pf >= 0)
        act(rt_pair_on_reply(&g_r, pf, &in, 0), 0);
    else {
        rt_req *q = NULL;
        for (uint32_t k = 0; k < g_r.table.cap; k++)
            if (g_r.table.slots[k] && g_r.table.slots[k]->loop.call_id == call)
                q = g_r.table.slots[k];
        if (q) act(rt_pair_on_alloc(&g_r, q, 0, &in, 0), 0);
    }
}

static void ack(int pf, uint64_t call)
{
    Td__Ack a = TD__ACK__INIT;
    Td__Envelope env = TD__ENVELOPE__INIT;
    env.body_case = TD__ENVELOPE__BODY_ACK;
    env.ack = &a;
    reply(pf, call, &env);
}

static void alloc_reply(uint64_t call, uint64_t rid)
{
    char t[] = "target";
    ProtobufCBinaryData b = {.len = 6, .data = (uint8_t *)t};
    Td__AllocReply ar = TD__ALLOC_REPLY__INIT;
    ar.request_id = rid;
    ar.kv_targets = &b;
    ar.n_kv_targets = 1;
    Td__Envelope env = TD__ENVELOPE__INIT;
    env.body_case = TD__ENVELOPE__BODY_ALLOC_REPLY;
    env.alloc_reply = &ar;
    reply(-1, call, &env);
}

static void error_reply(int pf, uint64_t call, Td__ErrorCode code)
{
    Td__ErrorEvent e = TD__ERROR_EVENT__INIT;
    e.code = code;
    e.message = "unit";
    Td__Envelope env = TD__ENVELOPE__INIT;
    env.body_case = TD__ENVELOPE__BODY_ERROR;
    env.error = &e;
    reply(pf, call, &env);
}

static void pf_event(int pf, Td__Event *ev)
{
    act(rt_pair_on_event(&g_r, pf, ev), 0);
}

static void prefill_done(int pf, uint64_t rid)
{
    uint32_t chunks[1] = {3};
    Td__PrefillDone d = TD__PREFILL_DONE__INIT;
    d.request_id = rid;
    d.chunk_sizes = chunks;
    d.n_chunk_sizes = 1;
    Td__Event ev = TD__EVENT__INIT;
    ev.body_case = TD__EVENT__BODY_PREFILL_DONE;
    ev.prefill_done = &d;
    pf_event(pf, &ev);
}

static void prefill_error(int pf, uint64_t rid, Td__ErrorCode code)
{
    Td__ErrorEvent e = TD__ERROR_EVENT__INIT;
    e.request_id = rid;
    e.code = code;
    e.message = "stage died";
    Td__Event ev = TD__EVENT__INIT;
    ev.body_case = TD__EVENT__BODY_ERROR;
    ev.error = &e;
    pf_event(pf, &ev);
}

/* Dispatch's check when no prefill instance can take q: true when q was failed. */
static bool unservable(rt_req *q)
{
    rt_pair_out o = rt_pair_unservable(&g_r, q);
    act(o, 0);
    return o.verdict != RT_PAIR_OK;
}

/* Nothing is held on any instance. */
static bool all_released(void)
{
    const rt_registry *g = &g_r.reg;
    return g->inst[0].active == 0 && g->pf[0].active == 0 && g->pf[1].active == 0 &&
           g->pf[0].inflight_tokens == 0 && g->pf[1].inflight_tokens == 0;
}

static void test_pair(void)
{
    TH_REQUIRE(pair_setup() == 0);
    TH_CHECK(rt_pair_deadline(g_r.cfg, 100) == 100 + 2000 + 1000 + 2000);

    /* the normal path: Ack and AllocReply in either order, then PrefillDone */
    for (int order = 0; order < 2; order++) {
        rt_req *q = pair_req();
        TH_REQUIRE(rt_pair_start(&g_r, q, 0, 0, 0) == 0);
        TH_CHECK(q->loop.state == RT_ST_SUBMITTED && q->pair.pf_busy && q->pair.pinst == 0);
        TH_CHECK(g_r.reg.inst[0].active == 1 && g_r.reg.pf[0].active == 1 &&
                 g_r.reg.pf[0].inflight_tokens == 3);
        uint64_t pcall = q->pair.pf_call;
        if (order == 0) ack(0, pcall);
        alloc_reply(q->loop.call_id, q->loop.rid);
        TH_CHECK(q->loop.state == RT_ST_RUNNING && q->pair.kvt_sent == (order == 0));
        if (order == 1) ack(0, pcall);
        TH_CHECK(q->pair.kvt_sent && !q->pair.targets &&
                 q->pair.pf_call != 0); /* the KvTarget call */
        ack(0, q->pair.pf_call);
        prefill_done(0, q->loop.rid);
        TH_CHECK(!q->pair.pf_busy && g_r.reg.pf[0].active == 0 &&
                 g_r.reg.pf[0].inflight_tokens == 0);
        rt_loop_retire(&g_r, q); /* the request ends */
        TH_CHECK(all_released());
        rt_req_release(q);
    }
    TH_CHECK(g_r.metrics.pf_requests == 2 && g_r.metrics.chunk.n == 2);

    /* a stage of the prefill instance died (ERR_PEER_FAILED): not the request's fault, it
       moves (waiting router.migrate_wait_ms for an instance), its retry not spent */
    rt_req *q = pair_req();
    TH_REQUIRE(rt_pair_start(&g_r, q, 0, 0, 0) == 0);
    ack(0, q->pair.pf_call);
    alloc_reply(q->loop.call_id, q->loop.rid);
    prefill_error(0, q->loop.rid, TD__ERROR_CODE__ERR_PEER_FAILED);
    TH_CHECK(q->loop.state == RT_ST_QUEUED && rt_fair_peek(&g_r.fair) == q && !q->pair.pf_retried &&
             q->pair.pf_avoid == -1 && q->loop.migrations == 1 && all_released());
    TH_CHECK(g_r.metrics.pf_failures[RT_PF_ERROR] == 1 && g_r.metrics.pf_retries == 0);
    pair_unqueue(q);
    rt_loop_retire(&g_r, q);
    rt_req_release(q);

    /* its KvTarget refused as unknown (the chain broke and stage 0 failed the request: that
       ErrorEvent may come after the reply): the same move */
    q = pair_req();
    TH_REQUIRE(rt_pair_start(&g_r, q, 0, 0, 0) == 0);
    ack(0, q->pair.pf_call);
    alloc_reply(q->loop.call_id, q->loop.rid);
    TH_REQUIRE(q->pair.kvt_sent && q->pair.pf_call);
    error_reply(0, q->pair.pf_call, TD__ERROR_CODE__ERR_NOT_FOUND);
    TH_CHECK(q->loop.state == RT_ST_QUEUED && !q->pair.pf_retried && q->loop.migrations == 1 &&
             all_released());
    TH_CHECK(g_r.metrics.pf_failures[RT_PF_ERROR] == 2 && g_r.metrics.pf_retries == 0);
    pair_unqueue(q);
    rt_loop_retire(&g_r, q);
    rt_req_release(q);

    /* a prefill failure: retried once avoiding the instance, with a fresh id; the second
       failure ends the request */
    q = pair_req();
    TH_REQUIRE(rt_pair_start(&g_r, q, 0, 0, 0) == 0);
    uint64_t rid1 = q->loop.rid;
    ack(0, q->pair.pf_call);
    prefill_error(0, q->loop.rid, TD__ERROR_CODE__ERR_INTERNAL);
    TH_CHECK(q->loop.state == RT_ST_QUEUED && rt_fair_peek(&g_r.fair) == q && q->pair.pf_retried &&
             q->pair.pf_avoid == 0);
    TH_CHECK(!q->pair.pf_same_ok && all_released());
    pair_unqueue(q);
    TH_REQUIRE(rt_pair_start(&g_r, q, 0, 1, 0) == 0);
    TH_CHECK(q->loop.rid != rid1 && rt_table_get(&g_r.table, rid1) == NULL);
    alloc_reply(q->loop.call_id, q->loop.rid);
    error_reply(1, q->pair.pf_call, TD__ERROR_CODE__ERR_PEER_FAILED); /* Prefill refused */
    TH_CHECK(q->http.done && q->http.status == 503 && strstr(q->http.out.buf, "prefill_failed") &&
             strstr(q->http.out.buf, "failed twice"));
    TH_CHECK(all_released() && g_r.metrics.pf_retries == 1);
    rt_req_release(q);

    /* a timeout with no other instance alive: the same instance may retry */
    g_r.reg.pf[1].alive = g_r.reg.pf[1].ready = false;
    q = pair_req();
    TH_REQUIRE(rt_pair_start(&g_r, q, 0, 0, 0) == 0);
    ack(0, q->pair.pf_call);
    prefill_error(0, q->loop.rid, TD__ERROR_CODE__ERR_TIMEOUT);
    TH_CHECKF(q->loop.state == RT_ST_QUEUED && q->pair.pf_same_ok && !unservable(q),
              "state %d same %d", (int)q->loop.state, q->pair.pf_same_ok);
    /* ... but not after a non-timeout failure */
    q->pair.pf_same_ok = false;
    TH_CHECK(unservable(q) && q->http.done && q->http.status == 503);
    TH_CHECK(rt_fair_peek(&g_r.fair) == NULL && g_r.fair.len == 0 && all_released());
    rt_req_release(q);
    g_r.reg.pf[1].alive = g_r.reg.pf[1].ready = true;

    /* decode BUSY before the Prefill's Ack: re-queued; the Prefill is cancelled when its Ack
       comes (an orphan), never before */
    q = pair_req();
    TH_REQUIRE(rt_pair_start(&g_r, q, 0, 0, 0) == 0);
    uint64_t pcall = q->pair.pf_call;
    error_reply(-1, q->loop.call_id, TD__ERROR_CODE__ERR_BUSY);
    TH_CHECK(q->loop.state == RT_ST_QUEUED && q->pair.busy == 1 && q->loop.retries == 0 &&
             !q->pair.pf_retried);
    TH_CHECK(g_r.reg.pf[0].n_orphans == 1 && all_released());
    ack(0, pcall);
    TH_CHECK(g_r.reg.pf[0].n_orphans == 0);
    pair_unqueue(q);

    /* a decode transfer timeout before the first token: retried */
    TH_REQUIRE(rt_pair_start(&g_r, q, 0, 0, 0) == 0);
    ack(0, q->pair.pf_call);
    alloc_reply(q->loop.call_id, q->loop.rid);
    Td__ErrorEvent xe = TD__ERROR_EVENT__INIT;
    xe.request_id = q->loop.rid;
    xe.code = TD__ERROR_CODE__ERR_TIMEOUT;
    xe.message = "transfer failed";
    act(rt_pair_on_decode_error(&g_r, q, &xe), 0);
    TH_CHECK(q->loop.state == RT_ST_QUEUED && q->pair.pf_retried && all_released());
    TH_CHECK(g_r.metrics.pf_failures[RT_PF_TRANSFER] == 1);
    pair_unqueue(q);

    /* the deadline ends the attempt and the request */
    TH_REQUIRE(rt_pair_start(&g_r, q, 0, 1, 0) == 0);
    ack(1, q->pair.pf_call);
    act(rt_pair_expire(&g_r, q, q->pair.deadline_ms), q->pair.deadline_ms);
    TH_CHECK(!q->http.done);
    act(rt_pair_expire(&g_r, q, q->pair.deadline_ms + 1), q->pair.deadline_ms + 1);
    TH_CHECK(q->http.done && q->http.status == 503 &&
             strstr(q->http.out.buf, "first_token_timeout"));
    TH_CHECK(all_released() && g_r.table.count == 0);
    rt_req_release(q);

    /* a decode rank (or a prefill stage, as the decode side sees it) died mid-transfer: the
       request moves, its retry not spent */
    q = pair_req();
    TH_REQUIRE(rt_pair_start(&g_r, q, 0, 0, 0) == 0);
    ack(0, q->pair.pf_call);
    alloc_reply(q->loop.call_id, q->loop.rid);
    xe.request_id = q->loop.rid;
    xe.code = TD__ERROR_CODE__ERR_PEER_FAILED;
    act(rt_pair_on_decode_error(&g_r, q, &xe), 7);
    TH_CHECK(q->loop.state == RT_ST_QUEUED && !q->pair.pf_retried && q->pair.pf_avoid == -1 &&
             q->loop.migrations == 1 && q->loop.lost_ms == 7 && all_released());
    TH_CHECK(g_r.metrics.pf_failures[RT_PF_TRANSFER] == 2);
    pair_unqueue(q);
    rt_loop_retire(&g_r, q);
    rt_req_release(q);

    /* the prefill instance dies mid-prefill: the request moves (to any instance alive, or
       the first one back within router.migrate_wait_ms), its retry not spent; a Prefill not
       yet acknowledged went to the process that died: that is no move of the request's
       (max_migrations), and one acknowledged is */
    for (int acked = 0; acked < 2; acked++) {
        q = pair_req();
        TH_REQUIRE(rt_pair_start(&g_r, q, 0, 0, 0) == 0);
        if (acked) ack(0, q->pair.pf_call);
        g_r.reg.pf[0].alive = g_r.reg.pf[0].ready = false;
        act(rt_pair_prefill_lost(&g_r, q, 0, false), 5); /* as the loop does for each request */
        TH_CHECK(q->loop.state == RT_ST_QUEUED && q->pair.pf_avoid == -1 && !q->pair.pf_retried &&
                 q->loop.migrations == acked && q->loop.lost_ms == 5 && all_released());
        TH_CHECK(g_r.metrics.pf_failures[RT_PF_DEAD] == 1 + (uint64_t)acked);
        TH_CHECK(g_r.reg.pf[0].n_orphans == 1 - acked); /* a Prefill not answered yet */
        pair_unqueue(q);
        if (!acked) {
            rt_loop_retire(&g_r, q);
            rt_req_release(q);
            g_r.reg.pf[0].n_orphans = 0;
            g_r.reg.pf[0].alive = g_r.reg.pf[0].ready = true;
        }
    }
    rt_loop_retire(&g_r, q);
    rt_req_release(q);
    pair_teardown();
}

/* Migration (rt_loop_lose): a request whose decode side is lost after tokens reached the
 * client goes back to the queue with the prompt plus those tokens, and max_tokens less as
 * many; it may move router.max_migrations times; "migrate": false ends it instead. */
static void got_tokens(rt_req *q, int n) /* as on_token does, without a tokenizer */
{
    q->loop.gen_ids =
        realloc(q->loop.gen_ids, (size_t)(q->loop.n_gen + n) * sizeof *q->loop.gen_ids);
    q->loop.cap_gen = q->loop.n_gen + n;
    for (int k = 0; k < n; k++)
        q->loop.gen_ids[q->loop.n_gen + k] = 100 + q->loop.n_gen + k;
    q->loop.n_gen += n;
}

static void test_migrate(void)
{
    TH_REQUIRE(pair_setup() == 0);
    TH_CHECK(g_r.cfg->router.max_migrations == 3 && g_r.cfg->router.migrate_wait_ms == 15000);
    rt_req *q = pair_req();
    q->p.max_tokens = 10;
    TH_REQUIRE(rt_pair_start(&g_r, q, 0, 0, 0) == 0);
    ack(0, q->pair.pf_call);
    alloc_reply(q->loop.call_id, q->loop.rid);
    prefill_done(0, q->loop.rid);
    got_tokens(q, 2);
    uint64_t rid0 = q->loop.rid;

    /* a rank died: ERR_PEER_FAILED after the first token moves the request */
    Td__ErrorEvent xe = TD__ERROR_EVENT__INIT;
    xe.request_id = q->loop.rid;
    xe.code = TD__ERROR_CODE__ERR_PEER_FAILED;
    xe.message = "rank 1 died";
    act(rt_pair_on_decode_error(&g_r, q, &xe), 1000);
    TH_CHECK(q->loop.state == RT_ST_QUEUED && !q->http.done && q->loop.migrations == 1 &&
             q->loop.lost_ms == 1000);
    TH_CHECK(q->loop.gen_base == 2 && q->loop.inst == -1 && all_released());
    size_t n = 0;
    const int32_t *ids = rt_req_prompt(q, &n);
    TH_CHECK(n == 5 && ids[0] == 1 && ids[2] == 3 && ids[3] == 100 && ids[4] == 101);

    /* the next attempt: a fresh id, the resumed prompt's tokens on the prefill instance */
    pair_unqueue(q);
    TH_REQUIRE(rt_pair_start(&g_r, q, 0, 1, 1100) == 0);
    TH_CHECK(q->loop.rid != rid0 && g_r.reg.pf[1].inflight_tokens == 5);
    /* before its first token a rank's death is a move too (the wait from the first loss) */
    ack(1, q->pair.pf_call);
    alloc_reply(q->loop.call_id, q->loop.rid);
    xe.request_id = q->loop.rid;
    act(rt_pair_on_decode_error(&g_r, q, &xe), 1200);
    TH_CHECK(q->loop.state == RT_ST_QUEUED && q->loop.migrations == 2 && !q->pair.pf_retried &&
             q->loop.lost_ms == 1000 && all_released());
    pair_unqueue(q);

    /* the restarted prefill instance: its prompts start again (waiting allowed); this one's
       Prefill was not acknowledged: not counted as a move */
    TH_REQUIRE(rt_pair_start(&g_r, q, 0, 0, 1300) == 0);
    act(rt_pair_prefill_lost(&g_r, q, 0, true), 1300);
    TH_CHECK(q->loop.state == RT_ST_QUEUED && q->loop.migrations == 2 && !q->pair.pf_retried &&
             all_released());
    pair_unqueue(q);

    /* a decode instance that is stopping moves it too; then max_migrations (3) is reached */
    TH_REQUIRE(rt_pair_start(&g_r, q, 0, 0, 1400) == 0);
    ack(0, q->pair.pf_call);
    alloc_reply(q->loop.call_id, q->loop.rid);
    prefill_done(0, q->loop.rid);
    got_tokens(q, 3);
    xe.request_id = q->loop.rid;
    xe.code = TD__ERROR_CODE__ERR_SHUTDOWN;
    act(rt_pair_on_decode_error(&g_r, q, &xe), 1500);
    TH_CHECK(q->loop.state == RT_ST_QUEUED && q->loop.migrations == 3 && q->loop.gen_base == 5);
    TH_CHECK(rt_req_prompt(q, &n)[7] == 104 && n == 8);
    pair_unqueue(q);
    TH_REQUIRE(rt_pair_start(&g_r, q, 0, 0, 1600) == 0);
    ack(0, q->pair.pf_call);
    alloc_reply(q->loop.call_id, q->loop.rid);
    prefill_done(0, q->loop.rid);
    got_tokens(q, 1);
    xe.request_id = q->loop.rid;
    act(rt_pair_on_decode_error(&g_r, q, &xe), 1700);
    TH_CHECK(q->http.done && q->http.status == 503 && strstr(q->http.out.buf, "max_migrations"));
    TH_CHECK(all_released() && g_r.table.count == 0);
    rt_req_release(q);

    /* "migrate": false: ends with 503 instead; an internal error is never moved */
    for (int k = 0; k < 2; k++) {
        q = pair_req();
        q->p.no_migrate = k == 0;
        TH_REQUIRE(rt_pair_start(&g_r, q, 0, 0, 0) == 0);
        ack(0, q->pair.pf_call);
        alloc_reply(q->loop.call_id, q->loop.rid);
        prefill_done(0, q->loop.rid);
        got_tokens(q, 1);
        xe.request_id = q->loop.rid;
        xe.code = k == 0 ? TD__ERROR_CODE__ERR_PEER_FAILED : TD__ERROR_CODE__ERR_INTERNAL;
        act(rt_pair_on_decode_error(&g_r, q, &xe), 0);
        TH_CHECK(q->http.done && q->http.status == (k == 0 ? 503 : 500) && q->loop.migrations == 0);
        TH_CHECK(k || strstr(q->http.out.buf, "migrate"));
        TH_CHECK(all_released() && g_r.table.count == 0);
        rt_req_release(q);
    }
    pair_teardown();
}

static const char *g_model;

static void test_stream(void)
{
    if (!g_model) return;
    td_gguf *g = NULL;
    TH_REQUIRE(td_gguf_open(g_model, &g, NULL, 0) == 0);
    rt_router r = {0};
    TH_REQUIRE(td_tok_create(g, &r.model.tok) == 0);
    snprintf(r.model.name, sizeof r.model.name, "m");
    const char *text = "hello world, this is the end of it";
    int32_t *ids = NULL;
    size_t n = 0;
    TH_REQUIRE(td_tok_encode(r.model.tok, text, strlen(text), false, false, &ids, &n) == 0);
    for (int stream = 0; stream < 2; stream++) {
        rt_req *q = rt_req_create();
        q->p.stream = stream;
        q->p.stop[0] = strdup("the end");
        q->p.stop_len[0] = 7;
        q->p.n_stop = 1;
        int fin = 0;
        for (size_t i = 0; i < n && fin == 0; i++)
            fin = rt_stream_tokens(&r, q, &ids[i], 1);
        TH_CHECK(fin == RT_FIN_STOP);
        rt_stream_finish(&r, q, RT_FIN_STOP);
        TH_CHECK(q->http.done);
        if (!stream) {
            TH_CHECKF(q->loop.text.len == 21 &&
                          !memcmp(q->loop.text.buf, "hello world, this is ", 21),
                      "text '%s'", q->loop.text.buf);
            TH_CHECK(q->http.status == 200 &&
                     strstr(q->http.out.buf, "\"finish_reason\":\"stop\""));
        } else {
            TH_CHECK(q->http.sse && strstr(q->http.out.buf, "data: [DONE]\n\n"));
            TH_CHECK(!strstr(q->http.out.buf, "the end") && !strstr(q->http.out.buf, "the en"));
        }
        rt_req_release(q);
    }
    free(ids);

    /* the per-request "timeout" (seconds), within router.max_request_timeout_ms */
    td_cfg cfg = {0};
    cfg.router.max_prompt_tokens = 100;
    cfg.router.max_tokens = 10;
    cfg.router.max_request_timeout_ms = 5000;
    r.cfg = &cfg;
    r.model.limits = &cfg.router;
    r.model.n_ctx = 64;
    static const struct {
        const char *body;
        int status;
        int64_t ms;
    } cases[] = {
        {"{\"prompt\": [1, 2]}", 0, 0},
        {"{\"prompt\": [1, 2], \"timeout\": 2.5}", 0, 2500},
        {"{\"prompt\": [1, 2], \"timeout\": 5}", 0, 5000},
        {"{\"prompt\": [1, 2], \"timeout\": 0.001}", 0, 1},
        {"{\"prompt\": [1, 2], \"timeout\": null}", 0, 0},
        {"{\"prompt\": [1, 2], \"timeout\": 5.01}", 400, 0},
        {"{\"prompt\": [1, 2], \"timeout\": 0}", 400, 0},
        {"{\"prompt\": [1, 2], \"timeout\": -1}", 400, 0},
        {"{\"prompt\": [1, 2], \"timeout\": \"10\"}", 400, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        rt_params p;
        rt_error e = {0};
        int st = rt_openai_parse(&r.model, RT_EP_COMPLETIONS, cases[i].body, strlen(cases[i].body),
                                 &p, &e);
        TH_CHECKF(st == cases[i].status && (st || p.timeout_ms == cases[i].ms),
                  "%s: status %d (%s), timeout %lld", cases[i].body, st, e.message,
                  st ? 0LL : (long long)p.timeout_ms);
        if (st) TH_CHECK(e.param && !strcmp(e.param, "timeout"));
        rt_params_fini(&p);
    }
    /* the penalties reach td_sampling; fields Tandem does not implement are named in a 400
     * (chat bodies that parse need a chat template, which this model lacks: the end-to-end
     * tests cover them) */
    static const struct {
        const char *body;
        rt_endpoint ep;
        int status;
        const char *param;
        float pres, freq, rep;
    } pcases[] = {
        {"{\"prompt\": [1], \"presence_penalty\": 1.5, \"frequency_penalty\": -0.5}",
         RT_EP_COMPLETIONS, 0, NULL, 1.5f, -0.5f, 1.0f},
        {"{\"prompt\": [1], \"repetition_penalty\": 1.25}", RT_EP_COMPLETIONS, 0, NULL, 0, 0,
         1.25f},
        {"{\"prompt\": [1], \"frequency_penalty\": 2.5}", RT_EP_COMPLETIONS, 400,
         "frequency_penalty", 0, 0, 0},
        {"{\"prompt\": [1], \"presence_penalty\": \"1\"}", RT_EP_COMPLETIONS, 400,
         "presence_penalty", 0, 0, 0},
        {"{\"prompt\": [1], \"min_tokens\": 3, \"max_tokens\": 2}", RT_EP_COMPLETIONS, 400,
         "min_tokens", 0, 0, 0},
        {"{\"prompt\": [1], \"min_tokens\": 3}", RT_EP_COMPLETIONS, 0, NULL, 0, 0, 1.0f},
        {"{\"prompt\": [1], \"logit_bias\": {\"1\": 5}}", RT_EP_COMPLETIONS, 0, NULL, 0, 0, 1.0f},
        {"{\"prompt\": [1], \"logit_bias\": {\"01\": 5}}", RT_EP_COMPLETIONS, 400, "logit_bias", 0,
         0, 0},
        {"{\"prompt\": [1], \"logit_bias\": {\"1\": \"5\"}}", RT_EP_COMPLETIONS, 400, "logit_bias",
         0, 0, 0},
        {"{\"prompt\": [1], \"stop_token_ids\": [1.5]}", RT_EP_COMPLETIONS, 400, "stop_token_ids",
         0, 0, 0},
        {"{\"prompt\": [1], \"skip_special_tokens\": 1}", RT_EP_COMPLETIONS, 400,
         "skip_special_tokens", 0, 0, 0},
        {"{\"prompt\": [1], \"max_completion_tokens\": 3}", RT_EP_COMPLETIONS, 400,
         "max_completion_tokens", 0, 0, 0},
        {"{\"prompt\": [1], \"stream_options\": {\"x\": 1}}", RT_EP_COMPLETIONS, 400,
         "stream_options", 0, 0, 0},
        {"{\"prompt\": [\"a\", \"b\"]}", RT_EP_COMPLETIONS, 400, "prompt", 0, 0, 0},
        /* a cut inside a UTF-8 character drops it (the error JSON must stay valid) */
        {"{\"prompt\": [1], "
         "\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\\u00e9x\": 1}",
         RT_EP_COMPLETIONS, 400, "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
         0, 0, 0},
        {"{\"prompt\": [1], \"user\": \"u-1\"}", RT_EP_COMPLETIONS, 0, NULL, 0, 0, 1.0f},
        {"{\"prompt\": [1], \"user\": 5}", RT_EP_COMPLETIONS, 400, "user", 0, 0, 0},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tool_choice\": "
         "\"required\"}",
         RT_EP_CHAT, 400, "tool_choice", 0, 0, 0},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\", \"refusal\": \"no\"}]}",
         RT_EP_CHAT, 400, "messages", 0, 0, 0},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"echo\": false}", RT_EP_CHAT,
         400, "echo", 0, 0, 0},
        {"{\"prompt\": [1], \"a_field_name_longer_than_the_copy_kept_in_the_error_object_"
         "so_that_it_is_cut\": 1}",
         RT_EP_COMPLETIONS, 400, "a_field_name_longer_than_the_copy_kept_in_the_error_object_so_t",
         0, 0, 0},
    };
    for (size_t i = 0; i < sizeof pcases / sizeof pcases[0]; i++) {
        rt_params p;
        rt_error e = {0};
        int st =
            rt_openai_parse(&r.model, pcases[i].ep, pcases[i].body, strlen(pcases[i].body), &p, &e);
        TH_CHECKF(st == pcases[i].status, "%s: status %d (%s)", pcases[i].body, st, e.message);
        char *ej = st ? rt_error_json(&e) : NULL;
        TH_CHECKF(!st || ej, "%s: the error has a JSON body", pcases[i].body);
        free(ej);
        if (st)
            TH_CHECKF(e.param && !strcmp(e.param, pcases[i].param), "%s: param %s", pcases[i].body,
                      e.param ? e.param : "(none)");
        else
            TH_CHECKF(p.sampling.presence_penalty == pcases[i].pres &&
                          p.sampling.frequency_penalty == pcases[i].freq &&
                          p.sampling.repeat_penalty == pcases[i].rep,
                      "%s: %g %g %g", pcases[i].body, p.sampling.presence_penalty,
                      p.sampling.frequency_penalty, p.sampling.repeat_penalty);
        rt_params_fini(&p);
    }
    td_tok_destroy(r.model.tok);
    td_gguf_close(g);
}

int main(int argc, char **argv)
{
    g_model = argc > 1 ? argv[1] : NULL;
    TH_RUN(test_holdback);
    TH_RUN(test_table);
    TH_RUN(test_fair);
    TH_RUN(test_keys);
    TH_RUN(test_pick);
    TH_RUN(test_pair);
    TH_RUN(test_migrate);
    TH_RUN(test_stream);
    TH_RUN(test_inst_counters);
    TH_RUN(test_compute_series);
    TH_RUN(test_spec_counters);
    TH_EXIT();
}
