/* RuntimeService, worker -> orchestrator side: Heartbeat and Checkpoint (spec
 * runtime.proto). A worker token (a valid bearer whose `scope` claim holds "runtime.worker",
 * docs/orchestrator.md, "Worker tokens") reaches the sessions of every org by id, since a
 * worker serves them all; any other verified token reaches only its own org's sessions
 * (another org's is NOT_FOUND, as everywhere) and records no worker liveness. The other
 * RuntimeService methods are the worker's: this service answers them UNIMPLEMENTED. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "auth_claims.h"
#include "ids.h"
#include "log.h"
#include "orch.h"
#include "store.h"
#include "upsquad/runtime/v1/runtime.pb-c.h"

typedef Upsquad__Runtime__V1__HeartbeatRequest HeartbeatRequest;
typedef Upsquad__Runtime__V1__HeartbeatResponse HeartbeatResponse;
typedef Upsquad__Runtime__V1__CheckpointRequest CheckpointRequest;
typedef Upsquad__Runtime__V1__CheckpointResponse CheckpointResponse;

/* The token was verified by the server before the handler ran; only its scope claim is read
 * (libcommon/auth_claims.h: space-separated string or array). */
static int worker_scope(rpc_call *call) {
    return auth_bearer_has_scope(rpc_metadata(call, "authorization"), ORCH_WORKER_SCOPE);
}

/* *org: NULL for a worker token (every org), else the caller's tenant (borrowed from the
 * call's identity); a token naming no tenant is UNAUTHENTICATED. */
static int caller_scope(rpc_call *call, const char **org) {
    const auth_identity *id;
    *org = NULL;
    if (worker_scope(call)) return RPC_OK;
    int rc = rpc_tenant(call, 0, &id);
    if (rc == RPC_OK) *org = id->org_id;
    return rc;
}

static int heartbeat(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                     void *ud) {
    orch *o = ud;
    const HeartbeatRequest *rq = (const HeartbeatRequest *)req;
    char err[512], key[256], val[32];
    const char *org;
    int rc = caller_scope(call, &org);
    if (rc) return rc;
    if (strlen(rq->worker_id) > 128)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "worker_id: at most 128 bytes");
    if (!rq->worker_id[0] && !rq->session_id[0])
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "session_id or worker_id: one of them is required");
    if (rq->active_sessions < 0)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "active_sessions: must not be negative");
    if (rq->session_id[0] && !ids_uuid_valid(rq->session_id))
        return rpc_error(call, RPC_INVALID_ARGUMENT, "session_id: not a UUID");
    /* liveness and load, a key that expires unless the next heartbeat refreshes it: only a
     * worker's token speaks for a worker (it decides where turns run) */
    kv *k = orch_kv(o);
    if (!org && rq->worker_id[0]) {
        snprintf(key, sizeof key, ORCH_WORKER_KEY "%s", rq->worker_id);
        snprintf(val, sizeof val, "%d", rq->active_sessions);
        if (!k || kv_set_ttl(k, key, val, strlen(val), (int)o->cfg->worker_ttl_ms) != KV_OK)
            log_warn("heartbeat.redis", "worker %s: liveness not recorded (Redis unreachable)",
                     rq->worker_id);
        /* the shared liveness record the crash-recovery sweeper of every replica reads */
        if (orch_store_worker_seen(o->pool, rq->worker_id, rq->active_sessions, err, sizeof err) !=
            DB_OK)
            log_warn("heartbeat.store", "worker %s: liveness not recorded: %s", rq->worker_id, err);
    }
    if (rq->session_id[0]) {
        rc = orch_store_heartbeat(o->pool, org, rq->session_id, err, sizeof err);
        if (rc == ORCH_ENOTFOUND)
            return rpc_error(call, RPC_NOT_FOUND, "session_id: no session %s", rq->session_id);
        if (rc != DB_OK) {
            log_error("heartbeat.store", "%s", err);
            return rpc_error(call, RPC_UNAVAILABLE, "the heartbeat could not be recorded");
        }
    }
    metric_inc(o->m_heartbeats);
    ((HeartbeatResponse *)resp)->acknowledged = 1;
    return RPC_OK;
}

