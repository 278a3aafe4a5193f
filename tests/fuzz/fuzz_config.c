/* fuzz_config.c: libFuzzer target for the cluster YAML loader (common/config.c).
 *
 * Every input goes through td_cfg_parse as the text of a config file. It must either give
 * a config that keeps the invariants config.h promises (every default filled in, one
 * entry per pipeline stage, exactly one of kv_blocks / kv_memory, unique names, lookups
 * that find every instance) or fail with a negative td_err, *out NULL and a
 * "NAME:LINE:COLUMN: ..." message; never crash, leak or read outside the input. A second
 * pass with a tiny error buffer checks that messages are truncated safely. Also feeds the
 * input (up to its first NUL) to td_cfg_parse_size and, on success, td_cfg_ctrl_url.
 *
 * Built by scripts/test.sh with clang -fsanitize=fuzzer,address,undefined; seeds are the
 * commented examples in deploy/ plus tests/fuzz/seeds-config/.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "td_err.h"

static volatile size_t sink;

static void check_cfg(const td_cfg *c)
{
    if (!c->path || !c->model || !c->run_dir || !c->router.listen || !c->router.api_key ||
        !c->router.chat_template || !c->kvxfer.ucx_tls)
        abort(); /* every string default is filled in */
    if (c->n_decode < 1 || !c->decode || c->n_prefill < 0 || (c->n_prefill && !c->prefill)) abort();
    char url[128];
    for (int i = 0; i < c->n_prefill; i++) {
        const td_cfg_prefill *x = &c->prefill[i];
        if (!x->name || x->pp < 1 || x->pp > TD_CFG_MAX_PARALLEL || x->n_hosts != x->pp ||
            !x->hosts)
            abort();
        if (x->layer_partition && x->n_layer_partition != x->pp) abort();
        for (int k = 0; k < x->n_hosts; k++) {
            if (!x->hosts[k]) abort();
            sink += strlen(x->hosts[k]);
            if (td_cfg_ctrl_url(x->hosts[k], x->port, url, sizeof url) == 0) sink += strlen(url);
        }
        if (td_cfg_find_prefill(c, x->name) != x) abort(); /* names are unique */
        sink += (size_t)x->chunk_size + (size_t)x->threads;
    }
    for (int i = 0; i < c->n_decode; i++) {
        const td_cfg_decode *x = &c->decode[i];
        if (!x->name || !x->host || (x->kv_dtype != TD_F16 && x->kv_dtype != TD_F32) || x->tp < 1 ||
            x->tp > TD_CFG_MAX_PARALLEL)
            abort();
        if ((x->kv_blocks != 0) == (x->kv_memory != 0)) abort(); /* exactly one of them */
        if (x->block_size <= 0 || (x->block_size & (x->block_size - 1))) abort();
        if (td_cfg_find_decode(c, x->name) != x) abort();
        if (td_cfg_ctrl_url(x->host, x->port, url, sizeof url) == 0) sink += strlen(url);
    }
    sink += strlen(c->model) + strlen(c->run_dir) + strlen(c->router.listen);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int quiet;
    if (!quiet) {
        td_log_set_level(TD_LOG_ERROR);
        quiet = 1;
    }
    char err[512] = "";
    td_cfg *c = (td_cfg *)(uintptr_t)1; /* must be set to NULL on failure */
    int rc = td_cfg_parse((const char *)data, size, "fuzz.yaml", &c, err, sizeof err);
    if (rc) {
        if (rc >= 0 || c || strncmp(err, "fuzz.yaml", 9)) abort();
    } else {
        if (!c) abort();
        check_cfg(c);
        td_cfg_free(c);
    }
    /* the same with a buffer too small for any message: truncated, terminated, no overflow */
    char tiny[8];
    memset(tiny, 'x', sizeof tiny);
    c = NULL;
    int rc2 = td_cfg_parse((const char *)data, size, "fuzz.yaml", &c, tiny, sizeof tiny);
    if ((rc2 == 0) != (rc == 0)) abort(); /* deterministic */
    if (rc2) {
        if (c || !memchr(tiny, 0, sizeof tiny)) abort();
    } else {
        td_cfg_free(c);
    }
    /* the size parser on the text up to the first NUL (bounded, NUL-terminated copy) */
    size_t n = size < 64 ? size : 64;
    char s[65];
    memcpy(s, data, n);
    s[n] = 0;
    int64_t v = 0;
    if (td_cfg_parse_size(s, &v) == 0 && v < 0) abort();
    return 0;
}
