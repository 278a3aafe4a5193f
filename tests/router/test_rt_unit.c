/* test_rt_unit.c: router units without processes: stop-string hold-back (random texts
 * fed character by character: the emitted text is exactly the text before the first stop
 * string to complete), the request table, and rt_stream over a real tokenizer (argv[1]: a GGUF). */
#include <stdlib.h>
#include <string.h>

#include "rt.h"
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
        TH_CHECK(rt_table_get(&t, reqs[i].rid) == &reqs[i]);
    uint64_t old = reqs[5].rid;
    rt_table_remove(&t, &reqs[5]);
    TH_CHECK(rt_table_get(&t, old) == NULL);
    TH_CHECK(rt_table_add(&t, &reqs[5]) == 0);
    TH_CHECK(reqs[5].rid != old && rt_table_get(&t, old) == NULL);
    TH_CHECK(rt_table_get(&t, reqs[5].rid) == &reqs[5]);
    TH_CHECK(t.count == 600);
    rt_table_fini(&t);
}

static const char *g_model;

static void test_stream(void)
{
    if (!g_model) return;
    td_gguf *g = NULL;
    TH_REQUIRE(td_gguf_open(g_model, &g, NULL, 0) == 0);
    rt_router r = {0};
    TH_REQUIRE(td_tok_create(g, &r.tok) == 0);
    snprintf(r.model_name, sizeof r.model_name, "m");
    const char *text = "hello world, this is the end of it";
    int32_t *ids = NULL;
    size_t n = 0;
    TH_REQUIRE(td_tok_encode(r.tok, text, strlen(text), false, false, &ids, &n) == 0);
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
        TH_CHECK(q->done);
        if (!stream) {
            TH_CHECKF(q->text.len == 21 && !memcmp(q->text.buf, "hello world, this is ", 21),
                      "text '%s'", q->text.buf);
            TH_CHECK(q->status == 200 && strstr(q->out.buf, "\"finish_reason\":\"stop\""));
        } else {
            TH_CHECK(q->sse && strstr(q->out.buf, "data: [DONE]\n\n"));
            TH_CHECK(!strstr(q->out.buf, "the end") && !strstr(q->out.buf, "the en"));
        }
        rt_req_release(q);
    }
    free(ids);
    td_tok_destroy(r.tok);
    td_gguf_close(g);
}

int main(int argc, char **argv)
{
    g_model = argc > 1 ? argv[1] : NULL;
    TH_RUN(test_holdback);
    TH_RUN(test_table);
    TH_RUN(test_stream);
    TH_EXIT();
}
