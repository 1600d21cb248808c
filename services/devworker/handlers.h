/* upsquad.runtime.v1.RuntimeService, the worker side: ExecuteStep (server streaming),
 * InitWorkerSession, TerminateSession, Checkpoint (the orchestrator's "serialise and return
 * state" poll). Heartbeat is the orchestrator's to serve: UNIMPLEMENTED here.
 *
 * Auth: every method requires a token the platform's key verifies (signature, exp, aud); with
 * UPSQUAD_DEVWORKER_REQUIRE_SCOPE set, its `scope` claim (a space-separated string or an
 * array) must also contain that scope, else PERMISSION_DENIED. */
#ifndef UPSQUAD_DW_HANDLERS_H
#define UPSQUAD_DW_HANDLERS_H

#include "rpc.h"
#include "worker.h"

/* Registers the methods with w (borrowed; must outlive the server) as their state. */
int dw_handlers_register(rpc_server *srv, dw_worker *w);

/* 1 when the verified bearer in `authorization` carries scope (exposed for tests). */
int dw_token_has_scope(const char *authorization, const char *scope);

#endif
