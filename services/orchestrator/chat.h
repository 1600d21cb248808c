/* One chat turn relayed to its caller, and the wait of a stream on a parked session
 * (docs/orchestrator.md, "SendMessage" and "Approvals and prompts on the chat path").
 *
 * Shared by SendMessage (a fresh turn) and the resume of a turn parked on a human gate (the
 * same turn re-entered from its frozen checkpoint: gate.c). A turn's worker events are relayed
 * (relay.c), audited, and its end stored; an interrupt_required or input_required opens an
 * approval or prompt through the workflow engine's ApprovalService (gate.c) and parks the
 * session on it at the turn's end. */
#ifndef UPSQUAD_ORCH_CHAT_H
#define UPSQUAD_ORCH_CHAT_H

#include <stdint.h>

#include "orch.h"
#include "store.h"
#include "turn.h"
#include "upsquad/runtime/v1/runtime.pb-c.h"

/* An autonomous cycle's step (autonomy.c): its ExecuteStepRequest.step_goal, a look at every
 * worker event before it is relayed, and its CompletionEvent kept back (the loop tells its own
 * end). */
typedef struct orch_chat_step {
    const char *goal;
    void (*observe)(void *ud, const Upsquad__Runtime__V1__ExecuteStepEvent *ev);
    void *ud;
    int hold_completion;
} orch_chat_step;

/* A delegated child's identity on its parent's stream (a chain: outer is the parent's own
 * envelope when the parent is itself a child; NULL at the root). */
typedef struct orch_envelope {
    const char *child_session_id, *child_agent_id, *invocation_id;
    const struct orch_envelope *outer;
} orch_envelope;

/* The tool a worker calls to delegate (docs/orchestrator.md, "Delegation"). */
#define ORCH_DELEGATE_TOOL "delegate_to_agent"

typedef struct orch_chat_turn {
    const char *org, *sid;
    const orch_session *s; /* borrowed: the session row with its snapshot */
    const char *requester; /* the member whose turn it is (a gate's requested_by) */
    const char *message;
    int mode; /* ExecutionMode of the request; 0 keeps the session's */
    const orch_turn *turns;
    size_t nturns;
    /* the turn's audit row (message_received, or session_resumed on a resume): the parent of
     * what it does and the name of its lease, held here while the turn runs */
    const char *parent;
    const char *prefer_worker; /* a resume runs where it was rehydrated ("" or NULL: any) */
    /* a resume of a gate answered otherwise than by running the call (a denial, a prompt's
     * answer): ExecuteStepRequest.ask_user_resume; NULL on a fresh turn or an approved call */
    const Upsquad__Runtime__V1__AskUserResume *resume;
    int64_t timeout_ms;
    const orch_chat_step *step; /* NULL: a chat turn */
    const orch_envelope *env;   /* a delegated child's turn on its parent's stream, or NULL */
} orch_chat_turn;

/* What a step leaves for its turn's end. */
typedef struct orch_chat_state {
    char approval_id[37]; /* the gate its interrupt / ask_user opened ("" none) */
    char gated_tool[129];
    char question[256];
    int error_relayed;
    int64_t started_ms;
    char deleg_call[65]; /* a delegate_to_agent call the worker suspended on */
    char *deleg_intent;  /* its intent JSON (heap: orch_chat_state_clear) */
    int deleg_gate;      /* a delegation waiting for its approval: parks DELEGATION_APPROVAL */
    char worker[128];    /* the worker of the step */
} orch_chat_state;
void orch_chat_state_clear(orch_chat_state *st);

/* An AgentEvent on call, wrapped in one DelegatedEventEnvelope per level of env. */
int orch_chat_send(rpc_call *call, const orch_envelope *env, Upsquad__Runtime__V1__AgentEvent *ae);

/* The steps of a turn: orch_chat_exec, and while a step delegates, the child's turn and the
 * same turn again with the child's result (delegate.c). res and st as orch_chat_exec's. */
int orch_chat_steps(orch *o, rpc_call *call, const orch_chat_turn *t, orch_turn_result *res,
                    orch_chat_state *st);

/* One ExecuteStep of a turn already begun (the caller holds its lease), relayed to call; st and
 * res (orch_turn_result_clear) for the turn's end. RPC status for call. */
int orch_chat_exec(orch *o, rpc_call *call, const orch_chat_turn *t, orch_turn_result *res,
                   orch_chat_state *st);
/* The turn's end from its last step's result: stored, a gate's park committed and told. */
int orch_chat_finish(orch *o, rpc_call *call, const orch_chat_turn *t, orch_turn_result *res,
                     const orch_chat_state *st, int *parked);

/* Runs t on a worker; call (NULL: nobody listens: the turn goes to the session's history
 * only) gets the relayed events. Stores the turn's end (parking the session on a gate it
 * opened). *parked 1 when the session is suspended at its end (a gate, or a pause that was
 * pending) and its SessionPausedEvent went to call. Returns the RPC status for call. */
int orch_chat_run(orch *o, rpc_call *call, const orch_chat_turn *t, int *parked);

/* spec SessionPausedEvent: the stream stays open until a SessionResumedEvent or the session's
 * end. Waits on the parked session (at most UPSQUAD_PAUSED_STREAMS per replica, within the
 * caller's deadline); a gate decided meanwhile is resumed on this stream (the rest of the turn
 * follows its SessionResumedEvent, and it may park again). */
void orch_chat_park(orch *o, rpc_call *call, const char *org, const char *sid);

/* A StatusEvent (THINKING, detail, pending_pause) on call, wrapped per env. */
int orch_chat_send_status(rpc_call *call, const orch_envelope *env, const char *detail,
                          int pending_pause);
/* A SessionPausedEvent for a pause (committed, or a delegation's wait) on call, wrapped per
 * env; paused_ms 0: now. */
int orch_chat_send_paused(rpc_call *call, const orch_envelope *env, const orch_pause *pz);
/* A SessionResumedEvent on call, wrapped per env; resumed_ms 0: now; approval_id non-empty:
 * resumed by that approval's decision. */
void orch_chat_send_resumed(rpc_call *call, const orch_envelope *env, int64_t resumed_ms,
                            int resumed_loop, const char *approval_id);
/* An ErrorEvent on call (within a delegated child's turn, wrapped in env like its other
 * events: spec, a child's events reach the parent only inside a DelegatedEventEnvelope). */
void orch_chat_send_error(rpc_call *call, const orch_envelope *env, const char *code,
                          const char *message, int retryable);

#endif
