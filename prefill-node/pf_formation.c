/* pf_formation.c: stage 0's view of the stage chain's membership: the other stages' hellos
 * (a stage that restarted or cannot be reached breaks the formation), the table of members
 * they are answered with, the members that fall silent, and re-forming (every job in the
 * broken chain fails; see pf_leader_int.h). */
#include <stdio.h>
#include <string.h>

#include "pf_leader_int.h"
#include "td_clock.h"
#include "td_err.h"

#define MEMBER_SILENCE_MS 5000 /* a joined stage that stops saying hello is gone... */

void pfl_reset_formation(pf_leader *ld, const char *why)
{
    bool logged = ld->running || ld->n_jobs; /* not at start-up */
    int64_t t0 = td_now_ms();
    if (logged)
        TD_LOG_WARN(
            "prefill %s: stage chain broken (%s): failing %d requests in flight, waiting for "
            "the stages to rejoin",
            ld->st->p->instance, why, ld->n_jobs);
    pf_stage_leave_chain(ld->st, TD_EIO); /* first: no RELEASE goes down the old chain */
    /* the queued ones too: the router moves them (another instance at once, or this one
       re-formed, within router.migrate_wait_ms) rather than their waiting here for a chain
       that may never form again until the transfer deadline */
    for (pf_job *j = ld->jobs, *nx; j; j = nx) {
        nx = j->next;
        pfl_finish_job(ld, j, TD_EIO,
                       j->emitted
                           ? "a prefill stage failed or restarted"
                           : "a prefill stage failed or restarted before the prompt started");
    }
    if (logged)
        TD_LOG_INFO("prefill %s: the old stage chain closed in %lld ms", ld->st->p->instance,
                    (long long)(td_now_ms() - t0));
    uint64_t old = ld->members[0].boot_id;
    memset(ld->members, 0, sizeof ld->members);
    ld->running = false;
    if (pf_chain_open(&ld->st->chain)) {
        TD_LOG_ERR("prefill %s: cannot recreate the activation pipe", ld->st->p->instance);
        return;
    }
    ld->members[0].present = true;
    ld->members[0].boot_id = old;
    pf_chain_address(&ld->st->chain, ld->members[0].addr, sizeof ld->members[0].addr,
                     &ld->members[0].addr_len);
    static uint64_t formations;
    ld->st->epoch = (ld->st->boot_id << 16) ^ ++formations; /* never 0, differs per formation */
    if (ld->st->pp == 1) ld->running = true;
}

static int table_reply(pf_leader *ld, td_ctrl_req *req)
{
    ProtobufCBinaryData addrs[PF_MAX_STAGES];
    uint64_t boots[PF_MAX_STAGES];
    for (int s = 0; s < ld->st->pp; s++) {
        addrs[s] = (ProtobufCBinaryData){ld->members[s].addr_len, ld->members[s].addr};
        boots[s] = ld->members[s].boot_id;
    }
    Td__StageTable t = TD__STAGE_TABLE__INIT;
    t.n_pipe_addresses = t.n_boot_ids = (size_t)ld->st->pp;
    t.pipe_addresses = addrs;
    t.boot_ids = boots;
    t.epoch = ld->st->epoch;
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.body_case = TD__ENVELOPE__BODY_STAGE_TABLE;
    e.stage_table = &t;
    return td_ctrl_server_reply(ld->srv, req, &e);
}

