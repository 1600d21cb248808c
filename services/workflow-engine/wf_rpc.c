#include "wf_rpc.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "db.h"
#include "err.h"
#include "ids.h"
#include "log.h"
#include "pbjson.h"
#include "redaction.h"
#include "wf.h"
#include "store.h"

Google__Protobuf__Struct *wfr_struct_json(rpc_call *call, const cJSON *obj) {
    Google__Protobuf__Struct *out = NULL;
    char e[256];
    if (!cJSON_IsObject(obj) ||
        pbjson_struct_from_json_a(obj, rpc_call_allocator(call), &out, e, sizeof e) != 0)
        return NULL;
    return out;
}

Google__Protobuf__Struct *wfr_struct(rpc_call *call, const char *json) {
    if (!json || !json[0]) return NULL;
    cJSON *o = cJSON_Parse(json);
    Google__Protobuf__Struct *s = wfr_struct_json(call, o);
    cJSON_Delete(o);
    return s;
}

void wfr_redact(rpc_call *call, cJSON *obj, int clearance, int floor, const char **red,
                size_t *nred, size_t cap) {
    cJSON *c = cJSON_IsObject(obj) ? obj->child : NULL;
    while (c) {
        cJSON *next = c->next;
        if (!redact_visible(clearance, floor, REDACT_PAYLOAD, c->string)) {
            int seen = 0;
            for (size_t i = 0; red && i < *nred; i++)
                seen |= !strcmp(red[i], c->string);
            if (red && !seen && *nred < cap) red[(*nred)++] = rpc_strdup(call, c->string);
            cJSON_DeleteItemFromObjectCaseSensitive(obj, c->string);
        }
        c = next;
    }
}

Google__Protobuf__Struct *wfr_struct_redacted(rpc_call *call, const char *json,
                                              const char *classification) {
    if (!json || !json[0]) return NULL;
    const auth_identity *id = rpc_identity(call);
    cJSON *o = cJSON_Parse(json);
    wfr_redact(call, o, id ? id->clearance : -1, redact_floor(classification), NULL, NULL, 0);
    Google__Protobuf__Struct *s = wfr_struct_json(call, o);
    cJSON_Delete(o);
    return s;
}

typedef struct fit_slot {
    Google__Protobuf__Struct **slot;
    size_t bytes;
} fit_slot;

static int fit_cmp(const void *a, const void *b) {
    size_t x = ((const fit_slot *)a)->bytes, y = ((const fit_slot *)b)->bytes;
    return x < y ? 1 : x > y ? -1 : 0;
}

size_t wfr_fit(rpc_call *call, const ProtobufCMessage *resp, Google__Protobuf__Struct **slots[],
               size_t n, const char *read_with) {
    size_t total = protobuf_c_message_get_packed_size(resp), done = 0;
    if (total <= WFR_RESPONSE_BUDGET || n == 0) return 0;
    fit_slot *v = rpc_alloc(call, n * sizeof *v);
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (slots[i] && *slots[i])
            v[m++] = (fit_slot){slots[i], protobuf_c_message_get_packed_size(&(*slots[i])->base)};
    qsort(v, m, sizeof *v, fit_cmp);
    for (size_t i = 0; i < m && total > WFR_RESPONSE_BUDGET; i++) {
        char json[256];
        snprintf(json, sizeof json, "{\"truncated\":true,\"bytes\":%zu,\"read_with\":\"%s\"}",
                 v[i].bytes, read_with);
        Google__Protobuf__Struct *marker = wfr_struct(call, json);
        size_t small = marker ? protobuf_c_message_get_packed_size(&marker->base) : 0;
        *v[i].slot = marker; /* the original stays in the call's arena, freed with it */
        total -= v[i].bytes - (small < v[i].bytes ? small : v[i].bytes);
        done++;
    }
    if (done)
        log_info("rpc.response_fit", "%zu payload(s) replaced by a truncation marker (%s)", done,
                 read_with);
    return done;
}

Google__Protobuf__Timestamp *wfr_ts(rpc_call *call, const PGresult *r, int row, int col) {
    if (st_null(r, row, col)) return NULL;
    Google__Protobuf__Timestamp *t = rpc_alloc(call, sizeof *t);
    pbjson_ts_from_ms(t, st_i(r, row, col));
    return t;
}

char *wfr_s(rpc_call *call, const PGresult *r, int row, int col) {
    return rpc_strdup(call, st_s(r, row, col));
}

