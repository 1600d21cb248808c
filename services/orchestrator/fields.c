/* Request field checks and response helpers of the handler files (fields.h). */
#include "fields.h"

#include <string.h>

#include "ids.h"
#include "log.h"
#include "pbjson.h"

int orch_uuid_field(rpc_call *call, const char *name, const char *v, int required) {
    if (!v || !v[0]) {
        if (required) return rpc_error(call, RPC_INVALID_ARGUMENT, "%s: required", name);
        return RPC_OK;
    }
    if (!ids_uuid_valid(v)) return rpc_error(call, RPC_INVALID_ARGUMENT, "%s: not a UUID", name);
    return RPC_OK;
}

int orch_text_field(rpc_call *call, const char *name, const char *v, size_t max) {
    if (v && strlen(v) > max)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "%s: longer than %zu bytes", name, max);
    return RPC_OK;
}

int orch_store_failed(rpc_call *call, const char *what, const char *err) {
    log_error("store.error", "%s: %s", what, err);
    return rpc_error(call, RPC_UNAVAILABLE, "%s failed; try again", what);
}

Google__Protobuf__Timestamp *orch_ts_ms(rpc_call *call, int64_t ms) {
    Google__Protobuf__Timestamp *t = rpc_alloc(call, sizeof *t);
    if (t) pbjson_ts_from_ms(t, ms);
    return t;
}

Google__Protobuf__Timestamp *orch_ts_us(rpc_call *call, int64_t us) {
    Google__Protobuf__Timestamp *t = rpc_alloc(call, sizeof *t);
    if (!t) return NULL;
    google__protobuf__timestamp__init(t);
    t->seconds = us / 1000000;
    t->nanos = (int32_t)(us % 1000000) * 1000;
    return t;
}
