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

typedef struct orch_worker_init {
    const SessionSnapshot *snapshot; /* borrowed */
    const orch_worker *avoid;        /* not this one (NULL: any) */
    const unsigned char *checkpoint; /* resume_checkpoint bytes, borrowed (NULL: fresh) */
    size_t checkpoint_len;
    int loop;       /* the checkpoint's loop_iteration */
    int timeout_ms; /* 0: 10 s */
} orch_worker_init;

/* InitWorkerSession on the least loaded live worker (its address into worker). RPC_OK;
 * RPC_UNAVAILABLE when no worker is live or the call failed (worth another try);
 * RPC_FAILED_PRECONDITION when the worker answered success=false (msg carries its
 * error_message: a checkpoint it cannot load). */
int orch_session_init_worker(orch *o, const orch_worker_init *in, char worker[128], char *msg,
                             size_t msglen);

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
