/* pl_hw.c: hardware profiles: the YAML loader (libyaml's document API, a field table, FILE:
 * LINE:COLUMN errors as common/config.c gives them) and the writer. */
#include "pl_hw.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "td_err.h"
#include "td_grow.h"

typedef enum { F_NUM, F_INT, F_STR, F_PEAK } fkind;

typedef struct {
    const char *key; /* "group.key" or "key" */
    fkind kind;
    size_t off;    /* into pl_hw */
    double lo, hi; /* accepted range of a number */
    double scale;  /* file unit -> pl_hw unit */
    int required;
} hw_field;

#define OFF(f) offsetof(pl_hw, f)
static const hw_field fields[] = {
    {"name", F_STR, OFF(name), 0, 0, 1, 1},
    {"devices_per_node", F_INT, OFF(devices_per_node), 1, 4096, 1, 1},
    {"memory_gib", F_NUM, OFF(mem_bytes), 1e-3, 1e6, 1073741824.0, 1},
    {"peak_tflops.fp8", F_NUM, OFF(peak_fp8), 1e-6, 1e6, 1e12, 0},
    {"peak_tflops.bf16", F_NUM, OFF(peak_bf16), 1e-6, 1e6, 1e12, 0},
    {"peak_tflops.f32", F_NUM, OFF(peak_f32), 1e-6, 1e6, 1e12, 0},
    {"matmul_type", F_PEAK, OFF(matmul_type), 0, 0, 1, 1},
    {"attention_type", F_PEAK, OFF(attention_type), 0, 0, 1, 1},
    {"hbm_gbps", F_NUM, OFF(hbm_bw), 1e-3, 1e6, 1e9, 1},
    {"nvlink_gbps", F_NUM, OFF(nvlink_bw), 1e-3, 1e6, 1e9, 1},
    {"net_gbps", F_NUM, OFF(net_bw), 1e-3, 1e6, 1e9, 1},
    {"latency_us.nvlink", F_NUM, OFF(nvlink_lat), 0, 1e6, 1e-6, 1},
    {"latency_us.net", F_NUM, OFF(net_lat), 0, 1e6, 1e-6, 1},
    {"efficiency.matmul", F_NUM, OFF(eff_matmul), 1e-6, 1, 1, 1},
    {"efficiency.attention", F_NUM, OFF(eff_attn), 1e-6, 1, 1, 1},
    {"efficiency.memory", F_NUM, OFF(eff_mem), 1e-6, 1, 1, 1},
    {"efficiency.nvlink", F_NUM, OFF(eff_nvlink), 1e-6, 1, 1, 1},
    {"efficiency.net", F_NUM, OFF(eff_net), 1e-6, 1, 1, 1},
    {"overhead_ms.chunk", F_NUM, OFF(chunk_overhead), 0, 1e6, 1e-3, 1},
    {"overhead_ms.step", F_NUM, OFF(step_overhead), 0, 1e6, 1e-3, 1},
    {"kv_transfer.gbps", F_NUM, OFF(kvx_bw), 1e-6, 1e6, 1e9, 0},
    {"kv_transfer.latency_us", F_NUM, OFF(kvx_lat), 0, 1e6, 1e-6, 0},
    {"one_node", F_INT, OFF(one_node), 0, 1, 1, 0},
    {"allreduce_us.tp2", F_NUM, OFF(ar_lat[2]), 0, 1e7, 1e-6, 0},
    {"allreduce_us.tp3", F_NUM, OFF(ar_lat[3]), 0, 1e7, 1e-6, 0},
    {"allreduce_us.tp4", F_NUM, OFF(ar_lat[4]), 0, 1e7, 1e-6, 0},
    {"decode_speedup.tp2", F_NUM, OFF(decode_speedup[2]), 0, 1e3, 1, 0},
    {"decode_speedup.tp3", F_NUM, OFF(decode_speedup[3]), 0, 1e3, 1, 0},
    {"decode_speedup.tp4", F_NUM, OFF(decode_speedup[4]), 0, 1e3, 1, 0},
    {"decode_speedup_ep.tp2", F_NUM, OFF(decode_speedup_ep[2]), 0, 1e3, 1, 0},
    {"decode_speedup_ep.tp3", F_NUM, OFF(decode_speedup_ep[3]), 0, 1e3, 1, 0},
    {"decode_speedup_ep.tp4", F_NUM, OFF(decode_speedup_ep[4]), 0, 1e3, 1, 0},
    {"prefill_speedup.tp2", F_NUM, OFF(prefill_speedup[2]), 0, 1e3, 1, 0},
    {"prefill_speedup.tp3", F_NUM, OFF(prefill_speedup[3]), 0, 1e3, 1, 0},
    {"prefill_speedup.tp4", F_NUM, OFF(prefill_speedup[4]), 0, 1e3, 1, 0},
    {"prefill_speedup_ep.tp2", F_NUM, OFF(prefill_speedup_ep[2]), 0, 1e3, 1, 0},
    {"prefill_speedup_ep.tp3", F_NUM, OFF(prefill_speedup_ep[3]), 0, 1e3, 1, 0},
    {"prefill_speedup_ep.tp4", F_NUM, OFF(prefill_speedup_ep[4]), 0, 1e3, 1, 0},
    {"decode_speedup_dp.tp2", F_NUM, OFF(decode_speedup_dp[2]), 0, 1e3, 1, 0},
    {"decode_speedup_dp.tp3", F_NUM, OFF(decode_speedup_dp[3]), 0, 1e3, 1, 0},
    {"decode_speedup_dp.tp4", F_NUM, OFF(decode_speedup_dp[4]), 0, 1e3, 1, 0},
    {"prefill_speedup_dp.tp2", F_NUM, OFF(prefill_speedup_dp[2]), 0, 1e3, 1, 0},
    {"prefill_speedup_dp.tp3", F_NUM, OFF(prefill_speedup_dp[3]), 0, 1e3, 1, 0},
    {"prefill_speedup_dp.tp4", F_NUM, OFF(prefill_speedup_dp[4]), 0, 1e3, 1, 0},
    {"decode_attention_us_per_token", F_NUM, OFF(decode_attn), 0, 1e6, 1e-6, 0},
};
#define N_FIELDS (sizeof fields / sizeof fields[0])

