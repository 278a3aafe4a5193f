/* kvx_pipe_fake.c: an in-process pipe for unit tests, with fault injection.
 *
 * Pipes on one fabric reach each other by index. A put copies at once into the target's
 * registered region (after a bounds check against the registration), so a flush only has
 * to report the outcome. Messages (active and tagged) are queued in the target's inbox and
 * delivered by the target's progress; completions of the sender's operations are queued
 * locally and delivered by its own progress. All fabric state is under the fabric mutex;
 * each pipe's local lists are touched only by its owner.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "kvx_pipe.h"
#include "kvx_wire.h"
#include "td_clock.h"

#define FAKE_MAX_PIPES 64

typedef struct fake_pipe fake_pipe;

typedef struct fake_mem {
    uint64_t id;
    int owner; /* pipe index */
    uint8_t *base;
    size_t len;
    struct fake_mem *next;
} fake_mem;

struct kvx_fake_fabric {
    pthread_mutex_t mu;
    uint64_t token; /* tells this fabric's addresses from another's */
    fake_pipe *pipes[FAKE_MAX_PIPES];
    bool dead[FAKE_MAX_PIPES];
    fake_mem *mems; /* every registration of every pipe */
    uint64_t next_mem;
    int n_created; /* slots are never reused, so a stale peer index never aliases */
};

/* A message in an inbox: active message (am_id >= 0) or tagged (am_id < 0). */
typedef struct fake_msg {
    int am_id;
    uint64_t tag;
    size_t len;
    struct fake_msg *next;
    uint8_t data[];
} fake_msg;

typedef struct fake_op {
    kvx_done_cb cb;
    void *arg;
    int status;
    size_t len;
    bool done;
    /* posted tag receive */
    bool is_recv;
    uint64_t tag;
    void *buf;
    size_t cap;
    struct fake_op *next;
} fake_op;

typedef struct {
    bool used;
    int target; /* pipe index */
    int status;
    bool err_pending;
    bool put_failed; /* an injected put error: next flush reports it */
} fake_peer;

struct kvx_mem {
    uint64_t id;
    void *base;
    size_t len;
};

struct kvx_rkey {
    kvx_peer peer;
    uint64_t id;
    int owner;
    struct kvx_rkey *next;
};

struct fake_pipe {
    kvx_pipe base;
    kvx_fake_fabric *fab;
    int index;
    int efd;
    kvx_pipe_params params;
    bool killed;
    fake_peer *peers;
    int n_peers;
    fake_op *ops; /* FIFO: completions in order */
    int n_ops;
    fake_msg *inbox, *inbox_tail; /* under fab->mu */
    struct kvx_rkey *rkeys;
    int n_rkeys, n_mems;
    int fail_puts_after;
    uint64_t n_puts;
    struct {
        kvx_am_cb cb;
        void *arg;
    } am[KVX_AM_IDS];
};

static void wake(fake_pipe *p)
{
    uint64_t one = 1;
    ssize_t r = write(p->efd, &one, sizeof(one));
    (void)r;
}

static fake_op *op_push(fake_pipe *p, kvx_done_cb cb, void *arg)
{
    fake_op *op = calloc(1, sizeof(*op));
    if (!op) return NULL;
    op->cb = cb;
    op->arg = arg;
    fake_op **tail = &p->ops;
    while (*tail)
        tail = &(*tail)->next;
    *tail = op;
    p->n_ops++;
    return op;
}

static fake_peer *peer_get(fake_pipe *p, kvx_peer id)
{
    if (id < 0 || id >= p->n_peers || !p->peers[id].used) return NULL;
    return &p->peers[id];
}

/* The target pipe of a live peer (fabric locked), or NULL and *err. */
static fake_pipe *target_locked(fake_pipe *p, kvx_peer id, int *err)
{
    fake_peer *pr = peer_get(p, id);
    if (!pr) {
        *err = TD_EINVAL;
        return NULL;
    }
    if (p->killed) {
        *err = TD_EIO;
        return NULL;
    }
    if (pr->status) {
        *err = pr->status;
        return NULL;
    }
    fake_pipe *t = p->fab->pipes[pr->target];
    if (!t || p->fab->dead[pr->target]) {
        *err = TD_EIO;
        return NULL;
    }
    return t;
}

