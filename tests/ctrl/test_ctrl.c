/* test_ctrl.c: the control plane (common/ctrl.h): codec round trips and rejections, and a
 * fake node serving real clients over ipc:// and tcp:// on loopback.
 *
 * The fake node runs in its own thread as the owner of a td_ctrl_server: it acks Submit,
 * then produces one token per request every step (token = first prompt token + index),
 * finishing with LENGTH at max_tokens; Cancel ends a request with CANCELLED. Request id
 * 999 is held without a reply for 400 ms (deadline test); request id 777 makes the node
 * queue all its tokens at once, one event per token (burst test). The reconnect test runs
 * it in a child process instead (test_ctrl --node URL), restarted as a decode node is.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ctrl.h"
#include "ctrl_internal.h"
#include "td_clock.h"
#include "td_err.h"
#include "tharness.h"

/* ---- codec --------------------------------------------------------------------------- */

static const char *seed_dir; /* --seeds DIR: write every encoded envelope there */

static Td__Envelope *roundtrip(const Td__Envelope *e)
{
    uint8_t *buf;
    size_t len;
    if (td_ctrl_encode(e, NULL, &buf, &len)) return NULL;
    if (seed_dir) {
        static int n_seed;
        char path[512];
        snprintf(path, sizeof path, "%s/seed-%02d-%s", seed_dir, n_seed++,
                 td_ctrl_body_name(e->body_case));
        FILE *f = fopen(path, "wb");
        if (f) {
            fwrite(buf, 1, len, f);
            fclose(f);
        }
    }
    Td__Envelope *out = NULL;
    char err[256];
    int rc = td_ctrl_decode(buf, len, NULL, &out, err, sizeof err);
    if (rc) fprintf(stderr, "decode: %s\n", err);
    free(buf);
    return out;
}

static void test_roundtrip_requests(void)
{
    int32_t prompt[] = {1, 2, 3, 50000, 0};
    int32_t stops[] = {7, 9};
    Td__Sampling sp = TD__SAMPLING__INIT;
    sp.temperature = 0.7f;
    sp.top_k = 40;
    sp.top_p = 0.9f;
    sp.min_p = 0.05f;
    sp.repeat_penalty = 1.1f;
    sp.repeat_last_n = 32;
    sp.seed = 0xfeedfacecafebeefull;
    Td__Submit sub = TD__SUBMIT__INIT;
    sub.request_id = 42;
    sub.n_token_ids = 5;
    sub.token_ids = prompt;
    sub.sampling = &sp;
    sub.max_tokens = 128;
    sub.n_stop_token_ids = 2;
    sub.stop_token_ids = stops;
    sub.ignore_eos = 1;
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.client_id = 0x1234;
    e.call_id = 77;
    e.timeout_ms = 5000;
    e.body_case = TD__ENVELOPE__BODY_SUBMIT;
    e.submit = &sub;
    Td__Envelope *d = roundtrip(&e);
    TH_REQUIRE(d);
    TH_CHECK(d->version == TD_CTRL_VERSION && d->client_id == 0x1234 && d->call_id == 77 &&
             d->timeout_ms == 5000);
    TH_REQUIRE(d->body_case == TD__ENVELOPE__BODY_SUBMIT);
    const Td__Submit *s = d->submit;
    TH_CHECK(s->request_id == 42 && s->max_tokens == 128 && s->ignore_eos);
    TH_CHECK(s->n_token_ids == 5 && !memcmp(s->token_ids, prompt, sizeof prompt));
    TH_CHECK(s->n_stop_token_ids == 2 && s->stop_token_ids[1] == 9);
    TH_REQUIRE(s->sampling);
    TH_CHECK(s->sampling->temperature == 0.7f && s->sampling->top_k == 40 &&
             s->sampling->top_p == 0.9f && s->sampling->min_p == 0.05f &&
             s->sampling->repeat_penalty == 1.1f && s->sampling->repeat_last_n == 32 &&
             s->sampling->seed == 0xfeedfacecafebeefull);
    td_ctrl_envelope_free(d);

    Td__Cancel c = TD__CANCEL__INIT;
    c.request_id = 42;
    e.body_case = TD__ENVELOPE__BODY_CANCEL;
    e.cancel = &c;
    d = roundtrip(&e);
    TH_CHECK(d && d->body_case == TD__ENVELOPE__BODY_CANCEL && d->cancel->request_id == 42);
    td_ctrl_envelope_free(d);

    Td__HealthRequest hr = TD__HEALTH_REQUEST__INIT;
    e.body_case = TD__ENVELOPE__BODY_HEALTH_REQUEST;
    e.health_request = &hr;
    d = roundtrip(&e);
    TH_CHECK(d && d->body_case == TD__ENVELOPE__BODY_HEALTH_REQUEST);
    td_ctrl_envelope_free(d);

    Td__Poll p = TD__POLL__INIT;
    p.ack_seq = 1000;
    p.wait_ms = 500;
    e.body_case = TD__ENVELOPE__BODY_POLL;
    e.poll = &p;
    d = roundtrip(&e);
    TH_CHECK(d && d->poll->ack_seq == 1000 && d->poll->wait_ms == 500);
    td_ctrl_envelope_free(d);

    Td__Alloc a = TD__ALLOC__INIT;
    a.request = &sub;
    a.n_stages = 2;
    e.body_case = TD__ENVELOPE__BODY_ALLOC;
    e.alloc = &a;
    d = roundtrip(&e);
    TH_CHECK(d && d->alloc->n_stages == 2 && d->alloc->request->request_id == 42 &&
             d->alloc->request->n_token_ids == 5);
    td_ctrl_envelope_free(d);

    uint8_t blob[] = {0, 1, 2, 255};
    Td__Prefill pf = TD__PREFILL__INIT;
    pf.request_id = 43;
    pf.n_token_ids = 3;
    pf.token_ids = prompt;
    pf.sampling = &sp;
    ProtobufCBinaryData blobs[2] = {{4, blob}, {2, blob}};
    pf.n_kv_targets = 2;
    pf.kv_targets = blobs;
    pf.n_decode_ranks = 2;
    pf.decode_instance = "d0";
    e.body_case = TD__ENVELOPE__BODY_PREFILL;
    e.prefill = &pf;
    d = roundtrip(&e);
    TH_CHECK(d && d->prefill->request_id == 43 && d->prefill->n_token_ids == 3 &&
             d->prefill->n_kv_targets == 2 && d->prefill->kv_targets[0].len == 4 &&
             d->prefill->kv_targets[0].data[3] == 255 && d->prefill->kv_targets[1].len == 2 &&
             !strcmp(d->prefill->decode_instance, "d0") && d->prefill->sampling->top_k == 40);
    td_ctrl_envelope_free(d);

    Td__KvTarget kt = TD__KV_TARGET__INIT;
    kt.request_id = 43;
    kt.n_kv_targets = 1;
    kt.kv_targets = blobs;
    e.body_case = TD__ENVELOPE__BODY_KV_TARGET;
    e.kv_target = &kt;
    d = roundtrip(&e);
    TH_CHECK(d && d->kv_target->request_id == 43 && d->kv_target->n_kv_targets == 1 &&
             d->kv_target->kv_targets[0].len == 4);
    td_ctrl_envelope_free(d);
    kt.n_kv_targets = 0; /* a KvTarget without targets is invalid */
    {
        uint8_t *buf;
        size_t len;
        TH_CHECK(td_ctrl_encode(&e, NULL, &buf, &len) == 0);
        Td__Envelope *bad = NULL;
        TH_CHECK(td_ctrl_decode(buf, len, NULL, &bad, NULL, 0) == TD_EINVAL && !bad);
        free(buf);
    }

    Td__StageHello sh = TD__STAGE_HELLO__INIT;
    sh.instance = "p0";
    sh.stage = 1;
    sh.pp = 2;
    sh.pipe_address = blobs[0];
    sh.pid = 1234;
    sh.boot_id = 99;
    e.body_case = TD__ENVELOPE__BODY_STAGE_HELLO;
    e.stage_hello = &sh;
    d = roundtrip(&e);
    TH_CHECK(d && d->stage_hello->stage == 1 && d->stage_hello->pp == 2 &&
             d->stage_hello->pipe_address.len == 4 && d->stage_hello->boot_id == 99);
    td_ctrl_envelope_free(d);

    /* Join (router.membership): round trip, then what the decoder refuses */
    Td__Join j = TD__JOIN__INIT;
    j.role = TD__ROLE__ROLE_DECODE;
    j.name = "d0-b";
    j.url = "tcp://10.0.0.7:9000";
    j.template_name = "d0";
    j.tp = 2;
    j.max_batch = 16;
    j.leaving = true;
    e.body_case = TD__ENVELOPE__BODY_JOIN;
    e.join = &j;
    d = roundtrip(&e);
    TH_CHECK(d && d->join->role == TD__ROLE__ROLE_DECODE && !strcmp(d->join->name, "d0-b") &&
             !strcmp(d->join->url, "tcp://10.0.0.7:9000") &&
             !strcmp(d->join->template_name, "d0") && d->join->tp == 2 &&
             d->join->max_batch == 16 && d->join->leaving);
    td_ctrl_envelope_free(d);
    for (int k = 0; k < 3; k++) {
        Td__Join bj = j;
        if (k == 0) bj.role = TD__ROLE__ROLE_ROUTER; /* neither decode nor prefill */
        if (k == 1) bj.url = "";                     /* nowhere to dial */
        if (k == 2) bj.tp = 100000;                  /* out of range */
        e.join = &bj;
        uint8_t *buf;
        size_t len;
        TH_CHECK(td_ctrl_encode(&e, NULL, &buf, &len) == 0);
        Td__Envelope *bad = NULL;
        int rc = td_ctrl_decode(buf, len, NULL, &bad, NULL, 0);
        TH_CHECKF((rc == TD_EINVAL || rc == TD_ERANGE) && !bad, "bad join %d: %d", k, rc);
        free(buf);
    }
}

