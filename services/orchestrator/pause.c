/* PauseSession, ResumeSession, GetProvenanceChain (pause.h; spec: upsquad/runtime/v1/
 * lifecycle.proto; docs/orchestrator.md, "Pause, resume and provenance"). Tenant from the
 * verified token; another org's session reads as NOT_FOUND (row-level security). */
#include "pause.h"

#include <cjson/cJSON.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fields.h"
#include "ids.h"
#include "log.h"
#include "pbjson.h"
#include "relay.h"
#include "session.h"
#include "util.h"

typedef Upsquad__Runtime__V1__PauseSessionRequest PauseRequest;
typedef Upsquad__Runtime__V1__PauseSessionResponse PauseResponse;
typedef Upsquad__Runtime__V1__ResumeSessionRequest ResumeRequest;
typedef Upsquad__Runtime__V1__ResumeSessionResponse ResumeResponse;
typedef Upsquad__Runtime__V1__GetProvenanceChainRequest ChainRequest;
typedef Upsquad__Runtime__V1__GetProvenanceChainResponse ChainResponse;
typedef Upsquad__Runtime__V1__ProvenanceChainLink ChainLink;

#define REASON_MAX 1024
#define CORRELATION_MAX 256
#define OPERATOR_INPUT_MAX (64 * 1024) /* spec: ResumeSessionRequest.operator_input */
#define PAUSE_POLL_MS 50
/* PauseSession calls waiting for a turn's end at once (each holds a blocking-pool thread, 8 by
 * default): beyond, a pause is recorded and the call answers UNAVAILABLE without waiting */
#define PAUSE_WAITERS_MAX 4
/* GetProvenanceChain: links returned at most, and sessions a cross_session walk enters (the
 * requested one included) */
#define CHAIN_MAX 256
#define CHAIN_SESSIONS_MAX 11

static atomic_int waiters;

/* ---- PauseSession ---- */

static void pause_reply(rpc_call *call, const orch_pause *pz, int was_already, PauseResponse *out) {
    out->status = UPSQUAD__RUNTIME__V1__AGENT_STATUS__AGENT_STATUS_SUSPENDED;
    out->checkpoint_key = rpc_strdup(call, pz->checkpoint_key);
    out->paused_at = orch_ts_ms(call, pz->paused_ms);
    out->was_already_suspended = was_already;
}