static void fake_peer_fail(fake_pipe *p, fake_peer *pr, int status)
{
    if (pr->status) return;
    pr->status = status;
    pr->err_pending = true;
}

static int deliver_msg(fake_pipe *p, kvx_peer peer, int am_id, uint64_t tag, const void *buf,
                       size_t len)
{
    kvx_fake_fabric *f = p->fab;
    fake_msg *m = malloc(sizeof(*m) + len);
    if (!m) return TD_ENOMEM;
    m->am_id = am_id;
    m->tag = tag;
    m->len = len;
    m->next = NULL;
    if (len) memcpy(m->data, buf, len);
    int err = 0;
    pthread_mutex_lock(&f->mu);
    fake_pipe *t = target_locked(p, peer, &err);
    if (t) {
        if (t->inbox_tail)
            t->inbox_tail->next = m;
        else
            t->inbox = m;
        t->inbox_tail = m;
        wake(t);
    }
    pthread_mutex_unlock(&f->mu);
    if (!t) free(m);
    return t ? 0 : err;
}

static int fake_progress(kvx_pipe *base)
{
    fake_pipe *p = (fake_pipe *)base;
    kvx_fake_fabric *f = p->fab;
    int n = 0;
    if (p->killed) return 0;

    /* peers whose pipe died */
    pthread_mutex_lock(&f->mu);
    for (int i = 0; i < p->n_peers; i++) {
        fake_peer *pr = &p->peers[i];
        if (pr->used && !pr->status && (!f->pipes[pr->target] || f->dead[pr->target]))
            fake_peer_fail(p, pr, TD_EIO);
    }
    fake_msg *in = p->inbox;
    p->inbox = p->inbox_tail = NULL;
    pthread_mutex_unlock(&f->mu);

    /* messages: active messages go to their handler, tagged ones to a posted receive */
    fake_msg *keep = NULL, **keep_tail = &keep;
    while (in) {
        fake_msg *m = in;
        in = in->next;
        m->next = NULL;
        if (m->am_id >= 0) {
            if (p->am[m->am_id].cb) p->am[m->am_id].cb(p->am[m->am_id].arg, m->data, m->len);
            free(m);
            n++;
            continue;
        }
        fake_op *rv = NULL;
        for (fake_op *op = p->ops; op; op = op->next)
            if (op->is_recv && !op->done && op->tag == m->tag) {
                rv = op;
                break;
            }
        if (!rv) {
            *keep_tail = m;
            keep_tail = &m->next;
            continue;
        }
        rv->done = true;
        if (m->len > rv->cap) {
            rv->status = TD_ERANGE;
        } else {
            memcpy(rv->buf, m->data, m->len);
            rv->len = m->len;
        }
        free(m);
    }
    if (keep) { /* unmatched tagged messages go back to the front, in order */
        pthread_mutex_lock(&f->mu);
        *keep_tail = p->inbox;
        if (!p->inbox) p->inbox_tail = NULL;
        p->inbox = keep;
        if (!p->inbox_tail) {
            fake_msg *t = keep;
            while (t->next)
                t = t->next;
            p->inbox_tail = t;
        }
        pthread_mutex_unlock(&f->mu);
    }

    /* completions, in order */
    fake_op **pp = &p->ops;
    while (*pp) {
        fake_op *op = *pp;
        if (!op->done) {
            pp = &op->next;
            continue;
        }
        *pp = op->next;
        p->n_ops--;
        kvx_done_cb cb = op->cb;
        void *arg = op->arg;
        int st = op->status;
        size_t len = op->len;
        free(op);
        if (cb) cb(arg, st, len);
        n++;
        pp = &p->ops; /* the callback may have added operations */
    }

    for (int i = 0; i < p->n_peers; i++) {
        fake_peer *pr = &p->peers[i];
        if (pr->used && pr->err_pending) {
            pr->err_pending = false;
            if (p->params.peer_err_cb) p->params.peer_err_cb(p->params.peer_err_arg, i, pr->status);
            n++;
        }
    }
    return n;
}

