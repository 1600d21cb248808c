/* WorkflowService handlers. Each reads like the spec rule it implements; SQL is in store.c,
 * run transitions in run.c / interp.c. Rules decided here (docs/workflow-engine.md):
 *   - org and member come from the verified token; both must be UUIDs (UNAUTHENTICATED).
 *   - Get/ListWorkflows show the org's team workflows and the caller's own private ones; a
 *     private workflow of someone else, a deleted one, or another org's is NOT_FOUND. Reads of
 *     a run follow its workflow's visibility (soft delete keeps them readable by id); the run
 *     control RPCs and DeliverWorkflowEvent are org-scoped only (org_run).
 *   - ids are validated first: empty is INVALID_ARGUMENT "<field> is required", not a UUID is
 *     INVALID_ARGUMENT "<field> must be a UUID"; nothing changes on any error. */
#include "handlers.h"
#include "handlers_int.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "defn_pb.h"
#include "ids.h"
#include "interp.h"
#include "log.h"
#include "pagetok.h"
#include "pbjson.h"
#include "redaction.h"
#include "run.h"
#include "store.h"
#include "wf_rpc.h"
#include "google/rpc/error_details.pb-c.h"
#include "upsquad/workflow/v1/workflow.pb-c.h"
#include "wf_expr.h"

#define P(x) Upsquad__Workflow__V1__##x
#define INIT(x, m) upsquad__workflow__v1__##x##__init(m)

#define NAME_MAX_CHARS 200
#define DESC_MAX_CHARS 2000
#define LIST_WF_DEFAULT 50
#define LIST_WF_MAX 100

/* ---- messages ---- */

static P(Workflow) * wf_msg(rpc_call *call, const PGresult *r, int row) {
    P(Workflow) *w = rpc_alloc(call, sizeof *w);
    INIT(workflow, w);
    w->id = wfr_s(call, r, row, WF_ID);
    w->org_id = wfr_s(call, r, row, WF_ORG);
    w->team_id = wfr_s(call, r, row, WF_TEAM);
    w->name = wfr_s(call, r, row, WF_NAME);
    w->description = wfr_s(call, r, row, WF_DESC);
    w->definition = wfr_struct(call, st_s(r, row, WF_DEF));
    w->created_by = wfr_s(call, r, row, WF_CREATED_BY);
    w->status = wfr_s(call, r, row, WF_STATUS);
    w->created_at = wfr_ts(call, r, row, WF_CREATED_AT);
    w->deleted_at = wfr_ts(call, r, row, WF_DELETED_AT);
    w->trigger_type = wfr_s(call, r, row, WF_TRIGGER_TYPE);
    w->enabled = st_b(r, row, WF_ENABLED);
    /* last_run_status, last_run_at, run_count, avg_cost_usd: "ROLLUP — WF-25 computes it;
     * 0 here" (this RPC "lays the field and returns the zero value") */
    w->updated_at = wfr_ts(call, r, row, WF_UPDATED_AT);
    w->visibility = wfr_s(call, r, row, WF_VISIBILITY);
    return w;
}

/* ---- definitions ---- */

/* Validates the definition; on success *json_out (malloc'd) is its JSON text. */
static int validate_definition(rpc_call *call, wf_engine *e, const Google__Protobuf__Struct *def,
                               const char *field, char **json_out) {
    *json_out = NULL;
    if (!def) return rpc_error(call, RPC_INVALID_ARGUMENT, "%s is required", field);
    cJSON *j = pbjson_struct_to_json(def);
    char *text = j ? cJSON_PrintUnformatted(j) : NULL;
    cJSON_Delete(j);
    if (!text) return rpc_error(call, RPC_INVALID_ARGUMENT, "%s nests too deeply", field);
    defn_violations v;
    defn_violations_init(&v);
    int rc = defn_validate(e->defn, text, strlen(text), &v);
    if (rc == DEFN_OK) {
        defn_violations_free(&v);
        *json_out = text;
        return RPC_OK;
    }
    free(text);
    if (rc != DEFN_INVALID) {
        defn_violations_free(&v);
        return rpc_error(call, RPC_INTERNAL, "definition validation failed");
    }
    char summary[600];
    defn_violations_summary(&v, summary, sizeof summary);
    defn_pb_error *pb = NULL;
    if (defn_violations_to_pb(&v, &pb) == 0) {
        rpc_error_detail(call, &pb->base);
        defn_violations_pb_free(pb);
    }
    defn_violations_free(&v);
    return rpc_error(call, RPC_INVALID_ARGUMENT, "%s is invalid: %s", field, summary);
}