typedef struct {
    const char *what;
    char *err;
    size_t errcap;
    yaml_document_t *doc;
} hw_ctx;

static int fail(hw_ctx *c, const yaml_node_t *n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fail(hw_ctx *c, const yaml_node_t *n, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n)
        snprintf(c->err, c->errcap, "%s:%zu:%zu: %s", c->what, n->start_mark.line + 1,
                 n->start_mark.column + 1, msg);
    else
        snprintf(c->err, c->errcap, "%s: %s", c->what, msg);
    TD_LOG_ERR("planner: %s", c->err);
    return TD_EINVAL;
}

static const char *scalar(const yaml_node_t *n)
{
    return n && n->type == YAML_SCALAR_NODE ? (const char *)n->data.scalar.value : NULL;
}

static int set_field(hw_ctx *c, const hw_field *f, const yaml_node_t *v, pl_hw *hw)
{
    const char *s = scalar(v);
    if (!s || !s[0]) return fail(c, v, "%s: expected a value", f->key);
    char *base = (char *)hw + f->off;
    if (f->kind == F_STR || f->kind == F_PEAK) {
        size_t cap = f->kind == F_STR ? sizeof hw->name : sizeof hw->matmul_type;
        if (strlen(s) >= cap) return fail(c, v, "%s: '%s' is too long", f->key, s);
        if (f->kind == F_PEAK && strcmp(s, "fp8") && strcmp(s, "bf16") && strcmp(s, "f32"))
            return fail(c, v, "%s: '%s': expected fp8, bf16 or f32", f->key, s);
        memcpy(base, s, strlen(s) + 1);
        return 0;
    }
    char *end;
    errno = 0;
    double x = strtod(s, &end);
    if (errno || *end || !isfinite(x)) return fail(c, v, "%s: '%s' is not a number", f->key, s);
    if (f->kind == F_INT && x != floor(x))
        return fail(c, v, "%s: '%s' is not a whole number", f->key, s);
    if (x < f->lo || x > f->hi)
        return fail(c, v, "%s: %s is outside [%g, %g]", f->key, s, f->lo, f->hi);
    if (f->kind == F_INT)
        *(int *)(void *)base = (int)x;
    else
        *(double *)(void *)base = x * f->scale;
    return 0;
}

/* One key (top-level or "group.key") with its value node. */
static int take(hw_ctx *c, const char *key, const yaml_node_t *kn, const yaml_node_t *v, pl_hw *hw,
                unsigned char *seen)
{
    for (size_t i = 0; i < N_FIELDS; i++) {
        if (strcmp(fields[i].key, key)) continue;
        if (seen[i]) return fail(c, kn, "%s given twice", key);
        seen[i] = 1;
        return set_field(c, &fields[i], v, hw);
    }
    return fail(c, kn, "unknown key '%s'", key);
}

