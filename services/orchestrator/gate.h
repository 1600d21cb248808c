/* Human gates on the chat path (docs/orchestrator.md, "Approvals and prompts on the chat path").
 *
 * A chat turn whose worker raises interrupt_required (a gated tool call) or input_required
 * (ask_user) gets an approval or a prompt in the workflow engine's ApprovalService, opened with
 * OpenApproval under a service bearer (scope approvals.open), so it is listed, decided,
 * clearance-checked, audited and expires like a workflow's gate. The session parks on it.
 *
 * The decision comes back on approval.decided.<org> (JetStream stream APPROVALS, at least once):
 * every replica consumes the one durable `orchestrator-sessions`, stores the decision on the
 * gate, and the turn is resumed exactly once (orch_store_gate_take), preferably by the replica
 * whose SendMessage stream waits on the park (it sees the decision on its next look), else by
 * whichever replica took the message, with nobody listening. */
#ifndef UPSQUAD_ORCH_GATE_H
#define UPSQUAD_ORCH_GATE_H

#include <stddef.h>
#include <stdint.h>

#include "orch.h"
#include "store.h"

typedef struct orch_gate_ask {
    const char *org, *sid, *agent_id, *requester;
    const char *kind; /* "approval_gate" or "user_prompt" */
    const char *tool, *tool_call_id, *idempotency_key;
    const uint8_t *intent; /* approval: pending_tool_intent (borrowed) */
    size_t intent_len;
    const uint8_t *question; /* prompt: question_spec JSON (borrowed) */
    size_t question_len;
    const uint8_t *frozen; /* prompt: InputRequired.checkpoint (borrowed) */
    size_t frozen_len;
    const char *message; /* the turn's user message */
    const char *holder;  /* this replica when a stream will wait on the park, else NULL */
} orch_gate_ask;

/* Opens the approval or prompt and records the gate; approval_id out (37 bytes). RPC status
 * with msg on failure (nothing is parked then: the turn fails). */
int orch_gate_open(orch *o, const orch_gate_ask *ask, char approval_id[37], char *msg,
                   size_t msglen);

/* Resumes the turn parked on a decided gate, once: call (NULL: nobody listens) gets
 * SessionResumedEvent(resumed_by_approval) and the rest of the turn. ORCH_ESTATE when another
 * resume took it (or it is not ready); *parked as orch_chat_run's. */
int orch_gate_resume(orch *o, rpc_call *call, const char *org, const char *approval_id,
                     int *parked);

/* A worker initialised with the session's newest checkpoint (the frozen turn: nothing ran
 * since it suspended), its address into worker; *ck (heap) the checkpoint's bytes. RPC
 * status with msg. s: with its snapshot. */
int orch_gate_rehydrate(orch *o, const orch_session *s, char worker[128], unsigned char **ck,
                        size_t *cklen, char *msg, size_t msglen);

/* The decision consumer (needs the bus: UPSQUAD_NATS_URL). */
int orch_gate_start(orch *o, char *err, size_t errlen);
void orch_gate_stop(orch *o);

#endif
