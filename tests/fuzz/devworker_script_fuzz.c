/* libFuzzer harness: devworker's script parser (services/devworker/script.c) on arbitrary
 * message text, as ExecuteStep hands it over. A parsed script must be well-formed: every event
 * op carries exactly one oneof arm, and it encodes. Any crash, sanitizer report or leak fails. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../services/devworker/script.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *msg = malloc(size + 1), err[256], ptr[256];
    const char *body;
    dw_script *s = NULL;
    if (msg == NULL) return 0;
    memcpy(msg, data, size);
    msg[size] = 0;
    if (!dw_script_detect(msg, &body)) body = msg; /* the body alone, too */
    if (dw_script_parse(body, 1000, &s, err, sizeof err, ptr, sizeof ptr) == 0) {
        size_t n;
        const dw_op *op = dw_script_ops(s, &n);
        for (size_t i = 0; i < n; i++) {
            if (op[i].kind != DW_OP_EVENT) continue;
            if (op[i].ev->event_case == UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT__NOT_SET)
                __builtin_trap();
            size_t len = protobuf_c_message_get_packed_size(&op[i].ev->base);
            uint8_t *buf = malloc(len ? len : 1);
            if (buf && protobuf_c_message_pack(&op[i].ev->base, buf) != len) __builtin_trap();
            free(buf);
        }
        dw_script_free(s);
    } else if (err[0] == 0) {
        __builtin_trap(); /* a refusal always says why */
    }
    free(msg);
    return 0;
}
