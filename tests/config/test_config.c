/* test_config.c: the cluster YAML (common/config.h).
 *
 * usage: test_config DIR [EXAMPLE.yaml...]
 * Writes a table of bad files into DIR (the build tree), loads each and checks the
 * "FILE:LINE:COLUMN: message" it gives; loads a good file and checks every value and
 * default; then loads each example given on the command line (the files in deploy/).
 */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "config.h"
#include "td_err.h"
#include "tharness.h"

static const char *dir; /* where the test's YAML files are written (main) */

static const char *write_file(const char *name, const char *text)
{
    static char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return NULL;
    fputs(text, f);
    fclose(f);
    return path;
}

#define MIN "model: /m.gguf\ndecode:\n  - name: d0\n"

typedef struct {
    const char *name;
    const char *text;
    int line, col;
    const char *msg; /* substring of the message after "FILE:LINE:COL: " */
} bad_case;

static const bad_case bad_cases[] = {
    {"empty", "", 1, 1, "empty configuration"},
    {"not_mapping", "- a\n- b\n", 1, 1, "expected a mapping at the top level, got a list"},
    {"syntax", "model: /m\ndecode: [\n", 3, 1, "yaml: "},
    {"tab_indent", "model: /m\ndecode:\n\t- name: d0\n", 3, 1, "yaml: "},
    {"no_model", "decode:\n  - name: d0\n", 1, 1, "missing required key 'model'"},
    {"no_decode", "model: /m\n", 1, 1, "no decode instance"},
    {"empty_decode", "model: /m\ndecode: []\n", 2, 9, "no decode instance"},
    {"unknown_top", MIN "modle: x\n", 4, 1, "unknown key 'modle' in the top level"},
    {"dup_top", MIN "model: /n\n", 4, 1,
     "duplicate key 'model' in the top level (first at line 1)"},
    {"backend", "model: /m\nbackend: tpu\ndecode:\n  - name: d0\n", 2, 10, "unknown backend 'tpu'"},
    {"cpu_act", "model: /m\ncpu_act: q4\ndecode:\n  - name: d0\n", 2, 10, "unknown cpu_act 'q4'"},
    {"cpu_act_cuda", "model: /m\nbackend: cuda\ncpu_act: q8\ndecode:\n  - name: d0\n", 3, 10,
     "cpu_act: only for the cpu backends"},
    {"router_type", MIN "router: 5\n", 4, 9, "router: expected a mapping, got a string"},
    {"router_unknown", MIN "router:\n  listen: 127.0.0.1:8000\n  max_qeue: 3\n", 6, 3,
     "unknown key 'max_qeue' in router"},
    {"router_listen", MIN "router:\n  listen: localhost\n", 5, 11, "expected HOST:PORT"},
    {"router_port", MIN "router:\n  listen: 1.2.3.4:70000\n", 5, 11, "expected HOST:PORT"},
    {"router_queue_neg", MIN "router:\n  max_queue: -1\n", 5, 14, "-1 is out of range [1, "},
    {"router_queue_str", MIN "router:\n  max_queue: lots\n", 5, 14,
     "expected an integer, got 'lots'"},
    {"router_queue_quoted", MIN "router:\n  max_queue: \"5\"\n", 5, 14,
     "expected an integer, got a string"},
    {"router_template", MIN "router:\n  chat_template: jinja\n", 5, 18,
     "chat_template 'jinja' is neither chatml"},
    {"router_tool_parser", MIN "router:\n  tool_parser: llama3\n", 5, 16,
     "unknown tool_parser 'llama3' (known: auto, hermes, llama3_json"},
    {"router_tls_cert_only", MIN "router:\n  tls_cert: /c.pem\n", 5, 3,
     "router: tls_cert is given but tls_key is missing (give both)"},
    {"router_tls_key_only", MIN "router:\n  tls_key: ~/k.pem\n", 5, 3,
     "router: tls_key is given but tls_cert is missing (give both)"},
    {"router_tls_ca_only", MIN "router:\n  tls_client_ca: /ca.pem\n", 5, 3,
     "router: tls_client_ca needs tls_cert and tls_key"},
    {"router_tls_empty", MIN "router:\n  tls_cert: \"\"\n  tls_key: /k.pem\n", 5, 13, "empty path"},
    {"router_req_timeout",
     MIN "router:\n  max_request_timeout_ms: 1000\n  request_timeout_ms: 2000\n", 6, 23,
     "request_timeout_ms (2000) is larger than max_request_timeout_ms (1000)"},
    {"router_req_timeout_zero", MIN "router:\n  request_timeout_ms: 0\n", 5, 23,
     "0 is out of range [1, 86400000]"},
    {"router_drain_neg", MIN "router:\n  drain_timeout_ms: -1\n", 5, 21,
     "-1 is out of range [0, 3600000]"},
    {"router_routing", MIN "router:\n  routing: prefix\n", 5, 12,
     "unknown routing 'prefix' (known: load, cache_aware, round_robin)"},
    {"router_cache_key", MIN "router:\n  cache_aware:\n    threshold: 0.5\n", 6, 5,
     "unknown key 'threshold' in router.cache_aware"},
    {"router_cache_rel", MIN "router:\n  cache_aware:\n    balance_rel_threshold: 0.5\n", 6, 28,
     "0.5 is out of range [1, 1000]"},
    {"router_cache_thr", MIN "router:\n  cache_aware:\n    cache_threshold: 1.5\n", 6, 22,
     "1.5 is out of range [0, 1]"},
    {"membership_key", MIN "router:\n  membership:\n    lease: 5\n", 6, 5,
     "unknown key 'lease' in router.membership"},
    {"membership_listen", MIN "router:\n  membership:\n    listen: router\n", 6, 13,
     "expected HOST:PORT"},
    {"membership_lease", MIN "router:\n  membership:\n    listen: 0.0.0.0:9300\n    lease_ms: 5\n",
     7, 15, "5 is out of range [100, 3600000]"},
    {"membership_no_listen", MIN "router:\n  membership:\n    address: r:9300\n", 6, 5,
     "router.membership: address is given but listen is not"},
    {"decode_drain", MIN "    drain_timeout_ms: -5\n", 4, 23, "-5 is out of range [0, 3600000]"},
    {"prefill_drain", MIN "prefill:\n  - name: p0\n    drain_timeout_ms: 3600001\n", 6, 23,
     "3600001 is out of range [0, 3600000]"},
    {"decode_not_list", "model: /m\ndecode:\n  name: d0\n", 3, 3,
     "decode: expected a list of instances, got a mapping"},
    {"decode_no_name", "model: /m\ndecode:\n  - tp: 2\n", 3, 5,
     "decode[0]: missing required key 'name'"},
    {"decode_bad_name", "model: /m\ndecode:\n  - name: d 0\n", 3, 11, "instance name 'd 0'"},
    {"decode_tp_zero", MIN "    tp: 0\n", 4, 9, "0 is out of range [1, 64]"},
    {"decode_tp_float", MIN "    tp: 1.5\n", 4, 9, "expected an integer, got '1.5'"},
    {"decode_tp_list", MIN "    tp: [1]\n", 4, 9, "expected an integer, got a list"},
    {"decode_ep_not_tp", MIN "    tp: 4\n    ep: 2\n", 5, 9, "ep 2: 1 or the instance's tp (4)"},
    {"decode_ep_zero", MIN "    ep: 0\n", 4, 9, "0 is out of range [1, 64]"},
    {"decode_dp_tp", MIN "    dp: 2\n    tp: 2\n", 4, 9,
     "dp 2: each member holds the model whole but its experts; tp and ep stay 1 (tp 2, ep 1)"},
    {"decode_tbo_tp1", MIN "    tbo_min_tokens: 8\n", 4, 21,
     "tbo_min_tokens (two-batch overlap) needs tp >= 2 and no dp (tp 1, dp 1)"},
    {"decode_tbo_dp", MIN "    dp: 2\n    tbo_min_tokens: 8\n", 5, 21,
     "needs tp >= 2 and no dp (tp 1, dp 2)"},
    {"decode_tbo_negative", MIN "    tp: 2\n    tbo_min_tokens: -1\n", 5, 21,
     "-1 is out of range [0, 1048576]"},
    {"decode_dp_mtp", MIN "    dp: 2\n    speculative:\n      method: mtp\n", 6, 7,
     "speculative method mtp with dp > 1 is not built yet"},
    {"decode_dp_clash", MIN "    dp: 2\n  - name: d1\n    port: 9001\n", 6, 11,
     "control port 9001 on 127.0.0.1 is already used by instance 'd0.1'"},
    {"decode_dp_name_clash", MIN "    dp: 2\n  - name: d0.1\n", 5, 11,
     "duplicate instance name 'd0.1'"},
    {"decode_dp_long_name",
     "model: /m\ndecode:\n  - name: "
     "abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyzabcdefghijk\n"
     "    dp: 2\n",
     3, 11,
     "dp 2: member name 'abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyzabcdefghijk.0' is "
     "longer than 63 bytes"},
    {"decode_dp_port_range", MIN "    dp: 3\n    port: 65534\n", 5, 11,
     "dp 3: member 2's port 65536 is beyond 65535"},
    {"decode_share_auto_no_itl", MIN "    share_cores: auto\n", 4, 18,
     "share_cores: auto claims the cores while steps run longer than itl_target_ms: set "
     "itl_target_ms (> 0)"},
    {"decode_share_text", MIN "    share_cores: maybe\n", 4, 18,
     "share_cores: expected true, false or auto, got maybe"},
    {"decode_share_list", MIN "    share_cores: [1]\n", 4, 18,
     "share_cores: expected true, false or auto, got a list"},
    {"decode_itl_neg", MIN "    itl_target_ms: -5\n", 4, 20, "-5 is out of range [0, 600000]"},
    {"decode_itl_text", MIN "    itl_target_ms: fast\n", 4, 20, "expected a number, got 'fast'"},
    {"decode_overlap_text", MIN "    overlap: sometimes\n", 4, 14,
     "expected true or false, got 'sometimes'"},
    {"spec_type", MIN "    speculative: ngram\n", 4, 18,
     "decode[0].speculative: expected a mapping, got a string"},
    {"spec_unknown", MIN "    speculative:\n      k: 4\n", 5, 7,
     "unknown key 'k' in decode[0].speculative (known: method, draft, max_tokens, adaptive, "
     "gate, ngram_min, ngram_max)"},
    {"spec_method", MIN "    speculative:\n      method: eagle\n", 5, 15,
     "unknown speculative method 'eagle' (known: ngram, draft, mtp, off)"},
    {"spec_draft_missing", MIN "    speculative:\n      method: draft\n", 5, 15,
     "decode[0].speculative: method draft needs draft (the draft model's GGUF)"},
    {"spec_draft_ngram", MIN "    speculative:\n      method: ngram\n      draft: /d.gguf\n", 6, 7,
     "decode[0].speculative: draft is the draft model of method draft, not ngram"},
    {"spec_draft_off", MIN "    speculative:\n      draft: /d.gguf\n      method: \"off\"\n", 5, 7,
     "draft is the draft model of method draft, not off"},
    {"spec_draft_mtp", MIN "    speculative:\n      method: mtp\n      draft: /d.gguf\n", 6, 7,
     "draft is the draft model of method draft, not mtp"},
    {"spec_draft_empty", MIN "    speculative:\n      draft: \"\"\n", 5, 14, "empty path"},
    {"spec_draft_list", MIN "    speculative:\n      draft: [a.gguf]\n", 5, 14,
     "expected a string, got a list"},
    {"spec_method_null", MIN "    speculative:\n      method:\n", 5, 14,
     "expected a string, got nothing (null)"},
    {"spec_max_zero", MIN "    speculative:\n      max_tokens: 0\n", 5, 19,
     "0 is out of range [1, 32]"},
    {"spec_max_big", MIN "    speculative:\n      max_tokens: 33\n", 5, 19,
     "33 is out of range [1, 32]"},
    {"spec_adaptive", MIN "    speculative:\n      adaptive: sometimes\n", 5, 17,
     "expected true or false, got 'sometimes'"},
    {"spec_min_zero", MIN "    speculative:\n      ngram_min: 0\n", 5, 18,
     "0 is out of range [1, 16]"},
    {"spec_max_ngram_big", MIN "    speculative:\n      ngram_max: 17\n", 5, 18,
     "17 is out of range [1, 16]"},
    {"spec_min_gt_max", MIN "    speculative:\n      ngram_min: 3\n      ngram_max: 2\n", 5, 18,
     "decode[0].speculative: ngram_min (3) is larger than ngram_max (2)"},
    {"spec_min_gt_default_max", MIN "    speculative:\n      ngram_min: 5\n", 5, 18,
     "ngram_min (5) is larger than ngram_max (4)"},
    {"spec_max_lt_default_min", MIN "    speculative:\n      ngram_max: 1\n", 5, 18,
     "ngram_min (2) is larger than ngram_max (1)"},
    {"spec_dup", MIN "    speculative:\n      max_tokens: 4\n      max_tokens: 5\n", 6, 7,
     "duplicate key 'max_tokens' in decode[0].speculative (first at line 5)"},
    {"pd_block_mismatch",
     "model: /m\nprefill:\n  - name: p0\ndecode:\n  - name: d0\n  - name: d1\n    block_size: 32\n",
     6, 11, "with prefill instances every decode instance needs the same"},
    {"prefill_kv_tokens",
     "model: /m\nprefill:\n  - name: p0\n    kv_tokens: 10\ndecode:\n  - name: d0\n", 4, 16,
     "10 is out of range"},
    {"decode_block", MIN "    block_size: 24\n", 4, 17, "block_size 24 is not a power of two"},
    {"decode_both_kv", MIN "    kv_blocks: 10\n    kv_memory: 1GiB\n", 5, 5,
     "give kv_blocks or kv_memory, not both"},
    {"decode_kv_memory", MIN "    kv_memory: 1 gigabyte\n", 4, 16, "expected a size"},
    {"decode_kv_memory_small", MIN "    kv_memory: 10\n", 4, 16, "smaller than 4096 bytes"},
    {"decode_dtype", MIN "    kv_dtype: q8\n", 4, 15, "kv_dtype 'q8'"},
    {"decode_unknown", MIN "    treads: 4\n", 4, 5, "unknown key 'treads' in decode[0]"},
    {"decode_dup_key", MIN "    tp: 1\n    tp: 2\n", 5, 5,
     "duplicate key 'tp' in decode[0] (first at line 4)"},
    {"decode_null_tp", MIN "    tp:\n", 4, 8, "expected an integer, got nothing (null)"},
    {"dup_names", MIN "  - name: d0\n", 4, 11, "duplicate instance name 'd0' (first at line 3)"},
    {"dup_names_roles", "model: /m\nprefill:\n  - name: x\ndecode:\n  - name: x\n", 5, 11,
     "duplicate instance name 'x' (first at line 3)"},
    {"dup_ports", MIN "    port: 9100\n  - name: d1\n    port: 9100\n", 6, 11,
     "control port 9100 on 127.0.0.1 is already used by instance 'd0'"},
    {"prefill_partition", MIN "prefill:\n  - name: p0\n    pp: 2\n    layer_partition: [30]\n", 7,
     22, "layer_partition has 1 entries but pp is 2"},
    {"prefill_partition_zero",
     MIN "prefill:\n  - name: p0\n    pp: 2\n    layer_partition: [30, 0]\n", 7, 27,
     "0 is out of range [1, 65536]"},
    {"prefill_hosts", MIN "prefill:\n  - name: p0\n    pp: 2\n    hosts: [a]\n", 7, 12,
     "hosts has 1 entries but pp is 2"},
    {"prefill_smooth", MIN "prefill:\n  - name: p0\n    smooth_factor: 1.5\n", 6, 20,
     "1.5 is out of range [0, 1]"},
    {"prefill_dyn", MIN "prefill:\n  - name: p0\n    dynamic_chunking: maybe\n", 6, 23,
     "expected true or false, got 'maybe'"},
    {"prefill_item", MIN "prefill:\n  - p0\n", 5, 5, "prefill[0]: expected a mapping"},
    {"devices_cpu", MIN "    devices: [0]\n", 4, 14, "devices: only for backend cuda"},
    {"devices_count",
     "model: /m\nbackend: cuda\ndecode:\n  - name: d0\n    tp: 2\n    devices: [0]\n", 6, 14,
     "devices has 1 entries but tp is 2 (one per rank)"},
    {"devices_range", "model: /m\nbackend: cuda\ndecode:\n  - name: d0\n    devices: [-1]\n", 5, 15,
     "-1 is out of range [0, 1023]"},
    {"prefill_devices",
     "model: /m\nbackend: cuda\nprefill:\n  - name: p0\n    pp: 2\n    devices: [1, 2, 3]\n"
     "decode:\n  - name: d0\n",
     6, 14, "devices has 3 entries but pp is 2 (one per stage)"},
    {"kvxfer_unknown", MIN "kvxfer:\n  tls: tcp\n", 5, 3, "unknown key 'tls' in kvxfer"},
    {"kvxfer_timeout", MIN "kvxfer:\n  timeout_ms: 0\n", 5, 15, "0 is out of range"},
    {"two_docs", MIN "---\nmodel: /x\n", 5, 1, "more than one YAML document"},
    {"security_no_ca", MIN "security:\n  cert: /c.pem\n  key: /k.pem\n", 5, 3,
     "security: missing required key 'ca'"},
    {"security_unknown", MIN "security:\n  ca_file: /c.pem\n", 5, 3,
     "unknown key 'ca_file' in security"},
    {"security_unreadable", MIN "security:\n  ca: /nonexistent/ca.pem\n  cert: /c\n  key: /k\n", 5,
     7, "security.ca: cannot read '/nonexistent/ca.pem': No such file or directory"},
    {"nonscalar_key", MIN "? [a]\n: 1\n", 4, 3, "keys must be strings"},
};

