/* fuzz_ctrl.c: libFuzzer target for the control-plane envelope decoder.
 *
 * Every input must decode or fail with a td_err, never crash, leak or read out of
 * bounds. Inputs that decode are encoded again; when that encoding decodes (it may not:
 * protobuf-c keeps unknown fields, even field number 0, and writes them back verbatim),
 * encoding it once more must give the same bytes. A pass with tight limits runs the
 * limit checks too.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ctrl.h"
#include "td_err.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int quiet;
    if (!quiet) {
        td_log_set_level(TD_LOG_ERROR);
        quiet = 1;
    }
    char err[256];
    Td__Envelope *e = NULL;
    int rc = td_ctrl_decode(data, size, NULL, &e, err, sizeof err);
    if (rc) {
        if (e || rc >= 0 || !err[0]) abort(); /* failures are negative, explained, clean */
        return 0;
    }
    uint8_t *buf = NULL;
    size_t len = 0;
    if (td_ctrl_encode(e, NULL, &buf, &len)) abort();
    Td__Envelope *e2 = NULL;
    uint8_t *buf2 = NULL;
    size_t len2 = 0;
    rc = td_ctrl_decode(buf, len, NULL, &e2, err, sizeof err);
    if (rc == 0) {
        if (td_ctrl_encode(e2, NULL, &buf2, &len2)) abort();
        uint8_t *buf3 = NULL;
        size_t len3 = 0;
        Td__Envelope *e4 = NULL;
        if (td_ctrl_decode(buf2, len2, NULL, &e4, err, sizeof err)) abort();
        if (td_ctrl_encode(e4, NULL, &buf3, &len3)) abort();
        if (len3 != len2 || memcmp(buf2, buf3, len2)) abort();
        free(buf3);
        td_ctrl_envelope_free(e4);
    } else if (e2 || rc >= 0 || !err[0]) {
        abort();
    }
    td_ctrl_opts tight = {.max_msg_bytes = 64, .max_tokens = 4};
    Td__Envelope *e3 = NULL;
    if (td_ctrl_decode(buf, len, &tight, &e3, err, sizeof err) == 0) td_ctrl_envelope_free(e3);
    free(buf);
    free(buf2);
    td_ctrl_envelope_free(e2);
    td_ctrl_envelope_free(e);
    return 0;
}
