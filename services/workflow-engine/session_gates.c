/* Agent sessions' approvals and prompts (docs/workflow-engine.md "Agent sessions: OpenApproval").
 *
 * The orchestrator opens one with ApprovalService.OpenApproval when a worker's turn trips a
 * gated tool call (InterruptRequired: kind "approval_gate") or asks the user (InputRequired:
 * kind "user_prompt"). The row is a governance row like a run's gate, decided through the same
 * doors (gates.c); what differs is written here:
 *   - the opener: a service bearer only (scope "approvals.open"), every field checked, one row
 *     per (org, session, correlation key);
 *   - expiry: a timer row (approval_timers) any replica fires, and a decision that finds the
 *     row past its expiry expires it first, so a late decision never wins over the timeout;
 *   - the decision event carries the session's fields and the pending tool intent, so the
 *     orchestrator resumes the session from the message alone; no run is woken;
 *   - the projection onto WorkflowAction (ListPendingApprovals, ApproveAction ...). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "auth_claims.h"
#include "gates_int.h"
#include "ids.h"
#include "interp.h"
#include "log.h"
#include "pbjson.h"
#include "store.h"
#include "subjects.h"
#include "util.h"
#include "wf_rpc.h"

#define A(x) Upsquad__Approval__V1__##x
#define P(x) Upsquad__Workflow__V1__##x

#define ID_TEXT_MAX 200    /* tool, tool_call_id, correlation_key, option value / label */
#define PROSE_MAX 2000     /* summary, question */
#define DESC_MAX 1000      /* option description */
#define INTENT_MAX 65536   /* pending_tool_intent bytes */
#define OPTIONS_MAX 20     /* a prompt's choices */
#define TIMEOUT_MAX 604800 /* seconds: a week */
#define TIMEOUT_DEFAULT 86400
#define SWEEP_BATCH 100 /* timers fired per scheduler round */

/* ---- the decision event ---- */

int sgate__announce(db_tx *tx, const PGresult *r, const char *status, const char *by,
                    const cJSON *answer, const char *comment, const char *trace, char *err,
                    size_t errlen) {
    const char *gid = st_s(r, 0, GT_ID), *org = st_s(r, 0, GT_ORG);
    A(ApprovalDecided) ev;
    upsquad__approval__v1__approval_decided__init(&ev);
    Google__Protobuf__Timestamp now;
    pbjson_ts_now(&now);
    Google__Protobuf__Struct *payload = NULL;
    uint8_t *intent = NULL, *buf = NULL;
    size_t intent_len = 0;
    char perr[128];
    int rc = DB_OK;
    pbjson_struct_from_json(answer, &payload, perr, sizeof perr);
    ev.approval_id = (char *)gid;
    ev.org_id = (char *)org;
    ev.run_id = (char *)st_s(r, 0, GT_RUN);
    ev.action_id = (char *)st_s(r, 0, GT_ACTION);
    ev.kind = (char *)st_s(r, 0, GT_KIND);
    ev.status = (char *)status;
    ev.decided_by = (char *)by;
    ev.decided_at = &now;
    ev.comment = (char *)(comment ? comment : "");
    ev.response_payload = payload;
    if (st_s(r, 0, GT_SESSION)[0]) {
        ev.session_id = (char *)st_s(r, 0, GT_SESSION);
        ev.agent_id = (char *)st_s(r, 0, GT_AGENT);
        ev.tool = (char *)st_s(r, 0, GT_TOOL);
        ev.tool_call_id = (char *)st_s(r, 0, GT_TOOL_CALL);
        ev.correlation_key = (char *)st_s(r, 0, GT_KEY);
        if ((rc = st_session_gate_intent(tx, gid, &intent, &intent_len, err, errlen))) goto done;
        ev.pending_tool_intent.data = intent;
        ev.pending_tool_intent.len = intent_len;
    }
    size_t len = protobuf_c_message_get_packed_size(&ev.base);
    if (!(buf = malloc(len ? len : 1))) {
        rc = DB_ENOMEM;
        goto done;
    }
    protobuf_c_message_pack(&ev.base, buf);
    char subject[160];
    snprintf(subject, sizeof subject, "%s.%s", SUBJ_APPROVAL_DECIDED, org);
    /* message id: the row, so a republish after a crash is dropped by JetStream */
    rc = st_outbox_put(tx, org, subject, gid, buf, len, trace, err, errlen);
done:
    free(buf);
    free(intent);
    if (payload) pbjson_struct_free(payload);
    return rc;
}