void pfl_handle_hello(pf_leader *ld, const td_ctrl_server_in *in)
{
    const Td__StageHello *h = in->env->stage_hello;
    if (strcmp(h->instance ? h->instance : "", ld->st->p->instance) ||
        h->pp != (uint32_t)ld->st->pp || h->stage == 0) {
        td_ctrl_server_reply_error(ld->srv, in->req, 0, TD__ERROR_CODE__ERR_INVALID,
                                   "this is stage 0 of %s (pp %d), not of %s (pp %u) / stage %u",
                                   ld->st->p->instance, ld->st->pp, h->instance ? h->instance : "",
                                   h->pp, h->stage);
        return;
    }
    int s = (int)h->stage;
    bool same = ld->members[s].present && ld->members[s].boot_id == h->boot_id &&
                ld->members[s].addr_len == h->pipe_address.len &&
                !memcmp(ld->members[s].addr, h->pipe_address.data, h->pipe_address.len);
    if (h->epoch && h->epoch != ld->st->epoch) {
        /* it runs in an older formation: it must reset and join again */
        td_ctrl_server_reply_error(ld->srv, in->req, 0, TD__ERROR_CODE__ERR_BUSY,
                                   "rejoin: the stage chain was re-formed");
        return;
    }
    if (!same) {
        if (ld->running && ld->st->pp > 1) {
            TD_LOG_INFO("prefill %s: stage %d (re)joins", ld->st->p->instance, s);
            pfl_reset_formation(ld, "a stage restarted");
        }
        if (h->pipe_address.len > sizeof ld->members[s].addr) {
            td_ctrl_server_reply_error(ld->srv, in->req, 0, TD__ERROR_CODE__ERR_TOO_LARGE,
                                       "pipe address of %zu bytes", h->pipe_address.len);
            return;
        }
        ld->members[s].present = true;
        ld->members[s].boot_id = h->boot_id;
        memcpy(ld->members[s].addr, h->pipe_address.data, h->pipe_address.len);
        ld->members[s].addr_len = h->pipe_address.len;
    }
    ld->members[s].seen_ms = td_now_ms();
    if (!ld->running) {
        char missing[256] = "";
        int off = 0;
        for (int k = 1; k < ld->st->pp; k++)
            if (!ld->members[k].present && off < (int)sizeof missing - 8)
                off += snprintf(missing + off, sizeof missing - (size_t)off, " %d", k);
        if (off) {
            td_ctrl_server_reply_error(ld->srv, in->req, 0, TD__ERROR_CODE__ERR_BUSY,
                                       "waiting for stages%s", missing);
            return;
        }
        const uint8_t *addrs[PF_MAX_STAGES];
        size_t lens[PF_MAX_STAGES];
        for (int k = 0; k < ld->st->pp; k++) {
            addrs[k] = ld->members[k].addr;
            lens[k] = ld->members[k].addr_len;
            ld->members[k].seen_ms = td_now_ms();
        }
        if (pf_chain_start(&ld->st->chain, addrs, lens)) {
            td_ctrl_server_reply_error(ld->srv, in->req, 0, TD__ERROR_CODE__ERR_BUSY,
                                       "cannot connect the stages");
            pfl_reset_formation(ld, "connect failed");
            return;
        }
        ld->running = true;
        TD_LOG_INFO("prefill %s: all %d stages joined: ready", ld->st->p->instance, ld->st->pp);
    }
    table_reply(ld, in->req);
}

void pfl_check_members(pf_leader *ld)
{
    if (!ld->running || ld->st->pp == 1) return;
    int64_t now = td_now_ms();
    /* ...unless chunks take long: a stage says hello between chunks, so one that computes a
     * long chunk (an 8K-token prefix on a slow or busy CPU) is silent for that long. Stage
     * 0's own recent chunk times stand in for the others' (similar layer counts). */
    int64_t silence = MEMBER_SILENCE_MS;
    if (3 * ld->st->slow_chunk_ms + 2000 > silence)
        silence = (int64_t)(3 * ld->st->slow_chunk_ms) + 2000;
    for (int s = 1; s < ld->st->pp; s++) {
        char why[96];
        if (pf_chain_stage_failed(&ld->st->chain, s)) {
            snprintf(why, sizeof why, "stage %d is unreachable", s);
            pfl_reset_formation(ld, why);
            return;
        }
        if (now - ld->members[s].seen_ms > silence) {
            snprintf(why, sizeof why, "stage %d silent for %lld ms", s, (long long)silence);
            pfl_reset_formation(ld, why);
            return;
        }
    }
    if (ld->st->chain.broken) pfl_reset_formation(ld, "activation send failed");
}
