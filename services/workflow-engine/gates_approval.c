/* The ApprovalService over the engine's governance rows (gates.h; docs/workflow-engine.md
 * "Governance"): RecordDecision decides every kind (an approval with APPROVED / REJECTED, a
 * question with {option_key, fields}, a prompt with {choice, text}) through the same decision as
 * every door (gates__record); GetApproval reads one. OpenApproval is session_gates.c's. */
#include "gates_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "pbjson.h"
#include "wf_rpc.h"
#include "upsquad/approval/v1/approval.pb-c.h"

#define A(x) Upsquad__Approval__V1__##x

/* ---- ApprovalService ---- */

A(Approval) * gates__approval_msg(rpc_call *call, const gate *g, const auth_identity *id) {
    A(Approval) *a = rpc_alloc(call, sizeof *a);
    upsquad__approval__v1__approval__init(a);
    a->id = wfr_s(call, g->r, 0, GT_ID);
    a->org_id = wfr_s(call, g->r, 0, GT_ORG);
    a->run_id = wfr_s(call, g->r, 0, GT_RUN);
    a->action_id = wfr_s(call, g->r, 0, GT_ACTION);
    a->kind = wfr_s(call, g->r, 0, GT_KIND);
    a->status = wfr_s(call, g->r, 0, GT_STATUS);
    a->required_clearance = g_floor(g);
    a->decided_by = wfr_s(call, g->r, 0, GT_DECIDED_BY);
    a->decided_at = wfr_ts(call, g->r, 0, GT_DECIDED_AT);
    a->comment = wfr_s(call, g->r, 0, GT_COMMENT);
    a->response_payload = wfr_struct(call, st_s(g->r, 0, GT_ANSWER));
    /* the spec is the gate's structure (kind, options, summary) a decider below the run's
     * floor still needs; the sensitive-key half of the one rule applies (wfr_redact) */
    cJSON *spec = cJSON_Duplicate(g->spec, 1);
    wfr_redact(call, spec, id->clearance, 0, NULL, NULL, 0);
    a->spec = wfr_struct_json(call, spec);
    cJSON_Delete(spec);
    a->created_at = wfr_ts(call, g->r, 0, GT_CREATED);
    a->expires_at = wfr_ts(call, g->r, 0, GT_EXPIRES);
    a->escalations = (int32_t)st_i(g->r, 0, GT_ESCALATIONS);
    a->can_decide = g_pending(g) && g_allowed(g, id);
    a->min_approvals = g_min_approvals(g);
    cJSON *ap = cJSON_Parse(st_s(g->r, 0, GT_APPROVERS)), *v;
    int n = cJSON_GetArraySize(ap);
    a->approvers = rpc_alloc(call, (size_t)(n ? n : 1) * sizeof *a->approvers);
    cJSON_ArrayForEach(v, ap) {
        if (cJSON_IsString(v)) a->approvers[a->n_approvers++] = rpc_strdup(call, v->valuestring);
    }
    cJSON_Delete(ap);
    a->session_id = wfr_s(call, g->r, 0, GT_SESSION);
    a->agent_id = wfr_s(call, g->r, 0, GT_AGENT);
    a->tool = wfr_s(call, g->r, 0, GT_TOOL);
    a->tool_call_id = wfr_s(call, g->r, 0, GT_TOOL_CALL);
    a->requested_by = rpc_strdup(call, g->session ? st_s(g->r, 0, GT_TRIGGERED_BY) : "");
    return a;
}

static int type_ok(const char *type, const cJSON *v) {
    if (!strcmp(type, "string")) return cJSON_IsString(v);
    if (!strcmp(type, "boolean")) return cJSON_IsBool(v);
    if (!strcmp(type, "number")) return cJSON_IsNumber(v);
    if (!strcmp(type, "integer"))
        return cJSON_IsNumber(v) && v->valuedouble == (double)(long long)v->valuedouble;
    if (!strcmp(type, "array")) return cJSON_IsArray(v);
    if (!strcmp(type, "object")) return cJSON_IsObject(v);
    return 0;
}

/* A question's answer {option_key, fields} against its options and answer fields; every
 * violation is named in the message (INVALID_ARGUMENT) before anything is written. */
static int check_question_answer(rpc_call *call, const gate *g, const cJSON *p) {
    char msg[1024];
    size_t k = 0;
    const char *key = jstr(p, "option_key");
    const cJSON *opts = cJSON_GetObjectItemCaseSensitive(g->spec, "options"), *o;
    const cJSON *decl = cJSON_GetObjectItemCaseSensitive(g->spec, "answer");
    const cJSON *fields = cJSON_GetObjectItemCaseSensitive(p, "fields");
    msg[0] = 0;
#define VIOL(...)                                                                                  \
    do {                                                                                           \
        if (k < sizeof msg - 1)                                                                    \
            k += (size_t)snprintf(msg + k, sizeof msg - k, "%s", k ? "; " : "");                   \
        if (k < sizeof msg - 1) k += (size_t)snprintf(msg + k, sizeof msg - k, __VA_ARGS__);       \
    } while (0)
    if (cJSON_GetArraySize(opts) > 0) {
        int ok = 0;
        cJSON_ArrayForEach(o, opts) {
            const char *v = jstr(o, "key");
            if (key && v && !strcmp(v, key)) ok = 1;
        }
        if (!key || !key[0])
            VIOL("response_payload.option_key is required");
        else if (!ok)
            VIOL("response_payload.option_key \"%.64s\" is not one of the question's options", key);
    } else if (key && key[0]) {
        VIOL("response_payload.option_key must be empty: the question has no options");
    }
    if (fields && !cJSON_IsObject(fields)) {
        VIOL("response_payload.fields must be an object");
        fields = NULL;
    }
    cJSON_ArrayForEach(o, decl) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(fields, o->string);
        const char *ty = jstr(o, "type");
        if (!v || cJSON_IsNull(v)) {
            if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "required")))
                VIOL("response_payload.fields.%s is required", o->string);
        } else if (ty && !type_ok(ty, v)) {
            VIOL("response_payload.fields.%s must be of type %s", o->string, ty);
        }
    }
    cJSON_ArrayForEach(o, fields) {
        if (!cJSON_GetObjectItemCaseSensitive(decl, o->string))
            VIOL("response_payload.fields.%s is not an answer field of the question", o->string);
    }
    for (const cJSON *c = p ? p->child : NULL; c; c = c->next)
        if (strcmp(c->string, "option_key") && strcmp(c->string, "fields"))
            VIOL("response_payload.%s is not part of a question's answer", c->string);
