/* cmd_generate.c: `tandem generate`: one prompt, one process, tokens streamed to stdout. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "jn_chat.h"
#include "cli.h"
#include "sampler.h"
#include "td_clock.h"
#include "td_err.h"

static void usage(void)
{
    fprintf(
        stderr,
        "usage: tandem generate --model PATH (--prompt TEXT | --chat TEXT | --prompt-ids IDS)\n"
        "         --max-tokens N [--temperature T] [--top-p P] [--top-k K] [--min-p P]\n"
        "         [--repeat-penalty R] [--presence-penalty P] [--frequency-penalty F]\n"
        "         [--seed S] [--ids] [--threads N] [--kv-type f16|f32]\n"
        "         [--ctx N] [--chunk N] [--ignore-eos] [--backend cpu|cuda|cpu-dev] [--tokenize] "
        "[--timing]\n"
        "  --prompt TEXT      raw text, tokenized as llama.cpp does (BOS if the model says so)\n"
        "  --chat TEXT        one user message rendered with the model's chat template\n"
        "  --prompt-ids IDS   token ids, e.g. 1,2,3\n"
        "  --ids              print generated token ids instead of text\n"
        "  --timing           prefill and decode wall times on stderr\n"
        "  --tokenize         print the prompt's token ids and exit (no --max-tokens needed)\n"
        "  --temperature 0    greedy decoding (default 0.8, top-k 40, top-p 0.95, min-p 0.05)\n");
}

typedef struct {
    const char *prompt, *chat, *prompt_ids;
    int max_tokens;
    td_sampling sp;
    bool seed_set, print_ids, ignore_eos, tokenize, timing;
    int chunk;
    cli_session_params sess;
} gen_args;

static int parse_args(int argc, char **argv, gen_args *a)
{
    *a = (gen_args){
        .max_tokens = -1,
        .sp = {.temperature = 0.8f,
               .top_k = 40,
               .top_p = 0.95f,
               .min_p = 0.05f,
               .repeat_penalty = 1.0f},
        .chunk = 512,
        .sess = {.kv_type = TD_F16, .need_tokenizer = true},
    };
    for (int i = 0; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        bool takes = true;
        if (!strcmp(f, "--model"))
            a->sess.model_path = v;
        else if (!strcmp(f, "--prompt"))
            a->prompt = v;
        else if (!strcmp(f, "--chat"))
            a->chat = v;
        else if (!strcmp(f, "--prompt-ids"))
            a->prompt_ids = v;
        else if (!strcmp(f, "--max-tokens"))
            rc = cli_parse_int(f, v, 0, 1 << 24, &a->max_tokens);
        else if (!strcmp(f, "--temperature"))
            rc = cli_parse_float(f, v, &a->sp.temperature);
        else if (!strcmp(f, "--top-p"))
            rc = cli_parse_float(f, v, &a->sp.top_p);
        else if (!strcmp(f, "--top-k"))
            rc = cli_parse_int(f, v, 0, 1 << 30, &a->sp.top_k);
        else if (!strcmp(f, "--min-p"))
            rc = cli_parse_float(f, v, &a->sp.min_p);
        else if (!strcmp(f, "--repeat-penalty"))
            rc = cli_parse_float(f, v, &a->sp.repeat_penalty);
        else if (!strcmp(f, "--presence-penalty"))
            rc = cli_parse_float(f, v, &a->sp.presence_penalty);
        else if (!strcmp(f, "--frequency-penalty"))
            rc = cli_parse_float(f, v, &a->sp.frequency_penalty);
        else if (!strcmp(f, "--seed")) {
            rc = cli_parse_u64(f, v, &a->sp.seed);
            a->seed_set = true;
        } else if (!strcmp(f, "--threads"))
            rc = cli_parse_int(f, v, 1, 256, &a->sess.threads);
        else if (!strcmp(f, "--backend"))
            a->sess.backend = v;
        else if (!strcmp(f, "--kv-type"))
            rc = cli_parse_kv_type(v, &a->sess.kv_type);
        else if (!strcmp(f, "--ctx"))
            rc = cli_parse_int(f, v, 1, 1 << 24, &a->sess.ctx);
        else if (!strcmp(f, "--chunk"))
            rc = cli_parse_int(f, v, 1, 1 << 20, &a->chunk);
        else if (!strcmp(f, "--ids")) {
            a->print_ids = true;
            takes = false;
        } else if (!strcmp(f, "--tokenize")) {
            a->tokenize = true;
            takes = false;
        } else if (!strcmp(f, "--timing")) {
            a->timing = true;
            takes = false;
        } else if (!strcmp(f, "--ignore-eos")) {
            a->ignore_eos = true;
            takes = false;
        } else if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
            usage();
            return 1;
        } else {
            fprintf(stderr, "tandem: unknown option '%s'\n", f);
            usage();
            return TD_EINVAL;
        }
        if (rc) return rc;
        if (takes) {
            if (!v) {
                fprintf(stderr, "tandem: %s needs a value\n", f);
                return TD_EINVAL;
            }
            i++;
        }
    }
    int n_src = !!a->prompt + !!a->chat + !!a->prompt_ids;
    if (a->tokenize && a->max_tokens < 0) a->max_tokens = 0;
    if (!a->sess.model_path || n_src != 1 || a->max_tokens < 0) {
        fprintf(stderr, "tandem: generate needs --model, exactly one of --prompt/--chat/"
                        "--prompt-ids, and --max-tokens\n");
        usage();
        return TD_EINVAL;
    }
    a->sess.need_tokenizer = !a->prompt_ids || !a->print_ids;
    if (!a->seed_set) a->sp.seed = (uint64_t)time(NULL) ^ ((uint64_t)clock() << 32);
    return 0;
}

/* Builds the prompt's token ids from whichever source was given. */
static int prompt_tokens(cli_session *s, const gen_args *a, int32_t **ids, int64_t *n)
{
    if (a->prompt_ids) {
        int rc = cli_parse_ids(a->prompt_ids, ids, n);
        if (rc) return rc;
        for (int64_t i = 0; i < *n; i++)
            if ((*ids)[i] >= s->rt.model->hp.n_vocab) {
                fprintf(stderr, "tandem: token id %d is outside the vocabulary (%d)\n", (*ids)[i],
                        s->rt.model->hp.n_vocab);
                free(*ids);
                *ids = NULL;
                return TD_ERANGE;
            }
        return 0;
    }
    char *rendered = NULL;
    const char *text = a->prompt;
    if (a->chat) {
        const char *tmpl;
        size_t tlen;
        if (td_gguf_get_str(s->rt.gguf, "tokenizer.chat_template", &tmpl, &tlen)) {
            fprintf(stderr, "tandem: --chat: the model has no chat template\n");
            return TD_EUNSUPP;
        }
        jn_special sp;
        jn_error e = {0};
        int rc = jn_special_init(&sp, s->tok);
        if (!rc) rc = jn_chat_render_user(tmpl, tlen, a->chat, &sp, &rendered, &e);
        jn_special_fini(&sp);
        if (rc) {
            fprintf(stderr,
                    "tandem: --chat: cannot render the model's chat template: line %d: %s\n",
                    e.line, e.msg[0] ? e.msg : td_strerror(rc));
            return rc;
        }
        text = rendered;
    }
    size_t nn = 0;
    /* a rendered chat prompt has its special tokens from the template (as the router's) */
    int rc = td_tok_encode(s->tok, text, strlen(text), !a->chat, true, ids, &nn);
    free(rendered);
    if (rc) {
        fprintf(stderr, "tandem: cannot tokenize the prompt: %s\n", td_strerror(rc));
        return rc;
    }
    *n = (int64_t)nn;
    if (*n == 0) {
        fprintf(stderr, "tandem: the prompt is empty\n");
        free(*ids);
        *ids = NULL;
        return TD_EINVAL;
    }
    return 0;
}

