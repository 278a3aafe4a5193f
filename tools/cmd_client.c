/* cmd_client.c: `tandem client`: the test client of the control plane. Submits requests
 * to an instance leader, collects the streamed tokens and prints, per request in input
 * order, "<finish> <id> <id> ..." (or just the ids with --ids-only for one request).
 *
 *   tandem client --url URL --prompt-ids IDS [--max-tokens N] [sampling] [--ids-only]
 *   tandem client --url URL --requests FILE     one request per line:
 *                                               MAX_TOKENS TEMPERATURE SEED ID,ID,...
 *   options: --timeout-ms MS (whole run; default 120000), --cancel-after N (cancel each
 *            request after N tokens), --garbage (first send bytes that are not a message
 *            and expect an error reply), --health (print the leader's load and exit),
 *            --stats (a last line with throughput, time to first token, time per token),
 *            --ignore-eos (generate max tokens whatever the model says),
 *            --tls-ca FILE [--tls-cert FILE --tls-key FILE] (a tcp:// URL is dialled as
 *            tls+tcp:// with these PEM files: the cluster YAML's security section; without
 *            a certificate the server refuses the connection, which is what tests check)
 * Exit status 0 when every request finished (stop, length or the asked-for cancel), 1 on
 * error events, refusals or timeouts (the reason goes to stderr).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "ctrl.h"
#include "td_clock.h"
#include "td_err.h"
#include "td_grow.h"

#define MAX_REQS 1024

typedef struct {
    int32_t *prompt;
    int64_t n_prompt;
    int max_tokens;
    float temperature;
    uint64_t seed;
    int32_t *out;
    int n_out, cap_out;
    Td__FinishReason finish;
    bool done, cancel_sent;
    int64_t t_submit, t_first, t_last; /* ms: submit, first token, last token */
    double gap_max;                    /* ms: longest pause between two tokens */
    char err[256];
} creq;

static const char *finish_name(Td__FinishReason f)
{
    switch (f) {
    case TD__FINISH_REASON__FINISH_STOP:
        return "stop";
    case TD__FINISH_REASON__FINISH_LENGTH:
        return "length";
    case TD__FINISH_REASON__FINISH_CANCELLED:
        return "cancelled";
    case TD__FINISH_REASON__FINISH_ERROR:
        return "error";
    default:
        return "none";
    }
}

static int read_requests(const char *path, creq *reqs, int *n)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "tandem: cannot read '%s'\n", path);
        return TD_EIO;
    }
    char line[65536];
    int rc = 0;
    *n = 0;
    while (fgets(line, sizeof line, f) && !rc) {
        if (line[0] == '\n' || line[0] == '#') continue;
        if (*n == MAX_REQS) {
            rc = TD_ERANGE;
            break;
        }
        creq *r = &reqs[*n];
        char ids[65536];
        unsigned long long seed;
        if (sscanf(line, "%d %f %llu %65535s", &r->max_tokens, &r->temperature, &seed, ids) != 4) {
            fprintf(stderr, "tandem: bad request line %d in '%s'\n", *n + 1, path);
            rc = TD_EINVAL;
            break;
        }
        r->seed = seed;
        rc = cli_parse_ids(ids, &r->prompt, &r->n_prompt);
        if (!rc) (*n)++;
    }
    fclose(f);
    return rc;
}

static void append(creq *r, const int32_t *ids, size_t n)
{
    if (n == 0) return; /* a final event may carry no tokens (and a NULL array) */
    if (TD_GROW_INT(r->out, r->cap_out, r->n_out + (int)n, 64)) return;
    memcpy(r->out + r->n_out, ids, n * sizeof *ids);
    r->n_out += (int)n;
}

/* The command line. */
typedef struct {
    const char *url, *ids, *file;
    const char *tls_ca, *tls_cert, *tls_key;
    int max_tokens, timeout_ms, cancel_after, top_k;
    float temperature, top_p, min_p;
    uint64_t seed;
    bool garbage, health, ids_only, stats, ignore_eos;
} client_opts;

