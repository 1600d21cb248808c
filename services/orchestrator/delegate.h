/* Delegation to a sub-agent (docs/orchestrator.md, "Delegation"; spec AgentEvent.delegated,
 * DelegatedEventEnvelope, PauseSource DELEGATION, SubagentLink).
 *
 * Wire shape: the worker calls the tool `delegate_to_agent` by raising interrupt_required with
 * tool_name "delegate_to_agent" and pending_tool_intent {"agent": role or agent id, "task":
 * text}, and suspends as for a gated call. The orchestrator spawns a child session of that
 * agent in the same org (its bridge row in subagent_invocations), tells the parent's stream
 * SessionPaused(DELEGATION, correlation id = the child), runs the child's turn with its events
 * relayed to the parent's stream as DelegatedEventEnvelopes, then resumes the parent's turn from
 * its frozen checkpoint with the child's outcome as the call's result (AskUserResume's
 * answer_tool_result, the re-entry contract of a decided gate). */
#ifndef UPSQUAD_ORCH_DELEGATE_H
#define UPSQUAD_ORCH_DELEGATE_H

#include <stddef.h>

#include "chat.h"

/* Runs the delegation st names for the turn t. *answer (heap): the answer_tool_result of the
 * parent's resume; worker: the worker the parent was rehydrated on; *ck (heap): its frozen
 * checkpoint. A refused delegation (unknown agent, over a limit, bad intent) is an error
 * result, not a failure. RPC status with the failure in res when the parent cannot go on
 * (terminated, no worker to resume it on). */
int orch_delegate(orch *o, rpc_call *call, const orch_chat_turn *t, const orch_chat_state *st,
                  orch_turn_result *res, char **answer, char worker[128], unsigned char **ck,
                  size_t *cklen);

#endif