/* --timing: prefill and decode wall times on stderr (the logits of each step reach the
 * host, so a device backend's figures include its synchronization and copy back). */
static void print_timing(int64_t n_prompt, int64_t prefill_ns, int64_t n_decode, int64_t decode_ns)
{
    fprintf(stderr, "timing: prefill %lld tokens %.3f ms (%.1f tok/s)", (long long)n_prompt,
            prefill_ns / 1e6, n_prompt / (prefill_ns / 1e9));
    if (n_decode > 0)
        fprintf(stderr, "; decode %lld steps %.3f ms (%.3f ms/token, %.1f tok/s)",
                (long long)n_decode, decode_ns / 1e6, decode_ns / 1e6 / n_decode,
                n_decode / (decode_ns / 1e9));
    fputc('\n', stderr);
}

static int emit(cli_session *s, td_detok *dt, const gen_args *a, int32_t id, bool *first)
{
    if (a->print_ids) {
        printf(*first ? "%d" : " %d", id);
        *first = false;
        return fflush(stdout) ? TD_EIO : 0;
    }
    char buf[256];
    int n = td_detok_push(dt, id, buf, sizeof buf);
    if (n < 0) return n;
    if (n > 0 && fwrite(buf, 1, (size_t)n, stdout) != (size_t)n) return TD_EIO;
    return fflush(stdout) ? TD_EIO : 0;
}

