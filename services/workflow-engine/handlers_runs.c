/* WorkflowService: runs (TriggerWorkflow, GetWorkflowStatus, ListRuns, ListVisibleRuns), run
 * control (PauseRun, ResumeRun, CancelRun, DeliverWorkflowEvent) and GetNodeIO; the rules of
 * handlers.c hold here too (org and member from the token, ids checked first, nothing changes
 * on an error). Registered with the definitions' handlers (handlers.c). */
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

#define LIST_RUNS_DEFAULT 20
#define LIST_RUNS_MAX 100
#define REASON_MAX 1000
#define EVENT_KEY_MAX 128
#define DELIVERY_ID_MAX 256
#define EVENT_PAYLOAD_MAX (256 * 1024)

/* list_row: spec, WorkflowRun.nodes_total is "populated by ListRuns; other RPCs leave it at 0
 * since they surface action lists directly" (VisibleRunRow's run is populated "exactly as
 * ListRuns"), and nodes_done is "Populated by ListRuns (#1074). Same zero-default semantics as
 * nodes_total". */
static P(WorkflowRun) * run_msg(rpc_call *call, const PGresult *r, int row, int list_row) {
    P(WorkflowRun) *m = rpc_alloc(call, sizeof *m);
    INIT(workflow_run, m);
    m->id = wfr_s(call, r, row, RUN_ID);
    m->workflow_id = wfr_s(call, r, row, RUN_WF);
    m->org_id = wfr_s(call, r, row, RUN_ORG);
    m->triggered_by = wfr_s(call, r, row, RUN_TRIGGERED_BY);
    m->status = wfr_s(call, r, row, RUN_STATUS);
    m->context = wfr_struct_redacted(call, st_s(r, row, RUN_CONTEXT), st_s(r, row, RUN_CLASS));
    m->started_at = wfr_ts(call, r, row, RUN_STARTED_AT);
    m->completed_at = wfr_ts(call, r, row, RUN_COMPLETED_AT);
    m->created_at = wfr_ts(call, r, row, RUN_CREATED_AT);
    /* cost_usd: "Until #1127 lands this field is always 0" (the engine records every turn's
     * cost in runs.cost_usd; the contract does not surface it yet) */
    m->paused_at = wfr_ts(call, r, row, RUN_PAUSED_AT);
    m->cancelled_at = wfr_ts(call, r, row, RUN_CANCELLED_AT);
    m->nodes_total = list_row ? (int32_t)st_i(r, row, RUN_TOTAL) : 0;
    m->nodes_done = list_row ? (int32_t)st_i(r, row, RUN_DONE) : 0;
    m->display_name = wfr_s(call, r, row, RUN_DISPLAY);
    return m;
}

/* ---- runs ---- */

/* A run of the caller's org, loaded in tx (row-level security reads no other org's row).
 * RPC_OK or an error. The run-control RPCs and DeliverWorkflowEvent use it as it is: spec,
 * "There is NO per-action RBAC on this RPC, and there is none on PauseRun / CancelRun /
 * ResumeRun either ... any authenticated caller in the owning org may deliver an event to that
 * org's run, exactly as any such caller may pause, cancel or resume it". */
static int org_run(rpc_call *call, db_tx *tx, const char *run_id, int lock, wf_run *r) {
    char err[512];
    int found = 0;
    int rc = wf_run_load(tx, run_id, lock, r, &found, err, sizeof err);
    if (rc) return wfr_db_fail(call, rc, err);
    if (!found) {
        wf_run_free(r);
        return rpc_error(call, RPC_NOT_FOUND, "run %s not found", run_id);
    }
    return RPC_OK;
}

/* A run visible to the caller (its workflow's visibility), loaded in tx, for the reads. RPC_OK
 * or an error. */
static int visible_run(rpc_call *call, const auth_identity *id, db_tx *tx, const char *run_id,
                       int lock, wf_run *r) {
    int rc = org_run(call, tx, run_id, lock, r);
    if (rc) return rc;
    if (!strcmp(r->visibility, "private") && strcmp(r->owner, id->sub)) {
        wf_run_free(r);
        return rpc_error(call, RPC_NOT_FOUND, "run %s not found", run_id);
    }
    return RPC_OK;
}