static void test_bad_files(void)
{
    char err[512];
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        const bad_case *b = &bad_cases[i];
        char name[128];
        snprintf(name, sizeof name, "bad-%s.yaml", b->name);
        const char *path = write_file(name, b->text);
        TH_REQUIRE(path);
        char want[1200];
        snprintf(want, sizeof want, "%s:%d:%d: ", path, b->line, b->col);
        td_cfg *c = NULL;
        int rc = td_cfg_load(path, &c, err, sizeof err);
        TH_CHECKF(rc < 0 && !c, "%s: loaded", b->name);
        TH_CHECKF(!strncmp(err, want, strlen(want)) && strstr(err, b->msg),
                  "%s: got '%s', want '%s%s'", b->name, err, want, b->msg);
        td_cfg_free(c);
    }
    td_cfg *c = NULL;
    char missing[1024];
    snprintf(missing, sizeof missing, "%s/does-not-exist.yaml", dir);
    TH_CHECK(td_cfg_load(missing, &c, err, sizeof err) == TD_EIO && !c);
    TH_CHECK(strstr(err, "does-not-exist.yaml:1:1: cannot open") != NULL);
}

/* security: the three files, read at load; absent: all NULL (plain tcp) */
static void test_security(void)
{
    char ca[600], cert[600], key[600], text[2400], err[512];
    snprintf(ca, sizeof ca, "%s", write_file("sec-ca.pem", "ca\n"));
    snprintf(cert, sizeof cert, "%s", write_file("sec-cert.pem", "cert\n"));
    snprintf(key, sizeof key, "%s", write_file("sec-key.pem", "key\n"));
    snprintf(text, sizeof text, MIN "security:\n  ca: %s\n  cert: %s\n  key: %s\n", ca, cert, key);
    td_cfg *c = NULL;
    TH_REQUIRE(td_cfg_parse(text, strlen(text), "sec.yaml", &c, err, sizeof err) == 0);
    TH_CHECK(!strcmp(c->security.ca, ca) && !strcmp(c->security.cert, cert) &&
             !strcmp(c->security.key, key));
    td_cfg_free(c);
    TH_REQUIRE(td_cfg_parse(MIN, strlen(MIN), "plain.yaml", &c, err, sizeof err) == 0);
    TH_CHECK(!c->security.ca && !c->security.cert && !c->security.key);
    td_cfg_free(c);
    /* a key that is missing is named with its line */
    snprintf(text, sizeof text, MIN "security:\n  ca: %s\n  cert: %s\n  key: %s/nope.pem\n", ca,
             cert, dir);
    TH_CHECK(td_cfg_parse(text, strlen(text), "sec.yaml", &c, err, sizeof err) == TD_EINVAL && !c);
    TH_CHECKF(strstr(err, "sec.yaml:7:8: security.key: cannot read") != NULL, "%s", err);
    /* TD_CFG_NO_FILE_CHECKS (tandem k8s render): the same file loads, paths kept; the keys
       are still required */
    TH_REQUIRE(td_cfg_parse_flags(text, strlen(text), "sec.yaml", TD_CFG_NO_FILE_CHECKS, &c, err,
                                  sizeof err) == 0);
    TH_CHECK(c->security.key && strstr(c->security.key, "/nope.pem") != NULL);
    td_cfg_free(c);
    snprintf(text, sizeof text, MIN "security:\n  ca: %s\n  cert: %s\n", ca, cert);
    TH_CHECK(td_cfg_parse_flags(text, strlen(text), "sec.yaml", TD_CFG_NO_FILE_CHECKS, &c, err,
                                sizeof err) == TD_EINVAL &&
             !c);
    TH_CHECKF(strstr(err, "missing required key 'key'") != NULL, "%s", err);
}