static int pause_session(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                         void *ud) {
    orch *o = ud;
    const PauseRequest *rq = (const PauseRequest *)req;
    const auth_identity *id;
    orch_pause pz;
    char state[16] = "", err[512];
    int outcome, rc;
    if ((rc = rpc_tenant(call, 0, &id)) ||
        (rc = orch_uuid_field(call, "session_id", rq->session_id, 1)) ||
        (rc = orch_text_field(call, "reason", rq->reason, REASON_MAX)) ||
        (rc = orch_text_field(call, "correlation_id", rq->correlation_id, CORRELATION_MAX)))
        return rc;
    if ((int)rq->pause_source < 0 || (int)rq->pause_source > 5)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "pause_source: unknown value %d",
                         (int)rq->pause_source);
    /* UNSPECIFIED: a person asked (the gateway's default caller), recorded as OPERATOR */
    int source = rq->pause_source ? (int)rq->pause_source
                                  : UPSQUAD__RUNTIME__V1__PAUSE_SOURCE__PAUSE_SOURCE_OPERATOR;
    const char *reason = rq->reason[0] ? rq->reason : "paused by the operator";
    int waited = 0, counted = 0;
    int64_t bound = o->cfg->step_timeout_ms + ORCH_TURN_END_SLACK_MS; /* no turn runs longer */
    int64_t t0 = util_mono_ms();
    for (;;) {
        rc = orch_store_pause(o->pool, id->org_id, rq->session_id, reason, source,
                              rq->correlation_id, &outcome, &pz, state, err, sizeof err);
        if (rc == ORCH_ENOTFOUND) {
            rc = rpc_error(call, RPC_NOT_FOUND, "session_id: no session %s", rq->session_id);
            break;
        }
        if (rc == ORCH_ESTATE) {
            if (!strcmp(state, "step"))
                rc = rpc_error(call, RPC_FAILED_PRECONDITION,
                               "session %s runs a workflow step: pause its run instead",
                               rq->session_id);
            else
                rc = rpc_error(call, RPC_FAILED_PRECONDITION,
                               "session %s is %s%s: only an active session can be paused",
                               rq->session_id, state,
                               waited ? " (ended before the pause committed)" : "");
            break;
        }
        if (rc != DB_OK) {
            rc = orch_store_failed(call, "pausing the session", err);
            break;
        }
        if (outcome != ORCH_PAUSE_PENDING) {
            /* ALREADY after our own wait is the pause this call recorded committing */
            pause_reply(call, &pz, outcome == ORCH_PAUSE_ALREADY && !waited, (PauseResponse *)resp);
            log_info("session.paused", "session %s org %s source %d%s", rq->session_id, id->org_id,
                     pz.source, outcome == ORCH_PAUSE_ALREADY && !waited ? " (already)" : "");
            rc = RPC_OK;
            break;
        }
        /* a turn is in flight: the pause is recorded and commits at its end; wait for that
         * boundary within the caller's deadline */
        if (!counted) {
            if (atomic_fetch_add(&waiters, 1) >= PAUSE_WAITERS_MAX) {
                atomic_fetch_sub(&waiters, 1);
                rc = rpc_error(call, RPC_UNAVAILABLE,
                               "the pause of session %s is recorded and commits when its running "
                               "turn ends; too many pauses are waiting here: call again to learn "
                               "when it committed",
                               rq->session_id);
                break;
            }
            counted = 1;
        }
        int64_t spent = util_mono_ms() - t0;
        if (rpc_cancelled(call)) {
            rc = rpc_error(call, RPC_CANCELLED, "cancelled (the pause stays recorded)");
            break;
        }
        if (rpc_deadline_ms(call) < PAUSE_POLL_MS * 2 || spent > bound) {
            rc = rpc_error(call, RPC_DEADLINE_EXCEEDED,
                           "session %s is running a turn: the pause is recorded and commits when "
                           "that turn ends (call again to learn when it did)",
                           rq->session_id);
            break;
        }
        waited = 1;
        usleep(PAUSE_POLL_MS * 1000);
    }
    if (counted) atomic_fetch_sub(&waiters, 1);
    return rc;
}

/* ---- ResumeSession ---- */

/* operator_input: optional JSON, at most 64 KiB (spec). *out: its compact text (heap, caller
 * frees), NULL when empty. */
static int operator_input(rpc_call *call, const ProtobufCBinaryData *in, char **out) {
    *out = NULL;
    if (in->len == 0) return RPC_OK;
    if (in->len > OPERATOR_INPUT_MAX)
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "operator_input: %zu bytes, larger than %d (64 KiB)", in->len,
                         OPERATOR_INPUT_MAX);
    if (memchr(in->data, 0, in->len) || util_utf8_check(in->data, in->len) != in->len)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "operator_input: not UTF-8 JSON text");
    const char *end = NULL;
    cJSON *j = cJSON_ParseWithLengthOpts((const char *)in->data, in->len, &end, 0);
    /* the whole input must be one JSON value (blanks after it allowed) */
    while (j && end && end < (const char *)in->data + in->len &&
           (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r'))
        end++;
    if (!j || end != (const char *)in->data + in->len) {
        cJSON_Delete(j);
        return rpc_error(call, RPC_INVALID_ARGUMENT, "operator_input: not valid JSON");
    }
    *out = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!*out) return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
    return RPC_OK;
}

