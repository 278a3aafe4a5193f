/* cmd_template.c: `tandem template`: render a chat template with a conversation, as the
 * router renders a chat request's prompt (jinja/jn_chat.h), and print it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "gguf.h"
#include "jn.h"
#include "jn_chat.h"
#include "td_err.h"
#include "tokenizer.h"

static void usage(void)
{
    fprintf(stderr,
            "usage: tandem template (--model FILE.gguf [--name NAME] | --template FILE.jinja)\n"
            "                       [--messages FILE.json] [--tools FILE.json]\n"
            "                       [--add-generation-prompt] [--kwargs JSON] [--bos TEXT]\n"
            "                       [--eos TEXT] [--now EPOCH]\n"
            "  prints the rendering (nothing added) of the model's chat template (or the\n"
            "  GGUF's tokenizer.chat_template.NAME), of a template file, or of a built-in\n"
            "  one (--template chatml|llama3|llama2|gemma); --messages: a JSON\n"
            "  array of messages (or an object with \"messages\"; '-' reads stdin); --tools: a\n"
            "  JSON array of tools; --kwargs: chat_template_kwargs (e.g. '{\"enable_thinking\":\n"
            "  false}'); --bos/--eos: the special tokens' text (from the model's vocabulary with\n"
            "  --model); --now: strftime_now's time, Unix seconds, UTC\n");
}


static json_t *read_json(const char *path, const char *what)
{
    size_t n;
    char *text = cli_read_file("template", path, &n);
    if (!text) return NULL;
    json_error_t e;
    json_t *j = json_loadb(text, n, JSON_DECODE_ANY, &e);
    free(text);
    if (!j) fprintf(stderr, "tandem template: %s '%s': line %d: %s\n", what, path, e.line, e.text);
    return j;
}

typedef struct {
    const char *model, *name, *tmpl, *messages, *tools, *kwargs, *bos, *eos, *now;
    bool agp;
} tpl_args;

static int parse(int argc, char **argv, tpl_args *a)
{
    for (int i = 0; i < argc; i++) {
        const char *f = argv[i];
        if (!strcmp(f, "--add-generation-prompt")) {
            a->agp = true;
            continue;
        }
        if (!strcmp(f, "-h") || !strcmp(f, "--help")) return 1;
        const char **dst = !strcmp(f, "--model")      ? &a->model
                           : !strcmp(f, "--name")     ? &a->name
                           : !strcmp(f, "--template") ? &a->tmpl
                           : !strcmp(f, "--messages") ? &a->messages
                           : !strcmp(f, "--tools")    ? &a->tools
                           : !strcmp(f, "--kwargs")   ? &a->kwargs
                           : !strcmp(f, "--bos")      ? &a->bos
                           : !strcmp(f, "--eos")      ? &a->eos
                           : !strcmp(f, "--now")      ? &a->now
                                                      : NULL;
        if (!dst) {
            fprintf(stderr, "tandem template: unknown option '%s'\n", f);
            return -1;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "tandem template: %s needs a value\n", f);
            return -1;
        }
        *dst = argv[++i];
    }
    if (!a->model == !a->tmpl) {
        fprintf(stderr, "tandem template: give one of --model and --template\n");
        return -1;
    }
    if (a->name && !a->model) {
        fprintf(stderr, "tandem template: --name needs --model\n");
        return -1;
    }
    return 0;
}

/* The template text and the special tokens of a model file. */
static int from_model(const tpl_args *a, td_gguf **g, const char **tmpl, size_t *tlen, char **bos,
                      char **eos)
{
    char err[256], key[160];
    int rc = td_gguf_open(a->model, g, err, sizeof err);
    if (rc) {
        fprintf(stderr, "tandem template: cannot open '%s': %s\n", a->model, err);
        return rc;
    }
    snprintf(key, sizeof key, "tokenizer.chat_template%s%.100s", a->name ? "." : "",
             a->name ? a->name : "");
    if (td_gguf_get_str(*g, key, tmpl, tlen)) {
        fprintf(stderr, "tandem template: '%s' has no %s\n", a->model, key);
        return TD_ENOENT;
    }
    td_tokenizer *tok = NULL;
    if (td_tok_create(*g, &tok)) return 0; /* no vocabulary: bos/eos stay as given */
    jn_special sp;                         /* the router's bos_token and eos_token */
    rc = jn_special_init(&sp, tok);
    td_tok_destroy(tok);
    *bos = sp.bos;
    *eos = sp.eos;
    return rc;
}