static int hexdigest_ok(const char *s) {
    if (strlen(s) != 64) return 0;
    for (const char *p = s; *p; p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f') || (*p >= 'A' && *p <= 'F')))
            return 0;
    return 1;
}

static int checkpoint(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                      void *ud) {
    orch *o = ud;
    const CheckpointRequest *rq = (const CheckpointRequest *)req;
    CheckpointResponse *out = (CheckpointResponse *)resp;
    char err[512], hex[65], want[65];
    const char *org;
    int rc = caller_scope(call, &org);
    if (rc) return rc;
    if (!ids_uuid_valid(rq->session_id))
        return rpc_error(call, RPC_INVALID_ARGUMENT, "session_id: not a UUID");
    if (rq->loop_iteration < 0)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "loop_iteration: must not be negative");
    /* the blob: a 4-byte big-endian schema version, then the opaque state */
    if (rq->bytes.len < 4)
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "bytes: shorter than the 4-byte schema version prefix");
    if ((long long)rq->bytes.len > o->cfg->checkpoint_max)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "bytes: %zu bytes, more than the %lld allowed",
                         rq->bytes.len, o->cfg->checkpoint_max);
    /* any version: the blob is opaque to the orchestrator, which only records it */
    const uint8_t *b = rq->bytes.data;
    uint32_t version = (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
    if (!hexdigest_ok(rq->bytes_sha256))
        return rpc_error(call, RPC_INVALID_ARGUMENT, "bytes_sha256: not a SHA-256 hex digest");
    ids_sha256_hex(rq->bytes.data, rq->bytes.len, hex);
    snprintf(want, sizeof want, "%s", rq->bytes_sha256);
    for (char *p = want; *p; p++)
        if (*p >= 'A' && *p <= 'F') *p = (char)(*p - 'A' + 'a');
    if (strcmp(hex, want))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "bytes_sha256: does not match the bytes (integrity check failed)");
    rc = orch_store_checkpoint(o->pool, org, rq->session_id, rq->loop_iteration, version,
                               rq->bytes.data, rq->bytes.len, hex, (int)o->cfg->checkpoints_keep,
                               err, sizeof err);
    switch (rc) {
    case DB_OK:
    case ORCH_EREPLAY: /* same (session, iteration, hash): the idempotent replay */
        metric_inc(o->m_checkpoints);
        /* "CheckpointResponse carries the serialized worker state": the stored blob and its
         * digest (borrowed from the request, which outlives the response's encoding) */
        out->state = rq->bytes;
        out->hash = rpc_strdup(call, hex);
        return RPC_OK;
    case ORCH_ECONFLICT:
        return rpc_error(call, RPC_ALREADY_EXISTS,
                         "loop_iteration %d of session %s is already checkpointed with another "
                         "hash",
                         rq->loop_iteration, rq->session_id);
    case ORCH_ENOTFOUND:
        return rpc_error(call, RPC_NOT_FOUND, "session_id: no session %s", rq->session_id);
    default:
        log_error("checkpoint.store", "%s", err);
        return rpc_error(call, RPC_UNAVAILABLE, "the checkpoint could not be stored");
    }
}

static int not_ours(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud) {
    (void)req;
    (void)resp;
    (void)ud;
    return rpc_error(call, RPC_UNIMPLEMENTED,
                     "%s is served by agent workers, not by the orchestrator",
                     rpc_method_path(call));
}

static int not_ours_stream(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    (void)req;
    (void)ud;
    return rpc_error(call, RPC_UNIMPLEMENTED,
                     "ExecuteStep is served by agent workers, not by the orchestrator");
}

#define SVC "/upsquad.runtime.v1.RuntimeService/"
#define DESC(x) &upsquad__runtime__v1__##x##__descriptor

int orch_runtime_register(rpc_server *srv, orch *o) {
    const rpc_method methods[] = {
        {SVC "Heartbeat", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(heartbeat_request),
         DESC(heartbeat_response), heartbeat, NULL, o, .flags = RPC_BLOCKING},
        {SVC "Checkpoint", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(checkpoint_request),
         DESC(checkpoint_response), checkpoint, NULL, o, .flags = RPC_BLOCKING},
        {SVC "InitWorkerSession", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(init_worker_session_request),
         DESC(init_worker_session_response), not_ours, NULL, o},
        {SVC "TerminateSession", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(terminate_session_request),
         DESC(terminate_session_response), not_ours, NULL, o},
        {SVC "ExecuteStep", RPC_SERVER_STREAM, RPC_AUTH_REQUIRED, DESC(execute_step_request),
         DESC(execute_step_event), NULL, not_ours_stream, o},
    };
    return rpc_server_add(srv, methods, sizeof methods / sizeof methods[0]);
}
