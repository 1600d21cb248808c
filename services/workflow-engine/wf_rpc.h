/* Helpers the WorkflowService and ApprovalService handlers share (handlers.c, gates.c): the
 * caller from the token, argument checks, database failures as statuses, and building
 * responses in the call's arena. */
#ifndef WF_RPC_H
#define WF_RPC_H

#include <cjson/cJSON.h>
#include <libpq-fe.h>
#include <stddef.h>

#include "auth.h"
#include "google/protobuf/struct.pb-c.h"
#include "google/protobuf/timestamp.pb-c.h"
#include "rpc.h"
#include "upsquad/workflow/v1/workflow.pb-c.h"

/* A Struct in the call's arena from a JSON object; NULL for anything else. */
Google__Protobuf__Struct *wfr_struct_json(rpc_call *call, const cJSON *obj);
/* The same from JSON text; NULL for "" or text that is not an object. */
Google__Protobuf__Struct *wfr_struct(rpc_call *call, const char *json);
/* The one redaction rule of node data (libcommon redaction.h, REDACT_PAYLOAD) applied to a JSON
 * object: every read that returns step input/output or a run context (GetNodeIO,
 * GetWorkflowStatus, ListRuns, ListVisibleRuns, ListPendingApprovals, the ApprovalService)
 * strips the top-level keys a caller of `clearance` may not see at floor (redact_floor of the
 * workflow's classification). Each removed key is added to red[0..*nred) (deduplicated, at
 * most cap, strings in the call's arena; red may be NULL). */
void wfr_redact(rpc_call *call, cJSON *obj, int clearance, int floor, const char **red,
                size_t *nred, size_t cap);
/* wfr_struct of json redacted for the calling identity (no identity: everything stripped). */
Google__Protobuf__Struct *wfr_struct_redacted(rpc_call *call, const char *json,
                                              const char *classification);
/* Column col of row as a Timestamp (NULL for SQL NULL) / a string, in the call's arena. */
Google__Protobuf__Timestamp *wfr_ts(rpc_call *call, const PGresult *r, int row, int col);
char *wfr_s(rpc_call *call, const PGresult *r, int row, int col);

/* One workflow_actions row (st_* AC_* columns) as a WorkflowAction in the call's arena. */
Upsquad__Workflow__V1__WorkflowAction *wfr_action_msg(rpc_call *call, const PGresult *r, int row);

/* Responses that aggregate payloads (GetWorkflowStatus, ListPendingApprovals, ListRuns,
 * ListVisibleRuns) stay within WFR_RESPONSE_BUDGET, under the 4 MiB that gRPC clients accept
 * by default (and so under our 16 MiB send limit): when
 * the whole response would be larger, the largest payloads among slots[0..n) (action
 * input/output, run context; NULL slots skipped) are replaced, largest first, by a marker
 * {"truncated": true, "bytes": <encoded size>, "read_with": read_with} until it fits, so the
 * page always arrives and says what it left out. Returns how many were replaced. */
#define WFR_RESPONSE_BUDGET ((size_t)7 << 19) /* 3.5 MiB */
size_t wfr_fit(rpc_call *call, const ProtobufCMessage *resp, Google__Protobuf__Struct **slots[],
               size_t n, const char *read_with);

/* A store failure as the call's status (logged with the SQLSTATE; no detail to the client). */
int wfr_db_fail(rpc_call *call, int rc, const char *err);
/* INVALID_ARGUMENT naming field unless v is a UUID. */
int wfr_need_id(rpc_call *call, const char *field, const char *v);
/* The same for the id of a gate (prompt_id, approval_id), which is the node's approval_id for
 * every kind; a blocked_by sub-kind token given instead is told where the id is. */
int wfr_need_gate_id(rpc_call *call, const char *field, const char *v);
/* Characters (code points) of valid UTF-8 text. */
size_t wfr_utf8_chars(const char *s);

#endif