static double peak_of(const pl_hw *hw, const char *type)
{
    return !strcmp(type, "fp8")    ? hw->peak_fp8
           : !strcmp(type, "bf16") ? hw->peak_bf16
                                   : hw->peak_f32;
}

/* Required keys, the peaks the types name, the defaults of the optional keys. */
static int finish(hw_ctx *c, const yaml_node_t *root, const unsigned char *seen, pl_hw *hw)
{
    for (size_t i = 0; i < N_FIELDS; i++)
        if (fields[i].required && !seen[i]) return fail(c, root, "missing key '%s'", fields[i].key);
    hw->matmul_flops = peak_of(hw, hw->matmul_type);
    hw->attn_flops = peak_of(hw, hw->attention_type);
    if (hw->matmul_flops <= 0)
        return fail(c, root, "matmul_type %s has no peak_tflops.%s", hw->matmul_type,
                    hw->matmul_type);
    if (hw->attn_flops <= 0)
        return fail(c, root, "attention_type %s has no peak_tflops.%s", hw->attention_type,
                    hw->attention_type);
    if (hw->kvx_bw <= 0) {
        hw->kvx_bw = hw->net_bw * hw->eff_net;
        hw->kvx_lat = hw->net_lat;
    }
    return 0;
}

static int walk(hw_ctx *c, pl_hw *hw)
{
    yaml_node_t *root = yaml_document_get_root_node(c->doc);
    if (!root || root->type != YAML_MAPPING_NODE)
        return fail(c, root, "expected a mapping of the profile's keys");
    unsigned char seen[N_FIELDS] = {0};
    for (yaml_node_pair_t *p = root->data.mapping.pairs.start; p < root->data.mapping.pairs.top;
         p++) {
        yaml_node_t *k = yaml_document_get_node(c->doc, p->key);
        yaml_node_t *v = yaml_document_get_node(c->doc, p->value);
        const char *ks = scalar(k);
        if (!ks) return fail(c, k, "expected a key");
        int rc = 0;
        if (v->type != YAML_MAPPING_NODE) {
            rc = take(c, ks, k, v, hw, seen);
        } else {
            for (yaml_node_pair_t *q = v->data.mapping.pairs.start;
                 !rc && q < v->data.mapping.pairs.top; q++) {
                yaml_node_t *k2 = yaml_document_get_node(c->doc, q->key);
                char full[128];
                if (!scalar(k2)) return fail(c, k2, "expected a key");
                snprintf(full, sizeof full, "%s.%s", ks, scalar(k2));
                rc = take(c, full, k2, yaml_document_get_node(c->doc, q->value), hw, seen);
            }
        }
        if (rc) return rc;
    }
    return finish(c, root, seen, hw);
}

int pl_hw_parse(const char *text, size_t len, const char *what, pl_hw *hw, char *err, size_t errcap)
{
    char dummy[8];
    if (!err) {
        err = dummy;
        errcap = sizeof dummy;
    }
    err[0] = 0;
    memset(hw, 0, sizeof *hw);
    hw_ctx c = {.what = what, .err = err, .errcap = errcap};
    yaml_parser_t parser;
    yaml_document_t doc;
    if (!yaml_parser_initialize(&parser)) return TD_ENOMEM;
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    if (!yaml_parser_load(&parser, &doc)) {
        snprintf(err, errcap, "%s:%zu:%zu: not YAML: %s", what, parser.problem_mark.line + 1,
                 parser.problem_mark.column + 1, parser.problem ? parser.problem : "?");
        TD_LOG_ERR("planner: %s", err);
        yaml_parser_delete(&parser);
        return TD_EFORMAT;
    }
    c.doc = &doc;
    int rc = walk(&c, hw);
    yaml_document_delete(&doc);
    yaml_parser_delete(&parser);
    return rc;
}