/* ---- expiry ---- */

int sgate__lapse(db_tx *tx, const PGresult *r, int *lapsed, char *err, size_t errlen) {
    *lapsed = 0;
    if (!st_s(r, 0, GT_SESSION)[0] || strcmp(st_s(r, 0, GT_STATUS), "pending") ||
        !st_b(r, 0, GT_LAPSED))
        return DB_OK;
    const char *gid = st_s(r, 0, GT_ID);
    int prompt = !strcmp(st_s(r, 0, GT_KIND), "user_prompt");
    cJSON *o = cJSON_CreateObject();
    if (!prompt) cJSON_AddStringToObject(o, "decision", "expired");
    cJSON_AddStringToObject(o, prompt ? "answered_by" : "decided_by", "timeout");
    char *answer = cJSON_PrintUnformatted(o);
    int rc = answer ? st_gate_decide(tx, gid, "expired", "timeout", answer, "", lapsed, err, errlen)
                    : DB_ENOMEM;
    if (rc == DB_OK && *lapsed && !(rc = st_approval_timer_delete(tx, gid, err, errlen)) &&
        !(rc = st_audit(tx, st_s(r, 0, GT_ORG), NULL, gid, "gate.expired", "timed out", err,
                        errlen)))
        rc = sgate__announce(tx, r, "expired", "timeout", o, "", "", err, errlen);
    free(answer);
    cJSON_Delete(o);
    return rc;
}

/* Fires one due timer in its own transaction; 1 when there was one. The governance row is
 * locked before its timer is deleted, the order every decision takes. */
static int sweep_one(wf_engine *e, const char *gid, const char *org) {
    char err[512];
    db_tx *tx = NULL;
    PGresult *r = NULL;
    int lapsed = 0;
    int rc = st_begin_service(e->pool, &tx, err, sizeof err);
    if (!rc) rc = st_scope_org(tx, org, err, sizeof err);
    if (!rc) rc = st_gate_get(tx, gid, 0, 1, &r, err, sizeof err);
    if (!rc && PQntuples(r) == 1) rc = sgate__lapse(tx, r, &lapsed, err, sizeof err);
    /* decided meanwhile, or gone: the timer has nothing left to fire */
    if (!rc && !lapsed) rc = st_approval_timer_delete(tx, gid, err, sizeof err);
    if (!rc) {
        rc = db_tx_commit(tx, err, sizeof err);
        tx = NULL;
    }
    db_tx_rollback(tx);
    PQclear(r);
    if (rc) {
        log_warn("approval.expire", "approval=%s org=%s: %s", gid, org, err);
        return 0;
    }
    if (lapsed) log_info("approval.expired", "approval=%s org=%s", gid, org);
    return lapsed;
}

void wf_session_gates_sweep(wf_engine *e) {
    char err[512];
    db_tx *tx = NULL;
    PGresult *due = NULL;
    int fired = 0;
    if (st_begin_service(e->pool, &tx, err, sizeof err) ||
        st_approval_timer_due(tx, SWEEP_BATCH, &due, err, sizeof err)) {
        log_warn("approval.sweep", "%s", err);
        goto done;
    }
    db_tx_rollback(tx); /* the list only: each timer fires in its own transaction */
    tx = NULL;
    for (int i = 0; i < PQntuples(due) && !e->stop; i++)
        fired += sweep_one(e, st_s(due, i, 0), st_s(due, i, 1));
    if (fired) wf_engine_kick_relay(e);
done:
    db_tx_rollback(tx);
    PQclear(due);
}

/* ---- projection onto WorkflowAction ---- */

