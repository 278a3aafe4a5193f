/* fuzz_gguf.c: libFuzzer target for the GGUF reader (common/gguf.c).
 *
 * Every input is parsed with td_gguf_open_buffer straight from libFuzzer's exact-size
 * buffer, so AddressSanitizer reports any read outside it. When the parse succeeds, every
 * key, scalar, string, array element and tensor byte is read through the public accessors,
 * which must never leave the buffer either. A failed parse must leave *out NULL and say why.
 *
 * Built by scripts/test.sh with clang -fsanitize=fuzzer,address,undefined; seeds come from
 * tests/ref/make_malformed.py's corpus (and tests/fuzz/gguf.dict helps it find fields).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"

static volatile uint64_t sink; /* keeps the reads from being optimized away */

static uint64_t sum_bytes(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t s = 0;
    for (size_t i = 0; i < n; i++)
        s += b[i];
    return s;
}

static void walk_kv(const td_gguf *g, size_t i)
{
    const char *key = td_gguf_kv_key(g, i);
    if (!key) abort();                                  /* a successful open must name every key */
    if (td_gguf_find_kv(g, key) != (int64_t)i) abort(); /* keys are unique */
    const char *s;
    size_t len;
    switch (td_gguf_kv_type(g, i)) {
    case TD_GGUF_STRING:
        if (td_gguf_get_str(g, key, &s, &len)) abort();
        sink += sum_bytes(s, len);
        break;
    case TD_GGUF_ARRAY: {
        td_gguf_vtype et;
        size_t n;
        if (td_gguf_get_arr(g, key, &et, &n)) abort();
        if (et == TD_GGUF_STRING) {
            for (size_t j = 0; j < n; j++) {
                if (td_gguf_arr_str(g, key, j, &s, &len)) abort();
                sink += sum_bytes(s, len);
            }
            break;
        }
        int32_t *iv = malloc((n ? n : 1) * sizeof *iv);
        float *fv = malloc((n ? n : 1) * sizeof *fv);
        if (iv && fv) {
            if (!td_gguf_arr_read_i32(g, key, iv, n)) sink += sum_bytes(iv, n * sizeof *iv);
            if (!td_gguf_arr_read_f32(g, key, fv, n)) sink += sum_bytes(fv, n * sizeof *fv);
        }
        free(iv);
        free(fv);
        break;
    }
    default: {
        int64_t v;
        uint32_t u;
        float f;
        bool b;
        if (!td_gguf_get_i64(g, key, &v)) sink += (uint64_t)v;
        if (!td_gguf_get_u32(g, key, &u)) sink += u;
        if (!td_gguf_get_f32(g, key, &f)) sink += sum_bytes(&f, sizeof f);
        if (!td_gguf_get_bool(g, key, &b)) sink += b;
        break;
    }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    td_gguf *g = NULL;
    char err[256] = "";
    int rc = td_gguf_open_buffer(data, size, &g, err, sizeof err);
    if (rc) {
        if (g || !err[0]) abort(); /* errors leave nothing open and always say why */
        return 0;
    }
    sink += td_gguf_version(g) + td_gguf_alignment(g);
    for (size_t i = 0; i < td_gguf_n_kv(g); i++)
        walk_kv(g, i);
    for (size_t i = 0; i < td_gguf_n_tensors(g); i++) {
        const td_gguf_tensor *t = td_gguf_tensor_at(g, i);
        if (!t || td_gguf_find_tensor(g, t->name) != t) abort();
        const uint8_t *p = t->data;
        if (p < data || t->nbytes > size || (size_t)(p - data) > size - t->nbytes) abort();
        sink += sum_bytes(t->data, t->nbytes);
    }
    td_gguf_close(g);
    return 0;
}
