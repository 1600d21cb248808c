/* What the LifecycleService handler files (lifecycle.c, pause.c, tree.c) share: request field
 * checks that answer INVALID_ARGUMENT naming the field, the answer to a failed store call, and
 * timestamps in the call's arena. Each returns the status it set on the call (RPC_OK when the
 * field is fine), so a handler writes `if ((rc = orch_uuid_field(...))) return rc;`. */
#ifndef ORCH_FIELDS_H
#define ORCH_FIELDS_H

#include <stddef.h>
#include <stdint.h>

#include "google/protobuf/timestamp.pb-c.h"
#include "rpc.h"

/* v a UUID; empty is "name: required" when required, else fine. */
int orch_uuid_field(rpc_call *call, const char *name, const char *v, int required);
/* v at most max bytes. */
int orch_text_field(rpc_call *call, const char *name, const char *v, size_t max);
/* A store call failed for a reason the caller cannot fix: logged with its detail, answered
 * UNAVAILABLE ("<what> failed; try again") without it. */
int orch_store_failed(rpc_call *call, const char *what, const char *err);
/* A Timestamp in the call's arena (NULL when out of memory). */
Google__Protobuf__Timestamp *orch_ts_ms(rpc_call *call, int64_t ms);
Google__Protobuf__Timestamp *orch_ts_us(rpc_call *call, int64_t us);

#endif