static void test_good_file(void)
{
    const char *text = "# a full file\n"
                       "model: ~/models/m.gguf\n"
                       "backend: cuda\n"
                       "run_dir: /tmp/run\n"
                       "router:\n"
                       "  listen: 0.0.0.0:8080\n"
                       "  api_key: \"sk-test\"\n"
                       "  max_queue: 10\n"
                       "  max_prompt_tokens: 2048\n"
                       "  max_tokens: 100\n"
                       "  chat_template: chatml\n"
                       "  tool_parser: kimi_k2\n"
                       "  heartbeat_ms: 250\n"
                       "  instance_timeout_ms: 1000\n"
                       "  request_timeout_ms: 5000\n"
                       "  max_request_timeout_ms: 60000\n"
                       "  drain_timeout_ms: 0\n"
                       "  routing: cache_aware\n"
                       "  cache_aware:\n"
                       "    cache_threshold: 0.25\n"
                       "    balance_abs_threshold: 8\n"
                       "    balance_rel_threshold: 1.5\n"
                       "  tls_cert: ~/tls/cert.pem\n"
                       "  tls_key: /etc/tandem/key.pem\n"
                       "  tls_client_ca: ca.pem\n"
                       "  membership:\n"
                       "    listen: 0.0.0.0:9300\n"
                       "    address: tandem-router:9300\n"
                       "    lease_ms: 2000\n"
                       "    seed: false\n"
                       "    max_instances: 8\n"
                       "prefill:\n"
                       "  - name: p0\n"
                       "    pp: 2\n"
                       "    layer_partition: [14, 16]\n"
                       "    chunk_size: 256\n"
                       "    dynamic_chunking: false\n"
                       "    smooth_factor: 0.6\n"
                       "    threads: 2\n"
                       "    hosts: [10.0.0.1, 10.0.0.2]\n"
                       "    kv_tokens: 4096\n"
                       "    max_queue: 8\n"
                       "    profile_budget_ms: 0\n"
                       "    devices: [0, 1]\n"
                       "  - name: p1\n"
                       "decode:\n"
                       "  - name: d0\n"
                       "    tp: 3\n"
                       "    ep: 3\n"
                       "    host: 10.0.0.3\n"
                       "    threads: 4\n"
                       "    block_size: 32\n"
                       "    kv_memory: 1GiB\n"
                       "    max_batch: 16\n"
                       "    step_tokens: 128\n"
                       "    itl_target_ms: 75.5\n"
                       "    share_cores: auto\n"
                       "    overlap: true\n"
                       "    drain_timeout_ms: 15000\n"
                       "    speculative:\n"
                       "      method: off\n"
                       "      max_tokens: 32\n"
                       "      adaptive: false\n"
                       "      gate: false\n"
                       "      ngram_min: 3\n"
                       "      ngram_max: 3\n"
                       "    kv_dtype: f32\n"
                       "    port: 7000\n"
                       "    devices: [2, 3, 4]\n"
                       "  - name: d1\n"
                       "    block_size: 32\n"
                       "    kv_dtype: f32\n"
                       "  - name: d2\n"
                       "    block_size: 32\n"
                       "    kv_dtype: f32\n"
                       "    speculative:\n"
                       "      max_tokens: 1\n"
                       "      ngram_min: 1\n"
                       "      ngram_max: 16\n"
                       "kvxfer:\n"
                       "  ucx_tls: tcp\n"
                       "  timeout_ms: 5000\n";
    const char *path = write_file("good.yaml", text);
    TH_REQUIRE(path);
    char err[512];
    td_cfg *c = NULL;
    int rc = td_cfg_load(path, &c, err, sizeof err);
    TH_CHECKF(rc == 0, "%s", err);
    TH_REQUIRE(c);
    char model[1024];
    snprintf(model, sizeof model, "%s/models/m.gguf", getenv("HOME") ? getenv("HOME") : "~");
    TH_CHECKF(!strcmp(c->model, model), "%s", c->model);
    TH_CHECK(c->backend == TD_CFG_BACKEND_CUDA && !strcmp(c->run_dir, "/tmp/run"));
    TH_CHECK(!strcmp(c->router.listen, "0.0.0.0:8080") && !strcmp(c->router.api_key, "sk-test"));
    TH_CHECK(c->router.max_queue == 10 && c->router.max_prompt_tokens == 2048 &&
             c->router.max_tokens == 100 && !strcmp(c->router.chat_template, "chatml") &&
             !strcmp(c->router.tool_parser, "kimi_k2") && c->router.heartbeat_ms == 250 &&
             c->router.instance_timeout_ms == 1000);
    TH_CHECK(c->router.request_timeout_ms == 5000 && c->router.max_request_timeout_ms == 60000 &&
             c->router.drain_timeout_ms == 0);
    TH_CHECK(!strcmp(c->router.membership.listen, "0.0.0.0:9300") &&
             !strcmp(c->router.membership.address, "tandem-router:9300") &&
             c->router.membership.lease_ms == 2000 && !c->router.membership.seed &&
             c->router.membership.max_instances == 8);
    TH_CHECK(td_cfg_find_decode(c, "d0")->drain_timeout_ms == 15000 &&
             td_cfg_find_decode(c, "d1")->drain_timeout_ms == 0);
    TH_CHECK(c->router.routing == TD_CFG_ROUTING_CACHE_AWARE &&
             c->router.cache_aware.cache_threshold == 0.25 &&
             c->router.cache_aware.balance_abs_threshold == 8 &&
             c->router.cache_aware.balance_rel_threshold == 1.5);
    char tls_cert[1024];
    snprintf(tls_cert, sizeof tls_cert, "%s/tls/cert.pem", getenv("HOME") ? getenv("HOME") : "~");
    TH_CHECKF(c->router.tls_cert && !strcmp(c->router.tls_cert, tls_cert), "%s",
              c->router.tls_cert ? c->router.tls_cert : "(null)");
    TH_CHECK(c->router.tls_key && !strcmp(c->router.tls_key, "/etc/tandem/key.pem") &&
             c->router.tls_client_ca && !strcmp(c->router.tls_client_ca, "ca.pem"));
    TH_REQUIRE(c->n_prefill == 2 && c->n_decode == 3);
    const td_cfg_prefill *p = td_cfg_find_prefill(c, "p0");
    TH_REQUIRE(p);
    TH_CHECK(p->pp == 2 && p->n_layer_partition == 2 && p->layer_partition[0] == 14 &&
             p->layer_partition[1] == 16 && p->chunk_size == 256 && !p->dynamic_chunking &&
             p->smooth_factor == 0.6 && p->threads == 2 && p->n_hosts == 2 &&
             !strcmp(p->hosts[1], "10.0.0.2") && p->port == 9100 && p->kv_tokens == 4096 &&
             p->max_queue == 8 && p->profile_budget_ms == 0 && p->n_devices == 2 &&
             p->devices[0] == 0 && p->devices[1] == 1);
    p = td_cfg_find_prefill(c, "p1"); /* all defaults */
    TH_REQUIRE(p);
    TH_CHECK(p->pp == 1 && !p->layer_partition && p->chunk_size == 0 && p->dynamic_chunking &&
             p->smooth_factor == 0.75 && p->threads == 1 && p->n_hosts == 1 &&
             !strcmp(p->hosts[0], "127.0.0.1") && p->port == 9101 && p->kv_tokens == 32768 &&
             p->max_queue == 64 && p->profile_budget_ms == 20000);
    const td_cfg_decode *d = td_cfg_find_decode(c, "d0");
    TH_REQUIRE(d);
    TH_CHECK(d->tp == 3 && d->ep == 3 && !strcmp(d->host, "10.0.0.3") && d->threads == 4 &&
             d->block_size == 32 && d->kv_memory == (1ll << 30) && d->kv_blocks == 0 &&
             d->max_batch == 16 && d->step_tokens == 128 && d->itl_target_ms == 75.5 &&
             d->kv_dtype == TD_F32 && d->port == 7000 && d->overlap && d->n_devices == 3 &&
             d->devices[2] == 4 && d->share_cores == TD_CFG_SHARE_AUTO);
    TH_CHECK(d->speculative.method == TD_CFG_SPEC_OFF && d->speculative.max_tokens == 32 &&
             !d->speculative.adaptive && !d->speculative.gate && d->speculative.ngram_min == 3 &&
             d->speculative.ngram_max == 3);
    d = td_cfg_find_decode(c, "d2"); /* a partial map: the rest defaults */
    TH_REQUIRE(d);
    TH_CHECK(d->speculative.method == TD_CFG_SPEC_NGRAM && d->speculative.max_tokens == 1 &&
             d->speculative.adaptive && d->speculative.gate && d->speculative.ngram_min == 1 &&
             d->speculative.ngram_max == 16);
    d = td_cfg_find_decode(c, "d1");
    TH_REQUIRE(d);
    TH_CHECK(d->tp == 1 && d->ep == 1 && !strcmp(d->host, "127.0.0.1") && d->threads == 1 &&
             d->block_size == 32 && d->kv_blocks == 4096 && d->kv_memory == 0 &&
             d->max_batch == 64 && d->step_tokens == 512 && d->itl_target_ms == 0 &&
             d->kv_dtype == TD_F32 && d->port == 9001 && !d->overlap && !d->devices &&
             d->share_cores == TD_CFG_SHARE_OFF);
    TH_CHECK(d->speculative.method == TD_CFG_SPEC_NGRAM && d->speculative.max_tokens == 8 &&
             d->speculative.adaptive && d->speculative.ngram_min == 2 &&
             d->speculative.ngram_max == 4);
    TH_CHECK(!td_cfg_find_decode(c, "p0") && !td_cfg_find_prefill(c, "d0") &&
             !td_cfg_find_decode(c, "nope"));
    TH_CHECK(!strcmp(c->kvxfer.ucx_tls, "tcp") && c->kvxfer.timeout_ms == 5000);
    char url[128];
    TH_CHECK(td_cfg_ctrl_url(d->host, d->port, url, sizeof url) == 0 &&
             !strcmp(url, "tcp://127.0.0.1:9001"));
    TH_CHECK(td_cfg_ctrl_url("::1", 5, url, sizeof url) == 0 && !strcmp(url, "tcp://[::1]:5"));
    td_cfg_free(c);

    /* the minimal file: every default */
    TH_REQUIRE(td_cfg_parse(MIN, strlen(MIN), "min", &c, err, sizeof err) == 0);
    TH_CHECK(c->cpu_act == TD_CFG_ACT_ENV && td_cfg_act_name(c->cpu_act) == NULL);
    td_cfg_free(c);
    TH_REQUIRE(td_cfg_parse(MIN "cpu_act: q8\n", strlen(MIN "cpu_act: q8\n"), "q8", &c, err,
                            sizeof err) == 0);
    TH_CHECK(c->cpu_act == TD_CFG_ACT_Q8 && !strcmp(td_cfg_act_name(c->cpu_act), "q8"));
    td_cfg_free(c);
    TH_REQUIRE(td_cfg_parse(MIN "cpu_act: q16\n", strlen(MIN "cpu_act: q16\n"), "q16", &c, err,
                            sizeof err) == 0);
    TH_CHECK(c->cpu_act == TD_CFG_ACT_Q16 && !strcmp(td_cfg_act_name(c->cpu_act), "q16"));
    td_cfg_free(c);
    TH_REQUIRE(td_cfg_parse(MIN "cpu_act: f32\n", strlen(MIN "cpu_act: f32\n"), "f32", &c, err,
                            sizeof err) == 0);
    TH_CHECK(c->cpu_act == TD_CFG_ACT_F32 && !strcmp(td_cfg_act_name(c->cpu_act), "f32"));
    td_cfg_free(c);
    TH_REQUIRE(td_cfg_parse(MIN "cpu_act: auto\n", strlen(MIN "cpu_act: auto\n"), "auto", &c, err,
                            sizeof err) == 0);
    TH_CHECK(c->cpu_act == TD_CFG_ACT_AUTO && !strcmp(td_cfg_act_name(c->cpu_act), "auto"));
    td_cfg_free(c);
    TH_REQUIRE(td_cfg_parse(MIN, strlen(MIN), "min", &c, err, sizeof err) == 0);
    TH_CHECK(c->backend == TD_CFG_BACKEND_CPU && !strcmp(c->router.listen, "127.0.0.1:8000") &&
             !strcmp(c->router.api_key, "") && c->router.max_queue == 256 &&
             c->router.max_prompt_tokens == 8192 && c->router.request_timeout_ms == 600000 &&
             c->router.max_request_timeout_ms == 3600000 && c->router.drain_timeout_ms == 30000 &&
             c->n_prefill == 0 && !strcmp(c->kvxfer.ucx_tls, "sm,tcp,self") &&
             c->kvxfer.timeout_ms == 120000 && strstr(c->run_dir, ".cache/tandem/run"));
    TH_CHECK(c->router.routing == TD_CFG_ROUTING_LOAD &&
             c->router.cache_aware.cache_threshold == 0.5 &&
             c->router.cache_aware.balance_abs_threshold == 32 &&
             c->router.cache_aware.balance_rel_threshold == 1.1);
    TH_CHECK(!c->router.tls_cert && !c->router.tls_key && !c->router.tls_client_ca);
    TH_CHECK(!strcmp(c->router.membership.listen, "") &&
             !strcmp(c->router.membership.address, "") && c->router.membership.lease_ms == 5000 &&
             c->router.membership.seed && c->router.membership.max_instances == 64);
    td_cfg_free(c);
    /* membership.address defaults to its listen address (one machine) */
    const char *ml = MIN "router:\n  membership:\n    listen: 127.0.0.1:9300\n";
    TH_REQUIRE(td_cfg_parse(ml, strlen(ml), "ml", &c, err, sizeof err) == 0);
    TH_CHECK(!strcmp(c->router.membership.address, "127.0.0.1:9300"));
    td_cfg_free(c);
    TH_REQUIRE(td_cfg_parse(MIN, strlen(MIN), "min", &c, err, sizeof err) == 0);
    TH_CHECK(td_cfg_name_ok("d0-7f.x_1") && !td_cfg_name_ok("") && !td_cfg_name_ok("a b") &&
             !td_cfg_name_ok("a/b") && !td_cfg_name_ok(NULL));
    TH_CHECK(c->decode[0].speculative.method == TD_CFG_SPEC_NGRAM &&
             c->decode[0].speculative.max_tokens == 8 && c->decode[0].speculative.adaptive &&
             c->decode[0].speculative.ngram_min == 2 && c->decode[0].speculative.ngram_max == 4);
    td_cfg_free(c);

    /* speculative: an empty map, and each method by name (quoted or not) */
    static const struct {
        const char *text;
        td_cfg_spec_method method;
    } spec[] = {
        {MIN "    speculative:\n", TD_CFG_SPEC_NGRAM},
        {MIN "    speculative: {}\n", TD_CFG_SPEC_NGRAM},
        {MIN "    speculative:\n      method: ngram\n", TD_CFG_SPEC_NGRAM},
        {MIN "    speculative:\n      method: \"off\"\n", TD_CFG_SPEC_OFF},
        {MIN "    speculative: {method: off, adaptive: true}\n", TD_CFG_SPEC_OFF},
        {MIN "    speculative:\n      draft: ~/d.gguf\n", TD_CFG_SPEC_DRAFT},
        {MIN "    speculative: {method: draft, draft: /d.gguf}\n", TD_CFG_SPEC_DRAFT},
        {MIN "    speculative: {method: mtp}\n", TD_CFG_SPEC_MTP},
    };
    for (size_t i = 0; i < sizeof spec / sizeof spec[0]; i++) {
        TH_REQUIRE(td_cfg_parse(spec[i].text, strlen(spec[i].text), "spec", &c, err, sizeof err) ==
                   0);
        const td_cfg_spec *s = &c->decode[0].speculative;
        TH_CHECKF(s->method == spec[i].method && s->max_tokens == 8 && s->adaptive &&
                      s->ngram_min == 2 && s->ngram_max == 4,
                  "spec case %zu", i);
        /* draft: ~ expanded, and set for method draft only */
        TH_CHECKF(s->method == TD_CFG_SPEC_DRAFT
                      ? s->draft && !strcmp(s->draft + strlen(s->draft) - 7, "/d.gguf") &&
                            s->draft[0] == '/'
                      : !s->draft,
                  "spec case %zu: draft %s", i, s->draft ? s->draft : "(none)");
        td_cfg_free(c);
    }

    /* a smaller maximum alone lowers the default deadline with it */
    const char *lower = MIN "router:\n  max_request_timeout_ms: 20000\n";
    TH_REQUIRE(td_cfg_parse(lower, strlen(lower), "lower", &c, err, sizeof err) == 0);
    TH_CHECK(c->router.request_timeout_ms == 20000 && c->router.max_request_timeout_ms == 20000);
    td_cfg_free(c);
}

