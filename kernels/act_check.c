/* act_check.c: the measured choice of the CPU activation mode (act_check.h): the check, its
 * cache key and file, and the lock that lets one process of a cluster measure for all. */
#include "act_check.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "jn_chat.h"
#include "cpu_backend.h"
#include "cpu_blas.h"
#include "kn_runtime.h"
#include "kv_mem.h"
#include "sampler.h"
#include "td_cachefile.h"
#include "td_clock.h"
#include "td_err.h"
#include "tokenizer.h"

#define MAGIC    "tandem act check 2\n"
#define FILE_MAX 4096

/* Everyday requests of the kinds users send (facts, code, arithmetic, translation, advice):
 * a near-tie the 8-bit rounding flips shows up in one of them. Changing them changes the
 * key (the check's text is hashed into it). */
static const char *const prompts[] = {
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Name the three primary colors.",
    "How many days are there in a week?",
    "Translate 'good morning' into Spanish.",
    "What is 12 plus 7?",
    "Give me one short tip for staying focused while studying.",
    "Who wrote Romeo and Juliet?",
};
#define N_PROMPTS ((int)(sizeof prompts / sizeof *prompts))

/* ---- the check ---- */

typedef struct {
    kn_runtime rt;
    kn_kv_mem *kv;
    td_tokenizer *tok;
    int32_t *ids[N_PROMPTS]; /* each prompt, templated and tokenized */
    size_t n_ids[N_PROMPTS];
    size_t max_ids;
    float *logits; /* n_vocab */
} check_ctx;

/* The prompt as the model's chat template renders one user message (plain text when the
 * model has none or it cannot be rendered), tokenized. */
static int encode_prompt(check_ctx *c, int i)
{
    const char *tmpl, *text = prompts[i];
    size_t tlen;
    char *rendered = NULL;
    if (!td_gguf_get_str(c->rt.gguf, "tokenizer.chat_template", &tmpl, &tlen)) {
        jn_special sp;
        jn_error e;
        if (!jn_special_init(&sp, c->tok) &&
            !jn_chat_render_user(tmpl, tlen, prompts[i], &sp, &rendered, &e))
            text = rendered;
        jn_special_fini(&sp);
    }
    /* a rendered prompt has its special tokens from the template (transformers' rule) */
    int rc = td_tok_encode(c->tok, text, strlen(text), !rendered, true, &c->ids[i], &c->n_ids[i]);
    free(rendered);
    if (!rc && c->n_ids[i] == 0) rc = TD_EINVAL;
    if (!rc && c->n_ids[i] > c->max_ids) c->max_ids = c->n_ids[i];
    return rc;
}

/* out[0..KN_ACT_CHECK_TOKENS) = the greedy continuation of prompt i in the current mode:
 * the prompt in one forward, then one token a step as the decode node runs them (solo rows). */
static int greedy(check_ctx *c, int i, int32_t *out)
{
    kn_kv_seq seq;
    kn_kv_seq_init(&seq);
    const int64_t n = (int64_t)c->n_ids[i];
    int32_t *pos = malloc((size_t)(n + KN_ACT_CHECK_TOKENS) * sizeof *pos);
    int32_t *seq_of = calloc((size_t)n, sizeof *seq_of);
    int rc = pos && seq_of ? 0 : TD_ENOMEM;
    for (int64_t k = 0; k < n + KN_ACT_CHECK_TOKENS && !rc; k++)
        pos[k] = (int32_t)k;
    int64_t len = 0;
    for (int t = 0; t < KN_ACT_CHECK_TOKENS && !rc; t++) {
        const int64_t m = t == 0 ? n : 1;
        if ((rc = kn_kv_seq_reserve(c->kv, &seq, len + m))) break;
        kn_seq_view view = {.block_table = seq.blocks, .n_ctx = (int32_t)(len + m)};
        int32_t last = (int32_t)(m - 1);
        kn_batch b = {.n_tokens = m,
                      .n_solo = t == 0 ? 0 : 1,
                      .tokens = t == 0 ? c->ids[i] : &out[t - 1],
                      .pos = pos + len,
                      .seq_of = seq_of,
                      .n_seqs = 1,
                      .seqs = &view,
                      .n_logits = 1,
                      .logit_rows = &last};
        if ((rc = kn_engine_forward(c->rt.engine, kn_kv_mem_pool(c->kv), &b, c->logits))) break;
        out[t] = kn_argmax(c->logits, c->rt.model->hp.n_vocab);
        len += m;
    }
    kn_kv_seq_fini(c->kv, &seq);
    free(pos);
    free(seq_of);
    return rc;
}