static int fake_arm(kvx_pipe *base)
{
    fake_pipe *p = (fake_pipe *)base;
    kvx_fake_fabric *f = p->fab;
    if (p->killed) return 1;
    uint64_t v;
    if (read(p->efd, &v, sizeof(v)) > 0) return 0; /* woken or signalled since last time */
    for (fake_op *op = p->ops; op; op = op->next)
        if (op->done) return 0;
    int busy = 0;
    pthread_mutex_lock(&f->mu);
    for (fake_msg *m = p->inbox; m && !busy; m = m->next)
        if (m->am_id >= 0)
            busy = 1;
        else
            for (fake_op *op = p->ops; op; op = op->next)
                if (op->is_recv && op->tag == m->tag) busy = 1;
    for (int i = 0; i < p->n_peers && !busy; i++) {
        fake_peer *pr = &p->peers[i];
        if (pr->used &&
            (pr->err_pending || (!pr->status && (!f->pipes[pr->target] || f->dead[pr->target]))))
            busy = 1;
    }
    pthread_mutex_unlock(&f->mu);
    return !busy;
}

static int fake_event_fd(kvx_pipe *base)
{
    return ((fake_pipe *)base)->efd;
}

static void fake_signal(kvx_pipe *base)
{
    wake((fake_pipe *)base);
}

static int fake_address(kvx_pipe *base, void *buf, size_t cap, size_t *len)
{
    fake_pipe *p = (fake_pipe *)base;
    uint8_t pl[12];
    kvx_wr w;
    kvx_wr_init(&w, pl, sizeof(pl));
    kvx_wr_u64(&w, p->fab->token);
    kvx_wr_u32(&w, (uint32_t)p->index);
    if (!kvx_frame_write(buf, cap, KVX_MAGIC_ADDR, KVX_KIND_FAKE, pl, sizeof(pl), len))
        return TD_ERANGE;
    return 0;
}

static int fake_connect(kvx_pipe *base, const void *addr, size_t len, kvx_peer *out)
{
    fake_pipe *p = (fake_pipe *)base;
    const void *pl;
    size_t n;
    if (kvx_frame_read(addr, len, KVX_MAGIC_ADDR, KVX_KIND_FAKE, &pl, &n) || n != 12) {
        TD_LOG_ERR("kvx fake: malformed peer address (%zu bytes)", len);
        return TD_EFORMAT;
    }
    kvx_rd r;
    kvx_rd_init(&r, pl, n);
    uint64_t token = kvx_rd_u64(&r);
    uint32_t idx = kvx_rd_u32(&r);
    if (token != p->fab->token || idx >= FAKE_MAX_PIPES) {
        TD_LOG_ERR("kvx fake: address of another fabric");
        return TD_EINVAL;
    }
    if (p->killed) return TD_EIO;
    int id = -1;
    for (int i = 0; i < p->n_peers; i++)
        if (!p->peers[i].used) {
            id = i;
            break;
        }
    if (id < 0) {
        fake_peer *np = realloc(p->peers, (size_t)(p->n_peers + 1) * sizeof(*np));
        if (!np) return TD_ENOMEM;
        p->peers = np;
        id = p->n_peers++;
    }
    memset(&p->peers[id], 0, sizeof(fake_peer));
    p->peers[id].used = true;
    p->peers[id].target = (int)idx;
    *out = id;
    return 0;
}

static void fake_rkey_destroy(kvx_pipe *base, kvx_rkey *rk)
{
    fake_pipe *p = (fake_pipe *)base;
    for (kvx_rkey **pp = &p->rkeys; *pp; pp = &(*pp)->next)
        if (*pp == rk) {
            *pp = rk->next;
            p->n_rkeys--;
            free(rk);
            return;
        }
}

static void fake_disconnect(kvx_pipe *base, kvx_peer peer, bool force)
{
    fake_pipe *p = (fake_pipe *)base;
    fake_peer *pr = peer_get(p, peer);
    if (!pr) return;
    for (kvx_rkey *rk = p->rkeys, *nx; rk; rk = nx) {
        nx = rk->next;
        if (rk->peer == peer) fake_rkey_destroy(base, rk);
    }
    pr->used = false;
}

static int fake_peer_status(kvx_pipe *base, kvx_peer peer)
{
    fake_peer *pr = peer_get((fake_pipe *)base, peer);
    return pr ? pr->status : TD_EINVAL;
}

