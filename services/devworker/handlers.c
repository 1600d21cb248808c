/* RuntimeService, worker side (see handlers.h). Request rules:
 *   ExecuteStep: session_id required (1..127 bytes), user_message or step_goal required, else
 *     INVALID_ARGUMENT naming the field; everything else is the step's (step.c) and ends with
 *     status OK, problems reported in-stream as ErrorEvents, as the Python worker does.
 *   InitWorkerSession: snapshot and snapshot.session_id required (INVALID_ARGUMENT); a
 *     resume_checkpoint shorter than its 4-byte prefix, or of another schema version, is
 *     success=false with error_message (spec: the worker MUST NOT start the session).
 *   TerminateSession: session_id required; idempotent (an unknown session is success=true);
 *     steps of the session in flight end with an ErrorEvent SESSION_TERMINATED.
 *   Checkpoint: session_id required; the latest state this worker holds, else NOT_FOUND. */
#include "handlers.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "auth_claims.h"
#include "ids.h"
#include "log.h"
#include "step.h"
#include "upsquad/runtime/v1/runtime.pb-c.h"

#define SVC "/upsquad.runtime.v1.RuntimeService/"
#define DESC(x) (&upsquad__runtime__v1__##x##__descriptor)

typedef Upsquad__Runtime__V1__ExecuteStepRequest StepRequest;
typedef Upsquad__Runtime__V1__InitWorkerSessionRequest InitRequest;
typedef Upsquad__Runtime__V1__InitWorkerSessionResponse InitResponse;
typedef Upsquad__Runtime__V1__TerminateSessionRequest TermRequest;
typedef Upsquad__Runtime__V1__TerminateSessionResponse TermResponse;
typedef Upsquad__Runtime__V1__CheckpointRequest CkRequest;
typedef Upsquad__Runtime__V1__CheckpointResponse CkResponse;

/* ---------------------------------------------------------------- auth ---- */

/* Only the orchestrator drives a worker: by default a call's token must carry its scope, so a
 * member's token (any tenant's) cannot reach sessions on it directly; `any` opts out. */
static int authorize(rpc_call *call, dw_worker *w) {
    const char *need = w->cfg->require_scope;
    if (need == NULL || need[0] == 0 || !strcmp(need, "any")) return RPC_OK;
    if (!auth_bearer_has_scope(rpc_metadata(call, "authorization"), need))
        return rpc_error(call, RPC_PERMISSION_DENIED, "the token does not carry scope %s", need);
    return RPC_OK;
}

static int check_id(rpc_call *call, const char *field, const char *v) {
    if (v == NULL || v[0] == 0)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "%s is required", field);
    if (strlen(v) >= DW_ID_MAX)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "%s is longer than %d bytes", field,
                         DW_ID_MAX - 1);
    return RPC_OK;
}

/* ---------------------------------------------------------------- methods ---- */

static int execute_step(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    const StepRequest *rq = (const StepRequest *)req;
    dw_worker *w = ud;
    int rc;
    if ((rc = authorize(call, w)) != RPC_OK) return rc;
    if ((rc = check_id(call, "session_id", rq->session_id)) != RPC_OK) return rc;
    if ((!rq->user_message || !rq->user_message[0]) && (!rq->step_goal || !rq->step_goal[0]))
        return rpc_error(call, RPC_INVALID_ARGUMENT, "user_message (or step_goal) is required");
    if (rq->tenant_id && strlen(rq->tenant_id) >= DW_ID_MAX)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "tenant_id is longer than %d bytes",
                         DW_ID_MAX - 1);
    return dw_step_run(w, call, rq);
}

/* What a resumed body (our own deterministic JSON) names: the loop iteration (else fallback)
 * and a suspension after an interrupt, recorded for the session's next step. */
static int32_t restore_body(dw_worker *w, const char *session_id, const uint8_t *body, size_t len,
                            int32_t fallback) {
    cJSON *o = cJSON_ParseWithLength((const char *)body, len);
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, "loop_iteration");
    const cJSON *at = cJSON_GetObjectItemCaseSensitive(o, "suspended_at");
    const cJSON *sha = cJSON_GetObjectItemCaseSensitive(o, "message_sha256");
    const cJSON *call = cJSON_GetObjectItemCaseSensitive(o, "tool_call_id");
    const cJSON *tool = cJSON_GetObjectItemCaseSensitive(o, "tool_name");
    int32_t v = cJSON_IsNumber(it) && it->valueint >= 0 ? it->valueint : fallback;
    if (cJSON_IsNumber(at) && at->valueint > 0 && cJSON_IsString(sha) && cJSON_IsString(call) &&
        cJSON_IsString(tool))
        dw_session_set_resume(w, session_id, at->valueint, sha->valuestring, call->valuestring,
                              tool->valuestring);
    cJSON_Delete(o);
    return v;
}

