/* Human gates' internals shared by gates.c (the doors every governance row is decided through),
 * gates_prompts.c (run prompts), gates_approval.c (the ApprovalService) and session_gates.c
 * (agent sessions' rows: the opener, their expiry, their projection). */
#ifndef WF_GATES_INT_H
#define WF_GATES_INT_H

#include <cjson/cJSON.h>
#include <libpq-fe.h>
#include <string.h>

#include "auth.h"
#include "db.h"
#include "rpc.h"
#include "store.h"
#include "run.h"
#include "upsquad/approval/v1/approval.pb-c.h"
#include "upsquad/workflow/v1/workflow.pb-c.h"
#include "wf.h"

/* One gate, loaded for a call: a run's (have_run) or a session's (session). */
typedef struct gate {
    db_tx *tx;
    wf_run run;
    int have_run;
    int session; /* an agent session's row: no run, no action */
    PGresult *r; /* GT_* row */
    cJSON *spec;
} gate;

/* ---- gates.c: one gate, loaded for a call, and the rules every door applies ---- */

#define COMMENT_MAX 1000 /* a decision's comment, in characters */

static inline const char *jstr(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static inline const char *g_kind(const gate *g) {
    return st_s(g->r, 0, GT_KIND);
}
static inline int g_floor(const gate *g) {
    return (int)st_i(g->r, 0, GT_CLEARANCE);
}
static inline int g_pending(const gate *g) {
    const char *as = st_s(g->r, 0, GT_ACT_STATUS);
    if (g->session) /* no action: the row's status, until its expiry */
        return !strcmp(st_s(g->r, 0, GT_STATUS), "pending") && !st_b(g->r, 0, GT_LAPSED);
    return !strcmp(st_s(g->r, 0, GT_STATUS), "pending") &&
           (!strcmp(as, "awaiting_approval") || !strcmp(as, "escalated"));
}
static inline const char *g_scope(const gate *g) {
    const char *a = jstr(g->spec, "answerable_by");
    return a ? a : "";
}

/* The floor and the answer scope, for this caller (not the row's state). */
static inline int g_allowed(const gate *g, const auth_identity *id) {
    if (id->clearance < g_floor(g)) return 0;
    if (!strcmp(g_scope(g), "requester") && strcmp(st_s(g->r, 0, GT_TRIGGERED_BY), id->sub))
        return 0;
    return 1;
}

/* The distinct approvers an approval gate needs (spec min_approvals; 1 when unset). */
static inline int g_min_approvals(const gate *g) {
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(g->spec, "min_approvals");
    return cJSON_IsNumber(n) && n->valueint > 1 ? n->valueint : 1;
}

/* Loads the gate named by id (by_action: an action id) in a transaction of the caller's org;
 * lock: the run row FOR UPDATE, then the row re-read under it (what a decision needs). */
int gates__open(rpc_call *call, wf_engine *e, const auth_identity *id, const char *field,
                const char *gid, int by_action, int lock, gate *g);
/* Rolls back what the call left open and frees the gate. */
void gates__free(gate *g);
/* PERMISSION_DENIED naming what this caller lacks (the floor or the answer scope). */
int gates__deny(rpc_call *call, const gate *g, const auth_identity *id);
/* Records the decision: first write wins on the governance row, then the action and the run
 * walk on. *won 0: another decision was first (nothing written). */
int gates__record(rpc_call *call, wf_engine *e, gate *g, const auth_identity *id,
                  const char *gov_status, const char *act_status, cJSON *output,
                  const char *comment, int *won, char **new_ids);
/* The row re-read in the gate's transaction: what a decision wrote, for its response. */
int gates__reread(rpc_call *call, gate *g);
/* Commits and wakes the interpreter and the relay here (any replica's tick may take it). */
int gates__commit(rpc_call *call, wf_engine *e, gate *g);
/* Before an approval gate is approved: allow_self_approval=false refuses the run's triggerer
 * (PERMISSION_DENIED); with min_approvals N > 1 each distinct member's approval is a vote, and
 * only the Nth resolves the gate. *resolved 0: this call's vote was counted (written in the
 * gate's transaction) and the gate still waits. On resolve, o gets the approvers. */
int gates__approve_rules(rpc_call *call, gate *g, const auth_identity *id, const char *comment,
                         cJSON *o, int *resolved);
/* The kinds a door does not answer, named with the door that does. */
int gates__wrong_door(rpc_call *call, const char *field, const char *kind, const char *here);

/* ---- gates_prompts.c: GetRunPrompt / AnswerRunPrompt ---- */

/* choice / text against the prompt (INVALID_ARGUMENT naming the field). */
int gates__check_prompt_answer(rpc_call *call, const gate *g, const char *choice, const char *text);
int gates__get_run_prompt(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                          void *ud);
int gates__answer_run_prompt(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                             void *ud);

/* ---- gates_approval.c: ApprovalService's RecordDecision, GetApproval ---- */

int gates__record_decision(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                           void *ud);
int gates__get_approval(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                        void *ud);

/* The gate as the ApprovalService returns it to id (in the call's arena). */
Upsquad__Approval__V1__Approval *gates__approval_msg(rpc_call *call, const gate *g,
                                                     const auth_identity *id);

/* ---- session_gates.c ---- */

/* Writes approval.decided.<org> for the GT_* row r that moved to status (decided by `by`, with
 * answer) into the outbox of tx, published under trace (the outbox row's trace_id); a
 * session's row carries its session fields and intent. */
int sgate__announce(db_tx *tx, const PGresult *r, const char *status, const char *by,
                    const cJSON *answer, const char *comment, const char *trace, char *err,
                    size_t errlen);
/* A session's pending row whose expiry passed (GT_LAPSED) is expired in tx (first write wins,
 * decided_by "timeout", announced); *lapsed 1 when this call expired it. r stays as read. */
int sgate__lapse(db_tx *tx, const PGresult *r, int *lapsed, char *err, size_t errlen);
/* A session's row as the WorkflowAction its PendingApproval and ApproveAction / RejectAction /
 * EscalateAction carry (docs/workflow-engine.md "Governance"), redacted for clearance. */
Upsquad__Workflow__V1__WorkflowAction *sgate__action_msg(rpc_call *call, const PGresult *r, int row,
                                                         int clearance);
/* ApprovalService.OpenApproval. */
int sgate__open(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud);

#endif