/* Spec: ResumeSession "re-hydrates a SUSPENDED session from its latest checkpoint": a worker
 * is initialised with it (InitWorkerSession.resume_checkpoint) before the session turns
 * ACTIVE; the worker's address into worker. Anything but SUSPENDED is FAILED_PRECONDITION; a
 * worker that cannot be had or refuses the checkpoint leaves the session suspended. */
static int rehydrate(rpc_call *call, orch *o, const char *org, const char *sid, char worker[128]) {
    orch_session s = {0};
    SessionSnapshot *snap = NULL;
    unsigned char *ck = NULL;
    size_t cklen = 0;
    int loop = 0;
    char err[512], msg[512];
    int rc = orch_store_session_get(o->pool, org, sid, 1, &s, err, sizeof err);
    if (rc == ORCH_ENOTFOUND) {
        rc = rpc_error(call, RPC_NOT_FOUND, "session_id: no session %s", sid);
        goto done;
    }
    if (rc != DB_OK) {
        rc = orch_store_failed(call, "reading the session", err);
        goto done;
    }
    if (strcmp(s.state, "suspended")) {
        rc = rpc_error(call, RPC_FAILED_PRECONDITION,
                       "session %s is %s: only a suspended session can be resumed", sid, s.state);
        goto done;
    }
    rc = orch_store_checkpoint_latest(o->pool, org, sid, &loop, &ck, &cklen, err, sizeof err);
    if (rc != DB_OK && rc != ORCH_ENOTFOUND) {
        rc = orch_store_failed(call, "reading the latest checkpoint", err);
        goto done;
    }
    snap = (SessionSnapshot *)protobuf_c_message_unpack(
        &upsquad__runtime__v1__session_snapshot__descriptor, NULL, s.snapshot_len, s.snapshot);
    if (!snap) {
        rc = rpc_error(call, RPC_INTERNAL, "the session's snapshot does not decode");
        goto done;
    }
    orch_worker_init wi = {
        .snapshot = snap, .checkpoint = ck, .checkpoint_len = cklen, .loop = loop};
    rc = orch_session_init_worker(o, &wi, worker, msg, sizeof msg);
    if (rc != RPC_OK) rc = rpc_error(call, rc, "%s; the session stays suspended", msg);
done:
    if (snap) protobuf_c_message_free_unpacked(&snap->base, NULL);
    free(ck);
    orch_session_clear(&s);
    return rc;
}

/* spec: an approval park waits for its decision (ApprovalService), not for an operator */
static int gate_refusal(rpc_call *call, const char *session_id, const char *gate) {
    return rpc_error(call, RPC_FAILED_PRECONDITION,
                     "session %s is parked on approval %s: it resumes when the approval is decided "
                     "(ApprovalService), not by ResumeSession",
                     session_id, gate[0] ? gate : "(unnamed)");
}