int cmd_generate(int argc, char **argv)
{
    gen_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc > 0 ? 0 : rc;
    cli_session s;
    if ((rc = cli_session_open(&s, &a.sess))) return rc;
    int32_t *ids = NULL, *hist = NULL;
    int64_t n = 0;
    float *logits = NULL;
    kn_kv_seq seq;
    kn_kv_seq_init(&seq);
    kn_sampler smp = {0};
    td_detok dt;
    bool detok = !a.print_ids && s.tok;
    if (detok) td_detok_init(&dt, s.tok);
    if ((rc = prompt_tokens(&s, &a, &ids, &n))) goto out;
    if (a.tokenize) {
        for (int64_t i = 0; i < n; i++)
            printf(i ? ",%d" : "%d", ids[i]);
        printf("\n");
        goto out;
    }
    if (n >= s.ctx) {
        fprintf(stderr, "tandem: the prompt has %lld tokens; the context holds %d\n", (long long)n,
                s.ctx);
        rc = TD_ERANGE;
        goto out;
    }
    int32_t n_vocab = s.rt.model->hp.n_vocab;
    logits = malloc((size_t)n_vocab * sizeof *logits);
    hist = malloc((size_t)(n + a.max_tokens + 1) * sizeof *hist);
    if (!logits || !hist) {
        rc = TD_ENOMEM;
        goto out;
    }
    memcpy(hist, ids, (size_t)n * sizeof *hist);
    if ((rc = kn_sampler_init(&smp, &a.sp, n_vocab))) goto out;
    const int64_t t0 = td_now_ns();
    if ((rc = cli_prefill(&s, &seq, ids, n, 0, a.chunk, logits, NULL))) {
        fprintf(stderr, "tandem: prefill failed: %s\n", td_strerror(rc));
        goto out;
    }
    const int64_t t1 = td_now_ns();
    int64_t len = n;
    bool first = true;
    for (int t = 0; t < a.max_tokens; t++) {
        int32_t id = kn_sample(&smp, logits, hist, len, len - n);
        if (id < 0) {
            rc = id;
            goto out;
        }
        if (!a.ignore_eos && s.tok && td_tok_is_eog(s.tok, id)) break;
        hist[len] = id;
        if ((rc = emit(&s, &dt, &a, id, &first))) goto out;
        if (t + 1 == a.max_tokens) break;
        if (len + 1 > s.ctx) {
            fprintf(stderr, "\ntandem: context of %d tokens is full\n", s.ctx);
            break;
        }
        if ((rc = cli_prefill(&s, &seq, &id, 1, len, 1, logits, NULL))) {
            fprintf(stderr, "tandem: decode failed: %s\n", td_strerror(rc));
            goto out;
        }
        len++;
    }
    if (detok) {
        char buf[64];
        int k = td_detok_flush(&dt, buf, sizeof buf);
        if (k > 0) fwrite(buf, 1, (size_t)k, stdout);
    }
    fputc('\n', stdout);
    fflush(stdout);
    if (a.timing) print_timing(n, t1 - t0, len - n, td_now_ns() - t1);
out:
    if (detok) td_detok_fini(&dt);
    kn_sampler_fini(&smp);
    kn_kv_seq_fini(s.mem, &seq);
    free(ids);
    free(hist);
    free(logits);
    cli_session_close(&s);
    return rc;
}
