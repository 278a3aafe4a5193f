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
 *            --ignore-eos (generate max tokens whatever the model says)
 * Exit status 0 when every request finished (stop, length or the asked-for cancel), 1 on
 * error events, refusals or timeouts (the reason goes to stderr).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "ctrl.h"
#include "td_err.h"

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
    if (r->n_out + (int)n > r->cap_out) {
        int cap = r->cap_out ? r->cap_out * 2 : 64;
        while (cap < r->n_out + (int)n)
            cap *= 2;
        int32_t *o = realloc(r->out, (size_t)cap * sizeof *o);
        if (!o) return;
        r->out = o;
        r->cap_out = cap;
    }
    memcpy(r->out + r->n_out, ids, n * sizeof *ids);
    r->n_out += (int)n;
}

int cmd_client(int argc, char **argv)
{
    const char *url = NULL, *ids = NULL, *file = NULL;
    int max_tokens = 16, timeout_ms = 120000, cancel_after = -1, rc = 0, top_k = 0;
    float temperature = 0, top_p = 0, min_p = 0;
    uint64_t seed = 0;
    bool garbage = false, health = false, ids_only = false, stats = false, ignore_eos = false;
    for (int i = 0; i < argc && !rc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool flag = true;
        if (!strcmp(f, "--garbage"))
            garbage = true;
        else if (!strcmp(f, "--health"))
            health = true;
        else if (!strcmp(f, "--ids-only"))
            ids_only = true;
        else if (!strcmp(f, "--stats"))
            stats = true;
        else if (!strcmp(f, "--ignore-eos"))
            ignore_eos = true;
        else
            flag = false;
        if (flag) continue;
        if (!v) {
            fprintf(stderr, "tandem: %s needs a value\n", f);
            return TD_EINVAL;
        }
        i++;
        if (!strcmp(f, "--url"))
            url = v;
        else if (!strcmp(f, "--prompt-ids"))
            ids = v;
        else if (!strcmp(f, "--requests"))
            file = v;
        else if (!strcmp(f, "--max-tokens"))
            rc = cli_parse_int(f, v, 1, 1 << 24, &max_tokens);
        else if (!strcmp(f, "--timeout-ms"))
            rc = cli_parse_int(f, v, 1, 1 << 30, &timeout_ms);
        else if (!strcmp(f, "--cancel-after"))
            rc = cli_parse_int(f, v, 0, 1 << 24, &cancel_after);
        else if (!strcmp(f, "--temperature"))
            rc = cli_parse_float(f, v, &temperature);
        else if (!strcmp(f, "--top-p"))
            rc = cli_parse_float(f, v, &top_p);
        else if (!strcmp(f, "--min-p"))
            rc = cli_parse_float(f, v, &min_p);
        else if (!strcmp(f, "--top-k"))
            rc = cli_parse_int(f, v, 0, 1 << 30, &top_k);
        else if (!strcmp(f, "--seed"))
            rc = cli_parse_u64(f, v, &seed);
        else {
            fprintf(stderr, "tandem: client: unknown option '%s'\n", f);
            return TD_EINVAL;
        }
    }
    if (rc) return rc;
    if (!url || (!health && !!ids == !!file)) {
        fprintf(stderr, "usage: tandem client --url URL (--prompt-ids IDS | --requests FILE | "
                        "--health) [--max-tokens N] [--temperature T] [--seed S] [--top-k K]\n"
                        "       [--timeout-ms MS] [--cancel-after N] [--garbage] [--ids-only]\n");
        return TD_EINVAL;
    }
    creq *reqs = calloc(MAX_REQS, sizeof *reqs);
    if (!reqs) return TD_ENOMEM;
    int n = 0;
    if (file)
        rc = read_requests(file, reqs, &n);
    else if (ids) {
        rc = cli_parse_ids(ids, &reqs[0].prompt, &reqs[0].n_prompt);
        reqs[0].max_tokens = max_tokens;
        reqs[0].temperature = temperature;
        reqs[0].seed = seed;
        n = 1;
    }
    td_ctrl_client *c = NULL;
    td_ctrl_opts opts = {0};
    if (!rc) rc = td_ctrl_client_create(url, &opts, &c);
    int64_t deadline = td_ctrl_now_ms() + timeout_ms;
    td_ctrl_client_in in = {0};
    uint64_t call;
    if (!rc && health) {
        Td__Envelope *env = NULL;
        if (!(rc = td_ctrl_client_health(c, 5000, &call))) {
            int err;
            while (td_ctrl_now_ms() < deadline) {
                if (td_ctrl_client_recv(c, &in, 200)) continue;
                if (in.kind == TD_CTRL_IN_REPLY && in.call_id == call) break;
            }
            err = in.kind == TD_CTRL_IN_REPLY ? in.err : TD_ETIMEDOUT;
            env = err ? NULL : in.env;
            if (env && env->body_case == TD__ENVELOPE__BODY_HEALTH) {
                Td__Health *h = env->health;
                printf("instance %s rank %u ready %d running %u waiting %u kv_used %u kv_free %u\n",
                       h->instance, h->rank, h->ready, h->running, h->waiting, h->kv_blocks_used,
                       h->kv_blocks_free);
            } else {
                fprintf(stderr, "tandem: no health reply: %s\n", td_strerror(err ? err : TD_EIO));
                rc = err ? err : TD_EIO;
            }
        }
        n = 0;
    }
    (void)n;
    if (!rc && garbage) {
        static const uint8_t junk[] = {0xff, 0x01, 0x02, 0x03, 0x7f, 0x00, 0x13, 0x37};
        rc = td_ctrl_client_call_raw(c, junk, sizeof junk, 5000, &call);
        int err = TD_ETIMEDOUT;
        Td__Envelope *env = NULL;
        while (!rc && td_ctrl_now_ms() < deadline) {
            if (td_ctrl_client_recv(c, &in, 200)) continue;
            if (in.kind == TD_CTRL_IN_REPLY && in.call_id == call) {
                err = in.err;
                env = in.env;
                break;
            }
        }
        if (!rc && (err || !env || env->body_case != TD__ENVELOPE__BODY_ERROR)) {
            fprintf(stderr, "tandem: garbage was not answered with an error (%s)\n",
                    td_strerror(err));
            rc = TD_EIO;
        } else if (!rc) {
            fprintf(stderr, "tandem: garbage answered: %s: %s\n",
                    td_ctrl_err_name(env->error->code), env->error->message);
        }
    }
    /* submit every request, then collect events until all finished */
    int outstanding = 0;
    uint64_t *calls = calloc((size_t)(n ? n : 1), sizeof *calls);
    for (int i = 0; i < n && !rc; i++) {
        Td__Submit sub = TD__SUBMIT__INIT;
        Td__Sampling sm = TD__SAMPLING__INIT;
        sm.temperature = reqs[i].temperature;
        sm.seed = reqs[i].seed;
        sm.top_k = top_k;
        sm.top_p = top_p;
        sm.min_p = min_p;
        sub.request_id = (uint64_t)i + 1;
        sub.token_ids = reqs[i].prompt;
        sub.n_token_ids = (size_t)reqs[i].n_prompt;
        sub.sampling = &sm;
        sub.max_tokens = (uint32_t)reqs[i].max_tokens;
        sub.ignore_eos = ignore_eos;
        rc = td_ctrl_client_submit(c, &sub, 10000, &calls[i]);
        reqs[i].t_submit = td_ctrl_now_ms();
        outstanding++;
    }
    int finished = 0, failures = 0;
    while (!rc && finished < n) {
        if (td_ctrl_now_ms() >= deadline) {
            fprintf(stderr, "tandem: timed out with %d of %d requests unfinished\n", n - finished,
                    n);
            rc = TD_ETIMEDOUT;
            break;
        }
        if (td_ctrl_client_recv(c, &in, 200)) continue;
        if (in.kind == TD_CTRL_IN_REPLY) {
            int i = -1;
            for (int k = 0; k < n; k++)
                if (calls[k] == in.call_id) i = k;
            if (i < 0) continue; /* a cancel's ack */
            if (in.err || (in.env && in.env->body_case == TD__ENVELOPE__BODY_ERROR)) {
                const char *msg = in.err ? td_strerror(in.err) : in.env->error->message;
                snprintf(reqs[i].err, sizeof reqs[i].err, "%s", msg);
                fprintf(stderr, "tandem: request %d refused: %s\n", i + 1, msg);
                if (!reqs[i].done) {
                    reqs[i].done = true;
                    reqs[i].finish = TD__FINISH_REASON__FINISH_ERROR;
                    finished++;
                    failures++;
                }
            }
            continue;
        }
        if (in.kind != TD_CTRL_IN_EVENTS) continue;
        for (size_t e = 0; e < in.n_events; e++) {
            const Td__Event *ev = in.events[e];
            if (ev->body_case == TD__EVENT__BODY_ERROR) {
                fprintf(stderr, "tandem: error event for request %llu: %s: %s\n",
                        (unsigned long long)ev->error->request_id,
                        td_ctrl_err_name(ev->error->code), ev->error->message);
                continue;
            }
            if (ev->body_case != TD__EVENT__BODY_TOKEN) continue;
            const Td__TokenEvent *t = ev->token;
            if (t->request_id < 1 || t->request_id > (uint64_t)n) continue;
            creq *r = &reqs[t->request_id - 1];
            if (r->done) continue;
            if (t->n_token_ids) {
                int64_t now = td_ctrl_now_ms();
                if (!r->t_first)
                    r->t_first = now;
                else if ((double)(now - r->t_last) > r->gap_max)
                    r->gap_max = (double)(now - r->t_last);
                r->t_last = now;
            }
            append(r, t->token_ids, t->n_token_ids);
            if (cancel_after >= 0 && r->n_out >= cancel_after && !r->cancel_sent &&
                t->finish == TD__FINISH_REASON__FINISH_NONE) {
                uint64_t cc;
                td_ctrl_client_cancel(c, t->request_id, 10000, &cc);
                r->cancel_sent = true;
            }
            if (t->finish != TD__FINISH_REASON__FINISH_NONE) {
                r->done = true;
                r->finish = t->finish;
                finished++;
                if (t->finish == TD__FINISH_REASON__FINISH_ERROR) failures++;
            }
        }
    }
    (void)outstanding;
    for (int i = 0; i < n; i++) {
        if (ids_only && n == 1) {
            for (int k = 0; k < reqs[i].n_out; k++)
                printf(k ? " %d" : "%d", reqs[i].out[k]);
            printf("\n");
        } else {
            printf("%s", reqs[i].done ? finish_name(reqs[i].finish) : "unfinished");
            for (int k = 0; k < reqs[i].n_out; k++)
                printf(" %d", reqs[i].out[k]);
            printf("\n");
        }
    }
    if (stats && n > 0) {
        /* throughput over the whole run; per request: time to first token and the mean
         * time per output token after it */
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
    fflush(stdout);
    td_ctrl_client_in_free(&in);
    td_ctrl_client_destroy(c);
    for (int i = 0; i < MAX_REQS; i++) {
        free(reqs[i].prompt);
        free(reqs[i].out);
    }
    free(reqs);
    free(calls);
    if (!rc && failures) rc = TD_EIO;
    return rc;
}
