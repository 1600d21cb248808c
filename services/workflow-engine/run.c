/* Run context and its events (run.h). */
#include "run.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bus.h"
#include "ids.h"
#include "log.h"
#include "pbjson.h"
#include "store.h"
#include "subjects.h"
#include "upsquad/internal/v1/run_events.pb-c.h"
#include "wf.h"

typedef Upsquad__Internal__V1__RunEvent RunEvent;
typedef Upsquad__Internal__V1__RunScope RunScope;

static void cp(char *dst, size_t n, const char *s) {
    snprintf(dst, n, "%s", s ? s : "");
}

int wf_run_load(db_tx *tx, const char *run_id, int lock, wf_run *r, int *found, char *err,
                size_t errlen) {
    PGresult *res = NULL;
    memset(r, 0, sizeof *r);
    *found = 0;
    int rc = st_run_load(tx, run_id, lock, &res, err, errlen);
    if (rc != DB_OK) return rc;
    return wf_run_take(tx, res, r, found);
}

int wf_run_take(db_tx *tx, PGresult *res, wf_run *r, int *found) {
    memset(r, 0, sizeof *r);
    *found = 0;
    if (PQntuples(res) == 0) goto done;
    r->tx = tx;
    cp(r->id, sizeof r->id, st_s(res, 0, RL_ID));
    cp(r->org, sizeof r->org, st_s(res, 0, RL_ORG));
    cp(r->wf, sizeof r->wf, st_s(res, 0, RL_WF));
    cp(r->triggered_by, sizeof r->triggered_by, st_s(res, 0, RL_TRIGGERED_BY));
    cp(r->status, sizeof r->status, st_s(res, 0, RL_STATUS));
    cp(r->team, sizeof r->team, st_s(res, 0, RL_TEAM));
    cp(r->visibility, sizeof r->visibility, st_s(res, 0, RL_VISIBILITY));
    cp(r->owner, sizeof r->owner, st_s(res, 0, RL_OWNER));
    cp(r->classification, sizeof r->classification, st_s(res, 0, RL_CLASSIFICATION));
    cp(r->trace, sizeof r->trace, st_s(res, 0, RL_TRACE));
    r->wf_deleted = st_b(res, 0, RL_WF_DELETED);
    r->wf_name = strdup(st_s(res, 0, RL_WF_NAME));
    r->display_name = strdup(st_s(res, 0, RL_DISPLAY));
    r->seq = r->seq_loaded = st_i(res, 0, RL_SEQ);
    r->started_ms = st_i(res, 0, RL_STARTED_AT);
    r->actions = st_i(res, 0, RL_ACTIONS);
    r->def = cJSON_Parse(st_s(res, 0, RL_DEF));
    r->context = cJSON_Parse(st_s(res, 0, RL_CONTEXT));
    if (!r->context) r->context = cJSON_CreateObject();
    *found = 1;
done:
    PQclear(res);
    return DB_OK;
}

const char *wf_run_trace(const wf_run *r) {
    const char *t = log_get_trace();
    return t && t[0] ? t : r->trace;
}

void wf_run_free(wf_run *r) {
    free(r->ev_subjects);
    free(r->ev_ids);
    free(r->ev_payloads);
    free(r->wf_name);
    free(r->display_name);
    cJSON_Delete(r->def);
    cJSON_Delete(r->context);
    memset(r, 0, sizeof *r);
}

/* Appends one element to a Postgres array literal being built ("{a,b"; closed at flush). The
 * elements (subjects, ids, hex) hold no quotes, braces, commas or backslashes. */
static int arr_add(char **buf, size_t *len, size_t *cap, const char *el, size_t n) {
    if (*len + n + 4 > *cap) {
        size_t c = *cap ? *cap * 2 : 1024;
        while (c < *len + n + 4)
            c *= 2;
        char *b = realloc(*buf, c);
        if (!b) return -1;
        *buf = b;
        *cap = c;
    }
    char sep = *len == 0 ? '{' : ',';
    (*buf)[(*len)++] = sep;
    memcpy(*buf + *len, el, n);
    *len += n;
    (*buf)[*len] = 0;
    return 0;
}