/* decode[].dp: the entry becomes its members, each its own instance; the ports follow
 * (the YAML's + K, or 9000 + the place in the list, later entries' too); each member its own
 * tier file. */
static void test_dp_members(void)
{
    const char *t = "model: /m.gguf\n"
                    "decode:\n"
                    "  - name: d0\n"
                    "    dp: 3\n"
                    "    prefix_cache_tier: {path: /tmp/tier, size: 1GiB}\n"
                    "  - name: d1\n"
                    "  - name: e\n"
                    "    dp: 2\n"
                    "    port: 7100\n";
    td_cfg *c = NULL;
    char err[512];
    TH_REQUIRE(td_cfg_parse(t, strlen(t), "dp.yaml", &c, err, sizeof err) == 0);
    TH_CHECK(c->n_decode == 6);
    const char *names[] = {"d0.0", "d0.1", "d0.2", "d1", "e.0", "e.1"};
    const int ports[] = {9000, 9001, 9002, 9003, 7100, 7101};
    const int dps[] = {3, 3, 3, 1, 2, 2}, ranks[] = {0, 1, 2, 0, 0, 1};
    for (int i = 0; i < 6 && i < c->n_decode; i++) {
        const td_cfg_decode *d = &c->decode[i];
        TH_CHECKF(!strcmp(d->name, names[i]) && d->port == ports[i] && d->dp == dps[i] &&
                      d->dp_rank == ranks[i],
                  "member %d: %s port %d dp %d rank %d", i, d->name, d->port, d->dp, d->dp_rank);
        TH_CHECK(dps[i] == 1 ? !d->dp_group : !strcmp(d->dp_group, i < 3 ? "d0" : "e"));
    }
    TH_CHECK(!strcmp(c->decode[1].tier.path, "/tmp/tier.1") && !c->decode[3].tier.path);
    td_cfg_free(c);
}

