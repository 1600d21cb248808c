/* The `inspect` directive: what the worker received, as JSON, so a test of the orchestrator can
 * check what reached the worker (prior_turns, the snapshot, the minted bearers' claims, which
 * provider keys) through the ordinary event stream.
 *
 * It never returns a secret: a provider key appears as "sha256:<hex of the key>", a bearer
 * (agent_gateway_token, context_engine_token) as its decoded claims without header or
 * signature (claims alone authenticate nothing). Fields at their proto default are left out
 * (the protobuf JSON mapping), names are the proto field names, enums their names, bytes UTF-8
 * text when they are, else base64. */
#ifndef UPSQUAD_DW_INSPECT_H
#define UPSQUAD_DW_INSPECT_H

#include <cjson/cJSON.h>

#include "upsquad/runtime/v1/runtime.pb-c.h"
#include "worker.h"

/* Compact JSON text; caller frees with cJSON_free. NULL on OOM. */
char *dw_inspect_json(dw_worker *w, const Upsquad__Runtime__V1__ExecuteStepRequest *rq);

/* Any protobuf-c message as JSON (the mapping above, no redaction). Caller deletes. */
cJSON *dw_pb_to_json(const ProtobufCMessage *m);

/* The decoded claims of a compact JWS "header.claims.signature" (the signature is neither
 * checked nor kept: callers verified the token, or only show its claims). Caller deletes; NULL
 * when tok is not a JWS with a JSON object payload. */
cJSON *dw_jws_claims(const char *tok);

#endif
