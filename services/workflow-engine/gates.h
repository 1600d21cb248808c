/* Human gates: WorkflowService's ApproveAction, RejectAction, EscalateAction,
 * ListPendingApprovals, GetRunPrompt, AnswerRunPrompt, and upsquad.approval.v1.ApprovalService
 * (RecordDecision, GetApproval), served by the engine over its governance rows. */
#ifndef WF_GATES_H
#define WF_GATES_H

#include "rpc.h"
#include "wf.h"

/* Registers the methods; ensures the APPROVALS stream when a bus is configured. */
int wf_gates_register(rpc_server *srv, wf_engine *e);

#endif