static int create_workflow(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                           void *ud) {
    const P(CreateWorkflowRequest) *rq = (const void *)req;
    P(CreateWorkflowResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    char err[512], uuid[37], *def = NULL;
    db_tx *tx = NULL;
    PGresult *r = NULL;
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc) return rc;
    if (!rq->name || !rq->name[0]) return rpc_error(call, RPC_INVALID_ARGUMENT, "name is required");
    if (wfr_utf8_chars(rq->name) > NAME_MAX_CHARS)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "name must be at most %d characters",
                         NAME_MAX_CHARS);
    if (wfr_utf8_chars(rq->description) > DESC_MAX_CHARS)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "description must be at most %d characters",
                         DESC_MAX_CHARS);
    if (rq->team_id[0] && !ids_uuid_valid(rq->team_id))
        return rpc_error(call, RPC_INVALID_ARGUMENT, "team_id must be a UUID");
    const char *vis = rq->visibility[0] ? rq->visibility : "team";
    if (strcmp(vis, "team") && strcmp(vis, "private"))
        return rpc_error(call, RPC_INVALID_ARGUMENT, "visibility must be \"team\" or \"private\"");
    if ((rc = validate_definition(call, e, rq->definition, "definition", &def))) return rc;
    ids_uuid_v7(uuid);
    if ((rc = st_begin(e->pool, id->org_id, id->sub, &tx, err, sizeof err)) ||
        (rc = st_wf_insert(tx, uuid, id->org_id, rq->team_id, rq->name, rq->description, def,
                           id->sub, vis, &r, err, sizeof err)) ||
        (rc = st_audit(tx, id->org_id, id->sub, uuid, "workflow.create", "", err, sizeof err)) ||
        (rc = db_tx_commit(tx, err, sizeof err))) {
        tx = NULL;
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    tx = NULL;
    out->workflow = wf_msg(call, r, 0);
done:
    db_tx_rollback(tx);
    PQclear(r);
    free(def);
    return rc;
}