/* One run: the requests, the connection and the progress of the event loop. */
typedef struct {
    const client_opts *o;
    td_ctrl_client *c;
    creq *reqs; /* (MAX_REQS), n used */
    int n;
    uint64_t *calls;        /* (n) the Submit call of each request */
    td_ctrl_client_in in;   /* the last message received */
    int64_t deadline;       /* ms: the whole run */
    int finished, failures; /* requests done, requests failed */
} client_run;

static int client_parse_args(int argc, char **argv, client_opts *o)
{
    *o = (client_opts){.max_tokens = 16, .timeout_ms = 120000, .cancel_after = -1};
    int rc = 0;
    for (int i = 0; i < argc && !rc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool flag = true;
        if (!strcmp(f, "--garbage"))
            o->garbage = true;
        else if (!strcmp(f, "--health"))
            o->health = true;
        else if (!strcmp(f, "--ids-only"))
            o->ids_only = true;
        else if (!strcmp(f, "--stats"))
            o->stats = true;
        else if (!strcmp(f, "--ignore-eos"))
            o->ignore_eos = true;
        else
            flag = false;
        if (flag) continue;
        if (!v) {
            fprintf(stderr, "tandem: %s needs a value\n", f);
            return TD_EINVAL;
        }
        i++;
        if (!strcmp(f, "--url"))
            o->url = v;
        else if (!strcmp(f, "--prompt-ids"))
            o->ids = v;
        else if (!strcmp(f, "--requests"))
            o->file = v;
        else if (!strcmp(f, "--tls-ca"))
            o->tls_ca = v;
        else if (!strcmp(f, "--tls-cert"))
            o->tls_cert = v;
        else if (!strcmp(f, "--tls-key"))
            o->tls_key = v;
        else if (!strcmp(f, "--max-tokens"))
            rc = cli_parse_int(f, v, 1, 1 << 24, &o->max_tokens);
        else if (!strcmp(f, "--timeout-ms"))
            rc = cli_parse_int(f, v, 1, 1 << 30, &o->timeout_ms);
        else if (!strcmp(f, "--cancel-after"))
            rc = cli_parse_int(f, v, 0, 1 << 24, &o->cancel_after);
        else if (!strcmp(f, "--temperature"))
            rc = cli_parse_float(f, v, &o->temperature);
        else if (!strcmp(f, "--top-p"))
            rc = cli_parse_float(f, v, &o->top_p);
        else if (!strcmp(f, "--min-p"))
            rc = cli_parse_float(f, v, &o->min_p);
        else if (!strcmp(f, "--top-k"))
            rc = cli_parse_int(f, v, 0, 1 << 30, &o->top_k);
        else if (!strcmp(f, "--seed"))
            rc = cli_parse_u64(f, v, &o->seed);
        else {
            fprintf(stderr, "tandem: client: unknown option '%s'\n", f);
            return TD_EINVAL;
        }
    }
    if (rc) return rc;
    if (!o->tls_cert != !o->tls_key || (o->tls_cert && !o->tls_ca)) {
        fprintf(stderr, "tandem: client: --tls-cert and --tls-key go together, with --tls-ca\n");
        return TD_EINVAL;
    }
    if (!o->url || (!o->health && !!o->ids == !!o->file)) {
        fprintf(stderr, "usage: tandem client --url URL (--prompt-ids IDS | --requests FILE | "
                        "--health) [--max-tokens N] [--temperature T] [--seed S] [--top-k K]\n"
                        "       [--timeout-ms MS] [--cancel-after N] [--garbage] [--ids-only]\n"
                        "       [--tls-ca FILE [--tls-cert FILE --tls-key FILE]]\n");
        return TD_EINVAL;
    }
    return 0;
}