static P(WorkflowRun) * run_now(rpc_call *call, db_tx *tx, const char *run_id, int *rc) {
    char err[512];
    PGresult *r = NULL;
    P(WorkflowRun) *m = NULL;
    *rc = st_run_row(tx, run_id, &r, err, sizeof err);
    if (*rc) {
        *rc = wfr_db_fail(call, *rc, err);
    } else if (PQntuples(r) == 0) {
        *rc = rpc_error(call, RPC_NOT_FOUND, "run %s not found", run_id);
    } else {
        m = run_msg(call, r, 0, 0);
    }
    PQclear(r);
    return m;
}

/* Idempotent triggers (docs/workflow-engine.md): the key is opaque to the engine; an empty one
 * is refused rather than silently ignored, as the spec does for delivery_id. */
#define WF_IDEMPOTENCY_KEY_MD "x-upsquad-idempotency-key"

static int idem_key_ok(const char *k) {
    size_t n = strlen(k);
    if (n < 1 || n > 128) return 0;
    for (size_t i = 0; i < n; i++)
        if (k[i] < 0x21 || k[i] > 0x7e) return 0;
    return 1;
}

/* Per-org admission (docs/workflow-engine.md): RESOURCE_EXHAUSTED with a google.rpc.RetryInfo
 * detail, so a flooding org is told when to come back instead of queueing unbounded work. */
static int admit_org(rpc_call *call, wf_engine *e, db_tx *tx, const char *org) {
    char err[512];
    long long active, recent;
    int rc = st_org_admission(tx, org, &active, &recent, err, sizeof err);
    if (rc) return wfr_db_fail(call, rc, err);
    int busy = active >= e->cfg->org_max_active;
    if (!busy && recent < e->cfg->org_trigger_rate) return RPC_OK;
    Google__Protobuf__Duration delay = GOOGLE__PROTOBUF__DURATION__INIT;
    Google__Rpc__RetryInfo ri = GOOGLE__RPC__RETRY_INFO__INIT;
    delay.seconds = busy ? 5 : 1;
    ri.retry_delay = &delay;
    rpc_error_detail(call, &ri.base);
    if (busy)
        return rpc_error(call, RPC_RESOURCE_EXHAUSTED,
                         "the org has %lld pending or running runs, the most it may have "
                         "(UPSQUAD_WF_ORG_MAX_ACTIVE_RUNS); retry later",
                         active);
    return rpc_error(call, RPC_RESOURCE_EXHAUSTED,
                     "the org started %lld runs in the last second, the most it may "
                     "(UPSQUAD_WF_ORG_TRIGGERS_PER_SEC); retry later",
                     recent);
}

