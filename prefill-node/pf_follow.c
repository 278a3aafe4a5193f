/* pf_follow.c: a prefill stage s > 0: join stage 0 (StageHello until the StageTable
 * comes), then compute what arrives on the chain; keep saying hello as a heartbeat, and
 * rejoin (new pipe, new address) whenever the chain breaks or stage 0 re-formed it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pf_int.h"
#include "td_clock.h"
#include "td_err.h"

#define HELLO_RETRY_MS   200
#define HEARTBEAT_MS     1000
#define HELLO_TIMEOUT_MS 2000

/* A follower's state, on top of its stage (st). Owned by the main thread, like the stage:
 * the follower's loop (pf_follower_run) is the only code that touches either. */
typedef struct {
    pf_stage *st;
    td_ctrl_client *cli; /* to stage 0's control socket */
    uint64_t hello_call; /* the StageHello in flight, 0 if none */
    int64_t hello_sent_ms;
    bool running; /* joined: the StageTable came and the chain is connected */
} pf_follower;

static int send_hello(pf_follower *fl)
{
    uint8_t addr[KVX_ADDR_MAX];
    size_t len;
    int rc = pf_chain_address(&fl->st->chain, addr, sizeof addr, &len);
    if (rc) return rc;
    Td__StageHello h = TD__STAGE_HELLO__INIT;
    h.instance = (char *)fl->st->p->instance;
    h.stage = (uint32_t)fl->st->stage;
    h.pp = (uint32_t)fl->st->pp;
    h.pipe_address = (ProtobufCBinaryData){len, addr};
    h.pid = (uint32_t)getpid();
    h.boot_id = fl->st->boot_id;
    h.epoch = fl->st->epoch;
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.body_case = TD__ENVELOPE__BODY_STAGE_HELLO;
    e.stage_hello = &h;
    rc = td_ctrl_client_call(fl->cli, &e, HELLO_TIMEOUT_MS, &fl->hello_call);
    fl->hello_sent_ms = td_now_ms();
    return rc;
}

/* Back to joining: abort this stage's requests, new pipe (the old address is dead). */
static int rejoin(pf_follower *fl, const char *why)
{
    TD_LOG_WARN("prefill %s stage %d: leaving the stage chain (%s); rejoining", fl->st->p->instance,
                fl->st->stage, why);
    pf_stage_leave_chain(fl->st, TD_EIO);
    fl->running = false;
    return pf_chain_open(&fl->st->chain);
}

static void on_reply(pf_follower *fl, const td_ctrl_client_in *in)
{
    if (in->call_id != fl->hello_call) return;
    fl->hello_call = 0;
    if (in->err) {
        if (fl->running)
            TD_LOG_DEBUG("prefill %s stage %d: hello: %s", fl->st->p->instance, fl->st->stage,
                         td_strerror(in->err));
        return; /* stage 0 is slow or away; its own checks decide */
    }
    const Td__Envelope *r = in->env;
    if (r->body_case == TD__ENVELOPE__BODY_STAGE_TABLE) {
        const Td__StageTable *t = r->stage_table;
        if (fl->running) {
            if (t->epoch != fl->st->epoch) rejoin(fl, "stage 0 re-formed the chain");
            return;
        }
        if (t->n_pipe_addresses != (size_t)fl->st->pp) {
            TD_LOG_ERR("prefill %s stage %d: stage table of %zu stages, expected %d",
                       fl->st->p->instance, fl->st->stage, t->n_pipe_addresses, fl->st->pp);
            return;
        }
        const uint8_t *addrs[PF_MAX_STAGES];
        size_t lens[PF_MAX_STAGES];
        for (int s = 0; s < fl->st->pp; s++) {
            addrs[s] = t->pipe_addresses[s].data;
            lens[s] = t->pipe_addresses[s].len;
        }
        if (pf_chain_start(&fl->st->chain, addrs, lens)) {
            rejoin(fl, "cannot connect");
            return;
        }
        fl->st->epoch = t->epoch;
        fl->running = true;
        TD_LOG_INFO("prefill %s stage %d: joined the stage chain (epoch %llx)", fl->st->p->instance,
                    fl->st->stage, (unsigned long long)fl->st->epoch);
        return;
    }
    if (r->body_case == TD__ENVELOPE__BODY_ERROR) {
        if (fl->running && r->error->code == TD__ERROR_CODE__ERR_BUSY) {
            rejoin(fl, r->error->message ? r->error->message : "stage 0 says busy");
            return;
        }
        if (!fl->running && r->error->code != TD__ERROR_CODE__ERR_BUSY)
            TD_LOG_ERR("prefill %s stage %d: stage 0 refused: %s", fl->st->p->instance,
                       fl->st->stage, r->error->message ? r->error->message : "");
    }
}

static int follow(pf_follower *fl)
{
    char url[256];
    int rc;
    if (fl->st->p->leader)
        snprintf(url, sizeof url, "%s", fl->st->p->leader);
    else if ((rc = td_cfg_ctrl_url(fl->st->cfg->hosts[0], fl->st->cfg->port, url, sizeof url)))
        return rc;
    td_ctrl_opts opts = {.security = &fl->st->p->cfg->security};
    if ((rc = td_ctrl_client_create(url, &opts, &fl->cli))) return rc;
    if ((rc = pf_chain_open(&fl->st->chain))) goto out;
    TD_LOG_INFO("prefill %s stage %d: joining stage 0 at %s", fl->st->p->instance, fl->st->stage,
                url);
    while (!*fl->st->p->stop) {
        int64_t now = td_now_ms();
        int period = fl->running ? HEARTBEAT_MS : HELLO_RETRY_MS;
        if (!fl->hello_call && now - fl->hello_sent_ms >= period) send_hello(fl);
        td_ctrl_client_in in = {0};
        while (td_ctrl_client_recv(fl->cli, &in, 0) == 0)
            if (in.kind == TD_CTRL_IN_REPLY) on_reply(fl, &in);
        td_ctrl_client_in_free(&in);
        int got = 0;
        if (fl->running) {
            got = pf_stage_recv(fl->st) > 0;
            if (!fl->st->chain.broken && pf_chain_neighbour_failed(&fl->st->chain))
                fl->st->chain.broken = true;
            if (fl->st->chain.broken && (rc = rejoin(fl, "a neighbour stage failed"))) break;
        }
        pf_stage_poll(fl->st);
        pf_chain_wait(&fl->st->chain, td_ctrl_client_fd(fl->cli), got ? 0 : fl->st->reqs ? 5 : 100);
    }
    /* SIGTERM: abort what is in flight; the connector tells the decode side */
    pf_stage_abort_all(fl->st, TD_ESTATE);
    int64_t start = td_now_ms();
    while (fl->st->reqs && td_now_ms() - start < 1000) {
        pf_stage_poll(fl->st);
        pf_chain_wait(&fl->st->chain, -1, 10);
    }
    rc = 0;
out:
    td_ctrl_client_destroy(fl->cli);
    fl->cli = NULL;
    return rc;
}

int pf_follower_run(pf_stage *st)
{
    pf_follower fl = {.st = st};
    return follow(&fl);
}