static void test_sizes(void)
{
    int64_t v;
    TH_CHECK(td_cfg_parse_size("1GiB", &v) == 0 && v == 1ll << 30);
    TH_CHECK(td_cfg_parse_size("512MiB", &v) == 0 && v == 512ll << 20);
    TH_CHECK(td_cfg_parse_size("1.5KiB", &v) == 0 && v == 1536);
    TH_CHECK(td_cfg_parse_size("2GB", &v) == 0 && v == 2000000000ll);
    TH_CHECK(td_cfg_parse_size("4096", &v) == 0 && v == 4096);
    TH_CHECK(td_cfg_parse_size("10 MiB", &v) == 0 && v == 10ll << 20);
    TH_CHECK(td_cfg_parse_size("1.3B", &v) == TD_EINVAL);
    TH_CHECK(td_cfg_parse_size("-1GiB", &v) == TD_EINVAL);
    TH_CHECK(td_cfg_parse_size("1GiBs", &v) == TD_EINVAL);
    TH_CHECK(td_cfg_parse_size("GiB", &v) == TD_EINVAL);
    TH_CHECK(td_cfg_parse_size("100000000TiB", &v) == TD_ERANGE);
}

static char **examples;
static int n_examples;

static void test_examples(void)
{
    for (int i = 0; i < n_examples; i++) {
        char err[512];
        td_cfg *c = NULL;
        int rc = td_cfg_load(examples[i], &c, err, sizeof err);
        TH_CHECKF(rc == 0, "%s", err);
        if (c) TH_CHECK(c->n_decode >= 1 && td_cfg_find_decode(c, "d0"));
        td_cfg_free(c);
    }
}

int main(int argc, char **argv)
{
    /* the YAML files go to argv[1], or to a fresh temporary directory: never the current
     * one (a run by hand from the repository root left them there to be committed) */
    static char tmp[] = "/tmp/tandem-test-config-XXXXXX";
    if (argc > 1)
        dir = argv[1];
    else if (!(dir = mkdtemp(tmp))) {
        perror("mkdtemp");
        return 1;
    }
    mkdir(dir, 0755);
    examples = argv + 2;
    n_examples = argc > 2 ? argc - 2 : 0;
    TH_RUN(test_bad_files);
    TH_RUN(test_good_file);
    TH_RUN(test_dp_members);
    TH_RUN(test_security);
    TH_RUN(test_sizes);
    TH_RUN(test_examples);
    TH_EXIT();
}