static int get_workflow(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                        void *ud) {
    const P(GetWorkflowRequest) *rq = (const void *)req;
    P(GetWorkflowResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    char err[512];
    db_tx *tx = NULL;
    PGresult *r = NULL;
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc || (rc = wfr_need_id(call, "workflow_id", rq->workflow_id))) return rc;
    if ((rc = st_begin_ex(e->pool, id->org_id, id->sub, ST_SNAPSHOT, &tx, err, sizeof err)) ||
        (rc = st_wf_get(tx, rq->workflow_id, id->sub, 0, &r, err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    if (PQntuples(r) == 0) {
        rc = rpc_error(call, RPC_NOT_FOUND, "workflow %s not found", rq->workflow_id);
        goto done;
    }
    out->workflow = wf_msg(call, r, 0);
done:
    db_tx_rollback(tx);
    PQclear(r);
    return rc;
}

static int valid_wf_status(const char *s) {
    return !strcmp(s, "draft") || !strcmp(s, "active") || !strcmp(s, "archived");
}

static int list_workflows(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                          void *ud) {
    const P(ListWorkflowsRequest) *rq = (const void *)req;
    P(ListWorkflowsResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    char err[512];
    db_tx *tx = NULL;
    PGresult *r = NULL;
    int total = 0, rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc) return rc;
    if (rq->team_id[0] && !ids_uuid_valid(rq->team_id))
        return rpc_error(call, RPC_INVALID_ARGUMENT, "team_id must be a UUID");
    if (rq->status[0] && !valid_wf_status(rq->status))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "status must be one of draft, active, archived");
    if (rq->offset < 0) return rpc_error(call, RPC_INVALID_ARGUMENT, "offset must be >= 0");
    int limit = rq->limit <= 0            ? LIST_WF_DEFAULT
                : rq->limit > LIST_WF_MAX ? LIST_WF_MAX
                                          : rq->limit;
    if ((rc = st_begin_ex(e->pool, id->org_id, id->sub, ST_SNAPSHOT, &tx, err, sizeof err)) ||
        (rc = st_wf_list(tx, id->sub, rq->team_id, rq->status, limit, rq->offset, &r, &total, err,
                         sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    int n = PQntuples(r);
    out->workflows = rpc_alloc(call, (size_t)(n ? n : 1) * sizeof *out->workflows);
    for (int i = 0; i < n; i++)
        out->workflows[i] = wf_msg(call, r, i);
    out->n_workflows = (size_t)n;
    out->total_count = total;
done:
    db_tx_rollback(tx);
    PQclear(r);
    return rc;
}

/* Opens a transaction and locks the caller's visible workflow: RPC_OK, or an error set. */
static int wf_locked(rpc_call *call, wf_engine *e, const auth_identity *id, const char *wf,
                     db_tx **tx, PGresult **r) {
    char err[512];
    int rc;
    if ((rc = st_begin(e->pool, id->org_id, id->sub, tx, err, sizeof err)) ||
        (rc = st_wf_get(*tx, wf, id->sub, 1, r, err, sizeof err)))
        return wfr_db_fail(call, rc, err);
    if (PQntuples(*r) == 0) return rpc_error(call, RPC_NOT_FOUND, "workflow %s not found", wf);
    return RPC_OK;
}

static int update_definition(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                             void *ud) {
    const P(UpdateWorkflowDefinitionRequest) *rq = (const void *)req;
    P(UpdateWorkflowDefinitionResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    char err[512], *def = NULL;
    db_tx *tx = NULL;
    PGresult *r = NULL, *r2 = NULL;
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc || (rc = wfr_need_id(call, "workflow_id", rq->workflow_id))) return rc;
    if ((rc = validate_definition(call, e, rq->definition, "definition", &def))) return rc;
    if ((rc = wf_locked(call, e, id, rq->workflow_id, &tx, &r))) goto done;
    /* run immunity: runs carry their own copy of the definition; this touches only the row */
    if ((rc = st_wf_update_def(tx, rq->workflow_id, def, &r2, err, sizeof err)) ||
        (rc = st_audit(tx, id->org_id, id->sub, rq->workflow_id, "workflow.update_definition", "",
                       err, sizeof err)) ||
        (rc = db_tx_commit(tx, err, sizeof err))) {
        tx = NULL;
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    tx = NULL;
    out->workflow = wf_msg(call, r2, 0);
done:
    db_tx_rollback(tx);
    PQclear(r);
    PQclear(r2);
    free(def);
    return rc;
}

static int update_status(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                         void *ud) {
    const P(UpdateWorkflowStatusRequest) *rq = (const void *)req;
    P(UpdateWorkflowStatusResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    char err[512];
    db_tx *tx = NULL;
    PGresult *r = NULL, *r2 = NULL;
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc || (rc = wfr_need_id(call, "workflow_id", rq->workflow_id))) return rc;
    if (!rq->status[0]) return rpc_error(call, RPC_INVALID_ARGUMENT, "status is required");
    if (!valid_wf_status(rq->status))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "status must be one of draft, active, archived");
    if ((rc = wf_locked(call, e, id, rq->workflow_id, &tx, &r))) goto done;
    if ((rc = st_wf_update_status(tx, rq->workflow_id, rq->status, &r2, err, sizeof err)) ||
        (rc = st_audit(tx, id->org_id, id->sub, rq->workflow_id, "workflow.update_status",
                       rq->status, err, sizeof err)) ||
        (rc = db_tx_commit(tx, err, sizeof err))) {
        tx = NULL;
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    tx = NULL;
    out->workflow = wf_msg(call, r2, 0);
done:
    db_tx_rollback(tx);
    PQclear(r);
    PQclear(r2);
    return rc;
}

static int set_enabled(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                       void *ud) {
    const P(SetWorkflowEnabledRequest) *rq = (const void *)req;
    P(SetWorkflowEnabledResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    char err[512], *cfg = NULL;
    db_tx *tx = NULL;
    PGresult *r = NULL, *r2 = NULL;
    int64_t next = 0;
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc || (rc = wfr_need_id(call, "workflow_id", rq->workflow_id))) return rc;
    const char *type = rq->trigger_type[0] ? rq->trigger_type : "manual";
    if (strcmp(type, "manual") && strcmp(type, "schedule"))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "trigger_type must be \"manual\" or \"schedule\"");
    int schedule = !strcmp(type, "schedule");
    if (schedule && rq->enabled && !rq->trigger_config)
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "trigger_config is required to enable a schedule trigger");
    if (schedule && rq->trigger_config) {
        cJSON *j = pbjson_struct_to_json(rq->trigger_config);
        cfg = j ? cJSON_PrintUnformatted(j) : NULL;
        cJSON_Delete(j);
        /* spec: "the RPC writes workflows.enabled / trigger_type / trigger_config": a dormant
         * schedule's config is stored as given; one that is to fire must be one this engine
         * can fire (docs/workflow-engine.md, Schedules) */
        if (!cfg || (rq->enabled &&
                     wf_schedule_next(e->pool, cfg, wf_now_ms(), &next, err, sizeof err) != 0)) {
            rc =
                rpc_error(call, RPC_INVALID_ARGUMENT, "trigger_config: %s", cfg ? err : "not JSON");
            free(cfg);
            return rc;
        }
    }
    /* enabled is the schedule-firing gate: always false for a manual workflow */
    int enabled = schedule && rq->enabled;
    if ((rc = wf_locked(call, e, id, rq->workflow_id, &tx, &r))) goto done;
    if (enabled && !strcmp(st_s(r, 0, WF_STATUS), "archived")) {
        rc = rpc_error(call, RPC_FAILED_PRECONDITION,
                       "workflow %s is archived; an archived workflow is never scheduled",
                       rq->workflow_id);
        goto done;
    }
    if ((rc = st_wf_set_trigger(tx, rq->workflow_id, enabled, type, cfg, &r2, err, sizeof err)) ||
        (rc = enabled ? st_schedule_put(tx, rq->workflow_id, id->org_id, cfg, next, err, sizeof err)
                      : st_schedule_drop(tx, rq->workflow_id, err, sizeof err)) ||
        (rc = st_audit(tx, id->org_id, id->sub, rq->workflow_id,
                       enabled ? "workflow.enable" : "workflow.disable", type, err, sizeof err)) ||
        (rc = db_tx_commit(tx, err, sizeof err))) {
        tx = NULL;
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    tx = NULL;
    out->workflow = wf_msg(call, r2, 0);
done:
    db_tx_rollback(tx);
    PQclear(r);
    PQclear(r2);
    free(cfg);
    return rc;
}

/* A deleted workflow's runs "become UNDISCOVERABLE through the workflow" (spec DeleteWorkflow):
 * each one's RunTransition, its scope now saying workflow_deleted, in the delete's transaction
 * (one event per run: the delete of a workflow with N runs writes N outbox rows). ids: the
 * runs, locked. */
static int runs_leave(db_tx *tx, const PGresult *ids, char *err, size_t errlen) {
    int rc = DB_OK;
    for (int i = 0; rc == DB_OK && i < PQntuples(ids); i++) {
        wf_run run;
        int found = 0;
        rc = wf_run_load(tx, st_s(ids, i, 0), 0, &run, &found, err, errlen); /* locked */
        if (rc == DB_OK && found && !(rc = wf_run_workflow_deleted(&run, err, errlen)))
            rc = wf_run_flush(&run, err, errlen);
        wf_run_free(&run);
    }
    return rc;
}

static int delete_workflow(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                           void *ud) {
    const P(DeleteWorkflowRequest) *rq = (const void *)req;
    (void)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    char err[512];
    db_tx *tx = NULL;
    PGresult *r = NULL, *ids = NULL;
    int deleted = 0;
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc || (rc = wfr_need_id(call, "workflow_id", rq->workflow_id))) return rc;
    /* the row is updated, not locked FOR UPDATE: a tick holds its run while it re-checks the
     * run's key on the workflow row (a key share, which FOR UPDATE blocks: that deadlocked);
     * the delete and a trigger of the workflow serialise on the store's trigger lock, so the
     * run list has every run a trigger committed */
    if ((rc = st_begin(e->pool, id->org_id, id->sub, &tx, err, sizeof err)) ||
        (rc = st_wf_get(tx, rq->workflow_id, id->sub, 0, &r, err, sizeof err)) ||
        (PQntuples(r) > 0 &&
         ((rc = st_wf_delete(tx, rq->workflow_id, &deleted, err, sizeof err)) ||
          (deleted && (rc = st_wf_run_ids(tx, rq->workflow_id, &ids, err, sizeof err)))))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    if (!deleted) { /* absent, invisible, or deleted meanwhile */
        rc = rpc_error(call, RPC_NOT_FOUND, "workflow %s not found", rq->workflow_id);
        goto done;
    }
    /* soft delete: runs, actions and logs stay, readable by id; each run tells the bus it left
     * every visible-runs set (the stream-hub's StreamVisibleRuns) */
    if ((rc = st_schedule_drop(tx, rq->workflow_id, err, sizeof err)) ||
        (rc = runs_leave(tx, ids, err, sizeof err)) ||
        (rc = st_audit(tx, id->org_id, id->sub, rq->workflow_id, "workflow.delete", "", err,
                       sizeof err)) ||
        (rc = db_tx_commit(tx, err, sizeof err))) {
        tx = NULL;
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    tx = NULL;
    wf_engine_kick_relay(e);
done:
    db_tx_rollback(tx);
    PQclear(ids);
    PQclear(r);
    return rc;
}

static int get_tool_catalog(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                            void *ud) {
    (void)req;
    P(GetToolCatalogResponse) *out = (void *)resp;
    wf_engine *e = ud;
    size_t nt, no, k = 0;
    const defn_tool *tools = defn_catalog_tools(e->defn, &nt);
    const defn_poll_observation *obs = defn_catalog_observations(e->defn, &no);
    out->tools = rpc_alloc(call, (nt ? nt : 1) * sizeof *out->tools);
    for (size_t i = 0; i < nt; i++) {
        /* gated off, or no provider mounted: omitted, not advertised */
        if (!tools[i].enabled || !wf_tool_mounted(e, tools[i].tool)) continue;
        P(ToolCatalogEntry) *t = rpc_alloc(call, sizeof *t);
        INIT(tool_catalog_entry, t);
        t->tool = (char *)tools[i].tool;
        t->description = (char *)(tools[i].description ? tools[i].description : "");
        t->actions =
            rpc_alloc(call, (tools[i].n_actions ? tools[i].n_actions : 1) * sizeof *t->actions);
        for (size_t a = 0; a < tools[i].n_actions; a++) {
            const defn_tool_action *da = &tools[i].actions[a];
            P(ToolCatalogAction) *m = rpc_alloc(call, sizeof *m);
            INIT(tool_catalog_action, m);
            m->action = (char *)da->action;
            m->description = (char *)(da->description ? da->description : "");
            m->args = rpc_alloc(call, (da->n_args ? da->n_args : 1) * sizeof *m->args);
            for (size_t g = 0; g < da->n_args; g++) {
                P(ToolCatalogArg) *ar = rpc_alloc(call, sizeof *ar);
                INIT(tool_catalog_arg, ar);
                ar->name = (char *)da->args[g].name;
                ar->type = (char *)da->args[g].type;
                ar->required = da->args[g].required;
                ar->description = (char *)(da->args[g].description ? da->args[g].description : "");
                ar->pinned_literal = da->args[g].pinned_literal;
                m->args[g] = ar;
            }
            m->n_args = da->n_args;
            t->actions[a] = m;
        }
        t->n_actions = tools[i].n_actions;
        out->tools[k++] = t;
    }
    out->n_tools = k;
    out->poll_observations = rpc_alloc(call, (no ? no : 1) * sizeof *out->poll_observations);
    for (size_t i = 0; i < no; i++) {
        P(PollObservation) *p = rpc_alloc(call, sizeof *p);
        INIT(poll_observation, p);
        p->tool = (char *)obs[i].tool;
        p->action = (char *)obs[i].action;
        p->rationale = (char *)(obs[i].rationale ? obs[i].rationale : "");
        out->poll_observations[i] = p;
    }
    out->n_poll_observations = no;
    return RPC_OK;
}

/* ---- served elsewhere ---- */

static int stream_elsewhere(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    (void)req;
    (void)ud;
    return rpc_error(call, RPC_UNIMPLEMENTED, "%s is served by stream-hub, not by workflow-engine",
                     rpc_method_path(call));
}

static int transcript_elsewhere(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                                void *ud) {
    (void)resp;
    return stream_elsewhere(call, req, ud);
}

#define SVC "/upsquad.workflow.v1.WorkflowService/"
#define D(x) &upsquad__workflow__v1__##x##__descriptor
/* Every handler but the catalogue's waits on Postgres: it runs on the blocking pool, bounded by
 * the call's deadline (libcommon/rpc.h, RPC_BLOCKING). */
#define U(name, req, resp, fn)                                                                     \
    { SVC name, RPC_UNARY, RPC_AUTH_REQUIRED, D(req), D(resp), fn, NULL, e, .flags = RPC_BLOCKING }
#define U_INLINE(name, req, resp, fn)                                                              \
    { SVC name, RPC_UNARY, RPC_AUTH_REQUIRED, D(req), D(resp), fn, NULL, e }
#define STREAM(name, req, resp)                                                                    \
    { SVC name, RPC_SERVER_STREAM, RPC_AUTH_REQUIRED, D(req), D(resp), NULL, stream_elsewhere, e }

int wf_handlers_register(rpc_server *srv, wf_engine *e) {
    const rpc_method methods[] = {
        U("CreateWorkflow", create_workflow_request, create_workflow_response, create_workflow),
        U("GetWorkflow", get_workflow_request, get_workflow_response, get_workflow),
        U("ListWorkflows", list_workflows_request, list_workflows_response, list_workflows),
        U("UpdateWorkflowDefinition", update_workflow_definition_request,
          update_workflow_definition_response, update_definition),
        U("UpdateWorkflowStatus", update_workflow_status_request, update_workflow_status_response,
          update_status),
        U("SetWorkflowEnabled", set_workflow_enabled_request, set_workflow_enabled_response,
          set_enabled),
        U("DeleteWorkflow", delete_workflow_request, delete_workflow_response, delete_workflow),
        U_INLINE("GetToolCatalog", get_tool_catalog_request, get_tool_catalog_response,
                 get_tool_catalog),
        U("TriggerWorkflow", trigger_workflow_request, trigger_workflow_response,
          wf__trigger_workflow),
        U("GetWorkflowStatus", get_workflow_status_request, get_workflow_status_response,
          wf__get_status),
        U("ListRuns", list_runs_request, list_runs_response, wf__list_runs),
        U("ListVisibleRuns", list_visible_runs_request, list_visible_runs_response,
          wf__list_visible_runs),
        U("PauseRun", pause_run_request, pause_run_response, wf__pause_run),
        U("ResumeRun", resume_run_request, resume_run_response, wf__resume_run),
        U("CancelRun", cancel_run_request, cancel_run_response, wf__cancel_run),
        U("DeliverWorkflowEvent", deliver_workflow_event_request, deliver_workflow_event_response,
          wf__deliver_event),
        U("GetNodeIO", get_node_iorequest, get_node_ioresponse, wf__get_node_io),
        U_INLINE("GetNodeTranscript", get_node_transcript_request, get_node_transcript_response,
                 transcript_elsewhere),
        STREAM("StreamRunStatus", stream_run_status_request, stream_run_status_response),
        STREAM("StreamRunLogs", stream_run_logs_request, stream_run_logs_response),
        STREAM("StreamNodeIO", stream_node_iorequest, stream_node_ioresponse),
        STREAM("StreamVisibleRuns", stream_visible_runs_request, visible_run_event),
    };
    return rpc_server_add(srv, methods, sizeof methods / sizeof methods[0]);
}
