/* The autonomous plan loop (docs/orchestrator.md, "The autonomous loop"; spec ExecutionMode
 * AUTONOMOUS: "goal → plan → step → observe → reflect → terminate ... all plan state, stall
 * detection, and termination decisions live in the orchestrator").
 *
 * One SendMessage in EXECUTION_MODE_AUTONOMOUS drives the loop as one turn: a PLAN step
 * (step_goal "decompose goal into todo plan") whose DecompositionEvent becomes the plan, then one
 * step per cycle pursuing the active todo (step_goal = its title), the cursor advanced when the
 * orchestrator confirms the todo done, until the plan completes, max_loops cycles ran, the
 * progress stalls, the caller cancels, or a step fails. The plan is stored after every cycle
 * (session_plans), so a later SendMessage on the session continues it at the same todo. */
#ifndef UPSQUAD_ORCH_AUTONOMY_H
#define UPSQUAD_ORCH_AUTONOMY_H

#include "chat.h"

/* The step_goal of the PLAN step (spec ExecuteStepRequest.step_goal). */
#define ORCH_PLAN_GOAL "decompose goal into todo plan"

/* Runs the loop for the turn t (begun: its message is the goal, or a nudge that continues an
 * unfinished plan). Holds and drops the turn's lease; stores its end. RPC status for call;
 * *parked as orch_chat_run's. */
int orch_auto_run(orch *o, rpc_call *call, const orch_chat_turn *t, int *parked);

/* The resume of the gate approval_id (gate.c: t is the turn it re-enters: its worker
 * rehydrated, the ask_user_resume of a denial or an answer). A gate a cycle parked on (the plan
 * names it) re-enters that cycle: its step carries the cycle's step_goal, the orchestrator
 * confirms its todo as any cycle's, and the plan goes on in this turn while call listens (with
 * nobody listening it stops after the cycle, reason "unattended"). Any other gate: the chat
 * turn again (orch_chat_run). RPC status for call; *parked as orch_chat_run's. */
int orch_auto_resume(orch *o, rpc_call *call, const orch_chat_turn *t, const char *approval_id,
                     int *parked);

/* RPC_OK when no turn of the session runs; else FAILED_PRECONDITION on call (one autonomous
 * loop per session: checked before the turn begins, so a refusal changes nothing). */
int orch_auto_busy(orch *o, rpc_call *call, const char *org, const char *sid);

/* The plan from a DecompositionEvent (unit-tested): titles trimmed, empty ones dropped, stable
 * sorted by ordering, at most max_todos, ids re-indexed todo-<n>; no todo left: one seed todo,
 * the goal. Returns the JSON array text [{"id", "title", "done": false}] (heap) and *n. */
char *orch_auto_plan(const Upsquad__Runtime__V1__DecompositionEvent *d, const char *goal,
                     int max_todos, int *n);

#endif
