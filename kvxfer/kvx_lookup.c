/* kvx_lookup.c: the lookup buffer: two chained hash tables (by key, by request) over
 * entries that also sit in one insertion-ordered list (for expiry). */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>

#include "kvx_lookup.h"
#include "kvx_pipe.h"
#include "td_clock.h"

typedef struct lb_entry lb_entry;
typedef struct lb_group lb_group;

struct lb_entry {
    kvx_lb_key key;
    void *val;
    size_t bytes;
    int64_t t_ms;            /* insertion time */
    lb_entry *hnext;         /* key hash chain */
    lb_entry *gprev, *gnext; /* the request's entries, oldest first */
    lb_entry *aprev, *anext; /* every entry, oldest first */
    lb_group *group;
};

struct lb_group {
    uint64_t req_id;
    lb_entry *head, *tail;
    lb_group *hnext; /* request hash chain */
};

struct kvx_lookup {
    pthread_mutex_t mu;
    pthread_cond_t space; /* signalled when bytes are freed */
    size_t budget, bytes;
    int entries, requests;
    lb_entry **keys;   /* (n_buckets) */
    lb_group **groups; /* (n_buckets) */
    size_t n_buckets;  /* power of two */
    lb_entry *oldest, *newest;
};

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static size_t key_hash(const kvx_lookup *lb, const kvx_lb_key *k)
{
    uint64_t h =
        mix(k->req_id ^ mix(((uint64_t)k->chunk << 32) ^ k->layer0 ^ ((uint64_t)k->layer1 << 16)));
    return (size_t)h & (lb->n_buckets - 1);
}

static size_t req_hash(const kvx_lookup *lb, uint64_t req)
{
    return (size_t)mix(req) & (lb->n_buckets - 1);
}

static bool key_eq(const kvx_lb_key *a, const kvx_lb_key *b)
{
    return a->req_id == b->req_id && a->chunk == b->chunk && a->layer0 == b->layer0 &&
           a->layer1 == b->layer1;
}

static lb_entry **find_key(kvx_lookup *lb, const kvx_lb_key *k)
{
    lb_entry **pp = &lb->keys[key_hash(lb, k)];
    while (*pp && !key_eq(&(*pp)->key, k))
        pp = &(*pp)->hnext;
    return pp;
}

static lb_group **find_group(kvx_lookup *lb, uint64_t req)
{
    lb_group **pp = &lb->groups[req_hash(lb, req)];
    while (*pp && (*pp)->req_id != req)
        pp = &(*pp)->hnext;
    return pp;
}

/* Grow both tables when the load passes 1 (entries are re-chained, not copied). */
static void maybe_grow(kvx_lookup *lb)
{
    if ((size_t)lb->entries < lb->n_buckets) return;
    size_t nb = lb->n_buckets * 2;
    lb_entry **nk = calloc(nb, sizeof(*nk));
    lb_group **ng = calloc(nb, sizeof(*ng));
    if (!nk || !ng) { /* keep the old tables: slower, still correct */
        free(nk);
        free(ng);
        return;
    }
    size_t ob = lb->n_buckets;
    lb_entry **ok = lb->keys;
    lb_group **og = lb->groups;
    lb->keys = nk;
    lb->groups = ng;
    lb->n_buckets = nb;
    for (size_t i = 0; i < ob; i++) {
        for (lb_entry *e = ok[i], *nx; e; e = nx) {
            nx = e->hnext;
            size_t h = key_hash(lb, &e->key);
            e->hnext = nk[h];
            nk[h] = e;
        }
        for (lb_group *g = og[i], *nx; g; g = nx) {
            nx = g->hnext;
            size_t h = req_hash(lb, g->req_id);
            g->hnext = ng[h];
            ng[h] = g;
        }
    }
    free(ok);
    free(og);
}

/* Unlink an entry from every structure; returns it (caller frees the record). */
static void unlink_entry(kvx_lookup *lb, lb_entry *e)
{
    lb_entry **pp = find_key(lb, &e->key);
    *pp = e->hnext;
    lb_group *g = e->group;
    if (e->gprev)
        e->gprev->gnext = e->gnext;
    else
        g->head = e->gnext;
    if (e->gnext)
        e->gnext->gprev = e->gprev;
    else
        g->tail = e->gprev;
    if (!g->head) {
        lb_group **gp = find_group(lb, g->req_id);
        *gp = g->hnext;
        free(g);
        lb->requests--;
    }
    if (e->aprev)
        e->aprev->anext = e->anext;
    else
        lb->oldest = e->anext;
    if (e->anext)
        e->anext->aprev = e->aprev;
    else
        lb->newest = e->aprev;
    lb->bytes -= e->bytes;
    lb->entries--;
    pthread_cond_broadcast(&lb->space);
}

int kvx_lookup_create(size_t budget_bytes, kvx_lookup **out)
{
    kvx_lookup *lb = calloc(1, sizeof(*lb));
    if (!lb) return TD_ENOMEM;
    lb->budget = budget_bytes ? budget_bytes : (size_t)256 << 20;
    lb->n_buckets = 64;
    lb->keys = calloc(lb->n_buckets, sizeof(*lb->keys));
    lb->groups = calloc(lb->n_buckets, sizeof(*lb->groups));
    if (!lb->keys || !lb->groups) {
        free(lb->keys);
        free(lb->groups);
        free(lb);
        return TD_ENOMEM;
    }
    pthread_mutex_init(&lb->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&lb->space, &ca);
    pthread_condattr_destroy(&ca);
    *out = lb;
    return 0;
}

