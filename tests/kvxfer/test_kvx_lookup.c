/* test_kvx_lookup.c: the lookup buffer: keys, budget (refuse or wait), cancel, expiry,
 * ordering per request, many entries (table growth) and a waiting producer. */
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "kvx_lookup.h"
#include "kvx_pipe.h"
#include "td_clock.h"
#include "tharness.h"

static int g_freed;
static void count_free(void *arg, const kvx_lb_key *k, void *val, size_t bytes)
{
    g_freed++;
    free(val);
}

static kvx_lb_key key(uint64_t req, uint32_t chunk)
{
    return (kvx_lb_key){.req_id = req, .chunk = chunk, .layer0 = 0, .layer1 = 15};
}

static void test_basic(void)
{
    kvx_lookup *lb;
    TH_REQUIRE(kvx_lookup_create(1000, &lb) == 0);
    kvx_lb_key k1 = key(1, 0), k2 = key(1, 1), k3 = key(2, 0);
    TH_CHECK(kvx_lookup_insert(lb, &k1, malloc(1), 300, 0) == 0);
    TH_CHECK(kvx_lookup_insert(lb, &k2, malloc(1), 300, 0) == 0);
    void *dup = malloc(1);
    TH_CHECK(kvx_lookup_insert(lb, &k1, dup, 10, 0) == TD_ESTATE);
    free(dup);
    void *v3 = malloc(1);
    TH_CHECK(kvx_lookup_insert(lb, &k3, v3, 500, 0) == TD_ENOSPC);    /* full: caller keeps v3 */
    TH_CHECK(kvx_lookup_insert(lb, &k3, v3, 2000, 100) == TD_ENOSPC); /* can never fit */
    kvx_lb_key other = k1;
    other.layer1 = 30; /* another layer range is another key */
    void *v;
    size_t bytes;
    TH_CHECK(kvx_lookup_drop_select(lb, &other, &v, &bytes) == TD_ENOENT);
    TH_CHECK(kvx_lookup_drop_select(lb, &k1, &v, &bytes) == 0 && bytes == 300);
    free(v);
    TH_CHECK(kvx_lookup_drop_select(lb, &k1, &v, &bytes) == TD_ENOENT);
    TH_CHECK(kvx_lookup_insert(lb, &k3, v3, 500, 0) == 0);
    kvx_lookup_stats st;
    kvx_lookup_stats_get(lb, &st);
    TH_CHECK(st.bytes == 800 && st.entries == 2 && st.requests == 2);
    g_freed = 0;
    TH_CHECK(kvx_lookup_drop_request(lb, 1, count_free, NULL) == 1);
    TH_CHECK(kvx_lookup_drop_request(lb, 1, count_free, NULL) == 0);
    kvx_lookup_destroy(lb, count_free, NULL);
    TH_CHECK(g_freed == 2);
}

static void test_order_and_many(void)
{
    kvx_lookup *lb;
    TH_REQUIRE(kvx_lookup_create(0, &lb) == 0);
    /* 3000 entries over 100 requests, chunks inserted out of order */
    for (uint32_t c = 0; c < 30; c++)
        for (uint64_t r = 0; r < 100; r++) {
            kvx_lb_key k = key(r, (c * 7) % 30);
            uint32_t *v = malloc(sizeof(*v));
            *v = (c * 7) % 30;
            TH_CHECK(kvx_lookup_insert(lb, &k, v, 10, 0) == 0);
        }
    kvx_lookup_stats st;
    kvx_lookup_stats_get(lb, &st);
    TH_CHECK(st.entries == 3000 && st.requests == 100);
    /* drop_first drains a request in insertion order */
    for (uint32_t c = 0; c < 30; c++) {
        kvx_lb_key k;
        void *v;
        TH_REQUIRE(kvx_lookup_drop_first(lb, 42, &k, &v, NULL) == 0);
        TH_CHECK(k.chunk == (c * 7) % 30 && *(uint32_t *)v == k.chunk);
        free(v);
    }
    TH_CHECK(kvx_lookup_drop_first(lb, 42, NULL, &(void *){0}, NULL) == TD_ENOENT);
    /* every other key is still found */
    for (uint64_t r = 0; r < 100; r += 9) {
        if (r == 42) continue;
        kvx_lb_key k = key(r, 13);
        void *v;
        TH_CHECK(kvx_lookup_drop_select(lb, &k, &v, NULL) == 0);
        free(v);
    }
    g_freed = 0;
    kvx_lookup_destroy(lb, count_free, NULL);
    TH_CHECK(g_freed == 3000 - 30 - 12);
}

static void test_expire(void)
{
    kvx_lookup *lb;
    TH_REQUIRE(kvx_lookup_create(0, &lb) == 0);
    kvx_lb_key a = key(1, 0), b = key(2, 0);
    TH_CHECK(kvx_lookup_insert(lb, &a, malloc(1), 1, 0) == 0);
    usleep(60 * 1000);
    TH_CHECK(kvx_lookup_insert(lb, &b, malloc(1), 1, 0) == 0);
    g_freed = 0;
    TH_CHECK(kvx_lookup_expire(lb, td_now_ms(), 30, count_free, NULL) == 1);
    TH_CHECK(g_freed == 1);
    void *v;
    TH_CHECK(kvx_lookup_drop_select(lb, &a, &v, NULL) == TD_ENOENT);
    TH_CHECK(kvx_lookup_drop_select(lb, &b, &v, NULL) == 0);
    free(v);
    kvx_lookup_destroy(lb, count_free, NULL);
}

typedef struct {
    kvx_lookup *lb;
    int rc;
    int64_t waited_ms;
} waiter;

static void *producer(void *arg)
{
    waiter *w = arg;
    kvx_lb_key k = key(9, 1);
    int64_t t0 = td_now_ms();
    void *v = malloc(1);
    w->rc = kvx_lookup_insert(w->lb, &k, v, 600, 3000);
    if (w->rc) free(v);
    w->waited_ms = td_now_ms() - t0;
    return NULL;
}

/* A full buffer: the producer waits on the condition until the consumer frees space; and
 * times out when nobody does. */
static void test_wait(void)
{
    kvx_lookup *lb;
    TH_REQUIRE(kvx_lookup_create(1000, &lb) == 0);
    kvx_lb_key k = key(9, 0);
    TH_REQUIRE(kvx_lookup_insert(lb, &k, malloc(1), 600, 0) == 0);
    waiter w = {.lb = lb};
    pthread_t th;
    pthread_create(&th, NULL, producer, &w);
    usleep(100 * 1000);
    void *v;
    TH_CHECK(kvx_lookup_drop_select(lb, &k, &v, NULL) == 0);
    free(v);
    pthread_join(th, NULL);
    TH_CHECK(w.rc == 0 && w.waited_ms >= 50 && w.waited_ms < 2500);

    kvx_lb_key k2 = key(9, 2);
    int64_t t0 = td_now_ms();
    void *v2 = malloc(1);
    TH_CHECK(kvx_lookup_insert(lb, &k2, v2, 600, 200) == TD_ETIMEDOUT);
    free(v2);
    int64_t dt = td_now_ms() - t0;
    TH_CHECK(dt >= 190 && dt < 1500);
    kvx_lookup_destroy(lb, count_free, NULL);
}

int main(void)
{
    TH_RUN(test_basic);
    TH_RUN(test_order_and_many);
    TH_RUN(test_expire);
    TH_RUN(test_wait);
    TH_EXIT();
}