/* A session's row status as a raw action status (the palette's fold applies as for a run's). */
static const char *action_status(const PGresult *r, int row) {
    const char *st = st_s(r, row, GT_STATUS);
    int prompt = !strcmp(st_s(r, row, GT_KIND), "user_prompt");
    if (!strcmp(st, "pending"))
        return st_b(r, row, GT_LAPSED)        ? (prompt ? "failed" : "rejected")
               : st_i(r, row, GT_ESCALATIONS) ? "escalated"
                                              : "awaiting_approval";
    if (!strcmp(st, "approved")) return "approved";
    if (!strcmp(st, "answered")) return "completed";
    if (!strcmp(st, "rejected")) return "rejected";
    return prompt ? "failed" : "rejected"; /* expired, closed */
}

static Google__Protobuf__Struct *redacted(rpc_call *call, const char *json, int clearance) {
    cJSON *o = cJSON_Parse(json);
    if (!cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return NULL;
    }
    /* the one rule (wfr_redact); a session has no workflow classification: floor 0 */
    wfr_redact(call, o, clearance, 0, NULL, NULL, 0);
    Google__Protobuf__Struct *s = wfr_struct_json(call, o);
    cJSON_Delete(o);
    return s;
}

P(WorkflowAction) * sgate__action_msg(rpc_call *call, const PGresult *r, int row, int clearance) {
    P(WorkflowAction) *a = rpc_alloc(call, sizeof *a);
    upsquad__workflow__v1__workflow_action__init(a);
    const char *status = action_status(r, row);
    a->id = wfr_s(call, r, row, GT_ID);
    a->run_id = rpc_strdup(call, "");
    a->org_id = wfr_s(call, r, row, GT_ORG);
    a->step_name = wfr_s(call, r, row, GT_TOOL);
    a->agent_id = wfr_s(call, r, row, GT_AGENT);
    a->status = rpc_strdup(call, status);
    a->input = redacted(call, st_s(r, row, GT_SPEC), clearance);
    a->output = redacted(call, st_s(r, row, GT_ANSWER), clearance);
    a->decided_by = wfr_s(call, r, row, GT_DECIDED_BY);
    a->decided_at = wfr_ts(call, r, row, GT_DECIDED_AT);
    a->created_at = wfr_ts(call, r, row, GT_CREATED);
    a->approval_id = wfr_s(call, r, row, GT_ID);
    a->blocked_by = rpc_strdup(call, wf_project_blocked_by(status, st_s(r, row, GT_ID)));
    return a;
}

/* ---- OpenApproval ---- */

/* INVALID_ARGUMENT naming field unless s has at most max characters (required: at least 1). */
static int text_field(rpc_call *call, const char *field, const char *s, size_t max, int required) {
    if (required && (!s || !s[0]))
        return rpc_error(call, RPC_INVALID_ARGUMENT, "%s is required", field);
    if (!util_utf8_valid(s ? s : ""))
        return rpc_error(call, RPC_INVALID_ARGUMENT, "%s must be valid UTF-8", field);
    if (wfr_utf8_chars(s) > max)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "%s must be at most %zu characters", field,
                         max);
    return RPC_OK;
}