int wf__trigger_workflow(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                         void *ud) {
    const P(TriggerWorkflowRequest) *rq = (const void *)req;
    P(TriggerWorkflowResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    char err[512], run_id[37], *ctx = NULL;
    db_tx *tx = NULL;
    PGresult *w = NULL;
    cJSON *def = NULL, *cj = NULL;
    wf_run run = {0};
    int found = 0;
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc || (rc = wfr_need_id(call, "workflow_id", rq->workflow_id))) return rc;
    const char *key = rpc_metadata(call, WF_IDEMPOTENCY_KEY_MD);
    if (key && !idem_key_ok(key))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         WF_IDEMPOTENCY_KEY_MD " must be 1 to 128 printable ASCII characters");
    cj = rq->context ? pbjson_struct_to_json(rq->context) : cJSON_CreateObject();
    if (!cj) return rpc_error(call, RPC_INVALID_ARGUMENT, "context nests too deeply");
    /* pipelined (db.h): its statements are prepared once per connection, and the writes
     * before each read go out with it */
    if ((rc = st_begin_ex(e->pool, id->org_id, id->sub, DB_TX_PIPELINE, &tx, err, sizeof err)) ||
        (rc = st_wf_def(tx, rq->workflow_id, id->sub, &w, err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    if (PQntuples(w) == 0) {
        rc = rpc_error(call, RPC_NOT_FOUND, "workflow %s not found", rq->workflow_id);
        goto done;
    }
    if (!strcmp(st_s(w, 0, WD_STATUS), "archived")) {
        rc = rpc_error(call, RPC_FAILED_PRECONDITION, "workflow %s is archived", rq->workflow_id);
        goto done;
    }
    /* the trigger context must satisfy the definition's declared trigger fields */
    def = cJSON_Parse(st_s(w, 0, WD_DEF));
    const cJSON *fields = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(def, "trigger"), "fields");
    if (fields && wf_expr_check_fields(fields, cj, "context", err, sizeof err) != 0) {
        rc = rpc_error(call, RPC_INVALID_ARGUMENT, "%s", err);
        goto done;
    }
    ctx = cJSON_PrintUnformatted(cj);
    ids_uuid_v7(run_id);
    if (key) {
        int claimed, same;
        char prior[37];
        if ((rc = st_trigger_key_claim(tx, id->org_id, key, run_id, rq->workflow_id, ctx, &claimed,
                                       prior, &same, err, sizeof err))) {
            rc = wfr_db_fail(call, rc, err);
            goto done;
        }
        if (!claimed) { /* a retry: the original run, unless the request differs */
            if (!same) {
                rc = rpc_error(call, RPC_FAILED_PRECONDITION,
                               "idempotency key \"%s\" was used for run %s of another "
                               "workflow or trigger context",
                               key, prior);
                goto done;
            }
            out->run = run_now(call, tx, prior, &rc);
            if (rc) goto done;
            rc = db_tx_commit(tx, err, sizeof err);
            tx = NULL;
            if (rc) rc = wfr_db_fail(call, rc, err);
            goto done;
        }
    }
    /* after the key: a retry of an admitted trigger answers its run even at the limits */
    if ((rc = admit_org(call, e, tx, id->org_id))) goto done;
    if ((rc = st_run_insert(tx, run_id, id->org_id, rq->workflow_id, id->sub, ctx,
                            st_s(w, 0, WD_DEF), rpc_trace_id(call), err, sizeof err)) ||
        (rc = wf_run_load(tx, run_id, 1, &run, &found, err, sizeof err)) ||
        (rc = wf_run_transition(&run, "pending", "", err, sizeof err)) ||
        (rc = wf_run_flush(&run, err, sizeof err)) ||
        (rc = st_audit(tx, id->org_id, id->sub, run_id, "run.trigger", "", err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    out->run = run_now(call, tx, run_id, &rc);
    if (rc) goto done;
    rc = db_tx_commit(tx, err, sizeof err);
    tx = NULL;
    if (rc) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    metric_inc(e->m_runs_started);
    /* the run's first line, on the trace its steps will carry (docs/libcommon.md "Traces") */
    log_set_id(LOG_ID_ORG, id->org_id);
    log_set_id(LOG_ID_RUN, run_id);
    log_info("run.triggered", "workflow %s", rq->workflow_id);
    log_clear_ids();
    wf_engine_kick(e);
done:
    db_tx_rollback(tx);
    wf_run_free(&run);
    PQclear(w);
    cJSON_Delete(def);
    cJSON_Delete(cj);
    free(ctx);
    return rc;
}

int wf__get_status(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud) {
    const P(GetWorkflowStatusRequest) *rq = (const void *)req;
    P(GetWorkflowStatusResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    char err[512];
    db_tx *tx = NULL;
    PGresult *a = NULL;
    wf_run run = {0};
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc || (rc = wfr_need_id(call, "run_id", rq->run_id))) return rc;
    /* the hot read (clients poll it): pipelined, so its reads are prepared statements */
    if ((rc = st_begin_ex(e->pool, id->org_id, id->sub, ST_SNAPSHOT | DB_TX_PIPELINE, &tx, err,
                          sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    if ((rc = visible_run(call, id, tx, rq->run_id, 0, &run))) goto done;
    if (!(out->run = run_now(call, tx, rq->run_id, &rc))) goto done;
    if ((rc = st_actions_of(tx, rq->run_id, &a, err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    int n = PQntuples(a);
    out->actions = rpc_alloc(call, (size_t)(n ? n : 1) * sizeof *out->actions);
    for (int i = 0; i < n; i++)
        out->actions[i] = wfr_action_msg(call, a, i);
    out->n_actions = (size_t)n;
    /* a long run of large steps: the page still arrives, its largest payloads marked */
    Google__Protobuf__Struct ***slots = rpc_alloc(call, ((size_t)n * 2 + 1) * sizeof *slots);
    size_t ns = 0;
    for (int i = 0; i < n; i++) {
        slots[ns++] = &out->actions[i]->input;
        slots[ns++] = &out->actions[i]->output;
    }
    slots[ns++] = &out->run->context;
    wfr_fit(call, &out->base, slots, ns, "GetNodeIO");
done:
    db_tx_rollback(tx);
    wf_run_free(&run);
    PQclear(a);
    return rc;
}

/* RunStatusFilter -> Postgres text[] of run statuses (NULL: all); -1 for an unknown value. */
static int status_filter(int f, const char **out) {
    switch (f) {
    case UPSQUAD__WORKFLOW__V1__RUN_STATUS_FILTER__RUN_STATUS_FILTER_UNSPECIFIED:
    case UPSQUAD__WORKFLOW__V1__RUN_STATUS_FILTER__RUN_STATUS_FILTER_ALL:
        *out = NULL;
        return 0;
    case UPSQUAD__WORKFLOW__V1__RUN_STATUS_FILTER__RUN_STATUS_FILTER_ACTIVE:
        *out = "{pending,running,paused}";
        return 0;
    case UPSQUAD__WORKFLOW__V1__RUN_STATUS_FILTER__RUN_STATUS_FILTER_COMPLETED:
        *out = "{completed}";
        return 0;
    case UPSQUAD__WORKFLOW__V1__RUN_STATUS_FILTER__RUN_STATUS_FILTER_FAILED:
        *out = "{failed,cancelled}";
        return 0;
    }
    return -1;
}

typedef struct page_q {
    const char *method, *workflow_id;
    int filter;
    int page_size;
    const char *token;
} page_q;

/* Runs one keyset page; rows in *res, with *n rows for this page and the next token. */
static int run_page(rpc_call *call, wf_engine *e, const auth_identity *id, db_tx *tx,
                    const page_q *q, PGresult **res, int *n, char **next) {
    char err[512], query[65], after_id[37] = "", after_us[32] = "0", fs[8],
                              teams[AUTH_MAX_TEAMS * 40 + 4];
    int64_t us = 0;
    const char *statuses;
    if (status_filter(q->filter, &statuses) != 0)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "status_filter %d is not a RunStatusFilter",
                         q->filter);
    int size = q->page_size <= 0              ? LIST_RUNS_DEFAULT
               : q->page_size > LIST_RUNS_MAX ? LIST_RUNS_MAX
                                              : q->page_size;
    snprintf(fs, sizeof fs, "%d", q->filter);
    const char *parts[] = {q->method, id->org_id, id->sub, q->workflow_id, fs};
    pagetok_query(query, parts, 5);
    if (q->token && q->token[0]) {
        if (pagetok_parse(e->page_key, query, q->token, &us, after_id) != 0)
            return rpc_error(call, RPC_INVALID_ARGUMENT, "page_token is not a token of this query");
        snprintf(after_us, sizeof after_us, "%lld", (long long)us);
    }
    size_t o = 0;
    teams[o++] = '{';
    for (size_t i = 0; i < id->n_teams; i++) {
        if (!ids_uuid_valid(id->teams[i])) continue; /* team units are UUIDs; others match none */
        o += (size_t)snprintf(teams + o, sizeof teams - o, "%s%s", o > 1 ? "," : "", id->teams[i]);
    }
    teams[o++] = '}';
    teams[o] = 0;
    int rc = st_run_page(tx, q->workflow_id, id->sub, teams, statuses, after_us, after_id, size,
                         res, err, sizeof err);
    if (rc) return wfr_db_fail(call, rc, err);
    *n = PQntuples(*res);
    *next = "";
    if (*n > size) {
        *n = size;
        char tok[PAGETOK_MAX + 1];
        if (pagetok_make(e->page_key, query, st_i(*res, size - 1, RUN_STARTED_US),
                         st_s(*res, size - 1, RUN_ID), tok, sizeof tok) == 0)
            *next = rpc_strdup(call, tok);
    }
    return RPC_OK;
}

int wf__list_runs(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud) {
    const P(ListRunsRequest) *rq = (const void *)req;
    P(ListRunsResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    char err[512];
    db_tx *tx = NULL;
    PGresult *w = NULL, *r = NULL;
    int n = 0;
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc || (rc = wfr_need_id(call, "workflow_id", rq->workflow_id))) return rc;
    if ((rc = st_begin_ex(e->pool, id->org_id, id->sub, ST_SNAPSHOT, &tx, err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    /* the workflow must exist for the caller; soft-deleted ones keep their runs listable by id */
    if ((rc = st_wf_row(tx, rq->workflow_id, &w, err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    if (PQntuples(w) == 0 || (!strcmp(st_s(w, 0, WF_VISIBILITY), "private") &&
                              strcmp(st_s(w, 0, WF_CREATED_BY), id->sub))) {
        rc = rpc_error(call, RPC_NOT_FOUND, "workflow %s not found", rq->workflow_id);
        goto done;
    }
    page_q q = {"ListRuns", rq->workflow_id, rq->status_filter, rq->page_size, rq->page_token};
    if ((rc = run_page(call, e, id, tx, &q, &r, &n, &out->next_page_token))) goto done;
    out->runs = rpc_alloc(call, (size_t)(n ? n : 1) * sizeof *out->runs);
    for (int i = 0; i < n; i++)
        out->runs[i] = run_msg(call, r, i, 1);
    out->n_runs = (size_t)n;
    Google__Protobuf__Struct ***slots = rpc_alloc(call, (size_t)(n ? n : 1) * sizeof *slots);
    for (int i = 0; i < n; i++)
        slots[i] = &out->runs[i]->context;
    wfr_fit(call, &out->base, slots, (size_t)n, "GetWorkflowStatus");
done:
    db_tx_rollback(tx);
    PQclear(w);
    PQclear(r);
    return rc;
}

static int prompt_kind(const char *k) {
    if (!strcmp(k, "user_prompt"))
        return UPSQUAD__WORKFLOW__V1__RUN_PROMPT_KIND__RUN_PROMPT_KIND_USER_PROMPT;
    if (!strcmp(k, "approval_gate"))
        return UPSQUAD__WORKFLOW__V1__RUN_PROMPT_KIND__RUN_PROMPT_KIND_APPROVAL_GATE;
    if (!strcmp(k, "question_gate"))
        return UPSQUAD__WORKFLOW__V1__RUN_PROMPT_KIND__RUN_PROMPT_KIND_QUESTION_GATE;
    return UPSQUAD__WORKFLOW__V1__RUN_PROMPT_KIND__RUN_PROMPT_KIND_UNSPECIFIED;
}

int wf__list_visible_runs(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                          void *ud) {
    const P(ListVisibleRunsRequest) *rq = (const void *)req;
    P(ListVisibleRunsResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    char err[512];
    db_tx *tx = NULL;
    PGresult *r = NULL;
    int n = 0;
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc) return rc;
    if ((rc = st_begin_ex(e->pool, id->org_id, id->sub, ST_SNAPSHOT, &tx, err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    page_q q = {"ListVisibleRuns", "", rq->status_filter, rq->page_size, rq->page_token};
    if ((rc = run_page(call, e, id, tx, &q, &r, &n, &out->next_page_token))) goto done;
    out->runs = rpc_alloc(call, (size_t)(n ? n : 1) * sizeof *out->runs);
    for (int i = 0; i < n; i++) {
        P(VisibleRunRow) *v = rpc_alloc(call, sizeof *v);
        INIT(visible_run_row, v);
        v->run = run_msg(call, r, i, 1);
        v->workflow_name = wfr_s(call, r, i, RUN_WF_NAME);
        v->display_name = wfr_s(call, r, i, RUN_DISPLAY);
        v->prompt_kind = prompt_kind(st_s(r, i, RUN_PROMPT_KIND));
        v->_open_prompt_count_case =
            UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_ROW___OPEN_PROMPT_COUNT_OPEN_PROMPT_COUNT;
        v->open_prompt_count = (int32_t)st_i(r, i, RUN_OPEN_PROMPTS);
        v->is_waiting = st_b(r, i, RUN_WAITING);
        out->runs[i] = v;
    }
    out->n_runs = (size_t)n;
    Google__Protobuf__Struct ***slots = rpc_alloc(call, (size_t)(n ? n : 1) * sizeof *slots);
    for (int i = 0; i < n; i++)
        slots[i] = &out->runs[i]->run->context;
    wfr_fit(call, &out->base, slots, (size_t)n, "GetWorkflowStatus");
done:
    db_tx_rollback(tx);
    PQclear(r);
    return rc;
}

/* ---- run control ---- */

enum { CTL_PAUSE, CTL_RESUME, CTL_CANCEL };

/* Pause, resume and cancel share their shape: validate, lock the run, apply the rule, audit
 * every call, answer with the run as it is now. */
static int run_control(rpc_call *call, wf_engine *e, int op, const char *run_id, const char *reason,
                       P(WorkflowRun) * *out) {
    static const char *const names[] = {"run.pause", "run.resume", "run.cancel"};
    const auth_identity *id;
    char err[512];
    db_tx *tx = NULL;
    wf_run run = {0};
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id), woke = 0;
    if (rc || (rc = wfr_need_id(call, "run_id", run_id))) return rc;
    if (wfr_utf8_chars(reason) > REASON_MAX)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "reason must be at most %d characters",
                         REASON_MAX);
    if ((rc = st_begin(e->pool, id->org_id, id->sub, &tx, err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    if ((rc = org_run(call, tx, run_id, 1, &run))) goto done;
    int terminal = wf_run_terminal(run.status);
    const char *outcome = "noop";
    if (op == CTL_PAUSE && !terminal && strcmp(run.status, "paused")) {
        /* takes effect at the next step boundary: no new step starts while paused */
        rc = wf_run_transition(&run, "paused", reason, err, sizeof err);
        outcome = "paused";
    } else if (op == CTL_RESUME) {
        if (terminal) {
            rc = rpc_error(call, RPC_FAILED_PRECONDITION, "run %s is %s; nothing to resume", run_id,
                           run.status);
            goto done;
        }
        if (!strcmp(run.status, "paused")) {
            if (!(rc = wf_run_transition(&run, "running", reason, err, sizeof err)))
                rc = st_queue_wake(tx, run_id, err, sizeof err);
            outcome = "resumed";
            woke = 1;
        }
    } else if (op == CTL_CANCEL && !terminal) {
        if (!(rc = wf_interp_cancel(&run, err, sizeof err)) &&
            !(rc = wf_run_transition(&run, "cancelled", reason[0] ? reason : "cancelled", err,
                                     sizeof err)))
            rc = st_queue_delete(tx, run_id, err, sizeof err);
        outcome = "cancelled";
    }
    if (rc || (rc = wf_run_flush(&run, err, sizeof err)) ||
        (rc = st_audit(tx, id->org_id, id->sub, run_id, names[op], reason[0] ? reason : outcome,
                       err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    if (!(*out = run_now(call, tx, run_id, &rc))) goto done;
    rc = db_tx_commit(tx, err, sizeof err);
    tx = NULL;
    if (rc) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    log_info("run.control", "%s run=%s org=%s by=%s outcome=%s", names[op], run_id, id->org_id,
             id->sub, outcome);
    if (op == CTL_CANCEL && !terminal) wf_engine_run_ended(e, "cancelled", run.started_ms);
    if (woke)
        wf_engine_kick(e);
    else
        wf_engine_kick_relay(e);
done:
    db_tx_rollback(tx);
    wf_run_free(&run);
    return rc;
}

int wf__pause_run(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud) {
    const P(PauseRunRequest) *rq = (const void *)req;
    return run_control(call, ud, CTL_PAUSE, rq->run_id, rq->reason,
                       &((P(PauseRunResponse) *)resp)->run);
}
int wf__resume_run(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud) {
    const P(ResumeRunRequest) *rq = (const void *)req;
    return run_control(call, ud, CTL_RESUME, rq->run_id, rq->reason,
                       &((P(ResumeRunResponse) *)resp)->run);
}
int wf__cancel_run(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud) {
    const P(CancelRunRequest) *rq = (const void *)req;
    return run_control(call, ud, CTL_CANCEL, rq->run_id, rq->reason,
                       &((P(CancelRunResponse) *)resp)->run);
}

static int key_char_ok(const char *k) {
    for (; *k; k++)
        if (!isalnum((unsigned char)*k) && !strchr("_.:-", *k)) return 0;
    return 1;
}

/* The payload is "the OPAQUE event body as JSON bytes" (spec), bound as the wait's output: one
 * JSON value and nothing after it but whitespace. cJSON_ParseWithLength stops after the first
 * value, so `{"a":1} x` would bind {"a":1} and drop the rest silently. NULL when malformed. */
static cJSON *event_payload_parse(const uint8_t *data, size_t len) {
    const char *end = NULL, *s = (const char *)data;
    cJSON *v = cJSON_ParseWithLengthOpts(s, len, &end, 0);
    if (!v) return NULL;
    for (; end < s + len; end++)
        if (!strchr(" \t\r\n", *end) || !*end) {
            cJSON_Delete(v);
            return NULL;
        }
    return v;
}

int wf__deliver_event(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                      void *ud) {
    const P(DeliverWorkflowEventRequest) *rq = (const void *)req;
    P(DeliverWorkflowEventResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    char err[512], *payload = NULL, msg[400];
    db_tx *tx = NULL;
    wf_run run = {0};
    int inserted = 0;
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc || (rc = wfr_need_id(call, "run_id", rq->run_id))) return rc;
    if (!rq->event_key[0]) return rpc_error(call, RPC_INVALID_ARGUMENT, "event_key is required");
    if (strlen(rq->event_key) > EVENT_KEY_MAX || !key_char_ok(rq->event_key))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "event_key must be 1 to %d characters of [A-Za-z0-9_.:-]", EVENT_KEY_MAX);
    if (!rq->delivery_id[0])
        return rpc_error(call, RPC_INVALID_ARGUMENT, "delivery_id is required");
    if (strlen(rq->delivery_id) > DELIVERY_ID_MAX)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "delivery_id must be at most %d bytes",
                         DELIVERY_ID_MAX);
    if (rq->payload.len > EVENT_PAYLOAD_MAX)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "payload must be at most %d bytes",
                         EVENT_PAYLOAD_MAX);
    /* an absent payload and an explicit JSON null both normalise to {} */
    cJSON *pj = rq->payload.len ? event_payload_parse(rq->payload.data, rq->payload.len)
                                : cJSON_CreateObject();
    if (!pj) return rpc_error(call, RPC_INVALID_ARGUMENT, "payload must be one JSON value");
    if (cJSON_IsNull(pj)) {
        cJSON_Delete(pj);
        pj = cJSON_CreateObject();
    }
    payload = cJSON_PrintUnformatted(pj);
    cJSON_Delete(pj);
    if ((rc = st_begin(e->pool, id->org_id, id->sub, &tx, err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    if ((rc = org_run(call, tx, rq->run_id, 1, &run))) goto done;
    /* burned durably before anything is signalled; org is the run's own */
    if ((rc = st_delivery_insert(tx, run.org, run.id, rq->event_key, rq->delivery_id, payload,
                                 &inserted, err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    if (inserted && wf_run_terminal(run.status)) {
        rc = rpc_error(call, RPC_FAILED_PRECONDITION, "run %s is %s", rq->run_id, run.status);
        goto done;
    }
    out->deduplicated = !inserted;
    if (inserted) {
        snprintf(msg, sizeof msg, "event %s delivered (delivery %.200s)", rq->event_key,
                 rq->delivery_id);
        if ((rc = st_queue_wake(tx, run.id, err, sizeof err)) ||
            (rc = wf_emit_log(&run, NULL, "INFO", msg, err, sizeof err)) ||
            (rc = wf_run_flush(&run, err, sizeof err)) ||
            (rc = st_audit(tx, run.org, id->sub, run.id, "run.deliver_event", rq->event_key, err,
                           sizeof err))) {
            rc = wfr_db_fail(call, rc, err);
            goto done;
        }
    }
    if (!(out->run = run_now(call, tx, rq->run_id, &rc))) goto done;
    rc = db_tx_commit(tx, err, sizeof err);
    tx = NULL;
    if (rc) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    if (inserted) wf_engine_kick(e);
done:
    db_tx_rollback(tx);
    wf_run_free(&run);
    free(payload);
    return rc;
}

/* ---- GetNodeIO redaction (docs/workflow-engine.md, "Node I/O redaction") ---- */

int wf__get_node_io(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud) {
    const P(GetNodeIORequest) *rq = (const void *)req;
    P(GetNodeIOResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    char err[512];
    db_tx *tx = NULL;
    PGresult *a = NULL;
    wf_run run = {0};
    cJSON *in = NULL, *o = NULL;
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc || (rc = wfr_need_id(call, "run_id", rq->run_id)) ||
        (rc = wfr_need_id(call, "node_id", rq->node_id)))
        return rc;
    if ((rc = st_begin_ex(e->pool, id->org_id, id->sub, ST_SNAPSHOT, &tx, err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    if ((rc = visible_run(call, id, tx, rq->run_id, 0, &run))) goto done;
    if ((rc = st_action_get(tx, rq->run_id, rq->node_id, &a, err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    if (PQntuples(a) == 0) {
        rc = rpc_error(call, RPC_NOT_FOUND, "node %s not found in run %s", rq->node_id, rq->run_id);
        goto done;
    }
    in = cJSON_Parse(st_s(a, 0, AC_INPUT));
    /* spec GetNodeIOResponse.output: "Empty if the node has not produced output yet (queued /
     * running / blocked)". What a node in those states holds is work in progress (a redone
     * agent step's rejected output, a loop container's laps so far, a poll wait's last
     * observation), not its output: only a resolved node answers one. */
    o = wf_raw_terminal(st_s(a, 0, AC_STATUS)) ? cJSON_Parse(st_s(a, 0, AC_OUTPUT)) : NULL;
    size_t cap = (size_t)cJSON_GetArraySize(in) + (size_t)cJSON_GetArraySize(o) + 1, nred = 0;
    const char **red = rpc_alloc(call, cap * sizeof *red);
    int floor = redact_floor(run.classification);
    wfr_redact(call, in, id->clearance, floor, red, &nred, cap);
    wfr_redact(call, o, id->clearance, floor, red, &nred, cap);
    out->input = cJSON_IsObject(in) ? wfr_struct_json(call, in) : NULL;
    out->output = cJSON_IsObject(o) ? wfr_struct_json(call, o) : NULL;
    out->redacted_fields = (char **)red;
    out->n_redacted_fields = nred;
done:
    db_tx_rollback(tx);
    wf_run_free(&run);
    PQclear(a);
    cJSON_Delete(in);
    cJSON_Delete(o);
    return rc;
}