static int open_check(check_ctx *c, const char *model_path, int n_threads, const char *who)
{
    char who_check[160]; /* its own runtime's log lines, apart from the caller's */
    snprintf(who_check, sizeof who_check, "%s (activation check)", who);
    kn_runtime_params rp = {.model_path = model_path,
                            .backend = "cpu",
                            .backend_opts = {.n_threads = n_threads, .cpu_act = "f32"},
                            .who = who_check};
    int rc = kn_runtime_open(&c->rt, &rp);
    if (!rc) rc = td_tok_create(c->rt.gguf, &c->tok);
    for (int i = 0; i < N_PROMPTS && !rc; i++)
        rc = encode_prompt(c, i);
    if (rc) return rc;
    const int bs = 16;
    const int n_blocks = (int)((c->max_ids + KN_ACT_CHECK_TOKENS + bs - 1) / bs) + 1;
    kn_kv_pool_params kp = kn_model_kv_params(c->rt.model, n_blocks, bs, TD_F16);
    kp.backend = &c->rt.be;
    if ((rc = kn_kv_mem_create(&kp, &c->kv))) return rc;
    c->logits = malloc((size_t)c->rt.model->hp.n_vocab * sizeof *c->logits);
    return c->logits ? 0 : TD_ENOMEM;
}

static void close_check(check_ctx *c)
{
    free(c->logits);
    kn_kv_mem_destroy(c->kv);
    for (int i = 0; i < N_PROMPTS; i++)
        free(c->ids[i]);
    td_tok_destroy(c->tok);
    kn_runtime_close(&c->rt);
}

/* Every prompt in mode a against the float32 tokens f32; the agreement into g. */
static int compare(check_ctx *c, kn_cpu_act_mode a, int32_t (*f32)[KN_ACT_CHECK_TOKENS],
                   kn_act_agreement *g)
{
    int32_t out[KN_ACT_CHECK_TOKENS];
    double sum = 0;
    *g = (kn_act_agreement){.measured = true, .first_diff = -1};
    kn_cpu_set_act(kn_cpu_of(c->rt.be), a);
    for (int i = 0; i < N_PROMPTS; i++) {
        int rc = greedy(c, i, out);
        if (rc) return rc;
        int same = 0;
        while (same < KN_ACT_CHECK_TOKENS && f32[i][same] == out[same])
            same++;
        sum += (double)same / KN_ACT_CHECK_TOKENS;
        if (same == KN_ACT_CHECK_TOKENS)
            g->agree_prompts++;
        else if (g->first_diff < 0)
            g->first_diff = i;
    }
    g->agreement = sum / N_PROMPTS;
    return 0;
}

/* float32, q8 and (when q8 differs) q16 on every prompt; the verdict into v. */
static int measure(const char *model_path, int n_threads, const char *who, kn_act_verdict *v)
{
    check_ctx c = {0};
    const int64_t t0 = td_now_ns();
    int rc = open_check(&c, model_path, n_threads, who);
    int32_t f32[N_PROMPTS][KN_ACT_CHECK_TOKENS];
    v->n_prompts = N_PROMPTS;
    v->q8 = v->q16 = (kn_act_agreement){.first_diff = -1};
    if (!rc) kn_cpu_set_act(kn_cpu_of(c.rt.be), KN_CPU_ACT_F32);
    for (int i = 0; i < N_PROMPTS && !rc; i++)
        rc = greedy(&c, i, f32[i]);
    if (!rc) rc = compare(&c, KN_CPU_ACT_Q8, f32, &v->q8);
    if (!rc && v->q8.agree_prompts < N_PROMPTS) rc = compare(&c, KN_CPU_ACT_Q16, f32, &v->q16);
    close_check(&c);
    if (rc) return rc;
    v->act = v->q8.agree_prompts == N_PROMPTS    ? "q8"
             : v->q16.agree_prompts == N_PROMPTS ? "q16"
                                                 : "f32";
    v->check_ms = (double)(td_now_ns() - t0) / 1e6;
    return 0;
}

/* ---- the cache ---- */