/* The requests of --requests FILE or the one of --prompt-ids into r->reqs. */
static int client_load(client_run *r)
{
    const client_opts *o = r->o;
    if (o->file) return read_requests(o->file, r->reqs, &r->n);
    if (!o->ids) return 0;
    creq *q = &r->reqs[0];
    int rc = cli_parse_ids(o->ids, &q->prompt, &q->n_prompt);
    q->max_tokens = o->max_tokens;
    q->temperature = o->temperature;
    q->seed = o->seed;
    r->n = 1;
    return rc;
}

/* --health: asks the leader's load and prints it. */
static int client_health(client_run *r)
{
    uint64_t call;
    int rc = td_ctrl_client_health(r->c, 5000, &call);
    if (rc) return rc;
    while (td_now_ms() < r->deadline) {
        if (td_ctrl_client_recv(r->c, &r->in, 200)) continue;
        if (r->in.kind == TD_CTRL_IN_REPLY && r->in.call_id == call) break;
    }
    int err = r->in.kind == TD_CTRL_IN_REPLY ? r->in.err : TD_ETIMEDOUT;
    Td__Envelope *env = err ? NULL : r->in.env;
    if (env && env->body_case == TD__ENVELOPE__BODY_HEALTH) {
        Td__Health *h = env->health;
        printf("instance %s rank %u ready %d running %u waiting %u kv_used %u kv_free %u\n",
               h->instance, h->rank, h->ready, h->running, h->waiting, h->kv_blocks_used,
               h->kv_blocks_free);
        for (size_t s = 0; s < h->n_prefix_cache_hit_tokens; s++)
            printf("prefix_cache_hit_tokens_s%zu %llu prefix_cache_evicted_blocks_s%zu %llu\n", s,
                   (unsigned long long)h->prefix_cache_hit_tokens[s], s,
                   s < h->n_prefix_cache_evicted_blocks
                       ? (unsigned long long)h->prefix_cache_evicted_blocks[s]
                       : 0ull);
        static const char *const tier[] = {"writes", "reads", "hit_tokens", "errors"};
        for (size_t k = 0; k < h->n_prefix_tier && k < 4; k++)
            printf("prefix_tier_%s %llu\n", tier[k], (unsigned long long)h->prefix_tier[k]);
        return 0;
    }
    fprintf(stderr, "tandem: no health reply: %s\n", td_strerror(err ? err : TD_EIO));
    return err ? err : TD_EIO;
}

/* --garbage: bytes that are not a message must be answered with an error reply. */
static int client_garbage(client_run *r)
{
    static const uint8_t junk[] = {0xff, 0x01, 0x02, 0x03, 0x7f, 0x00, 0x13, 0x37};
    uint64_t call;
    int rc = td_ctrl_client_call_raw(r->c, junk, sizeof junk, 5000, &call);
    int err = TD_ETIMEDOUT;
    Td__Envelope *env = NULL;
    while (!rc && td_now_ms() < r->deadline) {
        if (td_ctrl_client_recv(r->c, &r->in, 200)) continue;
        if (r->in.kind == TD_CTRL_IN_REPLY && r->in.call_id == call) {
            err = r->in.err;
            env = r->in.env;
            break;
        }
    }
    if (rc) return rc;
    if (err || !env || env->body_case != TD__ENVELOPE__BODY_ERROR) {
        fprintf(stderr, "tandem: garbage was not answered with an error (%s)\n", td_strerror(err));
        return TD_EIO;
    }
    fprintf(stderr, "tandem: garbage answered: %s: %s\n", td_ctrl_err_name(env->error->code),
            env->error->message);
    return 0;
}