static int init_session(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                        void *ud) {
    const InitRequest *rq = (const InitRequest *)req;
    InitResponse *out = (InitResponse *)resp;
    dw_worker *w = ud;
    int rc;
    if ((rc = authorize(call, w)) != RPC_OK) return rc;
    if (rq->snapshot == NULL) return rpc_error(call, RPC_INVALID_ARGUMENT, "snapshot is required");
    const Upsquad__Runtime__V1__SessionSnapshot *s = rq->snapshot;
    if ((rc = check_id(call, "snapshot.session_id", s->session_id)) != RPC_OK) return rc;
    if ((s->tenant_id && strlen(s->tenant_id) >= DW_ID_MAX) ||
        (s->model_id && strlen(s->model_id) >= DW_ID_MAX))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "snapshot.tenant_id and snapshot.model_id are at most %d bytes",
                         DW_ID_MAX - 1);
    int32_t next = 0;
    const ProtobufCBinaryData *ck = &rq->resume_checkpoint;
    if (ck->len > 0) {
        uint32_t want = (uint32_t)w->cfg->checkpoint_ver;
        if (ck->len < 4) {
            out->success = 0;
            out->error_message = "resume_checkpoint is shorter than its 4-byte version prefix";
            return RPC_OK;
        }
        uint32_t ver = (uint32_t)ck->data[0] << 24 | (uint32_t)ck->data[1] << 16 |
                       (uint32_t)ck->data[2] << 8 | ck->data[3];
        if (ver != want) {
            out->success = 0;
            out->error_message = rpc_sprintf(
                call, "checkpoint schema version %u is not supported (this worker reads %u)", ver,
                want);
            log_warn("session.resume_refused", "session %s: %s", s->session_id, out->error_message);
            return RPC_OK;
        }
    }
    /* a fresh init forgets an earlier suspension; a resumed one may name one */
    dw_session_set_resume(w, s->session_id, 0, "", "", "");
    if (ck->len > 0)
        next =
            restore_body(w, s->session_id, ck->data + 4, ck->len - 4, rq->resume_loop_iteration) +
            1;
    dw_session_init(w, s->session_id, s->tenant_id, s->model_id, next, ck->len > 0 ? next - 1 : -1);
    if (ck->len > 0) {
        char hash[65];
        ids_sha256_hex(ck->data, ck->len, hash);
        dw_session_set_state(w, s->session_id, next - 1, ck->data, ck->len, hash);
        log_info("session.resumed", "session %s resumed at loop iteration %d", s->session_id,
                 rq->resume_loop_iteration);
    }
    out->success = 1;
    return RPC_OK;
}

static int terminate_session(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                             void *ud) {
    const TermRequest *rq = (const TermRequest *)req;
    TermResponse *out = (TermResponse *)resp;
    dw_worker *w = ud;
    int rc;
    if ((rc = authorize(call, w)) != RPC_OK) return rc;
    if ((rc = check_id(call, "session_id", rq->session_id)) != RPC_OK) return rc;
    dw_session_terminate(w, rq->session_id);
    log_debug("session.terminated", "session %s: %s", rq->session_id,
              rq->reason && rq->reason[0] ? rq->reason : "(no reason)");
    out->success = 1;
    return RPC_OK;
}

static int checkpoint(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                      void *ud) {
    const CkRequest *rq = (const CkRequest *)req;
    CkResponse *out = (CkResponse *)resp;
    dw_worker *w = ud;
    uint8_t *blob;
    size_t len;
    char *hash;
    int rc;
    if ((rc = authorize(call, w)) != RPC_OK) return rc;
    if ((rc = check_id(call, "session_id", rq->session_id)) != RPC_OK) return rc;
    rc = dw_session_get_state(w, call, rq->session_id, &blob, &len, &hash);
    if (rc == RPC_NOT_FOUND)
        return rpc_error(call, RPC_NOT_FOUND, "no state for session %s on this worker",
                         rq->session_id);
    if (rc != RPC_OK) return rpc_error(call, rc, "out of memory");
    out->state.data = blob;
    out->state.len = len;
    out->hash = hash;
    return RPC_OK;
}

static int heartbeat(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                     void *ud) {
    (void)req;
    (void)resp;
    (void)ud;
    return rpc_error(call, RPC_UNIMPLEMENTED,
                     "Heartbeat is served by the orchestrator; this is a worker");
}

int dw_handlers_register(rpc_server *srv, dw_worker *w) {
    const rpc_method methods[] = {
        {SVC "ExecuteStep", RPC_SERVER_STREAM, RPC_AUTH_REQUIRED, DESC(execute_step_request),
         DESC(execute_step_event), NULL, execute_step, w},
        {SVC "InitWorkerSession", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(init_worker_session_request),
         DESC(init_worker_session_response), init_session, NULL, w},
        {SVC "TerminateSession", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(terminate_session_request),
         DESC(terminate_session_response), terminate_session, NULL, w},
        {SVC "Checkpoint", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(checkpoint_request),
         DESC(checkpoint_response), checkpoint, NULL, w},
        {SVC "Heartbeat", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(heartbeat_request),
         DESC(heartbeat_response), heartbeat, NULL, w},
    };
    return rpc_server_add(srv, methods, sizeof methods / sizeof methods[0]);
}