/* The sampler's lists (logit bias, min_tokens ids) through td_ctrl_sampling_to_pb, the wire
 * and td_ctrl_sampling_from_pb; bad lists are refused by the decoder. */
static void test_sampling_lists(void)
{
    int32_t prompt[] = {1, 2};
    td_sampling in = {
        .temperature = 0.5f, .min_tokens = 3, .n_min_tokens_ids = 2, .n_logit_bias = 2};
    in.min_tokens_ids[0] = 7;
    in.min_tokens_ids[1] = 2;
    in.logit_bias_ids[0] = 5;
    in.logit_bias_values[0] = -100.0f;
    in.logit_bias_ids[1] = 9;
    in.logit_bias_values[1] = 2.5f;
    Td__Sampling sp;
    td_ctrl_sampling_to_pb(&in, &sp);
    Td__Submit sub = TD__SUBMIT__INIT;
    sub.request_id = 1;
    sub.n_token_ids = 2;
    sub.token_ids = prompt;
    sub.sampling = &sp;
    sub.max_tokens = 4;
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.client_id = 1;
    e.body_case = TD__ENVELOPE__BODY_SUBMIT;
    e.submit = &sub;
    Td__Envelope *d = roundtrip(&e);
    TH_REQUIRE(d);
    td_sampling out = td_ctrl_sampling_from_pb(d->submit->sampling);
    td_ctrl_envelope_free(d);
    TH_CHECK(out.temperature == 0.5f && out.min_tokens == 3 && out.n_min_tokens_ids == 2 &&
             out.min_tokens_ids[0] == 7 && out.min_tokens_ids[1] == 2 && out.n_logit_bias == 2 &&
             out.logit_bias_ids[0] == 5 && out.logit_bias_values[0] == -100.0f &&
             out.logit_bias_ids[1] == 9 && out.logit_bias_values[1] == 2.5f);
    /* no lists: nothing on the wire, nothing back */
    td_sampling none = {.temperature = 1.0f};
    td_ctrl_sampling_to_pb(&none, &sp);
    TH_CHECK(sp.n_logit_bias_ids == 0 && sp.n_min_tokens_ids == 0);
    /* refused: ids and values of different lengths, a NaN bias, a negative id */
    float vals[2] = {1.0f, NAN};
    int32_t ids[2] = {3, -1};
    for (int k = 0; k < 3; k++) {
        td_ctrl_sampling_to_pb(&none, &sp);
        sp.logit_bias_ids = ids;
        sp.logit_bias_values = vals;
        sp.n_logit_bias_ids = k == 0 ? 2 : 1;
        sp.n_logit_bias_values = k == 0 ? 1 : 1;
        if (k == 1) vals[0] = NAN;
        if (k == 2) {
            vals[0] = 1.0f;
            sp.n_logit_bias_ids = sp.n_logit_bias_values = 0;
            sp.n_min_tokens_ids = 2;
            sp.min_tokens_ids = ids;
        }
        uint8_t *buf;
        size_t len;
        TH_REQUIRE(td_ctrl_encode(&e, NULL, &buf, &len) == 0);
        Td__Envelope *bad = NULL;
        TH_CHECKF(td_ctrl_decode(buf, len, NULL, &bad, NULL, 0) == (k == 0 ? TD_ERANGE : TD_EINVAL),
                  "bad sampling list %d is refused", k);
        td_ctrl_envelope_free(bad);
        free(buf);
    }
}