/* Submits every request (request id = index + 1). */
static int client_submit(client_run *r)
{
    const client_opts *o = r->o;
    int rc = 0;
    for (int i = 0; i < r->n && !rc; i++) {
        creq *q = &r->reqs[i];
        Td__Submit sub = TD__SUBMIT__INIT;
        Td__Sampling sm = TD__SAMPLING__INIT;
        sm.temperature = q->temperature;
        sm.seed = q->seed;
        sm.top_k = o->top_k;
        sm.top_p = o->top_p;
        sm.min_p = o->min_p;
        sub.request_id = (uint64_t)i + 1;
        sub.token_ids = q->prompt;
        sub.n_token_ids = (size_t)q->n_prompt;
        sub.sampling = &sm;
        sub.max_tokens = (uint32_t)q->max_tokens;
        sub.ignore_eos = o->ignore_eos;
        rc = td_ctrl_client_submit(r->c, &sub, 10000, &r->calls[i]);
        q->t_submit = td_now_ms();
    }
    return rc;
}

/* A reply: a refused Submit finishes its request with an error (a cancel's ack is
 * ignored). */
static void client_on_reply(client_run *r)
{
    const td_ctrl_client_in *in = &r->in;
    int i = -1;
    for (int k = 0; k < r->n; k++)
        if (r->calls[k] == in->call_id) i = k;
    if (i < 0) return; /* a cancel's ack */
    if (!in->err && !(in->env && in->env->body_case == TD__ENVELOPE__BODY_ERROR)) return;
    creq *q = &r->reqs[i];
    const char *msg = in->err ? td_strerror(in->err) : in->env->error->message;
    snprintf(q->err, sizeof q->err, "%s", msg);
    fprintf(stderr, "tandem: request %d refused: %s\n", i + 1, msg);
    if (!q->done) {
        q->done = true;
        q->finish = TD__FINISH_REASON__FINISH_ERROR;
        r->finished++;
        r->failures++;
    }
}

/* One token event: its tokens and times, --cancel-after, the finish. */
static void client_on_token(client_run *r, const Td__TokenEvent *t)
{
    if (t->request_id < 1 || t->request_id > (uint64_t)r->n) return;
    creq *q = &r->reqs[t->request_id - 1];
    if (q->done) return;
    if (t->n_token_ids) {
        int64_t now = td_now_ms();
        if (!q->t_first)
            q->t_first = now;
        else if ((double)(now - q->t_last) > q->gap_max)
            q->gap_max = (double)(now - q->t_last);
        q->t_last = now;
    }
    append(q, t->token_ids, t->n_token_ids);
    int cancel_after = r->o->cancel_after;
    if (cancel_after >= 0 && q->n_out >= cancel_after && !q->cancel_sent &&
        t->finish == TD__FINISH_REASON__FINISH_NONE) {
        uint64_t cc;
        td_ctrl_client_cancel(r->c, t->request_id, 10000, &cc);
        q->cancel_sent = true;
    }
    if (t->finish != TD__FINISH_REASON__FINISH_NONE) {
        q->done = true;
        q->finish = t->finish;
        r->finished++;
        if (t->finish == TD__FINISH_REASON__FINISH_ERROR) r->failures++;
    }
}

/* Collects replies and events until every request finished or the deadline passed. */
static int client_collect(client_run *r)
{
    while (r->finished < r->n) {
        if (td_now_ms() >= r->deadline) {
            fprintf(stderr, "tandem: timed out with %d of %d requests unfinished\n",
                    r->n - r->finished, r->n);
            return TD_ETIMEDOUT;
        }
        if (td_ctrl_client_recv(r->c, &r->in, 200)) continue;
        if (r->in.kind == TD_CTRL_IN_REPLY) {
            client_on_reply(r);
            continue;
        }
        if (r->in.kind != TD_CTRL_IN_EVENTS) continue;
        for (size_t e = 0; e < r->in.n_events; e++) {
            const Td__Event *ev = r->in.events[e];
            if (ev->body_case == TD__EVENT__BODY_ERROR) {
                fprintf(stderr, "tandem: error event for request %llu: %s: %s\n",
                        (unsigned long long)ev->error->request_id,
                        td_ctrl_err_name(ev->error->code), ev->error->message);
                continue;
            }
            if (ev->body_case == TD__EVENT__BODY_TOKEN) client_on_token(r, ev->token);
        }
    }
    return 0;
}

