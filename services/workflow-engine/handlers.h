/* WorkflowService's unary RPCs (this 17) and the streaming ones answered
 * UNIMPLEMENTED (served by stream-hub). */
#ifndef WF_HANDLERS_H
#define WF_HANDLERS_H

#include "rpc.h"
#include "wf.h"

int wf_handlers_register(rpc_server *srv, wf_engine *e);

#endif