static void test_roundtrip_replies(void)
{
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.call_id = 5;
    Td__Ack ack = TD__ACK__INIT;
    ack.request_id = 9;
    e.body_case = TD__ENVELOPE__BODY_ACK;
    e.ack = &ack;
    Td__Envelope *d = roundtrip(&e);
    TH_CHECK(d && d->call_id == 5 && d->ack->request_id == 9);
    td_ctrl_envelope_free(d);

    Td__ErrorEvent er = TD__ERROR_EVENT__INIT;
    er.request_id = 9;
    er.code = TD__ERROR_CODE__ERR_NO_SPACE;
    er.message = "prompt of 9000 tokens is larger than the KV pool";
    e.body_case = TD__ENVELOPE__BODY_ERROR;
    e.error = &er;
    d = roundtrip(&e);
    TH_CHECK(d && d->error->code == TD__ERROR_CODE__ERR_NO_SPACE &&
             !strcmp(d->error->message, er.message));
    td_ctrl_envelope_free(d);

    Td__Health h = TD__HEALTH__INIT;
    h.instance = "d0";
    h.role = TD__ROLE__ROLE_DECODE;
    h.rank = 0;
    h.running = 3;
    h.waiting = 4;
    h.kv_blocks_used = 100;
    h.kv_blocks_free = 3996;
    h.kv_block_size = 16;
    h.queued_prompt_tokens = 12;
    h.uptime_ms = 99;
    h.ready = 1;
    h.backend = "cpu";
    h.act = "q8";
    h.cpu_isa = "avx512";
    h.kernels_isa = "avx512";
    h.blas_core = "Prescott";
    h.blas_core_older = true;
    h.compute_paths = "Q4_1: batch float32 tiles + OpenBLAS sgemm, solo float32 dot";
    e.body_case = TD__ENVELOPE__BODY_HEALTH;
    e.health = &h;
    d = roundtrip(&e);
    TH_CHECK(d && !strcmp(d->health->instance, "d0") && d->health->role == TD__ROLE__ROLE_DECODE &&
             d->health->running == 3 && d->health->waiting == 4 &&
             d->health->kv_blocks_used == 100 && d->health->kv_blocks_free == 3996 &&
             d->health->kv_block_size == 16 && d->health->queued_prompt_tokens == 12 &&
             d->health->uptime_ms == 99 && d->health->ready);
    TH_CHECK(d && !strcmp(d->health->backend, "cpu") && !strcmp(d->health->act, "q8") &&
             !strcmp(d->health->cpu_isa, "avx512") && !strcmp(d->health->kernels_isa, "avx512") &&
             !strcmp(d->health->blas_core, "Prescott") && d->health->blas_core_older &&
             !strcmp(d->health->compute_paths, h.compute_paths));
    td_ctrl_envelope_free(d);
    /* the compute strings' bounds: at the limit decodes, one byte more does not */
    char tag[TD_CTRL_MAX_TAG + 2], paths[TD_CTRL_MAX_PATHS + 2];
    memset(tag, 'a', sizeof tag - 1);
    tag[sizeof tag - 1] = 0;
    memset(paths, 'p', sizeof paths - 1);
    paths[sizeof paths - 1] = 0;
    uint8_t *hb;
    size_t hl;
    char herr[160];
    for (int k = 0; k < 4; k++) {
        h.blas_core = k == 0 ? tag + 1 : k == 1 ? tag : "Prescott";
        h.compute_paths = k == 2 ? paths + 1 : k == 3 ? paths : "";
        TH_REQUIRE(td_ctrl_encode(&e, NULL, &hb, &hl) == 0);
        Td__Envelope *hd = NULL;
        int rc = td_ctrl_decode(hb, hl, NULL, &hd, herr, sizeof herr);
        TH_CHECKF(rc == (k % 2 ? TD_ERANGE : 0), "case %d: rc %d (%s)", k, rc, herr);
        TH_CHECK(k % 2 == 0 || strstr(herr, k == 1 ? "health.blas_core" : "health.compute_paths"));
        td_ctrl_envelope_free(hd);
        free(hb);
    }
    h.blas_core = "Prescott";
    h.compute_paths = "";

    uint8_t blob[300];
    for (int i = 0; i < 300; i++)
        blob[i] = (uint8_t)i;
    Td__AllocReply ar = TD__ALLOC_REPLY__INIT;
    ar.request_id = 9;
    ProtobufCBinaryData targets[3] = {{sizeof blob, blob}, {10, blob}, {1, blob + 299}};
    ar.n_kv_targets = 3;
    ar.kv_targets = targets;
    e.body_case = TD__ENVELOPE__BODY_ALLOC_REPLY;
    e.alloc_reply = &ar;
    d = roundtrip(&e);
    TH_CHECK(d && d->alloc_reply->n_kv_targets == 3 && d->alloc_reply->kv_targets[0].len == 300 &&
             !memcmp(d->alloc_reply->kv_targets[0].data, blob, 300) &&
             d->alloc_reply->kv_targets[2].len == 1 && d->alloc_reply->kv_targets[2].data[0] == 43);
    td_ctrl_envelope_free(d);

    /* Events: token, error, prefill_done, with health */
    int32_t toks[] = {11, 12};
    uint32_t chunks[] = {512, 256};
    Td__Usage u = TD__USAGE__INIT;
    u.prompt_tokens = 5;
    u.completion_tokens = 2;
    Td__TokenEvent te = TD__TOKEN_EVENT__INIT;
    te.request_id = 9;
    te.seq = 1;
    te.n_token_ids = 2;
    te.token_ids = toks;
    te.finish = TD__FINISH_REASON__FINISH_LENGTH;
    te.usage = &u;
    Td__PrefillDone pd = TD__PREFILL_DONE__INIT;
    pd.request_id = 9;
    pd.first_token = 11;
    pd.n_prompt_tokens = 768;
    pd.n_chunk_sizes = 2;
    pd.chunk_sizes = chunks;
    Td__Event ev[3] = {TD__EVENT__INIT, TD__EVENT__INIT, TD__EVENT__INIT};
    ev[0].seq = 7;
    ev[0].body_case = TD__EVENT__BODY_TOKEN;
    ev[0].token = &te;
    ev[1].seq = 8;
    ev[1].body_case = TD__EVENT__BODY_ERROR;
    ev[1].error = &er;
    ev[2].seq = 9;
    ev[2].body_case = TD__EVENT__BODY_PREFILL_DONE;
    ev[2].prefill_done = &pd;
    Td__Event *evp[3] = {&ev[0], &ev[1], &ev[2]};
    Td__Events evs = TD__EVENTS__INIT;
    evs.n_events = 3;
    evs.events = evp;
    evs.health = &h;
    e.body_case = TD__ENVELOPE__BODY_EVENTS;
    e.events = &evs;
    d = roundtrip(&e);
    TH_REQUIRE(d && d->events->n_events == 3 && d->events->health);
    const Td__TokenEvent *t = d->events->events[0]->token;
    TH_CHECK(d->events->events[0]->seq == 7 && t->request_id == 9 && t->seq == 1 &&
             t->n_token_ids == 2 && t->token_ids[1] == 12 &&
             t->finish == TD__FINISH_REASON__FINISH_LENGTH && t->usage->prompt_tokens == 5 &&
             t->usage->completion_tokens == 2);
    TH_CHECK(d->events->events[1]->error->code == TD__ERROR_CODE__ERR_NO_SPACE);
    TH_CHECK(d->events->events[2]->prefill_done->first_token == 11 &&
             d->events->events[2]->prefill_done->n_chunk_sizes == 2 &&
             d->events->events[2]->prefill_done->chunk_sizes[0] == 512);
    TH_CHECK(d->events->health->kv_blocks_free == 3996);
    td_ctrl_envelope_free(d);
}

static int decode_err(const void *buf, size_t len, const td_ctrl_opts *o, char *err, size_t cap)
{
    Td__Envelope *d = NULL;
    int rc = td_ctrl_decode(buf, len, o, &d, err, cap);
    td_ctrl_envelope_free(d);
    return rc;
}

