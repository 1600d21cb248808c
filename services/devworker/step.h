/* One ExecuteStep: the echo reply or a script, streamed on the call (docs/devworker.md).
 *
 * Loop iterations: an iteration ends at each `tool_result`, at each `checkpoint` directive and
 * at the end of the step (when anything happened since the last one). At each end the worker
 * records the session's state (4-byte big-endian schema version + a deterministic JSON body)
 * and queues RuntimeService.Checkpoint for the orchestrator with the session's next
 * loop_iteration; a `checkpoint` directive also streams the CheckpointEvent. */
#ifndef UPSQUAD_DW_STEP_H
#define UPSQUAD_DW_STEP_H

#include "rpc.h"
#include "upsquad/runtime/v1/runtime.pb-c.h"
#include "worker.h"

/* Runs the step to its end (or until the client cancels, the session is terminated, or a
 * `crash` directive exits the process). Returns the call's status. */
int dw_step_run(dw_worker *w, rpc_call *call, const Upsquad__Runtime__V1__ExecuteStepRequest *rq);

/* The state blob for a session's iteration (prefix + body), in the call arena. body may be
 * NULL: the deterministic default body. */
int dw_state_blob(rpc_call *call, int32_t version, const char *body, uint8_t **out, size_t *len);

#endif
