/* Human gates' internals shared by gates.c (the doors every governance row is decided through)
 * and session_gates.c (agent sessions' rows: the opener, their expiry, their projection). */
#ifndef WF_GATES_INT_H
#define WF_GATES_INT_H

#include <cjson/cJSON.h>
#include <libpq-fe.h>

#include "auth.h"
#include "db.h"
#include "rpc.h"
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