static int fake_mem_reg(kvx_pipe *base, void *addr, size_t len, kvx_mem **out)
{
    fake_pipe *p = (fake_pipe *)base;
    kvx_fake_fabric *f = p->fab;
    if (!addr || !len) return TD_EINVAL;
    kvx_mem *m = calloc(1, sizeof(*m));
    fake_mem *fm = calloc(1, sizeof(*fm));
    if (!m || !fm) {
        free(m);
        free(fm);
        return TD_ENOMEM;
    }
    pthread_mutex_lock(&f->mu);
    m->id = fm->id = ++f->next_mem;
    fm->owner = p->index;
    fm->base = addr;
    fm->len = len;
    fm->next = f->mems;
    f->mems = fm;
    pthread_mutex_unlock(&f->mu);
    m->base = addr;
    m->len = len;
    p->n_mems++;
    *out = m;
    return 0;
}

static void fake_mem_dereg(kvx_pipe *base, kvx_mem *m)
{
    fake_pipe *p = (fake_pipe *)base;
    kvx_fake_fabric *f = p->fab;
    pthread_mutex_lock(&f->mu);
    for (fake_mem **pp = &f->mems; *pp; pp = &(*pp)->next)
        if ((*pp)->id == m->id) {
            fake_mem *fm = *pp;
            *pp = fm->next;
            free(fm);
            break;
        }
    pthread_mutex_unlock(&f->mu);
    p->n_mems--;
    free(m);
}

static int fake_rkey_pack(kvx_pipe *base, kvx_mem *m, void *buf, size_t cap, size_t *len)
{
    fake_pipe *p = (fake_pipe *)base;
    uint8_t pl[12];
    kvx_wr w;
    kvx_wr_init(&w, pl, sizeof(pl));
    kvx_wr_u64(&w, m->id);
    kvx_wr_u32(&w, (uint32_t)p->index);
    if (!kvx_frame_write(buf, cap, KVX_MAGIC_RKEY, KVX_KIND_FAKE, pl, sizeof(pl), len))
        return TD_ERANGE;
    return 0;
}

static int fake_rkey_unpack(kvx_pipe *base, kvx_peer peer, const void *buf, size_t len,
                            kvx_rkey **out)
{
    fake_pipe *p = (fake_pipe *)base;
    fake_peer *pr = peer_get(p, peer);
    const void *pl;
    size_t n;
    if (!pr) return TD_EINVAL;
    if (kvx_frame_read(buf, len, KVX_MAGIC_RKEY, KVX_KIND_FAKE, &pl, &n) || n != 12) {
        TD_LOG_ERR("kvx fake: malformed rkey (%zu bytes)", len);
        return TD_EFORMAT;
    }
    kvx_rd r;
    kvx_rd_init(&r, pl, n);
    kvx_rkey *rk = calloc(1, sizeof(*rk));
    if (!rk) return TD_ENOMEM;
    rk->id = kvx_rd_u64(&r);
    rk->owner = (int)kvx_rd_u32(&r);
    rk->peer = peer;
    if (rk->owner != pr->target) {
        TD_LOG_ERR("kvx fake: rkey of pipe %d used with peer pipe %d", rk->owner, pr->target);
        free(rk);
        return TD_EINVAL;
    }
    rk->next = p->rkeys;
    p->rkeys = rk;
    p->n_rkeys++;
    *out = rk;
    return 0;
}

static int fake_put(kvx_pipe *base, kvx_peer peer, const void *src, size_t len, uint64_t raddr,
                    kvx_rkey *rk)
{
    fake_pipe *p = (fake_pipe *)base;
    kvx_fake_fabric *f = p->fab;
    int err = 0;
    if (!rk || rk->peer != peer) return TD_EINVAL;
    p->n_puts++;
    pthread_mutex_lock(&f->mu);
    fake_pipe *t = target_locked(p, peer, &err);
    if (t && p->fail_puts_after == 0) {
        peer_get(p, peer)->put_failed = true; /* reported by the next flush */
    } else if (t) {
        if (p->fail_puts_after > 0) p->fail_puts_after--;
        fake_mem *fm = f->mems;
        while (fm && fm->id != rk->id)
            fm = fm->next;
        uintptr_t a = (uintptr_t)raddr;
        if (!fm || fm->owner != t->index || a < (uintptr_t)fm->base || len > fm->len ||
            a - (uintptr_t)fm->base > fm->len - len) {
            TD_LOG_ERR("kvx fake: put of %zu bytes outside the remote registration", len);
            err = TD_ERANGE;
        } else if (len) {
            memcpy((void *)a, src, len);
        }
    }
    pthread_mutex_unlock(&f->mu);
    return err;
}