int wf_run_flush(wf_run *r, char *err, size_t errlen) {
    if (r->seq == r->seq_loaded) return DB_OK;
    if (r->n_ev == 0) {
        int rc = st_run_set_seq(r->tx, r->id, r->seq, err, errlen);
        if (rc == DB_OK) r->seq_loaded = r->seq;
        return rc;
    }
    char *arr[3] = {r->ev_subjects, r->ev_ids, r->ev_payloads};
    for (int i = 0; i < 3; i++) {
        if (arr_add(&arr[i], &r->ev_len[i], &r->ev_cap[i], "", 0)) return DB_ENOMEM;
        arr[i][r->ev_len[i] - 1] = '}'; /* the empty element's comma becomes the brace */
    }
    r->ev_subjects = arr[0], r->ev_ids = arr[1], r->ev_payloads = arr[2];
    int rc = st_events_put(r->tx, r->org, r->id, r->seq, r->ev_subjects, r->ev_ids, r->ev_payloads,
                           wf_run_trace(r), err, errlen);
    if (rc == DB_OK) r->seq_loaded = r->seq;
    r->n_ev = 0;
    r->ev_len[0] = r->ev_len[1] = r->ev_len[2] = 0;
    return rc;
}

static void scope_of(const wf_run *r, RunScope *s) {
    upsquad__internal__v1__run_scope__init(s);
    s->org_id = (char *)r->org;
    s->run_id = (char *)r->id;
    s->workflow_id = (char *)r->wf;
    s->workflow_name = r->wf_name ? r->wf_name : "";
    s->team_id = (char *)r->team;
    s->visibility = (char *)r->visibility;
    s->owner_id = (char *)r->owner;
    s->triggered_by = (char *)r->triggered_by;
    s->data_classification = (char *)r->classification;
    s->display_name = r->display_name ? r->display_name : "";
    s->workflow_deleted = r->wf_deleted;
}

/* Encodes ev with the next seq and writes it to the outbox for subject kind. */
static int put_event(wf_run *r, RunEvent *ev, const char *kind, char *err, size_t errlen) {
    RunScope scope;
    Google__Protobuf__Timestamp at;
    char subject[256], msg_id[96];
    scope_of(r, &scope);
    pbjson_ts_now(&at);
    ev->scope = &scope;
    ev->seq = ++r->seq;
    ev->at = &at;
    if (!bus_token_valid(r->org) || !bus_token_valid(r->id)) {
        snprintf(err, errlen, "run %s: ids are not subject tokens", r->id);
        return DB_EINVAL;
    }
    snprintf(subject, sizeof subject, "%s.%s.%s", kind, r->org, r->id);
    snprintf(msg_id, sizeof msg_id, "%s:%lld", r->id, (long long)ev->seq);
    size_t len = protobuf_c_message_get_packed_size(&ev->base);
    uint8_t *buf = malloc(len ? len : 1);
    char *hex = malloc(2 * len + 1);
    int rc = DB_ENOMEM;
    (void)err, (void)errlen;
    if (buf && hex) {
        protobuf_c_message_pack(&ev->base, buf);
        ids_hex(buf, len, hex);
        if (!arr_add(&r->ev_subjects, &r->ev_len[0], &r->ev_cap[0], subject, strlen(subject)) &&
            !arr_add(&r->ev_ids, &r->ev_len[1], &r->ev_cap[1], msg_id, strlen(msg_id)) &&
            !arr_add(&r->ev_payloads, &r->ev_len[2], &r->ev_cap[2], hex, 2 * len)) {
            r->n_ev++;
            rc = DB_OK;
        }
    }
    free(buf);
    free(hex);
    return rc;
}