static void test_decode_rejects(void)
{
    char err[256];
    /* empty and garbage */
    TH_CHECK(decode_err("", 0, NULL, err, sizeof err) == TD_EFORMAT);
    const uint8_t junk[] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01};
    TH_CHECK(decode_err(junk, sizeof junk, NULL, err, sizeof err) == TD_EFORMAT);
    TH_CHECK(strstr(err, "malformed") != NULL);

    /* every truncation of a valid Submit fails; inside the body it is malformed */
    int32_t prompt[64];
    for (int i = 0; i < 64; i++)
        prompt[i] = i * 1000;
    Td__Submit sub = TD__SUBMIT__INIT;
    sub.request_id = 1;
    sub.n_token_ids = 64;
    sub.token_ids = prompt;
    sub.max_tokens = 4;
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.client_id = 3;
    e.body_case = TD__ENVELOPE__BODY_SUBMIT;
    e.submit = &sub;
    uint8_t *buf;
    size_t len;
    TH_REQUIRE(td_ctrl_encode(&e, NULL, &buf, &len) == 0);
    int n_fail = 0, n_format = 0;
    for (size_t cut = 0; cut < len; cut++) {
        int rc = decode_err(buf, cut, NULL, err, sizeof err);
        n_fail += rc == TD_EFORMAT || rc == TD_EINVAL;
        n_format += rc == TD_EFORMAT;
    }
    TH_CHECKF(n_fail == (int)len, "%d of %zu truncations rejected", n_fail, len);
    TH_CHECK(n_format >= (int)len - 8);
    TH_CHECK(decode_err(buf, len, NULL, err, sizeof err) == 0);

    /* oversized: the limit applies to decode and encode */
    td_ctrl_opts small = {.max_msg_bytes = 100};
    TH_CHECK(decode_err(buf, len, &small, err, sizeof err) == TD_ERANGE);
    TH_CHECK(strstr(err, "exceeds the limit") != NULL);
    uint8_t *b2;
    size_t l2;
    TH_CHECK(td_ctrl_encode(&e, &small, &b2, &l2) == TD_ERANGE);
    /* repeated-field limit */
    td_ctrl_opts few = {.max_tokens = 16};
    TH_CHECK(decode_err(buf, len, &few, err, sizeof err) == TD_ERANGE);
    TH_CHECK(strstr(err, "64 token ids") != NULL);
    free(buf);

    /* wrong version, also with a body we cannot parse */
    e.version = 2;
    TH_REQUIRE(td_ctrl_encode(&e, NULL, &buf, &len) == 0);
    TH_CHECK(decode_err(buf, len, NULL, err, sizeof err) == TD_EUNSUPP);
    TH_CHECKF(strstr(err, "version 2, this build speaks 1") != NULL, "%s", err);
    buf[len - 1] ^= 0xff;
    memset(buf + 4, 0xff, len - 4);
    TH_CHECK(decode_err(buf, len, NULL, err, sizeof err) == TD_EUNSUPP);
    free(buf);
    e.version = 0;

    /* invalid values */
    prompt[5] = -1;
    TH_REQUIRE(td_ctrl_encode(&e, NULL, &buf, &len) == 0);
    TH_CHECK(decode_err(buf, len, NULL, err, sizeof err) == TD_EINVAL);
    TH_CHECK(strstr(err, "negative token id") != NULL);
    free(buf);
    prompt[5] = 5;
    Td__Sampling sp = TD__SAMPLING__INIT;
    sp.temperature = NAN;
    sub.sampling = &sp;
    TH_REQUIRE(td_ctrl_encode(&e, NULL, &buf, &len) == 0);
    TH_CHECK(decode_err(buf, len, NULL, err, sizeof err) == TD_EINVAL);
    free(buf);
    /* skip_samples counts tokens of the prompt (a moved request's generated ones) */
    sp.temperature = 0.5f;
    sp.skip_samples = (uint32_t)sub.n_token_ids - 1;
    TH_REQUIRE(td_ctrl_encode(&e, NULL, &buf, &len) == 0);
    TH_CHECK(decode_err(buf, len, NULL, err, sizeof err) == 0);
    free(buf);
    sp.skip_samples = (uint32_t)sub.n_token_ids;
    TH_REQUIRE(td_ctrl_encode(&e, NULL, &buf, &len) == 0);
    TH_CHECK(decode_err(buf, len, NULL, err, sizeof err) == TD_EINVAL);
    TH_CHECKF(strstr(err, "skip_samples") != NULL, "%s", err);
    free(buf);
    sub.sampling = NULL;
    sub.request_id = 0;
    TH_REQUIRE(td_ctrl_encode(&e, NULL, &buf, &len) == 0);
    TH_CHECK(decode_err(buf, len, NULL, err, sizeof err) == TD_EINVAL);
    free(buf);
    sub.request_id = 1;
    sub.n_stop_token_ids = TD_CTRL_MAX_STOP_IDS + 1;
    sub.stop_token_ids = prompt;
    TH_REQUIRE(td_ctrl_encode(&e, NULL, &buf, &len) == 0);
    TH_CHECK(decode_err(buf, len, NULL, err, sizeof err) == TD_ERANGE);
    free(buf);

    /* no body: a bare version */
    const uint8_t bare[] = {0x08, 0x01};
    TH_CHECK(decode_err(bare, sizeof bare, NULL, err, sizeof err) == TD_EINVAL);
    /* encode refuses a missing body */
    Td__Envelope none = TD__ENVELOPE__INIT;
    TH_CHECK(td_ctrl_encode(&none, NULL, &buf, &len) == TD_EINVAL);

    /* the decode memory budget: many empty events amplify ~30x+ */
    size_t n = 20000;
    uint8_t *big = malloc(4 + 4 * n + 16);
    size_t k = 0;
    big[k++] = 0x08; /* version 1 */
    big[k++] = 0x01;
    big[k++] = 0x8a; /* field 33, wire type 2: 33 << 3 | 2 = 266 -> 0x8a 0x02 */
    big[k++] = 0x02;
    size_t inner = 4 * n; /* Events: n x (field 1 len 2: Event{token{}}) */
    big[k++] = (uint8_t)(0x80 | (inner & 0x7f));
    big[k++] = (uint8_t)(0x80 | ((inner >> 7) & 0x7f));
    big[k++] = (uint8_t)(inner >> 14);
    for (size_t i = 0; i < n; i++) {
        big[k++] = 0x0a;
        big[k++] = 0x02;
        big[k++] = 0x12;
        big[k++] = 0x00;
    }
    int rc = decode_err(big, k, NULL, err, sizeof err);
    TH_CHECKF(rc == TD_ERANGE || rc == TD_EINVAL, "rc %d: %s", rc, err);
    free(big);
}

/* ---- fake node ------------------------------------------------------------------------ */

#define MAX_REQS 64

typedef struct {
    bool active;
    uint64_t client, rid;
    int32_t base;
    uint32_t produced, max, seq, prompt;
} fake_req;

typedef struct {
    td_ctrl_server *s;
    atomic_int stop;
    atomic_int peer_gone;
    fake_req reqs[MAX_REQS];
    td_ctrl_req *held;
    int64_t held_until;
} fake_node;

static int g_report_fd = -1; /* test_ctrl --node: "GONE" lines for the parent go here */

static fake_req *node_find(fake_node *n, uint64_t client, uint64_t rid)
{
    for (int i = 0; i < MAX_REQS; i++)
        if (n->reqs[i].active && n->reqs[i].client == client && n->reqs[i].rid == rid)
            return &n->reqs[i];
    return NULL;
}