static int fake_flush(kvx_pipe *base, kvx_peer peer, kvx_done_cb cb, void *arg)
{
    fake_pipe *p = (fake_pipe *)base;
    int err = 0;
    pthread_mutex_lock(&p->fab->mu);
    fake_pipe *t = target_locked(p, peer, &err);
    pthread_mutex_unlock(&p->fab->mu);
    if (!t) return err;
    fake_op *op = op_push(p, cb, arg);
    if (!op) return TD_ENOMEM;
    op->done = true;
    fake_peer *pr = peer_get(p, peer);
    if (pr->put_failed) {
        op->status = TD_EIO;
        fake_peer_fail(p, pr, TD_EIO);
    }
    wake(p);
    return 0;
}

static int fake_set_am_handler(kvx_pipe *base, unsigned id, kvx_am_cb cb, void *arg)
{
    fake_pipe *p = (fake_pipe *)base;
    if (id >= KVX_AM_IDS) return TD_EINVAL;
    p->am[id].cb = cb;
    p->am[id].arg = arg;
    return 0;
}

static int fake_send_common(fake_pipe *p, kvx_peer peer, int am_id, uint64_t tag, const void *buf,
                            size_t len, kvx_done_cb cb, void *arg)
{
    fake_op *op = op_push(p, cb, arg);
    if (!op) return TD_ENOMEM;
    int err = deliver_msg(p, peer, am_id, tag, buf, len);
    if (err) { /* unlink the op we just pushed (it is the tail) */
        fake_op **pp = &p->ops;
        while (*pp != op)
            pp = &(*pp)->next;
        *pp = NULL;
        p->n_ops--;
        free(op);
        return err;
    }
    op->done = true;
    wake(p);
    return 0;
}

static int fake_am_send(kvx_pipe *base, kvx_peer peer, unsigned id, const void *buf, size_t len,
                        kvx_done_cb cb, void *arg)
{
    if (id >= KVX_AM_IDS || len > KVX_AM_MAX) return TD_EINVAL;
    return fake_send_common((fake_pipe *)base, peer, (int)id, 0, buf, len, cb, arg);
}

static int fake_tag_send(kvx_pipe *base, kvx_peer peer, uint64_t tag, const void *buf, size_t len,
                         kvx_done_cb cb, void *arg)
{
    return fake_send_common((fake_pipe *)base, peer, -1, tag, buf, len, cb, arg);
}

static int fake_tag_recv(kvx_pipe *base, uint64_t tag, void *buf, size_t cap, kvx_done_cb cb,
                         void *arg)
{
    fake_pipe *p = (fake_pipe *)base;
    if (p->killed) return TD_EIO;
    fake_op *op = op_push(p, cb, arg);
    if (!op) return TD_ENOMEM;
    op->is_recv = true;
    op->tag = tag;
    op->buf = buf;
    op->cap = cap;
    wake(p);
    return 0;
}

static void fake_stats(kvx_pipe *base, kvx_pipe_stats *out)
{
    fake_pipe *p = (fake_pipe *)base;
    memset(out, 0, sizeof(*out));
    for (int i = 0; i < p->n_peers; i++)
        out->peers += p->peers[i].used;
    out->mems = p->n_mems;
    out->rkeys = p->n_rkeys;
    out->pending_ops = p->n_ops;
}

