/* Session creation and the preparation of a worker request, shared by SendMessage,
 * CreateSession and workflow agent steps. */
#ifndef UPSQUAD_ORCH_SESSION_H
#define UPSQUAD_ORCH_SESSION_H

#include "orch.h"
#include "agentdef.h"
#include "store.h"
#include "turn.h"

typedef struct orch_new_session {
    const char *org, *user, *agent_id, *model_override, *kind;
    int mode;           /* 0: the agent's default */
    const char *bearer; /* the caller's token, for model-registry (NULL: not checked) */
    int init_worker;    /* 1: InitWorkerSession on a worker first */
} orch_new_session;

/* Creates a session. On failure returns an RPC_* status with msg filled (nothing stored). */
int orch_session_start(orch *o, const orch_new_session *n, char session_id[37], char hash[65],
                       char *msg, size_t msglen);

/* Builds the ExecuteStep request of a turn in `a`: snapshot from the stored bytes (execution
 * mode overridden when mode != 0), decrypted provider keys, prior turns. *snap receives the
 * unpacked snapshot (caller frees with protobuf_c_message_free_unpacked); keys are wiped by
 * orch_request_wipe. */
int orch_request_build(orch *o, orch_arena *a, const orch_session *s, const char *message, int mode,
                       const orch_turn *turns, size_t nturns, ExecuteStepRequest **out,
                       SessionSnapshot **snap);
void orch_request_wipe(ExecuteStepRequest *r);

/* Tells a worker that a session ended (the worker of its last turn; any live one when that one
 * is gone): RuntimeService.TerminateSession, best effort, 3 s (lifecycle.c). */
void orch_session_tell_end(orch *o, const char *org, const char *worker, const char *sid,
                           const char *reason);

#endif