int wfr_db_fail(rpc_call *call, int rc, const char *err) {
    log_error("db.error", "%s: %s (%s)", rpc_method_path(call), err, db_sqlstate());
    /* libcommon's one mapping (err.h); the message never carries the database's own text */
    int st = err_to_status(rc);
    switch (st) {
    case RPC_DEADLINE_EXCEEDED:
        return rpc_error(call, st, "deadline exceeded in the database");
    case RPC_UNAVAILABLE:
        return rpc_error(call, st, "the database is unavailable; retry");
    case RPC_ABORTED:
        return rpc_error(call, st, "concurrent update; retry");
    case RPC_ALREADY_EXISTS:
        return rpc_error(call, st, "the row already exists");
    case RPC_FAILED_PRECONDITION:
        return rpc_error(call, st, "a referenced row does not exist");
    case RPC_INVALID_ARGUMENT:
        return rpc_error(call, st, "a value is outside what the store accepts");
    case RPC_RESOURCE_EXHAUSTED:
        return rpc_error(call, st, "out of memory; retry");
    default:
        return rpc_error(call, RPC_INTERNAL, "internal error");
    }
}

int wfr_need_id(rpc_call *call, const char *field, const char *v) {
    if (!v || !v[0]) return rpc_error(call, RPC_INVALID_ARGUMENT, "%s is required", field);
    if (!ids_uuid_valid(v))
        return rpc_error(call, RPC_INVALID_ARGUMENT, "%s must be a UUID", field);
    return RPC_OK;
}

int wfr_need_gate_id(rpc_call *call, const char *field, const char *v) {
    /* spec NodeStatusUpdate.blocked_by: a question parks under the sub-kind token
     * "awaiting-question", never its governance row's id; every gate's id (approval gate,
     * prompt, question, an agent's park) is WorkflowAction.approval_id, and prompt_id on the
     * live run events: the one address every door takes. A wait has no gate (spec: approval_id
     * is never stamped on a waiting row). */
    if (v && !strcmp(v, "awaiting-question"))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "%s must be a UUID: \"awaiting-question\" is the blocked_by sub-kind "
                         "token of a question, not its id; the question's id is the node's "
                         "approval_id (GetWorkflowStatus, ListWorkflowActions)",
                         field);
    if (v && (!strcmp(v, "waiting-on-signal") || !strcmp(v, "waiting-on-poll")))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "%s must be a UUID: \"%s\" is the blocked_by token of a wait step, "
                         "which has no gate to answer",
                         field, v);
    return wfr_need_id(call, field, v);
}

size_t wfr_utf8_chars(const char *s) {
    size_t n = 0;
    for (; s && *s; s++)
        if (((unsigned char)*s & 0xC0) != 0x80) n++;
    return n;
}

Upsquad__Workflow__V1__WorkflowAction *wfr_action_msg(rpc_call *call, const PGresult *r, int row) {
    Upsquad__Workflow__V1__WorkflowAction *a = rpc_alloc(call, sizeof *a);
    upsquad__workflow__v1__workflow_action__init(a);
    a->id = wfr_s(call, r, row, AC_ID);
    a->run_id = wfr_s(call, r, row, AC_RUN);
    a->org_id = wfr_s(call, r, row, AC_ORG);
    a->step_name = wfr_s(call, r, row, AC_STEP);
    a->agent_id = wfr_s(call, r, row, AC_AGENT);
    a->status = wfr_s(call, r, row, AC_STATUS);
    a->input = wfr_struct_redacted(call, st_s(r, row, AC_INPUT), st_s(r, row, AC_CLASS));
    a->output = wfr_struct_redacted(call, st_s(r, row, AC_OUTPUT), st_s(r, row, AC_CLASS));
    a->decided_by = wfr_s(call, r, row, AC_DECIDED_BY);
    a->decided_at = wfr_ts(call, r, row, AC_DECIDED_AT);
    a->created_at = wfr_ts(call, r, row, AC_CREATED_AT);
    a->approval_id = wfr_s(call, r, row, AC_APPROVAL);
    /* cost_usd: "Until #1127 lands this field is always 0" (recorded in actions.cost_usd) */
    /* time spent, never negative: an action started in the reading transaction itself (the
     * next action an ApproveAction starts) has started_at after that transaction's now() */
    int64_t elapsed = st_i(r, row, AC_ELAPSED);
    a->elapsed_ms = elapsed > 0 ? elapsed : 0;
    a->blocked_by = rpc_strdup(
        call, wf_project_blocked_by(st_s(r, row, AC_STATUS), st_s(r, row, AC_BLOCKED_BY)));
    a->iteration = (int32_t)st_i(r, row, AC_ITERATION);
    return a;
}