static void fake_destroy(kvx_pipe *base)
{
    fake_pipe *p = (fake_pipe *)base;
    kvx_fake_fabric *f = p->fab;
    pthread_mutex_lock(&f->mu);
    f->pipes[p->index] = NULL;
    for (fake_mem **pp = &f->mems; *pp;) {
        if ((*pp)->owner == p->index) {
            fake_mem *fm = *pp;
            *pp = fm->next;
            free(fm);
        } else {
            pp = &(*pp)->next;
        }
    }
    fake_msg *in = p->inbox;
    for (int i = 0; i < FAKE_MAX_PIPES; i++)
        if (f->pipes[i]) wake(f->pipes[i]);
    pthread_mutex_unlock(&f->mu);
    while (in) {
        fake_msg *m = in;
        in = in->next;
        free(m);
    }
    /* pending operations complete with an error */
    while (p->ops) {
        fake_op *op = p->ops;
        p->ops = op->next;
        if (op->cb) op->cb(op->arg, op->done ? op->status : TD_EIO, op->done ? op->len : 0);
        free(op);
    }
    while (p->rkeys)
        fake_rkey_destroy(base, p->rkeys);
    close(p->efd);
    free(p->peers);
    free(p);
}

static const kvx_pipe_ops fake_ops = {
    .name = "fake",
    .destroy = fake_destroy,
    .address = fake_address,
    .connect = fake_connect,
    .disconnect = fake_disconnect,
    .peer_status = fake_peer_status,
    .mem_reg = fake_mem_reg,
    .mem_dereg = fake_mem_dereg,
    .rkey_pack = fake_rkey_pack,
    .rkey_unpack = fake_rkey_unpack,
    .rkey_destroy = fake_rkey_destroy,
    .put = fake_put,
    .flush = fake_flush,
    .set_am_handler = fake_set_am_handler,
    .am_send = fake_am_send,
    .tag_send = fake_tag_send,
    .tag_recv = fake_tag_recv,
    .progress = fake_progress,
    .arm = fake_arm,
    .event_fd = fake_event_fd,
    .signal = fake_signal,
    .stats = fake_stats,
};

int kvx_fake_fabric_create(kvx_fake_fabric **out)
{
    kvx_fake_fabric *f = calloc(1, sizeof(*f));
    if (!f) return TD_ENOMEM;
    pthread_mutex_init(&f->mu, NULL);
    f->token = (uint64_t)(uintptr_t)f ^ (uint64_t)td_now_ms() ^ 0x9e3779b97f4a7c15ull;
    *out = f;
    return 0;
}

void kvx_fake_fabric_destroy(kvx_fake_fabric *f)
{
    if (!f) return;
    while (f->mems) {
        fake_mem *m = f->mems;
        f->mems = m->next;
        free(m);
    }
    pthread_mutex_destroy(&f->mu);
    free(f);
}

int kvx_pipe_fake_create(kvx_fake_fabric *f, const kvx_pipe_params *params, kvx_pipe **out)
{
    fake_pipe *p = calloc(1, sizeof(*p));
    if (!p) return TD_ENOMEM;
    p->base.ops = &fake_ops;
    p->fab = f;
    p->fail_puts_after = -1;
    if (params) p->params = *params;
    p->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (p->efd < 0) {
        free(p);
        return TD_EIO;
    }
    pthread_mutex_lock(&f->mu);
    int idx = f->n_created < FAKE_MAX_PIPES ? f->n_created++ : -1;
    if (idx >= 0) f->pipes[idx] = p;
    pthread_mutex_unlock(&f->mu);
    if (idx < 0) {
        close(p->efd);
        free(p);
        return TD_ENOSPC;
    }
    p->index = idx;
    *out = &p->base;
    return 0;
}

void kvx_pipe_fake_kill(kvx_pipe *base)
{
    fake_pipe *p = (fake_pipe *)base;
    kvx_fake_fabric *f = p->fab;
    pthread_mutex_lock(&f->mu);
    p->killed = true;
    f->dead[p->index] = true;
    for (int i = 0; i < FAKE_MAX_PIPES; i++)
        if (f->pipes[i]) wake(f->pipes[i]);
    pthread_mutex_unlock(&f->mu);
}

void kvx_pipe_fake_fail_puts_after(kvx_pipe *base, int n)
{
    ((fake_pipe *)base)->fail_puts_after = n;
}

uint64_t kvx_pipe_fake_puts(kvx_pipe *base)
{
    return ((fake_pipe *)base)->n_puts;
}