static void node_handle(fake_node *n, td_ctrl_server_in *in)
{
    if (in->kind == TD_CTRL_IN_PEER_GONE) {
        atomic_fetch_add(&n->peer_gone, 1);
        if (g_report_fd >= 0 && write(g_report_fd, "GONE\n", 5) != 5) perror("test_ctrl --node");
        for (int i = 0; i < MAX_REQS; i++)
            if (n->reqs[i].client == in->client_id) n->reqs[i].active = false;
        return;
    }
    const Td__Envelope *e = in->env;
    if (e->body_case == TD__ENVELOPE__BODY_SUBMIT) {
        const Td__Submit *s = e->submit;
        if (s->request_id == 999) { /* held: the client's deadline passes first */
            n->held = in->req;
            n->held_until = td_now_ms() + 400;
            return;
        }
        if (node_find(n, in->client_id, s->request_id)) { /* delivered twice: idempotent */
            td_ctrl_server_reply_ack(n->s, in->req, s->request_id);
            return;
        }
        fake_req *r = NULL;
        for (int i = 0; i < MAX_REQS && !r; i++)
            if (!n->reqs[i].active) r = &n->reqs[i];
        if (!r) {
            td_ctrl_server_reply_error(n->s, in->req, s->request_id, TD__ERROR_CODE__ERR_BUSY,
                                       "full");
            return;
        }
        *r = (fake_req){.active = true,
                        .client = in->client_id,
                        .rid = s->request_id,
                        .base = s->token_ids[0],
                        .max = s->max_tokens,
                        .prompt = (uint32_t)s->n_token_ids};
        td_ctrl_server_reply_ack(n->s, in->req, r->rid); /* frees in->env */
        if (r->rid == 777) { /* burst: every token now, one event each */
            for (; r->produced < r->max; r->produced++) {
                int32_t t = r->base + (int32_t)r->produced;
                bool last = r->produced + 1 == r->max;
                td_ctrl_server_send_tokens(n->s, r->client, r->rid, r->seq++, &t, 1,
                                           last ? TD__FINISH_REASON__FINISH_LENGTH
                                                : TD__FINISH_REASON__FINISH_NONE,
                                           r->prompt, r->produced + 1, 0);
            }
            r->active = false;
        }
    } else if (e->body_case == TD__ENVELOPE__BODY_CANCEL) {
        fake_req *r = node_find(n, in->client_id, e->cancel->request_id);
        if (!r) {
            td_ctrl_server_reply_error(n->s, in->req, e->cancel->request_id,
                                       TD__ERROR_CODE__ERR_NOT_FOUND, "no request %llu",
                                       (unsigned long long)e->cancel->request_id);
            return;
        }
        td_ctrl_server_reply_ack(n->s, in->req, r->rid);
        td_ctrl_server_send_tokens(n->s, r->client, r->rid, r->seq++, NULL, 0,
                                   TD__FINISH_REASON__FINISH_CANCELLED, r->prompt, r->produced, 0);
        r->active = false;
    } else {
        td_ctrl_server_reply_error(n->s, in->req, 0, TD__ERROR_CODE__ERR_UNSUPPORTED,
                                   "fake node: %s not supported", td_ctrl_body_name(e->body_case));
    }
}

static void *node_main(void *arg)
{
    fake_node *n = arg;
    Td__Health h = TD__HEALTH__INIT;
    h.instance = "fake0";
    h.role = TD__ROLE__ROLE_DECODE;
    h.kv_blocks_free = 1000;
    h.ready = 1;
    td_ctrl_server_set_health(n->s, &h);
    while (!atomic_load(&n->stop)) {
        int busy = 0;
        for (int i = 0; i < MAX_REQS; i++)
            busy |= n->reqs[i].active;
        td_ctrl_server_in in;
        int rc = td_ctrl_server_recv(n->s, &in, busy ? 3 : 20);
        if (rc == 0) node_handle(n, &in);
        if (n->held && td_now_ms() >= n->held_until) {
            td_ctrl_server_reply_ack(n->s, n->held, 999); /* late: the client gave up */
            n->held = NULL;
        }
        /* one step: a token for every running request */
        for (int i = 0; i < MAX_REQS; i++) {
            fake_req *r = &n->reqs[i];
            if (!r->active) continue;
            int32_t t = r->base + (int32_t)r->produced++;
            bool last = r->produced == r->max;
            td_ctrl_server_send_tokens(n->s, r->client, r->rid, r->seq++, &t, 1,
                                       last ? TD__FINISH_REASON__FINISH_LENGTH
                                            : TD__FINISH_REASON__FINISH_NONE,
                                       r->prompt, r->produced, 0);
            if (last) r->active = false;
        }
    }
    if (n->held) td_ctrl_server_reply_ack(n->s, n->held, 999);
    n->held = NULL;
    return NULL;
}

typedef struct {
    fake_node node;
    pthread_t th;
    char url[256];
} node_run;

static int node_start(node_run *nr, const char *url, const td_ctrl_opts *o)
{
    memset(nr, 0, sizeof *nr);
    if (td_ctrl_server_create(o, &nr->node.s)) return -1;
    if (td_ctrl_server_listen(nr->node.s, url, nr->url, sizeof nr->url)) {
        td_ctrl_server_destroy(nr->node.s);
        return -1;
    }
    pthread_create(&nr->th, NULL, node_main, &nr->node);
    return 0;
}

static void node_stop(node_run *nr)
{
    atomic_store(&nr->node.stop, 1);
    pthread_join(nr->th, NULL);
    td_ctrl_server_destroy(nr->node.s);
}

/* ---- the fake node as a process of its own -------------------------------------------- */

/* The options of the reconnect test, on both sides. */
static const td_ctrl_opts rc_opts = {
    .reconnect_min_ms = 20, .reconnect_max_ms = 100, .peer_grace_ms = 200, .poll_wait_ms = 200};

/* test_ctrl --node URL: the fake node serves URL (rc_opts) until stdin reaches EOF, then
 * stops its server and exits. Prints "READY" once listening and "GONE" for each client
 * reported gone (stdout is the parent's pipe). */
static int node_process(const char *url)
{
    g_report_fd = 1;
    node_run nr;
    if (node_start(&nr, url, &rc_opts)) return 1;
    if (write(1, "READY\n", 6) != 6) perror("test_ctrl --node");
    char b[64];
    ssize_t r;
    while ((r = read(0, b, sizeof b)) != 0)
        if (r < 0 && errno != EINTR) break;
    node_stop(&nr);
    return 0;
}

typedef struct {
    pid_t pid;
    int in, out; /* our ends of its stdin and stdout */
} node_proc;

/* One line from the node process into out (without its newline) within ms: 1, 0 at EOF
 * (it exited), -1 when ms passed first. */
static int proc_line(node_proc *np, char *out, size_t cap, int ms)
{
    int64_t end = td_now_ms() + ms;
    size_t n = 0;
    out[0] = 0;
    for (;;) {
        int left = (int)(end - td_now_ms());
        struct pollfd p = {.fd = np->out, .events = POLLIN};
        int rc = left > 0 ? poll(&p, 1, left) : 0;
        if (rc < 0 && errno == EINTR) continue;
        if (rc <= 0) return -1;
        char ch;
        ssize_t got = read(np->out, &ch, 1);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return 0;
        if (ch == '\n') return 1;
        if (n + 1 < cap) {
            out[n++] = ch;
            out[n] = 0;
        }
    }
}

