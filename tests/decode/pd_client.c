/* pd_client.c: the router's part in the disaggregated decode tests: send one Alloc (or,
 * with --submit, a colocated Submit) to a decode leader, print the KV targets it answers,
 * then collect the request's token stream.
 *
 *   pd_client --url URL --prompt-ids IDS [--max-tokens N] [--stages S] [--request-id R]
 *             [--temperature T] [--top-k K] [--top-p P] [--min-p P] [--seed S]
 *             [--ignore-eos] [--submit] [--cancel-after-ms MS] [--timeout-ms MS]
 *
 * Output lines (stdout, flushed at once):
 *   TARGETS <n> <hex> ...       the AllocReply (not with --submit)
 *   REFUSED <CODE> <message>    an error reply to the Alloc/Submit (exit status 2)
 *   ERROR <CODE> <message>      an error event of the request
 *   <finish> <id> <id> ...      at the end: stop | length | cancelled | error | unfinished
 * --cancel-after-ms cancels the request that long after the reply; SIGUSR1 cancels it at
 * once (a test script that knows when the transfer is under way). Exit status 0 when the
 * request finished with stop, length or the asked-for cancel; 1 otherwise.
 */
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctrl.h"
#include "pd_util.h"
#include "td_clock.h"
#include "td_err.h"

static volatile sig_atomic_t g_cancel;

static void on_usr1(int sig)
{
    (void)sig;
    g_cancel = 1;
}

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
        return "unfinished";
    }
}

