/* Internals shared by the WorkflowService handler files: the run handlers (handlers_runs.c)
 * that handlers.c registers. */
#ifndef WF_HANDLERS_INT_H
#define WF_HANDLERS_INT_H

#include "rpc.h"

int wf__trigger_workflow(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                         void *ud);
int wf__get_status(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud);
int wf__list_runs(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud);
int wf__list_visible_runs(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                          void *ud);
int wf__pause_run(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud);
int wf__resume_run(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud);
int wf__cancel_run(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud);
int wf__deliver_event(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                      void *ud);
int wf__get_node_io(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud);

#endif