static int resume_session(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                          void *ud) {
    orch *o = ud;
    const ResumeRequest *rq = (const ResumeRequest *)req;
    ResumeResponse *out = (ResumeResponse *)resp;
    const auth_identity *id;
    orch_resume rs;
    char state[16] = "", err[512], *input = NULL;
    int rc;
    if ((rc = rpc_tenant(call, 0, &id)) ||
        (rc = orch_uuid_field(call, "session_id", rq->session_id, 1)) ||
        (rc = orch_text_field(call, "resume_reason", rq->resume_reason, REASON_MAX)) ||
        (rc = operator_input(call, &rq->operator_input, &input)))
        return rc;
    char worker[128] = "", gate[65];
    /* a park on a human gate is lifted by its decision alone: nothing is rehydrated for it */
    rc = orch_store_resume_gate(o->pool, id->org_id, rq->session_id, gate, err, sizeof err);
    if (rc == ORCH_EGATED) {
        free(input);
        return gate_refusal(call, rq->session_id, gate);
    }
    if (rc == ORCH_ENOTFOUND) {
        free(input);
        return rpc_error(call, RPC_NOT_FOUND, "session_id: no session %s", rq->session_id);
    }
    if (rc != DB_OK) {
        free(input);
        return orch_store_failed(call, "reading the session", err);
    }
    if ((rc = rehydrate(call, o, id->org_id, rq->session_id, worker)) != RPC_OK) {
        free(input);
        return rc;
    }
    rc = orch_store_resume(o->pool, id->org_id, rq->session_id,
                           rq->resume_reason[0] ? rq->resume_reason : "resumed by the operator",
                           input, &rs, state, err, sizeof err);
    free(input);
    if (rc == ORCH_ENOTFOUND)
        return rpc_error(call, RPC_NOT_FOUND, "session_id: no session %s", rq->session_id);
    if (rc == ORCH_ESTATE)
        return rpc_error(call, RPC_FAILED_PRECONDITION,
                         "session %s is %s: only a suspended session can be resumed",
                         rq->session_id, state);
    if (rc == ORCH_EGATED) return gate_refusal(call, rq->session_id, rs.gate);
    if (rc != DB_OK) return orch_store_failed(call, "resuming the session", err);
    if (orch_store_session_placed(o->pool, id->org_id, rq->session_id, NULL, worker, 0, err,
                                  sizeof err) != DB_OK)
        log_warn("session.placed", "session %s: %s", rq->session_id, err);
    /* spec: "ACTIVE on success"; AgentStatus has no ACTIVE: THINKING is its running status
     * (docs/orchestrator.md, "ResumeSession") */
    out->status = UPSQUAD__RUNTIME__V1__AGENT_STATUS__AGENT_STATUS_THINKING;
    out->resumed_at_loop = rs.resumed_at_loop;
    out->resumed_at = orch_ts_ms(call, rs.resumed_ms);
    log_info("session.resumed", "session %s org %s at loop %d", rq->session_id, id->org_id,
             rs.resumed_at_loop);
    return RPC_OK;
}

/* ---- GetProvenanceChain ---- */

static ChainLink *chain_link(rpc_call *call, const orch_audit_link *l) {
    ChainLink *k = rpc_alloc(call, sizeof *k);
    if (!k) return NULL;
    upsquad__runtime__v1__provenance_chain_link__init(k);
    k->action_id = rpc_strdup(call, l->action_id);
    k->action_type = rpc_strdup(call, l->action_type);
    k->agent_id = rpc_strdup(call, l->agent_id);
    k->created_at = orch_ts_ms(call, l->created_ms);
    k->parent_action_id = rpc_strdup(call, l->parent_action_id);
    k->schema_version = (char *)"1";
    k->session_id = rpc_strdup(call, l->session_id);
    k->anchor_verified = 1;
    return k;
}