static int prompt_kind_enum(const char *k) {
    if (!k) return UPSQUAD__WORKFLOW__V1__RUN_PROMPT_KIND__RUN_PROMPT_KIND_UNSPECIFIED;
    if (!strcmp(k, "user_prompt"))
        return UPSQUAD__WORKFLOW__V1__RUN_PROMPT_KIND__RUN_PROMPT_KIND_USER_PROMPT;
    if (!strcmp(k, "question_gate"))
        return UPSQUAD__WORKFLOW__V1__RUN_PROMPT_KIND__RUN_PROMPT_KIND_QUESTION_GATE;
    if (!strcmp(k, "approval_gate"))
        return UPSQUAD__WORKFLOW__V1__RUN_PROMPT_KIND__RUN_PROMPT_KIND_APPROVAL_GATE;
    return UPSQUAD__WORKFLOW__V1__RUN_PROMPT_KIND__RUN_PROMPT_KIND_UNSPECIFIED;
}

int wf_emit_node(wf_run *r, const wf_node_ev *n, char *err, size_t errlen) {
    RunEvent ev;
    Upsquad__Internal__V1__NodeTransition nt;
    Upsquad__Workflow__V1__NodeStatusUpdate up;
    Google__Protobuf__Timestamp at;
    upsquad__internal__v1__run_event__init(&ev);
    upsquad__internal__v1__node_transition__init(&nt);
    upsquad__workflow__v1__node_status_update__init(&up);
    pbjson_ts_now(&at);
    const char *blocked = wf_project_blocked_by(n->raw_status, n->blocked_by);
    up.run_id = r->id;
    up.node_id = (char *)n->action_id;
    up.status = (char *)wf_fold_status(n->raw_status);
    up.elapsed_ms = n->elapsed_ms;
    up.cost_usd = n->cost;
    up.blocked_by = (char *)blocked;
    up.at = &at;
    up.iteration = n->iteration;
    nt.update = &up;
    nt.step_name = (char *)n->step;
    nt.step_type = (char *)n->type;
    nt.raw_status = (char *)n->raw_status;
    /* parked on a governance row: awaiting_approval, or escalated (the same row, still open:
     * spec VisibleRunEvent.needs_approval is "a governance_approvals row ... open on the run",
     * and the snapshot's freshest open row is this one; only a decision clears it) */
    int parked =
        (!strcmp(n->raw_status, "awaiting_approval") || !strcmp(n->raw_status, "escalated")) &&
        n->prompt_kind;
    nt.needs_input = parked && !strcmp(n->prompt_kind, "user_prompt");
    nt.needs_approval = parked && strcmp(n->prompt_kind, "user_prompt") != 0;
    nt.prompt_kind = parked ? prompt_kind_enum(n->prompt_kind) : 0;
    /* spec VisibleRunEvent.prompt_id: the governance_approvals row id of the gate the run is
     * parked on, for every kind (a question's blocked_by is its sub-kind token, not the id) */
    nt.prompt_id = !parked                                ? ""
                   : n->approval && n->approval[0]        ? (char *)n->approval
                   : strcmp(blocked, "awaiting-question") ? (char *)blocked
                                                          : "";
    nt.asked_by_role = parked && n->asked_by_role ? (char *)n->asked_by_role : "";
    nt.is_waiting = !strcmp(n->raw_status, "waiting");
    nt.run_status = r->status;
    ev.event_case = UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_NODE;
    ev.node = &nt;
    return put_event(r, &ev, SUBJ_WF_STATUS, err, errlen);
}

int wf_emit_log(wf_run *r, const char *action_id, const char *level, const char *msg, char *err,
                size_t errlen) {
    RunEvent ev;
    Upsquad__Workflow__V1__RunLogLine line;
    Google__Protobuf__Timestamp t;
    int rc = st_log(r->tx, r->org, r->id, action_id, level, msg, err, errlen);
    if (rc != DB_OK) return rc;
    upsquad__internal__v1__run_event__init(&ev);
    upsquad__workflow__v1__run_log_line__init(&line);
    pbjson_ts_now(&t);
    line.run_id = r->id;
    line.node_id = (char *)(action_id ? action_id : "");
    line.level = (char *)level;
    line.message = (char *)msg;
    line.t = &t;
    ev.event_case = UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_LOG;
    ev.log = &line;
    return put_event(r, &ev, SUBJ_WF_LOG, err, errlen);
}