int pl_hw_load(const char *path, pl_hw *hw, char *err, size_t errcap)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (err) snprintf(err, errcap, "%s: cannot open: %s", path, strerror(errno));
        TD_LOG_ERR("planner: %s: cannot open: %s", path, strerror(errno));
        return TD_EIO;
    }
    char *buf = NULL;
    size_t len = 0, cap = 0, n;
    char tmp[4096];
    while ((n = fread(tmp, 1, sizeof tmp, f)) > 0) {
        if (TD_GROW(buf, cap, len + n, 4096)) {
            free(buf);
            fclose(f);
            return TD_ENOMEM;
        }
        memcpy(buf + len, tmp, n);
        len += n;
    }
    fclose(f);
    int rc = pl_hw_parse(buf ? buf : "", len, path, hw, err, errcap);
    free(buf);
    return rc;
}

/* "key: {tp2: .., tp3: ..}" of the measured (> 0) entries of v[tp] times scale, or nothing. */
static void write_per_tp(FILE *f, const char *key, const double *v, double scale)
{
    bool first = true;
    for (int tp = 2; tp <= PL_HW_MAX_AR_TP; tp++)
        if (v[tp] > 0) {
            fprintf(f, "%s%stp%d: %.6g", first ? key : "", first ? ": {" : ", ", tp, v[tp] * scale);
            first = false;
        }
    if (!first) fprintf(f, "}\n");
}

int pl_hw_write(const pl_hw *hw, const char *comment, const char *path)
{
    FILE *f = fopen(path, "w");
    if (!f) {
        TD_LOG_ERR("planner: cannot write %s: %s", path, strerror(errno));
        return TD_EIO;
    }
    if (comment) fputs(comment, f);
    fprintf(f, "name: %s\ndevices_per_node: %d\nmemory_gib: %.3f\npeak_tflops:\n", hw->name,
            hw->devices_per_node, hw->mem_bytes / 1073741824.0);
    if (hw->peak_fp8 > 0) fprintf(f, "  fp8: %.6g\n", hw->peak_fp8 / 1e12);
    if (hw->peak_bf16 > 0) fprintf(f, "  bf16: %.6g\n", hw->peak_bf16 / 1e12);
    if (hw->peak_f32 > 0) fprintf(f, "  f32: %.6g\n", hw->peak_f32 / 1e12);
    fprintf(f, "matmul_type: %s\nattention_type: %s\n", hw->matmul_type, hw->attention_type);
    fprintf(f, "hbm_gbps: %.6g\nnvlink_gbps: %.6g\nnet_gbps: %.6g\n", hw->hbm_bw / 1e9,
            hw->nvlink_bw / 1e9, hw->net_bw / 1e9);
    fprintf(f, "latency_us: {nvlink: %.6g, net: %.6g}\n", hw->nvlink_lat * 1e6, hw->net_lat * 1e6);
    fprintf(f,
            "efficiency: {matmul: %.6g, attention: %.6g, memory: %.6g, nvlink: %.6g, net: %.6g}\n",
            hw->eff_matmul, hw->eff_attn, hw->eff_mem, hw->eff_nvlink, hw->eff_net);
    fprintf(f, "overhead_ms: {chunk: %.6g, step: %.6g}\n", hw->chunk_overhead * 1e3,
            hw->step_overhead * 1e3);
    fprintf(f, "kv_transfer: {gbps: %.6g, latency_us: %.6g}\n", hw->kvx_bw / 1e9,
            hw->kvx_lat * 1e6);
    if (hw->one_node) fprintf(f, "one_node: 1\n");
    write_per_tp(f, "decode_speedup", hw->decode_speedup, 1);
    write_per_tp(f, "decode_speedup_ep", hw->decode_speedup_ep, 1);
    write_per_tp(f, "prefill_speedup", hw->prefill_speedup, 1);
    write_per_tp(f, "prefill_speedup_ep", hw->prefill_speedup_ep, 1);
    write_per_tp(f, "decode_speedup_dp", hw->decode_speedup_dp, 1);
    write_per_tp(f, "prefill_speedup_dp", hw->prefill_speedup_dp, 1);
    if (hw->decode_attn > 0)
        fprintf(f, "decode_attention_us_per_token: %.6g\n", hw->decode_attn * 1e6);
    /* one mapping whatever tp counts were measured (closing it at the first gap left a tp
     * after the gap outside it) */
    write_per_tp(f, "allreduce_us", hw->ar_lat, 1e6);
    if (fclose(f)) {
        TD_LOG_ERR("planner: cannot write %s: %s", path, strerror(errno));
        return TD_EIO;
    }
    return 0;
}

double pl_hw_parallel(const pl_hw *hw, int n)
{
    int c = hw->devices_per_node;
    return hw->one_node && n > c ? (double)n / ((n + c - 1) / c) : n;
}
