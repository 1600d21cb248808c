/* libFuzzer harness: request decoding as the server does it (depth walk, then protobuf-c
 * unpack) over the request types that carry the deepest or widest trees. The first byte picks
 * the type. Any crash, sanitizer report or leak fails. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "rpc_internal.h"
#include "upsquad/runtime/v1/lifecycle.pb-c.h"
#include "upsquad/runtime/v1/runtime.pb-c.h"
#include "upsquad/test/v1/echo.pb-c.h"
#include "upsquad/workflow/v1/workflow.pb-c.h"

static const ProtobufCMessageDescriptor *const types[] = {
    &upsquad__test__v1__echo_request__descriptor,
    &upsquad__runtime__v1__execute_step_request__descriptor,
    &upsquad__runtime__v1__init_worker_session_request__descriptor,
    &upsquad__runtime__v1__send_message_request__descriptor,
    &upsquad__workflow__v1__create_workflow_request__descriptor,
    &google__protobuf__struct__descriptor,
};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const ProtobufCMessageDescriptor *d = types[data[0] % (sizeof types / sizeof types[0])];
    ProtobufCMessage *m = NULL;
    /* the request walk (limits, UTF-8, decoded size) runs first on the server: it must never
     * crash, and what it accepts under no bound must be what the unpacker accepts */
    static const rpc_field_limit lim[] = {{"model_ids", 3}, {"meta.fields", 4}};
    char msg[512];
    int wrc = rpc__check_request(data + 1, size - 1, d, lim, 2, 1 << 20, msg, sizeof msg);
    if (wrc != 0 && wrc != -1 && wrc != RPC_INVALID_ARGUMENT) __builtin_trap();
    int rc = rpc__decode_bytes(data + 1, size - 1, d, NULL, &m);
    if ((rc == 0) != (m != NULL)) __builtin_trap();
    if (m) {
        /* what decoded must encode again */
        size_t n = protobuf_c_message_get_packed_size(m);
        uint8_t *buf = malloc(n ? n : 1);
        if (buf && protobuf_c_message_pack(m, buf) != n) __builtin_trap();
        free(buf);
        protobuf_c_message_free_unpacked(m, NULL);
    }
    return 0;
}