/* Every field of the request, in order; the first violation is the status. */
static int check_open(rpc_call *call, const A(OpenApprovalRequest) * rq, const auth_identity *id,
                      int *prompt) {
    int rc;
    if ((rc = wfr_need_id(call, "org_id", rq->org_id))) return rc;
    if (strcmp(rq->org_id, id->org_id))
        return rpc_error(call, RPC_PERMISSION_DENIED,
                         "org_id must be the org of the caller's token");
    if ((rc = wfr_need_id(call, "session_id", rq->session_id)) ||
        (rc = wfr_need_id(call, "agent_id", rq->agent_id)))
        return rc;
    *prompt = !strcmp(rq->kind, "user_prompt");
    if (!*prompt && strcmp(rq->kind, "approval_gate"))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "kind must be \"approval_gate\" (a gated tool call) or \"user_prompt\" "
                         "(an ask_user)");
    if ((rc = text_field(call, "tool", rq->tool, ID_TEXT_MAX, !*prompt)) ||
        (rc = text_field(call, "tool_call_id", rq->tool_call_id, ID_TEXT_MAX, 0)))
        return rc;
    if (!*prompt && rq->pending_tool_intent.len == 0)
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "pending_tool_intent is required on an approval_gate");
    if (rq->pending_tool_intent.len > INTENT_MAX)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "pending_tool_intent must be at most %d bytes",
                         INTENT_MAX);
    if (rq->required_clearance < 1 || rq->required_clearance > WF_CLEARANCE_MAX)
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "required_clearance must be 1..%d (the tool's policy; there is no "
                         "default)",
                         WF_CLEARANCE_MAX);
    if ((rc = text_field(call, "summary", rq->summary, PROSE_MAX, 0)) ||
        (rc = text_field(call, "question", rq->question, PROSE_MAX, *prompt)))
        return rc;
    if (!*prompt && (rq->n_options || rq->allow_text || rq->question[0]))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "%s is for a user_prompt; an approval_gate is approved or rejected",
                         rq->n_options    ? "options"
                         : rq->allow_text ? "allow_text"
                                          : "question");
    if (rq->n_options > OPTIONS_MAX)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "options must be at most %d", OPTIONS_MAX);
    if (*prompt && !rq->n_options && !rq->allow_text)
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "options must not be empty unless allow_text is true (nothing could "
                         "answer the prompt)");
    for (size_t i = 0; i < rq->n_options; i++) {
        const A(ApprovalOption) *o = rq->options[i];
        char f[48];
        snprintf(f, sizeof f, "options[%zu].value", i);
        if ((rc = text_field(call, f, o->value, ID_TEXT_MAX, 1))) return rc;
        snprintf(f, sizeof f, "options[%zu].label", i);
        if ((rc = text_field(call, f, o->label, ID_TEXT_MAX, 0))) return rc;
        snprintf(f, sizeof f, "options[%zu].description", i);
        if ((rc = text_field(call, f, o->description, DESC_MAX, 0))) return rc;
        for (size_t j = 0; j < i; j++)
            if (!strcmp(rq->options[j]->value, o->value))
                return rpc_error(call, RPC_INVALID_ARGUMENT,
                                 "options[%zu].value repeats options[%zu].value", i, j);
    }
    if (rq->answerable_by[0] && strcmp(rq->answerable_by, "anyone") &&
        strcmp(rq->answerable_by, "requester"))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "answerable_by must be \"\", \"anyone\" or \"requester\"");
    if (rq->timeout_seconds < 0 || rq->timeout_seconds > TIMEOUT_MAX)
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "timeout_seconds must be 1..%d (0: the default, %d)", TIMEOUT_MAX,
                         TIMEOUT_DEFAULT);
    if ((rc = wfr_need_id(call, "requested_by", rq->requested_by)) ||
        (rc = text_field(call, "correlation_key", rq->correlation_key, ID_TEXT_MAX, 1)) ||
        (rc = text_field(call, "agent_name", rq->agent_name, ID_TEXT_MAX, 0)))
        return rc;
    return RPC_OK;
}

/* The row's spec: what a decider sees (Approval.spec, the PendingApproval action's input,
 * GetRunPrompt), in the keys a run's gate and prompt use. Caller deletes. */
static cJSON *open_spec(const A(OpenApprovalRequest) * rq, int prompt, const char *tool) {
    cJSON *s = cJSON_CreateObject();
    cJSON_AddStringToObject(s, "tool", tool);
    if (rq->tool_call_id[0]) cJSON_AddStringToObject(s, "tool_call_id", rq->tool_call_id);
    if (rq->summary[0]) cJSON_AddStringToObject(s, "summary", rq->summary);
    if (prompt) {
        cJSON_AddStringToObject(s, "question", rq->question);
        cJSON *opts = cJSON_AddArrayToObject(s, "options");
        for (size_t i = 0; i < rq->n_options; i++) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "value", rq->options[i]->value);
            cJSON_AddStringToObject(o, "label", rq->options[i]->label);
            if (rq->options[i]->description[0])
                cJSON_AddStringToObject(o, "description", rq->options[i]->description);
            cJSON_AddItemToArray(opts, o);
        }
        cJSON_AddBoolToObject(s, "allow_text", rq->allow_text);
    }
    if (rq->answerable_by[0]) cJSON_AddStringToObject(s, "answerable_by", rq->answerable_by);
    if (rq->agent_name[0]) cJSON_AddStringToObject(s, "agent_name", rq->agent_name);
    return s;
}