static int desc_add(char *d, size_t cap, size_t *off, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int desc_add(char *d, size_t cap, size_t *off, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(d + *off, cap - *off, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= cap - *off) return TD_ERANGE;
    *off += (size_t)n;
    return 0;
}

/* What the verdict depends on, one field per line, into d. */
static int key_desc(const char *model_path, char *d, size_t cap)
{
    struct stat st;
    td_gguf *g;
    char err[256];
    if (stat(model_path, &st) || td_gguf_open(model_path, &g, err, sizeof err)) return TD_EIO;
    const uint64_t h = td_fnv_gguf_tensors(td_fnv_i64(TD_FNV_OFFSET, (int64_t)st.st_size), g);
    const size_t nt = td_gguf_n_tensors(g);
    td_gguf_close(g);
    uint64_t ph = td_fnv_i64(TD_FNV_OFFSET, KN_ACT_CHECK_TOKENS);
    for (int i = 0; i < N_PROMPTS; i++)
        ph = td_fnv(ph, prompts[i], strlen(prompts[i]) + 1);
    char exe[TD_BUILD_IDENTITY_MAX], blas[TD_BUILD_IDENTITY_MAX], cpu[160];
    td_build_identity(0, exe, sizeof exe);
    kn_blas_build_identity(blas, sizeof blas);
    td_cpu_model_name(cpu, sizeof cpu);
    kn_blas_info b;
    kn_blas_info_get(&b);
    size_t off = 0;
    int rc = 0;
    rc |= desc_add(d, cap, &off, "model %016llx (%lld bytes, %zu tensors)\n",
                   (unsigned long long)h, (long long)st.st_size, nt);
    rc |= desc_add(d, cap, &off, "check %016llx (%d prompts, %d tokens)\n",
                   (unsigned long long)ph, N_PROMPTS, KN_ACT_CHECK_TOKENS);
    rc |= desc_add(d, cap, &off, "kernels %s; blas core %s\n", kn_cpu_isa(), b.core);
    rc |= desc_add(d, cap, &off, "build exe %s blas %s\n", exe, blas);
    rc |= desc_add(d, cap, &off, "cpu %s\n", cpu);
    return rc ? TD_ERANGE : 0;
}

/* The verdict of the file at path if it is whole and for this key (desc); else TD_ENOENT
 * (none) or another error with a reason. */
static int load(const char *path, const char *desc, kn_act_verdict *v, char *why, size_t cap)
{
    char *text;
    size_t len;
    int rc = td_cache_read(path, FILE_MAX, &text, &len, why, cap);
    if (rc) return rc;
    const size_t hl = strlen(MAGIC) + strlen(desc);
    char *end = NULL; /* the last line's "end " (the desc may hold those letters too) */
    for (char *e = strstr(text, "\nend "); e; e = strstr(e + 1, "\nend "))
        end = e + 1;
    char act[8] = "";
    int q16m = -1;
    unsigned long long sum = 0;
    rc = TD_EFORMAT;
    if (len < hl || strncmp(text, MAGIC, strlen(MAGIC)) || strncmp(text + strlen(MAGIC), desc,
                                                                    strlen(desc)))
        snprintf(why, cap, "another key or version");
    else if (!end || sscanf(end, "end %16llx\n", &sum) != 1 ||
             sum != td_fnv(TD_FNV_OFFSET, text, (size_t)(end - text)))
        snprintf(why, cap, "checksum");
    else if (sscanf(text + hl,
                    "--\nact %7s\nprompts %d\nq8 agree %d first_diff %d agreement %lf\n"
                    "q16 measured %d agree %d first_diff %d agreement %lf\ncheck_ms %lf\n",
                    act, &v->n_prompts, &v->q8.agree_prompts, &v->q8.first_diff, &v->q8.agreement,
                    &q16m, &v->q16.agree_prompts, &v->q16.first_diff, &v->q16.agreement,
                    &v->check_ms) != 10 ||
             (q16m != 0 && q16m != 1) ||
             (strcmp(act, "q8") && strcmp(act, "q16") && strcmp(act, "f32")))
        snprintf(why, cap, "fields");
    else
        rc = 0;
    v->act = !strcmp(act, "q8") ? "q8" : !strcmp(act, "q16") ? "q16" : "f32";
    v->q8.measured = true;
    v->q16.measured = q16m == 1;
    free(text);
    return rc;
}

static int store(const char *path, const char *desc, const kn_act_verdict *v, char *why,
                 size_t cap)
{
    char b[FILE_MAX];
    int n = snprintf(b, sizeof b,
                     "%s%s--\nact %s\nprompts %d\nq8 agree %d first_diff %d agreement %.6f\n"
                     "q16 measured %d agree %d first_diff %d agreement %.6f\ncheck_ms %.1f\n",
                     MAGIC, desc, v->act, v->n_prompts, v->q8.agree_prompts, v->q8.first_diff,
                     v->q8.agreement, v->q16.measured ? 1 : 0, v->q16.agree_prompts,
                     v->q16.first_diff, v->q16.agreement, v->check_ms);
    if (n < 0 || (size_t)n + 40 > sizeof b) return TD_ERANGE;
    n += snprintf(b + n, sizeof b - (size_t)n, "end %016llx\n",
                  (unsigned long long)td_fnv(TD_FNV_OFFSET, b, (size_t)n));
    return td_cache_write(path, b, (size_t)n, why, cap);
}

int kn_act_choose(const char *model_path, int n_threads, const char *who, kn_act_verdict *out)
{
    memset(out, 0, sizeof *out);
    who = who ? who : "tandem";
    char desc[4096], dir[400], why[512] = "";
    int rc = key_desc(model_path, desc, sizeof desc);
    if (rc) {
        TD_LOG_ERR("%s: cpu_act auto: cannot read '%s'", who, model_path);
        return rc;
    }
    if (!td_cache_dir("act", dir, sizeof dir))
        snprintf(out->path, sizeof out->path, "%s/model-%016llx.act", dir,
                 (unsigned long long)td_fnv(TD_FNV_OFFSET, desc, strlen(desc)));
    int lock = -1;
    if (out->path[0]) {
        lock = td_cache_lock(out->path); /* another process measuring: wait for it */
        rc = load(out->path, desc, out, why, sizeof why);
        if (!rc) {
            out->cached = true;
            if (lock >= 0) close(lock);
            return 0;
        }
        if (rc != TD_ENOENT)
            TD_LOG_WARN("%s: cpu_act auto: cache %s refused (%s): measuring again", who,
                        out->path, why);
    }
    TD_LOG_INFO("%s: cpu_act auto: comparing q8 (then q16) and float32 activations on %d prompts",
                who, N_PROMPTS);
    rc = measure(model_path, n_threads, who, out);
    if (!rc && out->path[0] && store(out->path, desc, out, why, sizeof why))
        TD_LOG_WARN("%s: cpu_act auto: cannot store the verdict in %s: %s", who, out->path, why);
    if (lock >= 0) close(lock); /* releases the lock */
    return rc;
}

int kn_act_resolve(const char *cpu_act, const char *model_path, int n_threads, const char *who,
                   const char **out)
{
    *out = cpu_act;
    if (!cpu_act) {
        const char *env = getenv("TANDEM_CPU_ACT");
        if (!env || strcmp(env, "auto")) return 0; /* kn_cpu_create reads it */
    } else if (strcmp(cpu_act, "auto")) {
        return 0;
    }
    kn_act_verdict v;
    int rc = kn_act_choose(model_path, n_threads, who, &v);
    if (rc) {
        *out = NULL;
        return rc;
    }
    *out = v.act;
    char q16[96] = "";
    if (v.q16.measured)
        snprintf(q16, sizeof q16, "; in q16 %d of %d, agreement %.2f", v.q16.agree_prompts,
                 v.n_prompts, v.q16.agreement);
    TD_LOG_INFO("%s: cpu_act auto: %s (%d of %d prompts give the same %d greedy tokens in q8 as "
                "in float32, agreement %.2f%s%s%s)",
                who ? who : "tandem", *out, v.q8.agree_prompts, v.n_prompts, KN_ACT_CHECK_TOKENS,
                v.q8.agreement, q16, v.cached ? "; cached in " : "", v.cached ? v.path : "");
    return 0;
}

int kn_act_runtime_open(kn_runtime *rt, const kn_runtime_params *p)
{
    kn_runtime_params q = *p;
    const bool cpu = !p->backend || !strcmp(p->backend, "cpu") || !strcmp(p->backend, "cpu-dev");
    int rc = cpu ? kn_act_resolve(p->backend_opts.cpu_act, p->model_path,
                                  p->backend_opts.n_threads, p->who, &q.backend_opts.cpu_act)
                 : 0;
    if (rc) {
        memset(rt, 0, sizeof *rt);
        return rc;
    }
    return kn_runtime_open(rt, &q);
}