#undef VIOL
    if (k) return rpc_error(call, RPC_INVALID_ARGUMENT, "%s", msg);
    return RPC_OK;
}

int gates__record_decision(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                           void *ud) {
    const A(RecordDecisionRequest) *rq = (const void *)req;
    A(RecordDecisionResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    gate g = {0};
    char *ids = NULL;
    cJSON *payload = NULL, *o = NULL;
    int won = 0;
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc || (rc = wfr_need_gate_id(call, "approval_id", rq->approval_id))) return rc;
    int approve = rq->decision == UPSQUAD__APPROVAL__V1__DECISION__DECISION_APPROVED;
    if (!approve && rq->decision != UPSQUAD__APPROVAL__V1__DECISION__DECISION_REJECTED)
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "decision must be DECISION_APPROVED or DECISION_REJECTED");
    if (wfr_utf8_chars(rq->comment) > COMMENT_MAX)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "comment must be at most %d characters",
                         COMMENT_MAX);
    payload = rq->response_payload ? pbjson_struct_to_json(rq->response_payload) : NULL;
    if ((rc = gates__open(call, e, id, "approval_id", rq->approval_id, 0, 1, &g))) goto done;
    /* every kind is decided here: a question with {option_key, fields}, a prompt (an agent's
     * ask_user among them) with {choice, text}, both as APPROVED */
    int question = !strcmp(g_kind(&g), "question_gate");
    int prompt = !strcmp(g_kind(&g), "user_prompt");
    const char *choice = jstr(payload, "choice") ? jstr(payload, "choice") : "";
    const char *text = jstr(payload, "text") ? jstr(payload, "text") : "";
    if ((question || prompt) && !approve) {
        rc = rpc_error(call, RPC_INVALID_ARGUMENT,
                       "decision must be DECISION_APPROVED on a %s (the answer is "
                       "response_payload %s)",
                       g_kind(&g), question ? "{option_key, fields}" : "{choice, text}");
        goto done;
    }
    if (!g_allowed(&g, id)) {
        rc = gates__deny(call, &g, id);
        goto done;
    }
    if (question && (rc = check_question_answer(call, &g, payload))) goto done;
    if (prompt && (rc = gates__check_prompt_answer(call, &g, choice, text))) goto done;
    if (g_pending(&g)) {
        o = cJSON_CreateObject();
        if (prompt) {
            cJSON_AddStringToObject(o, "choice", choice);
            cJSON_AddStringToObject(o, "text", text);
            cJSON_AddStringToObject(o, "answered_by", id->sub);
        } else if (question) {
            const char *key = jstr(payload, "option_key");
            const cJSON *f = cJSON_GetObjectItemCaseSensitive(payload, "fields");
            cJSON_AddStringToObject(o, "option_key", key ? key : "");
            cJSON_AddItemToObject(o, "fields", f ? cJSON_Duplicate(f, 1) : cJSON_CreateObject());
            cJSON_AddStringToObject(o, "answered_by", id->sub);
        } else {
            cJSON_AddStringToObject(o, "decision", approve ? "approved" : "rejected");
            cJSON_AddStringToObject(o, "decided_by", id->sub);
            cJSON_AddStringToObject(o, "comment", rq->comment);
        }
        int resolved = 1;
        if (!question && !prompt && approve)
            rc = gates__approve_rules(call, &g, id, rq->comment, o, &resolved);
        if (!rc && resolved)
            rc = gates__record(call, e, &g, id,
                               prompt    ? "answered"
                               : approve ? "approved"
                                         : "rejected",
                               question || prompt ? "completed"
                               : approve          ? "approved"
                                                  : "rejected",
                               o, rq->comment, &won, &ids);
        if (rc) goto done;
        won = won || !resolved; /* a counted vote is recorded; the gate still waits */
    }
    out->recorded = won;
    out->already_decided = !won;
    if ((rc = gates__reread(call, &g))) goto done;
    out->approval = gates__approval_msg(call, &g, id);
    if ((rc = gates__commit(call, e, &g))) goto done;
    if (won)
        log_info("gate.decided", "record approval=%s org=%s by=%s", rq->approval_id, id->org_id,
                 id->sub);
done:
    cJSON_Delete(payload);
    cJSON_Delete(o);
    free(ids);
    gates__free(&g);
    return rc;
}

int gates__get_approval(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                        void *ud) {
    const A(GetApprovalRequest) *rq = (const void *)req;
    A(GetApprovalResponse) *out = (void *)resp;
    const auth_identity *id;
    gate g = {0};
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc || (rc = wfr_need_gate_id(call, "approval_id", rq->approval_id))) return rc;
    if (!(rc = gates__open(call, ud, id, "approval_id", rq->approval_id, 0, 0, &g)))
        out->approval = gates__approval_msg(call, &g, id);
    gates__free(&g);
    return rc;
}