int main(int argc, char **argv)
{
    const char *url = NULL, *ids_s = NULL;
    int max_tokens = 16, stages = 1, cancel_after_ms = -1, timeout_ms = 120000;
    uint64_t rid = 1;
    bool submit = false, ignore_eos = false;
    Td__Sampling sm = TD__SAMPLING__INIT;
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(f, "--submit")) {
            submit = true;
            continue;
        }
        if (!strcmp(f, "--ignore-eos")) {
            ignore_eos = true;
            continue;
        }
        i++;
        if (!strcmp(f, "--url"))
            url = v;
        else if (!strcmp(f, "--prompt-ids"))
            ids_s = v;
        else if (!strcmp(f, "--max-tokens"))
            max_tokens = atoi(v);
        else if (!strcmp(f, "--stages"))
            stages = atoi(v);
        else if (!strcmp(f, "--request-id"))
            rid = strtoull(v, NULL, 10);
        else if (!strcmp(f, "--cancel-after-ms"))
            cancel_after_ms = atoi(v);
        else if (!strcmp(f, "--timeout-ms"))
            timeout_ms = atoi(v);
        else if (!strcmp(f, "--temperature"))
            sm.temperature = strtof(v, NULL);
        else if (!strcmp(f, "--top-k"))
            sm.top_k = atoi(v);
        else if (!strcmp(f, "--top-p"))
            sm.top_p = strtof(v, NULL);
        else if (!strcmp(f, "--min-p"))
            sm.min_p = strtof(v, NULL);
        else if (!strcmp(f, "--seed"))
            sm.seed = strtoull(v, NULL, 10);
        else {
            fprintf(stderr, "pd_client: unknown option %s\n", f);
            return 2;
        }
    }
    if (!url || !ids_s) {
        fprintf(stderr, "usage: pd_client --url URL --prompt-ids IDS [options]\n");
        return 2;
    }
    int n_prompt;
    int32_t *ids = pd_parse_ids(ids_s, &n_prompt);
    struct sigaction sa = {.sa_handler = on_usr1};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, NULL);
    td_ctrl_client *c;
    if (td_ctrl_client_create(url, &(td_ctrl_opts){0}, &c)) return 2;

    Td__Submit sub = TD__SUBMIT__INIT;
    sub.request_id = rid;
    sub.token_ids = ids;
    sub.n_token_ids = (size_t)n_prompt;
    sub.sampling = &sm;
    sub.max_tokens = (uint32_t)max_tokens;
    sub.ignore_eos = ignore_eos;
    Td__Alloc al = TD__ALLOC__INIT;
    al.request = &sub;
    al.n_stages = (uint32_t)stages;
    Td__Envelope env = TD__ENVELOPE__INIT;
    if (submit) {
        env.body_case = TD__ENVELOPE__BODY_SUBMIT;
        env.submit = &sub;
    } else {
        env.body_case = TD__ENVELOPE__BODY_ALLOC;
        env.alloc = &al;
    }
    uint64_t call;
    if (td_ctrl_client_call(c, &env, 10000, &call)) return 2;

    int64_t deadline = td_now_ms() + timeout_ms, cancel_at = -1;
    int32_t *out = malloc((size_t)(max_tokens + 1) * sizeof *out);
    int n_out = 0, status = 1;
    bool done = false, cancel_sent = false;
    Td__FinishReason finish = TD__FINISH_REASON__FINISH_NONE;
    td_ctrl_client_in in = {0};
    while (!done && td_now_ms() < deadline) {
        if (g_cancel && cancel_at < 0) cancel_at = 0;
        if (cancel_at >= 0 && !cancel_sent && td_now_ms() >= cancel_at) {
            uint64_t cc;
            td_ctrl_client_cancel(c, rid, 10000, &cc);
            cancel_sent = true;
        }
        if (td_ctrl_client_recv(c, &in, 20)) continue;
        if (in.kind == TD_CTRL_IN_REPLY && in.call_id == call) {
            if (in.err || !in.env) {
                printf("REFUSED TIMEOUT %s\n", td_strerror(in.err));
                status = 2;
                break;
            }
            if (in.env->body_case == TD__ENVELOPE__BODY_ERROR) {
                printf("REFUSED %s %s\n", td_ctrl_err_name(in.env->error->code),
                       in.env->error->message);
                status = 2;
                break;
            }
            if (in.env->body_case == TD__ENVELOPE__BODY_ALLOC_REPLY) {
                const Td__AllocReply *ar = in.env->alloc_reply;
                printf("TARGETS %zu", ar->n_kv_targets);
                for (size_t t = 0; t < ar->n_kv_targets; t++) {
                    putchar(' ');
                    pd_hex_print(stdout, ar->kv_targets[t].data, ar->kv_targets[t].len);
                }
                printf("\n");
                fflush(stdout);
            }
            if (cancel_after_ms >= 0) cancel_at = td_now_ms() + cancel_after_ms;
            continue;
        }
        if (in.kind != TD_CTRL_IN_EVENTS) continue;
        for (size_t e = 0; e < in.n_events && !done; e++) {
            const Td__Event *ev = in.events[e];
            if (ev->body_case == TD__EVENT__BODY_ERROR && ev->error->request_id == rid) {
                printf("ERROR %s %s\n", td_ctrl_err_name(ev->error->code), ev->error->message);
                fflush(stdout);
                continue;
            }
            if (ev->body_case != TD__EVENT__BODY_TOKEN || ev->token->request_id != rid) continue;
            const Td__TokenEvent *t = ev->token;
            for (size_t k = 0; k < t->n_token_ids && n_out <= max_tokens; k++)
                out[n_out++] = t->token_ids[k];
            if (t->finish != TD__FINISH_REASON__FINISH_NONE) {
                finish = t->finish;
                done = true;
            }
        }
    }
    if (status != 2) {
        printf("%s", finish_name(finish));
        for (int k = 0; k < n_out; k++)
            printf(" %d", out[k]);
        printf("\n");
        status = finish == TD__FINISH_REASON__FINISH_STOP ||
                         finish == TD__FINISH_REASON__FINISH_LENGTH ||
                         (finish == TD__FINISH_REASON__FINISH_CANCELLED && cancel_sent)
                     ? 0
                     : 1;
    }
    fflush(stdout);
    td_ctrl_client_in_free(&in);
    td_ctrl_client_destroy(c);
    free(out);
    free(ids);
    return status;
}
