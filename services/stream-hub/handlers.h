/* upsquad.workflow.v1.WorkflowService, the part stream-hub serves: StreamRunStatus,
 * StreamRunLogs, StreamNodeIO, StreamVisibleRuns and GetNodeTranscript. Every method requires
 * a valid token; the org is the token's. */
#ifndef UPSQUAD_HUB_HANDLERS_H
#define UPSQUAD_HUB_HANDLERS_H

#include "hub.h"
#include "rpc.h"

/* Registers the five methods with `h` (borrowed; must outlive the server) as their state. */
int hub_handlers_register(rpc_server *srv, hub *h);

#endif