static int get_provenance_chain(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                                void *ud) {
    orch *o = ud;
    const ChainRequest *rq = (const ChainRequest *)req;
    ChainResponse *out = (ChainResponse *)resp;
    const auth_identity *id;
    char err[512], sid[37], parent[37], anchor[37];
    /* boundary[i]: links[i] is the oldest link of its session; 1: a crossing into its parent
     * verified, -1: its anchor failed */
    signed char boundary[CHAIN_MAX] = {0};
    int rc, anchor_failed = 0;
    if ((rc = rpc_tenant(call, 0, &id)) ||
        (rc = orch_uuid_field(call, "session_id", rq->session_id, 1)) ||
        (rc = orch_uuid_field(call, "action_id", rq->action_id, 1)))
        return rc;
    orch_audit_link *links = calloc(CHAIN_MAX, sizeof *links);
    if (!links) return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
    size_t n = 0, got = 0;
    /* the walk: newest first, from the action up through parent_action_id within its session,
     * then (cross_session) from the session's anchor in its parent, and so on up */
    rc = orch_store_audit_chain(o->pool, id->org_id, rq->session_id, rq->action_id, CHAIN_MAX,
                                links, &got, err, sizeof err);
    if (rc != DB_OK) {
        rc = orch_store_failed(call, "reading the audit log", err);
        goto done;
    }
    if (got == 0) {
        rc = rpc_error(call, RPC_NOT_FOUND, "action_id: no action %s in session %s", rq->action_id,
                       rq->session_id);
        goto done;
    }
    for (size_t i = 0; i < got; i++)
        if (!links[i].verified) {
            /* the requested session's own chain does not verify: the log was altered */
            log_error("audit.chain_broken", "session %s action %s fails its hash chain",
                      rq->session_id, links[i].action_id);
            rc = rpc_error(call, RPC_DATA_LOSS,
                           "the audit log of session %s fails its hash chain at action %s",
                           rq->session_id, links[i].action_id);
            goto done;
        }
    n = got;
    snprintf(sid, sizeof sid, "%s", rq->session_id);
    for (int hops = 1; rq->cross_session && hops < CHAIN_SESSIONS_MAX && n < CHAIN_MAX; hops++) {
        int ok = 0;
        rc =
            orch_store_audit_anchor(o->pool, id->org_id, sid, parent, anchor, &ok, err, sizeof err);
        if (rc != DB_OK) {
            rc = orch_store_failed(call, "reading the session's parent", err);
            goto done;
        }
        if (!parent[0]) break; /* the root session */
        size_t before = n;
        if (ok) {
            rc = orch_store_audit_chain(o->pool, id->org_id, parent, anchor, CHAIN_MAX - n,
                                        links + n, &got, err, sizeof err);
            if (rc != DB_OK) {
                rc = orch_store_failed(call, "reading the audit log", err);
                goto done;
            }
            for (size_t i = 0; i < got; i++)
                if (!links[n + i].verified) ok = 0;
        }
        if (!ok) {
            /* the trusted prefix ends at this boundary (spec: truncated_at_boundary) */
            log_warn("audit.anchor_unverified",
                     "session %s: its anchor in parent session %s does not verify", sid, parent);
            anchor_failed = 1;
            boundary[before - 1] = -1;
            break;
        }
        boundary[before - 1] = 1;
        n += got;
        snprintf(sid, sizeof sid, "%s", parent);
    }
    out->truncated_at_boundary = anchor_failed;
    out->session_id = rpc_strdup(call, rq->session_id);
    out->action_id = rpc_strdup(call, rq->action_id);
    out->chain = rpc_alloc(call, n * sizeof *out->chain);
    if (!out->chain) {
        rc = rpc_error(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
        goto done;
    }
    /* oldest to newest: chain[0] the root, chain[n-1] the requested action */
    for (size_t i = 0; i < n; i++) {
        ChainLink *k = chain_link(call, &links[n - 1 - i]);
        if (!k) {
            rc = rpc_error(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
            goto done;
        }
        /* the previous link lived in another session: a crossing, its anchor verified */
        if (boundary[n - 1 - i] == 1) k->is_boundary_crossing = 1;
        /* the last trusted link before a boundary whose anchor failed */
        if (boundary[n - 1 - i] == -1) k->anchor_verified = 0;
        out->chain[out->n_chain++] = k;
    }
    rc = RPC_OK;
done:
    free(links);
    return rc;
}

#define SVC "/upsquad.runtime.v1.LifecycleService/"
#define DESC(x) &upsquad__runtime__v1__##x##__descriptor

int orch_pause_register(rpc_server *srv, orch *o) {
    const rpc_method methods[] = {
        {SVC "PauseSession", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(pause_session_request),
         DESC(pause_session_response), pause_session, NULL, o, .flags = RPC_BLOCKING},
        {SVC "ResumeSession", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(resume_session_request),
         DESC(resume_session_response), resume_session, NULL, o, .flags = RPC_BLOCKING},
        {SVC "GetProvenanceChain", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(get_provenance_chain_request),
         DESC(get_provenance_chain_response), get_provenance_chain, NULL, o, .flags = RPC_BLOCKING},
    };
    return rpc_server_add(srv, methods, sizeof methods / sizeof methods[0]);
}
