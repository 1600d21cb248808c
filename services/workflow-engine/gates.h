/* Human gates: WorkflowService's ApproveAction, RejectAction, EscalateAction,
 * ListPendingApprovals, GetRunPrompt, AnswerRunPrompt, and upsquad.approval.v1.ApprovalService
 * (RecordDecision, GetApproval, OpenApproval), served by the engine over its governance rows. */
#ifndef WF_GATES_H
#define WF_GATES_H

#include "rpc.h"
#include "wf.h"

/* Registers the methods; ensures the APPROVALS stream when a bus is configured. */
int wf_gates_register(rpc_server *srv, wf_engine *e);
/* Expires agent sessions' approvals whose timeout passed (session_gates.c); the scheduler
 * thread calls it every round. */
void wf_session_gates_sweep(wf_engine *e);

#endif