/* Per request in input order: "<finish> <id> ..." (or the ids alone, --ids-only). */
static void client_print(const client_run *r)
{
    for (int i = 0; i < r->n; i++) {
        const creq *q = &r->reqs[i];
        if (r->o->ids_only && r->n == 1) {
            for (int k = 0; k < q->n_out; k++)
                printf(k ? " %d" : "%d", q->out[k]);
            printf("\n");
        } else {
            printf("%s", q->done ? finish_name(q->finish) : "unfinished");
            for (int k = 0; k < q->n_out; k++)
                printf(" %d", q->out[k]);
            printf("\n");
        }
    }
}

/* --stats: throughput over the whole run; per request: time to first token and the mean
 * time per output token after it. */
static void client_print_stats(const client_run *r)
{
    const creq *reqs = r->reqs;
    int n = r->n;
    int64_t t0 = reqs[0].t_submit, t1 = 0, tokens = 0;
    double ttft = 0, tpot = 0, gap = 0;
    int n_tpot = 0;
    for (int i = 0; i < n; i++) {
        tokens += reqs[i].n_out;
        if (reqs[i].t_last > t1) t1 = reqs[i].t_last;
        if (reqs[i].t_first) ttft += (double)(reqs[i].t_first - reqs[i].t_submit);
        if (reqs[i].n_out > 1) {
            tpot += (double)(reqs[i].t_last - reqs[i].t_first) / (reqs[i].n_out - 1);
            n_tpot++;
        }
        if (reqs[i].gap_max > gap) gap = reqs[i].gap_max;
    }
    double secs = (double)(t1 - t0) / 1000.0;
    printf("stats: requests %d tokens %lld seconds %.3f tok_per_s %.1f ttft_ms %.1f "
           "tpot_ms %.2f max_gap_ms %.1f\n",
           n, (long long)tokens, secs, secs > 0 ? (double)tokens / secs : 0.0, ttft / n,
           n_tpot ? tpot / n_tpot : 0.0, gap);
}

int cmd_client(int argc, char **argv)
{
    client_opts o;
    int rc = client_parse_args(argc, argv, &o);
    if (rc) return rc;
    client_run r = {.o = &o};
    r.reqs = calloc(MAX_REQS, sizeof *r.reqs);
    if (!r.reqs) return TD_ENOMEM;
    rc = client_load(&r);
    td_cfg_security sec = {(char *)o.tls_ca, (char *)o.tls_cert, (char *)o.tls_key};
    td_ctrl_opts opts = {.security = &sec};
    if (!rc) rc = td_ctrl_client_create(o.url, &opts, &r.c);
    r.deadline = td_now_ms() + o.timeout_ms;
    if (!rc && o.health) {
        rc = client_health(&r);
        r.n = 0; /* --health submits nothing */
    }
    if (!rc && o.garbage) rc = client_garbage(&r);
    /* submit every request, then collect events until all finished */
    r.calls = calloc((size_t)(r.n ? r.n : 1), sizeof *r.calls);
    if (!rc && !r.calls) rc = TD_ENOMEM;
    if (!rc) rc = client_submit(&r);
    if (!rc) rc = client_collect(&r);
    client_print(&r);
    if (o.stats && r.n > 0) client_print_stats(&r);
    fflush(stdout);
    td_ctrl_client_in_free(&r.in);
    td_ctrl_client_destroy(r.c);
    for (int i = 0; i < MAX_REQS; i++) {
        free(r.reqs[i].prompt);
        free(r.reqs[i].out);
    }
    free(r.reqs);
    free(r.calls);
    if (!rc && r.failures) rc = TD_EIO;
    return rc;
}