/* The run's RunTransition event (status now r->status, before prev), with its counters. */
static int emit_run(wf_run *r, const char *prev, const char *reason, char *err, size_t errlen) {
    RunEvent ev;
    Upsquad__Internal__V1__RunTransition rt;
    Google__Protobuf__Timestamp started, completed;
    PGresult *row = NULL;
    int rc = st_run_counts(r->tx, r->id, &row, err, errlen);
    if (rc != DB_OK) return rc;
    upsquad__internal__v1__run_event__init(&ev);
    upsquad__internal__v1__run_transition__init(&rt);
    rt.status = r->status;
    rt.previous_status = (char *)prev;
    rt.nodes_total = (int32_t)st_i(row, 0, RC_TOTAL);
    rt.nodes_done = (int32_t)st_i(row, 0, RC_DONE);
    rt.cost_usd = st_d(row, 0, RC_COST);
    pbjson_ts_from_ms(&started, st_i(row, 0, RC_STARTED_AT));
    rt.started_at = &started;
    if (!st_null(row, 0, RC_COMPLETED_AT)) {
        pbjson_ts_from_ms(&completed, st_i(row, 0, RC_COMPLETED_AT));
        rt.completed_at = &completed;
    }
    rt.reason = (char *)(reason ? reason : "");
    PQclear(row);
    ev.event_case = UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_RUN;
    ev.run = &rt;
    return put_event(r, &ev, SUBJ_WF_STATUS, err, errlen);
}

int wf_run_transition(wf_run *r, const char *status, const char *reason, char *err, size_t errlen) {
    char prev[16], msg[512];
    cp(prev, sizeof prev, r->status);
    int rc = st_run_set_status(r->tx, r->id, status, reason, err, errlen);
    if (rc != DB_OK) return rc;
    cp(r->status, sizeof r->status, status);
    if ((rc = emit_run(r, prev, reason, err, errlen)) != DB_OK) return rc;
    snprintf(msg, sizeof msg, "run %s%s%s", status, reason && reason[0] ? ": " : "",
             reason ? reason : "");
    return wf_emit_log(r, NULL, !strcmp(status, "failed") ? "ERROR" : "INFO", msg, err, errlen);
}

int wf_run_workflow_deleted(wf_run *r, char *err, size_t errlen) {
    return emit_run(r, r->status, "", err, errlen); /* the scope says why */
}

/* ---- projection rules: the spec's single source (WorkflowAction.status) ---- */

const char *wf_fold_status(const char *raw) {
    if (!strcmp(raw, "pending")) return "queued";
    if (!strcmp(raw, "in_progress")) return "running";
    if (!strcmp(raw, "awaiting_approval") || !strcmp(raw, "waiting") || !strcmp(raw, "escalated"))
        return "blocked";
    if (!strcmp(raw, "approved") || !strcmp(raw, "completed") || !strcmp(raw, "skipped"))
        return "done";
    return "failed"; /* rejected, failed */
}

int wf_raw_terminal(const char *raw) {
    return !strcmp(raw, "approved") || !strcmp(raw, "completed") || !strcmp(raw, "skipped") ||
           !strcmp(raw, "rejected") || !strcmp(raw, "failed");
}

const char *wf_project_blocked_by(const char *raw, const char *stored) {
    int parked =
        !strcmp(raw, "awaiting_approval") || !strcmp(raw, "waiting") || !strcmp(raw, "escalated");
    return parked && stored ? stored : "";
}

int wf_run_terminal(const char *status) {
    return !strcmp(status, "completed") || !strcmp(status, "failed") ||
           !strcmp(status, "cancelled");
}

int64_t wf_now_ms(void) {
    Google__Protobuf__Timestamp t;
    pbjson_ts_now(&t);
    return pbjson_ts_to_ms(&t);
}