/* Start this program as `--node url` (it dies with us) and wait until it listens. */
static bool node_proc_start(node_proc *np, const char *url)
{
    char *argv[] = {"test_ctrl", "--node", (char *)url, NULL};
    int pin[2], pout[2];
    if (pipe(pin)) return false;
    if (pipe(pout)) {
        close(pin[0]);
        close(pin[1]);
        return false;
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(1);
        dup2(pin[0], 0);
        dup2(pout[1], 1);
        close(pin[0]);
        close(pin[1]);
        close(pout[0]);
        close(pout[1]);
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    close(pin[0]);
    close(pout[1]);
    *np = (node_proc){.pid = pid, .in = pin[1], .out = pout[0]};
    fcntl(np->in, F_SETFD, FD_CLOEXEC); /* the next node process must not hold them */
    fcntl(np->out, F_SETFD, FD_CLOEXEC);
    char line[64] = "";
    if (pid > 0 && proc_line(np, line, sizeof line, 20000) == 1 && !strcmp(line, "READY"))
        return true;
    fprintf(stderr, "the node process did not start (%s)\n", line);
    close(np->in);
    close(np->out);
    if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    return false;
}

/* Close its stdin: it stops its server (a bounded close) and exits. Returns true if it
 * exited with status 0; *lines: the lines it printed meanwhile. */
static bool node_proc_stop(node_proc *np, int *lines)
{
    close(np->in);
    char line[64];
    int n = 0, rc;
    int64_t end = td_now_ms() + 10000;
    while ((rc = proc_line(np, line, sizeof line, (int)(end - td_now_ms()))) == 1)
        n++;
    if (rc < 0) kill(np->pid, SIGKILL);
    int status = 0;
    waitpid(np->pid, &status, 0);
    close(np->out);
    *lines = n;
    return rc == 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* ---- client side helpers -------------------------------------------------------------- */

typedef struct {
    uint64_t rid;
    int32_t toks[8192];
    uint32_t n, next_seq;
    Td__FinishReason finish;
    bool done, seq_ok;
} stream;

typedef struct {
    uint64_t call_id;
    int err;
    Td__Envelope__BodyCase body;
    Td__ErrorCode code;
    char msg[256];
    bool got;
} reply_rec;

static int g_restarts;          /* TD_CTRL_IN_RESTARTED seen by pump_n */
static int g_tokens_at_restart; /* tokens of the first stream when the last one came */

/* Receive until every stream is done and every reply arrived, or the timeout. */
static bool pump_n(td_ctrl_client *c, stream *st, int n_st, int n_need, reply_rec *rp, int n_rp,
                   int timeout_ms)
{
    int64_t end = td_now_ms() + timeout_ms;
    td_ctrl_client_in in = {0};
    for (;;) {
        bool all = true;
        for (int i = 0; i < n_need; i++)
            all &= st[i].done;
        for (int i = 0; i < n_rp; i++)
            all &= rp[i].got;
        if (all) break;
        int64_t left = end - td_now_ms();
        if (left <= 0) break;
        if (td_ctrl_client_recv(c, &in, (int)left)) continue;
        if (in.kind == TD_CTRL_IN_REPLY) {
            for (int i = 0; i < n_rp; i++) {
                if (rp[i].call_id != in.call_id) continue;
                rp[i].got = true;
                rp[i].err = in.err;
                if (in.env) {
                    rp[i].body = in.env->body_case;
                    if (in.env->body_case == TD__ENVELOPE__BODY_ERROR) {
                        rp[i].code = in.env->error->code;
                        snprintf(rp[i].msg, sizeof rp[i].msg, "%s", in.env->error->message);
                    }
                }
            }
        } else if (in.kind == TD_CTRL_IN_RESTARTED) {
            g_restarts++;
            g_tokens_at_restart = n_st > 0 ? (int)st[0].n : -1;
        } else if (in.kind == TD_CTRL_IN_EVENTS) {
            for (size_t k = 0; k < in.n_events; k++) {
                const Td__Event *ev = in.events[k];
                if (ev->body_case != TD__EVENT__BODY_TOKEN) continue;
                for (int i = 0; i < n_st; i++) {
                    stream *s = &st[i];
                    if (s->rid != ev->token->request_id) continue;
                    if (ev->token->seq != s->next_seq++) s->seq_ok = false;
                    for (size_t j = 0; j < ev->token->n_token_ids && s->n < 8192; j++)
                        s->toks[s->n++] = ev->token->token_ids[j];
                    if (ev->token->finish) {
                        s->finish = ev->token->finish;
                        s->done = true;
                    }
                }
            }
        }
    }
    td_ctrl_client_in_free(&in);
    for (int i = 0; i < n_need; i++)
        if (!st[i].done) return false;
    for (int i = 0; i < n_rp; i++)
        if (!rp[i].got) return false;
    return true;
}

static bool pump(td_ctrl_client *c, stream *st, int n_st, reply_rec *rp, int n_rp, int timeout_ms)
{
    return pump_n(c, st, n_st, n_st, rp, n_rp, timeout_ms);
}

static Td__Submit make_submit(uint64_t rid, int32_t *prompt, size_t n, uint32_t max)
{
    Td__Submit s = TD__SUBMIT__INIT;
    s.request_id = rid;
    s.token_ids = prompt;
    s.n_token_ids = n;
    s.max_tokens = max;
    return s;
}

/* submit / events / cancel / health / bad input, over one URL */
static void exchange(const char *listen_url)
{
    node_run nr;
    TH_REQUIRE(node_start(&nr, listen_url, NULL) == 0);
    td_ctrl_client *c;
    TH_REQUIRE(td_ctrl_client_create(nr.url, NULL, &c) == 0);

    int32_t p1[] = {100, 1, 2}, p2[] = {200}, p3[] = {300, 5};
    Td__Submit s1 = make_submit(1, p1, 3, 20), s2 = make_submit(2, p2, 1, 7),
               s3 = make_submit(3, p3, 2, 100000);
    stream st[3] = {
        {.rid = 1, .seq_ok = true}, {.rid = 2, .seq_ok = true}, {.rid = 3, .seq_ok = true}};
    reply_rec rp[4] = {{0}};
    TH_CHECK(td_ctrl_client_submit(c, &s1, 2000, &rp[0].call_id) == 0);
    TH_CHECK(td_ctrl_client_submit(c, &s2, 2000, &rp[1].call_id) == 0);
    TH_CHECK(td_ctrl_client_submit(c, &s3, 2000, &rp[2].call_id) == 0);
    TH_CHECK(td_ctrl_client_health(c, 2000, &rp[3].call_id) == 0);
    TH_REQUIRE(pump_n(c, st, 3, 2, rp, 4, 5000));
    for (int i = 0; i < 3; i++)
        TH_CHECKF(rp[i].err == 0 && rp[i].body == TD__ENVELOPE__BODY_ACK, "reply %d: %d %d", i,
                  rp[i].err, rp[i].body);
    TH_CHECK(rp[3].err == 0 && rp[3].body == TD__ENVELOPE__BODY_HEALTH);
    TH_CHECK(st[0].n == 20 && st[0].finish == TD__FINISH_REASON__FINISH_LENGTH && st[0].seq_ok);
    TH_CHECK(st[1].n == 7 && st[1].finish == TD__FINISH_REASON__FINISH_LENGTH && st[1].seq_ok);
    bool vals = true;
    for (uint32_t i = 0; i < st[0].n; i++)
        vals &= st[0].toks[i] == 100 + (int32_t)i;
    for (uint32_t i = 0; i < st[1].n; i++)
        vals &= st[1].toks[i] == 200 + (int32_t)i;
    TH_CHECK(vals);

    /* cancel the long one mid-generation; cancel of an unknown id is an error reply */
    reply_rec cr[2] = {{0}};
    TH_CHECK(td_ctrl_client_cancel(c, 3, 2000, &cr[0].call_id) == 0);
    TH_CHECK(td_ctrl_client_cancel(c, 12345, 2000, &cr[1].call_id) == 0);
    TH_REQUIRE(pump(c, &st[2], 1, cr, 2, 5000));
    TH_CHECK(cr[0].err == 0 && cr[0].body == TD__ENVELOPE__BODY_ACK);
    TH_CHECK(cr[1].err == 0 && cr[1].body == TD__ENVELOPE__BODY_ERROR &&
             cr[1].code == TD__ERROR_CODE__ERR_NOT_FOUND);
    TH_CHECK(st[2].finish == TD__FINISH_REASON__FINISH_CANCELLED && st[2].n < 100000 &&
             st[2].seq_ok);

    /* bad messages get error replies; the server keeps serving */
    reply_rec bad[5] = {{0}};
    const uint8_t junk[] = {0xde, 0xad, 0xbe, 0xef, 0xff, 0xff};
    TH_CHECK(td_ctrl_client_call_raw(c, junk, sizeof junk, 2000, &bad[0].call_id) == 0);
    Td__Envelope e = TD__ENVELOPE__INIT;
    e.version = 7;
    e.client_id = 1;
    e.body_case = TD__ENVELOPE__BODY_SUBMIT;
    e.submit = &s1;
    uint8_t *buf;
    size_t len;
    TH_REQUIRE(td_ctrl_encode(&e, NULL, &buf, &len) == 0);
    TH_CHECK(td_ctrl_client_call_raw(c, buf, len, 2000, &bad[1].call_id) == 0);
    e.version = 0;
    free(buf);
    TH_REQUIRE(td_ctrl_encode(&e, NULL, &buf, &len) == 0);
    TH_CHECK(td_ctrl_client_call_raw(c, buf, len - 3, 2000, &bad[2].call_id) == 0); /* cut */
    free(buf);
    size_t big = (4u << 20) + 1000; /* over the default 4 MiB limit */
    uint8_t *huge = calloc(1, big);
    TH_CHECK(td_ctrl_client_call_raw(c, huge, big, 4000, &bad[3].call_id) == 0);
    free(huge);
    Td__Submit s4 = make_submit(4, p2, 1, 3);
    stream st4 = {.rid = 4, .seq_ok = true};
    TH_CHECK(td_ctrl_client_submit(c, &s4, 2000, &bad[4].call_id) == 0);
    TH_REQUIRE(pump(c, &st4, 1, bad, 5, 8000));
    TH_CHECK(bad[0].err == 0 && bad[0].code == TD__ERROR_CODE__ERR_MALFORMED);
    TH_CHECKF(bad[1].err == 0 && bad[1].code == TD__ERROR_CODE__ERR_VERSION &&
                  strstr(bad[1].msg, "version 7"),
              "%d %d %s", bad[1].err, bad[1].code, bad[1].msg);
    TH_CHECK(bad[2].err == 0 && bad[2].code == TD__ERROR_CODE__ERR_MALFORMED);
    TH_CHECK(bad[3].err == 0 && bad[3].code == TD__ERROR_CODE__ERR_TOO_LARGE);
    TH_CHECK(bad[4].err == 0 && bad[4].body == TD__ENVELOPE__BODY_ACK && st4.n == 3);

    /* a request the node does not answer in time: the deadline reports it */
    Td__Submit s9 = make_submit(999, p2, 1, 3);
    reply_rec dl = {0};
    int64_t t0 = td_now_ms();
    TH_CHECK(td_ctrl_client_submit(c, &s9, 150, &dl.call_id) == 0);
    TH_REQUIRE(pump(c, NULL, 0, &dl, 1, 3000));
    int64_t took = td_now_ms() - t0;
    TH_CHECKF(dl.err == TD_ETIMEDOUT && took >= 140 && took < 1000, "err %d after %lld ms", dl.err,
              (long long)took);
    /* the late reply is dropped; the next call still works */
    usleep(500 * 1000);
    reply_rec h2 = {0};
    TH_CHECK(td_ctrl_client_health(c, 2000, &h2.call_id) == 0);
    TH_REQUIRE(pump(c, NULL, 0, &h2, 1, 3000));
    TH_CHECK(h2.err == 0 && h2.body == TD__ENVELOPE__BODY_HEALTH);

    td_ctrl_server_stats ss;
    td_ctrl_server_get_stats(nr.node.s, &ss);
    TH_CHECKF(ss.rejected == 4 && ss.clients == 1, "rejected %llu clients %u",
              (unsigned long long)ss.rejected, ss.clients);
    td_ctrl_client_destroy(c);
    node_stop(&nr);
}

static void test_exchange_ipc(void)
{
    char url[128];
    snprintf(url, sizeof url, "ipc:///tmp/td-ctrl-test-%d.sock", (int)getpid());
    exchange(url);
}

static void test_exchange_tcp(void)
{
    exchange("tcp://127.0.0.1:0");
}

/* many events at once: all arrive, in order, each once */
static void test_burst(void)
{
    node_run nr;
    td_ctrl_opts o = {.max_msg_bytes = 16384}; /* forces many batches */
    TH_REQUIRE(node_start(&nr, "tcp://127.0.0.1:0", &o) == 0);
    td_ctrl_client *c;
    TH_REQUIRE(td_ctrl_client_create(nr.url, &o, &c) == 0);
    int32_t p[] = {1000};
    Td__Submit s = make_submit(777, p, 1, 5000);
    static stream st;
    memset(&st, 0, sizeof st);
    st.rid = 777;
    st.seq_ok = true;
    reply_rec rp = {0};
    TH_CHECK(td_ctrl_client_submit(c, &s, 2000, &rp.call_id) == 0);
    TH_REQUIRE(pump(c, &st, 1, &rp, 1, 10000));
    TH_CHECK(rp.err == 0 && st.n == 5000 && st.seq_ok &&
             st.finish == TD__FINISH_REASON__FINISH_LENGTH);
    bool vals = true;
    for (uint32_t i = 0; i < st.n; i++)
        vals &= st.toks[i] == 1000 + (int32_t)i;
    TH_CHECK(vals);
    td_ctrl_client_destroy(c);
    node_stop(&nr);
}

/* no server: calls time out cleanly; the server comes later: the dialer connects; the
 * server restarts: the dialer reconnects; the client goes away: the server notices.
 * The server is a process of its own (node_proc), started, stopped and started again, as a
 * restarted decode node is. Not one in this process: closing a server here while its
 * client's next Poll arrives can hang NNG 1.5.2's reaper thread for good (ctrl_internal.h),
 * and that thread is also what redials a lost connection, so the client would never
 * reconnect (seen: a restart whose close was given up, and every round after it timed out). */
static void test_absent_and_reconnect(void)
{
    char url[128];
    snprintf(url, sizeof url, "ipc:///tmp/td-ctrl-test-rc-%d.sock", (int)getpid());
    td_ctrl_client *c;
    TH_REQUIRE(td_ctrl_client_create(url, &rc_opts, &c) == 0);
    reply_rec r = {0};
    int64_t t0 = td_now_ms();
    TH_CHECK(td_ctrl_client_health(c, 300, &r.call_id) == 0);
    TH_REQUIRE(pump(c, NULL, 0, &r, 1, 3000));
    int64_t took = td_now_ms() - t0;
    TH_CHECKF(r.err == TD_ETIMEDOUT && took >= 290 && took < 1500, "err %d after %lld ms", r.err,
              (long long)took);

    for (int round = 0; round < 2; round++) { /* start, then restart */
        node_proc np;
        if (!node_proc_start(&np, url)) {
            TH_CHECKF(false, "round %d: no node process", round);
            break;
        }
        int32_t p[] = {10};
        Td__Submit s = make_submit(50 + round, p, 1, 5);
        stream st = {.rid = 50 + round, .seq_ok = true};
        reply_rec rp = {0};
        TH_CHECK(td_ctrl_client_submit(c, &s, 3000, &rp.call_id) == 0);
        TH_CHECK(pump(c, &st, 1, &rp, 1, 5000));
        TH_CHECKF(rp.err == 0 && rp.body == TD__ENVELOPE__BODY_ACK && st.n == 5 && st.seq_ok,
                  "round %d: err %d body %d n %u", round, rp.err, rp.body, st.n);
        /* a new server process is reported once, before any of its events (the first
           server is not a restart) */
        TH_CHECKF(g_restarts == round && (round == 0 || g_tokens_at_restart == 0),
                  "round %d: %d restarts reported, %d tokens before", round, g_restarts,
                  g_tokens_at_restart);
        if (round == 1) { /* the server notices the client going away */
            td_ctrl_client_destroy(c);
            c = NULL;
            char line[64];
            TH_CHECKF(proc_line(&np, line, sizeof line, 3000) == 1 && !strcmp(line, "GONE"),
                      "the client was not reported gone (%s)", line);
        }
        int more;
        TH_CHECKF(node_proc_stop(&np, &more) && more == 0,
                  "round %d: the node process did not exit cleanly (%d more lines)", round, more);
    }
    td_ctrl_client_destroy(c);
}

/* ---- teardown ------------------------------------------------------------------------ */

/* The server and the client of one connection close at the same moment, over and over (the
 * router and its nodes all getting SIGTERM): NNG 1.5.2's nng_close sometimes never returns
 * then (ctrl_internal.h). Every destroy must return within its bound. Runs for
 * TANDEM_CTRL_CLOSE_LOOP_MS (default 3000). */
typedef struct {
    node_run *nr;
    atomic_int done;
} stopper;

static void *stop_node_main(void *arg)
{
    stopper *x = arg;
    node_stop(x->nr);
    atomic_store(&x->done, 1);
    return NULL;
}

static void test_close_while_peer_closes(void)
{
    const char *env = getenv("TANDEM_CTRL_CLOSE_LOOP_MS");
    int64_t budget = env ? atoll(env) : 3000;
    int64_t end = td_now_ms() + budget;
    td_ctrl_opts o = {.reconnect_min_ms = 10, .reconnect_max_ms = 200, .poll_wait_ms = 500};
    int rounds = 0, slow = 0;
    int64_t worst = 0;
    while (td_now_ms() < end || rounds == 0) {
        node_run nr;
        TH_REQUIRE(node_start(&nr, "tcp://127.0.0.1:0", &o) == 0);
        td_ctrl_client *c;
        TH_REQUIRE(td_ctrl_client_create(nr.url, &o, &c) == 0);
        reply_rec r = {0};
        TH_CHECK(td_ctrl_client_health(c, 2000, &r.call_id) == 0);
        TH_CHECK(pump(c, NULL, 0, &r, 1, 3000) && r.err == 0);
        TH_CHECK(td_ctrl_client_health(c, 2000, &r.call_id) == 0); /* one in flight */
        stopper x = {.nr = &nr};
        pthread_t th;
        pthread_create(&th, NULL, stop_node_main, &x);
        usleep((useconds_t)(rounds % 7) * 300); /* vary which side goes first */
        int64_t t0 = td_now_ms();
        td_ctrl_client_destroy(c);
        int64_t took = td_now_ms() - t0;
        int64_t until = td_now_ms() + TD_CTRL_TEARDOWN_MS + 2000;
        while (!atomic_load(&x.done) && td_now_ms() < until)
            usleep(1000);
        int64_t stop_took = td_now_ms() - t0;
        TH_CHECKF(atomic_load(&x.done), "round %d: the server's destroy is still running", rounds);
        if (!atomic_load(&x.done)) break; /* its thread still uses nr: stop here */
        pthread_join(th, NULL);
        worst = took > worst ? took : worst;
        worst = stop_took > worst ? stop_took : worst;
        slow += took >= TD_CTRL_TEARDOWN_MS;
        TH_CHECKF(took < TD_CTRL_TEARDOWN_MS + 1500, "round %d: the client's destroy took %lld ms",
                  rounds, (long long)took);
        rounds++;
    }
    fprintf(stderr,
            "close while the peer closes: %d rounds, slowest destroy %lld ms, %d given up\n",
            rounds, (long long)worst, slow);
}

/* td_ctrl_teardown_bounded: a teardown that returns is waited for; one that hangs is given
 * up after TD_CTRL_TEARDOWN_MS, later ones after TD_CTRL_TEARDOWN_STUCK_MS. In a process of
 * its own (test_ctrl --teardown): the "stuck" mark is for the rest of the process. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool release;
    atomic_int ran, finished;
} gate;

static void gate_fn(void *arg)
{
    gate *g = arg;
    atomic_fetch_add(&g->ran, 1);
    pthread_mutex_lock(&g->mu);
    while (!g->release)
        pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
    atomic_fetch_add(&g->finished, 1);
}

static void test_teardown_bounded(void)
{
    gate g = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .release = true};
    int64_t t0 = td_now_ms();
    TH_CHECK(td_ctrl_teardown_bounded(gate_fn, &g, "quick"));
    TH_CHECK(atomic_load(&g.finished) == 1 && td_now_ms() - t0 < 500);

    g.release = false;
    t0 = td_now_ms();
    TH_CHECK(!td_ctrl_teardown_bounded(gate_fn, &g, "hanging"));
    int64_t took = td_now_ms() - t0;
    TH_CHECKF(took >= TD_CTRL_TEARDOWN_MS - 5 && took < TD_CTRL_TEARDOWN_MS + 1000, "%lld ms",
              (long long)took);
    t0 = td_now_ms(); /* NNG stuck: the next ones wait less */
    TH_CHECK(!td_ctrl_teardown_bounded(gate_fn, &g, "hanging too"));
    took = td_now_ms() - t0;
    TH_CHECKF(took >= TD_CTRL_TEARDOWN_STUCK_MS - 5 && took < TD_CTRL_TEARDOWN_MS, "%lld ms",
              (long long)took);
    TH_CHECK(atomic_load(&g.ran) == 3 && atomic_load(&g.finished) == 1);

    pthread_mutex_lock(&g.mu); /* the given-up teardowns still end when they can */
    g.release = true;
    pthread_cond_broadcast(&g.cv);
    pthread_mutex_unlock(&g.mu);
    int64_t until = td_now_ms() + 3000;
    while (atomic_load(&g.finished) < 3 && td_now_ms() < until)
        usleep(1000);
    TH_CHECK(atomic_load(&g.finished) == 3);
    TH_CHECK(td_ctrl_teardown_bounded(gate_fn, &g, "quick again"));
    usleep(20000); /* the detached threads drop their last reference */
}

int main(int argc, char **argv)
{
    td_log_set_level(TD_LOG_ERROR);
    if (argc == 3 && !strcmp(argv[1], "--seeds")) { /* fuzz seeds: the codec tests only */
        seed_dir = argv[2];
        TH_RUN(test_roundtrip_requests);
        TH_RUN(test_roundtrip_replies);
        TH_EXIT();
    }
    if (argc == 3 && !strcmp(argv[1], "--node")) /* test_absent_and_reconnect's server */
        return node_process(argv[2]);
    if (argc == 2 && !strcmp(argv[1], "--teardown")) { /* its own process: it marks NNG stuck */
        TH_RUN(test_teardown_bounded);
        TH_EXIT();
    }
    TH_RUN(test_roundtrip_requests);
    TH_RUN(test_roundtrip_replies);
    TH_RUN(test_sampling_lists);
    TH_RUN(test_decode_rejects);
    /* first of the tests with sockets: a close that NNG 1.5.2 hangs stops every reconnect
       of this process from then on (ctrl_internal.h), and this one needs them */
    TH_RUN(test_absent_and_reconnect);
    TH_RUN(test_exchange_ipc);
    TH_RUN(test_exchange_tcp);
    TH_RUN(test_burst);
    TH_RUN(test_close_while_peer_closes);
    TH_EXIT();
}