int sgate__open(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud) {
    const A(OpenApprovalRequest) *rq = (const void *)req;
    A(OpenApprovalResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    gate g = {0};
    char *spec_json = NULL, err[512], gid[37], row_id[37];
    int prompt = 0, created = 0;
    /* a service identity only: a member's token, whatever its clearance, opens nothing */
    if (!auth_bearer_has_scope(rpc_metadata(call, "authorization"), AUTH_SCOPE_APPROVALS_OPEN))
        return rpc_error(call, RPC_PERMISSION_DENIED,
                         "OpenApproval needs a service token whose scope holds \"%s\"",
                         AUTH_SCOPE_APPROVALS_OPEN);
    int rc = rpc_tenant(call, 0, &id);
    if (rc || (rc = check_open(call, rq, id, &prompt))) return rc;
    const char *tool = rq->tool[0] ? rq->tool : "ask_user";
    cJSON *spec = open_spec(rq, prompt, tool);
    spec_json = cJSON_PrintUnformatted(spec);
    cJSON_Delete(spec);
    ids_uuid_v7(gid);
    st_session_gate sg = {.id = gid,
                          .org = rq->org_id,
                          .session = rq->session_id,
                          .agent = rq->agent_id,
                          .kind = rq->kind,
                          .tool = tool,
                          .tool_call_id = rq->tool_call_id,
                          .requested_by = rq->requested_by,
                          .key = rq->correlation_key,
                          .intent = rq->pending_tool_intent.data,
                          .intent_len = rq->pending_tool_intent.len,
                          .clearance = rq->required_clearance,
                          .spec_json = spec_json,
                          .timeout_s = rq->timeout_seconds ? rq->timeout_seconds : TIMEOUT_DEFAULT};
    if (!spec_json) {
        rc = rpc_error(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
        goto done;
    }
    if ((rc = st_begin(e->pool, rq->org_id, NULL, &g.tx, err, sizeof err)) ||
        (rc = st_session_gate_open(g.tx, &sg, &created, row_id, err, sizeof err)) ||
        (created && (rc = st_audit(g.tx, rq->org_id, rq->requested_by, row_id, "gate.open", tool,
                                   err, sizeof err))) ||
        (rc = st_gate_get(g.tx, row_id, 0, 0, &g.r, err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    if (PQntuples(g.r) != 1) {
        rc = rpc_error(call, RPC_INTERNAL, "the approval opened is not readable");
        goto done;
    }
    /* the same key names the same ask: a different one under it is the caller's bug */
    if (!created &&
        (strcmp(st_s(g.r, 0, GT_KIND), rq->kind) || strcmp(st_s(g.r, 0, GT_TOOL), tool) ||
         strcmp(st_s(g.r, 0, GT_AGENT), rq->agent_id))) {
        rc = rpc_error(call, RPC_ALREADY_EXISTS,
                       "correlation_key already opened approval %s on this session for another "
                       "kind, tool or agent",
                       row_id);
        goto done;
    }
    g.session = 1;
    g.spec = cJSON_Parse(st_s(g.r, 0, GT_SPEC));
    out->approval = gates__approval_msg(call, &g, id);
    out->created = created;
    rc = db_tx_commit(g.tx, err, sizeof err);
    g.tx = NULL;
    if (rc) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    if (created)
        log_info("approval.opened", "approval=%s org=%s session=%s kind=%s tool=%s clearance=%d",
                 row_id, rq->org_id, rq->session_id, rq->kind, tool, rq->required_clearance);
done:
    db_tx_rollback(g.tx);
    PQclear(g.r);
    cJSON_Delete(g.spec);
    free(spec_json);
    return rc;
}
