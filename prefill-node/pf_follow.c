/* pf_follow.c: a prefill stage s > 0: join stage 0 (StageHello until the StageTable
 * comes), then compute what arrives on the chain; keep saying hello as a heartbeat, and
 * rejoin (new pipe, new address) whenever the chain breaks or stage 0 re-formed it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pf_int.h"
#include "td_err.h"

#define HELLO_RETRY_MS   200
#define HEARTBEAT_MS     1000
#define HELLO_TIMEOUT_MS 2000

static int send_hello(pf_node *n)
{
    uint8_t addr[KVX_ADDR_MAX];
    size_t len;
    int rc = pf_link_address(n->link, addr, sizeof addr, &len);
    if (rc) return rc;
    Td__StageHello h = TD__STAGE_HELLO__INIT;
    h.instance = (char *)n->p->instance;
    h.stage = (uint32_t)n->stage;
    h.pp = (uint32_t)n->pp;
    h.pipe_address = (ProtobufCBinaryData){len, addr};
    h.pid = (uint32_t)getpid();
    h.boot_id = n->boot_id;
    h.epoch = n->epoch;
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.body_case = TD__ENVELOPE__BODY_STAGE_HELLO;
    e.stage_hello = &h;
    rc = td_ctrl_client_call(n->cli, &e, HELLO_TIMEOUT_MS, &n->hello_call);
    n->hello_sent_ms = pf_now_ms();
    return rc;
}

/* Back to joining: abort this stage's requests, new pipe (the old address is dead). */
static int rejoin(pf_node *n, const char *why)
{
    TD_LOG_WARN("prefill %s stage %d: leaving the stage chain (%s); rejoining", n->p->instance,
                n->stage, why);
    pf_stage_abort_all(n, TD_EIO);
    pf_chain_close(n);
    n->running = false;
    return pf_chain_open(n);
}

static void on_reply(pf_node *n, const td_ctrl_client_in *in)
{
    if (in->call_id != n->hello_call) return;
    n->hello_call = 0;
    if (in->err) {
        if (n->running)
            TD_LOG_DEBUG("prefill %s stage %d: hello: %s", n->p->instance, n->stage,
                         td_strerror(in->err));
        return; /* stage 0 is slow or away; its own checks decide */
    }
    const Td__Envelope *r = in->env;
    if (r->body_case == TD__ENVELOPE__BODY_STAGE_TABLE) {
        const Td__StageTable *t = r->stage_table;
        if (n->running) {
            if (t->epoch != n->epoch) rejoin(n, "stage 0 re-formed the chain");
            return;
        }
        if (t->n_pipe_addresses != (size_t)n->pp) {
            TD_LOG_ERR("prefill %s stage %d: stage table of %zu stages, expected %d",
                       n->p->instance, n->stage, t->n_pipe_addresses, n->pp);
            return;
        }
        const uint8_t *addrs[PF_MAX_STAGES];
        size_t lens[PF_MAX_STAGES];
        for (int s = 0; s < n->pp; s++) {
            addrs[s] = t->pipe_addresses[s].data;
            lens[s] = t->pipe_addresses[s].len;
        }
        if (pf_chain_start(n, addrs, lens)) {
            rejoin(n, "cannot connect");
            return;
        }
        n->epoch = t->epoch;
        n->running = true;
        TD_LOG_INFO("prefill %s stage %d: joined the stage chain (epoch %llx)", n->p->instance,
                    n->stage, (unsigned long long)n->epoch);
        return;
    }
    if (r->body_case == TD__ENVELOPE__BODY_ERROR) {
        if (n->running && r->error->code == TD__ERROR_CODE__ERR_BUSY) {
            rejoin(n, r->error->message ? r->error->message : "stage 0 says busy");
            return;
        }
        if (!n->running && r->error->code != TD__ERROR_CODE__ERR_BUSY)
            TD_LOG_ERR("prefill %s stage %d: stage 0 refused: %s", n->p->instance, n->stage,
                       r->error->message ? r->error->message : "");
    }
}

int pf_follower_run(pf_node *n)
{
    char url[256];
    int rc;
    if (n->p->leader)
        snprintf(url, sizeof url, "%s", n->p->leader);
    else if ((rc = td_cfg_ctrl_url(n->cfg->hosts[0], n->cfg->port, url, sizeof url)))
        return rc;
    td_ctrl_opts opts = {0};
    if ((rc = td_ctrl_client_create(url, &opts, &n->cli))) return rc;
    if ((rc = pf_chain_open(n))) goto out;
    TD_LOG_INFO("prefill %s stage %d: joining stage 0 at %s", n->p->instance, n->stage, url);
    while (!*n->p->stop) {
        int64_t now = pf_now_ms();
        int period = n->running ? HEARTBEAT_MS : HELLO_RETRY_MS;
        if (!n->hello_call && now - n->hello_sent_ms >= period) send_hello(n);
        td_ctrl_client_in in = {0};
        while (td_ctrl_client_recv(n->cli, &in, 0) == 0)
            if (in.kind == TD_CTRL_IN_REPLY) on_reply(n, &in);
        td_ctrl_client_in_free(&in);
        int got = 0;
        if (n->running) {
            got = pf_stage_recv(n) > 0;
            if (!n->broken && (pf_link_peer_failed(n->link, n->lead_peer) ||
                               (n->next_peer >= 0 && pf_link_peer_failed(n->link, n->next_peer))))
                n->broken = true;
            if (n->broken && (rc = rejoin(n, "a neighbour stage failed"))) break;
        }
        pf_stage_poll(n);
        pf_wait(n, td_ctrl_client_fd(n->cli), got ? 0 : n->reqs ? 5 : 100);
    }
    /* SIGTERM: abort what is in flight; the connector tells the decode side */
    pf_stage_abort_all(n, TD_ESTATE);
    int64_t start = pf_now_ms();
    while (n->reqs && pf_now_ms() - start < 1000) {
        pf_stage_poll(n);
        pf_wait(n, -1, 10);
    }
    rc = 0;
out:
    td_ctrl_client_destroy(n->cli);
    n->cli = NULL;
    return rc;
}