void kvx_lookup_destroy(kvx_lookup *lb, kvx_lb_free_fn free_fn, void *arg)
{
    if (!lb) return;
    while (lb->oldest) {
        lb_entry *e = lb->oldest;
        unlink_entry(lb, e);
        if (free_fn) free_fn(arg, &e->key, e->val, e->bytes);
        free(e);
    }
    pthread_cond_destroy(&lb->space);
    pthread_mutex_destroy(&lb->mu);
    free(lb->keys);
    free(lb->groups);
    free(lb);
}

int kvx_lookup_insert(kvx_lookup *lb, const kvx_lb_key *key, void *val, size_t bytes,
                      int timeout_ms)
{
    if (bytes > lb->budget) {
        TD_LOG_ERR("kvx lookup: req %llu chunk %u: %zu bytes exceed the whole budget %zu",
                   (unsigned long long)key->req_id, key->chunk, bytes, lb->budget);
        return TD_ENOSPC;
    }
    lb_entry *e = calloc(1, sizeof(*e));
    if (!e) return TD_ENOMEM;
    pthread_mutex_lock(&lb->mu);
    if (*find_key(lb, key)) {
        pthread_mutex_unlock(&lb->mu);
        free(e);
        TD_LOG_ERR("kvx lookup: req %llu chunk %u layers %u-%u: already stored",
                   (unsigned long long)key->req_id, key->chunk, key->layer0, key->layer1);
        return TD_ESTATE;
    }
    if (lb->bytes + bytes > lb->budget && timeout_ms > 0) {
        struct timespec ts = td_deadline_ts(timeout_ms);
        while (lb->bytes + bytes > lb->budget) {
            int r = pthread_cond_timedwait(&lb->space, &lb->mu, &ts);
            if (r == ETIMEDOUT) break;
        }
        if (lb->bytes + bytes > lb->budget) {
            pthread_mutex_unlock(&lb->mu);
            free(e);
            return TD_ETIMEDOUT;
        }
        if (*find_key(lb, key)) { /* another thread stored it while we waited */
            pthread_mutex_unlock(&lb->mu);
            free(e);
            return TD_ESTATE;
        }
    }
    if (lb->bytes + bytes > lb->budget) {
        pthread_mutex_unlock(&lb->mu);
        free(e);
        return TD_ENOSPC;
    }
    lb_group **gp = find_group(lb, key->req_id);
    lb_group *g = *gp;
    if (!g) {
        g = calloc(1, sizeof(*g));
        if (!g) {
            pthread_mutex_unlock(&lb->mu);
            free(e);
            return TD_ENOMEM;
        }
        g->req_id = key->req_id;
        *gp = g;
        lb->requests++;
    }
    e->key = *key;
    e->val = val;
    e->bytes = bytes;
    e->t_ms = td_now_ms();
    e->group = g;
    e->gprev = g->tail;
    if (g->tail)
        g->tail->gnext = e;
    else
        g->head = e;
    g->tail = e;
    e->aprev = lb->newest;
    if (lb->newest)
        lb->newest->anext = e;
    else
        lb->oldest = e;
    lb->newest = e;
    lb_entry **kp = find_key(lb, key);
    *kp = e;
    lb->bytes += bytes;
    lb->entries++;
    maybe_grow(lb);
    pthread_mutex_unlock(&lb->mu);
    return 0;
}

int kvx_lookup_drop_select(kvx_lookup *lb, const kvx_lb_key *key, void **val, size_t *bytes)
{
    pthread_mutex_lock(&lb->mu);
    lb_entry *e = *find_key(lb, key);
    if (e) unlink_entry(lb, e);
    pthread_mutex_unlock(&lb->mu);
    if (!e) return TD_ENOENT;
    *val = e->val;
    if (bytes) *bytes = e->bytes;
    free(e);
    return 0;
}

int kvx_lookup_drop_first(kvx_lookup *lb, uint64_t req_id, kvx_lb_key *key, void **val,
                          size_t *bytes)
{
    pthread_mutex_lock(&lb->mu);
    lb_group *g = *find_group(lb, req_id);
    lb_entry *e = g ? g->head : NULL;
    if (e) unlink_entry(lb, e);
    pthread_mutex_unlock(&lb->mu);
    if (!e) return TD_ENOENT;
    if (key) *key = e->key;
    *val = e->val;
    if (bytes) *bytes = e->bytes;
    free(e);
    return 0;
}

int kvx_lookup_drop_request(kvx_lookup *lb, uint64_t req_id, kvx_lb_free_fn free_fn, void *arg)
{
    int n = 0;
    pthread_mutex_lock(&lb->mu);
    lb_group *g;
    while ((g = *find_group(lb, req_id)) != NULL) {
        lb_entry *e = g->head;
        unlink_entry(lb, e); /* frees g with its last entry */
        if (free_fn) free_fn(arg, &e->key, e->val, e->bytes);
        free(e);
        n++;
    }
    pthread_mutex_unlock(&lb->mu);
    return n;
}

int kvx_lookup_expire(kvx_lookup *lb, int64_t now_ms, int64_t max_age_ms, kvx_lb_free_fn free_fn,
                      void *arg)
{
    int n = 0;
    pthread_mutex_lock(&lb->mu);
    while (lb->oldest && lb->oldest->t_ms < now_ms - max_age_ms) {
        lb_entry *e = lb->oldest;
        unlink_entry(lb, e);
        if (free_fn) free_fn(arg, &e->key, e->val, e->bytes);
        free(e);
        n++;
    }
    pthread_mutex_unlock(&lb->mu);
    return n;
}

void kvx_lookup_stats_get(kvx_lookup *lb, kvx_lookup_stats *out)
{
    pthread_mutex_lock(&lb->mu);
    out->bytes = lb->bytes;
    out->budget = lb->budget;
    out->entries = lb->entries;
    out->requests = lb->requests;
    pthread_mutex_unlock(&lb->mu);
}
