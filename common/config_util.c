/* config_util.c: the small public helpers of config.h that do not parse YAML: sizes with units,
 * instance look-ups by name, control URLs, backend names, the router's template and tool-parser
 * names, freeing a configuration. */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "td_err.h"

int td_cfg_parse_size(const char *s, int64_t *out)
{
    char *end;
    errno = 0;
    if (!s || !isdigit((unsigned char)*s)) return TD_EINVAL;
    double v = strtod(s, &end);
    if (end == s || errno || !isfinite(v)) return TD_EINVAL;
    while (*end == ' ')
        end++;
    static const struct {
        const char *unit;
        double mul;
    } units[] = {{"", 1},
                 {"B", 1},
                 {"KiB", 1024.0},
                 {"MiB", 1048576.0},
                 {"GiB", 1073741824.0},
                 {"TiB", 1099511627776.0},
                 {"KB", 1e3},
                 {"MB", 1e6},
                 {"GB", 1e9},
                 {"TB", 1e12}};
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcmp(end, units[i].unit)) continue;
        double b = v * units[i].mul;
        if (b >= 9.2e18) return TD_ERANGE;
        if (b != floor(b)) return TD_EINVAL; /* fractional bytes */
        *out = (int64_t)b;
        return 0;
    }
    return TD_EINVAL;
}

bool td_cfg_name_ok(const char *s)
{
    size_t n = s ? strlen(s) : 0;
    if (!n || n > TD_CFG_NAME_MAX) return false;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)s[i]) && !strchr("_.-", s[i])) return false;
    return true;
}

const td_cfg_decode *td_cfg_find_decode(const td_cfg *c, const char *name)
{
    for (int i = 0; c && name && i < c->n_decode; i++)
        if (!strcmp(c->decode[i].name, name)) return &c->decode[i];
    return NULL;
}

const td_cfg_prefill *td_cfg_find_prefill(const td_cfg *c, const char *name)
{
    for (int i = 0; c && name && i < c->n_prefill; i++)
        if (!strcmp(c->prefill[i].name, name)) return &c->prefill[i];
    return NULL;
}

int td_cfg_ctrl_url(const char *host, int port, char *buf, size_t cap)
{
    bool v6 = strchr(host, ':') != NULL;
    int n = snprintf(buf, cap, v6 ? "tcp://[%s]:%d" : "tcp://%s:%d", host, port);
    return n < 0 || (size_t)n >= cap ? TD_ERANGE : 0;
}

const char *td_cfg_backend_name(td_cfg_backend b)
{
    return b == TD_CFG_BACKEND_CUDA ? "cuda" : b == TD_CFG_BACKEND_CPU_DEV ? "cpu-dev" : "cpu";
}

const char *td_cfg_act_name(td_cfg_act a)
{
    return a == TD_CFG_ACT_Q8     ? "q8"
           : a == TD_CFG_ACT_Q16  ? "q16"
           : a == TD_CFG_ACT_F32  ? "f32"
           : a == TD_CFG_ACT_AUTO ? "auto"
                                  : NULL;
}

bool td_cfg_chat_template_ok(const char *t)
{
    return !*t || !strcmp(t, "chatml") || !strcmp(t, "llama3") || !strcmp(t, "llama2") ||
           !strcmp(t, "gemma") || !access(t, R_OK);
}

bool td_cfg_tool_parser_known(const char *name)
{
    /* TD_CFG_TOOL_PARSERS as words: "auto, hermes, ..." */
    static const char all[] = TD_CFG_TOOL_PARSERS;
    size_t n = strlen(name);
    if (strpbrk(name, ", ")) return false;
    for (const char *s = all; n && (s = strstr(s, name)); s += n) {
        bool starts = s == all || s[-1] == ' ';
        if (starts && (s[n] == ',' || !s[n])) return true;
    }
    return false;
}

void cfg_free_decodes(td_cfg_decode *d, int n)
{
    for (int i = 0; d && i < n; i++) {
        free(d[i].name);
        free(d[i].dp_group);
        free(d[i].host);
        free(d[i].tier.path);
        free(d[i].speculative.draft);
        free(d[i].devices);
    }
    free(d);
}

void td_cfg_free(td_cfg *c)
{
    if (!c) return;
    free(c->path);
    free(c->model);
    free(c->run_dir);
    free(c->router.listen);
    free(c->router.api_key);
    free(c->router.chat_template);
    free(c->router.tool_parser);
    free(c->router.membership.listen);
    free(c->router.membership.address);
    free(c->router.tls_cert);
    free(c->router.tls_key);
    free(c->router.tls_client_ca);
    for (int i = 0; i < c->n_prefill; i++) {
        td_cfg_prefill *x = &c->prefill[i];
        free(x->name);
        free(x->layer_partition);
        free(x->devices);
        for (int h = 0; x->hosts && h < x->n_hosts; h++)
            free(x->hosts[h]);
        free(x->hosts);
    }
    free(c->prefill);
    cfg_free_decodes(c->decode, c->n_decode);
    free(c->kvxfer.ucx_tls);
    free(c->security.ca);
    free(c->security.cert);
    free(c->security.key);
    free(c);
}