static int render(const tpl_args *a, const char *tmpl, size_t tlen, const jn_chat *chat)
{
    jn_template *t = NULL;
    jn_error e = {0};
    jn_opts o = {0};
    if (a->now) {
        char *end;
        errno = 0;
        o.now = strtoll(a->now, &end, 10);
        if (errno || *end || o.now <= 0) {
            fprintf(stderr, "tandem template: --now needs Unix seconds, got '%s'\n", a->now);
            return TD_EINVAL;
        }
    }
    int rc = jn_parse(tmpl, tlen, &t, &e);
    if (rc) {
        fprintf(stderr, "tandem template: the template does not parse: line %d: %s\n", e.line,
                e.msg);
        return rc;
    }
    char *out = NULL;
    size_t n = 0;
    rc = jn_chat_render(t, chat, &o, &out, &n, &e);
    jn_template_free(t);
    if (rc) {
        fprintf(stderr, "tandem template: rendering failed: line %d: %s\n", e.line, e.msg);
        return rc;
    }
    if (fwrite(out, 1, n, stdout) != n || fflush(stdout)) rc = TD_EIO;
    free(out);
    return rc;
}

int cmd_template(int argc, char **argv)
{
    tpl_args a = {0};
    int p = parse(argc, argv, &a);
    if (p) {
        usage();
        return p > 0 ? 0 : TD_EINVAL;
    }
    td_gguf *g = NULL;
    char *file = NULL, *mbos = NULL, *meos = NULL;
    const char *tmpl = NULL;
    size_t tlen = 0;
    json_t *msgs = NULL, *tools = NULL, *kwargs = NULL;
    int rc = 0;
    if (a.model) {
        rc = from_model(&a, &g, &tmpl, &tlen, &mbos, &meos);
    } else if ((tmpl = jn_family_template(a.tmpl))) { /* as router.chat_template reads it */
        tlen = strlen(tmpl);
    } else if (!(file = cli_read_file("template", a.tmpl, &tlen))) {
        rc = TD_EIO;
    }
    if (file) tmpl = file;
    if (!rc && a.messages && !(msgs = read_json(a.messages, "messages"))) rc = TD_EINVAL;
    if (!rc && json_is_object(msgs)) { /* a fixture: {"messages": [...], ...} */
        json_t *inner = json_incref(json_object_get(msgs, "messages"));
        json_decref(msgs);
        msgs = inner;
    }
    if (!rc && a.messages && !json_is_array(msgs)) {
        fprintf(stderr,
                "tandem template: messages '%s' must be a JSON array of messages (or an "
                "object with one under \"messages\")\n",
                a.messages);
        rc = TD_EINVAL;
    }
    if (!rc && !msgs && !(msgs = json_array())) rc = TD_ENOMEM;
    if (!rc && a.tools && !(tools = read_json(a.tools, "tools"))) rc = TD_EINVAL;
    if (!rc && a.kwargs) {
        json_error_t e;
        if (!(kwargs = json_loads(a.kwargs, 0, &e))) {
            fprintf(stderr, "tandem template: --kwargs: %s\n", e.text);
            rc = TD_EINVAL;
        }
    }
    if (!rc) {
        jn_chat chat = {.messages = msgs,
                        .tools = tools,
                        .add_generation_prompt = a.agp,
                        .bos_token = a.bos ? a.bos : mbos,
                        .eos_token = a.eos ? a.eos : meos,
                        .kwargs = kwargs};
        rc = render(&a, tmpl, tlen, &chat);
    }
    json_decref(msgs);
    json_decref(tools);
    json_decref(kwargs);
    free(mbos);
    free(meos);
    free(file);
    td_gguf_close(g);
    return rc;
}
