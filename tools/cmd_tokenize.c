/* cmd_tokenize.c: `tandem tokenize`: text to token ids (and back) with a GGUF file's
 * vocabulary, as the serving nodes tokenize prompts. Only the tokenizer.ggml.* metadata is
 * read, so a vocabulary-only file (no tensors, such as llama.cpp's ggml-vocab-*.gguf) works
 * as well as a model; a vocabulary Tandem does not implement is refused with its reason. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "gguf.h"
#include "td_err.h"
#include "tokenizer.h"

static void usage(void)
{
    fprintf(stderr,
            "usage: tandem tokenize --model FILE.gguf [--text TEXT | --file F | --decode IDS]\n"
            "                       [--no-bos] [--no-parse-special] [--ids] [--info]\n"
            "  prints one line per token, 'ID<TAB>PIECE' (the piece's bytes, C-escaped);\n"
            "  --ids: the ids alone, on one line, space-separated; --info: the vocabulary\n"
            "  (type, pre-tokenizer, size, special tokens) first. Text comes from --text,\n"
            "  --file ('-': stdin) or else stdin, as bytes (no newline is stripped).\n"
            "  --no-bos: add none of the tokens the vocabulary adds (BOS, and EOS or [SEP]\n"
            "  where it adds them); --no-parse-special: control-token text such as\n"
            "  '<|im_start|>' stays text; --decode IDS ('1 2 3' or '1,2,3'): print the text\n"
            "  of ids instead (control tokens included).\n");
}

typedef struct {
    const char *model, *text, *file, *decode;
    bool no_bos, no_parse_special, ids_only, info;
} tok_args;

static int parse(int argc, char **argv, tok_args *a)
{
    for (int i = 0; i < argc; i++) {
        const char *f = argv[i];
        bool *flag = !strcmp(f, "--no-bos")             ? &a->no_bos
                     : !strcmp(f, "--no-parse-special") ? &a->no_parse_special
                     : !strcmp(f, "--ids")              ? &a->ids_only
                     : !strcmp(f, "--info")             ? &a->info
                                                        : NULL;
        if (flag) {
            *flag = true;
            continue;
        }
        if (!strcmp(f, "-h") || !strcmp(f, "--help")) return 1;
        const char **dst = !strcmp(f, "--model")    ? &a->model
                           : !strcmp(f, "--text")   ? &a->text
                           : !strcmp(f, "--file")   ? &a->file
                           : !strcmp(f, "--decode") ? &a->decode
                                                    : NULL;
        if (!dst) {
            fprintf(stderr, "tandem tokenize: unknown option '%s'\n", f);
            return -1;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "tandem tokenize: %s needs a value\n", f);
            return -1;
        }
        *dst = argv[++i];
    }
    if (!a->model) {
        fprintf(stderr, "tandem tokenize: --model is required\n");
        return -1;
    }
    if (!!a->text + !!a->file + !!a->decode > 1) {
        fprintf(stderr, "tandem tokenize: give at most one of --text, --file and --decode\n");
        return -1;
    }
    return 0;
}


/* Length of the valid UTF-8 character at s[0..n) (2..4), or 0. */
static size_t utf8_char(const unsigned char *s, size_t n)
{
    size_t k = s[0] >= 0xF0 && s[0] <= 0xF4 ? 4 : s[0] >= 0xE0 ? 3 : s[0] >= 0xC2 ? 2 : 0;
    if (!k || k > n || s[0] > 0xF4) return 0;
    for (size_t i = 1; i < k; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    if ((s[0] == 0xE0 && s[1] < 0xA0) || (s[0] == 0xED && s[1] > 0x9F) ||
        (s[0] == 0xF0 && s[1] < 0x90) || (s[0] == 0xF4 && s[1] > 0x8F))
        return 0;
    return k;
}

/* A piece as one printable line: valid UTF-8 as is, \n \t \r \\ escaped, other control
 * bytes and bytes of no whole character (a byte token's half of a character) as \xNN. */
static void put_escaped(const char *p, size_t n)
{
    const unsigned char *s = (const unsigned char *)p;
    for (size_t i = 0; i < n;) {
        unsigned char c = s[i];
        size_t k = c >= 0x80 ? utf8_char(s + i, n - i) : 1;
        if (c == '\n' || c == '\t' || c == '\r' || c == '\\') {
            printf("\\%c", c == '\n' ? 'n' : c == '\t' ? 't' : c == '\r' ? 'r' : '\\');
        } else if (k == 0 || c < 0x20 || c == 0x7F) {
            printf("\\x%02x", c);
            k = 1;
        } else {
            fwrite(s + i, 1, k, stdout);
        }
        i += k;
    }
}

static void print_info(const td_tokenizer *t)
{
    printf("type %s, pre-tokenizer %s, %d tokens, bos %d%s, eos %d%s%s\n", td_tok_type_name(t),
           td_tok_pre_name(t), td_tok_n_vocab(t), td_tok_bos(t),
           td_tok_add_bos(t) ? " (added)" : "", td_tok_eos(t),
           td_tok_clean_spaces(t) ? ", decode cleans spaces" : "",
           td_tok_lossless(t) ? "" : ", normalizes (no exact round trip)");
}

static int print_ids(const td_tokenizer *t, const int32_t *ids, size_t n, bool ids_only)
{
    for (size_t i = 0; i < n; i++) {
        if (ids_only) {
            printf("%s%d", i ? " " : "", ids[i]);
            continue;
        }
        size_t len;
        const char *p = td_tok_piece(t, ids[i], &len);
        printf("%d\t", ids[i]);
        put_escaped(p, len);
        putchar('\n');
    }
    if (ids_only) putchar('\n');
    return fflush(stdout) ? TD_EIO : 0;
}

static int decode(const td_tokenizer *t, const char *spec)
{
    int32_t *ids = NULL;
    int64_t n = 0;
    int rc = cli_parse_ids(spec, &ids, &n);
    if (rc) return rc;
    long need = td_tok_decode(t, ids, (size_t)n, true, NULL, 0);
    char *out = need >= 0 ? malloc((size_t)need + 1) : NULL;
    if (need < 0) {
        fprintf(stderr, "tandem tokenize: --decode: an id is not in [0, %d)\n", td_tok_n_vocab(t));
        rc = TD_EINVAL;
    } else if (!out) {
        rc = TD_ENOMEM;
    } else {
        td_tok_decode(t, ids, (size_t)n, true, out, (size_t)need);
        if (fwrite(out, 1, (size_t)need, stdout) != (size_t)need || fflush(stdout)) rc = TD_EIO;
    }
    free(out);
    free(ids);
    return rc;
}

static int tokenize(const td_tokenizer *t, const tok_args *a)
{
    size_t len = a->text ? strlen(a->text) : 0;
    char *buf = a->text ? NULL : cli_read_file("tokenize", a->file ? a->file : "-", &len);
    if (!a->text && !buf) return TD_EIO;
    int32_t *ids = NULL;
    size_t n = 0;
    int rc =
        td_tok_encode(t, a->text ? a->text : buf, len, !a->no_bos, !a->no_parse_special, &ids, &n);
    if (!rc) rc = print_ids(t, ids, n, a->ids_only);
    free(ids);
    free(buf);
    return rc;
}

int cmd_tokenize(int argc, char **argv)
{
    tok_args a = {0};
    int p = parse(argc, argv, &a);
    if (p) {
        usage();
        return p > 0 ? 0 : TD_EINVAL;
    }
    char err[256];
    td_gguf *g = NULL;
    int rc = td_gguf_open(a.model, &g, err, sizeof err);
    if (rc) {
        fprintf(stderr, "tandem tokenize: cannot open '%s': %s\n", a.model, err);
        return rc;
    }
    td_tokenizer *t = NULL;
    rc = td_tok_create(g, &t); /* reads the tokenizer.ggml.* keys only */
    td_gguf_close(g);
    if (rc) {
        fprintf(stderr, "tandem tokenize: '%s': %s vocabulary (the reason is above)\n", a.model,
                rc == TD_EUNSUPP ? "unsupported" : "unusable");
        return rc;
    }
    if (a.info) print_info(t);
    rc = a.decode ? decode(t, a.decode) : tokenize(t, &a);
    td_tok_destroy(t);
    return rc;
}
